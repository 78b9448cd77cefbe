// The two ring schedules every context-parallel algorithm here is built from (Liu et al. 2023, "Ring Attention").
//
// ring_circulate: a block (K/V, a latent, index keys) visits every rank of `comm`, one hop per step, P steps;
// the next block's send / receive is posted before the current block is processed (double buffering), so that
// communication overlaps `visit`. Step s at rank r sees the block of rank (r - s) mod P.
//
// ring_circulate_with_grad: the same, plus a gradient accumulator per block (fp32, or fp64 for fp64 results: the
// dtype of home_grad) that follows it one step behind:
// at each step `visit` adds this rank's contribution into a zeroed buffer while the upstream partial sum is in
// flight; the partial is then added (fixed order: local contribution + upstream partial) and sent on, grouped with
// the receive of the next partial (so that backends running a communicator's operations in order, like NCCL, never
// wait on a lone receive). After P hops the sum of every rank's contribution arrives home in `home_grad`.
//
// Deadlock freedom: every exchange posts its receive and send together (batch_isend_irecv), blocks on tag, gradients
// on tag + 1, in the same order on every rank, for any P >= 1. Synchronisation: collective over `comm`,
// host-synchronous. `exposed_s` (may be null) accumulates the seconds blocked in waits.
#pragma once

#include <functional>

#include "runtime/comm.h"

namespace seqpar {

using RingVisit = std::function<void(int src, const TensorView& block)>;
using RingGradVisit = std::function<void(int src, const TensorView& block, const TensorView& grad)>;

// Buffers live on local_block's device; copies, fills and sums run on `stream`.
void ring_circulate(Communicator& comm, const TensorView& local_block, int tag, const RingVisit& visit,
                    double* exposed_s = nullptr, Stream stream = Stream::cpu());

// home_grad: fp32 or fp64 (the accumulators' dtype) with the element count of `grad_shape`; receives the full
// gradient of this rank's block.
void ring_circulate_with_grad(Communicator& comm, const TensorView& local_block, const Shape& grad_shape,
                              const TensorView& home_grad, int tag, const RingGradVisit& visit,
                              double* exposed_s = nullptr, Stream stream = Stream::cpu());

}  // namespace seqpar
