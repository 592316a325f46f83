// A device-side error counter (one unsigned long long in device memory) that kernels bump with
// dev::count_error() when they skip something bad (an out-of-range cache slot, a position outside
// the RoPE table); the host reads and resets it. RAII, move-only; errors throw (CudaError).
#pragma once

#include <cuda_runtime.h>

#include "runtime/cuda_utils.h"

namespace v4attn {

class DeviceErrorCounter {
 public:
  // Zeroed on `stream` and waited for: a plain cudaMemset may still be in flight on the legacy
  // stream, which a non-blocking stream does not order against.
  explicit DeviceErrorCounter(cudaStream_t stream = nullptr) {
    V4_CUDA_CHECK(cudaMalloc(&ptr_, sizeof(unsigned long long)));
    V4_CUDA_CHECK(cudaMemsetAsync(ptr_, 0, sizeof(unsigned long long), stream));
    V4_CUDA_CHECK(cudaStreamSynchronize(stream));
  }
  ~DeviceErrorCounter() {
    if (ptr_) cudaFree(ptr_);
  }
  DeviceErrorCounter(const DeviceErrorCounter&) = delete;
  DeviceErrorCounter& operator=(const DeviceErrorCounter&) = delete;
  DeviceErrorCounter(DeviceErrorCounter&& o) noexcept : ptr_(o.ptr_) { o.ptr_ = nullptr; }
  DeviceErrorCounter& operator=(DeviceErrorCounter&& o) noexcept {
    if (this != &o) {
      if (ptr_) cudaFree(ptr_);
      ptr_ = o.ptr_;
      o.ptr_ = nullptr;
    }
    return *this;
  }

  // The device pointer to pass as a kernel's err_count.
  unsigned long long* get() const { return ptr_; }
  // Waits for `stream` (everything queued on it before), then returns the count.
  unsigned long long read(cudaStream_t stream = nullptr) const {
    unsigned long long v = 0;
    V4_CUDA_CHECK(cudaMemcpyAsync(&v, ptr_, sizeof(v), cudaMemcpyDeviceToHost, stream));
    V4_CUDA_CHECK(cudaStreamSynchronize(stream));
    return v;
  }
  // Zeroes the counter in stream order.
  void reset(cudaStream_t stream = nullptr) { V4_CUDA_CHECK(cudaMemsetAsync(ptr_, 0, sizeof(unsigned long long), stream)); }

 private:
  unsigned long long* ptr_ = nullptr;
};

}  // namespace v4attn
