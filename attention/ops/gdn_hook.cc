// The test-mode route of gdn_forward (gdn_hook.h).
#include "gdn_hook.h"

#include <atomic>

#include "../../runtime/env.h"

namespace seqpar::attn::ops {
namespace {
std::atomic<GdnForwardFn> g_hook{nullptr};
std::atomic<GdnTransitionFn> g_transition{nullptr};
std::atomic<GdnBackwardFn> g_backward{nullptr};
std::atomic<GdnMapProductFn> g_map_product{nullptr};
std::atomic<ShortConvForwardFn> g_conv_forward{nullptr};
std::atomic<ShortConvBackwardFn> g_conv_backward{nullptr};
std::atomic<std::int64_t> g_calls{0};
}  // namespace

void set_gdn_forward_hook(GdnForwardFn fn, GdnTransitionFn transition) {
  g_hook.store(fn);
  g_transition.store(transition);
}
void set_gdn_backward_hook(GdnBackwardFn fn) { g_backward.store(fn); }
void set_gdn_map_product_hook(GdnMapProductFn fn) { g_map_product.store(fn); }
void set_short_conv_hooks(ShortConvForwardFn forward, ShortConvBackwardFn backward) {
  g_conv_forward.store(forward);
  g_conv_backward.store(backward);
}
std::int64_t gdn_forward_hook_calls() { return g_calls.load(); }

namespace detail {
bool gdn_forward_hooked(const GdnForwardArgs& args, const TensorView& out, const TensorView& final_state) {
  const GdnForwardFn fn = g_hook.load();
  if (fn == nullptr || !env::lowered_attention()) return false;
  fn(args, out, final_state);
  g_calls.fetch_add(1);
  return true;
}
bool gdn_transition_hooked(const GdnForwardArgs& args, const TensorView& m, const TensorView& u) {
  const GdnTransitionFn fn = g_transition.load();
  if (fn == nullptr || !env::lowered_attention()) return false;
  fn(args, m, u);
  g_calls.fetch_add(1);
  return true;
}
bool gdn_backward_hooked(const GdnBackwardArgs& args, const TensorView& dq, const TensorView& dk, const TensorView& dv,
                         const TensorView& dg, const TensorView& dbeta, const TensorView& dinitial_state) {
  const GdnBackwardFn fn = g_backward.load();
  if (fn == nullptr || !env::lowered_attention()) return false;
  fn(args, dq, dk, dv, dg, dbeta, dinitial_state);
  g_calls.fetch_add(1);
  return true;
}
bool gdn_map_product_hooked(bool transpose_m, const TensorView& m, const TensorView& x, const TensorView& addend,
                            const TensorView& out) {
  const GdnMapProductFn fn = g_map_product.load();
  if (fn == nullptr || !env::lowered_attention()) return false;
  fn(transpose_m, m, x, addend, out);
  g_calls.fetch_add(1);
  return true;
}
bool short_conv_forward_hooked(const ShortConvArgs& args, const TensorView& out, const TensorView& final_conv_state) {
  const ShortConvForwardFn fn = g_conv_forward.load();
  if (fn == nullptr || !env::lowered_attention()) return false;
  fn(args, out, final_conv_state);
  g_calls.fetch_add(1);
  return true;
}
bool short_conv_backward_hooked(const ShortConvArgs& args, const TensorView& dout, const TensorView& dx,
                                const TensorView& dweight, const TensorView& dinitial_conv_state) {
  const ShortConvBackwardFn fn = g_conv_backward.load();
  if (fn == nullptr || !env::lowered_attention()) return false;
  fn(args, dout, dx, dweight, dinitial_conv_state);
  g_calls.fetch_add(1);
  return true;
}
}  // namespace detail

}  // namespace seqpar::attn::ops
