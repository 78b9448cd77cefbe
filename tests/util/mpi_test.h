// Access to the world communicator inside tests linked with the MPI gtest main.
#pragma once

#include "runtime/comm.h"

namespace seqpar::test {
Communicator& world();
}  // namespace seqpar::test
