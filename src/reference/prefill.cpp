// Synthetic prefill of a RefStack's caches (stack.h, synthetic_prefill).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

#include "v4attn/reference/gemm.h"
#include "v4attn/reference/prepare_ops.h"
#include "v4attn/reference/stack.h"

namespace v4attn::ref {

namespace {

constexpr int kHd = 512;
constexpr int kIdxHd = 128;
constexpr int kStateRow = 1024;
constexpr int64_t kChunk = 1024;  // rows per batch of the real path (even: pairs stay in a chunk)

[[noreturn]] void fail(const std::string& what) { throw std::invalid_argument("synthetic_prefill: " + what); }

uint64_t mix64(uint64_t z) {  // splitmix64 finaliser
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// A counter-based stream of 64-bit words for one (seed, tag, layer, request, position) key.
struct Stream {
  uint64_t key, n = 0;
  Stream(uint64_t seed, uint64_t tag, int64_t layer, int64_t req, int64_t pos)
      : key(mix64(mix64(seed ^ (tag << 56)) ^ mix64(static_cast<uint64_t>(layer) << 48 ^
                                                      static_cast<uint64_t>(req) << 32 ^ static_cast<uint64_t>(pos)))) {}
  uint64_t next() { return mix64(key + 0x632BE59BD9B4E019ull * ++n); }
};

// n values of roughly N(0, 1): the sum of four 16-bit uniforms (Irwin-Hall, scaled to unit
// variance; tails at +-3.46). Cheap and plenty for synthetic projection outputs.
void normal_values(Stream& s, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const uint64_t b = s.next();
    const double sum = static_cast<double>((b & 0xffff) + ((b >> 16) & 0xffff) + ((b >> 32) & 0xffff) + (b >> 48));
    out[i] = static_cast<float>((sum / 65535.0 - 2.0) * 1.7320508075688772);
  }
}

// e2m1 codes of a quantised normal: entry i = e2m1_rne(Phi^-1((i + 0.5) / 256) * 2.2) (the
// quantiser maps a block's amax, ~2.7 sigma for 16-32 normal values, to about 6).
const std::vector<uint8_t>& normal_nibbles() {
  static const std::vector<uint8_t> table = [] {
    std::vector<uint8_t> t(256);
    for (int i = 0; i < 256; ++i) {
      const double p = (i + 0.5) / 256.0;
      double lo = -8.0, hi = 8.0;  // bisection on the normal CDF 0.5 * erfc(-x / sqrt 2)
      for (int it = 0; it < 80; ++it) {
        const double mid = 0.5 * (lo + hi);
        (0.5 * std::erfc(-mid / std::sqrt(2.0)) < p ? lo : hi) = mid;
      }
      t[static_cast<size_t>(i)] = num::e2m1_from_f32(static_cast<float>(0.5 * (lo + hi) * 2.2));
    }
    return t;
  }();
  return table;
}

// `bytes` packed e2m1 pairs from the quantised normal, then element `amax_elem` of each block of
// `block` elements set to +-amax_code (the amax element of a real quantised block).
void fast_fp4_codes(Stream& s, uint8_t* data, int elems, int block, uint8_t amax_code) {
  const std::vector<uint8_t>& nib = normal_nibbles();
  uint64_t bits = 0;
  for (int i = 0; i < elems / 2; ++i) {
    if (i % 4 == 0) bits = s.next();
    const uint8_t lo = nib[bits & 0xff], hi = nib[(bits >> 8) & 0xff];
    bits >>= 16;
    data[i] = num::pack_e2m1(lo, hi);
  }
  for (int b = 0; b < elems / block; ++b) {
    const uint64_t r = s.next();
    const int e = b * block + static_cast<int>(r % static_cast<uint64_t>(block));
    const uint8_t code = static_cast<uint8_t>(amax_code | ((r >> 32) & 1 ? 8 : 0));
    uint8_t& byte = data[e / 2];
    byte = (e % 2 == 0) ? static_cast<uint8_t>((byte & 0xf0u) | code) : static_cast<uint8_t>((byte & 0x0fu) | (code << 4));
  }
}

// One compressed-KV slot: FP4 codes, 32 e4m3 scales in [0.25, 1] (codes 0x28..0x38).
void fast_comp_slot(Stream& s, const CacheLayout& l, uint8_t* cache, int64_t loc) {
  fast_fp4_codes(s, cache + l.data_offset(loc), kHd, num::kKvFp4Block, 7 /* 6.0 */);
  uint8_t* sc = cache + l.scale_offset(loc);
  for (int b = 0; b < kHd / num::kKvFp4Block; ++b) sc[b] = static_cast<uint8_t>(0x28 + s.next() % 17);
}

// One index-K slot: FP4 codes, 4 ue8m0 scales 2^-2..2^0, amax element at +-4 or +-6.
void fast_index_k_slot(Stream& s, const CacheLayout& l, uint8_t* cache, int64_t loc) {
  const uint8_t amax_code = (s.next() & 1) ? 7 /* 6.0 */ : 6 /* 4.0 */;
  fast_fp4_codes(s, cache + l.data_offset(loc), kIdxHd, num::kIndexerQuantBlock, amax_code);
  uint8_t* sc = cache + l.scale_offset(loc);
  for (int b = 0; b < kIdxHd / num::kIndexerQuantBlock; ++b) sc[b] = num::ue8m0_from_exp(-static_cast<int>(s.next() % 3));
}

void bf16_rows(Stream& s, num::bf16_t* out, int64_t n) {
  std::vector<float> f(static_cast<size_t>(n));
  normal_values(s, f.data(), n);
  for (int64_t i = 0; i < n; ++i) out[i] = num::bf16_from_f32(f[static_cast<size_t>(i)]);
}

// Index keys from pre-RoPE latents through the real wk GEMM and index_k_store.
int64_t store_index_keys(const CompressorWeights& cw, const std::vector<num::bf16_t>& latent,
                         const std::vector<int32_t>& g, const std::vector<int32_t>& loc, float eps,
                         const std::vector<float>& table, int64_t max_pos, const CompressorCaches& cc) {
  const int64_t n = static_cast<int64_t>(g.size());
  std::vector<num::bf16_t> kproj(static_cast<size_t>(n * kIdxHd));
  gemm_bf16(latent.data(), n, kHd, cw.wk, kproj.data(), kIdxHd);
  return index_k_store(kproj.data(), n, cw.k_norm.data(), eps, g.data(), table.data(), max_pos, loc.data(),
                       cc.index_k_layout, cc.index_k, cc.index_k_slots);
}

}  // namespace

const char* to_string(PrefillPath p) {
  switch (p) {
    case PrefillPath::kAuto: return "auto";
    case PrefillPath::kReal: return "real";
    case PrefillPath::kFast: return "fast";
  }
  return "?";
}

PrefillStats synthetic_prefill(RefStack& stack, const std::vector<int32_t>& context, const PrefillOptions& options) {
  const auto t0 = std::chrono::steady_clock::now();
  const ModelConfig& c = stack.config();
  const RequestPool& pool = stack.pool();
  if (static_cast<int>(context.size()) != pool.n_requests)
    fail(std::to_string(context.size()) + " context lengths for " + std::to_string(pool.n_requests) + " requests");
  for (size_t q = 0; q < context.size(); ++q)
    if (context[q] < 0 || context[q] > pool.max_context)
      fail("request " + std::to_string(q) + ": context " + std::to_string(context[q]) + " outside [0, max_context " +
           std::to_string(pool.max_context) + "]");
  if (options.real_max_groups < 0) fail("real_max_groups must be >= 0");

  int64_t total_groups = 0;
  for (int s : c.kv_source_layers)
    for (int32_t ctx : context) total_groups += ctx / stack.plan().layers[static_cast<size_t>(s)].ratio;
  PrefillStats st;
  st.path = options.path;
  // kAuto: the real path needs each kv source's weights; when the stack generates weights per
  // use (full-size configs) that would cost one whole layer's generation per source, for entries
  // that are synthetic either way, so auto takes the fast path there.
  if (st.path == PrefillPath::kAuto)
    st.path = total_groups <= options.real_max_groups && stack.keeps_all_weights() ? PrefillPath::kReal
                                                                                   : PrefillPath::kFast;
  const uint64_t seed = stack.options().seed;
  const float eps = c.norm_eps;
  const int64_t max_pos = stack.max_pos();
  const auto progress = [&](const std::string& line) {
    if (options.progress) options.progress(line);
  };

  // Window caches: the last `window` positions of every request, every layer.
  const std::vector<float> unit_norm(kHd, 1.0f);
  for (int l = 0; l < c.total_layers(); ++l) {
    const std::vector<float>& table = stack.rope_table(stack.plan().layers[static_cast<size_t>(l)].ratio);
    std::vector<uint8_t>& cache = stack.window_cache(l);
    for (int q = 0; q < pool.n_requests; ++q) {
      const int32_t first = std::max(0, context[static_cast<size_t>(q)] - c.window_size);
      const int64_t n = context[static_cast<size_t>(q)] - first;
      if (n == 0) continue;
      std::vector<num::bf16_t> kv(static_cast<size_t>(n * kHd));
      std::vector<int32_t> pos(static_cast<size_t>(n)), loc(static_cast<size_t>(n));
      for (int64_t i = 0; i < n; ++i) {
        const int32_t p = first + static_cast<int32_t>(i);
        Stream s(seed, 1, l, q, p);
        bf16_rows(s, kv.data() + i * kHd, kHd);
        pos[static_cast<size_t>(i)] = p;
        loc[static_cast<size_t>(i)] = pool.window_slot(q, p);
      }
      window_k_store(kv.data(), n, kHd, unit_norm.data(), eps, pos.data(), table.data(), max_pos, loc.data(),
                     CacheKind::kWindowV41, stack.window_layout(), cache.data(), stack.window_slots());
      st.window_rows += n;
    }
  }
  progress("prefill: window caches of " + std::to_string(c.total_layers()) + " layers written (" +
           std::to_string(st.window_rows) + " rows)");

  // Compressed KV + index K + pair state per kv source.
  const std::vector<float>& ctable = stack.rope_table(1);
  for (int src : c.kv_source_layers) {
    const int r = stack.plan().layers[static_cast<size_t>(src)].ratio;
    const CompressorCaches cc = stack.compressor_caches(src);
    if (r == 2) pair_state_init(cc.pair_state, cc.pair_state_rows);
    const CompressorWeights* cw = nullptr;
    if (st.path == PrefillPath::kReal) cw = &*stack.weights(src).compressor;
    const std::vector<int32_t>& slot_table = stack.comp_slot_table(r);
    const int64_t stride = stack.comp_slot_stride(r);

    for (int q = 0; q < pool.n_requests; ++q) {
      const int32_t C = context[static_cast<size_t>(q)];
      const int64_t groups = C / r;
      if (st.path == PrefillPath::kFast) {
        for (int64_t j = 0; j < groups; ++j) {
          const int64_t slot = slot_table[static_cast<size_t>(q * stride + j)];
          Stream s(seed, 2, src, q, j);
          fast_comp_slot(s, cc.comp_layout, cc.comp, slot);
          fast_index_k_slot(s, cc.index_k_layout, cc.index_k, slot);
        }
        if (r == 2 && C % 2 == 1) {  // the parked even row C-1
          Stream s(seed, 3, src, q, C - 1);
          normal_values(s, cc.pair_state + static_cast<int64_t>(q * pool.pair_ring + (C - 1) % pool.pair_ring) * kStateRow,
                        kStateRow);
        }
      } else if (r == 1) {
        for (int64_t p0 = 0; p0 < C; p0 += kChunk) {
          const int64_t n = std::min<int64_t>(kChunk, C - p0);
          std::vector<num::bf16_t> proj(static_cast<size_t>(n * kHd)), latent(static_cast<size_t>(n * kHd));
          std::vector<int32_t> pos(static_cast<size_t>(n)), loc(static_cast<size_t>(n));
          for (int64_t i = 0; i < n; ++i) {
            const int32_t p = static_cast<int32_t>(p0 + i);
            Stream s(seed, 4, src, q, p);
            bf16_rows(s, proj.data() + i * kHd, kHd);
            pos[static_cast<size_t>(i)] = p;
            loc[static_cast<size_t>(i)] = pool.full_slot(q, p);
          }
          c1_fused(proj.data(), n, cw->c_norm.data(), eps, pos.data(), ctable.data(), max_pos, loc.data(), cc.comp_layout,
                   cc.comp, cc.comp_slots, latent.data());
          store_index_keys(*cw, latent, pos, loc, eps, ctable, max_pos, cc);
        }
      } else {
        // Ratio 2: rows in order, each chunk starting at an even position so every odd row's
        // partner is the previous row of the chunk; each row has its own scratch state row, so
        // nothing is parked twice; an odd C leaves row C-1 parked, copied to the pool state.
        for (int64_t p0 = 0; p0 < C; p0 += kChunk) {
          const int64_t n = std::min<int64_t>(kChunk, C - p0);
          std::vector<float> kvs(static_cast<size_t>(n * kStateRow)), scratch(static_cast<size_t>(n * kStateRow));
          std::vector<num::bf16_t> latent(static_cast<size_t>(n * kHd));
          std::vector<int32_t> pos(static_cast<size_t>(n)), state_row(static_cast<size_t>(n)),
              partner(static_cast<size_t>(n), -1), prev(static_cast<size_t>(n), -1), loc(static_cast<size_t>(n), -1);
          for (int64_t i = 0; i < n; ++i) {
            const int32_t p = static_cast<int32_t>(p0 + i);
            Stream s(seed, 5, src, q, p);
            normal_values(s, kvs.data() + i * kStateRow, kStateRow);
            pos[static_cast<size_t>(i)] = p;
            state_row[static_cast<size_t>(i)] = static_cast<int32_t>(i);
            if (p % 2 == 1) {
              prev[static_cast<size_t>(i)] = static_cast<int32_t>(i - 1);
              loc[static_cast<size_t>(i)] = pool.full_slot(q, p) / 2;
            }
          }
          pair_state_init(scratch.data(), n);
          c2_fused(kvs.data(), n, pos.data(), state_row.data(), partner.data(), prev.data(), scratch.data(), n,
                   cw->c_norm.data(), eps, ctable.data(), max_pos, loc.data(), cc.comp_layout, cc.comp, cc.comp_slots,
                   latent.data());
          std::vector<num::bf16_t> lat_odd;
          std::vector<int32_t> g, loc_odd;
          for (int64_t i = 1; i < n; i += 2) {
            lat_odd.insert(lat_odd.end(), latent.begin() + i * kHd, latent.begin() + (i + 1) * kHd);
            g.push_back(pos[static_cast<size_t>(i)] - 1);
            loc_odd.push_back(loc[static_cast<size_t>(i)]);
          }
          store_index_keys(*cw, lat_odd, g, loc_odd, eps, ctable, max_pos, cc);
          if (n % 2 == 1) {  // only the last chunk can be odd: C - 1 stays parked
            const int64_t dst = static_cast<int64_t>(q) * pool.pair_ring + (C - 1) % pool.pair_ring;
            std::copy_n(scratch.data() + (n - 1) * kStateRow, kStateRow, cc.pair_state + dst * kStateRow);
          }
        }
      }
      st.groups += groups;
    }
    progress("prefill: kv source " + std::to_string(src) + " (ratio " + std::to_string(r) + "): " +
             std::to_string(st.groups) + " groups so far (" + to_string(st.path) + " path)");
  }
  st.ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  return st;
}

}  // namespace v4attn::ref
