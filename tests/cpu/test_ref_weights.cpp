// Tests of the deterministic synthetic layer weights (weights.h).
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <stdexcept>
#include <vector>

#include "ref_test_util.h"
#include "v4attn/config.h"
#include "v4attn/plan.h"
#include "v4attn/reference/weights.h"

namespace {

using namespace v4attn;
using namespace reftest;
using ref::LayerWeights;

bool same_bytes(const LayerWeights& a, const LayerWeights& b) {
  auto fp8 = [](const ref::Fp8Matrix& x, const ref::Fp8Matrix& y) { return x.n == y.n && x.k == y.k && x.w == y.w && x.scale == y.scale; };
  bool same = fp8(a.wqkv_a, b.wqkv_a) && fp8(a.wq_b, b.wq_b) && fp8(a.wo_b, b.wo_b) && a.q_norm == b.q_norm &&
              a.kv_norm == b.kv_norm && a.attn_sink == b.attn_sink && a.wo_a.w == b.wo_a.w &&
              a.compressor.has_value() == b.compressor.has_value() && a.indexer.has_value() == b.indexer.has_value();
  if (same && a.compressor) {
    const auto &c = *a.compressor, &d = *b.compressor;
    same = c.ratio == d.ratio && c.wkv_c.w == d.wkv_c.w && c.wkv.w == d.wkv.w && c.wgate.w == d.wgate.w &&
           c.c_norm == d.c_norm && c.wk.w == d.wk.w && c.k_norm == d.k_norm;
  }
  if (same && a.indexer) same = fp8(a.indexer->wq_b, b.indexer->wq_b) && a.indexer->weights_proj.w == b.indexer->weights_proj.w;
  return same;
}

double rms(const std::vector<float>& v) {
  double s = 0;
  for (float x : v) s += static_cast<double>(x) * x;
  return std::sqrt(s / static_cast<double>(v.size()));
}

void expect_norm_weights(const std::vector<float>& w, size_t n, const char* what) {
  ASSERT_EQ(w.size(), n) << what;
  for (float x : w) {
    EXPECT_GE(x, 0.8984375f) << what;  // 0.9 and 1.1 rounded to bf16 (step 2^-8 / 2^-7)
    EXPECT_LE(x, 1.1015625f) << what;
    EXPECT_EQ(num::round_bf16(x), x) << what << ": not bf16-representable";
  }
}

// Every fp8 block is tight (its largest code is in [224, 448]: amax / s is in (224, 448], and
// e4m3 rounding may bring it down to 224) and holds no NaN code.
void expect_fp8_healthy(const ref::Fp8Matrix& m, int64_t k, const char* what) {
  ASSERT_EQ(m.k, k) << what;
  const int64_t kb = m.k / 32;
  std::vector<double> block_max(m.scale.size(), 0.0);
  for (int64_t r = 0; r < m.n; ++r)
    for (int64_t c = 0; c < m.k; ++c) {
      const uint8_t code = m.w[static_cast<size_t>(r * m.k + c)];
      ASSERT_NE(code & 0x7f, 0x7f) << what << ": NaN code";
      double& bm = block_max[static_cast<size_t>((r / 32) * kb + c / 32)];
      bm = std::max(bm, std::fabs(e4m3_value(code)));
    }
  for (double bm : block_max) {
    EXPECT_GE(bm, 224.0) << what;
    EXPECT_LE(bm, 448.0) << what;
  }
  // Magnitude: N(0,1) / sqrt(K) before quantisation.
  const double want = 1.0 / std::sqrt(static_cast<double>(k));
  EXPECT_NEAR(rms(ref::dequant_fp8(m)), want, 0.05 * want) << what;
}

TEST(RefWeights, ReducedConfigShapesFollowThePlanAndAreDeterministic) {
  const ModelPlan plan = build_plan(reduced_config(), 1);
  const ModelConfig& c = plan.config;
  for (const LayerPlan& lp : plan.layers) {
    const LayerWeights w = ref::make_synthetic_layer_weights(plan, lp.layer, 7);
    EXPECT_EQ(w.layer, lp.layer);
    EXPECT_EQ(w.wqkv_a.n, c.q_lora_rank + 512);
    EXPECT_EQ(w.wq_b.n, c.n_heads * 512);
    EXPECT_EQ(w.compressor.has_value(), lp.is_kv_source) << lp.layer;
    EXPECT_EQ(w.indexer.has_value(), lp.is_index_source) << lp.layer;
    if (w.compressor) {
      EXPECT_EQ(w.compressor->ratio, lp.ratio);
      const size_t proj = static_cast<size_t>(512 * c.dim);
      EXPECT_EQ(w.compressor->wkv_c.w.size(), lp.ratio == 1 ? proj : 0u);
      EXPECT_EQ(w.compressor->wgate.w.size(), lp.ratio == 2 ? proj : 0u);
      expect_norm_weights(w.compressor->c_norm, 512, "c_norm");
      expect_norm_weights(w.compressor->k_norm, 128, "k_norm");
    }
    expect_norm_weights(w.q_norm, static_cast<size_t>(c.q_lora_rank), "q_norm");
    expect_norm_weights(w.kv_norm, 512, "kv_norm");
    expect_fp8_healthy(w.wqkv_a, c.dim, "wqkv_a");
    expect_fp8_healthy(w.wq_b, c.q_lora_rank, "wq_b");
    expect_fp8_healthy(w.wo_b, static_cast<int64_t>(c.o_groups) * c.o_lora_rank, "wo_b");
    EXPECT_EQ(w.wo_a.n, static_cast<int64_t>(c.o_groups) * c.o_lora_rank);
    EXPECT_EQ(w.wo_a.k, static_cast<int64_t>(c.n_heads / c.o_groups) * 512);
    EXPECT_TRUE(same_bytes(w, ref::make_synthetic_layer_weights(plan, lp.layer, 7))) << "layer " << lp.layer;
  }
  // Different layers and different seeds give different weights.
  const LayerWeights a = ref::make_synthetic_layer_weights(plan, 3, 7), b = ref::make_synthetic_layer_weights(plan, 4, 7);
  EXPECT_NE(a.wq_b.w, b.wq_b.w);
  EXPECT_NE(a.q_norm, b.q_norm);
  EXPECT_NE(a.wq_b.w, ref::make_synthetic_layer_weights(plan, 3, 8).wq_b.w);
  // Tensors of one layer differ from each other (the name is part of the key).
  EXPECT_NE(a.q_norm, std::vector<float>(a.kv_norm.begin(), a.kv_norm.begin() + static_cast<long>(a.q_norm.size())));
  EXPECT_THROW(ref::make_synthetic_layer_weights(plan, static_cast<int>(plan.layers.size()), 7), std::invalid_argument);
}

TEST(RefWeights, ProjectionsGiveUnitScaleOutputs) {
  // The bf16 / fp32 compressor weights: rms 1/sqrt(K) and attn_sink ~ N(0, 1).
  const ModelPlan plan = build_plan(reduced_config(), 1);
  const LayerWeights w2 = ref::make_synthetic_layer_weights(plan, 2, 11);  // ratio-2 kv source
  ASSERT_TRUE(w2.compressor);
  const double want = 1.0 / std::sqrt(static_cast<double>(plan.config.dim));
  EXPECT_NEAR(rms(w2.compressor->wkv.w), want, 0.03 * want);
  EXPECT_NEAR(rms(w2.compressor->wgate.w), want, 0.03 * want);
  EXPECT_NE(w2.compressor->wkv.w, w2.compressor->wgate.w);
  std::vector<float> wk(w2.compressor->wk.w.size());
  for (size_t i = 0; i < wk.size(); ++i) wk[i] = bf16_value(w2.compressor->wk.w[i]);
  EXPECT_NEAR(rms(wk), 1.0 / std::sqrt(512.0), 0.03 / std::sqrt(512.0));
  const std::vector<num::bf16_t> x = ref::synthetic_bf16(1 << 16, 5, 2.0f);
  std::vector<float> xf(x.size());
  double mean = 0;
  for (size_t i = 0; i < x.size(); ++i) mean += xf[i] = bf16_value(x[i]);
  EXPECT_NEAR(mean / static_cast<double>(x.size()), 0.0, 0.05);
  EXPECT_NEAR(rms(xf), 2.0, 0.05);
  EXPECT_EQ(x, ref::synthetic_bf16(1 << 16, 5, 2.0f));
  EXPECT_NE(x, ref::synthetic_bf16(1 << 16, 6, 2.0f));
}

TEST(RefWeights, FullSizeV41LayerIsFast) {
  const ModelPlan plan = build_plan(load_config(), 1);
  const auto t0 = std::chrono::steady_clock::now();
  const LayerWeights w = ref::make_synthetic_layer_weights(plan, 2, 1);  // full layer, ratio 2: the largest
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("[ weights ] full-size V4.1 layer 2 generated in %.3f s\n", s);
  EXPECT_EQ(w.wq_b.n, 32768);
  EXPECT_EQ(w.wq_b.k, 1280);
  EXPECT_EQ(w.wo_b.k, 8192);
  EXPECT_EQ(w.attn_sink.size(), 64u);
  ASSERT_TRUE(w.indexer);
  EXPECT_EQ(w.indexer->wq_b.n, 32 * 128);
  double mean = 0, sq = 0;
  for (float v : w.attn_sink) {
    mean += v;
    sq += static_cast<double>(v) * v;
  }
  EXPECT_NEAR(mean / 64, 0.0, 0.5);
  EXPECT_NEAR(std::sqrt(sq / 64), 1.0, 0.35);
  EXPECT_LT(s, 5.0);  // target well under 1 s on 2 cores; generous for loaded CI machines
}

}  // namespace
