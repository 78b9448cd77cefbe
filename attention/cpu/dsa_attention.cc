// DSA sparse latent attention on the CPU (absorbed MLA: one latent c shared by all heads, value = c[:, :Dv]):
// forward over the selected positions inside one latent block, backward with the final lse, and the head-summed
// probabilities used by the indexer loss. See attention/dsa.h for the math and the block protocol.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "attention/cpu/dsa_common.h"
#include "attention/dsa.h"

namespace seqpar::attn {
namespace {

using namespace dsa_detail;

struct AttnShape {
  std::int64_t B, Sq, H, Dqk, Dv, Sk, K;
  double scale;  // exact 1/sqrt(Dqk) in fp64 for the fp64 path
  std::vector<std::int64_t> q_pos, c_pos;
  std::vector<std::int32_t> valid;  // valid slots per row
};

AttnShape check_attention_args(const DsaAttentionArgs& a) {
  check_floating(a.q, "q");
  check_floating(a.c, "c");
  SEQPAR_CHECK(a.q.ndim() == 4, "q must be [B, Sq, H, Dqk], got ", shape_str(a.q.shape()));
  AttnShape s;
  s.B = a.q.dim(0);
  s.Sq = a.q.dim(1);
  s.H = a.q.dim(2);
  s.Dqk = a.q.dim(3);
  SEQPAR_CHECK(a.c.ndim() == 3 && a.c.dim(0) == s.B && a.c.dim(2) == s.Dqk, "c must be [B, Sk, Dqk] = [", s.B, ", Sk, ",
               s.Dqk, "], got ", shape_str(a.c.shape()));
  SEQPAR_CHECK(a.c.dtype() == a.q.dtype(), "q and c must share one dtype, got ", dtype_name(a.q.dtype()), " and ",
               dtype_name(a.c.dtype()));
  s.Sk = a.c.dim(1);
  s.Dv = a.dim_v;
  SEQPAR_CHECK(s.Dv >= 1 && s.Dv <= s.Dqk, "dim_v = ", s.Dv, " must be in [1, Dqk = ", s.Dqk, "]");
  SEQPAR_CHECK(std::isfinite(a.scale), "DSA scale ", a.scale, " must be finite (0 or less: 1/sqrt(Dqk))");
  s.scale = a.scale > 0.0f ? static_cast<double>(a.scale) : 1.0 / std::sqrt(static_cast<double>(s.Dqk));
  s.q_pos = positions_or_iota(a.q_pos, s.Sq, "q_pos", "Sq");
  s.c_pos = positions_or_iota(a.c_pos, s.Sk, "c_pos", "Sk");
  check_strictly_increasing(s.c_pos, "c_pos");
  s.valid = check_topk_rows(a.topk_indices, s.B, s.Sq, s.q_pos, "topk_indices");
  s.K = a.topk_indices.dim(2);
  return s;
}

// Loads `n` elements at element offset `at` of any floating tensor as Acc.
template <typename Acc>
void load_any(const TensorView& t, std::int64_t at, std::int64_t n, Acc* dst) {
  dispatch_floating(t.dtype(), [&](auto tag) {
    using T = decltype(tag);
    load_row(static_cast<const T*>(t.data()) + at, dst, n);
  });
}

// The local indices (into the block) and slots of the selected positions of row r inside the block.
inline void collect_selected(const AttnShape& s, const std::int64_t* idx, std::int64_t r, std::vector<std::int64_t>& m,
                             std::vector<std::int64_t>& slot) {
  m.clear();
  slot.clear();
  for_each_selected_in_block(idx + r * s.K, s.valid[static_cast<std::size_t>(r)], s.c_pos,
                             [&](std::int64_t sl, std::int64_t mm) {
                               slot.push_back(sl);
                               m.push_back(mm);
                             });
}

template <typename T>
void forward_impl(const DsaAttentionArgs& a, const AttnShape& s, const TensorView& out, const TensorView& lse) {
  using Acc = acc_t<T>;
  const std::int64_t H = s.H, Dqk = s.Dqk, Dv = s.Dv;
  const T* q = static_cast<const T*>(a.q.data());
  const T* c = static_cast<const T*>(a.c.data());
  const std::int64_t* idx = static_cast<const std::int64_t*>(a.topk_indices.data());
  float* lse_out = static_cast<float*>(lse.data());
  const std::int64_t rows = s.B * s.Sq;
#pragma omp parallel
  {
    std::vector<std::int64_t> sel, slots;
    std::vector<Acc> qrow(static_cast<std::size_t>(H * Dqk)), gath, score, o(static_cast<std::size_t>(H * Dv));
    std::vector<Acc> mx(static_cast<std::size_t>(H)), sum(static_cast<std::size_t>(H));
    std::vector<Acc> cT(static_cast<std::size_t>(kTile * Dqk)), tile(static_cast<std::size_t>(kTile * H));
    const Acc* rowp[kTile];
#pragma omp for schedule(dynamic, 2)
    for (std::int64_t r = 0; r < rows; ++r) {
      const std::int64_t b = r / s.Sq, t = r % s.Sq;
      collect_selected(s, idx, r, sel, slots);
      const std::int64_t n = static_cast<std::int64_t>(sel.size());
      std::fill(o.begin(), o.end(), Acc(0));
      if (n == 0) {
        for (std::int64_t h = 0; h < H; ++h) lse_out[(b * H + h) * s.Sq + t] = neg_inf();
        store_row(out, r * H * Dv, o.data(), H * Dv, false);
        continue;
      }
      load_row(q + r * H * Dqk, qrow.data(), H * Dqk);
      gath.resize(static_cast<std::size_t>(n * Dqk));
      for (std::int64_t j = 0; j < n; ++j) load_row(c + (b * s.Sk + sel[j]) * Dqk, gath.data() + j * Dqk, Dqk);
      // scores [H, n], a tile of kTile latent rows (transposed) against all heads at a time
      score.resize(static_cast<std::size_t>(H * n));
      for (std::int64_t j0 = 0; j0 < n; j0 += kTile) {
        const std::int64_t nj = std::min(kTile, n - j0);
        for (std::int64_t j = 0; j < nj; ++j) rowp[j] = gath.data() + (j0 + j) * Dqk;
        load_tile_transposed(rowp, nj, Dqk, cT.data());
        dot_tile(qrow.data(), H, Dqk, cT.data(), tile.data());
        for (std::int64_t h = 0; h < H; ++h) {
          for (std::int64_t j = 0; j < nj; ++j) score[h * n + j0 + j] = Acc(s.scale) * tile[h * kTile + j];
        }
      }
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
        lse_out[(b * H + h) * s.Sq + t] = static_cast<float>(mx[h] + std::log(sum[h]));
      }
      store_row(out, r * H * Dv, o.data(), H * Dv, false);
    }
  }
}

// Shared by the backward and dsa_attention_probs. Query pass: per row, p (and with dout, ds and dq) over the selected
// pairs inside the block; probs (optional) gets sum_h p per slot. Key pass (with dout): dc per block latent row.
template <typename T>
void backward_impl(const DsaAttentionArgs& a, const AttnShape& s, const TensorView& lse_t, const TensorView& dout_t,
                   const std::vector<float>& delta, const TensorView& dq_t, const TensorView& dc_t, bool accumulate,
                   float* probs) {
  using Acc = acc_t<T>;
  const std::int64_t H = s.H, Dqk = s.Dqk, Dv = s.Dv, Sq = s.Sq;
  const bool want_grad = !absent(dout_t);
  const T* q = static_cast<const T*>(a.q.data());
  const T* c = static_cast<const T*>(a.c.data());
  const std::int64_t* idx = static_cast<const std::int64_t*>(a.topk_indices.data());
  const float* lse = static_cast<const float*>(lse_t.data());
  const std::int64_t rows = s.B * Sq;
  const Acc scale = Acc(s.scale);

#pragma omp parallel
  {
    std::vector<std::int64_t> sel, slots;
    std::vector<Acc> qrow(static_cast<std::size_t>(H * Dqk)), dorow(static_cast<std::size_t>(H * Dv)), gath, p;
    std::vector<Acc> dq(static_cast<std::size_t>(H * Dqk)), lse_r(static_cast<std::size_t>(H));
    std::vector<Acc> cT(static_cast<std::size_t>(kTile * Dqk)), tile(static_cast<std::size_t>(kTile * H)),
        dptile(static_cast<std::size_t>(kTile * H));
    const Acc* rowp[kTile];
#pragma omp for schedule(dynamic, 2)
    for (std::int64_t r = 0; r < rows; ++r) {
      const std::int64_t b = r / Sq, t = r % Sq;
      collect_selected(s, idx, r, sel, slots);
      const std::int64_t n = static_cast<std::int64_t>(sel.size());
      std::fill(dq.begin(), dq.end(), Acc(0));
      if (n > 0) {
        load_row(q + r * H * Dqk, qrow.data(), H * Dqk);
        if (want_grad) load_any(dout_t, r * H * Dv, H * Dv, dorow.data());
        for (std::int64_t h = 0; h < H; ++h) lse_r[h] = static_cast<Acc>(lse[(b * H + h) * Sq + t]);
        gath.resize(static_cast<std::size_t>(n * Dqk));
        for (std::int64_t j = 0; j < n; ++j) load_row(c + (b * s.Sk + sel[j]) * Dqk, gath.data() + j * Dqk, Dqk);
        p.resize(static_cast<std::size_t>(H * n));
        for (std::int64_t j0 = 0; j0 < n; j0 += kTile) {
          const std::int64_t nj = std::min(kTile, n - j0);
          for (std::int64_t j = 0; j < nj; ++j) rowp[j] = gath.data() + (j0 + j) * Dqk;
          load_tile_transposed(rowp, nj, Dqk, cT.data());
          dot_tile(qrow.data(), H, Dqk, cT.data(), tile.data());
          if (want_grad) dot_tile(dorow.data(), H, Dv, cT.data(), dptile.data());  // rows d < Dv of cT: the value
          for (std::int64_t h = 0; h < H; ++h) {
            const bool dead = std::isinf(lse_r[h]);
            for (std::int64_t j = 0; j < nj; ++j) {
              const Acc pj = dead ? Acc(0) : std::exp(scale * tile[h * kTile + j] - lse_r[h]);
              p[h * n + j0 + j] = pj;
              if (want_grad && pj != Acc(0)) {
                const Acc ds = pj * (dptile[h * kTile + j] - static_cast<Acc>(delta[(b * H + h) * Sq + t]));
                axpy(scale * ds, rowp[j], dq.data() + h * Dqk, Dqk);
              }
            }
          }
        }
        if (probs != nullptr) {
          for (std::int64_t j = 0; j < n; ++j) {
            Acc ps = 0;
            for (std::int64_t h = 0; h < H; ++h) ps += p[h * n + j];
            probs[r * s.K + slots[j]] = static_cast<float>(ps);
          }
        }
      }
      if (want_grad) store_row(dq_t, r * H * Dqk, dq.data(), H * Dqk, accumulate);
    }
  }
  if (!want_grad) return;

  // Keys: dc of each block latent row, summed over its selecting queries in increasing (b, t) (see KeyOwner).
  std::vector<Acc> dc_acc(static_cast<std::size_t>(s.B * s.Sk * Dqk), Acc(0));
  const bool dout_in_place = dout_t.dtype() == dtype_v<Acc>;
#pragma omp parallel
  {
    const KeyOwner mine;
    std::vector<Acc> qrow(static_cast<std::size_t>(H * Dqk)), dorow(static_cast<std::size_t>(H * Dv));
    std::vector<Acc> cT(static_cast<std::size_t>(kTile * Dqk)), tile(static_cast<std::size_t>(kTile * H)),
        dptile(static_cast<std::size_t>(kTile * H)), lse_r(static_cast<std::size_t>(H)),
        delta_r(static_cast<std::size_t>(H));
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
                lse_r[h] = static_cast<Acc>(lse[(b * H + h) * Sq + t]);
                delta_r[h] = static_cast<Acc>(delta[(b * H + h) * Sq + t]);
              }
            }
            for (std::int64_t j = 0; j < n; ++j) crows[j] = c + (b * s.Sk + keys[j]) * Dqk;
            load_tile_transposed(crows, n, Dqk, cT.data());
            dot_tile(qr, H, Dqk, cT.data(), tile.data());
            dot_tile(dr, H, Dv, cT.data(), dptile.data());
            for (std::int64_t j = 0; j < n; ++j) {
              Acc* dc = dc_acc.data() + (b * s.Sk + keys[j]) * Dqk;
              for (std::int64_t h = 0; h < H; ++h) {
                if (std::isinf(lse_r[h])) continue;
                const Acc pj = std::exp(scale * tile[h * kTile + j] - lse_r[h]);
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
  for (std::int64_t km = 0; km < keys; ++km) store_row(dc_t, km * Dqk, dc_acc.data() + km * Dqk, Dqk, accumulate);
}

void check_lse(const TensorView& lse, const AttnShape& s, const char* what) {
  check_cpu(lse, what);
  check_dtype(lse, DType::kFloat32, what);
  check_shape(lse, {s.B, s.H, s.Sq}, what);
}

void delta_impl(const TensorView& out, const TensorView& dout, float* delta, std::int64_t B, std::int64_t Sq,
                std::int64_t H, std::int64_t Dv) {
  const bool wide = out.dtype() == DType::kFloat64 || dout.dtype() == DType::kFloat64;
#pragma omp parallel
  {
    std::vector<double> o(static_cast<std::size_t>(Dv)), g(static_cast<std::size_t>(Dv));
    std::vector<float> of(static_cast<std::size_t>(Dv)), gf(static_cast<std::size_t>(Dv));
#pragma omp for schedule(static)
    for (std::int64_t r = 0; r < B * Sq; ++r) {
      const std::int64_t b = r / Sq, t = r % Sq;
      for (std::int64_t h = 0; h < H; ++h) {
        const std::int64_t at = (r * H + h) * Dv;
        float v;
        if (wide) {
          load_any(out, at, Dv, o.data());
          load_any(dout, at, Dv, g.data());
          v = static_cast<float>(dot(o.data(), g.data(), Dv));
        } else {
          load_any(out, at, Dv, of.data());
          load_any(dout, at, Dv, gf.data());
          v = dot(of.data(), gf.data(), Dv);
        }
        delta[(b * H + h) * Sq + t] = v;
      }
    }
  }
}

}  // namespace

void dsa_attention_forward(const DsaAttentionArgs& args, const TensorView& out, const TensorView& lse, Stream stream) {
  check_cpu_stream(stream, "dsa_attention_forward");
  const AttnShape s = check_attention_args(args);
  check_floating(out, "out");
  check_shape(out, {s.B, s.Sq, s.H, s.Dv}, "out");
  check_lse(lse, s, "lse");
  dispatch_floating(args.q.dtype(), [&](auto tag) { forward_impl<decltype(tag)>(args, s, out, lse); });
}

void dsa_attention_delta(const TensorView& out, const TensorView& dout, const TensorView& delta, Stream stream) {
  check_cpu_stream(stream, "dsa_attention_delta");
  check_floating(out, "out");
  check_floating(dout, "dout");
  SEQPAR_CHECK(out.ndim() == 4, "out must be [B, Sq, H, Dv], got ", shape_str(out.shape()));
  check_shape(dout, out.shape(), "dout");
  check_cpu(delta, "delta");
  check_dtype(delta, DType::kFloat32, "delta");
  check_shape(delta, {out.dim(0), out.dim(2), out.dim(1)}, "delta");
  delta_impl(out, dout, static_cast<float*>(delta.data()), out.dim(0), out.dim(1), out.dim(2), out.dim(3));
}

void dsa_attention_backward(const DsaAttentionBackwardArgs& args, const TensorView& dq, const TensorView& dc,
                            bool accumulate, Stream stream) {
  check_cpu_stream(stream, "dsa_attention_backward");
  const AttnShape s = check_attention_args(args.fwd);
  check_floating(args.dout, "dout");
  check_shape(args.dout, {s.B, s.Sq, s.H, s.Dv}, "dout");
  check_lse(args.lse, s, "lse");
  check_grad_output(dq, args.fwd.q.shape(), accumulate, "dq");
  check_grad_output(dc, args.fwd.c.shape(), accumulate, "dc");
  std::vector<float> delta(static_cast<std::size_t>(s.B * s.H * s.Sq));
  if (absent(args.delta)) {
    check_floating(args.out, "out");
    check_shape(args.out, {s.B, s.Sq, s.H, s.Dv}, "out");
    delta_impl(args.out, args.dout, delta.data(), s.B, s.Sq, s.H, s.Dv);
  } else {
    check_lse(args.delta, s, "delta");
    const float* d = static_cast<const float*>(args.delta.data());
    std::copy(d, d + delta.size(), delta.begin());
  }
  float* probs = nullptr;
  if (!absent(args.probs)) {
    check_cpu(args.probs, "probs");
    check_dtype(args.probs, DType::kFloat32, "probs");
    check_shape(args.probs, args.fwd.topk_indices.shape(), "probs");
    probs = static_cast<float*>(args.probs.data());
  }
  dispatch_floating(args.fwd.q.dtype(), [&](auto tag) {
    backward_impl<decltype(tag)>(args.fwd, s, args.lse, args.dout, delta, dq, dc, accumulate, probs);
  });
}

void dsa_attention_probs(const DsaAttentionArgs& args, const TensorView& lse, const TensorView& probs, Stream stream) {
  check_cpu_stream(stream, "dsa_attention_probs");
  const AttnShape s = check_attention_args(args);
  check_lse(lse, s, "lse");
  check_cpu(probs, "probs");
  check_dtype(probs, DType::kFloat32, "probs");
  check_shape(probs, args.topk_indices.shape(), "probs");
  const std::vector<float> no_delta;
  dispatch_floating(args.q.dtype(), [&](auto tag) {
    backward_impl<decltype(tag)>(args, s, lse, TensorView(), no_delta, TensorView(), TensorView(), false,
                                 static_cast<float*>(probs.data()));
  });
}

}  // namespace seqpar::attn
