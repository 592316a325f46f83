// Positions the GEMMs' loops advance instead of dividing by a run-time value: the ring slot of the
// stage loops (v2, v3, the fused Q chain) and the (token, block) walk of the activation-scale loads
// (v2, v3). Host and device, so that a CPU test checks them against the divisions they replace.
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

// Item i = token * nkb + block of an NP x nkb table walked by `threads` threads (thread tid takes
// i = tid, tid + threads, ...): the thread's current (token, block) and the step between its items.
// `make` divides once (the kernels do it before their PDL wait: wgmma_fp8::act_scale_walk); the loads
// after the wait only add (session 32: each item's i / nkb had been an I2F.RP / MUFU.RCP / F2I chain
// right after the wait, on the critical path).
struct ActScaleWalk {
  int tok, b, dtok, db;
  V4_HD static ActScaleWalk make(int nkb, int tid, int threads) {
    const int n = nkb > 0 ? nkb : 1;  // no K blocks: no item (the first token is past any NP)
    return ActScaleWalk{nkb > 0 ? tid / n : (1 << 30), tid % n, threads / n, threads % n};
  }
  // The thread's next item (threads further on): block b + db, with a carry into the token.
  V4_HD void advance(int nkb) {
    tok += dtok;
    b += db;
    if (b >= nkb) b -= nkb, ++tok;
  }
};

}  // namespace v4attn::kernels::hopper
