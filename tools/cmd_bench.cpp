// `v4attn bench`: the GPU prepare stack of the whole model (device-random weights, device prefill
// at --context) per schedule: CUDA-event-timed cycles (graph replays or eager), then a few
// CUPTI-traced cycles for the report table of include/v4attn/trace.h (distinct streams, kernels per
// stream and on the q_rope_store lane, window-K writes on that lane, per-layer time, wq_b GEMM ->
// q_rope_store gap, kernel counts), one column per schedule. Also the GPU path of `v4attn main`
// (bench_runner.h).
//
// Checks made on the way (exit code 1 when one fails): no kernel skipped a row (the device error
// counter), every schedule leaves byte-identical outputs and caches (FNV-1a digest after its
// cycles: the step is replayed unchanged, and a replay of one step rewrites the same bytes), every
// traced cycle shows one q_rope_store per layer.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <memory>
#include <optional>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "bench_runner.h"
#include "cli.h"
#include "runtime/cuda_utils.h"
#include "runtime/phase_stamps.h"
#include "v4attn/build_info.h"
#include "v4attn/config.h"
#include "v4attn/cycle_floor.h"
#include "v4attn/plan.h"
#include "v4attn/kernels/qchain.h"
#include "v4attn/prepare/stack.h"
#include "v4attn/reference/stack.h"
#include "v4attn/reference/step.h"
#include "v4attn/runtime/cupti_trace.h"
#include "v4attn/trace.h"

namespace v4attn::cli {

namespace {

using prepare::Fusion;
using prepare::GpuPrepareStack;
using prepare::GpuStackOptions;

// A fusion knob's value (CLI-checked: auto, on or off).
Fusion fusion_from(const std::string& v) { return v == "on" ? Fusion::kOn : v == "off" ? Fusion::kOff : Fusion::kAuto; }

// CUDA events for the timed cycles (start / stop per cycle), destroyed on every path.
class CycleEvents {
 public:
  explicit CycleEvents(int cycles) {
    events_.reserve(static_cast<size_t>(2 * cycles));
    for (int i = 0; i < 2 * cycles; ++i) {
      cudaEvent_t e = nullptr;
      V4_CUDA_CHECK(cudaEventCreate(&e));
      events_.push_back(e);
    }
  }
  ~CycleEvents() {
    for (cudaEvent_t e : events_) cudaEventDestroy(e);
  }
  CycleEvents(const CycleEvents&) = delete;
  CycleEvents& operator=(const CycleEvents&) = delete;
  cudaEvent_t start(int i) const { return events_[static_cast<size_t>(2 * i)]; }
  cudaEvent_t stop(int i) const { return events_[static_cast<size_t>(2 * i + 1)]; }

 private:
  std::vector<cudaEvent_t> events_;
};

std::string fmt(const char* f, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, f, v);
  return buf;
}

// A Fusion knob (auto / on / off) of the bench subcommand.
void add_fusion_option(CLI::App* sub, const std::string& name, std::string& field, const std::string& help) {
  sub->add_option(name, field, help)->check(CLI::IsMember({"auto", "on", "off"}))->capture_default_str();
}

const char* s_fork_name(LayerIssue::SFork f) {
  switch (f) {
    case LayerIssue::SFork::kAtLayerStart: return "at-layer-start";
    case LayerIssue::SFork::kAfterQNorm: return "after-q-norm";
    case LayerIssue::SFork::kIdxOnKWithoutCmp: return "idx-on-k";
    case LayerIssue::SFork::kIdxGemmsOnK: return "idx-gemms-on-k";
  }
  return "?";
}

// FNV-1a of everything a cycle writes (q_pad, top-k, candidate mask, every cache).
uint64_t output_digest(GpuPrepareStack& stack) {
  uint64_t h = ref::kFnvOffset;
  for (int L = 0; L < stack.n_layers(); ++L) {
    const std::vector<num::bf16_t> q = stack.q_pad(L);
    h = ref::fnv1a64(q.data(), q.size() * sizeof(num::bf16_t), h);
  }
  for (int s : stack.plan().config.index_source_layers) {
    const std::vector<int32_t> t = stack.topk(s);
    h = ref::fnv1a64(t.data(), t.size() * sizeof(int32_t), h);
  }
  const std::vector<uint8_t> m = stack.candidate_mask();
  h = ref::fnv1a64(m.data(), m.size(), h);
  const prepare::CacheState st = stack.download_caches();
  for (const auto& v : st.window) h = ref::fnv1a64(v.data(), v.size(), h);
  for (size_t i = 0; i < st.comp.size(); ++i) {
    h = ref::fnv1a64(st.comp[i].data(), st.comp[i].size(), h);
    h = ref::fnv1a64(st.index_k[i].data(), st.index_k[i].size(), h);
    h = ref::fnv1a64(st.pair_state[i].data(), st.pair_state[i].size() * sizeof(float), h);
  }
  return h;
}

struct ScheduleResult {
  Schedule schedule = Schedule::kSerial;
  std::vector<double> cycle_us;  // CUDA-event time per timed cycle
  uint64_t digest = 0;
  unsigned long long errors = 0;
  bool traced = false;
  std::string trace_note;             // why there is no trace, or what looked wrong
  ReportColumn column;                // CUPTI cycles
  std::vector<TraceRecord> first_cycle;
  KernelClassifier classify;
};

double min_of(const std::vector<double>& v) { return v.empty() ? 0.0 : *std::min_element(v.begin(), v.end()); }
double max_of(const std::vector<double>& v) { return v.empty() ? 0.0 : *std::max_element(v.begin(), v.end()); }

// The timed and traced cycles of one schedule.
ScheduleResult run_schedule(GpuPrepareStack& stack, Schedule schedule, const BenchConfig& c, std::ostream& progress) {
  ScheduleResult res;
  res.schedule = schedule;
  res.column.label = to_string(schedule);
  const std::string tag = std::string("[bench] ") + to_string(schedule) + ": ";
  stack.set_schedule(schedule);
  stack.reset_error_count();

  // At least one untimed cycle with graphs: the capture is host work that would land between the
  // first timed cycle's events.
  const int warmup = std::max(c.warmup, c.graph ? 1 : 0);
  progress << tag << warmup << " warm-up cycle" << (warmup == 1 ? "" : "s")
           << (c.graph ? " (the first captures the graph)" : "") << std::endl;
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < warmup; ++i) stack.run(c.graph);
  stack.synchronize();
  progress << tag << "warm-up done in "
           << fmt("%.1f", std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count())
           << " ms; timing " << c.cycles << " cycles" << std::endl;

  const CycleEvents ev(c.cycles);
  const cudaStream_t main = stack.main_stream();
  for (int i = 0; i < c.cycles; ++i) {
    V4_CUDA_CHECK(cudaEventRecord(ev.start(i), main));
    stack.run(c.graph);
    V4_CUDA_CHECK(cudaEventRecord(ev.stop(i), main));
  }
  stack.synchronize();
  for (int i = 0; i < c.cycles; ++i) {
    float ms = 0.0f;
    V4_CUDA_CHECK(cudaEventElapsedTime(&ms, ev.start(i), ev.stop(i)));
    res.cycle_us.push_back(1000.0 * ms);
  }
  res.errors = stack.error_count();
  res.digest = output_digest(stack);

  // Measurement builds (-DV4ATTN_PHASE_STAMPS): one more cycle with the in-kernel phase stamps
  // recorded, written to $V4ATTN_STAMPS_OUT.<schedule>.
  if (const char* stamps_out = std::getenv("V4ATTN_STAMPS_OUT"); stamps_out != nullptr && stamps::available()) {
    stamps::reset();
    stack.run(c.graph);
    stack.synchronize();
    const std::string path = std::string(stamps_out) + "." + to_string(schedule);
    const long n = stamps::dump(path);
    progress << tag << "wrote " << n << " phase stamps to " << path << std::endl;
  }

  if (c.trace_cycles > 0) {
    progress << tag << "tracing " << c.trace_cycles << " cycles with CUPTI" << std::endl;
    try {
      // Tracing starts before the capture (the graph is captured again under it): kernel records
      // of graphs instantiated before tracing started are not guaranteed.
      stack.synchronize();
      stack.graphs().invalidate();
      ScopedCuptiTrace trace;
      stack.run(c.graph);  // capture (graph) + one untraced-in-the-report cycle
      stack.synchronize();
      std::vector<uint64_t> bounds{cupti_timestamp_ns()};
      for (int i = 0; i < c.trace_cycles; ++i) {
        stack.run(c.graph);
        stack.synchronize();
        bounds.push_back(cupti_timestamp_ns());
      }
      const std::vector<TraceRecord> records = trace.stop();
      if (cupti_trace_dropped_records() != 0)
        res.trace_note = std::to_string(cupti_trace_dropped_records()) + " CUPTI records dropped";
      res.classify = prepare::make_stack_classifier(records);
      const auto cycles = split_cycles_by_time(records, bounds);
      for (const auto& cyc : cycles) {
        const CycleStats st = analyze_cycle(cyc, res.classify);
        if (st.q_rope_count != stack.n_layers())
          res.trace_note += (res.trace_note.empty() ? "" : "; ") + std::string("a traced cycle has ") +
                            std::to_string(st.q_rope_count) + " q_rope_store kernels for " +
                            std::to_string(stack.n_layers()) + " layers";
        res.column.cycles.push_back(st);
      }
      if (!cycles.empty()) res.first_cycle = cycles.front();
      res.traced = !res.column.cycles.empty();
      if (!res.traced && res.trace_note.empty()) res.trace_note = "CUPTI returned no records";
    } catch (const std::exception& e) {
      res.trace_note = std::string("no CUPTI trace: ") + e.what();
      progress << tag << res.trace_note << std::endl;
    }
  }
  return res;
}

struct BenchCliOptions {
  ConfigOptions config;
  std::string schedule = "all";
  std::string mode = "verify";
  int bs = 1;
  int context = 65536;
  int cycles = 20;
  int warmup = 3;
  int trace_cycles = 5;
  bool graph = false;
  bool eager = false;
  std::string pdl = "all";
  std::string gemm = "auto";
  std::string fuse_x_quant = "auto";
  int v3_int_mask = -1;
  std::string s_fork = s_fork_name(prepare::GpuStackOptions{}.s_fork);
  bool lane_prologue = false;
  int scores_group_rows = 0;
  int scores_steps = 0;
  int scores_row_split = 0;
  int scores_min_blocks = 0;
  bool no_scores_mask = false;
  int scores_mask_tile = 0;
  int side_priority = 0;
  std::string select = "v3";
  std::string gemm_small = "auto";
  bool no_idx_gemm_main = false;
  int select_cluster = 0;
  bool select_window = false;
  bool no_select_pair = false;
  bool no_idx_x_on_k = false;
  bool qnorm_trigger_late = false;
  int qb_prewait_stages = -1;
  int qb_overlap = -1;
  int qb_side_mtiles = 0;
  bool no_fused_index_main = false;
  int qb_prewait_pace_ns = -1;
  int aq_warps = -1;
  bool idx_scores_main = false;
  std::string fuse_rope_store = "auto";
  std::string fuse_qnorm = "auto";
  std::string qnorm_dist = "auto";
  std::string fuse_qchain = "auto";
  std::string fuse_qchain_index = "auto";
  std::string qchain_q_direct = "auto";
  std::string idx_gemv = "auto";
  std::string qa_gemv = "auto";
  std::string fuse_cmp_tail = "auto";
  std::string src_idx_main = "auto";
  uint64_t seed = 1;
  std::string json_path;
  std::string trace_path;
};

}  // namespace

int bench_rows(const BenchConfig& c, const ModelConfig& cfg) {
  const int v = c.verify ? cfg.verify_rows_per_request() : 1;
  const int64_t rows = static_cast<int64_t>(c.bs) * v;
  if (c.bs < 1) throw UsageError("--bs must be >= 1");
  if (rows > kernels::kGemmMaxRows)
    throw UsageError("--bs " + std::to_string(c.bs) + " gives " + std::to_string(rows) + " rows per step (" +
                     (c.verify ? std::to_string(v) + " per request in verify" : std::string("decode")) +
                     "); the prepare GEMMs take at most " + std::to_string(kernels::kGemmMaxRows));
  return static_cast<int>(rows);
}

int run_gpu_bench(const BenchConfig& c, std::ostream& out, std::ostream& progress) {
  const ModelPlan plan = plan_from_options(c.config);
  const ModelConfig& cfg = plan.config;
  const int rows = bench_rows(c, cfg);
  const int v = c.verify ? cfg.verify_rows_per_request() : 1;
  if (c.schedules.empty()) throw UsageError("no schedule to run");
  if (c.cycles < 1) throw UsageError("--cycles must be >= 1");
  if (c.warmup < 0 || c.trace_cycles < 0) throw UsageError("--warmup and --trace-cycles must be >= 0");
  if (c.context < 0) throw UsageError("--context must be >= 0");
  const StepKind kind = c.verify ? StepKind::kVerify : StepKind::kDecode;

  GpuStackOptions so = c.knobs;
  so.n_requests = c.bs;
  so.max_context = std::max(c.context + v, 2);  // the step writes positions context .. context + v - 1
  so.rows_per_request = v;
  so.max_rows = rows;
  so.decode_buckets = {rows};  // exactly the step's rows: no padded rows in the measurement
  so.verify_buckets = {rows};
  so.schedule = c.schedules.front();
  so.weights = prepare::WeightSource::kDeviceRandom;
  so.progress = [&progress](const std::string& line) { progress << "[bench] " << line << std::endl; };

  cudaDeviceProp prop{};
  V4_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  const auto t0 = std::chrono::steady_clock::now();
  GpuPrepareStack stack(plan, so);
  const std::vector<int32_t> ctx(static_cast<size_t>(c.bs), c.context);
  stack.prefill_device_random(ctx);
  const BatchDesc batch = c.verify ? make_verify_batch(ctx, v) : make_decode_batch(ctx);
  const prepare::StepInfo info = stack.set_step(kind, batch);
  progress << "[bench] stack ready in "
           << fmt("%.2f", std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count()) << " s" << std::endl;

  out << "v4attn bench: " << prop.name << ", config " << cfg.source << " (" << cfg.n_layers << " layers), tp "
      << plan.parallel.tp << " (" << stack.local_heads() << " heads, " << stack.index_heads() << " index heads)\n";
  out << "build: v4attn " << build_string() << "\n";
  out << (c.verify ? "verify" : "decode") << " step: bs " << c.bs << " x " << v << " row" << (v > 1 ? "s" : "") << " = "
      << info.rows << " rows at context " << c.context << "; " << (c.graph ? "CUDA graph replay" : "eager launches")
      << ", PDL " << (c.knobs.pdl ? (c.knobs.pdl_everywhere ? "all" : "on") : "off") << ", GEMM " << kernels::gemm_version_name(c.knobs.gemm) << ", S fork "
      << s_fork_name(c.knobs.s_fork) << (c.knobs.lane_prologue ? ", lane prologue" : "") << ", fused Q chain "
      << to_string(c.knobs.fuse_qchain) << ", fused reindex Q chain " << to_string(c.knobs.fuse_qchain_index) << "\n";
  out << "device memory: " << fmt("%.2f", static_cast<double>(stack.device_bytes()) / 1e9) << " GB ("
      << fmt("%.2f", static_cast<double>(stack.weight_bytes()) / 1e9) << " GB weights, device-random)\n";

  std::vector<ScheduleResult> results;
  for (Schedule s : c.schedules) results.push_back(run_schedule(stack, s, c, progress));

  // --- report -----------------------------------------------------------------------------------
  std::vector<ReportColumn> columns;
  for (const ScheduleResult& r : results)
    if (r.traced) columns.push_back(r.column);
  out << "\n";
  if (!columns.empty()) {
    out << "CUPTI, " << c.trace_cycles << " traced cycle" << (c.trace_cycles == 1 ? "" : "s")
        << " per schedule (medians):\n"
        << format_report_table(columns, /*with_kernel_counts=*/true);
  } else {
    out << "CUPTI: no trace (" << (c.trace_cycles == 0 ? "--trace-cycles 0" : results.front().trace_note) << ")\n";
  }
  out << "\ncycle time, CUDA events over " << c.cycles << " cycle" << (c.cycles == 1 ? "" : "s") << " ("
      << (c.graph ? "graph replays" : "eager") << "):\n";
  // Issue 6's yardsticks: the cycle's bytes floor (cycle_floor.h) and, for its four cycles, the
  // plain-PyTorch figure it measured.
  const CycleFloor floor = prepare_cycle_floor(plan, stack.step_meta());
  const std::optional<double> torch_us = pytorch_reference_us(plan, c.verify, c.bs, c.context);
  char line[256];
  std::snprintf(line, sizeof line, "  %-14s %12s %12s %12s %14s %9s %10s\n", "schedule", "median us", "min us",
                "max us", "us per layer", "x floor", "x PyTorch");
  out << line;
  for (const ScheduleResult& r : results) {
    const double med = median(r.cycle_us);
    std::snprintf(line, sizeof line, "  %-14s %12.1f %12.1f %12.1f %14.2f %8.2fx %10s\n", to_string(r.schedule), med,
                  min_of(r.cycle_us), max_of(r.cycle_us), med / stack.n_layers(), med / floor.us(),
                  torch_us ? fmt("%.2fx", *torch_us / med).c_str() : "-");
    out << line;
  }
  out << "bytes floor: " << fmt("%.3f", static_cast<double>(floor.weight_bytes) / 1e9) << " GB prepare weights + "
      << fmt("%.1f", static_cast<double>(floor.index_k_bytes) / 1e6) << " MB index-K reads = "
      << fmt("%.1f", floor.us()) << " us at " << fmt("%.2f", kFloorBytesPerUs / 1e6)
      << " TB/s (issue 6: cycle <= 1.3x the floor"
      << (torch_us ? ", >= 8x faster than PyTorch's " + fmt("%.0f", *torch_us) + " us" : std::string()) << ")\n";

  int code = 0;
  bool identical = true;
  for (const ScheduleResult& r : results) identical = identical && r.digest == results.front().digest;
  out << "outputs and caches after the cycles: ";
  if (identical) {
    out << "byte-identical across schedules (digest " << ref::checksum_hex(results.front().digest) << ")\n";
  } else {
    out << "DIFFERENT:";
    for (const ScheduleResult& r : results) out << " " << to_string(r.schedule) << "=" << ref::checksum_hex(r.digest);
    out << "\n";
    code = 1;
  }
  unsigned long long errors = 0;
  for (const ScheduleResult& r : results) errors += r.errors;
  if (errors != 0) {
    out << "device error counter: " << errors << " rows skipped by the kernels (expected 0)\n";
    code = 1;
  }
  for (const ScheduleResult& r : results)
    if (!r.trace_note.empty()) out << "note (" << to_string(r.schedule) << "): " << r.trace_note << "\n";

  // --- files ------------------------------------------------------------------------------------
  if (!c.json_path.empty()) {
    nlohmann::ordered_json j;
    j["device"] = prop.name;
    {
      const BuildInfo& b = build_info();
      j["build"] = {{"version", b.version}, {"commit", b.commit}, {"modified", b.dirty},
                    {"phase_stamps", b.phase_stamps}, {"pdl_trigger_at_wait", b.pdl_trigger_at_wait},
                    {"gencode", b.gencode}};
    }
    j["config"] = cfg.source;
    j["tp"] = plan.parallel.tp;
    j["mode"] = c.verify ? "verify" : "decode";
    j["bs"] = c.bs;
    j["rows"] = info.rows;
    j["context"] = c.context;
    j["graph"] = c.graph;
    j["pdl"] = c.knobs.pdl;
    j["pdl_everywhere"] = c.knobs.pdl_everywhere;
    j["fuse_x_quant"] = to_string(c.knobs.fuse_x_quant);
    j["v3_int_mask"] = c.knobs.v3_int_mask;
    j["gemm"] = kernels::gemm_version_name(c.knobs.gemm);
    j["s_fork"] = s_fork_name(c.knobs.s_fork);
    j["lane_prologue"] = c.knobs.lane_prologue;
    j["scores_group_rows"] = c.knobs.scores_group_rows;
    j["scores_steps"] = c.knobs.scores_steps;
    j["scores_row_split"] = c.knobs.scores_row_split;
    j["scores_min_blocks"] = c.knobs.scores_min_blocks;
    j["scores_masked"] = c.knobs.scores_masked;
    j["scores_mask_tile"] = c.knobs.scores_mask_tile;
    j["side_priority"] = c.knobs.side_priority;
    j["select_version"] = c.knobs.select_version;
    j["gemm_small"] = kernels::gemm_version_name(c.knobs.gemm_small);
    j["idx_gemm_on_main"] = c.knobs.idx_gemm_on_main;
    j["select_cluster"] = c.knobs.select_cluster;
    j["select_pair"] = c.knobs.select_pair;
    j["select_window"] = c.knobs.select_window;
    j["idx_x_on_k"] = c.knobs.idx_x_on_k;
    j["qnorm_trigger_late"] = c.knobs.qnorm_trigger_late;
    j["qb_prewait_stages"] = c.knobs.qb_prewait_stages;
    j["qb_overlap"] = c.knobs.qb_overlap;
    j["qb_side_mtiles"] = c.knobs.qb_side_mtiles;
    j["fused_index_on_main"] = c.knobs.fused_index_on_main;
    j["qb_prewait_pace_ns"] = c.knobs.qb_prewait_pace_ns;
    j["aq_warps"] = c.knobs.aq_warps;
    j["idx_scores_on_main"] = c.knobs.idx_scores_on_main;
    j["fuse_rope_store"] = to_string(c.knobs.fuse_rope_store);
    j["fuse_qnorm"] = to_string(c.knobs.fuse_qnorm);
    j["qnorm_dist"] = to_string(c.knobs.qnorm_dist);
    j["fuse_qchain"] = to_string(c.knobs.fuse_qchain);
    j["fuse_qchain_index"] = to_string(c.knobs.fuse_qchain_index);
    j["qchain_q_direct"] = to_string(c.knobs.qchain_q_direct);
    j["idx_gemv"] = to_string(c.knobs.idx_gemv);
    j["qa_gemv"] = to_string(c.knobs.qa_gemv);
    j["fuse_cmp_tail"] = to_string(c.knobs.fuse_cmp_tail);
    j["src_idx_main"] = to_string(c.knobs.src_idx_main);
    j["seed"] = c.knobs.seed;
    j["device_bytes"] = stack.device_bytes();
    j["weight_bytes"] = stack.weight_bytes();
    j["floor"] = {{"weight_bytes", floor.weight_bytes}, {"index_k_bytes", floor.index_k_bytes},
                  {"bytes", floor.bytes()}, {"us", floor.us()}, {"bytes_per_us", kFloorBytesPerUs}};
    if (torch_us) j["pytorch_reference_us"] = *torch_us;
    nlohmann::ordered_json sched = nlohmann::ordered_json::array();
    for (const ScheduleResult& r : results) {
      nlohmann::ordered_json js;
      js["schedule"] = to_string(r.schedule);
      js["cycle_us"] = {{"median", median(r.cycle_us)}, {"min", min_of(r.cycle_us)}, {"max", max_of(r.cycle_us)},
                        {"samples", r.cycle_us}};
      js["us_per_layer"] = median(r.cycle_us) / stack.n_layers();
      js["ratio_to_floor"] = median(r.cycle_us) / floor.us();
      if (torch_us) js["speedup_vs_pytorch"] = *torch_us / median(r.cycle_us);
      js["digest"] = ref::checksum_hex(r.digest);
      js["skipped_rows"] = r.errors;
      js["traced"] = r.traced;
      if (!r.trace_note.empty()) js["trace_note"] = r.trace_note;
      sched.push_back(js);
    }
    j["schedules"] = sched;
    j["outputs_identical"] = identical;
    j["report"] = columns.empty() ? nlohmann::ordered_json() : nlohmann::ordered_json::parse(report_json(columns, -1));
    if (c.json_path == "-") {
      std::cout << j.dump(2) << "\n";
    } else {
      std::ofstream f(c.json_path, std::ios::trunc);
      f << j.dump(2) << "\n";
      f.close();
      if (!f) throw std::runtime_error("cannot write " + c.json_path);
      progress << "[bench] wrote " << c.json_path << std::endl;
    }
  }
  if (!c.trace_path.empty()) {
    const ScheduleResult* last = nullptr;
    for (const ScheduleResult& r : results)
      if (r.traced) last = &r;
    if (last == nullptr) {
      out << "no Chrome trace written: no schedule was traced\n";
    } else {
      std::ofstream f(c.trace_path, std::ios::trunc);
      f << chrome_trace_json(last->first_cycle, last->classify);
      f.close();
      if (!f) throw std::runtime_error("cannot write " + c.trace_path);
      progress << "[bench] wrote " << c.trace_path << " (one " << to_string(last->schedule)
               << " cycle; open in ui.perfetto.dev)" << std::endl;
    }
  }
  return code;
}

void register_bench_command(CLI::App& app, CommandResult& result) {
  auto o = std::make_shared<BenchCliOptions>();
  CLI::App* sub = app.add_subcommand(
      "bench", "Benchmark the GPU prepare stack of the whole model (device-random weights, device prefill) per "
               "schedule: CUDA-event cycle times and a CUPTI report (streams, lanes, per-layer time, PDL gap, "
               "kernel counts) with one column per schedule. Needs an sm_90 GPU.");
  add_config_options(*sub, o->config);
  sub->add_option("--schedule", o->schedule, "serial, sources-side, three-lane or all (in that order)")
      ->check(CLI::IsMember({"serial", "sources-side", "sources_side", "three-lane", "three_lane", "all"}))
      ->capture_default_str();
  sub->add_option("--mode", o->mode, "decode (one row per request) or verify (dspark_block_size + 1 rows per request)")
      ->check(CLI::IsMember({"decode", "verify"}))
      ->capture_default_str();
  sub->add_option("--bs", o->bs, "Requests in the batch (rows per step <= 64)")->check(CLI::Range(1, 64))->capture_default_str();
  sub->add_option("--context", o->context, "Prefilled positions per request")
      ->type_name("N")
      ->check(CLI::Range(0, 1 << 24))
      ->capture_default_str();
  sub->add_option("--cycles", o->cycles, "Timed cycles per schedule")->check(CLI::Range(1, 1000000))->capture_default_str();
  sub->add_option("--warmup", o->warmup, "Untimed cycles per schedule before timing")
      ->check(CLI::Range(0, 1000000))
      ->capture_default_str();
  sub->add_option("--trace-cycles", o->trace_cycles, "CUPTI-traced cycles per schedule (0: no CUPTI report)")
      ->check(CLI::Range(0, 10000))
      ->capture_default_str();
  sub->add_flag("--graph", o->graph, "Replay a CUDA graph per cycle (the default)");
  sub->add_flag("--eager", o->eager, "Launch every kernel per cycle instead of a graph replay");
  sub->add_option("--pdl", o->pdl,
                  "Programmatic dependent launch: on (q_rope_store, as prepare-schedule.md places it), all "
                  "(every kernel of the cycle) or off")
      ->check(CLI::IsMember({"on", "all", "off"}))
      ->capture_default_str();
  sub->add_option("--gemm", o->gemm,
                  "GEMM version: auto (fp8: v2 or v3 by shape, as measured; others tc), wgmma (v2), "
                  "wgmma-pipelined (v3), tc (v1, mma.sync) or simple (v0, reference order)")
      ->check(CLI::IsMember({"auto", "wgmma", "wgmma-pipelined", "tc", "simple", "skinny"}))
      ->capture_default_str();
  sub->add_option("--s-fork", o->s_fork, "Three-lane S-fork placement (runtime/lanes.h experiment knob)")
      ->check(CLI::IsMember({"at-layer-start", "after-q-norm", "idx-on-k", "idx-gemms-on-k"}))
      ->capture_default_str();
  sub->add_flag("--lane-prologue", o->lane_prologue, "Anchor both side lanes at the cycle start (lanes.h experiment)");
  add_fusion_option(sub, "--fuse-x-quant", o->fuse_x_quant,
                  "Let the wq_a|wkv v3 GEMM quantise x itself instead of a separate act-quant kernel: auto (steps of <= " +
                      std::to_string(prepare::kXQuantAutoRows) + " rows, where it measured faster), on or off; same bytes");
  sub->add_option("--v3-int-mask", o->v3_int_mask,
                  "v3 GEMM: K blocks of each 4-block stage widened with integer ops (bit j = block j; -1: the kernel's "
                  "default; tuning knob, may move rare outputs by 1 bf16 ulp)")
      ->check(CLI::Range(-1, 15))
      ->capture_default_str();
  sub->add_option("--scores-group-rows", o->scores_group_rows,
                  "Indexer scores: rows per CTA, 1..8 (0: a request's rows in verify, 1 in decode; tuning knob)")
      ->check(CLI::Range(0, 8))
      ->capture_default_str();
  sub->add_option("--scores-steps", o->scores_steps,
                  "Indexer scores: 32-position steps per warp per CTA, 1..64 (0: automatic; tuning knob)")
      ->check(CLI::Range(0, 64))
      ->capture_default_str();
  sub->add_option("--scores-row-split", o->scores_row_split,
                  "Indexer scores: warp sets per CTA that split its rows, 1..2 (0: automatic; tuning knob)")
      ->check(CLI::Range(0, 2))
      ->capture_default_str();
  sub->add_option("--scores-min-blocks", o->scores_min_blocks,
                  "Indexer scores: CTAs per SM its registers are capped for, 3 or 4 (0: automatic; tuning knob)")
      ->check(CLI::IsMember({0, 3, 4}))
      ->capture_default_str();
  sub->add_flag("--no-scores-mask", o->no_scores_mask,
                "Indexer scores after the candidate source: score every position and let the top-k apply the mask "
                "(default: score only the kept blocks; same bytes)");
  sub->add_option("--scores-mask-tile", o->scores_mask_tile,
                  "Indexer scores with the candidate mask: blocks of 8 positions per CTA tile, 16/32/64/128/256 (0: automatic; "
                  "tuning knob)")
      ->check(CLI::IsMember({0, 16, 32, 64, 128, 256}))
      ->capture_default_str();
  sub->add_option("--side-priority", o->side_priority,
                  "CUDA stream priority of the side lanes S and K (negative = higher than main; 0: default)")
      ->check(CLI::Range(-16, 0))
      ->capture_default_str();
  sub->add_option("--gemm-small", o->gemm_small,
                  "Version of the bf16 / fp32 GEMMs only (compressor, weights_proj, wk): auto (follow --gemm), "
                  "tc (v1) or skinny (v5)")
      ->check(CLI::IsMember({"auto", "tc", "skinny"}))
      ->capture_default_str();
  sub->add_flag("--no-idx-gemm-main", o->no_idx_gemm_main,
                "Index-source layers: run the indexer's wq_b GEMM first on lane S (default: on main after q_norm)");
  add_fusion_option(sub, "--fuse-qnorm", o->fuse_qnorm,
                  "q_norm and its act quant inside the wq_b GEMM's prologue in the unfused chain's layers without an "
                  "indexer: on (wherever v2 takes it), or auto / off (the rmsnorm kernel: the fused form measured slower); "
                  "same bytes; experiment knob");
  add_fusion_option(sub, "--qnorm-dist", o->qnorm_dist,
                    "q_norm of the unfused chain's layers without an indexer done by the wq_b GEMM's first CTAs (one row "
                    "each, into the q_norm kernel's buffers; the other CTAs wait for those rows): on, off (the q_norm "
                    "kernel), or auto (on at exactly " + std::to_string(prepare::kQNormDistAutoRows) +
                        " rows, where it measured faster; the q_norm kernel elsewhere); same bytes");
  add_fusion_option(sub, "--fuse-rope-store", o->fuse_rope_store,
                  "q_rope_store fused into the wq_b GEMM's epilogue in the layers that run the unfused chain: auto "
                  "(steps of " + std::to_string(prepare::kRopeStoreAutoMinRows) + "-" +
                      std::to_string(prepare::kRopeStoreAutoMaxRows) + " rows, where it measured faster), on or off; same bytes");
  add_fusion_option(sub, "--fuse-qchain", o->fuse_qchain,
                  "Plain layers as ONE kernel (act quant, wq_a|wkv, q_norm, wq_b + RoPE, window-K; kernels/qchain.h): "
                  "auto (steps of <= " + std::to_string(prepare::kQChainAutoRows) +
                      " rows, where it measured faster or even), on (<= " + std::to_string(kernels::kQChainMaxRows) +
                      " rows) or off; the unfused chain's bytes (with the default --v3-int-mask)");
  add_fusion_option(sub, "--fuse-qchain-index", o->fuse_qchain_index,
                  "Reindex layers (index sources without a compressor) with their Q chain as the fused kernel, "
                  "the indexer after it (on main; --no-fused-index-main: on lane S): auto (steps of <= " + std::to_string(prepare::kQChainIndexAutoRows) +
                      " rows, where it measured faster), on (<= " + std::to_string(kernels::kQChainMaxRows) +
                      " rows) or off; same bytes");
  add_fusion_option(sub, "--qchain-q-direct", o->qchain_q_direct,
                  "The fused Q chain's q hand-off: every CTA adds the q columns' split-K partials itself (one "
                  "hand-off instead of the tile reducers' two): auto (steps of <= " +
                      std::to_string(prepare::kQChainDirectAutoRows) + " rows, where it measured faster), on or off; same bytes");
  // The v6 (registers-first gemv) version knobs: another GEMM version, not a byte-neutral fusion.
  const auto add_gemv_option = [&](const char* name, std::string& field, const std::string& what, int auto_rows) {
    add_fusion_option(sub, name, field,
                      what + ": auto (steps of <= " + std::to_string(auto_rows) +
                          " rows with --gemm auto), on or off; another GEMM version (within the spec's allowance), "
                          "not the same bytes");
  };
  add_gemv_option("--idx-gemv", o->idx_gemv,
                  "The indexer's wq_b GEMM as v6 (the registers-first gemv, m <= " + std::to_string(kernels::kGemvMaxRows) +
                      ") instead of --gemm's choice",
                  prepare::kIdxGemvAutoRows);
  add_gemv_option("--qa-gemv", o->qa_gemv,
                  "The wq_a|wkv GEMM of the layers with a compressor as v6 after the act quant kernel, instead of "
                  "--gemm's choice (v3 with its fused act quant)",
                  prepare::kQaGemvAutoRows);
  add_fusion_option(sub, "--fuse-cmp-tail", o->fuse_cmp_tail,
                    "The compressor's tail (c2 or c1, the wk GEMM, the index-K store) as one kernel per row instead "
                    "of three launches: auto / on (wherever wk runs GEMM v5, i.e. --gemm-small auto or skinny) or off; "
                    "same bytes");
  add_fusion_option(sub, "--src-idx-main", o->src_idx_main,
                    "Three-lane, index sources with a compressor: the indexer's q pack, scores and selection on main "
                    "after its wq_b GEMM, the Q wq_b GEMM on lane K beside the selection (default: the indexer on lane "
                    "S beside the wq_b GEMM): auto (steps of <= " + std::to_string(prepare::kSrcIdxMainAutoRows) +
                        " rows, where it measured faster), on or off; same bytes");
  sub->add_flag("--idx-scores-main", o->idx_scores_main,
                "Reindex layers: weights_proj, q pack and the indexer scores on main before the wq_b GEMM (experiment knob)");
  sub->add_flag("--qnorm-trigger-late", o->qnorm_trigger_late,
                "q_norm lets the wq_b GEMM launch only after its last store (experiment knob)");
  sub->add_option("--qb-prewait-stages", o->qb_prewait_stages,
                  "wq_b GEMM: weight stages fetched before its PDL wait (-1: its whole first ring fill; tuning knob)")
      ->check(CLI::Range(-1, 8))
      ->capture_default_str();
  sub->add_option("--qb-prewait-pace", o->qb_prewait_pace_ns,
                  "wq_b GEMM: ns between its pre-wait weight stage issues per CTA (0: all at once; -1: automatic, "
                  "1000 for one-row steps; tuning knob)")
      ->check(CLI::Range(-1, 100000))
      ->capture_default_str();
  sub->add_option("--aq-warps", o->aq_warps,
                  "QA act quant: warps (32-element blocks) per CTA, 1..32 (0: the kernel's 4; -1: automatic: 4 for one "
                  "row, 16 for 2-7 rows, 32 from 8)")
      ->check(CLI::Range(-1, 32))
      ->capture_default_str();
  sub->add_option("--qb-overlap", o->qb_overlap,
                  "wq_b GEMM (v2) consumer loop: 0 one K block at a time, 1 widening overlapped, 2 fully pipelined "
                  "across pairs of stages (m <= 32), -1 default (tuning knob)")
      ->check(CLI::Range(-1, 2))
      ->capture_default_str();
  sub->add_flag("--no-fused-index-main", o->no_fused_index_main,
                "Reindex layers on the fused Q chain: the whole indexer on lane S after the chain (default: its GEMM, "
                "q pack, scores and selection on main after the chain, PDL-chained; weights_proj on lane S)");
  sub->add_option("--qb-side-mtiles", o->qb_side_mtiles,
                  "wq_b GEMM (v2, plain form, <= 16 rows) in layers with an indexer or a compressor: m64 tiles per "
                  "consumer warpgroup: 2 (128 CTAs), 4 (64 CTAs: SMs left to the side lanes), 0 automatic (4 in one-row steps, "
                  "where it measured faster); same bytes (tuning knob)")
      ->check(CLI::IsMember({0, 2, 4}))
      ->capture_default_str();
  sub->add_option("--select-cluster", o->select_cluster,
                  "Selection v3: CTAs per row (thread-block cluster size) 1, 2, 4, 8 or 16; 0: automatic")
      ->check(CLI::IsMember({0, 1, 2, 4, 8, 16}))
      ->capture_default_str();
  sub->add_flag("--no-idx-x-on-k", o->no_idx_x_on_k,
                "Three-lane, index sources with a compressor: weights_proj behind the compressor on lane S (default: on "
                "lane K at the layer's start); same bytes");
  sub->add_flag("--select-window", o->select_window,
                "Selection v3: start the radix select with the window exchange (16-bit prefixes under each CTA's "
                "largest score: one exchange fewer where the k-th score is within ~2 binades of the largest; else the "
                "plain passes follow); the same bytes by design (experiment knob, not yet run on a GPU: off)");
  sub->add_flag("--no-select-pair", o->no_select_pair,
                "Selection v3, the candidate source: the candidate mask then the top-k as two launches (default: one "
                "launch for both when they fit one wave; same bytes)");
  sub->add_option("--select", o->select,
                  "Indexer top-k / candidate-mask kernels: v3 (one cluster per row) or v2 (chunk CTAs + merge)")
      ->check(CLI::IsMember({"v2", "v3"}))
      ->capture_default_str();
  sub->add_option("--seed", o->seed, "Seed of the device-random weights and inputs")->capture_default_str();
  sub->add_option("--json", o->json_path, "Write the results as JSON to FILE ('-': stdout, table to stderr)")
      ->type_name("FILE");
  sub->add_option("--trace", o->trace_path, "Write a Chrome / Perfetto trace of one cycle of the last schedule")
      ->type_name("FILE");
  sub->callback([o, &result] {
    result.action = [o] {
      if (o->graph && o->eager) throw UsageError("--graph and --eager exclude each other");
      BenchConfig c;
      c.config = o->config;
      if (o->schedule == "all") c.schedules.assign(kAllSchedules.begin(), kAllSchedules.end());
      else c.schedules = {parse_schedule(o->schedule)};
      c.verify = o->mode == "verify";
      c.bs = o->bs;
      c.context = o->context;
      c.cycles = o->cycles;
      c.warmup = o->warmup;
      c.trace_cycles = o->trace_cycles;
      c.graph = !o->eager;
      c.knobs.pdl = o->pdl != "off";
      c.knobs.pdl_everywhere = o->pdl == "all";
      c.knobs.fuse_x_quant = fusion_from(o->fuse_x_quant);
      c.knobs.v3_int_mask = o->v3_int_mask;
      c.knobs.gemm = o->gemm == "simple" ? kernels::GemmVersion::kSimple
               : o->gemm == "tc"   ? kernels::GemmVersion::kTensorCore
               : o->gemm == "wgmma-pipelined" ? kernels::GemmVersion::kWgmmaPipelined
               : o->gemm == "wgmma" ? kernels::GemmVersion::kWgmma
               : o->gemm == "skinny" ? kernels::GemmVersion::kSkinny
                                   : kernels::GemmVersion::kAuto;
      c.knobs.s_fork = o->s_fork == "after-q-norm"     ? LayerIssue::SFork::kAfterQNorm
                 : o->s_fork == "idx-on-k"       ? LayerIssue::SFork::kIdxOnKWithoutCmp
                 : o->s_fork == "idx-gemms-on-k" ? LayerIssue::SFork::kIdxGemmsOnK
                                             : LayerIssue::SFork::kAtLayerStart;
      c.knobs.lane_prologue = o->lane_prologue;
      c.knobs.scores_group_rows = o->scores_group_rows;
      c.knobs.scores_steps = o->scores_steps;
      c.knobs.scores_row_split = o->scores_row_split;
      c.knobs.scores_min_blocks = o->scores_min_blocks;
      c.knobs.scores_masked = !o->no_scores_mask;
      c.knobs.scores_mask_tile = o->scores_mask_tile;
      c.knobs.side_priority = o->side_priority;
      c.knobs.select_version = o->select == "v2" ? 2 : 3;
      // The lane-K placement of the indexer's GEMMs excludes the main-lane one.
      c.knobs.idx_gemm_on_main = !o->no_idx_gemm_main && o->s_fork != "idx-gemms-on-k";
      c.knobs.select_cluster = o->select_cluster;
      c.knobs.select_pair = !o->no_select_pair;
      c.knobs.select_window = o->select_window;
      c.knobs.idx_x_on_k = !o->no_idx_x_on_k;
      c.knobs.qnorm_trigger_late = o->qnorm_trigger_late;
      c.knobs.qb_prewait_stages = o->qb_prewait_stages;
      c.knobs.qb_overlap = o->qb_overlap;
      c.knobs.qb_side_mtiles = o->qb_side_mtiles;
      c.knobs.fused_index_on_main = !o->no_fused_index_main;
      c.knobs.qb_prewait_pace_ns = o->qb_prewait_pace_ns;
      c.knobs.aq_warps = o->aq_warps;
      c.knobs.idx_scores_on_main = o->idx_scores_main && c.knobs.idx_gemm_on_main;
      c.knobs.fuse_rope_store = fusion_from(o->fuse_rope_store);
      c.knobs.fuse_qnorm = fusion_from(o->fuse_qnorm);
      c.knobs.qnorm_dist = fusion_from(o->qnorm_dist);
      c.knobs.fuse_qchain = fusion_from(o->fuse_qchain);
      c.knobs.fuse_qchain_index = fusion_from(o->fuse_qchain_index);
      c.knobs.qchain_q_direct = fusion_from(o->qchain_q_direct);
      c.knobs.idx_gemv = fusion_from(o->idx_gemv);
      c.knobs.qa_gemv = fusion_from(o->qa_gemv);
      c.knobs.fuse_cmp_tail = fusion_from(o->fuse_cmp_tail);
      c.knobs.src_idx_main = fusion_from(o->src_idx_main);
      c.knobs.gemm_small = o->gemm_small == "tc"       ? kernels::GemmVersion::kTensorCore
                     : o->gemm_small == "skinny" ? kernels::GemmVersion::kSkinny
                                                 : kernels::GemmVersion::kAuto;
      c.knobs.seed = o->seed;
      c.json_path = o->json_path;
      c.trace_path = o->trace_path;
      // Usage and config errors first (exit 2 from main), then the GPU.
      bench_rows(c, plan_from_options(c.config).config);
      std::string reason;
      if (!gpu_available(&reason)) {
        std::cout.flush();
        std::cerr << "v4attn bench: needs an sm_90 GPU (" << reason << ")" << std::endl;
        return 2;
      }
      return run_gpu_bench(c, c.json_path == "-" ? std::cerr : std::cout, std::cerr);
    };
  });
}

}  // namespace v4attn::cli
