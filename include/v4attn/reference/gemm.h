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
// per 32x32 block amax -> ue8m0 scale pow2ceil(amax/448), codes e4m3(w/s).
Fp8Matrix quantize_fp8_blocks(const std::vector<float>& w, int64_t n, int64_t k);

}  // namespace v4attn::ref
