#include "v4attn/rope_table.h"

#include <algorithm>
#include <cmath>
#include <numbers>
#include <stdexcept>

#include "v4attn/config.h"
#include "v4attn/numerics.h"

namespace v4attn {

RopeParams rope_params_for(const ModelConfig& c, bool compressed) {
  RopeParams p;
  p.base = compressed ? c.compress_rope_theta : c.rope_theta;
  p.yarn = compressed;
  p.factor = c.rope_factor;
  p.original_seq_len = c.original_seq_len;
  p.beta_fast = c.beta_fast;
  p.beta_slow = c.beta_slow;
  return p;
}

YarnBounds yarn_bounds(const RopeParams& p) {
  const double dim = 64.0;
  auto correction_dim = [&](double n) {
    return dim * std::log(static_cast<double>(p.original_seq_len) / (n * 2.0 * std::numbers::pi)) /
           (2.0 * std::log(p.base));
  };
  YarnBounds b;
  b.low = std::max(static_cast<int>(std::floor(correction_dim(p.beta_fast))), 0);
  b.high = std::min(static_cast<int>(std::ceil(correction_dim(p.beta_slow))), 63);
  return b;
}

std::vector<float> rope_inv_freq(const RopeParams& p) {
  using namespace num;
  std::vector<float> f(kRopePairs);
  for (int i = 0; i < kRopePairs; ++i) {
    const float e = static_cast<float>(2 * i) / 64.0f;  // exact
    // pow in double, rounded once to fp32; then the reciprocal in fp32.
    const float pw = static_cast<float>(std::pow(p.base, static_cast<double>(e)));
    f[i] = div_rn(1.0f, pw);
  }
  if (p.yarn) {
    const YarnBounds b = yarn_bounds(p);
    const float factor = static_cast<float>(p.factor);
    const float span = max_f(static_cast<float>(b.high - b.low), 1e-3f);
    for (int i = 0; i < kRopePairs; ++i) {
      const float ramp = clamp_f(div_rn(static_cast<float>(i - b.low), span), 0.0f, 1.0f);
      const float smooth = sub_rn(1.0f, ramp);
      f[i] = add_rn(mul_rn(div_rn(f[i], factor), sub_rn(1.0f, smooth)), mul_rn(f[i], smooth));
    }
  }
  return f;
}

std::vector<float> build_rope_table(const RopeParams& p, int64_t max_pos) {
  if (max_pos <= 0) throw std::invalid_argument("build_rope_table: max_pos must be positive");
  const std::vector<float> f = rope_inv_freq(p);
  std::vector<float> table(static_cast<size_t>(max_pos) * num::kRopeDim);
  for (int64_t pos = 0; pos < max_pos; ++pos) {
    float* row = table.data() + pos * num::kRopeDim;
    for (int i = 0; i < num::kRopePairs; ++i) {
      const float theta = num::mul_rn(static_cast<float>(pos), f[i]);
      row[2 * i] = static_cast<float>(std::cos(static_cast<double>(theta)));
      row[2 * i + 1] = static_cast<float>(std::sin(static_cast<double>(theta)));
    }
  }
  return table;
}

}  // namespace v4attn
