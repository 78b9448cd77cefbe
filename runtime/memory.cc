#include "runtime/memory.h"

#include <algorithm>
#include <cstdlib>
#include <iterator>
#include <map>
#include <mutex>
#include <string>

#include "runtime/comm_keepalive.h"
#include "runtime/env.h"
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

namespace {

constexpr std::size_t kCacheMinBytes = std::size_t{1} << 20;  // smaller blocks go straight back to the C library
constexpr std::size_t kCacheClassBytes = std::size_t{1} << 16;

// The bytes actually allocated for a host request: 64-byte multiples, and 64 KiB multiples (a size class of the
// cache) from 1 MiB on.
std::size_t host_block_bytes(std::size_t bytes) {
  const std::size_t rounded = std::max<std::size_t>(64, (bytes + 63) / 64 * 64);
  return rounded < kCacheMinBytes ? rounded : (rounded + kCacheClassBytes - 1) / kCacheClassBytes * kCacheClassBytes;
}

// Freed host blocks by size (memory.h).
class HostCache {
 public:
  HostCache() {
    const std::int64_t mb = env::get_int("SEQPAR_HOST_CACHE_MB", 1024);
    SEQPAR_CHECK(mb >= 0, "SEQPAR_HOST_CACHE_MB=", mb, " must be >= 0 (0: no host block cache)");
    // The limit in bytes must fit: 2^44 MiB and more wrapped to a limit of 0 or less than asked (the cache silently off).
    constexpr std::int64_t kMaxMb = (std::int64_t{1} << 43) - 1;
    SEQPAR_CHECK(mb <= kMaxMb, "SEQPAR_HOST_CACHE_MB=", mb, " must be <= ", kMaxMb, " (2^43 - 1 MiB, the most bytes ",
                 "a 64-bit size holds)");
    limit_ = static_cast<std::size_t>(mb) << 20;
  }
  // A cached block of exactly `size` bytes (a host_block_bytes value), or nullptr.
  void* take(std::size_t size) {
    if (size < kCacheMinBytes) return nullptr;
    std::lock_guard<std::mutex> lock(mutex_);
    const auto it = blocks_.find(size);
    if (it == blocks_.end()) return nullptr;
    void* ptr = it->second;
    blocks_.erase(it);
    held_ -= size;
    return ptr;
  }
  // Keeps the block if it is large enough and fits under the limit; false: the caller frees it.
  bool keep(void* ptr, std::size_t size) {
    if (size < kCacheMinBytes) return false;
    std::lock_guard<std::mutex> lock(mutex_);
    if (held_ + size > limit_) return false;
    blocks_.emplace(size, ptr);
    held_ += size;
    return true;
  }
  // Frees cached blocks until at most `bytes` are held (largest first).
  void trim(std::size_t bytes) {
    std::lock_guard<std::mutex> lock(mutex_);
    while (held_ > bytes && !blocks_.empty()) {
      const auto last = std::prev(blocks_.end());
      std::free(last->second);
      held_ -= last->first;
      blocks_.erase(last);
    }
  }
  std::size_t limit() {
    std::lock_guard<std::mutex> lock(mutex_);
    return limit_;
  }
  void set_limit(std::size_t bytes) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      limit_ = bytes;
    }
    trim(bytes);
  }
  std::size_t held() {
    std::lock_guard<std::mutex> lock(mutex_);
    return held_;
  }

 private:
  std::mutex mutex_;
  std::multimap<std::size_t, void*> blocks_;
  std::size_t held_ = 0, limit_ = 0;
};

HostCache& host_cache() {
  static HostCache* cache = new HostCache();  // never destroyed: frees may come from static destructors
  return *cache;
}

void* host_allocate(std::size_t bytes) {
  const std::size_t size = host_block_bytes(bytes);
  if (void* ptr = host_cache().take(size)) return ptr;
  void* ptr = std::aligned_alloc(64, size);
  if (ptr == nullptr) {  // the cached blocks may be what is missing
    host_cache().trim(0);
    ptr = std::aligned_alloc(64, size);
  }
  return ptr;
}

}  // namespace

std::size_t host_cache_limit() { return host_cache().limit(); }
void set_host_cache_limit(std::size_t bytes) { host_cache().set_limit(bytes); }
std::size_t host_cache_bytes() { return host_cache().held(); }

void* ledger_allocate(std::size_t bytes, MemCategory category, Device device) {
  void* ptr = nullptr;
  const bool injected = fault::fail_allocation();
  if (injected) {
    // SEQPAR_FAULT=oom: fail exactly as a real allocation failure does (below).
  } else if (device.is_cpu()) {
    ptr = host_allocate(bytes);
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
    if (!held_by_transport(ptr, bytes) && !host_cache().keep(ptr, host_block_bytes(bytes))) std::free(ptr);
  } else {
#if defined(SEQPAR_WITH_CUDA)
    cuda_free(ptr, device.index);
#endif
  }
  memory_ledger().on_free(category, static_cast<std::int64_t>(bytes));
}

}  // namespace seqpar
