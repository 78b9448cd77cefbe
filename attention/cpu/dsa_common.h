// Private helpers shared by the DSA CPU kernels (attention/cpu/dsa_*.cc): the per-block view of a top-k row, the
// GEMM tiles and the gathers that feed them, the chunks and key ownership of the key-gradient passes, fixed-order dot
// products and typed loads / stores (docs/design.md, "DSA CPU kernels"). Not a public header.
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

#include "mha_simd.h"
#include "scratch.h"
#include "../../runtime/dtype.h"
#include "../../runtime/error.h"
#include "../../runtime/tensor.h"

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

// Key tiles of kTile keys: the unit of KeyOwner's ownership.
inline constexpr std::int64_t kTile = 16;

// Widths of the GEMM operands are padded to a multiple of kPad (the fp32 SIMD width of gemm_tile, mha_simd.h);
// padding rows and columns are zero.
inline constexpr std::int64_t kPad = 16;
inline std::int64_t pad16(std::int64_t n) { return (n + kPad - 1) / kPad * kPad; }

// C[M, N] (=|+=) op(A) B with gemm_tile (attention/cpu/mha_simd.h): N a multiple of kPad, every element reduced over
// k in increasing order with the same instructions wherever it lies in C, so that a value does not depend on the
// shape of the product it was computed in.
template <typename Acc, bool kAccumulate = false, bool kTransA = false>
inline void gemm(std::int64_t M, std::int64_t N, std::int64_t K, const Acc* A, std::int64_t lda, const Acc* B,
                 std::int64_t ldb, Acc* C, std::int64_t ldc) {
  cpu::gemm_tile<Acc, kAccumulate, kTransA>(static_cast<int>(M), static_cast<int>(N), static_cast<int>(K), A,
                                            static_cast<int>(lda), B, static_cast<int>(ldb), C, static_cast<int>(ldc));
}

// dst [rows_pad, ld] = the rows base + keys[j] * D (j < n) as Acc, zero in columns D..ld and rows n..rows_pad.
template <typename Acc, typename T>
inline void gather_rows(const T* base, const std::int64_t* keys, std::int64_t n, std::int64_t rows_pad, std::int64_t D,
                        std::int64_t ld, Acc* dst) {
  for (std::int64_t j = 0; j < n; ++j) {
    load_row(base + keys[j] * D, dst + j * ld, D);
    std::fill(dst + j * ld + D, dst + (j + 1) * ld, Acc(0));
  }
  std::fill(dst + n * ld, dst + rows_pad * ld, Acc(0));
}

#if defined(__AVX512F__) && !defined(SEQPAR_MHA_SCALAR) && !defined(SEQPAR_MHA_NO_AVX512)
// dst[d * ld + j] = rows[j][d] for j, d < 16: a 16 x 16 fp32 transpose in registers.
inline void transpose16(const float* const* rows, float* dst, std::int64_t ld) {
  __m512 r[16], t[16];
  for (int j = 0; j < 16; ++j) r[j] = _mm512_loadu_ps(rows[j]);
  for (int j = 0; j < 16; j += 2) {  // 2 x 2 blocks of single elements
    t[j] = _mm512_unpacklo_ps(r[j], r[j + 1]);
    t[j + 1] = _mm512_unpackhi_ps(r[j], r[j + 1]);
  }
  for (int j = 0; j < 16; j += 4) {  // 4 x 4 blocks
    const __m512d a = _mm512_castps_pd(t[j]), b = _mm512_castps_pd(t[j + 1]);
    const __m512d c = _mm512_castps_pd(t[j + 2]), d = _mm512_castps_pd(t[j + 3]);
    r[j] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
    r[j + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
    r[j + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
    r[j + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
  }
  for (int j = 0; j < 4; ++j) {  // 128-bit lanes across groups of four rows
    const __m512 a = _mm512_shuffle_f32x4(r[j], r[j + 4], 0x88), b = _mm512_shuffle_f32x4(r[j], r[j + 4], 0xdd);
    const __m512 c = _mm512_shuffle_f32x4(r[j + 8], r[j + 12], 0x88),
                 d = _mm512_shuffle_f32x4(r[j + 8], r[j + 12], 0xdd);
    t[j] = _mm512_shuffle_f32x4(a, c, 0x88);
    t[j + 8] = _mm512_shuffle_f32x4(a, c, 0xdd);
    t[j + 4] = _mm512_shuffle_f32x4(b, d, 0x88);
    t[j + 12] = _mm512_shuffle_f32x4(b, d, 0xdd);
  }
  for (int d = 0; d < 16; ++d) _mm512_storeu_ps(dst + d * ld, t[d]);  // t[d] is column d
}
#endif

// dst[d * ld + j] = row(j)[d] as Acc for j < n, d < D (row(j): a pointer to D elements of any floating type), and
// zero in the padding columns n <= j < pad16(n). Blocks of 16 rows, so that the reads stay sequential.
template <typename Acc, typename RowFn>
inline void gather_transposed(RowFn&& row, std::int64_t n, std::int64_t D, std::int64_t ld, Acc* dst) {
  for (std::int64_t j0 = 0; j0 < n; j0 += kPad) {
    const std::int64_t nj = std::min(kPad, n - j0);
    decltype(row(0)) rows[kPad];
    for (std::int64_t j = 0; j < nj; ++j) rows[j] = row(j0 + j);
    std::int64_t d = 0;
#if defined(__AVX512F__) && !defined(SEQPAR_MHA_SCALAR) && !defined(SEQPAR_MHA_NO_AVX512)
    if constexpr (std::is_same_v<std::remove_cvref_t<decltype(*row(0))>, float> && std::is_same_v<Acc, float>) {
      if (nj == kPad) {
        const float* at[kPad];
        for (; d + kPad <= D; d += kPad) {
          for (std::int64_t j = 0; j < kPad; ++j) at[j] = rows[j] + d;
          transpose16(at, dst + d * ld + j0, ld);
        }
      }
    }
#endif
    for (; d < D; ++d) {
      Acc* out = dst + d * ld + j0;
      for (std::int64_t j = 0; j < nj; ++j) out[j] = load<Acc>(rows[j][d]);
      for (std::int64_t j = nj; j < kPad; ++j) out[j] = Acc(0);
    }
  }
}

// dst[i * ldd + c] = src[i * lds + cols[c]] for i < rows, c < n: the chosen columns of a row-major matrix.
template <typename Acc>
inline void gather_columns(const Acc* src, std::int64_t rows, std::int64_t lds, const std::int64_t* cols,
                           std::int64_t n, Acc* dst, std::int64_t ldd) {
  for (std::int64_t i = 0; i < rows; ++i) {
    for (std::int64_t c = 0; c < n; ++c) dst[i * ldd + c] = src[i * lds + cols[c]];
  }
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

// The selected slots of one row (valid prefix n_valid) that lie in the block, in ascending order, and their local
// indices into the block; slots and keys hold min(k, block size) entries. Returns their number.
inline std::int64_t collect_selected(const std::int64_t* row, std::int64_t n_valid,
                                     const std::vector<std::int64_t>& bpos, std::span<std::int64_t> slots,
                                     std::span<std::int64_t> keys) {
  std::int64_t n = 0;
  for_each_selected_in_block(row, n_valid, bpos, [&](std::int64_t slot, std::int64_t m) {
    slots[static_cast<std::size_t>(n)] = slot;
    keys[static_cast<std::size_t>(n++)] = m;
  });
  return n;
}

// Key-gradient passes (dc, dk_idx): a query pass over a chunk of query rows (any thread per row) keeps each selected
// pair's coefficients; then, inside a parallel region, every thread walks the chunk's rows in increasing (b, t) and
// handles only the keys it owns (tiles of kTile keys dealt round robin). Each key's gradient is therefore summed
// over queries in increasing (b, t) whatever the thread count, and no per-thread copies of the gradient are needed.
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

// The selected slots of one row inside the block (for_each_selected_in_block's order) whose key `mine` owns:
// cols[i] = the slot's rank among the row's selected slots in the block (its column in the query pass), keys[i] its
// local key index; returns their number.
inline std::int64_t owned_selected(const KeyOwner& mine, const std::int64_t* row, std::int64_t n_valid,
                                   const std::vector<std::int64_t>& bpos, std::int64_t* cols, std::int64_t* keys) {
  std::int64_t rank = 0, n = 0;
  for_each_selected_in_block(row, n_valid, bpos, [&](std::int64_t, std::int64_t m) {
    if (mine(m)) {
      cols[n] = rank;
      keys[n++] = m;
    }
    ++rank;
  });
  return n;
}

// acc[(base + keys[i]) * D + d] += t[i * ldt + d] for i < n, d < D: the key pass's scatter-add.
template <typename Acc>
inline void scatter_add_rows(const Acc* t, std::int64_t ldt, const std::int64_t* keys, std::int64_t n, std::int64_t D,
                             Acc* acc) {
  for (std::int64_t i = 0; i < n; ++i) {
    Acc* dst = acc + keys[i] * D;
    const Acc* src = t + i * ldt;
    for (std::int64_t d = 0; d < D; ++d) dst[d] += src[d];
  }
}

// Query rows per chunk of a key-gradient pass: as many as keep the chunk's kept values (bytes_per_row each) within
// the key-gradient accumulator's size, or one row per worker when that is larger; never above kChunkBytes, at least
// one.
inline constexpr std::int64_t kChunkBytes = std::int64_t{32} << 20;
inline std::int64_t chunk_rows(std::int64_t bytes_per_row, std::int64_t accumulator_bytes, std::int64_t rows,
                               int workers) {
  const std::int64_t per_row = std::max<std::int64_t>(bytes_per_row, 1);
  const std::int64_t budget = std::min(kChunkBytes, std::max(accumulator_bytes, per_row * workers));
  return std::clamp<std::int64_t>(budget / per_row, 1, std::max<std::int64_t>(rows, 1));
}

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

// The key-gradient accumulator of a backward call ([keys, D] of Acc): the output itself when it has the accumulator
// dtype (zeroed first unless `accumulate`), so that no copy is needed, else a zeroed workspace copy that finish()
// stores into the output. Either way each key's gradient is summed over queries in increasing order.
template <typename Acc>
class KeyGradient {
 public:
  KeyGradient(const TensorView& out, std::int64_t keys, std::int64_t D, bool accumulate, const std::string& what)
      : out_(out), keys_(keys), D_(D), accumulate_(accumulate), direct_(out.dtype() == dtype_v<Acc>) {
    if (direct_) {
      data_ = static_cast<Acc*>(out.data());
      if (!accumulate) {
#pragma omp parallel for schedule(static)
        for (std::int64_t k = 0; k < keys; ++k) std::fill(data_ + k * D, data_ + (k + 1) * D, Acc(0));
      }
    } else {
      owner_ = cpu::zeroed_workspace({keys * D}, dtype_v<Acc>, what);
      data_ = static_cast<Acc*>(owner_.data());
    }
  }
  Acc* data() const { return data_; }
  void finish() const {
    if (direct_) return;
#pragma omp parallel for schedule(static)
    for (std::int64_t k = 0; k < keys_; ++k) store_row(out_, k * D_, data_ + k * D_, D_, accumulate_);
  }

 private:
  TensorView out_;
  std::int64_t keys_, D_;
  bool accumulate_, direct_;
  Tensor owner_;
  Acc* data_ = nullptr;
};

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
