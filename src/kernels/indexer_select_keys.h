// The selections' order-preserving key of a score, host and device: the top-k and candidate-mask
// kernels (indexer_select_common.cuh, v1 / v2 / v3) select on it, and the host models of the
// selections (tests/cpu/test_select_window.cpp, the window-path checks of the GPU tests) build it
// with the same function.
#pragma once

#include <cstdint>

#include "v4attn/numerics.h"

namespace v4attn::kernels::select_keys {

// Order-preserving key of a selectable value (v > -inf, so never NaN); -0.0 maps like +0.0.
V4_HD uint32_t value_key(float v) {
  uint32_t u = num::f32_bits(v);
  if (u == 0x80000000u) u = 0u;
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

}  // namespace v4attn::kernels::select_keys
