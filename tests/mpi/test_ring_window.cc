// Sliding-window ring attention (p2p, and USP over it): exact results against the single-rank result for every
// layout with a window much smaller than, similar to and larger than the ring shard, and the bytes the ring
// communicator counted equal to the closed form of parallel/ring_attention.h (computed here from chunk arithmetic,
// independently of the WindowPlan that the layer uses).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "attention/mha.h"
#include "parallel/ring_attention.h"
#include "parallel/ring_pass.h"
#include "runtime/cp_grid.h"
#include "tests/util/mha_problem.h"
#include "tests/util/mpi_test.h"
#include "tests/util/test_util.h"

namespace seqpar {
namespace {

using test::world;

// The closed form: a layout cuts [0, S) into chunks of `c` tokens (contiguous: c = S/P, chunk i owned by rank i;
// zigzag: c = S/(2P), chunk i owned by min(i, 2P-1-i); stripe: c = 1, token t owned by t mod P). The rows of src's
// block that dst needs: for every chunk b of src, with a the first later chunk owned by dst (none: 0 rows),
// clamp(W - 1 - (a - b - 1) c, 0, c) (its last keys within W - 1 of a's first query).
struct Chunks {
  std::int64_t c;
  std::vector<int> owner;  // per chunk, in global order
};

Chunks chunks_of(LayoutKind kind, std::int64_t seq, int p) {
  Chunks ch;
  if (kind == LayoutKind::kContiguous) {
    ch.c = seq / p;
    for (int i = 0; i < p; ++i) ch.owner.push_back(i);
  } else if (kind == LayoutKind::kZigzag) {
    ch.c = seq / (2 * p);
    for (int i = 0; i < 2 * p; ++i) ch.owner.push_back(std::min(i, 2 * p - 1 - i));
  } else {
    ch.c = 1;
    for (std::int64_t t = 0; t < seq; ++t) ch.owner.push_back(static_cast<int>(t % p));
  }
  return ch;
}

std::int64_t formula_rows(const Chunks& ch, int dst, int src, std::int64_t window) {
  if (dst == src) return 0;
  std::int64_t rows = 0;
  const std::int64_t n = static_cast<std::int64_t>(ch.owner.size());
  for (std::int64_t b = 0; b < n; ++b) {
    if (ch.owner[b] != src) continue;
    std::int64_t a = b + 1;
    while (a < n && ch.owner[a] != dst) ++a;
    if (a == n) continue;
    rows += std::clamp(window - 1 - (a - b - 1) * ch.c, std::int64_t{0}, ch.c);
  }
  return rows;
}

struct WindowCase {
  LayoutKind layout;
  std::int64_t window;
  DType dtype = DType::kFloat32;
};

test::MhaShape shape_of(const WindowCase& c) {
  test::MhaShape s;
  s.batch = 2;
  s.seq = 96;  // divisible by 2P for P = 1, 2, 3, 4, 8
  s.hq = 4;
  s.hkv = 2;
  s.dim = 16;
  s.dtype = c.dtype;
  s.mask = {true, c.window};
  return s;
}

MhaCpConfig window_config(std::int64_t window) {
  MhaCpConfig cfg;
  cfg.causal = true;
  cfg.window = window;
  return cfg;
}

// Windows relative to the ring shard L = S / P: much smaller, about one shard, a few shards, the whole sequence.
std::vector<std::int64_t> windows_for(std::int64_t seq, int p) {
  const std::int64_t l = seq / p;
  return {1, 3, l, l + 1, 2 * l + 5, seq + 7};
}

void expect_fp64_match(const test::MhaResult& got, const test::MhaResult& want, const std::string& what) {
  const std::pair<const char*, std::pair<const std::vector<double>*, const std::vector<double>*>> tensors[] = {
      {"out", {&got.out, &want.out}},
      {"lse", {&got.lse, &want.lse}},
      {"dq", {&got.dq, &want.dq}},
      {"dk", {&got.dk, &want.dk}},
      {"dv", {&got.dv, &want.dv}}};
  for (const auto& [name, t] : tensors) {
    EXPECT_TRUE(test::all_close(*t.first, *t.second, 1e-10, 1e-10, what + " " + name));
  }
}

TEST(RingWindow, ExactForEveryLayoutAndWindow) {
  const int P = world().size();
  const CpGrid grid(world(), {1, 1, P});
  for (LayoutKind layout : {LayoutKind::kContiguous, LayoutKind::kZigzag, LayoutKind::kStripe}) {
    for (std::int64_t w : windows_for(96, P)) {
      for (DType dtype : {DType::kFloat32, DType::kFloat64}) {
        const WindowCase c{layout, w, dtype};
        const test::MhaProblem p(shape_of(c));
        const test::MhaResult want = test::single_rank_result(shape_of(c), p);
        const test::MhaResult got = test::usp_result(grid, shape_of(c), p, window_config(w), layout);
        const std::string what =
            str_cat(layout_name(layout), " window ", w, " ", dtype_name(dtype), " at ", P, " ranks");
        if (dtype == DType::kFloat64) {
          expect_fp64_match(got, want, what);
        } else {
          test::expect_mha_match(got, want, dtype, what);
        }
      }
    }
  }
}

TEST(RingWindow, BytesAndRoundsMatchFormula) {
  const int P = world().size(), r = world().rank();
  const CpGrid grid(world(), {1, 1, P});
  for (LayoutKind layout : {LayoutKind::kContiguous, LayoutKind::kZigzag, LayoutKind::kStripe}) {
    for (std::int64_t w : windows_for(96, P)) {
      for (DType dtype : {DType::kBFloat16, DType::kFloat64}) {  // kv 2 or 8 bytes, accumulators 4 or 8
        const WindowCase c{layout, w, dtype};
        const test::MhaShape s = shape_of(c);
        const test::MhaProblem p(s);
        CpCounters counters;
        test::usp_result(grid, s, p, window_config(w), layout, &counters);
        const Chunks ch = chunks_of(layout, s.seq, P);
        std::int64_t out_rows = 0, in_rows = 0, rounds = 0;
        for (int d = 1; d < P; ++d) {
          out_rows += formula_rows(ch, (r + d) % P, r, w);
          in_rows += formula_rows(ch, r, (r - d + P) % P, w);
          bool any = false;
          for (int x = 0; x < P; ++x) any = any || formula_rows(ch, (x + d) % P, x, w) > 0;
          rounds += any ? 1 : 0;
        }
        const std::int64_t row_elems = 2 * s.batch * s.hkv * s.dim;  // one row of k and v
        const std::int64_t kv_row = row_elems * static_cast<std::int64_t>(dtype_size(dtype));
        const std::int64_t dkv_row = row_elems * (dtype == DType::kFloat64 ? 8 : 4);
        // Forward: rows out as kv; backward: rows out again, plus the accumulators of the rows received sent home.
        const std::int64_t sent = 2 * out_rows * kv_row + in_rows * dkv_row;
        const std::int64_t received = 2 * in_rows * kv_row + out_rows * dkv_row;
        const std::string what =
            str_cat(layout_name(layout), " window ", w, " ", dtype_name(dtype), " rank ", r, "/", P);
        EXPECT_EQ(counters.bytes_sent, sent) << what;
        EXPECT_EQ(counters.bytes_received, received) << what;
        EXPECT_EQ(counters.message_rounds, 2 * rounds) << what;  // forward + backward
        // The cut: never more than the full ring's rows.
        EXPECT_LE(out_rows, (P - 1) * (s.seq / P)) << what;
      }
    }
  }
}

// The plan itself: rows as the closed form, and the small window of the docs/results.md row cuts the zigzag ring to W - 1
// rows each way at 2 ranks.
TEST(RingWindow, PlanMatchesFormula) {
  const int P = world().size(), r = world().rank();
  for (LayoutKind kind : {LayoutKind::kContiguous, LayoutKind::kZigzag, LayoutKind::kStripe}) {
    const std::int64_t seq = 2048 * P;  // 4K tokens at 2 ranks (the docs/results.md row)
    const SequenceLayout layout(kind, seq, P);
    std::vector<std::vector<std::int64_t>> pos;
    for (int x = 0; x < P; ++x) pos.push_back(layout.ring_shard_positions(x));
    const Chunks ch = chunks_of(kind, seq, P);
    for (std::int64_t w : {std::int64_t{1}, std::int64_t{256}, seq / P, seq}) {
      const WindowPlan plan(pos, r, w);
      for (int d = 1; d < P; ++d) {
        EXPECT_EQ(static_cast<std::int64_t>(plan.send_rows(d).size()), formula_rows(ch, (r + d) % P, r, w))
            << layout_name(kind) << " window " << w << " d " << d;
        EXPECT_EQ(static_cast<std::int64_t>(plan.recv_rows(d).size()), formula_rows(ch, r, (r - d + P) % P, w))
            << layout_name(kind) << " window " << w << " d " << d;
      }
      if (P == 2 && w == 256 && kind == LayoutKind::kZigzag) {
        EXPECT_EQ(plan.rows_sent(), 255);
      }
    }
  }
}

// USP: the ring dimension of a Ulysses x ring grid gets the same cut (the Ulysses all-to-alls are unchanged).
TEST(RingWindow, UspRingIsCut) {
  const int P = world().size();
  if (P % 2 != 0) GTEST_SKIP() << "USP needs an even world size here (ulysses_size 2)";
  const CpGrid grid(world(), {1, 2, P / 2});
  const WindowCase c{LayoutKind::kZigzag, 5};
  const test::MhaProblem p(shape_of(c));
  const test::MhaResult want = test::single_rank_result(shape_of(c), p);
  CpCounters counters;
  const test::MhaResult got = test::usp_result(grid, shape_of(c), p, window_config(5), LayoutKind::kZigzag, &counters);
  test::expect_mha_match(got, want, DType::kFloat32, str_cat("USP 2 x ", P / 2, " window 5"));
  // Ring part: the rows of the ring shard (S / Pr tokens, zigzag over Pr ranks) with Hkv / Pu heads.
  const int pr = P / 2, rr = grid.coords().ring_rank;
  const Chunks ch = chunks_of(LayoutKind::kZigzag, 96, pr);
  std::int64_t out_rows = 0, in_rows = 0;
  for (int d = 1; d < pr; ++d) {
    out_rows += formula_rows(ch, (rr + d) % pr, rr, 5);
    in_rows += formula_rows(ch, rr, (rr - d + pr) % pr, 5);
  }
  const std::int64_t row_elems = 2 * 2 * (2 / 2) * 16;  // k and v, B = 2, Hkv / Pu = 1, D = 16
  EXPECT_EQ(counters.bytes_sent, 2 * out_rows * row_elems * 4 + in_rows * row_elems * 4);
}

}  // namespace
}  // namespace seqpar
