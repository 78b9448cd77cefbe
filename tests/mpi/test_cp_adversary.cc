// Misuse of the CP layers' contexts that a caller can make by mistake: a refused backward (wrong dout shape or
// dtype) leaves the context live, so that a corrected call succeeds, and frees nothing; for every layer kind.
#include <gtest/gtest.h>

#include <functional>

#include "parallel/dsa_cp.h"
#include "parallel/gdn_cp.h"
#include "parallel/usp.h"
#include "runtime/cp_grid.h"
#include "tests/util/cp_test.h"
#include "tests/util/device_collectives.h"
#include "tests/util/mpi_test.h"
#include "tests/util/test_util.h"

namespace seqpar {
namespace {

using test::error_of;
using test::saved_bytes;
using test::world;

Tensor rnd(const Shape& s, std::uint64_t seed, DType dtype = DType::kFloat32, double lo = -1, double hi = 1) {
  return test::random_tensor(s, dtype, seed, lo, hi);
}

// One layer kind: a forward, and a backward given dout (of the right shape) in a dtype.
struct Kind {
  std::string name;
  Shape dout_shape;
  std::function<CpContext()> forward;
  std::function<void(CpContext&&, const TensorView&)> backward;
};

// Every refused backward leaves the context live and the saved activations in place; the corrected call then
// consumes it and the ledger returns to its start.
void expect_refusals_keep_the_context(const Kind& kind) {
  const std::int64_t base = saved_bytes();
  CpContext ctx = kind.forward();
  const std::int64_t one = saved_bytes() - base;
  ASSERT_GT(one, 0) << kind.name;
  Shape wrong = kind.dout_shape;
  wrong[1] += 1;
  const Tensor bad_shape = rnd(wrong, 20);
  const Tensor bad_dtype = Tensor::zeros(kind.dout_shape, DType::kInt32, MemCategory::kWorkspace);
  const Tensor bad_rank = rnd({kind.dout_shape[0], kind.dout_shape[1]}, 21);
  for (const auto& [what, dout] : {std::pair<const char*, const Tensor*>{"a wrong shape", &bad_shape},
                                   {"an int32 dtype", &bad_dtype},
                                   {"a 2-d shape", &bad_rank}}) {
    const std::string m = error_of([&] { kind.backward(std::move(ctx), dout->view()); });
    EXPECT_NE(m, "<no error>") << kind.name << ": dout with " << what << " was accepted";
    EXPECT_TRUE(ctx.live()) << kind.name << ": dout with " << what << " consumed the context (" << m << ")";
    EXPECT_EQ(saved_bytes() - base, one) << kind.name << ": dout with " << what;
  }
  const Tensor dout = rnd(kind.dout_shape, 22);
  kind.backward(std::move(ctx), dout.view());
  EXPECT_FALSE(ctx.live()) << kind.name;
  EXPECT_EQ(saved_bytes(), base) << kind.name;
  EXPECT_TRUE(test::all_ranks(world(), true));
}

TEST(CpAdversary, RefusedBackwardKeepsTheContext) {
  const test::SmallCpCase small;
  const CpGroups& groups = small.groups;
  const SequenceLayout& layout = small.layout;
  const std::int64_t B = small.B, H = small.H, D = small.D, sl = small.sl;

  MhaCp usp(groups, layout, MhaCpConfig{});
  Tensor q = rnd({B, sl, H, D}, 1), kv = rnd({B, sl, 2, D}, 2);
  expect_refusals_keep_the_context({"USP",
                                    {B, sl, H, D},
                                    [&] { return usp.forward(q.view(), kv.view(), kv.view()).ctx; },
                                    [&](CpContext&& c, const TensorView& d) { usp.backward(std::move(c), d); }});

  if (groups.ulysses_size() == 1) {
    RingAttention ring(groups, layout, MhaCpConfig{});
    expect_refusals_keep_the_context({"ring",
                                      {B, sl, H, D},
                                      [&] { return ring.forward(q.view(), kv.view(), kv.view()).ctx; },
                                      [&](CpContext&& c, const TensorView& d) { ring.backward(std::move(c), d); }});
  }

  GdnCpConfig gcfg;
  gcfg.chunk_size = 8;
  GdnCp gdn(groups, layout, gcfg);
  Tensor g = rnd({B, sl, H}, 3, DType::kFloat32, -0.1, -0.01), beta = rnd({B, sl, H}, 4, DType::kFloat32, 0.1, 0.5);
  expect_refusals_keep_the_context(
      {"GDN",
       {B, sl, H, D},
       [&] { return gdn.forward(q.view(), q.view(), q.view(), g.view(), beta.view()).ctx; },
       [&](CpContext&& c, const TensorView& d) { gdn.backward(std::move(c), d); }});

  DsaCpConfig dcfg;
  dcfg.topk = 6;
  dcfg.dim_v = 8;
  DsaCp dsa(groups, layout, dcfg);
  Tensor c = rnd({B, sl, D}, 5), qi = rnd({B, sl, 2, 8}, 6), ki = rnd({B, sl, 8}, 7), w = rnd({B, sl, 2}, 8);
  expect_refusals_keep_the_context({"DSA",
                                    {B, sl, H, 8},
                                    [&] { return dsa.forward(q.view(), c.view(), qi.view(), ki.view(), w.view()).ctx; },
                                    [&](CpContext&& ctx, const TensorView& d) { dsa.backward(std::move(ctx), d); }});

  ShortConvCp conv(groups, layout);
  Tensor wc = rnd({D, 4}, 10), dw = rnd({D, 4}, 11);
  expect_refusals_keep_the_context(
      {"short conv",
       {B, sl, D},
       [&] { return conv.forward(c.view(), wc.view()).ctx; },
       [&](CpContext&& ctx, const TensorView& d) { conv.backward(std::move(ctx), d, dw.view()); }});
  // An integer dweight, and a dout in another dtype than x (the conv kernel's rule), are refused before the context
  // is used.
  const std::int64_t base = saved_bytes();
  CpContext ctx = conv.forward(c.view(), wc.view()).ctx;
  const Tensor dw32i = Tensor::zeros({D, 4}, DType::kInt32, MemCategory::kWorkspace);
  EXPECT_NE(error_of([&] { conv.backward(std::move(ctx), c.view(), dw32i.view()); }), "<no error>");
  EXPECT_TRUE(ctx.live());
  const Tensor c64 = rnd({B, sl, D}, 13, DType::kFloat64);
  EXPECT_NE(error_of([&] { conv.backward(std::move(ctx), c64.view(), dw.view()); }), "<no error>");
  EXPECT_TRUE(ctx.live());
  conv.backward(std::move(ctx), c.view(), dw.view());
  EXPECT_EQ(saved_bytes(), base);
}

// RingAttention::backward_into (the entry point USP composes) refuses gradient buffers of a non-floating dtype
// before it consumes the context.
TEST(CpAdversary, BackwardIntoRefusesIntegerGradientBuffers) {
  const int n = world().size();
  const std::unique_ptr<Communicator> self = world().split(world().rank(), 0);
  const CpGroups groups(*self, world(), world());
  const SequenceLayout layout = SequenceLayout::for_groups(groups, 16 * n);
  RingAttention attn(groups, layout, MhaCpConfig{});
  const std::int64_t sl = layout.local_len();
  const Tensor q = rnd({1, sl, 2, 8}, 1), kv = rnd({1, sl, 2, 8}, 2);
  Tensor dq = rnd({1, sl, 2, 8}, 3), dk = rnd({1, sl, 2, 8}, 4), dv = rnd({1, sl, 2, 8}, 5);
  const Tensor bad = Tensor::zeros({1, sl, 2, 8}, DType::kInt32, MemCategory::kWorkspace);
  MhaCpOutput o = attn.forward(q.view(), kv.view(), kv.view());
  for (int which = 0; which < 3; ++which) {
    const std::string m = error_of([&] {
      attn.backward_into(std::move(o.ctx), q.view(), which == 0 ? bad.view() : dq.view(),
                         which == 1 ? bad.view() : dk.view(), which == 2 ? bad.view() : dv.view());
    });
    EXPECT_NE(m, "<no error>") << "an int32 gradient buffer " << which << " was accepted";
    EXPECT_TRUE(o.ctx.live()) << "gradient buffer " << which << ": " << m;
  }
  attn.backward_into(std::move(o.ctx), q.view(), dq.view(), dk.view(), dv.view());
  EXPECT_TRUE(test::all_ranks(world(), true));
}

// A communicator over `inner` whose fail_at-th operation (counted from 1 after arm()) throws before anything is
// posted, on every rank alike: an exception in the middle of a forward or backward.
class FailingComm final : public Communicator {
 public:
  explicit FailingComm(std::unique_ptr<Communicator> inner) : inner_(std::move(inner)) {
    set_group(inner_->rank(), inner_->size(), inner_->world_ranks());
    set_name("ring");
  }
  const char* backend_name() const override { return "failing"; }
  void arm(long long fail_at) {
    calls_ = 0;
    fail_at_ = fail_at;
  }
  long long calls() const { return calls_; }

 protected:
  void check_buffer(const TensorView&, const std::string&) const override {}
  WorkHandle do_isend(const TensorView& b, int peer, int tag, std::string) override {
    tick();
    return inner_->isend(b, peer, tag);
  }
  WorkHandle do_irecv(const TensorView& b, int peer, int tag, std::string) override {
    tick();
    return inner_->irecv(b, peer, tag);
  }
  WorkHandle do_batch_isend_irecv(const std::vector<P2POp>& ops, std::string) override {
    tick();
    return inner_->batch_isend_irecv(ops);
  }
  WorkHandle do_all_to_all(const TensorView& s, const TensorView& r, std::string) override {
    tick();
    return inner_->all_to_all(s, r);
  }
  WorkHandle do_all_gather(const TensorView& s, const TensorView& r, std::string) override {
    tick();
    return inner_->all_gather(s, r);
  }
  WorkHandle do_reduce_scatter(const TensorView& s, const TensorView& r, ReduceOp op, std::string) override {
    tick();
    return inner_->reduce_scatter(s, r, op);
  }
  WorkHandle do_all_reduce(const TensorView& b, ReduceOp op, std::string) override {
    tick();
    return inner_->all_reduce(b, op);
  }
  WorkHandle do_broadcast(const TensorView& b, int root, std::string) override {
    tick();
    return inner_->broadcast(b, root);
  }
  WorkHandle do_barrier(std::string) override {
    tick();
    return inner_->barrier();
  }

 private:
  void tick() {
    if (++calls_ == fail_at_) SEQPAR_THROW("test: communication call ", calls_, " fails");
  }
  std::unique_ptr<Communicator> inner_;
  long long calls_ = 0, fail_at_ = 0;
};

std::int64_t ledger_bytes(MemCategory c) { return memory_ledger().snapshot().current[static_cast<int>(c)]; }

// An exception at any communication call of a backward: the context is consumed (not reusable: its saved state was
// handed to the failed call) and the saved activations, workspaces and communication buffers are released.
TEST(CpAdversary, ExceptionInTheMiddleOfBackwardReleasesEverything) {
  const int n = world().size();
  if (n == 1) GTEST_SKIP() << "a ring of one rank does not communicate";
  const std::int64_t seq = 16 * n, B = 1, H = 2, D = 8;
  for (RingImpl impl : {RingImpl::kP2P, RingImpl::kAllGather}) {
    long long total = -1;  // communication calls of one clean backward
    for (long long fail_at = 0; total < 0 || fail_at <= total; ++fail_at) {
      // A fresh communicator each time: a failed exchange leaves unmatched messages behind.
      FailingComm ring(world().split(0, world().rank()));
      const std::unique_ptr<Communicator> self = world().split(world().rank(), 0);
      const CpGroups groups(*self, ring, ring);
      const SequenceLayout layout = SequenceLayout::for_groups(groups, seq);
      RingAttention attn(groups, layout, MhaCpConfig{impl});
      const std::int64_t sl = layout.local_len();
      const Tensor q = rnd({B, sl, H, D}, 1), kv = rnd({B, sl, H, D}, 2);
      const std::int64_t saved0 = ledger_bytes(MemCategory::kSavedActivation),
                         work0 = ledger_bytes(MemCategory::kWorkspace), comm0 = ledger_bytes(MemCategory::kCommBuffer);
      {
        MhaCpOutput o = attn.forward(q.view(), kv.view(), kv.view());
        ring.arm(fail_at);
        const std::string m = error_of([&] { attn.backward(std::move(o.ctx), q.view()); });
        if (fail_at == 0) {
          ASSERT_EQ(m, "<no error>");
          total = ring.calls();
          ASSERT_GT(total, 0);
          continue;
        }
        EXPECT_NE(m.find("test: communication call"), std::string::npos) << ring_impl_name(impl) << ": " << m;
        // The first call of a backward is the ranks' agreement check (parallel/cp_common.h), made before the
        // context is used: failing there leaves it live, like any refused call.
        const bool in_check = fail_at <= attn.backward_agreement().num_checks();
        EXPECT_EQ(o.ctx.live(), in_check) << ring_impl_name(impl) << " failing at call " << fail_at;
        if (!in_check) {
          EXPECT_EQ(ledger_bytes(MemCategory::kSavedActivation), saved0)
              << ring_impl_name(impl) << " failing at call " << fail_at << " of " << total;
        }
      }
      EXPECT_EQ(ledger_bytes(MemCategory::kWorkspace), work0) << ring_impl_name(impl) << " at call " << fail_at;
      EXPECT_EQ(ledger_bytes(MemCategory::kCommBuffer), comm0) << ring_impl_name(impl) << " at call " << fail_at;
    }
  }
  EXPECT_TRUE(test::all_ranks(world(), true));
}

// The layers place tokens by CpGroups::cp_rank() and address SP peers by sp.rank(): an CP group in another rank
// order (here reversed) is refused where the two differ, instead of mixing tokens silently.
TEST(CpAdversary, SpGroupInAnotherOrderIsRefused) {
  const std::unique_ptr<Communicator> self = world().split(world().rank(), 0);
  const std::unique_ptr<Communicator> reversed = world().split(0, world().size() - 1 - world().rank());
  const std::string m = error_of([&] { CpGroups(*self, world(), *reversed); });
  if (reversed->rank() == world().rank()) {
    EXPECT_EQ(m, "<no error>");
  } else {
    EXPECT_NE(
        m.find(str_cat("CpGroups: this rank is split rank ", reversed->rank(), ", but ring rank ", world().rank())),
        std::string::npos)
        << m;
  }
  EXPECT_EQ(error_of([&] { CpGroups(*self, world(), world()); }), "<no error>");
}

}  // namespace
}  // namespace seqpar
