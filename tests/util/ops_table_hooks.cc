// Linked with tests/util/gdn_hook_install.cc (the same object library): with SEQPAR_TEST_DEVICE=cuda, the GDN
// test-mode routes that gdn_hook_install.cc installs on the CPU table are installed again on the CUDA table
// (tests/util/ops_table.h) before the first test (a gtest environment runs after every static initializer), so that
// the existing GDN tests under SEQPAR_LOWERED_ATTENTION=1 run the composition on the device (scripts/gpu_check.sh,
// phase ops). Without a usable CUDA table (a CPU build, no device) the run skips every test with the reason
// (ops_table_route_skip) in the mode, never runs them on the CPU table. Without SEQPAR_TEST_DEVICE=cuda nothing changes.
#include <gtest/gtest.h>

#include "attention/ops/gdn_hook.h"
#include "tests/util/composed_routes.h"
#include "tests/util/ops_table.h"

namespace seqpar::test {
namespace {

const bool g_added = [] {
  add_cuda_table_routes("GDN", [] {
    attn::ops::set_gdn_forward_hook(&composed::gdn_forward, &composed::gdn_transition);
    attn::ops::set_gdn_backward_hook(&composed::gdn_backward);
    attn::ops::set_gdn_map_product_hook(&composed::gdn_map_product);
    attn::ops::set_short_conv_hooks(&composed::short_conv_forward, &composed::short_conv_backward);
  });
  return true;
}();

}  // namespace
}  // namespace seqpar::test
