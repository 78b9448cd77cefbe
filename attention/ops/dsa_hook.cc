// The test-mode route of dsa_attention_forward (dsa_hook.h).
#include "dsa_hook.h"

#include <atomic>

#include "../../runtime/env.h"

namespace seqpar::attn::ops {
namespace {
std::atomic<DsaAttentionForwardFn> g_hook{nullptr};
std::atomic<std::int64_t> g_calls{0};
}  // namespace

void set_dsa_attention_forward_hook(DsaAttentionForwardFn fn) { g_hook.store(fn); }
std::int64_t dsa_attention_forward_hook_calls() { return g_calls.load(); }

namespace detail {
bool dsa_attention_forward_hooked(const DsaAttentionArgs& args, const TensorView& out, const TensorView& lse) {
  const DsaAttentionForwardFn fn = g_hook.load();
  if (fn == nullptr || !env::lowered_attention()) return false;
  fn(args, out, lse);
  g_calls.fetch_add(1);
  return true;
}
}  // namespace detail

}  // namespace seqpar::attn::ops
