#include "parallel/ulysses.h"

#include <cstring>

#include "runtime/logging.h"
#include "runtime/tensor_ops.h"
#include "runtime/timer.h"

namespace seqpar {
namespace {

void check_4d(const TensorView& t, const char* what) {
  check_cpu(t, what);
  SEQPAR_CHECK(t.ndim() == 4, what, " ", t.str(), " must be [B, S, H, D]");
}

}  // namespace

UlyssesHeads::UlyssesHeads(std::int64_t hq_, std::int64_t hkv_, int pu) : hq(hq_), hkv(hkv_), ulysses_size(pu) {
  SEQPAR_CHECK(hkv >= 1 && hq >= 1 && hq % hkv == 0, "heads: Hq ", hq, " must be a positive multiple of Hkv ", hkv);
  SEQPAR_CHECK(hq % pu == 0, "Ulysses: Hq ", hq, " (Hkv ", hkv, ") must be divisible by ulysses_size ", pu);
  if (hkv % pu == 0) {
    hkv_expanded = hkv;
    replication = 1;
  } else {
    SEQPAR_CHECK(hkv < pu && pu % hkv == 0, "Ulysses: Hkv ", hkv, " (Hq ", hq, ") must be divisible by ulysses_size ",
                 pu, ", or divide it (then each KV head is replicated to ulysses_size / Hkv ranks)");
    hkv_expanded = pu;
    replication = pu / hkv;
  }
}

void ulysses_scatter_heads(Communicator& ulysses, const TensorView& in, const TensorView& out) {
  check_4d(in, "ulysses_scatter_heads input");
  check_4d(out, "ulysses_scatter_heads output");
  const int pu = ulysses.size();
  const std::int64_t B = in.dim(0), sl = in.dim(1), H = in.dim(2), D = in.dim(3);
  SEQPAR_CHECK(H % pu == 0, "ulysses_scatter_heads: ", H, " heads not divisible by ulysses_size ", pu);
  check_shape(out, {B, pu * sl, H / pu, D}, "ulysses_scatter_heads output");
  check_dtype(out, in.dtype(), "ulysses_scatter_heads output");
  if (pu == 1) {
    copy_convert(in, out);
    return;
  }
  const std::int64_t hp = H / pu;
  const std::size_t esz = dtype_size(in.dtype());
  const std::size_t run = static_cast<std::size_t>(hp * D) * esz;  // one token's heads of one destination
  // send[j][b][s][h'][d] = in[b][s][j*hp + h'][d]
  Tensor send = Tensor::empty({pu, B, sl, hp, D}, in.dtype(), MemCategory::kCommBuffer);
  const char* src = static_cast<const char*>(in.data());
  char* dst = static_cast<char*>(send.data());
  for (int j = 0; j < pu; ++j)
    for (std::int64_t bs = 0; bs < B * sl; ++bs)
      std::memcpy(dst + (j * B * sl + bs) * run, src + (bs * H + j * hp) * D * esz, run);
  // recv[j][b][s][h'][d] comes from rank j = out[b][j*sl + s][h'][d]
  Tensor recv = Tensor::empty({pu, B, sl, hp, D}, in.dtype(), MemCategory::kCommBuffer);
  ulysses.all_to_all(send.view(), recv.view())->wait();
  const std::size_t rows = static_cast<std::size_t>(sl) * run;
  for (int j = 0; j < pu; ++j)
    for (std::int64_t b = 0; b < B; ++b)
      std::memcpy(static_cast<char*>(out.data()) + ((b * pu + j) * sl) * run,
                  static_cast<const char*>(recv.data()) + (j * B + b) * rows, rows);
}

void ulysses_gather_heads(Communicator& ulysses, const TensorView& in, const TensorView& out) {
  check_4d(in, "ulysses_gather_heads input");
  check_4d(out, "ulysses_gather_heads output");
  const int pu = ulysses.size();
  const std::int64_t B = out.dim(0), sl = out.dim(1), H = out.dim(2), D = out.dim(3);
  SEQPAR_CHECK(H % pu == 0, "ulysses_gather_heads: ", H, " heads not divisible by ulysses_size ", pu);
  check_shape(in, {B, pu * sl, H / pu, D}, "ulysses_gather_heads input");
  check_dtype(in, out.dtype(), "ulysses_gather_heads input");
  if (pu == 1) {
    copy_convert(in, out);
    return;
  }
  const std::int64_t hp = H / pu;
  const std::size_t esz = dtype_size(in.dtype());
  const std::size_t run = static_cast<std::size_t>(hp * D) * esz;
  const std::size_t rows = static_cast<std::size_t>(sl) * run;
  // send[j][b] = in[b][j*sl : (j+1)*sl] (the sequence piece that rank j owns)
  Tensor send = Tensor::empty({pu, B, sl, hp, D}, in.dtype(), MemCategory::kCommBuffer);
  for (int j = 0; j < pu; ++j)
    for (std::int64_t b = 0; b < B; ++b)
      std::memcpy(static_cast<char*>(send.data()) + (j * B + b) * rows,
                  static_cast<const char*>(in.data()) + ((b * pu + j) * sl) * run, rows);
  Tensor recv = Tensor::empty({pu, B, sl, hp, D}, in.dtype(), MemCategory::kCommBuffer);
  ulysses.all_to_all(send.view(), recv.view())->wait();
  // recv[j][b][s] holds heads [j*hp, (j+1)*hp) of out[b][s]
  char* dst = static_cast<char*>(out.data());
  const char* src = static_cast<const char*>(recv.data());
  for (int j = 0; j < pu; ++j)
    for (std::int64_t bs = 0; bs < B * sl; ++bs)
      std::memcpy(dst + (bs * H + j * hp) * D * esz, src + (j * B * sl + bs) * run, run);
}

void ulysses_gather_heads_bhs(Communicator& ulysses, const TensorView& in, const TensorView& out) {
  check_cpu(in, "ulysses_gather_heads_bhs input");
  check_cpu(out, "ulysses_gather_heads_bhs output");
  const int pu = ulysses.size();
  SEQPAR_CHECK(out.ndim() == 3 && out.dim(1) % pu == 0, "ulysses_gather_heads_bhs: output ", out.str(),
               " must be [B, H, S_local] with H divisible by ulysses_size ", pu);
  const std::int64_t B = out.dim(0), H = out.dim(1), sl = out.dim(2), hp = H / pu;
  check_shape(in, {B, hp, pu * sl}, "ulysses_gather_heads_bhs input");
  check_dtype(in, out.dtype(), "ulysses_gather_heads_bhs input");
  if (pu == 1) {
    copy_convert(in, out);
    return;
  }
  const std::size_t esz = dtype_size(in.dtype());
  const std::size_t run = static_cast<std::size_t>(sl) * esz;
  // send[j][b][h'] = in[b][h'][j*sl : (j+1)*sl]; recv[j][b][h'] = out[b][j*hp + h'][:]
  Tensor send = Tensor::empty({pu, B, hp, sl}, in.dtype(), MemCategory::kCommBuffer);
  for (int j = 0; j < pu; ++j)
    for (std::int64_t bh = 0; bh < B * hp; ++bh)
      std::memcpy(static_cast<char*>(send.data()) + (j * B * hp + bh) * run,
                  static_cast<const char*>(in.data()) + (bh * pu + j) * run, run);
  Tensor recv = Tensor::empty({pu, B, hp, sl}, in.dtype(), MemCategory::kCommBuffer);
  ulysses.all_to_all(send.view(), recv.view())->wait();
  for (int j = 0; j < pu; ++j)
    for (std::int64_t b = 0; b < B; ++b)
      std::memcpy(static_cast<char*>(out.data()) + (b * H + j * hp) * run,
                  static_cast<const char*>(recv.data()) + (j * B + b) * hp * run, hp * run);
}

void replicate_kv_heads(const TensorView& in, std::int64_t r, const TensorView& out) {
  check_4d(in, "replicate_kv_heads input");
  const std::int64_t B = in.dim(0), S = in.dim(1), H = in.dim(2), D = in.dim(3);
  check_shape(out, {B, S, H * r, D}, "replicate_kv_heads output");
  check_dtype(out, in.dtype(), "replicate_kv_heads output");
  const std::size_t row = static_cast<std::size_t>(D) * dtype_size(in.dtype());
  for (std::int64_t bs = 0; bs < B * S; ++bs)
    for (std::int64_t e = 0; e < H * r; ++e)
      std::memcpy(static_cast<char*>(out.data()) + (bs * H * r + e) * row,
                  static_cast<const char*>(in.data()) + (bs * H + e / r) * row, row);
}

void reduce_kv_replicas(const TensorView& in, std::int64_t r, const TensorView& out) {
  check_4d(in, "reduce_kv_replicas input");
  check_4d(out, "reduce_kv_replicas output");
  const std::int64_t B = out.dim(0), S = out.dim(1), H = out.dim(2), D = out.dim(3);
  check_shape(in, {B, S, H * r, D}, "reduce_kv_replicas input");
  check_dtype(in, DType::kFloat32, "reduce_kv_replicas input");
  Tensor sum = Tensor::zeros(out.shape(), DType::kFloat32, MemCategory::kWorkspace);
  const float* src = in.data_as<float>();
  float* dst = sum.data_as<float>();
  for (std::int64_t bs = 0; bs < B * S; ++bs)
    for (std::int64_t e = 0; e < H * r; ++e)  // replicas added in rank order: deterministic
      for (std::int64_t d = 0; d < D; ++d) dst[(bs * H + e / r) * D + d] += src[(bs * H * r + e) * D + d];
  copy_convert(sum.view(), out);
}

// ---- USP ---------------------------------------------------------------------------------------------------

UspAttention::UspAttention(Communicator& ulysses, Communicator& ring, std::int64_t seq_len,
                           const RingAttentionConfig& config)
    : ulysses_(ulysses),
      ring_(ring),
      config_(config),
      layout_(config.layout, seq_len, ring.size(), ulysses.size()),
      positions_(layout_.positions(ring.rank() * ulysses.size() + ulysses.rank())),
      ring_attn_(ring, seq_len, config) {}

template <typename Fn>
void UspAttention::timed_a2a(Fn&& fn) {
  if (ulysses_.size() == 1) {  // the "all-to-all" of one rank is a local copy: no communication to count
    fn();
    return;
  }
  const CommCounters before = ulysses_.counters();
  const double t0 = wall_seconds();
  fn();
  counters_.a2a_s += wall_seconds() - t0;
  counters_.a2a_bytes_sent += ulysses_.counters().bytes_sent - before.bytes_sent;
  counters_.a2a_bytes_received += ulysses_.counters().bytes_received - before.bytes_received;
  SEQPAR_LOG(kDebug) << "Ulysses all-to-all over " << ulysses_.size() << " ranks: sent "
                     << ulysses_.counters().bytes_sent - before.bytes_sent << " bytes";
}

AttentionOutput UspAttention::forward(const TensorView& q, const TensorView& k, const TensorView& v) {
  check_4d(q, "USP q");
  check_4d(k, "USP k");
  check_4d(v, "USP v");
  SEQPAR_CHECK(k.shape() == v.shape(), "USP: k ", k.str(), " and v ", v.str(), " must have one shape");
  SEQPAR_CHECK(q.dim(1) == layout_.local_len() && k.dim(1) == layout_.local_len(), "USP: local sequence length ",
               q.dim(1), " must be seq_len ", layout_.seq_len(), " / (ring_size ", ring_.size(), " x ulysses_size ",
               ulysses_.size(), ") = ", layout_.local_len());
  SEQPAR_CHECK(q.dtype() == k.dtype() && q.dtype() == v.dtype(), "USP: q, k, v dtypes differ (", dtype_name(q.dtype()),
               ", ", dtype_name(k.dtype()), ", ", dtype_name(v.dtype()), ")");
  // Checked here, not only by the ring after the all-to-all, so that no message is sent with bad inputs.
  SEQPAR_CHECK(is_floating(q.dtype()), "USP: q, k, v have dtype ", dtype_name(q.dtype()),
               ", expected a floating dtype (fp32, bf16, fp16 or fp64)");
  SEQPAR_CHECK(q.dim(0) == k.dim(0) && q.dim(3) == k.dim(3), "USP: q ", q.str(), " and k ", k.str(),
               " must share batch (dim 0) and head dim (dim 3)");
  heads_ = std::make_unique<UlyssesHeads>(q.dim(2), k.dim(2), ulysses_.size());
  q_shape_ = q.shape();
  q_dtype_ = q.dtype();
  const int pu = ulysses_.size();
  const std::int64_t B = q.dim(0), sl = q.dim(1), D = q.dim(3), hq = heads_->hq, he = heads_->hkv_expanded;

  Tensor q_h = Tensor::empty({B, pu * sl, hq / pu, D}, q.dtype(), MemCategory::kWorkspace);
  Tensor k_h = Tensor::empty({B, pu * sl, he / pu, D}, q.dtype(), MemCategory::kWorkspace);
  Tensor v_h = Tensor::empty({B, pu * sl, he / pu, D}, q.dtype(), MemCategory::kWorkspace);
  timed_a2a([&] {
    ulysses_scatter_heads(ulysses_, q, q_h.view());
    if (heads_->replication == 1) {
      ulysses_scatter_heads(ulysses_, k, k_h.view());
      ulysses_scatter_heads(ulysses_, v, v_h.view());
    } else {
      Tensor expanded = Tensor::empty({B, sl, he, D}, q.dtype(), MemCategory::kWorkspace);
      replicate_kv_heads(k, heads_->replication, expanded.view());
      ulysses_scatter_heads(ulysses_, expanded.view(), k_h.view());
      replicate_kv_heads(v, heads_->replication, expanded.view());
      ulysses_scatter_heads(ulysses_, expanded.view(), v_h.view());
    }
  });

  Tensor out_h = Tensor::empty(q_h.shape(), q.dtype(), MemCategory::kWorkspace);
  Tensor lse_h = Tensor::empty({B, hq / pu, pu * sl}, DType::kFloat32, MemCategory::kWorkspace);
  ring_attn_.forward_into(q_h.view(), k_h.view(), v_h.view(), out_h.view(), lse_h.view());

  AttentionOutput o;
  o.out = Tensor::empty(q.shape(), q.dtype(), MemCategory::kSavedActivation);
  o.lse = Tensor::empty({B, hq, sl}, DType::kFloat32, MemCategory::kSavedActivation);
  timed_a2a([&] {
    ulysses_gather_heads(ulysses_, out_h.view(), o.out.view());
    ulysses_gather_heads_bhs(ulysses_, lse_h.view(), o.lse.view());
  });
  return o;
}

AttentionGrads UspAttention::backward(const TensorView& dout) {
  SEQPAR_CHECK(heads_ != nullptr, "USP: backward() needs a preceding forward()");
  check_4d(dout, "USP dout");
  // dout must have q's shape (checked before the all-to-all, so that a bad dout sends nothing); gradients come
  // back in q's dtype, whatever dout's floating dtype.
  check_shape(dout, q_shape_, "USP dout");
  SEQPAR_CHECK(is_floating(dout.dtype()), "USP: dout has dtype ", dtype_name(dout.dtype()),
               ", expected a floating dtype");
  const int pu = ulysses_.size();
  const std::int64_t B = dout.dim(0), sl = dout.dim(1), D = dout.dim(3), hq = heads_->hq, he = heads_->hkv_expanded,
                     hkv = heads_->hkv;
  const DType dtype = q_dtype_;
  Tensor dout_cast;
  if (dout.dtype() != dtype) dout_cast = Tensor::copy_of(dout, dtype, MemCategory::kWorkspace);
  const TensorView dout_q = dout.dtype() != dtype ? dout_cast.view() : dout;
  Tensor dout_h = Tensor::empty({B, pu * sl, hq / pu, D}, dtype, MemCategory::kWorkspace);
  timed_a2a([&] { ulysses_scatter_heads(ulysses_, dout_q, dout_h.view()); });

  // Replica gradients travel in fp32 so that their sum is exact to fp32 rounding.
  const DType kv_grad_dtype = heads_->replication == 1 ? dtype : DType::kFloat32;
  Tensor dq_h = Tensor::empty(dout_h.shape(), dtype, MemCategory::kWorkspace);
  Tensor dk_h = Tensor::empty({B, pu * sl, he / pu, D}, kv_grad_dtype, MemCategory::kWorkspace);
  Tensor dv_h = Tensor::empty({B, pu * sl, he / pu, D}, kv_grad_dtype, MemCategory::kWorkspace);
  ring_attn_.backward_into(dout_h.view(), dq_h.view(), dk_h.view(), dv_h.view());

  AttentionGrads g;
  g.dq = Tensor::empty({B, sl, hq, D}, dtype, MemCategory::kWorkspace);
  g.dk = Tensor::empty({B, sl, hkv, D}, dtype, MemCategory::kWorkspace);
  g.dv = Tensor::empty({B, sl, hkv, D}, dtype, MemCategory::kWorkspace);
  timed_a2a([&] {
    ulysses_gather_heads(ulysses_, dq_h.view(), g.dq.view());
    if (heads_->replication == 1) {
      ulysses_gather_heads(ulysses_, dk_h.view(), g.dk.view());
      ulysses_gather_heads(ulysses_, dv_h.view(), g.dv.view());
    } else {
      Tensor expanded = Tensor::empty({B, sl, he, D}, DType::kFloat32, MemCategory::kWorkspace);
      ulysses_gather_heads(ulysses_, dk_h.view(), expanded.view());
      reduce_kv_replicas(expanded.view(), heads_->replication, g.dk.view());
      ulysses_gather_heads(ulysses_, dv_h.view(), expanded.view());
      reduce_kv_replicas(expanded.view(), heads_->replication, g.dv.view());
    }
  });
  return g;
}

UspCounters UspAttention::counters() const {
  UspCounters c = counters_;
  c.ring = ring_attn_.counters();
  return c;
}

void UspAttention::reset_counters() {
  counters_.reset();
  ring_attn_.reset_counters();
}

}  // namespace seqpar
