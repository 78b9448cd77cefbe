#include "parallel/layout.h"

#include <cstring>

namespace seqpar {

const char* layout_name(LayoutKind kind) {
  switch (kind) {
    case LayoutKind::kContiguous: return "contiguous";
    case LayoutKind::kZigzag: return "zigzag";
    case LayoutKind::kStripe: return "stripe";
  }
  return "unknown";
}

LayoutKind parse_layout(std::string_view name) {
  if (name == "contiguous") return LayoutKind::kContiguous;
  if (name == "zigzag") return LayoutKind::kZigzag;
  if (name == "stripe") return LayoutKind::kStripe;
  SEQPAR_THROW("layout '", name, "' is not one of contiguous, zigzag, stripe");
}

SequenceLayout::SequenceLayout(LayoutKind kind, std::int64_t seq_len, int ring_size, int ulysses_size)
    : kind_(kind), seq_len_(seq_len), ring_size_(ring_size), ulysses_size_(ulysses_size) {
  SEQPAR_CHECK(ring_size >= 1 && ulysses_size >= 1, "ring_size ", ring_size, " and ulysses_size ", ulysses_size,
               " must be >= 1");
  SEQPAR_CHECK(seq_len >= 1, "seq_len ", seq_len, " must be >= 1");
  const std::int64_t ranks = static_cast<std::int64_t>(ring_size) * ulysses_size;
  if (kind == LayoutKind::kZigzag) {
    SEQPAR_CHECK(seq_len % (2 * ring_size) == 0, "seq_len ", seq_len,
                 " must be divisible by 2*ring_size=", 2 * ring_size, " for the zigzag layout");
    SEQPAR_CHECK((seq_len / ring_size) % ulysses_size == 0, "seq_len ", seq_len, " / ring_size ", ring_size, " = ",
                 seq_len / ring_size, " must be divisible by ulysses_size=", ulysses_size, " for the zigzag layout");
  } else {
    SEQPAR_CHECK(seq_len % ranks == 0, "seq_len ", seq_len, " must be divisible by ring_size*ulysses_size=", ranks,
                 " for the ", layout_name(kind), " layout");
  }
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

namespace {

// Copies rows of `row_bytes` between [outer, S_src, inner] and [outer, S_dst, inner] arrays.
void copy_rows(const char* src, std::int64_t src_len, char* dst, std::int64_t dst_len, std::int64_t outer,
               std::size_t row_bytes, const std::vector<std::int64_t>& positions, bool to_local) {
  const std::int64_t n = static_cast<std::int64_t>(positions.size());
  for (std::int64_t o = 0; o < outer; ++o) {
    for (std::int64_t i = 0; i < n; ++i) {
      const std::int64_t s = to_local ? positions[i] : i;
      const std::int64_t d = to_local ? i : positions[i];
      std::memcpy(dst + (o * dst_len + d) * row_bytes, src + (o * src_len + s) * row_bytes, row_bytes);
    }
  }
}

void check_pair(const TensorView& full, const TensorView& local, const std::vector<std::int64_t>& positions,
                int seq_dim, const char* op) {
  check_cpu(full, op);
  check_cpu(local, op);
  SEQPAR_CHECK(full.dtype() == local.dtype() && full.ndim() == local.ndim() && full.ndim() > seq_dim, op, ": full ",
               full.str(), " and local ", local.str(), " must have the same dtype and rank");
  for (int d = 0; d < full.ndim(); ++d) {
    const std::int64_t want = d == seq_dim ? static_cast<std::int64_t>(positions.size()) : full.dim(d);
    SEQPAR_CHECK(local.dim(d) == want, op, ": local ", local.str(), " does not match full ", full.str(), " with ",
                 positions.size(), " positions along dim ", seq_dim);
  }
  for (std::int64_t p : positions) {
    SEQPAR_CHECK(0 <= p && p < full.dim(seq_dim), op, ": position ", p, " outside [0, ", full.dim(seq_dim), ")");
  }
}

void move_rows(const TensorView& full, const TensorView& local, const std::vector<std::int64_t>& positions, int seq_dim,
               bool to_local) {
  std::int64_t outer = 1;
  for (int d = 0; d < seq_dim; ++d) outer *= full.dim(d);
  std::size_t row_bytes = dtype_size(full.dtype());
  for (int d = seq_dim + 1; d < full.ndim(); ++d) row_bytes *= static_cast<std::size_t>(full.dim(d));
  const std::int64_t full_len = full.dim(seq_dim), local_len = local.dim(seq_dim);
  if (to_local) {
    copy_rows(static_cast<const char*>(full.data()), full_len, static_cast<char*>(local.data()), local_len, outer,
              row_bytes, positions, true);
  } else {
    copy_rows(static_cast<const char*>(local.data()), local_len, static_cast<char*>(full.data()), full_len, outer,
              row_bytes, positions, false);
  }
}

}  // namespace

void shard_sequence(const TensorView& full, const std::vector<std::int64_t>& positions, const TensorView& local) {
  check_pair(full, local, positions, 1, "shard_sequence");
  move_rows(full, local, positions, 1, true);
}

void unshard_sequence(const TensorView& local, const std::vector<std::int64_t>& positions, const TensorView& full) {
  check_pair(full, local, positions, 1, "unshard_sequence");
  move_rows(full, local, positions, 1, false);
}

void shard_sequence_bhs(const TensorView& full, const std::vector<std::int64_t>& positions, const TensorView& local) {
  check_pair(full, local, positions, 2, "shard_sequence_bhs");
  move_rows(full, local, positions, 2, true);
}

void unshard_sequence_bhs(const TensorView& local, const std::vector<std::int64_t>& positions, const TensorView& full) {
  check_pair(full, local, positions, 2, "unshard_sequence_bhs");
  move_rows(full, local, positions, 2, false);
}

void scatter_sequence(Communicator& comm, const SequenceLayout& layout, const TensorView& full, const TensorView& local,
                      int root) {
  SEQPAR_CHECK(comm.size() == layout.num_ranks(), "scatter_sequence: communicator size ", comm.size(),
               " != layout ranks ", layout.num_ranks());
  check_cpu(local, "scatter_sequence");
  const int n = comm.size();
  // Root packs every rank's piece in rank order, then an all_to_all_v with zero counts elsewhere delivers them.
  Tensor packed;
  std::vector<std::int64_t> send_counts(n, 0), recv_counts(n, 0);
  recv_counts[root] = local.numel();
  if (comm.rank() == root) {
    Shape s = local.shape();
    s.insert(s.begin(), n);
    packed = Tensor::empty(s, local.dtype(), MemCategory::kCommBuffer);
    for (int r = 0; r < n; ++r) {
      shard_sequence(full, layout.positions(r), packed.view().slice0(r, r + 1).reshape(local.shape()));
      send_counts[r] = local.numel();
    }
  } else {
    packed = Tensor::empty({0}, local.dtype(), MemCategory::kCommBuffer);
  }
  comm.all_to_all_v(packed.view(), send_counts, local, recv_counts)->wait();
}

void gather_sequence(Communicator& comm, const SequenceLayout& layout, const TensorView& local, const TensorView& full,
                     int seq_dim) {
  SEQPAR_CHECK(comm.size() == layout.num_ranks(), "gather_sequence: communicator size ", comm.size(),
               " != layout ranks ", layout.num_ranks());
  SEQPAR_CHECK(seq_dim == 1 || seq_dim == 2, "gather_sequence: seq_dim ", seq_dim, " must be 1 or 2");
  const int n = comm.size();
  Shape s = local.shape();
  s.insert(s.begin(), n);
  Tensor all = Tensor::empty(s, local.dtype(), MemCategory::kCommBuffer);
  comm.all_gather(local, all.view())->wait();
  for (int r = 0; r < n; ++r) {
    const TensorView piece = all.view().slice0(r, r + 1).reshape(local.shape());
    if (seq_dim == 1) {
      unshard_sequence(piece, layout.positions(r), full);
    } else {
      unshard_sequence_bhs(piece, layout.positions(r), full);
    }
  }
}

}  // namespace seqpar
