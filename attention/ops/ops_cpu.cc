// The CPU ops table (ops_cpu.h).
#include "ops_cpu.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <vector>

#if defined(SEQPAR_OPS_WITH_CBLAS)
#include <cblas.h>
#endif

#include "../kernels/dsa_rows.h"
#include "../kernels/gdn_rows.h"

namespace seqpar::attn::ops {
namespace {

template <typename T>
void gemm_loops(Trans ta, Trans tb, std::int64_t m, std::int64_t n, std::int64_t k, T alpha, const T* a,
                std::int64_t lda, const T* b, std::int64_t ldb, T beta, T* c, std::int64_t ldc) {
  for (std::int64_t i = 0; i < m; ++i) {
    for (std::int64_t j = 0; j < n; ++j) {
      T acc = T(0);
      for (std::int64_t p = 0; p < k; ++p) {
        const T av = ta == Trans::kN ? a[i * lda + p] : a[p * lda + i];
        const T bv = tb == Trans::kN ? b[p * ldb + j] : b[j * ldb + p];
        acc += av * bv;
      }
      T& cij = c[i * ldc + j];
      cij = beta == T(0) ? alpha * acc : alpha * acc + beta * cij;
    }
  }
}

template <typename T>
void trsm_loops(std::int64_t n, std::int64_t nrhs, const T* l, std::int64_t ldl, T* b, std::int64_t ldb) {
  for (std::int64_t i = 1; i < n; ++i)
    for (std::int64_t p = 0; p < i; ++p) {
      const T lip = l[i * ldl + p];
      for (std::int64_t j = 0; j < nrhs; ++j) b[i * ldb + j] -= lip * b[p * ldb + j];
    }
}

// gemm_fixed_order's body for one matrix: columns in panels of kFixedLanes, op(B)'s panel packed as [k, kFixedLanes]
// (zero lanes past n), then per row i every lane sums a_ip b_pj over p in increasing order. Every element of every
// shape goes through this one loop (a lane's arithmetic does not depend on the lane or the panel), so its value does
// not depend on m, n or its place in C.
inline constexpr std::int64_t kFixedLanes = 16;
template <typename T>
__attribute__((noinline)) void gemm_fixed_one(std::int64_t m, std::int64_t n, std::int64_t k, T alpha, const T* a,
                                              std::int64_t sa_i, std::int64_t sa_p, const T* b, std::int64_t sb_p,
                                              std::int64_t sb_j, T beta, T* c, std::int64_t ldc, T* panel) {
  for (std::int64_t j0 = 0; j0 < n; j0 += kFixedLanes) {
    const std::int64_t nj = std::min(kFixedLanes, n - j0);
    for (std::int64_t p = 0; p < k; ++p)
      for (std::int64_t l = 0; l < kFixedLanes; ++l)
        panel[p * kFixedLanes + l] = l < nj ? b[p * sb_p + (j0 + l) * sb_j] : T(0);
    // a vector of kFixedLanes T (GCC / Clang vector extension): every lane takes the same operations; rows go four
    // at a time (one load of the panel row for four products), the last ones alone, each row's lanes by the same
    // statement acc += a_ip * b_p
    typedef T Lanes __attribute__((vector_size(kFixedLanes * sizeof(T))));
    const auto store = [&](std::int64_t i, const Lanes& acc) {
      T* ci = c + i * ldc + j0;
      for (std::int64_t l = 0; l < nj; ++l) ci[l] = beta == T(0) ? alpha * acc[l] : alpha * acc[l] + beta * ci[l];
    };
    std::int64_t i = 0;
    for (; i + 4 <= m; i += 4) {
      Lanes acc0 = {}, acc1 = {}, acc2 = {}, acc3 = {};
      for (std::int64_t p = 0; p < k; ++p) {
        Lanes bv;
        std::memcpy(&bv, panel + p * kFixedLanes, sizeof(Lanes));
        const T* ap = a + i * sa_i + p * sa_p;
        acc0 += ap[0] * bv;
        acc1 += ap[sa_i] * bv;
        acc2 += ap[2 * sa_i] * bv;
        acc3 += ap[3 * sa_i] * bv;
      }
      store(i, acc0);
      store(i + 1, acc1);
      store(i + 2, acc2);
      store(i + 3, acc3);
    }
    for (; i < m; ++i) {
      Lanes acc = {};
      for (std::int64_t p = 0; p < k; ++p) {
        Lanes bv;
        std::memcpy(&bv, panel + p * kFixedLanes, sizeof(Lanes));
        acc += a[i * sa_i + p * sa_p] * bv;
      }
      store(i, acc);
    }
  }
}

#if defined(SEQPAR_OPS_WITH_CBLAS)
CBLAS_TRANSPOSE cblas_trans(Trans t) { return t == Trans::kN ? CblasNoTrans : CblasTrans; }
void gemm_one(Trans ta, Trans tb, std::int64_t m, std::int64_t n, std::int64_t k, float alpha, const float* a,
              std::int64_t lda, const float* b, std::int64_t ldb, float beta, float* c, std::int64_t ldc) {
  cblas_sgemm(CblasRowMajor, cblas_trans(ta), cblas_trans(tb), m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
void gemm_one(Trans ta, Trans tb, std::int64_t m, std::int64_t n, std::int64_t k, double alpha, const double* a,
              std::int64_t lda, const double* b, std::int64_t ldb, double beta, double* c, std::int64_t ldc) {
  cblas_dgemm(CblasRowMajor, cblas_trans(ta), cblas_trans(tb), m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
void trsm_one(std::int64_t n, std::int64_t nrhs, const float* l, std::int64_t ldl, float* b, std::int64_t ldb) {
  cblas_strsm(CblasRowMajor, CblasLeft, CblasLower, CblasNoTrans, CblasUnit, n, nrhs, 1.0f, l, ldl, b, ldb);
}
void trsm_one(std::int64_t n, std::int64_t nrhs, const double* l, std::int64_t ldl, double* b, std::int64_t ldb) {
  cblas_dtrsm(CblasRowMajor, CblasLeft, CblasLower, CblasNoTrans, CblasUnit, n, nrhs, 1.0, l, ldl, b, ldb);
}
#else
template <typename T>
void gemm_one(Trans ta, Trans tb, std::int64_t m, std::int64_t n, std::int64_t k, T alpha, const T* a, std::int64_t lda,
              const T* b, std::int64_t ldb, T beta, T* c, std::int64_t ldc) {
  gemm_loops(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
template <typename T>
void trsm_one(std::int64_t n, std::int64_t nrhs, const T* l, std::int64_t ldl, T* b, std::int64_t ldb) {
  trsm_loops(n, nrhs, l, ldl, b, ldb);
}
#endif

template <typename T>
class CpuOps final : public Ops<T> {
 public:
  const char* name() const override { return "cpu"; }
  Device device() const override { return Device::cpu(); }
  void* allocate(std::size_t bytes) override {
    void* p = std::calloc(bytes > 0 ? bytes : 1, 1);
    if (p == nullptr) throw std::bad_alloc();
    return p;
  }
  void deallocate(void* p) override { std::free(p); }
  void upload(void* dst, const void* host, std::size_t bytes) override { std::memcpy(dst, host, bytes); }
  void download(void* host, const void* src, std::size_t bytes) override { std::memcpy(host, src, bytes); }

  void gemm(Trans ta, Trans tb, std::int64_t m, std::int64_t n, std::int64_t k, T alpha, Mat<const T> a, Mat<const T> b,
            T beta, Mat<T> c, Batch batch) override {
    if (m <= 0 || n <= 0) return;
    for (std::int64_t o = 0; o < batch.outer; ++o)
      for (std::int64_t i = 0; i < batch.inner; ++i) {
        if (k <= 0) {  // C = beta C
          T* cp = c.at(o, i);
          for (std::int64_t r = 0; r < m; ++r)
            for (std::int64_t j = 0; j < n; ++j) cp[r * c.ld + j] = beta == T(0) ? T(0) : beta * cp[r * c.ld + j];
          continue;
        }
        gemm_one(ta, tb, m, n, k, alpha, a.at(o, i), a.ld, b.at(o, i), b.ld, beta, c.at(o, i), c.ld);
      }
  }
  void trsm_unit_lower(std::int64_t n, std::int64_t nrhs, Mat<const T> l, Mat<T> b, Batch batch) override {
    if (n <= 0 || nrhs <= 0) return;
    for (std::int64_t o = 0; o < batch.outer; ++o)
      for (std::int64_t i = 0; i < batch.inner; ++i) trsm_one(n, nrhs, l.at(o, i), l.ld, b.at(o, i), b.ld);
  }
  void copy(std::int64_t rows, std::int64_t cols, Mat<const T> src, Mat<T> dst, Batch batch) override {
    for (std::int64_t o = 0; o < batch.outer; ++o)
      for (std::int64_t i = 0; i < batch.inner; ++i)
        for (std::int64_t r = 0; r < rows; ++r)
          std::memcpy(dst.at(o, i) + r * dst.ld, src.at(o, i) + r * src.ld, static_cast<std::size_t>(cols) * sizeof(T));
  }
  void scaled_identity(std::int64_t n, const T* s, std::int64_t s_so, std::int64_t s_si, Mat<T> dst,
                       Batch batch) override {
    for (std::int64_t o = 0; o < batch.outer; ++o)
      for (std::int64_t i = 0; i < batch.inner; ++i) {
        T* d = dst.at(o, i);
        const T v = s[o * s_so + i * s_si];
        for (std::int64_t r = 0; r < n; ++r)
          for (std::int64_t j = 0; j < n; ++j) d[r * dst.ld + j] = r == j ? v : T(0);
      }
  }

  void convert_in(const void* src, DType src_dtype, T* dst, std::int64_t n) override {
    for (std::int64_t i = 0; i < n; ++i) dst[i] = load_element<T>(src, src_dtype, static_cast<std::size_t>(i));
  }
  void convert_out(const T* src, void* dst, DType dst_dtype, std::int64_t n) override {
    for (std::int64_t i = 0; i < n; ++i) store_element<T>(src[i], dst, dst_dtype, static_cast<std::size_t>(i));
  }

  void gather_rows(std::int64_t rows, std::int64_t cols, const T* src, std::int64_t ld_src, const std::int64_t* idx,
                   T* dst, std::int64_t ld_dst) override {
    for (std::int64_t r = 0; r < rows; ++r) {
      T* d = dst + r * ld_dst;
      if (idx[r] < 0)
        std::fill(d, d + cols, T(0));
      else
        std::memcpy(d, src + idx[r] * ld_src, static_cast<std::size_t>(cols) * sizeof(T));
    }
  }
  void scatter_add_rows(std::int64_t rows, std::int64_t cols, const T* src, std::int64_t ld_src,
                        const std::int64_t* idx, T* dst, std::int64_t ld_dst) override {
    for (std::int64_t r = 0; r < rows; ++r) {
      if (idx[r] < 0) continue;
      T* d = dst + idx[r] * ld_dst;
      const T* s = src + r * ld_src;
      for (std::int64_t j = 0; j < cols; ++j) d[j] += s[j];
    }
  }

  void topk_rows(std::int64_t rows, std::int64_t n, std::int64_t k, const T* scores, std::int64_t ld,
                 const std::int64_t* lo, const std::int64_t* hi, std::int64_t* idx, T* val) override {
    std::vector<std::int64_t> cand;
    for (std::int64_t r = 0; r < rows; ++r) {
      const T* s = scores + r * ld;
      const std::int64_t b = std::max<std::int64_t>(lo[r], 0), e = std::min(hi[r], n);
      cand.clear();
      for (std::int64_t j = b; j < e; ++j)
        if (!std::isnan(s[j])) cand.push_back(j);
      const auto better = [s](std::int64_t x, std::int64_t y) { return s[x] > s[y] || (s[x] == s[y] && x < y); };
      const std::int64_t take = std::min<std::int64_t>(k, static_cast<std::int64_t>(cand.size()));
      std::partial_sort(cand.begin(), cand.begin() + take, cand.end(), better);
      std::sort(cand.begin(), cand.begin() + take);
      for (std::int64_t t = 0; t < k; ++t) {
        idx[r * k + t] = t < take ? cand[t] : -1;
        val[r * k + t] = t < take ? s[cand[t]] : -std::numeric_limits<T>::infinity();
      }
    }
  }

  void l2norm_scale_rows(std::int64_t rows, std::int64_t cols, T* x, std::int64_t ld, T eps, T s) override {
    for (std::int64_t r = 0; r < rows; ++r) rowops::l2norm_scale_row(x + r * ld, cols, eps, s);
  }
  void relu_rows(std::int64_t rows, std::int64_t cols, T* x, std::int64_t ld) override {
    for (std::int64_t r = 0; r < rows; ++r) rowops::relu_row(x + r * ld, cols);
  }
  void softmax_rows(std::int64_t rows, std::int64_t cols, T* x, std::int64_t ld, const std::int64_t* end,
                    std::int64_t end_div, T* row_max, T* row_sum) override {
    for (std::int64_t r = 0; r < rows; ++r)
      rowops::softmax_prefix_row(x + r * ld, cols, end[r / end_div], row_max + r, row_sum + r);
  }
  void scale_rows(std::int64_t rows, std::int64_t cols, T* x, std::int64_t ld, const T* s) override {
    for (std::int64_t r = 0; r < rows; ++r)
      for (std::int64_t j = 0; j < cols; ++j) x[r * ld + j] *= s[r];
  }
  void cumsum_rows(std::int64_t rows, std::int64_t cols, T* x, std::int64_t ld) override {
    for (std::int64_t r = 0; r < rows; ++r) rowops::cumsum_row(x + r * ld, cols);
  }
  void gdn_chunk_scales(std::int64_t chunks, std::int64_t C, const T* gamma, const T* beta, T* kscale, T* vscale,
                        T* qscale, T* kend, T* end_decay) override {
    for (std::int64_t c = 0; c < chunks; ++c)
      rowops::gdn_chunk_scales(gamma + c * C, beta + c * C, C, kscale + c * C, vscale + c * C, qscale + c * C,
                               kend + c * C, end_decay + c);
  }
  void gdn_chunk_masks(std::int64_t chunks, std::int64_t C, const T* gamma, const T* beta, T* a, T* qk) override {
    for (std::int64_t c = 0; c < chunks; ++c)
      for (std::int64_t i = 0; i < C; ++i) {
        rowops::gdn_wy_row(a + (c * C + i) * C, i, C, gamma + c * C, beta[c * C + i]);
        rowops::gdn_qk_row(qk + (c * C + i) * C, i, C, gamma + c * C);
      }
  }

  void row_dots(std::int64_t rows, std::int64_t cols, const T* a, std::int64_t lda, const T* b, std::int64_t ldb,
                T* out) override {
    for (std::int64_t r = 0; r < rows; ++r) out[r] = rowops::dot_row(a + r * lda, b + r * ldb, cols);
  }
  void l2norm_scale_backward_rows(std::int64_t rows, std::int64_t cols, const T* x, std::int64_t ldx, T* dy,
                                  std::int64_t ldy, T eps, T s) override {
    for (std::int64_t r = 0; r < rows; ++r) rowops::l2norm_scale_backward_row(x + r * ldx, dy + r * ldy, cols, eps, s);
  }
  void gdn_chunk_masks_backward(std::int64_t chunks, std::int64_t C, const T* gamma, const T* beta, const T* kk,
                                const T* qk, const T* dp, const T* da, T* dqk, T* dkk, T* dgamma, T* dbeta) override {
    for (std::int64_t c = 0; c < chunks; ++c) {
      const std::int64_t m = c * C * C;
      for (std::int64_t i = 0; i < C; ++i)
        rowops::gdn_masks_backward_row(i, C, gamma + c * C, beta + c * C, kk + m, qk + m, dp + m, da + m,
                                       dqk + m + i * C, dkk + m + i * C, dgamma + c * C + i, dbeta + c * C + i);
    }
  }
  void gdn_chunk_scales_backward(std::int64_t chunks, std::int64_t C, const T* gamma, const T* beta, const T* dqq,
                                 const T* dkbk, const T* dvbv, const T* dktk, const T* sds, T* dgamma,
                                 T* dbeta) override {
    for (std::int64_t c = 0; c < chunks; ++c) {
      const std::int64_t o = c * C;
      rowops::gdn_scales_backward(gamma + o, beta + o, C, dqq + o, dkbk + o, dvbv + o, dktk + o, sds[c], dgamma + o,
                                  dbeta + o);
    }
  }

  void short_conv_rows(std::int64_t rows, std::int64_t C, std::int64_t W, const T* xin, const std::int64_t* first,
                       const T* weight, bool silu, T* y) override {
    for (std::int64_t r = 0; r < rows; ++r) rowops::short_conv_row(xin + first[r] * C, C, W, weight, silu, y + r * C);
  }
  void short_conv_dpre_rows(std::int64_t rows, std::int64_t C, std::int64_t W, const T* xin, const std::int64_t* first,
                            const T* weight, bool silu, T* dy) override {
    for (std::int64_t r = 0; r < rows; ++r)
      rowops::short_conv_dpre_row(xin + first[r] * C, C, W, weight, silu, dy + r * C);
  }
  void short_conv_dx_rows(std::int64_t xrows, std::int64_t C, std::int64_t W, const T* dpre, const std::int64_t* src,
                          const T* weight, T* dxin) override {
    for (std::int64_t j = 0; j < xrows; ++j) rowops::short_conv_dx_row(dpre, src + j * W, C, W, weight, dxin + j * C);
  }
  void short_conv_dweight(std::int64_t rows, std::int64_t C, std::int64_t W, const T* dpre, const T* xin,
                          const std::int64_t* first, T* dweight) override {
    for (std::int64_t c = 0; c < C; ++c) rowops::short_conv_dweight_channel(c, rows, C, W, dpre, xin, first, dweight);
  }

  void gemm_fixed_order(Trans ta, Trans tb, std::int64_t m, std::int64_t n, std::int64_t k, T alpha, Mat<const T> a,
                        Mat<const T> b, T beta, Mat<T> c, Batch batch) override {
    if (m <= 0 || n <= 0) return;
    const std::int64_t sa_i = ta == Trans::kN ? a.ld : 1, sa_p = ta == Trans::kN ? 1 : a.ld;
    const std::int64_t sb_p = tb == Trans::kN ? b.ld : 1, sb_j = tb == Trans::kN ? 1 : b.ld;
    std::vector<T> panel(static_cast<std::size_t>(std::max<std::int64_t>(k, 1) * kFixedLanes));
    for (std::int64_t o = 0; o < batch.outer; ++o)
      for (std::int64_t e = 0; e < batch.inner; ++e)
        gemm_fixed_one(m, n, k, alpha, a.at(o, e), sa_i, sa_p, b.at(o, e), sb_p, sb_j, beta, c.at(o, e), c.ld,
                       panel.data());
  }
  void inverted_index(std::int64_t n_src, const std::int64_t* idx, std::int64_t n_dst, std::int64_t* offsets,
                      std::int64_t* list) override {
    std::fill(offsets, offsets + n_dst + 1, std::int64_t{0});
    for (std::int64_t r = 0; r < n_src; ++r)
      if (idx[r] >= 0 && idx[r] < n_dst) ++offsets[idx[r] + 1];
    for (std::int64_t d = 0; d < n_dst; ++d) offsets[d + 1] += offsets[d];
    std::vector<std::int64_t> next(offsets, offsets + n_dst);
    for (std::int64_t r = 0; r < n_src; ++r)  // ascending r: each list comes out ascending (a stable counting sort)
      if (idx[r] >= 0 && idx[r] < n_dst) list[next[static_cast<std::size_t>(idx[r])]++] = r;
  }
  void sum_rows_indexed(std::int64_t n_dst, std::int64_t cols, const T* src, std::int64_t ld_src,
                        const std::int64_t* offsets, const std::int64_t* list, T* dst, std::int64_t ld_dst) override {
    std::vector<T> acc(static_cast<std::size_t>(cols));
    for (std::int64_t d = 0; d < n_dst; ++d) {
      const std::int64_t b = offsets[d], e = offsets[d + 1];
      if (b == e) continue;
      std::copy(src + list[b] * ld_src, src + list[b] * ld_src + cols, acc.begin());
      for (std::int64_t i = b + 1; i < e; ++i)
        for (std::int64_t j = 0; j < cols; ++j) acc[j] += src[list[i] * ld_src + j];
      for (std::int64_t j = 0; j < cols; ++j) dst[d * ld_dst + j] += acc[j];
    }
  }
  void topk_merge_rows(std::int64_t rows, std::int64_t k, T* s_a, std::int64_t* p_a, const T* s_b,
                       const std::int64_t* p_b) override {
    std::vector<T> us(static_cast<std::size_t>(2 * k));
    std::vector<std::int64_t> up(static_cast<std::size_t>(2 * k)), col;
    for (std::int64_t r = 0; r < rows; ++r) {
      const std::int64_t n =
          rowops::topk_union_row(k, s_a + r * k, p_a + r * k, s_b + r * k, p_b + r * k, us.data(), up.data());
      col.resize(static_cast<std::size_t>(n));
      for (std::int64_t j = 0; j < n; ++j) col[j] = j;
      const std::int64_t take = std::min(k, n);
      std::partial_sort(col.begin(), col.begin() + take, col.end(), [&](std::int64_t x, std::int64_t y) {
        return rowops::topk_better(us[x], up[x], us[y], up[y]);
      });
      std::sort(col.begin(), col.begin() + take);  // column order is position order
      for (std::int64_t t = 0; t < k; ++t) {
        s_a[r * k + t] = t < take ? us[col[t]] : -std::numeric_limits<T>::infinity();
        p_a[r * k + t] = t < take ? up[col[t]] : -1;
      }
    }
  }
  void dsa_probs_rows(std::int64_t rows, std::int64_t n, T* s, std::int64_t ld, const std::int64_t* mask,
                      std::int64_t mask_div, const T* lse_hi, const T* lse_lo) override {
    for (std::int64_t r = 0; r < rows; ++r)
      rowops::dsa_probs_row(s + r * ld, n, mask + (r / mask_div) * n, lse_hi[r], lse_lo[r]);
  }
  void dsa_dscore_rows(std::int64_t rows, std::int64_t n, const T* p, T* dp, std::int64_t ld, const T* delta) override {
    for (std::int64_t r = 0; r < rows; ++r) rowops::dsa_dscore_row(p + r * ld, dp + r * ld, n, delta[r]);
  }
  void relu_head_sum_rows(std::int64_t queries, std::int64_t Hi, std::int64_t n, const T* s, const T* w,
                          T* out) override {
    for (std::int64_t q = 0; q < queries; ++q)
      rowops::relu_head_sum_row(s + q * Hi * n, n, Hi, n, w + q * Hi, out + q * n);
  }
  void indexer_grad_rows(std::int64_t queries, std::int64_t Hi, std::int64_t n, T* s, const T* w, const T* g,
                         T* dw) override {
    for (std::int64_t q = 0; q < queries; ++q)
      for (std::int64_t i = 0; i < Hi; ++i)
        dw[q * Hi + i] = rowops::indexer_grad_row(s + (q * Hi + i) * n, n, w[q * Hi + i], g + q * n);
  }
  void kl_rows(std::int64_t rows, std::int64_t k, const T* probs, const T* scores, const std::int64_t* idx,
               double grad_scale, T* dscores, double* loss) override {
    for (std::int64_t r = 0; r < rows; ++r)
      loss[r] = rowops::kl_row(probs + r * k, scores + r * k, idx + r * k, k, grad_scale,
                               dscores != nullptr ? dscores + r * k : nullptr);
  }
};

}  // namespace

Ops<float>& cpu_ops_f32() {
  static CpuOps<float> ops;
  return ops;
}
Ops<double>& cpu_ops_f64() {
  static CpuOps<double> ops;
  return ops;
}
bool cpu_ops_use_cblas() {
#if defined(SEQPAR_OPS_WITH_CBLAS)
  return true;
#else
  return false;
#endif
}

}  // namespace seqpar::attn::ops
