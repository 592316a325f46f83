// Synthetic-data and re-layout kernels of the GPU prepare stack (stack_kernels.h).
#include "prepare/stack_kernels.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

#include "runtime/launch.h"

namespace v4attn::prepare::detail {

namespace {

constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ull;
constexpr int kThreads = 256;
constexpr int kMaxGrid = 4096;  // grid-stride loops: enough CTAs to fill 132 SMs many times

[[noreturn]] void fail(const char* who, const std::string& what) {
  throw std::invalid_argument(std::string(who) + ": " + what);
}

__host__ __device__ __forceinline__ uint64_t mix64(uint64_t z) {  // splitmix64
  z += kGolden;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// Element i of the stream `key`.
__device__ __forceinline__ uint64_t draw(uint64_t key, uint64_t i) { return mix64(key ^ mix64(i * kGolden + 0x5851F42D4C957F2Dull)); }

// Irwin-Hall of four 16-bit uniforms, scaled to unit variance: z in [-3.46, 3.46].
__device__ __forceinline__ float normal_from_bits(uint64_t b) {
  const uint32_t sum = static_cast<uint32_t>(b & 0xffffu) + static_cast<uint32_t>((b >> 16) & 0xffffu) +
                       static_cast<uint32_t>((b >> 32) & 0xffffu) + static_cast<uint32_t>(b >> 48);
  return (static_cast<float>(sum) * (1.0f / 65535.0f) - 2.0f) * 1.7320508f;
}

unsigned grid_for(int64_t items, int per_cta) {
  const int64_t g = (items + per_cta - 1) / per_cta;
  return static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(g, kMaxGrid)));
}

LaunchConfig config_1d(int64_t items, int per_cta, cudaStream_t stream) {
  LaunchConfig cfg;
  cfg.grid = dim3(grid_for(items, per_cta), 1, 1);
  cfg.block = dim3(kThreads, 1, 1);
  cfg.stream = stream;
  cfg.pdl = false;
  return cfg;
}

// ---- weights -------------------------------------------------------------------------------------
// Grid-stride over elements; one thread per element.
__global__ void __launch_bounds__(kThreads) init_fp8_codes_kernel(uint8_t* w, int64_t n, uint64_t key) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * kThreads) {
    const float z = normal_from_bits(draw(key, static_cast<uint64_t>(i)));
    w[i] = num::e4m3_from_f32(num::clamp_f(num::mul_rn(z, 100.0f), -num::kE4m3Max, num::kE4m3Max));
  }
}

__global__ void __launch_bounds__(kThreads) init_fp8_scales_kernel(uint8_t* s, int64_t n, uint64_t key, int e) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * kThreads)
    s[i] = num::ue8m0_from_exp((draw(key, static_cast<uint64_t>(i)) & 3u) == 0 ? e - 1 : e);
}

__global__ void __launch_bounds__(kThreads) init_bf16_kernel(num::bf16_t* w, int64_t n, float scale, uint64_t key) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * kThreads)
    w[i] = num::bf16_from_f32(num::mul_rn(normal_from_bits(draw(key, static_cast<uint64_t>(i))), scale));
}

__global__ void __launch_bounds__(kThreads) init_f32_kernel(float* w, int64_t n, float scale, uint64_t key) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * kThreads)
    w[i] = num::mul_rn(normal_from_bits(draw(key, static_cast<uint64_t>(i))), scale);
}

__global__ void __launch_bounds__(kThreads) init_norm_kernel(float* w, int64_t n, uint64_t key) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * kThreads) {
    const float u = static_cast<float>(draw(key, static_cast<uint64_t>(i)) >> 40) * (1.0f / 16777216.0f);
    w[i] = num::round_bf16(num::add_rn(1.0f, num::mul_rn(0.2f, num::sub_rn(u, 0.5f))));
  }
}

// ---- inputs ----------------------------------------------------------------------------------------
// Grid (rows, layers); one CTA writes one row of one layer.
__global__ void __launch_bounds__(kThreads) generate_inputs_kernel(num::bf16_t* x_all, int64_t layer_stride, int dim,
                                                                   const int32_t* req, const int32_t* pos, uint64_t seed,
                                                                   int64_t step) {
  const int t = static_cast<int>(blockIdx.x);
  const int layer = static_cast<int>(blockIdx.y);
  const int32_t r = req[t];
  uint64_t key;
  if (r >= 0)  // a live row: its token's hidden state, whatever step carries it
    key = mix64(mix64(seed ^ 0x78ull) ^ mix64(static_cast<uint64_t>(layer) << 40 ^ static_cast<uint64_t>(r) << 24 ^
                                              static_cast<uint64_t>(static_cast<uint32_t>(pos[t]))));
  else  // a padded row: garbage that differs per step and row
    key = mix64(mix64(seed ^ 0x9adull) ^ mix64(static_cast<uint64_t>(step) << 32 ^ static_cast<uint64_t>(layer) << 20 ^
                                               static_cast<uint64_t>(t)));
  num::bf16_t* row = x_all + static_cast<int64_t>(layer) * layer_stride + static_cast<int64_t>(t) * dim;
  for (int c = threadIdx.x; c < dim; c += kThreads)
    row[c] = num::bf16_from_f32(normal_from_bits(draw(key, static_cast<uint64_t>(c))));
}

// ---- prefill ---------------------------------------------------------------------------------------
// One warp per (request, window position); 8 warps per CTA, grid-stride over the items.
__global__ void __launch_bounds__(kThreads) prefill_window_kernel(uint8_t* cache, CacheLayout layout, int64_t n_slots,
                                                                  const int32_t* ctx, int n_requests, int window, int ring,
                                                                  uint64_t key) {
  const int lane = threadIdx.x % 32;
  const int64_t items = static_cast<int64_t>(n_requests) * window;
  for (int64_t it = static_cast<int64_t>(blockIdx.x) * (kThreads / 32) + threadIdx.x / 32; it < items;
       it += static_cast<int64_t>(gridDim.x) * (kThreads / 32)) {
    const int q = static_cast<int>(it / window), i = static_cast<int>(it % window);
    const int32_t c = ctx[q];
    const int32_t first = c > window ? c - window : 0;
    const int32_t p = first + i;
    if (p >= c) continue;
    const int64_t slot = static_cast<int64_t>(q) * ring + p % ring;
    if (slot < 0 || slot >= n_slots) continue;
    const uint64_t k = mix64(key ^ mix64(static_cast<uint64_t>(q) << 32 ^ static_cast<uint64_t>(p)));
    uint8_t* data = cache + layout.data_offset(slot);
    uint32_t words[4];
    for (int w = 0; w < 4; ++w) {
      uint32_t v = 0;
      for (int b = 0; b < 4; ++b) {
        const float z = normal_from_bits(draw(k, static_cast<uint64_t>(lane * 16 + w * 4 + b)));
        v |= static_cast<uint32_t>(num::e4m3_from_f32(num::clamp_f(num::mul_rn(z, 128.0f), -num::kE4m3Max, num::kE4m3Max)))
             << (8 * b);
      }
      words[w] = v;
    }
    *reinterpret_cast<uint4*>(data + 16 * lane) = make_uint4(words[0], words[1], words[2], words[3]);
    if (lane < 16) cache[layout.scale_offset(slot) + lane] = num::ue8m0_from_exp(-7);
  }
}

// One warp per (request, group); grid-stride over request * max_groups.
__global__ void __launch_bounds__(kThreads) prefill_compressed_kernel(uint8_t* comp, CacheLayout comp_layout,
                                                                      uint8_t* index_k, CacheLayout index_layout,
                                                                      int64_t n_slots, const int32_t* slot_table,
                                                                      int64_t table_stride, const int32_t* ctx,
                                                                      int n_requests, int ratio, uint64_t key) {
  const int lane = threadIdx.x % 32;
  const int64_t items = static_cast<int64_t>(n_requests) * table_stride;
  for (int64_t it = static_cast<int64_t>(blockIdx.x) * (kThreads / 32) + threadIdx.x / 32; it < items;
       it += static_cast<int64_t>(gridDim.x) * (kThreads / 32)) {
    const int q = static_cast<int>(it / table_stride);
    const int64_t j = it % table_stride;
    if (j >= ctx[q] / ratio) continue;
    const int64_t slot = slot_table[static_cast<int64_t>(q) * table_stride + j];
    if (slot <= 0 || slot >= n_slots) continue;
    const uint64_t k = mix64(key ^ mix64(static_cast<uint64_t>(q) << 40 ^ static_cast<uint64_t>(j)));
    // Compressed KV: 512 e2m1 values (256 bytes, 8 per lane) + 32 e4m3 scales (one per lane).
    uint8_t bytes[8];
    for (int b = 0; b < 8; ++b) {
      const int e0 = 2 * (lane * 8 + b);
      const uint8_t lo = num::e2m1_from_f32(num::mul_rn(normal_from_bits(draw(k, static_cast<uint64_t>(e0))), 2.2f));
      const uint8_t hi = num::e2m1_from_f32(num::mul_rn(normal_from_bits(draw(k, static_cast<uint64_t>(e0 + 1))), 2.2f));
      bytes[b] = num::pack_e2m1(lo, hi);
    }
    uint8_t* cd = comp + comp_layout.data_offset(slot) + 8 * lane;
    for (int b = 0; b < 8; ++b) cd[b] = bytes[b];
    comp[comp_layout.scale_offset(slot) + lane] = static_cast<uint8_t>(0x28 + draw(k, 1000u + lane) % 17);
    // Index K: 128 e2m1 values (64 bytes, 2 per lane) + 4 ue8m0 scales (lanes 0..3).
    uint8_t* id = index_k + index_layout.data_offset(slot) + 2 * lane;
    for (int b = 0; b < 2; ++b) {
      const int e0 = 2 * (lane * 2 + b);
      const uint8_t lo = num::e2m1_from_f32(num::mul_rn(normal_from_bits(draw(k, 2000u + e0)), 2.2f));
      const uint8_t hi = num::e2m1_from_f32(num::mul_rn(normal_from_bits(draw(k, 2001u + e0)), 2.2f));
      id[b] = num::pack_e2m1(lo, hi);
    }
    if (lane < 4)
      index_k[index_layout.scale_offset(slot) + lane] = num::ue8m0_from_exp(-static_cast<int>(draw(k, 3000u + lane) % 3));
  }
}

// Grid-stride over the state's elements.
__global__ void __launch_bounds__(kThreads) prefill_pair_state_kernel(float* state, const int32_t* ctx, int n_requests,
                                                                      int ring, uint64_t key) {
  constexpr int kRow = 1024;
  const int64_t n = static_cast<int64_t>(n_requests) * ring * kRow;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * kThreads) {
    const int64_t row = i / kRow;
    const int d = static_cast<int>(i % kRow);
    const int q = static_cast<int>(row / ring), s = static_cast<int>(row % ring);
    const int32_t c = ctx[q];
    float v;
    if (c % 2 == 1 && s == (c - 1) % ring)
      v = normal_from_bits(draw(mix64(key ^ static_cast<uint64_t>(q)), static_cast<uint64_t>(d)));
    else
      v = d < kRow / 2 ? 0.0f : num::f32_from_bits(0xff800000u);  // kv 0, score -inf
    state[i] = v;
  }
}

// ---- indexer heads -----------------------------------------------------------------------------------
// Grid T, 128 threads: thread i copies 16-byte code chunk i (head i/4), scale byte i, weight i < 32.
constexpr int kPadThreads = 128;
__global__ void __launch_bounds__(kPadThreads) pad_indexer_heads_kernel(const uint8_t* codes_in, const uint8_t* scales_in,
                                                                        const float* weights_in, int heads,
                                                                        uint8_t* codes_out, uint8_t* scales_out,
                                                                        float* weights_out) {
  const int64_t t = blockIdx.x;
  const int i = threadIdx.x;
  const int h = i / 4, part = i % 4;
  uint4 chunk = make_uint4(0u, 0u, 0u, 0u);
  uint8_t scale = 127;
  if (h < heads) {
    chunk = *reinterpret_cast<const uint4*>(codes_in + (t * heads + h) * 64 + part * 16);
    scale = scales_in[(t * heads + h) * 4 + part];
  }
  *reinterpret_cast<uint4*>(codes_out + (t * 32 + h) * 64 + part * 16) = chunk;
  scales_out[(t * 32 + h) * 4 + part] = scale;
  if (i < 32) weights_out[t * 32 + i] = i < heads ? weights_in[t * heads + i] : 0.0f;
}

}  // namespace

uint64_t tensor_key(uint64_t seed, int layer, const char* name) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (const char* c = name; *c; ++c) {
    h ^= static_cast<uint8_t>(*c);
    h *= 0x100000001b3ull;
  }
  return mix64(mix64(seed + kGolden) ^ mix64(static_cast<uint64_t>(static_cast<int64_t>(layer)) * kGolden + 0xD1B54A32D192ED03ull) ^ h);
}

void init_fp8_weight(uint8_t* codes, uint8_t* scales, int64_t n, int64_t k, uint64_t key, cudaStream_t stream) {
  const char* who = "init_fp8_weight";
  if (n <= 0 || k <= 0 || k % 32 != 0) fail(who, "need n > 0 and k a positive multiple of 32");
  if (!codes || !scales) fail(who, "null pointer");
  const float amax = static_cast<float>(3.3 / std::sqrt(static_cast<double>(k)));
  const int e = num::pow2ceil_exp(amax * (1.0f / 448.0f));
  const int64_t n_scales = (n + 31) / 32 * (k / 32);
  launch_kernel("init_fp8_codes", init_fp8_codes_kernel, config_1d(n * k, kThreads, stream), codes, n * k, key);
  launch_kernel("init_fp8_scales", init_fp8_scales_kernel, config_1d(n_scales, kThreads, stream), scales, n_scales,
                mix64(key ^ 0x5ca1eull), e);
}

void init_bf16(num::bf16_t* w, int64_t n, float scale, uint64_t key, cudaStream_t stream) {
  if (n <= 0 || !w) fail("init_bf16", "need n > 0 and a pointer");
  launch_kernel("init_bf16", init_bf16_kernel, config_1d(n, kThreads, stream), w, n, scale, key);
}

void init_f32(float* w, int64_t n, float scale, uint64_t key, cudaStream_t stream) {
  if (n <= 0 || !w) fail("init_f32", "need n > 0 and a pointer");
  launch_kernel("init_f32", init_f32_kernel, config_1d(n, kThreads, stream), w, n, scale, key);
}

void init_norm(float* w, int64_t n, uint64_t key, cudaStream_t stream) {
  if (n <= 0 || !w) fail("init_norm", "need n > 0 and a pointer");
  launch_kernel("init_norm", init_norm_kernel, config_1d(n, kThreads, stream), w, n, key);
}

void generate_inputs(num::bf16_t* x_all, int64_t layer_stride, int n_layers, int rows, int dim, const int32_t* req,
                     const int32_t* pos, uint64_t seed, int64_t step, cudaStream_t stream) {
  const char* who = "generate_inputs";
  if (rows <= 0 || rows > 65535 || n_layers <= 0 || n_layers > 65535 || dim <= 0) fail(who, "bad rows, layers or dim");
  if (layer_stride < static_cast<int64_t>(rows) * dim) fail(who, "layer_stride < rows * dim");
  if (!x_all || !req || !pos) fail(who, "null pointer");
  LaunchConfig cfg;
  cfg.grid = dim3(static_cast<unsigned>(rows), static_cast<unsigned>(n_layers), 1);
  cfg.block = dim3(kThreads, 1, 1);
  cfg.stream = stream;
  launch_kernel("generate_inputs", generate_inputs_kernel, cfg, x_all, layer_stride, dim, req, pos, seed, step);
}

void prefill_window(uint8_t* cache, const CacheLayout& layout, int64_t n_slots, const int32_t* ctx, int n_requests,
                    int window, int ring, uint64_t key, cudaStream_t stream) {
  const char* who = "prefill_window";
  if (layout.data_bytes != 512 || layout.scale_bytes != 16) fail(who, "not the V41 window layout");
  if (n_requests <= 0 || window <= 0 || ring < window) fail(who, "bad request count, window or ring");
  if (n_slots < static_cast<int64_t>(n_requests) * ring) fail(who, "cache has fewer slots than requests * ring");
  if (!cache || !ctx) fail(who, "null pointer");
  launch_kernel("prefill_window", prefill_window_kernel,
                config_1d(static_cast<int64_t>(n_requests) * window, kThreads / 32, stream), cache, layout, n_slots,
                ctx, n_requests, window, ring, key);
}

void prefill_compressed(uint8_t* comp, const CacheLayout& comp_layout, uint8_t* index_k, const CacheLayout& index_layout,
                        int64_t n_slots, const int32_t* slot_table, int64_t table_stride, const int32_t* ctx,
                        int n_requests, int ratio, uint64_t key, cudaStream_t stream) {
  const char* who = "prefill_compressed";
  if (comp_layout.data_bytes != 256 || comp_layout.scale_bytes != 32) fail(who, "not the V41_FP4 layout");
  if (index_layout.data_bytes != 64 || index_layout.scale_bytes != 4) fail(who, "not the index-K layout");
  if (ratio != 1 && ratio != 2) fail(who, "ratio must be 1 or 2");
  if (n_requests <= 0 || table_stride <= 0 || n_slots <= 0) fail(who, "bad sizes");
  if (!comp || !index_k || !slot_table || !ctx) fail(who, "null pointer");
  launch_kernel("prefill_compressed", prefill_compressed_kernel,
                config_1d(static_cast<int64_t>(n_requests) * table_stride, kThreads / 32, stream), comp, comp_layout,
                index_k, index_layout, n_slots, slot_table, table_stride, ctx, n_requests, ratio, key);
}

void prefill_pair_state(float* state, const int32_t* ctx, int n_requests, int ring, uint64_t key, cudaStream_t stream) {
  if (n_requests <= 0 || ring <= 0 || !state || !ctx) fail("prefill_pair_state", "bad sizes or null pointer");
  launch_kernel("prefill_pair_state", prefill_pair_state_kernel,
                config_1d(static_cast<int64_t>(n_requests) * ring * 1024, kThreads, stream), state, ctx, n_requests,
                ring, key);
}

void pad_indexer_heads(const uint8_t* codes_in, const uint8_t* scales_in, const float* weights_in, int heads, int T,
                       uint8_t* codes_out, uint8_t* scales_out, float* weights_out, cudaStream_t stream) {
  const char* who = "pad_indexer_heads";
  if (heads < 1 || heads > 32) fail(who, "heads must be 1..32");
  if (T < 0) fail(who, "negative T");
  if (T == 0) return;
  if (!codes_in || !scales_in || !weights_in || !codes_out || !scales_out || !weights_out) fail(who, "null pointer");
  if (reinterpret_cast<uintptr_t>(codes_in) % 16 != 0 || reinterpret_cast<uintptr_t>(codes_out) % 16 != 0)
    fail(who, "code buffers must be 16-byte aligned");
  LaunchConfig cfg;
  cfg.grid = dim3(static_cast<unsigned>(T), 1, 1);
  cfg.block = dim3(kPadThreads, 1, 1);
  cfg.stream = stream;
  launch_kernel("pad_indexer_heads", pad_indexer_heads_kernel, cfg, codes_in, scales_in, weights_in, heads, codes_out,
                scales_out, weights_out);
}

}  // namespace v4attn::prepare::detail
