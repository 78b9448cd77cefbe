#include "runtime/comm_keepalive.h"

#include <atomic>
#include <mutex>
#include <utility>
#include <vector>

#include "runtime/logging.h"

namespace seqpar {
namespace {

std::mutex g_mutex;
std::vector<std::pair<std::uintptr_t, std::uintptr_t>> g_ranges;  // [begin, end) recorded by abandoned transfers
std::atomic<bool> g_any{false};
std::atomic<std::int64_t> g_kept_bytes{0};

}  // namespace

void keep_alive_for_transport(const void* ptr, std::size_t bytes) {
  if (ptr == nullptr || bytes == 0) return;
  const auto begin = reinterpret_cast<std::uintptr_t>(ptr);
  std::lock_guard<std::mutex> lock(g_mutex);
  g_ranges.emplace_back(begin, begin + bytes);
  g_any.store(true, std::memory_order_release);
}

bool held_by_transport(const void* ptr, std::size_t bytes) {
  if (!g_any.load(std::memory_order_acquire) || ptr == nullptr) return false;
  const auto begin = reinterpret_cast<std::uintptr_t>(ptr);
  const std::uintptr_t end = begin + (bytes > 0 ? bytes : 1);
  bool held = false;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    for (const auto& [b, e] : g_ranges) held = held || (begin < e && b < end);
  }
  if (held) {
    g_kept_bytes.fetch_add(static_cast<std::int64_t>(bytes), std::memory_order_relaxed);
    try {
      SEQPAR_LOG(kWarn) << "keeping " << bytes << " bytes of host memory that an abandoned communication may still "
                        << "use, instead of freeing them";
    } catch (...) {  // called from destructors: never throw
    }
  }
  return held;
}

std::int64_t bytes_kept_for_transport() { return g_kept_bytes.load(std::memory_order_relaxed); }

}  // namespace seqpar
