// Algebra of GDN segment maps S_end = M S_start + U (docs/design.md, "The gated delta recurrence"): composition,
// application, the adjoint used by a reverse scan, and the transpose. Per (batch, head) matrix products in the state
// dtype (fp32 or fp64) on the chunk kernels' products (gdn_gemm.h), OpenMP over (batch, head), fixed summation order.
#include <algorithm>
#include <cstdint>

#include "attention/cpu/gdn_cpu.h"
#include "attention/cpu/gdn_gemm.h"

namespace seqpar::attn::cpu {
namespace {

// c (+)= a b for row-major a [n, k], b [k, m] (gdn_gemm.h).
template <typename T>
void matmul(std::int64_t n, std::int64_t m, std::int64_t k, const T* a, const T* b, T* c, bool accumulate) {
  gdn::mm_nn<T>(n, m, k, T(1), a, k, b, m, c, m, accumulate);
}

// c (+)= a^T b for row-major a [k, n], b [k, m].
template <typename T>
void matmul_tn(std::int64_t n, std::int64_t m, std::int64_t k, const T* a, const T* b, T* c, bool accumulate) {
  gdn::mm_tn<T>(n, m, k, T(1), a, n, b, m, c, m, accumulate);
}

template <typename Fn>
void dispatch_state(DType dtype, Fn&& fn) {
  if (dtype == DType::kFloat64) {
    fn(double{});
  } else {
    fn(float{});
  }
}

// out = op(m) x (+ addend, when not empty) per (batch, head), op(m) = m or (kTranspose) m^T; addend may be out.
template <bool kTranspose>
void map_product(const TensorView& m, const TensorView& x, const TensorView& addend, const TensorView& out) {
  const std::int64_t BH = m.dim(0) * m.dim(1), K = m.dim(2), V = x.dim(3);
  dispatch_state(m.dtype(), [&](auto zero) {
    using T = decltype(zero);
    const T *pm = m.data_as<T>(), *px = x.data_as<T>();
    const T* pa = addend.empty() ? nullptr : addend.data_as<T>();
    T* po = out.data_as<T>();
#pragma omp parallel for schedule(static)
    for (std::int64_t bh = 0; bh < BH; ++bh) {
      T* o = po + bh * K * V;
      if (pa != nullptr && pa != po) std::copy(pa + bh * K * V, pa + (bh + 1) * K * V, o);
      if constexpr (kTranspose) {
        matmul_tn(K, V, K, pm + bh * K * K, px + bh * K * V, o, pa != nullptr);
      } else {
        matmul(K, V, K, pm + bh * K * K, px + bh * K * V, o, pa != nullptr);
      }
    }
  });
}

}  // namespace

void gdn_transition_compose_cpu(const TensorView& m2, const TensorView& u2, const TensorView& m1, const TensorView& u1,
                                const TensorView& m, const TensorView& u) {
  const std::int64_t BH = m2.dim(0) * m2.dim(1), K = m2.dim(2), V = u2.dim(3);
  dispatch_state(m2.dtype(), [&](auto zero) {
    using T = decltype(zero);
    const T *pm2 = m2.data_as<T>(), *pu2 = u2.data_as<T>(), *pm1 = m1.data_as<T>(), *pu1 = u1.data_as<T>();
    T *pm = m.data_as<T>(), *pu = u.data_as<T>();
#pragma omp parallel for schedule(static)
    for (std::int64_t bh = 0; bh < BH; ++bh) {
      matmul(K, K, K, pm2 + bh * K * K, pm1 + bh * K * K, pm + bh * K * K, false);
      std::copy(pu2 + bh * K * V, pu2 + (bh + 1) * K * V, pu + bh * K * V);
      matmul(K, V, K, pm2 + bh * K * K, pu1 + bh * K * V, pu + bh * K * V, true);
    }
  });
}

void gdn_transition_apply_cpu(const TensorView& m, const TensorView& u, const TensorView& s_start,
                              const TensorView& s_end) {
  map_product<false>(m, s_start, u, s_end);
}

void gdn_transition_apply_adjoint_cpu(const TensorView& m, const TensorView& ds_end, const TensorView& local,
                                      const TensorView& ds_start) {
  map_product<true>(m, ds_end, local, ds_start);
}

void gdn_transition_transpose_cpu(const TensorView& m, const TensorView& mt) {
  const std::int64_t BH = m.dim(0) * m.dim(1), K = m.dim(2);
  dispatch_state(m.dtype(), [&](auto zero) {
    using T = decltype(zero);
    const T* pm = m.data_as<T>();
    T* pt = mt.data_as<T>();
#pragma omp parallel for schedule(static)
    for (std::int64_t bh = 0; bh < BH; ++bh) {
      gdn::transpose(K, K, pm + bh * K * K, K, pt + bh * K * K, K);
    }
  });
}

}  // namespace seqpar::attn::cpu
