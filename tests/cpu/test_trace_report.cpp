// Host-only pieces of the prepare runtime: schedule names and lanes (runtime/schedule.h), and
// the trace report over synthetic CUPTI-like records (v4attn/trace.h).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "v4attn/runtime/schedule.h"
#include "v4attn/trace.h"

namespace v4attn {
namespace {

// --- schedules ------------------------------------------------------------------------------------

TEST(Schedule, NamesRoundTripAndBadNamesRefused) {
  for (Schedule s : kAllSchedules) EXPECT_EQ(parse_schedule(to_string(s)), s);
  EXPECT_EQ(parse_schedule("sources_side"), Schedule::kSourcesSide);
  EXPECT_EQ(parse_schedule("three_lane"), Schedule::kThreeLane);
  EXPECT_STREQ(to_string(Schedule::kSerial), "serial");
  EXPECT_STREQ(to_string(Schedule::kSourcesSide), "sources-side");
  EXPECT_STREQ(to_string(Schedule::kThreeLane), "three-lane");
  EXPECT_THROW(parse_schedule("three-lanes"), std::invalid_argument);
  EXPECT_THROW(parse_schedule(""), std::invalid_argument);
  EXPECT_THROW(parse_schedule("Serial"), std::invalid_argument);
}

// prepare-schedule.md, "Three schedules": serial all main; sources-side CMP + IDX on S;
// three-lane CMP + IDX on S, KV on K.
TEST(Schedule, WorkItemLanesFollowTheSpec) {
  struct Row {
    WorkItem item;
    Lane serial, sources_side, three_lane;
  };
  const Row rows[] = {
      {kWorkQA, Lane::kMain, Lane::kMain, Lane::kMain},  {kWorkQB, Lane::kMain, Lane::kMain, Lane::kMain},
      {kWorkKV, Lane::kMain, Lane::kMain, Lane::kK},     {kWorkCMP, Lane::kMain, Lane::kS, Lane::kS},
      {kWorkIDX, Lane::kMain, Lane::kS, Lane::kS},
  };
  for (const Row& r : rows) {
    EXPECT_EQ(lane_for(Schedule::kSerial, r.item), r.serial) << r.item;
    EXPECT_EQ(lane_for(Schedule::kSourcesSide, r.item), r.sources_side) << r.item;
    EXPECT_EQ(lane_for(Schedule::kThreeLane, r.item), r.three_lane) << r.item;
  }
  EXPECT_THROW(lane_for(Schedule::kSerial, static_cast<WorkItem>(kWorkQA | kWorkQB)), std::invalid_argument);
  EXPECT_STREQ(to_string(Lane::kK), "K");
}

// --- names and classifier -------------------------------------------------------------------------

TEST(TraceReport, KernelFunctionNameStripsParameters) {
  EXPECT_EQ(kernel_function_name("(anonymous namespace)::syn_qa(Params)"), "(anonymous namespace)::syn_qa");
  EXPECT_EQ(kernel_function_name("void ns::k<int, (f)(int)>(float const*, int (*)(int))"), "ns::k<int, (f)(int)>");
  EXPECT_EQ(kernel_function_name("plain_name"), "plain_name");
  EXPECT_EQ(kernel_function_name("memcpy HtoD"), "memcpy HtoD");
  EXPECT_EQ(kernel_function_name("(broken"), "(broken");
}

TEST(TraceReport, RegexClassifier) {
  const KernelClassifier c = make_regex_classifier({"q_rope_store", "wq_b_gemm", "window_k", "^cycle_marker"});
  TraceRecord r;
  r.name = "v4attn::q_rope_store_kernel(P)";
  EXPECT_EQ(c(r), KernelRole::kQRopeStore);
  r.name = "fp8_wq_b_gemm<64>";
  EXPECT_EQ(c(r), KernelRole::kWqbGemm);
  r.name = "window_k_store";
  EXPECT_EQ(c(r), KernelRole::kWindowKWrite);
  r.name = "cycle_marker()";
  EXPECT_EQ(c(r), KernelRole::kCycleStart);
  r.name = "x_cycle_marker()";
  EXPECT_EQ(c(r), KernelRole::kOther);
  r.name = "window_k_store";
  r.kind = TraceKind::kMemcpy;  // only kernels get roles
  EXPECT_EQ(c(r), KernelRole::kOther);
  EXPECT_THROW(make_regex_classifier({"(unclosed", "", "", ""}), std::invalid_argument);
}

// --- synthetic cycles -----------------------------------------------------------------------------

constexpr uint32_t kMainStream = 7, kSideS = 13, kSideK = 21;

// A memcpy / memset record (no graph node).
TraceRecord transfer(TraceKind kind, const std::string& name, uint32_t stream, uint64_t start, uint64_t end) {
  TraceRecord r;
  r.kind = kind;
  r.name = name;
  r.stream_id = stream;
  r.start_ns = start;
  r.end_ns = end;
  return r;
}

TraceRecord kernel(const std::string& name, uint32_t stream, uint64_t start, uint64_t end, uint32_t corr = 0,
                   uint64_t node = 0) {
  TraceRecord r;
  r.kind = TraceKind::kKernel;
  r.name = name;
  r.stream_id = stream;
  r.start_ns = start;
  r.end_ns = end;
  r.correlation_id = corr;
  r.graph_node_id = node;
  r.graph_id = node ? 1 : 0;
  return r;
}

const KernelClassifier& syn_classifier() {
  static const KernelClassifier c = make_regex_classifier({"q_rope_store", "wq_b", "window_k", "embed"});
  return c;
}

struct SynCycle {
  std::vector<TraceRecord> records;  // shuffled (the report must not rely on input order)
  std::vector<double> spacing_us;    // q_rope_store start spacings
  std::vector<double> gaps_us;       // q_rope start - wq_b end, per layer
  std::vector<double> leads_us;      // q_rope start - window-K end, per layer
  int k_on_main = 0;
};

// One cycle of `layers` layers: embed; per layer qa, wq_b, q_rope_store on main, window_k on K
// (or on main for the layers in k_on_main_layers), compressor on S every 4th layer, attention.
SynCycle make_cycle(std::mt19937& rng, int layers, uint64_t t0, uint32_t corr, const std::vector<int>& k_on_main_layers) {
  SynCycle c;
  std::uniform_int_distribution<int> spacing(9000, 13000), gap(-600, 600), kdur(300, 900);
  uint64_t node = 1;
  c.records.push_back(kernel("embed(int)", kMainStream, t0, t0 + 1000, corr, node++));
  uint64_t base = t0 + 1500;
  uint64_t prev_q = 0;
  for (int l = 0; l < layers; ++l) {
    c.records.push_back(kernel("qa_gemm(P)", kMainStream, base, base + 2000, corr, node++));
    const bool k_main = std::find(k_on_main_layers.begin(), k_on_main_layers.end(), l) != k_on_main_layers.end();
    const uint64_t k_start = base + 2100, k_end = k_start + static_cast<uint64_t>(kdur(rng));
    c.records.push_back(kernel("window_k_write(P)", k_main ? kMainStream : kSideK, k_start, k_end, corr, node++));
    if (k_main) ++c.k_on_main;
    if (l % 4 == 0) c.records.push_back(kernel("compressor(P)", kSideS, base + 100, base + 3000, corr, node++));
    const uint64_t g_start = base + 2500, g_end = base + 5000;
    c.records.push_back(kernel("wq_b_gemm(P)", kMainStream, g_start, g_end, corr, node++));
    int g = gap(rng);
    if (g == 0) g = 1;
    const uint64_t q_start = static_cast<uint64_t>(static_cast<int64_t>(g_end) + g);
    c.records.push_back(kernel("q_rope_store(P)", kMainStream, q_start, q_start + 800, corr, node++));
    c.gaps_us.push_back(g / 1000.0);
    c.leads_us.push_back((static_cast<double>(q_start) - static_cast<double>(k_end)) / 1000.0);
    if (l > 0) c.spacing_us.push_back(static_cast<double>(q_start - prev_q) / 1000.0);
    prev_q = q_start;
    c.records.push_back(kernel("attention(P)", kMainStream, q_start + 900, q_start + 3000, corr, node++));
    base += static_cast<uint64_t>(spacing(rng));
  }
  std::shuffle(c.records.begin(), c.records.end(), rng);
  return c;
}

double sorted_median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2.0;
}

TEST(TraceReport, MedianOfSamples) {
  EXPECT_DOUBLE_EQ(median({3.0, 1.0, 2.0}), 2.0);
  EXPECT_DOUBLE_EQ(median({4.0, 1.0, 3.0, 2.0}), 2.5);
  EXPECT_DOUBLE_EQ(median({-1.0, NAN, -3.0}), -2.0);  // NaN samples ignored
  EXPECT_TRUE(std::isnan(median({})));
}

TEST(TraceReport, CycleStatsStreamsLanesSpacingAndGaps) {
  std::mt19937 rng(20261130);
  const int layers = 40;
  const SynCycle c = make_cycle(rng, layers, 1'000'000, 99, {3, 17});
  const CycleStats s = analyze_cycle(c.records, syn_classifier());

  const int cmp_kernels = (layers + 3) / 4;
  EXPECT_EQ(s.kernels, 1 + layers * 5 + cmp_kernels);
  EXPECT_EQ(s.distinct_streams, 3);
  EXPECT_EQ(s.q_rope_stream, kMainStream);
  EXPECT_EQ(s.kernels_per_stream.at(kSideS), cmp_kernels);
  EXPECT_EQ(s.kernels_per_stream.at(kSideK), layers - 2);
  EXPECT_EQ(s.kernels_per_stream.at(kMainStream), 1 + layers * 4 + 2);
  EXPECT_EQ(s.main_lane_kernels, s.kernels_per_stream.at(kMainStream));
  EXPECT_EQ(s.q_rope_count, layers);
  EXPECT_EQ(s.wqb_gemm_count, layers);
  EXPECT_EQ(s.window_k_count, layers);
  ASSERT_EQ(s.layers.size(), static_cast<size_t>(layers));
  EXPECT_EQ(s.window_k_on_q_rope_lane, 2);
  EXPECT_TRUE(s.layers[3].same_stream);
  EXPECT_TRUE(s.layers[17].same_stream);
  EXPECT_FALSE(s.layers[4].same_stream);
  EXPECT_EQ(s.layers[4].window_k_stream, kSideK);

  EXPECT_DOUBLE_EQ(s.layer_time_us, sorted_median(c.spacing_us));
  EXPECT_EQ(s.gap_samples, layers);
  EXPECT_DOUBLE_EQ(s.gemm_to_q_rope_gap_us, sorted_median(c.gaps_us));
  EXPECT_EQ(s.early_launches, static_cast<int>(std::count_if(c.gaps_us.begin(), c.gaps_us.end(), [](double g) { return g < 0; })));
  EXPECT_DOUBLE_EQ(s.window_k_lead_us, sorted_median(c.leads_us));
  EXPECT_EQ(s.kernel_counts.at("q_rope_store"), layers);
  EXPECT_EQ(s.kernel_counts.at("compressor"), cmp_kernels);
  EXPECT_EQ(s.kernel_counts.at("embed"), 1);
}

TEST(TraceReport, NegativeGapWhenEveryQRopeStoreLaunchesEarly) {
  std::vector<TraceRecord> r;
  for (int l = 0; l < 5; ++l) {
    const uint64_t b = 10'000 + 10'000ull * l;
    r.push_back(kernel("wq_b", kMainStream, b, b + 4000));
    r.push_back(kernel("q_rope_store", kMainStream, b + 4000 - 320, b + 4500));  // PDL: 0.32 us early
  }
  const CycleStats s = analyze_cycle(r, syn_classifier());
  EXPECT_DOUBLE_EQ(s.gemm_to_q_rope_gap_us, -0.32);
  EXPECT_EQ(s.early_launches, 5);
  EXPECT_DOUBLE_EQ(s.layer_time_us, 10.0);
  EXPECT_EQ(s.window_k_count, 0);
  EXPECT_TRUE(s.layers.empty());
  EXPECT_TRUE(std::isnan(s.window_k_lead_us));
}

// The cycle time is the kernels' span: an anchor memset recorded long before the first kernel
// (traced cycles, docs/perf.md session 6) stays out of it, but not out of the record span.
TEST(TraceReport, CycleTimeIsTheKernelSpan) {
  std::vector<TraceRecord> r;
  const TraceRecord anchor = transfer(TraceKind::kMemset, "memset", kMainStream, 1'000, 1'500);
  r.push_back(anchor);
  r.push_back(kernel("wq_b", kMainStream, 460'000, 470'000));
  r.push_back(kernel("q_rope_store", kMainStream, 469'000, 471'000));
  r.push_back(kernel("compressor", kSideS, 465'000, 480'000));  // a side lane ends last
  const CycleStats s = analyze_cycle(r, syn_classifier());
  EXPECT_EQ(s.memsets, 1);
  EXPECT_EQ(s.kernel_start_ns, 460'000u);
  EXPECT_EQ(s.kernel_end_ns, 480'000u);
  EXPECT_DOUBLE_EQ(s.kernel_span_us(), 20.0);
  EXPECT_DOUBLE_EQ(s.duration_us(), 479.0);
  ReportColumn col;
  col.label = "three-lane";
  col.cycles = {s};
  const std::string table = format_report_table({col}, false);
  const auto row_value = [&](const std::string& label) {  // the cell right of the row's label
    const size_t at = table.find(label);
    if (at == std::string::npos) return std::string("(no row)");
    const size_t bar = table.find('|', at), eol = table.find('\n', at);
    std::string v = table.substr(bar + 1, eol - bar - 1);
    v.erase(0, v.find_first_not_of(' '));
    return v;
  };
  EXPECT_EQ(row_value("cycle time: first kernel start to last kernel end (us)"), "20") << table;
  EXPECT_EQ(row_value("record span incl. memcpy / memset (us)"), "479") << table;
  const CycleStats none = analyze_cycle({anchor}, syn_classifier());  // no kernel: no span
  EXPECT_DOUBLE_EQ(none.kernel_span_us(), 0.0);
}

// A layer whose wq_b GEMM record is missing gives no gap sample (not a gap to an older GEMM).
TEST(TraceReport, GapNeedsTheGemmOfTheSameLayer) {
  std::vector<TraceRecord> r;
  r.push_back(kernel("wq_b", kMainStream, 0, 1000));
  r.push_back(kernel("q_rope_store", kMainStream, 1500, 2000));
  r.push_back(kernel("q_rope_store", kMainStream, 9500, 10000));  // its GEMM is missing
  r.push_back(kernel("wq_b", kSideS, 9000, 9200));                // on another stream: not its GEMM
  const CycleStats s = analyze_cycle(r, syn_classifier());
  EXPECT_EQ(s.gap_samples, 1);
  EXPECT_DOUBLE_EQ(s.gemm_to_q_rope_gap_us, 0.5);
}

TEST(TraceReport, SplitCycles) {
  std::mt19937 rng(7);
  std::vector<TraceRecord> all;
  std::vector<uint64_t> bounds;
  std::vector<size_t> sizes;
  for (int cyc = 0; cyc < 3; ++cyc) {
    const uint64_t t0 = 1'000'000ull * (cyc + 1);
    bounds.push_back(t0 - 10);
    SynCycle c = make_cycle(rng, 6, t0, 100 + cyc, {});
    sizes.push_back(c.records.size());
    all.insert(all.end(), c.records.begin(), c.records.end());
  }
  bounds.push_back(4'000'000);
  TraceRecord eager = kernel("eager_kernel", 3, 5'000'000, 5'000'100, 555, 0);  // after the last boundary
  all.push_back(eager);
  std::shuffle(all.begin(), all.end(), rng);

  const auto by_time = split_cycles_by_time(all, bounds);
  ASSERT_EQ(by_time.size(), 3u);
  for (int c = 0; c < 3; ++c) {
    EXPECT_EQ(by_time[c].size(), sizes[c]);
    EXPECT_TRUE(std::is_sorted(by_time[c].begin(), by_time[c].end(),
                               [](const TraceRecord& a, const TraceRecord& b) { return a.start_ns < b.start_ns; }));
    for (const TraceRecord& r : by_time[c]) EXPECT_EQ(r.correlation_id, 100u + c);
  }
  EXPECT_THROW(split_cycles_by_time(all, {5, 5}), std::invalid_argument);

  const auto by_marker = split_cycles_by_marker(all, syn_classifier());
  ASSERT_EQ(by_marker.size(), 3u);
  EXPECT_EQ(by_marker[0].size(), sizes[0]);
  EXPECT_EQ(by_marker[2].size(), sizes[2] + 1);  // the eager kernel comes after the last marker
  EXPECT_EQ(by_marker[1].front().name, "embed(int)");

  const auto by_launch = split_cycles_by_graph_launch(all);
  ASSERT_EQ(by_launch.size(), 3u);
  for (int c = 0; c < 3; ++c) {
    EXPECT_EQ(by_launch[c].size(), sizes[c]);
    EXPECT_EQ(by_launch[c].front().correlation_id, 100u + c);
  }
}

std::vector<ReportColumn> three_columns(std::mt19937& rng) {
  std::vector<ReportColumn> cols;
  const std::vector<std::pair<std::string, std::vector<int>>> cfg = {
      {"sources-side", {0, 1, 2, 3, 4, 5, 6, 7}}, {"three-lane", {}}};
  for (const auto& [label, k_main] : cfg) {
    ReportColumn col{label, {}};
    for (int cyc = 0; cyc < 3; ++cyc) col.cycles.push_back(analyze_cycle(make_cycle(rng, 8, 1000, 1, k_main).records, syn_classifier()));
    cols.push_back(col);
  }
  cols.push_back({"empty", {}});
  return cols;
}

TEST(TraceReport, JsonReportIsWellFormed) {
  std::mt19937 rng(11);
  const auto cols = three_columns(rng);
  const nlohmann::json j = nlohmann::json::parse(report_json(cols));
  ASSERT_EQ(j.at("columns").size(), 3u);
  const auto& side = j["columns"][0];
  EXPECT_EQ(side["label"], "sources-side");
  EXPECT_EQ(side["summary"]["cycles"], 3);
  EXPECT_EQ(side["summary"]["window_k_on_q_rope_lane"].get<double>(), 8.0);
  EXPECT_EQ(side["summary"]["distinct_streams"].get<double>(), 2.0);  // main + S (K unused)
  ASSERT_EQ(side["cycles"].size(), 3u);
  EXPECT_EQ(side["cycles"][0]["layers"].size(), 8u);
  EXPECT_TRUE(side["cycles"][0]["layers"][0]["same_stream"].get<bool>());
  EXPECT_EQ(side["cycles"][0]["kernel_counts"]["q_rope_store"], 8);
  EXPECT_EQ(side["cycles"][0]["kernels_per_stream"][std::to_string(kSideS)], 2);
  const auto& three = j["columns"][1];
  EXPECT_EQ(three["summary"]["window_k_on_q_rope_lane"].get<double>(), 0.0);
  EXPECT_EQ(three["summary"]["distinct_streams_max"], 3);
  EXPECT_DOUBLE_EQ(three["cycles"][1]["layer_time_us"].get<double>(), cols[1].cycles[1].layer_time_us);
  // NaN (no samples) is written as null, which keeps the JSON valid.
  EXPECT_TRUE(j["columns"][2]["summary"]["layer_time_us"].is_null());
  EXPECT_EQ(nlohmann::json::parse(report_json(cols, -1)), j);
}

TEST(TraceReport, TextTableHasOneColumnPerSchedule) {
  std::mt19937 rng(12);
  const auto cols = three_columns(rng);
  const std::string t = format_report_table(cols);
  const std::string header = t.substr(0, t.find('\n'));
  for (const char* label : {"sources-side", "three-lane", "empty"}) EXPECT_NE(header.find(label), std::string::npos) << t;
  EXPECT_NE(t.find("window-K write on the q_rope_store lane"), std::string::npos);
  EXPECT_NE(t.find("8/8"), std::string::npos) << t;  // sources-side: every layer on the Q lane
  EXPECT_NE(t.find("0/8"), std::string::npos) << t;  // three-lane: none
  EXPECT_NE(t.find("  q_rope_store"), std::string::npos) << t;
  EXPECT_EQ(format_report_table(cols, false).find("  q_rope_store"), std::string::npos);
  // Every row has the same number of column separators.
  size_t pos = 0, lines = 0;
  while (pos < t.size()) {
    const size_t nl = t.find('\n', pos);
    const std::string line = t.substr(pos, nl - pos);
    if (line.find('|') != std::string::npos) {
      EXPECT_EQ(std::count(line.begin(), line.end(), '|'), 3) << line;
      ++lines;
    }
    pos = nl + 1;
  }
  EXPECT_GT(lines, 10u);
}

TEST(TraceReport, ChromeTraceOfOneCycle) {
  std::mt19937 rng(13);
  SynCycle c = make_cycle(rng, 4, 5'000'000, 42, {});
  TraceRecord copy = transfer(TraceKind::kMemcpy, "memcpy HtoD", kMainStream, 4'999'000, 4'999'500);
  copy.bytes = 4096;
  c.records.push_back(copy);
  const nlohmann::json j = nlohmann::json::parse(chrome_trace_json(c.records, syn_classifier()));
  const auto& ev = j.at("traceEvents");
  size_t complete = 0, meta = 0;
  bool main_named = false;
  for (const auto& e : ev) {
    if (e["ph"] == "X") {
      ++complete;
      EXPECT_GE(e["ts"].get<double>(), 0.0);
      EXPECT_GE(e["dur"].get<double>(), 0.0);
      EXPECT_TRUE(e["args"].contains("graphNodeId"));
      if (e["name"] == "memcpy HtoD") {
        EXPECT_DOUBLE_EQ(e["ts"].get<double>(), 0.0);  // the earliest record is the time origin
        EXPECT_DOUBLE_EQ(e["dur"].get<double>(), 0.5);
        EXPECT_EQ(e["args"]["bytes"], 4096);
        EXPECT_EQ(e["args"]["kind"], "memcpy");
      }
      if (e["name"] == "q_rope_store(P)") {
        EXPECT_EQ(e["tid"], kMainStream);
        EXPECT_EQ(e["args"]["role"], "q_rope_store");
        EXPECT_EQ(e["args"]["correlationId"], 42);
      }
    } else {
      EXPECT_EQ(e["ph"], "M");
      ++meta;
      if (e["tid"] == kMainStream) main_named = e["args"]["name"].get<std::string>().find("main lane") != std::string::npos;
    }
  }
  EXPECT_EQ(complete, c.records.size());
  EXPECT_EQ(meta, 3u);  // main, S, K
  EXPECT_TRUE(main_named);
  // Without a classifier: no roles, still valid.
  const nlohmann::json plain = nlohmann::json::parse(chrome_trace_json(c.records));
  EXPECT_FALSE(plain["traceEvents"][0]["args"].contains("role"));
  EXPECT_EQ(nlohmann::json::parse(chrome_trace_json({}))["traceEvents"].size(), 0u);
}

}  // namespace
}  // namespace v4attn
