// What the token caches of attention/ (MhaKvCache, attention/kv_cache.h; DsaCache, attention/dsa_cache.h) share:
// the global positions of the stored tokens with the rules of an append, and the [B, capacity, ...] row storage.
// No communication; host-synchronous.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "../runtime/device.h"
#include "../runtime/tensor.h"

namespace seqpar::attn {

// The global positions of a cache's stored tokens (strictly increasing; host metadata, not in the ledger) and the
// capacity rule of its appends. `cache` names the owner in messages ("MhaKvCache").
class TokenPositions {
 public:
  // Errors: capacity < 0 ("<cache>: capacity -1 must be >= 0"). Reserves nothing: the cache calls reserve() once
  // its storage is allocated, so that a capacity too large for the node fails there, with the cache's error.
  TokenPositions(std::int64_t capacity, const char* cache);
  // Reserves room for `capacity` positions (8 bytes each). Errors: "<cache>: out of memory reserving ...".
  void reserve();

  std::int64_t capacity() const { return capacity_; }
  std::int64_t length() const { return static_cast<std::int64_t>(positions_.size()); }
  const std::vector<std::int64_t>& positions() const { return positions_; }

  // The positions of n new tokens, checked, nothing stored: `positions` ([n], strictly increasing and above the last
  // stored position) or, when empty, the n positions after the last stored one (from 0 for an empty cache). Errors:
  // "<cache>::append: n new tokens after L stored would run past the capacity C", then the positions' rules.
  std::vector<std::int64_t> check_new(std::int64_t n, std::span<const std::int64_t> positions) const;
  // Records positions checked by check_new.
  void push(const std::vector<std::int64_t>& positions) {
    positions_.insert(positions_.end(), positions.begin(), positions.end());
  }
  void clear() { positions_.clear(); }

 private:
  std::int64_t capacity_;
  const char* cache_;
  std::vector<std::int64_t> positions_;
};

// A cache's storage dtype must be floating (fp32, bf16, fp16, fp64): Error naming `cache` otherwise.
void check_cache_dtype(DType dtype, const char* cache);

// Rows [begin, begin + n) of batch row b of a [B, capacity, ...] cache tensor, as a [1, n, ...] view (contiguous).
TensorView cache_rows(const Tensor& t, std::int64_t b, std::int64_t begin, std::int64_t n);

// Writes new [B, n, ...] rows (any floating dtype, converted; on t's device) into slots [begin, begin + n) of every
// batch row, ordered on `stream` (runtime/tensor_ops.h's copy_convert).
void write_cache_rows(const Tensor& t, std::int64_t begin, const TensorView& rows, Stream stream = Stream::cpu());

}  // namespace seqpar::attn
