// A hybrid stack (Qwen3-Next style: 3 GDN layers then 1 MHA layer, then a DSA layer) sharded once by ONE layout
// object that every layer takes, forward and backward, under USP and a ring over the world, against the same
// stack run on one rank (a 1 x 1 grid on a self communicator), on every rank.
//
// The chain: x_0 is the input; GDN layer i (one GdnCp object for the three) takes q = k = v = x_i with
// fixed g_i, beta_i and gives x_{i+1} = x_i + out_i; MHA takes q = k = v = x_3 and gives x_4 = x_3 + out; DSA takes
// q = x_4, the latent c = head 0 of x_4, and fixed indexer inputs; its out is the stack's output. The backward
// chains dout through the same maps to dx_0.
#include <gtest/gtest.h>

#include "parallel/dsa_cp.h"
#include "parallel/gdn_cp.h"
#include "parallel/usp.h"
#include "runtime/cp_grid.h"
#include "runtime/tensor_ops.h"
#include "tests/util/mha_problem.h"
#include "tests/util/mpi_test.h"
#include "tests/util/test_util.h"

namespace seqpar {
namespace {

using test::all_close;
using test::to_double;
using test::world;

constexpr std::int64_t kB = 1, kS = 64, kH = 4, kD = 16, kHi = 2, kDi = 8, kDv = 8, kTopk = 8;
constexpr int kGdnLayers = 3;

struct StackInputs {  // full tensors, fp32
  Tensor x, g[kGdnLayers], beta[kGdnLayers], q_idx, k_idx, w, dout;
  StackInputs() {
    x = test::random_tensor({kB, kS, kH, kD}, DType::kFloat32, 501);
    for (int i = 0; i < kGdnLayers; ++i) {
      g[i] = test::random_tensor({kB, kS, kH}, DType::kFloat32, 510 + i, -0.1, -0.001);
      beta[i] = test::random_tensor({kB, kS, kH}, DType::kFloat32, 520 + i, 0.05, 0.5);
    }
    q_idx = test::random_tensor({kB, kS, kHi, kDi}, DType::kFloat32, 530);
    k_idx = test::random_tensor({kB, kS, kDi}, DType::kFloat32, 531);
    w = test::random_tensor({kB, kS, kHi}, DType::kFloat32, 532, 0.1, 1.0);
    dout = test::random_tensor({kB, kS, kH, kDv}, DType::kFloat32, 533);
  }
};

struct StackResult {  // full tensors gathered on every rank, as fp64
  std::vector<double> out, lse, topk, dx;
  double loss = 0;
};

Tensor piece(const Tensor& full, const std::vector<std::int64_t>& pos) { return test::local_piece(full.view(), pos); }

Tensor copy(const TensorView& t) { return Tensor::copy_of(t, t.dtype(), MemCategory::kWorkspace); }

// x + y as a new tensor (fp32).
Tensor sum(const TensorView& x, const TensorView& y) {
  Tensor r = copy(x);
  add_inplace(r.view(), y);
  return r;
}

const std::vector<std::int64_t> kHead0 = {0};

StackResult run_stack(const CpGroups& groups, const SequenceLayout& layout, const StackInputs& in) {
  const std::vector<std::int64_t> pos = layout.positions(groups.cp_rank());
  const std::int64_t sl = layout.local_len();
  GdnCpConfig gcfg;
  gcfg.chunk_size = 8;
  GdnCp gdn(groups, layout, gcfg);  // one object, three layers
  MhaCp mha(groups, layout, MhaCpConfig{});
  DsaCpConfig dcfg;
  dcfg.topk = kTopk;
  dcfg.dim_v = kDv;
  DsaCp dsa(groups, layout, dcfg);

  // ---- forward ----
  Tensor x = piece(in.x, pos);
  std::vector<Tensor> g, beta;
  std::vector<CpContext> gdn_ctx;
  for (int i = 0; i < kGdnLayers; ++i) {
    g.push_back(piece(in.g[i], pos));
    beta.push_back(piece(in.beta[i], pos));
    GdnCpOutput o = gdn.forward(x.view(), x.view(), x.view(), g[i].view(), beta[i].view());
    gdn_ctx.push_back(std::move(o.ctx));
    x = sum(x.view(), o.out.view());
  }
  MhaCpOutput mo = mha.forward(x.view(), x.view(), x.view());
  x = sum(x.view(), mo.out.view());
  Tensor c = Tensor::empty({kB, sl, 1, kD}, DType::kFloat32, MemCategory::kWorkspace);
  gather_rows(x.view(), 2, kHead0, c.view());
  Tensor qi = piece(in.q_idx, pos), ki = piece(in.k_idx, pos), w = piece(in.w, pos);
  DsaCpOutput dso = dsa.forward(x.view(), c.view().reshape({kB, sl, kD}), qi.view(), ki.view(), w.view());

  // ---- backward, in reverse layer order ----
  Tensor dout = piece(in.dout, pos);
  DsaCpGrads dg = dsa.backward(std::move(dso.ctx), dout.view());
  Tensor dx = copy(dg.dq.view());
  index_add_rows(dg.dc.view().reshape({kB, sl, 1, kD}), 2, kHead0, dx.view());
  MhaCpGrads mg = mha.backward(std::move(mo.ctx), dx.view());
  dx = sum(sum(sum(dx.view(), mg.dq.view()).view(), mg.dk.view()).view(), mg.dv.view());
  for (int i = kGdnLayers - 1; i >= 0; --i) {
    GdnCpGrads gg = gdn.backward(std::move(gdn_ctx[i]), dx.view());
    dx = sum(sum(sum(dx.view(), gg.dq.view()).view(), gg.dk.view()).view(), gg.dv.view());
  }

  auto gather = [&](const Tensor& local, const Shape& full_shape, int seq_dim = 1) {
    Tensor full = Tensor::empty(full_shape, local.dtype(), MemCategory::kWorkspace);
    gather_sequence(groups.cp, layout, local.view(), full.view(), seq_dim);
    return to_double(full);
  };
  StackResult r;
  r.out = gather(dso.out, {kB, kS, kH, kDv});
  r.lse = gather(dso.lse, {kB, kH, kS}, 2);
  r.topk = gather(dso.topk_indices, {kB, kS, kTopk});
  r.dx = gather(dx, {kB, kS, kH, kD});
  r.loss = dg.loss;
  return r;
}

TEST(HybridStack, OneLayoutForEveryLayerMatchesOneRank) {
  const int n = world().size();
  const StackInputs in;
  // The same stack on one rank.
  auto self = world().split(world().rank(), 0);
  const CpGrid one(*self, {1, 1, 1});
  const CpGroups one_groups = CpGroups::from(one);
  const StackResult want = run_stack(one_groups, SequenceLayout::for_groups(one_groups, kS), in);

  std::vector<CpGridConfig> grids = {{1, 1, n}};            // ring over the world
  if (n % 2 == 0 && n > 2) grids.push_back({1, 2, n / 2});  // USP 2 x (n / 2)
  if (n == 2) grids.push_back({1, 2, 1});                   // Ulysses 2
  for (const CpGridConfig& cfg : grids) {
    const CpGrid grid(world(), cfg);
    const CpGroups groups = CpGroups::from(grid);
    const SequenceLayout layout = SequenceLayout::for_groups(groups, kS);  // zigzag, for every layer
    const StackResult got = run_stack(groups, layout, in);
    const std::string name = str_cat("hybrid stack on ", grid.str(), " (", layout_name(layout.kind()), ")");
    // fp32 with other block, segment and merge orders, through five layers: rounding only.
    const double atol = 1e-4, rtol = 1e-3;
    EXPECT_EQ(got.topk, want.topk) << name << ": topk_indices";
    EXPECT_TRUE(all_close(got.out, want.out, atol, rtol, name + " out"));
    EXPECT_TRUE(all_close(got.lse, want.lse, atol, rtol, name + " lse"));
    EXPECT_TRUE(all_close(got.dx, want.dx, atol, rtol, name + " dx"));
    EXPECT_NEAR(got.loss, want.loss, 1e-4 * std::max(1.0, std::abs(want.loss))) << name << " indexer loss";
  }
}

}  // namespace
}  // namespace seqpar
