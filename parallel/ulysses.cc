#include "parallel/ulysses.h"

#include <numeric>
#include <string>
#include <vector>

#include "runtime/logging.h"
#include "runtime/tensor_checks.h"
#include "runtime/tensor_ops.h"
#include "runtime/timer.h"

namespace seqpar {
namespace {

void check_4d(const TensorView& t, const char* what) {
  SEQPAR_CHECK(t.ndim() == 4, what, " ", t.str(), " must be [B, S, H, D]");
}

// A [B, S, H, ...] tensor seen as [B, S, H, rest] (rest = 1 for [B, S, H]).
TensorView as_4d(const TensorView& t) {
  SEQPAR_CHECK(t.ndim() >= 3, "Ulysses exchange: ", t.str(), " must be [B, S, H, ...]");
  std::int64_t rest = 1;
  for (int d = 3; d < t.ndim(); ++d) rest *= t.dim(d);
  return t.reshape({t.dim(0), t.dim(1), t.dim(2), rest});
}

// Expanded head e of a replicated kv comes from head e / r.
std::vector<std::int64_t> replica_sources(std::int64_t heads, std::int64_t r) {
  std::vector<std::int64_t> src(static_cast<std::size_t>(heads * r));
  for (std::int64_t e = 0; e < heads * r; ++e) src[e] = e / r;
  return src;
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

namespace {

// The all-to-all between the sequence-sharded [B, S_local, H, D] and the head-sharded [B, Pu S_local, H / Pu, D]:
// to_heads = true scatters heads (in is sequence-sharded), false gathers them back (the exact inverse).
void exchange_heads(Communicator& ulysses, const TensorView& in, const TensorView& out, bool to_heads, Stream stream) {
  const char* fn = to_heads ? "ulysses_scatter_heads" : "ulysses_gather_heads";
  const std::string in_name = str_cat(fn, " input"), out_name = str_cat(fn, " output");
  check_4d(in, in_name.c_str());
  check_4d(out, out_name.c_str());
  const TensorView& seq = to_heads ? in : out;
  const TensorView& heads = to_heads ? out : in;
  const int pu = ulysses.size();
  const std::int64_t B = seq.dim(0), sl = seq.dim(1), H = seq.dim(2), D = seq.dim(3);
  SEQPAR_CHECK(H % pu == 0, fn, ": ", H, " heads not divisible by ulysses_size ", pu);
  check_shape(heads, {B, pu * sl, H / pu, D}, (to_heads ? out_name : in_name).c_str());
  check_dtype(heads, seq.dtype(), (to_heads ? out_name : in_name).c_str());
  const DeviceAlloc alloc{common_device({in, out}, fn), stream};
  if (pu == 1) {
    alloc.copy_convert(in, out);
    return;
  }
  const std::int64_t hp = H / pu;
  // to_heads:  send[j][b][s] = heads [j hp, (j+1) hp) of in[b][s] (in read as [B sl, pu, hp D]); recv[j][b] (rank
  //            j's sequence piece) = out[b][j sl : (j+1) sl].
  // otherwise: send[j][b] = in[b][j sl : (j+1) sl] (the piece rank j owns); recv[j][b][s] = heads [j hp, (j+1) hp)
  //            of out[b][s].
  Tensor send = alloc.empty({pu, B, sl, hp, D}, in.dtype(), MemCategory::kCommBuffer);
  swap_outer_dims(in, to_heads ? B * sl : B, pu, send.view(), stream);
  Tensor recv = alloc.empty({pu, B, sl, hp, D}, in.dtype(), MemCategory::kCommBuffer);
  ulysses.all_to_all(send.view(), recv.view())->wait();
  swap_outer_dims(recv.view(), pu, to_heads ? B : B * sl, out, stream);
}

}  // namespace

void ulysses_scatter_heads(Communicator& ulysses, const TensorView& in, const TensorView& out, Stream stream) {
  exchange_heads(ulysses, in, out, true, stream);
}

void ulysses_gather_heads(Communicator& ulysses, const TensorView& in, const TensorView& out, Stream stream) {
  exchange_heads(ulysses, in, out, false, stream);
}

void ulysses_gather_heads_bhs(Communicator& ulysses, const TensorView& in, const TensorView& out, Stream stream) {
  const DeviceAlloc alloc{common_device({in, out}, "ulysses_gather_heads_bhs"), stream};
  const int pu = ulysses.size();
  SEQPAR_CHECK(out.ndim() == 3 && out.dim(1) % pu == 0, "ulysses_gather_heads_bhs: output ", out.str(),
               " must be [B, H, S_local] with H divisible by ulysses_size ", pu);
  const std::int64_t B = out.dim(0), H = out.dim(1), sl = out.dim(2), hp = H / pu;
  check_shape(in, {B, hp, pu * sl}, "ulysses_gather_heads_bhs input");
  check_dtype(in, out.dtype(), "ulysses_gather_heads_bhs input");
  if (pu == 1) {
    alloc.copy_convert(in, out);
    return;
  }
  // send[j][b][h'] = in[b][h'][j sl : (j+1) sl]; recv[j][b][h'] = out[b][j hp + h'][:].
  Tensor send = alloc.empty({pu, B, hp, sl}, in.dtype(), MemCategory::kCommBuffer);
  swap_outer_dims(in, B * hp, pu, send.view(), stream);
  Tensor recv = alloc.empty({pu, B, hp, sl}, in.dtype(), MemCategory::kCommBuffer);
  ulysses.all_to_all(send.view(), recv.view())->wait();
  swap_outer_dims(recv.view(), pu, B, out, stream);
}

void replicate_kv_heads(const TensorView& in, std::int64_t r, const TensorView& out, Stream stream) {
  check_4d(in, "replicate_kv_heads input");
  const std::int64_t B = in.dim(0), S = in.dim(1), H = in.dim(2), D = in.dim(3);
  check_shape(out, {B, S, H * r, D}, "replicate_kv_heads output");
  check_dtype(out, in.dtype(), "replicate_kv_heads output");
  common_device({in, out}, "replicate_kv_heads");
  gather_rows(in, 2, replica_sources(H, r), out, stream);
}

void reduce_kv_replicas(const TensorView& in, std::int64_t r, const TensorView& out, Stream stream) {
  check_4d(in, "reduce_kv_replicas input");
  check_4d(out, "reduce_kv_replicas output");
  const std::int64_t B = out.dim(0), S = out.dim(1), H = out.dim(2), D = out.dim(3);
  check_shape(in, {B, S, H * r, D}, "reduce_kv_replicas input");
  SEQPAR_CHECK(in.dtype() == DType::kFloat32 || in.dtype() == DType::kFloat64, "reduce_kv_replicas input ", in.str(),
               " must be fp32 or fp64 (the dtype the replicas are summed in)");
  const DeviceAlloc alloc{common_device({in, out}, "reduce_kv_replicas"), stream};
  Tensor sum = alloc.zeros(out.shape(), in.dtype(), MemCategory::kWorkspace);
  index_add_rows(in, 2, replica_sources(H, r), sum.view(), stream);  // replicas added in rank order: deterministic
  alloc.copy_convert(sum.view(), out);
}

// ---- UlyssesExchange -----------------------------------------------------------------------------------------

UlyssesExchange::UlyssesExchange(const CpGroups& groups, CpCounters& counters)
    : ulysses_(groups.ulysses), stream_(groups.stream), counters_(counters) {}

template <typename Fn>
void UlyssesExchange::counted(Fn&& fn) const {
  if (ulysses_.size() == 1) {  // the "all-to-all" of one rank is a local copy: no communication to count
    fn();
    return;
  }
  const CommCounters before = ulysses_.counters();
  {
    const ScopedTimer timer(counters_.a2a_s);
    fn();
  }
  counters_.a2a_bytes_sent += ulysses_.counters().bytes_sent - before.bytes_sent;
  counters_.a2a_bytes_received += ulysses_.counters().bytes_received - before.bytes_received;
  SEQPAR_LOG(kDebug) << "Ulysses exchange over " << ulysses_.size() << " ranks: sent "
                     << ulysses_.counters().bytes_sent - before.bytes_sent << " bytes";
}

Tensor UlyssesExchange::to_heads(const TensorView& x, MemCategory category) const {
  const DeviceAlloc alloc{x.device(), stream_};
  const int pu = ulysses_.size();
  SEQPAR_CHECK(x.ndim() >= 3 && x.dim(2) % pu == 0, "Ulysses exchange: ", x.str(),
               " must be [B, S_local, H, ...] with H divisible by ulysses_size ", pu);
  Shape s = x.shape();
  s[1] *= pu;
  s[2] /= pu;
  Tensor out = alloc.empty(s, x.dtype(), category);
  counted([&] { ulysses_scatter_heads(ulysses_, as_4d(x), as_4d(out.view()), stream_); });
  return out;
}

void UlyssesExchange::to_sequence(const TensorView& x_h, const TensorView& out) const {
  counted([&] { ulysses_gather_heads(ulysses_, as_4d(x_h), as_4d(out), stream_); });
}

void UlyssesExchange::lse_to_sequence(const TensorView& lse_h, const TensorView& lse) const {
  counted([&] { ulysses_gather_heads_bhs(ulysses_, lse_h, lse, stream_); });
}

Tensor UlyssesExchange::kv_to_heads(const TensorView& kv, const UlyssesHeads& heads, MemCategory category) const {
  const DeviceAlloc alloc{kv.device(), stream_};
  if (heads.replication == 1) return to_heads(kv, category);
  check_4d(kv, "Ulysses kv");
  Tensor expanded =
      alloc.empty({kv.dim(0), kv.dim(1), heads.hkv_expanded, kv.dim(3)}, kv.dtype(), MemCategory::kWorkspace);
  replicate_kv_heads(kv, heads.replication, expanded.view(), stream_);
  return to_heads(expanded.view(), category);
}

void UlyssesExchange::kv_grad_to_sequence(const TensorView& dkv_h, const UlyssesHeads& heads,
                                          const TensorView& out) const {
  const DeviceAlloc alloc{out.device(), stream_};
  if (heads.replication == 1) {
    to_sequence(dkv_h, out);
    return;
  }
  check_4d(out, "Ulysses kv gradient");
  Tensor expanded =
      alloc.empty({out.dim(0), out.dim(1), heads.hkv_expanded, out.dim(3)}, dkv_h.dtype(), MemCategory::kWorkspace);
  to_sequence(dkv_h, expanded.view());
  reduce_kv_replicas(expanded.view(), heads.replication, out, stream_);
}

Tensor UlyssesExchange::gather_pieces(const TensorView& local, MemCategory category) const {
  const DeviceAlloc alloc{local.device(), stream_};
  const int pu = ulysses_.size();
  Shape packed = local.shape();
  packed.insert(packed.begin(), pu);
  Shape out_shape = local.shape();
  out_shape[1] *= pu;
  Tensor out = alloc.empty(out_shape, local.dtype(), category);
  counted([&] {
    Tensor all = alloc.empty(packed, local.dtype(), MemCategory::kCommBuffer);
    ulysses_.all_gather(local, all.view())->wait();
    swap_outer_dims(all.view(), pu, local.dim(0), out.view(), stream_);  // [Pu, B, piece] -> [B, Pu, piece]
  });
  return out;
}

void UlyssesExchange::reduce_scatter_pieces(const TensorView& ring_shard, const TensorView& out) const {
  const DeviceAlloc alloc{ring_shard.device(), stream_};
  const int pu = ulysses_.size();
  counted([&] {
    Shape packed = out.shape();
    packed.insert(packed.begin(), pu);
    Tensor send = alloc.empty(packed, ring_shard.dtype(), MemCategory::kCommBuffer);
    swap_outer_dims(ring_shard, ring_shard.dim(0), pu, send.view(), stream_);  // [B, Pu, piece] -> [Pu, B, piece]
    ulysses_.reduce_scatter(send.view(), out, ReduceOp::kSum)->wait();
  });
}

Tensor UlyssesExchange::gather_heads_dim1(const TensorView& local) const {
  return gather_pieces(local, MemCategory::kWorkspace);  // the same all-gather, along the head dimension
}

Tensor UlyssesExchange::my_heads_dim1(const TensorView& full) const {
  const DeviceAlloc alloc{full.device(), stream_};
  const int pu = ulysses_.size();
  SEQPAR_CHECK(full.ndim() >= 2 && full.dim(1) % pu == 0, "Ulysses exchange: ", full.str(),
               " must be [B, H, ...] with H divisible by ulysses_size ", pu);
  const std::int64_t hl = full.dim(1) / pu;
  std::vector<std::int64_t> mine(static_cast<std::size_t>(hl));
  std::iota(mine.begin(), mine.end(), ulysses_.rank() * hl);
  Shape s = full.shape();
  s[1] = hl;
  Tensor out = alloc.empty(s, full.dtype(), MemCategory::kWorkspace);
  gather_rows(full, 1, mine, out.view(), stream_);
  return out;
}

}  // namespace seqpar
