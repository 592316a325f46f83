#include "v4attn/cycle_floor.h"

#include <algorithm>
#include <cstdint>
#include <map>
#include <stdexcept>
#include <string>

#include "v4attn/cache_layout.h"
#include "v4attn/config.h"

namespace v4attn {

CycleFloor prepare_cycle_floor(const ModelPlan& plan, const StepMeta& meta) {
  const ModelConfig& c = plan.config;
  if (meta.req.size() != static_cast<size_t>(meta.rows))
    throw std::invalid_argument("prepare_cycle_floor: step metadata has " + std::to_string(meta.req.size()) +
                                " requests for " + std::to_string(meta.rows) + " rows");
  CycleFloor f;
  const CacheLayout ik = cache_layout(CacheKind::kIndexK);
  const int64_t ik_token = ik.data_bytes + ik.scale_bytes;
  const int64_t K = c.candidate_topk_blocks, B = c.candidate_block_size;
  // Positions a masked row can score: all of them while its blocks fit the budget, else K - 1 full
  // blocks and the newest one (always kept: pinned to +inf), which may be partial.
  const auto kept_positions = [&](int64_t n) {
    return (n + B - 1) / B <= K ? n : (K - 1) * B + ((n - 1) % B + 1);
  };
  for (const LayerPlan& l : plan.layers) {
    if (l.layer >= c.n_layers) continue;  // draft stages are not in the cycle
    f.weight_bytes += l.prepare_weight_bytes();
    if (!l.is_index_source) continue;
    const int ratio = plan.layers[static_cast<size_t>(l.kv_src)].ratio;
    const std::vector<int32_t>& clen = meta.clen[ratio];
    if (clen.size() != static_cast<size_t>(meta.rows))
      throw std::invalid_argument("prepare_cycle_floor: step metadata has no ratio-" + std::to_string(ratio) + " clen");
    std::map<int32_t, int64_t> per_request;  // request -> positions its rows score
    for (int t = 0; t < meta.rows; ++t) {
      const int32_t r = meta.req[static_cast<size_t>(t)];
      if (r < 0) continue;
      int64_t n = std::max<int32_t>(clen[static_cast<size_t>(t)], 0);
      if (l.uses_candidates) n = kept_positions(n);
      int64_t& m = per_request[r];
      m = std::max(m, n);
    }
    for (const auto& [r, n] : per_request) f.index_k_bytes += n * ik_token;
  }
  return f;
}

CycleFloor prepare_cycle_floor(const ModelPlan& plan, bool verify, int bs, int64_t context) {
  const int v = verify ? plan.config.dspark_block_size + 1 : 1;
  if (bs < 1 || context < 0 || context + v > INT32_MAX)
    throw std::invalid_argument("prepare_cycle_floor: bs must be >= 1 and context in [0, 2^31 - rows)");
  // Only what prepare_cycle_floor reads: rows, requests, clen. Every request's rows are alike, so one
  // request stands for all and its bytes are multiplied.
  StepMeta one;
  one.rows = v;
  for (int i = 0; i < v; ++i) {
    const int64_t pos = context + i;
    one.req.push_back(0);
    one.clen[1].push_back(static_cast<int32_t>(pos + 1));
    one.clen[2].push_back(static_cast<int32_t>((pos + 1) / 2));
  }
  CycleFloor f = prepare_cycle_floor(plan, one);
  f.index_k_bytes *= bs;
  return f;
}

std::optional<double> pytorch_reference_us(const ModelPlan& plan, bool verify, int bs, int64_t context) {
  if (context != 65536 || plan.parallel.tp != 1) return std::nullopt;
  static const std::string released = config_to_json(load_config(""));
  if (config_to_json(plan.config) != released) return std::nullopt;
  if (verify && bs == 1) return 5480.0;
  if (!verify && bs == 1) return 4880.0;
  if (!verify && bs == 32) return 7440.0;
  if (verify && bs == 4) return 6570.0;
  return std::nullopt;
}

}  // namespace v4attn
