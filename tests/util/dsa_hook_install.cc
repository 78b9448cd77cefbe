// Linked into the DSA test programs (as an object, so that its initializer runs): installs the ops-table compositions
// of attention/ops/dsa_composed.h as the DSA kernels' test-mode routes (dsa_hook.h), and, when
// SEQPAR_LOWERED_ATTENTION = 1, fails the run at its end if no call took that route.
#include <string>

#include "attention/ops/dsa_composed.h"
#include "attention/ops/dsa_hook.h"
#include "runtime/error.h"
#include "tests/util/composed_routes.h"

namespace seqpar::attn::ops {
namespace {

const bool g_installed = [] {
  DsaHooks hooks;
  hooks.forward = &dsa_attention_forward_composed_cpu;
  hooks.backward = &dsa_attention_backward_composed_cpu;
  hooks.topk_block = &dsa_topk_block_composed_cpu;
  hooks.topk_merge = &dsa_topk_merge_composed_cpu;
  hooks.scores_selected = &dsa_indexer_scores_selected_composed_cpu;
  hooks.indexer_loss = &dsa_indexer_loss_composed_cpu;
  hooks.indexer_backward = &dsa_indexer_backward_composed_cpu;
  set_dsa_hooks(hooks);
  seqpar::test::add_composed_route_check("DSA kernel calls", &dsa_hook_calls, [] {
    return str_cat(" (attention forward: ", dsa_attention_forward_hook_calls(), ")");
  });
  return true;
}();

}  // namespace
}  // namespace seqpar::attn::ops
