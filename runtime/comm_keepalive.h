// Host memory that an abandoned transfer may still use (the buffer rule of runtime/comm.h).
//
// When a Work is abandoned while MPI may still read or write one of its host buffers (a send or collective whose
// peer never came, a receive whose cancel did not complete), the backend records the buffer's address range here.
// ledger_free (runtime/memory.cc) asks before returning host memory to the system: memory that overlaps a recorded
// range is deliberately kept (leaked, and logged at warn level), so that the transport never touches freed memory.
// Failure paths only: the registry is empty, and the check one relaxed atomic load, while nothing is abandoned.
// Thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>

namespace seqpar {

// Records [ptr, ptr + bytes) as possibly still used by the transport, for the rest of the process.
void keep_alive_for_transport(const void* ptr, std::size_t bytes);
// True when [ptr, ptr + bytes) overlaps a recorded range: the caller must not free that memory.
bool held_by_transport(const void* ptr, std::size_t bytes);
// Bytes of host memory kept so far because of abandoned transfers (diagnostics and tests).
std::int64_t bytes_kept_for_transport();

}  // namespace seqpar
