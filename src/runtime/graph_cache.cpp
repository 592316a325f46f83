#include "v4attn/runtime/graph_cache.h"

#include <algorithm>
#include <stdexcept>
#include <string>

#include "runtime/cuda_utils.h"

namespace v4attn {

const char* to_string(StepKind k) {
  switch (k) {
    case StepKind::kDecode: return "decode";
    case StepKind::kVerify: return "verify";
  }
  return "?";
}

namespace {

int kind_index(StepKind k) {
  switch (k) {
    case StepKind::kDecode: return 0;
    case StepKind::kVerify: return 1;
  }
  throw std::invalid_argument("GraphCache: unknown step kind");
}

std::vector<int> normalised_buckets(std::vector<int> b, StepKind kind) {
  for (int r : b)
    if (r <= 0)
      throw std::invalid_argument(std::string("GraphCache: ") + to_string(kind) + " bucket of " + std::to_string(r) +
                                  " rows (buckets must be > 0)");
  std::sort(b.begin(), b.end());
  b.erase(std::unique(b.begin(), b.end()), b.end());
  return b;
}

}  // namespace

GraphCache::GraphCache(std::vector<int> decode_buckets, std::vector<int> verify_buckets, cudaStreamCaptureMode mode)
    : mode_(mode) {
  buckets_[0] = normalised_buckets(std::move(decode_buckets), StepKind::kDecode);
  buckets_[1] = normalised_buckets(std::move(verify_buckets), StepKind::kVerify);
}

GraphCache::~GraphCache() {
  for (auto& [key, e] : entries_) destroy(e);
}

void GraphCache::destroy(Entry& e) {
  if (e.exec) cudaGraphExecDestroy(e.exec);
  if (e.graph) cudaGraphDestroy(e.graph);
  e.exec = nullptr;
  e.graph = nullptr;
}

const std::vector<int>& GraphCache::buckets(StepKind kind) const { return buckets_[kind_index(kind)]; }

int GraphCache::bucket_for(StepKind kind, int rows) const {
  if (rows < 1)
    throw std::invalid_argument(std::string("GraphCache: ") + to_string(kind) + " step of " + std::to_string(rows) +
                                " rows (need >= 1)");
  const std::vector<int>& b = buckets(kind);
  const auto it = std::lower_bound(b.begin(), b.end(), rows);
  if (it == b.end())
    throw std::out_of_range(std::string("GraphCache: ") + to_string(kind) + " step of " + std::to_string(rows) +
                            " rows exceeds the largest bucket (" + (b.empty() ? std::string("none configured") : std::to_string(b.back())) +
                            "); nothing launched");
  return *it;
}

GraphCache::Entry& GraphCache::get_or_capture(StepKind kind, int bucket, cudaStream_t main, const CaptureFn& capture) {
  const Key key{kind, bucket};
  if (auto it = entries_.find(key); it != entries_.end()) return it->second;

  if (!capture) throw std::invalid_argument("GraphCache: empty capture callable");
  if (main == nullptr || main == cudaStreamLegacy || main == cudaStreamPerThread)
    throw std::invalid_argument("GraphCache: capture needs a created stream, not the default stream");
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  V4_CUDA_CHECK(cudaStreamIsCapturing(main, &status));
  if (status != cudaStreamCaptureStatusNone)
    throw std::logic_error("GraphCache: the main stream is already capturing (nested capture)");

  V4_CUDA_CHECK(cudaStreamBeginCapture(main, mode_));
  try {
    capture(main, bucket);
  } catch (...) {
    // End the capture so the stream is usable again; the partial graph is discarded.
    cudaGraph_t partial = nullptr;
    cudaStreamEndCapture(main, &partial);
    if (partial) cudaGraphDestroy(partial);
    cudaGetLastError();  // the failed end-capture is not the error the caller needs to see
    throw;
  }
  Entry e;
  cudaError_t err = cudaStreamEndCapture(main, &e.graph);
  if (err != cudaSuccess) {
    if (e.graph) cudaGraphDestroy(e.graph);
    cudaGetLastError();
    throw_cuda_error(err, "cudaStreamEndCapture (a side stream not joined back, or an API call illegal during capture)",
                     __FILE__, __LINE__);
  }
  // Node priorities honoured: a kernel node carries its stream's priority (launch_kernel passes it
  // explicitly), but a graph instantiated without this flag runs every node at the priority of the
  // stream it is launched into, so that GpuStackOptions::side_priority had no effect on graph
  // replays (perf.md session 22 run 7: with the flag, side lanes at -1 measured +1.3 .. +2.6 %;
  // with every priority at the default the flag changes nothing).
  err = cudaGraphInstantiate(&e.exec, e.graph, cudaGraphInstantiateFlagUseNodePriority);
  if (err != cudaSuccess) {
    destroy(e);
    throw_cuda_error(err, "cudaGraphInstantiate", __FILE__, __LINE__);
  }
  // Uploading now moves the one-time setup out of the first replay.
  err = cudaGraphUpload(e.exec, main);
  if (err != cudaSuccess) {
    destroy(e);
    throw_cuda_error(err, "cudaGraphUpload", __FILE__, __LINE__);
  }
  ++captures_;
  return entries_.emplace(key, e).first->second;
}

int GraphCache::prepare(StepKind kind, int rows, cudaStream_t main, const CaptureFn& capture) {
  const int bucket = bucket_for(kind, rows);
  get_or_capture(kind, bucket, main, capture);
  return bucket;
}

int GraphCache::launch(StepKind kind, int rows, cudaStream_t main, const CaptureFn& capture) {
  const int bucket = bucket_for(kind, rows);
  Entry& e = get_or_capture(kind, bucket, main, capture);
  V4_CUDA_CHECK(cudaGraphLaunch(e.exec, main));
  return bucket;
}

bool GraphCache::contains(StepKind kind, int bucket_rows) const { return entries_.count({kind, bucket_rows}) != 0; }

size_t GraphCache::node_count(StepKind kind, int bucket_rows) const {
  const auto it = entries_.find({kind, bucket_rows});
  if (it == entries_.end()) return 0;
  size_t n = 0;
  V4_CUDA_CHECK(cudaGraphGetNodes(it->second.graph, nullptr, &n));
  return n;
}

void GraphCache::invalidate() {
  for (auto& [key, e] : entries_) destroy(e);
  entries_.clear();
}

void GraphCache::invalidate(StepKind kind) {
  for (auto it = entries_.begin(); it != entries_.end();) {
    if (it->first.first == kind) {
      destroy(it->second);
      it = entries_.erase(it);
    } else {
      ++it;
    }
  }
}

void GraphCache::invalidate(StepKind kind, int bucket_rows) {
  const auto it = entries_.find({kind, bucket_rows});
  if (it == entries_.end()) return;
  destroy(it->second);
  entries_.erase(it);
}

}  // namespace v4attn
