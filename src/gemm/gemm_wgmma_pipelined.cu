// v3 of the fp8 GEMM (GemmVersion::kWgmmaPipelined): v2's Hopper wgmma + TMA design with the
// consumer loop software-pipelined, the weight widening split between the cvt pipe and the integer
// pipe, the scale products precomputed per stage, and the split-K reduction done inside a
// thread-block cluster through distributed shared memory (no global workspace).
//
// Grid (tiles_n, S, groups), cluster (1, S, 1) when S > 1, block 384 = 3 warpgroups, one CTA per SM.
// One CTA owns block_n = 128 * MT weight rows (rows tile * block_n ..) x all m tokens x one
// contiguous range of K blocks (split s of S; S <= 8, S depends only on (n, k, groups)). The S CTAs
// of one output tile form one cluster.
//
// Roles (registers as v2: producer warpgroup setmaxnreg 40, consumers 232):
//  - warpgroup 0, warp 0, lane 0: producer, exactly as v2 (per 128-byte stage of K = 4 K blocks: one
//    TMA box of weights [block_n x 128 B] and one of activation codes [NP x 128 B], 128B swizzle,
//    onto the stage's `full` mbarrier; weight boxes of the first ring fill before dev::pdl_wait()).
//  - warpgroup 0, warps 1..3 (from 32 rows, when the producer has no refill to issue: warps 0..3):
//    converters. Per stage: the activation codes widened to f16 into an Xf
//    slot (ring of 2; wgmma's 128B-swizzle K-major B layout, as v2), and the table of scale products
//    ss[block][32-row group][token] = sa * sw (* 2^8 for integer-widened blocks, below), so that the
//    consumers do one fma per accumulator and nothing else.
//  - warpgroups 1, 2: consumers, MT m64 tiles each. The work of a warpgroup is a sequence of units
//    u = (K block b, tile mt) in the order b = 0, 1, ..., tiles inner. Unit u: ldmatrix.x4 of the
//    weight bytes, widening to f16 A fragments, two chained wgmma m64nNPk16 (the first with
//    scale-d = 0) into a block-sum register set, commit. D = kDepth block-sum sets (and A fragment
//    sets) rotate: the wgmmas of units u + 1 .. u + D - 1 are issued BEFORE waiting for unit u
//    (wgmma.wait_group D - 1), so the tensor core works on them while the CUDA cores fold u's block
//    sums into the accumulators and widen the weights of u + D (their ldmatrix is issued before
//    u's fmas, and u's scale products are loaded before its wait). D = 3 with one m64 tile per
//    warpgroup up to 32 rows, else 2 (session 35). The fma order per accumulator is
//    still b = 0, 1, 2, ... (the units of one tile are folded in block order). The loop runs in
//    straight-line iterations of 8 units (one stage at MT = 2, two at MT = 1) that drain the last
//    unit with wait_group 0: ptxas serializes every wgmma of a kernel (C7514) when a wgmma stays
//    in flight across a loop back-edge while block sums are read in the loop, or when the issue /
//    wait pattern depends on run-time conditions; units past the CTA's K range are issued as
//    dummies (their block sums are never read) to keep the pattern static.
//
// Weight widening (per K block j = b % 4 of a stage, `int_mask` bit j):
//  - cvt (bit clear): cvt.rn.f16x2.e4m3x2 on the byte pairs (4t, 4t+1) / (4t+2, 4t+3) of a
//    thread's word, exactly as v2 (the activations use the same instruction on the same pairs).
//  - integer (bit set): the bytes placed into f16 bit patterns (hopper_ptx.cuh), which gives the
//    weight value * 2^-8 exactly, pairs (4t, 4t+2) / (4t+1, 4t+3); the converters widen the
//    activations of such a block with the same integer ops followed by an exact * 256 (so the
//    activations are exact), writing them at the matching logical k. The block sum is then exactly
//    2^-8 * the true block sum (every product is scaled by the same power of two; the tensor core's
//    accumulation is scale-invariant far from the fp32 underflow range, and the smallest product is
//    2^-17 * 2^-9), and the scale product of that block carries the 2^8 back: ss = sa * (sw * 2^8).
//  Why both: Hopper's conversion pipe (F2FP) is slow, so a consumer that widens everything with
//  cvt is bound by it; the integer path costs ~3.5 ALU instructions per pair instead of one F2FP.
//  Mixing them (blocks 1 and 3 of every stage integer, 0b1010) loads both pipes; that was the
//  default until session 9, when all-cvt (0) measured faster alone (bench_gemm wq_a|wkv m = 1..64:
//  -0.4 to -0.5 us) and in the cycle (three-lane verify bs 1 -1.4 %, verify bs 4 / decode bs 8 /
//  decode bs 32 -0.7 to -0.9 %; digests unchanged), once the L2 stream policy had removed the
//  instruction-fetch and operand waits that made the conversion pipe look like the limit.
//
// Numerics (identical to v1 / v2 up to the order of additions inside a block, spec section 6):
//  - per block b, the tensor core forms the block sum of the 32 exact products (fp32 accumulation)
//    in some order; acc = fma(blocksum', ss, acc) with blocksum' * ss == blocksum * sa * sw exactly
//    (powers of two), so one rounding per block like the reference's acc + (blocksum * sa) * sw.
//    Blocks in increasing K order from +0. Assumes sa * sw < 2^119 (so that sa * sw * 2^8 does not
//    overflow; any real weight / activation scales), and that the tensor core takes f16 subnormal
//    inputs as they are (the integer-widened e4m3 subnormal weights; tested).
//  - split-K (S > 1): the CTA of split s sums its contiguous range of K blocks; the partials are
//    added in the fixed order ((P0 + P1) + P2) + ... exactly as v1 / v2 (never timing-dependent).
//
// Epilogue:
//  - S == 1: the accumulators are rounded to bf16 into shared memory ([NP][block_n + 8], conflict-
//    free), then written out in 16-byte pieces of rows (scalar stores when the output is not aligned).
//  - S > 1: each CTA stores its fp32 partial tile in its own shared memory ([NP][block_n + 4]), the
//    cluster synchronises, and CTA s reduces elements [s * E / S, (s + 1) * E / S) of the tile
//    (E = m * block_n / 4 float4 pieces), reading the S partials from the cluster's shared memory in
//    split order; a second cluster barrier keeps every CTA's shared memory alive until all reads are
//    done. All 384 threads take part in both cluster barriers.
//
// Shared memory (1024-aligned base): W slots [stages][block_n][128 B], Xc slots [stages][NP][128 B]
// (TMA, 128B swizzle), Xf slots [2][2 K-halves][NP][128 B] (f16), ss [2][4][block_n/32][NP] fp32;
// the epilogue reuses this region (all of it is dead by then); then decoded weight scales
// [block_n/32][kb_cta] and activation scales [kb_cta][NP] (fp32), then the mbarriers.
#include <cuda.h>

#include <algorithm>
#include <cstring>
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

using namespace hopper;

constexpr int kWarpgroupThreads = 128;
constexpr int kConsumerWarpgroups = 2;
constexpr int kThreads = kWarpgroupThreads * (1 + kConsumerWarpgroups);  // 384
constexpr int kConsumerThreads = kWarpgroupThreads * kConsumerWarpgroups;  // 256
constexpr int kConverterThreads = 96;                                       // warps 1..3
constexpr int kStageK = 128;                           // K bytes per stage (one 128B-swizzle row)
constexpr int kBlocksPerStage = kStageK / kGemmBlock;  // 4
constexpr int kXfSlots = 2;
// Block-sum (and A fragment) register sets of a consumer warpgroup = units in flight: three with one
// m64 tile per warpgroup up to 32 rows, else two (session 35, bench_gemm wq_a|wkv: three sets -2 % at
// 24-32 rows, +1.4 / +2.6 % at 48 / 64, idx_wq_b (two tiles) +1.5 % at 32-48).
template <int MT, int NP>
constexpr int kDepth = MT == 1 && NP <= 32 ? 3 : 2;
constexpr int kMaxStages = 8;
constexpr int kSmemLimit = 227 * 1024;  // sm_90 opt-in dynamic shared memory per block
constexpr int kSmemAlign = 1024;        // 128B-swizzle atoms (TMA destination, wgmma operand)
constexpr int kMaxClusterSplits = 8;    // portable cluster size: S <= 8
constexpr int64_t kOneWaveCtas = 120;   // automatic plans: at most this many CTAs in clusters ...
constexpr int64_t kClusterCtas = 96;    // ... else two tiles per warpgroup and about this many
constexpr int kDefaultIntMask = 0;      // every block widened with cvt (see "Weight widening")
constexpr uint32_t kConsumerBarrierId = 1;  // named barrier of the 256 consumers
constexpr uint32_t kProducerRegs = 40, kConsumerRegs = 232;
constexpr float kIntWidenScale = 256.0f;  // integer-widened weights are x * 2^-8
static_assert(kWarpgroupThreads * kProducerRegs + kConsumerThreads * kConsumerRegs <= kThreads * 168,
              "setmaxnreg split must fit the CTA's register pool (168 per thread at launch)");

// Byte offsets inside the CTA's shared memory (from the 1024-aligned base); host and device use the
// same function, so the launcher sizes exactly what the kernel addresses.
struct SmemLayout {
  uint32_t w = 0, xc = 0, xf = 0, ss = 0, epi = 0, sw = 0, sa = 0, bar = 0, total = 0;
};
__host__ __device__ constexpr uint32_t epilogue_bytes(int block_n, int np) {
  // S > 1: fp32 [np][block_n + 4]; S == 1: bf16 [np][block_n + 8] (smaller).
  return static_cast<uint32_t>(np * (block_n + 4) * 4);
}
__host__ __device__ constexpr SmemLayout smem_layout(int block_n, int np, int stages, int max_split_blocks) {
  SmemLayout l;
  uint32_t off = 0;
  l.w = off;
  off += static_cast<uint32_t>(stages * block_n * kStageK);
  l.xc = off;
  off += static_cast<uint32_t>(stages * np * kStageK);
  l.xf = off;
  off += static_cast<uint32_t>(kXfSlots * np * kStageK * 2);
  l.ss = off;
  off += static_cast<uint32_t>(kXfSlots * kBlocksPerStage * (block_n / 32) * np * 4);
  l.epi = 0;  // overlaps the rings: used only after the main loop
  off = off > epilogue_bytes(block_n, np) ? off : epilogue_bytes(block_n, np);
  off = (off + 15u) & ~15u;
  l.sw = off;
  off += static_cast<uint32_t>((block_n / 32) * max_split_blocks * 4);
  l.sa = off;  // 16-aligned: (block_n / 32) * 4 bytes is a multiple of 16
  off += static_cast<uint32_t>(max_split_blocks * np * 4);
  off = (off + 7u) & ~7u;
  l.bar = off;  // full[stages], empty[stages], xready[2], xfree[2]
  off += static_cast<uint32_t>((2 * stages + 2 * kXfSlots) * 8);
  l.total = off;
  return l;
}
size_t smem_request(const SmemLayout& l) { return static_cast<size_t>(l.total) + kSmemAlign; }

struct Wgmma3Params {
  CUtensorMap tmap_w;  // weights [groups][n][k] bytes; box {128, block_n, 1}, 128B swizzle
  CUtensorMap tmap_x;  // activation codes [groups][m][k] (row stride a_stride); box {128, NP, 1}, 128B swizzle
  const uint8_t* w_scale = nullptr;  // [groups][n/32, k_blocks] ue8m0, dense
  const uint8_t* a_scale = nullptr;  // [groups][m, k_blocks]; row r at a_scale + r * a_scale_stride
  bf16_t* out = nullptr;             // [groups][m, n]; row r at out + r * out_stride
  int64_t a_scale_stride = 0, out_stride = 0;
  int64_t w_scale_group_stride = 0, a_scale_group_stride = 0, out_group_stride = 0;
  int m = 0, n = 0, k_blocks = 0, splits = 1;
  int stages = 0;            // ring depth (1..kMaxStages)
  int max_split_blocks = 0;  // ceil(k_blocks / splits): capacity of the scale arrays
  int int_mask = kDefaultIntMask;  // bit j: block j of every stage widened with integer ops
  int out_vec = 0;           // 2: 16-byte output stores allowed, 1: 8-byte, 0: scalar only
  // Fused act quant (run_gemm_fp8_fused_quant): the bf16 activations [m, k] (row r at a_bf16 + r *
  // a_bf16_stride); tmap_x and a_scale are then unused. Requires stages >= every CTA's n_iter.
  const bf16_t* a_bf16 = nullptr;
  int64_t a_bf16_stride = 0;
};

// Consumer state that does not change over the main loop (one warpgroup, one thread).
struct ConsumerCtx {
  uint32_t w_base;     // shared address of W slot 0 + this thread's ldmatrix row offset (tile 0)
  uint32_t xf_base;    // shared address of Xf slot 0
  uint32_t bar_full, bar_empty, bar_xready, bar_xfree;
  const float* ss_base;  // ss slot 0 + this thread's (row group of tile 0, token pair) offset
  int stages, nkb, n_iter, int_mask;
  int ld_chunk;        // 0 / 1: which 16-byte chunk of the block pair this lane addresses
  int ld_swz;          // ldmatrix row & 7 (the 128B swizzle of its row)
};

// One stage as the consumer loop sees it (computed once per stage, used by its 4 * MT units).
// A stage index past the CTA's last stage (the absent second stage of a last MT = 1 iteration)
// refers to the last stage's slots with nb = 0: its units are dummies.
struct StageRef {
  uint32_t w_slot, xf_slot;            // shared addresses (W: incl. this thread's ldmatrix row)
  const float* ss;                     // scale products of the stage (this thread's row group / tokens)
  uint32_t full, empty, xready, xfree; // barrier addresses
  uint32_t full_parity, xready_parity;
  int nb;                              // K blocks of the stage (0: not a stage of this CTA)
};
// pos: the ring position of the stage referred to (of the last stage when `it` is past it).
template <int MT, int NP>
__device__ __forceinline__ StageRef stage_ref(const ConsumerCtx& c, int it, const RingPos& pos) {
  constexpr int BN = kConsumerWarpgroups * 64 * MT;
  StageRef r;
  const bool real = it < c.n_iter;
  const int ite = real ? it : c.n_iter - 1;
  static_assert(kXfSlots == 2, "x and xready_parity below are ite % kXfSlots and (ite / kXfSlots) & 1");
  const int s = pos.slot, x = ite & 1;
  r.w_slot = c.w_base + static_cast<uint32_t>(s * BN * kStageK);
  r.xf_slot = c.xf_base + static_cast<uint32_t>(x * NP * kStageK * 2);
  r.ss = c.ss_base + x * kBlocksPerStage * (BN / 32) * NP;
  r.full = c.bar_full + 8u * static_cast<uint32_t>(s);
  r.empty = c.bar_empty + 8u * static_cast<uint32_t>(s);
  r.xready = c.bar_xready + 8u * static_cast<uint32_t>(x);
  r.xfree = c.bar_xfree + 8u * static_cast<uint32_t>(x);
  r.full_parity = pos.parity;
  r.xready_parity = static_cast<uint32_t>((ite >> 1) & 1);
  r.nb = real ? min(kBlocksPerStage, c.nkb - ite * kBlocksPerStage) : 0;
  return r;
}

// The main loop of a consumer warpgroup runs in iterations of 8 units, a unit being (K block,
// m64 tile): MT = 2: one stage (4 blocks x 2 tiles), MT = 1: two stages (2 x 4 blocks). Unit K
// (0..7, static) of an iteration uses register set K % kDepth.
template <int MT>
constexpr int kStagesPerIter = MT == 2 ? 1 : 2;
template <int MT, int NP, int K>
struct Unit {
  static constexpr int stage = MT == 2 ? 0 : K >> 2;  // stage of the iteration
  static constexpr int j = MT == 2 ? K >> 1 : K & 3;  // block of the stage
  static constexpr int mt = MT == 2 ? K & 1 : 0;      // tile of the warpgroup
  static constexpr int buf = K % kDepth<MT, NP>;
  static constexpr bool first_of_stage = j == 0 && mt == 0;
  static constexpr bool last_of_stage = j == kBlocksPerStage - 1 && mt == MT - 1;
};

// Unit K of an iteration in three parts, so that each step can overlap its latencies:
//  - load_unit: waits for the stage's data on its first unit, ldmatrix of the weight bytes (issued
//    one unit ahead of their widening, so its latency hides behind the previous unit's fmas);
//  - widen_issue: widening into register set K & 1, waits for the stage's f16 activations on its
//    first unit, two wgmmas, commit; releases the stage's weight slot after its last unit;
//  - the fold in consume_unit.
// Units beyond the CTA's K range (blocks past a partial last stage, or the absent second stage of a
// last MT = 1 iteration) are dummies: the iteration's code is straight-line (every unit issues
// exactly one wgmma group, every wait is static), which ptxas needs to keep the wgmmas
// asynchronous. A dummy reads operands of the CTA's last stage (never refilled: no stage follows)
// and its block sums are never read; it does no barrier waits or arrivals.
template <int MT, int NP, int K>
__device__ __forceinline__ void load_unit(const ConsumerCtx& c, const StageRef (&sr)[2], uint32_t (&q)[4]) {
  using U = Unit<MT, NP, K>;
  const StageRef& r = sr[U::stage];
  if (U::first_of_stage && r.nb > 0) mbar_wait(r.full, r.full_parity);
  const int chunk = 2 * U::j + c.ld_chunk;
  ldmatrix_x4(q, r.w_slot + static_cast<uint32_t>(U::mt * 64 * kStageK + ((chunk ^ c.ld_swz) << 4)));
}

template <int MT, int NP, int K>
__device__ __forceinline__ void widen_issue(const ConsumerCtx& c, const StageRef (&sr)[2], const uint32_t (&q)[4],
                                            uint32_t (&af)[kDepth<MT, NP>][2][4], float (&d)[kDepth<MT, NP>][NP / 2]) {
  using U = Unit<MT, NP, K>;
  const StageRef& r = sr[U::stage];
  const bool stage_real = r.nb > 0;
  // q[0] / q[1]: rows g / g + 8, bytes 4t..4t+3 of the block's first 16 bytes (wgmma 0);
  // q[2] / q[3]: the same of its second 16 bytes (wgmma 1). A fragment (PTX ALayout_64x16):
  // a0 = (row g, k 2t..2t+1), a1 = (row g+8, k 2t..), a2 = (row g, k 2t+8..), a3 = (row g+8, k 2t+8..).
  if ((c.int_mask >> U::j) & 1) {
#pragma unroll
    for (int sp = 0; sp < 2; ++sp) {
      af[U::buf][sp][0] = e4m3x4_even_to_f16x2_scaled(q[2 * sp]);
      af[U::buf][sp][1] = e4m3x4_even_to_f16x2_scaled(q[2 * sp + 1]);
      af[U::buf][sp][2] = e4m3x4_odd_to_f16x2_scaled(q[2 * sp]);
      af[U::buf][sp][3] = e4m3x4_odd_to_f16x2_scaled(q[2 * sp + 1]);
    }
  } else {
#pragma unroll
    for (int sp = 0; sp < 2; ++sp) {
      af[U::buf][sp][0] = e4m3x2_lo_to_f16x2(q[2 * sp]);
      af[U::buf][sp][1] = e4m3x2_lo_to_f16x2(q[2 * sp + 1]);
      af[U::buf][sp][2] = e4m3x2_hi_to_f16x2(q[2 * sp]);
      af[U::buf][sp][3] = e4m3x2_hi_to_f16x2(q[2 * sp + 1]);
    }
  }
  if (U::first_of_stage && stage_real) mbar_wait(r.xready, r.xready_parity);
  const uint64_t desc0 = make_desc_sw128(r.xf_slot + static_cast<uint32_t>((U::j >> 1) * NP * kStageK + (U::j & 1) * 64));
  wgmma_fence();  // A fragments written and the block-sum set last read by ordinary instructions
  wgmma::WgmmaF16<NP>::mma(d[U::buf], af[U::buf][0], desc0, 0);      // block sum from zero
  wgmma::WgmmaF16<NP>::mma(d[U::buf], af[U::buf][1], desc0 + 2, 1);  // + 32 bytes: the second 16 logical k
  wgmma_commit();
  // Every weight byte of the stage is in registers (the widenings consumed the ldmatrix results and
  // the wgmmas consumed the widenings): the slot may be refilled.
  if (U::last_of_stage && stage_real) mbar_arrive(r.empty);
}

// Step of unit K (D = kDepth): issue unit K + D - 1 (its bytes are in q) into its register set
// (the set of unit K - 1, folded in the step before), load the scale products of K, wait for unit K
// (wait_group D - 1: at most the groups issued after K stay in flight; the last units of the
// iteration drain down to wait_group 0, because ptxas serializes wgmmas that stay in flight across a
// loop back-edge when their block sums are read in the loop), load the bytes of unit K + D into q,
// then fold K's block sums into its tile's accumulators, acc = fma(blocksum, ss, acc), if K is a
// real unit.
template <int MT, int NP, int K>
__device__ __forceinline__ void consume_unit(const ConsumerCtx& c, const StageRef (&sr)[2], uint32_t (&q)[4],
                                             uint32_t (&af)[kDepth<MT, NP>][2][4], float (&d)[kDepth<MT, NP>][NP / 2],
                                             float (&acc)[MT][NP / 2]) {
  using U = Unit<MT, NP, K>;
  constexpr int BN = kConsumerWarpgroups * 64 * MT;
  if constexpr (K + kDepth<MT, NP> - 1 < 8) widen_issue<MT, NP, K + kDepth<MT, NP> - 1>(c, sr, q, af, d);
  const StageRef& r = sr[U::stage];
  const bool real = U::j < r.nb;  // uniform across the warpgroup
  // ss[j][row group][token]: this thread's row group (tile mt) and token pair 2t, 2t + 1 (ready
  // since the stage's first unit waited for xready; independent of the wgmma). A dummy unit loads
  // stale values of its (valid) slot and does not use them.
  const float* ssp = r.ss + (U::j * (BN / 32) + 2 * U::mt) * NP;
  float2 sv[NP / 8];
#pragma unroll
  for (int jj = 0; jj < NP / 8; ++jj) sv[jj] = *reinterpret_cast<const float2*>(ssp + 8 * jj);
  wgmma_wait<(kDepth<MT, NP> - 1 < 7 - K ? kDepth<MT, NP> - 1 : 7 - K)>();  // unit K done (units K + 1 .. stay in flight)
  if constexpr (K + kDepth<MT, NP> < 8) load_unit<MT, NP, K + kDepth<MT, NP>>(c, sr, q);
  fence_registers(d[U::buf]);
  if (!real) return;  // a dummy unit
#pragma unroll
  for (int jj = 0; jj < NP / 8; ++jj) {
    acc[U::mt][4 * jj + 0] = __fmaf_rn(d[U::buf][4 * jj + 0], sv[jj].x, acc[U::mt][4 * jj + 0]);
    acc[U::mt][4 * jj + 1] = __fmaf_rn(d[U::buf][4 * jj + 1], sv[jj].y, acc[U::mt][4 * jj + 1]);
    acc[U::mt][4 * jj + 2] = __fmaf_rn(d[U::buf][4 * jj + 2], sv[jj].x, acc[U::mt][4 * jj + 2]);
    acc[U::mt][4 * jj + 3] = __fmaf_rn(d[U::buf][4 * jj + 3], sv[jj].y, acc[U::mt][4 * jj + 3]);
  }
  // The stage's f16 activations and scale products are no longer read once its last real unit is
  // folded (its wgmmas are complete; the dummies after it only read the CTA's last stage).
  if (U::mt == MT - 1 && U::j == r.nb - 1) mbar_arrive(r.xfree);
}

// kFused: the fused act quant (p.a_bf16) is its own instantiation, so the plain kernel compiles
// exactly as it did before the fused path existed (with a run-time flag the plain kernel was
// measured ~6 us per layer slower in the stack; docs/perf.md run 19).
template <int MT, int NP, bool kFused>
__global__ void __launch_bounds__(kThreads, 1) gemm_fp8_wgmma3_kernel(const __grid_constant__ Wgmma3Params p) {
  constexpr int BN = kConsumerWarpgroups * 64 * MT;  // weight rows per CTA
  constexpr int RG = BN / 32;                        // 32-row scale groups per CTA
  constexpr int R = NP / 2;                          // accumulator registers per m64 tile per thread
  constexpr uint32_t kStageTx = static_cast<uint32_t>((BN + NP) * kStageK);
  constexpr uint32_t kStageTxWeights = static_cast<uint32_t>(BN * kStageK);  // fused act quant: no x box
  static_assert(NP % 8 == 0 && NP >= 8 && NP <= 64, "NP is m rounded up to 8");

  extern __shared__ uint8_t smem_raw[];
  const uint32_t raw_addr = smem_u32(smem_raw);
  const uint32_t base = (raw_addr + (kSmemAlign - 1)) & ~static_cast<uint32_t>(kSmemAlign - 1);
  uint8_t* smem = smem_raw + (base - raw_addr);
  const int ST = p.stages;
  const int msb = p.max_split_blocks;
  const SmemLayout L = smem_layout(BN, NP, ST, msb);
  float* sw_s = reinterpret_cast<float*>(smem + L.sw);  // [RG][msb]
  float* sa_s = reinterpret_cast<float*>(smem + L.sa);  // [msb][NP]
  float* ss_s = reinterpret_cast<float*>(smem + L.ss);  // [2][4][RG][NP]
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
  // From 32 rows, when the whole K range fits the ring (prologue == n_iter: every weight stage goes
  // out before the PDL wait, the activation boxes right after it) the producer has no refill to
  // issue, and warp 0 converts too: 128 converter threads instead of 96 (uniform per CTA; the
  // xready barriers are initialised for the count). bench_gemm wq_a|wkv m 32 / 64 -3 / -7 %, decode
  // bs 32 -0.3..-0.4 %; m 24 even and m 8 +1.7 %, so the smaller NP keep 96 (docs/perf.md session 34).
  // (Two units per converter round, both loads first, was slower at every m: +1.2..+1.5 % per
  // cycle; not traced -- the converters run at kProducerRegs registers, a possible reason.)
  const bool producer_idle = NP >= 32 && prologue >= n_iter;
  const int n_conv = producer_idle ? kWarpgroupThreads : kConverterThreads;
  constexpr bool fused = kFused;  // the CTA quantises x itself (no x TMA, no a_scale)
  const uint32_t stage_tx = fused ? kStageTxWeights : kStageTx;

  // ---- setup: barriers, first ring fill of weights (constant data: before the PDL wait) --------
  if (tid == 0) {
    for (int s = 0; s < ST; ++s) {
      mbar_init(bar_full + 8u * s, 1);  // the producer's arrive.expect_tx (+ the TMA bytes)
      mbar_init(bar_empty + 8u * s, kConsumerThreads);
    }
    for (int x = 0; x < kXfSlots; ++x) {
      mbar_init(bar_xready + 8u * x, static_cast<uint32_t>(n_conv));
      mbar_init(bar_xfree + 8u * x, kConsumerThreads);
    }
    fence_mbarrier_init();
    prefetch_tensormap(&p.tmap_w);
    if (!fused) prefetch_tensormap(&p.tmap_x);  // fused: tmap_x is not a valid map
  }
  __syncthreads();
  [[maybe_unused]] unsigned int stamp_rec = 0u;  // measurement builds only (phase_stamps.cuh)
  if (tid == 0) V4ATTN_STAMP_BEGIN(stamp_rec, stamps::kGemmV3, 0);
  // Weight scales of the tile's K range, loaded and stored before the PDL wait. (v2 stores its first
  // element after the wait, beside the activation scales; here that measured slower at 24 rows --
  // verify bs 4 +0.4 to +0.8 % over five repetitions, docs/perf.md session 13 -- and is not used.)
  {
    wgmma_fp8::WeightScalePrefetch<kThreads> sw_pre;
    sw_pre.prefetch(p.w_scale + grp * p.w_scale_group_stride + static_cast<int64_t>(row0 / 32) * p.k_blocks + kb_begin,
                    p.k_blocks, row0, p.n, RG, nkb, msb, sw_s, tid);
    // The first ring fill only now, behind the weight-scale loads (issued after it, they queued
    // behind every CTA's fill; session 35).
    if (tid == 0) {
      for (int it = 0; it < prologue; ++it) {
        mbar_arrive_expect_tx(bar_full + 8u * it, stage_tx);
        tma_load_weights_3d(base + L.w + static_cast<uint32_t>(it * BN * kStageK), &p.tmap_w, bar_full + 8u * it,
                            (kb_begin + it * kBlocksPerStage) * kGemmBlock, row0, grp);
      }
    }
    sw_pre.store(msb, sw_s);
  }

  // This thread's walk over the activation-scale items, divided out before the wait (act_scale_walk).
  [[maybe_unused]] wgmma_fp8::ActScaleWalk sa_walk{};
  if constexpr (!fused) sa_walk = wgmma_fp8::act_scale_walk<kThreads>(nkb, tid);

  dev::pdl_wait();  // activation codes and scales (fused: the bf16 activations) are the predecessor's output
  if (tid == 0) V4ATTN_STAMP_AT(stamp_rec, stamps::kGemmV3, 1);

  if constexpr (fused) {
    // Fused act quant of the CTA's K range [kb_begin, kb_end) of the NP rows, exactly what
    // run_act_quant_fp8 + the TMA / scale loads below would leave in shared memory: per 32-block the
    // amax from 0 (block_amax_step, order-free max), act_quant_scale_exp, pow2_f32, act_quant_code
    // (detail::act_quant_chunk<4>, the same functions in the same order as act_quant_fp8_kernel).
    // One thread per 8-element chunk e = ((tok * nkb) + b) * 4 + c: the 4 chunks of a block are 4
    // consecutive lanes (amax by xor shuffles among them), a warp reads 512 contiguous bytes of a
    // row. Codes of block b go to ring slot b / 4 (every slot distinct: stages >= n_iter, so no slot
    // is ever refilled), 16-byte chunk 2 (b % 4) + c / 2 of the row, 128B-swizzled like the TMA box
    // (chunk q of row r at q ^ (r % 8)). Rows >= m: codes 0 and scale 0 (the TMA's zero fill and the
    // scale load's 0). NP * nkb * 4 is a multiple of 32 and the stride 384 too, so every warp runs
    // the shuffles with all its lanes. Loads are batched ahead of the math (one latency per batch).
    constexpr int kBatch = 4;
    const int total = NP * nkb * 4;
    const bf16_t* xg = p.a_bf16 + static_cast<int64_t>(kb_begin) * kGemmBlock;
    for (int e0 = tid; e0 < total; e0 += kBatch * kThreads) {
      uint4 v[kBatch];
#pragma unroll
      for (int r = 0; r < kBatch; ++r) {
        const int e = e0 + r * kThreads, blk = e >> 2, tok = blk / nkb, b = blk - tok * nkb, c = e & 3;
        v[r] = make_uint4(0u, 0u, 0u, 0u);
        if (e < total && tok < p.m)
          v[r] = *reinterpret_cast<const uint4*>(xg + tok * p.a_bf16_stride + b * kGemmBlock + c * detail::kChunk);
      }
#pragma unroll
      for (int r = 0; r < kBatch; ++r) {
        const int e = e0 + r * kThreads, blk = e >> 2, tok = blk / nkb, b = blk - tok * nkb, c = e & 3;
        if (e >= total) break;  // uniform per warp
        float xv[detail::kChunk];
        detail::unpack_bf16x8(v[r], xv);
        int scale_exp = 0;
        uint2 codes = detail::act_quant_chunk<4>(xv, scale_exp);
        const bool row_real = tok < p.m;
        if (!row_real) codes = make_uint2(0u, 0u);
        const int it = b >> 2, q = 2 * (b & 3) + (c >> 1);
        uint8_t* dst = smem + L.xc + it * NP * kStageK + tok * kStageK + ((q ^ (tok & 7)) << 4) + (c & 1) * 8;
        *reinterpret_cast<uint2*>(dst) = codes;
        if (c == 0) sa_s[b * NP + tok] = row_real ? num::f32_from_scale_exp(scale_exp) : 0.0f;
      }
    }
  }
  if (!fused && tid == 0) {  // (constant-folded per instantiation)
    for (int it = 0; it < prologue; ++it)
      tma_load_3d(base + L.xc + static_cast<uint32_t>(it * NP * kStageK), &p.tmap_x, bar_full + 8u * it,
                  (kb_begin + it * kBlocksPerStage) * kGemmBlock, 0, grp);
  }
  if (!fused)  // activation scales [block][token]; tokens >= m get 0 (so their scale products are 0)
    wgmma_fp8::load_activation_scales<NP>(p.a_scale + grp * p.a_scale_group_stride + kb_begin, p.a_scale_stride,
                                          p.m, nkb, sa_s, sa_walk);
  __syncthreads();  // scale arrays (fused: and the activation codes) visible to the converters
  if (tid == 0) V4ATTN_STAMP_AT(stamp_rec, stamps::kGemmV3, 5);

  if (warp < 4) {
    // ======== warpgroup 0: producer (warp 0, lane 0) and converters (warps 1..3; 0..3 if producer_idle)
    setmaxnreg_dec<kProducerRegs>();
    if (warp == 0 && !producer_idle) {
      if (lane == 0) {
        RingPos rp;  // stage it - ST (the loop runs only when prologue == ST)
        for (int it = prologue; it < n_iter; ++it, rp.advance(ST)) {
          const int s = rp.slot;
          mbar_wait(bar_empty + 8u * s, rp.parity);  // slot consumed (it - ST)
          const int kx = (kb_begin + it * kBlocksPerStage) * kGemmBlock;
          mbar_arrive_expect_tx(bar_full + 8u * s, stage_tx);
          tma_load_weights_3d(base + L.w + static_cast<uint32_t>(s * BN * kStageK), &p.tmap_w, bar_full + 8u * s, kx, row0,
                              grp);
          // Never reached when fused (stages >= n_iter: no refill), kept exact anyway.
          if (!fused)
            tma_load_3d(base + L.xc + static_cast<uint32_t>(s * NP * kStageK), &p.tmap_x, bar_full + 8u * s, kx, 0, grp);
        }
      }
    } else {
      const int ctid = producer_idle ? tid : tid - 32;  // 0 .. n_conv - 1
      if (ctid == 0 && blockIdx.x < 2) V4ATTN_STAMP_BEGIN(stamp_rec, stamps::kGemmV3, 63);
      RingPos rp;  // stage it
      for (int it = 0; it < n_iter; ++it, rp.advance(ST)) {
        const int s = rp.slot, x = it % kXfSlots;
        mbar_wait(bar_full + 8u * s, rp.parity);
        // Measurement builds: 96 + it = the stage's data landed, 112 + it = its f16 slot is free.
        if (ctid == 0 && blockIdx.x < 2 && it < 16) V4ATTN_STAMP_AT(stamp_rec, stamps::kGemmV3, 96 + it);
        if (it >= kXfSlots) mbar_wait(bar_xfree + 8u * x, static_cast<uint32_t>((it / kXfSlots - 1) & 1));
        if (ctid == 0 && blockIdx.x < 2 && it < 16) V4ATTN_STAMP_AT(stamp_rec, stamps::kGemmV3, 112 + it);
        const int nb = min(kBlocksPerStage, nkb - it * kBlocksPerStage);
        const uint8_t* xc = smem + L.xc + s * NP * kStageK;
        uint8_t* xf = smem + L.xf + x * NP * kStageK * 2;
        // Unit u: token n, 16-byte code chunk q = 2 j + sp (block j of the stage, half sp) -> the
        // 16 f16 of wgmma sp of block j, at the logical k the weights' widening of block j uses:
        // cvt blocks: byte pairs (4t, 4t+1) -> k 2t, 2t+1 and (4t+2, 4t+3) -> k 2t+8, 2t+9;
        // integer blocks: (4t, 4t+2) -> k 2t, 2t+1 and (4t+1, 4t+3) -> k 2t+8, 2t+9.
        for (int u = ctid; u < NP * 2 * nb; u += n_conv) {
          const int n = u % NP, q = u / NP;
          const int j = q >> 1, sp = q & 1;
          const uint4 v = *reinterpret_cast<const uint4*>(xc + n * kStageK + ((q ^ (n & 7)) << 4));
          uint4 lo, hi;
          if ((p.int_mask >> j) & 1) {
            lo = make_uint4(f16x2_times_256(e4m3x4_even_to_f16x2_scaled(v.x)), f16x2_times_256(e4m3x4_even_to_f16x2_scaled(v.y)),
                            f16x2_times_256(e4m3x4_even_to_f16x2_scaled(v.z)), f16x2_times_256(e4m3x4_even_to_f16x2_scaled(v.w)));
            hi = make_uint4(f16x2_times_256(e4m3x4_odd_to_f16x2_scaled(v.x)), f16x2_times_256(e4m3x4_odd_to_f16x2_scaled(v.y)),
                            f16x2_times_256(e4m3x4_odd_to_f16x2_scaled(v.z)), f16x2_times_256(e4m3x4_odd_to_f16x2_scaled(v.w)));
          } else {
            lo = make_uint4(e4m3x2_lo_to_f16x2(v.x), e4m3x2_lo_to_f16x2(v.y), e4m3x2_lo_to_f16x2(v.z), e4m3x2_lo_to_f16x2(v.w));
            hi = make_uint4(e4m3x2_hi_to_f16x2(v.x), e4m3x2_hi_to_f16x2(v.y), e4m3x2_hi_to_f16x2(v.z), e4m3x2_hi_to_f16x2(v.w));
          }
          const int cb = (j & 1) * 4 + sp * 2;  // 16-byte chunk of the f16 row (64 f16 = 2 blocks)
          uint8_t* row = xf + (j >> 1) * NP * kStageK + n * kStageK;
          *reinterpret_cast<uint4*>(row + ((cb ^ (n & 7)) << 4)) = lo;
          *reinterpret_cast<uint4*>(row + (((cb + 1) ^ (n & 7)) << 4)) = hi;
        }
        // Scale products of the stage: ss[x][j][rg][token] = sa[b][token] * sw[rg][b] (* 2^8 for an
        // integer-widened block). Powers of two: exact.
        float* ssx = ss_s + x * kBlocksPerStage * RG * NP;
        for (int e = ctid; e < nb * RG * (NP / 4); e += n_conv) {
          const int tq = e % (NP / 4), r = e / (NP / 4), rg = r % RG, j = r / RG;
          const int b = it * kBlocksPerStage + j;
          float swv = sw_s[rg * msb + b];
          if ((p.int_mask >> j) & 1) swv = num::mul_rn(swv, kIntWidenScale);
          const float4 sa4 = *reinterpret_cast<const float4*>(sa_s + b * NP + 4 * tq);
          *reinterpret_cast<float4*>(ssx + (j * RG + rg) * NP + 4 * tq) =
              make_float4(num::mul_rn(sa4.x, swv), num::mul_rn(sa4.y, swv), num::mul_rn(sa4.z, swv), num::mul_rn(sa4.w, swv));
        }
        fence_proxy_async_smem();  // the f16 operand is read by wgmma (async proxy)
        mbar_arrive(bar_xready + 8u * x);
        if (ctid == 0 && blockIdx.x < 2) V4ATTN_STAMP_AT(stamp_rec, stamps::kGemmV3, 64 + it);
      }
    }
    dev::pdl_launch_dependents();
    if (p.splits > 1) {  // the consumers' two cluster barriers (every thread of the cluster takes part)
      cluster_sync();
      cluster_sync_relaxed();
    }
    return;
  }

  // ======== warpgroups 1, 2: consumers =============================================================
  setmaxnreg_inc<kConsumerRegs>();
  const int ctid = tid - kWarpgroupThreads;  // 0..255
  const int wgc = ctid >> 7;                 // consumer warpgroup 0 / 1
  const int w = (ctid >> 5) & 3;             // warp within the warpgroup: rows 16w .. 16w + 15 of a tile
  const int g = lane >> 2, t = lane & 3;
  // ldmatrix.x4: lane supplies row (lane & 7) + 8 * ((lane >> 3) & 1) of its matrix, chunk + (lane >> 4):
  // matrices 0..3 = (rows 0-7, chunk 2j), (rows 8-15, 2j), (rows 0-7, 2j+1), (rows 8-15, 2j+1).
  const int ld_row = 16 * w + (lane & 7) + 8 * ((lane >> 3) & 1);

  ConsumerCtx c;
  c.w_base = base + L.w + static_cast<uint32_t>((wgc * MT * 64 + ld_row) * kStageK);
  c.xf_base = base + L.xf;
  c.bar_full = bar_full;
  c.bar_empty = bar_empty;
  c.bar_xready = bar_xready;
  c.bar_xfree = bar_xfree;
  c.ss_base = ss_s + (wgc * MT * 2 + (w >> 1)) * NP + 2 * t;  // row group of tile 0 of this warpgroup
  c.stages = ST;
  c.nkb = nkb;
  c.n_iter = n_iter;
  c.int_mask = p.int_mask;
  c.ld_chunk = lane >> 4;
  c.ld_swz = lane & 7;  // = ld_row & 7

  if (ctid == 0) V4ATTN_STAMP_BEGIN(stamp_rec, stamps::kGemmV3, 15);
  float acc[MT][R];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int i = 0; i < R; ++i) acc[mt][i] = 0.0f;
  // Every block-sum set is defined (and pinned by the register fences) before the first wgmma:
  // a plain definition that the compiler sinks between a wgmma and its wait makes ptxas serialize
  // every wgmma of the kernel (warning C7515).
  float d[kDepth<MT, NP>][R];
  if constexpr (kDepth<MT, NP> == 2) {  // (the two forms: each compiles as it was measured, docs/perf.md session 35)
#pragma unroll
    for (int i = 0; i < R; ++i) d[0][i] = d[1][i] = 0.0f;
    fence_registers(d[0]);
    fence_registers(d[1]);
  } else {
#pragma unroll
    for (int b = 0; b < kDepth<MT, NP>; ++b)
#pragma unroll
      for (int i = 0; i < R; ++i) d[b][i] = 0.0f;
#pragma unroll
    for (int b = 0; b < kDepth<MT, NP>; ++b) fence_registers(d[b]);
  }
  uint32_t af[kDepth<MT, NP>][2][4];
  uint32_t q[4];  // weight bytes of the next unit to widen (ldmatrix one unit ahead)

  RingPos rp_next;  // stage it0 (hopper::RingPos: no division by the run-time ring depth per stage)
  for (int it0 = 0; it0 < n_iter; it0 += kStagesPerIter<MT>) {
    if (ctid == 0 && blockIdx.x < 2) V4ATTN_STAMP_AT(stamp_rec, stamps::kGemmV3, 16 + it0);
    const RingPos rp0 = rp_next;
    RingPos rp1 = rp0;
    rp1.advance(ST);
    StageRef sr[2];
    sr[0] = stage_ref<MT, NP>(c, it0, rp0);
    sr[1] = MT == 1 ? stage_ref<MT, NP>(c, it0 + 1, it0 + 1 < n_iter ? rp1 : rp0) : sr[0];
    rp_next = rp1;
    if constexpr (MT == 1) rp_next.advance(ST);
    load_unit<MT, NP, 0>(c, sr, q);
    widen_issue<MT, NP, 0>(c, sr, q, af, d);
    load_unit<MT, NP, 1>(c, sr, q);
    if constexpr (kDepth<MT, NP> == 3) {
      widen_issue<MT, NP, 1>(c, sr, q, af, d);
      load_unit<MT, NP, 2>(c, sr, q);
    }
    consume_unit<MT, NP, 0>(c, sr, q, af, d, acc);
    consume_unit<MT, NP, 1>(c, sr, q, af, d, acc);
    consume_unit<MT, NP, 2>(c, sr, q, af, d, acc);
    consume_unit<MT, NP, 3>(c, sr, q, af, d, acc);
    consume_unit<MT, NP, 4>(c, sr, q, af, d, acc);
    consume_unit<MT, NP, 5>(c, sr, q, af, d, acc);
    consume_unit<MT, NP, 6>(c, sr, q, af, d, acc);
    consume_unit<MT, NP, 7>(c, sr, q, af, d, acc);
  }
  if (ctid == 0) V4ATTN_STAMP_AT(stamp_rec, stamps::kGemmV3, 3);
  dev::pdl_launch_dependents();

  // ---- epilogue (consumers; the cluster barriers with warpgroup 0) ------------------------------
  // Element (mt, i) of this thread: CTA row nl = (wgc*MT + mt)*64 + 16w + g + (i & 2 ? 8 : 0),
  // token = 8 (i / 4) + 2t + (i & 1).
  named_barrier_sync(kConsumerBarrierId, kConsumerThreads);  // every consumer is done with the rings
  bf16_t* out = p.out + grp * p.out_group_stride;
  if (p.splits == 1) {
    wgmma_fp8::store_tile_bf16_staged<MT, NP, kConsumerThreads>(
        [&](int mt, int i) { return num::bf16_from_f32(acc[mt][i]); }, [](int) { return true; }, smem + L.epi, out,
        p.out_stride, p.m, p.n, row0, wgc, w, g, t, ctid, p.out_vec, kConsumerBarrierId);
    return;
  }

  // S > 1: this CTA's fp32 partial tile into its own shared memory, then the cluster reduces.
  constexpr int kStride = BN + 4;  // floats per partial row (conflict-free, 16-byte rows)
  constexpr int kPieces = BN / 4;  // float4 pieces per token
  // The CTA's share of the reduction, [lo, hi) of the m * kPieces pieces: divided here, before the
  // cluster barrier (pinned: dev::pin_here), in 32 bits (m * kPieces * splits < 2^31), so that the
  // division is not a dependent chain after the barrier (as 64-bit divisions it was a call to the
  // division routine there, on the GEMM's critical path; session 32).
  int red_lo = split * (p.m * kPieces) / p.splits, red_hi = (split + 1) * (p.m * kPieces) / p.splits;
  dev::pin_here(red_lo);
  dev::pin_here(red_hi);
  float* part = reinterpret_cast<float*>(smem + L.epi);
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int i = 0; i < R; ++i) {
      const int nl = (wgc * MT + mt) * 64 + 16 * w + g + ((i & 2) ? 8 : 0);
      const int tok = 8 * (i >> 2) + 2 * t + (i & 1);
      if (tok < p.m) part[tok * kStride + nl] = acc[mt][i];
    }
  cluster_sync();  // every CTA's partial tile is written (release / acquire, cluster scope)
  if (ctid == 0) V4ATTN_STAMP_AT(stamp_rec, stamps::kGemmV3, 6);
  {
    const int S = p.splits;
    const uint32_t part_addr = base + L.epi;
    for (int e = red_lo + ctid; e < red_hi; e += kConsumerThreads) {
      const int tok = e / kPieces, pc = e - tok * kPieces;
      const int n = row0 + 4 * pc;
      if (n >= p.n) continue;
      const uint32_t off = part_addr + static_cast<uint32_t>((tok * kStride + 4 * pc) * 4);
      float4 v[kMaxClusterSplits];
#pragma unroll
      for (int sp = 0; sp < kMaxClusterSplits; ++sp)
        if (sp < S) v[sp] = ld_cluster_f32x4(map_to_cluster_rank(off, static_cast<uint32_t>(sp)));
      float4 sum = v[0];
#pragma unroll
      for (int sp = 1; sp < kMaxClusterSplits; ++sp)
        if (sp < S) {  // split order: ((P0 + P1) + P2) + ...
          sum.x = num::add_rn(sum.x, v[sp].x);
          sum.y = num::add_rn(sum.y, v[sp].y);
          sum.z = num::add_rn(sum.z, v[sp].z);
          sum.w = num::add_rn(sum.w, v[sp].w);
        }
      const bf16_t b0 = num::bf16_from_f32(sum.x), b1 = num::bf16_from_f32(sum.y), b2 = num::bf16_from_f32(sum.z),
                   b3 = num::bf16_from_f32(sum.w);
      bf16_t* dst = out + tok * p.out_stride + n;
      if (p.out_vec >= 1) {
        *reinterpret_cast<uint2*>(dst) = make_uint2(static_cast<uint32_t>(b0) | (static_cast<uint32_t>(b1) << 16),
                                                    static_cast<uint32_t>(b2) | (static_cast<uint32_t>(b3) << 16));
      } else {
        dst[0] = b0;
        dst[1] = b1;
        dst[2] = b2;
        dst[3] = b3;
      }
    }
  }
  if (ctid == 0) V4ATTN_STAMP_AT(stamp_rec, stamps::kGemmV3, 4);
  cluster_sync_relaxed();  // no CTA leaves (freeing its shared memory) before every read of it is done
}

using Wgmma3Kernel = void (*)(Wgmma3Params);

template <int MT, bool F>
Wgmma3Kernel pick_kernel(int np) {
  switch (np) {
    case 8: return gemm_fp8_wgmma3_kernel<MT, 8, F>;
    case 16: return gemm_fp8_wgmma3_kernel<MT, 16, F>;
    case 24: return gemm_fp8_wgmma3_kernel<MT, 24, F>;
    case 32: return gemm_fp8_wgmma3_kernel<MT, 32, F>;
    case 40: return gemm_fp8_wgmma3_kernel<MT, 40, F>;
    case 48: return gemm_fp8_wgmma3_kernel<MT, 48, F>;
    case 56: return gemm_fp8_wgmma3_kernel<MT, 56, F>;
    case 64: return gemm_fp8_wgmma3_kernel<MT, 64, F>;
    default: throw std::invalid_argument("gemm v3: m must be 1..64");
  }
}

// The TMA descriptors: shared host helper (gemm/tensor_map.h).
CUtensorMap make_tensor_map(const void* ptr, uint64_t cols, uint64_t rows, uint64_t groups, uint64_t row_stride,
                            uint64_t group_stride, uint32_t box_rows) {
  return detail::make_byte_tensor_map_sw128("gemm v3", ptr, cols, rows, groups, row_stride, group_stride, kStageK, box_rows);
}

}  // namespace

GemmPlan plan_gemm_wgmma_pipelined(int m, int64_t n, int64_t k, int groups, int force_splits, int force_mtiles,
                                   int force_stages) {
  // v2's tiling and split choice, S capped at the portable cluster size (the S CTAs of a tile form
  // one cluster). Two m64 tiles per warpgroup at most (v2's four-tile form is v2's own).
  if (force_mtiles == 4) throw std::invalid_argument("plan_gemm_wgmma_pipelined: force_mtiles 4 is v2's only");
  detail::WgmmaSplit sp = detail::plan_wgmma_split("plan_gemm_wgmma_pipelined", m, n, k, groups, force_splits,
                                                   force_mtiles, force_stages, kMaxClusterSplits);
  // One wave of clusters: with one CTA per SM, a cluster needs S free SMs of one GPC, so well below
  // 132 CTAs the clusters stop fitting at once and the kernel runs in two waves (measured, session 3
  // run 19: the indexer's wq_b 4096 x 1280 as 32 clusters of 4 took 10.6 us at m = 1, as 16 clusters
  // of 6 with two m64 tiles per warpgroup 6.2 us; wq_a|wkv's 14 clusters of 8 fit). Automatic plans
  // over kOneWaveCtas CTAs take two tiles per warpgroup and S = kClusterCtas / tiles instead (still
  // a function of (n, k, groups) only).
  if (force_splits == 0 && force_mtiles == 0 && sp.splits > 1 &&
      static_cast<int64_t>(groups) * sp.tiles_n * sp.splits > kOneWaveCtas) {
    const detail::WgmmaSplit wide =
        detail::plan_wgmma_split("plan_gemm_wgmma_pipelined", m, n, k, groups, 1, 2, force_stages, kMaxClusterSplits);
    const int64_t tiles = static_cast<int64_t>(groups) * wide.tiles_n;
    const int64_t s2 = std::clamp<int64_t>(kClusterCtas / std::max<int64_t>(tiles, 1), 1, kMaxClusterSplits);
    if (s2 * tiles <= kOneWaveCtas) {
      sp = detail::plan_wgmma_split("plan_gemm_wgmma_pipelined", m, n, k, groups, static_cast<int>(s2), 2, force_stages,
                                    kMaxClusterSplits);
    }
  }
  const int64_t kb = k / kGemmBlock, s = sp.splits;
  GemmPlan plan = sp.plan_base();
  plan.cluster = plan.splits;
  const int msb = static_cast<int>((kb + s - 1) / s);
  const int np = std::max(8, (m + 7) / 8 * 8);
  const int n_iter = (msb + kBlocksPerStage - 1) / kBlocksPerStage;
  // Pipeline depth for this m (numerics do not depend on it): as many stages as fit, <= 8, <= the
  // stages a CTA has. (Counted directly: the epilogue region overlaps the rings.)
  int fit = 0;
  for (int st = 1; st <= kMaxStages; ++st)
    if (smem_request(smem_layout(plan.block_n, np, st, msb)) <= static_cast<size_t>(kSmemLimit)) fit = st;
  plan.stages = std::min({fit, kMaxStages, n_iter});
  if (force_stages != 0) plan.stages = std::min(plan.stages, force_stages);
  plan.smem_bytes = plan.stages >= 1 ? smem_request(smem_layout(plan.block_n, np, plan.stages, msb)) : 0;
  plan.workspace_bytes = 0;  // the split-K reduction runs through the cluster's shared memory
  return plan;
}

bool gemm_v3_fused_quant_supported(int m, int64_t n, int64_t k) {
  if (m < 1 || m > kGemmMaxRows || n <= 0 || k <= 0 || n % kGemmBlock != 0 || k % kGemmBlock != 0) return false;
  if (n > (int64_t{1} << 30) || k > (int64_t{1} << 30)) return false;
  const GemmPlan plan = plan_gemm_wgmma_pipelined(m, n, k, 1);
  return plan.stages >= 1 && plan.stages >= detail::v3_max_cta_stages(plan, k);
}

namespace detail {

int v3_max_cta_stages(const GemmPlan& plan, int64_t k) {
  const int64_t kb = k / kGemmBlock;
  const int64_t msb = (kb + plan.splits - 1) / plan.splits;
  return static_cast<int>((msb + kBlocksPerStage - 1) / kBlocksPerStage);
}

void launch_gemm_fp8_wgmma_pipelined(const Fp8GemmParams& p, const GemmPlan& plan, cudaStream_t stream, bool pdl) {
  const int np = (p.m + 7) / 8 * 8;
  const int64_t kb = p.k / kGemmBlock;
  Wgmma3Params t;
  // Weights: [groups][n][k]; a single group gets a nominal group stride (the dimension has size 1).
  const uint64_t w_group = p.groups > 1 ? static_cast<uint64_t>(p.w_group_stride) : static_cast<uint64_t>(p.n * p.k);
  t.tmap_w = make_tensor_map(p.w, static_cast<uint64_t>(p.k), static_cast<uint64_t>(p.n), static_cast<uint64_t>(p.groups),
                             static_cast<uint64_t>(p.k), w_group, static_cast<uint32_t>(plan.block_n));
  if (p.a_bf16 != nullptr) {  // fused act quant: no x map
    // The kernel writes stage it's codes into slot it: every CTA's stages must be distinct slots.
    if (plan.stages < v3_max_cta_stages(plan, p.k))
      throw std::invalid_argument("gemm v3: a_bf16 (fused act quant) needs the whole K range of a CTA in its ring");
    std::memset(&t.tmap_x, 0, sizeof(t.tmap_x));
    t.a_bf16 = p.a_bf16;
    t.a_bf16_stride = p.a_bf16_stride;
  } else {
    const uint64_t a_group = p.groups > 1 ? static_cast<uint64_t>(p.a_group_stride) : static_cast<uint64_t>(p.m) * p.a_stride;
    t.tmap_x = make_tensor_map(p.a_q, static_cast<uint64_t>(p.k), static_cast<uint64_t>(p.m), static_cast<uint64_t>(p.groups),
                               static_cast<uint64_t>(p.a_stride), a_group, static_cast<uint32_t>(np));
  }
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
  t.stages = plan.stages;
  t.max_split_blocks = static_cast<int>((kb + plan.splits - 1) / plan.splits);
  t.int_mask = p.v3_int_mask < 0 ? kDefaultIntMask : p.v3_int_mask;
  t.out_vec = bf16_out_vector_width(p);
  const bool fused = p.a_bf16 != nullptr;
  const Wgmma3Kernel kernel = plan.warp_mtiles == 2 ? (fused ? pick_kernel<2, true>(np) : pick_kernel<2, false>(np))
                                                    : (fused ? pick_kernel<1, true>(np) : pick_kernel<1, false>(np));
  set_max_dynamic_smem(kernel, plan.smem_bytes);
  LaunchConfig cfg;
  cfg.grid = dim3(static_cast<unsigned>(plan.tiles_n), static_cast<unsigned>(plan.splits), static_cast<unsigned>(p.groups));
  cfg.block = dim3(kThreads);
  cfg.cluster = dim3(1, static_cast<unsigned>(plan.splits), 1);
  cfg.smem_bytes = plan.smem_bytes;
  cfg.stream = stream;
  cfg.pdl = pdl;
  launch_kernel("gemm_fp8_wgmma_pipelined", kernel, cfg, t);
}

}  // namespace detail
}  // namespace v4attn::kernels
