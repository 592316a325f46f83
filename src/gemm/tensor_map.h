// Host helper shared by the TMA GEMMs (v2 gemm_wgmma.cu, v3 gemm_wgmma_pipelined.cu): a 3-D byte
// tensor map for cp.async.bulk.tensor, encoded through the runtime's driver entry point (no -lcuda).
#pragma once

#include <cuda.h>

#include <cstdint>

namespace v4attn::kernels::detail {

// A 3-D byte tensor [groups][rows][cols] (row stride / group stride in bytes) read in boxes of
// {box_cols bytes, box_rows, 1} with the 128B swizzle; out-of-range elements are zero-filled.
// Throws (naming `who`) when the driver lacks the encoder or refuses the shape.
CUtensorMap make_byte_tensor_map_sw128(const char* who, const void* ptr, uint64_t cols, uint64_t rows, uint64_t groups,
                                       uint64_t row_stride, uint64_t group_stride, uint32_t box_cols, uint32_t box_rows);

}  // namespace v4attn::kernels::detail
