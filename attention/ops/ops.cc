// The device-neutral compositions of ops.h.
#include "ops.h"

namespace seqpar::attn::ops {

// ---- the affine scan, composed from the table (device-neutral) ----
template <typename T>
void scan_affine(Ops<T>& ops, std::int64_t segments, std::int64_t n, std::int64_t K, std::int64_t V, Mat<T> m,
                 Mat<T> u) {
  if (segments <= 0 || n <= 1) return;
  const std::int64_t mk = K * K, uk = K * V;
  Buffer<T> tm(ops, segments * n * mk), tu(ops, segments * n * uk);
  const Mat<T> tmm{tm.get(), K, n * mk, mk}, tuu{tu.get(), V, n * uk, uk};
  const Batch all{segments, n};
  for (std::int64_t d = 1; d < n; d *= 2) {
    ops.copy(K, K, Mat<const T>{m.ptr, m.ld, m.so, m.si}, tmm, all);
    ops.copy(K, V, Mat<const T>{u.ptr, u.ld, u.so, u.si}, tuu, all);
    const Batch tail{segments, n - d};
    // elements i >= d: (M_i, U_i) <- (M_i, U_i) o (M_{i-d}, U_{i-d})
    const Mat<const T> mi{tm.get() + d * mk, K, n * mk, mk}, mprev{tm.get(), K, n * mk, mk};
    const Mat<const T> uprev{tu.get(), V, n * uk, uk};
    ops.gemm(Trans::kN, Trans::kN, K, V, K, T(1), mi, uprev, T(1), Mat<T>{u.ptr + d * u.si, u.ld, u.so, u.si}, tail);
    ops.gemm(Trans::kN, Trans::kN, K, K, K, T(1), mi, mprev, T(0), Mat<T>{m.ptr + d * m.si, m.ld, m.so, m.si}, tail);
  }
}

template void scan_affine<float>(Ops<float>&, std::int64_t, std::int64_t, std::int64_t, std::int64_t, Mat<float>,
                                 Mat<float>);
template void scan_affine<double>(Ops<double>&, std::int64_t, std::int64_t, std::int64_t, std::int64_t, Mat<double>,
                                  Mat<double>);

}  // namespace seqpar::attn::ops
