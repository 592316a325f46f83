// hopper::RingPos (src/gemm/ring_pos.h): the stage loops of the GEMMs advance it instead of dividing
// by the ring depth; it must name the same slot and barrier parity as it % depth and (it / depth) & 1
// for every depth a ring can have and well past several wraps.
#include <gtest/gtest.h>

#include "gemm/ring_pos.h"

namespace {

using v4attn::kernels::hopper::RingPos;

TEST(RingPos, MatchesTheDivisionForEveryDepth) {
  for (int depth = 1; depth <= 8; ++depth) {
    RingPos rp;
    for (int it = 0; it < 200; ++it, rp.advance(depth)) {
      ASSERT_EQ(rp.slot, it % depth) << "depth " << depth << " stage " << it;
      ASSERT_EQ(rp.parity, static_cast<uint32_t>((it / depth) & 1)) << "depth " << depth << " stage " << it;
    }
  }
}

// v2's pairs and v3's consumers take the second stage's position as a copy of the first's advanced
// once, while the first's stays in use.
TEST(RingPos, CopiesAdvanceIndependently) {
  const int depth = 6;
  RingPos a;
  for (int it = 0; it < 40; it += 2) {
    RingPos b = a;
    b.advance(depth);
    EXPECT_EQ(b.slot, (it + 1) % depth);
    EXPECT_EQ(b.parity, static_cast<uint32_t>(((it + 1) / depth) & 1));
    EXPECT_EQ(a.slot, it % depth);  // the copy left the original alone
    a.advance(depth);
    a.advance(depth);
  }
}

}  // namespace
