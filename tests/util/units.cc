#include "tests/util/units.h"

#include <cmath>

#include "runtime/error.h"
#include "runtime/tensor_ops.h"

namespace seqpar::test {

// Power-of-two scale of one unit per dtype.
int unit_exponent(DType d) {
  switch (d) {
    case DType::kFloat64: return -20;
    case DType::kFloat32: return -4;
    case DType::kBFloat16: return 0;
    case DType::kFloat16: return -2;
    case DType::kInt32: return 16;
    case DType::kInt64: return 45;  // 200 units = 7e15 > 2^53: int64 must not travel through a double
  }
  return 0;
}

void put(const TensorView& t, std::int64_t i, std::int64_t units) {
  const int e = unit_exponent(t.dtype());
  switch (t.dtype()) {
    case DType::kFloat64: t.data_as<double>()[i] = std::ldexp(static_cast<double>(units), e); break;
    case DType::kFloat32: t.data_as<float>()[i] = std::ldexp(static_cast<float>(units), e); break;
    case DType::kBFloat16: t.data_as<bf16>()[i] = bf16(std::ldexp(static_cast<float>(units), e)); break;
    case DType::kFloat16: t.data_as<fp16>()[i] = fp16(std::ldexp(static_cast<float>(units), e)); break;
    case DType::kInt32: t.data_as<std::int32_t>()[i] = static_cast<std::int32_t>(units * (std::int64_t{1} << e)); break;
    case DType::kInt64: t.data_as<std::int64_t>()[i] = units * (std::int64_t{1} << e); break;
  }
}

// The units stored at element i of a host buffer, or nullopt when it is not a whole number of units.
std::optional<std::int64_t> take(const TensorView& t, std::int64_t i) {
  const int e = unit_exponent(t.dtype());
  double x = 0;
  switch (t.dtype()) {
    case DType::kFloat64: x = std::ldexp(t.data_as<double>()[i], -e); break;
    case DType::kFloat32: x = std::ldexp(static_cast<double>(t.data_as<float>()[i]), -e); break;
    case DType::kBFloat16: x = std::ldexp(static_cast<double>(static_cast<float>(t.data_as<bf16>()[i])), -e); break;
    case DType::kFloat16: x = std::ldexp(static_cast<double>(static_cast<float>(t.data_as<fp16>()[i])), -e); break;
    case DType::kInt32:
    case DType::kInt64: {
      const std::int64_t v = t.dtype() == DType::kInt32 ? t.data_as<std::int32_t>()[i] : t.data_as<std::int64_t>()[i];
      if (v % (std::int64_t{1} << e) != 0) return std::nullopt;
      return v / (std::int64_t{1} << e);
    }
  }
  if (!(std::fabs(x) < 1e15) || x != std::floor(x)) return std::nullopt;
  return static_cast<std::int64_t>(x);
}

// Exact comparison of a device (or host) buffer; the failure names what, the dtype, the first bad index, both
// values and the rank.
::testing::AssertionResult units_equal(const TensorView& t, const std::vector<std::int64_t>& want,
                                       const std::string& what) {
  if (t.numel() != static_cast<std::int64_t>(want.size())) {
    return ::testing::AssertionFailure() << "rank " << process_rank() << ": " << what << " has " << t.numel()
                                         << " elements, expected " << want.size();
  }
  Tensor host = Tensor::empty({t.numel()}, t.dtype(), MemCategory::kCommBuffer);
  copy_convert(t.reshape({t.numel()}), host);
  int bad = 0;
  std::string first;
  for (std::int64_t i = 0; i < t.numel(); ++i) {
    const auto got = take(host, i);
    if (!got || *got != want[i]) {
      if (bad++ == 0) {
        first = str_cat("index ", i, ": got ", got ? std::to_string(*got) : std::string("<not a unit value>"),
                        ", want ", want[i]);
      }
    }
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "rank " << process_rank() << ": " << what << " (" << dtype_name(t.dtype())
                                       << "): " << bad << " of " << t.numel() << " elements differ; first at " << first;
}

}  // namespace seqpar::test
