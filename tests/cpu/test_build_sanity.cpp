#include <gtest/gtest.h>

#include "v4attn/cache_layout.h"

TEST(CacheLayout, PageBytesMatchTheSpec) {
  using namespace v4attn;
  const CacheLayout w = cache_layout(CacheKind::kWindowV41, 64);
  EXPECT_EQ(w.data_bytes + w.scale_bytes, 528);
  EXPECT_EQ(w.page_bytes() % 512, 0);
  EXPECT_EQ(cache_layout(CacheKind::kWindowV4).data_bytes + cache_layout(CacheKind::kWindowV4).scale_bytes, 584);
  EXPECT_EQ(cache_layout(CacheKind::kCompressedFp4).data_bytes + cache_layout(CacheKind::kCompressedFp4).scale_bytes, 288);
  EXPECT_EQ(cache_layout(CacheKind::kIndexK).data_bytes + cache_layout(CacheKind::kIndexK).scale_bytes, 68);
  // Row 70 of a 64-slot page: second page, slot 6.
  EXPECT_EQ(w.data_offset(70), w.page_bytes() + 6 * 512);
  EXPECT_EQ(w.scale_offset(70), w.page_bytes() + 64 * 512 + 6 * 16);
}
