// Ulysses all-to-all and USP (Ulysses x Ring) against the single-rank result of the whole problem, for every
// grid of the world size (Pu x Pr, both placements), GQA with Hkv >= Pu and Hkv < Pu, MQA, fp32 and bf16.
#include <gtest/gtest.h>

#include <cstring>
#include <functional>

#include "parallel/comm_volume.h"
#include "parallel/ulysses.h"
#include "parallel/usp.h"
#include "runtime/cp_grid.h"
#include "tests/util/mha_problem.h"
#include "tests/util/mpi_test.h"
#include "tests/util/test_util.h"

namespace seqpar {
namespace {

using test::world;

struct UspCase {
  int ulysses_size;
  Placement placement;
  LayoutKind layout;
  RingImpl impl;
  bool causal;
  std::int64_t hkv;
  DType dtype;
};

std::string case_name(const UspCase& c) {
  return str_cat("u", c.ulysses_size, "_", placement_name(c.placement), "_", layout_name(c.layout), "_",
                 ring_impl_name(c.impl), c.causal ? "_causal" : "_full", "_hkv", c.hkv, "_", dtype_name(c.dtype));
}
void PrintTo(const UspCase& c, std::ostream* os) { *os << case_name(c); }

constexpr std::int64_t kHq = 8;

std::vector<UspCase> cases_for_world() {
  const int n = world().size();  // the MPI gtest main creates the world before registering tests
  std::vector<UspCase> cases;
  for (int pu = 1; pu <= n; ++pu) {
    if (n % pu != 0 || kHq % pu != 0) continue;
    for (Placement pl : {Placement::kUlyssesInner, Placement::kRingInner}) {
      if (pl == Placement::kRingInner && (pu == 1 || pu == n)) continue;  // same groups as ulysses_inner
      for (LayoutKind layout : {LayoutKind::kContiguous, LayoutKind::kZigzag}) {
        for (bool causal : {false, true}) {
          cases.push_back({pu, pl, layout, RingImpl::kP2P, causal, 2, DType::kFloat32});
        }
      }
      // GQA with Hkv < Pu (replicated KV heads) or >= Pu, MQA, MHA, all-gather ring, bf16.
      cases.push_back({pu, pl, LayoutKind::kZigzag, RingImpl::kP2P, true, 1, DType::kFloat32});
      cases.push_back({pu, pl, LayoutKind::kZigzag, RingImpl::kAllGather, true, kHq, DType::kFloat32});
      cases.push_back({pu, pl, LayoutKind::kZigzag, RingImpl::kP2P, true, 4, DType::kBFloat16});
      cases.push_back({pu, pl, LayoutKind::kContiguous, RingImpl::kAllGather, false, 1, DType::kBFloat16});
    }
  }
  return cases;
}

class UspVsSingleRank : public ::testing::TestWithParam<UspCase> {};

TEST_P(UspVsSingleRank, MatchesSingleRank) {
  const UspCase c = GetParam();
  const int n = world().size();
  CpGrid grid(world(), {1, c.ulysses_size, n / c.ulysses_size, c.placement});
  test::MhaShape shape;
  shape.batch = 2;
  shape.seq = 96;
  shape.hq = kHq;
  shape.hkv = c.hkv;
  shape.dim = 32;
  shape.dtype = c.dtype;
  shape.mask = {c.causal, 0};
  const test::MhaProblem p(shape);
  const test::MhaResult want = test::single_rank_result(shape, p);

  MhaCpConfig cfg;
  cfg.impl = c.impl;
  cfg.causal = c.causal;
  CpCounters counters;
  const test::MhaResult got = test::usp_result(grid, shape, p, cfg, c.layout, &counters);
  test::expect_mha_match(got, want, c.dtype, str_cat(case_name(c), " on ", grid.str()));

  // All-to-all volume: each all-to-all of N bytes moves (Pu-1)/Pu of N each way (the closed form sp_plan uses).
  MhaVolumeShape vs;
  vs.batch = shape.batch;
  vs.padded_len = shape.seq;
  vs.heads = kHq;
  vs.kv_heads = c.hkv;
  vs.head_dim = shape.dim;
  vs.storage_bytes = static_cast<std::int64_t>(dtype_size(c.dtype));
  vs.accum_bytes = c.dtype == DType::kFloat64 ? 8 : 4;
  vs.ring_size = n / c.ulysses_size;
  vs.ulysses_size = c.ulysses_size;
  vs.impl = c.impl;
  const MhaVolume v = mha_volume(vs);
  const std::int64_t total = v.a2a_forward + v.a2a_backward;
  EXPECT_EQ(counters.total_bytes_sent(), v.forward() + v.backward()) << "ring and all-to-all bytes together";
  EXPECT_EQ(counters.a2a_bytes_sent, total);
  EXPECT_EQ(counters.a2a_bytes_received, total);
}

INSTANTIATE_TEST_SUITE_P(Usp, UspVsSingleRank, ::testing::ValuesIn(cases_for_world()), test::CaseName());

TEST(Ulysses, AllToAllThenInverseIsIdentityBitwise) {
  const int n = world().size();
  for (DType dtype : {DType::kFloat32, DType::kBFloat16, DType::kFloat16, DType::kFloat64}) {
    Tensor x = test::random_tensor({2, 5, 2 * n, 3}, dtype, 21 + world().rank());
    Tensor h = Tensor::empty({2, 5 * n, 2, 3}, dtype, MemCategory::kWorkspace);
    Tensor back = Tensor::empty(x.shape(), dtype, MemCategory::kWorkspace);
    ulysses_scatter_heads(world(), x.view(), h.view());
    ulysses_gather_heads(world(), h.view(), back.view());
    EXPECT_EQ(0, std::memcmp(x.data(), back.data(), x.nbytes())) << dtype_name(dtype);
    // lse-shaped: [B, H/Pu, Pu*S] -> [B, H, S] against a direct construction.
    Tensor lse_h = test::random_tensor({2, 2, 5 * n}, DType::kFloat32, 31 + world().rank());
    Tensor lse = Tensor::empty({2, 2 * n, 5}, DType::kFloat32, MemCategory::kWorkspace);
    ulysses_gather_heads_bhs(world(), lse_h.view(), lse.view());
    // Rank u's lse[b, j*2 + h, s] comes from rank j's lse_h[b, h, u*5 + s].
    Tensor all = Tensor::empty({n, 2, 2, 5 * n}, DType::kFloat32, MemCategory::kWorkspace);
    world().all_gather(lse_h.view(), all.view())->wait();
    const float* a = all.data_as<float>();
    const float* l = lse.data_as<float>();
    const int u = world().rank();
    for (int b = 0; b < 2; ++b)
      for (int j = 0; j < n; ++j)
        for (int hh = 0; hh < 2; ++hh)
          for (int s = 0; s < 5; ++s)
            ASSERT_EQ(l[(b * 2 * n + j * 2 + hh) * 5 + s], a[((j * 2 + b) * 2 + hh) * 5 * n + u * 5 + s]);
  }
}

TEST(Ulysses, ScatterHeadsMatchesIndependentIndexing) {
  const int n = world().size(), u = world().rank();
  Tensor x = test::random_tensor({2, 3, 2 * n, 4}, DType::kFloat32, 41 + u);
  Tensor h = Tensor::empty({2, 3 * n, 2, 4}, DType::kFloat32, MemCategory::kWorkspace);
  ulysses_scatter_heads(world(), x.view(), h.view());
  Tensor all = Tensor::empty({n, 2, 3, 2 * n, 4}, DType::kFloat32, MemCategory::kWorkspace);
  world().all_gather(x.view(), all.view())->wait();
  const float* a = all.data_as<float>();
  const float* o = h.data_as<float>();
  // out[b, j*3 + s, hh, d] = x_j[b, s, u*2 + hh, d]
  for (int b = 0; b < 2; ++b)
    for (int j = 0; j < n; ++j)
      for (int s = 0; s < 3; ++s)
        for (int hh = 0; hh < 2; ++hh)
          for (int d = 0; d < 4; ++d)
            ASSERT_EQ(o[((b * 3 * n + j * 3 + s) * 2 + hh) * 4 + d],
                      a[(((j * 2 + b) * 3 + s) * 2 * n + u * 2 + hh) * 4 + d]);
}

TEST(Ulysses, HeadErrorsOnEveryRankWithOneMessage) {
  const int n = world().size();
  if (n == 1) GTEST_SKIP() << "every head count divides a Ulysses group of 1";
  auto message = [&](std::int64_t hq, std::int64_t hkv) {
    try {
      UlyssesHeads(hq, hkv, n);
    } catch (const Error& e) {
      return e.message();
    }
    return std::string();
  };
  const std::string bad_q = message(n * 2 + 1, 1);
  EXPECT_NE(bad_q.find(str_cat("Hq ", n * 2 + 1)), std::string::npos) << bad_q;
  EXPECT_NE(bad_q.find(str_cat("ulysses_size ", n)), std::string::npos) << bad_q;
  if (n >= 3) {
    // Hkv that neither is divisible by Pu nor divides it (e.g. Hkv = Pu + 1 with Hq = Pu (Pu + 1)).
    const std::string bad_kv = message(static_cast<std::int64_t>(n) * (n + 1), n + 1);
    EXPECT_NE(bad_kv.find(str_cat("Hkv ", n + 1)), std::string::npos) << bad_kv;
  }
  // Same message on every rank: compare lengths and a hash of the text.
  std::int64_t h = static_cast<std::int64_t>(std::hash<std::string>{}(bad_q)&0x7fffffffffff);
  std::int64_t v[2] = {h, -h};
  world().all_reduce(TensorView(v, DType::kInt64, {2}), ReduceOp::kMax)->wait();
  EXPECT_EQ(v[0], -v[1]);
  // USP: a local length that does not match the layout is refused before any all-to-all.
  CpGrid grid(world(), {1, n, 1, Placement::kUlyssesInner});
  const CpGroups groups = CpGroups::from(grid);
  MhaCp usp(groups, SequenceLayout::for_groups(groups, 4 * n), MhaCpConfig{});
  Tensor q = Tensor::zeros({1, 3, n, 8}, DType::kFloat32, MemCategory::kWorkspace);
  EXPECT_THROW(usp.forward(q.view(), q.view(), q.view()), Error);
  Tensor q4 = Tensor::zeros({1, 4, n + 1, 8}, DType::kFloat32, MemCategory::kWorkspace);
  EXPECT_THROW(usp.forward(q4.view(), q4.view(), q4.view()), Error);
}

// A layer built from the grid (its groups and, given a length, the zigzag layout of SequenceLayout::for_groups)
// computes bitwise what the layer built from CpGroups::from(grid) and that layout computes.
TEST(Usp, BuiltFromTheGridEqualsBuiltFromItsGroups) {
  const int n = world().size();
  const int pu = n % 2 == 0 ? 2 : 1;
  CpGrid grid(world(), {1, pu, n / pu, Placement::kUlyssesInner});
  const CpGroups groups = CpGroups::from(grid);
  const std::int64_t seq_len = 24 * n;
  MhaCpConfig cfg;
  cfg.causal = true;
  MhaCp from_groups(groups, SequenceLayout::for_groups(groups, seq_len), cfg);
  MhaCp from_grid(grid, seq_len, cfg);
  MhaCp from_grid_layout(grid, SequenceLayout::for_groups(groups, seq_len, LayoutKind::kZigzag), cfg);
  EXPECT_EQ(from_grid.positions(), from_groups.positions());
  const std::int64_t sl = from_grid.layout().local_len();
  const int r = grid.cp().rank();
  Tensor q = test::random_tensor({1, sl, 4, 8}, DType::kFloat32, 10 + r);
  Tensor k = test::random_tensor({1, sl, 2, 8}, DType::kFloat32, 20 + r);
  Tensor v = test::random_tensor({1, sl, 2, 8}, DType::kFloat32, 30 + r);
  Tensor dout = test::random_tensor({1, sl, 4, 8}, DType::kFloat32, 40 + r);
  auto run = [&](MhaCp& layer) {
    MhaCpOutput o = layer.forward(q, k, v);
    MhaCpGrads g = layer.backward(std::move(o.ctx), dout);
    std::vector<Tensor> all;
    for (Tensor* t : {&o.out, &o.lse, &g.dq, &g.dk, &g.dv}) all.push_back(std::move(*t));
    return all;
  };
  const std::vector<Tensor> want = run(from_groups);
  for (MhaCp* layer : {&from_grid, &from_grid_layout}) {
    const std::vector<Tensor> got = run(*layer);
    for (std::size_t i = 0; i < want.size(); ++i) {
      ASSERT_EQ(got[i].nbytes(), want[i].nbytes());
      EXPECT_EQ(std::memcmp(got[i].data(), want[i].data(), want[i].nbytes()), 0) << "tensor " << i;
    }
  }
}

// Inputs that only the ring (after the all-to-all) used to reject are refused before any message: an integer
// dtype, q / k differing in batch or head dim, a dout whose head dim differs from q's (its shape was checked
// against itself). A dout of another floating dtype gives gradients in q's dtype, as documented.
TEST(Usp, BadInputsAreRefusedBeforeTheAllToAll) {
  const int n = world().size();
  CpGrid grid(world(), {1, n, 1, Placement::kUlyssesInner});
  const CpGroups groups = CpGroups::from(grid);
  MhaCp usp(groups, SequenceLayout::for_groups(groups, 4 * n), MhaCpConfig{});
  const std::int64_t ops_before = grid.ulysses().counters().num_ops + grid.ring().counters().num_ops;
  auto sent = [&] { return grid.ulysses().counters().num_ops + grid.ring().counters().num_ops - ops_before; };
  auto error_of = [](const std::function<void()>& fn) {
    try {
      fn();
    } catch (const Error& e) {
      return e.message();
    }
    return std::string("<no error>");
  };
  Tensor qi = Tensor::zeros({1, 4, n, 8}, DType::kInt32, MemCategory::kWorkspace);
  std::string m = error_of([&] { usp.forward(qi.view(), qi.view(), qi.view()); });
  EXPECT_NE(m.find("USP: q, k, v have dtype int32, expected a floating dtype"), std::string::npos) << m;
  Tensor q = test::random_tensor({1, 4, n, 8}, DType::kFloat32, 1);
  Tensor k_d4 = test::random_tensor({1, 4, n, 4}, DType::kFloat32, 2);
  m = error_of([&] { usp.forward(q.view(), k_d4.view(), k_d4.view()); });
  EXPECT_NE(m.find("must share batch (dim 0) and head dim (dim 3)"), std::string::npos) << m;
  Tensor k_b2 = test::random_tensor({2, 4, n, 8}, DType::kFloat32, 3);
  m = error_of([&] { usp.forward(q.view(), k_b2.view(), k_b2.view()); });
  EXPECT_NE(m.find("must share batch (dim 0) and head dim (dim 3)"), std::string::npos) << m;
  EXPECT_EQ(sent(), 0) << "a refused forward communicated";

  MhaCpOutput o = usp.forward(q.view(), q.view(), q.view());
  const std::int64_t after_forward = sent();
  Tensor dout_d4 = test::random_tensor({1, 4, n, 4}, DType::kFloat32, 4);
  m = error_of([&] { usp.backward(std::move(o.ctx), dout_d4.view()); });
  EXPECT_NE(m.find("USP dout"), std::string::npos) << m;
  EXPECT_EQ(sent(), after_forward) << "a refused backward communicated";
  EXPECT_TRUE(o.ctx.live()) << "a refused backward consumed the context";
  Tensor dout64 = test::random_tensor({1, 4, n, 8}, DType::kFloat64, 5);
  MhaCpGrads g = usp.backward(std::move(o.ctx), dout64.view());
  EXPECT_EQ(g.dq.dtype(), DType::kFloat32);
  EXPECT_EQ(g.dk.dtype(), DType::kFloat32);
}

}  // namespace
}  // namespace seqpar
