// Tests of the CPU reference compressor (spec 3.3): the fused tails c1_fused / c2_fused, the
// index-K store, the whole kv-source step (compressor_forward) in decode and target-verify, and
// the Q chain at real V4.1 sizes (layer.h).
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "ref_test_util.h"
#include "v4attn/cache_layout.h"
#include "v4attn/config.h"
#include "v4attn/plan.h"
#include "v4attn/reference/gemm.h"
#include "v4attn/reference/layer.h"
#include "v4attn/reference/prepare_ops.h"
#include "v4attn/reference/step.h"
#include "v4attn/reference/weights.h"
#include "v4attn/rope_table.h"

namespace {

using namespace v4attn;
using namespace reftest;

constexpr float kEps = 1e-20f;
constexpr int kDim = 256;  // small model dim for the compressor GEMMs
constexpr int kMaxPos = 1024;

const std::vector<float>& compressed_table() {  // YaRN, compress_rope_theta, as V4.1's ratio > 0 layers
  static const std::vector<float> t = [] {
    RopeParams p;
    p.base = 160000.0;
    p.yarn = true;
    return build_rope_table(p, kMaxPos);
  }();
  return t;
}

ref::CompressorWeights make_compressor(int ratio, uint64_t seed) {
  std::mt19937_64 rng(seed);
  ref::CompressorWeights c;
  c.ratio = ratio;
  if (ratio == 1) {
    c.wkv_c.n = 512;
    c.wkv_c.k = kDim;
    c.wkv_c.w = random_bf16(512 * kDim, rng, 1.0 / 16);
  } else {
    c.wkv.n = c.wgate.n = 512;
    c.wkv.k = c.wgate.k = kDim;
    c.wkv.w = random_f32(512 * kDim, rng, 1.0 / 16);
    c.wgate.w = random_f32(512 * kDim, rng, 1.0 / 16);
  }
  c.c_norm = random_norm_weights(512, rng);
  c.wk.n = 128;
  c.wk.k = 512;
  c.wk.w = random_bf16(128 * 512, rng, 1.0 / std::sqrt(512.0));
  c.k_norm = random_norm_weights(128, rng);
  return c;
}

// The caches and pair state of one kv source, poisoned.
struct Caches {
  std::vector<uint8_t> comp, index_k;
  std::vector<float> state;
  ref::CompressorCaches view;
  Caches(int64_t slots, int64_t state_rows) {
    view.comp_layout = cache_layout(CacheKind::kCompressedFp4, 64);
    view.index_k_layout = cache_layout(CacheKind::kIndexK, 64);
    comp.assign(static_cast<size_t>(view.comp_layout.pool_bytes(slots)), kPoison);
    index_k.assign(static_cast<size_t>(view.index_k_layout.pool_bytes(slots)), kPoison);
    state.assign(static_cast<size_t>(state_rows * 1024), 0.0f);
    ref::pair_state_init(state.data(), state_rows);
    view.comp = comp.data();
    view.comp_slots = slots;
    view.index_k = index_k.data();
    view.index_k_slots = slots;
    view.pair_state = state.data();
    view.pair_state_rows = state_rows;
  }
  Caches(const Caches&) = delete;
  // Bitwise comparison (the state holds -inf; vector<float> == would also do, but NaN-safe here).
  bool same_as(const Caches& o) const {
    return comp == o.comp && index_k == o.index_k &&
           std::memcmp(state.data(), o.state.data(), state.size() * sizeof(float)) == 0;
  }
};

// Rows of x for a batch: row t is the x of (req, pos) (a deterministic function of the pair), so
// the same token has the same x in every batching; padded rows get unrelated values.
std::vector<bf16_t> x_for(const BatchDesc& b, uint64_t seed) {
  std::vector<bf16_t> x(static_cast<size_t>(b.rows()) * kDim);
  for (int t = 0; t < b.rows(); ++t) {
    std::mt19937_64 rng(b.req[t] < 0 ? seed * 7919 + 13 + t : seed + 1000003ull * b.req[t] + b.pos[t]);
    const std::vector<bf16_t> row = random_bf16(kDim, rng);
    std::copy(row.begin(), row.end(), x.begin() + t * kDim);
  }
  return x;
}

ref::CompressorOut run_step(const ref::CompressorWeights& cw, const BatchDesc& b, const RequestPool& pool, Caches& c,
                            uint64_t seed = 5) {
  const StepMeta meta = build_step_meta(b, pool, kMaxPos);
  const std::vector<bf16_t> x = x_for(b, seed);
  return ref::compressor_forward(cw, x.data(), kDim, meta, compressed_table().data(), kMaxPos, kEps, c.view);
}

BatchDesc single(int req, int pos) {
  BatchDesc b;
  b.req = {req};
  b.pos = {pos};
  return b;
}
BatchDesc block(int req, int pos0, int v, int pad_to = 0) {
  BatchDesc b;
  for (int i = 0; i < v; ++i) {
    b.req.push_back(req);
    b.pos.push_back(pos0 + i);
  }
  while (b.rows() < pad_to) {
    b.req.push_back(-1);
    b.pos.push_back(0);
  }
  return b;
}

// Number of slots of a cache (layout) whose bytes differ from the poison.
int64_t written_slots(const std::vector<uint8_t>& cache, const CacheLayout& layout, int64_t slots) {
  int64_t n = 0;
  for (int64_t s = 0; s < slots; ++s) {
    bool w = false;
    for (int i = 0; i < layout.data_bytes && !w; ++i) w = cache[layout.data_offset(s) + i] != kPoison;
    for (int i = 0; i < layout.scale_bytes && !w; ++i) w = cache[layout.scale_offset(s) + i] != kPoison;
    n += w;
  }
  return n;
}

// ---- index_k_store ------------------------------------------------------------------------------

TEST(RefCompressorIndexK, HandMadeRowBytes) {
  // The wanted post-RoPE key z (128 dims), one value per e2m1 case. kproj = sign, k_norm = |y|
  // with y the pre-RoPE key, so that RMSNorm (r = 1 for +-1 inputs) gives y exactly; RoPE at
  // g = 1 of the hand table is 90 degrees on dims 64..127: y[2k] = z[2k+1], y[2k+1] = -z[2k].
  // Block amax 4 -> s = pow2ceil(4/6) = 1 (ue8m0 127); amax 0.69921875 -> 2^-3 (124).
  const double grid1[8] = {4, 0.5, 1, 1.5, 2, 3, -0.75, 1.25};          // codes 6 1 2 3 4 5 A 2
  const uint8_t code1[8] = {0x6, 0x1, 0x2, 0x3, 0x4, 0x5, 0xA, 0x2};
  const double grid2[8] = {0.69921875, 0.25, 0.0625, -0.03125, 0.1875, -0.69921875, 0.125, 0.3125};
  const uint8_t code2[8] = {0x7, 0x4, 0x1, 0x8, 0x3, 0xF, 0x2, 0x4};  // / 2^-3: 5.6 2 .5 -.25 1.5 -5.6 1 2.5
  std::vector<double> z(128);
  for (int d = 0; d < 128; ++d) {
    const int blk = d / 32;
    z[d] = (blk % 2 == 0) ? grid1[d % 8] : grid2[d % 8];
  }
  std::vector<double> y = z;
  for (int k = 0; k < 32; ++k) {
    y[64 + 2 * k] = z[64 + 2 * k + 1];
    y[64 + 2 * k + 1] = -z[64 + 2 * k];
  }
  std::vector<bf16_t> kproj(128);
  std::vector<float> k_norm(128);
  for (int d = 0; d < 128; ++d) {
    kproj[d] = bf16_exact(y[d] < 0 ? -1.0 : 1.0);
    k_norm[d] = static_cast<float>(std::fabs(y[d]));
  }
  std::vector<float> table;
  for (int p = 0; p < 2; ++p)
    for (int i = 0; i < 32; ++i) {
      table.push_back(p == 0 ? 1.0f : 0.0f);
      table.push_back(p == 0 ? 0.0f : 1.0f);
    }
  const CacheLayout layout = cache_layout(CacheKind::kIndexK, 64);
  std::vector<uint8_t> cache(static_cast<size_t>(layout.pool_bytes(128)), kPoison);
  const int32_t g[1] = {1}, loc[1] = {70};
  EXPECT_EQ(ref::index_k_store(kproj.data(), 1, k_norm.data(), kEps, g, table.data(), 2, loc, layout, cache.data(), 128), 0);
  const uint8_t* data = cache.data() + layout.data_offset(70);
  const uint8_t* scales = cache.data() + layout.scale_offset(70);
  EXPECT_EQ(layout.data_offset(70), 64 * 68 + 6 * 64);  // page 1 (64 slots x 68 bytes), slot 6
  for (int d = 0; d < 128; d += 2) {
    const uint8_t* codes = (d / 32) % 2 == 0 ? code1 : code2;
    EXPECT_EQ(data[d / 2], codes[d % 8] | (codes[(d + 1) % 8] << 4)) << "dims " << d << "," << d + 1;
  }
  EXPECT_EQ(scales[0], 127);
  EXPECT_EQ(scales[1], 124);
  EXPECT_EQ(scales[2], 127);
  EXPECT_EQ(scales[3], 124);
  // Only slot 70 was written; slot 0 / negative skip; out of range is counted.
  size_t touched = 0;
  for (uint8_t b : cache) touched += b != kPoison;
  EXPECT_LE(touched, 68u);
  const std::vector<uint8_t> before = cache;
  const int32_t skip[3] = {0, -1, 128};
  const int32_t g3[3] = {0, 1, 0};
  std::vector<bf16_t> k3(3 * 128, bf16_exact(1.0));
  EXPECT_EQ(ref::index_k_store(k3.data(), 3, k_norm.data(), kEps, g3, table.data(), 2, skip, layout, cache.data(), 128), 1);
  EXPECT_EQ(cache, before);
  const int32_t gbad[3] = {0, 2, 0};  // past the 2-position table
  const int32_t locs[3] = {1, 2, 3};
  EXPECT_THROW(ref::index_k_store(k3.data(), 3, k_norm.data(), kEps, gbad, table.data(), 2, locs, layout, cache.data(), 128),
               std::invalid_argument);
  EXPECT_THROW(ref::index_k_store(k3.data(), 3, nullptr, kEps, g3, table.data(), 2, locs, layout, cache.data(), 128),
               std::invalid_argument);
  EXPECT_EQ(cache, before);
}

// ---- c1_fused ---------------------------------------------------------------------------------

TEST(RefCompressorC1, MatchesTheUnfusedChain) {
  std::mt19937_64 rng(3001);
  const int N = 5;
  const std::vector<bf16_t> proj = random_bf16(N * 512, rng, 0.7);
  const std::vector<float> c_norm = random_norm_weights(512, rng);
  const int32_t pos[N] = {0, 1, 77, 500, 1023};
  const int32_t loc[N] = {3, 0, 64, 99, 100};  // 0: padded (skip, latent still made); 100: out of range
  const CacheLayout layout = cache_layout(CacheKind::kCompressedFp4, 64);
  const int64_t slots = 100;
  std::vector<uint8_t> cache(static_cast<size_t>(layout.pool_bytes(slots)), kPoison);
  std::vector<bf16_t> latent(N * 512, kPoisonBf16);
  EXPECT_EQ(ref::c1_fused(proj.data(), N, c_norm.data(), kEps, pos, compressed_table().data(), kMaxPos, loc, layout,
                          cache.data(), slots, latent.data()),
            1);
  // Unfused: RMSNorm, RoPE at g = pos, FP4 store.
  std::vector<bf16_t> normed(N * 512);
  ref::rmsnorm_rows(proj.data(), N, 512, 512, c_norm.data(), kEps, normed.data(), 512);
  EXPECT_EQ(latent, normed);
  std::vector<bf16_t> roped = normed;
  ref::rope_rows(roped.data(), N, 1, 512, 512, pos, compressed_table().data(), kMaxPos);
  std::vector<uint8_t> want(cache.size(), kPoison);
  for (int t = 0; t < N; ++t)
    if (loc[t] > 0 && loc[t] < slots) ref::store_compressed_fp4(roped.data() + t * 512, layout, want.data(), loc[t]);
  EXPECT_EQ(cache, want);
  EXPECT_EQ(written_slots(cache, layout, slots), 3);
}

TEST(RefCompressorC1, BadInputThrowsAndChangesNothing) {
  std::vector<bf16_t> proj(2 * 512, bf16_exact(1.0)), latent(2 * 512, kPoisonBf16);
  std::vector<float> c_norm(512, 1.0f);
  const CacheLayout layout = cache_layout(CacheKind::kCompressedFp4, 64);
  std::vector<uint8_t> cache(static_cast<size_t>(layout.pool_bytes(64)), kPoison);
  const int32_t loc[2] = {1, 2};
  const int32_t past[2] = {0, kMaxPos};
  EXPECT_THROW(ref::c1_fused(proj.data(), 2, c_norm.data(), kEps, past, compressed_table().data(), kMaxPos, loc, layout,
                             cache.data(), 64, latent.data()),
               std::invalid_argument);
  const int32_t pos[2] = {0, 1};
  EXPECT_THROW(ref::c1_fused(proj.data(), 2, c_norm.data(), kEps, pos, compressed_table().data(), kMaxPos, loc, layout,
                             cache.data(), 64, nullptr),
               std::invalid_argument);
  EXPECT_THROW(ref::c1_fused(proj.data(), 2, c_norm.data(), kEps, pos, compressed_table().data(), kMaxPos, loc,
                             cache_layout(CacheKind::kWindowV41), cache.data(), 64, latent.data()),
               std::invalid_argument);
  EXPECT_EQ(cache, std::vector<uint8_t>(cache.size(), kPoison));
  EXPECT_EQ(latent, std::vector<bf16_t>(latent.size(), kPoisonBf16));
}

// ---- c2_fused ---------------------------------------------------------------------------------

TEST(RefCompressorC2, HandComputedPairs) {
  // Row 0 (pos 4) parks; row 1 (pos 5) pairs with row 0 in the batch; row 2 (pos 9) reads state
  // row 1 (never parked: score -inf, so p_a = 0 and pooled = its own kv); row 3 is padded.
  // Equal scores give p = 1/2 each: pooled = (1 + 3) / 2 = 2 in every dim, so the norm gives
  // r = 1/2 and the latent is c_norm exactly.
  const int N = 4;
  std::vector<float> kvs(N * 1024, 0.0f);
  for (int d = 0; d < 512; ++d) {
    kvs[0 * 1024 + d] = 1.0f;
    kvs[0 * 1024 + 512 + d] = 0.25f * (d % 5);
    kvs[1 * 1024 + d] = 3.0f;
    kvs[1 * 1024 + 512 + d] = 0.25f * (d % 5);
    kvs[2 * 1024 + d] = (d % 2 ? -0.5f : 0.5f);
    kvs[2 * 1024 + 512 + d] = 7.0f;
    kvs[3 * 1024 + d] = 100.0f;
  }
  std::mt19937_64 rng(3002);
  const std::vector<float> c_norm = random_norm_weights(512, rng);
  const int32_t pos[N] = {4, 5, 9, 0};
  const int32_t state_row[N] = {4, 5, 9 % 8, -1};
  const int32_t partner[N] = {-1, 4, 0, -1};  // pos 9: (9 - 1) % 8 = 0
  const int32_t prev[N] = {-1, 0, -1, -1};
  const int32_t loc[N] = {-1, 40, 41, -1};
  std::vector<float> state(8 * 1024);
  ref::pair_state_init(state.data(), 8);
  std::vector<float> state_before = state;
  const CacheLayout layout = cache_layout(CacheKind::kCompressedFp4, 64);
  std::vector<uint8_t> cache(static_cast<size_t>(layout.pool_bytes(64)), kPoison);
  std::vector<bf16_t> latent(N * 512, kPoisonBf16);
  EXPECT_EQ(ref::c2_fused(kvs.data(), N, pos, state_row, partner, prev, state.data(), 8, c_norm.data(), kEps,
                          compressed_table().data(), kMaxPos, loc, layout, cache.data(), 64, latent.data()),
            0);
  for (int d = 0; d < 512; ++d) {
    EXPECT_EQ(latent[0 * 512 + d], kPoisonBf16) << "even rows leave their latent row untouched";
    EXPECT_EQ(bf16_value(latent[1 * 512 + d]), c_norm[d]) << d;
    EXPECT_EQ(latent[3 * 512 + d], kPoisonBf16) << "padded rows write nothing";
  }
  // Row 2: pooled = its own kv (+-0.5): r = 2, latent = bf16(c_norm * +-1).
  for (int d = 0; d < 512; ++d) EXPECT_EQ(bf16_value(latent[2 * 512 + d]), (d % 2 ? -1.0f : 1.0f) * c_norm[d]) << d;
  // State: row 4 holds row 0's (kv, score); nothing else changed.
  std::copy(kvs.begin(), kvs.begin() + 1024, state_before.begin() + 4 * 1024);
  EXPECT_EQ(std::memcmp(state.data(), state_before.data(), state.size() * 4), 0);
  // The stores: group positions g = 4 and 8, compressed table.
  std::vector<uint8_t> want(cache.size(), kPoison);
  std::vector<bf16_t> r1(latent.begin() + 512, latent.begin() + 1024), r2(latent.begin() + 1024, latent.begin() + 1536);
  const int32_t g1[1] = {4}, g2[1] = {8};
  ref::rope_rows(r1.data(), 1, 1, 512, 512, g1, compressed_table().data(), kMaxPos);
  ref::rope_rows(r2.data(), 1, 1, 512, 512, g2, compressed_table().data(), kMaxPos);
  ref::store_compressed_fp4(r1.data(), layout, want.data(), 40);
  ref::store_compressed_fp4(r2.data(), layout, want.data(), 41);
  EXPECT_EQ(cache, want);
}

TEST(RefCompressorC2, MatchesTheUnfusedChain) {
  // A verify block of 6 rows at positions 7..12 (first row odd: partner from the state) plus a
  // decode row of another request at 20 (parks) and a padded row. The unfused chain: pair
  // softmax pool per dim, pooled rounded to bf16, RMSNorm, RoPE at g = pos - 1, FP4 store.
  std::mt19937_64 rng(3003);
  const int N = 8;
  std::vector<float> kvs = random_f32(N * 1024, rng, 1.5);
  const std::vector<float> c_norm = random_norm_weights(512, rng);
  const int32_t pos[N] = {7, 8, 9, 10, 11, 12, 20, 0};
  const int32_t state_row[N] = {7, 0, 1, 2, 3, 4, 8 + 4, -1};
  const int32_t partner[N] = {6, -1, 0, -1, 2, -1, -1, -1};
  const int32_t prev[N] = {-1, 0, 1, 2, 3, 4, -1, -1};
  const int32_t loc[N] = {50, -1, 51, -1, 52, -1, -1, -1};
  std::vector<float> state = random_f32(16 * 1024, rng, 1.5);  // a parked partner in row 6
  const std::vector<float> state_before = state;
  const CacheLayout layout = cache_layout(CacheKind::kCompressedFp4, 64);
  std::vector<uint8_t> cache(static_cast<size_t>(layout.pool_bytes(64)), kPoison);
  std::vector<bf16_t> latent(N * 512, kPoisonBf16);
  ASSERT_EQ(ref::c2_fused(kvs.data(), N, pos, state_row, partner, prev, state.data(), 16, c_norm.data(), kEps,
                          compressed_table().data(), kMaxPos, loc, layout, cache.data(), 64, latent.data()),
            0);
  std::vector<uint8_t> want(cache.size(), kPoison);
  std::vector<bf16_t> want_latent(N * 512, kPoisonBf16);
  for (int t : {0, 2, 4}) {
    const float* a = t == 0 ? state_before.data() + 6 * 1024 : kvs.data() + (t - 1) * 1024;
    const float* b = kvs.data() + t * 1024;
    std::vector<bf16_t> pooled(512);
    std::vector<float> pooled_f(512);
    for (int d = 0; d < 512; ++d) {
      pooled_f[d] = num::pair_softmax_pool(a[d], a[512 + d], b[d], b[512 + d]);
      pooled[d] = num::bf16_from_f32(pooled_f[d]);
    }
    ref::rmsnorm_rows(pooled.data(), 1, 512, 512, c_norm.data(), kEps, want_latent.data() + t * 512, 512);
    std::vector<bf16_t> roped(want_latent.begin() + t * 512, want_latent.begin() + (t + 1) * 512);
    const int32_t g[1] = {pos[t] - 1};
    ref::rope_rows(roped.data(), 1, 1, 512, 512, g, compressed_table().data(), kMaxPos);
    ref::store_compressed_fp4(roped.data(), layout, want.data(), loc[t]);
  }
  EXPECT_EQ(latent, want_latent);
  EXPECT_EQ(cache, want);
  // Parked rows: 8, 10, 12 of the block and 20 of the other request; everything else unchanged.
  std::vector<float> state_want = state_before;
  for (int t : {1, 3, 5, 6}) std::copy(kvs.begin() + t * 1024, kvs.begin() + (t + 1) * 1024, state_want.begin() + state_row[t] * 1024);
  EXPECT_EQ(std::memcmp(state.data(), state_want.data(), state.size() * 4), 0);
}

TEST(RefCompressorC2, RefusesInconsistentPairMetadataWithoutWriting) {
  std::vector<float> kvs(3 * 1024, 1.0f), state(4 * 1024, 0.0f), c_norm(512, 1.0f);
  const CacheLayout layout = cache_layout(CacheKind::kCompressedFp4, 64);
  std::vector<uint8_t> cache(static_cast<size_t>(layout.pool_bytes(64)), kPoison);
  std::vector<bf16_t> latent(3 * 512, kPoisonBf16);
  const int32_t loc[3] = {-1, 5, -1};
  auto call = [&](const int32_t* pos, const int32_t* srow, const int32_t* partner, const int32_t* prev) {
    return ref::c2_fused(kvs.data(), 3, pos, srow, partner, prev, state.data(), 4, c_norm.data(), kEps,
                         compressed_table().data(), kMaxPos, loc, layout, cache.data(), 64, latent.data());
  };
  const int32_t pos[3] = {2, 3, 4}, srow[3] = {2, 3, 0}, partner[3] = {-1, 2, -1}, prev[3] = {-1, 0, -1};
  // Two even rows parking in the same state row (a ring too small for the rows per request).
  const int32_t pos_b[3] = {2, 3, 6}, srow_b[3] = {2, 3, 2};
  EXPECT_THROW(call(pos_b, srow_b, partner, prev), std::invalid_argument);
  // A partner state row read and parked in the same step.
  const int32_t prev_none[3] = {-1, -1, -1}, srow_c[3] = {0, 3, 2};
  EXPECT_THROW(call(pos, srow_c, partner, prev_none), std::invalid_argument);
  // prev_row pointing at a row that is not at pos - 1.
  const int32_t prev_bad[3] = {-1, 2, -1};
  EXPECT_THROW(call(pos, srow, partner, prev_bad), std::invalid_argument);
  // State row outside the state; position past the table; null state.
  const int32_t srow_big[3] = {2, 3, 4};
  EXPECT_THROW(call(pos, srow_big, partner, prev), std::invalid_argument);
  const int32_t pos_past[3] = {2, 3, kMaxPos};
  EXPECT_THROW(call(pos_past, srow, partner, prev), std::invalid_argument);
  EXPECT_THROW(ref::c2_fused(kvs.data(), 3, pos, srow, partner, prev, nullptr, 4, c_norm.data(), kEps,
                             compressed_table().data(), kMaxPos, loc, layout, cache.data(), 64, latent.data()),
               std::invalid_argument);
  EXPECT_EQ(cache, std::vector<uint8_t>(cache.size(), kPoison));
  EXPECT_EQ(latent, std::vector<bf16_t>(latent.size(), kPoisonBf16));
  EXPECT_EQ(state, std::vector<float>(state.size(), 0.0f));
  // The consistent call works.
  EXPECT_EQ(call(pos, srow, partner, prev), 0);
  EXPECT_NE(cache, std::vector<uint8_t>(cache.size(), kPoison));
}

// ---- compressor_forward, ratio 2 ------------------------------------------------------------------

TEST(RefCompressorRatio2, DecodeStepsEqualVerifyBlocksOfSixAndOfTwelve) {
  const ref::CompressorWeights cw = make_compressor(2, 3101);
  const RequestPool pool = make_request_pool(2, 512, 12, 128);  // pair ring 16 > 12 rows
  const int64_t slots = pool.full_pool_slots() / 2 + 1;
  const int64_t state_rows = 2LL * pool.pair_ring;
  const int p = 10, req = 1;
  Caches a(slots, state_rows), b(slots, state_rows), c(slots, state_rows), d(slots, state_rows);
  for (int i = 0; i < 12; ++i) run_step(cw, single(req, p + i), pool, a);
  run_step(cw, block(req, p, 6), pool, b);
  run_step(cw, block(req, p + 6, 6), pool, b);
  const ref::CompressorOut out12 = run_step(cw, block(req, p, 12), pool, c);
  run_step(cw, block(req, p, 6, /*pad_to=*/8), pool, d);  // padded verify batches
  run_step(cw, block(req, p + 6, 6, /*pad_to=*/16), pool, d);
  EXPECT_TRUE(a.same_as(b)) << "decode steps vs two verify blocks of 6";
  EXPECT_TRUE(a.same_as(c)) << "decode steps vs one block of 12";
  EXPECT_TRUE(a.same_as(d)) << "decode steps vs padded verify blocks";
  // Six groups (10,11) .. (20,21) were written, each at full_slot(pos odd) / 2, with g = pos - 1.
  EXPECT_EQ(written_slots(a.comp, a.view.comp_layout, slots), 6);
  EXPECT_EQ(written_slots(a.index_k, a.view.index_k_layout, slots), 6);
  for (int i = 0; i < 12; ++i) {
    EXPECT_EQ(out12.g[i], (p + i) % 2 ? p + i - 1 : -1);
    const int64_t slot = pool.full_slot(req, p + i) / 2;
    if ((p + i) % 2) {
      EXPECT_NE(a.comp[a.view.comp_layout.data_offset(slot)], kPoison) << "group of " << p + i;
    }
  }
  // The last even position parked its (kv, score); the state rows of the other request are untouched.
  const float* parked = a.state.data() + (req * pool.pair_ring + (p + 10) % pool.pair_ring) * 1024;
  EXPECT_EQ(std::memcmp(parked, out12.kvs.data() + 10 * 1024, 1024 * 4), 0);
  for (int r = 0; r < pool.pair_ring; ++r) EXPECT_TRUE(std::isinf(a.state[r * 1024 + 512])) << "request 0 state row " << r;
}

TEST(RefCompressorRatio2, VerifyBlockStartingAtAnOddPositionReadsItsPartnerFromTheState) {
  const ref::CompressorWeights cw = make_compressor(2, 3102);
  const RequestPool pool = make_request_pool(1, 512, 6, 128);  // pair ring 8
  const int64_t slots = pool.full_pool_slots() / 2 + 1;
  Caches a(slots, pool.pair_ring), b(slots, pool.pair_ring), c(slots, pool.pair_ring);
  // a: decode 30..36. b: decode 30 (parks), then verify 31..36. c: like b with the state reset
  // between the two steps (so the group (30, 31) is completed with an empty partner).
  for (int p = 30; p <= 36; ++p) run_step(cw, single(0, p), pool, a);
  run_step(cw, single(0, 30), pool, b);
  run_step(cw, block(0, 31, 6), pool, b);
  run_step(cw, single(0, 30), pool, c);
  ref::pair_state_init(c.state.data(), pool.pair_ring);
  run_step(cw, block(0, 31, 6), pool, c);
  EXPECT_TRUE(a.same_as(b));
  const int64_t slot = pool.full_slot(0, 31) / 2;
  const CacheLayout& L = a.view.comp_layout;
  EXPECT_NE(std::memcmp(a.comp.data() + L.data_offset(slot), c.comp.data() + L.data_offset(slot), L.data_bytes), 0)
      << "the odd first row did not use the parked partner";
  // The later groups, paired inside the batch, do not depend on the state.
  const int64_t slot33 = pool.full_slot(0, 33) / 2;
  EXPECT_EQ(std::memcmp(a.comp.data() + L.data_offset(slot33), c.comp.data() + L.data_offset(slot33), L.data_bytes), 0);
}

TEST(RefCompressorRatio2, PaddedRowsChangeNothing) {
  const ref::CompressorWeights cw = make_compressor(2, 3103);
  const RequestPool pool = make_request_pool(2, 512, 6, 128);
  const int64_t slots = pool.full_pool_slots() / 2 + 1;
  Caches a(slots, 2 * pool.pair_ring), b(slots, 2 * pool.pair_ring), fresh(slots, 2 * pool.pair_ring);
  // Only padded rows: nothing anywhere.
  const ref::CompressorOut o = run_step(cw, make_decode_batch({}, 4), pool, a);
  EXPECT_TRUE(a.same_as(fresh));
  EXPECT_EQ(o.latent_pre_rope, std::vector<bf16_t>(4 * 512, 0));
  // Real rows with and without padding rows give the same bytes.
  run_step(cw, make_verify_batch({40, 51}, 6), pool, a);
  run_step(cw, make_verify_batch({40, 51}, 6, 16), pool, b);
  EXPECT_TRUE(a.same_as(b));
  EXPECT_EQ(written_slots(a.comp, a.view.comp_layout, slots), 6);  // 3 groups per request
}

TEST(RefCompressorRatio2, BadInputThrowsBeforeAnyWrite) {
  const ref::CompressorWeights cw = make_compressor(2, 3104);
  const RequestPool pool = make_request_pool(1, 512, 1, 128);  // pair ring 2: too small for 6 rows
  const int64_t slots = pool.full_pool_slots() / 2 + 1;
  Caches a(slots, pool.pair_ring), fresh(slots, pool.pair_ring);
  EXPECT_THROW(run_step(cw, block(0, 10, 6), pool, a), std::invalid_argument);
  // Position past the compressed RoPE table (the step metadata allowed it).
  const StepMeta meta = build_step_meta(single(0, 300), pool, 4096);
  const std::vector<bf16_t> x(kDim, bf16_exact(1.0));
  EXPECT_THROW(ref::compressor_forward(cw, x.data(), kDim, meta, compressed_table().data(), 200, kEps, a.view),
               std::invalid_argument);
  ref::CompressorCaches no_index = a.view;
  no_index.index_k = nullptr;
  EXPECT_THROW(ref::compressor_forward(cw, x.data(), kDim, build_step_meta(single(0, 3), pool, kMaxPos),
                                       compressed_table().data(), kMaxPos, kEps, no_index),
               std::invalid_argument);
  EXPECT_TRUE(a.same_as(fresh));
}

// The spec's ratio-2 chain (3.3 and cache-layouts.md "Slots"), written out from its formulas with
// the single public ops, for one step: the expected caches and pair state are updated in place,
// the expected per-row outputs returned. Slots, state rows and partners come from the pool and
// the batch directly (not from StepMeta), so that a wiring error in either shows up.
struct Ratio2Want {
  std::vector<float> kvs;  // [T, 1024] = [kv | score]
  std::vector<bf16_t> latent, kproj;
  std::vector<int32_t> g;
};
Ratio2Want ratio2_by_the_spec(const ref::CompressorWeights& cw, const BatchDesc& b, const RequestPool& pool,
                              const std::vector<bf16_t>& x, Caches& want) {
  const int T = b.rows();
  const CacheLayout& comp_layout = want.view.comp_layout;
  const CacheLayout& index_layout = want.view.index_k_layout;
  const float* table = compressed_table().data();
  Ratio2Want w;
  w.kvs.assign(static_cast<size_t>(T) * 1024, 0.0f);
  w.latent.assign(static_cast<size_t>(T) * 512, 0);
  w.kproj.assign(static_cast<size_t>(T) * 128, 0);
  w.g.assign(static_cast<size_t>(T), -1);
  // kv = x_f32 @ wkv^T, score = x_f32 @ wgate^T (padded rows too: the GEMM runs on all rows).
  std::vector<float> kv(static_cast<size_t>(T) * 512), score(static_cast<size_t>(T) * 512);
  ref::gemm_f32(x.data(), T, kDim, cw.wkv, kv.data(), 512);
  ref::gemm_f32(x.data(), T, kDim, cw.wgate, score.data(), 512);
  for (int t = 0; t < T; ++t) {
    std::copy_n(kv.begin() + t * 512, 512, w.kvs.begin() + t * 1024);
    std::copy_n(score.begin() + t * 512, 512, w.kvs.begin() + t * 1024 + 512);
  }
  const std::vector<float> state_before = want.state;  // every partner read sees the state before the step
  for (int t = 0; t < T; ++t) {
    const int req = b.req[t], pos = b.pos[t];
    if (req < 0) continue;  // padded row: nothing
    const int32_t state_row = req * pool.pair_ring + pos % pool.pair_ring;
    if (pos % 2 == 0) {  // parks (kv, score) for the odd partner to come
      std::copy_n(w.kvs.begin() + t * 1024, 1024, want.state.begin() + static_cast<size_t>(state_row) * 1024);
      continue;
    }
    // Odd: the group (pos - 1, pos); partner a = the previous row of the request if it is in the
    // batch, else its parked state row.
    const bool partner_in_batch = t > 0 && b.req[t - 1] == req && b.pos[t - 1] == pos - 1;
    const int32_t partner_state_row = req * pool.pair_ring + (pos - 1) % pool.pair_ring;
    const float* a = partner_in_batch ? w.kvs.data() + (t - 1) * 1024
                                      : state_before.data() + static_cast<size_t>(partner_state_row) * 1024;
    const float* self = w.kvs.data() + t * 1024;
    std::vector<bf16_t> pooled(512);
    for (int d = 0; d < 512; ++d) {
      const float sa = a[512 + d], sb = self[512 + d];
      const float m = std::max(sa, sb);
      const float ea = num::exp_f32_via_f64(sa - m), eb = num::exp_f32_via_f64(sb - m);
      const float pa = ea / (ea + eb), pb = eb / (ea + eb);
      const float kv_a_pa = a[d] * pa, kv_b_pb = self[d] * pb;  // each product rounded, then summed
      pooled[d] = num::bf16_from_f32(kv_a_pa + kv_b_pb);          // the pooled vector is bf16 before its norm
    }
    bf16_t* latent = w.latent.data() + t * 512;
    ref::rmsnorm_rows(pooled.data(), 1, 512, 512, cw.c_norm.data(), kEps, latent, 512);
    const int32_t g[1] = {pos - 1};
    w.g[t] = g[0];
    const int32_t slot = pool.full_slot(req, pos) / 2;  // c_out_loc: the completing row's slot / r
    // (a) index key from the latent before its RoPE; RoPE at g inside index_k_store.
    bf16_t* kproj = w.kproj.data() + t * 128;
    ref::gemm_bf16(latent, 1, 512, cw.wk, kproj, 128);
    const int32_t loc[1] = {slot};
    EXPECT_EQ(ref::index_k_store(kproj, 1, cw.k_norm.data(), kEps, g, table, kMaxPos, loc, index_layout,
                                 want.index_k.data(), want.view.index_k_slots),
              0);
    // (b) compressed KV: RoPE at g on dims 448..511, FP4 KV quant.
    std::vector<bf16_t> roped(latent, latent + 512);
    ref::rope_rows(roped.data(), 1, 1, 512, 512, g, table, kMaxPos);
    ref::store_compressed_fp4(roped.data(), comp_layout, want.comp.data(), slot);
  }
  return w;
}

TEST(RefCompressorRatio2, PiecesAreTheSingleOps) {
  const ref::CompressorWeights cw = make_compressor(2, 3105);
  const RequestPool pool = make_request_pool(3, 512, 6, 128);  // pair ring 8
  const int64_t slots = pool.full_pool_slots() / 2 + 1;
  const int64_t state_rows = 3LL * pool.pair_ring;
  Caches got(slots, state_rows), want(slots, state_rows);
  // Step 1: request 0 decodes at 20 (parks); request 1 verifies 40..45 (groups
  // paired inside the batch, and 44 parks too); request 2 decodes at 18 (parks); two padded rows.
  // Step 2: request 0 decodes at 21 (its partner 20 comes from the state); request 1 decodes at 46
  // (parks); request 2 verifies 19..24 (19 pairs with the parked 18, then 20..23 in the batch,
  // 24 parks); one padded row.
  BatchDesc step1, step2;
  step1.req = {0, 1, 1, 1, 1, 1, 1, 2, -1, -1};
  step1.pos = {20, 40, 41, 42, 43, 44, 45, 18, 0, 0};
  step2.req = {0, 1, 2, 2, 2, 2, 2, 2, -1};
  step2.pos = {21, 46, 19, 20, 21, 22, 23, 24, 0};
  int64_t groups = 0;
  for (const BatchDesc* b : {&step1, &step2}) {
    const StepMeta meta = build_step_meta(*b, pool, kMaxPos);
    const std::vector<bf16_t> x = x_for(*b, 11);
    const ref::CompressorOut o =
        ref::compressor_forward(cw, x.data(), kDim, meta, compressed_table().data(), kMaxPos, kEps, got.view);
    const Ratio2Want w = ratio2_by_the_spec(cw, *b, pool, x, want);
    const std::string step = b == &step1 ? "step 1" : "step 2";
    EXPECT_EQ(o.skipped, 0) << step;
    EXPECT_TRUE(o.kvs == w.kvs) << step << ": kvs is not [x @ wkv^T | x @ wgate^T]";
    EXPECT_EQ(o.g, w.g) << step;
    EXPECT_TRUE(o.latent_pre_rope == w.latent) << step << ": latent (pre-RoPE)";
    EXPECT_TRUE(o.kproj == w.kproj) << step << ": kproj = wk(latent)";
    EXPECT_TRUE(got.comp == want.comp) << step << ": compressed-KV cache bytes";
    EXPECT_TRUE(got.index_k == want.index_k) << step << ": index-K cache bytes";
    for (int64_t r = 0; r < state_rows; ++r)
      EXPECT_EQ(std::memcmp(got.state.data() + r * 1024, want.state.data() + r * 1024, 1024 * sizeof(float)), 0)
          << step << ": pair state row " << r;
    for (int32_t g : w.g) groups += g >= 0;
  }
  // The case exercises what it claims: 3 groups in step 1, 1 + 3 in step 2, and the partners
  // step 2 read from the state (position 20 of request 0, 18 of request 2) had really been parked
  // (finite score; an unparked row would give the partner weight 0).
  EXPECT_EQ(groups, 7);
  EXPECT_EQ(written_slots(got.comp, got.view.comp_layout, slots), 7);
  EXPECT_EQ(written_slots(got.index_k, got.view.index_k_layout, slots), 7);
  EXPECT_TRUE(std::isfinite(want.state[(0 * pool.pair_ring + 20 % pool.pair_ring) * 1024 + 512]));
  EXPECT_TRUE(std::isfinite(want.state[(2 * pool.pair_ring + 18 % pool.pair_ring) * 1024 + 512]));
}

// ---- compressor_forward, ratio 1 ------------------------------------------------------------------

TEST(RefCompressorRatio1, VerifyRowsEqualSeparateDecodeSteps) {
  const ref::CompressorWeights cw = make_compressor(1, 3201);
  const RequestPool pool = make_request_pool(2, 512, 6, 128);
  const int64_t slots = pool.full_pool_slots() + 1;
  Caches a(slots, 0), b(slots, 0), c(slots, 0);
  for (int i = 0; i < 6; ++i) {
    run_step(cw, single(0, 20 + i), pool, a);
    run_step(cw, single(1, 7 + i), pool, a);
  }
  run_step(cw, make_verify_batch({20, 7}, 6), pool, b);
  run_step(cw, make_verify_batch({20, 7}, 6, 16), pool, c);
  EXPECT_TRUE(a.same_as(b));
  EXPECT_TRUE(a.same_as(c));
  EXPECT_EQ(written_slots(a.comp, a.view.comp_layout, slots), 12);
  EXPECT_EQ(written_slots(a.index_k, a.view.index_k_layout, slots), 12);
}

TEST(RefCompressorRatio1, PiecesAreTheSingleOps) {
  const ref::CompressorWeights cw = make_compressor(1, 3202);
  const RequestPool pool = make_request_pool(1, 512, 6, 128);
  const int64_t slots = pool.full_pool_slots() + 1;
  Caches a(slots, 0);
  const BatchDesc b = make_verify_batch({100}, 6, 8);
  const StepMeta meta = build_step_meta(b, pool, kMaxPos);
  const std::vector<bf16_t> x = x_for(b, 9);
  const ref::CompressorOut o =
      ref::compressor_forward(cw, x.data(), kDim, meta, compressed_table().data(), kMaxPos, kEps, a.view);
  EXPECT_EQ(o.skipped, 0);
  std::vector<bf16_t> proj(8 * 512), kproj(8 * 128);
  ref::gemm_bf16(x.data(), 8, kDim, cw.wkv_c, proj.data(), 512);
  EXPECT_EQ(o.proj, proj);
  std::vector<bf16_t> latent(8 * 512);
  ref::rmsnorm_rows(proj.data(), 8, 512, 512, cw.c_norm.data(), kEps, latent.data(), 512);
  EXPECT_EQ(o.latent_pre_rope, latent);  // padded rows (pos 0) get a latent too: ratio 1 is stateless
  ref::gemm_bf16(latent.data(), 8, 512, cw.wk, kproj.data(), 128);
  EXPECT_EQ(o.kproj, kproj);
  std::vector<uint8_t> want(a.index_k.size(), kPoison);
  EXPECT_EQ(ref::index_k_store(kproj.data(), 8, cw.k_norm.data(), kEps, meta.pos.data(), compressed_table().data(),
                               kMaxPos, meta.c_out_loc[1].data(), a.view.index_k_layout, want.data(), slots),
            0);
  EXPECT_EQ(a.index_k, want);
  // The compressed KV: the latent with RoPE at g = pos, FP4 KV quant, at each completing row's slot
  // (every live row completes its group at ratio 1; padded rows write nothing).
  std::vector<bf16_t> roped = latent;
  ref::rope_rows(roped.data(), 8, 1, 512, 512, meta.pos.data(), compressed_table().data(), kMaxPos);
  std::vector<uint8_t> want_comp(a.comp.size(), kPoison);
  int written = 0;
  for (int t = 0; t < 8; ++t)
    if (meta.c_out_loc[1][static_cast<size_t>(t)] > 0) {
      ref::store_compressed_fp4(roped.data() + t * 512, a.view.comp_layout, want_comp.data(),
                                meta.c_out_loc[1][static_cast<size_t>(t)]);
      ++written;
    }
  EXPECT_EQ(written, 6);
  EXPECT_EQ(a.comp, want_comp);
  // Out-of-range slots are skipped and counted (compressed and index-K both).
  Caches small(pool.full_slot(0, 103), 0);  // slots of positions 103.. are out of range
  const ref::CompressorOut o2 =
      ref::compressor_forward(cw, x.data(), kDim, meta, compressed_table().data(), kMaxPos, kEps, small.view);
  EXPECT_EQ(o2.skipped, 2 * 3);
}

// ---- Q chain at real V4.1 sizes ---------------------------------------------------------------------

TEST(RefQChain, RealV41SizesSixRows) {
  const ModelPlan plan = build_plan(load_config(), 1);
  const ModelConfig& cfg = plan.config;
  const int layer = 21;  // a ratio-1 reuse layer: Q path only (fastest weights)
  const auto t0 = std::chrono::steady_clock::now();
  const ref::LayerWeights w = ref::make_synthetic_layer_weights(plan, layer, 42);
  const auto t1 = std::chrono::steady_clock::now();
  RopeParams rp;
  rp.base = cfg.compress_rope_theta;
  rp.yarn = true;
  const int64_t max_pos = 4096;
  const std::vector<float> table = build_rope_table(rp, max_pos);
  const int T = 6, H = cfg.n_heads, H_pad = 72;
  const std::vector<bf16_t> x = ref::synthetic_bf16(static_cast<size_t>(T) * cfg.dim, 99);
  const int32_t pos[T] = {1000, 1001, 1002, 1003, 1004, 1005};
  const auto t2 = std::chrono::steady_clock::now();
  const ref::QChainOut q = ref::q_chain(w, x.data(), T, pos, table.data(), max_pos, H, H_pad, cfg.norm_eps);
  const auto t3 = std::chrono::steady_clock::now();
  auto secs = [](auto a, auto b) { return std::chrono::duration<double>(b - a).count(); };
  std::printf("[ q_chain ] weights %.3f s, chain (T=6, H=64) %.3f s\n", secs(t0, t1), secs(t2, t3));
  EXPECT_LT(secs(t2, t3), 3.0);
  const int64_t width = cfg.q_lora_rank + 512;
  ASSERT_EQ(q.qkv_a.size(), static_cast<size_t>(T * width));
  // qkv_a: sampled elements against a double evaluation of the quantised operands.
  const ref::ActQuant aq = ref::act_quant(x.data(), T, cfg.dim, cfg.dim);
  const int64_t kb = cfg.dim / 32;
  int worst = 0;
  for (int t = 0; t < T; ++t)
    for (int64_t n = t; n < width; n += 97) {
      double s = 0;
      for (int64_t k = 0; k < cfg.dim; ++k)
        s += e4m3_value(aq.q[t * cfg.dim + k]) * ue8m0_value(aq.scale[t * kb + k / 32]) *
             e4m3_value(w.wqkv_a.w[n * cfg.dim + k]) * ue8m0_value(w.wqkv_a.scale[(n / 32) * kb + k / 32]);
      worst = std::max(worst, bf16_ulps(q.qkv_a[t * width + n], s));
    }
  EXPECT_LE(worst, 1);
  // qr is q_norm of the wq_a part; q is wq_b(qr); q_pad is q roped, padding heads zero.
  std::vector<bf16_t> qr(static_cast<size_t>(T) * cfg.q_lora_rank);
  ref::rmsnorm_rows(q.qkv_a.data(), T, cfg.q_lora_rank, width, w.q_norm.data(), cfg.norm_eps, qr.data(), cfg.q_lora_rank);
  EXPECT_EQ(q.qr, qr);
  std::vector<bf16_t> qb(static_cast<size_t>(T) * H * 512);
  ref::gemm_fp8(qr.data(), T, cfg.q_lora_rank, w.wq_b, qb.data(), H * 512);
  EXPECT_EQ(q.q, qb);
  ref::rope_rows(qb.data(), T, H, 512, H * 512, pos, table.data(), max_pos);
  for (int t = 0; t < T; ++t)
    for (int h = 0; h < H_pad; ++h)
      for (int d = 0; d < 512; ++d)
        ASSERT_EQ(q.q_pad[(static_cast<size_t>(t) * H_pad + h) * 512 + d],
                  h < H ? qb[(static_cast<size_t>(t) * H + h) * 512 + d] : bf16_t{0})
            << t << "," << h << "," << d;
  // Q has a healthy magnitude (the weights' 1/sqrt(K) scaling keeps activations O(1)).
  double ss = 0;
  for (bf16_t v : q.q) ss += static_cast<double>(bf16_value(v)) * bf16_value(v);
  const double rms = std::sqrt(ss / static_cast<double>(q.q.size()));
  EXPECT_GT(rms, 0.3);
  EXPECT_LT(rms, 3.0);
  EXPECT_THROW(ref::q_chain(w, x.data(), T, pos, table.data(), max_pos, H + 1, H_pad, cfg.norm_eps), std::invalid_argument);
  const int32_t past[T] = {0, 1, 2, 3, 4, static_cast<int32_t>(max_pos)};
  EXPECT_THROW(ref::q_chain(w, x.data(), T, past, table.data(), max_pos, H, H_pad, cfg.norm_eps), std::invalid_argument);
}

}  // namespace
