// The GDN forward composed from the ops table (attention/ops/gdn_composed.h) on the selected table: against the
// token-by-token fp64 recurrence (attention/reference/gdn_reference.h) at atol 1e-10 / rtol 1e-9 in fp64 (the
// tolerance of test_gdn.cc), and against the CPU chunk kernel (attention/gdn.h) in fp32 and bf16 inputs at
// atol 2e-5 / rtol 1e-4 (different summation orders). Covers lengths around the chunk, chunk sizes, grouped value
// heads, initial / final state, no L2 norm, strong decay, packed rows (cu_seqlens, empty documents) and argument
// errors. The backward (gdn_backward_composed) the same way: every gradient against the fp64 reference's backward
// (itself checked against finite differences in test_gdn.cc) and against the CPU kernel's, with dout and
// dfinal_state, grouped heads, packed rows, and the dinitial_state-only sweep.
// The table: the CPU one, or the CUDA one with SEQPAR_TEST_DEVICE=cuda (tests/util/ops_table.h).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <functional>
#include <cstring>
#include <string>
#include <vector>

#include "attention/gdn.h"
#include "attention/ops/gdn_composed.h"
#include "attention/ops/staging.h"
#include "attention/reference/gdn_reference.h"
#include "runtime/tensor_ops.h"
#include "tests/util/ops_table.h"
#include "tests/util/test_util.h"

namespace seqpar::attn {
namespace {

using test::all_close, test::random_tensor, test::to_double;
constexpr MemCategory kWs = MemCategory::kWorkspace;

struct Problem {
  std::int64_t B = 2, S = 16, H = 4, Hk = 2, K = 8, V = 6, chunk = 16;
  bool l2 = true, with_init = true;
  std::vector<std::int64_t> lens = {};  // packed documents (B = 1, S = their sum)
  double g_lo = -0.3, g_hi = -0.005;
  std::uint64_t seed = 1;
  std::string tag() const {
    std::string t = "S=" + std::to_string(S) + " C=" + std::to_string(chunk) + " H=" + std::to_string(H) +
                    " Hk=" + std::to_string(Hk) + (l2 ? " l2" : " nol2") + (with_init ? " init" : " noinit");
    if (!lens.empty()) t += " docs=" + std::to_string(lens.size());
    return t;
  }
};

struct Inputs {
  Tensor q, k, v, g, beta, init, cu;
  GdnForwardArgs args;
  std::int64_t states = 0;
};

Inputs make(const Problem& p, DType dtype) {
  Inputs r;
  r.states = p.lens.empty() ? p.B : static_cast<std::int64_t>(p.lens.size());
  const double kr = p.l2 ? 1.0 : 1.0 / std::sqrt(static_cast<double>(p.K));
  r.q = random_tensor({p.B, p.S, p.Hk, p.K}, dtype, p.seed * 11 + 1);
  r.k = random_tensor({p.B, p.S, p.Hk, p.K}, dtype, p.seed * 11 + 2, -kr, kr);
  r.v = random_tensor({p.B, p.S, p.H, p.V}, dtype, p.seed * 11 + 3);
  r.g = random_tensor({p.B, p.S, p.H}, dtype, p.seed * 11 + 4, p.g_lo, p.g_hi);
  r.beta = random_tensor({p.B, p.S, p.H}, dtype, p.seed * 11 + 5, 0.05, 0.95);
  r.init = random_tensor({r.states, p.H, p.K, p.V}, accumulator_dtype(dtype), p.seed * 11 + 6);
  r.args = {r.q, r.k, r.v, r.g, r.beta, p.with_init ? TensorView(r.init) : TensorView(), p.l2, 0.0f, p.chunk};
  if (!p.lens.empty()) {
    r.cu = Tensor::empty({static_cast<std::int64_t>(p.lens.size()) + 1}, DType::kInt64, kWs);
    std::int64_t* c = r.cu.data_as<std::int64_t>();
    c[0] = 0;
    for (std::size_t i = 0; i < p.lens.size(); ++i) c[i + 1] = c[i] + p.lens[i];
    r.args.cu_seqlens = r.cu;
  }
  return r;
}

struct Out {
  Tensor out, fin;
};

Out alloc(const Problem& p, const Inputs& r, DType out_dtype, DType state_dtype) {
  return {Tensor::empty({p.B, p.S, p.H, p.V}, out_dtype, kWs),
          Tensor::empty({r.states, p.H, p.K, p.V}, state_dtype, kWs)};
}

void expect_fp64_matches_reference(const Problem& p) {
  const Inputs r = make(p, DType::kFloat64);
  Out got = alloc(p, r, DType::kFloat64, DType::kFloat64), want = alloc(p, r, DType::kFloat64, DType::kFloat64);
  test::composed::gdn_forward(r.args, got.out, got.fin);
  reference::gdn_forward(r.args, want.out, want.fin);
  EXPECT_TRUE(all_close(to_double(got.out), to_double(want.out), 1e-10, 1e-9, "fp64 " + p.tag() + " out"));
  EXPECT_TRUE(all_close(to_double(got.fin), to_double(want.fin), 1e-10, 1e-9, "fp64 " + p.tag() + " final_state"));
}

void expect_matches_cpu_kernel(const Problem& p, DType dtype) {
  const Inputs r = make(p, dtype);
  Out got = alloc(p, r, DType::kFloat32, DType::kFloat32), want = alloc(p, r, DType::kFloat32, DType::kFloat32);
  test::composed::gdn_forward(r.args, got.out, got.fin);
  gdn_forward(r.args, want.out, want.fin);
  const std::string tag = std::string(dtype_name(dtype)) + " " + p.tag();
  EXPECT_TRUE(all_close(to_double(got.out), to_double(want.out), 2e-5, 1e-4, tag + " out"));
  EXPECT_TRUE(all_close(to_double(got.fin), to_double(want.fin), 2e-5, 1e-4, tag + " final_state"));
}

// The six gradients of a backward call; dinitial_state [states, H, K, V].
struct Grads {
  Tensor dq, dk, dv, dg, dbeta, dinit;
};

Grads alloc_grads(const Problem& p, const Inputs& r, DType dtype, DType state_dtype) {
  return {Tensor::empty({p.B, p.S, p.Hk, p.K}, dtype, kWs), Tensor::empty({p.B, p.S, p.Hk, p.K}, dtype, kWs),
          Tensor::empty({p.B, p.S, p.H, p.V}, dtype, kWs),  Tensor::empty({p.B, p.S, p.H}, dtype, kWs),
          Tensor::empty({p.B, p.S, p.H}, dtype, kWs),       Tensor::empty({r.states, p.H, p.K, p.V}, state_dtype, kWs)};
}

// The backward composed (`run`) against `want_fn` (the fp64 reference, or the CPU kernel) on the same inputs, dout
// and dfinal_state (when with_dfinal).
template <typename WantFn>
void expect_backward_close(const Problem& p, DType dtype, bool with_dfinal, double atol, double rtol, WantFn want_fn,
                           const std::string& what) {
  const Inputs r = make(p, dtype);
  const DType sd = accumulator_dtype(dtype), gd = sd;
  const Tensor dout = random_tensor({p.B, p.S, p.H, p.V}, dtype, p.seed * 11 + 7);
  const Tensor dfin = random_tensor({r.states, p.H, p.K, p.V}, sd, p.seed * 11 + 8);
  const GdnBackwardArgs ba{r.args, dout, with_dfinal ? dfin.view() : TensorView()};
  Grads got = alloc_grads(p, r, gd, sd), want = alloc_grads(p, r, gd, sd);
  test::composed::gdn_backward(ba, got.dq, got.dk, got.dv, got.dg, got.dbeta, got.dinit);
  want_fn(ba, want);
  const std::string tag = what + " " + std::string(dtype_name(dtype)) + " " + p.tag() + (with_dfinal ? " dfin" : "");
  const std::pair<const Tensor*, const Tensor*> pairs[] = {{&got.dq, &want.dq},       {&got.dk, &want.dk},
                                                           {&got.dv, &want.dv},       {&got.dg, &want.dg},
                                                           {&got.dbeta, &want.dbeta}, {&got.dinit, &want.dinit}};
  const char* names[] = {"dq", "dk", "dv", "dg", "dbeta", "dinitial_state"};
  for (int n = 0; n < 6; ++n)
    EXPECT_TRUE(all_close(to_double(*pairs[n].first), to_double(*pairs[n].second), atol, rtol, tag + " " + names[n]));
}

void expect_backward_matches_reference(const Problem& p, bool with_dfinal) {
  expect_backward_close(
      p, DType::kFloat64, with_dfinal, 1e-10, 1e-9,
      [](const GdnBackwardArgs& ba, Grads& g) {
        reference::gdn_backward(ba, g.dq, g.dk, g.dv, g.dg, g.dbeta, g.dinit);
      },
      "backward vs reference");
}

TEST(GdnComposed, LengthsAroundTheChunkFp64) {
  for (std::int64_t S : {1, 15, 16, 17, 37, 100})
    for (bool init : {false, true}) {
      Problem p;
      p.S = S;
      p.with_init = init;
      p.seed = static_cast<std::uint64_t>(S * 2 + init);
      expect_fp64_matches_reference(p);
    }
}

TEST(GdnComposed, ChunkSizesHeadsAndNoL2Fp64) {
  for (std::int64_t chunk : {1, 3, 64, 200}) {
    Problem p;
    p.S = 70;
    p.chunk = chunk;
    expect_fp64_matches_reference(p);
  }
  Problem mha;  // Hv = Hk, one batch row, larger head dims
  mha.B = 1, mha.H = 3, mha.Hk = 3, mha.K = 16, mha.V = 12, mha.S = 50, mha.chunk = 64;
  expect_fp64_matches_reference(mha);
  Problem nol2;
  nol2.l2 = false;
  nol2.S = 45;
  expect_fp64_matches_reference(nol2);
}

TEST(GdnComposed, StrongDecayFp64) {
  Problem p;
  p.S = 70;
  p.g_lo = -30.0, p.g_hi = -5.0;  // exp(gamma) underflows inside a chunk
  expect_fp64_matches_reference(p);
}

TEST(GdnComposed, PackedDocumentsFp64) {
  for (const std::vector<std::int64_t>& lens :
       {std::vector<std::int64_t>{5, 40, 0, 17}, std::vector<std::int64_t>{33}, std::vector<std::int64_t>{0, 0, 3}}) {
    Problem p;
    p.B = 1;
    p.lens = lens;
    p.S = 0;
    for (std::int64_t l : lens) p.S += l;
    for (bool init : {false, true}) {
      p.with_init = init;
      expect_fp64_matches_reference(p);
    }
  }
}

TEST(GdnComposed, MatchesCpuKernelFp32AndBf16) {
  for (DType dtype : {DType::kFloat32, DType::kBFloat16})
    for (std::int64_t S : {17, 130}) {
      Problem p;
      p.S = S;
      p.chunk = 64;
      p.K = 32, p.V = 16;
      expect_matches_cpu_kernel(p, dtype);
    }
  Problem packed;
  packed.B = 1, packed.lens = {20, 0, 51}, packed.S = 71;
  expect_matches_cpu_kernel(packed, DType::kFloat32);
}

TEST(GdnComposed, TransitionAppliedToAStateGivesTheRecurrenceFp64) {
  for (std::int64_t S : {0, 9, 40}) {
    Problem p;
    p.S = S;
    const Inputs r = make(p, DType::kFloat64);
    GdnForwardArgs seg = r.args;
    seg.initial_state = TensorView();
    Tensor m = Tensor::empty({p.B, p.H, p.K, p.K}, DType::kFloat64, kWs);
    Tensor u = Tensor::empty({p.B, p.H, p.K, p.V}, DType::kFloat64, kWs);
    test::composed::gdn_transition(seg, m, u);
    // m S_0 + u against the recurrence's final state from S_0 = r.init
    Tensor got = Tensor::empty({p.B, p.H, p.K, p.V}, DType::kFloat64, kWs);
    gdn_transition_apply(m, u, r.init, got);
    Out want = alloc(p, r, DType::kFloat64, DType::kFloat64);
    reference::gdn_forward(r.args, want.out, want.fin);
    EXPECT_TRUE(all_close(to_double(got), to_double(want.fin), 1e-10, 1e-9, "transition " + p.tag()));
  }
  Problem p;
  const Inputs r = make(p, DType::kFloat64);
  Tensor m = Tensor::empty({p.B, p.H, p.K, p.K}, DType::kFloat64, kWs);
  Tensor u = Tensor::empty({p.B, p.H, p.K, p.V}, DType::kFloat64, kWs);
  test::expect_error([&] { test::composed::gdn_transition(r.args, m, u); }, "initial_state must be empty");
}

TEST(GdnComposed, BackwardMatchesReferenceFp64) {
  for (std::int64_t S : {1, 15, 16, 17, 37})
    for (bool init : {false, true}) {
      Problem p;
      p.S = S;
      p.with_init = init;
      p.seed = static_cast<std::uint64_t>(50 + S * 2 + init);
      expect_backward_matches_reference(p, init);
    }
  for (std::int64_t chunk : {1, 3, 200}) {
    Problem p;
    p.S = 40;
    p.chunk = chunk;
    expect_backward_matches_reference(p, true);
  }
  Problem mha;  // Hv = Hk, larger head dims
  mha.B = 1, mha.H = 3, mha.Hk = 3, mha.K = 16, mha.V = 12, mha.S = 50, mha.chunk = 16;
  expect_backward_matches_reference(mha, true);
  Problem grouped;  // four value heads on one key head
  grouped.H = 4, grouped.Hk = 1, grouped.S = 33, grouped.chunk = 8;
  expect_backward_matches_reference(grouped, false);
  Problem nol2;
  nol2.l2 = false;
  nol2.S = 45;
  expect_backward_matches_reference(nol2, true);
  Problem strong;
  strong.S = 40;
  strong.g_lo = -30.0, strong.g_hi = -5.0;
  expect_backward_matches_reference(strong, true);
}

TEST(GdnComposed, BackwardPackedDocumentsFp64) {
  for (const std::vector<std::int64_t>& lens :
       {std::vector<std::int64_t>{5, 40, 0, 17}, std::vector<std::int64_t>{0, 0, 3}}) {
    Problem p;
    p.B = 1;
    p.lens = lens;
    p.S = 0;
    for (std::int64_t l : lens) p.S += l;
    for (bool init : {false, true}) {
      p.with_init = init;
      expect_backward_matches_reference(p, init);
    }
  }
}

TEST(GdnComposed, BackwardMatchesCpuKernelFp32AndBf16) {
  const auto kernel = [](const GdnBackwardArgs& ba, Grads& g) {
    gdn_backward(ba, g.dq, g.dk, g.dv, g.dg, g.dbeta, g.dinit);
  };
  for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
    Problem p;
    p.S = 130;
    p.chunk = 64;
    p.K = 32, p.V = 16;
    expect_backward_close(p, dtype, true, 5e-5, 2e-4, kernel, "backward vs kernel");
  }
  Problem packed;
  packed.B = 1, packed.lens = {20, 0, 51}, packed.S = 71;
  expect_backward_close(packed, DType::kFloat32, true, 5e-5, 2e-4, kernel, "backward vs kernel");
}

TEST(GdnComposed, BackwardStateGradientOnlyFp64) {
  // Only dinitial_state: the reverse sweep alone (no start states), against the full backward's.
  Problem p;
  p.S = 70;
  const Inputs r = make(p, DType::kFloat64);
  const Tensor dout = random_tensor({p.B, p.S, p.H, p.V}, DType::kFloat64, 77);
  const Tensor dfin = random_tensor({p.B, p.H, p.K, p.V}, DType::kFloat64, 78);
  const GdnBackwardArgs ba{r.args, dout, dfin};
  Tensor got = Tensor::empty({p.B, p.H, p.K, p.V}, DType::kFloat64, kWs);
  test::composed::gdn_backward(ba, {}, {}, {}, {}, {}, got);
  Grads want = alloc_grads(p, r, DType::kFloat64, DType::kFloat64);
  reference::gdn_backward(ba, want.dq, want.dk, want.dv, want.dg, want.dbeta, want.dinit);
  EXPECT_TRUE(all_close(to_double(got), to_double(want.dinit), 1e-10, 1e-9, "dinitial_state only"));
  Tensor bad = Tensor::empty({p.B, p.H, p.K, p.V + 1}, DType::kFloat64, kWs);
  test::expect_error([&] { test::composed::gdn_backward(ba, {}, {}, {}, {}, {}, bad); }, "dinitial_state");
}

TEST(GdnComposed, MapAlgebraMatchesTheCpuKernels) {
  // compose, apply, apply_adjoint (its output aliasing `local`) and transpose as map products, against the CPU
  // kernels of attention/gdn.h (this program installs no route, so those run the kernels) in fp32 and fp64.
  for (DType sd : {DType::kFloat64, DType::kFloat32}) {
    const std::int64_t B = 2, H = 3, K = 5, V = 4;
    const double tol = sd == DType::kFloat64 ? 1e-13 : 1e-5;
    const Tensor m1 = random_tensor({B, H, K, K}, sd, 1), m2 = random_tensor({B, H, K, K}, sd, 2),
                 u1 = random_tensor({B, H, K, V}, sd, 3), u2 = random_tensor({B, H, K, V}, sd, 4);
    const auto fresh = [&](std::int64_t n) { return Tensor::empty({B, H, K, n}, sd, kWs); };
    Tensor mg = fresh(K), ug = fresh(V), mw = fresh(K), uw = fresh(V);
    test::composed::gdn_map_product(false, m2, m1, {}, mg);
    test::composed::gdn_map_product(false, m2, u1, u2, ug);
    gdn_transition_compose(m2, u2, m1, u1, mw, uw);
    EXPECT_TRUE(all_close(to_double(mg), to_double(mw), tol, tol, "compose m"));
    EXPECT_TRUE(all_close(to_double(ug), to_double(uw), tol, tol, "compose u"));
    Tensor sg = fresh(V), sw = fresh(V);
    test::composed::gdn_map_product(false, m1, u1, u2, sg);
    gdn_transition_apply(m1, u2, u1, sw);
    EXPECT_TRUE(all_close(to_double(sg), to_double(sw), tol, tol, "apply"));
    Tensor local = fresh(V), dw = fresh(V);
    copy_convert(u2, local);
    gdn_transition_apply_adjoint(m1, u1, u2, dw);
    test::composed::gdn_map_product(true, m1, u1, local, local);  // ds_start aliases local
    EXPECT_TRUE(all_close(to_double(local), to_double(dw), tol, tol, "apply_adjoint"));
    Tensor tg = fresh(K), tw = fresh(K);
    test::composed::gdn_map_product(true, m1, {}, {}, tg);
    gdn_transition_transpose(m1, tw);
    EXPECT_EQ(to_double(tw), to_double(tg));  // a product with the identity is exact
  }
}

// The short conv composed against the fp64 reference (fp64) and the CPU kernel (fp32), forward and backward: with and
// without SiLU and conv state, W = 1 (no state rows), a short sequence (S < W - 1), packed documents (one empty).
void expect_conv_close(DType dtype, std::int64_t B, std::int64_t S, std::int64_t C, std::int64_t W, bool silu,
                       bool with_state, const std::vector<std::int64_t>& lens) {
  const std::int64_t N = lens.empty() ? B : static_cast<std::int64_t>(lens.size());
  const Tensor x = random_tensor({B, S, C}, dtype, 201), weight = random_tensor({C, W}, dtype, 202),
               state = random_tensor({N, W - 1, C}, dtype, 203), dout = random_tensor({B, S, C}, dtype, 204);
  Tensor cu;
  ShortConvArgs a{x, weight, with_state ? state.view() : TensorView(), silu};
  if (!lens.empty()) {
    cu = Tensor::empty({N + 1}, DType::kInt64, kWs);
    std::int64_t* c = cu.data_as<std::int64_t>();
    c[0] = 0;
    for (std::int64_t i = 0; i < N; ++i) c[i + 1] = c[i] + lens[i];
    a.cu_seqlens = cu;
  }
  const bool fp64 = dtype == DType::kFloat64;
  const double tol = fp64 ? 1e-12 : 1e-5;
  const auto t = [&](const Shape& s) { return Tensor::empty(s, dtype, kWs); };
  Tensor out = t({B, S, C}), fin = t({N, W - 1, C}), dx = t({B, S, C}), dw = t({C, W}), dst = t({N, W - 1, C});
  Tensor out_w = t({B, S, C}), fin_w = t({N, W - 1, C}), dx_w = t({B, S, C}), dw_w = t({C, W}),
         dst_w = t({N, W - 1, C});
  test::composed::short_conv_forward(a, out, fin);
  test::composed::short_conv_backward(a, dout, dx, dw, dst);
  if (fp64) {
    reference::short_conv_forward(a, out_w, fin_w);
    reference::short_conv_backward(a, dout, dx_w, dw_w, dst_w);
  } else {
    short_conv_forward(a, out_w, fin_w);
    short_conv_backward(a, dout, dx_w, dw_w, dst_w);
  }
  const std::string tag = std::string("conv ") + dtype_name(dtype) + " S=" + std::to_string(S) +
                          " W=" + std::to_string(W) + (silu ? " silu" : "") + (with_state ? " state" : "") +
                          (lens.empty() ? "" : " packed");
  EXPECT_TRUE(all_close(to_double(out), to_double(out_w), tol, tol, tag + " out"));
  EXPECT_EQ(to_double(fin), to_double(fin_w)) << tag << " final_conv_state";  // copies of inputs
  EXPECT_TRUE(all_close(to_double(dx), to_double(dx_w), tol, tol, tag + " dx"));
  EXPECT_TRUE(all_close(to_double(dw), to_double(dw_w), tol * 10, tol, tag + " dweight"));
  EXPECT_TRUE(all_close(to_double(dst), to_double(dst_w), tol, tol, tag + " dinitial_conv_state"));
}

TEST(GdnComposed, ShortConvMatchesReferenceAndKernel) {
  for (DType dtype : {DType::kFloat64, DType::kFloat32})
    for (bool silu : {false, true})
      for (bool state : {false, true}) {
        expect_conv_close(dtype, 2, 9, 6, 4, silu, state, {});
        expect_conv_close(dtype, 1, 2, 5, 4, silu, state, {});  // S < W - 1
      }
  expect_conv_close(DType::kFloat64, 2, 7, 3, 1, true, false, {});  // W = 1
  expect_conv_close(DType::kFloat64, 1, 12, 5, 3, true, true, {4, 0, 1, 7});
  expect_conv_close(DType::kFloat32, 1, 12, 5, 3, true, false, {4, 0, 1, 7});
}

TEST(GdnComposed, ZeroLengthGivesTheInitialState) {
  Problem p;
  p.S = 0;
  const Inputs r = make(p, DType::kFloat64);
  Out got = alloc(p, r, DType::kFloat64, DType::kFloat64);
  test::composed::gdn_forward(r.args, got.out, got.fin);
  EXPECT_EQ(to_double(r.init), to_double(got.fin));
}

// What the staging did over one call (attention/ops/staging.h).
ops::StagingCounts staged_by(const std::function<void()>& call) {
  const ops::StagingCounts a = ops::staging_counts();
  call();
  const ops::StagingCounts b = ops::staging_counts();
  return {b.in_place - a.in_place, b.converted_in - a.converted_in, b.copied_in - a.copied_in,
          b.uploaded - a.uploaded,  b.written - a.written,           b.downloaded - a.downloaded};
}

// On the CPU table every host tensor is on the table's device: a tensor of the table's dtype is used in place (no
// copy), another dtype is converted by the table's convert_in / convert_out, nothing is uploaded or downloaded; on a
// CUDA table host tensors are uploaded and downloaded, each once. A composition's writable input (the short conv's
// dout) is a copy; a map product whose out aliases its inputs still reads them first.
TEST(GdnComposed, StagingUsesTensorsOnTheTablesDeviceInPlace) {
  const bool cuda = test::ops_table_is_cuda();
  Problem p;
  for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
    const Inputs r = make(p, dtype);  // q, k, v, g, beta of dtype; initial_state fp32
    Out o = alloc(p, r, dtype, DType::kFloat32);
    const ops::StagingCounts c = staged_by([&] { test::composed::gdn_forward(r.args, o.out, o.fin); });
    const std::string tag = std::string("forward ") + dtype_name(dtype);
    const std::int64_t converted = dtype == DType::kFloat32 ? 0 : 5;
    EXPECT_EQ(c.in_place, cuda ? 0 : 6 - converted) << tag;
    EXPECT_EQ(c.converted_in, cuda ? 0 : converted) << tag;
    EXPECT_EQ(c.copied_in, 0) << tag;
    EXPECT_EQ(c.uploaded, cuda ? 6 : 0) << tag;
    EXPECT_EQ(c.written, cuda ? 0 : 2) << tag;
    EXPECT_EQ(c.downloaded, cuda ? 2 : 0) << tag;

    const Tensor dout = random_tensor({p.B, p.S, p.H, p.V}, dtype, 77);
    const Tensor dfin = random_tensor({r.states, p.H, p.K, p.V}, DType::kFloat32, 78);
    const GdnBackwardArgs ba{r.args, dout, dfin};
    Grads g = alloc_grads(p, r, dtype, DType::kFloat32);
    const ops::StagingCounts cb =
        staged_by([&] { test::composed::gdn_backward(ba, g.dq, g.dk, g.dv, g.dg, g.dbeta, g.dinit); });
    EXPECT_EQ(cb.copied_in, 0) << "backward " << dtype_name(dtype);
    EXPECT_EQ(cb.uploaded + cb.downloaded > 0, cuda) << "backward " << dtype_name(dtype);
    EXPECT_EQ(cb.written, cuda ? 0 : 6) << "backward " << dtype_name(dtype);
    if (!cuda) {
      // q, k, v, g, beta, dout of dtype; initial_state, dfinal_state fp32 (read once each)
      EXPECT_EQ(cb.converted_in, dtype == DType::kFloat32 ? 0 : 6) << "backward " << dtype_name(dtype);
      EXPECT_EQ(cb.in_place, dtype == DType::kFloat32 ? 8 : 2) << "backward " << dtype_name(dtype);
    }
  }
  // the short conv: x, weight, state in place; dout copied (the backward writes its gradient before the SiLU there)
  const Tensor x = random_tensor({1, 9, 4}, DType::kFloat32, 1), w = random_tensor({4, 3}, DType::kFloat32, 2),
               st = random_tensor({1, 2, 4}, DType::kFloat32, 3), dout = random_tensor({1, 9, 4}, DType::kFloat32, 4);
  const std::vector<double> dout_before = to_double(dout);
  Tensor dx = Tensor::empty({1, 9, 4}, DType::kFloat32, kWs), dw = Tensor::empty({4, 3}, DType::kFloat32, kWs),
         dst = Tensor::empty({1, 2, 4}, DType::kFloat32, kWs);
  const ShortConvArgs a{x, w, st, true};
  const ops::StagingCounts cc = staged_by([&] { test::composed::short_conv_backward(a, dout, dx, dw, dst); });
  EXPECT_EQ(cc.in_place, cuda ? 0 : 3);
  EXPECT_EQ(cc.copied_in, cuda ? 0 : 1);
  EXPECT_EQ(to_double(dout), dout_before);  // the caller's dout is untouched
  // out aliasing m and addend: m u + u into u's own memory
  const Tensor m = random_tensor({2, 3, 5, 5}, DType::kFloat64, 5), u = random_tensor({2, 3, 5, 4}, DType::kFloat64, 6);
  Tensor want = Tensor::empty({2, 3, 5, 4}, DType::kFloat64, kWs);
  test::composed::gdn_map_product(false, m, u, u, want);
  const Tensor mm = random_tensor({2, 3, 5, 5}, DType::kFloat64, 5);
  test::composed::gdn_map_product(true, mm, {}, {}, mm);  // out = m^T in place of m
  for (std::int64_t i = 0; i < 6; ++i)
    for (std::int64_t r = 0; r < 5; ++r)
      for (std::int64_t cidx = 0; cidx < 5; ++cidx)
        EXPECT_EQ(mm.data_as<double>()[i * 25 + r * 5 + cidx], m.data_as<double>()[i * 25 + cidx * 5 + r]);
  test::composed::gdn_map_product(false, m, u, u, u);
  EXPECT_EQ(to_double(u), to_double(want));
}

// bf16 inputs and bf16 outputs (states fp32): against the fp64 reference on the same (bf16) input values, within the
// bf16 rounding of the outputs (relative 2^-9) and fp32 arithmetic; and bitwise the bf16 rounding on the host of the
// same composition's fp32 outputs (the table's convert_out is the host conversion).
TEST(GdnComposed, Bf16InputsAndOutputsAgainstTheFp64Reference) {
  Problem p;
  p.S = 70, p.chunk = 32, p.K = 16, p.V = 8;
  const Inputs r = make(p, DType::kBFloat16);
  const auto fp64_of = [](const TensorView& t) {
    Tensor d = Tensor::empty(t.shape(), DType::kFloat64, kWs);
    copy_convert(t, d);
    return d;
  };
  const Tensor q = fp64_of(r.q), k = fp64_of(r.k), v = fp64_of(r.v), g = fp64_of(r.g), beta = fp64_of(r.beta),
               init = fp64_of(r.init);
  const GdnForwardArgs a64{q, k, v, g, beta, init, p.l2, 0.0f, p.chunk};
  Out got = alloc(p, r, DType::kBFloat16, DType::kFloat32), f32 = alloc(p, r, DType::kFloat32, DType::kFloat32),
      want = alloc(p, r, DType::kFloat64, DType::kFloat64);
  test::composed::gdn_forward(r.args, got.out, got.fin);
  test::composed::gdn_forward(r.args, f32.out, f32.fin);
  reference::gdn_forward(a64, want.out, want.fin);
  EXPECT_TRUE(all_close(to_double(got.out), to_double(want.out), 1e-4, 4e-3, "bf16 out vs fp64 reference"));
  EXPECT_TRUE(all_close(to_double(got.fin), to_double(want.fin), 1e-4, 1e-4, "fp32 final_state vs fp64 reference"));
  Tensor rounded = Tensor::empty(got.out.shape(), DType::kBFloat16, kWs);
  copy_convert(f32.out, rounded);
  EXPECT_EQ(std::memcmp(rounded.data(), got.out.data(), got.out.nbytes()), 0) << "bf16 out vs host rounding";

  // the backward: bf16 dout, bf16 gradients (dinitial_state fp32)
  const Tensor dout = random_tensor({p.B, p.S, p.H, p.V}, DType::kBFloat16, 91);
  const Tensor dout64 = fp64_of(dout);
  Grads gb = alloc_grads(p, r, DType::kBFloat16, DType::kFloat32), g32 = alloc_grads(p, r, DType::kFloat32, DType::kFloat32),
        g64 = alloc_grads(p, r, DType::kFloat64, DType::kFloat64);
  const GdnBackwardArgs ba{r.args, dout, TensorView()};
  test::composed::gdn_backward(ba, gb.dq, gb.dk, gb.dv, gb.dg, gb.dbeta, gb.dinit);
  test::composed::gdn_backward(ba, g32.dq, g32.dk, g32.dv, g32.dg, g32.dbeta, g32.dinit);
  reference::gdn_backward(GdnBackwardArgs{a64, dout64, TensorView()}, g64.dq, g64.dk, g64.dv, g64.dg, g64.dbeta,
                          g64.dinit);
  const Tensor* bf[] = {&gb.dq, &gb.dk, &gb.dv, &gb.dg, &gb.dbeta};
  const Tensor* f[] = {&g32.dq, &g32.dk, &g32.dv, &g32.dg, &g32.dbeta};
  const Tensor* w64[] = {&g64.dq, &g64.dk, &g64.dv, &g64.dg, &g64.dbeta};
  const char* names[] = {"dq", "dk", "dv", "dg", "dbeta"};
  for (int i = 0; i < 5; ++i) {
    EXPECT_TRUE(all_close(to_double(*bf[i]), to_double(*w64[i]), 1e-3, 4e-3, std::string("bf16 ") + names[i]));
    Tensor rr = Tensor::empty(bf[i]->shape(), DType::kBFloat16, kWs);
    copy_convert(*f[i], rr);
    EXPECT_EQ(std::memcmp(rr.data(), bf[i]->data(), rr.nbytes()), 0) << names[i] << " vs host rounding";
  }
  EXPECT_TRUE(all_close(to_double(gb.dinit), to_double(g64.dinit), 1e-4, 1e-4, "dinitial_state"));
}

// The CUDA route of attn::gdn_forward / gdn_backward (attention/gdn.cc): CUDA tensors on a CUDA stream run the
// composition on the CUDA table of that device, the fp32 tensors in place (no upload), bf16 converted on the device;
// against the CPU kernel on the same host values at 2e-5 / 1e-4. Needs a CUDA build and a device, else skipped.
TEST(GdnComposed, CudaTensorsTakeTheCudaRoute) {
  const std::string why = test::cuda_table_unavailable_reason();
  if (!why.empty()) GTEST_SKIP() << "the CUDA route needs a CUDA device: " << why;
  const Device dev = Device::cuda(0);
  const Stream stream{dev, nullptr};
  const auto on_device = [&](const TensorView& t) {
    Tensor d = Tensor::empty(t.shape(), t.dtype(), kWs, dev);
    copy_convert(t, d, stream);
    return d;
  };
  const auto on_host = [&](const TensorView& t) {
    Tensor h = Tensor::empty(t.shape(), t.dtype(), kWs);
    copy_convert(t, h, stream);
    return h;
  };
  Problem p;
  p.S = 70, p.chunk = 32;
  for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
    const Inputs r = make(p, dtype);
    const Tensor q = on_device(r.q), k = on_device(r.k), v = on_device(r.v), g = on_device(r.g),
                 beta = on_device(r.beta), init = on_device(r.init);
    const GdnForwardArgs a{q, k, v, g, beta, init, p.l2, 0.0f, p.chunk};
    Out want = alloc(p, r, DType::kFloat32, DType::kFloat32);
    gdn_forward(r.args, want.out, want.fin);
    const Tensor out = Tensor::empty(want.out.shape(), DType::kFloat32, kWs, dev),
                 fin = Tensor::empty(want.fin.shape(), DType::kFloat32, kWs, dev);
    const ops::StagingCounts c = staged_by([&] { gdn_forward(a, out, fin, stream); });
    const std::string tag = std::string("cuda route ") + dtype_name(dtype);
    EXPECT_EQ(c.uploaded, 0) << tag;
    EXPECT_EQ(c.downloaded, 0) << tag;
    EXPECT_EQ(c.in_place, dtype == DType::kFloat32 ? 6 : 1) << tag;
    EXPECT_TRUE(all_close(to_double(on_host(out)), to_double(want.out), 2e-5, 1e-4, tag + " out"));
    EXPECT_TRUE(all_close(to_double(on_host(fin)), to_double(want.fin), 2e-5, 1e-4, tag + " final_state"));

    const Tensor dout_h = random_tensor({p.B, p.S, p.H, p.V}, dtype, 93);
    const Tensor dout = on_device(dout_h);
    Grads gw = alloc_grads(p, r, DType::kFloat32, DType::kFloat32);
    gdn_backward(GdnBackwardArgs{r.args, dout_h, TensorView()}, gw.dq, gw.dk, gw.dv, gw.dg, gw.dbeta, gw.dinit);
    Grads gd{on_device(gw.dq), on_device(gw.dk), on_device(gw.dv), on_device(gw.dg), on_device(gw.dbeta),
             on_device(gw.dinit)};
    gdn_backward(GdnBackwardArgs{a, dout, TensorView()}, gd.dq, gd.dk, gd.dv, gd.dg, gd.dbeta, gd.dinit, stream);
    const std::pair<const Tensor*, const Tensor*> pairs[] = {{&gd.dq, &gw.dq}, {&gd.dk, &gw.dk},       {&gd.dv, &gw.dv},
                                                             {&gd.dg, &gw.dg}, {&gd.dbeta, &gw.dbeta}, {&gd.dinit, &gw.dinit}};
    for (const auto& [got, w] : pairs)
      EXPECT_TRUE(all_close(to_double(on_host(*got)), to_double(*w), 2e-5, 1e-4, tag + " gradient"));
  }
}

TEST(GdnComposed, ArgumentErrorsAreTheKernels) {
  Problem p;
  const Inputs r = make(p, DType::kFloat32);
  Out o = alloc(p, r, DType::kFloat32, DType::kFloat32);
  GdnForwardArgs bad = r.args;
  bad.chunk_size = 0;
  test::expect_error([&] { test::composed::gdn_forward(bad, o.out, o.fin); }, "chunk_size");
  Tensor wrong = Tensor::empty({p.B, p.S, p.H, p.V + 1}, DType::kFloat32, kWs);
  test::expect_error([&] { test::composed::gdn_forward(r.args, wrong, o.fin); }, "out");
}

}  // namespace
}  // namespace seqpar::attn
