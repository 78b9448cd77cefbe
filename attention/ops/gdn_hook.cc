// The test-mode route of gdn_forward (gdn_hook.h).
#include "gdn_hook.h"

#include <atomic>

#include "../../runtime/env.h"

namespace seqpar::attn::ops {
namespace {
std::atomic<GdnForwardFn> g_hook{nullptr};
std::atomic<GdnTransitionFn> g_transition{nullptr};
std::atomic<std::int64_t> g_calls{0};
}  // namespace

void set_gdn_forward_hook(GdnForwardFn fn, GdnTransitionFn transition) {
  g_hook.store(fn);
  g_transition.store(transition);
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
bool gdn_forward_hook_active() { return g_hook.load() != nullptr && env::lowered_attention(); }
bool gdn_transition_hooked(const GdnForwardArgs& args, const TensorView& m, const TensorView& u) {
  const GdnTransitionFn fn = g_transition.load();
  if (fn == nullptr || !env::lowered_attention()) return false;
  fn(args, m, u);
  g_calls.fetch_add(1);
  return true;
}
}  // namespace detail

}  // namespace seqpar::attn::ops
