// Ring attention (p2p and all-gather) against the single-rank result of the whole problem from the same seed,
// on every rank, for every layout and mask; plus work balance, communication volume, errors and determinism.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "attention/mha.h"
#include "parallel/comm_volume.h"
#include "parallel/ring_attention.h"
#include "runtime/cp_grid.h"
#include "runtime/tensor_ops.h"
#include "tests/util/mha_problem.h"
#include "tests/util/mpi_test.h"
#include "tests/util/test_util.h"

namespace seqpar {
namespace {

using test::world;

enum class Mask { kNone, kCausal, kWindow };
const char* mask_name(Mask m) { return m == Mask::kNone ? "full" : m == Mask::kCausal ? "causal" : "window"; }

struct Case {
  Mask mask;
  LayoutKind layout;
  RingImpl impl;
  std::int64_t batch = 2, seq = 192, hq = 4, hkv = 2, dim = 64;
  DType dtype = DType::kFloat32;
};

std::string case_name(const Case& c) {
  return str_cat(mask_name(c.mask), "_", layout_name(c.layout), "_", ring_impl_name(c.impl), "_B", c.batch, "_S", c.seq,
                 "_H", c.hq, "x", c.hkv, "_D", c.dim, "_", dtype_name(c.dtype));
}

void PrintTo(const Case& c, std::ostream* os) { *os << case_name(c); }

attn::MaskSpec mask_spec(Mask m, std::int64_t seq) {
  if (m == Mask::kNone) return {};
  if (m == Mask::kCausal) return {true, 0};
  return {true, seq / 3 + 1};  // spans several ranks' shards at every ring size
}

MhaCpConfig ring_config(const Case& c) {
  MhaCpConfig cfg;
  cfg.impl = c.impl;
  const attn::MaskSpec m = mask_spec(c.mask, c.seq);
  cfg.causal = m.causal;
  cfg.window = m.window;
  return cfg;
}

test::MhaShape shape_of(const Case& c) {
  test::MhaShape s;
  s.batch = c.batch;
  s.seq = c.seq;
  s.hq = c.hq;
  s.hkv = c.hkv;
  s.dim = c.dim;
  s.dtype = c.dtype;
  s.mask = mask_spec(c.mask, c.seq);
  return s;
}

// Runs ring attention over `comm` on the layout's shards and gathers the full results.
test::MhaResult distributed(Communicator& comm, const Case& c, const test::MhaProblem& p,
                            CpCounters* counters = nullptr) {
  const CpGrid grid(comm, {1, 1, comm.size()});
  const CpGroups groups = CpGroups::from(grid);
  const SequenceLayout layout = SequenceLayout::for_groups(groups, c.seq, c.layout);
  RingAttention ring(groups, layout, ring_config(c));
  const std::vector<std::int64_t> pos = layout.positions(comm.rank());
  EXPECT_EQ(pos, ring.positions());
  Tensor q = test::local_piece(p.q.view(), pos), k = test::local_piece(p.k.view(), pos),
         v = test::local_piece(p.v.view(), pos), dout = test::local_piece(p.dout.view(), pos);
  MhaCpOutput o = ring.forward(q.view(), k.view(), v.view());
  MhaCpGrads g = ring.backward(std::move(o.ctx), dout.view());
  if (counters) *counters = ring.counters();
  test::MhaResult r;
  r.out = test::gather_full(comm, layout, o.out.view(), p.q.shape());
  r.lse = test::gather_full(comm, layout, o.lse.view(), {c.batch, c.hq, c.seq}, 2);
  r.dq = test::gather_full(comm, layout, g.dq.view(), p.q.shape());
  r.dk = test::gather_full(comm, layout, g.dk.view(), p.k.shape());
  r.dv = test::gather_full(comm, layout, g.dv.view(), p.v.shape());
  return r;
}

class RingVsSingleRank : public ::testing::TestWithParam<Case> {};

TEST_P(RingVsSingleRank, MatchesSingleRank) {
  const Case c = GetParam();
  const test::MhaProblem p(shape_of(c));
  const test::MhaResult want = test::single_rank_result(shape_of(c), p);
  const test::MhaResult got = distributed(world(), c, p);
  test::expect_mha_match(got, want, c.dtype, str_cat(case_name(c), " at ", world().size(), " ranks"));
}

std::vector<Case> all_cases() {
  std::vector<Case> cases;
  for (Mask m : {Mask::kNone, Mask::kCausal, Mask::kWindow}) {
    for (LayoutKind l : {LayoutKind::kContiguous, LayoutKind::kZigzag, LayoutKind::kStripe}) {
      for (RingImpl i : {RingImpl::kP2P, RingImpl::kAllGather}) cases.push_back({m, l, i});
    }
  }
  // Head configurations, batch, head dim and dtype on the causal zigzag / p2p path (and some all-gather).
  for (RingImpl i : {RingImpl::kP2P, RingImpl::kAllGather}) {
    Case mqa{Mask::kCausal, LayoutKind::kZigzag, i};
    mqa.hkv = 1;
    cases.push_back(mqa);
    Case mha{Mask::kCausal, LayoutKind::kZigzag, i};
    mha.hkv = mha.hq;
    mha.batch = 1;
    cases.push_back(mha);
    Case d128{Mask::kCausal, LayoutKind::kStripe, i};
    d128.dim = 128;
    cases.push_back(d128);
    for (Mask m : {Mask::kNone, Mask::kCausal}) {
      for (LayoutKind l : {LayoutKind::kContiguous, LayoutKind::kZigzag}) {
        Case bf{m, l, i};
        bf.dtype = DType::kBFloat16;
        cases.push_back(bf);
      }
    }
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Ring, RingVsSingleRank, ::testing::ValuesIn(all_cases()), test::CaseName());

// bf16: the error against the fp64 reference must not grow with the ring size (accumulation is fp32).
TEST(RingAttention, Bf16ErrorDoesNotGrowWithRingSize) {
  for (RingImpl impl : {RingImpl::kP2P, RingImpl::kAllGather}) {
    Case c{Mask::kCausal, LayoutKind::kZigzag, impl};
    c.dtype = DType::kBFloat16;
    const test::MhaProblem p(shape_of(c));
    const test::MhaResult ref = test::reference_result(shape_of(c), p);

    auto self = world().split(world().rank(), 0);  // a ring of one: the single-rank error
    const test::MhaResult one = distributed(*self, c, p);
    const test::MhaResult many = distributed(world(), c, p);
    auto err = [](const std::vector<double>& a, const std::vector<double>& b) { return test::compare(a, b).max_abs; };
    const std::pair<const char*, std::pair<double, double>> errors[] = {
        {"out", {err(one.out, ref.out), err(many.out, ref.out)}},
        {"dq", {err(one.dq, ref.dq), err(many.dq, ref.dq)}},
        {"dk", {err(one.dk, ref.dk), err(many.dk, ref.dk)}},
        {"dv", {err(one.dv, ref.dv), err(many.dv, ref.dv)}}};
    for (const auto& [name, e] : errors) {
      // The floor covers the case of a (nearly) exact single-rank result: one bf16 ulp at 1.0 is 2^-8.
      EXPECT_LE(e.second, 2.0 * std::max(e.first, 1.0 / 256.0))
          << ring_impl_name(impl) << " " << name << ": error at " << world().size() << " ranks " << e.second << " vs "
          << e.first << " at 1 rank";
    }
  }
}

double reduce_scalar(double x, ReduceOp op) {
  world().all_reduce(TensorView(&x, DType::kFloat64, {1}), op)->wait();
  return x;
}

TEST(RingAttention, ZigzagCausalBalancesWork) {
  Case c{Mask::kCausal, LayoutKind::kZigzag, RingImpl::kP2P};
  const test::MhaProblem p(shape_of(c));
  CpCounters zz;
  distributed(world(), c, p, &zz);
  const double zmax = reduce_scalar(zz.flops, ReduceOp::kMax), zmin = -reduce_scalar(-zz.flops, ReduceOp::kMax);
  EXPECT_GT(zmin, 0.0);
  EXPECT_LE(zmax / zmin, 1.01) << "zigzag causal FLOPs per rank range over [" << zmin << ", " << zmax << "]";
  // Total work equals the causal half of the full problem plus the diagonal.
  const double total = reduce_scalar(zz.flops, ReduceOp::kSum);
  const double pairs = static_cast<double>(c.seq) * (c.seq + 1) / 2;
  EXPECT_DOUBLE_EQ(total, 14.0 * c.batch * c.hq * c.dim * pairs);  // 4 forward + 10 backward per pair

  c.layout = LayoutKind::kContiguous;
  CpCounters ct;
  distributed(world(), c, p, &ct);
  const double cmax = reduce_scalar(ct.flops, ReduceOp::kMax), cmin = -reduce_scalar(-ct.flops, ReduceOp::kMax);
  if (world().size() > 1) {
    EXPECT_GT(cmax / cmin, 2.0) << "contiguous causal should be imbalanced: [" << cmin << ", " << cmax << "]";
  }
}

TEST(RingAttention, BytesMatchFormula) {
  for (RingImpl impl : {RingImpl::kP2P, RingImpl::kAllGather}) {
    for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
      Case c{Mask::kCausal, LayoutKind::kZigzag, impl};
      c.dtype = dtype;
      const test::MhaProblem p(shape_of(c));
      CpCounters counters;
      distributed(world(), c, p, &counters);
      MhaVolumeShape vs;
      vs.batch = c.batch;
      vs.padded_len = c.seq;
      vs.heads = c.hq;
      vs.kv_heads = c.hkv;
      vs.head_dim = c.dim;
      vs.storage_bytes = static_cast<std::int64_t>(dtype_size(dtype));
      vs.accum_bytes = 4;
      vs.ring_size = world().size();
      vs.impl = impl;
      const MhaVolume v = mha_volume(vs);  // the closed form sp_plan predicts with
      const std::int64_t want = v.ring_forward + v.ring_backward;
      EXPECT_EQ(counters.bytes_sent, want) << ring_impl_name(impl) << " " << dtype_name(dtype);
      EXPECT_EQ(counters.bytes_received, want) << ring_impl_name(impl) << " " << dtype_name(dtype);
    }
  }
}

TEST(RingAttention, LayoutErrorsOnEveryRank) {
  const int P = world().size();
  const CpGrid grid(world(), {1, 1, P});
  const CpGroups groups = CpGroups::from(grid);
  MhaCpConfig cfg;
  // The constructor's error on this layout and config ("" when it accepts them).
  const auto error_of = [&](const SequenceLayout& layout, const MhaCpConfig& config) {
    try {
      RingAttention ring(groups, layout, config);
    } catch (const Error& e) {
      return e.message();
    }
    return std::string();
  };
  // Any length is padded by the layout (docs/design.md, "Packed rows and padding"; tests/mpi/test_mha_packed.cc checks the results).
  RingAttention odd(groups, SequenceLayout::for_groups(groups, 2 * P * 5 + 1, LayoutKind::kZigzag), cfg);
  // A layout built for other group sizes is refused with a message naming both.
  EXPECT_EQ(error_of(SequenceLayout(LayoutKind::kZigzag, 4 * P, P, 2), cfg),
            str_cat("ring attention: the layout was built for ring_size ", P,
                    " x ulysses_size 2, but the groups have ring_size ", P,
                    " x ulysses_size 1 (SequenceLayout::for_groups builds a matching one)"));
  const SequenceLayout layout = SequenceLayout::for_groups(groups, 2 * P * 4);
  cfg.causal = false;
  cfg.window = 8;
  EXPECT_THROW(RingAttention(groups, layout, cfg), Error);
  // A non-finite scale is refused by the constructor, before the first (K, V) block is sent (the kernel's own
  // check used to fire inside the first ring step, after the send was posted).
  MhaCpConfig bad_scale;
  bad_scale.scale = std::numeric_limits<float>::quiet_NaN();
  const std::int64_t ops_before = world().counters().num_ops + grid.ring().counters().num_ops;
  std::string message = error_of(layout, bad_scale);
  EXPECT_EQ(message, "ring attention: scale nan must be finite (0 or less: 1/sqrt(D))");
  EXPECT_EQ(world().counters().num_ops + grid.ring().counters().num_ops, ops_before);
  EXPECT_TRUE(test::all_ranks(world(), !message.empty()));
  // A negative soft-cap likewise, by the constructor (it was refused at the first forward's kernel arguments).
  MhaCpConfig bad_softcap;
  bad_softcap.score_mods.softcap = -2.0f;
  message = error_of(layout, bad_softcap);
  EXPECT_EQ(message, "ring attention: softcap -2 must be finite and > 0 (0: no soft-capping)");
  EXPECT_TRUE(test::all_ranks(world(), !message.empty()));
}

TEST(RingAttention, ShapeErrorsBeforeCommunication) {
  const int P = world().size();
  const CpGrid grid(world(), {1, 1, P});
  const CpGroups groups = CpGroups::from(grid);
  const SequenceLayout layout = SequenceLayout::for_groups(groups, 2 * P * 8);
  RingAttention ring(groups, layout, MhaCpConfig{});
  Tensor q = Tensor::zeros({1, 16, 4, 32}, DType::kFloat32, MemCategory::kWorkspace);
  Tensor k = Tensor::zeros({1, 16, 3, 32}, DType::kFloat32, MemCategory::kWorkspace);
  EXPECT_THROW(ring.forward(q.view(), k.view(), k.view()), Error);  // Hq 4 not a multiple of Hkv 3
  Tensor k_short = Tensor::zeros({1, 8, 2, 32}, DType::kFloat32, MemCategory::kWorkspace);
  EXPECT_THROW(ring.forward(q.view(), k_short.view(), k_short.view()), Error);
  EXPECT_THROW(ring.backward(CpContext{}, q.view()), Error);  // no forward's context
  // An integer dtype is refused by validate(), before the first block is sent (the kernel used to find it).
  for (RingImpl impl : {RingImpl::kP2P, RingImpl::kAllGather}) {
    MhaCpConfig cfg;
    cfg.impl = impl;
    RingAttention ring_i(groups, layout, cfg);
    Tensor qi = Tensor::zeros({1, 16, 2, 32}, DType::kInt32, MemCategory::kWorkspace);
    const std::int64_t ops_before = grid.ring().counters().num_ops;
    std::string m;
    try {
      ring_i.forward(qi.view(), qi.view(), qi.view());
    } catch (const Error& e) {
      m = e.message();
    }
    EXPECT_EQ(m, "ring attention: q, k, v have dtype int32, expected a floating dtype (fp32, bf16, fp16 or fp64)");
    // Nothing but the ranks' agreement check (one all-reduce of the call's fingerprint, parallel/cp_common.h).
    EXPECT_EQ(grid.ring().counters().num_ops, ops_before + ring_i.forward_agreement().num_checks())
        << ring_impl_name(impl);
    EXPECT_LE(ring_i.forward_agreement().num_checks(), 1);
  }
}

TEST(RingAttention, TwoRunsBitwiseEqual) {
  for (RingImpl impl : {RingImpl::kP2P, RingImpl::kAllGather}) {
    Case c{Mask::kWindow, LayoutKind::kZigzag, impl};
    const test::MhaProblem p(shape_of(c));
    const test::MhaResult a = distributed(world(), c, p);
    const test::MhaResult b = distributed(world(), c, p);
    EXPECT_EQ(a.out, b.out);
    EXPECT_EQ(a.lse, b.lse);
    EXPECT_EQ(a.dq, b.dq);
    EXPECT_EQ(a.dk, b.dk);
    EXPECT_EQ(a.dv, b.dv);
  }
}

}  // namespace
}  // namespace seqpar
