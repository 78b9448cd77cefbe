// Memory categories and the per-process memory ledger (docs/design.md, "Memory ledger").
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

#include "device.h"

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
// Host blocks of at least 1 MiB are not returned to the C library when freed but kept in a per-process cache and
// handed to the next host allocation of the same size class (the size rounded up to 64 KiB), as a GPU caching
// allocator does: the C library returns such blocks to the kernel (munmap), so that without the cache every step's
// temporaries page-fault and are zeroed by the kernel again, a cost linear in the sequence that a ring pays once per
// block call on every rank. The cache holds at most host_cache_limit() bytes (SEQPAR_HOST_CACHE_MB, default 1024;
// 0: off); a block that would exceed it is freed. An allocation that fails first empties the cache and retries.
// The ledger counts live bytes only (cached blocks are free); reused memory is not zeroed (as with malloc).
void* ledger_allocate(std::size_t bytes, MemCategory category, Device device);
void ledger_free(void* ptr, std::size_t bytes, MemCategory category, Device device);
// The cache's limit in bytes; setting it frees cached blocks beyond the new limit (0 empties and disables it).
// Thread-safe.
std::size_t host_cache_limit();
void set_host_cache_limit(std::size_t bytes);
// Bytes currently held by the cache (freed blocks waiting for reuse).
std::size_t host_cache_bytes();

}  // namespace seqpar
