#include <gtest/gtest.h>
#include "runtime/dtype.h"
TEST(DType, Placeholder) { EXPECT_EQ(seqpar::dtype_size(seqpar::DType::kBFloat16), 2u); }
