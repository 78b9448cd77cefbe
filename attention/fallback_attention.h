// The exact, slow attention path for what cuDNN's SDPA graphs refuse (fp32 backward, fp64, head dim > 256 backward,
// masks they cannot express), written once for every device: a host-side driver tiles the query rows of each
// lowered rectangle (attention/lowering.h) and composes GEMMs of scores with masked row operations; a FallbackOps
// implementation supplies the GEMM (cuBLAS on CUDA: attention/cuda/fallback_ops_cuda.cc; plain loops on the CPU:
// fallback_attention.cc, so that the composition is tested on the CPU against the fp64 reference) and the row
// bodies (below, host-device, launched per row on CUDA).
//
// Per rectangle (rows [q_begin, q_end) x keys [k_begin, k_end), mask m), per (b, h), per tile of query rows
// (docs/design.md, "MHA on one device"; FlashAttention-2's backward with the final lse and delta):
//   forward:  S = scale Q K^T; (P, lse_rect) = masked row softmax over the rectangle's band of keys; O_rect = P V;
//             merged into (O, lse) of the block by the LSE merge (rowops::lse_merge_*).
//   backward: S = scale Q K^T; P = exp(S - lse) on the band, 0 elsewhere (lse: the final one); dP = dO V^T;
//             dS = P (dP - delta); dQ += scale dS K; dK += scale dS^T Q; dV += P^T dO.
// The band of row i of a rectangle with sq x sk and mask m: keys j with sdpa_mask_visible(m, sq, sk, i, j), an
// interval [begin, end) (fallback_row_band).
// Arrays are T = float or double, row-major with leading dimensions: q / o / do [B, Sq, Hq, D] (a head's rows
// have stride Hq D), k / v [B, Sk, Hkv, D], lse / delta [B, Hq, Sq]. Storage dtypes are converted to T by the
// caller (mha boundary). GQA: query head h reads key head h / (Hq / Hkv).
#pragma once

#include <cstdint>
#include <vector>

#include "fallback_rows.h"
#include "lowering.h"

namespace seqpar::attn::fallback {

// The rectangle's RowBand (fallback_rows.h) of mask m.
RowBand fallback_row_band(const SdpaMask& m, std::int64_t sq, std::int64_t sk);

// What a device supplies. Pointers are on the device; calls are ordered (a stream on CUDA).
template <typename T>
class FallbackOps {
 public:
  virtual ~FallbackOps() = default;
  // Row-major C[m, n] = alpha op(A) op(B) + beta C, op(A) [m, k] (A stored [k, m] when trans_a), op(B) [k, n].
  virtual void gemm(bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k, T alpha, const T* a,
                    std::int64_t lda, const T* b, std::int64_t ldb, T beta, T* c, std::int64_t ldc) = 0;
  // rows x band.sk scores (leading dim band.sk) of local rows i0, i0 + 1, ...: p in place, lse[r] (stride 1), with
  // the rectangle's score modifiers and dropout (fallback_softmax_row).
  virtual void softmax_rows(const RowBand& band, const RowMods& mods, std::int64_t i0, std::int64_t rows, T* s,
                            T* lse) = 0;
  // rows of s -> z p, dp -> ds (fallback_grad_row), lse and delta of the rows at stride 1.
  virtual void grad_rows(const RowBand& band, const RowMods& mods, std::int64_t i0, std::int64_t rows, const T* lse,
                         const T* delta, T* s, T* dp) = 0;
  // The sink logit of one head joins `rows` finished rows (fallback_sink_row): o rows of d elements, leading dim ldo;
  // lse at stride 1.
  virtual void sink_rows(double sink, std::int64_t rows, std::int64_t d, T* o, std::int64_t ldo, T* lse) = 0;
  // Merge (o_b, lse_b) of `rows` rows (o rows of d elements, leading dim ldo; lse at stride 1) into (o, lse).
  virtual void merge_rows(std::int64_t rows, std::int64_t d, T* o, std::int64_t ldo, T* lse, const T* o_b,
                          std::int64_t ldo_b, const T* lse_b) = 0;
  // Scratch of n elements on the device, valid until the next scratch() call with the same slot.
  virtual T* scratch(int slot, std::int64_t n) = 0;
};

// Problem sizes and pointers (T arrays, see above). lse / delta are [B, Hq, Sq].
template <typename T>
struct FallbackProblem {
  std::int64_t batch = 0, sq = 0, sk = 0, hq = 0, hkv = 0, head_dim = 0;
  T scale = T(0);
  const T *q = nullptr, *k = nullptr, *v = nullptr;
  std::int64_t tile_rows = 128;  // query rows per score tile (memory: tile_rows x sk elements, three tiles)
  // Score modifiers and dropout (attention/mha.h ScoreMods, MhaForwardArgs::dropout), resolved by the caller:
  // softcap 0 = off; alibi / sinks: [Hq] host arrays or nullptr (off); q_pos [Sq], k_pos [Sk] the call's global
  // positions and q_tokens [Sq] (nullptr: tokens = positions), on the ops' device, read when alibi or dropout is
  // on; dropout p = 0: off, else keyed by head_offset + h. The sinks join the forward's rows once, after every
  // rectangle is merged; the backward takes the final lse (lse_total) and reads no sink.
  double softcap = 0.0;
  const double* alibi = nullptr;
  const double* sinks = nullptr;
  const std::int64_t *q_pos = nullptr, *k_pos = nullptr, *q_tokens = nullptr;
  DropoutSpec dropout{};
  std::int64_t head_offset = 0;
};

// Forward over the rectangles: out [B, Sq, Hq, D] and lse [B, Hq, Sq] overwritten (rows no rectangle covers get 0
// and -inf).
template <typename T>
void fallback_forward(FallbackOps<T>& ops, const FallbackProblem<T>& p, const std::vector<LoweredRect>& rects, T* out,
                      T* lse);
// Backward over the rectangles with the final lse and delta = rowsum(dO O): dq, dk, dv [.., D] accumulated (+=).
template <typename T>
void fallback_backward(FallbackOps<T>& ops, const FallbackProblem<T>& p, const std::vector<LoweredRect>& rects,
                       const T* dout, const T* lse, const T* delta, T* dq, T* dk, T* dv);

// The CPU implementation of FallbackOps (plain loops, the row bodies above): host pointers.
template <typename T>
class CpuFallbackOps final : public FallbackOps<T> {
 public:
  void gemm(bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k, T alpha, const T* a,
            std::int64_t lda, const T* b, std::int64_t ldb, T beta, T* c, std::int64_t ldc) override;
  void softmax_rows(const RowBand& band, const RowMods& mods, std::int64_t i0, std::int64_t rows, T* s,
                    T* lse) override;
  void grad_rows(const RowBand& band, const RowMods& mods, std::int64_t i0, std::int64_t rows, const T* lse,
                 const T* delta, T* s, T* dp) override;
  void sink_rows(double sink, std::int64_t rows, std::int64_t d, T* o, std::int64_t ldo, T* lse) override;
  void merge_rows(std::int64_t rows, std::int64_t d, T* o, std::int64_t ldo, T* lse, const T* o_b, std::int64_t ldo_b,
                  const T* lse_b) override;
  T* scratch(int slot, std::int64_t n) override;

 private:
  std::vector<T> buf_[8];
};

}  // namespace seqpar::attn::fallback
