// DSA kernels (attention/dsa.h) against the fp64 reference (attention/reference/dsa_reference.h) and finite
// differences: top-k exactness with ties, -1 padding and k > S, dense limit, block splitting in any order, causality,
// indexer loss and all gradients.
//
// Tolerances (kernel vs fp64 reference on the same rounded inputs):
//   fp64: 1e-12 abs + 1e-10 rel (fp64 end to end: every accumulator, lse and the top-k scores are fp64).
//   fp32: 2e-5 abs + 1e-4 rel (fp32 accumulation over <= 64 terms of magnitude <= 10).
//   bf16: outputs stored in bf16 (8-bit mantissa, relative rounding 2^-9 = 2e-3): 1e-2 abs + 1e-2 rel.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <string>
#include <tuple>
#include <vector>

#include "attention/dsa.h"
#include "attention/mha.h"
#include "attention/reference/dsa_reference.h"
#include "runtime/error.h"
#include "tests/util/device_collectives.h"
#include "tests/util/dsa_problem.h"
#include "tests/util/test_util.h"

#ifdef _OPENMP
#include <omp.h>
#endif

namespace seqpar::test {
namespace {

using attn::DsaAttentionArgs;
using attn::DsaAttentionBackwardArgs;
using attn::DsaIndexerArgs;
using attn::DsaIndexerLossArgs;
using attn::DsaTopkState;
using Pos = std::vector<std::int64_t>;

struct Tol {
  double atol, rtol;
};
Tol tol_for(DType dt) {
  switch (dt) {
    case DType::kFloat64: return {1e-12, 1e-10};
    case DType::kFloat32: return {2e-5, 1e-4};
    default: return {1e-2, 1e-2};  // bf16 storage of the outputs
  }
}

Tensor f64(const TensorView& t) { return Tensor::copy_of(t, DType::kFloat64, MemCategory::kWorkspace); }
Tensor f32_zeros(const Shape& s) { return Tensor::zeros(s, DType::kFloat32, MemCategory::kWorkspace); }
// Zeros of the kernels' accumulator dtype for `storage` inputs (lse, top-k scores, probs, accumulated gradients).
Tensor acc_zeros(const Shape& s, DType storage) {
  return Tensor::zeros(s, accumulator_dtype(storage), MemCategory::kWorkspace);
}
Tensor i64(const Shape& s) { return Tensor::empty(s, DType::kInt64, MemCategory::kWorkspace); }
std::vector<std::int64_t> ints(const TensorView& t) {
  const auto* p = static_cast<const std::int64_t*>(t.data());
  return {p, p + t.numel()};
}
Pos iota(std::int64_t n, std::int64_t from = 0) {
  Pos p(static_cast<std::size_t>(n));
  std::iota(p.begin(), p.end(), from);
  return p;
}

// Rows `rows` (sorted local indices) of dimension 1 of t [B, S, ...] as a new contiguous tensor [B, n, ...].
Tensor gather_seq(const TensorView& t, const Pos& rows) {
  Shape s = t.shape();
  const std::int64_t S = s[1];
  s[1] = static_cast<std::int64_t>(rows.size());
  Tensor out = Tensor::empty(s, t.dtype(), MemCategory::kWorkspace);
  const std::size_t row_bytes = t.nbytes() / static_cast<std::size_t>(t.dim(0) * S);
  for (std::int64_t b = 0; b < t.dim(0); ++b) {
    for (std::size_t i = 0; i < rows.size(); ++i) {
      std::memcpy(static_cast<char*>(out.data()) + (b * s[1] + static_cast<std::int64_t>(i)) * row_bytes,
                  static_cast<const char*>(t.data()) + (b * S + rows[i]) * row_bytes, row_bytes);
    }
  }
  return out;
}
// full[b, rows[i], :] += part[b, i, :] (fp32).
void scatter_add(const TensorView& full, const TensorView& part, const Pos& rows) {
  const std::int64_t S = full.dim(1), n = part.dim(1), B = full.dim(0);
  const std::int64_t D = full.numel() / (B * S);
  float* f = static_cast<float*>(full.data());
  const float* p = static_cast<const float*>(part.data());
  for (std::int64_t b = 0; b < B; ++b) {
    for (std::int64_t i = 0; i < n; ++i) {
      for (std::int64_t d = 0; d < D; ++d) f[(b * S + rows[i]) * D + d] += p[(b * n + i) * D + d];
    }
  }
}

// Zigzag shard r of P: chunks r and 2P-1-r of size S / (2P).
Pos zigzag(std::int64_t S, int P, int r) {
  const std::int64_t c = S / (2 * P);
  Pos p = iota(c, r * c);
  const Pos hi = iota(c, (2 * P - 1 - r) * c);
  p.insert(p.end(), hi.begin(), hi.end());
  return p;
}

struct Dims {
  std::int64_t B = 2, S = 36, H = 3, Dqk = 20, Dv = 16, Hi = 3, Di = 12, K = 8;
};

// Random DSA inputs of one storage dtype.
struct Problem {
  Dims d;
  DType dtype;
  Tensor q, c, q_idx, w, k_idx;
  Problem(const Dims& dims, DType dt, std::uint64_t seed) : d(dims), dtype(dt) {
    q = random_tensor({d.B, d.S, d.H, d.Dqk}, dt, seed + 1, -2.0, 2.0);
    c = random_tensor({d.B, d.S, d.Dqk}, dt, seed + 2, -1.0, 1.0);
    q_idx = random_tensor({d.B, d.S, d.Hi, d.Di}, dt, seed + 3);
    w = random_tensor({d.B, d.S, d.Hi}, dt, seed + 4, -1.0, 1.0);
    k_idx = random_tensor({d.B, d.S, d.Di}, dt, seed + 5);
  }
  DsaIndexerArgs indexer() const { return {q_idx, w, k_idx, {}, {}}; }
  // The indexer's top-k selection over all keys: topk_indices [B, S, K].
  Tensor selected() const {
    Tensor topk = Tensor::empty({d.B, d.S, d.K}, DType::kInt64, MemCategory::kWorkspace);
    attn::dsa_indexer_topk(indexer(), topk);
    return topk;
  }
  DsaAttentionArgs attention(const TensorView& topk) const {
    DsaAttentionArgs a{q, c, topk, {}, {}};
    a.dim_v = d.Dv;
    return a;
  }
};

// (loss(x + eps) - loss(x - eps)) / (2 eps) for the element *x, which is restored afterwards.
template <typename Loss>
double central_difference(double* x, double eps, Loss&& loss) {
  const double keep = *x;
  *x = keep + eps;
  const double lp = loss();
  *x = keep - eps;
  const double lm = loss();
  *x = keep;
  return (lp - lm) / (2 * eps);
}

std::string dtype_param_name(const ::testing::TestParamInfo<DType>& info) { return dtype_name(info.param); }

// ---- top-k selection ----------------------------------------------------------------------------------------------

class DsaTopkTest : public ::testing::TestWithParam<DType> {};

TEST_P(DsaTopkTest, MatchesReference) {
  const Dims d{.S = 48, .K = 10};
  const Problem pr(d, GetParam(), 11);
  Tensor got = i64({d.B, d.S, d.K}), want = i64({d.B, d.S, d.K});
  attn::dsa_indexer_topk(pr.indexer(), got);
  const Tensor q64 = f64(pr.q_idx), w64 = f64(pr.w), k64 = f64(pr.k_idx);
  attn::reference::dsa_indexer_topk({q64, w64, k64, {}, {}}, want);
  EXPECT_EQ(ints(got), ints(want));
}

INSTANTIATE_TEST_SUITE_P(Dtypes, DsaTopkTest,
                         ::testing::Values(DType::kFloat32, DType::kBFloat16, DType::kFloat16, DType::kFloat64),
                         dtype_param_name);

// Index keys drawn from three integer patterns and integer queries and weights: scores are exact in fp32 and most of
// them are tied, so the selection is decided by the position tie-break.
Problem tie_problem(const Dims& d) {
  Problem pr(d, DType::kFloat32, 21);
  const std::vector<double> pick = random_values(d.B * d.S, 99, 0.0, 3.0);
  const std::vector<double> qv = random_values(pr.q_idx.numel(), 98, -2.0, 3.0);
  const std::vector<double> wv = random_values(pr.w.numel(), 97, 0.0, 3.0);
  auto* k = pr.k_idx.data_as<float>();
  for (std::int64_t r = 0; r < d.B * d.S; ++r) {
    const int pat = static_cast<int>(pick[r]);
    for (std::int64_t e = 0; e < d.Di; ++e) k[r * d.Di + e] = static_cast<float>((e + pat) % 3 == 0 ? 1 : pat - 1);
  }
  for (std::int64_t i = 0; i < pr.q_idx.numel(); ++i) pr.q_idx.data_as<float>()[i] = std::floor(qv[i]);
  for (std::int64_t i = 0; i < pr.w.numel(); ++i) pr.w.data_as<float>()[i] = std::floor(wv[i]);
  return pr;
}

TEST(DsaTopk, ManyEqualScoresTieToSmallerPosition) {
  const Dims d{.S = 40};
  const Problem pr = tie_problem(d);
  Tensor got = i64({d.B, d.S, d.K}), want = i64({d.B, d.S, d.K});
  attn::dsa_indexer_topk(pr.indexer(), got);
  const Tensor q64 = f64(pr.q_idx), w64 = f64(pr.w), k64 = f64(pr.k_idx);
  attn::reference::dsa_indexer_topk({q64, w64, k64, {}, {}}, want);
  EXPECT_EQ(ints(got), ints(want));
  // Count ties at the selection boundary to make sure the case is exercised.
  Tensor scores = Tensor::empty({d.B, d.S, d.S}, DType::kFloat64, MemCategory::kWorkspace);
  attn::reference::dsa_indexer_scores({q64, w64, k64, {}, {}}, scores);
  std::int64_t boundary_ties = 0;
  const auto sel = ints(got);
  const double* sc = scores.data_as<double>();
  for (std::int64_t r = 0; r < d.B * d.S; ++r) {
    const std::int64_t t = r % d.S;
    if (t + 1 <= d.K) continue;
    double kth = INFINITY;
    for (std::int64_t s = 0; s < d.K; ++s) kth = std::min(kth, sc[r * d.S + sel[r * d.K + s]]);
    std::int64_t equal = 0;
    for (std::int64_t j = 0; j <= t; ++j) equal += sc[r * d.S + j] == kth;
    boundary_ties += equal > 1;
  }
  EXPECT_GT(boundary_ties, d.B * (d.S - d.K) / 2) << "the tie case is not exercised";

  // All scores equal (zero queries): the k smallest visible positions win.
  Problem zero = tie_problem(d);
  std::fill(zero.q_idx.data_as<float>(), zero.q_idx.data_as<float>() + zero.q_idx.numel(), 0.0f);
  attn::dsa_indexer_topk(zero.indexer(), got);
  const auto z = ints(got);
  for (std::int64_t r = 0; r < d.B * d.S; ++r) {
    const std::int64_t t = r % d.S;
    for (std::int64_t s = 0; s < d.K; ++s) {
      ASSERT_EQ(z[r * d.K + s], s <= t ? s : -1) << "row " << r << " slot " << s;
    }
  }
}

TEST(DsaTopk, PaddingAndKLargerThanS) {
  const Dims d{.S = 12, .K = 17};  // k > S
  const Problem pr(d, DType::kFloat32, 31);
  Tensor got = i64({d.B, d.S, d.K});
  attn::dsa_indexer_topk(pr.indexer(), got);
  const auto v = ints(got);
  for (std::int64_t r = 0; r < d.B * d.S; ++r) {
    const std::int64_t t = r % d.S;
    for (std::int64_t s = 0; s < d.K; ++s) ASSERT_EQ(v[r * d.K + s], s <= t ? s : -1) << "row " << r;
  }
  // Queries whose positions precede every key select nothing.
  const Pos kpos = iota(d.S, 5);
  Tensor none = i64({d.B, d.S, 4});
  attn::dsa_indexer_topk({pr.q_idx, pr.w, pr.k_idx, {}, kpos}, none);
  const auto nv = ints(none);
  for (std::int64_t r = 0; r < d.B * d.S; ++r) {
    const std::int64_t t = r % d.S;
    EXPECT_EQ(nv[r * 4] >= 0, t >= 5) << "row " << r;
  }
}

// Selection over key blocks fed in any order (and through dsa_topk_merge) equals the one-call selection, for a
// zigzag query shard.
void check_topk_blocks(const Problem& pr) {
  const Dims& d = pr.d;
  Tensor full = i64({d.B, d.S, d.K});
  attn::dsa_indexer_topk(pr.indexer(), full);
  const auto full_v = ints(full);
  const int P = 3;
  const Pos qrows = zigzag(d.S, P, 1);
  const Tensor q_idx = gather_seq(pr.q_idx, qrows), w = gather_seq(pr.w, qrows);
  const std::int64_t Sq = static_cast<std::int64_t>(qrows.size());
  std::vector<Pos> blocks;
  for (int r = 0; r < P; ++r) blocks.push_back(zigzag(d.S, P, r));
  const std::vector<Pos> contiguous = {iota(5), iota(12, 5), iota(d.S - 17, 17)};
  for (const auto& split : {blocks, contiguous}) {
    for (const std::vector<int>& order : {std::vector<int>{0, 1, 2}, {2, 0, 1}, {1, 2, 0}}) {
      Tensor sc = acc_zeros({d.B, Sq, d.K}, pr.dtype), ps = i64({d.B, Sq, d.K}), idx = i64({d.B, Sq, d.K});
      const DsaTopkState st{sc, ps};
      attn::dsa_topk_init(st);
      for (int o : order) {
        const Tensor k = gather_seq(pr.k_idx, split[o]);
        attn::dsa_indexer_topk_block({q_idx, w, k, qrows, split[o]}, st);
      }
      attn::dsa_topk_finalize(st, idx);
      const auto v = ints(idx);
      for (std::int64_t b = 0; b < d.B; ++b) {
        for (std::int64_t i = 0; i < Sq; ++i) {
          for (std::int64_t s = 0; s < d.K; ++s) {
            ASSERT_EQ(v[(b * Sq + i) * d.K + s], full_v[(b * d.S + qrows[i]) * d.K + s])
                << "b " << b << " query " << qrows[i] << " slot " << s << " order " << order[0] << order[1] << order[2];
          }
        }
      }
    }
  }
  // Two states over disjoint halves of the keys, merged, finalised in place.
  Tensor s1 = acc_zeros({d.B, d.S, d.K}, pr.dtype), p1 = i64({d.B, d.S, d.K}),
         s2 = acc_zeros({d.B, d.S, d.K}, pr.dtype), p2 = i64({d.B, d.S, d.K});
  attn::dsa_topk_init({s1, p1});
  attn::dsa_topk_init({s2, p2});
  const Pos lo = iota(d.S / 2), hi = iota(d.S - d.S / 2, d.S / 2);
  const Tensor klo = gather_seq(pr.k_idx, lo), khi = gather_seq(pr.k_idx, hi);
  attn::dsa_indexer_topk_block({pr.q_idx, pr.w, khi, {}, hi}, {s1, p1});
  attn::dsa_indexer_topk_block({pr.q_idx, pr.w, klo, {}, lo}, {s2, p2});
  attn::dsa_topk_merge({s1, p1}, {s2, p2});
  attn::dsa_topk_finalize({s1, p1}, p1);
  EXPECT_EQ(ints(p1), full_v);
}

TEST(DsaTopk, BlockSplitAnyOrderIsIdentical) {
  Dims d;
  check_topk_blocks(Problem(d, DType::kFloat32, 41));
  check_topk_blocks(Problem(d, DType::kBFloat16, 42));
  check_topk_blocks(tie_problem(d));
}

// dsa_topk_selected_scores: each selected slot's score, in topk_indices order, read from the final state (checked
// against a search of the state written here, and against the indexer scores recomputed for those positions); 0 for
// the padding. k > S gives padded rows.
TEST(DsaTopk, SelectedScoresFollowTopkIndices) {
  const Dims d{.S = 12, .K = 17};
  const Problem pr(d, DType::kFloat32, 33);
  Tensor sc = f32_zeros({d.B, d.S, d.K}), ps = i64({d.B, d.S, d.K}), idx = i64({d.B, d.S, d.K});
  Tensor sel = f32_zeros({d.B, d.S, d.K}), ref = f32_zeros({d.B, d.S, d.K});
  const DsaTopkState st{sc, ps};
  attn::dsa_topk_init(st);
  attn::dsa_indexer_topk_block(pr.indexer(), st);
  attn::dsa_topk_selected_scores(st, sel);
  attn::dsa_topk_finalize(st, idx);
  attn::dsa_indexer_scores_selected(pr.indexer(), idx, ref);
  const auto v = ints(idx), pos = ints(ps);
  const float* got = sel.data_as<float>();
  const float* state_scores = sc.data_as<float>();
  const float* want = ref.data_as<float>();
  for (std::int64_t r = 0; r < d.B * d.S; ++r) {
    for (std::int64_t s = 0; s < d.K; ++s) {
      const std::int64_t i = r * d.K + s;
      if (v[i] < 0) {
        ASSERT_EQ(got[i], 0.0f) << "row " << r << " padding slot " << s;
        continue;
      }
      float from_state = std::numeric_limits<float>::quiet_NaN();
      for (std::int64_t e = 0; e < d.K; ++e)
        if (pos[r * d.K + e] == v[i]) from_state = state_scores[r * d.K + e];
      ASSERT_EQ(got[i], from_state) << "row " << r << " slot " << s << " position " << v[i];
      ASSERT_NEAR(got[i], want[i], 1e-5 * (1 + std::fabs(want[i]))) << "row " << r << " slot " << s;
    }
  }
  Tensor wrong = i64({d.B, d.S, d.K});
  EXPECT_NE(test::error_of([&] { attn::dsa_topk_selected_scores(st, wrong); }).find("selected scores has dtype int64"),
            std::string::npos);
}

// ---- sparse latent attention --------------------------------------------------------------------------------------

// out, lse, dq, dc of one attention forward and backward over topk with the upstream gradient dout: the kernels
// (out, dq, dc in the storage dtype, lse in the accumulator dtype) or the fp64 reference on the same rounded inputs.
struct AttentionResult {
  Tensor out, lse, dq, dc;
};
AttentionResult kernel_attention(const Problem& pr, const TensorView& topk, const TensorView& dout) {
  const Dims& d = pr.d;
  const DsaAttentionArgs args = pr.attention(topk);
  AttentionResult r;
  r.out = Tensor::empty({d.B, d.S, d.H, d.Dv}, pr.dtype, MemCategory::kWorkspace);
  r.lse = acc_zeros({d.B, d.H, d.S}, pr.dtype);
  attn::dsa_attention_forward(args, r.out, r.lse);
  r.dq = Tensor::empty(pr.q.shape(), pr.dtype, MemCategory::kWorkspace);
  r.dc = Tensor::empty(pr.c.shape(), pr.dtype, MemCategory::kWorkspace);
  attn::dsa_attention_backward({args, r.out, dout, r.lse, {}, {}}, r.dq, r.dc, false);
  return r;
}
AttentionResult reference_attention(const Problem& pr, const TensorView& topk, const TensorView& dout) {
  const Dims& d = pr.d;
  const Tensor q64 = f64(pr.q), c64 = f64(pr.c), dout64 = f64(dout);
  DsaAttentionArgs ref = pr.attention(topk);
  ref.q = q64;
  ref.c = c64;
  auto empty = [](const Shape& s) { return Tensor::empty(s, DType::kFloat64, MemCategory::kWorkspace); };
  AttentionResult r{empty({d.B, d.S, d.H, d.Dv}), empty({d.B, d.H, d.S}), empty(pr.q.shape()), empty(pr.c.shape())};
  attn::reference::dsa_attention_forward(ref, r.out, r.lse);
  attn::reference::dsa_attention_backward(ref, dout64, r.dq, r.dc);
  return r;
}

class DsaAttentionTest : public ::testing::TestWithParam<DType> {};

TEST_P(DsaAttentionTest, ForwardBackwardMatchReference) {
  const DType dt = GetParam();
  Dims d;
  const Problem pr(d, dt, 51);
  const Tensor topk = pr.selected();
  const Tensor dout = random_tensor({d.B, d.S, d.H, d.Dv}, dt, 52);
  const AttentionResult k = kernel_attention(pr, topk, dout), r = reference_attention(pr, topk, dout);
  const Tol tol = tol_for(dt);
  EXPECT_TRUE(all_close(to_double(k.out), to_double(r.out), tol.atol, tol.rtol, "out"));
  const double lse_tol = dt == DType::kFloat64 ? 1e-12 : 1e-5;  // lse has the accumulator dtype (fp32 or fp64)
  EXPECT_TRUE(all_close(to_double(k.lse), to_double(r.lse), lse_tol, lse_tol, "lse"));
  EXPECT_TRUE(all_close(to_double(k.dq), to_double(r.dq), tol.atol, tol.rtol, "dq"));
  EXPECT_TRUE(all_close(to_double(k.dc), to_double(r.dc), tol.atol, tol.rtol, "dc"));
}

INSTANTIATE_TEST_SUITE_P(Dtypes, DsaAttentionTest,
                         ::testing::Values(DType::kFloat32, DType::kBFloat16, DType::kFloat64), dtype_param_name);

// k >= number of visible keys: exactly dense causal MLA attention (formula written out here, fp64).
TEST(DsaAttention, DenseWhenKCoversAllVisibleKeys) {
  const Dims d{.S = 20, .K = 25};
  const Problem pr(d, DType::kFloat64, 61);
  const Tensor topk = pr.selected();
  Tensor out = Tensor::empty({d.B, d.S, d.H, d.Dv}, DType::kFloat64, MemCategory::kWorkspace);
  Tensor lse = acc_zeros({d.B, d.H, d.S}, DType::kFloat64);
  attn::dsa_attention_forward(pr.attention(topk), out, lse);
  const double* q = pr.q.data_as<double>();
  const double* c = pr.c.data_as<double>();
  std::vector<double> want_out(static_cast<std::size_t>(out.numel())), want_lse(static_cast<std::size_t>(lse.numel()));
  const double scale = 1.0 / std::sqrt(static_cast<double>(d.Dqk));
  for (std::int64_t b = 0; b < d.B; ++b) {
    for (std::int64_t t = 0; t < d.S; ++t) {
      for (std::int64_t h = 0; h < d.H; ++h) {
        std::vector<double> a(static_cast<std::size_t>(t + 1));
        for (std::int64_t j = 0; j <= t; ++j) {
          double s = 0;
          for (std::int64_t e = 0; e < d.Dqk; ++e)
            s += q[((b * d.S + t) * d.H + h) * d.Dqk + e] * c[(b * d.S + j) * d.Dqk + e];
          a[j] = scale * s;
        }
        const double m = *std::max_element(a.begin(), a.end());
        double z = 0;
        for (double x : a) z += std::exp(x - m);
        want_lse[(b * d.H + h) * d.S + t] = m + std::log(z);
        for (std::int64_t e = 0; e < d.Dv; ++e) {
          double o = 0;
          for (std::int64_t j = 0; j <= t; ++j) o += std::exp(a[j] - m) / z * c[(b * d.S + j) * d.Dqk + e];
          want_out[((b * d.S + t) * d.H + h) * d.Dv + e] = o;
        }
      }
    }
  }
  EXPECT_TRUE(all_close(to_double(out), want_out, 1e-12, 1e-12, "out"));
  EXPECT_TRUE(all_close(to_double(lse), want_lse, 1e-12, 1e-12, "lse"));
}

// Latent blocks in any order, merged with attn::lse_merge, equal the one-call forward; the block backward with the
// final out / lse reproduces dq (to rounding) and dc and probs (bitwise).
TEST(DsaAttention, BlockSplitAnyOrderMatchesOneCall) {
  Dims d;
  const Problem pr(d, DType::kFloat32, 71);
  const Tensor topk = pr.selected();
  const DsaAttentionArgs args = pr.attention(topk);
  Tensor out = f32_zeros({d.B, d.S, d.H, d.Dv}), lse = f32_zeros({d.B, d.H, d.S});
  attn::dsa_attention_forward(args, out, lse);
  const Tensor dout = random_tensor(out.shape(), DType::kFloat32, 72);
  Tensor dq = f32_zeros(pr.q.shape()), dc = f32_zeros(pr.c.shape()), probs = f32_zeros(topk.shape());
  attn::dsa_attention_backward({args, out, dout, lse, {}, {}}, dq, dc, true);
  attn::dsa_attention_probs(args, lse, probs);

  const int P = 3;
  std::vector<Pos> zz;
  for (int r = 0; r < P; ++r) zz.push_back(zigzag(d.S, P, r));
  const std::vector<Pos> contiguous = {iota(7), iota(d.S - 7 - 10, 7), iota(10, d.S - 10)};
  Tensor delta = f32_zeros(lse.shape());  // precomputed once, as a ring would
  attn::dsa_attention_delta(out, dout, delta);
  for (const auto& split : {zz, contiguous}) {
    for (const std::vector<int>& order : {std::vector<int>{0, 1, 2}, {2, 1, 0}}) {
      Tensor mo = f32_zeros(out.shape()), ml = f32_zeros(lse.shape());
      std::fill(ml.data_as<float>(), ml.data_as<float>() + ml.numel(), -INFINITY);
      Tensor bdq = f32_zeros(dq.shape()), bdc = f32_zeros(dc.shape()), bprobs = f32_zeros(probs.shape());
      for (int o : order) {
        const Tensor cb = gather_seq(pr.c, split[o]);
        DsaAttentionArgs a = args;
        a.c = cb;
        a.c_pos = split[o];
        Tensor ob = f32_zeros(out.shape()), lb = f32_zeros(lse.shape());
        attn::dsa_attention_forward(a, ob, lb);
        attn::lse_merge(mo, ml, ob, lb);
        Tensor dcb = f32_zeros(cb.shape());
        attn::dsa_attention_backward({a, out, dout, lse, delta, bprobs}, bdq, dcb, true);  // probs fused
        scatter_add(bdc, dcb, split[o]);
      }
      EXPECT_TRUE(all_close(to_double(mo), to_double(out), 1e-6, 1e-5, "merged out"));
      EXPECT_TRUE(all_close(to_double(ml), to_double(lse), 1e-6, 1e-6, "merged lse"));
      EXPECT_TRUE(all_close(to_double(bdq), to_double(dq), 1e-6, 1e-5, "block dq"));
      EXPECT_EQ(to_double(bdc), to_double(dc)) << "block dc is not bitwise the one-call dc";
      EXPECT_EQ(to_double(bprobs), to_double(probs)) << "block probs are not bitwise the one-call probs";
    }
  }
}

// Central differences of L = sum(out * G) on the fp64 kernel.
TEST(DsaAttention, FiniteDifferencesDqDc) {
  const Dims d{.S = 16, .K = 6};
  Problem pr(d, DType::kFloat64, 81);
  const Tensor topk = pr.selected();
  const DsaAttentionArgs args = pr.attention(topk);
  const Tensor G = random_tensor({d.B, d.S, d.H, d.Dv}, DType::kFloat64, 82);
  Tensor out = Tensor::empty(G.shape(), DType::kFloat64, MemCategory::kWorkspace);
  Tensor lse = acc_zeros({d.B, d.H, d.S}, DType::kFloat64);
  auto loss = [&]() {
    attn::dsa_attention_forward(args, out, lse);
    double l = 0;
    for (std::int64_t i = 0; i < out.numel(); ++i) l += out.data_as<double>()[i] * G.data_as<double>()[i];
    return l;
  };
  loss();
  Tensor dq = Tensor::empty(pr.q.shape(), DType::kFloat64, MemCategory::kWorkspace);
  Tensor dc = Tensor::empty(pr.c.shape(), DType::kFloat64, MemCategory::kWorkspace);
  attn::dsa_attention_backward({args, out, G, lse, {}, {}}, dq, dc, false);
  const double eps = 1e-5;
  for (auto [x, g, name] : {std::tuple{&pr.q, &dq, "dq"}, std::tuple{&pr.c, &dc, "dc"}}) {
    const std::vector<double> pick = random_values(16, 83, 0.0, static_cast<double>(x->numel()));
    for (double pd : pick) {
      const auto i = static_cast<std::int64_t>(pd);
      const double fd = central_difference(x->data_as<double>() + i, eps, loss), an = g->data_as<double>()[i];
      EXPECT_NEAR(an, fd, 1e-6 + 1e-5 * std::abs(fd)) << name << "[" << i << "]";
    }
  }
}

TEST(DsaAttention, RowsWithNothingSelected) {
  const Dims d{.S = 10};
  const Problem pr(d, DType::kFloat32, 91);
  const Pos cpos = iota(d.S, 4);  // keys start at position 4: queries 0..3 see nothing
  Tensor topk = i64({d.B, d.S, d.K});
  attn::dsa_indexer_topk({pr.q_idx, pr.w, pr.k_idx, {}, cpos}, topk);
  DsaAttentionArgs a = pr.attention(topk);
  a.c_pos = cpos;
  Tensor out = f32_zeros({d.B, d.S, d.H, d.Dv}), lse = f32_zeros({d.B, d.H, d.S});
  attn::dsa_attention_forward(a, out, lse);
  const Tensor dout = random_tensor(out.shape(), DType::kFloat32, 92);
  Tensor dq = f32_zeros(pr.q.shape()), dc = f32_zeros(pr.c.shape());
  attn::dsa_attention_backward({a, out, dout, lse, {}, {}}, dq, dc, false);
  for (std::int64_t b = 0; b < d.B; ++b) {
    for (std::int64_t t = 0; t < d.S; ++t) {
      for (std::int64_t h = 0; h < d.H; ++h) {
        const float l = lse.data_as<float>()[(b * d.H + h) * d.S + t];
        if (t < 4) {
          EXPECT_TRUE(std::isinf(l) && l < 0) << "lse at t=" << t;
          for (std::int64_t e = 0; e < d.Dv; ++e)
            EXPECT_EQ(out.data_as<float>()[((b * d.S + t) * d.H + h) * d.Dv + e], 0.0f);
          for (std::int64_t e = 0; e < d.Dqk; ++e)
            EXPECT_EQ(dq.data_as<float>()[((b * d.S + t) * d.H + h) * d.Dqk + e], 0.0f);
        } else {
          EXPECT_TRUE(std::isfinite(l));
        }
      }
    }
  }
  for (double v : to_double(dc)) ASSERT_TRUE(std::isfinite(v));
}

TEST(DsaAttention, ArgumentErrors) {
  const Dims d{.S = 8, .K = 4};
  const Problem pr(d, DType::kFloat32, 95);
  const Tensor topk = pr.selected();
  Tensor out = f32_zeros({d.B, d.S, d.H, d.Dv}), lse = f32_zeros({d.B, d.H, d.S});
  DsaAttentionArgs a = pr.attention(topk);
  a.dim_v = d.Dqk + 1;
  EXPECT_THROW(attn::dsa_attention_forward(a, out, lse), Error);
  a = pr.attention(topk);
  a.scale = std::numeric_limits<float>::quiet_NaN();  // was silently replaced by 1/sqrt(Dqk)
  EXPECT_THROW(attn::dsa_attention_forward(a, out, lse), Error);
  a = pr.attention(topk);
  Pos bad = iota(d.S);
  std::swap(bad[2], bad[3]);
  a.c_pos = bad;
  EXPECT_THROW(attn::dsa_attention_forward(a, out, lse), Error);
  Tensor future = i64({d.B, d.S, d.K});
  std::memcpy(future.data(), topk.data(), topk.nbytes());
  future.data_as<std::int64_t>()[2 * d.K] = 5;  // row t = 2 selects position 5
  EXPECT_THROW(attn::dsa_attention_forward(pr.attention(future), out, lse), Error);
  std::memcpy(future.data(), topk.data(), topk.nbytes());
  std::swap(future.data_as<std::int64_t>()[5 * d.K], future.data_as<std::int64_t>()[5 * d.K + 1]);  // not ascending
  EXPECT_THROW(attn::dsa_attention_forward(pr.attention(future), out, lse), Error);
  const Pos kpos_bad = {0, 1, 1, 2, 3, 4, 5, 6};
  EXPECT_THROW(attn::dsa_indexer_topk({pr.q_idx, pr.w, pr.k_idx, {}, kpos_bad}, topk), Error);
}

// ---- indexer loss -------------------------------------------------------------------------------------------------

struct LossResult {
  double loss = 0;
  Tensor dq_idx, dw, dk_idx, dscores;
};

// The kernel pipeline on one key block: lse, probs, selected scores, loss, backward (accumulate into the accumulator
// dtype: fp64 for fp64 inputs, fp32 otherwise).
LossResult kernel_loss(const Problem& pr, const TensorView& topk) {
  const Dims& d = pr.d;
  const DsaAttentionArgs a = pr.attention(topk);
  const auto acc = [&](const Shape& s) { return acc_zeros(s, pr.dtype); };
  Tensor out = acc({d.B, d.S, d.H, d.Dv}), lse = acc({d.B, d.H, d.S});
  attn::dsa_attention_forward(a, out, lse);
  Tensor probs = acc(topk.shape()), scores = acc(topk.shape());
  attn::dsa_attention_probs(a, lse, probs);
  attn::dsa_indexer_scores_selected(pr.indexer(), topk, scores);
  LossResult r;
  r.dscores = acc(topk.shape());
  r.loss = attn::dsa_indexer_loss({probs, scores, topk}, r.dscores);
  r.dq_idx = acc(pr.q_idx.shape());
  r.dw = acc(pr.w.shape());
  r.dk_idx = acc(pr.k_idx.shape());
  attn::dsa_indexer_backward(pr.indexer(), topk, r.dscores, r.dq_idx, r.dw, r.dk_idx, true);
  return r;
}

class DsaIndexerLossTest : public ::testing::TestWithParam<DType> {};

TEST_P(DsaIndexerLossTest, MatchesReference) {
  const DType dt = GetParam();
  Dims d;
  const Problem pr(d, dt, 101);
  const Tensor topk = pr.selected();
  const LossResult k = kernel_loss(pr, topk);

  const Tensor q64 = f64(pr.q), c64 = f64(pr.c), qi64 = f64(pr.q_idx), w64 = f64(pr.w), ki64 = f64(pr.k_idx);
  DsaAttentionArgs ra = pr.attention(topk);
  ra.q = q64;
  ra.c = c64;
  Tensor dq_r = Tensor::empty(qi64.shape(), DType::kFloat64, MemCategory::kWorkspace);
  Tensor dw_r = Tensor::empty(w64.shape(), DType::kFloat64, MemCategory::kWorkspace);
  Tensor dk_r = Tensor::empty(ki64.shape(), DType::kFloat64, MemCategory::kWorkspace);
  const double loss_r = attn::reference::dsa_indexer_loss(ra, {qi64, w64, ki64, {}, {}}, dq_r, dw_r, dk_r);
  // The pipeline's intermediates (probs, scores, dscores) have the accumulator dtype: fp32-level tolerances, or
  // fp64 ones for fp64 inputs.
  const bool wide = dt == DType::kFloat64;
  const double atol = wide ? 1e-12 : 1e-5, rtol = wide ? 1e-10 : 1e-4;
  EXPECT_NEAR(k.loss, loss_r, atol + (wide ? rtol : 1e-5) * std::abs(loss_r));
  EXPECT_GT(loss_r, 0.1);
  EXPECT_TRUE(all_close(to_double(k.dq_idx), to_double(dq_r), atol, rtol, "dq_idx"));
  EXPECT_TRUE(all_close(to_double(k.dw), to_double(dw_r), atol, rtol, "dw"));
  EXPECT_TRUE(all_close(to_double(k.dk_idx), to_double(dk_r), atol, rtol, "dk_idx"));
}

INSTANTIATE_TEST_SUITE_P(Dtypes, DsaIndexerLossTest,
                         ::testing::Values(DType::kFloat32, DType::kBFloat16, DType::kFloat64), dtype_param_name);

// The reference gradients against central differences of the reference loss (selection and p* held fixed).
TEST(DsaIndexerLoss, FiniteDifferencesDqIdxDwDkIdx) {
  const Dims d{.S = 14, .K = 5};
  Problem pr(d, DType::kFloat64, 111);
  const Tensor topk = pr.selected();
  const DsaAttentionArgs a = pr.attention(topk);
  Tensor dq = Tensor::empty(pr.q_idx.shape(), DType::kFloat64, MemCategory::kWorkspace);
  Tensor dw = Tensor::empty(pr.w.shape(), DType::kFloat64, MemCategory::kWorkspace);
  Tensor dk = Tensor::empty(pr.k_idx.shape(), DType::kFloat64, MemCategory::kWorkspace);
  attn::reference::dsa_indexer_loss(a, pr.indexer(), dq, dw, dk);
  // The kernel agrees with the reference value (fp64 inputs and intermediates).
  const LossResult k = kernel_loss(pr, topk);
  const double eps = 1e-6;
  auto loss = [&]() { return attn::reference::dsa_indexer_loss(a, pr.indexer(), {}, {}, {}); };
  EXPECT_NEAR(k.loss, loss(), 1e-10 * std::abs(loss()));
  for (auto [x, g, kg, name] : {std::tuple{&pr.q_idx, &dq, &k.dq_idx, "dq_idx"}, std::tuple{&pr.w, &dw, &k.dw, "dw"},
                                std::tuple{&pr.k_idx, &dk, &k.dk_idx, "dk_idx"}}) {
    const std::vector<double> pick = random_values(16, 112, 0.0, static_cast<double>(x->numel()));
    for (double pd : pick) {
      const auto i = static_cast<std::int64_t>(pd);
      const double fd = central_difference(x->data_as<double>() + i, eps, loss);
      EXPECT_NEAR(g->data_as<double>()[i], fd, 1e-7 + 1e-5 * std::abs(fd)) << "reference " << name << "[" << i << "]";
      EXPECT_NEAR(kg->data_as<double>()[i], fd, 1e-7 + 1e-5 * std::abs(fd)) << "kernel " << name << "[" << i << "]";
    }
  }
}

// The three-step block protocol over latent / index-key blocks in any order equals the one-call pipeline.
TEST(DsaIndexerLoss, BlockSplitAnyOrderMatchesOneCall) {
  Dims d;
  const Problem pr(d, DType::kFloat32, 121);
  const Tensor topk = pr.selected();
  const LossResult one = kernel_loss(pr, topk);
  const DsaAttentionArgs args = pr.attention(topk);
  Tensor out = f32_zeros({d.B, d.S, d.H, d.Dv}), lse = f32_zeros({d.B, d.H, d.S});
  attn::dsa_attention_forward(args, out, lse);

  const int P = 3;
  const std::vector<int> order = {2, 0, 1};
  Tensor probs = f32_zeros(topk.shape()), scores = f32_zeros(topk.shape());
  for (int o : order) {  // (a) per block
    const Pos rows = zigzag(d.S, P, o);
    const Tensor cb = gather_seq(pr.c, rows), kb = gather_seq(pr.k_idx, rows);
    DsaAttentionArgs a = args;
    a.c = cb;
    a.c_pos = rows;
    attn::dsa_attention_probs(a, lse, probs);
    attn::dsa_indexer_scores_selected({pr.q_idx, pr.w, kb, {}, rows}, topk, scores);
  }
  Tensor dscores = f32_zeros(topk.shape());
  const double loss = attn::dsa_indexer_loss({probs, scores, topk}, dscores);  // (b)
  EXPECT_EQ(loss, one.loss);
  EXPECT_EQ(to_double(dscores), to_double(one.dscores));
  Tensor dq = f32_zeros(pr.q_idx.shape()), dw = f32_zeros(pr.w.shape()), dk = f32_zeros(pr.k_idx.shape());
  for (int o : order) {  // (c) per block
    const Pos rows = zigzag(d.S, P, o);
    const Tensor kb = gather_seq(pr.k_idx, rows);
    Tensor dkb = f32_zeros(kb.shape());
    attn::dsa_indexer_backward({pr.q_idx, pr.w, kb, {}, rows}, topk, dscores, dq, dw, dkb, true);
    scatter_add(dk, dkb, rows);
  }
  EXPECT_TRUE(all_close(to_double(dq), to_double(one.dq_idx), 1e-6, 1e-5, "block dq_idx"));
  EXPECT_TRUE(all_close(to_double(dw), to_double(one.dw), 1e-6, 1e-5, "block dw"));
  EXPECT_EQ(to_double(dk), to_double(one.dk_idx)) << "block dk_idx is not bitwise the one-call dk_idx";
}

// ---- fp64 end to end at large logits ------------------------------------------------------------------

// fp64 inputs whose attention logits and indexer scores reach `logit` (test::scale_to_large_logits), with index-key
// twins whose scores differ by 1e-9 relative (test::make_index_key_twins) and an odd k, so that fp32-rounded scores
// would tie where the fp64 selection does not.
Problem large_logit_problem(double logit) {
  Problem pr(Dims{.K = 9}, DType::kFloat64, 151);
  test::scale_to_large_logits(pr.q, pr.c, pr.q_idx, pr.w, pr.k_idx, logit, logit);
  test::make_index_key_twins(pr.k_idx, 1e-9);
  return pr;
}

class DsaFp64LargeLogitsTest : public ::testing::TestWithParam<double> {};

// The selection equals the fp64 reference's, and out, lse, dq, dc, the indexer loss, dq_idx, dw and dk_idx are
// within 1e-10 (relative to each tensor's largest value) of the fp64 reference.
TEST_P(DsaFp64LargeLogitsTest, MatchReferenceWithin1e10) {
  const Problem pr = large_logit_problem(GetParam());
  const Dims& d = pr.d;
  const Tensor topk = pr.selected();
  Tensor want = i64(topk.shape());
  attn::reference::dsa_indexer_topk(pr.indexer(), want);
  ASSERT_EQ(ints(topk), ints(want)) << "the fp64 selection differs from the fp64 reference's";

  const DsaAttentionArgs args = pr.attention(topk);
  Tensor out = acc_zeros({d.B, d.S, d.H, d.Dv}, pr.dtype), lse = acc_zeros({d.B, d.H, d.S}, pr.dtype);
  attn::dsa_attention_forward(args, out, lse);
  const Tensor dout = random_tensor(out.shape(), DType::kFloat64, 152);
  Tensor dq = acc_zeros(pr.q.shape(), pr.dtype), dc = acc_zeros(pr.c.shape(), pr.dtype);
  attn::dsa_attention_backward({args, out, dout, lse, {}, {}}, dq, dc, false);
  const LossResult k = kernel_loss(pr, topk);

  Tensor out_r = acc_zeros(out.shape(), pr.dtype), lse_r = acc_zeros(lse.shape(), pr.dtype);
  Tensor dq_r = acc_zeros(dq.shape(), pr.dtype), dc_r = acc_zeros(dc.shape(), pr.dtype);
  attn::reference::dsa_attention_forward(args, out_r, lse_r);
  attn::reference::dsa_attention_backward(args, dout, dq_r, dc_r);
  Tensor dqi_r = acc_zeros(pr.q_idx.shape(), pr.dtype), dw_r = acc_zeros(pr.w.shape(), pr.dtype),
         dki_r = acc_zeros(pr.k_idx.shape(), pr.dtype);
  const double loss_r = attn::reference::dsa_indexer_loss(args, pr.indexer(), dqi_r, dw_r, dki_r);

  const double rel = 1e-10;
  EXPECT_TRUE(test::rel_close(to_double(out), to_double(out_r), rel, "out"));
  EXPECT_TRUE(test::rel_close(to_double(lse), to_double(lse_r), rel, "lse"));
  EXPECT_TRUE(test::rel_close(to_double(dq), to_double(dq_r), rel, "dq"));
  EXPECT_TRUE(test::rel_close(to_double(dc), to_double(dc_r), rel, "dc"));
  EXPECT_TRUE(test::rel_close({k.loss}, {loss_r}, rel, "indexer loss"));
  EXPECT_TRUE(test::rel_close(to_double(k.dq_idx), to_double(dqi_r), rel, "dq_idx"));
  EXPECT_TRUE(test::rel_close(to_double(k.dw), to_double(dw_r), rel, "dw"));
  EXPECT_TRUE(test::rel_close(to_double(k.dk_idx), to_double(dki_r), rel, "dk_idx"));
}

// Selection over key blocks in any order and through dsa_topk_merge keeps the fp64 scores: the same set as one call.
TEST_P(DsaFp64LargeLogitsTest, BlockSelectionKeepsFp64Scores) { check_topk_blocks(large_logit_problem(GetParam())); }

INSTANTIATE_TEST_SUITE_P(Logits, DsaFp64LargeLogitsTest, ::testing::Values(1e2, 1e3, 1e4),
                         [](const ::testing::TestParamInfo<double>& info) {
                           return str_cat("logits_1e", static_cast<int>(std::lround(std::log10(info.param))));
                         });

// fp32 inputs with an fp64 lse (allowed for any inputs): the block lse is the fp64 sum of the fp32 max and the log of
// the fp32 sum, without fp32's rounding of lse (eps * |lse|, ~6e-4 at logits 1e4), so latent blocks merged in fp64
// (the merge formula written out here) reproduce the one-call out to fp32 rounding and its lse to ~1e-11 relative;
// with fp32 block lse the same merge is off by the lse rounding.
TEST(DsaAttention, Fp64LseOfFp32InputsMergesWithoutLseRounding) {
  const Problem wide = large_logit_problem(1e4);
  const Dims& d = wide.d;
  Problem pr(d, DType::kFloat32, 171);
  for (auto [dst, src] : {std::pair{&pr.q, &wide.q}, {&pr.c, &wide.c}}) {
    *dst = Tensor::copy_of(*src, DType::kFloat32, MemCategory::kWorkspace);
  }
  const Tensor topk = pr.selected();
  const DsaAttentionArgs args = pr.attention(topk);
  const Shape out_shape{d.B, d.S, d.H, d.Dv}, lse_shape{d.B, d.H, d.S};
  Tensor out = f32_zeros(out_shape), lse = acc_zeros(lse_shape, DType::kFloat64);
  attn::dsa_attention_forward(args, out, lse);

  auto merged = [&](DType lse_dtype) {
    Tensor mo = acc_zeros(out_shape, DType::kFloat64), ml = acc_zeros(lse_shape, DType::kFloat64);
    std::fill(ml.data_as<double>(), ml.data_as<double>() + ml.numel(), -INFINITY);
    const std::int64_t Dv = d.Dv;
    for (int r = 0; r < 3; ++r) {
      const Pos rows = zigzag(d.S, 3, r);
      const Tensor cb = gather_seq(pr.c, rows);
      DsaAttentionArgs a = args;
      a.c = cb;
      a.c_pos = rows;
      Tensor ob = acc_zeros(out_shape, DType::kFloat64),
             lb = Tensor::zeros(lse_shape, lse_dtype, MemCategory::kWorkspace);
      attn::dsa_attention_forward(a, ob, lb);
      const std::vector<double> lbv = to_double(lb);
      for (std::int64_t b = 0; b < d.B; ++b)
        for (std::int64_t t = 0; t < d.S; ++t)
          for (std::int64_t h = 0; h < d.H; ++h) {
            double& l = ml.data_as<double>()[(b * d.H + h) * d.S + t];
            const double l_b = lbv[static_cast<std::size_t>((b * d.H + h) * d.S + t)];
            if (std::isinf(l_b)) continue;
            const double m = std::max(l, l_b), wa = std::exp(l - m), wb = std::exp(l_b - m);
            double* o = mo.data_as<double>() + ((b * d.S + t) * d.H + h) * Dv;
            const double* o_b = ob.data_as<double>() + ((b * d.S + t) * d.H + h) * Dv;
            for (std::int64_t e = 0; e < Dv; ++e) o[e] = (wa * o[e] + wb * o_b[e]) / (wa + wb);
            l = m + std::log(wa + wb);
          }
    }
    return std::pair{to_double(mo), to_double(ml)};
  };
  const auto [mo64, ml64] = merged(DType::kFloat64);
  EXPECT_LE(test::rel_error(mo64, to_double(out)), 1e-6) << "out merged from fp64 block lse";
  EXPECT_LE(test::rel_error(ml64, to_double(lse)), 1e-10) << "lse merged from fp64 block lse";
  const auto [mo32, ml32] = merged(DType::kFloat32);
  EXPECT_GT(test::rel_error(mo32, to_double(out)), 1e-5) << "fp32 block lse should cost its rounding here";
}

// A top-k state whose scores are narrower than the accumulator dtype of the inputs is refused (fp64 inputs must be
// selected on fp64 scores).
TEST(DsaFp64, NarrowTopkStateIsRefused) {
  const Problem pr(Dims{.S = 8, .K = 4}, DType::kFloat64, 161);
  Tensor sc = f32_zeros({pr.d.B, pr.d.S, pr.d.K}), ps = i64({pr.d.B, pr.d.S, pr.d.K});
  EXPECT_EQ(test::error_of([&] {
              attn::dsa_indexer_topk_block(pr.indexer(), {sc, ps});
            }),
            "top-k state scores (fp64 indexer inputs) has dtype fp32, expected fp64");
  const Tensor topk = pr.selected();
  Tensor out = acc_zeros({pr.d.B, pr.d.S, pr.d.H, pr.d.Dv}, pr.dtype), lse = f32_zeros({pr.d.B, pr.d.H, pr.d.S});
  EXPECT_EQ(test::error_of([&] { attn::dsa_attention_forward(pr.attention(topk), out, lse); }),
            "lse has dtype fp32, expected fp64 for fp64 inputs");
}

// ---- causality ----------------------------------------------------------------------------------------------------

// Changing every token after position t0 leaves indices, out, lse, probs, scores, dscores, dq, dq_idx and dw at
// positions <= t0 unchanged (bitwise).
TEST(Dsa, CausalityOfEveryOutput) {
  Dims d;
  const std::int64_t t0 = 17;
  const Problem p1(d, DType::kFloat32, 131);
  Problem p2(d, DType::kFloat32, 131);
  const Problem other(d, DType::kFloat32, 999);
  for (auto [dst, src] : {std::pair{&p2.q, &other.q},
                          {&p2.c, &other.c},
                          {&p2.q_idx, &other.q_idx},
                          {&p2.w, &other.w},
                          {&p2.k_idx, &other.k_idx}}) {
    const std::int64_t row = dst->numel() / (d.B * d.S);
    for (std::int64_t b = 0; b < d.B; ++b) {
      for (std::int64_t t = t0 + 1; t < d.S; ++t) {
        std::memcpy(dst->data_as<float>() + (b * d.S + t) * row, src->data_as<float>() + (b * d.S + t) * row,
                    static_cast<std::size_t>(row) * 4);
      }
    }
  }
  const Tensor dout = random_tensor({d.B, d.S, d.H, d.Dv}, DType::kFloat32, 132);
  struct Run {
    Tensor topk, out, lse, dq;
    LossResult loss;
  };
  auto run = [&](const Problem& pr) {
    Run r;
    r.topk = i64({d.B, d.S, d.K});
    attn::dsa_indexer_topk(pr.indexer(), r.topk);
    const DsaAttentionArgs a = pr.attention(r.topk);
    r.out = f32_zeros({d.B, d.S, d.H, d.Dv});
    r.lse = f32_zeros({d.B, d.H, d.S});
    attn::dsa_attention_forward(a, r.out, r.lse);
    r.dq = f32_zeros(pr.q.shape());
    Tensor dc = f32_zeros(pr.c.shape());
    attn::dsa_attention_backward({a, r.out, dout, r.lse, {}, {}}, r.dq, dc, false);
    r.loss = kernel_loss(pr, r.topk);
    return r;
  };
  const Run a = run(p1), b = run(p2);
  // [B, S, ...] tensors: rows t <= t0; lse [B, H, S]: columns t <= t0.
  auto check_rows = [&](const TensorView& x, const TensorView& y, const char* name) {
    const std::vector<double> xv = to_double(x), yv = to_double(y);
    const std::int64_t row = x.numel() / (d.B * d.S);
    for (std::int64_t bb = 0; bb < d.B; ++bb) {
      for (std::int64_t i = 0; i < (t0 + 1) * row; ++i) {
        ASSERT_EQ(xv[bb * d.S * row + i], yv[bb * d.S * row + i]) << name << " b " << bb << " t " << i / row;
      }
    }
  };
  {
    const auto x = ints(a.topk), y = ints(b.topk);
    for (std::int64_t bb = 0; bb < d.B; ++bb) {
      for (std::int64_t i = 0; i < (t0 + 1) * d.K; ++i) ASSERT_EQ(x[bb * d.S * d.K + i], y[bb * d.S * d.K + i]);
    }
  }
  check_rows(a.out, b.out, "out");
  check_rows(a.dq, b.dq, "dq");
  check_rows(a.loss.dscores, b.loss.dscores, "dscores");
  check_rows(a.loss.dq_idx, b.loss.dq_idx, "dq_idx");
  check_rows(a.loss.dw, b.loss.dw, "dw");
  const std::vector<double> la = to_double(a.lse), lb = to_double(b.lse);
  for (std::int64_t r = 0; r < d.B * d.H; ++r) {
    for (std::int64_t t = 0; t <= t0; ++t) ASSERT_EQ(la[r * d.S + t], lb[r * d.S + t]) << "lse t " << t;
  }
  // ... and the change did reach the later positions.
  EXPECT_NE(to_double(a.out), to_double(b.out));
}

// ---- the kernels' tiling -----------------------------------------------------------------------------------------

// The CPU kernels run GEMM tiles: key panels of 64 in the top-k pass, latent tiles of up to 128 selected rows,
// every width padded to the 16-wide SIMD tiles, and chunks of query rows in the key-gradient passes. These cases put
// the edges of that tiling against the fp64 reference: DeepSeek-V3.2's widths (Dqk 576, Dv 512, Hi 64, Di 128) with
// 16 heads, S a multiple of no tile, k above the visible keys of the early rows, rows with more selected positions
// than one latent tile, widths that are not multiples of 16, and a window that starts the candidates inside a panel.
struct KernelCase {
  const char* name;
  Dims d;
  std::int64_t window;
};

const KernelCase kKernelCases[] = {
    {"deepseek_widths", {.B = 1, .S = 100, .H = 16, .Dqk = 576, .Dv = 512, .Hi = 64, .Di = 128, .K = 40}, 0},
    {"latent_tiles", {.B = 1, .S = 200, .H = 3, .Dqk = 20, .Dv = 16, .Hi = 3, .Di = 12, .K = 150}, 0},
    {"window_in_panel", {.B = 2, .S = 150, .H = 2, .Dqk = 33, .Dv = 17, .Hi = 5, .Di = 19, .K = 30}, 70},
};

class DsaKernelTilingTest : public ::testing::TestWithParam<std::tuple<DType, KernelCase>> {};

TEST_P(DsaKernelTilingTest, MatchesReference) {
  const auto& [dt, kc] = GetParam();
  const Dims& d = kc.d;
  const Problem pr(d, dt, 171);
  DsaIndexerArgs ia = pr.indexer();
  ia.window = kc.window;
  Tensor topk = i64({d.B, d.S, d.K}), topk_r = i64({d.B, d.S, d.K});
  attn::dsa_indexer_topk(ia, topk);
  const Tensor qi64 = f64(pr.q_idx), w64 = f64(pr.w), ki64 = f64(pr.k_idx);
  attn::reference::dsa_indexer_topk({qi64, w64, ki64, {}, {}, kc.window}, topk_r);
  EXPECT_EQ(ints(topk), ints(topk_r));

  const Tensor dout = random_tensor({d.B, d.S, d.H, d.Dv}, dt, 172);
  const AttentionResult ka = kernel_attention(pr, topk, dout), ra = reference_attention(pr, topk, dout);
  const LossResult k = kernel_loss(pr, topk);
  DsaAttentionArgs a64 = pr.attention(topk);
  const Tensor q64 = f64(pr.q), c64 = f64(pr.c);
  a64.q = q64;
  a64.c = c64;
  auto f64_like = [](const Tensor& t) { return Tensor::empty(t.shape(), DType::kFloat64, MemCategory::kWorkspace); };
  Tensor dqi_r = f64_like(qi64), dw_r = f64_like(w64), dki_r = f64_like(ki64);
  const double loss_r = attn::reference::dsa_indexer_loss(a64, {qi64, w64, ki64, {}, {}}, dqi_r, dw_r, dki_r);

  // Errors relative to each tensor's largest element: fp64 is fp64 end to end (observed below 1e-14); fp32 sums up
  // to Dqk = 576 or Hi Di = 8192 products in fp32 (observed below 4e-6); bf16 stores out, dq and dc in bf16 (2^-9,
  // observed below 4e-3), while the indexer side keeps the fp32 accumulator dtype.
  const double rel = dt == DType::kFloat64 ? 1e-12 : dt == DType::kFloat32 ? 2e-5 : 1e-2;
  const double rel_idx = dt == DType::kFloat64 ? 1e-12 : 2e-5;
  EXPECT_TRUE(rel_close(to_double(ka.out), to_double(ra.out), rel, "out"));
  EXPECT_TRUE(rel_close(to_double(ka.lse), to_double(ra.lse), rel_idx, "lse"));
  EXPECT_TRUE(rel_close(to_double(ka.dq), to_double(ra.dq), rel, "dq"));
  EXPECT_TRUE(rel_close(to_double(ka.dc), to_double(ra.dc), rel, "dc"));
  EXPECT_NEAR(k.loss, loss_r, rel_idx * std::abs(loss_r));
  EXPECT_TRUE(rel_close(to_double(k.dq_idx), to_double(dqi_r), rel_idx, "dq_idx"));
  EXPECT_TRUE(rel_close(to_double(k.dw), to_double(dw_r), rel_idx, "dw"));
  EXPECT_TRUE(rel_close(to_double(k.dk_idx), to_double(dki_r), rel_idx, "dk_idx"));
}

INSTANTIATE_TEST_SUITE_P(Cases, DsaKernelTilingTest,
                         ::testing::Combine(::testing::Values(DType::kFloat32, DType::kBFloat16, DType::kFloat64),
                                            ::testing::ValuesIn(kKernelCases)),
                         [](const ::testing::TestParamInfo<std::tuple<DType, KernelCase>>& info) {
                           return str_cat(std::get<1>(info.param).name, "_", dtype_name(std::get<0>(info.param)));
                         });

// ---- determinism --------------------------------------------------------------------------------------------------

// Every output is bitwise the same for 1 and 3 threads (fixed reduction orders; key gradients summed over queries in
// increasing order by their owning thread), also with several latent tiles per row and key pass (k = 150 > 128) and
// several chunks of query rows.
void check_thread_independence(const Dims& d) {
#ifndef _OPENMP
  GTEST_SKIP() << "built without OpenMP: one thread only";
#else
  const Problem pr(d, DType::kBFloat16, 141);
  const Tensor dout = random_tensor({d.B, d.S, d.H, d.Dv}, DType::kFloat32, 142);
  auto run = [&](int threads) {
    const int keep = omp_get_max_threads();
    omp_set_num_threads(threads);
    const Tensor topk = pr.selected();
    const DsaAttentionArgs a = pr.attention(topk);
    Tensor out = f32_zeros({d.B, d.S, d.H, d.Dv}), lse = f32_zeros({d.B, d.H, d.S});
    attn::dsa_attention_forward(a, out, lse);
    Tensor dq = f32_zeros(pr.q.shape()), dc = f32_zeros(pr.c.shape());
    attn::dsa_attention_backward({a, out, dout, lse, {}, {}}, dq, dc, false);
    LossResult l = kernel_loss(pr, topk);
    omp_set_num_threads(keep);
    std::vector<std::vector<double>> all = {to_double(out),  to_double(lse),       to_double(dq),
                                            to_double(dc),   to_double(l.dscores), to_double(l.dq_idx),
                                            to_double(l.dw), to_double(l.dk_idx),  {l.loss}};
    const auto idx = ints(topk);
    all.emplace_back(idx.begin(), idx.end());
    return all;
  };
  const auto one = run(1), three = run(3);
  const char* names[] = {"out", "lse", "dq", "dc", "dscores", "dq_idx", "dw", "dk_idx", "loss", "topk_indices"};
  for (std::size_t i = 0; i < one.size(); ++i)
    EXPECT_EQ(one[i], three[i]) << names[i] << " depends on the thread count";
#endif
}

TEST(Dsa, BitwiseIndependentOfThreadCount) { check_thread_independence({.S = 40, .K = 12}); }

TEST(Dsa, BitwiseIndependentOfThreadCountAcrossTiles) {
  check_thread_independence({.B = 1, .S = 200, .H = 3, .Dqk = 20, .Dv = 16, .Hi = 3, .Di = 12, .K = 150});
}

}  // namespace
}  // namespace seqpar::test
