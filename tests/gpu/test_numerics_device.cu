// Device-side numerics that take a different instruction sequence from the host (numerics.h), checked
// exhaustively on the GPU: e4m3_from_clamped_f32 (the hardware cvt.rn.satfinite.e4m3x2.f32) against
// the bit-manipulation e4m3_from_f32 for every fp32 bit pattern after the act quant's clamp, and
// div_by_scale against the IEEE division for every fp32 x and a set of scales (powers of two across
// the ue8m0 range, the edges where the reciprocal leaves the normal range, and non-powers); and the
// device paths of the elementwise chain (session 16): block_amax_step (one fmaxf) against max_f at
// several amax values, act_quant_code2_by_inv (a lower clamp + the saturating pair conversion) against
// two act_quant_code_by_inv, and bf16x2_from_f32_arith (cvt.rn.bf16x2.f32) against bf16_from_f32,
// each for every fp32 bit pattern.
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "gpu_test_util.h"
#include "v4attn/numerics.h"

namespace v4attn {
namespace {

using test_util::to_host;

// One sweep over every fp32 bit pattern x: check(x) says whether the device path agrees for it.
// Mismatches are counted; the smallest failing x is kept for the message.
template <class Check>
__global__ void sweep_every_float(Check check, unsigned long long* mismatches, uint32_t* first_bad) {
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  unsigned long long bad = 0;
  for (uint64_t i = blockIdx.x * static_cast<uint64_t>(blockDim.x) + threadIdx.x; i < (uint64_t{1} << 32); i += stride) {
    if (!check(static_cast<uint32_t>(i))) {
      if (bad == 0) atomicMin(first_bad, static_cast<uint32_t>(i));
      ++bad;
    }
  }
  if (bad) atomicAdd(mismatches, bad);
}

template <class Check>
void expect_every_float(Check check, const std::string& what) {
  DeviceBuffer<unsigned long long> bad(1);
  DeviceBuffer<uint32_t> first(1);
  bad.fill_bytes(0);
  first.fill_bytes(0xff);
  sweep_every_float<<<132 * 16, 256>>>(check, bad.get(), first.get());
  V4_CUDA_CHECK(cudaGetLastError());
  V4_CUDA_CHECK(cudaDeviceSynchronize());
  EXPECT_EQ(to_host(bad)[0], 0u) << what << ": first differing fp32 bits: 0x" << std::hex << to_host(first)[0];
}

// The second operand of a pair: another bit pattern of the same sweep (a fixed odd rotation of x).
__device__ __forceinline__ uint32_t partner_bits(uint32_t x) { return (x << 13 | x >> 19) ^ 0x5bd1e995u; }

struct E4m3Check {  // the hardware conversion after the act quant's clamp
  __device__ bool operator()(uint32_t bits) const {
    const float x = num::clamp_f(num::f32_from_bits(bits), -num::kE4m3Max, num::kE4m3Max);
    return num::e4m3_from_clamped_f32(x) == num::e4m3_from_f32(x);
  }
};
struct DivByScaleCheck {
  const float* scales;
  int n;
  __device__ bool operator()(uint32_t bits) const {
    const float x = num::f32_from_bits(bits);
    for (int j = 0; j < n; ++j) {
      const float a = num::div_by_scale(x, scales[j]), b = num::div_rn(x, scales[j]);
      // Same bits, or both NaN (the payload of a NaN x may pass through either operation differently).
      if (num::f32_bits(a) != num::f32_bits(b) && !(num::is_nan(a) && num::is_nan(b))) return false;
    }
    return true;
  }
};
struct AmaxStepCheck {
  const float* amaxes;
  int n;
  __device__ bool operator()(uint32_t bits) const {
    const float x = num::f32_from_bits(bits);
    for (int j = 0; j < n; ++j)
      if (num::f32_bits(num::block_amax_step(amaxes[j], x)) != num::f32_bits(num::max_f(amaxes[j], num::abs_f(x)))) return false;
    return true;
  }
};
struct ActQuantPairCheck {
  float inv;
  __device__ bool operator()(uint32_t bits) const {
    const float x = num::f32_from_bits(bits), y = num::f32_from_bits(partner_bits(bits));
    return num::act_quant_code2_by_inv(x, y, inv) ==
           static_cast<uint16_t>(num::act_quant_code_by_inv(x, inv) | (num::act_quant_code_by_inv(y, inv) << 8));
  }
};
// bf16x2_from_f32_arith against bf16_from_f32 per half: the same bits for every non-NaN input; a NaN
// input gives a NaN, and for a positive NaN (what device arithmetic produces) one whose bf16_from_f32
// after widening equals bf16_from_f32 of the input.
struct Bf16PairCheck {
  __device__ static bool half_ok(float in, uint32_t half) {
    const num::bf16_t sw = num::bf16_from_f32(in);
    if (!num::is_nan(in)) return half == sw;
    const float widened = num::f32_from_bits(half << 16);
    if (!num::is_nan(widened)) return false;
    return (num::f32_bits(in) >> 31) != 0u || num::bf16_from_f32(widened) == sw;
  }
  __device__ bool operator()(uint32_t bits) const {
    const float x = num::f32_from_bits(bits), y = num::f32_from_bits(partner_bits(bits));
    const uint32_t h = num::bf16x2_from_f32_arith(x, y);
    return half_ok(x, h & 0xffffu) && half_ok(y, h >> 16) && num::f32_bits(num::round_bf16_arith(x)) == (h << 16);
  }
};

// Canonical NaN from device arithmetic is positive (the premise of bf16x2_from_f32_arith's use on
// products): 0 * inf, inf - inf and NaN operands of either sign.
__global__ void arith_nan_sign_kernel(const float* in, uint32_t* out) {
  const float zero = in[0], inf = in[1], neg_nan = in[2], pos_nan = in[3];
  out[0] = num::f32_bits(num::mul_rn(zero, inf));
  out[1] = num::f32_bits(num::sub_rn(inf, inf));
  out[2] = num::f32_bits(num::mul_rn(neg_nan, 2.0f));
  out[3] = num::f32_bits(num::mul_rn(2.0f, neg_nan));
  out[4] = num::f32_bits(num::add_rn(neg_nan, pos_nan));
  out[5] = num::f32_bits(num::mul_rn(pos_nan, -1.0f));
}

TEST(GpuNumerics, E4m3HardwareMatchesSoftwareForEveryFloat) {
  V4_REQUIRE_GPU();
  expect_every_float(E4m3Check{}, "e4m3_from_clamped_f32");
}

TEST(GpuNumerics, DivideByPowerOfTwoScaleMatchesDivisionForEveryFloat) {
  V4_REQUIRE_GPU();
  std::vector<float> scales;
  for (int e : {-126, -125, -22, -9, -1, 0, 1, 7, 119, 126, 127}) scales.push_back(num::pow2_f32(e));
  for (float s : {3.0f, 0.375f, 448.0f, 1.5e-30f, -2.0f, 0.0f}) scales.push_back(s);  // not (positive normal) powers of two
  const auto d_scales = test_util::to_device(scales);
  expect_every_float(DivByScaleCheck{d_scales.get(), static_cast<int>(scales.size())}, "div_by_scale");
}

TEST(GpuNumerics, AmaxStepMatchesNanSkippingMaxForEveryFloat) {
  V4_REQUIRE_GPU();
  // amax values callers can hold: +0, a subnormal, normals across the range, the largest float, +inf.
  const std::vector<float> amaxes = {0.0f, num::f32_from_bits(1u), num::f32_from_bits(0x007fffffu), 1e-4f, 1.0f, 448.0f,
                                     num::f32_from_bits(0x7f7fffffu), num::f32_from_bits(0x7f800000u)};
  const auto d_amax = test_util::to_device(amaxes);
  expect_every_float(AmaxStepCheck{d_amax.get(), static_cast<int>(amaxes.size())}, "block_amax_step");
}

TEST(GpuNumerics, ActQuantPairMatchesTwoCodesForEveryFloat) {
  V4_REQUIRE_GPU();
  // inv 1: every fp32 product reaches the clamp and the conversion; 2^-7 and 2^126: the multiply in front.
  for (float inv : {1.0f, num::pow2_f32(-7), num::pow2_f32(126)})
    expect_every_float(ActQuantPairCheck{inv}, "act_quant_code2_by_inv, inv " + std::to_string(inv));
}

TEST(GpuNumerics, Bf16PairConversionMatchesSoftwareForEveryFloat) {
  V4_REQUIRE_GPU();
  expect_every_float(Bf16PairCheck{}, "bf16x2_from_f32_arith / round_bf16_arith");
}

TEST(GpuNumerics, DeviceArithmeticNanIsPositive) {
  V4_REQUIRE_GPU();
  const std::vector<float> in = {0.0f, num::f32_from_bits(0x7f800000u), num::f32_from_bits(0xffc01234u),
                                 num::f32_from_bits(0x7fc00001u)};
  const auto d_in = test_util::to_device(in);
  DeviceBuffer<uint32_t> out(6);
  out.fill_bytes(0);
  arith_nan_sign_kernel<<<1, 1>>>(d_in.get(), out.get());
  V4_CUDA_CHECK(cudaGetLastError());
  V4_CUDA_CHECK(cudaDeviceSynchronize());
  const auto h = to_host(out);
  for (size_t i = 0; i < h.size(); ++i) {
    EXPECT_TRUE(num::is_nan(num::f32_from_bits(h[i]))) << "case " << i;
    EXPECT_EQ(h[i] >> 31, 0u) << "case " << i << ": 0x" << std::hex << h[i];
  }
}

}  // namespace
}  // namespace v4attn
