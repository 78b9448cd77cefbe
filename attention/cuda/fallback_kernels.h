// CUDA launches of the fallback attention's row bodies (attention/fallback_attention.h): one thread per row, T =
// float or double, device pointers, asynchronous on `stream` (launch errors raised at once). Internal to attention/.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "../fallback_rows.h"

namespace seqpar::attn::cuda {

// Rows [i0, i0 + rows) of a rectangle: s [rows, band.sk] -> probabilities in place, lse[r] (score modifiers and
// dropout of `mods`, whose pointers are device pointers).
template <typename T>
void fallback_softmax_rows(const fallback::RowBand& band, const fallback::RowMods& mods, std::int64_t i0,
                           std::int64_t rows, T* s, T* lse, cudaStream_t stream);
// s -> z p with p = exp(a - lse) on the band, dp -> ds = p (z dp - delta) da/ds, in place (fallback_grad_row).
template <typename T>
void fallback_grad_rows(const fallback::RowBand& band, const fallback::RowMods& mods, std::int64_t i0,
                        std::int64_t rows, const T* lse, const T* delta, T* s, T* dp, cudaStream_t stream);
// The sink logit joins `rows` finished rows (fallback_sink_row): o rows of d elements at leading dim ldo, lse at
// stride lse_stride.
template <typename T>
void fallback_sink_rows(double sink, std::int64_t rows, std::int64_t d, T* o, std::int64_t ldo, T* lse,
                        std::int64_t lse_stride, cudaStream_t stream);
// (o, lse) of `rows` rows merged in place with (o_b, lse_b) (rowops::lse_merge_*).
template <typename T>
void fallback_merge_rows(std::int64_t rows, std::int64_t d, T* o, std::int64_t ldo, T* lse, const T* o_b,
                         std::int64_t ldo_b, const T* lse_b, cudaStream_t stream);

// delta [B, H, S] = rowsum(dout * out) of out / dout [B, S, H, D] (fallback_delta_row).
template <typename T>
void fallback_delta(std::int64_t batch, std::int64_t seq, std::int64_t heads, std::int64_t d, const T* out,
                    const T* dout, T* delta, cudaStream_t stream);

}  // namespace seqpar::attn::cuda
