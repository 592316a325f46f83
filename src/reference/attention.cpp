// CPU reference of the sparse attention core with sink and of the output projection (spec
// v41-attention.md section 4; cache byte layouts in cache-layouts.md).
#include "v4attn/reference/attention.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

namespace v4attn::ref {

namespace {

constexpr int kHeadDim = 512;
constexpr int kRopeStart = kHeadDim - num::kRopeDim;  // 448
constexpr int kBlockKeys = 64;                        // online-softmax block of key indices
constexpr float kInitialMax = -1e30f;

[[noreturn]] void fail(const char* fn, const std::string& what) {
  throw std::invalid_argument(std::string(fn) + ": " + what);
}

}  // namespace

void dequant_window_row(const uint8_t* cache, const CacheLayout& layout, CacheKind kind, int64_t loc, float* out512) {
  const uint8_t* data = cache + layout.data_offset(loc);
  const uint8_t* scales = cache + layout.scale_offset(loc);
  switch (kind) {
    case CacheKind::kWindowV41:
      // 512 e4m3 codes, one ue8m0 scale per 32 dims. e4m3 times a power of two: exact.
      for (int d = 0; d < kHeadDim; ++d)
        out512[d] = num::mul_rn(num::f32_from_e4m3(data[d]), num::f32_from_ue8m0(scales[d / 32]));
      return;
    case CacheKind::kWindowV4:
      // 448 e4m3 codes with one ue8m0 scale per 64 dims, then the RoPE tail as 64 bf16
      // (little-endian) in data bytes 448..575.
      for (int d = 0; d < kRopeStart; ++d)
        out512[d] = num::mul_rn(num::f32_from_e4m3(data[d]), num::f32_from_ue8m0(scales[d / 64]));
      for (int i = 0; i < num::kRopeDim; ++i) {
        const uint8_t* b = data + kRopeStart + 2 * i;
        out512[kRopeStart + i] = num::f32_from_bf16(static_cast<bf16_t>(b[0] | (b[1] << 8)));
      }
      return;
    default:
      fail("dequant_window_row", "kind is not a window layout");
  }
}

void dequant_compressed_row(const uint8_t* cache, const CacheLayout& layout, int64_t loc, float* out512) {
  // 256 bytes of e2m1 pairs (even element in the low nibble), one e4m3 scale per 16 dims. The
  // product of an e2m1 value (2 significant bits) and an e4m3 scale (4 bits) is exact in fp32
  // (and in bf16).
  const uint8_t* data = cache + layout.data_offset(loc);
  const uint8_t* scales = cache + layout.scale_offset(loc);
  for (int i = 0; i < kHeadDim / 2; ++i) {
    const float s = num::f32_from_e4m3(scales[(2 * i) / 16]);
    out512[2 * i] = num::mul_rn(num::f32_from_e2m1(static_cast<uint8_t>(data[i] & 0xfu)), s);
    out512[2 * i + 1] = num::mul_rn(num::f32_from_e2m1(static_cast<uint8_t>(data[i] >> 4)), s);
  }
}

// The algorithm, per row t (request r = req[t] >= 0, position P = pos[t]) and head h:
//
// Key-index list (shared by all heads), length n_idx = window + topk_stride, as in DeepSeek's
// reference (a fixed-width window part padded with -1, then the top-k part):
//   index i in [0, window):      position p = max(0, P - window + 1) + i, valid iff p <= P,
//                                key = window cache row r*window_ring + p % window_ring;
//   index window + i, i in [0, topk_stride): key = compressed cache row topk[t, i], valid iff >= 0.
// So before the window is full (P < window - 1) the window part holds positions 0..P followed
// by invalid indices, and the compressed part always starts at index `window`.
// K = V = the dequantised 512-dim vector (exact, see dequant_*_row).
//
// Score of a valid index i: s_i = fp32(dot(q, k_i)) * fp32(512^-0.5), where q = bf16 Q of the
// head (fp32-widened) and the dot is accumulated sequentially over d = 0..511 in fp32 (each
// product q[d]*k[d] is exact: bf16 times an exactly-dequantised value, < 24 significant bits).
//
// Online softmax over blocks of 64 consecutive indices, b = 0, 1, ..., ceil(n_idx/64)-1; every
// operation in fp32, exp = num::exp_f32_via_f64, subtractions rounded before the exp:
//   m = -1e30, den = 0, acc[0..512) = 0
//   per block with at least one valid index (a block without one changes nothing):
//     m_new = max(m, max of s_i over the block's valid indices)
//     corr  = exp(m - m_new)
//     p_i   = exp(s_i - m_new)                       for the valid indices
//     psum  = sum of p_i in index order, starting from 0
//     den   = den * corr + psum
//     acc[d] = acc[d] * corr + vsum[d], vsum[d] = sum in index order, starting from 0, of
//              bf16(p_i) * v_i[d] (each product exact)
//     m = m_new
//   out[d] = bf16(acc[d] / (den + exp(attn_sink[h] - m)))     (no sink: den alone)
// A row without any valid index (window 0 and no compressed entry) and a padded row (req < 0)
// give zeros. A GPU kernel computes the dots and the P.V sums with tensor cores (a different
// order), so it matches this to within a few bf16 ulps, not bit for bit.
void sparse_attention(const AttentionInputs& in, bf16_t* out) {
  static constexpr const char* kFn = "sparse_attention";
  const int64_t T = in.T;
  const int heads = in.heads;
  if (T < 0 || heads <= 0 || in.h_pad < heads) fail(kFn, "need T >= 0 and 0 < heads <= h_pad");
  if (in.window < 0) fail(kFn, "window must be >= 0");
  if (in.topk_stride < 0 || (in.topk != nullptr && in.topk_stride == 0)) fail(kFn, "bad topk_stride");
  if (T == 0) return;
  if (in.q == nullptr || in.pos == nullptr || in.req == nullptr || out == nullptr) fail(kFn, "null input");
  if (in.window > 0) {
    if (in.window_cache == nullptr) fail(kFn, "window > 0 needs a window cache");
    if (in.window_ring < in.window) fail(kFn, "window_ring must be >= window");
    if (in.window_kind != CacheKind::kWindowV41 && in.window_kind != CacheKind::kWindowV4)
      fail(kFn, "window_kind is not a window layout");
  }
  const int64_t n_topk = in.topk != nullptr ? in.topk_stride : 0;
  // Validate every slot before writing anything.
  for (int64_t t = 0; t < T; ++t) {
    if (in.req[t] < 0) continue;
    if (in.pos[t] < 0) fail(kFn, "row " + std::to_string(t) + ": negative position");
    if (in.window > 0 && in.window_slots > 0) {
      const int64_t last = static_cast<int64_t>(in.req[t]) * in.window_ring + (in.window_ring - 1);
      if (last >= in.window_slots)
        fail(kFn, "row " + std::to_string(t) + ": request " + std::to_string(in.req[t]) +
                      "'s window ring is outside the window pool");
    }
    for (int64_t i = 0; i < n_topk; ++i) {
      const int32_t slot = in.topk[t * in.topk_stride + i];
      if (slot < 0) continue;
      if (in.comp_cache == nullptr) fail(kFn, "compressed entries need a compressed cache");
      if (in.comp_slots > 0 && slot >= in.comp_slots)
        fail(kFn, "row " + std::to_string(t) + ": compressed slot " + std::to_string(slot) +
                      " outside [0, " + std::to_string(in.comp_slots) + ")");
    }
  }

  const int64_t n_idx = in.window + n_topk;
  const float score_scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(kHeadDim)));
  std::vector<float> keys(static_cast<size_t>(n_idx) * kHeadDim);
  std::vector<uint8_t> valid(static_cast<size_t>(n_idx));
  std::vector<float> s(kBlockKeys), p(kBlockKeys), qf(kHeadDim), acc(kHeadDim), vsum(kHeadDim);

  for (int64_t t = 0; t < T; ++t) {
    bf16_t* o_row = out + t * heads * kHeadDim;
    std::fill(o_row, o_row + static_cast<int64_t>(heads) * kHeadDim, bf16_t{0});
    const int32_t r = in.req[t];
    if (r < 0) continue;  // padded row
    const int64_t P = in.pos[t];

    // Gather and dequantise the row's keys once (shared by every head).
    int64_t n_valid = 0;
    const int64_t first = std::max<int64_t>(0, P - in.window + 1);
    for (int64_t i = 0; i < in.window; ++i) {
      const int64_t p_i = first + i;
      valid[i] = p_i <= P;
      if (!valid[i]) continue;
      ++n_valid;
      dequant_window_row(in.window_cache, in.window_layout, in.window_kind,
                         static_cast<int64_t>(r) * in.window_ring + p_i % in.window_ring,
                         keys.data() + i * kHeadDim);
    }
    for (int64_t i = 0; i < n_topk; ++i) {
      const int64_t idx = in.window + i;
      const int32_t slot = in.topk[t * in.topk_stride + i];
      valid[idx] = slot >= 0;
      if (!valid[idx]) continue;
      ++n_valid;
      dequant_compressed_row(in.comp_cache, in.comp_layout, slot, keys.data() + idx * kHeadDim);
    }
    if (n_valid == 0) continue;  // no key: zeros

    for (int h = 0; h < heads; ++h) {
      const bf16_t* qh = in.q + (t * in.h_pad + h) * kHeadDim;
      for (int d = 0; d < kHeadDim; ++d) qf[d] = num::f32_from_bf16(qh[d]);
      float m = kInitialMax, den = 0.0f;
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t b0 = 0; b0 < n_idx; b0 += kBlockKeys) {
        const int64_t b1 = std::min<int64_t>(b0 + kBlockKeys, n_idx);
        bool any = false;
        float block_max = kInitialMax;
        for (int64_t i = b0; i < b1; ++i) {
          if (!valid[i]) continue;
          const float* k = keys.data() + i * kHeadDim;
          float dot = 0.0f;
          for (int d = 0; d < kHeadDim; ++d) dot = num::add_rn(dot, num::mul_rn(qf[d], k[d]));
          s[i - b0] = num::mul_rn(dot, score_scale);
          block_max = any ? num::max_f(block_max, s[i - b0]) : s[i - b0];
          any = true;
        }
        if (!any) continue;
        const float m_new = num::max_f(m, block_max);
        const float corr = num::exp_f32_via_f64(num::sub_rn(m, m_new));
        float psum = 0.0f;
        std::fill(vsum.begin(), vsum.end(), 0.0f);
        for (int64_t i = b0; i < b1; ++i) {
          if (!valid[i]) continue;
          const float pi = num::exp_f32_via_f64(num::sub_rn(s[i - b0], m_new));
          psum = num::add_rn(psum, pi);
          const float pb = num::round_bf16(pi);
          const float* v = keys.data() + i * kHeadDim;
          for (int d = 0; d < kHeadDim; ++d) vsum[d] = num::add_rn(vsum[d], num::mul_rn(pb, v[d]));
        }
        den = num::add_rn(num::mul_rn(den, corr), psum);
        for (int d = 0; d < kHeadDim; ++d) acc[d] = num::add_rn(num::mul_rn(acc[d], corr), vsum[d]);
        m = m_new;
      }
      if (in.attn_sink != nullptr)
        den = num::add_rn(den, num::exp_f32_via_f64(num::sub_rn(in.attn_sink[h], m)));
      bf16_t* oh = o_row + static_cast<int64_t>(h) * kHeadDim;
      for (int d = 0; d < kHeadDim; ++d) oh[d] = num::bf16_from_f32(num::div_rn(acc[d], den));
    }
  }
}

void output_lora_a(const bf16_t* attn_out, int64_t T, int heads, int groups, const int32_t* pos,
                   const float* table, int64_t max_pos, const Bf16Matrix& wo_a, bf16_t* lora_out) {
  static constexpr const char* kFn = "output_lora_a";
  if (T < 0 || heads <= 0 || groups <= 0 || heads % groups != 0)
    fail(kFn, "need T >= 0, heads > 0 and groups dividing heads");
  const int64_t group_k = static_cast<int64_t>(heads / groups) * kHeadDim;
  if (wo_a.n <= 0 || wo_a.n % groups != 0 || wo_a.k != group_k ||
      wo_a.w.size() != static_cast<size_t>(wo_a.n * wo_a.k))
    fail(kFn, "wo_a must be [groups * o_lora_rank, (heads/groups) * 512]");
  if (T == 0) return;
  if (attn_out == nullptr || pos == nullptr || table == nullptr || lora_out == nullptr) fail(kFn, "null input");
  for (int64_t t = 0; t < T; ++t)
    if (pos[t] < 0 || pos[t] >= max_pos)
      fail(kFn, "row " + std::to_string(t) + ": position " + std::to_string(pos[t]) +
                    " outside the RoPE table [0, " + std::to_string(max_pos) + ")");

  // Inverse RoPE (c, -s) on dims 448..511 of each head, rounded to bf16, on a copy.
  const int64_t row_elems = static_cast<int64_t>(heads) * kHeadDim;
  std::vector<bf16_t> o(attn_out, attn_out + T * row_elems);
  for (int64_t t = 0; t < T; ++t) {
    const float* rope = table + static_cast<int64_t>(pos[t]) * num::kRopeDim;
    for (int h = 0; h < heads; ++h) {
      bf16_t* tail = o.data() + t * row_elems + static_cast<int64_t>(h) * kHeadDim + kRopeStart;
      for (int i = 0; i < num::kRopePairs; ++i) {
        float re, im;
        num::rope_rotate_inverse(num::f32_from_bf16(tail[2 * i]), num::f32_from_bf16(tail[2 * i + 1]),
                                 rope[2 * i], rope[2 * i + 1], re, im);
        tail[2 * i] = num::bf16_from_f32(re);
        tail[2 * i + 1] = num::bf16_from_f32(im);
      }
    }
  }
  // Group g: rows [T, group_k] starting at head g*heads/groups, times wo_a rows
  // g*rank..(g+1)*rank-1, written to lora_out columns g*rank..(g+1)*rank-1.
  const int64_t rank = wo_a.n / groups;
  Bf16Matrix wg;
  wg.n = rank;
  wg.k = group_k;
  for (int g = 0; g < groups; ++g) {
    const auto first = wo_a.w.begin() + static_cast<int64_t>(g) * rank * group_k;
    wg.w.assign(first, first + rank * group_k);
    gemm_bf16(o.data() + static_cast<int64_t>(g) * group_k, T, row_elems, wg,
              lora_out + static_cast<int64_t>(g) * rank, wo_a.n);
  }
}

void output_projection(const bf16_t* attn_out, int64_t T, int heads, int groups, const int32_t* pos,
                       const float* table, int64_t max_pos, const Bf16Matrix& wo_a, const Fp8Matrix& wo_b,
                       bf16_t* out) {
  if (wo_b.k != wo_a.n || wo_b.n <= 0)
    fail("output_projection", "wo_b must be [dim, groups * o_lora_rank] (wo_b.k == wo_a.n)");
  if (T == 0) return;
  if (out == nullptr) fail("output_projection", "null output");
  std::vector<bf16_t> lora(static_cast<size_t>(T * wo_a.n));
  output_lora_a(attn_out, T, heads, groups, pos, table, max_pos, wo_a, lora.data());
  gemm_fp8(lora.data(), T, wo_a.n, wo_b, out, wo_b.n);
}

}  // namespace v4attn::ref
