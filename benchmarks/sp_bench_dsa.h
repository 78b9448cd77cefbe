// sp_bench's DSA (DeepSeek sparse attention) workload: indexer top-k selection over the SP group (ring or
// all-gather), sparse latent attention over the ring, heads over the Ulysses group, and the indexer KL loss, through
// DsaContextParallel (parallel/dsa_cp.h). Inputs q [B, S, H, Dqk], c [B, S, Dqk], q_idx [B, S, Hi, Di],
// k_idx [B, S, Di], w [B, S, Hi], dout [B, S, H, Dv] (Dqk = --head-dim, Dv = --dim-v, Hi = --indexer-heads,
// Di = --indexer-dim); outputs out [B, S, H, Dv], lse [B, H, S] fp32, topk_indices [B, S, k] int64, loss [1] fp64,
// dq, dc, dq_idx, dk_idx, dw. The reference is the single-device kernels (attention/dsa.h) on the whole sequence,
// one call each.
#pragma once

#include <memory>

#include "benchmarks/sp_bench_workload.h"

namespace seqpar::bench {

std::vector<TensorSpec> dsa_input_specs(const SpBenchOptions& options);
std::unique_ptr<Workload> make_dsa_workload(const SpBenchOptions& options, const SpGrid& grid);

}  // namespace seqpar::bench
