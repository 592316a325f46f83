// Compressor tails (spec 3.3), decode and target-verify alike: c1 fused (ratio 1) and c2 fused
// (ratio 2). Twins of ref::c1_fused and ref::c2_fused. Both end in the V41_FP4 compressed-KV store
// (FP4 KV quant, block 16, e4m3 scales) of the latent roped at the group position g.
//
// Grid ceil(N / 2), block 64 threads: one warp per row (warp w of CTA b owns row 2b + w); lane l
// holds latent dims [8l, 8l+8) and [256+8l, 256+8l+8) (LaneSum chunks l and l+32; see
// prepare_common.cuh). Rows are independent, so any N works (decode, verify, padded buckets).
//
// PDL, both kernels: before dev::pdl_wait() a warp reads only step metadata (pos, out_loc, state
// rows, prev_row: host-copied before the step, see prepare_kernels.h) and constants (c_norm, the
// table row). The wait precedes the first load of the GEMM output (proj / kvs) and, for c2, every
// access to the pair state (the previous step's c2 launch wrote it; PDL chains do not promise
// that kernels before our predecessor have finished until the wait returns). The trigger follows
// each lane's last store.
#include "v4attn/kernels/prepare_kernels.h"

#include <string>

#include "kernels/prepare_common.cuh"
#include "runtime/launch.h"

namespace v4attn::kernels {

namespace {

constexpr int kRowsPerCta = 2;
constexpr int kThreads = 32 * kRowsPerCta;
constexpr int kHalf = kPrepHeadDim / 2;                                           // 256
constexpr int kTailFirstLane = (kPrepHeadDim - num::kRopeDim - kHalf) / detail::kChunk;  // 24
constexpr int kKvsRow = 2 * kPrepHeadDim;                                         // kv | score
static_assert(kTailFirstLane == 24, "lanes 24..31 hold dims 448..511 in their second chunk");

// Loads the 8-float table chunk of a tail lane for RoPE at position g (zeros elsewhere).
__device__ __forceinline__ void load_tail_table(const float* table, int32_t g, int lane, float (&cs)[detail::kChunk]) {
#pragma unroll
  for (int k = 0; k < detail::kChunk; ++k) cs[k] = 0.0f;
  if (lane >= kTailFirstLane)
    detail::ldg_f32x8(table + static_cast<int64_t>(g) * num::kRopeDim + (lane - kTailFirstLane) * detail::kChunk, cs);
}

// latent (bf16-exact values of the warp's row, pre-RoPE) -> RoPE on the tail lanes -> FP4 store at
// loc when 0 < loc < n_slots (>= n_slots: counted). Warp-uniform control flow.
__device__ __forceinline__ void rope_and_store(float (&x)[2][detail::kChunk], const float (&cs)[detail::kChunk],
                                               int lane, int32_t loc, const CacheLayout& layout, uint8_t* cache,
                                               int64_t n_slots, unsigned long long* err_count) {
  if (loc <= 0) return;  // no group slot (padded row or not completing)
  if (loc >= n_slots) {
    if (lane == 0) dev::count_error(err_count);
    return;
  }
  if (lane >= kTailFirstLane) detail::rope_chunk(x[1], cs);
  detail::store_latent_fp4(x, lane, layout, cache, loc);
}

// ---- c1 fused -------------------------------------------------------------------------------------
// Row t: latent = RMSNorm(proj[t], c_norm) -> latent_pre_rope[t] (every row, the padded ones too,
// like the reference); RoPE at g = pos[t]; FP4 store at out_loc[t].
__global__ void __launch_bounds__(kThreads) c1_fused_kernel(const __grid_constant__ C1FusedParams p) {
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int t = static_cast<int>(blockIdx.x) * kRowsPerCta + static_cast<int>(threadIdx.x) / 32;
  if (t >= p.N) return;

  const int32_t pos = p.pos[t];
  if (pos < 0 || pos >= p.max_pos) {  // refused on the host by the reference; here the row is skipped
    if (lane == 0) dev::count_error(p.err_count);
    return;
  }
  const int32_t loc = p.out_loc[t];
  float w[2][detail::kChunk], cs[detail::kChunk];
  detail::ldg_f32x8(p.c_norm + detail::kChunk * lane, w[0]);
  detail::ldg_f32x8(p.c_norm + kHalf + detail::kChunk * lane, w[1]);
  load_tail_table(p.table, pos, lane, cs);

  dev::pdl_wait();  // proj is the wkv_c GEMM's output

  const bf16_t* row = p.proj + static_cast<int64_t>(t) * p.proj_row_stride;
  float x[2][detail::kChunk];
  detail::load_bf16x8(row + detail::kChunk * lane, x[0]);
  detail::load_bf16x8(row + kHalf + detail::kChunk * lane, x[1]);
  const float r = num::rmsnorm_rstd(dev::warp_lane_sum(detail::lane_sum_squares_part<2>(x)), kPrepHeadDim, p.eps);
  detail::rmsnorm_apply_chunk(x[0], r, w[0]);
  detail::rmsnorm_apply_chunk(x[1], r, w[1]);
  bf16_t* latent = p.latent_pre_rope + static_cast<int64_t>(t) * p.latent_row_stride;
  detail::store_bf16x8(latent + detail::kChunk * lane, x[0]);
  detail::store_bf16x8(latent + kHalf + detail::kChunk * lane, x[1]);
  rope_and_store(x, cs, lane, loc, p.layout, p.cache, p.n_slots, p.err_count);

  dev::pdl_launch_dependents();  // after this lane's last store
}

// ---- c2 fused -------------------------------------------------------------------------------------
// Row t (warp-uniform branches):
//  - state_row < 0: padded, returns before touching anything;
//  - even pos: parks kvs[t] (all 1024 floats) in state[state_row] (lane l copies the 8-float
//    pieces l, l+32, l+64, l+96); no latent, no store;
//  - odd pos: partner = kvs[prev_row] (the INPUT row of the partner when it is in this batch; its
//    own warp may be parking it into the state concurrently, which is why the state is never read
//    for it) else state[partner_state_row]; pooled[d] = pair_softmax_pool(partner, self),
//    bf16-rounded; latent = RMSNorm(pooled, c_norm) -> latent_pre_rope[t]; RoPE at g = pos - 1;
//    FP4 store at out_loc[t]. Odd rows do not write the state (ref::c2_fused parks even rows only).
// Race freedom needs the reference's step invariant (build_step_meta guarantees it, ref::c2_fused
// refuses violations): no state row is parked twice, or parked and read as a partner, in one
// step. Then every state read sees the state from before the launch, as in the reference.
// Device-side containment of metadata the reference refuses (state row >= state_rows, pos outside
// the table, prev_row outside [0, N) or == t, partner state row outside the state): the row is
// skipped entirely and counted.
__global__ void __launch_bounds__(kThreads) c2_fused_kernel(const __grid_constant__ C2FusedParams p) {
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int t = static_cast<int>(blockIdx.x) * kRowsPerCta + static_cast<int>(threadIdx.x) / 32;
  if (t >= p.N) return;

  const int32_t srow = p.state_row[t];
  if (srow < 0) return;  // padded row: writes nothing at all
  const int32_t pos = p.pos[t];
  if (srow >= p.state_rows || pos < 0 || pos >= p.max_pos) {
    if (lane == 0) dev::count_error(p.err_count);
    return;
  }
  const float* self = p.kvs + static_cast<int64_t>(t) * p.kvs_row_stride;

  if ((pos & 1) == 0) {  // park (kv, score) for the partner-to-come
    dev::pdl_wait();     // kvs is the GEMM's output; the state row may be read by earlier kernels
    float* dst = p.state + static_cast<int64_t>(srow) * kKvsRow;
#pragma unroll
    for (int i = 0; i < kKvsRow / (32 * detail::kChunk); ++i) {
      float v[detail::kChunk];
      const int off = (i * 32 + lane) * detail::kChunk;
      detail::load_f32x8(self + off, v);
      detail::store_f32x8(dst + off, v);
    }
    dev::pdl_launch_dependents();
    return;
  }

  const int32_t prev = p.prev_row[t];
  const int32_t partner_srow = p.partner_state_row[t];
  const bool partner_ok = prev >= 0 ? (prev < p.N && prev != t) : (partner_srow >= 0 && partner_srow < p.state_rows);
  if (!partner_ok) {
    if (lane == 0) dev::count_error(p.err_count);
    return;
  }
  const int32_t g = pos - 1;  // >= 0: pos is odd
  const int32_t loc = p.out_loc[t];
  float w[2][detail::kChunk], cs[detail::kChunk];
  detail::ldg_f32x8(p.c_norm + detail::kChunk * lane, w[0]);
  detail::ldg_f32x8(p.c_norm + kHalf + detail::kChunk * lane, w[1]);
  load_tail_table(p.table, g, lane, cs);

  dev::pdl_wait();  // kvs (GEMM output) and the pair state (previous step) are read below

  const float* partner = prev >= 0 ? p.kvs + static_cast<int64_t>(prev) * p.kvs_row_stride
                                   : p.state + static_cast<int64_t>(partner_srow) * kKvsRow;
  float x[2][detail::kChunk];
#pragma unroll
  for (int c = 0; c < 2; ++c) {
    const int d0 = c * kHalf + detail::kChunk * lane;
    float kv_a[detail::kChunk], s_a[detail::kChunk], kv_b[detail::kChunk], s_b[detail::kChunk];
    detail::load_f32x8(partner + d0, kv_a);
    detail::load_f32x8(partner + kPrepHeadDim + d0, s_a);
    detail::load_f32x8(self + d0, kv_b);
    detail::load_f32x8(self + kPrepHeadDim + d0, s_b);
#pragma unroll
    for (int k = 0; k < detail::kChunk; ++k)
      x[c][k] = num::round_bf16(num::pair_softmax_pool(kv_a[k], s_a[k], kv_b[k], s_b[k]));  // a = even = partner
  }
  const float r = num::rmsnorm_rstd(dev::warp_lane_sum(detail::lane_sum_squares_part<2>(x)), kPrepHeadDim, p.eps);
  detail::rmsnorm_apply_chunk(x[0], r, w[0]);
  detail::rmsnorm_apply_chunk(x[1], r, w[1]);
  bf16_t* latent = p.latent_pre_rope + static_cast<int64_t>(t) * p.latent_row_stride;
  detail::store_bf16x8(latent + detail::kChunk * lane, x[0]);
  detail::store_bf16x8(latent + kHalf + detail::kChunk * lane, x[1]);
  rope_and_store(x, cs, lane, loc, p.layout, p.cache, p.n_slots, p.err_count);

  dev::pdl_launch_dependents();  // after this lane's last store
}

void require_latent(const bf16_t* latent, int64_t stride, const char* who) {
  detail::require_ptr(latent, who, "latent_pre_rope");
  detail::require_aligned(latent, 16, who, "latent_pre_rope");
  detail::require(stride >= kPrepHeadDim && stride % detail::kChunk == 0, who,
                  "latent_row_stride " + std::to_string(stride) + " must be >= 512 and a multiple of 8");
}

LaunchConfig row_warp_config(int rows, cudaStream_t stream, bool pdl) {
  LaunchConfig cfg;
  cfg.grid = dim3(static_cast<unsigned>((rows + kRowsPerCta - 1) / kRowsPerCta), 1, 1);
  cfg.block = dim3(kThreads, 1, 1);
  cfg.stream = stream;
  cfg.pdl = pdl;
  return cfg;
}

}  // namespace

void run_c1_fused(const C1FusedParams& p, cudaStream_t stream, bool pdl) {
  using detail::require;
  const char* who = "run_c1_fused";
  require(p.N >= 0, who, "negative N");
  require(p.proj_row_stride >= kPrepHeadDim && p.proj_row_stride % detail::kChunk == 0, who,
          "proj_row_stride " + std::to_string(p.proj_row_stride) + " must be >= 512 and a multiple of 8");
  detail::require_cache(p.layout, CacheKind::kCompressedFp4, p.cache, p.n_slots, who);
  if (p.N == 0) return;
  detail::require_ptr(p.proj, who, "proj");
  detail::require_aligned(p.proj, 16, who, "proj");
  detail::require_ptr(p.c_norm, who, "c_norm");
  detail::require_aligned(p.c_norm, 16, who, "c_norm");
  detail::require_ptr(p.pos, who, "pos");
  detail::require_ptr(p.out_loc, who, "out_loc");
  detail::require_table(p.table, p.max_pos, who);
  require_latent(p.latent_pre_rope, p.latent_row_stride, who);
  launch_kernel("c1_fused", c1_fused_kernel, row_warp_config(p.N, stream, pdl), p);
}

void run_c2_fused(const C2FusedParams& p, cudaStream_t stream, bool pdl) {
  using detail::require;
  const char* who = "run_c2_fused";
  require(p.N >= 0, who, "negative N");
  require(p.kvs_row_stride >= kKvsRow && p.kvs_row_stride % 4 == 0, who,
          "kvs_row_stride " + std::to_string(p.kvs_row_stride) + " must be >= 1024 and a multiple of 4");
  require(p.state_rows > 0, who, "state_rows must be > 0");
  detail::require_cache(p.layout, CacheKind::kCompressedFp4, p.cache, p.n_slots, who);
  if (p.N == 0) return;
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
  launch_kernel("c2_fused", c2_fused_kernel, row_warp_config(p.N, stream, pdl), p);
}

}  // namespace v4attn::kernels
