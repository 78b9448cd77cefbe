// The end-of-run check of the composed-hook installers (tests/util/gdn_hook_install.cc, dsa_hook_install.cc): with
// SEQPAR_LOWERED_ATTENTION = 1, a test program whose kernel calls never took the composed route fails at its end, so
// that a run in the mode cannot pass without exercising the composition. Header-only: one program may link both.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <cstdio>
#include <functional>
#include <string>
#include <utility>

#include "runtime/env.h"

namespace seqpar::test {

// Adds a gtest environment whose TearDown, in the mode and when tests ran (a run skipped as a whole, e.g.
// SEQPAR_TEST_DEVICE=cuda without a device, has said why and ran nothing), expects calls() > 0 and prints
// "<what> run composed: <calls()><detail()>".
// Args: what: the calls counted, e.g. "DSA kernel calls"; calls: the composed route's call counter; detail: more to
//   print after the count (optional).
inline void add_composed_route_check(std::string what, std::function<std::int64_t()> calls,
                                     std::function<std::string()> detail = {}) {
  class Check : public ::testing::Environment {
   public:
    Check(std::string what, std::function<std::int64_t()> calls, std::function<std::string()> detail)
        : what_(std::move(what)), calls_(std::move(calls)), detail_(std::move(detail)) {}
    void TearDown() override {
      if (!env::lowered_attention() || ::testing::UnitTest::GetInstance()->test_to_run_count() == 0 ||
          ::testing::Test::IsSkipped())
        return;
      const std::int64_t n = calls_();
      EXPECT_GT(n, 0) << "SEQPAR_LOWERED_ATTENTION=1 but no " << what_ << " ran composed";
      std::printf("%s run composed: %lld%s\n", what_.c_str(), static_cast<long long>(n),
                  detail_ ? detail_().c_str() : "");
    }

   private:
    std::string what_;
    std::function<std::int64_t()> calls_;
    std::function<std::string()> detail_;
  };
  ::testing::AddGlobalTestEnvironment(new Check(std::move(what), std::move(calls), std::move(detail)));
}

}  // namespace seqpar::test
