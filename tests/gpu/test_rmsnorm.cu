// run_rmsnorm vs ref::rmsnorm_rows (+ ref::act_quant of its output), bytes, poisoned outputs.
#include <random>
#include <vector>

#include "gpu_test_util.h"
#include "v4attn/kernels/norm_kernels.h"
#include "v4attn/reference/gemm.h"
#include "v4attn/reference/prepare_ops.h"

namespace {

using namespace v4attn;
using num::bf16_t;

struct Case {
  int rows, n;
  int64_t x_stride;
  bool quant;
};

void run_case(const Case& c, bool pdl, uint64_t seed, bool trigger_at_wait = true) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.5f);
  const int64_t y_stride = c.n + 8;
  std::vector<bf16_t> x(static_cast<size_t>(c.rows) * c.x_stride);
  for (auto& v : x) v = num::bf16_from_f32(nd(rng));
  std::vector<float> w(c.n);
  for (auto& v : w) v = num::round_bf16(1.0f + 0.1f * nd(rng));
  const float eps = 1e-20f;

  std::vector<bf16_t> y_ref(static_cast<size_t>(c.rows) * y_stride, 0xABAB);
  ref::rmsnorm_rows(x.data(), c.rows, c.n, c.x_stride, w.data(), eps, y_ref.data(), y_stride);

  DeviceBuffer<bf16_t> dx(x.size()), dy(y_ref.size());
  DeviceBuffer<float> dw(w.size());
  DeviceBuffer<uint8_t> dq(static_cast<size_t>(c.rows) * c.n), ds(static_cast<size_t>(c.rows) * (c.n / 32 + 1));
  dx.upload(x.data(), x.size());
  dw.upload(w.data(), w.size());
  dy.fill_bytes(0xAB);
  dq.fill_bytes(0xCD);
  ds.fill_bytes(0xCD);
  kernels::RmsNormParams p;
  p.x = dx.get(); p.x_stride = c.x_stride; p.w = dw.get(); p.eps = eps;
  p.y = dy.get(); p.y_stride = y_stride; p.rows = c.rows; p.n = c.n;
  if (c.quant) { p.q_codes = dq.get(); p.q_stride = c.n; p.q_scales = ds.get(); p.s_stride = c.n / 32 + 1; }
  p.trigger_at_wait = trigger_at_wait;
  kernels::run_rmsnorm(p, nullptr, pdl);
  V4_CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<bf16_t> y(y_ref.size());
  dy.download(y.data(), y.size());
  ASSERT_EQ(y, y_ref) << "rows " << c.rows << " n " << c.n;  // padding columns stay poisoned too
  if (c.quant) {
    const ref::ActQuant aq = ref::act_quant(y_ref.data(), c.rows, c.n, y_stride);
    std::vector<uint8_t> q(dq.size()), s(ds.size());
    dq.download(q.data(), q.size());
    ds.download(s.data(), s.size());
    for (int r = 0; r < c.rows; ++r) {
      for (int k = 0; k < c.n; ++k) ASSERT_EQ(q[r * c.n + k], aq.q[r * c.n + k]) << r << "," << k;
      for (int b = 0; b < c.n / 32; ++b) ASSERT_EQ(s[r * (c.n / 32 + 1) + b], aq.scale[r * (c.n / 32) + b]);
      ASSERT_EQ(s[r * (c.n / 32 + 1) + c.n / 32], 0xCD);  // stride padding untouched
    }
  }
}

TEST(GpuRmsNorm, MatchesReferenceBytes) {
  V4_REQUIRE_GPU();
  uint64_t seed = 11;
  for (int rows : {1, 6, 8, 48, 64})
    for (bool pdl : {false, true}) {
      run_case({rows, 1280, 1792, true}, pdl, ++seed);  // q_norm on the fused QA output, + act quant
      run_case({rows, 512, 512, false}, pdl, ++seed);
      run_case({rows, 136, 144, false}, pdl, ++seed);   // n not a multiple of 32, last lanes idle
      run_case({rows, 1280, 1792, true}, pdl, ++seed, /*trigger_at_wait=*/false);  // the late-trigger form
    }
}

TEST(GpuRmsNorm, RefusesBadShapes) {
  V4_REQUIRE_GPU();
  DeviceBuffer<bf16_t> d(4096);
  DeviceBuffer<float> w(4096);
  kernels::RmsNormParams p;
  p.x = d.get(); p.y = d.get(); p.w = w.get(); p.rows = 1; p.n = 100; p.x_stride = 104; p.y_stride = 104;
  EXPECT_THROW(kernels::run_rmsnorm(p, nullptr, false), std::invalid_argument);  // n % 8
  p.n = 96; p.x_stride = 64;
  EXPECT_THROW(kernels::run_rmsnorm(p, nullptr, false), std::invalid_argument);  // stride < n
  p.x_stride = 96; p.w = nullptr;
  EXPECT_THROW(kernels::run_rmsnorm(p, nullptr, false), std::invalid_argument);
}

}  // namespace
