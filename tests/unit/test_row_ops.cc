// The host-device element and row bodies (attention/kernels/row_ops.h) on the CPU, against fp64 / long double
// references and closed forms: lse merge, masked row softmax with lse, RoPE pair rotation, bf16 / fp16 conversions.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "attention/kernels/row_ops.h"
#include "attention/reference/rope_reference.h"
#include "runtime/tensor.h"
#include "util/test_util.h"

namespace seqpar {
namespace {

namespace ro = attn::rowops;
constexpr double kInf = std::numeric_limits<double>::infinity();

// Partial softmax result of scores s over values v (one value per key, D = 1) in long double: (out, lse).
std::pair<long double, long double> partial(const std::vector<double>& s, const std::vector<double>& v) {
  if (s.empty()) return {0.0L, -kInf};
  long double mx = -kInf;
  for (double x : s) mx = std::max<long double>(mx, x);
  long double sum = 0.0L, acc = 0.0L;
  for (std::size_t j = 0; j < s.size(); ++j) {
    const long double e = std::exp(static_cast<long double>(s[j]) - mx);
    sum += e;
    acc += e * v[j];
  }
  return {acc / sum, mx + std::log(sum)};
}

template <typename T>
void check_merge_against_union(double offset, double tol) {
  const std::vector<double> r = test::random_values(8000, 11);
  for (int c = 0; c < 200; ++c) {
    // keys split into two disjoint sets (sizes 0..9 each), scores around `offset` (+ a shift of up to 20 on side 2)
    const int n1 = c % 10, n2 = (c / 10) % 10;
    std::vector<double> s1, v1, s2, v2, s, v;
    for (int j = 0; j < n1; ++j) {
      s1.push_back(offset + 3.0 * r[c * 20 + j]);
      v1.push_back(r[4000 + c * 10 + j]);
    }
    for (int j = 0; j < n2; ++j) {
      s2.push_back(offset + 20.0 * r[(c * 7) % 200] + 3.0 * r[c * 20 + 10 + j]);
      v2.push_back(r[6000 + c * 10 + j]);
    }
    s = s1;
    s.insert(s.end(), s2.begin(), s2.end());
    v = v1;
    v.insert(v.end(), v2.begin(), v2.end());
    const auto [o1, l1] = partial(s1, v1);
    const auto [o2, l2] = partial(s2, v2);
    const auto [o, l] = partial(s, v);
    const ro::MergeWeights<T> w = ro::lse_merge_weights(static_cast<T>(l1), static_cast<T>(l2));
    const T out = ro::lse_merge_value(w, static_cast<T>(o1), static_cast<T>(o2));
    if (s.empty()) {
      EXPECT_EQ(w.lse, -kInf);
      EXPECT_EQ(out, T(0));
      continue;
    }
    // the weights are exp of lse differences: an lse of magnitude |offset| + 23 carries that times eps absolute
    const double scale = std::fabs(offset) + 23.0;
    EXPECT_NEAR(static_cast<double>(w.lse), static_cast<double>(l), tol * scale) << "case " << c;
    EXPECT_NEAR(static_cast<double>(out), static_cast<double>(o), tol * scale) << "case " << c;
  }
}

TEST(RowOps, LseMergeEqualsTheSoftmaxOverTheUnion) {
  for (double offset : {0.0, 50.0, -700.0, 1e4}) {
    check_merge_against_union<double>(offset, 4e-16);  // a few eps of the lse magnitude
    check_merge_against_union<float>(offset, 2e-7);
  }
}

TEST(RowOps, LseMergeEdgeCases) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  // both sides empty: lse -inf, out 0 even with garbage outs
  auto w = ro::lse_merge_weights(-kInf, -kInf);
  EXPECT_EQ(w.lse, -kInf);
  EXPECT_EQ(ro::lse_merge_value(w, nan, nan), 0.0);
  // one side empty: exactly the other side
  w = ro::lse_merge_weights(-kInf, 2.5);
  EXPECT_EQ(w.lse, 2.5);
  EXPECT_EQ(w.w1, 0.0);
  EXPECT_EQ(w.w2, 1.0);
  EXPECT_EQ(ro::lse_merge_value(w, nan, 0.375), 0.375);
  w = ro::lse_merge_weights(-3.0, -kInf);
  EXPECT_EQ(ro::lse_merge_value(w, -0.5, nan), -0.5);
  // lse differences up to 1e4 (and more): weights 1 and 0, lse the larger, no NaN
  for (double diff : {50.0, 800.0, 1e4, 1e300}) {
    w = ro::lse_merge_weights(1.0, 1.0 - diff);
    EXPECT_EQ(w.lse, 1.0 + std::log1p(std::exp(-diff)));
    EXPECT_FALSE(std::isnan(w.w1) || std::isnan(w.w2));
    EXPECT_EQ(ro::lse_merge_value(w, 0.25, 7.0), w.w1 * 0.25 + (w.w2 == 0.0 ? 0.0 : w.w2 * 7.0));
    const auto wf = ro::lse_merge_weights(1e4f, static_cast<float>(1e4 - diff));
    EXPECT_FALSE(std::isnan(wf.lse) || std::isnan(wf.w1) || std::isnan(wf.w2));
  }
  // equal lse: weights 1/2 each, lse + log 2 (closed form)
  w = ro::lse_merge_weights(1e4, 1e4);
  EXPECT_EQ(w.w1, 0.5);
  EXPECT_EQ(w.w2, 0.5);
  EXPECT_NEAR(w.lse, 1e4 + std::log(2.0), 1e-12);
}

TEST(RowOps, MaskedSoftmaxRowClosedFormAndReference) {
  // closed form: scores 0, log 2, log 3 -> p = 1/6, 2/6, 3/6, lse = log 6; keys outside [1, 4) of 5 masked
  const double s[5] = {100.0, 0.0, std::log(2.0), std::log(3.0), 100.0};
  double p[5];
  const double lse = ro::masked_softmax_row(s, 5, 1, 4, p);
  EXPECT_NEAR(lse, std::log(6.0), 1e-15);
  EXPECT_EQ(p[0], 0.0);
  EXPECT_EQ(p[4], 0.0);
  EXPECT_NEAR(p[1], 1.0 / 6.0, 1e-16);
  EXPECT_NEAR(p[2], 2.0 / 6.0, 1e-16);
  EXPECT_NEAR(p[3], 3.0 / 6.0, 1e-16);
  // random rows at offsets up to 1e4 against long double
  const std::vector<double> r = test::random_values(64 * 50, 5);
  for (double offset : {0.0, 1e3, -1e4, 1e4}) {
    for (int row = 0; row < 50; ++row) {
      std::vector<double> sc(64), pr(64);
      std::vector<float> scf(64), prf(64);
      for (int j = 0; j < 64; ++j) {
        sc[j] = offset + 8.0 * r[row * 64 + j];
        scf[j] = static_cast<float>(sc[j]);
      }
      const std::int64_t b = row % 7, e = 64 - row % 5;
      const double l = ro::masked_softmax_row(sc.data(), 64, b, e, pr.data());
      const float lf = ro::masked_softmax_row(scf.data(), 64, b, e, prf.data());
      std::vector<double> vis(sc.begin() + b, sc.begin() + e), ones(vis.size(), 1.0);
      const long double want = partial(vis, ones).second;
      // a few eps of lse's magnitude (|offset| + 8 + log 64)
      const double mag = std::fabs(offset) + 13.0;
      EXPECT_NEAR(l, static_cast<double>(want), 4e-16 * mag);
      EXPECT_NEAR(lf, static_cast<double>(want), 2e-7 * mag);
      long double sum = 0.0L;
      for (int j = 0; j < 64; ++j) {
        const long double pw = (j >= b && j < e) ? std::exp(static_cast<long double>(sc[j]) - want) : 0.0L;
        EXPECT_NEAR(pr[j], static_cast<double>(pw), 1e-13);
        sum += pr[j];
      }
      EXPECT_NEAR(static_cast<double>(sum), 1.0, 1e-13);
    }
  }
}

TEST(RowOps, MaskedSoftmaxRowWithoutVisibleKeysIsZeroNotNaN) {
  const double s[4] = {1.0, -kInf, -kInf, 2.0};
  double p[4] = {7, 7, 7, 7};
  EXPECT_EQ(ro::masked_softmax_row(s, 4, 2, 2, p), -kInf);  // empty range
  for (double x : p) EXPECT_EQ(x, 0.0);
  EXPECT_EQ(ro::masked_softmax_row(s, 4, 1, 3, p), -kInf);  // only -inf scores
  for (double x : p) EXPECT_EQ(x, 0.0);
  EXPECT_EQ(ro::masked_softmax_row(s, 4, 0, 3, p), 1.0);  // -inf scores inside a range: probability 0
  EXPECT_EQ(p[0], 1.0);
  EXPECT_EQ(p[1], 0.0);
  const float sf[2] = {-std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity()};
  float pf[2];
  EXPECT_EQ(ro::masked_softmax_row(sf, 2, 0, 2, pf), -std::numeric_limits<float>::infinity());
  EXPECT_EQ(pf[0], 0.0f);
}

TEST(RowOps, RopePairAgainstTheReference) {
  // the fp64 reference's rotation of [1, S, 1, D] (rotate-half) against the pair body with the same angles
  const std::int64_t S = 9, D = 16, half = D / 2;
  attn::RopeConfig cfg;
  const std::vector<std::int64_t> pos = {0, 1, 5, 17, 100, 1000, 4095, 65535, 1 << 20};
  Tensor x = test::random_tensor({1, S, 1, D}, DType::kFloat64, 3);
  Tensor y = Tensor::empty({1, S, 1, D}, DType::kFloat64, MemCategory::kWorkspace);
  attn::reference::rope_forward(cfg, pos, x.view(), y.view());
  const std::vector<double> inv = attn::reference::rope_inv_freq(cfg, D);
  const double factor = attn::reference::rope_attention_factor(cfg);
  const auto* xs = static_cast<const double*>(x.view().data());
  const auto* ys = static_cast<const double*>(y.view().data());
  for (std::int64_t s = 0; s < S; ++s) {
    for (std::int64_t i = 0; i < half; ++i) {
      const double angle = static_cast<double>(pos[s]) * inv[i];
      const double c = factor * std::cos(angle), sn = factor * std::sin(angle);
      double y0, y1, b0, b1;
      ro::rope_rotate_pair(xs[s * D + i], xs[s * D + i + half], c, sn, y0, y1);
      EXPECT_NEAR(y0, ys[s * D + i], 1e-15);
      EXPECT_NEAR(y1, ys[s * D + i + half], 1e-15);
      ro::rope_unrotate_pair(y0, y1, c, sn, b0, b1);  // R^T R = I for factor 1
      EXPECT_NEAR(b0, xs[s * D + i], 1e-15);
      EXPECT_NEAR(b1, xs[s * D + i + half], 1e-15);
    }
  }
  // closed form: (1, 0) rotated by theta is (cos theta, sin theta)
  float a, b;
  ro::rope_rotate_pair(1.0f, 0.0f, std::cos(0.5f), std::sin(0.5f), a, b);
  EXPECT_EQ(a, std::cos(0.5f));
  EXPECT_EQ(b, std::sin(0.5f));
}

// The value of a 16-bit float pattern with `man` mantissa bits and 15 - man exponent bits, from its fields
// (independent of the library's decoder).
double half_value(std::uint16_t h, int man) {
  const int all_ones = (1 << (15 - man)) - 1, bias = all_ones / 2;
  const int sign = h >> 15, e = (h >> man) & all_ones, m = h & ((1 << man) - 1);
  double v;
  if (e == all_ones) {
    v = m ? std::numeric_limits<double>::quiet_NaN() : kInf;
  } else if (e == 0) {
    v = std::ldexp(static_cast<double>(m), 1 - bias - man);
  } else {
    v = std::ldexp(1.0 + std::ldexp(static_cast<double>(m), -man), e - bias);
  }
  return sign ? -v : v;
}
double fp16_value(std::uint16_t h) { return half_value(h, 10); }
double bf16_value(std::uint16_t h) { return half_value(h, 7); }

// Round to nearest, ties to the even pattern, over the sorted non-negative finite values; beyond the largest by half
// an ulp or more: inf (pattern `inf_bits`).
std::uint16_t round_reference(double x, const std::vector<std::pair<double, std::uint16_t>>& table,
                              std::uint16_t inf_bits, double max_plus_half_ulp) {
  const std::uint16_t sign = std::signbit(x) ? 0x8000 : 0;
  const double a = std::fabs(x);
  if (a >= max_plus_half_ulp) return sign | inf_bits;
  auto it = std::lower_bound(table.begin(), table.end(), std::pair<double, std::uint16_t>(a, 0));
  if (it == table.end()) return sign | table.back().second;
  if (it->first == a || it == table.begin()) return sign | it->second;
  const auto lo = *(it - 1), hi = *it;
  if (a - lo.first < hi.first - a) return sign | lo.second;
  if (a - lo.first > hi.first - a) return sign | hi.second;
  return sign | ((lo.second & 1) ? hi.second : lo.second);
}

TEST(RowOps, Float16ConversionsRoundToNearestEven) {
  std::vector<std::pair<double, std::uint16_t>> half_table, bf_table;
  for (std::uint32_t h = 0; h < 0x7c00; ++h)
    half_table.push_back({fp16_value(static_cast<std::uint16_t>(h)), static_cast<std::uint16_t>(h)});
  for (std::uint32_t h = 0; h < 0x7f80; ++h)
    bf_table.push_back({bf16_value(static_cast<std::uint16_t>(h)), static_cast<std::uint16_t>(h)});
  // every 16-bit pattern decodes to its value exactly (NaN stays NaN)
  for (std::uint32_t h = 0; h < 65536; ++h) {
    const auto b = static_cast<std::uint16_t>(h);
    const double hv = fp16_value(b), bv = bf16_value(b);
    if (std::isnan(hv)) {
      EXPECT_TRUE(std::isnan(ro::fp16_to_float(b)));
    } else {
      ASSERT_EQ(static_cast<double>(ro::fp16_to_float(b)), hv) << std::hex << h;
    }
    if (std::isnan(bv)) {
      EXPECT_TRUE(std::isnan(ro::bf16_to_float(b)));
    } else {
      ASSERT_EQ(static_cast<double>(ro::bf16_to_float(b)), bv) << std::hex << h;
    }
  }
  // float -> 16 bits: every 251st float bit pattern plus the tie points, against the nearest-even reference
  const double half_max_plus = 65504.0 + 16.0, bf_max_plus = std::ldexp(1.0 + 127.0 / 128.0 + 1.0 / 256.0, 127);
  std::int64_t checked = 0;
  auto check = [&](float f) {
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(ro::fp16_to_float(ro::float_to_fp16(f))));
      EXPECT_TRUE(std::isnan(ro::bf16_to_float(ro::float_to_bf16(f))));
      return;
    }
    ASSERT_EQ(ro::float_to_fp16(f), round_reference(f, half_table, 0x7c00, half_max_plus)) << f;
    ASSERT_EQ(ro::float_to_bf16(f), round_reference(f, bf_table, 0x7f80, bf_max_plus)) << f;
    ++checked;
  };
  for (std::uint64_t u = 0; u < (1ull << 32); u += 251) check(bits_float(static_cast<std::uint32_t>(u)));
  for (std::size_t i = 0; i + 1 < half_table.size(); ++i)
    check(static_cast<float>((half_table[i].first + half_table[i + 1].first) / 2));  // exact in float
  for (std::size_t i = 0; i + 1 < bf_table.size(); ++i)
    check(static_cast<float>((bf_table[i].first + bf_table[i + 1].first) / 2));
  std::cout << "conversions: 65536 patterns decoded, " << checked << " floats rounded\n";
}

}  // namespace
}  // namespace seqpar
