// Public boundary of the DSA kernels: argument validation (callable on its own through the validate members)
// and dispatch to the CPU kernels in cpu/. Math: attention/dsa.h.
#include "attention/dsa.h"

#include <cmath>
#include <limits>

#include "attention/boundary.h"
#include "attention/cpu/dsa_cpu.h"
#include "attention/cpu/scratch.h"
#include "attention/ops/dsa_hook.h"
#include "runtime/error.h"
#include "runtime/tensor_checks.h"

namespace seqpar::attn {
namespace {

constexpr const char* kFamily = "DSA";

void check_floating(const TensorView& t, const char* what) { detail::check_floating(t, what, kFamily); }

// An optional tensor argument that was not given (a default TensorView has no data).
bool absent(const TensorView& t) { return t.data() == nullptr; }

// [B, Sq, k] arrays of the accumulator dtype `acc` indexed like topk_indices (probs, scores, dscores).
void check_slot_array(const TensorView& t, const TensorView& topk, DType acc, const char* what) {
  detail::check_host_tensor(t, topk.shape(), acc, what, kFamily);
}

// Gradient outputs: any floating dtype when overwritten, the accumulator dtype `acc` when accumulated into.
void check_grad_output(const TensorView& t, const Shape& shape, bool accumulate, DType acc, const char* what) {
  check_floating(t, what);
  check_shape(t, shape, what);
  if (accumulate) check_dtype(t, acc, str_cat(what, " (accumulate = true)").c_str());
}

// An accumulator that no input dtype fixes (a top-k state on its own, the indexer loss arrays): fp32 or fp64.
void check_acc_dtype(const TensorView& t, const char* what) {
  SEQPAR_CHECK(t.dtype() == DType::kFloat32 || t.dtype() == DType::kFloat64, what, " has dtype ", dtype_name(t.dtype()),
               ", expected fp32 or fp64 (the DSA accumulator dtypes)");
}

void check_topk_shape(const TensorView& topk, const char* what) {
  detail::check_host(topk, what, kFamily);
  check_dtype(topk, DType::kInt64, what);
  SEQPAR_CHECK(topk.ndim() == 3, what, " must be [B, Sq, k], got ", shape_str(topk.shape()));
  SEQPAR_CHECK(topk.dim(2) <= std::numeric_limits<std::int32_t>::max(), what, ": k = ", topk.dim(2),
               " must be at most ", std::numeric_limits<std::int32_t>::max());
}

// Number of valid (non -1) entries at the start of each row; checks that every row is ascending and distinct,
// -1 padded at the end, and never selects a position after its query.
std::vector<std::int32_t> check_topk_rows(const TensorView& topk, std::int64_t B, std::int64_t Sq,
                                          const std::vector<std::int64_t>& q_pos, const char* what) {
  check_topk_shape(topk, what);
  SEQPAR_CHECK(topk.dim(0) == B && topk.dim(1) == Sq, what, " must be [B, Sq, k] = [", B, ", ", Sq, ", k], got ",
               shape_str(topk.shape()));
  const std::int64_t K = topk.dim(2);
  const std::int64_t* idx = static_cast<const std::int64_t*>(topk.data());
  std::vector<std::int32_t> valid(static_cast<std::size_t>(B * Sq));
  for (std::int64_t r = 0; r < B * Sq; ++r) {
    const std::int64_t* row = idx + r * K;
    const std::int64_t t = r % Sq;
    std::int64_t n = 0;
    while (n < K && row[n] >= 0) {
      SEQPAR_CHECK(n == 0 || row[n] > row[n - 1], what, " row (b=", r / Sq, ", t=", t,
                   ") must be strictly ascending, but slot ", n, " holds ", row[n], " after ", row[n - 1]);
      SEQPAR_CHECK(row[n] <= q_pos[static_cast<std::size_t>(t)], what, " row (b=", r / Sq, ", t=", t, ") selects ",
                   "position ", row[n], " after its query position ", q_pos[static_cast<std::size_t>(t)]);
      ++n;
    }
    for (std::int64_t s = n; s < K; ++s) {
      SEQPAR_CHECK(row[s] == -1, what, " row (b=", r / Sq, ", t=", t, ") must be padded with -1 after its valid ",
                   "entries, but slot ", s, " holds ", row[s]);
    }
    valid[static_cast<std::size_t>(r)] = static_cast<std::int32_t>(n);
  }
  return valid;
}

cpu::DsaIndexerShape validate_indexer(const DsaIndexerArgs& a) {
  check_floating(a.q_idx, "q_idx");
  check_floating(a.w, "w");
  check_floating(a.k_idx, "k_idx");
  SEQPAR_CHECK(a.q_idx.ndim() == 4, "q_idx must be [B, Sq, Hi, Di], got ", shape_str(a.q_idx.shape()));
  cpu::DsaIndexerShape s{a.q_idx.dim(0), a.q_idx.dim(1), a.q_idx.dim(2), a.q_idx.dim(3), /*Sk=*/0, {}, {}};
  SEQPAR_CHECK(a.k_idx.ndim() == 3 && a.k_idx.dim(0) == s.B && a.k_idx.dim(2) == s.Di, "k_idx must be [B, Sk, Di] = [",
               s.B, ", Sk, ", s.Di, "], got ", shape_str(a.k_idx.shape()));
  s.Sk = a.k_idx.dim(1);
  check_shape(a.w, {s.B, s.Sq, s.Hi}, "w");
  SEQPAR_CHECK(a.k_idx.dtype() == a.q_idx.dtype() && a.w.dtype() == a.q_idx.dtype(),
               "q_idx, w and k_idx must share one dtype, got ", dtype_name(a.q_idx.dtype()), ", ",
               dtype_name(a.w.dtype()), ", ", dtype_name(a.k_idx.dtype()));
  s.q_pos = detail::positions_or_iota(a.q_pos, s.Sq, "q_pos", "Sq");
  s.k_pos = detail::positions_or_iota(a.k_pos, s.Sk, "k_pos", "Sk");
  detail::check_strictly_increasing(s.k_pos, "k_pos");
  SEQPAR_CHECK(a.window >= 0, "indexer window ", a.window, " must be >= 0 (0: no window)");
  SEQPAR_CHECK(
      a.doc_lo.size() == a.doc_hi.size() && (a.doc_lo.empty() || static_cast<std::int64_t>(a.doc_lo.size()) == s.Sq),
      "indexer doc_lo / doc_hi have ", a.doc_lo.size(), " / ", a.doc_hi.size(),
      " entries, expected both 0 (no document bounds) or both Sq = ", s.Sq);
  return s;
}

cpu::DsaAttentionShape validate_attention(const DsaAttentionArgs& a) {
  check_floating(a.q, "q");
  check_floating(a.c, "c");
  SEQPAR_CHECK(a.q.ndim() == 4, "q must be [B, Sq, H, Dqk], got ", shape_str(a.q.shape()));
  cpu::DsaAttentionShape s{a.q.dim(0), a.q.dim(1), a.q.dim(2), a.q.dim(3), /*Dv=*/0, /*Sk=*/0,
                           /*K=*/0,    0.0,        {},         {},         {}};
  SEQPAR_CHECK(a.c.ndim() == 3 && a.c.dim(0) == s.B && a.c.dim(2) == s.Dqk, "c must be [B, Sk, Dqk] = [", s.B, ", Sk, ",
               s.Dqk, "], got ", shape_str(a.c.shape()));
  SEQPAR_CHECK(a.c.dtype() == a.q.dtype(), "q and c must share one dtype, got ", dtype_name(a.q.dtype()), " and ",
               dtype_name(a.c.dtype()));
  s.Sk = a.c.dim(1);
  s.Dv = a.dim_v;
  SEQPAR_CHECK(s.Dv >= 1 && s.Dv <= s.Dqk, "dim_v = ", s.Dv, " must be in [1, Dqk = ", s.Dqk, "]");
  SEQPAR_CHECK(std::isfinite(a.scale), "DSA scale ", a.scale, " must be finite (0 or less: 1/sqrt(Dqk))");
  s.scale = a.scale > 0.0 ? detail::real_option(a.scale, a.q.dtype()) : 1.0 / std::sqrt(static_cast<double>(s.Dqk));
  s.q_pos = detail::positions_or_iota(a.q_pos, s.Sq, "q_pos", "Sq");
  s.c_pos = detail::positions_or_iota(a.c_pos, s.Sk, "c_pos", "Sk");
  detail::check_strictly_increasing(s.c_pos, "c_pos");
  s.valid = check_topk_rows(a.topk_indices, s.B, s.Sq, s.q_pos, "topk_indices");
  s.K = a.topk_indices.dim(2);
  return s;
}

// B < 0: any [B, Sq, k]. The scores are fp32 or fp64, and of the accumulator dtype of the indexer inputs when
// `inputs` is given.
void check_state(const DsaTopkState& st, std::int64_t B, std::int64_t Sq, const char* what,
                 const TensorView* inputs = nullptr) {
  detail::check_host(st.scores, what, kFamily);
  detail::check_host(st.positions, what, kFamily);
  if (inputs != nullptr) {
    check_dtype(st.scores, accumulator_dtype(inputs->dtype()),
                str_cat(what, " scores (", dtype_name(inputs->dtype()), " indexer inputs)").c_str());
  } else {
    check_acc_dtype(st.scores, str_cat(what, " scores").c_str());
  }
  check_dtype(st.positions, DType::kInt64, str_cat(what, " positions").c_str());
  SEQPAR_CHECK(st.scores.ndim() == 3 && st.scores.shape() == st.positions.shape(), what,
               ": scores and positions must both be [B, Sq, k], got ", shape_str(st.scores.shape()), " and ",
               shape_str(st.positions.shape()));
  if (B >= 0) {
    SEQPAR_CHECK(st.scores.dim(0) == B && st.scores.dim(1) == Sq, what, " must be [", B, ", ", Sq, ", k], got ",
                 shape_str(st.scores.shape()));
  }
}

// delta [B, H, Sq] of the accumulator dtype of q.
void check_delta(const TensorView& delta, const cpu::DsaAttentionShape& s, DType acc) {
  detail::check_host_tensor(delta, {s.B, s.H, s.Sq}, acc, "delta", kFamily);
}

// lse [B, H, Sq] of the accumulator dtype of q (dtype `inputs`), or fp64.
void check_lse(const TensorView& lse, const cpu::DsaAttentionShape& s, DType inputs) {
  detail::check_host(lse, "lse", kFamily);
  check_shape(lse, {s.B, s.H, s.Sq}, "lse");
  const DType acc = accumulator_dtype(inputs);
  SEQPAR_CHECK(lse.dtype() == acc || lse.dtype() == DType::kFloat64, "lse has dtype ", dtype_name(lse.dtype()),
               ", expected ", acc == DType::kFloat64 ? "fp64" : "fp32 or fp64", " for ", dtype_name(inputs), " inputs");
}

void check_block_out(const TensorView& t, const cpu::DsaAttentionShape& s, const char* what) {
  check_floating(t, what);
  check_shape(t, {s.B, s.Sq, s.H, s.Dv}, what);
}

// ---- validation of each call; returns what the kernel needs ----

cpu::DsaIndexerShape validate_topk_block(const DsaIndexerArgs& args, const DsaTopkState& state) {
  cpu::DsaIndexerShape s = validate_indexer(args);
  check_state(state, s.B, s.Sq, "top-k state", &args.q_idx);
  return s;
}

cpu::DsaAttentionShape validate_forward(const DsaAttentionArgs& args, const TensorView& out, const TensorView& lse) {
  cpu::DsaAttentionShape s = validate_attention(args);
  check_block_out(out, s, "out");
  check_lse(lse, s, args.q.dtype());
  return s;
}

cpu::DsaAttentionShape validate_probs(const DsaAttentionArgs& args, const TensorView& lse, const TensorView& probs) {
  cpu::DsaAttentionShape s = validate_attention(args);
  const DType acc = accumulator_dtype(args.q.dtype());
  check_lse(lse, s, args.q.dtype());
  check_slot_array(probs, args.topk_indices, acc, "probs");
  return s;
}

cpu::DsaAttentionShape validate_backward(const DsaAttentionBackwardArgs& args, const TensorView& dq,
                                         const TensorView& dc, bool accumulate) {
  cpu::DsaAttentionShape s = validate_attention(args.fwd);
  const DType acc = accumulator_dtype(args.fwd.q.dtype());
  check_block_out(args.dout, s, "dout");
  check_lse(args.lse, s, args.fwd.q.dtype());
  check_grad_output(dq, args.fwd.q.shape(), accumulate, acc, "dq");
  check_grad_output(dc, args.fwd.c.shape(), accumulate, acc, "dc");
  if (absent(args.delta)) {
    check_block_out(args.out, s, "out (needed for delta, which was not given)");
  } else {
    check_delta(args.delta, s, acc);
  }
  if (!absent(args.probs)) check_slot_array(args.probs, args.fwd.topk_indices, acc, "probs");
  return s;
}

void validate_delta(const TensorView& out, const TensorView& dout, const TensorView& delta) {
  check_floating(out, "out");
  check_floating(dout, "dout");
  SEQPAR_CHECK(out.ndim() == 4, "out must be [B, Sq, H, Dv], got ", shape_str(out.shape()));
  check_shape(dout, out.shape(), "dout");
  detail::check_host(delta, "delta", kFamily);
  check_shape(delta, {out.dim(0), out.dim(2), out.dim(1)}, "delta");
  check_acc_dtype(delta, "delta");
  SEQPAR_CHECK(delta.dtype() == DType::kFloat64 || (out.dtype() != DType::kFloat64 && dout.dtype() != DType::kFloat64),
               "delta has dtype ", dtype_name(delta.dtype()), ", expected fp64 for out ", dtype_name(out.dtype()),
               " and dout ", dtype_name(dout.dtype()), " (fp64 inputs are reduced in fp64)");
}

void validate_loss(const DsaIndexerLossArgs& args, const TensorView& dscores) {
  check_topk_shape(args.topk_indices, "topk_indices");
  check_acc_dtype(args.probs, "probs");
  check_slot_array(args.probs, args.topk_indices, args.probs.dtype(), "probs");
  check_slot_array(args.scores, args.topk_indices, args.probs.dtype(), "scores (like probs)");
  if (!absent(dscores)) check_slot_array(dscores, args.topk_indices, args.probs.dtype(), "dscores (like probs)");
}

struct IndexerBlock {
  cpu::DsaIndexerShape s;
  std::vector<std::int32_t> valid;
};

IndexerBlock validate_indexer_selected(const DsaIndexerArgs& args, const TensorView& topk_indices) {
  IndexerBlock r{validate_indexer(args), {}};
  r.valid = check_topk_rows(topk_indices, r.s.B, r.s.Sq, r.s.q_pos, "topk_indices");
  return r;
}

IndexerBlock validate_scores_selected(const DsaIndexerArgs& args, const TensorView& topk_indices,
                                      const TensorView& scores) {
  IndexerBlock r = validate_indexer_selected(args, topk_indices);
  check_slot_array(scores, topk_indices, accumulator_dtype(args.q_idx.dtype()), "scores");
  return r;
}

IndexerBlock validate_indexer_backward(const DsaIndexerArgs& args, const TensorView& topk_indices,
                                       const TensorView& dscores, const TensorView& dq_idx, const TensorView& dw,
                                       const TensorView& dk_idx, bool accumulate) {
  IndexerBlock r = validate_indexer_selected(args, topk_indices);
  const DType acc = accumulator_dtype(args.q_idx.dtype());
  check_slot_array(dscores, topk_indices, acc, "dscores");
  check_grad_output(dq_idx, args.q_idx.shape(), accumulate, acc, "dq_idx");
  check_grad_output(dw, args.w.shape(), accumulate, acc, "dw");
  check_grad_output(dk_idx, args.k_idx.shape(), accumulate, acc, "dk_idx");
  return r;
}

// The checks of the kernels without an argument struct.

void check_dsa_topk_init(const DsaTopkState& state, Stream stream) {
  detail::check_stream(stream, "dsa_topk_init", kFamily);
  check_state(state, -1, -1, "top-k state");
}

void check_dsa_topk_merge(const DsaTopkState& state, const DsaTopkState& other, Stream stream) {
  detail::check_stream(stream, "dsa_topk_merge", kFamily);
  check_state(state, -1, -1, "top-k state");
  check_state(other, -1, -1, "other top-k state");
  SEQPAR_CHECK(state.scores.shape() == other.scores.shape(), "top-k states to merge must have one shape, got ",
               shape_str(state.scores.shape()), " and ", shape_str(other.scores.shape()));
  check_dtype(other.scores, state.scores.dtype(), "other top-k state scores (like the state's)");
}

void check_dsa_topk_finalize(const DsaTopkState& state, const TensorView& topk_indices, Stream stream) {
  detail::check_stream(stream, "dsa_topk_finalize", kFamily);
  check_state(state, -1, -1, "top-k state");
  detail::check_host_tensor(topk_indices, state.positions.shape(), DType::kInt64, "topk_indices", kFamily);
}

void check_dsa_topk_selected_scores(const DsaTopkState& state, const TensorView& scores, Stream stream) {
  detail::check_stream(stream, "dsa_topk_selected_scores", kFamily);
  check_state(state, -1, -1, "top-k state");
  detail::check_host_tensor(scores, state.scores.shape(), state.scores.dtype(), "selected scores", kFamily);
}

void check_dsa_indexer_topk(const DsaIndexerArgs& args, const TensorView& topk_indices, Stream stream) {
  detail::check_stream(stream, "dsa_indexer_topk", kFamily);
  const cpu::DsaIndexerShape s = validate_indexer(args);
  check_topk_shape(topk_indices, "topk_indices");
  check_shape(topk_indices, {s.B, s.Sq, topk_indices.dim(2)}, "topk_indices");
}

void check_dsa_attention_delta(const TensorView& out, const TensorView& dout, const TensorView& delta, Stream stream) {
  detail::check_stream(stream, "dsa_attention_delta", kFamily);
  validate_delta(out, dout, delta);
}

}  // namespace

// ---- validation of the argument structs --------------------------------------------------------------------------

void DsaIndexerArgs::validate() const { validate_indexer(*this); }

void DsaAttentionArgs::validate() const { validate_attention(*this); }

void DsaIndexerArgs::validate(const DsaTopkState& state, Stream stream) const {
  detail::check_stream(stream, "dsa_indexer_topk_block", kFamily);
  validate_topk_block(*this, state);
}

void DsaAttentionArgs::validate(const TensorView& out, const TensorView& lse, Stream stream) const {
  detail::check_stream(stream, "dsa_attention_forward", kFamily);
  validate_forward(*this, out, lse);
}

void DsaAttentionBackwardArgs::validate(const TensorView& dq, const TensorView& dc, bool accumulate,
                                        Stream stream) const {
  detail::check_stream(stream, "dsa_attention_backward", kFamily);
  validate_backward(*this, dq, dc, accumulate);
}

void DsaIndexerLossArgs::validate(const TensorView& dscores, Stream stream) const {
  detail::check_stream(stream, "dsa_indexer_loss", kFamily);
  validate_loss(*this, dscores);
}

// ---- the kernels ---------------------------------------------------------------------------------------------------

void dsa_topk_init(const DsaTopkState& state, Stream stream) {
  check_dsa_topk_init(state, stream);
  cpu::dsa_topk_init_cpu(state);
}

void dsa_indexer_topk_block(const DsaIndexerArgs& args, const DsaTopkState& state, Stream stream) {
  detail::check_stream(stream, "dsa_indexer_topk_block", kFamily);
  const cpu::DsaIndexerShape s = validate_topk_block(args, state);
  if (const ops::DsaHooks* h = ops::detail::active_dsa_hooks(); h != nullptr && h->topk_block != nullptr) {
    h->topk_block(args, state);  // test mode (attention/ops/dsa_hook.h)
    ops::detail::note_dsa_hook_call();
    return;
  }
  cpu::dsa_indexer_topk_block_cpu(args, s, state);
}

void dsa_topk_merge(const DsaTopkState& state, const DsaTopkState& other, Stream stream) {
  check_dsa_topk_merge(state, other, stream);
  if (const ops::DsaHooks* h = ops::detail::active_dsa_hooks(); h != nullptr && h->topk_merge != nullptr) {
    h->topk_merge(state, other);
    ops::detail::note_dsa_hook_call();
    return;
  }
  cpu::dsa_topk_merge_cpu(state, other);
}

void dsa_topk_finalize(const DsaTopkState& state, const TensorView& topk_indices, Stream stream) {
  check_dsa_topk_finalize(state, topk_indices, stream);
  cpu::dsa_topk_finalize_cpu(state, topk_indices);
}

void dsa_topk_selected_scores(const DsaTopkState& state, const TensorView& scores, Stream stream) {
  check_dsa_topk_selected_scores(state, scores, stream);
  cpu::dsa_topk_selected_scores_cpu(state, scores);
}

void dsa_indexer_topk(const DsaIndexerArgs& args, const TensorView& topk_indices, Stream stream) {
  check_dsa_indexer_topk(args, topk_indices, stream);
  Tensor scores =
      cpu::zeroed_workspace(topk_indices.shape(), accumulator_dtype(args.q_idx.dtype()), "dsa_indexer_topk state");
  Tensor positions = cpu::zeroed_workspace(topk_indices.shape(), DType::kInt64, "dsa_indexer_topk state");
  const DsaTopkState state{scores.view(), positions.view()};
  dsa_topk_init(state, stream);
  dsa_indexer_topk_block(args, state, stream);
  dsa_topk_finalize(state, topk_indices, stream);
}

void dsa_attention_forward(const DsaAttentionArgs& args, const TensorView& out, const TensorView& lse, Stream stream) {
  detail::check_stream(stream, "dsa_attention_forward", kFamily);
  if (ops::detail::dsa_attention_forward_hooked(args, out, lse)) return;  // test mode (attention/ops/dsa_hook.h)
  cpu::dsa_attention_forward_cpu(args, validate_forward(args, out, lse), out, lse);
}

void dsa_attention_delta(const TensorView& out, const TensorView& dout, const TensorView& delta, Stream stream) {
  check_dsa_attention_delta(out, dout, delta, stream);
  cpu::dsa_attention_delta_cpu(out, dout, delta);
}

void dsa_attention_backward(const DsaAttentionBackwardArgs& args, const TensorView& dq, const TensorView& dc,
                            bool accumulate, Stream stream) {
  detail::check_stream(stream, "dsa_attention_backward", kFamily);
  const cpu::DsaAttentionShape s = validate_backward(args, dq, dc, accumulate);
  TensorView delta = args.delta;
  Tensor computed;
  if (absent(args.delta)) {
    computed =
        cpu::zeroed_workspace({s.B, s.H, s.Sq}, accumulator_dtype(args.fwd.q.dtype()), "dsa_attention_backward delta");
    cpu::dsa_attention_delta_cpu(args.out, args.dout, computed.view());
    delta = computed.view();
  }
  if (const ops::DsaHooks* h = ops::detail::active_dsa_hooks(); h != nullptr && h->backward != nullptr) {
    h->backward(args.fwd, args.lse, args.dout, delta, dq, dc, accumulate, args.probs);
    ops::detail::note_dsa_hook_call();
    return;
  }
  cpu::dsa_attention_backward_cpu(args.fwd, s, args.lse, args.dout, delta, dq, dc, accumulate, args.probs);
}

void dsa_attention_probs(const DsaAttentionArgs& args, const TensorView& lse, const TensorView& probs, Stream stream) {
  detail::check_stream(stream, "dsa_attention_probs", kFamily);
  const cpu::DsaAttentionShape s = validate_probs(args, lse, probs);
  if (const ops::DsaHooks* h = ops::detail::active_dsa_hooks(); h != nullptr && h->backward != nullptr) {
    h->backward(args, lse, TensorView(), TensorView(), TensorView(), TensorView(), false, probs);
    ops::detail::note_dsa_hook_call();
    return;
  }
  cpu::dsa_attention_backward_cpu(args, s, lse, TensorView(), TensorView(), TensorView(), TensorView(), false, probs);
}

void dsa_indexer_scores_selected(const DsaIndexerArgs& args, const TensorView& topk_indices, const TensorView& scores,
                                 Stream stream) {
  detail::check_stream(stream, "dsa_indexer_scores_selected", kFamily);
  const IndexerBlock v = validate_scores_selected(args, topk_indices, scores);
  if (const ops::DsaHooks* h = ops::detail::active_dsa_hooks(); h != nullptr && h->scores_selected != nullptr) {
    h->scores_selected(args, topk_indices, scores);
    ops::detail::note_dsa_hook_call();
    return;
  }
  cpu::dsa_indexer_scores_selected_cpu(args, v.s, topk_indices, v.valid, scores);
}

double dsa_indexer_loss(const DsaIndexerLossArgs& args, const TensorView& dscores, Stream stream) {
  args.validate(dscores, stream);
  if (const ops::DsaHooks* h = ops::detail::active_dsa_hooks(); h != nullptr && h->indexer_loss != nullptr) {
    const double loss = h->indexer_loss(args, dscores);
    ops::detail::note_dsa_hook_call();
    return loss;
  }
  return cpu::dsa_indexer_loss_cpu(args, dscores);
}

void dsa_indexer_backward(const DsaIndexerArgs& args, const TensorView& topk_indices, const TensorView& dscores,
                          const TensorView& dq_idx, const TensorView& dw, const TensorView& dk_idx, bool accumulate,
                          Stream stream) {
  detail::check_stream(stream, "dsa_indexer_backward", kFamily);
  const IndexerBlock v = validate_indexer_backward(args, topk_indices, dscores, dq_idx, dw, dk_idx, accumulate);
  if (const ops::DsaHooks* h = ops::detail::active_dsa_hooks(); h != nullptr && h->indexer_backward != nullptr) {
    h->indexer_backward(args, topk_indices, dscores, dq_idx, dw, dk_idx, accumulate);
    ops::detail::note_dsa_hook_call();
    return;
  }
  cpu::dsa_indexer_backward_cpu(args, v.s, topk_indices, v.valid, dscores, dq_idx, dw, dk_idx, accumulate);
}

}  // namespace seqpar::attn
