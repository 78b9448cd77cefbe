// The gtest environments of the composed-hook installers (tests/util/gdn_hook_install.cc, dsa_hook_install.cc, and
// their CUDA-table twins ops_table_hooks.cc, ops_table_dsa_hooks.cc): with SEQPAR_LOWERED_ATTENTION = 1, a test program
// whose kernel calls never took the composed route fails at its end, so that a run in the mode cannot pass without
// exercising the composition; with SEQPAR_TEST_DEVICE=cuda too, the routes are installed again on the CUDA table
// before the first test. Header-only: one program may link both kinds.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <cstdio>
#include <functional>
#include <string>
#include <utility>

#include "runtime/env.h"
#include "tests/util/ops_table.h"

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

// Adds a gtest environment whose SetUp, with SEQPAR_TEST_DEVICE=cuda in the mode, calls install() (the kind's routes
// on the CUDA table, tests/util/ops_table.h), or, without a usable CUDA table (a CPU build, no device), skips every
// test naming the reason (ops_table_route_skip), never running them on the CPU table. Otherwise it does nothing.
inline void add_cuda_table_routes(const char* kind, std::function<void()> install) {
  class Routes : public ::testing::Environment {
   public:
    Routes(const char* kind, std::function<void()> install) : kind_(kind), install_(std::move(install)) {}
    void SetUp() override {
      if (!ops_table_is_cuda() || !env::lowered_attention()) return;  // the routes are taken only in the mode
      const std::string reason = cuda_table_unavailable_reason();
      if (!reason.empty()) GTEST_SKIP() << ops_table_route_skip(kind_, reason);
      install_();
    }

   private:
    const char* kind_;
    std::function<void()> install_;
  };
  ::testing::AddGlobalTestEnvironment(new Routes(kind, std::move(install)));
}

}  // namespace seqpar::test
