// Device and host helpers shared by the prepare kernels (q_rope_store.cu, window_k.cu,
// compressor.cu, index_k.cu) and rmsnorm.cu. Every numeric step is a numerics.h primitive,
// applied in the same order as the CPU reference (src/reference/), so the bytes agree.
//
// Two conventions. The small-T prepare kernels (window-K, c1, c2, index-K) give each thread one
// pair of elements (see "pair-per-thread kernels" below). The chunk helpers serve q_rope_store and
// rmsnorm.cu, and the warp-per-row convention they were written for: lane l owns the LaneSum
// chunks of its row, i.e. dims [8l, 8l+8) and, for 512-wide rows, [256+8l, 256+8l+8) (chunk c ->
// lane c % 32). So the per-lane sum of squares runs chunk l then chunk l+32, each in element
// order, and the warp butterfly (dev::warp_lane_sum) finishes the LaneSum exactly as
// num::lane_sum_squares does. Quantization blocks are 2 (block 16), 4 (block 32) or 8 (block 64)
// consecutive lanes' chunks; their amax is combined with xor shuffles inside that lane group (max
// is order-free).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "kernels/device_common.cuh"
#include "v4attn/cache_layout.h"
#include "v4attn/numerics.h"

namespace v4attn::kernels::detail {

using num::bf16_t;

constexpr int kChunk = 8;          // LaneSum chunk: 8 values = one 16-byte bf16 vector
constexpr unsigned kFullMask = 0xffffffffu;

// ---- a paged row store's verdict from its step metadata ------------------------------------------
// The window-K and index-K stores (and the fused compressor tail, which runs the wk GEMM only for rows
// the index-K store writes): the row has no slot (loc < first_slot: nothing to do, the reference
// computes nothing either); its slot is past the pool or its position outside the RoPE table (the
// reference refuses those on the host; here the row is skipped and counted once); or it is written.
enum class PagedRow : int { kWrite, kNoSlot, kCounted };
__device__ __forceinline__ PagedRow paged_row_verdict(int32_t loc, int32_t first_slot, int64_t n_slots, int32_t pos,
                                                      int64_t max_pos) {
  if (loc < first_slot) return PagedRow::kNoSlot;
  if (loc >= n_slots || pos < 0 || pos >= max_pos) return PagedRow::kCounted;
  return PagedRow::kWrite;
}

// ---- loads and stores of one chunk ---------------------------------------------------------------
// Plain (coherent) loads for data a PDL predecessor may write: never the read-only path there.
__device__ __forceinline__ void unpack_bf16x8(const uint4& v, float (&x)[kChunk]) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    x[2 * i] = num::f32_from_bf16(static_cast<bf16_t>(w[i] & 0xffffu));
    x[2 * i + 1] = num::f32_from_bf16(static_cast<bf16_t>(w[i] >> 16));
  }
}
__device__ __forceinline__ void load_bf16x8(const bf16_t* p, float (&x)[kChunk]) {
  unpack_bf16x8(*reinterpret_cast<const uint4*>(p), x);
}
// x holds bf16-exact values (each already rounded); packs their bf16 bits, even element low.
__device__ __forceinline__ uint4 pack_bf16x8(const float (&x)[kChunk]) {
  uint32_t w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
    w[i] = static_cast<uint32_t>(num::bf16_from_f32(x[2 * i])) |
           (static_cast<uint32_t>(num::bf16_from_f32(x[2 * i + 1])) << 16);
  return make_uint4(w[0], w[1], w[2], w[3]);
}
// One 16-byte global store. Written out because nvcc scalarises a uint4 store whose value comes
// from two branches (q_rope_store's copy and rotate paths) into four 4-byte stores.
__device__ __forceinline__ void st_global_v4(void* p, const uint4& v) {
#if defined(__CUDA_ARCH__)
  asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
#else
  *static_cast<uint4*>(p) = v;  // host compilation pass only
#endif
}
__device__ __forceinline__ void store_bf16x8(bf16_t* p, const float (&x)[kChunk]) {
  *reinterpret_cast<uint4*>(p) = pack_bf16x8(x);
}
__device__ __forceinline__ void load_f32x8(const float* p, float (&x)[kChunk]) {
  const float4 a = reinterpret_cast<const float4*>(p)[0];
  const float4 b = reinterpret_cast<const float4*>(p)[1];
  x[0] = a.x; x[1] = a.y; x[2] = a.z; x[3] = a.w;
  x[4] = b.x; x[5] = b.y; x[6] = b.z; x[7] = b.w;
}
__device__ __forceinline__ void store_f32x8(float* p, const float (&x)[kChunk]) {
  reinterpret_cast<float4*>(p)[0] = make_float4(x[0], x[1], x[2], x[3]);
  reinterpret_cast<float4*>(p)[1] = make_float4(x[4], x[5], x[6], x[7]);
}
// Read-only path: only for constants nobody writes during the step (norm weights, RoPE tables).
__device__ __forceinline__ void ldg_f32x8(const float* p, float (&x)[kChunk]) {
  const float4 a = __ldg(reinterpret_cast<const float4*>(p));
  const float4 b = __ldg(reinterpret_cast<const float4*>(p) + 1);
  x[0] = a.x; x[1] = a.y; x[2] = a.z; x[3] = a.w;
  x[4] = b.x; x[5] = b.y; x[6] = b.z; x[7] = b.w;
}

// ---- RMSNorm pieces ----------------------------------------------------------------------------
// This lane's part of the LaneSum: its chunks in order, each chunk's terms in order.
template <int kChunks>
__device__ __forceinline__ float lane_sum_squares_part(const float (&x)[kChunks][kChunk]) {
  float acc = 0.0f;
#pragma unroll
  for (int c = 0; c < kChunks; ++c)
#pragma unroll
    for (int k = 0; k < kChunk; ++k) acc = num::add_rn(acc, num::mul_rn(x[c][k], x[c][k]));
  return acc;
}

// ---- the elementwise steps on one pair, and on one chunk pair by pair ---------------------------
// x <- bf16(w * (x * r)) for one pair, kept as the (exact) float values of the bf16s:
// num::rmsnorm_apply's products, rounded as a pair by num::bf16x2_from_f32_arith (they are device
// arithmetic; a NaN stays a NaN, and is stored as bf16_from_f32 stores it).
__device__ __forceinline__ void rmsnorm_apply_pair(float& x0, float& x1, float r, float2 w) {
  x0 = num::rmsnorm_product(x0, r, w.x);
  x1 = num::rmsnorm_product(x1, r, w.y);
  num::round_bf16_pair_arith(x0, x1);
}
// RoPE of one (re, im) pair with its table entry (cos, sin), rounded to bf16 (= rope_chunk's step).
__device__ __forceinline__ void rope_pair(float& x0, float& x1, float2 cs) {
  float re, im;
  num::rope_rotate(x0, x1, cs.x, cs.y, re, im);
  num::round_bf16_pair_arith(re, im);  // rope_rotate's results: device arithmetic
  x0 = re;
  x1 = im;
}
// x <- bf16(w * (x * r)) for one chunk.
__device__ __forceinline__ void rmsnorm_apply_chunk(float (&x)[kChunk], float r, const float (&w)[kChunk]) {
#pragma unroll
  for (int k = 0; k < kChunk; k += 2) rmsnorm_apply_pair(x[k], x[k + 1], r, make_float2(w[k], w[k + 1]));
}
// RoPE on one chunk: 4 (re, im) pairs with their 8 table floats (c0, s0, c1, s1, ...).
__device__ __forceinline__ void rope_chunk(float (&x)[kChunk], const float (&cs)[kChunk]) {
#pragma unroll
  for (int j = 0; j < 4; ++j) rope_pair(x[2 * j], x[2 * j + 1], make_float2(cs[2 * j], cs[2 * j + 1]));
}

// The amax of an aligned group of kLanes lanes' amaxes (xor offsets 1 .. kLanes/2; num::block_amax_step,
// whose amax operand is never NaN or -0). All 32 lanes must call it.
template <int kLanes>
__device__ __forceinline__ float lane_group_amax(float v) {
  static_assert(kLanes >= 1 && kLanes <= 32 && (kLanes & (kLanes - 1)) == 0, "power-of-two lane group");
#pragma unroll
  for (int off = 1; off < kLanes; off <<= 1) v = num::block_amax_step(v, __shfl_xor_sync(kFullMask, v, off));
  return v;
}

// ---- block amax over a group of kLanes consecutive lanes (each holding one chunk) -------------
// Starts from 0 like the reference; max is exact and order-free, so the xor combine inside the
// aligned lane group gives the block's amax on every lane of the group. All 32 lanes must call it.
template <int kLanes>
__device__ __forceinline__ float group_amax(const float (&x)[kChunk]) {
  float amax = 0.0f;
  // A tree of the 8 steps (max is exact and order-free): 3 dependent FMNMX instead of 8.
  float m[kChunk / 2];
#pragma unroll
  for (int k = 0; k < kChunk / 2; ++k) m[k] = num::block_amax_step(num::block_amax_step(amax, x[2 * k]), x[2 * k + 1]);
  amax = num::block_amax_step(num::block_amax_step(m[0], m[1]), num::block_amax_step(m[2], m[3]));
  return lane_group_amax<kLanes>(amax);
}

// act_quant_chunk's division path (an infinite or NaN amax only): out of line, so that the code
// every caller runs stays short (these kernels run once per launch with a cold instruction cache).
struct Chunk8 {
  float v[kChunk];
};
__device__ __noinline__ inline uint2 act_quant_chunk_by_division(Chunk8 x, int scale_exp) {
  const float s = num::pow2_f32(scale_exp);
  uint32_t w[2] = {0u, 0u};
#pragma unroll
  for (int k = 0; k < kChunk; ++k) w[k / 4] |= static_cast<uint32_t>(num::act_quant_code(x.v[k], s)) << (8 * (k % 4));
  return make_uint2(w[0], w[1]);
}
// FP8 act quant of one chunk whose block spans kLanes lanes: returns the 8 e4m3 codes (byte k =
// element k) and the block's scale exponent.
template <int kLanes>
__device__ __forceinline__ uint2 act_quant_chunk(const float (&x)[kChunk], int& scale_exp) {
  scale_exp = num::act_quant_scale_exp(group_amax<kLanes>(x));
  uint32_t w[2] = {0u, 0u};
  const float inv = num::act_quant_inv_scale(scale_exp);  // the test once per chunk, not per element
  if (inv != 0.0f) {
#pragma unroll
    for (int k = 0; k < kChunk; k += 2) w[k / 4] |= static_cast<uint32_t>(num::act_quant_code2_by_inv(x[k], x[k + 1], inv)) << (8 * (k % 4));
  } else {
    return act_quant_chunk_by_division(Chunk8{{x[0], x[1], x[2], x[3], x[4], x[5], x[6], x[7]}}, scale_exp);
  }
  return make_uint2(w[0], w[1]);
}

// 8 e2m1 codes of one chunk packed into 4 bytes (byte i = elements 2i (low nibble), 2i+1).
__device__ __forceinline__ uint32_t fp4_pack_chunk(const float (&x)[kChunk], float s) {
  uint32_t packed = 0u;
#pragma unroll
  for (int i = 0; i < 4; ++i)
    packed |= static_cast<uint32_t>(num::pack_e2m1(num::fp4_code(x[2 * i], s), num::fp4_code(x[2 * i + 1], s)))
              << (8 * i);
  return packed;
}

// FP4 KV quant (block 16 = two lanes' chunks, e4m3 scale): codes and the scale byte.
__device__ __forceinline__ uint32_t kv_fp4_quant_chunk(const float (&x)[kChunk], uint8_t& scale_byte) {
  scale_byte = num::kv_fp4_scale_byte(group_amax<2>(x));
  return fp4_pack_chunk(x, num::f32_from_e4m3(scale_byte));
}

// FP4 indexer quant (block 32 = four lanes' chunks, ue8m0 scale): codes and the scale exponent.
__device__ __forceinline__ uint32_t indexer_fp4_quant_chunk(const float (&x)[kChunk], int& scale_exp) {
  scale_exp = num::indexer_quant_scale_exp(group_amax<4>(x));
  return fp4_pack_chunk(x, num::pow2_f32(scale_exp));
}

// The V41_FP4 compressed-KV store of one 512-dim roped latent held warp-wide (lane l: chunks l
// and l+32): 256 code bytes (lane l writes bytes [4l, 4l+4) and [128+4l, 128+4l+4)), 32 e4m3
// scales (block b = elements [16b, 16b+16): chunk 0 of lanes 2b, 2b+1 for b < 16, chunk 1 of
// lanes 2(b-16), 2(b-16)+1 above). All 32 lanes of the warp must call it (shuffles).
__device__ __forceinline__ void store_latent_fp4(const float (&x)[2][kChunk], int lane, const CacheLayout& layout,
                                                 uint8_t* cache, int64_t loc) {
  uint8_t sc[2];
  const uint32_t codes0 = kv_fp4_quant_chunk(x[0], sc[0]);
  const uint32_t codes1 = kv_fp4_quant_chunk(x[1], sc[1]);
  uint8_t* data = cache + layout.data_offset(loc);
  uint8_t* scales = cache + layout.scale_offset(loc);
  *reinterpret_cast<uint32_t*>(data + 4 * lane) = codes0;
  *reinterpret_cast<uint32_t*>(data + 128 + 4 * lane) = codes1;
  if ((lane & 1) == 0) {
    scales[lane / 2] = sc[0];
    scales[16 + lane / 2] = sc[1];
  }
}

// ---- pair-per-thread kernels (c1, c2, window-K, index-K) ------------------------------------------
// At small T a row walked by one warp leaves the GPU idle behind long per-lane chains of exact
// numerics. These kernels give each thread ONE pair of consecutive elements (2j, 2j+1) of a row:
// one RoPE (re, im) pair, one e2m1 code byte, two e4m3 codes. A quantization block of B elements
// is B/2 consecutive threads, aligned inside a warp (B/2 divides 32), so its amax is an xor
// shuffle max over that lane group (max is exact and order-free).
// The RMSNorm sum of squares is NOT split that way: every warp that needs it computes the whole
// row's sum itself in the LaneSum order (warp_row_sum_squares: lane l sums chunks l, l+32, ... of
// the row, then dev::warp_lane_sum), i.e. exactly num::lane_sum_squares. The redundant reads (one
// row per warp, a few hundred bytes to 1 KB, L1/L2 hits) cost less than a shared-memory hand-off
// and a barrier, and they let the warps of one row live in different CTAs.

// Two bf16 values at p (4-byte aligned), plain coherent load.
__device__ __forceinline__ void load_bf16x2(const bf16_t* p, float& x0, float& x1) {
  const uint32_t w = *reinterpret_cast<const uint32_t*>(p);
  x0 = num::f32_from_bf16(static_cast<bf16_t>(w & 0xffffu));
  x1 = num::f32_from_bf16(static_cast<bf16_t>(w >> 16));
}
// The bf16 bits of two bf16-exact values, even element low.
__device__ __forceinline__ uint32_t pack_bf16x2(float x0, float x1) {
  return static_cast<uint32_t>(num::bf16_from_f32(x0)) | (static_cast<uint32_t>(num::bf16_from_f32(x1)) << 16);
}
// Two constant floats at p (8-byte aligned) through the read-only path (norm weights, RoPE tables).
__device__ __forceinline__ float2 ldg_f32x2(const float* p) { return __ldg(reinterpret_cast<const float2*>(p)); }

// The LaneSum of the squares of the bf16 row's n_chunks chunks (n_chunks <= 32 * kMaxPerLane),
// computed by the calling warp alone (all 32 lanes must call it; every lane gets the total): lane
// l sums its chunks l, l + 32, ... in order, all loads issued before the first add, then
// dev::warp_lane_sum. Lanes past the row add nothing, which equals num::lane_sum_squares' zero
// partials bit for bit (a sum of squares starts at +0 and adding +0 leaves it unchanged).
// rmsnorm.cu's warp 0 and the wq_b GEMM's fused q_norm (n_chunks at run time), and through
// warp_row_sum_squares<kN> the prepare kernels' rows of a compile-time width.
template <int kMaxPerLane>
__device__ __forceinline__ float warp_row_sum_squares_n(const bf16_t* row, int n_chunks, int lane) {
  float u[kMaxPerLane][kChunk];
#pragma unroll
  for (int i = 0; i < kMaxPerLane; ++i)
    if (lane + num::kLaneSumLanes * i < n_chunks) load_bf16x8(row + (lane + num::kLaneSumLanes * i) * kChunk, u[i]);
  float acc = 0.0f;
#pragma unroll
  for (int i = 0; i < kMaxPerLane; ++i)
    if (lane + num::kLaneSumLanes * i < n_chunks)
#pragma unroll
      for (int k = 0; k < kChunk; ++k) acc = num::add_rn(acc, num::mul_rn(u[i][k], u[i][k]));
  return dev::warp_lane_sum(acc);
}
// The same for the bf16 row[0, kN) of a compile-time width.
template <int kN>
__device__ __forceinline__ float warp_row_sum_squares(const bf16_t* row, int lane) {
  constexpr int kChunks = kN / kChunk;
  static_assert(kN % kChunk == 0 && (kChunks % num::kLaneSumLanes == 0 || kChunks < num::kLaneSumLanes),
                "whole chunks, every lane the same number of them or lanes past the row idle");
  return warp_row_sum_squares_n<(kChunks + num::kLaneSumLanes - 1) / num::kLaneSumLanes>(row, kChunks, lane);
}

// amax of one pair, from 0 like the reference's block loop.
__device__ __forceinline__ float pair_amax(float x0, float x1) {
  return num::block_amax_step(num::block_amax_step(0.0f, x0), x1);
}
// The e2m1 code byte of one pair at scale s (even element in the low nibble).
__device__ __forceinline__ uint8_t fp4_code_pair(float x0, float x1, float s) {
  return num::pack_e2m1(num::fp4_code(x0, s), num::fp4_code(x1, s));
}
// The two e4m3 codes of one pair at the act quant scale 2^e, element 0 in the low byte.
__device__ __forceinline__ uint16_t act_quant_code_pair(float x0, float x1, int e) {
  const float inv = num::act_quant_inv_scale(e);  // see num::act_quant_code_by_inv
  if (inv != 0.0f) return num::act_quant_code2_by_inv(x0, x1, inv);
  const float s = num::pow2_f32(e);
  return static_cast<uint16_t>(static_cast<uint32_t>(num::act_quant_code(x0, s)) |
                               (static_cast<uint32_t>(num::act_quant_code(x1, s)) << 8));
}

// ---- host-side argument checks (throw std::invalid_argument, nothing launched) ---------------
inline void require(bool ok, const char* who, const std::string& what) {
  if (!ok) throw std::invalid_argument(std::string(who) + ": " + what);
}
inline void require_ptr(const void* p, const char* who, const char* name) {
  require(p != nullptr, who, std::string(name) + " is null");
}
inline void require_aligned(const void* p, size_t bytes, const char* who, const char* name) {
  require(reinterpret_cast<uintptr_t>(p) % bytes == 0, who,
          std::string(name) + " must be " + std::to_string(bytes) + "-byte aligned");
}
// The layout has kind's per-token sizes and a positive page size; the cache base is 16-byte
// aligned so that the vector stores of every slot are aligned (page sizes are multiples of 16 for
// the window and compressed layouts; index-K slots need 4).
inline void require_cache(const CacheLayout& layout, CacheKind kind, const uint8_t* cache, int64_t n_slots,
                          const char* who) {
  const CacheLayout want = cache_layout(kind, layout.page_size > 0 ? layout.page_size : 1);
  require(layout.page_size > 0 && layout.data_bytes == want.data_bytes && layout.scale_bytes == want.scale_bytes &&
              layout.align == want.align,
          who,
          "cache layout (" + std::to_string(layout.data_bytes) + " data + " + std::to_string(layout.scale_bytes) +
              " scale bytes, align " + std::to_string(layout.align) + ", page " + std::to_string(layout.page_size) +
              ") is not cache_layout(kind " + std::to_string(static_cast<int>(kind)) + ", page)");
  require(n_slots > 0, who, "n_slots must be > 0");
  require_ptr(cache, who, "cache");
  require_aligned(cache, 16, who, "cache");
}
inline void require_table(const float* table, int64_t max_pos, const char* who) {
  require_ptr(table, who, "table");
  require_aligned(table, 16, who, "table");
  require(max_pos > 0, who, "max_pos must be > 0");
}

}  // namespace v4attn::kernels::detail
