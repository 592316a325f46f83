// Small kernels of the GPU prepare stack (src/prepare/stack.cpp) that are not prepare work items:
// device-side synthetic weights, inputs and prefill (for the full config, where host generation is
// too slow), and the indexer's head re-layout for fewer than 32 index heads. None of them is in the
// numerics contract: they make synthetic data (deterministic per seed on a given GPU) or move bytes.
//
// Every launcher validates its arguments (std::invalid_argument) and launches through
// v4attn::launch_kernel without PDL. Generators: z is a discretised N(0, 1) (sum of four 16-bit
// uniforms, scaled to unit variance; tails at +-3.46) drawn from splitmix64 of a per-element key.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "v4attn/cache_layout.h"
#include "v4attn/numerics.h"

namespace v4attn::prepare::detail {

// Key of one tensor of one layer (host side, mirrors nothing: device-random weights are their own).
uint64_t tensor_key(uint64_t seed, int layer, const char* name);

// fp8 weight [n, k] e4m3 codes e4m3(clamp(z * 100, -448, 448)) and ue8m0 scales
// [ceil(n/32), k/32] = 2^e or 2^(e-1) (one block in four), e = pow2ceil_exp(3.3 / sqrt(k) / 448):
// dequantised values have the spread of N(0, 1) / sqrt(k) quantised per 32x32 block.
void init_fp8_weight(uint8_t* codes, uint8_t* scales, int64_t n, int64_t k, uint64_t key, cudaStream_t stream);
// bf16 [n] = bf16(z * scale).
void init_bf16(num::bf16_t* w, int64_t n, float scale, uint64_t key, cudaStream_t stream);
// fp32 [n] = z * scale.
void init_f32(float* w, int64_t n, float scale, uint64_t key, cudaStream_t stream);
// Norm weights [n] = bf16-representable 1 + 0.2 * (u - 0.5), u uniform in [0, 1).
void init_norm(float* w, int64_t n, uint64_t key, cudaStream_t stream);

// x of every layer for one step: x_all + layer * layer_stride is layer's [rows, dim] bf16 (row
// stride dim). Live rows (req[t] >= 0): values from (seed, layer, req, pos); padded rows: from
// (seed, step, layer, t). req / pos are device arrays [rows] (the step metadata).
void generate_inputs(num::bf16_t* x_all, int64_t layer_stride, int n_layers, int rows, int dim, const int32_t* req,
                     const int32_t* pos, uint64_t seed, int64_t step, cudaStream_t stream);

// Window cache of one layer: for request q (context ctx[q], device array [n_requests]) the
// positions max(0, ctx - window) .. ctx - 1 at slot q * ring + pos % ring: 512 e4m3 codes
// e4m3(z * 128) and 16 ue8m0 scales 2^-7.
void prefill_window(uint8_t* cache, const CacheLayout& layout, int64_t n_slots, const int32_t* ctx, int n_requests,
                    int window, int ring, uint64_t key, cudaStream_t stream);
// Compressed KV + index K of one kv source (ratio r): group j < ctx[q] / r of request q at slot
// slot_table[q * table_stride + j]: e2m1 codes of z * 2.2, e4m3 scales 0x28..0x38 (KV) and ue8m0
// scales 2^-2..2^0 (index K). Slots outside [1, n_slots) are skipped.
void prefill_compressed(uint8_t* comp, const CacheLayout& comp_layout, uint8_t* index_k, const CacheLayout& index_layout,
                        int64_t n_slots, const int32_t* slot_table, int64_t table_stride, const int32_t* ctx,
                        int n_requests, int ratio, uint64_t key, cudaStream_t stream);
// Pair state [n_requests * ring, 1024]: kv 0 / score -inf, except the row of position ctx-1 of a
// request with odd ctx: z values (the parked even row).
void prefill_pair_state(float* state, const int32_t* ctx, int n_requests, int ring, uint64_t key, cudaStream_t stream);

// Indexer q of `heads` (< 32) heads, compact [T, heads, 64] codes / [T, heads, 4] scales /
// [T, heads] weights -> the 32-head layout of the scores kernel: heads >= `heads` get zero codes,
// scale bytes 127 and weight 0 (each adds exactly +0 to a score).
void pad_indexer_heads(const uint8_t* codes_in, const uint8_t* scales_in, const float* weights_in, int heads, int T,
                       uint8_t* codes_out, uint8_t* scales_out, float* weights_out, cudaStream_t stream);

}  // namespace v4attn::prepare::detail
