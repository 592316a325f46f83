// v5 of the bf16 and fp32 GEMMs (GemmVersion::kSkinny): the SMALL, memory-bound projections of the
// prepare path at m = 1..64 rows (weights_proj 32x5120, wk 128x512, ratio-1 wkv 512x5120 bf16; the
// ratio-2 [wkv; wgate] 1024x5120 fp32), built for little fixed latency and enough loads in flight.
//
// Grid (tiles_n, S, groups), block 128 = 4 warps, cluster (1, S, 1) when S > 1 (S <= 8). One CTA owns
// block_n weight rows (tile * block_n ..) x all m tokens x split s of S contiguous K ranges; warp w of
// the CTA owns part p = 4 s + w of the P = 4 S contiguous K parts (blocks [p kb / P, (p + 1) kb / P),
// maybe empty) for ALL block_n rows of the tile. S depends only on (n, k, groups), so the per-output
// order below never depends on m (block_n does, it moves no addition).
//
// Data path: every warp streams its own part through a PRIVATE ring of D slots (one K block each:
// the 32-element slice of every weight row of the tile and of every token row) with 16-byte cp.async
// copies; D = min(8, the part's blocks, what fits in ~100 KB per CTA), so at the model's shapes and
// m <= 8 the whole part is in flight at once. Lanes 0..15 copy the weights, lanes 16..31 the
// activations; after its copies of a slot every lane does cp.async.mbarrier.arrive.noinc on the
// slot's mbarrier (32 arrivals per phase), which fires when that lane's copies so far have landed.
// So a slot is complete when ITS weights and activations are, whatever was issued later by the other
// lanes: the weight copies of the first D slots go out before dev::pdl_wait() (weights are
// constants), the activation copies after it, and the warp still starts on block 0 as soon as block 0
// has landed (cp.async groups could not express that: they complete in issue order, so block 0's
// activations would wait for every weight copy issued before them). No CTA barrier in the loop: a
// lane waits on the slot's barrier (acquire), the warp __syncwarp()s after its last read of the slot,
// then refills it.
//
// bf16 (template NT = ceil(m / 8) n8 token tiles, R = m16 weight tiles per warp; block_n = 16 R):
// 64-byte slot rows (one K block), no swizzle needed: a quarter-warp reads two rows x 4 chunks of 16
// bytes (rows g, g+1 at 16 t), all 32 banks. mma.sync m16n8k16 exactly as v1 (gemm_tc.cu): thread
// (g, t) owns elements [8t, 8t + 8) of its weight rows g, g + 8 and token row g; two chained k16 mmas
// from C = 0 form the block sum; acc = add_rn(acc, blocksum). Token rows m..8 NT - 1 of every slot
// are zero (never loaded). R grows with m (1 for m <= 16, 2 for m <= 32, 4 above; never more rows
// than n needs, never below 128 CTAs) so that each activation byte is re-read by fewer CTAs.
//
// fp32 (template NT = ceil(m / 8) n8 token tiles; block_n = 32 = two m16 tiles): tensor cores on exact
// products. Slot: 32 weight rows x 128 bytes with the 16-byte chunk c of row r at chunk c ^ (r % 8)
// (a quarter-warp reads rows g, g + 1 at chunks 2t (+1) ^ g: 8 distinct bank groups), then 8 NT token
// rows as bf16 (64 bytes each; rows >= m zero, as bf16). Thread (g, t) loads elements 8t .. 8t + 7 of
// its rows g, g + 8 (two float4 each), splits every weight into three bf16 parts (w = hi + mid + lo
// exactly, truncations: split_f32_pair) and runs, per m16 tile and token tile, six chained m16n8k16
// mmas from zero (lo, mid, hi of elements 8t + 0..3, then of 8t + 4..7: the bf16 path's K
// permutation), acc = add_rn(acc, blocksum). Why not the CUDA cores: at m = 32 the fma forms took
// 40 us (v1) and 53 us (v5's fp32 path until session 11) for a 4.9 us stream; the split costs ~11 ALU
// operations per weight pair whatever m is. Up to kF32DirectMaxRows rows the data path is not the
// rings but direct register loads (gemm_f32_direct_kernel: same parts, same arithmetic, same bytes).
//
// Epilogue (both): after a CTA barrier (the reduction buffer aliases the rings) every warp stores
// its fp32 partial tile [m][block_n]; thread e of the CTA adds the 4 warps' values in warp order
// (add_rn). S == 1: round / store. S > 1: the CTA's sums stay in its shared memory, the cluster
// synchronises, CTA s reduces elements [s E / S, (s + 1) E / S) of the tile (E = m block_n),
// reading the S partials from the cluster's shared memory (DSMEM) in split order, ((Q0 + Q1) + Q2)
// + ..., and stores; a last cluster barrier keeps every CTA's shared memory alive until all remote
// reads are done. No workspace, no second kernel, no counters.
#include <algorithm>
#include <array>
#include <string>
#include <utility>

#include "gemm/gemm_internal.h"
#include "gemm/hopper_ptx.cuh"
#include "kernels/device_common.cuh"
#include "runtime/launch.h"

namespace v4attn::kernels {

namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kMaxSplits = 8;                   // portable cluster size
constexpr int kMaxDepth = 8;                    // slots per warp ring (cp.async.wait_group immediates 0..7)
constexpr int kTargetCtas = 256;                // ~2 CTAs per SM of the H200's 132
constexpr int kMinCtas = 128;                   // bf16: more rows per CTA only while this many CTAs remain
constexpr size_t kSmemBudget = 100 * 1024;      // per CTA, for the rings: two CTAs per SM
constexpr size_t kSmemLimit = 227 * 1024;       // sm_90 opt-in dynamic shared memory per block
constexpr int kBf16RowBytes = kGemmBlock * 2;   // one K block of bf16 (64 B)
constexpr int kF32RowBytes = kGemmBlock * 4;    // one K block of fp32 (128 B)
constexpr int kF32Rows = 32;                    // fp32: weight rows per CTA (two m16 tiles)
constexpr int kF32Chunks = kF32RowBytes / 16;   // 8 float4 per weight row and block
constexpr size_t kBarrierBytes = kWarps * kMaxDepth * 8;  // one mbarrier per slot of every warp's ring

struct SkinnyParams {
  const void* w = nullptr;      // [groups][n, k] bf16 or fp32, dense rows of k elements
  const bf16_t* x = nullptr;    // [groups][m, k] bf16; row r at x + r * x_stride
  void* out = nullptr;          // [groups][m, n] bf16 or fp32; row r at out + r * out_stride
  int64_t x_stride = 0, out_stride = 0;                                  // elements
  int64_t w_group_stride = 0, x_group_stride = 0, out_group_stride = 0;  // elements
  int m = 0, n = 0, k_blocks = 0;
  int splits = 1;           // S: CTAs per output tile (= cluster size)
  int depth = 1;            // D: slots of each warp's ring
  uint32_t slot_bytes = 0;  // one slot (multiple of 64)
  uint32_t warp_bytes = 0;  // one warp's region: D slots, multiple of 128
  uint32_t bar_offset = 0;  // the mbarriers [kWarps][D] (8 bytes each), past the rings / reduction buffer
};

constexpr int kLoaderLanes = 16;  // lanes 0..15 copy weights, lanes 16..31 activations

// ---- PTX wrappers ---------------------------------------------------------------------------------
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src) : "memory");
}
// One arrival on the mbarrier when every cp.async this thread issued so far has landed (the
// barrier's expected count includes it: .noinc).
__device__ __forceinline__ void cp_async_arrive_noinc(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }
__device__ __forceinline__ float ld_cluster_f32(uint32_t cluster_addr) {
  float v;
  asm volatile("ld.shared::cluster.f32 %0, [%1];\n" : "=f"(v) : "r"(cluster_addr) : "memory");
  return v;
}

// The K part of this warp: blocks [begin, begin + count) of the row (count may be 0).
struct WarpPart {
  int begin = 0, count = 0;
};
__device__ __forceinline__ WarpPart warp_part(const SkinnyParams& p, int split, int warp) {
  const int parts = p.splits * kWarps, part = split * kWarps + warp;
  WarpPart wp;
  wp.begin = static_cast<int>(static_cast<int64_t>(part) * p.k_blocks / parts);
  wp.count = static_cast<int>(static_cast<int64_t>(part + 1) * p.k_blocks / parts) - wp.begin;
  return wp;
}

// Token rows of one slot, bf16, 64 bytes each (both versions): rows < m of K block `kb` (relative to
// the part's first block, x already offset to it), by the 16 activation lanes (xl = lane - 16).
__device__ __forceinline__ void load_x_rows(uint32_t dst, const bf16_t* x, int64_t x_stride, int m, int kb, int xl) {
  for (int c = xl; c < m * 4; c += kLoaderLanes) {
    const int r = c >> 2, ch = c & 3;
    cp_async_16(dst + static_cast<uint32_t>(r * kBf16RowBytes + ch * 16), x + r * x_stride + kb * kGemmBlock + ch * 8);
  }
}

// This warp's slot barriers: init (lane 0; 32 arrivals per phase), visible to the warp.
__device__ __forceinline__ void init_slot_barriers(uint32_t bar0, int depth, int lane) {
  if (lane == 0)
    for (int s = 0; s < depth; ++s) hopper::mbar_init(bar0 + 8u * static_cast<uint32_t>(s), 32u);
  hopper::fence_mbarrier_init();
  __syncwarp();
}

// The CTA-level epilogue: red = [kWarps][m][BN] fp32 partial tiles (written by the warps before
// the call; rows >= rows_valid unused). Adds the warps in order, then (S > 1) the cluster's CTAs in
// split order; store(tok, row, value) writes one output.
template <int BN, class Store>
__device__ __forceinline__ void reduce_and_store(const SkinnyParams& p, float* red, int rows_valid, int split,
                                                 Store store) {
  const int mn = p.m * BN;
  __syncthreads();  // every warp's partial tile is in red
  for (int e = static_cast<int>(threadIdx.x); e < mn; e += kThreads) {
    const int tok = e / BN, row = e % BN;
    if (row >= rows_valid) continue;
    float s = red[e];
#pragma unroll
    for (int w = 1; w < kWarps; ++w) s = num::add_rn(s, red[w * mn + e]);
    if (p.splits == 1) store(tok, row, s);
    else red[e] = s;  // this CTA's partial Q_split (only this thread touches element e)
  }
  if (p.splits == 1) return;
  hopper::cluster_sync();  // every CTA's Q is in its shared memory (release / acquire, cluster scope)
  const int lo = static_cast<int>(static_cast<int64_t>(split) * mn / p.splits);
  const int hi = static_cast<int>(static_cast<int64_t>(split + 1) * mn / p.splits);
  const uint32_t red_s = hopper::smem_u32(red);
  for (int e = lo + static_cast<int>(threadIdx.x); e < hi; e += kThreads) {
    const int tok = e / BN, row = e % BN;
    if (row >= rows_valid) continue;
    const uint32_t addr = red_s + static_cast<uint32_t>(e) * 4u;
    float v[kMaxSplits];
#pragma unroll
    for (int sp = 0; sp < kMaxSplits; ++sp)
      if (sp < p.splits) v[sp] = ld_cluster_f32(hopper::map_to_cluster_rank(addr, static_cast<uint32_t>(sp)));
    float s = v[0];
#pragma unroll
    for (int sp = 1; sp < kMaxSplits; ++sp)
      if (sp < p.splits) s = num::add_rn(s, v[sp]);  // split order: ((Q0 + Q1) + Q2) + ...
    store(tok, row, s);
  }
  hopper::cluster_sync_relaxed();  // no CTA exits (freeing its shared memory) before all remote reads are done
}

// ---- bf16 ---------------------------------------------------------------------------------------------
template <int NT, int R>
__global__ void __launch_bounds__(kThreads) gemm_bf16_skinny_kernel(const __grid_constant__ SkinnyParams p) {
  constexpr int BN = 16 * R;  // weight rows per CTA (every warp: all of them)
  constexpr int BM = 8 * NT;  // token rows per slot (rows >= m are zero)
  extern __shared__ __align__(128) uint8_t smem[];

  const int tid = static_cast<int>(threadIdx.x), lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int row0 = static_cast<int>(blockIdx.x) * BN, split = static_cast<int>(blockIdx.y);
  const int grp = static_cast<int>(blockIdx.z);
  const int64_t k = static_cast<int64_t>(p.k_blocks) * kGemmBlock;
  const WarpPart part = warp_part(p, split, warp);
  const int rows_valid = min(BN, p.n - row0);  // a multiple of 16 (n % 32 == 0), > 0

  const bf16_t* w = static_cast<const bf16_t*>(p.w) + grp * p.w_group_stride + row0 * k +
                    static_cast<int64_t>(part.begin) * kGemmBlock;
  const bf16_t* x = p.x + grp * p.x_group_stride + static_cast<int64_t>(part.begin) * kGemmBlock;
  uint8_t* ring = smem + warp * p.warp_bytes;
  const uint32_t ring_s = hopper::smem_u32(ring);
  const int depth = p.depth;
  const uint32_t bar0 = hopper::smem_u32(smem + p.bar_offset) + 8u * static_cast<uint32_t>(warp * depth);
  const bool w_lane = lane < kLoaderLanes;
  const uint64_t stream = dev::l2_policy_stream();  // weights: read once per cycle

  // Block `it` of the part into slot it % D: this lane's share (weights or activations), then its
  // arrival on the slot's barrier.
  auto load = [&](int it) {
    const uint32_t dst = ring_s + static_cast<uint32_t>(it % depth) * p.slot_bytes;
    if (w_lane) {
#pragma unroll
      for (int i = 0; i < BN * 4 / kLoaderLanes; ++i) {
        const int c = lane + kLoaderLanes * i, r = c >> 2, ch = c & 3;
        if (r < rows_valid)
          dev::cp_async16_stream(dst + static_cast<uint32_t>(r * kBf16RowBytes + ch * 16), w + r * k + it * kGemmBlock + ch * 8,
                                 stream);
      }
    } else {
      load_x_rows(dst + BN * kBf16RowBytes, x, p.x_stride, p.m, it, lane - kLoaderLanes);
    }
    cp_async_arrive_noinc(bar0 + 8u * static_cast<uint32_t>(it % depth));
  };

  // ---- prologue: weights (constants) before the PDL wait, activations after ----------------------
  init_slot_barriers(bar0, depth, lane);
  const int pre = min(depth, part.count);
  if (w_lane)
    for (int s = 0; s < pre; ++s) load(s);
  for (int s = 0; s < pre; ++s)  // token rows m..BM-1 stay zero (never loaded)
    for (int c = p.m * 4 + lane; c < BM * 4; c += 32)
      *reinterpret_cast<uint4*>(ring + s * p.slot_bytes + BN * kBf16RowBytes + c * 16) = make_uint4(0u, 0u, 0u, 0u);
  __syncwarp();     // the zeros are visible to the warp
  dev::pdl_wait();  // x is the predecessor's output
  if (!w_lane)
    for (int s = 0; s < pre; ++s) load(s);

  float acc[R][NT][4];
#pragma unroll
  for (int mt = 0; mt < R; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[mt][nt][i] = 0.0f;
  bool live[R];  // m16 tile inside n (all in or all out)
#pragma unroll
  for (int mt = 0; mt < R; ++mt) live[mt] = mt * 16 < rows_valid;
  const float zero4[4] = {0.0f, 0.0f, 0.0f, 0.0f};

  // ---- main loop: one K block per iteration ------------------------------------------------------------
  for (int it = 0; it < part.count; ++it) {
    // Every lane's copies of block `it` have landed (phase it / D of the slot's barrier; acquire).
    hopper::mbar_wait(bar0 + 8u * static_cast<uint32_t>(it % depth), static_cast<uint32_t>((it / depth) & 1));
    const uint8_t* ws = ring + (it % depth) * p.slot_bytes;
    const uint8_t* xs = ws + BN * kBf16RowBytes;
    uint32_t af[R][2][4];
#pragma unroll
    for (int mt = 0; mt < R; ++mt) {
      const int r = mt * 16 + g;
      uint4 lo = make_uint4(0u, 0u, 0u, 0u), hi = lo;
      if (live[mt]) {
        lo = *reinterpret_cast<const uint4*>(ws + r * kBf16RowBytes + t * 16);
        hi = *reinterpret_cast<const uint4*>(ws + (r + 8) * kBf16RowBytes + t * 16);
      }
      af[mt][0][0] = lo.x;  // row g,   elements 8t + 0, 1 (logical k 2t, 2t+1 of mma 0)
      af[mt][0][1] = hi.x;  // row g+8, elements 8t + 0, 1
      af[mt][0][2] = lo.y;  // row g,   elements 8t + 2, 3 (logical k 2t+8, 2t+9)
      af[mt][0][3] = hi.y;
      af[mt][1][0] = lo.z;  // mma 1: elements 8t + 4..7
      af[mt][1][1] = hi.z;
      af[mt][1][2] = lo.w;
      af[mt][1][3] = hi.w;
    }
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const uint4 q = *reinterpret_cast<const uint4*>(xs + (nt * 8 + g) * kBf16RowBytes + t * 16);  // token nt*8+g
#pragma unroll
      for (int mt = 0; mt < R; ++mt) {
        if (!live[mt]) continue;
        float d[4];
        hopper::mma_m16n8k16<false>(d, af[mt][0], q.x, q.y, zero4);  // elements 8t + 0..3 of the block
        hopper::mma_m16n8k16<false>(d, af[mt][1], q.z, q.w, d);      // elements 8t + 4..7: d = block sum
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[mt][nt][i] = num::add_rn(acc[mt][nt][i], d[i]);
      }
    }
    __syncwarp();  // every lane is done reading the slot (and has passed its wait) before it is refilled
    if (it + depth < part.count) load(it + depth);
  }
  cp_async_wait_all();  // nothing is pending (every loaded slot was waited for); keep the ring quiet at exit
  dev::pdl_launch_dependents();

  // ---- epilogue ------------------------------------------------------------------------------------------
  __syncthreads();  // the reduction buffer aliases every warp's ring
  float* red = reinterpret_cast<float*>(smem);
  const int mn = p.m * BN;
  // Element (mt, nt, i): row mt*16 + g + (i >= 2 ? 8 : 0), token nt*8 + 2t + (i & 1).
#pragma unroll
  for (int mt = 0; mt < R; ++mt) {
    if (!live[mt]) continue;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int row = mt * 16 + g + (i >= 2 ? 8 : 0), tok = nt * 8 + 2 * t + (i & 1);
        if (tok < p.m) red[warp * mn + tok * BN + row] = acc[mt][nt][i];
      }
  }
  bf16_t* out = static_cast<bf16_t*>(p.out) + grp * p.out_group_stride + row0;
  reduce_and_store<BN>(p, red, rows_valid, split,
                       [&](int tok, int row, float v) { out[tok * p.out_stride + row] = num::bf16_from_f32(v); });
}

// ---- fp32 ---------------------------------------------------------------------------------------------
// w = hi + mid + lo exactly, each part a bf16 value: truncations, so every step is exact (w - hi and
// r1 - mid are exact fp32 differences, r2 keeps at most 8 significant bits). `pack_hi` gathers the
// upper halves of two fp32 words (elements k, k + 1) into one bf16x2 A-fragment register.
__device__ __forceinline__ uint32_t pack_hi(uint32_t a, uint32_t b) { return __byte_perm(a, b, 0x7632); }
struct SplitPair {
  uint32_t hi, mid, lo;  // bf16x2: low half element k, high half element k + 1
};
__device__ __forceinline__ SplitPair split_f32_pair(float a, float b) {
  constexpr uint32_t kTop = 0xffff0000u;
  const uint32_t ua = num::f32_bits(a), ub = num::f32_bits(b);
  const float ra = __fsub_rn(a, num::f32_from_bits(ua & kTop)), rb = __fsub_rn(b, num::f32_from_bits(ub & kTop));
  const uint32_t va = num::f32_bits(ra), vb = num::f32_bits(rb);
  const float sa = __fsub_rn(ra, num::f32_from_bits(va & kTop)), sb = __fsub_rn(rb, num::f32_from_bits(vb & kTop));
  return {pack_hi(ua, ub), pack_hi(va, vb), pack_hi(num::f32_bits(sa), num::f32_bits(sb))};
}

// One K block of a warp (both fp32 data paths, so their bytes are the same): w[mt][hh][h] = elements
// 8t + 4h .. + 3 of weight row mt * 16 + g + 8 hh, b[nt] = elements 8t .. 8t + 7 of token nt * 8 + g
// (bf16, zero for tokens >= m). Per m16 tile and token tile: six chained m16n8k16 mmas from zero
// (lo, mid, hi of elements 8t + 0..3, then of 8t + 4..7: the bf16 path's K permutation), then
// acc = add_rn(acc, blocksum).
template <int NT>
__device__ __forceinline__ void f32_block_mma(const float4 (&w)[2][2][2], const uint4 (&b)[NT], float (&acc)[2][NT][4]) {
  uint32_t af[3][2][2][4];  // [part hi / mid / lo][m16 tile][mma of the block][A fragment]
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float4 u = w[mt][0][h], v = w[mt][1][h];
      const SplitPair u01 = split_f32_pair(u.x, u.y), u23 = split_f32_pair(u.z, u.w);
      const SplitPair v01 = split_f32_pair(v.x, v.y), v23 = split_f32_pair(v.z, v.w);
      const SplitPair* q[4] = {&u01, &v01, &u23, &v23};  // A fragment order: (g, k01), (g+8, k01), (g, k23), (g+8, k23)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        af[0][mt][h][i] = q[i]->hi;
        af[1][mt][h][i] = q[i]->mid;
        af[2][mt][h][i] = q[i]->lo;
      }
    }
  const float zero4[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
      // Block sum from zero, smallest parts first: every product (bf16 x bf16) is exact in fp32.
      float d[4];
      hopper::mma_m16n8k16<false>(d, af[2][mt][0], b[nt].x, b[nt].y, zero4);
      hopper::mma_m16n8k16<false>(d, af[1][mt][0], b[nt].x, b[nt].y, d);
      hopper::mma_m16n8k16<false>(d, af[0][mt][0], b[nt].x, b[nt].y, d);
      hopper::mma_m16n8k16<false>(d, af[2][mt][1], b[nt].z, b[nt].w, d);
      hopper::mma_m16n8k16<false>(d, af[1][mt][1], b[nt].z, b[nt].w, d);
      hopper::mma_m16n8k16<false>(d, af[0][mt][1], b[nt].z, b[nt].w, d);
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[mt][nt][i] = num::add_rn(acc[mt][nt][i], d[i]);
    }
}

// The fp32 epilogue of both data paths: every warp's partial tile into the reduction buffer (which
// aliases the rings of the ring path), then the fixed-order reduction and the store.
template <int NT>
__device__ __forceinline__ void f32_store_partials(const SkinnyParams& p, uint8_t* smem, const float (&acc)[2][NT][4],
                                                   int warp, int g, int t, int row0, int rows_valid, int split, int grp) {
  __syncthreads();  // the reduction buffer aliases every warp's ring
  float* red = reinterpret_cast<float*>(smem);
  const int mn = p.m * kF32Rows;
  // Element (mt, nt, i): row mt*16 + g + (i >= 2 ? 8 : 0), token nt*8 + 2t + (i & 1).
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int row = mt * 16 + g + (i >= 2 ? 8 : 0), tok = nt * 8 + 2 * t + (i & 1);
        if (tok < p.m) red[warp * mn + tok * kF32Rows + row] = acc[mt][nt][i];  // rows >= rows_valid: never read
      }
  float* out = static_cast<float*>(p.out) + grp * p.out_group_stride + row0;
  reduce_and_store<kF32Rows>(p, red, rows_valid, split, [&](int tok, int row, float v) { out[tok * p.out_stride + row] = v; });
}

template <int NT>
__global__ void __launch_bounds__(kThreads) gemm_f32_skinny_kernel(const __grid_constant__ SkinnyParams p) {
  constexpr int BN = kF32Rows;  // two m16 tiles, every warp all of them
  constexpr int BM = 8 * NT;    // token rows per slot (rows >= m are zero)
  extern __shared__ __align__(128) uint8_t smem[];

  const int tid = static_cast<int>(threadIdx.x), lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int row0 = static_cast<int>(blockIdx.x) * BN, split = static_cast<int>(blockIdx.y);
  const int grp = static_cast<int>(blockIdx.z);
  const int64_t k = static_cast<int64_t>(p.k_blocks) * kGemmBlock;
  const WarpPart part = warp_part(p, split, warp);
  const int rows_valid = min(BN, p.n - row0);  // > 0; rows past it hold stale bytes, never stored

  const float* w = static_cast<const float*>(p.w) + grp * p.w_group_stride + row0 * k +
                   static_cast<int64_t>(part.begin) * kGemmBlock;
  const bf16_t* x = p.x + grp * p.x_group_stride + static_cast<int64_t>(part.begin) * kGemmBlock;
  uint8_t* ring = smem + warp * p.warp_bytes;
  const uint32_t ring_s = hopper::smem_u32(ring);
  const int depth = p.depth;
  const uint32_t bar0 = hopper::smem_u32(smem + p.bar_offset) + 8u * static_cast<uint32_t>(warp * depth);
  const bool w_lane = lane < kLoaderLanes;
  const uint64_t stream = dev::l2_policy_stream();  // weights: read once per cycle

  // As bf16; weight chunk c of row r goes to chunk c ^ (r % 8) of the row.
  auto load = [&](int it) {
    const uint32_t dst = ring_s + static_cast<uint32_t>(it % depth) * p.slot_bytes;
    if (w_lane) {
#pragma unroll
      for (int i = 0; i < BN * kF32Chunks / kLoaderLanes; ++i) {
        const int c = lane + kLoaderLanes * i, r = c / kF32Chunks, ch = c % kF32Chunks;
        if (r < rows_valid)
          dev::cp_async16_stream(dst + static_cast<uint32_t>(r * kF32RowBytes + ((ch ^ (r & 7)) << 4)),
                                 w + r * k + it * kGemmBlock + ch * 4, stream);
      }
    } else {
      load_x_rows(dst + BN * kF32RowBytes, x, p.x_stride, p.m, it, lane - kLoaderLanes);
    }
    cp_async_arrive_noinc(bar0 + 8u * static_cast<uint32_t>(it % depth));
  };

  // ---- prologue (as bf16) ------------------------------------------------------------------------------
  init_slot_barriers(bar0, depth, lane);
  const int pre = min(depth, part.count);
  if (w_lane)
    for (int s = 0; s < pre; ++s) load(s);
  for (int s = 0; s < pre; ++s)  // token rows m..BM-1 stay zero (never loaded)
    for (int c = p.m * 4 + lane; c < BM * 4; c += 32)
      *reinterpret_cast<uint4*>(ring + s * p.slot_bytes + BN * kF32RowBytes + c * 16) = make_uint4(0u, 0u, 0u, 0u);
  __syncwarp();
  dev::pdl_wait();
  if (!w_lane)
    for (int s = 0; s < pre; ++s) load(s);

  float acc[2][NT][4] = {};  // the block sums of each part are added from +0

  // ---- main loop: one K block per iteration ------------------------------------------------------------
  for (int it = 0; it < part.count; ++it) {
    hopper::mbar_wait(bar0 + 8u * static_cast<uint32_t>(it % depth), static_cast<uint32_t>((it / depth) & 1));
    const uint8_t* ws = ring + (it % depth) * p.slot_bytes;
    const uint8_t* xs = ws + BN * kF32RowBytes;
    float4 wv[2][2][2];
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh)
#pragma unroll
        for (int h = 0; h < 2; ++h)  // chunk 2t + h of row mt*16 + g + 8hh (row % 8 == g)
          wv[mt][hh][h] = *reinterpret_cast<const float4*>(ws + (mt * 16 + g + 8 * hh) * kF32RowBytes + (((2 * t + h) ^ g) << 4));
    uint4 xb[NT];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) xb[nt] = *reinterpret_cast<const uint4*>(xs + (nt * 8 + g) * kBf16RowBytes + t * 16);
    f32_block_mma<NT>(wv, xb, acc);
    __syncwarp();  // every lane is done with the slot before it is refilled
    if (it + depth < part.count) load(it + depth);
  }
  cp_async_wait_all();
  dev::pdl_launch_dependents();
  f32_store_partials<NT>(p, smem, acc, warp, g, t, row0, rows_valid, split, grp);
}

// The fp32 direct path (small m): the same warps, parts, per-block arithmetic and reduction as the
// ring kernel above (so the same bytes), but every lane loads its own A and B fragments straight
// into registers -- 8 16-byte weight loads per block (rows g, g + 8 of both m16 tiles, 32 bytes of
// each) and one per token tile -- with the next kDirectAhead blocks in flight, no shared-memory ring
// and no barriers. The rings' per-warp cp.async + mbarrier machinery streamed ~1.3 TB/s at one row.
constexpr int kDirectAhead = 2;  // K blocks of loads in flight per lane beyond the one being used
template <int NT>
__global__ void __launch_bounds__(kThreads) gemm_f32_direct_kernel(const __grid_constant__ SkinnyParams p) {
  extern __shared__ __align__(128) uint8_t smem[];  // the reduction buffer only
  const int tid = static_cast<int>(threadIdx.x), lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int row0 = static_cast<int>(blockIdx.x) * kF32Rows, split = static_cast<int>(blockIdx.y);
  const int grp = static_cast<int>(blockIdx.z);
  const int64_t k = static_cast<int64_t>(p.k_blocks) * kGemmBlock;
  const WarpPart part = warp_part(p, split, warp);
  const int rows_valid = min(kF32Rows, p.n - row0);
  const float* w = static_cast<const float*>(p.w) + grp * p.w_group_stride + row0 * k +
                   static_cast<int64_t>(part.begin) * kGemmBlock + 8 * t;
  const bf16_t* x = p.x + grp * p.x_group_stride + static_cast<int64_t>(part.begin) * kGemmBlock + 8 * t;
  const uint64_t stream = dev::l2_policy_stream();  // weights: read once per cycle

  auto load_w = [&](int it, float4 (&v)[2][2][2]) {
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int r = mt * 16 + g + 8 * hh;
#pragma unroll
        for (int h = 0; h < 2; ++h)
          v[mt][hh][h] = r < rows_valid ? dev::ldg_stream(reinterpret_cast<const float4*>(w + r * k + it * kGemmBlock + 4 * h), stream)
                                        : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      }
  };
  auto load_x = [&](int it, uint4 (&b)[NT]) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const int tok = nt * 8 + g;
      b[nt] = tok < p.m ? *reinterpret_cast<const uint4*>(x + tok * p.x_stride + it * kGemmBlock) : make_uint4(0u, 0u, 0u, 0u);
    }
  };

  float acc[2][NT][4] = {};  // the block sums of each part are added from +0

  // Ring of kDirectAhead + 1 register sets, indexed by it % (kDirectAhead + 1) in fully unrolled
  // groups so that every index is a compile-time constant (registers, not local memory).
  constexpr int kSets = kDirectAhead + 1;
  float4 wv[kSets][2][2][2];
  uint4 xb[kSets][NT];
#pragma unroll
  for (int s = 0; s < kDirectAhead; ++s)
    if (s < part.count) load_w(s, wv[s]);  // weights are constants: before the PDL wait
  dev::pdl_wait();  // x is the predecessor's output
#pragma unroll
  for (int s = 0; s < kDirectAhead; ++s)
    if (s < part.count) load_x(s, xb[s]);
  for (int it0 = 0; it0 < part.count; it0 += kSets) {
#pragma unroll
    for (int s = 0; s < kSets; ++s) {
      const int it = it0 + s;
      if (it < part.count) {
        const int nxt = it + kDirectAhead, ns = (s + kDirectAhead) % kSets;
        if (nxt < part.count) {
          load_w(nxt, wv[ns]);
          load_x(nxt, xb[ns]);
        }
        f32_block_mma<NT>(wv[s], xb[s], acc);
      }
    }
  }
  dev::pdl_launch_dependents();
  f32_store_partials<NT>(p, smem, acc, warp, g, t, row0, rows_valid, split, grp);
}

using SkinnyKernel = void (*)(SkinnyParams);

// The instantiations of a kernel template over NT = 1..N token tiles, indexed by NT - 1.
template <int R, int... I>
constexpr std::array<SkinnyKernel, sizeof...(I)> bf16_kernels(std::integer_sequence<int, I...>) {
  return {gemm_bf16_skinny_kernel<I + 1, R>...};
}
template <int... I>
constexpr std::array<SkinnyKernel, sizeof...(I)> f32_ring_kernels(std::integer_sequence<int, I...>) {
  return {gemm_f32_skinny_kernel<I + 1>...};
}
template <int... I>
constexpr std::array<SkinnyKernel, sizeof...(I)> f32_direct_kernels(std::integer_sequence<int, I...>) {
  return {gemm_f32_direct_kernel<I + 1>...};
}
template <size_t N>
SkinnyKernel pick_nt(const std::array<SkinnyKernel, N>& kernels, int nt, const char* what) {
  if (nt < 1 || nt > static_cast<int>(N)) throw std::invalid_argument(what);
  return kernels[static_cast<size_t>(nt - 1)];
}

template <int R>
SkinnyKernel pick_bf16_kernel(int nt) {
  static constexpr auto kKernels = bf16_kernels<R>(std::make_integer_sequence<int, 8>{});
  return pick_nt(kKernels, nt, "gemm v5: m must be 1..64");
}
SkinnyKernel pick_f32_kernel(int m) {
  static constexpr auto kKernels = f32_ring_kernels(std::make_integer_sequence<int, 8>{});
  return pick_nt(kKernels, (m + 7) / 8, "gemm v5: m must be 1..64");
}
SkinnyKernel pick_f32_direct_kernel(int m) {
  static constexpr auto kKernels = f32_direct_kernels(std::make_integer_sequence<int, kF32DirectMaxRows / 8>{});
  static_assert(kF32DirectMaxRows == 32, "the message below names the limit");
  return pick_nt(kKernels, (m + 7) / 8, "gemm v5: the fp32 direct path takes m <= 32");
}

// Per-warp ring geometry of a plan (host; the kernels get it through SkinnyParams).
struct RingGeometry {
  size_t slot_bytes = 0, warp_bytes = 0;
};
// The epilogue's reduction buffer: every warp's fp32 partial tile [kWarps][m][block_n].
size_t reduction_bytes(int m, int block_n) {
  return static_cast<size_t>(kWarps) * static_cast<size_t>(m) * static_cast<size_t>(block_n) * sizeof(float);
}
RingGeometry ring_geometry(bool f32, int m, int warp_mtiles, int depth) {
  RingGeometry g;
  const int nt = std::max(1, (m + 7) / 8);
  g.slot_bytes = f32 ? static_cast<size_t>(kF32Rows * kF32RowBytes + 8 * nt * kBf16RowBytes)
                     : static_cast<size_t>((16 * warp_mtiles + 8 * nt) * kBf16RowBytes);
  g.warp_bytes = (static_cast<size_t>(depth) * g.slot_bytes + 127) / 128 * 128;
  return g;
}

// One launch over the plan's tiles: grid (tiles_n, S, groups), the S CTAs of a tile one cluster.
void launch_tiles(const char* name, SkinnyKernel kernel, const SkinnyParams& t, const GemmPlan& plan, int groups,
                  size_t smem_bytes, cudaStream_t stream, bool pdl) {
  LaunchConfig cfg;
  cfg.grid = dim3(static_cast<unsigned>(plan.tiles_n), static_cast<unsigned>(plan.splits), static_cast<unsigned>(groups));
  cfg.block = dim3(kThreads);
  cfg.cluster = dim3(1, static_cast<unsigned>(plan.splits), 1);  // {1, 1, 1} when S == 1: no cluster attribute
  cfg.smem_bytes = smem_bytes;
  cfg.stream = stream;
  cfg.pdl = pdl;
  launch_kernel(name, kernel, cfg, t);
}

void launch_skinny(const char* name, SkinnyKernel kernel, SkinnyParams t, const GemmPlan& plan, bool f32, int groups,
                   cudaStream_t stream, bool pdl) {
  const RingGeometry geo = ring_geometry(f32, t.m, plan.warp_mtiles, plan.stages);
  t.splits = plan.splits;
  t.depth = plan.stages;
  t.slot_bytes = static_cast<uint32_t>(geo.slot_bytes);
  t.warp_bytes = static_cast<uint32_t>(geo.warp_bytes);
  t.bar_offset = static_cast<uint32_t>(plan.smem_bytes - kBarrierBytes);
  launch_tiles(name, kernel, t, plan, groups, plan.smem_bytes, stream, pdl);
}

}  // namespace

// Measured (docs/perf.md, session 2 run 2, bench_gemm graph timing with PDL, bf16): v5 beats v1
// at m >= 24 on every small projection (c1 wkv m=32: 10.9 vs 31.3 us), on wk (k 512) at every m
// (3.6 vs 5.6 us at m=6) and on c1 wkv (n 512) from m = 2 (8.6 vs 10.3 us at m=6); v1 wins on
// c1 wkv at m=1 (7.0 vs 8.5) and on weights_proj (n 32) below m = 24 (7.0 vs 7.7 at m=6).
// In the three-lane cycle (session 27, docs/perf.md runs 8-9) the c1 projection (512 x 5120, lane S
// of layer 20, starved beside the main lane's GEMMs) is faster as v1 up to 8 rows: same binary
// against HEAD, decode bs 2 -0.9 %, bs 3 -0.2 %, bs 4 -0.7 %, verify bs 1 (6 rows) -0.1..-0.4 %, decode
// bs 8 even; forced v1 at 12 rows even, at 24 +0.2 %. So wide (n >= 128, k > 1024) bf16 projections
// take v5 from 9 rows (was 2; the only such GEMM in V4.1's prepare is c1's).
namespace {
bool skinny_shape_ok(int m, int64_t n, int64_t k) {
  return m >= 1 && m <= kGemmMaxRows && n >= 1 && n <= 1024 && k >= kGemmBlock && k <= 8192 && k % kGemmBlock == 0;
}
}  // namespace
bool skinny_gemm_preferred(int m, int64_t n, int64_t k) {
  return skinny_shape_ok(m, n, k) && (m >= 24 || k <= 1024 || (n >= 128 && m >= 9));
}
// fp32 (the ratio-2 compressor [wkv; wgate] 1024x5120, session 11 runs 4-5, bench_gemm graph timing
// with PDL, us): v5 (direct path to 32 rows, rings above) against v1 at m = 1 / 6 / 8 / 12 / 16 / 24
// / 32 / 64: 8.0 / 8.3 / 8.4 / 13.9 / 14.1 / 15.0 / 15.8 / 31.1 vs 6.8 / 11.4 / 13.3 / 17.0 / 20.9 /
// 38.3 / 40.6 / 78.4 (session 26, m 2 / 3 / 4: v5 8.2 / 8.3 / 8.4). In session 11's
// three-lane cycle v5 below 16 rows was slower (verify bs 1 +0.2 %, decode bs 4 +0.8 %, decode bs 1
// +1.4 %); re-measured in session 26's schedule (docs/perf.md session 26, runs 6-8) it is faster
// from 2 rows: decode bs 2 -0.5 %, bs 4 -0.6 %, bs 8 -1.0 %, bs 12 -0.8 %, verify bs 2 -0.6 %, verify
// bs 1 -0.15 % (threshold 16 -> 2 against the session-start binary); at one row still +0.9 %.
bool f32_skinny_preferred(int m, int64_t n, int64_t k) { return skinny_shape_ok(m, n, k) && m >= 2; }

GemmPlan plan_gemm_skinny(int m, int64_t n, int64_t k, int groups, bool f32, int force_splits, int force_mtiles) {
  auto fail = [](const std::string& what) { throw std::invalid_argument("plan_gemm_skinny: " + what); };
  if (m < 0 || m > kGemmMaxRows) fail("m must be 0..64 (got " + std::to_string(m) + ")");
  if (n <= 0 || k <= 0 || k % kGemmBlock != 0 || groups < 1)
    fail("need n > 0, k a positive multiple of 32, groups >= 1 (got n " + std::to_string(n) + ", k " + std::to_string(k) +
         ", groups " + std::to_string(groups) + ")");
  if (force_splits < 0) fail("force_splits < 0");
  if (f32 ? (force_mtiles != 0 && force_mtiles != 1)
          : (force_mtiles != 0 && force_mtiles != 1 && force_mtiles != 2 && force_mtiles != 4))
    fail(f32 ? "force_mtiles must be 0 or 1 (fp32: 32 rows per CTA)" : "force_mtiles must be 0, 1, 2 or 4");
  const int64_t kb = k / kGemmBlock;
  const int nt = std::max(1, (m + 7) / 8);
  GemmPlan plan;
  // S from (n, k, groups) only (the numerics): ~kTargetCtas CTAs with the smallest tiles (16 rows
  // bf16, 32 fp32), at most the cluster size, and (automatic plan) at least one K block per warp.
  const int64_t unit_rows = f32 ? kF32Rows : 16;
  const int64_t units = static_cast<int64_t>(groups) * ((n + unit_rows - 1) / unit_rows);
  int64_t s;
  if (force_splits != 0) {
    s = std::min<int64_t>({force_splits, kMaxSplits, kb});
  } else {
    s = std::clamp<int64_t>((kTargetCtas + units - 1) / units, 1, kMaxSplits);
    s = std::min<int64_t>(s, std::max<int64_t>(1, kb / kWarps));
  }
  plan.splits = static_cast<int>(s);
  plan.cluster = plan.splits;
  // Rows per CTA (no effect on the numerics): bf16 more m16 tiles at larger m, so fewer CTAs re-read
  // the activations, but never more tiles than n needs and never below kMinCtas CTAs for it.
  int r = 1;
  if (!f32) {
    if (force_mtiles != 0) {
      r = force_mtiles;
    } else {
      r = nt <= 2 ? 1 : nt <= 4 ? 2 : 4;
      auto ctas = [&](int rr) { return static_cast<int64_t>(groups) * ((n + 16 * rr - 1) / (16 * rr)) * s; };
      while (r > 1 && (16 * (r / 2) >= n || ctas(r) < kMinCtas)) r /= 2;
    }
  }
  plan.warp_mtiles = r;
  plan.block_n = f32 ? kF32Rows : 16 * r;
  plan.tiles_n = static_cast<int>((n + plan.block_n - 1) / plan.block_n);
  // Ring depth: as many slots as the largest part has blocks, <= 8, within the CTA's budget.
  const int64_t max_part = (kb + s * kWarps - 1) / (s * kWarps);
  const RingGeometry one = ring_geometry(f32, m, r, 1);
  const size_t per_warp = kSmemBudget / kWarps;
  const int64_t fit = static_cast<int64_t>(per_warp / one.slot_bytes);
  plan.stages = static_cast<int>(std::clamp<int64_t>(std::min<int64_t>(fit, max_part), 1, kMaxDepth));
  const RingGeometry geo = ring_geometry(f32, m, r, plan.stages);
  const size_t ring = kWarps * geo.warp_bytes;
  const size_t red = reduction_bytes(m, plan.block_n);
  // The slot barriers go past both (the reduction buffer aliases the rings, never the barriers).
  plan.smem_bytes = (std::max(ring, red) + 127) / 128 * 128 + kBarrierBytes;
  if (plan.smem_bytes > kSmemLimit) fail("shared memory plan over the limit (internal)");
  plan.workspace_bytes = 0;  // split-K reduced inside the cluster
  return plan;
}

namespace {
// The fields bf16 and fp32 calls share (Bf16GemmParams / F32GemmParams name them alike).
template <class P>
SkinnyParams skinny_params(const P& p) {
  SkinnyParams t;
  t.w = p.w;
  t.x = p.x;
  t.out = p.out;
  t.x_stride = p.x_stride;
  t.out_stride = p.out_stride;
  t.m = p.m;
  t.n = static_cast<int>(p.n);
  t.k_blocks = static_cast<int>(p.k / kGemmBlock);
  return t;
}
}  // namespace

namespace detail {

void launch_gemm_bf16_skinny(const Bf16GemmParams& p, const GemmPlan& plan, cudaStream_t stream, bool pdl) {
  SkinnyParams t = skinny_params(p);
  t.w_group_stride = p.w_group_stride;
  t.x_group_stride = p.x_group_stride;
  t.out_group_stride = p.out_group_stride;
  const int nt = (p.m + 7) / 8;
  const SkinnyKernel kernel = plan.warp_mtiles == 4   ? pick_bf16_kernel<4>(nt)
                              : plan.warp_mtiles == 2 ? pick_bf16_kernel<2>(nt)
                                                      : pick_bf16_kernel<1>(nt);
  launch_skinny("gemm_bf16_skinny", kernel, t, plan, false, p.groups, stream, pdl);
}

void launch_gemm_f32_skinny(const F32GemmParams& p, const GemmPlan& plan, cudaStream_t stream, bool pdl) {
  const bool direct = p.v5_path == 1 || (p.v5_path == 0 && p.m <= kF32DirectMaxRows);
  if (!direct) {
    launch_skinny("gemm_f32_skinny", pick_f32_kernel(p.m), skinny_params(p), plan, true, 1, stream, pdl);
    return;
  }
  // The direct path: the plan's split (so the same parts and bytes as the rings), shared memory for
  // the reduction buffer only.
  SkinnyParams t = skinny_params(p);
  t.splits = plan.splits;
  launch_tiles("gemm_f32_direct", pick_f32_direct_kernel(p.m), t, plan, 1, reduction_bytes(p.m, kF32Rows), stream, pdl);
}

}  // namespace detail
}  // namespace v4attn::kernels
