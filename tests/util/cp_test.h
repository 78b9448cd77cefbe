// Shared set-up of the CP layer tests (contexts, adversarial inputs): one small problem on a grid with Ulysses 2 when
// the world size is even (else a ring over the world), and the ledger's saved_activation bytes.
#pragma once

#include <cstdint>

#include "parallel/cp_common.h"
#include "parallel/layout.h"
#include "runtime/memory.h"
#include "runtime/sp_grid.h"
#include "tests/util/mpi_test.h"

namespace seqpar::test {

inline std::int64_t saved_bytes() {
  return memory_ledger().snapshot().current[static_cast<int>(MemCategory::kSavedActivation)];
}

inline SpGridConfig small_grid_config() {
  const int n = world().size();
  return n % 2 == 0 ? SpGridConfig{1, 2, n / 2} : SpGridConfig{1, 1, n};
}

// 48 tokens, one sequence, 4 heads of 16 on small_grid_config(), zigzag.
struct SmallCpCase {
  static constexpr std::int64_t seq = 48, B = 1, H = 4, D = 16;
  SpGrid grid{world(), small_grid_config()};
  CpGroups groups = CpGroups::from(grid);
  SequenceLayout layout = SequenceLayout::for_groups(groups, seq);
  std::int64_t sl = layout.local_len();
};

}  // namespace seqpar::test
