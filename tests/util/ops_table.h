// The ops table that the tests of the composed algorithms (attention/ops/*_composed.h) run on, chosen by
// SEQPAR_TEST_DEVICE: unset or cpu, the CPU table; cuda, the CUDA table on device 0 (attention/cuda/ops_cuda.h; an
// error naming the reason when none is usable, so that a run asked to use the device never passes on the CPU). The
// compositions take host tensors and move them through the table's memory, so the same test bodies run on both.
#pragma once

#include <cstdlib>
#include <string>

#include "attention/cuda/ops_cuda.h"
#include "attention/ops/dsa_composed.h"
#include "attention/ops/gdn_composed.h"
#include "attention/ops/ops_cpu.h"
#include "runtime/error.h"

namespace seqpar::test {

// Whether SEQPAR_TEST_DEVICE selects the CUDA table (throws on a value other than cpu / cuda).
inline bool ops_table_is_cuda() {
  const char* env = std::getenv("SEQPAR_TEST_DEVICE");
  const std::string name = env == nullptr || *env == '\0' ? "cpu" : env;
  SEQPAR_CHECK(name == "cpu" || name == "cuda", "SEQPAR_TEST_DEVICE=", name, " must be cpu or cuda");
  return name == "cuda";
}

// Why the CUDA table cannot run here (seqpar built without CUDA, no usable device); empty when it can.
inline std::string cuda_table_unavailable_reason() {
  if (!attn::ops::cuda_ops_built()) return "seqpar was built without CUDA (SEQPAR_WITH_CUDA=OFF)";
  if (cuda_device_count() <= 0) return cuda_unavailable_reason();
  return {};
}

// The message of a test-mode route (tests/util/ops_table_hooks.cc, ops_table_dsa_hooks.cc) that skips its whole run
// because SEQPAR_TEST_DEVICE=cuda asks for the CUDA table and none is usable; scripts/gpu_check.sh fails on it.
inline std::string ops_table_route_skip(const char* kind, const std::string& reason) {
  return std::string("SEQPAR_TEST_DEVICE=cuda: no CUDA ops table for the composed ") + kind +
         " route, every test skipped: " + reason;
}

// Calls f(table) with the selected table of `dtype`'s arithmetic dtype.
template <typename F>
void with_test_ops(DType dtype, F&& f) {
  if (ops_table_is_cuda())
    attn::ops::with_cuda_ops(dtype, Device::cuda(0), Stream{Device::cuda(0), nullptr}, f);
  else
    attn::ops::with_cpu_ops(dtype, f);
}

// The composed entry points on the selected table (the *_composed_cpu functions' signatures).
namespace composed {
inline void gdn_forward(const attn::GdnForwardArgs& a, const TensorView& out, const TensorView& final_state) {
  with_test_ops(a.q.dtype(), [&](auto& ops) { attn::ops::gdn_forward_composed(ops, a, out, final_state); });
}
inline void gdn_transition(const attn::GdnForwardArgs& a, const TensorView& m, const TensorView& u) {
  with_test_ops(a.q.dtype(), [&](auto& ops) { attn::ops::gdn_transition_composed(ops, a, m, u); });
}
inline void gdn_backward(const attn::GdnBackwardArgs& a, const TensorView& dq, const TensorView& dk,
                         const TensorView& dv, const TensorView& dg, const TensorView& dbeta,
                         const TensorView& dinitial_state) {
  with_test_ops(a.fwd.q.dtype(),
                [&](auto& ops) { attn::ops::gdn_backward_composed(ops, a, dq, dk, dv, dg, dbeta, dinitial_state); });
}
inline void gdn_map_product(bool transpose_m, const TensorView& m, const TensorView& x, const TensorView& addend,
                            const TensorView& out) {
  with_test_ops(m.dtype(),
                [&](auto& ops) { attn::ops::gdn_map_product_composed(ops, transpose_m, m, x, addend, out); });
}
inline void short_conv_forward(const attn::ShortConvArgs& a, const TensorView& out,
                               const TensorView& final_conv_state) {
  with_test_ops(a.x.dtype(), [&](auto& ops) { attn::ops::short_conv_forward_composed(ops, a, out, final_conv_state); });
}
inline void short_conv_backward(const attn::ShortConvArgs& a, const TensorView& dout, const TensorView& dx,
                                const TensorView& dweight, const TensorView& dinitial_conv_state) {
  with_test_ops(a.x.dtype(), [&](auto& ops) {
    attn::ops::short_conv_backward_composed(ops, a, dout, dx, dweight, dinitial_conv_state);
  });
}
inline void dsa_indexer_topk(const attn::DsaIndexerArgs& a, const TensorView& topk_indices,
                             const TensorView& scores = {}) {
  with_test_ops(a.q_idx.dtype(),
                [&](auto& ops) { attn::ops::dsa_indexer_topk_composed(ops, a, topk_indices, scores); });
}
inline void dsa_attention_forward(const attn::DsaAttentionArgs& a, const TensorView& out, const TensorView& lse) {
  with_test_ops(a.q.dtype(), [&](auto& ops) { attn::ops::dsa_attention_forward_composed(ops, a, out, lse); });
}
inline void dsa_topk_block(const attn::DsaIndexerArgs& a, const attn::DsaTopkState& state) {
  with_test_ops(a.q_idx.dtype(), [&](auto& ops) { attn::ops::dsa_topk_block_composed(ops, a, state); });
}
inline void dsa_topk_merge(const attn::DsaTopkState& state, const attn::DsaTopkState& other) {
  with_test_ops(state.scores.dtype(), [&](auto& ops) { attn::ops::dsa_topk_merge_composed(ops, state, other); });
}
inline void dsa_attention_backward(const attn::DsaAttentionArgs& a, const TensorView& lse, const TensorView& dout,
                                   const TensorView& delta, const TensorView& dq, const TensorView& dc, bool accumulate,
                                   const TensorView& probs) {
  with_test_ops(a.q.dtype(), [&](auto& ops) {
    attn::ops::dsa_attention_backward_composed(ops, a, lse, dout, delta, dq, dc, accumulate, probs);
  });
}
inline void dsa_indexer_scores_selected(const attn::DsaIndexerArgs& a, const TensorView& topk_indices,
                                        const TensorView& scores) {
  with_test_ops(a.q_idx.dtype(),
                [&](auto& ops) { attn::ops::dsa_indexer_scores_selected_composed(ops, a, topk_indices, scores); });
}
inline void dsa_indexer_backward(const attn::DsaIndexerArgs& a, const TensorView& topk_indices,
                                 const TensorView& dscores, const TensorView& dq_idx, const TensorView& dw,
                                 const TensorView& dk_idx, bool accumulate) {
  with_test_ops(a.q_idx.dtype(), [&](auto& ops) {
    attn::ops::dsa_indexer_backward_composed(ops, a, topk_indices, dscores, dq_idx, dw, dk_idx, accumulate);
  });
}
inline double dsa_indexer_loss(const attn::DsaIndexerLossArgs& a, const TensorView& dscores) {
  double loss = 0.0;
  with_test_ops(a.probs.dtype(), [&](auto& ops) { loss = attn::ops::dsa_indexer_loss_composed(ops, a, dscores); });
  return loss;
}
}  // namespace composed

}  // namespace seqpar::test
