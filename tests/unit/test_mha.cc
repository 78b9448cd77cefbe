// MHA / GQA kernels (attention/mha.h): against the fp64 reference, finite differences, block splitting + LSE
// merge, edge rows, large logits, merge edge cases, determinism and argument checks.
//
// Expected values always come from an independent computation (the naive fp64 reference, central finite
// differences of the kernel's own fp64 forward, or one unsplit call), never from constants.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#if defined(_OPENMP)
#include <omp.h>
#endif

#include "attention/cpu/mha_simd.h"
#include "attention/mha.h"
#include "attention/reference/mha_reference.h"
#include "runtime/tensor_ops.h"
#include "tests/util/test_util.h"

namespace seqpar::attn {
namespace {

constexpr MemCategory kWs = MemCategory::kWorkspace;
constexpr double kInf = std::numeric_limits<double>::infinity();

// ---- position sets ------------------------------------------------------------------------------

enum class Layout { kContiguous, kZigzag, kRandom };
const char* layout_name(Layout l) {
  switch (l) {
    case Layout::kContiguous: return "contig";
    case Layout::kZigzag: return "zigzag";
    case Layout::kRandom: return "random";
  }
  return "?";
}

struct Positions {
  std::vector<std::int64_t> q, k;
};

// contig: keys 0..Sk-1, queries the last Sq positions of the same sequence (a query block that ends with the keys,
//   as in a decoder chunk), so that Sq != Sk still sees keys under a causal mask.
// zigzag: ring of 2 ranks, sequence cut into 4 chunks of c = Sq / 2; queries are rank 0's chunks {0, 3}, keys are
//   rank 1's chunks {1, 2} (Sk must equal Sq): chunk 0 sees no key, chunk 3 sees all of them.
// random: strictly increasing sets with random gaps of 1..3, drawn from the same range for q and k.
Positions make_positions(Layout layout, std::int64_t sq, std::int64_t sk, std::uint64_t seed) {
  Positions p;
  p.q.resize(static_cast<std::size_t>(sq));
  p.k.resize(static_cast<std::size_t>(sk));
  switch (layout) {
    case Layout::kContiguous: {
      const std::int64_t offset = std::max<std::int64_t>(0, sk - sq);
      for (std::int64_t i = 0; i < sq; ++i) p.q[i] = offset + i;
      for (std::int64_t j = 0; j < sk; ++j) p.k[j] = j;
      break;
    }
    case Layout::kZigzag: {
      const std::int64_t c = sq / 2;
      for (std::int64_t i = 0; i < sq; ++i) p.q[i] = i < c ? i : 3 * c + (i - c);
      for (std::int64_t j = 0; j < sk; ++j) p.k[j] = c + j;
      break;
    }
    case Layout::kRandom: {
      const std::vector<double> u = test::random_values(sq + sk, seed, 0.0, 1.0);
      std::int64_t pos = 0;
      for (std::int64_t i = 0; i < sq; ++i) p.q[i] = (pos += 1 + static_cast<std::int64_t>(u[i] * 3.0));
      pos = -2;
      for (std::int64_t j = 0; j < sk; ++j) p.k[j] = (pos += 1 + static_cast<std::int64_t>(u[sq + j] * 3.0));
      break;
    }
  }
  return p;
}

// ---- one problem: inputs, kernel run, reference run -------------------------------------------------

struct Problem {
  std::int64_t B, Sq, Sk, Hq, Hkv, D;
  DType dtype;
  MaskSpec mask;
  Layout layout;
  float scale = 0.0f;
  double lo = -1.0, hi = 1.0;  // range of q and k values
};

struct Inputs {
  Tensor q, k, v, dout;
  Positions pos;
};

Inputs make_inputs(const Problem& p, std::uint64_t seed) {
  Inputs in;
  in.q = test::random_tensor({p.B, p.Sq, p.Hq, p.D}, p.dtype, seed + 1, p.lo, p.hi);
  in.k = test::random_tensor({p.B, p.Sk, p.Hkv, p.D}, p.dtype, seed + 2, p.lo, p.hi);
  in.v = test::random_tensor({p.B, p.Sk, p.Hkv, p.D}, p.dtype, seed + 3);
  in.dout = test::random_tensor({p.B, p.Sq, p.Hq, p.D}, p.dtype, seed + 4);
  in.pos = make_positions(p.layout, p.Sq, p.Sk, seed + 5);
  return in;
}

MhaForwardArgs args_of(const Problem& p, const Inputs& in) {
  return MhaForwardArgs{in.q, in.k, in.v, in.pos.q, in.pos.k, p.mask, p.scale};
}

struct Results {
  Tensor out, lse, dq, dk, dv;
};

// Kernel forward + backward (overwrite mode), outputs and gradients in `out_dtype`.
Results run_kernel(const Problem& p, const Inputs& in, DType out_dtype) {
  Results r;
  const MhaForwardArgs a = args_of(p, in);
  r.out = Tensor::empty(in.q.shape(), out_dtype, kWs);
  r.lse = Tensor::empty({p.B, p.Hq, p.Sq}, accumulator_dtype(p.dtype), kWs);
  mha_forward(a, r.out, r.lse);
  r.dq = Tensor::empty(in.q.shape(), out_dtype, kWs);
  r.dk = Tensor::empty(in.k.shape(), out_dtype, kWs);
  r.dv = Tensor::empty(in.k.shape(), out_dtype, kWs);
  mha_backward(MhaBackwardArgs{a, r.out, in.dout, r.lse, {}}, r.dq, r.dk, r.dv, false);
  return r;
}

// The reference on the same (already rounded) inputs, converted to fp64.
Results run_reference(const Problem& p, const Inputs& in) {
  Results r;
  Tensor q = Tensor::copy_of(in.q, DType::kFloat64, kWs), k = Tensor::copy_of(in.k, DType::kFloat64, kWs);
  Tensor v = Tensor::copy_of(in.v, DType::kFloat64, kWs), dout = Tensor::copy_of(in.dout, DType::kFloat64, kWs);
  const MhaForwardArgs a{q, k, v, in.pos.q, in.pos.k, p.mask, p.scale};
  r.out = Tensor::empty(q.shape(), DType::kFloat64, kWs);
  r.lse = Tensor::empty({p.B, p.Hq, p.Sq}, DType::kFloat64, kWs);
  reference::mha_forward(a, r.out, r.lse);
  r.dq = Tensor::empty(q.shape(), DType::kFloat64, kWs);
  r.dk = Tensor::empty(k.shape(), DType::kFloat64, kWs);
  r.dv = Tensor::empty(k.shape(), DType::kFloat64, kWs);
  reference::mha_backward(a, dout, r.dq, r.dk, r.dv);
  return r;
}

struct Tolerance {
  double atol, rtol;
};

// Inputs are the same rounded values for kernel and reference, so the error comes from the arithmetic (fp32 or
// fp64) and from rounding the outputs to the storage dtype.
Tolerance tolerance(DType dtype) {
  switch (dtype) {
    // fp64 arithmetic throughout, lse and delta included: fp64 rounding over sums of a few hundred terms.
    case DType::kFloat64: return {1e-12, 1e-10};
    // fp32 arithmetic (exp2 polynomial ~2 ulp, sums over <= a few hundred keys and D <= 256 products).
    case DType::kFloat32: return {3e-5, 3e-4};
    // bf16 outputs: 8 significant bits (relative step 2^-8 = 3.9e-3); the backward's delta uses the bf16 out.
    case DType::kBFloat16: return {2e-2, 2e-2};
    // fp16 outputs: 11 significant bits (relative step 2^-11 = 4.9e-4); delta uses the fp16 out.
    case DType::kFloat16: return {4e-3, 4e-3};
    default: break;
  }
  return {0.0, 0.0};
}

bool has_nan(const TensorView& t) {
  for (double x : test::to_double(t))
    if (std::isnan(x)) return true;
  return false;
}

void expect_matches_reference(const Problem& p, std::uint64_t seed) {
  const Inputs in = make_inputs(p, seed);
  const Results got = run_kernel(p, in, p.dtype);
  const Results want = run_reference(p, in);
  const Tolerance tol = tolerance(p.dtype);
  EXPECT_FALSE(has_nan(got.out) || has_nan(got.lse) || has_nan(got.dq) || has_nan(got.dk) || has_nan(got.dv))
      << "NaN in the kernel's results";
  EXPECT_TRUE(test::all_close(test::to_double(got.out), test::to_double(want.out), tol.atol, tol.rtol, "out"));
  // lse is fp64 for fp64 inputs, else fp32: rounding of values of size |lse| (< 10 here).
  const double lse_tol = p.dtype == DType::kFloat64 ? 1e-12 : 2e-5;
  EXPECT_TRUE(test::all_close(test::to_double(got.lse), test::to_double(want.lse), lse_tol, lse_tol, "lse"));
  EXPECT_TRUE(test::all_close(test::to_double(got.dq), test::to_double(want.dq), tol.atol, tol.rtol, "dq"));
  EXPECT_TRUE(test::all_close(test::to_double(got.dk), test::to_double(want.dk), tol.atol, tol.rtol, "dk"));
  EXPECT_TRUE(test::all_close(test::to_double(got.dv), test::to_double(want.dv), tol.atol, tol.rtol, "dv"));
}

// ---- parameterised comparison with the reference --------------------------------------------------

enum class MaskKind { kNone, kCausal, kWindowShort, kWindowLong };
const char* mask_name(MaskKind m) {
  switch (m) {
    case MaskKind::kNone: return "nomask";
    case MaskKind::kCausal: return "causal";
    case MaskKind::kWindowShort: return "window17";
    case MaskKind::kWindowLong: return "window100000";
  }
  return "?";
}
MaskSpec mask_of(MaskKind m) {
  switch (m) {
    case MaskKind::kNone: return {};
    case MaskKind::kCausal: return {true, 0};
    case MaskKind::kWindowShort: return {true, 17};     // shorter than every S used here
    case MaskKind::kWindowLong: return {true, 100000};  // longer than every S: same as causal
  }
  return {};
}

struct Case {
  DType dtype;
  std::int64_t B, Sq, Sk, Hq, Hkv, D;
  MaskKind mask;
  Layout layout;
};

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  const Case& c = info.param;
  return str_cat(dtype_name(c.dtype), "_B", c.B, "_Sq", c.Sq, "_Sk", c.Sk, "_Hq", c.Hq, "_Hkv", c.Hkv, "_D", c.D, "_",
                 mask_name(c.mask), "_", layout_name(c.layout));
}

class MhaVsReference : public ::testing::TestWithParam<Case> {};

TEST_P(MhaVsReference, ForwardAndBackward) {
  const Case& c = GetParam();
  Problem p{c.B, c.Sq, c.Sk, c.Hq, c.Hkv, c.D, c.dtype, mask_of(c.mask), c.layout};
  expect_matches_reference(p, 1000 + static_cast<std::uint64_t>(c.Sq * 7 + c.Sk * 3 + c.D));
}

std::vector<Case> all_cases() {
  std::vector<Case> cases;
  const DType f32 = DType::kFloat32;
  // Every mask kind x every layout (zigzag needs Sq = Sk), fp32.
  for (MaskKind m : {MaskKind::kNone, MaskKind::kCausal, MaskKind::kWindowShort, MaskKind::kWindowLong})
    for (Layout l : {Layout::kContiguous, Layout::kZigzag, Layout::kRandom})
      cases.push_back({f32, 1, 96, 96, 4, 2, 64, m, l});
  // Sq != Sk both ways.
  for (MaskKind m : {MaskKind::kNone, MaskKind::kCausal, MaskKind::kWindowShort}) {
    cases.push_back({f32, 1, 50, 130, 2, 1, 32, m, Layout::kContiguous});
    cases.push_back({f32, 1, 130, 50, 2, 1, 32, m, Layout::kRandom});
  }
  // S equal to the tile size (64) and tile size +- 1, causal and unmasked.
  for (std::int64_t s : {63, 64, 65, 127, 128, 129})
    for (MaskKind m : {MaskKind::kNone, MaskKind::kCausal})
      cases.push_back({f32, 1, s, s, 2, 2, 32, m, Layout::kContiguous});
  // Head dims.
  for (std::int64_t d : {32, 64, 96, 128, 256})
    cases.push_back({f32, 1, 70, 70, 2, 1, d, MaskKind::kCausal, Layout::kContiguous});
  // Head ratios Hq / Hkv = 1, 2, 4, 8 and MQA (Hkv = 1).
  for (auto [hq, hkv] : {std::pair{4, 4}, {4, 2}, {8, 2}, {8, 1}, {3, 1}})
    cases.push_back({f32, 1, 70, 70, hq, hkv, 32, MaskKind::kCausal, Layout::kRandom});
  // Batch 3.
  cases.push_back({f32, 3, 70, 90, 4, 2, 32, MaskKind::kWindowShort, Layout::kContiguous});
  cases.push_back({f32, 3, 80, 80, 2, 1, 64, MaskKind::kCausal, Layout::kZigzag});
  // Every dtype, with masks and GQA.
  for (DType dt : {DType::kFloat64, DType::kBFloat16, DType::kFloat16}) {
    cases.push_back({dt, 1, 96, 96, 4, 2, 64, MaskKind::kCausal, Layout::kZigzag});
    cases.push_back({dt, 3, 70, 130, 2, 1, 96, MaskKind::kWindowShort, Layout::kRandom});
    cases.push_back({dt, 1, 65, 65, 2, 2, 128, MaskKind::kNone, Layout::kContiguous});
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Mha, MhaVsReference, ::testing::ValuesIn(all_cases()), case_name);

// ---- finite-difference gradients in fp64 --------------------------------------------------------

class MhaGradCheck : public ::testing::TestWithParam<std::pair<MaskKind, Layout>> {};

// Loss L = sum(dout * out) with the kernel's own fp64 forward; dL/dx by central differences with step h = 1e-5:
// truncation error O(h^2 |f'''|) ~ 1e-10 and rounding error ~ 1e-16 |L| / h ~ 1e-10. Every element of q, k, v.
TEST_P(MhaGradCheck, MatchesCentralDifferences) {
  const auto [mk, layout] = GetParam();
  Problem p{1, 10, 10, 2, 1, 6, DType::kFloat64, mask_of(mk), layout};
  if (mk == MaskKind::kWindowShort) p.mask.window = 3;  // short relative to S = 12
  p.scale = 0.7f;
  const Inputs in = make_inputs(p, 77);
  const Results got = run_kernel(p, in, DType::kFloat64);
  const std::vector<double> dout = test::to_double(in.dout);
  auto loss = [&]() {
    Tensor out = Tensor::empty(in.q.shape(), DType::kFloat64, kWs);
    Tensor lse = Tensor::empty({p.B, p.Hq, p.Sq}, DType::kFloat64, kWs);
    mha_forward(args_of(p, in), out, lse);
    const double* o = out.data_as<double>();
    double l = 0.0;
    for (std::size_t i = 0; i < dout.size(); ++i) l += dout[i] * o[i];
    return l;
  };
  const double h = 1e-5;
  for (auto [t, g, name] : {std::tuple{&in.q, &got.dq, "dq"}, {&in.k, &got.dk, "dk"}, {&in.v, &got.dv, "dv"}}) {
    const std::vector<double> fd = test::central_differences(*t, h, loss);
    // Central differences: truncation and rounding errors ~1e-10 each (the kernel itself is fp64 throughout).
    EXPECT_TRUE(test::all_close(test::to_double(*g), fd, 1e-8, 1e-7, name));
  }
}

INSTANTIATE_TEST_SUITE_P(Mha, MhaGradCheck,
                         ::testing::Values(std::pair{MaskKind::kNone, Layout::kContiguous},
                                           std::pair{MaskKind::kCausal, Layout::kContiguous},
                                           std::pair{MaskKind::kWindowShort, Layout::kContiguous},
                                           std::pair{MaskKind::kCausal, Layout::kZigzag},
                                           std::pair{MaskKind::kWindowShort, Layout::kRandom}),
                         [](const auto& info) {
                           return str_cat(mask_name(info.param.first), "_", layout_name(info.param.second));
                         });

// A loss that uses lse, L = sum(dout * out) + sum(dlse * lse): MhaBackwardArgs::dlse gives dL/dq, dk, dv equal to
// central differences (as above), also with delta given, and a row with no visible key ignores its dlse.
TEST_P(MhaGradCheck, LossOnLseMatchesCentralDifferences) {
  const auto [mk, layout] = GetParam();
  Problem p{1, 10, 10, 2, 1, 6, DType::kFloat64, mask_of(mk), layout};
  if (mk == MaskKind::kWindowShort) p.mask.window = 3;
  p.scale = 0.7f;
  const Inputs in = make_inputs(p, 78);
  const Tensor dlse = test::random_tensor({p.B, p.Hq, p.Sq}, DType::kFloat64, 79, -3.0, 3.0);
  const std::vector<double> dout = test::to_double(in.dout), dl = test::to_double(dlse);
  Tensor out = Tensor::empty(in.q.shape(), DType::kFloat64, kWs);
  Tensor lse = Tensor::empty({p.B, p.Hq, p.Sq}, DType::kFloat64, kWs);
  auto loss = [&]() {
    mha_forward(args_of(p, in), out, lse);
    const double* o = out.data_as<double>();
    const double* l = lse.data_as<double>();
    double sum = 0.0;
    for (std::size_t i = 0; i < dout.size(); ++i) sum += dout[i] * o[i];
    for (std::size_t i = 0; i < dl.size(); ++i) sum += std::isfinite(l[i]) ? dl[i] * l[i] : 0.0;
    return sum;
  };
  loss();
  Tensor delta = Tensor::empty(lse.shape(), DType::kFloat64, kWs);
  mha_backward_delta(out, in.dout, delta);
  for (bool with_delta : {false, true}) {
    MhaBackwardArgs b{args_of(p, in), out, in.dout, lse, with_delta ? delta.view() : TensorView{}};
    b.dlse = dlse;
    Tensor dq = Tensor::empty(in.q.shape(), DType::kFloat64, kWs), dk = Tensor::empty(in.k.shape(), DType::kFloat64, kWs),
           dv = Tensor::empty(in.k.shape(), DType::kFloat64, kWs);
    mha_backward(b, dq, dk, dv, false);
    for (auto [t, g, name] : {std::tuple{&in.q, &dq, "dq"}, {&in.k, &dk, "dk"}, {&in.v, &dv, "dv"}}) {
      const std::vector<double> fd = test::central_differences(*t, 1e-5, loss);
      EXPECT_TRUE(test::all_close(test::to_double(*g), fd, 1e-8, 1e-7, str_cat(name, with_delta ? " (delta given)" : "")));
    }
  }
}

// ---- key blocks + LSE merge equal one call ------------------------------------------------------

// Copies keys [j0, j1) of a [B, S, H, D] tensor.
Tensor slice_seq(const TensorView& t, std::int64_t j0, std::int64_t j1, DType dtype) {
  const std::int64_t B = t.dim(0), S = t.dim(1), row = t.dim(2) * t.dim(3);
  Tensor out = Tensor::empty({B, j1 - j0, t.dim(2), t.dim(3)}, dtype, kWs);
  const std::size_t in_size = dtype_size(t.dtype()), out_size = dtype_size(dtype);
  for (std::int64_t b = 0; b < B; ++b)
    convert(static_cast<const char*>(t.data()) + static_cast<std::size_t>((b * S + j0) * row) * in_size, t.dtype(),
            static_cast<char*>(out.data()) + static_cast<std::size_t>(b * (j1 - j0) * row) * out_size, dtype,
            static_cast<std::size_t>((j1 - j0) * row));
  return out;
}

struct SplitCase {
  DType dtype;
  MaskKind mask;
  Layout layout;
  std::vector<std::int64_t> cuts;  // block boundaries inside (0, Sk)
};

class MhaKeyBlocks : public ::testing::TestWithParam<SplitCase> {};

TEST_P(MhaKeyBlocks, MergedBlocksEqualOneCall) {
  const SplitCase& sc = GetParam();
  Problem p{2, 100, 200, 4, 2, 32, sc.dtype, mask_of(sc.mask), sc.layout};
  if (sc.layout == Layout::kZigzag) p.Sk = p.Sq;
  const Inputs in = make_inputs(p, 4242);
  const DType acc = accumulator_dtype(p.dtype);
  const Results one = run_kernel(p, in, acc);

  // The merge state as the ring keeps it: out in the accumulator dtype, lse in fp64 (block lse too).
  Tensor out = Tensor::zeros(in.q.shape(), acc, kWs);
  Tensor lse = Tensor::empty({p.B, p.Hq, p.Sq}, DType::kFloat64, kWs);
  fill(lse, -kInf);
  Tensor dq = Tensor::zeros(in.q.shape(), acc, kWs);
  std::vector<double> dk_all, dv_all;  // [B, Sk, Hkv, D] assembled from the blocks
  std::vector<std::int64_t> bounds{0};
  for (std::int64_t c : sc.cuts) bounds.push_back(std::min(c, p.Sk));
  bounds.push_back(p.Sk);
  Tensor delta = Tensor::empty({p.B, p.Hq, p.Sq}, acc, kWs);
  mha_backward_delta(one.out, in.dout, delta);

  std::vector<std::vector<double>> dk_blocks, dv_blocks;
  for (std::size_t blk = 0; blk + 1 < bounds.size(); ++blk) {
    const std::int64_t j0 = bounds[blk], j1 = bounds[blk + 1];
    Tensor kb = slice_seq(in.k, j0, j1, p.dtype), vb = slice_seq(in.v, j0, j1, p.dtype);
    const std::span<const std::int64_t> kpos(in.pos.k.data() + j0, static_cast<std::size_t>(j1 - j0));
    const MhaForwardArgs a{in.q, kb, vb, in.pos.q, kpos, p.mask, p.scale};
    Tensor ob = Tensor::empty(in.q.shape(), acc, kWs);
    Tensor lb = Tensor::empty({p.B, p.Hq, p.Sq}, DType::kFloat64, kWs);
    mha_forward(a, ob, lb);
    lse_merge(out, lse, ob, lb);
    // backward of the block with the final out / lse, accumulating into gradients of the accumulator dtype
    Tensor dkb = Tensor::zeros(kb.shape(), acc, kWs), dvb = Tensor::zeros(kb.shape(), acc, kWs);
    mha_backward(MhaBackwardArgs{a, one.out, in.dout, one.lse, delta}, dq, dkb, dvb, true);
    dk_blocks.push_back(test::to_double(dkb));
    dv_blocks.push_back(test::to_double(dvb));
  }
  // reassemble [B, Sk, Hkv, D] from the per-block [B, Sk_b, Hkv, D]
  const std::int64_t row = p.Hkv * p.D;
  for (auto [blocks, all] : {std::pair{&dk_blocks, &dk_all}, {&dv_blocks, &dv_all}}) {
    for (std::int64_t b = 0; b < p.B; ++b)
      for (std::size_t blk = 0; blk < blocks->size(); ++blk) {
        const std::int64_t len = bounds[blk + 1] - bounds[blk];
        const auto& src = (*blocks)[blk];
        all->insert(all->end(), src.begin() + b * len * row, src.begin() + (b + 1) * len * row);
      }
  }
  // Merging reassociates the softmax sums: rounding differences of the accumulator dtype only.
  const double t = acc == DType::kFloat64 ? 1e-13 : 2e-6, r = acc == DType::kFloat64 ? 1e-12 : 2e-5;
  EXPECT_TRUE(test::all_close(test::to_double(out), test::to_double(one.out), t, r, "merged out"));
  EXPECT_TRUE(test::all_close(test::to_double(lse), test::to_double(one.lse), t, t, "merged lse"));
  EXPECT_TRUE(test::all_close(test::to_double(dq), test::to_double(one.dq), t, r, "accumulated dq"));
  EXPECT_TRUE(test::all_close(dk_all, test::to_double(one.dk), t, r, "accumulated dk"));
  EXPECT_TRUE(test::all_close(dv_all, test::to_double(one.dv), t, r, "accumulated dv"));
}

INSTANTIATE_TEST_SUITE_P(
    Mha, MhaKeyBlocks,
    ::testing::Values(SplitCase{DType::kFloat32, MaskKind::kNone, Layout::kContiguous, {100}},
                      SplitCase{DType::kFloat32, MaskKind::kCausal, Layout::kContiguous, {37, 64, 150}},
                      SplitCase{DType::kFloat32, MaskKind::kWindowShort, Layout::kContiguous, {1, 2, 90, 91, 199}},
                      SplitCase{DType::kFloat32, MaskKind::kCausal, Layout::kZigzag, {50}},
                      SplitCase{DType::kFloat32, MaskKind::kCausal, Layout::kRandom, {13, 77, 120, 121, 180}},
                      SplitCase{DType::kBFloat16, MaskKind::kCausal, Layout::kRandom, {64, 128}},
                      SplitCase{DType::kFloat64, MaskKind::kWindowShort, Layout::kRandom, {50, 51, 150}}),
    [](const auto& info) {
      return str_cat(dtype_name(info.param.dtype), "_", mask_name(info.param.mask), "_", layout_name(info.param.layout),
                     "_", info.param.cuts.size() + 1, "blocks");
    });

// ---- rows with no visible key ------------------------------------------------------------------

TEST(MhaEdge, RowsWithNoVisibleKey) {
  // Keys at positions 40..139; queries at 0..99 (causal): queries 0..39 see nothing; window 5 with queries in
  // steps of 7 against keys in steps of 7 offset by 3 leaves further rows empty.
  for (const MaskSpec mask : {MaskSpec{true, 0}, MaskSpec{true, 5}}) {
    Problem p{2, 100, 100, 2, 1, 32, DType::kFloat32, mask, Layout::kContiguous};
    Inputs in = make_inputs(p, 9);
    for (std::int64_t i = 0; i < p.Sq; ++i) in.pos.q[i] = mask.window ? 7 * i : i;
    for (std::int64_t j = 0; j < p.Sk; ++j) in.pos.k[j] = mask.window ? 7 * j + 3 : 40 + j;
    const Results got = run_kernel(p, in, DType::kFloat32);
    const Results want = run_reference(p, in);
    const std::vector<double> lse = test::to_double(got.lse), out = test::to_double(got.out);
    std::int64_t empty_rows = 0;
    for (std::int64_t b = 0; b < p.B; ++b)
      for (std::int64_t h = 0; h < p.Hq; ++h)
        for (std::int64_t i = 0; i < p.Sq; ++i) {
          if (lse[(b * p.Hq + h) * p.Sq + i] != -kInf) continue;
          ++empty_rows;
          for (std::int64_t d = 0; d < p.D; ++d) ASSERT_EQ(out[((b * p.Sq + i) * p.Hq + h) * p.D + d], 0.0);
        }
    EXPECT_GT(empty_rows, 0) << "the positions were meant to leave rows without keys";
    EXPECT_FALSE(has_nan(got.out) || has_nan(got.dq) || has_nan(got.dk) || has_nan(got.dv));
    EXPECT_TRUE(test::all_close(lse, test::to_double(want.lse), 2e-5, 2e-5, "lse"));
    EXPECT_TRUE(test::all_close(out, test::to_double(want.out), 3e-5, 3e-4, "out"));
    EXPECT_TRUE(test::all_close(test::to_double(got.dq), test::to_double(want.dq), 3e-5, 3e-4, "dq"));
    EXPECT_TRUE(test::all_close(test::to_double(got.dk), test::to_double(want.dk), 3e-5, 3e-4, "dk"));
    EXPECT_TRUE(test::all_close(test::to_double(got.dv), test::to_double(want.dv), 3e-5, 3e-4, "dv"));
  }
}

TEST(MhaEdge, NoVisibleKeyAtAllAndEmptyKeys) {
  Problem p{1, 64, 64, 2, 2, 32, DType::kFloat32, {true, 0}, Layout::kContiguous};
  Inputs in = make_inputs(p, 10);
  for (std::int64_t j = 0; j < p.Sk; ++j) in.pos.k[j] = 1000 + j;  // every key is in the future
  Tensor dq = Tensor::zeros(in.q.shape(), DType::kFloat32, kWs);
  Results r = run_kernel(p, in, DType::kFloat32);
  for (double x : test::to_double(r.lse)) ASSERT_EQ(x, -kInf);
  for (const TensorView* t : {&r.out.view(), &r.dq.view(), &r.dk.view(), &r.dv.view()})
    for (double x : test::to_double(*t)) ASSERT_EQ(x, 0.0);
  // Sk = 0
  Tensor k0 = Tensor::empty({1, 0, 2, 32}, DType::kFloat32, kWs),
         v0 = Tensor::empty({1, 0, 2, 32}, DType::kFloat32, kWs);
  Tensor out = test::random_tensor(in.q.shape(), DType::kFloat32, 3);
  Tensor lse = Tensor::zeros({1, 2, 64}, DType::kFloat32, kWs);
  mha_forward(MhaForwardArgs{in.q, k0, v0, {}, {}, {}, 0.0f}, out, lse);
  for (double x : test::to_double(lse)) ASSERT_EQ(x, -kInf);
  for (double x : test::to_double(out)) ASSERT_EQ(x, 0.0);
}

// A NaN in a query or in a key makes the affected rows NaN (out and lse); they used to come out as
// "no visible key" (out 0, lse -inf), a finite answer that hid the bad input. Other rows are untouched.
TEST(MhaEdge, NonFiniteInputsPropagateInsteadOfLookingMasked) {
  Problem p{1, 8, 8, 1, 1, 16, DType::kFloat32, {true, 0}, Layout::kContiguous};
  Inputs in = make_inputs(p, 12);
  const Results clean = run_kernel(p, in, DType::kFloat32);
  in.q.data_as<float>()[2 * p.D] = std::numeric_limits<float>::quiet_NaN();  // query 2
  Results r = run_kernel(p, in, DType::kFloat32);
  std::vector<double> lse = test::to_double(r.lse), out = test::to_double(r.out);
  const std::vector<double> lse0 = test::to_double(clean.lse);
  for (std::int64_t i = 0; i < p.Sq; ++i) {
    if (i == 2) {
      EXPECT_TRUE(std::isnan(lse[i])) << "lse of the NaN query: " << lse[i];
      EXPECT_TRUE(std::isnan(out[i * p.D])) << "out of the NaN query: " << out[i * p.D];
    } else {
      EXPECT_EQ(lse[i], lse0[i]) << "row " << i;
    }
  }
  in = make_inputs(p, 12);
  in.k.data_as<float>()[5 * p.D] = std::numeric_limits<float>::quiet_NaN();  // key 5, seen by queries 5..7
  r = run_kernel(p, in, DType::kFloat32);
  lse = test::to_double(r.lse);
  for (std::int64_t i = 0; i < p.Sq; ++i) {
    if (i >= 5) {
      EXPECT_TRUE(std::isnan(lse[i])) << "row " << i << " sees the NaN key: lse " << lse[i];
    } else {
      EXPECT_EQ(lse[i], lse0[i]) << "row " << i;
    }
  }
}

// ---- large logits -------------------------------------------------------------------------------

TEST(MhaEdge, LogitsOfSize1e3DoNotOverflow) {
  // q, k in [-8, 8), D = 16, scale 1: |logits| up to 1024, typically several hundred.
  for (DType dt : {DType::kFloat32, DType::kFloat64}) {
    Problem p{1, 80, 80, 2, 1, 16, dt, {true, 0}, Layout::kContiguous, 1.0f, -8.0, 8.0};
    const Inputs in = make_inputs(p, 11);
    const Results got = run_kernel(p, in, dt);
    const Results want = run_reference(p, in);
    double max_abs_lse = 0.0;
    for (double x : test::to_double(want.lse)) max_abs_lse = std::max(max_abs_lse, std::abs(x));
    EXPECT_GT(max_abs_lse, 300.0) << "the logits were meant to be large";
    EXPECT_FALSE(has_nan(got.out) || has_nan(got.lse) || has_nan(got.dq) || has_nan(got.dk) || has_nan(got.dv));
    // fp32 logits of size 1e3 carry absolute rounding errors ~1e3 * 2^-24 * sqrt(D) ~ 2e-4, which become relative
    // errors of the probabilities; the fp32 backward recomputes P from the fp32 lse (absolute error
    // |lse| 2^-24 ~ 6e-5); gradients scale with |q|, |k| ~ 8. fp64 is fp64 throughout: ~1e3 * 2^-53 ~ 1e-13.
    const bool f64 = dt == DType::kFloat64;
    const double t_out = f64 ? 1e-10 : 2e-3;
    const double t_grad = f64 ? 1e-10 : 2e-3;
    EXPECT_TRUE(test::all_close(test::to_double(got.lse), test::to_double(want.lse), f64 ? 1e-11 : 1e-4,
                                f64 ? 1e-13 : 1e-6, "lse"));
    EXPECT_TRUE(test::all_close(test::to_double(got.out), test::to_double(want.out), t_out, t_out, "out"));
    EXPECT_TRUE(test::all_close(test::to_double(got.dq), test::to_double(want.dq), 8 * t_grad, t_grad, "dq"));
    EXPECT_TRUE(test::all_close(test::to_double(got.dk), test::to_double(want.dk), 8 * t_grad, t_grad, "dk"));
    EXPECT_TRUE(test::all_close(test::to_double(got.dv), test::to_double(want.dv), t_grad, t_grad, "dv"));
  }
}

// ---- precision at large logits: fp64 means fp64, and key blocks merge without extra error ---------

double rel_err(const TensorView& got, const TensorView& want) {
  return test::rel_err(test::to_double(got), test::to_double(want));
}

// B = 2, S = 40, GQA 4 / 2, D = 8; logits about `logits` with a spread softmax (test::set_logit_offset).
Problem large_logit_problem(DType dtype, MaskKind mask) {
  return Problem{2, 40, 40, 4, 2, 8, dtype, mask_of(mask), Layout::kContiguous};
}
Inputs large_logit_inputs(const Problem& p, double logits, std::uint64_t seed) {
  Inputs in = make_inputs(p, seed);
  test::set_logit_offset(in.q, in.k, logits);
  return in;
}

struct LogitCase {
  double logits;
  MaskKind mask;
};

class MhaLargeLogits : public ::testing::TestWithParam<LogitCase> {};

// fp64 storage computes in fp64 throughout: every output within 1e-10 relative of the fp64 reference, at logits of
// 1e2 to 1e4. (Before, lse was fp32 and the backward recomputed P from it: dq, dk, dv off by ~|lse| 2^-24.)
TEST_P(MhaLargeLogits, Fp64KernelMatchesReference) {
  const auto [logits, mask] = GetParam();
  const Problem p = large_logit_problem(DType::kFloat64, mask);
  const Inputs in = large_logit_inputs(p, logits, 1313);
  const Results got = run_kernel(p, in, DType::kFloat64);
  const Results want = run_reference(p, in);
  for (auto [g, w, name] : {std::tuple{&got.out, &want.out, "out"},
                            {&got.lse, &want.lse, "lse"},
                            {&got.dq, &want.dq, "dq"},
                            {&got.dk, &want.dk, "dk"},
                            {&got.dv, &want.dv, "dv"}}) {
    EXPECT_LE(rel_err(*g, *w), 1e-10) << name << " at logits " << logits;
  }
}

// Key blocks merged with lse_merge (fp64 merge state) against the fp64 reference: at fp64 within 1e-10 like one
// call; at fp32 within 2x of one call's own error (plus 1e-7 of the tensor's size, the rounding of the stored
// result). An fp32 lse between the blocks fails this at logits >= 1e3: the merge weights inherit its rounding.
TEST_P(MhaLargeLogits, MergedKeyBlocksAddNoError) {
  const auto [logits, mask] = GetParam();
  for (DType dt : {DType::kFloat64, DType::kFloat32}) {
    const Problem p = large_logit_problem(dt, mask);
    const Inputs in = large_logit_inputs(p, logits, 1414);
    const DType acc = accumulator_dtype(dt);
    const Results one = run_kernel(p, in, acc);
    const Results want = run_reference(p, in);
    Tensor out = Tensor::zeros(in.q.shape(), acc, kWs);
    Tensor lse = Tensor::empty({p.B, p.Hq, p.Sq}, DType::kFloat64, kWs);
    fill(lse, -kInf);
    for (auto [j0, j1] : {std::pair<std::int64_t, std::int64_t>{0, 13}, {13, 27}, {27, 40}}) {
      Tensor kb = slice_seq(in.k, j0, j1, dt), vb = slice_seq(in.v, j0, j1, dt);
      const std::span<const std::int64_t> kpos(in.pos.k.data() + j0, static_cast<std::size_t>(j1 - j0));
      Tensor ob = Tensor::empty(in.q.shape(), acc, kWs);
      Tensor lb = Tensor::empty({p.B, p.Hq, p.Sq}, DType::kFloat64, kWs);
      mha_forward(MhaForwardArgs{in.q, kb, vb, in.pos.q, kpos, p.mask, p.scale}, ob, lb);
      lse_merge(out, lse, ob, lb);
    }
    const double e_one = rel_err(one.out, want.out), e_merged = rel_err(out, want.out);
    if (dt == DType::kFloat64) {
      EXPECT_LE(e_merged, 1e-10) << "merged out at logits " << logits;
      EXPECT_LE(rel_err(lse, want.lse), 1e-13) << "merged lse at logits " << logits;
    } else {
      EXPECT_LE(e_merged, 2 * e_one + 1e-7) << "merged out at logits " << logits << " (one call: " << e_one << ")";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Mha, MhaLargeLogits,
                         ::testing::Values(LogitCase{1e2, MaskKind::kNone}, LogitCase{1e3, MaskKind::kNone},
                                           LogitCase{1e4, MaskKind::kNone}, LogitCase{1e2, MaskKind::kCausal},
                                           LogitCase{1e3, MaskKind::kCausal}, LogitCase{1e4, MaskKind::kCausal}),
                         [](const auto& info) {
                           return str_cat(mask_name(info.param.mask), "_logits", static_cast<int>(info.param.logits));
                         });

// ---- LSE merge ----------------------------------------------------------------------------------

struct MergeData {
  Tensor out, lse, out_b, lse_b;
};
MergeData merge_data(const std::vector<float>& l1, const std::vector<float>& l2, std::int64_t D) {
  const std::int64_t S = static_cast<std::int64_t>(l1.size());
  MergeData m{test::random_tensor({1, S, 1, D}, DType::kFloat32, 21), Tensor::empty({1, 1, S}, DType::kFloat32, kWs),
              test::random_tensor({1, S, 1, D}, DType::kFloat32, 22), Tensor::empty({1, 1, S}, DType::kFloat32, kWs)};
  std::copy(l1.begin(), l1.end(), m.lse.data_as<float>());
  std::copy(l2.begin(), l2.end(), m.lse_b.data_as<float>());
  return m;
}

// fp64 evaluation of the merge formula: lse = log(e^l1 + e^l2), out = e^(l1 - lse) o1 + e^(l2 - lse) o2.
void merge_fp64(const std::vector<double>& o1, double l1, const std::vector<double>& o2, double l2, std::int64_t row,
                std::int64_t D, std::vector<double>& out, double& lse) {
  const double mx = std::max(l1, l2);
  if (mx == -kInf) {
    lse = -kInf;
    for (std::int64_t d = 0; d < D; ++d) out[row * D + d] = 0.0;
    return;
  }
  lse = mx + std::log(std::exp(l1 - mx) + std::exp(l2 - mx));
  for (std::int64_t d = 0; d < D; ++d)
    out[row * D + d] = std::exp(l1 - lse) * o1[row * D + d] + std::exp(l2 - lse) * o2[row * D + d];
}

TEST(MhaLseMerge, MatchesFp64FormulaIncludingInfAndLargeDifferences) {
  const float ninf = -std::numeric_limits<float>::infinity();
  const std::vector<float> l1{0.0f, 1e4f, -1e4f, ninf, 3.0f, ninf, 5.5f, -2.0f, 1e4f, 0.5f};
  const std::vector<float> l2{1e4f, 0.0f, 0.0f, 2.0f, ninf, ninf, 5.5f, 7.25f, -1e4f, 0.49f};
  const std::int64_t D = 24;
  MergeData m = merge_data(l1, l2, D);
  const std::vector<double> o1 = test::to_double(m.out), o2 = test::to_double(m.out_b);
  lse_merge(m.out, m.lse, m.out_b, m.lse_b);
  std::vector<double> want_out(o1.size()), want_lse(l1.size());
  for (std::size_t i = 0; i < l1.size(); ++i)
    merge_fp64(o1, l1[i], o2, l2[i], static_cast<std::int64_t>(i), D, want_out, want_lse[i]);
  const std::vector<double> got_out = test::to_double(m.out), got_lse = test::to_double(m.lse);
  EXPECT_TRUE(test::all_close(got_lse, want_lse, 0.0, 1e-7, "merged lse"));
  EXPECT_TRUE(test::all_close(got_out, want_out, 1e-7, 1e-6, "merged out"));
  // Exactness where one side carries no weight (difference 1e4 or -inf): the other side comes out bit for bit.
  for (std::size_t i = 0; i < l1.size(); ++i) {
    const double d = static_cast<double>(l1[i]) - static_cast<double>(l2[i]);
    if (!(std::isinf(l1[i]) || std::isinf(l2[i]) || std::abs(d) >= 1e4)) continue;
    if (l1[i] == ninf && l2[i] == ninf) continue;
    const std::vector<double>& winner = (l1[i] > l2[i]) ? o1 : o2;
    EXPECT_EQ(got_lse[i], std::max<double>(l1[i], l2[i])) << "row " << i;
    for (std::int64_t e = 0; e < D; ++e)
      ASSERT_EQ(got_out[i * D + e], winner[i * D + e]) << "row " << i << " element " << e;
  }
}

TEST(MhaLseMerge, RejectsShapeAndDtypeMismatch) {
  MergeData m = merge_data({0.0f, 1.0f}, {1.0f, 0.0f}, 8);
  Tensor bad = Tensor::zeros({1, 2, 1, 8}, DType::kBFloat16, kWs);
  EXPECT_THROW(lse_merge(m.out, m.lse, bad, m.lse_b), Error);
  Tensor bad_lse = Tensor::zeros({1, 2, 1}, DType::kFloat32, kWs);
  EXPECT_THROW(lse_merge(m.out, m.lse, m.out_b, bad_lse), Error);
}

// ---- delta, visible pairs ------------------------------------------------------------------------

TEST(MhaBackwardDelta, MatchesRowDotProducts) {
  Tensor out = test::random_tensor({2, 33, 3, 20}, DType::kBFloat16, 31);
  Tensor dout = test::random_tensor({2, 33, 3, 20}, DType::kFloat32, 32);
  Tensor delta = Tensor::empty({2, 3, 33}, DType::kFloat32, kWs);
  mha_backward_delta(out, dout, delta);
  const std::vector<double> o = test::to_double(out), g = test::to_double(dout);
  std::vector<double> want(static_cast<std::size_t>(delta.numel()));
  for (std::int64_t b = 0; b < 2; ++b)
    for (std::int64_t i = 0; i < 33; ++i)
      for (std::int64_t h = 0; h < 3; ++h) {
        double acc = 0.0;
        for (std::int64_t d = 0; d < 20; ++d)
          acc += o[((b * 33 + i) * 3 + h) * 20 + d] * g[((b * 33 + i) * 3 + h) * 20 + d];
        want[(b * 3 + h) * 33 + i] = acc;
      }
  EXPECT_TRUE(test::all_close(test::to_double(delta), want, 1e-6, 1e-6, "delta"));
}

TEST(MhaVisiblePairs, MatchesBruteForceCount) {
  for (Layout l : {Layout::kContiguous, Layout::kZigzag, Layout::kRandom})
    for (MaskKind mk : {MaskKind::kNone, MaskKind::kCausal, MaskKind::kWindowShort, MaskKind::kWindowLong}) {
      const Positions pos = make_positions(l, 90, 90, 5);
      const MaskSpec mask = mask_of(mk);
      std::int64_t want = 0;
      for (std::int64_t qp : pos.q)
        for (std::int64_t kp : pos.k) want += !mask.causal || (kp <= qp && (mask.window == 0 || qp - kp < mask.window));
      EXPECT_EQ(visible_pairs(pos.q, pos.k, mask), want) << layout_name(l) << " " << mask_name(mk);
    }
}

// ---- determinism ------------------------------------------------------------------------------------

// Every result of r1 equals r2's bit for bit; `between` names the two runs.
void expect_bitwise_equal(const Results& r1, const Results& r2, const char* between) {
  for (auto [a, b, name] : {std::tuple{&r1.out, &r2.out, "out"},
                            {&r1.lse, &r2.lse, "lse"},
                            {&r1.dq, &r2.dq, "dq"},
                            {&r1.dk, &r2.dk, "dk"},
                            {&r1.dv, &r2.dv, "dv"}}) {
    EXPECT_EQ(std::memcmp(a->data(), b->data(), a->nbytes()), 0) << name << " differs between " << between;
  }
}

TEST(MhaDeterminism, TwoRunsAreBitwiseEqual) {
  Problem p{2, 300, 300, 4, 2, 64, DType::kFloat32, {true, 0}, Layout::kRandom};
  const Inputs in = make_inputs(p, 55);
  const Results r1 = run_kernel(p, in, DType::kFloat32);
  const Results r2 = run_kernel(p, in, DType::kFloat32);
  expect_bitwise_equal(r1, r2, "two runs");
}

TEST(MhaDeterminism, OneAndTwoThreadsAreBitwiseEqual) {
#if defined(_OPENMP)
  Problem p{1, 200, 260, 4, 1, 32, DType::kBFloat16, {true, 40}, Layout::kRandom};
  const Inputs in = make_inputs(p, 56);
  const int saved = omp_get_max_threads();
  omp_set_num_threads(1);
  const Results r1 = run_kernel(p, in, DType::kFloat32);
  omp_set_num_threads(2);
  const Results r2 = run_kernel(p, in, DType::kFloat32);
  omp_set_num_threads(saved);
  expect_bitwise_equal(r1, r2, "1 and 2 threads");
#else
  GTEST_SKIP() << "built without OpenMP: one thread only";
#endif
}

// Decode shapes (group * Sq <= 64 rows, no score transform) run one work item per (b, KV head) and read K and V of
// the compute dtype in place; longer query blocks run per (b, query head, tile) from packed copies. The rows of a
// one-query or three-query call must equal the same rows of one 70-query call bit for bit: fp32 with D = 64 (K and
// V in place), bf16 (both converted and packed) and fp32 with D = 40 (V not a multiple of the vector width: packed),
// keys not a multiple of the 64-key tile.
TEST(MhaDeterminism, DecodeShapeRowsEqualRowsOfALongQueryBlock) {
  for (auto [dtype, D] : {std::pair{DType::kFloat32, std::int64_t{64}}, std::pair{DType::kBFloat16, std::int64_t{64}},
                          std::pair{DType::kFloat32, std::int64_t{40}}}) {
    Problem p{2, 70, 300, 8, 2, D, dtype, {true, 0}, Layout::kContiguous};
    const Inputs in = make_inputs(p, 57);
    const DType acc = accumulator_dtype(dtype);
    Tensor out = Tensor::empty(in.q.shape(), acc, kWs), lse = Tensor::empty({p.B, p.Hq, p.Sq}, acc, kWs);
    mha_forward(args_of(p, in), out, lse);
    for (auto [i0, n] : {std::pair{std::int64_t{0}, std::int64_t{1}},
                         {std::int64_t{33}, std::int64_t{3}},
                         {std::int64_t{69}, std::int64_t{1}}}) {
      const Tensor q = slice_seq(in.q, i0, i0 + n, dtype);
      const std::vector<std::int64_t> q_pos(in.pos.q.begin() + i0, in.pos.q.begin() + i0 + n);
      Tensor o1 = Tensor::empty(q.shape(), acc, kWs), l1 = Tensor::empty({p.B, p.Hq, n}, acc, kWs);
      mha_forward(MhaForwardArgs{q, in.k, in.v, q_pos, in.pos.k, p.mask, p.scale}, o1, l1);
      const Tensor o_rows = slice_seq(out, i0, i0 + n, acc);
      EXPECT_EQ(std::memcmp(o1.data(), o_rows.data(), o1.nbytes()), 0)
          << dtype_name(dtype) << " D " << D << " out rows " << i0 << "..+" << n;
      for (std::int64_t b = 0; b < p.B; ++b)
        for (std::int64_t h = 0; h < p.Hq; ++h)
          EXPECT_EQ(std::memcmp(static_cast<const char*>(l1.data()) + ((b * p.Hq + h) * n) * dtype_size(acc),
                                static_cast<const char*>(lse.data()) + ((b * p.Hq + h) * p.Sq + i0) * dtype_size(acc),
                                static_cast<std::size_t>(n) * dtype_size(acc)),
                    0)
              << dtype_name(dtype) << " D " << D << " lse of b " << b << " h " << h << " rows " << i0;
    }
  }
}

// ---- fp32 accuracy of dK / dV against the number of queries -----------------------------------------------

// ||got - want||_2 / ||want||_2 over all elements.
double relative_error(const TensorView& got, const TensorView& want) {
  const std::vector<double> g = test::to_double(got), w = test::to_double(want);
  double num = 0.0, den = 0.0;
  for (std::size_t i = 0; i < g.size(); ++i) {
    num += (g[i] - w[i]) * (g[i] - w[i]);
    den += w[i] * w[i];
  }
  return std::sqrt(num / den);
}

// dK_j and dV_j are sums over every query row. With one 64-key tile and Sq queries, the fp32 kernel's dk / dv error
// against the fp64 reference (same inputs, rounded to fp32 once) must not grow with Sq: a running sum over the query
// tiles (the error of a sequential sum grows like sqrt(n) relative to a result of nonzero mean, dout >= 0 here) gave
// about 5x the error at 32x the queries (dv 2.2e-7 at 256, 1.2e-6 at 8192); pairwise sums keep it within 2x
// (log2 32 more levels of rounding; measured: no growth, about 1e-7) and below 5e-7 (4 fp32 epsilons) at both
// lengths.
TEST(MhaAccuracy, Fp32DkDvErrorDoesNotGrowWithQueries) {
  double err[2][2] = {};  // [short, long][dk, dv]
  const std::int64_t lengths[2] = {256, 8192};
  for (int n = 0; n < 2; ++n) {
    const std::int64_t Sq = lengths[n], Sk = 64, D = 32;
    const Tensor q = test::random_tensor({1, Sq, 1, D}, DType::kFloat32, 91, -1.0, 1.0);
    const Tensor k = test::random_tensor({1, Sk, 1, D}, DType::kFloat32, 92, -1.0, 1.0);
    const Tensor v = test::random_tensor({1, Sk, 1, D}, DType::kFloat32, 93, -1.0, 1.0);
    const Tensor dout = test::random_tensor({1, Sq, 1, D}, DType::kFloat32, 94, 0.0, 1.0);
    const MhaForwardArgs a{q, k, v, {}, {}, MaskSpec{}, 0.0f};
    Tensor out = Tensor::empty(q.shape(), DType::kFloat32, kWs), lse = Tensor::empty({1, 1, Sq}, DType::kFloat32, kWs);
    mha_forward(a, out, lse);
    Tensor dq = Tensor::empty(q.shape(), DType::kFloat32, kWs), dk = Tensor::empty(k.shape(), DType::kFloat32, kWs),
           dv = Tensor::empty(k.shape(), DType::kFloat32, kWs);
    mha_backward(MhaBackwardArgs{a, out, dout, lse, {}}, dq, dk, dv, false);

    const Tensor q64 = Tensor::copy_of(q, DType::kFloat64, kWs), k64 = Tensor::copy_of(k, DType::kFloat64, kWs);
    const Tensor v64 = Tensor::copy_of(v, DType::kFloat64, kWs), do64 = Tensor::copy_of(dout, DType::kFloat64, kWs);
    const MhaForwardArgs a64{q64, k64, v64, {}, {}, MaskSpec{}, 0.0f};
    Tensor out64 = Tensor::empty(q.shape(), DType::kFloat64, kWs);
    Tensor lse64 = Tensor::empty({1, 1, Sq}, DType::kFloat64, kWs);
    reference::mha_forward(a64, out64, lse64);
    Tensor dq64 = Tensor::empty(q.shape(), DType::kFloat64, kWs), dk64 = Tensor::empty(k.shape(), DType::kFloat64, kWs),
           dv64 = Tensor::empty(k.shape(), DType::kFloat64, kWs);
    reference::mha_backward(a64, do64, dq64, dk64, dv64);
    err[n][0] = relative_error(dk, dk64);
    err[n][1] = relative_error(dv, dv64);
  }
  for (int w = 0; w < 2; ++w) {
    const char* name = w == 0 ? "dk" : "dv";
    EXPECT_LE(err[1][w], 2.0 * err[0][w]) << name << " relative error " << err[1][w] << " at Sq " << lengths[1]
                                          << " against " << err[0][w] << " at Sq " << lengths[0];
    EXPECT_LE(err[1][w], 5e-7) << name << " relative error at Sq " << lengths[1];
    EXPECT_LE(err[0][w], 5e-7) << name << " relative error at Sq " << lengths[0];
    std::printf("%s relative error: Sq %lld %.3g, Sq %lld %.3g\n", name, static_cast<long long>(lengths[0]), err[0][w],
                static_cast<long long>(lengths[1]), err[1][w]);
  }
}

// ---- the vectorised exp2 of the kernels ---------------------------------------------------------------

TEST(MhaSimd, Exp2MatchesStdAndUnderflowsToZero) {
  using S = cpu::Simd<float>;
  constexpr int W = S::W;
  // Dense sweep of [-130, 1]: the kernels only evaluate exp2 of non-positive arguments (plus rounding).
  std::vector<float> x;
  for (double t = -130.0; t <= 1.0; t += 1.0 / 1024.0 + 1e-7) x.push_back(static_cast<float>(t));
  for (float special : {-std::numeric_limits<float>::infinity(), -1e30f, -125.0f, -124.99f, 0.0f, -0.0f})
    x.push_back(special);
  while (x.size() % W != 0) x.push_back(0.5f);
  std::vector<float> y(x.size());
  for (std::size_t i = 0; i < x.size(); i += W) S::store(y.data() + i, S::exp2(S::load(x.data() + i)));
  double worst = 0.0;
  for (std::size_t i = 0; i < x.size(); ++i) {
    const double want = std::exp2(static_cast<double>(x[i]));
    if (x[i] < -125.0f) {
      ASSERT_EQ(y[i], 0.0f) << "exp2(" << x[i] << ") must flush to 0";
      continue;
    }
    const double rel = std::abs(y[i] - want) / want;
    worst = std::max(worst, rel);
    // polynomial error < 1e-7 plus a few roundings of the Horner steps: within 4 fp32 ulp (2^-23 each)
    ASSERT_LE(rel, 4.0 * 1.2e-7) << "exp2(" << x[i] << ") = " << y[i] << ", want " << want;
  }
  char worst_text[32];
  std::snprintf(worst_text, sizeof worst_text, "%.3g", worst);
  RecordProperty("max_rel_error", worst_text);
  // NaN stays NaN in every lane position (it used to flush to 0, so a NaN score silently got no weight).
  std::vector<float> nan_in(W, -1.0f), nan_out(W);
  for (int lane = 0; lane < W; ++lane) {
    nan_in[lane] = std::numeric_limits<float>::quiet_NaN();
    S::store(nan_out.data(), S::exp2(S::load(nan_in.data())));
    EXPECT_TRUE(std::isnan(nan_out[lane])) << "exp2(NaN) in lane " << lane << " = " << nan_out[lane];
    if (W > 1) {
      EXPECT_EQ(nan_out[(lane + 1) % W], 0.5f) << "the other lanes are exp2(-1), lane " << lane;
    }
    nan_in[lane] = -1.0f;
  }
}

// ---- argument checks --------------------------------------------------------------------------------

using test::expect_error;

TEST(MhaArgs, RejectsInvalidConfigurations) {
  Problem p{1, 16, 16, 3, 2, 8, DType::kFloat32, {true, 0}, Layout::kContiguous};
  Inputs in = make_inputs(p, 1);
  Tensor out = Tensor::empty(in.q.shape(), DType::kFloat32, kWs);
  Tensor lse = Tensor::empty({1, 3, 16}, DType::kFloat32, kWs);
  expect_error([&] { mha_forward(args_of(p, in), out, lse); }, "multiple of kv heads");
  Problem ok{1, 16, 16, 2, 1, 8, DType::kFloat32, {false, 4}, Layout::kContiguous};
  Inputs in2 = make_inputs(ok, 2);
  Tensor lse2 = Tensor::empty({1, 2, 16}, DType::kFloat32, kWs);
  Tensor out2 = Tensor::empty(in2.q.shape(), DType::kFloat32, kWs);
  expect_error([&] { mha_forward(args_of(ok, in2), out2, lse2); }, "requires mask.causal");
  ok.mask = {true, 0};
  std::swap(in2.pos.q[3], in2.pos.q[4]);
  expect_error([&] { mha_forward(args_of(ok, in2), out2, lse2); }, "q_pos must be non-decreasing");
  std::swap(in2.pos.q[3], in2.pos.q[4]);
  Tensor lse_bf16 = Tensor::empty({1, 2, 16}, DType::kBFloat16, kWs);
  expect_error([&] { mha_forward(args_of(ok, in2), out2, lse_bf16); }, "lse has dtype bf16");
  Tensor dq = Tensor::zeros(in2.q.shape(), DType::kBFloat16, kWs);
  Tensor dk = Tensor::zeros(in2.k.shape(), DType::kFloat32, kWs),
         dv = Tensor::zeros(in2.k.shape(), DType::kFloat32, kWs);
  mha_forward(args_of(ok, in2), out2, lse2);
  expect_error(
      [&] {
        mha_backward(MhaBackwardArgs{args_of(ok, in2), out2, in2.dout, lse2, {}}, dq, dk, dv, true);
      },
      "dq (accumulate = true) has dtype bf16");
  // scale: <= 0 means 1/sqrt(D) (the documented contract, also for negative values); NaN and inf are errors.
  MhaForwardArgs sa = args_of(ok, in2);
  mha_forward(sa, out2, lse2);
  const std::vector<double> default_out = test::to_double(out2);
  sa.scale = -1.0f;
  mha_forward(sa, out2, lse2);
  EXPECT_EQ(test::to_double(out2), default_out) << "scale -1 must act as the default 1/sqrt(D)";
  sa.scale = std::numeric_limits<float>::quiet_NaN();
  expect_error([&] { mha_forward(sa, out2, lse2); }, "scale nan must be finite");
  sa.scale = std::numeric_limits<float>::infinity();
  expect_error([&] { mha_forward(sa, out2, lse2); }, "scale inf must be finite");
}

}  // namespace
}  // namespace seqpar::attn
