// Model FLOPs of the DSA and GDN kernels (docs/benchmarks.md, "Definitions of the benchmark figures"), one definition for sp_bench (sp_bench_dsa.cc,
// sp_bench_gdn.cc) and kernel_bench (kernel_bench_dsa.cc, kernel_bench_gdn.cc). Model FLOPs count the useful
// multiply-adds (2 per pair) of the algorithm, not what a kernel happens to execute, so the figures of different
// implementations compare.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "attention/gdn.h"

namespace seqpar::bench {

// ---- DSA: indexer + top-k, sparse latent attention, indexer loss (attention/dsa.h) ----------------------------------

struct DsaFlopShape {
  std::int64_t batch = 1, seq = 0;
  std::int64_t heads = 0, head_dim = 0, dim_v = 0;  // H, Dqk, Dv
  std::int64_t indexer_heads = 0, indexer_dim = 0;  // Hi, Di
  std::int64_t topk = 0, window = 0;                // k; window W > 0 caps the candidates of a query
  std::vector<std::int64_t> doc_lens;               // a packed row's document lengths (batch 1); empty: one of seq
};

// Attention: 2 H (Dqk + Dv) per (query, selected key) pair (scores and the weighted value sum).
inline double dsa_attention_flops_per_pair(const DsaFlopShape& s) {
  return 2.0 * static_cast<double>(s.heads) * static_cast<double>(s.head_dim + s.dim_v);
}
// Indexer: 2 Hi Di per (query, candidate key) pair.
inline double dsa_indexer_flops_per_pair(const DsaFlopShape& s) {
  return 2.0 * static_cast<double>(s.indexer_heads) * static_cast<double>(s.indexer_dim);
}
// Per document of L tokens (a query sees keys of its own document only): sum_{t=0}^{L-1} min(m, t+1) =
// m (m + 1) / 2 + (L - m) m with m = min(cap, L); summed over the documents (one of S tokens when not packed), times
// the batch.
inline double dsa_capped_pairs(const DsaFlopShape& s, std::int64_t cap) {
  double pairs = 0;
  const auto add = [&](std::int64_t len) {
    const double n = static_cast<double>(len), m = static_cast<double>(std::min(cap, len));
    pairs += m * (m + 1) / 2 + (n - m) * m;
  };
  if (s.doc_lens.empty()) add(s.seq);
  for (const std::int64_t len : s.doc_lens) add(len);
  return static_cast<double>(s.batch) * pairs;
}
// The candidates of query t: its t + 1 visible keys (of its document), or the last min(W, t + 1) with a window W.
inline std::int64_t dsa_candidate_cap(const DsaFlopShape& s) { return s.window > 0 ? s.window : s.seq; }
// (query, selected key) pairs: query t selects min(k, candidates) keys.
inline double dsa_selected_pairs(const DsaFlopShape& s) {
  return dsa_capped_pairs(s, std::min(s.topk, dsa_candidate_cap(s)));
}
// (query, candidate key) pairs the indexer scores: S (S + 1) / 2 per batch row without a window.
inline double dsa_visible_pairs(const DsaFlopShape& s) { return dsa_capped_pairs(s, dsa_candidate_cap(s)); }

// Forward: attention over the selected pairs plus the indexer over the visible pairs.
inline double dsa_forward_flops(const DsaFlopShape& s) {
  return dsa_selected_pairs(s) * dsa_attention_flops_per_pair(s) + dsa_visible_pairs(s) * dsa_indexer_flops_per_pair(s);
}
// Backward: 2.5 x the attention forward plus the indexer loss side, 6 Hi Di per selected pair (the selected pairs'
// scores, dq_idx and dk_idx).
inline double dsa_backward_flops(const DsaFlopShape& s) {
  return dsa_selected_pairs(s) * (2.5 * dsa_attention_flops_per_pair(s) + 3.0 * dsa_indexer_flops_per_pair(s));
}

// ---- GDN: chunked gated delta rule (attention/gdn.h), optionally after the short conv ------------------------------

struct GdnFlopShape {
  std::int64_t batch = 1, seq = 0;
  std::int64_t heads = 0, head_dim = 0, dim_v = 0;  // Hv value heads, K, V
  std::int64_t chunk_size = 0;                      // C = min(chunk_size, S, kGdnMaxChunkSize)
  std::int64_t conv_width = 0, conv_channels = 0;   // short conv: W and its channels (0: no conv)
};

// Forward: per token and value head 6 C K + 4 C V + 6 K V (the chunk's [C, C] and [C, K] / [C, V] products and its
// [K, V] state products), plus 2 W per token and conv channel.
// C is the chunk the kernels run: a chunk_size above attn::kGdnMaxChunkSize (128) runs as chunks of 128 tokens, so a
// larger C would count work that is not done (--chunk-size 1000 reported 6x the GFLOP/s of 128 at the same time).
inline double gdn_forward_flops(const GdnFlopShape& s) {
  const double c = static_cast<double>(attn::gdn_run_chunk_size(s.chunk_size, s.seq)),
               k = static_cast<double>(s.head_dim), v = static_cast<double>(s.dim_v);
  const double conv = 2.0 * static_cast<double>(s.conv_width) * static_cast<double>(s.conv_channels);
  return static_cast<double>(s.batch) * static_cast<double>(s.seq) *
         (static_cast<double>(s.heads) * (6 * c * k + 4 * c * v + 6 * k * v) + conv);
}
// Backward: 2.5 x the forward.
inline double gdn_backward_flops(const GdnFlopShape& s) { return 2.5 * gdn_forward_flops(s); }
// A segment's map (gdn_transition: the state [M | U] of K + V columns carried through the chunks, no output): per
// token and value head the chunk's [C, C] and [C, K] / [C, V] products, 4 C K + 2 C V, and the wide state's two
// products, 4 K (K + V). C as the forward's: gdn_transition runs the same chunks.
inline double gdn_map_flops(const GdnFlopShape& s) {
  const double c = static_cast<double>(attn::gdn_run_chunk_size(s.chunk_size, s.seq)),
               k = static_cast<double>(s.head_dim), v = static_cast<double>(s.dim_v);
  return static_cast<double>(s.batch) * static_cast<double>(s.seq) * static_cast<double>(s.heads) *
         (4 * c * k + 2 * c * v + 4 * k * (k + v));
}
// Composing two maps (gdn_transition_compose): M2 M1 and M2 U1, 2 K K (K + V) per batch and value head.
inline double gdn_compose_flops(const GdnFlopShape& s) {
  const double k = static_cast<double>(s.head_dim), v = static_cast<double>(s.dim_v);
  return static_cast<double>(s.batch) * static_cast<double>(s.heads) * 2 * k * k * (k + v);
}

}  // namespace seqpar::bench
