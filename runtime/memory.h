// Memory categories and the per-process memory ledger (docs/design.md section 11).
//
// Every owning allocation is tagged with a category; the ledger keeps the current and peak bytes of each
// category and the peak of the total, so that benchmarks can print
//   M_peak = model_state + saved_activation + persistent_cache + max_t(workspace(t) + comm_buffer(t)) + margin.
// Thread-safe. Byte counts are the requested sizes (alignment padding is not counted).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

#include "runtime/device.h"

namespace seqpar {

enum class MemCategory : std::uint8_t { kModelState, kSavedActivation, kPersistentCache, kWorkspace, kCommBuffer };
inline constexpr int kNumMemCategories = 5;
const char* mem_category_name(MemCategory category);  // "model_state", "saved_activation", ...

struct MemorySnapshot {
  std::array<std::int64_t, kNumMemCategories> current{};
  std::array<std::int64_t, kNumMemCategories> peak{};
  std::int64_t total_current = 0;
  std::int64_t total_peak = 0;
};

class MemoryLedger {
 public:
  void on_alloc(MemCategory category, std::int64_t bytes);
  void on_free(MemCategory category, std::int64_t bytes);
  MemorySnapshot snapshot() const;
  // Sets every peak (per category and total) to the current value.
  void reset_peaks();

 private:
  std::array<std::int64_t, kNumMemCategories> current_{};
  std::array<std::int64_t, kNumMemCategories> peak_{};
  std::int64_t total_current_ = 0;
  std::int64_t total_peak_ = 0;
};

// The ledger of this process (one per device type would be a later refinement; CPU and CUDA bytes share it).
MemoryLedger& memory_ledger();
// "model_state N, saved_activation N, ..., total N bytes": the ledger's current bytes, for error messages.
std::string ledger_totals();

// Raw allocation through the ledger: 64-byte aligned host memory, or device memory on CUDA.
// Throws Error naming the size, the category and the ledger's current bytes per category when the allocation
// fails ("out of memory: ..."); SEQPAR_FAULT=oom (runtime/fault.h) makes a chosen allocation fail the same way.
void* ledger_allocate(std::size_t bytes, MemCategory category, Device device);
void ledger_free(void* ptr, std::size_t bytes, MemCategory category, Device device);

}  // namespace seqpar
