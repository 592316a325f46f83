// The GPU prepare stack: every backbone layer's decode / target-verify prepare (prepare-schedule.md
// "Work items of one layer": QA, QB, KV, CMP, IDX) over the layers of a ModelPlan, issued under one
// of the three schedules (runtime/schedule.h) eagerly or as a CUDA graph per batch bucket
// (runtime/graph_cache.h), on the lanes of runtime/lanes.h (issue_layer: the recording rule).
//
// What one cycle does, per backbone layer L (ratio r, plan.layers[L]), on `rows` = the step's
// bucket rows (live rows first, then padded rows):
//   QA  act quant x[L] -> fp8 GEMM wqkv_a -> qkv_a [rows, q_lora_rank + 512]
//   q_norm (issued separately, the three-lane diagram's "[q_norm]"): RMSNorm(qkv_a[:, :q_rank],
//       q_norm) with the fused FP8 act quant -> qr (bf16) + qr codes / scales
//   QB  fp8 GEMM wq_b on the qr codes -> q [rows, H*512] -> q_rope_store (PDL per options.pdl)
//       -> q_pad[L] [rows, H_pad, 512]
//   KV  window_k_store on qkv_a[:, q_rank:] (row stride q_rank + 512) -> window cache of L
//   CMP (kv sources) ratio 1: bf16 GEMM wkv_c(x) -> c1_fused (store at c_out_loc[1]) -> bf16 GEMM
//       wk(latent) -> index_k_store (g = pos, slot c_out_loc[1]);
//       ratio 2: f32 GEMM [wkv; wgate](x) -> c2_fused (pair state) -> wk(latent) -> index_k_store
//       (g = pos - 1 for rows completing a group, slot c_out_loc[2]; other rows store nothing)
//   IDX (index sources) fp8 GEMM indexer.wq_b on the qr codes -> qi; bf16 GEMM weights_proj(x);
//       indexer_q_pack (RoPE, FP4 quant, weights * 128^-0.5 * index_n_heads^-0.5); scores over the
//       index-K cache of kv_src(L); candidate source: candidate mask of its scores (its own top-k
//       is unmasked); index sources after it: top-k with the mask fused (= apply_candidate_mask
//       then top-k); top-k -> compressed slots, topk[L] [rows, round_up(index_topk, 64)].
// Reuse layers read the top-k of idx_src(L) and the caches of kv_src(L); nothing is copied.
//
// Buffers are static (allocated once, sized for options.max_rows), so one captured graph per
// (step kind, bucket) replays any step of that bucket: set_step() rewrites the step metadata
// (cudaMemcpyAsync on the main stream) and the per-layer inputs x[L] before the launch.
//
// Weights (options.weights):
//  - kReference: make_synthetic_layer_weights(plan, L, seed) uploaded (tp 1 only): the bytes the
//    CPU reference (ref::RefStack with the same seed) uses; tests compare against it.
//  - kDeviceRandom: written on the device by hash kernels (for the full 40-layer config, where host
//    generation takes minutes): fp8 codes e4m3(z * 100) of a discretised normal z with one ue8m0
//    scale per 32x32 block near pow2ceil(3.3 / sqrt(K) / 448) (what quantising N(0,1)/sqrt(K) gives),
//    bf16 / f32 weights z / sqrt(K), norm weights 1 +- 0.1 (bf16 values). Deterministic in
//    (seed, layer, tensor).
//
// Inputs x[L] [rows, dim] bf16: from set_step's host_x callback (reference mode: the reference's
// RefStack::synthetic_x) or, without one, generated on the device from (seed, layer, request,
// position) for live rows and (seed, step, layer, row) for padded rows (values z ~ N(0, 1)).
//
// Caches (the V4.1 layouts of cache_layout.h, 64-slot pages): per backbone layer a window cache
// (kWindowV41, n_requests * window_ring slots); per kv source a compressed-KV (kCompressedFp4) and
// an index-K (kIndexK) pool of full_pool_slots / r + 1 slots (as ref::RefStack), and for ratio-2
// sources the pair state fp32 [n_requests * pair_ring, 1024]. The request pool is
// make_request_pool(n_requests, max_context, rows_per_request, window) (the reference's).
// Filled by load_reference_caches() (bytes of a ref::RefStack after synthetic_prefill),
// upload_caches(), or prefill_device_random() (see there).
//
// Indexer heads: the scores kernel is written for 32 heads. The stack runs the indexer with
// index_heads() = index_n_heads heads at every tp (replicated, as engines run the V3.2/V4 indexer:
// each rank needs the full scores for its top-k), not index_n_heads / tp. When index_heads() < 32
// (reduced configs) the packed q is re-laid out to 32 heads with zero codes and zero weights in the
// padding heads, which adds exactly +0 to every score (bit-identical to the reference's sum over
// index_heads() heads). weights_proj is padded to a multiple of 32 output rows (zero rows) because
// the GEMMs take n % 32 == 0.
//
// H_pad = local heads rounded up to a multiple of 8 (64 -> 64 at tp 1, 16 -> 16 at tp 4, 4 -> 8 for
// the reduced config): the attention kernel's tile is 8 heads wide at least; padding heads are
// never written (tests check they keep their poison).
//
// Not thread-safe; one stack per host thread. Errors: std::invalid_argument for bad options or
// steps (nothing issued), CudaError for CUDA failures.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "v4attn/kernels/gemm.h"
#include "v4attn/numerics.h"
#include "v4attn/plan.h"
#include "v4attn/reference/step.h"
#include "v4attn/runtime/graph_cache.h"
#include "v4attn/runtime/lanes.h"
#include "v4attn/runtime/schedule.h"
#include "v4attn/trace.h"

namespace v4attn {
namespace ref {
class RefStack;
}

namespace prepare {

enum class WeightSource : uint8_t { kReference, kDeviceRandom };
// A fusion knob of GpuStackOptions (fuse_qchain, fuse_qchain_index, fuse_x_quant, fuse_rope_store, fuse_qnorm,
// qnorm_dist, idx_gemv, qa_gemv): never, by the measured rule of the field (kAuto), or wherever the fused form (the
// kernel version) takes the shape.
enum class Fusion : uint8_t { kOff, kAuto, kOn };
// kAuto's row limit. Measured (docs/perf.md, session 10, three-lane, fused vs unfused, two
// repetitions): decode bs 6 -1.8 %, verify bs 1 (6 rows) -1.7 %, decode bs 8 even, verify bs 2 (12
// rows) +3.8 %, decode bs 16 +7.5 %: the kernel's per-row work (act quant of its K range, q_norm of
// every row in every CTA) grows with the rows, and it holds every SM while the index layers' side
// lanes want some. (Session 9, before the fused chain's ring fill waited for its prologue loads:
// faster only up to 4 rows.) Session 14, against the unfused chain WITH the fused RoPE store (same
// binary, two repetitions): decode bs 8 +1.4 / +1.3 % (so 8 rows now run unfused), decode bs 6
// -1.4 / -1.6 %, verify bs 1 (6 rows) -2.6 / -2.4 %. Session 16 (the fused chain ~3 us per layer
// faster; same binary, two repetitions, --fuse-qchain on against auto = the unfused chain with the
// fused RoPE store): decode bs 8 -4.3 %, decode bs 10 -4.1 %, verify bs 2 (12 rows) -1.8 %, decode
// bs 12 -1.6 %, decode bs 16 +1.3 %; 13-15 rows not measured. Session 22 (after the chain's q_norm
// weights moved to registers; same binary, two repetitions): decode bs 16 -0.9 % (1675.1 / 1675.2 ->
// 1658.9 / 1660.5), so the limit is the kernel's 16 rows; verify bs 2 (12 rows) stays on it.
constexpr int kQChainAutoRows = 16;
// fuse_qchain_index's kAuto row limit (docs/perf.md session 17, three-lane, same binary, two
// repetitions: decode bs 1 -1.8 %, bs 2 -0.8 %, bs 3 -0.4 %, bs 4 -0.9 %; decode bs 6 +0.1 %,
// verify bs 1 (6 rows) -0.2 % over three runs, decode bs 8 +0.2 %, verify bs 2 (12 rows) +1.3 %).
// Session 20 (run 13, with the indexer on main after the chain, fused_index_on_main; same binary,
// two repetitions): on vs 4 rows: decode bs 5 -0.4 %, bs 6 -0.3 %, bs 8 -0.7 %, verify bs 1 -0.4 %.
constexpr int kQChainIndexAutoRows = 8;
// qchain_q_direct's kAuto row limit: the fused chain's direct q hand-off (kernels/qchain.h
// QChainFusedParams::q_direct) where it measured faster (docs/perf.md session 20 run 1, three-lane,
// same binary, four repetitions each: decode bs 1 -1.8 %, decode bs 2 +0.5 %, decode bs 4 +6 %,
// verify bs 1 (6 rows) +10 %: every CTA reads 40 KB of partials per row, ~0.75 us per row of L2
// bandwidth; bench_qchain per layer 19.98 -> 19.46 us at 1 row, even at 2, +1.2 .. +6 us at 3-8).
constexpr int kQChainDirectAutoRows = 1;
// fuse_x_quant's kAuto row limit (docs/perf.md, session 9, three-lane, three repetitions: verify
// bs 1 (6 rows) -0.5 %, decode bs 8 -0.8 %, decode bs 2 even, verify bs 2 (12 rows) +1.0 %).
constexpr int kXQuantAutoRows = 8;
// idx_gemv's kAuto row limit: the indexer's wq_b GEMM as v6 (kernels::GemmVersion::kGemv) up to
// this many rows, all v6 takes (docs/perf.md session 23, three-lane, same binary, off -> on, two
// repetitions: decode bs 1 -1.0 %, verify bs 1 (6 rows) -0.5 %, decode bs 2 / 4 / 8 -0.9 / -0.6 /
// -0.6 %; with two token tiles: decode bs 10 -0.6 %, verify bs 2 (12 rows) -0.1 %, decode bs 12 -0.5 %,
// decode bs 16 -0.7 %).
constexpr int kIdxGemvAutoRows = 16;
// qa_gemv's kAuto row limit (docs/perf.md session 23 runs 17-18, three-lane, same binary, v3 with its
// fused act quant -> act quant + v6: decode bs 1 -0.2 %, verify bs 1 (6 rows) -0.4 %, decode bs 4
// +0.1 %, decode bs 8 -0.3 %); v6 takes wq_a|wkv (k 5120) at one n8 tile only.
constexpr int kQaGemvAutoRows = 8;
// src_idx_main's kAuto row limit (docs/perf.md session 24 runs 9, 10, 12, three-lane, same binary,
// off -> on, two repetitions each: decode bs 1 -1.2 / -0.75 / -0.75 %; decode bs 2 even, bs 3 +0.2 %,
// bs 4 even, bs 8 +0.4 %, verify bs 1 (6 rows) +1.65 %: the wq_b GEMM, started only after the
// scores, then ends after the selection).
constexpr int kSrcIdxMainAutoRows = 1;
// qnorm_dist's kAuto rows: exactly this many (GpuStackOptions::qnorm_dist has the measurements).
constexpr int kQNormDistAutoRows = 24;
// fuse_rope_store's kAuto rows: steps of kRopeStoreAutoMinRows..kRopeStoreAutoMaxRows rows (docs/perf.md,
// three-lane, two repetitions, fused vs the q_rope_store kernel). Session 11 (the epilogue staged,
// its table loaded before the PDL wait): verify bs 2 (12 rows) -2.0 %, decode bs 16 -2.4 %, verify
// bs 4 (24) -0.2 %, decode bs 32 even. Session 14 (after session 13's v2 scale-table change), same
// binary: verify bs 4 -1.0 / -1.1 %, decode bs 32 -0.3 / -0.6 %, verify bs 6 (36) even, verify bs 8
// (48) -2.1 / -1.9 %, decode bs 48 -1.7 / -1.7 %, but decode bs 64 +1.4 / +1.8 %; at 1-8 rows
// (index layers only: the plain layers run the fused chain) verify bs 1 +0.4 / +0.9 %, decode bs 1
// +0.6 / +0.4 %, decode bs 8 even (with the fused chain on its plain layers); 8 rows joined the range
// with kQChainAutoRows = 7 (the unfused chain with the fused RoPE store beats the fused chain there).
// Since session 16 the plain layers run the fused chain up to 12 rows (kQChainAutoRows), so at 8-12
// rows this rule applies to the index layers' unfused chain only.
constexpr int kRopeStoreAutoMinRows = 8;
constexpr int kRopeStoreAutoMaxRows = 48;
// Indexer scores in verify steps: from this many requests on, a CTA scores half a request's rows
// (the stack's automatic group_rows; the knob scores_group_rows overrides it). docs/perf.md
// session 17: three-lane, same binary, two repetitions each.
constexpr int kScoresHalfGroupRequests = 4;
// The stack's automatic rows per scores CTA: 1 in decode; in verify the rows of one request
// (rows_per_request, clamped to 1..8), or half of them (rounded up) from kScoresHalfGroupRequests
// requests on.
int scores_auto_group_rows(bool verify, int64_t rows, int rows_per_request);
const char* to_string(Fusion f);
const char* to_string(WeightSource w);

struct GpuStackOptions {
  int n_requests = 1;
  int max_context = 0;       // positions per request (> 0); also the RoPE tables' max_pos
  int rows_per_request = 0;  // most rows of one request in a step; 0: the config's verify rows.
                             // Sizes the window ring and the pair ring (as ref::StackOptions).
  int max_rows = 64;         // rows of the largest step (graph bucket max), 1..64
  // Graph buckets (rows) per step kind; empty: defaults. Decode default: {1, 2, 4, 8, 16, 24, 32,
  // 48, 64} below max_rows, plus max_rows; verify default: v * {1, 2, 3, 4, 6, 8, 10} below
  // max_rows (v = verify rows per request), plus max_rows. Eager cycles use the same bucket rows,
  // so eager and graph runs of a step do identical work.
  std::vector<int> decode_buckets;
  std::vector<int> verify_buckets;
  Schedule schedule = Schedule::kThreeLane;
  // Three-lane S-fork placement (lanes.h). kIdxOnKWithoutCmp since session 17: the reindex layers
  // (IDX without CMP; not those on the fused chain, fuse_qchain_index) run their indexer on lane K
  // behind the window-K store, the other layers as kAtLayerStart (docs/perf.md session 17, same
  // binary, three repetitions: verify bs 4 -0.7 %, decode bs 32 -0.45 %, decode bs 8 -0.3 %,
  // verify bs 1 / 8 even; session 14 had it within the noise).
  LayerIssue::SFork s_fork = LayerIssue::SFork::kIdxOnKWithoutCmp;
  // Cycle prologue. Every cycle starts with a 4-byte memset on main (the step metadata is copied
  // before the graph launch, outside the graph, so without it layer 0's side block would be a
  // root of the graph, and a root replays on a stream of its own). lane_prologue: use
  // PrepareStreams::lane_prologue instead (also anchors both side lanes; an experiment, lanes.h;
  // ignored by the serial schedule, which has no side lane).
  bool lane_prologue = false;
  bool pdl = true;  // programmatic dependent launch of q_rope_store behind the wq_b GEMM
  // With pdl: every other kernel of the cycle too (each reads only weights, tables and step
  // metadata before griddepcontrol.wait: the GEMMs start streaming weights while their
  // predecessor finishes). Measured 1.4-2.5 % per verify bs 1 cycle (docs/perf.md, run 12).
  bool pdl_everywhere = true;
  // The wq_a|wkv GEMM quantises x itself (kernels::run_gemm_fp8_fused_quant, the same bytes) when
  // it runs v3 and gemm_v3_fused_quant_supported holds; else act quant + GEMM as two kernels.
  // kAuto: at most kXQuantAutoRows rows. Was off (session 2, run 18: 2055.6 vs 1868.4 us per verify
  // bs 1 cycle; bench_gemm m=24: 18.4 vs 14.0 us); with the L2 stream policy (session 9) it wins
  // up to 8 rows and loses from 12.
  Fusion fuse_x_quant = Fusion::kAuto;
  // The v3 GEMM's integer-widened blocks (kernels::Fp8GemmParams::v3_int_mask; -1: its default).
  // Another mask may move rare outputs by 1 bf16 ulp (spec section 6). Tuning knob.
  int v3_int_mask = -1;
  kernels::GemmVersion gemm = kernels::GemmVersion::kAuto;  // every GEMM of the cycle (kAuto: by shape, gemm.h)
  // The bf16 / fp32 GEMMs only (compressor, weights_proj, wk); kAuto: follow `gemm`.
  kernels::GemmVersion gemm_small = kernels::GemmVersion::kAuto;
  // Indexer scores launch shape (outputs do not depend on it): rows per CTA (0: the rows of one
  // request in verify, 1 in decode) and 32-position steps per warp (0: the launcher's choice).
  int scores_group_rows = 0;  // 0..8
  int scores_steps = 0;       // 0..64
  int scores_row_split = 0;   // warp sets splitting a CTA's rows, 1..2 (0: automatic)
  int scores_min_blocks = 0;  // register cap of the scores kernel: CTAs per SM, 3 or 4 (0: automatic)
  // Index sources after the candidate source (24..36 in V4.1): the scores kernel takes the
  // candidate mask and scores only the kept blocks (IndexerScoresParams::candidate_mask; the
  // top-k then sees exactly apply_candidate_mask's scores, as before). false: every position is
  // scored and the top-k applies the mask (the earlier path; same bytes). scores_mask_tile: the
  // masked kernel's blocks per CTA tile, 16 / 32 / 64 / 128 / 256 (0: automatic). With the mask the
  // scores_steps / scores_row_split knobs do not apply to those layers, scores_min_blocks only to
  // the 16-block tile.
  bool scores_masked = true;
  int scores_mask_tile = 0;
  // CUDA stream priority of the side lanes S and K (lower = higher; 0 = default; clamped into
  // the device's range). Experiment knob: side-lane CTAs are scheduled before main-lane CTAs that
  // wait for the same SMs (e.g. GEMM CTAs launched early under PDL). In graph replays too since
  // session 22 (the graphs honour node priorities; before, replays ignored it): -1 measured +1.3 to
  // +2.6 % at every shape tried (docs/perf.md session 22 run 7), so 0 stays.
  int side_priority = 0;
  // Indexer top-k and candidate-mask kernels: 3 = one thread-block cluster per row (v3, no
  // workspace), 2 = chunk CTAs + merge through the workspace (v2).
  int select_version = 3;
  int select_cluster = 0;  // v3: CTAs per row (cluster size) 1, 2, 4, 8, 16; 0: automatic
  // v3: the radix select starts with the window exchange (kernels::IndexerTopkParams::v3_window:
  // one exchange fewer where the k-th score lies within ~2 binades of the row's largest). The same
  // bytes by design (GpuIndexerSelectV3.* in both forms, GpuStackSchedules: written, not yet run on a
  // GPU). Built in session 36 without a GPU run: off until measured.
  bool select_window = false;
  // v3, the candidate source: its top-k and its candidate mask (same scores, neither reads the
  // other) in one launch (kernels::run_indexer_select_pair_v3: when both fit one wave, else the two
  // launches). false: the mask, then the top-k, two launches on lane S. Same bytes.
  bool select_pair = true;
  // Three-lane, the index sources with a compressor (2, 8, 14, 20 in V4.1): weights_proj (reads
  // only x) on lane K at the layer's start instead of behind the compressor on lane S; the
  // indexer waits for it through an event (LayerIssue::idx_x_on_k). Same bytes. Default since
  // session 9 (with the L2 stream policy, same run: verify bs 1 -0.5 %, verify bs 4 -1.3 %, decode
  // bs 32 -1.5 %, decode bs 1 -0.3 %; docs/perf.md).
  bool idx_x_on_k = true;
  // q_norm lets the wq_b GEMM launch only after its last store (no early weight prefetch by the
  // GEMM competing with q_norm's loads); experiment knob.
  bool qnorm_trigger_late = false;
  // The wq_b GEMM (v2): weight stages of its first ring fill issued before its PDL wait (-1: all,
  // the kernel's default; 0: none) and its consumer loop (Fp8GemmParams::v2_overlap: -1 default,
  // 0, 1, 2). Tuning knobs; same bytes.
  int qb_prewait_stages = -1;
  int qb_overlap = -1;
  // The wq_b GEMM in layers with side lanes (an indexer or a compressor), plain form only (no fused
  // RoPE store / q_norm), steps of <= 16 rows, where v2's automatic plan is one split (TP1: 128 CTAs
  // of 256 rows): m64 tiles per consumer warpgroup. 2: the automatic plan; 4: 64 CTAs of 512 rows
  // (the same bytes; the other SMs stay free for the side lanes' kernels while it streams); 0 =
  // automatic: 4 in one-row steps, else 2. Measured (docs/perf.md
  // session 20 run 7, same binary, four repetitions): 4 vs 2 decode bs 1 -0.55 %, decode bs 4
  // +0.6 %, decode bs 6 +1.2 %, verify bs 1 +1.8 % (the side lanes' latency-bound kernels beside
  // the GEMM's stream get slower, not faster: the scores of a reindex layer 16.7 -> 28.7 us).
  int qb_side_mtiles = 0;
  // wq_b GEMM: Fp8GemmParams::prewait_pace_ns; -1 = automatic: 1000 ns for one-row steps (decode
  // bs 1: -2.3 % per cycle), 0 otherwise (pacing was slower at 6 rows and more; docs/perf.md session 4).
  int qb_prewait_pace_ns = -1;
  // The QA act quant's warps per CTA (ActQuantParams::warps_per_cta): -1 automatic (as measured,
  // docs/perf.md session 5 run 19: the kernel's 4 for one-row steps, where 32 was 1.2 % slower; 16
  // for 2-7 rows, -2.1 % per verify bs 1 cycle; 32 from 8 rows, -1.4 / -0.3 / -0.6 % at 8 / 24 / 32
  // rows), 0 the kernel's default, 1..32. Its CTAs, launched early under PDL, wait on their SMs for
  // the previous layer's q_rope_store, and the QA GEMM's one-per-SM CTAs cannot start on those SMs:
  // with 4 warps a verify bs 1 step spread 240 CTAs over the machine and only 48 of the QA GEMM's
  // 112 CTAs started before act quant ended (phase stamps). Launch shape only: same bytes.
  int aq_warps = -1;
  // Index sources without a compressor (reindex layers): weights_proj, q pack and the scores on
  // main before the wq_b GEMM (which then launches after the scores' last store); lane S keeps
  // the selection. Needs idx_gemm_on_main. Experiment knob: slower wherever measured (sessions 2
  // and 17, docs/perf.md: the top-k cannot be placed beside the wq_b GEMM; 12-32 rows +1.3 to
  // +3.5 %, session 33 run 8: the scores, the top-k and the GEMM each fill the GPU there).
  bool idx_scores_on_main = false;
  // The wq_b GEMM (v2) writes q_pad with the RoPE itself (q_rope_store fused into its epilogue;
  // same bytes, tested) in the layers that run the unfused chain. kOff: never; kAuto: steps of
  // kRopeStoreAutoMinRows..kRopeStoreAutoMaxRows rows (where it measured faster); kOn: wherever v2 takes it
  // (gemm_v2_rope_store_supported).
  Fusion fuse_rope_store = Fusion::kAuto;
  // The wq_b GEMM (v2) computes q_norm and its act quant itself, in its prologue (same bytes,
  // tested), in the layers that run the unfused chain and have no indexer (nothing else reads
  // q_norm's output there): one kernel and its two PDL hand-offs fewer per layer. kOff and kAuto:
  // never -- measured slower (docs/perf.md session 13 run 14: verify bs 2 +6.9 %, decode bs 16
  // +8.7 %, verify bs 4 +11.9 %, decode bs 32 +17 % against the q_norm kernel: every CTA normalises and quantises all m rows, a
  // long exact-arithmetic chain per chunk, which costs more than the kernel boundary it removes);
  // kOn: wherever v2 takes it (gemm_v2_qnorm_supported). Experiment knob.
  Fusion fuse_qnorm = Fusion::kAuto;
  // The distributed form of that (kernels::gemm_v2_qnorm_dist_supported): the wq_b GEMM's first T
  // CTAs normalise and quantise one row each into the buffers the q_norm kernel would write (same
  // bytes, tested), the other CTAs wait for those rows only (a counter), and the ring keeps its
  // stages. Same layers (unfused chain, no indexer); fuse_qnorm kOn takes precedence. kOff: never;
  // kAuto: at exactly kQNormDistAutoRows rows; kOn: wherever v2 takes it. History of the rule (its sign
  // has flipped with the wq_b GEMM's post-wait path, so re-measure it after changing that): session 25
  // measured it -0.3..-0.8 % at 17-32 rows; after session 30's GEMM changes the q_norm kernel was
  // faster everywhere (verify bs 3 / 4 -1.1 / -1.3 %, decode bs 20 / 24 -1.5 %); after session 32's
  // (the activation-scale walk before the wait) the distributed form wins at 24 rows only: verify bs 4
  // -0.6 / -0.9 / -1.0 %, decode bs 24 -0.9 / -0.6 / -0.6 / -0.3 % (six pairs over three runs), and
  // loses or is even at 18, 20-23, 25, 26, 28, 30 and 32 rows (+0.0..+0.75 %; docs/perf.md session 32
  // runs 6-7). Same bytes either way.
  Fusion qnorm_dist = Fusion::kAuto;
  // When a plain layer (work QA | QB | KV, no compressor / indexer) runs as the fused Q chain. kOff:
  // never, the five-kernel chain with its window-K on lane K; kAuto: at most kQChainAutoRows rows
  // (where it measured faster in the three-lane cycle), and only with `gemm` kAuto (a forced GEMM
  // version keeps the unfused chain); kOn: at most kernels::kQChainMaxRows rows. Always only on a
  // device where its grid fits (qchain_fused_supported). The fused chain is the whole layer as ONE
  // kernel (kernels/qchain.h: act quant, wq_a|wkv GEMM, q_norm, wq_b GEMM +
  // RoPE store, window-K store, with in-kernel hand-offs) on the main lane, no side lane. Its QA
  // GEMM widens every block with cvt (v3_int_mask 0, v3's default), so it writes the unfused
  // chain's bytes (tested at the kernel and over whole cycles; with another v3_int_mask the bytes
  // may differ by 1 bf16 ulp in rare elements, spec section 6). kAuto by default since session 9
  // (kQChainAutoRows: where it measured; 4 rows in session 9, 8 in sessions 10-13, 7 in 14-15,
  // 12 in 16-21, 16 since 22).
  Fusion fuse_qchain = Fusion::kAuto;
  // When a reindex layer (an index source without a compressor: 24, 28, 32, 36 in V4.1) runs its
  // Q chain as the fused Q chain on main (it writes qr and its codes, which the indexer reads):
  // lane S takes weights_proj from x at the layer's start, and the indexer (its wq_b GEMM, q pack,
  // scores, selection) follows the chain on main (fused_index_on_main) or on lane S. Same bytes
  // (tested over whole cycles). kOff: never;
  // kAuto: at most kQChainIndexAutoRows rows, with `gemm` kAuto; kOn: at most
  // kernels::kQChainMaxRows rows. Layers with a compressor keep the unfused chain: the spinning
  // chain holds 128 SMs while the compressor's four dependent kernels wait for them (measured
  // +1.6 to +5.7 %, docs/perf.md session 17). In the layers it takes, idx_gemm_on_main,
  // idx_scores_on_main and s_fork (but kAfterQNorm) do not apply: the indexer has one place there.
  Fusion fuse_qchain_index = Fusion::kAuto;
  // The fused Q chain's q hand-off (in every layer that runs it): kOff: the q tiles' split-K
  // partials added by each tile's last CTA, then every CTA waits for all tiles (two hand-offs);
  // kAuto: the direct form (every CTA adds all q partials itself: one hand-off, 40 KB of partials
  // per row and CTA) at most kQChainDirectAutoRows rows; kOn: the direct form wherever it fits.
  // Same bytes (QChainFusedParams::q_direct).
  Fusion qchain_q_direct = Fusion::kAuto;
  // The indexer's wq_b GEMM (every index source) as v6, the registers-first gemv
  // (kernels::GemmVersion::kGemv: no ring, no cluster, one latency for its weight slice), instead
  // of `gemm`'s choice (v3). Not a byte-neutral knob: another GEMM version, within the spec's
  // allowance of the reference like every version; every schedule and fusion of a step uses the
  // same one. kOff: never; kAuto: at most kIdxGemvAutoRows rows, with `gemm` kAuto; kOn: wherever
  // v6 takes the shape (gemm_gemv_supported).
  Fusion idx_gemv = Fusion::kAuto;
  // The wq_a|wkv GEMM of the layers with a compressor (the kv sources: 2, 8, 14, 20 in V4.1; they
  // never run the fused Q chain, so every configuration of a step runs their QA GEMM the same way)
  // as v6 after the act quant kernel (v6 has no fused act quant; fuse_x_quant does not apply there),
  // instead of `gemm`'s choice (v3 with its fused act quant). Another GEMM version, like idx_gemv.
  // kOff: never; kAuto: at most kQaGemvAutoRows rows, with `gemm` kAuto; kOn: wherever v6 takes it.
  Fusion qa_gemv = Fusion::kAuto;
  // The compressor's tail in one kernel (kernels::run_c2_index_fused / run_c1_index_fused: c2 or c1,
  // the wk GEMM and the index-K store of a row by one CTA) instead of three dependent launches on
  // lane S, the source layers' critical path at 2+ rows (docs/perf.md session 26 run 13, ratio 2,
  // same binary, on vs off: verify bs 1 -0.85 %, verify bs 2 -0.65 %, decode bs 2 -0.15 %, decode bs 8
  // and verify bs 4 even, decode bs 1 +0.1 %, within noise; session 27 run 1, the ratio-1 form added:
  // verify bs 1 -0.1 %, decode bs 1 / 8, verify bs 4 and decode bs 32 even). The same bytes as the
  // unfused tail with wk on GEMM v5 (its version under kAuto / kSkinny); with another small-GEMM
  // version the tail stays unfused. kOff: never; kAuto and kOn: wherever wk runs v5.
  Fusion fuse_cmp_tail = Fusion::kAuto;
  // The index sources with a compressor (2, 8, 14, 20 in V4.1), three-lane schedule: the indexer's
  // q pack, scores and selection on main right after its wq_b GEMM (main first joins lane S, the
  // compressor that writes this step's index K, and lane K, weights_proj and the window-K store),
  // and the wq_b GEMM + q_rope_store forked to lane K beside the selection. Otherwise (kOff) the
  // indexer runs on lane S beside the wq_b GEMM, whose weight stream slows its latency-bound
  // kernels (the scores ~13 us in the cycle against ~4-5 alone at one row); here the scores run
  // alone and the stream overlaps the selection instead. The selection is launched on main under
  // PDL before the GEMM's CTAs can take its cluster's SMs (on lane S after the GEMM on main, its
  // 16-CTA clusters waited for the GEMM's end: +1.0..3.9 %, perf.md session 24 run 8). Same bytes. kAuto: at most
  // kSrcIdxMainAutoRows rows; kOn: every step. s_fork, idx_x_on_k and idx_gemm_on_main do not
  // apply to the layers it takes.
  Fusion src_idx_main = Fusion::kAuto;
  // Reindex layers on the fused Q chain (fuse_qchain_index), three-lane / sources-side schedules:
  // true: lane S runs only weights_proj (forked after the chain, beside the indexer's GEMM: session
  // 21, verify bs 1 -0.35 %, decode bs 2 / 4 -0.5 %, against the fork at the layer's start, where
  // it ran beside the chain and slowed it); main runs the chain, the indexer's
  // wq_b GEMM and, joined with S, the q pack, scores and selection, all PDL-chained, so the next
  // layer's chain launches under PDL behind the selection instead of after a cross-stream join.
  // false: the whole indexer on lane S after the chain (sessions 17-19). Same bytes. Measured
  // (docs/perf.md session 20 run 11, same binary, two repetitions): decode bs 1 -0.5 %, bs 2 -0.3 %,
  // bs 4 -0.7 %. (Only the indexer's GEMM on main, lane S from the q pack on, was +0.4 to +0.6 %.)
  bool fused_index_on_main = true;
  // Index-source layers: run the indexer's wq_b GEMM (qr -> qi) on the main lane right after
  // q_norm instead of first on lane S (experiment knob; docs/perf.md).
  // Default since run 20: verify bs 1 1688.7 vs 1703.8 us, decode bs 32 4615.6 vs 4668.1 us.
  bool idx_gemm_on_main = true;
  WeightSource weights = WeightSource::kDeviceRandom;
  uint64_t seed = 1;  // weights (both sources) and device-generated inputs
  std::function<void(const std::string&)> progress;  // optional progress lines (construction, prefill)
};

// Refuses (std::invalid_argument, naming the option) what the stack cannot run: bad sizes, tp > 1
// with reference weights, index_n_heads > 32, buckets outside [1, max_rows]. No CUDA call.
void validate_options(const ModelPlan& plan, const GpuStackOptions& options);

// Host copies of every cache the stack owns (indexed by layer id; empty where a layer owns none).
struct CacheState {
  std::vector<std::vector<uint8_t>> window;   // backbone layers: window cache bytes
  std::vector<std::vector<uint8_t>> comp;     // kv sources: compressed-KV pool bytes
  std::vector<std::vector<uint8_t>> index_k;  // kv sources: index-K pool bytes
  std::vector<std::vector<float>> pair_state; // ratio-2 kv sources: [pair rows, 1024] fp32
};

// Which bucket a step ran with.
struct StepInfo {
  StepKind kind = StepKind::kDecode;
  int rows = 0;    // live + caller-padded rows of the batch
  int bucket = 0;  // rows the cycle runs (padded rows up to it)
  int64_t step = 0;  // index of this step in the stack's life
};

// The synthetic input rows of a layer for a step: [meta.rows, dim] bf16.
using HostInputFn = std::function<std::vector<num::bf16_t>(int layer, const StepMeta& meta)>;

class GpuPrepareStack {
 public:
  // Validates (validate_options), allocates every buffer, builds and uploads the RoPE tables and
  // the slot tables, initialises the weights (options.weights) and zeroes the caches. Throws
  // std::invalid_argument or CudaError (everything allocated so far is released).
  GpuPrepareStack(const ModelPlan& plan, const GpuStackOptions& options);
  ~GpuPrepareStack();
  GpuPrepareStack(const GpuPrepareStack&) = delete;
  GpuPrepareStack& operator=(const GpuPrepareStack&) = delete;

  const ModelPlan& plan() const;
  const GpuStackOptions& options() const;
  const RequestPool& pool() const;
  int n_layers() const;        // backbone layers the cycle runs (config.n_layers)
  int local_heads() const;     // n_heads / tp
  int h_pad() const;           // heads of q_pad (see the file comment)
  int index_heads() const;     // heads of the indexer (replicated: index_n_heads)
  int64_t max_pos() const;     // RoPE table rows (= max_context)
  int64_t window_slots() const;
  int64_t comp_slots(int kv_source) const;
  int64_t pair_state_rows() const;
  int64_t topk_width() const;              // round_up(index_topk, 64)
  int64_t score_stride(int ratio) const;   // round_up(max_context / ratio, 64)
  int64_t candidate_mask_stride() const;   // ceil(score stride of the candidate source / block); 0 without one
  size_t device_bytes() const;             // everything this stack allocated
  size_t weight_bytes() const;             // of which weights
  cudaStream_t main_stream() const;        // the lanes' main stream (the cycle's stream)
  GraphCache& graphs();
  int bucket_for(StepKind kind, int rows) const;

  // Schedule / PDL / GEMM version of the next cycles. A change drops the captured graphs (after
  // waiting for the main stream).
  void set_schedule(Schedule s);
  void set_pdl(bool pdl);
  void set_pdl_everywhere(bool on);
  void set_gemm_version(kernels::GemmVersion v);
  void set_s_fork(LayerIssue::SFork f);
  void set_lane_prologue(bool on);
  void set_fuse_rope_store(Fusion f);  // GpuStackOptions::fuse_rope_store
  void set_fuse_qnorm(Fusion f);       // GpuStackOptions::fuse_qnorm
  void set_qnorm_dist(Fusion f);       // GpuStackOptions::qnorm_dist
  void set_fuse_qchain(Fusion f);     // GpuStackOptions::fuse_qchain
  void set_fuse_qchain_index(Fusion f);  // GpuStackOptions::fuse_qchain_index
  void set_qchain_q_direct(Fusion f);    // GpuStackOptions::qchain_q_direct
  void set_idx_gemv(Fusion f);           // GpuStackOptions::idx_gemv
  void set_qa_gemv(Fusion f);            // GpuStackOptions::qa_gemv
  void set_fuse_cmp_tail(Fusion f);      // GpuStackOptions::fuse_cmp_tail
  void set_src_idx_main(Fusion f);       // GpuStackOptions::src_idx_main
  void set_qb_side_mtiles(int mtiles);   // GpuStackOptions::qb_side_mtiles (validated as at construction)
  void set_fused_index_on_main(bool on); // GpuStackOptions::fused_index_on_main
  void set_fuse_x_quant(Fusion f);    // GpuStackOptions::fuse_x_quant

  // --- caches ------------------------------------------------------------------------------------
  // Device-side synthetic prefill (the full config at 64K would take minutes on the host): as if
  // positions 0 .. context[q]-1 of request q had been processed. Zeroes every cache, then writes:
  //  - window caches of every backbone layer: the last min(context, window) positions of each
  //    request at their ring slots, each a valid V41 entry (512 e4m3 codes e4m3(z * 128), z a
  //    discretised normal, with 16 ue8m0 scales 2^-7: what the window store gives a normed kv);
  //  - per kv source, every completed group (context / r per request) at its compressed slot
  //    (the slot table's req_to_token[q][j*r] / r): a V41_FP4 entry (e2m1 codes of a quantised
  //    normal, 32 e4m3 scales in [0.25, 1]) and an index-K entry (e2m1 codes, 4 ue8m0 scales
  //    2^-2..2^0);
  //  - ratio-2 pair state: every row initialised (kv 0, score -inf); when context is odd, the row
  //    of position context-1 holds a parked (kv, score) of normal values, so the next step at
  //    position context completes the group (context-1, context).
  // The entries are not what the real compressor would store for some input, but they decode like
  // real ones (the attention and indexer kernels see realistic magnitudes). Deterministic in seed.
  // context: one entry per request, each in [0, max_context]. Waits for completion.
  void prefill_device_random(const std::vector<int32_t>& context);
  // Bytes of a CPU reference's caches (same plan, pool sizes and rows_per_request; refused
  // otherwise): window caches of the backbone layers, compressed KV, index K, pair state.
  void load_reference_caches(ref::RefStack& reference);
  CacheState download_caches();                  // waits for the main stream
  void upload_caches(const CacheState& state);   // sizes must match; stream-ordered on main

  // --- steps -------------------------------------------------------------------------------------
  // Sets the step the next cycles run: pads the batch to bucket_for(kind, rows) with padded rows
  // (req -1: out_cache_loc 0, swa_loc -1, state rows -1), builds the metadata (build_step_meta:
  // unknown requests, positions past max_context are refused), checks that no request has more
  // than rows_per_request rows, copies the metadata into the static device buffers and writes
  // x[L] for every backbone layer (host_x when given, else the device generator), all on the main
  // stream after whatever was issued before. rows in [1, max_rows].
  StepInfo set_step(StepKind kind, const BatchDesc& batch, const HostInputFn& host_x = nullptr);
  const StepMeta& step_meta() const;  // of the current step (bucket rows)
  const StepInfo& step_info() const;

  // One cycle of the current step: eagerly (kernels issued now on main_stream() and the side
  // lanes), or as a replay of the graph of the step's (kind, bucket) (captured on first use).
  // Both return once issued; nothing is synchronised.
  void run_eager();
  void run_graph();
  void run(bool graph) { graph ? run_graph() : run_eager(); }
  void synchronize();  // waits for the main stream (the side lanes join it within every layer)

  // --- outputs (wait for the main stream, then copy to the host) ---------------------------------
  std::vector<num::bf16_t> q_pad(int layer);   // [max_rows, h_pad, 512]; rows >= bucket untouched
  std::vector<int32_t> topk(int index_source); // [max_rows, topk_width]
  std::vector<uint8_t> candidate_mask();       // [max_rows, candidate_mask_stride]
  // Fills q_pad of every layer, every top-k buffer and the candidate mask with `byte` (tests:
  // unwritten elements then show). Stream-ordered on main.
  void poison_outputs(uint8_t byte);
  // Skipped-row count of every kernel since the last reset (DeviceErrorCounter); 0 when healthy.
  unsigned long long error_count();
  void reset_error_count();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// --- CUPTI roles of the stack's kernels ------------------------------------------------------------
// Classifier for the trace report (trace.h) of this stack's cycles, built from the records it
// will classify. Kernel names are not unique per role (wqkv_a, wq_b and the indexer's wq_b are
// one fp8 GEMM kernel), so the wq_b GEMM is found by order: for every q_rope_store record, the
// nearest earlier-starting fp8 GEMM kernel on the same stream (with no other q_rope_store in
// between) is that layer's wq_b GEMM (QB issues exactly "GEMM, q_rope_store" back to back on the
// main lane). Names matched (substring of the demangled name):
//   q_rope_store  "q_rope_store_kernel"
//   window-K      "window_k_store_kernel"
//   fp8 GEMM      "gemm_tc_kernel<true" / "gemm_tc_kernel<(bool)1" (v1) or "gemm_fp8_simple_kernel" (v0)
// Records are identified by (stream, start, end, correlation id, graph node id).
KernelClassifier make_stack_classifier(const std::vector<TraceRecord>& records);

}  // namespace prepare
}  // namespace v4attn
