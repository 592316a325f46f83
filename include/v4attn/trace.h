// GPU activity records (filled by the CUPTI tracer of the GPU library,
// include/v4attn/runtime/cupti_trace.h) and the host-only report over them: per cycle, how many
// streams ran, on which lane each layer's window-K write ran relative to q_rope_store, the
// per-layer time (median spacing of q_rope_store starts), the wq_b GEMM end -> q_rope_store start
// gap (negative when PDL launches q_rope_store early), kernel counts; a text table with one
// column per schedule, JSON, and a Chrome / Perfetto trace of one cycle.
//
// No CUDA here: this lives in the host library so reports can be built and tested anywhere.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <string_view>
#include <vector>

namespace v4attn {

enum class TraceKind : uint8_t { kKernel, kMemcpy, kMemset };
const char* to_string(TraceKind k);

struct TraceRecord {
  TraceKind kind = TraceKind::kKernel;
  std::string name;            // kernel: demangled name; memcpy: "memcpy HtoD" ...; memset: "memset"
  uint32_t device_id = 0;
  uint32_t stream_id = 0;      // CUPTI stream id; at graph replay, the stream the node ran on
  uint32_t graph_id = 0;       // 0: not launched from a graph
  uint64_t graph_node_id = 0;  // 0: not launched from a graph
  uint32_t correlation_id = 0; // API call that launched it (one cudaGraphLaunch for a whole replay)
  uint64_t start_ns = 0;       // CUPTI timestamps (cupti_timestamp_ns() clock)
  uint64_t end_ns = 0;
  uint64_t bytes = 0;          // memcpy / memset size; 0 for kernels
};

// "ns::kernel<int>(float const*, int)" -> "ns::kernel<int>": the demangled name without its
// parameter list (the outermost trailing "(...)"); other names unchanged.
std::string kernel_function_name(std::string_view demangled);

// What a kernel stands for in the report.
enum class KernelRole : uint8_t {
  kOther,
  kQRopeStore,    // q_rope_store: one per layer, the main (Q) lane
  kWqbGemm,       // the wq_b GEMM right before q_rope_store
  kWindowKWrite,  // the window-K write (KV): one per layer
  kCycleStart,    // a marker kernel that begins each cycle (for split_cycles_by_marker)
};
const char* to_string(KernelRole r);
using KernelClassifier = std::function<KernelRole(const TraceRecord&)>;

// ECMAScript regexes searched (std::regex_search) in TraceRecord::name of kernel records; an
// empty pattern never matches. The first matching role in the order q_rope_store, wqb_gemm,
// window_k_write, cycle_start wins. Invalid regexes throw std::invalid_argument.
struct RolePatterns {
  std::string q_rope_store;
  std::string wqb_gemm;
  std::string window_k_write;
  std::string cycle_start;
};
KernelClassifier make_regex_classifier(const RolePatterns& patterns);

// --- splitting a trace into cycles (every result sorted by start) ------------------------------
// boundaries_ns: b0 < b1 < ... < bN gives N cycles; cycle c holds the records with
// b[c] <= start < b[c+1]; records outside [b0, bN) are dropped. Unsorted boundaries throw.
std::vector<std::vector<TraceRecord>> split_cycles_by_time(const std::vector<TraceRecord>& records,
                                                           const std::vector<uint64_t>& boundaries_ns);
// Each kCycleStart kernel begins a cycle that runs until the next one; records before the first
// marker are dropped.
std::vector<std::vector<TraceRecord>> split_cycles_by_marker(const std::vector<TraceRecord>& records,
                                                             const KernelClassifier& classify);
// Graph replays: records with a graph_node_id, grouped by correlation_id (one cudaGraphLaunch per
// cycle), cycles ordered by their first start; records not from a graph are dropped.
std::vector<std::vector<TraceRecord>> split_cycles_by_graph_launch(const std::vector<TraceRecord>& records);

// --- per-cycle analysis --------------------------------------------------------------------------
// Layer l is the l-th q_rope_store by start time; its window-K write is the l-th window-K write
// by start time (both happen once per layer, in layer order).
struct LayerLanes {
  uint32_t q_rope_stream = 0;
  uint32_t window_k_stream = 0;
  bool same_stream = false;
  int64_t window_k_lead_ns = 0;  // q_rope_store start - window-K end (> 0: K done before Q RoPE)
};

struct CycleStats {
  uint64_t start_ns = 0;  // first record start
  uint64_t end_ns = 0;    // last record end
  // First kernel start / last kernel end (0 without kernels). The cycle's anchor memset can be
  // recorded well before the first kernel in traced cycles (~460 us in docs/perf.md session 6, run
  // 11, where the CUDA-event cycles show no such gap), so the report's cycle time is this span.
  uint64_t kernel_start_ns = 0;
  uint64_t kernel_end_ns = 0;
  int kernels = 0;        // kernel records (memcpy / memset not counted)
  int memcpys = 0;
  int memsets = 0;
  std::map<uint32_t, int> kernels_per_stream;
  int distinct_streams = 0;  // streams that ran at least one kernel
  uint32_t q_rope_stream = 0;  // stream most q_rope_store kernels ran on: "the main lane"
  int main_lane_kernels = 0;   // kernels on q_rope_stream
  int q_rope_count = 0;
  int wqb_gemm_count = 0;
  int window_k_count = 0;
  std::vector<LayerLanes> layers;  // min(q_rope_count, window_k_count) entries
  int window_k_on_q_rope_lane = 0; // layers whose window-K write ran on its q_rope_store stream
  // Median spacing of consecutive q_rope_store starts (NaN with fewer than 2).
  double layer_time_us = 0;
  // For each q_rope_store, the latest wq_b GEMM on the same stream that started before it:
  // q_rope start - GEMM end. Median (NaN without samples), sample count, count of negative gaps.
  double gemm_to_q_rope_gap_us = 0;
  int gap_samples = 0;
  int early_launches = 0;
  double window_k_lead_us = 0;  // median of LayerLanes::window_k_lead_ns (NaN without layers)
  std::map<std::string, int> kernel_counts;  // by kernel_function_name
  double duration_us() const { return end_ns > start_ns ? static_cast<double>(end_ns - start_ns) / 1000.0 : 0.0; }
  double kernel_span_us() const {
    return kernel_end_ns > kernel_start_ns ? static_cast<double>(kernel_end_ns - kernel_start_ns) / 1000.0 : 0.0;
  }
};
CycleStats analyze_cycle(const std::vector<TraceRecord>& cycle, const KernelClassifier& classify);

// Median of a sample (mean of the two middle values for an even count); NaN when empty.
double median(std::vector<double> v);

// One column of the report: a label (schedule name, "three-lane early" ...) and its cycles.
struct ReportColumn {
  std::string label;
  std::vector<CycleStats> cycles;
};

// Text table: one row per figure, one column per ReportColumn; each cell is the median over the
// column's cycles (distinct streams as "min-max" when they differ). Kernel-count rows (one per
// kernel name, median per cycle) follow when with_kernel_counts.
std::string format_report_table(const std::vector<ReportColumn>& columns, bool with_kernel_counts = true);
// {"columns":[{"label":..., "summary":{...medians...}, "cycles":[{...CycleStats...}]}]}; NaN as
// null. Serialized with `indent` (-1: compact).
std::string report_json(const std::vector<ReportColumn>& columns, int indent = 2);

// Chrome / Perfetto trace of one cycle: {"traceEvents":[...], "displayTimeUnit":"ns"}; one
// complete event (ph "X") per record with ts / dur in microseconds relative to the cycle's first
// start, pid = device, tid = stream, name = kernel name, args {graphNodeId, correlationId, kind,
// role (when a classifier is given)}; plus thread_name metadata (ph "M") per stream, the
// q_rope_store stream named "main lane". Open in ui.perfetto.dev or chrome://tracing.
std::string chrome_trace_json(const std::vector<TraceRecord>& cycle, const KernelClassifier& classify = nullptr);

}  // namespace v4attn
