// CPU reference of a whole V4.1 attention stack for one step (decode or target-verify): every
// backbone layer (optionally the draft stages) in the order of the spec, with its caches, the
// borrowed top-k and candidate mask, synthetic weights and synthetic activations. Built on the
// per-op references (layer.h, prepare_ops.h, indexer.h, attention.h); this file only wires them.
//
// Per layer L (ratio r, plan.layers[L]) of a step, in this order:
//   x = synthetic_x(L, rows)                       [T, dim] bf16
//   Q chain (QA, QB)      q_chain -> qkv_a, qr, q, q_pad
//   window K (KV)         window_k_store(qkv_a[:, q_lora_rank:]) into L's window cache
//   compressor (CMP)      kv sources: compressor_forward -> compressed-KV + index-K + pair state
//   indexer (IDX)         index sources: qi = wq_b_idx(qr) (fp8 GEMM) -> indexer_q_pack,
//                         w = indexer_weights(weights_proj(x)) -> indexer_scores over the index-K
//                         cache of kv_src(L) -> candidate_mask (candidate source; its own top-k is
//                         unmasked) or apply_candidate_mask (index sources after it) ->
//                         topk_to_slots -> L's top-k (kept for the reuse layers after it)
//   attention             sparse_attention over L's window cache (+ r > 0: the compressed cache
//                         of kv_src(L) at the top-k of idx_src(L)) -> output_projection -> [T, dim]
// RoPE tables: ratio-0 layers use rope_theta without YaRN; r > 0 layers (everything of theirs:
// Q, window K, compressor, indexer, output) use compress_rope_theta with YaRN. Both tables have
// max_pos = the request pool's max_context rows.
//
// Synthetic activations: a live row's x is a function of (seed, layer, request, position) only,
// so a verify block and the equivalent sequence of decode steps see the same inputs and must
// leave the same cache bytes. A padded row's x depends on (seed, step, layer, row) and is not
// zero, so a padded row that wrote anything would show.
//
// Only tp = 1 is supported (the indexer needs every head's score before its top-k, and the
// output projection would need an all-reduce): other plans are refused.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "v4attn/cache_layout.h"
#include "v4attn/plan.h"
#include "v4attn/reference/layer.h"
#include "v4attn/reference/step.h"
#include "v4attn/reference/weights.h"

namespace v4attn::ref {

class Dumper;

// FNV-1a 64 over bytes (offset basis 0xcbf29ce484222325, prime 0x100000001b3), chainable.
constexpr uint64_t kFnvOffset = 0xcbf29ce484222325ull;
uint64_t fnv1a64(const void* data, size_t bytes, uint64_t h = kFnvOffset);
std::string checksum_hex(uint64_t h);  // 16 lower-case hex digits

struct StackOptions {
  int n_requests = 1;
  int max_context = 0;       // positions per request (> 0); also the RoPE tables' max_pos
  int rows_per_request = 0;  // most rows of one request in a step; 0: the config's verify rows
                             // (dspark_block_size + 1). Sizes the window ring and pair ring.
  uint64_t seed = 1;         // weights and synthetic activations
  // All layers' weights are kept in memory when their total (plan weight bytes) is at most this;
  // above it each layer's weights are generated when the layer runs and dropped after (the full
  // V4.1 config is ~6 GB of weights; generating one layer takes a fraction of a second).
  int64_t keep_weights_max_bytes = int64_t{2} << 30;
};

// What one layer did in a step.
struct LayerRecord {
  int layer = 0;
  int ratio = 0;
  LayerMode mode = LayerMode::kWindowOnly;
  int kv_src = -1;
  int idx_src = -1;
  uint32_t work = 0;        // WorkItem bits that ran (QA QB KV, CMP for kv sources, IDX for index sources)
  bool attention = false;   // attention + output projection ran (false with prepare_only)
  uint64_t q_checksum = 0;       // FNV-1a of q_pad [T, H, 512] bf16
  uint64_t window_checksum = 0;  // FNV-1a of the written window slots' bytes (data then scales), row order
  uint64_t comp_checksum = 0;    // kv sources: FNV-1a of the whole compressed-KV pool after the step
  uint64_t index_k_checksum = 0; // kv sources: FNV-1a of the whole index-K pool after the step
  uint64_t topk_checksum = 0;    // r > 0: FNV-1a of the top-k this layer used (own or borrowed)
  int64_t topk_count = 0;        // r > 0: valid (>= 0) entries of that top-k, all rows
  uint64_t out_checksum = 0;     // FNV-1a of the output [T, dim] bf16 (0 with prepare_only)
  int64_t skipped = 0;           // out-of-range slots skipped by the stores (0 when healthy)
  double prepare_ms = 0.0;       // QA .. IDX
  double attention_ms = 0.0;     // attention + output projection
  std::vector<num::bf16_t> output;  // [T, dim] (empty with prepare_only)
};

struct StepOptions {
  bool include_draft = false;  // also run the draft stages (ids n_layers .. total_layers-1)
  int max_layers = -1;         // run only backbone layers 0 .. max_layers-1 (-1: all)
  bool prepare_only = false;   // stop after the prepare: no attention, no output projection
  Dumper* dumper = nullptr;    // when set: dump the step's inputs/intermediates/outputs
  std::vector<int> dump_layers;  // layers to dump (empty: every layer that runs)
  std::function<void(const LayerRecord&)> on_layer;  // called after each layer (progress)
};

struct StepResult {
  int64_t step = 0;  // index of this step in the stack's life (0, 1, ...)
  StepMeta meta;
  std::vector<LayerRecord> layers;
  double total_ms = 0.0;
};

class RefStack {
 public:
  // Refuses (std::invalid_argument) tp != 1 and bad options.
  RefStack(const ModelPlan& plan, const StackOptions& options);

  const ModelPlan& plan() const { return plan_; }
  const ModelConfig& config() const { return plan_.config; }
  const StackOptions& options() const { return options_; }
  const RequestPool& pool() const { return pool_; }
  int64_t max_pos() const { return pool_.max_context; }
  // ratio 0: base table (rope_theta, no YaRN); ratio 1 or 2: compressed table (YaRN).
  const std::vector<float>& rope_table(int ratio) const { return ratio == 0 ? rope_base_ : rope_compressed_; }
  // Weights of a layer (generated on first use). The reference stays valid until the next call
  // for another layer when the stack does not keep all weights (see StackOptions).
  const LayerWeights& weights(int layer);
  bool keeps_all_weights() const { return keep_weights_; }

  // Window cache of any layer (kWindowV41 layout, pool().window_pool_slots() slots).
  CacheLayout window_layout() const { return cache_layout(CacheKind::kWindowV41); }
  int64_t window_slots() const { return pool_.window_pool_slots(); }
  std::vector<uint8_t>& window_cache(int layer);
  // Caches owned by a kv source (layer id of the source): compressed KV (kCompressedFp4) and
  // index K (kIndexK), comp_slots(source) slots each; the ratio-2 pair state fp32
  // [pair_state_rows(), 1024] (empty for ratio-1 sources).
  int64_t comp_slots(int kv_source) const;
  std::vector<uint8_t>& comp_cache(int kv_source);
  std::vector<uint8_t>& index_k_cache(int kv_source);
  std::vector<float>& pair_state(int kv_source);
  int64_t pair_state_rows() const { return static_cast<int64_t>(pool_.n_requests) * pool_.pair_ring; }
  CompressorCaches compressor_caches(int kv_source);
  // Top-k of an index source from the last step that ran it: [rows, topk_width()] compressed slots.
  const std::vector<int32_t>& topk(int index_source) const;
  int64_t topk_width() const { return topk_width_; }
  // Candidate mask of the last step [rows, candidate_mask_stride()] (1 = block kept).
  const std::vector<uint8_t>& candidate_mask() const { return cand_mask_; }
  int64_t candidate_mask_stride() const { return cand_mask_stride_; }
  // Compressed position j of request r -> compressed-pool slot req_to_token[r][j*ratio] / ratio,
  // [n_requests, comp_slot_stride(ratio)] with stride max_context / ratio.
  const std::vector<int32_t>& comp_slot_table(int ratio) const;
  int64_t comp_slot_stride(int ratio) const { return pool_.max_context / ratio; }

  // The synthetic x [T, dim] of a layer for the rows of a step (see the file comment).
  std::vector<num::bf16_t> synthetic_x(int layer, const StepMeta& meta, int64_t step) const;

  // Layers a step runs for these options, in order.
  std::vector<int> layers_to_run(const StepOptions& options) const;
  // One step: BatchDesc -> build_step_meta -> every layer. Throws std::invalid_argument on bad
  // batches (before any cache is written).
  StepResult run_step(const BatchDesc& batch, const StepOptions& options = {});
  int64_t steps_run() const { return steps_; }

 private:
  struct SourceCaches {
    std::vector<uint8_t> comp, index_k;
    std::vector<float> pair_state;
  };
  LayerRecord run_layer(int layer, const StepMeta& meta, int64_t step, const StepOptions& options, bool dump);
  SourceCaches& source(int kv_source);
  const SourceCaches& source(int kv_source) const;

  ModelPlan plan_;
  StackOptions options_;
  RequestPool pool_;
  int64_t full_slots_ = 0;  // pool_.full_pool_slots(), computed once
  std::vector<float> rope_base_, rope_compressed_;
  bool keep_weights_ = true;
  std::vector<std::optional<LayerWeights>> weights_;
  std::vector<std::vector<uint8_t>> window_;       // per layer id
  std::vector<std::optional<SourceCaches>> sources_;  // per layer id (kv sources only)
  std::vector<std::vector<int32_t>> topk_;         // per layer id (index sources only)
  int64_t topk_width_ = 0;
  std::vector<uint8_t> cand_mask_;
  int64_t cand_mask_stride_ = 0;
  std::vector<int32_t> comp_slot_table_[3];        // by ratio 1, 2
  int64_t steps_ = 0;
};

// --- synthetic prefill (src/reference/prefill.cpp) ---------------------------------------------
//
// Fills the caches as if positions 0 .. context[r]-1 of every request had been processed:
//  - window caches (every layer, draft stages included): the last min(context, window) positions
//    of each request, through window_k_store on synthetic kv rows (the real norm/RoPE/fp8 path;
//    cheap: window rows per layer), so every written slot is a well-formed quantised vector;
//  - per kv source, every completed group (context / ratio of them) in the compressed-KV and
//    index-K caches, by one of two paths:
//      kReal: the real compressor tail on synthetic projections: ratio 1 c1_fused on a synthetic
//             wkv_c(x); ratio 2 c2_fused on synthetic fp32 (kv, score) rows, paired in order;
//             then the index key from the latent through the real wk GEMM and index_k_store.
//             Entries are exactly what decode steps would store for those projections.
//      kFast: random valid entries written directly: FP4 KV blocks of 16 with a positive e4m3
//             scale and codes from a quantised normal distribution, one code per block at +-6
//             (what the quantiser gives its amax element); index-K blocks of 32 with a ue8m0
//             scale in 2^-2..2^0 and one code at +-4 or +-6. Decodes like real entries, costs a
//             few ns per byte (64K context x 4 sources in well under a second).
//      kAuto: kReal when the total number of groups is at most real_max_groups and the stack
//             keeps all weights in memory (not the full-size configs), else kFast.
//  - ratio-2 pair state: initialised for every request, and when context is odd the state row
//    of position context-1 holds that even row's parked (kv, score) (kReal: the synthetic row
//    that was paired in order; kFast: a synthetic row), so a step at position context completes
//    the group (context-1, context).
// Positions are not limited to multiples of anything; context 0 leaves a request empty.
enum class PrefillPath { kAuto, kReal, kFast };
const char* to_string(PrefillPath p);

struct PrefillOptions {
  PrefillPath path = PrefillPath::kAuto;
  int64_t real_max_groups = 32768;  // kAuto threshold (total groups over kv sources and requests)
  std::function<void(const std::string&)> progress;  // optional progress lines
};

struct PrefillStats {
  PrefillPath path = PrefillPath::kReal;  // the path used for the compressed entries
  int64_t window_rows = 0;                // window slots written (all layers)
  int64_t groups = 0;                     // compressed entries written (all sources, all requests)
  double ms = 0.0;
};

// context: one entry per request of the pool, each in [0, max_context] (a step at position
// context needs context + rows <= max_context). Throws std::invalid_argument on bad input before
// writing anything. Window entries use a unit kv_norm weight (no layer weights are generated for
// them); the kReal compressor path uses the kv source's own c_norm, wk and k_norm.
PrefillStats synthetic_prefill(RefStack& stack, const std::vector<int32_t>& context,
                               const PrefillOptions& options = {});

}  // namespace v4attn::ref
