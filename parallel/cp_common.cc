#include "parallel/cp_common.h"

#include <algorithm>
#include <atomic>
#include <charconv>
#include <cstring>
#include <functional>

#include "parallel/layout.h"
#include "runtime/env.h"
#include "runtime/cp_grid.h"
#include "runtime/tensor_checks.h"

namespace seqpar {

namespace {
constexpr const char* kRingImplNames[] = {"p2p", "allgather"};
constexpr const char* kDsaSelectNames[] = {"ring", "allgather"};
constexpr const char* kGdnModeNames[] = {"chain", "scan"};
constexpr const char* kAgreementModeNames[] = {"off", "changes", "always"};
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

CpGroups::CpGroups(Communicator& ulysses_, Communicator& ring_, Communicator& cp_, Stream stream_)
    : ulysses(ulysses_), ring(ring_), cp(cp_), stream(stream_) {
  SEQPAR_CHECK(cp.size() == ulysses.size() * ring.size(), "CpGroups: CP group size ", cp.size(),
               " must equal ulysses_size ", ulysses.size(), " x ring_size ", ring.size());
  // The layers place tokens by cp_rank() and address SP peers by cp.rank(): they must be the same rank.
  SEQPAR_CHECK(cp.rank() == cp_rank(), "CpGroups: this rank is ", cp.name(), " rank ", cp.rank(), ", but ring rank ",
               ring.rank(), " x ulysses_size ", ulysses.size(), " + ulysses rank ", ulysses.rank(), " = ", cp_rank(),
               "; the CP group must order its ranks ring-major (CpGrid does)");
}

CpGroups CpGroups::from(const CpGrid& grid, Stream stream) {
  return CpGroups(grid.ulysses(), grid.ring(), grid.cp(), stream);
}

void check_layout_matches(const CpGroups& groups, const SequenceLayout& layout, const char* layer) {
  SEQPAR_CHECK(layout.ring_size() == groups.ring_size() && layout.ulysses_size() == groups.ulysses_size(), layer,
               ": the layout was built for ring_size ", layout.ring_size(), " x ulysses_size ", layout.ulysses_size(),
               ", but the groups have ring_size ", groups.ring_size(), " x ulysses_size ", groups.ulysses_size(),
               " (SequenceLayout::for_groups builds a matching one)");
}

const char* agreement_mode_name(AgreementMode mode) { return kAgreementModeNames[static_cast<int>(mode)]; }
AgreementMode parse_agreement_mode(std::string_view name) {
  return static_cast<AgreementMode>(parse_option_index(name, kAgreementModeNames, "agreement check mode"));
}

AgreementMode agreement_mode() {
  static const AgreementMode mode = [] {
    const std::string v = env::get_string("SEQPAR_AGREEMENT_CHECK", "");
    if (v.empty()) return AgreementMode::kChanges;
    try {
      return parse_agreement_mode(v);
    } catch (const Error& e) {
      SEQPAR_THROW("SEQPAR_AGREEMENT_CHECK=", v, ": ", e.message());
    }
  }();
  return mode;
}

Fingerprint::Fingerprint(std::string_view call) {
  text_.reserve(512);
  add_text("call", call);
}

Fingerprint& Fingerprint::add_text(std::string_view name, std::string_view value) {
  text_.append(name).append("=").append(value).append("\n");
  return *this;
}

Fingerprint& Fingerprint::add_int(std::string_view name, std::int64_t value) {
  char buf[24];
  const auto r = std::to_chars(buf, buf + sizeof(buf), value);
  return add_text(name, std::string_view(buf, static_cast<std::size_t>(r.ptr - buf)));
}

Fingerprint& Fingerprint::add_real(std::string_view name, double value) {
  char buf[32];
  const auto r = std::to_chars(buf, buf + sizeof(buf), value);  // shortest text that reads back exactly
  return add_text(name, std::string_view(buf, static_cast<std::size_t>(r.ptr - buf)));
}

Fingerprint& Fingerprint::add_flag(std::string_view name, bool value) { return add_text(name, value ? "yes" : "no"); }

Fingerprint& Fingerprint::add_tensor(std::string_view name, const TensorView& t) {
  if (t.empty() && t.ndim() == 0) return add_text(name, "none");
  std::string v = t.device().is_cuda() ? "cuda " : "";
  v += dtype_name(t.dtype());
  v += shape_str(t.shape());
  return add_text(name, v);
}

Fingerprint& Fingerprint::add_tensors(std::initializer_list<std::pair<std::string_view, TensorView>> named) {
  for (const auto& [name, t] : named) add_tensor(name, t);
  return *this;
}

std::uint64_t Fingerprint::digest() const {
  std::uint64_t h = 14695981039346656037ull;  // FNV-1a 64
  for (const char c : text_) {
    h ^= static_cast<unsigned char>(c);
    h *= 1099511628211ull;
  }
  return h;
}

namespace {

// Runs `op` on int64 buffers where `comm` wants them (host views for a host communicator; device copies, made and
// read back on `stream`, otherwise) and waits for it.
void run_int64_collective(Communicator& comm, Stream stream, std::vector<std::int64_t>& send,
                          std::vector<std::int64_t>* recv,
                          const std::function<WorkHandle(const TensorView&, const TensorView&)>& op) {
  const auto host = [](std::vector<std::int64_t>& v) {
    return TensorView(v.data(), DType::kInt64, {static_cast<std::int64_t>(v.size())});
  };
  std::vector<std::int64_t> unused;
  std::vector<std::int64_t>& out = recv != nullptr ? *recv : unused;
  if (comm.device().is_cpu()) {
    op(host(send), recv != nullptr ? host(out) : TensorView())->wait();
    return;
  }
  Tensor d_send =
      Tensor::empty({static_cast<std::int64_t>(send.size())}, DType::kInt64, MemCategory::kCommBuffer, comm.device());
  copy_convert(host(send), d_send.view(), stream);
  Tensor d_recv;
  if (recv != nullptr) {
    d_recv =
        Tensor::empty({static_cast<std::int64_t>(out.size())}, DType::kInt64, MemCategory::kCommBuffer, comm.device());
  }
  op(d_send.view(), recv != nullptr ? d_recv.view() : TensorView())->wait();
  copy_convert(d_send.view(), host(send), stream);
  if (recv != nullptr) copy_convert(d_recv.view(), host(out), stream);
}

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> lines;
  std::size_t start = 0;
  while (start < text.size()) {
    const std::size_t end = text.find('\n', start);
    lines.push_back(text.substr(start, end - start));
    start = end == std::string::npos ? text.size() : end + 1;
  }
  return lines;
}

// The message every rank throws: the first field whose value is not the same on every rank, with the ranks of
// each value (in order of first appearance).
std::string disagreement_message(const Communicator& comm, const std::vector<std::string>& texts) {
  std::vector<std::vector<std::string>> lines;
  std::size_t most = 0;
  for (const std::string& t : texts) {
    lines.push_back(lines_of(t));
    most = std::max(most, lines.back().size());
  }
  auto name_of = [](const std::string& line) { return line.substr(0, line.find('=')); };
  auto value_of = [](const std::string& line) { return line.substr(std::min(line.size(), line.find('=') + 1)); };
  const std::string call = lines[0].empty() ? "CP layer" : value_of(lines[0][0]);
  for (std::size_t i = 0; i < most; ++i) {
    std::vector<std::string> names;  // distinct field names at position i
    for (const auto& l : lines) {
      if (i < l.size() && std::find(names.begin(), names.end(), name_of(l[i])) == names.end())
        names.push_back(name_of(l[i]));
    }
    // One name: the ranks differ in its value. Several: they made different calls (whole lines are shown).
    const bool one_name = names.size() == 1;
    std::vector<std::pair<std::string, std::vector<int>>> values;
    for (int r = 0; r < static_cast<int>(lines.size()); ++r) {
      const std::string v =
          i < lines[r].size() ? (one_name ? value_of(lines[r][i]) : lines[r][i]) : std::string("(no such field)");
      auto it = std::find_if(values.begin(), values.end(), [&](const auto& e) { return e.first == v; });
      if (it == values.end()) it = values.insert(values.end(), {v, {}});
      it->second.push_back(r);
    }
    if (values.size() == 1) continue;
    std::string detail;
    for (const auto& [v, ranks] : values) {
      detail += str_cat(detail.empty() ? "" : "; ", v, " on ", comm.name(), ranks.size() > 1 ? " ranks " : " rank ");
      for (std::size_t j = 0; j < ranks.size(); ++j) detail += str_cat(j ? ", " : "", ranks[j]);
    }
    return str_cat(call, ": the ranks of the ", comm.name(), " group (", comm.members_str(), ") disagree on ",
                   one_name ? names[0] : str_cat("the fields of the call (field ", i + 1, ")"), ": ", detail,
                   ". Every rank must pass the same shapes, dtypes and configuration (checked before any data "
                   "moves)");
  }
  return str_cat(call, ": the ranks of the ", comm.name(), " group (", comm.members_str(),
                 ") pass different configurations (their fingerprints differ)");
}

}  // namespace

void AgreementCheck::run(Communicator& comm, const Fingerprint& fp, Stream stream) {
  if (mode_ == AgreementMode::kOff || comm.size() == 1) {  // a group of one cannot disagree
    ++num_skipped_;
    return;
  }
  const std::uint64_t digest = fp.digest();
  if (mode_ == AgreementMode::kChanges && have_agreed_ && digest == agreed_digest_) {
    ++num_skipped_;
    return;
  }
  ++num_checks_;
  // max over ranks of (d, -d, length) gives (max d, -min d, max length); 62 bits keep -d representable.
  const auto d = static_cast<std::int64_t>(digest & ((std::uint64_t{1} << 62) - 1));
  const std::int64_t length = static_cast<std::int64_t>(fp.text().size());
  std::vector<std::int64_t> reduced = {d, -d, length};
  run_int64_collective(comm, stream, reduced, nullptr,
                       [&](const TensorView& buf, const TensorView&) { return comm.all_reduce(buf, ReduceOp::kMax); });
  if (reduced[0] == -reduced[1]) {
    have_agreed_ = true;
    agreed_digest_ = digest;
    return;
  }
  // They differ: every rank's text, padded to the longest, 8 characters per int64.
  const std::int64_t words = (reduced[2] + 7) / 8;
  std::vector<std::int64_t> mine(static_cast<std::size_t>(words), 0);
  std::memcpy(mine.data(), fp.text().data(), fp.text().size());
  std::vector<std::int64_t> all(static_cast<std::size_t>(words * comm.size()), 0);
  run_int64_collective(comm, stream, mine, &all,
                       [&](const TensorView& send, const TensorView& recv) { return comm.all_gather(send, recv); });
  std::vector<std::string> texts;
  for (int r = 0; r < comm.size(); ++r) {
    const char* p = reinterpret_cast<const char*>(all.data() + static_cast<std::size_t>(r) * words);
    texts.emplace_back(p, strnlen(p, static_cast<std::size_t>(words) * 8));
  }
  SEQPAR_THROW(disagreement_message(comm, texts));
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

void timed_wait(const Communicator& comm, WorkHandle& work, double* exposed_s) {
  timed_wait(work, comm.size() > 1 ? exposed_s : nullptr);
}

CommMeter::CommMeter(const CpGroups& groups, CpCounters& counters)
    : groups_(groups),
      counters_(counters),
      ring_(groups.ring.counters()),
      cp_(groups.cp.counters()),
      ulysses_(groups.ulysses.counters()) {}

std::int64_t CommMeter::bytes_sent_so_far() const {
  std::int64_t b = groups_.ring.counters().bytes_sent - ring_.bytes_sent;
  if (&groups_.cp != &groups_.ring) b += groups_.cp.counters().bytes_sent - cp_.bytes_sent;
  if (&groups_.ulysses != &groups_.ring && &groups_.ulysses != &groups_.cp)
    b += groups_.ulysses.counters().bytes_sent - ulysses_.bytes_sent;
  return b;
}

CommMeter::~CommMeter() {
  counters_.bytes_sent += groups_.ring.counters().bytes_sent - ring_.bytes_sent;
  counters_.bytes_received += groups_.ring.counters().bytes_received - ring_.bytes_received;
  if (&groups_.cp != &groups_.ring) {
    counters_.bytes_sent += groups_.cp.counters().bytes_sent - cp_.bytes_sent;
    counters_.bytes_received += groups_.cp.counters().bytes_received - cp_.bytes_received;
  }
  if (&groups_.ulysses != &groups_.ring && &groups_.ulysses != &groups_.cp) {
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
  Communicator* comms[3] = {&groups.ulysses, &groups.ring, &groups.cp};
  for (int i = 0; i < 3; ++i) {
    previous_[i] = comms[i]->stream();
    comms[i]->set_stream(groups.stream);
  }
  active_ = true;
}

CommStreamScope::~CommStreamScope() {
  if (!active_) return;
  Communicator* comms[3] = {&groups_.ulysses, &groups_.ring, &groups_.cp};
  for (int i = 0; i < 3; ++i) comms[i]->set_stream(previous_[i]);
}

}  // namespace seqpar
