#include "gpu_test_util.h"

namespace {
__global__ void add_one(int* p) { p[threadIdx.x] += 1; }
}  // namespace

TEST(GpuSmoke, KernelRuns) {
  V4_REQUIRE_GPU();
  (void)cudaGetLastError();  // this test checks its own launch, not an error an earlier test left
  v4attn::DeviceBuffer<int> buf(32);
  std::vector<int> h(32);
  for (int i = 0; i < 32; ++i) h[i] = 3 * i + 1;
  buf.upload(h.data(), 32);
  add_one<<<1, 32>>>(buf.get());
  V4_CUDA_CHECK_LAUNCH();
  std::vector<int> out(32);
  buf.download(out.data(), 32);
  for (int i = 0; i < 32; ++i) EXPECT_EQ(out[i], 3 * i + 2);
}
