// Shared by GPU tests: skip with a reason when no sm_90+ GPU is present (CI has none).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "kernels/device_common.cuh"
#include "runtime/cuda_utils.h"
#include "runtime/launch.h"

#define V4_REQUIRE_GPU()                                          \
  do {                                                            \
    std::string v4_reason_;                                       \
    if (!::v4attn::gpu_available(&v4_reason_)) GTEST_SKIP() << "needs an sm_90 GPU: " << v4_reason_; \
  } while (0)

// Buffers shared by the kernel tests (one definition instead of a copy per test file).
namespace v4attn::test_util {

constexpr uint8_t kOutputPoison = 0xAB;     // every output byte before a launch
constexpr size_t kOutputGuardBytes = 256;   // poisoned tail after every output, must stay poison

// A device copy of h (at least 4 elements, so that an empty input still has a valid pointer).
template <class T>
DeviceBuffer<T> to_device(const std::vector<T>& h) {
  DeviceBuffer<T> d(std::max<size_t>(h.size(), 4));
  if (!h.empty()) d.upload(h.data(), h.size());
  return d;
}

template <class T>
std::vector<T> to_host(const DeviceBuffer<T>& d) {
  std::vector<T> h(d.size());
  d.download(h.data(), h.size());
  return h;
}

// An output buffer of n elements plus a guard tail, all poisoned.
template <class T>
struct PoisonedOutput {
  size_t n;
  DeviceBuffer<uint8_t> buf;
  explicit PoisonedOutput(size_t n_elems) : n(n_elems), buf(n_elems * sizeof(T) + kOutputGuardBytes) {
    buf.fill_bytes(kOutputPoison);
  }
  T* get() const { return reinterpret_cast<T*>(buf.get()); }
  // Downloads the n elements and checks that the guard tail is untouched.
  std::vector<T> download_checked() const {
    std::vector<uint8_t> raw(buf.size());
    buf.download(raw.data(), raw.size());
    for (size_t i = n * sizeof(T); i < raw.size(); ++i)
      if (raw[i] != kOutputPoison) {
        ADD_FAILURE() << "write past the end of the output, byte " << i - n * sizeof(T) << " of the guard";
        break;
      }
    std::vector<T> out(n);
    std::memcpy(out.data(), raw.data(), n * sizeof(T));
    return out;
  }
};

// A device error counter (the kernels' err_count), zeroed.
struct ErrorCount {
  DeviceBuffer<unsigned long long> buf{1};
  ErrorCount() { buf.fill_bytes(0); }
  unsigned long long* get() const { return buf.get(); }
  unsigned long long read() const {
    unsigned long long v = 0;
    buf.download(&v, 1);
    return v;
  }
};

// ---- launch modes and the late producer (PDL tests) --------------------------------------------
// kPdlLate: a kernel's input is written by a "late producer" that lets its dependents launch at
// once, spins ~25 us, then copies the input in; a kernel that reads it before griddepcontrol.wait
// sees poison and fails its comparison.
enum class Launch { kPlain, kPdl, kPdlLate };
inline bool pdl_of(Launch m) { return m != Launch::kPlain; }
inline const char* launch_name(Launch m) {
  return m == Launch::kPlain ? "plain" : (m == Launch::kPdl ? "pdl" : "pdl-late");
}

namespace {  // internal linkage: every test file that includes this gets its own kernel
// The late producer: triggers its dependents first, spins, then copies src -> dst.
__global__ void late_copy_kernel(const uint4* src, uint4* dst, long long n16, long long spin_cycles) {
  dev::pdl_launch_dependents();
  const long long t0 = clock64();
  while (clock64() - t0 < spin_cycles) {
  }
  for (long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; i < n16;
       i += static_cast<long long>(gridDim.x) * blockDim.x)
    dst[i] = src[i];
}
}  // namespace

// Poisons `input` and queues the late producer that copies `staging` into it (bytes % 16 == 0);
// the caller then launches the kernel under test with PDL on the same stream.
inline void queue_late_producer(const void* staging, void* input, size_t bytes, uint8_t poison, cudaStream_t s) {
  V4_CUDA_CHECK(cudaMemsetAsync(input, poison, bytes, s));
  LaunchConfig cfg;
  cfg.grid = dim3(8, 1, 1);
  cfg.block = dim3(256, 1, 1);
  cfg.stream = s;
  launch_kernel("late_copy", late_copy_kernel, cfg, static_cast<const uint4*>(staging), static_cast<uint4*>(input),
                static_cast<long long>(bytes / 16), 50000LL);
}

// kPdlLate only: moves `input`'s content to `staging` and queues the late producer that restores
// it. Call right before the kernel launch on the same stream.
template <class T>
void late_feed(Launch mode, DeviceBuffer<T>& input, DeviceBuffer<T>& staging, uint8_t poison, cudaStream_t s) {
  if (mode != Launch::kPdlLate) return;
  ASSERT_EQ(input.bytes() % 16, 0u) << "late inputs are copied in 16-byte units";
  staging.resize(input.size());
  V4_CUDA_CHECK(cudaMemcpyAsync(staging.get(), input.get(), input.bytes(), cudaMemcpyDeviceToDevice, s));
  queue_late_producer(staging.get(), input.get(), input.bytes(), poison, s);
}

// A non-blocking stream per use; everything queued on the legacy stream before is finished.
struct TestStream {
  cudaStream_t s = nullptr;
  TestStream() {
    V4_CUDA_CHECK(cudaDeviceSynchronize());
    V4_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  }
  ~TestStream() {
    cudaStreamSynchronize(s);
    cudaStreamDestroy(s);
  }
  TestStream(const TestStream&) = delete;
  TestStream& operator=(const TestStream&) = delete;
};

}  // namespace v4attn::test_util
