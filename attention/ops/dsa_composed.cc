// The composed DSA indexer top-k (dsa_composed.h).
#include "dsa_composed.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "../../runtime/error.h"
#include "../../runtime/tensor_ops.h"
#include "host_values.h"
#include "ops_cpu.h"

namespace seqpar::attn::ops {

template <typename T>
void dsa_indexer_topk_composed(Ops<T>& ops, const DsaIndexerArgs& args, const TensorView& topk_indices,
                               const TensorView& scores) {
  args.validate();
  const std::int64_t B = args.q_idx.dim(0), Sq = args.q_idx.dim(1), Hi = args.q_idx.dim(2), Di = args.q_idx.dim(3);
  const std::int64_t Sk = args.k_idx.dim(1);
  SEQPAR_CHECK(topk_indices.dtype() == DType::kInt64 && topk_indices.ndim() == 3 && topk_indices.dim(0) == B &&
                   topk_indices.dim(1) == Sq && topk_indices.dim(2) >= 1,
               "dsa_indexer_topk: topk_indices must be int64 [", B, ", ", Sq, ", k >= 1], got ", topk_indices.str());
  SEQPAR_CHECK(scores.empty() || (scores.dtype() == dtype_v<T> && scores.shape() == Shape({B, Sq, Sk})),
               "dsa_indexer_topk: scores must be ", dtype_name(dtype_v<T>), " [", B, ", ", Sq, ", ", Sk, "], got ",
               scores.str());
  const std::int64_t k = topk_indices.dim(2);

  // candidate column range of every query row
  std::vector<std::int64_t> qp(args.q_pos.begin(), args.q_pos.end()), kp(args.k_pos.begin(), args.k_pos.end());
  if (qp.empty())
    for (std::int64_t t = 0; t < Sq; ++t) qp.push_back(t);
  if (kp.empty())
    for (std::int64_t j = 0; j < Sk; ++j) kp.push_back(j);
  std::vector<std::int64_t> lo(B * Sq), hi(B * Sq);
  for (std::int64_t t = 0; t < Sq; ++t) {
    std::int64_t first = std::numeric_limits<std::int64_t>::min(), last = qp[t];  // positions [first, last]
    if (args.window > 0) first = qp[t] - args.window + 1;
    if (!args.doc_lo.empty()) {
      first = std::max(first, args.doc_lo[t]);
      last = std::min(last, args.doc_hi[t] - 1);
    }
    const std::int64_t l = std::lower_bound(kp.begin(), kp.end(), first) - kp.begin();
    const std::int64_t h = std::upper_bound(kp.begin(), kp.end(), last) - kp.begin();
    for (std::int64_t b = 0; b < B; ++b) {
      lo[b * Sq + t] = l;
      hi[b * Sq + t] = std::max(l, h);
    }
  }

  const Buffer<T> q(ops, host_values<T>(args.q_idx)), w(ops, host_values<T>(args.w)),
      kk(ops, host_values<T>(args.k_idx));
  const Buffer<std::int64_t> d_lo(ops, lo), d_hi(ops, hi);
  Buffer<T> logits(ops, B * Sq * Hi * Sk), score(ops, B * Sq * Sk);
  // 1. logits [Sq Hi, Sk] per batch row; 2. ReLU; 3. weighted head sum per (b, t)
  ops.gemm(Trans::kN, Trans::kT, Sq * Hi, Sk, Di, T(1), Mat<const T>{q.get(), Di, Sq * Hi * Di, 0},
           Mat<const T>{kk.get(), Di, Sk * Di, 0}, T(0), Mat<T>{logits.get(), Sk, Sq * Hi * Sk, 0}, Batch{B, 1});
  ops.relu_rows(B * Sq * Hi, Sk, logits.get(), Sk);
  ops.gemm(Trans::kN, Trans::kN, 1, Sk, Hi, T(1), Mat<const T>{w.get(), Hi, 0, Hi},
           Mat<const T>{logits.get(), Sk, 0, Hi * Sk}, T(0), Mat<T>{score.get(), Sk, 0, Sk}, Batch{1, B * Sq});
  // 4. top-k over each row's candidate columns
  Buffer<std::int64_t> idx(ops, B * Sq * k);
  Buffer<T> val(ops, B * Sq * k);
  ops.topk_rows(B * Sq, Sk, k, score.get(), Sk, d_lo.get(), d_hi.get(), idx.get(), val.get());

  std::vector<std::int64_t> cols(static_cast<std::size_t>(B * Sq * k));
  ops.download(cols.data(), idx.get(), cols.size() * sizeof(std::int64_t));
  std::int64_t* out = topk_indices.data_as<std::int64_t>();
  for (std::size_t e = 0; e < cols.size(); ++e) out[e] = cols[e] < 0 ? -1 : kp[cols[e]];
  if (!scores.empty()) {
    std::vector<T> host(static_cast<std::size_t>(B * Sq * Sk));
    ops.download(host.data(), score.get(), host.size() * sizeof(T));
    for (std::int64_t r = 0; r < B * Sq; ++r)
      for (std::int64_t j = 0; j < Sk; ++j)
        if (j < lo[r] || j >= hi[r]) host[r * Sk + j] = -std::numeric_limits<T>::infinity();
    std::copy(host.begin(), host.end(), scores.data_as<T>());
  }
}

template <typename T>
void dsa_attention_forward_composed(Ops<T>& ops, const DsaAttentionArgs& args, const TensorView& out,
                                    const TensorView& lse) {
  args.validate(out, lse);
  const std::int64_t B = args.q.dim(0), Sq = args.q.dim(1), H = args.q.dim(2), Dqk = args.q.dim(3);
  const std::int64_t Sk = args.c.dim(1), k = args.topk_indices.dim(2), Dv = args.dim_v;
  const T scale = args.scale > 0.0f ? static_cast<T>(args.scale) : T(1) / std::sqrt(static_cast<T>(Dqk));
  std::vector<std::int64_t> qp(args.q_pos.begin(), args.q_pos.end()), cp(args.c_pos.begin(), args.c_pos.end());
  if (qp.empty())
    for (std::int64_t t = 0; t < Sq; ++t) qp.push_back(t);
  if (cp.empty())
    for (std::int64_t j = 0; j < Sk; ++j) cp.push_back(j);

  // latent rows of each query's selected positions in this block, compacted to the front; their count
  const std::int64_t* sel = args.topk_indices.data_as<std::int64_t>();
  std::vector<std::int64_t> rows(B * Sq * k, -1), count(B * Sq, 0);
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t t = 0; t < Sq; ++t) {
      const std::int64_t r = b * Sq + t;
      for (std::int64_t e = 0; e < k; ++e) {
        const std::int64_t p = sel[r * k + e];
        if (p < 0 || p > qp[t]) continue;
        const auto it = std::lower_bound(cp.begin(), cp.end(), p);
        if (it == cp.end() || *it != p) continue;
        rows[r * k + count[r]++] = b * Sk + (it - cp.begin());
      }
    }

  const Buffer<T> q(ops, host_values<T>(args.q)), c(ops, host_values<T>(args.c));
  const Buffer<std::int64_t> d_rows(ops, rows), d_count(ops, count);
  Buffer<T> csel(ops, B * Sq * k * Dqk), p(ops, B * Sq * H * k), o(ops, B * Sq * H * Dv), mx(ops, B * Sq * H),
      sum(ops, B * Sq * H);
  ops.gather_rows(B * Sq * k, Dqk, c.get(), Dqk, d_rows.get(), csel.get(), Dqk);
  const Batch per_query{1, B * Sq};
  ops.gemm(Trans::kN, Trans::kT, H, k, Dqk, scale, Mat<const T>{q.get(), Dqk, 0, H * Dqk},
           Mat<const T>{csel.get(), Dqk, 0, k * Dqk}, T(0), Mat<T>{p.get(), k, 0, H * k}, per_query);
  ops.softmax_rows(B * Sq * H, k, p.get(), k, d_count.get(), H, mx.get(), sum.get());
  ops.gemm(Trans::kN, Trans::kN, H, Dv, k, T(1), Mat<const T>{p.get(), k, 0, H * k},
           Mat<const T>{csel.get(), Dqk, 0, k * Dqk}, T(0), Mat<T>{o.get(), Dv, 0, H * Dv}, per_query);

  std::vector<T> host_o(static_cast<std::size_t>(B * Sq * H * Dv)), host_mx(static_cast<std::size_t>(B * Sq * H)),
      host_sum(host_mx.size());
  ops.download(host_o.data(), o.get(), host_o.size() * sizeof(T));
  ops.download(host_mx.data(), mx.get(), host_mx.size() * sizeof(T));
  ops.download(host_sum.data(), sum.get(), host_sum.size() * sizeof(T));
  if (!host_o.empty()) copy_convert(TensorView(host_o.data(), dtype_v<T>, out.shape()), out);
  // lse = max + log(sum) in lse's dtype ([B, Sq, H] -> [B, H, Sq]): an fp64 lse of fp32 inputs carries no fp32 lse
  // rounding, as dsa_attention_forward's
  std::vector<double> lse_bhs(host_mx.size());
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t t = 0; t < Sq; ++t)
      for (std::int64_t h = 0; h < H; ++h) {
        const std::size_t i = static_cast<std::size_t>((b * Sq + t) * H + h);
        lse_bhs[(b * H + h) * Sq + t] = lse.dtype() == DType::kFloat64
                                            ? double(host_mx[i]) + std::log(double(host_sum[i]))
                                            : double(T(host_mx[i] + std::log(host_sum[i])));
      }
  if (!lse_bhs.empty()) copy_convert(TensorView(lse_bhs.data(), DType::kFloat64, lse.shape()), lse);
}

template void dsa_attention_forward_composed<float>(Ops<float>&, const DsaAttentionArgs&, const TensorView&,
                                                    const TensorView&);
template void dsa_attention_forward_composed<double>(Ops<double>&, const DsaAttentionArgs&, const TensorView&,
                                                     const TensorView&);

template void dsa_indexer_topk_composed<float>(Ops<float>&, const DsaIndexerArgs&, const TensorView&,
                                               const TensorView&);
template void dsa_indexer_topk_composed<double>(Ops<double>&, const DsaIndexerArgs&, const TensorView&,
                                                const TensorView&);

void dsa_indexer_topk_composed_cpu(const DsaIndexerArgs& args, const TensorView& topk_indices,
                                   const TensorView& scores) {
  with_cpu_ops(args.q_idx.dtype(), [&](auto& ops) { dsa_indexer_topk_composed(ops, args, topk_indices, scores); });
}

void dsa_attention_forward_composed_cpu(const DsaAttentionArgs& args, const TensorView& out, const TensorView& lse) {
  with_cpu_ops(args.q.dtype(), [&](auto& ops) { dsa_attention_forward_composed(ops, args, out, lse); });
}

}  // namespace seqpar::attn::ops
