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

float fp16_bits_to_float(std::uint16_t h) {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t exp = (h >> 10) & 0x1fu;
  const std::uint32_t mant = h & 0x3ffu;
  if (exp == 0x1f) return bits_float(sign | 0x7f800000u | (mant << 13));  // inf / NaN (payload kept)
  if (exp == 0) {
    // zero or subnormal: mant * 2^-24, exact in float
    const float magnitude = std::ldexp(static_cast<float>(mant), -24);
    return sign ? -magnitude : magnitude;
  }
  return bits_float(sign | ((exp + 112u) << 23) | (mant << 13));
}

std::uint16_t float_to_fp16_bits(float f) {
  const std::uint32_t u = float_bits(f);
  const std::uint16_t sign = static_cast<std::uint16_t>((u >> 16) & 0x8000u);
  const std::uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return static_cast<std::uint16_t>(sign | 0x7e00u | ((abs >> 13) & 0x3ffu));  // NaN
  if (abs >= 0x477ff000u) return static_cast<std::uint16_t>(sign | 0x7c00u);  // >= 65520 rounds to inf
  if (abs < 0x38800000u) {
    // result is subnormal or zero: value = abs * 2^24 half-ulps, rounded to nearest even
    if (abs < 0x33000000u) return sign;  // below half the smallest subnormal (2^-25): rounds to zero
    const std::uint32_t exp = abs >> 23;
    const std::uint32_t mant = (abs & 0x7fffffu) | 0x800000u;
    const std::uint32_t shift = 126u - exp;  // so that result = mant >> shift (shift in 14..24)
    std::uint32_t result = mant >> shift;
    const std::uint32_t rem = mant & ((1u << shift) - 1u);
    const std::uint32_t half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (result & 1u))) ++result;
    return static_cast<std::uint16_t>(sign | result);
  }
  // normal: rebias the exponent (127 -> 15) and round the 13 dropped bits to nearest even
  const std::uint32_t rebased = abs - (112u << 23);
  const std::uint32_t rounding = 0xfffu + ((rebased >> 13) & 1u);
  return static_cast<std::uint16_t>(sign | ((rebased + rounding) >> 13));
}

namespace {
// fp64 -> fp32 rounding to odd: truncate toward zero, then set the last bit when the conversion was inexact.
float double_to_float_round_to_odd(double x) {
  float f = static_cast<float>(x);  // round to nearest even
  if (std::isnan(x) || static_cast<double>(f) == x) return f;
  if (std::fabs(static_cast<double>(f)) > std::fabs(x)) {
    f = std::nextafter(f, 0.0f);  // rounded away from zero (or to inf): step back toward zero
  }
  return bits_float(float_bits(f) | 1u);
}

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
