// Lightning-indexer kernels for sm_90a (spec v41-attention.md section 3.4), each bit-exact against
// the CPU reference of include/v4attn/reference/indexer.h:
//   run_indexer_q_pack      qi (wq_b output) + pos -> RoPE -> FP4 indexer quant (codes + ue8m0),
//                           and weights_proj output -> fp32 head weights (ref::indexer_q_pack,
//                           ref::indexer_weights);
//   run_indexer_scores      score[t, j] = sum_h relu(q[t,h] . K[slot(t,j)]) * w[t,h] over the
//                           index-K paged cache, -inf for j >= clen (ref::indexer_scores);
//   run_candidate_mask      candidate source: top blocks of 8 positions (ref::candidate_mask);
//   run_apply_candidate_mask  later index sources: scores outside the mask -> -inf, in place
//                           (ref::apply_candidate_mask);
//   run_indexer_topk        top-k positions -> compressed-pool slots sorted by position, -1
//                           padded (ref::topk_to_slots), optionally with the candidate mask fused
//                           (same result as apply_candidate_mask + topk, one pass less).
//
// Conventions: every array is a device pointer, row-major, strides in elements. Each run_*
// validates shapes and pointers on the host (std::invalid_argument, nothing launched) and takes
// the stream and a `pdl` flag (programmatic dependent launch: each kernel waits for its stream
// predecessor before its first global read and lets its successor launch after its last store).
// Values that live on the device (pos, req, clen, slots) cannot be checked on the host: the
// kernels contain them (skip or clamp) and count each case in `err_count` (nullable).
//
// Selection workspace (top-k and candidate mask, "v2"): with `workspace` set, the selection runs
// on many CTAs per row (each chunk of a row selects its own top k, the last chunk CTA to finish
// merges the chunk lists; no grid-wide barrier, deterministic: every list has a fixed place and
// the merge does not depend on which CTA runs it). The workspace is device memory of at least
// indexer_topk_workspace_bytes / candidate_mask_workspace_bytes for the launch's T and score
// stride (a buffer sized for the largest launch serves every smaller one, and one buffer can serve
// both ops), ZERO-FILLED ONCE when allocated; every launch leaves it ready for the next (the
// per-row arrival counters, the only part that must be zero, are reset by the merging CTA).
// Launches that share a workspace must be ordered (one stream, or events; PDL is fine: the
// workspace is touched only after griddepcontrol.wait). With `workspace` null the
// one-CTA-per-row kernel ("v1") runs.
//
// Selection "v3" (`version = 3` in the params, or run_indexer_topk_v3 / run_candidate_mask_v3;
// src/kernels/indexer_select_v3.cu), built for latency: one thread-block cluster per row (1..16
// CTAs, `v3_cluster`, 0 = automatic), each CTA keeps its contiguous chunk of the row in shared
// memory (read from global memory once), an 8-bit x 4-pass radix select whose per-pass histograms
// are pushed through distributed shared memory (st.async, each CTA waits on its own mbarrier for
// the cluster's bytes), and an ordered compaction in position order. No workspace; same results as
// v1 / v2 bit for bit. run_indexer_select_pair_v3 runs the candidate source's top-k and mask (same
// scores, neither reads the other) in one launch.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "v4attn/cache_layout.h"
#include "v4attn/numerics.h"

namespace v4attn::kernels {

constexpr int kIndexerHeads = 32;     // index_n_heads (the scores kernel is written for 32)
constexpr int kIndexerHeadDim = 128;  // index_head_dim
constexpr int kIndexerCodeBytes = 64; // e2m1 pairs per head (or per index-K slot)
constexpr int kIndexerScaleBytes = 4; // ue8m0 per head (one per 32 values)
constexpr int64_t kSelectMaxRows = 4096;  // v2 selection: rows per launch (arrival counters)

// ---- q pack + head weights ------------------------------------------------------------------
// Grid: (T, ceil(heads / 4)) CTAs of 256 threads; one CTA owns 4 heads of one row, one thread one
// pair of values (a 32-value quant block = 16 threads, its amax a 16-lane butterfly max). Row t
// with pos outside [0, max_pos) is skipped (its codes and scales are not written; weights are) and
// counted once.
struct IndexerQPackParams {
  const num::bf16_t* qi = nullptr;        // [T, qi_stride], head h at h*128 (wq_b_idx output)
  int64_t qi_stride = 0;                  // >= heads*128, multiple of 8 (16-byte rows)
  const num::bf16_t* wproj_out = nullptr; // [T, wproj_stride], head h at h (weights_proj output)
  int64_t wproj_stride = 0;               // >= heads
  const int32_t* pos = nullptr;           // [T]
  const float* rope_table = nullptr;      // [max_pos, 64] (the layer's compressed RoPE table)
  int64_t max_pos = 0;
  int64_t T = 0;
  int heads = kIndexerHeads;              // local heads, 1..32
  int heads_total = kIndexerHeads;        // for the weight scale 128^-0.5 * heads_total^-0.5
  uint8_t* q_codes = nullptr;             // [T, heads, 64] e2m1 pairs, even element low nibble
  uint8_t* q_scales = nullptr;            // [T, heads, 4] ue8m0
  float* weights = nullptr;               // [T, heads]
  unsigned long long* err_count = nullptr;    // device counter (nullable)
};
void run_indexer_q_pack(const IndexerQPackParams& p, cudaStream_t stream, bool pdl);

// The fp32 weight scale, computed exactly like the reference: 1/64 for 32 heads.
float indexer_weight_scale(int heads_total);

// ---- scores ---------------------------------------------------------------------------------
// Grid: (ceil(T / group_rows), position tiles); one CTA owns a group of consecutive rows and a
// tile of positions; 4 warps, each takes 32 positions per step (int8 tensor-core MMAs give the
// exact 32-element block sums). Rows of a group with the same req (the verify rows of one
// request) share one read of the index K of the tile; a group is processed as runs of equal req.
// Bytes: 68 B of index K + 4 B of slot table per position read, 4 B of score per stride slot.
// K slot of position j: comp_slot_table[req[t] * comp_table_stride + j]. req < 0 is a padded row
// (all -inf, like the reference). Device-side containment of what the reference refuses: a slot
// outside [0, n_slots) gives score -inf for that position (counted once per read: once per
// position and run of equal-req rows of a group); a row with req >= comp_table_rows sees
// nothing, a clen outside [0, min(score_stride, comp_table_stride)] is clamped into it (counted
// once per row).
// Bit-exact against the reference (which uses ldexp) whenever the scale exponents of each
// (q block, K block) pair satisfy -146 <= eq + ek - 2 <= 127 (the fp32 powers of two the kernel
// forms exist; 3 of margin for the shifted-q form); real activations are far inside (|e| < ~20).
struct IndexerScoresParams {
  const uint8_t* q_codes = nullptr;       // [T, 32, 64] (16-byte aligned)
  const uint8_t* q_scales = nullptr;      // [T, 32, 4]  (16-byte aligned)
  const float* weights = nullptr;         // [T, 32]
  const uint8_t* index_k_cache = nullptr; // index-K pool (16-byte aligned)
  CacheLayout layout{};                   // cache_layout(CacheKind::kIndexK, P), P a power of 2 in [4, 2^20]
  int64_t n_slots = 0;                    // slots the pool holds
  const int32_t* req = nullptr;           // [T]
  const int32_t* clen = nullptr;          // [T]
  const int32_t* comp_slot_table = nullptr;  // [comp_table_rows, comp_table_stride]
  int64_t comp_table_stride = 0;
  int64_t comp_table_rows = 0;
  float* scores = nullptr;                // [T, score_stride]
  int64_t score_stride = 0;               // multiple of 64
  int64_t T = 0;
  unsigned long long* err_count = nullptr;    // device counter (nullable)
  int steps_per_warp = 0;                 // tuning: 32-position steps per warp per CTA (1..64: the
                                          // CTA's tile is 128 * steps positions, streamed through a
                                          // ring of 2 K buffers per warp); 0 = automatic (the
                                          // largest of 16 / 8 / 4 / 2 giving >= 1024 CTAs, else 1)
  int group_rows = 1;                     // rows per CTA, 1..8: consecutive rows of one request
                                          // share the K reads (verify: the rows per request;
                                          // decode: 1). Any value is correct for any batch.
  int min_blocks = 0;                     // tuning: CTAs per SM the registers are capped for, 3 (168
                                          // registers, no spill) or 4 (128, some spills); 0 =
                                          // automatic: 3 (measured, docs/perf.md session 6)
  bool trigger_at_wait = true;            // PDL: let the successor launch at the wait (false: after
                                          // the last store; see dev::pdl_wait_no_trigger)
  int row_split = 0;                      // tuning: warp sets per CTA that split a run's rows (1 or 2;
                                          // 0 = automatic: 1, measured faster). Same bytes.
  // Candidate mask (index sources after the candidate source): with candidate_mask set, the output
  // is ref::apply_candidate_mask of the scores (score -inf at j < clen where mask[t, j / 8] == 0)
  // and only kept blocks are read and scored: each CTA compacts the blocks its rows keep, so the
  // work follows the kept fraction (2048 of 8192 blocks per row at 64K), not the context. Slots of
  // positions no row keeps are not read (nor checked). steps_per_warp does not apply; min_blocks
  // only to the 16-block tile (4 unless 3 is asked; the larger tiles take 3).
  const uint8_t* candidate_mask = nullptr;  // optional [T, mask_stride], any nonzero byte keeps the block
  int64_t mask_stride = 0;                  // >= score_stride / 8
  int mask_block = 8;                       // positions per mask byte: must be 8
  int mask_tile_blocks = 0;                 // tuning: blocks per CTA tile, 16 / 32 / ... / 256 (0 = automatic:
                                            // the largest that gives >= 1024 CTAs, at least 16). Same bytes.
};
void run_indexer_scores(const IndexerScoresParams& p, cudaStream_t stream, bool pdl);
// The launch shape run_indexer_scores takes for p (host only; p's launch fields as
// run_indexer_scores accepts them): grid (groups x tiles), positions per CTA tile, K buffers
// per warp, threads, dynamic shared memory and the CTAs per SM the registers are capped for.
struct IndexerScoresShape {
  bool masked = false;       // candidate_mask set: the masked kernel
  int64_t groups = 0;        // grid x: ceil(T / group_rows)
  int64_t tiles = 0;         // grid y: ceil(score_stride / tile_positions)
  int64_t tile_positions = 0;
  int mask_tile_blocks = 0;  // masked: blocks of 8 positions per tile
  int span_steps = 0;        // unmasked: 32-position steps per warp per tile
  int ring = 1;              // K buffers per warp
  int threads = 0;
  int min_blocks = 0;
  size_t smem_bytes = 0;
};
IndexerScoresShape indexer_scores_shape(const IndexerScoresParams& p);
// The mask_tile_blocks values run_indexer_scores accepts: 0 (automatic), 16, 32, 64, 128, 256 (a
// block-list entry holds the block index in 8 bits). Host only; the stack's option check uses it.
bool indexer_scores_mask_tile_ok(int tile_blocks);

// The ways a v3 window exchange can go (IndexerTopkParams / CandidateMaskParams::v3_window_paths).
// Every CTA of a row's cluster takes the same one (the decision is made from the same exchanged
// counts), which the record lets a test check.
namespace select_window_path {
constexpr uint8_t kNone = 0;      // no window exchange ran (no keys to select, or a chunk too long to hold)
constexpr uint8_t kAll = 1;       // at most k valid keys: all of them, decided by the exchange
constexpr uint8_t kBucket = 2;    // the k-th key's 16-bit prefix found, and its whole bucket taken
constexpr uint8_t kPrefix = 3;    // the k-th key's 16-bit prefix found; radix pass 2 next
constexpr uint8_t kFallback = 4;  // not within the window: radix pass 0 next, as without it
constexpr int kMaxRanks = 16;     // entries per row (the largest v3 cluster)
}  // namespace select_window_path

// ---- candidate mask (candidate source layer) ------------------------------------------------
// Block score = max over `block` positions (< clen), the block holding clen-1 pinned to +inf; the
// top min(topk_blocks, n_blocks) blocks with score > -inf (ties: lower block first) get 1, every
// other byte of the row's [0, mask_stride) gets 0.
// v2 (workspace set): grid (chunks of 1024 blocks, T), 512 threads. v1: T CTAs of 1024 threads.
struct CandidateMaskParams {
  const float* scores = nullptr;          // [T, score_stride]
  int64_t score_stride = 0;
  const int32_t* clen = nullptr;          // [T]; clamped to [0, score_stride] (counted)
  int64_t T = 0;
  int block = 8;                          // candidate_block_size
  int topk_blocks = 2048;                 // candidate_topk_blocks
  uint8_t* mask = nullptr;                // [T, mask_stride]
  int64_t mask_stride = 0;                // >= ceil(score_stride / block)
  unsigned long long* err_count = nullptr;    // device counter (nullable)
  void* workspace = nullptr;              // v2 selection workspace (see the top); null: v1
  size_t workspace_bytes = 0;             // >= candidate_mask_workspace_bytes(T, score_stride, ...)
  int version = 0;                        // 0: v2 with a workspace, else v1; 3: v3 (no workspace)
  int v3_cluster = 0;                     // v3 tuning: CTAs per row (1, 2, 4, 8, 16); 0 = automatic
  bool v3_window = false;                 // v3: the window exchange first (as IndexerTopkParams'; same bytes)
  uint8_t* v3_window_paths = nullptr;     // v3_window: which way each CTA's exchange went (as IndexerTopkParams')
};
// Workspace bytes for run_candidate_mask with T rows of score_stride positions (monotone in every
// argument). 0 when v2 cannot run such a launch (T > kSelectMaxRows): run_candidate_mask then
// runs v1 whatever the workspace.
size_t candidate_mask_workspace_bytes(int64_t T, int64_t score_stride, int block, int topk_blocks);
void run_candidate_mask(const CandidateMaskParams& p, cudaStream_t stream, bool pdl);
// v3 directly (what run_candidate_mask does with version 3; `version` and the workspace ignored).
void run_candidate_mask_v3(const CandidateMaskParams& p, cudaStream_t stream, bool pdl);

// In place: scores[t, j] = -inf for j < clen[t] with mask[t, j / block] == 0. Entries j >= clen
// are not touched (the scores kernel already wrote -inf there). Grid: (row tiles, T).
struct ApplyCandidateMaskParams {
  float* scores = nullptr;                // [T, score_stride]
  int64_t score_stride = 0;
  const int32_t* clen = nullptr;          // [T]; clamped to [0, score_stride] (counted)
  int64_t T = 0;
  int block = 8;
  const uint8_t* mask = nullptr;          // [T, mask_stride]
  int64_t mask_stride = 0;                // >= ceil(score_stride / block)
  unsigned long long* err_count = nullptr;    // device counter (nullable)
};
void run_apply_candidate_mask(const ApplyCandidateMaskParams& p, cudaStream_t stream, bool pdl);

// ---- top-k -> slots -------------------------------------------------------------------------
// req and clen are contained like the scores kernel's (req < 0: all -1). k = min(topk, clen) best
// scores among positions j < clen with score > -inf (ties: lower position first), output sorted
// by position, mapped through comp_slot_table[req * stride + j], then -1 up to out_stride.
// Selection: radix select (12 + 10 + 10 bits) of the order-preserving key of each score, then an
// ordered compaction (sorted output, exact tie order). -0.0 and +0.0 are one key (they compare
// equal, as in the reference).
// v2 (workspace set): grid (chunks of 4096 positions, T), 512 threads: each chunk CTA selects
// its chunk's top k, the row's last CTA merges (a row of one chunk is finished by its CTA).
// v1 (workspace null): T CTAs of 1024 threads, one per row.
// With candidate_mask set, position j < clen counts as -inf when mask[j / mask_block] == 0
// (= apply_candidate_mask then top-k, without rewriting the scores).
struct IndexerTopkParams {
  const float* scores = nullptr;          // [T, score_stride]
  int64_t score_stride = 0;
  const int32_t* clen = nullptr;          // [T]; clamped to [0, min(score_stride, table stride)]
  const int32_t* req = nullptr;           // [T]; rows outside [0, comp_table_rows) give all -1
  int64_t T = 0;
  const int32_t* comp_slot_table = nullptr;  // [comp_table_rows, comp_table_stride]
  int64_t comp_table_stride = 0;
  int64_t comp_table_rows = 0;
  const uint8_t* candidate_mask = nullptr;   // optional [T, mask_stride]
  int64_t mask_stride = 0;
  int mask_block = 8;
  int topk = 512;                         // index_topk, 1..out_stride
  int32_t* out = nullptr;                 // [T, out_stride]
  int64_t out_stride = 0;                 // multiple of 64, >= topk
  unsigned long long* err_count = nullptr;    // device counter (nullable)
  void* workspace = nullptr;              // v2 selection workspace (see the top); null: v1
  size_t workspace_bytes = 0;             // >= indexer_topk_workspace_bytes(T, score_stride, topk)
  int version = 0;                        // 0: v2 with a workspace, else v1; 3: v3 (no workspace)
  int v3_cluster = 0;                     // v3 tuning: CTAs per row (1, 2, 4, 8, 16); 0 = automatic
  // v3 with a candidate mask: chunks held in shared memory keep only the groups of 8 positions with
  // a selectable key and the radix passes walk those (~1/4 of the row under V4.1's mask). false:
  // every position is walked (tuning / A-B knob; same bytes).
  bool v3_compact = true;
  // v3: the radix select starts with the window exchange (indexer_select_v3.cu: the top 16 bits of
  // the k-th key in one exchange, where the k-th key lies within ~2 binades of the row's largest
  // finite value; else passes 0-3 as without it). The same bytes by design (its GPU tests are not
  // yet run). Not yet measured on a GPU: off.
  bool v3_window = false;
  // Diagnostics (tests, measurement): with v3_window, [T * select_window_path::kMaxRanks] bytes, entry
  // t * kMaxRanks + rank = which way the window exchange of row t's CTA `rank` went (select_window_path;
  // entries of ranks past the row's cluster are not written). Null: nothing is recorded.
  uint8_t* v3_window_paths = nullptr;
};
// Workspace bytes for run_indexer_topk with T rows of score_stride positions and this topk
// (monotone in every argument). 0 when v2 cannot run such a launch (T > kSelectMaxRows):
// run_indexer_topk then runs v1 whatever the workspace.
size_t indexer_topk_workspace_bytes(int64_t T, int64_t score_stride, int topk);
void run_indexer_topk(const IndexerTopkParams& p, cudaStream_t stream, bool pdl);
// v3 directly (what run_indexer_topk does with version 3; `version` and the workspace ignored).
void run_indexer_topk_v3(const IndexerTopkParams& p, cudaStream_t stream, bool pdl);
// The candidate source's selections (v3), which read the same scores and not each other's output:
// one launch of 2T clusters (T top-k, then T mask) when 2T clusters of the top-k's automatic size
// fit one wave of 2 CTAs per SM (at 64K rows on 132 SMs: T <= 8, 13..16, 25..33; or the given
// v3_cluster, which both params must share); else run_candidate_mask_v3 then run_indexer_topk_v3
// on `stream`. Same bytes either way. Returns
// whether it was one launch. Refused: different T or v3_cluster, a top-k that reads the mask
// being written (tp.candidate_mask == mp.mask), and whatever either launcher refuses.
bool run_indexer_select_pair_v3(const IndexerTopkParams& tp, const CandidateMaskParams& mp, cudaStream_t stream,
                                bool pdl);
// The v3 launch rules (host only, no device needed; `sms` = the device's multiprocessors):
// the automatic cluster size (v3_cluster = 0) of T rows of n elements (positions for the top-k,
// mask = true: candidate blocks for the mask): the smallest power of two giving each CTA at most
// 2048 positions / 512 blocks (4096 / 1024 above 16 rows), at most 16, with T * cluster <= 3/2 *
// sms (a 16-CTA cluster that cannot be resident falls back to 8 at launch); and whether the pair
// is one launch for automatic clusters (its 2T rows within 2 * sms CTAs take the same size).
int select_v3_auto_cluster(int64_t T, int64_t n, bool mask, int sms);
bool select_v3_pair_is_one_launch(int64_t T, int64_t score_stride, int sms);
// Whether the v3 top-k (alone or the pair's top-k half) over rows of score_stride slots walks a
// chunk tail for a row of n positions in clusters of `cluster` CTAs (1, 2, 4, 8 or 16; host only):
// a resident chunk whose last round would hold at most 512 positions, in launches of at most 8 CTAs
// per cluster. Throws std::invalid_argument for cluster 0 or another size, or n outside [1, score_stride].
bool select_v3_topk_takes_tail(int64_t n, int64_t score_stride, int cluster);

}  // namespace v4attn::kernels
