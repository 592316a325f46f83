// `v4attn plan`: the layer plan of a config (roles, sources, work items, weights) as a table, or
// as JSON with --json; with --floor MODE:BS, the prepare cycle's bytes floor of such steps
// (cycle_floor.h: no GPU needed). Also the shared --config/--tp options and the plan summary.
#include <cstdio>
#include <iostream>
#include <memory>
#include <optional>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "cli.h"
#include "v4attn/config.h"
#include "v4attn/cycle_floor.h"

namespace v4attn::cli {

namespace {

constexpr LayerMode kModes[] = {LayerMode::kWindowOnly, LayerMode::kFull, LayerMode::kReindex,
                                LayerMode::kReuse, LayerMode::kDraft};

// Weights are reported in decimal megabytes (10^6 bytes), as model cards do.
std::string megabytes(int64_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f", static_cast<double>(bytes) / 1e6);
  return buf;
}

std::string layer_list(const std::vector<int>& layers) {
  std::string s = "[";
  for (size_t i = 0; i < layers.size(); ++i) s += (i ? ", " : "") + std::to_string(layers[i]);
  return s + "]";
}

const char* candidate_column(const LayerPlan& l) {
  if (l.is_candidate_source) return "src";
  if (l.uses_candidates) return "uses";
  return "-";
}

std::string source_column(int layer) { return layer < 0 ? "-" : std::to_string(layer); }

int64_t total_weight_bytes(const ModelPlan& plan) {
  int64_t total = 0;
  for (const LayerPlan& l : plan.layers) total += l.weight_bytes();
  return total;
}

void print_table(const ModelPlan& plan, std::ostream& out) {
  char line[160];
  std::snprintf(line, sizeof line, "%5s %5s %-11s %6s %7s %4s  %-16s %10s\n", "layer", "ratio",
                "mode", "kv_src", "idx_src", "cand", "work", "weight MB");
  out << line;
  for (const LayerPlan& l : plan.layers) {
    std::snprintf(line, sizeof line, "%5d %5d %-11s %6s %7s %4s  %-16s %10s\n", l.layer, l.ratio,
                  to_string(l.mode), source_column(l.kv_src).c_str(),
                  source_column(l.idx_src).c_str(), candidate_column(l),
                  work_items_string(l.work).c_str(), megabytes(l.weight_bytes()).c_str());
    out << line;
  }
  out << "\n";
  print_plan_summary(plan, out);
}

nlohmann::ordered_json plan_json(const ModelPlan& plan) {
  using nlohmann::ordered_json;
  const ModelConfig& c = plan.config;
  ordered_json j;
  j["source"] = c.source;
  j["config"] = ordered_json::parse(config_to_json(c));
  j["tp"] = plan.parallel.tp;
  j["local_heads"] = plan.parallel.local_heads;
  j["local_index_heads"] = plan.parallel.local_index_heads;
  j["local_groups"] = plan.parallel.local_groups;
  ordered_json layers = ordered_json::array();
  for (const LayerPlan& l : plan.layers) {
    ordered_json jl;
    jl["layer"] = l.layer;
    jl["ratio"] = l.ratio;
    jl["mode"] = to_string(l.mode);
    jl["kv_src"] = l.kv_src;
    jl["idx_src"] = l.idx_src;
    jl["is_kv_source"] = l.is_kv_source;
    jl["is_index_source"] = l.is_index_source;
    jl["is_candidate_source"] = l.is_candidate_source;
    jl["uses_candidates"] = l.uses_candidates;
    ordered_json work = ordered_json::array();
    std::istringstream items(work_items_string(l.work));
    for (std::string item; items >> item;) work.push_back(item);
    jl["work"] = work;
    ordered_json weights = ordered_json::array();
    for (const WeightSpec& w : l.weights)
      weights.push_back({{"name", w.name}, {"shape", w.shape}, {"dtype", to_string(w.dtype)},
                         {"bytes", w.bytes()}, {"use", w.use == WeightUse::kPrepare ? "prepare" : "attention"}});
    jl["weights"] = weights;
    jl["weight_bytes"] = l.weight_bytes();
    jl["prepare_weight_bytes"] = l.prepare_weight_bytes();
    layers.push_back(jl);
  }
  j["layers"] = layers;
  ordered_json counts;
  for (LayerMode m : kModes) counts[to_string(m)] = plan.count(m);
  j["counts"] = counts;
  j["total_weight_bytes"] = total_weight_bytes(plan);
  return j;
}

struct PlanOptions {
  ConfigOptions config;
  bool json = false;
  std::vector<std::string> floors;  // MODE:BS
  int context = 65536;
};

// The bytes floor of one step shape: bs requests at `context` prefilled positions, one row each
// (decode) or dspark_block_size + 1 (verify).
struct FloorRow {
  bool verify = false;
  int bs = 0, rows = 0;
  CycleFloor floor;
  std::optional<double> pytorch_us;
};

FloorRow floor_of(const ModelPlan& plan, const std::string& shape, int context) {
  const size_t colon = shape.find(':');
  const std::string mode = shape.substr(0, colon);
  int bs = 0;
  try {
    size_t used = 0;
    if (colon != std::string::npos) bs = std::stoi(shape.substr(colon + 1), &used);
    if (colon == std::string::npos || used != shape.size() - colon - 1) bs = 0;
  } catch (const std::exception&) {
    bs = 0;
  }
  if ((mode != "decode" && mode != "verify") || bs < 1 || bs > 4096)
    throw UsageError("--floor takes decode:BS or verify:BS (BS 1..4096), not '" + shape + "'");
  FloorRow r;
  r.verify = mode == "verify";
  r.bs = bs;
  r.rows = bs * (r.verify ? plan.config.dspark_block_size + 1 : 1);
  r.floor = prepare_cycle_floor(plan, r.verify, bs, context);
  r.pytorch_us = pytorch_reference_us(plan, r.verify, bs, context);
  return r;
}

void print_floors(const std::vector<FloorRow>& rows, int context, int tp, std::ostream& out) {
  out << "\nprepare cycle bytes floor (per rank at tp " << tp << ", context " << context
      << ", at " << kFloorBytesPerUs / 1e6 << " TB/s; weights read once, index-K reads of each request's rows):\n";
  char line[200];
  std::snprintf(line, sizeof line, "  %-12s %5s %14s %15s %11s %12s\n", "cycle", "rows", "weights GB", "index-K MB",
                "floor us", "PyTorch us");
  out << line;
  for (const FloorRow& r : rows) {
    const std::string name = std::string(r.verify ? "verify" : "decode") + " bs " + std::to_string(r.bs);
    std::snprintf(line, sizeof line, "  %-12s %5d %14.3f %15.1f %11.1f %12s\n", name.c_str(), r.rows,
                  static_cast<double>(r.floor.weight_bytes) / 1e9, static_cast<double>(r.floor.index_k_bytes) / 1e6,
                  r.floor.us(), r.pytorch_us ? std::to_string(static_cast<int>(*r.pytorch_us)).c_str() : "-");
    out << line;
  }
}

nlohmann::ordered_json floors_json(const std::vector<FloorRow>& rows, int context) {
  using nlohmann::ordered_json;
  ordered_json a = ordered_json::array();
  for (const FloorRow& r : rows) {
    ordered_json j;
    j["mode"] = r.verify ? "verify" : "decode";
    j["bs"] = r.bs;
    j["rows"] = r.rows;
    j["context"] = context;
    j["weight_bytes"] = r.floor.weight_bytes;
    j["index_k_bytes"] = r.floor.index_k_bytes;
    j["bytes"] = r.floor.bytes();
    j["us"] = r.floor.us();
    if (r.pytorch_us) j["pytorch_reference_us"] = *r.pytorch_us;
    a.push_back(j);
  }
  return a;
}

}  // namespace

void add_config_options(CLI::App& sub, ConfigOptions& options) {
  sub.add_option("--config", options.config_path,
                 "Config JSON file (default: the embedded DeepSeek-V4.1-Flash config)")
      ->type_name("FILE");
  sub.add_option("--tp", options.tp, "Tensor-parallel size: heads are split over N ranks")
      ->type_name("N")
      ->capture_default_str();
}

ModelPlan plan_from_options(const ConfigOptions& options) {
  return build_plan(load_config(options.config_path), options.tp);
}

void print_plan_summary(const ModelPlan& plan, std::ostream& out) {
  const ModelConfig& c = plan.config;
  const ParallelConfig& p = plan.parallel;
  out << "config " << c.source << ": " << c.total_layers() << " layers (" << c.n_layers
      << " backbone + " << c.n_mtp_layers << " draft stages), tp " << p.tp << " ("
      << p.local_heads << " heads, " << p.local_index_heads << " index heads, " << p.local_groups
      << " output groups per rank)\n";
  out << "modes:";
  for (LayerMode m : kModes) out << (m == kModes[0] ? " " : ", ") << plan.count(m) << " " << to_string(m);
  out << "\n";
  out << "kv sources " << layer_list(c.kv_source_layers) << ", index sources "
      << layer_list(c.index_source_layers) << ", candidate source "
      << (c.candidate_source_layer < 0 ? std::string("none") : std::to_string(c.candidate_source_layer))
      << "\n";
  out << "attention weights per rank: " << megabytes(total_weight_bytes(plan)) << " MB\n";
}

void register_plan_command(CLI::App& app, CommandResult& result) {
  auto options = std::make_shared<PlanOptions>();
  CLI::App* sub = app.add_subcommand(
      "plan", "Print the layer plan of a config: per layer its compress ratio, mode, kv and "
              "index sources, candidate role, prepare work items and weight size at a TP size.");
  add_config_options(*sub, options->config);
  sub->add_flag("--json", options->json, "Print the plan as JSON (only JSON on stdout)");
  sub->add_option("--floor", options->floors,
                  "Also the prepare cycle's bytes floor of these steps (decode:BS or verify:BS; repeatable): "
                  "its prepare weights plus the index-K reads of its rows, at 4.27 TB/s, and issue 6's "
                  "PyTorch figure where it has one (JSON: \"floors\")")
      ->type_name("MODE:BS");
  sub->add_option("--context", options->context, "Prefilled positions per request for --floor")
      ->type_name("N")
      ->capture_default_str()
      ->check(CLI::Range(0, 1 << 24));
  sub->callback([options, &result] {
    result.action = [options] {
      const ModelPlan plan = plan_from_options(options->config);
      std::vector<FloorRow> floors;
      for (const std::string& f : options->floors) floors.push_back(floor_of(plan, f, options->context));
      if (options->json) {
        nlohmann::ordered_json j = plan_json(plan);
        if (!floors.empty()) j["floors"] = floors_json(floors, options->context);
        std::cout << j.dump(2) << "\n";
      } else {
        print_table(plan, std::cout);
        if (!floors.empty()) print_floors(floors, options->context, plan.parallel.tp, std::cout);
      }
      return 0;
    };
  });
}

}  // namespace v4attn::cli
