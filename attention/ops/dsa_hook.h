// The test-mode route of the DSA kernels of attention/dsa.h to the ops-table composition (attention/ops/dsa_composed.h)
// under SEQPAR_LOWERED_ATTENTION = 1, as gdn_hook.h does for GDN. Part of seqpar_dsa; installed by
// tests/util/dsa_hook_install.cc, linked into the DSA tests. Every kernel that computes runs composed when its hook
// is installed: the attention forward, backward and probs, the indexer's block top-k and the merge of top-k states,
// the selected scores, the KL loss and the indexer backward. dsa_topk_init, dsa_topk_finalize,
// dsa_topk_selected_scores (which read a state in any order) and dsa_attention_delta stay the boundary's.
#pragma once

#include <cstdint>

#include "../dsa.h"

namespace seqpar::attn::ops {

using DsaAttentionForwardFn = void (*)(const DsaAttentionArgs& args, const TensorView& out, const TensorView& lse);

// The composed kernels the boundary hands its calls to, each called after the boundary's own checks (the forward:
// after its stream check) with the arguments of the kernel it replaces; nullptr: that kernel stays the CPU kernel's.
struct DsaHooks {
  DsaAttentionForwardFn forward = nullptr;
  // dsa_attention_backward with delta resolved (computed by the boundary when not given), and dsa_attention_probs
  // (dout, delta, dq, dc absent: probs only).
  void (*backward)(const DsaAttentionArgs& args, const TensorView& lse, const TensorView& dout, const TensorView& delta,
                   const TensorView& dq, const TensorView& dc, bool accumulate, const TensorView& probs) = nullptr;
  void (*topk_block)(const DsaIndexerArgs& args, const DsaTopkState& state) = nullptr;
  void (*topk_merge)(const DsaTopkState& state, const DsaTopkState& other) = nullptr;
  void (*scores_selected)(const DsaIndexerArgs& args, const TensorView& topk_indices,
                          const TensorView& scores) = nullptr;
  double (*indexer_loss)(const DsaIndexerLossArgs& args, const TensorView& dscores) = nullptr;
  void (*indexer_backward)(const DsaIndexerArgs& args, const TensorView& topk_indices, const TensorView& dscores,
                           const TensorView& dq_idx, const TensorView& dw, const TensorView& dk_idx,
                           bool accumulate) = nullptr;
};

// Installs the hooks (a copy; before any DSA call of the process).
void set_dsa_hooks(const DsaHooks& hooks);

// Installs (or, with nullptr, removes) the forward that dsa_attention_forward hands its calls to in the test mode.
void set_dsa_attention_forward_hook(DsaAttentionForwardFn fn);

// Calls handed to the forward hook in this process so far, and to any hook.
std::int64_t dsa_attention_forward_hook_calls();
std::int64_t dsa_hook_calls();

namespace detail {
// In dsa_attention_forward, after its stream check: runs the hook and returns true when the mode is on and a hook is
// installed; else false.
bool dsa_attention_forward_hooked(const DsaAttentionArgs& args, const TensorView& out, const TensorView& lse);
// The installed hooks when the mode is on, else nullptr. The boundary calls note_dsa_hook_call() after each hook.
const DsaHooks* active_dsa_hooks();
void note_dsa_hook_call();
}  // namespace detail

}  // namespace seqpar::attn::ops
