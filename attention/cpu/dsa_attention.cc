// DSA sparse latent attention on the CPU (absorbed MLA: one latent c shared by all heads, value = c[:, :Dv]):
// forward over the selected positions inside one latent block, backward with the final lse, and the head-summed
// probabilities used by the indexer loss. See attention/dsa.h for the math and the block protocol.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "attention/cpu/dsa_common.h"
#include "attention/cpu/dsa_cpu.h"
#include "attention/cpu/scratch.h"

namespace seqpar::attn::cpu {
namespace {

using namespace dsa_detail;
using AttnShape = DsaAttentionShape;

// Loads `n` elements at element offset `at` of any floating tensor as Acc.
template <typename Acc>
void load_any(const TensorView& t, std::int64_t at, std::int64_t n, Acc* dst) {
  dispatch_floating(t.dtype(), [&](auto tag) {
    using T = decltype(tag);
    load_row(static_cast<const T*>(t.data()) + at, dst, n);
  });
}

// lse [B, H, Sq]: the accumulator dtype Acc, or fp64 for any inputs (attention/dsa.h). Read as fp64; written from the
// row's max and sum, in fp64 when lse is fp64 (so that no fp32 rounding of lse, eps * |lse|, enters a merge).
template <typename Acc>
struct LseArray {
  void* data;
  bool wide;  // fp64
  explicit LseArray(const TensorView& t) : data(t.data()), wide(t.dtype() == DType::kFloat64) {}
  double operator[](std::int64_t i) const {
    return wide ? static_cast<const double*>(data)[i] : static_cast<double>(static_cast<const Acc*>(data)[i]);
  }
  void set(std::int64_t i, Acc max, Acc sum) const {
    if (wide) {
      static_cast<double*>(data)[i] = static_cast<double>(max) + std::log(static_cast<double>(sum));
    } else {
      static_cast<Acc*>(data)[i] = max + std::log(sum);
    }
  }
  void set_empty(std::int64_t i) const {
    if (wide) {
      static_cast<double*>(data)[i] = neg_inf<double>();
    } else {
      static_cast<Acc*>(data)[i] = neg_inf<Acc>();
    }
  }
};

// p = exp(scaled score - lse) with the difference taken in fp64 (lse may be fp64 for fp32 inputs), then in Acc.
template <typename Acc>
inline Acc prob(Acc scaled_score, double lse) {
  return std::exp(static_cast<Acc>(static_cast<double>(scaled_score) - lse));
}

// The most positions of one row that can lie inside the block: min(k, Sk).
inline std::int64_t max_selected(const AttnShape& s) { return std::min(s.K, s.Sk); }

// The local indices (into the block) and slots of the selected positions of row r inside the block; m and slot
// hold max_selected(s) entries. Returns their number.
inline std::int64_t collect_selected(const AttnShape& s, const std::int64_t* idx, std::int64_t r,
                                     std::span<std::int64_t> m, std::span<std::int64_t> slot) {
  std::int64_t n = 0;
  for_each_selected_in_block(idx + r * s.K, s.valid[static_cast<std::size_t>(r)], s.c_pos,
                             [&](std::int64_t sl, std::int64_t mm) {
                               slot[n] = sl;
                               m[n++] = mm;
                             });
  return n;
}

// Loads query row r (batch b) and its n selected latent rows sel[0..n) into qrow [H, Dqk] and gath [n, Dqk], then
// for each tile of up to kTile of them fills cT (the tile transposed) and tile [H, kTile] = q_h . c_j, and calls
// fn(j0, nj, rows) with the tile's first index, its size and its gathered rows.
template <typename T, typename Acc, typename Fn>
void for_each_selected_tile_scores(const T* q, const T* c, const AttnShape& s, std::int64_t b, std::int64_t r,
                                   std::span<const std::int64_t> sel, std::int64_t n, std::span<Acc> qrow,
                                   std::span<Acc> gath, std::span<Acc> cT, std::span<Acc> tile, Fn&& fn) {
  const std::int64_t H = s.H, Dqk = s.Dqk;
  load_row(q + r * H * Dqk, qrow.data(), H * Dqk);
  for (std::int64_t j = 0; j < n; ++j) load_row(c + (b * s.Sk + sel[j]) * Dqk, gath.data() + j * Dqk, Dqk);
  const Acc* rows[kTile];
  for (std::int64_t j0 = 0; j0 < n; j0 += kTile) {
    const std::int64_t nj = std::min(kTile, n - j0);
    for (std::int64_t j = 0; j < nj; ++j) rows[j] = gath.data() + (j0 + j) * Dqk;
    load_tile_transposed(rows, nj, Dqk, cT.data());
    dot_tile(qrow.data(), H, Dqk, cT.data(), tile.data());
    fn(j0, nj, rows);
  }
}

template <typename T>
void forward_impl(const DsaAttentionArgs& a, const AttnShape& s, const TensorView& out, const TensorView& lse) {
  using Acc = acc_t<T>;
  const std::int64_t H = s.H, Dqk = s.Dqk, Dv = s.Dv;
  const T* q = static_cast<const T*>(a.q.data());
  const T* c = static_cast<const T*>(a.c.data());
  const std::int64_t* idx = static_cast<const std::int64_t*>(a.topk_indices.data());
  const LseArray<Acc> lse_out(lse);
  const std::int64_t rows = s.B * s.Sq, nmax = max_selected(s);
  const WorkerScratch<std::int64_t> iws({nmax, nmax}, "dsa_attention_forward scratch");
  const WorkerScratch<Acc> ws({H * Dqk, nmax * Dqk, H * nmax, H * Dv, H, H, kTile * Dqk, kTile * H},
                              "dsa_attention_forward scratch");
#pragma omp parallel
  {
    const std::span<std::int64_t> sel = iws.buffer(0), slots = iws.buffer(1);
    const std::span<Acc> qrow = ws.buffer(0), gath = ws.buffer(1), score = ws.buffer(2), o = ws.buffer(3),
                         mx = ws.buffer(4), sum = ws.buffer(5), cT = ws.buffer(6), tile = ws.buffer(7);
#pragma omp for schedule(dynamic, 2)
    for (std::int64_t r = 0; r < rows; ++r) {
      const std::int64_t b = r / s.Sq, t = r % s.Sq;
      const std::int64_t n = collect_selected(s, idx, r, sel, slots);
      std::fill(o.begin(), o.end(), Acc(0));
      if (n == 0) {
        for (std::int64_t h = 0; h < H; ++h) lse_out.set_empty((b * H + h) * s.Sq + t);
        store_row(out, r * H * Dv, o.data(), H * Dv, false);
        continue;
      }
      // scores [H, n], a tile of kTile latent rows (transposed) against all heads at a time
      for_each_selected_tile_scores(q, c, s, b, r, sel, n, qrow, gath, cT, tile,
                                    [&](std::int64_t j0, std::int64_t nj, const Acc* const*) {
                                      for (std::int64_t h = 0; h < H; ++h) {
                                        for (std::int64_t j = 0; j < nj; ++j) {
                                          score[h * n + j0 + j] = Acc(s.scale) * tile[h * kTile + j];
                                        }
                                      }
                                    });
      for (std::int64_t h = 0; h < H; ++h) {
        Acc m = score[h * n];
        for (std::int64_t j = 1; j < n; ++j) m = std::max(m, score[h * n + j]);
        Acc z = 0;
        for (std::int64_t j = 0; j < n; ++j) {
          const Acc e = std::exp(score[h * n + j] - m);
          score[h * n + j] = e;
          z += e;
        }
        mx[h] = m;
        sum[h] = z;
      }
      for (std::int64_t j0 = 0; j0 < n; j0 += kTile) {  // a tile of latent rows stays in cache across heads
        const std::int64_t j1 = std::min(n, j0 + kTile);
        for (std::int64_t h = 0; h < H; ++h) {
          for (std::int64_t j = j0; j < j1; ++j) axpy(score[h * n + j], gath.data() + j * Dqk, o.data() + h * Dv, Dv);
        }
      }
      for (std::int64_t h = 0; h < H; ++h) {
        const Acc inv = Acc(1) / sum[h];
        for (std::int64_t d = 0; d < Dv; ++d) o[h * Dv + d] *= inv;
        lse_out.set((b * H + h) * s.Sq + t, mx[h], sum[h]);
      }
      store_row(out, r * H * Dv, o.data(), H * Dv, false);
    }
  }
}

// Shared by the backward and dsa_attention_probs. Query pass: per row, p (and with dout, ds and dq) over the selected
// pairs inside the block; probs (optional) gets sum_h p per slot. Key pass (with dout): dc per block latent row.
template <typename T>
void backward_impl(const DsaAttentionArgs& a, const AttnShape& s, const TensorView& lse_t, const TensorView& dout_t,
                   const TensorView& delta_t, const TensorView& dq_t, const TensorView& dc_t, bool accumulate,
                   const TensorView& probs_t) {
  using Acc = acc_t<T>;
  const std::int64_t H = s.H, Dqk = s.Dqk, Dv = s.Dv, Sq = s.Sq;
  const bool want_grad = !absent(dout_t);
  const T* q = static_cast<const T*>(a.q.data());
  const T* c = static_cast<const T*>(a.c.data());
  const std::int64_t* idx = static_cast<const std::int64_t*>(a.topk_indices.data());
  const LseArray<Acc> lse(lse_t);
  const Acc* delta = static_cast<const Acc*>(delta_t.data());
  Acc* probs = static_cast<Acc*>(probs_t.data());
  const std::int64_t rows = s.B * Sq;
  const Acc scale = Acc(s.scale);
  const std::int64_t nmax = max_selected(s);

  const WorkerScratch<std::int64_t> iws({nmax, nmax}, "dsa_attention_backward query scratch");
  const WorkerScratch<Acc> qws({H * Dqk, H * Dv, nmax * Dqk, H * nmax, H * Dqk, kTile * Dqk, kTile * H, kTile * H},
                               "dsa_attention_backward query scratch");
  const WorkerScratch<double> lws({H}, "dsa_attention_backward lse scratch");  // used by one pass at a time
#pragma omp parallel
  {
    const std::span<std::int64_t> sel = iws.buffer(0), slots = iws.buffer(1);
    const std::span<Acc> qrow = qws.buffer(0), dorow = qws.buffer(1), gath = qws.buffer(2), p = qws.buffer(3),
                         dq = qws.buffer(4), cT = qws.buffer(5), tile = qws.buffer(6), dptile = qws.buffer(7);
    const std::span<double> lse_r = lws.buffer(0);
#pragma omp for schedule(dynamic, 2)
    for (std::int64_t r = 0; r < rows; ++r) {
      const std::int64_t b = r / Sq, t = r % Sq;
      const std::int64_t n = collect_selected(s, idx, r, sel, slots);
      std::fill(dq.begin(), dq.end(), Acc(0));
      if (n > 0) {
        if (want_grad) load_any(dout_t, r * H * Dv, H * Dv, dorow.data());
        for (std::int64_t h = 0; h < H; ++h) lse_r[h] = lse[(b * H + h) * Sq + t];
        for_each_selected_tile_scores(
            q, c, s, b, r, sel, n, qrow, gath, cT, tile, [&](std::int64_t j0, std::int64_t nj, const Acc* const* rowp) {
              if (want_grad) dot_tile(dorow.data(), H, Dv, cT.data(), dptile.data());  // rows d < Dv of cT: the value
              for (std::int64_t h = 0; h < H; ++h) {
                const bool dead = std::isinf(lse_r[h]);
                for (std::int64_t j = 0; j < nj; ++j) {
                  const Acc pj = dead ? Acc(0) : prob(scale * tile[h * kTile + j], lse_r[h]);
                  p[h * n + j0 + j] = pj;
                  if (want_grad && pj != Acc(0)) {
                    const Acc ds = pj * (dptile[h * kTile + j] - delta[(b * H + h) * Sq + t]);
                    axpy(scale * ds, rowp[j], dq.data() + h * Dqk, Dqk);
                  }
                }
              }
            });
        if (probs != nullptr) {
          for (std::int64_t j = 0; j < n; ++j) {
            Acc ps = 0;
            for (std::int64_t h = 0; h < H; ++h) ps += p[h * n + j];
            probs[r * s.K + slots[j]] = ps;
          }
        }
      }
      if (want_grad) store_row(dq_t, r * H * Dqk, dq.data(), H * Dqk, accumulate);
    }
  }
  if (!want_grad) return;

  // Keys: dc of each block latent row, summed over its selecting queries in increasing (b, t) (see KeyOwner).
  const Tensor dc_acc_owner =
      zeroed_workspace({s.B * s.Sk * Dqk}, dtype_v<Acc>, "dsa_attention_backward dc accumulator");
  Acc* const dc_acc = static_cast<Acc*>(dc_acc_owner.data());
  const bool dout_in_place = dout_t.dtype() == dtype_v<Acc>;
  const WorkerScratch<Acc> kws({H * Dqk, H * Dv, kTile * Dqk, kTile * H, kTile * H, H},
                               "dsa_attention_backward key scratch");
#pragma omp parallel
  {
    const KeyOwner mine;
    const std::span<Acc> qrow = kws.buffer(0), dorow = kws.buffer(1), cT = kws.buffer(2), tile = kws.buffer(3),
                         dptile = kws.buffer(4), delta_r = kws.buffer(5);
    const std::span<double> lse_r = lws.buffer(0);
    const T* crows[kTile];
    for (std::int64_t r = 0; r < rows; ++r) {
      const std::int64_t b = r / Sq, t = r % Sq;
      const Acc* qr = nullptr;
      const Acc* dr = nullptr;
      for_each_selected_tile(
          idx + r * s.K, s.valid[static_cast<std::size_t>(r)], s.c_pos, mine,
          [&](const std::int64_t*, const std::int64_t* keys, std::int64_t n) {
            if (qr == nullptr) {  // the query row as Acc: in place for fp32 / fp64 storage, converted otherwise
              if constexpr (std::is_same_v<T, Acc>) {
                qr = q + r * H * Dqk;
              } else {
                load_row(q + r * H * Dqk, qrow.data(), H * Dqk);
                qr = qrow.data();
              }
              if (dout_in_place) {
                dr = static_cast<const Acc*>(dout_t.data()) + r * H * Dv;
              } else {
                load_any(dout_t, r * H * Dv, H * Dv, dorow.data());
                dr = dorow.data();
              }
              for (std::int64_t h = 0; h < H; ++h) {
                lse_r[h] = lse[(b * H + h) * Sq + t];
                delta_r[h] = delta[(b * H + h) * Sq + t];
              }
            }
            for (std::int64_t j = 0; j < n; ++j) crows[j] = c + (b * s.Sk + keys[j]) * Dqk;
            load_tile_transposed(crows, n, Dqk, cT.data());
            dot_tile(qr, H, Dqk, cT.data(), tile.data());
            dot_tile(dr, H, Dv, cT.data(), dptile.data());
            for (std::int64_t j = 0; j < n; ++j) {
              Acc* dc = dc_acc + (b * s.Sk + keys[j]) * Dqk;
              for (std::int64_t h = 0; h < H; ++h) {
                if (std::isinf(lse_r[h])) continue;
                const Acc pj = prob(scale * tile[h * kTile + j], lse_r[h]);
                if (pj == Acc(0)) continue;
                const Acc ds = pj * (dptile[h * kTile + j] - delta_r[h]);
                axpy(scale * ds, qr + h * Dqk, dc, Dqk);
                axpy(pj, dr + h * Dv, dc, Dv);
              }
            }
          });
    }
  }
  const std::int64_t keys = s.B * s.Sk;
#pragma omp parallel for schedule(static)
  for (std::int64_t km = 0; km < keys; ++km) store_row(dc_t, km * Dqk, dc_acc + km * Dqk, Dqk, accumulate);
}

// delta [B, H, Sq] of dtype D (fp32 or fp64): the dot products in D.
template <typename D>
void delta_impl(const TensorView& out, const TensorView& dout, const TensorView& delta_t) {
  const std::int64_t B = out.dim(0), Sq = out.dim(1), H = out.dim(2), Dv = out.dim(3);
  D* delta = static_cast<D*>(delta_t.data());
  const WorkerScratch<D> ws({Dv, Dv}, "dsa_attention_delta scratch");
#pragma omp parallel
  {
    const std::span<D> o = ws.buffer(0), g = ws.buffer(1);
#pragma omp for schedule(static)
    for (std::int64_t r = 0; r < B * Sq; ++r) {
      const std::int64_t b = r / Sq, t = r % Sq;
      for (std::int64_t h = 0; h < H; ++h) {
        const std::int64_t at = (r * H + h) * Dv;
        load_any(out, at, Dv, o.data());
        load_any(dout, at, Dv, g.data());
        delta[(b * H + h) * Sq + t] = dot(o.data(), g.data(), Dv);
      }
    }
  }
}

}  // namespace

void dsa_attention_forward_cpu(const DsaAttentionArgs& args, const DsaAttentionShape& s, const TensorView& out,
                               const TensorView& lse) {
  dispatch_floating(args.q.dtype(), [&](auto tag) { forward_impl<decltype(tag)>(args, s, out, lse); });
}

void dsa_attention_delta_cpu(const TensorView& out, const TensorView& dout, const TensorView& delta) {
  dispatch_acc(delta.dtype(), [&](auto tag) { delta_impl<decltype(tag)>(out, dout, delta); });
}

void dsa_attention_backward_cpu(const DsaAttentionArgs& args, const DsaAttentionShape& s, const TensorView& lse,
                                const TensorView& dout, const TensorView& delta, const TensorView& dq,
                                const TensorView& dc, bool accumulate, const TensorView& probs) {
  dispatch_floating(args.q.dtype(), [&](auto tag) {
    backward_impl<decltype(tag)>(args, s, lse, dout, delta, dq, dc, accumulate, probs);
  });
}

}  // namespace seqpar::attn::cpu
