// GEMMs of the prepare path (spec v41-attention.md section 2 "Block-scaled FP8 GEMM", section 6),
// sm_90a, tuned for few rows: M = 1..64 tokens against weights that are streamed once.
//
//   run_act_quant_fp8  <-> ref::act_quant   (bf16 rows -> e4m3 codes + ue8m0 scales, byte-exact)
//   run_gemm_fp8       <-> ref::gemm_fp8    (quantized activations x fp8 32x32-block weights)
//   run_gemm_bf16      <-> ref::gemm_bf16   (bf16 x bf16, fp32 accumulation, bf16 out)
//   run_gemm_f32       <-> ref::gemm_f32    (bf16 x widened to fp32, fp32 weights, fp32 out)
//
// Every GEMM computes out[m, n] = sum_k a[m, k] * w[n, k] (weights [N, K] row-major, "x @ W^T"),
// optionally for `groups` independent problems that differ only by base offsets (wo_a: 8 groups).
//
// Versions (GemmVersion):
//  - kSimple (v0): one thread per output element, a plain loop in exactly the reference's order,
//    so its output is byte-identical to the CPU reference. The fallback and the bench baseline.
//  - kTensorCore (v1, fp8 / bf16): mma.sync m16n8k16 with the WEIGHT as the 16-row A operand and
//    the tokens as the 8-column B operand (small M wastes little), weights streamed through a
//    cp.async shared-memory ring, split-K across CTAs where N is small. M <= kGemmMaxRows.
//    fp8 codes are widened to f16 in registers (exact: every e4m3 value is an f16 value) because
//    sm_90 has no native fp8 mma.sync (ptxas would emulate it the same way, but per mma).
//  - kTensorCore for run_gemm_f32: CUDA-core fma kernel (no tensor cores; fp32 weights).
//  - kWgmma (v2, fp8 only; M <= 64): Hopper wgmma m64nNk16 (f16 x f16 -> f32) with the WEIGHT as
//    the 64-row A operand (fp8 bytes ldmatrix'ed from shared memory and widened to f16 in
//    registers) and the tokens (m rounded up to 8 = N) as the B operand (activation codes widened to
//    f16 once per CTA and stage by converter warps, in shared memory), the weights and activation
//    codes streamed by TMA through an mbarrier ring (one producer thread), one CTA per SM, split-K
//    with v1's deterministic reduction where N is small. Same numerics as v1 (below): the block sum
//    by the tensor core from zero, then one fma per block. It does NOT use the native e4m3 wgmma:
//    Hopper's fp8 tensor-core accumulation keeps only ~13-14 bits (products aligned to the largest
//    exponent and truncated), which would move many bf16 outputs, beyond the spec's allowance.
//    run_gemm_bf16 / run_gemm_f32 accept kWgmma and run their v1 (no v2 of those yet), so one
//    version setting can drive a whole stack.
//  - kWgmmaPipelined (v3, fp8 only; M <= 64): v2's design (same CTA roles, TMA ring, f16 wgmma with
//    the weight as A from registers) with (1) the consumer loop software-pipelined over two block-sum
//    register sets (the wgmmas of the next tile-block are in flight while the CUDA cores fold the
//    previous one into the accumulators and widen the next weights), (2) the weight widening split
//    between the cvt instruction and integer ops (Hopper's conversion pipe is slow; the integer
//    form yields weight * 2^-8 exactly and that block's scale carries 2^8; Fp8GemmParams::
//    v3_int_mask picks the blocks), (3) the per-block scale products sa * sw precomputed per stage
//    by the converter warps, (4) split-K (S <= 8) inside a thread-block cluster: the partial tiles
//    are reduced through distributed shared memory in split order, no global workspace and no
//    arrival counters, (5) a coalesced (shared-memory staged) bf16 epilogue.
//    run_gemm_bf16 / run_gemm_f32 accept it and run their v1.
//    What to use: fp8 GEMMs with m <= 64: kWgmma (best_fp8_gemm_version; v3 is the candidate to
//    replace it once measured); bf16 / fp32: kTensorCore, or kSkinny where skinny_gemm_preferred.
//  - kSkinny (v5, bf16 and fp32 only; M <= 64; src/gemm/gemm_skinny.cu): for the SMALL, memory-bound
//    projections (weights_proj 32x5120, wk 128x512, ratio-1 wkv 512x5120, ratio-2 [wkv; wgate]
//    1024x5120 fp32). Grid (tiles_n, S, groups), cluster (1, S, 1): one CTA owns block_n weight rows
//    x one of S contiguous K ranges (S <= 8, from (n, k, groups) only), its 4 warps split that range
//    again into 4 contiguous parts; each warp streams its own part through a private cp.async ring
//    (16-byte copies; up to 8 K blocks in flight per warp; weights of the first slots issued before
//    the PDL wait), so ~256 CTAs stream at m = 1. bf16: mma.sync m16n8k16 as v1 (block_n = 16,
//    32 or 64 rows by m: fewer activation re-reads at larger m). fp32: mma.sync m16n8k16 bf16 too
//    (block_n = 32): x is bf16, so exact in bf16; each fp32 weight is split in registers into three
//    bf16 parts whose sum is the weight (below), so every product is exact; up to 32 rows without the
//    rings (each lane loads its own fragments into registers, two K blocks ahead: the same parts and
//    arithmetic, so the same bytes; F32GemmParams::v5_path). The 4 S partial sums
//    of an output are reduced in a fixed order (warps in the CTA, then the cluster's CTAs through
//    distributed shared memory): no workspace, no second kernel. fp8 calls given kSkinny run
//    kAuto's fp8 choice. Numerics below.
//
//  - kGemv (v6, fp8 only; m <= kGemvMaxRows = 16, groups == 1; src/gemm/gemm_gemv.cu): latency
//    first for few rows against small weights (the indexer's wq_b): one 16-row weight tile per CTA,
//    the K range split over the CTA's warps, every lane's weight fragments loaded from global memory
//    straight into registers before the PDL wait (no ring, no producer, no cluster), the tokens' codes
//    (one or two n8 tiles) in registers after it, mma.sync m16n8k16 with v1's fragment mapping, the
//    warps' partials added in warp order in shared memory.
//
// Numerics of v1 (what differs from the reference, and why it stays within the spec's allowance):
//  - fp8: per 32-wide K block b, the tensor core forms blocksum(b) of the 32 exact products
//    (two chained k16 mmas starting from C = 0); then acc = fma(blocksum, sa * sw, acc) on the
//    CUDA cores. sa and sw are powers of two, so sa * sw is exact and blocksum * (sa * sw) is
//    exact: the fma rounds once, exactly like the reference's add(acc, mul(mul(blocksum, sa), sw)).
//    Only the order of additions inside a block differs (spec: <= 1 bf16 ulp, rarely).
//    (Assumes no overflow / underflow of blocksum * sa * sw, true for any real weights and
//    activations: |blocksum| <= 2^23, sa in [2^-22, 2^120], sw a weight scale.)
//  - bf16: same structure without scales: per 32-wide K block a tensor-core block sum, then
//    acc = add_rn(acc, blocksum) in block order (round-to-nearest on the CUDA cores, so rounding
//    errors do not build up with the tensor core's truncating accumulator over long K).
//  - v2 (kWgmma): v1's fp8 numerics: per block, two chained k16 wgmmas (the first with scale-d = 0)
//    form the block sum, then the same fma; split-K over contiguous K ranges reduced in split
//    order, like v1, but with v2's own S per shape (plan_gemm_wgmma), so v1 and v2 may differ from
//    each other by the split structure too (both within the spec's allowance of the reference).
//  - v3 (kWgmmaPipelined): v2's numerics (block sum by the tensor core from zero, one fma per block
//    with the exact scale product, blocks in order per output, split-K reduced in split order), its
//    own S per shape (<= 8, the cluster size). In integer-widened blocks the block sum is exactly
//    2^-8 times the true one and the scale product exactly 2^8 times sa * sw, so the fma rounds the
//    same exact product once (assumes sa * sw * 2^8 does not overflow, and the tensor core takes f16
//    subnormals, which e4m3 subnormal weights become: tested with subnormal-only exact data). Its
//    intra-block order differs from v2's in those blocks (other byte-to-k assignment), so v2 and v3
//    may differ by 1 ulp in rare elements, like v1 and v2.
//  - split-K (S > 1): CTA s sums its contiguous range of K blocks in order (from +0); the partial
//    sums are added in the fixed order ((P0 + P1) + P2) + ... by the last CTA to finish a tile,
//    so results never depend on timing. S depends only on (n, k, groups), never on M, so a token's
//    output does not depend on how many other tokens are in the batch.
//  - f32 v1: each lane accumulates (fma) a strided slice of K in order, then a fixed butterfly
//    across lanes and a fixed order across warps: equal to the reference up to rounding
//    (|diff| <= ~K * 2^-24 * sum_k |x_k * w_k|).
//  - v5 (kSkinny), bf16: v1's numerics: per 32-wide K block the tensor core forms the block sum
//    from zero (two chained k16 mmas), acc = add_rn(acc, blocksum) in block order over each of the
//    P = 4 S contiguous K parts (part p = warp p % 4 of split p / 4, blocks [p kb / P, (p+1) kb / P),
//    possibly empty = +0); then per output Q_s = ((P_s0 + P_s1) + P_s2) + P_s3 inside CTA s and
//    ((Q_0 + Q_1) + Q_2) + ... over the cluster, all add_rn: fixed, never timing-dependent. S (so P)
//    depends only on (n, k, groups); the rows per CTA depend on m but not the order, so a token's
//    output does not depend on the batch it is in (tested). Within 1 bf16 ulp of the reference
//    in rare elements, like v1 (another split structure than v1's, so v1 and v5 may differ by 1 ulp).
//  - v5 (kSkinny), fp32: each weight w = hi + mid + lo, three bf16 values by truncation (hi = w's
//    top 8 significant bits, mid = the top 8 of w - hi, lo = the rest, which has at most 8): exact
//    for |w| >= 2^-103; below, lo is cut to bf16's subnormal step, an error under 2^-133 per weight.
//    Per 32-wide K block the tensor core forms the block sum of its 96 exact products (6 chained
//    mmas from C = 0: lo, mid, hi of the first 16 k, then of the second), acc = add_rn(acc,
//    blocksum) in block order over each of the P = 4 S parts, then the fixed reduction of the P
//    partials as for bf16. The mma's own fp32 accumulation (order and rounding inside one mma) is
//    not specified by the hardware; modelled as <= 1 ulp per addition the bound is |v5 - s| <=
//    (K / 32 * 18 + K / P + P) u a (s = sum_k x_k w_k, a = sum_k |x_k w_k|, u = 2^-24, first
//    order), inside the 2 (K + 8) u a the tests check (measured: <= 1.2e-6 a at K = 5120, also on
//    weights spread over 2^-40..2^8). Exact whenever every partial sum is representable (small
//    integers). kAuto takes it from m = 2 (f32_skinny_preferred; from 16 before session 26); v1 at
//    one row.
//
//  - v6 (kGemv): v1's fp8 numerics (block sum by two chained mmas from zero, one fma per block with
//    the exact scale product, blocks in order from +0 within each of S contiguous K ranges, the S
//    partials added in order ((P0 + P1) + P2) + ...), S = ceil(k / 320) from k only (so a token's
//    output does not depend on its batch). Another split structure than v1 / v3: within 1 bf16 ulp
//    of them in rare elements.
//
// Conventions: params structs passed by value; all pointers are device pointers; strides and
// group strides are in elements. Host launchers validate everything and throw
// std::invalid_argument (nothing launched) on bad input; m == 0 launches nothing. `pdl`: launch
// with programmatic stream serialization; weights (and weight scales) are read before
// dev::pdl_wait(), activations only after it; outputs do not depend on pdl.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "v4attn/numerics.h"

namespace v4attn::kernels {

using num::bf16_t;

constexpr int kGemmBlock = 32;    // K block of the fp8 GEMM / act quant; N block of weight scales
constexpr int kGemmMaxRows = 64;  // M limit of the tensor-core versions
constexpr int kF32DirectMaxRows = 32;  // fp32 v5: the direct data path (registers, no rings) up to this m
constexpr int kGemvMaxRows = 16;         // fp8 v6: rows (one or two n8 tiles of tokens)
constexpr int kGemvMaxBlocksPerWarp = 10;  // fp8 v6: K blocks per warp (registers)
constexpr int kGemvMaxWarps = 16;          // fp8 v6: warps (K splits) per CTA, 512 threads
constexpr int64_t kGemvMaxK = int64_t{kGemvMaxWarps} * kGemvMaxBlocksPerWarp * kGemmBlock;  // 5120

// kAuto: fp8 GEMMs take best_fp8_gemm_version(m, n, k); bf16 / fp32 GEMMs take kSkinny where
// skinny_gemm_preferred(m, n, k) says so (bf16: only single-group calls without v1 plan overrides;
// both: only when the arguments meet kSkinny's requirements), kTensorCore otherwise.
// kSkinny (v5): bf16 / fp32 only; fp8 calls given it run kAuto's fp8 choice.
// kGemv (v6): fp8 only, m <= kGemvMaxRows, groups == 1 (gemm_gemv_supported); bf16 / fp32 calls
// given it run their kAuto choice.
enum class GemmVersion : int {
  kSimple = 0,
  kTensorCore = 1,
  kWgmma = 2,
  kWgmmaPipelined = 3,
  kAuto = 4,
  kSkinny = 5,
  kGemv = 6
};
const char* gemm_version_name(GemmVersion v);
// Whether kAuto runs a bf16 GEMM of m rows against an [n, k] weight with kSkinny (v5): on the small
// projections of the prepare path (1 <= m <= 64, n <= 1024, k a multiple of 32, k <= 8192), where it
// measured faster: m >= 24, or k <= 1024 (wk), or n >= 128 with m >= 9 (the c1 projection; from 2
// before session 27, whose cycles took v1 up to 8 rows: gemm_skinny.cu, docs/perf.md session 27).
bool skinny_gemm_preferred(int m, int64_t n, int64_t k);
// The version run_gemm_bf16 runs when asked for `version` by a call with groups == 1 and no plan
// overrides: kAuto and kGemv resolve to kSkinny where skinny_gemm_preferred, else kTensorCore;
// kSimple and kSkinny stay; the fp8-only versions (kWgmma, kWgmmaPipelined) run v1, kTensorCore.
// (Callers that depend on a GEMM's bytes ask here rather than repeat the rule.)
GemmVersion bf16_gemm_version(GemmVersion version, int m, int64_t n, int64_t k);
// The fp32 GEMM's kAuto rule: kSkinny (tensor cores) for 2 <= m <= 64 on the same small shapes,
// v1 (CUDA cores) at one row (docs/perf.md, session 11: ratio-2 [wkv; wgate] at m = 16 / 24 / 32 /
// 64: v1 20.9 / 38.3 / 40.6 / 78.4 us, v5 14.1 / 15.0 / 15.8 / 31.1; session 26 re-measured the
// three-lane cycle: v5 faster from 2 rows, +0.9 % at one row; it had been 16 <= m before).
bool f32_skinny_preferred(int m, int64_t n, int64_t k);
// The fastest exact-enough fp8 version for m rows: kWgmma for 1 <= m <= 64, kSimple otherwise
// (no tensor-core version takes more than 64 rows).
GemmVersion best_fp8_gemm_version(int m);
// The measured per-shape choice (docs/perf.md, run 9, graph timing with PDL): v3 where its
// in-cluster split-K reduction pays, i.e. narrow and long GEMMs (n <= 2048, k >= 4096: the fused
// wq_a|wkv 1792x5120, 7.5-14.3 us vs v2's 8.3-36.4 us over M = 1..64), and on n <= 4096 with
// k <= 2048 (the indexer's wq_b 4096x1280 with v3's one-wave cluster plan: 6.2-10.9 vs v2's
// 6.4-28.8 us over M = 1..64, session 3 run 19); v2 elsewhere (v3 was slower on wq_b and wo_b).
// kSimple beyond 64 rows.
GemmVersion best_fp8_gemm_version(int m, int64_t n, int64_t k);

// ---- FP8 act quant ----------------------------------------------------------------------------
// Per row and per block of 32 along K: amax -> ue8m0 scale, e4m3 codes (numerics.h act quant),
// byte-identical to ref::act_quant. No alignment requirement (but run_gemm_fp8 wants q 16-byte
// aligned with q_stride % 16 == 0).
struct ActQuantParams {
  const bf16_t* x = nullptr;  // [m, k] bf16; row r at x + r * x_stride
  int64_t x_stride = 0;       // elements, >= k
  uint8_t* q = nullptr;       // [m, k] e4m3 codes; row r at q + r * q_stride
  int64_t q_stride = 0;       // bytes, >= k
  uint8_t* scale = nullptr;   // [m, k/32] ue8m0; row r at scale + r * scale_stride
  int64_t scale_stride = 0;   // bytes, >= k/32
  int m = 0;
  int64_t k = 0;              // multiple of 32
  // Warps (32-element blocks) per CTA, 1..32; 0 = 4. The same work per thread whatever the value;
  // larger CTAs put the grid on fewer SMs (the CTAs of a PDL-launched act quant wait on their SMs
  // for the predecessor, and a one-CTA-per-SM GEMM after it cannot use those SMs).
  int warps_per_cta = 0;
};
// The warps_per_cta the prepare stack picks by default for m rows (GpuStackOptions::aq_warps -1;
// measured, docs/perf.md session 5 run 19): 0 (the kernel's 4) for one row, 16 for 2-7, 32 from 8.
constexpr int act_quant_auto_warps(int64_t m) { return m == 1 ? 0 : m < 8 ? 16 : 32; }
void run_act_quant_fp8(const ActQuantParams& p, cudaStream_t stream, bool pdl);

// ---- workspace of the split-K tensor-core GEMMs --------------------------------------------------
// fp32 partial sums [S, groups, m, n] plus one arrival counter per output tile. The counters must
// be zero before the first use (init_gemm_workspace, once after allocation); every completed GEMM
// leaves them zero again, so one workspace serves any number of stream-ordered GEMMs (and graph
// replays). Two GEMMs that may run concurrently need two workspaces. A GEMM whose plan has S == 1
// needs no workspace (data may be null).
struct GemmWorkspace {
  void* data = nullptr;  // 256-byte aligned (cudaMalloc is)
  size_t bytes = 0;
};
void init_gemm_workspace(const GemmWorkspace& ws, cudaStream_t stream);

// How v1 / v2 / v3 cut a problem (exposed for the bench, tests and the engine's workspace sizing).
// S, warp_mtiles, block_n and tiles_n depend only on (n, k, groups, overrides), never on m.
struct GemmPlan {
  int warp_mtiles = 1;   // v1: 16-row weight tiles per warp (1 or 2), a CTA (4 warps) owns 64 * this rows;
                         // v2, v3: m64 tiles per consumer warpgroup (1 or 2), a CTA owns 128 * this rows
  int block_n = 64;      // weight rows per CTA
  int tiles_n = 0;       // ceil(n / block_n)
  int splits = 1;        // S: K ranges (CTAs) per output tile
  size_t workspace_bytes = 0;  // for m rows (0 when splits == 1)
  int stages = 0;        // v2, v3: TMA ring depth for this m (0 = the CTA's K range does not fit: refused)
  size_t smem_bytes = 0; // v2, v3: dynamic shared memory per CTA for this m
  int cluster = 1;       // v3: CTAs per thread-block cluster (= splits; its split-K needs no workspace)
};
// force_splits / force_mtiles: 0 = automatic (the default everywhere); tests use them to reach
// every code path on small shapes.
GemmPlan plan_gemm_tc(int m, int64_t n, int64_t k, int groups, int force_splits = 0, int force_mtiles = 0);
GemmPlan plan_gemm_wgmma(int m, int64_t n, int64_t k, int groups, int force_splits = 0, int force_mtiles = 0,
                         int force_stages = 0);
// v3: force_splits is capped at 8 (the cluster size); workspace_bytes is always 0.
GemmPlan plan_gemm_wgmma_pipelined(int m, int64_t n, int64_t k, int groups, int force_splits = 0, int force_mtiles = 0,
                                   int force_stages = 0);
// v5 (kSkinny): block_n = 16 * warp_mtiles rows per CTA (bf16; warp_mtiles 1, 2 or 4 by m unless
// forced) or 32 (f32; warp_mtiles 1); splits = cluster = S <= 8 from (n, k, groups) only
// (force_splits: capped at 8 and at k / 32); stages = slots of each warp's cp.async ring (each slot
// one K block); smem_bytes per CTA; workspace_bytes always 0. Requires 0 <= m <= 64, k % 32 == 0,
// force_mtiles in {0, 1, 2, 4} (f32: 0 or 1).
GemmPlan plan_gemm_skinny(int m, int64_t n, int64_t k, int groups, bool f32, int force_splits = 0,
                          int force_mtiles = 0);
// The plan `version` uses (kSimple: no split, no workspace; kSkinny: the bf16 plan_gemm_skinny --
// fp8 calls given kSkinny run kAuto's fp8 version, whose workspace gemm_workspace_bytes covers).
// v6: 16 weight rows per CTA (tiles_n = n / 16), splits = warps per CTA = ceil(k / 32 / kGemvMaxBlocksPerWarp).
GemmPlan plan_gemm_gemv(int m, int64_t n, int64_t k);
// Whether v6 takes the call: 1 <= m <= kGemvMaxRows, groups == 1, n and k multiples of 32, k <= kGemvMaxK
// (k <= kGemvMaxK / 2 above 8 rows: two token tiles run at most 8 warps).
bool gemm_gemv_supported(int m, int64_t n, int64_t k, int groups = 1);
GemmPlan plan_gemm(GemmVersion version, int m, int64_t n, int64_t k, int groups, int force_splits = 0,
                   int force_mtiles = 0);
// Workspace bytes for any m <= m_max with the automatic plan of ANY version (what an engine
// allocates: the same workspace then serves v1 and v2, which both leave their counters zero; v3
// needs none).
size_t gemm_workspace_bytes(int m_max, int64_t n, int64_t k, int groups = 1);

// ---- FP8 block-scaled GEMM --------------------------------------------------------------------
// out[m, n] = bf16( sum over K blocks b in order of blocksum(b) * sa[m, b] * sw[n/32, b] ).
// Requirements: n % 32 == 0, k % 32 == 0, 1 <= groups; v1, v2, v3: m <= 64; v1, v2: a workspace
// when the plan splits K; v2, v3: the plan's stages >= 1 (the K range of a CTA fits in shared
// memory; always true for the automatic plan) and, with groups > 1, group strides that do not make
// the groups overlap (TMA tensor maps). Alignment (all versions): a_q, w 16-byte aligned; a_stride,
// a_group_stride and w_group_stride multiples of 16.
struct Fp8GemmParams {
  const uint8_t* a_q = nullptr;      // [m, k] e4m3 codes (run_act_quant_fp8 output); row r at a_q + r * a_stride
  int64_t a_stride = 0;              // bytes, >= k
  const uint8_t* a_scale = nullptr;  // [m, k/32] ue8m0; row r at a_scale + r * a_scale_stride
  int64_t a_scale_stride = 0;        // bytes, >= k/32
  const uint8_t* w = nullptr;        // [n, k] e4m3, dense (row stride k)
  const uint8_t* w_scale = nullptr;  // [n/32, k/32] ue8m0, dense
  bf16_t* out = nullptr;             // [m, n] bf16; row r at out + r * out_stride
  int64_t out_stride = 0;            // elements, >= n
  int m = 0;
  int64_t n = 0, k = 0;
  // groups > 1: problem g uses a_q + g * a_group_stride, a_scale + g * a_scale_group_stride,
  // w + g * w_group_stride, w_scale + g * w_scale_group_stride, out + g * out_group_stride.
  int groups = 1;
  int64_t a_group_stride = 0, a_scale_group_stride = 0, w_group_stride = 0, w_scale_group_stride = 0,
          out_group_stride = 0;
  int force_splits = 0, force_mtiles = 0;  // v1 / v2 / v3 plan overrides (0 = automatic)
  int force_stages = 0;                    // v2, v3: TMA ring depth override (0 = automatic; capped by what fits)
  // v3 tuning (outputs do not depend on it beyond the rare 1-ulp intra-block reordering): bit j
  // (j = 0..3) set = K block j of every 128-byte stage widens its weight codes with integer ops
  // (ALU pipe) instead of cvt (conversion pipe). -1 = default (0 since session 9: all cvt; it
  // was 0b1010, half on each pipe).
  int v3_int_mask = -1;
  // v2 / v3: weight stages of the first ring fill issued BEFORE the PDL wait (-1 = all of them,
  // the default; 0 = none). The rest of the first fill follows the wait. Tuning only: the early
  // fill overlaps the predecessor but competes with it (and the kernels before it) for DRAM.
  int prewait_stages = -1;
  // v2: pacing of those pre-wait weight stages, nanoseconds between consecutive stage issues per CTA
  // (0 = all at once). Experiment knob: spreads the first ring fill so that other kernels' memory
  // requests do not queue behind it.
  int prewait_pace_ns = 0;
  // v2 tuning (numerics identical): the consumer loop over the 4 K blocks of a full stage.
  // 0 = one block at a time; 1 = the ldmatrix and widening of block j + 1 issued while the wgmmas
  // of block j run; 2 = also block j + 1's wgmmas issued before block j is folded (two block-sum
  // register sets), over pairs of full stages as one straight-line body, so that the pipeline drains
  // once per two stages (m <= 32 only, larger m run 1); -1 = the default (2). Measured (docs/perf.md):
  // wq_b at m = 1 / 6 / 24 / 32: 15.5 / 15.8 / 19.8 / 21.6 us (0) -> 12.7 / 13.1 / 17.6 / 19.1 us
  // (2 as one stage at a time, session 3); m = 8 / 24 / 32: 13.98 / 16.80 / 18.68 -> 12.38 / 15.88 /
  // 17.74 (pairs of stages, session 29, another machine).
  int v2_overlap = -1;
  // v3 only (run_gemm_fp8_fused_quant): the bf16 activations [m, k] (row r at a_bf16 + r *
  // a_bf16_stride elements; 16-byte aligned, stride % 8 == 0). The GEMM then quantises them itself
  // (byte-identical to run_act_quant_fp8 on the same rows), and a_q / a_scale must be null.
  const bf16_t* a_bf16 = nullptr;
  int64_t a_bf16_stride = 0;  // elements, >= k
  // v2 only (run_gemm_fp8_qnorm): q_norm and its act quant fused into the prologue. The bf16 rows
  // [m, k] (row r at qnorm_x + r * qnorm_x_stride elements; 16-byte aligned, stride % 8 == 0) are
  // RMS-normalised with the fp32 weights qnorm_w [k] and eps qnorm_eps, then act-quantised, exactly
  // as run_rmsnorm (with q_codes) would before the plain GEMM; a_q / a_scale must then be null.
  const bf16_t* qnorm_x = nullptr;
  int64_t qnorm_x_stride = 0;  // elements, >= k
  const float* qnorm_w = nullptr;
  float qnorm_eps = 0.0f;
  // v2, with qnorm_x: the distributed q_norm (gemm_v2_qnorm_dist_supported). Set, the grid's first
  // m CTAs normalise and quantise one row each, writing the codes and scales to a_q / a_scale (then
  // non-null: the buffers and layout run_rmsnorm's q_codes / q_scales would fill; a_stride and
  // a_scale_stride as for the plain GEMM) and, if qnorm_y is set, the normalised bf16 rows to
  // qnorm_y (run_rmsnorm's y); every CTA waits for the m rows on these two words (zero before the
  // first use; the kernel leaves them zero), then goes on as the plain GEMM. The waiting CTAs spin:
  // the grid may not exceed the SMs the process holds at once.
  uint32_t* qnorm_dist_bar = nullptr;
  bf16_t* qnorm_y = nullptr;
  int64_t qnorm_y_stride = 0;  // elements, >= k
  // v2 only (run_gemm_fp8_rope_store): q_rope_store fused into the epilogue.
  const int32_t* rope_pos = nullptr;      // [m] positions
  const float* rope_table = nullptr;      // [rope_max_pos, 64] fp32 (cos, sin) interleaved
  int64_t rope_max_pos = 0;
  unsigned long long* rope_err = nullptr; // rows with pos outside [0, rope_max_pos): not written, counted
};
void run_gemm_fp8(const Fp8GemmParams& p, const GemmWorkspace& ws, GemmVersion version, cudaStream_t stream,
                  bool pdl);

// ---- fused forms (validated by run_gemm_fp8 itself: it takes a_bf16 / rope_* too; the two run_*
// below are wrappers that also require their field and pick the version) ------------------------
// v3 with the FP8 act quant fused in:
// run_gemm_fp8_fused_quant: out = run_gemm_fp8(act_quant(a_bf16), kWgmmaPipelined), byte for byte,
// in one kernel: after its PDL wait every CTA quantises its own K range of the m rows (numerics.h
// act quant, the same functions in the same order as run_act_quant_fp8) straight into its shared
// memory, instead of TMA-loading codes and reading scales. Needs the whole K range of a CTA to fit
// in its ring (plan.stages >= the CTA's stages of 4 K blocks), which
// gemm_v3_fused_quant_supported(m, n, k) says for the automatic plan (the wq_a|wkv 1792 x 5120
// GEMM at every m <= 64). Requirements beyond run_gemm_fp8's for v3: a_bf16 set (a_q, a_scale
// null), groups == 1, a_bf16 16-byte aligned with a_bf16_stride % 8 == 0 and >= k. `version`:
// kAuto / kSkinny resolve as in run_gemm_fp8 (best_fp8_gemm_version(m, n, k)); anything that is
// not then kWgmmaPipelined is refused ("a_bf16 needs GemmVersion::kWgmmaPipelined").
bool gemm_v3_fused_quant_supported(int m, int64_t n, int64_t k);
void run_gemm_fp8_fused_quant(const Fp8GemmParams& p, GemmVersion version, cudaStream_t stream, bool pdl);

// Whether v2's four-m64-tiles-per-warpgroup form (force_splits 1, force_mtiles 4: 512 weight rows
// per CTA, half the CTAs of the two-tile plan) takes an m x n x k problem with the bytes of v2's
// automatic plan: m <= 16 and an automatic plan of one split (a split-K plan adds in another order).
bool gemm_v2_four_tiles_supported(int m, int64_t n, int64_t k);
// wq_b with q_rope_store fused into its epilogue (v2): out[m, n] is the q_pad row m (heads of 512
// dims, out_stride = H_pad * 512), dims 448..511 of each head rotated at rope_pos[m] exactly like
// run_q_rope_store on the unfused GEMM's bf16 output (the same bytes; tested). A row with a
// position outside [0, rope_max_pos) is not written and counted once in rope_err (as
// q_rope_store does). Supported when v2's plan has one split and two m64 tiles per warpgroup
// (wq_b at TP1: n 32768, k 1280), n a multiple of 512, groups == 1.
bool gemm_v2_rope_store_supported(int m, int64_t n, int64_t k);
void run_gemm_fp8_rope_store(const Fp8GemmParams& p, cudaStream_t stream, bool pdl);

// wq_b with q_norm fused into its prologue (v2): out = run_gemm_fp8(rmsnorm_quant(qnorm_x)), byte
// for byte, in one kernel -- after its PDL wait every CTA computes the RMSNorm of the m rows (the
// LaneSum order of run_rmsnorm, one warp per row), applies the weights and act-quantises them into
// its shared memory (all of K: one split), instead of TMA-loading the codes q_norm would have
// written. Saves the q_norm kernel and its PDL hand-offs where nothing else reads q_norm's output
// (the layers without an indexer) -- but measured slower in the stack (docs/perf.md session 13: every
// CTA redoes all m rows' exact per-chunk arithmetic), so the stack runs it only on request
// (GpuStackOptions::fuse_qnorm kOn). May be combined with the fused RoPE store (rope_*). Supported
// when v2's plan has one split and two m64 tiles per warpgroup, groups == 1, k <= 2048 and the
// codes of all K fit beside at least one ring stage -- where n is whole heads of 512, also with the
// RoPE store's table, so that a caller may add it (gemm_v2_qnorm_supported).
bool gemm_v2_qnorm_supported(int m, int64_t n, int64_t k);
void run_gemm_fp8_qnorm(const Fp8GemmParams& p, cudaStream_t stream, bool pdl);
// The distributed form (qnorm_dist_bar set; run_gemm_fp8 with GemmVersion::kWgmma): out, and the
// codes / scales / y it writes, byte for byte those of run_rmsnorm (q_codes, y) then run_gemm_fp8 v2
// (plain or with the RoPE store). After its PDL wait CTA c < m normalises and quantises row c exactly
// as rmsnorm_kernel does (LaneSum by one warp, one thread per 8-element chunk) into a_q / a_scale and
// counts it (a release add); every CTA waits for the m rows (acquire loads), then TMA-loads them like
// the plain GEMM; the last CTA past that wait rewinds the two words. Unlike the per-CTA form the
// ring keeps its stages and no row is normalised twice; against the q_norm kernel it saves a kernel
// boundary for a counter hand-off (docs/perf.md session 25 run 6: decode bs 32 -0.3 %, verify bs 4 -0.5 %).
// Supported when v2's automatic plan has two m64 tiles per warpgroup, k <= 2048, and its grid fits
// the SMs the process holds at once (groups == 1 is run_gemm_fp8's requirement).
bool gemm_v2_qnorm_dist_supported(int m, int64_t n, int64_t k);

// ---- bf16 GEMM --------------------------------------------------------------------------------
// out[m, n] = bf16( sum_k x[m, k] * w[n, k] ), fp32 accumulation. Requirements as for fp8;
// alignment: x, w 16-byte aligned; x_stride, x_group_stride and w_group_stride multiples of 8.
// kSkinny: the same (m <= 64, no workspace); force_splits = its S (capped at 8), force_mtiles =
// its m16 tiles per CTA (0, 1, 2 or 4).
struct Bf16GemmParams {
  const bf16_t* x = nullptr;  // [m, k]; row r at x + r * x_stride
  int64_t x_stride = 0;       // elements, >= k
  const bf16_t* w = nullptr;  // [n, k], dense
  bf16_t* out = nullptr;      // [m, n]; row r at out + r * out_stride
  int64_t out_stride = 0;     // elements, >= n
  int m = 0;
  int64_t n = 0, k = 0;
  // wo_a: groups = 8, x_group_stride = 4096 (the group's columns of o), w_group_stride =
  // 1024 * 4096, out_group_stride = 1024.
  int groups = 1;
  int64_t x_group_stride = 0, w_group_stride = 0, out_group_stride = 0;
  int force_splits = 0, force_mtiles = 0;  // v1 plan overrides (0 = automatic)
};
void run_gemm_bf16(const Bf16GemmParams& p, const GemmWorkspace& ws, GemmVersion version, cudaStream_t stream,
                   bool pdl);

// ---- fp32 GEMM (ratio-2 compressor [wkv; wgate]) --------------------------------------------
// out[m, n] = sum_k f32(x[m, k]) * w[n, k], fp32 out. Requirements: n % 4 == 0, k % 4 == 0 (both
// versions); alignment: w 16-byte aligned, x 8-byte aligned, x_stride % 4 == 0. Any m (v1 tiles
// m by 16). kSkinny additionally: m <= 64, k % 32 == 0, x 16-byte aligned, x_stride % 8 == 0
// (kAuto falls back to v1 when these do not hold).
struct F32GemmParams {
  const bf16_t* x = nullptr;  // [m, k]; row r at x + r * x_stride
  int64_t x_stride = 0;       // elements, >= k
  const float* w = nullptr;   // [n, k], dense
  float* out = nullptr;       // [m, n]; row r at out + r * out_stride
  int64_t out_stride = 0;     // elements, >= n
  int m = 0;
  int64_t n = 0, k = 0;
  int force_splits = 0;  // kSkinny plan override (its S, capped at 8; 0 = automatic); v0 / v1 ignore it
  // kSkinny's data path (the same bytes either way): 0 automatic (direct up to kF32DirectMaxRows
  // rows), 1 direct register loads (m <= kF32DirectMaxRows), 2 per-warp shared-memory rings. v0 / v1
  // ignore it.
  int v5_path = 0;
};
void run_gemm_f32(const F32GemmParams& p, GemmVersion version, cudaStream_t stream, bool pdl);

}  // namespace v4attn::kernels
