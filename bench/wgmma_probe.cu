// Probe of the fp8 GEMM consumer loop's instruction mix (v2 / v3, src/gemm/gemm_wgmma*.cu) on the
// hardware: what one K block ("unit": MT m64 weight tiles x 32 K of one stage) costs per SM when a
// warpgroup does only part of the loop's work. The wq_b GEMM's phase stamps (docs/perf.md, session
// 4) showed its consumers taking ~0.72 us per 128-K stage (4 units at MT = 2, 2 warpgroups) whatever
// the memory did; this says which instruction stream sets that pace.
//
// Modes (each consumer warpgroup runs `units` units back to back, no memory traffic but shared
// memory: the weight bytes and the f16 B operand live in one shared-memory tile that is reread):
//   ld+wgmma   the ldmatrix.x4 of the weight bytes per tile (raw bytes as the f16 A fragment), the
//              two chained wgmma m64nNk16 per tile, the fold (fma). (A from registers loaded once
//              outside the loop made ptxas serialize the wgmmas, C7514, so that is not offered.)
//   full       + the 8 cvt e4m3x2 -> f16x2 per tile: the v2 consumer's work per unit
//   int-half   full, with tile 1's widening done by integer ops (v3's mask idea) instead of cvt
//   split      full, but the two k16 halves of a block into two independent sums (added at the fold)
// `depth` D: block-sum register sets in flight (wgmma.wait_group D-1), D = 1 waits for every unit.
// Output: ns per 16 m64 x 32-K tiles (one 128-K stage of a wq_b CTA: MT 2, 2 warpgroups) per SM, and cycles per wgmma per SM, medians over
// repetitions of a 132-CTA launch (one CTA per SM). No correctness to check: a timing probe only
// (the arithmetic of the real kernels is tested in tests/gpu).
//
// Usage: bench_wgmma_probe [--units 4096] [--reps 9] [--json FILE]
#include <CLI/CLI.hpp>

#include <cstdio>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "bench_common.h"
#include "gemm/hopper_ptx.cuh"
#include "gemm/wgmma_f16.cuh"
#include "runtime/cuda_utils.h"

namespace v4attn::bench {
namespace {

using namespace kernels::hopper;

enum Mode : int { kLdWgmma, kFull, kIntHalf, kSplit };
const char* mode_name(int m) {
  switch (m) {
    case kLdWgmma: return "ld+wgmma";
    case kFull: return "full";
    case kIntHalf: return "int-half";
    case kSplit: return "split";
  }
  return "?";
}

constexpr int kSmemBytes = 64 * 1024;  // weight tile [128 rows x 128 B] x 2 + B operand, 1024-aligned
constexpr int kUnroll = 8;             // units per straight-line loop iteration (drained at its end)

template <int MODE, int D, int MT, int NP, int NWG>
__global__ void __launch_bounds__(128 * NWG, 1) probe_kernel(int iters, float* sink) {
  extern __shared__ uint8_t smem_raw[];
  const uint32_t raw = smem_u32(smem_raw);
  const uint32_t base = (raw + 1023u) & ~1023u;
  uint8_t* smem = smem_raw + (base - raw);
  const int tid = static_cast<int>(threadIdx.x), lane = tid & 31, w = (tid >> 5) & 3, wg = tid >> 7;
  for (int i = tid; i < 32 * 1024 / 4; i += blockDim.x)  // small finite e4m3 / f16 codes
    reinterpret_cast<uint32_t*>(smem)[i] = 0x30303030u ^ static_cast<uint32_t>(i * 0x01010101u & 0x07070707u);
  __syncthreads();
  constexpr int R = NP / 2;
  const uint32_t w_tile = base;                 // [MT * 64 * NWG rows][128 B] wraps in 32 KB
  const uint32_t b_tile = base + 32 * 1024;     // f16 B operand, [NP][128 B] x 2 halves
  const int ld_row = 16 * w + (lane & 7) + 8 * ((lane >> 3) & 1);
  const int ld_chunk = lane >> 4;
  float acc[MT][R];
  float d[D][MT][R];
  float d2[D][MT][R];
  uint32_t a[D][MT][2][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int i = 0; i < R; ++i) acc[mt][i] = 0.0f;
  const float s = 1.0f + static_cast<float>(tid) * 1e-7f;

  auto load = [&](int u, uint32_t (&aa)[MT][2][4]) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      {
        const int row = ((wg * MT + mt) * 64 + ld_row) & 255;
        const int chunk = 2 * (u & 3) + ld_chunk;
        uint32_t q[4];
        ldmatrix_x4(q, w_tile + static_cast<uint32_t>(row * 128 + ((chunk ^ (row & 7)) << 4)));
        if constexpr (MODE == kLdWgmma) {
          aa[mt][0][0] = q[0]; aa[mt][0][1] = q[1]; aa[mt][0][2] = q[0]; aa[mt][0][3] = q[1];
          aa[mt][1][0] = q[2]; aa[mt][1][1] = q[3]; aa[mt][1][2] = q[2]; aa[mt][1][3] = q[3];
        } else if (MODE == kIntHalf && mt == 1) {
          aa[mt][0][0] = e4m3x4_even_to_f16x2_scaled(q[0]);
          aa[mt][0][1] = e4m3x4_even_to_f16x2_scaled(q[1]);
          aa[mt][0][2] = e4m3x4_odd_to_f16x2_scaled(q[0]);
          aa[mt][0][3] = e4m3x4_odd_to_f16x2_scaled(q[1]);
          aa[mt][1][0] = e4m3x4_even_to_f16x2_scaled(q[2]);
          aa[mt][1][1] = e4m3x4_even_to_f16x2_scaled(q[3]);
          aa[mt][1][2] = e4m3x4_odd_to_f16x2_scaled(q[2]);
          aa[mt][1][3] = e4m3x4_odd_to_f16x2_scaled(q[3]);
        } else {
          aa[mt][0][0] = e4m3x2_lo_to_f16x2(q[0]);
          aa[mt][0][1] = e4m3x2_lo_to_f16x2(q[1]);
          aa[mt][0][2] = e4m3x2_hi_to_f16x2(q[0]);
          aa[mt][0][3] = e4m3x2_hi_to_f16x2(q[1]);
          aa[mt][1][0] = e4m3x2_lo_to_f16x2(q[2]);
          aa[mt][1][1] = e4m3x2_lo_to_f16x2(q[3]);
          aa[mt][1][2] = e4m3x2_hi_to_f16x2(q[2]);
          aa[mt][1][3] = e4m3x2_hi_to_f16x2(q[3]);
        }
      }
    }
  };
  auto issue = [&](int u, const uint32_t (&aa)[MT][2][4], float (&dd)[MT][R], float (&dd2)[MT][R]) {
    const uint64_t desc0 = make_desc_sw128(b_tile + static_cast<uint32_t>((u & 1) * 64));
    const uint64_t desc1 = desc0 + 2;
    wgmma_fence();
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      kernels::wgmma::WgmmaF16<NP>::mma(dd[mt], aa[mt][0], desc0, 0);
      if constexpr (MODE == kSplit)
        kernels::wgmma::WgmmaF16<NP>::mma(dd2[mt], aa[mt][1], desc1, 0);
      else
        kernels::wgmma::WgmmaF16<NP>::mma(dd[mt], aa[mt][1], desc1, 1);
    }
    wgmma_commit();
  };
  auto fold = [&](float (&dd)[MT][R], float (&dd2)[MT][R]) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      fence_registers(dd[mt]);
      if constexpr (MODE == kSplit) fence_registers(dd2[mt]);
#pragma unroll
      for (int i = 0; i < R; ++i) {
        const float bs = MODE == kSplit ? __fadd_rn(dd[mt][i], dd2[mt][i]) : dd[mt][i];
        acc[mt][i] = __fmaf_rn(bs, s, acc[mt][i]);
      }
    }
  };

  for (int it = 0; it < iters; ++it) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      load(u, a[u % D]);
      issue(u, a[u % D], d[u % D], d2[u % D]);
      if (u >= D - 1) {
        wgmma_wait<D - 1>();
        fold(d[(u - D + 1) % D], d2[(u - D + 1) % D]);
      }
    }
    wgmma_wait<0>();
#pragma unroll
    for (int u = kUnroll - D + 1; u < kUnroll; ++u)
      if (u >= 0) fold(d[u % D], d2[u % D]);
  }
  float t = 0.0f;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int i = 0; i < R; ++i) t += acc[mt][i];
  if (t == 12345.678f) sink[0] = t;  // keeps the work alive; never true for these inputs
}

struct Variant {
  int mode, depth, mt, np, nwg;
  void (*kernel)(int, float*);
};

template <int MODE, int D, int MT, int NP, int NWG>
Variant make() {
  return {MODE, D, MT, NP, NWG, probe_kernel<MODE, D, MT, NP, NWG>};
}

}  // namespace
}  // namespace v4attn::bench

int main(int argc, char** argv) {
  using namespace v4attn::bench;
  CLI::App app{"bench_wgmma_probe: per-SM cost of the fp8 GEMM consumer loop's instruction mix"};
  v4attn::bench::add_version_flag(app, "bench_wgmma_probe");
  int units = 4096, reps = 9;
  std::string json_path;
  app.add_option("--units", units, "units (K blocks) per consumer warpgroup per launch, multiple of 8")->check(CLI::Range(8, 1 << 20));
  app.add_option("--reps", reps, "timed launches per variant (median)")->check(CLI::Range(1, 1000));
  app.add_option("--json", json_path, "also write the rows as JSON");
  CLI11_PARSE(app, argc, argv);
  if (units % kUnroll != 0) {
    std::fprintf(stderr, "bench_wgmma_probe: --units must be a multiple of %d (got %d)\n", kUnroll, units);
    return 2;
  }
  try {
    int dev_count = 0;
    if (cudaGetDeviceCount(&dev_count) != cudaSuccess || dev_count == 0) {
      std::printf("bench_wgmma_probe: no CUDA device; nothing measured\n");
      return 0;
    }
    int sms = 0, clock_khz = 0;
    V4_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    V4_CUDA_CHECK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, 0));
    const std::vector<Variant> variants = {
        make<kLdWgmma, 2, 2, 8, 2>(), make<kFull, 2, 2, 8, 2>(),
        make<kIntHalf, 2, 2, 8, 2>(),   make<kSplit, 2, 2, 8, 2>(),
        make<kLdWgmma, 1, 2, 8, 2>(), make<kLdWgmma, 4, 2, 8, 2>(), make<kFull, 1, 2, 8, 2>(),
        make<kFull, 4, 2, 8, 2>(),      make<kSplit, 4, 2, 8, 2>(),     make<kIntHalf, 4, 2, 8, 2>(),
        make<kLdWgmma, 2, 2, 8, 1>(), make<kFull, 2, 2, 8, 1>(),      make<kFull, 4, 2, 8, 1>(),
        make<kLdWgmma, 2, 1, 8, 4>(), make<kFull, 2, 1, 8, 4>(),      make<kFull, 4, 1, 8, 4>(),
        make<kLdWgmma, 2, 2, 32, 2>(), make<kFull, 2, 2, 32, 2>(),    make<kFull, 3, 2, 32, 2>(),
        make<kLdWgmma, 2, 2, 24, 2>(), make<kFull, 2, 2, 24, 2>(),
    };
    v4attn::DeviceBuffer<float> sink(1);
    cudaStream_t s;
    V4_CUDA_CHECK(cudaStreamCreate(&s));
    EventTimer timer;
    nlohmann::json rows = nlohmann::json::array();
    std::printf("%-10s %5s %3s %3s %4s %14s %16s %16s\n", "mode", "depth", "MT", "NP", "WGs", "ns/16 tiles/SM",
                "cycles/wgmma/SM", "units/us/SM");
    const int iters = units / kUnroll;
    for (const Variant& v : variants) {
      V4_CUDA_CHECK(cudaFuncSetAttribute(reinterpret_cast<const void*>(v.kernel),
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes + 1024));
      auto launch = [&] {
        v.kernel<<<sms, 128 * v.nwg, kSmemBytes + 1024, s>>>(iters, sink.get());
        V4_CUDA_CHECK(cudaGetLastError());
      };
      for (int i = 0; i < 3; ++i) launch();
      std::vector<float> ms;
      for (int i = 0; i < reps; ++i) ms.push_back(timer.time_ms(s, launch));
      const double us = median_us(ms);
      // Units per SM: every warpgroup of the CTA runs `units` units of MT tiles.
      const double units_sm = static_cast<double>(units) * v.nwg;
      const double tiles_sm = units_sm * v.mt;  // m64 x 32-K tiles per SM
      // "4 units" of the real kernel = 4 K blocks x 4 m64 tiles (MT 2 x 2 warpgroups) = 16 tiles.
      const double ns_per_stage = us * 1e3 / tiles_sm * 16.0;
      const double wgmmas_sm = tiles_sm * 2.0;
      const double cyc_per_wgmma = us * 1e-6 * clock_khz * 1e3 / wgmmas_sm;
      std::printf("%-10s %5d %3d %3d %4d %14.1f %16.1f %16.1f\n", mode_name(v.mode), v.depth, v.mt, v.np, v.nwg,
                  ns_per_stage, cyc_per_wgmma, units_sm / us);
      rows.push_back({{"mode", mode_name(v.mode)}, {"depth", v.depth}, {"mt", v.mt}, {"np", v.np}, {"warpgroups", v.nwg},
                      {"us", us}, {"ns_per_16_tiles", ns_per_stage}, {"cycles_per_wgmma_at_clock_rate", cyc_per_wgmma}});
    }
    V4_CUDA_CHECK(cudaStreamDestroy(s));
    std::printf("(cycles at the device's reported clock %d MHz; 16 tiles = one 128-K stage of the wq_b CTA)\n",
                clock_khz / 1000);
    if (!json_path.empty()) write_json(json_path, rows);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_wgmma_probe: %s\n", e.what());
    return 1;
  }
  return 0;
}
