// CP layers are stateless between calls: one configured object serves several layers (or micro-batches), each
// forward's context owns exactly one layer's saved activations, backwards may come in any order, and a context is
// accepted once, only by the object that made it.
#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <utility>
#include <vector>

#include "parallel/dsa_cp.h"
#include "parallel/gdn_cp.h"
#include "parallel/ring_attention.h"
#include "parallel/usp.h"
#include "runtime/cp_grid.h"
#include "tests/util/cp_test.h"
#include "tests/util/device_collectives.h"
#include "tests/util/mha_problem.h"
#include "tests/util/mpi_test.h"
#include "tests/util/test_util.h"

namespace seqpar {
namespace {

using test::saved_bytes;
using test::world;

using test::error_of;

test::MhaShape mha_shape(std::uint64_t seed) {
  test::MhaShape s;
  s.batch = 1;
  s.seq = 48;
  s.hq = 4;
  s.hkv = 2;
  s.dim = 16;
  s.mask = {true, 0};
  s.seed = seed;
  return s;
}

// Two layers through one USP object, interleaved: forward(l1), forward(l2), backward(l2), backward(l1); each
// layer's outputs and gradients match its own single-rank result.
TEST(CpContext, OneObjectServesTwoInterleavedLayers) {
  const CpGrid grid(world(), test::small_grid_config());
  const CpGroups groups = CpGroups::from(grid);
  const test::MhaShape s1 = mha_shape(0), s2 = mha_shape(100);
  const SequenceLayout layout = SequenceLayout::for_groups(groups, s1.seq);
  MhaCp usp(groups, layout, MhaCpConfig{});
  const test::MhaProblem p1(s1), p2(s2);
  const auto& pos = usp.positions();
  Tensor q1 = test::local_piece(p1.q.view(), pos), k1 = test::local_piece(p1.k.view(), pos),
         v1 = test::local_piece(p1.v.view(), pos), d1 = test::local_piece(p1.dout.view(), pos);
  Tensor q2 = test::local_piece(p2.q.view(), pos), k2 = test::local_piece(p2.k.view(), pos),
         v2 = test::local_piece(p2.v.view(), pos), d2 = test::local_piece(p2.dout.view(), pos);
  MhaCpOutput o1 = usp.forward(q1.view(), k1.view(), v1.view());
  MhaCpOutput o2 = usp.forward(q2.view(), k2.view(), v2.view());
  MhaCpGrads g2 = usp.backward(std::move(o2.ctx), d2.view());
  MhaCpGrads g1 = usp.backward(std::move(o1.ctx), d1.view());
  const std::pair<const MhaCpOutput*, const MhaCpGrads*> results[] = {{&o1, &g1}, {&o2, &g2}};
  const test::MhaShape* shapes[] = {&s1, &s2};
  const test::MhaProblem* problems[] = {&p1, &p2};
  for (int l = 0; l < 2; ++l) {
    const test::MhaShape& s = *shapes[l];
    const test::MhaProblem& p = *problems[l];
    test::MhaResult got;
    got.out = test::gather_full(grid.cp(), layout, results[l].first->out.view(), p.q.shape());
    got.lse = test::gather_full(grid.cp(), layout, results[l].first->lse.view(), {s.batch, s.hq, s.seq}, 2);
    got.dq = test::gather_full(grid.cp(), layout, results[l].second->dq.view(), p.q.shape());
    got.dk = test::gather_full(grid.cp(), layout, results[l].second->dk.view(), p.k.shape());
    got.dv = test::gather_full(grid.cp(), layout, results[l].second->dv.view(), p.v.shape());
    test::expect_mha_match(got, test::single_rank_result(s, p), s.dtype,
                           str_cat("layer ", l + 1, " of two interleaved on ", grid.str()));
  }
}

TEST(CpContext, ContextMisuseIsAClearError) {
  const CpGrid grid(world(), test::small_grid_config());
  const CpGroups groups = CpGroups::from(grid);
  const test::MhaShape s = mha_shape(0);
  const SequenceLayout layout = SequenceLayout::for_groups(groups, s.seq);
  MhaCp usp(groups, layout, MhaCpConfig{}), other(groups, layout, MhaCpConfig{});
  const test::MhaProblem p(s);
  const auto& pos = usp.positions();
  Tensor q = test::local_piece(p.q.view(), pos), k = test::local_piece(p.k.view(), pos),
         v = test::local_piece(p.v.view(), pos), d = test::local_piece(p.dout.view(), pos);

  EXPECT_EQ(error_of([&] { usp.backward(CpContext{}, d.view()); }),
            "USP: backward() got an empty context (default-constructed or moved from); pass the context its "
            "forward() returned");
  MhaCpOutput o = usp.forward(q.view(), k.view(), v.view());
  // Another object, even one of the same configuration, refuses it and leaves it live.
  const std::string foreign = error_of([&] { other.backward(std::move(o.ctx), d.view()); });
  EXPECT_NE(foreign.find("USP: backward() got a context made by another layer object"), std::string::npos) << foreign;
  EXPECT_TRUE(o.ctx.live());
  // A moved-from context is empty.
  CpContext moved = std::move(o.ctx);
  EXPECT_FALSE(o.ctx.live());
  EXPECT_NE(error_of([&] { usp.backward(std::move(o.ctx), d.view()); }).find("empty context"), std::string::npos);
  usp.backward(std::move(moved), d.view());
  EXPECT_EQ(error_of([&] { usp.backward(std::move(moved), d.view()); }),
            "USP: backward() got a context that a backward() already used; each forward's context serves one "
            "backward");
  // A copy of a layer is another object.
  MhaCp copy = usp;
  MhaCpOutput o2 = usp.forward(q.view(), k.view(), v.view());
  EXPECT_NE(error_of([&] { copy.backward(std::move(o2.ctx), d.view()); }).find("another layer object"),
            std::string::npos);
  usp.backward(std::move(o2.ctx), d.view());
  // A moved layer is the same layer: its contexts made before the move still serve (e.g. a std::vector of layers that
  // reallocates between forward and backward).
  MhaCpOutput o3 = usp.forward(q.view(), k.view(), v.view());
  MhaCp moved_layer = std::move(usp);
  moved_layer.backward(std::move(o3.ctx), d.view());
  EXPECT_FALSE(o3.ctx.live());
  EXPECT_TRUE(test::all_ranks(world(), true));
}

// A layer kind under test: runs forwards (returning their contexts) and a backward of one context.
struct Kind {
  std::string name;
  std::function<CpContext()> forward;
  std::function<void(CpContext&&)> backward;
};

// saved_activation after N forwards is N times one layer's, and back to the start after the N backwards in a
// mixed order; for every CP layer kind.
void expect_saved_ledger(const Kind& kind) {
  const std::int64_t base = saved_bytes();
  std::vector<CpContext> ctx;
  ctx.push_back(kind.forward());
  const std::int64_t one = saved_bytes() - base;
  EXPECT_GT(one, 0) << kind.name;
  for (int i = 1; i < 4; ++i) {
    ctx.push_back(kind.forward());
    EXPECT_EQ(saved_bytes() - base, (i + 1) * one) << kind.name << " after " << i + 1 << " forwards";
  }
  int left = 4;
  for (int i : {2, 0, 3, 1}) {
    kind.backward(std::move(ctx[i]));
    --left;
    EXPECT_EQ(saved_bytes() - base, left * one) << kind.name << " after backward of forward " << i;
  }
  EXPECT_EQ(saved_bytes(), base) << kind.name;
}

TEST(CpContext, SavedActivationsAreOwnedByTheContexts) {
  const test::SmallCpCase small;
  const CpGroups& groups = small.groups;
  const SequenceLayout& layout = small.layout;
  const std::int64_t B = small.B, H = small.H, D = small.D, sl = small.sl;
  auto rnd = [](const Shape& s, std::uint64_t seed, double lo = -1, double hi = 1) {
    return test::random_tensor(s, DType::kFloat32, seed, lo, hi);
  };

  MhaCp usp(groups, layout, MhaCpConfig{});
  Tensor q = rnd({B, sl, H, D}, 1), kv = rnd({B, sl, 2, D}, 2);
  expect_saved_ledger({"USP", [&] { return usp.forward(q.view(), kv.view(), kv.view()).ctx; },
                       [&](CpContext&& c) { usp.backward(std::move(c), q.view()); }});

  GdnCpConfig gcfg;
  gcfg.chunk_size = 8;
  GdnCp gdn(groups, layout, gcfg);
  Tensor g = rnd({B, sl, H}, 3, -0.1, -0.01), beta = rnd({B, sl, H}, 4, 0.1, 0.5);
  expect_saved_ledger({"GDN", [&] { return gdn.forward(q.view(), q.view(), q.view(), g.view(), beta.view()).ctx; },
                       [&](CpContext&& c) { gdn.backward(std::move(c), q.view()); }});

  DsaCpConfig dcfg;
  dcfg.topk = 6;
  dcfg.dim_v = 8;
  DsaCp dsa(groups, layout, dcfg);
  Tensor c = rnd({B, sl, D}, 5), qi = rnd({B, sl, 2, 8}, 6), ki = rnd({B, sl, 8}, 7), w = rnd({B, sl, 2}, 8);
  Tensor dout = rnd({B, sl, H, 8}, 9);
  expect_saved_ledger({"DSA", [&] { return dsa.forward(q.view(), c.view(), qi.view(), ki.view(), w.view()).ctx; },
                       [&](CpContext&& ctx) { dsa.backward(std::move(ctx), dout.view()); }});

  ShortConvCp conv(groups, layout);
  Tensor wc = rnd({D, 4}, 10), dw = rnd({D, 4}, 11);
  expect_saved_ledger({"short conv", [&] { return conv.forward(c.view(), wc.view()).ctx; },
                       [&](CpContext&& ctx) { conv.backward(std::move(ctx), c.view(), dw.view()); }});
}

TEST(CpContext, LayoutMustMatchTheGroups) {
  const CpGrid grid(world(), test::small_grid_config());
  const CpGroups groups = CpGroups::from(grid);
  const int n = world().size();
  const SequenceLayout wrong(LayoutKind::kZigzag, 16 * n, n, 1);  // every rank in the ring, no Ulysses
  if (groups.ulysses_size() == 1) GTEST_SKIP() << "a ring over the world is what the wrong layout describes";
  for (const auto& make :
       std::vector<std::function<void()>>{[&] { MhaCp(groups, wrong, MhaCpConfig{}); },
                                          [&] { GdnCp(groups, wrong, GdnCpConfig{}); },
                                          [&] { DsaCp(groups, wrong, DsaCpConfig{}); },
                                          [&] { ShortConvCp(groups, wrong); }}) {
    const std::string m = error_of(make);
    EXPECT_NE(m.find(str_cat("the layout was built for ring_size ", n,
                             " x ulysses_size 1, but the groups have ring_size ", n / 2, " x ulysses_size 2")),
              std::string::npos)
        << m;
  }
}

// Device-neutral schedules: CUDA inputs (a fake device pointer: nothing reads it) reach the attention boundary,
// which (MHA: in a build without CUDA) refuses them with its "no CUDA implementation yet" error before any buffer
// is allocated or any data is sent (no message but the ranks' agreement check), on every rank alike. Inputs on two
// devices are a clear error too.
TEST(CpContext, CudaInputsStopAtTheAttentionBoundaryBeforeAnyMessage) {
  const CpGrid grid(world(), test::small_grid_config());
  const CpGroups groups = CpGroups::from(grid);
  const std::int64_t seq = 48, B = 1, H = 4, D = 16;
  const SequenceLayout layout = SequenceLayout::for_groups(groups, seq);
  [[maybe_unused]] const std::int64_t sl = layout.local_len(), sr = layout.ring_shard_len();  // sr: builds without CUDA
  void* fake = reinterpret_cast<void*>(std::uintptr_t{0x1000});
  auto cuda = [&](const Shape& s) { return TensorView(fake, DType::kFloat32, s, Device::cuda(0)); };
  auto counters = [&] {
    return std::vector<std::int64_t>{groups.ulysses.counters().num_ops, groups.ring.counters().num_ops,
                                     groups.cp.counters().num_ops, groups.cp.counters().bytes_sent};
  };
  const std::vector<std::int64_t> before = counters();

  RingAttention ring(groups, layout, MhaCpConfig{});
  MhaCp usp(groups, layout, MhaCpConfig{});
  GdnCpConfig gcfg;
  gcfg.chunk_size = 8;
  GdnCp gdn(groups, layout, gcfg);
  DsaCpConfig dcfg;
  dcfg.topk = 6;
  dcfg.dim_v = 8;
  DsaCp dsa(groups, layout, dcfg);
  ShortConvCp conv(groups, layout);
  // In a CUDA build the MHA layers take CUDA tensors (the fake pointer would be read): only the others are refused.
  const std::vector<std::pair<const char*, std::function<void()>>> calls = {
#if !defined(SEQPAR_WITH_CUDA)
      {"ring attention",
       [&] {
         ring.forward(cuda({B, sr, H, D}), cuda({B, sr, 2, D}), cuda({B, sr, 2, D}));
       }},
      {"USP",
       [&] {
         usp.forward(cuda({B, sl, H, D}), cuda({B, sl, 2, D}), cuda({B, sl, 2, D}));
       }},
#endif
      {"GDN",
       [&] {
         gdn.forward(cuda({B, sl, H, D}), cuda({B, sl, H, D}), cuda({B, sl, H, D}), cuda({B, sl, H}), cuda({B, sl, H}));
       }},
      {"DSA",
       [&] {
         dsa.forward(cuda({B, sl, H, D}), cuda({B, sl, D}), cuda({B, sl, 2, 8}), cuda({B, sl, 8}), cuda({B, sl, 2}));
       }},
      {"short conv",
       [&] {
         conv.forward(cuda({B, sl, D}), cuda({D, 4}));
       }},
  };
  // The only message before the refusal is each layer's agreement check (one all-reduce of its call's fingerprint,
  // parallel/cp_common.h): over the ring group for RingAttention, the CP group for the others; nothing else.
  auto expected = [&] {
    const std::int64_t ring_checks = ring.forward_agreement().num_checks(),
                       sp_checks = usp.forward_agreement().num_checks() + gdn.forward_agreement().num_checks() +
                                   dsa.forward_agreement().num_checks() + conv.forward_agreement().num_checks();
    std::vector<std::int64_t> e = before;
    e[1] += ring_checks;
    e[2] += sp_checks;
    e[3] = counters()[3] <= before[3] + 2 * 24 * sp_checks ? counters()[3] : -1;  // at most 2 x 24 bytes a check
    return e;
  };
  for (const auto& [name, call] : calls) {
    const std::string m = error_of(call);
    EXPECT_NE(m.find("kernels have no CUDA implementation yet"), std::string::npos) << name << ": " << m;
    EXPECT_EQ(counters(), expected()) << name << " communicated before refusing CUDA inputs";
  }

  // A host q with CUDA k / v: refused by the layer itself, naming both devices.
  Tensor q = test::random_tensor({B, sl, H, D}, DType::kFloat32, 1, -1, 1);
  const std::string m = error_of([&] { usp.forward(q.view(), cuda({B, sl, 2, D}), cuda({B, sl, 2, D})); });
  EXPECT_NE(m.find("USP forward: every input must be on one device"), std::string::npos) << m;
  EXPECT_NE(m.find("@cuda:0"), std::string::npos) << m;
  EXPECT_EQ(counters(), expected());
}

// A group of one rank communicates nothing, so nothing can be exposed: every layer's forward and backward on groups
// of one (each rank alone) report zero exposed communication time and zero bytes (the exposed comm column
// of sp_bench read 19% for a one-rank GDN forward, the wait of a broadcast to itself).
TEST(CpContext, GroupsOfOneExposeNoCommunication) {
  const std::unique_ptr<Communicator> self = world().split(world().rank(), 0);
  const CpGroups groups(*self, *self, *self);
  const std::int64_t seq = 37, B = 1, H = 2, D = 8;  // odd: a ring of one takes any length
  const SequenceLayout layout = SequenceLayout::for_groups(groups, seq);
  auto rnd = [](const Shape& s, std::uint64_t seed, double lo = -1, double hi = 1) {
    return test::random_tensor(s, DType::kFloat32, seed, lo, hi);
  };
  const Tensor q = rnd({B, seq, H, D}, 1), dout = rnd({B, seq, H, D}, 2), g = rnd({B, seq, H}, 3, -0.1, -0.01),
               beta = rnd({B, seq, H}, 4, 0.1, 0.5), c = rnd({B, seq, D}, 5), qi = rnd({B, seq, 2, 8}, 6),
               ki = rnd({B, seq, 8}, 7), wi = rnd({B, seq, 2}, 8), ddsa = rnd({B, seq, H, 4}, 9);
  // Runs `layer`'s forward, then its backward on the forward's context; after each, nothing exposed or sent.
  auto expect_nothing_exposed = [](const auto& layer, auto forward, auto backward, const std::string& what) {
    auto o = forward();
    EXPECT_EQ(layer.counters().total_exposed_s(), 0.0) << what << " forward";
    backward(std::move(o.ctx));
    EXPECT_EQ(layer.counters().total_exposed_s(), 0.0) << what << " forward + backward";
    EXPECT_EQ(layer.counters().total_bytes_sent(), 0) << what;
  };
  for (RingImpl impl : {RingImpl::kP2P, RingImpl::kAllGather}) {
    MhaCp usp(groups, layout, MhaCpConfig{impl});
    expect_nothing_exposed(
        usp, [&] { return usp.forward(q.view(), q.view(), q.view()); },
        [&](CpContext&& ctx) { usp.backward(std::move(ctx), dout.view()); }, str_cat("MHA ", ring_impl_name(impl)));
  }
  for (GdnCpMode mode : {GdnCpMode::kChain, GdnCpMode::kScan}) {
    GdnCpConfig cfg;
    cfg.mode = mode;
    cfg.chunk_size = 8;
    GdnCp gdn(groups, layout, cfg);
    expect_nothing_exposed(
        gdn, [&] { return gdn.forward(q.view(), q.view(), q.view(), g.view(), beta.view()); },
        [&](CpContext&& ctx) { gdn.backward(std::move(ctx), dout.view()); }, str_cat("GDN ", gdn_cp_mode_name(mode)));
  }
  for (DsaSelectMode select : {DsaSelectMode::kRing, DsaSelectMode::kAllGather}) {
    DsaCpConfig cfg;
    cfg.select = select;
    cfg.topk = 6;
    cfg.dim_v = 4;
    DsaCp dsa(groups, layout, cfg);
    expect_nothing_exposed(
        dsa, [&] { return dsa.forward(q.view(), c.view(), qi.view(), ki.view(), wi.view()); },
        [&](CpContext&& ctx) { dsa.backward(std::move(ctx), ddsa.view()); },
        str_cat("DSA ", dsa_select_mode_name(select)));
  }
}

}  // namespace
}  // namespace seqpar
