// The prepare cycle's bytes floor (include/v4attn/cycle_floor.h) against figures worked out by hand
// from the plan's weight table and the spec's cache sizes, as docs/perf.md has reported them since
// session 7 (2.160 GB of prepare weights; per request 3 ratio-2 sources at 32K compressed positions,
// layer 20 at 64K, 4 masked layers at 2048 kept blocks of 8, x 68 bytes).
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "v4attn/config.h"
#include "v4attn/cycle_floor.h"
#include "v4attn/plan.h"
#include "v4attn/reference/step.h"

namespace {

using namespace v4attn;

StepMeta step_at(const ModelPlan& plan, bool verify, int bs, int context) {
  const int v = verify ? plan.config.dspark_block_size + 1 : 1;
  const RequestPool pool = make_request_pool(bs, context + v, v, plan.config.window_size);
  const std::vector<int32_t> ctx(static_cast<size_t>(bs), context);
  return build_step_meta(verify ? make_verify_batch(ctx, v) : make_decode_batch(ctx), pool, context + v);
}

TEST(CycleFloor, PrepareWeightsOfTheReleasedConfig) {
  const ModelPlan plan = build_plan(load_config(""), 1);
  int64_t prepare = 0, all = 0;
  for (const LayerPlan& l : plan.layers) {
    if (l.layer >= plan.config.n_layers) continue;
    prepare += l.prepare_weight_bytes();
    all += l.weight_bytes();
    // What the prepare does not read: the attention sink and the output projection.
    int64_t attention = 0;
    for (const WeightSpec& w : l.weights)
      if (w.use == WeightUse::kAttention) {
        attention += w.bytes();
        EXPECT_TRUE(w.name == "attn_sink" || w.name.rfind("wo_", 0) == 0) << w.name;
      }
    EXPECT_EQ(l.weight_bytes(), l.prepare_weight_bytes() + attention);
  }
  EXPECT_EQ(prepare, 2160304128);  // docs/perf.md's 2.160 GB
  EXPECT_GT(all, prepare);
}

TEST(CycleFloor, TheIssuesFourCyclesAndDecodeBs8) {
  const ModelPlan plan = build_plan(load_config(""), 1);
  struct Case {
    bool verify;
    int bs;
    double floor_us;  // docs/perf.md, rounded to 0.1 us
  };
  const Case cases[] = {{true, 1, 509.6}, {false, 1, 509.6}, {true, 4, 520.5}, {false, 8, 535.1},
                        {false, 32, 622.8}};
  for (const Case& k : cases) {
    const CycleFloor f = prepare_cycle_floor(plan, step_at(plan, k.verify, k.bs, 65536));
    const std::string what = std::string(k.verify ? "verify" : "decode") + " bs " + std::to_string(k.bs);
    EXPECT_EQ(f.weight_bytes, 2160304128) << what;
    // Per request: 3 x 32768 + 65537 (ratio 1 at pos 65536; verify: 65542) positions, and in the 4
    // masked layers 2047 full blocks of 8 plus the newest block: 1 position (clen 65537) or 6 (65542).
    const int64_t ratio1 = k.verify ? 65542 : 65537;
    const int64_t masked = 2047 * 8 + (k.verify ? 6 : 1);
    EXPECT_EQ(f.index_k_bytes, k.bs * (3 * (k.verify ? 32771 : 32768) + ratio1 + 4 * masked) * int64_t{68}) << what;
    EXPECT_NEAR(f.us(), k.floor_us, 0.05) << what;
  }
}

// The shape form (no slot tables) gives what the step form gives.
TEST(CycleFloor, ShapeFormMatchesTheStepForm) {
  const ModelPlan plan = build_plan(load_config(""), 1);
  for (bool verify : {false, true})
    for (int bs : {1, 3, 32})
      for (int context : {0, 7, 100, 4095, 65536}) {
        const CycleFloor a = prepare_cycle_floor(plan, step_at(plan, verify, bs, context));
        const CycleFloor b = prepare_cycle_floor(plan, verify, bs, context);
        EXPECT_EQ(a.weight_bytes, b.weight_bytes);
        EXPECT_EQ(a.index_k_bytes, b.index_k_bytes) << (verify ? "verify" : "decode") << " bs " << bs << " at " << context;
      }
  EXPECT_THROW(prepare_cycle_floor(plan, true, 0, 100), std::invalid_argument);
  EXPECT_THROW(prepare_cycle_floor(plan, false, 1, -1), std::invalid_argument);
  // Large shapes cost nothing to compute: 4096 requests at 1M positions.
  EXPECT_GT(prepare_cycle_floor(plan, false, 4096, 1 << 20).us(), 0.0);
}

TEST(CycleFloor, PaddedRowsAndShortContexts) {
  const ModelPlan plan = build_plan(load_config(""), 1);
  // A request's rows read one cache: 6 verify rows cost what its longest row does, padded rows nothing.
  StepMeta m = step_at(plan, true, 1, 100);
  const CycleFloor one = prepare_cycle_floor(plan, m);
  // clen at positions 100..105: ratio 2 53 (3 sources), ratio 1 106 (layer 20), masked: all 106 (14
  // blocks, within the budget of 2048).
  EXPECT_EQ(one.index_k_bytes, (3 * 53 + 106 + 4 * 106) * int64_t{68});
  m.rows += 2;
  m.req.push_back(-1);
  m.req.push_back(-1);
  for (int r : {1, 2}) m.clen[r].insert(m.clen[r].end(), {0, 0});
  EXPECT_EQ(prepare_cycle_floor(plan, m).index_k_bytes, one.index_k_bytes);
  // Empty context: the weights only.
  EXPECT_EQ(prepare_cycle_floor(plan, step_at(plan, false, 3, 0)).index_k_bytes,
            3 * (3 * 0 + 1 + 4 * 1) * int64_t{68});  // pos 0: ratio-2 clen 0, ratio-1 clen 1
  // Malformed metadata is refused.
  StepMeta bad = m;
  bad.req.pop_back();
  EXPECT_THROW(prepare_cycle_floor(plan, bad), std::invalid_argument);
}

TEST(CycleFloor, PytorchFiguresOnlyForTheIssuesCycles) {
  const ModelPlan plan = build_plan(load_config(""), 1);
  EXPECT_EQ(pytorch_reference_us(plan, true, 1, 65536), 5480.0);
  EXPECT_EQ(pytorch_reference_us(plan, false, 1, 65536), 4880.0);
  EXPECT_EQ(pytorch_reference_us(plan, false, 32, 65536), 7440.0);
  EXPECT_EQ(pytorch_reference_us(plan, true, 4, 65536), 6570.0);
  EXPECT_FALSE(pytorch_reference_us(plan, false, 8, 65536).has_value());
  EXPECT_FALSE(pytorch_reference_us(plan, true, 1, 32768).has_value());
  // Only the released config at tp 1: the figures are of that model on one GPU.
  EXPECT_FALSE(pytorch_reference_us(build_plan(load_config(""), 4), true, 1, 65536).has_value());
  EXPECT_FALSE(pytorch_reference_us(build_plan(reduced_config(), 1), true, 1, 65536).has_value());
  ModelConfig other = load_config("");
  other.index_topk = 1024;
  EXPECT_FALSE(pytorch_reference_us(build_plan(other, 1), true, 1, 65536).has_value());
  // The same config from its file (another source name) counts as the released one.
  const ModelConfig from_file = load_config(std::string(V4ATTN_SOURCE_DIR) + "/configs/deepseek-v4.1-flash.json");
  EXPECT_EQ(pytorch_reference_us(build_plan(from_file, 1), true, 1, 65536), 5480.0);
}

}  // namespace
