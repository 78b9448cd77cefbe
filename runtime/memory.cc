#include "runtime/memory.h"

#include <algorithm>
#include <cstdlib>
#include <mutex>
#include <string>

#include "runtime/comm_keepalive.h"
#include "runtime/error.h"
#include "runtime/fault.h"

namespace seqpar {
namespace {
std::mutex g_ledger_mutex;
}

const char* mem_category_name(MemCategory category) {
  switch (category) {
    case MemCategory::kModelState: return "model_state";
    case MemCategory::kSavedActivation: return "saved_activation";
    case MemCategory::kPersistentCache: return "persistent_cache";
    case MemCategory::kWorkspace: return "workspace";
    case MemCategory::kCommBuffer: return "comm_buffer";
  }
  return "unknown";
}

void MemoryLedger::on_alloc(MemCategory category, std::int64_t bytes) {
  std::lock_guard<std::mutex> lock(g_ledger_mutex);
  const int c = static_cast<int>(category);
  current_[c] += bytes;
  peak_[c] = std::max(peak_[c], current_[c]);
  total_current_ += bytes;
  total_peak_ = std::max(total_peak_, total_current_);
}

void MemoryLedger::on_free(MemCategory category, std::int64_t bytes) {
  std::lock_guard<std::mutex> lock(g_ledger_mutex);
  current_[static_cast<int>(category)] -= bytes;
  total_current_ -= bytes;
}

MemorySnapshot MemoryLedger::snapshot() const {
  std::lock_guard<std::mutex> lock(g_ledger_mutex);
  MemorySnapshot s;
  s.current = current_;
  s.peak = peak_;
  s.total_current = total_current_;
  s.total_peak = total_peak_;
  return s;
}

void MemoryLedger::reset_peaks() {
  std::lock_guard<std::mutex> lock(g_ledger_mutex);
  peak_ = current_;
  total_peak_ = total_current_;
}

MemoryLedger& memory_ledger() {
  static MemoryLedger ledger;
  return ledger;
}

#if defined(SEQPAR_WITH_CUDA)
void* cuda_allocate(std::size_t bytes, int ordinal);
void cuda_free(void* ptr, int ordinal);
#endif

std::string ledger_totals() {
  const MemorySnapshot s = memory_ledger().snapshot();
  std::string text;
  for (int c = 0; c < kNumMemCategories; ++c) {
    text += str_cat(c ? ", " : "", mem_category_name(static_cast<MemCategory>(c)), " ", s.current[c]);
  }
  return str_cat(text, ", total ", s.total_current, " bytes");
}

void* ledger_allocate(std::size_t bytes, MemCategory category, Device device) {
  void* ptr = nullptr;
  const bool injected = fault::fail_allocation();
  if (injected) {
    // SEQPAR_FAULT=oom: fail exactly as a real allocation failure does (below).
  } else if (device.is_cpu()) {
    const std::size_t rounded = std::max<std::size_t>(64, (bytes + 63) / 64 * 64);
    ptr = std::aligned_alloc(64, rounded);
  } else {
#if defined(SEQPAR_WITH_CUDA)
    ptr = cuda_allocate(bytes, device.index);
#else
    SEQPAR_THROW("cannot allocate on ", device.str(), ": seqpar was built without CUDA");
#endif
  }
  SEQPAR_CHECK(ptr != nullptr, "out of memory: allocating ", bytes, " bytes of ", mem_category_name(category), " on ",
               device.str(), " (ledger now holds ", ledger_totals(), ")",
               injected ? " [injected by SEQPAR_FAULT]" : "");
  memory_ledger().on_alloc(category, static_cast<std::int64_t>(bytes));
  return ptr;
}

void ledger_free(void* ptr, std::size_t bytes, MemCategory category, Device device) {
  if (!ptr) return;
  if (device.is_cpu()) {
    // Memory an abandoned transfer may still read or write is kept, never freed (runtime/comm_keepalive.h).
    if (!held_by_transport(ptr, bytes)) std::free(ptr);
  } else {
#if defined(SEQPAR_WITH_CUDA)
    cuda_free(ptr, device.index);
#endif
  }
  memory_ledger().on_free(category, static_cast<std::int64_t>(bytes));
}

}  // namespace seqpar
