// gtest main for tests run under mpirun: every rank runs every test; rank 0 prints the usual gtest output and the
// other ranks print only their failures, prefixed by their rank. The exit code is non-zero on every rank when any
// rank failed. Tests reach the world communicator through seqpar::test::world().
#include <gtest/gtest.h>

#include <cstdio>

#include "runtime/mpi_comm.h"
#include "tests/util/mpi_test.h"
#include "tests/util/test_util.h"

namespace seqpar::test {
namespace {
MpiCommunicator* g_world = nullptr;

class RankFailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit RankFailurePrinter(int rank) : rank_(rank) {}
  void OnTestPartResult(const ::testing::TestPartResult& r) override {
    if (!r.failed()) return;
    std::fprintf(stderr, "[rank %d] %s:%d: Failure\n%s\n", rank_, r.file_name() ? r.file_name() : "?", r.line_number(),
                 r.summary());
  }

 private:
  int rank_;
};
}  // namespace

Communicator& world() { return *g_world; }

}  // namespace seqpar::test

int main(int argc, char** argv) {
  return seqpar::run_mpi_main(argc, argv, [](int argc, char** argv) {
    // The world exists before InitGoogleTest so that parameter generators may ask for its size.
    auto world = seqpar::MpiCommunicator::world();
    seqpar::test::g_world = world.get();
    ::testing::InitGoogleTest(&argc, argv);
    if (world->rank() != 0) {
      auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
      delete listeners.Release(listeners.default_result_printer());
      listeners.Append(new seqpar::test::RankFailurePrinter(world->rank()));
    }
    const int local_failed = RUN_ALL_TESTS() != 0 ? 1 : 0;
    const bool ok = seqpar::test::all_ranks(*world, local_failed == 0);
    if (world->rank() == 0) {
      std::printf("[mpi] %d ranks: %s\n", world->size(), ok ? "all ranks passed" : "some rank FAILED");
    }
    seqpar::test::g_world = nullptr;
    return ok ? 0 : 1;
  });
}
