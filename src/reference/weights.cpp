// Deterministic synthetic layer weights (weights.h).
//
// Generator: counter-based. Every element (tensor, global row, global column) gets its value from
// a splitmix64 mix of (seed, layer, tensor-name hash, row, column / 4), so the bytes do not depend
// on thread count or generation order, different layers and tensors differ, and a tensor-parallel
// shard would be the matching slice of the tp = 1 tensor. One 64-bit draw gives four 16-bit
// indices into a table of normal quantiles (a discretised N(0, 1)). That keeps a full-size V4.1
// layer (~140 M values) at a fraction of a second on two cores.
#include "v4attn/reference/weights.h"

#include <algorithm>
#include <cmath>
#include <exception>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "reference/ref_internal.h"

namespace v4attn::ref {
namespace {

constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ull;

uint64_t mix64(uint64_t z) {  // splitmix64 finaliser
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

uint64_t fnv1a(std::string_view s) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (char c : s) {
    h ^= static_cast<uint8_t>(c);
    h *= 0x100000001b3ull;
  }
  return h;
}

// Key of one tensor of one layer.
uint64_t tensor_key(uint64_t seed, int64_t layer, std::string_view name) {
  return mix64(mix64(seed + kGolden) ^ mix64(static_cast<uint64_t>(layer) * kGolden + 0x1234567ull) ^ fnv1a(name));
}

// Standard-normal quantiles at the 2^16 midpoints (i + 0.5) / 2^16, in fp32: one 16-bit uniform
// indexes a sample (a discretised N(0, 1), tails at +-4.3). Newton on erfc in double, from the
// logistic approximation; the table is the same on every machine up to libm's erfc/exp, which
// are accurate far beyond the fp32 rounding of the result.
const std::vector<float>& normal_quantiles() {
  static const std::vector<float> table = [] {
    std::vector<float> t(65536);
    for (int i = 0; i < 32768; ++i) {  // lower half; the upper half mirrors it (exactly symmetric)
      const double p = (i + 0.5) / 65536.0;
      double lo = -6.0, hi = 0.0;  // the quantile is in (-4.4, 0): a bracket for safeguarded Newton
      double x = std::max(lo, std::log(p / (1.0 - p)) / 1.702);  // logistic approximation
      for (int it = 0; it < 100; ++it) {
        const double f = 0.5 * std::erfc(-x / std::sqrt(2.0)) - p;
        if (f < 0) lo = x; else hi = x;
        const double pdf = std::exp(-0.5 * x * x) / std::sqrt(2.0 * 3.14159265358979323846);
        double next = x - f / pdf;
        if (!(next > lo && next < hi)) next = 0.5 * (lo + hi);  // Newton left the bracket: bisect
        if (std::fabs(next - x) < 1e-14) break;
        x = next;
      }
      t[static_cast<size_t>(i)] = static_cast<float>(x);
      t[static_cast<size_t>(65535 - i)] = -static_cast<float>(x);
    }
    return t;
  }();
  return table;
}

// Four N(0,1) samples for columns 4*quad .. 4*quad+3 of `row`: one 64-bit draw, four 16-bit
// quantile indices.
void normal4(const std::vector<float>& q, uint64_t key, int64_t row, int64_t quad, float out[4]) {
  const uint64_t bits = mix64(key ^ mix64(static_cast<uint64_t>(row) * kGolden + static_cast<uint64_t>(quad)));
  for (int i = 0; i < 4; ++i) out[i] = q[static_cast<size_t>((bits >> (16 * i)) & 0xffffu)];
}

// Row `row` (global index) of a tensor: k values, sample * scale.
void fill_row(uint64_t key, int64_t row, int64_t k, float scale, float* out) {
  const std::vector<float>& nq = normal_quantiles();
  float q[4];
  for (int64_t c = 0; c < k; c += 4) {
    normal4(nq, key, row, c / 4, q);
    for (int i = 0; i < 4 && c + i < k; ++i) out[c + i] = num::mul_rn(q[i], scale);
  }
}

// Runs body(i) for i in [0, count) on two threads (interleaved chunks; results are per-index).
template <class Body>
void parallel_for(int64_t count, Body body) {
  const unsigned hw = std::max(1u, std::thread::hardware_concurrency());
  const int threads = static_cast<int>(std::min<int64_t>({2, static_cast<int64_t>(hw), count}));
  if (threads <= 1) {
    for (int64_t i = 0; i < count; ++i) body(i);
    return;
  }
  std::exception_ptr error;
  std::thread other([&] {
    try {
      for (int64_t i = count / 2; i < count; ++i) body(i);
    } catch (...) {
      error = std::current_exception();
    }
  });
  std::exception_ptr own_error;
  try {
    for (int64_t i = 0; i < count / 2; ++i) body(i);
  } catch (...) {
    own_error = std::current_exception();
  }
  other.join();  // always joined: a joinable std::thread must not be destroyed
  if (own_error) std::rethrow_exception(own_error);
  if (error) std::rethrow_exception(error);
}

// N(0,1)/sqrt(k) weights quantised to fp8 32x32 blocks, generated one 32-row strip at a time.
Fp8Matrix synth_fp8(uint64_t seed, int layer, std::string_view name, int64_t n, int64_t k) {
  Fp8Matrix m;
  m.n = n;
  m.k = k;
  m.w.resize(static_cast<size_t>(n * k));
  const int64_t strips = (n + 31) / 32;
  m.scale.resize(static_cast<size_t>(strips * (k / 32)));
  const uint64_t key = tensor_key(seed, layer, name);
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(k)));
  parallel_for(strips, [&](int64_t s) {
    const int64_t r0 = s * 32, rows = std::min<int64_t>(32, n - r0);
    thread_local std::vector<float> strip;  // reused: a fresh 1 MB buffer per strip costs page faults
    strip.resize(static_cast<size_t>(rows * k));
    for (int64_t r = 0; r < rows; ++r) fill_row(key, r0 + r, k, scale, strip.data() + r * k);
    quantize_fp8_strip(strip.data(), rows, k, m.w.data() + r0 * k, m.scale.data() + s * (k / 32));
  });
  return m;
}

Bf16Matrix synth_bf16(uint64_t seed, int layer, std::string_view name, int64_t n, int64_t k) {
  Bf16Matrix m;
  m.n = n;
  m.k = k;
  m.w.resize(static_cast<size_t>(n * k));
  const uint64_t key = tensor_key(seed, layer, name);
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(k)));
  parallel_for(n, [&](int64_t r) {
    thread_local std::vector<float> row;
    row.resize(static_cast<size_t>(k));
    fill_row(key, r, k, scale, row.data());
    for (int64_t c = 0; c < k; ++c) m.w[static_cast<size_t>(r * k + c)] = num::bf16_from_f32(row[c]);
  });
  return m;
}

F32Matrix synth_f32(uint64_t seed, int layer, std::string_view name, int64_t n, int64_t k) {
  F32Matrix m;
  m.n = n;
  m.k = k;
  m.w.resize(static_cast<size_t>(n * k));
  const uint64_t key = tensor_key(seed, layer, name);
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(k)));
  parallel_for(n, [&](int64_t r) { fill_row(key, r, k, scale, m.w.data() + r * k); });
  return m;
}

// Norm weights: 1 +- 0.1 (uniform), rounded to bf16-representable fp32 values.
std::vector<float> synth_norm(uint64_t seed, int layer, std::string_view name, int64_t n) {
  std::vector<float> w(static_cast<size_t>(n));
  const uint64_t key = tensor_key(seed, layer, name);
  for (int64_t i = 0; i < n; ++i) {
    const uint64_t bits = mix64(key ^ mix64(static_cast<uint64_t>(i) + kGolden));
    const float u = static_cast<float>(bits >> 40) * (1.0f / 16777216.0f);  // [0, 1), 24 bits: exact
    w[static_cast<size_t>(i)] = num::round_bf16(1.0f + 0.2f * (u - 0.5f));
  }
  return w;
}

std::vector<float> synth_vector(uint64_t seed, int layer, std::string_view name, int64_t n) {
  std::vector<float> v(static_cast<size_t>(n));
  fill_row(tensor_key(seed, layer, name), 0, n, 1.0f, v.data());
  return v;
}

int checked_div(int a, int b, const char* what) {
  if (b <= 0 || a % b != 0)
    throw std::invalid_argument(std::string("make_synthetic_layer_weights: ") + what + " (" + std::to_string(a) +
                                ") is not divisible by tp " + std::to_string(b));
  return a / b;
}

// The plan's weight list (plan.h) names every tensor of the layer with its local shape: the
// generated tensors must have exactly those shapes (names the plan has and we do not generate
// are not ours to check).
void check_against_plan(const LayerWeights& w, const LayerPlan& lp) {
  auto shape_of = [&](const std::string& name, std::vector<int64_t>& shape) -> bool {
    auto fp8 = [&](const Fp8Matrix& m, bool scale) {
      shape = scale ? std::vector<int64_t>{(m.n + 31) / 32, m.k / 32} : std::vector<int64_t>{m.n, m.k};
    };
    const bool is_scale = name.size() > 6 && name.compare(name.size() - 6, 6, ".scale") == 0;
    const std::string base = is_scale ? name.substr(0, name.size() - 6) : name;
    const auto& c = w.compressor;
    const auto& ix = w.indexer;
    if (base == "wqkv_a") fp8(w.wqkv_a, is_scale);
    else if (base == "wq_b") fp8(w.wq_b, is_scale);
    else if (base == "wo_b") fp8(w.wo_b, is_scale);
    else if (base == "indexer.wq_b" && ix) fp8(ix->wq_b, is_scale);
    else if (is_scale) return false;
    else if (name == "q_norm") shape = {static_cast<int64_t>(w.q_norm.size())};
    else if (name == "kv_norm") shape = {static_cast<int64_t>(w.kv_norm.size())};
    else if (name == "attn_sink") shape = {static_cast<int64_t>(w.attn_sink.size())};
    else if (name == "wo_a") shape = {w.wo_a.n, w.wo_a.k};
    else if (name == "indexer.weights_proj" && ix) shape = {ix->weights_proj.n, ix->weights_proj.k};
    else if (name == "compressor.wkv" && c) shape = c->ratio == 1 ? std::vector<int64_t>{c->wkv_c.n, c->wkv_c.k}
                                                                 : std::vector<int64_t>{c->wkv.n, c->wkv.k};
    else if (name == "compressor.wgate" && c) shape = {c->wgate.n, c->wgate.k};
    else if (name == "compressor.norm" && c) shape = {static_cast<int64_t>(c->c_norm.size())};
    else if (name == "compressor.wk" && c) shape = {c->wk.n, c->wk.k};
    else if (name == "compressor.k_norm" && c) shape = {static_cast<int64_t>(c->k_norm.size())};
    else return false;
    return true;
  };
  for (const WeightSpec& spec : lp.weights) {
    std::vector<int64_t> shape;
    if (!shape_of(spec.name, shape)) continue;
    if (shape != spec.shape)
      throw std::logic_error("make_synthetic_layer_weights: layer " + std::to_string(lp.layer) + " tensor " + spec.name +
                             " does not have the plan's shape");
  }
}

}  // namespace

LayerWeights make_synthetic_layer_weights(const ModelPlan& plan, int layer, uint64_t seed) {
  const ModelConfig& cfg = plan.config;
  if (layer < 0 || layer >= static_cast<int>(plan.layers.size()))
    throw std::invalid_argument("make_synthetic_layer_weights: layer " + std::to_string(layer) + " is not in the plan (" +
                                std::to_string(plan.layers.size()) + " layers)");
  const LayerPlan& lp = plan.layers[static_cast<size_t>(layer)];
  const int tp = std::max(1, plan.parallel.tp);
  const int heads = plan.parallel.local_heads > 0 ? plan.parallel.local_heads : checked_div(cfg.n_heads, tp, "n_heads");
  const int index_heads = plan.parallel.local_index_heads > 0 ? plan.parallel.local_index_heads
                                                              : checked_div(cfg.index_n_heads, tp, "index_n_heads");
  const int groups = plan.parallel.local_groups > 0 ? plan.parallel.local_groups : checked_div(cfg.o_groups, tp, "o_groups");
  const int64_t dim = cfg.dim, hd = cfg.head_dim, qr = cfg.q_lora_rank;
  if (dim % 32 != 0 || qr % 32 != 0 || hd != 512 || cfg.rope_head_dim != 64)
    throw std::invalid_argument("make_synthetic_layer_weights: dim and q_lora_rank must be multiples of 32, head_dim 512, rope 64");

  LayerWeights w;
  w.layer = lp.layer;
  w.wqkv_a = synth_fp8(seed, layer, "wqkv_a", qr + hd, dim);
  w.q_norm = synth_norm(seed, layer, "q_norm", qr);
  w.wq_b = synth_fp8(seed, layer, "wq_b", heads * hd, qr);
  w.kv_norm = synth_norm(seed, layer, "kv_norm", hd);
  if (lp.is_kv_source) {
    CompressorWeights c;
    c.ratio = lp.ratio;
    if (lp.ratio == 1) {
      c.wkv_c = synth_bf16(seed, layer, "compressor.wkv", hd, dim);
    } else if (lp.ratio == 2) {
      c.wkv = synth_f32(seed, layer, "compressor.wkv", hd, dim);
      c.wgate = synth_f32(seed, layer, "compressor.wgate", hd, dim);
    } else {
      throw std::invalid_argument("make_synthetic_layer_weights: kv source layer " + std::to_string(layer) +
                                  " has ratio " + std::to_string(lp.ratio) + " (must be 1 or 2)");
    }
    c.c_norm = synth_norm(seed, layer, "compressor.norm", hd);
    c.wk = synth_bf16(seed, layer, "compressor.wk", cfg.index_head_dim, hd);
    c.k_norm = synth_norm(seed, layer, "compressor.k_norm", cfg.index_head_dim);
    w.compressor = std::move(c);
  }
  if (lp.is_index_source) {
    IndexerWeights ix;
    ix.wq_b = synth_fp8(seed, layer, "indexer.wq_b", static_cast<int64_t>(index_heads) * cfg.index_head_dim, qr);
    ix.weights_proj = synth_bf16(seed, layer, "indexer.weights_proj", index_heads, dim);
    w.indexer = std::move(ix);
  }
  w.attn_sink = synth_vector(seed, layer, "attn_sink", heads);
  const int64_t heads_per_group = cfg.n_heads / cfg.o_groups;
  w.wo_a = synth_bf16(seed, layer, "wo_a", static_cast<int64_t>(groups) * cfg.o_lora_rank, heads_per_group * hd);
  w.wo_b = synth_fp8(seed, layer, "wo_b", dim, static_cast<int64_t>(groups) * cfg.o_lora_rank);
  check_against_plan(w, lp);
  return w;
}

std::vector<num::bf16_t> synthetic_bf16(size_t n, uint64_t seed, float scale) {
  std::vector<num::bf16_t> out(n);
  const uint64_t key = tensor_key(seed, -1, "synthetic_bf16");
  const std::vector<float>& nq = normal_quantiles();
  float q[4];
  for (size_t c = 0; c < n; c += 4) {
    normal4(nq, key, 0, static_cast<int64_t>(c / 4), q);
    for (size_t i = 0; i < 4 && c + i < n; ++i) out[c + i] = num::bf16_from_f32(q[i] * scale);
  }
  return out;
}

}  // namespace v4attn::ref
