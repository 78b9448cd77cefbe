// fp64 references for attention/gdn.h (tests only): token-by-token gated delta rule with its reverse mode, and the
// direct short causal conv with its gradients. Written for clarity, not speed.
#include "attention/reference/gdn_reference.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "runtime/error.h"

namespace seqpar::attn::reference {
namespace {

using Vec = std::vector<double>;

void check_f64(const TensorView& t, const char* what) {
  SEQPAR_CHECK(t.dtype() == DType::kFloat64, "gdn reference: ", what, " must be fp64, got ", dtype_name(t.dtype()));
}

const double* f64(const TensorView& t) { return t.data_as<double>(); }
double* f64w(const TensorView& t) { return t.data_as<double>(); }

// H value heads, Hk key heads: value head h reads q and k of key head h / (H / Hk).
struct Dims {
  std::int64_t B, S, H, Hk, K, V;
  // Element offset of token t's q or k row for value head h of batch b.
  std::int64_t qk_row(std::int64_t b, std::int64_t t, std::int64_t h) const {
    return ((b * S + t) * Hk + h / (H / Hk)) * K;
  }
};

Dims dims_of(const GdnForwardArgs& a) {
  for (const TensorView* t : {&a.q, &a.k, &a.v, &a.g, &a.beta}) check_f64(*t, "input");
  const Dims d{a.q.dim(0), a.q.dim(1), a.v.dim(2), a.q.dim(2), a.q.dim(3), a.v.dim(3)};
  SEQPAR_CHECK(d.Hk >= 1 && d.H % d.Hk == 0, "gdn reference: value heads ", d.H, " must be a multiple of key heads ",
               d.Hk);
  return d;
}

double dotp(const double* a, const double* b, std::int64_t n) {
  double s = 0;
  for (std::int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// y = x / sqrt(|x|^2 + eps) (or x), times s; returns 1 / sqrt(|x|^2 + eps) (or 1).
double normalise(const double* x, std::int64_t n, bool l2, double s, double* y) {
  const double r = l2 ? 1.0 / std::sqrt(dotp(x, x, n) + kGdnL2NormEps) : 1.0;
  for (std::int64_t i = 0; i < n; ++i) y[i] = s * r * x[i];
  return r;
}

// Inverse of normalise for gradients: given dy for y = s * x * r, returns dx (yn = x * r).
void normalise_backward(const double* x, std::int64_t n, bool l2, double s, const double* dy, double* dx) {
  if (!l2) {
    for (std::int64_t i = 0; i < n; ++i) dx[i] = s * dy[i];
    return;
  }
  const double r = 1.0 / std::sqrt(dotp(x, x, n) + kGdnL2NormEps);
  double yd = 0;
  for (std::int64_t i = 0; i < n; ++i) yd += x[i] * r * s * dy[i];
  for (std::int64_t i = 0; i < n; ++i) dx[i] = (s * dy[i] - x[i] * r * yd) * r;
}

// One independent sequence: tokens [begin, end) of batch row b, starting from state row `state` of the state
// tensors. Unpacked: one per batch row ({b, 0, S, b}); packed (cu_seqlens, B = 1): one per document.
struct Run {
  std::int64_t b, begin, end, state;
};

std::vector<Run> runs_of(const TensorView& cu_seqlens, std::int64_t B, std::int64_t S) {
  std::vector<Run> runs;
  if (cu_seqlens.empty()) {
    for (std::int64_t b = 0; b < B; ++b) runs.push_back({b, 0, S, b});
    return runs;
  }
  SEQPAR_CHECK(B == 1, "gdn reference: a packed row must have B = 1, got ", B);
  const std::int64_t* cu = cu_seqlens.data_as<std::int64_t>();
  for (std::int64_t i = 0; i + 1 < cu_seqlens.numel(); ++i) runs.push_back({0, cu[i], cu[i + 1], i});
  SEQPAR_CHECK(cu[0] == 0 && cu[cu_seqlens.numel() - 1] == S, "gdn reference: cu_seqlens must run from 0 to ", S);
  return runs;
}

double scale_of(const GdnForwardArgs& a, std::int64_t K) {
  return a.scale > 0.0f ? static_cast<double>(a.scale) : 1.0 / std::sqrt(static_cast<double>(K));
}

}  // namespace

void gdn_forward(const GdnForwardArgs& a, const TensorView& out, const TensorView& final_state) {
  const Dims d = dims_of(a);
  const double scale = scale_of(a, d.K);
  const std::int64_t K = d.K, V = d.V;
  Vec s(K * V), q(K), k(K), u(V);
  for (const Run& run : runs_of(a.cu_seqlens, d.B, d.S)) {
    const std::int64_t b = run.b;
    for (std::int64_t h = 0; h < d.H; ++h) {
      const std::int64_t bh = run.state * d.H + h;  // state row
      if (a.initial_state.empty()) {
        std::fill(s.begin(), s.end(), 0.0);
      } else {
        std::copy(f64(a.initial_state) + bh * K * V, f64(a.initial_state) + (bh + 1) * K * V, s.begin());
      }
      for (std::int64_t t = run.begin; t < run.end; ++t) {
        const std::int64_t tok = (b * d.S + t) * d.H + h;
        normalise(f64(a.q) + d.qk_row(b, t, h), K, a.use_qk_l2norm, scale, q.data());
        normalise(f64(a.k) + d.qk_row(b, t, h), K, a.use_qk_l2norm, 1.0, k.data());
        const double* v = f64(a.v) + tok * V;
        const double lam = std::exp(f64(a.g)[tok]), bt = f64(a.beta)[tok];
        for (std::int64_t j = 0; j < V; ++j) {
          u[j] = 0;
          for (std::int64_t i = 0; i < K; ++i) u[j] += k[i] * s[i * V + j];
        }
        for (std::int64_t i = 0; i < K; ++i) {
          for (std::int64_t j = 0; j < V; ++j) {
            s[i * V + j] = lam * (s[i * V + j] - bt * k[i] * u[j]) + bt * k[i] * v[j];
          }
        }
        double* o = f64w(out) + tok * V;
        for (std::int64_t j = 0; j < V; ++j) {
          o[j] = 0;
          for (std::int64_t i = 0; i < K; ++i) o[j] += s[i * V + j] * q[i];
        }
      }
      if (!final_state.empty()) std::copy(s.begin(), s.end(), f64w(final_state) + bh * K * V);
    }
  }
}

void gdn_backward(const GdnBackwardArgs& args, const TensorView& dq_out, const TensorView& dk_out,
                  const TensorView& dv_out, const TensorView& dg_out, const TensorView& dbeta_out,
                  const TensorView& dinit_out) {
  const GdnForwardArgs& a = args.fwd;
  const Dims d = dims_of(a);
  const double scale = scale_of(a, d.K);
  const std::int64_t K = d.K, V = d.V, KV = K * V;
  Vec states((d.S + 1) * KV), ds(KV), dp(KV), q(K), k(K), u(V), dq(K), dk(K), dx(K), dpu(V), dptk(V);
  for (const TensorView* t : {&dq_out, &dk_out}) {
    if (!t->empty()) std::fill(f64w(*t), f64w(*t) + t->numel(), 0.0);
  }
  for (const Run& run : runs_of(a.cu_seqlens, d.B, d.S)) {
    const std::int64_t b = run.b;
    for (std::int64_t h = 0; h < d.H; ++h) {
      const std::int64_t bh = run.state * d.H + h;  // state row
      // Forward, keeping the run's states: states[t - begin] = S_{t-1}.
      if (a.initial_state.empty()) {
        std::fill(states.begin(), states.begin() + KV, 0.0);
      } else {
        std::copy(f64(a.initial_state) + bh * KV, f64(a.initial_state) + (bh + 1) * KV, states.begin());
      }
      for (std::int64_t t = run.begin; t < run.end; ++t) {
        const std::int64_t tok = (b * d.S + t) * d.H + h;
        normalise(f64(a.k) + d.qk_row(b, t, h), K, a.use_qk_l2norm, 1.0, k.data());
        const double* v = f64(a.v) + tok * V;
        const double lam = std::exp(f64(a.g)[tok]), bt = f64(a.beta)[tok];
        const double* sp = states.data() + (t - run.begin) * KV;
        double* sn = states.data() + (t - run.begin + 1) * KV;
        for (std::int64_t j = 0; j < V; ++j) {
          u[j] = 0;
          for (std::int64_t i = 0; i < K; ++i) u[j] += k[i] * sp[i * V + j];
        }
        for (std::int64_t i = 0; i < K; ++i) {
          for (std::int64_t j = 0; j < V; ++j)
            sn[i * V + j] = lam * (sp[i * V + j] - bt * k[i] * u[j]) + bt * k[i] * v[j];
        }
      }
      // Reverse.
      if (args.dfinal_state.empty()) {
        std::fill(ds.begin(), ds.end(), 0.0);
      } else {
        std::copy(f64(args.dfinal_state) + bh * KV, f64(args.dfinal_state) + (bh + 1) * KV, ds.begin());
      }
      for (std::int64_t t = run.end - 1; t >= run.begin; --t) {
        const std::int64_t tok = (b * d.S + t) * d.H + h;
        const std::int64_t qk = d.qk_row(b, t, h);
        normalise(f64(a.q) + qk, K, a.use_qk_l2norm, scale, q.data());
        normalise(f64(a.k) + qk, K, a.use_qk_l2norm, 1.0, k.data());
        const double* v = f64(a.v) + tok * V;
        const double* dout = args.dout.empty() ? nullptr : f64(args.dout) + tok * V;
        const double lam = std::exp(f64(a.g)[tok]), bt = f64(a.beta)[tok];
        const double* sp = states.data() + (t - run.begin) * KV;      // S_{t-1}
        const double* sn = states.data() + (t - run.begin + 1) * KV;  // S_t
        // o_t = S_t^T q_t: dS_t += q_t do_t^T, dq_t = S_t do_t.
        for (std::int64_t i = 0; i < K; ++i) {
          dq[i] = 0;
          for (std::int64_t j = 0; j < V; ++j) {
            const double doj = dout ? dout[j] : 0.0;
            ds[i * V + j] += q[i] * doj;
            dq[i] += sn[i * V + j] * doj;
          }
        }
        // S_t = lam P + beta k v^T with P = S_{t-1} - beta k u^T, u = S_{t-1}^T k.
        for (std::int64_t j = 0; j < V; ++j) {
          u[j] = 0;
          for (std::int64_t i = 0; i < K; ++i) u[j] += k[i] * sp[i * V + j];
        }
        double dlam = 0, dbeta = 0;
        for (std::int64_t i = 0; i < K; ++i) {
          for (std::int64_t j = 0; j < V; ++j) {
            const double p = sp[i * V + j] - bt * k[i] * u[j];
            dlam += ds[i * V + j] * p;
            dp[i * V + j] = lam * ds[i * V + j];
            dbeta += k[i] * (ds[i * V + j] * v[j] - dp[i * V + j] * u[j]);
          }
        }
        // dpu = dP u (as K), dptk = dP^T k (as V).
        for (std::int64_t j = 0; j < V; ++j) {
          dptk[j] = 0;
          for (std::int64_t i = 0; i < K; ++i) dptk[j] += dp[i * V + j] * k[i];
        }
        for (std::int64_t i = 0; i < K; ++i) {
          double dsv = 0, dpuu = 0, sdp = 0;
          for (std::int64_t j = 0; j < V; ++j) {
            dsv += ds[i * V + j] * v[j];
            dpuu += dp[i * V + j] * u[j];
            sdp += sp[i * V + j] * dptk[j];
          }
          dk[i] = bt * dsv - bt * (dpuu + sdp);
        }
        if (!dv_out.empty()) {
          double* dv = f64w(dv_out) + tok * V;
          for (std::int64_t j = 0; j < V; ++j) {
            dv[j] = 0;
            for (std::int64_t i = 0; i < K; ++i) dv[j] += bt * ds[i * V + j] * k[i];
          }
        }
        if (!dg_out.empty()) f64w(dg_out)[tok] = lam * dlam;
        if (!dbeta_out.empty()) f64w(dbeta_out)[tok] = dbeta;
        // q and k of a key head are shared by its value heads: their gradients add up.
        if (!dq_out.empty()) {
          normalise_backward(f64(a.q) + qk, K, a.use_qk_l2norm, scale, dq.data(), dx.data());
          for (std::int64_t i = 0; i < K; ++i) f64w(dq_out)[qk + i] += dx[i];
        }
        if (!dk_out.empty()) {
          normalise_backward(f64(a.k) + qk, K, a.use_qk_l2norm, 1.0, dk.data(), dx.data());
          for (std::int64_t i = 0; i < K; ++i) f64w(dk_out)[qk + i] += dx[i];
        }
        // dS_{t-1} = (I - beta k k^T) dP.
        for (std::int64_t i = 0; i < K; ++i) {
          for (std::int64_t j = 0; j < V; ++j) ds[i * V + j] = dp[i * V + j] - bt * k[i] * dptk[j];
        }
      }
      if (!dinit_out.empty()) std::copy(ds.begin(), ds.end(), f64w(dinit_out) + bh * KV);
    }
  }
}

void short_conv_forward(const ShortConvArgs& a, const TensorView& out, const TensorView& final_conv_state) {
  check_f64(a.x, "x");
  const std::int64_t B = a.x.dim(0), S = a.x.dim(1), C = a.x.dim(2), W = a.weight.dim(1);
  const double* x = f64(a.x);
  const double* w = f64(a.weight);
  // xin of run r at token t (t >= r.begin - (W-1)): the run's own tokens, else its conv state (or 0).
  auto xin = [&](const Run& r, std::int64_t t, std::int64_t c) -> double {
    if (t >= r.begin) return x[(r.b * S + t) * C + c];
    if (a.initial_conv_state.empty()) return 0.0;
    return f64(a.initial_conv_state)[(r.state * (W - 1) + t - r.begin + W - 1) * C + c];
  };
  for (const Run& r : runs_of(a.cu_seqlens, B, S)) {
    for (std::int64_t t = r.begin; t < r.end; ++t) {
      for (std::int64_t c = 0; c < C; ++c) {
        double y = 0;
        for (std::int64_t j = 0; j < W; ++j) y += w[c * W + j] * xin(r, t - (W - 1) + j, c);
        f64w(out)[(r.b * S + t) * C + c] = a.use_silu ? y / (1.0 + std::exp(-y)) : y;
      }
    }
    if (!final_conv_state.empty()) {
      for (std::int64_t i = 0; i < W - 1; ++i) {
        for (std::int64_t c = 0; c < C; ++c)
          f64w(final_conv_state)[(r.state * (W - 1) + i) * C + c] = xin(r, r.end - (W - 1) + i, c);
      }
    }
  }
}

void short_conv_backward(const ShortConvArgs& a, const TensorView& dout, const TensorView& dx,
                         const TensorView& dweight, const TensorView& dinit) {
  check_f64(a.x, "x");
  const std::int64_t B = a.x.dim(0), S = a.x.dim(1), C = a.x.dim(2), W = a.weight.dim(1);
  const double* x = f64(a.x);
  const double* w = f64(a.weight);
  const bool has_init = !a.initial_conv_state.empty();
  auto xin = [&](const Run& r, std::int64_t t, std::int64_t c) -> double {
    if (t >= r.begin) return x[(r.b * S + t) * C + c];
    if (!has_init) return 0.0;
    return f64(a.initial_conv_state)[(r.state * (W - 1) + t - r.begin + W - 1) * C + c];
  };
  const std::vector<Run> runs = runs_of(a.cu_seqlens, B, S);
  Vec gx(B * S * C, 0.0), gw(C * W, 0.0), gi(runs.size() * std::max<std::int64_t>(W - 1, 0) * C, 0.0);
  for (const Run& r : runs) {
    for (std::int64_t t = r.begin; t < r.end; ++t) {
      for (std::int64_t c = 0; c < C; ++c) {
        double y = 0;
        for (std::int64_t j = 0; j < W; ++j) y += w[c * W + j] * xin(r, t - (W - 1) + j, c);
        double dy = f64(dout)[(r.b * S + t) * C + c];
        if (a.use_silu) {
          const double sg = 1.0 / (1.0 + std::exp(-y));
          dy *= sg * (1.0 + y * (1.0 - sg));
        }
        for (std::int64_t j = 0; j < W; ++j) {
          const std::int64_t tt = t - (W - 1) + j;
          gw[c * W + j] += dy * xin(r, tt, c);
          if (tt >= r.begin) {
            gx[(r.b * S + tt) * C + c] += w[c * W + j] * dy;
          } else {
            gi[(r.state * (W - 1) + tt - r.begin + W - 1) * C + c] += w[c * W + j] * dy;
          }
        }
      }
    }
  }
  if (!dx.empty()) std::copy(gx.begin(), gx.end(), f64w(dx));
  if (!dweight.empty()) std::copy(gw.begin(), gw.end(), f64w(dweight));
  if (!dinit.empty()) std::copy(gi.begin(), gi.end(), f64w(dinit));
}

}  // namespace seqpar::attn::reference
