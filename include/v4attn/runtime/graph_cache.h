// CUDA-graph cache for decode / target-verify cycles, keyed by (step kind, batch bucket rows).
//
// The cache stores graphs only. The caller owns every buffer the cycle touches: inputs are
// static buffers sized for the largest bucket, rewritten (cudaMemcpyAsync / kernels on the main
// stream) between replays; a replay for `rows` runs the graph captured for bucket_for(rows), so
// the caller pads rows..bucket-1 (e.g. out_cache_loc 0 / swa_loc -1) before launching.
//
// Typical use by the stack driver:
//   GraphCache graphs({1, 2, 4, 8}, {8, 16, 32, 64});
//   ... write this step's inputs into the static buffers on `main` ...
//   graphs.launch(StepKind::kVerify, rows, main, [&](cudaStream_t s, int bucket_rows) {
//     issue_cycle(lanes /* PrepareStreams borrowing s */, bucket_rows);  // captured, not run
//   });
// The capture callable is called once per (kind, bucket) (again after an invalidate); it must
// issue the whole cycle on `s` and leave every side stream joined (PrepareStreams joins per
// layer). Pointers it bakes into the graph must stay valid until the entry is invalidated.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <utility>
#include <vector>

namespace v4attn {

enum class StepKind : uint8_t { kDecode, kVerify };
const char* to_string(StepKind k);

// Issues one cycle on `main` for a batch of `bucket_rows` rows (called under stream capture).
using CaptureFn = std::function<void(cudaStream_t main, int bucket_rows)>;

class GraphCache {
 public:
  // Bucket row counts per kind; sorted and de-duplicated here; each must be > 0; a kind may
  // have no buckets (then every request for it is refused). Makes no CUDA call.
  GraphCache(std::vector<int> decode_buckets, std::vector<int> verify_buckets,
             cudaStreamCaptureMode mode = cudaStreamCaptureModeThreadLocal);
  // Destroys the graphs. The caller must not destroy the cache while a replay is in flight.
  ~GraphCache();
  GraphCache(const GraphCache&) = delete;
  GraphCache& operator=(const GraphCache&) = delete;

  const std::vector<int>& buckets(StepKind kind) const;
  // Smallest bucket >= rows. rows < 1: std::invalid_argument; rows above the largest bucket (or
  // no bucket for the kind): std::out_of_range naming both.
  int bucket_for(StepKind kind, int rows) const;

  // Captures + instantiates + uploads the graph for bucket_for(rows) if not cached (nothing
  // runs), then replays it on `main` with cudaGraphLaunch. Returns the bucket used. When
  // bucket_for throws, nothing is captured or launched. `main` must not be the legacy default
  // stream (capture needs a real stream).
  int launch(StepKind kind, int rows, cudaStream_t main, const CaptureFn& capture);
  // Only the capture / instantiate / upload part (warm-up); returns the bucket.
  int prepare(StepKind kind, int rows, cudaStream_t main, const CaptureFn& capture);

  bool contains(StepKind kind, int bucket_rows) const;
  size_t size() const { return entries_.size(); }
  // Number of captures done so far (counts re-captures after invalidation).
  size_t captures() const { return captures_; }
  // Nodes of a cached graph (kernel, memcpy, event ... nodes); 0 when not cached.
  size_t node_count(StepKind kind, int bucket_rows) const;

  // Drop graphs (weights reloaded, buffers re-allocated, schedule changed). The caller must make
  // sure no replay of a dropped graph is still in flight (synchronise its stream first).
  void invalidate();
  void invalidate(StepKind kind);
  void invalidate(StepKind kind, int bucket_rows);

 private:
  struct Entry {
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
  };
  using Key = std::pair<StepKind, int>;
  Entry& get_or_capture(StepKind kind, int bucket, cudaStream_t main, const CaptureFn& capture);
  static void destroy(Entry& e);

  std::vector<int> buckets_[2];
  cudaStreamCaptureMode mode_;
  std::map<Key, Entry> entries_;
  size_t captures_ = 0;
};

}  // namespace v4attn
