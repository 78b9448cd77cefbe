// Wall-clock time for counters and benchmarks (steady clock, seconds as double).
#pragma once

#include <chrono>
#include <ctime>

namespace seqpar {

inline double wall_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// CPU time of the whole process (every thread), seconds: what a process got of the machine, which a shared machine's
// load does not inflate the way it does wall time.
inline double process_cpu_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

}  // namespace seqpar
