// CPU reference GEMMs (spec section 2). Row-major; weights are [N, K] ("out = x @ W^T").
#pragma once

#include <cstdint>
#include <vector>

#include "v4attn/numerics.h"

namespace v4attn::ref {

using num::bf16_t;

// fp8 e4m3 weight with one ue8m0 scale per 32x32 block.
struct Fp8Matrix {
  int64_t n = 0, k = 0;
  std::vector<uint8_t> w;      // [n, k] e4m3
  std::vector<uint8_t> scale;  // [ceil(n/32), k/32] ue8m0
};
struct Bf16Matrix {
  int64_t n = 0, k = 0;
  std::vector<bf16_t> w;  // [n, k]
};
struct F32Matrix {
  int64_t n = 0, k = 0;
  std::vector<float> w;  // [n, k]
};

// FP8 act quant of rows (block 32 along K, ue8m0 scales): codes [m, k], scales [m, k/32].
struct ActQuant {
  int64_t m = 0, k = 0;
  std::vector<uint8_t> q;
  std::vector<uint8_t> scale;
};
ActQuant act_quant(const bf16_t* x, int64_t m, int64_t k, int64_t x_stride);

// C[m,n] = sum over K-blocks b, in order, of (sum_{k in b, in order} qa*qw) * sa[m,b] * sw[n/32,b],
// fp32, bf16 out. out has row stride out_stride (>= n).
void gemm_fp8(const ActQuant& a, const Fp8Matrix& w, bf16_t* out, int64_t out_stride);
// Convenience: act_quant then gemm_fp8.
void gemm_fp8(const bf16_t* x, int64_t m, int64_t x_stride, const Fp8Matrix& w, bf16_t* out, int64_t out_stride);
// bf16 x bf16, fp32 accumulation in k order, bf16 out.
void gemm_bf16(const bf16_t* x, int64_t m, int64_t x_stride, const Bf16Matrix& w, bf16_t* out, int64_t out_stride);
// fp32 x fp32 (x given as bf16 and widened), fp32 accumulation in k order, fp32 out.
void gemm_f32(const bf16_t* x, int64_t m, int64_t x_stride, const F32Matrix& w, float* out, int64_t out_stride);

// Dequantised copies (for cuBLASLt peers and tests).
std::vector<float> dequant_fp8(const Fp8Matrix& w);

// Quantise an fp32 matrix into the fp8 32x32-block format (used by the synthetic initialiser):
// per 32x32 block (the last row block may be shorter) the act-quant rule of numerics.h:
// amax floored at 1e-4, ue8m0 scale s = pow2ceil(amax * fp32(1/448)), codes e4m3(clamp(w/s)).
// k must be a multiple of 32.
Fp8Matrix quantize_fp8_blocks(const std::vector<float>& w, int64_t n, int64_t k);

// Worker threads of the reference GEMMs (default 2; values < 1 mean 1). Results never depend
// on it: each output element has one fixed fp32 evaluation order.
int gemm_threads();
void set_gemm_threads(int threads);

}  // namespace v4attn::ref
