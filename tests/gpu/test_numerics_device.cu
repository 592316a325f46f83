// Device-side numerics that take a different instruction sequence from the host (numerics.h), checked
// exhaustively on the GPU: e4m3_from_clamped_f32 (the hardware cvt.rn.satfinite.e4m3x2.f32) against
// the bit-manipulation e4m3_from_f32 for every fp32 bit pattern after the act quant's clamp, and
// div_by_scale against the IEEE division for every fp32 x and a set of scales (powers of two across
// the ue8m0 range, the edges where the reciprocal leaves the normal range, and non-powers).
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "gpu_test_util.h"
#include "v4attn/numerics.h"

namespace v4attn {
namespace {

using test_util::to_host;

__global__ void e4m3_hw_vs_sw_kernel(unsigned long long* mismatches, uint32_t* first_bad) {
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  unsigned long long bad = 0;
  for (uint64_t i = blockIdx.x * static_cast<uint64_t>(blockDim.x) + threadIdx.x; i < (uint64_t{1} << 32); i += stride) {
    const float x = num::clamp_f(num::f32_from_bits(static_cast<uint32_t>(i)), -num::kE4m3Max, num::kE4m3Max);
    if (num::e4m3_from_clamped_f32(x) != num::e4m3_from_f32(x)) {
      if (bad == 0) atomicMin(first_bad, static_cast<uint32_t>(i));
      ++bad;
    }
  }
  if (bad) atomicAdd(mismatches, bad);
}

__global__ void div_by_scale_kernel(const float* scales, int n_scales, unsigned long long* mismatches, uint32_t* first_bad) {
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  unsigned long long bad = 0;
  for (uint64_t i = blockIdx.x * static_cast<uint64_t>(blockDim.x) + threadIdx.x; i < (uint64_t{1} << 32); i += stride) {
    const float x = num::f32_from_bits(static_cast<uint32_t>(i));
    for (int j = 0; j < n_scales; ++j) {
      const float a = num::div_by_scale(x, scales[j]), b = num::div_rn(x, scales[j]);
      // Same bits, or both NaN (the payload of a NaN x may pass through either operation differently).
      if (num::f32_bits(a) != num::f32_bits(b) && !(num::is_nan(a) && num::is_nan(b))) {
        if (bad == 0) atomicMin(first_bad, static_cast<uint32_t>(i));
        ++bad;
      }
    }
  }
  if (bad) atomicAdd(mismatches, bad);
}

TEST(GpuNumerics, E4m3HardwareMatchesSoftwareForEveryFloat) {
  V4_REQUIRE_GPU();
  DeviceBuffer<unsigned long long> bad(1);
  DeviceBuffer<uint32_t> first(1);
  bad.fill_bytes(0);
  first.fill_bytes(0xff);
  e4m3_hw_vs_sw_kernel<<<132 * 16, 256>>>(bad.get(), first.get());
  V4_CUDA_CHECK(cudaGetLastError());
  V4_CUDA_CHECK(cudaDeviceSynchronize());
  EXPECT_EQ(to_host(bad)[0], 0u) << "first differing fp32 bits: 0x" << std::hex << to_host(first)[0];
}

TEST(GpuNumerics, DivideByPowerOfTwoScaleMatchesDivisionForEveryFloat) {
  V4_REQUIRE_GPU();
  std::vector<float> scales;
  for (int e : {-126, -125, -22, -9, -1, 0, 1, 7, 119, 126, 127}) scales.push_back(num::pow2_f32(e));
  for (float s : {3.0f, 0.375f, 448.0f, 1.5e-30f, -2.0f, 0.0f}) scales.push_back(s);  // not (positive normal) powers of two
  const auto d_scales = test_util::to_device(scales);
  DeviceBuffer<unsigned long long> bad(1);
  DeviceBuffer<uint32_t> first(1);
  bad.fill_bytes(0);
  first.fill_bytes(0xff);
  div_by_scale_kernel<<<132 * 16, 256>>>(d_scales.get(), static_cast<int>(scales.size()), bad.get(), first.get());
  V4_CUDA_CHECK(cudaGetLastError());
  V4_CUDA_CHECK(cudaDeviceSynchronize());
  EXPECT_EQ(to_host(bad)[0], 0u) << "first differing x bits: 0x" << std::hex << to_host(first)[0];
}

}  // namespace
}  // namespace v4attn
