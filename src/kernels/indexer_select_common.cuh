// Keys shared by the indexer's selection kernels (top-k and candidate mask): v2 in
// indexer_topk.cu, v3 in indexer_select_v3.cu. Both select on order-preserving uint32 keys of
// fp32 scores, key 0 meaning "not selectable" (-inf, masked, past clen).
#pragma once

#include <cstdint>

#include "kernels/indexer_select_keys.h"  // value_key
#include "v4attn/numerics.h"

namespace v4attn::kernels::select_keys {

__device__ __forceinline__ float neg_inf() { return -__int_as_float(0x7f800000); }

// Key of candidate block b < n_blocks: max over its positions below clen (num::max_f from -inf,
// in position order, as the reference; the sign of a zero maximum does not matter, +0 and -0
// share a key), the newest block pinned to +inf. vec8: 8-position blocks at 16-byte aligned rows.
__device__ __forceinline__ uint32_t block_key(const float* row, int64_t c, int block, int64_t b, int64_t newest,
                                              bool vec8) {
  if (b == newest) return value_key(__int_as_float(0x7f800000));
  float v = neg_inf();
  const int64_t j0 = b * block, j1 = min(j0 + block, c);
  if (vec8 && j1 == j0 + 8) {
    const float4 x = *reinterpret_cast<const float4*>(row + j0);
    const float4 y = *reinterpret_cast<const float4*>(row + j0 + 4);
    v = num::max_f(num::max_f(num::max_f(num::max_f(v, x.x), x.y), x.z), x.w);
    v = num::max_f(num::max_f(num::max_f(num::max_f(v, y.x), y.y), y.z), y.w);
  } else {
    for (int64_t j = j0; j < j1; ++j) v = num::max_f(v, row[j]);
  }
  return v > neg_inf() ? value_key(v) : 0u;
}

}  // namespace v4attn::kernels::select_keys
