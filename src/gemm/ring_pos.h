// Ring positions of the GEMMs' stage loops (v2, v3, the fused Q chain): host and device, so that a
// CPU test checks them against the division they replace.
#pragma once

#include <cstdint>

#include "v4attn/numerics.h"  // V4_HD

namespace v4attn::kernels::hopper {

// Stage `it` of a ring of `depth` slots sits in slot it % depth with barrier phase parity
// (it / depth) & 1. A loop that walks the stages in order advances this instead: with the depth a
// run-time value each `%` / `/` compiled to an integer division (~30 instructions and a dependent
// I2F / MUFU.RCP / F2I chain) in every stage, right before the stage's barrier wait (Nsight Compute,
// the fused Q chain's wq_b loop; docs/perf.md session 31).
struct RingPos {
  int slot = 0;
  uint32_t parity = 0u;
  V4_HD void advance(int depth) {
    if (++slot == depth) {
      slot = 0;
      parity ^= 1u;
    }
  }
};

}  // namespace v4attn::kernels::hopper
