#include "v4attn/cycle_floor.h"

#include <algorithm>
#include <map>
#include <stdexcept>
#include <string>

#include "v4attn/cache_layout.h"

namespace v4attn {

CycleFloor prepare_cycle_floor(const ModelPlan& plan, const StepMeta& meta) {
  const ModelConfig& c = plan.config;
  if (meta.req.size() != static_cast<size_t>(meta.rows))
    throw std::invalid_argument("prepare_cycle_floor: step metadata has " + std::to_string(meta.req.size()) +
                                " requests for " + std::to_string(meta.rows) + " rows");
  CycleFloor f;
  const CacheLayout ik = cache_layout(CacheKind::kIndexK);
  const int64_t ik_token = ik.data_bytes + ik.scale_bytes;
  const int64_t kept = int64_t{c.candidate_topk_blocks} * c.candidate_block_size;
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
      if (l.uses_candidates) n = std::min(n, kept);
      int64_t& m = per_request[r];
      m = std::max(m, n);
    }
    for (const auto& [r, n] : per_request) f.index_k_bytes += n * ik_token;
  }
  return f;
}

std::optional<double> pytorch_reference_us(bool verify, int bs, int64_t context) {
  if (context != 65536) return std::nullopt;
  if (verify && bs == 1) return 5480.0;
  if (!verify && bs == 1) return 4880.0;
  if (!verify && bs == 32) return 7440.0;
  if (verify && bs == 4) return 6570.0;
  return std::nullopt;
}

}  // namespace v4attn
