// Dropout under every MHA CP path: ring p2p and all-gather, Ulysses and USP (both placements),
// contiguous / zigzag / stripe layouts, causal and not, GQA with Hkv >= Pu and Hkv < Pu (replicated KV heads), B = 2.
// The mask is keyed by (seed, batch, global head, global query position, global key position), so every grid must
// drop exactly the pairs one rank drops:
//   fp64: out, lse, dq, dk, dv within 1e-10 relative of the fp64 reference that regenerates the mask pair by pair
//         (attention/reference) and of one rank's kernel. A single pair dropped differently would be an error of
//         about p_ij |v_j| / (1 - p) ~ 1e-2, so this checks that the masks are identical. (Not bitwise: the ring's
//         merges and the Ulysses / ring reductions of dK, dV sum in another order than one call.)
//   fp32: against one rank with the same dropout within the fp32 tolerances of the CP tests (expect_mha_match).
// Plus: another seed gives another result (the dropout is on), and a bad p fails in the constructor on every rank.
#include <gtest/gtest.h>

#include <limits>

#include "parallel/usp.h"
#include "runtime/cp_grid.h"
#include "tests/util/cp_test.h"
#include "tests/util/mha_problem.h"
#include "tests/util/mpi_test.h"
#include "tests/util/test_util.h"

namespace seqpar {
namespace {

using test::world;

struct DropoutCase {
  CpGridConfig grid;  // dp_size 1; ring_size from the world size
  LayoutKind layout;
  RingImpl impl;
  bool causal;
  std::int64_t hkv;
};

std::string case_name(const DropoutCase& c) {
  return str_cat("u", c.grid.ulysses_size, "_", placement_name(c.grid.placement), "_", layout_name(c.layout), "_",
                 ring_impl_name(c.impl), c.causal ? "_causal" : "_full", "_hkv", c.hkv);
}
void PrintTo(const DropoutCase& c, std::ostream* os) { *os << case_name(c); }

constexpr std::int64_t kHq = 8;

std::vector<DropoutCase> cases_for_world() {
  std::vector<DropoutCase> cases;
  for (const CpGridConfig& g : test::usp_grids(kHq)) {
    // Every layout, both ring implementations, causal and not, GQA with Hkv = 2 and MQA (Hkv < Pu from Pu = 2).
    cases.push_back({g, LayoutKind::kZigzag, RingImpl::kP2P, true, 2});
    cases.push_back({g, LayoutKind::kZigzag, RingImpl::kAllGather, false, 2});
    cases.push_back({g, LayoutKind::kContiguous, RingImpl::kP2P, false, 2});
    cases.push_back({g, LayoutKind::kStripe, RingImpl::kAllGather, true, 2});
    cases.push_back({g, LayoutKind::kContiguous, RingImpl::kP2P, true, 1});
  }
  return cases;
}

test::MhaShape shape_of(const DropoutCase& c, DType dtype) {
  return {.batch = 2,
          .seq = 48,
          .hq = kHq,
          .hkv = c.hkv,
          .dim = 16,
          .dtype = dtype,
          .mask = {c.causal, 0},
          .mods = {},
          .dropout = {0.25, 0x5eed'0000'0017ull}};
}

// fp64 out, lse, dq, dk, dv of `got` within 1e-10 relative of the fp64 reference `ref` and of the one-rank `one`.
void expect_fp64_match(const test::MhaResult& got, const test::MhaResult& one, const test::MhaResult& ref,
                       const std::string& what) {
  for (auto [name, g, o, r] : {std::tuple{"out", &got.out, &one.out, &ref.out},
                               {"lse", &got.lse, &one.lse, &ref.lse},
                               {"dq", &got.dq, &one.dq, &ref.dq},
                               {"dk", &got.dk, &one.dk, &ref.dk},
                               {"dv", &got.dv, &one.dv, &ref.dv}}) {
    EXPECT_LE(test::rel_err(*g, *r), 1e-10) << what << ": " << name << " against the fp64 reference";
    EXPECT_LE(test::rel_err(*g, *o), 1e-10) << what << ": " << name << " against one rank";
  }
}

class DropoutCp : public ::testing::TestWithParam<DropoutCase> {};

TEST_P(DropoutCp, EveryGridDropsThePairsOneRankDrops) {
  const DropoutCase c = GetParam();
  const CpGrid grid(world(), c.grid);
  for (DType dtype : {DType::kFloat64, DType::kFloat32}) {
    const test::MhaShape shape = shape_of(c, dtype);
    const test::MhaProblem p(shape);
    const test::MhaResult one = test::single_rank_result(shape, p);
    const test::MhaResult got = test::usp_result(grid, shape, p, test::cp_config(shape, c.impl), c.layout);
    const std::string what = str_cat(case_name(c), " on ", grid.str(), ", ", dtype_name(dtype));
    if (dtype == DType::kFloat64) {
      const test::MhaResult ref = test::reference_result(shape, p);
      expect_fp64_match(got, one, ref, what);
    } else {
      test::expect_mha_match(got, one, dtype, what);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Cp, DropoutCp, ::testing::ValuesIn(cases_for_world()), test::CaseName());

// Packed rows whose documents are not multiples of 2 ring_size: zigzag pads every document, so a rank's slots are not
// the tokens (the ring's positions). The mask is keyed on tokens (MhaForwardArgs::q_tokens), so every grid, kind and
// implementation drops exactly the pairs of one rank on the unpadded row: fp64 out, lse, dq, dk, dv within 1e-10 of
// the fp64 reference (which regenerates every pair) and of the one-rank kernel, both with the documents' bounds on
// token positions. A pair keyed on a padded slot would be an O(1e-2) error.
TEST(DropoutCp, PackedRowsDropThePairsOneRankDrops) {
  const std::vector<std::int64_t> cu = cu_seqlens_of(std::vector<std::int64_t>{1, 3, 7, 0, 5, 2, 11});
  const DocBounds bounds = test::token_doc_bounds(cu);
  for (attn::MaskSpec mask : {attn::MaskSpec{true, 0}, attn::MaskSpec{false, 0}, attn::MaskSpec{true, 4}}) {
    test::MhaShape shape{.batch = 1,
                         .seq = cu.back(),
                         .hq = kHq,
                         .hkv = 2,
                         .dim = 16,
                         .dtype = DType::kFloat64,
                         .mask = {mask.causal, mask.window, bounds.lo, bounds.hi},
                         .mods = {},
                         .dropout = {0.25, 0x5eed'0000'0033ull}};
    const test::MhaProblem p(shape);
    const test::MhaResult one = test::single_rank_result(shape, p);
    const test::MhaResult ref = test::reference_result(shape, p);
    for (const CpGridConfig& gc : test::usp_grids(kHq, /*both_placements=*/false)) {
      const CpGrid grid(world(), gc);
      const CpGroups groups = CpGroups::from(grid);
      for (LayoutKind kind : {LayoutKind::kZigzag, LayoutKind::kContiguous, LayoutKind::kStripe, LayoutKind::kBalanced}) {
        for (RingImpl impl : {RingImpl::kP2P, RingImpl::kAllGather}) {
          const SequenceLayout layout = SequenceLayout::packed_for_groups(groups, cu, kind);
          const test::MhaResult got = test::usp_result(grid, shape, p, test::cp_config(shape, impl), layout);
          const std::string what = str_cat(layout_name(kind), " ", ring_impl_name(impl), mask.causal ? " causal" : " full",
                                           " w", mask.window, " on ", grid.str());
          expect_fp64_match(got, one, ref, what);
        }
      }
    }
  }
}

// The dropout is really on: another seed changes out by O(1) on every grid (and the lse not at all).
TEST(DropoutCp, AnotherSeedGivesAnotherResult) {
  const int n = world().size();
  const CpGrid grid(world(), {1, n % 2 == 0 ? 2 : 1, n % 2 == 0 ? n / 2 : n});
  const DropoutCase c{grid.config(), LayoutKind::kZigzag, RingImpl::kP2P, true, 2};
  test::MhaShape shape = shape_of(c, DType::kFloat32);
  const test::MhaProblem p(shape);
  MhaCpConfig cfg;
  cfg.dropout = shape.dropout;
  const test::MhaResult a = test::usp_result(grid, shape, p, cfg, c.layout);
  cfg.dropout.seed += 1;
  const test::MhaResult b = test::usp_result(grid, shape, p, cfg, c.layout);
  EXPECT_GT(test::rel_err(a.out, b.out), 0.1);
  EXPECT_EQ(a.lse, b.lse);
}

// A bad p fails on every rank in the constructor, before any message.
TEST(DropoutCp, BadProbabilityFailsInTheConstructorOnEveryRank) {
  const int n = world().size();
  const CpGrid grid(world(), {1, 1, n});
  const CpGroups groups = CpGroups::from(grid);
  const SequenceLayout layout = SequenceLayout::for_groups(groups, 16 * n);
  for (double bad : {-0.5, 1.0, std::numeric_limits<double>::quiet_NaN()}) {
    MhaCpConfig cfg;
    cfg.dropout.p = bad;
    try {
      MhaCp usp(groups, layout, cfg);
      ADD_FAILURE() << "dropout p " << bad << " was accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("ring attention: dropout p"), std::string::npos) << e.what();
    }
  }
}

}  // namespace
}  // namespace seqpar
