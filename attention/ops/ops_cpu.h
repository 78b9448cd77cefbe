// The CPU ops table (attention/ops/ops.h): GEMM and triangular solves on OpenBLAS's CBLAS when the build found it
// (SEQPAR_OPS_WITH_CBLAS), else on plain loops; everything else loops over the rows calling the bodies of
// attention/kernels/gdn_rows.h. Memory is host memory. Single-threaded apart from OpenBLAS's own threads.
#pragma once

#include "../../runtime/dtype.h"
#include "ops.h"

namespace seqpar::attn::ops {

// The process-wide CPU tables (stateless).
Ops<float>& cpu_ops_f32();
Ops<double>& cpu_ops_f64();

template <typename T>
Ops<T>& cpu_ops();
template <>
inline Ops<float>& cpu_ops<float>() {
  return cpu_ops_f32();
}
template <>
inline Ops<double>& cpu_ops<double>() {
  return cpu_ops_f64();
}

// Calls f(table) with the fp64 table for fp64 data, else the fp32 one (bf16 / fp16 inputs compute in fp32).
template <typename F>
void with_cpu_ops(DType dtype, F&& f) {
  if (dtype == DType::kFloat64)
    f(cpu_ops_f64());
  else
    f(cpu_ops_f32());
}

// Whether the CPU table's GEMM and trsm run on CBLAS (else on loops).
bool cpu_ops_use_cblas();

}  // namespace seqpar::attn::ops
