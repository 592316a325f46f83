#include "runtime/cuda_utils.h"

#include <sstream>

namespace v4attn {

void throw_cuda_error(cudaError_t err, const char* what, const char* file, int line) {
  std::ostringstream os;
  os << "CUDA error " << cudaGetErrorName(err) << " (" << cudaGetErrorString(err) << ") in " << what
     << " at " << file << ":" << line;
  throw CudaError(os.str());
}

bool gpu_available(std::string* reason) {
  int n = 0;
  const cudaError_t err = cudaGetDeviceCount(&n);
  if (err != cudaSuccess || n == 0) {
    if (reason) *reason = std::string("no CUDA device (") + (err != cudaSuccess ? cudaGetErrorString(err) : "0 devices") + ")";
    cudaGetLastError();
    return false;
  }
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess || prop.major < 9) {
    if (reason) *reason = std::string("device 0 (") + prop.name + ") is not sm_90 or newer";
    return false;
  }
  return true;
}

}  // namespace v4attn
