// v0 of every GEMM (and the FP8 act quant): one thread per output element, a plain loop in the
// CPU reference's exact order, so the output is byte-identical to ref::gemm_* / ref::act_quant.
// Slow on purpose (weights are read with one thread per row); it is the fallback and the bench
// baseline. Every kernel calls dev::pdl_wait() before its first load.
#include <algorithm>

#include "gemm/gemm_internal.h"
#include "kernels/device_common.cuh"
#include "runtime/launch.h"
#include "runtime/phase_stamps.cuh"

namespace v4attn::kernels {

V4ATTN_STAMP_UNIT();

namespace {

constexpr int kSimpleThreads = 128;

// ---- FP8 act quant ----------------------------------------------------------------------------
// Grid (ceil((k/32) / W), m), block 32 W (W = ActQuantParams::warps_per_cta, 4 by default): one
// warp owns one 32-wide block of one row, one lane one element, whatever W. amax = warp max of
// max(0, |x|): the reference's sequential NaN-skipping max from 0, exactly (max is exact and
// order-free); then the same scale exponent and codes.
constexpr int kQuantWarps = kSimpleThreads / 32;  // the default W (warps_per_cta 0)
constexpr int kQuantMaxWarps = 32;

__global__ void __launch_bounds__(kQuantMaxWarps * 32) act_quant_fp8_kernel(const __grid_constant__ ActQuantParams p) {
  const bool stamper = threadIdx.x == 0 && blockIdx.x == 0 && blockIdx.y == 0;
  [[maybe_unused]] unsigned int stamp_rec = 0u;  // measurement builds only (phase_stamps.cuh)
  if (stamper) V4ATTN_STAMP_BEGIN(stamp_rec, stamps::kActQuant, 0);
  dev::pdl_wait();  // x is the predecessor's output
  if (stamper) V4ATTN_STAMP_AT(stamp_rec, stamps::kActQuant, 1);
  const int row = static_cast<int>(blockIdx.y);
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int64_t blk = static_cast<int64_t>(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (blk < p.k / kGemmBlock) {  // uniform per warp
    const float v = num::f32_from_bf16(p.x[row * p.x_stride + blk * kGemmBlock + lane]);
    const float amax = dev::warp_max(num::block_amax_step(0.0f, v));
    const int e = num::act_quant_scale_exp(amax);
    const float inv = num::act_quant_inv_scale(e);  // uniform per warp: no division code on the common path
    p.q[row * p.q_stride + blk * kGemmBlock + lane] =
        inv != 0.0f ? num::act_quant_code_by_inv(v, inv) : num::act_quant_code(v, num::pow2_f32(e));
    if (lane == 0) p.scale[row * p.scale_stride + blk] = num::ue8m0_from_exp(e);
  }
  if (stamper) V4ATTN_STAMP_AT(stamp_rec, stamps::kActQuant, 4);
  dev::pdl_launch_dependents();
}

// ---- v0 GEMMs ---------------------------------------------------------------------------------
// Grid (ceil(n / 128), m, groups), block 128: thread -> one output element out[m, n] of group z.
__global__ void __launch_bounds__(kSimpleThreads) gemm_fp8_simple_kernel(const __grid_constant__ Fp8GemmParams p) {
  dev::pdl_wait();
  const int64_t n = static_cast<int64_t>(blockIdx.x) * kSimpleThreads + threadIdx.x;
  const int m = static_cast<int>(blockIdx.y);
  const int64_t grp = blockIdx.z;
  if (n < p.n) {
    const int64_t kb = p.k / kGemmBlock;
    const uint8_t* a = p.a_q + grp * p.a_group_stride + m * p.a_stride;
    const uint8_t* sa = p.a_scale + grp * p.a_scale_group_stride + m * p.a_scale_stride;
    const uint8_t* w = p.w + grp * p.w_group_stride + n * p.k;
    const uint8_t* sw = p.w_scale + grp * p.w_scale_group_stride + (n / kGemmBlock) * kb;
    float acc = 0.0f;
    for (int64_t b = 0; b < kb; ++b) {
      float bs = 0.0f;
      for (int i = 0; i < kGemmBlock; ++i)
        bs = num::add_rn(bs, num::mul_rn(num::f32_from_e4m3(a[b * kGemmBlock + i]), num::f32_from_e4m3(w[b * kGemmBlock + i])));
      acc = num::add_rn(acc, num::mul_rn(num::mul_rn(bs, num::f32_from_ue8m0(sa[b])), num::f32_from_ue8m0(sw[b])));
    }
    p.out[grp * p.out_group_stride + m * p.out_stride + n] = num::bf16_from_f32(acc);
  }
  dev::pdl_launch_dependents();
}

__global__ void __launch_bounds__(kSimpleThreads) gemm_bf16_simple_kernel(const __grid_constant__ Bf16GemmParams p) {
  dev::pdl_wait();
  const int64_t n = static_cast<int64_t>(blockIdx.x) * kSimpleThreads + threadIdx.x;
  const int m = static_cast<int>(blockIdx.y);
  const int64_t grp = blockIdx.z;
  if (n < p.n) {
    const bf16_t* x = p.x + grp * p.x_group_stride + m * p.x_stride;
    const bf16_t* w = p.w + grp * p.w_group_stride + n * p.k;
    float acc = 0.0f;
    for (int64_t i = 0; i < p.k; ++i) acc = num::add_rn(acc, num::mul_rn(num::f32_from_bf16(x[i]), num::f32_from_bf16(w[i])));
    p.out[grp * p.out_group_stride + m * p.out_stride + n] = num::bf16_from_f32(acc);
  }
  dev::pdl_launch_dependents();
}

__global__ void __launch_bounds__(kSimpleThreads) gemm_f32_simple_kernel(const __grid_constant__ F32GemmParams p) {
  dev::pdl_wait();
  const int64_t n = static_cast<int64_t>(blockIdx.x) * kSimpleThreads + threadIdx.x;
  const int m = static_cast<int>(blockIdx.y);
  if (n < p.n) {
    const bf16_t* x = p.x + m * p.x_stride;
    const float* w = p.w + n * p.k;
    float acc = 0.0f;
    for (int64_t i = 0; i < p.k; ++i) acc = num::add_rn(acc, num::mul_rn(num::f32_from_bf16(x[i]), w[i]));
    p.out[m * p.out_stride + n] = acc;
  }
  dev::pdl_launch_dependents();
}

LaunchConfig simple_config(int64_t n, int m, int groups, cudaStream_t stream, bool pdl) {
  LaunchConfig cfg;
  cfg.grid = dim3(static_cast<unsigned>((n + kSimpleThreads - 1) / kSimpleThreads), static_cast<unsigned>(m),
                  static_cast<unsigned>(groups));
  cfg.block = dim3(kSimpleThreads);
  cfg.stream = stream;
  cfg.pdl = pdl;
  return cfg;
}

}  // namespace

void run_act_quant_fp8(const ActQuantParams& p, cudaStream_t stream, bool pdl) {
  auto fail = [](const std::string& what) { throw std::invalid_argument("run_act_quant_fp8: " + what); };
  if (p.m < 0) fail("m < 0");
  if (p.m == 0) return;
  if (p.m > 65535) fail("m > 65535");
  if (p.k <= 0 || p.k % kGemmBlock != 0) fail("k " + std::to_string(p.k) + " is not a positive multiple of 32");
  if (p.x == nullptr || p.q == nullptr || p.scale == nullptr) fail("null pointer");
  if (p.x_stride < p.k) fail("x_stride < k");
  if (p.q_stride < p.k) fail("q_stride < k");
  if (p.scale_stride < p.k / kGemmBlock) fail("scale_stride < k/32");
  if (p.warps_per_cta < 0 || p.warps_per_cta > kQuantMaxWarps) fail("warps_per_cta must be 0..32");
  LaunchConfig cfg;
  const int64_t blocks = p.k / kGemmBlock;
  const int warps = p.warps_per_cta > 0 ? p.warps_per_cta : kQuantWarps;
  cfg.grid = dim3(static_cast<unsigned>((blocks + warps - 1) / warps), static_cast<unsigned>(p.m));
  cfg.block = dim3(static_cast<unsigned>(warps * 32));
  cfg.stream = stream;
  cfg.pdl = pdl;
  launch_kernel("act_quant_fp8", act_quant_fp8_kernel, cfg, p);
}

namespace detail {

void launch_gemm_fp8_simple(const Fp8GemmParams& p, cudaStream_t stream, bool pdl) {
  launch_kernel("gemm_fp8_simple", gemm_fp8_simple_kernel, simple_config(p.n, p.m, p.groups, stream, pdl), p);
}
void launch_gemm_bf16_simple(const Bf16GemmParams& p, cudaStream_t stream, bool pdl) {
  launch_kernel("gemm_bf16_simple", gemm_bf16_simple_kernel, simple_config(p.n, p.m, p.groups, stream, pdl), p);
}
void launch_gemm_f32_simple(const F32GemmParams& p, cudaStream_t stream, bool pdl) {
  launch_kernel("gemm_f32_simple", gemm_f32_simple_kernel, simple_config(p.n, p.m, 1, stream, pdl), p);
}

}  // namespace detail
}  // namespace v4attn::kernels
