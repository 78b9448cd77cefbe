// Linked into the GDN test programs (as an object, so that its initializer runs): installs the ops-table GDN forward,
// backward, segment map, map algebra and short conv as the test-mode routes of attention/gdn.h (gdn_hook.h), and,
// when SEQPAR_LOWERED_ATTENTION = 1, fails the run at its end if no call took those routes (so a test run in the mode
// cannot pass without exercising the composition).
#include "attention/ops/gdn_composed.h"
#include "attention/ops/gdn_hook.h"
#include "tests/util/composed_routes.h"

namespace seqpar::attn::ops {
namespace {

const bool g_installed = [] {
  set_gdn_forward_hook(&gdn_forward_composed_cpu, &gdn_transition_composed_cpu);
  set_gdn_backward_hook(&gdn_backward_composed_cpu);
  set_gdn_map_product_hook(&gdn_map_product_composed_cpu);
  set_short_conv_hooks(&short_conv_forward_composed_cpu, &short_conv_backward_composed_cpu);
  seqpar::test::add_composed_route_check("gdn_forward calls", &gdn_forward_hook_calls);
  return true;
}();

}  // namespace
}  // namespace seqpar::attn::ops
