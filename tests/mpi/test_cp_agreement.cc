// Ranks that disagree on what they pass to a CP layer: every entry point checks, before any data
// moves, that all ranks of its group pass the same shapes, dtypes and configuration, and every rank stops with the
// same message naming the first field that differs and its value on each rank. The disagreeing runs used to end
// with wrong numbers (k, v of another shape but the same byte count) or a crash inside MPI (another seq_len).
// Registered at 2, 3 and 4 ranks; rank 0 (or the last rank) is the odd one out.
#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <vector>

#include "parallel/dsa_cp.h"
#include "parallel/gdn_cp.h"
#include "parallel/layout.h"
#include "parallel/usp.h"
#include "runtime/cp_grid.h"
#include "tests/util/cp_test.h"
#include "tests/util/device_collectives.h"
#include "tests/util/mpi_test.h"
#include "tests/util/test_util.h"

namespace seqpar {
namespace {

using test::error_of;
using test::world;

Tensor rnd(const Shape& s, std::uint64_t seed, DType dtype = DType::kFloat32, double lo = -1, double hi = 1) {
  return test::random_tensor(s, dtype, seed, lo, hi);
}

// Every rank's string, in world rank order (lengths all-reduced, then the characters all-gathered as int32).
std::vector<std::string> gather_strings(const std::string& mine) {
  Communicator& w = world();
  std::int32_t length = static_cast<std::int32_t>(mine.size());
  w.all_reduce(TensorView(&length, DType::kInt32, {1}), ReduceOp::kMax)->wait();
  std::vector<std::int32_t> send(static_cast<std::size_t>(length) + 1, -1), all(send.size() * w.size());
  for (std::size_t i = 0; i < mine.size(); ++i) send[i] = static_cast<unsigned char>(mine[i]);
  w.all_gather(TensorView(send.data(), DType::kInt32, {length + 1}),
               TensorView(all.data(), DType::kInt32, {static_cast<std::int64_t>(all.size())}))
      ->wait();
  std::vector<std::string> out(static_cast<std::size_t>(w.size()));
  for (int r = 0; r < w.size(); ++r) {
    for (std::int32_t i = 0; i <= length && all[r * (length + 1) + i] >= 0; ++i) {
      out[r] += static_cast<char>(all[r * (length + 1) + i]);
    }
  }
  return out;
}

// `fn` fails on every rank with one and the same message, which contains every part of `parts`.
void expect_same_error_everywhere(const std::function<void()>& fn, const std::vector<std::string>& parts) {
  const std::string m = error_of(fn);
  for (const std::string& part : parts) EXPECT_TRUE(test::contains(m, part)) << "missing '" << part << "' in: " << m;
  EXPECT_TRUE(test::contains(m, "Every rank must pass the same shapes, dtypes and configuration")) << m;
  const std::vector<std::string> all = gather_strings(m);
  for (int r = 0; r < world().size(); ++r) EXPECT_EQ(all[r], m) << "rank " << r << " got another message";
}

// "<group> rank 0" / "<group> ranks 1, 2, 3": the ranks [first, last] of a group.
std::string ranks_of(const std::string& group, int first, int last) {
  std::string s = group + (first == last ? " rank " : " ranks ");
  for (int r = first; r <= last; ++r) s += str_cat(r > first ? ", " : "", r);
  return s;
}

bool odd_one() { return world().rank() == 0; }  // the rank that passes something else

struct RingOverWorld {
  CpGrid grid{world(), test::ring_over_world()};
  CpGroups groups = CpGroups::from(grid);
};

// The first case: q [1, 32, 4, 16] everywhere, k and v [1, 32, 2, 32] on rank 0 and [1, 32, 4, 16] on the
// others (the same byte count). p2p and all-gather rings, and USP.
TEST(CpAgreement, KvShapesDiffer) {
  const int n = world().size();
  const Shape mine = odd_one() ? Shape{1, 32, 2, 32} : Shape{1, 32, 4, 16};
  const Tensor q = rnd({1, 32, 4, 16}, 1), kv = rnd(mine, 2);
  const std::vector<std::string> values = {"disagree on k: fp32[1, 32, 2, 32] on " + ranks_of("ring", 0, 0) +
                                           "; fp32[1, 32, 4, 16] on " + ranks_of("ring", 1, n - 1)};
  RingOverWorld w;
  const SequenceLayout layout = SequenceLayout::for_groups(w.groups, 32 * n);
  for (RingImpl impl : {RingImpl::kP2P, RingImpl::kAllGather}) {
    RingAttention attn(w.groups, layout, MhaCpConfig{impl});
    std::vector<std::string> parts = values;
    parts.push_back("ring attention forward: the ranks of the ring group (world ranks 0-");
    expect_same_error_everywhere([&] { attn.forward(q.view(), kv.view(), kv.view()); }, parts);
  }
  const test::SmallCpCase small;  // Ulysses 2 when the world size is even
  const std::int64_t sl = small.sl;
  MhaCp usp(small.groups, small.layout, MhaCpConfig{});
  const Tensor qs = rnd({1, sl, 4, 16}, 3), kvs = rnd(odd_one() ? Shape{1, sl, 2, 32} : Shape{1, sl, 4, 16}, 4);
  expect_same_error_everywhere(
      [&] { usp.forward(qs.view(), kvs.view(), kvs.view()); },
      {"USP forward: the ranks of the cp group",
       str_cat("disagree on k: fp32[1, ", sl, ", 2, 32] on cp rank 0; fp32[1, ", sl, ", 4, 16] on cp rank")});
}

// The second case: rank 0 builds its layout for seq_len 256, the others for 512 (96 and 192 at 3 ranks,
// where 256 is not a zigzag length): every layer kind names seq_len.
TEST(CpAgreement, SeqLenDiffers) {
  const int n = world().size();
  const std::int64_t seq_a = n == 3 ? 96 : 256, seq_b = 2 * seq_a, seq = odd_one() ? seq_a : seq_b;
  const std::string field = str_cat("disagree on seq_len: ", seq_a, " on ", ranks_of("cp", 0, 0), "; ", seq_b, " on ",
                                    ranks_of("cp", 1, n - 1));
  CpGrid grid(world(), test::small_grid_config());
  const CpGroups groups = CpGroups::from(grid);
  const SequenceLayout layout = SequenceLayout::for_groups(groups, seq);
  const std::int64_t sl = layout.local_len(), B = 1, H = 4, D = 16;
  const Tensor q = rnd({B, sl, H, D}, 1), kv = rnd({B, sl, 2, D}, 2);

  MhaCp usp(groups, layout, MhaCpConfig{});
  expect_same_error_everywhere([&] { usp.forward(q.view(), kv.view(), kv.view()); }, {"USP forward", field});

  GdnCpConfig gcfg;
  gcfg.chunk_size = 8;
  GdnCp gdn(groups, layout, gcfg);
  const Tensor g = rnd({B, sl, H}, 3, DType::kFloat32, -0.1, -0.01),
               beta = rnd({B, sl, H}, 4, DType::kFloat32, 0.1, 0.5);
  expect_same_error_everywhere([&] { gdn.forward(q.view(), q.view(), q.view(), g.view(), beta.view()); },
                               {"GDN CP forward", field});

  DsaCpConfig dcfg;
  dcfg.topk = 6;
  dcfg.dim_v = 8;
  DsaCp dsa(groups, layout, dcfg);
  const Tensor c = rnd({B, sl, D}, 5), qi = rnd({B, sl, 2, 8}, 6), ki = rnd({B, sl, 8}, 7), w = rnd({B, sl, 2}, 8);
  expect_same_error_everywhere([&] { dsa.forward(q.view(), c.view(), qi.view(), ki.view(), w.view()); },
                               {"DSA CP forward", field});

  ShortConvCp conv(groups, layout);
  const Tensor wc = rnd({D, 4}, 10);
  expect_same_error_everywhere([&] { conv.forward(c.view(), wc.view()); }, {"short conv CP forward", field});

  RingOverWorld r;
  RingAttention ring(r.groups, SequenceLayout::for_groups(r.groups, seq), MhaCpConfig{});
  const Tensor qr = rnd({B, seq / n, H, D}, 11);
  expect_same_error_everywhere(
      [&] { ring.forward(qr.view(), qr.view(), qr.view()); },
      {"ring attention forward", str_cat("disagree on seq_len: ", seq_a, " on ring rank 0; ", seq_b, " on ring rank")});
}

// A dtype, the mask, the window, the ring implementation, and (the last rank being the odd one) the scale.
TEST(CpAgreement, AttentionConfigurationDiffers) {
  const int n = world().size(), me = world().rank();
  RingOverWorld w;
  const SequenceLayout layout = SequenceLayout::for_groups(w.groups, 16 * n);
  const Tensor q32 = rnd({1, 16, 2, 8}, 1), q64 = rnd({1, 16, 2, 8}, 1, DType::kFloat64);
  const std::string rest = ranks_of("ring", 1, n - 1);
  {
    RingAttention attn(w.groups, layout, MhaCpConfig{});
    const TensorView q = odd_one() ? q64.view() : q32.view();
    expect_same_error_everywhere([&] { attn.forward(q, q, q); },
                                 {"disagree on q: fp64[1, 16, 2, 8] on ring rank 0; fp32[1, 16, 2, 8] on " + rest});
  }
  MhaCpConfig cfg;
  cfg.causal = !odd_one();
  expect_same_error_everywhere(
      [&] { RingAttention(w.groups, layout, cfg).forward(q32.view(), q32.view(), q32.view()); },
      {"disagree on causal: no on ring rank 0; yes on " + rest});
  cfg = {};
  cfg.window = odd_one() ? 4 : 0;
  expect_same_error_everywhere(
      [&] { RingAttention(w.groups, layout, cfg).forward(q32.view(), q32.view(), q32.view()); },
      {"disagree on window: 4 on ring rank 0; 0 on " + rest});
  cfg = {};
  cfg.impl = odd_one() ? RingImpl::kAllGather : RingImpl::kP2P;
  expect_same_error_everywhere(
      [&] { RingAttention(w.groups, layout, cfg).forward(q32.view(), q32.view(), q32.view()); },
      {"disagree on impl: allgather on ring rank 0; p2p on " + rest});
  cfg = {};
  cfg.scale = me == n - 1 ? 0.5f : 0.25f;
  expect_same_error_everywhere(
      [&] { RingAttention(w.groups, layout, cfg).forward(q32.view(), q32.view(), q32.view()); },
      {"disagree on scale: 0.25 on " + ranks_of("ring", 0, n - 2) + "; 0.5 on ring rank " + std::to_string(n - 1)});
}

// GDN's chunk size and mode, DSA's top-k, the short conv's width.
TEST(CpAgreement, LayerConfigurationDiffers) {
  const int n = world().size();
  const test::SmallCpCase small;
  const CpGroups& groups = small.groups;
  const std::int64_t B = small.B, H = small.H, D = small.D, sl = small.sl;
  const std::string rest = ranks_of("cp", 1, n - 1);
  const Tensor q = rnd({B, sl, H, D}, 1), g = rnd({B, sl, H}, 3, DType::kFloat32, -0.1, -0.01),
               beta = rnd({B, sl, H}, 4, DType::kFloat32, 0.1, 0.5);
  auto gdn_forward = [&](const GdnCpConfig& cfg) {
    GdnCp(groups, small.layout, cfg).forward(q.view(), q.view(), q.view(), g.view(), beta.view());
  };
  GdnCpConfig gcfg;
  gcfg.chunk_size = odd_one() ? 8 : 16;
  expect_same_error_everywhere([&] { gdn_forward(gcfg); },
                               {"GDN CP forward", "disagree on chunk_size: 8 on cp rank 0; 16 on " + rest});
  gcfg = {};
  gcfg.mode = odd_one() ? GdnCpMode::kChain : GdnCpMode::kScan;
  expect_same_error_everywhere([&] { gdn_forward(gcfg); }, {"disagree on mode: chain on cp rank 0; scan on " + rest});
  // initial_state given on one rank only.
  const Tensor init = rnd({B, H, D, D}, 9);
  GdnCp gdn(groups, small.layout, GdnCpConfig{});
  expect_same_error_everywhere(
      [&] { gdn.forward(q.view(), q.view(), q.view(), g.view(), beta.view(), odd_one() ? init.view() : TensorView()); },
      {"disagree on initial_state: fp32[1, 4, 16, 16] on cp rank 0; none on " + rest});

  DsaCpConfig dcfg;
  dcfg.topk = odd_one() ? 6 : 8;
  dcfg.dim_v = 8;
  const Tensor c = rnd({B, sl, D}, 5), qi = rnd({B, sl, 2, 8}, 6), ki = rnd({B, sl, 8}, 7), w = rnd({B, sl, 2}, 8);
  expect_same_error_everywhere(
      [&] {
        DsaCp(groups, small.layout, dcfg).forward(q.view(), c.view(), qi.view(), ki.view(), w.view());
      },
      {"DSA CP forward", "disagree on topk: 6 on cp rank 0; 8 on " + rest});

  const Tensor wc = rnd({D, odd_one() ? 3 : 4}, 10);
  ShortConvCp conv(groups, small.layout);
  expect_same_error_everywhere(
      [&] { conv.forward(c.view(), wc.view()); },
      {"short conv CP forward", "disagree on weight: fp32[16, 3] on cp rank 0; fp32[16, 4] on " + rest});
}

// Backwards: the forward agreed, then dout (or GDN's dfinal_state) differs.
TEST(CpAgreement, BackwardInputsDiffer) {
  const int n = world().size();
  const test::SmallCpCase small;
  const std::int64_t B = small.B, H = small.H, D = small.D, sl = small.sl;
  const std::string rest = ranks_of("cp", 1, n - 1);
  const Tensor q = rnd({B, sl, H, D}, 1), dout32 = rnd({B, sl, H, D}, 2),
               dout64 = rnd({B, sl, H, D}, 2, DType::kFloat64);
  const TensorView dout = odd_one() ? dout64.view() : dout32.view();
  MhaCp usp(small.groups, small.layout, MhaCpConfig{});
  MhaCpOutput o = usp.forward(q.view(), q.view(), q.view());
  expect_same_error_everywhere(
      [&] { usp.backward(std::move(o.ctx), dout); },
      {"USP backward", str_cat("disagree on dout: fp64[1, ", sl, ", 4, 16] on cp rank 0; fp32")});
  EXPECT_TRUE(o.ctx.live());  // refused before the context was used: a corrected call goes through
  usp.backward(std::move(o.ctx), dout32.view());

  RingOverWorld w;
  RingAttention ring(w.groups, SequenceLayout::for_groups(w.groups, 16 * n), MhaCpConfig{});
  const Tensor qr = rnd({1, 16, 2, 8}, 3), dr = rnd({1, 16, 2, 8}, 4, odd_one() ? DType::kFloat64 : DType::kFloat32);
  MhaCpOutput r = ring.forward(qr.view(), qr.view(), qr.view());
  expect_same_error_everywhere([&] { ring.backward(std::move(r.ctx), dr.view()); },
                               {"ring attention backward", "disagree on dout: fp64[1, 16, 2, 8] on ring rank 0"});

  const Tensor g = rnd({B, sl, H}, 3, DType::kFloat32, -0.1, -0.01),
               beta = rnd({B, sl, H}, 4, DType::kFloat32, 0.1, 0.5);
  GdnCp gdn(small.groups, small.layout, GdnCpConfig{});
  GdnCpOutput go = gdn.forward(q.view(), q.view(), q.view(), g.view(), beta.view());
  const Tensor dfinal = rnd({B, H, D, D}, 5);
  expect_same_error_everywhere(
      [&] { gdn.backward(std::move(go.ctx), dout32.view(), odd_one() ? dfinal.view() : TensorView()); },
      {"GDN CP backward", "disagree on dfinal_state: fp32[1, 4, 16, 16] on cp rank 0; none on " + rest});

  DsaCpConfig dcfg;
  dcfg.topk = 6;
  dcfg.dim_v = 8;
  DsaCp dsa(small.groups, small.layout, dcfg);
  const Tensor c = rnd({B, sl, D}, 5), qi = rnd({B, sl, 2, 8}, 6), ki = rnd({B, sl, 8}, 7), wi = rnd({B, sl, 2}, 8),
               ddsa = rnd({B, sl, H, 8}, 9);
  DsaCpOutput dsa_out = dsa.forward(q.view(), c.view(), qi.view(), ki.view(), wi.view());
  expect_same_error_everywhere([&] { dsa.backward(std::move(dsa_out.ctx), ddsa.view(), odd_one() ? 2.0f : 1.0f); },
                               {"DSA CP backward", "disagree on loss_grad_scale: 2 on cp rank 0; 1 on " + rest});
}

// The call itself differs: one rank calls with more fields (a helper-level check of the message).
TEST(CpAgreement, DifferentFieldListsAreNamed) {
  const int n = world().size();
  Fingerprint fp("test call");
  fp.add_int("a", 1);
  if (odd_one()) fp.add_int("b", 2);
  AgreementCheck check(AgreementMode::kChanges);
  expect_same_error_everywhere([&] { check.run(world(), fp); },
                               {"test call: the ranks of the world group", "disagree on b: 2 on world rank 0; ",
                                "(no such field) on " + ranks_of("world", 1, n - 1)});
}

// The sequence collectives (scatter_sequence, gather_sequence, gather_sequence_to_root) check the same way: pieces
// of the same byte count but another dtype or trailing shape, other byte counts, and a root `full` of another
// dtype all stop every rank with one message (they used to gather garbage silently or abort inside the transport).
TEST(CpAgreement, SequenceCollectivesDiffer) {
  const int n = world().size();
  const SequenceLayout layout(LayoutKind::kZigzag, 8 * n, n, 1);
  const std::int64_t L = layout.local_len(), T = layout.seq_len();
  const std::string lw = str_cat("[1, ", L, ", 4]"), lh = str_cat("[1, ", L, ", 2]"), l3 = str_cat("[1, ", L, ", 3]");
  // Same bytes, other dtype and trailing shape.
  const Tensor a = odd_one() ? rnd({1, L, 4}, 3) : rnd({1, L, 2}, 3, DType::kFloat64);
  const Tensor full_a = Tensor::zeros({1, T, a.view().dim(2)}, a.view().dtype());
  expect_same_error_everywhere([&] { gather_sequence(world(), layout, a.view(), full_a.view()); },
                               {"gather_sequence: the ranks of the world group",
                                "disagree on local: fp32" + lw + " on world rank 0; fp64" + lh + " on world rank"});
  expect_same_error_everywhere([&] { gather_sequence_to_root(world(), layout, a.view(), full_a.view()); },
                               {"gather_sequence_to_root:", "disagree on local: fp32" + lw + " on world rank 0"});
  // Other byte counts.
  const Tensor b = rnd({1, L, odd_one() ? 3 : 4}, 4);
  const Tensor full_b = Tensor::zeros({1, T, b.view().dim(2)}, DType::kFloat32);
  expect_same_error_everywhere([&] { gather_sequence(world(), layout, b.view(), full_b.view()); },
                               {"disagree on local: fp32" + l3 + " on world rank 0; fp32" + lw});
  // scatter: every rank's local of another dtype, or root's full not matching root's local.
  const Tensor full_root = rnd({1, T, 4}, 5, DType::kFloat64);
  const Tensor local_c = Tensor::zeros({1, L, 4}, odd_one() ? DType::kFloat32 : DType::kFloat64);
  expect_same_error_everywhere([&] { scatter_sequence(world(), layout, full_root.view(), local_c.view()); },
                               {"scatter_sequence:", "disagree on local: fp32" + lw + " on world rank 0"});
  const Tensor local_d = Tensor::zeros({1, L, 4}, DType::kFloat32);
  expect_same_error_everywhere(
      [&] { scatter_sequence(world(), layout, full_root.view(), local_d.view()); },
      {"disagree on root's full: fp64[1, " + std::to_string(T) + ", 4]", str_cat("expected fp32[1, ", T, ", 4]")});
  // The agreeing call still moves the data.
  scatter_sequence(world(), layout, rnd({1, T, 4}, 6).view(), local_d.view());
  EXPECT_TRUE(test::all_ranks(world(), !HasFailure()));
}

// Ranks that agree run, and the check's collective runs once per configuration (mode `changes`, the default): a
// repeated call sends nothing for the check, a new shape checks again, and going back to the first shape too (the
// cache holds the last agreed call only). With SEQPAR_AGREEMENT_CHECK=always every call checks.
TEST(CpAgreement, AgreeingRanksRunAndTheCheckIsCached) {
  const test::SmallCpCase small;
  const std::int64_t B = small.B, H = small.H, D = small.D, sl = small.sl;
  MhaCp usp(small.groups, small.layout, MhaCpConfig{});
  const bool always = usp.forward_agreement().mode() == AgreementMode::kAlways;
  ASSERT_NE(usp.forward_agreement().mode(), AgreementMode::kOff) << "this test needs the check on";
  Communicator& sp = small.groups.cp;  // used by USP only for the check (Ulysses and ring have their own groups)
  const Tensor q1 = rnd({B, sl, H, D}, 1), q2 = rnd({2 * B, sl, H, D}, 2);
  std::int64_t expected_checks = 0, ops = sp.counters().num_ops;
  auto call = [&](const Tensor& q, bool new_configuration) {
    MhaCpOutput o = usp.forward(q.view(), q.view(), q.view());
    if (new_configuration || always) ++expected_checks;
    EXPECT_EQ(usp.forward_agreement().num_checks(), expected_checks);
    EXPECT_EQ(sp.counters().num_ops - ops, new_configuration || always ? 1 : 0);
    ops = sp.counters().num_ops;
    return o;
  };
  MhaCpOutput first = call(q1, true);
  MhaCpOutput again = call(q1, false);
  EXPECT_EQ(test::to_double(first.out.view()), test::to_double(again.out.view()));
  call(q2, true);   // a new shape: checked
  call(q2, false);  // repeated: cached
  call(q1, true);   // back to the first shape: checked again
  EXPECT_EQ(usp.forward_agreement().num_checks() + usp.forward_agreement().num_skipped(), 5);
  EXPECT_TRUE(test::all_ranks(world(), !HasFailure()));
}

}  // namespace
}  // namespace seqpar
