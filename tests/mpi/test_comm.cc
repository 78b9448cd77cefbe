#include <gtest/gtest.h>
#include "tests/util/mpi_test.h"
TEST(Comm, Placeholder) { EXPECT_GE(seqpar::test::world().size(), 1); }
