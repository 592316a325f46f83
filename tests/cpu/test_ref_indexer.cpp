// Tests of the CPU reference lightning indexer, candidate mask and top-k (spec section 3.4).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <stdexcept>
#include <vector>

#include "v4attn/cache_layout.h"
#include "v4attn/numerics.h"
#include "v4attn/reference/indexer.h"
#include "v4attn/reference/prepare_ops.h"
#include "v4attn/rope_table.h"

namespace {

using namespace v4attn;
using num::bf16_t;

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// The e2m1 grid written out here (not through numerics.h), so that the tests decode codes
// independently of the code under test.
double grid_value(uint8_t code) {
  static const double kMag[8] = {0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0};
  return (code & 8u) ? -kMag[code & 7u] : kMag[code & 7u];
}
uint8_t low_nibble(uint8_t b) { return b & 0xfu; }
uint8_t high_nibble(uint8_t b) { return b >> 4; }

bf16_t bf16_exact(double v) {  // the tests only feed values that bf16 holds exactly
  const float f = static_cast<float>(v);
  const bf16_t b = num::bf16_from_f32(f);
  EXPECT_EQ(num::f32_from_bf16(b), f) << v << " is not a bf16 value";
  return b;
}

// ---- indexer_q_pack ---------------------------------------------------------------------------

// One 32-element block pattern, in units of the block scale: (value, expected e2m1 code).
// Covers every grid point, both signs, the RNE ties (0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2,
// 3.5->4, 5->4), values between grid points and the sign kept on values rounding to zero.
struct Unit {
  double v;
  uint8_t code;
};
const Unit kPattern[32] = {
    {6, 0x7},     {-6, 0xF},    {0.5, 0x1},   {-0.5, 0x9},  {1, 0x2},     {1.5, 0x3},   {2, 0x4},
    {3, 0x5},     {4, 0x6},     {-4, 0xE},    {0.25, 0x0},  {-0.25, 0x8}, {0.75, 0x2},  {1.25, 0x2},
    {1.75, 0x4},  {2.5, 0x4},   {3.5, 0x6},   {5, 0x6},     {-5, 0xE},    {0, 0x0},     {-1.75, 0xC},
    {5.5, 0x7},   {0.625, 0x1}, {2.25, 0x4},  {3.25, 0x5},  {4.5, 0x6},   {5.25, 0x7},  {1.125, 0x2},
    {-1.375, 0xB}, {0.875, 0x2}, {0.375, 0x1}, {-0.125, 0x8}};

TEST(RefIndexerQPack, HandMadeHeadsGiveTheExpectedBytes) {
  // Hand-made RoPE table: position 0 is the identity (cos 1, sin 0); position 1 rotates each
  // pair by 90 degrees (cos 0, sin 1): (re, im) -> (-im, re), exact in fp32.
  std::vector<float> table(2 * 64);
  for (int i = 0; i < 32; ++i) {
    table[2 * i] = 1.0f, table[2 * i + 1] = 0.0f;
    table[64 + 2 * i] = 0.0f, table[64 + 2 * i + 1] = 1.0f;
  }
  const int T = 2, heads = 2;
  const std::vector<int32_t> pos = {0, 1};
  std::vector<bf16_t> qi(T * heads * 128);
  std::vector<uint8_t> want_codes(T * heads * 64), want_scales(T * heads * 4);
  for (int t = 0; t < T; ++t)
    for (int h = 0; h < heads; ++h)
      for (int b = 0; b < 4; ++b) {
        const int e = -3 + 2 * b - h + t;  // distinct block scales 2^e
        want_scales[(t * heads + h) * 4 + b] = static_cast<uint8_t>(127 + e);
        // Stored (post-RoPE) values of block b: the pattern, rotated by (b + h) so that every
        // block pairs different elements; element i of the block = kPattern[(i + b + h) % 32].
        double stored[32];
        uint8_t codes[32];
        for (int i = 0; i < 32; ++i) {
          const Unit& u = kPattern[(i + b + h) % 32];
          stored[i] = std::ldexp(u.v, e);
          codes[i] = u.code;
        }
        bf16_t* dst = qi.data() + (t * heads + h) * 128 + b * 32;
        for (int i = 0; i < 32; i += 2) {
          if (b >= 2 && pos[t] == 1) {
            // RoPE tail at position 1: input (re, im) = (stored_im, -stored_re).
            dst[i] = bf16_exact(stored[i + 1]);
            dst[i + 1] = bf16_exact(-stored[i]);
          } else {
            dst[i] = bf16_exact(stored[i]);
            dst[i + 1] = bf16_exact(stored[i + 1]);
          }
          want_codes[(t * heads + h) * 64 + (b * 32 + i) / 2] =
              static_cast<uint8_t>(codes[i] | (codes[i + 1] << 4));
        }
      }
  const ref::IndexerQ q = ref::indexer_q_pack(qi.data(), T, heads, pos.data(), table.data(), 2);
  EXPECT_EQ(q.T, T);
  EXPECT_EQ(q.heads, heads);
  EXPECT_EQ(q.codes, want_codes);
  EXPECT_EQ(q.scales, want_scales);
}

TEST(RefIndexerQPack, ZeroHeadUsesTheAmaxFloorAndRopeTableIsApplied) {
  // A zero head: codes 0, scale from the amax floor. A second head of random values on the real
  // compressed RoPE table: every dequantised value is within one grid step of the roped input.
  RopeParams rp;
  rp.base = 160000.0;
  rp.yarn = true;
  const int64_t max_pos = 700;
  const std::vector<float> table = build_rope_table(rp, max_pos);
  std::mt19937 rng(1234);
  std::normal_distribution<float> nd(0.0f, 1.5f);
  const int heads = 2;
  const std::vector<int32_t> pos = {693};
  std::vector<bf16_t> qi(heads * 128, 0);
  for (int d = 0; d < 128; ++d) qi[128 + d] = num::bf16_from_f32(nd(rng));
  const ref::IndexerQ q = ref::indexer_q_pack(qi.data(), 1, heads, pos.data(), table.data(), max_pos);
  const uint8_t floor_scale = num::ue8m0_from_exp(num::indexer_quant_scale_exp(0.0f));
  // Zero magnitudes; the RoPE tail may hold -0.0 (0 * negative cos), whose sign the e2m1 code keeps.
  for (int i = 0; i < 64; ++i) EXPECT_EQ(q.codes[i] & (i < 32 ? 0xff : 0x77), 0) << i;
  for (int b = 0; b < 4; ++b) EXPECT_EQ(q.scales[b], floor_scale);

  const float* rope = table.data() + pos[0] * 64;
  for (int d = 0; d < 128; ++d) {
    double x = num::f32_from_bf16(qi[128 + d]);
    if (d >= 64) {  // roped in double, independently of the fp32 path
      const int i = (d - 64) / 2;
      const double re = num::f32_from_bf16(qi[128 + 64 + 2 * i]), im = num::f32_from_bf16(qi[128 + 64 + 2 * i + 1]);
      x = (d % 2 == 0) ? re * rope[2 * i] - im * rope[2 * i + 1] : re * rope[2 * i + 1] + im * rope[2 * i];
    }
    const uint8_t byte = q.codes[64 + d / 2];
    const double s = std::ldexp(1.0, q.scales[4 + d / 32] - 127);
    const double deq = grid_value(d % 2 ? high_nibble(byte) : low_nibble(byte)) * s;
    EXPECT_LE(std::fabs(deq - x), s * 1.0 + 1e-2 * std::fabs(x)) << "dim " << d;
  }
}

TEST(RefIndexerQPack, RejectsPositionOutsideTheTable) {
  std::vector<float> table(4 * 64, 0.0f);
  std::vector<bf16_t> qi(128, 0);
  const int32_t pos = 4;
  EXPECT_THROW(ref::indexer_q_pack(qi.data(), 1, 1, &pos, table.data(), 4), std::invalid_argument);
}

// ---- indexer_weights ----------------------------------------------------------------------------

TEST(RefIndexerWeights, ScaleIsOneSixtyFourthFor32HeadsAndRoundedOnceOtherwise) {
  std::mt19937 rng(7);
  std::normal_distribution<float> nd(0.0f, 3.0f);
  const int T = 3, heads = 8;
  std::vector<bf16_t> wp(T * heads);
  for (auto& b : wp) b = num::bf16_from_f32(nd(rng));
  const std::vector<float> w32 = ref::indexer_weights(wp.data(), T, heads, 32);
  ASSERT_EQ(w32.size(), wp.size());
  for (size_t i = 0; i < wp.size(); ++i) EXPECT_EQ(w32[i], num::f32_from_bf16(wp[i]) / 64.0f) << i;  // exact
  const std::vector<float> w24 = ref::indexer_weights(wp.data(), T, heads, 24);
  const float c24 = static_cast<float>(std::pow(128.0, -0.5) * std::pow(24.0, -0.5));
  for (size_t i = 0; i < wp.size(); ++i) EXPECT_EQ(w24[i], num::f32_from_bf16(wp[i]) * c24) << i;
  EXPECT_THROW(ref::indexer_weights(wp.data(), T, heads, 4), std::invalid_argument);
}

// ---- indexer_scores -----------------------------------------------------------------------------

// A random index-K pool written byte by byte in the paged layout, with its dequantised values.
struct IndexKPool {
  CacheLayout layout = cache_layout(CacheKind::kIndexK);
  int64_t n_slots = 0;
  std::vector<uint8_t> bytes;
  std::vector<double> values;  // [n_slots, 128]
};

IndexKPool make_index_k_pool(int64_t n_slots, std::mt19937& rng) {
  IndexKPool p;
  p.n_slots = n_slots;
  p.bytes.assign(p.layout.pool_bytes(n_slots), 0xAB);
  p.values.resize(n_slots * 128);
  std::uniform_int_distribution<int> code(0, 15), exp(-7, 1);
  for (int64_t s = 0; s < n_slots; ++s) {
    uint8_t* data = p.bytes.data() + p.layout.data_offset(s);
    uint8_t* sc = p.bytes.data() + p.layout.scale_offset(s);
    for (int b = 0; b < 4; ++b) sc[b] = static_cast<uint8_t>(127 + exp(rng));
    for (int i = 0; i < 64; ++i) {
      const uint8_t lo = static_cast<uint8_t>(code(rng)), hi = static_cast<uint8_t>(code(rng));
      data[i] = static_cast<uint8_t>(lo | (hi << 4));
      p.values[s * 128 + 2 * i] = std::ldexp(grid_value(lo), sc[(2 * i) / 32] - 127);
      p.values[s * 128 + 2 * i + 1] = std::ldexp(grid_value(hi), sc[(2 * i + 1) / 32] - 127);
    }
  }
  return p;
}

ref::IndexerQ make_random_q(int64_t T, int heads, std::mt19937& rng) {
  ref::IndexerQ q;
  q.T = T;
  q.heads = heads;
  q.codes.resize(T * heads * 64);
  q.scales.resize(T * heads * 4);
  std::uniform_int_distribution<int> byte(0, 255), exp(-6, 2);
  for (auto& c : q.codes) c = static_cast<uint8_t>(byte(rng));
  for (auto& s : q.scales) s = static_cast<uint8_t>(127 + exp(rng));
  return q;
}

double q_value(const ref::IndexerQ& q, int64_t t, int h, int d) {
  const uint8_t byte = q.codes[(t * q.heads + h) * 64 + d / 2];
  return std::ldexp(grid_value(d % 2 ? high_nibble(byte) : low_nibble(byte)),
                    q.scales[(t * q.heads + h) * 4 + d / 32] - 127);
}

// Independent evaluation: each 32-term block sum in double from the dequantised values (exact in
// double, and by the exactness argument also representable in fp32: checked), then the fp32
// steps in the documented order.
float expected_score(const ref::IndexerQ& q, const IndexKPool& pool, const float* w, int64_t t, int64_t slot) {
  float score = 0.0f;
  for (int h = 0; h < q.heads; ++h) {
    float dot = 0.0f;
    for (int b = 0; b < 4; ++b) {
      double block = 0.0;
      for (int d = b * 32; d < (b + 1) * 32; ++d) block += q_value(q, t, h, d) * pool.values[slot * 128 + d];
      const float block_f = static_cast<float>(block);
      EXPECT_EQ(static_cast<double>(block_f), block) << "block sum not exact in fp32";
      dot = dot + block_f;
    }
    const float relu = dot > 0.0f ? dot : 0.0f;
    score = score + relu * w[t * q.heads + h];
  }
  return score;
}

TEST(RefIndexerScores, MatchAnIndependentEvaluationExactly) {
  std::mt19937 rng(42);
  const int heads = 4;
  const int64_t T = 4, n_slots = 400, stride = 160;  // pages of 64 slots: several pages
  const IndexKPool pool = make_index_k_pool(n_slots, rng);
  const ref::IndexerQ q = make_random_q(T, heads, rng);
  std::vector<float> w(T * heads);
  std::normal_distribution<float> nd(0.0f, 0.05f);
  for (auto& x : w) x = nd(rng);  // signed, like weights_proj outputs
  // Two requests with shuffled slot tables (as req_to_token[req][j*r]/r would be).
  std::vector<int32_t> table(2 * stride);
  std::vector<int32_t> perm(n_slots);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  std::copy(perm.begin(), perm.begin() + 2 * stride, table.begin());
  const std::vector<int32_t> req = {0, 1, 1, -1};
  const std::vector<int32_t> clen = {37, 150, 0, 12};  // the padded row (req -1) sees nothing
  const int64_t score_stride = 160;
  std::vector<float> scores(T * score_stride, kNaN);
  ref::indexer_scores(q, w.data(), pool.bytes.data(), pool.layout, n_slots, req.data(), clen.data(),
                      table.data(), stride, scores.data(), score_stride);
  int positive = 0, zero = 0;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < score_stride; ++j) {
      const float got = scores[t * score_stride + j];
      if (req[t] < 0 || j >= clen[t]) {
        EXPECT_EQ(got, -kInf) << t << "," << j;
        continue;
      }
      const float want = expected_score(q, pool, w.data(), t, table[req[t] * stride + j]);
      EXPECT_EQ(num::f32_bits(got), num::f32_bits(want)) << "row " << t << " position " << j << ": " << got << " vs " << want;
      positive += got > 0.0f;
      zero += got == 0.0f;
    }
  EXPECT_GT(positive, 50);  // the data exercises both signs of w and of the dots
}

// indexer_q_pack and index_k_store apply the same RoPE + FP4 indexer quant: the normed key packed
// as a query is byte-identical to the 68-byte slot the store writes (so the reader and the writer
// agree on the layout), and the score of a key against itself is its relu'd squared norm times w.
TEST(RefIndexerScores, QueryPackingAndIndexKStoreAgreeByteForByte) {
  std::mt19937 rng(77);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  RopeParams rp;
  rp.base = 160000.0;
  rp.yarn = true;
  const int64_t N = 3, n_slots = 130, max_pos = 300;
  const std::vector<float> table = build_rope_table(rp, max_pos);
  std::vector<bf16_t> kproj(N * 128);
  for (auto& b : kproj) b = num::bf16_from_f32(nd(rng));
  std::vector<float> k_norm(128);
  for (auto& w : k_norm) w = 0.5f + std::fabs(nd(rng));
  const std::vector<int32_t> g = {0, 77, 299}, loc = {1, 64, 129};
  const CacheLayout layout = cache_layout(CacheKind::kIndexK);
  std::vector<uint8_t> cache(layout.pool_bytes(n_slots), 0xEE);
  ASSERT_EQ(ref::index_k_store(kproj.data(), N, k_norm.data(), 1e-6f, g.data(), table.data(), max_pos, loc.data(),
                               layout, cache.data(), n_slots),
            0);
  std::vector<bf16_t> normed(N * 128);
  ref::rmsnorm_rows(kproj.data(), N, 128, 128, k_norm.data(), 1e-6f, normed.data(), 128);
  const ref::IndexerQ q = ref::indexer_q_pack(normed.data(), N, 1, g.data(), table.data(), max_pos);
  for (int64_t t = 0; t < N; ++t) {
    const uint8_t* data = cache.data() + layout.data_offset(loc[t]);
    const uint8_t* sc = cache.data() + layout.scale_offset(loc[t]);
    EXPECT_EQ(std::vector<uint8_t>(data, data + 64), std::vector<uint8_t>(q.codes.begin() + t * 64, q.codes.begin() + t * 64 + 64));
    EXPECT_EQ(std::vector<uint8_t>(sc, sc + 4), std::vector<uint8_t>(q.scales.begin() + t * 4, q.scales.begin() + t * 4 + 4));
  }
  // Row t's query against its own key (slot table: position j -> loc[j]).
  const std::vector<float> w = {1.0f, 1.0f, 1.0f};
  const std::vector<int32_t> req = {0, 0, 0}, clen = {3, 3, 3};
  std::vector<float> scores(N * 3, kNaN);
  ref::indexer_scores(q, w.data(), cache.data(), layout, n_slots, req.data(), clen.data(), loc.data(), 3,
                      scores.data(), 3);
  for (int64_t t = 0; t < N; ++t) {
    double sq = 0.0;
    for (int d = 0; d < 128; ++d) sq += q_value(q, t, 0, d) * q_value(q, t, 0, d);
    EXPECT_EQ(scores[t * 3 + t], static_cast<float>(sq)) << t;
  }
}

TEST(RefIndexerScores, RejectOutOfRangeSlotsBeforeWriting) {
  std::mt19937 rng(3);
  const IndexKPool pool = make_index_k_pool(64, rng);
  const ref::IndexerQ q = make_random_q(1, 2, rng);
  const std::vector<float> w = {0.5f, 0.25f};
  std::vector<int32_t> table = {3, 64, 5};  // 64 is outside a 64-slot pool
  const int32_t req = 0, clen = 3;
  std::vector<float> scores(64, kNaN);
  EXPECT_THROW(ref::indexer_scores(q, w.data(), pool.bytes.data(), pool.layout, 64, &req, &clen, table.data(), 3,
                                   scores.data(), 64),
               std::invalid_argument);
  for (float s : scores) EXPECT_TRUE(std::isnan(s));
  const int32_t long_clen = 65;  // more positions than the score row holds
  table[1] = 4;
  EXPECT_THROW(ref::indexer_scores(q, w.data(), pool.bytes.data(), pool.layout, 64, &req, &long_clen, table.data(),
                                   3, scores.data(), 64),
               std::invalid_argument);
}

// ---- top-k --------------------------------------------------------------------------------------

// Expected top-k positions by an independent route: stable sort of positions by descending score
// (stability keeps lower positions first among equal scores), keep k, sort by position.
std::vector<int64_t> expected_topk_positions(const float* row, int64_t clen, int topk) {
  std::vector<int64_t> p;
  for (int64_t j = 0; j < clen; ++j)
    if (row[j] != -kInf) p.push_back(j);
  std::stable_sort(p.begin(), p.end(), [&](int64_t a, int64_t b) { return row[a] > row[b]; });
  p.resize(std::min<size_t>(p.size(), static_cast<size_t>(topk)));
  std::sort(p.begin(), p.end());
  return p;
}

struct TopkCase {
  std::vector<float> scores;
  std::vector<int32_t> clen, req, table;
  int64_t score_stride = 0, table_stride = 0;
};

std::vector<int32_t> run_topk(const TopkCase& c, int topk, int64_t out_stride) {
  const int64_t T = static_cast<int64_t>(c.clen.size());
  std::vector<int32_t> out(T * out_stride, 0x7eadbeef);
  ref::topk_to_slots(c.scores.data(), T, c.score_stride, c.clen.data(), topk, c.req.data(), c.table.data(),
                     c.table_stride, out.data(), out_stride);
  return out;
}

void expect_topk_row(const TopkCase& c, const std::vector<int32_t>& out, int64_t t, int topk, int64_t out_stride) {
  const std::vector<int64_t> want =
      c.req[t] < 0 ? std::vector<int64_t>{}
                   : expected_topk_positions(c.scores.data() + t * c.score_stride, c.clen[t], topk);
  for (int64_t i = 0; i < out_stride; ++i) {
    const int32_t want_slot = i < static_cast<int64_t>(want.size()) ? c.table[c.req[t] * c.table_stride + want[i]] : -1;
    EXPECT_EQ(out[t * out_stride + i], want_slot) << "row " << t << " entry " << i;
  }
}

// Shuffled slot tables for n_req requests: slots are distinct, so a wrong position shows.
std::vector<int32_t> shuffled_table(int n_req, int64_t stride, std::mt19937& rng) {
  std::vector<int32_t> t(n_req * stride);
  std::iota(t.begin(), t.end(), 1000);
  std::shuffle(t.begin(), t.end(), rng);
  return t;
}

TEST(RefTopk, TiesGoToTheLowerPosition) {
  std::mt19937 rng(11);
  TopkCase c;
  c.score_stride = c.table_stride = 256;
  c.clen = {200, 70};
  c.req = {0, 1};
  c.table = shuffled_table(2, 256, rng);
  c.scores.assign(2 * 256, -kInf);
  std::uniform_int_distribution<int> few(0, 3);
  for (int j = 0; j < 200; ++j) c.scores[j] = static_cast<float>(few(rng));  // many ties
  for (int j = 0; j < 70; ++j) c.scores[256 + j] = 1.0f;                   // all equal
  const std::vector<int32_t> out = run_topk(c, 64, 64);
  for (int t = 0; t < 2; ++t) expect_topk_row(c, out, t, 64, 64);
  // All-equal row: exactly positions 0..63.
  for (int i = 0; i < 64; ++i) EXPECT_EQ(out[64 + i], c.table[256 + i]);
}

TEST(RefTopk, ClenBelowAtAndAboveTopkAndZero) {
  std::mt19937 rng(12);
  std::normal_distribution<float> nd;
  TopkCase c;
  c.score_stride = c.table_stride = 600;
  c.clen = {10, 64, 517, 0, 64};
  c.req = {0, 1, 2, 0, 1};
  c.table = shuffled_table(3, 600, rng);
  c.scores.assign(5 * 600, -kInf);
  for (int t = 0; t < 5; ++t)
    for (int j = 0; j < c.clen[t]; ++j) c.scores[t * 600 + j] = nd(rng);
  const int topk = 64;
  const std::vector<int32_t> out = run_topk(c, topk, 128);  // width padded past topk with -1
  for (int t = 0; t < 5; ++t) expect_topk_row(c, out, t, topk, 128);
  // clen < topk: all positions kept, in position order.
  for (int i = 0; i < 10; ++i) EXPECT_EQ(out[i], c.table[i]);
  EXPECT_EQ(out[10], -1);
  // clen == 0: nothing.
  for (int i = 0; i < 128; ++i) EXPECT_EQ(out[3 * 128 + i], -1);
  // clen > topk: exactly topk entries, ascending positions.
  EXPECT_NE(out[2 * 128 + 63], -1);
  EXPECT_EQ(out[2 * 128 + 64], -1);
}

TEST(RefTopk, PaddingWidthMustBeAMultipleOf64) {
  TopkCase c;
  c.score_stride = c.table_stride = 8;
  c.clen = {8};
  c.req = {0};
  c.table = {1, 2, 3, 4, 5, 6, 7, 8};
  c.scores = {1, 2, 3, 4, 5, 6, 7, 8};
  std::vector<int32_t> out(100);
  EXPECT_THROW(ref::topk_to_slots(c.scores.data(), 1, 8, c.clen.data(), 4, c.req.data(), c.table.data(), 8,
                                  out.data(), 100),
               std::invalid_argument);
  EXPECT_THROW(ref::topk_to_slots(c.scores.data(), 1, 8, c.clen.data(), 65, c.req.data(), c.table.data(), 8,
                                  out.data(), 64),
               std::invalid_argument);
  const std::vector<int32_t> got = run_topk(c, 4, 64);  // best 4 = positions 4..7
  EXPECT_EQ((std::vector<int32_t>(got.begin(), got.begin() + 5)), (std::vector<int32_t>{5, 6, 7, 8, -1}));
}

TEST(RefTopk, SlotsComeFromTheRowsRequestTable) {
  std::mt19937 rng(13);
  std::normal_distribution<float> nd;
  TopkCase c;
  c.score_stride = 96;
  c.table_stride = 100;  // table rows wider than the score rows
  c.clen = {90, 90, 90};
  c.req = {2, 0, -1};  // the padded row gives all -1
  c.table = shuffled_table(3, 100, rng);
  c.scores.assign(3 * 96, -kInf);
  for (int t = 0; t < 3; ++t)
    for (int j = 0; j < 90; ++j) c.scores[t * 96 + j] = nd(rng);
  const std::vector<int32_t> out = run_topk(c, 64, 64);
  for (int t = 0; t < 3; ++t) expect_topk_row(c, out, t, 64, 64);
  for (int i = 0; i < 64; ++i) EXPECT_EQ(out[128 + i], -1);
}

TEST(RefTopk, NegativeInfinityScoresAreNeverSelected) {
  TopkCase c;
  c.score_stride = c.table_stride = 100;
  c.clen = {100};
  c.req = {0};
  c.table.resize(100);
  std::iota(c.table.begin(), c.table.end(), 500);
  c.scores.assign(100, -kInf);
  for (int j = 0; j < 100; j += 3) c.scores[j] = static_cast<float>(-j);  // 34 finite scores
  const std::vector<int32_t> out = run_topk(c, 64, 64);
  for (int i = 0; i < 64; ++i) EXPECT_EQ(out[i], i < 34 ? 500 + 3 * i : -1) << i;
}

// ---- candidate mask -------------------------------------------------------------------------------

TEST(RefTopkCandidate, FewerReachableBlocksThanTopkBlocksKeepsAllFinite) {
  // clen 20, blocks of 8: 3 blocks; topk_blocks larger than that keeps them all; a block of only
  // -inf scores (block 1) is not kept; mask bytes past n_blocks are 0.
  std::vector<float> scores(32, kNaN);
  for (int j = 0; j < 20; ++j) scores[j] = (j >= 8 && j < 16) ? -kInf : static_cast<float>(j);
  const int32_t clen = 20;
  std::vector<uint8_t> mask(6, 0xCD);
  ref::candidate_mask(scores.data(), 1, 32, &clen, 8, 2048, mask.data(), 6);
  EXPECT_EQ(mask, (std::vector<uint8_t>{1, 0, 1, 0, 0, 0}));
}

TEST(RefTopkCandidate, NewestBlockIsAlwaysKeptAndTiesGoToTheLowerBlock) {
  // clen 41 with blocks of 8: block 5 holds only position 40 (the newest) with a very low score.
  std::vector<float> scores(48, -kInf);
  const float s[5] = {1.0f, 3.0f, 2.0f, 3.0f, 0.5f};  // block maxima; blocks 1 and 3 tie
  for (int b = 0; b < 5; ++b)
    for (int i = 0; i < 8; ++i) scores[b * 8 + i] = (i == 5) ? s[b] : s[b] - 10.0f;
  scores[40] = -1e30f;
  const int32_t clen = 41;
  std::vector<uint8_t> mask(8, 0xCD);
  ref::candidate_mask(scores.data(), 1, 48, &clen, 8, 2, mask.data(), 8);
  EXPECT_EQ(mask, (std::vector<uint8_t>{0, 1, 0, 0, 0, 1, 0, 0}));  // newest + block 1 (tie with 3)
  ref::candidate_mask(scores.data(), 1, 48, &clen, 8, 3, mask.data(), 8);
  EXPECT_EQ(mask, (std::vector<uint8_t>{0, 1, 0, 1, 0, 1, 0, 0}));
  const int32_t zero = 0;
  ref::candidate_mask(scores.data(), 1, 48, &zero, 8, 3, mask.data(), 8);
  EXPECT_EQ(mask, std::vector<uint8_t>(8, 0));
  const int32_t too_long = 65;  // 9 blocks do not fit a mask row of 8
  EXPECT_THROW(ref::candidate_mask(scores.data(), 1, 80, &too_long, 8, 3, mask.data(), 8), std::invalid_argument);
}

TEST(RefTopkCandidate, LaterSourceMaskingRemovesPositionsOutsideTheMask) {
  // Candidate source scores -> mask (top 6 blocks of 8 out of 40); a later source's own scores
  // masked with it select only positions inside kept blocks, and exactly the top-k of those.
  std::mt19937 rng(21);
  std::normal_distribution<float> nd;
  const int64_t T = 2, stride = 320, mstride = 40;
  const std::vector<int32_t> clen = {317, 150}, req = {0, 1};
  std::vector<float> src(T * stride, -kInf), later(T * stride, -kInf);
  for (int t = 0; t < T; ++t)
    for (int j = 0; j < clen[t]; ++j) src[t * stride + j] = nd(rng), later[t * stride + j] = nd(rng);
  std::vector<uint8_t> mask(T * mstride, 0xCD);
  ref::candidate_mask(src.data(), T, stride, clen.data(), 8, 6, mask.data(), mstride);
  for (int t = 0; t < T; ++t) {
    int kept = 0;
    for (int b = 0; b < mstride; ++b) kept += mask[t * mstride + b];
    EXPECT_EQ(kept, 6);
    EXPECT_EQ(mask[t * mstride + (clen[t] - 1) / 8], 1) << "newest block";
  }
  std::vector<float> masked = later;
  ref::apply_candidate_mask(masked.data(), T, stride, clen.data(), 8, mask.data(), mstride);
  for (int t = 0; t < T; ++t)
    for (int j = 0; j < stride; ++j) {
      const bool inside = j < clen[t] && mask[t * mstride + j / 8];
      EXPECT_EQ(num::f32_bits(masked[t * stride + j]), num::f32_bits(inside ? later[t * stride + j] : -kInf));
    }
  TopkCase c;
  c.scores = masked;
  c.score_stride = c.table_stride = stride;
  c.clen = clen;
  c.req = req;
  c.table = shuffled_table(2, stride, rng);
  const std::vector<int32_t> out = run_topk(c, 64, 64);
  for (int t = 0; t < T; ++t) {
    expect_topk_row(c, out, t, 64, 64);
    int n = 0, reachable = 0;
    for (int i = 0; i < 64; ++i) n += out[t * 64 + i] != -1;
    for (int j = 0; j < clen[t]; ++j) reachable += mask[t * mstride + j / 8];
    EXPECT_LT(reachable, 64) << "6 kept blocks of 8 hold fewer positions than topk";
    EXPECT_EQ(n, reachable);
  }
}

}  // namespace
