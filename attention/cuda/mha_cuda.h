// MHA / GQA forward and backward on CUDA tensors: what mha_forward / mha_backward (attention/mha.h) run when their
// tensors or stream are on a CUDA device. Internal to attention/; built only with SEQPAR_WITH_CUDA.
//
// Every call is lowered into masked rectangles (attention/lowering.h). In a build with the cuDNN frontend, each
// rectangle of a bf16 / fp16 call that cuDNN takes runs as one dense cuDNN SDPA graph (attention/cuda/
// cudnn_sdpa_graphs.h: run_sdpa, plans cached per shape, strides, dtype, mask and scale; forward with fp32
// natural-log stats merged into the call's result by the lse merge; backward with the final out and lse,
// deterministic, its gradients added up). Every other rectangle (fp32, fp64, head dim not a multiple of 8, > 256
// backward, a graph cuDNN refuses, no frontend) runs the exact fallback (attention/fallback_attention.h): inputs
// converted to the accumulator dtype (fp32; fp64 for fp64), cuBLAS GEMM tiles of scores with the masked row kernels.
// Results are accumulated in the accumulator dtype and converted to the outputs' dtypes. Nothing here has run on a
// GPU.
// Supported: the masks of MaskSpec (causal, window, document bounds), GQA, any head dim, fp32 / bf16 / fp16 / fp64,
// lse of the accumulator dtype or fp64, a given delta, accumulate; soft-capping, ALiBi, sinks and dropout (the
// slopes and sinks as host [Hq] vectors, as on the CPU), which run the exact fallback whatever the dtype: its row
// bodies (attention/fallback_rows.h: mod_score, dropout_factor with the Philox body of attention/dropout.h,
// fallback_sink_row) are the ones the CPU tests run against the fp64 reference, so a device draws the CPU's
// dropout mask. Refused with an error naming the feature before any work: dlse; tensors on different devices or
// on the CPU.
// Sync: ordered on the stream (the call's stream; its handle may be null, the legacy default stream); returns
// after the stream has finished the call's work (scratch buffers are freed on return).
#pragma once

#include <vector>

#include "../mha.h"

namespace seqpar::attn::cuda {

void mha_forward_cuda(const MhaForwardArgs& args, const TensorView& out, const TensorView& lse, Stream stream);
void mha_backward_cuda(const MhaBackwardArgs& args, const TensorView& dq, const TensorView& dk, const TensorView& dv,
                       bool accumulate, Stream stream);

// The checks of the calls above without their work (what MhaForwardArgs::validate and MhaBackwardArgs::validate run
// for CUDA tensors, so that a context-parallel caller refuses a call on every rank before anything is sent):
// check_forward_fields: the fields of the forward (q, k, v on one CUDA device, the features refused above);
// check_forward_call / check_backward_call: every check of mha_forward_cuda / mha_backward_cuda. Host-only.
void check_forward_fields(const MhaForwardArgs& args);
void check_forward_call(const MhaForwardArgs& args, const TensorView& out, const TensorView& lse, Stream stream);
void check_backward_call(const MhaBackwardArgs& args, const TensorView& dq, const TensorView& dk, const TensorView& dv,
                         bool accumulate, Stream stream);

// attn::lse_merge on CUDA tensors: out / out_b and lse / lse_b fp32 or fp64 each, merged in fp64 per row by the body
// the host uses (attention/kernels/row_ops.h), rounded once on store. Ordered on `stream`; returns after the stream
// has finished it.
// Errors: tensors not all on the stream's CUDA device; shapes and dtypes as attn::lse_merge.
void lse_merge_cuda(const TensorView& out, const TensorView& lse, const TensorView& out_b, const TensorView& lse_b,
                    Stream stream);
// attn::mha_apply_sinks on CUDA tensors (out [B, S, H, D], lse [B, H, S], fp32 or fp64 each, on the stream's
// device; sinks: the [H] values, read from the host tensor by the caller): converted to fp64, each row through
// fallback_sink_row (attention/fallback_rows.h), rounded once on store. Ordered on `stream`; returns after the stream
// has finished it. Errors: as attn::mha_apply_sinks, and tensors not all on the stream's CUDA device.
void apply_sinks_cuda(const TensorView& out, const TensorView& lse, const std::vector<double>& sinks, Stream stream);

// attn::mha_backward_delta on CUDA tensors: out and dout converted to the sum's dtype (fp64 when delta is fp64, else
// fp32, as on the host), then one row per thread (attention/fallback_rows.h, fallback_delta_row, in index order).
// Ordered on `stream`; returns after the stream has finished it.
// Errors: as attn::mha_backward_delta, and tensors not all on the stream's CUDA device.
void mha_backward_delta_cuda(const TensorView& out, const TensorView& dout, const TensorView& delta, Stream stream);

}  // namespace seqpar::attn::cuda
