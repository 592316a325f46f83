// CUPTI activity tracing -> TraceRecord. CUPTI hands filled buffers to buffer_completed (on its
// own thread, or on the thread calling cuptiActivityFlushAll); records are converted there under
// a mutex and kept until flush / stop hands them out.
#include "v4attn/runtime/cupti_trace.h"

#include <cupti.h>
#include <cxxabi.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <string>
#include <unordered_map>

#include "runtime/cuda_utils.h"

namespace v4attn {

namespace {

struct TraceState {
  std::mutex mu;
  std::vector<TraceRecord> records;                   // guarded by mu
  std::unordered_map<const char*, std::string> names;  // demangle cache, guarded by mu
  uint64_t dropped = 0;                               // guarded by mu
  std::atomic<size_t> buffer_bytes{size_t{8} << 20};
  bool active = false;  // touched only by the API functions (one controlling thread)
  std::vector<CUpti_ActivityKind> enabled;
};

TraceState& state() {
  static TraceState s;
  return s;
}

void check_cupti(CUptiResult r, const char* what) {
  if (r == CUPTI_SUCCESS) return;
  const char* msg = nullptr;
  if (cuptiGetResultString(r, &msg) != CUPTI_SUCCESS || !msg) msg = "unknown CUPTI error";
  throw std::runtime_error(std::string("CUPTI error in ") + what + ": " + msg);
}

// CUPTI shares one name string among all records of a kernel, so demangling is cached by the
// pointer. Called with state().mu held.
const std::string& kernel_name(const char* mangled) {
  auto& names = state().names;
  if (!mangled) {
    static const std::string unknown = "<unknown kernel>";
    return unknown;
  }
  if (auto it = names.find(mangled); it != names.end()) return it->second;
  int status = 0;
  char* demangled = abi::__cxa_demangle(mangled, nullptr, nullptr, &status);
  std::string name = (status == 0 && demangled) ? std::string(demangled) : std::string(mangled);
  std::free(demangled);
  return names.emplace(mangled, std::move(name)).first->second;
}

const char* memcpy_kind_name(uint8_t k) {
  switch (k) {
    case CUPTI_ACTIVITY_MEMCPY_KIND_HTOD: return "memcpy HtoD";
    case CUPTI_ACTIVITY_MEMCPY_KIND_DTOH: return "memcpy DtoH";
    case CUPTI_ACTIVITY_MEMCPY_KIND_DTOD: return "memcpy DtoD";
    case CUPTI_ACTIVITY_MEMCPY_KIND_HTOH: return "memcpy HtoH";
    case CUPTI_ACTIVITY_MEMCPY_KIND_PTOP: return "memcpy PtoP";
    default: return "memcpy (array)";
  }
}

void CUPTIAPI buffer_requested(uint8_t** buffer, size_t* size, size_t* max_records) {
  const size_t bytes = state().buffer_bytes.load();
  // CUPTI requires 8-byte aligned buffers; aligned_alloc needs a size multiple of the alignment.
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(8, bytes));
  *size = *buffer ? bytes : 0;
  *max_records = 0;  // as many as fit
}

// A C callback: must not throw.
void CUPTIAPI buffer_completed(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid_size) {
  TraceState& st = state();
  std::vector<TraceRecord> parsed;
  uint64_t no_timestamp = 0;
  try {
    std::lock_guard<std::mutex> lock(st.mu);
    CUpti_Activity* rec = nullptr;
    while (buffer && cuptiActivityGetNextRecord(buffer, valid_size, &rec) == CUPTI_SUCCESS) {
      TraceRecord t;
      switch (rec->kind) {
        case CUPTI_ACTIVITY_KIND_KERNEL:
        case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL: {
          const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(rec);
          t.kind = TraceKind::kKernel;
          t.name = kernel_name(k->name);
          t.device_id = k->deviceId;
          t.stream_id = k->streamId;
          t.graph_id = k->graphId;
          t.graph_node_id = k->graphNodeId;
          t.correlation_id = k->correlationId;
          t.start_ns = k->start;
          t.end_ns = k->end;
          break;
        }
        case CUPTI_ACTIVITY_KIND_MEMCPY: {
          const auto* m = reinterpret_cast<const CUpti_ActivityMemcpy6*>(rec);
          t.kind = TraceKind::kMemcpy;
          t.name = memcpy_kind_name(m->copyKind);
          t.device_id = m->deviceId;
          t.stream_id = m->streamId;
          t.graph_id = m->graphId;
          t.graph_node_id = m->graphNodeId;
          t.correlation_id = m->correlationId;
          t.start_ns = m->start;
          t.end_ns = m->end;
          t.bytes = m->bytes;
          break;
        }
        case CUPTI_ACTIVITY_KIND_MEMSET: {
          const auto* m = reinterpret_cast<const CUpti_ActivityMemset4*>(rec);
          t.kind = TraceKind::kMemset;
          t.name = "memset";
          t.device_id = m->deviceId;
          t.stream_id = m->streamId;
          t.graph_id = m->graphId;
          t.graph_node_id = m->graphNodeId;
          t.correlation_id = m->correlationId;
          t.start_ns = m->start;
          t.end_ns = m->end;
          t.bytes = m->bytes;
          break;
        }
        default:
          continue;  // a kind we did not enable
      }
      // Zero timestamps: CUPTI could not time the activity (lack of device memory).
      if (t.start_ns == 0 && t.end_ns == 0) {
        ++no_timestamp;
        continue;
      }
      parsed.push_back(std::move(t));
    }
    size_t dropped = 0;
    if (cuptiActivityGetNumDroppedRecords(nullptr, 0, &dropped) != CUPTI_SUCCESS) dropped = 0;
    st.dropped += dropped + no_timestamp;
    st.records.insert(st.records.end(), std::make_move_iterator(parsed.begin()), std::make_move_iterator(parsed.end()));
  } catch (...) {
    // Out of memory while converting: the records of this buffer are lost; nothing to report to.
  }
  std::free(buffer);
}

void register_callbacks_once() {
  static std::once_flag once;
  static CUptiResult result = CUPTI_SUCCESS;
  std::call_once(once, [] { result = cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed); });
  check_cupti(result, "cuptiActivityRegisterCallbacks");
}

std::vector<TraceRecord> take_records() {
  TraceState& st = state();
  std::vector<TraceRecord> out;
  {
    std::lock_guard<std::mutex> lock(st.mu);
    out.swap(st.records);
  }
  std::stable_sort(out.begin(), out.end(), [](const TraceRecord& a, const TraceRecord& b) { return a.start_ns < b.start_ns; });
  return out;
}

void disable_enabled_kinds() {
  for (CUpti_ActivityKind k : state().enabled) cuptiActivityDisable(k);
  state().enabled.clear();
}

}  // namespace

void cupti_trace_start(const CuptiTraceOptions& options) {
  TraceState& st = state();
  if (st.active) throw std::logic_error("cupti_trace_start: a tracing session is already active");
  if (options.buffer_bytes < 4096 || options.buffer_bytes % 8 != 0)
    throw std::invalid_argument("cupti_trace_start: buffer_bytes must be >= 4096 and a multiple of 8");
  register_callbacks_once();
  st.buffer_bytes.store(options.buffer_bytes);
  {
    std::lock_guard<std::mutex> lock(st.mu);
    st.records.clear();
    st.dropped = 0;
  }
  std::vector<CUpti_ActivityKind> kinds;
  if (options.kernels) kinds.push_back(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL);
  if (options.memcpy) kinds.push_back(CUPTI_ACTIVITY_KIND_MEMCPY);
  if (options.memset) kinds.push_back(CUPTI_ACTIVITY_KIND_MEMSET);
  if (kinds.empty()) throw std::invalid_argument("cupti_trace_start: no activity kind selected");
  for (CUpti_ActivityKind k : kinds) {
    const CUptiResult r = cuptiActivityEnable(k);
    if (r != CUPTI_SUCCESS) {
      disable_enabled_kinds();
      check_cupti(r, "cuptiActivityEnable");
    }
    st.enabled.push_back(k);
  }
  st.active = true;
}

std::vector<TraceRecord> cupti_trace_flush() {
  if (!state().active) throw std::logic_error("cupti_trace_flush: no tracing session is active");
  // Records of unfinished work would come back without timestamps: wait for the device first.
  V4_CUDA_CHECK(cudaDeviceSynchronize());
  check_cupti(cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED), "cuptiActivityFlushAll");
  return take_records();
}

std::vector<TraceRecord> cupti_trace_stop() {
  TraceState& st = state();
  if (!st.active) throw std::logic_error("cupti_trace_stop: no tracing session is active");
  st.active = false;
  const cudaError_t sync = cudaDeviceSynchronize();
  disable_enabled_kinds();
  const CUptiResult flushed = cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
  std::vector<TraceRecord> out = take_records();
  if (sync != cudaSuccess) throw_cuda_error(sync, "cudaDeviceSynchronize (cupti_trace_stop)", __FILE__, __LINE__);
  check_cupti(flushed, "cuptiActivityFlushAll");
  return out;
}

bool cupti_trace_active() { return state().active; }

uint64_t cupti_trace_dropped_records() {
  std::lock_guard<std::mutex> lock(state().mu);
  return state().dropped;
}

uint64_t cupti_timestamp_ns() {
  uint64_t t = 0;
  check_cupti(cuptiGetTimestamp(&t), "cuptiGetTimestamp");
  return t;
}

ScopedCuptiTrace::~ScopedCuptiTrace() {
  if (!cupti_trace_active()) return;
  try {
    cupti_trace_stop();
  } catch (...) {
    // Destructor on an error path: the session is off either way (stop clears `active` first).
  }
}

}  // namespace v4attn
