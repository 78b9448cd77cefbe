// Access to the world communicator inside tests linked with the MPI gtest main.
#pragma once

#include <string>

#include "runtime/comm.h"
#include "runtime/cp_grid.h"

namespace seqpar::test {
Communicator& world();
// The grid of one ring over the whole world (no Ulysses, no data parallelism).
inline CpGridConfig ring_over_world() { return {1, 1, world().size(), Placement::kUlyssesInner}; }
// Ulysses groups of `ulysses_size` ranks (inner) and rings over the rest of the world (no data parallelism).
inline CpGridConfig ulysses_over_world(int ulysses_size) {
  return {1, ulysses_size, world().size() / ulysses_size, Placement::kUlyssesInner};
}
// The name generator of a parameterised test whose parameter has a case_name() (found by argument lookup).
struct CaseName {
  template <typename Info>
  std::string operator()(const Info& info) const {
    return case_name(info.param);
  }
};
}  // namespace seqpar::test
