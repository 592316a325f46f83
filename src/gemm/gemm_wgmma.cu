// v2 of the fp8 GEMM: Hopper wgmma (f16 x f16 -> f32) with the weights streamed by TMA.
//
// Grid (tiles_n, S, groups), block 384 = 3 warpgroups, one CTA per SM (~130-220 KB of shared
// memory). Registers: 168 per thread at launch (384 threads, one CTA per SM); the producer
// warpgroup gives back down to 40 (setmaxnreg.dec) and the consumers take 232 (setmaxnreg.inc):
// 128 * 40 + 256 * 232 = 384 * 168, so the CTA's pool covers it exactly (DeepGEMM's split).
// One CTA owns block_n = 128 * MT weight rows (rows tile * block_n ..) x all m tokens x one
// contiguous range of K blocks (split s of S), like v1 (S depends only on (n, k, groups), the same
// fixed-order split-K reduction, so a token's output never depends on the other tokens of the batch).
//
// Roles:
//  - warpgroup 0, warp 0, lane 0: producer. Per stage (128 bytes of K = 4 K blocks) one TMA box of
//    the weights [block_n rows x 128 B] and one of the activation codes [NP rows x 128 B] (NP = m
//    rounded up to 8; rows >= m are zero-filled by the TMA unit), both 128B-swizzled, onto the
//    stage's `full` mbarrier (expected bytes = both boxes). Stages form a ring of p.stages slots
//    (as deep as shared memory allows, up to 8); a slot is refilled after its `empty` barrier.
//    Weight boxes of the first ring fill are issued BEFORE dev::pdl_wait() (constant data), the
//    activation boxes after it.
//  - warpgroup 0, warps 1..3: converters. wgmma has no e4m3 x f16 form and the fp8 wgmma is not
//    exact (below), so the activation codes of each stage are widened to f16 (exact: every e4m3
//    value is an f16 value) into an "Xf" slot (ring of 2, `xready` / `xfree` barriers) in the
//    K-major 128B-swizzled layout that wgmma's B descriptor reads, permuted along K as below.
//  - warpgroups 1, 2: consumers. Each owns MT m64 tiles (64 weight rows each). Per K block and
//    tile: one ldmatrix.x4 of the fp8 weight bytes, 8 cvt e4m3x2 -> f16x2 into the A fragment
//    registers, two wgmma m64nNPk16 (the first with scale-d = 0: the block sum starts from zero),
//    wait, then acc = fma(blocksum, sa * sw, acc) per element on the CUDA cores.
//
// Why f16 wgmma and not the native e4m3 wgmma: Hopper's fp8 tensor-core path accumulates in a
// reduced-precision fixed-point format (products aligned to the largest exponent, ~13-14 bits kept,
// low bits truncated; DeepSeek-V3 report sec. 3.5.2, SageAttention2), which would move a large
// fraction of the bf16 outputs and break the spec's "<= 1 ulp, rarely". The f16 path keeps fp32-level
// accumulation (v1's mma.sync f16 runs on the same units and was measured at ~0.02% of elements
// 1 ulp off), and the f16 tensor rate (~2 k FMA/clk/SM) is still ~2x what M = 64 needs at the
// weight-streaming rate.
//
// Numerics (identical to v1 up to the order of additions inside a block; see gemm.h):
//  - block sum: the 32 products of a block go to two chained k16 wgmmas (scale-d 0, then 1), fp32
//    tensor-core accumulation; every product of two e4m3 values is exact in f16 x f16 -> f32.
//  - acc = fma(blocksum, sa * sw, acc): sa * sw is a power of two, so one rounding, like the
//    reference's acc + (blocksum * sa) * sw. Blocks in increasing K order from +0.
//
// K permutation (a block sum is order-free, so the 32 elements of a block may be assigned to the
// 2 x 16 logical k of the two wgmmas by any bijection, as long as A and B use the same one):
//   ldmatrix.x4 gives thread (g = lane / 4, t = lane % 4) the 4 bytes [4t, 4t + 4) of 16-byte chunk
//   c of its rows g and g + 8; chunk c = 0 / 1 of the block feeds wgmma sp = c. The A fragment
//   (PTX / CuTe ALayout_64x16: a0 = (row g, k 2t..2t+1), a1 = (row g+8, k 2t..), a2 = (row g,
//   k 2t+8..), a3 = (row g+8, k 2t+8..)) takes the low byte pair (bytes 4t, 4t+1) as k (2t, 2t+1)
//   and the high pair (4t+2, 4t+3) as k (2t+8, 2t+9). So logical k of wgmma sp <-> block byte
//     kl = 2t + i      <-> 16 sp + 4t + i        (i = 0, 1)
//     kl = 8 + 2t + i  <-> 16 sp + 4t + 2 + i
//   The converters write the activations' f16 at exactly these logical positions, widening the same
//   byte pairs with the same cvt instruction, so each product meets its partner whatever the cvt's
//   half order.
//
// Shared memory (from a 1024-aligned base): W slots [stages][block_n][128 B] (TMA 128B swizzle:
// 16-byte chunk c of row r at chunk c ^ (r % 8)), Xc slots [stages][NP][128 B] (same swizzle),
// Xf slots [2][2 K-halves][NP][128 B] (f16, the same swizzle: wgmma's 128B-swizzle K-major
// canonical layout, 8-row groups 1024 B apart = SBO), decoded weight scales [block_n/32][kb_cta]
// and activation scales [kb_cta][NP] (fp32), the mbarriers.
//
// Epilogue: S == 1 rounds the tile to bf16 into the (then dead) weight ring and stores 16-byte row
// pieces (wgmma_fp8::store_tile_bf16_staged, shared with v3); S > 1 stores the fp32 partial tile, the
// last CTA of a tile (arrival counter) adds the S partials in split order and stores bf16, then
// resets the counter. dev::pdl_launch_dependents() follows the main loop.
#include <cuda.h>

#include <algorithm>
#include <string>

#include "gemm/gemm_internal.h"
#include "gemm/hopper_ptx.cuh"
#include "gemm/tensor_map.h"
#include "gemm/wgmma_f16.cuh"
#include "gemm/wgmma_fp8_block.cuh"
#include "kernels/device_common.cuh"
#include "kernels/prepare_common.cuh"
#include "runtime/launch.h"
#include "runtime/phase_stamps.cuh"

namespace v4attn::kernels {

V4ATTN_STAMP_UNIT();

namespace {

// The PTX wrappers (mbarriers, TMA, setmaxnreg, ldmatrix, cvt e4m3 -> f16, wgmma fences / groups,
// smem descriptors) are shared with v3.
using namespace hopper;

constexpr int kWarpgroupThreads = 128;
constexpr int kConsumerWarpgroups = 2;
constexpr int kFullPipelineMaxNp = 32;  // v2_overlap 2: registers for a second block-sum set (estimate, larger NP not measured)
constexpr int kThreads = kWarpgroupThreads * (1 + kConsumerWarpgroups);  // 384
constexpr int kConsumerThreads = kWarpgroupThreads * kConsumerWarpgroups;  // 256
constexpr int kConverterThreads = 96;                                       // warps 1..3
constexpr int kRopeHeadDim = wgmma_fp8::kRopeHeadDim;  // kRope: columns are heads of 512 dims
constexpr int kStageK = wgmma_fp8::kStageBytes;             // K bytes per stage (one 128B-swizzle row)
constexpr int kBlocksPerStage = kStageK / kGemmBlock;       // 4
constexpr int kXfSlots = 2;
constexpr int kMaxStages = 8;
constexpr int kSmemLimit = 227 * 1024;  // sm_90 opt-in dynamic shared memory per block
constexpr int kSmemAlign = 1024;        // 128B-swizzle atoms (TMA destination, wgmma operand)
constexpr int kTargetCtas = 132;        // H100 / H200 SXM: one CTA per SM
constexpr int kMaxCtaBlocks = 96;       // K blocks per CTA in the automatic plan (scale arrays)
constexpr uint32_t kConsumerBarrierId = 1;              // named barrier of the 256 consumers
constexpr uint32_t kProducerRegs = 40, kConsumerRegs = 232;
constexpr int kMaxBoxRows = 256;  // TMA box limit per dimension
constexpr int kMaxNpMt4 = 16;     // rows of the four-m64-tile form (its accumulators grow with MT x NP)
static_assert(kWarpgroupThreads * kProducerRegs + kConsumerThreads * kConsumerRegs <= kThreads * 168,
              "setmaxnreg split must fit the CTA's register pool (168 per thread at launch)");

// The kQNorm form's code stages: all of a CTA's K blocks, 4 per 128-byte stage (host and kernel).
__host__ __device__ constexpr int qnorm_code_stages(int max_split_blocks) {
  return (max_split_blocks + kBlocksPerStage - 1) / kBlocksPerStage;
}
// Byte offsets inside the CTA's shared memory (from the 1024-aligned base). Host and device use
// the same function, so the launcher sizes exactly what the kernel addresses.
struct SmemLayout {
  uint32_t w = 0, xc = 0, xf = 0, sw = 0, sa = 0, tab = 0, rstd = 0, bar = 0, flag = 0, total = 0;
};
// rope: the kRope form's RoPE table rows of the step ([np][64] fp32) and row flags ([np] int), loaded
// in the prologue (the plain form has none: its layout is unchanged).
// qnorm_stages > 0 (the kQNorm form): the activation codes of all K (qnorm_stages stages, written by
// the prologue, never refilled) instead of a ring of `stages` TMA slots, and the rows' rstd ([np] fp32).
__host__ __device__ constexpr SmemLayout smem_layout(int block_n, int np, int stages, int max_split_blocks,
                                                     bool rope = false, int qnorm_stages = 0) {
  SmemLayout l;
  uint32_t off = 0;
  l.w = off;
  off += static_cast<uint32_t>(stages * block_n * kStageK);
  l.xc = off;
  off += static_cast<uint32_t>((qnorm_stages > 0 ? qnorm_stages : stages) * np * kStageK);
  l.xf = off;
  off += static_cast<uint32_t>(kXfSlots * np * kStageK * 2);
  l.sw = off;
  off += static_cast<uint32_t>((block_n / 32) * max_split_blocks * 4);
  l.sa = off;
  off += static_cast<uint32_t>(max_split_blocks * np * 4);
  off = (off + 15u) & ~15u;
  l.tab = off;
  if (rope) off += static_cast<uint32_t>(np * (num::kRopeDim + 1) * 4);
  l.rstd = off;
  if (qnorm_stages > 0) off += static_cast<uint32_t>(np * 4);
  off = (off + 7u) & ~7u;
  l.bar = off;  // full[stages], empty[stages], xready[2], xfree[2]
  off += static_cast<uint32_t>((2 * stages + 2 * kXfSlots) * 8);
  l.flag = off;
  off += 8;
  l.total = off;
  return l;
}
size_t smem_request(const SmemLayout& l) { return static_cast<size_t>(l.total) + kSmemAlign; }

struct WgmmaParams {
  CUtensorMap tmap_w;  // weights [groups][n][k] bytes; box {128, block_n, 1}, 128B swizzle
  CUtensorMap tmap_x;  // activation codes [groups][m][k] (row stride a_stride); box {128, NP, 1}, 128B swizzle
  const uint8_t* w_scale = nullptr;  // [groups][n/32, k_blocks] ue8m0, dense
  const uint8_t* a_scale = nullptr;  // [groups][m, k_blocks]; row r at a_scale + r * a_scale_stride
  bf16_t* out = nullptr;             // [groups][m, n]; row r at out + r * out_stride
  float* partials = nullptr;         // [S][groups][m][n] (S > 1)
  uint32_t* counters = nullptr;      // [groups][tiles_n] (S > 1), zero between GEMMs
  int64_t a_scale_stride = 0, out_stride = 0;
  int64_t w_scale_group_stride = 0, a_scale_group_stride = 0, out_group_stride = 0;
  int m = 0, n = 0, k_blocks = 0, splits = 1, tiles_n = 0;
  int stages = 0;            // ring depth (1..kMaxStages)
  int max_split_blocks = 0;  // ceil(k_blocks / splits): capacity of the scale arrays
  int prewait_stages = 0;    // weight stages of the first ring fill issued before the PDL wait
  int prewait_pace_ns = 0;   // Fp8GemmParams::prewait_pace_ns
  int overlap = 1;           // consumer loop on full stages: 0 / 1 / 2 (Fp8GemmParams::v2_overlap)
  int out_vec = 0;           // S == 1: bf16_out_vector_width (2: 16-byte stores, else element by element)
  // kRope (run_gemm_fp8_rope_store): q_rope_store in the epilogue (S == 1 only).
  const int32_t* rope_pos = nullptr;  // [m]
  const float* rope_table = nullptr;  // [rope_max_pos, 64] (cos, sin) interleaved
  int64_t rope_max_pos = 0;
  unsigned long long* rope_err = nullptr;
  // kQNorm (run_gemm_fp8_qnorm): q_norm + act quant of x in the prologue (S == 1 only).
  const bf16_t* qn_x = nullptr;  // [m][k], row r at qn_x + r * qn_x_stride
  int64_t qn_x_stride = 0;
  const float* qn_w = nullptr;   // [k]
  float qn_eps = 0.0f;
  // kQDist (Fp8GemmParams::qnorm_dist_bar): CTA c < m's row of q_norm + act quant into global
  // memory, every CTA waiting for the m rows; qn_x / qn_w / qn_eps as for kQNorm.
  uint32_t* qd_bar = nullptr;      // [2]: rows written, CTAs past the wait (zero at rest)
  uint8_t* qd_codes = nullptr;     // [m][k] e4m3 (the activation TMA's source)
  uint8_t* qd_scales = nullptr;    // [m][k / 32] ue8m0 (a_scale)
  int64_t qd_code_stride = 0, qd_scale_stride = 0;
  bf16_t* qd_y = nullptr;          // optional [m][k] bf16
  int64_t qd_y_stride = 0;
};

// The kQNorm prologue (after the PDL wait; see the kernel's comment): rstd per row, then the codes of
// all K into xc (stage it at xc + it * NP * 128, 128B-swizzled like the TMA box) and the scales into
// sa [block][token]. Ends with a CTA barrier (rstd is read across warps).
constexpr int kQNormMaxChunksPerLane = 8;  // k <= 2048 (the launcher checks)
template <int NP>
__device__ __forceinline__ void qnorm_quant_prologue(const WgmmaParams& p, uint8_t* xc, float* rstd_s, float* sa_s, int nkb,
                                                     int tid) {
  using namespace detail;  // prepare_common.cuh: the chunk helpers of rmsnorm.cu
  const int k = nkb * kGemmBlock, n_chunks = k / kChunk;
  const int warp = tid >> 5, lane = tid & 31;
  for (int row = warp; row < p.m; row += kThreads / 32) {  // rmsnorm_kernel's warp 0, one row per warp
    const bf16_t* x = p.qn_x + static_cast<int64_t>(row) * p.qn_x_stride;
    const float r = num::rmsnorm_rstd(warp_row_sum_squares_n<kQNormMaxChunksPerLane>(x, n_chunks, lane), k, p.qn_eps);
    if (lane == 0) rstd_s[row] = r;
  }
  __syncthreads();
  // One thread per chunk e = tok * n_chunks + c; n_chunks % 4 == 0 and NP * n_chunks % 32 == 0, and
  // the stride is 384: the 4 chunks of a block are 4 consecutive lanes, and every warp runs each
  // round's shuffles with all its lanes. Loads of a round are issued before its math.
  constexpr int kBatch = 4;
  const int total = NP * n_chunks;
  for (int e0 = tid; e0 < total; e0 += kBatch * kThreads) {
    float v[kBatch][kChunk], wv[kBatch][kChunk];
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      const int e = e0 + b * kThreads, tok = e / n_chunks, c = e - tok * n_chunks;
      if (e < total && tok < p.m) {
        load_bf16x8(p.qn_x + static_cast<int64_t>(tok) * p.qn_x_stride + c * kChunk, v[b]);
        ldg_f32x8(p.qn_w + c * kChunk, wv[b]);
      } else {
#pragma unroll
        for (int q = 0; q < kChunk; ++q) v[b][q] = wv[b][q] = 0.0f;
      }
    }
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      const int e = e0 + b * kThreads, tok = e / n_chunks, c = e - tok * n_chunks;
      if (e >= total) break;  // uniform per warp
      const bool row_real = tok < p.m;
      if (row_real) rmsnorm_apply_chunk(v[b], rstd_s[tok], wv[b]);
      int scale_exp = 0;
      uint2 codes = act_quant_chunk<4>(v[b], scale_exp);
      if (!row_real) codes = make_uint2(0u, 0u);
      const int it = c / 16, cc = c % 16, q = cc >> 1;  // stage (16 chunks = 128 bytes), 16-byte piece
      *reinterpret_cast<uint2*>(xc + it * NP * kStageK + tok * kStageK + ((q ^ (tok & 7)) << 4) + (cc & 1) * 8) = codes;
      if ((c & 3) == 0) sa_s[(c >> 2) * NP + tok] = row_real ? num::f32_from_scale_exp(scale_exp) : 0.0f;
    }
  }
}

// kQDist: rows blockIdx.x, + gridDim.x, ... of q_norm + act quant, exactly rmsnorm_kernel's steps
// (warp 0 the LaneSum of the row, thread c chunk c, the 4 chunks of a 32-block in 4 consecutive
// lanes), into global memory. rstd_s: one float of shared memory.
__device__ __forceinline__ void qnorm_dist_rows(const WgmmaParams& p, int k, float* rstd_s, int tid,
                                                const float (&wv)[detail::kChunk]) {
  using namespace detail;  // prepare_common.cuh: the chunk helpers of rmsnorm.cu
  const int n_chunks = k / kChunk, lane = tid & 31;
  const bool active = tid < n_chunks;
  const bool in_warps = (tid >> 5) < (n_chunks + 31) / 32;  // whole warps run the 4-lane shuffles
  if (blockIdx.y != 0 || blockIdx.z != 0) return;  // the rows are the first split's (uniform per CTA)
  for (int row = static_cast<int>(blockIdx.x); row < p.m; row += static_cast<int>(gridDim.x)) {
    const bf16_t* x = p.qn_x + static_cast<int64_t>(row) * p.qn_x_stride;
    float v[kChunk];
    if (active) load_bf16x8(x + tid * kChunk, v);
    if (tid < 32) {
      const float r = num::rmsnorm_rstd(warp_row_sum_squares_n<kQNormMaxChunksPerLane>(x, n_chunks, lane), k, p.qn_eps);
      if (lane == 0) *rstd_s = r;
    }
    __syncthreads();
    const float r = *rstd_s;
    if (active) {
      rmsnorm_apply_chunk(v, r, wv);
      if (p.qd_y != nullptr) store_bf16x8(p.qd_y + static_cast<int64_t>(row) * p.qd_y_stride + tid * kChunk, v);
    } else {
#pragma unroll
      for (int q = 0; q < kChunk; ++q) v[q] = 0.0f;
    }
    if (in_warps) {
      int e = 0;
      const uint2 codes = act_quant_chunk<4>(v, e);
      if (active) {
        *reinterpret_cast<uint2*>(p.qd_codes + static_cast<int64_t>(row) * p.qd_code_stride + tid * kChunk) = codes;
        if ((lane & 3) == 0) p.qd_scales[static_cast<int64_t>(row) * p.qd_scale_stride + tid / 4] = num::ue8m0_from_exp(e);
      }
    }
    __syncthreads();  // rstd_s is rewritten by the next row
  }
}

// kQDist: the rows' hand-off. bar[0] counts the rows written (each row's CTA adds its rows after its
// stores with a release add -- the barrier before it orders the CTA's stores first, and release is
// cumulative -- behind a proxy fence, as TMA reads them back), and every CTA waits, one thread with
// acquire loads, for all m (then a proxy fence on the reading side too); bar[1] then counts the CTAs past that
// wait, and the last one rewinds both words for the next launch (no CTA of this launch reads them
// after its own bar[1] arrival, and the next launch touches them only after its PDL wait, i.e. after
// this grid). A CTA waits only for the rows' CTAs, not for every CTA of the grid.
__device__ __forceinline__ void qnorm_dist_rows_handoff(uint32_t* bar, int m, int tid) {
  __syncthreads();  // this CTA's rows are stored
  if (tid == 0) {
    const uint32_t total = gridDim.x * gridDim.y * gridDim.z;
    const uint32_t cta = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
    const uint32_t mine = cta < static_cast<uint32_t>(m)
                              ? (static_cast<uint32_t>(m) - 1u - cta) / gridDim.x + 1u  // rows cta, cta + gridDim.x, ...
                              : 0u;
    if (blockIdx.y == 0 && blockIdx.z == 0 && mine > 0) {
      asm volatile("fence.proxy.async.global;" ::: "memory");
      asm volatile("red.release.gpu.global.add.u32 [%0], %1;" ::"l"(bar), "r"(mine) : "memory");
    }
    uint32_t done = 0;
    do asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(done) : "l"(bar) : "memory");
    while (done < static_cast<uint32_t>(m));
    asm volatile("fence.proxy.async.global;" ::: "memory");  // the rows are read by TMA (async proxy)
    if (atomicAdd(bar + 1, 1u) == total - 1) {
      bar[0] = 0u;
      bar[1] = 0u;
    }
  }
  __syncthreads();
}

// kRope: the wq_b GEMM with q_rope_store fused into its epilogue (its own instantiation, so the
// plain kernel is compiled exactly as without it). Output column n is dim n % 512 of head n / 512;
// dims 448..511 are rotated at rope_pos[m] in (even, odd) pairs. The pair partner of the element a
// thread holds (column n ^ 1) is held by lane ^ 4 (fragment row g ^ 1, same column t and register
// i), so one xor shuffle brings it. Numerics exactly those of q_rope_store on the GEMM's bf16
// output: each value rounded to bf16 first, then num::rope_rotate in fp32, rounded to bf16. A row
// whose position is outside the table is not written and counted once (like q_rope_store).
//
// kQNorm: the wq_b GEMM with q_norm and its act quant fused into the prologue (its own instantiation,
// like kRope). After the PDL wait the CTA computes rstd of each of the m rows of qn_x in the LaneSum
// order of rmsnorm.cu (one warp per row: lane l sums chunks l, l + 32, ... in order, then
// dev::warp_lane_sum, num::rmsnorm_rstd), then per 8-element chunk rmsnorm_apply_chunk and
// act_quant_chunk<4> (4 consecutive lanes hold the 4 chunks of a 32-block), exactly the functions
// and order of rmsnorm_kernel with q_codes -- so the codes and scales are the bytes q_norm would have
// written for the plain GEMM to load. The codes of all K go to a shared buffer laid out like the TMA
// slots (stage it at xc + it * NP * 128, 128B swizzle), rows >= m zero with scale 0 (the TMA's zero
// fill and the scale loads' 0). One split only: every CTA needs the whole K of x anyway.
//
// kQDist: q_norm + act quant of row c by CTA c < m (qnorm_dist_rows) into global memory, every CTA
// waiting for the m rows (qnorm_dist_rows_handoff), then the plain form's activation TMA (its own
// instantiation too). The q_norm weights of a row CTA's chunk are loaded before the PDL wait
// (constants); the rest of a first ring fill that prewait_stages held back goes out after the row,
// before the wait for the others' rows.
template <int MT, int NP, bool kRope = false, bool kQNorm = false, bool kQDist = false>
__global__ void __launch_bounds__(kThreads, 1) gemm_fp8_wgmma_kernel(const __grid_constant__ WgmmaParams p) {
  static_assert(!(kQNorm && kQDist), "one q_norm form");
  constexpr int BN = kConsumerWarpgroups * 64 * MT;  // weight rows per CTA
  constexpr int kBoxRows = BN < kMaxBoxRows ? BN : kMaxBoxRows;
  constexpr int R = NP / 2;                          // accumulator registers per m64 tile per thread
  constexpr uint32_t kStageTx = static_cast<uint32_t>((BN + (kQNorm ? 0 : NP)) * kStageK);  // kQNorm: no x box
  static_assert(NP % 8 == 0 && NP >= 8 && NP <= 64, "NP is m rounded up to 8");
  // Past 16 rows the consumers load the activation scales after the role split (only they read
  // them), so the converters widen stage 0 as soon as its TMA lands instead of after the scales' L2
  // round trip: decode bs 32 / verify bs 4 -0.6 / -1.0 % (session 30, with the distributed q_norm,
  // which kAuto now takes at 24 rows only: not re-measured with the q_norm kernel before the GEMM).
  // At 1-16 rows the whole CTA loads them before the split as before: there the wq_b GEMM alone was
  // ~2 % slower the other way.
  constexpr bool kScalesInConsumers = !kQNorm && NP > 16;

  extern __shared__ uint8_t smem_raw[];
  const uint32_t raw_addr = smem_u32(smem_raw);
  const uint32_t base = (raw_addr + (kSmemAlign - 1)) & ~static_cast<uint32_t>(kSmemAlign - 1);
  uint8_t* smem = smem_raw + (base - raw_addr);
  const int ST = p.stages;
  const int msb = p.max_split_blocks;
  const SmemLayout L = smem_layout(BN, NP, ST, msb, kRope, kQNorm ? qnorm_code_stages(msb) : 0);
  float* sw_s = reinterpret_cast<float*>(smem + L.sw);  // [BN/32][msb]
  float* sa_s = reinterpret_cast<float*>(smem + L.sa);  // [msb][NP]
  int* s_flag = reinterpret_cast<int*>(smem + L.flag);
  const uint32_t bar_full = base + L.bar, bar_empty = bar_full + 8u * ST, bar_xready = bar_empty + 8u * ST,
                 bar_xfree = bar_xready + 8u * kXfSlots;

  const int tid = static_cast<int>(threadIdx.x), warp = tid >> 5, lane = tid & 31;
  const int tile = static_cast<int>(blockIdx.x), split = static_cast<int>(blockIdx.y), grp = static_cast<int>(blockIdx.z);
  const int row0 = tile * BN;
  const int kb_begin = static_cast<int>(static_cast<int64_t>(split) * p.k_blocks / p.splits);
  const int kb_end = static_cast<int>(static_cast<int64_t>(split + 1) * p.k_blocks / p.splits);
  const int nkb = kb_end - kb_begin;  // 1..msb
  const int n_iter = (nkb + kBlocksPerStage - 1) / kBlocksPerStage;
  const int prologue = min(ST, n_iter);
  int early = min(prologue, p.prewait_stages);  // weight stages issued before the PDL wait

  // ---- setup: barriers, first ring fill of weights (constant data: before the PDL wait) --------
  if (tid == 0) {
    for (int s = 0; s < ST; ++s) {
      mbar_init(bar_full + 8u * s, 1);  // the producer's arrive.expect_tx (+ the TMA bytes)
      mbar_init(bar_empty + 8u * s, kConsumerThreads);
    }
    for (int x = 0; x < kXfSlots; ++x) {
      mbar_init(bar_xready + 8u * x, kConverterThreads);
      mbar_init(bar_xfree + 8u * x, kConsumerThreads);
    }
    fence_mbarrier_init();
    prefetch_tensormap(&p.tmap_w);
    if (!kQNorm) prefetch_tensormap(&p.tmap_x);  // kQNorm: tmap_x is not a valid map
  }
  __syncthreads();
  [[maybe_unused]] unsigned int stamp_rec = 0u;  // measurement builds only (phase_stamps.cuh)
  if (tid == 0) V4ATTN_STAMP_BEGIN(stamp_rec, stamps::kGemmV2, 0);
  // A stage's weights: BN rows in boxes of at most kMaxBoxRows (TMA's limit per dimension).
  auto load_weights = [&](int s, int it) {
#pragma unroll
    for (int b = 0; b < BN / kBoxRows; ++b)
      tma_load_weights_3d(base + L.w + static_cast<uint32_t>((s * BN + b * kBoxRows) * kStageK), &p.tmap_w,
                          bar_full + 8u * s, (kb_begin + it * kBlocksPerStage) * kGemmBlock, row0 + b * kBoxRows, grp);
  };
  auto issue_weight_stage = [&](int it) {
    mbar_arrive_expect_tx(bar_full + 8u * it, kStageTx);
    load_weights(it, it);
  };
  // Weight scales of the tile's K range, decoded once: loaded before the PDL wait, stored after it
  // with the activation scales (wgmma_fp8::WeightScalePrefetch says why).
  wgmma_fp8::WeightScalePrefetch<kThreads> sw_pre;
  sw_pre.prefetch(p.w_scale + grp * p.w_scale_group_stride + static_cast<int64_t>(row0 / 32) * p.k_blocks + kb_begin,
                  p.k_blocks, row0, p.n, BN / 32, nkb, msb, sw_s, tid);
  [[maybe_unused]] float qd_wv[detail::kChunk];  // kQDist: the q_norm weights of this thread's chunk (constants)
  if constexpr (kQDist) {
    if (static_cast<int>(blockIdx.x) < p.m && tid < p.k_blocks * kGemmBlock / detail::kChunk)
      detail::ldg_f32x8(p.qn_w + tid * detail::kChunk, qd_wv);
  }
  if constexpr (kRope) {
    // The table rows of the step's positions and a written / not-written flag per row, into their
    // own region before the PDL wait (positions and table are step inputs and constants, not the
    // predecessor's output, as in the fused chain's phase 0), all loads of a thread issued before
    // its stores: [NP][64] fp32 (16-byte pieces, 16 per row), then [NP] int.
    constexpr int kPieces = NP * (num::kRopeDim / 4);
    constexpr int kPer = (kPieces + kThreads - 1) / kThreads;
    float4* tab4 = reinterpret_cast<float4*>(smem + L.tab);
    int* row_ok = reinterpret_cast<int*>(smem + L.tab + NP * num::kRopeDim * 4);
    int32_t pos[kPer];
#pragma unroll
    for (int r = 0; r < kPer; ++r) {
      const int idx = tid + r * kThreads, row = idx / (num::kRopeDim / 4);
      pos[r] = idx < kPieces && row < p.m ? p.rope_pos[row] : -1;
    }
    float4 v[kPer];
#pragma unroll
    for (int r = 0; r < kPer; ++r) {
      const int idx = tid + r * kThreads, piece = idx % (num::kRopeDim / 4);
      const bool ok = pos[r] >= 0 && pos[r] < p.rope_max_pos;
      v[r] = ok ? reinterpret_cast<const float4*>(p.rope_table + static_cast<int64_t>(pos[r]) * num::kRopeDim)[piece]
                : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
#pragma unroll
    for (int r = 0; r < kPer; ++r) {
      const int idx = tid + r * kThreads, row = idx / (num::kRopeDim / 4), piece = idx % (num::kRopeDim / 4);
      if (idx < kPieces) {
        tab4[idx] = v[r];
        if (piece == 0) row_ok[row] = pos[r] >= 0 && pos[r] < p.rope_max_pos ? 1 : 0;
      }
    }
  }

  // The first ring fill only now, behind the small loads of the prologue (the weight scales, the
  // q_norm weights, the RoPE rows): issued after it, they queued behind every CTA's fill (session 35;
  // the fused chain's session-10 lesson).
  if (tid == 0) {
    const uint64_t t_start = p.prewait_pace_ns > 0 ? dev::globaltimer_ns() : 0;
    for (int it = 0; it < early; ++it) {
      if (p.prewait_pace_ns > 0 && it > 0)  // paced: stage it at t_start + it * pace
        while (dev::globaltimer_ns() < t_start + static_cast<uint64_t>(it) * static_cast<uint64_t>(p.prewait_pace_ns)) {
        }
      issue_weight_stage(it);
    }
  }

  // This thread's walk over the activation-scale items, divided out before the wait (act_scale_walk).
  [[maybe_unused]] wgmma_fp8::ActScaleWalk sa_walk{};
  if constexpr (!kQNorm) {
    if constexpr (kScalesInConsumers)
      sa_walk = wgmma_fp8::act_scale_walk<kConsumerThreads>(nkb, tid - kWarpgroupThreads);
    else
      sa_walk = wgmma_fp8::act_scale_walk<kThreads>(nkb, tid);
  }

  dev::pdl_wait();  // activation codes and scales are the predecessor's output
  if (tid == 0) V4ATTN_STAMP_AT(stamp_rec, stamps::kGemmV2, 1);
  if constexpr (kQDist) {
    qnorm_dist_rows(p, p.k_blocks * kGemmBlock, reinterpret_cast<float*>(s_flag + 1), tid, qd_wv);
    if (tid == 0) V4ATTN_STAMP_AT(stamp_rec, stamps::kGemmV2, 10);  // measurement builds: rows written
    if (tid == 0)  // the rest of the first fill (prewait_stages < the fill): before the rows' wait, not after
      for (int it = early; it < prologue; ++it) issue_weight_stage(it);
    early = prologue;
    qnorm_dist_rows_handoff(p.qd_bar, p.m, tid);
    if (tid == 0) V4ATTN_STAMP_AT(stamp_rec, stamps::kGemmV2, 11);  // every row seen
  }

  if (tid == 0) {
    for (int it = early; it < prologue; ++it) issue_weight_stage(it);
    if constexpr (!kQNorm)
      for (int it = 0; it < prologue; ++it)
        tma_load_3d(base + L.xc + static_cast<uint32_t>(it * NP * kStageK), &p.tmap_x, bar_full + 8u * it,
                    (kb_begin + it * kBlocksPerStage) * kGemmBlock, 0, grp);
  }
  if constexpr (kQNorm) {
    qnorm_quant_prologue<NP>(p, smem + L.xc, reinterpret_cast<float*>(smem + L.rstd), sa_s, nkb, tid);
  } else if constexpr (!kScalesInConsumers) {
    // activation scales [block][token]; tokens >= m get 0
    wgmma_fp8::load_activation_scales<NP>(p.a_scale + grp * p.a_scale_group_stride + kb_begin, p.a_scale_stride,
                                          p.m, nkb, sa_s, sa_walk);
  }
  sw_pre.store(msb, sw_s);
  __syncthreads();  // scale arrays visible to the consumers (kScalesInConsumers: the weight scales only)

  if (warp < 4) {
    // ======== warpgroup 0: producer (warp 0, lane 0) and converters (warps 1..3) ==================
    setmaxnreg_dec<kProducerRegs>();
    if (warp == 0) {
      if (lane == 0) {
        RingPos rp;  // stage it - ST (the loop runs only when prologue == ST)
        for (int it = prologue; it < n_iter; ++it, rp.advance(ST)) {
          const int s = rp.slot;
          mbar_wait(bar_empty + 8u * s, rp.parity);  // slot consumed (it - ST)
          const int kx = (kb_begin + it * kBlocksPerStage) * kGemmBlock;
          mbar_arrive_expect_tx(bar_full + 8u * s, kStageTx);
          load_weights(s, it);
          if constexpr (!kQNorm)
            tma_load_3d(base + L.xc + static_cast<uint32_t>(s * NP * kStageK), &p.tmap_x, bar_full + 8u * s, kx, 0, grp);
        }
      }
    } else {
      const int ctid = tid - 32;  // 0..95
      if (ctid == 0 && blockIdx.x < 2) V4ATTN_STAMP_BEGIN(stamp_rec, stamps::kGemmV2, 63);
      RingPos rp;  // stage it
      for (int it = 0; it < n_iter; ++it, rp.advance(ST)) {
        const int s = rp.slot, x = it % kXfSlots;
        mbar_wait(bar_full + 8u * s, rp.parity);
        // Measurement builds: 96 + it = the stage's data landed, 112 + it = its f16 slot is free.
        if (ctid == 0 && blockIdx.x < 2 && it < 16) V4ATTN_STAMP_AT(stamp_rec, stamps::kGemmV2, 96 + it);
        if (it >= kXfSlots) mbar_wait(bar_xfree + 8u * x, static_cast<uint32_t>((it / kXfSlots - 1) & 1));
        if (ctid == 0 && blockIdx.x < 2 && it < 16) V4ATTN_STAMP_AT(stamp_rec, stamps::kGemmV2, 112 + it);
        const uint8_t* xc = smem + L.xc + (kQNorm ? it : s) * NP * kStageK;  // kQNorm: all K, never refilled
        uint8_t* xf = smem + L.xf + x * NP * kStageK * 2;
        // Unit u: token n, 16-byte code chunk q = 2 j + sp (block j of the stage, half sp) -> the
        // 16 f16 of wgmma sp of block j: low byte pairs at logical k 0..7, high pairs at 8..15.
        for (int u = ctid; u < NP * 8; u += kConverterThreads) {
          const int n = u % NP, q = u / NP;
          const uint4 v = *reinterpret_cast<const uint4*>(xc + n * kStageK + ((q ^ (n & 7)) << 4));
          const uint4 lo = make_uint4(e4m3x2_lo_to_f16x2(v.x), e4m3x2_lo_to_f16x2(v.y), e4m3x2_lo_to_f16x2(v.z),
                                      e4m3x2_lo_to_f16x2(v.w));
          const uint4 hi = make_uint4(e4m3x2_hi_to_f16x2(v.x), e4m3x2_hi_to_f16x2(v.y), e4m3x2_hi_to_f16x2(v.z),
                                      e4m3x2_hi_to_f16x2(v.w));
          const int j = q >> 1, sp = q & 1;
          const int cb = (j & 1) * 4 + sp * 2;  // 16-byte chunk of the f16 row (64 f16 = 2 blocks)
          uint8_t* row = xf + (j >> 1) * NP * kStageK + n * kStageK;
          *reinterpret_cast<uint4*>(row + ((cb ^ (n & 7)) << 4)) = lo;
          *reinterpret_cast<uint4*>(row + (((cb + 1) ^ (n & 7)) << 4)) = hi;
        }
        fence_proxy_async_smem();  // the f16 operand is read by wgmma (async proxy)
        mbar_arrive(bar_xready + 8u * x);
        if (ctid == 0 && blockIdx.x < 2) V4ATTN_STAMP_AT(stamp_rec, stamps::kGemmV2, 64 + it);
      }
    }
    dev::pdl_launch_dependents();
    return;
  }

  // ======== warpgroups 1, 2: consumers =============================================================
  setmaxnreg_inc<kConsumerRegs>();
  const int ctid = tid - kWarpgroupThreads;  // 0..255
  if constexpr (kScalesInConsumers) {  // activation scales [block][token]; tokens >= m get 0
    wgmma_fp8::load_activation_scales<NP>(p.a_scale + grp * p.a_scale_group_stride + kb_begin, p.a_scale_stride,
                                          p.m, nkb, sa_s, sa_walk);
    named_barrier_sync(kConsumerBarrierId, kConsumerThreads);
  }
  const int wgc = ctid >> 7;                 // consumer warpgroup 0 / 1
  const int w = (ctid >> 5) & 3;             // warp within the warpgroup: rows 16w .. 16w + 15 of a tile
  const int g = lane >> 2, t = lane & 3;
  // ldmatrix.x4: lane supplies row (lane & 7) + 8 * ((lane >> 3) & 1) of its matrix, chunk + (lane >> 4):
  // matrices 0..3 = (rows 0-7, chunk 2j), (rows 8-15, 2j), (rows 0-7, 2j+1), (rows 8-15, 2j+1).
  const int ld_row = 16 * w + (lane & 7) + 8 * ((lane >> 3) & 1);
  const int ld_chunk = lane >> 4;

  if (ctid == 0) V4ATTN_STAMP_BEGIN(stamp_rec, stamps::kGemmV2, 15);
  float acc[MT][R], d[MT][R];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int i = 0; i < R; ++i) {
      acc[mt][i] = 0.0f;
      d[mt][i] = 0.0f;
    }

  // overlap 2 (NP <= kFullPipelineMaxNp): two full stages it0, it0 + 1 as one straight-line body
  // (wgmma_fp8::run_stage_pair: two block-sum / A fragment sets, block b + 1's wgmmas issued before
  // block b is folded, across the stages' boundary too, one drain per pair; the same bytes as one
  // block at a time). A stage left over (an odd count, a partial last stage) and a ring of one slot
  // (stage it0 + 1 would wait for the slot stage it0 holds) run the one-stage loop of overlap 1.
  // Session 29 (docs/perf.md): this replaced session 3's one-stage form of overlap 2 (one drain per
  // stage): wq_b m 8 / 24 / 32 13.98 / 16.80 / 18.68 -> 12.38 / 15.88 / 17.74 us; kept beside it,
  // the old form's code alone moved the 24-32-row cycles by +-1 % (instruction-cache layout). Groups
  // of five stages were faster alone (11.8 / 17.5 us) but 7-9 % slower in the cycle: their longer
  // straight-line bodies miss the instruction cache; three sets in flight: even to +1.8 %.
  // rp0: stage it0's ring position (RingPos: no division by the run-time ST per stage).
  auto run_stage_pair = [&](int it0, const RingPos& rp0) {
    if constexpr (NP <= kFullPipelineMaxNp) {
      RingPos rp1 = rp0;
      rp1.advance(ST);
      auto wait_stage = [&](int it, const RingPos& rp) {
        const int x = it % kXfSlots;
        mbar_wait(bar_full + 8u * rp.slot, rp.parity);
        mbar_wait(bar_xready + 8u * x, static_cast<uint32_t>((it / kXfSlots) & 1));
        if (ctid == 0 && (it == 0 || blockIdx.x < 2)) V4ATTN_STAMP_AT(stamp_rec, stamps::kGemmV2, it == 0 ? 2 : 16 + it);
      };
      auto ops_of = [&](int it, const RingPos& rp) {
        const int x = it % kXfSlots;
        return wgmma_fp8::BlockOps<MT, NP>{base + L.w + static_cast<uint32_t>(rp.slot * BN * kStageK),
                                           base + L.xf + static_cast<uint32_t>(x * NP * kStageK * 2), wgc, w, ld_row,
                                           ld_chunk, t};
      };
      wait_stage(it0, rp0);
      wgmma_fp8::run_stage_pair<MT, NP>(
          ops_of(it0, rp0), ops_of(it0 + 1, rp1),
          [&](int q, int mt, int j) {
            return sw_s[((wgc * MT + mt) * 2 + (w >> 1)) * msb + (it0 + q) * kBlocksPerStage + j];
          },
          [&](int q, int j) { return sa_s + ((it0 + q) * kBlocksPerStage + j) * NP; }, [&] { wait_stage(it0 + 1, rp1); },
          [&](int q) { mbar_arrive(bar_empty + 8u * (q == 0 ? rp0.slot : rp1.slot)); },
          [&](int q) { mbar_arrive(bar_xfree + 8u * ((it0 + q) % kXfSlots)); }, acc);
    }
  };

  RingPos rp;  // stage it
  for (int it = 0; it < n_iter; ++it, rp.advance(ST)) {
    if constexpr (NP <= kFullPipelineMaxNp) {
      if (p.overlap == 2 && ST >= 2 && nkb / kBlocksPerStage - it >= 2) {  // stages it, it + 1 both full
        run_stage_pair(it, rp);
        ++it;
        rp.advance(ST);
        continue;
      }
    }
    const int s = rp.slot, x = it % kXfSlots;
    mbar_wait(bar_full + 8u * s, rp.parity);
    mbar_wait(bar_xready + 8u * x, static_cast<uint32_t>((it / kXfSlots) & 1));
    if (ctid == 0 && (it == 0 || blockIdx.x < 2)) V4ATTN_STAMP_AT(stamp_rec, stamps::kGemmV2, it == 0 ? 2 : 16 + it);
    const uint32_t w_slot = base + L.w + static_cast<uint32_t>(s * BN * kStageK);
    const uint32_t xf_slot = base + L.xf + static_cast<uint32_t>(x * NP * kStageK * 2);
    const int nb = min(kBlocksPerStage, nkb - it * kBlocksPerStage);
    // The three steps of one K block j of this stage (b = it * 4 + j), wgmma_fp8::BlockOps:
    //  load: ldmatrix.x4 of the weight bytes, widened to the f16 A fragments; the weight scales;
    //  issue: the two chained wgmmas per tile (the first with scale-d = 0: the block sum from zero);
    //  fold: the products sa * sw before the wait (their shared loads and multiplies overlap the
    //  wgmmas), after it acc += blocksum * (sa * sw), one rounding per block, blocks in order.
    const wgmma_fp8::BlockOps<MT, NP> ops{w_slot, xf_slot, wgc, w, ld_row, ld_chunk, t};
    auto load_block = [&](int j, uint32_t (&a)[MT][2][4], float (&swv)[MT]) {
      ops.load(j, a, [&](int mt) { swv[mt] = sw_s[((wgc * MT + mt) * 2 + (w >> 1)) * msb + it * kBlocksPerStage + j]; });
    };
    auto issue_block = [&](int j, const uint32_t (&a)[MT][2][4], float (&d)[MT][R]) { ops.issue(j, a, d); };
    using Ss = float[MT][wgmma_fp8::BlockOps<MT, NP>::S];
    auto products_block = [&](int j, const float (&swv)[MT], Ss& ss) {
      ops.products(sa_s + (it * kBlocksPerStage + j) * NP, swv, ss);
    };
    auto fold_block = [&](const Ss& ss, float (&d)[MT][R]) { ops.fold_products(ss, d, acc); };
    const bool full_stage = nb == kBlocksPerStage;
    // Full stages run straight-line code (the loops below unroll) with every wgmma waited for
    // inside the stage: a wgmma in flight across the loop back-edge makes ptxas serialize them all.
    // Two A fragment sets (and scale sets) alternate between consecutive blocks.
    if (p.overlap != 0 && full_stage) {
      // Widening overlapped: block j + 1's ldmatrix + widening is issued after block j's wgmmas
      // and before waiting for them, so the tensor core and the conversion pipe work at once.
      uint32_t a[2][MT][2][4];
      float sw[2][MT];
      load_block(0, a[0], sw[0]);
#pragma unroll
      for (int j = 0; j < kBlocksPerStage; ++j) {
        issue_block(j, a[j & 1], d);
        if (j + 1 < kBlocksPerStage) load_block(j + 1, a[(j + 1) & 1], sw[(j + 1) & 1]);
        Ss ss;
        products_block(j, sw[j & 1], ss);
        wgmma_wait<0>();
        fold_block(ss, d);
      }
    } else {
#pragma unroll
      for (int j = 0; j < kBlocksPerStage; ++j) {
        if (j >= nb) break;  // uniform: only the CTA's last stage is partial
        uint32_t a[MT][2][4];
        float swv[MT];
        load_block(j, a, swv);
        issue_block(j, a, d);
        Ss ss;
        products_block(j, swv, ss);
        wgmma_wait<0>();
        fold_block(ss, d);
      }
    }
    // This thread's reads of the slot are complete (ldmatrix is synchronous; the wgmmas reading Xf
    // were waited for).
    mbar_arrive(bar_empty + 8u * s);
    mbar_arrive(bar_xfree + 8u * x);
  }
  if (ctid == 0) V4ATTN_STAMP_AT(stamp_rec, stamps::kGemmV2, 3);
  dev::pdl_launch_dependents();

  // ---- epilogue (consumers only) ------------------------------------------------------------------
  // Element (mt, i) of this thread's accumulators: weight row (output column) n and token m.
  auto out_col = [&](int mt, int i) { return row0 + (wgc * MT + mt) * 64 + 16 * w + g + ((i & 2) ? 8 : 0); };
  auto out_tok = [&](int i) { return 8 * (i >> 2) + 2 * t + (i & 1); };
  bf16_t* out = p.out + grp * p.out_group_stride;
  if constexpr (kRope) {  // S == 1, one group (host-checked)
    // The table rows and row flags were loaded in the prologue (the __syncthreads before the main
    // loop published them). The rotated bf16 tile is staged in the weight ring (dead once both
    // consumer warpgroups are here) and stored in 16-byte row pieces, rows past the table skipped.
    const float* tab = reinterpret_cast<const float*>(smem + L.tab);
    const int* row_ok = reinterpret_cast<const int*>(smem + L.tab + NP * num::kRopeDim * 4);
    if (tile == 0 && ctid < p.m && !row_ok[ctid]) dev::count_error(p.rope_err);  // each bad row once
    named_barrier_sync(kConsumerBarrierId, kConsumerThreads);
    wgmma_fp8::store_tile_bf16_staged<MT, NP, kConsumerThreads>(
        [&](int mt, int i) {
          const int n = out_col(mt, i), m = out_tok(i);
          return wgmma_fp8::rope_store_bf16(acc[mt][i], n, tab, m);  // m < NP
        },
        [&](int m) { return row_ok[m] != 0; }, smem + L.w, out, p.out_stride, p.m, p.n, row0, wgc, w, g, t, ctid, p.out_vec,
        kConsumerBarrierId);
    return;
  }
  if (p.splits == 1) {  // staged through the weight ring (dead once both consumer warpgroups are here)
    named_barrier_sync(kConsumerBarrierId, kConsumerThreads);
    wgmma_fp8::store_tile_bf16_staged<MT, NP, kConsumerThreads>(
        [&](int mt, int i) { return num::bf16_from_f32(acc[mt][i]); }, [](int) { return true; }, smem + L.w, out,
        p.out_stride, p.m, p.n, row0, wgc, w, g, t, ctid, p.out_vec, kConsumerBarrierId);
    if (ctid == 0) V4ATTN_STAMP_AT(stamp_rec, stamps::kGemmV2, 4);
    return;
  }

  const int64_t mn = static_cast<int64_t>(p.m) * p.n;
  const int groups = static_cast<int>(gridDim.z);
  float* part = p.partials + (static_cast<int64_t>(split) * groups + grp) * mn;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int i = 0; i < R; ++i) {
      const int n = out_col(mt, i), m = out_tok(i);
      if (m < p.m && n < p.n) part[static_cast<int64_t>(m) * p.n + n] = acc[mt][i];
    }
  // Last-block pattern (as v1): each thread fences its own partial stores device-wide before the
  // barrier; one thread's counter bump then orders after all of them.
  __threadfence();
  named_barrier_sync(kConsumerBarrierId, kConsumerThreads);
  uint32_t* counter = p.counters + grp * p.tiles_n + tile;
  if (ctid == 0) {
    const uint32_t arrived = atomicAdd(counter, 1u);
    *s_flag = arrived == static_cast<uint32_t>(p.splits - 1) ? 1 : 0;
  }
  named_barrier_sync(kConsumerBarrierId, kConsumerThreads);
  if (!*s_flag) return;
  __threadfence();  // acquire side: the other CTAs' partials are visible (read through L2 below)

  const int rows_valid = min(BN, p.n - row0);
  const float* pbase = p.partials + static_cast<int64_t>(grp) * mn;
  const int64_t split_stride = static_cast<int64_t>(groups) * mn;
  for (int idx = ctid; idx < p.m * rows_valid; idx += kConsumerThreads) {
    const int m = idx / rows_valid, n = row0 + idx % rows_valid;
    const int64_t off = static_cast<int64_t>(m) * p.n + n;
    float sum = __ldcg(pbase + off);
    for (int sp = 1; sp < p.splits; ++sp) sum = num::add_rn(sum, __ldcg(pbase + sp * split_stride + off));
    out[m * p.out_stride + n] = num::bf16_from_f32(sum);
  }
  if (ctid == 0) *counter = 0u;  // every CTA of this tile has arrived: ready for the next GEMM
}

using WgmmaKernel = void (*)(WgmmaParams);

template <int MT, bool kRope = false, bool kQNorm = false, bool kQDist = false>
WgmmaKernel pick_wgmma_kernel(int np) {
  switch (np) {
    case 8: return gemm_fp8_wgmma_kernel<MT, 8, kRope, kQNorm, kQDist>;
    case 16: return gemm_fp8_wgmma_kernel<MT, 16, kRope, kQNorm, kQDist>;
    case 24: return gemm_fp8_wgmma_kernel<MT, 24, kRope, kQNorm, kQDist>;
    case 32: return gemm_fp8_wgmma_kernel<MT, 32, kRope, kQNorm, kQDist>;
    case 40: return gemm_fp8_wgmma_kernel<MT, 40, kRope, kQNorm, kQDist>;
    case 48: return gemm_fp8_wgmma_kernel<MT, 48, kRope, kQNorm, kQDist>;
    case 56: return gemm_fp8_wgmma_kernel<MT, 56, kRope, kQNorm, kQDist>;
    case 64: return gemm_fp8_wgmma_kernel<MT, 64, kRope, kQNorm, kQDist>;
    default: throw std::invalid_argument("gemm v2: m must be 1..64");
  }
}

// Four m64 tiles per warpgroup (512 weight rows per CTA): plain form, at most kMaxNpMt4 rows.
WgmmaKernel pick_wgmma_kernel_mt4(int np) {
  static_assert(kMaxNpMt4 == 16, "the instantiations below");
  switch (np) {
    case 8: return gemm_fp8_wgmma_kernel<4, 8>;
    case 16: return gemm_fp8_wgmma_kernel<4, 16>;
    default: throw std::invalid_argument("gemm v2: four m64 tiles per warpgroup take m <= 16");
  }
}

// The TMA descriptors: shared host helper (gemm/tensor_map.h).
CUtensorMap make_tensor_map(const void* ptr, uint64_t cols, uint64_t rows, uint64_t groups, uint64_t row_stride,
                            uint64_t group_stride, uint32_t box_rows) {
  return detail::make_byte_tensor_map_sw128("gemm v2", ptr, cols, rows, groups, row_stride, group_stride, kStageK, box_rows);
}

}  // namespace

namespace detail {

WgmmaSplit plan_wgmma_split(const char* who, int m, int64_t n, int64_t k, int groups, int force_splits, int force_mtiles,
                            int force_stages, int max_splits) {
  auto fail = [who](const std::string& what) { throw std::invalid_argument(std::string(who) + ": " + what); };
  if (m < 0 || m > kGemmMaxRows || n <= 0 || k <= 0 || groups < 1) fail("need 0 <= m <= 64, n > 0, k > 0, groups >= 1");
  // force_mtiles 4 (v2 only: plan_gemm_wgmma takes it for one split and m <= kMaxNpMt4, v3 refuses
  // it): 512 rows per CTA, half the CTAs of 2, the same bytes (a tile's rows do not change any
  // element's arithmetic).
  if (force_splits < 0 || force_mtiles < 0 || (force_mtiles > 2 && force_mtiles != 4) || force_stages < 0)
    fail("force_splits >= 0, force_mtiles in 0..2 or 4, force_stages >= 0");
  const int64_t kb = k / kGemmBlock;
  if (kb < 1) fail("k < 32");
  WgmmaSplit sp;
  sp.warp_mtiles = force_mtiles != 0 ? force_mtiles : (groups * ((n + 255) / 256) >= 96 ? 2 : 1);  // wq_b: 128 CTAs
  sp.block_n = kConsumerWarpgroups * 64 * sp.warp_mtiles;
  sp.tiles_n = static_cast<int>((n + sp.block_n - 1) / sp.block_n);
  const int64_t tiles = static_cast<int64_t>(groups) * sp.tiles_n;
  int64_t s;
  if (force_splits != 0) {
    s = std::min<int64_t>(force_splits, kb);
  } else {
    s = std::max<int64_t>(1, kTargetCtas / tiles);                       // ~one CTA per SM
    s = std::max<int64_t>(s, (kb + kMaxCtaBlocks - 1) / kMaxCtaBlocks);  // bounded scale arrays
    s = std::min<int64_t>(s, kb);
  }
  if (max_splits > 0) s = std::min<int64_t>(s, max_splits);
  sp.splits = static_cast<int>(s);
  return sp;
}

}  // namespace detail

GemmPlan plan_gemm_wgmma(int m, int64_t n, int64_t k, int groups, int force_splits, int force_mtiles, int force_stages) {
  const detail::WgmmaSplit sp =
      detail::plan_wgmma_split("plan_gemm_wgmma", m, n, k, groups, force_splits, force_mtiles, force_stages, 0);
  if (sp.warp_mtiles == 4 && (sp.splits != 1 || m > kMaxNpMt4))
    throw std::invalid_argument("plan_gemm_wgmma: force_mtiles 4 needs one split and m <= " + std::to_string(kMaxNpMt4));
  const int64_t kb = k / kGemmBlock, s = sp.splits;
  GemmPlan plan = sp.plan_base();
  // Pipeline depth for this m (numerics do not depend on it): as many stages as fit, <= 8, <= the
  // stages a CTA has.
  const int msb = static_cast<int>((kb + s - 1) / s);
  const int np = std::max(8, (m + 7) / 8 * 8);
  const int n_iter = (msb + kBlocksPerStage - 1) / kBlocksPerStage;
  const size_t fixed = smem_request(smem_layout(plan.block_n, np, 0, msb)) + (2 * kMaxStages) * 8;
  const size_t stage = static_cast<size_t>(plan.block_n + np) * kStageK;
  const int64_t fit = fixed >= static_cast<size_t>(kSmemLimit) ? 0 : static_cast<int64_t>((kSmemLimit - fixed) / stage);
  plan.stages = static_cast<int>(std::min<int64_t>({fit, kMaxStages, n_iter}));
  if (force_stages != 0) plan.stages = std::min(plan.stages, force_stages);
  plan.smem_bytes = plan.stages >= 1 ? smem_request(smem_layout(plan.block_n, np, plan.stages, msb)) : 0;
  plan.workspace_bytes = plan.splits > 1 ? detail::workspace_counter_bytes(groups, plan.tiles_n) +
                                               static_cast<size_t>(plan.splits) * static_cast<size_t>(groups) *
                                                   static_cast<size_t>(m) * static_cast<size_t>(n) * sizeof(float)
                                         : 0;
  return plan;
}

namespace {
// Ring stages of a one-split form with extra shared-memory regions beside the ring (the RoPE table
// with rope; with qnorm the codes of all max_split_blocks K blocks): the plan's, fewer where they do
// not fit; 0 when not even one does. The launcher and the support predicates use the same count.
int fitting_stages(const GemmPlan& plan, int np, int max_split_blocks, bool rope, bool qnorm) {
  const int xs = qnorm ? qnorm_code_stages(max_split_blocks) : 0;
  int st = plan.stages;
  while (st >= 1 &&
         smem_request(smem_layout(plan.block_n, np, st, max_split_blocks, rope, xs)) > static_cast<size_t>(kSmemLimit))
    --st;
  return st;
}
}  // namespace

bool gemm_v2_qnorm_supported(int m, int64_t n, int64_t k) {
  if (m < 1 || m > kGemmMaxRows || n <= 0 || k <= 0 || k % kGemmBlock != 0 || k > 2048) return false;
  const GemmPlan plan = plan_gemm_wgmma(m, n, k, 1);
  if (plan.splits != 1 || plan.warp_mtiles != 2 || plan.stages < 1) return false;
  const int np = (m + 7) / 8 * 8, msb = static_cast<int>(k / kGemmBlock);
  return fitting_stages(plan, np, msb, false, true) >= 1 &&
         (n % kRopeHeadDim != 0 || fitting_stages(plan, np, msb, true, true) >= 1);
}

bool gemm_v2_qnorm_dist_supported(int m, int64_t n, int64_t k) {
  if (m < 1 || m > kGemmMaxRows || n <= 0 || k <= 0 || k % kGemmBlock != 0 || k > 2048) return false;
  const GemmPlan plan = plan_gemm_wgmma(m, n, k, 1);
  return plan.warp_mtiles == 2 && plan.stages >= 1 &&
         static_cast<int64_t>(plan.tiles_n) * plan.splits <= detail::device_sm_count(-1);
}

bool gemm_v2_four_tiles_supported(int m, int64_t n, int64_t k) {
  if (m < 1 || m > kMaxNpMt4 || n <= 0 || k <= 0 || k % kGemmBlock != 0) return false;
  return plan_gemm_wgmma(m, n, k, 1).splits == 1 && plan_gemm_wgmma(m, n, k, 1, 1, 4).stages >= 1;
}

bool gemm_v2_rope_store_supported(int m, int64_t n, int64_t k) {
  if (m < 1 || m > kGemmMaxRows || n <= 0 || n % kRopeHeadDim != 0 || k <= 0 || k % kGemmBlock != 0) return false;
  const GemmPlan plan = plan_gemm_wgmma(m, n, k, 1);
  return plan.splits == 1 && plan.warp_mtiles == 2 && plan.stages >= 1;
}

namespace detail {

void launch_gemm_fp8_wgmma(const Fp8GemmParams& p, const GemmPlan& plan, const GemmWorkspace& ws, cudaStream_t stream,
                           bool pdl) {
  const int np = (p.m + 7) / 8 * 8;
  const int64_t kb = p.k / kGemmBlock;
  WgmmaParams t;
  // Weights: [groups][n][k]; a single group gets a nominal group stride (the dimension has size 1).
  const uint64_t w_group = p.groups > 1 ? static_cast<uint64_t>(p.w_group_stride) : static_cast<uint64_t>(p.n * p.k);
  t.tmap_w = make_tensor_map(p.w, static_cast<uint64_t>(p.k), static_cast<uint64_t>(p.n), static_cast<uint64_t>(p.groups),
                             static_cast<uint64_t>(p.k), w_group, static_cast<uint32_t>(std::min(plan.block_n, kMaxBoxRows)));
  const uint64_t a_group = p.groups > 1 ? static_cast<uint64_t>(p.a_group_stride) : static_cast<uint64_t>(p.m) * p.a_stride;
  const bool qdist = p.qnorm_x != nullptr && p.qnorm_dist_bar != nullptr;  // kQDist: codes via global memory
  const bool qnorm = p.qnorm_x != nullptr && !qdist;
  if (!qnorm)  // kQNorm: no activation TMA (the map stays zero and is never used)
    t.tmap_x = make_tensor_map(p.a_q, static_cast<uint64_t>(p.k), static_cast<uint64_t>(p.m), static_cast<uint64_t>(p.groups),
                               static_cast<uint64_t>(p.a_stride), a_group, static_cast<uint32_t>(np));
  t.w_scale = p.w_scale;
  t.a_scale = p.a_scale;
  t.out = p.out;
  t.a_scale_stride = p.a_scale_stride;
  t.out_stride = p.out_stride;
  t.w_scale_group_stride = p.w_scale_group_stride;
  t.a_scale_group_stride = p.a_scale_group_stride;
  t.out_group_stride = p.out_group_stride;
  t.m = p.m;
  t.n = static_cast<int>(p.n);
  t.k_blocks = static_cast<int>(kb);
  t.splits = plan.splits;
  t.tiles_n = plan.tiles_n;
  t.stages = plan.stages;
  t.max_split_blocks = static_cast<int>((kb + plan.splits - 1) / plan.splits);
  t.prewait_stages = p.prewait_stages < 0 ? plan.stages : p.prewait_stages;
  t.prewait_pace_ns = p.prewait_pace_ns;
  t.overlap = p.v2_overlap < 0 ? 2 : p.v2_overlap;  // 2 runs as 1 where m > 32
  t.out_vec = bf16_out_vector_width(p);
  if (plan.splits > 1) {
    uint8_t* wsb = static_cast<uint8_t*>(ws.data);
    t.counters = reinterpret_cast<uint32_t*>(wsb);
    t.partials = reinterpret_cast<float*>(wsb + workspace_counter_bytes(p.groups, plan.tiles_n));
  }
  const bool rope = p.rope_table != nullptr;
  t.rope_pos = p.rope_pos;
  t.rope_table = p.rope_table;
  t.rope_max_pos = p.rope_max_pos;
  t.rope_err = p.rope_err;
  t.qn_x = p.qnorm_x;
  t.qn_x_stride = p.qnorm_x_stride;
  t.qn_w = p.qnorm_w;
  t.qn_eps = p.qnorm_eps;
  if (qdist) {
    t.qd_bar = p.qnorm_dist_bar;
    t.qd_codes = const_cast<uint8_t*>(p.a_q);
    t.qd_scales = const_cast<uint8_t*>(p.a_scale);
    t.qd_code_stride = p.a_stride;
    t.qd_scale_stride = p.a_scale_stride;
    t.qd_y = p.qnorm_y;
    t.qd_y_stride = p.qnorm_y_stride;  // the plan's fit (gemm_v2_qnorm_dist_supported): checked by run_gemm_fp8
  }
  size_t smem_bytes = plan.smem_bytes;
  if (rope || qnorm) {  // the table region / the codes of all K beside the ring: fewer ring stages where needed
    if (plan.splits != 1 || plan.warp_mtiles != 2 || p.groups != 1)
      throw std::invalid_argument("gemm v2: the fused RoPE store / q_norm needs one split, two m64 tiles per warpgroup, one group");
    t.stages = fitting_stages(plan, np, t.max_split_blocks, rope, qnorm);
    if (t.stages < 1) throw std::invalid_argument("gemm v2: the fused RoPE store / q_norm does not fit shared memory");
    smem_bytes = smem_request(smem_layout(plan.block_n, np, t.stages, t.max_split_blocks, rope,
                                          qnorm ? qnorm_code_stages(t.max_split_blocks) : 0));
  }
  const WgmmaKernel kernel = qdist                   ? (rope ? pick_wgmma_kernel<2, true, false, true>(np)
                                                             : pick_wgmma_kernel<2, false, false, true>(np))
                             : qnorm                 ? (rope ? pick_wgmma_kernel<2, true, true>(np)
                                                             : pick_wgmma_kernel<2, false, true>(np))
                             : rope                  ? pick_wgmma_kernel<2, true>(np)
                             : plan.warp_mtiles == 4 ? pick_wgmma_kernel_mt4(np)
                             : plan.warp_mtiles == 2 ? pick_wgmma_kernel<2>(np)
                                                     : pick_wgmma_kernel<1>(np);
  set_max_dynamic_smem(kernel, smem_bytes);
  LaunchConfig cfg;
  cfg.grid = dim3(static_cast<unsigned>(plan.tiles_n), static_cast<unsigned>(plan.splits), static_cast<unsigned>(p.groups));
  cfg.block = dim3(kThreads);
  cfg.smem_bytes = smem_bytes;
  cfg.stream = stream;
  cfg.pdl = pdl;
  launch_kernel("gemm_fp8_wgmma", kernel, cfg, t);
}

}  // namespace detail
}  // namespace v4attn::kernels
