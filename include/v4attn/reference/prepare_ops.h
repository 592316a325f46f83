// CPU reference of the per-layer prepare operations (spec section 3), one function per op, each
// the oracle for one GPU kernel. All arrays row-major; shapes in comments; `stride` arguments are
// in elements. Slot arrays come from StepMeta (step.h). Every function validates its inputs and
// throws std::invalid_argument before writing anything. Writes outside the given caches never
// happen: a slot outside [0, n_slots) is skipped and counted in the returned/accumulated
// `skipped` counter (the GPU kernels do the same with a device-side counter).
#pragma once

#include <cstdint>
#include <vector>

#include "v4attn/cache_layout.h"
#include "v4attn/numerics.h"

namespace v4attn::ref {

using num::bf16_t;

// y[r, 0..n) = RMSNorm(x[r, 0..n), w) with the LaneSum order (numerics.h); n multiple of 8.
void rmsnorm_rows(const bf16_t* x, int64_t rows, int n, int64_t x_stride, const float* w, float eps,
                  bf16_t* y, int64_t y_stride);

// In place: RoPE at pos[r] on the last 64 dims of each of `heads` vectors of length head_dim per
// row (vector h of row r starts at v + r*row_stride + h*head_dim). Result rounded to bf16.
// table: fp32 [max_pos, 64]; pos must be in [0, max_pos).
void rope_rows(bf16_t* v, int64_t rows, int heads, int head_dim, int64_t row_stride,
               const int32_t* pos, const float* table, int64_t max_pos, bool inverse = false);

// q_rope_store: q [T, H, 512] (wq_b output) -> q_pad [T, H_pad, 512] with RoPE at pos on dims
// 448..511 of each head; heads H..H_pad-1 of q_pad are not written; q is not modified.
void q_rope_store(const bf16_t* q, int64_t T, int H, const int32_t* pos, const float* table,
                  int64_t max_pos, bf16_t* q_pad, int H_pad);

// Window K: kv = RMSNorm(kv_raw[t, 0..512), kv_norm) (kv_raw rows have stride kv_stride, e.g.
// the kv part of the fused wq_a|wkv output); RoPE at pos on dims 448..511; then
//  - kWindowV41: FP8 act quant over all 512 dims (block 32) -> 512 e4m3 + 16 ue8m0;
//  - kWindowV4: dims 0..447 FP8 quant with block 64 (ue8m0 scale pow2ceil(amax/448), amax floor
//    1e-4) -> 448 e4m3 + 7 ue8m0 + 1 zero pad byte; dims 448..511 stored as bf16 (the RoPE tail).
// Stored at swa_loc[t] (< 0: no write). Returns the number of skipped out-of-range slots.
// kv_out (optional, [T, 512]) receives the normed, roped bf16 vector (for dumps and tests).
int64_t window_k_store(const bf16_t* kv_raw, int64_t T, int64_t kv_stride, const float* kv_norm,
                       float eps, const int32_t* pos, const float* table, int64_t max_pos,
                       const int32_t* swa_loc, CacheKind kind, const CacheLayout& layout,
                       uint8_t* cache, int64_t n_slots, bf16_t* kv_out = nullptr);

// Compressed-KV store of one 512-dim latent (already roped, bf16) at `loc` in the V41_FP4 layout:
// FP4 KV quant, block 16, e4m3 scales; even element in the low nibble.
void store_compressed_fp4(const bf16_t* latent_roped, const CacheLayout& layout, uint8_t* cache, int64_t loc);

// Ratio-1 compressor tail ("c1 fused"): proj [N, 512] bf16 (= wkv_c(x)) ->
// latent = RMSNorm(proj, c_norm) -> latent_pre_rope [N, 512] (for the index key) ->
// RoPE at g = pos[t] with the compressed RoPE table -> FP4 KV store at out_loc[t]
// (<= 0: skip the store; the latent is still produced). Returns skipped out-of-range slots.
int64_t c1_fused(const bf16_t* proj, int64_t N, const float* c_norm, float eps, const int32_t* pos,
                 const float* table, int64_t max_pos, const int32_t* out_loc,
                 const CacheLayout& layout, uint8_t* cache, int64_t n_slots, bf16_t* latent_pre_rope);

// Ratio-2 compressor tail ("c2 fused"), decode and verify alike:
// kvs [N, 1024] fp32 = [kv(512) | score(512)] per row (= x_f32 @ [wkv; wgate]^T).
// Row t with even pos parks its (kv, score) in state row state_row[t] (fp32 [rows, 1024]);
// row t with odd pos completes group g = pos - 1 with its partner: batch row prev_row[t] if >= 0,
// else state row state_row_of_partner = (state_row[t] - pos%ring + (pos-1)%ring) -- passed
// explicitly as partner_state_row[t]. pooled[d] = pair_softmax_pool(kv_a, s_a, kv_b, s_b)
// (a = partner = even position), latent = RMSNorm(bf16(pooled), c_norm) ->
// latent_pre_rope[t] -> RoPE at g -> FP4 KV store at out_loc[t] (<= 0 skip). Even rows leave
// latent_pre_rope[t] untouched. Padded rows (state_row < 0) write nothing at all and are not
// validated. Refused (std::invalid_argument, nothing written): a live row's pos outside
// [0, max_pos) or state row outside [0, state_rows); an odd row whose prev_row is not a live row
// at pos - 1, or (prev_row < 0) whose partner_state_row is outside the state; a state row parked
// twice, or parked and read, in one call (see pair_state_init). Returns skipped out-of-range slots.
int64_t c2_fused(const float* kvs, int64_t N, const int32_t* pos, const int32_t* state_row,
                 const int32_t* partner_state_row, const int32_t* prev_row, float* state,
                 int64_t state_rows, const float* c_norm, float eps, const float* table,
                 int64_t max_pos, const int32_t* out_loc, const CacheLayout& layout,
                 uint8_t* cache, int64_t n_slots, bf16_t* latent_pre_rope);

// Sets ratio-2 pair state rows [state_rows, 1024] to their initial value: kv = 0, score = -inf (a
// partner read before anything was parked then gets weight exp(-inf) = 0).
// Semantics of c2_fused with respect to the state: every read sees the state as it was before
// the call (phase 1 completes groups, phase 2 parks even rows); a step in which a state row
// would be parked twice, or parked and read, is refused (pair ring too small for the rows).
void pair_state_init(float* state, int64_t state_rows);

// Index-K store: kproj [N, 128] bf16 (= wk(latent_pre_rope)) -> k = RMSNorm(kproj, k_norm) ->
// RoPE at g[t] on dims 64..127 (compressed table) -> FP4 indexer quant (block 32, ue8m0) ->
// 68-byte index-K slot at out_loc[t] (<= 0 skip). Returns skipped out-of-range slots.
int64_t index_k_store(const bf16_t* kproj, int64_t N, const float* k_norm, float eps,
                      const int32_t* g, const float* table, int64_t max_pos, const int32_t* out_loc,
                      const CacheLayout& layout, uint8_t* cache, int64_t n_slots);

}  // namespace v4attn::ref
