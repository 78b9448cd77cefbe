#include "parallel/cp_common.h"

#include <atomic>

#include "parallel/layout.h"
#include "runtime/sp_grid.h"

namespace seqpar {

namespace {
constexpr const char* kRingImplNames[] = {"p2p", "allgather"};
constexpr const char* kDsaSelectNames[] = {"ring", "allgather"};
constexpr const char* kGdnModeNames[] = {"chain", "scan"};
}  // namespace

int parse_option_index(std::string_view name, std::span<const char* const> names, const char* what) {
  std::string all;
  for (std::size_t i = 0; i < names.size(); ++i) {
    if (name == names[i]) return static_cast<int>(i);
    all += (i > 0 ? ", " : "") + std::string(names[i]);
  }
  SEQPAR_THROW(what, " '", name, "' is not one of ", all);
}

const char* ring_impl_name(RingImpl impl) { return kRingImplNames[static_cast<int>(impl)]; }
RingImpl parse_ring_impl(std::string_view name) {
  return static_cast<RingImpl>(parse_option_index(name, kRingImplNames, "ring impl"));
}
const char* dsa_select_mode_name(DsaSelectMode mode) { return kDsaSelectNames[static_cast<int>(mode)]; }
DsaSelectMode parse_dsa_select_mode(std::string_view name) {
  return static_cast<DsaSelectMode>(parse_option_index(name, kDsaSelectNames, "DSA selection mode"));
}
const char* gdn_cp_mode_name(GdnCpMode mode) { return kGdnModeNames[static_cast<int>(mode)]; }
GdnCpMode parse_gdn_cp_mode(std::string_view name) {
  return static_cast<GdnCpMode>(parse_option_index(name, kGdnModeNames, "GDN mode"));
}

CpGroups::CpGroups(Communicator& ulysses_, Communicator& ring_, Communicator& sp_, Stream stream_)
    : ulysses(ulysses_), ring(ring_), sp(sp_), stream(stream_) {
  SEQPAR_CHECK(sp.size() == ulysses.size() * ring.size(), "CpGroups: SP group size ", sp.size(),
               " must equal ulysses_size ", ulysses.size(), " x ring_size ", ring.size());
  // The layers place tokens by sp_rank() and address SP peers by sp.rank(): they must be the same rank.
  SEQPAR_CHECK(sp.rank() == sp_rank(), "CpGroups: this rank is ", sp.name(), " rank ", sp.rank(), ", but ring rank ",
               ring.rank(), " x ulysses_size ", ulysses.size(), " + ulysses rank ", ulysses.rank(), " = ", sp_rank(),
               "; the SP group must order its ranks ring-major (SpGrid does)");
}

CpGroups CpGroups::from(const SpGrid& grid, Stream stream) {
  return CpGroups(grid.ulysses(), grid.ring(), grid.sp(), stream);
}

void check_layout_matches(const CpGroups& groups, const SequenceLayout& layout, const char* layer) {
  SEQPAR_CHECK(layout.ring_size() == groups.ring_size() && layout.ulysses_size() == groups.ulysses_size(), layer,
               ": the layout was built for ring_size ", layout.ring_size(), " x ulysses_size ", layout.ulysses_size(),
               ", but the groups have ring_size ", groups.ring_size(), " x ulysses_size ", groups.ulysses_size(),
               " (SequenceLayout::for_groups builds a matching one)");
}

void check_grad_input(const TensorView& t, const Shape& shape, const char* what) {
  check_shape(t, shape, what);
  SEQPAR_CHECK(is_floating(t.dtype()), what, " has dtype ", dtype_name(t.dtype()),
               ", expected a floating dtype (fp32, bf16, fp16 or fp64)");
}

CpCounters& CpCounters::operator+=(const CpCounters& o) {
  flops += o.flops;
  attention_pairs += o.attention_pairs;
  bytes_sent += o.bytes_sent;
  bytes_received += o.bytes_received;
  a2a_bytes_sent += o.a2a_bytes_sent;
  a2a_bytes_received += o.a2a_bytes_received;
  message_rounds += o.message_rounds;
  exposed_comm_s += o.exposed_comm_s;
  compute_s += o.compute_s;
  a2a_s += o.a2a_s;
  return *this;
}

void timed_wait(WorkHandle& work, double* exposed_s) {
  if (!work) return;
  const double t0 = wall_seconds();
  work->wait();
  if (exposed_s != nullptr) *exposed_s += wall_seconds() - t0;
  work.reset();
}

CommMeter::CommMeter(const CpGroups& groups, CpCounters& counters)
    : groups_(groups),
      counters_(counters),
      ring_(groups.ring.counters()),
      sp_(groups.sp.counters()),
      ulysses_(groups.ulysses.counters()) {}

std::int64_t CommMeter::bytes_sent_so_far() const {
  std::int64_t b = groups_.ring.counters().bytes_sent - ring_.bytes_sent;
  if (&groups_.sp != &groups_.ring) b += groups_.sp.counters().bytes_sent - sp_.bytes_sent;
  if (&groups_.ulysses != &groups_.ring && &groups_.ulysses != &groups_.sp)
    b += groups_.ulysses.counters().bytes_sent - ulysses_.bytes_sent;
  return b;
}

CommMeter::~CommMeter() {
  counters_.bytes_sent += groups_.ring.counters().bytes_sent - ring_.bytes_sent;
  counters_.bytes_received += groups_.ring.counters().bytes_received - ring_.bytes_received;
  if (&groups_.sp != &groups_.ring) {
    counters_.bytes_sent += groups_.sp.counters().bytes_sent - sp_.bytes_sent;
    counters_.bytes_received += groups_.sp.counters().bytes_received - sp_.bytes_received;
  }
  if (&groups_.ulysses != &groups_.ring && &groups_.ulysses != &groups_.sp) {
    counters_.a2a_bytes_sent += groups_.ulysses.counters().bytes_sent - ulysses_.bytes_sent;
    counters_.a2a_bytes_received += groups_.ulysses.counters().bytes_received - ulysses_.bytes_received;
  }
}

namespace {
std::uint64_t next_layer_id() {
  static std::atomic<std::uint64_t> next{1};
  return next.fetch_add(1);
}
}  // namespace

LayerId::LayerId() : id_(next_layer_id()) {}
LayerId::LayerId(const LayerId&) : id_(next_layer_id()) {}
LayerId& LayerId::operator=(const LayerId&) {
  id_ = next_layer_id();
  return *this;
}
LayerId::LayerId(LayerId&& other) noexcept : id_(other.id_) { other.id_ = next_layer_id(); }
LayerId& LayerId::operator=(LayerId&& other) noexcept {
  id_ = other.id_;
  other.id_ = next_layer_id();
  return *this;
}

CpContext& CpContext::operator=(CpContext&& other) noexcept {
  if (this != &other) {
    layer_id_ = other.layer_id_;
    layer_ = other.layer_;
    state_ = other.state_;
    saved_ = std::move(other.saved_);
    other.layer_id_ = 0;
    other.state_ = State::kEmpty;
  }
  return *this;
}

void CpContext::check_consumable(const LayerId& id, const char* layer) const {
  SEQPAR_CHECK(state_ != State::kEmpty, layer,
               ": backward() got an empty context (default-constructed or moved from); pass the context its "
               "forward() returned");
  SEQPAR_CHECK(state_ != State::kConsumed, layer,
               ": backward() got a context that a backward() already used; each forward's context serves one "
               "backward");
  SEQPAR_CHECK(layer_id_ == id.value(), layer, ": backward() got a context made by another layer object (", layer_,
               " #", layer_id_, ", this is #", id.value(),
               "); a context goes back to the object, and so the configuration, that made it");
}

CommStreamScope::CommStreamScope(const CpGroups& groups) : groups_(groups) {
  if (groups.stream.device.is_cpu()) return;
  Communicator* comms[3] = {&groups.ulysses, &groups.ring, &groups.sp};
  for (int i = 0; i < 3; ++i) {
    previous_[i] = comms[i]->stream();
    comms[i]->set_stream(groups.stream);
  }
  active_ = true;
}

CommStreamScope::~CommStreamScope() {
  if (!active_) return;
  Communicator* comms[3] = {&groups_.ulysses, &groups_.ring, &groups_.sp};
  for (int i = 0; i < 3; ++i) comms[i]->set_stream(previous_[i]);
}

}  // namespace seqpar
