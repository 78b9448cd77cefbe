// Linked with tests/util/dsa_hook_install.cc (the same object library): with SEQPAR_TEST_DEVICE=cuda, the DSA
// test-mode routes that dsa_hook_install.cc installs on the CPU table (every DSA kernel that computes) are installed
// again on the CUDA table (tests/util/ops_table.h) before the first test, so that the existing DSA tests under
// SEQPAR_LOWERED_ATTENTION=1 (test_dsa, test_dsa_packed_kernel, test_decode and the DSA CP tests) run the composition
// on the device (scripts/gpu_check.sh, phases ops and cp). Without a usable CUDA table (a CPU build, no device) the
// run in the mode skips every test with the reason, never runs them on the CPU table. Without SEQPAR_TEST_DEVICE=cuda nothing
// changes.
#include <gtest/gtest.h>

#include "attention/ops/dsa_hook.h"
#include "tests/util/composed_routes.h"
#include "tests/util/ops_table.h"

namespace seqpar::test {
namespace {

const bool g_added = [] {
  add_cuda_table_routes("DSA", [] {
    attn::ops::DsaHooks hooks;
    hooks.forward = &composed::dsa_attention_forward;
    hooks.backward = &composed::dsa_attention_backward;
    hooks.topk_block = &composed::dsa_topk_block;
    hooks.topk_merge = &composed::dsa_topk_merge;
    hooks.scores_selected = &composed::dsa_indexer_scores_selected;
    hooks.indexer_loss = &composed::dsa_indexer_loss;
    hooks.indexer_backward = &composed::dsa_indexer_backward;
    attn::ops::set_dsa_hooks(hooks);
  });
  return true;
}();

}  // namespace
}  // namespace seqpar::test
