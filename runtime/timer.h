// Wall-clock time for counters and benchmarks (steady clock, seconds as double).
#pragma once

#include <chrono>

namespace seqpar {

inline double wall_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

}  // namespace seqpar
