// Per-layer elementwise prepare kernels (spec v41-attention.md section 3, prepare-schedule.md),
// sm_90a. Each kernel is the byte-exact twin of one CPU reference function of
// include/v4attn/reference/prepare_ops.h, built from the same primitives (numerics.h):
//
//   run_q_rope_store   <-> ref::q_rope_store       (wq_b output -> head-padded, roped Q)
//   run_window_k_store <-> ref::window_k_store     (kv_norm + RoPE + FP8 quant -> window cache)
//   run_c1_fused       <-> ref::c1_fused           (ratio-1 compressor tail -> latent + FP4 KV)
//   run_c2_fused       <-> ref::c2_fused           (ratio-2 pair pooling + state -> latent + FP4 KV)
//   run_index_k_store  <-> ref::index_k_store      (k_norm + RoPE + FP4 indexer quant -> index K)
//
// Conventions shared by every kernel here:
//  - One params struct per kernel, passed by value; all pointers are device pointers; strides are
//    in elements. Shapes are in the comments ([rows, cols]).
//  - The host launcher validates shapes, strides, alignment and pointers and throws
//    std::invalid_argument (nothing is launched) on bad input. A row count of 0 launches nothing.
//  - `pdl`: launch with programmatic stream serialization (PDL). Every kernel reads only step
//    metadata and constant tables/weights before dev::pdl_wait(), loads its activation input after
//    it, and calls dev::pdl_launch_dependents() after its last store. Outputs are identical with
//    pdl on and off. Metadata read before the wait (positions, slots, state rows) must be written
//    by something that fully completes before the predecessor kernel starts (a host copy earlier
//    in the stream, or a kernel followed by a launch without PDL); that is how the engine fills
//    the per-step arrays.
//  - `err_count` (may be null): a device counter (DeviceErrorCounter in runtime/) incremented once
//    per skipped row part: a cache slot >= n_slots (the row's store is skipped, the other outputs
//    are still written, exactly like the reference's `skipped` count), and device-only checks the
//    reference turns into host exceptions (a position outside the RoPE table, a state row outside
//    the state): there the whole row is skipped (nothing written for it).
//  - Padded rows: q_rope_store / window-K have none of their own (window slot < 0 = no write);
//    c1 / index-K skip the store at out_loc <= 0; c2 writes nothing for state_row < 0.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "v4attn/cache_layout.h"
#include "v4attn/numerics.h"

namespace v4attn::kernels {

using num::bf16_t;

constexpr int kPrepHeadDim = 512;   // head_dim / latent width (448 nope + 64 RoPE)
constexpr int kPrepIndexDim = 128;  // index_head_dim

// ---- q_rope_store -----------------------------------------------------------------------------
// q_pad[t, h, :] = q[t, h, :] with RoPE at pos[t] on dims 448..511, for h < H. Heads H..H_pad-1
// of q_pad are never written; q is not modified.
struct QRopeStoreParams {
  const bf16_t* q = nullptr;     // [T, H, 512]; row t at q + t * q_row_stride (wq_b output)
  int64_t q_row_stride = 0;      // elements, >= H * 512, multiple of 8
  bf16_t* q_pad = nullptr;       // [T, H_pad, 512]; row t at q_pad + t * q_pad_row_stride
  int64_t q_pad_row_stride = 0;  // elements, >= H_pad * 512, multiple of 8
  const int32_t* pos = nullptr;  // [T], in [0, max_pos)
  const float* table = nullptr;  // [max_pos, 64] fp32 (cos, sin) interleaved (rope_table.h)
  int64_t max_pos = 0;
  int T = 0;
  int H = 0;         // heads present in q (local heads)
  int H_pad = 0;     // heads of q_pad, >= H
  int head_dim = kPrepHeadDim;  // must be 512
  unsigned long long* err_count = nullptr;  // counts rows skipped for pos outside the table
};
void run_q_rope_store(const QRopeStoreParams& p, cudaStream_t stream, bool pdl);

// ---- window-K store ---------------------------------------------------------------------------
// kv = RMSNorm(kv[t], kv_norm) (LaneSum order), RoPE at pos[t] on dims 448..511 (bf16), then the
// V41 (512 e4m3 + 16 ue8m0) or V4 (448 e4m3 block 64 + 64 bf16 tail; 7 ue8m0 + 1 zero pad) slot at
// swa_loc[t]: < 0 no write, >= n_slots skipped and counted.
struct WindowKStoreParams {
  const bf16_t* kv = nullptr;      // [T, 512]; row t at kv + t * kv_row_stride (the kv columns of
                                   // the fused wq_a|wkv output: base + 1280, stride 1792)
  int64_t kv_row_stride = 0;       // elements, >= 512, multiple of 8
  const float* kv_norm = nullptr;  // [512]
  float eps = 0.0f;
  const int32_t* pos = nullptr;    // [T]
  const float* table = nullptr;    // [max_pos, 64]
  int64_t max_pos = 0;
  const int32_t* swa_loc = nullptr;  // [T]
  CacheKind kind = CacheKind::kWindowV41;  // kWindowV41 or kWindowV4
  CacheLayout layout{};            // == cache_layout(kind, page_size)
  uint8_t* cache = nullptr;        // layout.pool_bytes(n_slots) bytes
  int64_t n_slots = 0;
  int T = 0;
  unsigned long long* err_count = nullptr;
};
void run_window_k_store(const WindowKStoreParams& p, cudaStream_t stream, bool pdl);

// ---- c1 fused (ratio-1 compressor tail) -------------------------------------------------------
// latent = RMSNorm(proj[t], c_norm) -> latent_pre_rope[t] (every row); RoPE at g = pos[t]
// (compressed table) on dims 448..511 -> FP4 KV quant (block 16, e4m3 scales) -> V41_FP4 slot at
// out_loc[t] (<= 0 skip; >= n_slots skipped and counted).
struct C1FusedParams {
  const bf16_t* proj = nullptr;    // [N, 512]; row t at proj + t * proj_row_stride (wkv_c output)
  int64_t proj_row_stride = 0;     // elements, >= 512, multiple of 8
  const float* c_norm = nullptr;   // [512]
  float eps = 0.0f;
  const int32_t* pos = nullptr;    // [N] (g = pos)
  const float* table = nullptr;    // [max_pos, 64] compressed (YaRN) table
  int64_t max_pos = 0;
  const int32_t* out_loc = nullptr;  // [N] compressed slot; <= 0 skip
  CacheLayout layout{};            // == cache_layout(kCompressedFp4, page_size)
  uint8_t* cache = nullptr;
  int64_t n_slots = 0;
  bf16_t* latent_pre_rope = nullptr;  // [N, 512]; row t at + t * latent_row_stride
  int64_t latent_row_stride = 0;      // elements, >= 512, multiple of 8
  int N = 0;
  unsigned long long* err_count = nullptr;
};
void run_c1_fused(const C1FusedParams& p, cudaStream_t stream, bool pdl);

// ---- c2 fused (ratio-2 compressor tail, decode and verify) ------------------------------------
// Per row t (state_row[t] < 0: padded, nothing written):
//  - even pos: parks kvs[t] (kv | score) in state[state_row[t]];
//  - odd pos: partner = kvs[prev_row[t]] if prev_row[t] >= 0 (the INPUT row, never the state it
//    is being written to in this launch), else state[partner_state_row[t]];
//    pooled = pair_softmax_pool(partner, own); latent = RMSNorm(bf16(pooled), c_norm) ->
//    latent_pre_rope[t]; RoPE at g = pos - 1 -> FP4 KV store at out_loc[t] (<= 0 skip). The
//    state written by odd rows follows ref::c2_fused (see c2 kernel comment).
struct C2FusedParams {
  const float* kvs = nullptr;      // [N, 1024] fp32 = [kv(512) | score(512)]; row stride below
  int64_t kvs_row_stride = 0;      // elements, >= 1024, multiple of 4
  const int32_t* pos = nullptr;                // [N]
  const int32_t* state_row = nullptr;          // [N]; < 0 = padded row
  const int32_t* partner_state_row = nullptr;  // [N]; used by odd rows with prev_row < 0
  const int32_t* prev_row = nullptr;           // [N]; batch row of the partner or -1
  float* state = nullptr;          // [state_rows, 1024] fp32 pair state (kv | score)
  int64_t state_rows = 0;
  const float* c_norm = nullptr;   // [512]
  float eps = 0.0f;
  const float* table = nullptr;    // [max_pos, 64] compressed (YaRN) table
  int64_t max_pos = 0;
  const int32_t* out_loc = nullptr;  // [N] compressed slot; <= 0 skip
  CacheLayout layout{};            // == cache_layout(kCompressedFp4, page_size)
  uint8_t* cache = nullptr;
  int64_t n_slots = 0;
  bf16_t* latent_pre_rope = nullptr;  // [N, 512]; only completing (odd) rows are written
  int64_t latent_row_stride = 0;      // elements, >= 512, multiple of 8
  int N = 0;
  unsigned long long* err_count = nullptr;
};
void run_c2_fused(const C2FusedParams& p, cudaStream_t stream, bool pdl);

// ---- index-K store ----------------------------------------------------------------------------
// k = RMSNorm(kproj[t], k_norm); RoPE at g[t] (compressed table) on dims 64..127; FP4 indexer
// quant (block 32, ue8m0) -> 68-byte index-K slot at out_loc[t] (<= 0 skip).
struct IndexKStoreParams {
  const bf16_t* kproj = nullptr;   // [N, 128]; row t at kproj + t * kproj_row_stride (wk output)
  int64_t kproj_row_stride = 0;    // elements, >= 128, multiple of 8
  const float* k_norm = nullptr;   // [128]
  float eps = 0.0f;
  const int32_t* g = nullptr;      // [N] group positions
  const float* table = nullptr;    // [max_pos, 64] compressed (YaRN) table
  int64_t max_pos = 0;
  const int32_t* out_loc = nullptr;  // [N]; <= 0 skip
  CacheLayout layout{};            // == cache_layout(kIndexK, page_size)
  uint8_t* cache = nullptr;
  int64_t n_slots = 0;
  int N = 0;
  unsigned long long* err_count = nullptr;
};
void run_index_k_store(const IndexKStoreParams& p, cudaStream_t stream, bool pdl);

// ---- c2 / c1 + wk + index-K, fused (the compressor tail of an index source) --------------------
// One launch doing run_c2_fused(c2), kproj = latent_pre_rope @ wk^T (the bf16 GEMM with version
// v5's bytes, GemmVersion::kSkinny / kAuto at every m) and run_index_k_store(ik) on that kproj, with
// their bytes (latent, pair state, compressed cache, index-K cache, error counts); kproj rows are
// written only for the rows that store an index key (the unfused GEMM writes every row: scratch).
// ik.kproj must be writable; ik.N == c2.N; wk [128, 512] bf16, 16-byte aligned.
struct C2IndexFusedParams {
  C2FusedParams c2;
  const bf16_t* wk = nullptr;
  IndexKStoreParams ik;
};
void run_c2_index_fused(const C2IndexFusedParams& p, cudaStream_t stream, bool pdl);
// The same for the ratio-1 tail: run_c1_fused(c1), the wk GEMM, run_index_k_store(ik), one CTA of 256
// threads per row.
struct C1IndexFusedParams {
  C1FusedParams c1;
  const bf16_t* wk = nullptr;
  IndexKStoreParams ik;
};
void run_c1_index_fused(const C1IndexFusedParams& p, cudaStream_t stream, bool pdl);

}  // namespace v4attn::kernels
