// A whole MHA problem (q, k, v, dout from fixed seeds, identical on every rank), its single-rank result, and
// sharding / gathering by a SequenceLayout: shared by the ring and USP tests.
#pragma once

#include <string>
#include <vector>

#include "attention/mha.h"
#include "parallel/layout.h"
#include "parallel/usp.h"
#include "runtime/cp_grid.h"

namespace seqpar::test {

struct MhaShape {
  std::int64_t batch = 2, seq = 192, hq = 4, hkv = 2, dim = 64;
  DType dtype = DType::kFloat32;
  attn::MaskSpec mask;
  std::uint64_t seed = 0;       // added to the fixed seeds of q, k, v, dout (another problem of the same shape)
  double logits = 0;            // > 0: logits of about this size with a spread softmax (test::set_logit_offset)
  attn::ScoreMods mods;         // soft-capping, ALiBi, sinks over all hq heads (views kept alive by the caller)
  attn::DropoutSpec dropout{};  // applied by single_rank_result and reference_result (usp_result: the config's)
};

// An fp64 problem on one row of `tokens` tokens (B = 1): hq query and hkv key/value heads of dimension `dim`, `mask`.
MhaShape one_row_fp64(std::int64_t tokens, std::int64_t hq, std::int64_t hkv, std::int64_t dim,
                      attn::MaskSpec mask = {});

// The MhaCp configuration of a run of `s`: `impl`, the causal flag and window of s.mask, s.mods and s.dropout.
MhaCpConfig cp_config(const MhaShape& s, RingImpl impl);

struct MhaProblem {
  Tensor q, k, v, dout;    // full [B, S, H, D]
  MhaProblem() = default;  // tensors set by the caller (e.g. one document of a packed problem)
  explicit MhaProblem(const MhaShape& s);
};

struct MhaResult {
  std::vector<double> out, lse, dq, dk, dv;  // full tensors as fp64
  std::vector<double> dsinks;                // [hq] when s.mods has sinks, else empty
};

// One mha_forward + mha_backward call over the whole sequence (the single-rank result).
MhaResult single_rank_result(const MhaShape& s, const MhaProblem& p);
// The fp64 reference (attention/reference) on the dtype-rounded inputs.
MhaResult reference_result(const MhaShape& s, const MhaProblem& p);

// A packed problem (B = 1, s.seq = cu.back()) run one document at a time: document d alone through
// single_rank_result, written into the full result at its tokens (lse -inf, everything else 0 where no document is).
MhaResult per_document_result(const MhaShape& s, const MhaProblem& p, const std::vector<std::int64_t>& cu);

// The document bounds of the tokens 0..T-1 of a packed row on one device (no padding, slots = tokens): token t of
// document d sees keys [cu[d], cu[d+1]). For MhaShape::mask of a packed single-rank or reference run.
DocBounds token_doc_bounds(const std::vector<std::int64_t>& cu);

// This rank's [B, S_local, ...] piece of a full [B, S, ...] tensor.
Tensor local_piece(const TensorView& full, const std::vector<std::int64_t>& positions);
// Gathers every rank's piece into the full tensor (seq_dim 1, or 2 for lse) and returns it as fp64.
std::vector<double> gather_full(Communicator& comm, const SequenceLayout& layout, const TensorView& local,
                                const Shape& full_shape, int seq_dim = 1);

// MhaCp (pure ring when ulysses_size = 1, pure Ulysses when ring_size = 1) on `grid` over the layout's
// shards of `p`, forward and backward; the gathered full results on every rank (dsinks: this rank's, which is the
// full sum), and the layer's counters.
MhaResult usp_result(const CpGrid& grid, const MhaShape& s, const MhaProblem& p, const MhaCpConfig& cfg,
                     LayoutKind layout, CpCounters* counters = nullptr);
// The same on a given layout (packed or padded: pieces cut by shard_sequence(layout, cp_rank, ...), s.seq = the
// layout's seq_len). `local`, when given, receives this rank's local out, lse, dq, dk, dv (padding rows included).
MhaResult usp_result(const CpGrid& grid, const MhaShape& s, const MhaProblem& p, const MhaCpConfig& cfg,
                     const SequenceLayout& layout, CpCounters* counters = nullptr,
                     std::vector<Tensor>* local = nullptr);

// Every tensor (out, lse, dq, dk, dv, dsinks) within atol = rtol = tol, with EXPECTs naming `what`.
void expect_mha_close(const MhaResult& got, const MhaResult& want, double tol, const std::string& what);

// Per-dtype comparison of every tensor (out, lse, dq, dk, dv) with EXPECTs naming `what`.
void expect_mha_match(const MhaResult& got, const MhaResult& want, DType dtype, const std::string& what);

}  // namespace seqpar::test
