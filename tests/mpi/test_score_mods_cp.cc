// Score modifiers (soft-capping, ALiBi, attention sinks) under every MHA CP path: ring p2p and all-gather, Ulysses
// and USP on every grid of the world size, against the single-rank result of the whole problem (out, lse, dq, dk,
// dv and dsinks, which every rank returns whole), GQA, B = 2, causal, non-causal and a window. The single-rank
// result itself is checked against the fp64 reference. Bad parameters are refused on every rank before anything is
// sent.
#include <gtest/gtest.h>

#include <functional>

#include "parallel/usp.h"
#include "runtime/cp_grid.h"
#include "tests/util/cp_test.h"
#include "tests/util/device_collectives.h"
#include "tests/util/mha_problem.h"
#include "tests/util/mpi_test.h"
#include "tests/util/test_util.h"

namespace seqpar {
namespace {

using test::world;

constexpr std::int64_t kHq = 12;  // divisible by every Ulysses size of 1, 2, 3, 4, 8 ranks but 8

struct ModsCase {
  int ulysses_size;
  RingImpl impl;
  LayoutKind layout;
  attn::MaskSpec mask;
  float softcap;
  bool alibi, sinks;
};

std::string case_name(const ModsCase& c) {
  return str_cat("u", c.ulysses_size, "_", ring_impl_name(c.impl), "_", layout_name(c.layout),
                 c.mask.causal ? "_causal" : "_full", c.mask.window > 0 ? "_window" : "",
                 c.softcap > 0 ? "_softcap" : "", c.alibi ? "_alibi" : "", c.sinks ? "_sinks" : "");
}
void PrintTo(const ModsCase& c, std::ostream* os) { *os << case_name(c); }

std::vector<ModsCase> cases_for_world() {
  std::vector<ModsCase> cases;
  for (const CpGridConfig& g : test::usp_grids(kHq, /*both_placements=*/false)) {
    const int pu = g.ulysses_size;
    for (RingImpl impl : {RingImpl::kP2P, RingImpl::kAllGather}) {
      cases.push_back({pu, impl, LayoutKind::kZigzag, {true, 0}, 4.0f, true, true});
      cases.push_back({pu, impl, LayoutKind::kContiguous, {false, 0}, 4.0f, true, true});
    }
    cases.push_back({pu, RingImpl::kP2P, LayoutKind::kZigzag, {true, 20}, 3.0f, true, true});
    cases.push_back({pu, RingImpl::kP2P, LayoutKind::kZigzag, {true, 0}, 0.0f, false, true});
    cases.push_back({pu, RingImpl::kP2P, LayoutKind::kContiguous, {false, 0}, 2.0f, false, false});
    cases.push_back({pu, RingImpl::kAllGather, LayoutKind::kZigzag, {true, 0}, 0.0f, true, false});
  }
  return cases;
}

class ScoreModsVsSingleRank : public ::testing::TestWithParam<ModsCase> {};

TEST_P(ScoreModsVsSingleRank, MatchesSingleRank) {
  const ModsCase c = GetParam();
  const int n = world().size();
  CpGrid grid(world(), test::ulysses_over_world(c.ulysses_size));
  test::MhaShape shape;
  shape.batch = 2;
  shape.seq = 48;
  shape.hq = kHq;
  shape.hkv = c.ulysses_size > 1 ? c.ulysses_size : 4;  // GQA; KV heads split over the Ulysses group
  shape.dim = 16;
  shape.mask = c.mask;
  const std::vector<float> slopes = attn::alibi_slopes(kHq);
  Tensor slopes_t = Tensor::empty({kHq}, DType::kFloat32, MemCategory::kWorkspace);
  std::copy(slopes.begin(), slopes.end(), slopes_t.view().data_as<float>());
  Tensor sinks = test::random_tensor({kHq}, DType::kFloat32, 21, -1.0, 3.0);
  shape.mods.softcap = c.softcap;
  if (c.alibi) shape.mods.alibi_slopes = slopes_t;
  if (c.sinks) shape.mods.sinks = sinks;
  const test::MhaProblem p(shape);
  const test::MhaResult want = test::single_rank_result(shape, p);
  if (n == 1) {  // the single-rank kernels themselves against the fp64 reference (once, on one rank)
    test::expect_mha_match(want, test::reference_result(shape, p), DType::kFloat32, "single rank vs reference");
  }
  const test::MhaResult got = test::usp_result(grid, shape, p, test::cp_config(shape, c.impl), c.layout);
  EXPECT_EQ(got.dsinks.size(), c.sinks ? static_cast<std::size_t>(kHq) : 0u);
  test::expect_mha_match(got, want, DType::kFloat32, str_cat(case_name(c), " on ", grid.str()));
}

INSTANTIATE_TEST_SUITE_P(ScoreMods, ScoreModsVsSingleRank, ::testing::ValuesIn(cases_for_world()), test::CaseName());

// Packed rows whose documents are not multiples of 2 ring_size (zigzag pads each one, so slots are not tokens): ALiBi
// reads |q_pos - k_pos| inside a document, a sink joins each row once, soft-capping is per pair. Every grid, kind and
// implementation, causal, full and a window, fp64, equals the one-rank kernel and the fp64 reference on the unpadded
// row (documents' bounds on token positions) within 1e-10, dsinks included.
TEST(ScoreMods, PackedRowsMatchOneRankAndTheReference) {
  const std::vector<std::int64_t> cu = cu_seqlens_of(std::vector<std::int64_t>{1, 3, 7, 0, 5, 2, 11});
  const DocBounds bounds = test::token_doc_bounds(cu);
  const std::vector<float> slopes = attn::alibi_slopes(kHq);
  Tensor slopes_t = Tensor::empty({kHq}, DType::kFloat32, MemCategory::kWorkspace);
  std::copy(slopes.begin(), slopes.end(), slopes_t.view().data_as<float>());
  Tensor sinks = test::random_tensor({kHq}, DType::kFloat64, 21, -1.0, 3.0);  // fp64: dsinks in fp64
  for (attn::MaskSpec mask : {attn::MaskSpec{true, 0}, attn::MaskSpec{false, 0}, attn::MaskSpec{true, 4}}) {
    test::MhaShape shape = test::one_row_fp64(cu.back(), kHq, 4, 16, {mask.causal, mask.window, bounds.lo, bounds.hi});
    shape.mods.softcap = 3.0f;
    shape.mods.alibi_slopes = slopes_t;
    shape.mods.sinks = sinks;
    const test::MhaProblem p(shape);
    const test::MhaResult one = test::single_rank_result(shape, p);
    const test::MhaResult ref = test::reference_result(shape, p);
    for (const CpGridConfig& gc : test::usp_grids(kHq, /*both_placements=*/false)) {
      if (shape.hkv % gc.ulysses_size != 0) continue;
      const CpGrid grid(world(), gc);
      const CpGroups groups = CpGroups::from(grid);
      for (LayoutKind kind : {LayoutKind::kZigzag, LayoutKind::kContiguous, LayoutKind::kBalanced}) {
        for (RingImpl impl : {RingImpl::kP2P, RingImpl::kAllGather}) {
          const test::MhaResult got = test::usp_result(grid, shape, p, test::cp_config(shape, impl),
                                                       SequenceLayout::packed_for_groups(groups, cu, kind));
          const std::string what = str_cat(layout_name(kind), " ", ring_impl_name(impl), mask.causal ? " causal" : " full",
                                           " w", mask.window, " on ", grid.str());
          test::expect_mha_close(got, one, 1e-10, what + " against one rank:");
          test::expect_mha_close(got, ref, 1e-10, what + " against the fp64 reference:");
        }
      }
    }
  }
}

// A loss that also reads lse (MhaCp::backward's dlse) with sinks and GQA, on a packed zigzag row: every grid
// and implementation equals one kernel call on the whole row with the same dlse (attn::MhaBackwardArgs::dlse, itself
// checked against central differences in tests/unit/test_mha.cc), dsinks from delta - dlse, fp64, within 1e-10.
TEST(ScoreMods, LseGradientWithSinksMatchesOneRank) {
  const std::vector<std::int64_t> cu = cu_seqlens_of(std::vector<std::int64_t>{1, 3, 7, 0, 5, 2, 11});
  const DocBounds bounds = test::token_doc_bounds(cu);
  const std::int64_t T = cu.back(), hkv = 4, D = 16;
  Tensor sinks = test::random_tensor({kHq}, DType::kFloat64, 23, -1.0, 2.0);
  const test::MhaProblem p(test::one_row_fp64(T, kHq, hkv, D));
  const Tensor dlse = test::random_tensor({1, kHq, T}, DType::kFloat64, 24, -2.0, 2.0);
  // one kernel call on the whole row
  attn::MhaForwardArgs a;
  a.q = p.q;
  a.k = p.k;
  a.v = p.v;
  a.mask = {true, 0, bounds.lo, bounds.hi};
  a.mods.sinks = sinks;
  Tensor out = Tensor::empty(p.q.shape(), DType::kFloat64, MemCategory::kWorkspace);
  Tensor lse = Tensor::empty({1, kHq, T}, DType::kFloat64, MemCategory::kWorkspace);
  attn::mha_forward(a, out, lse);
  attn::MhaBackwardArgs b{a, out, p.dout, lse, {}};
  b.dlse = dlse;
  Tensor dq = Tensor::empty(p.q.shape(), DType::kFloat64, MemCategory::kWorkspace);
  Tensor dk = Tensor::empty(p.k.shape(), DType::kFloat64, MemCategory::kWorkspace);
  Tensor dv = Tensor::empty(p.k.shape(), DType::kFloat64, MemCategory::kWorkspace);
  attn::mha_backward(b, dq, dk, dv, false);
  Tensor delta = Tensor::empty(lse.shape(), DType::kFloat64, MemCategory::kWorkspace);
  attn::mha_backward_delta(out, p.dout, delta);
  for (std::int64_t i = 0; i < delta.numel(); ++i) delta.data_as<double>()[i] -= dlse.data_as<double>()[i];
  Tensor dsinks = Tensor::empty({kHq}, DType::kFloat64, MemCategory::kWorkspace);
  attn::mha_sinks_backward({delta, lse, sinks}, dsinks);
  const test::MhaResult want{test::to_double(out), test::to_double(lse), test::to_double(dq), test::to_double(dk),
                             test::to_double(dv), test::to_double(dsinks)};
  for (const CpGridConfig& gc : test::usp_grids(kHq, /*both_placements=*/false)) {
    if (hkv % gc.ulysses_size != 0) continue;
    const CpGrid grid(world(), gc);
    const CpGroups groups = CpGroups::from(grid);
    const SequenceLayout layout = SequenceLayout::packed_for_groups(groups, cu, LayoutKind::kZigzag);
    for (RingImpl impl : {RingImpl::kP2P, RingImpl::kAllGather}) {
      MhaCpConfig cfg;
      cfg.impl = impl;
      cfg.causal = true;
      cfg.score_mods.sinks = sinks;
      MhaCp usp(groups, layout, cfg);
      auto piece = [&](const Tensor& full, int seq_dim) {
        Shape shape = full.shape();
        shape[seq_dim] = layout.local_len();
        Tensor t = Tensor::empty(shape, full.dtype(), MemCategory::kWorkspace);
        shard_sequence(layout, groups.cp_rank(), full.view(), t.view(), seq_dim);
        return t;
      };
      Tensor q = piece(p.q, 1), k = piece(p.k, 1), v = piece(p.v, 1), dout = piece(p.dout, 1), dl = piece(dlse, 2);
      MhaCpOutput o = usp.forward(q.view(), k.view(), v.view());
      MhaCpGrads g = usp.backward(std::move(o.ctx), dout.view(), dl.view());
      Communicator& sp = grid.cp();
      const test::MhaResult got{test::gather_full(sp, layout, o.out.view(), p.q.shape()),
                                test::gather_full(sp, layout, o.lse.view(), {1, kHq, T}, 2),
                                test::gather_full(sp, layout, g.dq.view(), p.q.shape()),
                                test::gather_full(sp, layout, g.dk.view(), p.k.shape()),
                                test::gather_full(sp, layout, g.dv.view(), p.k.shape()),
                                test::to_double(g.dsinks.view())};
      test::expect_mha_close(got, want, 1e-10, str_cat(ring_impl_name(impl), " on ", grid.str(), ":"));
    }
  }
}

// Every rank gets the same one error, and nothing is sent.
TEST(ScoreMods, BadParametersAreRefusedOnEveryRank) {
  const int n = world().size();
  CpGrid grid(world(), {1, 1, n, Placement::kUlyssesInner});
  const CpGroups groups = CpGroups::from(grid);
  const SequenceLayout layout = SequenceLayout::for_groups(groups, 8 * n);
  Tensor q = test::random_tensor({1, 8, 4, 8}, DType::kFloat32, 1);
  Tensor wrong = Tensor::zeros({5}, DType::kFloat32, MemCategory::kWorkspace);
  Tensor half = Tensor::zeros({4}, DType::kBFloat16, MemCategory::kWorkspace);
  const std::int64_t ops_before = grid.ring().counters().num_ops;
  auto error_of = [&](const std::function<void(MhaCpConfig&)>& set) {
    MhaCpConfig cfg;
    set(cfg);
    return test::error_of([&] { MhaCp(groups, layout, cfg).forward(q.view(), q.view(), q.view()); });
  };
  std::string m = error_of([](MhaCpConfig& c) { c.score_mods.softcap = -2.0f; });
  EXPECT_NE(m.find("softcap -2 must be finite and > 0"), std::string::npos) << m;
  m = error_of([&](MhaCpConfig& c) { c.score_mods.alibi_slopes = wrong; });
  EXPECT_NE(m.find("alibi_slopes must be [Hq] = [4]"), std::string::npos) << m;
  m = error_of([&](MhaCpConfig& c) { c.score_mods.sinks = half; });
  EXPECT_NE(m.find("sinks has dtype bf16"), std::string::npos) << m;
  EXPECT_EQ(grid.ring().counters().num_ops, ops_before) << "a refused forward communicated";
}

}  // namespace
}  // namespace seqpar
