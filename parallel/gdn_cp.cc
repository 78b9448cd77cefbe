#include "parallel/gdn_cp.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>

#include "parallel/ulysses.h"
#include "runtime/logging.h"
#include "runtime/tensor_ops.h"
#include "runtime/timer.h"

namespace seqpar {
namespace {

constexpr int kTagChainFwd = 2000;
constexpr int kTagChainBwd = 6000;
constexpr int kTagScan = 10000;
constexpr int kTagShift = 14000;
constexpr int kTagHalo = 18000;
constexpr int kTagHaloGrad = 19000;
constexpr std::int64_t kMaxSegments = 4000;  // keeps every tag family inside MPI's guaranteed tag range

// Bytes of one row (all dims after the sequence dim 1) of a [B, S, ...] tensor.
std::size_t row_bytes(const TensorView& t) {
  std::size_t n = dtype_size(t.dtype());
  for (int d = 2; d < t.ndim(); ++d) n *= static_cast<std::size_t>(t.dim(d));
  return n;
}

// Rows [offset, offset + length) of every batch of a [B, S, ...] tensor, as a contiguous [B, length, ...] copy.
Tensor take_rows(const TensorView& t, std::int64_t offset, std::int64_t length, MemCategory category) {
  Shape s = t.shape();
  s[1] = length;
  Tensor out = Tensor::empty(s, t.dtype(), category);
  const std::size_t rb = row_bytes(t);
  for (std::int64_t b = 0; b < t.dim(0); ++b) {
    std::memcpy(static_cast<char*>(out.data()) + b * length * rb,
                static_cast<const char*>(t.data()) + (b * t.dim(1) + offset) * rb, length * rb);
  }
  return out;
}

// The inverse: writes a [B, length, ...] tensor into rows [offset, offset + length) of `dst`.
void put_rows(const TensorView& src, const TensorView& dst, std::int64_t offset) {
  const std::size_t rb = row_bytes(dst);
  const std::int64_t length = src.dim(1);
  for (std::int64_t b = 0; b < dst.dim(0); ++b) {
    std::memcpy(static_cast<char*>(dst.data()) + (b * dst.dim(1) + offset) * rb,
                static_cast<const char*>(src.data()) + b * length * rb, length * rb);
  }
}

// [B, S, H] -> [B, S, H, 1] view (Ulysses all-to-all of per-head scalars).
TensorView as_4d(const TensorView& t) { return t.reshape({t.dim(0), t.dim(1), t.dim(2), 1}); }

// Heads [u * hl, (u + 1) * hl) of a full [B, H, K, V] state.
Tensor state_heads(const TensorView& full, int u, std::int64_t hl) {
  const std::int64_t B = full.dim(0), H = full.dim(1);
  Tensor out = Tensor::empty({B, hl, full.dim(2), full.dim(3)}, full.dtype(), MemCategory::kWorkspace);
  const std::size_t head_bytes = static_cast<std::size_t>(full.dim(2) * full.dim(3)) * dtype_size(full.dtype());
  for (std::int64_t b = 0; b < B; ++b)
    std::memcpy(static_cast<char*>(out.data()) + b * hl * head_bytes,
                static_cast<const char*>(full.data()) + (b * H + u * hl) * head_bytes, hl * head_bytes);
  return out;
}

// The full [B, H, K, V] state from every Ulysses rank's [B, H / Pu, K, V] heads (all-gather).
Tensor gather_state_heads(Communicator& ulysses, const TensorView& local) {
  const int pu = ulysses.size();
  const std::int64_t B = local.dim(0), hl = local.dim(1);
  Tensor all = Tensor::empty({pu, B, hl, local.dim(2), local.dim(3)}, local.dtype(), MemCategory::kCommBuffer);
  ulysses.all_gather(local, all.view())->wait();
  Tensor full = Tensor::empty({B, hl * pu, local.dim(2), local.dim(3)}, local.dtype(), MemCategory::kWorkspace);
  const std::size_t head_bytes = static_cast<std::size_t>(local.dim(2) * local.dim(3)) * dtype_size(local.dtype());
  for (int u = 0; u < pu; ++u)
    for (std::int64_t b = 0; b < B; ++b)
      std::memcpy(static_cast<char*>(full.data()) + (b * hl * pu + u * hl) * head_bytes,
                  static_cast<const char*>(all.data()) + (u * B + b) * hl * head_bytes, hl * head_bytes);
  return full;
}

// Kogge-Stone inclusive scan of packed [M | U] affine maps over the segments in global order (dir = +1:
// agg_i <- agg_i o agg_{i-o}) or in reverse order (dir = -1: agg_i <- agg_i o agg_{i+o}), for o = 1, 2, 4, ...
// `mine` lists this rank's segments (indices into `segments`), `agg` their maps. Returns the number of rounds.
std::int64_t scan_maps(Communicator& ring, const std::vector<Segment>& segments, const std::vector<int>& mine,
                       const Shape& map_shape, const Shape& state_shape, int dir, std::vector<Tensor>& agg,
                       double* exposed_s) {
  const int n = static_cast<int>(segments.size()), me = ring.rank();
  const std::int64_t mk = shape_numel(map_shape), uk = shape_numel(state_shape);
  auto m_of = [&](const Tensor& t) { return t.view().slice0(0, mk).reshape(map_shape); };
  auto u_of = [&](const Tensor& t) { return t.view().slice0(mk, mk + uk).reshape(state_shape); };
  std::map<int, std::size_t> slot;  // global segment index -> index in mine
  for (std::size_t j = 0; j < mine.size(); ++j) slot[mine[j]] = j;
  std::int64_t rounds = 0;
  for (int o = 1; o < n; o *= 2, ++rounds) {
    std::vector<P2POp> ops;
    std::vector<Tensor> snapshot(mine.size()), received(mine.size());
    for (std::size_t j = 0; j < mine.size(); ++j) {
      snapshot[j] = Tensor::copy_of(agg[j].view(), agg[j].dtype(), MemCategory::kCommBuffer);
    }
    for (std::size_t j = 0; j < mine.size(); ++j) {
      const int i = mine[j], to = i + dir * o, from = i - dir * o;
      if (to >= 0 && to < n && segments[to].owner != me) {
        ops.push_back(P2POp::send(snapshot[j].view(), segments[to].owner, kTagScan + to));
      }
      if (from >= 0 && from < n) {
        received[j] = Tensor::empty({mk + uk}, agg[j].dtype(), MemCategory::kCommBuffer);
        if (segments[from].owner == me) {
          copy_convert(snapshot[slot[from]].view(), received[j].view());
        } else {
          ops.push_back(P2POp::recv(received[j].view(), segments[from].owner, kTagScan + i));
        }
      }
    }
    if (!ops.empty()) {
      const double t0 = wall_seconds();
      ring.batch_isend_irecv(ops)->wait();
      *exposed_s += wall_seconds() - t0;
    }
    for (std::size_t j = 0; j < mine.size(); ++j) {
      if (!received[j].defined()) continue;
      Tensor next = Tensor::empty({mk + uk}, agg[j].dtype(), MemCategory::kCommBuffer);
      attn::gdn_transition_compose(m_of(snapshot[j]), u_of(snapshot[j]), m_of(received[j]), u_of(received[j]),
                                   m_of(next), u_of(next));
      agg[j] = std::move(next);
    }
  }
  return rounds;
}

}  // namespace

const char* gdn_cp_mode_name(GdnCpMode mode) { return mode == GdnCpMode::kChain ? "chain" : "scan"; }

GdnCpMode parse_gdn_cp_mode(std::string_view name) {
  if (name == "chain") return GdnCpMode::kChain;
  if (name == "scan") return GdnCpMode::kScan;
  SEQPAR_THROW("GDN mode '", name, "' is not one of chain, scan");
}

std::vector<Segment> segments_in_global_order(const std::vector<std::vector<std::int64_t>>& positions_per_rank) {
  std::vector<Segment> segs;
  for (int r = 0; r < static_cast<int>(positions_per_rank.size()); ++r) {
    const auto& pos = positions_per_rank[r];
    for (std::size_t i = 0; i < pos.size();) {
      std::size_t j = i + 1;
      while (j < pos.size() && pos[j] == pos[j - 1] + 1) ++j;
      segs.push_back({pos[i], static_cast<std::int64_t>(j - i), r, static_cast<std::int64_t>(i)});
      i = j;
    }
  }
  std::sort(segs.begin(), segs.end(), [](const Segment& a, const Segment& b) { return a.start < b.start; });
  return segs;
}

// ---- GDN under CP --------------------------------------------------------------------------------------------

struct GdnContextParallel::Impl {
  // Ring-level (head-sharded) saved inputs and per-segment state.
  Tensor q, k, v, g, beta;
  std::vector<int> mine;                              // indices into segments_ of this rank's segments, in global order
  std::vector<Tensor> start;                          // start state of each of mine
  std::vector<Tensor> map_m;                          // scan: M of each of mine
  std::int64_t batch = 0, heads = 0, dk = 0, dv = 0;  // heads: local (H / Pu)
  DType state_dtype = DType::kFloat32;
  bool has_forward = false;

  Shape state_shape() const { return {batch, heads, dk, dv}; }
  Shape map_shape() const { return {batch, heads, dk, dk}; }
};

GdnContextParallel::GdnContextParallel(Communicator& ulysses, Communicator& ring, std::int64_t seq_len,
                                       const GdnCpConfig& config)
    : ulysses_(ulysses),
      ring_(ring),
      config_(config),
      layout_(config.layout, seq_len, ring.size(), ulysses.size()),
      positions_(layout_.positions(ring.rank() * ulysses.size() + ulysses.rank())),
      impl_(std::make_shared<Impl>()) {
  SEQPAR_CHECK(config.layout != LayoutKind::kStripe,
               "GDN under context parallelism supports the contiguous and zigzag layouts; the stripe layout would "
               "make every token its own segment");
  SEQPAR_CHECK(config.chunk_size >= 1, "GDN chunk_size ", config.chunk_size, " must be >= 1");
  SEQPAR_CHECK(std::isfinite(config.scale), "GDN scale ", config.scale, " must be finite (0 or less: 1/sqrt(K))");
  std::vector<std::vector<std::int64_t>> ring_positions;
  for (int r = 0; r < ring.size(); ++r) ring_positions.push_back(layout_.ring_shard_positions(r));
  segments_ = segments_in_global_order(ring_positions);
  SEQPAR_CHECK(static_cast<std::int64_t>(segments_.size()) <= kMaxSegments, "GDN under CP: ", segments_.size(),
               " segments exceed the supported ", kMaxSegments);
  for (int i = 0; i < static_cast<int>(segments_.size()); ++i) {
    if (segments_[i].owner == ring.rank()) impl_->mine.push_back(i);
  }
}

namespace {

// Inputs of one segment, copied out of the ring-level tensors.
struct SegmentInputs {
  Tensor q, k, v, g, beta;
};

SegmentInputs segment_inputs(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta,
                             const Segment& s) {
  const MemCategory c = MemCategory::kWorkspace;
  return {take_rows(q.view(), s.local_offset, s.length, c), take_rows(k.view(), s.local_offset, s.length, c),
          take_rows(v.view(), s.local_offset, s.length, c), take_rows(g.view(), s.local_offset, s.length, c),
          take_rows(beta.view(), s.local_offset, s.length, c)};
}

attn::GdnForwardArgs forward_args(const SegmentInputs& in, const GdnCpConfig& cfg, const TensorView& start) {
  attn::GdnForwardArgs a;
  a.q = in.q.view();
  a.k = in.k.view();
  a.v = in.v.view();
  a.g = in.g.view();
  a.beta = in.beta.view();
  a.initial_state = start;
  a.use_qk_l2norm = cfg.use_qk_l2norm;
  a.scale = cfg.scale;
  a.chunk_size = cfg.chunk_size;
  return a;
}

// Point-to-point exchange of one round: sends to and receives from other ranks (self-messages are the caller's).
struct Round {
  std::vector<P2POp> ops;
  void send(const TensorView& t, int peer, int tag) { ops.push_back(P2POp::send(t, peer, tag)); }
  void recv(const TensorView& t, int peer, int tag) { ops.push_back(P2POp::recv(t, peer, tag)); }
};

}  // namespace

// Runs the ring-level algorithm on head-sharded tensors; returns the final state of the last segment (on its
// owner; empty elsewhere) after broadcasting it to every ring rank.
GdnCpOutput GdnContextParallel::forward(const TensorView& q, const TensorView& k, const TensorView& v,
                                        const TensorView& g, const TensorView& beta, const TensorView& initial_state) {
  Impl& s = *impl_;
  for (const TensorView* t : {&q, &k, &v, &g, &beta}) check_cpu(*t, "GDN CP input");
  SEQPAR_CHECK(q.ndim() == 4 && k.shape() == q.shape() && v.ndim() == 4 && g.ndim() == 3 && beta.ndim() == 3,
               "GDN CP: q ", q.str(), ", k ", k.str(), ", v ", v.str(), ", g ", g.str(), ", beta ", beta.str(),
               " must be [B, S_local, H, K], [B, S_local, H, K], [B, S_local, H, V], [B, S_local, H] x 2");
  const std::int64_t B = q.dim(0), sl = q.dim(1), H = q.dim(2), K = q.dim(3), V = v.dim(3);
  SEQPAR_CHECK(sl == layout_.local_len(), "GDN CP: local sequence length ", sl, " must be seq_len ", layout_.seq_len(),
               " / (ring_size ", ring_.size(), " x ulysses_size ", ulysses_.size(), ") = ", layout_.local_len());
  check_shape(v, {B, sl, H, V}, "GDN CP v");
  check_shape(g, {B, sl, H}, "GDN CP g");
  check_shape(beta, {B, sl, H}, "GDN CP beta");
  const int pu = ulysses_.size();
  SEQPAR_CHECK(H % pu == 0, "GDN CP: heads ", H, " must be divisible by ulysses_size ", pu);
  s.batch = B;
  s.heads = H / pu;
  s.dk = K;
  s.dv = V;
  s.state_dtype = attn::gdn_state_dtype(q.dtype());
  if (!initial_state.empty()) {
    check_shape(initial_state, {B, H, K, V}, "GDN CP initial_state");
    check_dtype(initial_state, s.state_dtype, "GDN CP initial_state");
  }

  // Ulysses: [B, S_local, H, *] -> [B, S_ring, H/Pu, *].
  const std::int64_t sr = layout_.ring_shard_len();
  const double a0 = wall_seconds();
  const std::int64_t a2a_before = ulysses_.counters().bytes_sent;
  auto scatter = [&](const TensorView& t, std::int64_t last) {
    Tensor out = Tensor::empty({B, sr, s.heads, last}, t.dtype(), MemCategory::kSavedActivation);
    ulysses_scatter_heads(ulysses_, t.ndim() == 3 ? as_4d(t) : t, out.view());
    if (t.ndim() == 3)
      return Tensor::copy_of(out.view().reshape({B, sr, s.heads}), t.dtype(), MemCategory::kSavedActivation);
    return out;
  };
  s.q = scatter(q, K);
  s.k = scatter(k, K);
  s.v = scatter(v, V);
  s.g = scatter(g, 1);
  s.beta = scatter(beta, 1);
  // This rank's heads of the initial state.
  Tensor init_local;
  if (!initial_state.empty()) init_local = state_heads(initial_state, ulysses_.rank(), s.heads);
  counters_.exposed_comm_s += wall_seconds() - a0;

  const int n = static_cast<int>(segments_.size());
  const int me = ring_.rank();
  const CommCounters before = ring_.counters();
  Tensor out_h = Tensor::empty({B, sr, s.heads, V}, q.dtype(), MemCategory::kWorkspace);
  Tensor last_final;  // final state of the last segment, on its owner
  s.start.clear();
  s.start.resize(s.mine.size());
  s.map_m.clear();
  s.map_m.resize(s.mine.size());

  auto wait_timed = [&](WorkHandle w) {
    if (!w) return;
    const double t0 = wall_seconds();
    w->wait();
    counters_.exposed_comm_s += wall_seconds() - t0;
  };
  auto run_segment = [&](std::size_t j, const TensorView& start, const TensorView& final_state) {
    const Segment& seg = segments_[s.mine[j]];
    const SegmentInputs in = segment_inputs(s.q, s.k, s.v, s.g, s.beta, seg);
    Tensor out_seg = Tensor::empty({B, seg.length, s.heads, V}, q.dtype(), MemCategory::kWorkspace);
    const double t0 = wall_seconds();
    attn::gdn_forward(forward_args(in, config_, start), out_seg.view(), final_state);
    counters_.compute_s += wall_seconds() - t0;
    put_rows(out_seg.view(), out_h.view(), seg.local_offset);
  };

  if (config_.mode == GdnCpMode::kChain) {
    std::vector<WorkHandle> sends;
    std::vector<Tensor> finals(s.mine.size());  // end states; alive until their sends complete
    for (std::size_t j = 0; j < s.mine.size(); ++j) {
      const int i = s.mine[j];
      s.start[j] = Tensor::zeros(s.state_shape(), s.state_dtype, MemCategory::kSavedActivation);
      if (i == 0) {
        if (init_local.defined()) copy_convert(init_local.view(), s.start[j].view());
      } else if (segments_[i - 1].owner == me) {
        copy_convert(finals[j - 1].view(), s.start[j].view());
      } else {
        wait_timed(ring_.irecv(s.start[j].view(), segments_[i - 1].owner, kTagChainFwd + i));
      }
      finals[j] = Tensor::empty(s.state_shape(), s.state_dtype, MemCategory::kCommBuffer);
      run_segment(j, s.start[j].view(), finals[j].view());
      if (i + 1 < n && segments_[i + 1].owner != me) {
        sends.push_back(ring_.isend(finals[j].view(), segments_[i + 1].owner, kTagChainFwd + i + 1));
      }
      if (i + 1 == n) last_final = Tensor::copy_of(finals[j].view(), s.state_dtype, MemCategory::kWorkspace);
    }
    for (auto& w : sends) wait_timed(std::move(w));
    counters_.message_rounds += n - 1;
  } else {
    // 1. Each segment's map from a zero start, packed as [M | U].
    const std::int64_t mk = B * s.heads * K * K, uk = B * s.heads * K * V;
    std::vector<Tensor> agg(s.mine.size());
    for (std::size_t j = 0; j < s.mine.size(); ++j) {
      const Segment& seg = segments_[s.mine[j]];
      const SegmentInputs in = segment_inputs(s.q, s.k, s.v, s.g, s.beta, seg);
      agg[j] = Tensor::empty({mk + uk}, s.state_dtype, MemCategory::kCommBuffer);
      const double t0 = wall_seconds();
      attn::gdn_transition(forward_args(in, config_, {}), agg[j].view().slice0(0, mk).reshape(s.map_shape()),
                           agg[j].view().slice0(mk, mk + uk).reshape(s.state_shape()));
      counters_.compute_s += wall_seconds() - t0;
      s.map_m[j] = Tensor::copy_of(agg[j].view().slice0(0, mk).reshape(s.map_shape()), s.state_dtype,
                                   MemCategory::kSavedActivation);
    }
    auto m_of = [&](const Tensor& t) { return t.view().slice0(0, mk).reshape(s.map_shape()); };
    auto u_of = [&](const Tensor& t) { return t.view().slice0(mk, mk + uk).reshape(s.state_shape()); };
    // 2. Kogge-Stone inclusive scan: agg_i <- agg_i o agg_{i-o}.
    std::map<int, std::size_t> slot;  // global segment index -> index in mine
    for (std::size_t j = 0; j < s.mine.size(); ++j) slot[s.mine[j]] = j;
    counters_.message_rounds +=
        scan_maps(ring_, segments_, s.mine, s.map_shape(), s.state_shape(), +1, agg, &counters_.exposed_comm_s);
    // 3. End state of every segment from the global initial state; shift by one segment to get start states.
    std::vector<Tensor> end(s.mine.size());
    for (std::size_t j = 0; j < s.mine.size(); ++j) {
      end[j] = Tensor::empty(s.state_shape(), s.state_dtype, MemCategory::kCommBuffer);
      if (init_local.defined()) {
        attn::gdn_transition_apply(m_of(agg[j]), u_of(agg[j]), init_local.view(), end[j].view());
      } else {
        copy_convert(u_of(agg[j]), end[j].view());
      }
    }
    Round shift;
    for (std::size_t j = 0; j < s.mine.size(); ++j) {
      const int i = s.mine[j];
      s.start[j] = Tensor::zeros(s.state_shape(), s.state_dtype, MemCategory::kSavedActivation);
      if (i + 1 < n && segments_[i + 1].owner != me)
        shift.send(end[j].view(), segments_[i + 1].owner, kTagShift + i + 1);
      if (i == 0) {
        if (init_local.defined()) copy_convert(init_local.view(), s.start[j].view());
      } else if (segments_[i - 1].owner == me) {
        copy_convert(end[slot[i - 1]].view(), s.start[j].view());
      } else {
        shift.recv(s.start[j].view(), segments_[i - 1].owner, kTagShift + i);
      }
    }
    if (!shift.ops.empty()) wait_timed(ring_.batch_isend_irecv(shift.ops));
    if (n > 1) ++counters_.message_rounds;
    // 4. Every segment runs from its start state.
    for (std::size_t j = 0; j < s.mine.size(); ++j) {
      Tensor fin = Tensor::empty(s.state_shape(), s.state_dtype, MemCategory::kWorkspace);
      run_segment(j, s.start[j].view(), fin.view());
      if (s.mine[j] + 1 == n) last_final = std::move(fin);
    }
  }
  counters_.bytes_sent += ring_.counters().bytes_sent - before.bytes_sent;
  counters_.bytes_received += ring_.counters().bytes_received - before.bytes_received;

  // final_state: broadcast from the last segment's owner over the ring, then gather heads over Ulysses.
  GdnCpOutput result;
  Tensor final_local = last_final.defined() ? std::move(last_final)
                                            : Tensor::empty(s.state_shape(), s.state_dtype, MemCategory::kWorkspace);
  const double b0 = wall_seconds();
  ring_.broadcast(final_local.view(), segments_.back().owner)->wait();
  result.final_state = gather_state_heads(ulysses_, final_local.view());
  result.out = Tensor::empty({B, sl, H, V}, q.dtype(), MemCategory::kSavedActivation);
  ulysses_gather_heads(ulysses_, out_h.view(), result.out.view());
  counters_.exposed_comm_s += wall_seconds() - b0;
  counters_.a2a_bytes_sent += ulysses_.counters().bytes_sent - a2a_before;
  SEQPAR_LOG(kDebug) << "GDN forward (" << gdn_cp_mode_name(config_.mode) << ", ring " << ring_.rank() << "/"
                     << ring_.size() << ", " << segments_.size() << " segments): message rounds so far "
                     << counters_.message_rounds;
  s.has_forward = true;
  return result;
}

GdnCpGrads GdnContextParallel::backward(const TensorView& dout, const TensorView& dfinal_state) {
  Impl& s = *impl_;
  SEQPAR_CHECK(s.has_forward, "GDN CP: backward() needs a preceding forward()");
  const int pu = ulysses_.size();
  const std::int64_t B = s.batch, H = s.heads * pu, K = s.dk, V = s.dv, sl = layout_.local_len(),
                     sr = layout_.ring_shard_len();
  check_cpu(dout, "GDN CP dout");
  check_shape(dout, {B, sl, H, V}, "GDN CP dout");
  if (!dfinal_state.empty()) {
    check_shape(dfinal_state, {B, H, K, V}, "GDN CP dfinal_state");
    check_dtype(dfinal_state, s.state_dtype, "GDN CP dfinal_state");
  }
  const DType dtype = s.q.dtype();
  const std::int64_t a2a_before = ulysses_.counters().bytes_sent;
  Tensor dout_h = Tensor::empty({B, sr, s.heads, V}, dout.dtype(), MemCategory::kWorkspace);
  ulysses_scatter_heads(ulysses_, dout, dout_h.view());
  Tensor dfinal_local;
  if (!dfinal_state.empty()) dfinal_local = state_heads(dfinal_state, ulysses_.rank(), s.heads);

  const int n = static_cast<int>(segments_.size());
  const int me = ring_.rank();
  const CommCounters before = ring_.counters();
  Tensor dq_h = Tensor::empty({B, sr, s.heads, K}, dtype, MemCategory::kWorkspace);
  Tensor dk_h = Tensor::empty({B, sr, s.heads, K}, dtype, MemCategory::kWorkspace);
  Tensor dv_h = Tensor::empty({B, sr, s.heads, V}, dtype, MemCategory::kWorkspace);
  Tensor dg_h = Tensor::empty({B, sr, s.heads}, dtype, MemCategory::kWorkspace);
  Tensor db_h = Tensor::empty({B, sr, s.heads}, dtype, MemCategory::kWorkspace);
  Tensor first_dinit;  // d(initial_state) of segment 0, on its owner

  auto wait_timed = [&](WorkHandle w) {
    if (!w) return;
    const double t0 = wall_seconds();
    w->wait();
    counters_.exposed_comm_s += wall_seconds() - t0;
  };
  // Full backward of segment j with the given dS_end; writes the gradients' rows and returns dS_start.
  auto run_segment = [&](std::size_t j, const TensorView& ds_end) {
    const Segment& seg = segments_[s.mine[j]];
    const SegmentInputs in = segment_inputs(s.q, s.k, s.v, s.g, s.beta, seg);
    Tensor dout_seg = take_rows(dout_h.view(), seg.local_offset, seg.length, MemCategory::kWorkspace);
    attn::GdnBackwardArgs a;
    a.fwd = forward_args(in, config_, s.start[j].view());
    a.dout = dout_seg.view();
    a.dfinal_state = ds_end;
    Tensor dq = Tensor::empty(in.q.shape(), dtype, MemCategory::kWorkspace);
    Tensor dk = Tensor::empty(in.k.shape(), dtype, MemCategory::kWorkspace);
    Tensor dv = Tensor::empty(in.v.shape(), dtype, MemCategory::kWorkspace);
    Tensor dg = Tensor::empty(in.g.shape(), dtype, MemCategory::kWorkspace);
    Tensor db = Tensor::empty(in.beta.shape(), dtype, MemCategory::kWorkspace);
    Tensor ds_start = Tensor::empty(s.state_shape(), s.state_dtype, MemCategory::kCommBuffer);
    const double t0 = wall_seconds();
    attn::gdn_backward(a, dq.view(), dk.view(), dv.view(), dg.view(), db.view(), ds_start.view());
    counters_.compute_s += wall_seconds() - t0;
    put_rows(dq.view(), dq_h.view(), seg.local_offset);
    put_rows(dk.view(), dk_h.view(), seg.local_offset);
    put_rows(dv.view(), dv_h.view(), seg.local_offset);
    put_rows(dg.view(), dg_h.view(), seg.local_offset);
    put_rows(db.view(), db_h.view(), seg.local_offset);
    return ds_start;
  };

  if (config_.mode == GdnCpMode::kChain) {
    std::vector<WorkHandle> sends;
    std::vector<Tensor> ds_starts(s.mine.size());  // alive until their sends complete
    for (std::size_t jj = s.mine.size(); jj-- > 0;) {
      const int i = s.mine[jj];
      Tensor ds_end = Tensor::zeros(s.state_shape(), s.state_dtype, MemCategory::kCommBuffer);
      if (i == n - 1) {
        if (dfinal_local.defined()) copy_convert(dfinal_local.view(), ds_end.view());
      } else if (segments_[i + 1].owner == me) {
        copy_convert(ds_starts[jj + 1].view(), ds_end.view());
      } else {
        wait_timed(ring_.irecv(ds_end.view(), segments_[i + 1].owner, kTagChainBwd + i));
      }
      ds_starts[jj] = run_segment(jj, ds_end.view());
      if (i > 0 && segments_[i - 1].owner != me) {
        sends.push_back(ring_.isend(ds_starts[jj].view(), segments_[i - 1].owner, kTagChainBwd + i - 1));
      }
      if (i == 0) first_dinit = Tensor::copy_of(ds_starts[jj].view(), s.state_dtype, MemCategory::kWorkspace);
    }
    for (auto& w : sends) wait_timed(std::move(w));
    counters_.message_rounds += n - 1;
  } else {
    const std::int64_t mk = B * s.heads * K * K, uk = B * s.heads * K * V;
    auto m_of = [&](const Tensor& t) { return t.view().slice0(0, mk).reshape(s.map_shape()); };
    auto u_of = [&](const Tensor& t) { return t.view().slice0(mk, mk + uk).reshape(s.state_shape()); };
    // 1. Local parts L (cheap reverse sweep) and the maps (M^T, L).
    std::vector<Tensor> agg(s.mine.size());
    for (std::size_t j = 0; j < s.mine.size(); ++j) {
      const Segment& seg = segments_[s.mine[j]];
      const SegmentInputs in = segment_inputs(s.q, s.k, s.v, s.g, s.beta, seg);
      Tensor dout_seg = take_rows(dout_h.view(), seg.local_offset, seg.length, MemCategory::kWorkspace);
      attn::GdnBackwardArgs a;
      a.fwd = forward_args(in, config_, s.start[j].view());
      a.dout = dout_seg.view();
      agg[j] = Tensor::empty({mk + uk}, s.state_dtype, MemCategory::kCommBuffer);
      const double t0 = wall_seconds();
      attn::gdn_backward(a, {}, {}, {}, {}, {}, u_of(agg[j]));
      attn::gdn_transition_transpose(s.map_m[j].view(), m_of(agg[j]));
      counters_.compute_s += wall_seconds() - t0;
    }
    std::map<int, std::size_t> slot;
    for (std::size_t j = 0; j < s.mine.size(); ++j) slot[s.mine[j]] = j;
    // 2. Reverse Kogge-Stone scan: agg_i <- agg_i o agg_{i+o} (the later segments' map applies first).
    counters_.message_rounds +=
        scan_maps(ring_, segments_, s.mine, s.map_shape(), s.state_shape(), -1, agg, &counters_.exposed_comm_s);
    // 3. dS_start of every segment; shift to the previous segment to get each dS_end.
    std::vector<Tensor> ds_start(s.mine.size());
    for (std::size_t j = 0; j < s.mine.size(); ++j) {
      ds_start[j] = Tensor::empty(s.state_shape(), s.state_dtype, MemCategory::kCommBuffer);
      if (dfinal_local.defined()) {
        attn::gdn_transition_apply(m_of(agg[j]), u_of(agg[j]), dfinal_local.view(), ds_start[j].view());
      } else {
        copy_convert(u_of(agg[j]), ds_start[j].view());
      }
    }
    Round shift;
    std::vector<Tensor> ds_end(s.mine.size());
    for (std::size_t j = 0; j < s.mine.size(); ++j) {
      const int i = s.mine[j];
      ds_end[j] = Tensor::zeros(s.state_shape(), s.state_dtype, MemCategory::kCommBuffer);
      if (i > 0 && segments_[i - 1].owner != me)
        shift.send(ds_start[j].view(), segments_[i - 1].owner, kTagShift + i - 1);
      if (i == n - 1) {
        if (dfinal_local.defined()) copy_convert(dfinal_local.view(), ds_end[j].view());
      } else if (segments_[i + 1].owner == me) {
        copy_convert(ds_start[slot[i + 1]].view(), ds_end[j].view());
      } else {
        shift.recv(ds_end[j].view(), segments_[i + 1].owner, kTagShift + i);
      }
    }
    if (!shift.ops.empty()) wait_timed(ring_.batch_isend_irecv(shift.ops));
    if (n > 1) ++counters_.message_rounds;
    // 4. Full backward of every segment.
    for (std::size_t j = 0; j < s.mine.size(); ++j) {
      Tensor d0 = run_segment(j, ds_end[j].view());
      if (s.mine[j] == 0) first_dinit = std::move(d0);
    }
  }
  counters_.bytes_sent += ring_.counters().bytes_sent - before.bytes_sent;
  counters_.bytes_received += ring_.counters().bytes_received - before.bytes_received;

  GdnCpGrads grads;
  auto gather = [&](const Tensor& t, std::int64_t last, bool per_head_scalar) {
    Tensor out =
        Tensor::empty(per_head_scalar ? Shape{B, sl, H} : Shape{B, sl, H, last}, dtype, MemCategory::kWorkspace);
    const TensorView in = per_head_scalar ? as_4d(t.view()) : t.view();
    ulysses_gather_heads(ulysses_, in, per_head_scalar ? as_4d(out.view()) : out.view());
    return out;
  };
  grads.dq = gather(dq_h, K, false);
  grads.dk = gather(dk_h, K, false);
  grads.dv = gather(dv_h, V, false);
  grads.dg = gather(dg_h, 1, true);
  grads.dbeta = gather(db_h, 1, true);
  Tensor dinit_local = first_dinit.defined() ? std::move(first_dinit)
                                             : Tensor::empty(s.state_shape(), s.state_dtype, MemCategory::kWorkspace);
  ring_.broadcast(dinit_local.view(), segments_.front().owner)->wait();
  grads.dinitial_state = gather_state_heads(ulysses_, dinit_local.view());
  counters_.a2a_bytes_sent += ulysses_.counters().bytes_sent - a2a_before;
  return grads;
}

// ---- short conv halo ------------------------------------------------------------------------------------------

struct ShortConvContextParallel::HaloPlan {
  // For each of this rank's segments: the global positions of its halo (W-1 before its start, oldest first;
  // negative ones are zeros) and, for each, the (owner, owner's local row) that holds it.
  struct Need {
    std::int64_t position;
    int owner;
    std::int64_t row;
  };
  std::vector<int> mine;                        // indices into segments_
  std::vector<std::vector<Need>> needs;         // per segment of mine
  std::vector<std::vector<std::int64_t>> give;  // per peer: my local rows that peer needs, in its order
  std::vector<std::vector<std::pair<std::size_t, std::size_t>>> take;  // per peer: (segment j, halo slot)
};

ShortConvContextParallel::ShortConvContextParallel(Communicator& comm, const SequenceLayout& layout)
    : comm_(comm), layout_(layout) {
  SEQPAR_CHECK(comm.size() == layout.num_ranks(), "short conv CP: communicator size ", comm.size(), " != layout ranks ",
               layout.num_ranks());
  for (int r = 0; r < comm.size(); ++r) positions_.push_back(layout.positions(r));
  segments_ = segments_in_global_order(positions_);
}

Tensor ShortConvContextParallel::forward(const TensorView& x, const TensorView& weight, bool use_silu) {
  check_cpu(x, "short conv CP x");
  check_cpu(weight, "short conv CP weight");
  SEQPAR_CHECK(x.ndim() == 3 && x.dim(1) == layout_.local_len(), "short conv CP: x ", x.str(),
               " must be [B, S_local = ", layout_.local_len(), ", C]");
  SEQPAR_CHECK(weight.ndim() == 2 && weight.dim(0) == x.dim(2) && weight.dim(1) >= 1, "short conv CP: weight ",
               weight.str(), " must be [C = ", x.dim(2), ", W >= 1]");
  const std::int64_t B = x.dim(0), C = x.dim(2), W = weight.dim(1);
  const int me = comm_.rank(), n = comm_.size();
  // Plan the halo: who needs which rows from whom (every rank derives the same plan from the layout).
  if (!plan_ || width_ != W) {
    auto plan = std::make_shared<HaloPlan>();
    std::vector<std::pair<int, std::int64_t>> where(static_cast<std::size_t>(layout_.seq_len()));
    for (int r = 0; r < n; ++r)
      for (std::size_t i = 0; i < positions_[r].size(); ++i)
        where[positions_[r][i]] = {r, static_cast<std::int64_t>(i)};
    plan->give.assign(n, {});
    plan->take.assign(n, {});
    for (int i = 0; i < static_cast<int>(segments_.size()); ++i) {
      const Segment& seg = segments_[i];
      std::vector<HaloPlan::Need> need;
      for (std::int64_t w = W - 1; w >= 1; --w) {
        const std::int64_t p = seg.start - w;
        need.push_back({p, p >= 0 ? where[p].first : -1, p >= 0 ? where[p].second : -1});
      }
      if (seg.owner == me) {
        plan->mine.push_back(i);
        const std::size_t j = plan->needs.size();
        for (std::size_t h = 0; h < need.size(); ++h) {
          if (need[h].owner >= 0 && need[h].owner != me) plan->take[need[h].owner].push_back({j, h});
        }
        plan->needs.push_back(need);
      } else {
        for (const auto& nd : need) {
          if (nd.owner == me) plan->give[seg.owner].push_back(nd.row);
        }
      }
    }
    plan_ = plan;
    width_ = W;
  }
  const HaloPlan& plan = *plan_;
  const std::size_t rb = static_cast<std::size_t>(C) * dtype_size(x.dtype());
  // Exchange: to each peer, the rows it needs ([rows, B, C]); from each peer, ours.
  std::vector<Tensor> send(n), recv(n);
  std::vector<P2POp> ops;
  for (int r = 0; r < n; ++r) {
    if (!plan.give[r].empty()) {
      const std::int64_t rows = static_cast<std::int64_t>(plan.give[r].size());
      send[r] = Tensor::empty({rows, B, C}, x.dtype(), MemCategory::kCommBuffer);
      for (std::int64_t i = 0; i < rows; ++i)
        for (std::int64_t b = 0; b < B; ++b)
          std::memcpy(static_cast<char*>(send[r].data()) + (i * B + b) * rb,
                      static_cast<const char*>(x.data()) + (b * x.dim(1) + plan.give[r][i]) * rb, rb);
      ops.push_back(P2POp::send(send[r].view(), r, kTagHalo));
      halo_bytes_sent_ += static_cast<std::int64_t>(send[r].nbytes());
    }
    if (!plan.take[r].empty()) {
      recv[r] =
          Tensor::empty({static_cast<std::int64_t>(plan.take[r].size()), B, C}, x.dtype(), MemCategory::kCommBuffer);
      ops.push_back(P2POp::recv(recv[r].view(), r, kTagHalo));
    }
  }
  if (!ops.empty()) comm_.batch_isend_irecv(ops)->wait();

  saved_x_ = Tensor::copy_of(x, x.dtype(), MemCategory::kSavedActivation);
  saved_weight_ = Tensor::copy_of(weight, weight.dtype(), MemCategory::kSavedActivation);
  use_silu_ = use_silu;
  Tensor out = Tensor::empty(x.shape(), x.dtype(), MemCategory::kSavedActivation);
  // Assemble each segment's conv state (kept for the backward) and run it.
  saved_halo_.clear();
  saved_halo_.resize(plan.mine.size());
  std::vector<std::size_t> cursor(n, 0);
  for (std::size_t j = 0; j < plan.mine.size(); ++j) {
    const Segment& seg = segments_[plan.mine[j]];
    Tensor state = Tensor::zeros({B, W - 1, C}, x.dtype(), MemCategory::kWorkspace);
    for (std::size_t h = 0; h < plan.needs[j].size(); ++h) {
      const auto& nd = plan.needs[j][h];
      if (nd.owner < 0) continue;
      for (std::int64_t b = 0; b < B; ++b) {
        char* dst = static_cast<char*>(state.data()) + (b * (W - 1) + static_cast<std::int64_t>(h)) * rb;
        if (nd.owner == me) {
          std::memcpy(dst, static_cast<const char*>(x.data()) + (b * x.dim(1) + nd.row) * rb, rb);
        } else {
          const std::size_t i = cursor[nd.owner];
          std::memcpy(dst, static_cast<const char*>(recv[nd.owner].data()) + (i * B + b) * rb, rb);
        }
      }
      if (nd.owner != me) ++cursor[nd.owner];
    }
    Tensor xs = take_rows(x, seg.local_offset, seg.length, MemCategory::kWorkspace);
    Tensor ys = Tensor::empty(xs.shape(), x.dtype(), MemCategory::kWorkspace);
    attn::ShortConvArgs a;
    a.x = xs.view();
    a.weight = weight;
    a.initial_conv_state = W > 1 ? state.view() : TensorView();
    a.use_silu = use_silu;
    attn::short_conv_forward(a, ys.view(), {});
    put_rows(ys.view(), out.view(), seg.local_offset);
    saved_halo_[j] = std::move(state);
  }
  return out;
}

Tensor ShortConvContextParallel::backward(const TensorView& dout, const TensorView& dweight) {
  SEQPAR_CHECK(plan_ && saved_x_.defined(), "short conv CP: backward() needs a preceding forward()");
  const TensorView x = saved_x_.view();
  check_shape(dout, x.shape(), "short conv CP dout");
  check_shape(dweight, saved_weight_.shape(), "short conv CP dweight");
  const std::int64_t B = x.dim(0), C = x.dim(2), W = width_;
  const int me = comm_.rank(), n = comm_.size();
  const HaloPlan& plan = *plan_;
  check_cpu(dout, "short conv CP dout");
  Tensor dx32 = Tensor::zeros(x.shape(), DType::kFloat32, MemCategory::kWorkspace);
  Tensor dw32 = Tensor::zeros(saved_weight_.shape(), DType::kFloat32, MemCategory::kWorkspace);
  const std::size_t rb32 = static_cast<std::size_t>(C) * 4;
  // Halo gradients per peer, in the order of plan.take (fp32 on the wire).
  std::vector<Tensor> send(n), recv(n);
  for (int r = 0; r < n; ++r) {
    if (!plan.take[r].empty()) {
      send[r] = Tensor::empty({static_cast<std::int64_t>(plan.take[r].size()), B, C}, DType::kFloat32,
                              MemCategory::kCommBuffer);
    }
  }
  std::vector<std::size_t> cursor(n, 0);
  for (std::size_t j = 0; j < plan.mine.size(); ++j) {
    const Segment& seg = segments_[plan.mine[j]];
    Tensor xs = take_rows(x, seg.local_offset, seg.length, MemCategory::kWorkspace);
    Tensor dys = take_rows(dout, seg.local_offset, seg.length, MemCategory::kWorkspace);
    attn::ShortConvArgs a;
    a.x = xs.view();
    a.weight = saved_weight_.view();
    a.initial_conv_state = W > 1 ? saved_halo_[j].view() : TensorView();
    a.use_silu = use_silu_;
    Tensor dxs = Tensor::empty(xs.shape(), DType::kFloat32, MemCategory::kWorkspace);
    Tensor dws = Tensor::empty(saved_weight_.shape(), DType::kFloat32, MemCategory::kWorkspace);
    Tensor dstate = Tensor::empty({B, W - 1, C}, DType::kFloat32, MemCategory::kWorkspace);
    attn::short_conv_backward(a, dys.view(), dxs.view(), dws.view(), W > 1 ? dstate.view() : TensorView());
    // dx rows of the segment (segments are disjoint: plain add into zeros).
    Tensor cur_rows = take_rows(dx32.view(), seg.local_offset, seg.length, MemCategory::kWorkspace);
    add_inplace(cur_rows.view(), dxs.view());
    put_rows(cur_rows.view(), dx32.view(), seg.local_offset);
    add_inplace(dw32.view(), dws.view());
    // Halo gradients: to their owners (or into our own dx).
    for (std::size_t h = 0; h < plan.needs[j].size(); ++h) {
      const auto& nd = plan.needs[j][h];
      if (nd.owner < 0) continue;
      for (std::int64_t b = 0; b < B; ++b) {
        const float* g = dstate.data_as<float>() + (b * (W - 1) + static_cast<std::int64_t>(h)) * C;
        if (nd.owner == me) {
          float* d = dx32.data_as<float>() + (b * x.dim(1) + nd.row) * C;
          for (std::int64_t c = 0; c < C; ++c) d[c] += g[c];
        } else {
          std::memcpy(static_cast<char*>(send[nd.owner].data()) + (cursor[nd.owner] * B + b) * rb32, g, rb32);
        }
      }
      if (nd.owner != me) ++cursor[nd.owner];
    }
  }
  std::vector<P2POp> ops;
  for (int r = 0; r < n; ++r) {
    if (!plan.take[r].empty()) ops.push_back(P2POp::send(send[r].view(), r, kTagHaloGrad));
    if (!plan.give[r].empty()) {
      recv[r] = Tensor::empty({static_cast<std::int64_t>(plan.give[r].size()), B, C}, DType::kFloat32,
                              MemCategory::kCommBuffer);
      ops.push_back(P2POp::recv(recv[r].view(), r, kTagHaloGrad));
    }
  }
  if (!ops.empty()) comm_.batch_isend_irecv(ops)->wait();
  // Add the received halo gradients into our rows, peers in rank order (deterministic).
  for (int r = 0; r < n; ++r) {
    for (std::size_t i = 0; i < plan.give[r].size(); ++i) {
      for (std::int64_t b = 0; b < B; ++b) {
        const float* g = recv[r].data_as<float>() + (i * B + b) * C;
        float* d = dx32.data_as<float>() + (b * x.dim(1) + plan.give[r][i]) * C;
        for (std::int64_t c = 0; c < C; ++c) d[c] += g[c];
      }
    }
  }
  comm_.all_reduce(dw32.view(), ReduceOp::kSum)->wait();
  copy_convert(dw32.view(), dweight);
  Tensor dx = Tensor::empty(x.shape(), x.dtype(), MemCategory::kWorkspace);
  copy_convert(dx32.view(), dx.view());
  return dx;
}

}  // namespace seqpar
