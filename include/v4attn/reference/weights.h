// Per-layer attention weights with the real shapes and dtypes (spec sections 1-4), and a
// deterministic synthetic initialiser with realistic magnitudes.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "v4attn/plan.h"
#include "v4attn/reference/gemm.h"

namespace v4attn::ref {

struct CompressorWeights {
  int ratio = 0;        // 1 or 2
  Bf16Matrix wkv_c;     // ratio 1: [512, dim] bf16
  F32Matrix wkv;        // ratio 2: [512, dim] fp32
  F32Matrix wgate;      // ratio 2: [512, dim] fp32
  std::vector<float> c_norm;  // [512]
  Bf16Matrix wk;              // [index_head_dim 128, 512] bf16
  std::vector<float> k_norm;  // [128]
};

struct IndexerWeights {
  Fp8Matrix wq_b;        // [local_index_heads * 128, q_lora_rank] fp8
  Bf16Matrix weights_proj;  // [local_index_heads, dim] bf16
};

struct LayerWeights {
  int layer = 0;
  Fp8Matrix wqkv_a;            // fused wq_a|wkv: [q_lora_rank + head_dim, dim] fp8 (rows 0..q_lora_rank-1 = wq_a)
  std::vector<float> q_norm;   // [q_lora_rank]
  Fp8Matrix wq_b;              // [local_heads * head_dim, q_lora_rank]
  std::vector<float> kv_norm;  // [head_dim]
  std::optional<CompressorWeights> compressor;  // kv sources only
  std::optional<IndexerWeights> indexer;        // index sources only
  std::vector<float> attn_sink;                 // [local_heads]
  Bf16Matrix wo_a;             // [local_groups * o_lora_rank, (n_heads/o_groups) * head_dim]
  Fp8Matrix wo_b;              // [dim, local_groups * o_lora_rank]
};

// Deterministic in (seed, layer): the same call gives the same bytes on every machine.
// Magnitudes: x ~ O(1) rows; projections scaled by 1/sqrt(K) so norms' inputs are O(1); norm
// weights around 1; no e4m3 saturation; attention scores with a spread that makes softmax
// non-trivial.
LayerWeights make_synthetic_layer_weights(const ModelPlan& plan, int layer, uint64_t seed);

// A deterministic bf16 tensor of O(scale) values (inputs x, etc.).
std::vector<num::bf16_t> synthetic_bf16(size_t n, uint64_t seed, float scale = 1.0f);

}  // namespace v4attn::ref
