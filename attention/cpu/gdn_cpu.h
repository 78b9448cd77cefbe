// Internal: the CPU GDN kernels behind attention/gdn.h (chunked gated delta rule, segment maps, short conv).
// Arguments are validated by attention/gdn.cc, which passes the validated sizes along; not a public header.
#pragma once

#include <cstdint>
#include <vector>

#include "../gdn.h"

namespace seqpar::attn::cpu {

// Validated sizes: q [B, S, Hk, K], v [B, S, H, V] (H value heads, a multiple of Hk); C = the chunk length used,
// min(chunk_size, max(S, 1)).
// A window (gdn_forward_window): the tensors hold rows_total rows per batch, heads_total value heads and
// key_heads_total key heads; the call runs S rows from row0 and H value heads from head0 (0: the whole tensors).
struct GdnDims {
  std::int64_t B = 0, S = 0, H = 0, Hk = 0, K = 0, V = 0, C = 0;
  std::int64_t rows_total = 0, row0 = 0, heads_total = 0, key_heads_total = 0, head0 = 0;
  std::int64_t num_chunks() const { return (S + C - 1) / C; }
  // Value heads per key head; value head h reads key head h / group().
  std::int64_t group() const { return H / Hk; }
  bool windowed() const { return heads_total > 0; }
  // The row of batch b, token t (of the run), value head h (of the run) in a [B, rows, heads, *] value tensor, and
  // the row of its key head in a q or k tensor.
  std::int64_t value_row(std::int64_t b, std::int64_t t, std::int64_t h) const {
    if (!windowed()) return (b * S + t) * H + h;
    return (b * rows_total + row0 + t) * heads_total + head0 + h;
  }
  std::int64_t key_row(std::int64_t b, std::int64_t t, std::int64_t h) const {
    if (!windowed()) return (b * S + t) * Hk + h / group();
    return (b * rows_total + row0 + t) * key_heads_total + (head0 + h) / (heads_total / key_heads_total);
  }
};

// Work ahead (attention/gdn.h, GdnAhead): the buffer of gdn_ahead_numel_cpu elements of the compute dtype, of
// which the first chunks_done chunks are computed. Forward: per (batch, head, chunk) the chunk's state-independent
// quantities; backward: per (batch, head, chunk) the chunk's start state (the forward sweep).
struct GdnAheadBuffer {
  void* data = nullptr;
  std::int64_t chunks_done = 0;
};

// ahead: null, or work ahead for these args and sizes (the initial state aside in the forward); the kernels use
// its computed chunks (the backward completes the buffer's start states in place) and compute the rest.
void gdn_forward_cpu(const GdnForwardArgs& args, const GdnDims& d, const TensorView& out, const TensorView& final_state,
                     const GdnAheadBuffer* ahead = nullptr);
void gdn_backward_cpu(const GdnBackwardArgs& args, const GdnDims& d, const TensorView& dq, const TensorView& dk,
                      const TensorView& dv, const TensorView& dg, const TensorView& dbeta,
                      const TensorView& dinitial_state, const GdnAheadBuffer* ahead = nullptr);
std::int64_t gdn_ahead_numel_cpu(const GdnDims& d, bool backward);
// Chunks [chunk_begin, chunk_end) of the work ahead (backward: chunk_begin's state must be there when > 0).
void gdn_ahead_cpu(const GdnForwardArgs& args, const GdnDims& d, bool backward, const GdnAheadBuffer& ahead,
                   std::int64_t chunk_begin, std::int64_t chunk_end);
void gdn_transition_cpu(const GdnForwardArgs& args, const GdnDims& d, const TensorView& m, const TensorView& u);

void gdn_transition_compose_cpu(const TensorView& m2, const TensorView& u2, const TensorView& m1, const TensorView& u1,
                                const TensorView& m, const TensorView& u);
void gdn_transition_apply_cpu(const TensorView& m, const TensorView& u, const TensorView& s_start,
                              const TensorView& s_end);
void gdn_transition_apply_adjoint_cpu(const TensorView& m, const TensorView& ds_end, const TensorView& local,
                                      const TensorView& ds_start);
void gdn_transition_transpose_cpu(const TensorView& m, const TensorView& mt);

// x [B, S, C], weight [C, W]; cu_seqlens: the validated document bounds of a packed row (B = 1), empty otherwise.
struct ShortConvDims {
  std::int64_t B = 0, S = 0, C = 0, W = 0;
  std::vector<std::int64_t> cu_seqlens = {};
};

void short_conv_forward_cpu(const ShortConvArgs& args, const ShortConvDims& d, const TensorView& out,
                            const TensorView& final_conv_state);
void short_conv_backward_cpu(const ShortConvArgs& args, const ShortConvDims& d, const TensorView& dout,
                             const TensorView& dx, const TensorView& dweight, const TensorView& dinitial_conv_state);

}  // namespace seqpar::attn::cpu
