// Benchmark of the lightning-indexer kernels (include/v4attn/kernels/indexer_kernels.h): q pack,
// scores, top-k -> slots, candidate mask, and the chain of one index-source layer.
//
// For every context length clen (--clen, default 4096 and 65536), batch shape (--shape: "decode" =
// T rows of T requests, the worst case for K traffic; "verify" = T/6 requests x 6 consecutive rows
// (clen-5 .. clen), padded to T with rows of req -1) and row count T: build seeded random inputs
// (random e2m1 codes, realistic scale bytes, per-request slot tables of 64-slot pages in shuffled
// page order), validate against the CPU reference (q pack: every byte; scores: rows 0 and the last
// real row, bit for bit; top-k and candidate mask: every row of both versions, fed the GPU
// scores; the chain: its q pack and its top-k), then time each kernel with CUDA events around each
// launch (5 warm-ups, then --reps launches, a 128 MB memset before each one so that every launch
// starts with a cold L2) and report the median.
//
// "bytes" is what the kernel must move at least: scores = index K of every distinct (request,
// position) (68 B) + the slot table entries (4 B) + the score row writes (4 B x score_stride) + q;
// top-k = one read of the visible scores + the selected slot table entries + the output;
// candidate mask = one read of the visible scores + the mask bytes; q pack = qi + weights_proj
// output in, codes + scales + weights out. "floor" is that at 4.27 TB/s. Single launches pay the
// launch latency (~2-3 us), which dominates the small kernels.
//
// Versions:
//  - scores "masked" / "masked-sh" (with a candidate mask of 2048 random kept blocks per row, own
//    or shared by a request's rows; "-mN": N blocks per CTA tile): only kept blocks are scored.
//  - scores "auto" (the launcher's tile choice) and "s1", "s2", "s4" (32-position steps per warp
//    per CTA, i.e. 128 / 256 / 512 positions per CTA; "s8", "s12", "s14", "s16", "s21", "s24",
//    "s32" only when named in --only) on narrow scales (each vector's 4 block
//    scales within 2^1, like real quantized activations: the kernel's fused path), and "wide"
//    (auto tiles, independent block scales: the per-block path), all one row per CTA
//    (group_rows 1); verify shapes add "g6" and "g6-wide" (group_rows 6: the 6 rows of a request
//    in one CTA, one read of their K).
//  - top-k and candidate mask "v1" (one CTA per row), "v2" (many CTAs per row, workspace) and
//    "v3" (one thread-block cluster per row, automatic cluster size), "v3-c1" .. "v3-c16" (1, 2,
//    4, 8, 16 CTAs per row), "v3w" (v3 whose radix select starts with the window exchange).
//  - top-k "v3-masked" / "v3-masked-nc" (a later index source: the mask of 2048 random kept
//    blocks fused, the kept groups compacted / every position walked), "v3-masked-c1" / "-c2" /
//    "-c4" (compacted, 1 / 2 / 4 CTAs per row), "v3w-masked" (compacted, the window exchange).
//  - pair "v3" (the candidate source's top-k and mask in one launch, run_indexer_select_pair_v3),
//    "serial" (the v3 mask then the v3 top-k, two launches) and "v3w" (the pair, window exchange).
//  - q pack "v2" (one thread per pair of values).
//  - chain "idx": q pack -> scores (g6 for verify) -> top-k v2, and "idx+mask": with the
//    candidate mask v2 before the top-k (the candidate source layer), captured once in a CUDA
//    graph with PDL between the kernels; each replay timed like a kernel (cold L2). "idx-v3" and
//    "idx+mask-v3": the same chains with the v3 selection.
//
// Usage: bench_indexer [--T 1,6,8,48,64] [--clen 4096,65536] [--shape decode,verify] [--reps 100]
//                      [--select-only] [--json FILE]
// (--select-only: top-k, candidate mask and the chains only; e.g. the v2 / v3 comparison:
//  bench_indexer --T 6,24,32 --clen 32768,65536 --select-only)
#include <CLI/CLI.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <numeric>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "bench_common.h"
#include "runtime/cuda_utils.h"
#include "runtime/phase_stamps.h"
#include "v4attn/cache_layout.h"
#include "v4attn/kernels/indexer_kernels.h"
#include "v4attn/reference/indexer.h"
#include "v4attn/rope_table.h"

namespace {

using namespace v4attn;
using num::bf16_t;
namespace kn = v4attn::kernels;

using bench::to_device;
using bench::to_host;

constexpr int kHeads = kn::kIndexerHeads;
constexpr int kTopk = 512;
constexpr int kMaskBlock = 8;
constexpr int kCandidateBlocks = 2048;

struct Row {
  std::string kernel, version, shape;
  int T = 0;
  int64_t clen = 0;
  double median_us = 0.0;
  int64_t bytes = 0;
  bool valid = false;
  double floor_us() const { return bench::floor_us(bytes); }
};

std::mt19937_64& rng() {
  static std::mt19937_64 r(20250101);
  return r;
}

// One step of one shape: host inputs, device copies, and the outputs of the kernels under test.
struct Problem {
  std::string shape;
  int T = 0;
  int64_t clen = 0, stride = 0, n_req = 0, n_slots = 0, mask_stride = 0;
  CacheLayout layout = cache_layout(CacheKind::kIndexK);
  ref::IndexerQ q;
  std::vector<float> w;
  std::vector<uint8_t> cache;
  std::vector<int32_t> table, req, row_clen;
  DeviceBuffer<uint8_t> d_codes, d_scales, d_cache, d_mask, d_ws;
  DeviceBuffer<float> d_w, d_scores, d_rope;
  DeviceBuffer<int32_t> d_table, d_req, d_clen, d_out, d_pos;
  DeviceBuffer<bf16_t> d_qi, d_wproj;
  // q pack inputs (the chain): qi [T, 32*128], weights_proj output [T, 32], pos, a RoPE table.
  std::vector<bf16_t> qi, wproj;
  std::vector<int32_t> pos;
  std::vector<float> rope;
  int64_t max_pos = 0;
  int64_t distinct_positions = 0;  // sum over requests of their largest clen
  int64_t visible_positions = 0;   // sum over rows of clen
};

// Scale bytes of one vector (4 blocks): "narrow" = within 2^1 of a base (real quantized
// activations: the scores kernel's fused path), "wide" = independent per block (its per-block path).
void vector_scales(uint8_t* s4, bool wide) {
  const uint32_t base = 118 + static_cast<uint32_t>(rng()() % 13);
  for (int b = 0; b < 4; ++b)
    s4[b] = static_cast<uint8_t>(wide ? 118 + rng()() % 17 : base + rng()() % 2);
}

Problem make_problem(const std::string& shape, int T, int64_t clen, bool wide) {
  Problem pb;
  pb.shape = shape;
  pb.T = T;
  pb.clen = clen;
  pb.stride = (clen + 63) / 64 * 64;
  pb.mask_stride = (pb.stride + kMaskBlock - 1) / kMaskBlock;
  const bool verify = shape == "verify" && T >= 6;
  pb.n_req = verify ? T / 6 : T;
  pb.req.assign(static_cast<size_t>(T), -1);
  pb.row_clen.assign(static_cast<size_t>(T), 0);
  for (int t = 0; t < T; ++t) {
    if (verify) {
      if (t / 6 >= pb.n_req) continue;  // padded row
      pb.req[t] = t / 6;
      pb.row_clen[t] = static_cast<int32_t>(clen - 5 + t % 6);
    } else {
      pb.req[t] = t;
      pb.row_clen[t] = static_cast<int32_t>(clen);
    }
  }
  for (int t = 0; t < T; ++t) pb.visible_positions += pb.row_clen[t];
  pb.distinct_positions = pb.n_req * clen;

  // Pool: n_req * clen slots in pages of 64; each request takes clen/64 pages in shuffled order.
  const int64_t P = pb.layout.page_size;
  const int64_t pages_per_req = (clen + P - 1) / P;
  pb.n_slots = pb.n_req * pages_per_req * P;
  std::vector<int64_t> pages(static_cast<size_t>(pb.n_req * pages_per_req));
  std::iota(pages.begin(), pages.end(), 0);
  std::shuffle(pages.begin(), pages.end(), rng());
  pb.table.resize(static_cast<size_t>(pb.n_req * pb.stride));
  for (int64_t r = 0; r < pb.n_req; ++r)
    for (int64_t j = 0; j < pb.stride; ++j)
      pb.table[r * pb.stride + j] =
          static_cast<int32_t>(pages[(r * pages_per_req + std::min(j, clen - 1) / P)] * P + std::min(j, clen - 1) % P);
  pb.cache.resize(static_cast<size_t>(pb.layout.pool_bytes(pb.n_slots)));
  for (size_t i = 0; i < pb.cache.size(); i += 8) {
    const uint64_t v = rng()();
    std::memcpy(pb.cache.data() + i, &v, std::min<size_t>(8, pb.cache.size() - i));
  }
  for (int64_t s = 0; s < pb.n_slots; ++s) vector_scales(pb.cache.data() + pb.layout.scale_offset(s), wide);

  pb.q.T = T;
  pb.q.heads = kHeads;
  pb.q.codes.resize(static_cast<size_t>(T) * kHeads * 64);
  pb.q.scales.resize(static_cast<size_t>(T) * kHeads * 4);
  for (auto& b : pb.q.codes) b = static_cast<uint8_t>(rng()());
  for (size_t v = 0; v < pb.q.scales.size(); v += 4) vector_scales(pb.q.scales.data() + v, wide);
  std::normal_distribution<float> nd(0.0f, 2.0f);
  std::vector<bf16_t> wproj(static_cast<size_t>(T) * kHeads);
  for (auto& x : wproj) x = num::bf16_from_f32(nd(rng()));
  pb.w = ref::indexer_weights(wproj.data(), T, kHeads, kHeads);

  pb.d_codes = to_device(pb.q.codes);
  pb.d_scales = to_device(pb.q.scales);
  pb.d_w = to_device(pb.w);
  pb.d_cache = to_device(pb.cache);
  pb.d_table = to_device(pb.table);
  pb.d_req = to_device(pb.req);
  pb.d_clen = to_device(pb.row_clen);
  pb.d_scores.resize(static_cast<size_t>(T * pb.stride));
  pb.d_mask.resize(static_cast<size_t>(T * pb.mask_stride));
  pb.d_out.resize(static_cast<size_t>(T) * kTopk);

  // q pack inputs: qi ~ N(0, 1) bf16, weights_proj output ~ N(0, 2), positions near clen.
  pb.max_pos = 8192;
  RopeParams rp;
  rp.base = 160000.0;
  rp.yarn = true;
  pb.rope = build_rope_table(rp, pb.max_pos);
  std::normal_distribution<float> nq(0.0f, 1.0f);
  pb.qi.resize(static_cast<size_t>(T) * kHeads * 128);
  for (auto& x : pb.qi) x = num::bf16_from_f32(nq(rng()));
  pb.wproj.resize(static_cast<size_t>(T) * kHeads);
  for (auto& x : pb.wproj) x = num::bf16_from_f32(nd(rng()));
  pb.pos.resize(static_cast<size_t>(T));
  for (auto& x : pb.pos) x = static_cast<int32_t>(rng()() % pb.max_pos);
  pb.d_qi = to_device(pb.qi);
  pb.d_wproj = to_device(pb.wproj);
  pb.d_pos = to_device(pb.pos);
  pb.d_rope = to_device(pb.rope);
  // One selection workspace for top-k and the candidate mask, zeroed once (the stack's contract).
  const size_t ws = std::max(kn::indexer_topk_workspace_bytes(T, pb.stride, kTopk),
                             kn::candidate_mask_workspace_bytes(T, pb.stride, kMaskBlock, kCandidateBlocks));
  pb.d_ws.resize(std::max<size_t>(ws, 16));
  pb.d_ws.fill_bytes(0);
  return pb;
}

kn::IndexerScoresParams scores_params(const Problem& pb, int steps, int group_rows = 1) {
  kn::IndexerScoresParams p;
  p.q_codes = pb.d_codes.get();
  p.q_scales = pb.d_scales.get();
  p.weights = pb.d_w.get();
  p.index_k_cache = pb.d_cache.get();
  p.layout = pb.layout;
  p.n_slots = pb.n_slots;
  p.req = pb.d_req.get();
  p.clen = pb.d_clen.get();
  p.comp_slot_table = pb.d_table.get();
  p.comp_table_stride = pb.stride;
  p.comp_table_rows = pb.n_req;
  p.scores = pb.d_scores.get();
  p.score_stride = pb.stride;
  p.T = pb.T;
  p.steps_per_warp = steps;
  p.group_rows = group_rows;
  return p;
}
kn::IndexerQPackParams qpack_params(const Problem& pb) {
  kn::IndexerQPackParams p;
  p.qi = pb.d_qi.get();
  p.qi_stride = int64_t{kHeads} * 128;
  p.wproj_out = pb.d_wproj.get();
  p.wproj_stride = kHeads;
  p.pos = pb.d_pos.get();
  p.rope_table = pb.d_rope.get();
  p.max_pos = pb.max_pos;
  p.T = pb.T;
  p.q_codes = pb.d_codes.get();
  p.q_scales = pb.d_scales.get();
  p.weights = pb.d_w.get();
  return p;
}
// Selection versions of top-k and the candidate mask.
struct SelVersion {
  const char* name;
  int version;     // IndexerTopkParams / CandidateMaskParams::version
  bool workspace;  // v2
  int cluster;     // v3_cluster (0 = automatic)
  bool window = false;  // v3_window (v3w: the radix select starts with the window exchange)
};
constexpr SelVersion kSelVersions[] = {
    {"v1", 0, false, 0},      {"v2", 0, true, 0},       {"v3", 3, false, 0},      {"v3-c1", 3, false, 1},
    {"v3-c2", 3, false, 2},   {"v3-c4", 3, false, 4},   {"v3-c8", 3, false, 8},   {"v3-c16", 3, false, 16},
    {"v3w", 3, false, 0, true}};
constexpr SelVersion kChainV2 = kSelVersions[1];
constexpr SelVersion kChainV3 = kSelVersions[2];

kn::IndexerTopkParams topk_params(const Problem& pb, bool v2) {
  kn::IndexerTopkParams p;
  p.scores = pb.d_scores.get();
  p.score_stride = pb.stride;
  p.clen = pb.d_clen.get();
  p.req = pb.d_req.get();
  p.T = pb.T;
  p.comp_slot_table = pb.d_table.get();
  p.comp_table_stride = pb.stride;
  p.comp_table_rows = pb.n_req;
  p.topk = kTopk;
  p.out = pb.d_out.get();
  p.out_stride = kTopk;
  if (v2) {
    p.workspace = pb.d_ws.get();
    p.workspace_bytes = pb.d_ws.bytes();
  }
  return p;
}
kn::IndexerTopkParams topk_params(const Problem& pb, const SelVersion& v) {
  kn::IndexerTopkParams p = topk_params(pb, v.workspace);
  p.version = v.version;
  p.v3_cluster = v.cluster;
  p.v3_window = v.window;
  return p;
}
kn::CandidateMaskParams mask_params(const Problem& pb, bool v2) {
  kn::CandidateMaskParams p;
  p.scores = pb.d_scores.get();
  p.score_stride = pb.stride;
  p.clen = pb.d_clen.get();
  p.T = pb.T;
  p.block = kMaskBlock;
  p.topk_blocks = kCandidateBlocks;
  p.mask = pb.d_mask.get();
  p.mask_stride = pb.mask_stride;
  if (v2) {
    p.workspace = pb.d_ws.get();
    p.workspace_bytes = pb.d_ws.bytes();
  }
  return p;
}

kn::CandidateMaskParams mask_params(const Problem& pb, const SelVersion& v) {
  kn::CandidateMaskParams p = mask_params(pb, v.workspace);
  p.version = v.version;
  p.v3_cluster = v.cluster;
  p.v3_window = v.window;
  return p;
}

// A candidate mask for the masked scores rows: every row keeps min(2048, blocks) random blocks of
// 8 positions (the V4.1 budget), independently per row, or (shared) one draw per request.
struct HostMask {
  std::vector<uint8_t> bytes;  // [T, pb.mask_stride]
  DeviceBuffer<uint8_t> d;
  int64_t kept_distinct = 0;   // sum over requests of the positions some row of it keeps
};
HostMask make_mask(const Problem& pb, bool shared) {
  HostMask m;
  m.bytes.assign(static_cast<size_t>(pb.T * pb.mask_stride), 0);
  const int64_t n_blocks = (pb.clen + kMaskBlock - 1) / kMaskBlock;
  std::vector<int64_t> blocks(static_cast<size_t>(n_blocks));
  std::vector<uint8_t> any(static_cast<size_t>(pb.n_req * n_blocks), 0);
  for (int t = 0; t < pb.T; ++t) {
    if (pb.req[t] < 0) continue;
    if (!shared || t == 0 || pb.req[t] != pb.req[t - 1]) {
      std::iota(blocks.begin(), blocks.end(), 0);
      std::shuffle(blocks.begin(), blocks.end(), rng());
    }
    for (int64_t i = 0; i < std::min<int64_t>(kCandidateBlocks, n_blocks); ++i) {
      m.bytes[static_cast<size_t>(t * pb.mask_stride + blocks[i])] = 1;
      any[static_cast<size_t>(pb.req[t] * n_blocks + blocks[i])] = 1;
    }
  }
  for (uint8_t a : any) m.kept_distinct += a ? kMaskBlock : 0;
  m.d = to_device(m.bytes);
  return m;
}
kn::IndexerScoresParams masked_scores_params(const Problem& pb, const HostMask& m, int group_rows, int tile) {
  kn::IndexerScoresParams p = scores_params(pb, 0, group_rows);
  p.candidate_mask = m.d.get();
  p.mask_stride = pb.mask_stride;
  p.mask_block = kMaskBlock;
  p.mask_tile_blocks = tile;
  return p;
}

// ---- validation ---------------------------------------------------------------------------------
// Scores of rows 0 and the last real row against the reference (a two-row sub-batch); with a mask,
// against the reference's scores with ref::apply_candidate_mask.
bool validate_scores(Problem& pb, cudaStream_t s, int group_rows = 1, const HostMask* mask = nullptr, int tile = 0) {
  pb.d_scores.fill_bytes(0xAB, s);
  kn::run_indexer_scores(mask ? masked_scores_params(pb, *mask, group_rows, tile) : scores_params(pb, 0, group_rows), s,
                         false);
  V4_CUDA_CHECK(cudaStreamSynchronize(s));
  const auto got = to_host(pb.d_scores, static_cast<size_t>(pb.T) * pb.stride);
  int last = pb.T - 1;
  while (last > 0 && pb.req[last] < 0) --last;
  std::vector<int> rows = {0};
  if (last > 0) rows.push_back(last);
  ref::IndexerQ q;
  q.T = static_cast<int64_t>(rows.size());
  q.heads = kHeads;
  std::vector<float> w;
  std::vector<int32_t> req, clen;
  for (int t : rows) {
    q.codes.insert(q.codes.end(), pb.q.codes.begin() + int64_t{t} * kHeads * 64,
                   pb.q.codes.begin() + int64_t{t + 1} * kHeads * 64);
    q.scales.insert(q.scales.end(), pb.q.scales.begin() + int64_t{t} * kHeads * 4,
                    pb.q.scales.begin() + int64_t{t + 1} * kHeads * 4);
    w.insert(w.end(), pb.w.begin() + int64_t{t} * kHeads, pb.w.begin() + int64_t{t + 1} * kHeads);
    req.push_back(pb.req[t]);
    clen.push_back(pb.row_clen[t]);
  }
  std::vector<float> want(rows.size() * static_cast<size_t>(pb.stride));
  ref::indexer_scores(q, w.data(), pb.cache.data(), pb.layout, pb.n_slots, req.data(), clen.data(), pb.table.data(),
                      pb.stride, want.data(), pb.stride);
  if (mask != nullptr) {
    std::vector<uint8_t> m;
    for (int t : rows)
      m.insert(m.end(), mask->bytes.begin() + int64_t{t} * pb.mask_stride, mask->bytes.begin() + int64_t{t + 1} * pb.mask_stride);
    ref::apply_candidate_mask(want.data(), q.T, pb.stride, clen.data(), kMaskBlock, m.data(), pb.mask_stride);
  }
  for (size_t i = 0; i < rows.size(); ++i)
    if (std::memcmp(got.data() + int64_t{rows[i]} * pb.stride, want.data() + i * pb.stride, pb.stride * sizeof(float)) != 0)
      return false;
  return true;
}

// The reference top-k of the scores (host copy), after ref::apply_candidate_mask of `mask`
// ([T, pb.mask_stride] bytes) when given.
std::vector<int32_t> reference_topk(const Problem& pb, std::vector<float> scores, const uint8_t* mask = nullptr) {
  if (mask != nullptr)
    ref::apply_candidate_mask(scores.data(), pb.T, pb.stride, pb.row_clen.data(), kMaskBlock, mask, pb.mask_stride);
  std::vector<int32_t> want(static_cast<size_t>(pb.T) * kTopk);
  ref::topk_to_slots(scores.data(), pb.T, pb.stride, pb.row_clen.data(), kTopk, pb.req.data(), pb.table.data(),
                     pb.stride, want.data(), kTopk);
  return want;
}

// The top-k and candidate mask outputs in d_out / d_mask against the reference fed the GPU scores.
bool check_topk_and_mask(Problem& pb, cudaStream_t s, bool& mask_ok) {
  V4_CUDA_CHECK(cudaStreamSynchronize(s));
  const auto scores = to_host(pb.d_scores, static_cast<size_t>(pb.T) * pb.stride);
  const auto out = to_host(pb.d_out, static_cast<size_t>(pb.T) * kTopk);
  const auto mask = to_host(pb.d_mask, static_cast<size_t>(pb.T) * pb.mask_stride);
  const auto want = reference_topk(pb, scores);
  std::vector<uint8_t> want_mask(mask.size());
  ref::candidate_mask(scores.data(), pb.T, pb.stride, pb.row_clen.data(), kMaskBlock, kCandidateBlocks,
                      want_mask.data(), pb.mask_stride);
  mask_ok = mask == want_mask;
  return out == want;
}

// Top-k and candidate mask of one version against the reference, both fed the GPU scores.
bool validate_topk_and_mask(Problem& pb, cudaStream_t s, const SelVersion& v, bool& mask_ok) {
  kn::run_indexer_scores(scores_params(pb, 0), s, false);
  pb.d_out.fill_bytes(0xAB, s);
  pb.d_mask.fill_bytes(0xAB, s);
  kn::run_indexer_topk(topk_params(pb, v), s, false);
  kn::run_candidate_mask(mask_params(pb, v), s, false);
  return check_topk_and_mask(pb, s, mask_ok);
}

// The chain of one index-source layer (optionally with the candidate mask of the candidate source,
// whose mask then also filters the top-k, like a later index source would), on stream s with PDL.
void issue_chain(const Problem& pb, cudaStream_t s, bool with_mask, const SelVersion& sel) {
  const int group_rows = pb.shape == "verify" ? 6 : 1;
  kn::run_indexer_q_pack(qpack_params(pb), s, true);
  kn::run_indexer_scores(scores_params(pb, 0, group_rows), s, true);
  kn::IndexerTopkParams tp = topk_params(pb, sel);
  if (with_mask) {
    kn::run_candidate_mask(mask_params(pb, sel), s, true);
    tp.candidate_mask = pb.d_mask.get();
    tp.mask_stride = pb.mask_stride;
    tp.mask_block = kMaskBlock;
  }
  kn::run_indexer_topk(tp, s, true);
}

// The chain's q pack bytes against the reference, and its top-k (and mask) against the reference
// fed the chain's own scores.
bool validate_chain(Problem& pb, cudaStream_t s, bool with_mask, const SelVersion& sel = kChainV2) {
  pb.d_codes.fill_bytes(0xAB, s);
  pb.d_out.fill_bytes(0xAB, s);
  pb.d_mask.fill_bytes(0xAB, s);
  issue_chain(pb, s, with_mask, sel);
  V4_CUDA_CHECK(cudaStreamSynchronize(s));
  const auto q = ref::indexer_q_pack(pb.qi.data(), pb.T, kHeads, pb.pos.data(), pb.rope.data(), pb.max_pos);
  const auto w = ref::indexer_weights(pb.wproj.data(), pb.T, kHeads, kHeads);
  bool ok = to_host(pb.d_codes, q.codes.size()) == q.codes && to_host(pb.d_scales, q.scales.size()) == q.scales &&
            to_host(pb.d_w, w.size()) == w;
  const auto scores = to_host(pb.d_scores, static_cast<size_t>(pb.T) * pb.stride);
  std::vector<uint8_t> want_mask;
  if (with_mask) {
    want_mask.resize(static_cast<size_t>(pb.T * pb.mask_stride));
    ref::candidate_mask(scores.data(), pb.T, pb.stride, pb.row_clen.data(), kMaskBlock, kCandidateBlocks,
                        want_mask.data(), pb.mask_stride);
    ok = ok && to_host(pb.d_mask, want_mask.size()) == want_mask;
  }
  const auto want = reference_topk(pb, scores, with_mask ? want_mask.data() : nullptr);
  return ok && to_host(pb.d_out, want.size()) == want;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"bench_indexer: validate, then time the lightning-indexer kernels"};
  v4attn::bench::add_version_flag(app, "bench_indexer");
  std::vector<int> Ts = {1, 6, 8, 48, 64};
  std::vector<int64_t> clens = {4096, 65536};
  std::vector<std::string> shapes = {"decode", "verify"};
  int reps = 100;
  bool select_only = false;
  std::string json_path;
  app.add_option("--T", Ts, "row counts T")->delimiter(',');
  app.add_option("--clen", clens, "context lengths (compressed positions per row)")->delimiter(',');
  app.add_option("--shape", shapes, "batch shapes: decode (one request per row), verify (6 rows per request)")
      ->delimiter(',');
  app.add_option("--reps", reps, "timed launches per case (>= 50)")->check(CLI::Range(50, 100000));
  app.add_flag("--select-only", select_only, "only top-k, the candidate mask and the chains (skip scores / q pack rows)");
  app.add_option("--json", json_path, "also write the rows to this JSON file");
  std::vector<std::string> only;
  app.add_option("--only", only,
                 "time only these rows, as kernel:version (e.g. scores:g6,scores:masked); the others are skipped "
                 "(for profilers: one kernel's launches)")
      ->delimiter(',');
  CLI11_PARSE(app, argc, argv);
  const auto want = [&](const std::string& kernel, const std::string& version) {
    return only.empty() || std::find(only.begin(), only.end(), kernel + ":" + version) != only.end();
  };

  try {
    if (!bench::gpu_present("bench_indexer")) return 2;
    // Measurement builds (-DV4ATTN_PHASE_STAMPS): the stamps of the first launches (up to the
    // buffer's records) written to $V4ATTN_STAMPS_OUT at the end, e.g. with --only topk:v3.
    const char* stamps_out = std::getenv("V4ATTN_STAMPS_OUT");
    const bool stamping = stamps_out != nullptr && stamps::available();
    if (stamping) stamps::reset();
    for (int T : Ts)
      if (T < 1 || T > 1024) throw std::invalid_argument("--T values must be in [1, 1024]");
    for (int64_t c : clens)
      if (c < 8 || c > (int64_t{1} << 20)) throw std::invalid_argument("--clen values must be in [8, 2^20]");
    for (const auto& s : shapes)
      if (s != "decode" && s != "verify") throw std::invalid_argument("--shape must be decode or verify");
    cudaStream_t stream;
    V4_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    bench::L2Flush l2;
    // One launch's median time, cold L2.
    auto cold_median_us = [&](const std::function<void(cudaStream_t)>& launch) {
      return bench::cold_l2_median_us(launch, reps, l2, stream);
    };

    std::vector<Row> rows;
    bool all_valid = true;
    std::printf("%-14s %-8s %-6s %5s %7s %11s %11s %9s %7s %s\n", "kernel", "ver", "shape", "T", "clen", "median_us",
                "bytes", "floor_us", "ratio", "valid");
    auto report = [&](Row r) {
      all_valid = all_valid && r.valid;
      std::printf("%-14s %-8s %-6s %5d %7lld %11.2f %11lld %9.3f %7.2f %s\n", r.kernel.c_str(), r.version.c_str(),
                  r.shape.c_str(), r.T, static_cast<long long>(r.clen), r.median_us, static_cast<long long>(r.bytes),
                  r.floor_us(), r.median_us / r.floor_us(), r.valid ? "ok" : "MISMATCH");
      std::fflush(stdout);
      rows.push_back(r);
    };
    for (int64_t clen : clens)
      for (const auto& shape : shapes)
        for (int T : Ts) {
          if (shape == "verify" && T < 6) continue;  // a verify block is 6 rows
          const bool verify = shape == "verify";
          auto row_of = [&](const std::string& kernel, const std::string& version, int64_t bytes, bool valid,
                            double us) {
            Row r;
            r.kernel = kernel;
            r.version = version;
            r.shape = shape;
            r.T = T;
            r.clen = clen;
            r.bytes = bytes;
            r.valid = valid;
            r.median_us = us;
            report(r);
          };
          auto scores_bytes = [&](const Problem& pb) {
            return pb.distinct_positions * (kn::kIndexerCodeBytes + kn::kIndexerScaleBytes) +
                   pb.distinct_positions * 4 + int64_t{pb.T} * pb.stride * 4 + int64_t{pb.T} * kHeads * (64 + 4 + 4);
          };
          if (!select_only && (want("scores", "wide") || want("scores", "g6-wide"))) {  // wide scales: the per-block path (auto tiles), one row per CTA and (verify) 6
            Problem wide = make_problem(shape, T, clen, /*wide=*/true);
            V4_CUDA_CHECK(cudaDeviceSynchronize());
            for (int g : verify ? std::vector<int>{1, 6} : std::vector<int>{1}) {
              if (!want("scores", g == 1 ? "wide" : "g6-wide")) continue;
              const auto p = scores_params(wide, 0, g);
              const bool ok = validate_scores(wide, stream, g);
              row_of("scores", g == 1 ? "wide" : "g6-wide", scores_bytes(wide), ok,
                     cold_median_us([&](cudaStream_t s) { kn::run_indexer_scores(p, s, false); }));
            }
          }
          Problem pb = make_problem(shape, T, clen, /*wide=*/false);
          V4_CUDA_CHECK(cudaDeviceSynchronize());
          const bool scores_ok = select_only || validate_scores(pb, stream);
          // narrow scales: the fused path. Steps 8 .. 32 only when asked for by name (--only).
          for (int steps : {0, 1, 2, 4, 8, 12, 14, 16, 21, 24, 32}) {
            if (select_only) break;
            const std::string name = steps == 0 ? "auto" : "s" + std::to_string(steps);
            if (!want("scores", name) || (steps > 4 && only.empty())) continue;
            const auto p = scores_params(pb, steps);
            row_of("scores", name, scores_bytes(pb), scores_ok,
                   cold_median_us([&](cudaStream_t s) { kn::run_indexer_scores(p, s, false); }));
          }
          if (verify && !select_only && want("scores", "g6")) {
            const auto p = scores_params(pb, 0, 6);
            const bool ok = validate_scores(pb, stream, 6);
            row_of("scores", "g6", scores_bytes(pb), ok,
                   cold_median_us([&](cudaStream_t s) { kn::run_indexer_scores(p, s, false); }));
          }
          // Masked scores (an index source after the candidate source): only the kept blocks are
          // read and scored. "masked" = each row its own random 2048 blocks (the union of a verify
          // request's rows is then ~all blocks at small clen), "masked-sh" = the rows of a request
          // share theirs; tiles automatic or "mN" = N blocks per CTA.
          if (!select_only)
            for (bool shared : verify ? std::vector<bool>{false, true} : std::vector<bool>{false}) {
              const HostMask mask = make_mask(pb, shared);
              const int g = verify ? 6 : 1;
              for (int tile : {0, 16, 32, 64, 128, 256}) {
                const std::string name = std::string(shared ? "masked-sh" : "masked") + (tile ? "-m" + std::to_string(tile) : "");
                if (!want("scores", name)) continue;
                const auto p = masked_scores_params(pb, mask, g, tile);
                const bool ok = validate_scores(pb, stream, g, &mask, tile);
                const int64_t bytes = mask.kept_distinct * (kn::kIndexerCodeBytes + kn::kIndexerScaleBytes + 4) +
                                      int64_t{pb.T} * pb.stride * 4 + int64_t{pb.T} * (kHeads * (64 + 4 + 4) + pb.mask_stride);
                row_of("scores", name, bytes, ok, cold_median_us([&](cudaStream_t s) { kn::run_indexer_scores(p, s, false); }));
              }
            }
          // Top-k and the candidate mask read the scores the scores kernel left in d_scores.
          const int64_t topk_bytes = pb.visible_positions * 4 + int64_t{pb.T} * kTopk * (4 + 4);
          const int64_t mask_bytes = pb.visible_positions * 4 + int64_t{pb.T} * pb.mask_stride;
          for (const SelVersion& v : kSelVersions) {
            if (!want("topk", v.name) && !want("candidate_mask", v.name)) continue;
            bool mask_ok = false;
            const bool topk_ok = validate_topk_and_mask(pb, stream, v, mask_ok);
            kn::run_indexer_scores(scores_params(pb, 0), stream, false);
            const auto tp = topk_params(pb, v);
            row_of("topk", v.name, topk_bytes, topk_ok,
                   cold_median_us([&](cudaStream_t s) { kn::run_indexer_topk(tp, s, false); }));
            const auto mp = mask_params(pb, v);
            row_of("candidate_mask", v.name, mask_bytes, mask_ok,
                   cold_median_us([&](cudaStream_t s) { kn::run_candidate_mask(mp, s, false); }));
          }
          // Top-k v3 of a later index source (the candidate mask fused: 2048 random kept blocks per
          // row, the same mask for both rows), compacted (default) and walking every position;
          // checked against the reference's apply_candidate_mask + topk_to_slots of the GPU scores.
          const HostMask fused_mask = want("topk", "v3-masked") || want("topk", "v3-masked-nc") ||
                                              want("topk", "v3-masked-c1") || want("topk", "v3-masked-c2") ||
                                              want("topk", "v3-masked-c4") || want("topk", "v3w-masked")
                                          ? make_mask(pb, false)
                                                                                                 : HostMask{};
          // compacted (automatic cluster, 1, 2, 4 CTAs), walking every position, compacted with the window exchange
          for (const int variant : {0, 1, 2, 3, 4, 5}) {
            const bool compact = variant != 4, window = variant == 5;
            const int cluster = compact && variant != 5 ? (variant == 0 ? 0 : 1 << (variant - 1)) : 0;
            const std::string name_s = window     ? "v3w-masked"
                                       : !compact   ? "v3-masked-nc"
                                       : cluster == 0 ? "v3-masked"
                                                      : "v3-masked-c" + std::to_string(cluster);
            const char* name = name_s.c_str();
            if (!want("topk", name)) continue;
            const HostMask& mask = fused_mask;
            kn::run_indexer_scores(scores_params(pb, 0), stream, false);
            auto tp = topk_params(pb, kChainV3);
            tp.candidate_mask = mask.d.get();
            tp.mask_stride = pb.mask_stride;
            tp.mask_block = kMaskBlock;
            tp.v3_compact = compact;
            tp.v3_cluster = cluster;
            tp.v3_window = window;
            pb.d_out.fill_bytes(0xAB, stream);
            kn::run_indexer_topk(tp, stream, false);
            V4_CUDA_CHECK(cudaStreamSynchronize(stream));
            const auto want_t =
                reference_topk(pb, to_host(pb.d_scores, static_cast<size_t>(pb.T) * pb.stride), mask.bytes.data());
            const bool ok = to_host(pb.d_out, want_t.size()) == want_t;
            row_of("topk", name, topk_bytes + int64_t{pb.T} * pb.mask_stride, ok,
                   cold_median_us([&](cudaStream_t st) { kn::run_indexer_topk(tp, st, false); }));
          }
          // The candidate source's two selections: one pair launch (v3) against mask + top-k as two
          // launches ("serial"), both checked against the reference first.
          for (const char* form : {"v3", "serial", "v3w"}) {
            if (!want("pair", form)) continue;
            const bool one = std::string(form) != "serial";
            auto tp = topk_params(pb, kChainV3);
            auto mp = mask_params(pb, kChainV3);
            tp.v3_window = mp.v3_window = std::string(form) == "v3w";
            const auto issue = [&](cudaStream_t s) {
              if (one) {
                (void)kn::run_indexer_select_pair_v3(tp, mp, s, false);
              } else {
                kn::run_candidate_mask_v3(mp, s, false);
                kn::run_indexer_topk_v3(tp, s, false);
              }
            };
            kn::run_indexer_scores(scores_params(pb, 0), stream, false);
            pb.d_out.fill_bytes(0xAB, stream);
            pb.d_mask.fill_bytes(0xAB, stream);
            issue(stream);
            bool mask_ok = false;
            const bool topk_ok = check_topk_and_mask(pb, stream, mask_ok);
            row_of("pair", form, topk_bytes + mask_bytes - pb.visible_positions * 4, topk_ok && mask_ok,
                   cold_median_us(issue));
          }
          // q pack, then the chains (q pack overwrites the random q of d_codes: done last).
          const int64_t qpack_bytes = int64_t{pb.T} * (kHeads * 128 * 2 + kHeads * 2 + kHeads * (64 + 4 + 4) + 4);
          if (!select_only && want("qpack", "v2")) {
            const auto qp = qpack_params(pb);
            const bool ok = validate_chain(pb, stream, false);  // checks the q pack bytes too
            row_of("qpack", "v2", qpack_bytes, ok,
                   cold_median_us([&](cudaStream_t s) { kn::run_indexer_q_pack(qp, s, false); }));
          }
          for (int chain = 0; chain < 4; ++chain) {
            const bool with_mask = chain % 2 == 1;
            const SelVersion& sel = chain < 2 ? kChainV2 : kChainV3;
            if (!want("chain", std::string(with_mask ? "idx+mask" : "idx") + (chain < 2 ? "" : "-v3"))) continue;
            const bool ok = validate_chain(pb, stream, with_mask, sel);
            cudaGraph_t graph;
            cudaGraphExec_t exec;
            V4_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
            issue_chain(pb, stream, with_mask, sel);
            V4_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
            V4_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
            const double us =
                cold_median_us([&](cudaStream_t s) { V4_CUDA_CHECK(cudaGraphLaunch(exec, s)); });
            V4_CUDA_CHECK(cudaGraphExecDestroy(exec));
            V4_CUDA_CHECK(cudaGraphDestroy(graph));
            row_of("chain", std::string(with_mask ? "idx+mask" : "idx") + (chain < 2 ? "" : "-v3"),
                   qpack_bytes + scores_bytes(pb) + topk_bytes + (with_mask ? mask_bytes : 0), ok, us);
          }
        }

    if (!json_path.empty()) {
      nlohmann::json j = nlohmann::json::array();
      for (const Row& r : rows)
        j.push_back({{"kernel", r.kernel}, {"version", r.version}, {"shape", r.shape}, {"T", r.T}, {"clen", r.clen},
                     {"median_us", r.median_us}, {"bytes", r.bytes}, {"floor_us", r.floor_us()},
                     {"ratio", r.median_us / r.floor_us()}, {"valid", r.valid}});
      bench::write_json(json_path, j);
    }
    if (stamping) {
      V4_CUDA_CHECK(cudaDeviceSynchronize());
      std::printf("wrote %ld phase stamps to %s\n", stamps::dump(stamps_out), stamps_out);
    }
    V4_CUDA_CHECK(cudaStreamDestroy(stream));
    return bench::validity_exit_code("bench_indexer", all_valid);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_indexer: %s\n", e.what());
    return 1;
  }
}
