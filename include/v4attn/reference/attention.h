// CPU reference of the sparse attention core with sink and the output projection (spec section 4).
#pragma once

#include <cstdint>
#include <vector>

#include "v4attn/cache_layout.h"
#include "v4attn/numerics.h"
#include "v4attn/reference/gemm.h"

namespace v4attn::ref {

using num::bf16_t;

// Dequantise one cached 512-dim vector to fp32 (exact: codes * scales, RoPE tail as stored).
void dequant_window_row(const uint8_t* cache, const CacheLayout& layout, CacheKind kind, int64_t loc, float* out512);
void dequant_compressed_row(const uint8_t* cache, const CacheLayout& layout, int64_t loc, float* out512);

struct AttentionInputs {
  int64_t T = 0;
  int heads = 0;                   // local heads
  const bf16_t* q = nullptr;       // [T, q_head_stride=H_pad, 512] padded Q (roped)
  int h_pad = 0;
  const int32_t* pos = nullptr;    // [T]
  const int32_t* req = nullptr;    // [T] (-1 padded: output zeros)
  int window = 128;
  int window_ring = 0;             // window slot of (req, p) = req*window_ring + p % window_ring
  const uint8_t* window_cache = nullptr;
  CacheLayout window_layout{};
  CacheKind window_kind = CacheKind::kWindowV41;
  const int32_t* topk = nullptr;   // [T, topk_stride] compressed slots or -1 (nullptr: none)
  int64_t topk_stride = 0;
  const uint8_t* comp_cache = nullptr;
  CacheLayout comp_layout{};
  const float* attn_sink = nullptr;  // [heads] (nullptr: no sink, i.e. attn_sink = -inf)
  // Pool sizes in slots, for range checks (a slot outside [0, n) throws); 0 = unchecked.
  int64_t window_slots = 0;
  int64_t comp_slots = 0;
};

// out [T, heads, 512] bf16: s = (q.k) * 512^-0.5 fp32; online softmax over blocks of 64 indices
// (window first, then compressed entries), running max from -1e30, p = exp(s - m) (double exp
// rounded to fp32), denominator fp32 p, numerator bf16(p) * v; sink added to the denominator as
// exp(sink - m_final); a row with no valid key gives zeros. The exact key-index list and block
// algorithm are defined in src/reference/attention.cpp (the GPU kernel mirrors it).
void sparse_attention(const AttentionInputs& in, bf16_t* out);

// Output: inverse RoPE at pos on dims 448..511 of each head (bf16), view [T, groups, heads/groups
// * 512], per group g: o_g @ wo_a[g]^T (bf16 GEMM, fp32 acc) -> [T, groups*o_lora_rank] bf16,
// then wo_b (fp8 GEMM) -> [T, dim] bf16.
void output_projection(const bf16_t* attn_out, int64_t T, int heads, int groups, const int32_t* pos,
                       const float* table, int64_t max_pos, const Bf16Matrix& wo_a,
                       const Fp8Matrix& wo_b, bf16_t* out);

// First half of output_projection, exposed for tests and dumps: inverse RoPE + the per-group
// wo_a GEMM -> lora_out [T, groups*o_lora_rank] bf16 (o_lora_rank = wo_a.n / groups).
void output_lora_a(const bf16_t* attn_out, int64_t T, int heads, int groups, const int32_t* pos,
                   const float* table, int64_t max_pos, const Bf16Matrix& wo_a, bf16_t* lora_out);

}  // namespace v4attn::ref
