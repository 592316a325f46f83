// Tests of the request pool and step metadata (step.h, cache-layouts.md "Slots"). Expected slots
// are written out by hand from the rules of cache-layouts.md.
#include <gtest/gtest.h>

#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "v4attn/reference/step.h"

namespace {

using namespace v4attn;

TEST(RefStepPool, PagesOf256AfterTheDummyPage) {
  // 3 requests, 300 positions -> 2 pages (512 slots) each, starting at slot 256.
  const RequestPool pool = make_request_pool(3, 300, 6, 128);
  EXPECT_EQ(pool.n_requests, 3);
  EXPECT_EQ(pool.max_context, 300);
  ASSERT_EQ(pool.req_to_token.size(), 900u);
  EXPECT_EQ(pool.full_slot(0, 0), 256);
  EXPECT_EQ(pool.full_slot(0, 299), 555);
  EXPECT_EQ(pool.full_slot(1, 0), 768);
  EXPECT_EQ(pool.full_slot(2, 7), 1280 + 7);
  EXPECT_EQ(pool.full_pool_slots(), 1280 + 300);
  EXPECT_EQ(pool.window_ring, 133);  // 128 + 6 - 1
  EXPECT_EQ(pool.pair_ring, 8);      // smallest power of two > 6
  EXPECT_EQ(pool.window_slot(2, 140), 2 * 133 + 7);
  EXPECT_EQ(pool.window_pool_slots(), 3 * 133);
  EXPECT_EQ(make_request_pool(1, 256, 1, 128).pair_ring, 2);
  EXPECT_EQ(make_request_pool(1, 256, 8, 128).pair_ring, 16);
  EXPECT_EQ(make_request_pool(1, 256, 1, 128).window_ring, 128);
}

TEST(RefStepPool, CompressedSlotsOfDifferentGroupsNeverCollide) {
  const RequestPool pool = make_request_pool(3, 700, 6, 128);
  for (int r = 1; r <= 2; ++r) {
    std::set<int32_t> seen;
    for (int req = 0; req < pool.n_requests; ++req)
      for (int p = r - 1; p < pool.max_context; p += r) {  // the completing position of each group
        const int32_t slot = pool.full_slot(req, p) / r;
        EXPECT_GT(slot, 0);
        EXPECT_TRUE(seen.insert(slot).second) << "ratio " << r << " request " << req << " position " << p;
      }
  }
}

TEST(RefStepPool, RefusesBadArguments) {
  EXPECT_THROW(make_request_pool(-1, 10, 1, 128), std::invalid_argument);
  EXPECT_THROW(make_request_pool(1, 0, 1, 128), std::invalid_argument);
  EXPECT_THROW(make_request_pool(1, 10, 0, 128), std::invalid_argument);
  EXPECT_THROW(make_request_pool(1, 10, 1, 0), std::invalid_argument);
  EXPECT_THROW(make_request_pool(100000, 1 << 20, 1, 128), std::invalid_argument);  // int32 slot overflow
}

TEST(RefStepBatch, DecodeAndVerifyRowsAreRequestMajorWithPadding) {
  const BatchDesc d = make_decode_batch({5, 9}, 4);
  EXPECT_EQ(d.req, (std::vector<int32_t>{0, 1, -1, -1}));
  EXPECT_EQ(d.pos, (std::vector<int32_t>{5, 9, 0, 0}));
  const BatchDesc v = make_verify_batch({5, 9}, 3, 7);
  EXPECT_EQ(v.req, (std::vector<int32_t>{0, 0, 0, 1, 1, 1, -1}));
  EXPECT_EQ(v.pos, (std::vector<int32_t>{5, 6, 7, 9, 10, 11, 0}));
  EXPECT_EQ(make_decode_batch({1, 2, 3}, 2).rows(), 3);  // pad_to below the row count adds nothing
  EXPECT_THROW(make_verify_batch({1}, 0), std::invalid_argument);
}

TEST(RefStepMeta, DecodeRowsByHand) {
  const RequestPool pool = make_request_pool(2, 512, 6, 128);  // bases 256 and 768; ring 133; pair ring 8
  const StepMeta m = build_step_meta(make_decode_batch({140, 7}, 3), pool, 1024);
  ASSERT_EQ(m.rows, 3);
  EXPECT_EQ(m.req, (std::vector<int32_t>{0, 1, -1}));
  EXPECT_EQ(m.pos, (std::vector<int32_t>{140, 7, 0}));
  EXPECT_EQ(m.out_cache_loc, (std::vector<int32_t>{396, 775, 0}));
  EXPECT_EQ(m.swa_loc, (std::vector<int32_t>{7, 133 + 7, -1}));
  EXPECT_EQ(m.c_out_loc[1], (std::vector<int32_t>{396, 775, -1}));
  EXPECT_EQ(m.c_out_loc[2], (std::vector<int32_t>{-1, 387, -1}));  // 140 even: no group completes
  EXPECT_EQ(m.clen[1], (std::vector<int32_t>{141, 8, 0}));
  EXPECT_EQ(m.clen[2], (std::vector<int32_t>{70, 4, 0}));
  EXPECT_EQ(m.pair_state_row, (std::vector<int32_t>{4, 8 + 7, -1}));
  EXPECT_EQ(m.pair_prev_row, (std::vector<int32_t>{-1, -1, -1}));
  EXPECT_EQ(m.pair_partner_state_row, (std::vector<int32_t>{-1, 8 + 6, -1}));
  EXPECT_TRUE(m.c_out_loc[0].empty());
  EXPECT_TRUE(m.clen[0].empty());
}

TEST(RefStepMeta, VerifyRowsByHand) {
  const RequestPool pool = make_request_pool(2, 512, 6, 128);
  // Request 0 from position 9 (odd: its first row pairs with the state), request 1 from 20.
  const StepMeta m = build_step_meta(make_verify_batch({9, 20}, 6), pool, 1024);
  ASSERT_EQ(m.rows, 12);
  for (int i = 0; i < 6; ++i) {
    const int p0 = 9 + i, p1 = 20 + i;
    EXPECT_EQ(m.out_cache_loc[i], 256 + p0);
    EXPECT_EQ(m.out_cache_loc[6 + i], 768 + p1);
    EXPECT_EQ(m.swa_loc[i], p0 % 133);
    EXPECT_EQ(m.swa_loc[6 + i], 133 + p1 % 133);
    EXPECT_EQ(m.c_out_loc[2][i], p0 % 2 == 1 ? (256 + p0) / 2 : -1);
    EXPECT_EQ(m.c_out_loc[2][6 + i], p1 % 2 == 1 ? (768 + p1) / 2 : -1);
    EXPECT_EQ(m.pair_state_row[i], p0 % 8);
    EXPECT_EQ(m.pair_state_row[6 + i], 8 + p1 % 8);
    EXPECT_EQ(m.pair_prev_row[i], i == 0 ? -1 : i - 1);  // row 0 of each block has no batch partner
    EXPECT_EQ(m.pair_prev_row[6 + i], i == 0 ? -1 : 6 + i - 1);
    EXPECT_EQ(m.pair_partner_state_row[i], p0 % 2 == 1 ? (p0 - 1) % 8 : -1);
    EXPECT_EQ(m.pair_partner_state_row[6 + i], p1 % 2 == 1 ? 8 + (p1 - 1) % 8 : -1);
  }
  EXPECT_EQ(m.c_out_loc[2][0], (256 + 9) / 2);
  EXPECT_EQ(m.pair_partner_state_row[0], 0);  // (9 - 1) % 8
}

TEST(RefStepMeta, RefusesBadRowsWithClearMessages) {
  const RequestPool pool = make_request_pool(2, 1000, 1, 128);
  auto message = [&](const BatchDesc& b, int max_pos) -> std::string {
    try {
      build_step_meta(b, pool, max_pos);
    } catch (const std::invalid_argument& e) {
      return e.what();
    }
    return "(no error)";
  };
  BatchDesc b = make_decode_batch({1, 2, 3, 900});
  b.req = {0, 1, 1, 0};
  EXPECT_EQ(message(b, 800), "row 3: position 900 is past the RoPE table (max_pos 800)");
  b.pos[3] = 1000;
  EXPECT_EQ(message(b, 4096), "row 3: position 1000 is past the request's context (max_context 1000)");
  b.pos[3] = 5;
  b.req[1] = 7;
  EXPECT_EQ(message(b, 4096), "row 1: unknown request 7 (pool has 2 requests)");
  b.req[1] = -2;
  EXPECT_EQ(message(b, 4096), "row 1: unknown request -2 (pool has 2 requests)");
  b.req[1] = 1;
  b.pos[0] = -1;
  EXPECT_EQ(message(b, 4096), "row 0: position -1 is negative");
  b.pos[0] = 0;
  EXPECT_EQ(message(b, 4096), "(no error)");
  b.pos.pop_back();
  EXPECT_THROW(build_step_meta(b, pool, 4096), std::invalid_argument);
}

}  // namespace
