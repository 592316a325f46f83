// Probe of the weight stream of the TMA GEMMs (v2 gemm_wgmma.cu, v3 gemm_wgmma_pipelined.cu, the
// fused Q chain) with no compute at all: what bandwidth one CTA per SM reaches when it streams a
// row-major byte matrix in the GEMMs' boxes -- {128 bytes of K, box_rows rows}, 128B swizzle -- through
// a ring of `depth` slots, refilling a slot as soon as its box has landed. It is the "nothing but the
// bytes" bound the GEMMs are compared with (docs/perf.md session 13: the QA GEMM's 9.2 MB stream in
// 2.5 us per launch with PDL, 4.0 us without; v3 takes 7.4 us).
//
// Each CTA walks `rounds` row blocks and all K / 128 chunks of its K range, like a GEMM tile walking K;
// one thread issues (the GEMMs' producer). --splits S lays the CTAs out like a split-K GEMM: CTA c
// reads tile c / S, K range c % S of a matrix S * K bytes wide (without it: tile c, the whole K).
// Bytes per launch = rounds * grid * box_rows * K; the matrix is sized to that, so every byte is read
// once per launch. Two timings: us_event, one launch timed alone with events after an L2 flush
// (includes the host launch latency); us_graph (--graph N, default 20), N launches back to back in one
// CUDA graph over rotated copies of the matrix (--rotate-mb, default 192 MiB: more than 3x the L2, at
// most N copies), per launch -- how the engine runs its GEMMs and what bench_gemm's %floor uses. A
// "launch only" row per grid gives the graph time of the same kernel with no loads (barrier init and
// exit): the part of us_graph that is not the stream. GB/s and %floor (of 4.27 TB/s) use us_graph.
// CTA 0 also records when it saw each stage complete (%globaltimer from its start; last launch run).
//
// Usage: bench_tma_probe [--k 1280 5120] [--rows 64 128 256] [--depth 1 2 4 6 8] [--rounds 4]
//                        [--ctas 132] [--splits S] [--reps 20] [--graph 20] [--rotate-mb 192]
//                        [--cluster C [--cluster-sync]] [--pdl] [--threads T [--all-wait]]
//                        [--no-hint] [--json FILE]
// --cluster C: launched in clusters of C CTAs (v3's split-K clusters); --cluster-sync adds one cluster
// barrier before exit. --pdl: PDL launches, each CTA triggering its dependents at entry (the graph
// timing then lets launch i + 1 start its stream while launch i drains). --threads / --all-wait: a
// CTA of T threads of which every one polls every stage's barrier (a GEMM's consumers), not just the
// issuing thread. --no-hint: plain loads instead of the GEMMs' evict-first L2 policy.
#include <CLI/CLI.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "bench_common.h"
#include "gemm/hopper_ptx.cuh"
#include "gemm/tensor_map.h"
#include "kernels/device_common.cuh"
#include "runtime/cuda_utils.h"
#include "runtime/launch.h"

namespace v4attn::bench {
namespace {

using namespace kernels::hopper;

constexpr int kChunk = 128;              // K bytes per box (the 128B swizzle's row)
constexpr int kSmemAlign = 1024;         // 128B-swizzle atoms
constexpr int kSmemLimit = 227 * 1024;   // sm_90 opt-in dynamic shared memory per block
constexpr int kMaxDepth = 16;

constexpr int kMaxThreads = 384;
constexpr int kLandingStages = 64;  // stages whose landing time CTA 0 records

// landing[0] = CTA 0's start (%globaltimer), landing[1 + i] = when stage i was seen complete.
__global__ void __launch_bounds__(kMaxThreads, 1) tma_stream_kernel(const __grid_constant__ CUtensorMap map, int box_rows,
                                                           int depth, int chunks, int rounds, int splits, bool hint,
                                                           bool cluster_sync_at_end, bool all_wait,
                                                           unsigned long long* landing, unsigned int* sink) {
  extern __shared__ uint8_t smem_raw[];
  const uint32_t raw = smem_u32(smem_raw);
  const uint32_t base = (raw + (kSmemAlign - 1)) & ~static_cast<uint32_t>(kSmemAlign - 1);
  const uint32_t slot_bytes = static_cast<uint32_t>(box_rows * kChunk);
  const uint32_t bars = base + static_cast<uint32_t>(depth) * slot_bytes;
  const bool issuer = threadIdx.x == 0, recorder = issuer && blockIdx.x == 0;
  const unsigned long long t_start = dev::globaltimer_ns();
  if (issuer) {
    dev::pdl_launch_dependents();  // --pdl: the next launch may start (its loads are constant data)
    for (int s = 0; s < depth; ++s) mbar_init(bars + 8u * s, 1);
    fence_mbarrier_init();
  }
  if (blockDim.x > 32) __syncthreads();  // barriers initialised before any other thread waits
  const int total = rounds * chunks;
  auto issue = [&](int i) {
    const int s = i % depth, r = i / chunks, c = i - r * chunks;
    // CTA -> (tile, split): a split-K GEMM's CTA reads `chunks` chunks of its split's K range.
    const int tiles = static_cast<int>(gridDim.x) / splits, cta = static_cast<int>(blockIdx.x);
    const int tile = cta / splits, split = cta - tile * splits;
    const int row0 = (r * tiles + tile) * box_rows;
    const int k0 = (split * chunks + c) * kChunk;
    mbar_arrive_expect_tx(bars + 8u * s, slot_bytes);
    const uint32_t dst = base + static_cast<uint32_t>(s) * slot_bytes;
    if (hint) tma_load_weights_3d(dst, &map, bars + 8u * s, k0, row0, 0);  // the GEMMs' evict-first policy
    else tma_load_3d(dst, &map, bars + 8u * s, k0, row0, 0);
  };
  if (issuer)
    for (int i = 0; i < depth && i < total; ++i) issue(i);
  if (issuer || all_wait) {  // --all-wait: every thread polls every stage's barrier, like a GEMM's consumers
    for (int i = 0; i < total; ++i) {
      mbar_wait(bars + 8u * (i % depth), static_cast<uint32_t>((i / depth) & 1));
      if (recorder && i < kLandingStages) landing[1 + i] = dev::globaltimer_ns();
      if (all_wait && blockDim.x > 32) __syncthreads();  // nobody re-arms a slot another thread still polls
      if (issuer && i + depth < total) issue(i + depth);
    }
  }
  if (recorder) landing[0] = t_start;
  if (issuer) {
    // Touch the last slot so that the loads cannot be considered dead (they are not: TMA writes are
    // not elided, but the sink keeps the probe honest if that ever changes).
    uint32_t v;
    asm volatile("ld.shared.u32 %0, [%1];" : "=r"(v) : "r"(base));
    if (v == 0xdeadbeefu) atomicAdd(sink, 1u);
  }
  // --cluster-sync: one cluster barrier before exit (every thread of the cluster arrives), like v3's
  // split-K reduction (its cost alone).
  if (cluster_sync_at_end) cluster_sync();
}

struct Row {
  int64_t k = 0;
  int box_rows = 0, depth = 0, ctas = 0, rounds = 0;
  bool hint = true;
  int64_t bytes = 0;
  double us = 0.0;        // event-timed, one cold launch
  double graph_us = 0.0;  // per launch in a graph replay (0: not measured)
  std::vector<double> landing_us;  // CTA 0: when each stage was seen complete, from its start
  double gbps() const { return graph_us > 0.0 ? static_cast<double>(bytes) / graph_us / 1e3 : 0.0; }
};

constexpr double kMiB = 1024.0 * 1024.0;

}  // namespace
}  // namespace v4attn::bench

int main(int argc, char** argv) {
  using namespace v4attn;
  using namespace v4attn::bench;
  CLI::App app{"bench_tma_probe: bandwidth of a one-thread TMA weight stream per CTA (no compute) by box shape and ring depth"};
  v4attn::bench::add_version_flag(app, "bench_tma_probe");
  std::vector<int64_t> ks = {1280, 5120};
  std::vector<int> rows = {64, 128, 256};
  std::vector<int> depths = {1, 2, 4, 6, 8};
  int rounds = 4, ctas = 132, reps = 20, graph_launches = 20, cluster = 1, splits = 1;
  double rotate_mib = 192.0;  // > 3x the 60 MB L2
  bool no_hint = false, pdl = false, cluster_sync_at_end = false, all_wait = false;
  int threads = 32;
  std::string json_path;
  app.add_option("--k", ks, "K bytes per row (multiples of 128)")->delimiter(',');
  app.add_option("--rows", rows, "rows per box (8..256, multiple of 8)")->delimiter(',');
  app.add_option("--depth", depths, "ring slots per CTA (1..16; depth * rows * 128 must fit in 227 KB)")->delimiter(',');
  app.add_option("--rounds", rounds, "row blocks per CTA")->check(CLI::Range(1, 64));
  app.add_option("--ctas", ctas, "CTAs (one per SM)")->check(CLI::Range(1, 1024));
  app.add_option("--reps", reps, "timed launches per case (median)")->check(CLI::Range(3, 1000));
  app.add_option("--graph", graph_launches, "launches per timed CUDA graph (0: event timing only)")->check(CLI::Range(0, 200));
  app.add_option("--splits", splits, "split-K: CTA c reads K range c % S of a matrix S * K bytes wide (rows: tile c / S)")
      ->check(CLI::Range(1, 64));
  app.add_option("--rotate-mb", rotate_mib, "MiB of matrix copies the graph rotates over (at most --graph copies)")
      ->check(CLI::Range(1.0, 65536.0));
  app.add_option("--cluster", cluster, "CTAs per thread-block cluster (1 = no cluster launch; must divide --ctas)")
      ->check(CLI::Range(1, 8));
  app.add_flag("--cluster-sync", cluster_sync_at_end, "one cluster barrier before exit (needs --cluster > 1)");
  app.add_option("--threads", threads, "threads per CTA (32..384, multiple of 32)")->check(CLI::Range(32, kMaxThreads));
  app.add_flag("--all-wait", all_wait, "every thread polls every stage's barrier (default: the issuing thread only)");
  app.add_flag("--pdl", pdl, "launch with PDL (each launch triggers its dependents at entry)");
  app.add_flag("--no-hint", no_hint, "plain TMA loads (default: the GEMMs' evict-first L2 policy)");
  app.add_option("--json", json_path, "also write the rows as JSON");
  CLI11_PARSE(app, argc, argv);
  for (int64_t k : ks)
    if (k < kChunk || k % kChunk != 0) {
      std::fprintf(stderr, "bench_tma_probe: --k must be a positive multiple of 128 (got %lld)\n", static_cast<long long>(k));
      return 2;
    }
  for (int r : rows)
    if (r < 8 || r > 256 || r % 8 != 0) {
      std::fprintf(stderr, "bench_tma_probe: --rows must be 8..256 and a multiple of 8 (got %d)\n", r);
      return 2;
    }
  for (int d : depths)
    if (d < 1 || d > kMaxDepth) {
      std::fprintf(stderr, "bench_tma_probe: --depth must be 1..%d (got %d)\n", kMaxDepth, d);
      return 2;
    }
  if (ctas % cluster != 0) {
    std::fprintf(stderr, "bench_tma_probe: --cluster %d must divide --ctas %d\n", cluster, ctas);
    return 2;
  }
  if (threads % 32 != 0) {
    std::fprintf(stderr, "bench_tma_probe: --threads must be a multiple of 32 (got %d)\n", threads);
    return 2;
  }
  if (ctas % splits != 0) {
    std::fprintf(stderr, "bench_tma_probe: --splits %d must divide --ctas %d\n", splits, ctas);
    return 2;
  }
  if (cluster_sync_at_end && cluster < 2) {
    std::fprintf(stderr, "bench_tma_probe: --cluster-sync needs --cluster > 1\n");
    return 2;
  }
  if (!gpu_present("bench_tma_probe")) return 1;
  cudaStream_t stream = nullptr;
  V4_CUDA_CHECK(cudaStreamCreate(&stream));
  L2Flush l2;
  DeviceBuffer<unsigned int> sink(1);
  DeviceBuffer<unsigned long long> landing(1 + kLandingStages);
  V4_CUDA_CHECK(cudaMemset(sink.get(), 0, sizeof(unsigned int)));
  auto run_kernel = [&](cudaStream_t st, const CUtensorMap& map, size_t smem, int r, int d, int chunks) {
    LaunchConfig cfg;
    cfg.grid = dim3(static_cast<unsigned>(ctas));
    cfg.block = dim3(static_cast<unsigned>(threads));
    cfg.smem_bytes = smem;
    cfg.stream = st;
    cfg.pdl = pdl;
    cfg.cluster = dim3(static_cast<unsigned>(cluster));
    launch_kernel("tma_stream_kernel", tma_stream_kernel, cfg, map, r, d, chunks, rounds, splits, !no_hint, cluster_sync_at_end,
                  all_wait, landing.get(), sink.get());
  };
  std::vector<Row> out;
  std::printf("%6s %5s %5s %5s %9s %9s %9s %8s %7s\n", "K", "rows", "depth", "ctas", "MB", "us_event", "us_graph", "GB/s",
              "%floor");
  if (graph_launches > 0) {
    // The same kernel with nothing to load, at the largest shared-memory size of the sweep.
    const double us = graph_per_launch_us(
        [&](cudaStream_t st, int) { run_kernel(st, CUtensorMap{}, kSmemLimit, 8, 1, 0); },
        graph_launches, stream);
    std::printf("%6s %5s %5s %5d %9s %9s %9.2f %8s %7s   (launch only)\n", "-", "-", "-", ctas, "-", "-", us, "-", "-");
  }
  for (int64_t k : ks)
    for (int r : rows) {
      const int64_t n_rows = static_cast<int64_t>(rounds) * (ctas / splits) * r;
      const int64_t row_bytes = k * splits;
      const int64_t bytes = n_rows * row_bytes;
      const int copies = graph_launches > 0
          ? std::clamp(static_cast<int>(std::ceil(rotate_mib * kMiB / static_cast<double>(bytes))), 2, std::max(2, graph_launches))
          : 1;
      DeviceBuffer<uint8_t> w(static_cast<size_t>(bytes * copies));
      V4_CUDA_CHECK(cudaMemset(w.get(), 0x38, w.size()));  // e4m3 1.0: any bytes do
      std::vector<CUtensorMap> maps;
      for (int c = 0; c < copies; ++c)
        maps.push_back(kernels::detail::make_byte_tensor_map_sw128(
            "bench_tma_probe", w.get() + static_cast<size_t>(c) * static_cast<size_t>(bytes), static_cast<uint64_t>(row_bytes),
            static_cast<uint64_t>(n_rows), 1, static_cast<uint64_t>(row_bytes), static_cast<uint64_t>(bytes), kChunk,
            static_cast<uint32_t>(r)));
      for (int d : depths) {
        const size_t smem = static_cast<size_t>(d) * r * kChunk + 8 * kMaxDepth + kSmemAlign;
        if (smem > static_cast<size_t>(kSmemLimit)) continue;
        const int chunks = static_cast<int>(k / kChunk);
        auto launch = [&](cudaStream_t st, int copy) { run_kernel(st, maps[static_cast<size_t>(copy)], smem, r, d, chunks); };
        Row row{k, r, d, ctas, rounds, !no_hint, bytes, 0.0, 0.0, {}};
        row.us = cold_l2_median_us([&](cudaStream_t st) { launch(st, 0); }, reps, l2, stream);
        if (graph_launches > 0)
          row.graph_us = graph_per_launch_us([&](cudaStream_t st, int i) { launch(st, i % copies); }, graph_launches, stream);
        // CTA 0's stage landings in the last launch that ran (a graph replay's last when --graph > 0).
        std::vector<unsigned long long> t(1 + kLandingStages);
        landing.download(t.data(), t.size());
        const int shown = std::min(rounds * chunks, kLandingStages);
        for (int i = 0; i < shown; ++i) row.landing_us.push_back(static_cast<double>(t[1 + i] - t[0]) / 1e3);
        out.push_back(row);
        std::printf("%6lld %5d %5d %5d %9.1f %9.2f %9s %8.1f %6.1f%%   CTA 0 stages landed at (us):", static_cast<long long>(k),
                    r, d, ctas, static_cast<double>(row.bytes) / 1e6, row.us, fmt_us(row.graph_us).c_str(), row.gbps(),
                    pct_of_floor(row.bytes, row.graph_us > 0.0 ? row.graph_us : row.us));
        for (int i = 0; i < std::min(shown, 12); ++i) std::printf(" %.2f", row.landing_us[static_cast<size_t>(i)]);
        std::printf("%s\n", shown > 12 ? " ..." : "");
      }
    }
  if (!json_path.empty()) {
    nlohmann::json j = nlohmann::json::array();
    for (const Row& r : out)
      j.push_back({{"k", r.k}, {"box_rows", r.box_rows}, {"depth", r.depth}, {"ctas", r.ctas}, {"rounds", r.rounds}, {"l2_hint", r.hint},
                   {"bytes", r.bytes}, {"us_event", r.us}, {"us_graph", r.graph_us}, {"graph_launches", graph_launches},
                   {"cluster", cluster}, {"splits", splits}, {"rotate_mib", rotate_mib},
                   {"threads", threads}, {"all_wait", all_wait}, {"cta0_landing_us", r.landing_us}, {"cluster_sync", cluster_sync_at_end}, {"pdl", pdl},
                   {"pct_floor", pct_of_floor(r.bytes, r.graph_us > 0.0 ? r.graph_us : r.us)}});
    write_json(json_path, j);
  }
  V4_CUDA_CHECK(cudaStreamDestroy(stream));
  return 0;
}
