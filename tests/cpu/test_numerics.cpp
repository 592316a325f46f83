// Tests of the shared numerics header (include/v4attn/numerics.h) against the spec
// (v41-attention.md sections 2 and 6). Every expected value is either written by hand or
// computed by an independent double-precision path written here (a value-based search over
// the format's grid, frexp for exponents, double arithmetic rounded once to fp32), never by
// calling the function under test.
//
// Double arithmetic rounded once to fp32 is a correctly rounded fp32 operation for + - * /
// (double has 53 >= 2*24 + 2 bits), which is what lets the test state "fp32(a op b)"
// independently of the host's fp32 arithmetic.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "v4attn/numerics.h"

namespace {

namespace num = v4attn::num;

uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
float float_of(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
// fp32(a op b) through double: one rounding, so correctly rounded.
float f32_mul(float a, float b) { return static_cast<float>(static_cast<double>(a) * static_cast<double>(b)); }
float f32_add(float a, float b) { return static_cast<float>(static_cast<double>(a) + static_cast<double>(b)); }
float f32_sub(float a, float b) { return static_cast<float>(static_cast<double>(a) - static_cast<double>(b)); }
float f32_div(float a, float b) { return static_cast<float>(static_cast<double>(a) / static_cast<double>(b)); }

// Distance in fp32 ulps (of the expected value's binade) between a float and a double.
double ulps_off(float got, double expected) {
  const int e = std::ilogb(expected);
  const double ulp = std::ldexp(1.0, std::max(e, -126) - 23);
  return std::fabs(static_cast<double>(got) - expected) / ulp;
}

// ---- independent reference encoders ----------------------------------------------------------

// bf16 RNE from the value: truncation toward zero is the lower neighbour, the next bf16 up in
// magnitude the upper one; the midpoint comparison is done in double (all three are exact there).
uint16_t bf16_ref(float x) {
  const uint32_t u = bits_of(x);
  if (std::isnan(x)) return static_cast<uint16_t>(((u >> 16) & 0x8000u) | 0x7fc0u);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t mag_bits = u & 0x7fffffffu;
  if (mag_bits == 0x7f800000u) return static_cast<uint16_t>(sign | 0x7f80u);
  const uint16_t lo = static_cast<uint16_t>(mag_bits >> 16);  // truncated magnitude
  const double a = std::fabs(static_cast<double>(x));
  const double lo_v = static_cast<double>(float_of(static_cast<uint32_t>(lo) << 16));
  if (a == lo_v) return static_cast<uint16_t>(sign | lo);
  // Upper neighbour: lo + one bf16 ulp; past the largest finite it is 2^128 (-> inf).
  const double hi_v = lo == 0x7f7fu ? std::ldexp(1.0, 128) : static_cast<double>(float_of(static_cast<uint32_t>(lo + 1) << 16));
  const double mid = (lo_v + hi_v) / 2;  // exact in double
  uint16_t mag;
  if (a < mid) mag = lo;
  else if (a > mid) mag = static_cast<uint16_t>(lo + 1);
  else mag = (lo & 1u) ? static_cast<uint16_t>(lo + 1) : lo;
  return static_cast<uint16_t>(sign | mag);
}

// e4m3fn value of a magnitude code 0..126 from the textbook formula.
double e4m3_mag_value(int code) {
  const int e = code >> 3, m = code & 7;
  if (e == 0) return m * std::ldexp(1.0, -9);
  return (1.0 + m / 8.0) * std::ldexp(1.0, e - 7);
}
const std::array<double, 127>& e4m3_grid() {
  static const std::array<double, 127> g = [] {
    std::array<double, 127> t{};
    for (int c = 0; c < 127; ++c) t[c] = e4m3_mag_value(c);
    return t;
  }();
  return g;
}
// Nearest grid value by search; ties to the even code; |x| >= 448 saturates to 0x7e.
uint8_t e4m3_ref(float x) {
  const uint8_t sign = std::signbit(x) ? 0x80 : 0x00;
  if (std::isnan(x)) return static_cast<uint8_t>(sign | 0x7f);
  const double a = std::fabs(static_cast<double>(x));
  if (a >= 448.0) return static_cast<uint8_t>(sign | 0x7e);
  const auto& g = e4m3_grid();
  const int k = static_cast<int>(std::upper_bound(g.begin(), g.end(), a) - g.begin()) - 1;  // g[k] <= a
  if (g[k] == a) return static_cast<uint8_t>(sign | k);
  const double mid = (g[k] + g[k + 1]) / 2;
  int c;
  if (a < mid) c = k;
  else if (a > mid) c = k + 1;
  else c = (k % 2 == 0) ? k : k + 1;
  return static_cast<uint8_t>(sign | c);
}

constexpr std::array<double, 8> kE2m1Grid = {0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0};
uint8_t e2m1_ref(float x) {
  const uint8_t sign = std::signbit(x) ? 0x8 : 0x0;
  const double a = std::fabs(static_cast<double>(x));
  if (a >= 6.0) return static_cast<uint8_t>(sign | 7);
  int k = 0;
  while (k + 1 < 8 && kE2m1Grid[k + 1] <= a) ++k;
  if (kE2m1Grid[k] == a) return static_cast<uint8_t>(sign | k);
  const double mid = (kE2m1Grid[k] + kE2m1Grid[k + 1]) / 2;
  int c;
  if (a < mid) c = k;
  else if (a > mid) c = k + 1;
  else c = (k % 2 == 0) ? k : k + 1;
  return static_cast<uint8_t>(sign | c);
}
// Half the gap between the grid neighbours around |v| (v in [0, 6]): the largest possible
// rounding error of e2m1 at v.
double e2m1_half_gap(double v) {
  const double a = std::fabs(v);
  if (a <= 2.0) return 0.25;
  if (a <= 4.0) return 0.5;
  return 1.0;
}

// ceil(log2 v) for positive finite v, from frexp (no bit tricks): v = m * 2^ex, m in [0.5, 1).
int ceil_log2_ref(double v) {
  int ex = 0;
  const double m = std::frexp(v, &ex);
  return m == 0.5 ? ex - 1 : ex;
}

// A random bf16 value (as fp32) with exponent in [emin, emax], random sign and 7-bit mantissa.
float random_bf16(std::mt19937& rng, int emin, int emax) {
  std::uniform_int_distribution<int> exp_dist(emin, emax);
  std::uniform_int_distribution<uint32_t> mant(0, 127), sgn(0, 1);
  const uint32_t e = static_cast<uint32_t>(exp_dist(rng) + 127);
  return float_of((sgn(rng) << 31) | (e << 23) | (mant(rng) << 16));
}

const float kNaN = std::numeric_limits<float>::quiet_NaN();
const float kInf = std::numeric_limits<float>::infinity();

// ================================ bf16 ===========================================================

TEST(NumericsBf16, TiesRoundToEven) {
  EXPECT_EQ(num::bf16_from_f32(float_of(0x3f808000u)), 0x3f80);  // tie, 0x3f80 even: down
  EXPECT_EQ(num::bf16_from_f32(float_of(0x3f818000u)), 0x3f82);  // tie, 0x3f81 odd: up
  EXPECT_EQ(num::bf16_from_f32(float_of(0x3f808001u)), 0x3f81);  // just above the tie
  EXPECT_EQ(num::bf16_from_f32(float_of(0x3f807fffu)), 0x3f80);  // just below the tie
  EXPECT_EQ(num::bf16_from_f32(float_of(0x3f817fffu)), 0x3f81);
  EXPECT_EQ(num::bf16_from_f32(float_of(0xbf808000u)), 0xbf80);  // negative ties mirror
  EXPECT_EQ(num::bf16_from_f32(float_of(0xbf818000u)), 0xbf82);
  // Carry across the binade: 0x3fff8000 is the tie between 0x3fff (odd) and 0x4000.
  EXPECT_EQ(num::bf16_from_f32(float_of(0x3fff8000u)), 0x4000);
  EXPECT_EQ(num::bf16_from_f32(1.0f), 0x3f80);
  EXPECT_EQ(num::bf16_from_f32(0.0f), 0x0000);
  EXPECT_EQ(num::bf16_from_f32(-0.0f), 0x8000);
}

TEST(NumericsBf16, OverflowGoesToInfinity) {
  EXPECT_EQ(num::bf16_from_f32(std::numeric_limits<float>::max()), 0x7f80);  // rounds past 0x7f7f
  EXPECT_EQ(num::bf16_from_f32(-std::numeric_limits<float>::max()), 0xff80);
  EXPECT_EQ(num::bf16_from_f32(float_of(0x7f7f8000u)), 0x7f80);  // tie, 0x7f7f odd: up to inf
  EXPECT_EQ(num::bf16_from_f32(float_of(0x7f7f7fffu)), 0x7f7f);  // largest finite bf16 stays
  EXPECT_EQ(num::bf16_from_f32(float_of(0x7f7e8000u)), 0x7f7e);  // tie, even: down
  EXPECT_EQ(num::bf16_from_f32(kInf), 0x7f80);
  EXPECT_EQ(num::bf16_from_f32(-kInf), 0xff80);
}

TEST(NumericsBf16, NanIsCanonicalQuietNanWithSign) {
  for (uint32_t payload : {0x7f800001u, 0x7f80ffffu, 0x7fc00000u, 0x7fffffffu, 0x7fa00000u, 0x7f810000u}) {
    EXPECT_EQ(num::bf16_from_f32(float_of(payload)), 0x7fc0) << std::hex << payload;
    EXPECT_EQ(num::bf16_from_f32(float_of(payload | 0x80000000u)), 0xffc0) << std::hex << payload;
    EXPECT_TRUE(std::isnan(num::round_bf16(float_of(payload))));
  }
}

TEST(NumericsBf16, Denormals) {
  EXPECT_EQ(num::bf16_from_f32(float_of(0x00000001u)), 0x0000);  // smallest fp32 denormal: 0
  EXPECT_EQ(num::bf16_from_f32(float_of(0x00008000u)), 0x0000);  // tie with 0 (even): 0
  EXPECT_EQ(num::bf16_from_f32(float_of(0x00008001u)), 0x0001);
  EXPECT_EQ(num::bf16_from_f32(float_of(0x00018000u)), 0x0002);  // tie, odd: up
  EXPECT_EQ(num::bf16_from_f32(float_of(0x00010000u)), 0x0001);  // bf16 denormal exactly
  EXPECT_EQ(num::bf16_from_f32(float_of(0x007fffffu)), 0x0080);  // rounds up to the smallest normal
  EXPECT_EQ(num::bf16_from_f32(float_of(0x80018000u)), 0x8002);
  EXPECT_EQ(num::f32_from_bf16(0x0001), std::ldexp(1.0f, -133));  // denormal decode keeps its value
  EXPECT_EQ(num::f32_from_bf16(0x8001), -std::ldexp(1.0f, -133));
}

TEST(NumericsBf16, AllBitPatternsRoundTrip) {
  for (uint32_t b = 0; b < 65536; ++b) {
    const float f = num::f32_from_bf16(static_cast<uint16_t>(b));
    ASSERT_EQ(bits_of(f), b << 16) << std::hex << b;
    const uint16_t back = num::bf16_from_f32(f);
    const bool is_nan = (b & 0x7fffu) > 0x7f80u;
    const uint16_t expected = is_nan ? static_cast<uint16_t>((b & 0x8000u) | 0x7fc0u) : static_cast<uint16_t>(b);
    ASSERT_EQ(back, expected) << std::hex << b;
  }
}

TEST(NumericsBf16, IsFiniteOnEveryBitPattern) {
  std::vector<uint16_t> all(65536);
  for (uint32_t b = 0; b < 65536; ++b) {
    all[b] = static_cast<uint16_t>(b);
    ASSERT_EQ(num::bf16_is_finite(static_cast<uint16_t>(b)), std::isfinite(num::f32_from_bf16(static_cast<uint16_t>(b))))
        << std::hex << b;
  }
  // first_non_finite_bf16: the first of +inf (0x7f80), at index 0x7f80; none in a finite run; -1 when empty.
  EXPECT_EQ(num::first_non_finite_bf16(all.data(), static_cast<int64_t>(all.size())), 0x7f80);
  EXPECT_EQ(num::first_non_finite_bf16(all.data(), 0x7f80), -1);
  EXPECT_EQ(num::first_non_finite_bf16(all.data() + 0xff80, 1), 0);  // -inf
  EXPECT_EQ(num::first_non_finite_bf16(all.data() + 0x7fc0, 1), 0);  // quiet NaN
  EXPECT_EQ(num::first_non_finite_bf16(all.data() + 0x7f7f, 1), -1);  // the largest finite
  EXPECT_EQ(num::first_non_finite_bf16(nullptr, 0), -1);
}

TEST(NumericsBf16, RandomFp32AgainstValueReference) {
  std::mt19937 rng(0xbf16);
  std::uniform_int_distribution<uint32_t> any;
  for (int i = 0; i < 1'000'000; ++i) {
    uint32_t u = any(rng);
    if (i % 4 == 1) u = (u & 0xffff0000u) | 0x8000u;  // force exact ties
    if (i % 4 == 2) u = (u & 0xffff0000u) | (0x8000u ^ (u & 1u ? 1u : 0xffffu));  // next to a tie
    const float x = float_of(u);
    const uint16_t got = num::bf16_from_f32(x);
    ASSERT_EQ(got, bf16_ref(x)) << std::hex << u;
    if (!std::isnan(x)) {
      ASSERT_EQ(bits_of(num::round_bf16(x)), static_cast<uint32_t>(got) << 16);
    }
  }
}

// ================================ e4m3 ===========================================================

TEST(NumericsE4m3, DecodeAll256AgainstFormula) {
  for (int b = 0; b < 256; ++b) {
    const float got = num::f32_from_e4m3(static_cast<uint8_t>(b));
    const int mag = b & 0x7f;
    if (mag == 0x7f) {
      EXPECT_TRUE(std::isnan(got)) << b;
      continue;
    }
    const double expected = ((b & 0x80) ? -1.0 : 1.0) * e4m3_mag_value(mag);
    EXPECT_EQ(static_cast<double>(got), expected) << b;
    EXPECT_EQ(std::signbit(got), (b & 0x80) != 0) << b;  // 0x80 decodes to -0.0
  }
  EXPECT_EQ(num::f32_from_e4m3(0x7e), 448.0f);
  EXPECT_EQ(num::f32_from_e4m3(0xfe), -448.0f);
  EXPECT_EQ(num::f32_from_e4m3(0x01), std::ldexp(1.0f, -9));
  EXPECT_EQ(num::f32_from_e4m3(0x07), 7.0f * std::ldexp(1.0f, -9));
  EXPECT_EQ(num::f32_from_e4m3(0x08), std::ldexp(1.0f, -6));
  EXPECT_EQ(num::f32_from_e4m3(0x38), 1.0f);
  EXPECT_EQ(num::f32_from_e4m3(0x39), 1.125f);
  EXPECT_EQ(bits_of(num::f32_from_e4m3(0x80)), 0x80000000u);
  EXPECT_EQ(num::kE4m3Max, 448.0f);
}

TEST(NumericsE4m3, EveryNonNanByteRoundTrips) {
  for (int b = 0; b < 256; ++b) {
    if ((b & 0x7f) == 0x7f) continue;
    EXPECT_EQ(num::e4m3_from_f32(num::f32_from_e4m3(static_cast<uint8_t>(b))), b) << b;
    EXPECT_EQ(e4m3_ref(num::f32_from_e4m3(static_cast<uint8_t>(b))), b) << b;  // reference sanity
  }
}

TEST(NumericsE4m3, MidpointsTieToEvenAndNeighboursGoToNearest) {
  const auto& g = e4m3_grid();
  for (int k = 0; k + 1 < 127; ++k) {
    const double mid_d = (g[k] + g[k + 1]) / 2;
    const float mid = static_cast<float>(mid_d);
    ASSERT_EQ(static_cast<double>(mid), mid_d);  // midpoints have <= 5 significant bits
    const int even = (k % 2 == 0) ? k : k + 1;
    EXPECT_EQ(num::e4m3_from_f32(mid), even) << "k=" << k;
    EXPECT_EQ(num::e4m3_from_f32(-mid), 0x80 | even) << "k=" << k;
    EXPECT_EQ(num::e4m3_from_f32(std::nextafter(mid, 0.0f)), k) << "k=" << k;
    EXPECT_EQ(num::e4m3_from_f32(std::nextafter(mid, kInf)), k + 1) << "k=" << k;
    EXPECT_EQ(num::e4m3_from_f32(-std::nextafter(mid, kInf)), 0x80 | (k + 1)) << "k=" << k;
  }
}

TEST(NumericsE4m3, SaturatesAbove448) {
  for (float x : {448.0f, std::nextafter(448.0f, kInf), 449.0f, 463.9f, 464.0f, 470.0f, 480.0f, 512.0f,
                  1e10f, std::numeric_limits<float>::max(), kInf}) {
    EXPECT_EQ(num::e4m3_from_f32(x), 0x7e) << x;
    EXPECT_EQ(num::e4m3_from_f32(-x), 0xfe) << x;
  }
  EXPECT_EQ(num::e4m3_from_f32(447.9f), 0x7e);
  EXPECT_EQ(num::e4m3_from_f32(432.0f), 0x7e);  // tie 416|448 -> even code 0x7e
  EXPECT_EQ(num::e4m3_from_f32(std::nextafter(432.0f, 0.0f)), 0x7d);
}

TEST(NumericsE4m3, NanEncodesAsNanWithSign) {
  EXPECT_EQ(num::e4m3_from_f32(kNaN), 0x7f);
  EXPECT_EQ(num::e4m3_from_f32(-kNaN), 0xff);
  EXPECT_EQ(num::e4m3_from_f32(float_of(0x7f800001u)), 0x7f);
  EXPECT_EQ(num::e4m3_from_f32(float_of(0xffbfffffu)), 0xff);
}

TEST(NumericsE4m3, TinyValuesAndSubnormals) {
  const float q = std::ldexp(1.0f, -10);  // half of the smallest subnormal 2^-9
  EXPECT_EQ(num::e4m3_from_f32(q), 0x00);                         // tie with 0: even (0)
  EXPECT_EQ(num::e4m3_from_f32(-q), 0x80);
  EXPECT_EQ(num::e4m3_from_f32(std::nextafter(q, kInf)), 0x01);
  EXPECT_EQ(num::e4m3_from_f32(std::nextafter(q, 0.0f)), 0x00);
  EXPECT_EQ(num::e4m3_from_f32(3 * q), 0x02);                     // tie 1|2: even (2)
  EXPECT_EQ(num::e4m3_from_f32(5 * q), 0x02);                     // tie 2|3: even (2)
  EXPECT_EQ(num::e4m3_from_f32(7 * q), 0x04);                     // tie 3|4: even (4)
  EXPECT_EQ(num::e4m3_from_f32(15 * q), 0x08);                    // tie 7|8 (subnormal|normal): 8
  EXPECT_EQ(num::e4m3_from_f32(std::ldexp(1.0f, -11)), 0x00);
  EXPECT_EQ(num::e4m3_from_f32(1e-30f), 0x00);
  EXPECT_EQ(num::e4m3_from_f32(-1e-30f), 0x80);
  EXPECT_EQ(num::e4m3_from_f32(std::numeric_limits<float>::min()), 0x00);
  EXPECT_EQ(num::e4m3_from_f32(std::numeric_limits<float>::denorm_min()), 0x00);
  EXPECT_EQ(num::e4m3_from_f32(-std::numeric_limits<float>::denorm_min()), 0x80);
  EXPECT_EQ(num::e4m3_from_f32(0.0f), 0x00);
  EXPECT_EQ(num::e4m3_from_f32(-0.0f), 0x80);
}

TEST(NumericsE4m3, RandomFp32AgainstGridSearch) {
  std::mt19937 rng(0xe4);
  std::uniform_int_distribution<uint32_t> any;
  std::uniform_int_distribution<int> exp_dist(-14, 9);
  for (int i = 0; i < 500'000; ++i) {
    float x;
    if (i % 2 == 0) {
      x = float_of(any(rng));  // any bit pattern, NaN and inf included
    } else {  // the interesting range: around the e4m3 grid
      x = float_of((any(rng) & 0x807fffffu) | (static_cast<uint32_t>(exp_dist(rng) + 127) << 23));
    }
    ASSERT_EQ(num::e4m3_from_f32(x), e4m3_ref(x)) << std::hexfloat << x;
  }
}

// ================================ e2m1 ===========================================================

TEST(NumericsE2m1, DecodeAll16) {
  const float expected[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                              -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
  for (int c = 0; c < 16; ++c) {
    const float got = num::f32_from_e2m1(static_cast<uint8_t>(c));
    EXPECT_EQ(got, expected[c]) << c;
    EXPECT_EQ(std::signbit(got), c >= 8) << c;
  }
  // Only the low nibble matters.
  EXPECT_EQ(num::f32_from_e2m1(0xf5), 3.0f);
}

TEST(NumericsE2m1, EncodeGridValues) {
  for (int c = 0; c < 8; ++c) {
    EXPECT_EQ(num::e2m1_from_f32(static_cast<float>(kE2m1Grid[c])), c) << c;
    EXPECT_EQ(num::e2m1_from_f32(-static_cast<float>(kE2m1Grid[c])), 8 | c) << c;
  }
}

TEST(NumericsE2m1, TiesFollowTheSpecList) {
  // spec: 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4 (values).
  const struct { float x; uint8_t code; } ties[] = {
      {0.25f, 0}, {0.75f, 2}, {1.25f, 2}, {1.75f, 4}, {2.5f, 4}, {3.5f, 6}, {5.0f, 6}};
  for (const auto& t : ties) {
    EXPECT_EQ(num::e2m1_from_f32(t.x), t.code) << t.x;
    EXPECT_EQ(num::e2m1_from_f32(-t.x), 8 | t.code) << t.x;
    EXPECT_EQ(num::f32_from_e2m1(num::e2m1_from_f32(t.x)),
              static_cast<float>(t.x == 0.25f ? 0.0 : t.x == 0.75f || t.x == 1.25f ? 1.0 : t.x == 1.75f || t.x == 2.5f ? 2.0 : 4.0));
  }
}

TEST(NumericsE2m1, JustOffTheTiesGoesToTheNearest) {
  const struct { float mid; uint8_t below, above; } ties[] = {
      {0.25f, 0, 1}, {0.75f, 1, 2}, {1.25f, 2, 3}, {1.75f, 3, 4}, {2.5f, 4, 5}, {3.5f, 5, 6}, {5.0f, 6, 7}};
  for (const auto& t : ties) {
    EXPECT_EQ(num::e2m1_from_f32(std::nextafter(t.mid, 0.0f)), t.below) << t.mid;
    EXPECT_EQ(num::e2m1_from_f32(std::nextafter(t.mid, kInf)), t.above) << t.mid;
    EXPECT_EQ(num::e2m1_from_f32(-std::nextafter(t.mid, 0.0f)), 8 | t.below) << t.mid;
    EXPECT_EQ(num::e2m1_from_f32(-std::nextafter(t.mid, kInf)), 8 | t.above) << t.mid;
  }
}

TEST(NumericsE2m1, SaturatesAboveSix) {
  for (float x : {6.0f, std::nextafter(6.0f, kInf), 7.0f, 100.0f, 1e30f, kInf}) {
    EXPECT_EQ(num::e2m1_from_f32(x), 0x7) << x;
    EXPECT_EQ(num::e2m1_from_f32(-x), 0xf) << x;
  }
}

TEST(NumericsE2m1, SignBitIsKeptEvenForZero) {
  // Documented in the header: the sign bit is kept for every input.
  EXPECT_EQ(num::e2m1_from_f32(0.0f), 0x0);
  EXPECT_EQ(num::e2m1_from_f32(-0.0f), 0x8);
  EXPECT_EQ(num::e2m1_from_f32(-0.1f), 0x8);
  EXPECT_EQ(num::e2m1_from_f32(-0.25f), 0x8);
  EXPECT_EQ(num::e2m1_from_f32(-1e-30f), 0x8);
  // NaN: documented as code 7 with its sign.
  EXPECT_EQ(num::e2m1_from_f32(kNaN), 0x7);
  EXPECT_EQ(num::e2m1_from_f32(-kNaN), 0xf);
}

TEST(NumericsE2m1, RandomAgainstGridSearch) {
  std::mt19937 rng(0xe2);
  std::uniform_real_distribution<float> u(-7.0f, 7.0f);
  for (int i = 0; i < 200'000; ++i) {
    float x = u(rng);
    if (i % 3 == 0) x = std::ldexp(std::round(std::ldexp(x, 3)), -3);  // on the 1/8 lattice: ties hit
    ASSERT_EQ(num::e2m1_from_f32(x), e2m1_ref(x)) << x;
  }
}

TEST(NumericsE2m1, PackPutsTheEvenElementInTheLowNibble) {
  EXPECT_EQ(num::pack_e2m1(0x3, 0xa), 0xa3);
  EXPECT_EQ(num::pack_e2m1(0xa, 0x3), 0x3a);
  EXPECT_EQ(num::pack_e2m1(0xf, 0x0), 0x0f);
  EXPECT_EQ(num::pack_e2m1(0x0, 0xf), 0xf0);
  EXPECT_EQ(num::pack_e2m1(0x13, 0x2a), 0xa3);  // stray high bits are masked off
  for (int a = 0; a < 16; ++a)
    for (int b = 0; b < 16; ++b)
      EXPECT_EQ(num::pack_e2m1(static_cast<uint8_t>(a), static_cast<uint8_t>(b)), a + 16 * b);
}

// ================================ ue8m0 / pow2ceil ==============================================

TEST(NumericsUe8m0, ExactPowersOfTwoMapToThemselves) {
  for (int e = -126; e <= 127; ++e) {
    const float p = std::ldexp(1.0f, e);
    EXPECT_EQ(num::pow2ceil_exp(p), e) << e;
    EXPECT_EQ(num::pow2ceil(p), p) << e;
    EXPECT_EQ(num::pow2_f32(e), p) << e;
  }
}

TEST(NumericsUe8m0, NonPowersRoundUp) {
  EXPECT_EQ(num::pow2ceil(1.5f), 2.0f);
  EXPECT_EQ(num::pow2ceil(3.0f), 4.0f);
  EXPECT_EQ(num::pow2ceil(0.75f), 1.0f);
  EXPECT_EQ(num::pow2ceil(5.0f), 8.0f);
  EXPECT_EQ(num::pow2ceil(std::nextafter(1.0f, 0.0f)), 1.0f);
  EXPECT_EQ(num::pow2ceil(std::nextafter(1.0f, 2.0f)), 2.0f);
  for (int e = -126; e <= 126; ++e) {
    const float p = std::ldexp(1.0f, e);
    EXPECT_EQ(num::pow2ceil_exp(std::nextafter(p, kInf)), e + 1) << e;   // just above 2^e
    EXPECT_EQ(num::pow2ceil_exp(std::nextafter(2 * p, 0.0f)), e + 1) << e;  // just below 2^(e+1)
  }
  // Largest and smallest normals.
  EXPECT_EQ(num::pow2ceil_exp(std::numeric_limits<float>::max()), 128);
  EXPECT_EQ(num::pow2ceil_exp(std::numeric_limits<float>::min()), -126);
  EXPECT_EQ(num::pow2ceil_exp(std::nextafter(std::numeric_limits<float>::min(), 1.0f)), -125);
}

TEST(NumericsUe8m0, RandomNormalsAgainstFrexp) {
  std::mt19937 rng(0x8e);
  std::uniform_int_distribution<uint32_t> mant(0, 0x7fffffu), ex(1, 253);
  for (int i = 0; i < 200'000; ++i) {
    const uint32_t m = (i % 5 == 0) ? 0u : mant(rng);
    const float v = float_of((ex(rng) << 23) | m);
    const int e = ceil_log2_ref(v);
    ASSERT_EQ(num::pow2ceil_exp(v), e) << std::hexfloat << v;
    ASSERT_EQ(num::pow2ceil(v), std::ldexp(1.0f, e)) << std::hexfloat << v;
  }
}

TEST(NumericsUe8m0, ByteEncodingAndDecoding) {
  EXPECT_EQ(num::ue8m0_from_exp(0), 127);
  EXPECT_EQ(num::ue8m0_from_exp(-8), 119);
  EXPECT_EQ(num::ue8m0_from_exp(-22), 105);
  EXPECT_EQ(num::ue8m0_from_exp(-126), 1);
  EXPECT_EQ(num::ue8m0_from_exp(127), 254);
  const struct { uint8_t b; double v; } cases[] = {
      {127, 1.0}, {128, 2.0}, {126, 0.5}, {119, std::ldexp(1.0, -8)}, {105, std::ldexp(1.0, -22)},
      {1, std::ldexp(1.0, -126)}, {254, std::ldexp(1.0, 127)}, {0, std::ldexp(1.0, -127)}, {200, std::ldexp(1.0, 73)}};
  for (const auto& c : cases) EXPECT_EQ(static_cast<double>(num::f32_from_ue8m0(c.b)), c.v) << int(c.b);
  for (int e = -126; e <= 127; ++e) EXPECT_EQ(num::f32_from_ue8m0(num::ue8m0_from_exp(e)), std::ldexp(1.0f, e));
}

// ================================ quantizers =====================================================

// Independent act-quant scale exponent: amax floored at fp32(1e-4), times fp32(1/448) rounded
// once to fp32, then ceil(log2) by frexp.
int act_scale_exp_ref(double amax) {
  const float amax_f = std::max(static_cast<float>(amax), static_cast<float>(1e-4));
  const float inv448 = static_cast<float>(1.0 / 448.0);
  return ceil_log2_ref(f32_mul(amax_f, inv448));
}
int indexer_scale_exp_ref(double amax) {
  const float floor_v = static_cast<float>(std::ldexp(6.0, -126));
  const float amax_f = std::max(static_cast<float>(amax), floor_v);
  return ceil_log2_ref(f32_mul(amax_f, static_cast<float>(1.0 / 6.0)));
}
uint8_t kv_scale_byte_ref(double amax) {
  const float amax_f = std::max(static_cast<float>(amax), static_cast<float>(std::ldexp(6.0, -9)));
  const float q = std::min(f32_div(amax_f, 6.0f), 448.0f);
  return e4m3_ref(q);
}

double block_amax(const std::vector<float>& x) {
  double a = 0;
  for (float v : x) a = std::max(a, std::fabs(static_cast<double>(v)));
  return a;
}
float amax_by_header(const std::vector<float>& x) {
  float a = 0.0f;
  for (float v : x) a = num::block_amax_step(a, v);
  return a;
}

TEST(NumericsActQuant, ZeroAndTinyBlocksUseTheFloor) {
  // 1e-4 * fp32(1/448) = 2.2321e-7: 2^-23 = 1.19e-7 < it <= 2^-22 = 2.38e-7, so s = 2^-22.
  EXPECT_EQ(act_scale_exp_ref(0.0), -22);  // the reference agrees with the hand value
  EXPECT_EQ(num::act_quant_scale_exp(0.0f), -22);
  EXPECT_EQ(num::act_quant_scale_exp(1e-6f), -22);
  EXPECT_EQ(num::act_quant_scale_exp(9.99e-5f), -22);
  EXPECT_EQ(num::act_quant_scale_exp(1e-30f), -22);
  EXPECT_EQ(num::act_quant_scale_exp(std::numeric_limits<float>::denorm_min()), -22);
  const float s = num::pow2_f32(-22);
  for (float x : {0.0f, 1e-6f, -1e-6f, 1e-30f}) {
    EXPECT_EQ(num::act_quant_code(x, s), e4m3_ref(static_cast<float>(x / static_cast<double>(s)))) << x;
  }
  EXPECT_EQ(num::act_quant_code(0.0f, s), 0x00);
  EXPECT_EQ(num::act_quant_code(-0.0f, s), 0x80);
  // 1e-6 / 2^-22 = 4.194: neighbours 4 (0x48) and 4.5 (0x49), nearer 4.
  EXPECT_EQ(num::act_quant_code(1e-6f, s), 0x48);  // 4.0 = (1+0/8)*2^(9-7)
}

// act_quant_code_by_inv (the device paths' hoisted reciprocal) equals act_quant_code at every
// exponent it accepts, on random finite values, +-0, values that saturate, subnormals, inf and NaN;
// outside -126..126 act_quant_inv_scale is 0 (the callers divide).
TEST(NumericsActQuant, HoistedReciprocalEqualsDivByScale) {
  std::mt19937 rng(1234);
  std::uniform_int_distribution<uint32_t> bits;
  const float specials[] = {0.0f, -0.0f, 448.0f, -448.0f, 1e30f, -1e30f, 1e-40f, -1e-40f,
                            std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                            std::numeric_limits<float>::quiet_NaN()};
  for (int e = -130; e <= 130; ++e) {
    const float inv = num::act_quant_inv_scale(e);
    if (e < -126 || e > 126) {
      EXPECT_EQ(inv, 0.0f) << e;
      continue;
    }
    ASSERT_NE(inv, 0.0f) << e;
    const float s = num::pow2_f32(e);
    for (float x : specials) EXPECT_EQ(num::act_quant_code_by_inv(x, inv), num::act_quant_code(x, s)) << e << " " << x;
    for (int i = 0; i < 2000; ++i) {
      // Values around the scale: |x| / s spans the e4m3 range and a little beyond.
      const float x = std::ldexp(static_cast<float>(static_cast<int32_t>(bits(rng))) * 0x1.0p-31f, e + 10);
      ASSERT_EQ(num::act_quant_code_by_inv(x, inv), num::act_quant_code(x, s)) << e << " " << x;
      uint32_t u = bits(rng);
      float y;
      std::memcpy(&y, &u, sizeof(y));
      ASSERT_EQ(num::act_quant_code_by_inv(y, inv), num::act_quant_code(y, s)) << e << " bits " << u;
    }
  }
}

TEST(NumericsActQuant, AmaxExactly448TimesPowerOfTwo) {
  for (int k = -20; k <= 20; ++k) {
    const float amax = std::ldexp(448.0f, k);
    EXPECT_EQ(num::act_quant_scale_exp(amax), k) << k;
    EXPECT_EQ(act_scale_exp_ref(amax), k) << k;
    const float s = num::pow2_f32(k);
    EXPECT_EQ(num::act_quant_code(amax, s), 0x7e) << k;
    EXPECT_EQ(num::act_quant_code(-amax, s), 0xfe) << k;
    // Just above 448 * 2^k the scale doubles.
    EXPECT_EQ(num::act_quant_scale_exp(std::nextafter(amax, kInf)), k + 1) << k;
  }
  // Values beyond the block's own scale clamp to +-448.
  EXPECT_EQ(num::act_quant_code(1000.0f, 1.0f), 0x7e);
  EXPECT_EQ(num::act_quant_code(-1e20f, 1.0f), 0xfe);
}

TEST(NumericsActQuant, AmaxOneGivesScaleTwoToMinusEight) {
  // fp32(1/448) = 2.232e-3 in (2^-9, 2^-8]: s = 2^-8, codes are e4m3(256 x).
  EXPECT_EQ(num::act_quant_scale_exp(1.0f), -8);
  const float s = num::pow2_f32(-8);
  EXPECT_EQ(num::act_quant_code(1.0f, s), 0x78);   // 256 = 2^8: e = 15, m = 0
  EXPECT_EQ(num::act_quant_code(-1.0f, s), 0xf8);
  EXPECT_EQ(num::act_quant_code(0.5f, s), 0x70);   // 128 = 2^7
  EXPECT_EQ(num::act_quant_code(0.75f, s), 0x74);  // 192 = 1.5 * 2^7
  EXPECT_EQ(num::act_quant_code(std::ldexp(1.0f, -17), s), 0x01);  // 2^-9
  EXPECT_EQ(num::act_quant_code(std::ldexp(1.0f, -18), s), 0x00);  // 2^-10: tie to 0
  EXPECT_EQ(num::act_quant_code(0.0078125f, s), 0x40);  // 2^-7 * 256 = 2 = 2^(8-7)
  // (2^-7 + 2^-11) * 256 = 2.125: the tie between 2 (0x40) and 2.25 (0x41) goes to 0x40.
  EXPECT_EQ(num::act_quant_code(0.0078125f + std::ldexp(1.0f, -11), s), 0x40);
}

TEST(NumericsActQuant, RandomBlocksMatchIndependentPath) {
  std::mt19937 rng(0xac7);
  std::uniform_int_distribution<int> base_exp(-30, 20);
  for (int blk = 0; blk < 4000; ++blk) {
    const int e0 = base_exp(rng);
    std::vector<float> x(num::kActQuantBlock);
    for (float& v : x) v = random_bf16(rng, e0 - 12, e0);
    if (blk % 7 == 0) x[blk % 32] = 0.0f;
    const double amax = block_amax(x);
    ASSERT_EQ(static_cast<double>(amax_by_header(x)), amax);
    const int e = num::act_quant_scale_exp(amax_by_header(x));
    ASSERT_EQ(e, act_scale_exp_ref(amax)) << "block " << blk;
    const float s = num::pow2_f32(e);
    ASSERT_EQ(static_cast<double>(s), std::ldexp(1.0, e));
    std::vector<uint8_t> codes(x.size(), 0x7f);  // poisoned (NaN code)
    for (size_t j = 0; j < x.size(); ++j) codes[j] = num::act_quant_code(x[j], s);
    for (size_t j = 0; j < x.size(); ++j) {
      const double v = std::clamp(x[j] / std::ldexp(1.0, e), -448.0, 448.0);
      ASSERT_EQ(codes[j], e4m3_ref(static_cast<float>(v))) << "block " << blk << " j " << j;
      // Fake quant: within half an e4m3 ulp (2^-4 relative) or half the subnormal step (2^-10 s).
      const double deq = static_cast<double>(num::f32_from_e4m3(codes[j])) * std::ldexp(1.0, e);
      ASSERT_LE(std::fabs(deq - x[j]), std::max(std::fabs(x[j]) * 0.0625, std::ldexp(1.0, e - 10)));
      // The block's amax never needs clamping: |x / s| <= 448.
      ASSERT_LE(std::fabs(x[j] / std::ldexp(1.0, e)), 448.0);
    }
  }
}

TEST(NumericsIndexerQuant, ZeroAndTinyBlocksUseTheFloor) {
  // fp32(1/6) = 0xaaaaab * 2^-26 and 6 * 0xaaaaab = 2^26 + 2, so 6 * fp32(1/6) = 1 + 2^-25, a
  // quarter ulp above 1: 6 * 2^-126 * fp32(1/6) rounds to 2^-126 exactly, s = 2^-126.
  EXPECT_EQ(indexer_scale_exp_ref(0.0), -126);
  EXPECT_EQ(num::indexer_quant_scale_exp(0.0f), -126);
  EXPECT_EQ(num::indexer_quant_scale_exp(1e-39f), -126);  // fp32 denormal amax
  EXPECT_EQ(num::indexer_quant_scale_exp(7e-38f), -126);  // just below 6 * 2^-126 = 7.05e-38
  EXPECT_EQ(num::indexer_quant_scale_exp(std::numeric_limits<float>::min()), -126);
  const float s = num::pow2_f32(-126);
  EXPECT_EQ(num::fp4_code(0.0f, s), 0x0);
  EXPECT_EQ(num::fp4_code(-0.0f, s), 0x8);
  EXPECT_EQ(num::fp4_code(std::numeric_limits<float>::min(), s), 0x2);  // 2^-126 / 2^-126 = 1
}

TEST(NumericsIndexerQuant, AmaxSixTimesPowerOfTwoAndAmaxOne) {
  for (int k = -20; k <= 20; ++k) {
    const float amax = std::ldexp(6.0f, k);
    EXPECT_EQ(num::indexer_quant_scale_exp(amax), k) << k;
    EXPECT_EQ(indexer_scale_exp_ref(amax), k) << k;
    const float s = num::pow2_f32(k);
    EXPECT_EQ(num::fp4_code(amax, s), 0x7) << k;
    EXPECT_EQ(num::fp4_code(-amax, s), 0xf) << k;
    EXPECT_EQ(num::indexer_quant_scale_exp(std::nextafter(amax, kInf)), k + 1) << k;
  }
  // amax 1: fp32(1/6) = 0.1667 in (1/8, 1/4]: s = 1/4, codes are e2m1(4 x).
  EXPECT_EQ(num::indexer_quant_scale_exp(1.0f), -2);
  const float s = 0.25f;
  EXPECT_EQ(num::fp4_code(1.0f, s), 0x6);     // 4
  EXPECT_EQ(num::fp4_code(-0.5f, s), 0xc);    // -2
  EXPECT_EQ(num::fp4_code(0.625f, s), 0x4);   // 2.5: tie -> 2
  EXPECT_EQ(num::fp4_code(0.875f, s), 0x6);   // 3.5: tie -> 4
  EXPECT_EQ(num::fp4_code(0.0625f, s), 0x0);  // 0.25: tie -> 0
  EXPECT_EQ(num::fp4_code(3.0f, s), 0x7);     // 12 clamps to 6
  EXPECT_EQ(num::fp4_code(-3.0f, s), 0xf);
}

TEST(NumericsIndexerQuant, RandomBlocksMatchIndependentPath) {
  std::mt19937 rng(0x1d8);
  std::uniform_int_distribution<int> base_exp(-40, 30);
  for (int blk = 0; blk < 4000; ++blk) {
    const int e0 = base_exp(rng);
    std::vector<float> x(num::kIndexerQuantBlock);
    for (float& v : x) v = random_bf16(rng, e0 - 6, e0);
    const double amax = block_amax(x);
    const int e = num::indexer_quant_scale_exp(amax_by_header(x));
    ASSERT_EQ(e, indexer_scale_exp_ref(amax)) << "block " << blk;
    const double s = std::ldexp(1.0, e);
    std::vector<uint8_t> codes(x.size(), 0xff);
    for (size_t j = 0; j < x.size(); ++j) codes[j] = num::fp4_code(x[j], num::pow2_f32(e));
    for (size_t j = 0; j < x.size(); ++j) {
      const double v = std::clamp(x[j] / s, -6.0, 6.0);
      ASSERT_EQ(codes[j], e2m1_ref(static_cast<float>(v))) << "block " << blk << " j " << j;
      ASSERT_LE(std::fabs(x[j] / s), 6.0);
      const double deq = static_cast<double>(num::f32_from_e2m1(codes[j])) * s;
      ASSERT_LE(std::fabs(deq - x[j]), s * e2m1_half_gap(v));
    }
  }
}

TEST(NumericsKvFp4Quant, ScaleByteHandCases) {
  EXPECT_EQ(num::kv_fp4_scale_byte(6.0f), 0x38);   // 6 / 6 = 1.0
  EXPECT_EQ(num::kv_fp4_scale_byte(0.0f), 0x01);   // floor 6 * 2^-9 -> 2^-9
  EXPECT_EQ(num::kv_fp4_scale_byte(1e-6f), 0x01);
  EXPECT_EQ(num::kv_fp4_scale_byte(std::ldexp(6.0f, -9)), 0x01);
  EXPECT_EQ(num::kv_fp4_scale_byte(std::ldexp(6.0f, -8)), 0x02);  // 2^-8 = 2 * 2^-9
  EXPECT_EQ(num::kv_fp4_scale_byte(12.0f), 0x40);  // 2.0
  EXPECT_EQ(num::kv_fp4_scale_byte(7.0f), 0x39);   // 1.1667: nearer 1.125 than 1.25
  EXPECT_EQ(num::kv_fp4_scale_byte(7.125f), 0x3a); // 7.125 / 6 = 1.1875 exactly: tie 1.125|1.25 -> even 0x3a
  // One fp32 ulp below 7.125: amax / 6 = 1.1875 - 2^-21 / 6 rounds to 1.1875 - 2^-23, below the
  // tie, so 0x39. (Multiplying by fp32(1/6) instead would round to 1.1875 and give 0x3a: the
  // spec divides.)
  EXPECT_EQ(num::kv_fp4_scale_byte(std::nextafter(7.125f, 0.0f)), 0x39);
  EXPECT_EQ(num::kv_fp4_scale_byte(std::nextafter(1824.0f, 0.0f)), 0x79);  // same at 304 = 1.1875 * 2^8
  EXPECT_EQ(num::kv_fp4_scale_byte(6.0f * 448.0f), 0x7e);
  EXPECT_EQ(num::kv_fp4_scale_byte(1e6f), 0x7e);   // clamped at 448
  EXPECT_EQ(num::kv_fp4_scale_byte(kInf), 0x7e);
  for (double a : {0.0, 1e-6, 6.0, 7.0, 7.125, 12.0, 2688.0, 1e6, static_cast<double>(std::nextafter(7.125f, 0.0f))}) EXPECT_EQ(num::kv_fp4_scale_byte(static_cast<float>(a)), kv_scale_byte_ref(a)) << a;
}

TEST(NumericsKvFp4Quant, RandomBlocksMatchIndependentPath) {
  std::mt19937 rng(0xf4);
  std::uniform_int_distribution<int> base_exp(-14, 10);
  double worst_rel_normal_scale = 0;
  for (int blk = 0; blk < 4000; ++blk) {
    const int e0 = base_exp(rng);
    std::vector<float> x(num::kKvFp4Block);
    for (float& v : x) v = random_bf16(rng, e0 - 5, e0);
    const double amax = block_amax(x);
    const uint8_t sb = num::kv_fp4_scale_byte(amax_by_header(x));
    ASSERT_EQ(sb, kv_scale_byte_ref(amax)) << "block " << blk;
    const float s = num::f32_from_e4m3(sb);
    std::vector<uint8_t> codes(x.size(), 0xff);
    for (size_t j = 0; j < x.size(); ++j) codes[j] = num::fp4_code(x[j], s);
    for (size_t j = 0; j < x.size(); ++j) {
      const float v = std::clamp(f32_div(x[j], s), -6.0f, 6.0f);
      ASSERT_EQ(codes[j], e2m1_ref(v)) << "block " << blk << " j " << j;
      // The e4m3 scale may be below amax / 6 (by up to 1/16 for a normal scale, much more for a
      // subnormal one), so |x / s| can exceed 6 (clamped); the dequantised value is within half
      // a grid gap plus that overshoot.
      const double ratio = std::fabs(static_cast<double>(x[j]) / s);
      if (s >= std::ldexp(1.0f, -6)) {
        ASSERT_LE(ratio, 6.0 * (1.0 + 1.0 / 15.0));
      }
      const double deq = static_cast<double>(num::f32_from_e2m1(codes[j])) * s;
      ASSERT_LE(std::fabs(deq - x[j]), s * (e2m1_half_gap(std::min(ratio, 6.0)) + std::max(ratio - 6.0, 0.0)) * (1 + 1e-12));
      if (s >= std::ldexp(1.0f, -6)) worst_rel_normal_scale = std::max(worst_rel_normal_scale, std::fabs(deq - x[j]) / amax);
    }
  }
  // With a normal scale the error stays within half the top grid gap (1 of 6) plus the
  // overshoot: about amax / 6.
  EXPECT_LT(worst_rel_normal_scale, 1.0 / 6.0 + 0.05);
}

TEST(NumericsQuant, BlockAmaxSkipsNanAndTakesMagnitudes) {
  EXPECT_EQ(num::block_amax_step(0.0f, -3.0f), 3.0f);
  EXPECT_EQ(num::block_amax_step(3.0f, -2.0f), 3.0f);
  EXPECT_EQ(num::block_amax_step(3.0f, kNaN), 3.0f);
  EXPECT_EQ(num::block_amax_step(kNaN, -5.0f), 5.0f);
  EXPECT_EQ(num::block_amax_step(0.0f, -kInf), kInf);
}

// ================================ LaneSum and RMSNorm ============================================

// The documented LaneSum order written out independently: walk the row element by element;
// element j belongs to chunk j / 8, which belongs to lane (j / 8) % 32, so each lane sees its
// chunks in increasing order and each chunk's terms in order. Then the butterfly as a tree on
// lane 0: level `off` adds lane l + off into lane l for l < off (what xor-shuffle lane 0 holds).
float lane_sum_squares_ref(const std::vector<float>& x) {
  std::array<float, 32> partial{};
  for (size_t j = 0; j < x.size(); ++j) {
    const size_t lane = (j / 8) % 32;
    volatile float sq = x[j] * x[j];
    volatile float acc = partial[lane] + sq;
    partial[lane] = acc;
  }
  for (int off = 16; off >= 1; off /= 2)
    for (int l = 0; l < off; ++l) {
      volatile float s = partial[l] + partial[l + off];
      partial[l] = s;
    }
  return partial[0];
}

std::vector<float> random_row(std::mt19937& rng, int n, int emin, int emax) {
  std::vector<float> x(n);
  for (float& v : x) v = random_bf16(rng, emin, emax);
  return x;
}

TEST(NumericsLaneSum, SquaresMatchTheDocumentedOrderBitExactly) {
  std::mt19937 rng(0x1a2e);
  int differs_from_sequential = 0;
  for (int n : {8, 128, 264, 512, 1280}) {
    for (int trial = 0; trial < 200; ++trial) {
      const std::vector<float> x = random_row(rng, n, -8, 8);
      const float got = num::lane_sum_squares(x.data(), n);
      ASSERT_EQ(bits_of(got), bits_of(lane_sum_squares_ref(x))) << "n=" << n << " trial " << trial;
      float seq = 0.0f;
      for (float v : x) seq = f32_add(seq, f32_mul(v, v));
      differs_from_sequential += bits_of(seq) != bits_of(got);
    }
  }
  // The inputs are varied enough that the order is observable: a plain sequential sum differs
  // often, so the bit-exact comparison above really checks the order.
  EXPECT_GT(differs_from_sequential, 100);
}

TEST(NumericsLaneSum, SquaresWithinFp32BoundOfExactSum) {
  std::mt19937 rng(0x55);
  for (int n : {128, 512, 1280}) {
    // Rounding depth: one product, n/32 sequential adds in a lane, 5 butterfly levels.
    const double k = n / 32 + 5 + 1;
    const double u = std::ldexp(1.0, -24);
    const double bound = k * u / (1 - k * u);
    for (int trial = 0; trial < 100; ++trial) {
      const std::vector<float> x = random_row(rng, n, -20, 20);
      double exact = 0;
      for (float v : x) exact += static_cast<double>(v) * v;  // products exact; sum error ~1e-16 rel
      const float got = num::lane_sum_squares(x.data(), n);
      EXPECT_LE(std::fabs(got - exact), bound * exact) << "n=" << n;
    }
  }
}

TEST(NumericsLaneSum, CombineIsTheXorButterflyAndEveryLaneAgrees) {
  std::mt19937 rng(0xb7);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (int trial = 0; trial < 1000; ++trial) {
    std::array<float, 32> p{};
    for (int l = 0; l < 32; ++l) p[l] = std::ldexp(u(rng), static_cast<int>(rng() % 40) - 20);
    std::array<float, 32> tree = p;
    for (int off = 16; off >= 1; off /= 2)
      for (int l = 0; l < off; ++l) tree[l] = f32_add(tree[l], tree[l + off]);
    std::array<float, 32> q = p;
    const float total = num::lane_sum_combine(q.data());
    ASSERT_EQ(bits_of(total), bits_of(tree[0]));
    for (int l = 0; l < 32; ++l) ASSERT_EQ(bits_of(q[l]), bits_of(total)) << "lane " << l;
  }
  // A hand case where the order decides: 1 + 2^-24 + 2^-24 is 1 when added one at a time, but the
  // butterfly pairs the two small values first (lanes 8 and 24 meet at level 16), giving 1 + 2^-23.
  std::array<float, 32> p{};
  p[0] = 1.0f;
  p[8] = std::ldexp(1.0f, -24);
  p[24] = std::ldexp(1.0f, -24);
  // Level 16: lane 8 gets p8 + p24 = 2^-23; level 8: lane 0 gets 1 + 2^-23.
  EXPECT_EQ(num::lane_sum_combine(p.data()), 1.0f + std::ldexp(1.0f, -23));
}

TEST(NumericsRmsNorm, RstdIsTheSpecSequenceAndWithinBoundOfDouble) {
  std::mt19937 rng(0x125);
  const double u = std::ldexp(1.0, -24);
  double worst_ulps = 0;
  for (int n : {128, 512, 1280}) {
    for (int trial = 0; trial < 2000; ++trial) {
      const std::vector<float> x = random_row(rng, n, -30, 30);
      const float ss = num::lane_sum_squares(x.data(), n);
      for (float eps : {1e-20f, 1e-6f}) {
        const float r = num::rmsnorm_rstd(ss, n, eps);
        // fp32(1 / fp32(sqrt(fp32(fp32(ss / n) + eps)))), each step rounded once.
        const float mean = f32_div(ss, static_cast<float>(n));
        const float sum = f32_add(mean, eps);
        const float root = static_cast<float>(std::sqrt(static_cast<double>(sum)));  // correctly rounded
        ASSERT_EQ(bits_of(r), bits_of(f32_div(1.0f, root))) << "n=" << n;
        // Against the exact value of the same ss: 4 roundings, two of them halved by the sqrt:
        // relative error <= 3u.
        const double exact = 1.0 / std::sqrt(static_cast<double>(ss) / n + static_cast<double>(eps));
        ASSERT_LE(std::fabs(r - exact), 3 * u * exact * (1 + 1e-9));
        worst_ulps = std::max(worst_ulps, ulps_off(r, exact));
      }
    }
  }
  // 3u relative is at most 3 ulps (1.5 where the mantissa is small); seen: about 1.6.
  EXPECT_LE(worst_ulps, 3.0);
  EXPECT_GT(worst_ulps, 0.0);  // the comparison is not vacuous
  // Where eps matters: an all-zero row gives 1 / sqrt(eps), finite (norm_eps = 1e-20 is a
  // normal fp32 number); a mean equal to eps doubles the radicand.
  const float r0 = num::rmsnorm_rstd(0.0f, 512, 1e-20f);
  EXPECT_EQ(r0, f32_div(1.0f, static_cast<float>(std::sqrt(static_cast<double>(1e-20f)))));
  EXPECT_NEAR(r0, 1e10, 1e10 * 1e-6);
  const float mean_eq_eps = num::rmsnorm_rstd(f32_mul(1e-6f, 512.0f), 512, 1e-6f);
  EXPECT_NEAR(mean_eq_eps, 1.0 / std::sqrt(2e-6), 1e-3);
  // Hand case: ss = 512 * 4 over n = 512 -> mean 4, r = 0.5.
  EXPECT_EQ(num::rmsnorm_rstd(2048.0f, 512, 0.0f), 0.5f);
  EXPECT_EQ(num::rmsnorm_rstd(2048.0f, 512, 1e-20f), 0.5f);  // eps far below half an ulp of 4
}

TEST(NumericsRmsNorm, ApplyMultipliesTheWeightAfterTheNormalisation) {
  EXPECT_EQ(num::rmsnorm_apply(3.0f, 0.5f, 2.0f), 0x4040);  // 3 * 0.5 * 2 = 3
  EXPECT_EQ(num::rmsnorm_apply(-1.0f, 0.25f, 4.0f), 0xbf80);
  std::mt19937 rng(0xa991);
  std::uniform_real_distribution<float> u(0.5f, 2.0f);
  int order_visible = 0;
  for (int i = 0; i < 1'000'000; ++i) {
    const float x = random_bf16(rng, -10, 10), r = u(rng), w = random_bf16(rng, -3, 3);
    const uint16_t got = num::rmsnorm_apply(x, r, w);
    ASSERT_EQ(got, bf16_ref(f32_mul(w, f32_mul(x, r))));
    order_visible += got != bf16_ref(f32_mul(f32_mul(w, x), r));
  }
  EXPECT_GT(order_visible, 0);  // the other order is distinguishable on these inputs
}

TEST(NumericsRmsNorm, FullRowAgainstDouble) {
  std::mt19937 rng(0x12);
  for (int n : {128, 512, 1280}) {
    const std::vector<float> x = random_row(rng, n, -4, 4);
    std::vector<float> w(n);
    for (float& v : w) v = random_bf16(rng, -2, 1);
    const float ss = num::lane_sum_squares(x.data(), n);
    const float r = num::rmsnorm_rstd(ss, n, 1e-20f);
    std::vector<uint16_t> y(n, 0xffff);  // poisoned (NaN)
    for (int j = 0; j < n; ++j) y[j] = num::rmsnorm_apply(x[j], r, w[j]);
    double ms = 0;
    for (float v : x) ms += static_cast<double>(v) * v;
    const double rd = 1.0 / std::sqrt(ms / n + 1e-20);
    for (int j = 0; j < n; ++j) {
      const double exact = static_cast<double>(w[j]) * x[j] * rd;
      const double got = num::f32_from_bf16(y[j]);
      // bf16 rounding (half an ulp: 2^-8 relative) plus a few fp32 roundings upstream.
      ASSERT_LE(std::fabs(got - exact), std::fabs(exact) * (std::ldexp(1.0, -8) + 1e-6)) << "n=" << n << " j=" << j;
    }
  }
}

// ================================ RoPE rotation ==================================================

TEST(NumericsRope, HandComputedRotations) {
  float re = kNaN, im = kNaN;
  num::rope_rotate(1.0f, 0.0f, 0.0f, 1.0f, re, im);  // 1 * i = i
  EXPECT_EQ(re, 0.0f);
  EXPECT_EQ(im, 1.0f);
  re = im = kNaN;
  num::rope_rotate(3.0f, 4.0f, 0.5f, 0.75f, re, im);  // 1.5 - 3, 2.25 + 2
  EXPECT_EQ(re, -1.5f);
  EXPECT_EQ(im, 4.25f);
  re = im = kNaN;
  num::rope_rotate_inverse(3.0f, 4.0f, 0.5f, 0.75f, re, im);  // 1.5 + 3, -2.25 + 2
  EXPECT_EQ(re, 4.5f);
  EXPECT_EQ(im, -0.25f);
  re = im = kNaN;
  num::rope_rotate(2.0f, -1.0f, 1.0f, 0.0f, re, im);  // identity
  EXPECT_EQ(re, 2.0f);
  EXPECT_EQ(im, -1.0f);
  re = im = kNaN;
  num::rope_rotate(2.0f, -1.0f, -1.0f, 0.0f, re, im);  // half turn
  EXPECT_EQ(re, -2.0f);
  EXPECT_EQ(im, 1.0f);
}

TEST(NumericsRope, ProductsAreRoundedBeforeTheSumNoFma) {
  // a = 1 + 2^-12: a * a = 1 + 2^-11 + 2^-24 (a tie, rounds down to 1 + 2^-11);
  // b * d with b = a + 2^-23, d = a - 2^-23 is a*a - 2^-46 (rounds to 1 + 2^-11 too).
  // Separately rounded, a*a - b*d = 0; any fused form gives +-(2^-24 or 2^-24 - 2^-46).
  const float a = 1.0f + std::ldexp(1.0f, -12);
  const float b = a + std::ldexp(1.0f, -23), d = a - std::ldexp(1.0f, -23);
  ASSERT_EQ(std::fma(a, a, -f32_mul(b, d)), std::ldexp(1.0f, -24));  // the fused forms differ
  ASSERT_NE(std::fma(-b, d, f32_mul(a, a)), 0.0f);
  float re = kNaN, im = kNaN;
  num::rope_rotate(/*re=*/a, /*im=*/b, /*c=*/a, /*s=*/d, re, im);
  EXPECT_EQ(re, 0.0f);  // a*c - b*s
  volatile float p1 = a * d, p2 = b * a;
  volatile float im_expected = p1 + p2;
  EXPECT_EQ(bits_of(im), bits_of(im_expected));
  // The imaginary part: re*s + im*c with im negative cancels the same way.
  re = im = kNaN;
  num::rope_rotate(/*re=*/a, /*im=*/-b, /*c=*/d, /*s=*/a, re, im);
  EXPECT_EQ(im, 0.0f);  // a*a + (-b)*d
  volatile float q1 = a * d, q2 = -b * a;
  volatile float re_expected = q1 - q2;
  EXPECT_EQ(bits_of(re), bits_of(re_expected));
  ASSERT_NE(std::fma(a, a, -f32_mul(b, d)), 0.0f);
  ASSERT_NE(std::fma(-b, d, f32_mul(a, a)), 0.0f);
}

TEST(NumericsRope, RandomRotationsMatchSeparatelyRoundedProducts) {
  std::mt19937 rng(0x20e);
  std::uniform_real_distribution<float> ang(-3.2f, 3.2f);
  int fma_would_differ = 0;
  for (int i = 0; i < 200'000; ++i) {
    const float re_in = random_bf16(rng, -6, 6), im_in = random_bf16(rng, -6, 6);
    const double t = ang(rng);
    const float c = static_cast<float>(std::cos(t)), s = static_cast<float>(std::sin(t));
    float re = kNaN, im = kNaN;
    num::rope_rotate(re_in, im_in, c, s, re, im);
    volatile float rc = re_in * c, is = im_in * s, rs = re_in * s, ic = im_in * c;
    volatile float exp_re = rc - is, exp_im = rs + ic;
    ASSERT_EQ(bits_of(re), bits_of(exp_re));
    ASSERT_EQ(bits_of(im), bits_of(exp_im));
    fma_would_differ += std::fma(re_in, c, -is) != exp_re;
    float ire = kNaN, iim = kNaN;
    num::rope_rotate_inverse(re_in, im_in, c, s, ire, iim);
    volatile float is2 = im_in * -s, rs2 = re_in * -s;
    volatile float exp_ire = rc - is2, exp_iim = rs2 + ic;
    ASSERT_EQ(bits_of(ire), bits_of(exp_ire));
    ASSERT_EQ(bits_of(iim), bits_of(exp_iim));
  }
  EXPECT_GT(fma_would_differ, 1000);  // the comparison can tell a fused implementation apart
}

// ================================ pair softmax ===================================================

TEST(NumericsPairSoftmax, EqualScoresGiveTheAverage) {
  EXPECT_EQ(num::pair_softmax_pool(1.0f, 0.3f, 3.0f, 0.3f), 2.0f);
  EXPECT_EQ(num::pair_softmax_pool(-5.0f, -100.0f, 1.0f, -100.0f), -2.0f);
  std::mt19937 rng(0xa5);
  for (int i = 0; i < 10000; ++i) {
    const float a = random_bf16(rng, -10, 10), b = random_bf16(rng, -10, 10), sc = random_bf16(rng, -5, 5);
    // p = 1/2 exactly; a/2 and b/2 exact, one rounding of the sum.
    ASSERT_EQ(num::pair_softmax_pool(a, sc, b, sc), static_cast<float>((static_cast<double>(a) + b) / 2));
  }
}

TEST(NumericsPairSoftmax, MinusInfinityPartnerGivesTheOtherValueExactly) {
  std::mt19937 rng(0x1f);
  for (int i = 0; i < 10000; ++i) {
    const float kv_a = random_bf16(rng, -20, 20), kv_b = random_bf16(rng, -20, 20), sc = random_bf16(rng, -10, 10);
    ASSERT_EQ(bits_of(num::pair_softmax_pool(kv_a, -kInf, kv_b, sc)), bits_of(kv_b));
    ASSERT_EQ(bits_of(num::pair_softmax_pool(kv_a, sc, kv_b, -kInf)), bits_of(kv_a));
  }
  // The pair state starts with score -inf and (say) zero kv.
  EXPECT_EQ(num::pair_softmax_pool(0.0f, -kInf, 1.25f, 0.0f), 1.25f);
}

TEST(NumericsPairSoftmax, LargeScoreDifference) {
  // exp(-200) underflows fp32 to 0: the winner's value exactly.
  EXPECT_EQ(num::pair_softmax_pool(1.5f, 200.0f, -7.0f, 0.0f), 1.5f);
  EXPECT_EQ(num::pair_softmax_pool(1.5f, 0.0f, -7.0f, 200.0f), -7.0f);
  // Difference 20: eb = fp32(exp(-20)) = 2.06e-9; p_a rounds to 1 (eb < 2^-25), p_b = eb / (1 + eb).
  const float eb = static_cast<float>(std::exp(-20.0));
  const float den = f32_add(1.0f, eb);
  ASSERT_EQ(den, 1.0f);
  const float expected = f32_add(f32_mul(1.0f, 1.0f), f32_mul(1000.0f, f32_div(eb, den)));
  EXPECT_EQ(num::pair_softmax_pool(1.0f, 20.0f, 1000.0f, 0.0f), expected);
  EXPECT_NE(expected, 1.0f);  // the small weight still shows
}

TEST(NumericsPairSoftmax, RandomAgainstSpecSequenceAndDouble) {
  std::mt19937 rng(0x50f7);
  std::uniform_real_distribution<float> sd(-30.0f, 30.0f);
  const double u = std::ldexp(1.0, -24);
  for (int i = 0; i < 200'000; ++i) {
    const float kv_a = random_bf16(rng, -8, 8), kv_b = random_bf16(rng, -8, 8);
    const float sa = sd(rng), sb = (i % 4 == 0) ? sa + sd(rng) * 0.01f : sd(rng);
    const float got = num::pair_softmax_pool(kv_a, sa, kv_b, sb);
    // The spec's fp32 sequence, each step rounded once (exp in double, rounded to fp32).
    const float m = std::max(sa, sb);
    const float ea = static_cast<float>(std::exp(static_cast<double>(f32_sub(sa, m))));
    const float eb = static_cast<float>(std::exp(static_cast<double>(f32_sub(sb, m))));
    const float den = f32_add(ea, eb);
    const float expected = f32_add(f32_mul(kv_a, f32_div(ea, den)), f32_mul(kv_b, f32_div(eb, den)));
    ASSERT_EQ(bits_of(got), bits_of(expected)) << i;
    // Against exact math: p_a, p_b carry <= 3u (exp, sum, division), the products and the sum
    // <= 2u more, relative to |kv_a| p_a + |kv_b| p_b; the rounded difference a - m (<= u|a-m|
    // absolute) is amplified by exp into a relative error of up to |a - b| u.
    const double md = std::max<double>(sa, sb);
    const double xa = std::exp(sa - md), xb = std::exp(sb - md);
    const double pa = xa / (xa + xb), pb = xb / (xa + xb);
    const double exact = kv_a * pa + kv_b * pb;
    const double scale = std::fabs(kv_a) * pa + std::fabs(kv_b) * pb;
    ASSERT_LE(std::fabs(got - exact), (6 + std::fabs(static_cast<double>(sa) - sb)) * u * scale) << i;
  }
}

}  // namespace

// div_by_scale (the quantizers' x / s): the same bits as the IEEE division for every power-of-two
// scale with a normal reciprocal (where it multiplies) and for any other scale (where it divides),
// on a sweep of fp32 patterns (every exponent, random mantissas, zeros, subnormals, inf, NaN).
TEST(NumericsQuant, DivideByScaleMatchesDivision) {
  std::vector<float> scales;
  for (int e = -126; e <= 127; ++e) scales.push_back(num::pow2_f32(e));
  for (float s : {3.0f, 0.375f, 448.0f, 1.5e-30f, -2.0f, 0.0f, 1e-40f}) scales.push_back(s);
  uint64_t st = 0x9E3779B97F4A7C15ull;
  auto next = [&st] {
    st ^= st << 13;
    st ^= st >> 7;
    st ^= st << 17;
    return st;
  };
  int checked = 0;
  for (uint32_t exp_bits = 0; exp_bits < 256; ++exp_bits)
    for (int i = 0; i < 24; ++i) {
      const uint32_t bits = (static_cast<uint32_t>(next() & 1u) << 31) | (exp_bits << 23) |
                            static_cast<uint32_t>(i == 0 ? 0u : next() & 0x7fffffu);
      const float x = num::f32_from_bits(bits);
      for (float s : scales) {
        const float a = num::div_by_scale(x, s), b = num::div_rn(x, s);
        if (num::is_nan(a) && num::is_nan(b)) continue;
        ASSERT_EQ(num::f32_bits(a), num::f32_bits(b)) << "x bits 0x" << std::hex << bits << " s " << s;
        ++checked;
      }
    }
  EXPECT_GT(checked, 1000000);
}
