// The fused Q chain of a plain layer (spec v41-attention.md 3.1 and 3.2) in ONE kernel:
//
//   act quant(x) -> wq_a|wkv GEMM (fp8, split-K) -> qkv_a
//                   qkv_a[:, :q_rank]  -> q_norm (+ act quant) -> wq_b GEMM (fp8) -> RoPE -> q_pad
//                   qkv_a[:, q_rank:]  -> window-K store (norm, RoPE, FP8, paged)
//
// Why: as separate kernels the chain is latency-bound (docs/design.md "Where the floor is"):
// every kernel's one-CTA-per-SM grid waits for its predecessor's SMs, then for its prologue, and
// the wq_b weights can only stream once the wq_b CTAs are resident. Here the grid is resident from
// the start (one CTA per SM, at most the SM count, so every CTA runs at once): each CTA loads its
// wq_a|wkv weight slice and the first stages of its wq_b tile before the PDL wait, and the
// hand-offs between the stages of the chain are arrival counters in global memory, not launches.
//
// Bytes: identical to the unfused chain run_act_quant_fp8 -> run_gemm_fp8 (v3, v3_int_mask 0)
// -> run_rmsnorm (with its act quant) -> run_gemm_fp8_rope_store (v2) -> run_window_k_store, on
// every output below (tested: GpuQChainFused). The QA GEMM's split-K structure is v3's plan for
// the shape (so a token's output never depends on the batch), its block sums the cvt-widened f16
// wgmma of v2 / v3 (int_mask 0, v3's default since session 9; against v3 with integer-widened
// blocks it may differ by 1 bf16 ulp in rare elements, spec section 6).
//
// Speed (docs/perf.md, sessions 8-10): per layer, layers back to back (bench_qchain, session 10
// run 6), fused vs unfused: 22.2 vs 26.8 us at 1 row, 25.2 vs 27.2 at 6, 26.2 vs 27.5 at 8, 35.0
// vs 33.2 at 16 (its per-row work, q_norm in every CTA, grows with the rows). Session 10's gain:
// the wq_b ring fill waits for the CTA's phase-0 loads (scales, q_norm weights, RoPE rows), which
// had queued behind it. In the three-lane cycle (run 6, before the ring fill's pacing) faster up to
// 6 rows (decode bs 1 / 4 -4.1 / -3.7 % against session 9's binary; decode bs 6 -1.8 %, verify bs 1
// -1.7 % against --fuse-qchain off), even at 8 and slower at 12 and 16 (it holds every SM while the index layers' side lanes want some):
// GpuStackOptions::fuse_qchain runs it by default up to kQChainAutoRows (8 rows in sessions 10-13,
// 12 in 16-21, all 16 since session 22; Fusion::kAuto), and fuse_qchain_index in the reindex layers up to
// kQChainIndexAutoRows (4 in sessions 17-19, 8 since session 20). Session 16
// (bench_qchain, same run): 20.0 us at 1 row, 22.1 at 6, 22.8 at 8 (fewer instructions in its
// exact elementwise steps; only the QA scales before the PDL wait; a staged RoPE store; the QA
// slots' wq_b stages fetched after q_norm).
//
// Co-residency: the counters are waited on by spinning CTAs, so every CTA must be resident at
// once. The grid is at most the device's SM count with one CTA per SM (~200 KB of shared memory
// each): resident as soon as the SMs are free. Other kernels running on the device (side lanes)
// only delay CTAs, never block them for good, as long as no running kernel waits on this one. The
// SM count the rule uses is what the process may hold: the current context's execution affinity
// (an MPS client context with an SM limit) and CUDA_MPS_ACTIVE_THREAD_PERCENTAGE lower it, and a
// grid above it is refused (the stack then runs the unfused chain). Green contexts created by the
// caller through the driver API are not seen: do not run the fused chain inside one smaller than
// the grid.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "v4attn/kernels/prepare_kernels.h"
#include "v4attn/numerics.h"

namespace v4attn::kernels {

constexpr int kQChainMaxRows = 16;  // T limit of the fused chain (NP 8 or 16)

struct QChainFusedParams {
  const bf16_t* x = nullptr;             // [T, dim] layer input; row t at x + t * x_stride
  int64_t x_stride = 0;                  // elements, >= dim, multiple of 8
  const uint8_t* wqkv_a = nullptr;       // [q_rank + 512, dim] e4m3, dense
  const uint8_t* wqkv_a_scale = nullptr; // [(q_rank + 512) / 32, dim / 32] ue8m0, dense
  const float* q_norm = nullptr;         // [q_rank]
  float eps = 0.0f;                      // q_norm's epsilon (the window-K norm takes kv.eps)
  const uint8_t* wq_b = nullptr;         // [H * 512, q_rank] e4m3, dense
  const uint8_t* wq_b_scale = nullptr;   // [H * 512 / 32, q_rank / 32] ue8m0, dense
  // Outputs (the unfused chain's buffers): qkv_a [T, q_rank + 512] bf16 (row stride qkv_a_stride);
  // qr [T, q_rank] bf16, qr_codes [T, q_rank] e4m3 and qr_scales [T, q_rank / 32] ue8m0 (dense,
  // what run_rmsnorm writes with its act quant); q_pad [T, H_pad * 512] (heads < H written).
  bf16_t* qkv_a = nullptr;
  int64_t qkv_a_stride = 0;              // elements, >= q_rank + 512, multiple of 8
  bf16_t* qr = nullptr;
  uint8_t* qr_codes = nullptr;
  uint8_t* qr_scales = nullptr;
  bf16_t* q_pad = nullptr;
  int64_t q_pad_stride = 0;              // elements, >= H * 512
  // The window-K store of the kv columns: everything but kv / kv_row_stride / T (the launcher sets
  // those to qkv_a + q_rank, qkv_a_stride, T). Its pos / table / max_pos / err_count also serve
  // the RoPE of q (the same step positions and table, like the unfused q_rope_store).
  WindowKStoreParams kv{};
  int T = 0;                             // rows, 1..kQChainMaxRows
  int64_t dim = 0, q_rank = 0;
  int H = 0;
  // From qchain_fused_workspace_bytes(T_max, dim, q_rank): arrival counters (zero before the first
  // use: init_qchain_workspace; every completed launch leaves them zero) + fp32 split-K partials.
  // One workspace per stream that runs the chain.
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  // The q columns' hand-off. false: the split-K partials of each q tile are added by the tile's last
  // CTA, which stores qkv_a and counts the tile; every CTA waits for all q tiles and reads qkv_a
  // (two hand-offs). true: every CTA waits for all q partials and adds them itself (one hand-off,
  // but every CTA reads qa_splits x T x q_rank fp32: 40 KB per row at V4.1). Same bytes either way.
  // Needs qchain_fused_supported(..., q_direct = true).
  bool q_direct = false;
};

// Whether the fused chain takes this shape on `device` (T rows, the layer's dim / q_rank / H):
// 1 <= T <= kQChainMaxRows, dim % 128 == 0, q_rank % 256 == 0, the wq_b GEMM's v2 rope-store plan
// (one split, 256-column tiles), the QA GEMM's v3 plan with 128-column tiles, and a grid of at
// most the device's SM count.
// With q_direct: also whether the direct q hand-off takes it (the T staged q rows fit in shared memory).
bool qchain_fused_supported(int T, int64_t dim, int64_t q_rank, int H, int device = -1, bool q_direct = false);
// The same plan for a device of `sm_count` SMs, without asking the driver (host only; what the CPU
// tests pin), every field 0 / false when unsupported:
//  - grid: the CTAs it needs, max(wq_b tiles, QA tiles x splits, 3 T);
//  - ring: the wq_b ring slots (32 KB each) every CTA gets, what shared memory holds after the fixed
//    parts, at most one per wq_b stage. The slots not holding the QA weights are what a CTA streams
//    before q_norm, so a fixed part that grows can cost a slot and ~4 MB of that stream;
//  - direct_ok: the direct q hand-off takes it (the T staged q rows, T x q_rank bf16, fit in the QA
//    weight slots): qchain_fused_supported(..., q_direct = true) on such a device.
struct QChainFusedShape {
  int grid = 0;
  int ring = 0;
  bool direct_ok = false;
};
QChainFusedShape qchain_fused_shape(int T, int64_t dim, int64_t q_rank, int H, int sm_count);
size_t qchain_fused_workspace_bytes(int T_max, int64_t dim, int64_t q_rank);
void init_qchain_workspace(void* workspace, size_t bytes, cudaStream_t stream);
// Validates everything (std::invalid_argument, nothing launched) and launches one kernel.
void run_qchain_fused(const QChainFusedParams& p, cudaStream_t stream, bool pdl);
// The unfused chain the fused kernel replaces, on the same parameters (the tests' and the bench's
// reference): run_act_quant_fp8 -> run_gemm_fp8 (v3 with v3_int_mask) -> run_rmsnorm with its act
// quant -> run_gemm_fp8_rope_store (v2) -> run_window_k_store, five launches. x_codes [T, dim] and
// x_scales [T, dim / 32] (dense) are its act quant's scratch; p.workspace is not used. With
// v3_int_mask 0 (or -1, the default, the same mask now) it writes the fused kernel's bytes.
void run_qchain_unfused(const QChainFusedParams& p, uint8_t* x_codes, uint8_t* x_scales, int v3_int_mask,
                        cudaStream_t stream, bool pdl);

}  // namespace v4attn::kernels
