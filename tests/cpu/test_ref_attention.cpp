// Tests of the CPU reference sparse attention with sink and the output projection (spec section 4).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <stdexcept>
#include <vector>

#include "v4attn/cache_layout.h"
#include "v4attn/numerics.h"
#include "v4attn/reference/attention.h"
#include "v4attn/reference/prepare_ops.h"
#include "v4attn/rope_table.h"

namespace {

using namespace v4attn;
using num::bf16_t;

constexpr bf16_t kBf16NaN = 0x7fc0;
constexpr bf16_t kPoison = 0xffff;  // a NaN: an unwritten output element fails every comparison

// Encoders written out here (not through numerics.h), so that the caches' expected values are
// independent of the decoders under test.
struct Coded {
  uint8_t code;
  double value;
};
// A normal e4m3 value (1 + m/8) * 2^e with e in [e_lo, e_hi] (never the NaN pattern).
Coded random_e4m3(std::mt19937& rng, int e_lo, int e_hi, bool positive) {
  std::uniform_int_distribution<int> e(e_lo, e_hi), m(0, 7), sign(0, 1);
  const int ex = e(rng), mant = m(rng);
  const bool neg = !positive && sign(rng);
  const uint8_t code = static_cast<uint8_t>((neg ? 0x80 : 0) | ((ex + 7) << 3) | mant);
  return {code, (neg ? -1.0 : 1.0) * std::ldexp(1.0 + mant / 8.0, ex)};
}
double grid_value(uint8_t code) {
  static const double kMag[8] = {0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0};
  return (code & 8u) ? -kMag[code & 7u] : kMag[code & 7u];
}
double bf16_value(bf16_t b) { return num::f32_from_bf16(b); }

// bf16 ulp of |x| (x != 0): 2^(floor(log2|x|) - 7).
double bf16_ulp(double x) {
  int e;
  std::frexp(std::max(std::fabs(x), 1e-30), &e);
  return std::ldexp(1.0, e - 8);
}

// A cache pool of n slots, every slot random, with the values each slot dequantises to.
struct Pool {
  CacheLayout layout{};
  int64_t n = 0;
  std::vector<uint8_t> bytes;
  std::vector<double> values;  // [n, 512]
  double* row(int64_t s) { return values.data() + s * 512; }
  const double* row(int64_t s) const { return values.data() + s * 512; }
};

Pool make_window_pool(CacheKind kind, int64_t n, std::mt19937& rng, bool positive) {
  Pool p;
  p.layout = cache_layout(kind);
  p.n = n;
  p.bytes.assign(p.layout.pool_bytes(n), 0x5A);
  p.values.resize(n * 512);
  std::uniform_int_distribution<int> scale_exp(-1, 0);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (int64_t s = 0; s < n; ++s) {
    uint8_t* data = p.bytes.data() + p.layout.data_offset(s);
    uint8_t* sc = p.bytes.data() + p.layout.scale_offset(s);
    const int nope = kind == CacheKind::kWindowV41 ? 512 : 448;
    const int block = kind == CacheKind::kWindowV41 ? 32 : 64;
    for (int b = 0; b < nope / block; ++b) sc[b] = static_cast<uint8_t>(127 + scale_exp(rng));
    if (kind == CacheKind::kWindowV4) sc[7] = 0;
    for (int d = 0; d < nope; ++d) {
      const Coded c = random_e4m3(rng, -2, 1, positive);
      data[d] = c.code;
      p.row(s)[d] = std::ldexp(c.value, sc[d / block] - 127);
    }
    if (kind == CacheKind::kWindowV4)
      for (int i = 0; i < 64; ++i) {
        float v = nd(rng);
        if (positive) v = std::fabs(v) + 0.01f;
        const bf16_t b = num::bf16_from_f32(v);
        data[448 + 2 * i] = static_cast<uint8_t>(b & 0xff);
        data[448 + 2 * i + 1] = static_cast<uint8_t>(b >> 8);
        p.row(s)[448 + i] = bf16_value(b);
      }
  }
  return p;
}

Pool make_comp_pool(int64_t n, std::mt19937& rng, bool positive) {
  Pool p;
  p.layout = cache_layout(CacheKind::kCompressedFp4);
  p.n = n;
  p.bytes.assign(p.layout.pool_bytes(n), 0xA5);
  p.values.resize(n * 512);
  std::uniform_int_distribution<int> code(positive ? 1 : 0, positive ? 7 : 15);
  for (int64_t s = 0; s < n; ++s) {
    uint8_t* data = p.bytes.data() + p.layout.data_offset(s);
    uint8_t* sc = p.bytes.data() + p.layout.scale_offset(s);
    double scale[32];
    for (int b = 0; b < 32; ++b) {
      const Coded c = random_e4m3(rng, -3, -1, true);
      sc[b] = c.code;
      scale[b] = c.value;
    }
    for (int i = 0; i < 256; ++i) {
      const uint8_t lo = static_cast<uint8_t>(code(rng)), hi = static_cast<uint8_t>(code(rng));
      data[i] = static_cast<uint8_t>(lo | (hi << 4));
      p.row(s)[2 * i] = grid_value(lo) * scale[(2 * i) / 16];
      p.row(s)[2 * i + 1] = grid_value(hi) * scale[(2 * i + 1) / 16];
    }
  }
  return p;
}

// Float64 evaluation of softmax-with-sink attention over a list of keys (K = V).
struct DoubleAttention {
  std::vector<double> out;   // [512]
  std::vector<double> abs_weighted;  // sum_i p_i |v_i[d]| / den: the scale of bf16(p) errors
  double m = 0.0, den_without_sink = 0.0;
};
DoubleAttention double_attention(const bf16_t* q, const std::vector<const double*>& keys, double sink) {
  DoubleAttention r;
  r.out.assign(512, 0.0);
  r.abs_weighted.assign(512, 0.0);
  if (keys.empty()) return r;
  std::vector<double> s(keys.size());
  for (size_t i = 0; i < keys.size(); ++i) {
    double dot = 0.0;
    for (int d = 0; d < 512; ++d) dot += bf16_value(q[d]) * keys[i][d];
    s[i] = dot / std::sqrt(512.0);
  }
  r.m = *std::max_element(s.begin(), s.end());
  double den = 0.0;
  for (size_t i = 0; i < keys.size(); ++i) {
    const double p = std::exp(s[i] - r.m);
    den += p;
    for (int d = 0; d < 512; ++d) {
      r.out[d] += p * keys[i][d];
      r.abs_weighted[d] += p * std::fabs(keys[i][d]);
    }
  }
  r.den_without_sink = den;
  den += std::exp(sink - r.m);
  for (int d = 0; d < 512; ++d) r.out[d] /= den, r.abs_weighted[d] /= den;
  return r;
}

// ---- dequantisation -----------------------------------------------------------------------------

TEST(RefAttentionDequant, WindowAndCompressedRowsDecodeExactly) {
  std::mt19937 rng(5);
  for (CacheKind kind : {CacheKind::kWindowV41, CacheKind::kWindowV4}) {
    const Pool p = make_window_pool(kind, 70, rng, false);
    for (int64_t s : {0, 63, 64, 69}) {
      std::vector<float> got(512, std::numeric_limits<float>::quiet_NaN());
      ref::dequant_window_row(p.bytes.data(), p.layout, kind, s, got.data());
      for (int d = 0; d < 512; ++d) ASSERT_EQ(static_cast<double>(got[d]), p.row(s)[d]) << "slot " << s << " dim " << d;
    }
  }
  const Pool c = make_comp_pool(70, rng, false);
  for (int64_t s : {0, 5, 64, 69}) {
    std::vector<float> got(512, std::numeric_limits<float>::quiet_NaN());
    ref::dequant_compressed_row(c.bytes.data(), c.layout, s, got.data());
    for (int d = 0; d < 512; ++d) ASSERT_EQ(static_cast<double>(got[d]), c.row(s)[d]) << "slot " << s << " dim " << d;
  }
}

// The readers agree with the prepare ops' writers on the layouts (nibble order, scale placement,
// V4 RoPE tail): what window_k_store / store_compressed_fp4 write dequantises to the stored
// vector within the quantizers' error.
TEST(RefAttentionDequant, ReadsWhatThePrepareStoresWrite) {
  std::mt19937 rng(9);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  const int64_t T = 3, n_slots = 70, max_pos = 128;
  const std::vector<float> table = build_rope_table(RopeParams{}, max_pos);
  std::vector<bf16_t> kv_raw(T * 512);
  for (auto& b : kv_raw) b = num::bf16_from_f32(nd(rng));
  std::vector<float> kv_norm(512);
  for (auto& w : kv_norm) w = 0.5f + std::fabs(nd(rng));
  const std::vector<int32_t> pos = {3, 64, 127}, loc = {1, 64, 69};
  for (CacheKind kind : {CacheKind::kWindowV41, CacheKind::kWindowV4}) {
    const CacheLayout layout = cache_layout(kind);
    std::vector<uint8_t> cache(layout.pool_bytes(n_slots), 0);
    std::vector<bf16_t> kv(T * 512);
    ASSERT_EQ(ref::window_k_store(kv_raw.data(), T, 512, kv_norm.data(), 1e-6f, pos.data(), table.data(), max_pos,
                                  loc.data(), kind, layout, cache.data(), n_slots, kv.data()),
              0);
    for (int64_t t = 0; t < T; ++t) {
      std::vector<float> got(512);
      ref::dequant_window_row(cache.data(), layout, kind, loc[t], got.data());
      const int block = kind == CacheKind::kWindowV41 ? 32 : 64;
      for (int d = 0; d < 512; ++d) {
        const double x = bf16_value(kv[t * 512 + d]);
        if (kind == CacheKind::kWindowV4 && d >= 448) {
          ASSERT_EQ(got[d], x) << "V4 RoPE tail is stored as bf16";
          continue;
        }
        double amax = 0.0;
        for (int i = d / block * block; i < d / block * block + block; ++i) amax = std::max(amax, std::fabs(bf16_value(kv[t * 512 + i])));
        ASSERT_LE(std::fabs(got[d] - x), std::ldexp(std::fabs(x), -4) + std::ldexp(amax, -12)) << "row " << t << " dim " << d;
      }
    }
  }
  const CacheLayout layout = cache_layout(CacheKind::kCompressedFp4);
  std::vector<uint8_t> cache(layout.pool_bytes(n_slots), 0);
  std::vector<bf16_t> latent(512);
  for (auto& b : latent) b = num::bf16_from_f32(nd(rng));
  ref::store_compressed_fp4(latent.data(), layout, cache.data(), 66);
  std::vector<float> got(512);
  ref::dequant_compressed_row(cache.data(), layout, 66, got.data());
  for (int d = 0; d < 512; ++d) {
    double amax = 0.0;
    for (int i = d / 16 * 16; i < d / 16 * 16 + 16; ++i) amax = std::max(amax, std::fabs(bf16_value(latent[i])));
    // A grid step is at most 2 * scale (scale ~ amax / 6): error <= scale, plus the e4m3 scale's rounding.
    ASSERT_LE(std::fabs(got[d] - bf16_value(latent[d])), amax / 6.0 * 1.07 + amax / 8.0) << "dim " << d;
  }
}

// ---- sparse attention -----------------------------------------------------------------------------

// A batch over two requests: row 0 = request 0 at position 40 (window not yet full), rows 1-2 =
// request 1 at positions 300 and 301 (verify-like; the ring has wrapped: position 301 uses the
// ring slot of 168, which is outside row 1's window), row 3 padded.
struct AttentionCase {
  int heads = 3, h_pad = 4, window = 128, ring = 133, n_req = 2;
  int64_t T = 4, topk_stride = 128;
  std::vector<int32_t> pos = {40, 300, 301, 0}, req = {0, 1, 1, -1};
  Pool win, comp;
  std::vector<bf16_t> q;
  std::vector<int32_t> topk;
  std::vector<float> sink;
  CacheKind kind = CacheKind::kWindowV41;

  AttentionCase(CacheKind k, bool positive, uint64_t seed) : kind(k) {
    std::mt19937 rng(static_cast<uint32_t>(seed));
    win = make_window_pool(kind, static_cast<int64_t>(n_req) * ring, rng, positive);
    comp = make_comp_pool(400, rng, positive);
    std::normal_distribution<float> nd(0.0f, 1.5f);
    q.assign(T * h_pad * 512, kBf16NaN);  // padding heads stay NaN: they must never be read
    for (int64_t t = 0; t < T; ++t)
      for (int h = 0; h < heads; ++h)
        for (int d = 0; d < 512; ++d) q[(t * h_pad + h) * 512 + d] = num::bf16_from_f32(nd(rng));
    // Row 1's stale ring slots (positions 168..172 -> slots 35..39 of request 1) hold keys aligned
    // with row 1's head-0 query: if they were attended, they would dominate the output.
    for (int p = 168; p <= 172; ++p) {
      const int64_t slot = 1 * ring + p % ring;
      uint8_t* data = win.bytes.data() + win.layout.data_offset(slot);
      const uint8_t* sc = win.bytes.data() + win.layout.scale_offset(slot);
      for (int d = 0; d < 448; d += 2) {
        // e4m3 2.0 (0x40) where q >= 0; where q < 0: -2.0 (0xC0), or 2^-6 (0x08) for positive caches.
        const bool q_neg = num::f32_from_bf16(q[(1 * h_pad + 0) * 512 + d]) < 0;
        data[d] = !q_neg ? 0x40 : (positive ? 0x08 : 0xC0);
        const double v = !q_neg ? 2.0 : (positive ? 1.0 / 64.0 : -2.0);
        win.row(slot)[d] = v * std::ldexp(1.0, sc[d / (kind == CacheKind::kWindowV41 ? 32 : 64)] - 127);
      }
    }
    std::uniform_int_distribution<int> slot(0, 399), coin(0, 9);
    topk.assign(T * topk_stride, -1);
    for (int64_t i = 0; i < 70; ++i) topk[i] = slot(rng);                       // row 0: 70 then -1
    for (int64_t i = 0; i < topk_stride; ++i) topk[topk_stride + i] = slot(rng);  // row 1: full
    for (int64_t i = 0; i < topk_stride; ++i)                                     // row 2: -1 inside
      topk[2 * topk_stride + i] = coin(rng) < 3 ? -1 : slot(rng);
    for (int64_t i = 0; i < topk_stride; ++i) topk[3 * topk_stride + i] = slot(rng);  // padded row
    sink = {0.5f, -2.0f, 3.0f};
  }

  ref::AttentionInputs inputs() const {
    ref::AttentionInputs in;
    in.T = T;
    in.heads = heads;
    in.q = q.data();
    in.h_pad = h_pad;
    in.pos = pos.data();
    in.req = req.data();
    in.window = window;
    in.window_ring = ring;
    in.window_cache = win.bytes.data();
    in.window_layout = win.layout;
    in.window_kind = kind;
    in.topk = topk.data();
    in.topk_stride = topk_stride;
    in.comp_cache = comp.bytes.data();
    in.comp_layout = comp.layout;
    in.attn_sink = sink.data();
    in.window_slots = win.n;
    in.comp_slots = comp.n;
    return in;
  }

  // The keys of row t, from the slot formulas of the spec (window positions, then top-k).
  std::vector<const double*> keys(int64_t t) const {
    std::vector<const double*> k;
    if (req[t] < 0) return k;
    for (int64_t p = std::max<int64_t>(0, pos[t] - window + 1); p <= pos[t]; ++p)
      k.push_back(win.row(static_cast<int64_t>(req[t]) * ring + p % ring));
    for (int64_t i = 0; i < topk_stride; ++i)
      if (topk[t * topk_stride + i] >= 0) k.push_back(comp.row(topk[t * topk_stride + i]));
    return k;
  }
  const bf16_t* q_head(int64_t t, int h) const { return q.data() + (t * h_pad + h) * 512; }
};

std::vector<bf16_t> run_attention(const ref::AttentionInputs& in) {
  std::vector<bf16_t> out(in.T * in.heads * 512, kPoison);
  ref::sparse_attention(in, out.data());
  return out;
}

void check_against_double(CacheKind kind, bool positive, uint64_t seed) {
  const AttentionCase c(kind, positive, seed);
  const std::vector<bf16_t> out = run_attention(c.inputs());
  int64_t exact = 0, total = 0;
  for (int64_t t = 0; t < c.T; ++t)
    for (int h = 0; h < c.heads; ++h) {
      const bf16_t* got = out.data() + (t * c.heads + h) * 512;
      const DoubleAttention want = double_attention(c.q_head(t, h), c.keys(t), c.sink[h]);
      for (int d = 0; d < 512; ++d) {
        const double g = bf16_value(got[d]), w = want.out[d];
        // bf16(p) in the numerator errs by <= 2^-9 p per key, the final rounding by half an ulp;
        // with all-positive values that is within 2 ulps of the result.
        const double tol = positive ? 2.0 * bf16_ulp(w)
                                    : std::ldexp(std::fabs(w), -8) + 1.5 * std::ldexp(want.abs_weighted[d], -9) + 1e-12;
        ASSERT_LE(std::fabs(g - w), tol) << "row " << t << " head " << h << " dim " << d << ": " << g << " vs " << w;
        exact += num::bf16_from_f32(static_cast<float>(w)) == got[d];
        ++total;
      }
    }
  EXPECT_GT(exact, total / 2) << "most elements round to the same bf16 as the float64 result";
  // The stale ring slots matter: attending them would have moved row 1 far off.
  std::vector<const double*> with_stale = c.keys(1);
  for (int p = 168; p <= 172; ++p) with_stale.push_back(c.win.row(1 * c.ring + p % c.ring));
  const DoubleAttention stale = double_attention(c.q_head(1, 0), with_stale, c.sink[0]);
  double max_diff = 0.0;
  for (int d = 0; d < 512; ++d) max_diff = std::max(max_diff, std::fabs(stale.out[d] - bf16_value(out[(1 * c.heads) * 512 + d])));
  EXPECT_GT(max_diff, 0.1);
}

TEST(RefAttention, MatchesFloat64WithinTwoUlpsOnPositiveValuesV41) { check_against_double(CacheKind::kWindowV41, true, 101); }
TEST(RefAttention, MatchesFloat64WithinTwoUlpsOnPositiveValuesV4) { check_against_double(CacheKind::kWindowV4, true, 102); }
TEST(RefAttention, MatchesFloat64WithinTheBf16PBoundOnSignedValuesV41) { check_against_double(CacheKind::kWindowV41, false, 103); }
TEST(RefAttention, MatchesFloat64WithinTheBf16PBoundOnSignedValuesV4) { check_against_double(CacheKind::kWindowV4, false, 104); }

TEST(RefAttention, WindowWrapsAroundTheRingOfItsRequest) {
  // Row 1 (request 1, position 300) reads positions 173..300 at ring slots 133 + p % 133, which
  // wraps from slot 266-1 back to 133; the stale slots of positions 168..172 are excluded. Checked
  // by the float64 comparison above; here also: moving the row to request 0 changes the result.
  const AttentionCase c(CacheKind::kWindowV41, false, 105);
  const std::vector<bf16_t> out = run_attention(c.inputs());
  AttentionCase moved = c;
  moved.req[1] = 0;
  const std::vector<bf16_t> out_moved = run_attention(moved.inputs());
  int differ = 0;
  for (int d = 0; d < 512; ++d) differ += out[c.heads * 512 + d] != out_moved[c.heads * 512 + d];
  EXPECT_GT(differ, 400);
  const DoubleAttention want = double_attention(moved.q_head(1, 0), moved.keys(1), moved.sink[0]);
  for (int d = 0; d < 512; ++d) {
    const double tol = std::ldexp(std::fabs(want.out[d]), -8) + 1.5 * std::ldexp(want.abs_weighted[d], -9);
    ASSERT_LE(std::fabs(bf16_value(out_moved[c.heads * 512 + d]) - want.out[d]), tol) << d;
  }
}

TEST(RefAttention, SinkOnlyScalesTheResultThroughTheDenominator) {
  AttentionCase c(CacheKind::kWindowV41, false, 106);
  // Without a sink: nullptr and a sink of -1e30 (exp underflows to 0) give identical bytes.
  ref::AttentionInputs in = c.inputs();
  in.attn_sink = nullptr;
  const std::vector<bf16_t> none = run_attention(in);
  const std::vector<float> very_negative(c.heads, -1e30f);
  in.attn_sink = very_negative.data();
  EXPECT_EQ(run_attention(in), none);
  // Sinks chosen so that exp(sink - m) is 1, 1/4 and 3 times the keys' own denominator: the
  // output is scaled by 1/2, 4/5 and 1/4.
  std::vector<float> sink(c.heads);
  std::vector<double> ratio(c.heads);
  for (int h = 0; h < c.heads; ++h) {
    const DoubleAttention a = double_attention(c.q_head(1, h), c.keys(1), -INFINITY);
    const double target = a.den_without_sink * (h == 0 ? 1.0 : h == 1 ? 0.25 : 3.0);
    sink[h] = static_cast<float>(a.m + std::log(target));
    ratio[h] = a.den_without_sink / (a.den_without_sink + std::exp(static_cast<double>(sink[h]) - a.m));
  }
  in.attn_sink = sink.data();
  const std::vector<bf16_t> with = run_attention(in);
  for (int h = 0; h < c.heads; ++h)
    for (int d = 0; d < 512; ++d) {
      const int64_t i = (1 * c.heads + h) * 512 + d;
      const double g = bf16_value(with[i]), w = ratio[h] * bf16_value(none[i]);
      ASSERT_LE(std::fabs(g - w), 2.5 * bf16_ulp(w) + 1e-30) << "head " << h << " dim " << d;
    }
}

TEST(RefAttention, PaddedRowsAndRowsWithoutKeysGiveZeros) {
  const AttentionCase c(CacheKind::kWindowV41, false, 107);
  const std::vector<bf16_t> out = run_attention(c.inputs());
  for (int i = 0; i < c.heads * 512; ++i) ASSERT_EQ(out[3 * c.heads * 512 + i], 0) << i;  // padded row 3
  // No window and only -1 entries (or no top-k at all): zeros for every row.
  ref::AttentionInputs in = c.inputs();
  in.window = 0;
  in.window_cache = nullptr;
  const std::vector<int32_t> none(c.T * c.topk_stride, -1);
  in.topk = none.data();
  for (bf16_t b : run_attention(in)) ASSERT_EQ(b, 0);
  in.topk = nullptr;
  for (bf16_t b : run_attention(in)) ASSERT_EQ(b, 0);
}

TEST(RefAttention, RejectsSlotsOutsideThePools) {
  AttentionCase c(CacheKind::kWindowV41, false, 108);
  c.topk[5] = static_cast<int32_t>(c.comp.n);
  std::vector<bf16_t> out(c.T * c.heads * 512, kPoison);
  EXPECT_THROW(ref::sparse_attention(c.inputs(), out.data()), std::invalid_argument);
  for (bf16_t b : out) ASSERT_EQ(b, kPoison);
  c.topk[5] = 0;
  ref::AttentionInputs in = c.inputs();
  in.window_slots = c.ring;  // request 1's ring lies past a one-request pool
  EXPECT_THROW(ref::sparse_attention(in, out.data()), std::invalid_argument);
  in = c.inputs();
  in.window_ring = c.window - 1;
  EXPECT_THROW(ref::sparse_attention(in, out.data()), std::invalid_argument);
}

// The block algorithm itself, on three compressed keys (indices 0 and 1 in the first block of 64,
// index 70 in the second, so the second block rescales the first), restated step by step in fp32.
// The expected bytes differ from those of two plausible variants (fp32 p in the numerator; one
// global max instead of the running one), so the test pins the documented algorithm.
TEST(RefAttention, OnlineSoftmaxBlocksFollowTheDocumentedSteps) {
  CacheLayout layout = cache_layout(CacheKind::kCompressedFp4);
  const int64_t n_slots = 8;
  std::vector<uint8_t> cache(layout.pool_bytes(n_slots), 0);
  // Key j: dim 0 = score driver a_j, dim 1 + j = 1.0 (one-hot), dim 4 = mixed value b_j; all
  // e4m3 scales 1.0 (0x38), so the values are the e2m1 grid values.
  const uint8_t a_code[3] = {0xF /* -6 */, 0xE /* -4 */, 0xD /* -3 */};
  const uint8_t b_code[3] = {0x3 /* 1.5 */, 0x9 /* -0.5 */, 0x6 /* 4 */};
  const int32_t slot_of[3] = {5, 2, 7};
  for (int j = 0; j < 3; ++j) {
    uint8_t* data = cache.data() + layout.data_offset(slot_of[j]);
    std::fill(cache.begin() + layout.scale_offset(slot_of[j]), cache.begin() + layout.scale_offset(slot_of[j]) + 32, 0x38);
    uint8_t nib[512] = {};
    nib[0] = a_code[j];
    nib[1 + j] = 0x2;  // 1.0
    nib[4] = b_code[j];
    for (int i = 0; i < 256; ++i) data[i] = static_cast<uint8_t>(nib[2 * i] | (nib[2 * i + 1] << 4));
  }
  std::vector<bf16_t> q(512, 0);
  q[0] = num::bf16_from_f32(7.0f);
  std::vector<int32_t> topk(128, -1);
  topk[0] = slot_of[0], topk[1] = slot_of[1], topk[70] = slot_of[2];
  const int32_t pos = 9, req = 0;
  const float sink = 0.75f;
  ref::AttentionInputs in;
  in.T = 1, in.heads = 1, in.h_pad = 1, in.q = q.data(), in.pos = &pos, in.req = &req;
  in.window = 0, in.window_ring = 0;
  in.topk = topk.data(), in.topk_stride = 128, in.comp_cache = cache.data(), in.comp_layout = layout;
  in.attn_sink = &sink, in.comp_slots = n_slots;
  std::vector<bf16_t> out(512, kPoison);
  ref::sparse_attention(in, out.data());

  // Expected, in fp32 with the documented order (host build: no contraction).
  const float a[3] = {-6.0f, -4.0f, -3.0f}, b[3] = {1.5f, -0.5f, 4.0f};
  const float c = static_cast<float>(1.0 / std::sqrt(512.0));
  float s[3];
  for (int j = 0; j < 3; ++j) s[j] = (7.0f * a[j]) * c;
  auto ex = [](float x) { return static_cast<float>(std::exp(static_cast<double>(x))); };
  auto expected = [&](bool bf16_p, bool running_max) {
    auto rp = [&](float p) { return bf16_p ? num::round_bf16(p) : p; };
    std::vector<float> acc(5, 0.0f);
    auto v = [&](int j, int d) { return d == 0 ? a[j] : d == 4 ? b[j] : (d == 1 + j ? 1.0f : 0.0f); };
    // Block 0: keys 0, 1 (from m = -1e30: the correction is exp(-huge) = 0).
    const float m1 = running_max ? std::max(s[0], s[1]) : std::max({s[0], s[1], s[2]});
    const float corr0 = ex(-1e30f - m1);
    const float p0 = ex(s[0] - m1), p1 = ex(s[1] - m1);
    float den = 0.0f * corr0 + ((0.0f + p0) + p1);
    for (int d = 0; d < 5; ++d) acc[d] = acc[d] * corr0 + ((0.0f + rp(p0) * v(0, d)) + rp(p1) * v(1, d));
    // Block 1: key 2 raises the max.
    const float m2 = std::max(m1, s[2]);
    const float corr = ex(m1 - m2), p2 = ex(s[2] - m2);
    den = den * corr + (0.0f + p2);
    for (int d = 0; d < 5; ++d) acc[d] = acc[d] * corr + (0.0f + rp(p2) * v(2, d));
    den = den + ex(sink - m2);
    std::vector<bf16_t> o(512, 0);
    for (int d = 0; d < 5; ++d) o[d] = num::bf16_from_f32(acc[d] / den);
    return o;
  };
  const std::vector<bf16_t> want = expected(true, true);
  EXPECT_EQ(out, want);
  EXPECT_NE(want, expected(false, true)) << "the case must tell bf16(p) from fp32 p";
  EXPECT_NE(want, expected(true, false)) << "the case must tell the running max from a global one";
}

// ---- output projection ----------------------------------------------------------------------------

struct ProjectionCase {
  int64_t T = 3, max_pos = 256;
  int heads = 4, groups = 2, rank = 32, dim = 96;
  std::vector<int32_t> pos = {0, 17, 250};
  std::vector<float> table;
  std::vector<bf16_t> attn;
  ref::Bf16Matrix wo_a;
  ref::Fp8Matrix wo_b;
  std::vector<double> wo_b_values;  // [dim, groups*rank] dequantised

  explicit ProjectionCase(uint32_t seed) {
    std::mt19937 rng(seed);
    table = build_rope_table(RopeParams{}, max_pos);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    attn.resize(T * heads * 512);
    for (auto& b : attn) b = num::bf16_from_f32(nd(rng));
    const int64_t k = static_cast<int64_t>(heads / groups) * 512;
    wo_a.n = groups * rank;
    wo_a.k = k;
    wo_a.w.resize(wo_a.n * k);
    for (auto& b : wo_a.w) b = num::bf16_from_f32(nd(rng) / 32.0f);
    wo_b.n = dim;
    wo_b.k = groups * rank;
    wo_b.w.resize(wo_b.n * wo_b.k);
    wo_b.scale.resize(((dim + 31) / 32) * (wo_b.k / 32));
    std::uniform_int_distribution<int> se(-8, -5);
    for (auto& s : wo_b.scale) s = static_cast<uint8_t>(127 + se(rng));
    wo_b_values.resize(wo_b.w.size());
    for (int64_t n = 0; n < dim; ++n)
      for (int64_t j = 0; j < wo_b.k; ++j) {
        const Coded c = random_e4m3(rng, -4, 3, false);
        wo_b.w[n * wo_b.k + j] = c.code;
        wo_b_values[n * wo_b.k + j] = std::ldexp(c.value, wo_b.scale[(n / 32) * (wo_b.k / 32) + j / 32] - 127);
      }
  }
  // Attention output with the inverse RoPE applied in double (dims 448..511 of every head).
  double o(int64_t t, int64_t flat) const {
    const int64_t d = flat % 512, base = t * heads * 512 + (flat - d);
    if (d < 448) return bf16_value(attn[base + d]);
    const int i = static_cast<int>(d - 448) / 2;
    const double c = table[pos[t] * 64 + 2 * i], s = table[pos[t] * 64 + 2 * i + 1];
    const double re = bf16_value(attn[base + 448 + 2 * i]), im = bf16_value(attn[base + 448 + 2 * i + 1]);
    return d % 2 == 0 ? re * c + im * s : -re * s + im * c;
  }
};

TEST(RefAttentionOutput, LoraAMatchesFloat64WithinBf16Rounding) {
  const ProjectionCase c(31);
  std::vector<bf16_t> lora(c.T * c.groups * c.rank, kPoison);
  ref::output_lora_a(c.attn.data(), c.T, c.heads, c.groups, c.pos.data(), c.table.data(), c.max_pos, c.wo_a,
                     lora.data());
  const int64_t k = c.wo_a.k;
  int64_t exact = 0;
  for (int64_t t = 0; t < c.T; ++t)
    for (int g = 0; g < c.groups; ++g)
      for (int r = 0; r < c.rank; ++r) {
        double sum = 0.0, abs_sum = 0.0, tail_abs = 0.0;
        for (int64_t j = 0; j < k; ++j) {
          const double term = c.o(t, g * k + j) * bf16_value(c.wo_a.w[(g * c.rank + r) * k + j]);
          sum += term;
          abs_sum += std::fabs(term);
          if (j % 512 >= 448) tail_abs += std::fabs(term);
        }
        const int64_t col = g * c.rank + r;
        const double got = bf16_value(lora[t * c.groups * c.rank + col]);
        // Half an ulp for the output rounding, 2^-9 relative on the bf16-rounded RoPE tail, and the
        // fp32 accumulation over k terms.
        const double tol = bf16_ulp(sum) + std::ldexp(tail_abs, -9) + std::ldexp(abs_sum, -16);
        ASSERT_LE(std::fabs(got - sum), tol) << "row " << t << " col " << col;
        exact += num::bf16_from_f32(static_cast<float>(sum)) == lora[t * c.groups * c.rank + col];
      }
  EXPECT_GT(exact, c.T * c.groups * c.rank * 3 / 4);
  const std::vector<int32_t> bad_pos = {0, 17, 256};
  EXPECT_THROW(ref::output_lora_a(c.attn.data(), c.T, c.heads, c.groups, bad_pos.data(), c.table.data(), c.max_pos,
                                  c.wo_a, lora.data()),
               std::invalid_argument);
}

TEST(RefAttentionOutput, ProjectionMatchesFloat64OfTheFp8Gemm) {
  const ProjectionCase c(32);
  std::vector<bf16_t> lora(c.T * c.groups * c.rank);
  ref::output_lora_a(c.attn.data(), c.T, c.heads, c.groups, c.pos.data(), c.table.data(), c.max_pos, c.wo_a,
                     lora.data());
  std::vector<bf16_t> out(c.T * c.dim, kPoison);
  ref::output_projection(c.attn.data(), c.T, c.heads, c.groups, c.pos.data(), c.table.data(), c.max_pos, c.wo_a,
                         c.wo_b, out.data());
  // The float64 evaluation of the fp8 GEMM on the lora activation: act quant per 32-block (the
  // spec's quantizer, via the shared primitives), then exact products summed in double.
  const int64_t k = c.wo_b.k;
  int64_t exact = 0;
  for (int64_t t = 0; t < c.T; ++t) {
    std::vector<double> a(k);
    for (int64_t b = 0; b < k / 32; ++b) {
      float amax = 0.0f;
      for (int i = 0; i < 32; ++i) amax = num::block_amax_step(amax, bf16_value(lora[t * k + b * 32 + i]));
      const float s = num::pow2_f32(num::act_quant_scale_exp(amax));
      for (int i = 0; i < 32; ++i) {
        const float x = static_cast<float>(bf16_value(lora[t * k + b * 32 + i]));
        a[b * 32 + i] = static_cast<double>(num::f32_from_e4m3(num::act_quant_code(x, s))) * s;
      }
    }
    for (int64_t n = 0; n < c.dim; ++n) {
      double sum = 0.0, abs_sum = 0.0;
      for (int64_t j = 0; j < k; ++j) {
        sum += a[j] * c.wo_b_values[n * k + j];
        abs_sum += std::fabs(a[j] * c.wo_b_values[n * k + j]);
      }
      const double got = bf16_value(out[t * c.dim + n]);
      ASSERT_LE(std::fabs(got - sum), bf16_ulp(sum) + std::ldexp(abs_sum, -20)) << "row " << t << " col " << n;
      exact += num::bf16_from_f32(static_cast<float>(sum)) == out[t * c.dim + n];
    }
  }
  EXPECT_GT(exact, c.T * c.dim * 3 / 4);
  ref::Fp8Matrix wrong = c.wo_b;
  wrong.k = 32;
  EXPECT_THROW(ref::output_projection(c.attn.data(), c.T, c.heads, c.groups, c.pos.data(), c.table.data(), c.max_pos,
                                      c.wo_a, wrong, out.data()),
               std::invalid_argument);
}

}  // namespace
