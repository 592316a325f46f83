#include "v4attn/trace.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>
#include <sstream>
#include <stdexcept>

namespace v4attn {

namespace {
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

std::vector<TraceRecord> sorted_by_start(std::vector<TraceRecord> r) {
  std::stable_sort(r.begin(), r.end(), [](const TraceRecord& a, const TraceRecord& b) { return a.start_ns < b.start_ns; });
  return r;
}
}  // namespace

const char* to_string(TraceKind k) {
  switch (k) {
    case TraceKind::kKernel: return "kernel";
    case TraceKind::kMemcpy: return "memcpy";
    case TraceKind::kMemset: return "memset";
  }
  return "?";
}

const char* to_string(KernelRole r) {
  switch (r) {
    case KernelRole::kOther: return "other";
    case KernelRole::kQRopeStore: return "q_rope_store";
    case KernelRole::kWqbGemm: return "wq_b GEMM";
    case KernelRole::kWindowKWrite: return "window-K write";
    case KernelRole::kCycleStart: return "cycle start";
  }
  return "?";
}

std::string kernel_function_name(std::string_view name) {
  // Template kernels demangle with their return type ("void ns::k<int>(float*)").
  if (name.substr(0, 5) == "void ") name.remove_prefix(5);
  if (name.empty() || name.back() != ')') return std::string(name);
  int depth = 0;
  for (size_t i = name.size(); i-- > 0;) {
    if (name[i] == ')') ++depth;
    if (name[i] == '(' && --depth == 0) return i == 0 ? std::string(name) : std::string(name.substr(0, i));
  }
  return std::string(name);  // unbalanced: leave it alone
}

KernelClassifier make_regex_classifier(const RolePatterns& p) {
  struct Rule {
    KernelRole role;
    std::regex re;
  };
  auto rules = std::make_shared<std::vector<Rule>>();
  const auto add = [&](const std::string& pattern, KernelRole role, const char* what) {
    if (pattern.empty()) return;
    try {
      rules->push_back({role, std::regex(pattern, std::regex::ECMAScript)});
    } catch (const std::regex_error& e) {
      throw std::invalid_argument(std::string("make_regex_classifier: bad ") + what + " pattern \"" + pattern + "\": " + e.what());
    }
  };
  add(p.q_rope_store, KernelRole::kQRopeStore, "q_rope_store");
  add(p.wqb_gemm, KernelRole::kWqbGemm, "wqb_gemm");
  add(p.window_k_write, KernelRole::kWindowKWrite, "window_k_write");
  add(p.cycle_start, KernelRole::kCycleStart, "cycle_start");
  return [rules](const TraceRecord& r) {
    if (r.kind != TraceKind::kKernel) return KernelRole::kOther;
    for (const Rule& rule : *rules)
      if (std::regex_search(r.name, rule.re)) return rule.role;
    return KernelRole::kOther;
  };
}

// --- cycle splitting -----------------------------------------------------------------------------

std::vector<std::vector<TraceRecord>> split_cycles_by_time(const std::vector<TraceRecord>& records,
                                                           const std::vector<uint64_t>& b) {
  for (size_t i = 1; i < b.size(); ++i)
    if (b[i] <= b[i - 1]) throw std::invalid_argument("split_cycles_by_time: boundaries must be strictly increasing");
  std::vector<std::vector<TraceRecord>> cycles(b.size() > 1 ? b.size() - 1 : 0);
  for (const TraceRecord& r : sorted_by_start(records)) {
    const auto it = std::upper_bound(b.begin(), b.end(), r.start_ns);  // first boundary > start
    if (it == b.begin() || it == b.end()) continue;                    // before b0 or at/after bN
    cycles[static_cast<size_t>(it - b.begin()) - 1].push_back(r);
  }
  return cycles;
}

std::vector<std::vector<TraceRecord>> split_cycles_by_marker(const std::vector<TraceRecord>& records,
                                                             const KernelClassifier& classify) {
  if (!classify) throw std::invalid_argument("split_cycles_by_marker: no classifier");
  std::vector<std::vector<TraceRecord>> cycles;
  for (const TraceRecord& r : sorted_by_start(records)) {
    if (r.kind == TraceKind::kKernel && classify(r) == KernelRole::kCycleStart) cycles.emplace_back();
    if (!cycles.empty()) cycles.back().push_back(r);
  }
  return cycles;
}

std::vector<std::vector<TraceRecord>> split_cycles_by_graph_launch(const std::vector<TraceRecord>& records) {
  std::map<uint32_t, std::vector<TraceRecord>> by_launch;
  for (const TraceRecord& r : sorted_by_start(records))
    if (r.graph_node_id != 0) by_launch[r.correlation_id].push_back(r);
  std::vector<std::vector<TraceRecord>> cycles;
  for (auto& [id, recs] : by_launch) cycles.push_back(std::move(recs));
  std::sort(cycles.begin(), cycles.end(),
            [](const auto& a, const auto& b) { return a.front().start_ns < b.front().start_ns; });
  return cycles;
}

// --- per-cycle analysis --------------------------------------------------------------------------

double median(std::vector<double> v) {
  v.erase(std::remove_if(v.begin(), v.end(), [](double x) { return std::isnan(x); }), v.end());
  if (v.empty()) return kNaN;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2.0;
}

CycleStats analyze_cycle(const std::vector<TraceRecord>& cycle, const KernelClassifier& classify) {
  if (!classify) throw std::invalid_argument("analyze_cycle: no classifier");
  CycleStats s;
  s.layer_time_us = s.gemm_to_q_rope_gap_us = s.window_k_lead_us = kNaN;
  if (cycle.empty()) return s;
  const std::vector<TraceRecord> recs = sorted_by_start(cycle);
  s.start_ns = recs.front().start_ns;
  for (const TraceRecord& r : recs) s.end_ns = std::max(s.end_ns, r.end_ns);

  std::vector<const TraceRecord*> q_rope, wqb, window_k;
  for (const TraceRecord& r : recs) {
    if (r.kind == TraceKind::kMemcpy) ++s.memcpys;
    if (r.kind == TraceKind::kMemset) ++s.memsets;
    if (r.kind != TraceKind::kKernel) continue;
    if (s.kernels == 0) s.kernel_start_ns = r.start_ns;  // records are sorted by start
    s.kernel_end_ns = std::max(s.kernel_end_ns, r.end_ns);
    ++s.kernels;
    ++s.kernels_per_stream[r.stream_id];
    ++s.kernel_counts[kernel_function_name(r.name)];
    switch (classify(r)) {
      case KernelRole::kQRopeStore: q_rope.push_back(&r); break;
      case KernelRole::kWqbGemm: wqb.push_back(&r); break;
      case KernelRole::kWindowKWrite: window_k.push_back(&r); break;
      default: break;
    }
  }
  s.distinct_streams = static_cast<int>(s.kernels_per_stream.size());
  s.q_rope_count = static_cast<int>(q_rope.size());
  s.wqb_gemm_count = static_cast<int>(wqb.size());
  s.window_k_count = static_cast<int>(window_k.size());

  if (!q_rope.empty()) {
    std::map<uint32_t, int> votes;
    for (const TraceRecord* q : q_rope) ++votes[q->stream_id];
    // Most votes wins; ties go to the smaller stream id (map order) for a stable answer.
    s.q_rope_stream = std::max_element(votes.begin(), votes.end(), [](const auto& a, const auto& b) {
                        return a.second < b.second;
                      })->first;
    s.main_lane_kernels = s.kernels_per_stream[s.q_rope_stream];
  }

  const size_t n_layers = std::min(q_rope.size(), window_k.size());
  std::vector<double> leads;
  for (size_t l = 0; l < n_layers; ++l) {
    LayerLanes L;
    L.q_rope_stream = q_rope[l]->stream_id;
    L.window_k_stream = window_k[l]->stream_id;
    L.same_stream = L.q_rope_stream == L.window_k_stream;
    L.window_k_lead_ns = static_cast<int64_t>(q_rope[l]->start_ns) - static_cast<int64_t>(window_k[l]->end_ns);
    if (L.same_stream) ++s.window_k_on_q_rope_lane;
    leads.push_back(static_cast<double>(L.window_k_lead_ns) / 1000.0);
    s.layers.push_back(L);
  }
  s.window_k_lead_us = median(leads);

  std::vector<double> spacing;
  for (size_t i = 1; i < q_rope.size(); ++i)
    spacing.push_back(static_cast<double>(q_rope[i]->start_ns - q_rope[i - 1]->start_ns) / 1000.0);
  s.layer_time_us = median(spacing);

  // The GEMM of a q_rope_store is the latest wq_b GEMM on its stream that started after the
  // previous q_rope_store of that stream and not after this one: a layer without a GEMM record
  // then gives no sample instead of a gap to an older layer's GEMM.
  std::vector<double> gaps;
  std::map<uint32_t, uint64_t> prev_q_start;  // per stream
  for (const TraceRecord* q : q_rope) {
    const auto prev = prev_q_start.find(q->stream_id);
    const TraceRecord* gemm = nullptr;
    for (const TraceRecord* g : wqb) {
      if (g->stream_id != q->stream_id || g->start_ns > q->start_ns) continue;
      if (prev != prev_q_start.end() && g->start_ns <= prev->second) continue;
      if (!gemm || g->start_ns >= gemm->start_ns) gemm = g;
    }
    prev_q_start[q->stream_id] = q->start_ns;
    if (!gemm) continue;
    const double gap = (static_cast<double>(q->start_ns) - static_cast<double>(gemm->end_ns)) / 1000.0;
    gaps.push_back(gap);
    if (gap < 0) ++s.early_launches;
  }
  s.gap_samples = static_cast<int>(gaps.size());
  s.gemm_to_q_rope_gap_us = median(gaps);
  return s;
}

// --- summaries, table, JSON ----------------------------------------------------------------------

namespace {

struct ColumnSummary {
  int cycles = 0;
  int streams_min = 0, streams_max = 0;
  double streams = kNaN, kernels = kNaN, main_lane_kernels = kNaN, layers = kNaN;
  double window_k_on_q_rope_lane = kNaN, layer_time_us = kNaN, gap_us = kNaN, early_launches = kNaN;
  double window_k_lead_us = kNaN, cycle_us = kNaN, span_us = kNaN, q_rope = kNaN, wqb = kNaN, window_k = kNaN;
  std::map<std::string, double> kernel_counts;
};

template <class F>
double median_of(const std::vector<CycleStats>& cs, F f) {
  std::vector<double> v;
  for (const CycleStats& c : cs) v.push_back(static_cast<double>(f(c)));
  return median(std::move(v));
}

ColumnSummary summarize(const ReportColumn& col) {
  ColumnSummary s;
  const auto& cs = col.cycles;
  s.cycles = static_cast<int>(cs.size());
  if (cs.empty()) return s;
  s.streams_min = s.streams_max = cs.front().distinct_streams;
  for (const CycleStats& c : cs) {
    s.streams_min = std::min(s.streams_min, c.distinct_streams);
    s.streams_max = std::max(s.streams_max, c.distinct_streams);
  }
  s.streams = median_of(cs, [](const CycleStats& c) { return c.distinct_streams; });
  s.kernels = median_of(cs, [](const CycleStats& c) { return c.kernels; });
  s.main_lane_kernels = median_of(cs, [](const CycleStats& c) { return c.main_lane_kernels; });
  s.layers = median_of(cs, [](const CycleStats& c) { return c.layers.size(); });
  s.window_k_on_q_rope_lane = median_of(cs, [](const CycleStats& c) { return c.window_k_on_q_rope_lane; });
  s.layer_time_us = median_of(cs, [](const CycleStats& c) { return c.layer_time_us; });
  s.gap_us = median_of(cs, [](const CycleStats& c) { return c.gemm_to_q_rope_gap_us; });
  s.early_launches = median_of(cs, [](const CycleStats& c) { return c.early_launches; });
  s.window_k_lead_us = median_of(cs, [](const CycleStats& c) { return c.window_k_lead_us; });
  s.cycle_us = median_of(cs, [](const CycleStats& c) { return c.kernel_span_us(); });
  s.span_us = median_of(cs, [](const CycleStats& c) { return c.duration_us(); });
  s.q_rope = median_of(cs, [](const CycleStats& c) { return c.q_rope_count; });
  s.wqb = median_of(cs, [](const CycleStats& c) { return c.wqb_gemm_count; });
  s.window_k = median_of(cs, [](const CycleStats& c) { return c.window_k_count; });
  std::set<std::string> names;
  for (const CycleStats& c : cs)
    for (const auto& [name, n] : c.kernel_counts) names.insert(name);
  for (const std::string& name : names)
    s.kernel_counts[name] = median_of(cs, [&](const CycleStats& c) {
      const auto it = c.kernel_counts.find(name);
      return it == c.kernel_counts.end() ? 0 : it->second;
    });
  return s;
}

std::string fmt(double v) {
  if (std::isnan(v)) return "-";
  char buf[64];
  if (v == std::floor(v) && std::fabs(v) < 1e15)
    std::snprintf(buf, sizeof buf, "%.0f", v);
  else
    std::snprintf(buf, sizeof buf, "%.2f", v);
  return buf;
}

nlohmann::json num(double v) { return std::isnan(v) ? nlohmann::json(nullptr) : nlohmann::json(v); }

nlohmann::json cycle_json(const CycleStats& c) {
  nlohmann::json j;
  j["start_ns"] = c.start_ns;
  j["end_ns"] = c.end_ns;
  j["duration_us"] = num(c.duration_us());
  j["kernel_start_ns"] = c.kernel_start_ns;
  j["kernel_end_ns"] = c.kernel_end_ns;
  j["kernel_span_us"] = num(c.kernel_span_us());
  j["kernels"] = c.kernels;
  j["memcpys"] = c.memcpys;
  j["memsets"] = c.memsets;
  j["distinct_streams"] = c.distinct_streams;
  nlohmann::json per_stream = nlohmann::json::object();
  for (const auto& [stream, n] : c.kernels_per_stream) per_stream[std::to_string(stream)] = n;
  j["kernels_per_stream"] = per_stream;
  j["q_rope_stream"] = c.q_rope_stream;
  j["main_lane_kernels"] = c.main_lane_kernels;
  j["q_rope_count"] = c.q_rope_count;
  j["wqb_gemm_count"] = c.wqb_gemm_count;
  j["window_k_count"] = c.window_k_count;
  j["window_k_on_q_rope_lane"] = c.window_k_on_q_rope_lane;
  nlohmann::json layers = nlohmann::json::array();
  for (const LayerLanes& L : c.layers)
    layers.push_back({{"q_rope_stream", L.q_rope_stream},
                      {"window_k_stream", L.window_k_stream},
                      {"same_stream", L.same_stream},
                      {"window_k_lead_ns", L.window_k_lead_ns}});
  j["layers"] = layers;
  j["layer_time_us"] = num(c.layer_time_us);
  j["gemm_to_q_rope_gap_us"] = num(c.gemm_to_q_rope_gap_us);
  j["gap_samples"] = c.gap_samples;
  j["early_launches"] = c.early_launches;
  j["window_k_lead_us"] = num(c.window_k_lead_us);
  nlohmann::json counts = nlohmann::json::object();
  for (const auto& [name, n] : c.kernel_counts) counts[name] = n;
  j["kernel_counts"] = counts;
  return j;
}

nlohmann::json summary_json(const ColumnSummary& s) {
  nlohmann::json j;
  j["cycles"] = s.cycles;
  j["distinct_streams"] = num(s.streams);
  j["distinct_streams_min"] = s.streams_min;
  j["distinct_streams_max"] = s.streams_max;
  j["kernels"] = num(s.kernels);
  j["main_lane_kernels"] = num(s.main_lane_kernels);
  j["layers"] = num(s.layers);
  j["window_k_on_q_rope_lane"] = num(s.window_k_on_q_rope_lane);
  j["layer_time_us"] = num(s.layer_time_us);
  j["gemm_to_q_rope_gap_us"] = num(s.gap_us);
  j["early_launches"] = num(s.early_launches);
  j["window_k_lead_us"] = num(s.window_k_lead_us);
  j["cycle_us"] = num(s.cycle_us);
  nlohmann::json counts = nlohmann::json::object();
  for (const auto& [name, n] : s.kernel_counts) counts[name] = num(n);
  j["kernel_counts"] = counts;
  return j;
}

}  // namespace

std::string format_report_table(const std::vector<ReportColumn>& columns, bool with_kernel_counts) {
  std::vector<ColumnSummary> sums;
  for (const ReportColumn& c : columns) sums.push_back(summarize(c));

  std::vector<std::pair<std::string, std::vector<std::string>>> rows;
  const auto row = [&](std::string label, auto cell) {
    std::vector<std::string> cells;
    for (const ColumnSummary& s : sums) cells.push_back(cell(s));
    rows.emplace_back(std::move(label), std::move(cells));
  };
  row("cycles", [](const ColumnSummary& s) { return std::to_string(s.cycles); });
  row("distinct streams per cycle", [](const ColumnSummary& s) {
    if (s.cycles == 0) return std::string("-");
    return s.streams_min == s.streams_max ? std::to_string(s.streams_min)
                                          : std::to_string(s.streams_min) + "-" + std::to_string(s.streams_max);
  });
  row("kernels per cycle", [](const ColumnSummary& s) { return fmt(s.kernels); });
  row("kernels on the q_rope_store lane", [](const ColumnSummary& s) { return fmt(s.main_lane_kernels); });
  row("window-K write on the q_rope_store lane", [](const ColumnSummary& s) {
    return fmt(s.window_k_on_q_rope_lane) + "/" + fmt(s.layers);
  });
  row("layer time: median q_rope_store spacing (us)", [](const ColumnSummary& s) { return fmt(s.layer_time_us); });
  row("gap wq_b GEMM end -> q_rope_store start (us)", [](const ColumnSummary& s) { return fmt(s.gap_us); });
  row("q_rope_store launched early (gap < 0)", [](const ColumnSummary& s) { return fmt(s.early_launches); });
  row("window-K done before q_rope_store (us)", [](const ColumnSummary& s) { return fmt(s.window_k_lead_us); });
  row("cycle time: first kernel start to last kernel end (us)", [](const ColumnSummary& s) { return fmt(s.cycle_us); });
  row("record span incl. memcpy / memset (us)", [](const ColumnSummary& s) { return fmt(s.span_us); });
  row("q_rope_store / wq_b GEMM / window-K kernels", [](const ColumnSummary& s) {
    return fmt(s.q_rope) + " / " + fmt(s.wqb) + " / " + fmt(s.window_k);
  });
  if (with_kernel_counts) {
    std::set<std::string> names;
    for (const ColumnSummary& s : sums)
      for (const auto& [name, n] : s.kernel_counts) names.insert(name);
    for (const std::string& name : names)
      row("  " + name, [&](const ColumnSummary& s) {
        const auto it = s.kernel_counts.find(name);
        return it == s.kernel_counts.end() ? std::string("0") : fmt(it->second);
      });
  }

  size_t w0 = 0;
  for (const auto& r : rows) w0 = std::max(w0, r.first.size());
  std::vector<size_t> w(columns.size());
  for (size_t c = 0; c < columns.size(); ++c) {
    w[c] = columns[c].label.size();
    for (const auto& r : rows) w[c] = std::max(w[c], r.second[c].size());
  }
  std::ostringstream os;
  const auto line = [&](const std::string& label, const std::vector<std::string>& cells) {
    os << label << std::string(w0 - label.size(), ' ');
    for (size_t c = 0; c < cells.size(); ++c) os << " | " << std::string(w[c] - cells[c].size(), ' ') << cells[c];
    os << "\n";
  };
  std::vector<std::string> labels;
  for (const ReportColumn& c : columns) labels.push_back(c.label);
  line("", labels);
  size_t total = w0;
  for (size_t x : w) total += x + 3;
  os << std::string(total, '-') << "\n";
  for (const auto& r : rows) line(r.first, r.second);
  return os.str();
}

std::string report_json(const std::vector<ReportColumn>& columns, int indent) {
  nlohmann::json cols = nlohmann::json::array();
  for (const ReportColumn& c : columns) {
    nlohmann::json cycles = nlohmann::json::array();
    for (const CycleStats& cs : c.cycles) cycles.push_back(cycle_json(cs));
    cols.push_back({{"label", c.label}, {"summary", summary_json(summarize(c))}, {"cycles", cycles}});
  }
  return nlohmann::json{{"columns", cols}}.dump(indent);
}

std::string chrome_trace_json(const std::vector<TraceRecord>& cycle, const KernelClassifier& classify) {
  const std::vector<TraceRecord> recs = sorted_by_start(cycle);
  const uint64_t t0 = recs.empty() ? 0 : recs.front().start_ns;
  uint32_t main_lane = 0;
  bool have_main_lane = false;
  if (classify) {
    const CycleStats s = analyze_cycle(recs, classify);
    have_main_lane = s.q_rope_count > 0;
    main_lane = s.q_rope_stream;
  }
  nlohmann::json events = nlohmann::json::array();
  std::set<std::pair<uint32_t, uint32_t>> threads;  // (device, stream)
  for (const TraceRecord& r : recs) {
    nlohmann::json args = {{"graphNodeId", r.graph_node_id},
                           {"graphId", r.graph_id},
                           {"correlationId", r.correlation_id},
                           {"kind", to_string(r.kind)}};
    if (r.bytes) args["bytes"] = r.bytes;
    if (classify) args["role"] = to_string(classify(r));
    const uint64_t end = std::max(r.end_ns, r.start_ns);
    events.push_back({{"name", r.name},
                      {"ph", "X"},
                      {"ts", static_cast<double>(r.start_ns - t0) / 1000.0},
                      {"dur", static_cast<double>(end - r.start_ns) / 1000.0},
                      {"pid", r.device_id},
                      {"tid", r.stream_id},
                      {"args", args}});
    threads.insert({r.device_id, r.stream_id});
  }
  for (const auto& [dev, stream] : threads) {
    std::string name = "stream " + std::to_string(stream);
    if (have_main_lane && stream == main_lane) name += " (main lane)";
    events.push_back({{"name", "thread_name"}, {"ph", "M"}, {"pid", dev}, {"tid", stream}, {"args", {{"name", name}}}});
  }
  return nlohmann::json{{"traceEvents", events}, {"displayTimeUnit", "ns"}}.dump();
}

}  // namespace v4attn
