// Shared by GPU tests: skip with a reason when no sm_90+ GPU is present (CI has none).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "runtime/cuda_utils.h"

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

}  // namespace v4attn::test_util
