// Precision of every MHA CP path at large logits: ring p2p, ring all-gather, Ulysses and USP (both
// placements), contiguous / zigzag / stripe layouts, causal and not, GQA with Hkv < Pu (replicated KV heads), B = 2,
// logits of 1e2, 1e3 and 1e4 (test::set_logit_offset: lse ~ logits with a spread softmax).
//   fp64: every output and gradient within 1e-10 relative of the fp64 reference (attention/reference) and of one
//         rank (fp64 is fp64 throughout, merges included).
//   fp32, bf16: the distributed error against the fp64 reference within 2x of the one-rank error (plus one unit
//         roundoff of the dtype, for a one-rank error of exactly 0): the merges add no error beyond one
//         online-softmax pass. With an fp32 lse between ring steps the p2p ring fails both at logits >= 1e3.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "parallel/usp.h"
#include "runtime/cp_grid.h"
#include "tests/util/cp_test.h"
#include "tests/util/mha_problem.h"
#include "tests/util/mpi_test.h"
#include "tests/util/test_util.h"

namespace seqpar {
namespace {

using test::world;

struct PrecisionCase {
  int ulysses_size;
  Placement placement;
  LayoutKind layout;
  RingImpl impl;
  bool causal;
};

std::string case_name(const PrecisionCase& c) {
  return str_cat("u", c.ulysses_size, "_", placement_name(c.placement), "_", layout_name(c.layout), "_",
                 ring_impl_name(c.impl), c.causal ? "_causal" : "_full");
}
void PrintTo(const PrecisionCase& c, std::ostream* os) { *os << case_name(c); }

constexpr std::int64_t kHq = 8, kHkv = 2;

std::vector<PrecisionCase> cases_for_world() {
  const int n = world().size();
  std::vector<PrecisionCase> cases;
  for (const CpGridConfig& g : test::usp_grids(kHq)) {
    const Placement pl = g.placement;
    for (LayoutKind layout : {LayoutKind::kContiguous, LayoutKind::kZigzag, LayoutKind::kStripe}) {
      // runtime (each case runs 9 problems): the ring-inner placement on zigzag only, stripe up to 3 ranks
      if ((pl == Placement::kRingInner && layout != LayoutKind::kZigzag) || (n > 3 && layout == LayoutKind::kStripe))
        continue;
      for (RingImpl impl : {RingImpl::kP2P, RingImpl::kAllGather}) {
        for (bool causal : {false, true}) cases.push_back({g.ulysses_size, pl, layout, impl, causal});
      }
    }
  }
  return cases;
}

// One unit roundoff of the dtype: the floor of the fp32 / bf16 criterion.
double unit_roundoff(DType dtype) { return dtype == DType::kBFloat16 ? 0x1p-8 : 0x1p-24; }

class CpPrecision : public ::testing::TestWithParam<PrecisionCase> {};

TEST_P(CpPrecision, MergesAddNoErrorAtLargeLogits) {
  const PrecisionCase c = GetParam();
  const int n = world().size();
  const CpGrid grid(world(), {1, c.ulysses_size, n / c.ulysses_size, c.placement});
  MhaCpConfig cfg;
  cfg.impl = c.impl;
  cfg.causal = c.causal;
  for (double logits : {1e2, 1e3, 1e4}) {
    for (DType dtype : {DType::kFloat64, DType::kFloat32, DType::kBFloat16}) {
      test::MhaShape shape;
      shape.batch = 2;
      shape.seq = 48;
      shape.hq = kHq;
      shape.hkv = kHkv;
      shape.dim = 8;
      shape.dtype = dtype;
      shape.mask = {c.causal, 0};
      shape.logits = logits;
      const test::MhaProblem p(shape);
      const test::MhaResult ref = test::reference_result(shape, p);
      const test::MhaResult one = test::single_rank_result(shape, p);
      const test::MhaResult got = test::usp_result(grid, shape, p, cfg, c.layout);
      const std::string what = str_cat(case_name(c), " on ", grid.str(), ", ", dtype_name(dtype), ", logits ", logits);
      for (auto [name, g, o, r] : {std::tuple{"out", &got.out, &one.out, &ref.out},
                                   {"lse", &got.lse, &one.lse, &ref.lse},
                                   {"dq", &got.dq, &one.dq, &ref.dq},
                                   {"dk", &got.dk, &one.dk, &ref.dk},
                                   {"dv", &got.dv, &one.dv, &ref.dv}}) {
        const double e_got = test::rel_err(*g, *r), e_one = test::rel_err(*o, *r);
        if (std::getenv("SEQPAR_TEST_PRINT_ERRORS") != nullptr && world().rank() == 0)
          std::printf("%s %s: %.3g (one rank %.3g)\n", what.c_str(), name, e_got, e_one);
        if (dtype == DType::kFloat64) {
          EXPECT_LE(e_got, 1e-10) << what << ": " << name << " against the fp64 reference";
          EXPECT_LE(test::rel_err(*g, *o), 1e-10) << what << ": " << name << " against one rank";
        } else {
          EXPECT_LE(e_got, 2 * e_one + unit_roundoff(dtype))
              << what << ": " << name << " error " << e_got << " against the fp64 reference, one rank's " << e_one;
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Cp, CpPrecision, ::testing::ValuesIn(cases_for_world()), test::CaseName());

}  // namespace
}  // namespace seqpar
