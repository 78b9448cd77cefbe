// Exact test data for communication tests: "units" are small integers stored as units x 2^k with a dtype-dependent
// power of two (fp64 carries fractions, int64 values beyond 2^53). Sums of up to 256 units are exact in every
// dtype, so collectives can be compared exactly with closed forms whatever their reduction order.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "runtime/tensor.h"

namespace seqpar::test {

// Power-of-two scale of one unit per dtype.
int unit_exponent(DType d);
// Element i of a host buffer = `units` units.
void put(const TensorView& t, std::int64_t i, std::int64_t units);
// The units stored at element i of a host buffer, or nullopt when it is not a whole number of units.
std::optional<std::int64_t> take(const TensorView& t, std::int64_t i);
// Exact comparison of a host or device buffer; the failure names `what`, the dtype, the first bad index, both values
// and the rank.
::testing::AssertionResult units_equal(const TensorView& t, const std::vector<std::int64_t>& want,
                                       const std::string& what);

}  // namespace seqpar::test
