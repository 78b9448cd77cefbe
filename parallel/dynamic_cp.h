// Dynamic context parallelism (docs/design.md, "Dynamic CP"): one training step's documents in micro-batches, each
// with its own CP degree, run on the grids of a CpGridSet. The plan (benchmarks' sp_plan --dynamic-cp makes one)
// lists micro-batches in execution order; micro-batch m holds documents doc_ids (indices into the step's documents,
// packed in that order into one row) and runs on group `group` of degree `degree` (world ranks group x degree ..
// group x degree + degree - 1). Every rank runs the micro-batches of its groups in plan order; since all ranks order
// them by the same global list, the first unfinished micro-batch is the next one on every rank of its group, and no
// rank waits on another in a cycle.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "../runtime/comm.h"
#include "../runtime/cp_grid_set.h"
#include "cp_common.h"
#include "layout.h"

namespace seqpar {

struct DynamicCpMicroBatch {
  int degree = 1;
  int group = 0;
  std::vector<std::int64_t> doc_ids;
};

class DynamicCpSchedule {
 public:
  // Checks the plan and keeps this rank's part of it; `grids` must outlive the schedule.
  // Args: doc_lens: the step's document lengths (>= 0), the same on every rank; plan: the micro-batches in execution
  //   order.
  // Errors, the same on every rank and before any message but one agreement check over `world` (an all-reduce;
  //   when ranks differ, an all-gather that names the first differing field and its value on each rank): ranks
  //   holding different document lengths or plans; a degree the grid set does not have; a group outside
  //   [0, W / degree); a document id outside [0, num_docs) or a document in no micro-batch or in two; a micro-batch
  //   of no tokens (no documents, or only documents of length 0).
  // Sync: collective over `world` (the world the grid set was built over).
  DynamicCpSchedule(Communicator& world, const CpGridSet& grids, std::vector<std::int64_t> doc_lens,
                    std::vector<DynamicCpMicroBatch> plan);

  // The plan, and the indices of the micro-batches this rank runs, in execution order.
  // Sync: host-only.
  const std::vector<DynamicCpMicroBatch>& plan() const { return plan_; }
  const std::vector<int>& local() const { return local_; }

  // Micro-batch m: its grid (this rank must belong to its group: m in local()), the cu_seqlens of its packed row,
  // the step token of each of its tokens (the documents' tokens in the step's order, document d starting at
  // doc_lens[0] + ... + doc_lens[d - 1]), and its layout over the grid's groups.
  // Errors: m outside the plan; grid()/layout(): a micro-batch this rank does not run.
  // Sync: host-only.
  const CpGrid& grid(int m) const;
  std::vector<std::int64_t> cu_seqlens(int m) const;
  std::vector<std::int64_t> step_tokens(int m) const;
  SequenceLayout layout(int m, LayoutKind kind) const;

  std::int64_t num_tokens() const { return doc_start_.back(); }
  const std::vector<std::int64_t>& doc_lens() const { return doc_lens_; }

 private:
  const CpGridSet& grids_;
  std::vector<std::int64_t> doc_lens_, doc_start_;
  std::vector<DynamicCpMicroBatch> plan_;
  std::vector<int> local_;
};

}  // namespace seqpar
