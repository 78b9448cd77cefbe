// What every context-parallel (CP) layer of parallel/ shares: the communicator groups it runs on, its counters,
// the timing helpers that fill them, and the context a forward hands to its backward.
//
// One argument shape for every CP layer (RingAttention, MhaCp, DsaCp, GdnCp,
// ShortConvCp):  Layer(const CpGroups& groups, const SequenceLayout& layout, const Config& config).
// A layer is stateless between calls: forward() returns its outputs and a CpContext that owns what the backward
// needs (ledger category saved_activation); backward() takes that context back (by rvalue), checks that this very
// object made it and that it was not used before, and frees it. One configured object therefore serves any
// number of layers and micro-batches, with the backwards in any order.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "../runtime/comm.h"
#include "../runtime/device.h"
#include "../runtime/tensor.h"
#include "../runtime/tensor_ops.h"
#include "../runtime/timer.h"

namespace seqpar {

class CpGrid;
class SequenceLayout;

// The options of the CP layers.
enum class RingImpl : std::uint8_t { kP2P, kAllGather };        // ring attention: blocks around, or all-gather
enum class DsaSelectMode : std::uint8_t { kRing, kAllGather };  // DSA selection over the CP group
enum class GdnCpMode : std::uint8_t { kChain, kScan };          // GDN state passing

// The options' names ("p2p", "allgather"; "ring", "allgather"; "chain", "scan") and their parsers.
// Errors: the parsers: "<what> 'x' is not one of a, b" for another name.
// Sync: host-only.
const char* ring_impl_name(RingImpl impl);
RingImpl parse_ring_impl(std::string_view name);
const char* dsa_select_mode_name(DsaSelectMode mode);
DsaSelectMode parse_dsa_select_mode(std::string_view name);
const char* gdn_cp_mode_name(GdnCpMode mode);
GdnCpMode parse_gdn_cp_mode(std::string_view name);

// The index of `name` in `names`.
// Returns: the index.
// Errors: "<what> '<name>' is not one of <names, comma-separated>".
// Sync: host-only.
int parse_option_index(std::string_view name, std::span<const char* const> names, const char* what);

// The communicators of one CP layer and the compute stream of its kernels.
//   ulysses: the Ulysses group (size Pu, rank = ulysses_rank); heads <-> sequence all-to-all.
//   ring:    the ring group (size Pr, rank = ring_rank); blocks and states travel around it.
//   sp:      the whole CP group (size Pu * Pr, rank = cp_rank = ring_rank * Pu + ulysses_rank); DSA's selection
//            and the short conv halo use it.
// The references must outlive every layer built from the groups.
struct CpGroups {
  Communicator& ulysses;
  Communicator& ring;
  Communicator& cp;
  // Every kernel and tensor_ops call gets it; a device stream is also set on the communicators during each call
  // (CommStreamScope), so that their copies (MPI staging) or kernels (NCCL, through an event) follow the work
  // queued on it. The host-synchronous calls of the schedules finish their stream work before they return.
  Stream stream;

  // The groups from three communicators, or from the grid's Ulysses, ring and CP communicators (from()).
  // Errors: cp.size() != ulysses.size() * ring.size(), cp.rank() != cp_rank() (on the ranks where it differs).
  // Sync: host-only, no communication.
  CpGroups(Communicator& ulysses, Communicator& ring, Communicator& cp, Stream stream = Stream::cpu());
  static CpGroups from(const CpGrid& grid, Stream stream = Stream::cpu());

  // Sizes and this rank's CP rank (ring_rank * Pu + ulysses_rank).
  // Sync: host-only.
  int ulysses_size() const { return ulysses.size(); }
  int ring_size() const { return ring.size(); }
  int cp_rank() const { return ring.rank() * ulysses.size() + ulysses.rank(); }
};

// Checks that `layout` was built for these groups.
// Args: layer: names the caller in the message.
// Errors: ring_size or ulysses_size different from the groups' sizes (identical on every rank).
// Sync: host-only, collective-free.
void check_layout_matches(const CpGroups& groups, const SequenceLayout& layout, const char* layer);

// ---- agreement of the ranks (docs/design.md, "Agreement of the ranks") ----------------------------------
//
// Every public forward() and backward() of the CP layers checks, before any data moves, that all ranks of its group
// pass the same shapes, dtypes and configuration: each rank writes its call as named fields (a Fingerprint), and one
// all-reduce (max) of three int64 (the 62-bit digest of the fields, its negation, the fields' text length) tells
// every rank whether all digests are equal. Only when they differ, an all-gather of the fields' text lets every rank
// name the first field that differs and its value on each rank, and every rank throws the same Error.
//
// When it runs (SEQPAR_AGREEMENT_CHECK, read once, at the first layer built):
//   changes (default): on a call whose fingerprint differs from the last one this entry point of this layer object
//            found all ranks agreeing on (the first call, and every call after a shape or configuration change).
//            A repeated call pays only for writing its fingerprint (no message). What it cannot see: one rank
//            changing alone while the others repeat the agreed call (that rank waits in the check and the others
//            in their first message, until SEQPAR_COMM_TIMEOUT_S); use `always` to catch that too.
//   always:  on every call (one 24-byte all-reduce per call).
//   off:     never.
enum class AgreementMode : std::uint8_t { kOff, kChanges, kAlways };

// Names ("off", "changes", "always") and their parser.
// Errors: the parser, for another name.
// Sync: host-only.
const char* agreement_mode_name(AgreementMode mode);
AgreementMode parse_agreement_mode(std::string_view name);

// The mode of SEQPAR_AGREEMENT_CHECK (default changes), read once.
// Errors: a value that is not a mode (naming the value and the accepted ones).
// Sync: host-only.
AgreementMode agreement_mode();

// The fields of one call, in order, as text ("name=value" lines). The first field names the call. Every member is
// host-only and returns *this for chaining.
class Fingerprint {
 public:
  explicit Fingerprint(std::string_view call);
  // Fields: an integer; a real (shortest exact rendering); a flag ("yes" / "no"); text.
  Fingerprint& add_int(std::string_view name, std::int64_t value);
  Fingerprint& add_real(std::string_view name, double value);
  Fingerprint& add_flag(std::string_view name, bool value);
  Fingerprint& add_text(std::string_view name, std::string_view value);
  // A tensor: dtype and shape ("fp32[1, 32, 4, 16]"), "cuda " before it for a device tensor, "none" for an empty
  // view; add_tensors: add_tensor for each (name, tensor), in order.
  Fingerprint& add_tensor(std::string_view name, const TensorView& t);
  Fingerprint& add_tensors(std::initializer_list<std::pair<std::string_view, TensorView>> named);

  // The text, and its FNV-1a 64 digest.
  const std::string& text() const { return text_; }
  std::uint64_t digest() const;

 private:
  std::string text_;
};

// One entry point's agreement check and its cache (the digest of the last call every rank agreed on).
class AgreementCheck {
 public:
  explicit AgreementCheck(AgreementMode mode = agreement_mode()) : mode_(mode) {}

  // Checks that every rank of `comm` passes the same fingerprint (see AgreementMode for when it runs).
  // Errors: the same on every rank of `comm`: "<call>: the ranks of <group> (<members>) disagree on <field>:
  //   <value> on <group> rank(s) ...; <value> on ..."; a communication timeout.
  // Sync: collective over `comm` when it runs (every rank of `comm` must call it, in the same order as its other
  //   operations on `comm`); buffers on comm.device() (copied on `stream`); waits with the default
  //   communication timeout.
  void run(Communicator& comm, const Fingerprint& fp, Stream stream = Stream::cpu());

  // The mode; num_checks(): calls that ran the collective; num_skipped(): calls served by the cache (mode off, a
  // group of one).
  // Sync: host-only.
  AgreementMode mode() const { return mode_; }
  std::int64_t num_checks() const { return num_checks_; }
  std::int64_t num_skipped() const { return num_skipped_; }

 private:
  AgreementMode mode_;
  bool have_agreed_ = false;
  std::uint64_t agreed_digest_ = 0;
  std::int64_t num_checks_ = 0, num_skipped_ = 0;
};

// Checks a gradient input or output buffer of a backward (dout, dq). Layers call it before consuming their context,
// so that a refused call leaves the context live.
// Errors: naming `what`, unless t has `shape` and a floating dtype (the device is checked by common_device).
// Sync: host-only.
void check_grad_input(const TensorView& t, const Shape& shape, const char* what);

// What one CP layer did on this rank; every field is summed over the calls since the last reset().
struct CpCounters {
  double flops = 0;                     // attention FLOPs executed (MHA: 4 B Hq D per visible pair forward, 2.5x bwd)
  double attention_pairs = 0;           // DSA: (query, selected key) pairs x local heads attended
  std::int64_t bytes_sent = 0;          // ring and CP groups (blocks, states, index keys, halos)
  std::int64_t bytes_received = 0;      //   "
  std::int64_t a2a_bytes_sent = 0;      // Ulysses group (all-to-all and all-gather of the heads exchange)
  std::int64_t a2a_bytes_received = 0;  //   "
  std::int64_t message_rounds = 0;      // sequential rounds of messages: GDN's states (chain: N-1 each way; scan:
                                        // log), MHA's and DSA's rings (P - 1 forward, P backward per ring)
  double exposed_comm_s = 0;            // seconds blocked waiting for ring / SP messages (not hidden by compute)
  double compute_s = 0;                 // seconds in kernels and merges
  double a2a_s = 0;                     // seconds in Ulysses exchanges (never overlapped)

  // Sums of the fields above; reset() zeroes every field; += adds another layer's counters.
  double total_exposed_s() const { return exposed_comm_s + a2a_s; }
  std::int64_t total_bytes_sent() const { return bytes_sent + a2a_bytes_sent; }
  void reset() { *this = {}; }
  CpCounters& operator+=(const CpCounters& other);
};

// Adds the wall-clock seconds of its lifetime to `seconds` (RAII).
class ScopedTimer {
 public:
  explicit ScopedTimer(double& seconds) : seconds_(seconds), t0_(wall_seconds()) {}
  ~ScopedTimer() { seconds_ += wall_seconds() - t0_; }
  ScopedTimer(const ScopedTimer&) = delete;
  ScopedTimer& operator=(const ScopedTimer&) = delete;

 private:
  double& seconds_;
  double t0_;
};

// Waits for `work` (a null handle is a no-op) and resets it, adding the seconds blocked to *exposed_s (may be null).
// The `comm` form: the same for an operation on `comm`, except that a group of one adds nothing: it moves no data
// (its collectives are local copies), so none of its time is exposed communication.
// Errors: those of Work::wait.
// Sync: host-blocking until the operation completes.
void timed_wait(WorkHandle& work, double* exposed_s);
void timed_wait(const Communicator& comm, WorkHandle& work, double* exposed_s);

// Adds to a CpCounters the bytes a set of communicators moved during its lifetime: `ring_or_sp` (deduplicated, so
// that one communicator passed twice is counted once) into bytes_sent / bytes_received, `ulysses` into a2a_*.
class CommMeter {
 public:
  // Starts counting; the destructor adds the bytes moved since.
  // Sync: host-only.
  CommMeter(const CpGroups& groups, CpCounters& counters);
  ~CommMeter();
  CommMeter(const CommMeter&) = delete;
  CommMeter& operator=(const CommMeter&) = delete;
  // Bytes sent over all groups since construction.
  // Sync: host-only.
  std::int64_t bytes_sent_so_far() const;

 private:
  const CpGroups& groups_;
  CpCounters& counters_;
  CommCounters ring_, cp_, ulysses_;
};

// A unique id per layer object (a copy gets a new one; a move hands its id over), so that a context finds its way
// back to its maker only.
class LayerId {
 public:
  LayerId();
  LayerId(const LayerId&);
  LayerId& operator=(const LayerId&);
  // A moved-to layer is the same layer: it keeps the id (its contexts stay valid); the moved-from one gets a new id.
  LayerId(LayerId&& other) noexcept;
  LayerId& operator=(LayerId&& other) noexcept;
  // The id.
  // Sync: host-only.
  std::uint64_t value() const { return id_; }

 private:
  std::uint64_t id_;
};

// What a forward saved for its backward. Move-only; owns the saved tensors until backward() consumes it.
// States: empty (default-constructed or moved from), live (returned by a forward), consumed (given to a backward).
class CpContext {
 public:
  CpContext() = default;
  CpContext(CpContext&& other) noexcept { *this = std::move(other); }
  CpContext& operator=(CpContext&& other) noexcept;
  CpContext(const CpContext&) = delete;
  CpContext& operator=(const CpContext&) = delete;

  // True while the context is live (returned by a forward, not yet consumed).
  // Sync: host-only.
  bool live() const { return state_ == State::kLive; }

  // For layers: wraps `saved` (made by layer `id`, a `layer` name for messages).
  // Returns: a live context.
  // Sync: host-only.
  template <typename Saved>
  static CpContext make(const LayerId& id, const char* layer, std::shared_ptr<Saved> saved) {
    CpContext c;
    c.layer_id_ = id.value();
    c.layer_ = layer;
    c.state_ = State::kLive;
    c.saved_ = std::move(saved);
    return c;
  }
  // For layers: checks like consume() but leaves the context live (a backward validates its other arguments with
  // the saved shapes first, so that a refused call can be retried with the same context).
  // Returns: the saved state, shared.
  // Errors: as consume().
  // Sync: host-only.
  template <typename Saved>
  std::shared_ptr<Saved> peek(const LayerId& id, const char* layer) const {
    check_consumable(id, layer);
    return std::static_pointer_cast<Saved>(saved_);
  }
  // For layers: checks that the context is live and was made by `id`, marks it consumed and hands over its saved
  // state.
  // Returns: the saved state (freed when the caller drops it).
  // Errors: naming `layer`, for a context that is empty, consumed or made by another layer object.
  // Sync: host-only.
  template <typename Saved>
  std::shared_ptr<Saved> consume(const LayerId& id, const char* layer) {
    check_consumable(id, layer);
    state_ = State::kConsumed;
    return std::static_pointer_cast<Saved>(std::move(saved_));
  }

 private:
  enum class State : std::uint8_t { kEmpty, kLive, kConsumed };
  void check_consumable(const LayerId& id, const char* layer) const;

  std::uint64_t layer_id_ = 0;
  const char* layer_ = "";
  State state_ = State::kEmpty;
  std::shared_ptr<void> saved_;
};

// Where a schedule puts its buffers: the device of its inputs (common_device), with every fill, copy and
// conversion ordered on `stream` (the groups' stream). No host-only operation: on a CUDA device these are the
// CUDA versions of runtime/tensor_ops.h.
struct DeviceAlloc {
  Device device;
  Stream stream;

  // Tensor::empty / zeros / copy_of and copy_convert on `device`, ordered on `stream`. copy_of: a copy of `src`
  // (on its own device, which is `device` inside a schedule) converted to `dtype`.
  // Errors: those of the Tensor and tensor_ops functions called.
  Tensor empty(const Shape& shape, DType dtype, MemCategory category) const {
    return Tensor::empty(shape, dtype, category, device);
  }
  Tensor zeros(const Shape& shape, DType dtype, MemCategory category) const {
    return Tensor::zeros(shape, dtype, category, device, stream);
  }
  Tensor copy_of(const TensorView& src, DType dtype, MemCategory category) const {
    return Tensor::copy_of(src, dtype, category, stream);
  }
  void copy_convert(const TensorView& src, const TensorView& dst) const { seqpar::copy_convert(src, dst, stream); }
};

// Sets the groups' stream on their communicators for a scope when it is a device stream (a host stream leaves them
// alone, so that a device communicator keeps its own); restores the previous streams at exit.
class CommStreamScope {
 public:
  // Sets the streams; the destructor restores them.
  // Errors: those of Communicator::set_stream.
  // Sync: as Communicator::set_stream.
  explicit CommStreamScope(const CpGroups& groups);
  ~CommStreamScope();
  CommStreamScope(const CommStreamScope&) = delete;
  CommStreamScope& operator=(const CommStreamScope&) = delete;

 private:
  const CpGroups& groups_;
  Stream previous_[3];
  bool active_ = false;
};

}  // namespace seqpar
