// Tests of the CPU reference prepare ops (prepare_ops.h, spec 3.1-3.2, cache-layouts.md):
// RMSNorm, RoPE, the padded Q store, the window-K store (V41 and V4 layouts) and the FP4
// compressed-KV store. Expected bytes are written by hand from the format definitions; random
// cross-checks use double arithmetic rounded once per fp32 operation (a correctly rounded fp32
// op), written here independently of numerics.h.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <map>
#include <random>
#include <stdexcept>
#include <vector>

#include "ref_test_util.h"
#include "v4attn/cache_layout.h"
#include "v4attn/reference/prepare_ops.h"
#include "v4attn/rope_table.h"

namespace {

using namespace v4attn;
using namespace reftest;

constexpr float kEps = 1e-20f;

float f32_mul(float a, float b) { return static_cast<float>(static_cast<double>(a) * b); }
float f32_add(float a, float b) { return static_cast<float>(static_cast<double>(a) + b); }
float f32_sub(float a, float b) { return static_cast<float>(static_cast<double>(a) - b); }

// RoPE table of `n` positions where position p uses (c, s) = rot[p] for all 32 pairs.
std::vector<float> uniform_table(const std::vector<std::pair<float, float>>& rot) {
  std::vector<float> t;
  for (const auto& [c, s] : rot)
    for (int i = 0; i < 32; ++i) {
      t.push_back(c);
      t.push_back(s);
    }
  return t;
}
// pos 0: identity; pos 1: +90 degrees ((re, im) -> (-im, re), exact); pos 2: (0.6, 0.8).
std::vector<float> hand_table() { return uniform_table({{1.0f, 0.0f}, {0.0f, 1.0f}, {0.6f, 0.8f}}); }

// The LaneSum order written out from its definition (numerics.h): chunks of 8 to lanes c % 32,
// lanes accumulate in order, then the xor butterfly 16, 8, 4, 2, 1.
float lane_sum_squares_by_definition(const std::vector<float>& x) {
  float lane[32] = {};
  for (size_t i = 0; i < x.size(); ++i) {
    const size_t l = (i / 8) % 32;
    lane[l] = f32_add(lane[l], f32_mul(x[i], x[i]));
  }
  for (int off = 16; off >= 1; off /= 2) {
    float next[32];
    for (int l = 0; l < 32; ++l) next[l] = f32_add(lane[l], lane[l ^ off]);
    std::memcpy(lane, next, sizeof lane);
  }
  return lane[0];
}

// ---- rmsnorm_rows -----------------------------------------------------------------------------

TEST(RefPrepareRmsNorm, HandComputedRow) {
  // x = +-2 over 16 dims: mean square 4, r = 1 / sqrt(4 + 1e-20) = 0.5 exactly, y = w * x / 2.
  std::vector<bf16_t> x(16), y(16, kPoisonBf16);
  std::vector<float> w(16);
  for (int i = 0; i < 16; ++i) {
    x[i] = bf16_exact(i % 3 == 0 ? -2.0 : 2.0);
    w[i] = static_cast<float>(0.75 + i / 16.0);  // multiples of 1/16: bf16 exact
  }
  ref::rmsnorm_rows(x.data(), 1, 16, 16, w.data(), kEps, y.data(), 16);
  for (int i = 0; i < 16; ++i) EXPECT_EQ(bf16_value(y[i]), (i % 3 == 0 ? -1.0f : 1.0f) * w[i]) << i;
}

TEST(RefPrepareRmsNorm, FollowsTheLaneSumOrderWithStridesAndInPlace) {
  std::mt19937_64 rng(2001);
  const int n = 512, rows = 20, xs = 520, ys = 530;
  std::vector<bf16_t> x = random_bf16(static_cast<size_t>(rows * xs), rng, 3.0);
  // Wide dynamic range inside rows, so the summation order matters in fp32.
  for (size_t i = 0; i < x.size(); i += 37) x[i] = bf16_exact(bf16_value(x[i]) * 1024.0);
  const std::vector<float> w = random_norm_weights(n, rng);
  std::vector<bf16_t> y(static_cast<size_t>(rows * ys), kPoisonBf16);
  ref::rmsnorm_rows(x.data(), rows, n, xs, w.data(), kEps, y.data(), ys);
  for (int r = 0; r < rows; ++r) {
    std::vector<float> xf(n);
    for (int i = 0; i < n; ++i) xf[i] = bf16_value(x[r * xs + i]);
    const float ss = lane_sum_squares_by_definition(xf);
    const float rstd = static_cast<float>(1.0 / static_cast<double>(static_cast<float>(
                                                    std::sqrt(static_cast<double>(f32_add(static_cast<float>(static_cast<double>(ss) / n), kEps))))));
    for (int i = 0; i < n; ++i)
      ASSERT_EQ(y[r * ys + i], num::bf16_from_f32(f32_mul(w[i], f32_mul(xf[i], rstd)))) << r << "," << i;
    for (int i = n; i < ys; ++i) EXPECT_EQ(y[r * ys + i], kPoisonBf16);
  }
  // In place (y == x) gives the same bytes.
  std::vector<bf16_t> inplace = x;
  ref::rmsnorm_rows(inplace.data(), rows, n, xs, w.data(), kEps, inplace.data(), xs);
  for (int r = 0; r < rows; ++r)
    for (int i = 0; i < n; ++i) ASSERT_EQ(inplace[r * xs + i], y[r * ys + i]);
}

TEST(RefPrepareRmsNorm, RefusesBadInputWithoutWriting) {
  std::vector<bf16_t> x(24, bf16_exact(1.0)), y(24, kPoisonBf16);
  std::vector<float> w(24, 1.0f);
  EXPECT_THROW(ref::rmsnorm_rows(x.data(), 1, 20, 24, w.data(), kEps, y.data(), 24), std::invalid_argument);  // n % 8
  EXPECT_THROW(ref::rmsnorm_rows(x.data(), 1, 24, 24, nullptr, kEps, y.data(), 24), std::invalid_argument);
  EXPECT_THROW(ref::rmsnorm_rows(x.data(), 1, 24, 16, w.data(), kEps, y.data(), 24), std::invalid_argument);
  EXPECT_EQ(y, std::vector<bf16_t>(24, kPoisonBf16));
}

// ---- rope_rows --------------------------------------------------------------------------------

TEST(RefPrepareRope, HandTableRotatesTheTailOnly) {
  const std::vector<float> table = hand_table();
  std::mt19937_64 rng(2002);
  const int heads = 2, hd = 128, stride = 2 * 128 + 8, rows = 3;
  std::vector<bf16_t> v = random_bf16(static_cast<size_t>(rows * stride), rng);
  const std::vector<bf16_t> orig = v;
  const int32_t pos[3] = {0, 1, 2};
  ref::rope_rows(v.data(), rows, heads, hd, stride, pos, table.data(), 3);
  for (int r = 0; r < rows; ++r)
    for (int h = 0; h < heads; ++h) {
      const bf16_t* a = orig.data() + r * stride + h * hd;
      const bf16_t* b = v.data() + r * stride + h * hd;
      for (int d = 0; d < hd - 64; ++d) ASSERT_EQ(b[d], a[d]);
      for (int k = 0; k < 32; ++k) {
        const float re = bf16_value(a[hd - 64 + 2 * k]), im = bf16_value(a[hd - 64 + 2 * k + 1]);
        float wre, wim;
        if (r == 0) {
          wre = re;
          wim = im;
        } else if (r == 1) {
          wre = -im;
          wim = re;
        } else {  // each product rounded to fp32, then the sum / difference
          wre = f32_sub(f32_mul(re, 0.6f), f32_mul(im, 0.8f));
          wim = f32_add(f32_mul(re, 0.8f), f32_mul(im, 0.6f));
        }
        EXPECT_EQ(b[hd - 64 + 2 * k], num::bf16_from_f32(wre)) << r << "," << h << "," << k;
        EXPECT_EQ(b[hd - 64 + 2 * k + 1], num::bf16_from_f32(wim)) << r << "," << h << "," << k;
      }
    }
  for (int r = 0; r < rows; ++r)
    for (int d = heads * hd; d < stride; ++d) EXPECT_EQ(v[r * stride + d], orig[r * stride + d]);
  // The inverse at 90 degrees undoes the rotation exactly.
  std::vector<bf16_t> w = orig;
  const int32_t p1[3] = {1, 1, 1};
  ref::rope_rows(w.data(), rows, heads, hd, stride, p1, table.data(), 3);
  ref::rope_rows(w.data(), rows, heads, hd, stride, p1, table.data(), 3, /*inverse=*/true);
  EXPECT_EQ(w, orig);
}

TEST(RefPrepareRope, RefusesPositionsOutsideTheTableWithoutWriting) {
  const std::vector<float> table = hand_table();
  std::vector<bf16_t> v(2 * 64, bf16_exact(1.0));
  const std::vector<bf16_t> orig = v;
  const int32_t pos[2] = {1, 3};  // 3 is past the 3-row table
  EXPECT_THROW(ref::rope_rows(v.data(), 2, 1, 64, 64, pos, table.data(), 3), std::invalid_argument);
  const int32_t neg[2] = {-1, 0};
  EXPECT_THROW(ref::rope_rows(v.data(), 2, 1, 64, 64, neg, table.data(), 3), std::invalid_argument);
  EXPECT_EQ(v, orig);
}

// ---- q_rope_store -----------------------------------------------------------------------------

TEST(RefPrepareQRopeStore, WritesRopedHeadsAndLeavesPaddingHeadsUntouched) {
  RopeParams p;  // a ratio-0 layer's table
  const std::vector<float> table = build_rope_table(p, 2048);
  std::mt19937_64 rng(2003);
  const int T = 3, H = 3, H_pad = 5;
  const std::vector<bf16_t> q = random_bf16(static_cast<size_t>(T * H * 512), rng);
  const std::vector<bf16_t> q_copy = q;
  const int32_t pos[3] = {0, 1000, 2047};
  std::vector<bf16_t> q_pad(static_cast<size_t>(T * H_pad * 512), kPoisonBf16);
  ref::q_rope_store(q.data(), T, H, pos, table.data(), 2048, q_pad.data(), H_pad);
  EXPECT_EQ(q, q_copy);  // the input is not modified
  std::vector<bf16_t> roped = q;
  ref::rope_rows(roped.data(), T, H, 512, H * 512, pos, table.data(), 2048);
  for (int t = 0; t < T; ++t) {
    for (int h = 0; h < H; ++h)
      for (int d = 0; d < 512; ++d) ASSERT_EQ(q_pad[(t * H_pad + h) * 512 + d], roped[(t * H + h) * 512 + d]);
    for (int h = H; h < H_pad; ++h)
      for (int d = 0; d < 512; ++d) ASSERT_EQ(q_pad[(t * H_pad + h) * 512 + d], kPoisonBf16) << "padding head written";
  }
  // Position 1000 really rotates (the test would not notice a missing RoPE otherwise).
  EXPECT_NE(std::memcmp(&q_pad[(1 * H_pad) * 512 + 448], &q[(1 * H) * 512 + 448], 64 * 2), 0);
}

TEST(RefPrepareQRopeStore, BadInputThrowsAndChangesNothing) {
  const std::vector<float> table = hand_table();
  std::vector<bf16_t> q(2 * 512, bf16_exact(0.5)), q_pad(2 * 2 * 512, kPoisonBf16);
  const int32_t past[2] = {0, 3};
  EXPECT_THROW(ref::q_rope_store(q.data(), 2, 1, past, table.data(), 3, q_pad.data(), 2), std::invalid_argument);
  const int32_t ok[2] = {0, 1};
  EXPECT_THROW(ref::q_rope_store(q.data(), 2, 1, ok, nullptr, 3, q_pad.data(), 2), std::invalid_argument);
  EXPECT_THROW(ref::q_rope_store(q.data(), 2, 2, ok, table.data(), 3, q_pad.data(), 1), std::invalid_argument);  // H_pad < H
  EXPECT_EQ(q_pad, std::vector<bf16_t>(q_pad.size(), kPoisonBf16));
}

// ---- window_k_store ---------------------------------------------------------------------------

// A hand-made window-K row: kv_raw = +-1 everywhere (mean square 1, so the norm's r is exactly 1)
// and kv_norm = the magnitudes below, so the normed vector is exactly +-kv_norm. Each 32-dim block
// starts with magnitude 2 (block amax 2 -> scale 2^-7, ue8m0 120; x / s = 128 x).
struct HandRow {
  std::vector<bf16_t> raw;   // [512]
  std::vector<float> norm;   // [512]
  std::vector<float> value;  // [512] the normed vector, +-norm
};
const double kMags[8] = {2.0, 1.0, 0.5, 0.75, 1.5, 0.010009765625 /* bf16(0.01) */, 0.0078125, 0.001953125};
// e4m3 code of 128 * magnitude: 256 -> 0x78, 128 -> 0x70, 64 -> 0x68, 96 -> 0x6C, 192 -> 0x74,
// 1.28125 -> 1.25 (mantissa 2.25 -> 2) -> 0x3A, 1 -> 0x38, 0.25 -> 0x28.
const std::map<double, uint8_t> kCodeOf128x = {{2.0, 0x78}, {1.0, 0x70}, {0.5, 0x68}, {0.75, 0x6C}, {1.5, 0x74},
                                               {0.010009765625, 0x3A}, {0.0078125, 0x38}, {0.001953125, 0x28}};
HandRow hand_row() {
  HandRow h;
  for (int d = 0; d < 512; ++d) {
    const double mag = d % 32 == 0 ? 2.0 : kMags[(d * 5 + d / 32) % 8];
    const double sign = (d % 3 == 0) ? -1.0 : 1.0;
    h.raw.push_back(bf16_exact(sign));
    h.norm.push_back(static_cast<float>(mag));
    h.value.push_back(static_cast<float>(sign * mag));
  }
  return h;
}
// The vector after RoPE at the hand table's position 1 (90 degrees on dims 448..511).
std::vector<float> rotated(const std::vector<float>& v) {
  std::vector<float> r = v;
  for (int k = 0; k < 32; ++k) {
    r[448 + 2 * k] = -v[448 + 2 * k + 1];
    r[448 + 2 * k + 1] = v[448 + 2 * k];
  }
  return r;
}
uint8_t code_of(float v) {
  const uint8_t c = kCodeOf128x.at(std::fabs(static_cast<double>(v)));
  return v < 0 ? static_cast<uint8_t>(c | 0x80) : c;
}

TEST(RefPrepareWindowK, V41HandMadeRowBytes) {
  const std::vector<float> table = hand_table();
  const HandRow h = hand_row();
  const CacheLayout layout = cache_layout(CacheKind::kWindowV41, 64);
  const int64_t n_slots = 128;
  std::vector<uint8_t> cache(static_cast<size_t>(layout.pool_bytes(n_slots)), kPoison);
  // Two rows: position 0 (identity RoPE) at slot 70 (page 1, slot 6), position 1 (90 degrees) at 3.
  std::vector<bf16_t> raw(2 * 600);
  std::copy(h.raw.begin(), h.raw.end(), raw.begin());
  std::copy(h.raw.begin(), h.raw.end(), raw.begin() + 600);
  const int32_t pos[2] = {0, 1}, loc[2] = {70, 3};
  std::vector<bf16_t> kv_out(2 * 512, kPoisonBf16);
  const int64_t skipped = ref::window_k_store(raw.data(), 2, 600, h.norm.data(), kEps, pos, table.data(), 3, loc,
                                              CacheKind::kWindowV41, layout, cache.data(), n_slots, kv_out.data());
  EXPECT_EQ(skipped, 0);
  std::vector<uint8_t> want(cache.size(), kPoison);
  const std::vector<float> values[2] = {h.value, rotated(h.value)};
  for (int t = 0; t < 2; ++t) {
    for (int d = 0; d < 512; ++d) {
      want[layout.data_offset(loc[t]) + d] = code_of(values[t][d]);  // all 512 dims, RoPE tail included
      EXPECT_EQ(bf16_value(kv_out[t * 512 + d]), values[t][d]) << t << "," << d;
    }
    for (int b = 0; b < 16; ++b) want[layout.scale_offset(loc[t]) + b] = 120;
  }
  EXPECT_EQ(layout.data_offset(70), layout.page_bytes() + 6 * 512);
  ASSERT_EQ(cache.size(), want.size());
  for (size_t i = 0; i < cache.size(); ++i) ASSERT_EQ(cache[i], want[i]) << "byte " << i;
}

TEST(RefPrepareWindowK, V4LayoutKeepsTheRopeTailAsBf16) {
  const std::vector<float> table = hand_table();
  const HandRow h = hand_row();
  const CacheLayout layout = cache_layout(CacheKind::kWindowV4, 64);
  const int64_t n_slots = 64;
  std::vector<uint8_t> cache(static_cast<size_t>(layout.pool_bytes(n_slots)), kPoison);
  const int32_t pos[1] = {1}, loc[1] = {9};
  ASSERT_EQ(ref::window_k_store(h.raw.data(), 1, 512, h.norm.data(), kEps, pos, table.data(), 3, loc,
                                CacheKind::kWindowV4, layout, cache.data(), n_slots),
            0);
  const std::vector<float> v = rotated(h.value);
  std::vector<uint8_t> want(cache.size(), kPoison);
  // Nope dims: block 64; each 64-dim block holds a 2 (amax 2 -> scale 2^-7 again).
  for (int d = 0; d < 448; ++d) want[layout.data_offset(9) + d] = code_of(v[d]);
  for (int d = 448; d < 512; ++d) {  // the roped tail, bf16 little-endian, exactly
    const bf16_t b = bf16_exact(v[d]);
    want[layout.data_offset(9) + 448 + 2 * (d - 448)] = static_cast<uint8_t>(b & 0xff);
    want[layout.data_offset(9) + 448 + 2 * (d - 448) + 1] = static_cast<uint8_t>(b >> 8);
  }
  for (int b = 0; b < 7; ++b) want[layout.scale_offset(9) + b] = 120;
  want[layout.scale_offset(9) + 7] = 0;  // pad byte
  for (size_t i = 0; i < cache.size(); ++i) ASSERT_EQ(cache[i], want[i]) << "byte " << i;
}

TEST(RefPrepareWindowK, V4NopeBlockOf64UsesItsOwnAmax) {
  // A 64-dim block whose first half has amax 4 and second half amax 0.5: block 64 gives one
  // scale 2^-6 (ue8m0 121) for both halves; (V41's block 32 would give two scales).
  std::vector<bf16_t> raw(512, bf16_exact(1.0));
  std::vector<float> norm(512, 0.5f);
  norm[0] = 4.0f;  // the normed vector equals the weights (r = 1)
  const std::vector<float> table = hand_table();
  const CacheLayout layout = cache_layout(CacheKind::kWindowV4, 64);
  std::vector<uint8_t> cache(static_cast<size_t>(layout.pool_bytes(64)), kPoison);
  const int32_t pos[1] = {0}, loc[1] = {1};
  ref::window_k_store(raw.data(), 1, 512, norm.data(), kEps, pos, table.data(), 3, loc, CacheKind::kWindowV4, layout,
                      cache.data(), 64);
  EXPECT_EQ(cache[layout.scale_offset(1) + 0], 121);  // 4 / 448 -> 2^-6
  EXPECT_EQ(cache[layout.data_offset(1) + 0], 0x78);  // 4 / 2^-6 = 256
  EXPECT_EQ(cache[layout.data_offset(1) + 1], 0x60);  // 0.5 / 2^-6 = 32
  EXPECT_EQ(cache[layout.data_offset(1) + 33], 0x60);  // same block: same scale (block 32 would give 0x78)
  EXPECT_EQ(cache[layout.scale_offset(1) + 1], 118);  // the next block: 0.5 / 448 -> 2^-9
  EXPECT_EQ(cache[layout.data_offset(1) + 64], 0x78);
}

TEST(RefPrepareWindowK, NegativeSlotWritesNothingAndOutOfRangeIsSkippedAndCounted) {
  RopeParams p;
  const std::vector<float> table = build_rope_table(p, 512);
  std::mt19937_64 rng(2004);
  const int T = 4;
  const std::vector<bf16_t> raw = random_bf16(static_cast<size_t>(T * 512), rng, 2.0);
  const std::vector<float> norm = random_norm_weights(512, rng);
  for (CacheKind kind : {CacheKind::kWindowV41, CacheKind::kWindowV4}) {
    const CacheLayout layout = cache_layout(kind, 64);
    const int64_t n_slots = 100;
    std::vector<uint8_t> cache(static_cast<size_t>(layout.pool_bytes(n_slots)), kPoison);
    const std::vector<uint8_t> poisoned = cache;
    const int32_t pos[T] = {3, 4, 5, 6};
    const int32_t none[T] = {-1, -1, -1, -1};
    std::vector<bf16_t> kv_out(T * 512, kPoisonBf16);
    EXPECT_EQ(ref::window_k_store(raw.data(), T, 512, norm.data(), kEps, pos, table.data(), 512, none, kind, layout,
                                  cache.data(), n_slots, kv_out.data()),
              0);
    EXPECT_EQ(cache, poisoned) << "a negative slot wrote";
    EXPECT_EQ(std::count(kv_out.begin(), kv_out.end(), kPoisonBf16), 0) << "the norm still runs";
    // Slots 100 and 5000 are outside the 100-slot pool: skipped and counted; slot 7 is written.
    const int32_t loc[T] = {100, 7, -1, 5000};
    EXPECT_EQ(ref::window_k_store(raw.data(), T, 512, norm.data(), kEps, pos, table.data(), 512, loc, kind, layout,
                                  cache.data(), n_slots),
              2);
    for (size_t i = 0; i < cache.size(); ++i) {
      const bool in_slot7 = (static_cast<int64_t>(i) >= layout.data_offset(7) && static_cast<int64_t>(i) < layout.data_offset(7) + layout.data_bytes) ||
                            (static_cast<int64_t>(i) >= layout.scale_offset(7) && static_cast<int64_t>(i) < layout.scale_offset(7) + layout.scale_bytes);
      if (!in_slot7) {
        ASSERT_EQ(cache[i], kPoison) << "byte " << i << " outside slot 7 written";
      }
    }
    EXPECT_NE(std::memcmp(cache.data() + layout.data_offset(7), poisoned.data() + layout.data_offset(7), 64), 0);
  }
}

TEST(RefPrepareWindowK, BadInputThrowsAndChangesNothing) {
  const std::vector<float> table = hand_table();
  const HandRow h = hand_row();
  const CacheLayout layout = cache_layout(CacheKind::kWindowV41, 64);
  std::vector<uint8_t> cache(static_cast<size_t>(layout.pool_bytes(64)), kPoison);
  const std::vector<uint8_t> poisoned = cache;
  std::vector<bf16_t> raw(2 * 512);
  std::copy(h.raw.begin(), h.raw.end(), raw.begin());
  std::copy(h.raw.begin(), h.raw.end(), raw.begin() + 512);
  std::vector<bf16_t> kv_out(2 * 512, kPoisonBf16);
  const int32_t loc[2] = {1, 2};
  const int32_t past[2] = {0, 3};  // row 1 is past the 3-position table
  EXPECT_THROW(ref::window_k_store(raw.data(), 2, 512, h.norm.data(), kEps, past, table.data(), 3, loc,
                                   CacheKind::kWindowV41, layout, cache.data(), 64, kv_out.data()),
               std::invalid_argument);
  const int32_t pos[2] = {0, 1};
  EXPECT_THROW(ref::window_k_store(raw.data(), 2, 512, nullptr, kEps, pos, table.data(), 3, loc, CacheKind::kWindowV41,
                                   layout, cache.data(), 64, kv_out.data()),
               std::invalid_argument);
  EXPECT_THROW(ref::window_k_store(raw.data(), 2, 512, h.norm.data(), kEps, pos, table.data(), 3, nullptr,
                                   CacheKind::kWindowV41, layout, cache.data(), 64, kv_out.data()),
               std::invalid_argument);
  EXPECT_THROW(ref::window_k_store(raw.data(), 2, 256, h.norm.data(), kEps, pos, table.data(), 3, loc,
                                   CacheKind::kWindowV41, layout, cache.data(), 64, kv_out.data()),
               std::invalid_argument);  // stride < 512
  EXPECT_THROW(ref::window_k_store(raw.data(), 2, 512, h.norm.data(), kEps, pos, table.data(), 3, loc,
                                   CacheKind::kWindowV4, layout, cache.data(), 64, kv_out.data()),
               std::invalid_argument);  // a V41 layout for the V4 kind
  EXPECT_EQ(cache, poisoned);
  EXPECT_EQ(kv_out, std::vector<bf16_t>(kv_out.size(), kPoisonBf16));
}

// ---- store_compressed_fp4 ---------------------------------------------------------------------

TEST(RefPrepareCompressedFp4, HandMadeLatentBytes) {
  std::vector<bf16_t> latent(512, bf16_exact(0.0));
  // Block 0 (amax 6 -> scale e4m3(1) = 0x38): one value per e2m1 case, ties to the even code.
  const double b0[16] = {6, -6, 0.5, 1, 1.5, 2, 3, 4, -0.25, 0.25, 0.75, 1.25, 2.5, 5, -3.5, 1.75};
  const uint8_t c0[16] = {0x7, 0xF, 0x1, 0x2, 0x3, 0x4, 0x5, 0x6, 0x8, 0x0, 0x2, 0x2, 0x4, 0x6, 0xE, 0x4};
  // Block 1: amax 1.203125 (bf16 of 1.2) -> 1.203125 / 6 = 0.2005 -> e4m3 0.203125 (0x25);
  // 1.203125 / s = 5.92 -> 6 (0x7), 0.30078125 / s = 1.48 -> 1.5 (0x3), 0.5 / s = 2.46 -> 2 (0x4),
  // 0.80078125 / s = 3.94 -> 4 (0x6), -0.02 / s -> -0 (0x8).
  const double b1[5] = {1.203125, 0.30078125, 0.5, 0.80078125, -0.02001953125};
  const uint8_t c1[5] = {0x7, 0x3, 0x4, 0x6, 0x8};
  for (int i = 0; i < 16; ++i) latent[i] = bf16_exact(b0[i]);
  for (int i = 0; i < 5; ++i) latent[16 + i] = bf16_exact(b1[i]);
  // Block 2 stays all zero: amax floored at 6 * 2^-9 -> scale 2^-9, the smallest e4m3 (0x01).
  const CacheLayout layout = cache_layout(CacheKind::kCompressedFp4, 64);
  std::vector<uint8_t> cache(static_cast<size_t>(layout.pool_bytes(64)), kPoison);
  ref::store_compressed_fp4(latent.data(), layout, cache.data(), 3);
  const uint8_t* data = cache.data() + layout.data_offset(3);
  const uint8_t* scales = cache.data() + layout.scale_offset(3);
  EXPECT_EQ(layout.data_offset(3), 3 * 256);
  EXPECT_EQ(layout.scale_offset(3), 64 * 256 + 3 * 32);
  for (int i = 0; i < 16; i += 2) EXPECT_EQ(data[i / 2], c0[i] | (c0[i + 1] << 4)) << i;  // even element low
  EXPECT_EQ(data[8], c1[0] | (c1[1] << 4));
  EXPECT_EQ(data[9], c1[2] | (c1[3] << 4));
  EXPECT_EQ(data[10], c1[4] | (0x0 << 4));
  EXPECT_EQ(scales[0], 0x38);
  EXPECT_EQ(scales[1], 0x25);
  for (int b = 2; b < 32; ++b) EXPECT_EQ(scales[b], 0x01) << b;
  for (int i = 16; i < 256; ++i) EXPECT_EQ(data[i], 0x00) << i;
  // Nothing outside slot 3 was written.
  size_t touched = 0;
  for (uint8_t b : cache) touched += b != kPoison;
  EXPECT_LE(touched, 288u);
  EXPECT_THROW(ref::store_compressed_fp4(latent.data(), layout, cache.data(), -1), std::invalid_argument);
  EXPECT_THROW(ref::store_compressed_fp4(nullptr, layout, cache.data(), 1), std::invalid_argument);
  EXPECT_THROW(ref::store_compressed_fp4(latent.data(), cache_layout(CacheKind::kIndexK), cache.data(), 1),
               std::invalid_argument);
}

}  // namespace
