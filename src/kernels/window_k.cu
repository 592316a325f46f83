// Window-K store (spec 3.2): kv rows (the kv columns of the fused wq_a|wkv GEMM output) ->
// RMSNorm(kv_norm) -> RoPE at pos on dims 448..511 -> FP8 quant -> paged window cache at swa_loc.
// Twin of ref::window_k_store (the GPU has no kv_out debugging output).
//
// Grid 2T CTAs of 128 threads, pair per thread (prepare_common.cuh): CTA 2t + h owns pairs
// 128h .. 128h+127 of row t, thread j dims 2j, 2j+1 (j in 0..255). Each warp computes the row's
// RMSNorm sum of squares itself in the LaneSum order (detail::warp_row_sum_squares), so the two
// CTAs of a row never talk. Warp 7 of the row (j >= 224, dims 448..511) holds the RoPE tail.
//  - V41: 16 blocks of 32 = 16 lanes per block; thread j stores its 2 codes at bytes 2j, 2j+1,
//    thread 16b stores scale b.
//  - V4: dims 0..447 in 7 blocks of 64 = one warp per block (warps 0..6 of the row, lane 0
//    stores the scale); warp 7 stores the bf16 tail (4 bytes per thread at 448 + 4(j - 224)),
//    thread 224 the zero pad byte after the 7 scales.
// (The previous version walked each row with one warp, 16 dims per lane: a few rows left the GPU
// idle behind long exact-numerics chains.)
//
// PDL: before dev::pdl_wait() a thread reads swa_loc[t] and pos[t] (step metadata, written by a
// host copy that precedes the QA GEMM; see prepare_kernels.h; both loads in flight together) and
// the constant kv_norm weights and table entry. It waits before the first load of the kv row (the
// QA GEMM output) and triggers its dependents after its cache stores. Rows that store nothing
// return without waiting: they read nothing the predecessor writes. Errors are counted once per
// row (by the thread of pair 0).
#include "v4attn/kernels/prepare_kernels.h"

#include <string>

#include "kernels/prepare_common.cuh"
#include "runtime/launch.h"

namespace v4attn::kernels {

namespace {

constexpr int kNope = kPrepHeadDim - num::kRopeDim;        // 448
constexpr int kPairs = kPrepHeadDim / 2;                   // 256
constexpr int kTailFirstPair = kNope / 2;                  // 224: warp 7 of the row
constexpr int kThreads = 128;
constexpr int kCtasPerRow = kPairs / kThreads;             // 2
constexpr int kV41BlockPairs = num::kActQuantBlock / 2;    // 16 lanes per V41 block
constexpr int kV4BlockPairs = 64 / 2;                      // 32: one warp per V4 block
static_assert(kTailFirstPair % 32 == 0, "the RoPE / bf16 tail pairs are a whole warp (uniform branch)");
static_assert(kPairs % kThreads == 0 && kThreads % 32 == 0, "whole warps, whole CTAs per row");

__global__ void __launch_bounds__(kThreads) window_k_store_kernel(const __grid_constant__ WindowKStoreParams p) {
  const int t = static_cast<int>(blockIdx.x / kCtasPerRow);
  const int j = static_cast<int>(blockIdx.x % kCtasPerRow) * kThreads + static_cast<int>(threadIdx.x);
  const int lane = static_cast<int>(threadIdx.x) % 32;

  // Step metadata and constants only.
  const int32_t loc = p.swa_loc[t];
  const int32_t pos = p.pos[t];
  if (loc < 0) return;  // no write (the reference's norm has no other output on the GPU side)
  if (loc >= p.n_slots) {  // skipped and counted, like the reference's `skipped`
    if (j == 0) dev::count_error(p.err_count);
    return;
  }
  if (pos < 0 || pos >= p.max_pos) {  // refused on the host by the reference; contained here
    if (j == 0) dev::count_error(p.err_count);
    return;
  }
  const bool tail = j >= kTailFirstPair;
  const float2 w = detail::ldg_f32x2(p.kv_norm + 2 * j);
  const float2 cs = tail ? detail::ldg_f32x2(p.table + static_cast<int64_t>(pos) * num::kRopeDim + 2 * (j - kTailFirstPair))
                         : make_float2(0.0f, 0.0f);

  dev::pdl_wait();  // the kv row is the QA GEMM's output

  const bf16_t* row = p.kv + static_cast<int64_t>(t) * p.kv_row_stride;
  float x0, x1;
  detail::load_bf16x2(row + 2 * j, x0, x1);
  const float r = num::rmsnorm_rstd(detail::warp_row_sum_squares<kPrepHeadDim>(row, lane), kPrepHeadDim, p.eps);
  detail::rmsnorm_apply_pair(x0, x1, r, w);
  if (tail) detail::rope_pair(x0, x1, cs);

  uint8_t* data = p.cache + p.layout.data_offset(loc);
  uint8_t* scales = p.cache + p.layout.scale_offset(loc);
  if (p.kind == CacheKind::kWindowV41) {
    const int e = num::act_quant_scale_exp(detail::lane_group_max<kV41BlockPairs>(detail::pair_amax(x0, x1)));
    *reinterpret_cast<uint16_t*>(data + 2 * j) = detail::act_quant_code_pair(x0, x1, num::pow2_f32(e));
    if (j % kV41BlockPairs == 0) scales[j / kV41BlockPairs] = num::ue8m0_from_exp(e);
  } else if (!tail) {  // kWindowV4, dims 0..447: block j / 32 is this warp
    const int e = num::act_quant_scale_exp(detail::lane_group_max<kV4BlockPairs>(detail::pair_amax(x0, x1)));
    *reinterpret_cast<uint16_t*>(data + 2 * j) = detail::act_quant_code_pair(x0, x1, num::pow2_f32(e));
    if (j % kV4BlockPairs == 0) scales[j / kV4BlockPairs] = num::ue8m0_from_exp(e);
  } else {  // kWindowV4, the roped bf16 tail (little-endian, even element first)
    *reinterpret_cast<uint32_t*>(data + kNope + 4 * (j - kTailFirstPair)) = detail::pack_bf16x2(x0, x1);
    if (j == kTailFirstPair) scales[kNope / 64] = 0;  // the pad byte after the 7 scales
  }

  dev::pdl_launch_dependents();  // after this thread's last store
}

}  // namespace

void run_window_k_store(const WindowKStoreParams& p, cudaStream_t stream, bool pdl) {
  using detail::require;
  const char* who = "run_window_k_store";
  require(p.T >= 0, who, "negative T");
  require(p.T <= (1 << 30), who, "T " + std::to_string(p.T) + " exceeds the grid limit (2 CTAs per row)");
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
  cfg.grid = dim3(static_cast<unsigned>(static_cast<int64_t>(p.T) * kCtasPerRow), 1, 1);
  cfg.block = dim3(kThreads, 1, 1);
  cfg.stream = stream;
  cfg.pdl = pdl;
  launch_kernel("window_k_store", window_k_store_kernel, cfg, p);
}

}  // namespace v4attn::kernels
