// CPU reference of the compressor tails and the index-K store (spec 3.3, prepare_ops.h), and the
// whole kv-source compressor step (layer.h compressor_forward).
#include <algorithm>
#include <stdexcept>
#include <string>
#include <vector>

#include "reference/ref_internal.h"
#include "v4attn/reference/layer.h"
#include "v4attn/reference/prepare_ops.h"

namespace v4attn::ref {

using namespace detail;

namespace {

constexpr int kHd = 512;       // latent width
constexpr int kIdxHd = 128;    // index key width
constexpr int kStateRow = 1024;  // pair state row: kv(512) | score(512)

// FP4 KV quant of a 512-dim bf16 vector into one V41_FP4 slot (no validation).
void store_fp4_row(const bf16_t* v, const CacheLayout& layout, uint8_t* cache, int64_t loc) {
  uint8_t* data = cache + layout.data_offset(loc);
  uint8_t* scales = cache + layout.scale_offset(loc);
  for (int b = 0; b < kHd / num::kKvFp4Block; ++b) {
    float x[num::kKvFp4Block];
    float amax = 0.0f;
    for (int i = 0; i < num::kKvFp4Block; ++i) {
      x[i] = num::f32_from_bf16(v[b * num::kKvFp4Block + i]);
      amax = num::block_amax_step(amax, x[i]);
    }
    const uint8_t sb = num::kv_fp4_scale_byte(amax);
    const float s = num::f32_from_e4m3(sb);
    for (int i = 0; i < num::kKvFp4Block; i += 2)
      data[(b * num::kKvFp4Block + i) / 2] = num::pack_e2m1(num::fp4_code(x[i], s), num::fp4_code(x[i + 1], s));
    scales[b] = sb;
  }
}

// The shared tail of c1 and c2 for one row: latent (normed, pre-RoPE) -> RoPE at g with the
// compressed table -> FP4 KV store at loc (<= 0: skip; >= n_slots: skip and count).
int64_t rope_and_store(const bf16_t* latent_pre_rope, int64_t g, const float* table, int64_t loc,
                       const CacheLayout& layout, uint8_t* cache, int64_t n_slots) {
  if (loc <= 0) return 0;
  if (loc >= n_slots) return 1;
  bf16_t roped[kHd];
  std::copy(latent_pre_rope, latent_pre_rope + kHd, roped);
  rope_tail(roped, kHd, table + g * num::kRopeDim);
  store_fp4_row(roped, layout, cache, loc);
  return 0;
}

}  // namespace

void store_compressed_fp4(const bf16_t* latent_roped, const CacheLayout& layout, uint8_t* cache, int64_t loc) {
  const char* who = "store_compressed_fp4";
  require_ptr(latent_roped, who, "latent_roped");
  require_ptr(cache, who, "cache");
  require_layout(layout, CacheKind::kCompressedFp4, who);
  require(loc >= 0, who, "negative slot " + std::to_string(loc));
  store_fp4_row(latent_roped, layout, cache, loc);
}

int64_t c1_fused(const bf16_t* proj, int64_t N, const float* c_norm, float eps, const int32_t* pos,
                 const float* table, int64_t max_pos, const int32_t* out_loc, const CacheLayout& layout,
                 uint8_t* cache, int64_t n_slots, bf16_t* latent_pre_rope) {
  const char* who = "c1_fused";
  require(N >= 0 && n_slots >= 0, who, "negative row or slot count");
  require_layout(layout, CacheKind::kCompressedFp4, who);
  if (N == 0) return 0;
  require_ptr(proj, who, "proj");
  require_ptr(c_norm, who, "c_norm");
  require_ptr(pos, who, "pos");
  require_ptr(table, who, "table");
  require_ptr(out_loc, who, "out_loc");
  require_ptr(cache, who, "cache");
  require_ptr(latent_pre_rope, who, "latent_pre_rope");
  require_positions(pos, N, max_pos, who);
  int64_t skipped = 0;
  for (int64_t t = 0; t < N; ++t) {
    bf16_t* latent = latent_pre_rope + t * kHd;
    rmsnorm_row(proj + t * kHd, kHd, c_norm, eps, latent);
    skipped += rope_and_store(latent, pos[t], table, out_loc[t], layout, cache, n_slots);  // ratio 1: g = pos
  }
  return skipped;
}

int64_t c2_fused(const float* kvs, int64_t N, const int32_t* pos, const int32_t* state_row,
                 const int32_t* partner_state_row, const int32_t* prev_row, float* state, int64_t state_rows,
                 const float* c_norm, float eps, const float* table, int64_t max_pos, const int32_t* out_loc,
                 const CacheLayout& layout, uint8_t* cache, int64_t n_slots, bf16_t* latent_pre_rope) {
  const char* who = "c2_fused";
  require(N >= 0 && n_slots >= 0 && state_rows >= 0, who, "negative row, slot or state-row count");
  require_layout(layout, CacheKind::kCompressedFp4, who);
  if (N == 0) return 0;
  require_ptr(kvs, who, "kvs");
  require_ptr(pos, who, "pos");
  require_ptr(state_row, who, "state_row");
  require_ptr(partner_state_row, who, "partner_state_row");
  require_ptr(prev_row, who, "prev_row");
  require_ptr(state, who, "state");
  require_ptr(c_norm, who, "c_norm");
  require_ptr(table, who, "table");
  require_ptr(out_loc, who, "out_loc");
  require_ptr(cache, who, "cache");
  require_ptr(latent_pre_rope, who, "latent_pre_rope");
  // Validate every live row, and that no state row is both read (as a partner) and parked in
  // this step, or parked twice: then the step's result does not depend on row order (a GPU
  // kernel runs the rows concurrently), and state reads see the state from before the step.
  std::vector<int32_t> parked, read;
  for (int64_t t = 0; t < N; ++t) {
    if (state_row[t] < 0) continue;  // padded row: ignored entirely
    const std::string row = "row " + std::to_string(t) + ": ";
    require(pos[t] >= 0 && pos[t] < max_pos, who,
            row + "pos " + std::to_string(pos[t]) + " is outside the RoPE table [0, " + std::to_string(max_pos) + ")");
    require(state_row[t] < state_rows, who,
            row + "state row " + std::to_string(state_row[t]) + " >= state rows " + std::to_string(state_rows));
    if (pos[t] % 2 == 0) {
      parked.push_back(state_row[t]);
      continue;
    }
    const int32_t p = prev_row[t];
    if (p >= 0) {
      require(p < N && p != t && state_row[p] >= 0 && pos[p] == pos[t] - 1, who,
              row + "prev_row " + std::to_string(p) + " is not a live row of this batch at position pos - 1");
    } else {
      require(partner_state_row[t] >= 0 && partner_state_row[t] < state_rows, who,
              row + "partner state row " + std::to_string(partner_state_row[t]) + " is outside [0, " +
                  std::to_string(state_rows) + ")");
      read.push_back(partner_state_row[t]);
    }
  }
  std::sort(parked.begin(), parked.end());
  require(std::adjacent_find(parked.begin(), parked.end()) == parked.end(), who,
          "two rows park in the same pair-state row (pair ring too small for the rows per request)");
  for (int32_t r : read)
    require(!std::binary_search(parked.begin(), parked.end(), r), who,
            "pair-state row " + std::to_string(r) + " is read and parked in the same step (pair ring too small)");

  // Phase 1: complete the groups (reads only: kvs and the state as it was before this step).
  int64_t skipped = 0;
  float pooled[kHd];
  bf16_t pooled_bf16[kHd];
  for (int64_t t = 0; t < N; ++t) {
    if (state_row[t] < 0 || pos[t] % 2 == 0) continue;
    const float* partner = prev_row[t] >= 0 ? kvs + static_cast<int64_t>(prev_row[t]) * kStateRow
                                            : state + static_cast<int64_t>(partner_state_row[t]) * kStateRow;
    const float* self = kvs + t * kStateRow;
    for (int d = 0; d < kHd; ++d) {
      pooled[d] = num::pair_softmax_pool(partner[d], partner[kHd + d], self[d], self[kHd + d]);
      pooled_bf16[d] = num::bf16_from_f32(pooled[d]);  // the pooled vector is bf16 before its norm
    }
    bf16_t* latent = latent_pre_rope + t * kHd;
    rmsnorm_row(pooled_bf16, kHd, c_norm, eps, latent);
    skipped += rope_and_store(latent, pos[t] - 1, table, out_loc[t], layout, cache, n_slots);  // g = pos - 1
  }
  // Phase 2: even rows park (kv, score) for their partner-to-come.
  for (int64_t t = 0; t < N; ++t) {
    if (state_row[t] < 0 || pos[t] % 2 != 0) continue;
    std::copy(kvs + t * kStateRow, kvs + (t + 1) * kStateRow, state + static_cast<int64_t>(state_row[t]) * kStateRow);
  }
  return skipped;
}

int64_t index_k_store(const bf16_t* kproj, int64_t N, const float* k_norm, float eps, const int32_t* g,
                      const float* table, int64_t max_pos, const int32_t* out_loc, const CacheLayout& layout,
                      uint8_t* cache, int64_t n_slots) {
  const char* who = "index_k_store";
  require(N >= 0 && n_slots >= 0, who, "negative row or slot count");
  require_layout(layout, CacheKind::kIndexK, who);
  if (N == 0) return 0;
  require_ptr(kproj, who, "kproj");
  require_ptr(k_norm, who, "k_norm");
  require_ptr(g, who, "g");
  require_ptr(table, who, "table");
  require_ptr(out_loc, who, "out_loc");
  require_ptr(cache, who, "cache");
  require_positions(g, N, max_pos, who, "group position");
  int64_t skipped = 0;
  bf16_t k[kIdxHd];
  for (int64_t t = 0; t < N; ++t) {
    const int64_t loc = out_loc[t];
    if (loc <= 0) continue;
    if (loc >= n_slots) {
      ++skipped;
      continue;
    }
    rmsnorm_row(kproj + t * kIdxHd, kIdxHd, k_norm, eps, k);
    rope_tail(k, kIdxHd, table + static_cast<int64_t>(g[t]) * num::kRopeDim);
    uint8_t* data = cache + layout.data_offset(loc);
    uint8_t* scales = cache + layout.scale_offset(loc);
    for (int b = 0; b < kIdxHd / num::kIndexerQuantBlock; ++b) {
      float x[num::kIndexerQuantBlock];
      float amax = 0.0f;
      for (int i = 0; i < num::kIndexerQuantBlock; ++i) {
        x[i] = num::f32_from_bf16(k[b * num::kIndexerQuantBlock + i]);
        amax = num::block_amax_step(amax, x[i]);
      }
      const int e = num::indexer_quant_scale_exp(amax);
      const float s = num::pow2_f32(e);
      for (int i = 0; i < num::kIndexerQuantBlock; i += 2)
        data[(b * num::kIndexerQuantBlock + i) / 2] = num::pack_e2m1(num::fp4_code(x[i], s), num::fp4_code(x[i + 1], s));
      scales[b] = num::ue8m0_from_exp(e);
    }
  }
  return skipped;
}

CompressorOut compressor_forward(const CompressorWeights& cw, const bf16_t* x, int64_t x_stride, const StepMeta& meta,
                                 const float* table, int64_t max_pos, float eps, const CompressorCaches& caches) {
  const char* who = "compressor_forward";
  const int r = cw.ratio;
  const int64_t T = meta.rows;
  require(r == 1 || r == 2, who, "compressor ratio " + std::to_string(r) + " must be 1 or 2");
  require(T >= 0, who, "negative row count");
  const auto meta_ok = [&](const std::vector<int32_t>& v) { return static_cast<int64_t>(v.size()) == T; };
  require(meta_ok(meta.pos) && meta_ok(meta.c_out_loc[r]) && meta_ok(meta.pair_state_row) &&
              meta_ok(meta.pair_prev_row) && meta_ok(meta.pair_partner_state_row),
          who, "step metadata arrays do not have meta.rows entries");
  const int64_t dim = r == 1 ? cw.wkv_c.k : cw.wkv.k;
  require(r == 1 ? cw.wkv_c.n == kHd : (cw.wkv.n == kHd && cw.wgate.n == kHd && cw.wgate.k == dim), who,
          "compressor projection shapes must be [512, dim]");
  require(cw.wk.n == kIdxHd && cw.wk.k == kHd, who, "wk must be [128, 512]");
  require(static_cast<int64_t>(cw.c_norm.size()) == kHd && static_cast<int64_t>(cw.k_norm.size()) == kIdxHd, who,
          "c_norm must have 512 and k_norm 128 entries");
  require(x_stride >= dim, who, "x_stride < dim");
  require(caches.comp_slots >= 0 && caches.index_k_slots >= 0 && caches.pair_state_rows >= 0, who,
          "negative slot or state-row count");

  CompressorOut out;
  out.ratio = r;
  out.latent_pre_rope.assign(static_cast<size_t>(T * kHd), 0);
  out.kproj.assign(static_cast<size_t>(T * kIdxHd), 0);
  out.g.assign(static_cast<size_t>(T), -1);
  if (T == 0) return out;
  require_ptr(x, who, "x");

  // Rows that complete a group (and so get a latent and an index key).
  std::vector<int64_t> live;
  for (int64_t t = 0; t < T; ++t) {
    if (r == 1) {
      out.g[static_cast<size_t>(t)] = meta.pos[static_cast<size_t>(t)];  // padded rows too (pos 0): stateless, store suppressed
      live.push_back(t);
    } else if (meta.pair_state_row[static_cast<size_t>(t)] >= 0 && meta.pos[static_cast<size_t>(t)] % 2 == 1) {
      out.g[static_cast<size_t>(t)] = meta.pos[static_cast<size_t>(t)] - 1;
      live.push_back(t);
    }
  }

  // Stage 1: projection + fused tail (norm, RoPE at g, FP4 store). Validation of positions,
  // pointers and state rows happens inside c1_fused / c2_fused before they write.
  if (r == 1) {
    out.proj.assign(static_cast<size_t>(T * kHd), 0);
    gemm_bf16(x, T, x_stride, cw.wkv_c, out.proj.data(), kHd);
    // The index-K store below validates the same group positions; check them here as well so
    // that a bad position is refused before the compressed cache is touched.
    require_ptr(caches.index_k, who, "index-K cache");
    require_layout(caches.index_k_layout, CacheKind::kIndexK, who);
    out.skipped += c1_fused(out.proj.data(), T, cw.c_norm.data(), eps, meta.pos.data(), table, max_pos,
                            meta.c_out_loc[1].data(), caches.comp_layout, caches.comp, caches.comp_slots,
                            out.latent_pre_rope.data());
  } else {
    out.kvs.assign(static_cast<size_t>(T * kStateRow), 0.0f);
    gemm_f32(x, T, x_stride, cw.wkv, out.kvs.data(), kStateRow);
    gemm_f32(x, T, x_stride, cw.wgate, out.kvs.data() + kHd, kStateRow);
    require_ptr(caches.index_k, who, "index-K cache");
    require_layout(caches.index_k_layout, CacheKind::kIndexK, who);
    out.skipped += c2_fused(out.kvs.data(), T, meta.pos.data(), meta.pair_state_row.data(),
                            meta.pair_partner_state_row.data(), meta.pair_prev_row.data(), caches.pair_state,
                            caches.pair_state_rows, cw.c_norm.data(), eps, table, max_pos, meta.c_out_loc[2].data(),
                            caches.comp_layout, caches.comp, caches.comp_slots, out.latent_pre_rope.data());
  }

  // Stage 2: index keys of the completing rows, from the latent BEFORE its RoPE.
  const int64_t n_live = static_cast<int64_t>(live.size());
  std::vector<bf16_t> lat(static_cast<size_t>(n_live * kHd)), kp(static_cast<size_t>(n_live * kIdxHd));
  std::vector<int32_t> g(static_cast<size_t>(n_live)), loc(static_cast<size_t>(n_live));
  for (int64_t i = 0; i < n_live; ++i) {
    const int64_t t = live[static_cast<size_t>(i)];
    std::copy_n(out.latent_pre_rope.data() + t * kHd, kHd, lat.data() + i * kHd);
    g[static_cast<size_t>(i)] = out.g[static_cast<size_t>(t)];
    loc[static_cast<size_t>(i)] = meta.c_out_loc[r][static_cast<size_t>(t)];
  }
  gemm_bf16(lat.data(), n_live, kHd, cw.wk, kp.data(), kIdxHd);
  for (int64_t i = 0; i < n_live; ++i)
    std::copy_n(kp.data() + i * kIdxHd, kIdxHd, out.kproj.data() + live[static_cast<size_t>(i)] * kIdxHd);
  out.skipped += index_k_store(kp.data(), n_live, cw.k_norm.data(), eps, g.data(), table, max_pos, loc.data(),
                               caches.index_k_layout, caches.index_k, caches.index_k_slots);
  return out;
}

}  // namespace v4attn::ref
