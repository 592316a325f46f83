// Whole-stack CPU reference (stack.h): a verify step end to end on the reduced config, decode vs
// verify equivalence of the caches and outputs, padded rows, determinism, prepare-only, the
// synthetic prefill (both paths) and refused input.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <vector>

#include "v4attn/config.h"
#include "v4attn/plan.h"
#include "v4attn/reference/stack.h"

namespace {

using namespace v4attn;
using namespace v4attn::ref;

constexpr int kRows = 6;  // reduced config: dspark_block_size 5 -> 6 verify rows

const ModelPlan& reduced_plan() {
  static const ModelPlan plan = build_plan(reduced_config(), 1);
  return plan;
}

StackOptions opts(int n_requests, int max_context, uint64_t seed = 11) {
  StackOptions o;
  o.n_requests = n_requests;
  o.max_context = max_context;
  o.seed = seed;
  return o;
}

bool all_finite(const std::vector<num::bf16_t>& v) {
  for (num::bf16_t b : v)
    if (!num::is_finite(num::f32_from_bf16(b))) return false;
  return true;
}
bool all_zero(const num::bf16_t* p, size_t n) {
  for (size_t i = 0; i < n; ++i)
    if (p[i] != 0) return false;
  return true;
}

// Every cache of a stack, compared byte for byte with another's.
void expect_same_caches(RefStack& a, RefStack& b, const char* what) {
  const ModelConfig& c = a.config();
  for (int l = 0; l < c.total_layers(); ++l)
    EXPECT_TRUE(a.window_cache(l) == b.window_cache(l)) << what << ": window cache of layer " << l;
  for (int s : c.kv_source_layers) {
    EXPECT_TRUE(a.comp_cache(s) == b.comp_cache(s)) << what << ": compressed cache of source " << s;
    EXPECT_TRUE(a.index_k_cache(s) == b.index_k_cache(s)) << what << ": index-K cache of source " << s;
    EXPECT_EQ(0, std::memcmp(a.pair_state(s).data(), b.pair_state(s).data(), a.pair_state(s).size() * sizeof(float)))
        << what << ": pair state of source " << s;
  }
}

TEST(RefStack, ReducedVerifyStepEndToEnd) {
  const ModelPlan& plan = reduced_plan();
  const int C = 4096;
  const auto t0 = std::chrono::steady_clock::now();
  RefStack st(plan, opts(1, C + kRows));
  const PrefillStats ps = synthetic_prefill(st, {C});
  EXPECT_EQ(ps.groups, C / 2 + C);  // source 2 (ratio 2) and source 6 (ratio 1)
  EXPECT_EQ(ps.window_rows, plan.config.total_layers() * plan.config.window_size);
  const StepResult res = st.run_step(make_verify_batch({C}, kRows));
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(ms, 5000.0) << "prefill + verify step on the reduced config took " << ms << " ms";

  ASSERT_EQ(res.layers.size(), static_cast<size_t>(plan.config.n_layers));
  const int64_t dim = plan.config.dim;
  for (const LayerRecord& rec : res.layers) {
    const LayerPlan& lp = plan.layers[static_cast<size_t>(rec.layer)];
    SCOPED_TRACE("layer " + std::to_string(rec.layer));
    EXPECT_EQ(rec.work, lp.work);
    EXPECT_TRUE(rec.attention);
    EXPECT_EQ(rec.skipped, 0);
    ASSERT_EQ(rec.output.size(), static_cast<size_t>(kRows * dim));
    EXPECT_TRUE(all_finite(rec.output));
    for (int t = 0; t < kRows; ++t) EXPECT_FALSE(all_zero(rec.output.data() + t * dim, dim)) << "row " << t;
    EXPECT_NE(rec.window_checksum, kFnvOffset);  // something was written
    if (lp.ratio == 0) {
      EXPECT_EQ(rec.topk_count, 0);
      continue;
    }
    // Top-k used: ascending compressed slots of positions < clen of each row.
    const std::vector<int32_t>& tk = st.topk(lp.idx_src);
    const std::vector<int32_t>& table = st.comp_slot_table(lp.ratio);
    int64_t count = 0;
    for (int t = 0; t < kRows; ++t) {
      const int32_t clen = res.meta.clen[lp.ratio][static_cast<size_t>(t)];
      const int32_t* row = tk.data() + t * st.topk_width();
      int k = 0;
      while (k < st.topk_width() && row[k] >= 0) ++k;
      for (int i = k; i < st.topk_width(); ++i) EXPECT_EQ(row[i], -1);
      const bool masked = plan.layers[static_cast<size_t>(lp.idx_src)].uses_candidates;
      if (masked) {
        EXPECT_GT(k, 0);
        EXPECT_LE(k, plan.config.candidate_topk_blocks * plan.config.candidate_block_size);
        // Every selected position lies in a block the candidate source kept for this row (the mask
        // excludes most of this context: 8 blocks of 8 of 4096 positions), so a masked layer whose
        // scores were not masked would select outside it.
        const uint8_t* mrow = st.candidate_mask().data() + t * st.candidate_mask_stride();
        int64_t kept_blocks = 0;
        for (int64_t b = 0; b < st.candidate_mask_stride(); ++b) kept_blocks += mrow[b] != 0;
        EXPECT_EQ(kept_blocks, std::min<int64_t>(plan.config.candidate_topk_blocks,
                                                 (clen + plan.config.candidate_block_size - 1) /
                                                     plan.config.candidate_block_size))
            << "row " << t;
        for (int i = 0; i < k; ++i)
          EXPECT_NE(mrow[(row[i] - table[0]) / plan.config.candidate_block_size], 0)
              << "row " << t << ": selected compressed position " << row[i] - table[0] << " is outside the mask";
      } else {
        EXPECT_EQ(k, std::min(plan.config.index_topk, clen)) << "row " << t;
      }
      for (int i = 0; i < k; ++i) {
        EXPECT_GE(row[i], table[0]);
        EXPECT_LT(row[i], table[0] + clen);  // one request: slots are contiguous from table[0]
        if (i > 0) {
          EXPECT_LT(row[i - 1], row[i]);
        }
      }
      count += k;
    }
    EXPECT_EQ(rec.topk_count, count);
    if (lp.is_kv_source) {
      EXPECT_EQ(rec.comp_checksum, fnv1a64(st.comp_cache(rec.layer).data(), st.comp_cache(rec.layer).size()));
      EXPECT_EQ(rec.index_k_checksum, fnv1a64(st.index_k_cache(rec.layer).data(), st.index_k_cache(rec.layer).size()));
    }
  }
}

// n decode steps (one row per request each) vs one verify block of n rows per request at the
// same positions: every cache byte, every output row and every top-k row agree.
void decode_vs_verify(const std::vector<int32_t>& ctx) {
  const ModelPlan& plan = reduced_plan();
  const int n_req = static_cast<int>(ctx.size());
  const int max_ctx = *std::max_element(ctx.begin(), ctx.end()) + kRows;
  RefStack dec(plan, opts(n_req, max_ctx)), ver(plan, opts(n_req, max_ctx));
  synthetic_prefill(dec, ctx);
  synthetic_prefill(ver, ctx);
  expect_same_caches(dec, ver, "after prefill");

  const StepResult vr = ver.run_step(make_verify_batch(ctx, kRows));
  const int64_t dim = plan.config.dim;
  const std::vector<int> index_sources = plan.config.index_source_layers;
  for (int i = 0; i < kRows; ++i) {
    std::vector<int32_t> pos(ctx);
    for (int32_t& p : pos) p += i;
    const StepResult dr = dec.run_step(make_decode_batch(pos));
    ASSERT_EQ(dr.layers.size(), vr.layers.size());
    for (size_t l = 0; l < dr.layers.size(); ++l)
      for (int q = 0; q < n_req; ++q) {
        const int vrow = q * kRows + i;
        EXPECT_EQ(0, std::memcmp(dr.layers[l].output.data() + q * dim, vr.layers[l].output.data() + vrow * dim,
                                 dim * sizeof(num::bf16_t)))
            << "layer " << l << ", request " << q << ", row " << i;
      }
    for (int s : index_sources)
      for (int q = 0; q < n_req; ++q)
        EXPECT_EQ(0, std::memcmp(dec.topk(s).data() + q * dec.topk_width(),
                                 ver.topk(s).data() + (q * kRows + i) * ver.topk_width(), ver.topk_width() * sizeof(int32_t)))
            << "top-k of index source " << s << ", request " << q << ", row " << i;
  }
  expect_same_caches(dec, ver, "after the steps");
}

TEST(RefStack, DecodeStepsEqualVerifyBlockOddContext) {
  decode_vs_verify({515});  // row 0 (odd position) pairs with the prefill's parked row
}
TEST(RefStack, DecodeStepsEqualVerifyBlockTwoRequests) {
  decode_vs_verify({300, 201});  // even and odd start, two requests' slots interleaved in a step
}

TEST(RefStack, PaddedRowsWriteNothingAndGiveZeros) {
  const ModelPlan& plan = reduced_plan();
  const std::vector<int32_t> ctx{301, 256};
  RefStack plain(plan, opts(2, 400)), padded(plan, opts(2, 400));
  synthetic_prefill(plain, ctx);
  synthetic_prefill(padded, ctx);
  const StepResult a = plain.run_step(make_verify_batch(ctx, kRows));
  const StepResult b = padded.run_step(make_verify_batch(ctx, kRows, 2 * kRows + 4));
  expect_same_caches(plain, padded, "verify with padded rows");
  const int64_t dim = plan.config.dim, live = 2 * kRows;
  ASSERT_EQ(b.meta.rows, live + 4);
  for (size_t l = 0; l < a.layers.size(); ++l) {
    EXPECT_EQ(0, std::memcmp(a.layers[l].output.data(), b.layers[l].output.data(), live * dim * sizeof(num::bf16_t)))
        << "layer " << l;
    EXPECT_TRUE(all_zero(b.layers[l].output.data() + live * dim, 4 * dim)) << "padded rows of layer " << l;
  }
  for (int s : plan.config.index_source_layers) {
    const std::vector<int32_t>& tk = padded.topk(s);
    for (int64_t i = live * padded.topk_width(); i < static_cast<int64_t>(tk.size()); ++i) ASSERT_EQ(tk[i], -1);
  }
  // The padded rows' x is not zero (so a padded row that stored anything would have shown).
  const std::vector<num::bf16_t> x = padded.synthetic_x(2, b.meta, b.step);
  EXPECT_FALSE(all_zero(x.data() + live * dim, 4 * dim));

  // Decode with padding too.
  const StepResult c = plain.run_step(make_decode_batch({307, 262}));
  const StepResult d = padded.run_step(make_decode_batch({307, 262}, 5));
  expect_same_caches(plain, padded, "decode with padded rows");
  for (size_t l = 0; l < c.layers.size(); ++l)
    EXPECT_TRUE(all_zero(d.layers[l].output.data() + 2 * dim, 3 * dim)) << "padded decode rows of layer " << l;
}

TEST(RefStack, DeterministicAndSeedSensitive) {
  const ModelPlan& plan = reduced_plan();
  const auto run = [&](uint64_t seed) {
    RefStack st(plan, opts(1, 700, seed));
    synthetic_prefill(st, {690});
    return st.run_step(make_verify_batch({690}, kRows));
  };
  const StepResult a = run(3), b = run(3), c = run(4);
  ASSERT_EQ(a.layers.size(), b.layers.size());
  for (size_t l = 0; l < a.layers.size(); ++l) {
    EXPECT_EQ(a.layers[l].out_checksum, b.layers[l].out_checksum) << "layer " << l;
    EXPECT_EQ(a.layers[l].q_checksum, b.layers[l].q_checksum) << "layer " << l;
    EXPECT_EQ(a.layers[l].window_checksum, b.layers[l].window_checksum) << "layer " << l;
    EXPECT_EQ(a.layers[l].comp_checksum, b.layers[l].comp_checksum) << "layer " << l;
    EXPECT_EQ(a.layers[l].index_k_checksum, b.layers[l].index_k_checksum) << "layer " << l;
    EXPECT_EQ(a.layers[l].topk_checksum, b.layers[l].topk_checksum) << "layer " << l;
    EXPECT_NE(a.layers[l].out_checksum, c.layers[l].out_checksum) << "layer " << l;
    EXPECT_NE(a.layers[l].q_checksum, c.layers[l].q_checksum) << "layer " << l;
  }
}

TEST(RefStack, PrepareOnlyMatchesTheFullStepsPrepare) {
  const ModelPlan& plan = reduced_plan();
  RefStack full(plan, opts(1, 600)), prep(plan, opts(1, 600));
  synthetic_prefill(full, {577});
  synthetic_prefill(prep, {577});
  const StepResult a = full.run_step(make_verify_batch({577}, kRows));
  StepOptions po;
  po.prepare_only = true;
  const StepResult b = prep.run_step(make_verify_batch({577}, kRows), po);
  expect_same_caches(full, prep, "prepare only");
  for (size_t l = 0; l < a.layers.size(); ++l) {
    EXPECT_FALSE(b.layers[l].attention);
    EXPECT_TRUE(b.layers[l].output.empty());
    EXPECT_EQ(b.layers[l].out_checksum, 0u);
    EXPECT_EQ(a.layers[l].q_checksum, b.layers[l].q_checksum);
    EXPECT_EQ(a.layers[l].topk_checksum, b.layers[l].topk_checksum);
  }
}

TEST(RefStack, LayerLimitAndDraftStages) {
  const ModelPlan& plan = reduced_plan();
  RefStack st(plan, opts(1, 300));
  synthetic_prefill(st, {200});
  StepOptions o;
  o.max_layers = 3;
  o.include_draft = true;
  const StepResult r = st.run_step(make_verify_batch({200}, kRows), o);
  ASSERT_EQ(r.layers.size(), 4u);
  EXPECT_EQ(r.layers[2].layer, 2);
  EXPECT_EQ(r.layers[3].layer, plan.config.n_layers);
  EXPECT_EQ(r.layers[3].mode, LayerMode::kDraft);
  EXPECT_EQ(r.layers[3].work, kWorkQA | kWorkQB | kWorkKV);
  EXPECT_TRUE(r.layers[3].attention);
  int called = 0;
  o.on_layer = [&](const LayerRecord&) { ++called; };
  st.run_step(make_verify_batch({206}, kRows), o);
  EXPECT_EQ(called, 4);
}

// Prefill: which slots are written, pair state parity, both paths' entries well-formed.
void check_prefill(PrefillPath path, int32_t C) {
  SCOPED_TRACE(std::string("path ") + to_string(path) + ", context " + std::to_string(C));
  const ModelPlan& plan = reduced_plan();
  const ModelConfig& cfg = plan.config;
  RefStack st(plan, opts(2, 1024));
  PrefillOptions po;
  po.path = path;
  const PrefillStats ps = synthetic_prefill(st, {C, 0}, po);
  EXPECT_EQ(ps.path, path);
  const RequestPool& pool = st.pool();
  // Window: the last `window` positions of request 0 have a scale byte != 0, other ring slots
  // and request 1 (context 0) are untouched.
  const CacheLayout wl = st.window_layout();
  for (int l = 0; l < cfg.total_layers(); ++l) {
    const std::vector<uint8_t>& w = st.window_cache(l);
    for (int q = 0; q < 2; ++q)
      for (int i = 0; i < pool.window_ring; ++i) {
        const int64_t loc = q * pool.window_ring + i;
        bool written = false;
        for (int p = std::max(0, (q == 0 ? C : 0) - cfg.window_size); p < (q == 0 ? C : 0); ++p)
          written = written || p % pool.window_ring == i;
        const uint8_t* sc = w.data() + wl.scale_offset(loc);
        bool nonzero = false;
        for (int b = 0; b < wl.scale_bytes; ++b) nonzero = nonzero || sc[b] != 0;
        ASSERT_EQ(nonzero, written) << "layer " << l << ", request " << q << ", ring slot " << i;
      }
  }
  for (int s : cfg.kv_source_layers) {
    const int r = plan.layers[static_cast<size_t>(s)].ratio;
    const CacheLayout cl = cache_layout(CacheKind::kCompressedFp4), il = cache_layout(CacheKind::kIndexK);
    const std::vector<int32_t>& table = st.comp_slot_table(r);
    for (int q = 0; q < 2; ++q)
      for (int64_t j = 0; j < st.comp_slot_stride(r); ++j) {
        const int64_t slot = table[static_cast<size_t>(q * st.comp_slot_stride(r) + j)];
        const bool written = q == 0 && j < C / r;
        const uint8_t* cs = st.comp_cache(s).data() + cl.scale_offset(slot);
        const uint8_t* is = st.index_k_cache(s).data() + il.scale_offset(slot);
        for (int b = 0; b < cl.scale_bytes; ++b) {
          // e4m3 scale: positive, finite (0x7f is NaN), or all zero when unwritten.
          if (written) ASSERT_TRUE(cs[b] > 0 && cs[b] < 0x7f) << "source " << s << " slot " << slot << " scale " << int(cs[b]);
          else ASSERT_EQ(cs[b], 0) << "source " << s << " slot " << slot;
        }
        for (int b = 0; b < il.scale_bytes; ++b) {
          if (written) ASSERT_TRUE(is[b] > 100 && is[b] < 140) << "index-K scale " << int(is[b]);
          else ASSERT_EQ(is[b], 0);
        }
      }
    if (r == 2) {
      const std::vector<float>& ps_rows = st.pair_state(s);
      for (int64_t row = 0; row < st.pair_state_rows(); ++row) {
        const bool parked = C % 2 == 1 && row == (C - 1) % pool.pair_ring;  // request 0's ring rows come first
        const float score0 = ps_rows[static_cast<size_t>(row * 1024 + 512)];
        EXPECT_EQ(std::isinf(score0) && score0 < 0, !parked) << "source " << s << ", state row " << row;
      }
    }
  }
}

TEST(RefStack, PrefillRealPath) {
  check_prefill(PrefillPath::kReal, 515);
  check_prefill(PrefillPath::kReal, 1000);
}
TEST(RefStack, PrefillFastPath) {
  check_prefill(PrefillPath::kFast, 515);
  check_prefill(PrefillPath::kFast, 1000);
}

TEST(RefStack, PrefillAutoPicksByGroupCount) {
  RefStack st(reduced_plan(), opts(1, 2100));
  PrefillOptions po;
  po.real_max_groups = 3000;
  EXPECT_EQ(synthetic_prefill(st, {1999}, po).path, PrefillPath::kReal);  // 999 + 1999 groups
  EXPECT_EQ(synthetic_prefill(st, {2001}, po).path, PrefillPath::kFast);  // 1000 + 2001 groups
}

// A fast prefill at 64K context then a decode step through the first kv/index source.
TEST(RefStack, Prefill64KFast) {
  const int C = 65536;
  RefStack st(reduced_plan(), opts(1, C + kRows));
  const auto t0 = std::chrono::steady_clock::now();
  const PrefillStats ps = synthetic_prefill(st, {C});
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_EQ(ps.path, PrefillPath::kFast);
  EXPECT_EQ(ps.groups, C / 2 + C);
  EXPECT_LT(ms, 3000.0);
  StepOptions o;
  o.max_layers = 3;
  const StepResult r = st.run_step(make_decode_batch({C}), o);
  EXPECT_EQ(r.layers[2].topk_count, reduced_plan().config.index_topk);
  EXPECT_TRUE(all_finite(r.layers[2].output));
  EXPECT_FALSE(all_zero(r.layers[2].output.data(), r.layers[2].output.size()));
}

TEST(RefStack, RefusesBadInput) {
  EXPECT_THROW(RefStack(build_plan(reduced_config(), 2), opts(1, 100)), std::invalid_argument);
  EXPECT_THROW(RefStack(reduced_plan(), opts(0, 100)), std::invalid_argument);
  EXPECT_THROW(RefStack(reduced_plan(), opts(1, 0)), std::invalid_argument);
  RefStack st(reduced_plan(), opts(2, 300));
  EXPECT_THROW(synthetic_prefill(st, {10}), std::invalid_argument);        // one context for two requests
  EXPECT_THROW(synthetic_prefill(st, {10, 301}), std::invalid_argument);   // past max_context
  synthetic_prefill(st, {290, 100});
  const std::vector<uint8_t> before = st.window_cache(0);
  EXPECT_THROW(st.run_step(make_verify_batch({296, 100}, kRows)), std::invalid_argument);  // 296+5 >= 300
  EXPECT_THROW(st.run_step(make_verify_batch({10, 100}, kRows + 1)), std::invalid_argument);  // 7 rows per request
  BatchDesc unknown = make_decode_batch({10});
  unknown.req[0] = 5;
  EXPECT_THROW(st.run_step(unknown), std::invalid_argument);
  StepOptions o;
  o.dump_layers = {99};
  EXPECT_THROW(st.run_step(make_decode_batch({10, 20}), o), std::invalid_argument);
  EXPECT_TRUE(before == st.window_cache(0));
  EXPECT_EQ(st.steps_run(), 0);
}

TEST(RefStack, FnvChecksum) {
  // FNV-1a 64 reference values: "" -> offset basis, "a" -> 0xaf63dc4c8601ec8c.
  EXPECT_EQ(fnv1a64("", 0), 0xcbf29ce484222325ull);
  EXPECT_EQ(fnv1a64("a", 1), 0xaf63dc4c8601ec8cull);
  EXPECT_EQ(fnv1a64("b", 1, fnv1a64("a", 1)), fnv1a64("ab", 2));
  EXPECT_EQ(checksum_hex(0xaf63dc4c8601ec8cull), "af63dc4c8601ec8c");
}

}  // namespace
