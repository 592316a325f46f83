// CPU reference of multi-op chains of one layer's prepare (spec 3.1 and 3.3), built from the
// single ops of gemm.h and prepare_ops.h. The intermediate tensors are returned so that a GPU
// test can feed its kernels the very same GEMM outputs (spec section 6) and compare bytes.
#pragma once

#include <cstdint>
#include <vector>

#include "v4attn/cache_layout.h"
#include "v4attn/numerics.h"
#include "v4attn/reference/step.h"
#include "v4attn/reference/weights.h"

namespace v4attn::ref {

using num::bf16_t;

// Q chain (spec 3.1) of T rows.
struct QChainOut {
  std::vector<bf16_t> qkv_a;  // [T, q_lora_rank + 512]: fused wq_a|wkv output (fp8 GEMM); the
                              // window-K input is qkv_a + q_lora_rank with row stride qkv_a width
  std::vector<bf16_t> qr;     // [T, q_lora_rank] = RMSNorm(qkv_a[:, :q_lora_rank], q_norm)
  std::vector<bf16_t> q;      // [T, H * 512] = wq_b(qr), before RoPE
  std::vector<bf16_t> q_pad;  // [T, H_pad, 512] = q_rope_store(q); padding heads are 0 here
                              // (the store itself never writes them)
};

// x [T, dim] bf16 (row stride dim = w.wqkv_a.k). H = local heads (must equal w.wq_b.n / 512),
// H_pad >= H. table / max_pos: this layer's RoPE table. eps: norm_eps. Throws
// std::invalid_argument on bad shapes or positions.
QChainOut q_chain(const LayerWeights& w, const bf16_t* x, int64_t T, const int32_t* pos, const float* table,
                  int64_t max_pos, int H, int H_pad, float eps);

// The caches a kv-source compressor writes (n_slots / rows each cover the whole buffer).
struct CompressorCaches {
  uint8_t* comp = nullptr;      // compressed KV, kCompressedFp4 layout
  CacheLayout comp_layout = cache_layout(CacheKind::kCompressedFp4);
  int64_t comp_slots = 0;
  uint8_t* index_k = nullptr;   // index K, kIndexK layout
  CacheLayout index_k_layout = cache_layout(CacheKind::kIndexK);
  int64_t index_k_slots = 0;
  float* pair_state = nullptr;  // ratio 2 only: fp32 [pair_state_rows, 1024] (pair_state_init)
  int64_t pair_state_rows = 0;
};

struct CompressorOut {
  int ratio = 0;
  std::vector<bf16_t> proj;             // ratio 1: [T, 512] = wkv_c(x) (bf16 GEMM)
  std::vector<float> kvs;               // ratio 2: [T, 1024] = x_f32 @ [wkv; wgate]^T (fp32)
  std::vector<bf16_t> latent_pre_rope;  // [T, 512]; 0 for rows that complete no group
  std::vector<bf16_t> kproj;            // [T, 128] = wk(latent_pre_rope); 0 for rows without latent
  std::vector<int32_t> g;               // [T] group position (ratio 1: pos, ratio 2: pos - 1), or -1
  int64_t skipped = 0;                  // out-of-range compressed + index-K slots
};

// One step of a kv-source layer's compressor for the rows of `meta` (x [meta.rows, dim], row
// stride x_stride):
//  ratio 1: proj = gemm_bf16(x, wkv_c) -> c1_fused (store at c_out_loc[1]) -> kproj =
//           gemm_bf16(latent, wk) -> index_k_store at g = pos, slot c_out_loc[1];
//  ratio 2: kvs = gemm_f32(x, [wkv; wgate]) -> c2_fused (pair state rows from meta, store at
//           c_out_loc[2]) -> for the rows that complete a group (live, odd pos): kproj =
//           gemm_bf16(latent, wk) -> index_k_store at g = pos - 1, slot c_out_loc[2].
// table / max_pos: the compressed RoPE table (YaRN, compress_rope_theta). Bad input throws
// std::invalid_argument before any cache or state is written.
CompressorOut compressor_forward(const CompressorWeights& cw, const bf16_t* x, int64_t x_stride, const StepMeta& meta,
                                 const float* table, int64_t max_pos, float eps, const CompressorCaches& caches);

}  // namespace v4attn::ref
