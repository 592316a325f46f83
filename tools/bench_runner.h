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
#include "v4attn/prepare/stack.h"
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
  // Every knob of the stack (PDL, GEMM versions, schedule experiments, kernel launch shapes,
  // seed) with the stack's own defaults; run_gpu_bench sets the sizes, buckets and schedule.
  prepare::GpuStackOptions knobs;
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
