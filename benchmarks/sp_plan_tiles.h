// sp_plan's tile model of a FlashAttention-3-style attention call (a GPU profile's optional "mha_tiles" block;
// docs/benchmarks.md, "sp_plan"). The kernel cuts every sequence of a varlen call into tiles of block_m query rows x
// block_n keys per head and runs one work unit per outer block: the forward an M block of queries looping over the
// N blocks of keys it sees, the backward an N block of keys looping over the M blocks of queries that see it. A unit
// costs (iterations + overhead_blocks) inner iterations of one tile at unit_flops_per_s, and never less than its
// iterations at the phase's plateau rate (the kernel curve's best point). Short documents and the causal diagonal
// then cost what their whole tiles and their per-unit prologue and epilogue cost, which a curve indexed by the FLOPs
// of a call cannot tell (a call over many short documents has the FLOPs of a long one).
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace seqpar::bench::plan {

struct TilePhase {
  int block_m = 0, block_n = 0;                                    // tile without a causal mask: query rows x keys
  int causal_block_m = 0, causal_block_n = 0;                      // with one
  double unit_flops_per_s = 0;                                     // the rate of a unit's inner iterations
  double overhead_blocks = 0;                                      // a unit's fixed cost, in inner iterations
  double causal_unit_flops_per_s = 0, causal_overhead_blocks = 0;  // with a causal mask (JSON default: the above)
  bool pack_gqa = false;  // the query heads sharing a key head packed into the M rows (one unit serves them all)
};

struct AttnTiles {
  bool present = false;
  TilePhase fwd, bwd;  // fwd: units are M blocks (inner loop over N blocks); bwd: N blocks (inner loop over M)
  std::string source;
};

// One sequence of a varlen call: q_len queries against k_len keys; causal aligned bottom-right (query i sees keys
// j <= i + k_len - q_len), as FlashAttention's varlen causal mask.
struct TileSeq {
  std::int64_t q_len = 0, k_len = 0;
  bool causal = false;
};

// Inner iterations of one call, summed over its units, and the units (per head of the call: heads / kv_heads
// units share one key head when pack_gqa). For tests and tile_call_seconds.
struct TileCount {
  double iterations = 0, units = 0;
};
TileCount tile_count(const TilePhase& ph, bool bwd, const std::vector<TileSeq>& seqs, int heads, int kv_heads);

// Seconds of one call of `heads` query heads on `kv_heads` key heads of head_dim columns; plateau_flops_per_s: the
// rate no unit exceeds. Forward FLOPs of a tile 4 M N D, backward 2.5 times that.
double tile_call_seconds(const AttnTiles& t, bool bwd, const std::vector<TileSeq>& seqs, int heads, int kv_heads,
                         int head_dim, double plateau_flops_per_s);

// The memory passes around one FlashAttention-3 varlen call of MagiAttention's baselines (utils_cp.py,
// _fa3_varlen_forward / _fa3_varlen_backward), in bytes: every input is gathered to its valid rows before the call
// (torch.gather: read and write) and every output scattered back into a zero-filled tensor of the input's rows
// (zero fill, then read and write). Q = the call's query rows (sum of q_len), K = its key rows, e = storage bytes,
// D = head_dim, Hq = heads, Hkv = kv_heads; lse in fp32 (4 bytes a row and head). Forward: q, k, v gathered, out and
// lse scattered: e D (5 Q Hq + 4 K Hkv) + 12 Q Hq. Backward: q, out, dout, k, v and lse gathered, dq, dk, dv
// scattered: e D (9 Q Hq + 10 K Hkv) + 8 Q Hq.
double unpad_pad_bytes(bool bwd, const std::vector<TileSeq>& seqs, int heads, int kv_heads, int head_dim,
                       double elem_bytes);

// The ring step's half reads (TransformerEngine's thd_read_half_tensor, prepare_input_bwd: a read and a write of the
// half): a call whose queries are half the keys (q_len < k_len: the second query chunk) copies that half of q
// (forward) or of q, out, dout (backward); one whose keys are half the queries copies that half of k and v. Bytes:
// forward 2 e D (Q' Hq) + 4 e D (K' Hkv), backward 6 e D (Q' Hq) + 4 e D (K' Hkv), Q' and K' the halved rows.
double half_read_bytes(bool bwd, const std::vector<TileSeq>& seqs, int heads, int kv_heads, int head_dim,
                       double elem_bytes);

// The ring function's copy passes of MagiAttention's ring baselines (exps/dist_attn/baselines/ring_attn.py,
// FA3RingAttnFunc and TERingAttnFunc), in bytes, over the rank's `rows` rows of hq query and hkv key heads of
// head_dim columns; e storage bytes, a the running out's and the gradients' bytes, l the lse's. Forward, at the first
// step only: K and V concatenated into the first send buffer (torch.cat: 4 e hkv D a row), out zero-filled
// (torch.zeros_like(q): a hq D), the first lse cloned (2 l hq) and step 0's output folded in by thd_out_correction,
// which runs for every step (e + 2 a) hq D: rows (4 e hkv D + hq (D (e + 3 a) + 2 l)); later steps nothing (their merge
// is the merge pass). Backward, first step: K and V copied into the first buffer (4 e hkv D), step 0's dq, dk, dv
// copied into the accumulators (2 a hq D + 4 a hkv D) and its dk, dv concatenated (4 e hkv D): rows D (8 e hkv + 2 a hq
// + 4 a hkv); every later step: its dk, dv concatenated before their update (torch.cat: rows 4 e hkv D).
double ring_copy_pass_bytes(bool bwd, bool first_step, double rows, double hq, double hkv, int head_dim,
                            double elem_bytes, double grad_bytes, double lse_bytes);

// The "mha_tiles" block: {"fwd": {...}, "bwd": {...}, "source": ...}; each phase block_m, block_n, causal_block_m,
// causal_block_n (> 0), unit_flops_per_s (> 0), overhead_blocks (>= 0), causal_unit_flops_per_s and
// causal_overhead_blocks (optional, the same rules; default the values without a mask), pack_gqa (optional, false).
// Errors name `what` and the field.
AttnTiles tiles_from_json(const nlohmann::json& j, const std::string& what);
nlohmann::json tiles_json(const AttnTiles& t);

}  // namespace seqpar::bench::plan
