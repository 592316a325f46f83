// q_rope_store (spec 3.1): wq_b output q [T, H, 512] -> head-padded q_pad [T, H_pad, 512] with
// RoPE at pos[t] on dims 448..511 of every head. Twin of ref::q_rope_store.
//
// Grid (ceil(H / 2), T), block 128 threads. One CTA owns two heads of one row; one thread owns one
// 16-byte vector (8 dims) of one head: vectors 0..55 are copied bit for bit, vectors 56..63 (dims
// 448..511, four (re, im) pairs each) are rotated with the row's table entries.
//
// PDL (prepare-schedule.md): this is the kernel right after the wq_b GEMM on the main lane.
//  - Before dev::pdl_wait(): pos[t] and the RoPE table values. Neither is written by the GEMM:
//    the table is constant, and pos is written by the step's host copy (or metadata kernel), which
//    precedes the GEMM in stream order with ordinary (full) serialization; this kernel cannot
//    start before the GEMM has started, so that copy is complete and visible. (A producer of pos
//    that itself lets its successor start early would break this; the engine has none.)
//  - dev::pdl_wait() sits right before the first load of q (the GEMM output), in every thread
//    that loads q.
//  - dev::pdl_launch_dependents() follows the thread's last store, so the successor's prologue
//    overlaps only our tail; the successor still waits (griddepcontrol.wait) for our completion
//    before it reads q_pad.
// The writes happen after the wait, so they also never race with anything the GEMM (or what it
// waited for) still reads. Output bytes do not depend on pdl.
#include "v4attn/kernels/prepare_kernels.h"

#include <string>

#include "kernels/prepare_common.cuh"
#include "runtime/launch.h"
#include "runtime/phase_stamps.cuh"

namespace v4attn::kernels {

V4ATTN_STAMP_UNIT();

namespace {

constexpr int kVecsPerHead = kPrepHeadDim / detail::kChunk;                    // 64
constexpr int kRopeFirstVec = (kPrepHeadDim - num::kRopeDim) / detail::kChunk;  // 56
constexpr int kHeadsPerCta = 2;
constexpr int kThreads = kHeadsPerCta * kVecsPerHead;  // 128
static_assert(num::kRopeDim % detail::kChunk == 0, "RoPE tail must be whole vectors");

__global__ void __launch_bounds__(kThreads) q_rope_store_kernel(const __grid_constant__ QRopeStoreParams p) {
  const int t = static_cast<int>(blockIdx.y);
  const int h = static_cast<int>(blockIdx.x) * kHeadsPerCta + static_cast<int>(threadIdx.x) / kVecsPerHead;
  const int vec = static_cast<int>(threadIdx.x) % kVecsPerHead;

  // Step metadata and constants only (see the PDL note above).
  const int32_t pos = p.pos[t];
  if (pos < 0 || pos >= p.max_pos) {  // the host reference refuses this; here: skip the row, count once
    if (blockIdx.x == 0 && threadIdx.x == 0) dev::count_error(p.err_count);
    return;
  }
  if (h >= p.H) return;
  const bool rotate = vec >= kRopeFirstVec;
  float cs[detail::kChunk] = {};
  if (rotate) detail::ldg_f32x8(p.table + static_cast<int64_t>(pos) * num::kRopeDim + (vec - kRopeFirstVec) * detail::kChunk, cs);

  const bool stamper = threadIdx.x == 0 && blockIdx.x == 0;
  [[maybe_unused]] unsigned int stamp_rec = 0u;  // measurement builds only (phase_stamps.cuh)
  if (stamper) V4ATTN_STAMP_BEGIN(stamp_rec, stamps::kQRopeStore, 0);
  dev::pdl_wait();  // q is the predecessor's output
  if (stamper) V4ATTN_STAMP_AT(stamp_rec, stamps::kQRopeStore, 1);

  const int64_t in_off = static_cast<int64_t>(t) * p.q_row_stride + static_cast<int64_t>(h) * kPrepHeadDim + vec * detail::kChunk;
  const int64_t out_off = static_cast<int64_t>(t) * p.q_pad_row_stride + static_cast<int64_t>(h) * kPrepHeadDim + vec * detail::kChunk;
  uint4 v = *reinterpret_cast<const uint4*>(p.q + in_off);  // dims 0..447 pass through bit for bit
  if (rotate) {
    float x[detail::kChunk];
    detail::unpack_bf16x8(v, x);
    detail::rope_chunk(x, cs);
    v = detail::pack_bf16x8(x);
  }
  detail::st_global_v4(p.q_pad + out_off, v);
  if (stamper) V4ATTN_STAMP_AT(stamp_rec, stamps::kQRopeStore, 4);

  dev::pdl_launch_dependents();  // after this thread's last store
}

}  // namespace

void run_q_rope_store(const QRopeStoreParams& p, cudaStream_t stream, bool pdl) {
  using detail::require;
  const char* who = "run_q_rope_store";
  require(p.head_dim == kPrepHeadDim, who, "head_dim " + std::to_string(p.head_dim) + " must be 512");
  require(p.T >= 0 && p.H >= 0, who, "negative T or H");
  require(p.T <= 65535, who, "T " + std::to_string(p.T) + " exceeds the grid's y limit 65535");
  require(p.H_pad >= p.H, who, "H_pad " + std::to_string(p.H_pad) + " < H " + std::to_string(p.H));
  require(p.q_row_stride >= static_cast<int64_t>(p.H) * kPrepHeadDim && p.q_row_stride % detail::kChunk == 0, who,
          "q_row_stride " + std::to_string(p.q_row_stride) + " must be >= H * 512 and a multiple of 8");
  require(p.q_pad_row_stride >= static_cast<int64_t>(p.H_pad) * kPrepHeadDim &&
              p.q_pad_row_stride % detail::kChunk == 0,
          who, "q_pad_row_stride " + std::to_string(p.q_pad_row_stride) + " must be >= H_pad * 512 and a multiple of 8");
  if (p.T == 0 || p.H == 0) return;
  detail::require_ptr(p.q, who, "q");
  detail::require_ptr(p.q_pad, who, "q_pad");
  detail::require_ptr(p.pos, who, "pos");
  detail::require_aligned(p.q, 16, who, "q");
  detail::require_aligned(p.q_pad, 16, who, "q_pad");
  detail::require_table(p.table, p.max_pos, who);

  LaunchConfig cfg;
  cfg.grid = dim3(static_cast<unsigned>((p.H + kHeadsPerCta - 1) / kHeadsPerCta), static_cast<unsigned>(p.T), 1);
  cfg.block = dim3(kThreads, 1, 1);
  cfg.stream = stream;
  cfg.pdl = pdl;
  launch_kernel("q_rope_store", q_rope_store_kernel, cfg, p);
}

}  // namespace v4attn::kernels
