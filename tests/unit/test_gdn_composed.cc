// The GDN forward composed from the ops table (attention/ops/gdn_composed.h) on the selected table: against the
// token-by-token fp64 recurrence (attention/reference/gdn_reference.h) at atol 1e-10 / rtol 1e-9 in fp64 (the
// tolerance of test_gdn.cc), and against the CPU chunk kernel (attention/gdn.h) in fp32 and bf16 inputs at
// atol 2e-5 / rtol 1e-4 (different summation orders). Covers lengths around the chunk, chunk sizes, grouped value
// heads, initial / final state, no L2 norm, strong decay, packed rows (cu_seqlens, empty documents) and argument
// errors.
// The table: the CPU one, or the CUDA one with SEQPAR_TEST_DEVICE=cuda (tests/util/ops_table.h).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "attention/gdn.h"
#include "attention/ops/gdn_composed.h"
#include "attention/reference/gdn_reference.h"
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

TEST(GdnComposed, ZeroLengthGivesTheInitialState) {
  Problem p;
  p.S = 0;
  const Inputs r = make(p, DType::kFloat64);
  Out got = alloc(p, r, DType::kFloat64, DType::kFloat64);
  test::composed::gdn_forward(r.args, got.out, got.fin);
  EXPECT_EQ(to_double(r.init), to_double(got.fin));
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
