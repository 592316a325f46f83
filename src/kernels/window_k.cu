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
#include "kernels/window_k_device.cuh"
#include "runtime/launch.h"

namespace v4attn::kernels {

namespace {

constexpr int kThreads = 128;
constexpr int kCtasPerRow = detail::window_k::kPairs / kThreads;  // 2
static_assert(detail::window_k::kPairs % kThreads == 0 && kThreads % 32 == 0, "whole warps, whole CTAs per row");

__global__ void __launch_bounds__(kThreads) window_k_store_kernel(const __grid_constant__ WindowKStoreParams p) {
  const int t = static_cast<int>(blockIdx.x / kCtasPerRow);
  const int j = static_cast<int>(blockIdx.x % kCtasPerRow) * kThreads + static_cast<int>(threadIdx.x);
  detail::window_k_store_pair<true>(p, t, j, static_cast<int>(threadIdx.x) % 32);
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
