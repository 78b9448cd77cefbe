// The device-neutral compositions of ops.h.
#include "ops.h"

#include <atomic>

#include "../../runtime/error.h"
#include "staging.h"

namespace seqpar::attn::ops {

void unsupported_op(const char* table, const char* op) { SEQPAR_THROW("ops table ", table, " does not support ", op); }

// ---- staging (staging.h) ----
namespace {
std::atomic<std::int64_t> g_staging[6];
}  // namespace

StagingCounts staging_counts() {
  StagingCounts c;
  c.in_place = g_staging[0].load();
  c.converted_in = g_staging[1].load();
  c.copied_in = g_staging[2].load();
  c.uploaded = g_staging[3].load();
  c.written = g_staging[4].load();
  c.downloaded = g_staging[5].load();
  return c;
}

namespace detail {
void note_staging(StagingEvent e) { g_staging[static_cast<int>(e)].fetch_add(1, std::memory_order_relaxed); }

void check_stageable(const TensorView& t, const char* what, const char* table, Device table_device) {
  SEQPAR_CHECK(t.device() == table_device || t.device().is_cpu(), what, " ", t.str(), " is on ", t.device().str(),
               ", but the ", table, " ops table runs on ", table_device.str(),
               " (pass tensors on that device or on the host)");
  SEQPAR_CHECK(t.data() != nullptr, what, " ", t.str(), " has no data");
}
}  // namespace detail

// ---- the affine scan, composed from the table (device-neutral) ----
namespace {

// Element i <- element i o element i - d for i = first, first + step, ... < n, every segment, as one batch: U first
// (it reads the old M_i), then M_i M_{i-d} through a scratch buffer (a GEMM may not write an operand it reads).
template <typename T>
void combine(Ops<T>& ops, std::int64_t segments, std::int64_t n, std::int64_t K, std::int64_t V, Mat<T> m, Mat<T> u,
             std::int64_t first, std::int64_t step, std::int64_t d, T* scratch) {
  if (first >= n) return;
  const std::int64_t count = (n - 1 - first) / step + 1;
  const Batch batch{segments, count};
  const Mat<const T> mi{m.ptr + first * m.si, m.ld, m.so, step * m.si};
  const Mat<const T> mj{m.ptr + (first - d) * m.si, m.ld, m.so, step * m.si};
  const Mat<const T> uj{u.ptr + (first - d) * u.si, u.ld, u.so, step * u.si};
  ops.gemm(Trans::kN, Trans::kN, K, V, K, T(1), mi, uj, T(1), Mat<T>{u.ptr + first * u.si, u.ld, u.so, step * u.si},
           batch);
  const Mat<T> tmp{scratch, K, count * K * K, K * K};
  ops.gemm(Trans::kN, Trans::kN, K, K, K, T(1), mi, mj, T(0), tmp, batch);
  ops.copy(K, K, Mat<const T>{tmp.ptr, tmp.ld, tmp.so, tmp.si}, Mat<T>{m.ptr + first * m.si, m.ld, m.so, step * m.si},
           batch);
}

}  // namespace

// Brent-Kung: an up-sweep (d = 1, 2, 4, ...: elements 2d-1, 4d-1, ... take in the d elements before them) leaves
// the full prefix at every index 2^j - 1; a down-sweep (d from the largest down to 1: elements 3d-1, 5d-1, ... take in
// the full prefix d before them) completes the rest. About 2n products in 2 log2(n) rounds (each round one batched
// call per product over all segments), against n log2(n) for a Hillis-Steele scan.
template <typename T>
void scan_affine(Ops<T>& ops, std::int64_t segments, std::int64_t n, std::int64_t K, std::int64_t V, Mat<T> m,
                 Mat<T> u) {
  if (segments <= 0 || n <= 1) return;
  Buffer<T> scratch(ops, segments * (n / 2 + 1) * K * K);
  std::int64_t top = 1;
  for (std::int64_t d = 1; 2 * d <= n; d *= 2) {
    combine(ops, segments, n, K, V, m, u, 2 * d - 1, 2 * d, d, scratch.get());
    top = d;
  }
  for (std::int64_t d = top; d >= 1; d /= 2) combine(ops, segments, n, K, V, m, u, 3 * d - 1, 2 * d, d, scratch.get());
}

template void scan_affine<float>(Ops<float>&, std::int64_t, std::int64_t, std::int64_t, std::int64_t, Mat<float>,
                                 Mat<float>);
template void scan_affine<double>(Ops<double>&, std::int64_t, std::int64_t, std::int64_t, std::int64_t, Mat<double>,
                                  Mat<double>);

}  // namespace seqpar::attn::ops
