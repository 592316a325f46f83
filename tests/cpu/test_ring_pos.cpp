// hopper::RingPos (src/gemm/ring_pos.h): the stage loops of the GEMMs advance it instead of dividing
// by the ring depth; it must name the same slot and barrier parity as it % depth and (it / depth) & 1
// for every depth a ring can have and well past several wraps. hopper::ActScaleWalk: the (token,
// block) of every activation-scale item a thread loads, as i / nkb and i % nkb.
#include <gtest/gtest.h>

#include "gemm/ring_pos.h"

namespace {

using v4attn::kernels::hopper::ActScaleWalk;
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

// Every thread of a GEMM's loader (256 or 384 threads) walks items tid, tid + threads, ... of NP x nkb
// tables; the walk must visit exactly the (i / nkb, i % nkb) of those items, in that order, for the
// K-block counts of every split the GEMMs make (1 .. 48 here; V4.1's largest split holds 40) and
// for nkb larger than, equal to and dividing the thread count.
TEST(ActScaleWalk, VisitsTheItemsOfTheDivision) {
  for (int threads : {128, 256, 384})
    for (int np : {8, 16, 32, 64})
      for (int nkb : {1, 2, 3, 5, 7, 10, 20, 32, 40, 48, 128, 384, 500}) {
        const int total = np * nkb;
        for (int tid = 0; tid < threads; ++tid) {
          ActScaleWalk w = ActScaleWalk::make(nkb, tid, threads);
          int i = tid;
          for (; w.tok < np; w.advance(nkb), i += threads) {
            ASSERT_LT(i, total) << "walk past the table: threads " << threads << " nkb " << nkb << " tid " << tid;
            ASSERT_EQ(w.tok, i / nkb) << "threads " << threads << " nkb " << nkb << " item " << i;
            ASSERT_EQ(w.b, i % nkb) << "threads " << threads << " nkb " << nkb << " item " << i;
          }
          EXPECT_GE(i, total) << "the walk stopped early: threads " << threads << " nkb " << nkb << " tid " << tid;
        }
      }
}

// No K blocks (an empty split): no item, whatever the thread.
TEST(ActScaleWalk, EmptyRangeHasNoItem) {
  for (int tid = 0; tid < 384; ++tid) EXPECT_GE(ActScaleWalk::make(0, tid, 384).tok, 64);
}

}  // namespace
