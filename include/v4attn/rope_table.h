// RoPE / YaRN tables (spec section 2), built once per layer kind on the host and shared, byte for
// byte, by the CPU reference and the GPU kernels (which never evaluate transcendentals).
#pragma once

#include <cstdint>
#include <vector>

namespace v4attn {

struct ModelConfig;

struct RopeParams {
  double base = 10000.0;        // rope_theta (ratio-0 layers) or compress_rope_theta (ratio > 0)
  bool yarn = false;            // YaRN only for ratio > 0 layers
  double factor = 16.0;         // rope_factor
  int64_t original_seq_len = 65536;
  double beta_fast = 32.0;
  double beta_slow = 1.0;
};

// The table parameters of a config's layers (spec section 2): compressed = the ratio > 0 layers'
// table (compress_rope_theta with YaRN), else the ratio-0 layers' (rope_theta, no YaRN). The one
// definition the CPU reference and the GPU stack both build their tables from.
RopeParams rope_params_for(const ModelConfig& c, bool compressed);

struct YarnBounds {
  int low = 0;
  int high = 0;
};

// low = max(floor(cd(beta_fast)), 0), high = min(ceil(cd(beta_slow)), 63), in double.
YarnBounds yarn_bounds(const RopeParams& p);

// The 32 inverse frequencies f_i in fp32, YaRN-corrected when p.yarn.
std::vector<float> rope_inv_freq(const RopeParams& p);

// fp32 [max_pos, 64]: (cos theta, sin theta) interleaved, theta = fp32(float(pos) * f_i),
// cos/sin evaluated in double on the fp32 angle and rounded to fp32.
std::vector<float> build_rope_table(const RopeParams& p, int64_t max_pos);

}  // namespace v4attn
