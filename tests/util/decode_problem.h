// Shared by the decode tests (single device and under CP): a prompt of T tokens followed by decode steps, as one
// sequence of T + steps * n tokens, and its independent result: the fp64 references (attention/reference) run over
// the whole sequence, whose rows T.. are what the decode steps must return.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "attention/dsa.h"
#include "attention/gdn_decode.h"
#include "attention/mha.h"
#include "attention/reference/dsa_reference.h"
#include "attention/reference/gdn_reference.h"
#include "attention/reference/mha_reference.h"
#include "parallel/decode_cp.h"
#include "runtime/memory.h"
#include "runtime/tensor_ops.h"
#include "tests/util/test_util.h"

namespace seqpar::test {

// Rows [begin, end) of dimension `dim` of `full` (a copy, workspace).
inline Tensor rows_of(const TensorView& full, std::int64_t begin, std::int64_t end, int dim = 1) {
  return slice_dim(full, dim, begin, end);
}

// The ledger's persistent_cache bytes now (the caches' category).
inline std::int64_t persistent_bytes() {
  return memory_ledger().snapshot().current[static_cast<int>(MemCategory::kPersistentCache)];
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

// DSA: q [B, S, H, Dqk], c [B, S, Dqk], q_idx [B, S, Hi, Di], k_idx [B, S, Di], w [B, S, Hi] of the whole sequence,
// and its training forward: topk_indices [B, S, k] of the single-device kernel on the inputs' dtype (attn::
// dsa_indexer_topk over all keys: what a decode must return bitwise), and out, lse of the fp64 reference attention
// over that selection. For fp64 inputs the selection also equals the fp64 reference's (ref_topk_matches).
struct DsaDecodeProblem {
  Tensor q, c, q_idx, k_idx, w;
  Tensor topk_indices;      // int64 [B, S, k]
  Tensor ref_out, ref_lse;  // fp64 [B, S, H, Dv], [B, H, S]
  bool ref_topk_matches = true;
  DsaDecodeProblem(std::int64_t B, std::int64_t S, std::int64_t H, std::int64_t dqk, std::int64_t dv, std::int64_t hi,
                   std::int64_t di, std::int64_t topk, std::int64_t window, DType dtype, std::uint64_t seed) {
    q = random_tensor({B, S, H, dqk}, dtype, seed + 1);
    c = random_tensor({B, S, dqk}, dtype, seed + 2);
    q_idx = random_tensor({B, S, hi, di}, dtype, seed + 3);
    k_idx = random_tensor({B, S, di}, dtype, seed + 4);
    w = random_tensor({B, S, hi}, dtype, seed + 5);
    attn::DsaIndexerArgs idx{q_idx, w, k_idx, {}, {}};
    idx.window = window;
    topk_indices = Tensor::empty({B, S, topk}, DType::kInt64, MemCategory::kWorkspace);
    attn::dsa_indexer_topk(idx, topk_indices);
    const Tensor q64 = as_f64(q), c64 = as_f64(c), qi64 = as_f64(q_idx), ki64 = as_f64(k_idx), w64 = as_f64(w);
    if (dtype == DType::kFloat64) {
      attn::DsaIndexerArgs idx64{qi64, w64, ki64, {}, {}};
      idx64.window = window;
      Tensor ref_topk = Tensor::empty({B, S, topk}, DType::kInt64, MemCategory::kWorkspace);
      attn::reference::dsa_indexer_topk(idx64, ref_topk);
      ref_topk_matches = to_double(ref_topk) == to_double(topk_indices);
    }
    attn::DsaAttentionArgs a;
    a.q = q64;
    a.c = c64;
    a.topk_indices = topk_indices;
    a.dim_v = dv;
    ref_out = Tensor::empty({B, S, H, dv}, DType::kFloat64, MemCategory::kWorkspace);
    ref_lse = Tensor::empty({B, H, S}, DType::kFloat64, MemCategory::kWorkspace);
    attn::reference::dsa_attention_forward(a, ref_out, ref_lse);
  }
};

// Tolerances of a decode result against the fp64 reference: fp64 inputs to 1e-11 (one softmax / recurrence in
// another order), fp32 to 2e-5 absolute + 2e-4 relative (values of O(1), fp32 accumulation).
inline double decode_atol(DType dtype) { return dtype == DType::kFloat64 ? 1e-11 : 2e-5; }
inline double decode_rtol(DType dtype) { return dtype == DType::kFloat64 ? 1e-11 : 2e-4; }

// The global positions [t0, t1) of a step's tokens.
inline std::vector<std::int64_t> step_positions(std::int64_t t0, std::int64_t t1) {
  std::vector<std::int64_t> pos;
  for (std::int64_t t = t0; t < t1; ++t) pos.push_back(t);
  return pos;
}

// A step's out [B, n, H, D] and lse [B, H, n] against rows [t0, t1) of the reference's out [B, S, H, D] and
// lse [B, H, S], with the decode tolerances of `dtype`.
inline void expect_step_close(const TensorView& out, const TensorView& lse, const TensorView& ref_out,
                              const TensorView& ref_lse, std::int64_t t0, std::int64_t t1, DType dtype,
                              const std::string& what) {
  EXPECT_TRUE(all_close(to_double(out), to_double(rows_of(ref_out, t0, t1)), decode_atol(dtype), decode_rtol(dtype),
                        str_cat("out of ", what)));
  EXPECT_TRUE(all_close(to_double(lse), to_double(rows_of(ref_lse, t0, t1, 2)), decode_atol(dtype), decode_rtol(dtype),
                        str_cat("lse of ", what)));
}

}  // namespace seqpar::test
