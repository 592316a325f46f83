// Indexer scores (spec 3.4): for row t and compressed position j < clen[t],
//   score[t, j] = sum over heads h = 0..31, in order, of relu(dot(t, h, j)) * w[t, h],
//   dot = ((b0 + b1) + b2) + b3,  b_i = exact block sum of 32 products of dequantized e2m1 values,
// with the K vector read from the paged index-K cache at slot comp_slot_table[req[t]][j]; -inf for
// j in [clen, score_stride). Twin of ref::indexer_scores, bit for bit.
//
// Exactness. Twice an e2m1 value is an integer in [-12, 12], so each product of two codes times 4
// is an integer and a 32-term block sum times 4 (|.| <= 32 * 144 = 4608) is an exact int32: the
// int8 tensor-core MMA (mma.sync m16n8k32 s8.s8.s32, one k-step = one quant block) computes it
// exactly, in any internal order. The block sum is then isum * 2^(eq + ek - 2): converted exactly
// (magic-number conversion: the accumulator starts at the bits of 1.5 * 2^23, so the result's
// bits are the float 1.5 * 2^23 + isum, and subtracting 1.5 * 2^23 is exact) and scaled by the
// power of two sq * (sk * 1/4), which is exact whenever the block sum is a normal fp32 number, as
// is the reference's ldexp. Everything after that rounds, in exactly the reference's order.
//
// Grid: (T, position tiles); blockIdx.x = row (fastest, so the rows of one request, which read
// the same K, run together and share L2), blockIdx.y = tile. One CTA = 4 warps = one row and
// 4 * 32 * steps positions. Warp w takes the 32 positions [tile + (i*4 + w) * 32, +32) at step i.
//
// Per CTA: the row's 32 heads of q (2 KB of codes) are decoded once into registers as the MMA's B
// operand (n = head, 4 n-tiles of 8 heads, k = the block's 32 elements); head and k are
// permuted so that lane (g, tq) accumulates heads 8tq..8tq+7 and its k-slots hold elements
// 8tq..8tq+7 of the block, which are one 32-bit word of the packed codes (any permutation of k is
// fine: the block sum is an exact integer). Per warp step: the 32 positions' K slots (64 B
// codes + 4 B scales each) are copied with cp.async (16-byte chunks) into a 3-stage per-warp
// ring; the slot table entries are loaded one step ahead. The A operand (m = position, two
// m-tiles of 16) is decoded from shared memory (e2m1 nibbles -> int8 with two PRMTs). Each lane
// then forms relu(dot) * w for its (position, head) pairs and writes the 8 head terms of a
// position to a shared buffer; lane l finally adds the 32 terms of position l in head order and
// stores the score (one coalesced 128-byte store).
//
// Two exact ways to form dot, chosen per warp and m-tile (warp vote):
//  - per-block path (any scales): one MMA per block into a fresh accumulator, each block sum
//    scaled by its own power of two, ((b0 + b1) + b2) + b3 in fp32 exactly like the reference.
//    ~16 fp32 ops per (position, head).
//  - fused path, when every q head of the row and both K slots of the lane have their 4 block
//    scale exponents within 3 of their minimum (and within [-60, 50]): the int8 operands carry
//    the 2^(e_b - e_min) factors (shifted PRMT tables, |values| <= 96), the four k-steps chain
//    into one accumulator, and one power-of-two product gives dot. Equal to the reference because
//    its block sums and partial sums are then all exact (see the proof at the path). ~4 fp32 ops.
//  Vectors whose block amaxes are within ~8x of each other take the fused path (whether real q
//  heads do, RoPE half vs nope half, is to be measured); the per-block path keeps every input
//  exact.
//
// Bytes per visible position: 68 (index K) + 4 (slot table); per stride slot: 4 (score write).
//
// PDL: req and clen (step metadata) are read before dev::pdl_wait(); q, weights, the slot table
// and the index-K cache after it (q/w come from the q-pack kernel, K from the index-K store).
// The trigger follows the CTA's last store.
#include "v4attn/kernels/indexer_kernels.h"

#include <stdexcept>
#include <string>

#include "kernels/device_common.cuh"
#include "runtime/launch.h"

namespace v4attn::kernels {

namespace {

constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
constexpr int kStepPositions = 32;  // positions per warp step
constexpr int kStages = 3;          // cp.async ring depth per warp
constexpr int kTransStride = 36;    // floats per position row of the term buffer (conflict-free)
constexpr int kBlocks = kIndexerHeadDim / num::kIndexerQuantBlock;  // 4
constexpr int kMaxSteps = 4;
constexpr uint32_t kFullMask = 0xffffffffu;
constexpr int kMagicBits = 0x4B400000;   // 1.5 * 2^23
constexpr float kMagicFloat = 12582912.0f;

struct ScoresSmem {
  uint32_t kdata[kWarps][kStages][kStepPositions * 16];  // position p: 16 words, chunk c at (c ^ swz(p))
  uint32_t kscale[kWarps][kStages][kStepPositions];      // position p: its 4 ue8m0 bytes
  float terms[kWarps][kStepPositions * kTransStride];    // [position][head] relu(dot) * w
};

// ---- device helpers ---------------------------------------------------------------------------
__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
}

// Four e2m1 codes (nibbles of sel[15:0], nibble i -> byte i) -> four int8 = twice their value.
// prmt's generic mode copies source byte (nibble & 7) when the nibble's bit 3 is clear and
// replicates that byte's sign bit (0 for our table, all values < 128) when it is set. So `pos`
// holds the magnitude of the positive codes (0 for negative ones) and `neg`, with bit 3 flipped,
// the magnitude of the negative codes; (128 + pos - neg) per byte never borrows, and xor 0x80
// turns the biased byte into the two's complement of pos - neg.
// With the table shifted left by s (s <= 3: every byte stays < 128, no carry between bytes) the
// same two PRMTs give twice the value times 2^s (|.| <= 96, still int8 and still borrow-free).
constexpr uint32_t kTwiceLo = 0x03020100u;  // codes 0..3 -> 0, 1, 2, 3   (twice 0, .5, 1, 1.5)
constexpr uint32_t kTwiceHi = 0x0C080604u;  // codes 4..7 -> 4, 6, 8, 12  (twice 2, 3, 4, 6)
__device__ __forceinline__ uint32_t e2m1x4_to_s8(uint32_t sel, uint32_t lo, uint32_t hi) {
  const uint32_t pos = prmt(lo, hi, sel);
  const uint32_t neg = prmt(lo, hi, sel ^ 0x8888u);
  return ((pos | 0x80808080u) - neg) ^ 0x80808080u;
}
__device__ __forceinline__ uint32_t e2m1x4_to_s8_twice(uint32_t sel) { return e2m1x4_to_s8(sel, kTwiceLo, kTwiceHi); }

// D = A * B + C, int8 x int8 -> int32, m16n8k32 (exact; no saturation needed: |D| < 2^31).
__device__ __forceinline__ void mma_s8_m16n8k32(int (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2], int c) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%10, %10, %10, %10};\n"
      : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "r"(c));
}
// D += A * B.
__device__ __forceinline__ void mma_s8_m16n8k32_acc(int (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// The fused path (below) needs the 4 block scale bytes of a vector within a span of 3 (so the
// int8 operands can absorb 2^(e_b - e_min)) and in a range where every partial sum is an exact
// fp32 number: exponents in [-60, 50] (byte - 127).
constexpr int kFusedSpan = 3;
constexpr uint32_t kFusedMinByte = 127 - 60, kFusedMaxByte = 127 + 50;
__device__ __forceinline__ uint32_t byte_of(uint32_t w, int b) { return (w >> (8 * b)) & 0xffu; }
__device__ __forceinline__ uint32_t min_byte(uint32_t w) {
  return min(min(byte_of(w, 0), byte_of(w, 1)), min(byte_of(w, 2), byte_of(w, 3)));
}
__device__ __forceinline__ bool fused_ok(uint32_t w) {
  const uint32_t lo = min_byte(w);
  const uint32_t hi = max(max(byte_of(w, 0), byte_of(w, 1)), max(byte_of(w, 2), byte_of(w, 3)));
  return hi - lo <= kFusedSpan && lo >= kFusedMinByte && hi <= kFusedMaxByte;
}

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
// src_bytes = 0 zero-fills the destination without reading the source.
__device__ __forceinline__ void cp_async_16(void* dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src), "r"(src_bytes)
               : "memory");
}
__device__ __forceinline__ void cp_async_4(void* dst, const void* src, int src_bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_addr(dst)), "l"(src), "r"(src_bytes)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Swizzle of the four 16-byte chunks of a position's codes in shared memory: the A-operand reads
// (lanes g = 0..7 -> positions base+g, word 4*block + tq) then hit 32 distinct banks.
__device__ __forceinline__ int chunk_swizzle(int p) { return (p >> 1) & 3; }

__global__ void __launch_bounds__(kThreads, 3)
    indexer_scores_kernel(const __grid_constant__ IndexerScoresParams p, int steps, int page_shift) {
  __shared__ __align__(16) ScoresSmem sm;
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const int g = lane >> 2, tq = lane & 3;
  const int64_t t = blockIdx.x;
  const int64_t tile_base = static_cast<int64_t>(blockIdx.y) * kWarps * kStepPositions * steps;

  // ---- row metadata, contained like the reference refuses it ----
  const int32_t req = p.req[t];
  int64_t c = p.clen[t];
  bool row_error = false;
  if (c < 0) { c = 0; row_error = true; }
  if (c > p.score_stride) { c = p.score_stride; row_error = true; }
  if (req < 0) {
    c = 0;  // padded row: sees no position (not an error)
  } else if (req >= p.comp_table_rows) {
    if (c > 0) row_error = true;  // unknown request
    c = 0;
  } else if (c > p.comp_table_stride) {
    c = p.comp_table_stride;
    row_error = true;
  }
  if (row_error && blockIdx.y == 0 && threadIdx.x == 0) dev::count_error(p.err_count);

  dev::pdl_wait();  // q, weights, slot table and index K are written by predecessors

  float* out_row = p.scores + t * p.score_stride;
  const bool tile_has_work = tile_base < c;  // CTA-uniform

  // ---- q of this row: B fragments (decoded once), scales and weights of this lane's 8 heads ----
  // q_shifted (CTA-uniform: every thread reads all 32 heads' scale words): every head's 4 block
  // scales fit the fused path; then block b's int8 values carry 2^(eq_b - eq_min) and the head's
  // scale is 2^eq_min for every block (sq[hl][b] = sq_min), which both paths use: the per-block
  // path's block sums are unchanged (isum * 2^(eq_b - eq_min) * 2^eq_min), the fused path needs it.
  uint32_t bq[4][kBlocks][2];
  float sq[8][kBlocks];
  float wt[8];
  bool q_shifted = false;
  if (tile_has_work) {
    const uint32_t* qs_row = reinterpret_cast<const uint32_t*>(p.q_scales + t * (kIndexerHeads * kIndexerScaleBytes));
    q_shifted = true;
#pragma unroll
    for (int v = 0; v < kIndexerHeads / 4; ++v) {
      const uint4 w4 = reinterpret_cast<const uint4*>(qs_row)[v];
      q_shifted = q_shifted && fused_ok(w4.x) && fused_ok(w4.y) && fused_ok(w4.z) && fused_ok(w4.w);
    }
    const uint8_t* qrow = p.q_codes + t * (kIndexerHeads * kIndexerCodeBytes);
#pragma unroll
    for (int n = 0; n < 4; ++n) {
      const int head = 8 * (g >> 1) + 2 * n + (g & 1);  // MMA column g of n-tile n
      const uint32_t hs = qs_row[head];
      const uint32_t hmin = min_byte(hs);
#pragma unroll
      for (int b = 0; b < kBlocks; ++b) {
        const uint32_t shift = q_shifted ? byte_of(hs, b) - hmin : 0u;
        const uint32_t lo = kTwiceLo << shift, hi = kTwiceHi << shift;
        const uint32_t w = *reinterpret_cast<const uint32_t*>(qrow + head * kIndexerCodeBytes + 16 * b + 4 * tq);
        bq[n][b][0] = e2m1x4_to_s8(w, lo, hi);        // elements 8tq..8tq+3 -> k-slots 4tq..4tq+3
        bq[n][b][1] = e2m1x4_to_s8(w >> 16, lo, hi);  // elements 8tq+4..8tq+7 -> k-slots 16+4tq..
      }
    }
    // Accumulator column 2tq + e of n-tile n is head 8tq + 2n + e =: 8tq + hl.
#pragma unroll
    for (int hl = 0; hl < 8; ++hl) {
      const uint32_t hs = qs_row[8 * tq + hl];
      const uint32_t hmin = min_byte(hs);
#pragma unroll
      for (int b = 0; b < kBlocks; ++b)
        sq[hl][b] = num::f32_from_ue8m0(static_cast<uint8_t>(q_shifted ? hmin : byte_of(hs, b)));
      wt[hl] = p.weights[t * kIndexerHeads + 8 * tq + hl];
    }
  }

  // ---- per-warp pipeline over steps ----
  const int64_t table_row = req >= 0 ? static_cast<int64_t>(req) * p.comp_table_stride : 0;
  const int64_t page_bytes = p.layout.page_bytes();
  const int64_t page_mask = (int64_t{1} << page_shift) - 1;
  const int64_t scale_base = static_cast<int64_t>(p.layout.page_size) * kIndexerCodeBytes;
  auto step_base = [&](int i) -> int64_t {
    return tile_base + (static_cast<int64_t>(i) * kWarps + warp) * kStepPositions;
  };
  auto load_slot = [&](int i) -> int32_t {  // this lane's table entry for step i (-1 past clen)
    const int64_t j = step_base(i) + lane;
    return (i < steps && j < c) ? p.comp_slot_table[table_row + j] : -1;
  };
  uint32_t valid_ring = 0;  // bit (i % kStages): this lane's position of step i has a usable slot
  auto issue = [&](int i, int32_t slot) {
    const int64_t p0 = step_base(i);
    if (i >= steps || p0 >= c) return;  // warp-uniform: nothing to load for this step
    const int stage = i % kStages;
    const bool in_clen = p0 + lane < c;
    const bool ok = in_clen && slot >= 0 && slot < p.n_slots;
    if (in_clen && !ok) dev::count_error(p.err_count);  // reference refuses it; here: score -inf
    const int32_t use = ok ? slot : -1;
    valid_ring = (valid_ring & ~(1u << stage)) | (static_cast<uint32_t>(ok) << stage);
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const int ci = lane + 32 * q;
      const int pp = ci >> 2, ch = ci & 3;
      const int32_t s = __shfl_sync(kFullMask, use, pp);
      const int64_t off = (static_cast<int64_t>(s) >> page_shift) * page_bytes + (s & page_mask) * kIndexerCodeBytes;
      cp_async_16(&sm.kdata[warp][stage][pp * 16 + ((ch ^ chunk_swizzle(pp)) * 4)],
                  s >= 0 ? p.index_k_cache + off + 16 * ch : p.index_k_cache, s >= 0 ? 16 : 0);
    }
    const int64_t soff = (static_cast<int64_t>(use) >> page_shift) * page_bytes + scale_base +
                         (use & page_mask) * kIndexerScaleBytes;
    cp_async_4(&sm.kscale[warp][stage][lane], ok ? p.index_k_cache + soff : p.index_k_cache, ok ? 4 : 0);
  };

#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    issue(s, load_slot(s));
    cp_async_commit();
  }
  int32_t slot_next = load_slot(kStages - 1);

  float* terms = sm.terms[warp];
  for (int i = 0; i < steps; ++i) {
    const int64_t p0 = step_base(i);
    if (p0 >= p.score_stride) break;  // warp-uniform; later steps are further out
    issue(i + kStages - 1, slot_next);
    cp_async_commit();
    slot_next = load_slot(i + kStages);  // used one step later: its latency hides behind this step
    cp_async_wait<kStages - 1>();        // this lane's copies of step i have landed
    __syncwarp();                        // ... and every other lane's

    if (p0 >= c) {  // warp-uniform: nothing visible in this step
      out_row[p0 + lane] = -__int_as_float(0x7f800000);
      continue;
    }
    const int stage = i % kStages;
    const uint32_t* kd = sm.kdata[warp][stage];
    const uint32_t* ks = sm.kscale[warp][stage];
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
      uint32_t kw[2][kBlocks], sc[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int pp = 16 * mt + g + 8 * r;  // position of MMA rows g (r = 0) and g + 8 (r = 1)
#pragma unroll
        for (int b = 0; b < kBlocks; ++b) kw[r][b] = kd[pp * 16 + ((b ^ chunk_swizzle(pp)) * 4) + tq];
        sc[r] = ks[pp];
      }
      float term[2][8];
      if (__all_sync(kFullMask, q_shifted && fused_ok(sc[0]) && fused_ok(sc[1]))) {
        // Fused path: K's int8 values carry 2^(ek_b - ek_min), q's 2^(eq_b - eq_min), so the four
        // k-steps accumulate I = sum_b isum_b * 2^(eq_b + ek_b - eq_min - ek_min) in one int32.
        // Each block sum and every partial sum of ((b0 + b1) + b2) + b3 is an integer multiple of
        // 2^Emin (Emin = eq_min + ek_min - 2) below 2^21 * 2^Emin (|isum_b| <= 4608, shifts <= 6),
        // hence an exact fp32 number: the reference's rounded sums are exact here and equal
        // I * 2^Emin, which the magic conversion and one power-of-two product give exactly.
        uint32_t kmin[2];
        float sk4min[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          kmin[r] = min_byte(sc[r]);
          sk4min[r] = num::mul_rn(num::f32_from_ue8m0(static_cast<uint8_t>(kmin[r])), 0.25f);
        }
        int acc[4][4];
#pragma unroll
        for (int b = 0; b < kBlocks; ++b) {
          const uint32_t s0 = byte_of(sc[0], b) - kmin[0], s1 = byte_of(sc[1], b) - kmin[1];
          const uint32_t lo0 = kTwiceLo << s0, hi0 = kTwiceHi << s0, lo1 = kTwiceLo << s1, hi1 = kTwiceHi << s1;
          const uint32_t a[4] = {e2m1x4_to_s8(kw[0][b], lo0, hi0), e2m1x4_to_s8(kw[1][b], lo1, hi1),
                                 e2m1x4_to_s8(kw[0][b] >> 16, lo0, hi0), e2m1x4_to_s8(kw[1][b] >> 16, lo1, hi1)};
#pragma unroll
          for (int n = 0; n < 4; ++n) {
            if (b == 0) mma_s8_m16n8k32(acc[n], a, bq[n][0], kMagicBits);
            else mma_s8_m16n8k32_acc(acc[n], a, bq[n][b]);
          }
        }
#pragma unroll
        for (int n = 0; n < 4; ++n)
#pragma unroll
          for (int r = 0; r < 2; ++r)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const int hl = 2 * n + e;
              const float isum = num::sub_rn(__int_as_float(acc[n][2 * r + e]), kMagicFloat);  // exact
              const float dot = num::mul_rn(isum, num::mul_rn(sq[hl][0], sk4min[r]));
              term[r][hl] = num::mul_rn(dot > 0.0f ? dot : 0.0f, wt[hl]);
            }
      } else {
        // Per-block path (any scales): four exact block sums, combined like the reference.
        float sk4[2][kBlocks];
#pragma unroll
        for (int r = 0; r < 2; ++r)
#pragma unroll
          for (int b = 0; b < kBlocks; ++b)
            sk4[r][b] = num::mul_rn(num::f32_from_ue8m0(static_cast<uint8_t>(byte_of(sc[r], b))), 0.25f);
        float dot[2][8];
#pragma unroll
        for (int b = 0; b < kBlocks; ++b) {
          const uint32_t a[4] = {e2m1x4_to_s8_twice(kw[0][b]), e2m1x4_to_s8_twice(kw[1][b]),
                                 e2m1x4_to_s8_twice(kw[0][b] >> 16), e2m1x4_to_s8_twice(kw[1][b] >> 16)};
#pragma unroll
          for (int n = 0; n < 4; ++n) {
            int acc[4];
            mma_s8_m16n8k32(acc, a, bq[n][b], kMagicBits);
#pragma unroll
            for (int r = 0; r < 2; ++r)
#pragma unroll
              for (int e = 0; e < 2; ++e) {
                const int hl = 2 * n + e;
                const float isum = num::sub_rn(__int_as_float(acc[2 * r + e]), kMagicFloat);  // exact
                const float block_sum = num::mul_rn(isum, num::mul_rn(sq[hl][b], sk4[r][b]));
                dot[r][hl] = b == 0 ? block_sum : num::add_rn(dot[r][hl], block_sum);
              }
          }
        }
#pragma unroll
        for (int r = 0; r < 2; ++r)
#pragma unroll
          for (int hl = 0; hl < 8; ++hl) term[r][hl] = num::mul_rn(dot[r][hl] > 0.0f ? dot[r][hl] : 0.0f, wt[hl]);
      }
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float4* dst = reinterpret_cast<float4*>(terms + (16 * mt + g + 8 * r) * kTransStride + 8 * tq);
        dst[0] = make_float4(term[r][0], term[r][1], term[r][2], term[r][3]);
        dst[1] = make_float4(term[r][4], term[r][5], term[r][6], term[r][7]);
      }
    }
    __syncwarp();
    float score = 0.0f;
    const float4* row = reinterpret_cast<const float4*>(terms + lane * kTransStride);
#pragma unroll
    for (int h4 = 0; h4 < kIndexerHeads / 4; ++h4) {
      const float4 v = row[h4];
      score = num::add_rn(num::add_rn(num::add_rn(num::add_rn(score, v.x), v.y), v.z), v.w);
    }
    const bool valid = (valid_ring >> stage) & 1u;
    out_row[p0 + lane] = valid ? score : -__int_as_float(0x7f800000);
    __syncwarp();  // the term buffer and this stage are rewritten by later steps
  }
  cp_async_wait<0>();

  dev::pdl_launch_dependents();  // after this thread's last store
}

void require(bool ok, const char* who, const std::string& what) {
  if (!ok) throw std::invalid_argument(std::string(who) + ": " + what);
}
bool aligned(const void* ptr, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(ptr) % bytes == 0; }

}  // namespace

void run_indexer_scores(const IndexerScoresParams& p, cudaStream_t stream, bool pdl) {
  const char* who = "run_indexer_scores";
  require(p.T >= 0, who, "negative T");
  require(p.score_stride > 0 && p.score_stride % 64 == 0, who,
          "score_stride " + std::to_string(p.score_stride) + " must be a positive multiple of 64");
  const CacheLayout want = cache_layout(CacheKind::kIndexK, p.layout.page_size > 0 ? p.layout.page_size : 1);
  require(p.layout.data_bytes == want.data_bytes && p.layout.scale_bytes == want.scale_bytes &&
              p.layout.align == want.align,
          who, "layout is not the index-K layout (64 + 4 bytes per slot)");
  const int P = p.layout.page_size;
  require(P >= 4 && (P & (P - 1)) == 0, who,
          "index-K page size " + std::to_string(P) + " must be a power of two >= 4 (16-byte aligned slots)");
  require(p.n_slots >= 0, who, "negative n_slots");
  require(p.comp_table_stride >= 0 && p.comp_table_rows >= 0, who, "negative slot table shape");
  require(p.steps_per_warp >= 0 && p.steps_per_warp <= kMaxSteps, who, "steps_per_warp must be in [0, 4]");
  if (p.T == 0) return;
  require(p.T <= 0x7fffffff, who, "T too large for one grid dimension");
  require(p.q_codes != nullptr && p.q_scales != nullptr && p.weights != nullptr && p.req != nullptr &&
              p.clen != nullptr && p.scores != nullptr,
          who, "null pointer");
  require(p.index_k_cache != nullptr || p.n_slots == 0, who, "null index-K cache");
  require(p.comp_slot_table != nullptr || p.comp_table_rows == 0, who, "null slot table");
  require(aligned(p.q_codes, 16) && aligned(p.q_scales, 16) && aligned(p.index_k_cache, 16), who,
          "q_codes, q_scales and index_k_cache must be 16-byte aligned");
  require(p.n_slots < (int64_t{1} << 31), who, "n_slots must fit in int32 slots");

  int page_shift = 0;
  while ((1 << page_shift) < P) ++page_shift;
  // Steps per warp: 4 (512 positions per CTA) unless that leaves fewer than ~2 CTAs per SM of an
  // H200 (132 SMs); then shorter tiles for more parallelism.
  int steps = p.steps_per_warp;
  if (steps == 0) {
    steps = kMaxSteps;
    auto ctas = [&](int s) { return p.T * ((p.score_stride + kThreads * s - 1) / (kThreads * s)); };
    while (steps > 1 && ctas(steps) < 264) steps /= 2;
  }
  const int64_t tile = static_cast<int64_t>(kWarps) * kStepPositions * steps;
  const int64_t tiles = (p.score_stride + tile - 1) / tile;
  require(tiles <= 65535, who, "score_stride too large for the tile grid");

  LaunchConfig cfg;
  cfg.grid = dim3(static_cast<unsigned>(p.T), static_cast<unsigned>(tiles), 1);
  cfg.block = dim3(kThreads, 1, 1);
  cfg.stream = stream;
  cfg.pdl = pdl;
  launch_kernel("indexer_scores", indexer_scores_kernel, cfg, p, steps, page_shift);
}

}  // namespace v4attn::kernels
