// Window-K store (spec 3.2): kv rows (the kv columns of the fused wq_a|wkv GEMM output) ->
// RMSNorm(kv_norm) -> RoPE at pos on dims 448..511 -> FP8 quant -> paged window cache at swa_loc.
// Twin of ref::window_k_store (the GPU has no kv_out debugging output).
//
// Grid ceil(T / 2), block 64 threads: one warp per row (warp w of CTA b owns row 2b + w). Lane l
// holds dims [8l, 8l+8) and [256+8l, 256+8l+8) (the LaneSum chunks l and l+32, see
// prepare_common.cuh), so the sum of squares is the reference's order exactly. Lanes 24..31 own the
// RoPE tail in their second chunk (dims 448 + 8(l-24) .. +8).
//  - V41: 16 blocks of 32 = 4 lanes per block; lane l stores its 8 codes at bytes 8l and 256+8l,
//    lane 4j stores the scales of blocks j and 8+j.
//  - V4: dims 0..447 in 7 blocks of 64 = 8 lanes per block (blocks 0..3 from first chunks,
//    4..6 from the second chunks of lanes 0..23); lanes 24..31 store the bf16 tail (16 bytes each
//    at 448 + 16(l-24)); lane 24 writes the zero pad byte after the 7 scales.
//
// PDL: before dev::pdl_wait() the warp reads swa_loc[t] and pos[t] (step metadata, written by a
// host copy that precedes the QA GEMM; see prepare_kernels.h) and the constant kv_norm weights and
// table row. It waits before the first load of the kv row (the QA GEMM output) and triggers its
// dependents after its cache stores. Rows that store nothing return without waiting: they read
// nothing the predecessor writes.
#include "v4attn/kernels/prepare_kernels.h"

#include <string>

#include "kernels/prepare_common.cuh"
#include "runtime/launch.h"

namespace v4attn::kernels {

namespace {

constexpr int kRowsPerCta = 2;
constexpr int kThreads = 32 * kRowsPerCta;
constexpr int kNope = kPrepHeadDim - num::kRopeDim;                  // 448
constexpr int kTailFirstLane = (kNope - kPrepHeadDim / 2) / detail::kChunk;  // 24
static_assert(kTailFirstLane == 24, "lanes 24..31 hold dims 448..511 in their second chunk");

__global__ void __launch_bounds__(kThreads) window_k_store_kernel(const __grid_constant__ WindowKStoreParams p) {
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int t = static_cast<int>(blockIdx.x) * kRowsPerCta + static_cast<int>(threadIdx.x) / 32;
  if (t >= p.T) return;

  // Step metadata and constants only.
  const int32_t loc = p.swa_loc[t];
  if (loc < 0) return;  // no write (the reference's norm has no other output on the GPU side)
  if (loc >= p.n_slots) {  // skipped and counted, like the reference's `skipped`
    if (lane == 0) dev::count_error(p.err_count);
    return;
  }
  const int32_t pos = p.pos[t];
  if (pos < 0 || pos >= p.max_pos) {  // refused on the host by the reference; contained here
    if (lane == 0) dev::count_error(p.err_count);
    return;
  }
  float w[2][detail::kChunk];
  detail::ldg_f32x8(p.kv_norm + detail::kChunk * lane, w[0]);
  detail::ldg_f32x8(p.kv_norm + kPrepHeadDim / 2 + detail::kChunk * lane, w[1]);
  const bool tail_lane = lane >= kTailFirstLane;
  float cs[detail::kChunk] = {};
  if (tail_lane)
    detail::ldg_f32x8(p.table + static_cast<int64_t>(pos) * num::kRopeDim + (lane - kTailFirstLane) * detail::kChunk, cs);

  dev::pdl_wait();  // the kv row is the QA GEMM's output

  const bf16_t* row = p.kv + static_cast<int64_t>(t) * p.kv_row_stride;
  float x[2][detail::kChunk];
  detail::load_bf16x8(row + detail::kChunk * lane, x[0]);
  detail::load_bf16x8(row + kPrepHeadDim / 2 + detail::kChunk * lane, x[1]);

  const float sum_sq = dev::warp_lane_sum(detail::lane_sum_squares_part<2>(x));
  const float r = num::rmsnorm_rstd(sum_sq, kPrepHeadDim, p.eps);
  detail::rmsnorm_apply_chunk(x[0], r, w[0]);
  detail::rmsnorm_apply_chunk(x[1], r, w[1]);
  if (tail_lane) detail::rope_chunk(x[1], cs);

  uint8_t* data = p.cache + p.layout.data_offset(loc);
  uint8_t* scales = p.cache + p.layout.scale_offset(loc);
  if (p.kind == CacheKind::kWindowV41) {
    int e0, e1;
    const uint2 c0 = detail::act_quant_chunk<4>(x[0], e0);  // block l/4
    const uint2 c1 = detail::act_quant_chunk<4>(x[1], e1);  // block 8 + l/4
    *reinterpret_cast<uint2*>(data + detail::kChunk * lane) = c0;
    *reinterpret_cast<uint2*>(data + kPrepHeadDim / 2 + detail::kChunk * lane) = c1;
    if (lane % 4 == 0) {
      scales[lane / 4] = num::ue8m0_from_exp(e0);
      scales[8 + lane / 4] = num::ue8m0_from_exp(e1);
    }
  } else {  // kWindowV4
    int e0, e1;
    const uint2 c0 = detail::act_quant_chunk<8>(x[0], e0);  // block l/8 (0..3)
    // Every lane joins the shuffles; lanes 24..31 (the bf16 tail) discard their codes.
    const uint2 c1 = detail::act_quant_chunk<8>(x[1], e1);  // block 4 + l/8 (4..6) for l < 24
    *reinterpret_cast<uint2*>(data + detail::kChunk * lane) = c0;
    if (lane % 8 == 0) scales[lane / 8] = num::ue8m0_from_exp(e0);
    if (!tail_lane) {
      *reinterpret_cast<uint2*>(data + kPrepHeadDim / 2 + detail::kChunk * lane) = c1;
      if (lane % 8 == 0) scales[4 + lane / 8] = num::ue8m0_from_exp(e1);
    } else {
      *reinterpret_cast<uint4*>(data + kNope + 2 * detail::kChunk * (lane - kTailFirstLane)) = detail::pack_bf16x8(x[1]);
      if (lane == kTailFirstLane) scales[kNope / 64] = 0;  // the pad byte after the 7 scales
    }
  }

  dev::pdl_launch_dependents();  // after this lane's last store
}

}  // namespace

void run_window_k_store(const WindowKStoreParams& p, cudaStream_t stream, bool pdl) {
  using detail::require;
  const char* who = "run_window_k_store";
  require(p.T >= 0, who, "negative T");
  require(p.kind == CacheKind::kWindowV41 || p.kind == CacheKind::kWindowV4, who, "kind must be kWindowV41 or kWindowV4");
  require(p.kv_row_stride >= kPrepHeadDim && p.kv_row_stride % detail::kChunk == 0, who,
          "kv_row_stride " + std::to_string(p.kv_row_stride) + " must be >= 512 and a multiple of 8");
  detail::require_cache(p.layout, p.kind, p.cache, p.n_slots, who);
  if (p.T == 0) return;
  detail::require_ptr(p.kv, who, "kv");
  detail::require_aligned(p.kv, 16, who, "kv");
  detail::require_ptr(p.kv_norm, who, "kv_norm");
  detail::require_aligned(p.kv_norm, 16, who, "kv_norm");
  detail::require_ptr(p.pos, who, "pos");
  detail::require_ptr(p.swa_loc, who, "swa_loc");
  detail::require_table(p.table, p.max_pos, who);

  LaunchConfig cfg;
  cfg.grid = dim3(static_cast<unsigned>((p.T + kRowsPerCta - 1) / kRowsPerCta), 1, 1);
  cfg.block = dim3(kThreads, 1, 1);
  cfg.stream = stream;
  cfg.pdl = pdl;
  launch_kernel("window_k_store", window_k_store_kernel, cfg, p);
}

}  // namespace v4attn::kernels
