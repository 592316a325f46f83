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
    // Per request: 3 x 32768 + 65537 (ratio 1 at pos 65536; verify: 65542) + 4 x 16384 positions.
    const int64_t ratio1 = k.verify ? 65542 : 65537;
    EXPECT_EQ(f.index_k_bytes, k.bs * (3 * (k.verify ? 32771 : 32768) + ratio1 + 4 * 16384) * int64_t{68}) << what;
    EXPECT_NEAR(f.us(), k.floor_us, 0.05) << what;
  }
}

TEST(CycleFloor, PaddedRowsAndShortContexts) {
  const ModelPlan plan = build_plan(load_config(""), 1);
  // A request's rows read one cache: 6 verify rows cost what its longest row does, padded rows nothing.
  StepMeta m = step_at(plan, true, 1, 100);
  const CycleFloor one = prepare_cycle_floor(plan, m);
  // clen at positions 100..105: ratio 2 53 (3 sources), ratio 1 106 (layer 20), masked min(106, 16384).
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
  EXPECT_EQ(pytorch_reference_us(true, 1, 65536), 5480.0);
  EXPECT_EQ(pytorch_reference_us(false, 1, 65536), 4880.0);
  EXPECT_EQ(pytorch_reference_us(false, 32, 65536), 7440.0);
  EXPECT_EQ(pytorch_reference_us(true, 4, 65536), 6570.0);
  EXPECT_FALSE(pytorch_reference_us(false, 8, 65536).has_value());
  EXPECT_FALSE(pytorch_reference_us(true, 1, 32768).has_value());
}

}  // namespace
