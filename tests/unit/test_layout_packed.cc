// Sequence layouts with padding and packed documents (parallel/layout.h, docs/design.md, "Packed rows and padding"): slots, the
// token / document / RoPE accessors, cu_seqlens validation and the balanced partitioner. Every property is checked
// against an independent rule written here (the token order of a document, the chunk arithmetic, a direct work sum).
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <set>

#include "parallel/layout.h"

namespace seqpar {
namespace {

constexpr LayoutKind kKinds[] = {LayoutKind::kContiguous, LayoutKind::kZigzag, LayoutKind::kStripe,
                                 LayoutKind::kBalanced};

std::string describe(const SequenceLayout& l) {
  return str_cat(layout_name(l.kind()), " T=", l.seq_len(), " docs=", l.num_docs(), " ring=", l.ring_size(),
                 " uly=", l.ulysses_size());
}

// Every invariant of the slot contract, checked from the outside:
// - the ring shards partition [0, padded_len) into equal, increasing pieces; the Ulysses pieces concatenate to them;
// - every token appears at exactly one slot, the others are padding;
// - inside a document, slots and tokens advance together (slot - doc slot start = token - cu[d]);
// - doc bounds, RoPE positions and doc ids agree with cu_seqlens.
void check_contract(const SequenceLayout& l) {
  SCOPED_TRACE(describe(l));
  const std::int64_t T = l.seq_len(), padded = l.padded_len();
  const auto cu = l.cu_seqlens();
  ASSERT_GE(padded, T);
  ASSERT_EQ(padded % l.num_ranks(), 0);
  std::set<std::int64_t> slots;
  std::vector<int> token_seen(static_cast<std::size_t>(T), 0);
  for (int r = 0; r < l.ring_size(); ++r) {
    const auto shard = l.ring_shard_positions(r);
    ASSERT_EQ(static_cast<std::int64_t>(shard.size()), l.ring_shard_len());
    for (std::size_t i = 1; i < shard.size(); ++i) ASSERT_LT(shard[i - 1], shard[i]);
    std::vector<std::int64_t> joined;
    for (int u = 0; u < l.ulysses_size(); ++u) {
      const int sp = r * l.ulysses_size() + u;
      const auto pos = l.positions(sp);
      ASSERT_EQ(static_cast<std::int64_t>(pos.size()), l.local_len());
      joined.insert(joined.end(), pos.begin(), pos.end());
      const auto tok = l.token_index(sp);
      const auto doc = l.doc_index(sp);
      const auto rope = l.rope_positions(sp);
      const DocBounds b = l.doc_bounds(sp);
      for (std::size_t i = 0; i < pos.size(); ++i) {
        if (tok[i] < 0) {
          EXPECT_EQ(doc[i], -1);
          EXPECT_EQ(rope[i], 0);
          EXPECT_EQ(b.lo[i], b.hi[i]) << "a padding row sees no key";
          continue;
        }
        ASSERT_LT(tok[i], T);
        ++token_seen[static_cast<std::size_t>(tok[i])];
        const std::int64_t d = std::upper_bound(cu.begin(), cu.end(), tok[i]) - cu.begin() - 1;
        EXPECT_EQ(doc[i], d);
        EXPECT_EQ(rope[i], tok[i] - cu[d]);
        EXPECT_EQ(b.hi[i] - b.lo[i], cu[d + 1] - cu[d]);
        EXPECT_EQ(pos[i] - b.lo[i], tok[i] - cu[d]);
        EXPECT_EQ(b.lo[i], l.slot_cu_seqlens()[d]);
      }
    }
    EXPECT_EQ(joined, shard);
    slots.insert(shard.begin(), shard.end());
  }
  EXPECT_EQ(static_cast<std::int64_t>(slots.size()), padded);
  EXPECT_EQ(*slots.begin(), 0);
  EXPECT_EQ(*slots.rbegin(), padded - 1);
  for (std::int64_t t = 0; t < T; ++t) ASSERT_EQ(token_seen[t], 1) << "token " << t;
  EXPECT_GE(l.flop_imbalance(), 1.0);
}

TEST(LayoutPadding, AnyLengthOnAnyGrid) {
  for (LayoutKind kind : kKinds) {
    for (int ring : {1, 2, 3, 4, 8}) {
      for (int uly : {1, 2, 4}) {
        for (std::int64_t S : {1, 2, 3, 7, 12, 197, 1000}) check_contract(SequenceLayout(kind, S, ring, uly));
      }
    }
  }
  check_contract(SequenceLayout(LayoutKind::kZigzag, 8191, 4, 1));
  check_contract(SequenceLayout(LayoutKind::kZigzag, 8191, 2, 2));
  // 8191 on a ring of 4 (zigzag): one document padded at its end to 8192, eight chunks of 1024.
  const SequenceLayout z(LayoutKind::kZigzag, 8191, 4, 1);
  EXPECT_EQ(z.padded_len(), 8192);
  EXPECT_EQ(z.local_len(), 2048);
  EXPECT_EQ(z.token_index(0).back(), -1);  // the padding slot ends chunk 7, which rank 0 holds
  for (int r = 1; r < 4; ++r) EXPECT_EQ(z.token_index(r), z.positions(r));
  // A sequence shorter than the ranks: every rank works, most hold only padding.
  const SequenceLayout tiny(LayoutKind::kContiguous, 3, 8, 1);
  EXPECT_EQ(tiny.padded_len(), 8);
  EXPECT_EQ(tiny.token_index(5), std::vector<std::int64_t>{-1});
}

// Lengths that divide as each kind always needed give today's layout: no padding, the old positions.
TEST(LayoutPadding, DivisibleLengthsKeepTheUnpaddedLayout) {
  for (int ring : {1, 2, 3, 4}) {
    for (int uly : {1, 2, 3}) {
      const std::int64_t S = 2 * ring * uly * 5;
      for (LayoutKind kind : {LayoutKind::kContiguous, LayoutKind::kZigzag, LayoutKind::kStripe}) {
        const SequenceLayout l(kind, S, ring, uly);
        EXPECT_EQ(l.padded_len(), S);
        EXPECT_FALSE(l.has_padding());
        for (int r = 0; r < l.num_ranks(); ++r) EXPECT_EQ(l.token_index(r), l.positions(r));
      }
      // Zigzag: chunk r then chunk 2P-1-r of S/(2P) tokens.
      const SequenceLayout z(LayoutKind::kZigzag, S, ring, uly);
      for (int r = 0; r < ring; ++r) {
        const auto shard = z.ring_shard_positions(r);
        const std::int64_t c = S / (2 * ring);
        EXPECT_EQ(shard.front(), ring == 1 ? 0 : r * c);
        EXPECT_EQ(shard.back(), ring == 1 ? S - 1 : (2 * ring - r) * c - 1);
      }
    }
  }
  // A ring of one takes any length with zigzag, as before (odd lengths included).
  EXPECT_FALSE(SequenceLayout(LayoutKind::kZigzag, 197, 1, 1).has_padding());
}

TEST(LayoutPacked, DocumentsOfEveryShape) {
  const std::vector<std::vector<std::int64_t>> mixes = {
      {5},                        // one document
      {1, 1, 1, 1, 1, 1, 1},      // all of length 1
      {0, 3, 0, 0, 2, 0},         // zero-length documents, some shorter than the ranks
      {1, 100, 1, 2, 50, 3, 40},  // long and short
      {197},
      {8191},
      {4096, 4095},
  };
  for (const auto& lens : mixes) {
    const auto cu = cu_seqlens_of(lens);
    for (LayoutKind kind : kKinds) {
      for (int ring : {1, 2, 3, 4, 8}) {
        for (int uly : {1, 2}) {
          const SequenceLayout l = SequenceLayout::packed(kind, cu, ring, uly);
          EXPECT_TRUE(l.is_packed());
          EXPECT_EQ(l.num_docs(), static_cast<std::int64_t>(lens.size()));
          check_contract(l);
        }
      }
    }
  }
  // Zigzag per document: each document padded to a multiple of 2P and cut into 2P chunks, rank r taking chunks r and
  // 2P-1-r (TransformerEngine's THD layout).
  const std::vector<std::int64_t> cu = {0, 5, 21};
  const SequenceLayout z = SequenceLayout::packed(LayoutKind::kZigzag, cu, 2, 1);
  EXPECT_EQ(std::vector<std::int64_t>(z.slot_cu_seqlens().begin(), z.slot_cu_seqlens().end()),
            (std::vector<std::int64_t>{0, 8, 24}));
  EXPECT_EQ(z.ring_shard_positions(0), (std::vector<std::int64_t>{0, 1, 6, 7, 8, 9, 10, 11, 20, 21, 22, 23}));
  EXPECT_EQ(z.token_index(0), (std::vector<std::int64_t>{0, 1, -1, -1, 5, 6, 7, 8, 17, 18, 19, 20}));
  EXPECT_EQ(z.rope_positions(1), (std::vector<std::int64_t>{2, 3, 4, 0, 4, 5, 6, 7, 8, 9, 10, 11}));
}

TEST(LayoutPacked, BadCuSeqlensNameTheRule) {
  auto message = [](std::vector<std::int64_t> cu) {
    try {
      SequenceLayout::packed(LayoutKind::kZigzag, cu, 2, 1);
    } catch (const Error& e) {
      return e.message();
    }
    return std::string("no error");
  };
  EXPECT_EQ(message({0, 4, 3}), "cu_seqlens[2] = 3 < cu_seqlens[1] = 4: cu_seqlens must be non-decreasing");
  EXPECT_EQ(message({1, 4}), "cu_seqlens[0] = 1 must be 0");
  EXPECT_EQ(message({0, -2, 4}), "cu_seqlens[1] = -2 must be >= 0");
  EXPECT_EQ(message({0}), "cu_seqlens has 1 entries; it must have N+1 >= 2 (one more than the number of documents)");
  EXPECT_EQ(message({0, 0, 0}), "cu_seqlens ends at a total of 0 tokens; a row must hold at least one token");
  EXPECT_EQ(message({0, 0, 3, 3}), "no error");
  EXPECT_THROW(SequenceLayout(LayoutKind::kZigzag, 0, 2, 1), Error);
  EXPECT_THROW(parse_layout("balance"), Error);
  EXPECT_EQ(parse_layout("balanced"), LayoutKind::kBalanced);
  // Different cu_seqlens of the same total give different digests (the agreement check's field).
  EXPECT_NE(SequenceLayout::packed(LayoutKind::kZigzag, std::vector<std::int64_t>{0, 2, 8}, 2).cu_seqlens_digest(),
            SequenceLayout::packed(LayoutKind::kZigzag, std::vector<std::int64_t>{0, 3, 8}, 2).cu_seqlens_digest());
}

// The causal work of ring rank r, summed here token by token: sum over held tokens of (offset in document + 1).
std::vector<double> work_per_ring_rank(const SequenceLayout& l) {
  std::vector<double> w(static_cast<std::size_t>(l.ring_size()), 0.0);
  const auto cu = l.cu_seqlens();
  for (int r = 0; r < l.ring_size(); ++r) {
    for (int u = 0; u < l.ulysses_size(); ++u) {
      for (const std::int64_t t : l.token_index(r * l.ulysses_size() + u)) {
        if (t < 0) continue;
        const std::int64_t d = std::upper_bound(cu.begin(), cu.end(), t) - cu.begin() - 1;
        w[r] += static_cast<double>(t - cu[d] + 1);
      }
    }
  }
  return w;
}

double imbalance(const std::vector<double>& w) {
  return *std::max_element(w.begin(), w.end()) * static_cast<double>(w.size()) /
         std::accumulate(w.begin(), w.end(), 0.0);
}

// Balanced chunks are whole 64-token tiles of the row: inside every 64-row tile of a ring shard the token slots are
// consecutive (one piece of the row), so a tile of local queries or keys never spans two chunks and the kernels' tile
// classification on a rank is the one-device call's (docs/design.md, "The balanced partitioner").
TEST(LayoutBalanced, ChunksAreWholeTilesOfTheRow) {
  for (int ring : {2, 3, 4, 8}) {
    for (std::uint64_t seed : {1234u, 7u}) {
      const auto cu = cu_seqlens_of(synthetic_doc_lens("longtail", 32768, seed));
      const SequenceLayout b = SequenceLayout::packed(LayoutKind::kBalanced, cu, ring, 1);
      SCOPED_TRACE(str_cat(describe(b), " seed ", seed));
      EXPECT_EQ(b.chunk_len() % 64, 0);
      for (int r = 0; r < ring; ++r) {
        const auto pos = b.ring_shard_positions(r);
        for (std::size_t i = 1; i < pos.size(); ++i) {
          if (i % 64 != 0 && pos[i] < b.seq_len()) {  // (the trailing padding slots carry no token)
            ASSERT_EQ(pos[i], pos[i - 1] + 1) << "ring rank " << r << " local row " << i;
          }
        }
      }
    }
  }
  // Short rows keep small chunks (c = ceil(T / 32P) below 32 is not rounded).
  const std::vector<std::int64_t> short_lens = {100, 97};
  EXPECT_EQ(SequenceLayout::packed(LayoutKind::kBalanced, cu_seqlens_of(short_lens), 2, 1).chunk_len(), 4);
}

// The partitioner on the documented long-tailed mix (32K tokens, lengths 64..16K): FLOP imbalance <= 1.05 for every
// seed and ring size, tokens per ring rank equal within one chunk; the contiguous split of the same rows is far worse.
TEST(LayoutBalanced, LongTailedMixIsBalanced) {
  for (int ring : {2, 3, 4, 8}) {
    double contiguous_sum = 0;
    const int seeds = 10;
    for (std::uint64_t seed = 0; seed < seeds; ++seed) {
      const auto lens = synthetic_doc_lens("longtail", 32768, seed);
      ASSERT_EQ(std::accumulate(lens.begin(), lens.end(), std::int64_t{0}), 32768);
      for (std::int64_t len : lens) ASSERT_LE(len, 16384);
      const auto cu = cu_seqlens_of(lens);
      const SequenceLayout b = SequenceLayout::packed(LayoutKind::kBalanced, cu, ring, 1);
      SCOPED_TRACE(str_cat(describe(b), " seed ", seed));
      check_contract(b);
      const auto w = work_per_ring_rank(b);
      EXPECT_NEAR(b.flop_imbalance(), imbalance(w), 1e-12);
      EXPECT_LE(b.flop_imbalance(), 1.05);
      std::int64_t most = 0, least = b.seq_len();
      for (int r = 0; r < ring; ++r) {
        const auto tok = b.token_index(r);
        const std::int64_t n = std::count_if(tok.begin(), tok.end(), [](std::int64_t t) { return t >= 0; });
        most = std::max(most, n);
        least = std::min(least, n);
      }
      EXPECT_LE(most - least, b.chunk_len());
      const SequenceLayout c = SequenceLayout::packed(LayoutKind::kContiguous, cu, ring, 1);
      EXPECT_NEAR(c.flop_imbalance(), imbalance(work_per_ring_rank(c)), 1e-12);
      contiguous_sum += c.flop_imbalance();
    }
    if (ring == 8) {
      EXPECT_GT(contiguous_sum / seeds, 1.5) << "the contiguous split of the mix is badly imbalanced";
    }
  }
  // Zigzag per document pairs early and late chunks: equal work on every rank when no document needs padding.
  const std::vector<std::int64_t> cu = {0, 16, 24, 88};
  EXPECT_DOUBLE_EQ(SequenceLayout::packed(LayoutKind::kZigzag, cu, 4, 1).flop_imbalance(), 1.0);
  EXPECT_THROW(synthetic_doc_lens("pareto", 100, 0), Error);
}

// Tile pairs per (ring rank r, ring step s), pair by pair: ring shard r's and ring shard (r - s) mod P's local rows
// cut into 64-row tiles, a pair counted when one (query, key) row pair shares a document with key slot <= query
// slot. `doc` maps a slot to its document or -1.
template <typename DocOf>
std::vector<std::int64_t> brute_step_work(const std::vector<std::vector<std::int64_t>>& shards, const DocOf& doc) {
  const int P = static_cast<int>(shards.size());
  std::vector<std::vector<std::int64_t>> docs;
  for (const auto& shard : shards) {
    docs.emplace_back();
    for (const std::int64_t slot : shard) docs.back().push_back(doc(slot));
  }
  std::vector<std::int64_t> w(static_cast<std::size_t>(P * P), 0);
  for (int r = 0; r < P; ++r) {
    for (int s = 0; s < P; ++s) {
      const auto& q = shards[r];
      const auto& k = shards[(r - s + P) % P];
      const auto& dq = docs[r];
      const auto& dk = docs[(r - s + P) % P];
      for (std::size_t q0 = 0; q0 < q.size(); q0 += 64) {
        for (std::size_t k0 = 0; k0 < k.size(); k0 += 64) {
          bool seen = false;
          for (std::size_t i = q0; i < std::min(q.size(), q0 + 64) && !seen; ++i) {
            for (std::size_t j = k0; j < std::min(k.size(), k0 + 64) && !seen; ++j) {
              seen = k[j] <= q[i] && dq[i] >= 0 && dq[i] == dk[j];
            }
          }
          w[r * P + s] += seen ? 1 : 0;
        }
      }
    }
  }
  return w;
}

// sum_s max_r w / sum_s mean_r w of a [P * P] per-(rank, step) table.
double step_figure(const std::vector<std::int64_t>& w, int P) {
  double sum_max = 0, sum = 0;
  for (int s = 0; s < P; ++s) {
    std::int64_t most = 0;
    for (int r = 0; r < P; ++r) {
      most = std::max(most, w[r * P + s]);
      sum += static_cast<double>(w[r * P + s]);
    }
    sum_max += static_cast<double>(most);
  }
  return sum_max * P / sum;
}

// step_work() against the pair-by-pair count for every kind (padding and Ulysses included), and the balanced kind's
// per-step figure against the greedy assignment alone (balanced_chunk_owners(..., false)): the local search never
// makes it worse, keeps the token counts, and the layout holds exactly the refined chunks.
TEST(LayoutBalanced, StepWorkMatchesPairByPairAndBeatsTheGreedy) {
  for (const std::uint64_t seed : {3u, 1234u}) {
    const auto cu = cu_seqlens_of(synthetic_doc_lens("longtail", 6000 + static_cast<std::int64_t>(seed), seed));
    for (int ring : {2, 3, 4}) {
      for (const LayoutKind kind : kKinds) {
        for (int uly : {1, 2}) {
          const SequenceLayout l = SequenceLayout::packed(kind, cu, ring, uly);
          SCOPED_TRACE(str_cat(describe(l), " seed ", seed));
          std::vector<std::vector<std::int64_t>> shards;
          for (int r = 0; r < ring; ++r) shards.push_back(l.ring_shard_positions(r));
          const auto doc = [&l](std::int64_t slot) { return l.doc_of_slot(slot); };
          const auto expect = brute_step_work(shards, doc);
          ASSERT_EQ(l.step_work(), expect);
          EXPECT_NEAR(l.step_imbalance(), step_figure(expect, ring), 1e-12);
          EXPECT_GE(l.step_imbalance(), 1.0);
        }
      }
      const SequenceLayout b = SequenceLayout::packed(LayoutKind::kBalanced, cu, ring, 1);
      const std::int64_t c = b.chunk_len(), T = cu.back();
      ASSERT_EQ(c, balanced_chunk_len(T, ring));
      for (const bool refine : {false, true}) {
        const std::vector<int> owner = balanced_chunk_owners(cu, ring, refine);
        ASSERT_EQ(static_cast<std::int64_t>(owner.size()), (T + c - 1) / c);
        std::vector<std::vector<std::int64_t>> shards(ring);
        for (std::size_t i = 0; i < owner.size(); ++i) {
          for (std::int64_t t = static_cast<std::int64_t>(i) * c; t < std::min<std::int64_t>(T, (i + 1) * c); ++t) {
            shards[owner[i]].push_back(t);
          }
        }
        std::size_t most = 0, least = T;
        for (const auto& s : shards) most = std::max(most, s.size()), least = std::min(least, s.size());
        EXPECT_LE(static_cast<std::int64_t>(most - least), c);
        const auto doc = [&cu](std::int64_t t) -> std::int64_t {
          if (t >= cu.back()) return -1;
          return std::upper_bound(cu.begin(), cu.end(), t) - cu.begin() - 1;
        };
        const double figure = step_figure(brute_step_work(shards, doc), ring);
        if (refine) {
          for (int r = 0; r < ring; ++r) {
            const auto pos = b.ring_shard_positions(r);
            EXPECT_EQ(std::vector<std::int64_t>(pos.begin(), pos.begin() + shards[r].size()), shards[r]);
          }
          EXPECT_NEAR(b.step_imbalance(), figure, 1e-12);
        } else {
          EXPECT_LE(b.step_imbalance(), figure + 1e-12) << "the local search made the ring steps less even";
        }
      }
    }
  }
}

// step_imbalance_for_mask against closed forms on one unpacked row of S = 64 m P tokens (m tiles a ring shard):
// without the causal mask every (rank, step) entry is m^2 tile pairs whatever the kind, so the figure is 1; with it,
// contiguous shards give each rank m (m + 1) / 2 at step 0 and at step s >= 1 m^2 on ranks r >= s (the earlier
// shards' keys), 0 on the others: P (m (m + 1) / 2 + (P - 1) m^2) / (P m (m + 1) / 2 + m^2 P (P - 1) / 2). The causal
// form is the layout's own step_imbalance().
TEST(LayoutStepImbalance, ForTheMaskAgainstClosedForms) {
  for (int P : {1, 2, 3, 4}) {
    for (std::int64_t m : {1, 2, 3}) {
      for (LayoutKind kind : {LayoutKind::kContiguous, LayoutKind::kZigzag, LayoutKind::kStripe}) {
        const SequenceLayout l(kind, 64 * m * P, P);
        SCOPED_TRACE(str_cat(describe(l), " m=", m));
        EXPECT_NEAR(step_imbalance_for_mask(l, false), 1.0, 1e-12);
        EXPECT_EQ(step_imbalance_for_mask(l, true), l.step_imbalance());
      }
      const double Pd = P, md = static_cast<double>(m), tri = md * (md + 1) / 2;
      const double want = Pd * (tri + (Pd - 1) * md * md) / (Pd * tri + md * md * Pd * (Pd - 1) / 2);
      EXPECT_NEAR(step_imbalance_for_mask(SequenceLayout(LayoutKind::kContiguous, 64 * m * P, P), true), want, 1e-12)
          << "P=" << P << " m=" << m;
    }
  }
}

}  // namespace
}  // namespace seqpar
