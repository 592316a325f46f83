// The reduced config for fast CPU runs (values and layer roles documented in config.h).
#include "v4attn/config.h"

namespace v4attn {

ModelConfig reduced_config() {
  ModelConfig c;
  c.source = "<reduced>";
  c.dim = 512;
  c.n_layers = 12;
  c.n_mtp_layers = 1;
  c.n_heads = 4;
  c.head_dim = 512;
  c.rope_head_dim = 64;
  c.q_lora_rank = 256;
  c.o_groups = 2;
  c.o_lora_rank = 128;
  // The window stays at 128: the window ring, its RoPE positions and the attention blocking are
  // exercised with the real size.
  c.window_size = 128;
  c.norm_eps = 1e-20f;
  // Backbone 0..11 then one draft stage (12). Ratio 2 for 2..5, ratio 1 for 6..11, as V4.1 has
  // its ratio-2 block before its ratio-1 block.
  c.compress_ratios = {0, 0, 2, 2, 2, 2, 1, 1, 1, 1, 1, 1, 0};
  c.kv_source_layers = {2, 6};
  c.index_source_layers = {2, 4, 6, 8, 10};
  // Candidate source 6 (kv + index source, as 20 is in V4.1): 8 and 10 use its block mask.
  c.candidate_source_layer = 6;
  c.candidate_topk_blocks = 8;
  c.candidate_block_size = 8;
  c.index_n_heads = 4;
  c.index_head_dim = 128;
  c.index_topk = 64;
  // RoPE / YaRN as V4.1-Flash, so the shared RoPE tables are the real ones.
  c.rope_theta = 10000.0;
  c.compress_rope_theta = 160000.0;
  c.original_seq_len = 65536;
  c.rope_factor = 16.0;
  c.beta_fast = 32.0;
  c.beta_slow = 1.0;
  c.dspark_block_size = 5;
  validate_config(c);
  return c;
}

}  // namespace v4attn
