// `v4attn main`: the main job of scripts/main.sh. One decode or target-verify step of the
// attention stack after a synthetic prefill. The GPU stack is wired in through run_main_gpu()
// (a hook that still declines: the GPU stack is run by `v4attn bench` for now); without a GPU, or
// with --cpu, the CPU reference runs the step (src/reference/stack.cpp) on the reduced config and
// prints one line per layer: what ran, checksums of its outputs and caches, top-k size, time.
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "bench_runner.h"
#include "cli.h"
#include "runtime/cuda_utils.h"
#include "v4attn/config.h"
#include "v4attn/reference/dump.h"
#include "v4attn/reference/stack.h"

namespace v4attn::cli {

namespace {

struct MainOptions {
  std::string config_path;  // --config (CPU path: use this config instead of the reduced one)
  bool cpu = false;
  std::string mode = "verify";
  int bs = 1;
  int context = -1;  // -1: the path's default (CPU: 4096)
  int layers = -1;   // -1: all backbone layers
  bool full_config = false;
  bool draft = false;
  std::string dump_dir;
  std::string dump_layers;
  std::string json_path;
  uint64_t seed = 1;
};

constexpr int kCpuDefaultContext = 4096;

// THE GPU HOOK: the GPU prepare stack (src/prepare/) of the config (default: the full V4.1-Flash
// config) with device-random weights and a device prefill runs the step (default: target-verify,
// bs 1 = 6 rows, 64K context, CUDA graph, PDL) under the serial and the three-lane schedule, and
// prints the bench table with one column per schedule (tools/cmd_bench.cpp, run_gpu_bench). The
// CPU-only options (--dump, --dump-layers, --draft, --layers, --full-config) fall back to the CPU
// reference. Returns true when the GPU ran the step; a failed check (skipped rows, schedules
// disagreeing) throws (exit 1).
bool run_main_gpu(const MainOptions& options, std::ostream& out) {
  const MainOptions& o = options;
  if (!o.dump_dir.empty() || !o.dump_layers.empty() || o.draft || o.layers > 0 || o.full_config) {
    out << "GPU found, but --dump, --dump-layers, --draft, --layers and --full-config are CPU-path options: "
           "running the CPU reference.\n";
    return false;
  }
  BenchConfig c;
  c.config.config_path = o.config_path;
  c.schedules = {Schedule::kSerial, Schedule::kThreeLane};
  c.verify = o.mode == "verify";
  c.bs = o.bs;
  c.context = o.context < 0 ? 65536 : o.context;
  c.cycles = 10;  // a few cycles per schedule: the whole run stays around a minute
  c.warmup = 3;
  c.trace_cycles = 3;
  c.graph = true;
  c.knobs.pdl = true;
  c.knobs.seed = o.seed;
  c.json_path = o.json_path;
  bench_rows(c, load_config(o.config_path));  // usage errors before anything runs
  out << "GPU path: the prepare stack of every backbone layer on the GPU (device-random weights, device prefill), "
      << (c.verify ? "target-verify" : "decode") << " bs " << c.bs << " at context " << c.context
      << ", CUDA graph, PDL on; serial vs three-lane (--cpu runs the CPU reference instead)\n";
  const int code = run_gpu_bench(c, out, std::cerr);
  if (code != 0) throw std::runtime_error("GPU main: a check failed (see the lines above)");
  return true;
}

// "2,6,8-10" or "all" -> layer ids (checked against the config).
std::vector<int> parse_layer_list(const std::string& text, int total_layers) {
  std::vector<int> ids;
  if (text.empty() || text == "all") {
    for (int l = 0; l < total_layers; ++l) ids.push_back(l);
    return ids;
  }
  std::stringstream ss(text);
  for (std::string item; std::getline(ss, item, ',');) {
    try {
      size_t used = 0;
      const size_t dash = item.find('-', 1);
      const int a = std::stoi(item.substr(0, dash), &used);
      if (used != (dash == std::string::npos ? item.size() : dash)) throw std::invalid_argument(item);
      int b = a;
      if (dash != std::string::npos) {
        b = std::stoi(item.substr(dash + 1), &used);
        if (used != item.size() - dash - 1) throw std::invalid_argument(item);
      }
      if (a < 0 || b < a || b >= total_layers)
        throw UsageError("--dump-layers: " + item + " is outside the layers 0.." + std::to_string(total_layers - 1));
      for (int l = a; l <= b; ++l) ids.push_back(l);
    } catch (const UsageError&) {
      throw;
    } catch (const std::exception&) {
      throw UsageError("--dump-layers: cannot parse \"" + item + "\" (expected ids and ranges like 2,6,8-10 or all)");
    }
  }
  return ids;
}

std::string fmt(const char* f, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, f, v);
  return buf;
}

std::string describe(const ModelConfig& c) {
  return "dim " + std::to_string(c.dim) + ", " + std::to_string(c.n_layers) + " layers + " +
         std::to_string(c.n_mtp_layers) + " draft, " + std::to_string(c.n_heads) + " heads, index_topk " +
         std::to_string(c.index_topk) + ", window " + std::to_string(c.window_size);
}

int run_main_cpu(const MainOptions& o, bool gpu_present, const std::string& no_gpu_reason) {
  // With --json - the JSON document is the only thing on stdout; the table goes to stderr.
  const bool json_stdout = o.json_path == "-";
  std::ostream& out = json_stdout ? std::cerr : std::cout;

  ModelConfig cfg;
  std::string which;
  if (o.full_config || !o.config_path.empty()) {
    cfg = load_config(o.config_path);
    which = o.config_path.empty() ? "the full V4.1-Flash config" : "config " + cfg.source;
  } else {
    cfg = reduced_config();
    which = "the reduced config";
  }
  const ModelPlan plan = build_plan(cfg, 1);
  const int context = o.context < 0 ? kCpuDefaultContext : o.context;
  const bool verify = o.mode == "verify";
  const int rows_per_req = verify ? cfg.verify_rows_per_request() : 1;
  const int64_t total_rows = static_cast<int64_t>(o.bs) * rows_per_req;
  const bool long_run = o.full_config || !o.config_path.empty() || static_cast<int64_t>(context) * o.bs > 32768;
  const auto progress = [&](const std::string& line) {
    if (long_run) std::cerr << "[main] " << line << std::endl;
  };

  // Usage errors first, before anything is printed.
  std::vector<int> dump_ids;
  if (!o.dump_dir.empty()) dump_ids = parse_layer_list(o.dump_layers, cfg.total_layers());
  else if (!o.dump_layers.empty()) throw UsageError("--dump-layers needs --dump DIR");

  out << (gpu_present ? "CPU path (--cpu)" : "no GPU") << ": running the CPU reference on " << which << " ("
      << describe(cfg) << (gpu_present ? "" : "; " + no_gpu_reason) << ")\n";
  if (o.full_config || !o.config_path.empty())
    std::cerr << "warning: the CPU reference on a full-size config is slow (about a second or more per layer "
                 "and per row block, plus weight generation); the reduced config is the default\n";

  ref::StackOptions so;
  so.n_requests = o.bs;
  so.max_context = context + cfg.verify_rows_per_request();
  so.seed = o.seed;
  ref::RefStack stack(plan, so);
  out << (verify ? "verify" : "decode") << " step: bs " << o.bs << " x " << rows_per_req << " row"
      << (rows_per_req > 1 ? "s" : "") << " at context " << context << ", seed " << o.seed << "\n";

  ref::PrefillOptions po;
  po.progress = progress;
  const std::vector<int32_t> ctx(static_cast<size_t>(o.bs), context);
  const ref::PrefillStats ps = ref::synthetic_prefill(stack, ctx, po);
  out << "prefill: " << ps.window_rows << " window rows, " << ps.groups << " compressed groups (" << to_string(ps.path)
      << " path), " << fmt("%.2f", ps.ms / 1000.0) << " s\n";

  std::unique_ptr<ref::Dumper> dumper;
  ref::StepOptions step;
  step.max_layers = o.layers;
  step.include_draft = o.draft;
  if (!o.dump_dir.empty()) {
    dumper = std::make_unique<ref::Dumper>(o.dump_dir);
    step.dumper = dumper.get();
    step.dump_layers = dump_ids;
  }
  char line[320];
  std::snprintf(line, sizeof line, "%5s %5s %-11s %-20s %-16s %-16s %-16s %-16s %-16s %6s %8s\n", "layer", "ratio",
                "mode", "work", "out", "q", "window", "comp", "index_k", "topk", "ms");
  out << line;
  out.flush();
  step.on_layer = [&](const ref::LayerRecord& r) {
    const std::string work = work_items_string(r.work) + (r.attention ? " ATT" : "");
    const bool src = r.work & kWorkCMP;
    std::snprintf(line, sizeof line, "%5d %5d %-11s %-20s %-16s %-16s %-16s %-16s %-16s %6s %8.2f\n", r.layer, r.ratio,
                  to_string(r.mode), work.c_str(), ref::checksum_hex(r.out_checksum).c_str(),
                  ref::checksum_hex(r.q_checksum).c_str(), ref::checksum_hex(r.window_checksum).c_str(),
                  src ? ref::checksum_hex(r.comp_checksum).c_str() : "-",
                  src ? ref::checksum_hex(r.index_k_checksum).c_str() : "-",
                  r.ratio > 0 ? std::to_string(r.topk_count).c_str() : "-", r.prepare_ms + r.attention_ms);
    out << line;
    out.flush();
    progress("layer " + std::to_string(r.layer) + " done");
  };
  const BatchDesc batch = verify ? make_verify_batch(ctx, rows_per_req) : make_decode_batch(ctx);
  const ref::StepResult res = stack.run_step(batch, step);

  double prep = 0, att = 0;
  uint64_t stack_sum = ref::kFnvOffset;
  int64_t skipped = 0;
  for (const ref::LayerRecord& r : res.layers) {
    prep += r.prepare_ms;
    att += r.attention_ms;
    skipped += r.skipped;
    stack_sum = ref::fnv1a64(&r.out_checksum, sizeof r.out_checksum, stack_sum);
    stack_sum = ref::fnv1a64(&r.q_checksum, sizeof r.q_checksum, stack_sum);
  }
  out << "summary: " << res.layers.size() << (res.layers.size() == 1 ? " layer, " : " layers, ")
      << (verify ? "verify" : "decode") << " bs " << o.bs << " (" << total_rows << (total_rows == 1 ? " row" : " rows")
      << ") at context " << context << ": prepare " << fmt("%.3f", prep / 1000.0) << " s + attention "
      << fmt("%.3f", att / 1000.0) << " s = " << fmt("%.3f", res.total_ms / 1000.0) << " s; stack checksum "
      << ref::checksum_hex(stack_sum) << (skipped ? "; " + std::to_string(skipped) + " SKIPPED SLOTS" : "") << "\n";
  if (dumper) out << "dump: " << dumper->entries().size() << " tensors in " << o.dump_dir << " (manifest.json)\n";

  if (!o.json_path.empty()) {
    nlohmann::ordered_json j;
    j["path"] = "cpu";
    j["config"] = cfg.source;
    j["mode"] = o.mode;
    j["bs"] = o.bs;
    j["rows"] = total_rows;
    j["context"] = context;
    j["seed"] = o.seed;
    j["prefill"] = {{"path", to_string(ps.path)}, {"window_rows", ps.window_rows}, {"groups", ps.groups}, {"ms", ps.ms}};
    nlohmann::ordered_json layers = nlohmann::ordered_json::array();
    for (const ref::LayerRecord& r : res.layers) {
      nlohmann::ordered_json jl;
      jl["layer"] = r.layer;
      jl["ratio"] = r.ratio;
      jl["mode"] = to_string(r.mode);
      jl["kv_src"] = r.kv_src;
      jl["idx_src"] = r.idx_src;
      jl["work"] = work_items_string(r.work);
      jl["attention"] = r.attention;
      jl["out_checksum"] = ref::checksum_hex(r.out_checksum);
      jl["q_checksum"] = ref::checksum_hex(r.q_checksum);
      jl["window_checksum"] = ref::checksum_hex(r.window_checksum);
      if (r.work & kWorkCMP) {
        jl["comp_checksum"] = ref::checksum_hex(r.comp_checksum);
        jl["index_k_checksum"] = ref::checksum_hex(r.index_k_checksum);
      }
      if (r.ratio > 0) {
        jl["topk_checksum"] = ref::checksum_hex(r.topk_checksum);
        jl["topk_count"] = r.topk_count;
      }
      jl["skipped"] = r.skipped;
      jl["prepare_ms"] = r.prepare_ms;
      jl["attention_ms"] = r.attention_ms;
      layers.push_back(jl);
    }
    j["layers"] = layers;
    j["total_ms"] = res.total_ms;
    j["stack_checksum"] = ref::checksum_hex(stack_sum);
    if (json_stdout) {
      std::cout << j.dump(2) << "\n";
    } else {
      std::ofstream f(o.json_path, std::ios::trunc);
      f << j.dump(2) << "\n";
      f.close();
      if (!f) throw std::runtime_error("cannot write " + o.json_path);
    }
  }
  return skipped == 0 ? 0 : 1;
}

}  // namespace

void register_main_command(CLI::App& app, CommandResult& result) {
  auto o = std::make_shared<MainOptions>();
  CLI::App* sub = app.add_subcommand(
      "main", "The main job: one target-verify (or decode) step of the V4.1-Flash attention stack after a "
              "synthetic prefill. Without a GPU (or with --cpu) the CPU reference runs it on the reduced "
              "config and prints per layer what ran, checksums, top-k size and time.");
  sub->add_option("--config", o->config_path, "Config JSON file (CPU path: run this config instead of the reduced one)")
      ->type_name("FILE");
  sub->add_flag("--cpu", o->cpu, "Force the CPU reference path even when a GPU is present");
  sub->add_option("--mode", o->mode, "decode (one row per request) or verify (dspark_block_size + 1 rows per request)")
      ->check(CLI::IsMember({"decode", "verify"}))
      ->capture_default_str();
  sub->add_option("--bs", o->bs, "Requests in the batch")->check(CLI::Range(1, 4096))->capture_default_str();
  sub->add_option("--context", o->context, "Context length per request before the step (default: 4096 on the CPU path)")
      ->type_name("N")
      ->check(CLI::Range(0, 1 << 20));
  sub->add_option("--layers", o->layers, "Run only the first N backbone layers")->type_name("N")->check(CLI::Range(1, 1 << 16));
  sub->add_flag("--full-config", o->full_config,
                "CPU path on the real V4.1-Flash config (or --config FILE) instead of the reduced one (slow)");
  sub->add_flag("--draft", o->draft, "Also run the draft stages (window-only layers after the backbone)");
  sub->add_option("--dump", o->dump_dir, "Write the step's inputs, intermediates and outputs as .npy + manifest.json")
      ->type_name("DIR");
  sub->add_option("--dump-layers", o->dump_layers, "Layers to dump: ids and ranges like 2,6,8-10 (default: all)")
      ->type_name("LIST");
  sub->add_option("--json", o->json_path, "Write the per-layer table as JSON to FILE ('-': stdout, table to stderr)")
      ->type_name("FILE");
  sub->add_option("--seed", o->seed, "Seed of the synthetic weights and activations")->capture_default_str();
  sub->callback([o, &result] {
    result.action = [o] {
      std::string reason;
      const bool gpu = gpu_available(&reason);
      if (gpu && !o->cpu) {
        std::ostream& note = o->json_path == "-" ? std::cerr : std::cout;
        if (run_main_gpu(*o, note)) return 0;
      }
      return run_main_cpu(*o, gpu, reason.empty() ? "no usable CUDA device" : reason);
    };
  });
}

}  // namespace v4attn::cli
