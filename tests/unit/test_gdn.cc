// Unit tests of the CPU gated delta rule (attention/gdn.h) against the token-by-token fp64 recurrence
// (attention/reference/gdn_reference.h), whose gradients are in turn checked against central finite differences.
//
// Tolerances (per dtype; inputs of the reference are the kernel's inputs rounded to the storage dtype, so only
// arithmetic differs):
//   fp64: atol 1e-10, rtol 1e-9   (chunked vs token order; the chunk inverse (I + A)^-1 is well conditioned here)
//   fp32: atol 2e-5,  rtol 1e-4   for S <= 1000; the S = 8192 test states its own (below)
//   bf16 inputs: the same as fp32 on values (arithmetic is fp32; out is stored fp32 in these tests)
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <string>
#include <tuple>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "attention/gdn.h"
#include "attention/reference/gdn_reference.h"
#include "tests/util/test_util.h"

namespace seqpar::attn {
namespace {

using test::all_close;
using test::random_tensor;
using test::to_double;

constexpr MemCategory kWs = MemCategory::kWorkspace;

struct Problem {
  std::int64_t B = 2, S = 16, H = 3, Hk = 0, K = 16, V = 12;  // H value heads; Hk key heads (0: H)
  bool l2 = true;
  bool with_init = true;
  std::int64_t chunk = kGdnDefaultChunkSize;
  std::uint64_t seed = 1;
  std::int64_t key_heads() const { return Hk > 0 ? Hk : H; }
};

// Inputs in the storage dtype plus their fp64 copies (same rounded values) for the reference.
struct Inputs {
  Tensor q, k, v, g, beta, init;  // storage dtype (init: state dtype)
  Tensor q64, k64, v64, g64, beta64, init64;
  Problem p;
  DType dtype = DType::kFloat64;

  GdnForwardArgs args() const { return args_of(q, k, v, g, beta, init); }
  GdnForwardArgs args64() const { return args_of(q64, k64, v64, g64, beta64, init64); }
  GdnForwardArgs args_of(const TensorView& q_, const TensorView& k_, const TensorView& v_, const TensorView& g_,
                         const TensorView& beta_, const TensorView& init_) const {
    return {q_, k_, v_, g_, beta_, p.with_init ? init_ : TensorView(), p.l2, 0.0f, p.chunk};
  }
};

Tensor as_f64(const TensorView& t) { return Tensor::copy_of(t, DType::kFloat64, kWs); }

Inputs make_inputs(const Problem& p, DType dtype) {
  Inputs in;
  in.p = p;
  in.dtype = dtype;
  // Without the L2 normalisation, k is kept at norm ~ 0.6 so that I - beta k k^T stays a contraction.
  const double kr = p.l2 ? 1.0 : 1.0 / std::sqrt(static_cast<double>(p.K));
  in.q = random_tensor({p.B, p.S, p.key_heads(), p.K}, dtype, p.seed * 11 + 1);
  in.k = random_tensor({p.B, p.S, p.key_heads(), p.K}, dtype, p.seed * 11 + 2, -kr, kr);
  in.v = random_tensor({p.B, p.S, p.H, p.V}, dtype, p.seed * 11 + 3);
  in.g = random_tensor({p.B, p.S, p.H}, dtype, p.seed * 11 + 4, -0.3, -0.005);
  in.beta = random_tensor({p.B, p.S, p.H}, dtype, p.seed * 11 + 5, 0.05, 0.95);
  in.init = random_tensor({p.B, p.H, p.K, p.V}, accumulator_dtype(dtype), p.seed * 11 + 6);
  in.q64 = as_f64(in.q);
  in.k64 = as_f64(in.k);
  in.v64 = as_f64(in.v);
  in.g64 = as_f64(in.g);
  in.beta64 = as_f64(in.beta);
  in.init64 = as_f64(in.init);
  return in;
}

struct Outputs {
  Tensor out, final_state;
};

Outputs run_forward(const Inputs& in) {
  const Problem& p = in.p;
  Outputs o;
  // fp64 inputs give fp64 out; fp32 and bf16 inputs give fp32 out (what a ring accumulates).
  o.out = Tensor::empty({p.B, p.S, p.H, p.V}, in.dtype == DType::kFloat64 ? DType::kFloat64 : DType::kFloat32, kWs);
  o.final_state = Tensor::empty({p.B, p.H, p.K, p.V}, accumulator_dtype(in.dtype), kWs);
  gdn_forward(in.args(), o.out, o.final_state);
  return o;
}

Outputs run_reference(const Inputs& in) {
  const Problem& p = in.p;
  Outputs o;
  o.out = Tensor::empty({p.B, p.S, p.H, p.V}, DType::kFloat64, kWs);
  o.final_state = Tensor::empty({p.B, p.H, p.K, p.V}, DType::kFloat64, kWs);
  reference::gdn_forward(in.args64(), o.out, o.final_state);
  return o;
}

struct Grads {
  Tensor dq, dk, dv, dg, dbeta, dinit;
};

Grads alloc_grads(const Problem& p, DType dtype, DType state_dtype) {
  Grads gr;
  gr.dq = Tensor::empty({p.B, p.S, p.key_heads(), p.K}, dtype, kWs);
  gr.dk = Tensor::empty({p.B, p.S, p.key_heads(), p.K}, dtype, kWs);
  gr.dv = Tensor::empty({p.B, p.S, p.H, p.V}, dtype, kWs);
  gr.dg = Tensor::empty({p.B, p.S, p.H}, dtype, kWs);
  gr.dbeta = Tensor::empty({p.B, p.S, p.H}, dtype, kWs);
  gr.dinit = Tensor::empty({p.B, p.H, p.K, p.V}, state_dtype, kWs);
  return gr;
}

void expect_grads_close(const Grads& got, const Grads& want, double atol, double rtol, const std::string& tag) {
  EXPECT_TRUE(all_close(to_double(got.dq), to_double(want.dq), atol, rtol, tag + " dq"));
  EXPECT_TRUE(all_close(to_double(got.dk), to_double(want.dk), atol, rtol, tag + " dk"));
  EXPECT_TRUE(all_close(to_double(got.dv), to_double(want.dv), atol, rtol, tag + " dv"));
  EXPECT_TRUE(all_close(to_double(got.dg), to_double(want.dg), atol, rtol, tag + " dg"));
  EXPECT_TRUE(all_close(to_double(got.dbeta), to_double(want.dbeta), atol, rtol, tag + " dbeta"));
  EXPECT_TRUE(all_close(to_double(got.dinit), to_double(want.dinit), atol, rtol, tag + " dinitial_state"));
}

Grads run_backward(const Inputs& in, const TensorView& dout, const TensorView& dfin, DType grad_dtype);
Grads run_reference_backward(const Inputs& in, const TensorView& dout, const TensorView& dfin);

// The kernel's forward of `in` against the fp64 recurrence: out and final_state within atol + rtol |want|, named by
// `tag`. Returns the kernel's outputs.
Outputs expect_forward_matches_reference(const Inputs& in, double atol, double rtol, const std::string& tag) {
  Outputs got = run_forward(in);
  const Outputs want = run_reference(in);
  EXPECT_TRUE(all_close(to_double(got.out), to_double(want.out), atol, rtol, tag + " out"));
  EXPECT_TRUE(all_close(to_double(got.final_state), to_double(want.final_state), atol, rtol, tag + " final"));
  return got;
}

std::string tag_of(const Problem& p, DType dtype) {
  return std::string(dtype_name(dtype)) + " S=" + std::to_string(p.S) + " C=" + std::to_string(p.chunk) +
         " Hv=" + std::to_string(p.H) + " Hk=" + std::to_string(p.key_heads()) + (p.l2 ? " l2" : " nol2") +
         (p.with_init ? " init" : " noinit");
}

// ---- forward vs the recurrence -----------------------------------------------------------------------------

class GdnForward : public ::testing::TestWithParam<std::tuple<std::int64_t, bool, bool>> {};

TEST_P(GdnForward, MatchesRecurrenceFp64AndFp32) {
  Problem p;
  std::tie(p.S, p.with_init, p.l2) = GetParam();
  p.seed = static_cast<std::uint64_t>(p.S * 4 + p.with_init * 2 + p.l2);
  for (DType dtype : {DType::kFloat64, DType::kFloat32, DType::kBFloat16}) {
    const Inputs in = make_inputs(p, dtype);
    const Outputs got = run_forward(in);
    const Outputs want = run_reference(in);
    const double atol = dtype == DType::kFloat64 ? 1e-10 : 2e-5;
    const double rtol = dtype == DType::kFloat64 ? 1e-9 : 1e-4;
    const std::string tag = tag_of(p, dtype);
    EXPECT_TRUE(all_close(to_double(got.out), to_double(want.out), atol, rtol, tag + " out"));
    EXPECT_TRUE(all_close(to_double(got.final_state), to_double(want.final_state), atol, rtol, tag + " final_state"));
  }
}

// S in {1, C-1, C, C+1, 2C+5, 1000} with C = 64.
INSTANTIATE_TEST_SUITE_P(Lengths, GdnForward,
                         ::testing::Combine(::testing::Values<std::int64_t>(1, 63, 64, 65, 133, 1000),
                                            ::testing::Bool(), ::testing::Bool()),
                         [](const auto& info) {
                           return "S" + std::to_string(std::get<0>(info.param)) +
                                  (std::get<1>(info.param) ? "_init" : "_noinit") +
                                  (std::get<2>(info.param) ? "_l2" : "_nol2");
                         });

TEST(GdnForwardMisc, SmallChunksAndZeroLength) {
  for (std::int64_t chunk : {1, 3, 16}) {
    Problem p;
    p.S = 37;
    p.chunk = chunk;
    const Inputs in = make_inputs(p, DType::kFloat64);
    const Outputs got = run_forward(in);
    const Outputs want = run_reference(in);
    EXPECT_TRUE(all_close(to_double(got.out), to_double(want.out), 1e-10, 1e-9, tag_of(p, in.dtype) + " out"));
    EXPECT_TRUE(all_close(to_double(got.final_state), to_double(want.final_state), 1e-10, 1e-9,
                          tag_of(p, in.dtype) + " final_state"));
  }
  {
    // Strong decay (g down to -30 per token): exp(gamma) underflows inside a chunk; no NaN, same values.
    Problem p;
    p.S = 70;
    Inputs in = make_inputs(p, DType::kFloat64);
    in.g = random_tensor({p.B, p.S, p.H}, DType::kFloat64, 3, -30.0, -5.0);
    in.g64 = as_f64(in.g);
    const Outputs got = run_forward(in);
    const Outputs want = run_reference(in);
    EXPECT_TRUE(all_close(to_double(got.out), to_double(want.out), 1e-10, 1e-9, "strong decay out"));
    EXPECT_TRUE(
        all_close(to_double(got.final_state), to_double(want.final_state), 1e-10, 1e-9, "strong decay final_state"));
    Tensor dout = random_tensor({p.B, p.S, p.H, p.V}, DType::kFloat64, 4);
    const Grads g = run_backward(in, dout, TensorView(), DType::kFloat64);
    const Grads gw = run_reference_backward(in, dout, TensorView());
    expect_grads_close(g, gw, 1e-10, 1e-9, "strong decay");
  }
  {
    // chunk_size far beyond S is one chunk of S tokens: the same result as chunk_size = S, without sizing the
    // scratch for chunk_size (1 << 20 used to ask for terabytes).
    Problem p;
    p.S = 37;
    p.chunk = 37;
    const Inputs in = make_inputs(p, DType::kFloat32);
    const Outputs want = run_forward(in);
    Tensor dout = random_tensor({p.B, p.S, p.H, p.V}, DType::kFloat32, 5);
    const Grads gw = run_backward(in, dout, TensorView(), DType::kFloat32);
    Problem huge = p;
    huge.chunk = std::int64_t{1} << 20;
    const Inputs in_huge = make_inputs(huge, DType::kFloat32);
    const Outputs got = run_forward(in_huge);
    EXPECT_EQ(to_double(got.out), to_double(want.out));
    EXPECT_EQ(to_double(got.final_state), to_double(want.final_state));
    const Grads g = run_backward(in_huge, dout, TensorView(), DType::kFloat32);
    expect_grads_close(g, gw, 0, 0, "chunk_size 2^20 vs S");
  }
  Problem p;
  p.S = 0;
  const Inputs in = make_inputs(p, DType::kFloat32);
  const Outputs got = run_forward(in);
  EXPECT_TRUE(all_close(to_double(got.final_state), to_double(in.init), 0, 0, "S=0 final_state"));
  Tensor dfin = random_tensor({p.B, p.H, p.K, p.V}, DType::kFloat32, 9);
  Tensor dout = Tensor::empty({p.B, 0, p.H, p.V}, DType::kFloat32, kWs);
  const Grads g = run_backward(in, dout, dfin, DType::kFloat32);
  EXPECT_TRUE(all_close(to_double(g.dinit), to_double(dfin), 0, 0, "S=0 dinitial_state"));
}

TEST(GdnForwardMisc, RejectsBadShapes) {
  Problem p;
  const Inputs in = make_inputs(p, DType::kFloat32);
  GdnForwardArgs a = in.args();
  Tensor out = Tensor::empty({p.B, p.S, p.H, p.V}, DType::kFloat32, kWs);
  Tensor bad = Tensor::empty({p.B, p.S, p.H, p.K + 1}, DType::kFloat32, kWs);
  a.k = bad;
  EXPECT_THROW(gdn_forward(a, out, TensorView()), Error);
  a = in.args();
  a.chunk_size = 0;
  EXPECT_THROW(gdn_forward(a, out, TensorView()), Error);
  a = in.args();
  Tensor init64 = Tensor::empty({p.B, p.H, p.K, p.V}, DType::kFloat64, kWs);
  a.initial_state = init64;  // fp32 inputs need an fp32 state
  EXPECT_THROW(gdn_forward(a, out, TensorView()), Error);
  a = in.args();
  a.scale = std::numeric_limits<float>::quiet_NaN();  // was silently replaced by 1/sqrt(K)
  EXPECT_THROW(gdn_forward(a, out, TensorView()), Error);
}

// ---- the fp64 reference's gradients against finite differences ----------------------------------------------

// L = sum(out * wo) + sum(final_state * ws), all fp64.
double reference_loss(const GdnForwardArgs& a, const Problem& p, const std::vector<double>& wo,
                      const std::vector<double>& ws) {
  Tensor out = Tensor::empty({p.B, p.S, p.H, p.V}, DType::kFloat64, kWs);
  Tensor fin = Tensor::empty({p.B, p.H, p.K, p.V}, DType::kFloat64, kWs);
  reference::gdn_forward(a, out, fin);
  double l = 0;
  for (std::int64_t i = 0; i < out.numel(); ++i) l += out.data_as<double>()[i] * wo[i];
  for (std::int64_t i = 0; i < fin.numel(); ++i) l += fin.data_as<double>()[i] * ws[i];
  return l;
}

TEST(GdnReference, GradientsMatchFiniteDifferences) {
  // (l2, key heads) with 2 value heads: one-to-one with and without the normalisation, and both value heads on one
  // key head (dq and dk sum over them).
  for (const auto& [l2, hk] : {std::pair{true, 2}, std::pair{false, 2}, std::pair{true, 1}, std::pair{false, 1}}) {
    const Problem p{.B = 2, .S = 7, .H = 2, .Hk = hk, .K = 4, .V = 3, .l2 = l2};
    Inputs in = make_inputs(p, DType::kFloat64);
    const std::vector<double> wo = test::random_values(p.B * p.S * p.H * p.V, 91);
    const std::vector<double> ws = test::random_values(p.B * p.H * p.K * p.V, 92);
    Tensor dout = Tensor::empty({p.B, p.S, p.H, p.V}, DType::kFloat64, kWs);
    Tensor dfin = Tensor::empty({p.B, p.H, p.K, p.V}, DType::kFloat64, kWs);
    std::memcpy(dout.data(), wo.data(), dout.nbytes());
    std::memcpy(dfin.data(), ws.data(), dfin.nbytes());
    Grads gr = alloc_grads(p, DType::kFloat64, DType::kFloat64);
    GdnBackwardArgs ba{in.args64(), dout, dfin};
    reference::gdn_backward(ba, gr.dq, gr.dk, gr.dv, gr.dg, gr.dbeta, gr.dinit);
    const std::pair<Tensor*, Tensor*> pairs[] = {{&in.q64, &gr.dq}, {&in.k64, &gr.dk},       {&in.v64, &gr.dv},
                                                 {&in.g64, &gr.dg}, {&in.beta64, &gr.dbeta}, {&in.init64, &gr.dinit}};
    const char* names[] = {"dq", "dk", "dv", "dg", "dbeta", "dinitial_state"};
    const double h = 1e-6;
    for (int n = 0; n < 6; ++n) {
      double* x = pairs[n].first->data_as<double>();
      std::vector<double> fd(static_cast<std::size_t>(pairs[n].first->numel()));
      for (std::size_t i = 0; i < fd.size(); ++i) {
        const double x0 = x[i];
        x[i] = x0 + h;
        const double lp = reference_loss(in.args64(), p, wo, ws);
        x[i] = x0 - h;
        const double lm = reference_loss(in.args64(), p, wo, ws);
        x[i] = x0;
        fd[i] = (lp - lm) / (2 * h);
      }
      // Central differences with h = 1e-6 on O(1) values: truncation ~1e-12, cancellation ~1e-10.
      EXPECT_TRUE(
          all_close(to_double(*pairs[n].second), fd, 1e-8, 1e-6,
                    std::string("reference ") + names[n] + (l2 ? " l2" : " nol2") + " Hk=" + std::to_string(hk)));
    }
  }
}

// ---- chunked backward vs the reference's backward -------------------------------------------------------------

Grads run_backward(const Inputs& in, const TensorView& dout, const TensorView& dfin, DType grad_dtype) {
  Grads gr = alloc_grads(in.p, grad_dtype, accumulator_dtype(in.dtype));
  GdnBackwardArgs ba{in.args(), dout, dfin};
  gdn_backward(ba, gr.dq, gr.dk, gr.dv, gr.dg, gr.dbeta, gr.dinit);
  return gr;
}

Grads run_reference_backward(const Inputs& in, const TensorView& dout, const TensorView& dfin) {
  Grads gr = alloc_grads(in.p, DType::kFloat64, DType::kFloat64);
  Tensor dout64 = as_f64(dout);
  Tensor dfin64;
  GdnBackwardArgs ba{in.args64(), dout64, TensorView()};
  if (!dfin.empty()) {
    dfin64 = as_f64(dfin);
    ba.dfinal_state = dfin64;
  }
  reference::gdn_backward(ba, gr.dq, gr.dk, gr.dv, gr.dg, gr.dbeta, gr.dinit);
  return gr;
}

class GdnBackward : public ::testing::TestWithParam<std::tuple<std::int64_t, bool, bool>> {};

TEST_P(GdnBackward, MatchesReference) {
  Problem p;
  std::tie(p.S, p.with_init, p.l2) = GetParam();
  p.seed = static_cast<std::uint64_t>(100 + p.S * 4 + p.with_init * 2 + p.l2);
  for (DType dtype : {DType::kFloat64, DType::kFloat32, DType::kBFloat16}) {
    const Inputs in = make_inputs(p, dtype);
    Tensor dout = random_tensor({p.B, p.S, p.H, p.V}, dtype, p.seed + 7);
    Tensor dfin = random_tensor({p.B, p.H, p.K, p.V}, accumulator_dtype(dtype), p.seed + 8);
    // bf16 inputs (and dout) with fp32 gradients: the reference sees the same rounded values.
    const DType grad_dtype = dtype == DType::kBFloat16 ? DType::kFloat32 : dtype;
    const Grads got = run_backward(in, dout, p.with_init ? dfin.view() : TensorView(), grad_dtype);
    const Grads want = run_reference_backward(in, dout, p.with_init ? dfin.view() : TensorView());
    const double atol = dtype == DType::kFloat64 ? 1e-10 : 5e-5;
    const double rtol = dtype == DType::kFloat64 ? 1e-9 : 2e-4;
    expect_grads_close(got, want, atol, rtol, tag_of(p, dtype));
  }
}

INSTANTIATE_TEST_SUITE_P(Lengths, GdnBackward,
                         ::testing::Combine(::testing::Values<std::int64_t>(1, 63, 64, 65, 133, 300), ::testing::Bool(),
                                            ::testing::Bool()),
                         [](const auto& info) {
                           return "S" + std::to_string(std::get<0>(info.param)) +
                                  (std::get<1>(info.param) ? "_init" : "_noinit") +
                                  (std::get<2>(info.param) ? "_l2" : "_nol2");
                         });

TEST(GdnBackwardMisc, SmallChunksAndStateOnlySweep) {
  Problem p;
  p.S = 29;
  p.chunk = 8;
  const Inputs in = make_inputs(p, DType::kFloat64);
  Tensor dout = random_tensor({p.B, p.S, p.H, p.V}, DType::kFloat64, 5);
  Tensor dfin = random_tensor({p.B, p.H, p.K, p.V}, DType::kFloat64, 6);
  const Grads got = run_backward(in, dout, dfin, DType::kFloat64);
  const Grads want = run_reference_backward(in, dout, dfin);
  expect_grads_close(got, want, 1e-10, 1e-9, tag_of(p, in.dtype));
  // Only dinitial_state requested: the dS sweep alone gives the same value.
  Tensor dinit = Tensor::empty({p.B, p.H, p.K, p.V}, DType::kFloat64, kWs);
  GdnBackwardArgs ba{in.args(), dout, dfin};
  gdn_backward(ba, {}, {}, {}, {}, {}, dinit);
  EXPECT_TRUE(all_close(to_double(dinit), to_double(want.dinit), 1e-10, 1e-9, "state-only dinitial_state"));
}

// ---- grouped value heads (Hv = G Hk) ---------------------------------------------------------------------------

// [B, S, Hk, D] -> [B, S, Hk G, D] with head e a copy of head e / G (torch's repeat_interleave along the heads).
Tensor repeat_heads(const TensorView& t, std::int64_t G) {
  const std::int64_t rows = t.dim(0) * t.dim(1), hk = t.dim(2);
  Tensor out = Tensor::empty({t.dim(0), t.dim(1), hk * G, t.dim(3)}, t.dtype(), kWs);
  const std::size_t row = static_cast<std::size_t>(t.dim(3)) * dtype_size(t.dtype());
  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int64_t e = 0; e < hk * G; ++e) {
      std::memcpy(static_cast<char*>(out.data()) + (r * hk * G + e) * row,
                  static_cast<const char*>(t.data()) + (r * hk + e / G) * row, row);
    }
  }
  return out;
}

// The adjoint of repeat_heads in fp64: [B, S, Hk G, D] -> [B, S, Hk, D] values, heads e G .. e G + G - 1 summed.
std::vector<double> sum_head_groups(const TensorView& t, std::int64_t G) {
  const std::vector<double> x = to_double(t);
  const std::int64_t D = t.dim(3), n = t.numel() / (G * D);
  std::vector<double> out(static_cast<std::size_t>(n * D), 0.0);
  for (std::int64_t r = 0; r < n; ++r) {
    for (std::int64_t j = 0; j < G; ++j) {
      for (std::int64_t e = 0; e < D; ++e) out[r * D + e] += x[(r * G + j) * D + e];
    }
  }
  return out;
}

// max |got - want| <= rel * max |want| over the tensor (relative to its scale).
::testing::AssertionResult within_rel(const TensorView& got, const TensorView& want, double rel,
                                      const std::string& what) {
  double scale = 0;
  for (double x : to_double(want)) scale = std::max(scale, std::abs(x));
  return all_close(to_double(got), to_double(want), rel * scale, 0, what + " (rel " + std::to_string(rel) + ")");
}

class GdnGrouped : public ::testing::TestWithParam<std::tuple<std::int64_t, std::int64_t>> {};

// Hv value heads on Hk key heads against the fp64 recurrence (forward and backward), and against the one-to-one
// kernel on q and k repeated to Hv heads, whose dq and dk summed over each group must equal the grouped ones.
TEST_P(GdnGrouped, MatchesRecurrenceAndRepeatedHeads) {
  Problem p;
  std::tie(p.H, p.Hk) = GetParam();
  const std::int64_t G = p.H / p.Hk;
  for (const std::int64_t S : {std::int64_t{1}, std::int64_t{70}, std::int64_t{133}}) {
    p.S = S;
    p.seed = static_cast<std::uint64_t>(500 + S + 7 * p.H + p.Hk);
    for (DType dtype : {DType::kFloat64, DType::kFloat32, DType::kBFloat16}) {
      const std::string tag = tag_of(p, dtype);
      const Inputs in = make_inputs(p, dtype);
      const double atol = dtype == DType::kFloat64 ? 1e-10 : 5e-5;
      const double rtol = dtype == DType::kFloat64 ? 1e-9 : 2e-4;
      const Outputs got = expect_forward_matches_reference(in, atol, rtol, tag);
      Tensor dout = random_tensor({p.B, p.S, p.H, p.V}, dtype, p.seed + 7);
      Tensor dfin = random_tensor({p.B, p.H, p.K, p.V}, accumulator_dtype(dtype), p.seed + 8);
      const DType grad_dtype = dtype == DType::kBFloat16 ? DType::kFloat32 : dtype;
      const Grads g = run_backward(in, dout, dfin, grad_dtype);
      expect_grads_close(g, run_reference_backward(in, dout, dfin), atol, rtol, tag);

      // The same problem with q and k repeated to Hv heads, through the one-to-one path.
      Inputs rep;
      rep.p = p;
      rep.p.Hk = 0;
      rep.dtype = dtype;
      rep.q = repeat_heads(in.q, G);
      rep.k = repeat_heads(in.k, G);
      for (auto [dst, src] : {std::pair{&rep.v, &in.v}, std::pair{&rep.g, &in.g}, std::pair{&rep.beta, &in.beta},
                              std::pair{&rep.init, &in.init}}) {
        *dst = Tensor::copy_of(*src, src->dtype(), kWs);
      }
      const Outputs rep_out = run_forward(rep);
      EXPECT_EQ(to_double(got.out), to_double(rep_out.out)) << tag << " out vs repeated heads";
      EXPECT_EQ(to_double(got.final_state), to_double(rep_out.final_state)) << tag << " final vs repeated heads";
      const Grads rg = run_backward(rep, dout, dfin, grad_dtype);
      // Per value head the arithmetic is identical; only the group sum differs (fp64 here, the kernel's dtype there).
      const double sum_tol = grad_dtype == DType::kFloat64 ? 1e-14 : 1e-6;
      EXPECT_TRUE(all_close(to_double(g.dq), sum_head_groups(rg.dq, G), sum_tol, sum_tol, tag + " dq vs repeated"));
      EXPECT_TRUE(all_close(to_double(g.dk), sum_head_groups(rg.dk, G), sum_tol, sum_tol, tag + " dk vs repeated"));
      for (const auto& [a, b, name] :
           {std::tuple{&g.dv, &rg.dv, "dv"}, std::tuple{&g.dg, &rg.dg, "dg"}, std::tuple{&g.dbeta, &rg.dbeta, "dbeta"},
            std::tuple{&g.dinit, &rg.dinit, "dinit"}}) {
        EXPECT_EQ(to_double(*a), to_double(*b)) << tag << " " << name << " vs repeated heads";
      }
    }
  }
}

// (Hv, Hk): Qwen3-Next's pairs, all value heads on one key head, three per key head.
INSTANTIATE_TEST_SUITE_P(Heads, GdnGrouped,
                         ::testing::Values(std::tuple<std::int64_t, std::int64_t>{4, 2},
                                           std::tuple<std::int64_t, std::int64_t>{3, 1},
                                           std::tuple<std::int64_t, std::int64_t>{6, 2}),
                         [](const auto& info) {
                           return "Hv" + std::to_string(std::get<0>(info.param)) + "_Hk" +
                                  std::to_string(std::get<1>(info.param));
                         });

TEST(GdnGroupedMisc, RejectsValueHeadsNotAMultipleOfKeyHeads) {
  Problem p;
  p.H = 4;
  p.Hk = 3;
  const Inputs in = make_inputs(p, DType::kFloat32);
  Tensor out = Tensor::empty({p.B, p.S, p.H, p.V}, DType::kFloat32, kWs);
  try {
    gdn_forward(in.args(), out, TensorView());
    ADD_FAILURE() << "Hv 4 on Hk 3 was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("value heads Hv = 4"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("multiple of key heads Hk = 3"), std::string::npos) << e.what();
  }
  Grads g = alloc_grads(p, DType::kFloat32, DType::kFloat32);
  GdnBackwardArgs ba{in.args(), TensorView(), TensorView()};
  EXPECT_THROW(gdn_backward(ba, g.dq, g.dk, g.dv, g.dg, g.dbeta, g.dinit), Error);
  Tensor m = Tensor::empty({p.B, p.H, p.K, p.K}, DType::kFloat32, kWs),
         u = Tensor::empty({p.B, p.H, p.K, p.V}, DType::kFloat32, kWs);
  GdnForwardArgs ta = in.args();
  ta.initial_state = {};
  EXPECT_THROW(gdn_transition(ta, m, u), Error);
}

// fp64 storage computes in fp64: every output and gradient within 1e-10 of the recurrence relative to its scale,
// with large values (|v| up to 1e4, |q|, |k| up to 1e3 before the normalisation, a state of 1e4), grouped heads and
// chunk boundaries inside.
TEST(GdnFp64, LargeInputsWithin1e10) {
  for (const bool l2 : {true, false}) {
    Problem p{.B = 1, .S = 200, .H = 4, .Hk = 2, .K = 24, .V = 20, .l2 = l2};
    p.seed = 901 + l2;
    Inputs in = make_inputs(p, DType::kFloat64);
    if (l2) {
      in.q = random_tensor({p.B, p.S, p.Hk, p.K}, DType::kFloat64, 31, -1e3, 1e3);
      in.k = random_tensor({p.B, p.S, p.Hk, p.K}, DType::kFloat64, 32, -1e3, 1e3);
    }
    in.v = random_tensor({p.B, p.S, p.H, p.V}, DType::kFloat64, 33, -1e4, 1e4);
    in.init = random_tensor({p.B, p.H, p.K, p.V}, DType::kFloat64, 34, -1e4, 1e4);
    in.q64 = as_f64(in.q);
    in.k64 = as_f64(in.k);
    in.v64 = as_f64(in.v);
    in.init64 = as_f64(in.init);
    const std::string tag = std::string("fp64 large ") + (l2 ? "l2" : "nol2");
    const Outputs got = run_forward(in);
    const Outputs want = run_reference(in);
    EXPECT_TRUE(within_rel(got.out, want.out, 1e-10, tag + " out"));
    EXPECT_TRUE(within_rel(got.final_state, want.final_state, 1e-10, tag + " final_state"));
    Tensor dout = random_tensor({p.B, p.S, p.H, p.V}, DType::kFloat64, 35, -1e3, 1e3);
    Tensor dfin = random_tensor({p.B, p.H, p.K, p.V}, DType::kFloat64, 36, -1e2, 1e2);
    const Grads g = run_backward(in, dout, dfin, DType::kFloat64);
    const Grads w = run_reference_backward(in, dout, dfin);
    for (const auto& [a, b, name] :
         {std::tuple{&g.dq, &w.dq, "dq"}, std::tuple{&g.dk, &w.dk, "dk"}, std::tuple{&g.dv, &w.dv, "dv"},
          std::tuple{&g.dg, &w.dg, "dg"}, std::tuple{&g.dbeta, &w.dbeta, "dbeta"},
          std::tuple{&g.dinit, &w.dinit, "dinitial_state"}}) {
      EXPECT_TRUE(within_rel(*a, *b, 1e-10, tag + " " + name));
    }
  }
}

// ---- S = 8192 in fp32 ---------------------------------------------------------------------------------------

// Tolerance: |err| <= 1e-5 + 1e-4 |ref| for out and final_state. Observed (g++ 12, AVX2): max abs error 5e-8 on out
// (values up to ~0.25) and 2e-7 on final_state (values up to ~0.5); the bound leaves room for other compilers and
// vector widths. The error does not grow with S because
// every step is a contraction (exp(g) < 1, 0 < beta < 1 with unit-norm k).
TEST(GdnLong, Fp32At8192) {
  const Problem p{.B = 1, .S = 8192, .H = 2, .K = 64, .V = 64};
  const Inputs in = make_inputs(p, DType::kFloat32);
  const Outputs got = run_forward(in);
  const Outputs want = run_reference(in);
  const auto so = test::compare(to_double(got.out), to_double(want.out));
  const auto ss = test::compare(to_double(got.final_state), to_double(want.final_state));
  double max_out = 0, max_state = 0;
  for (double x : to_double(want.out)) max_out = std::max(max_out, std::abs(x));
  for (double x : to_double(want.final_state)) max_state = std::max(max_state, std::abs(x));
  std::printf("fp32 S=8192: out max_abs_err %.3g (max |out| %.3g); final_state max_abs_err %.3g (max |state| %.3g)\n",
              so.max_abs, max_out, ss.max_abs, max_state);
  EXPECT_TRUE(all_close(to_double(got.out), to_double(want.out), 1e-5, 1e-4, "S=8192 fp32 out"));
  EXPECT_TRUE(all_close(to_double(got.final_state), to_double(want.final_state), 1e-5, 1e-4, "S=8192 fp32 final"));
}

// ---- SIMD-wide shapes and thread counts ------------------------------------------------------------------------

// Head dims that fill whole SIMD vectors (K = 32, V = 48: the fp32 kernels' register-blocked products, as at
// Qwen3-Next's K = V = 128) and a partial last chunk: forward and backward against the fp64 recurrence, in fp32 and
// fp64; and every output bitwise the same for 1 and 3 threads.
TEST(GdnSimdShapes, MatchesReferenceAndIndependentOfThreadCount) {
  Problem p{.B = 2, .S = 150, .H = 4, .Hk = 2, .K = 32, .V = 48};
  p.seed = 901;
  for (DType dtype : {DType::kFloat64, DType::kFloat32}) {
    const std::string tag = tag_of(p, dtype) + " K=32 V=48";
    const Inputs in = make_inputs(p, dtype);
    const Tensor dout = random_tensor({p.B, p.S, p.H, p.V}, dtype, p.seed + 7);
    const Tensor dfin = random_tensor({p.B, p.H, p.K, p.V}, accumulator_dtype(dtype), p.seed + 8);
    // Same tolerances as GdnBackward / GdnGrouped for each dtype.
    const double atol = dtype == DType::kFloat64 ? 1e-10 : 5e-5;
    const double rtol = dtype == DType::kFloat64 ? 1e-9 : 2e-4;
    const Outputs got = expect_forward_matches_reference(in, atol, rtol, tag);
    const Grads g = run_backward(in, dout, dfin, dtype);
    expect_grads_close(g, run_reference_backward(in, dout, dfin), atol, rtol, tag);
#ifdef _OPENMP
    const int keep = omp_get_max_threads();
    for (int threads : {1, 3}) {
      omp_set_num_threads(threads);
      const Outputs o = run_forward(in);
      const Grads t = run_backward(in, dout, dfin, dtype);
      omp_set_num_threads(keep);
      const std::string at = tag + " with " + std::to_string(threads) + " thread(s)";
      EXPECT_EQ(to_double(o.out), to_double(got.out)) << at << ": out depends on the thread count";
      EXPECT_EQ(to_double(o.final_state), to_double(got.final_state)) << at << ": final_state";
      for (const auto& [a, b, name] :
           {std::tuple{&t.dq, &g.dq, "dq"}, std::tuple{&t.dk, &g.dk, "dk"}, std::tuple{&t.dv, &g.dv, "dv"},
            std::tuple{&t.dg, &g.dg, "dg"}, std::tuple{&t.dbeta, &g.dbeta, "dbeta"},
            std::tuple{&t.dinit, &g.dinit, "dinitial_state"}}) {
        EXPECT_EQ(to_double(*a), to_double(*b)) << at << ": " << name << " depends on the thread count";
      }
    }
#endif
  }
}

// ---- splitting a sequence: chain (state by hand) and scan (transition maps) -----------------------------------

// Tokens [s0, s1) of a [B, S, ...] tensor (any dtype) as a new tensor.
Tensor slice_seq(const TensorView& t, std::int64_t s0, std::int64_t s1) {
  Shape shape = t.shape();
  const std::int64_t B = shape[0], S = shape[1];
  const std::int64_t row = t.numel() / (B * S) * static_cast<std::int64_t>(dtype_size(t.dtype()));
  shape[1] = s1 - s0;
  Tensor out = Tensor::empty(shape, t.dtype(), kWs);
  for (std::int64_t b = 0; b < B; ++b) {
    std::memcpy(static_cast<char*>(out.data()) + b * (s1 - s0) * row,
                static_cast<const char*>(t.data()) + (b * S + s0) * row, static_cast<std::size_t>((s1 - s0) * row));
  }
  return out;
}

// Writes `piece` into tokens [s0, s0 + piece S) of `t`.
void put_seq(const TensorView& piece, const TensorView& t, std::int64_t s0) {
  const std::int64_t B = t.dim(0), S = t.dim(1), n = piece.dim(1);
  const std::int64_t row = t.numel() / (B * S) * static_cast<std::int64_t>(dtype_size(t.dtype()));
  for (std::int64_t b = 0; b < B; ++b) {
    std::memcpy(static_cast<char*>(t.data()) + (b * S + s0) * row, static_cast<const char*>(piece.data()) + b * n * row,
                static_cast<std::size_t>(n * row));
  }
}

struct Piece {
  Tensor q, k, v, g, beta;
  GdnForwardArgs args(const Inputs& in, const TensorView& init) const {
    GdnForwardArgs a = gdn_args(q, k, v, g, beta, in.p.l2);
    a.initial_state = init;
    a.chunk_size = in.p.chunk;
    return a;
  }
};

class GdnSplit : public ::testing::TestWithParam<std::tuple<DType, bool>> {};

TEST_P(GdnSplit, ChainAndScanEqualOneCall) {
  const auto [dtype, grouped] = GetParam();
  const DType sd = accumulator_dtype(dtype);
  Problem p;
  p.S = 150;
  p.seed = 77;
  if (grouped) {  // 4 value heads on 2 key heads
    p.H = 4;
    p.Hk = 2;
  }
  const Inputs in = make_inputs(p, dtype);
  // Lengths 40, 1, 64, 45: a chunk boundary inside, a one-token piece, a full chunk.
  const std::vector<std::int64_t> cuts = {0, 40, 41, 105, 150};
  const int np = static_cast<int>(cuts.size()) - 1;
  const double atol = dtype == DType::kFloat64 ? 1e-10 : 3e-5;
  const double rtol = dtype == DType::kFloat64 ? 1e-9 : 2e-4;
  const Shape sshape = {p.B, p.H, p.K, p.V};

  Tensor dout = random_tensor({p.B, p.S, p.H, p.V}, dtype, 1234);
  Tensor dfin = random_tensor(sshape, sd, 1235);
  const Outputs whole = run_forward(in);
  const Grads whole_g = run_backward(in, dout, dfin, dtype);

  std::vector<Piece> pieces(np);
  std::vector<Tensor> douts(np);
  for (int i = 0; i < np; ++i) {
    pieces[i] = {slice_seq(in.q, cuts[i], cuts[i + 1]), slice_seq(in.k, cuts[i], cuts[i + 1]),
                 slice_seq(in.v, cuts[i], cuts[i + 1]), slice_seq(in.g, cuts[i], cuts[i + 1]),
                 slice_seq(in.beta, cuts[i], cuts[i + 1])};
    douts[i] = slice_seq(dout, cuts[i], cuts[i + 1]);
  }
  const DType out_dtype = whole.out.dtype();

  // Chain: forward passes final_state on; backward passes dinitial_state back.
  {
    Tensor out = Tensor::empty(whole.out.shape(), out_dtype, kWs);
    std::vector<Tensor> starts(np + 1);
    starts[0] = Tensor::copy_of(in.init, sd, kWs);
    for (int i = 0; i < np; ++i) {
      Tensor po = Tensor::empty({p.B, cuts[i + 1] - cuts[i], p.H, p.V}, out_dtype, kWs);
      starts[i + 1] = Tensor::empty(sshape, sd, kWs);
      gdn_forward(pieces[i].args(in, starts[i]), po, starts[i + 1]);
      put_seq(po, out, cuts[i]);
    }
    EXPECT_TRUE(all_close(to_double(out), to_double(whole.out), atol, rtol, "chain out"));
    EXPECT_TRUE(all_close(to_double(starts[np]), to_double(whole.final_state), atol, rtol, "chain final_state"));

    Grads g = alloc_grads(p, dtype, sd);
    Tensor ds = Tensor::copy_of(dfin, sd, kWs);
    for (int i = np - 1; i >= 0; --i) {
      Problem pp = p;
      pp.S = cuts[i + 1] - cuts[i];
      Grads pg = alloc_grads(pp, dtype, sd);
      GdnBackwardArgs ba{pieces[i].args(in, starts[i]), douts[i], ds};
      gdn_backward(ba, pg.dq, pg.dk, pg.dv, pg.dg, pg.dbeta, pg.dinit);
      put_seq(pg.dq, g.dq, cuts[i]);
      put_seq(pg.dk, g.dk, cuts[i]);
      put_seq(pg.dv, g.dv, cuts[i]);
      put_seq(pg.dg, g.dg, cuts[i]);
      put_seq(pg.dbeta, g.dbeta, cuts[i]);
      ds = std::move(pg.dinit);
    }
    g.dinit = std::move(ds);
    expect_grads_close(g, whole_g, atol, rtol, std::string("chain ") + dtype_name(dtype));
  }

  // Scan: (M, U) per piece from a zero start, exclusive scan for the start states, then the forward.
  {
    std::vector<Tensor> m(np), u(np);
    for (int i = 0; i < np; ++i) {
      m[i] = Tensor::empty({p.B, p.H, p.K, p.K}, sd, kWs);
      u[i] = Tensor::empty(sshape, sd, kWs);
      gdn_transition(pieces[i].args(in, TensorView()), m[i], u[i]);
    }
    std::vector<Tensor> starts(np + 1);
    starts[0] = Tensor::copy_of(in.init, sd, kWs);
    Tensor out = Tensor::empty(whole.out.shape(), out_dtype, kWs);
    for (int i = 0; i < np; ++i) {
      starts[i + 1] = Tensor::empty(sshape, sd, kWs);
      gdn_transition_apply(m[i], u[i], starts[i], starts[i + 1]);
      // M S + U equals the forward's final state from that start.
      Tensor po = Tensor::empty({p.B, cuts[i + 1] - cuts[i], p.H, p.V}, out_dtype, kWs);
      Tensor fin = Tensor::empty(sshape, sd, kWs);
      gdn_forward(pieces[i].args(in, starts[i]), po, fin);
      EXPECT_TRUE(all_close(to_double(starts[i + 1]), to_double(fin), atol, rtol,
                            "M S + U vs forward, piece " + std::to_string(i)));
      put_seq(po, out, cuts[i]);
    }
    EXPECT_TRUE(all_close(to_double(out), to_double(whole.out), atol, rtol, "scan out"));
    EXPECT_TRUE(all_close(to_double(starts[np]), to_double(whole.final_state), atol, rtol, "scan final_state"));
    // Composition of all maps applied to the initial state.
    Tensor cm = Tensor::copy_of(m[0], sd, kWs), cu = Tensor::copy_of(u[0], sd, kWs);
    for (int i = 1; i < np; ++i) {
      Tensor nm = Tensor::empty(cm.shape(), sd, kWs), nu = Tensor::empty(cu.shape(), sd, kWs);
      gdn_transition_compose(m[i], u[i], cm, cu, nm, nu);
      cm = std::move(nm);
      cu = std::move(nu);
    }
    Tensor fin = Tensor::empty(sshape, sd, kWs);
    gdn_transition_apply(cm, cu, starts[0], fin);
    EXPECT_TRUE(all_close(to_double(fin), to_double(whole.final_state), atol, rtol, "composed map final_state"));

    // Backward: local parts L_i (dS sweep only), reverse scan dS_start_i = M_i^T dS_end_i + L_i, full backward.
    std::vector<Tensor> local(np), ds_end(np);
    for (int i = 0; i < np; ++i) {
      local[i] = Tensor::empty(sshape, sd, kWs);
      GdnBackwardArgs ba{pieces[i].args(in, starts[i]), douts[i], TensorView()};
      gdn_backward(ba, {}, {}, {}, {}, {}, local[i]);
    }
    ds_end[np - 1] = Tensor::copy_of(dfin, sd, kWs);
    Tensor ds0 = Tensor::empty(sshape, sd, kWs);
    for (int i = np - 1; i >= 0; --i) {
      Tensor dss = Tensor::empty(sshape, sd, kWs);
      gdn_transition_apply_adjoint(m[i], ds_end[i], local[i], dss);
      if (i > 0) {
        ds_end[i - 1] = std::move(dss);
      } else {
        ds0 = std::move(dss);
      }
    }
    EXPECT_TRUE(all_close(to_double(ds0), to_double(whole_g.dinit), atol, rtol, "scan dinitial_state"));
    // The same through composed transposed maps: (M1^T, L1) o ... o (M_np^T, L_np) applied to dfin.
    Tensor am = Tensor::empty({p.B, p.H, p.K, p.K}, sd, kWs);
    gdn_transition_transpose(m[np - 1], am);
    Tensor au = Tensor::copy_of(local[np - 1], sd, kWs);
    for (int i = np - 2; i >= 0; --i) {
      Tensor mt = Tensor::empty(am.shape(), sd, kWs);
      gdn_transition_transpose(m[i], mt);
      Tensor nm = Tensor::empty(am.shape(), sd, kWs), nu = Tensor::empty(au.shape(), sd, kWs);
      gdn_transition_compose(mt, local[i], am, au, nm, nu);
      am = std::move(nm);
      au = std::move(nu);
    }
    Tensor ds0b = Tensor::empty(sshape, sd, kWs);
    gdn_transition_apply(am, au, dfin, ds0b);
    EXPECT_TRUE(all_close(to_double(ds0b), to_double(whole_g.dinit), atol, rtol, "composed adjoint dinitial_state"));

    Grads g = alloc_grads(p, dtype, sd);
    for (int i = 0; i < np; ++i) {
      Problem pp = p;
      pp.S = cuts[i + 1] - cuts[i];
      Grads pg = alloc_grads(pp, dtype, sd);
      GdnBackwardArgs ba{pieces[i].args(in, starts[i]), douts[i], ds_end[i]};
      gdn_backward(ba, pg.dq, pg.dk, pg.dv, pg.dg, pg.dbeta, TensorView());
      put_seq(pg.dq, g.dq, cuts[i]);
      put_seq(pg.dk, g.dk, cuts[i]);
      put_seq(pg.dv, g.dv, cuts[i]);
      put_seq(pg.dg, g.dg, cuts[i]);
      put_seq(pg.dbeta, g.dbeta, cuts[i]);
    }
    g.dinit = std::move(ds0);
    expect_grads_close(g, whole_g, atol, rtol, std::string("scan ") + dtype_name(dtype));
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, GdnSplit,
                         ::testing::Combine(::testing::Values(DType::kFloat64, DType::kFloat32), ::testing::Bool()),
                         [](const auto& info) {
                           return std::string(dtype_name(std::get<0>(info.param))) +
                                  (std::get<1>(info.param) ? "_grouped" : "_heads1to1");
                         });

// ---- windows: a few heads of a longer tensor, in place ------------------------------------------------------

// Rows [r0, r0 + n) of head `head` of a [B, S, H, *] (or [B, S, H]) tensor as a contiguous [B, n, 1, *] copy.
Tensor copy_window(const TensorView& t, std::int64_t r0, std::int64_t n, std::int64_t head) {
  Shape s = t.shape();
  s[1] = n;
  s[2] = 1;
  Tensor out = Tensor::empty(s, t.dtype(), kWs);
  const std::int64_t w = t.ndim() == 4 ? t.dim(3) : 1, e = static_cast<std::int64_t>(dtype_size(t.dtype()));
  for (std::int64_t b = 0; b < t.dim(0); ++b)
    for (std::int64_t r = 0; r < n; ++r)
      std::memcpy(static_cast<char*>(out.data()) + (b * n + r) * w * e,
                  static_cast<const char*>(t.data()) + ((b * t.dim(1) + r0 + r) * t.dim(2) + head) * w * e,
                  static_cast<std::size_t>(w * e));
  return out;
}

// `whole` [B, S, H, w] after a window call: inside rows [r0, r0 + n) x heads [h0, h0 + parts.size()) it must equal
// parts[h - h0] [B, n, 1, w] exactly, elsewhere `before` (untouched).
void expect_window(const TensorView& whole, const std::vector<double>& before, const std::vector<Tensor>& parts,
                   std::int64_t r0, std::int64_t n, std::int64_t h0, const std::string& what) {
  const std::vector<double> got = to_double(whole);
  std::vector<std::vector<double>> want;
  for (const Tensor& t : parts) want.push_back(to_double(t));
  const std::int64_t B = whole.dim(0), S = whole.dim(1), H = whole.dim(2), w = whole.ndim() == 4 ? whole.dim(3) : 1;
  const auto nh = static_cast<std::int64_t>(parts.size());
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t t = 0; t < S; ++t)
      for (std::int64_t h = 0; h < H; ++h)
        for (std::int64_t e = 0; e < w; ++e) {
          const std::int64_t i = ((b * S + t) * H + h) * w + e;
          const bool in = t >= r0 && t < r0 + n && h >= h0 && h < h0 + nh;
          const double x = in ? want[h - h0][((b * n + t - r0) * w) + e] : before[i];
          ASSERT_EQ(got[i], x) << what << " at b " << b << ", row " << t << ", head " << h << ", element " << e
                               << (in ? " (inside the window: vs the call on copies)" : " (outside: untouched)");
        }
}

// The problem of the window tests: 2 rows of 70 tokens, 4 value heads on 2 key heads, chunks of 16, and the window
// rows [13, 54) x value heads [1, 3) (key heads 0 and 1; 3 chunks of 16, 16 and 9 rows), with random initial_state
// and dfinal_state of the window's heads and a random dout (seeds base + 91, + 94, + 93).
struct WindowCase {
  Problem p;
  Inputs in;
  GdnWindow window{13, 41, 1, 2};
  DType od = DType::kFloat32, sd = DType::kFloat32;  // outputs and gradients; states
  Tensor init, dfin, dout;                           // [B, num_heads, K, V] (state dtype), the same, [B, S, H, V]
};

WindowCase make_window_case(DType dtype, std::uint64_t seed, std::uint64_t base) {
  WindowCase c;
  c.p.B = 2;
  c.p.S = 70;
  c.p.H = 4;
  c.p.Hk = 2;
  c.p.chunk = 16;
  c.p.seed = seed;
  c.in = make_inputs(c.p, dtype);
  c.od = dtype == DType::kFloat64 ? DType::kFloat64 : DType::kFloat32;
  c.sd = accumulator_dtype(dtype);
  const Shape state{c.p.B, c.window.num_heads, c.p.K, c.p.V};
  c.init = random_tensor(state, c.sd, base + 91);
  c.dfin = random_tensor(state, c.sd, base + 94);
  c.dout = random_tensor({c.p.B, c.p.S, c.p.H, c.p.V}, dtype, base + 93);
  return c;
}

// gdn_forward_window / gdn_backward_window against gdn_forward / gdn_backward on copies of each value head of the
// window (bitwise: the same arithmetic on the same values), with everything outside the window left untouched.
TEST(GdnWindow, EqualsTheCallOnCopiesBitwise) {
  for (DType dtype : {DType::kFloat64, DType::kFloat32, DType::kBFloat16}) {
    const WindowCase c = make_window_case(dtype, 77, 0);
    const Problem& p = c.p;
    const Inputs& in = c.in;
    const GdnWindow& window = c.window;
    const std::int64_t r0 = window.row_begin, n = window.num_rows, h0 = window.head_begin, nh = window.num_heads;
    const std::int64_t G = p.H / p.Hk;  // value heads 1, 2 read key heads 0, 1
    const DType od = c.od, sd = c.sd;
    const std::string tag = dtype_name(dtype);
    const Tensor &init = c.init, &dfin = c.dfin, &dout = c.dout;
    Tensor out = random_tensor({p.B, p.S, p.H, p.V}, od, 92), fin = random_tensor({p.B, nh, p.K, p.V}, sd, 95);
    Tensor dq = random_tensor({p.B, p.S, p.H, p.K}, od, 96), dk = random_tensor({p.B, p.S, p.H, p.K}, od, 97);
    Tensor dv = random_tensor({p.B, p.S, p.H, p.V}, od, 98), dg = random_tensor({p.B, p.S, p.H}, od, 99);
    Tensor db = random_tensor({p.B, p.S, p.H}, od, 100), dinit = random_tensor({p.B, nh, p.K, p.V}, sd, 101);
    const std::vector<double> out0 = to_double(out), dq0 = to_double(dq), dk0 = to_double(dk), dv0 = to_double(dv),
                              dg0 = to_double(dg), db0 = to_double(db);
    GdnForwardArgs a = in.args();
    a.initial_state = init;
    gdn_forward_window(a, window, out, fin);
    gdn_backward_window({a, dout, dfin}, window, dq, dk, dv, dg, db, dinit);

    std::vector<Tensor> outs, dqs, dks, dvs, dgs, dbs, fins, dinits;
    auto as_rows = [](const TensorView& t) { return t.reshape({t.dim(0), 1, t.dim(1), t.dim(2) * t.dim(3)}); };
    for (std::int64_t i = 0; i < nh; ++i) {
      const std::int64_t h = h0 + i;
      const Tensor q = copy_window(in.q, r0, n, h / G), k = copy_window(in.k, r0, n, h / G),
                   v = copy_window(in.v, r0, n, h), g = copy_window(in.g, r0, n, h),
                   beta = copy_window(in.beta, r0, n, h), init_i = copy_window(as_rows(init), 0, 1, i),
                   dfin_i = copy_window(as_rows(dfin), 0, 1, i), dout_i = copy_window(dout, r0, n, h);
      const Shape state{p.B, 1, p.K, p.V};
      const GdnForwardArgs ai{q, k, v, g, beta, init_i.view().reshape(state), p.l2, 0.0f, p.chunk};
      outs.push_back(Tensor::empty({p.B, n, 1, p.V}, od, kWs));
      fins.push_back(Tensor::empty({p.B, 1, 1, p.K * p.V}, sd, kWs));
      gdn_forward(ai, outs.back(), fins.back().view().reshape(state));
      for (auto* list : {&dqs, &dks}) list->push_back(Tensor::empty({p.B, n, 1, p.K}, od, kWs));
      dvs.push_back(Tensor::empty({p.B, n, 1, p.V}, od, kWs));
      for (auto* list : {&dgs, &dbs}) list->push_back(Tensor::empty({p.B, n, 1}, od, kWs));
      dinits.push_back(Tensor::empty({p.B, 1, 1, p.K * p.V}, sd, kWs));
      gdn_backward({ai, dout_i, dfin_i.view().reshape(state)}, dqs.back(), dks.back(), dvs.back(), dgs.back(),
                   dbs.back(), dinits.back().view().reshape(state));
    }
    expect_window(out, out0, outs, r0, n, h0, tag + " out");
    expect_window(dq, dq0, dqs, r0, n, h0, tag + " dq (per value head)");
    expect_window(dk, dk0, dks, r0, n, h0, tag + " dk (per value head)");
    expect_window(dv, dv0, dvs, r0, n, h0, tag + " dv");
    expect_window(dg, dg0, dgs, r0, n, h0, tag + " dg");
    expect_window(db, db0, dbs, r0, n, h0, tag + " dbeta");
    // States [B, nh, K, V] seen as [B, 1, nh, K V]: every head is inside the window.
    expect_window(as_rows(fin), {}, fins, 0, 1, 0, tag + " final_state");
    expect_window(as_rows(dinit), {}, dinits, 0, 1, 0, tag + " dinitial_state");
  }
}

TEST(GdnWindow, RejectsWindowsOutsideTheTensors) {
  Problem p;
  p.H = 4;
  p.Hk = 2;
  p.with_init = false;
  const Inputs in = make_inputs(p, DType::kFloat32);
  Tensor out = Tensor::empty({p.B, p.S, p.H, p.V}, DType::kFloat32, kWs);
  for (const GdnWindow w : {GdnWindow{0, 0, 0, 1}, GdnWindow{10, 7, 0, 1}, GdnWindow{-1, 2, 0, 1},
                            GdnWindow{0, 4, 3, 2}, GdnWindow{0, 4, 0, 0}}) {
    EXPECT_THROW(gdn_forward_window(in.args(), w, out, {}), Error)
        << "rows [" << w.row_begin << ", +" << w.num_rows << "), heads [" << w.head_begin << ", +" << w.num_heads
        << ")";
  }
  // A state of the whole head count where the window has 1 head.
  Tensor fin = Tensor::empty({p.B, p.H, p.K, p.V}, DType::kFloat32, kWs);
  EXPECT_THROW(gdn_forward_window(in.args(), {0, 4, 0, 1}, out, fin), Error);
}

// Work ahead (GdnAhead): a window call that finds 0, some or all of its chunks computed ahead gives bitwise the
// results of the call without it, forward and backward; the independent reference is the call without work ahead
// (itself checked against copies above and the fp64 recurrence).
TEST(GdnAhead, WindowWithWorkAheadIsBitwiseTheWindowWithout) {
  for (DType dtype : {DType::kFloat64, DType::kFloat32, DType::kBFloat16}) {
    const WindowCase c = make_window_case(dtype, 78, 100);
    const Problem& p = c.p;
    const GdnWindow& window = c.window;  // 3 chunks of 16, 16 and 9 rows
    const std::int64_t nh = window.num_heads;
    const DType od = c.od, sd = c.sd;
    const Tensor &init = c.init, &dfin = c.dfin, &dout = c.dout;
    GdnForwardArgs a = c.in.args();
    a.initial_state = init;
    struct Results {
      Tensor out, fin, dq, dk, dv, dg, db, dinit;
    };
    // Every output starts from the same random values, so the rows outside the window are compared too.
    auto run = [&](std::int64_t fwd_done, std::int64_t bwd_done) {
      Results r{random_tensor({p.B, p.S, p.H, p.V}, od, 192), random_tensor({p.B, nh, p.K, p.V}, sd, 195),
                random_tensor({p.B, p.S, p.H, p.K}, od, 196), random_tensor({p.B, p.S, p.H, p.K}, od, 197),
                random_tensor({p.B, p.S, p.H, p.V}, od, 198), random_tensor({p.B, p.S, p.H}, od, 199),
                random_tensor({p.B, p.S, p.H}, od, 200),      random_tensor({p.B, nh, p.K, p.V}, sd, 201)};
      if (fwd_done < 0) {
        gdn_forward_window(a, window, r.out, r.fin);
      } else {
        GdnForwardArgs no_start = a;
        no_start.initial_state = {};  // the forward's work ahead does not read it
        GdnAhead ahead = gdn_forward_ahead(no_start, window);
        EXPECT_EQ(ahead.num_chunks, 3);
        for (std::int64_t i = 0; i < fwd_done; ++i) gdn_ahead_step(no_start, ahead, 1);
        // The test-mode route (SEQPAR_LOWERED_ATTENTION = 1, the .composed ctest) computes nothing ahead.
        if (ahead.buffer.defined()) {
          EXPECT_EQ(ahead.chunks_done, fwd_done);
        }
        gdn_forward_window(a, window, r.out, r.fin, &ahead);
      }
      const GdnBackwardArgs b{a, dout, dfin};
      if (bwd_done < 0) {
        gdn_backward_window(b, window, r.dq, r.dk, r.dv, r.dg, r.db, r.dinit);
      } else {
        GdnAhead ahead = gdn_backward_ahead({a, {}, {}}, window);
        const bool computes = ahead.buffer.defined();  // not under the test-mode route
        if (bwd_done > 0) {
          EXPECT_EQ(gdn_ahead_step(a, ahead, bwd_done), !computes || bwd_done == 3);
        }
        gdn_backward_window(b, window, r.dq, r.dk, r.dv, r.dg, r.db, r.dinit, &ahead);
        if (computes) {
          EXPECT_TRUE(ahead.complete());
        }
      }
      return r;
    };
    const Results want = run(-1, -1);
    for (std::int64_t done = 0; done <= 3; ++done) {
      const Results got = run(done, done);
      const std::string tag = std::string(dtype_name(dtype)) + ", " + std::to_string(done) + " chunks ahead: ";
      auto same = [&](const Tensor& x, const Tensor& y, const char* what) {
        EXPECT_TRUE(all_close(to_double(x), to_double(y), 0.0, 0.0, tag + what));
      };
      same(got.out, want.out, "out");
      same(got.fin, want.fin, "final_state");
      same(got.dq, want.dq, "dq");
      same(got.dk, want.dk, "dk");
      same(got.dv, want.dv, "dv");
      same(got.dg, want.dg, "dg");
      same(got.db, want.db, "dbeta");
      same(got.dinit, want.dinit, "dinitial_state");
    }
  }
}

TEST(GdnAhead, RejectsWorkAheadOfAnotherWindowOrDirection) {
  Problem p;
  p.H = 4;
  p.Hk = 2;
  p.S = 40;
  p.chunk = 8;
  p.with_init = false;
  const Inputs in = make_inputs(p, DType::kFloat32);
  Tensor out = Tensor::empty({p.B, p.S, p.H, p.V}, DType::kFloat32, kWs);
  Tensor dv = Tensor::empty({p.B, p.S, p.H, p.V}, DType::kFloat32, kWs);
  GdnAhead ahead = gdn_forward_ahead(in.args(), {0, 16, 1, 1});
  EXPECT_THROW(gdn_ahead_step(in.args(), ahead, 0), Error);                            // max_chunks < 1
  EXPECT_THROW(gdn_forward_window(in.args(), {0, 16, 2, 1}, out, {}, &ahead), Error);  // another head
  EXPECT_THROW(gdn_forward_window(in.args(), {8, 16, 1, 1}, out, {}, &ahead), Error);  // other rows
  EXPECT_THROW(gdn_backward_window({in.args(), {}, {}}, {0, 16, 1, 1}, {}, {}, dv, {}, {}, {}, &ahead),
               Error);                                                // made for the forward
  EXPECT_THROW(gdn_forward_ahead(in.args(), {30, 16, 0, 1}), Error);  // rows past the tensors
  EXPECT_NO_THROW(gdn_forward_window(in.args(), {0, 16, 1, 1}, out, {}, &ahead));
}

}  // namespace
}  // namespace seqpar::attn
