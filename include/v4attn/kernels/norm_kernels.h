// Generic row RMSNorm on the GPU (q_norm of the Q chain), the byte-exact twin of
// ref::rmsnorm_rows (LaneSum order), optionally fused with the FP8 act quant of its output (block
// 32, ue8m0), which is exactly what the next fp8 GEMM (wq_b) would compute from y: the GEMM can
// then skip its own quantisation pass.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "v4attn/numerics.h"

namespace v4attn::kernels {

// Grid: one CTA per row, one thread per 8-element chunk (n/8 threads rounded up to whole warps);
// warp 0 computes the row's LaneSum (lane l: chunks l, l+32, ...), every thread normalises (and
// quantises) its own chunk.
struct RmsNormParams {
  const num::bf16_t* x = nullptr;  // [rows, n]; row r at x + r * x_stride
  int64_t x_stride = 0;            // elements, multiple of 8
  const float* w = nullptr;        // [n]
  float eps = 0.0f;
  num::bf16_t* y = nullptr;        // [rows, n]; row r at y + r * y_stride
  int64_t y_stride = 0;            // elements, multiple of 8
  uint8_t* q_codes = nullptr;      // optional [rows, n] e4m3 of y (act quant), row stride q_stride
  int64_t q_stride = 0;
  uint8_t* q_scales = nullptr;     // optional [rows, n/32] ue8m0, row stride s_stride
  int64_t s_stride = 0;
  int rows = 0;
  int n = 0;                       // multiple of 32 when quantising, of 8 otherwise; <= 2048
  // PDL trigger: at the wait (the build's policy, device_common.cuh) or only after the last store
  // (then the successor, e.g. the wq_b GEMM, does not prefetch weights while this kernel runs).
  bool trigger_at_wait = true;
};
void run_rmsnorm(const RmsNormParams& p, cudaStream_t stream, bool pdl);

}  // namespace v4attn::kernels
