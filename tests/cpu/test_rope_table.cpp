// Tests of the RoPE / YaRN tables (include/v4attn/rope_table.h) against v41-attention.md
// section 2. Expected values come from hand computation or from an independent double path in
// this file: fp32 operations are done in double and rounded once (correctly rounded for
// + - * /), so the spec's fp32 sequence can be restated without using the code under test.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <limits>
#include <numbers>
#include <sstream>
#include <utility>
#include <stdexcept>
#include <vector>

#include <nlohmann/json.hpp>

#include "v4attn/config.h"
#include "v4attn/numerics.h"
#include "v4attn/rope_table.h"

namespace {

using v4attn::RopeParams;
using v4attn::YarnBounds;

uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
float f32_mul(float a, float b) { return static_cast<float>(static_cast<double>(a) * b); }
float f32_add(float a, float b) { return static_cast<float>(static_cast<double>(a) + b); }
float f32_sub(float a, float b) { return static_cast<float>(static_cast<double>(a) - b); }
float f32_div(float a, float b) { return static_cast<float>(static_cast<double>(a) / b); }

double ulps_off(float got, double expected) {
  const double ulp = std::ldexp(1.0, std::max(std::ilogb(expected), -126) - 23);
  return std::fabs(static_cast<double>(got) - expected) / ulp;
}

// The RoPE parameters of the released config, read from the JSON file itself.
struct ReleasedRope {
  double rope_theta, compress_rope_theta, rope_factor, beta_fast, beta_slow;
  int64_t original_seq_len;
};
ReleasedRope released_rope() {
  std::ifstream in(std::string(V4ATTN_SOURCE_DIR) + "/configs/deepseek-v4.1-flash.json");
  if (!in) throw std::runtime_error("cannot open configs/deepseek-v4.1-flash.json");
  std::stringstream ss;
  ss << in.rdbuf();
  const nlohmann::json j = nlohmann::json::parse(ss.str());
  return {j.at("rope_theta").get<double>(),  j.at("compress_rope_theta").get<double>(),
          j.at("rope_factor").get<double>(), j.at("beta_fast").get<double>(),
          j.at("beta_slow").get<double>(),   j.at("original_seq_len").get<int64_t>()};
}
RopeParams compressed_params() {  // ratio > 0 layers: compress_rope_theta with YaRN
  const ReleasedRope r = released_rope();
  RopeParams p;
  p.base = r.compress_rope_theta;
  p.yarn = true;
  p.factor = r.rope_factor;
  p.original_seq_len = r.original_seq_len;
  p.beta_fast = r.beta_fast;
  p.beta_slow = r.beta_slow;
  return p;
}
RopeParams window_only_params() {  // ratio 0 layers: rope_theta, no YaRN
  RopeParams p = compressed_params();
  p.base = released_rope().rope_theta;
  p.yarn = false;
  return p;
}

// Independent correction dimension: 32 * log2(L / (2 pi n)) / log2(base), the spec's
// 64 ln(L / (n 2 pi)) / (2 ln base) rewritten.
double correction_dim_ref(double n, double base, double seq_len) {
  return 32.0 * std::log2(seq_len / (2.0 * std::numbers::pi * n)) / std::log2(base);
}
YarnBounds yarn_bounds_ref(const RopeParams& p) {
  YarnBounds b;
  b.low = static_cast<int>(std::floor(correction_dim_ref(p.beta_fast, p.base, static_cast<double>(p.original_seq_len))));
  b.high = static_cast<int>(std::ceil(correction_dim_ref(p.beta_slow, p.base, static_cast<double>(p.original_seq_len))));
  if (b.low < 0) b.low = 0;
  if (b.high > 63) b.high = 63;
  return b;
}

TEST(RopeYarn, BoundsForTheReleasedConfig) {
  const ReleasedRope r = released_rope();
  ASSERT_EQ(r.compress_rope_theta, 160000.0);
  ASSERT_EQ(r.original_seq_len, 65536);
  ASSERT_EQ(r.beta_fast, 32.0);
  ASSERT_EQ(r.beta_slow, 1.0);
  // cd(32) = 64 ln(65536 / (64 pi)) / (2 ln 160000) = 15.45; cd(1) = 24.71.
  const YarnBounds b = v4attn::yarn_bounds(compressed_params());
  EXPECT_EQ(b.low, 15);
  EXPECT_EQ(b.high, 25);
}

TEST(RopeYarn, BoundsForBase10000) {
  // cd(32) = 64 ln(325.95) / (2 ln 10000) = 20.105; cd(1) = 64 ln(10430.4) / 18.42 = 32.146.
  RopeParams p = compressed_params();
  p.base = 10000.0;
  const YarnBounds b = v4attn::yarn_bounds(p);
  EXPECT_EQ(b.low, 20);
  EXPECT_EQ(b.high, 33);
  const YarnBounds r = yarn_bounds_ref(p);
  EXPECT_EQ(b.low, r.low);
  EXPECT_EQ(b.high, r.high);
}

TEST(RopeYarn, BoundsClampToTheDimensionRange) {
  RopeParams p = compressed_params();
  // A tiny context: cd(beta_fast) is negative, so low clamps to 0.
  p.original_seq_len = 64;
  EXPECT_LT(correction_dim_ref(p.beta_fast, p.base, 64.0), 0.0);
  EXPECT_EQ(v4attn::yarn_bounds(p).low, 0);
  // A tiny base: cd(beta_slow) far above 63, so high clamps to 63.
  p = compressed_params();
  p.base = 2.0;
  EXPECT_GT(correction_dim_ref(p.beta_slow, p.base, 65536.0), 63.0);
  EXPECT_EQ(v4attn::yarn_bounds(p).high, 63);
  // A sweep of bases and contexts against the independent formula.
  for (double base : {500.0, 1000.0, 10000.0, 50000.0, 160000.0, 1e6, 1e7})
    for (int64_t len : {4096, 32768, 65536, 131072}) {
      p = compressed_params();
      p.base = base;
      p.original_seq_len = len;
      const YarnBounds b = v4attn::yarn_bounds(p), r = yarn_bounds_ref(p);
      EXPECT_EQ(b.low, r.low) << base << " " << len;
      EXPECT_EQ(b.high, r.high) << base << " " << len;
    }
}

TEST(RopeInvFreq, WithoutYarnIsFp32PowThenFp32Reciprocal) {
  // The spec computes f_i = 1 / pow(base, e_i) in fp32: pow rounded to fp32, then an fp32
  // division. Two roundings: the result is within 0.5 ulp + u relative of 1 / base^e_i, which
  // can be a little over 1 ulp (base 10000, i = 10: 1.0055 ulps).
  double worst_ulps = 0;
  for (double base : {10000.0, 160000.0, 500000.0}) {
    RopeParams p = window_only_params();
    p.base = base;
    const std::vector<float> f = v4attn::rope_inv_freq(p);
    ASSERT_EQ(f.size(), 32u);
    EXPECT_EQ(f[0], 1.0f);  // base^0
    for (int i = 0; i < 32; ++i) {
      // The correctly rounded fp32 pow, from extended precision (checks that rounding the double
      // pow to fp32 hits no double-rounding case for these exponents).
      const long double e = static_cast<long double>(2 * i) / 64.0L;
      const float pw = static_cast<float>(std::pow(static_cast<long double>(base), e));
      ASSERT_EQ(pw, static_cast<float>(std::pow(base, static_cast<double>(2 * i) / 64.0))) << i;
      EXPECT_EQ(bits_of(f[i]), bits_of(f32_div(1.0f, pw))) << "base " << base << " i " << i;
      const double exact = 1.0 / std::pow(base, 2.0 * i / 64.0);
      EXPECT_LE(ulps_off(f[i], exact), 1.5) << "base " << base << " i " << i;
      worst_ulps = std::max(worst_ulps, ulps_off(f[i], exact));
      if (i > 0) {
        EXPECT_LT(f[i], f[i - 1]);
      }
    }
    // Hand value: i = 16 is base^-0.5.
    EXPECT_LE(ulps_off(f[16], 1.0 / std::sqrt(base)), 1.5);
  }
  EXPECT_LT(worst_ulps, 1.1);  // seen: 1.0055
}

// The spec's YaRN sequence in fp32, each step rounded once through double.
std::vector<float> yarn_freq_ref(const std::vector<float>& plain, int low, int high, double factor) {
  std::vector<float> out(plain.size());
  const float fac = static_cast<float>(factor);
  const float span = std::max(static_cast<float>(high - low), 1e-3f);
  for (size_t i = 0; i < plain.size(); ++i) {
    float ramp = f32_div(static_cast<float>(static_cast<int>(i) - low), span);
    ramp = std::min(std::max(ramp, 0.0f), 1.0f);
    const float smooth = f32_sub(1.0f, ramp);
    out[i] = f32_add(f32_mul(f32_div(plain[i], fac), f32_sub(1.0f, smooth)), f32_mul(plain[i], smooth));
  }
  return out;
}

TEST(RopeInvFreq, YarnKeepsHighFrequenciesAndDividesLowOnes) {
  const RopeParams p = compressed_params();
  RopeParams plain_p = p;
  plain_p.yarn = false;
  const std::vector<float> plain = v4attn::rope_inv_freq(plain_p);
  const std::vector<float> f = v4attn::rope_inv_freq(p);
  ASSERT_EQ(f.size(), 32u);
  // low = 15, high = 25 (BoundsForTheReleasedConfig): ramp_i = clamp((i - 15) / 10, 0, 1).
  for (int i = 0; i <= 15; ++i) EXPECT_EQ(bits_of(f[i]), bits_of(plain[i])) << i;  // smooth = 1
  for (int i = 25; i < 32; ++i) EXPECT_EQ(bits_of(f[i]), bits_of(plain[i] / 16.0f)) << i;  // smooth = 0
  // i = 20: ramp = smooth = 0.5, f * (1/32 + 1/2) = f * 17 / 32 rounded once.
  EXPECT_EQ(f[20], static_cast<float>(static_cast<double>(plain[20]) * 17.0 / 32.0));
  // Every blended entry lies between f / factor and f, and the whole vector is the spec sequence.
  for (int i = 16; i < 25; ++i) {
    EXPECT_LT(f[i], plain[i]) << i;
    EXPECT_GT(f[i], plain[i] / 16.0f) << i;
  }
  const std::vector<float> ref = yarn_freq_ref(plain, 15, 25, 16.0);
  for (int i = 0; i < 32; ++i) EXPECT_EQ(bits_of(f[i]), bits_of(ref[i])) << i;
  // Blended values against exact math (ramp (i-15)/10 in double): within a couple of ulps.
  for (int i = 16; i < 25; ++i) {
    const double ramp = (i - 15) / 10.0;
    const double exact = static_cast<double>(plain[i]) * (ramp / 16.0 + (1.0 - ramp));
    EXPECT_LE(ulps_off(f[i], exact), 2.0) << i;
  }
}

TEST(RopeInvFreq, YarnWithOtherBoundsMatchesTheSpecSequence) {
  // Factors that are not powers of two make the order (f / factor) * (1 - smooth) observable.
  for (const auto& [base, factor] : {std::pair{10000.0, 16.0}, std::pair{1e6, 16.0}, std::pair{160000.0, 10.0},
                                    std::pair{160000.0, 40.0}, std::pair{10000.0, 3.0}, std::pair{1e6, 10.0},
                                    std::pair{160000.0, 7.0}}) {
    RopeParams p = compressed_params();
    p.base = base;
    p.factor = factor;
    RopeParams plain_p = p;
    plain_p.yarn = false;
    const YarnBounds b = yarn_bounds_ref(p);
    const std::vector<float> f = v4attn::rope_inv_freq(p);
    const std::vector<float> ref = yarn_freq_ref(v4attn::rope_inv_freq(plain_p), b.low, b.high, p.factor);
    for (int i = 0; i < 32; ++i) EXPECT_EQ(bits_of(f[i]), bits_of(ref[i])) << base << " " << factor << " " << i;
  }
}

// The table entry as the spec defines it: theta = fp32(float(pos) * f_i), cos/sin in double on
// that fp32 angle, rounded to fp32.
void expect_row_matches(const std::vector<float>& table, const std::vector<float>& f, int64_t pos) {
  for (int i = 0; i < 32; ++i) {
    const float theta = f32_mul(static_cast<float>(pos), f[i]);
    const float c = static_cast<float>(std::cos(static_cast<double>(theta)));
    const float s = static_cast<float>(std::sin(static_cast<double>(theta)));
    const float got_c = table[static_cast<size_t>(pos) * 64 + 2 * i];
    const float got_s = table[static_cast<size_t>(pos) * 64 + 2 * i + 1];
    EXPECT_EQ(bits_of(got_c), bits_of(c)) << "pos " << pos << " i " << i;
    EXPECT_EQ(bits_of(got_s), bits_of(s)) << "pos " << pos << " i " << i;
  }
}

TEST(RopeTable, SpotValuesAreDoubleCosSinOfTheFp32Angle) {
  for (const RopeParams& p : {window_only_params(), compressed_params()}) {
    const int64_t max_pos = 100001;
    const std::vector<float> table = v4attn::build_rope_table(p, max_pos);
    ASSERT_EQ(table.size(), static_cast<size_t>(max_pos) * 64);
    const std::vector<float> f = v4attn::rope_inv_freq(p);
    for (int i = 0; i < 32; ++i) {  // position 0: angle 0 everywhere
      EXPECT_EQ(table[2 * i], 1.0f);
      EXPECT_EQ(bits_of(table[2 * i + 1]), 0u);
    }
    for (int64_t pos : {1, 2, 7, 1000, 65535, 65536, 99999, 100000}) expect_row_matches(table, f, pos);
    // Position 1, i = 0: angle 1 rad exactly (f_0 = 1).
    EXPECT_EQ(table[64], static_cast<float>(std::cos(1.0)));
    EXPECT_EQ(table[65], static_cast<float>(std::sin(1.0)));
    // Every entry is a cosine/sine: bounded by 1 and on the unit circle up to fp32 rounding.
    for (int64_t pos = 0; pos < max_pos; pos += 997)
      for (int i = 0; i < 32; ++i) {
        const double c = table[pos * 64 + 2 * i], s = table[pos * 64 + 2 * i + 1];
        ASSERT_LE(std::fabs(c), 1.0);
        ASSERT_LE(std::fabs(s), 1.0);
        ASSERT_NEAR(c * c + s * s, 1.0, 2e-7);
      }
  }
}

TEST(RopeTable, AngleIsTheFp32ProductNotTheDoubleOne) {
  // At a large position the fp32 rounding of pos * f_i moves the angle by up to ~2^-7 rad, so a
  // table computed from the double angle differs; the table must follow the fp32 angle.
  const RopeParams p = window_only_params();
  const int64_t pos = 100000;
  const std::vector<float> table = v4attn::build_rope_table(p, pos + 1);
  const std::vector<float> f = v4attn::rope_inv_freq(p);
  int differs_from_double_angle = 0;
  for (int i = 0; i < 32; ++i) {
    const float c_double_angle = static_cast<float>(std::cos(static_cast<double>(pos) * f[i]));
    differs_from_double_angle += bits_of(table[pos * 64 + 2 * i]) != bits_of(c_double_angle);
  }
  EXPECT_GT(differs_from_double_angle, 0);
  expect_row_matches(table, f, pos);
}

TEST(RopeTable, SizesAndInvalidLengths) {
  const RopeParams p = window_only_params();
  EXPECT_EQ(v4attn::build_rope_table(p, 1).size(), 64u);
  EXPECT_EQ(v4attn::build_rope_table(p, 129).size(), 129u * 64u);
  EXPECT_THROW(v4attn::build_rope_table(p, 0), std::invalid_argument);
  EXPECT_THROW(v4attn::build_rope_table(p, -1), std::invalid_argument);
  // A shorter table is a prefix of a longer one (entries depend on the position only).
  const std::vector<float> a = v4attn::build_rope_table(p, 300), b = v4attn::build_rope_table(p, 1000);
  for (size_t k = 0; k < a.size(); ++k) ASSERT_EQ(bits_of(a[k]), bits_of(b[k])) << k;
}

}  // namespace

namespace {

bool same_params(const RopeParams& a, const RopeParams& b) {
  return a.base == b.base && a.yarn == b.yarn && a.factor == b.factor && a.original_seq_len == b.original_seq_len &&
         a.beta_fast == b.beta_fast && a.beta_slow == b.beta_slow;
}

// rope_params_for is what both the CPU reference and the GPU stack build their tables from: the
// released config's keys, read by the config loader, must land in the right fields (ratio > 0 layers:
// compress_rope_theta with YaRN; ratio 0: rope_theta without), the same as this file's own reading.
TEST(RopeParamsFor, ReleasedConfigGivesTheSpecsTwoTables) {
  const v4attn::ModelConfig c = v4attn::load_config(std::string(V4ATTN_SOURCE_DIR) + "/configs/deepseek-v4.1-flash.json");
  const RopeParams comp = v4attn::rope_params_for(c, true);
  const RopeParams win = v4attn::rope_params_for(c, false);
  EXPECT_TRUE(same_params(comp, compressed_params()));
  EXPECT_TRUE(same_params(win, window_only_params()));
  EXPECT_EQ(comp.base, 160000.0);
  EXPECT_TRUE(comp.yarn);
  EXPECT_EQ(win.base, 10000.0);
  EXPECT_FALSE(win.yarn);
}

// Every field follows its key: a config with each value changed gives tables parameters that change with it.
TEST(RopeParamsFor, EachFieldFollowsItsKey) {
  v4attn::ModelConfig c = v4attn::load_config(std::string(V4ATTN_SOURCE_DIR) + "/configs/deepseek-v4.1-flash.json");
  c.rope_theta = 12345.0;
  c.compress_rope_theta = 54321.0;
  c.rope_factor = 8.0;
  c.original_seq_len = 4096;
  c.beta_fast = 16.0;
  c.beta_slow = 2.0;
  for (bool compressed : {false, true}) {
    const RopeParams p = v4attn::rope_params_for(c, compressed);
    EXPECT_EQ(p.base, compressed ? 54321.0 : 12345.0);
    EXPECT_EQ(p.yarn, compressed);
    EXPECT_EQ(p.factor, 8.0);
    EXPECT_EQ(p.original_seq_len, 4096);
    EXPECT_EQ(p.beta_fast, 16.0);
    EXPECT_EQ(p.beta_slow, 2.0);
  }
}

}  // namespace
