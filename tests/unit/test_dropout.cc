// Dropout on the attention probabilities (attention/dropout.h, attention/mha.h): the Philox generator against its
// published known-answer vectors, the keep rate against binomial bounds, the kernels against the fp64 reference that
// regenerates the same mask, the reference's backward against central differences with the mask fixed, p = 0 against
// no dropout (bitwise), the head offset (bitwise), and the argument checks.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <tuple>
#include <vector>

#include "attention/dropout.h"
#include "attention/mha.h"
#include "attention/reference/mha_reference.h"
#include "tests/util/test_util.h"

namespace seqpar::attn {
namespace {

constexpr MemCategory kWs = MemCategory::kWorkspace;

// ---- the generator ------------------------------------------------------------------------------

// Random123 (D. E. Shaw Research) kat_vectors, philox4x32 with 10 rounds: counter, key, expected output.
TEST(DropoutPhilox, MatchesPublishedKnownAnswers) {
  using W4 = std::array<std::uint32_t, 4>;
  using W2 = std::array<std::uint32_t, 2>;
  const std::tuple<W4, W2, W4> kat[] = {{{0, 0, 0, 0}, {0, 0}, {0x6627e8d5u, 0xe169c58du, 0xbc57ac4cu, 0x9b00dbd8u}},
                                        {{0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu},
                                         {0xffffffffu, 0xffffffffu},
                                         {0x408f276du, 0x41c83b0eu, 0xa20bc7c6u, 0x6d5451fdu}},
                                        {{0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u},
                                         {0xa4093822u, 0x299f31d0u},
                                         {0xd16cfe09u, 0x94fdccebu, 0x5001e420u, 0x24126ea1u}}};
  for (const auto& [ctr, key, want] : kat) EXPECT_EQ(philox4x32_10(ctr, key), want);
}

// Over N = 2^21 pairs the kept count is Binomial(N, q) with q = (2^32 - ceil(p 2^32)) / 2^32 for an ideal generator;
// a deterministic seed passes |count - N q| <= 6 sqrt(N q (1 - q)) (a 2e-9 two-sided tail for a true binomial).
TEST(DropoutPhilox, KeepRateIsWithinBinomialBounds) {
  for (double p : {0.1, 0.5, 0.9}) {
    std::int64_t kept = 0, n = 0;
    for (std::int64_t b = 0; b < 2; ++b)
      for (std::int64_t h = 0; h < 4; ++h)
        for (std::int64_t i = 0; i < 256; ++i)
          for (std::int64_t j = 0; j < 1024; ++j, ++n) kept += dropout_keep(2024, b, h, i, j, p) ? 1 : 0;
    const double q = static_cast<double>((std::uint64_t{1} << 32) - dropout_threshold(p)) / 4294967296.0;
    const double mean = static_cast<double>(n) * q, sd = std::sqrt(static_cast<double>(n) * q * (1 - q));
    EXPECT_LE(std::fabs(static_cast<double>(kept) - mean), 6 * sd) << "p " << p << ": kept " << kept << " of " << n;
  }
  // The threshold is exact at the ends: p = 0 keeps every word, p just below 1 keeps only the top words.
  EXPECT_EQ(dropout_threshold(0.0), 0u);
  EXPECT_EQ(dropout_threshold(0.5), std::uint64_t{1} << 31);
  EXPECT_EQ(dropout_threshold(std::nextafter(1.0, 0.0)), std::uint64_t{1} << 32);
}

// The key of a pair: changing any one of seed, batch, head, query or key position changes about half the decisions.
TEST(DropoutPhilox, EveryKeyFieldChangesTheMask) {
  const std::int64_t n = 4096;
  auto differing = [&](auto&& other) {
    std::int64_t d = 0;
    for (std::int64_t t = 0; t < n; ++t) {
      const std::int64_t i = t / 64, j = t % 64;
      d += dropout_keep(7, 1, 2, i, j, 0.5) != other(i, j) ? 1 : 0;
    }
    return d;
  };
  // Binomial(4096, 1/2) for independent decisions: mean 2048, sd 32.
  for (const auto& [name, d] :
       {std::pair{"seed", differing([](auto i, auto j) { return dropout_keep(8, 1, 2, i, j, 0.5); })},
        {"batch", differing([](auto i, auto j) { return dropout_keep(7, 0, 2, i, j, 0.5); })},
        {"head", differing([](auto i, auto j) { return dropout_keep(7, 1, 3, i, j, 0.5); })},
        {"q_pos", differing([](auto i, auto j) { return dropout_keep(7, 1, 2, i + 1, j, 0.5); })},
        {"k_pos", differing([](auto i, auto j) { return dropout_keep(7, 1, 2, i, j + 1, 0.5); })},
        {"seed high word", differing([](auto i, auto j) { return dropout_keep(7 + (1ull << 32), 1, 2, i, j, 0.5); })}})
    EXPECT_NEAR(static_cast<double>(d), 2048.0, 6 * 32.0) << name;
}

// ---- the kernels against the fp64 reference -----------------------------------------------------

struct Problem {
  std::int64_t B = 2, Sq = 150, Sk = 150, Hq = 4, Hkv = 2, D = 16;
  DType dtype = DType::kFloat64;
  MaskSpec mask;
  DropoutSpec dropout{0.3, 99};
  std::int64_t head_offset = 0;
  std::vector<std::int64_t> q_pos, k_pos;  // zigzag-like sets with gaps (empty: 0..S-1)
};

struct Inputs {
  Tensor q, k, v, dout;
};

Inputs make_inputs(const Problem& p, std::uint64_t seed) {
  return {test::random_tensor({p.B, p.Sq, p.Hq, p.D}, p.dtype, seed),
          test::random_tensor({p.B, p.Sk, p.Hkv, p.D}, p.dtype, seed + 1),
          test::random_tensor({p.B, p.Sk, p.Hkv, p.D}, p.dtype, seed + 2),
          test::random_tensor({p.B, p.Sq, p.Hq, p.D}, p.dtype, seed + 3)};
}

MhaForwardArgs args_of(const Problem& p, const TensorView& q, const TensorView& k, const TensorView& v) {
  MhaForwardArgs a;
  a.q = q;
  a.k = k;
  a.v = v;
  a.q_pos = p.q_pos;
  a.k_pos = p.k_pos;
  a.mask = p.mask;
  a.dropout = p.dropout;
  a.head_offset = p.head_offset;
  return a;
}

struct Results {
  std::vector<double> out, lse, dq, dk, dv;
};

Results run_kernel(const Problem& p, const Inputs& in) {
  const MhaForwardArgs a = args_of(p, in.q, in.k, in.v);
  Tensor out = Tensor::empty(in.q.shape(), p.dtype, kWs);
  Tensor lse = Tensor::empty({p.B, p.Hq, p.Sq}, accumulator_dtype(p.dtype), kWs);
  mha_forward(a, out, lse);
  Tensor dq = Tensor::empty(in.q.shape(), p.dtype, kWs), dk = Tensor::empty(in.k.shape(), p.dtype, kWs),
         dv = Tensor::empty(in.k.shape(), p.dtype, kWs);
  mha_backward(MhaBackwardArgs{a, out, in.dout, lse, {}}, dq, dk, dv, false);
  return {test::to_double(out), test::to_double(lse), test::to_double(dq), test::to_double(dk), test::to_double(dv)};
}

Results run_reference(const Problem& p, const Inputs& in) {
  auto f64 = [](const Tensor& t) { return Tensor::copy_of(t.view(), DType::kFloat64, kWs); };
  Tensor q = f64(in.q), k = f64(in.k), v = f64(in.v), dout = f64(in.dout);
  const MhaForwardArgs a = args_of(p, q, k, v);
  Tensor out = Tensor::empty(q.shape(), DType::kFloat64, kWs),
         lse = Tensor::empty({p.B, p.Hq, p.Sq}, DType::kFloat64, kWs);
  Tensor dq = Tensor::empty(q.shape(), DType::kFloat64, kWs), dk = Tensor::empty(k.shape(), DType::kFloat64, kWs),
         dv = Tensor::empty(k.shape(), DType::kFloat64, kWs);
  reference::mha_forward(a, out, lse);
  reference::mha_backward(a, dout, dq, dk, dv);
  return {test::to_double(out), test::to_double(lse), test::to_double(dq), test::to_double(dk), test::to_double(dv)};
}

// Zigzag-like positions of one rank of two: chunks {0, 3} of four for queries, {1, 2} for keys, plus a gap, so that
// key positions are not consecutive across the chunk boundary and not aligned to the generator's groups of four.
void set_zigzag_positions(Problem& p) {
  const std::int64_t c = p.Sq / 2;
  for (std::int64_t i = 0; i < p.Sq; ++i) p.q_pos.push_back(i < c ? i : 3 * c + (i - c));
  for (std::int64_t j = 0; j < p.Sk; ++j) p.k_pos.push_back(j < c ? c + j + 1 : c + j + 3);
}

struct KernelCase {
  DType dtype;
  bool causal;
  bool zigzag;
  std::int64_t head_offset;
  double p;
};

class DropoutVsReference : public ::testing::TestWithParam<KernelCase> {};

TEST_P(DropoutVsReference, ForwardAndBackward) {
  const KernelCase c = GetParam();
  Problem p;
  p.dtype = c.dtype;
  p.mask = {c.causal, 0};
  p.head_offset = c.head_offset;
  p.dropout.p = c.p;
  if (c.zigzag) set_zigzag_positions(p);
  const Inputs in = make_inputs(p, 501);
  const Results got = run_kernel(p, in), want = run_reference(p, in);
  // fp64: fp64 arithmetic end to end (the reference regenerates the same mask; one differing pair would be an
  // error of about p_ij |v| / (1 - p) ~ 1e-2). fp32: fp32 arithmetic over <= 150 keys and D = 16, as in test_mha.
  const bool f64 = c.dtype == DType::kFloat64;
  const double atol = f64 ? 1e-12 : 3e-5, rtol = f64 ? 1e-10 : 3e-4;
  EXPECT_TRUE(test::all_close(got.out, want.out, atol, rtol, "out"));
  EXPECT_TRUE(test::all_close(got.lse, want.lse, f64 ? 1e-12 : 2e-5, f64 ? 1e-12 : 2e-5, "lse"));
  EXPECT_TRUE(test::all_close(got.dq, want.dq, atol, rtol, "dq"));
  EXPECT_TRUE(test::all_close(got.dk, want.dk, atol, rtol, "dk"));
  EXPECT_TRUE(test::all_close(got.dv, want.dv, atol, rtol, "dv"));
}

INSTANTIATE_TEST_SUITE_P(
    Dropout, DropoutVsReference,
    ::testing::Values(KernelCase{DType::kFloat64, false, false, 0, 0.3},
                      KernelCase{DType::kFloat64, true, false, 0, 0.3}, KernelCase{DType::kFloat64, true, true, 5, 0.3},
                      KernelCase{DType::kFloat64, false, true, 2, 0.9}, KernelCase{DType::kFloat32, true, true, 0, 0.1},
                      KernelCase{DType::kFloat32, false, false, 3, 0.5}),
    [](const auto& info) {
      const KernelCase& c = info.param;
      return str_cat(dtype_name(c.dtype), c.causal ? "_causal" : "_full", c.zigzag ? "_zigzag" : "_contig", "_head",
                     c.head_offset, "_p", static_cast<int>(c.p * 10));
    });

// lse is the undropped one (bitwise the same as without dropout), while out really changes.
TEST(DropoutKernel, LseIsUndroppedAndOutChanges) {
  Problem p;
  p.dtype = DType::kFloat32;
  p.mask = {true, 0};
  const Inputs in = make_inputs(p, 7);
  const Results with = run_kernel(p, in);
  p.dropout = {};
  const Results without = run_kernel(p, in);
  EXPECT_EQ(with.lse, without.lse);
  EXPECT_GT(test::rel_err(with.out, without.out), 0.1);
}

// p = 0 is off: bitwise the kernels without dropout, whatever the seed and head offset.
TEST(DropoutKernel, ZeroProbabilityIsBitwiseNoDropout) {
  for (DType dtype : {DType::kFloat32, DType::kFloat64}) {
    Problem p;
    p.dtype = dtype;
    p.mask = {true, 0};
    set_zigzag_positions(p);
    const Inputs in = make_inputs(p, 8);
    p.dropout = {0.0, 12345};
    p.head_offset = 7;
    const Results zero = run_kernel(p, in);
    p.dropout = {};
    p.head_offset = 0;
    const Results off = run_kernel(p, in);
    EXPECT_EQ(zero.out, off.out) << dtype_name(dtype);
    EXPECT_EQ(zero.lse, off.lse) << dtype_name(dtype);
    EXPECT_EQ(zero.dq, off.dq) << dtype_name(dtype);
    EXPECT_EQ(zero.dk, off.dk) << dtype_name(dtype);
    EXPECT_EQ(zero.dv, off.dv) << dtype_name(dtype);
  }
}

// A call on query heads [2, 4) with head_offset 2 (what a Ulysses rank does) gives bitwise the forward of those heads
// in a call over all four (the forward's work items are per head; the keys are the same).
TEST(DropoutKernel, HeadOffsetSelectsTheGlobalHeadsBitwise) {
  Problem p;
  p.dtype = DType::kFloat32;
  p.Hkv = 4;  // one kv head per query head, so that heads [2, 4) need kv heads [2, 4) only
  const Inputs in = make_inputs(p, 9);
  const MhaForwardArgs all = args_of(p, in.q, in.k, in.v);
  Tensor out = Tensor::empty(in.q.shape(), p.dtype, kWs), lse = Tensor::empty({p.B, p.Hq, p.Sq}, p.dtype, kWs);
  mha_forward(all, out, lse);
  // heads [2, 4) of q, k, v as their own tensors
  auto heads = [&](const Tensor& t) {
    Tensor h = Tensor::empty({t.dim(0), t.dim(1), 2, t.dim(3)}, t.dtype(), kWs);
    for (std::int64_t r = 0; r < t.dim(0) * t.dim(1); ++r)
      std::memcpy(h.data_as<float>() + r * 2 * p.D, t.data_as<float>() + (r * 4 + 2) * p.D, 2 * p.D * sizeof(float));
    return h;
  };
  Tensor q2 = heads(in.q), k2 = heads(in.k), v2 = heads(in.v);
  Problem p2 = p;
  p2.Hq = p2.Hkv = 2;
  p2.head_offset = 2;
  Tensor out2 = Tensor::empty(q2.shape(), p.dtype, kWs), lse2 = Tensor::empty({p.B, 2, p.Sq}, p.dtype, kWs);
  mha_forward(args_of(p2, q2, k2, v2), out2, lse2);
  const Tensor want = heads(out);
  EXPECT_EQ(0, std::memcmp(want.data(), out2.data(), out2.nbytes())) << "out of heads 2, 3";
  p2.head_offset = 0;  // the wrong heads: another mask
  mha_forward(args_of(p2, q2, k2, v2), out2, lse2);
  EXPECT_GT(test::rel_err(test::to_double(out2), test::to_double(want)), 0.1);
}

// ---- the backward's math: central differences of the fp64 reference with the mask fixed -----------

// L = sum(dout * out) of the fp64 reference forward (the mask depends on positions only, so it is fixed under the
// perturbation); the reference backward (ds = p (z dO . v - sum_l p z dO . v)) against (L(x + h) - L(x - h)) / 2h,
// h = 1e-5: truncation O(h^2) ~ 1e-10, rounding ~ 1e-16 / h ~ 1e-11. Then the kernel's backward (delta from the
// dropped out) against the same reference.
TEST(DropoutGrad, ReferenceBackwardMatchesCentralDifferences) {
  for (bool causal : {false, true}) {
    Problem p;
    p.B = 2;
    p.Sq = p.Sk = 12;
    p.Hq = 2;
    p.Hkv = 1;
    p.D = 4;
    p.mask = {causal, 0};
    p.dropout = {0.4, 5};
    const Inputs in = make_inputs(p, 33);
    const Results ref = run_reference(p, in);
    const std::vector<double> dout = test::to_double(in.dout);
    auto loss = [&]() {
      Tensor out = Tensor::empty(in.q.shape(), DType::kFloat64, kWs),
             lse = Tensor::empty({2, 2, 12}, DType::kFloat64, kWs);
      reference::mha_forward(args_of(p, in.q, in.k, in.v), out, lse);
      double l = 0.0;
      for (std::size_t i = 0; i < dout.size(); ++i) l += dout[i] * out.data_as<double>()[i];
      return l;
    };
    const double h = 1e-5;
    for (auto [t, g, name] : {std::tuple{&in.q, &ref.dq, "dq"}, {&in.k, &ref.dk, "dk"}, {&in.v, &ref.dv, "dv"}}) {
      const std::vector<double> fd = test::central_differences(*t, h, loss);
      EXPECT_TRUE(test::all_close(*g, fd, 1e-8, 1e-7, str_cat(name, causal ? " causal" : " full")));
    }
    const Results got = run_kernel(p, in);
    EXPECT_TRUE(test::all_close(got.dq, ref.dq, 1e-12, 1e-10, "kernel dq"));
    EXPECT_TRUE(test::all_close(got.dk, ref.dk, 1e-12, 1e-10, "kernel dk"));
    EXPECT_TRUE(test::all_close(got.dv, ref.dv, 1e-12, 1e-10, "kernel dv"));
  }
}

// ---- argument checks ----------------------------------------------------------------------------

using test::expect_error;

TEST(DropoutArgs, RejectsBadProbabilityAndCounterRanges) {
  Problem p;
  p.dtype = DType::kFloat32;
  p.Sq = p.Sk = 8;
  const Inputs in = make_inputs(p, 1);
  Tensor out = Tensor::empty(in.q.shape(), p.dtype, kWs), lse = Tensor::empty({p.B, p.Hq, p.Sq}, p.dtype, kWs);
  for (double bad :
       {-0.1, 1.0, 1.5, std::numeric_limits<double>::quiet_NaN(), std::numeric_limits<double>::infinity()}) {
    p.dropout.p = bad;
    const MhaForwardArgs a = args_of(p, in.q, in.k, in.v);
    const std::string msg = str_cat("dropout p ", bad, " must be a finite number in [0, 1)");
    expect_error([&] { mha_forward(a, out, lse); }, msg);
    expect_error([&] { a.validate(); }, msg);
    expect_error([&] { mha_backward(MhaBackwardArgs{a, out, in.dout, lse, {}}, out, in.k, in.v, false); }, msg);
  }
  p.dropout.p = 0.2;
  p.head_offset = -1;
  expect_error([&] { args_of(p, in.q, in.k, in.v).validate(); }, "dropout: head_offset -1");
  p.head_offset = 0;
  p.q_pos = {-1, 0, 1, 2, 3, 4, 5, 6};
  expect_error([&] { args_of(p, in.q, in.k, in.v).validate(); }, "dropout: q_pos [-1, 6]");
  p.q_pos.clear();
  p.k_pos = {0, 1, 2, 3, 4, 5, 6, std::int64_t{1} << 32};
  expect_error([&] { args_of(p, in.q, in.k, in.v).validate(); }, "must lie in [0, 2^32)");
  // Without dropout the same positions are fine (positions are free when no mask is drawn).
  p.dropout.p = 0.0;
  args_of(p, in.q, in.k, in.v).validate();
}

}  // namespace
}  // namespace seqpar::attn
