#include "runtime/dtype.h"

#include <cmath>
#include <type_traits>

#include "runtime/error.h"

namespace seqpar {

std::size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::kFloat64: return 8;
    case DType::kFloat32: return 4;
    case DType::kBFloat16: return 2;
    case DType::kFloat16: return 2;
    case DType::kInt32: return 4;
    case DType::kInt64: return 8;
  }
  SEQPAR_THROW("unknown dtype value ", static_cast<int>(dtype));
}

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kFloat64: return "fp64";
    case DType::kFloat32: return "fp32";
    case DType::kBFloat16: return "bf16";
    case DType::kFloat16: return "fp16";
    case DType::kInt32: return "int32";
    case DType::kInt64: return "int64";
  }
  return "unknown";
}

DType parse_dtype(std::string_view name) {
  for (DType d : {DType::kFloat64, DType::kFloat32, DType::kBFloat16, DType::kFloat16, DType::kInt32, DType::kInt64}) {
    if (name == dtype_name(d)) return d;
  }
  SEQPAR_THROW("dtype '", name, "' is not one of fp64, fp32, bf16, fp16, int32, int64");
}

bool is_floating(DType dtype) { return dtype != DType::kInt32 && dtype != DType::kInt64; }

void throw_unsupported_dtype(DType dtype) {
  SEQPAR_THROW("dtype ", dtype_name(dtype), " is not supported here (floating dtypes only)");
}

namespace {
template <typename S, typename D>
void convert_typed(const S* src, D* dst, std::size_t count) {
  for (std::size_t i = 0; i < count; ++i) dst[i] = from_float<D>(static_cast<float>(to_float(src[i])));
}
template <typename S>
void convert_to_double(const S* src, double* dst, std::size_t count) {
  for (std::size_t i = 0; i < count; ++i) dst[i] = static_cast<double>(to_float(src[i]));
}
}  // namespace

void convert(const void* src, DType src_dtype, void* dst, DType dst_dtype, std::size_t count) {
  if (src_dtype == dst_dtype) {
    if (count > 0) std::memcpy(dst, src, count * dtype_size(src_dtype));  // memcpy(null, null, 0) is UB
    return;
  }
  SEQPAR_CHECK(is_floating(src_dtype) && is_floating(dst_dtype), "convert: cannot convert ", dtype_name(src_dtype),
               " to ", dtype_name(dst_dtype));
  dispatch_floating(src_dtype, [&](auto s) {
    using S = decltype(s);
    const S* in = static_cast<const S*>(src);
    if (dst_dtype == DType::kFloat64) {
      convert_to_double(in, static_cast<double*>(dst), count);
    } else if (src_dtype == DType::kFloat64) {
      dispatch_floating(dst_dtype, [&](auto d) {
        using D = decltype(d);
        D* out = static_cast<D*>(dst);
        const double* din = static_cast<const double*>(src);
        if constexpr (std::is_same_v<D, float>) {
          for (std::size_t i = 0; i < count; ++i) out[i] = static_cast<float>(din[i]);
        } else {
          // Round to odd into fp32 first: fp32 keeps >= 2 more bits than bf16 / fp16, so the following
          // round-to-nearest-even gives the correctly rounded result (no double rounding).
          for (std::size_t i = 0; i < count; ++i) out[i] = D(double_to_float_round_to_odd(din[i]));
        }
      });
    } else {
      dispatch_floating(dst_dtype, [&](auto d) {
        using D = decltype(d);
        convert_typed(in, static_cast<D*>(dst), count);
      });
    }
  });
}

DType accumulator_dtype(DType storage) { return storage == DType::kFloat64 ? DType::kFloat64 : DType::kFloat32; }

}  // namespace seqpar
