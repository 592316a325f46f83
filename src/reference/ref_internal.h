// Helpers shared by the CPU reference's translation units (not a public interface).
#pragma once

#include <cstdint>

namespace v4attn::ref {

// Quantises `rows` (1..32) rows of k fp32 weights (one 32-row block strip, row-major) into e4m3
// codes [rows, k] and one ue8m0 scale per 32 columns [k/32], as quantize_fp8_blocks does.
void quantize_fp8_strip(const float* w, int64_t rows, int64_t k, uint8_t* codes, uint8_t* scales);

}  // namespace v4attn::ref

#include <string>

#include "v4attn/cache_layout.h"
#include "v4attn/numerics.h"

namespace v4attn::ref::detail {

[[noreturn]] void fail(const std::string& what);  // throws std::invalid_argument(what)
void require(bool ok, const char* who, const std::string& what);  // fail("who: what") unless ok
void require_ptr(const void* p, const char* who, const char* name);  // "who: name is null"
// Every pos[i] (i < n) in [0, max_pos); names the first bad row.
void require_positions(const int32_t* pos, int64_t n, int64_t max_pos, const char* who, const char* what = "pos");
// The layout has the per-token byte sizes of `kind` (and a positive page size).
void require_layout(const CacheLayout& layout, CacheKind kind, const char* who);

// RMSNorm of one row of n bf16 values (numerics.h LaneSum order), bf16 out; y may alias x.
void rmsnorm_row(const num::bf16_t* x, int n, const float* w, float eps, num::bf16_t* y);
// RoPE (or inverse) on the last 64 values of v[0..len) with one table row (32 (cos, sin) pairs),
// each result rounded to bf16.
void rope_tail(num::bf16_t* v, int len, const float* table_row, bool inverse = false);

}  // namespace v4attn::ref::detail
