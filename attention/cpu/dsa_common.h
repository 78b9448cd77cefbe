// Private helpers shared by the DSA CPU kernels (attention/cpu/dsa_*.cc): positions, argument checks, the
// per-block view of a top-k row, the key -> selecting-queries lists used by the key-gradient passes, and typed
// loads / stores. Not a public header.
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

#include "runtime/device.h"
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

// Positions: the given span, or 0..n-1 when empty.
inline std::vector<std::int64_t> positions_or_iota(std::span<const std::int64_t> pos, std::int64_t n, const char* what,
                                                   const char* len_name) {
  std::vector<std::int64_t> out;
  if (pos.empty()) {
    out.resize(static_cast<std::size_t>(n));
    std::iota(out.begin(), out.end(), std::int64_t{0});
  } else {
    SEQPAR_CHECK(static_cast<std::int64_t>(pos.size()) == n, what, " has ", pos.size(), " entries, expected ", len_name,
                 " = ", n);
    out.assign(pos.begin(), pos.end());
  }
  return out;
}

inline void check_strictly_increasing(const std::vector<std::int64_t>& pos, const char* what) {
  for (std::size_t i = 1; i < pos.size(); ++i) {
    SEQPAR_CHECK(pos[i] > pos[i - 1], what, " must be strictly increasing, but entry ", i, " is ", pos[i], " after ",
                 pos[i - 1]);
  }
}

// The CPU kernels run on the calling thread; a CUDA stream means the caller wanted the (not yet built) GPU path.
inline void check_cpu_stream(const Stream& stream, const char* fn) {
  SEQPAR_CHECK(stream.device.is_cpu(), fn, ": stream on ", stream.device.str(),
               ", but only the CPU implementation of DSA is built");
}

inline void check_floating(const TensorView& t, const char* what) {
  check_cpu(t, what);
  SEQPAR_CHECK(is_floating(t.dtype()), what, " must have a floating dtype, got ", dtype_name(t.dtype()));
}

// Accumulator outputs: with accumulate they must be fp32.
inline void check_grad_output(const TensorView& t, const Shape& shape, bool accumulate, const char* what) {
  check_cpu(t, what);
  check_shape(t, shape, what);
  if (accumulate) {
    check_dtype(t, DType::kFloat32, what);
  } else {
    SEQPAR_CHECK(is_floating(t.dtype()), what, " must have a floating dtype, got ", dtype_name(t.dtype()));
  }
}

// Number of valid (non -1) entries at the start of each row; checks that every row is ascending and distinct,
// -1 padded at the end, and never selects a position after its query.
inline std::vector<std::int32_t> check_topk_rows(const TensorView& topk, std::int64_t B, std::int64_t Sq,
                                                 const std::vector<std::int64_t>& q_pos, const char* what) {
  check_cpu(topk, what);
  check_dtype(topk, DType::kInt64, what);
  SEQPAR_CHECK(topk.ndim() == 3 && topk.dim(0) == B && topk.dim(1) == Sq, what, " must be [B, Sq, k] = [", B, ", ", Sq,
               ", k], got ", shape_str(topk.shape()));
  const std::int64_t K = topk.dim(2);
  SEQPAR_CHECK(K <= std::numeric_limits<std::int32_t>::max(), what, ": k = ", K, " is too large");
  const std::int64_t* idx = static_cast<const std::int64_t*>(topk.data());
  std::vector<std::int32_t> valid(static_cast<std::size_t>(B * Sq));
  for (std::int64_t r = 0; r < B * Sq; ++r) {
    const std::int64_t* row = idx + r * K;
    const std::int64_t t = r % Sq;
    std::int64_t n = 0;
    while (n < K && row[n] >= 0) {
      SEQPAR_CHECK(n == 0 || row[n] > row[n - 1], what, " row (b=", r / Sq, ", t=", t,
                   ") must be strictly ascending, but slot ", n, " holds ", row[n], " after ", row[n - 1]);
      SEQPAR_CHECK(row[n] <= q_pos[static_cast<std::size_t>(t)], what, " row (b=", r / Sq, ", t=", t, ") selects ",
                   "position ", row[n], " after its query position ", q_pos[static_cast<std::size_t>(t)]);
      ++n;
    }
    for (std::int64_t s = n; s < K; ++s) {
      SEQPAR_CHECK(row[s] == -1, what, " row (b=", r / Sq, ", t=", t, ") must be padded with -1 after its valid ",
                   "entries, but slot ", s, " holds ", row[s]);
    }
    valid[static_cast<std::size_t>(r)] = static_cast<std::int32_t>(n);
  }
  return valid;
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

// Stores n Acc values at element offset `at` of `dst` (any floating dtype), adding to the fp32 contents when
// `accumulate`.
template <typename Acc>
inline void store_row(const TensorView& dst, std::int64_t at, const Acc* src, std::int64_t n, bool accumulate) {
  if (accumulate) {
    float* d = static_cast<float*>(dst.data()) + at;
    for (std::int64_t i = 0; i < n; ++i) d[i] = static_cast<float>(static_cast<Acc>(d[i]) + src[i]);
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

inline float neg_inf() { return -std::numeric_limits<float>::infinity(); }

}  // namespace seqpar::attn::dsa_detail
