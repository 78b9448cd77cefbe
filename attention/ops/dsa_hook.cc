// The test-mode route of the DSA kernels (dsa_hook.h).
#include "dsa_hook.h"

#include <atomic>

#include "../../runtime/env.h"

namespace seqpar::attn::ops {
namespace {
DsaHooks g_hooks;  // written by the installers before any call, read-only afterwards
std::atomic<DsaAttentionForwardFn> g_forward{nullptr};
std::atomic<std::int64_t> g_forward_calls{0}, g_calls{0};
}  // namespace

void set_dsa_hooks(const DsaHooks& hooks) {
  g_hooks = hooks;
  g_forward.store(hooks.forward);
}
void set_dsa_attention_forward_hook(DsaAttentionForwardFn fn) {
  g_hooks.forward = fn;
  g_forward.store(fn);
}
std::int64_t dsa_attention_forward_hook_calls() { return g_forward_calls.load(); }
std::int64_t dsa_hook_calls() { return g_calls.load(); }

namespace detail {
bool dsa_attention_forward_hooked(const DsaAttentionArgs& args, const TensorView& out, const TensorView& lse) {
  const DsaAttentionForwardFn fn = g_forward.load();
  if (fn == nullptr || !env::lowered_attention()) return false;
  fn(args, out, lse);
  g_forward_calls.fetch_add(1);
  g_calls.fetch_add(1);
  return true;
}
const DsaHooks* active_dsa_hooks() { return env::lowered_attention() ? &g_hooks : nullptr; }
void note_dsa_hook_call() { g_calls.fetch_add(1); }
}  // namespace detail

}  // namespace seqpar::attn::ops
