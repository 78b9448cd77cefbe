// Linked into the DSA test programs (as an object, so that its initializer runs): installs the ops-table sparse
// latent attention forward as dsa_attention_forward's test-mode route (dsa_hook.h), and, when
// SEQPAR_LOWERED_ATTENTION = 1, fails the run at its end if no call took that route.
#include <gtest/gtest.h>

#include "../../runtime/env.h"
#include "dsa_composed.h"
#include "dsa_hook.h"

namespace seqpar::attn::ops {
namespace {

class ComposedRouteTaken : public ::testing::Environment {
 public:
  void TearDown() override {
    if (env::lowered_attention() && ::testing::UnitTest::GetInstance()->test_to_run_count() > 0) {
      EXPECT_GT(dsa_attention_forward_hook_calls(), 0)
          << "SEQPAR_LOWERED_ATTENTION=1 but no dsa_attention_forward call ran composed";
    }
  }
};

const bool g_installed = [] {
  set_dsa_attention_forward_hook(&dsa_attention_forward_composed_cpu);
  ::testing::AddGlobalTestEnvironment(new ComposedRouteTaken);
  return true;
}();

}  // namespace
}  // namespace seqpar::attn::ops
