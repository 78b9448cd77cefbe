// RoPE (attention/rope.h): every pairing, scaling and column window against the fp64 reference
// (attention/reference/rope_reference.h), the backward as the transpose (R^T R = m^2 I, <R x, y> = <x, R^T y>, finite
// differences), the llama3 and YaRN inverse frequencies against closed-form values worked out by hand, and the
// parameter errors.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <numbers>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include "attention/reference/rope_reference.h"
#include "attention/rope.h"
#include "runtime/error.h"
#include "tests/util/test_util.h"

namespace seqpar {
namespace {

using attn::RopeConfig;
using attn::RopePairing;
using attn::RopeScaling;

Tensor copy64(const TensorView& x) { return Tensor::copy_of(x, DType::kFloat64, MemCategory::kWorkspace); }

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

// One case: a config and the shape it rotates.
struct Variant {
  std::string name;
  RopeConfig cfg;
  Shape shape;
};

std::vector<Variant> variants() {
  std::vector<Variant> v;
  for (RopePairing pairing : {RopePairing::kRotateHalf, RopePairing::kInterleaved}) {
    const std::string p = attn::rope_pairing_name(pairing);
    RopeConfig c;
    c.pairing = pairing;
    v.push_back({p + " full", c, {2, 9, 3, 16}});
    RopeConfig partial = c;  // Qwen3-Next: partial_rotary_factor 0.25 of 32 columns
    partial.rotary_dim = 8;
    partial.theta = 1e7;
    v.push_back({p + " partial", partial, {2, 9, 2, 32}});
    RopeConfig window = c;  // DSA's latent: the last columns of a 3-d [B, S, D] tensor
    window.rotary_dim = 8;
    window.column_offset = 24;
    v.push_back({p + " latent window", window, {2, 9, 32}});
    RopeConfig llama = c;
    llama.theta = 500000;
    llama.scaling = RopeScaling::kLlama3;
    llama.llama3.original_max_position_embeddings = 64;  // small, so that the test positions cross every band
    v.push_back({p + " llama3", llama, {1, 9, 2, 64}});
    RopeConfig yarn = c;
    yarn.scaling = RopeScaling::kYarn;
    yarn.yarn.factor = 40;
    yarn.yarn.original_max_position_embeddings = 64;
    yarn.rotary_dim = 16;
    yarn.column_offset = 8;
    v.push_back({p + " yarn window", yarn, {2, 9, 2, 32}});
    RopeConfig yarn_m = yarn;  // DeepSeek's mscale / mscale_all_dim (m = 1) and an mscale alone (m != 1)
    yarn_m.yarn.mscale = 0.707;
    yarn_m.yarn.mscale_all_dim = 1.0;
    v.push_back({p + " yarn mscale", yarn_m, {2, 9, 2, 32}});
  }
  return v;
}

// Positions far apart (global positions of a long sequence), not sorted.
std::vector<std::int64_t> positions_for(std::int64_t s) {
  std::vector<std::int64_t> pos(s);
  for (std::int64_t i = 0; i < s; ++i) pos[i] = (i * 7919 + 13) % 100000;
  return pos;
}

TEST(Rope, EveryVariantMatchesTheFp64Reference) {
  for (const Variant& v : variants()) {
    const std::vector<std::int64_t> pos = positions_for(v.shape[1]);
    for (DType dtype : {DType::kFloat64, DType::kFloat32}) {
      Tensor x = test::random_tensor(v.shape, dtype, 11);
      Tensor x64 = copy64(x.view()), want = copy64(x.view());
      attn::reference::rope_forward(v.cfg, pos, x64.view(), want.view());
      Tensor got = Tensor::copy_of(x.view(), dtype, MemCategory::kWorkspace);
      attn::rope_forward(got.view(), pos, v.cfg);
      // fp32: cos and sin are rounded to fp32, each product once more: a few units of 2^-24 on values of order 1.
      const double tol = dtype == DType::kFloat64 ? 1e-12 : 1e-6;
      EXPECT_TRUE(test::all_close(test::to_double(got.view()), test::to_double(want.view()), tol, tol, v.name))
          << dtype_name(dtype);
      Tensor back = Tensor::copy_of(x.view(), dtype, MemCategory::kWorkspace);
      attn::rope_backward(back.view(), pos, v.cfg);
      attn::reference::rope_backward(v.cfg, pos, x64.view(), want.view());
      EXPECT_TRUE(
          test::all_close(test::to_double(back.view()), test::to_double(want.view()), tol, tol, v.name + " backward"))
          << dtype_name(dtype);
    }
  }
}

TEST(Rope, ColumnsOutsideTheWindowPassThrough) {
  RopeConfig c;
  c.pairing = RopePairing::kInterleaved;
  c.rotary_dim = 4;
  c.column_offset = 6;
  Tensor x = test::random_tensor({1, 5, 2, 12}, DType::kFloat64, 3);
  Tensor y = copy64(x.view());
  attn::rope_forward(y.view(), positions_for(5), c);
  const std::vector<double> a = test::to_double(x.view()), b = test::to_double(y.view());
  int changed = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    const std::int64_t col = static_cast<std::int64_t>(i % 12);
    if (col < 6 || col >= 10) {
      EXPECT_EQ(a[i], b[i]) << "column " << col;
    } else {
      changed += a[i] != b[i];
    }
  }
  EXPECT_GT(changed, 0);
}

// The backward is the transpose of the forward: R^T (R x) = m^2 x, <R x, y> = <x, R^T y>, and the derivative of
// L(x) = <R x, y> along a direction e by central differences equals <e, R^T y>.
TEST(Rope, BackwardIsTheTranspose) {
  for (const Variant& v : variants()) {
    const std::vector<std::int64_t> pos = positions_for(v.shape[1]);
    const double m = attn::rope_attention_factor(v.cfg);
    Tensor x = test::random_tensor(v.shape, DType::kFloat64, 5), y = test::random_tensor(v.shape, DType::kFloat64, 6);
    Tensor rx = copy64(x.view()), rty = copy64(y.view());
    attn::rope_forward(rx.view(), pos, v.cfg);
    attn::rope_backward(rty.view(), pos, v.cfg);
    Tensor rtrx = copy64(rx.view());
    attn::rope_backward(rtrx.view(), pos, v.cfg);
    // m^2 x on the rotated columns, x elsewhere.
    std::vector<double> want = test::to_double(x.view());
    const std::int64_t d = v.shape.back(), o = v.cfg.column_offset;
    const std::int64_t r = v.cfg.rotary_dim > 0 ? v.cfg.rotary_dim : d - o;
    for (std::size_t i = 0; i < want.size(); ++i) {
      const std::int64_t col = static_cast<std::int64_t>(i) % d;
      if (col >= o && col < o + r) want[i] *= m * m;
    }
    EXPECT_TRUE(test::all_close(test::to_double(rtrx.view()), want, 1e-12, 1e-12, v.name + " R^T R x"));
    const std::vector<double> xs = test::to_double(x.view()), ys = test::to_double(y.view());
    const std::vector<double> rxs = test::to_double(rx.view()), rtys = test::to_double(rty.view());
    const double lhs = std::inner_product(rxs.begin(), rxs.end(), ys.begin(), 0.0);
    const double rhs = std::inner_product(xs.begin(), xs.end(), rtys.begin(), 0.0);
    EXPECT_NEAR(lhs, rhs, 1e-11 * static_cast<double>(xs.size())) << v.name;

    // Central differences of L along e (L is linear, so the difference quotient is exact up to rounding).
    Tensor e = test::random_tensor(v.shape, DType::kFloat64, 7);
    const std::vector<double> es = test::to_double(e.view());
    auto loss_at = [&](double h) {
      Tensor xh = copy64(x.view());
      double* p = xh.data_as<double>();
      for (std::size_t i = 0; i < es.size(); ++i) p[i] += h * es[i];
      attn::rope_forward(xh.view(), pos, v.cfg);
      const std::vector<double> r = test::to_double(xh.view());
      return std::inner_product(r.begin(), r.end(), ys.begin(), 0.0);
    };
    const double h = 1e-4, fd = (loss_at(h) - loss_at(-h)) / (2 * h);
    const double analytic = std::inner_product(es.begin(), es.end(), rtys.begin(), 0.0);
    EXPECT_NEAR(fd, analytic, 1e-8 * std::max(1.0, std::abs(analytic))) << v.name;
  }
}

// Llama 3.1 8B: theta 500000, r = 128, factor 8, low 1, high 4, original 8192. Wavelength 2 pi / f_i against
// w_hi = 8192 / 4 = 2048 and w_lo = 8192: pair 10 (w = 48.8) keeps f; pair 40 (w = 22911 > 8192) is f / 8; pairs 30
// (w = 2948) and 33 (w = 5454) are in the medium band: s = (8192 / w - 1) / 3, f' = (1 - s) f / 8 + s f.
TEST(RopeFrequencies, Llama3MatchesClosedForm) {
  RopeConfig c;
  c.theta = 500000;
  c.scaling = RopeScaling::kLlama3;
  const std::vector<double> f = attn::rope_inv_freq(c, 128);
  ASSERT_EQ(f.size(), 64u);
  auto base = [](int i) { return std::pow(500000.0, -i / 64.0); };
  auto medium = [&](int i) {
    const double w = 2 * std::numbers::pi / base(i), s = (8192 / w - 1) / 3;
    return (1 - s) * base(i) / 8 + s * base(i);
  };
  EXPECT_NEAR(f[0], 1.0, 1e-15);
  EXPECT_NEAR(f[10], base(10), 1e-15);
  EXPECT_NEAR(f[40], base(40) / 8, 1e-18);
  EXPECT_NEAR(f[30], medium(30), 1e-16);
  EXPECT_NEAR(f[33], medium(33), 1e-16);
  // The same values as numbers (Python, fp64): f_30 = 0.0013718935677611381, f_33 = 3.1269375038406517e-04.
  EXPECT_NEAR(f[30], 0.0013718935677611381, 1e-15);
  EXPECT_NEAR(f[33], 3.1269375038406517e-04, 1e-15);
  EXPECT_NEAR(f[40], 3.428102195952591e-05, 1e-17);
  EXPECT_EQ(attn::rope_attention_factor(c), 1.0);
  const std::vector<double> ref = attn::reference::rope_inv_freq(c, 128);
  for (std::size_t i = 0; i < f.size(); ++i) EXPECT_NEAR(f[i], ref[i], 1e-15 * ref[i]) << i;
}

// DeepSeek-V3: theta 10000, r = 64, factor 40, original 4096, beta_fast 32, beta_slow 1. Correction dims
// d(n) = 64 ln(4096 / (2 pi n)) / (2 ln 10000): d(32) = 10.47 -> floor 10, d(1) = 22.51 -> ceil 23. Pairs <= 10 keep
// f, pairs >= 23 are f / 40, pair 16 has ramp g = 6/13 and f = 10000^(-1/2) = 0.01: 0.01 (7/13 + 6/(13 40)) = 0.0055.
TEST(RopeFrequencies, YarnMatchesClosedForm) {
  RopeConfig c;
  c.scaling = RopeScaling::kYarn;
  c.yarn.factor = 40;
  const std::vector<double> f = attn::rope_inv_freq(c, 64);
  ASSERT_EQ(f.size(), 32u);
  auto base = [](int i) { return std::pow(10000.0, -i / 32.0); };
  EXPECT_NEAR(f[5], base(5), 1e-16);
  EXPECT_NEAR(f[10], base(10), 1e-16);
  EXPECT_NEAR(f[16], 0.0055, 1e-16);
  EXPECT_NEAR(f[23], base(23) / 40, 1e-18);
  EXPECT_NEAR(f[30], 4.445698525097306e-06, 1e-19);
  EXPECT_NEAR(f[11], base(11) * (12.0 / 13 + 1.0 / (13 * 40)), 1e-16);
  // Attention factor: 0.1 ln 40 + 1 = 1.3688879454113936 by default; DeepSeek's mscale = mscale_all_dim = 1 gives
  // 1 on cos / sin and mscale(40, 1)^2 on the softmax scale; an explicit attention_factor wins.
  EXPECT_NEAR(attn::rope_attention_factor(c), 1.3688879454113936, 1e-15);
  EXPECT_EQ(attn::rope_softmax_scale_factor(c), 1.0);
  c.yarn.mscale = 1;
  c.yarn.mscale_all_dim = 1;
  EXPECT_EQ(attn::rope_attention_factor(c), 1.0);
  EXPECT_NEAR(attn::rope_softmax_scale_factor(c), 1.3688879454113936 * 1.3688879454113936, 1e-14);
  c.yarn.attention_factor = 1.25;
  EXPECT_EQ(attn::rope_attention_factor(c), 1.25);
  const std::vector<double> ref = attn::reference::rope_inv_freq(c, 64);
  for (std::size_t i = 0; i < f.size(); ++i) EXPECT_NEAR(f[i], ref[i], 1e-15 * ref[i]) << i;
}

TEST(RopeErrors, BadParametersAreRejectedWithTheirRule) {
  Tensor x = Tensor::zeros({1, 4, 2, 16}, DType::kFloat32, MemCategory::kWorkspace);
  const std::vector<std::int64_t> pos{0, 1, 2, 3};
  auto rejects = [&](const RopeConfig& c, const std::string& needle) {
    for (const std::string& e : {error_of([&] { c.validate(x.view(), pos); }),
                                 error_of([&] { attn::rope_forward(x.view(), pos, c); }),
                                 error_of([&] { attn::rope_backward(x.view(), pos, c); })}) {
      EXPECT_NE(e.find(needle), std::string::npos) << "expected '" << needle << "' in '" << e << "'";
    }
  };
  RopeConfig c;
  EXPECT_EQ(error_of([&] { c.validate(x.view(), pos); }), "");
  c.rotary_dim = 7;
  rejects(c, "rotary_dim 7 must be even");
  c.rotary_dim = 18;
  rejects(c, "rotary_dim 18 at column_offset 0 exceeds the head dim 16");
  c.rotary_dim = 8;
  c.column_offset = 10;
  rejects(c, "rotary_dim 8 at column_offset 10 exceeds the head dim 16");
  c.column_offset = -1;
  rejects(c, "column_offset -1 must be >= 0");
  // One bad parameter at a time, on an otherwise default configuration.
  const std::vector<std::pair<std::function<void(RopeConfig&)>, std::string>> cases = {
      {[](RopeConfig& k) { k.theta = -1; }, "theta -1 must be positive and finite"},
      {[](RopeConfig& k) { k.llama3.low_freq_factor = 4; }, "must satisfy 0 < low_freq_factor < high_freq_factor"},
      {[](RopeConfig& k) { k.llama3.factor = 0.5; }, "llama3: factor 0.5 must be >= 1"},
      {[](RopeConfig& k) { k.llama3.original_max_position_embeddings = 0; },
       "llama3: original_max_position_embeddings 0 must be >= 1"},
      {[](RopeConfig& k) { k.yarn.beta_fast = 1; },
       "beta_fast 1 and beta_slow 1 must satisfy beta_fast > beta_slow > 0"},
      {[](RopeConfig& k) { k.yarn.factor = 0; }, "yarn: factor 0 must be >= 1"},
      {[](RopeConfig& k) { k.yarn.original_max_position_embeddings = -5; },
       "yarn: original_max_position_embeddings -5 must be >= 1"},
      {[](RopeConfig& k) { k.yarn.mscale = -1; }, "must be finite and >= 0"},
  };
  for (const auto& [mutate, needle] : cases) {
    c = RopeConfig{};
    // The scaling whose parameter the case sets (theta: any).
    c.scaling = needle.find("llama3") != std::string::npos || needle.find("freq") != std::string::npos
                    ? RopeScaling::kLlama3
                    : RopeScaling::kYarn;
    mutate(c);
    rejects(c, needle);
  }
  EXPECT_NE(error_of([] { (void)attn::parse_rope_pairing("neox"); }).find("not one of rotate-half, interleaved"),
            std::string::npos);
  EXPECT_NE(error_of([] { (void)attn::parse_rope_scaling("ntk"); }).find("not one of none, llama3, yarn"),
            std::string::npos);
  EXPECT_EQ(attn::parse_rope_scaling(attn::rope_scaling_name(RopeScaling::kYarn)), RopeScaling::kYarn);
  EXPECT_EQ(attn::parse_rope_pairing(attn::rope_pairing_name(RopePairing::kInterleaved)), RopePairing::kInterleaved);
}

}  // namespace
}  // namespace seqpar
