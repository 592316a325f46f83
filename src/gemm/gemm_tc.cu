// v1 of the fp8 and bf16 GEMMs: mma.sync m16n8k16 (f32 accumulate), weights as the A operand.
//
// Grid (tiles_n, S, groups), block 128 (4 warps). One CTA owns block_n = 64 * MT weight rows
// (rows tile * block_n ..) x all m tokens x one contiguous range of K blocks (split s of S); warp w
// owns rows [w * 16 * MT, (w + 1) * 16 * MT) of the tile, as MT m16 tiles, against NT = ceil(m/8)
// n8 tiles of tokens.
//
// Data path: a kStages-deep cp.async ring; stage i holds 128 bytes per row of every weight row of
// the tile (fp8: 4 K blocks, bf16: 2 K blocks) and of every token row (8 * NT rows; rows >= m are
// zero). Rows are 128 bytes with the 16-byte chunks XOR-swizzled so that both the cp.async writes
// and the fragment reads are free of bank conflicts. fp8 scales (weight and activation) of the
// CTA's K range are decoded to fp32 into shared memory once.
//
// Fragments (PTX ISA, mma.m16n8k16 .f16/.bf16; g = lane / 4, t = lane % 4):
//   A (16 x 16, row): a0 = A[g][2t, 2t+1], a1 = A[g+8][2t, 2t+1], a2 = A[g][2t+8, 2t+9],
//                     a3 = A[g+8][2t+8, 2t+9]   (lower k in the lower 16 bits)
//   B (16 x 8, col):  b0 = B[2t, 2t+1][g],     b1 = B[2t+8, 2t+9][g]
//   C (16 x 8):       c0, c1 = C[g][2t, 2t+1], c2, c3 = C[g+8][2t, 2t+1]
// A block sum is a sum over its 32 k in any order, so the 32 k of a block are assigned to the two
// chained k16 mmas by a permutation chosen for contiguous loads: thread t owns the 8 consecutive
// elements [8t, 8t + 8) of the block, of its weight rows g and g + 8 and of its token row g:
//   mma 0: logical k (2t, 2t+1) <- elements 8t + (0, 1);  logical k (2t+8, 2t+9) <- 8t + (2, 3)
//   mma 1: logical k (2t, 2t+1) <- elements 8t + (4, 5);  logical k (2t+8, 2t+9) <- 8t + (6, 7)
// The same map is applied to A and B (it depends only on t, which A's and B's owners share), so
// each product qa[k] * qw[k] meets its own partner. fp8 pairs are widened with
// cvt.rn.f16x2.e4m3x2 (exact) for A and B alike, so even the order of the two halves inside a
// 32-bit register is the same on both sides.
//
// Epilogue: S == 1 stores bf16 directly. S > 1: every CTA stores its fp32 partial tile, bumps the
// tile's arrival counter; the last CTA to arrive adds the S partials in split order 0..S-1 and
// stores bf16, then resets the counter to zero (deterministic: the order never depends on which
// CTA arrives last).
//
// PDL: the weight-scale preload and the weight cp.asyncs of the first kStages - 1 stages are
// issued before dev::pdl_wait(); activations, activation scales, workspace and outputs are touched
// only after it. dev::pdl_launch_dependents() follows the main loop.
#include <algorithm>
#include <string>

#include "gemm/gemm_internal.h"
#include "gemm/hopper_ptx.cuh"
#include "kernels/device_common.cuh"
#include "runtime/launch.h"

namespace v4attn::kernels {

namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kStages = 4;
constexpr int kRowBytes = 128;              // bytes of one row of one stage
constexpr int kChunksPerRow = kRowBytes / 16;
constexpr int kMaxSmemBytes = 227 * 1024 - 1024;  // sm_90 opt-in limit per block, minus static smem

template <bool kFp8>
struct TcTraits {
  static constexpr int kElemBytes = kFp8 ? 1 : 2;
  static constexpr int kBlockBytes = kGemmBlock * kElemBytes;       // 32 or 64
  static constexpr int kBlocksPerStage = kRowBytes / kBlockBytes;   // 4 or 2
};

struct TcParams {
  const uint8_t* w = nullptr;        // [groups][n, k] elements, dense: row stride k_blocks * block bytes
  const uint8_t* w_scale = nullptr;  // fp8: [groups][n/32, k_blocks] ue8m0, dense
  const uint8_t* a = nullptr;        // [groups][m, k] elements; row r at a + r * a_stride_bytes
  const uint8_t* a_scale = nullptr;  // fp8: [groups][m, k_blocks]; row r at a_scale + r * a_scale_stride
  bf16_t* out = nullptr;             // [groups][m, n]; row r at out + r * out_stride
  float* partials = nullptr;         // [S][groups][m][n] (S > 1)
  uint32_t* counters = nullptr;      // [groups][tiles_n] (S > 1), zero between GEMMs
  int64_t a_stride_bytes = 0, a_scale_stride = 0, out_stride = 0;
  int64_t w_group_bytes = 0, w_scale_group_stride = 0, a_group_bytes = 0, a_scale_group_stride = 0,
          out_group_stride = 0;
  int m = 0, n = 0, k_blocks = 0, splits = 1, tiles_n = 0;
  int max_split_blocks = 0;          // ceil(k_blocks / splits): capacity of the scale arrays
};

// ---- PTX wrappers -----------------------------------------------------------------------------
__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}
// Two e4m3 codes (low byte = lower element) -> f16x2 (lower element in the low half). Exact.
__device__ __forceinline__ uint32_t e4m3x2_to_f16x2(uint32_t two_codes) {
  const unsigned short h = static_cast<unsigned short>(two_codes & 0xffffu);
  uint32_t r;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;\n" : "=r"(r) : "h"(h));
  return r;
}

// Physical 16-byte chunk of logical chunk `ch` (0..7) in row r of a stage.
//  fp8 reads 8 bytes per thread: a half-warp (rows g = 0..3, t = 0..3) reads chunks 2j + t/2 of
//  four rows; XOR with 2 * (r % 4) spreads them over all eight chunk slots of the 128-byte bank
//  window (rows are 128 bytes apart, i.e. in the same banks). bf16 reads 16 bytes per thread: a
//  quarter-warp (rows g = 0..1) reads chunks 4j + t of two rows; XOR with 4 * (r % 2) separates
//  them. The cp.async writes (8 consecutive chunks of one row per quarter-warp) stay a permutation.
template <bool kFp8>
__device__ __forceinline__ int swizzle(int r, int ch) {
  return kFp8 ? (ch ^ ((r & 3) << 1)) : (ch ^ ((r & 1) << 2));
}

template <bool kFp8, int NT, int MT>
__global__ void __launch_bounds__(kThreads) gemm_tc_kernel(const __grid_constant__ TcParams p) {
  using Tr = TcTraits<kFp8>;
  constexpr int BN = kWarps * 16 * MT;   // weight rows per CTA
  constexpr int BM = 8 * NT;             // token rows per stage
  constexpr int kStageBytes = (BN + BM) * kRowBytes;
  constexpr int kBps = Tr::kBlocksPerStage;
  constexpr int kBlockBytes = Tr::kBlockBytes;
  static_assert((BN / 32) % 2 == 0, "sa_s must stay 8-byte aligned for its float2 reads");

  extern __shared__ __align__(128) uint8_t smem[];
  __shared__ int s_is_last;

  const int tid = static_cast<int>(threadIdx.x), lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int tile = static_cast<int>(blockIdx.x), split = static_cast<int>(blockIdx.y), grp = static_cast<int>(blockIdx.z);
  const int row0 = tile * BN;
  const int rows_valid = min(BN, p.n - row0);  // a multiple of 32, > 0
  const int kb_begin = static_cast<int>(static_cast<int64_t>(split) * p.k_blocks / p.splits);
  const int kb_end = static_cast<int>(static_cast<int64_t>(split + 1) * p.k_blocks / p.splits);
  const int nkb = kb_end - kb_begin;  // >= 1 (splits <= k_blocks)
  const int n_iter = (nkb + kBps - 1) / kBps;

  const int64_t w_row_bytes = static_cast<int64_t>(p.k_blocks) * kBlockBytes;
  const uint8_t* w_tile = p.w + grp * p.w_group_bytes + row0 * w_row_bytes + static_cast<int64_t>(kb_begin) * kBlockBytes;
  const uint8_t* a_tile = p.a + grp * p.a_group_bytes + static_cast<int64_t>(kb_begin) * kBlockBytes;

  float* sw_s = reinterpret_cast<float*>(smem + kStages * kStageBytes);  // [BN/32][max_split_blocks]
  float* sa_s = sw_s + (BN / 32) * p.max_split_blocks;                    // [max_split_blocks][BM]

  const uint64_t stream = dev::l2_policy_stream();  // weights: read once per cycle
  auto load_w = [&](int it) {  // weight rows of stage `it` -> slot it % kStages
    uint8_t* dst = smem + (it % kStages) * kStageBytes;
    const int kb0 = it * kBps;
    const int chunks_valid = min(kBps, nkb - kb0) * (kBlockBytes / 16);
#pragma unroll
    for (int i = 0; i < BN * kChunksPerRow / kThreads; ++i) {
      const int c = tid + i * kThreads;
      const int r = c / kChunksPerRow, ch = c % kChunksPerRow;
      if (r < rows_valid && ch < chunks_valid)
        dev::cp_async16_stream(smem_u32(dst + r * kRowBytes + swizzle<kFp8>(r, ch) * 16),
                               w_tile + r * w_row_bytes + kb0 * kBlockBytes + ch * 16, stream);
    }
  };
  auto load_a = [&](int it) {  // token rows < m of stage `it`
    uint8_t* dst = smem + (it % kStages) * kStageBytes + BN * kRowBytes;
    const int kb0 = it * kBps;
    const int chunks_valid = min(kBps, nkb - kb0) * (kBlockBytes / 16);
    for (int c = tid; c < BM * kChunksPerRow; c += kThreads) {
      const int r = c / kChunksPerRow, ch = c % kChunksPerRow;
      if (r < p.m && ch < chunks_valid)
        cp_async_16(smem_u32(dst + r * kRowBytes + swizzle<kFp8>(r, ch) * 16),
                    a_tile + r * p.a_stride_bytes + kb0 * kBlockBytes + ch * 16);
    }
  };

  // ---- prologue, part 1: only constant data (weights), before the PDL wait ----------------------
  // Token rows m..BM-1 of every slot are zero for the whole kernel (never loaded; their mma
  // columns are never stored, zeros just keep them finite).
  for (int i = tid; i < kStages * BM * kChunksPerRow; i += kThreads) {
    const int slot = i / (BM * kChunksPerRow), r = (i / kChunksPerRow) % BM, ch = i % kChunksPerRow;
    if (r >= p.m)
      *reinterpret_cast<uint4*>(smem + slot * kStageBytes + (BN + r) * kRowBytes + ch * 16) = make_uint4(0, 0, 0, 0);
  }
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s)
    if (s < n_iter) load_w(s);
  if constexpr (kFp8) {  // weight scales of the tile's K range, decoded once (while the copies fly)
    const uint8_t* sw_g = p.w_scale + grp * p.w_scale_group_stride + static_cast<int64_t>(row0 / 32) * p.k_blocks + kb_begin;
#pragma unroll
    for (int rg = 0; rg < BN / 32; ++rg)
      for (int b = tid; b < nkb; b += kThreads)
        sw_s[rg * p.max_split_blocks + b] = rg * 32 < rows_valid ? num::f32_from_ue8m0(sw_g[rg * p.k_blocks + b]) : 0.0f;
  }

  dev::pdl_wait();  // activations (and their scales) are the predecessor's output

  // ---- prologue, part 2: activations --------------------------------------------------------------
  // Group s of the prologue = {stage s's activations} (+ all prologue weights in group 0).
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < n_iter) load_a(s);
    cp_async_commit();
  }
  if constexpr (kFp8) {  // activation scales, [block][token]; tokens >= m get 0
    const uint8_t* sa_g = p.a_scale + grp * p.a_scale_group_stride + kb_begin;
    for (int r = 0; r < BM; ++r)
      for (int b = tid; b < nkb; b += kThreads)
        sa_s[b * BM + r] = r < p.m ? num::f32_from_ue8m0(sa_g[r * p.a_scale_stride + b]) : 0.0f;
  }

  float acc[MT][NT][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[mt][nt][i] = 0.0f;

  bool live[MT];  // m16 tile inside n (n % 32 == 0, so a tile is all in or all out)
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) live[mt] = row0 + warp * 16 * MT + mt * 16 < p.n;
  const float zero4[4] = {0.0f, 0.0f, 0.0f, 0.0f};

  // ---- main loop ----------------------------------------------------------------------------------
  for (int it = 0; it < n_iter; ++it) {
    cp_async_wait<kStages - 2>();  // this thread's copies of stage `it` have landed ...
    __syncthreads();               // ... everyone's too; and slot (it - 1) % kStages is free again
    {
      const int next = it + kStages - 1;
      if (next < n_iter) {
        load_w(next);
        load_a(next);
      }
      cp_async_commit();  // possibly empty: keeps one group per iteration
    }

    const uint8_t* ws = smem + (it % kStages) * kStageBytes;
    const uint8_t* as = ws + BN * kRowBytes;
    const int kb0 = it * kBps;
    const int nb = min(kBps, nkb - kb0);
#pragma unroll
    for (int j = 0; j < kBps; ++j) {
      if (j >= nb) break;
      // A fragments (weights) of both k16 halves, and the weight scale, per m16 tile.
      uint32_t af[MT][2][4];
      [[maybe_unused]] float swv[MT];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        const int r = warp * 16 * MT + mt * 16 + g;
        if constexpr (kFp8) {
          const int ch = 2 * j + (t >> 1), off = (t & 1) * 8;
          const uint2 lo = *reinterpret_cast<const uint2*>(ws + r * kRowBytes + swizzle<kFp8>(r, ch) * 16 + off);
          const uint2 hi = *reinterpret_cast<const uint2*>(ws + (r + 8) * kRowBytes + swizzle<kFp8>(r + 8, ch) * 16 + off);
          af[mt][0][0] = e4m3x2_to_f16x2(lo.x);
          af[mt][0][1] = e4m3x2_to_f16x2(hi.x);
          af[mt][0][2] = e4m3x2_to_f16x2(lo.x >> 16);
          af[mt][0][3] = e4m3x2_to_f16x2(hi.x >> 16);
          af[mt][1][0] = e4m3x2_to_f16x2(lo.y);
          af[mt][1][1] = e4m3x2_to_f16x2(hi.y);
          af[mt][1][2] = e4m3x2_to_f16x2(lo.y >> 16);
          af[mt][1][3] = e4m3x2_to_f16x2(hi.y >> 16);
          swv[mt] = sw_s[((warp * 16 * MT + mt * 16) / 32) * p.max_split_blocks + kb0 + j];
        } else {
          const int ch = 4 * j + t;
          const uint4 lo = *reinterpret_cast<const uint4*>(ws + r * kRowBytes + swizzle<kFp8>(r, ch) * 16);
          const uint4 hi = *reinterpret_cast<const uint4*>(ws + (r + 8) * kRowBytes + swizzle<kFp8>(r + 8, ch) * 16);
          af[mt][0][0] = lo.x;
          af[mt][0][1] = hi.x;
          af[mt][0][2] = lo.y;
          af[mt][0][3] = hi.y;
          af[mt][1][0] = lo.z;
          af[mt][1][1] = hi.z;
          af[mt][1][2] = lo.w;
          af[mt][1][3] = hi.w;
          swv[mt] = 1.0f;
        }
      }
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        const int tr = nt * 8 + g;  // token row of this thread's B column
        uint32_t b[2][2];
        [[maybe_unused]] float sa0 = 1.0f, sa1 = 1.0f;
        if constexpr (kFp8) {
          const int ch = 2 * j + (t >> 1), off = (t & 1) * 8;
          const uint2 q = *reinterpret_cast<const uint2*>(as + tr * kRowBytes + swizzle<kFp8>(tr, ch) * 16 + off);
          b[0][0] = e4m3x2_to_f16x2(q.x);
          b[0][1] = e4m3x2_to_f16x2(q.x >> 16);
          b[1][0] = e4m3x2_to_f16x2(q.y);
          b[1][1] = e4m3x2_to_f16x2(q.y >> 16);
          const float2 sa = *reinterpret_cast<const float2*>(sa_s + (kb0 + j) * BM + nt * 8 + 2 * t);
          sa0 = sa.x;  // token nt*8 + 2t   (C columns c0 / c2)
          sa1 = sa.y;  // token nt*8 + 2t+1 (C columns c1 / c3)
        } else {
          const int ch = 4 * j + t;
          const uint4 q = *reinterpret_cast<const uint4*>(as + tr * kRowBytes + swizzle<kFp8>(tr, ch) * 16);
          b[0][0] = q.x;
          b[0][1] = q.y;
          b[1][0] = q.z;
          b[1][1] = q.w;
        }
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          if (!live[mt]) continue;
          float d[4];
          hopper::mma_m16n8k16<kFp8>(d, af[mt][0], b[0][0], b[0][1], zero4);  // elements 8t + 0..3 of the block
          hopper::mma_m16n8k16<kFp8>(d, af[mt][1], b[1][0], b[1][1], d);      // elements 8t + 4..7: d = block sum
          if constexpr (kFp8) {
            // sa * sw is a power of two: exact; so is blocksum * (sa * sw). One rounding, like the
            // reference's acc + ((blocksum * sa) * sw).
            const float s0 = num::mul_rn(sa0, swv[mt]), s1 = num::mul_rn(sa1, swv[mt]);
            acc[mt][nt][0] = __fmaf_rn(d[0], s0, acc[mt][nt][0]);
            acc[mt][nt][1] = __fmaf_rn(d[1], s1, acc[mt][nt][1]);
            acc[mt][nt][2] = __fmaf_rn(d[2], s0, acc[mt][nt][2]);
            acc[mt][nt][3] = __fmaf_rn(d[3], s1, acc[mt][nt][3]);
          } else {
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[mt][nt][i] = num::add_rn(acc[mt][nt][i], d[i]);
          }
        }
      }
    }
  }
  cp_async_wait<0>();  // nothing useful is pending (only empty groups); keep the ring quiet at exit
  dev::pdl_launch_dependents();

  // ---- epilogue -----------------------------------------------------------------------------------
  // Element (mt, nt, i): weight row n = row0 + warp*16*MT + mt*16 + g + (i >= 2 ? 8 : 0),
  // token m = nt*8 + 2t + (i & 1).
  bf16_t* out = p.out + grp * p.out_group_stride;
  if (p.splits == 1) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      if (!live[mt]) continue;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int n = row0 + warp * 16 * MT + mt * 16 + g + (i >= 2 ? 8 : 0);
          const int m = nt * 8 + 2 * t + (i & 1);
          if (m < p.m) out[m * p.out_stride + n] = num::bf16_from_f32(acc[mt][nt][i]);
        }
    }
    return;
  }

  const int64_t mn = static_cast<int64_t>(p.m) * p.n;
  const int groups = static_cast<int>(gridDim.z);
  float* part = p.partials + (static_cast<int64_t>(split) * groups + grp) * mn;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    if (!live[mt]) continue;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int n = row0 + warp * 16 * MT + mt * 16 + g + (i >= 2 ? 8 : 0);
        const int m = nt * 8 + 2 * t + (i & 1);
        if (m < p.m) part[static_cast<int64_t>(m) * p.n + n] = acc[mt][nt][i];
      }
  }
  // Classic last-block pattern: each thread fences its own partial stores device-wide before the
  // barrier; thread 0's counter bump then orders after all of them.
  __threadfence();
  __syncthreads();
  uint32_t* counter = p.counters + grp * p.tiles_n + tile;
  if (tid == 0) {
    const uint32_t arrived = atomicAdd(counter, 1u);
    s_is_last = arrived == static_cast<uint32_t>(p.splits - 1) ? 1 : 0;
  }
  __syncthreads();
  if (!s_is_last) return;
  __threadfence();  // acquire side: the other CTAs' partials are visible (read through L2 below)

  const float* base = p.partials + static_cast<int64_t>(grp) * mn;
  const int64_t split_stride = static_cast<int64_t>(groups) * mn;
  for (int idx = tid; idx < p.m * rows_valid; idx += kThreads) {
    const int m = idx / rows_valid, n = row0 + idx % rows_valid;
    const int64_t off = static_cast<int64_t>(m) * p.n + n;
    float sum = __ldcg(base + off);
    for (int s = 1; s < p.splits; ++s) sum = num::add_rn(sum, __ldcg(base + s * split_stride + off));
    out[m * p.out_stride + n] = num::bf16_from_f32(sum);
  }
  if (tid == 0) *counter = 0u;  // every CTA of this tile has arrived: ready for the next GEMM
}

using TcKernel = void (*)(TcParams);

template <bool kFp8, int MT>
TcKernel pick_kernel(int nt) {
  switch (nt) {
    case 1: return gemm_tc_kernel<kFp8, 1, MT>;
    case 2: return gemm_tc_kernel<kFp8, 2, MT>;
    case 3: return gemm_tc_kernel<kFp8, 3, MT>;
    case 4: return gemm_tc_kernel<kFp8, 4, MT>;
    case 5: return gemm_tc_kernel<kFp8, 5, MT>;
    case 6: return gemm_tc_kernel<kFp8, 6, MT>;
    case 7: return gemm_tc_kernel<kFp8, 7, MT>;
    case 8: return gemm_tc_kernel<kFp8, 8, MT>;
    default: throw std::invalid_argument("gemm v1: m must be 1..64");
  }
}

template <bool kFp8>
void launch_tc(const TcParams& base, int groups, const GemmPlan& plan, const GemmWorkspace& ws, cudaStream_t stream,
               bool pdl) {
  TcParams p = base;
  const int nt = (p.m + 7) / 8;
  const int bn = plan.block_n, bm = 8 * nt;
  p.splits = plan.splits;
  p.tiles_n = plan.tiles_n;
  p.max_split_blocks = (p.k_blocks + plan.splits - 1) / plan.splits;
  if (plan.splits > 1) {
    uint8_t* wsb = static_cast<uint8_t*>(ws.data);
    p.counters = reinterpret_cast<uint32_t*>(wsb);
    p.partials = reinterpret_cast<float*>(wsb + detail::workspace_counter_bytes(groups, plan.tiles_n));
  }
  size_t smem = static_cast<size_t>(kStages) * static_cast<size_t>(bn + bm) * kRowBytes;
  if (kFp8) smem += static_cast<size_t>(bn / 32 + bm) * static_cast<size_t>(p.max_split_blocks) * sizeof(float);
  if (smem > static_cast<size_t>(kMaxSmemBytes))
    throw std::invalid_argument(std::string(kFp8 ? "run_gemm_fp8" : "run_gemm_bf16") + ": k range per CTA too long (" +
                                std::to_string(smem) + " B of shared memory); use more splits");
  const TcKernel kernel = plan.warp_mtiles == 2 ? pick_kernel<kFp8, 2>(nt) : pick_kernel<kFp8, 1>(nt);
  // bf16 with 64 weight rows and 25..32 tokens asks for exactly 48 KB of dynamic shared memory,
  // which with the kernel's static s_is_last is over the default limit (cudaErrorInvalidValue):
  // always raise the limit to what this launch uses.
  detail::set_max_dynamic_smem(kernel, smem);
  LaunchConfig cfg;
  cfg.grid = dim3(static_cast<unsigned>(plan.tiles_n), static_cast<unsigned>(plan.splits), static_cast<unsigned>(groups));
  cfg.block = dim3(kThreads);
  cfg.smem_bytes = smem;
  cfg.stream = stream;
  cfg.pdl = pdl;
  launch_kernel(kFp8 ? "gemm_fp8_tc" : "gemm_bf16_tc", kernel, cfg, p);
}

}  // namespace

GemmPlan plan_gemm_tc(int m, int64_t n, int64_t k, int groups, int force_splits, int force_mtiles) {
  auto fail = [](const std::string& what) { throw std::invalid_argument("plan_gemm_tc: " + what); };
  if (m < 0 || n <= 0 || k <= 0 || groups < 1) fail("need m >= 0, n > 0, k > 0, groups >= 1");
  if (force_splits < 0 || force_mtiles < 0 || force_mtiles > 2) fail("force_splits >= 0, force_mtiles in 0..2");
  const int64_t kb = k / kGemmBlock;
  if (kb < 1) fail("k < 32");
  GemmPlan plan;
  // Two m16 tiles per warp halve the activation-fragment work per weight byte, but double the
  // rows per CTA: worth it only when there are still >= 128 tiles (enough CTAs without split-K).
  plan.warp_mtiles = force_mtiles != 0 ? force_mtiles : (groups * ((n + 127) / 128) >= 128 ? 2 : 1);
  plan.block_n = 64 * plan.warp_mtiles;
  plan.tiles_n = static_cast<int>((n + plan.block_n - 1) / plan.block_n);
  const int64_t tiles = static_cast<int64_t>(groups) * plan.tiles_n;
  int64_t s;
  if (force_splits != 0) s = std::min<int64_t>(force_splits, kb);
  else if (tiles >= 192) s = 1;  // enough CTAs to keep 132 SMs streaming
  else s = std::clamp<int64_t>((256 + tiles / 2) / tiles, 1, std::max<int64_t>(1, kb / 4));  // ~256 CTAs, >= 4 blocks each
  plan.splits = static_cast<int>(s);
  plan.workspace_bytes = plan.splits > 1 ? detail::workspace_counter_bytes(groups, plan.tiles_n) +
                                               static_cast<size_t>(plan.splits) * static_cast<size_t>(groups) *
                                                   static_cast<size_t>(m) * static_cast<size_t>(n) * sizeof(float)
                                         : 0;
  return plan;
}

void init_gemm_workspace(const GemmWorkspace& ws, cudaStream_t stream) {
  if (ws.bytes == 0) return;
  if (ws.data == nullptr) throw std::invalid_argument("init_gemm_workspace: null data with nonzero bytes");
  V4_CUDA_CHECK(cudaMemsetAsync(ws.data, 0, ws.bytes, stream));
}

namespace detail {

void launch_gemm_fp8_tc(const Fp8GemmParams& p, const GemmPlan& plan, const GemmWorkspace& ws, cudaStream_t stream,
                        bool pdl) {
  TcParams t;
  t.w = p.w;
  t.w_scale = p.w_scale;
  t.a = p.a_q;
  t.a_scale = p.a_scale;
  t.out = p.out;
  t.a_stride_bytes = p.a_stride;
  t.a_scale_stride = p.a_scale_stride;
  t.out_stride = p.out_stride;
  t.w_group_bytes = p.w_group_stride;
  t.w_scale_group_stride = p.w_scale_group_stride;
  t.a_group_bytes = p.a_group_stride;
  t.a_scale_group_stride = p.a_scale_group_stride;
  t.out_group_stride = p.out_group_stride;
  t.m = p.m;
  t.n = static_cast<int>(p.n);
  t.k_blocks = static_cast<int>(p.k / kGemmBlock);
  launch_tc<true>(t, p.groups, plan, ws, stream, pdl);
}

void launch_gemm_bf16_tc(const Bf16GemmParams& p, const GemmPlan& plan, const GemmWorkspace& ws, cudaStream_t stream,
                         bool pdl) {
  TcParams t;
  t.w = reinterpret_cast<const uint8_t*>(p.w);
  t.a = reinterpret_cast<const uint8_t*>(p.x);
  t.out = p.out;
  t.a_stride_bytes = p.x_stride * 2;
  t.out_stride = p.out_stride;
  t.w_group_bytes = p.w_group_stride * 2;
  t.a_group_bytes = p.x_group_stride * 2;
  t.out_group_stride = p.out_group_stride;
  t.m = p.m;
  t.n = static_cast<int>(p.n);
  t.k_blocks = static_cast<int>(p.k / kGemmBlock);
  launch_tc<false>(t, p.groups, plan, ws, stream, pdl);
}

}  // namespace detail
}  // namespace v4attn::kernels
