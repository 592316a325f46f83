// CUPTI roles of the GPU prepare stack's kernels (include/v4attn/prepare/stack.h,
// make_stack_classifier): names for q_rope_store (and the fused Q chain) and the window-K write,
// order on the stream for the wq_b GEMM (its kernel is shared with the other fp8 GEMMs).
#include <algorithm>
#include <map>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "v4attn/prepare/stack.h"

namespace v4attn::prepare {

namespace {

bool contains(const std::string& s, const char* part) { return s.find(part) != std::string::npos; }

// The fused Q chain (kernels/qchain.h) ends with the layer's RoPE store: it takes q_rope_store's
// role, so that the per-layer figures (keyed on q_rope_store) count its layers too.
bool is_q_rope_store(const TraceRecord& r) {
  return r.kind == TraceKind::kKernel && (contains(r.name, "q_rope_store_kernel") || contains(r.name, "qchain_fused_kernel"));
}
bool is_window_k(const TraceRecord& r) {
  return r.kind == TraceKind::kKernel && contains(r.name, "window_k_store_kernel");
}
bool is_fp8_gemm(const TraceRecord& r) {
  // Every fp8 GEMM version: v1 (gemm_tc_kernel<true, ...>), v2 (gemm_fp8_wgmma_kernel), v0.
  return r.kind == TraceKind::kKernel && (contains(r.name, "gemm_tc_kernel<true") || contains(r.name, "gemm_tc_kernel<(bool)1") ||
                                          contains(r.name, "gemm_fp8_wgmma") || contains(r.name, "gemm_fp8_simple_kernel"));
}

using RecordKey = std::tuple<uint32_t, uint64_t, uint64_t, uint32_t, uint64_t>;
RecordKey key_of(const TraceRecord& r) { return {r.stream_id, r.start_ns, r.end_ns, r.correlation_id, r.graph_node_id}; }

}  // namespace

KernelClassifier make_stack_classifier(const std::vector<TraceRecord>& records) {
  std::map<uint32_t, std::vector<const TraceRecord*>> per_stream;
  for (const TraceRecord& r : records)
    if (r.kind == TraceKind::kKernel) per_stream[r.stream_id].push_back(&r);
  std::set<RecordKey> wqb;
  for (auto& [stream, recs] : per_stream) {
    std::stable_sort(recs.begin(), recs.end(), [](const TraceRecord* a, const TraceRecord* b) {
      return a->start_ns != b->start_ns ? a->start_ns < b->start_ns : a->end_ns < b->end_ns;
    });
    for (size_t i = 0; i < recs.size(); ++i) {
      if (!is_q_rope_store(*recs[i])) continue;
      for (size_t j = i; j-- > 0;) {
        if (is_q_rope_store(*recs[j])) break;  // the previous layer: this one's GEMM ran elsewhere
        if (is_fp8_gemm(*recs[j])) {
          wqb.insert(key_of(*recs[j]));
          break;
        }
      }
    }
  }
  return [wqb = std::move(wqb)](const TraceRecord& r) {
    if (is_q_rope_store(r)) return KernelRole::kQRopeStore;
    if (is_window_k(r)) return KernelRole::kWindowKWrite;
    if (is_fp8_gemm(r) && wqb.count(key_of(r)) != 0) return KernelRole::kWqbGemm;
    return KernelRole::kOther;
  };
}

}  // namespace v4attn::prepare
