// Compressor tails (spec 3.3), decode and target-verify alike: c1 fused (ratio 1) and c2 fused
// (ratio 2). Twins of ref::c1_fused and ref::c2_fused. Both end in the V41_FP4 compressed-KV store
// (FP4 KV quant, block 16, e4m3 scales) of the latent roped at the group position g.
//
// Pair per thread (see prepare_common.cuh): thread j of a row owns latent dims 2j, 2j+1 (j in
// 0..255): its latent_pre_rope bf16 pair, its RoPE pair (j >= 224: dims 448..511, warp-uniform),
// its code byte j of the FP4 slot; the FP4 block b (dims 16b..16b+15) is the 8 lanes 8b..8b+7,
// lane 8b stores scale byte b. (The previous version walked each row with one warp, 16 dims per
// lane through double exps, IEEE divisions and software e4m3/e2m1: a few rows left the GPU idle
// behind those chains.)
//  - c1: grid 2N CTAs of 128 threads (CTA 2t + h owns pairs 128h .. 128h+127 of row t); each warp
//    computes its row's RMSNorm sum of squares itself (detail::warp_row_sum_squares, the LaneSum
//    order), so the two CTAs of a row never talk.
//  - c2: grid N CTAs of 256 threads (one per row): the pooled row is built pair by pair, parked in
//    shared memory (bf16-exact floats), and after one barrier every warp takes the row's LaneSum
//    from there (lane l: chunks l and l+32) and goes on with its own pairs.
//  - c2 / c1 + wk + index-K (c2_index_fused_kernel, c1_index_fused_kernel): one CTA of 256 threads
//    per row does the compressor's row (c2's steps, or c1's pairs), then the indexer's key of that
//    row -- the wk GEMM (kproj = latent_pre_rope @ wk^T, 128 x 512 bf16) by the same mma.sync
//    fragments and the same sum tree as GEMM v5 (gemm_skinny.cu) at that shape, then the index-K
//    store's steps (index_k_device.cuh) --, so the source layers' lane S runs one kernel where it
//    ran three dependent ones (c2 or c1, the v5 GEMM, index_k_store), with the same bytes.
// Rows are independent, so any N works (decode, verify, padded buckets). Every early exit depends
// on the row's metadata only, so it is uniform over the row's CTAs (the c2 barrier is safe).
//
// PDL, both kernels: before dev::pdl_wait() a thread reads only step metadata (pos, out_loc, state
// rows, prev_row: host-copied before the step, see prepare_kernels.h; all of a row's metadata is
// loaded at once, before the first branch) and constants (c_norm, the table row). The wait
// precedes the first load of the GEMM output (proj / kvs) and, for c2, every access to the pair
// state (the previous step's c2 launch wrote it; PDL chains do not promise that kernels before
// our predecessor have finished until the wait returns). The trigger follows each thread's last
// store. Errors (device-side containment, see prepare_kernels.h) are counted once per row, by the
// thread of pair 0.
#include "v4attn/kernels/prepare_kernels.h"

#include <string>

#include "gemm/gemm_internal.h"
#include "gemm/hopper_ptx.cuh"
#include "kernels/index_k_device.cuh"
#include "kernels/prepare_common.cuh"
#include "runtime/launch.h"

namespace v4attn::kernels {

namespace {

constexpr int kPairs = kPrepHeadDim / 2;                                  // 256 pairs per latent
constexpr int kTailFirstPair = (kPrepHeadDim - num::kRopeDim) / 2;       // 224: dims 448..511
constexpr int kFp4BlockPairs = num::kKvFp4Block / 2;                     // 8 lanes per FP4 block
constexpr int kKvsRow = 2 * kPrepHeadDim;                                // kv | score
constexpr int kC1Threads = 128;
constexpr int kC1CtasPerRow = kPairs / kC1Threads;                       // 2
constexpr int kC2Threads = kPairs;                                       // 256: one CTA per row
static_assert(kTailFirstPair % 32 == 0, "the RoPE pairs are whole warps (uniform branch)");
static_assert(kPairs % kC1Threads == 0 && kC1Threads % 32 == 0, "c1: whole warps, whole CTAs per row");
static_assert(kKvsRow == 4 * kC2Threads, "c2 park: one float4 per thread");

// The (cos, sin) table entry of pair j for RoPE at position g (zeros off the tail; never used).
__device__ __forceinline__ float2 load_tail_cs(const float* table, int32_t g, int j) {
  return j >= kTailFirstPair ? detail::ldg_f32x2(table + static_cast<int64_t>(g) * num::kRopeDim + 2 * (j - kTailFirstPair))
                             : make_float2(0.0f, 0.0f);
}

// Pair j of a normalised (bf16-exact, pre-RoPE) latent row: stores it to latent_row, then RoPE at
// the table entry cs (tail pairs) and its FP4 code byte (and, for a block's first lane, the block's
// scale byte) into the slot loc when 0 < loc < n_slots; loc >= n_slots is counted once per row (by
// pair 0). loc is per row, so the branches are warp-uniform, as the block-amax shuffles need.
__device__ __forceinline__ void latent_pair_out(float x0, float x1, int j, float2 cs, int32_t loc, bf16_t* latent_row,
                                                const CacheLayout& layout, uint8_t* cache, int64_t n_slots,
                                                unsigned long long* err_count) {
  *reinterpret_cast<uint32_t*>(latent_row + 2 * j) = detail::pack_bf16x2(x0, x1);
  if (loc <= 0) return;  // no group slot (padded row or not completing)
  if (loc >= n_slots) {
    if (j == 0) dev::count_error(err_count);
    return;
  }
  if (j >= kTailFirstPair) detail::rope_pair(x0, x1, cs);
  const uint8_t sb = num::kv_fp4_scale_byte(detail::lane_group_amax<kFp4BlockPairs>(detail::pair_amax(x0, x1)));
  cache[layout.data_offset(loc) + j] = detail::fp4_code_pair(x0, x1, num::f32_from_e4m3(sb));
  if (j % kFp4BlockPairs == 0) cache[layout.scale_offset(loc) + j / kFp4BlockPairs] = sb;
}

// ---- c1 fused -------------------------------------------------------------------------------------
// Row t: latent = RMSNorm(proj[t], c_norm) -> latent_pre_rope[t] (every row, the padded ones too,
// like the reference); RoPE at g = pos[t]; FP4 store at out_loc[t].
// Pair j of row t (any CTA shape: every warp takes the row's sum of squares itself). Returns without
// the PDL trigger: the caller triggers after its own last store.
__device__ __forceinline__ void c1_pair(const C1FusedParams& p, int t, int j) {
  const int lane = j % 32;

  const int32_t pos = p.pos[t];
  const int32_t loc = p.out_loc[t];
  if (pos < 0 || pos >= p.max_pos) {  // refused on the host by the reference; here the row is skipped
    if (j == 0) dev::count_error(p.err_count);
    return;
  }
  const float2 w = detail::ldg_f32x2(p.c_norm + 2 * j);
  const float2 cs = load_tail_cs(p.table, pos, j);

  dev::pdl_wait();  // proj is the wkv_c GEMM's output

  const bf16_t* row = p.proj + static_cast<int64_t>(t) * p.proj_row_stride;
  float x0, x1;
  detail::load_bf16x2(row + 2 * j, x0, x1);
  const float r = num::rmsnorm_rstd(detail::warp_row_sum_squares<kPrepHeadDim>(row, lane), kPrepHeadDim, p.eps);
  detail::rmsnorm_apply_pair(x0, x1, r, w);
  latent_pair_out(x0, x1, j, cs, loc, p.latent_pre_rope + static_cast<int64_t>(t) * p.latent_row_stride, p.layout,
                  p.cache, p.n_slots, p.err_count);
}

__global__ void __launch_bounds__(kC1Threads) c1_fused_kernel(const __grid_constant__ C1FusedParams p) {
  c1_pair(p, static_cast<int>(blockIdx.x / kC1CtasPerRow),
          static_cast<int>(blockIdx.x % kC1CtasPerRow) * kC1Threads + static_cast<int>(threadIdx.x));
  dev::pdl_launch_dependents();  // after this thread's last store (or its early return)
}

// ---- c2 fused -------------------------------------------------------------------------------------
// Row t (CTA-uniform branches):
//  - state_row < 0: padded, returns before touching anything;
//  - even pos: parks kvs[t] (all 1024 floats, one float4 per thread) in state[state_row]; no
//    latent, no store;
//  - odd pos: partner = kvs[prev_row] (the INPUT row of the partner when it is in this batch; its
//    own CTA may be parking it into the state concurrently, which is why the state is never read
//    for it) else state[partner_state_row]; pooled[d] = pair_softmax_pool(partner, self),
//    bf16-rounded; latent = RMSNorm(pooled, c_norm) -> latent_pre_rope[t]; RoPE at g = pos - 1;
//    FP4 store at out_loc[t]. Odd rows do not write the state (ref::c2_fused parks even rows only).
// Race freedom needs the reference's step invariant (build_step_meta guarantees it, ref::c2_fused
// refuses violations): no state row is parked twice, or parked and read as a partner, in one
// step. Then every state read sees the state from before the launch, as in the reference.
// Device-side containment of metadata the reference refuses (state row >= state_rows, pos outside
// the table, prev_row outside [0, N) or == t, partner state row outside the state): the row is
// skipped entirely and counted.
// Row t by its CTA of 256 threads (thread j = pair j); pooled_row: 512 floats of shared memory.
// Returns (CTA-uniformly) without the PDL trigger: the caller triggers after its own last store.
__device__ __forceinline__ void c2_row(const C2FusedParams& p, int t, int j, float* pooled_row) {
  const int lane = j % 32;

  // The row's whole metadata in one round trip (the odd-row fields are [N] too: always readable).
  const int32_t srow = p.state_row[t];
  const int32_t pos = p.pos[t];
  const int32_t prev = p.prev_row[t];
  const int32_t partner_srow = p.partner_state_row[t];
  const int32_t loc = p.out_loc[t];
  if (srow < 0) return;  // padded row: writes nothing at all
  if (srow >= p.state_rows || pos < 0 || pos >= p.max_pos) {
    if (j == 0) dev::count_error(p.err_count);
    return;
  }
  const float* self = p.kvs + static_cast<int64_t>(t) * p.kvs_row_stride;

  if ((pos & 1) == 0) {  // park (kv, score) for the partner-to-come
    dev::pdl_wait();     // kvs is the GEMM's output; the state row may be read by earlier kernels
    const float4 v = *reinterpret_cast<const float4*>(self + 4 * j);
    *reinterpret_cast<float4*>(p.state + static_cast<int64_t>(srow) * kKvsRow + 4 * j) = v;
    return;
  }

  const bool partner_ok = prev >= 0 ? (prev < p.N && prev != t) : (partner_srow >= 0 && partner_srow < p.state_rows);
  if (!partner_ok) {
    if (j == 0) dev::count_error(p.err_count);
    return;
  }
  const int32_t g = pos - 1;  // >= 0: pos is odd
  const float2 w = detail::ldg_f32x2(p.c_norm + 2 * j);
  const float2 cs = load_tail_cs(p.table, g, j);

  dev::pdl_wait();  // kvs (GEMM output) and the pair state (previous step) are read below

  const float* partner = prev >= 0 ? p.kvs + static_cast<int64_t>(prev) * p.kvs_row_stride
                                   : p.state + static_cast<int64_t>(partner_srow) * kKvsRow;
  const int d = 2 * j;
  const float2 kv_a = *reinterpret_cast<const float2*>(partner + d);  // a = even = partner
  const float2 s_a = *reinterpret_cast<const float2*>(partner + kPrepHeadDim + d);
  const float2 kv_b = *reinterpret_cast<const float2*>(self + d);
  const float2 s_b = *reinterpret_cast<const float2*>(self + kPrepHeadDim + d);
  float x0 = num::round_bf16(num::pair_softmax_pool(kv_a.x, s_a.x, kv_b.x, s_b.x));
  float x1 = num::round_bf16(num::pair_softmax_pool(kv_a.y, s_a.y, kv_b.y, s_b.y));
  *reinterpret_cast<float2*>(pooled_row + d) = make_float2(x0, x1);
  __syncthreads();

  // Every warp: the row's LaneSum from shared memory (lane l: chunks l and l + 32, in order).
  float xs[2][detail::kChunk];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const float4* src = reinterpret_cast<const float4*>(pooled_row + (i * 32 + lane) * detail::kChunk);
    const float4 a = src[0], b = src[1];
    xs[i][0] = a.x; xs[i][1] = a.y; xs[i][2] = a.z; xs[i][3] = a.w;
    xs[i][4] = b.x; xs[i][5] = b.y; xs[i][6] = b.z; xs[i][7] = b.w;
  }
  const float r = num::rmsnorm_rstd(dev::warp_lane_sum(detail::lane_sum_squares_part<2>(xs)), kPrepHeadDim, p.eps);
  detail::rmsnorm_apply_pair(x0, x1, r, w);
  latent_pair_out(x0, x1, j, cs, loc, p.latent_pre_rope + static_cast<int64_t>(t) * p.latent_row_stride, p.layout,
                  p.cache, p.n_slots, p.err_count);
}

__global__ void __launch_bounds__(kC2Threads) c2_fused_kernel(const __grid_constant__ C2FusedParams p) {
  __shared__ __align__(16) float pooled_row[kPrepHeadDim];  // the row's bf16-exact pooled values
  c2_row(p, static_cast<int>(blockIdx.x), static_cast<int>(threadIdx.x), pooled_row);
  dev::pdl_launch_dependents();  // after this thread's last store (or its early return)
}

// ---- c2 + wk + index-K, fused ------------------------------------------------------------------
// kproj[t] = bf16(latent_pre_rope[t] @ wk^T) with GEMM v5's bytes at (n 128, k 512): v5 plans S = 4
// splits of 4 warps there whatever m is (kWkSplits, checked by the launcher), so output c is
// bf16(((Q0 + Q1) + Q2) + Q3), Q_s = ((B_4s + B_4s+1) + B_4s+2) + B_4s+3, B_p = +0 + the block sum
// of K block p, the block sum = two chained m16n8k16 bf16 mmas from zero with v1's fragment mapping
// (thread (g, q) holds elements 8q .. 8q + 7 of weight rows g, g + 8 and of token row g; the first
// mma takes elements 8q .. 8q + 3). An mma's column (token) does not depend on the others, so the
// row alone (token 0; token rows 1..7 zero) gets the bytes it gets inside v5's batch. Warp w owns
// output rows 16w .. 16w + 15 and walks the 16 K blocks in order, folding each split as it ends.
constexpr int kWkBlocks = kPrepHeadDim / kGemmBlock;  // 16
constexpr int kWkSplits = 4;                           // v5's S at (128, 512); one block per part
constexpr int kWkPartsPerSplit = kWkBlocks / kWkSplits;  // 4 = v5's warps per split
static_assert(kC2Threads / 32 * 16 == kPrepIndexDim, "8 warps x 16 output rows");
// This thread's wk fragments (constants): weight rows 16w + g and 16w + g + 8, elements 8q .. 8q + 7 of
// every K block, loaded at the kernel's start so that their latency hides behind c2.
struct WkFragments {
  uint4 lo[kWkBlocks], hi[kWkBlocks];
};
__device__ __forceinline__ void load_wk_fragments(const bf16_t* __restrict__ wk, int j, WkFragments& f) {
  const int lane = j % 32, warp = j / 32, g = lane >> 2, q = lane & 3;
  const bf16_t* w_lo = wk + static_cast<int64_t>(16 * warp + g) * kPrepHeadDim + 8 * q;
#pragma unroll
  for (int b = 0; b < kWkBlocks; ++b) {
    f.lo[b] = __ldg(reinterpret_cast<const uint4*>(w_lo + b * kGemmBlock));
    f.hi[b] = __ldg(reinterpret_cast<const uint4*>(w_lo + 8 * kPrepHeadDim + b * kGemmBlock));
  }
}
__device__ __forceinline__ void wk_row(const WkFragments& f, const bf16_t* latent_row, bf16_t* kproj_row, int j) {
  const int lane = j % 32, warp = j / 32, g = lane >> 2, q = lane & 3;
  uint4 x[kWkBlocks];  // token 0 = the row (lanes g == 0); token rows 1..7 zero
#pragma unroll
  for (int b = 0; b < kWkBlocks; ++b)
    x[b] = g == 0 ? *reinterpret_cast<const uint4*>(latent_row + b * kGemmBlock + 8 * q) : make_uint4(0u, 0u, 0u, 0u);
  const float zero4[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  float total[2] = {0.0f, 0.0f}, split_sum[2] = {0.0f, 0.0f};
#pragma unroll
  for (int b = 0; b < kWkBlocks; ++b) {
    const uint32_t a0[4] = {f.lo[b].x, f.hi[b].x, f.lo[b].y, f.hi[b].y}, a1[4] = {f.lo[b].z, f.hi[b].z, f.lo[b].w, f.hi[b].w};
    float d[4];
    hopper::mma_m16n8k16<false>(d, a0, x[b].x, x[b].y, zero4);  // elements 8q + 0..3 of the block
    hopper::mma_m16n8k16<false>(d, a1, x[b].z, x[b].w, d);      // elements 8q + 4..7: d = block sum
    // token 0 = column 0: d[0] (row g) and d[2] (row g + 8) of the lanes q == 0
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float part = num::add_rn(0.0f, d[2 * h]);  // v5's warp accumulator over its one block
      split_sum[h] = b % kWkPartsPerSplit == 0 ? part : num::add_rn(split_sum[h], part);  // warps in order
      if (b % kWkPartsPerSplit == kWkPartsPerSplit - 1)
        total[h] = b < kWkPartsPerSplit ? split_sum[h] : num::add_rn(total[h], split_sum[h]);  // splits in order
    }
  }
  if (q == 0) {
    kproj_row[16 * warp + g] = num::bf16_from_f32(total[0]);
    kproj_row[16 * warp + g + 8] = num::bf16_from_f32(total[1]);
  }
}

// The compressor's part of a row by the fused kernel's 256 threads (thread j = pair j).
__device__ __forceinline__ void compressor_row(const C2FusedParams& p, int t, int j, float* pooled_row) {
  c2_row(p, t, j, pooled_row);
}
__device__ __forceinline__ void compressor_row(const C1FusedParams& p, int t, int j, float*) { c1_pair(p, t, j); }

// Row t: the compressor's row (c1 or c2); then, when the row stores an index key (the index-K
// store's own test; CTA-uniform), the wk GEMM of the row from latent_pre_rope[t] as it is in global
// memory after the compressor (this launch's latent, or an earlier step's for rows it did not write:
// the unfused chain reads the same) into kproj[t], and the index-K store's pairs (warps 0, 1), which
// also count its errors.
template <class CP>
__device__ __forceinline__ void index_fused_row(const CP& c, const bf16_t* wk, const IndexKStoreParams& ik) {
  __shared__ __align__(16) float pooled_row[kPrepHeadDim];
  const int t = static_cast<int>(blockIdx.x), j = static_cast<int>(threadIdx.x);
  const bool stores = detail::index_k_row_verdict(ik, t) == detail::PagedRow::kWrite;  // step metadata
  WkFragments f;
  if (stores) load_wk_fragments(wk, j, f);
  compressor_row(c, t, j, pooled_row);
  if (stores) {  // CTA-uniform
    dev::pdl_wait();  // rows the compressor left before its wait: an earlier step's latent
    __syncthreads();  // the CTA's latent stores are visible to all its threads
    wk_row(f, c.latent_pre_rope + static_cast<int64_t>(t) * c.latent_row_stride,
           const_cast<bf16_t*>(ik.kproj) + static_cast<int64_t>(t) * ik.kproj_row_stride, j);
    __syncthreads();  // kproj[t] is complete
  }
  if (j < detail::index_k::kThreads) detail::index_k_store_pair<false>(ik, t, j);
  dev::pdl_launch_dependents();  // after this thread's last store
}
__global__ void __launch_bounds__(kC2Threads, 1) c2_index_fused_kernel(const __grid_constant__ C2IndexFusedParams p) {
  index_fused_row(p.c2, p.wk, p.ik);
}
__global__ void __launch_bounds__(kC2Threads, 1) c1_index_fused_kernel(const __grid_constant__ C1IndexFusedParams p) {
  index_fused_row(p.c1, p.wk, p.ik);
}

void require_latent(const bf16_t* latent, int64_t stride, const char* who) {
  detail::require_ptr(latent, who, "latent_pre_rope");
  detail::require_aligned(latent, 16, who, "latent_pre_rope");
  detail::require(stride >= kPrepHeadDim && stride % detail::kChunk == 0, who,
                  "latent_row_stride " + std::to_string(stride) + " must be >= 512 and a multiple of 8");
}

LaunchConfig row_config(int64_t ctas, int threads, cudaStream_t stream, bool pdl) {
  LaunchConfig cfg;
  cfg.grid = dim3(static_cast<unsigned>(ctas), 1, 1);
  cfg.block = dim3(static_cast<unsigned>(threads), 1, 1);
  cfg.stream = stream;
  cfg.pdl = pdl;
  return cfg;
}

}  // namespace

namespace {
// run_c1_fused's argument checks (also the fused tail's); false: N == 0, nothing to launch.
bool require_c1(const C1FusedParams& p, const char* who) {
  using detail::require;
  require(p.N >= 0, who, "negative N");
  require(p.N <= (1 << 30), who, "N " + std::to_string(p.N) + " exceeds the grid limit (2 CTAs per row)");
  require(p.proj_row_stride >= kPrepHeadDim && p.proj_row_stride % detail::kChunk == 0, who,
          "proj_row_stride " + std::to_string(p.proj_row_stride) + " must be >= 512 and a multiple of 8");
  detail::require_cache(p.layout, CacheKind::kCompressedFp4, p.cache, p.n_slots, who);
  if (p.N == 0) return false;
  detail::require_ptr(p.proj, who, "proj");
  detail::require_aligned(p.proj, 16, who, "proj");
  detail::require_ptr(p.c_norm, who, "c_norm");
  detail::require_aligned(p.c_norm, 16, who, "c_norm");
  detail::require_ptr(p.pos, who, "pos");
  detail::require_ptr(p.out_loc, who, "out_loc");
  detail::require_table(p.table, p.max_pos, who);
  require_latent(p.latent_pre_rope, p.latent_row_stride, who);
  return true;
}
// The fused tails' own checks: rows, the index-K arguments, the wk weights, v5's plan for wk.
void require_index_fused(int n, const bf16_t* wk, const IndexKStoreParams& ik, const char* who) {
  detail::require(ik.N == n, who, "ik.N " + std::to_string(ik.N) + " != the compressor's N " + std::to_string(n));
  detail::require_index_k_store(ik, who);
  // The fused sums are GEMM v5's only while v5 splits (128, 512) this way (gemm_skinny.cu's plan, a
  // function of the shape only: checked once).
  static const bool v5_plan_ok = plan_gemm_skinny(1, kPrepIndexDim, kPrepHeadDim, 1, false).splits == kWkSplits;
  if (!v5_plan_ok)
    throw std::logic_error(std::string(who) + ": GEMM v5's plan for wk changed; the fused sums would differ");
  if (n == 0) return;
  detail::require_ptr(wk, who, "wk");
  detail::require_aligned(wk, 16, who, "wk");
}
}  // namespace

void run_c1_fused(const C1FusedParams& p, cudaStream_t stream, bool pdl) {
  if (!require_c1(p, "run_c1_fused")) return;
  launch_kernel("c1_fused", c1_fused_kernel,
                row_config(static_cast<int64_t>(p.N) * kC1CtasPerRow, kC1Threads, stream, pdl), p);
}

void run_c1_index_fused(const C1IndexFusedParams& p, cudaStream_t stream, bool pdl) {
  const char* who = "run_c1_index_fused";
  require_index_fused(p.c1.N, p.wk, p.ik, who);
  if (!require_c1(p.c1, who)) return;
  launch_kernel("c1_index_fused", c1_index_fused_kernel, row_config(p.c1.N, kC2Threads, stream, pdl), p);
}

namespace {
// run_c2_fused's argument checks (also the fused tail's); false: N == 0, nothing to launch.
bool require_c2(const C2FusedParams& p, const char* who) {
  using detail::require;
  require(p.N >= 0, who, "negative N");
  require(p.kvs_row_stride >= kKvsRow && p.kvs_row_stride % 4 == 0, who,
          "kvs_row_stride " + std::to_string(p.kvs_row_stride) + " must be >= 1024 and a multiple of 4");
  require(p.state_rows > 0, who, "state_rows must be > 0");
  detail::require_cache(p.layout, CacheKind::kCompressedFp4, p.cache, p.n_slots, who);
  if (p.N == 0) return false;
  detail::require_ptr(p.kvs, who, "kvs");
  detail::require_aligned(p.kvs, 16, who, "kvs");
  detail::require_ptr(p.pos, who, "pos");
  detail::require_ptr(p.state_row, who, "state_row");
  detail::require_ptr(p.partner_state_row, who, "partner_state_row");
  detail::require_ptr(p.prev_row, who, "prev_row");
  detail::require_ptr(p.state, who, "state");
  detail::require_aligned(p.state, 16, who, "state");
  detail::require_ptr(p.c_norm, who, "c_norm");
  detail::require_aligned(p.c_norm, 16, who, "c_norm");
  detail::require_ptr(p.out_loc, who, "out_loc");
  detail::require_table(p.table, p.max_pos, who);
  require_latent(p.latent_pre_rope, p.latent_row_stride, who);
  return true;
}
}  // namespace

void run_c2_fused(const C2FusedParams& p, cudaStream_t stream, bool pdl) {
  if (!require_c2(p, "run_c2_fused")) return;
  launch_kernel("c2_fused", c2_fused_kernel, row_config(p.N, kC2Threads, stream, pdl), p);
}

void run_c2_index_fused(const C2IndexFusedParams& p, cudaStream_t stream, bool pdl) {
  const char* who = "run_c2_index_fused";
  require_index_fused(p.c2.N, p.wk, p.ik, who);
  if (!require_c2(p.c2, who)) return;
  launch_kernel("c2_index_fused", c2_index_fused_kernel, row_config(p.c2.N, kC2Threads, stream, pdl), p);
}

}  // namespace v4attn::kernels
