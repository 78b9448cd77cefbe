// The attention blocks of every layout's ring steps, all-gather calls and packed rows, for kernel tests that run one
// block at a time (lowered execution, the fallback driver): query and key positions of each (rank, source) pair of
// a ring of each size in `rings`, S 37 unpadded or a packed row of documents {13, 1, 0, 7, 20}.
#pragma once

#include <string>
#include <vector>

#include "parallel/layout.h"

namespace seqpar {

struct RingBlock {
  std::string name;
  std::vector<std::int64_t> q_pos, k_pos;
  DocBounds bounds;  // empty: no document bounds
};

inline std::vector<RingBlock> ring_blocks(const std::vector<int>& rings) {
  std::vector<RingBlock> v;
  for (LayoutKind kind : {LayoutKind::kContiguous, LayoutKind::kZigzag, LayoutKind::kStripe, LayoutKind::kBalanced}) {
    for (int ring : rings) {
      for (bool packed : {false, true}) {
        const std::vector<std::int64_t> docs = {13, 1, 0, 7, 20};
        const SequenceLayout layout =
            packed ? SequenceLayout::packed(kind, cu_seqlens_of(docs), ring) : SequenceLayout(kind, 37, ring);
        const bool bounded = layout.is_packed() || layout.has_padding();
        std::vector<std::int64_t> all(static_cast<std::size_t>(layout.padded_len()));
        for (std::int64_t t = 0; t < layout.padded_len(); ++t) all[static_cast<std::size_t>(t)] = t;
        const std::string base =
            std::string(layout_name(kind)) + (packed ? " packed" : " S37") + " ring " + std::to_string(ring);
        for (int r = 0; r < ring; ++r) {
          const std::vector<std::int64_t> q = layout.ring_shard_positions(r);
          const DocBounds b = bounded ? layout.doc_bounds_of_slots(q) : DocBounds{};
          for (int src = 0; src < ring; ++src)
            v.push_back({base + " rank " + std::to_string(r) + " src " + std::to_string(src), q,
                         layout.ring_shard_positions(src), b});
          v.push_back({base + " rank " + std::to_string(r) + " all-gather", q, all, b});
        }
      }
    }
  }
  return v;
}

}  // namespace seqpar
