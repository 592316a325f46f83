// Internal launchers of the GEMM family (include/v4attn/kernels/gemm.h). The public run_*
// functions (gemm_api.cu) validate every argument once and then call one of these, which trust
// their input.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "runtime/cuda_utils.h"
#include "v4attn/kernels/gemm.h"

namespace v4attn::kernels::detail {

// v0: one thread per output element, the reference's order (gemm_simple.cu).
void launch_gemm_fp8_simple(const Fp8GemmParams& p, cudaStream_t stream, bool pdl);
void launch_gemm_bf16_simple(const Bf16GemmParams& p, cudaStream_t stream, bool pdl);
void launch_gemm_f32_simple(const F32GemmParams& p, cudaStream_t stream, bool pdl);

// v1: tensor cores (gemm_tc.cu); `plan` comes from plan_gemm_tc with the params' overrides.
void launch_gemm_fp8_tc(const Fp8GemmParams& p, const GemmPlan& plan, const GemmWorkspace& ws, cudaStream_t stream,
                        bool pdl);
void launch_gemm_bf16_tc(const Bf16GemmParams& p, const GemmPlan& plan, const GemmWorkspace& ws, cudaStream_t stream,
                         bool pdl);

// v2: wgmma + TMA (gemm_wgmma.cu); `plan` comes from plan_gemm_wgmma with the params' overrides.
void launch_gemm_fp8_wgmma(const Fp8GemmParams& p, const GemmPlan& plan, const GemmWorkspace& ws, cudaStream_t stream,
                           bool pdl);

// v3: pipelined wgmma + TMA, split-K in a cluster (gemm_wgmma_pipelined.cu); `plan` comes from
// plan_gemm_wgmma_pipelined with the params' overrides. No workspace.
void launch_gemm_fp8_wgmma_pipelined(const Fp8GemmParams& p, const GemmPlan& plan, cudaStream_t stream, bool pdl);
// v6: registers-first gemv for m <= kGemvMaxRows (gemm_gemv.cu); the plan is plan_gemm_gemv's.
void launch_gemm_fp8_gemv(const Fp8GemmParams& p, cudaStream_t stream, bool pdl);
// The SMs this process can hold at once on `device` (-1: the current one), counted low: kernels
// whose CTAs wait on each other size their grids with it (gemm_qchain.cu).
int device_sm_count(int device);

// The tiling and split-K choice v2 and v3 share (gemm_wgmma.cu): two m64 tiles per consumer
// warpgroup (256 rows per CTA) when that still gives ~one CTA per SM without split-K, otherwise 128
// rows per CTA and split-K to fill the machine (bounded so that a CTA's scale arrays stay small;
// max_splits > 0 caps S, v3's cluster size). Validates the arguments (`who` names the caller).
struct WgmmaSplit {
  int warp_mtiles = 1, block_n = 0, tiles_n = 0, splits = 1;
  // The plan's tiling and split fields (the stages / shared memory are the version's own).
  GemmPlan plan_base() const {
    GemmPlan plan;
    plan.warp_mtiles = warp_mtiles;
    plan.block_n = block_n;
    plan.tiles_n = tiles_n;
    plan.splits = splits;
    return plan;
  }
};
WgmmaSplit plan_wgmma_split(const char* who, int m, int64_t n, int64_t k, int groups, int force_splits, int force_mtiles,
                            int force_stages, int max_splits);

// v3: stages of 4 K blocks of the CTA with the most K blocks under `plan` (its fused act quant
// needs them all in the ring at once).
int v3_max_cta_stages(const GemmPlan& plan, int64_t k);

inline bool aligned_to(const void* ptr, size_t bytes) { return reinterpret_cast<uintptr_t>(ptr) % bytes == 0; }

// The widest bf16 output stores a GEMM may use on `p`'s output (v2 and v3 epilogues): 2 = 16 bytes,
// 1 = 8 bytes, 0 = element by element (every row and group start aligned to the width).
inline int bf16_out_vector_width(const Fp8GemmParams& p) {
  const bool one_group = p.groups == 1;
  if (aligned_to(p.out, 16) && p.out_stride % 8 == 0 && (one_group || p.out_group_stride % 8 == 0)) return 2;
  if (aligned_to(p.out, 8) && p.out_stride % 4 == 0 && (one_group || p.out_group_stride % 4 == 0)) return 1;
  return 0;
}

// v1 of the fp32 GEMM: CUDA cores (gemm_f32.cu).
void launch_gemm_f32_warp(const F32GemmParams& p, cudaStream_t stream, bool pdl);

// v5 (kSkinny) of the bf16 and fp32 GEMMs (gemm_skinny.cu); `plan` comes from plan_gemm_skinny with
// the params' overrides. Split-K in a cluster, no workspace.
void launch_gemm_bf16_skinny(const Bf16GemmParams& p, const GemmPlan& plan, cudaStream_t stream, bool pdl);
void launch_gemm_f32_skinny(const F32GemmParams& p, const GemmPlan& plan, cudaStream_t stream, bool pdl);

// Raises a kernel's dynamic shared-memory limit to `bytes` before its launch. Needed for any
// dynamic size that, together with the kernel's static shared memory, exceeds the 48 KB default:
// launch_kernel() raises it only above 48 KB of dynamic memory, so a kernel with static shared
// memory and exactly 48 KB of dynamic memory would fail with cudaErrorInvalidValue.
template <class... KArgs>
void set_max_dynamic_smem(void (*kernel)(KArgs...), size_t bytes) {
  if (bytes > 0)
    V4_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
}

// Workspace layout of a split-K GEMM: [counters: groups * tiles_n uint32, padded to 256 B]
// [partials: splits * groups * m * n fp32].
inline size_t workspace_counter_bytes(int groups, int tiles_n) {
  const size_t b = static_cast<size_t>(groups) * static_cast<size_t>(tiles_n) * sizeof(uint32_t);
  return (b + 255) / 256 * 256;
}

}  // namespace v4attn::kernels::detail
