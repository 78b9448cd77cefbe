#include "attention/reference/dsa_reference.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <span>
#include <vector>

#include "runtime/error.h"
#include "runtime/tensor_checks.h"

namespace seqpar::attn::reference {
namespace {

constexpr double kNegInf = -std::numeric_limits<double>::infinity();

std::vector<std::int64_t> pos_or_iota(std::span<const std::int64_t> pos, std::int64_t n) {
  std::vector<std::int64_t> out(static_cast<std::size_t>(n));
  if (pos.empty()) {
    std::iota(out.begin(), out.end(), std::int64_t{0});
  } else {
    SEQPAR_CHECK(static_cast<std::int64_t>(pos.size()) == n, "reference: ", pos.size(), " positions for ", n, " rows");
    std::copy(pos.begin(), pos.end(), out.begin());
  }
  return out;
}

const double* f64(const TensorView& t, const char* what) {
  check_dtype(t, DType::kFloat64, what);
  return static_cast<const double*>(t.data());
}
double* f64w(const TensorView& t, const char* what) {
  check_dtype(t, DType::kFloat64, what);
  return static_cast<double*>(t.data());
}

struct Idx {
  std::int64_t B, Sq, Hi, Di, Sk;
  std::vector<std::int64_t> qp, kp;
  const double *q, *w, *k;
  std::int64_t window = 0;
  std::span<const std::int64_t> doc_lo{}, doc_hi{};
  // Key j is a candidate of query t: causal, inside the window when there is one, and inside the query's document
  // [doc_lo, doc_hi) when there are document bounds (a padding query, lo >= hi, has no candidate).
  bool candidate(std::int64_t t, std::int64_t j) const {
    if (!doc_lo.empty() && (kp[j] < doc_lo[t] || kp[j] >= doc_hi[t])) return false;
    return kp[j] <= qp[t] && (window <= 0 || qp[t] - kp[j] < window);
  }
};
Idx unpack(const DsaIndexerArgs& a) {
  Idx s{a.q_idx.dim(0), a.q_idx.dim(1), a.q_idx.dim(2), a.q_idx.dim(3), a.k_idx.dim(1), {}, {}, {}, {}, {}};
  check_shape(a.w, {s.B, s.Sq, s.Hi}, "w");
  check_shape(a.k_idx, {s.B, s.Sk, s.Di}, "k_idx");
  s.qp = pos_or_iota(a.q_pos, s.Sq);
  s.kp = pos_or_iota(a.k_pos, s.Sk);
  s.q = f64(a.q_idx, "q_idx");
  s.w = f64(a.w, "w");
  s.k = f64(a.k_idx, "k_idx");
  s.window = a.window;
  SEQPAR_CHECK(a.doc_lo.size() == a.doc_hi.size() && (a.doc_lo.empty() || std::ssize(a.doc_lo) == s.Sq),
               "doc_lo / doc_hi must both be empty or both have Sq entries");
  s.doc_lo = a.doc_lo;
  s.doc_hi = a.doc_hi;
  return s;
}

// s_tij = q_idx_ti . k_idx_j
double index_dot(const Idx& s, std::int64_t b, std::int64_t t, std::int64_t i, std::int64_t j) {
  const double* q = s.q + ((b * s.Sq + t) * s.Hi + i) * s.Di;
  const double* k = s.k + (b * s.Sk + j) * s.Di;
  double acc = 0.0;
  for (std::int64_t d = 0; d < s.Di; ++d) acc += q[d] * k[d];
  return acc;
}

double index_score(const Idx& s, std::int64_t b, std::int64_t t, std::int64_t j) {
  double acc = 0.0;
  for (std::int64_t i = 0; i < s.Hi; ++i)
    acc += s.w[(b * s.Sq + t) * s.Hi + i] * std::max(0.0, index_dot(s, b, t, i, j));
  return acc;
}

struct Attn {
  std::int64_t B, Sq, H, Dqk, Dv, Sk, K;
  double scale;
  std::vector<std::int64_t> qp, cp;
  const double *q, *c;
  const std::int64_t* topk;
};
Attn unpack(const DsaAttentionArgs& a) {
  Attn s{a.q.dim(0), a.q.dim(1), a.q.dim(2), a.q.dim(3), a.dim_v, a.c.dim(1), a.topk_indices.dim(2),
         0.0,        {},         {},         {},         {},      {}};
  check_shape(a.c, {s.B, s.Sk, s.Dqk}, "c");
  check_dtype(a.topk_indices, DType::kInt64, "topk_indices");
  check_shape(a.topk_indices, {s.B, s.Sq, s.K}, "topk_indices");
  s.scale = a.scale > 0.0f ? static_cast<double>(a.scale) : 1.0 / std::sqrt(static_cast<double>(s.Dqk));
  s.qp = pos_or_iota(a.q_pos, s.Sq);
  s.cp = pos_or_iota(a.c_pos, s.Sk);
  s.q = f64(a.q, "q");
  s.c = f64(a.c, "c");
  s.topk = static_cast<const std::int64_t*>(a.topk_indices.data());
  return s;
}

// mask[j]: key j is visible to query t and selected by row (b, t).
std::vector<char> selected_mask(const Attn& s, std::int64_t b, std::int64_t t) {
  std::vector<char> mask(static_cast<std::size_t>(s.Sk), 0);
  const std::int64_t* row = s.topk + (b * s.Sq + t) * s.K;
  for (std::int64_t j = 0; j < s.Sk; ++j) {
    if (s.cp[j] > s.qp[t]) continue;
    for (std::int64_t e = 0; e < s.K; ++e) {
      if (row[e] == s.cp[j]) mask[j] = 1;
    }
  }
  return mask;
}

// Dense scores a_hj (masked to -inf) and the softmax P_hj for one query row; lse per head.
void attention_row(const Attn& s, std::int64_t b, std::int64_t t, std::vector<double>& p, std::vector<double>& lse) {
  const std::vector<char> mask = selected_mask(s, b, t);
  p.assign(static_cast<std::size_t>(s.H * s.Sk), 0.0);
  lse.assign(static_cast<std::size_t>(s.H), kNegInf);
  for (std::int64_t h = 0; h < s.H; ++h) {
    const double* qh = s.q + ((b * s.Sq + t) * s.H + h) * s.Dqk;
    std::vector<double> a(static_cast<std::size_t>(s.Sk), kNegInf);
    double mx = kNegInf;
    for (std::int64_t j = 0; j < s.Sk; ++j) {
      if (!mask[j]) continue;
      double acc = 0.0;
      for (std::int64_t d = 0; d < s.Dqk; ++d) acc += qh[d] * s.c[(b * s.Sk + j) * s.Dqk + d];
      a[j] = s.scale * acc;
      mx = std::max(mx, a[j]);
    }
    if (mx == kNegInf) continue;
    double z = 0.0;
    for (std::int64_t j = 0; j < s.Sk; ++j) z += mask[j] ? std::exp(a[j] - mx) : 0.0;
    lse[h] = mx + std::log(z);
    for (std::int64_t j = 0; j < s.Sk; ++j) p[h * s.Sk + j] = mask[j] ? std::exp(a[j] - lse[h]) : 0.0;
  }
}

}  // namespace

void dsa_indexer_scores(const DsaIndexerArgs& args, const TensorView& scores) {
  const Idx s = unpack(args);
  check_shape(scores, {s.B, s.Sq, s.Sk}, "scores");
  double* out = f64w(scores, "scores");
  for (std::int64_t b = 0; b < s.B; ++b) {
    for (std::int64_t t = 0; t < s.Sq; ++t) {
      for (std::int64_t j = 0; j < s.Sk; ++j) {
        out[(b * s.Sq + t) * s.Sk + j] = s.candidate(t, j) ? index_score(s, b, t, j) : kNegInf;
      }
    }
  }
}

void dsa_indexer_topk(const DsaIndexerArgs& args, const TensorView& topk_indices) {
  const Idx s = unpack(args);
  check_dtype(topk_indices, DType::kInt64, "topk_indices");
  const std::int64_t K = topk_indices.dim(2);
  check_shape(topk_indices, {s.B, s.Sq, K}, "topk_indices");
  std::int64_t* out = static_cast<std::int64_t*>(topk_indices.data());
  for (std::int64_t b = 0; b < s.B; ++b) {
    for (std::int64_t t = 0; t < s.Sq; ++t) {
      std::vector<std::pair<double, std::int64_t>> cand;  // (score, position)
      for (std::int64_t j = 0; j < s.Sk; ++j) {
        if (s.candidate(t, j)) cand.emplace_back(index_score(s, b, t, j), s.kp[j]);
      }
      std::sort(cand.begin(), cand.end(), [](const auto& x, const auto& y) {
        return x.first != y.first ? x.first > y.first : x.second < y.second;
      });
      std::vector<std::int64_t> sel;
      for (std::size_t e = 0; e < cand.size() && static_cast<std::int64_t>(e) < K; ++e) sel.push_back(cand[e].second);
      std::sort(sel.begin(), sel.end());
      std::int64_t* row = out + (b * s.Sq + t) * K;
      for (std::int64_t e = 0; e < K; ++e) row[e] = e < static_cast<std::int64_t>(sel.size()) ? sel[e] : -1;
    }
  }
}

void dsa_attention_forward(const DsaAttentionArgs& args, const TensorView& out, const TensorView& lse) {
  const Attn s = unpack(args);
  check_shape(out, {s.B, s.Sq, s.H, s.Dv}, "out");
  check_shape(lse, {s.B, s.H, s.Sq}, "lse");
  double* o = f64w(out, "out");
  double* l = f64w(lse, "lse");
  std::vector<double> p, row_lse;
  for (std::int64_t b = 0; b < s.B; ++b) {
    for (std::int64_t t = 0; t < s.Sq; ++t) {
      attention_row(s, b, t, p, row_lse);
      for (std::int64_t h = 0; h < s.H; ++h) {
        l[(b * s.H + h) * s.Sq + t] = row_lse[h];
        double* oh = o + ((b * s.Sq + t) * s.H + h) * s.Dv;
        for (std::int64_t d = 0; d < s.Dv; ++d) {
          double acc = 0.0;
          for (std::int64_t j = 0; j < s.Sk; ++j) acc += p[h * s.Sk + j] * s.c[(b * s.Sk + j) * s.Dqk + d];
          oh[d] = acc;
        }
      }
    }
  }
}

void dsa_attention_backward(const DsaAttentionArgs& args, const TensorView& dout, const TensorView& dq,
                            const TensorView& dc) {
  const Attn s = unpack(args);
  check_shape(dout, {s.B, s.Sq, s.H, s.Dv}, "dout");
  check_shape(dq, {s.B, s.Sq, s.H, s.Dqk}, "dq");
  check_shape(dc, {s.B, s.Sk, s.Dqk}, "dc");
  const double* g = f64(dout, "dout");
  double* dqp = f64w(dq, "dq");
  double* dcp = f64w(dc, "dc");
  std::fill(dqp, dqp + dq.numel(), 0.0);
  std::fill(dcp, dcp + dc.numel(), 0.0);
  std::vector<double> p, row_lse;
  for (std::int64_t b = 0; b < s.B; ++b) {
    for (std::int64_t t = 0; t < s.Sq; ++t) {
      attention_row(s, b, t, p, row_lse);
      for (std::int64_t h = 0; h < s.H; ++h) {
        const double* gh = g + ((b * s.Sq + t) * s.H + h) * s.Dv;
        const double* qh = s.q + ((b * s.Sq + t) * s.H + h) * s.Dqk;
        double* dqh = dqp + ((b * s.Sq + t) * s.H + h) * s.Dqk;
        // dp_j = dout . v_j; ds_j = p_j (dp_j - sum_i p_i dp_i)
        std::vector<double> dp(static_cast<std::size_t>(s.Sk), 0.0);
        double mean = 0.0;
        for (std::int64_t j = 0; j < s.Sk; ++j) {
          for (std::int64_t d = 0; d < s.Dv; ++d) dp[j] += gh[d] * s.c[(b * s.Sk + j) * s.Dqk + d];
          mean += p[h * s.Sk + j] * dp[j];
        }
        for (std::int64_t j = 0; j < s.Sk; ++j) {
          const double pj = p[h * s.Sk + j];
          if (pj == 0.0) continue;
          const double ds = pj * (dp[j] - mean);
          const double* cj = s.c + (b * s.Sk + j) * s.Dqk;
          double* dcj = dcp + (b * s.Sk + j) * s.Dqk;
          for (std::int64_t d = 0; d < s.Dqk; ++d) {
            dqh[d] += s.scale * ds * cj[d];
            dcj[d] += s.scale * ds * qh[d];
          }
          for (std::int64_t d = 0; d < s.Dv; ++d) dcj[d] += pj * gh[d];
        }
      }
    }
  }
}

double dsa_indexer_loss(const DsaAttentionArgs& attn, const DsaIndexerArgs& idx, const TensorView& dq_idx,
                        const TensorView& dw, const TensorView& dk_idx) {
  const Attn a = unpack(attn);
  const Idx s = unpack(idx);
  SEQPAR_CHECK(a.cp == s.kp && a.qp == s.qp && a.B == s.B, "reference indexer loss: attention and indexer keys differ");
  const bool grads = dq_idx.data() != nullptr;
  double* dq = grads ? f64w(dq_idx, "dq_idx") : nullptr;
  double* dwp = grads ? f64w(dw, "dw") : nullptr;
  double* dk = grads ? f64w(dk_idx, "dk_idx") : nullptr;
  if (grads) {
    std::fill(dq, dq + dq_idx.numel(), 0.0);
    std::fill(dwp, dwp + dw.numel(), 0.0);
    std::fill(dk, dk + dk_idx.numel(), 0.0);
  }
  double loss = 0.0;
  std::vector<double> p, row_lse;
  for (std::int64_t b = 0; b < s.B; ++b) {
    for (std::int64_t t = 0; t < s.Sq; ++t) {
      const std::vector<char> mask = selected_mask(a, b, t);
      attention_row(a, b, t, p, row_lse);
      std::vector<double> target(static_cast<std::size_t>(s.Sk), 0.0), score(static_cast<std::size_t>(s.Sk), kNegInf);
      double z = 0.0, mx = kNegInf;
      for (std::int64_t j = 0; j < s.Sk; ++j) {
        if (!mask[j]) continue;
        for (std::int64_t h = 0; h < a.H; ++h) target[j] += p[h * s.Sk + j];
        z += target[j];
        score[j] = index_score(s, b, t, j);
        mx = std::max(mx, score[j]);
      }
      if (z == 0.0) continue;
      double ze = 0.0;
      for (std::int64_t j = 0; j < s.Sk; ++j) ze += mask[j] ? std::exp(score[j] - mx) : 0.0;
      const double lse_i = mx + std::log(ze);
      for (std::int64_t j = 0; j < s.Sk; ++j) {
        if (!mask[j]) continue;
        const double pt = target[j] / z;
        const double log_q = score[j] - lse_i;
        if (pt > 0.0) loss += pt * (std::log(pt) - log_q);
        if (!grads) continue;
        const double g = std::exp(log_q) - pt;  // dL / dI_tj
        const double* kj = s.k + (b * s.Sk + j) * s.Di;
        for (std::int64_t i = 0; i < s.Hi; ++i) {
          const double sd = index_dot(s, b, t, i, j);
          if (sd <= 0.0) continue;
          const double wi = s.w[(b * s.Sq + t) * s.Hi + i];
          const double* qi = s.q + ((b * s.Sq + t) * s.Hi + i) * s.Di;
          dwp[(b * s.Sq + t) * s.Hi + i] += g * sd;
          for (std::int64_t d = 0; d < s.Di; ++d) {
            dq[((b * s.Sq + t) * s.Hi + i) * s.Di + d] += g * wi * kj[d];
            dk[(b * s.Sk + j) * s.Di + d] += g * wi * qi[d];
          }
        }
      }
    }
  }
  return loss;
}

}  // namespace seqpar::attn::reference
