// GDN and its short conv under context parallelism against the fp64 token-by-token recurrence (and the direct
// fp64 conv) on the whole sequence: every rank checks every output and gradient of every head.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "attention/reference/gdn_reference.h"
#include "parallel/gdn_cp.h"
#include "runtime/cp_grid.h"
#include "tests/util/mpi_test.h"
#include "tests/util/test_util.h"

namespace seqpar {
namespace {

using test::all_close;
using test::to_double;
using test::world;

constexpr std::int64_t kB = 2, kH = 4, kK = 16, kV = 8;  // kH value heads

struct GdnCase {
  GdnCpMode mode;
  LayoutKind layout;
  int ulysses_size = 1;
  bool initial_state = true;
  bool l2norm = true;
  std::int64_t seq = 96;
  std::int64_t key_heads = kH;  // Hk: kH / key_heads value heads share each q, k head
  DType dtype = DType::kFloat32;
  bool large = false;  // values up to 1e4 (v, initial_state), 1e3 (q, k before the L2 norm, dout)
};

std::string case_name(const GdnCase& c) {
  return str_cat(gdn_cp_mode_name(c.mode), "_", layout_name(c.layout), "_u", c.ulysses_size,
                 c.initial_state ? "_init" : "_noinit", c.l2norm ? "_l2" : "_nol2", "_S", c.seq, "_Hv", kH, "_Hk",
                 c.key_heads, "_", dtype_name(c.dtype), c.large ? "_large" : "");
}
void PrintTo(const GdnCase& c, std::ostream* os) { *os << case_name(c); }

struct GdnProblem {
  Tensor q, k, v, g, beta, init, dout, dfinal;  // full, in the case's dtype (init, dfinal: its state dtype)
  explicit GdnProblem(const GdnCase& c) {
    const DType t = c.dtype;
    const std::int64_t seq = c.seq, hk = c.key_heads;
    auto make = [t](const Shape& s, std::uint64_t seed, double lo, double hi) {
      return test::random_tensor(s, t, seed, lo, hi);
    };
    // Without the L2 norm, keys of norm <= 1 keep (I - beta k k^T) a contraction.
    const double kscale = c.l2norm ? 1.0 : 1.0 / std::sqrt(static_cast<double>(kK));
    const double qk = c.large && c.l2norm ? 1e3 : 1.0, big = c.large ? 1e4 : 1.0, dbig = c.large ? 1e3 : 1.0;
    q = make({kB, seq, hk, kK}, 101, -qk, qk);
    k = make({kB, seq, hk, kK}, 102, -kscale * qk, kscale * qk);
    v = make({kB, seq, kH, kV}, 103, -big, big);
    g = make({kB, seq, kH}, 104, -0.1, -0.001);  // weak decay: states carry across segments
    beta = make({kB, seq, kH}, 105, 0.05, 0.5);
    init = make({kB, kH, kK, kV}, 106, -0.5 * big, 0.5 * big);
    dout = make({kB, seq, kH, kV}, 107, -dbig, dbig);
    dfinal = make({kB, kH, kK, kV}, 108, -dbig, dbig);
  }
};

// fp32: the chunked kernels against the fp64 recurrence, rounding of O(S) fp32 steps with O(1) values.
// fp64: everything runs in fp64, so every tensor agrees with the recurrence to 1e-10 of its largest value.
::testing::AssertionResult close_to(const std::vector<double>& got, const Tensor& want, const GdnCase& c,
                                    const std::string& what) {
  const std::vector<double> w = to_double(want);
  if (c.dtype != DType::kFloat64) return all_close(got, w, 2e-4, 2e-3, what);
  double scale = 0;
  for (double x : w) scale = std::max(scale, std::abs(x));
  return all_close(got, w, 1e-10 * scale, 0, what + " (fp64: 1e-10 of max |ref| " + std::to_string(scale) + ")");
}

Tensor f64(const Tensor& t) { return Tensor::copy_of(t.view(), DType::kFloat64, MemCategory::kWorkspace); }

TensorView shard(const Tensor& full, const std::vector<std::int64_t>& pos, std::vector<Tensor>& keep) {
  Shape s = full.shape();
  s[1] = static_cast<std::int64_t>(pos.size());
  keep.push_back(Tensor::empty(s, full.dtype(), MemCategory::kWorkspace));
  shard_sequence(full.view(), pos, keep.back().view());
  return keep.back().view();
}

std::vector<double> gather(Communicator& sp, const SequenceLayout& layout, const Tensor& local, Shape full_shape) {
  Tensor full = Tensor::empty(full_shape, local.dtype(), MemCategory::kWorkspace);
  gather_sequence(sp, layout, local.view(), full.view());
  return to_double(full);
}

class GdnCpVsRecurrence : public ::testing::TestWithParam<GdnCase> {};

TEST_P(GdnCpVsRecurrence, MatchesFp64Recurrence) {
  const GdnCase c = GetParam();
  CpGrid grid(world(), test::ulysses_over_world(c.ulysses_size));
  const GdnProblem p(c);

  // fp64 reference of the whole sequence.
  Tensor q64 = f64(p.q), k64 = f64(p.k), v64 = f64(p.v), g64 = f64(p.g), b64 = f64(p.beta), i64 = f64(p.init),
         do64 = f64(p.dout), df64 = f64(p.dfinal);
  attn::GdnForwardArgs ra;
  ra.q = q64.view();
  ra.k = k64.view();
  ra.v = v64.view();
  ra.g = g64.view();
  ra.beta = b64.view();
  ra.initial_state = c.initial_state ? i64.view() : TensorView();
  ra.use_qk_l2norm = c.l2norm;
  Tensor ro = Tensor::empty({kB, c.seq, kH, kV}, DType::kFloat64, MemCategory::kWorkspace);
  Tensor rf = Tensor::empty({kB, kH, kK, kV}, DType::kFloat64, MemCategory::kWorkspace);
  attn::reference::gdn_forward(ra, ro.view(), rf.view());
  attn::GdnBackwardArgs rb;
  rb.fwd = ra;
  rb.dout = do64.view();
  rb.dfinal_state = df64.view();
  Tensor rdq = Tensor::empty(q64.shape(), DType::kFloat64, MemCategory::kWorkspace);
  Tensor rdk = Tensor::empty(k64.shape(), DType::kFloat64, MemCategory::kWorkspace);
  Tensor rdv = Tensor::empty(v64.shape(), DType::kFloat64, MemCategory::kWorkspace);
  Tensor rdg = Tensor::empty(g64.shape(), DType::kFloat64, MemCategory::kWorkspace);
  Tensor rdb = Tensor::empty(b64.shape(), DType::kFloat64, MemCategory::kWorkspace);
  Tensor rdi = Tensor::empty(i64.shape(), DType::kFloat64, MemCategory::kWorkspace);
  attn::reference::gdn_backward(rb, rdq.view(), rdk.view(), rdv.view(), rdg.view(), rdb.view(), rdi.view());

  GdnCpConfig cfg;
  cfg.mode = c.mode;
  cfg.use_qk_l2norm = c.l2norm;
  cfg.chunk_size = 16;  // several chunks per segment at small ranks, partial chunks at large ones
  const CpGroups groups = CpGroups::from(grid);
  GdnCp gdn(groups, SequenceLayout::for_groups(groups, c.seq, c.layout), cfg);
  std::vector<Tensor> keep;
  const auto& pos = gdn.positions();
  GdnCpOutput o =
      gdn.forward(shard(p.q, pos, keep), shard(p.k, pos, keep), shard(p.v, pos, keep), shard(p.g, pos, keep),
                  shard(p.beta, pos, keep), c.initial_state ? p.init.view() : TensorView());
  Tensor dout_local =
      Tensor::empty({kB, static_cast<std::int64_t>(pos.size()), kH, kV}, c.dtype, MemCategory::kWorkspace);
  shard_sequence(p.dout.view(), pos, dout_local.view());
  GdnCpGrads gr = gdn.backward(std::move(o.ctx), dout_local.view(), p.dfinal.view());

  const std::string name = str_cat(case_name(c), " on ", grid.str());
  Communicator& sp = grid.cp();
  EXPECT_TRUE(close_to(gather(sp, gdn.layout(), o.out, {kB, c.seq, kH, kV}), ro, c, name + " out"));
  EXPECT_TRUE(close_to(to_double(o.final_state), rf, c, name + " final_state"));
  EXPECT_TRUE(close_to(gather(sp, gdn.layout(), gr.dq, q64.shape()), rdq, c, name + " dq"));
  EXPECT_TRUE(close_to(gather(sp, gdn.layout(), gr.dk, k64.shape()), rdk, c, name + " dk"));
  EXPECT_TRUE(close_to(gather(sp, gdn.layout(), gr.dv, v64.shape()), rdv, c, name + " dv"));
  EXPECT_TRUE(close_to(gather(sp, gdn.layout(), gr.dg, g64.shape()), rdg, c, name + " dg"));
  EXPECT_TRUE(close_to(gather(sp, gdn.layout(), gr.dbeta, b64.shape()), rdb, c, name + " dbeta"));
  EXPECT_TRUE(close_to(to_double(gr.dinitial_state), rdi, c, name + " dinitial_state"));
  EXPECT_EQ(gr.dq.dtype(), c.dtype) << name;
  EXPECT_EQ(gr.dinitial_state.dtype(), accumulator_dtype(c.dtype)) << name;

  // Message rounds: chain is sequential over the N segments, scan is logarithmic.
  const std::int64_t segments = static_cast<std::int64_t>(segments_in_global_order([&] {
                                                            std::vector<std::vector<std::int64_t>> per_rank;
                                                            for (int r = 0; r < grid.ring().size(); ++r)
                                                              per_rank.push_back(gdn.layout().ring_shard_positions(r));
                                                            return per_rank;
                                                          }())
                                                              .size());
  std::int64_t log_rounds = 0;
  while ((std::int64_t{1} << log_rounds) < segments) ++log_rounds;
  const std::int64_t want =
      c.mode == GdnCpMode::kChain ? 2 * (segments - 1) : 2 * (log_rounds + (segments > 1 ? 1 : 0));
  EXPECT_EQ(gdn.counters().message_rounds, want) << name;
}

std::vector<GdnCase> gdn_cases() {
  const int n = world().size();
  std::vector<GdnCase> cases;
  for (GdnCpMode mode : {GdnCpMode::kChain, GdnCpMode::kScan}) {
    for (LayoutKind layout : {LayoutKind::kContiguous, LayoutKind::kZigzag}) {
      cases.push_back({mode, layout});
    }
    cases.push_back({mode, LayoutKind::kZigzag, 1, false, true});
    cases.push_back({mode, LayoutKind::kContiguous, 1, true, false});
    if (n % 2 == 0 && n >= 4) {
      cases.push_back({mode, LayoutKind::kZigzag, 2});  // USP 2 x (n/2)
      cases.push_back({mode, LayoutKind::kContiguous, 2, false, false});
    }
    // Grouped value heads: 4 value heads on 2 key heads (pairs, as Qwen3-Next) and on 1; under USP the key heads are
    // split (Hk = 2 over Pu = 2) or replicated (Hk = 1 over Pu = 2, Hk = 2 over Pu = 4).
    cases.push_back({mode, LayoutKind::kZigzag, 1, true, true, 96, 2});
    cases.push_back({mode, LayoutKind::kContiguous, 1, true, false, 96, 1});
    if (n % 2 == 0 && n >= 2) {
      cases.push_back({mode, LayoutKind::kZigzag, 2, true, true, 96, 2});
      cases.push_back({mode, LayoutKind::kContiguous, 2, true, true, 96, 1});
    }
    if (n % 4 == 0) cases.push_back({mode, LayoutKind::kZigzag, 4, true, true, 96, 2});
    // fp64 storage: within 1e-10 of the recurrence, with large values and grouped heads, on both layouts, and
    // under USP with replicated key heads.
    cases.push_back({mode, LayoutKind::kZigzag, 1, true, true, 96, 2, DType::kFloat64, true});
    cases.push_back({mode, LayoutKind::kContiguous, 1, true, false, 96, kH, DType::kFloat64, true});
    if (n % 2 == 0 && n >= 2) cases.push_back({mode, LayoutKind::kZigzag, 2, true, true, 96, 1, DType::kFloat64, true});
    if (n % 2 == 0 && n >= 4) {
      cases.push_back({mode, LayoutKind::kContiguous, 2, false, true, 96, 2, DType::kFloat64, true});
    }
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(GdnCp, GdnCpVsRecurrence, ::testing::ValuesIn(gdn_cases()), test::CaseName());

// One GdnCp forward and backward of `p` (sequence length seq) on `layout` with `cfg`: this rank's outputs, gradients
// and the phase seconds of each direction.
struct GdnCpRun {
  Tensor out, final_state;
  GdnCpGrads grads;
  GdnCp::PhaseSeconds fwd, bwd;
};
GdnCpRun run_gdn_cp(const CpGroups& groups, const GdnProblem& p, std::int64_t seq, LayoutKind layout,
                    const GdnCpConfig& cfg) {
  GdnCp gdn(groups, SequenceLayout::for_groups(groups, seq, layout), cfg);
  std::vector<Tensor> keep;
  const auto& pos = gdn.positions();
  const GdnCpInputs in{shard(p.q, pos, keep), shard(p.k, pos, keep), shard(p.v, pos, keep), shard(p.g, pos, keep),
                       shard(p.beta, pos, keep)};
  GdnCpOutput o = gdn.forward(in.q, in.k, in.v, in.g, in.beta, p.init.view());
  GdnCpRun r;
  r.fwd = gdn.last_phase_seconds();
  r.grads =
      gdn.backward(std::move(o.ctx), shard(p.dout, pos, keep), p.dfinal.view(), cfg.save_inputs ? GdnCpInputs{} : in);
  r.bwd = gdn.last_phase_seconds();
  r.out = std::move(o.out);
  r.final_state = std::move(o.final_state);
  return r;
}

// Every output and gradient of `a` bitwise equal to `b`'s (the message names `name` and the tensor).
void expect_bitwise_equal(const GdnCpRun& a, const GdnCpRun& b, const std::string& name) {
  auto same = [&](const Tensor& x, const Tensor& y, const char* what) {
    ASSERT_EQ(x.nbytes(), y.nbytes()) << name << " " << what;
    EXPECT_EQ(std::memcmp(x.data(), y.data(), x.nbytes()), 0) << name << " " << what << " differs";
  };
  same(a.out, b.out, "out");
  same(a.final_state, b.final_state, "final_state");
  same(a.grads.dq, b.grads.dq, "dq");
  same(a.grads.dk, b.grads.dk, "dk");
  same(a.grads.dv, b.grads.dv, "dv");
  same(a.grads.dg, b.grads.dg, "dg");
  same(a.grads.dbeta, b.grads.dbeta, "dbeta");
  same(a.grads.dinitial_state, b.grads.dinitial_state, "dinitial_state");
}

// At 2 ring ranks (contiguous: 2 segments; zigzag: 3) no segment's map is read by another segment, so the scan computes
// none: its outputs and gradients are bitwise those of the chain (the same kernels on the same states), and its
// seconds in maps are 0. At 4 ranks with zigzag (7 segments) the middle segments' maps remain, and both modes still
// agree with each other to rounding (each against the fp64 recurrence: GdnCpVsRecurrence).
TEST(GdnCp, ScanAtTwoRanksComputesNoMapAndMatchesChainBitwise) {
  const int n = world().size();
  if (n != 2 && n != 4) GTEST_SKIP() << "needs 2 or 4 ranks, has " << n;
  CpGrid grid(world(), test::ring_over_world());
  const CpGroups groups = CpGroups::from(grid);
  for (LayoutKind layout : {LayoutKind::kContiguous, LayoutKind::kZigzag}) {
    if (n == 4 && layout == LayoutKind::kContiguous) continue;
    const GdnCase c{GdnCpMode::kScan, layout, 1, true, true, 96, 2};
    const GdnProblem p(c);
    auto run = [&](GdnCpMode mode) {
      GdnCpConfig cfg;
      cfg.mode = mode;
      cfg.chunk_size = 16;
      return run_gdn_cp(groups, p, c.seq, layout, cfg);
    };
    const GdnCpRun chain = run(GdnCpMode::kChain), scan = run(GdnCpMode::kScan);
    const std::string name = str_cat(layout_name(layout), " on ", n, " ranks");
    if (n == 2) {
      EXPECT_EQ(scan.fwd.maps, 0.0) << name << ": the forward scan computed a map";
      EXPECT_EQ(scan.bwd.maps, 0.0) << name << ": the backward scan computed a map";
      expect_bitwise_equal(scan, chain, name + ", scan against chain:");
    } else {
      // Rank 1 holds segments 1 and 5 of 7: both carry their state and are read by others in both directions.
      if (grid.ring().rank() == 1) {
        EXPECT_GT(scan.fwd.maps, 0.0) << name;
        EXPECT_GT(scan.bwd.maps, 0.0) << name;
      }
      EXPECT_TRUE(all_close(to_double(scan.out), to_double(chain.out), 1e-4, 1e-3, name + " out, scan vs chain"));
    }
  }
}

// Every mode and layout run with one GdnCpConfig switch off, then on (set(cfg, on)); check(off, on, name) compares.
template <typename Set, typename Check>
void run_switch_off_and_on(Set set, Check check) {
  const int n = world().size();
  CpGrid grid(world(), test::ring_over_world());
  const CpGroups groups = CpGroups::from(grid);
  for (GdnCpMode mode : {GdnCpMode::kChain, GdnCpMode::kScan}) {
    for (LayoutKind layout : {LayoutKind::kContiguous, LayoutKind::kZigzag}) {
      const GdnCase c{mode, layout, 1, true, true, 64 * n, 2};
      const GdnProblem p(c);
      auto run = [&](bool on) {
        GdnCpConfig cfg;
        cfg.mode = mode;
        cfg.chunk_size = 8;
        set(cfg, on);
        return run_gdn_cp(groups, p, c.seq, layout, cfg);
      };
      const GdnCpRun off = run(false), on = run(true);
      check(off, on,
            str_cat(gdn_cp_mode_name(mode), ", ", layout_name(layout), " on ", n, " ranks, rank ", grid.ring().rank()));
    }
  }
}

// The work ahead (GdnCpConfig::work_ahead) changes no bit: chain and scan, both layouts, the same problem with and
// without it give identical outputs and gradients on every rank (the reference: the same call without work ahead,
// itself checked against the fp64 recurrence in GdnCpVsRecurrence). How much is done ahead depends on timing; the
// results may not.
TEST(GdnCp, WorkAheadChangesNoBit) {
  const int n = world().size();
  if (n < 2) GTEST_SKIP() << "needs 2 or more ranks (nothing waits on 1), has " << n;
  run_switch_off_and_on([](GdnCpConfig& cfg, bool on) { cfg.work_ahead = on; },
                        [](const GdnCpRun& off, const GdnCpRun& on, const std::string& where) {
                          const std::string name = str_cat(where, " (", on.fwd.ahead + on.bwd.ahead, " s ahead)");
                          EXPECT_EQ(off.fwd.ahead + off.bwd.ahead, 0.0)
                              << name << ": work ahead ran although turned off";
                          expect_bitwise_equal(on, off, name + ", with work ahead against without:");
                        });
}

// The saved inputs copied in idle time (GdnCpConfig::defer_copies) against copied first: the backward reads them, so
// a copy left unfinished or misplaced shows in the gradients.
TEST(GdnCp, DeferredCopiesChangeNoBit) {
  run_switch_off_and_on([](GdnCpConfig& cfg, bool on) { cfg.defer_copies = on; },
                        [](const GdnCpRun& first, const GdnCpRun& deferred, const std::string& name) {
                          expect_bitwise_equal(deferred, first, name + ", saved copies deferred against made first:");
                        });
}

// The inputs not saved (GdnCpConfig::save_inputs false: the backward reads the caller's tensors handed back) against
// copies in the context: the same outputs and gradients to the bit, over the ring and (4 ranks) over Ulysses x ring,
// where the context holds the exchanged heads either way.
TEST(GdnCp, UnsavedInputsChangeNoBit) {
  run_switch_off_and_on([](GdnCpConfig& cfg, bool on) { cfg.save_inputs = !on; },
                        [](const GdnCpRun& saved, const GdnCpRun& handed_back, const std::string& name) {
                          expect_bitwise_equal(handed_back, saved, name + ", inputs handed back against saved:");
                        });
  const int n = world().size();
  if (n != 4) return;
  CpGrid grid(world(), test::ulysses_over_world(2));
  const CpGroups groups = CpGroups::from(grid);
  const GdnCase c{GdnCpMode::kScan, LayoutKind::kZigzag, 2, true, true, 64 * n, 2};
  const GdnProblem p(c);
  auto run = [&](bool save) {
    GdnCpConfig cfg;
    cfg.chunk_size = 8;
    cfg.save_inputs = save;
    return run_gdn_cp(groups, p, c.seq, c.layout, cfg);
  };
  expect_bitwise_equal(run(false), run(true), "Ulysses 2 x ring 2, inputs handed back against saved:");
}

// The forward's work ahead starting with the last waiting window (GdnCpConfig::ahead_last_first) against in run
// order: only the order of local work changes, so outputs and gradients must be bitwise the same.
TEST(GdnCp, AheadLastFirstChangesNoBit) {
  const int n = world().size();
  if (n < 2) GTEST_SKIP() << "needs 2 or more ranks (nothing waits on 1), has " << n;
  run_switch_off_and_on([](GdnCpConfig& cfg, bool on) { cfg.ahead_last_first = on; },
                        [](const GdnCpRun& in_order, const GdnCpRun& last_first, const std::string& name) {
                          expect_bitwise_equal(last_first, in_order,
                                               name + ", work ahead last window first against in run order:");
                        });
}

// The lean backward (GdnCpConfig::lean_backward: dout read in place, no zero fill without padding, the key-head sums
// of dq, dk in idle time) against the backward that copies, zero-fills and sums at the end: the same gradients to the
// bit. The run_switch_off_and_on problem has 2 value heads per key head; here also 4 and 1 (no key-head sum). Padded
// lengths (the zero fill kept) are test_gdn_cp_packed's, which checks the padding rows' gradients are 0.
TEST(GdnCp, LeanBackwardChangesNoBit) {
  run_switch_off_and_on([](GdnCpConfig& cfg, bool on) { cfg.lean_backward = on; },
                        [](const GdnCpRun& off, const GdnCpRun& on, const std::string& name) {
                          expect_bitwise_equal(on, off, name + ", lean backward against copies first:");
                        });
  const int n = world().size();
  CpGrid grid(world(), test::ring_over_world());
  const CpGroups groups = CpGroups::from(grid);
  for (GdnCpMode mode : {GdnCpMode::kChain, GdnCpMode::kScan}) {
    for (LayoutKind layout : {LayoutKind::kContiguous, LayoutKind::kZigzag}) {
      for (const auto& [seq, key_heads] : {std::pair<std::int64_t, std::int64_t>{48 * n, 1}, {40 * n, kH}}) {
        const GdnCase c{mode, layout, 1, true, true, seq, key_heads};
        const GdnProblem p(c);
        auto run = [&](bool on) {
          GdnCpConfig cfg;
          cfg.mode = mode;
          cfg.chunk_size = 8;
          cfg.lean_backward = on;
          return run_gdn_cp(groups, p, c.seq, layout, cfg);
        };
        const GdnCpRun off = run(false), on = run(true);
        expect_bitwise_equal(on, off, str_cat(case_name(c), " rank ", grid.ring().rank(), ", lean against not:"));
      }
    }
  }
}

// The chain's tag index is segment x value heads + head: 2^25 segments (a packed row of 2^25 one-token zigzag chunks)
// at 64 heads pass 2^31. Each offset must lie in [0, kGdnTagSpan) and be the index's residue, computed here by parts.
TEST(GdnCp, MessageTagOffsetsBeyondInt) {
  constexpr std::int64_t kHeads = 64;
  for (const std::int64_t segment : {std::int64_t{0}, std::int64_t{3999}, std::int64_t{1} << 25,
                                     (std::int64_t{1} << 25) + 77, std::int64_t{1} << 40}) {
    for (const std::int64_t h : {std::int64_t{0}, std::int64_t{5}, kHeads - 1}) {
      const std::int64_t index = segment * kHeads + h;
      const int offset = gdn_tag_offset(index);
      EXPECT_GE(offset, 0) << "index " << index;
      EXPECT_LT(offset, kGdnTagSpan) << "index " << index;
      EXPECT_EQ(offset, ((segment % kGdnTagSpan) * kHeads + h) % kGdnTagSpan) << "index " << index;
    }
  }
}

TEST(GdnCp, ConfigurationErrors) {
  const int n = world().size();
  CpGrid grid(world(), test::ring_over_world());
  const CpGroups groups = CpGroups::from(grid);
  GdnCpConfig cfg;
  EXPECT_THROW(GdnCp(groups, SequenceLayout::for_groups(groups, 4 * n, LayoutKind::kStripe), cfg), Error);
  // Any length is accepted (the layout pads; tests/mpi/test_gdn_cp_packed.cc checks S = 197 and 8191).
  GdnCpConfig nan_scale = cfg;
  nan_scale.scale = std::nanf("");  // was silently replaced by 1/sqrt(K)
  EXPECT_THROW(GdnCp(groups, SequenceLayout::for_groups(groups, 2 * n), nan_scale), Error);
  GdnCp gdn(groups, SequenceLayout::for_groups(groups, 2 * n), cfg);
  Tensor dout = Tensor::zeros({1, 2, 1, 4}, DType::kFloat32, MemCategory::kWorkspace);
  EXPECT_THROW(gdn.backward(CpContext{}, dout.view()), Error);                       // no forward's context
  Tensor q = Tensor::zeros({1, 3, 1, 4}, DType::kFloat32, MemCategory::kWorkspace);  // wrong local length
  Tensor gb = Tensor::zeros({1, 3, 1}, DType::kFloat32, MemCategory::kWorkspace);
  EXPECT_THROW(gdn.forward(q.view(), q.view(), q.view(), gb.view(), gb.view()), Error);
  // The inputs handed back to the backward: missing without save_inputs, given with it, or shaped unlike the
  // forward's; refused on every rank naming the tensor and the rule (the context stays usable); ranks that differ in
  // it are refused by the agreement check.
  {
    Tensor q2 = Tensor::zeros({1, 2, 1, 4}, DType::kFloat32, MemCategory::kWorkspace);
    Tensor other = Tensor::zeros({1, 2, 1, 8}, DType::kFloat32, MemCategory::kWorkspace);
    Tensor g2 = Tensor::zeros({1, 2, 1}, DType::kFloat32, MemCategory::kWorkspace);
    const GdnCpInputs in{q2.view(), q2.view(), q2.view(), g2.view(), g2.view()};
    auto expect_refused = [&](GdnCp& layer, CpContext& ctx, const GdnCpInputs& back, const std::string& words) {
      try {
        layer.backward(std::move(ctx), dout.view(), {}, back);
        ADD_FAILURE() << "accepted; expected: " << words;
      } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << e.what();
      }
    };
    GdnCpConfig unsaved = cfg;
    unsaved.save_inputs = false;
    GdnCp handed(groups, SequenceLayout::for_groups(groups, 2 * n), unsaved);
    GdnCpOutput o = handed.forward(in.q, in.k, in.v, in.g, in.beta);
    if (n > 1) {  // one rank hands them back, the others do not: every rank is told, nothing hangs
      expect_refused(handed, o.ctx, world().rank() == 0 ? in : GdnCpInputs{}, "inputs handed back");
    }
    expect_refused(handed, o.ctx, {}, "inputs.q missing: with GdnCpConfig::save_inputs false");
    GdnCpInputs wrong = in;
    wrong.v = other.view();
    expect_refused(handed, o.ctx, wrong, "inputs.v fp32[1, 2, 1, 8]@cpu does not match the forward's v");
    EXPECT_NO_THROW(handed.backward(std::move(o.ctx), dout.view(), {}, in));  // the context survived the refusals
    GdnCp saved(groups, SequenceLayout::for_groups(groups, 2 * n), cfg);
    GdnCpOutput o2 = saved.forward(in.q, in.k, in.v, in.g, in.beta);
    expect_refused(saved, o2.ctx, in, "given, but GdnCpConfig::save_inputs is true");
  }
  // 4 value heads on 3 key heads: refused with GDN's rule, on every rank, before anything is sent.
  Tensor q3 = Tensor::zeros({1, 2, 3, 4}, DType::kFloat32, MemCategory::kWorkspace);
  Tensor v4 = Tensor::zeros({1, 2, 4, 4}, DType::kFloat32, MemCategory::kWorkspace);
  Tensor g4 = Tensor::zeros({1, 2, 4}, DType::kFloat32, MemCategory::kWorkspace);
  try {
    gdn.forward(q3.view(), q3.view(), v4.view(), g4.view(), g4.view());
    ADD_FAILURE() << "Hv 4 on Hk 3 was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("value heads Hv = 4 must be a positive multiple of key heads Hk = 3"),
              std::string::npos)
        << e.what();
  }
}

// Short conv with its halo, including segments shorter than W - 1 (the halo then spans several ranks).
// The fp64 reference short conv (silu) of x [B, S, C], weight [C, W] and dy, forward and backward.
struct ShortConvReference {
  Tensor y, dx, dw;
  ShortConvReference(const Tensor& x, const Tensor& w, const Tensor& dy) {
    const Tensor x64 = f64(x), w64 = f64(w), dy64 = f64(dy);
    attn::ShortConvArgs ra;
    ra.x = x64.view();
    ra.weight = w64.view();
    y = Tensor::empty(x64.shape(), DType::kFloat64, MemCategory::kWorkspace);
    dx = Tensor::empty(x64.shape(), DType::kFloat64, MemCategory::kWorkspace);
    dw = Tensor::empty(w64.shape(), DType::kFloat64, MemCategory::kWorkspace);
    attn::reference::short_conv_forward(ra, y.view(), {});
    attn::reference::short_conv_backward(ra, dy64.view(), dx.view(), dw.view(), {});
  }
};

TEST(ShortConvCp, MatchesDirectConvIncludingShortSegments) {
  const int n = world().size();
  for (LayoutKind layout : {LayoutKind::kContiguous, LayoutKind::kZigzag}) {
    for (std::int64_t width : {1, 4}) {
      for (std::int64_t seq : {std::int64_t{2} * n, std::int64_t{2} * n * 7}) {
        const std::int64_t C = 6;
        const CpGrid grid(world(), {1, 1, n});
        const CpGroups groups = CpGroups::from(grid);
        const SequenceLayout lay = SequenceLayout::for_groups(groups, seq, layout);
        Tensor x = test::random_tensor({kB, seq, C}, DType::kFloat32, 201);
        Tensor w = test::random_tensor({C, width}, DType::kFloat32, 202);
        Tensor dy = test::random_tensor({kB, seq, C}, DType::kFloat32, 203);
        const ShortConvReference ref(x, w, dy);

        ShortConvCp conv(groups, lay);
        const auto pos = lay.positions(world().rank());
        std::vector<Tensor> keep;
        ShortConvCpOutput o = conv.forward(shard(x, pos, keep), w.view());
        const Tensor& y = o.out;
        Tensor dw = Tensor::empty(w.shape(), DType::kFloat32, MemCategory::kWorkspace);
        Tensor dx = conv.backward(std::move(o.ctx), shard(dy, pos, keep), dw.view());
        const std::string name = str_cat(layout_name(layout), " W", width, " S", seq, " at ", n, " ranks");
        EXPECT_TRUE(all_close(gather(grid.cp(), lay, y, x.shape()), to_double(ref.y), 1e-5, 1e-5, name + " out"));
        EXPECT_TRUE(all_close(gather(grid.cp(), lay, dx, x.shape()), to_double(ref.dx), 1e-5, 1e-5, name + " dx"));
        EXPECT_TRUE(all_close(to_double(dw), to_double(ref.dw), 1e-4, 1e-5, name + " dweight"));
      }
    }
  }
}

// Every storage dtype (the backward used to run the kernel with fp32 outputs on bf16, fp16 or fp64 inputs, which the
// kernel refuses): out, dx and dweight against the fp64 reference of the same rounded inputs, at the dtype's
// tolerance (dweight sums every token's term: atol scaled by S).
TEST(ShortConvCp, EveryStorageDtype) {
  const int n = world().size();
  const std::int64_t seq = 8 * n, C = 6, W = 4;
  const CpGrid grid(world(), {1, 1, n});
  const CpGroups groups = CpGroups::from(grid);
  const SequenceLayout lay = SequenceLayout::for_groups(groups, seq);
  struct Tol {
    DType dtype;
    double atol, rtol;
  };
  for (const Tol& t : {Tol{DType::kFloat32, 1e-5, 1e-5}, Tol{DType::kBFloat16, 2e-2, 2e-2},
                       Tol{DType::kFloat16, 2e-3, 5e-3}, Tol{DType::kFloat64, 1e-12, 1e-10}}) {
    const Tensor x = test::random_tensor({kB, seq, C}, t.dtype, 201), w = test::random_tensor({C, W}, t.dtype, 202),
                 dy = test::random_tensor({kB, seq, C}, t.dtype, 203);
    const ShortConvReference ref(x, w, dy);
    ShortConvCp conv(groups, lay);
    const auto pos = lay.positions(world().rank());
    std::vector<Tensor> keep;
    ShortConvCpOutput o = conv.forward(shard(x, pos, keep), w.view());
    Tensor dw = Tensor::empty(w.shape(), t.dtype, MemCategory::kWorkspace);
    const Tensor dx = conv.backward(std::move(o.ctx), shard(dy, pos, keep), dw.view());
    const std::string name = str_cat("short conv ", dtype_name(t.dtype), " at ", n, " ranks");
    EXPECT_EQ(dx.dtype(), t.dtype) << name;
    EXPECT_TRUE(all_close(gather(grid.cp(), lay, o.out, x.shape()), to_double(ref.y), t.atol, t.rtol, name + " out"));
    EXPECT_TRUE(all_close(gather(grid.cp(), lay, dx, x.shape()), to_double(ref.dx), t.atol, t.rtol, name + " dx"));
    EXPECT_TRUE(all_close(to_double(dw), to_double(ref.dw), t.atol * seq, t.rtol, name + " dweight"));
    // The backward that returns both gradients (ShortConvCpGrads) gives them bitwise.
    ShortConvCpOutput o2 = conv.forward(shard(x, pos, keep), w.view());
    const ShortConvCpGrads g = conv.backward(std::move(o2.ctx), shard(dy, pos, keep));
    ASSERT_EQ(g.dx.shape(), dx.shape()) << name;
    ASSERT_EQ(g.dweight.shape(), dw.shape()) << name;
    EXPECT_EQ(g.dweight.dtype(), t.dtype) << name;
    EXPECT_EQ(std::memcmp(g.dx.data(), dx.data(), dx.nbytes()), 0) << name << " dx (ShortConvCpGrads)";
    EXPECT_EQ(std::memcmp(g.dweight.data(), dw.data(), dw.nbytes()), 0) << name << " dweight (ShortConvCpGrads)";
  }
}

}  // namespace
}  // namespace seqpar
