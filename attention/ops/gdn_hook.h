// The test-mode route of attn::gdn_forward and attn::gdn_transition to another implementation (the ops-table
// composition, attention/ops/gdn_composed.h) under SEQPAR_LOWERED_ATTENTION = 1. Part of seqpar_gdn, which knows
// nothing of the ops table: a program that links the composition installs it (attention/ops/gdn_hook_install.cc, linked
// into the GDN tests), so the existing GDN tests and the CP tests above them run the composed forward.
#pragma once

#include <cstdint>

#include "../../runtime/device.h"
#include "../gdn.h"

namespace seqpar::attn::ops {

using GdnForwardFn = void (*)(const GdnForwardArgs& args, const TensorView& out, const TensorView& final_state);
using GdnTransitionFn = void (*)(const GdnForwardArgs& args, const TensorView& m, const TensorView& u);

// Installs (or, with nullptr, removes) the forward and the segment map that gdn_forward and gdn_transition hand
// their calls to in the test mode.
void set_gdn_forward_hook(GdnForwardFn fn, GdnTransitionFn transition);

// Calls of gdn_forward and gdn_transition handed to the hooks in this process so far (tests check that the mode was
// taken).
std::int64_t gdn_forward_hook_calls();

namespace detail {
// In gdn_forward, after its stream check: runs the hook and returns true when the mode is on and a hook is
// installed; else false (gdn_forward runs its own kernel).
bool gdn_forward_hooked(const GdnForwardArgs& args, const TensorView& out, const TensorView& final_state);
// Whether gdn_forward would hand its call to the hook now (the mode is on and a hook installed).
bool gdn_forward_hook_active();
// The same for gdn_transition.
bool gdn_transition_hooked(const GdnForwardArgs& args, const TensorView& m, const TensorView& u);
}  // namespace detail

}  // namespace seqpar::attn::ops
