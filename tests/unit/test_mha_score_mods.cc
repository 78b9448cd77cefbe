// Score modifiers of the MHA kernels (attention/mha.h ScoreMods): soft-capping, ALiBi and attention sinks, each and
// together, forward and backward (dsinks included) against the fp64 reference; central finite differences of the
// reference for dsinks and the soft-capped dq / dk; the sinks applied once after a split into key blocks merged by
// lse_merge; the ALiBi slope rule; argument errors.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "attention/mha.h"
#include "attention/reference/mha_reference.h"
#include "tests/util/device_collectives.h"
#include "tests/util/test_util.h"

namespace seqpar::attn {
namespace {

constexpr MemCategory kWs = MemCategory::kWorkspace;

struct Mods {
  float softcap = 0.0f;
  bool alibi = false, sinks = false;
};

struct Case {
  std::int64_t B = 2, Sq = 70, Sk = 70, Hq = 4, Hkv = 2, D = 16;
  DType dtype = DType::kFloat64;
  MaskSpec mask{true, 0};
  Mods mods;
};

// Inputs, positions (queries at 3 i + 1, keys at 3 j: both sparse and interleaved, as a zigzag shard sees them)
// and the per-head vectors, all for one case.
struct ModsProblem {
  Tensor q, k, v, dout, slopes, sinks;
  std::vector<std::int64_t> q_pos, k_pos;
  MhaForwardArgs args;

  ModsProblem(const Case& c, DType sinks_dtype = DType::kFloat32) {
    q = test::random_tensor({c.B, c.Sq, c.Hq, c.D}, c.dtype, 1, -2.0, 2.0);
    k = test::random_tensor({c.B, c.Sk, c.Hkv, c.D}, c.dtype, 2, -2.0, 2.0);
    v = test::random_tensor({c.B, c.Sk, c.Hkv, c.D}, c.dtype, 3);
    dout = test::random_tensor({c.B, c.Sq, c.Hq, c.D}, c.dtype, 4);
    for (std::int64_t i = 0; i < c.Sq; ++i) q_pos.push_back(3 * i + 1);
    for (std::int64_t j = 0; j < c.Sk; ++j) k_pos.push_back(3 * j);
    args = MhaForwardArgs{q, k, v, q_pos, k_pos, c.mask, 0.0f};
    args.mods.softcap = c.mods.softcap;
    if (c.mods.alibi) {
      const std::vector<float> s = alibi_slopes(c.Hq);
      slopes = Tensor::empty({c.Hq}, DType::kFloat32, kWs);
      std::copy(s.begin(), s.end(), slopes.view().data_as<float>());
      args.mods.alibi_slopes = slopes;
    }
    if (c.mods.sinks) {
      sinks = test::random_tensor({c.Hq}, sinks_dtype, 5, -1.0, 3.0);
      args.mods.sinks = sinks;
    }
  }
};

struct Results {
  std::vector<double> out, lse, dq, dk, dv, dsinks;
};

Results kernel_results(const Case& c, const ModsProblem& s) {
  Tensor out = Tensor::empty(s.q.shape(), c.dtype, kWs);
  Tensor lse = Tensor::empty({c.B, c.Hq, c.Sq}, accumulator_dtype(c.dtype), kWs);
  mha_forward(s.args, out, lse);
  Tensor dq = Tensor::empty(s.q.shape(), c.dtype, kWs), dk = Tensor::empty(s.k.shape(), c.dtype, kWs),
         dv = Tensor::empty(s.k.shape(), c.dtype, kWs);
  mha_backward(MhaBackwardArgs{s.args, out, s.dout, lse, {}}, dq, dk, dv, false);
  Results r{test::to_double(out), test::to_double(lse), test::to_double(dq),
            test::to_double(dk),  test::to_double(dv),  {}};
  if (c.mods.sinks) {
    const DType wide = c.dtype == DType::kFloat64 ? DType::kFloat64 : DType::kFloat32;
    Tensor delta = Tensor::empty({c.B, c.Hq, c.Sq}, wide, kWs), dsinks = Tensor::empty({c.Hq}, wide, kWs);
    mha_backward_delta(out, s.dout, delta);
    mha_sinks_backward({delta, lse, s.sinks}, dsinks);
    r.dsinks = test::to_double(dsinks);
  }
  return r;
}

// The fp64 reference on the same inputs (converted to fp64), for args (possibly perturbed copies of s's tensors).
Results reference_results(const Case& c, const MhaForwardArgs& a, const TensorView& dout_in) {
  auto f64 = [](const TensorView& t) { return Tensor::copy_of(t, DType::kFloat64, kWs); };
  Tensor q = f64(a.q), k = f64(a.k), v = f64(a.v), dout = f64(dout_in);
  MhaForwardArgs r64 = a;
  r64.q = q;
  r64.k = k;
  r64.v = v;
  Tensor out = Tensor::empty(q.shape(), DType::kFloat64, kWs),
         lse = Tensor::empty({c.B, c.Hq, c.Sq}, DType::kFloat64, kWs);
  reference::mha_forward(r64, out, lse);
  Tensor dq = Tensor::empty(q.shape(), DType::kFloat64, kWs), dk = Tensor::empty(k.shape(), DType::kFloat64, kWs),
         dv = Tensor::empty(k.shape(), DType::kFloat64, kWs);
  Tensor dsinks;
  if (!a.mods.sinks.empty()) dsinks = Tensor::empty({c.Hq}, DType::kFloat64, kWs);
  reference::mha_backward(r64, dout, dq, dk, dv, dsinks);
  return {test::to_double(out), test::to_double(lse),
          test::to_double(dq),  test::to_double(dk),
          test::to_double(dv),  a.mods.sinks.empty() ? std::vector<double>{} : test::to_double(dsinks)};
}

void expect_close(const Results& got, const Results& want, DType dtype, const std::string& what) {
  // fp64: fp64 arithmetic end to end (the score transform in double); fp32: fp32 scores, exp2 polynomial, sums of
  // up to 70 keys (the same tolerances as the plain kernels' tests).
  const double atol = dtype == DType::kFloat64 ? 1e-12 : 3e-5, rtol = dtype == DType::kFloat64 ? 1e-10 : 3e-4;
  EXPECT_TRUE(test::all_close(got.out, want.out, atol, rtol, what + " out"));
  EXPECT_TRUE(test::all_close(got.lse, want.lse, atol, dtype == DType::kFloat64 ? 1e-12 : 2e-5, what + " lse"));
  EXPECT_TRUE(test::all_close(got.dq, want.dq, atol, rtol, what + " dq"));
  EXPECT_TRUE(test::all_close(got.dk, want.dk, atol, rtol, what + " dk"));
  EXPECT_TRUE(test::all_close(got.dv, want.dv, atol, rtol, what + " dv"));
  // dsinks sums B Sq = 140 row terms: 10x the per-element fp32 tolerance
  EXPECT_TRUE(test::all_close(got.dsinks, want.dsinks, 10 * atol, 10 * rtol, what + " dsinks"));
}

struct Variant {
  const char* name;
  Mods mods;
};
const Variant kVariants[] = {{"softcap", {2.5f, false, false}},
                             {"alibi", {0.0f, true, false}},
                             {"sinks", {0.0f, false, true}},
                             {"all", {3.0f, true, true}}};

TEST(MhaScoreMods, MatchReference) {
  for (const Variant& var : kVariants) {
    for (DType dtype : {DType::kFloat64, DType::kFloat32}) {
      for (MaskSpec mask : {MaskSpec{true, 0}, MaskSpec{false, 0}, MaskSpec{true, 40}}) {
        Case c;
        c.dtype = dtype;
        c.mask = mask;
        c.mods = var.mods;
        const ModsProblem s(c);
        const std::string what = std::string(var.name) + " " + dtype_name(dtype) + (mask.causal ? " causal" : "") +
                                 (mask.window > 0 ? " window" : "");
        expect_close(kernel_results(c, s), reference_results(c, s.args, s.dout), dtype, what);
      }
    }
  }
}

// Loss L = sum(dout * out): central differences of the fp64 reference forward against its backward.
double loss(const Case& c, const MhaForwardArgs& a, const TensorView& dout) {
  Tensor out = Tensor::empty(a.q.shape(), DType::kFloat64, kWs),
         lse = Tensor::empty({c.B, c.Hq, c.Sq}, DType::kFloat64, kWs);
  reference::mha_forward(a, out, lse);
  double l = 0.0;
  const std::vector<double> o = test::to_double(out), g = test::to_double(dout);
  for (std::size_t i = 0; i < o.size(); ++i) l += o[i] * g[i];
  return l;
}

double central_difference(const Case& c, const ModsProblem& s, double* x) {
  const double eps = 1e-6, x0 = *x;
  *x = x0 + eps;
  const double up = loss(c, s.args, s.dout);
  *x = x0 - eps;
  const double down = loss(c, s.args, s.dout);
  *x = x0;
  return (up - down) / (2 * eps);
}

TEST(MhaScoreMods, ReferenceGradientsMatchFiniteDifferences) {
  Case c;
  c.B = 1, c.Sq = c.Sk = 12, c.Hq = 4, c.Hkv = 2, c.D = 8;
  c.mods = {1.5f, true, true};  // a small cap: tanh far from linear on these scores
  for (MaskSpec mask : {MaskSpec{true, 0}, MaskSpec{false, 0}}) {
    c.mask = mask;
    ModsProblem s(c, DType::kFloat64);
    const Results r = reference_results(c, s.args, s.dout);
    for (std::int64_t h = 0; h < c.Hq; ++h) {
      const double fd = central_difference(c, s, s.sinks.view().data_as<double>() + h);
      EXPECT_NEAR(r.dsinks[h], fd, 1e-7 * (1 + std::fabs(fd))) << "dsinks[" << h << "]";
    }
    for (std::int64_t e : {0, 17, 101, 250, 383}) {
      const double fd = central_difference(c, s, s.q.view().data_as<double>() + e);
      EXPECT_NEAR(r.dq[e], fd, 1e-7 * (1 + std::fabs(fd))) << "dq[" << e << "]";
    }
    for (std::int64_t e : {0, 33, 120, 191}) {
      const double fd = central_difference(c, s, s.k.view().data_as<double>() + e);
      EXPECT_NEAR(r.dk[e], fd, 1e-7 * (1 + std::fabs(fd))) << "dk[" << e << "]";
    }
  }
}

// A ring's forward: key blocks without the sinks, merged by lse_merge, then mha_apply_sinks once; and its backward
// per block with the final lse plus mha_sinks_backward: the same as one call with the sinks.
TEST(MhaScoreMods, SinksOnceAfterBlockMerge) {
  Case c;
  c.Sq = c.Sk = 96;
  c.mods = {2.0f, true, true};
  const ModsProblem s(c);
  const Results whole = kernel_results(c, s);
  const std::int64_t half = c.Sk / 2;
  Tensor out = Tensor::zeros(s.q.shape(), DType::kFloat64, kWs);
  Tensor lse = Tensor::empty({c.B, c.Hq, c.Sq}, DType::kFloat64, kWs);
  for (double& x : std::span<double>(lse.view().data_as<double>(), static_cast<std::size_t>(lse.numel())))
    x = -std::numeric_limits<double>::infinity();
  Tensor k[2], v[2];
  MhaForwardArgs blocks[2];
  for (int b = 0; b < 2; ++b) {
    k[b] = Tensor::empty({c.B, half, c.Hkv, c.D}, c.dtype, kWs);
    v[b] = Tensor::empty({c.B, half, c.Hkv, c.D}, c.dtype, kWs);
    for (std::int64_t bb = 0; bb < c.B; ++bb) {
      const std::size_t n = static_cast<std::size_t>(half * c.Hkv * c.D);
      std::copy_n(s.k.view().data_as<double>() + (bb * c.Sk + b * half) * c.Hkv * c.D, n,
                  k[b].view().data_as<double>() + bb * n);
      std::copy_n(s.v.view().data_as<double>() + (bb * c.Sk + b * half) * c.Hkv * c.D, n,
                  v[b].view().data_as<double>() + bb * n);
    }
    blocks[b] = s.args;
    blocks[b].k = k[b];
    blocks[b].v = v[b];
    blocks[b].k_pos = std::span<const std::int64_t>(s.k_pos).subspan(static_cast<std::size_t>(b * half), half);
    blocks[b].mods.sinks = {};
    Tensor bo = Tensor::empty(s.q.shape(), DType::kFloat64, kWs), bl = Tensor::empty(lse.shape(), DType::kFloat64, kWs);
    mha_forward(blocks[b], bo, bl);
    lse_merge(out, lse, bo, bl);
  }
  mha_apply_sinks(out, lse, s.sinks);
  EXPECT_TRUE(test::all_close(test::to_double(out), whole.out, 1e-13, 1e-11, "merged out"));
  EXPECT_TRUE(test::all_close(test::to_double(lse), whole.lse, 1e-13, 1e-12, "merged lse"));
  Tensor dq = Tensor::zeros(s.q.shape(), DType::kFloat64, kWs), dk = Tensor::zeros(s.k.shape(), DType::kFloat64, kWs);
  Tensor dk_b = Tensor::zeros(k[0].shape(), DType::kFloat64, kWs),
         dv_b = Tensor::zeros(k[0].shape(), DType::kFloat64, kWs);
  for (int b = 0; b < 2; ++b) mha_backward(MhaBackwardArgs{blocks[b], out, s.dout, lse, {}}, dq, dk_b, dv_b, true);
  EXPECT_TRUE(test::all_close(test::to_double(dq), whole.dq, 1e-13, 1e-11, "block dq"));
}

TEST(MhaScoreMods, AlibiSlopesFollowThePaper) {
  // Power of two: 2^(-8 (h + 1) / H); otherwise the 8 slopes of H = 8 then every other one of H = 16.
  const std::vector<float> s8 = alibi_slopes(8), s12 = alibi_slopes(12);
  ASSERT_EQ(s8.size(), 8u);
  ASSERT_EQ(s12.size(), 12u);
  for (int h = 0; h < 8; ++h) EXPECT_FLOAT_EQ(s8[h], std::ldexp(1.0f, -(h + 1)));
  for (int h = 0; h < 8; ++h) EXPECT_FLOAT_EQ(s12[h], s8[h]);
  for (int h = 0; h < 4; ++h) EXPECT_FLOAT_EQ(s12[8 + h], std::exp2(-0.5f * static_cast<float>(2 * h + 1)));
  EXPECT_THROW(alibi_slopes(0), Error);
}

// One clear Error naming the rule.
void expect_error(const std::function<void()>& fn, const std::string& needle) {
  const std::string m = test::error_of(fn);
  EXPECT_TRUE(test::contains(m, needle)) << m;
}

TEST(MhaScoreMods, RejectsBadParameters) {
  Case c;
  c.mods = {0.0f, true, true};
  const ModsProblem s(c);
  MhaForwardArgs a = s.args;
  a.mods.softcap = -1.0f;
  expect_error([&] { a.validate(); }, "softcap -1 must be finite and > 0");
  a.mods.softcap = std::numeric_limits<float>::infinity();
  expect_error([&] { a.validate(); }, "softcap inf");
  a = s.args;
  Tensor wrong = Tensor::zeros({c.Hq + 1}, DType::kFloat32, kWs);
  a.mods.alibi_slopes = wrong;
  expect_error([&] { a.validate(); }, "alibi_slopes must be [Hq] = [4]");
  Tensor half = Tensor::zeros({c.Hq}, DType::kBFloat16, kWs);
  a = s.args;
  a.mods.sinks = half;
  expect_error([&] { a.validate(); }, "sinks has dtype bf16, expected fp32 or fp64");
  Tensor bad = Tensor::zeros({c.Hq}, DType::kFloat32, kWs);
  bad.view().data_as<float>()[2] = std::nanf("");
  a.mods.sinks = bad;
  expect_error([&] { a.validate(); }, "sinks[2] = nan must be finite");
}

}  // namespace
}  // namespace seqpar::attn
