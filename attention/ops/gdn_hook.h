// The test-mode route of attn::gdn_forward, gdn_backward, gdn_transition, the segment-map algebra and the short conv to
// another implementation (the ops-table composition, attention/ops/gdn_composed.h) under SEQPAR_LOWERED_ATTENTION = 1.
// Part of seqpar_gdn, which knows nothing of the ops table: a program that links the composition installs it
// (tests/util/gdn_hook_install.cc, linked into the GDN tests), so the existing GDN tests, the decode tests and the
// CP tests above them run the composition.
#pragma once

#include <cstdint>

#include "../../runtime/device.h"
#include "../gdn.h"

namespace seqpar::attn::ops {

using GdnForwardFn = void (*)(const GdnForwardArgs& args, const TensorView& out, const TensorView& final_state);
using GdnTransitionFn = void (*)(const GdnForwardArgs& args, const TensorView& m, const TensorView& u);
using GdnBackwardFn = void (*)(const GdnBackwardArgs& args, const TensorView& dq, const TensorView& dk,
                               const TensorView& dv, const TensorView& dg, const TensorView& dbeta,
                               const TensorView& dinitial_state);

// out = op(m) x (+ addend), x empty = the identity (attention/ops/gdn_composed.h, gdn_map_product_composed).
using GdnMapProductFn = void (*)(bool transpose_m, const TensorView& m, const TensorView& x, const TensorView& addend,
                                 const TensorView& out);

using ShortConvForwardFn = void (*)(const ShortConvArgs& args, const TensorView& out,
                                    const TensorView& final_conv_state);
using ShortConvBackwardFn = void (*)(const ShortConvArgs& args, const TensorView& dout, const TensorView& dx,
                                     const TensorView& dweight, const TensorView& dinitial_conv_state);

// Installs (or, with nullptr, removes) the forward and the segment map that gdn_forward and gdn_transition hand
// their calls to in the test mode.
void set_gdn_forward_hook(GdnForwardFn fn, GdnTransitionFn transition);
// The same for gdn_backward.
void set_gdn_backward_hook(GdnBackwardFn fn);
// The same for the segment-map algebra (gdn_transition_compose, _apply, _apply_adjoint, _transpose).
void set_gdn_map_product_hook(GdnMapProductFn fn);
// The same for short_conv_forward and short_conv_backward.
void set_short_conv_hooks(ShortConvForwardFn forward, ShortConvBackwardFn backward);

// Calls of gdn_forward, gdn_backward and gdn_transition handed to the hooks in this process so far (tests check that
// the mode was taken).
std::int64_t gdn_forward_hook_calls();

namespace detail {
// In gdn_forward, after its stream check: runs the hook and returns true when the mode is on and a hook is
// installed; else false (gdn_forward runs its own kernel).
bool gdn_forward_hooked(const GdnForwardArgs& args, const TensorView& out, const TensorView& final_state);
// Whether gdn_forward would hand its call to the hook now (the mode is on and a hook installed).
bool gdn_forward_hook_active();
// The same for gdn_transition.
bool gdn_transition_hooked(const GdnForwardArgs& args, const TensorView& m, const TensorView& u);
// The same for gdn_backward.
bool gdn_backward_hook_active();
bool gdn_backward_hooked(const GdnBackwardArgs& args, const TensorView& dq, const TensorView& dk, const TensorView& dv,
                         const TensorView& dg, const TensorView& dbeta, const TensorView& dinitial_state);
// The same for the segment-map algebra, after its argument checks: one product.
bool gdn_map_product_hooked(bool transpose_m, const TensorView& m, const TensorView& x, const TensorView& addend,
                            const TensorView& out);
// The same for the short conv, after its argument checks.
bool short_conv_forward_hooked(const ShortConvArgs& args, const TensorView& out, const TensorView& final_conv_state);
bool short_conv_backward_hooked(const ShortConvArgs& args, const TensorView& dout, const TensorView& dx,
                                const TensorView& dweight, const TensorView& dinitial_conv_state);
}  // namespace detail

}  // namespace seqpar::attn::ops
