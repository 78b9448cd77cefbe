#include "parallel/gdn_cp.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "parallel/ulysses.h"
#include "runtime/env.h"
#include "runtime/logging.h"
#include "runtime/tensor_checks.h"
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
// The chain's messages of segment i, head h carry tag base + gdn_tag_offset(i H + h), inside MPI's guaranteed tag
// range for any number of segments. Two chain messages between the same pair of ranks are posted in increasing
// (backward: decreasing) segment order by the sender and the receiver alike, so where tags repeat (indices
// kGdnTagSpan apart) they still match in order (MPI's non-overtaking rule; NCCL matches by order anyway). Scan and
// shift rounds send one packed message per peer (PackedRound).
static_assert(kTagChainFwd + kGdnTagSpan <= kTagChainBwd && kTagChainBwd + kGdnTagSpan <= kTagScan &&
                  kTagScan + kGdnTagSpan <= kTagShift && kTagShift + kGdnTagSpan <= kTagHalo && kTagHaloGrad <= 32767,
              "the kinds' tag ranges are disjoint and below 32767, the least MPI_TAG_UB MPI allows");
int tag_of(int base, std::int64_t index) { return base + gdn_tag_offset(index); }

// Adds the wall-clock and the process CPU seconds of its lifetime to `wall` and `cpu` (RAII).
class PhaseClock {
 public:
  PhaseClock(double& wall, double& cpu) : wall_(wall), cpu_(cpu), w0_(wall_seconds()), c0_(process_cpu_seconds()) {}
  ~PhaseClock() {
    wall_ += wall_seconds() - w0_;
    cpu_ += process_cpu_seconds() - c0_;
  }
  PhaseClock(const PhaseClock&) = delete;
  PhaseClock& operator=(const PhaseClock&) = delete;

 private:
  double &wall_, &cpu_;
  double w0_, c0_;
};

// The saved copies of the forward's inputs, made while the kernels read the caller's tensors (ulysses_size 1, host
// tensors): block by block while a message is pending (step(), the idle work before the work ahead), the rest before
// the forward waits for its own sends (finish()). Only the saved copies are late; the kernels never read them in
// the forward, so results do not change. Its time is counted into the copies phase.
class DeferredCopies {
 public:
  // Bytes per step: a fraction of a millisecond of copying, so that an arrival waits little.
  static constexpr std::int64_t kBlockBytes = std::int64_t{1} << 20;

  DeferredCopies(double& wall, double& cpu) : wall_(wall), cpu_(cpu) {}
  // dst (same shape and dtype as src, both contiguous host tensors) becomes a copy of src by finish().
  void add(const TensorView& src, const TensorView& dst) {
    SEQPAR_CHECK(src.shape() == dst.shape() && src.dtype() == dst.dtype(), "GDN CP: deferred copy of ", src.str(),
                 " into ", dst.str(), " needs the same shape and dtype");
    items_.push_back({static_cast<const char*>(src.data()), static_cast<char*>(dst.data()),
                      static_cast<std::int64_t>(src.nbytes())});
  }
  bool done() const { return next_ == items_.size(); }
  // Copies the next block; false when nothing was left.
  bool step() {
    if (done()) return false;
    const PhaseClock clock(wall_, cpu_);
    copy_block();
    return true;
  }
  // Copies what is left, calling `progress` (when given) between blocks.
  void finish(const std::function<void()>& progress = {}) {
    while (!done()) {
      {
        const PhaseClock clock(wall_, cpu_);
        copy_block();
      }
      if (progress) progress();
    }
  }

 private:
  struct Item {
    const char* src;
    char* dst;
    std::int64_t bytes;
  };
  void copy_block() {
    Item& it = items_[next_];
    const std::int64_t n = std::min(kBlockBytes, it.bytes - offset_);
    if (n > 0) std::memcpy(it.dst + offset_, it.src + offset_, static_cast<std::size_t>(n));
    offset_ += n;
    if (offset_ >= it.bytes) {
      ++next_;
      offset_ = 0;
    }
  }
  double &wall_, &cpu_;
  std::vector<Item> items_;
  std::size_t next_ = 0;
  std::int64_t offset_ = 0;
};

// Idle work: the deferred copies first, then `then` (when given).
std::function<bool()> copies_then(DeferredCopies& copies, std::function<bool()> then) {
  if (copies.done()) return then;
  return [&copies, then = std::move(then)] { return copies.step() || (then && then()); };
}

// The backward's sums of dq, dk over the value heads of each key head (grouped value heads, G > 1): from the per
// value head [B, S_ring, Hl, K] into [B, S_ring, Hl / G, K], key head by key head, each once its G value heads have run
// on every row of the rank (ran()): while a message is pending (step()) and the rest at the end (finish()). Every
// element is the sum of the same G terms in value-head order in the state dtype T, as the whole-tensor reduction it
// replaces adds them, so results do not change. Host fp32 / fp64 tensors of one dtype. Its time is counted into the
// copies phase.
class KeyHeadSums {
 public:
  KeyHeadSums(const TensorView& dq_v, const TensorView& dk_v, const TensorView& dq, const TensorView& dk,
              std::int64_t group, std::int64_t rows_needed, double& wall, double& cpu)
      : dq_v_(dq_v),
        dk_v_(dk_v),
        dq_(dq),
        dk_(dk),
        group_(group),
        rows_needed_(rows_needed),
        ran_(static_cast<std::size_t>(dq_v.dim(2)), 0),
        summed_(static_cast<std::size_t>(dq.dim(2)), 0),
        wall_(wall),
        cpu_(cpu) {
    SEQPAR_CHECK(dq_v.dtype() == dq.dtype() && dk_v.dtype() == dk.dtype() && dq.dtype() == dk.dtype() &&
                     (dq.dtype() == DType::kFloat32 || dq.dtype() == DType::kFloat64),
                 "GDN CP: key-head sums of ", dq_v.str(), " into ", dq.str(), " need one fp32 / fp64 dtype");
  }
  // Value head h has run on `rows` more rows.
  void ran(std::int64_t h, std::int64_t rows) { ran_[static_cast<std::size_t>(h)] += rows; }
  // Sums the first key head whose value heads have all run and that is not summed yet; false when there is none.
  bool step() {
    for (std::size_t kh = 0; kh < summed_.size(); ++kh) {
      if (summed_[kh]) continue;
      bool ready = true;
      for (std::int64_t e = 0; e < group_; ++e) {
        ready = ready && ran_[kh * static_cast<std::size_t>(group_) + static_cast<std::size_t>(e)] >= rows_needed_;
      }
      if (!ready) continue;
      sum(static_cast<std::int64_t>(kh));
      return true;
    }
    return false;
  }
  // Sums every key head not summed yet.
  void finish() {
    for (std::size_t kh = 0; kh < summed_.size(); ++kh) {
      if (!summed_[kh]) sum(static_cast<std::int64_t>(kh));
    }
  }

 private:
  void sum(std::int64_t kh) {
    const PhaseClock clock(wall_, cpu_);
    if (dq_.dtype() == DType::kFloat32) {
      sum_as<float>(dq_v_, dq_, kh);
      sum_as<float>(dk_v_, dk_, kh);
    } else {
      sum_as<double>(dq_v_, dq_, kh);
      sum_as<double>(dk_v_, dk_, kh);
    }
    summed_[static_cast<std::size_t>(kh)] = 1;
  }
  template <typename T>
  void sum_as(const TensorView& src, const TensorView& dst, std::int64_t kh) const {
    const std::int64_t rows = src.dim(0) * src.dim(1), hl = src.dim(2), hkl = dst.dim(2), K = dst.dim(3);
    const T* s = static_cast<const T*>(src.data());
    T* d = static_cast<T*>(dst.data());
    for (std::int64_t r = 0; r < rows; ++r) {
      const T* in = s + (r * hl + kh * group_) * K;
      T* out = d + (r * hkl + kh) * K;
      for (std::int64_t x = 0; x < K; ++x) out[x] = in[x];
      for (std::int64_t e = 1; e < group_; ++e) {
        for (std::int64_t x = 0; x < K; ++x) out[x] += in[e * K + x];
      }
    }
  }
  TensorView dq_v_, dk_v_, dq_, dk_;
  std::int64_t group_, rows_needed_;
  std::vector<std::int64_t> ran_;
  std::vector<char> summed_;
  double &wall_, &cpu_;
};

// Rows [offset, offset + length) of positions along dim 1.
std::vector<std::int64_t> row_range(std::int64_t offset, std::int64_t length) {
  std::vector<std::int64_t> rows(static_cast<std::size_t>(length));
  for (std::int64_t i = 0; i < length; ++i) rows[i] = offset + i;
  return rows;
}

// Rows [offset, offset + length) of every batch of a [B, S, ...] tensor, as a contiguous [B, length, ...] copy.
Tensor take_rows(const TensorView& t, std::int64_t offset, std::int64_t length, MemCategory category, Stream stream) {
  const DeviceAlloc alloc{t.device(), stream};
  Shape s = t.shape();
  s[1] = length;
  Tensor out = alloc.empty(s, t.dtype(), category);
  gather_rows(t, 1, row_range(offset, length), out.view(), stream);
  return out;
}

// The inverse: writes a [B, length, ...] tensor into rows [offset, offset + length) of `dst`.
void put_rows(const TensorView& src, const TensorView& dst, std::int64_t offset, Stream stream) {
  scatter_rows(src, 1, row_range(offset, src.dim(1)), dst, stream);
}

// One round of point-to-point messages with at most one message per peer and direction: the pieces a rank sends a
// peer are packed into one buffer in the order they were added, and a receiver adds its pieces from a peer in the
// order that peer adds them (both in increasing segment order, or both in decreasing). Packing keeps a round at one
// message per peer however many segments a rank holds (a packed row of many short documents has thousands).
class PackedRound {
 public:
  explicit PackedRound(const DeviceAlloc& alloc) : alloc_(alloc) {}
  void send(const TensorView& t, int peer) { sends_[peer].push_back(t); }
  void recv(const TensorView& t, int peer) { recvs_[peer].push_back(t); }
  // Posts the messages (tag `tag`), waits (the wait counted into exposed_s) and unpacks what arrived; no-op when
  // nothing was added.
  void run(Communicator& comm, int tag, double* exposed_s, const std::function<bool()>& idle = {}) {
    post(comm, tag);
    wait(exposed_s, idle);
  }
  // run() in two steps: post() packs and posts every message, wait() waits (counted into exposed_s) and unpacks.
  void post(Communicator& comm, int tag) {
    if (sends_.empty() && recvs_.empty()) return;
    std::vector<P2POp> ops;
    for (const auto& [peer, views] : sends_) {
      buffers_.push_back(pack(views));
      for (std::int64_t off = 0; const TensorView& v : views) {
        alloc_.copy_convert(v, part(buffers_.back(), off, v));
        off += v.numel();
      }
      ops.push_back(P2POp::send(buffers_.back().view(), peer, tag));
    }
    for (const auto& [peer, views] : recvs_) {
      buffers_.push_back(pack(views));
      unpack_.emplace_back(&views, buffers_.size() - 1);
      ops.push_back(P2POp::recv(buffers_.back().view(), peer, tag));
    }
    work_ = comm.batch_isend_irecv(ops);
  }
  // idle (when given) runs while the messages have not all arrived, until it returns false (nothing left to do).
  void wait(double* exposed_s, const std::function<bool()>& idle = {}) {
    if (!work_) return;
    if (idle) {
      while (!work_->test() && idle()) {
      }
    }
    timed_wait(work_, exposed_s);
    work_.reset();
    for (const auto& [views, b] : unpack_) {
      for (std::int64_t off = 0; const TensorView& v : *views) {
        alloc_.copy_convert(part(buffers_[b], off, v), v);
        off += v.numel();
      }
    }
  }
  // Lets the communicator progress posted sends (a large message may need the sender's help) without blocking.
  void poke() {
    if (work_) (void)work_->test();
  }
  bool empty() const { return sends_.empty() && recvs_.empty(); }

 private:
  // A buffer for `views` end to end (one dtype: the state dtype).
  Tensor pack(const std::vector<TensorView>& views) const {
    std::int64_t n = 0;
    for (const TensorView& v : views) n += v.numel();
    return alloc_.empty({n}, views.front().dtype(), MemCategory::kCommBuffer);
  }
  static TensorView part(const Tensor& buffer, std::int64_t off, const TensorView& like) {
    return buffer.view().slice0(off, off + like.numel()).reshape(like.shape());
  }
  const DeviceAlloc& alloc_;
  std::map<int, std::vector<TensorView>> sends_, recvs_;
  std::vector<Tensor> buffers_;
  std::vector<std::pair<const std::vector<TensorView>*, std::size_t>> unpack_;
  WorkHandle work_;
};

// Head-major copy of a [B, S, H, D] tensor: [H, B, S, D], so that head h is the contiguous [B, S, 1, D] of head_view.
Tensor head_major(const TensorView& t, MemCategory category, Stream stream) {
  const DeviceAlloc alloc{t.device(), stream};
  Tensor out = alloc.empty({t.dim(2), t.dim(0), t.dim(1), t.ndim() == 4 ? t.dim(3) : 1}, t.dtype(), category);
  swap_outer_dims(t, t.dim(0) * t.dim(1), t.dim(2), out.view(), stream);
  return out;
}
TensorView head_view(const Tensor& hm, std::int64_t h) {
  return hm.view().slice0(h, h + 1).reshape({hm.dim(1), hm.dim(2), 1, hm.dim(3)});
}

// Head h of a [N, H, ...] state tensor as a contiguous [N, 1, ...] copy, and the inverse.
Tensor take_head(const TensorView& t, std::int64_t h, MemCategory category, Stream stream) {
  const DeviceAlloc alloc{t.device(), stream};
  Shape s = t.shape();
  s[1] = 1;
  Tensor out = alloc.empty(s, t.dtype(), category);
  const std::int64_t idx[1] = {h};
  gather_rows(t, 1, idx, out.view(), stream);
  return out;
}
void put_head(const TensorView& src, const TensorView& dst, std::int64_t h, Stream stream) {
  const std::int64_t idx[1] = {h};
  scatter_rows(src, 1, idx, dst, stream);
}

}  // namespace

// Work ahead (attn::GdnAhead) for the windows that will wait for a state from another rank, in the order they run:
// while a rank waits for a message it calls step(), which computes a few chunks of the first window not yet done
// ahead, so that when the state arrives only the state-dependent part of that window is left. Purely local: step()
// posts no message and waits for none, and every message is posted and waited for in the same order as without it,
// so it changes when a rank notices an arrival (by at most one step) but not the schedule's message order or its
// results (the kernels' results with work ahead are bitwise those without).
class GdnCp::AheadQueue {
 public:
  // What a window's kernel reads: the args (the backward's with the window's start state) of (segment slot j, head h).
  using ArgsOf = std::function<attn::GdnForwardArgs(std::size_t j, std::int64_t h)>;
  // Chunks per step: short enough that an arrival waits little (a few milliseconds at K = V = 128).
  static constexpr std::int64_t kChunksPerStep = 4;
  // At most kGdnAheadMaxWindows windows are made ahead and not yet used, their buffers under kGdnAheadBudgetBytes
  // (the first one always fits; gdn_cp.h).
  static constexpr std::int64_t kMaxWindows = kGdnAheadMaxWindows;
  static constexpr std::int64_t kBudgetBytes = kGdnAheadBudgetBytes;

  // Its time is counted into wall.local and wall.ahead (cpu likewise) and compute_s.
  AheadQueue(bool enabled, bool backward, ArgsOf args_of, GdnCp::PhaseSeconds& wall, GdnCp::PhaseSeconds& cpu,
             double& compute_s)
      : enabled_(enabled),
        backward_(backward),
        args_of_(std::move(args_of)),
        wall_(wall),
        cpu_(cpu),
        compute_(compute_s) {}
  // Window (j, h) waits for a state; add in the order the windows run.
  void add(std::size_t j, std::int64_t h, const attn::GdnWindow& w) {
    if (!enabled_) return;
    index_[{j, h}] = items_.size();
    items_.push_back({j, h, w, {}, 0, false, false});
  }
  // Moves the last window added to the front (before any step): it is worked on first.
  void last_first() {
    SEQPAR_ASSERT(next_ == 0 && held_windows_ == 0, "GDN work ahead reordered after its first step");
    if (items_.size() < 2) return;
    std::rotate(items_.begin(), items_.end() - 1, items_.end());
    for (std::size_t i = 0; i < items_.size(); ++i) index_[{items_[i].j, items_[i].h}] = i;
  }
  // A few chunks of the first window not done ahead. Returns false when there is nothing to do (all done, or the
  // next buffer would pass the budget).
  bool step() {
    // Done: used, complete, or made without a buffer (the test-mode route computes nothing ahead).
    auto done = [](const Item& i) { return i.used || (i.made && (i.ahead.complete() || !i.ahead.buffer.defined())); };
    while (next_ < items_.size() && done(items_[next_])) ++next_;
    if (next_ == items_.size()) return false;
    Item& it = items_[next_];
    const attn::GdnForwardArgs args = args_of_(it.j, it.h);
    const PhaseClock local(wall_.local, cpu_.local), ahead(wall_.ahead, cpu_.ahead);
    const ScopedTimer timer(compute_);
    if (!it.made) {
      const std::int64_t bytes = attn::gdn_ahead_bytes(args, it.window, backward_);
      if (held_ > 0 && (held_ + bytes > kBudgetBytes || held_windows_ >= kMaxWindows)) return false;
      it.ahead =
          backward_ ? attn::gdn_backward_ahead({args, {}, {}}, it.window) : attn::gdn_forward_ahead(args, it.window);
      it.made = true;
      it.bytes = bytes;
      held_ += bytes;
      ++held_windows_;
    }
    attn::gdn_ahead_step(args, it.ahead, kChunksPerStep);
    return true;
  }
  // The work ahead of window (j, h) when any was started, else null; release() once the window has run.
  attn::GdnAhead* find(std::size_t j, std::int64_t h) {
    const auto f = index_.find({j, h});
    if (f == index_.end() || !items_[f->second].made) return nullptr;
    return &items_[f->second].ahead;
  }
  void release(std::size_t j, std::int64_t h) {
    const auto f = index_.find({j, h});
    if (f == index_.end()) return;
    Item& it = items_[f->second];
    if (it.used) return;
    if (it.made) --held_windows_;
    held_ -= it.bytes;
    it.bytes = 0;
    it.ahead = {};
    it.used = true;
  }
  std::function<bool()> idle() {
    if (!enabled_) return {};
    return [this] { return step(); };
  }

 private:
  struct Item {
    std::size_t j;
    std::int64_t h;
    attn::GdnWindow window;
    attn::GdnAhead ahead;
    std::int64_t bytes;
    bool made, used;
  };
  bool enabled_, backward_;
  ArgsOf args_of_;
  GdnCp::PhaseSeconds &wall_, &cpu_;
  double& compute_;
  std::vector<Item> items_;
  std::map<std::pair<std::size_t, std::int64_t>, std::size_t> index_;
  std::size_t next_ = 0;
  std::int64_t held_ = 0, held_windows_ = 0;
};

std::vector<Segment> segments_in_global_order(const std::vector<std::vector<std::int64_t>>& tokens_per_rank) {
  std::vector<Segment> segs;
  for (int r = 0; r < static_cast<int>(tokens_per_rank.size()); ++r) {
    const auto& tok = tokens_per_rank[r];
    for (std::size_t i = 0; i < tok.size();) {
      if (tok[i] < 0) {  // padding
        ++i;
        continue;
      }
      std::size_t j = i + 1;
      while (j < tok.size() && tok[j] >= 0 && tok[j] == tok[j - 1] + 1) ++j;
      segs.push_back({tok[i], static_cast<std::int64_t>(j - i), r, static_cast<std::int64_t>(i)});
      i = j;
    }
  }
  std::sort(segs.begin(), segs.end(), [](const Segment& a, const Segment& b) { return a.start < b.start; });
  return segs;
}

std::vector<SegmentPiece> segment_pieces(const Segment& seg, const std::vector<std::int64_t>& cu_seqlens) {
  std::vector<SegmentPiece> pieces;
  const std::int64_t end = seg.start + seg.length;
  for (std::int64_t t = seg.start; t < end;) {
    // The document of token t: the last d with cu_seqlens[d] <= t (it holds t, being non-empty).
    const auto d =
        static_cast<std::int64_t>(std::upper_bound(cu_seqlens.begin(), cu_seqlens.end(), t) - cu_seqlens.begin()) - 1;
    const std::int64_t stop = std::min(end, cu_seqlens[d + 1]);
    pieces.push_back({t - seg.start, stop - t, d, t == cu_seqlens[d], stop == cu_seqlens[d + 1]});
    t = stop;
  }
  return pieces;
}

namespace {

// ---- what the layers read from the layout: the token of every row (-1: padding) and the document bounds ----

std::vector<std::int64_t> shard_tokens(const SequenceLayout& layout, int cp_rank) {
  return layout.token_index(cp_rank);
}

// The rows of ring shard `ring_rank` (what a rank holds after the Ulysses all-to-all).
std::vector<std::int64_t> ring_shard_tokens(const SequenceLayout& layout, int ring_rank) {
  return layout.tokens_of_slots(layout.ring_shard_positions(ring_rank));
}

std::vector<std::int64_t> document_bounds(const SequenceLayout& layout) {
  const std::span<const std::int64_t> cu = layout.cu_seqlens();
  return {cu.begin(), cu.end()};
}

}  // namespace

// ---- GDN under CP --------------------------------------------------------------------------------------------

struct GdnCp::Saved {
  // Ring-level (head-sharded) saved inputs (undefined at ulysses_size 1 without save_inputs) and per-segment,
  // per-head state.
  Tensor q, k, v, g, beta;
  // What the kernels read: views of q ... beta above, or of the caller's tensors (the forward's, then those handed
  // back to backward).
  GdnCpInputs read;
  // The forward's caller tensors: after the forward only their shapes, dtypes and devices are read (the backward
  // checks the inputs handed back against them).
  GdnCpInputs given;
  Tensor init;                                        // this rank's heads of initial_state (undefined: zeros)
  std::vector<std::vector<Tensor>> start;             // [segment of mine][value head]: incoming state [B, 1, K, V]
  std::vector<std::vector<Tensor>> map_m;             // scan: M [B, 1, K, K] of a carrying segment (when computed)
  std::int64_t batch = 0, heads = 0, dk = 0, dv = 0;  // heads: local value heads (Hv / Pu)
  std::int64_t key_heads = 0;                         // global key heads Hk (q, k)
  std::int64_t num_docs = 1;                          // documents (1 for an unpacked layout)
  bool packed = false;
  DType state_dtype = DType::kFloat32;

  // Value heads per local key head (value head h reads local key head h / group()).
  std::int64_t group() const { return heads / read.q.dim(2); }
  // One document's state of one value head: [B, 1, K, V], B = 1 when packed.
  Shape state_shape() const { return {batch, 1, dk, dv}; }
  // Every document's states: [N, Hl, K, V] packed, [B, Hl, K, V] otherwise.
  Shape states_shape() const { return {packed ? num_docs : batch, heads, dk, dv}; }
  // Document d's state inside a states_shape() tensor (undefined stays empty: zeros).
  TensorView doc_state(const Tensor& states, std::int64_t d) const {
    if (!states.defined()) return {};
    return packed ? states.view().slice0(d, d + 1) : states.view();
  }
  Shape map_shape() const { return {batch, 1, dk, dk}; }
  // A map of one value head packed as [M | U] (what the scan sends) and its two parts.
  std::int64_t packed_numel() const { return shape_numel(map_shape()) + shape_numel(state_shape()); }
  TensorView m_of(const Tensor& packed) const {
    return packed.view().slice0(0, shape_numel(map_shape())).reshape(map_shape());
  }
  TensorView u_of(const Tensor& packed) const {
    return packed.view().slice0(shape_numel(map_shape()), packed_numel()).reshape(state_shape());
  }
};

namespace {

// rows x cols undefined tensors.
std::vector<std::vector<Tensor>> tensor_grid(std::size_t rows, std::int64_t cols) {
  std::vector<std::vector<Tensor>> g(rows);
  for (auto& r : g) r.resize(static_cast<std::size_t>(cols));
  return g;
}

// A zero map packed as [M | U] (Saved::packed_numel).
template <typename SavedT>
Tensor zero_map(const SavedT& s, const DeviceAlloc& alloc) {
  return alloc.zeros({s.packed_numel()}, s.state_dtype, MemCategory::kCommBuffer);
}

// The ring-level inputs head-major (head_major): value head h reads q, k of key head h / group.
struct HeadInputs {
  Tensor q, k, v, g, beta;
  std::int64_t group = 1;
  TensorView qh(std::int64_t h) const { return head_view(q, h / group); }
  TensorView kh(std::int64_t h) const { return head_view(k, h / group); }
  TensorView vh(std::int64_t h) const { return head_view(v, h); }
  TensorView gh(std::int64_t h) const { return head_view(g, h).reshape({g.dim(1), g.dim(2), 1}); }
  TensorView bh(std::int64_t h) const { return head_view(beta, h).reshape({beta.dim(1), beta.dim(2), 1}); }
};

// The ring-level inputs the kernels read (the caller's tensors while the saved copies are deferred, or without
// save_inputs).
HeadInputs head_inputs(const GdnCpInputs& in, std::int64_t group, Stream stream) {
  const MemCategory c = MemCategory::kWorkspace;
  return {head_major(in.q, c, stream), head_major(in.k, c, stream),    head_major(in.v, c, stream),
          head_major(in.g, c, stream), head_major(in.beta, c, stream), group};
}

}  // namespace

GdnCp::GdnCp(const CpGroups& groups, const SequenceLayout& layout, const GdnCpConfig& config)
    : CpLayerBase(groups, layout, "GDN CP"), config_(config) {
  SEQPAR_CHECK(layout.kind() != LayoutKind::kStripe,
               "GDN under context parallelism supports the contiguous, zigzag and balanced layouts; the stripe "
               "layout would make every token its own segment");
  SEQPAR_CHECK(config.chunk_size >= 1, "GDN chunk_size ", config.chunk_size, " must be >= 1");
  SEQPAR_CHECK(std::isfinite(config.scale), "GDN scale ", config.scale, " must be finite (0 or less: 1/sqrt(K))");
  std::vector<std::vector<std::int64_t>> ring_tokens;
  for (int r = 0; r < groups.ring_size(); ++r) ring_tokens.push_back(ring_shard_tokens(layout_, r));
  ring_shard_rows_ = static_cast<std::int64_t>(ring_tokens[groups.ring.rank()].size());
  segments_ = segments_in_global_order(ring_tokens);
  cu_seqlens_ = document_bounds(layout_);
  for (int i = 0; i < static_cast<int>(segments_.size()); ++i) {
    pieces_.push_back(segment_pieces(segments_[i], cu_seqlens_));
    if (!pieces_.back().front().starts_doc) ++chain_links_;  // a state passes from segment i - 1 to segment i
    if (segments_[i].owner == groups.ring.rank()) {
      slot_[i] = mine_.size();
      mine_.push_back(i);
    }
  }
  plan_fwd_ = std::make_shared<ScanPlan>(gdn_scan_plan(pieces_, +1));
  plan_bwd_ = std::make_shared<ScanPlan>(gdn_scan_plan(pieces_, -1));
  work_ahead_ = config.work_ahead && env::gdn_work_ahead();
  defer_copies_ = config.defer_copies && env::gdn_defer_copies();
  ahead_last_first_ = config.ahead_last_first && env::gdn_ahead_last_first();
  lean_backward_ = config.lean_backward && env::gdn_lean_backward();
}

// The scan's bookkeeping (docs/design.md, "GDN chain and scan"). Direction +1 (forward): segment i's map takes its
// start state to its end state, a segment "carries" when it is one piece that continues a document, and the shift
// gives segment i + 1 the end state of i. Direction -1 (backward): the maps take dS_end to dS_start, a segment
// carries when it is one piece that continues a document and is continued, and the shift gives segment i - 1 the
// dS_start of i. Kogge-Stone round r (offset o = 2^(r-1)) composes the map of i with the one of i - dir o.
GdnScanPlan gdn_scan_plan(const std::vector<std::vector<SegmentPiece>>& pieces, int dir) {
  const int n = static_cast<int>(pieces.size());
  auto continues = [&](int i) { return !pieces[i].front().starts_doc; };
  auto continued = [&](int i) { return !pieces[i].back().ends_doc; };
  GdnScanPlan p;
  while ((1 << p.rounds) < n) ++p.rounds;
  const int R = p.rounds;
  auto in = [&](int i) { return i >= 0 && i < n; };
  // Does the shift pass a state from segment i to segment i + dir?
  auto link = [&](int i) { return in(i + dir) && (dir > 0 ? continues(i + 1) : continues(i)); };
  p.known.assign(R + 1, std::vector<char>(n, 0));
  p.need.assign(R + 1, std::vector<char>(n, 0));
  for (int i = 0; i < n; ++i) {
    const bool carries = pieces[i].size() == 1 && continues(i) && (dir > 0 || continued(i));
    p.known[0][i] = !carries;
  }
  for (int r = 1, o = 1; r <= R; ++r, o *= 2) {
    for (int i = 0; i < n; ++i) p.known[r][i] = p.known[r - 1][i] || (in(i - dir * o) && p.known[r - 1][i - dir * o]);
  }
  for (int i = 0; i < n; ++i) p.need[R][i] = link(i);
  for (int r = R, o = 1 << (R - 1); r >= 1; --r, o /= 2) {
    for (int i = 0; i < n; ++i) {
      if (!p.need[r][i]) continue;
      p.need[r - 1][i] = 1;
      // A known map stays as it is (a map with M = 0 composed with any other is itself).
      if (!p.known[r - 1][i] && in(i - dir * o)) p.need[r - 1][i - dir * o] = 1;
    }
  }
  // A segment whose predecessor's map is known from phase 1 and whose own unscanned map nobody else reads runs in
  // round 1 from the state it receives, and its map is never computed.
  p.direct.assign(n, 0);
  p.ready.assign(n, R);
  for (int i = 0; i < n; ++i) {
    if (R >= 1 && p.need[1][i] && !p.known[0][i] && p.known[1][i] && !(in(i + dir) && p.composes(1, i + dir))) {
      p.direct[i] = 1;
    }
    for (int r = R; r >= 0; --r) {
      if (p.known[r][i] || (r == 1 && p.direct[i])) p.ready[i] = r;
    }
  }
  return p;
}

namespace {

// Inputs of `length` rows from `offset` of value head h (q, k of its key head), copied out: [B, length, 1, *].
struct SegmentInputs {
  Tensor q, k, v, g, beta;
};

SegmentInputs segment_inputs(const HeadInputs& hi, std::int64_t h, std::int64_t offset, std::int64_t length,
                             Stream stream) {
  const MemCategory c = MemCategory::kWorkspace;
  auto rows = [&](const TensorView& t) { return take_rows(t, offset, length, c, stream); };
  return {rows(hi.qh(h)), rows(hi.kh(h)), rows(hi.vh(h)), rows(hi.gh(h)), rows(hi.bh(h))};
}

attn::GdnForwardArgs forward_args(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& g,
                                  const TensorView& beta, const GdnCpConfig& cfg, const TensorView& start) {
  return {q, k, v, g, beta, start, cfg.use_qk_l2norm, cfg.scale, cfg.chunk_size};
}

attn::GdnForwardArgs forward_args(const SegmentInputs& in, const GdnCpConfig& cfg, const TensorView& start) {
  return forward_args(in.q.view(), in.k.view(), in.v.view(), in.g.view(), in.beta.view(), cfg, start);
}

// The Ulysses plan of H value heads on Hk key heads over Pu ranks: value heads are split, key heads follow (split
// when Pu divides Hk, else replicated). GDN's own errors first, identical on every rank.
UlyssesHeads gdn_ulysses_heads(std::int64_t H, std::int64_t Hk, int pu) {
  SEQPAR_CHECK(Hk >= 1 && H >= 1 && H % Hk == 0, "GDN CP: value heads Hv = ", H,
               " must be a positive multiple of key heads Hk = ", Hk, " (value head h reads key head h / (Hv / Hk))");
  SEQPAR_CHECK(H % pu == 0, "GDN CP: value heads Hv = ", H, " must be divisible by ulysses_size ", pu);
  SEQPAR_CHECK(Hk % pu == 0 || pu % Hk == 0, "GDN CP: key heads Hk = ", Hk, " must be divisible by ulysses_size ", pu,
               " or divide it (then each key head is replicated to ulysses_size / Hk ranks)");
  return UlyssesHeads(H, Hk, pu);
}

// The end of a chain phase: waits for this rank's sends (the wait counted as exposed) and adds the chain's sequential
// rounds, one per link between segments.
void finish_chain_sends(std::vector<WorkHandle>& sends, CpCounters& counters, std::int64_t links) {
  for (auto& w : sends) timed_wait(w, &counters.exposed_comm_s);
  counters.message_rounds += links;
}

// Every document's state summed over the ring (each is written by the one rank whose piece ends or starts the
// document, zeros elsewhere: the sum is exact); then the zero-length documents', which pass `through` (their
// initial state forward, their dfinal_state backward; zeros when undefined) unchanged.
void finish_doc_states(Communicator& ring, const Tensor& states, const std::vector<std::int64_t>& cu_seqlens,
                       const Tensor& through, bool packed, const DeviceAlloc& alloc, double* exposed_s) {
  WorkHandle sum = ring.all_reduce(states.view(), ReduceOp::kSum);
  timed_wait(ring, sum, exposed_s);
  if (!packed) return;
  for (std::size_t d = 0; d + 1 < cu_seqlens.size(); ++d) {
    if (cu_seqlens[d] != cu_seqlens[d + 1]) continue;
    const auto i = static_cast<std::int64_t>(d);
    const TensorView dst = states.view().slice0(i, i + 1);
    if (through.defined()) alloc.copy_convert(through.view().slice0(i, i + 1), dst);
  }
}

}  // namespace

// What run_scan does at each step for one value head of one of this rank's segments (forward or backward).
struct GdnCp::ScanHooks {
  // Phase 1: the segment's packed map, or an undefined tensor when the plan needs none.
  std::function<Tensor(std::size_t j, std::int64_t h)> phase1;
  // Round 1 of a direct segment: runs from the received state; returns its packed map (M = 0).
  std::function<Tensor(std::size_t j, std::int64_t h, const TensorView& state)> direct;
  // After the shift: runs what is left with the state it received (empty when it receives none).
  std::function<void(std::size_t j, std::int64_t h, const TensorView& state)> finish;
  // While a round's or the shift's messages are pending: one step of local work, false when there is none.
  std::function<bool()> idle;
  // Before the scan waits for its own sends: local work left, calling `progress` now and then (may be empty).
  std::function<void(const std::function<void()>& progress)> before_send_wait;
};

// One forward call's buffers, shared by its steps (run_pieces, forward_chain, forward_scan).
struct GdnCp::ForwardPass {
  Saved& s;
  const DeviceAlloc& alloc;
  Stream stream;
  DType dtype;    // of q: the outputs'
  Tensor& out_h;  // [B, S_ring, Hl, V]; padding rows belong to no segment and stay 0
  Tensor&
      finals;  // the end state of every document that ends in one of this rank's pieces (summed over the ring later)
  // The ring-level inputs the kernels read: s.q ... s.beta, or the caller's tensors (while their saved copies are
  // deferred, or without save_inputs).
  GdnCpInputs inputs;
  DeferredCopies& copies;
  // The ring-level inputs head-major, made on first use: only a segment map (gdn_transition) reads them; the
  // outputs' kernels read the heads of `inputs` in place (attn::gdn_forward_window).
  std::optional<HeadInputs> hm;
  const HeadInputs& in() {
    if (!hm) hm = head_inputs(inputs, s.group(), stream);
    return *hm;
  }
  attn::GdnForwardArgs args(const GdnCpConfig& cfg, const TensorView& start) const {
    return forward_args(inputs.q, inputs.k, inputs.v, inputs.g, inputs.beta, cfg, start);
  }
  AheadQueue* ahead = nullptr;  // work ahead for the windows that wait for a state (set by the chain or scan)
};

GdnCpOutput GdnCp::forward(const TensorView& q, const TensorView& k, const TensorView& v,
                                        const TensorView& g, const TensorView& beta, const TensorView& initial_state) {
  {
    Fingerprint fp = fingerprint("GDN CP forward");
    fp.add_text("mode", gdn_cp_mode_name(config_.mode))
        .add_int("chunk_size", config_.chunk_size)
        .add_flag("use_qk_l2norm", config_.use_qk_l2norm)
        .add_real("scale", config_.scale)
        .add_tensors({{"q", q}, {"k", k}, {"v", v}, {"g", g}, {"beta", beta}, {"initial_state", initial_state}});
    agree(forward_agreement_, fp);
  }
  const DeviceAlloc alloc{common_device({q, k, v, g, beta, initial_state}, "GDN CP forward"), groups_.stream};
  auto cp_ = validate_forward(q, k, v, g, beta, initial_state);
  phases_ = {};
  cpu_phases_ = {};
  std::optional<PhaseClock> total_clock(std::in_place, phases_.total, cpu_phases_.total);
  std::optional<PhaseClock> copies_clock(std::in_place, phases_.copies, cpu_phases_.copies);
  Saved& s = *cp_;
  const std::int64_t B = s.batch, sl = q.dim(1), H = v.dim(2), V = s.dv;
  const UlyssesHeads heads = gdn_ulysses_heads(H, s.key_heads, groups_.ulysses_size());
  const CommStreamScope stream_scope(groups_);
  const UlyssesExchange a2a(groups_, counters_);
  const Stream stream = groups_.stream;
  Communicator& ring = groups_.ring;

  // Ulysses: [B, S_local, H, *] -> [B, S_ring, H/Pu, *] for the value heads; q and k follow their value heads (split
  // when Pu divides Hk, else each key head replicated to the Pu / Hk ranks whose value heads read it).
  const std::int64_t sr = ring_shard_rows_;
  // At ulysses_size 1 the heads layout is the caller's: without save_inputs the kernels read the caller's tensors and
  // nothing is copied; on the host the saved copies are made in idle time and before the sends are waited for
  // (DeferredCopies).
  DeferredCopies copies(phases_.copies, cpu_phases_.copies);
  s.given = {q, k, v, g, beta};
  if (!config_.save_inputs && groups_.ulysses_size() == 1) {
    s.read = s.given;
  } else if (defer_copies_ && groups_.ulysses_size() == 1 && alloc.device.is_cpu()) {
    s.q = alloc.empty(q.shape(), q.dtype(), MemCategory::kSavedActivation);
    s.k = alloc.empty(k.shape(), k.dtype(), MemCategory::kSavedActivation);
    s.v = alloc.empty(v.shape(), v.dtype(), MemCategory::kSavedActivation);
    s.g = alloc.empty(g.shape(), g.dtype(), MemCategory::kSavedActivation);
    s.beta = alloc.empty(beta.shape(), beta.dtype(), MemCategory::kSavedActivation);
    s.read = s.given;
    copies.add(q, s.q.view());
    copies.add(k, s.k.view());
    copies.add(v, s.v.view());
    copies.add(g, s.g.view());
    copies.add(beta, s.beta.view());
  } else {
    s.q = a2a.kv_to_heads(q, heads, MemCategory::kSavedActivation);
    s.k = a2a.kv_to_heads(k, heads, MemCategory::kSavedActivation);
    s.v = a2a.to_heads(v, MemCategory::kSavedActivation);
    s.g = a2a.to_heads(g, MemCategory::kSavedActivation);
    s.beta = a2a.to_heads(beta, MemCategory::kSavedActivation);
    s.read = {s.q.view(), s.k.view(), s.v.view(), s.g.view(), s.beta.view()};
  }
  const GdnCpInputs inputs = s.read;
  // This rank's heads of the initial states.
  if (!initial_state.empty()) s.init = a2a.my_heads_dim1(initial_state);

  // Padding rows belong to no segment: their outputs stay 0. Every other row is written by the kernels, so without
  // padding the outputs need no zero fill.
  std::int64_t segment_rows = 0;
  for (const int i : mine_) segment_rows += segments_[i].length;
  Tensor out_h = segment_rows == sr ? alloc.empty({B, sr, s.heads, V}, q.dtype(), MemCategory::kWorkspace)
                                    : alloc.zeros({B, sr, s.heads, V}, q.dtype(), MemCategory::kWorkspace);
  // The end state of every document that ends in one of this rank's pieces (summed over the ring afterwards).
  Tensor finals = alloc.zeros(s.states_shape(), s.state_dtype, MemCategory::kWorkspace);
  s.start = tensor_grid(mine_.size(), s.heads);
  s.map_m = tensor_grid(mine_.size(), s.heads);
  for (auto& per_head : s.start) {
    for (Tensor& t : per_head) t = alloc.zeros(s.state_shape(), s.state_dtype, MemCategory::kSavedActivation);
  }
  ForwardPass f{s, alloc, stream, q.dtype(), out_h, finals, inputs, copies, {}};
  copies_clock.reset();
  {
    const CommMeter meter(groups_, counters_);
    const double exposed0 = counters_.exposed_comm_s;
    if (config_.mode == GdnCpMode::kChain) {
      forward_chain(f);
    } else {
      forward_scan(f);
    }
    copies.finish();  // none left after the chain or the scan
    phases_.wait = counters_.exposed_comm_s - exposed0;
  }
  // The backward reads the saved tensors, or (without save_inputs at ulysses_size 1) those handed back to it.
  s.read = s.q.defined() ? GdnCpInputs{s.q.view(), s.k.view(), s.v.view(), s.g.view(), s.beta.view()} : GdnCpInputs{};

  // final_state: every document's end state summed over the ring, then the heads gathered over Ulysses.
  GdnCpOutput result;
  finish_doc_states(ring, finals, cu_seqlens_, s.init, s.packed, alloc, &counters_.exposed_comm_s);
  result.final_state = a2a.gather_heads_dim1(finals.view());
  copies_clock.emplace(phases_.copies, cpu_phases_.copies);
  if (groups_.ulysses_size() == 1) {  // the heads layout is the sequence layout: no copy
    result.out = std::move(out_h);
  } else {
    result.out = alloc.empty({B, sl, H, V}, q.dtype(), MemCategory::kWorkspace);
    a2a.to_sequence(out_h.view(), result.out.view());
  }
  copies_clock.reset();
  total_clock.reset();
  log_phases("forward");
  result.ctx = CpContext::make(id_, "GDN CP", std::move(cp_));
  return result;
}

// Every check of forward's inputs, the GDN kernels' own on the local shapes included (before anything is sent);
// returns the saved state with its sizes set.
std::shared_ptr<GdnCp::Saved> GdnCp::validate_forward(
    const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& g, const TensorView& beta,
    const TensorView& initial_state) const {
  SEQPAR_CHECK(q.ndim() == 4 && k.shape() == q.shape() && v.ndim() == 4 && g.ndim() == 3 && beta.ndim() == 3,
               "GDN CP: q ", q.str(), ", k ", k.str(), ", v ", v.str(), ", g ", g.str(), ", beta ", beta.str(),
               " must be [B, S_local, Hk, K], [B, S_local, Hk, K], [B, S_local, Hv, V], [B, S_local, Hv] x 2");
  const std::int64_t B = q.dim(0), sl = q.dim(1), Hk = q.dim(2), H = v.dim(2), K = q.dim(3), V = v.dim(3);
  SEQPAR_CHECK(sl == layout_.local_len(), "GDN CP: local sequence length ", sl, " must be the layout's local_len ",
               layout_.local_len(), " (seq_len ", layout_.seq_len(), " over ring_size ", layout_.ring_size(),
               " x ulysses_size ", layout_.ulysses_size(), ")");
  check_shape(v, {B, sl, H, V}, "GDN CP v");
  check_shape(g, {B, sl, H}, "GDN CP g");
  check_shape(beta, {B, sl, H}, "GDN CP beta");
  SEQPAR_CHECK(B >= 1, "GDN CP: batch B = ", B, " (q ", q.str(), ") must be >= 1");
  const int pu = groups_.ulysses_size();
  (void)gdn_ulysses_heads(H, Hk, pu);  // errors when the heads do not split over Ulysses
  auto saved = std::make_shared<Saved>();
  Saved& s = *saved;
  s.batch = B;
  s.heads = H / pu;
  s.key_heads = Hk;
  s.dk = K;
  s.dv = V;
  s.packed = layout_.is_packed();
  s.num_docs = static_cast<std::int64_t>(cu_seqlens_.size()) - 1;
  s.state_dtype = accumulator_dtype(q.dtype());
  SEQPAR_CHECK(!s.packed || B == 1, "GDN CP: a packed layout (", s.num_docs,
               " documents in one row) needs batch size 1, got B = ", B);
  if (!initial_state.empty()) {
    check_shape(initial_state, {s.packed ? s.num_docs : B, H, K, V}, "GDN CP initial_state");
    check_dtype(initial_state, s.state_dtype, "GDN CP initial_state");
  }
  // The GDN kernels' own checks on the local shapes (devices included) before anything is sent.
  forward_args(q, k, v, g, beta, config_, s.packed ? TensorView() : initial_state).validate();
  return saved;
}

// Runs, for value head h, the pieces of segment j that start a document (when `known`: from the document's initial
// state) and the piece that continues the previous segment's document (when `continuing`: from s.start[j][h]);
// writes their out rows and the end state of every document that ends here into f.finals. Returns the end state of
// the last piece run.
Tensor GdnCp::run_pieces(ForwardPass& f, std::size_t j, std::int64_t h, bool known, bool continuing) {
  Saved& s = f.s;
  const DeviceAlloc& alloc = f.alloc;
  const Stream stream = f.stream;
  const Segment& seg = segments_[mine_[j]];
  Tensor end;
  for (const SegmentPiece& p : pieces_[mine_[j]]) {
    if (p.starts_doc ? !known : !continuing) continue;
    std::optional<PhaseClock> copies(std::in_place, phases_.copies, cpu_phases_.copies);
    end = alloc.empty(s.state_shape(), s.state_dtype, MemCategory::kCommBuffer);
    Tensor init;
    if (p.starts_doc && s.init.defined())
      init = take_head(s.doc_state(s.init, p.doc), h, MemCategory::kWorkspace, stream);
    copies.reset();
    {
      const ScopedTimer timer(counters_.compute_s);
      const PhaseClock phase(phases_.local, cpu_phases_.local);
      const TensorView start = p.starts_doc ? (init.defined() ? init.view() : TensorView()) : s.start[j][h].view();
      const attn::GdnWindow window{seg.local_offset + p.offset, p.length, h, 1};
      const attn::GdnForwardArgs args = f.args(config_, start);
      const bool waited = !p.starts_doc && f.ahead != nullptr;  // the piece that waited for s.start[j][h]
      attn::gdn_forward_window(args, window, f.out_h.view(), end.view(), waited ? f.ahead->find(j, h) : nullptr,
                               stream);
      if (waited) f.ahead->release(j, h);
    }
    copies.emplace(phases_.copies, cpu_phases_.copies);
    if (p.ends_doc) put_head(end.view(), s.doc_state(f.finals, p.doc), h, stream);
  }
  return end;
}

// The window of segment slot j, value head h that waits for a state: the first piece (forward: it continues the
// previous segment's document) or the last (backward: its document goes on in the next segment).
attn::GdnWindow GdnCp::waiting_window(std::size_t j, std::int64_t h, bool backward) const {
  const int i = mine_[j];
  const SegmentPiece& p = backward ? pieces_[i].back() : pieces_[i].front();
  return {segments_[i].local_offset + p.offset, p.length, h, 1};
}

GdnCp::AheadQueue GdnCp::forward_ahead_queue(ForwardPass& f) {
  return AheadQueue(
      work_ahead_, false, [this, &f](std::size_t, std::int64_t) { return f.args(config_, {}); }, phases_, cpu_phases_,
      counters_.compute_s);
}

// The scan's windows that wait for a message, in the order run_scan runs them: the direct segments (round 1), then
// those that receive their state (dS_end) in the shift; head-major, like the rounds.
void GdnCp::add_scan_waits(const ScanPlan& p, int dir, std::int64_t heads, AheadQueue& q, bool backward) const {
  const int n = static_cast<int>(segments_.size());
  const int me = groups_.ring.rank();
  auto waits = [&](int i, bool direct_stage) {
    const int from = i - dir;
    if (from < 0 || from >= n || segments_[from].owner == me) return false;
    if (backward ? !continued(i) : !continues(i)) return false;
    return direct_stage ? static_cast<bool>(p.direct[i]) : p.need[p.rounds][from] && !p.direct[i];
  };
  for (const bool direct_stage : {true, false}) {
    for (std::int64_t h = 0; h < heads; ++h) {
      for (std::size_t j = 0; j < mine_.size(); ++j) {
        if (waits(mine_[j], direct_stage)) q.add(j, h, waiting_window(j, h, backward));
      }
    }
  }
}

// The chain: each segment waits for the end state of the segment before it, runs, and sends its own on, one value
// head at a time, so that the next segment's owner starts on head h while this one runs head h + 1.
void GdnCp::forward_chain(ForwardPass& f) {
  Saved& s = f.s;
  const DeviceAlloc& alloc = f.alloc;
  Communicator& ring = groups_.ring;
  const int n = static_cast<int>(segments_.size());
  const int me = ring.rank();
  const std::int64_t H = s.heads;
  auto wait_timed = [&](WorkHandle w) { timed_wait(w, &counters_.exposed_comm_s); };
  std::vector<WorkHandle> sends;
  std::vector<std::vector<Tensor>> ends = tensor_grid(mine_.size(), H);
  // Work ahead, while a receive is pending, for the pieces that wait for a state from another rank.
  AheadQueue ahead = forward_ahead_queue(f);
  for (std::size_t j = 0; j < mine_.size(); ++j) {
    const int i = mine_[j];
    if (!continues(i) || segments_[i - 1].owner == me) continue;
    for (std::int64_t h = 0; h < H; ++h) ahead.add(j, h, waiting_window(j, h, false));
  }
  if (ahead_last_first_) ahead.last_first();
  f.ahead = &ahead;
  const std::function<bool()> idle = copies_then(f.copies, ahead.idle());
  for (std::size_t j = 0; j < mine_.size(); ++j) {
    const int i = mine_[j];
    for (std::int64_t h = 0; h < H; ++h) {
      if (continues(i)) {  // i > 0: token 0 starts a document
        if (segments_[i - 1].owner == me) {
          alloc.copy_convert(ends[j - 1][h].view(), s.start[j][h].view());
        } else {
          WorkHandle w = ring.irecv(s.start[j][h].view(), segments_[i - 1].owner, tag_of(kTagChainFwd, i * H + h));
          if (idle) {
            while (!w->test() && idle()) {
            }
          }
          wait_timed(std::move(w));
        }
      }
      ends[j][h] = run_pieces(f, j, h, true, true);
      if (i + 1 < n && continues(i + 1) && segments_[i + 1].owner != me) {
        sends.push_back(ring.isend(ends[j][h].view(), segments_[i + 1].owner, tag_of(kTagChainFwd, (i + 1) * H + h)));
      }
      for (auto& w : sends) (void)w->test();  // progress for messages that need the sender
    }
  }
  // The saved copies left, while the last sends travel (and progress for them between blocks).
  f.copies.finish([&] {
    for (auto& w : sends) (void)w->test();
  });
  finish_chain_sends(sends, counters_, chain_links_);
}

// The scan of docs/design.md, "GDN chain and scan", one value head at a time through each stage (phase 1, the
// rounds, the shift with the final runs), every message posted as soon as its contents are final.
void GdnCp::run_scan(const ScanPlan& p, int dir, const Saved& s, const DeviceAlloc& alloc, const ScanHooks& hooks) {
  Communicator& ring = groups_.ring;
  const int n = static_cast<int>(segments_.size()), me = ring.rank(), R = p.rounds;
  const std::int64_t H = s.heads;
  const std::size_t nm = mine_.size();
  auto in = [&](int i) { return i >= 0 && i < n; };
  auto owner = [&](int i) { return segments_[i].owner; };
  std::vector<std::vector<Tensor>> agg = tensor_grid(nm, H);
  std::vector<std::unique_ptr<PackedRound>> sends;
  auto post = [&](std::unique_ptr<PackedRound> pr, int tag) {
    if (pr->empty()) return;
    pr->post(ring, tag);
    sends.push_back(std::move(pr));
  };
  auto poke = [&] {
    for (auto& pr : sends) pr->poke();
  };
  // Round r's messages of head h (the maps after round r - 1).
  auto post_round = [&](int r, std::int64_t h) {
    if (r > R) return;
    const int o = 1 << (r - 1);
    auto pr = std::make_unique<PackedRound>(alloc);
    for (std::size_t j = 0; j < nm; ++j) {
      const int to = mine_[j] + dir * o;
      if (in(to) && owner(to) != me && p.composes(r, to)) pr->send(agg[j][h].view(), owner(to));
    }
    post(std::move(pr), tag_of(kTagScan, (r - 1) * H + h));
  };
  // The shift's messages: per peer, the states of this rank's segments that go there, sent at the first stage at
  // which all of them are final (a map with M = 0 no longer changes).
  std::map<int, int> shift_stage;
  for (std::size_t j = 0; j < nm; ++j) {
    const int i = mine_[j], to = i + dir;
    if (!p.need[R][i] || owner(to) == me || p.direct[to]) continue;
    shift_stage[owner(to)] = std::max(shift_stage[owner(to)], p.ready[i]);
  }
  auto post_shift = [&](int stage, std::int64_t h) {
    for (const auto& [peer, st] : shift_stage) {
      if (st != stage) continue;
      auto pr = std::make_unique<PackedRound>(alloc);
      for (std::size_t j = 0; j < nm; ++j) {
        const int i = mine_[j], to = i + dir;
        if (p.need[R][i] && owner(to) == peer && !p.direct[to]) pr->send(s.u_of(agg[j][h]), peer);
      }
      post(std::move(pr), tag_of(kTagShift, h));
    }
  };
  // 1. Each segment's map (or, when its start is known, its run).
  for (std::int64_t h = 0; h < H; ++h) {
    for (std::size_t j = 0; j < nm; ++j) agg[j][h] = hooks.phase1(j, h);
    post_round(1, h);
    post_shift(0, h);
    poke();
  }
  // 2. Kogge-Stone rounds: agg_i <- agg_i o agg_{i - dir o}, only where the result is used; a direct segment runs
  // from the state it receives in round 1.
  for (int r = 1, o = 1; r <= R; ++r, o *= 2) {
    for (std::int64_t h = 0; h < H; ++h) {
      PackedRound recv(alloc);
      std::vector<Tensor> got(nm);  // received (or this rank's own, copied) maps of round r - 1
      for (std::size_t j = 0; j < nm; ++j) {
        const int i = mine_[j], from = i - dir * o;
        if (!in(from) || !p.composes(r, i)) continue;
        if (owner(from) == me) {
          got[j] = alloc.copy_of(agg[slot_.at(from)][h].view(), s.state_dtype, MemCategory::kCommBuffer);
        } else {
          got[j] = alloc.empty({s.packed_numel()}, s.state_dtype, MemCategory::kCommBuffer);
          recv.recv(got[j].view(), owner(from));
        }
      }
      recv.run(ring, tag_of(kTagScan, (r - 1) * H + h), &counters_.exposed_comm_s, hooks.idle);
      for (std::size_t j = 0; j < nm; ++j) {
        if (!got[j].defined()) continue;
        if (r == 1 && p.direct[mine_[j]]) {
          agg[j][h] = hooks.direct(j, h, s.u_of(got[j]));
          continue;
        }
        const ScopedTimer timer(counters_.compute_s);
        const PhaseClock phase(phases_.combine, cpu_phases_.combine);
        Tensor next = alloc.empty({s.packed_numel()}, s.state_dtype, MemCategory::kCommBuffer);
        attn::gdn_transition_compose(s.m_of(agg[j][h]), s.u_of(agg[j][h]), s.m_of(got[j]), s.u_of(got[j]), s.m_of(next),
                                     s.u_of(next), alloc.stream);
        agg[j][h] = std::move(next);
      }
      post_round(r + 1, h);
      post_shift(r, h);
      poke();
    }
  }
  counters_.message_rounds += R;
  // 3. The shift gives every segment the state at its start (forward) or end (backward), and it runs.
  for (std::int64_t h = 0; h < H; ++h) {
    PackedRound recv(alloc);
    std::vector<Tensor> state(nm);
    for (std::size_t j = 0; j < nm; ++j) {
      const int i = mine_[j], from = i - dir;
      if (!in(from) || !p.need[R][from] || p.direct[i]) continue;
      if (owner(from) == me) {
        state[j] = alloc.copy_of(s.u_of(agg[slot_.at(from)][h]), s.state_dtype, MemCategory::kCommBuffer);
      } else {
        state[j] = alloc.empty(s.state_shape(), s.state_dtype, MemCategory::kCommBuffer);
        recv.recv(state[j].view(), owner(from));
      }
    }
    recv.run(ring, tag_of(kTagShift, h), &counters_.exposed_comm_s, hooks.idle);
    for (std::size_t j = 0; j < nm; ++j) {
      if (!p.direct[mine_[j]]) hooks.finish(j, h, state[j].defined() ? state[j].view() : TensorView());
      poke();
    }
  }
  if (n > 1) ++counters_.message_rounds;
  if (hooks.before_send_wait) hooks.before_send_wait(poke);
  for (auto& pr : sends) pr->wait(&counters_.exposed_comm_s);
}

// The scan forward: the maps of the segments that carry their incoming state (gdn_transition), the known segments
// run in phase 1, the direct ones in round 1, the others after the shift.
void GdnCp::forward_scan(ForwardPass& f) {
  Saved& s = f.s;
  const DeviceAlloc& alloc = f.alloc;
  const Stream stream = f.stream;
  const ScanPlan& p = *plan_fwd_;
  ScanHooks hooks;
  hooks.phase1 = [&](std::size_t j, std::int64_t h) -> Tensor {
    const int i = mine_[j];
    if (p.known[0][i]) {  // its pieces start from known states (M = 0): U is the end state of its last piece
      Tensor agg = zero_map(s, alloc);
      const Tensor end = run_pieces(f, j, h, true, false);
      alloc.copy_convert(end.view(), s.u_of(agg));
      return agg;
    }
    if (!p.need[0][i] || p.direct[i]) return {};
    Tensor agg = zero_map(s, alloc);
    const Segment& seg = segments_[i];
    const SegmentInputs in = segment_inputs(f.in(), h, seg.local_offset, seg.length, stream);
    {
      const ScopedTimer timer(counters_.compute_s);
      const PhaseClock phase(phases_.maps, cpu_phases_.maps);
      attn::gdn_transition(forward_args(in, config_, {}), s.m_of(agg), s.u_of(agg), stream);
    }
    s.map_m[j][h] = alloc.copy_of(s.m_of(agg), s.state_dtype, MemCategory::kSavedActivation);
    return agg;
  };
  hooks.direct = [&](std::size_t j, std::int64_t h, const TensorView& start) -> Tensor {
    alloc.copy_convert(start, s.start[j][h].view());
    Tensor agg = zero_map(s, alloc);
    const Tensor end = run_pieces(f, j, h, false, true);
    alloc.copy_convert(end.view(), s.u_of(agg));
    return agg;
  };
  hooks.finish = [&](std::size_t j, std::int64_t h, const TensorView& start) {
    if (start.empty()) return;
    alloc.copy_convert(start, s.start[j][h].view());
    run_pieces(f, j, h, false, true);
  };
  AheadQueue ahead = forward_ahead_queue(f);
  add_scan_waits(p, +1, s.heads, ahead, false);
  if (ahead_last_first_) ahead.last_first();
  f.ahead = &ahead;
  hooks.idle = copies_then(f.copies, ahead.idle());
  hooks.before_send_wait = [&f](const std::function<void()>& progress) { f.copies.finish(progress); };
  run_scan(p, +1, s, alloc, hooks);
}

// One backward call's inputs and gradient buffers, shared by its steps (run_piece, run_pieces_backward,
// backward_chain, backward_scan). The gradients of padding rows stay 0.
struct GdnCp::BackwardPass {
  const Saved& s;
  const DeviceAlloc& alloc;
  Stream stream;
  DType dtype;           // of q: the gradients'
  DType qk_grad_dtype;   // dq, dk before the sum over replicated key heads (the accumulation dtype when replicated)
  DType vqk_dtype;       // dq, dk of one value head: qk_grad_dtype, or the state dtype when value heads are grouped
  TensorView dout_h;     // [B, S_ring, Hl, V]
  Tensor& dfinal_local;  // this rank's heads of dfinal_state (undefined: zeros)
  // Gradients: dq, dk per value head ([B, S_ring, Hl, K], summed per key head at the end), dv, dg, dbeta; the
  // kernels write their heads in place (attn::gdn_backward_window).
  Tensor& dq_v;
  Tensor& dk_v;
  Tensor& dv_h;
  Tensor& dg_h;
  Tensor& db_h;
  Tensor& dinits;  // d(initial_state) of every document that starts in one of this rank's pieces
  // The ring-level inputs and dout head-major, made on first use: only a segment map reads them.
  std::optional<HeadInputs> hm;
  Tensor dout_hm;
  const HeadInputs& in() {
    if (!hm) hm = head_inputs(s.read, s.group(), stream);
    return *hm;
  }
  const Tensor& dout_head_major() {
    if (!dout_hm.defined()) dout_hm = head_major(dout_h, MemCategory::kWorkspace, stream);
    return dout_hm;
  }
  AheadQueue* ahead = nullptr;  // work ahead for the pieces that wait for dS_end (set by the chain or scan)
  KeyHeadSums* sums = nullptr;  // the key-head sums of dq, dk made as value heads finish (lean backward, G > 1)
  // Idle work while a message is pending: the key-head sums that are ready, then the work ahead (either may be off).
  std::function<bool()> idle() const {
    std::function<bool()> then = ahead != nullptr ? ahead->idle() : std::function<bool()>();
    if (sums == nullptr) return then;
    return [s = sums, then = std::move(then)] { return s->step() || (then && then()); };
  }
};

namespace {

// Empty when `in` is what backward needs (nothing with save_inputs, else tensors like the forward's `given`: their
// values cannot be checked); else what is wrong, naming the tensor and the rule.
std::string inputs_handed_back(bool save_inputs, const GdnCpInputs& given, const GdnCpInputs& in) {
  const std::pair<const char*, std::pair<const TensorView*, const TensorView*>> named[] = {
      {"q", {&given.q, &in.q}},
      {"k", {&given.k, &in.k}},
      {"v", {&given.v, &in.v}},
      {"g", {&given.g, &in.g}},
      {"beta", {&given.beta, &in.beta}}};
  for (const auto& [name, pair] : named) {
    const TensorView &fwd = *pair.first, &back = *pair.second;
    if (save_inputs) {
      if (back.data() != nullptr)
        return str_cat("inputs.", name, " ", back.str(), " given, but GdnCpConfig::save_inputs is true (the context ",
                       "holds its own copies): pass no inputs");
      continue;
    }
    if (back.data() == nullptr)
      return str_cat("inputs.", name, " missing: with GdnCpConfig::save_inputs false, backward takes the forward's ",
                     "q, k, v, g, beta back");
    if (back.shape() != fwd.shape() || back.dtype() != fwd.dtype() || back.device() != fwd.device())
      return str_cat(
          "inputs.", name, " ", back.str(), " does not match the forward's ", name, " ", fwd.str(),
          ": with GdnCpConfig::save_inputs false, pass the forward's tensors (or their exact recomputation)");
  }
  return {};
}

}  // namespace

// The backward arguments of piece p of segment j for one value head (its inputs and dout rows, owned by the returned
// struct; moving Tensors keeps their buffers, so the views in `args` stay valid).
struct GdnCp::PieceBackward {
  SegmentInputs in;
  Tensor dout, init;
  attn::GdnBackwardArgs args;
};

GdnCpGrads GdnCp::backward(CpContext&& ctx, const TensorView& dout, const TensorView& dfinal_state,
                           const GdnCpInputs& inputs) {
  const std::shared_ptr<Saved> saved = ctx.peek<Saved>(id_, "GDN CP");
  const Saved& s = *saved;
  const std::string handed_back = inputs_handed_back(config_.save_inputs, s.given, inputs);
  {
    Fingerprint fp = fingerprint("GDN CP backward");
    fp.add_tensor("forward's q", s.given.q)
        .add_tensor("forward's v", s.given.v)
        .add_tensor("dout", dout)
        .add_tensor("dfinal_state", dfinal_state)
        .add_flag("inputs handed back as GdnCpConfig::save_inputs requires", handed_back.empty());
    agree(backward_agreement_, fp);
  }
  SEQPAR_CHECK(handed_back.empty(), "GDN CP backward: ", handed_back);
  if (!config_.save_inputs && groups_.ulysses_size() == 1) saved->read = inputs;
  const int pu = groups_.ulysses_size();
  const std::int64_t B = s.batch, H = s.heads * pu, Hk = s.key_heads, K = s.dk, V = s.dv, sl = layout_.local_len(),
                     sr = ring_shard_rows_;
  const UlyssesHeads heads = gdn_ulysses_heads(H, Hk, pu);
  const DeviceAlloc alloc{common_device({s.read.q, dout, dfinal_state}, "GDN CP backward (saved tensors, dout)"),
                          groups_.stream};
  check_grad_input(dout, {B, sl, H, V}, "GDN CP dout");
  if (!dfinal_state.empty()) {
    check_shape(dfinal_state, {s.packed ? s.num_docs : B, H, K, V}, "GDN CP dfinal_state");
    check_dtype(dfinal_state, s.state_dtype, "GDN CP dfinal_state");
  }
  ctx.consume<Saved>(id_, "GDN CP");
  phases_ = {};
  cpu_phases_ = {};
  std::optional<PhaseClock> total_clock(std::in_place, phases_.total, cpu_phases_.total);
  std::optional<PhaseClock> copies_clock(std::in_place, phases_.copies, cpu_phases_.copies);
  const CommStreamScope stream_scope(groups_);
  const UlyssesExchange a2a(groups_, counters_);
  const Stream stream = groups_.stream;
  Communicator& ring = groups_.ring;
  const DType dtype = s.read.q.dtype();
  // Lean backward (GdnCpConfig::lean_backward): on the host, dout read in place at ulysses_size 1, no zero fill
  // without padding rows, the key-head sums in idle time.
  const bool lean = lean_backward_ && alloc.device.is_cpu();
  Tensor dout_copy;
  if (!lean || pu > 1) dout_copy = a2a.to_heads(dout);
  const TensorView dout_h = dout_copy.defined() ? dout_copy.view() : dout;
  Tensor dfinal_local;
  if (!dfinal_state.empty()) dfinal_local = a2a.my_heads_dim1(dfinal_state);

  // dq, dk of this rank's key heads; replicated key heads (Hk < Pu) are summed over their replicas afterwards, in
  // the accumulation dtype (fp32, fp64 for fp64). Padding rows belong to no segment: their gradients stay 0.
  const DType qk_grad_dtype =
      heads.replication == 1 ? dtype : (dtype == DType::kFloat64 ? DType::kFloat64 : DType::kFloat32);
  // Gradients, one value head at a time; with grouped value heads (G > 1) each value head's dq, dk contribution stays
  // in the state dtype and the G of a key head are summed in value-head order below, as the kernel's own grouped sum
  // does (docs/design.md, "Grouped value heads").
  const std::int64_t G = s.group(), Hl = s.heads, Hkl = s.read.q.dim(2);
  const DType vqk_dtype = G > 1 ? s.state_dtype : qk_grad_dtype;
  // Padding rows belong to no segment: their gradients stay 0. Every other row is written by the kernels (every value
  // head of every piece runs), so without padding the lean backward zero-fills nothing.
  std::int64_t segment_rows = 0;
  for (const int i : mine_) segment_rows += segments_[i].length;
  auto grad_buffer = [&](const Shape& shape, DType t) {
    return lean && segment_rows == sr ? alloc.empty(shape, t, MemCategory::kWorkspace)
                                      : alloc.zeros(shape, t, MemCategory::kWorkspace);
  };
  Tensor dq_v = grad_buffer({B, sr, Hl, K}, vqk_dtype);
  Tensor dk_v = grad_buffer({B, sr, Hl, K}, vqk_dtype);
  Tensor dv_h = grad_buffer({B, sr, Hl, V}, dtype);
  Tensor dg_h = grad_buffer({B, sr, Hl}, dtype);
  Tensor db_h = grad_buffer({B, sr, Hl}, dtype);
  // Grouped value heads, lean: each key head's sum of dq, dk made once its value heads have run on every row (in
  // idle time first), element by element as key_heads_of below does; only where no dtype conversion follows.
  Tensor dq_k, dk_k;
  std::optional<KeyHeadSums> sums;
  if (lean && G > 1 && qk_grad_dtype == vqk_dtype) {
    dq_k = alloc.empty(s.read.q.shape(), qk_grad_dtype, MemCategory::kWorkspace);
    dk_k = alloc.empty(s.read.q.shape(), qk_grad_dtype, MemCategory::kWorkspace);
    sums.emplace(dq_v.view(), dk_v.view(), dq_k.view(), dk_k.view(), G, segment_rows, phases_.copies,
                 cpu_phases_.copies);
  }
  // d(initial_state) of every document that starts in one of this rank's pieces (summed over the ring afterwards).
  Tensor dinits = alloc.zeros(s.states_shape(), s.state_dtype, MemCategory::kWorkspace);
  BackwardPass bp{s,    alloc, stream, dtype, qk_grad_dtype, vqk_dtype, dout_h, dfinal_local,
                  dq_v, dk_v,  dv_h,   dg_h,  db_h,          dinits,    {},     {}};
  bp.sums = sums ? &*sums : nullptr;
  copies_clock.reset();
  {
    const CommMeter meter(groups_, counters_);
    const double exposed0 = counters_.exposed_comm_s;
    if (config_.mode == GdnCpMode::kChain) {
      backward_chain(bp);
    } else {
      backward_scan(bp);
    }
    phases_.wait = counters_.exposed_comm_s - exposed0;
  }
  copies_clock.emplace(phases_.copies, cpu_phases_.copies);
  // [B, S_ring, Hl, K] per value head -> [B, S_ring, Hkl, K]: the G value heads of each key head (adjacent in a row)
  // summed in value-head order, in the state dtype.
  auto key_heads_of = [&](const Tensor& v) {
    const std::int64_t rows = B * sr * Hkl;
    Tensor by_head = alloc.empty({G, rows, K}, v.dtype(), MemCategory::kWorkspace);
    swap_outer_dims(v.view(), rows, G, by_head.view(), stream);
    Tensor acc = alloc.copy_of(by_head.view().slice0(0, 1), s.state_dtype, MemCategory::kWorkspace);
    for (std::int64_t e = 1; e < G; ++e) add_inplace(acc.view(), by_head.view().slice0(e, e + 1), stream);
    Tensor km = alloc.empty(s.read.q.shape(), qk_grad_dtype, MemCategory::kWorkspace);
    alloc.copy_convert(acc.view(), km.view().reshape({1, rows, K}));
    return km;
  };
  if (sums) {
    sums->finish();
    dq_v = std::move(dq_k);
    dk_v = std::move(dk_k);
  } else if (G > 1) {
    dq_v = key_heads_of(dq_v);
    dk_v = key_heads_of(dk_v);
  }

  GdnCpGrads grads;
  // Without Ulysses the heads layout is the sequence layout (and dq, dk are in the gradients' dtype): no copy.
  auto gather = [&](Tensor& t, const Shape& shape) {
    if (pu == 1) return std::move(t);
    Tensor out = alloc.empty(shape, dtype, MemCategory::kWorkspace);
    a2a.to_sequence(t.view(), out.view());
    return out;
  };
  if (pu == 1) {
    grads.dq = std::move(dq_v);
    grads.dk = std::move(dk_v);
  } else {
    grads.dq = alloc.empty({B, sl, Hk, K}, dtype, MemCategory::kWorkspace);
    grads.dk = alloc.empty({B, sl, Hk, K}, dtype, MemCategory::kWorkspace);
    a2a.kv_grad_to_sequence(dq_v.view(), heads, grads.dq.view());
    a2a.kv_grad_to_sequence(dk_v.view(), heads, grads.dk.view());
  }
  grads.dv = gather(dv_h, {B, sl, H, V});
  grads.dg = gather(dg_h, {B, sl, H});
  grads.dbeta = gather(db_h, {B, sl, H});
  copies_clock.reset();
  finish_doc_states(ring, dinits, cu_seqlens_, dfinal_local, s.packed, alloc, &counters_.exposed_comm_s);
  grads.dinitial_state = a2a.gather_heads_dim1(dinits.view());
  total_clock.reset();
  log_phases("backward");
  return grads;
}

void GdnCp::log_phases(const char* what) const {
  const PhaseSeconds &w = phases_, &c = cpu_phases_;
  SEQPAR_LOG(kDebug) << "GDN " << what << " (" << gdn_cp_mode_name(config_.mode) << ", ring " << groups_.ring.rank()
                     << "/" << groups_.ring.size() << ", " << segments_.size() << " segments): message rounds so far "
                     << counters_.message_rounds << "; seconds (wall / process CPU): maps " << w.maps << " / " << c.maps
                     << ", local " << w.local << " / " << c.local << ", combine " << w.combine << " / " << c.combine
                     << ", copies " << w.copies << " / " << c.copies << ", wait " << w.wait << ", total " << w.total
                     << " / " << c.total;
}

// The backward arguments of piece p of segment j (its inputs and dout rows, owned by the returned struct; moving
// Tensors keeps their buffers, so the views in `args` stay valid).
GdnCp::PieceBackward GdnCp::piece_backward(BackwardPass& bp, std::size_t j, const SegmentPiece& p, std::int64_t h) {
  const Saved& s = bp.s;
  const Stream stream = bp.stream;
  const std::int64_t offset = segments_[mine_[j]].local_offset + p.offset;
  PieceBackward b{segment_inputs(bp.in(), h, offset, p.length, stream),
                  take_rows(head_view(bp.dout_head_major(), h), offset, p.length, MemCategory::kWorkspace, stream),
                  {},
                  {}};
  if (p.starts_doc && s.init.defined())
    b.init = take_head(s.doc_state(s.init, p.doc), h, MemCategory::kWorkspace, stream);
  const TensorView start = p.starts_doc ? (b.init.defined() ? b.init.view() : TensorView()) : s.start[j][h].view();
  b.args.fwd = forward_args(b.in, config_, start);
  b.args.dout = b.dout.view();
  return b;
}

// Full backward of piece p of segment j, value head h, with the given dS_end; writes the gradients' rows and returns
// dS_start.
Tensor GdnCp::run_piece(BackwardPass& bp, std::size_t j, const SegmentPiece& p, std::int64_t h,
                        const TensorView& ds_end) {
  const Saved& s = bp.s;
  const DeviceAlloc& alloc = bp.alloc;
  const Stream stream = bp.stream;
  const std::int64_t offset = segments_[mine_[j]].local_offset + p.offset;
  std::optional<PhaseClock> copies(std::in_place, phases_.copies, cpu_phases_.copies);
  Tensor init;
  if (p.starts_doc && s.init.defined())
    init = take_head(s.doc_state(s.init, p.doc), h, MemCategory::kWorkspace, stream);
  Tensor ds_start = alloc.empty(s.state_shape(), s.state_dtype, MemCategory::kCommBuffer);
  copies.reset();
  const ScopedTimer timer(counters_.compute_s);
  const PhaseClock phase(phases_.local, cpu_phases_.local);
  attn::GdnBackwardArgs args;
  const TensorView start = p.starts_doc ? (init.defined() ? init.view() : TensorView()) : s.start[j][h].view();
  args.fwd = forward_args(s.read.q, s.read.k, s.read.v, s.read.g, s.read.beta, config_, start);
  args.dout = bp.dout_h;
  args.dfinal_state = ds_end;
  const attn::GdnWindow window{offset, p.length, h, 1};
  const bool waited = !p.ends_doc && bp.ahead != nullptr;  // the piece that waited for dS_end
  attn::gdn_backward_window(args, window, bp.dq_v.view(), bp.dk_v.view(), bp.dv_h.view(), bp.dg_h.view(),
                            bp.db_h.view(), ds_start.view(), waited ? bp.ahead->find(j, h) : nullptr, stream);
  if (waited) bp.ahead->release(j, h);
  if (bp.sums != nullptr) bp.sums->ran(h, p.length);
  return ds_start;
}

// Runs, last first, value head h of the pieces of segment j that end their document (when `known`: dS_end = that
// document's dfinal_state) and of the piece whose document goes on in the next segment (when `waiting`: dS_end =
// ds_end_in); records dinitial_state of every document that starts here into bp.dinits. Returns dS_start of the
// piece that continues the previous segment's document when it ran (the segment's dS_start), else an undefined
// tensor.
Tensor GdnCp::run_pieces_backward(BackwardPass& bp, std::size_t j, std::int64_t h, bool known, bool waiting,
                                  const TensorView& ds_end_in) {
  const Saved& s = bp.s;
  const Stream stream = bp.stream;
  Tensor seg_ds_start;
  const std::vector<SegmentPiece>& pc = pieces_[mine_[j]];
  for (auto it = pc.rbegin(); it != pc.rend(); ++it) {
    const SegmentPiece& p = *it;
    if (p.ends_doc ? !known : !waiting) continue;
    Tensor dfinal;
    if (p.ends_doc && bp.dfinal_local.defined()) {
      dfinal = take_head(s.doc_state(bp.dfinal_local, p.doc), h, MemCategory::kWorkspace, stream);
    }
    Tensor ds = run_piece(bp, j, p, h, p.ends_doc ? (dfinal.defined() ? dfinal.view() : TensorView()) : ds_end_in);
    if (p.starts_doc) {
      put_head(ds.view(), s.doc_state(bp.dinits, p.doc), h, stream);
    } else {
      seg_ds_start = std::move(ds);
    }
  }
  return seg_ds_start;
}

GdnCp::AheadQueue GdnCp::backward_ahead_queue(BackwardPass& bp) {
  const Saved& s = bp.s;
  // The start state of the waiting piece: s.start when it continues a document, else its document's initial state
  // (head h copied out once, as run_piece does; zeros when there is none).
  auto inits = std::make_shared<std::map<std::pair<std::size_t, std::int64_t>, Tensor>>();
  return AheadQueue(
      work_ahead_, true,
      [this, &s, inits, stream = bp.stream](std::size_t j, std::int64_t h) {
        const SegmentPiece& p = pieces_[mine_[j]].back();
        TensorView start = s.start[j][h].view();
        if (p.starts_doc) {
          start = {};
          if (s.init.defined()) {
            Tensor& init = (*inits)[{j, h}];
            if (!init.defined()) init = take_head(s.doc_state(s.init, p.doc), h, MemCategory::kWorkspace, stream);
            start = init.view();
          }
        }
        return forward_args(s.read.q, s.read.k, s.read.v, s.read.g, s.read.beta, config_, start);
      },
      phases_, cpu_phases_, counters_.compute_s);
}

// The chain, last segment first: each waits for dS_end from the segment after it, runs, and sends dS_start back,
// one value head at a time (the pipeline of forward_chain).
void GdnCp::backward_chain(BackwardPass& bp) {
  const Saved& s = bp.s;
  const DeviceAlloc& alloc = bp.alloc;
  Communicator& ring = groups_.ring;
  const int me = ring.rank();
  const std::int64_t H = s.heads;
  auto wait_timed = [&](WorkHandle w) { timed_wait(w, &counters_.exposed_comm_s); };
  std::vector<WorkHandle> sends;
  // alive until their sends complete
  std::vector<std::vector<Tensor>> ds_starts = tensor_grid(mine_.size(), H);
  // Work ahead, while a receive is pending, for the pieces that wait for dS_end from another rank.
  AheadQueue ahead = backward_ahead_queue(bp);
  for (std::size_t jj = mine_.size(); jj-- > 0;) {
    const int i = mine_[jj];
    if (!continued(i) || segments_[i + 1].owner == me) continue;
    for (std::int64_t h = 0; h < H; ++h) ahead.add(jj, h, waiting_window(jj, h, true));
  }
  bp.ahead = &ahead;
  const std::function<bool()> idle = bp.idle();
  for (std::size_t jj = mine_.size(); jj-- > 0;) {
    const int i = mine_[jj];
    for (std::int64_t h = 0; h < H; ++h) {
      Tensor ds_end = alloc.zeros(s.state_shape(), s.state_dtype, MemCategory::kCommBuffer);
      if (continued(i)) {  // i + 1 < n: the last token of the row ends a document
        if (segments_[i + 1].owner == me) {
          alloc.copy_convert(ds_starts[jj + 1][h].view(), ds_end.view());
        } else {
          WorkHandle w = ring.irecv(ds_end.view(), segments_[i + 1].owner, tag_of(kTagChainBwd, i * H + h));
          if (idle) {
            while (!w->test() && idle()) {
            }
          }
          wait_timed(std::move(w));
        }
      }
      ds_starts[jj][h] = run_pieces_backward(bp, jj, h, true, true, ds_end.view());
      if (continues(i) && segments_[i - 1].owner != me) {
        sends.push_back(
            ring.isend(ds_starts[jj][h].view(), segments_[i - 1].owner, tag_of(kTagChainBwd, (i - 1) * H + h)));
      }
      for (auto& w : sends) (void)w->test();  // progress for messages that need the sender
    }
  }
  finish_chain_sends(sends, counters_, chain_links_);
}

// The reverse scan: the maps (M^T, L) of dS_start in terms of dS_end of the carrying segments (L from the cheap
// reverse sweep), the known segments run in phase 1, the direct ones in round 1, the others after the shift.
void GdnCp::backward_scan(BackwardPass& bp) {
  const Saved& s = bp.s;
  const DeviceAlloc& alloc = bp.alloc;
  const Stream stream = bp.stream;
  const ScanPlan& p = *plan_bwd_;
  ScanHooks hooks;
  hooks.phase1 = [&](std::size_t j, std::int64_t h) -> Tensor {
    const int i = mine_[j];
    if (p.known[0][i]) {  // dS_end comes from its documents' dfinal_state (M = 0); L: dS_start of its continuing piece
      Tensor agg = zero_map(s, alloc);
      const Tensor l = run_pieces_backward(bp, j, h, true, false, {});
      if (l.defined()) alloc.copy_convert(l.view(), s.u_of(agg));
      return agg;
    }
    if (!p.need[0][i] || p.direct[i]) return {};
    Tensor agg = zero_map(s, alloc);
    const PieceBackward b = piece_backward(bp, j, pieces_[i].front(), h);
    const ScopedTimer timer(counters_.compute_s);
    const PhaseClock phase(phases_.maps, cpu_phases_.maps);
    attn::gdn_backward(b.args, {}, {}, {}, {}, {}, s.u_of(agg), stream);
    Tensor m;
    if (!s.map_m[j][h].defined()) {  // the forward did not need this map
      m = alloc.empty(s.map_shape(), s.state_dtype, MemCategory::kWorkspace);
      Tensor u = alloc.empty(s.state_shape(), s.state_dtype, MemCategory::kWorkspace);
      attn::GdnForwardArgs a = b.args.fwd;
      a.initial_state = {};
      attn::gdn_transition(a, m.view(), u.view(), stream);
    }
    attn::gdn_transition_transpose(m.defined() ? m.view() : s.map_m[j][h].view(), s.m_of(agg), stream);
    return agg;
  };
  hooks.direct = [&](std::size_t j, std::int64_t h, const TensorView& ds_end) -> Tensor {
    Tensor agg = zero_map(s, alloc);
    const Tensor ds = run_pieces_backward(bp, j, h, false, true, ds_end);
    alloc.copy_convert(ds.view(), s.u_of(agg));
    return agg;
  };
  hooks.finish = [&](std::size_t j, std::int64_t h, const TensorView& ds_end) {
    if (ds_end.empty()) return;
    run_pieces_backward(bp, j, h, false, true, ds_end);
  };
  AheadQueue ahead = backward_ahead_queue(bp);
  add_scan_waits(p, -1, s.heads, ahead, true);
  bp.ahead = &ahead;
  hooks.idle = bp.idle();
  run_scan(p, -1, s, alloc, hooks);
}

// ---- short conv halo ------------------------------------------------------------------------------------------

struct ShortConvCp::HaloPlan {
  // For each of this rank's segments: the global positions of its halo (W-1 before its start, oldest first;
  // negative ones are zeros) and, for each, the (owner, owner's local row) that holds it.
  struct Need {
    std::int64_t position;
    int owner;
    std::int64_t row;
  };
  // Where one segment's halo slots come from: `slots` of the conv state filled from `rows` of a source (this
  // rank's x when the source is this rank, else the rows of the message from that peer).
  struct Source {
    int peer;
    std::vector<std::int64_t> rows, slots;
  };
  std::int64_t width = 0;
  std::vector<int> mine;                        // indices into segments_
  std::vector<std::vector<Source>> sources;     // per segment of mine
  std::vector<std::vector<std::int64_t>> give;  // per peer: my local rows that peer needs, in its order
  std::vector<std::int64_t> take_count;         // per peer: rows it sends me
};

struct ShortConvCp::Saved {
  Tensor x, weight;
  std::vector<Tensor> halo;  // each segment's conv state [B, W-1, C]
  std::int64_t width = 0;
};

ShortConvCp::ShortConvCp(const CpGroups& groups, const SequenceLayout& layout,
                                                   const ShortConvCpConfig& config)
    : groups_(groups), layout_(layout), config_(config) {
  check_layout_matches(groups, layout, "short conv CP");
  for (int r = 0; r < groups.cp.size(); ++r) tokens_.push_back(shard_tokens(layout, r));
  segments_ = segments_in_global_order(tokens_);
  cu_seqlens_ = document_bounds(layout);
}

namespace {

// The conv arguments of one segment: its rows xs and, when it holds more than one document (a packed row, B = 1),
// their bounds inside the segment with one conv state per piece: the halo for the first (zeros beyond its document's
// start), zeros for the others (each starts a document).
struct SegmentConv {
  Tensor cu, states;
  attn::ShortConvArgs args;
};

SegmentConv segment_conv(const TensorView& xs, const TensorView& weight, const TensorView& halo,
                         const std::vector<SegmentPiece>& pieces, bool use_silu, const DeviceAlloc& alloc) {
  SegmentConv c;
  c.args.x = xs;
  c.args.weight = weight;
  c.args.use_silu = use_silu;
  c.args.initial_conv_state = halo;
  if (pieces.size() == 1) return c;
  const auto np = static_cast<std::int64_t>(pieces.size());
  c.cu = Tensor::empty({np + 1}, DType::kInt64, MemCategory::kWorkspace);
  std::int64_t* cu = c.cu.data_as<std::int64_t>();
  for (std::int64_t i = 0; i < np; ++i) cu[i] = pieces[i].offset;
  cu[np] = pieces.back().offset + pieces.back().length;
  c.args.cu_seqlens = c.cu.view();
  if (!halo.empty()) {
    c.states = alloc.zeros({np, halo.dim(1), halo.dim(2)}, halo.dtype(), MemCategory::kWorkspace);
    alloc.copy_convert(halo, c.states.view().slice0(0, 1));
    c.args.initial_conv_state = c.states.view();
  }
  return c;
}

}  // namespace

const ShortConvCp::HaloPlan& ShortConvCp::plan_for(std::int64_t W) {
  if (plan_ && plan_->width == W) return *plan_;
  // Who needs which rows from whom (every rank derives the same plan from the layout).
  const int me = groups_.cp.rank(), n = groups_.cp.size();
  auto plan = std::make_shared<HaloPlan>();
  plan->width = W;
  std::vector<std::pair<int, std::int64_t>> where(static_cast<std::size_t>(cu_seqlens_.back()));
  for (int r = 0; r < n; ++r) {
    for (std::size_t i = 0; i < tokens_[r].size(); ++i) {
      if (tokens_[r][i] >= 0) where[tokens_[r][i]] = {r, static_cast<std::int64_t>(i)};
    }
  }
  plan->give.assign(n, {});
  plan->take_count.assign(n, 0);
  for (int i = 0; i < static_cast<int>(segments_.size()); ++i) {
    const Segment& seg = segments_[i];
    // The halo stops at the start of the segment's first document: inputs before it are zeros.
    const std::int64_t doc_start = cu_seqlens_[segment_pieces(seg, cu_seqlens_).front().doc];
    std::vector<HaloPlan::Need> need;
    for (std::int64_t w = W - 1; w >= 1; --w) {
      const std::int64_t p = seg.start - w;
      const bool inside = p >= doc_start;
      need.push_back({p, inside ? where[p].first : -1, inside ? where[p].second : -1});
    }
    if (seg.owner == me) {
      plan->mine.push_back(i);
      std::vector<HaloPlan::Source> sources;
      auto source_of = [&](int peer) -> HaloPlan::Source& {
        for (auto& src : sources)
          if (src.peer == peer) return src;
        sources.push_back({peer, {}, {}});
        return sources.back();
      };
      for (std::size_t h = 0; h < need.size(); ++h) {
        const HaloPlan::Need& nd = need[h];
        if (nd.owner < 0) continue;
        HaloPlan::Source& src = source_of(nd.owner);
        src.rows.push_back(nd.owner == me ? nd.row : plan->take_count[nd.owner]++);
        src.slots.push_back(static_cast<std::int64_t>(h));
      }
      plan->sources.push_back(std::move(sources));
    } else {
      for (const auto& nd : need) {
        if (nd.owner == me) plan->give[seg.owner].push_back(nd.row);
      }
    }
  }
  plan_ = plan;
  return *plan_;
}

ShortConvCpOutput ShortConvCp::forward(const TensorView& x, const TensorView& weight) {
  {
    Fingerprint fp("short conv CP forward");
    fp.add_flag("use_silu", config_.use_silu);
    add_layout_fields(fp, layout_);
    fp.add_tensor("x", x).add_tensor("weight", weight);
    forward_agreement_.run(groups_.cp, fp, groups_.stream);
  }
  const DeviceAlloc alloc{common_device({x, weight}, "short conv CP forward"), groups_.stream};
  SEQPAR_CHECK(x.ndim() == 3 && x.dim(1) == layout_.local_len(), "short conv CP: x ", x.str(),
               " must be [B, S_local = ", layout_.local_len(), ", C]");
  SEQPAR_CHECK(weight.ndim() == 2 && weight.dim(0) == x.dim(2) && weight.dim(1) >= 1, "short conv CP: weight ",
               weight.str(), " must be [C = ", x.dim(2), ", W >= 1]");
  {
    // The short conv kernels' own checks on the local shapes (devices included) before any halo is sent.
    attn::ShortConvArgs local;
    local.x = x;
    local.weight = weight;
    local.use_silu = config_.use_silu;
    local.validate();
  }
  const std::int64_t B = x.dim(0), C = x.dim(2), W = weight.dim(1);
  SEQPAR_CHECK(!layout_.is_packed() || B == 1, "short conv CP: a packed layout (", cu_seqlens_.size() - 1,
               " documents in one row) needs batch size 1, got B = ", B);
  const int me = groups_.cp.rank(), n = groups_.cp.size();
  const HaloPlan& plan = plan_for(W);
  const CommStreamScope stream_scope(groups_);
  const Stream stream = groups_.stream;
  // Exchange: to each peer, the rows it needs ([B, rows, C]); from each peer, ours.
  std::vector<Tensor> send(n), recv(n);
  std::vector<P2POp> ops;
  for (int r = 0; r < n; ++r) {
    if (!plan.give[r].empty()) {
      send[r] =
          alloc.empty({B, static_cast<std::int64_t>(plan.give[r].size()), C}, x.dtype(), MemCategory::kCommBuffer);
      gather_rows(x, 1, plan.give[r], send[r].view(), stream);
      ops.push_back(P2POp::send(send[r].view(), r, kTagHalo));
      halo_bytes_sent_ += static_cast<std::int64_t>(send[r].nbytes());
    }
    if (plan.take_count[r] > 0) {
      recv[r] = alloc.empty({B, plan.take_count[r], C}, x.dtype(), MemCategory::kCommBuffer);
      ops.push_back(P2POp::recv(recv[r].view(), r, kTagHalo));
    }
  }
  if (!ops.empty()) groups_.cp.batch_isend_irecv(ops)->wait();

  auto s = std::make_shared<Saved>();
  s->x = alloc.copy_of(x, x.dtype(), MemCategory::kSavedActivation);
  s->weight = alloc.copy_of(weight, weight.dtype(), MemCategory::kSavedActivation);
  s->width = W;
  ShortConvCpOutput o;
  o.out = alloc.zeros(x.shape(), x.dtype(), MemCategory::kWorkspace);  // padding rows stay 0
  // Assemble each segment's conv state (kept for the backward) and run it.
  s->halo.resize(plan.mine.size());
  for (std::size_t j = 0; j < plan.mine.size(); ++j) {
    const Segment& seg = segments_[plan.mine[j]];
    Tensor state = alloc.zeros({B, W - 1, C}, x.dtype(), MemCategory::kSavedActivation);
    for (const HaloPlan::Source& src : plan.sources[j]) {
      Tensor rows = alloc.empty({B, static_cast<std::int64_t>(src.rows.size()), C}, x.dtype(), MemCategory::kWorkspace);
      gather_rows(src.peer == me ? x : recv[src.peer].view(), 1, src.rows, rows.view(), stream);
      scatter_rows(rows.view(), 1, src.slots, state.view(), stream);
    }
    Tensor xs = take_rows(x, seg.local_offset, seg.length, MemCategory::kWorkspace, stream);
    Tensor ys = alloc.empty(xs.shape(), x.dtype(), MemCategory::kWorkspace);
    const SegmentConv sc = segment_conv(xs.view(), weight, W > 1 ? state.view() : TensorView(),
                                        segment_pieces(seg, cu_seqlens_), config_.use_silu, alloc);
    attn::short_conv_forward(sc.args, ys.view(), {}, stream);
    put_rows(ys.view(), o.out.view(), seg.local_offset, stream);
    s->halo[j] = std::move(state);
  }
  o.ctx = CpContext::make(id_, "short conv CP", std::move(s));
  return o;
}

ShortConvCpGrads ShortConvCp::backward(CpContext&& ctx, const TensorView& dout) {
  const std::shared_ptr<Saved> s = ctx.peek<Saved>(id_, "short conv CP");
  ShortConvCpGrads g;
  g.dweight = Tensor::empty(s->weight.shape(), s->weight.dtype(), MemCategory::kWorkspace, s->weight.view().device());
  g.dx = backward(std::move(ctx), dout, g.dweight);
  return g;
}

Tensor ShortConvCp::backward(CpContext&& ctx, const TensorView& dout, const TensorView& dweight) {
  const std::shared_ptr<Saved> s = ctx.peek<Saved>(id_, "short conv CP");
  {
    Fingerprint fp("short conv CP backward");
    fp.add_tensor("saved x", s->x.view())
        .add_tensor("saved weight", s->weight.view())
        .add_tensor("dout", dout)
        .add_tensor("dweight", dweight);
    backward_agreement_.run(groups_.cp, fp, groups_.stream);
  }
  const TensorView x = s->x.view();
  const DeviceAlloc alloc{common_device({x, dout, dweight}, "short conv CP backward (saved x, dout, dweight)"),
                          groups_.stream};
  check_grad_input(dout, x.shape(), "short conv CP dout");
  check_dtype(dout, x.dtype(), "short conv CP dout");  // the conv kernel takes dout in x's dtype
  check_grad_input(dweight, s->weight.shape(), "short conv CP dweight");
  ctx.consume<Saved>(id_, "short conv CP");
  const std::int64_t B = x.dim(0), C = x.dim(2), W = s->width;
  const int me = groups_.cp.rank(), n = groups_.cp.size();
  const HaloPlan& plan = plan_for(W);
  const CommStreamScope stream_scope(groups_);
  const Stream stream = groups_.stream;
  // The kernel runs in the accumulation dtype (its outputs have its input's dtype): fp64 for fp64, else fp32.
  const DType acc = x.dtype() == DType::kFloat64 ? DType::kFloat64 : DType::kFloat32;
  auto to_acc = [&](Tensor t) {
    return t.dtype() == acc ? std::move(t) : alloc.copy_of(t.view(), acc, MemCategory::kWorkspace);
  };
  const Tensor weight = alloc.copy_of(s->weight.view(), acc, MemCategory::kWorkspace);
  Tensor dx32 = alloc.zeros(x.shape(), acc, MemCategory::kWorkspace);
  Tensor dw32 = alloc.zeros(s->weight.shape(), acc, MemCategory::kWorkspace);
  // Halo gradients per peer, in the order that peer sent the rows (fp32 on the wire).
  std::vector<Tensor> send(n), recv(n);
  for (int r = 0; r < n; ++r) {
    if (plan.take_count[r] > 0) {
      send[r] = alloc.empty({B, plan.take_count[r], C}, acc, MemCategory::kCommBuffer);
    }
  }
  for (std::size_t j = 0; j < plan.mine.size(); ++j) {
    const Segment& seg = segments_[plan.mine[j]];
    Tensor xs = to_acc(take_rows(x, seg.local_offset, seg.length, MemCategory::kWorkspace, stream));
    Tensor dys = to_acc(take_rows(dout, seg.local_offset, seg.length, MemCategory::kWorkspace, stream));
    Tensor halo = W > 1 ? alloc.copy_of(s->halo[j].view(), acc, MemCategory::kWorkspace) : Tensor();
    const SegmentConv sc = segment_conv(xs.view(), weight.view(), W > 1 ? halo.view() : TensorView(),
                                        segment_pieces(seg, cu_seqlens_), config_.use_silu, alloc);
    Tensor dxs = alloc.empty(xs.shape(), acc, MemCategory::kWorkspace);
    Tensor dws = alloc.empty(s->weight.shape(), acc, MemCategory::kWorkspace);
    // d(conv states): one per piece; the first is the halo's gradient.
    const std::int64_t nstates = sc.states.defined() ? sc.states.dim(0) : B;
    Tensor dstates = alloc.empty({nstates, W - 1, C}, acc, MemCategory::kWorkspace);
    attn::short_conv_backward(sc.args, dys.view(), dxs.view(), dws.view(), W > 1 ? dstates.view() : TensorView(),
                              stream);
    const TensorView dstate = sc.states.defined() ? dstates.view().slice0(0, 1) : dstates.view();
    // dx rows of the segment (segments are disjoint), then the halo gradients: into our own dx, or to their owners.
    index_add_rows(dxs.view(), 1, row_range(seg.local_offset, seg.length), dx32.view(), stream);
    add_inplace(dw32.view(), dws.view(), stream);
    for (const HaloPlan::Source& src : plan.sources[j]) {
      Tensor g = alloc.empty({B, static_cast<std::int64_t>(src.slots.size()), C}, acc, MemCategory::kWorkspace);
      gather_rows(dstate, 1, src.slots, g.view(), stream);
      if (src.peer == me) {
        index_add_rows(g.view(), 1, src.rows, dx32.view(), stream);
      } else {
        scatter_rows(g.view(), 1, src.rows, send[src.peer].view(), stream);
      }
    }
  }
  std::vector<P2POp> ops;
  for (int r = 0; r < n; ++r) {
    if (plan.take_count[r] > 0) ops.push_back(P2POp::send(send[r].view(), r, kTagHaloGrad));
    if (!plan.give[r].empty()) {
      recv[r] = alloc.empty({B, static_cast<std::int64_t>(plan.give[r].size()), C}, acc, MemCategory::kCommBuffer);
      ops.push_back(P2POp::recv(recv[r].view(), r, kTagHaloGrad));
    }
  }
  if (!ops.empty()) groups_.cp.batch_isend_irecv(ops)->wait();
  // Add the received halo gradients into our rows, peers in rank order (deterministic).
  for (int r = 0; r < n; ++r) {
    if (!plan.give[r].empty()) index_add_rows(recv[r].view(), 1, plan.give[r], dx32.view(), stream);
  }
  groups_.cp.all_reduce(dw32.view(), ReduceOp::kSum)->wait();
  alloc.copy_convert(dw32.view(), dweight);
  Tensor dx = alloc.empty(x.shape(), x.dtype(), MemCategory::kWorkspace);
  alloc.copy_convert(dx32.view(), dx.view());
  return dx;
}

}  // namespace seqpar
