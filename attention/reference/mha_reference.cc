// Naive fp64 attention (docs/design.md, "MHA on one device"), written straight from the definitions with the mask
// tested on the global positions of every (query, key) pair, so that it shares no code path with the tiled kernels.
#include "attention/reference/mha_reference.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "attention/dropout.h"
#include "runtime/error.h"
#include "runtime/tensor_checks.h"

namespace seqpar::attn::reference {
namespace {

struct Dims {
  std::int64_t B, Sq, Sk, Hq, Hkv, D, group;
  double scale;
};

// Per-head value of a ScoreMods vector (fp32 / fp64 [Hq]), or `none` when the vector is empty.
double head_value(const TensorView& t, std::int64_t h, double none) {
  if (t.empty()) return none;
  return t.dtype() == DType::kFloat64 ? t.data_as<double>()[h] : static_cast<double>(t.data_as<float>()[h]);
}

Dims check(const MhaForwardArgs& a) {
  for (const TensorView* t : {&a.q, &a.k, &a.v}) {
    SEQPAR_CHECK(t->ndim() == 4, "reference: q, k, v must be 4-d, got ", t->str());
    check_dtype(*t, DType::kFloat64, "reference q / k / v");
  }
  Dims d{a.q.dim(0), a.q.dim(1), a.k.dim(1), a.q.dim(2), a.k.dim(2), a.q.dim(3), 0, 0.0};
  SEQPAR_CHECK(d.Hkv > 0 && d.Hq % d.Hkv == 0, "reference: Hq ", d.Hq, " not a multiple of Hkv ", d.Hkv);
  check_shape(a.k, {d.B, d.Sk, d.Hkv, d.D}, "reference k");
  check_shape(a.v, {d.B, d.Sk, d.Hkv, d.D}, "reference v");
  SEQPAR_CHECK(a.q_pos.empty() || static_cast<std::int64_t>(a.q_pos.size()) == d.Sq, "reference: q_pos size");
  SEQPAR_CHECK(a.k_pos.empty() || static_cast<std::int64_t>(a.k_pos.size()) == d.Sk, "reference: k_pos size");
  a.dropout.validate("reference");
  d.group = d.Hq / d.Hkv;
  d.scale = a.scale > 0.0f ? static_cast<double>(a.scale) : 1.0 / std::sqrt(static_cast<double>(d.D));
  return d;
}

bool visible(const MhaForwardArgs& a, std::int64_t i, std::int64_t j) {
  const std::int64_t qp = a.q_pos.empty() ? i : a.q_pos[static_cast<std::size_t>(i)];
  const std::int64_t kp = a.k_pos.empty() ? j : a.k_pos[static_cast<std::size_t>(j)];
  // documents: the key must lie in the query's own document, [doc_lo, doc_hi) (a padding query has none)
  if (!a.mask.doc_lo.empty()) {
    const std::size_t u = static_cast<std::size_t>(i);
    if (kp < a.mask.doc_lo[u] || kp >= a.mask.doc_hi[u]) return false;
  }
  if (!a.mask.causal) return true;
  if (kp > qp) return false;
  return a.mask.window <= 0 || qp - kp < a.mask.window;
}

// Dropout multiplier z_ij of (b, h) (attention/dropout.h): 1 without dropout, else keep / (1 - p), one
// dropout_keep call per pair on the global head and tokens (a key's token: its position moved by the query's
// token - position, MhaForwardArgs::q_tokens).
double dropout_z(const MhaForwardArgs& a, std::int64_t b, std::int64_t h, std::int64_t i, std::int64_t j) {
  if (a.dropout.p == 0.0) return 1.0;
  const std::int64_t qp = a.q_pos.empty() ? i : a.q_pos[static_cast<std::size_t>(i)];
  const std::int64_t kp = a.k_pos.empty() ? j : a.k_pos[static_cast<std::size_t>(j)];
  const std::int64_t qt = a.q_tokens.empty() ? qp : a.q_tokens[static_cast<std::size_t>(i)];
  if (qt < 0) return 0.0;  // a padding row sees no key
  return dropout_keep(a.dropout.seed, b, a.head_offset + h, qt, kp + qt - qp, a.dropout.p) ? 1.0 / (1.0 - a.dropout.p)
                                                                                          : 0.0;
}

// Probabilities p[i][j] (0 where masked) and lse[i] (with the sink) of one (b, h); dtanh[i][j] = d a_ij / d(scale
// q.k) (1 - tanh^2 with soft-capping, else 1).
void probabilities(const MhaForwardArgs& a, const Dims& d, std::int64_t b, std::int64_t h, std::vector<double>& p,
                   std::vector<double>& lse, std::vector<double>& dtanh) {
  const double* q = a.q.data_as<double>();
  const double* k = a.k.data_as<double>();
  const std::int64_t hk = h / d.group;
  p.assign(static_cast<std::size_t>(d.Sq * d.Sk), 0.0);
  dtanh.assign(static_cast<std::size_t>(d.Sq * d.Sk), 1.0);
  const double cap = a.mods.softcap, slope = head_value(a.mods.alibi_slopes, h, 0.0);
  const double sink = head_value(a.mods.sinks, h, -std::numeric_limits<double>::infinity());
  lse.assign(static_cast<std::size_t>(d.Sq), -std::numeric_limits<double>::infinity());
  std::vector<double> a_row(static_cast<std::size_t>(d.Sk));
  for (std::int64_t i = 0; i < d.Sq; ++i) {
    double mx = -std::numeric_limits<double>::infinity();
    for (std::int64_t j = 0; j < d.Sk; ++j) {
      if (!visible(a, i, j)) continue;
      double dot = 0.0;
      for (std::int64_t e = 0; e < d.D; ++e)
        dot += q[((b * d.Sq + i) * d.Hq + h) * d.D + e] * k[((b * d.Sk + j) * d.Hkv + hk) * d.D + e];
      a_row[j] = d.scale * dot;
      if (cap > 0.0) {
        a_row[j] = cap * std::tanh(a_row[j] / cap);
        dtanh[i * d.Sk + j] = 1.0 - std::pow(std::tanh(d.scale * dot / cap), 2);
      }
      const std::int64_t qp = a.q_pos.empty() ? i : a.q_pos[static_cast<std::size_t>(i)];
      const std::int64_t kp = a.k_pos.empty() ? j : a.k_pos[static_cast<std::size_t>(j)];
      a_row[j] -= slope * std::fabs(static_cast<double>(qp - kp));
      mx = std::max(mx, a_row[j]);
    }
    if (mx == -std::numeric_limits<double>::infinity() && sink == mx) continue;  // no visible key, no sink
    mx = std::max(mx, sink);
    double sum = std::exp(sink - mx);  // the sink: one more term of the denominator, without a value
    for (std::int64_t j = 0; j < d.Sk; ++j)
      if (visible(a, i, j)) sum += std::exp(a_row[j] - mx);
    lse[i] = mx + std::log(sum);
    for (std::int64_t j = 0; j < d.Sk; ++j)
      if (visible(a, i, j)) p[i * d.Sk + j] = std::exp(a_row[j] - lse[i]);
  }
}

}  // namespace

void mha_forward(const MhaForwardArgs& args, const TensorView& out, const TensorView& lse) {
  const Dims d = check(args);
  check_dtype(out, DType::kFloat64, "reference out");
  check_dtype(lse, DType::kFloat64, "reference lse");
  check_shape(out, args.q.shape(), "reference out");
  check_shape(lse, {d.B, d.Hq, d.Sq}, "reference lse");
  const double* v = args.v.data_as<double>();
  double* o = out.data_as<double>();
  double* l = lse.data_as<double>();
  std::vector<double> p, row_lse, dtanh, z(static_cast<std::size_t>(d.Sk));
  for (std::int64_t b = 0; b < d.B; ++b) {
    for (std::int64_t h = 0; h < d.Hq; ++h) {
      probabilities(args, d, b, h, p, row_lse, dtanh);
      const std::int64_t hk = h / d.group;
      for (std::int64_t i = 0; i < d.Sq; ++i) {
        l[(b * d.Hq + h) * d.Sq + i] = row_lse[i];
        for (std::int64_t j = 0; j < d.Sk; ++j) z[j] = dropout_z(args, b, h, i, j);
        for (std::int64_t e = 0; e < d.D; ++e) {
          double acc = 0.0;
          for (std::int64_t j = 0; j < d.Sk; ++j)
            acc += z[j] * p[i * d.Sk + j] * v[((b * d.Sk + j) * d.Hkv + hk) * d.D + e];
          o[((b * d.Sq + i) * d.Hq + h) * d.D + e] = acc;
        }
      }
    }
  }
}

void mha_backward(const MhaForwardArgs& args, const TensorView& dout, const TensorView& dq, const TensorView& dk,
                  const TensorView& dv, const TensorView& dsinks) {
  const Dims d = check(args);
  for (const TensorView* t : {&dout, &dq, &dk, &dv}) check_dtype(*t, DType::kFloat64, "reference dout / dq / dk / dv");
  check_shape(dout, args.q.shape(), "reference dout");
  check_shape(dq, args.q.shape(), "reference dq");
  check_shape(dk, args.k.shape(), "reference dk");
  check_shape(dv, args.k.shape(), "reference dv");
  const double* q = args.q.data_as<double>();
  const double* k = args.k.data_as<double>();
  const double* v = args.v.data_as<double>();
  const double* go = dout.data_as<double>();
  double* gq = dq.data_as<double>();
  double* gk = dk.data_as<double>();
  double* gv = dv.data_as<double>();
  std::fill(gq, gq + dq.numel(), 0.0);
  std::fill(gk, gk + dk.numel(), 0.0);
  std::fill(gv, gv + dv.numel(), 0.0);
  const bool sinks = !args.mods.sinks.empty();
  SEQPAR_CHECK(sinks == !dsinks.empty(), "reference: dsinks must be given exactly when sinks are");
  if (sinks) {
    check_dtype(dsinks, DType::kFloat64, "reference dsinks");
    check_shape(dsinks, {d.Hq}, "reference dsinks");
    std::fill(dsinks.data_as<double>(), dsinks.data_as<double>() + d.Hq, 0.0);
  }
  std::vector<double> p, row_lse, dtanh, dp(static_cast<std::size_t>(d.Sk)), z(static_cast<std::size_t>(d.Sk));
  for (std::int64_t b = 0; b < d.B; ++b) {
    for (std::int64_t h = 0; h < d.Hq; ++h) {
      probabilities(args, d, b, h, p, row_lse, dtanh);
      const std::int64_t hk = h / d.group;
      auto qi = [&](std::int64_t i) { return ((b * d.Sq + i) * d.Hq + h) * d.D; };
      auto kj = [&](std::int64_t j) { return ((b * d.Sk + j) * d.Hkv + hk) * d.D; };
      for (std::int64_t i = 0; i < d.Sq; ++i) {
        // dp_ij = z_ij dO_i . v_j (the gradient with respect to p_ij, o_i = sum_j z_ij p_ij v_j); softmax
        // Jacobian: ds_ij = p_ij (dp_ij - sum_l p_il dp_il)
        double rowdot = 0.0;
        for (std::int64_t j = 0; j < d.Sk; ++j) {
          double acc = 0.0;
          for (std::int64_t e = 0; e < d.D; ++e) acc += go[qi(i) + e] * v[kj(j) + e];
          z[j] = dropout_z(args, b, h, i, j);
          dp[j] = z[j] * acc;
          rowdot += p[i * d.Sk + j] * dp[j];
        }
        // the sink's probability exp(sink - lse) has dp = 0 (no value): d lse / d sink = p_sink, so
        // d loss / d sink = sum_j p_ij (dp_ij - rowdot) d a_ij / d sink = -p_sink rowdot
        if (sinks && row_lse[i] != -std::numeric_limits<double>::infinity())
          dsinks.data_as<double>()[h] -= std::exp(head_value(args.mods.sinks, h, 0.0) - row_lse[i]) * rowdot;
        for (std::int64_t j = 0; j < d.Sk; ++j) {
          const double pij = p[i * d.Sk + j];
          if (pij == 0.0) continue;
          const double ds = pij * (dp[j] - rowdot) * dtanh[i * d.Sk + j];
          for (std::int64_t e = 0; e < d.D; ++e) {
            gv[kj(j) + e] += z[j] * pij * go[qi(i) + e];
            gq[qi(i) + e] += d.scale * ds * k[kj(j) + e];
            gk[kj(j) + e] += d.scale * ds * q[qi(i) + e];
          }
        }
      }
    }
  }
}

}  // namespace seqpar::attn::reference
