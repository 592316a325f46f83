// CPU reference of the lightning indexer and top-k (spec v41-attention.md section 3.4,
// cache-layouts.md "index K" and "Top-k output").
#include "v4attn/reference/indexer.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>

namespace v4attn::ref {

namespace {

constexpr int kIndexHeadDim = 128;
constexpr int kIndexBlocks = kIndexHeadDim / num::kIndexerQuantBlock;  // 4 blocks of 32
constexpr int kIndexCodeBytes = kIndexHeadDim / 2;                    // 64 bytes of e2m1 pairs
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

[[noreturn]] void fail(const char* fn, const std::string& what) {
  throw std::invalid_argument(std::string(fn) + ": " + what);
}

// Twice the e2m1 value of a 4-bit code, as an integer: {0,1,2,3,4,6,8,12} with the sign. Twice,
// so that every grid value (multiples of 1/2) is an integer and block sums are integer sums.
int e2m1_twice(uint8_t code) { return static_cast<int>(num::f32_from_e2m1(code) * 2.0f); }

// The 128 codes of one packed head as integers (twice the value), element order.
void unpack_twice(const uint8_t* packed, int* out128) {
  for (int i = 0; i < kIndexCodeBytes; ++i) {
    out128[2 * i] = e2m1_twice(static_cast<uint8_t>(packed[i] & 0xfu));
    out128[2 * i + 1] = e2m1_twice(static_cast<uint8_t>(packed[i] >> 4));
  }
}

}  // namespace

IndexerQ indexer_q_pack(const bf16_t* qi, int64_t T, int heads, const int32_t* pos, const float* table,
                        int64_t max_pos) {
  static constexpr const char* kFn = "indexer_q_pack";
  if (T < 0 || heads <= 0) fail(kFn, "T must be >= 0 and heads > 0");
  if (T > 0 && (qi == nullptr || pos == nullptr || table == nullptr)) fail(kFn, "null input");
  for (int64_t t = 0; t < T; ++t)
    if (pos[t] < 0 || pos[t] >= max_pos)
      fail(kFn, "row " + std::to_string(t) + ": position " + std::to_string(pos[t]) +
                    " outside the RoPE table [0, " + std::to_string(max_pos) + ")");

  IndexerQ q;
  q.T = T;
  q.heads = heads;
  q.codes.assign(static_cast<size_t>(T) * heads * kIndexCodeBytes, 0);
  q.scales.assign(static_cast<size_t>(T) * heads * kIndexBlocks, 0);

  float v[kIndexHeadDim];
  for (int64_t t = 0; t < T; ++t) {
    const float* rope = table + static_cast<int64_t>(pos[t]) * num::kRopeDim;
    for (int h = 0; h < heads; ++h) {
      const bf16_t* src = qi + (t * heads + h) * kIndexHeadDim;
      for (int d = 0; d < kIndexHeadDim; ++d) v[d] = num::f32_from_bf16(src[d]);
      // RoPE on the last 64 dims (adjacent pairs), result rounded to bf16 like every stored Q.
      float* tail = v + (kIndexHeadDim - num::kRopeDim);
      for (int i = 0; i < num::kRopePairs; ++i) {
        float re, im;
        num::rope_rotate(tail[2 * i], tail[2 * i + 1], rope[2 * i], rope[2 * i + 1], re, im);
        tail[2 * i] = num::round_bf16(re);
        tail[2 * i + 1] = num::round_bf16(im);
      }
      // FP4 indexer quant per block of 32 (ue8m0 scale), packed two codes per byte.
      uint8_t* codes = q.codes.data() + (t * heads + h) * kIndexCodeBytes;
      uint8_t* scales = q.scales.data() + (t * heads + h) * kIndexBlocks;
      for (int b = 0; b < kIndexBlocks; ++b) {
        const float* blk = v + b * num::kIndexerQuantBlock;
        float amax = 0.0f;
        for (int i = 0; i < num::kIndexerQuantBlock; ++i) amax = num::block_amax_step(amax, blk[i]);
        const int e = num::indexer_quant_scale_exp(amax);
        const float s = num::pow2_f32(e);
        scales[b] = num::ue8m0_from_exp(e);
        for (int i = 0; i < num::kIndexerQuantBlock; i += 2)
          codes[(b * num::kIndexerQuantBlock + i) / 2] =
              num::pack_e2m1(num::fp4_code(blk[i], s), num::fp4_code(blk[i + 1], s));
      }
    }
  }
  return q;
}

std::vector<float> indexer_weights(const bf16_t* wproj_out, int64_t T, int heads, int heads_total) {
  if (T < 0 || heads <= 0 || heads_total < heads)
    fail("indexer_weights", "need T >= 0 and 0 < heads <= heads_total");
  if (T > 0 && wproj_out == nullptr) fail("indexer_weights", "null input");
  // 128^-0.5 * heads_total^-0.5 = 1 / sqrt(128 * heads_total): evaluated once in double (sqrt is
  // correctly rounded) and rounded once to fp32. For heads_total = 32 this is 1/sqrt(4096) =
  // 1/64 exactly, so the product below is exact for the real model (a power of two times bf16).
  const float c = static_cast<float>(1.0 / std::sqrt(128.0 * static_cast<double>(heads_total)));
  std::vector<float> w(static_cast<size_t>(T) * heads);
  for (size_t i = 0; i < w.size(); ++i) w[i] = num::mul_rn(num::f32_from_bf16(wproj_out[i]), c);
  return w;
}

// Exactness of the block sums. An e2m1 value is a multiple of 1/2 with |v| <= 6, so the product of
// a query code and a key code is a multiple of 1/4 with magnitude <= 36, and a 32-term block sum is
// a multiple of 1/4 with magnitude <= 1152, i.e. an integer number of quarters below 2^13: exactly
// representable in fp32 and exactly accumulated in ANY order (here: integers, on twice-values).
// The block's scale product scale_q * scale_k is a power of two 2^(eq+ek), so
// block_sum = fp32(S * 2^(eq+ek)) is one correctly rounded ldexp, exact whenever the result is
// a normal fp32 number (always, unless a block's amax is below ~2^-100); a GPU kernel doing
// (S * scale_q) * scale_k in fp32 gets the same bits in that range. Only the combination of
// the four block sums, ((b0 + b1) + b2) + b3, the relu, the product with w and the head
// accumulation round, and they follow the fixed order below.
void indexer_scores(const IndexerQ& q, const float* w, const uint8_t* index_k_cache,
                    const CacheLayout& layout, int64_t n_slots, const int32_t* req,
                    const int32_t* clen, const int32_t* comp_slot_table, int64_t comp_table_stride,
                    float* scores, int64_t score_stride) {
  static constexpr const char* kFn = "indexer_scores";
  const int64_t T = q.T;
  const int heads = q.heads;
  if (T < 0 || heads <= 0) fail(kFn, "empty IndexerQ");
  if (q.codes.size() != static_cast<size_t>(T) * heads * kIndexCodeBytes ||
      q.scales.size() != static_cast<size_t>(T) * heads * kIndexBlocks)
    fail(kFn, "IndexerQ buffers do not match T x heads");
  if (layout.data_bytes != kIndexCodeBytes || layout.scale_bytes != kIndexBlocks)
    fail(kFn, "layout is not the index-K layout (64 + 4 bytes)");
  if (T == 0) return;
  if (w == nullptr || req == nullptr || clen == nullptr || scores == nullptr)
    fail(kFn, "null input");
  // Validate everything before writing anything.
  for (int64_t t = 0; t < T; ++t) {
    const int64_t c = clen[t];
    if (c < 0 || c > score_stride)
      fail(kFn, "row " + std::to_string(t) + ": clen " + std::to_string(c) +
                    " outside [0, score_stride=" + std::to_string(score_stride) + "]");
    if (req[t] < 0 || c == 0) continue;
    if (c > comp_table_stride) fail(kFn, "row " + std::to_string(t) + ": clen exceeds the slot table");
    if (comp_slot_table == nullptr || index_k_cache == nullptr) fail(kFn, "null slot table or cache");
    for (int64_t j = 0; j < c; ++j) {
      const int64_t slot = comp_slot_table[req[t] * comp_table_stride + j];
      if (slot < 0 || slot >= n_slots)
        fail(kFn, "row " + std::to_string(t) + ", position " + std::to_string(j) + ": slot " +
                      std::to_string(slot) + " outside [0, " + std::to_string(n_slots) + ")");
    }
  }

  int kq[kIndexHeadDim], kk[kIndexHeadDim];
  std::vector<int> q_twice(static_cast<size_t>(heads) * kIndexHeadDim);
  for (int64_t t = 0; t < T; ++t) {
    float* row = scores + t * score_stride;
    const int64_t c = req[t] < 0 ? 0 : clen[t];  // a padded row sees no position
    for (int64_t j = c; j < score_stride; ++j) row[j] = kNegInf;
    if (c == 0) continue;
    for (int h = 0; h < heads; ++h) {
      unpack_twice(q.codes.data() + (t * heads + h) * kIndexCodeBytes, kq);
      std::copy(kq, kq + kIndexHeadDim, q_twice.begin() + static_cast<int64_t>(h) * kIndexHeadDim);
    }
    for (int64_t j = 0; j < c; ++j) {
      const int64_t slot = comp_slot_table[req[t] * comp_table_stride + j];
      unpack_twice(index_k_cache + layout.data_offset(slot), kk);
      const uint8_t* k_scales = index_k_cache + layout.scale_offset(slot);
      float score = 0.0f;
      for (int h = 0; h < heads; ++h) {
        const int* qh = q_twice.data() + static_cast<int64_t>(h) * kIndexHeadDim;
        const uint8_t* q_scales = q.scales.data() + (t * heads + h) * kIndexBlocks;
        float dot = 0.0f;
        for (int b = 0; b < kIndexBlocks; ++b) {
          int sum4 = 0;  // 4 x the block sum (twice-values on both sides): an exact integer
          for (int i = b * 32; i < (b + 1) * 32; ++i) sum4 += qh[i] * kk[i];
          const int e = (static_cast<int>(q_scales[b]) - 127) + (static_cast<int>(k_scales[b]) - 127) - 2;
          const float block_sum = std::ldexp(static_cast<float>(sum4), e);
          dot = b == 0 ? block_sum : num::add_rn(dot, block_sum);
        }
        const float relu = dot > 0.0f ? dot : 0.0f;
        score = num::add_rn(score, num::mul_rn(relu, w[t * heads + h]));
      }
      row[j] = score;
    }
  }
}

void candidate_mask(const float* scores, int64_t T, int64_t score_stride, const int32_t* clen, int block,
                    int topk_blocks, uint8_t* mask, int64_t mask_stride) {
  static constexpr const char* kFn = "candidate_mask";
  if (T < 0 || block <= 0 || topk_blocks < 0) fail(kFn, "need T >= 0, block > 0, topk_blocks >= 0");
  if (T == 0) return;
  if (scores == nullptr || clen == nullptr || mask == nullptr) fail(kFn, "null input");
  for (int64_t t = 0; t < T; ++t) {
    if (clen[t] < 0 || clen[t] > score_stride) fail(kFn, "row " + std::to_string(t) + ": clen outside [0, score_stride]");
    if ((clen[t] + block - 1) / block > mask_stride) fail(kFn, "row " + std::to_string(t) + ": mask_stride too small");
  }

  struct BlockScore {
    float score;
    int64_t block;
  };
  std::vector<BlockScore> cand;
  for (int64_t t = 0; t < T; ++t) {
    uint8_t* m = mask + t * mask_stride;
    std::fill(m, m + mask_stride, uint8_t{0});
    const int64_t c = clen[t];
    if (c == 0) continue;
    const float* row = scores + t * score_stride;
    const int64_t n_blocks = (c + block - 1) / block;
    const int64_t newest = (c - 1) / block;
    cand.clear();
    for (int64_t b = 0; b < n_blocks; ++b) {
      float s = kNegInf;  // positions past clen (padding of the last block) count as -inf
      for (int64_t j = b * block; j < std::min<int64_t>((b + 1) * block, c); ++j) s = num::max_f(s, row[j]);
      if (b == newest) s = std::numeric_limits<float>::infinity();  // the newest block is always kept
      if (s > kNegInf) cand.push_back({s, b});  // a block of only -inf (or NaN) scores never counts
    }
    const int64_t keep = std::min<int64_t>({static_cast<int64_t>(topk_blocks), n_blocks,
                                            static_cast<int64_t>(cand.size())});
    // Highest score first; equal scores: lower block first (a strict total order).
    std::partial_sort(cand.begin(), cand.begin() + keep, cand.end(), [](const BlockScore& a, const BlockScore& b) {
      return a.score > b.score || (a.score == b.score && a.block < b.block);
    });
    for (int64_t i = 0; i < keep; ++i) m[cand[i].block] = 1;
  }
}

void apply_candidate_mask(float* scores, int64_t T, int64_t score_stride, const int32_t* clen, int block,
                          const uint8_t* mask, int64_t mask_stride) {
  static constexpr const char* kFn = "apply_candidate_mask";
  if (T < 0 || block <= 0) fail(kFn, "need T >= 0 and block > 0");
  if (T == 0) return;
  if (scores == nullptr || clen == nullptr || mask == nullptr) fail(kFn, "null input");
  for (int64_t t = 0; t < T; ++t) {
    if (clen[t] < 0 || clen[t] > score_stride) fail(kFn, "row " + std::to_string(t) + ": clen outside [0, score_stride]");
    if ((clen[t] + block - 1) / block > mask_stride) fail(kFn, "row " + std::to_string(t) + ": mask_stride too small");
  }
  for (int64_t t = 0; t < T; ++t) {
    float* row = scores + t * score_stride;
    const uint8_t* m = mask + t * mask_stride;
    for (int64_t j = 0; j < clen[t]; ++j)
      if (m[j / block] == 0) row[j] = kNegInf;
  }
}

void topk_to_slots(const float* scores, int64_t T, int64_t score_stride, const int32_t* clen, int topk,
                   const int32_t* req, const int32_t* comp_slot_table, int64_t comp_table_stride, int32_t* out,
                   int64_t out_stride) {
  static constexpr const char* kFn = "topk_to_slots";
  if (T < 0 || topk < 0) fail(kFn, "need T >= 0 and topk >= 0");
  if (out_stride <= 0 || out_stride % 64 != 0) fail(kFn, "out_stride must be a positive multiple of 64");
  if (topk > out_stride) fail(kFn, "topk exceeds out_stride");
  if (T == 0) return;
  if (scores == nullptr || clen == nullptr || req == nullptr || out == nullptr) fail(kFn, "null input");
  for (int64_t t = 0; t < T; ++t) {
    if (clen[t] < 0 || clen[t] > score_stride) fail(kFn, "row " + std::to_string(t) + ": clen outside [0, score_stride]");
    if (req[t] >= 0 && clen[t] > 0 && (comp_slot_table == nullptr || clen[t] > comp_table_stride))
      fail(kFn, "row " + std::to_string(t) + ": clen exceeds the slot table");
  }

  struct Candidate {
    float score;
    int64_t pos;
  };
  std::vector<Candidate> cand;
  for (int64_t t = 0; t < T; ++t) {
    int32_t* o = out + t * out_stride;
    std::fill(o, o + out_stride, -1);
    const int64_t c = req[t] < 0 ? 0 : clen[t];
    const float* row = scores + t * score_stride;
    cand.clear();
    // -inf (masked or past clen) and NaN scores are never selected: `s > -inf` is false for both.
    for (int64_t j = 0; j < c; ++j)
      if (row[j] > kNegInf) cand.push_back({row[j], j});
    const int64_t k = std::min<int64_t>(topk, static_cast<int64_t>(cand.size()));
    // Best first; equal scores: lower position first (a strict total order).
    std::partial_sort(cand.begin(), cand.begin() + k, cand.end(), [](const Candidate& a, const Candidate& b) {
      return a.score > b.score || (a.score == b.score && a.pos < b.pos);
    });
    std::sort(cand.begin(), cand.begin() + k, [](const Candidate& a, const Candidate& b) { return a.pos < b.pos; });
    const int32_t* table = comp_slot_table + (req[t] < 0 ? 0 : req[t] * comp_table_stride);
    for (int64_t i = 0; i < k; ++i) o[i] = table[cand[i].pos];
  }
}

}  // namespace v4attn::ref
