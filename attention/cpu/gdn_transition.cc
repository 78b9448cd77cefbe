// Algebra of GDN segment maps S_end = M S_start + U (DESIGN.md section 6): composition, application, the adjoint
// used by a reverse scan, and the transpose. Per (batch, head) matrix products in the state dtype (fp32 or fp64),
// OpenMP over (batch, head), fixed summation order.
#include <algorithm>
#include <cstdint>

#include "attention/gdn.h"
#include "runtime/error.h"

namespace seqpar::attn {
namespace {

struct MapDims {
  std::int64_t BH = 0, K = 0, V = 0;
};

void check_map_matrix(const TensorView& m, const char* what) {
  check_cpu(m, what);
  SEQPAR_CHECK(m.ndim() == 4 && m.dim(2) == m.dim(3), "gdn: ", what, " must be [B, H, K, K], got ",
               shape_str(m.shape()));
  SEQPAR_CHECK(m.dtype() == DType::kFloat32 || m.dtype() == DType::kFloat64, "gdn: ", what,
               " must be fp32 or fp64 (the state dtype), got ", dtype_name(m.dtype()));
}

// Checks that `t` is [B, H, K, *] with m's B, H, K and dtype, and the given last dim (< 0: any).
void check_like(const TensorView& t, const TensorView& m, std::int64_t last, const char* what) {
  check_cpu(t, what);
  SEQPAR_CHECK(t.ndim() == 4, "gdn: ", what, " must be 4-d [B, H, K, *], got ", shape_str(t.shape()));
  check_shape(t, {m.dim(0), m.dim(1), m.dim(2), last < 0 ? t.dim(3) : last}, what);
  check_dtype(t, m.dtype(), what);
}

// c (+)= a b for row-major a [n, k], b [k, m].
template <typename T>
void matmul(std::int64_t n, std::int64_t m, std::int64_t k, const T* a, const T* b, T* c, bool accumulate) {
  for (std::int64_t i = 0; i < n; ++i) {
    T* ci = c + i * m;
    if (!accumulate) std::fill(ci, ci + m, T(0));
    for (std::int64_t p = 0; p < k; ++p) {
      const T aip = a[i * k + p];
      const T* bp = b + p * m;
      for (std::int64_t j = 0; j < m; ++j) ci[j] += aip * bp[j];
    }
  }
}

// c (+)= a^T b for row-major a [k, n], b [k, m].
template <typename T>
void matmul_tn(std::int64_t n, std::int64_t m, std::int64_t k, const T* a, const T* b, T* c, bool accumulate) {
  if (!accumulate) std::fill(c, c + n * m, T(0));
  for (std::int64_t p = 0; p < k; ++p) {
    for (std::int64_t i = 0; i < n; ++i) {
      const T api = a[p * n + i];
      T* ci = c + i * m;
      const T* bp = b + p * m;
      for (std::int64_t j = 0; j < m; ++j) ci[j] += api * bp[j];
    }
  }
}

template <typename Fn>
void dispatch_state(DType dtype, Fn&& fn) {
  if (dtype == DType::kFloat64) {
    fn(double{});
  } else {
    fn(float{});
  }
}

}  // namespace

void gdn_transition_compose(const TensorView& m2, const TensorView& u2, const TensorView& m1, const TensorView& u1,
                            const TensorView& m, const TensorView& u, Stream stream) {
  check_map_matrix(m2, "m2");
  check_like(m1, m2, m2.dim(2), "m1");
  check_like(m, m2, m2.dim(2), "m");
  check_like(u2, m2, -1, "u2");
  check_like(u1, m2, u2.dim(3), "u1");
  check_like(u, m2, u2.dim(3), "u");
  SEQPAR_CHECK(m.data() != m1.data() && m.data() != m2.data() && u.data() != u1.data() && u.data() != u2.data(),
               "gdn_transition_compose: outputs may not alias inputs");
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

void gdn_transition_apply(const TensorView& m, const TensorView& u, const TensorView& s_start, const TensorView& s_end,
                          Stream stream) {
  check_map_matrix(m, "m");
  check_like(s_start, m, -1, "s_start");
  check_like(s_end, m, s_start.dim(3), "s_end");
  if (!u.empty()) check_like(u, m, s_start.dim(3), "u");
  SEQPAR_CHECK(s_end.data() != s_start.data(), "gdn_transition_apply: s_end may not alias s_start");
  const std::int64_t BH = m.dim(0) * m.dim(1), K = m.dim(2), V = s_start.dim(3);
  dispatch_state(m.dtype(), [&](auto zero) {
    using T = decltype(zero);
    const T *pm = m.data_as<T>(), *ps = s_start.data_as<T>();
    const T* pu = u.empty() ? nullptr : u.data_as<T>();
    T* pe = s_end.data_as<T>();
#pragma omp parallel for schedule(static)
    for (std::int64_t bh = 0; bh < BH; ++bh) {
      T* e = pe + bh * K * V;
      if (pu != nullptr && pu != e) std::copy(pu + bh * K * V, pu + (bh + 1) * K * V, e);
      matmul(K, V, K, pm + bh * K * K, ps + bh * K * V, e, pu != nullptr);
    }
  });
}

void gdn_transition_apply_adjoint(const TensorView& m, const TensorView& ds_end, const TensorView& local,
                                  const TensorView& ds_start, Stream stream) {
  check_map_matrix(m, "m");
  check_like(ds_end, m, -1, "ds_end");
  check_like(ds_start, m, ds_end.dim(3), "ds_start");
  if (!local.empty()) check_like(local, m, ds_end.dim(3), "local");
  SEQPAR_CHECK(ds_start.data() != ds_end.data(), "gdn_transition_apply_adjoint: ds_start may not alias ds_end");
  const std::int64_t BH = m.dim(0) * m.dim(1), K = m.dim(2), V = ds_end.dim(3);
  dispatch_state(m.dtype(), [&](auto zero) {
    using T = decltype(zero);
    const T *pm = m.data_as<T>(), *pd = ds_end.data_as<T>();
    const T* pl = local.empty() ? nullptr : local.data_as<T>();
    T* ps = ds_start.data_as<T>();
#pragma omp parallel for schedule(static)
    for (std::int64_t bh = 0; bh < BH; ++bh) {
      T* s = ps + bh * K * V;
      if (pl != nullptr && pl != ps) std::copy(pl + bh * K * V, pl + (bh + 1) * K * V, s);
      matmul_tn(K, V, K, pm + bh * K * K, pd + bh * K * V, s, pl != nullptr);
    }
  });
}

void gdn_transition_transpose(const TensorView& m, const TensorView& mt, Stream stream) {
  check_map_matrix(m, "m");
  check_like(mt, m, m.dim(2), "mt");
  SEQPAR_CHECK(mt.data() != m.data(), "gdn_transition_transpose: mt may not alias m");
  const std::int64_t BH = m.dim(0) * m.dim(1), K = m.dim(2);
  dispatch_state(m.dtype(), [&](auto zero) {
    using T = decltype(zero);
    const T* pm = m.data_as<T>();
    T* pt = mt.data_as<T>();
#pragma omp parallel for schedule(static)
    for (std::int64_t bh = 0; bh < BH; ++bh) {
      for (std::int64_t i = 0; i < K; ++i) {
        for (std::int64_t j = 0; j < K; ++j) pt[bh * K * K + j * K + i] = pm[bh * K * K + i * K + j];
      }
    }
  });
}

}  // namespace seqpar::attn
