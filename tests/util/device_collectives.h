// Communicator checks shared by the communicator tests: host buffers of the MPI backend (tests/mpi/test_comm.cc),
// device buffers of the MPI backend (tests/mpi/test_mpi_device.cc) and of the NCCL backend
// (tests/mpi/test_nccl_comm.cc): exact "unit" data (tests/util/units.h), on the CUDA device of this rank for the
// device tests, and one function per collective that runs it on every dtype and compares with a closed form.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "runtime/comm.h"

namespace seqpar::test {

inline constexpr DType kAllDTypes[] = {DType::kFloat64, DType::kFloat32, DType::kBFloat16,
                                       DType::kFloat16, DType::kInt32,   DType::kInt64};

// A device buffer (this rank's CUDA device) holding `units`, and one filled with a single value.
Tensor on_device(DType dtype, const std::vector<std::int64_t>& units);
Tensor filled_on_device(DType dtype, std::int64_t n, std::int64_t units);
int mod(int a, int p);  // non-negative remainder
// The message of the Error `fn` throws ("<no error>" when it does not throw).
std::string error_of(const std::function<void()>& fn);
bool contains(const std::string& s, const std::string& part);
// Units of element i of what rank `src` sends to its right / left neighbour.
std::int64_t right_units(int src, int i);
std::int64_t left_units(int src, int i);
// `local_reason` why this rank cannot run a group of tests (empty when it can), agreed over `w` so that every rank
// skips alike: empty only when every rank can; "another rank <why_other>" on a rank that could.
std::string agreed_skip_reason(Communicator& w, std::string local_reason, const char* why_other);
// GTEST_SKIP with `reason` unless it is empty.
#define SEQPAR_SKIP_IF(reason)                       \
  do {                                               \
    if (!(reason).empty()) GTEST_SKIP() << (reason); \
  } while (0)

// Each runs one operation on every dtype with device buffers and EXPECTs the closed-form result on this rank.
void check_all_to_all(Communicator& w);
void check_all_to_all_v(Communicator& w);
void check_all_gather(Communicator& w);
void check_reduce_scatter(Communicator& w);
void check_all_reduce(Communicator& w);
void check_broadcast(Communicator& w);
void check_batch_ring_both_directions(Communicator& w);
void check_ring_forwarding(Communicator& w);

// A buffer of `n` elements all equal to `units` where the communicator under test wants it (host or device).
using FilledBuffer = std::function<Tensor(DType dtype, std::int64_t n, std::int64_t units)>;
// CommCounters after each kind of operation against its definition (runtime/comm.h). `lone_p2p`: also a lone
// isend + irecv pair (a backend that serialises its operations, like NCCL, would deadlock on it around a ring).
void check_byte_counters(Communicator& w, const FilledBuffer& filled, bool lone_p2p);

}  // namespace seqpar::test
