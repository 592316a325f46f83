// GPU lightning-indexer kernels against the CPU reference (include/v4attn/reference/indexer.h):
// q pack bytes, scores bit for bit, candidate mask bytes, masked scores, top-k slots exactly.
// Every output buffer (plus a guard tail) is poisoned before the call and compared whole, so an
// unwritten element or a write past the end fails.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "gpu_test_util.h"
#include "kernels/device_common.cuh"
#include "runtime/cuda_utils.h"
#include "runtime/launch.h"
#include "v4attn/cache_layout.h"
#include "v4attn/kernels/indexer_kernels.h"
#include "v4attn/numerics.h"
#include "v4attn/reference/indexer.h"
#include "v4attn/rope_table.h"

namespace {

using namespace v4attn;
using num::bf16_t;

constexpr uint8_t kPoison = test_util::kOutputPoison;
constexpr float kInf = std::numeric_limits<float>::infinity();

// ---- buffers ------------------------------------------------------------------------------------
using test_util::ErrorCount;
using test_util::PoisonedOutput;
using test_util::to_device;

// ---- launch modes -------------------------------------------------------------------------------
using test_util::Launch;
using test_util::launch_name;
using test_util::pdl_of;
using test_util::TestStream;
template <class T>
void late_feed(Launch mode, DeviceBuffer<T>& input, DeviceBuffer<T>& staging, cudaStream_t s) {
  test_util::late_feed(mode, input, staging, kPoison, s);
}

// Byte-identical arrays; on failure reports the first differing element.
template <class T>
void expect_same_bytes(const std::vector<T>& got, const std::vector<T>& want, const std::string& what,
                       int64_t row_len = 0) {
  ASSERT_EQ(got.size(), want.size()) << what;
  if (std::memcmp(got.data(), want.data(), got.size() * sizeof(T)) == 0) return;
  size_t bad = 0, n_bad = 0;
  for (size_t i = 0; i < got.size(); ++i)
    if (std::memcmp(&got[i], &want[i], sizeof(T)) != 0) {
      if (n_bad++ == 0) bad = i;
    }
  std::string where = "element " + std::to_string(bad);
  if (row_len > 0) where += " (row " + std::to_string(bad / row_len) + ", col " + std::to_string(bad % row_len) + ")";
  ADD_FAILURE() << what << ": " << n_bad << " element(s) differ; first at " << where << ": got " << +got[bad]
                << ", want " << +want[bad];
}

// ---- random inputs ------------------------------------------------------------------------------
std::vector<bf16_t> random_bf16(size_t n, std::mt19937_64& rng, float sigma = 1.0f) {
  std::normal_distribution<float> nd(0.0f, sigma);
  std::vector<bf16_t> v(n);
  for (auto& x : v) x = num::bf16_from_f32(nd(rng));
  return v;
}

// Scale mixes. The scores kernel has two exact paths: a fused one when every 4 block scales of a
// q head (all heads of the row) and of a K slot (all 16 slots of an MMA tile) lie within 2^3 of
// each other, and a per-block one otherwise. kWide feeds the per-block path only, kNarrow the
// fused path only, kMixed both (even rows narrow, odd rows wide; 98% of the K slots narrow).
// kHeadMixed: q heads narrow or wide at random (70% narrow) within every row, so the n-tiles of
// one row take different paths (the kernel decides per m-tile, row and n-tile of 8 heads).
enum class ScaleMix { kWide, kNarrow, kMixed, kHeadMixed };
const char* mix_name(ScaleMix m) {
  switch (m) {
    case ScaleMix::kWide: return "wide";
    case ScaleMix::kNarrow: return "narrow";
    case ScaleMix::kMixed: return "mixed";
    default: return "head-mixed";
  }
}

// 4 scale bytes of one vector: a base in 2^-11 .. 2^-1 plus 0..span per block.
void vector_scales(uint8_t* s4, int span, std::mt19937_64& rng) {
  const int base = 116 + static_cast<int>(rng() % 11);
  for (int b = 0; b < 4; ++b) s4[b] = static_cast<uint8_t>(base + static_cast<int>(rng() % (span + 1)));
}

// Indexer queries: random codes (every nibble value), realistic scale bytes, and one all-zero head
// block per row (the reference's floor scale path).
ref::IndexerQ random_q(int64_t T, std::mt19937_64& rng, ScaleMix mix = ScaleMix::kMixed) {
  ref::IndexerQ q;
  q.T = T;
  q.heads = kernels::kIndexerHeads;
  q.codes.resize(static_cast<size_t>(T) * q.heads * 64);
  q.scales.resize(static_cast<size_t>(T) * q.heads * 4);
  for (auto& b : q.codes) b = static_cast<uint8_t>(rng());
  for (int64_t t = 0; t < T; ++t) {
    const bool narrow = mix == ScaleMix::kNarrow || (mix == ScaleMix::kMixed && t % 2 == 0);
    for (int h = 0; h < q.heads; ++h) {
      const bool head_narrow = mix == ScaleMix::kHeadMixed ? rng() % 10 < 7 : narrow;
      vector_scales(&q.scales[(t * q.heads + h) * 4], head_narrow ? 3 : 20, rng);
    }
  }
  for (int64_t t = 0; t < T; ++t) {
    const int h = static_cast<int>(rng() % q.heads), b = static_cast<int>(rng() % 4);
    std::fill_n(q.codes.begin() + (t * q.heads + h) * 64 + 16 * b, 16, uint8_t{0});
  }
  return q;
}

std::vector<float> random_weights(int64_t T, std::mt19937_64& rng) {
  const auto wproj = random_bf16(static_cast<size_t>(T) * kernels::kIndexerHeads, rng, 2.0f);
  return ref::indexer_weights(wproj.data(), T, kernels::kIndexerHeads, kernels::kIndexerHeads);
}

struct IndexKPool {
  CacheLayout layout{};
  int64_t n_slots = 0;
  std::vector<uint8_t> bytes;
};
IndexKPool random_pool(int64_t n_slots, int page, std::mt19937_64& rng, ScaleMix mix = ScaleMix::kMixed) {
  IndexKPool pool;
  pool.layout = cache_layout(CacheKind::kIndexK, page);
  pool.n_slots = n_slots;
  pool.bytes.resize(static_cast<size_t>(pool.layout.pool_bytes(n_slots)));
  for (auto& b : pool.bytes) b = static_cast<uint8_t>(rng());
  for (int64_t s = 0; s < n_slots; ++s) {
    const bool narrow = mix == ScaleMix::kNarrow ||
                        ((mix == ScaleMix::kMixed || mix == ScaleMix::kHeadMixed) && rng() % 100 < 98);
    vector_scales(&pool.bytes[pool.layout.scale_offset(s)], narrow ? 3 : 12, rng);
  }
  return pool;
}

struct SlotTable {
  int64_t rows = 0, stride = 0;
  std::vector<int32_t> v;
};
// Each request's row: a fresh shuffle of the pool's slots (positions land anywhere in the pool).
SlotTable shuffled_table(int64_t rows, int64_t stride, int64_t n_slots, std::mt19937_64& rng) {
  SlotTable tab;
  tab.rows = rows;
  tab.stride = stride;
  tab.v.resize(static_cast<size_t>(rows * stride));
  std::vector<int32_t> perm(static_cast<size_t>(n_slots));
  std::iota(perm.begin(), perm.end(), 0);
  for (int64_t r = 0; r < rows; ++r) {
    std::shuffle(perm.begin(), perm.end(), rng);
    for (int64_t j = 0; j < stride; ++j) tab.v[r * stride + j] = perm[j % n_slots];
  }
  return tab;
}

// ---- scores -------------------------------------------------------------------------------------
struct ScoresProblem {
  ref::IndexerQ q;
  std::vector<float> w;
  IndexKPool pool;
  SlotTable table;
  std::vector<int32_t> req, clen;
  int64_t score_stride = 0;
  int64_t T() const { return q.T; }
};

ScoresProblem make_scores_problem(const std::vector<int32_t>& req, const std::vector<int32_t>& clen, int64_t n_req,
                                  int64_t score_stride, std::mt19937_64& rng, ScaleMix mix = ScaleMix::kMixed,
                                  int page = kDefaultPageSize) {
  ScoresProblem pb;
  const int64_t T = static_cast<int64_t>(req.size());
  pb.q = random_q(T, rng, mix);
  pb.w = random_weights(T, rng);
  const int64_t max_clen = std::max<int64_t>(1, *std::max_element(clen.begin(), clen.end()));
  pb.pool = random_pool(max_clen + 37, page, rng, mix);
  pb.table = shuffled_table(n_req, max_clen, pb.pool.n_slots, rng);
  pb.req = req;
  pb.clen = clen;
  pb.score_stride = score_stride;
  return pb;
}

std::vector<float> reference_scores(const ScoresProblem& pb) {
  std::vector<float> out(static_cast<size_t>(pb.T() * pb.score_stride));
  ref::indexer_scores(pb.q, pb.w.data(), pb.pool.bytes.data(), pb.pool.layout, pb.pool.n_slots, pb.req.data(),
                      pb.clen.data(), pb.table.v.data(), pb.table.stride, out.data(), pb.score_stride);
  return out;
}

struct GpuScores {
  std::vector<float> scores;
  unsigned long long errors = 0;
};
// Which scores input the late producer writes in Launch::kPdlLate.
enum class LateScoresInput { kQCodes, kCache };

// A candidate mask for the masked scores kernel: [T, stride] bytes, nonzero keeps a block of 8.
struct ScoresMask {
  std::vector<uint8_t> bytes;
  int64_t stride = 0;
  int tile_blocks = 0;  // mask_tile_blocks (0: automatic)
};

GpuScores gpu_scores(const ScoresProblem& pb, const std::vector<int32_t>& table_override = {}, int steps = 0,
                     Launch mode = Launch::kPlain, LateScoresInput late = LateScoresInput::kQCodes,
                     int group_rows = 1, int row_split = 0, int min_blocks = 0, const ScoresMask* mask = nullptr) {
  const int64_t T = pb.T();
  auto d_codes = to_device(pb.q.codes);
  auto d_scales = to_device(pb.q.scales);
  auto d_w = to_device(pb.w);
  auto d_cache = to_device(pb.pool.bytes);
  auto d_table = to_device(table_override.empty() ? pb.table.v : table_override);
  auto d_req = to_device(pb.req);
  auto d_clen = to_device(pb.clen);
  PoisonedOutput<float> out(static_cast<size_t>(T * pb.score_stride));
  ErrorCount err;
  kernels::IndexerScoresParams p;
  p.q_codes = d_codes.get();
  p.q_scales = d_scales.get();
  p.weights = d_w.get();
  p.index_k_cache = d_cache.get();
  p.layout = pb.pool.layout;
  p.n_slots = pb.pool.n_slots;
  p.req = d_req.get();
  p.clen = d_clen.get();
  p.comp_slot_table = d_table.get();
  p.comp_table_stride = pb.table.stride;
  p.comp_table_rows = pb.table.rows;
  p.scores = out.get();
  p.score_stride = pb.score_stride;
  p.T = T;
  p.err_count = err.get();
  p.steps_per_warp = steps;
  p.group_rows = group_rows;
  p.row_split = row_split;
  p.min_blocks = min_blocks;
  DeviceBuffer<uint8_t> d_mask;
  if (mask != nullptr) {
    d_mask = to_device(mask->bytes);
    p.candidate_mask = d_mask.get();
    p.mask_stride = mask->stride;
    p.mask_tile_blocks = mask->tile_blocks;
  }
  {
    TestStream stream;
    DeviceBuffer<uint8_t> staging;
    late_feed(mode, late == LateScoresInput::kQCodes ? d_codes : d_cache, staging, stream.s);
    kernels::run_indexer_scores(p, stream.s, pdl_of(mode));
    V4_CUDA_CHECK_LAUNCH();
    V4_CUDA_CHECK(cudaStreamSynchronize(stream.s));
  }
  return {out.download_checked(), err.read()};
}

void check_scores(const ScoresProblem& pb, const std::string& what, int steps = 0, Launch mode = Launch::kPlain,
                  int group_rows = 1, int row_split = 0, int min_blocks = 0) {
  const auto want = reference_scores(pb);
  const auto got = gpu_scores(pb, {}, steps, mode, LateScoresInput::kQCodes, group_rows, row_split, min_blocks);
  EXPECT_EQ(got.errors, 0u) << what;
  expect_same_bytes(got.scores, want, what, pb.score_stride);
}

// ---- selection inputs ---------------------------------------------------------------------------
// Scores with many exact ties: small integers (with both zeros), some continuous values, some -inf,
// NaN and +inf; entries past clen are finite garbage (must be ignored).
std::vector<float> tie_heavy_scores(int64_t T, int64_t stride, const std::vector<int32_t>& clen, std::mt19937_64& rng,
                                    int levels) {
  std::vector<float> s(static_cast<size_t>(T * stride));
  std::uniform_int_distribution<int> lvl(0, levels - 1);
  std::uniform_real_distribution<float> cont(-4.0f, 4.0f);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < stride; ++j) {
      float v;
      const uint64_t r = rng() % 1000;
      if (j >= clen[t]) v = 100.0f + static_cast<float>(j % 7);  // garbage past clen (larger than any valid)
      else if (r < 60) v = -kInf;                                  // masked
      else if (r < 62) v = std::numeric_limits<float>::quiet_NaN();
      else if (r < 63) v = kInf;
      else if (r < 200) v = cont(rng);
      else if (r < 260) v = -0.0f;
      else v = static_cast<float>(lvl(rng));
      s[t * stride + j] = v;
    }
  return s;
}

std::vector<float> random_scores(int64_t T, int64_t stride, const std::vector<int32_t>& clen, std::mt19937_64& rng) {
  std::vector<float> s(static_cast<size_t>(T * stride), -kInf);
  std::normal_distribution<float> nd(0.0f, 3.0f);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < clen[t]; ++j) s[t * stride + j] = nd(rng);
  return s;
}

struct TopkProblem {
  int64_t T = 0, stride = 0;
  std::vector<float> scores;
  std::vector<int32_t> req, clen;
  SlotTable table;
  int topk = 512;
  int64_t out_stride = 512;
  std::vector<uint8_t> mask;  // optional [T, mask_stride]
  int64_t mask_stride = 0;
  int mask_block = 8;
};

std::vector<int32_t> reference_topk(const TopkProblem& pb) {
  std::vector<float> s = pb.scores;
  if (!pb.mask.empty())
    ref::apply_candidate_mask(s.data(), pb.T, pb.stride, pb.clen.data(), pb.mask_block, pb.mask.data(), pb.mask_stride);
  std::vector<int32_t> out(static_cast<size_t>(pb.T * pb.out_stride));
  ref::topk_to_slots(s.data(), pb.T, pb.stride, pb.clen.data(), pb.topk, pb.req.data(), pb.table.v.data(),
                     pb.table.stride, out.data(), pb.out_stride);
  return out;
}

// Selection versions: v1 = one CTA per row (no workspace), v2 = many CTAs per row (workspace).
enum class Sel { kV1, kV2 };
constexpr Sel kSels[] = {Sel::kV1, Sel::kV2};
std::string sel_name(Sel v) { return v == Sel::kV1 ? "v1" : "v2"; }

// A zero-filled selection workspace of at least `bytes` (the stack's contract: zeroed once).
DeviceBuffer<uint8_t> zeroed_workspace(size_t bytes) {
  DeviceBuffer<uint8_t> ws(std::max<size_t>(bytes, 16));
  ws.fill_bytes(0);
  return ws;
}

// v2 runs on `ws` when given (kept across calls: its counters must come back zeroed), else on a
// fresh zeroed workspace of exactly the launch's size.
std::vector<int32_t> gpu_topk(const TopkProblem& pb, unsigned long long* errors = nullptr, Launch mode = Launch::kPlain,
                              Sel sel = Sel::kV1, DeviceBuffer<uint8_t>* ws = nullptr) {
  const size_t ws_bytes = kernels::indexer_topk_workspace_bytes(pb.T, pb.stride, pb.topk);
  DeviceBuffer<uint8_t> own_ws;
  if (sel == Sel::kV2 && ws == nullptr) {
    own_ws = zeroed_workspace(ws_bytes);
    ws = &own_ws;
  }
  auto d_scores = to_device(pb.scores);
  auto d_req = to_device(pb.req);
  auto d_clen = to_device(pb.clen);
  auto d_table = to_device(pb.table.v);
  auto d_mask = to_device(pb.mask);
  PoisonedOutput<int32_t> out(static_cast<size_t>(pb.T * pb.out_stride));
  ErrorCount err;
  kernels::IndexerTopkParams p;
  p.scores = d_scores.get();
  p.score_stride = pb.stride;
  p.clen = d_clen.get();
  p.req = d_req.get();
  p.T = pb.T;
  p.comp_slot_table = d_table.get();
  p.comp_table_stride = pb.table.stride;
  p.comp_table_rows = pb.table.rows;
  if (!pb.mask.empty()) {
    p.candidate_mask = d_mask.get();
    p.mask_stride = pb.mask_stride;
    p.mask_block = pb.mask_block;
  }
  p.topk = pb.topk;
  p.out = out.get();
  p.out_stride = pb.out_stride;
  p.err_count = err.get();
  if (sel == Sel::kV2) {
    p.workspace = ws->get();
    p.workspace_bytes = ws->bytes();
    EXPECT_GE(ws->bytes(), ws_bytes);
  }
  {
    TestStream stream;
    DeviceBuffer<float> staging;
    late_feed(mode, d_scores, staging, stream.s);
    kernels::run_indexer_topk(p, stream.s, pdl_of(mode));
    V4_CUDA_CHECK_LAUNCH();
    V4_CUDA_CHECK(cudaStreamSynchronize(stream.s));
  }
  auto got = out.download_checked();
  const auto e = err.read();
  if (errors != nullptr) *errors = e;
  else EXPECT_EQ(e, 0u);
  return got;
}

TopkProblem make_topk_problem(const std::vector<int32_t>& clen, int64_t stride, int topk, int64_t out_stride,
                              std::mt19937_64& rng, bool ties) {
  TopkProblem pb;
  pb.T = static_cast<int64_t>(clen.size());
  pb.stride = stride;
  pb.clen = clen;
  pb.topk = topk;
  pb.out_stride = out_stride;
  const int64_t n_req = 3;
  pb.req.resize(clen.size());
  for (size_t t = 0; t < clen.size(); ++t) pb.req[t] = static_cast<int32_t>(rng() % n_req);
  pb.table = shuffled_table(n_req, stride, stride + 11, rng);
  pb.scores = ties ? tie_heavy_scores(pb.T, stride, clen, rng, 12) : random_scores(pb.T, stride, clen, rng);
  return pb;
}

// ---- candidate mask -----------------------------------------------------------------------------
struct MaskProblem {
  int64_t T = 0, stride = 0, mask_stride = 0;
  std::vector<float> scores;
  std::vector<int32_t> clen;
  int block = 8, topk_blocks = 2048;
};

std::vector<uint8_t> reference_mask(const MaskProblem& pb) {
  std::vector<uint8_t> m(static_cast<size_t>(pb.T * pb.mask_stride));
  ref::candidate_mask(pb.scores.data(), pb.T, pb.stride, pb.clen.data(), pb.block, pb.topk_blocks, m.data(),
                      pb.mask_stride);
  return m;
}

std::vector<uint8_t> gpu_mask(const MaskProblem& pb, Launch mode = Launch::kPlain, Sel sel = Sel::kV1,
                              DeviceBuffer<uint8_t>* ws = nullptr) {
  const size_t ws_bytes = kernels::candidate_mask_workspace_bytes(pb.T, pb.stride, pb.block, pb.topk_blocks);
  DeviceBuffer<uint8_t> own_ws;
  if (sel == Sel::kV2 && ws == nullptr) {
    own_ws = zeroed_workspace(ws_bytes);
    ws = &own_ws;
  }
  auto d_scores = to_device(pb.scores);
  auto d_clen = to_device(pb.clen);
  PoisonedOutput<uint8_t> out(static_cast<size_t>(pb.T * pb.mask_stride));
  ErrorCount err;
  kernels::CandidateMaskParams p;
  p.scores = d_scores.get();
  p.score_stride = pb.stride;
  p.clen = d_clen.get();
  p.T = pb.T;
  p.block = pb.block;
  p.topk_blocks = pb.topk_blocks;
  p.mask = out.get();
  p.mask_stride = pb.mask_stride;
  p.err_count = err.get();
  if (sel == Sel::kV2) {
    p.workspace = ws->get();
    p.workspace_bytes = ws->bytes();
    EXPECT_GE(ws->bytes(), ws_bytes);
  }
  {
    TestStream stream;
    DeviceBuffer<float> staging;
    late_feed(mode, d_scores, staging, stream.s);
    kernels::run_candidate_mask(p, stream.s, pdl_of(mode));
    V4_CUDA_CHECK_LAUNCH();
    V4_CUDA_CHECK(cudaStreamSynchronize(stream.s));
  }
  EXPECT_EQ(err.read(), 0u);
  return out.download_checked();
}

// =================================================================================================
// q pack
// =================================================================================================

struct QPackInputs {
  int64_t T = 0, qi_stride = 0, wproj_stride = 0, max_pos = 0;
  std::vector<bf16_t> qi;        // [T, 4096] contiguous (the reference's layout)
  std::vector<bf16_t> qi_strided;
  std::vector<bf16_t> wproj;     // [T, 32]
  std::vector<bf16_t> wproj_strided;
  std::vector<int32_t> pos;
  std::vector<float> table;
};

QPackInputs make_qpack_inputs(int64_t T, int64_t qi_pad, int64_t w_pad, std::mt19937_64& rng) {
  QPackInputs in;
  in.T = T;
  in.max_pos = 3000;
  RopeParams rp;
  rp.base = 160000.0;
  rp.yarn = true;
  in.table = build_rope_table(rp, in.max_pos);
  const int64_t D = int64_t{kernels::kIndexerHeads} * kernels::kIndexerHeadDim;
  in.qi = random_bf16(static_cast<size_t>(T * D), rng);
  // Spread the block scales: each 32-block gets its own power-of-two magnitude (2^-9 .. 2^8), and
  // one block per row is all zero (the amax floor).
  for (int64_t t = 0; t < T; ++t)
    for (int64_t blk = 0; blk < D / 32; ++blk) {
      const float f = std::ldexp(1.0f, static_cast<int>(rng() % 18) - 9);
      for (int i = 0; i < 32; ++i) {
        bf16_t& x = in.qi[t * D + blk * 32 + i];
        x = num::bf16_from_f32(num::f32_from_bf16(x) * f);
      }
    }
  for (int64_t t = 0; t < T; ++t) std::fill_n(in.qi.begin() + t * D + 32 * static_cast<int64_t>(rng() % (D / 32)), 32, bf16_t{0});
  in.wproj = random_bf16(static_cast<size_t>(T * kernels::kIndexerHeads), rng, 3.0f);
  in.pos.resize(static_cast<size_t>(T));
  for (auto& p : in.pos) p = static_cast<int32_t>(rng() % in.max_pos);
  if (T > 1) in.pos[1] = static_cast<int32_t>(in.max_pos - 1);
  in.qi_stride = D + qi_pad;
  in.wproj_stride = kernels::kIndexerHeads + w_pad;
  in.qi_strided.assign(static_cast<size_t>(T * in.qi_stride), num::bf16_from_f32(7.0f));
  in.wproj_strided.assign(static_cast<size_t>(T * in.wproj_stride), num::bf16_from_f32(7.0f));
  for (int64_t t = 0; t < T; ++t) {
    std::copy_n(in.qi.begin() + t * D, D, in.qi_strided.begin() + t * in.qi_stride);
    std::copy_n(in.wproj.begin() + t * kernels::kIndexerHeads, kernels::kIndexerHeads,
                in.wproj_strided.begin() + t * in.wproj_stride);
  }
  return in;
}

struct QPackOut {
  std::vector<uint8_t> codes, scales;
  std::vector<float> weights;
  unsigned long long errors = 0;
};
// heads < 32: the first `heads` heads of each row (the stack's tensor-parallel compact heads).
QPackOut gpu_qpack(const QPackInputs& in, Launch mode, int heads = kernels::kIndexerHeads) {
  auto d_qi = to_device(in.qi_strided);
  auto d_w = to_device(in.wproj_strided);
  auto d_pos = to_device(in.pos);
  auto d_table = to_device(in.table);
  const int64_t H = heads;
  PoisonedOutput<uint8_t> codes(static_cast<size_t>(in.T * H * 64));
  PoisonedOutput<uint8_t> scales(static_cast<size_t>(in.T * H * 4));
  PoisonedOutput<float> weights(static_cast<size_t>(in.T * H));
  ErrorCount err;
  kernels::IndexerQPackParams p;
  p.qi = d_qi.get();
  p.qi_stride = in.qi_stride;
  p.wproj_out = d_w.get();
  p.wproj_stride = in.wproj_stride;
  p.pos = d_pos.get();
  p.rope_table = d_table.get();
  p.max_pos = in.max_pos;
  p.T = in.T;
  p.q_codes = codes.get();
  p.q_scales = scales.get();
  p.weights = weights.get();
  p.err_count = err.get();
  p.heads = heads;
  p.heads_total = kernels::kIndexerHeads;
  {
    TestStream stream;
    DeviceBuffer<bf16_t> staging;
    late_feed(mode, d_qi, staging, stream.s);
    kernels::run_indexer_q_pack(p, stream.s, pdl_of(mode));
    V4_CUDA_CHECK_LAUNCH();
    V4_CUDA_CHECK(cudaStreamSynchronize(stream.s));
  }
  return {codes.download_checked(), scales.download_checked(), weights.download_checked(), err.read()};
}

TEST(GpuIndexerQPack, BytesMatchReference) {
  V4_REQUIRE_GPU();
  std::mt19937_64 rng(0x5eed0001);
  for (int64_t T : {1, 6, 8, 48, 64}) {
    const int64_t qi_pad = T % 2 == 0 ? 64 : 0, w_pad = T % 3 == 0 ? 16 : 0;  // strided and contiguous rows
    const auto in = make_qpack_inputs(T, qi_pad, w_pad, rng);
    const auto want = ref::indexer_q_pack(in.qi.data(), T, kernels::kIndexerHeads, in.pos.data(), in.table.data(),
                                          in.max_pos);
    const auto want_w = ref::indexer_weights(in.wproj.data(), T, kernels::kIndexerHeads, kernels::kIndexerHeads);
    const Launch mode = T == 8 ? Launch::kPdlLate : (T == 6 ? Launch::kPdl : Launch::kPlain);
    const auto got = gpu_qpack(in, mode);
    const std::string what = "T=" + std::to_string(T) + " " + launch_name(mode);
    EXPECT_EQ(got.errors, 0u) << what;
    expect_same_bytes(got.codes, want.codes, what + " codes", 32 * 64);
    expect_same_bytes(got.scales, want.scales, what + " scales", 32 * 4);
    expect_same_bytes(got.weights, want_w, what + " weights", 32);
  }
}

TEST(GpuIndexerQPack, FewerHeadsMatchReference) {
  V4_REQUIRE_GPU();
  std::mt19937_64 rng(0x5eed0003);
  // 16 heads (4 CTAs of 4 heads per row) and 5 (a partial last CTA), strided inputs.
  for (int heads : {16, 5})
    for (int64_t T : {1, 6}) {
      const auto in = make_qpack_inputs(T, 64, 16, rng);
      std::vector<bf16_t> qi_c, wp_c;  // the reference's contiguous [T, heads*128] and [T, heads]
      for (int64_t t = 0; t < T; ++t) {
        qi_c.insert(qi_c.end(), in.qi.begin() + t * 4096, in.qi.begin() + t * 4096 + heads * 128);
        wp_c.insert(wp_c.end(), in.wproj.begin() + t * 32, in.wproj.begin() + t * 32 + heads);
      }
      const auto want = ref::indexer_q_pack(qi_c.data(), T, heads, in.pos.data(), in.table.data(), in.max_pos);
      const auto want_w = ref::indexer_weights(wp_c.data(), T, heads, kernels::kIndexerHeads);
      const auto got = gpu_qpack(in, T == 6 ? Launch::kPdlLate : Launch::kPlain, heads);
      const std::string what = "heads " + std::to_string(heads) + " T=" + std::to_string(T);
      EXPECT_EQ(got.errors, 0u) << what;
      expect_same_bytes(got.codes, want.codes, what + " codes", heads * 64);
      expect_same_bytes(got.scales, want.scales, what + " scales", heads * 4);
      expect_same_bytes(got.weights, want_w, what + " weights", heads);
    }
}

TEST(GpuIndexerQPack, WeightScaleIsOneOver64) {
  EXPECT_EQ(kernels::indexer_weight_scale(32), 1.0f / 64.0f);
  EXPECT_THROW(kernels::indexer_weight_scale(0), std::invalid_argument);
}

TEST(GpuIndexerQPack, PositionOutsideTableSkipsRowAndCounts) {
  V4_REQUIRE_GPU();
  std::mt19937_64 rng(0x5eed0002);
  auto in = make_qpack_inputs(6, 0, 0, rng);
  const auto want = ref::indexer_q_pack(in.qi.data(), 6, 32, in.pos.data(), in.table.data(), in.max_pos);
  in.pos[2] = static_cast<int32_t>(in.max_pos);  // one past the table
  in.pos[4] = -1;
  const auto got = gpu_qpack(in, Launch::kPlain);
  EXPECT_EQ(got.errors, 2u);
  for (int64_t t = 0; t < 6; ++t) {
    const bool skipped = t == 2 || t == 4;
    for (int64_t i = 0; i < 32 * 64; ++i) {
      const uint8_t w = skipped ? kPoison : want.codes[t * 32 * 64 + i];
      if (got.codes[t * 32 * 64 + i] != w) {
        ADD_FAILURE() << "row " << t << " code byte " << i;
        break;
      }
    }
    for (int64_t i = 0; i < 32 * 4; ++i)
      if (got.scales[t * 32 * 4 + i] != (skipped ? kPoison : want.scales[t * 32 * 4 + i])) {
        ADD_FAILURE() << "row " << t << " scale byte " << i;
        break;
      }
  }
  // Weights do not depend on pos: written for every row.
  expect_same_bytes(got.weights, ref::indexer_weights(in.wproj.data(), 6, 32, 32), "weights");
}

// =================================================================================================
// scores
// =================================================================================================

TEST(GpuIndexerScores, EdgeLengthsMatchReferenceBitForBit) {
  V4_REQUIRE_GPU();
  std::mt19937_64 rng(0x5eed0101);
  // clen 0, 1, 63, 64, 1000, 5000 on six rows of six requests; the stride leaves -inf tails.
  for (ScaleMix mix : {ScaleMix::kWide, ScaleMix::kNarrow, ScaleMix::kMixed, ScaleMix::kHeadMixed}) {
    const auto pb = make_scores_problem({0, 1, 2, 3, 4, 5}, {0, 1, 63, 64, 1000, 5000}, 6, 5056, rng, mix);
    check_scores(pb, std::string("edge lengths, ") + mix_name(mix) + " scales");
  }
}

TEST(GpuIndexerScores, TileSizesAndPdlGiveTheSameBits) {
  V4_REQUIRE_GPU();
  std::mt19937_64 rng(0x5eed0102);
  const auto pb = make_scores_problem({1, 0, 1}, {1500, 700, 1537}, 2, 1600, rng);
  const auto want = reference_scores(pb);
  // group_rows 3: the three rows in one CTA as three runs (req 1, 0, 1).
  for (int group_rows : {1, 3})
    for (int steps : {1, 2, 3, 4, 7, 13}) {  // 7, 13: odd step counts through the 2-buffer ring
      const auto got = gpu_scores(pb, {}, steps, steps == 3 ? Launch::kPdl : Launch::kPlain, LateScoresInput::kQCodes,
                                  group_rows);
      EXPECT_EQ(got.errors, 0u);
      expect_same_bytes(got.scores, want, "steps " + std::to_string(steps) + " group_rows " + std::to_string(group_rows),
                        pb.score_stride);
    }
  // PDL with late inputs: q (from the q-pack kernel) and the index-K cache (from the index-K
  // store) are only read after griddepcontrol.wait.
  for (int group_rows : {1, 3})
    for (LateScoresInput late : {LateScoresInput::kQCodes, LateScoresInput::kCache}) {
      const auto got = gpu_scores(pb, {}, 0, Launch::kPdlLate, late, group_rows);
      EXPECT_EQ(got.errors, 0u);
      expect_same_bytes(got.scores, want,
                        std::string(late == LateScoresInput::kQCodes ? "late q" : "late K") + " group_rows " +
                            std::to_string(group_rows),
                        pb.score_stride);
    }
}

TEST(GpuIndexerScores, FullContext65536MatchesReference) {
  V4_REQUIRE_GPU();
  std::mt19937_64 rng(0x5eed0103);
  const auto pb = make_scores_problem({0}, {65536}, 1, 65536, rng, ScaleMix::kMixed);  // row 0: fused q
  check_scores(pb, "clen 65536");
}

TEST(GpuIndexerScores, DecodeBatchesMatchReference) {
  V4_REQUIRE_GPU();
  std::mt19937_64 rng(0x5eed0104);
  for (int64_t T : {1, 6, 8, 48, 64}) {
    std::vector<int32_t> req(static_cast<size_t>(T)), clen(static_cast<size_t>(T));
    for (int64_t t = 0; t < T; ++t) {
      req[t] = static_cast<int32_t>(rng() % 5);
      clen[t] = static_cast<int32_t>(rng() % 700);
    }
    if (T > 1) {
      req[T - 1] = -1;  // padded rows: req -1 (with and without a stale clen) see nothing
      clen[T - 1] = 0;
    }
    if (T > 2) req[T - 2] = -1;
    const auto pb = make_scores_problem(req, clen, 5, 704, rng);
    check_scores(pb, "decode T=" + std::to_string(T));
  }
}

TEST(GpuIndexerScores, VerifyBatchWithPaddedRowsAndSmallPages) {
  V4_REQUIRE_GPU();
  std::mt19937_64 rng(0x5eed0105);
  // 4 requests x 6 verify rows (consecutive positions: clen c..c+5), then 8 padded rows.
  std::vector<int32_t> req, clen;
  const int32_t base[4] = {90, 511, 1024, 2047};
  for (int r = 0; r < 4; ++r)
    for (int v = 0; v < 6; ++v) {
      req.push_back(r);
      clen.push_back(base[r] + v);
    }
  for (int i = 0; i < 8; ++i) {
    req.push_back(-1);
    clen.push_back(0);
  }
  for (int page : {64, 16}) {
    const auto pb = make_scores_problem(req, clen, 4, 2112, rng, page == 64 ? ScaleMix::kNarrow : ScaleMix::kMixed, page);
    // group_rows 6: one request per CTA; 4 and 8: groups straddle requests (several runs per CTA).
    for (int group_rows : {1, 6, 4, 8})
      check_scores(pb, "verify, page " + std::to_string(page) + ", group_rows " + std::to_string(group_rows), 0,
                   Launch::kPlain, group_rows);
  }
}

TEST(GpuIndexerScores, OutOfRangeSlotsGiveMinusInfAndAreCounted) {
  V4_REQUIRE_GPU();
  std::mt19937_64 rng(0x5eed0106);
  const auto pb = make_scores_problem({0, 1}, {300, 200}, 2, 320, rng);
  const auto want = reference_scores(pb);  // valid table
  auto bad = pb.table.v;
  bad[0 * pb.table.stride + 17] = static_cast<int32_t>(pb.pool.n_slots);  // one past the pool
  bad[1 * pb.table.stride + 199] = -3;
  bad[1 * pb.table.stride + 250] = -3;  // past clen of row 1: never read, not counted
  const auto got = gpu_scores(pb, bad);
  EXPECT_EQ(got.errors, 2u);
  auto want_bad = want;
  want_bad[0 * pb.score_stride + 17] = -kInf;
  want_bad[1 * pb.score_stride + 199] = -kInf;
  expect_same_bytes(got.scores, want_bad, "bad slots", pb.score_stride);
}

TEST(GpuIndexerScores, BadRowMetadataIsContainedAndCounted) {
  V4_REQUIRE_GPU();
  std::mt19937_64 rng(0x5eed0107);
  auto pb = make_scores_problem({0, 1, 0}, {100, 50, 64}, 2, 128, rng);
  auto want = reference_scores(pb);
  // Row 1: unknown request (2 rows in the table) -> sees nothing; row 2: clen past the stride ->
  // clamped to min(score_stride, table stride) (the reference refuses both).
  pb.req[1] = 2;
  pb.clen[2] = 129;
  const auto got = gpu_scores(pb);
  EXPECT_EQ(got.errors, 2u);
  std::fill_n(want.begin() + 1 * pb.score_stride, pb.score_stride, -kInf);
  auto pb_clamped = pb;
  pb_clamped.req[1] = 1;
  pb_clamped.clen = {100, 0, static_cast<int32_t>(std::min<int64_t>(pb.score_stride, pb.table.stride))};
  const auto want_row2 = reference_scores(pb_clamped);
  std::copy_n(want_row2.begin() + 2 * pb.score_stride, pb.score_stride, want.begin() + 2 * pb.score_stride);
  expect_same_bytes(got.scores, want, "contained rows", pb.score_stride);
}

TEST(GpuIndexerScores, GroupedVerifyRowsMatchReferenceAndSharedReadsCountOnce) {
  V4_REQUIRE_GPU();
  std::mt19937_64 rng(0x5eed0108);
  // 2 requests x 6 verify rows at ~6000 positions (several tiles, head-mixed paths), 2 padded rows.
  std::vector<int32_t> req, clen;
  for (int r = 0; r < 2; ++r)
    for (int v = 0; v < 6; ++v) {
      req.push_back(r);
      clen.push_back(5995 + 3 * r + v);
    }
  req.push_back(-1);
  clen.push_back(0);
  req.push_back(-1);
  clen.push_back(17);  // stale clen of a padded row: sees nothing, not an error
  const auto pb = make_scores_problem(req, clen, 2, 6016, rng, ScaleMix::kHeadMixed);
  // row_split 1 and 2 (two warp sets splitting the rows of a run; 0 = automatic) give the same bits.
  for (int group_rows : {6, 1, 7})
    for (int steps : {0, 1, 3, 16})
      for (int row_split : {0, 1, 2})
        check_scores(pb,
                     "grouped verify, group_rows " + std::to_string(group_rows) + " steps " + std::to_string(steps) +
                         " row_split " + std::to_string(row_split),
                     steps, Launch::kPlain, group_rows, row_split);
  // The 4-CTAs-per-SM register cap (spills) gives the same bits, on every tile size.
  for (int group_rows : {6, 1})
    for (int steps : {1, 2, 3, 4})
      check_scores(pb, "min_blocks 4, group_rows " + std::to_string(group_rows) + " steps " + std::to_string(steps), steps,
                   Launch::kPlain, group_rows, 1, 4);

  // Bad slots: position 17 is seen by all 6 rows of request 0, position 5998 only by its rows 4
  // and 5 (clen 5999, 6000). Each row's score there is -inf; the error is counted once per read:
  // per row with group_rows 1, once per request run with group_rows 6.
  auto bad = pb.table.v;
  bad[17] = -5;
  bad[5998] = static_cast<int32_t>(pb.pool.n_slots);
  auto want = reference_scores(pb);
  for (int t = 0; t < 6; ++t) want[t * pb.score_stride + 17] = -kInf;
  for (int t = 4; t < 6; ++t) want[t * pb.score_stride + 5998] = -kInf;
  for (int group_rows : {1, 6})
    for (int row_split : {1, 2}) {  // the second warp set reads the same positions: counted once still
      const auto got = gpu_scores(pb, bad, 0, Launch::kPlain, LateScoresInput::kQCodes, group_rows, row_split);
      EXPECT_EQ(got.errors, group_rows == 1 ? 8u : 2u) << "group_rows " << group_rows << " row_split " << row_split;
      expect_same_bytes(got.scores, want,
                        "bad slots, group_rows " + std::to_string(group_rows) + " row_split " + std::to_string(row_split),
                        pb.score_stride);
    }
}

TEST(GpuIndexerScores, ExtremeWeightsKeepBothPathsExact) {
  V4_REQUIRE_GPU();
  std::mt19937_64 rng(0x5eed0109);
  // Head weights where sq_min * w is not an exact fp32 number (the fused path's precondition):
  // subnormal and tiny weights (the product underflows), 2^126 (it overflows on the larger q
  // scales), besides +0, -0 and ordinary ones. The kernel must fall back per n-tile and still
  // give the reference's bits (terms may be subnormal or +inf; weights are all >= 0 where huge,
  // so a sum never meets inf - inf).
  for (ScaleMix mix : {ScaleMix::kNarrow, ScaleMix::kHeadMixed}) {
    auto pb = make_scores_problem({0, 0, 1, 1}, {700, 701, 950, 64}, 2, 960, rng, mix);
    for (int64_t t = 0; t < pb.T(); ++t) {
      float* w = pb.w.data() + t * kernels::kIndexerHeads;
      w[1] = 0.0f;
      w[2] = -0.0f;
      w[3] = std::ldexp(1.0f, -120);
      w[4] = -std::ldexp(1.0f, -135);  // subnormal
      w[9] = std::ldexp(1.0f, 126);
      w[17] = std::ldexp(1.5f, -130);   // subnormal
      w[30] = -std::ldexp(1.0f, -118);
    }
    for (int group_rows : {1, 2}) check_scores(pb, std::string("extreme weights, ") + mix_name(mix), 0, Launch::kPlain, group_rows);
  }
}

// Masks of every kind for T rows: kept fraction `keep_pct` of the blocks per row (independent rows),
// or runs of kept blocks ("clustered": the rows of a request share most of them, like real
// neighbouring queries), or none / all.
enum class MaskKind { kRandom, kClustered, kNone, kAll };
ScoresMask make_mask(int64_t T, int64_t score_stride, MaskKind kind, int keep_pct, std::mt19937_64& rng) {
  ScoresMask m;
  m.stride = score_stride / 8 + 3;  // wider than needed: the kernel must use the stride
  m.bytes.assign(static_cast<size_t>(T * m.stride), 0);
  std::vector<uint8_t> shared(static_cast<size_t>(m.stride), 0);
  for (auto& b : shared) b = rng() % 100 < static_cast<uint64_t>(keep_pct) ? 1 : 0;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t b = 0; b < m.stride; ++b) {
      uint8_t v = 0;
      switch (kind) {
        case MaskKind::kRandom: v = rng() % 100 < static_cast<uint64_t>(keep_pct) ? static_cast<uint8_t>(1 + rng() % 255) : 0; break;
        case MaskKind::kClustered: v = ((b / 16) % 4 == 0 || (shared[b] && rng() % 8 != 0)) ? 1 : 0; break;
        case MaskKind::kNone: v = 0; break;
        case MaskKind::kAll: v = 1; break;
      }
      m.bytes[t * m.stride + b] = v;
    }
  return m;
}

// The masked kernel's output must be ref::apply_candidate_mask of the reference scores, byte for byte.
// `unmasked` = reference_scores(pb) (computed once per problem by the caller).
void check_masked_scores(const ScoresProblem& pb, const std::vector<float>& unmasked, const ScoresMask& mask,
                         const std::string& what, int group_rows, Launch mode = Launch::kPlain,
                         LateScoresInput late = LateScoresInput::kQCodes, int min_blocks = 0) {
  auto want = unmasked;
  ref::apply_candidate_mask(want.data(), pb.T(), pb.score_stride, pb.clen.data(), 8, mask.bytes.data(), mask.stride);
  const auto got = gpu_scores(pb, {}, 0, mode, late, group_rows, 0, min_blocks, &mask);
  EXPECT_EQ(got.errors, 0u) << what;
  expect_same_bytes(got.scores, want, what, pb.score_stride);
}

TEST(GpuIndexerScoresMasked, DecodeRowsEqualApplyMaskOfReference) {
  V4_REQUIRE_GPU();
  std::mt19937_64 rng(0x5eed0111);
  // Rows of distinct requests (one row per run), lengths across several tiles of every size and
  // partial last blocks, a padded row and an empty one.
  const std::vector<int32_t> req = {0, 1, 2, 3, -1, 4, 5};
  const std::vector<int32_t> clen = {4099, 2053, 1, 64, 0, 0, 3333};
  for (ScaleMix mix : {ScaleMix::kNarrow, ScaleMix::kMixed}) {
    const auto pb = make_scores_problem(req, clen, 6, 4160, rng, mix);
    const auto unmasked = reference_scores(pb);
    for (MaskKind kind : {MaskKind::kRandom, MaskKind::kClustered, MaskKind::kNone, MaskKind::kAll})
      for (int tile : {0, 16, 32, 64, 128, 256}) {
        auto mask = make_mask(pb.T(), pb.score_stride, kind, 25, rng);
        mask.tile_blocks = tile;
        check_masked_scores(pb, unmasked, mask,
                            std::string("decode, ") + mix_name(mix) + " scales, mask kind " +
                                std::to_string(static_cast<int>(kind)) + ", tile " + std::to_string(tile),
                            1);
      }
  }
}

TEST(GpuIndexerScoresMasked, VerifyGroupsEqualApplyMaskOfReference) {
  V4_REQUIRE_GPU();
  std::mt19937_64 rng(0x5eed0112);
  // 3 requests x 6 verify rows (each row its own mask: the run's list is their union, a row
  // skips the m-tiles it does not keep), 2 padded rows; groups of 6 (one request per CTA), 4 and 8
  // (groups straddle requests: several runs per CTA, each with its own list).
  std::vector<int32_t> req, clen;
  const int32_t base[3] = {5000, 1500, 77};
  for (int r = 0; r < 3; ++r)
    for (int v = 0; v < 6; ++v) {
      req.push_back(r);
      clen.push_back(base[r] + v);
    }
  req.insert(req.end(), {-1, -1});
  clen.insert(clen.end(), {0, 9});
  const auto pb = make_scores_problem(req, clen, 3, 5056, rng, ScaleMix::kHeadMixed);
  const auto unmasked = reference_scores(pb);
  for (MaskKind kind : {MaskKind::kRandom, MaskKind::kClustered})
    for (int keep : {25, 80})
      for (int group_rows : {6, 4, 8, 1})
        for (int tile : {0, 16, 128}) {
          auto mask = make_mask(pb.T(), pb.score_stride, kind, keep, rng);
          mask.tile_blocks = tile;
          const std::string what = "verify, mask kind " + std::to_string(static_cast<int>(kind)) + " keep " +
                                   std::to_string(keep) + " %, group_rows " + std::to_string(group_rows) + ", tile " +
                                   std::to_string(tile);
          check_masked_scores(pb, unmasked, mask, what, group_rows);
          if (tile == 16)  // the 16-block tile's other register cap (3 CTAs per SM)
            check_masked_scores(pb, unmasked, mask, what + ", 3 CTAs/SM", group_rows, Launch::kPlain,
                                LateScoresInput::kQCodes, 3);
        }
  // PDL: q and the index-K cache are only read after the wait (late producers).
  auto mask = make_mask(pb.T(), pb.score_stride, MaskKind::kRandom, 50, rng);
  for (LateScoresInput late : {LateScoresInput::kQCodes, LateScoresInput::kCache})
    check_masked_scores(pb, unmasked, mask, late == LateScoresInput::kQCodes ? "late q" : "late K", 6, Launch::kPdlLate, late);
}

TEST(GpuIndexerScoresMasked, FullContext65536WithTheRealBudget) {
  V4_REQUIRE_GPU();
  std::mt19937_64 rng(0x5eed0113);
  // 2048 kept blocks of 8192 per row (the V4.1 candidate budget at 64K), two decode rows.
  const auto pb = make_scores_problem({0, 1}, {65536, 65530}, 2, 65536, rng, ScaleMix::kMixed);
  auto mask = make_mask(pb.T(), pb.score_stride, MaskKind::kNone, 0, rng);
  for (int64_t t = 0; t < 2; ++t) {
    std::vector<int64_t> blocks(8192);
    std::iota(blocks.begin(), blocks.end(), 0);
    std::shuffle(blocks.begin(), blocks.end(), rng);
    for (int i = 0; i < 2048; ++i) mask.bytes[t * mask.stride + blocks[i]] = 1;
  }
  check_masked_scores(pb, reference_scores(pb), mask, "65536 positions, 2048 kept blocks", 1);
}

TEST(GpuIndexerScoresMasked, BadSlotsCountOnlyWhereRead) {
  V4_REQUIRE_GPU();
  std::mt19937_64 rng(0x5eed0114);
  const auto pb = make_scores_problem({0, 0}, {300, 301}, 1, 320, rng);
  auto mask = make_mask(pb.T(), pb.score_stride, MaskKind::kNone, 0, rng);
  // Row 0 keeps blocks 2 and 10, row 1 block 10 and 30.
  mask.bytes[0 * mask.stride + 2] = 1;
  mask.bytes[0 * mask.stride + 10] = 1;
  mask.bytes[1 * mask.stride + 10] = 1;
  mask.bytes[1 * mask.stride + 30] = 1;
  auto bad = pb.table.v;
  bad[17] = -2;                                          // block 2: kept by row 0, read: counted once
  bad[85] = static_cast<int32_t>(pb.pool.n_slots);       // block 10: kept by both rows (one read): once
  bad[100] = -2;                                         // block 12: no row keeps it: not read, not counted
  auto want = reference_scores(pb);
  ref::apply_candidate_mask(want.data(), pb.T(), pb.score_stride, pb.clen.data(), 8, mask.bytes.data(), mask.stride);
  want[0 * pb.score_stride + 17] = -kInf;
  want[0 * pb.score_stride + 85] = -kInf;
  want[1 * pb.score_stride + 85] = -kInf;
  for (int group_rows : {2, 1}) {
    const auto got = gpu_scores(pb, bad, 0, Launch::kPlain, LateScoresInput::kQCodes, group_rows, 0, 0, &mask);
    // group_rows 1: each row is its own run and reads its kept blocks (block 10 twice)
    EXPECT_EQ(got.errors, group_rows == 2 ? 2u : 3u) << "group_rows " << group_rows;
    expect_same_bytes(got.scores, want, "bad slots, group_rows " + std::to_string(group_rows), pb.score_stride);
  }
}

// =================================================================================================
// top-k
// =================================================================================================

TEST(GpuIndexerTopk, TiesMaskedAndShortRowsMatchReference) {
  V4_REQUIRE_GPU();
  std::mt19937_64 rng(0x5eed0201);
  const std::vector<int32_t> clen = {0, 1, 100, 511, 512, 513, 700, 5000, 20000, 65536};
  const auto pb = make_topk_problem(clen, 65536, 512, 576, rng, /*ties=*/true);
  const auto want = reference_topk(pb);
  for (Sel v : kSels) expect_same_bytes(gpu_topk(pb, nullptr, Launch::kPlain, v), want, "tie-heavy " + sel_name(v), pb.out_stride);
}

TEST(GpuIndexerTopk, DecodeBatchesMatchReference) {
  V4_REQUIRE_GPU();
  std::mt19937_64 rng(0x5eed0202);
  for (int64_t T : {1, 6, 8, 48, 64}) {
    std::vector<int32_t> clen(static_cast<size_t>(T));
    for (auto& c : clen) c = static_cast<int32_t>(rng() % 4096);
    if (T > 1) clen[0] = 4096;
    const bool ties = T % 2 == 0;
    auto pb = make_topk_problem(clen, 4096, 512, 512, rng, ties);
    if (T > 2) {
      pb.req[T - 1] = -1;  // padded rows (one with a stale clen) give all -1
      pb.clen[T - 2] = 0;
    }
    const Launch mode = T == 6 ? Launch::kPdlLate : (T == 8 ? Launch::kPdl : Launch::kPlain);
    const auto want = reference_topk(pb);
    for (Sel v : kSels)
      expect_same_bytes(gpu_topk(pb, nullptr, mode, v), want,
                        "T=" + std::to_string(T) + " " + launch_name(mode) + " " + sel_name(v), pb.out_stride);
  }
}

TEST(GpuIndexerTopk, AllEqualScoresTakeTheLowestPositions) {
  V4_REQUIRE_GPU();
  std::mt19937_64 rng(0x5eed0203);
  auto pb = make_topk_problem({65536, 3000, 512}, 65536, 512, 512, rng, false);
  for (int64_t t = 0; t < pb.T; ++t)
    for (int64_t j = 0; j < pb.clen[t]; ++j) pb.scores[t * pb.stride + j] = 0.5f;
  // Row 1: the equal run starts at 100 after -inf positions; one larger value at the end.
  for (int64_t j = 0; j < 100; ++j) pb.scores[1 * pb.stride + j] = -kInf;
  pb.scores[1 * pb.stride + 2999] = 1.0f;
  for (Sel v : kSels) {
    const auto got = gpu_topk(pb, nullptr, Launch::kPlain, v);
    expect_same_bytes(got, reference_topk(pb), "all equal " + sel_name(v), pb.out_stride);
    // Independent of the reference: row 0 is the slots of positions 0..511.
    for (int i = 0; i < 512; ++i) ASSERT_EQ(got[i], pb.table.v[pb.req[0] * pb.table.stride + i]) << sel_name(v) << " " << i;
  }
}

TEST(GpuIndexerTopk, OtherKAndWidths) {
  V4_REQUIRE_GPU();
  std::mt19937_64 rng(0x5eed0204);
  for (int topk : {0, 1, 64, 500, 2048}) {
    const std::vector<int32_t> clen = {0, 63, 2000, 2049, 9000};
    const int64_t out_stride = std::max<int64_t>(64, (topk + 63) / 64 * 64);
    const auto pb = make_topk_problem(clen, 9024, topk, out_stride, rng, topk % 2 == 0);
    const auto want = reference_topk(pb);
    for (Sel v : kSels)
      expect_same_bytes(gpu_topk(pb, nullptr, Launch::kPlain, v), want, "topk " + std::to_string(topk) + " " + sel_name(v),
                        pb.out_stride);
  }
}

TEST(GpuIndexerTopk, RowsLongerThanOneOutputChunk) {
  V4_REQUIRE_GPU();
  std::mt19937_64 rng(0x5eed0207);
  // > 65536 positions: the general path with several 65536-position output chunks.
  for (bool ties : {false, true}) {
    const auto pb = make_topk_problem({65537, 70000, 131072}, 131072, 512, 512, rng, ties);
    const auto want = reference_topk(pb);
    for (Sel v : kSels)
      expect_same_bytes(gpu_topk(pb, nullptr, Launch::kPlain, v), want,
                        std::string("long rows, ties ") + (ties ? "on " : "off ") + sel_name(v), pb.out_stride);
  }
}

TEST(GpuIndexerTopk, FusedCandidateMaskEqualsApplyThenTopk) {
  V4_REQUIRE_GPU();
  std::mt19937_64 rng(0x5eed0205);
  const std::vector<int32_t> clen = {0, 9, 800, 4100, 30000, 65536};
  for (bool ties : {false, true}) {
    auto pb = make_topk_problem(clen, 65536, 512, 512, rng, ties);
    pb.mask_block = 8;
    pb.mask_stride = 8192 + 64;
    pb.mask.resize(static_cast<size_t>(pb.T * pb.mask_stride));
    for (auto& m : pb.mask) m = (rng() % 4 == 0) ? 1 : 0;
    const auto want = reference_topk(pb);
    for (Sel v : kSels)
      expect_same_bytes(gpu_topk(pb, nullptr, Launch::kPlain, v), want,
                        std::string("masked, ties ") + (ties ? "on " : "off ") + sel_name(v), pb.out_stride);
  }
}

TEST(GpuIndexerTopk, BadRowMetadataIsContainedAndCounted) {
  V4_REQUIRE_GPU();
  std::mt19937_64 rng(0x5eed0206);
  auto pb = make_topk_problem({600, 600, 600}, 1024, 512, 512, rng, false);
  auto want = reference_topk(pb);
  pb.req[1] = 3;       // unknown request (3 table rows): all -1
  pb.clen[2] = 5000;   // past the stride: clamped to 1024
  std::fill_n(want.begin() + 512, 512, -1);
  auto pb2 = pb;
  pb2.req[1] = 0;
  pb2.clen = {600, 600, 1024};
  const auto want2 = reference_topk(pb2);
  std::copy_n(want2.begin() + 1024, 512, want.begin() + 1024);
  for (Sel v : kSels) {
    unsigned long long errors = 0;
    const auto got = gpu_topk(pb, &errors, Launch::kPlain, v);
    EXPECT_EQ(errors, 2u) << sel_name(v);
    expect_same_bytes(got, want, "contained rows " + sel_name(v), pb.out_stride);
  }
}

TEST(GpuIndexerTopk, V2EdgeLengthsUpTo131072MatchReference) {
  V4_REQUIRE_GPU();
  std::mt19937_64 rng(0x5eed0208);
  // One chunk (4096 positions) per v2 CTA: rows of 0, 1, k-1, k, k+1 positions, chunk edges, and
  // 16 / 32 chunks (one and two merge rounds of 8192 list entries).
  const std::vector<int32_t> clen = {0, 1, 511, 512, 513, 4095, 4096, 4097, 8193, 65536, 131072};
  for (bool ties : {true, false}) {
    const auto pb = make_topk_problem(clen, 131072, 512, 576, rng, ties);
    const auto want = reference_topk(pb);
    for (Sel v : kSels)
      expect_same_bytes(gpu_topk(pb, nullptr, ties ? Launch::kPdlLate : Launch::kPlain, v), want,
                        std::string("edge lengths, ties ") + (ties ? "on " : "off ") + sel_name(v), pb.out_stride);
  }
}

TEST(GpuIndexerTopk, V2TiesAcrossChunksAndMergeRounds) {
  V4_REQUIRE_GPU();
  std::mt19937_64 rng(0x5eed0209);
  auto pb = make_topk_problem({131072, 131072, 20000, 9000}, 131072, 512, 512, rng, false);
  // Row 0: all equal (every chunk lists its first 512, the merge keeps positions 0..511).
  for (int64_t j = 0; j < 131072; ++j) pb.scores[j] = 0.5f;
  // Row 1: equal values everywhere except 300 larger ones spread over the last chunks: the
  // threshold's ties come from the first chunk, the larger ones from the last.
  for (int64_t j = 0; j < 131072; ++j) pb.scores[1 * pb.stride + j] = -2.0f;
  for (int i = 0; i < 300; ++i) pb.scores[1 * pb.stride + 131071 - 17 * i] = 3.0f + static_cast<float>(i % 5);
  // Row 2: 3 distinct values with the k-th in the middle one; its ties span every chunk.
  for (int64_t j = 0; j < 20000; ++j) pb.scores[2 * pb.stride + j] = j % 97 == 0 ? 9.0f : (j % 7 == 0 ? 1.0f : -1.0f);
  // Row 3: -0.0 and +0.0 interleaved (one key), some -inf and NaN, a few positives.
  for (int64_t j = 0; j < 9000; ++j) {
    float x = (j % 2) ? -0.0f : 0.0f;
    if (j % 11 == 0) x = -kInf;
    if (j % 13 == 0) x = std::numeric_limits<float>::quiet_NaN();
    if (j % 1000 == 999) x = 1.0f;
    pb.scores[3 * pb.stride + j] = x;
  }
  const auto want = reference_topk(pb);
  for (Sel v : kSels) {
    const auto got = gpu_topk(pb, nullptr, Launch::kPlain, v);
    expect_same_bytes(got, want, "ties across chunks " + sel_name(v), pb.out_stride);
    for (int i = 0; i < 512; ++i)  // independent of the reference
      ASSERT_EQ(got[i], pb.table.v[pb.req[0] * pb.table.stride + i]) << sel_name(v) << " " << i;
  }
}

TEST(GpuIndexerTopk, V2IsDeterministicAndItsWorkspaceIsReusable) {
  V4_REQUIRE_GPU();
  std::mt19937_64 rng(0x5eed020a);
  // One workspace (zeroed once) for every launch below, of different shapes and both ops, in an
  // order where a small launch follows a large one and vice versa: each launch must leave it
  // ready for the next, and the same input must give the same bytes every time.
  const size_t bytes = std::max(kernels::indexer_topk_workspace_bytes(64, 131072, 2048),
                                kernels::candidate_mask_workspace_bytes(64, 131072, 8, 2048));
  auto ws = zeroed_workspace(bytes);
  std::vector<int32_t> clen_a(64);
  for (auto& c : clen_a) c = static_cast<int32_t>(rng() % 65537);
  clen_a[5] = 65536;
  const auto a = make_topk_problem(clen_a, 65536, 512, 512, rng, true);
  auto b = make_topk_problem({131072, 70000, 4097}, 131072, 2048, 2048, rng, false);
  b.mask_block = 8;
  b.mask_stride = 131072 / 8;
  b.mask.resize(static_cast<size_t>(b.T * b.mask_stride));
  for (auto& m : b.mask) m = (rng() % 3 == 0) ? 1 : 0;
  MaskProblem c;
  c.clen = {65536, 30000, 1, 0, 8 * 1024 + 3};
  c.T = 5;
  c.stride = 65536;
  c.mask_stride = 8192;
  c.scores = tie_heavy_scores(c.T, c.stride, c.clen, rng, 5);
  const auto want_a = reference_topk(a), want_b = reference_topk(b);
  const auto want_c = reference_mask(c);
  const auto first_a = gpu_topk(a, nullptr, Launch::kPlain, Sel::kV2, &ws);
  expect_same_bytes(first_a, want_a, "A #1");
  for (int rep = 0; rep < 3; ++rep) {
    expect_same_bytes(gpu_topk(b, nullptr, rep == 1 ? Launch::kPdl : Launch::kPlain, Sel::kV2, &ws), want_b, "B masked");
    expect_same_bytes(gpu_mask(c, Launch::kPlain, Sel::kV2, &ws), want_c, "C mask");
    const auto again = gpu_topk(a, nullptr, rep == 2 ? Launch::kPdlLate : Launch::kPlain, Sel::kV2, &ws);
    ASSERT_EQ(std::memcmp(again.data(), first_a.data(), again.size() * sizeof(int32_t)), 0) << "A differs on run " << rep;
  }
}

// =================================================================================================
// candidate mask and its application
// =================================================================================================

TEST(GpuIndexerCandidateMask, MatchesReference) {
  V4_REQUIRE_GPU();
  std::mt19937_64 rng(0x5eed0301);
  const std::vector<int32_t> clen = {0, 1, 7, 8, 9, 1000, 16384, 16385, 30001, 65536};
  for (bool ties : {false, true}) {
    MaskProblem pb;
    pb.T = static_cast<int64_t>(clen.size());
    pb.stride = 65536;
    pb.mask_stride = 8192 + 128;
    pb.clen = clen;
    pb.scores = ties ? tie_heavy_scores(pb.T, pb.stride, clen, rng, 6) : random_scores(pb.T, pb.stride, clen, rng);
    // A few blocks of only -inf (never kept unless newest).
    for (int64_t t = 0; t < pb.T; ++t)
      for (int64_t j = 800; j < std::min<int64_t>(clen[t], 880); ++j) pb.scores[t * pb.stride + j] = -kInf;
    const Launch mode = ties ? Launch::kPdlLate : Launch::kPlain;
    const auto want = reference_mask(pb);
    for (Sel v : kSels)
      expect_same_bytes(gpu_mask(pb, mode, v), want,
                        std::string("mask, ties ") + (ties ? "on " : "off ") + launch_name(mode) + " " + sel_name(v),
                        pb.mask_stride);
  }
}

TEST(GpuIndexerCandidateMask, MaskWiderThanOneOutputChunk) {
  V4_REQUIRE_GPU();
  std::mt19937_64 rng(0x5eed0304);
  // 600000 positions = 75000 blocks > 65536: the chunked output, and more blocks than the budget.
  MaskProblem pb;
  pb.clen = {600000, 70001, 0};
  pb.T = 3;
  pb.stride = 600064;
  pb.mask_stride = 75008 + 16;
  pb.scores = random_scores(pb.T, pb.stride, pb.clen, rng);
  for (int budget : {2048, 70000}) {
    pb.topk_blocks = budget;
    const auto want = reference_mask(pb);
    for (Sel v : kSels)
      expect_same_bytes(gpu_mask(pb, Launch::kPlain, v), want, "wide mask, budget " + std::to_string(budget) + " " + sel_name(v),
                        pb.mask_stride);
  }
}

TEST(GpuIndexerCandidateMask, OtherBlockSizesAndBudgets) {
  V4_REQUIRE_GPU();
  std::mt19937_64 rng(0x5eed0302);
  const std::vector<int32_t> clen = {0, 5, 333, 4000, 12345};
  for (int block : {1, 5, 8}) {
    for (int budget : {0, 3, 100, 2048}) {
      MaskProblem pb;
      pb.T = static_cast<int64_t>(clen.size());
      pb.stride = 12352;
      pb.block = block;
      pb.topk_blocks = budget;
      pb.mask_stride = (pb.stride + block - 1) / block + 3;
      pb.clen = clen;
      pb.scores = tie_heavy_scores(pb.T, pb.stride, clen, rng, 4);
      const auto want = reference_mask(pb);
      for (Sel v : kSels)
        expect_same_bytes(gpu_mask(pb, Launch::kPlain, v), want,
                          "block " + std::to_string(block) + " budget " + std::to_string(budget) + " " + sel_name(v),
                          pb.mask_stride);
    }
  }
}

TEST(GpuIndexerCandidateMask, V2ChunkEdgesMatchReference) {
  V4_REQUIRE_GPU();
  std::mt19937_64 rng(0x5eed0305);
  // v2 CTAs take 1024 blocks each: rows of 1023, 1024, 1025, 2048, 2049 and 16384 blocks (with
  // partial last blocks), budgets below, at and above a chunk, and above the row.
  const std::vector<int32_t> clen = {8 * 1023, 8 * 1024, 8 * 1024 + 1, 8 * 2048 - 3, 8 * 2049, 131072};
  for (int budget : {100, 1024, 2048, 5000, 20000}) {
    MaskProblem pb;
    pb.T = static_cast<int64_t>(clen.size());
    pb.stride = 131072;
    pb.mask_stride = 16384 + 40;
    pb.clen = clen;
    pb.topk_blocks = budget;
    pb.scores = budget % 2 == 0 ? tie_heavy_scores(pb.T, pb.stride, clen, rng, 3) : random_scores(pb.T, pb.stride, clen, rng);
    const auto want = reference_mask(pb);
    for (Sel v : kSels)
      expect_same_bytes(gpu_mask(pb, Launch::kPlain, v), want, "budget " + std::to_string(budget) + " " + sel_name(v),
                        pb.mask_stride);
  }
}

TEST(GpuIndexerCandidateMask, ApplyMatchesReference) {
  V4_REQUIRE_GPU();
  std::mt19937_64 rng(0x5eed0303);
  const std::vector<int32_t> clen = {0, 1, 9, 1000, 4096};
  const int64_t T = static_cast<int64_t>(clen.size()), stride = 4096, mask_stride = 520;
  auto scores = tie_heavy_scores(T, stride, clen, rng, 10);
  std::vector<uint8_t> mask(static_cast<size_t>(T * mask_stride));
  for (auto& m : mask) m = (rng() % 3 == 0) ? 1 : 0;
  auto want = scores;
  ref::apply_candidate_mask(want.data(), T, stride, clen.data(), 8, mask.data(), mask_stride);
  auto d_scores = to_device(scores);
  auto d_clen = to_device(clen);
  auto d_mask = to_device(mask);
  kernels::ApplyCandidateMaskParams p;
  p.scores = d_scores.get();
  p.score_stride = stride;
  p.clen = d_clen.get();
  p.T = T;
  p.block = 8;
  p.mask = d_mask.get();
  p.mask_stride = mask_stride;
  kernels::run_apply_candidate_mask(p, nullptr, false);
  V4_CUDA_CHECK_LAUNCH();
  std::vector<float> got(scores.size());
  d_scores.download(got.data(), got.size());
  expect_same_bytes(got, want, "apply mask", stride);
}

// =================================================================================================
// the whole indexer chain: q pack -> scores -> candidate mask -> masked top-k
// =================================================================================================

TEST(GpuIndexerChain, QPackScoresMaskTopkMatchReference) {
  V4_REQUIRE_GPU();
  std::mt19937_64 rng(0x5eed0401);
  // 8 rows, 2 per request (consecutive), clen up to ~9000 of a 9216 stride: the v2 selection
  // merges up to 3 chunks per row.
  const int64_t T = 8, stride = 9216;
  const auto in = make_qpack_inputs(T, 0, 0, rng);
  std::vector<int32_t> req(T), clen(T);
  for (int64_t t = 0; t < T; ++t) {
    req[t] = static_cast<int32_t>(t / 2);
    clen[t] = static_cast<int32_t>(rng() % 9000 + 1);
  }
  clen[3] = 9216;
  // Reference chain.
  ScoresProblem pb;
  pb.q = ref::indexer_q_pack(in.qi.data(), T, 32, in.pos.data(), in.table.data(), in.max_pos);
  pb.w = ref::indexer_weights(in.wproj.data(), T, 32, 32);
  pb.pool = random_pool(4000, 64, rng);
  pb.table = shuffled_table(4, stride, pb.pool.n_slots, rng);
  pb.req = req;
  pb.clen = clen;
  pb.score_stride = stride;
  const auto ref_scores = reference_scores(pb);
  const int64_t mask_stride = stride / 8;
  const int budget = 300;
  std::vector<uint8_t> ref_mask(static_cast<size_t>(T * mask_stride));
  ref::candidate_mask(ref_scores.data(), T, stride, clen.data(), 8, budget, ref_mask.data(), mask_stride);
  auto masked = ref_scores;
  ref::apply_candidate_mask(masked.data(), T, stride, clen.data(), 8, ref_mask.data(), mask_stride);
  std::vector<int32_t> ref_out(static_cast<size_t>(T * 512));
  ref::topk_to_slots(masked.data(), T, stride, clen.data(), 512, req.data(), pb.table.v.data(), pb.table.stride,
                     ref_out.data(), 512);

  auto d_qi = to_device(in.qi);
  auto d_wp = to_device(in.wproj);
  auto d_pos = to_device(in.pos);
  auto d_table = to_device(in.table);
  auto d_cache = to_device(pb.pool.bytes);
  auto d_slots = to_device(pb.table.v);
  auto d_req = to_device(req);
  auto d_clen = to_device(clen);
  // One workspace for the mask and the top-k (the stack's sharing), sized for both.
  auto ws = zeroed_workspace(std::max(kernels::indexer_topk_workspace_bytes(T, stride, 512),
                                      kernels::candidate_mask_workspace_bytes(T, stride, 8, budget)));
  for (Sel v : kSels) {
    const int group_rows = v == Sel::kV1 ? 1 : 2;
    const std::string what = sel_name(v) + " group_rows " + std::to_string(group_rows);
    // GPU chain on one stream with PDL between the kernels.
    cudaStream_t stream;
    V4_CUDA_CHECK(cudaStreamCreate(&stream));
    DeviceBuffer<uint8_t> d_codes(T * 32 * 64), d_scales(T * 32 * 4);
    DeviceBuffer<float> d_w(T * 32), d_scores(T * stride);
    DeviceBuffer<uint8_t> d_mask(T * mask_stride);
    DeviceBuffer<int32_t> d_out(T * 512);
    d_codes.fill_bytes(kPoison);
    d_scales.fill_bytes(kPoison);
    d_scores.fill_bytes(kPoison);
    d_mask.fill_bytes(kPoison);
    d_out.fill_bytes(kPoison);
    V4_CUDA_CHECK(cudaDeviceSynchronize());

    kernels::IndexerQPackParams qp;
    qp.qi = d_qi.get();
    qp.qi_stride = 32 * 128;
    qp.wproj_out = d_wp.get();
    qp.wproj_stride = 32;
    qp.pos = d_pos.get();
    qp.rope_table = d_table.get();
    qp.max_pos = in.max_pos;
    qp.T = T;
    qp.q_codes = d_codes.get();
    qp.q_scales = d_scales.get();
    qp.weights = d_w.get();
    kernels::run_indexer_q_pack(qp, stream, true);
    kernels::IndexerScoresParams sp;
    sp.q_codes = d_codes.get();
    sp.q_scales = d_scales.get();
    sp.weights = d_w.get();
    sp.index_k_cache = d_cache.get();
    sp.layout = pb.pool.layout;
    sp.n_slots = pb.pool.n_slots;
    sp.req = d_req.get();
    sp.clen = d_clen.get();
    sp.comp_slot_table = d_slots.get();
    sp.comp_table_stride = pb.table.stride;
    sp.comp_table_rows = pb.table.rows;
    sp.scores = d_scores.get();
    sp.score_stride = stride;
    sp.T = T;
    sp.group_rows = group_rows;
    kernels::run_indexer_scores(sp, stream, true);
    kernels::CandidateMaskParams cp;
    cp.scores = d_scores.get();
    cp.score_stride = stride;
    cp.clen = d_clen.get();
    cp.T = T;
    cp.block = 8;
    cp.topk_blocks = budget;
    cp.mask = d_mask.get();
    cp.mask_stride = mask_stride;
    kernels::IndexerTopkParams tp;
    tp.scores = d_scores.get();
    tp.score_stride = stride;
    tp.clen = d_clen.get();
    tp.req = d_req.get();
    tp.T = T;
    tp.comp_slot_table = d_slots.get();
    tp.comp_table_stride = pb.table.stride;
    tp.comp_table_rows = pb.table.rows;
    tp.candidate_mask = d_mask.get();
    tp.mask_stride = mask_stride;
    tp.mask_block = 8;
    tp.topk = 512;
    tp.out = d_out.get();
    tp.out_stride = 512;
    if (v == Sel::kV2) {
      cp.workspace = tp.workspace = ws.get();
      cp.workspace_bytes = tp.workspace_bytes = ws.bytes();
    }
    kernels::run_candidate_mask(cp, stream, true);
    kernels::run_indexer_topk(tp, stream, true);
    V4_CUDA_CHECK_LAUNCH();
    V4_CUDA_CHECK(cudaStreamSynchronize(stream));

    std::vector<float> got_scores(static_cast<size_t>(T * stride));
    d_scores.download(got_scores.data(), got_scores.size());
    std::vector<uint8_t> got_mask(static_cast<size_t>(T * mask_stride));
    d_mask.download(got_mask.data(), got_mask.size());
    std::vector<int32_t> got_out(static_cast<size_t>(T * 512));
    d_out.download(got_out.data(), got_out.size());
    V4_CUDA_CHECK(cudaStreamDestroy(stream));
    expect_same_bytes(got_scores, ref_scores, "chain scores " + what, stride);
    expect_same_bytes(got_mask, ref_mask, "chain mask " + what, mask_stride);
    expect_same_bytes(got_out, ref_out, "chain top-k " + what, 512);
  }
}

// =================================================================================================
// host-side refusals (no GPU needed: nothing is launched)
// =================================================================================================

template <class T>
T* fake_ptr() {
  return reinterpret_cast<T*>(uintptr_t{0x10000});  // aligned, never dereferenced on the host
}

kernels::IndexerScoresParams valid_scores_params() {
  kernels::IndexerScoresParams p;
  p.q_codes = fake_ptr<uint8_t>();
  p.q_scales = fake_ptr<uint8_t>();
  p.weights = fake_ptr<float>();
  p.index_k_cache = fake_ptr<uint8_t>();
  p.layout = cache_layout(CacheKind::kIndexK);
  p.n_slots = 100;
  p.req = fake_ptr<int32_t>();
  p.clen = fake_ptr<int32_t>();
  p.comp_slot_table = fake_ptr<int32_t>();
  p.comp_table_stride = 128;
  p.comp_table_rows = 1;
  p.scores = fake_ptr<float>();
  p.score_stride = 128;
  p.T = 1;
  return p;
}

kernels::IndexerTopkParams valid_topk_params() {
  kernels::IndexerTopkParams p;
  p.scores = fake_ptr<float>();
  p.score_stride = 1024;
  p.clen = fake_ptr<int32_t>();
  p.req = fake_ptr<int32_t>();
  p.T = 1;
  p.comp_slot_table = fake_ptr<int32_t>();
  p.comp_table_stride = 1024;
  p.comp_table_rows = 1;
  p.topk = 512;
  p.out = fake_ptr<int32_t>();
  p.out_stride = 512;
  return p;
}

TEST(GpuIndexerHostChecks, BadShapesAreRefusedBeforeLaunch) {
  {
    auto p = valid_scores_params();
    p.score_stride = 100;  // not a multiple of 64
    EXPECT_THROW(kernels::run_indexer_scores(p, nullptr, false), std::invalid_argument);
    p = valid_scores_params();
    p.layout = cache_layout(CacheKind::kCompressedFp4);
    EXPECT_THROW(kernels::run_indexer_scores(p, nullptr, false), std::invalid_argument);
    p = valid_scores_params();
    p.layout = cache_layout(CacheKind::kIndexK, 48);  // not a power of two
    EXPECT_THROW(kernels::run_indexer_scores(p, nullptr, false), std::invalid_argument);
    p = valid_scores_params();
    p.layout = cache_layout(CacheKind::kIndexK, 1 << 21);  // past 2^20 (32-bit in-page offsets)
    EXPECT_THROW(kernels::run_indexer_scores(p, nullptr, false), std::invalid_argument);
    p.layout = cache_layout(CacheKind::kIndexK, 1 << 20);  // the largest page: accepted (nothing to launch at T 0)
    p.T = 0;
    EXPECT_NO_THROW(kernels::run_indexer_scores(p, nullptr, false));
    p = valid_scores_params();
    p.q_codes = reinterpret_cast<uint8_t*>(uintptr_t{0x10004});  // misaligned
    EXPECT_THROW(kernels::run_indexer_scores(p, nullptr, false), std::invalid_argument);
    p = valid_scores_params();
    p.scores = nullptr;
    EXPECT_THROW(kernels::run_indexer_scores(p, nullptr, false), std::invalid_argument);
    p = valid_scores_params();
    p.steps_per_warp = 65;
    EXPECT_THROW(kernels::run_indexer_scores(p, nullptr, false), std::invalid_argument);
    for (int g : {0, 9}) {
      p = valid_scores_params();
      p.group_rows = g;
      EXPECT_THROW(kernels::run_indexer_scores(p, nullptr, false), std::invalid_argument) << "group_rows " << g;
    }
    p = valid_scores_params();
    p.T = -1;
    EXPECT_THROW(kernels::run_indexer_scores(p, nullptr, false), std::invalid_argument);
    // candidate mask: block 8 only, a stride covering score_stride / 8, one warp set, a known tile
    p = valid_scores_params();
    p.candidate_mask = fake_ptr<uint8_t>();
    p.mask_stride = 16;
    p.mask_block = 4;
    EXPECT_THROW(kernels::run_indexer_scores(p, nullptr, false), std::invalid_argument);
    p.mask_block = 8;
    p.mask_stride = 15;
    EXPECT_THROW(kernels::run_indexer_scores(p, nullptr, false), std::invalid_argument);
    p.mask_stride = 16;
    p.row_split = 2;
    EXPECT_THROW(kernels::run_indexer_scores(p, nullptr, false), std::invalid_argument);
    p.row_split = 0;
    p.mask_tile_blocks = 48;
    EXPECT_THROW(kernels::run_indexer_scores(p, nullptr, false), std::invalid_argument);
    p.mask_tile_blocks = 512;  // a list entry holds the block index in 8 bits
    EXPECT_THROW(kernels::run_indexer_scores(p, nullptr, false), std::invalid_argument);
  }
  {
    auto p = valid_topk_params();
    p.out_stride = 500;  // not a multiple of 64
    EXPECT_THROW(kernels::run_indexer_topk(p, nullptr, false), std::invalid_argument);
    p = valid_topk_params();
    p.topk = 576;  // wider than the output
    EXPECT_THROW(kernels::run_indexer_topk(p, nullptr, false), std::invalid_argument);
    p = valid_topk_params();
    p.candidate_mask = fake_ptr<uint8_t>();
    p.mask_stride = 100;  // < 1024 / 8
    EXPECT_THROW(kernels::run_indexer_topk(p, nullptr, false), std::invalid_argument);
    p = valid_topk_params();
    p.out = nullptr;
    EXPECT_THROW(kernels::run_indexer_topk(p, nullptr, false), std::invalid_argument);
    // v2: a workspace smaller than the launch needs, or misaligned.
    p = valid_topk_params();
    p.workspace = fake_ptr<uint8_t>();
    p.workspace_bytes = kernels::indexer_topk_workspace_bytes(p.T, p.score_stride, p.topk) - 1;
    EXPECT_THROW(kernels::run_indexer_topk(p, nullptr, false), std::invalid_argument);
    p.workspace = reinterpret_cast<void*>(uintptr_t{0x10008});
    p.workspace_bytes = kernels::indexer_topk_workspace_bytes(p.T, p.score_stride, p.topk);
    EXPECT_THROW(kernels::run_indexer_topk(p, nullptr, false), std::invalid_argument);
  }
  {
    kernels::CandidateMaskParams p;
    p.scores = fake_ptr<float>();
    p.score_stride = 1024;
    p.clen = fake_ptr<int32_t>();
    p.T = 1;
    p.mask = fake_ptr<uint8_t>();
    p.mask_stride = 127;  // < 1024 / 8
    EXPECT_THROW(kernels::run_candidate_mask(p, nullptr, false), std::invalid_argument);
    p.mask_stride = 128;
    p.block = 0;
    EXPECT_THROW(kernels::run_candidate_mask(p, nullptr, false), std::invalid_argument);
    p.block = 8;
    p.workspace = fake_ptr<uint8_t>();
    p.workspace_bytes = kernels::candidate_mask_workspace_bytes(p.T, p.score_stride, p.block, p.topk_blocks) - 1;
    EXPECT_THROW(kernels::run_candidate_mask(p, nullptr, false), std::invalid_argument);
    kernels::ApplyCandidateMaskParams a;
    a.scores = fake_ptr<float>();
    a.score_stride = 1024;
    a.clen = fake_ptr<int32_t>();
    a.T = 1;
    a.mask = fake_ptr<uint8_t>();
    a.mask_stride = 64;
    EXPECT_THROW(kernels::run_apply_candidate_mask(a, nullptr, false), std::invalid_argument);
  }
  {
    kernels::IndexerQPackParams p;
    p.qi = fake_ptr<bf16_t>();
    p.qi_stride = 4096 + 4;  // not a multiple of 8
    p.wproj_out = fake_ptr<bf16_t>();
    p.wproj_stride = 32;
    p.pos = fake_ptr<int32_t>();
    p.rope_table = fake_ptr<float>();
    p.max_pos = 10;
    p.T = 1;
    p.q_codes = fake_ptr<uint8_t>();
    p.q_scales = fake_ptr<uint8_t>();
    p.weights = fake_ptr<float>();
    EXPECT_THROW(kernels::run_indexer_q_pack(p, nullptr, false), std::invalid_argument);
    p.qi_stride = 4096;
    p.heads = 33;
    EXPECT_THROW(kernels::run_indexer_q_pack(p, nullptr, false), std::invalid_argument);
    p.heads = 32;
    p.heads_total = 16;
    EXPECT_THROW(kernels::run_indexer_q_pack(p, nullptr, false), std::invalid_argument);
  }
}

// The launch shapes the docs describe (docs/design.md, perf.md session 6), without a GPU.
TEST(GpuIndexerHostChecks, ScoresLaunchShapes) {
  const auto shape = [](int64_t T, int group_rows, int64_t stride, bool masked, int steps = 0, int tile = 0,
                        int row_split = 0, int min_blocks = 0) {
    auto p = valid_scores_params();
    p.T = T;
    p.group_rows = group_rows;
    p.score_stride = stride;
    p.steps_per_warp = steps;
    p.row_split = row_split;
    p.min_blocks = min_blocks;
    if (masked) {
      p.candidate_mask = fake_ptr<uint8_t>();
      p.mask_stride = stride / 8;
      p.mask_tile_blocks = tile;
    }
    return kernels::indexer_scores_shape(p);
  };
  // Automatic steps: the largest of 16 / 8 / 4 / 2 giving >= 1024 CTAs (>= 768 for one-row
  // groups), else 1.
  auto s = shape(6, 6, 65536, false);  // verify bs 1: one step per warp, 512 CTAs, one K buffer
  EXPECT_EQ(s.span_steps, 1);
  EXPECT_EQ(s.ring, 1);
  EXPECT_EQ(s.groups * s.tiles, 512);
  EXPECT_EQ(s.threads, 128);
  EXPECT_EQ(s.min_blocks, 3);
  EXPECT_EQ(shape(24, 6, 65536, false).span_steps, 2);  // verify bs 4: 2 at 64K, 1 at 32K
  EXPECT_EQ(shape(24, 6, 32768, false).span_steps, 1);
  s = shape(32, 1, 32768, false);  // decode bs 32: 8 at 32K, 16 at 64K
  EXPECT_EQ(s.span_steps, 8);
  EXPECT_EQ(s.ring, 2);
  EXPECT_EQ(s.tile_positions, 1024);
  EXPECT_EQ(s.groups * s.tiles, 1024);
  EXPECT_EQ(shape(32, 1, 65536, false).span_steps, 16);
  EXPECT_EQ(shape(6, 1, 65536, false).span_steps, 4);    // decode bs 6: 768 CTAs
  EXPECT_EQ(shape(6, 1, 32768, false).span_steps, 2);
  EXPECT_EQ(shape(8, 1, 65536, false).span_steps, 4);    // decode bs 8: 1024 CTAs (8 steps: 512)
  EXPECT_EQ(shape(24, 1, 65536, false).span_steps, 16);  // decode bs 24: 768 CTAs
  EXPECT_EQ(shape(1, 1, 65536, false).span_steps, 1);    // decode bs 1: 512 CTAs
  // Knobs: steps, row split (two warp sets, one CTA per SM), the 4-CTA register cap.
  s = shape(32, 1, 32768, false, 13);
  EXPECT_EQ(s.span_steps, 13);
  EXPECT_EQ(s.tiles, (32768 + 13 * 128 - 1) / (13 * 128));
  EXPECT_EQ(shape(6, 6, 65536, false, 0, 0, 2).threads, 256);
  EXPECT_EQ(shape(6, 6, 65536, false, 0, 0, 2).min_blocks, 1);
  EXPECT_EQ(shape(6, 6, 65536, false, 0, 0, 1, 4).min_blocks, 4);
  // Automatic register cap: 4 CTAs per SM from two multi-row groups on (session 17), else 3.
  EXPECT_EQ(shape(12, 6, 65536, false).min_blocks, 4);  // verify bs 2
  EXPECT_EQ(shape(24, 3, 65536, false).min_blocks, 4);  // verify bs 4 in 3-row groups
  EXPECT_EQ(shape(24, 3, 65536, false).span_steps, 4);  // 8 groups x 128 tiles
  EXPECT_EQ(shape(12, 6, 65536, false, 0, 0, 0, 3).min_blocks, 3);  // the knob
  EXPECT_EQ(shape(32, 1, 65536, false).min_blocks, 3);  // decode
  EXPECT_EQ(shape(3, 3, 65536, false).min_blocks, 3);   // one group
  // Masked: the largest of 256 / 128 / 64 / 32 blocks giving >= 1024 CTAs (>= 384 for one-row
  // groups), else 16.
  s = shape(6, 6, 65536, true);  // verify bs 1
  EXPECT_TRUE(s.masked);
  EXPECT_EQ(s.mask_tile_blocks, 16);
  EXPECT_EQ(s.ring, 1);
  EXPECT_EQ(s.min_blocks, 4);
  EXPECT_EQ(shape(6, 6, 65536, true, 0, 0, 0, 3).min_blocks, 3);       // the 16-block tile's knob
  EXPECT_EQ(shape(32, 1, 65536, true, 0, 256, 0, 4).min_blocks, 3);    // larger tiles: always 3
  EXPECT_EQ(shape(32, 1, 65536, true).mask_tile_blocks, 256);  // decode bs 32 (1024 CTAs)
  EXPECT_EQ(shape(64, 1, 65536, true).mask_tile_blocks, 256);
  EXPECT_EQ(shape(16, 1, 65536, true).mask_tile_blocks, 256);  // 512 CTAs
  EXPECT_EQ(shape(8, 1, 65536, true).mask_tile_blocks, 128);    // decode bs 8 (512 CTAs)
  EXPECT_EQ(shape(6, 1, 65536, true).mask_tile_blocks, 128);    // decode bs 6 (384 CTAs)
  EXPECT_EQ(shape(1, 1, 65536, true).mask_tile_blocks, 16);     // decode bs 1 (512 CTAs)
  EXPECT_EQ(shape(12, 6, 65536, true).mask_tile_blocks, 16);    // verify bs 2 (2 groups: 1024 CTAs)
  s = shape(32, 1, 65536, true, 0, 32);
  EXPECT_EQ(s.mask_tile_blocks, 32);
  EXPECT_EQ(s.tile_positions, 256);
  EXPECT_EQ(s.tiles, 256);
  // The masked kernel's per-warp block lists: 4 warps x 32 entries x 4 B more shared memory than
  // the unmasked kernel with the same K buffers.
  EXPECT_EQ(s.smem_bytes, shape(32, 1, 65536, false, 2).smem_bytes + 4 * 32 * 4);
}

// The v3 selection's automatic cluster sizes and the pair's one-launch rule, as the header states
// them (no GPU: these are the host rules the launchers apply; docs/perf.md session 7, run 10-11).
TEST(GpuIndexerHostChecks, SelectV3LaunchRules) {
  using kernels::select_v3_auto_cluster;
  using kernels::select_v3_pair_is_one_launch;
  constexpr int kSms = 132;  // H200
  // Top-k over 64K positions: 16 up to 12 rows (T * 16 <= 198), then 8 to 24 rows, 4 to 49, 2 to 99.
  EXPECT_EQ(select_v3_auto_cluster(1, 65536, false, kSms), 16);
  EXPECT_EQ(select_v3_auto_cluster(6, 65536, false, kSms), 16);  // verify bs 1
  EXPECT_EQ(select_v3_auto_cluster(8, 65536, false, kSms), 16);
  EXPECT_EQ(select_v3_auto_cluster(13, 65536, false, kSms), 8);
  EXPECT_EQ(select_v3_auto_cluster(24, 65536, false, kSms), 8);  // verify bs 4
  EXPECT_EQ(select_v3_auto_cluster(32, 65536, false, kSms), 4);  // decode bs 32 (session 7: 4 beat 8)
  EXPECT_EQ(select_v3_auto_cluster(48, 65536, false, kSms), 4);
  EXPECT_EQ(select_v3_auto_cluster(64, 65536, false, kSms), 2);
  // Short rows take only the CTAs their chunks need: 2048 positions per CTA (4096 above 16 rows).
  EXPECT_EQ(select_v3_auto_cluster(6, 4096, false, kSms), 2);
  EXPECT_EQ(select_v3_auto_cluster(6, 2048, false, kSms), 1);
  EXPECT_EQ(select_v3_auto_cluster(6, 32768, false, kSms), 16);
  EXPECT_EQ(select_v3_auto_cluster(32, 8192, false, kSms), 2);
  // The mask over 8192 blocks (64K positions): 512 blocks per CTA (1024 above 16 rows).
  EXPECT_EQ(select_v3_auto_cluster(6, 8192, true, kSms), 16);
  EXPECT_EQ(select_v3_auto_cluster(32, 8192, true, kSms), 4);
  EXPECT_EQ(select_v3_auto_cluster(6, 2048, true, kSms), 4);
  // The pair at 64K: one launch at 1..8 and 13..16 rows and at 25..33, else two.
  for (int64_t T : {1, 6, 8, 13, 16, 25, 32, 33}) EXPECT_TRUE(select_v3_pair_is_one_launch(T, 65536, kSms)) << T;
  for (int64_t T : {9, 12, 17, 24, 34}) EXPECT_FALSE(select_v3_pair_is_one_launch(T, 65536, kSms)) << T;
  // Another device size moves the bounds (e.g. 114 SMs, an H100 PCIe: 171 CTAs for one launch).
  EXPECT_EQ(select_v3_auto_cluster(12, 65536, false, 114), 8);
  EXPECT_FALSE(select_v3_pair_is_one_launch(8, 65536, 114));
  EXPECT_THROW(select_v3_auto_cluster(0, 65536, false, kSms), std::invalid_argument);
  EXPECT_THROW(select_v3_pair_is_one_launch(6, 65536, 0), std::invalid_argument);
  // Chunk tails: a resident chunk whose last round (4096 positions) would hold at most 512, in
  // clusters of at most 8 CTAs (the tail tests of test_indexer_select_v3.cu assert their rows with it).
  using kernels::select_v3_topk_takes_tail;
  EXPECT_TRUE(select_v3_topk_takes_tail(65537, 65544, 8));    // 8 chunks of 8200: 2 rounds + 8
  EXPECT_FALSE(select_v3_topk_takes_tail(65536, 65544, 8));   // a whole last round
  EXPECT_FALSE(select_v3_topk_takes_tail(65537, 65544, 16));  // 16-CTA launches have no tail code
  EXPECT_TRUE(select_v3_topk_takes_tail(36864, 73736, 8));    // last round 512: the largest tail
  EXPECT_FALSE(select_v3_topk_takes_tail(36865, 73736, 8));   // 520
  EXPECT_TRUE(select_v3_topk_takes_tail(4097, 73736, 1));
  EXPECT_FALSE(select_v3_topk_takes_tail(4096, 73736, 1));    // one round: nothing to end early
  EXPECT_FALSE(select_v3_topk_takes_tail(65537, 73736, 1));   // 17 rounds: not resident (6 fit)
  EXPECT_TRUE(select_v3_topk_takes_tail(32769, 73736, 4));
  EXPECT_THROW(select_v3_topk_takes_tail(65537, 65544, 0), std::invalid_argument);
  EXPECT_THROW(select_v3_topk_takes_tail(65537, 65544, 3), std::invalid_argument);
  EXPECT_THROW(select_v3_topk_takes_tail(0, 65544, 8), std::invalid_argument);
  EXPECT_THROW(select_v3_topk_takes_tail(65545, 65544, 8), std::invalid_argument);
}

TEST(GpuIndexerHostChecks, SelectionWorkspaceSizes) {
  using kernels::candidate_mask_workspace_bytes;
  using kernels::indexer_topk_workspace_bytes;
  // Monotone in every argument (a buffer sized for the largest launch serves the smaller ones).
  size_t prev = 0;
  for (int64_t T : {1, 6, 64, 512})
    for (int64_t stride : {64, 4096, 4160, 65536, 131072})
      for (int k : {0, 1, 512, 2048}) {
        const size_t b = indexer_topk_workspace_bytes(T, stride, k);
        EXPECT_GT(b, 0u);
        EXPECT_LE(indexer_topk_workspace_bytes(T, stride, k), indexer_topk_workspace_bytes(T + 1, stride, k));
        EXPECT_LE(b, indexer_topk_workspace_bytes(T, stride + 64, k));
        EXPECT_LE(b, indexer_topk_workspace_bytes(T, stride, k + 1));
        EXPECT_LE(candidate_mask_workspace_bytes(T, stride, 8, k), candidate_mask_workspace_bytes(T + 1, stride + 8, 8, k + 1));
        prev = b;
      }
  EXPECT_GT(prev, 0u);
  // A 64K-position verify row: 16 chunk lists of 512 entries (8 B each) plus the counters.
  EXPECT_GE(indexer_topk_workspace_bytes(6, 65536, 512), size_t{6} * 16 * 512 * 8);
  EXPECT_LT(indexer_topk_workspace_bytes(6, 65536, 512), size_t{1} << 20);
  // Beyond the rows v2 serves: 0 (the launchers run v1).
  EXPECT_EQ(indexer_topk_workspace_bytes(kernels::kSelectMaxRows + 1, 4096, 512), 0u);
  EXPECT_EQ(candidate_mask_workspace_bytes(kernels::kSelectMaxRows + 1, 4096, 8, 2048), 0u);
  EXPECT_THROW(indexer_topk_workspace_bytes(-1, 4096, 512), std::invalid_argument);
  EXPECT_THROW(candidate_mask_workspace_bytes(1, 4096, 0, 2048), std::invalid_argument);
}

TEST(GpuIndexerHostChecks, EmptyBatchLaunchesNothing) {
  auto p = valid_scores_params();
  p.T = 0;
  p.scores = nullptr;  // never touched for T = 0
  EXPECT_NO_THROW(kernels::run_indexer_scores(p, nullptr, false));
  auto q = valid_topk_params();
  q.T = 0;
  EXPECT_NO_THROW(kernels::run_indexer_topk(q, nullptr, false));
}

}  // namespace
