// DeepSeek inference config (the format of configs/deepseek-v4.1-flash.json). Keys are the
// reference config's own names; unknown keys are ignored; missing, mistyped or inconsistent
// required keys are refused with a ConfigError naming the key and the file.
//
// Error messages are one line, always starting "config error in <source>: ", e.g.
//   config error in my.json: key "n_heads": expected an integer, got string
//   config error in my.json: missing required key "dim"
//   config error in my.json: invalid JSON at byte 812: syntax error ...
// Integer keys refuse JSON numbers with a fraction or exponent (5120.0, 5e3): a config that
// says 5120.0 was probably edited by a tool that lost integer-ness, and silently truncating a
// dimension is worse than refusing. Float keys take integers (10000 is a fine rope_theta).
//
// Optional keys (everything else is required):
//   candidate_source_layer  absent, null or -1: no candidate source (no layer masks its scores);
//   candidate_topk_blocks, candidate_block_size  required only when a candidate source is set
//                           (then > 0); when none is set they may be absent (stay 0).
//
// Consistency rules beyond types (each refused with the key it concerns):
//   rope_head_dim == 64 and head_dim == 512 (the kernels are written for V4.1's 448 + 64);
//   index_head_dim == 128; index_topk a positive multiple of 64 (attention blocks of 64);
//   dim, q_lora_rank and o_lora_rank multiples of 32 (FP8 GEMM K blocks are 32 wide);
//   n_heads % o_groups == 0; window_size > 0; norm_eps > 0 (and > 0 as fp32); every dimension,
//   rope parameter and count > 0 (n_mtp_layers >= 0); dspark_block_size >= 1;
//   compress_ratios has exactly n_layers + n_mtp_layers entries, each 0, 1 or 2, and draft
//   stages (ids >= n_layers) have ratio 0 (they are window-only);
//   kv_source_layers / index_source_layers: strictly increasing backbone ids with ratio > 0,
//   every kv source is also an index source; every backbone layer with ratio > 0 has a kv
//   source and an index source at or before it, and its kv source has the same ratio (it
//   reads that cache with its own ratio's clen = (pos + 1) / r);
//   candidate_source_layer (if set) is an index source, and every index source after it reads
//   the same kv source (the published block mask indexes that cache's compressed positions).
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
// The consistency rules above, on an already-filled config (reduced_config() and hand-built
// configs go through this too). Throws ConfigError naming cfg.source and the key.
void validate_config(const ModelConfig& cfg);
// The config as JSON text with the reference key names (parse_config of it gives back an equal
// config, up to `source`). Only the keys this engine reads are written.
std::string config_to_json(const ModelConfig& cfg);
// Reads a file; an empty path loads the embedded default (configs/deepseek-v4.1-flash.json).
ModelConfig load_config(const std::string& path = "");
// The embedded default config's JSON text (compiled into the library).
const std::string& default_config_json();

// A reduced config for fast CPU runs: fewer layers and smaller dim/heads/ranks, with
// head_dim 512, rope 64, the V4.1 layer-role pattern (window-only, full, reindex, reuse,
// candidate source) kept. Validated like a loaded one. source = "<reduced>". Values:
//   dim 512, n_layers 12 + n_mtp_layers 1, n_heads 4 (head_dim 512 = 448 + 64), q_lora_rank 256,
//   o_groups 2, o_lora_rank 128, window_size 128, index_n_heads 4, index_head_dim 128,
//   index_topk 64, candidate_block_size 8, candidate_topk_blocks 8, dspark_block_size 5,
//   norm_eps and the RoPE/YaRN parameters as V4.1-Flash;
//   compress_ratios [0,0, 2,2,2,2, 1,1,1,1,1,1, 0], kv sources [2,6], index sources
//   [2,4,6,8,10], candidate source 6. Roles:
//     0,1 window-only | 2 full (ratio 2) | 3,5 reuse of 2 | 4 reindex (ratio 2, K/KV of 2) |
//     6 full (ratio 1, candidate source) | 7,9,11 reuse | 8,10 reindex using candidates |
//     12 draft.
//   Small enough for a CPU step in well under a second; keeps every code path of the plan
//   (both ratios, both kinds of borrowing, candidate masking) and the real per-head shapes.
//   It splits over tp 1 and 2 (n_heads 4, index_n_heads 4, o_groups 2).
ModelConfig reduced_config();

// Tensor-parallel shape: heads are split over tp ranks.
struct ParallelConfig {
  int tp = 1;
  int local_heads = 0;        // n_heads / tp
  int local_index_heads = 0;  // index_n_heads / tp
  int local_groups = 0;       // o_groups / tp (wo_a / wo_b are split by output group)
};
// Refuses tp < 1 or n_heads / index_n_heads / o_groups not divisible by tp (ConfigError naming
// the key and the tp value).
ParallelConfig make_parallel(const ModelConfig& cfg, int tp);

}  // namespace v4attn
