// The test-mode route of attn::dsa_attention_forward to the ops-table composition (attention/ops/dsa_composed.h)
// under SEQPAR_LOWERED_ATTENTION = 1, as gdn_hook.h does for GDN. Part of seqpar_dsa; installed by
// attention/ops/dsa_hook_install.cc, linked into the DSA tests.
#pragma once

#include <cstdint>

#include "../dsa.h"

namespace seqpar::attn::ops {

using DsaAttentionForwardFn = void (*)(const DsaAttentionArgs& args, const TensorView& out, const TensorView& lse);

// Installs (or, with nullptr, removes) the forward that dsa_attention_forward hands its calls to in the test mode.
void set_dsa_attention_forward_hook(DsaAttentionForwardFn fn);

// Calls handed to the hook in this process so far.
std::int64_t dsa_attention_forward_hook_calls();

namespace detail {
// In dsa_attention_forward, after its stream check: runs the hook and returns true when the mode is on and a hook is
// installed; else false.
bool dsa_attention_forward_hooked(const DsaAttentionArgs& args, const TensorView& out, const TensorView& lse);
}  // namespace detail

}  // namespace seqpar::attn::ops
