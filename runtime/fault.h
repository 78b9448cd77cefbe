// Fault injection for testing the failure paths (off unless SEQPAR_FAULT is set; docs/operations.md lists the knob).
//
//   SEQPAR_FAULT=<kind>,rank=<world rank>,at=<n>[,seconds=<t>]
//     comm_error  the rank's n-th communication call (any Communicator operation, counted from 1 on this process)
//                 throws Error "injected fault: ..." before anything is posted
//     oom         the rank's n-th ledger allocation fails exactly as a real out-of-memory does
//     stall       the rank sleeps t seconds in its n-th communication call, then goes on (peers see a stopped rank)
//     count       nothing fails; at exit the rank prints how many communication calls and allocations it made,
//                 and the list of its calls ("ring: batch_isend_irecv", ...), to choose `at` for the other kinds
//   Example: SEQPAR_FAULT=comm_error,rank=1,at=5
//
// The knob is parsed when MPI starts (MpiSession), so a malformed value stops every rank before any message is sent.
// Counters are per process and thread-safe (allocations may come from OpenMP threads).
#pragma once

#include <cstddef>
#include <string>

namespace seqpar::fault {

enum class Kind { kNone, kCommError, kOom, kStall, kCount };

struct Plan {
  Kind kind = Kind::kNone;
  int rank = -1;         // world rank the fault applies to
  long long at = 0;      // 1-based index of the call / allocation
  double seconds = 0.0;  // stall only
};

// Parses a SEQPAR_FAULT value; throws Error naming the value and the rule when malformed. Empty: Kind::kNone.
Plan parse_plan(const std::string& value);
// Throws Error when the plan names a rank outside a job of `world_size` ranks (MpiSession calls it at start, so
// that a fault meant for rank 4 of a 4-rank job is refused instead of silently never injected).
void check_rank_in_world(const Plan& p, int world_size);
// The plan read once from SEQPAR_FAULT (throws when malformed).
const Plan& plan();

// Called by the Communicator front-end at the start of every operation (`op` names it). May throw or sleep.
void on_comm_call(const char* op);
// Called by ledger_allocate before allocating; true when this allocation must fail as out of memory.
bool fail_allocation();

}  // namespace seqpar::fault
