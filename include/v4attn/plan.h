// The layer plan: for each layer of a config, its role, its sources, the prepare work items it
// runs (prepare-schedule.md) and the weights it owns (shapes and dtypes at a given TP size).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "v4attn/config.h"

namespace v4attn {

enum class LayerMode {
  kWindowOnly,  // ratio 0 backbone layer
  kFull,        // kv source + index source (owns compressor, wk, indexer)
  kReindex,     // own indexer, borrowed index-K and compressed KV
  kReuse,       // borrows compressed KV and top-k
  kDraft,       // MTP / DSpark draft stage (window-only)
};
const char* to_string(LayerMode m);

enum WorkItem : uint32_t {
  kWorkQA = 1u << 0,   // fused wq_a|wkv GEMM + q_norm
  kWorkQB = 1u << 1,   // wq_b GEMM + q_rope_store
  kWorkKV = 1u << 2,   // window-K norm + RoPE + fp8 quant + store
  kWorkCMP = 1u << 3,  // compressor + index-K store
  kWorkIDX = 1u << 4,  // indexer q, weights, logits, candidates, top-k
};
std::string work_items_string(uint32_t work);  // e.g. "QA QB KV CMP IDX"

enum class DType { kF32, kBF16, kE4M3, kUE8M0 };
const char* to_string(DType d);
int64_t dtype_bytes(DType d);

// Which part of a layer reads a weight: the prepare (QA, QB, KV, CMP, IDX) or the attention core and
// output projection after it (attn_sink, wo_a, wo_b). The prepare's bytes floor counts the former.
enum class WeightUse { kPrepare, kAttention };

struct WeightSpec {
  std::string name;            // e.g. "wq_b", "wq_b.scale", "compressor.wkv"
  std::vector<int64_t> shape;  // local (TP-sharded) shape
  DType dtype;
  WeightUse use = WeightUse::kPrepare;
  int64_t bytes() const;
};

struct LayerPlan {
  int layer = 0;
  int ratio = 0;
  LayerMode mode = LayerMode::kWindowOnly;
  int kv_src = -1;   // layer whose compressed-KV / index-K caches this layer reads (-1: none)
  int idx_src = -1;  // layer whose top-k this layer uses (-1: none)
  bool is_kv_source = false;
  bool is_index_source = false;
  bool is_candidate_source = false;
  bool uses_candidates = false;  // index source after the candidate source: masks its scores
  uint32_t work = 0;             // WorkItem bits
  std::vector<WeightSpec> weights;
  int64_t weight_bytes() const;
  int64_t prepare_weight_bytes() const;  // the weights the prepare reads (WeightUse::kPrepare)
};

struct ModelPlan {
  ModelConfig config;
  ParallelConfig parallel;
  std::vector<LayerPlan> layers;  // backbone then draft stages
  int count(LayerMode m) const;
};

ModelPlan build_plan(const ModelConfig& cfg, int tp = 1);

}  // namespace v4attn
