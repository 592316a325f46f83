// Helpers for the CPU reference tests (test_ref_*.cpp): independent decoders of the storage
// formats (written from the format definitions, not through numerics.h), bf16 ulp distance,
// seeded random inputs. Header-only; tests/cpu/*.cpp are the test sources.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <random>
#include <vector>

#include "v4attn/numerics.h"

namespace reftest {

using v4attn::num::bf16_t;

// float8 e4m3fn from its definition: bias 7, subnormals m * 2^-9, 0x7f / 0xff NaN.
inline double e4m3_value(uint8_t code) {
  const int e = (code >> 3) & 0xf, m = code & 7;
  double mag;
  if (e == 15 && m == 7) mag = std::nan("");
  else if (e == 0) mag = m * std::ldexp(1.0, -9);
  else mag = (1.0 + m / 8.0) * std::ldexp(1.0, e - 7);
  return (code & 0x80) ? -mag : mag;
}
// e2m1 from its grid {0, .5, 1, 1.5, 2, 3, 4, 6}, sign in bit 3.
inline double e2m1_value(uint8_t nibble) {
  static const double kMag[8] = {0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0};
  return (nibble & 8u) ? -kMag[nibble & 7u] : kMag[nibble & 7u];
}
inline double ue8m0_value(uint8_t b) { return std::ldexp(1.0, static_cast<int>(b) - 127); }

inline float bf16_value(bf16_t b) { return v4attn::num::f32_from_bf16(b); }
// A bf16 that holds v exactly (the tests only feed such values).
inline bf16_t bf16_exact(double v) {
  const float f = static_cast<float>(v);
  const bf16_t b = v4attn::num::bf16_from_f32(f);
  EXPECT_EQ(static_cast<double>(v4attn::num::f32_from_bf16(b)), v) << v << " is not a bf16 value";
  return b;
}
// Position of a bf16 on the number line (monotone integer; +0 and -0 coincide).
inline int32_t bf16_ordinal(bf16_t b) {
  const int32_t mag = b & 0x7fff;
  return (b & 0x8000) ? -mag : mag;
}
// bf16 ulps between a bf16 and the bf16 rounding of a double value.
inline int32_t bf16_ulps(bf16_t got, double expected) {
  const bf16_t want = v4attn::num::bf16_from_f32(static_cast<float>(expected));
  return std::abs(bf16_ordinal(got) - bf16_ordinal(want));
}

inline std::vector<bf16_t> random_bf16(size_t n, std::mt19937_64& rng, double sd = 1.0) {
  std::normal_distribution<double> dist(0.0, sd);
  std::vector<bf16_t> v(n);
  for (auto& x : v) x = v4attn::num::bf16_from_f32(static_cast<float>(dist(rng)));
  return v;
}
inline std::vector<float> random_f32(size_t n, std::mt19937_64& rng, double sd = 1.0) {
  std::normal_distribution<double> dist(0.0, sd);
  std::vector<float> v(n);
  for (auto& x : v) x = static_cast<float>(dist(rng));
  return v;
}
// Norm-like weights: bf16-representable fp32 values in [0.9, 1.1].
inline std::vector<float> random_norm_weights(size_t n, std::mt19937_64& rng) {
  std::uniform_real_distribution<double> dist(0.9, 1.1);
  std::vector<float> v(n);
  for (auto& x : v) x = v4attn::num::round_bf16(static_cast<float>(dist(rng)));
  return v;
}

constexpr uint8_t kPoison = 0xAB;
constexpr bf16_t kPoisonBf16 = 0xABAB;

}  // namespace reftest
