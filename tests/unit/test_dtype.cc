// DType tests: every bf16 / fp16 bit pattern round trips through float; float and double -> bf16 / fp16 rounding
// is checked against an independent reference (the nearest representable value found by searching a table of
// every finite value in fp64, ties to the even bit pattern, overflow when the nearest is 2^(emax+1)); names and
// the buffer conversions between dtypes.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "runtime/dtype.h"
#include "runtime/error.h"

namespace seqpar {
namespace {

// ---- independent reference -----------------------------------------------------------------------------

// A binary16-style format: 1 sign bit, `exp_bits` exponent bits, `mant_bits` stored mantissa bits.
struct Format {
  const char* name;
  int exp_bits;
  int mant_bits;
  int bias() const { return (1 << (exp_bits - 1)) - 1; }
  std::uint16_t inf_bits() const { return static_cast<std::uint16_t>(((1u << exp_bits) - 1u) << mant_bits); }
  std::uint16_t max_finite_bits() const { return static_cast<std::uint16_t>(inf_bits() - 1u); }
};
void PrintTo(const Format& f, std::ostream* os) { *os << f.name; }
constexpr Format kBf16{"bf16", 8, 7};
constexpr Format kFp16{"fp16", 5, 10};

// Decodes a bit pattern from the IEEE definition (no bit tricks shared with the implementation).
double decode(const Format& f, std::uint16_t bits) {
  const bool negative = (bits >> 15) != 0;
  const int e = (bits >> f.mant_bits) & ((1 << f.exp_bits) - 1);
  const int m = bits & ((1 << f.mant_bits) - 1);
  double v;
  if (e == (1 << f.exp_bits) - 1) {
    v = m == 0 ? std::numeric_limits<double>::infinity() : std::numeric_limits<double>::quiet_NaN();
  } else if (e == 0) {
    v = std::ldexp(static_cast<double>(m), 1 - f.bias() - f.mant_bits);  // subnormal
  } else {
    v = std::ldexp(static_cast<double>((1 << f.mant_bits) + m), e - f.bias() - f.mant_bits);
  }
  return negative ? -v : v;
}

bool is_nan_bits(const Format& f, std::uint16_t bits) { return (bits & 0x7fffu) > f.inf_bits(); }

// table[b] = value of the non-negative bit pattern b for b <= max finite; one more entry, 2^(emax+1) at the
// index of the inf pattern, is the value that the rounding of IEEE 754 compares against for overflow (its
// pattern is even, so a tie between the largest finite value and it goes to inf).
std::vector<double> make_table(const Format& f) {
  std::vector<double> t;
  for (std::uint32_t b = 0; b <= f.max_finite_bits(); ++b) t.push_back(decode(f, static_cast<std::uint16_t>(b)));
  t.push_back(std::ldexp(1.0, (1 << f.exp_bits) - 1 - f.bias()));  // 2^(emax+1)
  return t;
}
const std::vector<double>& table(const Format& f) {
  static const std::vector<double> bf16_table = make_table(kBf16);
  static const std::vector<double> fp16_table = make_table(kFp16);
  return f.exp_bits == kBf16.exp_bits ? bf16_table : fp16_table;
}

// Round to nearest, ties to even, of any non-NaN double: searches the sorted table of all finite values.
std::uint16_t reference_round(const Format& f, double x) {
  const std::uint16_t sign = std::signbit(x) ? 0x8000u : 0u;
  const double a = std::fabs(x);
  const std::vector<double>& t = table(f);
  if (a >= t.back()) return static_cast<std::uint16_t>(sign | f.inf_bits());
  const std::size_t i = static_cast<std::size_t>(std::upper_bound(t.begin(), t.end(), a) - t.begin()) - 1;
  std::size_t pick;
  if (a == t[i]) {
    pick = i;
  } else {
    const double mid = 0.5 * (t[i] + t[i + 1]);  // exact: both have far fewer than 52 significant bits
    if (a < mid) {
      pick = i;
    } else if (a > mid) {
      pick = i + 1;
    } else {
      pick = (i % 2 == 0) ? i : i + 1;  // tie: the even bit pattern (i + 1 may be the inf pattern)
    }
  }
  return static_cast<std::uint16_t>(sign | pick);
}

std::uint16_t to_bits(const Format& f, float x) {
  return f.exp_bits == kBf16.exp_bits ? float_to_bf16_bits(x) : float_to_fp16_bits(x);
}
float from_bits(const Format& f, std::uint16_t b) {
  return f.exp_bits == kBf16.exp_bits ? bf16_bits_to_float(b) : fp16_bits_to_float(b);
}

std::string hex(std::uint32_t v) {
  char buf[16];
  std::snprintf(buf, sizeof(buf), "0x%04x", v);
  return buf;
}

// Checks one float input against the reference; returns false (after one gtest failure) on a mismatch.
::testing::AssertionResult check_round(const Format& f, float x) {
  const std::uint16_t got = to_bits(f, x);
  if (std::isnan(x)) {
    if (is_nan_bits(f, got) && ((got >> 15) == (float_bits(x) >> 31))) return ::testing::AssertionSuccess();
    return ::testing::AssertionFailure() << f.name << "(NaN " << hex(float_bits(x)) << ") = " << hex(got)
                                         << ", expected a NaN of the same sign";
  }
  const std::uint16_t want = reference_round(f, static_cast<double>(x));
  if (got == want) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << f.name << "(" << x << " = float bits " << hex(float_bits(x))
                                       << ") = " << hex(got) << " (" << decode(f, got) << "), expected " << hex(want)
                                       << " (" << decode(f, want) << ")";
}

class HalfFormats : public ::testing::TestWithParam<Format> {};

// ---- round trips over all 65536 patterns ---------------------------------------------------------------

TEST_P(HalfFormats, AllBitPatternsRoundTripExactly) {
  const Format f = GetParam();
  int failures = 0;
  for (std::uint32_t b = 0; b < 65536 && failures < 10; ++b) {
    const auto bits = static_cast<std::uint16_t>(b);
    const float x = from_bits(f, bits);
    const double want = decode(f, bits);
    if (std::isnan(want)) {
      // NaN stays NaN (quiet, sign kept) both ways.
      const bool ok = std::isnan(x) && std::signbit(x) == ((bits >> 15) != 0) && is_nan_bits(f, to_bits(f, x)) &&
                      (to_bits(f, x) >> 15) == (bits >> 15);
      if (!ok) {
        ++failures;
        ADD_FAILURE() << f.name << " NaN pattern " << hex(bits) << " -> float " << x << " -> " << hex(to_bits(f, x));
      }
      continue;
    }
    // Exact to float (inf kept), and back to the same pattern (signed zeros included).
    if (!(static_cast<double>(x) == want && std::signbit(x) == std::signbit(want)) || to_bits(f, x) != bits) {
      ++failures;
      ADD_FAILURE() << f.name << " pattern " << hex(bits) << " -> float " << x << " (want " << want << ") -> "
                    << hex(to_bits(f, x));
    }
  }
  EXPECT_EQ(failures, 0);
}

TEST_P(HalfFormats, StructWrappersMatchBitFunctions) {
  const Format f = GetParam();
  for (std::uint32_t b = 0; b < 65536; b += 37) {
    const auto bits = static_cast<std::uint16_t>(b);
    if (f.exp_bits == kBf16.exp_bits) {
      const bf16 h = bf16::from_bits(bits);
      ASSERT_EQ(float_bits(static_cast<float>(h)), float_bits(bf16_bits_to_float(bits)));
      if (!is_nan_bits(f, bits)) {
        ASSERT_EQ(bf16(static_cast<float>(h)).bits, bits);
      }
    } else {
      const fp16 h = fp16::from_bits(bits);
      ASSERT_EQ(float_bits(static_cast<float>(h)), float_bits(fp16_bits_to_float(bits)));
      if (!is_nan_bits(f, bits)) {
        ASSERT_EQ(fp16(static_cast<float>(h)).bits, bits);
      }
    }
  }
}

// ---- float -> 16-bit rounding against the reference ----------------------------------------------------

// For every pair of neighbouring values (a, b) (including the largest finite value and 2^(emax+1)), both signs:
// a, b, the midpoint (a tie), the floats just either side of the midpoint, and the floats just inside a and b.
// Covers ties to even, subnormals, the subnormal/normal boundary, overflow to inf and values just below it.
TEST_P(HalfFormats, FloatRoundingMatchesReferenceAtEveryMidpoint) {
  const Format f = GetParam();
  const std::vector<double>& t = table(f);
  int failures = 0;
  for (std::size_t i = 0; i + 1 < t.size() && failures < 10; ++i) {
    const double a = t[i], b = t[i + 1];
    const double mid = 0.5 * (a + b);
    const float fmid = static_cast<float>(mid);
    ASSERT_EQ(static_cast<double>(fmid), mid) << "midpoint not representable in float";
    const float inf = std::numeric_limits<float>::infinity();
    const float points[] = {static_cast<float>(a),
                            static_cast<float>(b),
                            fmid,
                            std::nextafter(fmid, inf),
                            std::nextafter(fmid, 0.0f),
                            std::nextafter(static_cast<float>(a), inf),
                            std::nextafter(static_cast<float>(b), 0.0f)};
    for (float p : points) {
      for (float x : {p, -p}) {
        const auto r = check_round(f, x);
        if (!r) {
          ++failures;
          ADD_FAILURE() << r.message();
        }
      }
    }
  }
  EXPECT_EQ(failures, 0);
}

// Random float bit patterns over the whole range (NaN payloads, inf, float subnormals included).
TEST_P(HalfFormats, FloatRoundingMatchesReferenceOnRandomBitPatterns) {
  const Format f = GetParam();
  std::mt19937 gen(f.exp_bits * 7919u);
  int failures = 0;
  for (int n = 0; n < (1 << 20) && failures < 10; ++n) {
    const float x = bits_float(static_cast<std::uint32_t>(gen()));
    const auto r = check_round(f, x);
    if (!r) {
      ++failures;
      ADD_FAILURE() << r.message();
    }
  }
  // All float exponents at the narrow range where fp16 flushes to zero / goes subnormal, densely.
  for (std::uint32_t u = 0x32000000u; u < 0x39000000u && failures < 10; u += 0x1001u) {
    const auto r = check_round(f, bits_float(u));
    if (!r) {
      ++failures;
      ADD_FAILURE() << r.message();
    }
  }
  EXPECT_EQ(failures, 0);
}

INSTANTIATE_TEST_SUITE_P(DType, HalfFormats, ::testing::Values(kBf16, kFp16),
                         [](const ::testing::TestParamInfo<Format>& info) { return std::string(info.param.name); });

// Hand-computed anchors, independent of the reference table.
TEST(DType, Fp16KnownValues) {
  struct Case {
    float x;
    std::uint16_t bits;
  };
  const float inf = std::numeric_limits<float>::infinity();
  const Case cases[] = {
      {0.0f, 0x0000},
      {-0.0f, 0x8000},
      {1.0f, 0x3c00},
      {-2.0f, 0xc000},
      {1.0f + 0x1p-11f, 0x3c00},      // tie between 1 and 1+2^-10: even (1)
      {1.0f + 3 * 0x1p-11f, 0x3c02},  // tie between 1+2^-10 and 1+2^-9: even (1+2^-9)
      {1.0f + 0x1p-11f + 0x1p-20f, 0x3c01},
      {65504.0f, 0x7bff},         // largest finite
      {65519.99609375f, 0x7bff},  // just below the overflow threshold
      {65520.0f, 0x7c00},         // tie between 65504 and 2^16: even -> inf
      {-65520.0f, 0xfc00},
      {1e6f, 0x7c00},
      {inf, 0x7c00},
      {-inf, 0xfc00},
      {0x1p-14f, 0x0400},             // smallest normal
      {0x1p-14f - 0x1p-25f, 0x0400},  // tie between the largest subnormal and the smallest normal: even
      {0x1p-24f, 0x0001},             // smallest subnormal
      {0x1p-25f, 0x0000},             // half of it: tie, even (0)
      {-0x1p-25f, 0x8000},
      {0x1p-25f + 0x1p-40f, 0x0001},
      {1.5f * 0x1p-24f, 0x0002},  // tie between 1 and 2 subnormal ulps: even (2)
      {2.5f * 0x1p-24f, 0x0002},  // tie between 2 and 3: even (2)
      {1e-30f, 0x0000},
  };
  for (const Case& c : cases) {
    EXPECT_EQ(hex(float_to_fp16_bits(c.x)), hex(c.bits)) << "fp16(" << c.x << ")";
  }
  EXPECT_EQ(fp16_bits_to_float(0x7bff), 65504.0f);
  EXPECT_EQ(fp16_bits_to_float(0x0001), 0x1p-24f);
  EXPECT_EQ(fp16_bits_to_float(0x03ff), 1023 * 0x1p-24f);
  EXPECT_TRUE(std::isnan(fp16_bits_to_float(0x7c01)));
  EXPECT_TRUE(std::isnan(fp16_bits_to_float(0xfe00)));
}

TEST(DType, Bf16KnownValues) {
  struct Case {
    float x;
    std::uint16_t bits;
  };
  const float inf = std::numeric_limits<float>::infinity();
  const float max_float = std::numeric_limits<float>::max();
  const Case cases[] = {
      {0.0f, 0x0000},
      {-0.0f, 0x8000},
      {1.0f, 0x3f80},
      {1.0f + 0x1p-8f, 0x3f80},      // tie: even
      {1.0f + 3 * 0x1p-8f, 0x3f82},  // tie: even (up)
      {1.0f + 0x1p-8f + 0x1p-23f, 0x3f81},
      {3.3895313892515355e38f, 0x7f7f},  // largest finite bf16
      {max_float, 0x7f80},               // above the tie at (2^128 - 2^120): inf
      {-max_float, 0xff80},
      {inf, 0x7f80},
      {0x1p-133f, 0x0001},      // smallest bf16 subnormal
      {0x1p-134f, 0x0000},      // half of it: tie, even (0)
      {0x1p-149f, 0x0000},      // smallest float subnormal
      {3 * 0x1p-134f, 0x0002},  // tie between 1 and 2 ulps: even (2)
  };
  for (const Case& c : cases) {
    EXPECT_EQ(hex(float_to_bf16_bits(c.x)), hex(c.bits)) << "bf16(" << c.x << ")";
  }
}

TEST(DType, NaNPayloadsNeverBecomeInf) {
  // Float NaNs whose payload lives only in the bits that the 16-bit formats drop must stay NaN.
  for (std::uint32_t u : {0x7f800001u, 0xff800001u, 0x7f801fffu, 0x7fc00000u, 0xffffffffu, 0x7f810000u}) {
    const float x = bits_float(u);
    ASSERT_TRUE(std::isnan(x));
    EXPECT_TRUE(is_nan_bits(kBf16, float_to_bf16_bits(x))) << hex(u);
    EXPECT_TRUE(is_nan_bits(kFp16, float_to_fp16_bits(x))) << hex(u);
    EXPECT_EQ(float_to_bf16_bits(x) >> 15, u >> 31);
    EXPECT_EQ(float_to_fp16_bits(x) >> 15, u >> 31);
  }
}

// ---- names ------------------------------------------------------------------------------------------------

TEST(DType, NamesSizesAndParsing) {
  struct Row {
    DType dtype;
    const char* name;
    std::size_t size;
    bool floating;
  };
  const Row rows[] = {{DType::kFloat64, "fp64", 8, true},  {DType::kFloat32, "fp32", 4, true},
                      {DType::kBFloat16, "bf16", 2, true}, {DType::kFloat16, "fp16", 2, true},
                      {DType::kInt32, "int32", 4, false},  {DType::kInt64, "int64", 8, false}};
  for (const Row& r : rows) {
    EXPECT_STREQ(dtype_name(r.dtype), r.name);
    EXPECT_EQ(parse_dtype(r.name), r.dtype) << r.name;
    EXPECT_EQ(dtype_size(r.dtype), r.size) << r.name;
    EXPECT_EQ(is_floating(r.dtype), r.floating) << r.name;
  }
  static_assert(dtype_v<double> == DType::kFloat64 && dtype_v<float> == DType::kFloat32);
  static_assert(dtype_v<bf16> == DType::kBFloat16 && dtype_v<fp16> == DType::kFloat16);
  static_assert(dtype_v<std::int32_t> == DType::kInt32 && dtype_v<std::int64_t> == DType::kInt64);
  static_assert(sizeof(bf16) == 2 && sizeof(fp16) == 2);

  for (const char* bad : {"", "FP32", "float32", "bf16 ", "fp8", "int16"}) {
    try {
      parse_dtype(bad);
      ADD_FAILURE() << "parse_dtype('" << bad << "') did not throw";
    } catch (const Error& e) {
      const std::string msg = e.message();
      EXPECT_NE(msg.find(std::string("'") + bad + "'"), std::string::npos) << msg;
      EXPECT_NE(msg.find("fp64, fp32, bf16, fp16, int32, int64"), std::string::npos) << msg;
    }
  }
}

TEST(DType, DispatchFloatingRejectsIntegers) {
  EXPECT_EQ(dispatch_floating(DType::kBFloat16, [](auto x) { return dtype_v<decltype(x)>; }), DType::kBFloat16);
  EXPECT_EQ(dispatch_floating(DType::kFloat64, [](auto x) { return dtype_v<decltype(x)>; }), DType::kFloat64);
  try {
    dispatch_floating(DType::kInt32, [](auto) { return 0; });
    ADD_FAILURE() << "no throw";
  } catch (const Error& e) {
    EXPECT_NE(e.message().find("int32"), std::string::npos) << e.message();
  }
}

// ---- convert ---------------------------------------------------------------------------------------------

constexpr DType kFloating[] = {DType::kFloat64, DType::kFloat32, DType::kBFloat16, DType::kFloat16};

// Writes the values `v` (exactly representable in `dtype`) into a buffer of `dtype`.
std::vector<unsigned char> encode_exact(const std::vector<double>& v, DType dtype) {
  std::vector<unsigned char> out(v.size() * dtype_size(dtype));
  for (std::size_t i = 0; i < v.size(); ++i) {
    unsigned char* p = out.data() + i * dtype_size(dtype);
    switch (dtype) {
      case DType::kFloat64: std::memcpy(p, &v[i], 8); break;
      case DType::kFloat32: {
        const float x = static_cast<float>(v[i]);
        std::memcpy(p, &x, 4);
        break;
      }
      case DType::kBFloat16:
      case DType::kFloat16: {
        const Format f = dtype == DType::kBFloat16 ? kBf16 : kFp16;
        const std::uint16_t b =
            std::isnan(v[i]) ? static_cast<std::uint16_t>(f.inf_bits() | 1u) : reference_round(f, v[i]);
        std::memcpy(p, &b, 2);
        break;
      }
      default: break;
    }
  }
  return out;
}

// The reference result of converting the value x to `dtype`.
double reference_value(double x, DType dtype) {
  if (std::isnan(x)) return x;
  switch (dtype) {
    case DType::kFloat64: return x;
    case DType::kFloat32:
      return static_cast<double>(static_cast<float>(x));  // the C++ conversion rounds to nearest even
    case DType::kBFloat16: return decode(kBf16, reference_round(kBf16, x));
    case DType::kFloat16: return decode(kFp16, reference_round(kFp16, x));
    default: return 0;
  }
}

double read_value(const unsigned char* p, DType dtype) {
  switch (dtype) {
    case DType::kFloat64: {
      double x;
      std::memcpy(&x, p, 8);
      return x;
    }
    case DType::kFloat32: {
      float x;
      std::memcpy(&x, p, 4);
      return x;
    }
    case DType::kBFloat16:
    case DType::kFloat16: {
      std::uint16_t b;
      std::memcpy(&b, p, 2);
      return decode(dtype == DType::kBFloat16 ? kBf16 : kFp16, b);
    }
    default: return 0;
  }
}

// Source values exactly representable in `src`: every 16-bit value of the source format, or for fp32 / fp64
// values that fall between neighbours of the 16-bit formats (midpoints, and for fp64 midpoints moved by far less
// than an fp32 ulp, which a conversion through a rounded fp32 would get wrong).
std::vector<double> source_values(DType src) {
  std::vector<double> v;
  if (src == DType::kBFloat16 || src == DType::kFloat16) {
    const Format f = src == DType::kBFloat16 ? kBf16 : kFp16;
    for (std::uint32_t b = 0; b < 65536; ++b) v.push_back(decode(f, static_cast<std::uint16_t>(b)));
    return v;
  }
  for (const Format& f : {kBf16, kFp16}) {
    const std::vector<double>& t = table(f);
    for (std::size_t i = 0; i + 1 < t.size(); i += 3) {
      const double mid = 0.5 * (t[i] + t[i + 1]);
      for (double x : {t[i], mid, -mid}) v.push_back(x);
      if (src == DType::kFloat64) {
        const double tiny = std::ldexp(std::fabs(mid), -40);
        for (double x : {mid + tiny, mid - tiny, -(mid + tiny)}) v.push_back(x);
      }
    }
  }
  const double inf = std::numeric_limits<double>::infinity();
  for (double x : {inf, -inf, std::numeric_limits<double>::quiet_NaN(), 1e300, -1e-300, 0.1, -1.0 / 3.0}) {
    v.push_back(src == DType::kFloat32 ? static_cast<double>(static_cast<float>(x)) : x);
  }
  return v;
}

TEST(DType, ConvertBetweenEveryPairOfFloatingDTypes) {
  for (DType src : kFloating) {
    const std::vector<double> values = source_values(src);
    const std::vector<unsigned char> in = encode_exact(values, src);
    for (DType dst : kFloating) {
      SCOPED_TRACE(std::string(dtype_name(src)) + " -> " + dtype_name(dst));
      std::vector<unsigned char> out(values.size() * dtype_size(dst));
      convert(in.data(), src, out.data(), dst, values.size());
      int failures = 0;
      for (std::size_t i = 0; i < values.size() && failures < 5; ++i) {
        const double x = read_value(in.data() + i * dtype_size(src), src);
        const double got = read_value(out.data() + i * dtype_size(dst), dst);
        const double want = reference_value(x, dst);
        const bool ok = std::isnan(want) ? std::isnan(got) : (got == want && std::signbit(got) == std::signbit(want));
        if (!ok) {
          ++failures;
          ADD_FAILURE() << "element " << i << ": " << x << " -> " << got << ", expected " << want;
        }
      }
    }
  }
}

TEST(DType, ConvertIntegersOnlyToThemselves) {
  const std::vector<std::int32_t> a = {1, -2, 2147483647, -2147483647 - 1};
  std::vector<std::int32_t> b(a.size());
  convert(a.data(), DType::kInt32, b.data(), DType::kInt32, a.size());
  EXPECT_EQ(a, b);
  const std::vector<std::int64_t> c = {1, -(std::int64_t{1} << 62), (std::int64_t{1} << 53) + 1};
  std::vector<std::int64_t> d(c.size());
  convert(c.data(), DType::kInt64, d.data(), DType::kInt64, c.size());
  EXPECT_EQ(c, d);
  float f[4];
  try {
    convert(a.data(), DType::kInt32, f, DType::kFloat32, 4);
    ADD_FAILURE() << "int32 -> fp32 did not throw";
  } catch (const Error& e) {
    EXPECT_NE(e.message().find("cannot convert int32 to fp32"), std::string::npos) << e.message();
  }
  EXPECT_THROW(convert(f, DType::kFloat32, d.data(), DType::kInt64, 1), Error);
  EXPECT_THROW(convert(a.data(), DType::kInt32, d.data(), DType::kInt64, 1), Error);
}

TEST(DType, ConvertZeroElementsTouchesNothing) {
  std::uint16_t dst = 0xabcd;
  const float src = 1.0f;
  convert(&src, DType::kFloat32, &dst, DType::kBFloat16, 0);
  EXPECT_EQ(dst, 0xabcd);
}


// The per-element bodies of the ops tables' convert_in / convert_out (load_element / store_element, host and device)
// equal convert() bit for bit: every bf16 and fp16 pattern read as fp32 and fp64; every 16-bit value, the midpoints
// between neighbours (the ties), one fp32 ulp either side of them, fp32 subnormals, +-inf, NaNs and random fp32 bit
// patterns written as bf16 / fp16; fp64 values at and just off those points written as fp32 / bf16 / fp16. The
// fp64 -> bf16 / fp16 results are also checked against the nearest representable value computed here in fp64
// (ties to the even pattern), independently of the round-to-odd step both share.
std::uint16_t bits16(DType dt, float x) {
  std::uint16_t r = 0;
  convert(&x, DType::kFloat32, &r, dt, 1);
  return r;
}
double value16(DType dt, std::uint16_t h) {
  return dt == DType::kBFloat16 ? double(bf16_bits_to_float(h)) : double(fp16_bits_to_float(h));
}
// The bodies through an 8-byte cell (the bodies' switch addresses every dtype's width).
template <typename T, typename E>
T load_one(E e, DType dt) {
  std::uint64_t cell = 0;
  std::memcpy(&cell, &e, sizeof(E));
  return load_element<T>(&cell, dt, 0);
}
template <typename E, typename T>
E store_one(T v, DType dt) {
  std::uint64_t cell = 0;
  store_element<T>(v, &cell, dt, 0);
  E e;
  std::memcpy(&e, &cell, sizeof(E));
  return e;
}

TEST(DType, ElementBodiesMatchTheHostConversion) {
  const DType halves[] = {DType::kBFloat16, DType::kFloat16};
  std::vector<float> floats = {0.0f, -0.0f, std::numeric_limits<float>::infinity(),
                               -std::numeric_limits<float>::infinity(), std::numeric_limits<float>::max(),
                               std::numeric_limits<float>::denorm_min(), std::numeric_limits<float>::min(), 65504.0f,
                               65520.0f, 65519.99f};
  for (std::uint32_t u : {0x7fc00000u, 0xffc00001u, 0x7f800001u, 0x7fbfffffu}) floats.push_back(bits_float(u));
  for (DType dt : halves)
    for (std::uint32_t h = 0; h < 0x10000u; ++h) {
      const auto b = static_cast<std::uint16_t>(h);
      float want_f = 0.0f;
      double want_d = 0.0;
      convert(&b, dt, &want_f, DType::kFloat32, 1);
      convert(&b, dt, &want_d, DType::kFloat64, 1);
      const float got_f = load_one<float>(b, dt);
      const double got_d = load_one<double>(b, dt);
      ASSERT_EQ(float_bits(got_f), float_bits(want_f)) << dtype_name(dt) << " pattern " << h;
      ASSERT_EQ(std::memcmp(&got_d, &want_d, 8), 0) << dtype_name(dt) << " pattern " << h;
      floats.push_back(got_f);
      const auto next = static_cast<std::uint16_t>(h + 1);
      if ((h & 0x7fffu) < 0x7fffu && std::isfinite(value16(dt, b)) && std::isfinite(value16(dt, next))) {
        const float mid = static_cast<float>((value16(dt, b) + value16(dt, next)) / 2);  // exact in fp32
        floats.push_back(mid);
        floats.push_back(std::nextafter(mid, 0.0f));
        floats.push_back(std::nextafter(mid, 2 * mid));
      }
    }
  std::mt19937 rng(7);
  for (int i = 0; i < 200000; ++i) floats.push_back(bits_float(static_cast<std::uint32_t>(rng())));
  std::int64_t ties = 0;
  for (const float x : floats) {
    for (DType dt : halves) {
      const auto got = store_one<std::uint16_t>(x, dt);
      ASSERT_EQ(got, bits16(dt, x)) << dtype_name(dt) << " of fp32 bits " << std::hex << float_bits(x);
    }
    // fp64 at x and just off it (the double-rounding cases of a midpoint)
    const double d = x;
    for (const double y : {d, d * (1 + 0x1p-40), d * (1 - 0x1p-40)}) {
      float want_f = 0.0f;
      const auto got_f = store_one<float>(y, DType::kFloat32);
      convert(&y, DType::kFloat64, &want_f, DType::kFloat32, 1);
      ASSERT_EQ(float_bits(got_f), float_bits(want_f)) << "fp32 of fp64 " << y;
      ASSERT_EQ(float_bits(load_one<float>(y, DType::kFloat64)), float_bits(want_f)) << "load fp64 " << y;
      for (DType dt : halves) {
        std::uint16_t want = 0;
        const auto got = store_one<std::uint16_t>(y, dt);
        convert(&y, DType::kFloat64, &want, dt, 1);
        ASSERT_EQ(got, want) << dtype_name(dt) << " of fp64 " << y;
        const double r = value16(dt, got);
        if (std::isnan(y) || !std::isfinite(r)) continue;
        // the nearest of the representable neighbours, ties to the even pattern
        for (int step : {-1, 1}) {
          const auto nb = static_cast<std::uint16_t>(got + step);
          if ((got & 0x7fffu) == 0 && step < 0) continue;
          const double v = value16(dt, nb);
          if (!std::isfinite(v) || std::signbit(v) != std::signbit(r)) continue;
          const double er = std::abs(y - r), ev = std::abs(y - v);
          ASSERT_LE(er, ev) << dtype_name(dt) << " of fp64 " << y << ": " << r << " is not the nearest";
          if (er == ev) {
            ++ties;
            ASSERT_EQ(got & 1u, 0u) << dtype_name(dt) << " tie of fp64 " << y << " not to even";
          }
        }
      }
    }
  }
  EXPECT_GT(ties, 60000);  // the midpoints were among the values
}

}  // namespace
}  // namespace seqpar
