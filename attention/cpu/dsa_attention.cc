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

// The per-row products run over tiles of at most kLatentTile selected latent rows. Each tile is read from c once,
// into g [m, Qp] (rows as Acc, zero padded to Qp = pad16(Dqk) columns; the first Dv columns are the values), and
// transposed from there into gT [Dqk, pad16(m)] (for the products with q and dout); both stay in the core's L2.
inline constexpr std::int64_t kLatentTile = 128;

// Width of the per-thread tile buffers for rows with at most nmax selected positions.
inline std::int64_t latent_tile(std::int64_t nmax) { return std::min(kLatentTile, pad16(nmax)); }

template <typename T, typename Acc>
void gather_latent_tile(const T* c, const AttnShape& s, std::int64_t b, const std::int64_t* keys, std::int64_t m,
                        Acc* g, Acc* gT) {
  const std::int64_t Qp = pad16(s.Dqk);
  gather_rows(c + b * s.Sk * s.Dqk, keys, m, m, s.Dqk, Qp, g);
  gather_transposed<Acc>([&](std::int64_t j) { return g + j * Qp; }, m, s.Dqk, pad16(m), gT);
}

// C [M, N] (=|+=) A x g for the latent tile starting at j0: overwritten for the first tile, accumulated after.
template <typename Acc>
void gemm_tiles_accumulate(std::int64_t j0, std::int64_t M, std::int64_t N, std::int64_t m, const Acc* A,
                           std::int64_t lda, const Acc* g, std::int64_t ldg, Acc* C, std::int64_t ldc) {
  if (j0 == 0) {
    gemm<Acc>(M, N, m, A, lda, g, ldg, C, ldc);
  } else {
    gemm<Acc, true>(M, N, m, A, lda, g, ldg, C, ldc);
  }
}

// Per query row, over tiles of its selected latent rows (flash style, each tile read once): scores [H, m] = q [H, Dqk]
// x gT (one product for all heads), the running max and sum per head (rescaling out when the max grows), then
// out [H, Dv] += p [H, m] x g[:, :Dv].
template <typename T>
void forward_impl(const DsaAttentionArgs& a, const AttnShape& s, const TensorView& out, const TensorView& lse) {
  using Acc = acc_t<T>;
  const std::int64_t H = s.H, Dqk = s.Dqk, Dv = s.Dv, Qp = pad16(Dqk), Vp = pad16(Dv);
  const T* q = static_cast<const T*>(a.q.data());
  const T* c = static_cast<const T*>(a.c.data());
  const std::int64_t* idx = static_cast<const std::int64_t*>(a.topk_indices.data());
  const LseArray<Acc> lse_out(lse);
  const std::int64_t rows = s.B * s.Sq, nmax = max_selected(s);
  const WorkerScratch<std::int64_t> iws({nmax, nmax}, "dsa_attention_forward scratch");
  const std::int64_t L = latent_tile(nmax);
  const WorkerScratch<Acc> ws({H * Dqk, L * Qp, Dqk * L, H * L, H * Vp, H, H}, "dsa_attention_forward scratch");
#pragma omp parallel
  {
    const std::span<std::int64_t> sel = iws.buffer(0), slots = iws.buffer(1);
    const std::span<Acc> qrow = ws.buffer(0), g = ws.buffer(1), gT = ws.buffer(2), score = ws.buffer(3),
                         o = ws.buffer(4), mx = ws.buffer(5), sum = ws.buffer(6);
#pragma omp for schedule(dynamic, 2)
    for (std::int64_t r = 0; r < rows; ++r) {
      const std::int64_t b = r / s.Sq, t = r % s.Sq;
      const std::int64_t n = collect_selected(idx + r * s.K, s.valid[static_cast<std::size_t>(r)], s.c_pos, slots, sel);
      if (n == 0) {
        std::fill(o.begin(), o.end(), Acc(0));
        for (std::int64_t h = 0; h < H; ++h) {
          lse_out.set_empty((b * H + h) * s.Sq + t);
          store_row(out, (r * H + h) * Dv, o.data(), Dv, false);
        }
        continue;
      }
      load_row(q + r * H * Dqk, qrow.data(), H * Dqk);
      for (std::int64_t j0 = 0; j0 < n; j0 += L) {
        const std::int64_t m = std::min(L, n - j0), mp = pad16(m);
        gather_latent_tile(c, s, b, sel.data() + j0, m, g.data(), gT.data());
        gemm<Acc>(H, mp, Dqk, qrow.data(), Dqk, gT.data(), mp, score.data(), mp);
        for (std::int64_t h = 0; h < H; ++h) {
          Acc* sc = score.data() + h * mp;
          Acc mt = j0 == 0 ? neg_inf<Acc>() : mx[h];
          for (std::int64_t j = 0; j < m; ++j) {
            sc[j] *= Acc(s.scale);
            mt = std::max(mt, sc[j]);
          }
          Acc z = 0;
          for (std::int64_t j = 0; j < m; ++j) {
            sc[j] = std::exp(sc[j] - mt);
            z += sc[j];
          }
          if (j0 == 0) {
            sum[h] = z;
          } else {
            const Acc corr = std::exp(mx[h] - mt);  // the earlier tiles' terms against the new max
            sum[h] = sum[h] * corr + z;
            if (corr != Acc(1)) {
              for (std::int64_t d = 0; d < Vp; ++d) o[h * Vp + d] *= corr;
            }
          }
          mx[h] = mt;
        }
        gemm_tiles_accumulate(j0, H, Vp, m, score.data(), mp, g.data(), Qp, o.data(), Vp);
      }
      for (std::int64_t h = 0; h < H; ++h) {
        const Acc inv = Acc(1) / sum[h];
        for (std::int64_t d = 0; d < Dv; ++d) o[h * Vp + d] *= inv;
        lse_out.set((b * H + h) * s.Sq + t, mx[h], sum[h]);
        store_row(out, (r * H + h) * Dv, o.data() + h * Vp, Dv, false);
      }
    }
  }
}

// Shared by the backward and dsa_attention_probs, in chunks of query rows (chunk_rows). Query pass, per row over
// latent tiles: scores = q x gT and dp = dout x gT[:Dv] (one product each for all heads), p, ds, the head-summed
// probs, dq = scale ds [H, n] x g; p and scale ds are kept for the key pass. Key pass (with dout): each
// thread, over the chunk's rows in order, for the latent rows it owns:
//   dc_j += (scale ds)[:, j]^T q  +  p[:, j]^T dout   (one [n_own, H] x [H, Dqk] and one [n_own, H] x [H, Dv] product)
// then a scatter-add, so that dc_j is summed over queries in increasing (b, t) whatever the thread count.
template <typename T>
void backward_impl(const DsaAttentionArgs& a, const AttnShape& s, const TensorView& lse_t, const TensorView& dout_t,
                   const TensorView& delta_t, const TensorView& dq_t, const TensorView& dc_t, bool accumulate,
                   const TensorView& probs_t) {
  using Acc = acc_t<T>;
  const std::int64_t H = s.H, Dqk = s.Dqk, Dv = s.Dv, Sq = s.Sq, Qp = pad16(Dqk), Vp = pad16(Dv);
  const bool want_grad = !absent(dout_t);
  const T* q = static_cast<const T*>(a.q.data());
  const T* c = static_cast<const T*>(a.c.data());
  const std::int64_t* idx = static_cast<const std::int64_t*>(a.topk_indices.data());
  const LseArray<Acc> lse(lse_t);
  const Acc* delta = static_cast<const Acc*>(delta_t.data());
  Acc* probs = static_cast<Acc*>(probs_t.data());
  const std::int64_t rows = s.B * Sq;
  const Acc scale = Acc(s.scale);
  const std::int64_t nmax = max_selected(s), npad = pad16(nmax);

  // per chunk row: p [H, npad] then scale ds [H, npad]
  const std::int64_t coef_row = 2 * H * npad;
  const std::int64_t chunk =
      want_grad ? chunk_rows(coef_row * static_cast<std::int64_t>(sizeof(Acc)),
                             s.B * s.Sk * Dqk * static_cast<std::int64_t>(sizeof(Acc)), rows, max_workers())
                : rows;
  const Tensor coef_owner =
      zeroed_workspace({want_grad ? chunk * coef_row : 0}, dtype_v<Acc>, "dsa_attention_backward coefficients");
  Acc* const coef = static_cast<Acc*>(coef_owner.data());
  const KeyGradient<Acc> dc_acc(want_grad ? dc_t : TensorView{}, want_grad ? s.B * s.Sk : 0, Dqk, accumulate,
                                "dsa_attention_backward dc accumulator");
  const WorkerScratch<std::int64_t> iws({nmax, nmax}, "dsa_attention_backward scratch");
  const std::int64_t L = latent_tile(nmax);
  const WorkerScratch<Acc> ws({H * Qp, H * Vp, L * Qp, Dqk * L, H * npad, H * npad, H * Qp},
                              "dsa_attention_backward scratch");
  const WorkerScratch<double> lws({H}, "dsa_attention_backward lse scratch");
#pragma omp parallel
  {
    const std::span<std::int64_t> sel = iws.buffer(0), slots = iws.buffer(1);
    const std::span<Acc> qrow = ws.buffer(0), dorow = ws.buffer(1), g = ws.buffer(2), gT = ws.buffer(3),
                         p = ws.buffer(4), ds = ws.buffer(5), dq = ws.buffer(6);
    // the key pass reuses the query pass's buffers: own [H, L] in p, part [L, Qp] in g
    const std::span<Acc> own = p, part = g;
    const std::span<double> lse_r = lws.buffer(0);
    const KeyOwner mine;
    // q and dout rows of row r as Acc, zero padded to Qp and Vp columns ([H, Qp], [H, Vp]).
    auto load_padded = [&](std::int64_t r) {
      for (std::int64_t h = 0; h < H; ++h) {
        load_row(q + (r * H + h) * Dqk, qrow.data() + h * Qp, Dqk);
        std::fill(qrow.data() + h * Qp + Dqk, qrow.data() + (h + 1) * Qp, Acc(0));
        if (!want_grad) continue;
        load_any(dout_t, (r * H + h) * Dv, Dv, dorow.data() + h * Vp);
        std::fill(dorow.data() + h * Vp + Dv, dorow.data() + (h + 1) * Vp, Acc(0));
      }
    };
    for (std::int64_t r0 = 0; r0 < rows; r0 += chunk) {
      const std::int64_t r1 = std::min(rows, r0 + chunk);
#pragma omp for schedule(dynamic, 2)
      for (std::int64_t r = r0; r < r1; ++r) {
        const std::int64_t b = r / Sq, t = r % Sq;
        const std::int64_t n =
            collect_selected(idx + r * s.K, s.valid[static_cast<std::size_t>(r)], s.c_pos, slots, sel);
        std::fill(dq.begin(), dq.end(), Acc(0));
        if (n > 0) {
          const std::int64_t np = pad16(n);
          load_padded(r);
          for (std::int64_t h = 0; h < H; ++h) lse_r[h] = lse[(b * H + h) * Sq + t];
          const Acc* dl = want_grad ? delta + b * H * Sq + t : nullptr;  // delta[b, h, t] at dl[h * Sq]
          for (std::int64_t j0 = 0; j0 < n; j0 += L) {
            const std::int64_t m = std::min(L, n - j0), mp = pad16(m);
            gather_latent_tile(c, s, b, sel.data() + j0, m, g.data(), gT.data());
            gemm<Acc>(H, mp, Dqk, qrow.data(), Qp, gT.data(), mp, p.data() + j0, np);
            if (want_grad) gemm<Acc>(H, mp, Dv, dorow.data(), Vp, gT.data(), mp, ds.data() + j0, np);
            for (std::int64_t h = 0; h < H; ++h) {
              const bool dead = std::isinf(lse_r[h]);
              Acc* ph = p.data() + h * np + j0;
              Acc* dsh = ds.data() + h * np + j0;
              for (std::int64_t j = 0; j < m; ++j) {
                ph[j] = dead ? Acc(0) : prob(scale * ph[j], lse_r[h]);
                if (want_grad) dsh[j] = scale * (ph[j] * (dsh[j] - dl[h * Sq]));
              }
              std::fill(ph + m, ph + mp, Acc(0));
              if (want_grad) std::fill(dsh + m, dsh + mp, Acc(0));
            }
            if (!want_grad) continue;
            gemm_tiles_accumulate(j0, H, Qp, m, ds.data() + j0, np, g.data(), Qp, dq.data(), Qp);
          }
          if (probs != nullptr) {
            for (std::int64_t j = 0; j < n; ++j) {
              Acc ps = 0;
              for (std::int64_t h = 0; h < H; ++h) ps += p[h * np + j];
              probs[r * s.K + slots[j]] = ps;
            }
          }
          if (want_grad) {
            Acc* kept = coef + (r - r0) * coef_row;
            for (std::int64_t h = 0; h < H; ++h) {
              std::copy(p.data() + h * np, p.data() + (h + 1) * np, kept + h * npad);
              std::copy(ds.data() + h * np, ds.data() + (h + 1) * np, kept + (H + h) * npad);
            }
          }
        }
        if (want_grad) {
          for (std::int64_t h = 0; h < H; ++h) {
            store_row(dq_t, (r * H + h) * Dqk, dq.data() + h * Qp, Dqk, accumulate);
          }
        }
      }  // implicit barrier: the chunk's p and ds are complete
      if (!want_grad) continue;
      for (std::int64_t r = r0; r < r1; ++r) {
        const std::int64_t n_own = owned_selected(mine, idx + r * s.K, s.valid[static_cast<std::size_t>(r)], s.c_pos,
                                                  slots.data(), sel.data());
        if (n_own == 0) continue;
        load_padded(r);
        const Acc* kept = coef + (r - r0) * coef_row;
        for (std::int64_t i0 = 0; i0 < n_own; i0 += L) {
          const std::int64_t m = std::min(L, n_own - i0);
          gather_columns(kept + H * npad, H, npad, slots.data() + i0, m, own.data(), L);
          gemm<Acc, false, true>(m, Qp, H, own.data(), L, qrow.data(), Qp, part.data(), Qp);
          gather_columns(kept, H, npad, slots.data() + i0, m, own.data(), L);
          gemm<Acc, true, true>(m, Vp, H, own.data(), L, dorow.data(), Vp, part.data(), Qp);
          scatter_add_rows(part.data(), Qp, sel.data() + i0, m, Dqk, dc_acc.data() + r / Sq * s.Sk * Dqk);
        }
      }
#pragma omp barrier
    }
  }
  dc_acc.finish();
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
