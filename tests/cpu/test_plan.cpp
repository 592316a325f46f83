// Layer plan: roles, sources, candidate flags, work items and weight shapes for V4.1-Flash (TP1
// and TP4) and for the reduced config.
#include <gtest/gtest.h>

#include <set>
#include <string>
#include <vector>

#include "v4attn/config.h"
#include "v4attn/plan.h"

namespace {

using v4attn::DType;
using v4attn::LayerMode;
using v4attn::LayerPlan;
using v4attn::ModelPlan;
using v4attn::WeightSpec;

const WeightSpec* find_weight(const LayerPlan& l, const std::string& name) {
  for (const WeightSpec& w : l.weights)
    if (w.name == name) return &w;
  return nullptr;
}

std::vector<std::string> weight_names(const LayerPlan& l) {
  std::vector<std::string> names;
  for (const WeightSpec& w : l.weights) names.push_back(w.name);
  return names;
}

void expect_weight(const LayerPlan& l, const std::string& name, std::vector<int64_t> shape,
                   DType dtype) {
  const WeightSpec* w = find_weight(l, name);
  ASSERT_NE(w, nullptr) << "layer " << l.layer << " has no " << name;
  EXPECT_EQ(w->shape, shape) << "layer " << l.layer << " " << name;
  EXPECT_EQ(w->dtype, dtype) << "layer " << l.layer << " " << name;
}

const ModelPlan& v41_plan() {
  static const ModelPlan plan = v4attn::build_plan(v4attn::load_config(), 1);
  return plan;
}

}  // namespace

TEST(PlanV41, ModeCounts) {
  const ModelPlan& p = v41_plan();
  ASSERT_EQ(p.layers.size(), 43u);
  EXPECT_EQ(p.count(LayerMode::kWindowOnly), 2);
  EXPECT_EQ(p.count(LayerMode::kFull), 4);
  EXPECT_EQ(p.count(LayerMode::kReindex), 4);
  EXPECT_EQ(p.count(LayerMode::kReuse), 30);
  EXPECT_EQ(p.count(LayerMode::kDraft), 3);
}

TEST(PlanV41, ModeOfEveryLayer) {
  const std::set<int> window_only = {0, 1}, full = {2, 8, 14, 20}, reindex = {24, 28, 32, 36},
                      draft = {40, 41, 42};
  for (const LayerPlan& l : v41_plan().layers) {
    LayerMode want = LayerMode::kReuse;
    if (window_only.count(l.layer)) want = LayerMode::kWindowOnly;
    if (full.count(l.layer)) want = LayerMode::kFull;
    if (reindex.count(l.layer)) want = LayerMode::kReindex;
    if (draft.count(l.layer)) want = LayerMode::kDraft;
    EXPECT_EQ(l.mode, want) << "layer " << l.layer << " is " << v4attn::to_string(l.mode);
    EXPECT_EQ(l.layer, &l - v41_plan().layers.data());
    EXPECT_EQ(l.ratio, v41_plan().config.compress_ratios[l.layer]);
    EXPECT_EQ(l.is_kv_source, full.count(l.layer) == 1) << l.layer;
    EXPECT_EQ(l.is_index_source, full.count(l.layer) + reindex.count(l.layer) == 1) << l.layer;
  }
}

TEST(PlanV41, SourcesOfLayers) {
  const struct {
    int layer, kv, idx;
  } cases[] = {{0, -1, -1},  {1, -1, -1},  {2, 2, 2},    {3, 2, 2},    {7, 2, 2},
               {8, 8, 8},    {19, 14, 14}, {20, 20, 20}, {23, 20, 20}, {24, 20, 24},
               {25, 20, 24}, {35, 20, 32}, {39, 20, 36}, {40, -1, -1}, {42, -1, -1}};
  for (const auto& c : cases) {
    const LayerPlan& l = v41_plan().layers[c.layer];
    EXPECT_EQ(l.kv_src, c.kv) << "layer " << c.layer;
    EXPECT_EQ(l.idx_src, c.idx) << "layer " << c.layer;
  }
}

TEST(PlanV41, CandidateFlags) {
  for (const LayerPlan& l : v41_plan().layers) {
    EXPECT_EQ(l.is_candidate_source, l.layer == 20) << l.layer;
    const bool uses = l.layer == 24 || l.layer == 28 || l.layer == 32 || l.layer == 36;
    EXPECT_EQ(l.uses_candidates, uses) << l.layer;
  }
}

TEST(PlanV41, WorkItems) {
  using namespace v4attn;
  for (const LayerPlan& l : v41_plan().layers) {
    uint32_t want = kWorkQA | kWorkQB | kWorkKV;
    if (l.is_kv_source) want |= kWorkCMP;
    if (l.is_index_source) want |= kWorkIDX;
    EXPECT_EQ(l.work, want) << l.layer;
  }
  EXPECT_EQ(work_items_string(v41_plan().layers[20].work), "QA QB KV CMP IDX");
  EXPECT_EQ(work_items_string(v41_plan().layers[24].work), "QA QB KV IDX");
  EXPECT_EQ(work_items_string(v41_plan().layers[25].work), "QA QB KV");
  EXPECT_EQ(work_items_string(kWorkCMP), "CMP");
  EXPECT_EQ(work_items_string(0), "");
}

TEST(PlanV41, WeightShapesAtTp1) {
  const LayerPlan& l = v41_plan().layers[3];  // a reuse layer: the common weights only
  EXPECT_EQ(weight_names(l), (std::vector<std::string>{"wqkv_a", "wqkv_a.scale", "q_norm", "wq_b",
                                                       "wq_b.scale", "kv_norm", "attn_sink", "wo_a",
                                                       "wo_b", "wo_b.scale"}));
  expect_weight(l, "wqkv_a", {1792, 5120}, DType::kE4M3);
  expect_weight(l, "wqkv_a.scale", {56, 160}, DType::kUE8M0);
  expect_weight(l, "q_norm", {1280}, DType::kF32);
  expect_weight(l, "wq_b", {32768, 1280}, DType::kE4M3);
  expect_weight(l, "wq_b.scale", {1024, 40}, DType::kUE8M0);
  expect_weight(l, "kv_norm", {512}, DType::kF32);
  expect_weight(l, "attn_sink", {64}, DType::kF32);
  expect_weight(l, "wo_a", {8192, 4096}, DType::kBF16);
  expect_weight(l, "wo_b", {5120, 8192}, DType::kE4M3);
  expect_weight(l, "wo_b.scale", {160, 256}, DType::kUE8M0);
  // wq_b: 41.9 MB of fp8 plus its scales; wqkv_a: 1792 x 5120 fp8.
  EXPECT_EQ(find_weight(l, "wq_b")->bytes(), int64_t{32768} * 1280);
  EXPECT_EQ(find_weight(l, "wq_b")->bytes() + find_weight(l, "wq_b.scale")->bytes(),
            int64_t{32768} * 1280 + 1024 * 40);
  EXPECT_EQ(find_weight(l, "wqkv_a")->bytes(), int64_t{1792} * 5120);
  EXPECT_EQ(find_weight(l, "wo_a")->bytes(), int64_t{8192} * 4096 * 2);
  EXPECT_EQ(find_weight(l, "attn_sink")->bytes(), 64 * 4);
  int64_t sum = 0;
  for (const WeightSpec& w : l.weights) sum += w.bytes();
  EXPECT_EQ(l.weight_bytes(), sum);
  EXPECT_EQ(l.weight_bytes(), 160268288);
}

TEST(PlanV41, CompressorAndIndexerWeightsByRole) {
  const ModelPlan& p = v41_plan();
  // Ratio-2 kv source: fp32 wkv and wgate.
  const LayerPlan& l2 = p.layers[2];
  expect_weight(l2, "compressor.wkv", {512, 5120}, DType::kF32);
  expect_weight(l2, "compressor.wgate", {512, 5120}, DType::kF32);
  expect_weight(l2, "compressor.norm", {512}, DType::kF32);
  expect_weight(l2, "compressor.wk", {128, 512}, DType::kBF16);
  expect_weight(l2, "compressor.k_norm", {128}, DType::kF32);
  expect_weight(l2, "indexer.wq_b", {4096, 1280}, DType::kE4M3);
  expect_weight(l2, "indexer.wq_b.scale", {128, 40}, DType::kUE8M0);
  expect_weight(l2, "indexer.weights_proj", {32, 5120}, DType::kBF16);
  // Ratio-1 kv source: bf16 wkv, no gate.
  const LayerPlan& l20 = p.layers[20];
  expect_weight(l20, "compressor.wkv", {512, 5120}, DType::kBF16);
  EXPECT_EQ(find_weight(l20, "compressor.wgate"), nullptr);
  expect_weight(l20, "indexer.wq_b", {4096, 1280}, DType::kE4M3);
  // Reindex: own indexer, no compressor.
  const LayerPlan& l24 = p.layers[24];
  expect_weight(l24, "indexer.wq_b", {4096, 1280}, DType::kE4M3);
  expect_weight(l24, "indexer.weights_proj", {32, 5120}, DType::kBF16);
  for (const std::string& name : weight_names(l24))
    EXPECT_EQ(name.rfind("compressor.", 0), std::string::npos) << name;
  // Reuse, window-only and draft: neither.
  for (int L : {0, 25, 41})
    for (const std::string& name : weight_names(p.layers[L])) {
      EXPECT_EQ(name.rfind("compressor.", 0), std::string::npos) << L << " " << name;
      EXPECT_EQ(name.rfind("indexer.", 0), std::string::npos) << L << " " << name;
    }
  // Byte totals follow: a ratio-2 full layer adds 2 fp32 [512, 5120] matrices and the rest.
  const int64_t compressor2 = 2 * 512 * 5120 * 4 + 512 * 4 + 128 * 512 * 2 + 128 * 4;
  const int64_t indexer = 4096 * 1280 + 128 * 40 + 32 * 5120 * 2;
  EXPECT_EQ(l2.weight_bytes(), p.layers[3].weight_bytes() + compressor2 + indexer);
  EXPECT_EQ(l24.weight_bytes(), p.layers[3].weight_bytes() + indexer);
}

TEST(PlanV41, ShapesAtTp4) {
  const ModelPlan p = v4attn::build_plan(v4attn::load_config(), 4);
  EXPECT_EQ(p.parallel.tp, 4);
  EXPECT_EQ(p.parallel.local_heads, 16);
  EXPECT_EQ(p.parallel.local_index_heads, 8);
  EXPECT_EQ(p.parallel.local_groups, 2);
  EXPECT_EQ(p.count(LayerMode::kReuse), 30);  // roles do not depend on TP
  const LayerPlan& l = p.layers[2];
  expect_weight(l, "wqkv_a", {1792, 5120}, DType::kE4M3);  // replicated
  expect_weight(l, "wq_b", {16 * 512, 1280}, DType::kE4M3);
  expect_weight(l, "wq_b.scale", {256, 40}, DType::kUE8M0);
  expect_weight(l, "attn_sink", {16}, DType::kF32);
  expect_weight(l, "wo_a", {2 * 1024, 4096}, DType::kBF16);
  expect_weight(l, "wo_b", {5120, 2048}, DType::kE4M3);
  expect_weight(l, "wo_b.scale", {160, 64}, DType::kUE8M0);
  expect_weight(l, "compressor.wkv", {512, 5120}, DType::kF32);  // replicated
  expect_weight(l, "indexer.wq_b", {8 * 128, 1280}, DType::kE4M3);
  expect_weight(l, "indexer.weights_proj", {8, 5120}, DType::kBF16);
  EXPECT_EQ(find_weight(l, "wq_b")->bytes(), int64_t{32768} * 1280 / 4);
}

TEST(PlanV41, RefusesBadTpAndInvalidConfigs) {
  EXPECT_THROW(v4attn::build_plan(v4attn::load_config(), 3), v4attn::ConfigError);
  v4attn::ModelConfig c = v4attn::load_config();
  c.index_source_layers = {2, 8, 14, 20, 24, 28, 32, 37};  // 37 instead of 36: still valid
  EXPECT_NO_THROW(v4attn::build_plan(c, 1));
  c.compress_ratios[37] = 0;  // now a source with ratio 0
  EXPECT_THROW(v4attn::build_plan(c, 1), v4attn::ConfigError);
}

TEST(PlanNoCandidates, NoLayerUsesCandidates) {
  v4attn::ModelConfig c = v4attn::load_config();
  c.candidate_source_layer = -1;
  const ModelPlan p = v4attn::build_plan(c, 1);
  for (const LayerPlan& l : p.layers) {
    EXPECT_FALSE(l.is_candidate_source) << l.layer;
    EXPECT_FALSE(l.uses_candidates) << l.layer;
  }
  EXPECT_EQ(p.count(LayerMode::kReindex), 4);
}

TEST(PlanReduced, ContainsAllFiveModes) {
  const ModelPlan p = v4attn::build_plan(v4attn::reduced_config(), 1);
  ASSERT_EQ(p.layers.size(), 13u);
  for (LayerMode m : {LayerMode::kWindowOnly, LayerMode::kFull, LayerMode::kReindex,
                      LayerMode::kReuse, LayerMode::kDraft})
    EXPECT_GT(p.count(m), 0) << v4attn::to_string(m);
  const LayerMode want[] = {LayerMode::kWindowOnly, LayerMode::kWindowOnly, LayerMode::kFull,
                            LayerMode::kReuse,      LayerMode::kReindex,    LayerMode::kReuse,
                            LayerMode::kFull,       LayerMode::kReuse,      LayerMode::kReindex,
                            LayerMode::kReuse,      LayerMode::kReindex,    LayerMode::kReuse,
                            LayerMode::kDraft};
  for (const LayerPlan& l : p.layers) {
    EXPECT_EQ(l.mode, want[l.layer]) << "layer " << l.layer;
    EXPECT_EQ(l.is_candidate_source, l.layer == 6) << l.layer;
    EXPECT_EQ(l.uses_candidates, l.layer == 8 || l.layer == 10) << l.layer;
  }
  // Both ratios among the kv sources, and a reindex layer of each ratio.
  EXPECT_EQ(p.layers[2].ratio, 2);
  EXPECT_EQ(p.layers[6].ratio, 1);
  EXPECT_EQ(p.layers[4].kv_src, 2);
  EXPECT_EQ(p.layers[4].idx_src, 4);
  EXPECT_EQ(p.layers[5].idx_src, 4);
  EXPECT_EQ(p.layers[11].kv_src, 6);
  EXPECT_EQ(p.layers[11].idx_src, 10);
  expect_weight(p.layers[2], "compressor.wgate", {512, 512}, DType::kF32);
  expect_weight(p.layers[6], "compressor.wkv", {512, 512}, DType::kBF16);
  expect_weight(p.layers[3], "wq_b", {4 * 512, 256}, DType::kE4M3);
  expect_weight(p.layers[3], "wo_a", {2 * 128, 2 * 512}, DType::kBF16);
  const ModelPlan p2 = v4attn::build_plan(v4attn::reduced_config(), 2);
  expect_weight(p2.layers[3], "wo_a", {128, 2 * 512}, DType::kBF16);
  expect_weight(p2.layers[4], "indexer.weights_proj", {2, 512}, DType::kBF16);
}

TEST(PlanTypes, NamesAndSizes) {
  using namespace v4attn;
  EXPECT_STREQ(to_string(LayerMode::kWindowOnly), "window-only");
  EXPECT_STREQ(to_string(LayerMode::kFull), "full");
  EXPECT_STREQ(to_string(LayerMode::kReindex), "reindex");
  EXPECT_STREQ(to_string(LayerMode::kReuse), "reuse");
  EXPECT_STREQ(to_string(LayerMode::kDraft), "draft");
  EXPECT_STREQ(to_string(DType::kE4M3), "e4m3");
  EXPECT_EQ(dtype_bytes(DType::kF32), 4);
  EXPECT_EQ(dtype_bytes(DType::kBF16), 2);
  EXPECT_EQ(dtype_bytes(DType::kE4M3), 1);
  EXPECT_EQ(dtype_bytes(DType::kUE8M0), 1);
  const WeightSpec w{"x", {3, 5, 7}, DType::kBF16};
  EXPECT_EQ(w.bytes(), 3 * 5 * 7 * 2);
}
