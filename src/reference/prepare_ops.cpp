// CPU reference of the per-row prepare ops (prepare_ops.h): RMSNorm, RoPE, the padded Q store and
// the window-K store. The compressor ops live in compressor.cpp.
//
// Every op validates all of its inputs before its first write, so a refused call leaves every
// output exactly as it was.
#include "v4attn/reference/prepare_ops.h"

#include <limits>
#include <stdexcept>
#include <string>

#include "reference/ref_internal.h"

namespace v4attn::ref {

namespace detail {

void fail(const std::string& what) { throw std::invalid_argument(what); }

void require(bool ok, const char* who, const std::string& what) {
  if (!ok) fail(std::string(who) + ": " + what);
}

void require_ptr(const void* p, const char* who, const char* name) {
  if (p == nullptr) fail(std::string(who) + ": " + name + " is null");
}

void require_positions(const int32_t* pos, int64_t n, int64_t max_pos, const char* who, const char* what) {
  for (int64_t i = 0; i < n; ++i)
    if (pos[i] < 0 || pos[i] >= max_pos)
      fail(std::string(who) + ": row " + std::to_string(i) + ": " + what + " " + std::to_string(pos[i]) +
           " is outside the RoPE table [0, " + std::to_string(max_pos) + ")");
}

void require_layout(const CacheLayout& layout, CacheKind kind, const char* who) {
  const CacheLayout want = cache_layout(kind, layout.page_size);
  if (layout.page_size <= 0 || layout.align <= 0 || layout.data_bytes != want.data_bytes ||
      layout.scale_bytes != want.scale_bytes)
    fail(std::string(who) + ": cache layout (" + std::to_string(layout.data_bytes) + " data + " +
         std::to_string(layout.scale_bytes) + " scale bytes, page " + std::to_string(layout.page_size) +
         ") is not the layout of cache kind " + std::to_string(static_cast<int>(kind)));
}

void rmsnorm_row(const num::bf16_t* x, int n, const float* w, float eps, num::bf16_t* y) {
  std::vector<float> xf(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) xf[static_cast<size_t>(i)] = num::f32_from_bf16(x[i]);
  const float r = num::rmsnorm_rstd(num::lane_sum_squares(xf.data(), n), n, eps);
  for (int i = 0; i < n; ++i) y[i] = num::rmsnorm_apply(xf[static_cast<size_t>(i)], r, w[i]);
}

void rope_tail(num::bf16_t* v, int len, const float* table_row, bool inverse) {
  num::bf16_t* tail = v + (len - num::kRopeDim);
  for (int k = 0; k < num::kRopePairs; ++k) {
    const float re = num::f32_from_bf16(tail[2 * k]), im = num::f32_from_bf16(tail[2 * k + 1]);
    const float c = table_row[2 * k], s = table_row[2 * k + 1];
    float out_re, out_im;
    if (inverse)
      num::rope_rotate_inverse(re, im, c, s, out_re, out_im);
    else
      num::rope_rotate(re, im, c, s, out_re, out_im);
    tail[2 * k] = num::bf16_from_f32(out_re);
    tail[2 * k + 1] = num::bf16_from_f32(out_im);
  }
}

}  // namespace detail

using namespace detail;

void rmsnorm_rows(const bf16_t* x, int64_t rows, int n, int64_t x_stride, const float* w, float eps, bf16_t* y,
                  int64_t y_stride) {
  const char* who = "rmsnorm_rows";
  require(rows >= 0, who, "negative row count");
  require(n > 0 && n % 8 == 0, who, "n " + std::to_string(n) + " must be a positive multiple of 8");
  require(x_stride >= n && y_stride >= n, who, "strides must be >= n");
  if (rows == 0) return;
  require_ptr(x, who, "x");
  require_ptr(w, who, "w");
  require_ptr(y, who, "y");
  for (int64_t r = 0; r < rows; ++r) rmsnorm_row(x + r * x_stride, n, w, eps, y + r * y_stride);
}

void rope_rows(bf16_t* v, int64_t rows, int heads, int head_dim, int64_t row_stride, const int32_t* pos,
               const float* table, int64_t max_pos, bool inverse) {
  const char* who = "rope_rows";
  require(rows >= 0 && heads >= 0, who, "negative row or head count");
  require(head_dim >= num::kRopeDim && head_dim % 8 == 0, who,
          "head_dim " + std::to_string(head_dim) + " must be a multiple of 8 and >= 64");
  require(row_stride >= static_cast<int64_t>(heads) * head_dim, who, "row_stride must be >= heads * head_dim");
  if (rows == 0 || heads == 0) return;
  require_ptr(v, who, "v");
  require_ptr(pos, who, "pos");
  require_ptr(table, who, "table");
  require_positions(pos, rows, max_pos, who);
  for (int64_t r = 0; r < rows; ++r)
    for (int h = 0; h < heads; ++h)
      rope_tail(v + r * row_stride + static_cast<int64_t>(h) * head_dim, head_dim,
                table + static_cast<int64_t>(pos[r]) * num::kRopeDim, inverse);
}

void q_rope_store(const bf16_t* q, int64_t T, int H, const int32_t* pos, const float* table, int64_t max_pos,
                  bf16_t* q_pad, int H_pad) {
  const char* who = "q_rope_store";
  constexpr int kHd = 512;
  require(T >= 0 && H >= 0, who, "negative row or head count");
  require(H_pad >= H, who, "H_pad " + std::to_string(H_pad) + " < H " + std::to_string(H));
  if (T == 0 || H == 0) return;
  require_ptr(q, who, "q");
  require_ptr(q_pad, who, "q_pad");
  require_ptr(pos, who, "pos");
  require_ptr(table, who, "table");
  require_positions(pos, T, max_pos, who);
  for (int64_t t = 0; t < T; ++t)
    for (int h = 0; h < H; ++h) {
      const bf16_t* src = q + (t * H + h) * kHd;
      bf16_t* dst = q_pad + (t * H_pad + h) * kHd;
      // Copy then rotate in place: the 448 nope dims pass through unchanged.
      for (int d = 0; d < kHd; ++d) dst[d] = src[d];
      rope_tail(dst, kHd, table + static_cast<int64_t>(pos[t]) * num::kRopeDim);
    }
}

int64_t window_k_store(const bf16_t* kv_raw, int64_t T, int64_t kv_stride, const float* kv_norm, float eps,
                       const int32_t* pos, const float* table, int64_t max_pos, const int32_t* swa_loc, CacheKind kind,
                       const CacheLayout& layout, uint8_t* cache, int64_t n_slots, bf16_t* kv_out) {
  const char* who = "window_k_store";
  constexpr int kHd = 512, kNope = 448;
  require(T >= 0 && n_slots >= 0, who, "negative row or slot count");
  require(kv_stride >= kHd, who, "kv_stride " + std::to_string(kv_stride) + " < 512");
  require(kind == CacheKind::kWindowV41 || kind == CacheKind::kWindowV4, who, "kind must be kWindowV41 or kWindowV4");
  require_layout(layout, kind, who);
  if (T == 0) return 0;
  require_ptr(kv_raw, who, "kv_raw");
  require_ptr(kv_norm, who, "kv_norm");
  require_ptr(pos, who, "pos");
  require_ptr(table, who, "table");
  require_ptr(swa_loc, who, "swa_loc");
  require_ptr(cache, who, "cache");
  require_positions(pos, T, max_pos, who);

  int64_t skipped = 0;
  bf16_t kv[kHd];
  for (int64_t t = 0; t < T; ++t) {
    rmsnorm_row(kv_raw + t * kv_stride, kHd, kv_norm, eps, kv);
    rope_tail(kv, kHd, table + static_cast<int64_t>(pos[t]) * num::kRopeDim);
    if (kv_out != nullptr)
      for (int d = 0; d < kHd; ++d) kv_out[t * kHd + d] = kv[d];
    const int64_t loc = swa_loc[t];
    if (loc < 0) continue;  // "no write" (e.g. a padded row)
    if (loc >= n_slots) {
      ++skipped;
      continue;
    }
    uint8_t* data = cache + layout.data_offset(loc);
    uint8_t* scales = cache + layout.scale_offset(loc);
    // V41 quantises all 512 dims (RoPE tail included) with block 32; V4 quantises the 448 nope
    // dims with block 64 and keeps the roped tail as bf16.
    const int block = kind == CacheKind::kWindowV41 ? num::kActQuantBlock : 64;
    const int quant_dims = kind == CacheKind::kWindowV41 ? kHd : kNope;
    for (int b = 0; b < quant_dims / block; ++b) {
      float amax = 0.0f;
      for (int i = 0; i < block; ++i) amax = num::block_amax_step(amax, num::f32_from_bf16(kv[b * block + i]));
      const int e = num::act_quant_scale_exp(amax);
      const float s = num::pow2_f32(e);
      for (int i = 0; i < block; ++i) data[b * block + i] = num::act_quant_code(num::f32_from_bf16(kv[b * block + i]), s);
      scales[b] = num::ue8m0_from_exp(e);
    }
    if (kind == CacheKind::kWindowV4) {
      for (int d = kNope; d < kHd; ++d) {  // bf16, little-endian
        data[kNope + 2 * (d - kNope)] = static_cast<uint8_t>(kv[d] & 0xffu);
        data[kNope + 2 * (d - kNope) + 1] = static_cast<uint8_t>(kv[d] >> 8);
      }
      scales[kNope / 64] = 0;  // the pad byte after the 7 scales
    }
  }
  return skipped;
}

void pair_state_init(float* state, int64_t state_rows) {
  require(state_rows >= 0, "pair_state_init", "negative row count");
  if (state_rows == 0) return;
  require_ptr(state, "pair_state_init", "state");
  for (int64_t r = 0; r < state_rows; ++r)
    for (int d = 0; d < 512; ++d) {
      state[r * 1024 + d] = 0.0f;
      state[r * 1024 + 512 + d] = -std::numeric_limits<float>::infinity();
    }
}

}  // namespace v4attn::ref
