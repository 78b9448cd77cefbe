// A packed DSA row on one device for the packed-row tests (tests/unit/test_dsa_packed_kernel.cc,
// tests/mpi/test_dsa_packed.cc): random inputs of one row (B = 1) and the whole single-device pipeline (top-k with
// document bounds, attention forward and backward, indexer loss and its gradients) through the kernels or the fp64
// reference. Header-only; needs seqpar_dsa and seqpar_reference.
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

#include "attention/dsa.h"
#include "attention/reference/dsa_reference.h"
#include "tests/util/test_util.h"

namespace seqpar::test::dsa_packed {

using Pos = std::vector<std::int64_t>;
// Widths of the problems: heads H (divisible by the Ulysses sizes of the tests), latent Dqk, value Dv, indexer Hi x Di.
inline constexpr std::int64_t H = 4, Dqk = 20, Dv = 16, Hi = 2, Di = 12;

// Random DSA inputs of one row of S rows (B = 1), storage dtype dt.
struct Inputs {
  Tensor q, c, q_idx, w, k_idx, dout;
  Inputs(std::int64_t S, DType dt, std::uint64_t seed) {
    q = random_tensor({1, S, H, Dqk}, dt, seed + 1, -2.0, 2.0);
    c = random_tensor({1, S, Dqk}, dt, seed + 2);
    q_idx = random_tensor({1, S, Hi, Di}, dt, seed + 3);
    w = random_tensor({1, S, Hi}, dt, seed + 4);
    k_idx = random_tensor({1, S, Di}, dt, seed + 5);
    dout = random_tensor({1, S, H, Dv}, dt, seed + 6);
  }
  Inputs() = default;
  std::vector<Tensor*> all() { return {&q, &c, &q_idx, &w, &k_idx, &dout}; }
  std::vector<const Tensor*> all() const { return {&q, &c, &q_idx, &w, &k_idx, &dout}; }
  // Rows [from, from + n) of every tensor (copies).
  Inputs rows(std::int64_t from, std::int64_t n) const {
    Inputs r;
    const std::vector<Tensor*> dst = r.all();
    const std::vector<const Tensor*> src = all();
    for (std::size_t i = 0; i < src.size(); ++i) {
      const Tensor& t = *src[i];
      Shape s = t.shape();
      const std::int64_t row = t.numel() / s[1];
      s[1] = n;
      *dst[i] = Tensor::empty(s, t.dtype(), MemCategory::kWorkspace);
      const std::size_t bytes = dtype_size(t.dtype());
      std::memcpy(dst[i]->data(), static_cast<const char*>(t.data()) + from * row * bytes,
                  static_cast<std::size_t>(n * row) * bytes);
    }
    return r;
  }
};

// Everything one call of the DSA pipeline produces, as fp64 vectors ([1, S, ...] row-major; lse [1, H, S]).
struct Result {
  std::vector<std::int64_t> topk;
  std::vector<double> out, lse, dq, dc, dq_idx, dw, dk_idx, dscores;
  double loss = 0;
};

// Kernels (reference = false) or the fp64 reference: top-k with document bounds, attention forward and backward,
// indexer loss with its gradients. Positions 0..S-1 (the slots of the row).
inline Result run(Inputs& in, std::int64_t K, const Pos& lo, const Pos& hi, bool reference, std::int64_t window = 0) {
  const std::int64_t S = in.q.dim(1);
  const DType acc = accumulator_dtype(in.q.dtype());
  attn::DsaIndexerArgs ia{in.q_idx, in.w, in.k_idx, {}, {}};
  ia.doc_lo = lo;
  ia.doc_hi = hi;
  ia.window = window;
  Tensor topk = Tensor::empty({1, S, K}, DType::kInt64, MemCategory::kWorkspace);
  Tensor out = Tensor::empty({1, S, H, Dv}, reference ? DType::kFloat64 : in.q.dtype(), MemCategory::kWorkspace);
  Tensor lse = Tensor::empty({1, H, S}, reference ? DType::kFloat64 : acc, MemCategory::kWorkspace);
  const DType gd = reference ? DType::kFloat64 : acc;
  Tensor dq = Tensor::empty(in.q.shape(), gd, MemCategory::kWorkspace);
  Tensor dc = Tensor::empty(in.c.shape(), gd, MemCategory::kWorkspace);
  Tensor dq_idx = Tensor::empty(in.q_idx.shape(), gd, MemCategory::kWorkspace);
  Tensor dw = Tensor::empty(in.w.shape(), gd, MemCategory::kWorkspace);
  Tensor dk_idx = Tensor::empty(in.k_idx.shape(), gd, MemCategory::kWorkspace);
  Result r;
  if (reference) {
    attn::reference::dsa_indexer_topk(ia, topk.view());
    attn::DsaAttentionArgs aa{in.q, in.c, topk.view(), {}, {}};
    aa.dim_v = Dv;
    attn::reference::dsa_attention_forward(aa, out.view(), lse.view());
    attn::reference::dsa_attention_backward(aa, in.dout, dq.view(), dc.view());
    r.loss = attn::reference::dsa_indexer_loss(aa, ia, dq_idx.view(), dw.view(), dk_idx.view());
  } else {
    Tensor scores = Tensor::empty({1, S, K}, acc, MemCategory::kWorkspace);
    Tensor pos = Tensor::empty({1, S, K}, DType::kInt64, MemCategory::kWorkspace);
    const attn::DsaTopkState state{scores.view(), pos.view()};
    attn::dsa_topk_init(state);
    attn::dsa_indexer_topk_block(ia, state);
    Tensor sel = Tensor::empty({1, S, K}, acc, MemCategory::kWorkspace);
    attn::dsa_topk_selected_scores(state, sel.view());
    attn::dsa_topk_finalize(state, topk.view());
    attn::DsaAttentionArgs aa{in.q, in.c, topk.view(), {}, {}};
    aa.dim_v = Dv;
    attn::dsa_attention_forward(aa, out.view(), lse.view());
    Tensor probs = Tensor::zeros({1, S, K}, acc, MemCategory::kWorkspace);
    attn::DsaAttentionBackwardArgs ba;
    ba.fwd = aa;
    ba.out = out.view();
    ba.dout = in.dout.view();
    ba.lse = lse.view();
    ba.probs = probs.view();
    attn::dsa_attention_backward(ba, dq.view(), dc.view(), false);
    Tensor dscores = Tensor::empty({1, S, K}, acc, MemCategory::kWorkspace);
    r.loss = attn::dsa_indexer_loss({probs.view(), sel.view(), topk.view()}, dscores.view());
    attn::dsa_indexer_backward(ia, topk.view(), dscores.view(), dq_idx.view(), dw.view(), dk_idx.view(), false);
    r.dscores = test::to_double(dscores.view());
  }
  const std::int64_t* t = topk.data_as<std::int64_t>();
  r.topk.assign(t, t + S * K);
  r.out = test::to_double(out.view());
  r.lse = test::to_double(lse.view());
  r.dq = test::to_double(dq.view());
  r.dc = test::to_double(dc.view());
  r.dq_idx = test::to_double(dq_idx.view());
  r.dw = test::to_double(dw.view());
  r.dk_idx = test::to_double(dk_idx.view());
  return r;
}

}  // namespace seqpar::test::dsa_packed
