// DSA test inputs at large logits and the relative error the fp64 tests use (tests/unit/test_dsa.cc,
// tests/mpi/test_dsa_cp.cc). Header-only; needs seqpar_reference.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "attention/reference/dsa_reference.h"
#include "runtime/error.h"
#include "tests/util/test_util.h"

namespace seqpar::test {

// Multiplies the fp64 tensors a and b in place by one factor so that max |f(a, b)| becomes `target`, where f is
// homogeneous of degree 2 (a product of one a and one b) and `largest` returns the current max |f|.
template <typename Largest>
void scale_pair_to(Tensor& a, Tensor& b, double target, Largest&& largest) {
  const double now = largest();
  SEQPAR_CHECK(now > 0.0, "scale_pair_to: every value is 0");
  const double f = std::sqrt(target / now);
  for (Tensor* t : {&a, &b}) {
    double* x = t->data_as<double>();
    for (std::int64_t i = 0; i < t->numel(); ++i) x[i] *= f;
  }
}

// Large logits for fp64 DSA inputs q [B, S, H, Dqk], c [B, S, Dqk], q_idx [B, S, Hi, Di], w [B, S, Hi],
// k_idx [B, S, Di] (scale = 1 / sqrt(Dqk), the kernels' default):
//   attention: the last latent column (a score-only column when Dv < Dqk, like the rope part) becomes 1 and q's last
//     column (0.5 + 0.5 |q|) logit / scale, so every logit is an offset between logit / 2 and logit (per query and
//     head) plus the O(1) spread of the other columns: lse is as large as the logits while several keys share the
//     softmax (blocks of a ring merge with comparable lse), and the offset lies along q, so that dq stays well
//     conditioned (a large common latent column would turn lse's rounding, eps * logit, into dq);
//   indexer: q_idx and k_idx multiplied by one factor so that the largest |I_tj| is `index_score` (the relu is
//     positively homogeneous), which makes the indexer softmax of the loss sharply peaked.
inline void scale_to_large_logits(Tensor& q, Tensor& c, Tensor& q_idx, const Tensor& w, Tensor& k_idx, double logit,
                                  double index_score) {
  const std::int64_t B = q.dim(0), S = q.dim(1), D = q.dim(3);
  double* cp = c.data_as<double>();
  for (std::int64_t r = 0; r < B * S; ++r) cp[r * D + D - 1] = 1.0;
  double* qp = q.data_as<double>();
  const double offset = logit * std::sqrt(static_cast<double>(D));
  for (std::int64_t r = 0; r < B * S * q.dim(2); ++r) {
    qp[r * D + D - 1] = (0.5 + 0.5 * std::abs(qp[r * D + D - 1])) * offset;
  }
  scale_pair_to(q_idx, k_idx, index_score, [&] {
    Tensor scores = Tensor::empty({B, S, S}, DType::kFloat64, MemCategory::kWorkspace);
    attn::reference::dsa_indexer_scores({q_idx.view(), w.view(), k_idx.view(), {}, {}}, scores.view());
    double m = 0.0;
    for (double v : to_double(scores.view()))
      if (std::isfinite(v)) m = std::max(m, std::abs(v));
    return m;
  });
}

// Makes the index keys come in near-twins: k_idx[b, 2m + 1] = (1 + delta) k_idx[b, 2m] (fp64, in place). Each twin
// scores (1 + delta) times its partner (the indexer is homogeneous in k_idx), so with delta far below fp32's
// resolution and an odd k, the fp64 selection cuts twin pairs where fp32-rounded scores would tie.
inline void make_index_key_twins(Tensor& k_idx, double delta) {
  const std::int64_t rows = k_idx.dim(0) * k_idx.dim(1), S = k_idx.dim(1), D = k_idx.dim(2);
  double* k = k_idx.data_as<double>();
  for (std::int64_t r = 0; r < rows; ++r) {
    if (r % S % 2 == 0) continue;
    for (std::int64_t d = 0; d < D; ++d) k[r * D + d] = (1.0 + delta) * k[(r - 1) * D + d];
  }
}

// max |got - want| / max |want| (0 when both are 0); infinities at the same places in both are equal.
inline double rel_error(const std::vector<double>& got, const std::vector<double>& want) {
  double err = 0.0, scale = 0.0;
  for (std::size_t i = 0; i < want.size() && i < got.size(); ++i) {
    if (std::isinf(want[i]) && got[i] == want[i]) continue;
    err = std::max(err, std::abs(got[i] - want[i]));
    if (std::isfinite(want[i])) scale = std::max(scale, std::abs(want[i]));
  }
  return scale > 0.0 ? err / scale : err;
}

// all_close with the absolute tolerance rel * max |want|: every element within rel of the tensor's scale (and the
// element-wise message of all_close on failure).
inline ::testing::AssertionResult rel_close(const std::vector<double>& got, const std::vector<double>& want, double rel,
                                            const std::string& what) {
  double scale = 0.0;
  for (double v : want)
    if (std::isfinite(v)) scale = std::max(scale, std::abs(v));
  return all_close(got, want, rel * scale, rel, str_cat(what, " (relative error ", rel_error(got, want), ")"));
}

}  // namespace seqpar::test
