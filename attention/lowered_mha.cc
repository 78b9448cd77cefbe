// Lowered execution of MHA on the CPU: each rectangle of the lowering run as its own kernel call (lowering.h).
#include <atomic>
#include <limits>
#include <numeric>

#include "attention/lowering.h"
#include "runtime/env.h"
#include "runtime/error.h"
#include "runtime/tensor_ops.h"

namespace seqpar::attn {
namespace {

thread_local bool t_in_lowered = false;  // set while a lowered call runs its sub-blocks
std::atomic<std::int64_t> g_rects{0};

struct LoweredScope {
  LoweredScope() { t_in_lowered = true; }
  ~LoweredScope() { t_in_lowered = false; }
  LoweredScope(const LoweredScope&) = delete;
  LoweredScope& operator=(const LoweredScope&) = delete;
};

std::vector<std::int64_t> iota_vec(std::int64_t begin, std::int64_t end) {
  std::vector<std::int64_t> v(static_cast<std::size_t>(end - begin));
  std::iota(v.begin(), v.end(), begin);
  return v;
}

Shape with_dim(Shape s, int dim, std::int64_t n) {
  s[static_cast<std::size_t>(dim)] = n;
  return s;
}

// A copy of rows `idx` of t along dim.
Tensor rows_of(const TensorView& t, int dim, const std::vector<std::int64_t>& idx, Stream stream) {
  Tensor r = Tensor::empty(with_dim(t.shape(), dim, static_cast<std::int64_t>(idx.size())), t.dtype(),
                           MemCategory::kWorkspace);
  gather_rows(t, dim, idx, r.view(), stream);
  return r;
}

// One rectangle as kernel arguments: the sub-block's positions and mask in the kernel's terms (see lowering.h).
// The global positions of the rectangle's rows (mod_q_pos / mod_k_pos: what ALiBi and dropout read) and its rows
// of q_tokens.
struct SubBlock {
  std::vector<std::int64_t> q_idx, k_idx, q_pos, k_pos;
  MaskSpec mask;
  std::vector<std::int64_t> mod_q_pos, mod_k_pos, q_tokens;
};

std::vector<std::int64_t> slice(std::span<const std::int64_t> v, std::int64_t begin, std::int64_t end) {
  return {v.begin() + begin, v.begin() + end};
}

SubBlock sub_block(const MhaForwardArgs& args, const LoweredRect& r) {
  SubBlock b;
  b.q_idx = iota_vec(r.q_begin, r.q_end);
  b.k_idx = iota_vec(r.k_begin, r.k_end);
  const std::int64_t e = r.mask.align == DiagonalAlignment::kBottomRight ? r.sk() - r.sq() : 0;
  std::int64_t shift = e, window = r.mask.left_bound;
  if (!r.mask.causal && r.mask.left_bound > 0) {
    // a left bound alone: causal with every key in the past (query i at i + sk), the window widened to match
    shift = r.sk();
    window = r.mask.left_bound + r.sk() - e;
  }
  b.q_pos = iota_vec(shift, shift + r.sq());
  b.k_pos = iota_vec(0, r.sk());
  b.mask = MaskSpec(r.mask.causal || r.mask.left_bound > 0, window);
  if (!args.mods.alibi_slopes.empty() || args.dropout.p > 0.0) {
    const std::span<const std::int64_t> qp = args.mod_q_pos.empty() ? args.q_pos : args.mod_q_pos,
                                        kp = args.mod_k_pos.empty() ? args.k_pos : args.mod_k_pos;
    b.mod_q_pos = qp.empty() ? iota_vec(r.q_begin, r.q_end) : slice(qp, r.q_begin, r.q_end);
    b.mod_k_pos = kp.empty() ? iota_vec(r.k_begin, r.k_end) : slice(kp, r.k_begin, r.k_end);
    if (!args.q_tokens.empty()) b.q_tokens = slice(args.q_tokens, r.q_begin, r.q_end);
  }
  return b;
}

std::vector<LoweredRect> lower_call(const MhaForwardArgs& args) {
  const std::int64_t sq = args.q.dim(1), sk = args.k.dim(1);
  const std::vector<std::int64_t> qi = args.q_pos.empty() ? iota_vec(0, sq) : std::vector<std::int64_t>{};
  const std::vector<std::int64_t> ki = args.k_pos.empty() ? iota_vec(0, sk) : std::vector<std::int64_t>{};
  return lower_attention_block(args.q_pos.empty() ? std::span<const std::int64_t>(qi) : args.q_pos,
                               args.k_pos.empty() ? std::span<const std::int64_t>(ki) : args.k_pos, args.mask);
}

MhaForwardArgs sub_args(const MhaForwardArgs& args, const SubBlock& b, const TensorView& q, const TensorView& k,
                        const TensorView& v) {
  MhaForwardArgs a = args;
  a.q = q;
  a.k = k;
  a.v = v;
  a.q_pos = b.q_pos;
  a.k_pos = b.k_pos;
  a.mask = b.mask;
  a.mods.sinks = {};  // applied once to the merged result
  a.mod_q_pos = b.mod_q_pos;  // ALiBi and dropout read the global positions (empty: neither is on)
  a.mod_k_pos = b.mod_k_pos;
  a.q_tokens = b.q_tokens;
  return a;
}

}  // namespace

bool lowered_attention_enabled() { return env::lowered_attention(); }

std::int64_t lowered_rects_executed() { return g_rects.load(); }

bool detail::route_to_lowered(const MhaForwardArgs& args) {
  return lowered_attention_enabled() && !t_in_lowered;
}

void mha_forward_lowered(const MhaForwardArgs& args, const TensorView& out, const TensorView& lse, Stream stream) {
  args.validate(out, lse, stream);
  const LoweredScope scope;
  const std::vector<LoweredRect> rects = lower_call(args);
  const DType acc = accumulator_dtype(args.q.dtype());
  Tensor acc_out = Tensor::zeros(out.shape(), acc, MemCategory::kWorkspace);
  Tensor acc_lse = Tensor::empty(lse.shape(), DType::kFloat64, MemCategory::kWorkspace);
  fill(acc_lse.view(), -std::numeric_limits<double>::infinity(), stream);
  for (const LoweredRect& r : rects) {
    const SubBlock b = sub_block(args, r);
    const Tensor q = rows_of(args.q, 1, b.q_idx, stream), k = rows_of(args.k, 1, b.k_idx, stream),
                 v = rows_of(args.v, 1, b.k_idx, stream);
    Tensor o = Tensor::empty(q.shape(), acc, MemCategory::kWorkspace);
    Tensor l = Tensor::empty(with_dim(lse.shape(), 2, r.sq()), DType::kFloat64, MemCategory::kWorkspace);
    mha_forward(sub_args(args, b, q.view(), k.view(), v.view()), o.view(), l.view(), stream);
    Tensor run_o = rows_of(acc_out.view(), 1, b.q_idx, stream), run_l = rows_of(acc_lse.view(), 2, b.q_idx, stream);
    lse_merge(run_o.view(), run_l.view(), o.view(), l.view(), stream);
    scatter_rows(run_o.view(), 1, b.q_idx, acc_out.view(), stream);
    scatter_rows(run_l.view(), 2, b.q_idx, acc_lse.view(), stream);
    ++g_rects;
  }
  if (!args.mods.sinks.empty()) mha_apply_sinks(acc_out.view(), acc_lse.view(), args.mods.sinks, stream);
  copy_convert(acc_out.view(), out, stream);
  copy_convert(acc_lse.view(), lse, stream);
}

void mha_backward_lowered(const MhaBackwardArgs& args, const TensorView& dq, const TensorView& dk, const TensorView& dv,
                          bool accumulate, Stream stream) {
  args.validate(dq, dk, dv, accumulate, stream);
  const LoweredScope scope;
  const std::vector<LoweredRect> rects = lower_call(args.fwd);
  const DType acc = accumulator_dtype(args.fwd.q.dtype());
  // delta as the kernel computes it when none is given (fp64 when out or dout is fp64)
  Tensor delta_own;
  TensorView delta = args.delta;
  if (delta.empty()) {
    const bool wide = args.out.dtype() == DType::kFloat64 || args.dout.dtype() == DType::kFloat64;
    delta_own = Tensor::empty(args.lse.shape(), wide ? DType::kFloat64 : DType::kFloat32, MemCategory::kWorkspace);
    mha_backward_delta(args.out, args.dout, delta_own.view(), stream);
    delta = delta_own.view();
  }
  Tensor dq_own, dk_own, dv_own;
  TensorView dq_acc = dq, dk_acc = dk, dv_acc = dv;
  if (!accumulate) {
    dq_own = Tensor::zeros(dq.shape(), acc, MemCategory::kWorkspace);
    dk_own = Tensor::zeros(dk.shape(), acc, MemCategory::kWorkspace);
    dv_own = Tensor::zeros(dv.shape(), acc, MemCategory::kWorkspace);
    dq_acc = dq_own.view();
    dk_acc = dk_own.view();
    dv_acc = dv_own.view();
  }
  for (const LoweredRect& r : rects) {
    const SubBlock b = sub_block(args.fwd, r);
    const Tensor q = rows_of(args.fwd.q, 1, b.q_idx, stream), k = rows_of(args.fwd.k, 1, b.k_idx, stream),
                 v = rows_of(args.fwd.v, 1, b.k_idx, stream);
    const Tensor dout = rows_of(args.dout, 1, b.q_idx, stream), lse = rows_of(args.lse, 2, b.q_idx, stream),
                 dl = rows_of(delta, 2, b.q_idx, stream);
    Tensor out;  // not read (delta is given), but checked like dout when present
    if (!args.out.empty()) out = rows_of(args.out, 1, b.q_idx, stream);
    MhaBackwardArgs a;
    a.fwd = sub_args(args.fwd, b, q.view(), k.view(), v.view());
    a.out = out.view();
    a.dout = dout.view();
    a.lse = lse.view();
    a.delta = dl.view();
    Tensor sdq = Tensor::empty(q.shape(), acc, MemCategory::kWorkspace);
    Tensor sdk = Tensor::empty(k.shape(), acc, MemCategory::kWorkspace);
    Tensor sdv = Tensor::empty(v.shape(), acc, MemCategory::kWorkspace);
    mha_backward(a, sdq.view(), sdk.view(), sdv.view(), false, stream);
    index_add_rows(sdq.view(), 1, b.q_idx, dq_acc, stream);
    index_add_rows(sdk.view(), 1, b.k_idx, dk_acc, stream);
    index_add_rows(sdv.view(), 1, b.k_idx, dv_acc, stream);
    ++g_rects;
  }
  if (!accumulate) {
    copy_convert(dq_acc, dq, stream);
    copy_convert(dk_acc, dk, stream);
    copy_convert(dv_acc, dv, stream);
  }
}

}  // namespace seqpar::attn
