// sp_bench's MHA / GQA workload: ring, Ulysses and USP through UspAttention (ulysses-size 1 = pure ring,
// ring-size 1 = pure Ulysses). Inputs q k v dout [B, S, H, D]; outputs out [B, S, Hq, D], lse [B, Hq, S] (fp32),
// dq, dk, dv. The reference is one attn::mha_forward + attn::mha_backward call on the full tensors.
#pragma once

#include <memory>

#include "benchmarks/sp_bench_workload.h"

namespace seqpar::bench {

std::vector<TensorSpec> mha_input_specs(const SpBenchOptions& options);
std::unique_ptr<Workload> make_mha_workload(const SpBenchOptions& options, const SpGrid& grid);

}  // namespace seqpar::bench
