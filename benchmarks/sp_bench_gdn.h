// sp_bench's GDN (gated delta rule) workload: chain or scan over the ring group, Ulysses all-to-all over heads,
// through GdnContextParallel (parallel/gdn_cp.h). Inputs q k [B, S, H, K], v [B, S, H, V], g beta [B, S, H],
// initial_state [B, H, K, V], dout [B, S, H, V] (K = V = --head-dim); outputs out, final_state, dq, dk, dv, dg, dbeta,
// dinitial_state. The reference is one attn::gdn_forward + attn::gdn_backward call on the full tensors.
#pragma once

#include <memory>

#include "benchmarks/sp_bench_workload.h"

namespace seqpar::bench {

std::vector<TensorSpec> gdn_input_specs(const SpBenchOptions& options);
std::unique_ptr<Workload> make_gdn_workload(const SpBenchOptions& options, const SpGrid& grid);

}  // namespace seqpar::bench
