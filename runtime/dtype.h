// Element types and the bf16 / fp16 conversions.
//
// Storage dtypes are fp64, fp32, bf16 and fp16; int32 and int64 serve indices (top-k) and counters.
// Conversions float -> bf16 / fp16 round to nearest, ties to even (IEEE 754 roundTiesToEven); overflow gives
// +-inf, NaN stays NaN (quiet, sign kept), subnormals are handled exactly. Conversions to float are exact.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

#include "host_device.h"

namespace seqpar {

enum class DType : std::uint8_t { kFloat64, kFloat32, kBFloat16, kFloat16, kInt32, kInt64 };

std::size_t dtype_size(DType dtype);
const char* dtype_name(DType dtype);  // "fp64", "fp32", "bf16", "fp16", "int32", "int64"
// Parses the names above; throws Error naming the value and the accepted names otherwise.
DType parse_dtype(std::string_view name);

// The accumulator dtype of a storage dtype: fp64 for fp64, fp32 for fp32, bf16 and fp16. Every attention kernel
// (MHA, DSA, GDN) computes scores, softmax statistics, states and accumulated gradients in it, and returns lse and
// states in it (docs/design.md, "Conventions").
DType accumulator_dtype(DType storage);
bool is_floating(DType dtype);

// ---- bit-level conversions ------------------------------------------------------------------------

// Host and device (SEQPAR_HOST_DEVICE): the CUDA kernels convert with these same bodies.
SEQPAR_HOST_DEVICE inline std::uint32_t float_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}
SEQPAR_HOST_DEVICE inline float bits_float(std::uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

SEQPAR_HOST_DEVICE inline float bf16_bits_to_float(std::uint16_t h) {
  return bits_float(static_cast<std::uint32_t>(h) << 16);
}

SEQPAR_HOST_DEVICE inline std::uint16_t float_to_bf16_bits(float f) {
  const std::uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((u >> 16) | 0x0040u);  // quiet NaN
  const std::uint32_t rounding = 0x7fffu + ((u >> 16) & 1u);  // ties to even; carries into the exponent
  return static_cast<std::uint16_t>((u + rounding) >> 16);
}

SEQPAR_HOST_DEVICE inline float fp16_bits_to_float(std::uint16_t h) {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t exp = (h >> 10) & 0x1fu;
  const std::uint32_t mant = h & 0x3ffu;
  if (exp == 0x1f) return bits_float(sign | 0x7f800000u | (mant << 13));  // inf / NaN (payload kept)
  if (exp == 0) {
    // zero or subnormal: mant * 2^-24, exact in float
    const float magnitude = static_cast<float>(mant) * 5.9604644775390625e-8f;  // 2^-24
    return sign ? -magnitude : magnitude;
  }
  return bits_float(sign | ((exp + 112u) << 23) | (mant << 13));
}

SEQPAR_HOST_DEVICE inline std::uint16_t float_to_fp16_bits(float f) {
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

// fp64 -> fp32 rounded to odd (toward zero, then the last bit set when inexact; NaN and exact values unchanged):
// fp32 keeps at least 2 more bits than bf16 / fp16, so rounding this to nearest even gives the correctly rounded
// bf16 / fp16 of x (no double rounding). Bit operations only, so that a kernel converts with the same body.
SEQPAR_HOST_DEVICE inline float double_to_float_round_to_odd(double x) {
  const float f = static_cast<float>(x);  // nearest even
  if (x != x || static_cast<double>(f) == x) return f;
  std::uint32_t u = float_bits(f);
  const bool away = x > 0 ? static_cast<double>(f) > x : static_cast<double>(f) < x;
  if (away) u -= 1u;  // one step toward zero (inf steps to the largest finite value)
  return bits_float(u | 1u);
}

// Element i of a buffer of `dtype` (fp64, fp32, bf16 or fp16) as T (float or double), and T into element i: the
// per-element bodies of the ops tables' convert_in / convert_out (attention/ops/ops.h), host and device. Each equals
// convert() above bit for bit: bf16 / fp16 / fp32 -> T exactly (fp64 -> fp32 to nearest even); T -> bf16 / fp16 to
// nearest even once (fp64 through double_to_float_round_to_odd). Integer dtypes give 0 / store nothing (callers
// check dtypes first).
template <typename T>
SEQPAR_HOST_DEVICE inline T load_element(const void* src, DType dtype, std::size_t i) {
  switch (dtype) {
    case DType::kFloat64: return static_cast<T>(static_cast<const double*>(src)[i]);
    case DType::kFloat32: return static_cast<T>(static_cast<const float*>(src)[i]);
    case DType::kBFloat16: return static_cast<T>(bf16_bits_to_float(static_cast<const std::uint16_t*>(src)[i]));
    case DType::kFloat16: return static_cast<T>(fp16_bits_to_float(static_cast<const std::uint16_t*>(src)[i]));
    default: return T(0);
  }
}
template <typename T>
SEQPAR_HOST_DEVICE inline float narrow_for_16bit(T v) {
  if constexpr (sizeof(T) == sizeof(double))
    return double_to_float_round_to_odd(static_cast<double>(v));
  else
    return static_cast<float>(v);
}
template <typename T>
SEQPAR_HOST_DEVICE inline void store_element(T v, void* dst, DType dtype, std::size_t i) {
  switch (dtype) {
    case DType::kFloat64: static_cast<double*>(dst)[i] = static_cast<double>(v); break;
    case DType::kFloat32: static_cast<float*>(dst)[i] = static_cast<float>(v); break;
    case DType::kBFloat16: static_cast<std::uint16_t*>(dst)[i] = float_to_bf16_bits(narrow_for_16bit(v)); break;
    case DType::kFloat16: static_cast<std::uint16_t*>(dst)[i] = float_to_fp16_bits(narrow_for_16bit(v)); break;
    default: break;
  }
}

// 16-bit storage types. Arithmetic happens in float: convert with float(x) and the constructors.
struct bf16 {
  std::uint16_t bits = 0;
  bf16() = default;
  explicit bf16(float f) : bits(float_to_bf16_bits(f)) {}
  explicit operator float() const { return bf16_bits_to_float(bits); }
  static bf16 from_bits(std::uint16_t b) {
    bf16 x;
    x.bits = b;
    return x;
  }
};
struct fp16 {
  std::uint16_t bits = 0;
  fp16() = default;
  explicit fp16(float f) : bits(float_to_fp16_bits(f)) {}
  explicit operator float() const { return fp16_bits_to_float(bits); }
  static fp16 from_bits(std::uint16_t b) {
    fp16 x;
    x.bits = b;
    return x;
  }
};

// Maps a C++ element type to its DType.
template <typename T>
struct dtype_of;
// clang-format off
template <> struct dtype_of<double> { static constexpr DType value = DType::kFloat64; };
template <> struct dtype_of<float> { static constexpr DType value = DType::kFloat32; };
template <> struct dtype_of<bf16> { static constexpr DType value = DType::kBFloat16; };
template <> struct dtype_of<fp16> { static constexpr DType value = DType::kFloat16; };
template <> struct dtype_of<std::int32_t> { static constexpr DType value = DType::kInt32; };
template <> struct dtype_of<std::int64_t> { static constexpr DType value = DType::kInt64; };
// clang-format on
template <typename T>
inline constexpr DType dtype_v = dtype_of<T>::value;

// Element-wise conversions between buffers of any floating dtypes, each correctly rounded (nearest, ties to even;
// fp64 -> bf16 / fp16 rounds once, not through a rounded fp32). Integer dtypes convert only to themselves.
void convert(const void* src, DType src_dtype, void* dst, DType dst_dtype, std::size_t count);

[[noreturn]] void throw_unsupported_dtype(DType dtype);

// Calls `fn(T{})` with T the C++ type of a floating `dtype`; throws for integer dtypes.
template <typename Fn>
decltype(auto) dispatch_floating(DType dtype, Fn&& fn) {
  switch (dtype) {
    case DType::kFloat64: return fn(double{});
    case DType::kFloat32: return fn(float{});
    case DType::kBFloat16: return fn(bf16{});
    case DType::kFloat16: return fn(fp16{});
    default: break;
  }
  throw_unsupported_dtype(dtype);
}

// Element access in float (or double) regardless of storage type.
inline float to_float(float x) { return x; }
inline float to_float(bf16 x) { return static_cast<float>(x); }
inline float to_float(fp16 x) { return static_cast<float>(x); }
inline double to_float(double x) { return x; }
template <typename T>
inline T from_float(float x) {
  return T(x);
}
template <>
inline double from_float<double>(float x) {
  return x;
}

}  // namespace seqpar
