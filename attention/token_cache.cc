// The positions and row storage of the token caches (attention/token_cache.h).
#include "attention/token_cache.h"

#include "attention/boundary.h"
#include "runtime/error.h"
#include "runtime/tensor_ops.h"

namespace seqpar::attn {

TokenPositions::TokenPositions(std::int64_t capacity, const char* cache) : capacity_(capacity), cache_(cache) {
  SEQPAR_CHECK(capacity >= 0, cache, ": capacity ", capacity, " must be >= 0");
}

void TokenPositions::reserve() {
  try {
    positions_.reserve(static_cast<std::size_t>(capacity_));
  } catch (const std::exception&) {  // std::bad_alloc, std::length_error
    SEQPAR_THROW(cache_, ": out of memory reserving the positions of capacity ", capacity_, " tokens (8 bytes each)");
  }
}

std::vector<std::int64_t> TokenPositions::check_new(std::int64_t n, std::span<const std::int64_t> positions) const {
  SEQPAR_CHECK(length() + n <= capacity_, cache_, "::append: ", n, " new tokens after ", length(),
               " stored would run past the capacity ", capacity_);
  const std::int64_t next = positions_.empty() ? 0 : positions_.back() + 1;
  std::vector<std::int64_t> pos;
  if (positions.empty()) {
    for (std::int64_t i = 0; i < n; ++i) pos.push_back(next + i);
    return pos;
  }
  SEQPAR_CHECK(static_cast<std::int64_t>(positions.size()) == n, cache_, "::append: positions has ", positions.size(),
               " entries for n = ", n, " new tokens (dim 1 of the new rows)");
  detail::check_strictly_increasing(positions, str_cat(cache_, "::append positions").c_str());
  SEQPAR_CHECK(n == 0 || positions.front() >= next, cache_, "::append: position ", positions.front(),
               " must follow the last stored position ", next - 1, " (positions strictly increase along the cache)");
  pos.assign(positions.begin(), positions.end());
  return pos;
}

void check_cache_dtype(DType dtype, const char* cache) {
  SEQPAR_CHECK(is_floating(dtype), cache, ": dtype ", dtype_name(dtype),
               " must be a floating dtype (fp32, bf16, fp16 or fp64)");
}

TensorView cache_rows(const Tensor& t, std::int64_t b, std::int64_t begin, std::int64_t n) {
  std::int64_t row = 1;
  for (int d = 2; d < t.view().ndim(); ++d) row *= t.dim(d);
  auto* base =
      static_cast<char*>(t.data()) + static_cast<std::size_t>((b * t.dim(1) + begin) * row) * dtype_size(t.dtype());
  Shape shape = t.shape();
  shape[0] = 1;
  shape[1] = n;
  return TensorView(base, t.dtype(), shape, t.view().device());
}

void write_cache_rows(const Tensor& t, std::int64_t begin, const TensorView& rows, Stream stream) {
  for (std::int64_t b = 0; b < t.dim(0); ++b) {
    copy_convert(rows.slice0(b, b + 1), cache_rows(t, b, begin, rows.dim(1)), stream);
  }
}

}  // namespace seqpar::attn
