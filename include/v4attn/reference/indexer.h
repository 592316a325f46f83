// CPU reference of the lightning indexer and top-k (spec section 3.4).
#pragma once

#include <cstdint>
#include <vector>

#include "v4attn/cache_layout.h"
#include "v4attn/numerics.h"

namespace v4attn::ref {

using num::bf16_t;

// Packed FP4 indexer queries: per row and head, 128 values = 64 bytes of e2m1 pairs + 4 ue8m0.
struct IndexerQ {
  int64_t T = 0;
  int heads = 0;
  std::vector<uint8_t> codes;   // [T, heads, 64]
  std::vector<uint8_t> scales;  // [T, heads, 4]
};

// qi [T, heads*128] bf16 (= indexer wq_b(qr)) -> RoPE at pos on each head's last 64 dims
// (bf16) -> FP4 indexer quant (block 32, ue8m0) -> packed.
IndexerQ indexer_q_pack(const bf16_t* qi, int64_t T, int heads, const int32_t* pos,
                        const float* table, int64_t max_pos);

// w [T, heads] fp32 = weights_proj output (bf16) * (128^-0.5 * heads_total^-0.5) (1/64 for 32 heads).
std::vector<float> indexer_weights(const bf16_t* wproj_out, int64_t T, int heads, int heads_total);

// Scores for row t over compressed positions j < clen[t] of the kv source:
// score[t, j] = sum over heads h in order of relu(q[t,h] . K[slot(t, j)]) * w[t, h], where each
// 128-term dot product is the sum of its four 32-element block sums in order (block sums are exact).
// slot(t, j) = topk_slot_table[req[t]][j] (compressed-pool slot of compressed position j).
// Output scores [T, score_stride], entries j >= clen[t] set to -inf.
void indexer_scores(const IndexerQ& q, const float* w, const uint8_t* index_k_cache,
                    const CacheLayout& layout, int64_t n_slots, const int32_t* req,
                    const int32_t* clen, const int32_t* comp_slot_table, int64_t comp_table_stride,
                    float* scores, int64_t score_stride);

// Candidate source: blocks of `block` positions, block score = max over its positions (padding
// -inf); the block holding position clen-1 pinned to +inf; keep the top min(topk_blocks, n_blocks)
// blocks whose score > -inf (ties: lower block first). mask [T, mask_stride] bytes (1 = kept).
void candidate_mask(const float* scores, int64_t T, int64_t score_stride, const int32_t* clen,
                    int block, int topk_blocks, uint8_t* mask, int64_t mask_stride);
// Later index sources: scores outside the mask set to -inf (in place).
void apply_candidate_mask(float* scores, int64_t T, int64_t score_stride, const int32_t* clen,
                          int block, const uint8_t* mask, int64_t mask_stride);

// Top-k: k = min(topk, clen) best scores (ties: lower position first), then sorted ascending by
// position, mapped to compressed-pool slots via the slot table; slots past k are -1; output width
// out_stride (a multiple of 64). clen == 0 gives all -1. Positions with score -inf are never
// selected (so masked positions drop out and k may be smaller).
void topk_to_slots(const float* scores, int64_t T, int64_t score_stride, const int32_t* clen,
                   int topk, const int32_t* req, const int32_t* comp_slot_table,
                   int64_t comp_table_stride, int32_t* out, int64_t out_stride);

}  // namespace v4attn::ref
