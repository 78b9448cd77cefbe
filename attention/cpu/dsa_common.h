// Private helpers shared by the DSA CPU kernels (attention/cpu/dsa_*.cc): the per-block view of a top-k row, the
// key ownership of the key-gradient passes, fixed-order dot products and typed loads / stores. Not a public header.
// The argument checks live in attention/dsa.cc.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <span>
#include <type_traits>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "runtime/dtype.h"
#include "runtime/error.h"
#include "runtime/tensor.h"

namespace seqpar::attn::dsa_detail {

// Arithmetic type for a storage type: fp64 for fp64, fp32 otherwise.
template <typename T>
using acc_t = std::conditional_t<std::is_same_v<T, double>, double, float>;

template <typename Acc, typename T>
inline Acc load(const T& x) {
  if constexpr (std::is_same_v<T, double>) {
    return static_cast<Acc>(x);
  } else if constexpr (std::is_same_v<T, float>) {
    return static_cast<Acc>(x);
  } else {
    return static_cast<Acc>(static_cast<float>(x));
  }
}

// Converts n elements of a storage type to Acc.
template <typename Acc, typename T>
inline void load_row(const T* src, Acc* dst, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) dst[i] = load<Acc>(src[i]);
}

// Dot product with a fixed summation order (32 lanes by index mod 32, then a fixed tree): enough independent
// accumulators to hide the FMA latency, and a pair's value does not depend on where it is computed.
template <typename Acc>
inline Acc dot(const Acc* a, const Acc* b, std::int64_t n) {
  constexpr int kLanes = 32;
  Acc lane[kLanes] = {};
  std::int64_t d = 0;
  for (; d + kLanes <= n; d += kLanes) {
    for (int l = 0; l < kLanes; ++l) lane[l] += a[d + l] * b[d + l];
  }
  for (int l = 0; d < n; ++d, ++l) lane[l] += a[d] * b[d];
  for (int width = kLanes / 2; width >= 1; width /= 2) {
    for (int l = 0; l < width; ++l) lane[l] += lane[l + width];
  }
  return lane[0];
}

// Tiles of kTile rows of the second operand, stored transposed ([D][kTile], zero-padded), feed dot_tile.
inline constexpr std::int64_t kTile = 16;

// out[r * kTile + l] = sum_d a[r * D + d] * bT[d * kTile + l] for r < rows, l < kTile, with d ascending. Every lane
// runs the same sequence of operations, so a pair's value does not depend on its lane, its tile or the tiling; kept
// out of line so that every caller runs the same instructions.
template <typename Acc>
__attribute__((noinline)) void dot_tile(const Acc* a, std::int64_t rows, std::int64_t D, const Acc* bT, Acc* out) {
  std::int64_t r = 0;
  for (; r + 4 <= rows; r += 4) {
    Acc s0[kTile] = {}, s1[kTile] = {}, s2[kTile] = {}, s3[kTile] = {};
    const Acc *a0 = a + r * D, *a1 = a0 + D, *a2 = a1 + D, *a3 = a2 + D;
    for (std::int64_t d = 0; d < D; ++d) {
      const Acc* br = bT + d * kTile;
      const Acc x0 = a0[d], x1 = a1[d], x2 = a2[d], x3 = a3[d];
      for (std::int64_t l = 0; l < kTile; ++l) {
        s0[l] += x0 * br[l];
        s1[l] += x1 * br[l];
        s2[l] += x2 * br[l];
        s3[l] += x3 * br[l];
      }
    }
    for (std::int64_t l = 0; l < kTile; ++l) {
      out[r * kTile + l] = s0[l];
      out[(r + 1) * kTile + l] = s1[l];
      out[(r + 2) * kTile + l] = s2[l];
      out[(r + 3) * kTile + l] = s3[l];
    }
  }
  for (; r < rows; ++r) {
    Acc s0[kTile] = {};
    const Acc* a0 = a + r * D;
    for (std::int64_t d = 0; d < D; ++d) {
      const Acc* br = bT + d * kTile;
      const Acc x0 = a0[d];
      for (std::int64_t l = 0; l < kTile; ++l) s0[l] += x0 * br[l];
    }
    for (std::int64_t l = 0; l < kTile; ++l) out[r * kTile + l] = s0[l];
  }
}

// tileT[d * kTile + j] = rows[j][d] as Acc for j < n (n <= kTile), zero for the padding lanes.
template <typename Acc, typename T>
inline void load_tile_transposed(const T* const* rows, std::int64_t n, std::int64_t D, Acc* tileT) {
  for (std::int64_t d = 0; d < D; ++d) {
    Acc* dst = tileT + d * kTile;
    for (std::int64_t j = 0; j < n; ++j) dst[j] = load<Acc>(rows[j][d]);
    for (std::int64_t j = n; j < kTile; ++j) dst[j] = Acc(0);
  }
}

// y += alpha * x
template <typename Acc>
inline void axpy(Acc alpha, const Acc* x, Acc* y, std::int64_t n) {
  for (std::int64_t d = 0; d < n; ++d) y[d] += alpha * x[d];
}

// The selected slots of one row (valid prefix row[0..n)) that lie in a block with strictly increasing positions
// `bpos`: calls fn(slot, local_index) in ascending slot order.
template <typename Fn>
inline void for_each_selected_in_block(const std::int64_t* row, std::int64_t n, const std::vector<std::int64_t>& bpos,
                                       Fn&& fn) {
  if (bpos.empty() || n == 0) return;
  const std::int64_t* lo = std::lower_bound(row, row + n, bpos.front());
  const std::int64_t* hi = std::upper_bound(lo, row + n, bpos.back());
  const bool contiguous = bpos.back() - bpos.front() + 1 == static_cast<std::int64_t>(bpos.size());
  auto search_from = bpos.begin();
  for (const std::int64_t* p = lo; p < hi; ++p) {
    if (contiguous) {
      fn(p - row, *p - bpos.front());
      continue;
    }
    search_from = std::lower_bound(search_from, bpos.end(), *p);
    if (search_from != bpos.end() && *search_from == *p) fn(p - row, search_from - bpos.begin());
  }
}

// The selected slots of one row inside the block whose local key index passes `keep`, in tiles of up to kTile:
// fn(slots, keys, n).
template <typename Keep, typename Fn>
inline void for_each_selected_tile(const std::int64_t* row, std::int64_t n_valid, const std::vector<std::int64_t>& bpos,
                                   Keep&& keep, Fn&& fn) {
  std::int64_t slots[kTile], keys[kTile];
  std::int64_t n = 0;
  for_each_selected_in_block(row, n_valid, bpos, [&](std::int64_t slot, std::int64_t m) {
    if (!keep(m)) return;
    slots[n] = slot;
    keys[n] = m;
    if (++n == kTile) {
      fn(slots, keys, n);
      n = 0;
    }
  });
  if (n > 0) fn(slots, keys, n);
}

// Key-gradient passes (dc, dk_idx): inside a parallel region every thread walks all query rows in increasing (b, t)
// and handles only the keys it owns (tiles of kTile keys dealt round robin). Each key's gradient is therefore summed
// over queries in increasing (b, t) and heads in increasing order whatever the thread count, no per-thread copies of
// the gradient are needed, and each query row is read once per thread instead of once per selected pair.
struct KeyOwner {
  int me = 0, num = 1;
  KeyOwner() {
#ifdef _OPENMP
    me = omp_get_thread_num();
    num = omp_get_num_threads();
#endif
  }
  bool operator()(std::int64_t m) const { return (m / kTile) % num == me; }
};

// Stores n Acc values at element offset `at` of `dst` (any floating dtype), adding to the contents when
// `accumulate` (then dst holds Acc: the accumulator dtype, checked by attention/dsa.cc).
template <typename Acc>
inline void store_row(const TensorView& dst, std::int64_t at, const Acc* src, std::int64_t n, bool accumulate) {
  if (accumulate) {
    Acc* d = static_cast<Acc*>(dst.data()) + at;
    for (std::int64_t i = 0; i < n; ++i) d[i] += src[i];
    return;
  }
  dispatch_floating(dst.dtype(), [&](auto tag) {
    using D = decltype(tag);
    D* d = static_cast<D*>(dst.data()) + at;
    for (std::int64_t i = 0; i < n; ++i) {
      if constexpr (std::is_same_v<D, double>) {
        d[i] = static_cast<double>(src[i]);
      } else if constexpr (std::is_same_v<D, float>) {
        d[i] = static_cast<float>(src[i]);
      } else {
        d[i] = D(static_cast<float>(src[i]));
      }
    }
  });
}

// An optional tensor argument that was not given (a default TensorView has no data).
inline bool absent(const TensorView& t) { return t.data() == nullptr; }

template <typename Acc = float>
inline Acc neg_inf() {
  return -std::numeric_limits<Acc>::infinity();
}

// fn(Acc{}) for an accumulator dtype (fp32 or fp64; attention/dsa.h accumulator_dtype), checked by attention/dsa.cc.
template <typename Fn>
decltype(auto) dispatch_acc(DType dtype, Fn&& fn) {
  if (dtype == DType::kFloat64) return fn(double{});
  SEQPAR_ASSERT(dtype == DType::kFloat32, "DSA accumulator of dtype ", dtype_name(dtype));
  return fn(float{});
}

}  // namespace seqpar::attn::dsa_detail
