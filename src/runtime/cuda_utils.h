// CUDA error handling and device queries shared by the runtime, kernels, tests and benches.
// Errors throw (never exit): a GoogleTest binary or an engine embedding v4attn must survive.
#pragma once

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

namespace v4attn {

struct CudaError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

[[noreturn]] void throw_cuda_error(cudaError_t err, const char* what, const char* file, int line);

#define V4_CUDA_CHECK(expr)                                                        \
  do {                                                                             \
    cudaError_t v4_err_ = (expr);                                                  \
    if (v4_err_ != cudaSuccess) ::v4attn::throw_cuda_error(v4_err_, #expr, __FILE__, __LINE__); \
  } while (0)

// After a launch: the launch error (sync errors surface at the next synchronising call).
#define V4_CUDA_CHECK_LAUNCH() V4_CUDA_CHECK(cudaGetLastError())

// True when a CUDA device of compute capability >= 9.0 is usable; otherwise `reason` says why.
bool gpu_available(std::string* reason = nullptr);

// RAII device buffer (plain cudaMalloc; no managed memory).
template <class T>
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t n) { resize(n); }
  ~DeviceBuffer() { reset(); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& o) noexcept : ptr_(o.ptr_), n_(o.n_) { o.ptr_ = nullptr; o.n_ = 0; }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    if (this != &o) { reset(); ptr_ = o.ptr_; n_ = o.n_; o.ptr_ = nullptr; o.n_ = 0; }
    return *this;
  }
  void resize(size_t n) {
    reset();
    if (n) V4_CUDA_CHECK(cudaMalloc(&ptr_, n * sizeof(T)));
    n_ = n;
  }
  void reset() {
    if (ptr_) cudaFree(ptr_);
    ptr_ = nullptr;
    n_ = 0;
  }
  T* get() const { return ptr_; }
  size_t size() const { return n_; }
  size_t bytes() const { return n_ * sizeof(T); }
  void upload(const T* h, size_t n, cudaStream_t s = nullptr) {
    if (n > n_) throw std::invalid_argument("DeviceBuffer::upload: more elements than allocated");
    V4_CUDA_CHECK(cudaMemcpyAsync(ptr_, h, n * sizeof(T), cudaMemcpyHostToDevice, s));
  }
  void download(T* h, size_t n, cudaStream_t s = nullptr) const {
    if (n > n_) throw std::invalid_argument("DeviceBuffer::download: more elements than allocated");
    V4_CUDA_CHECK(cudaMemcpyAsync(h, ptr_, n * sizeof(T), cudaMemcpyDeviceToHost, s));
    V4_CUDA_CHECK(cudaStreamSynchronize(s));
  }
  void fill_bytes(int byte, cudaStream_t s = nullptr) {
    if (n_) V4_CUDA_CHECK(cudaMemsetAsync(ptr_, byte, bytes(), s));
  }

 private:
  T* ptr_ = nullptr;
  size_t n_ = 0;
};

}  // namespace v4attn
