#include "parallel/ring_attention.h"

#include <cmath>
#include <limits>

#include "parallel/ring_pass.h"
#include "runtime/logging.h"
#include "runtime/tensor_checks.h"
#include "runtime/tensor_ops.h"
#include "runtime/timer.h"

namespace seqpar {
namespace {

constexpr int kTagKv = 101;  // (K, V) blocks around the ring; 102: their (dK, dV) accumulators

// delta of the backward: fp64 when the inputs or dout are fp64 (attn::mha_backward_delta), else the accumulators'.
DType delta_dtype(DType storage, DType dout) {
  return dout == DType::kFloat64 ? DType::kFloat64 : accumulator_dtype(storage);
}

Shape packed_shape(const Shape& kv_shape, std::int64_t n) {
  Shape s = kv_shape;
  s.insert(s.begin(), n);
  return s;
}

// Part i of a tensor packed as [n, ...shape].
TensorView part(const TensorView& packed, std::int64_t i, const Shape& shape) {
  return packed.slice0(i, i + 1).reshape(shape);
}

// A packed [2, B, L, H, D] block read as [2B, L, H, D] (rows along dim 1, as the windowed exchange moves them) and
// back, with n rows.
Shape rows_shape(const Shape& kv_shape, std::int64_t n) { return {2 * kv_shape[0], n, kv_shape[2], kv_shape[3]}; }
Shape kv_rows_shape(const Shape& kv_shape, std::int64_t n) { return {kv_shape[0], n, kv_shape[2], kv_shape[3]}; }

// Zeroes the rows i of t along dimension `dim` (size tokens.size()) whose token is -1 (padding rows), in runs.
// Padding rows hold whatever the caller left there (NaN included); as zeros, a masked probability 0 times them stays 0.
void zero_padding_rows(const TensorView& t, int dim, std::span<const std::int64_t> tokens, Stream stream) {
  const std::int64_t n = static_cast<std::int64_t>(tokens.size());
  if (n == 0 || t.numel() == 0) return;
  std::int64_t outer = 1;
  for (int d = 0; d < dim; ++d) outer *= t.dim(d);
  const TensorView rows = t.reshape({outer, n, t.numel() / (outer * n)});
  for (std::int64_t i = 0; i < n;) {
    if (tokens[static_cast<std::size_t>(i)] >= 0) {
      ++i;
      continue;
    }
    std::int64_t e = i;
    while (e < n && tokens[static_cast<std::size_t>(e)] < 0) ++e;
    for (std::int64_t o = 0; o < outer; ++o) fill(rows.slice0(o, o + 1).reshape({n, rows.dim(2)}).slice0(i, e), 0.0, stream);
    i = e;
  }
}

}  // namespace

struct RingAttention::Saved {
  Tensor q, k, v, out, lse;
  std::int64_t head_offset = 0;  // global index of q's head 0 (the dropout key)
};

RingAttention::RingAttention(const CpGroups& groups, const SequenceLayout& layout, const MhaCpConfig& config)
    : groups_(groups), layout_(layout), config_(config), rank_(groups.ring.rank()), size_(groups.ring.size()) {
  check_layout_matches(groups, layout, "ring attention");
  SEQPAR_CHECK(config.window >= 0, "window ", config.window, " must be >= 0 (0: no window)");
  // The kernels check this too, but only once the first (K, V) block is already on the wire.
  SEQPAR_CHECK(std::isfinite(config.scale), "ring attention: scale ", config.scale,
               " must be finite (0 or less: 1/sqrt(D))");
  SEQPAR_CHECK(config.window == 0 || config.causal, "a sliding window (window=", config.window, ") needs causal=true");
  SEQPAR_CHECK(std::isfinite(config.score_mods.softcap) && config.score_mods.softcap >= 0.0f, "ring attention: softcap ",
               config.score_mods.softcap, " must be finite and > 0 (0: no soft-capping)");
  config.dropout.validate("ring attention");
  positions_.reserve(size_);
  for (int r = 0; r < size_; ++r) positions_.push_back(layout_.ring_shard_positions(r));
  global_order_.resize(static_cast<std::size_t>(layout_.padded_len()));
  for (std::int64_t i = 0; i < layout_.padded_len(); ++i) global_order_[i] = i;
  // Packed or padded rows: every local query sees only its own document's slots (padding rows none).
  if (layout_.is_packed() || layout_.has_padding()) {
    doc_ = layout_.doc_bounds_of_slots(positions_[rank_]);
    tokens_ = layout_.tokens_of_slots(positions_[rank_]);  // dropout keys its mask on tokens, not slots
  }
  // packed or padded: rows of other documents and padding rows are never sent
  if (config.window > 0 && config.impl == RingImpl::kP2P) {
    plan_.emplace(positions_, rank_, config.window, window_doc_bounds(layout_, positions_));
  }
}

Device RingAttention::validate(const TensorView& q, const TensorView& k, const TensorView& v,
                               std::int64_t head_offset) const {
  const Device device = common_device({q, k, v}, "ring attention forward");
  SEQPAR_CHECK(q.ndim() == 4 && k.ndim() == 4 && v.ndim() == 4, "ring attention: q ", q.str(), ", k ", k.str(), ", v ",
               v.str(), " must all be [B, S_local, H, D]");
  SEQPAR_CHECK(k.shape() == v.shape(), "ring attention: k ", k.str(), " and v ", v.str(), " must have one shape");
  SEQPAR_CHECK(q.dtype() == k.dtype() && q.dtype() == v.dtype(), "ring attention: q, k, v dtypes differ (",
               dtype_name(q.dtype()), ", ", dtype_name(k.dtype()), ", ", dtype_name(v.dtype()), ")");
  // The kernels check this too, but only once the first block is already on the wire.
  SEQPAR_CHECK(is_floating(q.dtype()), "ring attention: q, k, v have dtype ", dtype_name(q.dtype()),
               ", expected a floating dtype (fp32, bf16, fp16 or fp64)");
  SEQPAR_CHECK(q.dim(0) == k.dim(0) && q.dim(3) == k.dim(3), "ring attention: q ", q.str(), " and k ", k.str(),
               " must share batch and head dim");
  SEQPAR_CHECK(q.dim(1) == layout_.ring_shard_len() && k.dim(1) == layout_.ring_shard_len(),
               "ring attention: local sequence length ", q.dim(1), " (q) / ", k.dim(1), " (k) must be padded_len ",
               layout_.padded_len(), " / ring_size ", size_, " = ", layout_.ring_shard_len());
  check_sequence_tensor(layout_, q, layout_.ring_shard_len(), 1, "ring attention", "q");
  SEQPAR_CHECK(k.dim(2) >= 1 && q.dim(2) % k.dim(2) == 0, "ring attention: Hq ", q.dim(2),
               " must be a multiple of Hkv ", k.dim(2));
  attn::MhaForwardArgs local;
  local.q = q;
  local.k = k;
  local.v = v;
  local.q_pos = local.k_pos = positions_[rank_];
  local.mask = mask();
  local.scale = config_.scale;
  local.mods = config_.score_mods;
  local.dropout = config_.dropout;
  local.head_offset = head_offset;
  local.q_tokens = tokens_;
  local.validate();
  return device;
}

DeviceAlloc RingAttention::alloc_for(const Saved& s) const { return {s.q.view().device(), groups_.stream}; }

attn::MhaForwardArgs RingAttention::block_args(const Saved& s, const TensorView& k, const TensorView& v,
                                               std::span<const std::int64_t> k_pos) const {
  attn::MhaForwardArgs a;
  a.q = s.q.view();
  a.k = k;
  a.v = v;
  a.q_pos = positions_[rank_];
  a.k_pos = k_pos;
  a.mask = mask();
  a.scale = config_.scale;
  a.mods = config_.score_mods;
  a.mods.sinks = {};
  a.dropout = config_.dropout;
  a.head_offset = s.head_offset;
  a.q_tokens = tokens_;
  return a;
}

Fingerprint mha_forward_fingerprint(std::string_view call, const MhaCpConfig& config,
                                    const SequenceLayout& layout, const TensorView& q, const TensorView& k,
                                    const TensorView& v) {
  Fingerprint fp(call);
  fp.add_text("impl", ring_impl_name(config.impl))
      .add_flag("causal", config.causal)
      .add_int("window", config.window)
      .add_real("scale", config.scale)
      .add_real("softcap", config.score_mods.softcap)
      .add_tensor("alibi_slopes", config.score_mods.alibi_slopes)
      .add_tensor("sinks", config.score_mods.sinks)
      .add_real("dropout p", config.dropout.p)
      .add_int("dropout seed", static_cast<std::int64_t>(config.dropout.seed));
  add_layout_fields(fp, layout);
  fp.add_tensors({{"q", q}, {"k", k}, {"v", v}});
  return fp;
}

void RingAttention::agree_forward(const TensorView& q, const TensorView& k, const TensorView& v) {
  forward_agreement_.run(groups_.ring, mha_forward_fingerprint("ring attention forward", config_, layout_, q, k, v),
                         groups_.stream);
}

void RingAttention::agree_backward(const CpContext& ctx, const TensorView& dout) {
  const std::shared_ptr<Saved> s = ctx.peek<Saved>(id_, "ring attention");
  Fingerprint fp("ring attention backward");
  fp.add_tensor("saved q", s->q.view()).add_tensor("saved k", s->k.view()).add_tensor("dout", dout);
  backward_agreement_.run(groups_.ring, fp, groups_.stream);
}

void RingAttention::sinks_grad(const Saved& s, const TensorView& delta, const TensorView& dsinks) {
  const TensorView& sinks = config_.score_mods.sinks;
  if (sinks.empty()) return;
  attn::mha_sinks_backward({delta, s.lse.view(), sinks}, dsinks, groups_.stream);
  WorkHandle w = groups_.ring.all_reduce(dsinks, ReduceOp::kSum);
  timed_wait(groups_.ring, w, &counters_.exposed_comm_s);
}

MhaCpOutput RingAttention::forward(const TensorView& q, const TensorView& k, const TensorView& v) {
  agree_forward(q, k, v);
  const DeviceAlloc alloc{validate(q, k, v, 0), groups_.stream};
  MhaCpOutput o;
  o.out = alloc.empty(q.shape(), q.dtype(), MemCategory::kWorkspace);
  o.lse = alloc.empty({q.dim(0), q.dim(2), q.dim(1)}, accumulator_dtype(q.dtype()), MemCategory::kWorkspace);
  o.ctx = run_forward(q, k, v, o.out, o.lse, 0);
  return o;
}

MhaCpGrads RingAttention::backward(CpContext&& ctx, const TensorView& dout, const TensorView& dlse) {
  agree_backward(ctx, dout);
  const std::shared_ptr<Saved> s = ctx.peek<Saved>(id_, "ring attention");
  const DeviceAlloc alloc = alloc_for(*s);
  MhaCpGrads g;
  g.dq = alloc.empty(s->q.shape(), s->q.dtype(), MemCategory::kWorkspace);
  g.dk = alloc.empty(s->k.shape(), s->k.dtype(), MemCategory::kWorkspace);
  g.dv = alloc.empty(s->v.shape(), s->v.dtype(), MemCategory::kWorkspace);
  const TensorView& sinks = config_.score_mods.sinks;
  if (!sinks.empty()) g.dsinks = alloc.empty(sinks.shape(), sinks.dtype(), MemCategory::kWorkspace);
  run_backward(std::move(ctx), dout, g.dq, g.dk, g.dv, g.dsinks, dlse);
  return g;
}

CpContext RingAttention::forward_into(const TensorView& q, const TensorView& k, const TensorView& v,
                                      const TensorView& out, const TensorView& lse, std::int64_t head_offset) {
  agree_forward(q, k, v);
  return run_forward(q, k, v, out, lse, head_offset);
}

void RingAttention::backward_into(CpContext&& ctx, const TensorView& dout, const TensorView& dq, const TensorView& dk,
                                  const TensorView& dv, const TensorView& dsinks, const TensorView& dlse) {
  agree_backward(ctx, dout);
  run_backward(std::move(ctx), dout, dq, dk, dv, dsinks, dlse);
}

CpContext RingAttention::run_forward(const TensorView& q, const TensorView& k, const TensorView& v,
                                     const TensorView& out, const TensorView& lse, std::int64_t head_offset) {
  const DeviceAlloc alloc{validate(q, k, v, head_offset), groups_.stream};
  common_device({q, out, lse}, "ring attention forward (q, out, lse)");
  check_shape(out, q.shape(), "ring attention out");
  check_shape(lse, {q.dim(0), q.dim(2), q.dim(1)}, "ring attention lse");
  check_dtype(lse, accumulator_dtype(q.dtype()), "ring attention lse");
  const CommStreamScope stream_scope(groups_);
  auto s = std::make_shared<Saved>();
  s->head_offset = head_offset;
  s->q = alloc.copy_of(q, q.dtype(), MemCategory::kSavedActivation);
  s->k = alloc.copy_of(k, k.dtype(), MemCategory::kSavedActivation);
  s->v = alloc.copy_of(v, v.dtype(), MemCategory::kSavedActivation);
  // Padding rows never reach a real token: the saved copies (what every block reads) hold zeros there.
  for (const Tensor* t : {&s->q, &s->k, &s->v}) zero_padding_rows(t->view(), 1, tokens_, groups_.stream);
  {
    const CommMeter meter(groups_, counters_);
    if (config_.impl == RingImpl::kP2P) {
      forward_p2p(*s, out, lse);
    } else {
      forward_allgather(*s, out, lse);
    }
    SEQPAR_LOG(kDebug) << "ring attention forward (" << ring_impl_name(config_.impl) << ", "
                       << layout_name(layout_.kind()) << ", ring " << rank_ << "/" << size_ << "): q " << q.str()
                       << ", sent " << meter.bytes_sent_so_far() << " bytes";
  }
  s->out = alloc.copy_of(out, out.dtype(), MemCategory::kSavedActivation);
  s->lse = alloc.copy_of(lse, lse.dtype(), MemCategory::kSavedActivation);
  return CpContext::make(id_, "ring attention", std::move(s));
}

void RingAttention::run_backward(CpContext&& ctx, const TensorView& dout, const TensorView& dq, const TensorView& dk,
                                 const TensorView& dv, const TensorView& dsinks, const TensorView& dlse) {
  const std::shared_ptr<Saved> saved = ctx.peek<Saved>(id_, "ring attention");
  const Saved& s = *saved;
  common_device({s.q.view(), dout, dq, dk, dv}, "ring attention backward (saved tensors, dout, dq, dk, dv)");
  check_shape(dout, s.q.shape(), "ring attention dout");
  SEQPAR_CHECK(is_floating(dout.dtype()), "ring attention: dout has dtype ", dtype_name(dout.dtype()),
               ", expected a floating dtype");
  check_grad_input(dq, s.q.shape(), "ring attention dq");
  check_grad_input(dk, s.k.shape(), "ring attention dk");
  check_grad_input(dv, s.v.shape(), "ring attention dv");
  if (!config_.score_mods.sinks.empty())
    attn::MhaSinksBackwardArgs{s.lse, s.lse, config_.score_mods.sinks}.validate(dsinks, groups_.stream);
  if (!dlse.empty()) {
    common_device({s.q.view(), dlse}, "ring attention backward (saved tensors, dlse)");
    check_shape(dlse, s.lse.shape(), "ring attention dlse");
    SEQPAR_CHECK(dlse.dtype() == DType::kFloat32 || dlse.dtype() == DType::kFloat64, "ring attention: dlse has dtype ",
                 dtype_name(dlse.dtype()), ", expected fp32 or fp64");
  }
  ctx.consume<Saved>(id_, "ring attention");
  const CommStreamScope stream_scope(groups_);
  const CommMeter meter(groups_, counters_);
  Tensor delta = alloc_for(s).empty(s.lse.shape(), delta_dtype(s.q.dtype(), dout.dtype()), MemCategory::kWorkspace);
  attn::mha_backward_delta(s.out.view(), dout, delta.view(), groups_.stream);
  if (!dlse.empty()) {
    // d lse_i / d a_ij = p_ij: the lse gradient joins ds as ds_ij = p_ij (dp_ij - (delta_i - dlse_i)), and dsinks
    // takes the same delta - dlse (attn::MhaBackwardArgs::dlse).
    const Tensor d = alloc_for(s).copy_of(dlse, delta.dtype(), MemCategory::kWorkspace);
    add_scaled_inplace(delta.view(), d.view(), -1.0, groups_.stream);
  }
  // a padding row's dout may hold anything: its delta is 0 (the kernels skip the row; dsinks reads delta)
  zero_padding_rows(delta.view(), 2, tokens_, groups_.stream);
  // The kernels read delta; out goes with it only while delta is rowsum(dout * out) of every row (no dlse folded
  // in, no zeroed padding row), since a device backend may recompute delta from out (attn::MhaBackwardArgs::out).
  const TensorView out_of_delta = dlse.empty() && !layout_.has_padding() ? s.out.view() : TensorView();
  if (config_.impl == RingImpl::kP2P) {
    backward_p2p(s, out_of_delta, dout, delta, dq, dk, dv);
  } else {
    backward_allgather(s, out_of_delta, dout, delta, dq, dk, dv);
  }
  sinks_grad(s, delta.view(), dsinks);
  SEQPAR_LOG(kDebug) << "ring attention backward (" << ring_impl_name(config_.impl) << ", ring " << rank_ << "/"
                     << size_ << "): sent " << meter.bytes_sent_so_far() << " bytes";
}

// ---- p2p -------------------------------------------------------------------------------------------------

void RingAttention::forward_p2p(const Saved& s, const TensorView& out, const TensorView& lse) {
  const DeviceAlloc alloc = alloc_for(s);
  const TensorView& q = s.q.view();
  const Shape& kv_shape = s.k.shape();
  const double flops_per_pair = 4.0 * static_cast<double>(q.dim(0) * q.dim(2) * q.dim(3));
  const attn::MaskSpec mask = this->mask();
  const Stream stream = groups_.stream;

  Tensor kv = alloc.empty(packed_shape(kv_shape, 2), q.dtype(), MemCategory::kCommBuffer);
  alloc.copy_convert(s.k.view(), part(kv.view(), 0, kv_shape));
  alloc.copy_convert(s.v.view(), part(kv.view(), 1, kv_shape));
  // The merge state: out in the accumulator dtype, the running lse and every block's lse in fp64, so that the merge
  // weights exp(lse_b - lse) carry no rounding of an fp32 lse (attn::lse_merge); lse is rounded once at the end.
  const DType acc_dtype = accumulator_dtype(q.dtype());
  Tensor acc_out = alloc.zeros(q.shape(), acc_dtype, MemCategory::kWorkspace);
  Tensor acc_lse = alloc.empty(lse.shape(), DType::kFloat64, MemCategory::kWorkspace);
  fill(acc_lse.view(), -std::numeric_limits<double>::infinity(), stream);
  Tensor block_out = alloc.empty(q.shape(), acc_dtype, MemCategory::kWorkspace);
  Tensor block_lse = alloc.empty(lse.shape(), DType::kFloat64, MemCategory::kWorkspace);

  // One block of keys (all of a rank's, or the rows the window lets through) merged into the running state.
  auto merge_block = [&](const TensorView& k, const TensorView& v, std::span<const std::int64_t> k_pos) {
    const std::int64_t pairs = attn::visible_pairs(positions_[rank_], k_pos, mask);
    if (pairs == 0) return;  // nothing visible: never computed
    const ScopedTimer timer(counters_.compute_s);
    attn::mha_forward(block_args(s, k, v, k_pos), block_out.view(), block_lse.view(), stream);
    attn::lse_merge(acc_out.view(), acc_lse.view(), block_out.view(), block_lse.view(), stream);
    counters_.flops += flops_per_pair * static_cast<double>(pairs);
  };
  if (plan_) {
    window_exchange(
        groups_.ring, *plan_, kv.view().reshape(rows_shape(kv_shape, kv_shape[1])), kTagKv,
        [&](int src, const TensorView& block, std::span<const std::int64_t> rows) {
          const TensorView packed = block.reshape(packed_shape(kv_rows_shape(kv_shape, block.dim(1)), 2));
          const Shape rshape = kv_rows_shape(kv_shape, block.dim(1));
          merge_block(part(packed, 0, rshape), part(packed, 1, rshape), positions_of_rows(positions_[src], rows));
        },
        &counters_.exposed_comm_s, stream);
    counters_.message_rounds += static_cast<std::int64_t>(plan_->rounds().size());
  } else {
    ring_circulate(
        groups_.ring, kv.view(), kTagKv,
        [&](int src, const TensorView& block) {
          merge_block(part(block, 0, kv_shape), part(block, 1, kv_shape), positions_[src]);
        },
        &counters_.exposed_comm_s, stream);
    counters_.message_rounds += size_ - 1;
  }
  // every block merged: the sink joins each row once
  if (!config_.score_mods.sinks.empty())
    attn::mha_apply_sinks(acc_out.view(), acc_lse.view(), config_.score_mods.sinks, stream);
  alloc.copy_convert(acc_out.view(), out);
  alloc.copy_convert(acc_lse.view(), lse);
}

void RingAttention::backward_p2p(const Saved& s, const TensorView& out, const TensorView& dout, const TensorView& delta,
                                 const TensorView& dq, const TensorView& dk, const TensorView& dv) {
  const DeviceAlloc alloc = alloc_for(s);
  const TensorView& q = s.q.view();
  const Shape& kv_shape = s.k.shape();
  const double flops_per_pair = 10.0 * static_cast<double>(q.dim(0) * q.dim(2) * q.dim(3));  // 2.5 x forward
  const attn::MaskSpec mask = this->mask();
  const Shape pshape = packed_shape(kv_shape, 2);
  const Stream stream = groups_.stream;

  const DType acc_dtype = accumulator_dtype(q.dtype());
  Tensor dq_acc = alloc.zeros(q.shape(), acc_dtype, MemCategory::kWorkspace);
  Tensor kv = alloc.empty(pshape, q.dtype(), MemCategory::kCommBuffer);
  alloc.copy_convert(s.k.view(), part(kv.view(), 0, kv_shape));
  alloc.copy_convert(s.v.view(), part(kv.view(), 1, kv_shape));
  Tensor dkv = alloc.empty(pshape, acc_dtype, MemCategory::kWorkspace);

  attn::MhaBackwardArgs args;
  args.out = out;
  args.dout = dout;
  args.lse = s.lse.view();
  args.delta = delta;
  // One block's contribution: dq here, (dk, dv) of its rows into `grad` (packed [2, B, rows, Hkv, D]).
  auto block_grads = [&](const TensorView& k, const TensorView& v, std::span<const std::int64_t> k_pos,
                         const TensorView& dk_block, const TensorView& dv_block) {
    const std::int64_t pairs = attn::visible_pairs(positions_[rank_], k_pos, mask);
    if (pairs == 0) return;
    const ScopedTimer timer(counters_.compute_s);
    args.fwd = block_args(s, k, v, k_pos);
    attn::mha_backward(args, dq_acc.view(), dk_block, dv_block, true, stream);
    counters_.flops += flops_per_pair * static_cast<double>(pairs);
  };
  if (plan_) {
    window_exchange_with_grad(
        groups_.ring, *plan_, kv.view().reshape(rows_shape(kv_shape, kv_shape[1])), rows_shape(kv_shape, kv_shape[1]),
        dkv.view(), kTagKv,
        [&](int src, const TensorView& block, std::span<const std::int64_t> rows, const TensorView& grad) {
          const Shape rshape = kv_rows_shape(kv_shape, block.dim(1));
          const TensorView packed = block.reshape(packed_shape(rshape, 2));
          const TensorView packed_grad = grad.reshape(packed_shape(rshape, 2));
          block_grads(part(packed, 0, rshape), part(packed, 1, rshape), positions_of_rows(positions_[src], rows),
                      part(packed_grad, 0, rshape), part(packed_grad, 1, rshape));
        },
        &counters_.exposed_comm_s, stream);
    counters_.message_rounds += static_cast<std::int64_t>(plan_->rounds().size());
  } else {
    ring_circulate_with_grad(
        groups_.ring, kv.view(), pshape, dkv.view(), kTagKv,
        [&](int src, const TensorView& block, const TensorView& grad) {
          block_grads(part(block, 0, kv_shape), part(block, 1, kv_shape), positions_[src], part(grad, 0, kv_shape),
                      part(grad, 1, kv_shape));
        },
        &counters_.exposed_comm_s, stream);
    counters_.message_rounds += size_ > 1 ? size_ : 0;
  }
  alloc.copy_convert(part(dkv.view(), 0, kv_shape), dk);
  alloc.copy_convert(part(dkv.view(), 1, kv_shape), dv);
  alloc.copy_convert(dq_acc.view(), dq);
}

// ---- all-gather ------------------------------------------------------------------------------------------

attn::MhaForwardArgs RingAttention::gather_kv_global(const Saved& s, Tensor& k_full, Tensor& v_full) {
  const DeviceAlloc alloc = alloc_for(s);
  const Shape& kv_shape = s.k.shape();
  const Shape full_shape = {kv_shape[0], layout_.padded_len(), kv_shape[2], kv_shape[3]};
  k_full = alloc.empty(full_shape, s.k.dtype(), MemCategory::kCommBuffer);
  v_full = alloc.empty(full_shape, s.k.dtype(), MemCategory::kCommBuffer);
  Tensor local = alloc.empty(packed_shape(kv_shape, 2), s.k.dtype(), MemCategory::kCommBuffer);
  alloc.copy_convert(s.k.view(), part(local.view(), 0, kv_shape));
  alloc.copy_convert(s.v.view(), part(local.view(), 1, kv_shape));
  Tensor gathered = alloc.empty(packed_shape(packed_shape(kv_shape, 2), size_), s.k.dtype(), MemCategory::kCommBuffer);
  WorkHandle w = groups_.ring.all_gather(local.view(), gathered.view());
  timed_wait(groups_.ring, w, &counters_.exposed_comm_s);
  for (int r = 0; r < size_; ++r) {
    const TensorView rank_kv = gathered.view().slice0(r, r + 1).reshape(packed_shape(kv_shape, 2));
    unshard_sequence(part(rank_kv, 0, kv_shape), positions_[r], k_full.view(), alloc.stream);
    unshard_sequence(part(rank_kv, 1, kv_shape), positions_[r], v_full.view(), alloc.stream);
  }
  attn::MhaForwardArgs a = block_args(s, k_full.view(), v_full.view(), global_order_);
  a.mods.sinks = config_.score_mods.sinks;  // one call over every key: the sink joins it
  return a;
}

void RingAttention::forward_allgather(const Saved& s, const TensorView& out, const TensorView& lse) {
  const TensorView& q = s.q.view();
  Tensor k_full, v_full;
  const attn::MhaForwardArgs args = gather_kv_global(s, k_full, v_full);
  {
    const ScopedTimer timer(counters_.compute_s);
    attn::mha_forward(args, out, lse, groups_.stream);
  }
  counters_.flops += 4.0 * static_cast<double>(q.dim(0) * q.dim(2) * q.dim(3)) *
                     static_cast<double>(attn::visible_pairs(args.q_pos, args.k_pos, args.mask));
}

void RingAttention::backward_allgather(const Saved& s, const TensorView& out, const TensorView& dout,
                                       const TensorView& delta, const TensorView& dq, const TensorView& dk,
                                       const TensorView& dv) {
  const DeviceAlloc alloc = alloc_for(s);
  const TensorView& q = s.q.view();
  const Shape& kv_shape = s.k.shape();
  Tensor k_full, v_full;
  attn::MhaBackwardArgs args;
  args.fwd = gather_kv_global(s, k_full, v_full);
  const Shape& full_shape = k_full.shape();
  args.out = out;
  args.dout = dout;
  args.lse = s.lse.view();
  args.delta = delta;
  const DType acc_dtype = accumulator_dtype(q.dtype());
  Tensor dk_full = alloc.zeros(full_shape, acc_dtype, MemCategory::kWorkspace);
  Tensor dv_full = alloc.zeros(full_shape, acc_dtype, MemCategory::kWorkspace);
  Tensor dq_acc = alloc.zeros(q.shape(), acc_dtype, MemCategory::kWorkspace);
  {
    const ScopedTimer timer(counters_.compute_s);
    attn::mha_backward(args, dq_acc.view(), dk_full.view(), dv_full.view(), true, groups_.stream);
  }
  counters_.flops += 10.0 * static_cast<double>(q.dim(0) * q.dim(2) * q.dim(3)) *
                     static_cast<double>(attn::visible_pairs(args.fwd.q_pos, args.fwd.k_pos, args.fwd.mask));

  // Pack every rank's rows (in its layout order) and reduce-scatter the sums (accumulator dtype).
  const Shape pshape = packed_shape(kv_shape, 2);
  Tensor send = alloc.empty(packed_shape(pshape, size_), acc_dtype, MemCategory::kCommBuffer);
  for (int r = 0; r < size_; ++r) {
    const TensorView rank_part = send.view().slice0(r, r + 1).reshape(pshape);
    shard_sequence(dk_full.view(), positions_[r], part(rank_part, 0, kv_shape), alloc.stream);
    shard_sequence(dv_full.view(), positions_[r], part(rank_part, 1, kv_shape), alloc.stream);
  }
  Tensor recv = alloc.empty(pshape, acc_dtype, MemCategory::kCommBuffer);
  WorkHandle rs = groups_.ring.reduce_scatter(send.view(), recv.view(), ReduceOp::kSum);
  timed_wait(groups_.ring, rs, &counters_.exposed_comm_s);
  alloc.copy_convert(part(recv.view(), 0, kv_shape), dk);
  alloc.copy_convert(part(recv.view(), 1, kv_shape), dv);
  alloc.copy_convert(dq_acc.view(), dq);
}

}  // namespace seqpar
