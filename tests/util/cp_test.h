// Shared set-up of the CP layer tests (contexts, adversarial inputs): one small problem on a grid with Ulysses 2 when
// the world size is even (else a ring over the world), and the ledger's saved_activation bytes.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "parallel/cp_common.h"
#include "parallel/layout.h"
#include "runtime/memory.h"
#include "runtime/cp_grid.h"
#include "tests/util/mpi_test.h"
#include "tests/util/test_util.h"

namespace seqpar::test {

// Runs fn, which must throw Error on this rank with `needle` in its message; true on every rank when every rank did.
template <typename Fn>
bool fails_everywhere(Fn&& fn, const std::string& needle) {
  bool ok = false;
  try {
    fn();
  } catch (const Error& e) {
    ok = std::string(e.what()).find(needle) != std::string::npos;
    EXPECT_TRUE(ok) << e.what();
  }
  return all_ranks(world(), ok);
}

// This CP rank's [B, layout.local_len(), ...] piece of a full [B, S, ...] tensor, cut by shard_sequence (its
// padding rows 0).
inline Tensor layout_piece(const SequenceLayout& layout, int cp_rank, const Tensor& full) {
  Shape shape = full.shape();
  shape[1] = layout.local_len();
  Tensor t = Tensor::empty(shape, full.dtype(), MemCategory::kWorkspace);
  shard_sequence(layout, cp_rank, full.view(), t.view());
  return t;
}

inline std::int64_t saved_bytes() {
  return memory_ledger().snapshot().current[static_cast<int>(MemCategory::kSavedActivation)];
}

inline CpGridConfig small_grid_config() {
  const int n = world().size();
  return n % 2 == 0 ? CpGridConfig{1, 2, n / 2} : CpGridConfig{1, 1, n};
}

// Every USP grid of the world for `heads` query heads: each Ulysses size dividing both the world size and heads,
// with the ulysses-inner placement, and the ring-inner one where it makes other groups (1 < ulysses_size < world).
inline std::vector<CpGridConfig> usp_grids(std::int64_t heads, bool both_placements = true) {
  const int n = world().size();
  std::vector<CpGridConfig> grids;
  for (int pu = 1; pu <= n; ++pu) {
    if (n % pu != 0 || heads % pu != 0) continue;
    grids.push_back({1, pu, n / pu, Placement::kUlyssesInner});
    if (both_placements && pu > 1 && pu < n) grids.push_back({1, pu, n / pu, Placement::kRingInner});
  }
  return grids;
}

// 48 tokens, one sequence, 4 heads of 16 on small_grid_config(), zigzag.
struct SmallCpCase {
  static constexpr std::int64_t seq = 48, B = 1, H = 4, D = 16;
  CpGrid grid{world(), small_grid_config()};
  CpGroups groups = CpGroups::from(grid);
  SequenceLayout layout = SequenceLayout::for_groups(groups, seq);
  std::int64_t sl = layout.local_len();
};

// The bad-packing checks of a CP layer on packed rows: `forward_error(layout, batch)` runs one forward of
// the layer over `layout` with batch B and returns its Error message (empty: none). B > 1 with a packed layout, and
// (on more than one rank) rank 0 handed another packing of the same total, each fail with one named error on every
// rank before any message.
template <typename ForwardError>
void expect_bad_packings_fail(const CpGroups& groups, ForwardError&& forward_error) {
  const std::vector<std::int64_t> cu = {0, 5, 12};
  std::string message = forward_error(SequenceLayout::packed_for_groups(groups, cu, LayoutKind::kZigzag), 2);
  EXPECT_NE(message.find("has batch B = 2; a packed layout (cu_seqlens) takes B = 1"), std::string::npos) << message;
  EXPECT_TRUE(all_ranks(world(), !message.empty()));
  if (world().size() == 1) return;
  // Rank 0 was handed another packing of the same total (contiguous: the same padded length, so only the digest
  // differs).
  const std::vector<std::int64_t> other = {0, 6, 12};
  message = forward_error(
      SequenceLayout::packed_for_groups(groups, world().rank() == 0 ? other : cu, LayoutKind::kContiguous), 1);
  EXPECT_NE(message.find("disagree on cu_seqlens digest"), std::string::npos) << message;
  EXPECT_TRUE(all_ranks(world(), !message.empty()));
}

}  // namespace seqpar::test
