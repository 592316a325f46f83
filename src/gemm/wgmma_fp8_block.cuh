// One K block of the fp8 wgmma GEMMs' consumer loop (v2 gemm_wgmma.cu, the fused Q chain
// gemm_qchain.cu): the weight bytes of MT m64 tiles ldmatrix'ed from a 128B-swizzled stage and
// widened to f16 A fragments, the two chained k16 wgmmas of the block sum (the first from zero),
// and the fold acc += blocksum * (sa * sw) after the wait. Numerics and the K permutation: the
// header of gemm_wgmma.cu.
#pragma once

#include <cstdint>

#include "gemm/hopper_ptx.cuh"
#include "gemm/ring_pos.h"
#include "gemm/wgmma_f16.cuh"
#include "kernels/device_common.cuh"
#include "v4attn/numerics.h"

namespace v4attn::kernels::wgmma_fp8 {

constexpr int kStageBytes = 128;  // K bytes per stage row (one 128B-swizzle row)
constexpr int kRopeHeadDim = 512;  // wq_b output columns are heads of 512 dims, RoPE on the last 64

template <int MT, int NP>
struct BlockOps {
  static constexpr int R = NP / 2;
  uint32_t w_slot, xf_slot;        // the stage's weight slot and f16 operand slot (shared addresses)
  int wgc, w, ld_row, ld_chunk, t;  // consumer warpgroup, its warp, ldmatrix row / chunk, lane % 4
  // per_tile(mt) runs right after tile mt's widening (the callers load the tile's weight scale
  // there).
  template <class PerTile>
  __device__ __forceinline__ void load(int j, uint32_t (&a)[MT][2][4], PerTile&& per_tile) const {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      const int row = (wgc * MT + mt) * 64 + ld_row;
      const int chunk = 2 * j + ld_chunk;
      uint32_t q[4];
      hopper::ldmatrix_x4(q, w_slot + static_cast<uint32_t>(row * kStageBytes + ((chunk ^ (row & 7)) << 4)));
      a[mt][0][0] = hopper::e4m3x2_lo_to_f16x2(q[0]);
      a[mt][0][1] = hopper::e4m3x2_lo_to_f16x2(q[1]);
      a[mt][0][2] = hopper::e4m3x2_hi_to_f16x2(q[0]);
      a[mt][0][3] = hopper::e4m3x2_hi_to_f16x2(q[1]);
      a[mt][1][0] = hopper::e4m3x2_lo_to_f16x2(q[2]);
      a[mt][1][1] = hopper::e4m3x2_lo_to_f16x2(q[3]);
      a[mt][1][2] = hopper::e4m3x2_hi_to_f16x2(q[2]);
      a[mt][1][3] = hopper::e4m3x2_hi_to_f16x2(q[3]);
      per_tile(mt);
    }
  }
  __device__ __forceinline__ void issue(int j, const uint32_t (&a)[MT][2][4], float (&d)[MT][R]) const {
    const uint64_t desc0 = hopper::make_desc_sw128(xf_slot + static_cast<uint32_t>((j >> 1) * NP * kStageBytes + (j & 1) * 64));
    const uint64_t desc1 = desc0 + 2;  // + 32 bytes: the second 16 logical k of the block
    hopper::wgmma_fence();  // A fragments and accumulators were written by ordinary instructions
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      wgmma::WgmmaF16<NP>::mma(d[mt], a[mt][0], desc0, 0);  // block sum from zero
      wgmma::WgmmaF16<NP>::mma(d[mt], a[mt][1], desc1, 1);
    }
    hopper::wgmma_commit();
  }
  // acc += blocksum * (sa * sw): sa * sw is a power of two (exact), one rounding per block.
  // sa_row: the block's activation scales [NP]; swv: the tile's weight scale per m64 tile. (The fused
  // Q chain's form; v2 calls the two halves below instead, products() before its wgmma wait. Kept
  // apart on purpose: written as the two halves, this one's SASS in the chain reorders.)
  __device__ __forceinline__ void fold(const float* sa_row, const float (&swv)[MT], float (&d)[MT][R],
                                       float (&acc)[MT][R]) const {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) hopper::fence_registers(d[mt]);
#pragma unroll
    for (int jj = 0; jj < NP / 8; ++jj) {
      const float2 sa = *reinterpret_cast<const float2*>(sa_row + 8 * jj + 2 * t);
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        const float s0 = num::mul_rn(sa.x, swv[mt]), s1 = num::mul_rn(sa.y, swv[mt]);
        acc[mt][4 * jj + 0] = __fmaf_rn(d[mt][4 * jj + 0], s0, acc[mt][4 * jj + 0]);
        acc[mt][4 * jj + 1] = __fmaf_rn(d[mt][4 * jj + 1], s1, acc[mt][4 * jj + 1]);
        acc[mt][4 * jj + 2] = __fmaf_rn(d[mt][4 * jj + 2], s0, acc[mt][4 * jj + 2]);
        acc[mt][4 * jj + 3] = __fmaf_rn(d[mt][4 * jj + 3], s1, acc[mt][4 * jj + 3]);
      }
    }
  }
  // fold() in two halves, so that a caller can form the block's scale products before it waits for
  // the block's wgmmas: products() takes the shared loads and multiplies (the same roundings),
  // fold_products() only the fmas. ss[mt][2 jj + e] = sa[8 jj + 2t + e] * sw[mt].
  static constexpr int S = NP / 4;  // products per tile this thread folds with
  __device__ __forceinline__ void products(const float* sa_row, const float (&swv)[MT], float (&ss)[MT][S]) const {
#pragma unroll
    for (int jj = 0; jj < NP / 8; ++jj) {
      const float2 sa = *reinterpret_cast<const float2*>(sa_row + 8 * jj + 2 * t);
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        ss[mt][2 * jj + 0] = num::mul_rn(sa.x, swv[mt]);
        ss[mt][2 * jj + 1] = num::mul_rn(sa.y, swv[mt]);
      }
    }
  }
  __device__ __forceinline__ void fold_products(const float (&ss)[MT][S], float (&d)[MT][R], float (&acc)[MT][R]) const {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) hopper::fence_registers(d[mt]);
#pragma unroll
    for (int jj = 0; jj < NP / 8; ++jj)
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        acc[mt][4 * jj + 0] = __fmaf_rn(d[mt][4 * jj + 0], ss[mt][2 * jj + 0], acc[mt][4 * jj + 0]);
        acc[mt][4 * jj + 1] = __fmaf_rn(d[mt][4 * jj + 1], ss[mt][2 * jj + 1], acc[mt][4 * jj + 1]);
        acc[mt][4 * jj + 2] = __fmaf_rn(d[mt][4 * jj + 2], ss[mt][2 * jj + 0], acc[mt][4 * jj + 2]);
        acc[mt][4 * jj + 3] = __fmaf_rn(d[mt][4 * jj + 3], ss[mt][2 * jj + 1], acc[mt][4 * jj + 3]);
      }
  }
};

// Two full stages (8 K blocks) as one straight-line sequence with two block-sum / A fragment sets:
// block b + 1's wgmmas are issued before block b is folded, across the stages' boundary too, and
// only the last block is drained -- every wgmma is waited for before the function returns (ptxas
// serialises every wgmma of a kernel when one stays in flight across a loop back-edge while block
// sums are read in the loop). The folds run in block order, so the bytes are those of one stage at
// a time. The caller has waited for stage 0's operands; wait_second() waits for stage 1's (called
// while block 3 of stage 0 runs); release_w(q) right after stage q's last weight load (ldmatrix is
// synchronous: the weight slot is no longer read, so the producer may refill it while this thread
// still waits for stage 1 -- released only after the fold, the refill would trail stage 1's arrival
// in a memory-paced loop), release_x(q) after stage q's last fold (the f16 operand, which the
// wgmmas read, is no longer read); sw(q, mt, j): tile mt's weight scale of block j of stage q;
// sa(q, j): that block's activation scales [NP]. v2's loop (v2_overlap 2): one drain per two stages
// instead of one per stage (docs/perf.md session 29; in the fused Q chain's wq_b loop, which streams
// at 1-16 rows, it measured slower).
template <int MT, int NP, class Sw, class Sa, class WaitSecond, class ReleaseW, class ReleaseX>
__device__ __forceinline__ void run_stage_pair(const BlockOps<MT, NP>& ops0, const BlockOps<MT, NP>& ops1, Sw&& sw,
                                               Sa&& sa, WaitSecond&& wait_second, ReleaseW&& release_w,
                                               ReleaseX&& release_x, float (&acc)[MT][NP / 2]) {
  constexpr int R = NP / 2, kBlocks = 4, B = 2 * kBlocks;
  uint32_t a[2][MT][2][4];
  float swv[2][MT];
  float d[2][MT][R];
  auto load_issue = [&](int b) {  // block b's sets were freed by block b - 2's wait / fold
    const int q = b / kBlocks, j = b % kBlocks;
    if (b == kBlocks) wait_second();
    const BlockOps<MT, NP>& ops = q == 0 ? ops0 : ops1;
    ops.load(j, a[b & 1], [&](int mt) { swv[b & 1][mt] = sw(q, mt, j); });
    if (j == kBlocks - 1) release_w(q);
    ops.issue(j, a[b & 1], d[b & 1]);
  };
  load_issue(0);
#pragma unroll
  for (int b = 0; b < B; ++b) {
    const int q = b / kBlocks, j = b % kBlocks;
    const BlockOps<MT, NP>& ops = q == 0 ? ops0 : ops1;
    if (b + 1 < B) load_issue(b + 1);
    // Block b's scale products before its wait: their shared loads and multiplies overlap the
    // wgmmas instead of sitting between the wait and the fold.
    float ss[MT][BlockOps<MT, NP>::S];
    ops.products(sa(q, j), swv[b & 1], ss);
    if (b + 1 < B) {
      hopper::wgmma_wait<1>();  // block b done, b + 1 may still run
    } else {
      hopper::wgmma_wait<0>();
    }
    ops.fold_products(ss, d[b & 1], acc);
    if (j == kBlocks - 1) release_x(q);
  }
}

// The one-split epilogue of the fp8 wgmma GEMMs (v2, v3): value(mt, i) -> bf16 of this thread's
// accumulator element (mt, i) = CTA row (wgc*MT + mt)*64 + 16w + g + (i & 2 ? 8 : 0), token 8 (i / 4)
// + 2t + (i & 1) (called by every lane for every element: it may shuffle), staged as a tile [m][BN
// + 8] in shared memory (conflict-free: a warp's 32 stores hit 16 words of distinct banks), then
// written out in 16-byte row pieces (out_vec == 2) or element by element, tokens with !row_ok(tok)
// skipped. A per-element global store from the fragment layout writes 2 bytes per lane, pieces
// scattered over 4 rows, in an unrolled straight-line block that misses the instruction cache once
// per launch (Nsight Compute, v2 at m = 64: a quarter of the kernel's samples). The caller has
// synchronised the consumers (the stage aliases the weight ring); `bar` is their named barrier.
template <int MT, int NP, int kThreads, class Value, class RowOk>
__device__ __forceinline__ void store_tile_bf16_staged(Value&& value, RowOk&& row_ok, uint8_t* stage_smem, bf16_t* out,
                                                       int64_t out_stride, int m, int n, int row0, int wgc, int w,
                                                       int g, int t, int ctid, int out_vec, uint32_t bar) {
  constexpr int BN = 128 * MT;      // rows per CTA (two consumer warpgroups)
  constexpr int kStride = BN + 8;   // bf16 elements per staged row (16-byte rows)
  constexpr int kChunks = BN / 8;   // 16-byte pieces per token
  bf16_t* stage = reinterpret_cast<bf16_t*>(stage_smem);
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int i = 0; i < NP / 2; ++i) {
      const int nl = (wgc * MT + mt) * 64 + 16 * w + g + ((i & 2) ? 8 : 0);
      const int tok = 8 * (i >> 2) + 2 * t + (i & 1);
      const bf16_t v = value(mt, i);
      if (tok < m) stage[tok * kStride + nl] = v;
    }
  hopper::named_barrier_sync(bar, kThreads);
  for (int e = ctid; e < m * kChunks; e += kThreads) {
    const int tok = e / kChunks, nc = e - tok * kChunks;
    const int col = row0 + 8 * nc;
    if (col >= n || !row_ok(tok)) continue;  // n is a multiple of 32: a piece is all in or all out
    const uint4 v = *reinterpret_cast<const uint4*>(stage + tok * kStride + 8 * nc);
    bf16_t* dst = out + tok * out_stride + col;
    if (out_vec == 2) {
      *reinterpret_cast<uint4*>(dst) = v;
    } else {
      const uint32_t wv[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int h = 0; h < 4; ++h) {
        dst[2 * h] = static_cast<bf16_t>(wv[h] & 0xFFFFu);
        dst[2 * h + 1] = static_cast<bf16_t>(wv[h] >> 16);
      }
    }
  }
}

// The RoPE store's value for the bf16 GEMM output x at column n (dim n % 512 of its head; dims
// 448..511 rotate in (even, odd) pairs) given its pair partner (column n ^ 1) and the row's table
// entries (64 floats, (cos, sin) interleaved): q_rope_store's arithmetic on the same values.
__device__ __forceinline__ float rope_head_value(float x, float partner, int n, const float* tab_row) {
  const int hd = n % kRopeHeadDim;
  if (hd < kRopeHeadDim - num::kRopeDim) return x;
  const int j = (hd - (kRopeHeadDim - num::kRopeDim)) >> 1;
  const float c = tab_row[2 * j], sn = tab_row[2 * j + 1];
  float re, im;
  if ((n & 1) == 0) {
    num::rope_rotate(x, partner, c, sn, re, im);
    return re;
  }
  num::rope_rotate(partner, x, c, sn, re, im);
  return im;
}
// The RoPE store's bf16 for the accumulator acc of column n: the GEMM's bf16 output (rounded by the
// hardware conversion, acc being device arithmetic), its partner from lane ^ 4 (column n ^ 1; every
// lane of the warp must call it), then rope_head_value with row m's entries of the staged table
// ([rows][64] floats).
__device__ __forceinline__ num::bf16_t rope_store_bf16(float acc, int n, const float* tab, int m) {
  const float x = num::round_bf16_arith(acc);
  const float partner = __shfl_xor_sync(0xffffffffu, x, 4);
  return num::bf16_from_f32(rope_head_value(x, partner, n, tab + m * num::kRopeDim));
}


// ---- the scale tables of a CTA's K range (v2, v3) ----------------------------------------------
// Weight scales sw[rg][b] (fp32, row stride msb) of the 32-row groups rg of the tile at row0 and
// the K blocks [kb_begin, kb_begin + nkb); groups past n get 0 (their outputs are never stored).
// Split around the PDL wait: prefetch() loads this thread's first element into a register (before
// the wait: the scales are constants), store() writes it (after the wait, beside the activation
// scales), so that a CTA that starts after its predecessor has ended -- its wait returns at once --
// pays one memory latency for both tables, not one each (v2: 12 / 16 rows -1 %, perf.md session 13).
// v3 calls store() right after prefetch(), before the wait: the split measured slower there at 24
// rows. Elements past the first kThreads (no tile of the model's shapes has that many) are loaded
// and stored by prefetch(), batched.
template <int kThreads>
struct WeightScalePrefetch {
  int rg = 0, b = 0;
  bool mine = false, real = false;
  uint32_t code = 0;
  __device__ __forceinline__ void prefetch(const uint8_t* sw_g, int64_t k_blocks, int row0, int n, int rgs, int nkb,
                                           int msb, float* sw_s, int tid) {
    const int total = rgs * nkb;
    rg = tid / nkb;
    b = tid - rg * nkb;
    mine = tid < total;
    real = mine && row0 + rg * 32 < n;
    code = real ? sw_g[rg * k_blocks + b] : 0u;
    constexpr int kBatch = 4;
    for (int i0 = tid + kThreads; i0 < total; i0 += kBatch * kThreads) {
      uint32_t v[kBatch];
#pragma unroll
      for (int r = 0; r < kBatch; ++r) {
        const int i = i0 + r * kThreads, g = i / nkb, bb = i - g * nkb;
        v[r] = i < total && row0 + g * 32 < n ? sw_g[g * k_blocks + bb] : 0u;
      }
#pragma unroll
      for (int r = 0; r < kBatch; ++r) {
        const int i = i0 + r * kThreads, g = i / nkb, bb = i - g * nkb;
        if (i < total) sw_s[g * msb + bb] = row0 + g * 32 < n ? num::f32_from_ue8m0(static_cast<uint8_t>(v[r])) : 0.0f;
      }
    }
  }
  __device__ __forceinline__ void store(int msb, float* sw_s) const {
    if (mine) sw_s[rg * msb + b] = real ? num::f32_from_ue8m0(static_cast<uint8_t>(code)) : 0.0f;
  }
};

// This thread's hopper::ActScaleWalk over the activation-scale items, pinned where it is made (the
// kernels make it before their PDL wait, so the divisions are paid while the CTA waits).
using hopper::ActScaleWalk;
template <int kThreads>
__device__ __forceinline__ ActScaleWalk act_scale_walk(int nkb, int tid) {
  ActScaleWalk w = ActScaleWalk::make(nkb, tid, kThreads);
  dev::pin_here(w.tok);
  dev::pin_here(w.b);
  dev::pin_here(w.dtok);
  dev::pin_here(w.db);
  return w;
}

// Activation scales sa[b][token] (fp32, NP tokens per block) of the K blocks [0, nkb) from sa_g
// (token r's block b at sa_g[r * stride + b]); tokens >= m get 0, so that their scale products are
// 0. Every load of a round is issued before any use: one memory latency per round (this runs right
// after the PDL wait, on the critical path). `walk`: act_scale_walk<kThreads>(nkb, tid), made before
// the wait.
template <int NP>
__device__ __forceinline__ void load_activation_scales(const uint8_t* sa_g, int64_t stride, int m, int nkb, float* sa_s,
                                                       ActScaleWalk walk) {
  constexpr int kBatch = 8;
#pragma unroll 1
  while (walk.tok < NP) {  // item i < NP * nkb
    int tok[kBatch], b[kBatch];
    uint32_t v[kBatch];
#pragma unroll
    for (int r = 0; r < kBatch; ++r) {
      tok[r] = walk.tok, b[r] = walk.b;
      v[r] = tok[r] < NP && tok[r] < m ? sa_g[tok[r] * stride + b[r]] : 0u;
      walk.advance(nkb);
    }
#pragma unroll
    for (int r = 0; r < kBatch; ++r)
      if (tok[r] < NP) sa_s[b[r] * NP + tok[r]] = tok[r] < m ? num::f32_from_ue8m0(static_cast<uint8_t>(v[r])) : 0.0f;
  }
}

}  // namespace v4attn::kernels::wgmma_fp8
