// Tests of the paged cache byte layouts (include/v4attn/cache_layout.h) against cache-layouts.md:
// page size, data and scale offsets of every cache kind, recomputed from the spec's formula with
// the spec table's literal numbers (not the layout's own fields), at several page sizes.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "v4attn/cache_layout.h"

namespace {

using namespace v4attn;

// One row of cache-layouts.md's table, as the spec writes it.
struct SpecLayout {
  CacheKind kind;
  const char* name;
  int64_t data_bytes;   // per token
  int64_t scale_bytes;  // per token
  int64_t align;        // page bytes are a multiple of this
};

// data: V41 512 x e4m3; V4 448 x e4m3 + 64 x bf16 = 576; FP4 256 B; index K 64 B.
// scales: V41 16 x ue8m0; V4 7 x ue8m0 + 1 pad; FP4 32 x e4m3; index K 4 x ue8m0.
// The index-K row gives no align (only "pages of 64 slots"): its pages are not padded.
constexpr SpecLayout kSpecLayouts[] = {
    {CacheKind::kWindowV41, "window V41", 512, 16, 512},
    {CacheKind::kWindowV4, "window V4", 448 + 64 * 2, 7 + 1, 576},
    {CacheKind::kCompressedFp4, "compressed FP4", 256, 32, 256},
    {CacheKind::kIndexK, "index K", 64, 4, 1},
};

int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

int64_t spec_page_bytes(const SpecLayout& s, int64_t P) {
  return round_up(P * (s.data_bytes + s.scale_bytes), s.align);
}
int64_t spec_data_offset(const SpecLayout& s, int64_t P, int64_t loc) {
  const int64_t page = loc / P, slot = loc % P;
  return page * spec_page_bytes(s, P) + slot * s.data_bytes;
}
int64_t spec_scale_offset(const SpecLayout& s, int64_t P, int64_t loc) {
  const int64_t page = loc / P, slot = loc % P;
  return page * spec_page_bytes(s, P) + P * s.data_bytes + slot * s.scale_bytes;
}

TEST(CacheLayout, BytesPerTokenAreTheSpecTable) {
  for (const SpecLayout& s : kSpecLayouts) {
    const CacheLayout L = cache_layout(s.kind);
    EXPECT_EQ(L.data_bytes, s.data_bytes) << s.name;
    EXPECT_EQ(L.scale_bytes, s.scale_bytes) << s.name;
    EXPECT_EQ(L.page_size, kDefaultPageSize) << s.name;
  }
  EXPECT_EQ(kDefaultPageSize, 64);  // the index-K pool is defined with pages of 64 slots
}

TEST(CacheLayout, PagesAndOffsetsFollowTheSpecFormula) {
  // P = 1 and 3 make every padded kind pad (e.g. V41: 528 -> 1024); at P = 64 only the V4 layout
  // pads (64 x 584 = 37376 -> 37440), which is why the default page size alone is not enough.
  const int64_t page_sizes[] = {1, 3, 64, 256};
  for (const SpecLayout& s : kSpecLayouts) {
    for (const int64_t P : page_sizes) {
      const CacheLayout L = cache_layout(s.kind, static_cast<int>(P));
      // Mismatches are collected into one message per (kind, P): one wrong constant would
      // otherwise fail every slot separately.
      std::string bad;
      auto check = [&bad](const std::string& what, int64_t got, int64_t want) {
        if (got != want) bad += "\n  " + what + " = " + std::to_string(got) + ", spec " + std::to_string(want);
      };
      check("page_bytes", L.page_bytes(), spec_page_bytes(s, P));
      // First, second, last slot of page 0; first slot of page 1; inside page 2; slots 64 and
      // past (where an unpadded V4 page at P = 64 would start early); and a slot whose byte
      // offset exceeds 2^31 (a multi-GB pool: offsets must be 64-bit).
      std::vector<int64_t> locs = {0, 1, P - 1, P, 2 * P + 5, 64, 65, 130, 40'000'000};
      std::sort(locs.begin(), locs.end());
      locs.erase(std::unique(locs.begin(), locs.end()), locs.end());  // P = 1 repeats some
      for (const int64_t loc : locs) {
        check("data_offset(" + std::to_string(loc) + ")", L.data_offset(loc), spec_data_offset(s, P, loc));
        check("scale_offset(" + std::to_string(loc) + ")", L.scale_offset(loc), spec_scale_offset(s, P, loc));
      }
      // A pool is whole pages.
      for (const int64_t n : {P, P + 1, 3 * P + 2})
        check("pool_bytes(" + std::to_string(n) + ")", L.pool_bytes(n), (n + P - 1) / P * spec_page_bytes(s, P));
      EXPECT_TRUE(bad.empty()) << s.name << ", P = " << P << ":" << bad;
    }
  }
}

TEST(CacheLayout, DefaultPagesWithTheSpecsLiteralSizes) {
  // The numbers worked out by hand for 64-slot pages, so that a wrong formula in this file and
  // the same wrong formula in the header cannot agree unnoticed.
  EXPECT_EQ(cache_layout(CacheKind::kWindowV41).page_bytes(), 33792);      // 64 x 528 = 66 x 512
  EXPECT_EQ(cache_layout(CacheKind::kWindowV4).page_bytes(), 37440);       // 64 x 584 = 37376 -> 65 x 576
  EXPECT_EQ(cache_layout(CacheKind::kCompressedFp4).page_bytes(), 18432);  // 64 x 288 = 72 x 256
  EXPECT_EQ(cache_layout(CacheKind::kIndexK).page_bytes(), 4352);          // 64 x 68
  // V4, slot 64 (page 1, slot 0) and slot 70's scales: 37440 + 64 x 576 + 6 x 8.
  EXPECT_EQ(cache_layout(CacheKind::kWindowV4).data_offset(64), 37440);
  EXPECT_EQ(cache_layout(CacheKind::kWindowV4).scale_offset(70), 37440 + 36864 + 48);
  // One-slot pages: V41 528 -> 1024, V4 584 -> 1152, FP4 288 -> 512, index K 68.
  EXPECT_EQ(cache_layout(CacheKind::kWindowV41, 1).page_bytes(), 1024);
  EXPECT_EQ(cache_layout(CacheKind::kWindowV4, 1).page_bytes(), 1152);
  EXPECT_EQ(cache_layout(CacheKind::kCompressedFp4, 1).page_bytes(), 512);
  EXPECT_EQ(cache_layout(CacheKind::kIndexK, 1).page_bytes(), 68);
}

}  // namespace
