// DeepSeek inference config (the format of configs/deepseek-v4.1-flash.json). Keys are the
// reference config's own names; unknown keys are ignored; missing, mistyped or inconsistent
// required keys are refused with a ConfigError naming the key and the file.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace v4attn {

struct ConfigError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct ModelConfig {
  std::string source;  // file the config came from ("<embedded default>" or a path)

  int dim = 0;
  int n_layers = 0;       // backbone layers
  int n_mtp_layers = 0;   // draft stages, ids n_layers .. n_layers + n_mtp_layers - 1
  int n_heads = 0;
  int head_dim = 0;       // nope + rope
  int rope_head_dim = 0;  // must be 64
  int q_lora_rank = 0;
  int o_groups = 0;
  int o_lora_rank = 0;
  int window_size = 0;
  float norm_eps = 0.0f;
  std::vector<int> compress_ratios;      // n_layers + n_mtp_layers entries, each 0, 1 or 2
  std::vector<int> kv_source_layers;     // sorted, ratio > 0
  std::vector<int> index_source_layers;  // sorted, ratio > 0; must include every kv source
  int candidate_source_layer = -1;       // -1: none
  int candidate_topk_blocks = 0;
  int candidate_block_size = 0;
  int index_n_heads = 0;
  int index_head_dim = 0;
  int index_topk = 0;
  double rope_theta = 0.0;
  double compress_rope_theta = 0.0;
  int64_t original_seq_len = 0;
  double rope_factor = 0.0;
  double beta_fast = 0.0;
  double beta_slow = 0.0;
  int dspark_block_size = 0;  // verify rows per request = dspark_block_size + 1

  int nope_head_dim() const { return head_dim - rope_head_dim; }
  int total_layers() const { return n_layers + n_mtp_layers; }
  int verify_rows_per_request() const { return dspark_block_size + 1; }
};

// Parses and validates. `source` names the file in error messages.
ModelConfig parse_config(const std::string& json_text, const std::string& source);
// Reads a file; an empty path loads the embedded default (configs/deepseek-v4.1-flash.json).
ModelConfig load_config(const std::string& path = "");
// The embedded default config's JSON text (compiled into the library).
const std::string& default_config_json();

// A reduced config for fast CPU runs: fewer layers and smaller dim/heads/ranks, with
// head_dim 512, rope 64, the V4.1 layer-role pattern (window-only, full, reindex, reuse,
// candidate source) kept. Validated like a loaded one.
ModelConfig reduced_config();

// Tensor-parallel shape: heads are split over tp ranks.
struct ParallelConfig {
  int tp = 1;
  int local_heads = 0;        // n_heads / tp
  int local_index_heads = 0;  // index_n_heads / tp
};
// Refuses tp < 1 or head counts not divisible by tp (ConfigError naming the key).
ParallelConfig make_parallel(const ModelConfig& cfg, int tp);

}  // namespace v4attn
