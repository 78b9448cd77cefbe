// Linked into the DSA test programs (as an object, so that its initializer runs): installs the ops-table compositions
// of attention/ops/dsa_composed.h as the DSA kernels' test-mode routes (dsa_hook.h), and, when
// SEQPAR_LOWERED_ATTENTION = 1, fails the run at its end if no call took that route.
#include <gtest/gtest.h>

#include <cstdio>

#include "runtime/env.h"
#include "attention/ops/dsa_composed.h"
#include "attention/ops/dsa_hook.h"

namespace seqpar::attn::ops {
namespace {

class ComposedRouteTaken : public ::testing::Environment {
 public:
  void TearDown() override {
    // (a run skipped as a whole, e.g. SEQPAR_TEST_DEVICE=cuda without a device, has said why and ran nothing)
    if (env::lowered_attention() && ::testing::UnitTest::GetInstance()->test_to_run_count() > 0 &&
        !::testing::Test::IsSkipped()) {
      EXPECT_GT(dsa_hook_calls(), 0) << "SEQPAR_LOWERED_ATTENTION=1 but no DSA kernel call ran composed";
      std::printf("DSA kernel calls run composed: %lld (attention forward: %lld)\n",
                  static_cast<long long>(dsa_hook_calls()), static_cast<long long>(dsa_attention_forward_hook_calls()));
    }
  }
};

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
  ::testing::AddGlobalTestEnvironment(new ComposedRouteTaken);
  return true;
}();

}  // namespace
}  // namespace seqpar::attn::ops
