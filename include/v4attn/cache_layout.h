// Paged cache byte layouts (cache-layouts.md). A page holds P data rows, then P scale rows,
// padded to a multiple of `align` bytes. Row loc: page = loc / P, slot = loc % P.
#pragma once

#include <cstdint>

#include "v4attn/numerics.h"

namespace v4attn {

enum class CacheKind : int {
  kWindowV41 = 0,   // 512 x e4m3 + 16 x ue8m0 (one per 32 dims)          528 B/token
  kWindowV4 = 1,    // 448 x e4m3 + 64 x bf16 RoPE tail; 7 x ue8m0 + 1 pad 584 B/token
  kCompressedFp4 = 2,  // 256 B e2m1 pairs + 32 x e4m3 scales (one per 16)  288 B/token
  kIndexK = 3,      // 64 B e2m1 pairs (128 values) + 4 x ue8m0 (one per 32) 68 B/token
};

struct CacheLayout {
  int32_t data_bytes;   // per token
  int32_t scale_bytes;  // per token
  int32_t align;        // page size rounded up to a multiple of this
  int32_t page_size;    // P tokens per page

  V4_HD int64_t page_bytes() const {
    const int64_t raw = static_cast<int64_t>(page_size) * (data_bytes + scale_bytes);
    return (raw + align - 1) / align * align;
  }
  V4_HD int64_t data_offset(int64_t loc) const {
    return (loc / page_size) * page_bytes() + (loc % page_size) * data_bytes;
  }
  V4_HD int64_t scale_offset(int64_t loc) const {
    return (loc / page_size) * page_bytes() + static_cast<int64_t>(page_size) * data_bytes +
           (loc % page_size) * scale_bytes;
  }
  // Bytes for a pool of n_tokens slots (whole pages).
  V4_HD int64_t pool_bytes(int64_t n_tokens) const {
    return (n_tokens + page_size - 1) / page_size * page_bytes();
  }
};

constexpr int kDefaultPageSize = 64;

V4_HD CacheLayout cache_layout(CacheKind kind, int page_size = kDefaultPageSize) {
  switch (kind) {
    case CacheKind::kWindowV41: return CacheLayout{512, 16, 512, page_size};
    case CacheKind::kWindowV4: return CacheLayout{448 + 128, 8, 576, page_size};
    case CacheKind::kCompressedFp4: return CacheLayout{256, 32, 256, page_size};
    case CacheKind::kIndexK: default: return CacheLayout{64, 4, 1, page_size};
  }
}

}  // namespace v4attn
