#include "gemm/tensor_map.h"

#include <cudaTypedefs.h>

#include <mutex>
#include <stdexcept>
#include <string>

#include "runtime/cuda_utils.h"

namespace v4attn::kernels::detail {
namespace {

PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder(const char* who) {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = nullptr;
  static std::once_flag once;
  std::call_once(once, [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult q{};
    V4_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &q));
    if (q == cudaDriverEntryPointSuccess) fn = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(f);
  });
  if (fn == nullptr) throw CudaError(std::string(who) + ": cuTensorMapEncodeTiled is not available from the driver");
  return fn;
}

}  // namespace

CUtensorMap make_byte_tensor_map_sw128(const char* who, const void* ptr, uint64_t cols, uint64_t rows, uint64_t groups,
                                       uint64_t row_stride, uint64_t group_stride, uint32_t box_cols, uint32_t box_rows) {
  CUtensorMap map;
  const cuuint64_t dims[3] = {cols, rows, groups};
  const cuuint64_t strides[2] = {row_stride, group_stride};
  const cuuint32_t box[3] = {box_cols, box_rows, 1};
  const cuuint32_t elem_strides[3] = {1, 1, 1};
  const CUresult r = tensor_map_encoder(who)(&map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 3, const_cast<void*>(ptr), dims, strides,
                                             box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                             CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS)
    throw std::invalid_argument(std::string(who) + ": cuTensorMapEncodeTiled failed (" +
                                std::to_string(static_cast<int>(r)) + ") for a " + std::to_string(groups) + " x " +
                                std::to_string(rows) + " x " + std::to_string(cols) + " tensor (row stride " +
                                std::to_string(row_stride) + ", group stride " + std::to_string(group_stride) + ")");
  return map;
}

}  // namespace v4attn::kernels::detail
