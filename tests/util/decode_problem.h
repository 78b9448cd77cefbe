// Shared by the decode tests (single device and under CP): a prompt of T tokens followed by decode steps, as one
// sequence of T + steps * n tokens, and its independent result: the fp64 references (attention/reference) run over
// the whole sequence, whose rows T.. are what the decode steps must return.
#pragma once

#include <cstdint>
#include <vector>

#include "attention/gdn_decode.h"
#include "attention/mha.h"
#include "attention/reference/gdn_reference.h"
#include "attention/reference/mha_reference.h"
#include "parallel/decode_cp.h"
#include "runtime/tensor_ops.h"
#include "tests/util/test_util.h"

namespace seqpar::test {

// Rows [begin, end) of dimension `dim` of `full` (a copy, workspace).
inline Tensor rows_of(const TensorView& full, std::int64_t begin, std::int64_t end, int dim = 1) {
  return slice_dim(full, dim, begin, end);
}

inline Tensor as_f64(const TensorView& t) { return Tensor::copy_of(t, DType::kFloat64, MemCategory::kWorkspace); }

inline attn::ShortConvArgs conv_args(const TensorView& x, const TensorView& weight) {
  attn::ShortConvArgs a;
  a.x = x;
  a.weight = weight;
  return a;
}

struct DecodeSchedule {
  std::int64_t prompt = 0;  // T
  std::int64_t steps = 0;   // N
  std::int64_t n = 1;       // new tokens per step
  std::int64_t total() const { return prompt + steps * n; }
  std::int64_t first(std::int64_t step) const { return prompt + step * n; }  // first position of a step
};

// MHA / GQA: q [B, S, Hq, D], k, v [B, S, Hkv, D] of the whole sequence, and the causal fp64 reference over it.
struct MhaDecodeProblem {
  Tensor q, k, v;
  Tensor ref_out, ref_lse;  // fp64 [B, S, Hq, D], [B, Hq, S]
  MhaDecodeProblem(std::int64_t B, std::int64_t S, std::int64_t hq, std::int64_t hkv, std::int64_t D, DType dtype,
                   std::uint64_t seed) {
    q = random_tensor({B, S, hq, D}, dtype, seed + 1);
    k = random_tensor({B, S, hkv, D}, dtype, seed + 2);
    v = random_tensor({B, S, hkv, D}, dtype, seed + 3);
    const Tensor q64 = as_f64(q), k64 = as_f64(k), v64 = as_f64(v);
    attn::MhaForwardArgs a;
    a.q = q64;
    a.k = k64;
    a.v = v64;
    a.mask.causal = true;
    ref_out = Tensor::empty({B, S, hq, D}, DType::kFloat64, MemCategory::kWorkspace);
    ref_lse = Tensor::empty({B, hq, S}, DType::kFloat64, MemCategory::kWorkspace);
    attn::reference::mha_forward(a, ref_out, ref_lse);
  }
};

// GDN: q, k [B, S, Hk, K], v [B, S, Hv, V], g, beta [B, S, Hv] of the whole sequence (zero initial state), and the
// fp64 token-by-token reference over it (out and final_state). conv_width W > 0: q, k, v are the inputs of the short
// conv with SiLU, conv_weight [2 Hk K + Hv V, W] (rows q, k, v), and the reference runs the fp64 conv over the whole
// sequence before the recurrence (the training forward of the layer).
struct GdnDecodeProblem {
  Tensor q, k, v, g, beta, conv_weight;
  Tensor ref_out, ref_final;  // fp64 [B, S, Hv, V], [B, Hv, K, V]
  GdnDecodeProblem(std::int64_t B, std::int64_t S, std::int64_t hk, std::int64_t hv, std::int64_t K, std::int64_t V,
                   DType dtype, std::uint64_t seed, std::int64_t conv_width = 0) {
    q = random_tensor({B, S, hk, K}, dtype, seed + 1);
    k = random_tensor({B, S, hk, K}, dtype, seed + 2);
    v = random_tensor({B, S, hv, V}, dtype, seed + 3);
    g = random_tensor({B, S, hv}, dtype, seed + 4, -0.1, -0.001);  // weak decay: the prompt's state matters
    beta = random_tensor({B, S, hv}, dtype, seed + 5, 0.05, 0.5);
    Tensor q64 = as_f64(q), k64 = as_f64(k), v64 = as_f64(v);
    const Tensor g64 = as_f64(g), b64 = as_f64(beta);
    if (conv_width > 0) {
      conv_weight = random_tensor({2 * hk * K + hv * V, conv_width}, dtype, seed + 6, -0.5, 0.5);
      const Tensor w64 = as_f64(conv_weight);
      std::int64_t row = 0;
      for (Tensor* t : {&q64, &k64, &v64}) {  // depthwise: each part with its rows of the weight
        const std::int64_t c = t->dim(2) * t->dim(3);
        Tensor y = Tensor::empty(t->shape(), DType::kFloat64, MemCategory::kWorkspace);
        attn::reference::short_conv_forward(conv_args(t->view().reshape({B, S, c}), w64.view().slice0(row, row + c)),
                                            y.view().reshape({B, S, c}), {});
        *t = std::move(y);
        row += c;
      }
    }
    const attn::GdnForwardArgs a = attn::gdn_args(q64, k64, v64, g64, b64);
    ref_out = Tensor::empty({B, S, hv, V}, DType::kFloat64, MemCategory::kWorkspace);
    ref_final = Tensor::empty({B, hv, K, V}, DType::kFloat64, MemCategory::kWorkspace);
    attn::reference::gdn_forward(a, ref_out, ref_final);
  }
};

// Tolerances of a decode result against the fp64 reference: fp64 inputs to 1e-11 (one softmax / recurrence in
// another order), fp32 to 2e-5 absolute + 2e-4 relative (values of O(1), fp32 accumulation).
inline double decode_atol(DType dtype) { return dtype == DType::kFloat64 ? 1e-11 : 2e-5; }
inline double decode_rtol(DType dtype) { return dtype == DType::kFloat64 ? 1e-11 : 2e-4; }

}  // namespace seqpar::test
