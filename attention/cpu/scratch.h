// Internal to attention/: per-worker scratch of the CPU kernels' OpenMP regions and the kernels' out-of-memory
// error. Not a public header.
//
// An exception that leaves an OpenMP parallel region ends the process (std::terminate), so no allocation that can
// fail happens inside a region: every worker's buffers are carved out of one ledger workspace allocation made
// before the region, and a failed allocation is raised as seqpar's out-of-memory error naming the bytes asked for
// and the ledger's current totals by category.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <span>
#include <string>
#include <vector>

#include "../../runtime/dtype.h"
#include "../../runtime/error.h"
#include "../../runtime/tensor.h"

namespace seqpar::attn::cpu {

// Threads a parallel region started here may have (1 without OpenMP).
int max_workers();
// The calling thread's number in the innermost parallel region (0 outside any region or without OpenMP).
int worker_id();

// Throws seqpar::Error "out of memory: <what> asked for <bytes> bytes (the ledger holds model_state N, ..., total N
// bytes)" (runtime/memory.h ledger_totals).
[[noreturn]] void throw_out_of_memory(const std::string& what, std::int64_t bytes);

// A zero-filled ledger workspace tensor; a failed allocation is raised by throw_out_of_memory.
Tensor zeroed_workspace(const Shape& shape, DType dtype, const std::string& what);

// One zero-filled slice per worker, each holding buffers of the given element counts, allocated before a parallel
// region; inside the region each thread takes its own buffers with buffer(i).
template <typename T>
class WorkerScratch {
 public:
  WorkerScratch(std::initializer_list<std::int64_t> sizes, const std::string& what, int workers = max_workers())
      : workers_(workers) {
    for (std::int64_t n : sizes) {
      offsets_.push_back(stride_);
      sizes_.push_back(n);
      stride_ += (n + 15) / 16 * 16;  // 64-byte aligned buffers for fp32
    }
    owner_ = zeroed_workspace({static_cast<std::int64_t>(workers_) * stride_}, dtype_v<T>, what);
  }
  // Buffer `i` of the calling thread.
  std::span<T> buffer(std::size_t i) const {
    const int w = worker_id();
    SEQPAR_ASSERT(w < workers_, "worker ", w, " of a scratch for ", workers_);
    return {static_cast<T*>(owner_.data()) + w * stride_ + offsets_[i], static_cast<std::size_t>(sizes_[i])};
  }

 private:
  int workers_;
  std::int64_t stride_ = 0;
  std::vector<std::int64_t> offsets_, sizes_;
  Tensor owner_;
};

// Workers of a region that runs on max_workers() threads when `parallel`, else on the calling thread only.
inline int region_workers(bool parallel) { return parallel ? max_workers() : 1; }

}  // namespace seqpar::attn::cpu
