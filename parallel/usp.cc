#include "parallel/usp.h"

#include "runtime/tensor_checks.h"
#include "runtime/tensor_ops.h"

namespace seqpar {
namespace {

void check_4d(const TensorView& t, const char* what) {
  SEQPAR_CHECK(t.ndim() == 4, what, " ", t.str(), " must be [B, S, H, D]");
}

// The inner ring's configuration: the score modifiers' per-head vectors cut to this rank's Ulysses heads
// [u H / Pu, (u + 1) H / Pu). Vectors of another shape are passed on whole, for forward() to reject.
MhaCpConfig ring_config(const CpGroups& groups, const MhaCpConfig& config) {
  MhaCpConfig c = config;
  const std::int64_t pu = groups.ulysses_size(), u = groups.ulysses.rank();
  for (TensorView* t : {&c.score_mods.alibi_slopes, &c.score_mods.sinks}) {
    if (t->empty() || t->ndim() != 1 || t->dim(0) % pu != 0) continue;
    const std::int64_t n = t->dim(0) / pu;
    *t = t->slice0(u * n, (u + 1) * n);
  }
  return c;
}

}  // namespace

struct MhaCp::Saved {
  CpContext ring;  // the inner ring attention's context
  UlyssesHeads heads;
  Shape q_shape;  // what dout must match
  DType q_dtype;  // the gradients' dtype
  Device device;  // of the forward's inputs
};

MhaCp::MhaCp(const CpGroups& groups, const SequenceLayout& layout, const MhaCpConfig& config)
    : groups_(groups),
      layout_(layout),
      config_(config),
      positions_((check_layout_matches(groups, layout, "USP"), layout.positions(groups.cp_rank()))),
      ring_attn_(groups, layout, ring_config(groups, config)) {}

MhaCp::MhaCp(const CpGrid& grid, const SequenceLayout& layout, const MhaCpConfig& config)
    : MhaCp(CpGroups::from(grid), layout, config) {}

MhaCp::MhaCp(const CpGrid& grid, std::int64_t seq_len, const MhaCpConfig& config,
                           LayoutKind kind)
    : MhaCp(grid, SequenceLayout::for_groups(CpGroups::from(grid), seq_len, kind), config) {}

MhaCpOutput MhaCp::forward(const TensorView& q, const TensorView& k, const TensorView& v) {
  forward_agreement_.run(groups_.cp, mha_forward_fingerprint("USP forward", config_, layout_, q, k, v), groups_.stream);
  const DeviceAlloc alloc{common_device({q, k, v}, "USP forward"), groups_.stream};
  check_4d(q, "USP q");
  check_4d(k, "USP k");
  check_4d(v, "USP v");
  SEQPAR_CHECK(k.shape() == v.shape(), "USP: k ", k.str(), " and v ", v.str(), " must have one shape");
  SEQPAR_CHECK(q.dim(1) == layout_.local_len() && k.dim(1) == layout_.local_len(), "USP: local sequence length ",
               q.dim(1), " must be padded_len ", layout_.padded_len(), " / (ring_size ", layout_.ring_size(),
               " x ulysses_size ", layout_.ulysses_size(), ") = ", layout_.local_len());
  check_sequence_tensor(layout_, q, layout_.local_len(), 1, "USP", "q");
  SEQPAR_CHECK(q.dtype() == k.dtype() && q.dtype() == v.dtype(), "USP: q, k, v dtypes differ (", dtype_name(q.dtype()),
               ", ", dtype_name(k.dtype()), ", ", dtype_name(v.dtype()), ")");
  // Checked here, not only by the ring after the all-to-all, so that no message is sent with bad inputs.
  SEQPAR_CHECK(is_floating(q.dtype()), "USP: q, k, v have dtype ", dtype_name(q.dtype()),
               ", expected a floating dtype (fp32, bf16, fp16 or fp64)");
  SEQPAR_CHECK(q.dim(0) == k.dim(0) && q.dim(3) == k.dim(3), "USP: q ", q.str(), " and k ", k.str(),
               " must share batch (dim 0) and head dim (dim 3)");
  const UlyssesHeads heads(q.dim(2), k.dim(2), groups_.ulysses_size());
  // The MHA kernels' own checks on the local shapes (devices included) before the all-to-all.
  attn::MhaForwardArgs local;
  local.q = q;
  local.k = k;
  local.v = v;
  local.q_pos = local.k_pos = positions_;
  local.mask = {config_.causal, config_.window};
  local.scale = config_.scale;
  local.mods = config_.score_mods;
  local.dropout = config_.dropout;
  local.validate();
  const CommStreamScope stream_scope(groups_);
  const UlyssesExchange a2a(groups_, counters_);
  const int pu = groups_.ulysses_size();
  const std::int64_t B = q.dim(0), sl = q.dim(1), hq = heads.hq;
  const DType lse_dtype = accumulator_dtype(q.dtype());
  MhaCpOutput o;
  auto alloc_outputs = [&] {
    o.out = alloc.empty(q.shape(), q.dtype(), MemCategory::kWorkspace);
    o.lse = alloc.empty({B, hq, sl}, lse_dtype, MemCategory::kWorkspace);
  };
  CpContext ring_ctx;
  if (pu == 1) {
    // A Ulysses group of one moves nothing: the ring reads the caller's tensors and writes the outputs in place.
    alloc_outputs();
    ring_ctx = ring_attn_.run_forward(q, k, v, o.out.view(), o.lse.view(), 0);
  } else {
    Tensor q_h = a2a.to_heads(q);
    Tensor k_h = a2a.kv_to_heads(k, heads);
    Tensor v_h = a2a.kv_to_heads(v, heads);
    Tensor out_h = alloc.empty(q_h.shape(), q.dtype(), MemCategory::kWorkspace);
    Tensor lse_h = alloc.empty({B, hq / pu, pu * sl}, lse_dtype, MemCategory::kWorkspace);
    // This rank holds query heads [u Hq / Pu, (u + 1) Hq / Pu) (ulysses.h): the global heads of the dropout key.
    const std::int64_t head_offset = groups_.ulysses.rank() * (hq / pu);
    ring_ctx = ring_attn_.run_forward(q_h.view(), k_h.view(), v_h.view(), out_h.view(), lse_h.view(), head_offset);
    alloc_outputs();
    a2a.to_sequence(out_h.view(), o.out.view());
    a2a.lse_to_sequence(lse_h.view(), o.lse.view());
  }
  o.ctx = CpContext::make(
      id_, "USP", std::make_shared<Saved>(Saved{std::move(ring_ctx), heads, q.shape(), q.dtype(), alloc.device}));
  return o;
}

MhaCpGrads MhaCp::backward(CpContext&& ctx, const TensorView& dout, const TensorView& dlse) {
  const std::shared_ptr<Saved> s = ctx.peek<Saved>(id_, "USP");
  {
    Fingerprint fp("USP backward");
    fp.add_text("saved q", str_cat(dtype_name(s->q_dtype), shape_str(s->q_shape))).add_tensor("dout", dout);
    backward_agreement_.run(groups_.cp, fp, groups_.stream);
  }
  check_4d(dout, "USP dout");
  const DeviceAlloc alloc{common_device({dout}, "USP backward"), groups_.stream};
  SEQPAR_CHECK(alloc.device == s->device, "USP backward: dout ", dout.str(), " must be on the forward's device ",
               s->device.str());
  // dout must have q's shape (checked before the all-to-all, so that a bad dout sends nothing); gradients come
  // back in q's dtype, whatever dout's floating dtype.
  check_shape(dout, s->q_shape, "USP dout");
  SEQPAR_CHECK(is_floating(dout.dtype()), "USP: dout has dtype ", dtype_name(dout.dtype()),
               ", expected a floating dtype");
  const std::int64_t hq_all = s->q_shape[2];
  if (!dlse.empty()) {
    SEQPAR_CHECK(common_device({dout, dlse}, "USP backward (dout, dlse)") == s->device, "USP backward: dlse ",
                 dlse.str(), " must be on the forward's device ", s->device.str());
    check_shape(dlse, {s->q_shape[0], hq_all, s->q_shape[1]}, "USP dlse");
    SEQPAR_CHECK(dlse.dtype() == DType::kFloat32 || dlse.dtype() == DType::kFloat64, "USP: dlse has dtype ",
                 dtype_name(dlse.dtype()), ", expected fp32 or fp64");
  }
  ctx.consume<Saved>(id_, "USP");
  const CommStreamScope stream_scope(groups_);
  const UlyssesExchange a2a(groups_, counters_);
  const UlyssesHeads& heads = s->heads;
  const std::int64_t B = dout.dim(0), sl = dout.dim(1), D = dout.dim(3), hkv = heads.hkv;
  const DType dtype = s->q_dtype;
  Tensor dout_cast;
  if (dout.dtype() != dtype) dout_cast = alloc.copy_of(dout, dtype, MemCategory::kWorkspace);
  const TensorView dout_q = dout.dtype() != dtype ? dout_cast.view() : dout;
  const TensorView& sinks = config_.score_mods.sinks;
  const int pu = groups_.ulysses_size();
  MhaCpGrads g;
  auto alloc_grads = [&] {
    g.dq = alloc.empty(s->q_shape, dtype, MemCategory::kWorkspace);
    g.dk = alloc.empty({B, sl, hkv, D}, dtype, MemCategory::kWorkspace);
    g.dv = alloc.empty({B, sl, hkv, D}, dtype, MemCategory::kWorkspace);
  };
  if (pu == 1) {  // as in forward: nothing moves, the ring writes the gradients in place
    if (!sinks.empty()) g.dsinks = alloc.empty(sinks.shape(), sinks.dtype(), MemCategory::kWorkspace);
    alloc_grads();
    ring_attn_.run_backward(std::move(s->ring), dout_q, g.dq.view(), g.dk.view(), g.dv.view(), g.dsinks, dlse);
    return g;
  }
  Tensor dout_h = a2a.to_heads(dout_q);
  // dlse [B, Hq, S_local] -> [B, Hq / Pu, Pu S_local], as lse came back: moved as [B, S_local, Hq, 1] rows.
  Tensor dlse_h;
  if (!dlse.empty()) {
    Tensor rows = alloc.empty({B, sl, hq_all, 1}, dlse.dtype(), MemCategory::kWorkspace);
    for (std::int64_t b = 0; b < B; ++b)
      swap_outer_dims(dlse.slice0(b, b + 1), hq_all, sl, rows.view().slice0(b, b + 1), groups_.stream);
    const Tensor rows_h = a2a.to_heads(rows.view());
    dlse_h = alloc.empty({B, hq_all / pu, pu * sl}, dlse.dtype(), MemCategory::kWorkspace);
    for (std::int64_t b = 0; b < B; ++b)
      swap_outer_dims(rows_h.view().slice0(b, b + 1), pu * sl, hq_all / pu, dlse_h.view().slice0(b, b + 1),
                      groups_.stream);
  }

  // Replica gradients travel in the accumulator dtype (fp32, fp64 for fp64) so that their sum is rounded once.
  const DType kv_grad_dtype = heads.replication == 1 ? dtype : accumulator_dtype(dtype);
  Tensor dq_h = alloc.empty(dout_h.shape(), dtype, MemCategory::kWorkspace);
  Tensor dk_h = alloc.empty({B, pu * sl, heads.hkv_expanded / pu, D}, kv_grad_dtype, MemCategory::kWorkspace);
  Tensor dv_h = alloc.empty(dk_h.shape(), kv_grad_dtype, MemCategory::kWorkspace);
  Tensor dsinks_h;  // the sums over the ring group for this rank's heads, then gathered over the Ulysses group
  if (!sinks.empty()) dsinks_h = alloc.empty({sinks.dim(0) / pu}, sinks.dtype(), MemCategory::kWorkspace);
  ring_attn_.run_backward(std::move(s->ring), dout_h.view(), dq_h.view(), dk_h.view(), dv_h.view(), dsinks_h,
                          dlse_h.defined() ? dlse_h.view() : TensorView{});

  if (!sinks.empty()) {
    const Tensor all = a2a.gather_heads_dim1(dsinks_h.view().reshape({1, sinks.dim(0) / pu}));
    g.dsinks = alloc.empty(sinks.shape(), sinks.dtype(), MemCategory::kWorkspace);
    alloc.copy_convert(all.view().reshape(sinks.shape()), g.dsinks.view());
  }
  alloc_grads();
  a2a.to_sequence(dq_h.view(), g.dq.view());
  a2a.kv_grad_to_sequence(dk_h.view(), heads, g.dk.view());
  a2a.kv_grad_to_sequence(dv_h.view(), heads, g.dv.view());
  return g;
}

void MhaCp::set_stream(Stream stream) {
  groups_.stream = stream;
  ring_attn_.set_stream(stream);
}

CpCounters MhaCp::counters() const {
  CpCounters c = counters_;
  c += ring_attn_.counters();
  return c;
}

void MhaCp::reset_counters() {
  counters_.reset();
  ring_attn_.reset_counters();
}

}  // namespace seqpar
