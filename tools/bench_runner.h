// The GPU prepare-stack benchmark behind `v4attn bench` (tools/cmd_bench.cpp) and the GPU path of
// `v4attn main` (tools/cmd_main.cpp): the full config in device-random mode, a device-side prefill,
// then per schedule: warm-up, CUDA-event-timed cycles, a few CUPTI-traced cycles, the report table
// of include/v4attn/trace.h with one column per schedule.
#pragma once

#include <cstdint>
#include <iosfwd>
#include <string>
#include <vector>

#include "cli.h"
#include "v4attn/kernels/gemm.h"
#include "v4attn/runtime/lanes.h"
#include "v4attn/runtime/schedule.h"

namespace v4attn::cli {

struct BenchConfig {
  ConfigOptions config;                 // --config, --tp
  std::vector<Schedule> schedules;      // in column order
  bool verify = true;                   // verify (dspark_block_size + 1 rows per request) or decode
  int bs = 1;                           // requests
  int context = 65536;                  // prefilled positions per request
  int cycles = 20;                      // timed cycles per schedule
  int warmup = 3;                       // untimed cycles per schedule (the first one captures)
  int trace_cycles = 5;                 // CUPTI-traced cycles per schedule (0: no trace)
  bool graph = true;                    // CUDA-graph replay (else eager launches)
  bool pdl = true;                      // q_rope_store with PDL
  bool pdl_everywhere = true;           // with pdl: every kernel of the cycle
  bool fuse_x_quant = false;            // wq_a|wkv v3 GEMM quantises x itself (GpuStackOptions::fuse_x_quant)
  kernels::GemmVersion gemm = kernels::GemmVersion::kAuto;
  LayerIssue::SFork s_fork = LayerIssue::SFork::kAtLayerStart;
  bool lane_prologue = false;
  int scores_group_rows = 0;            // indexer scores: rows per CTA (0: the stack's default)
  int scores_steps = 0;                 // indexer scores: steps per warp (0: automatic)
  int scores_row_split = 0;             // indexer scores: warp sets per CTA splitting its rows (0: automatic)
  int scores_min_blocks = 0;            // indexer scores: register cap, CTAs per SM (0: 3)
  int side_priority = 0;                // CUDA stream priority of the side lanes (0: default)
  kernels::GemmVersion gemm_small = kernels::GemmVersion::kAuto;  // bf16 / fp32 GEMMs (kAuto: follow gemm)
  bool idx_gemm_on_main = true;         // indexer wq_b GEMM on main after q_norm
  int select_cluster = 0;               // selection v3 cluster size (0: automatic)
  bool qnorm_trigger_late = false;      // q_norm triggers its successor after its last store
  bool idx_scores_on_main = false;      // reindex layers: q pack + scores on main before wq_b
  bool fuse_rope_store = false;         // q_rope_store fused into the wq_b GEMM's epilogue
  int select_version = 3;               // indexer top-k / candidate mask: v3 (cluster) or v2
  uint64_t seed = 1;
  std::string json_path;   // "" none, "-" stdout (then the table goes to `out`, which should be stderr)
  std::string trace_path;  // Chrome trace of one traced cycle of the last schedule ("" none)
};

// Rows per step: bs * (verify ? dspark_block_size + 1 : 1); must be <= 64 (UsageError otherwise).
int bench_rows(const BenchConfig& c, const ModelConfig& cfg);

// Runs the benchmark; the table and summary lines go to `out`, progress lines to `progress`.
// Returns the exit code: 0, or 1 when a check failed (a kernel skipped rows, schedules disagreed
// on the outputs). Throws UsageError / ConfigError for bad options, std::exception on failures.
// Needs a GPU (the caller checks gpu_available()).
int run_gpu_bench(const BenchConfig& c, std::ostream& out, std::ostream& progress);

}  // namespace v4attn::cli
