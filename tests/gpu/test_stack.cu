// Tests of the GPU prepare stack (include/v4attn/prepare/stack.h).
//
//  - GpuStackReference: the reduced config with the reference's synthetic weights, the v0 GEMMs
//    (byte-identical to the CPU GEMMs by construction) and the reference's caches (synthetic
//    prefill, real path) against ref::RefStack (prepare_only) over two consecutive steps of decode
//    and verify batches (with padded rows): per layer q_pad (vs an independent ref::q_chain, and
//    the reference's q checksum), every cache byte (window, compressed KV, index K, pair state),
//    the top-k of every index source and the candidate mask. Outputs are poisoned before each
//    step, so an unwritten element fails; padding heads and rows past the bucket must keep the
//    poison.
//  - GpuStackSchedules: tensor-core GEMMs, device-random weights and prefill; the three
//    schedules x {eager, graph} x {PDL on, off} give byte-identical outputs and caches over two
//    steps (state carried, the second step replays the graph captured for the first with new
//    positions and inputs).
//  - GpuStackFull: the real V4.1-Flash config (tp 1 and tp 4), device-random weights and prefill:
//    schedules and execution modes agree, top-k sizes are what the clen says, no kernel skipped
//    anything.
//  - GpuStack: device prefill layout, refusals of bad steps and options.
//  - GpuStackHost (no GPU needed): option validation, the CUPTI role classifier.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <iterator>
#include <string>
#include <vector>

#include "gpu_test_util.h"
#include "v4attn/config.h"
#include "v4attn/kernels/qchain.h"
#include "v4attn/plan.h"
#include "v4attn/prepare/stack.h"
#include "v4attn/reference/layer.h"
#include "v4attn/reference/stack.h"
#include "v4attn/reference/step.h"

namespace v4attn {
namespace {

using num::bf16_t;
using prepare::CacheState;
using prepare::GpuPrepareStack;
using prepare::GpuStackOptions;
using prepare::WeightSource;
using prepare::Fusion;

constexpr uint8_t kPoison = 0xAB;
constexpr bf16_t kPoisonBf16 = 0xABAB;
constexpr int32_t kPoisonI32 = static_cast<int32_t>(0xABABABABu);

// Index of the first differing element, -1 when equal (sizes must match: -2 when they differ).
template <class T>
int64_t first_diff(const std::vector<T>& a, const std::vector<T>& b) {
  if (a.size() != b.size()) return -2;
  for (size_t i = 0; i < a.size(); ++i)
    if (std::memcmp(&a[i], &b[i], sizeof(T)) != 0) return static_cast<int64_t>(i);
  return -1;
}

std::vector<int32_t> contexts(int bs) {
  // Odd and even contexts: ratio-2 rows at odd positions read the pair state (prefill parked the
  // even partner), others pair inside the batch.
  static const int32_t base[] = {301, 290, 333, 257, 300, 311, 275, 288, 263, 318};
  std::vector<int32_t> c;
  for (int q = 0; q < bs; ++q) c.push_back(base[q % 10] + 13 * (q / 10));
  return c;
}

BatchDesc make_batch(StepKind kind, const std::vector<int32_t>& pos0, int v, int pad_to) {
  return kind == StepKind::kDecode ? make_decode_batch(pos0, pad_to) : make_verify_batch(pos0, v, pad_to);
}

std::vector<int32_t> advanced(const std::vector<int32_t>& ctx, int by) {
  std::vector<int32_t> p = ctx;
  for (int32_t& x : p) x += by;
  return p;
}

// Everything a cycle writes: q_pad of every layer, top-k of every index source, candidate mask,
// the caches.
struct Snapshot {
  std::vector<std::vector<bf16_t>> q_pad;
  std::vector<std::vector<int32_t>> topk;  // by layer id (empty: not an index source)
  std::vector<uint8_t> mask;
  CacheState caches;
};

Snapshot take_snapshot(GpuPrepareStack& s) {
  Snapshot snap;
  for (int L = 0; L < s.n_layers(); ++L) snap.q_pad.push_back(s.q_pad(L));
  snap.topk.resize(static_cast<size_t>(s.n_layers()));
  for (int L : s.plan().config.index_source_layers) snap.topk[static_cast<size_t>(L)] = s.topk(L);
  snap.mask = s.candidate_mask();
  snap.caches = s.download_caches();
  return snap;
}

// live_rows >= 0: compare q_pad and top-k of the first live_rows rows only (the padded rows' inputs
// depend on the stack's step counter).
void expect_same(const Snapshot& want, const Snapshot& got, const GpuPrepareStack& s, int live_rows, const std::string& what) {
  const size_t q_row = static_cast<size_t>(s.h_pad()) * 512;
  const size_t k_row = static_cast<size_t>(s.topk_width());
  const auto prefix = [&](auto v, size_t row) {
    if (live_rows >= 0) v.resize(std::min(v.size(), row * static_cast<size_t>(live_rows)));
    return v;
  };
  for (size_t L = 0; L < want.q_pad.size(); ++L)
    EXPECT_EQ(first_diff(prefix(want.q_pad[L], q_row), prefix(got.q_pad[L], q_row)), -1) << what << ": q_pad of layer " << L;
  for (size_t L = 0; L < want.topk.size(); ++L)
    EXPECT_EQ(first_diff(prefix(want.topk[L], k_row), prefix(got.topk[L], k_row)), -1) << what << ": top-k of layer " << L;
  if (live_rows < 0) EXPECT_EQ(first_diff(want.mask, got.mask), -1) << what << ": candidate mask";
  for (size_t L = 0; L < want.caches.window.size(); ++L)
    EXPECT_EQ(first_diff(want.caches.window[L], got.caches.window[L]), -1) << what << ": window cache of layer " << L;
  for (size_t L = 0; L < want.caches.comp.size(); ++L) {
    EXPECT_EQ(first_diff(want.caches.comp[L], got.caches.comp[L]), -1) << what << ": compressed cache of " << L;
    EXPECT_EQ(first_diff(want.caches.index_k[L], got.caches.index_k[L]), -1) << what << ": index-K cache of " << L;
    EXPECT_EQ(first_diff(want.caches.pair_state[L], got.caches.pair_state[L]), -1) << what << ": pair state of " << L;
  }
}

// ================================ host-only (no GPU) ===================================================

// The automatic rows per indexer-scores CTA (stack.h; docs/perf.md session 17).
TEST(GpuStackHost, ScoresGroupRowsFollowTheRequestCount) {
  EXPECT_EQ(prepare::scores_auto_group_rows(false, 32, 6), 1);  // decode: one row per CTA
  EXPECT_EQ(prepare::scores_auto_group_rows(true, 6, 6), 6);    // verify bs 1: the request's rows
  EXPECT_EQ(prepare::scores_auto_group_rows(true, 12, 6), 6);   // bs 2
  EXPECT_EQ(prepare::scores_auto_group_rows(true, 18, 6), 6);   // bs 3
  EXPECT_EQ(prepare::scores_auto_group_rows(true, 24, 6), 3);   // bs 4: half a request
  EXPECT_EQ(prepare::scores_auto_group_rows(true, 48, 6), 3);   // bs 8
  EXPECT_EQ(prepare::scores_auto_group_rows(true, 20, 5), 3);   // odd rows per request: rounded up
  EXPECT_EQ(prepare::scores_auto_group_rows(true, 24, 12), 8);  // clamped to the kernel's 8 rows per CTA
  EXPECT_EQ(prepare::scores_auto_group_rows(true, 0, 6), 6);    // no rows: no launch either way
  static_assert(prepare::kScoresHalfGroupRequests == 4, "the cases above assume the measured threshold");
}

TEST(GpuStackHost, ValidateOptionsRefusesWhatTheStackCannotRun) {
  const ModelPlan plan = build_plan(reduced_config(), 1);
  GpuStackOptions ok;
  ok.max_context = 64;
  EXPECT_NO_THROW(prepare::validate_options(plan, ok));
  const auto refused = [&](const std::function<void(GpuStackOptions&)>& edit, const char* needle) {
    GpuStackOptions o = ok;
    edit(o);
    try {
      prepare::validate_options(plan, o);
      ADD_FAILURE() << "accepted; expected a refusal mentioning \"" << needle << "\"";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  refused([](GpuStackOptions& o) { o.n_requests = 0; }, "n_requests");
  refused([](GpuStackOptions& o) { o.max_context = 1; }, "max_context");
  refused([](GpuStackOptions& o) { o.rows_per_request = -1; }, "rows_per_request");
  refused([](GpuStackOptions& o) { o.max_rows = 0; }, "max_rows");
  refused([](GpuStackOptions& o) { o.max_rows = 65; }, "max_rows");
  refused([](GpuStackOptions& o) { o.decode_buckets = {1, 0}; }, "decode bucket 0");
  refused([](GpuStackOptions& o) { o.verify_buckets = {6, 65}; }, "verify bucket 65");
  refused([](GpuStackOptions& o) { o.scores_group_rows = 9; }, "scores_group_rows");
  refused([](GpuStackOptions& o) { o.scores_steps = 65; }, "scores_steps");
  refused([](GpuStackOptions& o) { o.select_version = 1; }, "select_version");
  refused([](GpuStackOptions& o) { o.qb_prewait_stages = -2; }, "qb_prewait_stages");
  refused([](GpuStackOptions& o) { o.qb_side_mtiles = 3; }, "qb_side_mtiles");
  refused([](GpuStackOptions& o) { o.qb_overlap = 3; }, "qb_overlap");
  refused([](GpuStackOptions& o) { o.qb_prewait_pace_ns = -2; }, "qb_prewait_pace_ns");
  refused([](GpuStackOptions& o) { o.aq_warps = 33; }, "aq_warps");
  refused([](GpuStackOptions& o) { o.v3_int_mask = 16; }, "v3_int_mask");
  refused([](GpuStackOptions& o) { o.v3_int_mask = -2; }, "v3_int_mask");
  refused([](GpuStackOptions& o) { o.scores_mask_tile = 48; }, "scores_mask_tile");
  refused(
      [](GpuStackOptions& o) {
        o.idx_scores_on_main = true;
        o.idx_gemm_on_main = false;
      },
      "idx_scores_on_main");
  refused(
      [](GpuStackOptions& o) {
        o.idx_gemm_on_main = true;
        o.s_fork = LayerIssue::SFork::kIdxGemmsOnK;
      },
      "idx_gemm_on_main");
  const ModelPlan tp2 = build_plan(reduced_config(), 2);
  GpuStackOptions ref_tp2 = ok;
  ref_tp2.weights = WeightSource::kReference;
  EXPECT_THROW(prepare::validate_options(tp2, ref_tp2), std::invalid_argument);
  ref_tp2.weights = WeightSource::kDeviceRandom;
  EXPECT_NO_THROW(prepare::validate_options(tp2, ref_tp2));  // device weights: any tp
  ModelConfig many_heads = reduced_config();
  many_heads.index_n_heads = 64;
  EXPECT_THROW(prepare::validate_options(build_plan(many_heads, 1), ok), std::invalid_argument);
}

TraceRecord kernel(const char* name, uint32_t stream, uint64_t start, uint64_t end, uint32_t corr = 1) {
  TraceRecord r;
  r.kind = TraceKind::kKernel;
  r.name = name;
  r.stream_id = stream;
  r.start_ns = start;
  r.end_ns = end;
  r.correlation_id = corr;
  r.graph_node_id = start;  // distinct per record
  return r;
}

TEST(GpuStackHost, ClassifierFindsTheWqbGemmByStreamOrder) {
  const char* fp8 = "v4attn::kernels::detail::(anonymous namespace)::gemm_tc_kernel<true, 1, 1>(v4attn::kernels::detail::TcParams)";
  const char* bf16 = "v4attn::kernels::detail::(anonymous namespace)::gemm_tc_kernel<false, 1, 1>(v4attn::kernels::detail::TcParams)";
  const char* qrope = "v4attn::kernels::(anonymous namespace)::q_rope_store_kernel(v4attn::kernels::QRopeStoreParams)";
  const char* wk = "v4attn::kernels::(anonymous namespace)::window_k_store_kernel(v4attn::kernels::WindowKStoreParams)";
  const char* norm = "v4attn::kernels::(anonymous namespace)::rmsnorm_kernel(v4attn::kernels::RmsNormParams)";
  // Two layers on main (7): act quant, wqkv_a GEMM, q_norm, wq_b GEMM, q_rope_store (PDL: starts
  // before the GEMM ends in layer 1), then the indexer's fp8 GEMM (serial-like). Window-K on 9;
  // an fp8 GEMM on the side stream 8 started between (must not count).
  std::vector<TraceRecord> recs = {
      kernel("act_quant_fp8_kernel", 7, 100, 110),  kernel(fp8, 7, 110, 200),   kernel(norm, 7, 200, 210),
      kernel(fp8, 7, 210, 300),                     kernel(qrope, 7, 305, 320),  kernel(fp8, 8, 301, 330),
      kernel(wk, 9, 230, 240),                      kernel(fp8, 7, 320, 360),    kernel(bf16, 7, 360, 370),
      kernel("act_quant_fp8_kernel", 7, 400, 410),  kernel(fp8, 7, 410, 500),   kernel(norm, 7, 500, 510),
      kernel(fp8, 7, 510, 600),                     kernel(qrope, 7, 590, 610),  kernel(wk, 9, 530, 540),
  };
  const KernelClassifier classify = prepare::make_stack_classifier(recs);
  EXPECT_EQ(classify(recs[3]), KernelRole::kWqbGemm);
  EXPECT_EQ(classify(recs[12]), KernelRole::kWqbGemm);
  for (size_t i : {1u, 5u, 7u, 10u}) EXPECT_EQ(classify(recs[i]), KernelRole::kOther) << i;
  EXPECT_EQ(classify(recs[4]), KernelRole::kQRopeStore);
  EXPECT_EQ(classify(recs[6]), KernelRole::kWindowKWrite);
  const CycleStats st = analyze_cycle(recs, classify);
  EXPECT_EQ(st.q_rope_count, 2);
  EXPECT_EQ(st.wqb_gemm_count, 2);
  EXPECT_EQ(st.window_k_count, 2);
  EXPECT_EQ(st.gap_samples, 2);
  EXPECT_EQ(st.early_launches, 1);  // layer 1: q_rope_store at 590, its GEMM ended at 600
  EXPECT_EQ(st.window_k_on_q_rope_lane, 0);
  EXPECT_EQ(st.distinct_streams, 3);

  // A q_rope_store whose GEMM ran on another stream gets no wq_b GEMM (no false match across layers).
  std::vector<TraceRecord> split = {kernel(fp8, 7, 0, 10), kernel(qrope, 7, 20, 30), kernel(fp8, 8, 40, 50),
                                    kernel(qrope, 7, 60, 70)};
  const KernelClassifier c2 = prepare::make_stack_classifier(split);
  EXPECT_EQ(c2(split[0]), KernelRole::kWqbGemm);
  EXPECT_EQ(c2(split[2]), KernelRole::kOther);

  // The wgmma GEMM (v2, the stack's default) is recognised too (the gap column read "-" on the
  // H200 before this: run 8).
  const char* wgmma = "v4attn::kernels::(anonymous namespace)::gemm_fp8_wgmma_kernel<2, 8>(v4attn::kernels::detail::WgmmaParams)";
  std::vector<TraceRecord> v2 = {kernel(wgmma, 7, 0, 10), kernel(qrope, 7, 9, 30)};
  const KernelClassifier c3 = prepare::make_stack_classifier(v2);
  EXPECT_EQ(c3(v2[0]), KernelRole::kWqbGemm);
  EXPECT_EQ(analyze_cycle(v2, c3).early_launches, 1);

  // The fused Q chain (one kernel per plain layer) takes q_rope_store's role; the fp8 GEMM of an
  // unfused layer before it is still found by stream order.
  const char* qchain = "void v4attn::kernels::(anonymous namespace)::qchain_fused_kernel<8>(v4attn::kernels::(anonymous namespace)::QcParams)";
  std::vector<TraceRecord> fused = {kernel(qchain, 7, 0, 25), kernel(qchain, 7, 26, 50), kernel(fp8, 7, 50, 60),
                                    kernel(qrope, 7, 61, 70)};
  const KernelClassifier c4 = prepare::make_stack_classifier(fused);
  EXPECT_EQ(c4(fused[0]), KernelRole::kQRopeStore);
  EXPECT_EQ(c4(fused[1]), KernelRole::kQRopeStore);
  EXPECT_EQ(c4(fused[2]), KernelRole::kWqbGemm);
  EXPECT_EQ(analyze_cycle(fused, c4).q_rope_count, 3);
}

// ================================ against the CPU reference ============================================

struct RefCase {
  const char* name;
  StepKind kind;
  int bs;
  std::vector<int> buckets;  // of `kind`
  int expect_bucket;         // bucket of the batch (padded rows = bucket - bs * v)
  Schedule schedule;
  bool graph;
  bool pdl;
};

class GpuStackReference : public ::testing::TestWithParam<RefCase> {};

TEST_P(GpuStackReference, MatchesRefStackOverTwoSteps) {
  V4_REQUIRE_GPU();
  const RefCase& tc = GetParam();
  const ModelPlan plan = build_plan(reduced_config(), 1);
  const ModelConfig& cfg = plan.config;
  const int v = tc.kind == StepKind::kVerify ? cfg.verify_rows_per_request() : 1;
  const std::vector<int32_t> ctx = contexts(tc.bs);
  const int max_context = *std::max_element(ctx.begin(), ctx.end()) + 2 * v + 2;
  constexpr uint64_t kSeed = 7;

  ref::StackOptions so;
  so.n_requests = tc.bs;
  so.max_context = max_context;
  so.seed = kSeed;
  ref::RefStack ref(plan, so);
  ref::PrefillOptions po;
  po.path = ref::PrefillPath::kReal;
  ref::synthetic_prefill(ref, ctx, po);

  GpuStackOptions go;
  go.n_requests = tc.bs;
  go.max_context = max_context;
  go.max_rows = 32;
  (tc.kind == StepKind::kDecode ? go.decode_buckets : go.verify_buckets) = tc.buckets;
  go.schedule = tc.schedule;
  go.pdl = tc.pdl;
  go.gemm = kernels::GemmVersion::kSimple;  // byte-identical to the reference GEMMs
  go.weights = WeightSource::kReference;
  go.seed = kSeed;
  GpuPrepareStack gpu(plan, go);
  gpu.load_reference_caches(ref);
  ASSERT_EQ(gpu.local_heads(), cfg.n_heads);
  ASSERT_EQ(gpu.h_pad(), 8);  // 4 heads padded to 8: the padding heads must never be written

  const int H = gpu.local_heads(), HP = gpu.h_pad(), R = go.max_rows;
  for (int step = 0; step < 2; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    const std::vector<int32_t> pos0 = advanced(ctx, step * v);
    const int rows = tc.bs * v;
    const int bucket = gpu.bucket_for(tc.kind, rows);
    ASSERT_EQ(bucket, tc.expect_bucket);
    const BatchDesc batch = make_batch(tc.kind, pos0, v, bucket);
    const int64_t ref_step = ref.steps_run();
    gpu.poison_outputs(kPoison);
    gpu.reset_error_count();
    // The un-padded batch: the stack pads it to the same bucket, with the same padded rows.
    const prepare::StepInfo info = gpu.set_step(tc.kind, make_batch(tc.kind, pos0, v, 0),
                                                [&](int L, const StepMeta& m) { return ref.synthetic_x(L, m, ref_step); });
    ASSERT_EQ(info.bucket, bucket);
    ASSERT_EQ(info.rows, rows);
    gpu.run(tc.graph);
    gpu.synchronize();

    ref::StepOptions opt;
    opt.prepare_only = true;
    const ref::StepResult res = ref.run_step(batch, opt);
    ASSERT_EQ(res.meta.rows, bucket);
    ASSERT_EQ(res.meta.pos, gpu.step_meta().pos);
    ASSERT_EQ(res.meta.req, gpu.step_meta().req);
    EXPECT_EQ(gpu.error_count(), 0u);

    // Q per layer: an independent q_chain on the same weights and inputs.
    const StepMeta& meta = res.meta;
    for (int L = 0; L < cfg.n_layers; ++L) {
      SCOPED_TRACE("layer " + std::to_string(L));
      const int r = plan.layers[static_cast<size_t>(L)].ratio;
      const std::vector<bf16_t> x = ref.synthetic_x(L, meta, ref_step);
      const ref::QChainOut qc = ref::q_chain(ref.weights(L), x.data(), bucket, meta.pos.data(), ref.rope_table(r).data(),
                                             ref.max_pos(), H, H, cfg.norm_eps);
      const std::vector<bf16_t> got = gpu.q_pad(L);
      ASSERT_EQ(got.size(), static_cast<size_t>(R) * HP * 512);
      int64_t bad = 0, unpoisoned = 0;
      std::vector<bf16_t> live;
      for (int t = 0; t < R; ++t)
        for (int h = 0; h < HP; ++h)
          for (int d = 0; d < 512; ++d) {
            const bf16_t g = got[(static_cast<size_t>(t) * HP + h) * 512 + d];
            if (t < bucket && h < H) {
              live.push_back(g);
              if (g != qc.q_pad[(static_cast<size_t>(t) * H + h) * 512 + d]) ++bad;
            } else if (g != kPoisonBf16) {
              ++unpoisoned;
            }
          }
      EXPECT_EQ(bad, 0) << "q_pad elements differing from ref::q_chain";
      EXPECT_EQ(unpoisoned, 0) << "padding heads / rows past the bucket were written";
      EXPECT_EQ(ref::fnv1a64(live.data(), live.size() * sizeof(bf16_t)), res.layers[static_cast<size_t>(L)].q_checksum);
      EXPECT_EQ(res.layers[static_cast<size_t>(L)].skipped, 0);
    }

    // Every cache byte.
    const CacheState st = gpu.download_caches();
    for (int L = 0; L < cfg.n_layers; ++L)
      EXPECT_EQ(first_diff(st.window[static_cast<size_t>(L)], ref.window_cache(L)), -1) << "window cache of layer " << L;
    for (int s : cfg.kv_source_layers) {
      EXPECT_EQ(first_diff(st.comp[static_cast<size_t>(s)], ref.comp_cache(s)), -1) << "compressed cache of " << s;
      EXPECT_EQ(first_diff(st.index_k[static_cast<size_t>(s)], ref.index_k_cache(s)), -1) << "index-K cache of " << s;
      EXPECT_EQ(first_diff(st.pair_state[static_cast<size_t>(s)], ref.pair_state(s)), -1) << "pair state of " << s;
    }

    // Top-k of every index source; rows past the bucket keep the poison.
    const int64_t width = gpu.topk_width();
    ASSERT_EQ(width, ref.topk_width());
    for (int s : cfg.index_source_layers) {
      const std::vector<int32_t> got = gpu.topk(s);
      const std::vector<int32_t>& want = ref.topk(s);
      ASSERT_EQ(want.size(), static_cast<size_t>(bucket * width));
      EXPECT_EQ(first_diff(std::vector<int32_t>(got.begin(), got.begin() + bucket * width), want), -1) << "top-k of " << s;
      EXPECT_TRUE(std::all_of(got.begin() + bucket * width, got.end(), [](int32_t v) { return v == kPoisonI32; }))
          << "top-k rows past the bucket written, layer " << s;
      int64_t valid = 0;
      for (int32_t v2 : want) valid += v2 >= 0;
      EXPECT_GT(valid, 0) << "layer " << s << " selected nothing: the comparison would be vacuous";
    }

    // Candidate mask: the reference's row width is ceil(max clen / block); the GPU's is static and
    // zero past the blocks the row has.
    const std::vector<uint8_t> mask = gpu.candidate_mask();
    const std::vector<uint8_t>& want_mask = ref.candidate_mask();
    const int64_t ms = gpu.candidate_mask_stride(), rs = ref.candidate_mask_stride();
    ASSERT_GE(ms, rs);
    int64_t mask_bad = 0, kept = 0;
    for (int t = 0; t < R; ++t)
      for (int64_t b = 0; b < ms; ++b) {
        const uint8_t g = mask[static_cast<size_t>(t * ms + b)];
        if (t >= bucket) {
          mask_bad += g != kPoison;
        } else if (b < rs) {
          mask_bad += g != want_mask[static_cast<size_t>(t * rs + b)];
          kept += g == 1;
        } else {
          mask_bad += g != 0;
        }
      }
    EXPECT_EQ(mask_bad, 0) << "candidate mask bytes";
    EXPECT_GT(kept, 0);
  }
  EXPECT_EQ(gpu.graphs().captures(), tc.graph ? 1u : 0u) << "the second step must replay the first step's graph";
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, GpuStackReference,
    ::testing::Values(RefCase{"decode_bs1_serial_eager", StepKind::kDecode, 1, {1, 8}, 1, Schedule::kSerial, false, false},
                      RefCase{"decode_bs8_three_lane_graph", StepKind::kDecode, 8, {1, 8}, 8, Schedule::kThreeLane, true, true},
                      RefCase{"verify_bs1_padded_sources_side_graph", StepKind::kVerify, 1, {8, 32}, 8,
                              Schedule::kSourcesSide, true, false},
                      RefCase{"verify_bs4_padded_three_lane_graph", StepKind::kVerify, 4, {8, 32}, 32, Schedule::kThreeLane,
                              true, true},
                      RefCase{"verify_bs4_exact_three_lane_eager", StepKind::kVerify, 4, {24}, 24, Schedule::kThreeLane,
                              false, true}),
    [](const ::testing::TestParamInfo<RefCase>& i) { return std::string(i.param.name); });

// ================================ schedules x execution x PDL ==========================================

struct ShapeCase {
  const char* name;
  StepKind kind;
  int bs;
  std::vector<int> buckets;
};

class GpuStackSchedules : public ::testing::TestWithParam<ShapeCase> {};

TEST_P(GpuStackSchedules, AllSchedulesGraphsAndPdlGiveIdenticalBytes) {
  V4_REQUIRE_GPU();
  const ShapeCase& sc = GetParam();
  const ModelPlan plan = build_plan(reduced_config(), 1);
  const int v = sc.kind == StepKind::kVerify ? plan.config.verify_rows_per_request() : 1;
  const std::vector<int32_t> ctx = contexts(sc.bs);
  GpuStackOptions go;
  go.n_requests = sc.bs;
  go.max_context = *std::max_element(ctx.begin(), ctx.end()) + 2 * v + 2;
  go.max_rows = 32;
  (sc.kind == StepKind::kDecode ? go.decode_buckets : go.verify_buckets) = sc.buckets;
  go.weights = WeightSource::kDeviceRandom;
  go.gemm = kernels::GemmVersion::kTensorCore;
  go.seed = 11;

  struct Config {
    Schedule schedule;
    bool graph;
    bool pdl;
    LayerIssue::SFork s_fork = LayerIssue::SFork::kAtLayerStart;
    bool lane_prologue = false;
    bool pdl_everywhere = false;
    bool idx_gemm_on_main = false;
    int select_version = 3;
    int select_cluster = 0;
    int scores_group_rows = 0;
    int scores_steps = 0;
    int scores_row_split = 0;
    int scores_min_blocks = 0;
    int side_priority = 0;
    bool qnorm_trigger_late = false;
    bool idx_scores_on_main = false;
    int qb_prewait_stages = -1;
    int qb_overlap = -1;
    int qb_prewait_pace_ns = -1;
    int aq_warps = -1;
    bool scores_masked = true;
    int scores_mask_tile = 0;
    bool select_pair = true;
    bool idx_x_on_k = true;  // the stack's default
    bool select_window = false;
  };
  using SF = LayerIssue::SFork;
  std::vector<Config> configs;
  for (Schedule sched : kAllSchedules)
    for (bool graph : {false, true})
      for (bool pdl : {false, true}) configs.push_back({sched, graph, pdl});
  // The lanes' experiment knobs must not change bytes either.
  configs.push_back({.schedule = Schedule::kThreeLane, .graph = true, .pdl = true, .s_fork = SF::kAfterQNorm});
  configs.push_back({.schedule = Schedule::kThreeLane, .graph = true, .pdl = true, .s_fork = SF::kIdxOnKWithoutCmp});
  configs.push_back({.schedule = Schedule::kThreeLane, .graph = true, .pdl = true, .lane_prologue = true});
  configs.push_back({.schedule = Schedule::kSourcesSide, .graph = false, .pdl = true, .lane_prologue = true});
  // The indexer's GEMMs on lane K (cross-lane event to S), eager and in graph, and on a schedule
  // without lane K (where they run right before the rest of IDX).
  configs.push_back({.schedule = Schedule::kThreeLane, .graph = true, .pdl = true, .s_fork = SF::kIdxGemmsOnK});
  configs.push_back({.schedule = Schedule::kThreeLane, .graph = false, .pdl = true, .s_fork = SF::kIdxGemmsOnK});
  configs.push_back({.schedule = Schedule::kSourcesSide, .graph = true, .pdl = true, .s_fork = SF::kIdxGemmsOnK});
  // PDL on every kernel of the cycle, eager and in graphs, on every schedule.
  for (Schedule sched : kAllSchedules)
    for (bool graph : {false, true}) configs.push_back({.schedule = sched, .graph = graph, .pdl = true, .pdl_everywhere = true});
  // Session-2 knobs, each against the first configuration: the indexer's GEMM on main (eager, graph,
  // serial), the v2 selection kernels, a fixed v3 cluster size, other scores launch shapes, high-
  // priority side lanes, the late q_norm trigger, q pack + scores on main in the reindex layers.
  // (Not the GEMM versions: another GEMM version may move rare outputs by the GEMM contract's ulp,
  // e.g. v5's fp32 compressor GEMM changes pair-state bytes; those are tested per GEMM against the
  // reference.) `with`: a three-lane graph cycle with PDL everywhere unless given.
  const auto with = [&](const std::function<void(Config&)>& edit, Schedule sched = Schedule::kThreeLane, bool graph = true) {
    Config c{.schedule = sched, .graph = graph, .pdl = true, .pdl_everywhere = true};
    edit(c);
    configs.push_back(c);
  };
  with([](Config& c) { c.idx_gemm_on_main = true; });
  with([](Config& c) { c.idx_gemm_on_main = true; }, Schedule::kThreeLane, false);
  with([](Config& c) { c.idx_gemm_on_main = true; }, Schedule::kSerial);
  with([](Config& c) { c.select_version = 2; });
  with([](Config& c) { c.select_cluster = 4; });
  with([](Config& c) { c.scores_group_rows = 2, c.scores_steps = 1; });
  with([](Config& c) { c.scores_group_rows = 1, c.scores_steps = 4, c.side_priority = -5; });
  with([](Config& c) { c.scores_steps = 16; });  // session 6: a 2048-position tile streamed through the ring
  with([](Config& c) { c.scores_row_split = 1; });
  with([](Config& c) { c.scores_min_blocks = 4; });
  with([](Config& c) { c.idx_gemm_on_main = true, c.qnorm_trigger_late = true; });
  // Session 3: the wq_b GEMM's pre-wait weight stages and its consumer loops (the schedule and the
  // loop change, never the arithmetic).
  with([](Config& c) { c.idx_gemm_on_main = true, c.qb_prewait_stages = 1, c.qb_overlap = 1; });
  with([](Config& c) { c.idx_gemm_on_main = true, c.qb_prewait_stages = 0, c.qb_overlap = 0; });
  for (Schedule sched : kAllSchedules)
    for (bool graph : {false, true}) with([](Config& c) { c.idx_gemm_on_main = c.idx_scores_on_main = true; }, sched, graph);
  // Session 4: the wq_b GEMM's paced pre-wait stages (timing only).
  with([](Config& c) { c.idx_gemm_on_main = true, c.qb_prewait_pace_ns = 700; });
  with([](Config& c) { c.idx_gemm_on_main = true, c.qb_prewait_pace_ns = 0; }, Schedule::kThreeLane, false);
  // Session 5: the act quant's CTA size (launch shape only).
  with([](Config& c) { c.aq_warps = 32; });
  with([](Config& c) { c.aq_warps = 0; });
  with([](Config& c) { c.aq_warps = 7; }, Schedule::kSerial, false);
  // Session 6: the reindex layers' scores over the kept blocks only, against scoring every position
  // (the top-k applies the mask in both), and the masked kernel's tile sizes.
  with([](Config& c) { c.scores_masked = false; });
  with([](Config& c) { c.scores_masked = false; }, Schedule::kSerial, false);
  with([](Config& c) { c.scores_mask_tile = 16; });
  with([](Config& c) { c.scores_mask_tile = 128, c.scores_group_rows = 1; });
  // Session 7: the candidate source's mask and top-k as two launches (default: one pair launch).
  with([](Config& c) { c.select_pair = false; });
  with([](Config& c) { c.scores_mask_tile = 64; });  // decode bs 32 takes 256 automatically now
  // weights_proj behind the compressor on lane S (the default puts it on lane K, through a
  // cross-lane event), eager and in graph, and on a schedule where it has no effect.
  with([](Config& c) { c.idx_x_on_k = false; });
  with([](Config& c) { c.idx_x_on_k = false; }, Schedule::kThreeLane, false);
  with([](Config& c) { c.idx_x_on_k = false; }, Schedule::kSourcesSide);
  with([](Config& c) { c.select_pair = false, c.select_cluster = 16; }, Schedule::kSerial, false);
  // Session 36: the selections' window exchange, the pair launch and the two launches, eager too.
  with([](Config& c) { c.select_window = true; });
  with([](Config& c) { c.select_window = true, c.select_pair = false; }, Schedule::kThreeLane, false);
  // (The fused Q chain and x quantised inside the QA GEMM need the automatic fp8 GEMMs, not v1:
  // GpuStackFull compares them.)

  std::vector<Snapshot> first;  // per step, of the first configuration
  std::string first_name;
  int n_configs = 0;
  for (const Config& c : configs) {
    const std::string name =
        std::string(to_string(c.schedule)) + (c.graph ? " graph" : " eager") + (c.pdl ? " pdl" : " no-pdl") +
        " s_fork " + std::to_string(static_cast<int>(c.s_fork)) + (c.lane_prologue ? " lane-prologue" : "") +
        (c.pdl_everywhere ? " pdl-everywhere" : "") + (c.idx_gemm_on_main ? " idx-gemm-main" : "") + " select v" +
        std::to_string(c.select_version) + " cluster " + std::to_string(c.select_cluster) + " scores g" +
        std::to_string(c.scores_group_rows) + " s" + std::to_string(c.scores_steps) + " rs" +
        std::to_string(c.scores_row_split) + " mb" + std::to_string(c.scores_min_blocks) + " side-priority " +
        std::to_string(c.side_priority) + (c.qnorm_trigger_late ? " qnorm-late" : "") +
        (c.idx_scores_on_main ? " idx-scores-main" : "") + " qb-prewait " + std::to_string(c.qb_prewait_stages) + " qb-overlap " + std::to_string(c.qb_overlap) + " qb-pace " + std::to_string(c.qb_prewait_pace_ns) + " aq-warps " + std::to_string(c.aq_warps) +
        (c.scores_masked ? "" : " scores-unmasked") + " mask-tile " + std::to_string(c.scores_mask_tile) +
        (c.select_pair ? "" : " select-unpaired") + (c.idx_x_on_k ? "" : " idx-x-on-s") +
        (c.select_window ? " select-window" : "");
    SCOPED_TRACE(name);
    // A fresh stack per configuration: the device inputs of padded rows depend on the step count.
    go.schedule = c.schedule;
    go.pdl = c.pdl;
    go.s_fork = c.s_fork;
    go.lane_prologue = c.lane_prologue;
    go.pdl_everywhere = c.pdl_everywhere;
    go.idx_gemm_on_main = c.idx_gemm_on_main;
    go.select_version = c.select_version;
    go.scores_group_rows = c.scores_group_rows;
    go.scores_steps = c.scores_steps;
    go.side_priority = c.side_priority;
    go.scores_row_split = c.scores_row_split;
    go.qnorm_trigger_late = c.qnorm_trigger_late;
    go.qb_prewait_stages = c.qb_prewait_stages;
    go.qb_overlap = c.qb_overlap;
    go.qb_prewait_pace_ns = c.qb_prewait_pace_ns;
    go.aq_warps = c.aq_warps;
    go.scores_masked = c.scores_masked;
    go.scores_mask_tile = c.scores_mask_tile;
    go.idx_scores_on_main = c.idx_scores_on_main;
    go.scores_min_blocks = c.scores_min_blocks;
    go.select_cluster = c.select_cluster;
    go.select_pair = c.select_pair;
    go.idx_x_on_k = c.idx_x_on_k;
    go.select_window = c.select_window;
    GpuPrepareStack gpu(plan, go);
    gpu.prefill_device_random(ctx);
    for (int step = 0; step < 2; ++step) {
      gpu.poison_outputs(kPoison);
      const prepare::StepInfo info = gpu.set_step(sc.kind, make_batch(sc.kind, advanced(ctx, step * v), v, 0));
      ASSERT_GE(info.bucket, info.rows);
      gpu.run(c.graph);
      Snapshot snap = take_snapshot(gpu);
      if (n_configs == 0) {
        first.push_back(std::move(snap));
        first_name = name;
      } else {
        expect_same(first[static_cast<size_t>(step)], snap, gpu, -1, name + " vs " + first_name + ", step " + std::to_string(step));
      }
    }
    EXPECT_EQ(gpu.error_count(), 0u);
    EXPECT_EQ(gpu.graphs().captures(), c.graph ? 1u : 0u);
    ++n_configs;
  }
  ASSERT_EQ(n_configs, static_cast<int>(configs.size()));
  // Not vacuous: the steps produced top-k entries and changed the caches between the two steps.
  int64_t valid = 0;
  for (const auto& t : first[1].topk)
    for (int32_t s : t) valid += s >= 0 && s != kPoisonI32;
  EXPECT_GT(valid, 0);
  EXPECT_NE(first_diff(first[0].caches.window[0], first[1].caches.window[0]), -1);
}

INSTANTIATE_TEST_SUITE_P(Shapes, GpuStackSchedules,
                         ::testing::Values(ShapeCase{"decode_bs1", StepKind::kDecode, 1, {1, 8}},
                                           ShapeCase{"decode_bs8", StepKind::kDecode, 8, {1, 8}},
                                           ShapeCase{"verify_bs1_padded", StepKind::kVerify, 1, {8, 32}},
                                           ShapeCase{"verify_bs4", StepKind::kVerify, 4, {24}},
                                           ShapeCase{"verify_bs4_padded", StepKind::kVerify, 4, {32}}),
                         [](const ::testing::TestParamInfo<ShapeCase>& i) { return std::string(i.param.name); });

// ================================ the real config ======================================================

int buckets_rows(const GpuStackOptions& go, StepKind kind) {
  const std::vector<int>& b = kind == StepKind::kDecode ? go.decode_buckets : go.verify_buckets;
  return b.empty() ? 0 : b.front();
}

void run_full_config(int tp, StepKind kind, int bs, std::vector<int> buckets) {
  const ModelPlan plan = build_plan(load_config(""), tp);
  const ModelConfig& cfg = plan.config;
  const int v = kind == StepKind::kVerify ? cfg.verify_rows_per_request() : 1;
  std::vector<int32_t> ctx;
  for (int q = 0; q < bs; ++q) ctx.push_back(q % 2 == 0 ? 3001 + 10 * q : 2500 + 10 * q);  // odd and even
  GpuStackOptions go;
  go.n_requests = bs;
  go.max_context = 3200;
  go.max_rows = 16;
  (kind == StepKind::kDecode ? go.decode_buckets : go.verify_buckets) = std::move(buckets);
  go.weights = WeightSource::kDeviceRandom;
  go.seed = 5;
  GpuPrepareStack gpu(plan, go);
  EXPECT_EQ(gpu.local_heads(), cfg.n_heads / tp);
  EXPECT_EQ(gpu.h_pad(), cfg.n_heads / tp);  // 64 and 16 are multiples of 8: no padding heads
  EXPECT_EQ(gpu.index_heads(), 32);         // replicated indexer
  gpu.prefill_device_random(ctx);
  const CacheState initial = gpu.download_caches();

  struct Config {
    Schedule schedule;
    bool graph;
    bool pdl;
    Fusion fuse_rope_store = Fusion::kOff;  // q_rope_store in the wq_b GEMM's epilogue (v2)
    Fusion fuse_qchain = Fusion::kOff;  // plain layers as one kernel (kernels/qchain.h)
    Fusion fuse_x_quant = Fusion::kAuto;  // x quantised inside the wq_a|wkv GEMM (the default)
    Fusion fuse_qnorm = Fusion::kAuto;    // q_norm inside the wq_b GEMM (the default: its own kernel)
    Fusion fuse_qchain_index = Fusion::kOff;  // reindex layers' Q chain as the fused kernel
    Fusion qchain_q_direct = Fusion::kAuto;   // the fused chain's direct q hand-off (kernels/qchain.h)
    int qb_side_mtiles = 0;                   // the index layers' wq_b GEMM at 64 (4) / 128 (2) CTAs
    bool fused_index_on_main = true;          // fused reindex layers: the indexer on main after the chain
    Fusion src_idx_main = Fusion::kAuto;      // three-lane: the compressor layers' indexer on main
    Fusion qnorm_dist = Fusion::kAuto;        // q_norm shared by the wq_b GEMM's first CTAs (kAuto: 24 rows)
    Fusion fuse_cmp_tail = Fusion::kAuto;     // the ratio-2 compressor's tail as one kernel (kAuto: on)
  };
  const Config configs[] = {{Schedule::kSerial, false, false},
                            {Schedule::kThreeLane, true, true},
                            {Schedule::kSourcesSide, true, false},
                            {Schedule::kThreeLane, false, true},
                            {Schedule::kThreeLane, true, true, Fusion::kOn},
                            {Schedule::kSerial, false, false, Fusion::kOn},
                            {Schedule::kThreeLane, true, true, Fusion::kAuto},
                            {Schedule::kThreeLane, true, true, Fusion::kOff, Fusion::kOn},
                            {Schedule::kSerial, false, false, Fusion::kOff, Fusion::kOn},
                            {Schedule::kThreeLane, true, true, Fusion::kOff, Fusion::kAuto},
                            // x quantised by its own kernel / always inside the GEMM, against the
                            // first configuration's automatic choice (inside up to 8 rows).
                            {Schedule::kSerial, false, false, Fusion::kOff, Fusion::kOff, Fusion::kOff},
                            {Schedule::kThreeLane, true, true, Fusion::kOff, Fusion::kOff, Fusion::kOn},
                            // q_norm inside the wq_b GEMM, against the first configuration's q_norm kernel.
                            {Schedule::kSerial, false, false, Fusion::kOff, Fusion::kOff, Fusion::kAuto, Fusion::kOn},
                            {Schedule::kThreeLane, true, true, Fusion::kAuto, Fusion::kOff, Fusion::kAuto, Fusion::kOn},
                            // The reindex layers' Q chain as the fused kernel (with and without the
                            // plain layers'), the indexer after it on lane S / on main.
                            {Schedule::kThreeLane, true, true, Fusion::kOff, Fusion::kOn, Fusion::kAuto, Fusion::kAuto, Fusion::kOn},
                            {Schedule::kThreeLane, false, true, Fusion::kAuto, Fusion::kOff, Fusion::kAuto, Fusion::kAuto, Fusion::kOn},
                            {Schedule::kSerial, false, false, Fusion::kOff, Fusion::kOff, Fusion::kAuto, Fusion::kAuto, Fusion::kOn},
                            {Schedule::kSourcesSide, true, false, Fusion::kOff, Fusion::kOn, Fusion::kAuto, Fusion::kAuto, Fusion::kOn},
                            // The fused chains' q hand-off: always direct / always through the tile reducers.
                            {Schedule::kThreeLane, true, true, Fusion::kAuto, Fusion::kOn, Fusion::kAuto, Fusion::kAuto, Fusion::kOn, Fusion::kOn},
                            {Schedule::kSerial, false, false, Fusion::kOff, Fusion::kOn, Fusion::kAuto, Fusion::kAuto, Fusion::kOn, Fusion::kOff},
                            // The index layers' wq_b GEMM at four / two m64 tiles per warpgroup.
                            {Schedule::kThreeLane, true, true, Fusion::kOff, Fusion::kAuto, Fusion::kAuto, Fusion::kAuto, Fusion::kAuto, Fusion::kAuto, 4},
                            {Schedule::kThreeLane, true, true, Fusion::kOff, Fusion::kAuto, Fusion::kAuto, Fusion::kAuto, Fusion::kAuto, Fusion::kAuto, 2},
                            // Fused reindex layers with the whole indexer on lane S (the default: on main).
                            {Schedule::kThreeLane, true, true, Fusion::kOff, Fusion::kOn, Fusion::kAuto, Fusion::kAuto, Fusion::kOn, Fusion::kAuto, 0, false},
                            {Schedule::kSourcesSide, true, true, Fusion::kOff, Fusion::kOn, Fusion::kAuto, Fusion::kAuto, Fusion::kOn, Fusion::kAuto, 0, true},
                            // The compressor layers' indexer on main, the wq_b GEMM on lane K (and off).
                            {Schedule::kThreeLane, true, true, Fusion::kOff, Fusion::kOn, Fusion::kAuto, Fusion::kAuto, Fusion::kOn, Fusion::kAuto, 0, true, Fusion::kOn},
                            {Schedule::kThreeLane, false, true, Fusion::kOff, Fusion::kOff, Fusion::kAuto, Fusion::kAuto, Fusion::kOff, Fusion::kAuto, 0, true, Fusion::kOn},
                            {Schedule::kThreeLane, true, true, Fusion::kOff, Fusion::kOn, Fusion::kAuto, Fusion::kAuto, Fusion::kOn, Fusion::kAuto, 0, true, Fusion::kOff},
                            // The plain layers' q_norm shared by the wq_b GEMM's first CTAs (the
                            // unfused chain; kAuto takes it at 24 rows only), plain and with the RoPE store.
                            {Schedule::kThreeLane, true, true, Fusion::kOff, Fusion::kOff, Fusion::kAuto, Fusion::kAuto, Fusion::kOff, Fusion::kAuto, 0, true, Fusion::kAuto, Fusion::kOn},
                            {Schedule::kSerial, false, false, Fusion::kOn, Fusion::kOff, Fusion::kAuto, Fusion::kAuto, Fusion::kOff, Fusion::kAuto, 0, true, Fusion::kAuto, Fusion::kOn},
                            // The ratio-2 compressor's tail as three launches (c2, the wk GEMM, the
                            // index-K store) against the first configuration's fused kernel.
                            {Schedule::kThreeLane, true, true, Fusion::kOff, Fusion::kOff, Fusion::kAuto, Fusion::kAuto, Fusion::kOff, Fusion::kAuto, 0, true, Fusion::kAuto, Fusion::kAuto, Fusion::kOff},
                            {Schedule::kSerial, false, false, Fusion::kOff, Fusion::kOff, Fusion::kAuto, Fusion::kAuto, Fusion::kOff, Fusion::kAuto, 0, true, Fusion::kAuto, Fusion::kAuto, Fusion::kOff}};
  // The fused form must really run here (wq_b at this config and bucket), or the configs above
  // that ask for it would silently compare the unfused path with itself.
  if (tp == 1) {
    EXPECT_TRUE(kernels::gemm_v2_rope_store_supported(buckets_rows(go, kind), static_cast<int64_t>(cfg.n_heads) * 512,
                                                      cfg.q_lora_rank));
    // Likewise the fused Q chain (its QA GEMM widens every block with cvt, as v3's default mask).
    EXPECT_TRUE(kernels::qchain_fused_supported(buckets_rows(go, kind), cfg.dim, cfg.q_lora_rank, cfg.n_heads));
    EXPECT_TRUE(kernels::qchain_fused_supported(buckets_rows(go, kind), cfg.dim, cfg.q_lora_rank, cfg.n_heads, -1, true));
    // And the index layers' wq_b GEMM at four m64 tiles per warpgroup (qb_side_mtiles 4).
    EXPECT_TRUE(kernels::gemm_v2_four_tiles_supported(buckets_rows(go, kind), static_cast<int64_t>(cfg.n_heads) * 512,
                                                      cfg.q_lora_rank));
    // And the wq_b GEMM that normalises its input itself, in both forms.
    EXPECT_TRUE(kernels::gemm_v2_qnorm_supported(buckets_rows(go, kind), static_cast<int64_t>(cfg.n_heads) * 512,
                                                 cfg.q_lora_rank));
    EXPECT_TRUE(kernels::gemm_v2_qnorm_dist_supported(buckets_rows(go, kind), static_cast<int64_t>(cfg.n_heads) * 512,
                                                      cfg.q_lora_rank));
    // And the QA GEMM that quantises x itself.
    EXPECT_TRUE(kernels::gemm_v3_fused_quant_supported(buckets_rows(go, kind), cfg.q_lora_rank + 512, cfg.dim));
    // And v6 for the indexer's wq_b (idx_gemv's default), and, at its rows, for the wq_a|wkv GEMM of
    // the layers with a compressor (qa_gemv's default): the GEMM version every config here runs.
    EXPECT_TRUE(kernels::gemm_gemv_supported(buckets_rows(go, kind), static_cast<int64_t>(cfg.index_n_heads) * cfg.index_head_dim,
                                             cfg.q_lora_rank));
    if (buckets_rows(go, kind) <= prepare::kQaGemvAutoRows)
      EXPECT_TRUE(kernels::gemm_gemv_supported(buckets_rows(go, kind), cfg.q_lora_rank + 512, cfg.dim));
  }
  // And the fused compressor tail (it takes wk's GEMM v5, the version kAuto runs at these rows).
  EXPECT_TRUE(kernels::skinny_gemm_preferred(buckets_rows(go, kind), cfg.index_head_dim, 512));
  // And layers with both a compressor and an indexer, which src_idx_main reschedules: without one the
  // src-idx-main configs would compare the default path with itself.
  EXPECT_TRUE(std::any_of(plan.layers.begin(), plan.layers.end(), [](const auto& l) {
    return (l.work & kWorkCMP) != 0 && (l.work & kWorkIDX) != 0;
  }));
  std::vector<Snapshot> first;
  const int rows = bs * v;
  for (size_t c = 0; c < std::size(configs); ++c) {
    const std::string name = std::string(to_string(configs[c].schedule)) + (configs[c].graph ? " graph" : " eager") +
                             " rope-store " + to_string(configs[c].fuse_rope_store) + " qchain " + to_string(configs[c].fuse_qchain) +
                             " x-quant " + to_string(configs[c].fuse_x_quant) + " qnorm " + to_string(configs[c].fuse_qnorm) +
                             " qchain-index " + to_string(configs[c].fuse_qchain_index) + " q-direct " +
                             to_string(configs[c].qchain_q_direct) + " qb-side-mtiles " + std::to_string(configs[c].qb_side_mtiles) +
                             (configs[c].fused_index_on_main ? "" : " fused-index-on-S") + " src-idx-main " +
                             to_string(configs[c].src_idx_main) + " qnorm-dist " + to_string(configs[c].qnorm_dist) +
                             " cmp-tail " + to_string(configs[c].fuse_cmp_tail);
    SCOPED_TRACE(name);
    gpu.upload_caches(initial);
    gpu.set_schedule(configs[c].schedule);
    gpu.set_pdl(configs[c].pdl);
    gpu.set_fuse_rope_store(configs[c].fuse_rope_store);
    gpu.set_fuse_qchain(configs[c].fuse_qchain);
    gpu.set_fuse_x_quant(configs[c].fuse_x_quant);
    gpu.set_fuse_qnorm(configs[c].fuse_qnorm);
    gpu.set_fuse_qchain_index(configs[c].fuse_qchain_index);
    gpu.set_qchain_q_direct(configs[c].qchain_q_direct);
    gpu.set_qb_side_mtiles(configs[c].qb_side_mtiles);
    gpu.set_fused_index_on_main(configs[c].fused_index_on_main);
    gpu.set_src_idx_main(configs[c].src_idx_main);
    gpu.set_qnorm_dist(configs[c].qnorm_dist);
    gpu.set_fuse_cmp_tail(configs[c].fuse_cmp_tail);
    gpu.reset_error_count();
    for (int step = 0; step < 2; ++step) {
      gpu.poison_outputs(kPoison);
      const std::vector<int32_t> pos0 = advanced(ctx, step * v);
      gpu.set_step(kind, make_batch(kind, pos0, v, 0));
      gpu.run(configs[c].graph);
      Snapshot snap = take_snapshot(gpu);
      if (c == 0) {
        // Top-k sizes: clen <= 2048 blocks of 8, so the candidate mask keeps everything and every
        // live row of an index source selects min(index_topk, clen) positions.
        for (int s : cfg.index_source_layers) {
          const int r = plan.layers[static_cast<size_t>(s)].ratio;
          for (int t = 0; t < rows; ++t) {
            const int q = t / v;
            const int pos = pos0[static_cast<size_t>(q)] + t % v;
            const int64_t want = std::min<int64_t>(cfg.index_topk, (pos + 1) / r);
            const auto row = snap.topk[static_cast<size_t>(s)].begin() + static_cast<int64_t>(t) * gpu.topk_width();
            const int64_t got = std::count_if(row, row + gpu.topk_width(), [](int32_t x) { return x >= 0; });
            EXPECT_EQ(got, want) << "index source " << s << " row " << t;
          }
        }
        first.push_back(std::move(snap));
      } else {
        expect_same(first[static_cast<size_t>(step)], snap, gpu, rows, name + ", step " + std::to_string(step));
      }
    }
    EXPECT_EQ(gpu.error_count(), 0u);
  }
}

TEST(GpuStackFull, V41FlashTp1VerifyAgreesAcrossSchedules) {
  V4_REQUIRE_GPU();
  run_full_config(1, StepKind::kVerify, 2, {16});  // 12 live rows, 4 padded
}

TEST(GpuStackFull, V41FlashTp1DecodeAgreesAcrossSchedules) {
  V4_REQUIRE_GPU();
  run_full_config(1, StepKind::kDecode, 3, {4});  // 3 live rows, 1 padded: Fusion::kAuto fuses here
}

TEST(GpuStackFull, V41FlashTp4DecodeAgreesAcrossSchedules) {
  V4_REQUIRE_GPU();
  run_full_config(4, StepKind::kDecode, 3, {4});  // 3 live rows, 1 padded
}

// ================================ prefill and refusals =================================================

TEST(GpuStack, DevicePrefillWritesExactlyTheContext) {
  V4_REQUIRE_GPU();
  const ModelPlan plan = build_plan(reduced_config(), 1);
  const ModelConfig& cfg = plan.config;
  const std::vector<int32_t> ctx = {5, 130, 257, 0};
  GpuStackOptions go;
  go.n_requests = 4;
  go.max_context = 300;
  go.max_rows = 24;
  GpuPrepareStack gpu(plan, go);
  gpu.prefill_device_random(ctx);
  const CacheState st = gpu.download_caches();
  const RequestPool& pool = gpu.pool();
  const CacheLayout wl = cache_layout(CacheKind::kWindowV41);
  for (int L = 0; L < cfg.n_layers; ++L) {
    const std::vector<uint8_t>& w = st.window[static_cast<size_t>(L)];
    for (int q = 0; q < 4; ++q)
      for (int slot = 0; slot < pool.window_ring; ++slot) {
        // Which position (if any) of the last `window` ones maps to this ring slot.
        bool written = false;
        for (int p = std::max(0, ctx[static_cast<size_t>(q)] - cfg.window_size); p < ctx[static_cast<size_t>(q)]; ++p)
          written = written || p % pool.window_ring == slot;
        const int64_t loc = static_cast<int64_t>(q) * pool.window_ring + slot;
        const uint8_t scale0 = w[static_cast<size_t>(wl.scale_offset(loc))];
        EXPECT_EQ(scale0, written ? 120 : 0) << "layer " << L << " request " << q << " ring slot " << slot;
      }
  }
  const CacheLayout cl = cache_layout(CacheKind::kCompressedFp4), il = cache_layout(CacheKind::kIndexK);
  for (int s : cfg.kv_source_layers) {
    const int r = plan.layers[static_cast<size_t>(s)].ratio;
    int64_t written = 0, want = 0;
    for (int64_t loc = 0; loc < gpu.comp_slots(s); ++loc) {
      const uint8_t cs = st.comp[static_cast<size_t>(s)][static_cast<size_t>(cl.scale_offset(loc))];
      const uint8_t is = st.index_k[static_cast<size_t>(s)][static_cast<size_t>(il.scale_offset(loc))];
      EXPECT_EQ(cs != 0, is != 0) << "slot " << loc;
      written += cs != 0;
    }
    for (int q = 0; q < 4; ++q) {
      want += ctx[static_cast<size_t>(q)] / r;
      for (int j = 0; j < ctx[static_cast<size_t>(q)] / r; ++j) {
        const int64_t loc = pool.full_slot(q, j * r) / r;
        EXPECT_GE(st.comp[static_cast<size_t>(s)][static_cast<size_t>(cl.scale_offset(loc))], 0x28) << "group " << j;
      }
    }
    EXPECT_EQ(written, want) << "kv source " << s;
    if (r == 2) {
      const std::vector<float>& ps = st.pair_state[static_cast<size_t>(s)];
      for (int q = 0; q < 4; ++q)
        for (int slot = 0; slot < pool.pair_ring; ++slot) {
          const float* row = ps.data() + (static_cast<size_t>(q) * pool.pair_ring + slot) * 1024;
          const bool parked = ctx[static_cast<size_t>(q)] % 2 == 1 && slot == (ctx[static_cast<size_t>(q)] - 1) % pool.pair_ring;
          EXPECT_EQ(std::isinf(row[512]) && row[512] < 0, !parked) << "request " << q << " slot " << slot;
        }
    }
  }
  // A verify step on it: nothing skipped, unmasked index sources select min(topk, clen).
  gpu.set_step(StepKind::kVerify, make_verify_batch({5, 130, 257}, 6));
  gpu.run_graph();
  EXPECT_EQ(gpu.error_count(), 0u);
  for (int s : {2, 6}) {  // kv + index sources (no candidate mask applied to their own top-k)
    ASSERT_TRUE(plan.layers[static_cast<size_t>(s)].is_kv_source);
    const int r = plan.layers[static_cast<size_t>(s)].ratio;
    const std::vector<int32_t> tk = gpu.topk(s);
    for (int t = 0; t < 18; ++t) {
      const int pos = std::vector<int>{5, 130, 257}[static_cast<size_t>(t / 6)] + t % 6;
      const int64_t got = std::count_if(tk.begin() + t * gpu.topk_width(), tk.begin() + (t + 1) * gpu.topk_width(),
                                        [](int32_t x) { return x >= 0; });
      EXPECT_EQ(got, std::min(cfg.index_topk, (pos + 1) / r)) << "layer " << s << " row " << t;
    }
  }
}

TEST(GpuStack, RefusesBadStepsAndMismatchedState) {
  V4_REQUIRE_GPU();
  const ModelPlan plan = build_plan(reduced_config(), 1);
  GpuStackOptions go;
  go.n_requests = 2;
  go.max_context = 200;
  go.max_rows = 12;
  GpuPrepareStack gpu(plan, go);
  EXPECT_THROW(gpu.run_eager(), std::invalid_argument);  // no step yet
  EXPECT_THROW(gpu.run_graph(), std::invalid_argument);
  BatchDesc too_many = make_verify_batch({10, 20}, 6);
  too_many.req.push_back(0);
  too_many.pos.push_back(16);
  EXPECT_THROW(gpu.set_step(StepKind::kVerify, too_many), std::exception);  // 13 rows > max_rows
  EXPECT_THROW(gpu.set_step(StepKind::kDecode, make_decode_batch({10, 20, 30})), std::invalid_argument);  // request 2
  EXPECT_THROW(gpu.set_step(StepKind::kDecode, make_decode_batch({10, 200})), std::invalid_argument);  // pos >= max_context
  BatchDesc seven = make_verify_batch({10}, 7);  // 7 rows of one request > rows_per_request 6
  EXPECT_THROW(gpu.set_step(StepKind::kVerify, seven), std::invalid_argument);
  EXPECT_THROW(gpu.set_step(StepKind::kDecode, BatchDesc{}), std::invalid_argument);
  EXPECT_THROW(gpu.prefill_device_random({10}), std::invalid_argument);
  EXPECT_THROW(gpu.prefill_device_random({10, 201}), std::invalid_argument);
  CacheState st = gpu.download_caches();
  st.window[3].pop_back();
  EXPECT_THROW(gpu.upload_caches(st), std::invalid_argument);
  ref::StackOptions so;
  so.n_requests = 3;
  so.max_context = 200;
  ref::RefStack other(plan, so);
  EXPECT_THROW(gpu.load_reference_caches(other), std::invalid_argument);
  EXPECT_THROW(gpu.topk(3), std::invalid_argument);  // a reuse layer has no top-k of its own
  EXPECT_THROW(gpu.comp_slots(4), std::invalid_argument);  // a reindex layer owns no pool
  // Host inputs with a non-finite value in a live row (NaN in layer 3, +-inf in layer 5) are refused,
  // naming where; one in a padded row is not (padded rows write nothing).
  for (const uint16_t bad : {uint16_t{0x7fc0}, uint16_t{0x7f80}, uint16_t{0xff80}}) {
    const int layer_bad = bad == 0x7fc0 ? 3 : 5;
    const prepare::HostInputFn x_bad = [&](int layer, const StepMeta& meta) {
      std::vector<num::bf16_t> x(static_cast<size_t>(meta.rows) * plan.config.dim, num::bf16_from_f32(0.5f));
      if (layer == layer_bad) x[static_cast<size_t>(plan.config.dim) + 17] = bad;  // row 1, element 17
      return x;
    };
    try {
      gpu.set_step(StepKind::kDecode, make_decode_batch({10, 20}), x_bad);
      ADD_FAILURE() << "a non-finite input (bf16 " << std::hex << bad << ") was accepted";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("layer " + std::to_string(layer_bad) + " row 1 element 17 is not finite"),
                std::string::npos)
          << e.what();
    }
  }
  // None of the refused steps was set.
  EXPECT_THROW(gpu.step_info(), std::invalid_argument);
  // Still usable after the refusals.
  gpu.set_step(StepKind::kDecode, make_decode_batch({10, 20}));
  gpu.run_eager();
  gpu.synchronize();
  EXPECT_EQ(gpu.error_count(), 0u);
  // A NaN in a padded row (the caller's third row, req -1) is not the step's business.
  const prepare::HostInputFn x_padded_nan = [&](int, const StepMeta& meta) {
    std::vector<num::bf16_t> x(static_cast<size_t>(meta.rows) * plan.config.dim, num::bf16_from_f32(0.5f));
    for (int t = 0; t < meta.rows; ++t)
      if (meta.req[static_cast<size_t>(t)] < 0) x[static_cast<size_t>(t) * plan.config.dim] = 0x7fc0;
    return x;
  };
  EXPECT_EQ(gpu.set_step(StepKind::kDecode, make_decode_batch({10, 20}, 3), x_padded_nan).rows, 3);
  gpu.run_eager();
  gpu.synchronize();
  EXPECT_EQ(gpu.error_count(), 0u);
}

}  // namespace
}  // namespace v4attn
