// Probe of the weight stream of the TMA GEMMs (v2 gemm_wgmma.cu, v3 gemm_wgmma_pipelined.cu, the
// fused Q chain) with no compute at all: what bandwidth one CTA per SM reaches when it streams a
// row-major byte matrix in the GEMMs' boxes -- {128 bytes of K, box_rows rows}, 128B swizzle -- through
// a ring of `depth` slots, refilling a slot as soon as its box has landed. Phase stamps of session 12
// (docs/perf.md) showed the GEMMs' stages landing ~0.7-1.1 us apart per CTA whether a stage was 16 KB
// (v3 on wq_a|wkv, 128 rows) or 32 KB (v2 on wq_b, 256 rows): this says whether the TMA stream
// itself sets that pace, and which box shape / ring depth reaches the HBM rate.
//
// Each CTA walks `rounds` row blocks (block b of CTA c: rows ((b * grid) + c) * box_rows ..) and all
// K / 128 chunks of each, like a GEMM tile walking K; one thread issues and waits (the GEMMs'
// producer). Bytes per launch = rounds * grid * box_rows * K; the matrix is sized to that, so every
// byte is read once per launch (L2 flushed before each timed launch). Output: median microseconds
// and GB/s per (K, box_rows, depth), and the percentage of the 4.27 TB/s floor.
//
// Usage: bench_tma_probe [--k 1280 5120] [--rows 64 128 256] [--depth 1 2 4 6 8] [--rounds 4]
//                        [--ctas 132] [--reps 20] [--no-hint] [--json FILE]
// --no-hint: plain loads instead of the GEMMs' evict-first L2 policy (dev::l2_policy_stream).
#include <CLI/CLI.hpp>

#include <cstdio>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "bench_common.h"
#include "gemm/hopper_ptx.cuh"
#include "gemm/tensor_map.h"
#include "runtime/cuda_utils.h"

namespace v4attn::bench {
namespace {

using namespace kernels::hopper;

constexpr int kChunk = 128;              // K bytes per box (the 128B swizzle's row)
constexpr int kSmemAlign = 1024;         // 128B-swizzle atoms
constexpr int kSmemLimit = 227 * 1024;   // sm_90 opt-in dynamic shared memory per block
constexpr int kMaxDepth = 16;

__global__ void __launch_bounds__(32, 1) tma_stream_kernel(const __grid_constant__ CUtensorMap map, int box_rows,
                                                           int depth, int chunks, int rounds, bool hint,
                                                           unsigned int* sink) {
  extern __shared__ uint8_t smem_raw[];
  const uint32_t raw = smem_u32(smem_raw);
  const uint32_t base = (raw + (kSmemAlign - 1)) & ~static_cast<uint32_t>(kSmemAlign - 1);
  const uint32_t slot_bytes = static_cast<uint32_t>(box_rows * kChunk);
  const uint32_t bars = base + static_cast<uint32_t>(depth) * slot_bytes;
  if (threadIdx.x != 0) return;
  for (int s = 0; s < depth; ++s) mbar_init(bars + 8u * s, 1);
  fence_mbarrier_init();
  const int total = rounds * chunks;
  auto issue = [&](int i) {
    const int s = i % depth, r = i / chunks, c = i - r * chunks;
    const int row0 = (r * static_cast<int>(gridDim.x) + static_cast<int>(blockIdx.x)) * box_rows;
    mbar_arrive_expect_tx(bars + 8u * s, slot_bytes);
    const uint32_t dst = base + static_cast<uint32_t>(s) * slot_bytes;
    if (hint) tma_load_weights_3d(dst, &map, bars + 8u * s, c * kChunk, row0, 0);  // the GEMMs' evict-first policy
    else tma_load_3d(dst, &map, bars + 8u * s, c * kChunk, row0, 0);
  };
  for (int i = 0; i < depth && i < total; ++i) issue(i);
  for (int i = 0; i < total; ++i) {
    mbar_wait(bars + 8u * (i % depth), static_cast<uint32_t>((i / depth) & 1));
    if (i + depth < total) issue(i + depth);
  }
  // Touch the last slot so that the loads cannot be considered dead (they are not: TMA writes are
  // not elided, but the sink keeps the probe honest if that ever changes).
  uint32_t v;
  asm volatile("ld.shared.u32 %0, [%1];" : "=r"(v) : "r"(base));
  if (v == 0xdeadbeefu) atomicAdd(sink, 1u);
}

struct Row {
  int64_t k = 0;
  int box_rows = 0, depth = 0, ctas = 0, rounds = 0;
  bool hint = true;
  int64_t bytes = 0;
  double us = 0.0;
};

}  // namespace
}  // namespace v4attn::bench

int main(int argc, char** argv) {
  using namespace v4attn;
  using namespace v4attn::bench;
  CLI::App app{"bench_tma_probe: bandwidth of a one-thread TMA weight stream per CTA (no compute) by box shape and ring depth"};
  std::vector<int64_t> ks = {1280, 5120};
  std::vector<int> rows = {64, 128, 256};
  std::vector<int> depths = {1, 2, 4, 6, 8};
  int rounds = 4, ctas = 132, reps = 20;
  bool no_hint = false;
  std::string json_path;
  app.add_option("--k", ks, "K bytes per row (multiples of 128)")->delimiter(',');
  app.add_option("--rows", rows, "rows per box (8..256, multiple of 8)")->delimiter(',');
  app.add_option("--depth", depths, "ring slots per CTA (1..16; depth * rows * 128 must fit in 227 KB)")->delimiter(',');
  app.add_option("--rounds", rounds, "row blocks per CTA")->check(CLI::Range(1, 64));
  app.add_option("--ctas", ctas, "CTAs (one per SM)")->check(CLI::Range(1, 1024));
  app.add_option("--reps", reps, "timed launches per case (median)")->check(CLI::Range(3, 1000));
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
  if (!gpu_present("bench_tma_probe")) return 1;
  cudaStream_t stream = nullptr;
  V4_CUDA_CHECK(cudaStreamCreate(&stream));
  L2Flush l2;
  DeviceBuffer<unsigned int> sink(1);
  V4_CUDA_CHECK(cudaMemset(sink.get(), 0, sizeof(unsigned int)));
  V4_CUDA_CHECK(cudaFuncSetAttribute(tma_stream_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemLimit));
  std::vector<Row> out;
  std::printf("%6s %5s %5s %5s %10s %10s %8s %7s\n", "K", "rows", "depth", "ctas", "MB", "us", "GB/s", "%floor");
  for (int64_t k : ks)
    for (int r : rows) {
      const int64_t n_rows = static_cast<int64_t>(rounds) * ctas * r;
      DeviceBuffer<uint8_t> w(static_cast<size_t>(n_rows * k));
      V4_CUDA_CHECK(cudaMemset(w.get(), 0x38, w.size()));  // e4m3 1.0: any bytes do
      const CUtensorMap map = kernels::detail::make_byte_tensor_map_sw128(
          "bench_tma_probe", w.get(), static_cast<uint64_t>(k), static_cast<uint64_t>(n_rows), 1, static_cast<uint64_t>(k),
          static_cast<uint64_t>(n_rows * k), kChunk, static_cast<uint32_t>(r));
      for (int d : depths) {
        const size_t smem = static_cast<size_t>(d) * r * kChunk + 8 * kMaxDepth + kSmemAlign;
        if (smem > static_cast<size_t>(kSmemLimit)) continue;
        const int chunks = static_cast<int>(k / kChunk);
        const double us = cold_l2_median_us(
            [&](cudaStream_t st) {
              tma_stream_kernel<<<ctas, 32, smem, st>>>(map, r, d, chunks, rounds, !no_hint, sink.get());
              V4_CUDA_CHECK(cudaGetLastError());
            },
            reps, l2, stream);
        const Row row{k, r, d, ctas, rounds, !no_hint, n_rows * k, us};
        out.push_back(row);
        std::printf("%6lld %5d %5d %5d %10.1f %10.2f %8.1f %6.1f%%\n", static_cast<long long>(k), r, d, ctas,
                    static_cast<double>(row.bytes) / 1e6, row.us, static_cast<double>(row.bytes) / row.us / 1e3,
                    pct_of_floor(row.bytes, row.us));
      }
    }
  if (!json_path.empty()) {
    nlohmann::json j = nlohmann::json::array();
    for (const Row& r : out)
      j.push_back({{"k", r.k}, {"box_rows", r.box_rows}, {"depth", r.depth}, {"ctas", r.ctas}, {"rounds", r.rounds}, {"l2_hint", r.hint},
                   {"bytes", r.bytes}, {"us", r.us}, {"pct_floor", pct_of_floor(r.bytes, r.us)}});
    write_json(json_path, j);
  }
  V4_CUDA_CHECK(cudaStreamDestroy(stream));
  return 0;
}
