#include "parallel/layout.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "runtime/tensor_ops.h"

namespace seqpar {

namespace {
constexpr const char* kLayoutNames[] = {"contiguous", "zigzag", "stripe", "balanced"};

using Positions = std::vector<std::int64_t>;
// The balanced kind's chunk unit: the key / query tile of the CPU attention kernels (attention/cpu/mha_cpu.h
// kBlockQ = kBlockK = 64).
constexpr std::int64_t kTileAlign = 64;

std::int64_t round_up(std::int64_t x, std::int64_t m) { return (x + m - 1) / m * m; }

void check_cu_seqlens(std::span<const std::int64_t> cu) {
  SEQPAR_CHECK(cu.size() >= 2, "cu_seqlens has ", cu.size(),
               " entries; it must have N+1 >= 2 (one more than the number of documents)");
  SEQPAR_CHECK(cu[0] == 0, "cu_seqlens[0] = ", cu[0], " must be 0");
  for (std::size_t i = 1; i < cu.size(); ++i) {
    SEQPAR_CHECK(cu[i] >= 0, "cu_seqlens[", i, "] = ", cu[i], " must be >= 0");
    SEQPAR_CHECK(cu[i] >= cu[i - 1], "cu_seqlens[", i, "] = ", cu[i], " < cu_seqlens[", i - 1, "] = ", cu[i - 1],
                 ": cu_seqlens must be non-decreasing");
  }
  SEQPAR_CHECK(cu.back() >= 1, "cu_seqlens ends at a total of ", cu.back(),
               " tokens; a row must hold at least one token");
}
// The cu_seqlens of one unpacked row of seq_len tokens.
Positions unpacked_cu_seqlens(std::int64_t seq_len) {
  SEQPAR_CHECK(seq_len >= 1, "seq_len ", seq_len, " must be >= 1");
  return {0, seq_len};
}
}  // namespace

const char* layout_name(LayoutKind kind) { return kLayoutNames[static_cast<int>(kind)]; }
LayoutKind parse_layout(std::string_view name) {
  return static_cast<LayoutKind>(parse_option_index(name, kLayoutNames, "layout"));
}

struct SequenceLayout::Data {
  bool packed = false;
  Positions cu, slot_cu;  // token space, slot space; [N+1]
  std::int64_t padded_len = 0;
  std::int64_t chunk_len = 0;
  std::vector<Positions> shards;  // slots of each ring shard, increasing
  std::vector<std::int64_t> work, step_work;
  double imbalance = 1.0, step_imbalance = 1.0;
  std::uint64_t digest = 0;
};

namespace {

// The balanced kind's chunks and the work between them. The unit is the kernels' tile (64 tokens) when chunks are
// whole tiles, else one token. A query unit u sees the key units [first(u), u], first(u) the unit of the start of the
// document of u's first token: for tiles these are the (query tile, key tile) pairs the kernels compute (the rows of
// every document in the tile see from their document's start to the tile itself), for tokens the causal pairs.
// pair[i n + j]: the units pairs (query unit in chunk i, key unit in chunk j) visible; n chunks.
struct ChunkPairs {
  std::int64_t n = 0;
  std::vector<std::int64_t> len, pair;
};
ChunkPairs chunk_pairs(std::span<const std::int64_t> cu, std::int64_t c) {
  const std::int64_t T = cu.back(), g = c % kTileAlign == 0 ? kTileAlign : 1, per_chunk = c / g;
  ChunkPairs cp;
  cp.n = (T + c - 1) / c;
  cp.pair.assign(static_cast<std::size_t>(cp.n * cp.n), 0);
  for (std::int64_t i = 0; i < cp.n; ++i) cp.len.push_back(std::min(T, (i + 1) * c) - i * c);
  std::size_t d = 0;  // the document of the unit's first token (zero-length documents skipped)
  for (std::int64_t u = 0; u * g < T; ++u) {
    while (cu[d + 1] <= u * g) ++d;
    const std::int64_t first = cu[d] / g, i = u / per_chunk;
    for (std::int64_t j = first / per_chunk; j <= i; ++j) {
      const std::int64_t lo = std::max(first, j * per_chunk), hi = std::min(u, (j + 1) * per_chunk - 1);
      cp.pair[static_cast<std::size_t>(i * cp.n + j)] += hi - lo + 1;
    }
  }
  return cp;
}

// sum over ring steps s of max over ring ranks r of work(r, s): R[r P + (r - s) mod P] when R holds rank x key rank
// (by_key_rank), else R[r P + s].
std::int64_t sum_of_step_max(const std::vector<std::int64_t>& R, int P, bool by_key_rank = true) {
  std::int64_t sum = 0;
  for (int s = 0; s < P; ++s) {
    std::int64_t most = 0;
    for (int r = 0; r < P; ++r) {
      most = std::max(most, R[static_cast<std::size_t>(r) * static_cast<std::size_t>(P) +
                              static_cast<std::size_t>(by_key_rank ? (r - s + P) % P : s)]);
    }
    sum += most;
  }
  return sum;
}

// The local search's objective: sum_s max_r work(r, s), then (ties) the sum of squares of every work(r, s), which
// rewards evening out the entries below a step's maximum, so that the search leaves plateaus of the first.
struct StepScore {
  std::int64_t sum_max;
  double sum_sq;
  bool operator<(const StepScore& o) const { return sum_max != o.sum_max ? sum_max < o.sum_max : sum_sq < o.sum_sq; }
};
StepScore step_score(const std::vector<std::int64_t>& R, int P) {
  double sq = 0;
  for (const std::int64_t w : R) sq += static_cast<double>(w) * static_cast<double>(w);
  return {sum_of_step_max(R, P), sq};
}

// Swaps of equal-length chunks between ring ranks that lower sum_s max_r work(r, s) (layout.h; StepScore), at most
// kPasses passes over the chunk pairs. A[i P + o]: chunk i's queries against rank o's keys; B[j P + q]: rank q's
// queries against chunk j's keys; R[a P + b]: rank a's queries against rank b's keys. Cost O(passes n^2 P^2).
void refine_steps(const ChunkPairs& cp, int P, std::vector<int>& owner) {
  constexpr int kPasses = 4;
  const std::int64_t n = cp.n;
  auto M = [&cp, n](std::int64_t i, std::int64_t j) { return cp.pair[static_cast<std::size_t>(i * n + j)]; };
  std::vector<std::int64_t> A(static_cast<std::size_t>(n * P), 0), B(A.size(), 0),
      R(static_cast<std::size_t>(P) * static_cast<std::size_t>(P));
  for (std::int64_t i = 0; i < n; ++i) {
    for (std::int64_t j = 0; j < n; ++j) {
      A[i * P + owner[j]] += M(i, j);
      B[j * P + owner[i]] += M(i, j);
      R[owner[i] * P + owner[j]] += M(i, j);
    }
  }
  // R after chunk x (its row a_row of A, column b_col of B) moves from rank a to rank b.
  auto move = [P](std::vector<std::int64_t>& r, std::vector<std::int64_t> a_row, std::vector<std::int64_t> b_col,
                  std::int64_t self, int a, int b) {
    for (int o = 0; o < P; ++o) {
      r[a * P + o] -= a_row[o];
      r[b * P + o] += a_row[o];
    }
    b_col[a] -= self;  // the chunk's own queries now sit on b
    b_col[b] += self;
    for (int q = 0; q < P; ++q) {
      r[q * P + a] -= b_col[q];
      r[q * P + b] += b_col[q];
    }
  };
  auto row = [P](const std::vector<std::int64_t>& v, std::int64_t i) {
    return std::vector<std::int64_t>(v.begin() + i * P, v.begin() + (i + 1) * P);
  };
  StepScore best = step_score(R, P);
  for (int pass = 0; pass < kPasses; ++pass) {
    bool improved = false;
    for (std::int64_t x = 0; x < n; ++x) {
      for (std::int64_t y = x + 1; y < n; ++y) {
        const int a = owner[x], b = owner[y];
        if (a == b || cp.len[x] != cp.len[y]) continue;
        std::vector<std::int64_t> trial = R;
        move(trial, row(A, x), row(B, x), M(x, x), a, b);
        std::vector<std::int64_t> ay = row(A, y), by = row(B, y);  // as seen after x moved
        ay[a] -= M(y, x);
        ay[b] += M(y, x);
        by[a] -= M(x, y);
        by[b] += M(x, y);
        move(trial, ay, by, M(y, y), b, a);
        const StepScore value = step_score(trial, P);
        if (!(value < best)) continue;
        best = value;
        R = std::move(trial);
        owner[x] = b;
        owner[y] = a;
        for (std::int64_t i = 0; i < n; ++i) {
          A[i * P + a] += M(i, y) - M(i, x);
          A[i * P + b] += M(i, x) - M(i, y);
          B[i * P + a] += M(y, i) - M(x, i);
          B[i * P + b] += M(x, i) - M(y, i);
        }
        improved = true;
      }
    }
    if (!improved) break;
  }
}

}  // namespace

std::int64_t balanced_chunk_len(std::int64_t seq_len, int ring_size) {
  SEQPAR_CHECK(seq_len >= 1 && ring_size >= 1, "balanced_chunk_len: seq_len ", seq_len, " and ring_size ", ring_size,
               " must be >= 1");
  const std::int64_t c = (seq_len + 32 * ring_size - 1) / (32 * ring_size);
  return c >= kTileAlign / 2 ? round_up(c, kTileAlign) : c;
}

std::vector<int> balanced_chunk_owners(std::span<const std::int64_t> cu_seqlens, int ring_size, bool refine) {
  check_cu_seqlens(cu_seqlens);
  SEQPAR_CHECK(ring_size >= 1, "balanced_chunk_owners: ring_size ", ring_size, " must be >= 1");
  const std::int64_t c = balanced_chunk_len(cu_seqlens.back(), ring_size);
  const ChunkPairs cp = chunk_pairs(cu_seqlens, c);
  std::vector<std::int64_t> chunk_work(static_cast<std::size_t>(cp.n), 0);
  for (std::int64_t i = 0; i < cp.n; ++i) {
    for (std::int64_t j = 0; j <= i; ++j) chunk_work[i] += cp.pair[static_cast<std::size_t>(i * cp.n + j)];
  }
  std::vector<std::int64_t> order(static_cast<std::size_t>(cp.n));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&chunk_work](std::int64_t x, std::int64_t y) { return chunk_work[x] > chunk_work[y]; });
  std::vector<std::int64_t> tokens(ring_size, 0), work(ring_size, 0);
  std::vector<int> owner(static_cast<std::size_t>(cp.n), 0);
  for (const std::int64_t i : order) {
    const std::int64_t least = *std::min_element(tokens.begin(), tokens.end());
    int best = -1;
    for (int r = 0; r < ring_size; ++r) {
      if (tokens[r] + cp.len[i] > least + c) continue;  // the rank with the fewest tokens always qualifies
      if (best < 0 || work[r] < work[best]) best = r;
    }
    tokens[best] += cp.len[i];
    work[best] += chunk_work[i];
    owner[i] = best;
  }
  if (refine && ring_size > 1) refine_steps(cp, ring_size, owner);
  return owner;
}

namespace {

// Kernel tile pairs per (ring rank r, ring step s), row-major [r P + s]: ring shard r's local rows against ring shard
// (r - s) mod P's, both cut into 64-row tiles, a pair counted when some query row sees some key row (same document,
// and when `causal` key slot <= query slot). The rows a query sees in a sorted key shard are one index range; over a
// tile's rows both ends increase, so the key tiles they touch are counted by one sweep. O(P padded_len).
std::vector<std::int64_t> ring_step_tiles(const SequenceLayout& layout, const std::vector<Positions>& shards,
                                          bool causal = true) {
  const int P = static_cast<int>(shards.size());
  std::vector<DocBounds> bounds;
  for (const Positions& s : shards) bounds.push_back(layout.doc_bounds_of_slots(s));
  // P * P in size_t: a ring of 2^16 ranks overflows int (the table was then empty and written out of bounds).
  std::vector<std::int64_t> tiles(static_cast<std::size_t>(P) * static_cast<std::size_t>(P), 0);
  for (int r = 0; r < P; ++r) {
    const Positions& q = shards[r];
    for (int s = 0; s < P; ++s) {
      const Positions& k = shards[(r - s + P) % P];
      std::int64_t& out = tiles[static_cast<std::size_t>(r) * static_cast<std::size_t>(P) + static_cast<std::size_t>(s)];
      std::size_t lb = 0, ub = 0;
      std::int64_t last = -1;  // the highest key tile counted for the current query tile
      for (std::size_t i = 0; i < q.size(); ++i) {
        if (i % kTileAlign == 0) last = -1;
        const std::int64_t lo = bounds[r].lo[i], hi = causal ? std::min(bounds[r].hi[i], q[i] + 1) : bounds[r].hi[i];
        if (lo >= hi) continue;  // padding row
        while (lb < k.size() && k[lb] < lo) ++lb;
        while (ub < k.size() && k[ub] < hi) ++ub;
        if (lb >= ub) continue;
        const std::int64_t t0 = std::max<std::int64_t>(lb / kTileAlign, last + 1), t1 = (ub - 1) / kTileAlign;
        if (t0 <= t1) out += t1 - t0 + 1;
        last = std::max(last, t1);
      }
    }
  }
  return tiles;
}

// sum_s max_r tiles / sum_s mean_r tiles of a ring_step_tiles table (1 when it holds no work).
double step_imbalance_of(const std::vector<std::int64_t>& tiles, int P) {
  const std::int64_t total = std::accumulate(tiles.begin(), tiles.end(), std::int64_t{0});
  return total > 0 ? static_cast<double>(sum_of_step_max(tiles, P, false)) * static_cast<double>(P) /
                         static_cast<double>(total)
                   : 1.0;
}

// The balanced kind's ring shards: each rank's chunks in row order.
std::vector<Positions> balanced_shards(const Positions& cu, int ring, std::int64_t c) {
  const std::vector<int> owner = balanced_chunk_owners(cu, ring, true);
  const std::int64_t T = cu.back(), n = static_cast<std::int64_t>(owner.size());
  std::vector<std::int64_t> tokens(ring, 0);
  for (std::int64_t i = 0; i < n; ++i) tokens[owner[i]] += std::min(T, (i + 1) * c) - i * c;
  std::vector<Positions> shards(ring);
  for (int r = 0; r < ring; ++r) shards[r].reserve(static_cast<std::size_t>(tokens[r]));  // a huge row fails at once
  for (std::int64_t i = 0; i < n; ++i) {
    for (std::int64_t t = i * c; t < std::min(T, (i + 1) * c); ++t) shards[owner[i]].push_back(t);
  }
  return shards;
}

}  // namespace

SequenceLayout::SequenceLayout(LayoutKind kind, std::int64_t seq_len, int ring_size, int ulysses_size)
    : SequenceLayout(kind, unpacked_cu_seqlens(seq_len), false, ring_size, ulysses_size) {}

SequenceLayout SequenceLayout::packed(LayoutKind kind, std::span<const std::int64_t> cu_seqlens, int ring_size,
                                      int ulysses_size) {
  check_cu_seqlens(cu_seqlens);
  return SequenceLayout(kind, Positions(cu_seqlens.begin(), cu_seqlens.end()), true, ring_size, ulysses_size);
}

SequenceLayout::SequenceLayout(LayoutKind kind, std::vector<std::int64_t> cu, bool packed, int ring_size,
                               int ulysses_size)
    : kind_(kind), ring_size_(ring_size), ulysses_size_(ulysses_size) {
  SEQPAR_CHECK(ring_size >= 1 && ulysses_size >= 1, "ring_size ", ring_size, " and ulysses_size ", ulysses_size,
               " must be >= 1");
  SEQPAR_CHECK(static_cast<int>(kind) < 4, "unknown layout kind ", static_cast<int>(kind));
  // A layout holds int64 positions per slot: far below this bound a row no longer fits in memory, and above it the
  // padding arithmetic could overflow (2^62 tokens used to end in std::length_error "vector::reserve").
  constexpr std::int64_t kMaxTokens = std::int64_t{1} << 48;
  SEQPAR_CHECK(cu.back() <= kMaxTokens, "seq_len ", cu.back(), " must be <= 2^48 = ", kMaxTokens,
               " (a layout holds an int64 position per slot)");
  auto data = std::make_shared<Data>();
  Data& d = *data;
  d.packed = packed;
  d.cu = std::move(cu);
  const std::int64_t T = d.cu.back(), P = ring_size, U = ulysses_size;
  const std::size_t N = d.cu.size() - 1;
  d.shards.assign(static_cast<std::size_t>(P), {});
  switch (kind) {
    case LayoutKind::kContiguous:
    case LayoutKind::kStripe: {
      d.slot_cu = d.cu;
      d.padded_len = round_up(T, P * U);
      const std::int64_t len = d.padded_len / P;
      for (std::int64_t r = 0; r < P; ++r) {
        d.shards[r].reserve(static_cast<std::size_t>(len));  // sized up front: a huge row fails at once
        for (std::int64_t i = 0; i < len; ++i) {
          d.shards[r].push_back(kind == LayoutKind::kContiguous ? r * len + i : i * P + r);
        }
      }
      break;
    }
    case LayoutKind::kZigzag: {
      d.slot_cu.assign(N + 1, 0);
      const std::int64_t unit = P == 1 ? 1 : 2 * P;  // a ring of one pads no document
      for (std::size_t k = 0; k < N; ++k) d.slot_cu[k + 1] = d.slot_cu[k] + round_up(d.cu[k + 1] - d.cu[k], unit);
      const std::int64_t docs_end = d.slot_cu[N];
      const std::int64_t extra = ((U - (docs_end / P) % U) % U);  // trailing padding slots per ring shard
      d.padded_len = docs_end + P * extra;
      for (std::int64_t r = 0; r < P; ++r) {
        Positions& shard = d.shards[r];
        shard.reserve(static_cast<std::size_t>(d.padded_len / P));
        if (P == 1) {
          for (std::int64_t i = 0; i < docs_end; ++i) shard.push_back(i);
        } else {
          for (std::size_t k = 0; k < N; ++k) {
            const std::int64_t chunk = (d.slot_cu[k + 1] - d.slot_cu[k]) / (2 * P);
            for (const std::int64_t c : {r, 2 * P - 1 - r}) {
              for (std::int64_t i = 0; i < chunk; ++i) shard.push_back(d.slot_cu[k] + c * chunk + i);
            }
          }
        }
        for (std::int64_t i = 0; i < extra; ++i) shard.push_back(docs_end + r * extra + i);
      }
      break;
    }
    case LayoutKind::kBalanced: {
      d.slot_cu = d.cu;
      // About 32 chunks per ring rank; from 32 tokens on, c is a multiple of the CPU kernels' tile (64), so that
      // every chunk but the row's last starts a rank's local tile and a tile never spans two chunks.
      d.chunk_len = balanced_chunk_len(T, ring_size);
      d.shards = balanced_shards(d.cu, ring_size, d.chunk_len);
      std::int64_t most = 0;
      for (const Positions& shard : d.shards) most = std::max<std::int64_t>(most, shard.size());
      const std::int64_t len = round_up(std::max<std::int64_t>(most, 1), U);
      d.padded_len = P * len;
      std::int64_t next_pad = T;
      for (Positions& shard : d.shards) {
        while (static_cast<std::int64_t>(shard.size()) < len) shard.push_back(next_pad++);
      }
      break;
    }
  }
  data_ = data;
  // Per-ring-rank causal work and the digest.
  d.work.assign(static_cast<std::size_t>(P), 0);
  for (std::int64_t r = 0; r < P; ++r) {
    for (const std::int64_t slot : d.shards[r]) {
      const std::int64_t k = doc_of_slot(slot);
      if (k >= 0) d.work[r] += slot - d.slot_cu[k] + 1;
    }
  }
  std::int64_t total = 0, most = 0;
  for (const std::int64_t w : d.work) {
    total += w;
    most = std::max(most, w);
  }
  d.imbalance = total > 0 ? static_cast<double>(most) * static_cast<double>(P) / static_cast<double>(total) : 1.0;
  d.step_work = ring_step_tiles(*this, d.shards);
  d.step_imbalance = step_imbalance_of(d.step_work, ring_size);
  std::uint64_t h = 1469598103934665603ULL;
  for (const std::int64_t v : d.cu) {
    for (int byte = 0; byte < 8; ++byte) {
      h ^= (static_cast<std::uint64_t>(v) >> (8 * byte)) & 0xffU;
      h *= 1099511628211ULL;
    }
  }
  d.digest = h;
}

std::int64_t SequenceLayout::seq_len() const { return data_->cu.back(); }
std::int64_t SequenceLayout::padded_len() const { return data_->padded_len; }
bool SequenceLayout::is_packed() const { return data_->packed; }
std::int64_t SequenceLayout::num_docs() const { return static_cast<std::int64_t>(data_->cu.size()) - 1; }
std::span<const std::int64_t> SequenceLayout::cu_seqlens() const { return data_->cu; }
std::span<const std::int64_t> SequenceLayout::slot_cu_seqlens() const { return data_->slot_cu; }
double SequenceLayout::flop_imbalance() const { return data_->imbalance; }
double SequenceLayout::step_imbalance() const { return data_->step_imbalance; }
const std::vector<std::int64_t>& SequenceLayout::step_work() const { return data_->step_work; }
const std::vector<std::int64_t>& SequenceLayout::ring_work() const { return data_->work; }
std::int64_t SequenceLayout::chunk_len() const { return data_->chunk_len; }
std::uint64_t SequenceLayout::cu_seqlens_digest() const { return data_->digest; }

std::int64_t SequenceLayout::doc_of_slot(std::int64_t slot) const {
  SEQPAR_CHECK(0 <= slot && slot < padded_len(), "slot ", slot, " outside [0, ", padded_len(), ")");
  const Positions& sc = data_->slot_cu;
  // The last document starting at or before the slot (zero-length documents start where the next one does).
  const std::int64_t k = std::upper_bound(sc.begin(), sc.end(), slot) - sc.begin() - 1;
  if (k >= num_docs()) return -1;  // trailing padding
  return slot - sc[k] < data_->cu[k + 1] - data_->cu[k] ? k : -1;
}

std::int64_t SequenceLayout::token_of_slot(std::int64_t slot) const {
  const std::int64_t k = doc_of_slot(slot);
  return k < 0 ? -1 : data_->cu[k] + slot - data_->slot_cu[k];
}

std::vector<std::int64_t> SequenceLayout::tokens_of_slots(std::span<const std::int64_t> slots) const {
  Positions out(slots.size());
  for (std::size_t i = 0; i < slots.size(); ++i) out[i] = token_of_slot(slots[i]);
  return out;
}

DocBounds SequenceLayout::doc_bounds_of_slots(std::span<const std::int64_t> slots) const {
  DocBounds b;
  b.lo.resize(slots.size());
  b.hi.resize(slots.size());
  for (std::size_t i = 0; i < slots.size(); ++i) {
    const std::int64_t k = doc_of_slot(slots[i]);
    b.lo[i] = k < 0 ? slots[i] : data_->slot_cu[k];
    b.hi[i] = k < 0 ? slots[i] : data_->slot_cu[k] + data_->cu[k + 1] - data_->cu[k];
  }
  return b;
}

std::vector<std::int64_t> SequenceLayout::rope_positions_of_slots(std::span<const std::int64_t> slots) const {
  Positions out(slots.size());
  for (std::size_t i = 0; i < slots.size(); ++i) {
    const std::int64_t k = doc_of_slot(slots[i]);
    out[i] = k < 0 ? 0 : slots[i] - data_->slot_cu[k];
  }
  return out;
}

std::vector<std::int64_t> SequenceLayout::token_index(int cp_rank) const { return tokens_of_slots(positions(cp_rank)); }
std::vector<std::int64_t> SequenceLayout::doc_index(int cp_rank) const {
  const Positions pos = positions(cp_rank);
  Positions out(pos.size());
  for (std::size_t i = 0; i < pos.size(); ++i) out[i] = doc_of_slot(pos[i]);
  return out;
}
DocBounds SequenceLayout::doc_bounds(int cp_rank) const { return doc_bounds_of_slots(positions(cp_rank)); }
std::vector<std::int64_t> SequenceLayout::rope_positions(int cp_rank) const {
  return rope_positions_of_slots(positions(cp_rank));
}

namespace {
constexpr const char* kDocDists[] = {"longtail", "short"};
}  // namespace

std::vector<std::int64_t> synthetic_doc_lens(std::string_view dist, std::int64_t total, std::uint64_t seed) {
  const int which = parse_option_index(dist, kDocDists, "document distribution");
  SEQPAR_CHECK(total >= 1, "synthetic_doc_lens: total ", total, " must be >= 1");
  const double lo = which == 0 ? 64.0 : 1.0, ratio = 256.0;  // [64, 16384] or [1, 256]
  std::uint64_t state = seed;
  auto next = [&state] {  // splitmix64 (Steele, Lea, Flood 2014)
    std::uint64_t z = (state += 0x9E3779B97F4A7C15ULL);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
  };
  Positions lens;
  for (std::int64_t sum = 0; sum < total;) {
    const double u = static_cast<double>(next() >> 11) * 0x1.0p-53;
    const std::int64_t len = std::min(total - sum, static_cast<std::int64_t>(lo * std::pow(ratio, u)));
    lens.push_back(len);
    sum += len;
  }
  return lens;
}

double step_imbalance_for_mask(const SequenceLayout& layout, bool causal) {
  if (causal) return layout.step_imbalance();
  std::vector<Positions> shards;
  for (int r = 0; r < layout.ring_size(); ++r) shards.push_back(layout.ring_shard_positions(r));
  return step_imbalance_of(ring_step_tiles(layout, shards, false), layout.ring_size());
}

std::vector<std::int64_t> cu_seqlens_of(std::span<const std::int64_t> doc_lens) {
  Positions cu{0};
  for (std::size_t i = 0; i < doc_lens.size(); ++i) {
    SEQPAR_CHECK(doc_lens[i] >= 0, "document length ", doc_lens[i], " (document ", i, ") must be >= 0");
    cu.push_back(cu.back() + doc_lens[i]);
  }
  return cu;
}

void add_layout_fields(Fingerprint& fp, const SequenceLayout& layout) {
  fp.add_text("layout", layout_name(layout.kind()))
      .add_int("seq_len", layout.seq_len())
      .add_int("padded_len", layout.padded_len())
      .add_int("ring_size", layout.ring_size())
      .add_int("ulysses_size", layout.ulysses_size());
  if (layout.is_packed()) {
    fp.add_int("num_docs", layout.num_docs())
        .add_int("cu_seqlens digest", static_cast<std::int64_t>(layout.cu_seqlens_digest()));
  }
}

SequenceLayout SequenceLayout::for_groups(const CpGroups& groups, std::int64_t seq_len, LayoutKind kind) {
  return SequenceLayout(kind, seq_len, groups.ring_size(), groups.ulysses_size());
}

SequenceLayout SequenceLayout::packed_for_groups(const CpGroups& groups, std::span<const std::int64_t> cu_seqlens,
                                                 LayoutKind kind) {
  return packed(kind, cu_seqlens, groups.ring_size(), groups.ulysses_size());
}

std::vector<std::int64_t> SequenceLayout::ring_shard_positions(int ring_rank) const {
  SEQPAR_CHECK(0 <= ring_rank && ring_rank < ring_size_, "ring_rank ", ring_rank, " outside [0, ", ring_size_, ")");
  return data_->shards[static_cast<std::size_t>(ring_rank)];
}

std::vector<std::int64_t> SequenceLayout::positions(int cp_rank) const {
  SEQPAR_CHECK(0 <= cp_rank && cp_rank < num_ranks(), "cp_rank ", cp_rank, " outside [0, ", num_ranks(), ")");
  const int ring_rank = cp_rank / ulysses_size_;
  const int ulysses_rank = cp_rank % ulysses_size_;
  const Positions& shard = data_->shards[static_cast<std::size_t>(ring_rank)];
  const std::int64_t len = local_len();
  return Positions(shard.begin() + ulysses_rank * len, shard.begin() + (ulysses_rank + 1) * len);
}

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

// The rows that hold tokens (tokens[i] >= 0) and those tokens, both in row order.
struct RealRows {
  Positions rows, tokens;
  bool all = true;  // no padding row
};
RealRows real_rows(std::span<const std::int64_t> tokens) {
  RealRows r;
  for (std::size_t i = 0; i < tokens.size(); ++i) {
    if (tokens[i] < 0) {
      r.all = false;
      continue;
    }
    r.rows.push_back(static_cast<std::int64_t>(i));
    r.tokens.push_back(tokens[i]);
  }
  return r;
}

// A buffer shaped like `local` with only the real rows along seq_dim.
Tensor real_rows_buffer(const DeviceAlloc& alloc, const TensorView& local, int seq_dim, const RealRows& r) {
  Shape s = local.shape();
  s[static_cast<std::size_t>(seq_dim)] = static_cast<std::int64_t>(r.rows.size());
  return alloc.empty(s, local.dtype(), MemCategory::kWorkspace);
}

void check_seq_dim(int seq_dim, const char* what) {
  SEQPAR_CHECK(seq_dim == 1 || seq_dim == 2, what, ": seq_dim ", seq_dim, " must be 1 or 2");
}

}  // namespace

void check_sequence_tensor(const SequenceLayout& layout, const TensorView& t, std::int64_t len, int seq_dim,
                           const char* what, const char* name) {
  SEQPAR_CHECK(t.ndim() > seq_dim, what, ": ", name, " ", t.str(), " has no sequence dimension ", seq_dim);
  SEQPAR_CHECK(!layout.is_packed() || t.dim(0) == 1, what, ": ", name, " ", t.str(), " has batch B = ", t.dim(0),
               "; a packed layout (cu_seqlens) takes B = 1");
  SEQPAR_CHECK(t.dim(seq_dim) == len, what, ": ", name, " ", t.str(), " has ", t.dim(seq_dim), " rows along dim ",
               seq_dim, "; the layout needs ", len,
               len == layout.seq_len() ? " (seq_len: the tokens of the row, cu_seqlens' last entry)"
                                       : " (local_len: padded_len / ranks)");
}

namespace {
// gather_token_rows (to_local) and scatter_token_rows: real rows move through a buffer of only those rows.
void copy_token_rows(const TensorView& full, const TensorView& local, int seq_dim, std::span<const std::int64_t> tokens,
                     bool to_local, Stream stream) {
  const RealRows r = real_rows(tokens);
  if (r.all) {
    to_local ? gather_rows(full, seq_dim, r.tokens, local, stream)
             : scatter_rows(local, seq_dim, r.tokens, full, stream);
    return;
  }
  const DeviceAlloc alloc{common_device({full, local}, to_local ? "gather_token_rows" : "scatter_token_rows"), stream};
  // Padding rows of a gathered piece become zero: zero the piece, then place the real rows.
  if (to_local) alloc.copy_convert(alloc.zeros(local.shape(), local.dtype(), MemCategory::kWorkspace).view(), local);
  if (r.rows.empty()) return;
  Tensor tmp = real_rows_buffer(alloc, local, seq_dim, r);
  if (to_local) {
    gather_rows(full, seq_dim, r.tokens, tmp.view(), stream);
    scatter_rows(tmp.view(), seq_dim, r.rows, local, stream);
  } else {
    gather_rows(local, seq_dim, r.rows, tmp.view(), stream);
    scatter_rows(tmp.view(), seq_dim, r.tokens, full, stream);
  }
}
}  // namespace

void gather_token_rows(const TensorView& full, int seq_dim, std::span<const std::int64_t> tokens,
                       const TensorView& local, Stream stream) {
  copy_token_rows(full, local, seq_dim, tokens, true, stream);
}

void scatter_token_rows(const TensorView& local, int seq_dim, std::span<const std::int64_t> tokens,
                        const TensorView& full, Stream stream) {
  copy_token_rows(full, local, seq_dim, tokens, false, stream);
}

namespace {
// The checks of shard_sequence / unshard_sequence (`what`).
void check_shard_args(const SequenceLayout& layout, const TensorView& full, const TensorView& local, int seq_dim,
                      const char* what) {
  check_seq_dim(seq_dim, what);
  check_sequence_tensor(layout, full, layout.seq_len(), seq_dim, what, "full");
  check_sequence_tensor(layout, local, layout.local_len(), seq_dim, what, "local");
}
}  // namespace

void shard_sequence(const SequenceLayout& layout, int cp_rank, const TensorView& full, const TensorView& local,
                    int seq_dim, Stream stream) {
  check_shard_args(layout, full, local, seq_dim, "shard_sequence");
  gather_token_rows(full, seq_dim, layout.token_index(cp_rank), local, stream);
}

void unshard_sequence(const SequenceLayout& layout, int cp_rank, const TensorView& local, const TensorView& full,
                      int seq_dim, Stream stream) {
  check_shard_args(layout, full, local, seq_dim, "unshard_sequence");
  scatter_token_rows(local, seq_dim, layout.token_index(cp_rank), full, stream);
}

namespace {

// What root's `full` is, for the agreement record: "as local" when it has local's dtype, device and trailing shape
// with seq_len rows along seq_dim, else its description and the expected one.
std::string root_full_status(const SequenceLayout& layout, const TensorView& local, const TensorView& full,
                             int seq_dim) {
  Shape want = local.shape();
  if (seq_dim >= 0 && seq_dim < static_cast<int>(want.size()))
    want[static_cast<std::size_t>(seq_dim)] = layout.seq_len();
  if (full.dtype() == local.dtype() && full.shape() == want && full.device() == local.device()) return "as local";
  return str_cat(full.str(), ", expected ", dtype_name(local.dtype()), shape_str(want), " on local's device");
}

// The ranks' agreement check of a sequence collective (docs/design.md, "Agreement of the ranks"), before any data
// moves: the layout, seq_dim, root, local's dtype / shape / device and (gather_sequence) full's, and root's `full`
// as root sees it (scatter_sequence, gather_sequence_to_root). Runs on every call unless SEQPAR_AGREEMENT_CHECK=off.
void agree_on_sequence_call(Communicator& comm, const SequenceLayout& layout, const TensorView& local,
                            const TensorView& full, int seq_dim, int root, bool full_on_root_only, const char* what,
                            Stream stream) {
  Fingerprint fp(what);
  add_layout_fields(fp, layout);
  fp.add_int("seq_dim", seq_dim);
  if (full_on_root_only) {
    fp.add_int("root", root);
    fp.add_tensor("local", local);
    fp.add_text("root's full", comm.rank() == root ? root_full_status(layout, local, full, seq_dim) : "as local");
  } else {
    fp.add_tensor("local", local).add_tensor("full", full);
  }
  AgreementCheck().run(comm, fp, stream);
}

void check_gather(const Communicator& comm, const SequenceLayout& layout, const TensorView& local, int seq_dim,
                  const char* what) {
  SEQPAR_CHECK(comm.size() == layout.num_ranks(), what, ": communicator size ", comm.size(), " != layout ranks ",
               layout.num_ranks());
  check_seq_dim(seq_dim, what);
  check_sequence_tensor(layout, local, layout.local_len(), seq_dim, what, "local");
}

// The pieces of every CP rank, [n, local shape] in rank order, written to their tokens in `full`.
void unshard_pieces(const SequenceLayout& layout, const TensorView& all, const Shape& local_shape,
                    const TensorView& full, int seq_dim, Stream stream) {
  for (int r = 0; r < layout.num_ranks(); ++r) {
    unshard_sequence(layout, r, all.slice0(r, r + 1).reshape(local_shape), full, seq_dim, stream);
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
  agree_on_sequence_call(comm, layout, local, full, 1, root, true, "scatter_sequence", stream);
  check_gather(comm, layout, local, 1, "scatter_sequence");
  const int n = comm.size();
  // Root packs every rank's piece in rank order, then an all_to_all_v with zero counts elsewhere delivers them.
  const DeviceAlloc alloc{common_device({full, local}, "scatter_sequence"), stream};
  Tensor packed;
  std::vector<std::int64_t> send_counts(n, 0), recv_counts(n, 0);
  recv_counts[root] = local.numel();
  if (comm.rank() == root) {
    packed = alloc.empty(per_rank_shape(n, local.shape()), local.dtype(), MemCategory::kCommBuffer);
    for (int r = 0; r < n; ++r) {
      shard_sequence(layout, r, full, packed.view().slice0(r, r + 1).reshape(local.shape()), 1, stream);
      send_counts[r] = local.numel();
    }
  } else {
    packed = alloc.empty({0}, local.dtype(), MemCategory::kCommBuffer);
  }
  comm.all_to_all_v(packed.view(), send_counts, local, recv_counts)->wait();
}

void gather_sequence(Communicator& comm, const SequenceLayout& layout, const TensorView& local, const TensorView& full,
                     int seq_dim, Stream stream) {
  agree_on_sequence_call(comm, layout, local, full, seq_dim, 0, false, "gather_sequence", stream);
  check_gather(comm, layout, local, seq_dim, "gather_sequence");
  const DeviceAlloc alloc{common_device({local, full}, "gather_sequence"), stream};
  Tensor all = alloc.empty(per_rank_shape(comm.size(), local.shape()), local.dtype(), MemCategory::kCommBuffer);
  comm.all_gather(local, all.view())->wait();
  unshard_pieces(layout, all.view(), local.shape(), full, seq_dim, stream);
}

void gather_sequence_to_root(Communicator& comm, const SequenceLayout& layout, const TensorView& local,
                             const TensorView& full, int root, int seq_dim, Stream stream) {
  agree_on_sequence_call(comm, layout, local, full, seq_dim, root, true, "gather_sequence_to_root", stream);
  check_gather(comm, layout, local, seq_dim, "gather_sequence_to_root");
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

namespace {
const SequenceLayout& checked_layout(const CpGroups& groups, const SequenceLayout& layout, const char* layer) {
  check_layout_matches(groups, layout, layer);
  return layout;
}
}  // namespace

CpLayerBase::CpLayerBase(const CpGroups& groups, const SequenceLayout& layout, const char* layer)
    : groups_(groups), layout_(checked_layout(groups, layout, layer)), positions_(layout.positions(groups.cp_rank())) {}

Fingerprint CpLayerBase::fingerprint(std::string_view call) const {
  Fingerprint fp(call);
  add_layout_fields(fp, layout_);
  return fp;
}

}  // namespace seqpar
