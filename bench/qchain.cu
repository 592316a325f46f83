// bench_qchain: the plain layer's Q chain, fused (run_qchain_fused, one kernel) against the
// unfused chain it replaces (act quant -> v3 GEMM -> rmsnorm + act quant -> v2 wq_b GEMM with the
// RoPE store -> window-K store), at the V4.1 TP1 shapes, the fused kernel with either q hand-off
// (QChainFusedParams::q_direct). First checks that all write the same
// bytes (qkv_a, the head-padded q_pad, the window cache), then times `--layers` layers back to back
// in one CUDA graph (PDL between kernels, each layer with its own weights so that every layer
// streams its 51 MB from HBM), median over `--reps` replays, per layer, next to the bytes floor.
//
// Usage: bench_qchain [--T 1,6,8,16] [--layers 8] [--reps 30] [--json FILE]
#include <CLI/CLI.hpp>
#include <cuda_runtime.h>

#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "bench_common.h"
#include "prepare/stack_kernels.h"
#include "v4attn/cache_layout.h"
#include "v4attn/kernels/gemm.h"
#include "v4attn/kernels/prepare_kernels.h"
#include "v4attn/kernels/qchain.h"

using namespace v4attn;
using namespace v4attn::kernels;
namespace pd = v4attn::prepare::detail;

namespace {

constexpr int64_t kDim = 5120, kQRank = 1280, kHd = 512, kQa = kQRank + kHd;
constexpr int kHeads = 64;
constexpr int64_t kMaxPos = 4096, kSlots = 64;

struct LayerWeights {
  DeviceBuffer<uint8_t> wqkv_a{static_cast<size_t>(kQa * kDim)}, wqkv_a_s{static_cast<size_t>((kQa / 32) * (kDim / 32))};
  DeviceBuffer<uint8_t> wq_b{static_cast<size_t>(kHeads * kHd * kQRank)},
      wq_b_s{static_cast<size_t>((kHeads * kHd / 32) * (kQRank / 32))};
  DeviceBuffer<float> q_norm{static_cast<size_t>(kQRank)}, kv_norm{static_cast<size_t>(kHd)};
  explicit LayerWeights(uint64_t key) {
    pd::init_fp8_weight(wqkv_a.get(), wqkv_a_s.get(), kQa, kDim, key * 7 + 1, nullptr);
    pd::init_fp8_weight(wq_b.get(), wq_b_s.get(), kHeads * kHd, kQRank, key * 7 + 2, nullptr);
    pd::init_norm(q_norm.get(), kQRank, key * 7 + 3, nullptr);
    pd::init_norm(kv_norm.get(), kHd, key * 7 + 4, nullptr);
  }
  // HBM bytes one layer's chain must read: both fp8 weights and their scales.
  static int64_t bytes() { return kQa * kDim + (kQa / 32) * (kDim / 32) + kHeads * kHd * kQRank + (kHeads * kHd / 32) * (kQRank / 32); }
};

// One chain's buffers (the step's inputs and every output).
struct Chain {
  int T;
  CacheLayout layout = cache_layout(CacheKind::kWindowV41);
  DeviceBuffer<bf16_t> x, qkv_a, qr, q_pad;
  DeviceBuffer<uint8_t> xq, xs, qrq, qrs, cache, ws;
  DeviceBuffer<float> table{static_cast<size_t>(kMaxPos * 64)};
  DeviceBuffer<int32_t> pos, loc;
  DeviceBuffer<unsigned long long> err{1};
  explicit Chain(int t)
      : T(t),
        x(static_cast<size_t>(t) * kDim),
        qkv_a(static_cast<size_t>(t) * kQa),
        qr(static_cast<size_t>(t) * kQRank),
        q_pad(static_cast<size_t>(t) * kHeads * kHd),
        xq(static_cast<size_t>(t) * kDim),
        xs(static_cast<size_t>(t) * (kDim / 32)),
        qrq(static_cast<size_t>(t) * kQRank),
        qrs(static_cast<size_t>(t) * (kQRank / 32)),
        cache(static_cast<size_t>(layout.pool_bytes(kSlots))),
        ws(qchain_fused_workspace_bytes(kQChainMaxRows, kDim, kQRank)) {
    pd::init_bf16(x.get(), static_cast<int64_t>(t) * kDim, 1.0f, 11, nullptr);
    pd::init_f32(table.get(), kMaxPos * 64, 1.0f, 12, nullptr);
    std::vector<int32_t> hp(static_cast<size_t>(t)), hl(static_cast<size_t>(t));
    for (int i = 0; i < t; ++i) {
      hp[static_cast<size_t>(i)] = 3000 + i;
      hl[static_cast<size_t>(i)] = i % static_cast<int>(kSlots);
    }
    pos = bench::to_device(hp);
    loc = bench::to_device(hl);
    init_qchain_workspace(ws.get(), ws.size(), nullptr);
    err.fill_bytes(0);
  }
  void poison() {
    qkv_a.fill_bytes(0xAB);
    q_pad.fill_bytes(0xAB);
    cache.fill_bytes(0xAB);
  }
  WindowKStoreParams window(const LayerWeights& w) {
    WindowKStoreParams p;
    p.kv = qkv_a.get() + kQRank;
    p.kv_row_stride = kQa;
    p.kv_norm = w.kv_norm.get();
    p.eps = 1e-6f;
    p.pos = pos.get();
    p.table = table.get();
    p.max_pos = kMaxPos;
    p.swa_loc = loc.get();
    p.kind = CacheKind::kWindowV41;
    p.layout = layout;
    p.cache = cache.get();
    p.n_slots = kSlots;
    p.T = T;
    p.err_count = err.get();
    return p;
  }
  // The unfused chain (int_mask 0 = -1, v3's default: the fused kernel's widening; 0xA: half the
  // blocks widened with integer ops, the default before session 9).
  void unfused(const LayerWeights& w, cudaStream_t s, int int_mask) {
    run_qchain_unfused(params(w), xq.get(), xs.get(), int_mask, s, true);
  }
  void fused(const LayerWeights& w, cudaStream_t s, bool q_direct = false) {
    QChainFusedParams p = params(w);
    p.q_direct = q_direct;
    run_qchain_fused(p, s, true);
  }
  QChainFusedParams params(const LayerWeights& w) {
    QChainFusedParams p;
    p.x = x.get();
    p.x_stride = kDim;
    p.wqkv_a = w.wqkv_a.get();
    p.wqkv_a_scale = w.wqkv_a_s.get();
    p.q_norm = w.q_norm.get();
    p.eps = 1e-6f;
    p.wq_b = w.wq_b.get();
    p.wq_b_scale = w.wq_b_s.get();
    p.qkv_a = qkv_a.get();
    p.qkv_a_stride = kQa;
    p.qr = qr.get();
    p.qr_codes = qrq.get();
    p.qr_scales = qrs.get();
    p.q_pad = q_pad.get();
    p.q_pad_stride = kHeads * kHd;
    p.kv = window(w);
    p.T = T;
    p.dim = kDim;
    p.q_rank = kQRank;
    p.H = kHeads;
    p.workspace = ws.get();
    p.workspace_bytes = ws.size();
    return p;
  }
};

// The bytes of every output of one chain, for the check.
std::vector<uint8_t> outputs(const Chain& c) {
  std::vector<uint8_t> out;
  auto add = [&out](const auto& buf) {
    std::vector<uint8_t> b(buf.bytes());
    V4_CUDA_CHECK(cudaMemcpy(b.data(), buf.get(), b.size(), cudaMemcpyDeviceToHost));
    out.insert(out.end(), b.begin(), b.end());
  };
  add(c.qkv_a);
  add(c.q_pad);
  add(c.cache);
  return out;
}

// Median per-layer time of a graph holding `layers` chains (one per weight set) on one stream.
double graph_per_layer_us(const std::function<void(int, cudaStream_t)>& issue_layer, int layers, int reps,
                          cudaStream_t s) {
  cudaGraph_t graph;
  V4_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  for (int l = 0; l < layers; ++l) issue_layer(l, s);
  V4_CUDA_CHECK(cudaStreamEndCapture(s, &graph));
  cudaGraphExec_t exec;
  V4_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  bench::EventTimer timer;
  for (int i = 0; i < 3; ++i) V4_CUDA_CHECK(cudaGraphLaunch(exec, s));
  std::vector<float> ms;
  for (int i = 0; i < reps; ++i) ms.push_back(timer.time_ms(s, [&] { V4_CUDA_CHECK(cudaGraphLaunch(exec, s)); }));
  V4_CUDA_CHECK(cudaGraphExecDestroy(exec));
  V4_CUDA_CHECK(cudaGraphDestroy(graph));
  return bench::median_us(std::move(ms)) / layers;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"bench_qchain: validate, then time the fused Q chain of a plain layer against the unfused chain"};
  v4attn::bench::add_version_flag(app, "bench_qchain");
  std::vector<int> Ts = {1, 6, 8, 16};
  int layers = 8, reps = 30;
  std::string json_path;
  app.add_option("--T", Ts, "row counts T (1..16)")->delimiter(',');
  app.add_option("--layers", layers, "layers per graph, each with its own weights (>= 4: more than L2 holds)")
      ->check(CLI::Range(4, 40));
  app.add_option("--reps", reps, "timed graph replays (>= 10)")->check(CLI::Range(10, 10000));
  app.add_option("--json", json_path, "also write the rows to this JSON file");
  CLI11_PARSE(app, argc, argv);
  try {
    if (!bench::gpu_present("bench_qchain")) return 2;
    for (int T : Ts)
      if (T < 1 || T > kQChainMaxRows) throw std::invalid_argument("--T values must be in [1, 16]");
    cudaStream_t s;
    V4_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    std::printf("bench_qchain: %d layers of weights (%.1f MB each)\n", layers, LayerWeights::bytes() / 1e6);
    std::vector<std::unique_ptr<LayerWeights>> w;
    for (int l = 0; l < layers; ++l) w.push_back(std::make_unique<LayerWeights>(100 + static_cast<uint64_t>(l)));
    const double floor = bench::floor_us(LayerWeights::bytes());
    std::printf("%-28s %3s %10s %9s %7s %s\n", "chain", "T", "us/layer", "floor_us", "ratio", "valid");
    nlohmann::json rows = nlohmann::json::array();
    bool all_valid = true;
    for (int T : Ts) {
      Chain c(T);
      c.poison();
      c.unfused(*w[0], s, 0);
      V4_CUDA_CHECK(cudaStreamSynchronize(s));
      const std::vector<uint8_t> want = outputs(c);
      c.poison();
      c.fused(*w[0], s);
      V4_CUDA_CHECK(cudaStreamSynchronize(s));
      bool valid = outputs(c) == want;
      c.poison();
      c.fused(*w[0], s, true);
      V4_CUDA_CHECK(cudaStreamSynchronize(s));
      valid = valid && outputs(c) == want;
      all_valid = all_valid && valid;
      const std::pair<const char*, std::function<void(int, cudaStream_t)>> variants[] = {
          {"unfused (v3 default: cvt)", [&](int l, cudaStream_t st) { c.unfused(*w[static_cast<size_t>(l)], st, -1); }},
          {"unfused (v3 mask 0b1010)", [&](int l, cudaStream_t st) { c.unfused(*w[static_cast<size_t>(l)], st, 0xA); }},
          {"fused (one kernel)", [&](int l, cudaStream_t st) { c.fused(*w[static_cast<size_t>(l)], st); }},
          {"fused, direct q hand-off", [&](int l, cudaStream_t st) { c.fused(*w[static_cast<size_t>(l)], st, true); }},
      };
      for (const auto& [name, issue] : variants) {
        const double us = graph_per_layer_us(issue, layers, reps, s);
        std::printf("%-28s %3d %10.2f %9.2f %7.2f %s\n", name, T, us, floor, us / floor, valid ? "ok" : "MISMATCH");
        rows.push_back({{"chain", name}, {"T", T}, {"us_per_layer", us}, {"floor_us", floor}, {"ratio", us / floor},
                        {"bytes_per_layer", LayerWeights::bytes()}, {"valid", valid}});
      }
    }
    if (!json_path.empty()) bench::write_json(json_path, rows);
    V4_CUDA_CHECK(cudaStreamDestroy(s));
    return bench::validity_exit_code("bench_qchain", all_valid);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_qchain: %s\n", e.what());
    return 1;
  }
}
