#include "parallel/layout.h"

#include "runtime/tensor_ops.h"

namespace seqpar {

namespace {
constexpr const char* kLayoutNames[] = {"contiguous", "zigzag", "stripe"};
}  // namespace

const char* layout_name(LayoutKind kind) { return kLayoutNames[static_cast<int>(kind)]; }
LayoutKind parse_layout(std::string_view name) {
  return static_cast<LayoutKind>(parse_option_index(name, kLayoutNames, "layout"));
}

SequenceLayout::SequenceLayout(LayoutKind kind, std::int64_t seq_len, int ring_size, int ulysses_size)
    : kind_(kind), seq_len_(seq_len), ring_size_(ring_size), ulysses_size_(ulysses_size) {
  SEQPAR_CHECK(ring_size >= 1 && ulysses_size >= 1, "ring_size ", ring_size, " and ulysses_size ", ulysses_size,
               " must be >= 1");
  SEQPAR_CHECK(seq_len >= 1, "seq_len ", seq_len, " must be >= 1");
  const std::int64_t ranks = static_cast<std::int64_t>(ring_size) * ulysses_size;
  if (kind == LayoutKind::kZigzag) {
    // A ring of one holds the whole sequence in order (its two chunks are adjacent): any length.
    SEQPAR_CHECK(ring_size == 1 || seq_len % (2 * ring_size) == 0, "seq_len ", seq_len,
                 " must be divisible by 2*ring_size=", 2 * ring_size, " for the zigzag layout");
    SEQPAR_CHECK((seq_len / ring_size) % ulysses_size == 0, "seq_len ", seq_len, " / ring_size ", ring_size, " = ",
                 seq_len / ring_size, " must be divisible by ulysses_size=", ulysses_size, " for the zigzag layout");
  } else {
    SEQPAR_CHECK(seq_len % ranks == 0, "seq_len ", seq_len, " must be divisible by ring_size*ulysses_size=", ranks,
                 " for the ", layout_name(kind), " layout");
  }
}

void add_layout_fields(Fingerprint& fp, const SequenceLayout& layout) {
  fp.add_text("layout", layout_name(layout.kind()))
      .add_int("seq_len", layout.seq_len())
      .add_int("ring_size", layout.ring_size())
      .add_int("ulysses_size", layout.ulysses_size());
}

SequenceLayout SequenceLayout::for_groups(const CpGroups& groups, std::int64_t seq_len, LayoutKind kind) {
  return SequenceLayout(kind, seq_len, groups.ring_size(), groups.ulysses_size());
}

std::vector<std::int64_t> SequenceLayout::ring_shard_positions(int ring_rank) const {
  SEQPAR_CHECK(0 <= ring_rank && ring_rank < ring_size_, "ring_rank ", ring_rank, " outside [0, ", ring_size_, ")");
  const std::int64_t len = ring_shard_len();
  std::vector<std::int64_t> pos(static_cast<std::size_t>(len));
  switch (kind_) {
    case LayoutKind::kContiguous:
      for (std::int64_t i = 0; i < len; ++i) pos[i] = ring_rank * len + i;
      break;
    case LayoutKind::kZigzag: {
      if (ring_size_ == 1) {  // chunks 0 and 1 of the whole sequence, adjacent: 0 .. S-1 (S may be odd)
        for (std::int64_t i = 0; i < len; ++i) pos[i] = i;
        break;
      }
      const std::int64_t chunk = len / 2;
      const std::int64_t second = 2 * ring_size_ - 1 - ring_rank;
      for (std::int64_t i = 0; i < chunk; ++i) {
        pos[i] = ring_rank * chunk + i;
        pos[chunk + i] = second * chunk + i;
      }
      break;
    }
    case LayoutKind::kStripe:
      for (std::int64_t i = 0; i < len; ++i) pos[i] = i * ring_size_ + ring_rank;
      break;
  }
  return pos;
}

std::vector<std::int64_t> SequenceLayout::positions(int sp_rank) const {
  SEQPAR_CHECK(0 <= sp_rank && sp_rank < num_ranks(), "sp_rank ", sp_rank, " outside [0, ", num_ranks(), ")");
  const int ring_rank = sp_rank / ulysses_size_;
  const int ulysses_rank = sp_rank % ulysses_size_;
  const std::vector<std::int64_t> shard = ring_shard_positions(ring_rank);
  const std::int64_t len = local_len();
  return std::vector<std::int64_t>(shard.begin() + ulysses_rank * len, shard.begin() + (ulysses_rank + 1) * len);
}

using Positions = std::vector<std::int64_t>;

void shard_sequence(const TensorView& full, const Positions& pos, const TensorView& local, Stream stream) {
  gather_rows(full, 1, pos, local, stream);
}

void unshard_sequence(const TensorView& local, const Positions& pos, const TensorView& full, Stream stream) {
  scatter_rows(local, 1, pos, full, stream);
}

void shard_sequence_bhs(const TensorView& full, const Positions& pos, const TensorView& local, Stream stream) {
  gather_rows(full, 2, pos, local, stream);
}

void unshard_sequence_bhs(const TensorView& local, const Positions& pos, const TensorView& full, Stream stream) {
  scatter_rows(local, 2, pos, full, stream);
}

namespace {

void check_gather(const Communicator& comm, const SequenceLayout& layout, int seq_dim, const char* what) {
  SEQPAR_CHECK(comm.size() == layout.num_ranks(), what, ": communicator size ", comm.size(), " != layout ranks ",
               layout.num_ranks());
  SEQPAR_CHECK(seq_dim == 1 || seq_dim == 2, what, ": seq_dim ", seq_dim, " must be 1 or 2");
}

// The pieces of every SP rank, [n, local shape] in rank order, written to their positions in `full`.
void unshard_pieces(const SequenceLayout& layout, const TensorView& all, const Shape& local_shape,
                    const TensorView& full, int seq_dim, Stream stream) {
  for (int r = 0; r < layout.num_ranks(); ++r) {
    const TensorView piece = all.slice0(r, r + 1).reshape(local_shape);
    if (seq_dim == 1) {
      unshard_sequence(piece, layout.positions(r), full, stream);
    } else {
      unshard_sequence_bhs(piece, layout.positions(r), full, stream);
    }
  }
}

// [n, shape...]: one slot per rank of an n-rank exchange.
Shape per_rank_shape(int n, const Shape& shape) {
  Shape s = shape;
  s.insert(s.begin(), n);
  return s;
}

}  // namespace

void scatter_sequence(Communicator& comm, const SequenceLayout& layout, const TensorView& full, const TensorView& local,
                      int root, Stream stream) {
  SEQPAR_CHECK(comm.size() == layout.num_ranks(), "scatter_sequence: communicator size ", comm.size(),
               " != layout ranks ", layout.num_ranks());
  const int n = comm.size();
  // Root packs every rank's piece in rank order, then an all_to_all_v with zero counts elsewhere delivers them.
  const DeviceAlloc alloc{common_device({full, local}, "scatter_sequence"), stream};
  Tensor packed;
  std::vector<std::int64_t> send_counts(n, 0), recv_counts(n, 0);
  recv_counts[root] = local.numel();
  if (comm.rank() == root) {
    packed = alloc.empty(per_rank_shape(n, local.shape()), local.dtype(), MemCategory::kCommBuffer);
    for (int r = 0; r < n; ++r) {
      shard_sequence(full, layout.positions(r), packed.view().slice0(r, r + 1).reshape(local.shape()), stream);
      send_counts[r] = local.numel();
    }
  } else {
    packed = alloc.empty({0}, local.dtype(), MemCategory::kCommBuffer);
  }
  comm.all_to_all_v(packed.view(), send_counts, local, recv_counts)->wait();
}

void gather_sequence(Communicator& comm, const SequenceLayout& layout, const TensorView& local, const TensorView& full,
                     int seq_dim, Stream stream) {
  check_gather(comm, layout, seq_dim, "gather_sequence");
  const DeviceAlloc alloc{common_device({local, full}, "gather_sequence"), stream};
  Tensor all = alloc.empty(per_rank_shape(comm.size(), local.shape()), local.dtype(), MemCategory::kCommBuffer);
  comm.all_gather(local, all.view())->wait();
  unshard_pieces(layout, all.view(), local.shape(), full, seq_dim, stream);
}

void gather_sequence_to_root(Communicator& comm, const SequenceLayout& layout, const TensorView& local,
                             const TensorView& full, int root, int seq_dim, Stream stream) {
  check_gather(comm, layout, seq_dim, "gather_sequence_to_root");
  SEQPAR_CHECK(root >= 0 && root < comm.size(), "gather_sequence_to_root: root ", root, " outside the communicator of ",
               comm.size(), " ranks");
  const bool is_root = comm.rank() == root;
  const DeviceAlloc alloc{common_device({local, is_root ? full : TensorView{}}, "gather_sequence_to_root"), stream};
  // The mirror of scatter_sequence: an all_to_all_v in which every rank sends only to root.
  const int n = comm.size();
  std::vector<std::int64_t> send_counts(n, 0), recv_counts(n, 0);
  send_counts[root] = local.numel();
  Tensor all;
  if (is_root) {
    all = alloc.empty(per_rank_shape(n, local.shape()), local.dtype(), MemCategory::kCommBuffer);
    recv_counts.assign(n, local.numel());
  } else {
    all = alloc.empty({0}, local.dtype(), MemCategory::kCommBuffer);
  }
  comm.all_to_all_v(local, send_counts, all.view(), recv_counts)->wait();
  if (is_root) unshard_pieces(layout, all.view(), local.shape(), full, seq_dim, stream);
}

CpLayerBase::CpLayerBase(const CpGroups& groups, const SequenceLayout& layout, const char* layer)
    : groups_(groups),
      layout_(layout),
      positions_((check_layout_matches(groups, layout, layer), layout.positions(groups.sp_rank()))) {}

Fingerprint CpLayerBase::fingerprint(std::string_view call) const {
  Fingerprint fp(call);
  add_layout_fields(fp, layout_);
  return fp;
}

}  // namespace seqpar
