// CUPTI activity tracing of kernels (CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL, which keeps kernel
// concurrency intact), memcpys and memsets, as TraceRecords for the host-only report of
// include/v4attn/trace.h. Records come from CUpti_ActivityKernel10 / CUpti_ActivityMemcpy6 /
// CUpti_ActivityMemset4 (the versions of CUDA 13.0's cupti_activity.h); at graph replay their
// streamId is the stream the graph node actually ran on, and graphNodeId is set.
//
// One tracing session per process at a time (CUPTI's activity buffers are process-wide):
//   cupti_trace_start();
//   ... run ... (take cupti_timestamp_ns() between cycles to delimit them)
//   std::vector<TraceRecord> recs = cupti_trace_stop();
// Errors throw std::runtime_error (CUPTI) or CudaError (device synchronisation).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "v4attn/trace.h"

namespace v4attn {

struct CuptiTraceOptions {
  bool kernels = true;
  bool memcpy = true;
  bool memset = true;
  size_t buffer_bytes = size_t{8} << 20;  // per CUPTI activity buffer (multiple of 8)
};

// Enables the activity kinds and clears previously collected records. Throws std::logic_error if
// a session is active, std::runtime_error when CUPTI refuses (no GPU, another profiler attached).
void cupti_trace_start(const CuptiTraceOptions& options = {});
// Synchronises the device, forces CUPTI to hand over its buffers and returns (and forgets) the
// records collected so far, sorted by start; tracing continues.
std::vector<TraceRecord> cupti_trace_flush();
// Like flush, then disables the activity kinds. Records still in flight are included.
std::vector<TraceRecord> cupti_trace_stop();
bool cupti_trace_active();
// Records lost in the current / last session: dropped by CUPTI for lack of buffer space, or
// delivered without timestamps (they are not returned).
uint64_t cupti_trace_dropped_records();
// CUPTI's clock: the one of TraceRecord::start_ns / end_ns (cycle boundaries for
// split_cycles_by_time).
uint64_t cupti_timestamp_ns();

// Stops a session on scope exit if still active (records discarded); for exception paths.
class ScopedCuptiTrace {
 public:
  explicit ScopedCuptiTrace(const CuptiTraceOptions& options = {}) { cupti_trace_start(options); }
  ~ScopedCuptiTrace();
  ScopedCuptiTrace(const ScopedCuptiTrace&) = delete;
  ScopedCuptiTrace& operator=(const ScopedCuptiTrace&) = delete;
  std::vector<TraceRecord> stop() { return cupti_trace_stop(); }
};

}  // namespace v4attn
