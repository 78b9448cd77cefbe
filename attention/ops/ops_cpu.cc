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
