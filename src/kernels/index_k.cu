// Index-K store (spec 3.3 (a)): kproj = wk(latent_pre_rope) [N, 128] -> RMSNorm(k_norm) -> RoPE
// at g on dims 64..127 (compressed table) -> FP4 indexer quant (block 32, ue8m0) -> 68-byte slot
// (64 B e2m1 pairs + 4 ue8m0) of the paged index-K cache at out_loc. Twin of ref::index_k_store.
//
// Grid N CTAs of 64 threads, pair per thread (prepare_common.cuh): thread j of row t owns dims 2j,
// 2j+1 (j in 0..63); warp 1 holds the RoPE half (dims 64..127). Each of the two warps computes the
// row's RMSNorm sum of squares itself in the LaneSum order (detail::warp_row_sum_squares: lane
// l < 16 holds chunk l, lanes 16..31 add 0, exactly the zero partials of num::lane_sum_squares for
// n = 128). Quant block b (dims 32b..32b+31) = the 16 lanes 16b..16b+15 (mod 32); thread j stores
// code byte j, thread 16b stores scale byte b. (The previous version gave each row one warp, 8
// dims per lane: six rows ran six warps through long exact-numerics chains.)
//
// PDL: before dev::pdl_wait() a thread reads out_loc[t] and g[t] (step metadata, both loads in
// flight together) and the constant k_norm weights and table entry; the wait precedes the first
// load of kproj (the wk GEMM output); the trigger follows the last store. Rows that store nothing
// (out_loc <= 0 or out of range) return before the wait, like the reference, which computes
// nothing for them. Errors are counted once per row (by thread 0).
#include "v4attn/kernels/prepare_kernels.h"

#include <string>

#include "kernels/index_k_device.cuh"
#include "kernels/prepare_common.cuh"
#include "runtime/launch.h"

namespace v4attn::kernels {

namespace {

constexpr int kThreads = detail::index_k::kThreads;  // 64: one per pair

__global__ void __launch_bounds__(kThreads) index_k_store_kernel(const __grid_constant__ IndexKStoreParams p) {
  detail::index_k_store_pair<true>(p, static_cast<int>(blockIdx.x), static_cast<int>(threadIdx.x));
  dev::pdl_launch_dependents();  // after this thread's last store (or its early return)
}

}  // namespace

namespace detail {
bool require_index_k_store(const IndexKStoreParams& p, const char* who) {
  require(p.N >= 0, who, "negative N");
  require(p.kproj_row_stride >= kPrepIndexDim && p.kproj_row_stride % kChunk == 0, who,
          "kproj_row_stride " + std::to_string(p.kproj_row_stride) + " must be >= 128 and a multiple of 8");
  require_cache(p.layout, CacheKind::kIndexK, p.cache, p.n_slots, who);
  if (p.N == 0) return false;
  require_ptr(p.kproj, who, "kproj");
  require_aligned(p.kproj, 16, who, "kproj");
  require_ptr(p.k_norm, who, "k_norm");
  require_aligned(p.k_norm, 16, who, "k_norm");
  require_ptr(p.g, who, "g");
  require_ptr(p.out_loc, who, "out_loc");
  require_table(p.table, p.max_pos, who);
  return true;
}
}  // namespace detail

void run_index_k_store(const IndexKStoreParams& p, cudaStream_t stream, bool pdl) {
  if (!detail::require_index_k_store(p, "run_index_k_store")) return;
  LaunchConfig cfg;
  cfg.grid = dim3(static_cast<unsigned>(p.N), 1, 1);
  cfg.block = dim3(kThreads, 1, 1);
  cfg.stream = stream;
  cfg.pdl = pdl;
  launch_kernel("index_k_store", index_k_store_kernel, cfg, p);
}

}  // namespace v4attn::kernels
