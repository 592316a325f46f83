// The layer plan (include/v4attn/plan.h): roles, sources, work items and weights per layer.
#include "v4attn/plan.h"

#include <algorithm>
#include <stdexcept>

namespace v4attn {

const char* to_string(LayerMode m) {
  switch (m) {
    case LayerMode::kWindowOnly: return "window-only";
    case LayerMode::kFull: return "full";
    case LayerMode::kReindex: return "reindex";
    case LayerMode::kReuse: return "reuse";
    case LayerMode::kDraft: return "draft";
  }
  return "?";
}

std::string work_items_string(uint32_t work) {
  static constexpr struct {
    uint32_t bit;
    const char* name;
  } kItems[] = {{kWorkQA, "QA"}, {kWorkQB, "QB"}, {kWorkKV, "KV"}, {kWorkCMP, "CMP"}, {kWorkIDX, "IDX"}};
  std::string out;
  for (const auto& item : kItems) {
    if ((work & item.bit) == 0) continue;
    if (!out.empty()) out += ' ';
    out += item.name;
  }
  return out;
}

const char* to_string(DType d) {
  switch (d) {
    case DType::kF32: return "f32";
    case DType::kBF16: return "bf16";
    case DType::kE4M3: return "e4m3";
    case DType::kUE8M0: return "ue8m0";
  }
  return "?";
}

int64_t dtype_bytes(DType d) {
  switch (d) {
    case DType::kF32: return 4;
    case DType::kBF16: return 2;
    case DType::kE4M3:
    case DType::kUE8M0: return 1;
  }
  throw std::logic_error("dtype_bytes: unknown dtype");
}

int64_t WeightSpec::bytes() const {
  int64_t n = dtype_bytes(dtype);
  for (int64_t d : shape) n *= d;
  return n;
}

int64_t LayerPlan::weight_bytes() const {
  int64_t total = 0;
  for (const WeightSpec& w : weights) total += w.bytes();
  return total;
}

int64_t LayerPlan::prepare_weight_bytes() const {
  int64_t total = 0;
  for (const WeightSpec& w : weights)
    if (w.use == WeightUse::kPrepare) total += w.bytes();
  return total;
}

int ModelPlan::count(LayerMode m) const {
  return static_cast<int>(std::count_if(layers.begin(), layers.end(),
                                        [m](const LayerPlan& l) { return l.mode == m; }));
}

namespace {

bool contains(const std::vector<int>& sorted_layers, int L) {
  return std::binary_search(sorted_layers.begin(), sorted_layers.end(), L);
}

int max_at_or_before(const std::vector<int>& sorted_layers, int L) {
  int best = -1;
  for (int s : sorted_layers)
    if (s <= L) best = s;
  return best;
}

// An fp8 [n, k] weight and its ue8m0 scale, one per 32x32 block: [ceil(n/32), k/32]
// (validate_config guarantees every K is a multiple of 32).
void add_fp8(std::vector<WeightSpec>& out, const std::string& name, int64_t n, int64_t k,
             WeightUse use = WeightUse::kPrepare) {
  out.push_back({name, {n, k}, DType::kE4M3, use});
  out.push_back({name + ".scale", {(n + 31) / 32, k / 32}, DType::kUE8M0, use});
}

std::vector<WeightSpec> layer_weights(const ModelConfig& c, const ParallelConfig& p,
                                      const LayerPlan& l) {
  const int64_t dim = c.dim, hd = c.head_dim, qr = c.q_lora_rank;
  std::vector<WeightSpec> w;
  // Q and window-K path: every layer (including draft stages).
  add_fp8(w, "wqkv_a", qr + hd, dim);  // fused wq_a | wkv, rows 0..q_lora_rank-1 = wq_a
  w.push_back({"q_norm", {qr}, DType::kF32});
  add_fp8(w, "wq_b", int64_t{p.local_heads} * hd, qr);
  w.push_back({"kv_norm", {hd}, DType::kF32});
  // The compressor produces one 512-dim latent (shared by all heads), so it is replicated over
  // TP ranks, not split.
  if (l.is_kv_source) {
    if (l.ratio == 1) {
      w.push_back({"compressor.wkv", {hd, dim}, DType::kBF16});
    } else {  // ratio 2: used in fp32 on fp32 input (spec 3.3)
      w.push_back({"compressor.wkv", {hd, dim}, DType::kF32});
      w.push_back({"compressor.wgate", {hd, dim}, DType::kF32});
    }
    w.push_back({"compressor.norm", {hd}, DType::kF32});
    w.push_back({"compressor.wk", {c.index_head_dim, hd}, DType::kBF16});
    w.push_back({"compressor.k_norm", {c.index_head_dim}, DType::kF32});
  }
  if (l.is_index_source) {
    add_fp8(w, "indexer.wq_b", int64_t{p.local_index_heads} * c.index_head_dim, qr);
    w.push_back({"indexer.weights_proj", {p.local_index_heads, dim}, DType::kBF16});
  }
  // Output path: heads (and so output groups) are split over TP ranks.
  w.push_back({"attn_sink", {p.local_heads}, DType::kF32, WeightUse::kAttention});
  const int64_t group_rows = int64_t{p.local_groups} * c.o_lora_rank;
  w.push_back({"wo_a", {group_rows, int64_t{c.n_heads / c.o_groups} * hd}, DType::kBF16, WeightUse::kAttention});
  add_fp8(w, "wo_b", dim, group_rows, WeightUse::kAttention);
  return w;
}

}  // namespace

ModelPlan build_plan(const ModelConfig& cfg, int tp) {
  // A hand-built config gets the same checks as a loaded one: the plan relies on them.
  validate_config(cfg);
  ModelPlan plan;
  plan.config = cfg;
  plan.parallel = make_parallel(cfg, tp);
  plan.layers.reserve(cfg.total_layers());
  for (int L = 0; L < cfg.total_layers(); ++L) {
    LayerPlan l;
    l.layer = L;
    l.ratio = cfg.compress_ratios[L];
    l.is_kv_source = contains(cfg.kv_source_layers, L);
    l.is_index_source = contains(cfg.index_source_layers, L);
    if (L >= cfg.n_layers) {
      l.mode = LayerMode::kDraft;
    } else if (l.ratio == 0) {
      l.mode = LayerMode::kWindowOnly;
    } else if (l.is_kv_source) {  // validate_config: every kv source is an index source
      l.mode = LayerMode::kFull;
    } else if (l.is_index_source) {
      l.mode = LayerMode::kReindex;
    } else {
      l.mode = LayerMode::kReuse;
    }
    // Draft stages and ratio-0 layers read no compressed cache and no top-k.
    if (l.ratio > 0) {
      l.kv_src = max_at_or_before(cfg.kv_source_layers, L);
      l.idx_src = max_at_or_before(cfg.index_source_layers, L);
    }
    const int cand = cfg.candidate_source_layer;
    l.is_candidate_source = cand >= 0 && L == cand;
    l.uses_candidates = cand >= 0 && l.is_index_source && L > cand;
    l.work = kWorkQA | kWorkQB | kWorkKV;
    if (l.is_kv_source) l.work |= kWorkCMP;
    if (l.is_index_source) l.work |= kWorkIDX;
    l.weights = layer_weights(cfg, plan.parallel, l);
    plan.layers.push_back(std::move(l));
  }
  return plan;
}

}  // namespace v4attn
