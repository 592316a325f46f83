// The fused Q chain of a plain layer (include/v4attn/kernels/qchain.h): act quant -> wq_a|wkv
// GEMM -> q_norm -> wq_b GEMM + RoPE store, and the window-K store, in one kernel.
//
// Grid G = max(wq_b tiles, QA units, 3 T) CTAs (V4.1 TP1: 128), one per SM, 384 threads:
//  - warp 0, lane 0: the producer of the wq_b weight ring (TMA, as v2 gemm_wgmma.cu). Before the
//    PDL wait it also issues the CTA's wq_a|wkv weight slice (QA units only).
//  - warps 1..3 ("helpers"): act quant and q_norm with the consumers; one window-K work item
//    (96 pairs of one row) in the last 3 T CTAs while the consumers run the wq_b loop.
//  - warps 4..11 (warpgroups 1, 2): the wgmma consumers of both GEMMs.
// Warps 1..11 are the "workers" (named barrier, 352 threads); warp 0 takes no part in them.
//
// Phases of CTA c (the hand-offs are arrival counters in the workspace: release by an acq_rel /
// release atomic after a barrier, acquire by one thread's ld.acquire.gpu + a barrier):
//  0. before the PDL wait: barriers, the QA weight slice (tile c % tiles, split c / tiles, v3's
//     K ranges) by TMA; the QA weight scales into shared memory; the operands zeroed (rows >= T
//     stay zero); then, once those loads have landed (and at 9-16 rows the QA slice too; session 28),
//     the first wq_b ring stages by TMA (behind a bulk stream small loads took ~8 us; session 10),
//     paced (kRingPaceNs). Each worker's q_norm
//     weights (its one chunk's 8) into registers, first used in phase 2. The other constants (wq_b
//     scales, the step's RoPE rows) are loaded by the helpers in phase 1, while the consumers run
//     the QA loop (session 16: they had kept late-starting CTAs ~4.5 us from their PDL wait).
//  1. QA units (c < tiles * S): the CTA's K range of x act-quantised (numerics.h, as
//     run_act_quant_fp8) straight into the wgmma operand layout (f16), the block sums (two chained
//     m64nNPk16 wgmmas per 32-wide block, v2's K permutation) folded as v2 / v3 do; the fp32
//     partial tile to the workspace; the last CTA of a tile adds the S partials in split order
//     (as v3), stores the bf16 tile into qkv_a and counts it (q tiles / kv tiles apart).
//  2. every CTA, once the q tiles are all counted: q_norm of every row. One warp per row sums
//     the squares in the LaneSum order (lane l: chunks l, l + 32, ...), then each worker
//     normalises and act-quantises one chunk per pass (4 lanes = one 32-block) straight into the
//     wq_b operand (the whole K, f16) and its scales; CTA t also stores row t's qr / codes /
//     scales.
//  3. the wq_b GEMM of tile c (v2's consumer loop, overlap 2, MT 2) over the weight ring, with the
//     RoPE store epilogue of v2's kRope form into q_pad; meanwhile the window-K items, once the
//     kv tiles are counted.
// The QA weight slice lives in the last ring slots (it is consumed before the wq_b loop needs
// them): the producer fills those slots with wq_b stages only once q_norm is done (`qn`; every
// consumer's QA loop is done before it). Filled as soon as the QA loop ended, that bulk traffic
// landed on the split-K and q hand-offs (session 16, same run: decode bs 1 -1.6 %, verify bs 1
// -0.3 %, decode bs 6 -0.4 % with the later fill).
//
// Why the one-shot phases are written as compact loops (one chunk per thread and pass, no
// division in the loop, the act quant's division path out of line): they run once per launch with
// a cold instruction cache; Nsight Compute's top stall in them was "no instruction" (session 8),
// and the first form (one warp walking a row's 5 chunks, fully unrolled) took ~16 us for q_norm.
//
// Counters: tile[qa tiles] (the split-K arrivals, reset by the reducing CTA), q_done, kv_done,
// exits. Each CTA counts its exit after its last wait on q_done / kv_done; the last one resets
// all three, so the next launch (stream-ordered, its PDL wait waits for this grid) starts from 0.
#include <cuda.h>

#include <algorithm>
#include <cstdlib>
#include <string>

#include "gemm/gemm_internal.h"
#include "gemm/hopper_ptx.cuh"
#include "gemm/tensor_map.h"
#include "gemm/wgmma_f16.cuh"
#include "gemm/wgmma_fp8_block.cuh"
#include "kernels/device_common.cuh"
#include "kernels/prepare_common.cuh"
#include "kernels/window_k_device.cuh"
#include "runtime/launch.h"
#include "runtime/phase_stamps.cuh"
#include "v4attn/kernels/gemm.h"
#include "v4attn/kernels/norm_kernels.h"
#include "v4attn/kernels/qchain.h"

namespace v4attn::kernels {

V4ATTN_STAMP_UNIT();

namespace {

using namespace hopper;

constexpr int kThreads = 384;
constexpr int kWorkers = 352;          // warps 1..11
constexpr int kHelpers = 96;           // warps 1..3
constexpr int kConsumerThreads = 256;  // warps 4..11
constexpr uint32_t kBarConsumers = 1, kBarWorkers = 2, kBarHelpers = 3;
constexpr int kStageK = wgmma_fp8::kStageBytes;  // K bytes per stage (one 128B-swizzle row)
constexpr int kBlocksPerStage = 4;
constexpr int kQaBn = 128;             // QA tile: 2 consumer warpgroups x one m64 tile
constexpr int kQbBn = 256;             // wq_b tile: 2 consumer warpgroups x two m64 tiles
constexpr int kQbMt = 2;
constexpr int kQaSlot = kQaBn * kStageK;   // 16 KB per QA stage
constexpr int kQbSlot = kQbBn * kStageK;   // 32 KB per wq_b ring slot
constexpr int kMaxRing = 8;
constexpr int kRopeHeadDim = wgmma_fp8::kRopeHeadDim;
constexpr int kSmemLimit = 227 * 1024;
constexpr int kSmemAlign = 1024;
// The first wq_b ring fill issues one stage (32 KB per CTA, ~4 MB over the grid: ~1 us of DRAM)
// per this many ns rather than all at once, so that the latency-bound loads running meanwhile (x
// for the act quant, the split-K partials, qkv_a for q_norm) meet a shorter queue. Session 10, same
// run: 0 / 500 / 1000 / 2000 ns: bench_qchain 22.32 / 22.24 / 22.04 / 22.05 us per layer at one row,
// 25.25 / 24.99 / 24.90 / 26.44 at 6; three-lane decode bs 1 -0.4 %, verify bs 1 -0.5 % at 1000.
// Session 16 (after the QA slots' stages moved behind q_norm, so the first fill is the free slots
// only), same run, 1000 / 1500 / 2000: verify bs 1 1240.7 / 1231.5 / 1237.9 us, decode bs 1 1072.0 /
// 1068.6 / 1071.6, decode bs 2 / 3 / 4 / 6 -0.2 / -0.55 / -0.4 / -0.6 % at 1500; 0 and 500 slower.
constexpr uint64_t kRingPaceNs = 1500;
constexpr int kMaxSplits = 8;              // QA split-K splits the reductions hold in registers
constexpr int kKvCols = kPrepHeadDim;      // 512 kv columns after the q_rank q columns
constexpr int kKvParts = (kKvCols / 2 + kHelpers - 1) / kHelpers;  // window-K work items per row (3)
static_assert(kHelpers % 32 == 0, "window-K pairs in whole warps");

enum Counter : int { kQDone = 0, kKvDone = 1, kExits = 2, kQParts = 3, kTile0 = 4 };  // words of the workspace
constexpr int kCounterBytes = 256;         // kTile0 + up to 60 tiles

struct SmemLayout {
  uint32_t ring = 0, xf = 0, sw_b = 0, sa_b = 0, sw_a = 0, sa_a = 0, rope = 0, bar = 0, flag = 0, total = 0;
};
// ring slots, then the f16 operand of the whole wq_b K (the QA operand aliases its start: the QA
// GEMM is done before q_norm writes it), scales, barriers. (The q_norm weights are in the workers'
// registers, not here: see the kernel.)
__host__ __device__ constexpr SmemLayout smem_layout(int np, int ring, int qb_blocks, int qa_blocks) {
  SmemLayout l;
  uint32_t off = 0;
  l.ring = off;
  off += static_cast<uint32_t>(ring * kQbSlot);
  l.xf = off;
  off += static_cast<uint32_t>((qb_blocks / kBlocksPerStage) * 2 * np * kStageK);
  l.sw_b = off;
  off += static_cast<uint32_t>((kQbBn / 32) * qb_blocks * 4);
  l.sa_b = off;
  off += static_cast<uint32_t>(qb_blocks * np * 4);
  l.sw_a = off;
  off += static_cast<uint32_t>((kQaBn / 32) * qa_blocks * 4);
  l.sa_a = off;
  off += static_cast<uint32_t>(qa_blocks * np * 4);
  l.rope = off;  // [NP][64] table rows, NP row flags, [kQChainMaxRows] rstd
  off += static_cast<uint32_t>(np * num::kRopeDim * 4 + np * 4 + kQChainMaxRows * 4);
  off = (off + 7u) & ~7u;
  l.bar = off;  // full[ring], empty[ring], qa_full, qn (q_norm done), prologue
  off += static_cast<uint32_t>((2 * ring + 3) * 8);
  l.flag = off;
  off += 8;
  l.total = off;
  return l;
}

struct QcParams {
  CUtensorMap tmap_qa;  // wqkv_a [n_qa][dim] bytes; box {128, 128}
  CUtensorMap tmap_qb;  // wq_b [n_qb][q_rank] bytes; box {128, 256}
  const bf16_t* x;
  int64_t x_stride;
  const uint8_t* qa_scale;
  const uint8_t* qb_scale;
  const float* q_norm;
  float eps;
  bf16_t* qkv_a;
  int64_t qkv_a_stride;
  bf16_t* qr;
  uint8_t* qr_codes;
  uint8_t* qr_scales;
  bf16_t* q_pad;
  int64_t q_pad_stride;
  int q_pad_vec;  // store_tile_bf16_staged's out_vec: 2 when q_pad and its stride allow 16-byte pieces
  WindowKStoreParams kv;
  uint32_t* counters;
  float* partials;  // [S][T][n_qa]
  int T;
  int dim_blocks;   // K blocks of the QA GEMM
  int n_qa, q_rank, n_qb;
  int qa_tiles, q_tiles, qa_splits, qa_units, qa_max_blocks;
  int ring;         // wq_b ring slots
  int qa_slot0;     // first ring slot the QA weights occupy
  int grid;
};

__device__ __forceinline__ uint32_t ld_acquire_gpu(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void spin_until(const uint32_t* p, uint32_t target) {
  while (ld_acquire_gpu(p) < target) {
  }
}

// The f16 of 8 e4m3 codes (one 8-element chunk = half of a 16-byte code chunk) written at the
// logical k of v2's converters: stage operand `xf` (2 K-halves of [NP][128 B], 128B swizzle),
// block j of the stage, half sp of the block's 32 codes, half h of that 16-byte chunk, row n.
template <int NP>
__device__ __forceinline__ void put_codes_f16(uint8_t* xf, int j, int sub, int n, uint2 codes) {
  const int sp = sub >> 1, h = sub & 1;
  const int cb = (j & 1) * 4 + sp * 2;
  uint8_t* row = xf + (j >> 1) * NP * kStageK + n * kStageK;
  const uint2 lo = make_uint2(e4m3x2_lo_to_f16x2(codes.x), e4m3x2_lo_to_f16x2(codes.y));
  const uint2 hi = make_uint2(e4m3x2_hi_to_f16x2(codes.x), e4m3x2_hi_to_f16x2(codes.y));
  *reinterpret_cast<uint2*>(row + ((cb ^ (n & 7)) << 4) + 8 * h) = lo;
  *reinterpret_cast<uint2*>(row + (((cb + 1) ^ (n & 7)) << 4) + 8 * h) = hi;
}

// The row passes of a one-shot elementwise phase (act quant of x, q_norm): each worker owns one
// 8-element chunk (a fixed column offset, `chunk0` in row 0) of rows sub_r, sub_r + rows_per_pass,
// ... The chunks of the first kAhead passes are loaded before any is used and each pass loads the
// one kAhead passes ahead (a register shift, no dynamic indexing), so that T rows cost one load
// round trip, not one per pass (the passes' compute is short; at 6 rows q_norm took 3 passes of an
// L2 round trip each). A compact loop body with no division in it: this code runs once per launch,
// cold in the instruction cache. body(r, act, v): act = this worker has row r; the others run the
// same code on zeros (the act quant's 4-lane amax needs every lane).
template <bool kL2Only, int kAhead>  // kL2Only: __ldcg, rows written by other CTAs of this launch
struct RowChunks {
  struct Ahead {
    uint4 v[kAhead];
  };
  const bf16_t* chunk0;
  int64_t stride;
  int T, sub_r, rows_per_pass;
  __device__ __forceinline__ uint4 load(int r) const {
    if (sub_r >= rows_per_pass || r >= T) return make_uint4(0u, 0u, 0u, 0u);
    const uint4* q = reinterpret_cast<const uint4*>(chunk0 + static_cast<int64_t>(r) * stride);
    return kL2Only ? __ldcg(q) : *q;
  }
  __device__ __forceinline__ Ahead prefetch() const {
    Ahead a;
#pragma unroll
    for (int i = 0; i < kAhead; ++i) a.v[i] = load(sub_r + i * rows_per_pass);
    return a;
  }
  template <class Body>
  __device__ __forceinline__ void passes(Ahead a, Body&& body) const {
#pragma unroll 1
    for (int r0 = 0; r0 < T; r0 += rows_per_pass) {  // warp-uniform trip count
      const int r = r0 + sub_r;
      float v[detail::kChunk];
      detail::unpack_bf16x8(a.v[0], v);
#pragma unroll
      for (int i = 0; i + 1 < kAhead; ++i) a.v[i] = a.v[i + 1];
      a.v[kAhead - 1] = load(r + kAhead * rows_per_pass);
      body(r, sub_r < rows_per_pass && r < T, v);
    }
  }
};
// Passes in flight: the act quant of x takes kWorkers / (chunks of a CTA's K range) rows per pass
// (V4.1: 4, so <= 4 passes at 16 rows), q_norm kWorkers / (q_rank / 8) (V4.1: 2, so 3 passes at 6
// rows, 4 at 8, 8 at 16).
constexpr int kActQuantAhead = 4, kQNormAhead = 4;

using wgmma_fp8::BlockOps;

__device__ __forceinline__ uint32_t atom_add_acq_rel_gpu(uint32_t* p, uint32_t v) {
  uint32_t old;
  asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
  return old;
}
__device__ __forceinline__ void red_add_release_gpu(uint32_t* p, uint32_t v) {
  asm volatile("red.release.gpu.global.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// The split-K partials of one element added in split order, ((P0 + P1) + P2) + ..., as v3 adds
// them: the tile reducer's and the direct q hand-off's one sum (v[sp] for sp < splits).
__device__ __forceinline__ float sum_in_split_order(const float (&v)[kMaxSplits], int splits) {
  float sum = v[0];
#pragma unroll
  for (int sp = 1; sp < kMaxSplits; ++sp)
    if (sp < splits) sum = num::add_rn(sum, v[sp]);
  return sum;
}

// One full stage (4 K blocks) of MT m64 tiles, v2's overlap-2 pipeline: block j + 1's ldmatrix,
// widening and wgmmas are issued before block j is folded (two block-sum sets), folds in block
// order. sw_row(mt, b): the weight scale of tile mt's 32-row group at the stage's block b; sa: the
// stage's activation scales [4][NP].
template <int MT, int NP, class SwRow>
__device__ __forceinline__ void run_full_stage(const BlockOps<MT, NP>& ops, SwRow sw_row, const float* sa,
                                               float (&acc)[MT][NP / 2], float (&d)[MT][NP / 2], float (&d2)[MT][NP / 2]) {
  constexpr int R = NP / 2;
  uint32_t a[2][MT][2][4];
  float sw[2][MT];
  auto sums = [&](int j) -> float (&)[MT][R] { return (j & 1) ? d2 : d; };
  auto load = [&](int j) { ops.load(j, a[j & 1], [&](int mt) { sw[j & 1][mt] = sw_row(mt, j); }); };
  load(0);
  ops.issue(0, a[0], sums(0));
#pragma unroll
  for (int j = 0; j < kBlocksPerStage; ++j) {
    if (j + 1 < kBlocksPerStage) {
      load(j + 1);
      ops.issue(j + 1, a[(j + 1) & 1], sums(j + 1));
      wgmma_wait<1>();
    } else {
      wgmma_wait<0>();
    }
    ops.fold(sa + j * NP, sw[j & 1], sums(j), acc);
  }
}

// The QA loop's stage (MT 1): all four blocks' loads and wgmmas issued before the first fold (four
// block-sum sets in flight), then the folds in block order. The QA slice is in shared memory before
// the loop starts, so its stages are not memory-paced: with two blocks in flight a stage took ~0.42 us
// (phase stamps, session 21: 2.0 us for the 5 stages at 1-8 rows) against ~0.15 us of tensor-core
// throughput (bench_wgmma_probe); with four, 1.87 us for the 5 (the rest is not the wgmma chains:
// five iterations per launch never reach a steady state). Same arithmetic as run_full_stage: each
// block sum from its own zeroed set, the folds in order.
template <int MT, int NP, class SwRow>
__device__ __forceinline__ void run_full_stage_all4(const BlockOps<MT, NP>& ops, SwRow sw_row, const float* sa,
                                                    float (&acc)[MT][NP / 2]) {
  constexpr int R = NP / 2;
  uint32_t a[kBlocksPerStage][MT][2][4];
  float sw[kBlocksPerStage][MT];
  float d[kBlocksPerStage][MT][R];
#pragma unroll
  for (int j = 0; j < kBlocksPerStage; ++j) {
    ops.load(j, a[j], [&](int mt) { sw[j][mt] = sw_row(mt, j); });
    ops.issue(j, a[j], d[j]);
  }
  wgmma_wait<3>();
  ops.fold(sa + 0 * NP, sw[0], d[0], acc);
  wgmma_wait<2>();
  ops.fold(sa + 1 * NP, sw[1], d[1], acc);
  wgmma_wait<1>();
  ops.fold(sa + 2 * NP, sw[2], d[2], acc);
  wgmma_wait<0>();
  ops.fold(sa + 3 * NP, sw[3], d[3], acc);
}
static_assert(kBlocksPerStage == 4, "run_full_stage_all4 waits for four commit groups");

// kDirect (QChainFusedParams::q_direct): the q columns take ONE hand-off instead of two. Each q unit
// counts its stored partial tile (kQParts, a release add it does not wait on) and every CTA, once
// all q_tiles x qa_splits have arrived, adds the partials of every q column itself -- in split
// order, rounded to bf16 as the tile's reducer would -- into shared memory (the QA weight slots,
// consumed by then), and q_norm reads them there. So the q tiles have no reducer, no tile-counter
// round trip and no second count to wait for; the price is the partial bytes every CTA reads
// (qa_splits x T x q_rank x 4: 40 KB per row at V4.1), which grows with the rows. CTA r stores
// row r's qkv_a q columns (the reducers' output). The kv tiles keep their reducer (the window-K
// store waits for them off the critical path).
template <int NP, bool kDirect>
__global__ void __launch_bounds__(kThreads, 1) qchain_fused_kernel(const __grid_constant__ QcParams p) {
  constexpr int R = NP / 2;
  static_assert(NP == 8 || NP == 16, "the fused chain takes up to 16 rows");

  [[maybe_unused]] unsigned long long t_entry = 0;
  V4ATTN_STAMP_NOW(t_entry);  // measurement builds: phase 14, the CTA's first instruction
  extern __shared__ uint8_t smem_raw[];
  const uint32_t raw_addr = smem_u32(smem_raw);
  const uint32_t base = (raw_addr + (kSmemAlign - 1)) & ~static_cast<uint32_t>(kSmemAlign - 1);
  uint8_t* smem = smem_raw + (base - raw_addr);
  const int ST = p.ring;
  const int qb_blocks = p.q_rank / 32;
  const int qb_iters = qb_blocks / kBlocksPerStage;
  const SmemLayout L = smem_layout(NP, ST, qb_blocks, p.qa_max_blocks);
  float* sw_b = reinterpret_cast<float*>(smem + L.sw_b);  // [8][qb_blocks]
  float* sa_b = reinterpret_cast<float*>(smem + L.sa_b);  // [qb_blocks][NP]
  float* sw_a = reinterpret_cast<float*>(smem + L.sw_a);  // [4][qa_max_blocks]
  float* sa_a = reinterpret_cast<float*>(smem + L.sa_a);  // [qa_max_blocks][NP]
  float* rope_tab = reinterpret_cast<float*>(smem + L.rope);  // [NP][64]
  int* rope_ok = reinterpret_cast<int*>(rope_tab + NP * num::kRopeDim);  // [NP]
  float* s_rstd = reinterpret_cast<float*>(rope_ok + NP);  // [kQChainMaxRows]
  int* s_flag = reinterpret_cast<int*>(smem + L.flag);
  const uint32_t bar_full = base + L.bar, bar_empty = bar_full + 8u * ST, bar_qa_full = bar_empty + 8u * ST,
                 bar_qn = bar_qa_full + 8u, bar_prologue = bar_qn + 8u;

  const int tid = static_cast<int>(threadIdx.x), warp = tid >> 5, lane = tid & 31;
  const int c = static_cast<int>(blockIdx.x);
  const bool qa_unit = c < p.qa_units;
  const int qa_tile = c % p.qa_tiles, qa_split = c / p.qa_tiles;
  const int kb_begin = qa_unit ? static_cast<int>(static_cast<int64_t>(qa_split) * p.dim_blocks / p.qa_splits) : 0;
  const int kb_end = qa_unit ? static_cast<int>(static_cast<int64_t>(qa_split + 1) * p.dim_blocks / p.qa_splits) : 0;
  const int nkb = kb_end - kb_begin;
  const int qa_iters = (nkb + kBlocksPerStage - 1) / kBlocksPerStage;
  const bool qb_unit = c * kQbBn < p.n_qb;
  const int qb_row0 = c * kQbBn;
  uint32_t* counters = p.counters;

  // ---- phase 0: barriers, weights (constant data: before the PDL wait) ---------------------------
  if (tid == 0) {
    for (int s = 0; s < ST; ++s) {
      mbar_init(bar_full + 8u * s, 1);
      mbar_init(bar_empty + 8u * s, kConsumerThreads);
    }
    mbar_init(bar_qa_full, 1);
    mbar_init(bar_prologue, 1);
    mbar_init(bar_qn, 1);  // one arrival: worker 0 after q_norm's last barrier
    fence_mbarrier_init();
    prefetch_tensormap(&p.tmap_qa);
    prefetch_tensormap(&p.tmap_qb);
  }
  __syncthreads();  // the last CTA-wide barrier: warp 0 leaves the workers' barriers below

  if (warp == 0) {
    if (lane != 0) return;
    // ======== producer ============================================================================
    if (qa_unit) {
      mbar_arrive_expect_tx(bar_qa_full, static_cast<uint32_t>(qa_iters * kQaSlot));
      for (int i = 0; i < qa_iters; ++i)
        tma_load_weights_3d(base + L.ring + static_cast<uint32_t>(p.qa_slot0 * kQbSlot + i * kQaSlot), &p.tmap_qa,
                            bar_qa_full, (kb_begin + i * kBlocksPerStage) * 32, qa_tile * kQaBn, 0);
    }
    if (!qb_unit) return;
    // The wq_b ring fill (~20 MB over the grid) waits for the workers' phase-0 loads: issued at once
    // with them, it queued them behind itself, and a CTA that started behind the previous kernel's
    // exits reached its PDL wait ~8 us after it started (session 10: -8 % per layer at 1-8 rows).
    // The QA weights, needed first, go out at once.
    mbar_wait(bar_prologue, 0u);
    // At 9-16 rows (NP 16) a QA unit's ring fill also waits for its QA slice to land, so that the slice
    // streams without the ring's stages beside it (why that pays at 9-16 rows only was not traced).
    // Session 28 run 11, against the previous commit: verify bs 2 -1.1 %, decode bs 10 / 12 / 16 -1.4 /
    // -1.1 / -1.3 %. At 1-8 rows the same wait measured slower (run 7: decode bs 1 / 4 / 8 +0.4 / +0.5 /
    // +0.9 %, verify bs 1 +0.6 %).
    if (NP == 16 && qa_unit) mbar_wait(bar_qa_full, 0u);
    const uint64_t t_start = dev::globaltimer_ns();
    // Slots not holding QA weights (kDirect: q_norm's staged rows use those slots in every CTA).
    const int first_free = qa_unit || kDirect ? p.qa_slot0 : ST;
    RingPos rp;  // stage it
    for (int it = 0; it < qb_iters; ++it, rp.advance(ST)) {
      const int s = rp.slot;
      if (it >= ST) mbar_wait(bar_empty + 8u * s, rp.parity ^ 1u);  // consumed in round it / ST - 1
      else if (s >= first_free) mbar_wait(bar_qn, 0u);  // q_norm is done (so the QA weights are consumed)
      if (it > 0 && it < ST)  // the first fill paced (kRingPaceNs)
        while (dev::globaltimer_ns() < t_start + static_cast<uint64_t>(it) * kRingPaceNs) {
        }
      mbar_arrive_expect_tx(bar_full + 8u * s, static_cast<uint32_t>(kQbSlot));
      tma_load_weights_3d(base + L.ring + static_cast<uint32_t>(s * kQbSlot), &p.tmap_qb, bar_full + 8u * s, it * kStageK,
                          qb_row0, 0);
    }
    return;
  }

  // ======== workers (warps 1..11) ==================================================================
  const int wtid = tid - 32;  // 0..351
  // Measurement builds (phase_stamps.cuh): phases 0-2, 7, 8, 12-14, 48, 49 by worker 0; 3-6, 9-11 and
  // 16 + stage (CTAs 0, 1) by consumer 0.
  [[maybe_unused]] unsigned int stamp_rec = 0u;
  if (wtid == 0 || tid == 128) V4ATTN_STAMP_BEGIN(stamp_rec, stamps::kQChain, tid == 128 ? 15 : 0);
  if (wtid == 0) V4ATTN_STAMP_AT_TIME(stamp_rec, stamps::kQChain, 14, t_entry);
  // The loads of the CTA's constants: every load of a group is issued before its first shared-memory
  // store (the compiler does not move a global load above a store it cannot tell apart, so a loop of
  // load -> store costs a round trip per iteration). Only the QA weight scales are needed before the
  // QA loop; the rest (wq_b scales and the step's RoPE rows: ~3.5 KB and, for the RoPE rows, two
  // dependent round trips; the q_norm weights: wv below) is loaded by the helper warps while the
  // consumers run the QA loop (load_late_constants below). In phase 0 they had put those round
  // trips, behind the QA slice's bulk stream, between a CTA's start and its PDL wait: ~4.5 us for
  // the CTAs that start as the previous launch ends (session 16 stamps), i.e. on every layer's
  // critical path.
  const int n_swb = qb_unit ? (kQbBn / 32) * qb_blocks : 0;
  auto load_late_constants = [&](int t, int nt) {  // thread t of nt (the helpers: wtid of 96)
    constexpr int kSwbPer = 4, kRopePer = 6;  // V4.1 at NP 8: 320 and 512 over 96 threads
    const uint8_t* g_swb = p.qb_scale + static_cast<int64_t>(qb_row0 / 32) * qb_blocks;
    auto rope_pos = [&](int idx) -> int32_t { return idx / num::kRopeDim < p.T ? p.kv.pos[idx / num::kRopeDim] : -1; };
    auto rope_ok_at = [&](int32_t pos) { return pos >= 0 && pos < p.kv.max_pos; };
    auto rope_src = [&](int idx, int32_t pos) {
      return rope_ok_at(pos) ? __ldg(p.kv.table + static_cast<int64_t>(pos) * num::kRopeDim + idx % num::kRopeDim) : 0.0f;
    };
    uint8_t swb[kSwbPer];
    float tab[kRopePer];
    int32_t pos[kRopePer];
#pragma unroll
    for (int i = 0; i < kRopePer; ++i) pos[i] = t + i * nt < NP * num::kRopeDim ? rope_pos(t + i * nt) : -1;
#pragma unroll
    for (int i = 0; i < kSwbPer; ++i) swb[i] = t + i * nt < n_swb ? g_swb[t + i * nt] : uint8_t{0};
#pragma unroll
    for (int i = 0; i < kRopePer; ++i) tab[i] = rope_src(t + i * nt, pos[i]);
#pragma unroll
    for (int i = 0; i < kSwbPer; ++i)
      if (t + i * nt < n_swb) sw_b[t + i * nt] = num::f32_from_ue8m0(swb[i]);
    // The RoPE table rows of the step's positions (step metadata + constants), for the epilogue,
    // and each row's flag (position inside the table).
#pragma unroll
    for (int i = 0; i < kRopePer; ++i) {
      const int idx = t + i * nt;
      if (idx >= NP * num::kRopeDim) break;
      rope_tab[idx] = tab[i];
      if (idx % num::kRopeDim == 0) rope_ok[idx / num::kRopeDim] = rope_ok_at(pos[i]) ? 1 : 0;
    }
    for (int i = t + kSwbPer * nt; i < n_swb; i += nt) sw_b[i] = num::f32_from_ue8m0(g_swb[i]);
    for (int idx = t + kRopePer * nt; idx < NP * num::kRopeDim; idx += nt) {
      const int32_t ps = rope_pos(idx);
      rope_tab[idx] = rope_src(idx, ps);
      if (idx % num::kRopeDim == 0) rope_ok[idx / num::kRopeDim] = rope_ok_at(ps) ? 1 : 0;
    }
  };
  {
    constexpr int kSwaPer = 2;  // per worker at most (V4.1: 4 x 20 = 80); larger shapes take the tail loop
    const int n_swa = qa_unit ? (kQaBn / 32) * nkb : 0;
    const uint8_t* g_swa = p.qa_scale + static_cast<int64_t>(qa_tile * kQaBn / 32) * p.dim_blocks + kb_begin;
    auto swa_src = [&](int i) { return g_swa[(i / nkb) * p.dim_blocks + i % nkb]; };
    auto swa_dst = [&](int i) -> float& { return sw_a[(i / nkb) * p.qa_max_blocks + i % nkb]; };
    uint8_t swa[kSwaPer];
#pragma unroll
    for (int i = 0; i < kSwaPer; ++i) swa[i] = wtid + i * kWorkers < n_swa ? swa_src(wtid + i * kWorkers) : uint8_t{0};
#pragma unroll
    for (int i = 0; i < kSwaPer; ++i)
      if (wtid + i * kWorkers < n_swa) swa_dst(wtid + i * kWorkers) = num::f32_from_ue8m0(swa[i]);
    for (int i = wtid + kSwaPer * kWorkers; i < n_swa; i += kWorkers) swa_dst(i) = num::f32_from_ue8m0(swa_src(i));
    // The operands' rows >= T stay zero (and their scales 0): the wgmmas read NP rows.
    uint4* xf4 = reinterpret_cast<uint4*>(smem + L.xf);
    for (int i = wtid; i < (qb_iters * 2 * NP * kStageK) / 16; i += kWorkers) xf4[i] = make_uint4(0u, 0u, 0u, 0u);
    for (int i = wtid; i < qb_blocks * NP; i += kWorkers) sa_b[i] = 0.0f;
    for (int i = wtid; i < p.qa_max_blocks * NP; i += kWorkers) sa_a[i] = 0.0f;
  }
  named_barrier_sync(kBarWorkers, kWorkers);
  if (wtid == 0) mbar_arrive(bar_prologue);  // phase 0's loads have landed: the ring fill may start
  // The q_norm weights of the one chunk this worker normalises in phase 2 (q_norm's (b): chunk
  // wtid % (q_rank / 8) of every row it takes), into registers: constants, loaded here and first
  // used there, so the loads stay in flight through phase 1. In shared memory (5 KB, the helpers
  // storing all q_rank of them while the consumers ran the QA loop) the fused chain was 0.2-0.4 us
  // slower per launch (bench_qchain) and the cycles 0.65-1.0 % (perf.md session 22 run 10).
  const int row_chunks = p.q_rank / 8;
  const int qn_ch = wtid % row_chunks;
  float wv[detail::kChunk];
#pragma unroll
  for (int k = 0; k < detail::kChunk; ++k) wv[k] = __ldg(p.q_norm + qn_ch * 8 + k);
  // The workers' row / chunk mappings of phase 1's act quant (per_row chunks of the CTA's K range
  // per row) and phase 2's q_norm (row_chunks per q row) divide by run-time values: computed here,
  // before the PDL wait, and pinned (dev::pin_here), they are paid while the CTA waits. Left to
  // the compiler, each division (an I2F.RP / MUFU.RCP / F2I chain of ~30 instructions) ran right
  // after the PDL wait or the q hand-off, i.e. on the layer's critical path (Nsight Compute of the
  // chain at one row, session 32).
  const int aq_per_row = qa_unit ? nkb * 4 : 1;
  int aq_cr = wtid % aq_per_row, aq_sub = wtid / aq_per_row, aq_rpp = kWorkers / aq_per_row;
  int qn_sub = wtid / row_chunks, qn_rpp = kWorkers / row_chunks;
  dev::pin_here(aq_cr);
  dev::pin_here(aq_sub);
  dev::pin_here(aq_rpp);
  dev::pin_here(qn_sub);
  dev::pin_here(qn_rpp);

  dev::pdl_wait();  // x is the predecessor's output
  if (wtid == 0) V4ATTN_STAMP_AT(stamp_rec, stamps::kQChain, 1);

  const int ctid = tid - 128;  // consumers: 0..255
  const bool consumer = warp >= 4;
  const int wgc = ctid >> 7, cw = (ctid >> 5) & 3, g4 = lane >> 2, t4 = lane & 3;
  const int ld_row = 16 * cw + (lane & 7) + 8 * ((lane >> 3) & 1), ld_chunk = lane >> 4;

  // ---- phase 1: QA units ----------------------------------------------------------------------------
  if (qa_unit) {
    {  // Act quant of the CTA's K range of x into the QA operand (f16) and its scales: worker w
       // takes chunk w % per_row of rows w / per_row + k * rows_per_pass.
      const int jb = aq_cr >> 2, sub = aq_cr & 3;
      uint8_t* xf_blk = smem + L.xf + (jb >> 2) * 2 * NP * kStageK;
      const RowChunks<false, kActQuantAhead> rows{p.x + (kb_begin + jb) * 32 + sub * 8, p.x_stride, p.T, aq_sub,
                                                  aq_rpp};
      rows.passes(rows.prefetch(), [&](int r, bool act, float (&v)[detail::kChunk]) {
        int e = 0;
        const uint2 codes = detail::act_quant_chunk<4>(v, e);
        if (act) {
          put_codes_f16<NP>(xf_blk, jb & 3, sub, r, codes);
          if (sub == 0) sa_a[jb * NP + r] = num::f32_from_scale_exp(e);
        }
      });
      fence_proxy_async_smem();
      named_barrier_sync(kBarWorkers, kWorkers);
      if (wtid == 0) V4ATTN_STAMP_AT(stamp_rec, stamps::kQChain, 2);
    }
    if (consumer) {
      BlockOps<1, NP> ops{0u, 0u, wgc, cw, ld_row, ld_chunk, t4};
      float acc[1][R], d[1][R], d2[1][R];
#pragma unroll
      for (int i = 0; i < R; ++i) acc[0][i] = 0.0f;
      const float* sw_grp = sw_a + (wgc * 2 + (cw >> 1)) * p.qa_max_blocks;
      mbar_wait(bar_qa_full, 0u);
      if (ctid == 0) V4ATTN_STAMP_AT(stamp_rec, stamps::kQChain, 3);
      for (int it = 0; it < qa_iters; ++it) {
        ops.w_slot = base + L.ring + static_cast<uint32_t>(p.qa_slot0 * kQbSlot + it * kQaSlot);
        ops.xf_slot = base + L.xf + static_cast<uint32_t>(it * 2 * NP * kStageK);
        const int b0 = it * kBlocksPerStage;
        const int nb = min(kBlocksPerStage, nkb - b0);
        if (nb == kBlocksPerStage) {
          if constexpr (kDirect)  // measured: the four-block stage +0.9 % at decode bs 1 in this form
            run_full_stage<1, NP>(ops, [&](int, int j) { return sw_grp[b0 + j]; }, sa_a + b0 * NP, acc, d, d2);
          else
            run_full_stage_all4<1, NP>(ops, [&](int, int j) { return sw_grp[b0 + j]; }, sa_a + b0 * NP, acc);
        } else {
          for (int j = 0; j < nb; ++j) {
            uint32_t a[1][2][4];
            const float swv[1] = {sw_grp[b0 + j]};
            ops.load(j, a, [](int) {});
            ops.issue(j, a, d);
            wgmma_wait<0>();
            ops.fold(sa_a + (b0 + j) * NP, swv, d, acc);
          }
        }
      }
      if (ctid == 0) V4ATTN_STAMP_AT(stamp_rec, stamps::kQChain, 4);
      // The fp32 partial tile, then the split-K reduction by the tile's last CTA (v3's order).
      // Release / acquire: the barrier orders every consumer's partial stores before consumer 0's
      // acq_rel arrival; the last arriver's acquire (and the barrier after it) orders the other
      // splits' partials before its reads.
      const int64_t tile_elems = static_cast<int64_t>(p.T) * p.n_qa;
      float* part = p.partials + qa_split * tile_elems;
#pragma unroll
      for (int i = 0; i < R; ++i) {
        const int col = qa_tile * kQaBn + wgc * 64 + 16 * cw + g4 + ((i & 2) ? 8 : 0);
        const int m = 8 * (i >> 2) + 2 * t4 + (i & 1);
        if (m < p.T) part[static_cast<int64_t>(m) * p.n_qa + col] = acc[0][i];
      }
      named_barrier_sync(kBarConsumers, kConsumerThreads);
      uint32_t* tile_counter = counters + kTile0 + qa_tile;
      if (kDirect && qa_tile < p.q_tiles) {
        // The partial is counted (release: the barrier ordered every consumer's stores before it);
        // every CTA adds the q partials in phase 2.
        if (ctid == 0) {
          red_add_release_gpu(counters + kQParts, 1u);
          V4ATTN_STAMP_AT(stamp_rec, stamps::kQChain, 5);
        }
      } else {
        if (ctid == 0) *s_flag = atom_add_acq_rel_gpu(tile_counter, 1u) == static_cast<uint32_t>(p.qa_splits - 1) ? 1 : 0;
        named_barrier_sync(kBarConsumers, kConsumerThreads);
        if (ctid == 0) V4ATTN_STAMP_AT(stamp_rec, stamps::kQChain, 5);
        if (*s_flag) {
          // Every load of the thread's elements first (one L2 latency, not one per element), then
          // the sums in split order ((P0 + P1) + P2) + ..., as v3.
          constexpr int kPer = kQChainMaxRows * kQaBn / kConsumerThreads;  // elements per thread, at most
          float part_v[kPer][kMaxSplits];
#pragma unroll
          for (int e = 0; e < kPer; ++e) {
            const int idx = ctid + e * kConsumerThreads;
            if (idx >= p.T * kQaBn) break;
            const int64_t off = static_cast<int64_t>(idx / kQaBn) * p.n_qa + qa_tile * kQaBn + idx % kQaBn;
#pragma unroll
            for (int sp = 0; sp < kMaxSplits; ++sp)
              if (sp < p.qa_splits) part_v[e][sp] = __ldcg(p.partials + sp * tile_elems + off);
          }
#pragma unroll
          for (int e = 0; e < kPer; ++e) {
            const int idx = ctid + e * kConsumerThreads;
            if (idx >= p.T * kQaBn) break;
            const float sum = sum_in_split_order(part_v[e], p.qa_splits);
            p.qkv_a[static_cast<int64_t>(idx / kQaBn) * p.qkv_a_stride + qa_tile * kQaBn + idx % kQaBn] = num::bf16_from_f32(sum);
          }
          named_barrier_sync(kBarConsumers, kConsumerThreads);
          if (ctid == 0) {
            *tile_counter = 0u;  // every split of the tile has arrived (read again only by the next launch)
            red_add_release_gpu(counters + (qa_tile < p.q_tiles ? kQDone : kKvDone), 1u);
            V4ATTN_STAMP_AT(stamp_rec, stamps::kQChain, 6);
          }
        }
      }
    }
  }

  // The helpers' late constants (above): during the QA loop in QA units; visible to every worker
  // after phase 2's first barrier (the wq_b scales and RoPE rows are read in phase 3).
  if (!consumer) load_late_constants(wtid, kHelpers);

  // ---- phase 2: q_norm of every row into the wq_b operand -------------------------------------------
  if (wtid == 0) {
    if (kDirect) spin_until(counters + kQParts, static_cast<uint32_t>(p.q_tiles * p.qa_splits));
    else spin_until(counters + kQDone, static_cast<uint32_t>(p.q_tiles));
    V4ATTN_STAMP_AT(stamp_rec, stamps::kQChain, 7);
  }
  named_barrier_sync(kBarWorkers, kWorkers);  // also: the QA operand (aliased) is no longer read
  {
    const int ch = qn_ch, b = ch >> 2;
    // Where q_norm reads qkv_a's q columns: the reducers' global rows, or (kDirect) this CTA's own
    // sums of the partials staged in the QA weight slots ([T][q_rank] bf16).
    bf16_t* const stage = reinterpret_cast<bf16_t*>(smem + L.ring + static_cast<uint32_t>(p.qa_slot0 * kQbSlot));
    const bf16_t* const q_src = kDirect ? stage : p.qkv_a;
    const int64_t q_stride = kDirect ? static_cast<int64_t>(p.q_rank) : p.qkv_a_stride;
    if constexpr (kDirect) {
      // Worker w: chunk w % row_chunks of rows w / row_chunks + k * rows_per_pass, all splits' loads
      // first, then ((P0 + P1) + P2) + ... as the tile reducer adds them.
      const int sub_r = qn_sub, rows_per_pass = qn_rpp;
      const int64_t tile_elems = static_cast<int64_t>(p.T) * p.n_qa;
#pragma unroll 1
      for (int r = sub_r; sub_r < rows_per_pass && r < p.T; r += rows_per_pass) {
        const float* src = p.partials + static_cast<int64_t>(r) * p.n_qa + ch * 8;
        static_assert(detail::kChunk == 8, "a chunk is two float4");
        float v[detail::kChunk][kMaxSplits];  // element k of the chunk, split sp
#pragma unroll
        for (int sp = 0; sp < kMaxSplits; ++sp)
          if (sp < p.qa_splits) {
            const float4 lo = __ldcg(reinterpret_cast<const float4*>(src + sp * tile_elems));
            const float4 hi = __ldcg(reinterpret_cast<const float4*>(src + sp * tile_elems) + 1);
            v[0][sp] = lo.x, v[1][sp] = lo.y, v[2][sp] = lo.z, v[3][sp] = lo.w;
            v[4][sp] = hi.x, v[5][sp] = hi.y, v[6][sp] = hi.z, v[7][sp] = hi.w;
          }
        float sum[detail::kChunk];
#pragma unroll
        for (int k = 0; k < detail::kChunk; ++k) sum[k] = sum_in_split_order(v[k], p.qa_splits);
        const uint4 packed = detail::pack_bf16x8(sum);
        *reinterpret_cast<uint4*>(stage + static_cast<int64_t>(r) * p.q_rank + ch * 8) = packed;
        if (c == r) *reinterpret_cast<uint4*>(p.qkv_a + static_cast<int64_t>(r) * p.qkv_a_stride + ch * 8) = packed;
      }
      named_barrier_sync(kBarWorkers, kWorkers);
    }
    // (b)'s mapping, and its first passes' chunks loaded before (a) so that all the loads overlap.
    const RowChunks<!kDirect, kQNormAhead> rows{q_src + ch * 8, q_stride, p.T, qn_sub, qn_rpp};
    const auto first = rows.prefetch();
    // (a) One warp per row: the sum of squares in the LaneSum order (lane l: chunks l, l + 32, ...;
    //     all loads first), rstd into shared memory.
    constexpr int kMaxPerLane = 8;  // q_rank <= 2048
    const int per_lane = p.q_rank / 256;
    for (int r = warp - 1; r < p.T; r += kWorkers / 32) {
      const bf16_t* row = q_src + static_cast<int64_t>(r) * q_stride;
      uint4 raw[kMaxPerLane];
#pragma unroll
      for (int i = 0; i < kMaxPerLane; ++i)
        if (i < per_lane) {
          const uint4* src = reinterpret_cast<const uint4*>(row + (lane + 32 * i) * 8);
          raw[i] = kDirect ? *src : __ldcg(src);
        }
      float ss = 0.0f;
#pragma unroll
      for (int i = 0; i < kMaxPerLane; ++i) {
        if (i >= per_lane) break;
        float v[detail::kChunk];
        detail::unpack_bf16x8(raw[i], v);
#pragma unroll
        for (int k = 0; k < detail::kChunk; ++k) ss = num::add_rn(ss, num::mul_rn(v[k], v[k]));
      }
      const float rstd = num::rmsnorm_rstd(dev::warp_lane_sum(ss), static_cast<int>(p.q_rank), p.eps);
      if (lane == 0) s_rstd[r] = rstd;
    }
    named_barrier_sync(kBarWorkers, kWorkers);
    if (wtid == 0) V4ATTN_STAMP_AT(stamp_rec, stamps::kQChain, 48);
    // (b) Worker w normalises and quantises chunk w % row_chunks of rows w / row_chunks + k *
    //     rows_per_pass (4 consecutive lanes = one 32-block).
    uint8_t* xf_blk = smem + L.xf + (b >> 2) * 2 * NP * kStageK;
    rows.passes(first, [&](int r, bool act, float (&v)[detail::kChunk]) {
      detail::rmsnorm_apply_chunk(v, act ? s_rstd[r] : 1.0f, wv);
      int e = 0;
      const uint2 codes = detail::act_quant_chunk<4>(v, e);
      if (!act) return;  // lanes past the rows took part in the amax shuffles only
      put_codes_f16<NP>(xf_blk, b & 3, ch & 3, r, codes);
      if ((ch & 3) == 0) sa_b[b * NP + r] = num::f32_from_scale_exp(e);
      if (c == r) {  // CTA r: row r's qr, codes and scales (the unfused chain's outputs)
        detail::store_bf16x8(p.qr + static_cast<int64_t>(r) * p.q_rank + ch * 8, v);
        *reinterpret_cast<uint2*>(p.qr_codes + static_cast<int64_t>(r) * p.q_rank + ch * 8) = codes;
        if ((ch & 3) == 0) p.qr_scales[static_cast<int64_t>(r) * (p.q_rank / 32) + b] = num::ue8m0_from_exp(e);
      }
    });
    if (wtid == 0) V4ATTN_STAMP_AT(stamp_rec, stamps::kQChain, 49);
    fence_proxy_async_smem();
  }
  named_barrier_sync(kBarWorkers, kWorkers);
  if (wtid == 0) V4ATTN_STAMP_AT(stamp_rec, stamps::kQChain, 8);
  if (wtid == 0) mbar_arrive(bar_qn);  // the QA slots' wq_b stages may go out (see the producer)

  if (!consumer) {
    // ======== helpers: the window-K row of this CTA, then the exit count ==========================
    // Work item (row, part): pairs [96 part, 96 part + 96) of row `row`, one pair per helper (the
    // exact chain of a pair is long, and it shares the SM with the wq_b loop), items on the last
    // CTAs of the grid (the last ones are not QA units).
    const int kv_item = p.grid - 1 - c;
    if (kv_item < p.T * kKvParts) {
      if (wtid == 0) {
        spin_until(counters + kKvDone, static_cast<uint32_t>(p.qa_tiles - p.q_tiles));
        V4ATTN_STAMP_AT(stamp_rec, stamps::kQChain, 12);
      }
      named_barrier_sync(kBarHelpers, kHelpers);
      const int j = (kv_item % kKvParts) * kHelpers + wtid;  // whole 32-pair groups per warp
      if (j < detail::window_k::kPairs) detail::window_k_store_pair<false>(p.kv, kv_item / kKvParts, j, lane);
      if (wtid == 0) V4ATTN_STAMP_AT(stamp_rec, stamps::kQChain, 13);
    }
    if (wtid == 0) {
      const uint32_t prev = atomicAdd(counters + kExits, 1u);
      if (prev == static_cast<uint32_t>(p.grid - 1)) {  // every CTA is past its waits
        counters[kQDone] = 0u;
        counters[kKvDone] = 0u;
        counters[kExits] = 0u;
        counters[kQParts] = 0u;
      }
    }
    return;
  }
  if (!qb_unit) return;

  // ---- phase 3: the wq_b GEMM of tile c (v2's loop, overlap 2) + the RoPE store -------------------
  // One stage at a time: v2's pairs of stages (wgmma_fp8::run_stage_pair) measured slower here
  // (session 29: cycles +2..+3 % at 1-8 rows, bench_qchain +0.7..1 %).
  BlockOps<kQbMt, NP> ops{0u, 0u, wgc, cw, ld_row, ld_chunk, t4};
  float acc[kQbMt][R], d[kQbMt][R], d2[kQbMt][R];
#pragma unroll
  for (int mt = 0; mt < kQbMt; ++mt)
#pragma unroll
    for (int i = 0; i < R; ++i) acc[mt][i] = 0.0f;
  RingPos rp;  // stage it
  for (int it = 0; it < qb_iters; ++it, rp.advance(ST)) {
    const int s = rp.slot;
    mbar_wait(bar_full + 8u * s, rp.parity);
    if (ctid == 0 && (it == 0 || c < 2)) V4ATTN_STAMP_AT(stamp_rec, stamps::kQChain, it == 0 ? 9 : 16 + it);
    ops.w_slot = base + L.ring + static_cast<uint32_t>(s * kQbSlot);
    ops.xf_slot = base + L.xf + static_cast<uint32_t>(it * 2 * NP * kStageK);
    const int b0 = it * kBlocksPerStage;
    run_full_stage<kQbMt, NP>(
        ops, [&](int mt, int j) { return sw_b[((wgc * kQbMt + mt) * 2 + (cw >> 1)) * qb_blocks + b0 + j]; },
        sa_b + b0 * NP, acc, d, d2);
    mbar_arrive(bar_empty + 8u * s);
  }
  dev::pdl_launch_dependents();
  if (ctid == 0) V4ATTN_STAMP_AT(stamp_rec, stamps::kQChain, 10);

  // RoPE store epilogue (v2's kRope form, the same staged store): column n = dim n % 512 of head
  // n / 512; the pair partner (n ^ 1) is lane ^ 4's element. Table rows loaded by the helpers. The
  // tile is staged in ring slot 0 (every stage has been consumed: the producer issues nothing after
  // the last one) and written in 16-byte row pieces; per element from the fragment layout it had
  // been 2-byte stores and ~40 instructions per element (Nsight Compute, session 16).
  // A row whose position is outside the table is counted once, from its flag (a loop over the
  // positions in global memory here would put T round trips before this CTA's exit).
  if (c == 0 && ctid < p.T && !rope_ok[ctid]) dev::count_error(p.kv.err_count);
  named_barrier_sync(kBarConsumers, kConsumerThreads);  // every consumer is past its last ring read
  wgmma_fp8::store_tile_bf16_staged<kQbMt, NP, kConsumerThreads>(
      [&](int mt, int i) {
        const int n = qb_row0 + (wgc * kQbMt + mt) * 64 + 16 * cw + g4 + ((i & 2) ? 8 : 0);
        const int m = 8 * (i >> 2) + 2 * t4 + (i & 1);
        return wgmma_fp8::rope_store_bf16(acc[mt][i], n, rope_tab, m);  // m < NP
      },
      [&](int m) { return rope_ok[m] != 0; }, smem + L.ring, p.q_pad, p.q_pad_stride, p.T, p.n_qb, qb_row0, wgc, cw, g4,
      t4, ctid, p.q_pad_vec, kBarConsumers);
  if (ctid == 0) V4ATTN_STAMP_AT(stamp_rec, stamps::kQChain, 11);
}

// Everything the launcher and qchain_fused_supported derive from a shape.
struct QcPlan {
  bool ok = false;
  std::string why;
  int np = 0, n_qa = 0, n_qb = 0, qa_tiles = 0, q_tiles = 0, qa_splits = 0, qa_units = 0, qa_max_blocks = 0;
  int qb_tiles = 0, grid = 0, ring = 0, qa_slot0 = 0;
  size_t smem = 0;
  // The direct q hand-off (QChainFusedParams::q_direct) takes the shape: the T staged q rows fit in
  // the QA weight slots.
  bool direct_ok = false;
};

}  // namespace
namespace detail {
// The SMs this process can have at once on `device`: the device's count, limited by the current
// context's execution affinity when it is the device's (an MPS client context created with an SM
// limit) and by CUDA_MPS_ACTIVE_THREAD_PERCENTAGE. The fused chain's CTAs spin on each other, so a
// grid larger than what the process may hold at once would never finish: count low, never high.
int device_sm_count(int device) {
  int current = 0;
  V4_CUDA_CHECK(cudaGetDevice(&current));
  if (device < 0) device = current;
  int sms = 0;
  V4_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  if (device == current) {
    // The affinity is the current context's: make sure there is one (cudaSetDevice initialises the
    // primary context since CUDA 12, and is allowed during a stream capture, unlike cudaFree(0)).
    // Without it a first call before any other CUDA work failed with CUDA_ERROR_INVALID_CONTEXT
    // (harmless, the count stayed the attribute's, but compute-sanitizer reports it).
    V4_CUDA_CHECK(cudaSetDevice(current));
    using GetAffinity = CUresult (*)(CUexecAffinityParam*, CUexecAffinityType);
    static const GetAffinity get = [] {
      void* f = nullptr;
      cudaDriverEntryPointQueryResult q{};
      if (cudaGetDriverEntryPointByVersion("cuCtxGetExecAffinity", &f, 11040, cudaEnableDefault, &q) != cudaSuccess ||
          q != cudaDriverEntryPointSuccess) {
        (void)cudaGetLastError();
        return static_cast<GetAffinity>(nullptr);
      }
      return reinterpret_cast<GetAffinity>(f);
    }();
    CUexecAffinityParam aff{};
    if (get != nullptr && get(&aff, CU_EXEC_AFFINITY_TYPE_SM_COUNT) == CUDA_SUCCESS && aff.param.smCount.val > 0)
      sms = std::min(sms, static_cast<int>(aff.param.smCount.val));
  }
  if (const char* pct = std::getenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"); pct != nullptr && *pct != '\0') {
    const double v = std::strtod(pct, nullptr);
    if (v > 0.0 && v < 100.0) sms = std::min(sms, static_cast<int>(sms * v / 100.0));
  }
  return sms;
}
}  // namespace detail
using detail::device_sm_count;
namespace {

QcPlan make_plan(int T, int64_t dim, int64_t q_rank, int H, int sm_count) {
  QcPlan pl;
  auto no = [&](const std::string& why) {
    pl.why = why;
    return pl;
  };
  if (T < 1 || T > kQChainMaxRows) return no("T must be 1.." + std::to_string(kQChainMaxRows));
  if (dim <= 0 || dim % 128 != 0) return no("dim must be a positive multiple of 128");
  if (q_rank <= 0 || q_rank % 256 != 0 || q_rank > 2048) return no("q_rank must be a multiple of 256, <= 2048");
  if (H <= 0) return no("H must be positive");
  pl.np = T <= 8 ? 8 : 16;
  pl.n_qa = static_cast<int>(q_rank) + kKvCols;
  pl.n_qb = H * kRopeHeadDim;
  const GemmPlan qa = plan_gemm(GemmVersion::kWgmmaPipelined, T, pl.n_qa, dim, 1);
  if (qa.block_n != kQaBn) return no("the QA GEMM's v3 plan does not use 128-column tiles");
  pl.qa_tiles = qa.tiles_n;
  pl.q_tiles = static_cast<int>(q_rank / kQaBn);
  pl.qa_splits = qa.splits;
  pl.qa_units = pl.qa_tiles * pl.qa_splits;
  if (pl.qa_splits > kMaxSplits) return no("the QA GEMM's v3 plan has more than 8 splits");
  if (kTile0 + pl.qa_tiles > kCounterBytes / 4) return no("too many QA tiles");
  const int dim_blocks = static_cast<int>(dim / 32);
  pl.qa_max_blocks = (dim_blocks + pl.qa_splits - 1) / pl.qa_splits;
  // The predicate holds exactly when v2's plan is one split of 256-column tiles (two m64 tiles per
  // warpgroup), the layout of phase 3 and its RoPE epilogue.
  if (!gemm_v2_rope_store_supported(T, pl.n_qb, q_rank)) return no("the wq_b GEMM has no one-split rope-store plan");
  pl.qb_tiles = pl.n_qb / kQbBn;
  pl.grid = std::max({pl.qb_tiles, pl.qa_units, T * kKvParts});
  if (pl.grid > sm_count)
    return no("grid " + std::to_string(pl.grid) + " exceeds the " + std::to_string(sm_count) + " SMs (co-residency)");
  const int qb_blocks = static_cast<int>(q_rank / 32);
  const int qa_stage_bytes = ((pl.qa_max_blocks + 3) / 4) * kQaSlot;
  const int qa_slots = (qa_stage_bytes + kQbSlot - 1) / kQbSlot;
  const SmemLayout fixed = smem_layout(pl.np, 0, qb_blocks, pl.qa_max_blocks);
  const int fixed_bytes = static_cast<int>(fixed.total) + kSmemAlign + 2 * kMaxRing * 8;
  pl.ring = std::min(kMaxRing, (kSmemLimit - fixed_bytes) / kQbSlot);
  pl.ring = std::min(pl.ring, qb_blocks / kBlocksPerStage);
  if (pl.ring < qa_slots + 1) return no("shared memory holds too few ring slots beside the QA weights");
  pl.qa_slot0 = pl.ring - qa_slots;
  pl.smem = smem_layout(pl.np, pl.ring, qb_blocks, pl.qa_max_blocks).total + kSmemAlign;
  pl.direct_ok = static_cast<int64_t>(T) * q_rank * 2 <= static_cast<int64_t>(qa_slots) * kQbSlot;
  pl.ok = true;
  return pl;
}

// The window-K store of the chain's kv columns: p.kv with the fields the chain owns (qchain.h).
WindowKStoreParams window_k_of(const QChainFusedParams& p) {
  WindowKStoreParams kv = p.kv;
  kv.kv = p.qkv_a + p.q_rank;
  kv.kv_row_stride = p.qkv_a_stride;
  kv.T = p.T;
  return kv;
}

size_t partial_bytes(int T_max, int64_t q_rank, int splits) {
  return static_cast<size_t>(splits) * static_cast<size_t>(T_max) * static_cast<size_t>(q_rank + kKvCols) * sizeof(float);
}

}  // namespace

bool qchain_fused_supported(int T, int64_t dim, int64_t q_rank, int H, int device, bool q_direct) {
  const QcPlan pl = make_plan(T, dim, q_rank, H, device_sm_count(device));
  return pl.ok && (!q_direct || pl.direct_ok);
}

QChainFusedShape qchain_fused_shape(int T, int64_t dim, int64_t q_rank, int H, int sm_count) {
  const QcPlan pl = make_plan(T, dim, q_rank, H, sm_count);
  QChainFusedShape sh;
  if (pl.ok) {
    sh.grid = pl.grid;
    sh.ring = pl.ring;
    sh.direct_ok = pl.direct_ok;
  }
  return sh;
}

size_t qchain_fused_workspace_bytes(int T_max, int64_t dim, int64_t q_rank) {
  if (T_max < 1 || T_max > kQChainMaxRows || dim <= 0 || q_rank <= 0) return 0;
  // v3's split count depends on (n, k) only; take it at T_max.
  const GemmPlan qa = plan_gemm(GemmVersion::kWgmmaPipelined, T_max, q_rank + kKvCols, dim, 1);
  return kCounterBytes + partial_bytes(T_max, q_rank, qa.splits);
}

void init_qchain_workspace(void* workspace, size_t bytes, cudaStream_t stream) {
  if (workspace == nullptr || bytes < static_cast<size_t>(kCounterBytes))
    throw std::invalid_argument("init_qchain_workspace: workspace of at least " + std::to_string(kCounterBytes) + " bytes");
  V4_CUDA_CHECK(cudaMemsetAsync(workspace, 0, kCounterBytes, stream));
}

void run_qchain_unfused(const QChainFusedParams& p, uint8_t* x_codes, uint8_t* x_scales, int v3_int_mask,
                        cudaStream_t stream, bool pdl) {
  const int64_t n_qa = p.q_rank + kKvCols, n_qb = static_cast<int64_t>(p.H) * kRopeHeadDim;
  ActQuantParams a;
  a.x = p.x;
  a.x_stride = p.x_stride;
  a.q = x_codes;
  a.q_stride = p.dim;
  a.scale = x_scales;
  a.scale_stride = p.dim / 32;
  a.m = p.T;
  a.k = p.dim;
  a.warps_per_cta = act_quant_auto_warps(p.T);  // the stack's automatic rule (GpuStackOptions::aq_warps)
  run_act_quant_fp8(a, stream, pdl);
  // The two fp8 GEMMs: activations (codes, ue8m0 scales, dense rows of k) x a dense [n, k] weight.
  auto fp8 = [&p](const uint8_t* a_q, const uint8_t* a_scale, int64_t k, const uint8_t* w, const uint8_t* w_scale,
                  bf16_t* out, int64_t out_stride, int64_t n) {
    Fp8GemmParams g;
    g.a_q = a_q;
    g.a_stride = k;
    g.a_scale = a_scale;
    g.a_scale_stride = k / 32;
    g.w = w;
    g.w_scale = w_scale;
    g.out = out;
    g.out_stride = out_stride;
    g.m = p.T;
    g.n = n;
    g.k = k;
    return g;
  };
  Fp8GemmParams g = fp8(x_codes, x_scales, p.dim, p.wqkv_a, p.wqkv_a_scale, p.qkv_a, p.qkv_a_stride, n_qa);
  g.v3_int_mask = v3_int_mask;
  run_gemm_fp8(g, GemmWorkspace{}, GemmVersion::kWgmmaPipelined, stream, pdl);
  RmsNormParams n;
  n.x = p.qkv_a;
  n.x_stride = p.qkv_a_stride;
  n.w = p.q_norm;
  n.eps = p.eps;
  n.y = p.qr;
  n.y_stride = p.q_rank;
  n.q_codes = p.qr_codes;
  n.q_stride = p.q_rank;
  n.q_scales = p.qr_scales;
  n.s_stride = p.q_rank / 32;
  n.rows = p.T;
  n.n = static_cast<int>(p.q_rank);
  run_rmsnorm(n, stream, pdl);
  Fp8GemmParams b = fp8(p.qr_codes, p.qr_scales, p.q_rank, p.wq_b, p.wq_b_scale, p.q_pad, p.q_pad_stride, n_qb);
  b.rope_pos = p.kv.pos;
  b.rope_table = p.kv.table;
  b.rope_max_pos = p.kv.max_pos;
  b.rope_err = p.kv.err_count;
  run_gemm_fp8_rope_store(b, stream, pdl);
  run_window_k_store(window_k_of(p), stream, pdl);
}

void run_qchain_fused(const QChainFusedParams& p, cudaStream_t stream, bool pdl) {
  using detail::require;
  using detail::require_aligned;
  using detail::require_ptr;
  const char* who = "run_qchain_fused";
  const QcPlan pl = make_plan(p.T, p.dim, p.q_rank, p.H, device_sm_count(-1));
  require(pl.ok, who, "unsupported shape: " + pl.why);
  require(!p.q_direct || pl.direct_ok, who, "q_direct: the staged q rows do not fit in the QA weight slots");
  require_ptr(p.x, who, "x");
  require_ptr(p.wqkv_a, who, "wqkv_a");
  require_ptr(p.wqkv_a_scale, who, "wqkv_a_scale");
  require_ptr(p.q_norm, who, "q_norm");
  require_ptr(p.wq_b, who, "wq_b");
  require_ptr(p.wq_b_scale, who, "wq_b_scale");
  require_ptr(p.qkv_a, who, "qkv_a");
  require_ptr(p.qr, who, "qr");
  require_ptr(p.qr_codes, who, "qr_codes");
  require_ptr(p.qr_scales, who, "qr_scales");
  require_ptr(p.q_pad, who, "q_pad");
  require_ptr(p.workspace, who, "workspace");
  require(p.x_stride >= p.dim && p.x_stride % 8 == 0, who, "x_stride must be >= dim and a multiple of 8");
  require(p.qkv_a_stride >= pl.n_qa && p.qkv_a_stride % 8 == 0, who, "qkv_a_stride must be >= q_rank + 512, a multiple of 8");
  require(p.q_pad_stride >= pl.n_qb, who, "q_pad_stride must be >= H * 512");
  require_aligned(p.x, 16, who, "x");
  require_aligned(p.wqkv_a, 16, who, "wqkv_a");
  require_aligned(p.wq_b, 16, who, "wq_b");
  require_aligned(p.qkv_a, 16, who, "qkv_a");
  require_aligned(p.qr, 16, who, "qr");
  require_aligned(p.qr_codes, 8, who, "qr_codes");
  require(p.workspace_bytes >= kCounterBytes + partial_bytes(p.T, p.q_rank, pl.qa_splits), who,
          "workspace too small (qchain_fused_workspace_bytes)");
  require_aligned(p.workspace, 256, who, "workspace");
  // The window-K part: the same checks as run_window_k_store.
  const WindowKStoreParams kv = window_k_of(p);
  require(kv.kind == CacheKind::kWindowV41 || kv.kind == CacheKind::kWindowV4, who, "kv.kind must be kWindowV41 or kWindowV4");
  detail::require_cache(kv.layout, kv.kind, kv.cache, kv.n_slots, who);
  require_ptr(kv.kv_norm, who, "kv.kv_norm");
  require_aligned(kv.kv_norm, 16, who, "kv.kv_norm");
  require_ptr(kv.pos, who, "kv.pos");
  require_ptr(kv.swa_loc, who, "kv.swa_loc");
  detail::require_table(kv.table, kv.max_pos, who);

  QcParams t{};
  t.tmap_qa = detail::make_byte_tensor_map_sw128(who, p.wqkv_a, static_cast<uint64_t>(p.dim), static_cast<uint64_t>(pl.n_qa), 1,
                                                 static_cast<uint64_t>(p.dim), static_cast<uint64_t>(p.dim) * pl.n_qa, kStageK, kQaBn);
  t.tmap_qb = detail::make_byte_tensor_map_sw128(who, p.wq_b, static_cast<uint64_t>(p.q_rank), static_cast<uint64_t>(pl.n_qb), 1,
                                                 static_cast<uint64_t>(p.q_rank), static_cast<uint64_t>(p.q_rank) * pl.n_qb, kStageK,
                                                 kQbBn);
  t.x = p.x;
  t.x_stride = p.x_stride;
  t.qa_scale = p.wqkv_a_scale;
  t.qb_scale = p.wq_b_scale;
  t.q_norm = p.q_norm;
  t.eps = p.eps;
  t.qkv_a = p.qkv_a;
  t.qkv_a_stride = p.qkv_a_stride;
  t.qr = p.qr;
  t.qr_codes = p.qr_codes;
  t.qr_scales = p.qr_scales;
  t.q_pad = p.q_pad;
  t.q_pad_stride = p.q_pad_stride;
  t.q_pad_vec = detail::aligned_to(p.q_pad, 16) && p.q_pad_stride % 8 == 0 ? 2 : 0;
  t.kv = kv;
  t.counters = static_cast<uint32_t*>(p.workspace);
  t.partials = reinterpret_cast<float*>(static_cast<uint8_t*>(p.workspace) + kCounterBytes);
  t.T = p.T;
  t.dim_blocks = static_cast<int>(p.dim / 32);
  t.n_qa = pl.n_qa;
  t.q_rank = static_cast<int>(p.q_rank);
  t.n_qb = pl.n_qb;
  t.qa_tiles = pl.qa_tiles;
  t.q_tiles = pl.q_tiles;
  t.qa_splits = pl.qa_splits;
  t.qa_units = pl.qa_units;
  t.qa_max_blocks = pl.qa_max_blocks;
  t.ring = pl.ring;
  t.qa_slot0 = pl.qa_slot0;
  t.grid = pl.grid;
  auto kernel = pl.np == 8 ? (p.q_direct ? qchain_fused_kernel<8, true> : qchain_fused_kernel<8, false>)
                           : (p.q_direct ? qchain_fused_kernel<16, true> : qchain_fused_kernel<16, false>);
  detail::set_max_dynamic_smem(kernel, pl.smem);
  LaunchConfig cfg;
  cfg.grid = dim3(static_cast<unsigned>(pl.grid));
  cfg.block = dim3(kThreads);
  cfg.smem_bytes = pl.smem;
  cfg.stream = stream;
  cfg.pdl = pdl;
  launch_kernel("qchain_fused", kernel, cfg, t);
}

}  // namespace v4attn::kernels
