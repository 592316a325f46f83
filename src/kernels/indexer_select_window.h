// The arithmetic of the selections' window exchange (indexer_select_v3.cu, kWindow kernels), host
// and device: the kernel and its CPU model (tests/cpu/test_select_window.cpp) call the same
// functions, so CI checks the alignment of the CTAs' windows and the exchange's decision on every
// case the model builds, without a GPU.
//
// Keys are the selections' order-preserving 32-bit keys (select_keys::value_key): 0 = never
// selected, finite values below kInfKey, +inf at kInfKey. A CTA whose largest finite key is `top`
// counts its finite keys by 16-bit prefix (key >> 16) in the 256 prefixes [base(top), top >> 16];
// every CTA of the cluster receives every CTA's histogram and top and adds, for each prefix under
// the cluster's largest top, the counts of the CTAs whose window holds it (a CTA's keys of a prefix
// above its own window do not exist: its window ends at its largest key).
#pragma once

#include <cstdint>

#include "v4attn/numerics.h"

namespace v4attn::kernels::select_window {

constexpr uint32_t kInfKey = 0xff800000u;  // value_key(+inf)
constexpr int kBins = 256;                 // prefixes per window

// The first 16-bit prefix of the window of a CTA whose largest finite key is top_key (0: none).
V4_HD uint32_t base(uint32_t top_key) {
  const uint32_t top = top_key >> 16;
  return top >= kBins - 1 ? top - (kBins - 1) : 0u;
}

// Whether a key is counted by a window starting at key lo = base << 16, and its bin there (keys
// below lo wrap past the span; +inf and invalid keys are not counted).
V4_HD bool counts(uint32_t key, uint32_t lo) { return key != 0u && key - lo <= (kInfKey - 1u) - lo; }
V4_HD uint32_t bin(uint32_t key, uint32_t lo) { return (key - lo) >> 16; }

// The count of 16-bit prefix `prefix` in the window histogram `hist` of a CTA whose largest finite
// key is r_top_key (0 where the window does not hold the prefix).
V4_HD uint32_t bin_count(const uint32_t* hist, uint32_t r_top_key, uint32_t prefix) {
  const uint32_t r_base = base(r_top_key);
  return prefix >= r_base && prefix <= (r_top_key >> 16) ? hist[prefix - r_base] : 0u;
}

// Whether the exchange decides the k-th key's prefix: it is neither among the +inf keys (inf_all,
// which rank above every bin) nor below the cluster's window (in_window: the finite keys counted
// under the cluster's largest top). Else the selection runs radix pass 0.
V4_HD bool decides(uint32_t inf_all, uint32_t in_window, uint32_t k) {
  return inf_all < k && k <= inf_all + in_window;
}

}  // namespace v4attn::kernels::select_window
