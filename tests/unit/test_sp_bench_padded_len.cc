// sp_bench_padded_len (benchmarks/sp_bench_options.h): the padded length in closed form, which sp_bench's memory
// estimate uses so that --dry-run of a sequence too long for the node builds no layout, against the padded_len of
// the SequenceLayout the run builds, for every kind, ring and Ulysses size and unpacked and packed rows (documents of
// length 0 and 1 included).
#include <gtest/gtest.h>

#include <vector>

#include "benchmarks/sp_bench_options.h"
#include "parallel/layout.h"

namespace seqpar::bench {
namespace {

void expect_same(SpBenchOptions o) {
  const SequenceLayout layout = sp_bench_layout(o);
  EXPECT_EQ(sp_bench_padded_len(o), layout.padded_len())
      << layout_name(o.layout) << " seq " << o.seq << " ring " << o.grid.ring_size << " ulysses "
      << o.grid.ulysses_size << " docs " << doc_lens_text(o);
}

TEST(SpBenchPaddedLen, UnpackedRowsMatchTheLayout) {
  for (const LayoutKind kind : {LayoutKind::kContiguous, LayoutKind::kZigzag, LayoutKind::kStripe,
                                LayoutKind::kBalanced}) {
    for (int ring = 1; ring <= 4; ++ring) {
      for (int ulysses = 1; ulysses <= 3; ++ulysses) {
        for (std::int64_t seq : {1, 2, 3, 7, 8, 13, 24, 41, 100, 257}) {
          SpBenchOptions o;
          o.layout = kind;
          o.seq = seq;
          o.grid.ring_size = ring;
          o.grid.ulysses_size = ulysses;
          expect_same(o);
        }
      }
    }
  }
}

TEST(SpBenchPaddedLen, PackedRowsMatchTheLayout) {
  const std::vector<std::vector<std::int64_t>> rows = {{1}, {0, 5}, {1, 1, 1}, {3, 0, 0, 9}, {17, 1, 4}, {64, 63}};
  for (const LayoutKind kind : {LayoutKind::kContiguous, LayoutKind::kZigzag, LayoutKind::kStripe,
                                LayoutKind::kBalanced}) {
    for (int ring = 1; ring <= 4; ++ring) {
      for (int ulysses = 1; ulysses <= 3; ++ulysses) {
        for (const auto& docs : rows) {
          SpBenchOptions o;
          o.layout = kind;
          o.doc_lens = docs;
          o.seq = 0;
          for (const std::int64_t len : docs) o.seq += len;
          o.grid.ring_size = ring;
          o.grid.ulysses_size = ulysses;
          expect_same(o);
        }
      }
    }
  }
}

}  // namespace
}  // namespace seqpar::bench
