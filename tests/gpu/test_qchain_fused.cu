// The fused Q chain (run_qchain_fused) against the unfused chain it replaces (run_qchain_unfused:
// act quant -> v3 GEMM (cvt widening, v3_int_mask 0) -> rmsnorm + act quant -> v2 wq_b GEMM with
// the RoPE store -> window-K store), at the V4.1 shapes (dim 5120, q_rank 1280, 64 heads). Every output byte for
// byte (qkv_a, qr, its codes and scales, the head-padded q_pad with its padding and a row past the
// RoPE table left poison, the window cache with a skipped row), the error counts, eager and in a
// replayed CUDA graph (the arrival counters must return to zero after every launch), PDL on / off.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "gpu_test_util.h"
#include "prepare/stack_kernels.h"
#include "v4attn/cache_layout.h"
#include "v4attn/kernels/gemm.h"
#include "v4attn/kernels/prepare_kernels.h"
#include "v4attn/kernels/qchain.h"

namespace v4attn::kernels {
namespace {

using test_util::to_device;
using test_util::to_host;
namespace pd = prepare::detail;

constexpr int64_t kDim = 5120, kQRank = 1280, kHd = 512;
constexpr int kHeads = 64, kHeadsPad = 72;
constexpr int64_t kQa = kQRank + kHd;
constexpr int64_t kMaxPos = 4096;
constexpr int64_t kSlots = 48;
constexpr uint8_t kPoison = 0xAB;

struct Weights {
  DeviceBuffer<uint8_t> wqkv_a{static_cast<size_t>(kQa * kDim)}, wqkv_a_s{static_cast<size_t>((kQa / 32) * (kDim / 32))};
  DeviceBuffer<uint8_t> wq_b{static_cast<size_t>(kHeads * kHd * kQRank)},
      wq_b_s{static_cast<size_t>((kHeads * kHd / 32) * (kQRank / 32))};
  DeviceBuffer<float> q_norm{static_cast<size_t>(kQRank)}, kv_norm{static_cast<size_t>(kHd)};
  DeviceBuffer<float> table{static_cast<size_t>(kMaxPos * 64)};
  explicit Weights(uint64_t seed) {
    pd::init_fp8_weight(wqkv_a.get(), wqkv_a_s.get(), kQa, kDim, seed * 11 + 1, nullptr);
    pd::init_fp8_weight(wq_b.get(), wq_b_s.get(), kHeads * kHd, kQRank, seed * 11 + 2, nullptr);
    pd::init_norm(q_norm.get(), kQRank, seed * 11 + 3, nullptr);
    pd::init_norm(kv_norm.get(), kHd, seed * 11 + 4, nullptr);
    pd::init_f32(table.get(), kMaxPos * 64, 1.0f, seed * 11 + 5, nullptr);
  }
};

// The outputs of one chain (unfused or fused), poisoned beforehand.
struct Outputs {
  int T;
  CacheLayout layout = cache_layout(CacheKind::kWindowV41);
  DeviceBuffer<bf16_t> qkv_a, qr, q_pad;
  DeviceBuffer<uint8_t> qrq, qrs, cache;
  DeviceBuffer<unsigned long long> err{1};
  explicit Outputs(int t)
      : T(t),
        qkv_a(static_cast<size_t>(t) * (kQa + 8)),
        qr(static_cast<size_t>(t) * kQRank),
        q_pad(static_cast<size_t>(t + 1) * kHeadsPad * kHd),
        qrq(static_cast<size_t>(t) * kQRank),
        qrs(static_cast<size_t>(t) * (kQRank / 32)),
        cache(static_cast<size_t>(layout.pool_bytes(kSlots))) {
    poison();
  }
  void poison() {
    qkv_a.fill_bytes(kPoison);
    qr.fill_bytes(kPoison);
    q_pad.fill_bytes(kPoison);
    qrq.fill_bytes(kPoison);
    qrs.fill_bytes(kPoison);
    cache.fill_bytes(kPoison);
    err.fill_bytes(0);
  }
};

struct Step {
  int T;
  DeviceBuffer<bf16_t> x;
  DeviceBuffer<int32_t> pos, loc;
  Step(int t, uint64_t seed) : T(t), x(static_cast<size_t>(t) * (kDim + 64)) {
    pd::init_bf16(x.get(), static_cast<int64_t>(t) * (kDim + 64), 1.0f, seed * 13 + 7, nullptr);
    std::vector<int32_t> hp(static_cast<size_t>(t)), hl(static_cast<size_t>(t));
    for (int i = 0; i < t; ++i) {
      hp[static_cast<size_t>(i)] = static_cast<int32_t>((seed * 977 + static_cast<uint64_t>(i) * 131) % kMaxPos);
      hl[static_cast<size_t>(i)] = static_cast<int32_t>((i * 5 + 3) % kSlots);
    }
    if (t > 2) hp[1] = static_cast<int32_t>(kMaxPos);  // past the table: no q row, no window row, counted by both
    if (t > 3) hl[3] = -1;                             // no window write
    pos = to_device(hp);
    loc = to_device(hl);
  }
};

WindowKStoreParams window_params(const Weights& w, const Step& s, Outputs& o) {
  WindowKStoreParams p;
  p.kv = o.qkv_a.get() + kQRank;
  p.kv_row_stride = kQa + 8;
  p.kv_norm = w.kv_norm.get();
  p.eps = 1e-6f;
  p.pos = s.pos.get();
  p.table = w.table.get();
  p.max_pos = kMaxPos;
  p.swa_loc = s.loc.get();
  p.kind = CacheKind::kWindowV41;
  p.layout = o.layout;
  p.cache = o.cache.get();
  p.n_slots = kSlots;
  p.T = s.T;
  p.err_count = o.err.get();
  return p;
}

QChainFusedParams fused_params(const Weights& w, const Step& s, Outputs& o, const DeviceBuffer<uint8_t>& ws,
                                bool q_direct = false) {
  QChainFusedParams p;
  p.q_direct = q_direct;
  p.x = s.x.get();
  p.x_stride = kDim + 64;
  p.wqkv_a = w.wqkv_a.get();
  p.wqkv_a_scale = w.wqkv_a_s.get();
  p.q_norm = w.q_norm.get();
  p.eps = 1e-6f;
  p.wq_b = w.wq_b.get();
  p.wq_b_scale = w.wq_b_s.get();
  p.qkv_a = o.qkv_a.get();
  p.qkv_a_stride = kQa + 8;
  p.qr = o.qr.get();
  p.qr_codes = o.qrq.get();
  p.qr_scales = o.qrs.get();
  p.q_pad = o.q_pad.get();
  p.q_pad_stride = static_cast<int64_t>(kHeadsPad) * kHd;
  p.kv = window_params(w, s, o);
  p.T = s.T;
  p.dim = kDim;
  p.q_rank = kQRank;
  p.H = kHeads;
  p.workspace = ws.get();
  p.workspace_bytes = ws.size();
  return p;
}

// The unfused chain (run_qchain_unfused with the fused kernel's widening) into o.
void run_unfused(const Weights& w, const Step& s, Outputs& o, bool pdl) {
  DeviceBuffer<uint8_t> xq(static_cast<size_t>(s.T) * kDim), xs(static_cast<size_t>(s.T) * (kDim / 32));
  DeviceBuffer<uint8_t> no_ws(1);
  run_qchain_unfused(fused_params(w, s, o, no_ws), xq.get(), xs.get(), 0, nullptr, pdl);
  V4_CUDA_CHECK(cudaDeviceSynchronize());
}

template <class T>
size_t count_diff(const DeviceBuffer<T>& want, const DeviceBuffer<T>& got, const char* what, int T_rows) {
  const std::vector<T> a = to_host(want), b = to_host(got);
  size_t differ = 0;
  for (size_t i = 0; i < a.size(); ++i)
    if (a[i] != b[i] && differ++ < 4)
      ADD_FAILURE() << what << " element " << i << " (T " << T_rows << "): fused " << +b[i] << ", unfused " << +a[i];
  return differ;
}

void expect_same(const Outputs& want, const Outputs& got, const std::string& label) {
  SCOPED_TRACE(label);
  EXPECT_EQ(count_diff(want.qkv_a, got.qkv_a, "qkv_a", want.T), 0u);
  EXPECT_EQ(count_diff(want.qr, got.qr, "qr", want.T), 0u);
  EXPECT_EQ(count_diff(want.qrq, got.qrq, "qr codes", want.T), 0u);
  EXPECT_EQ(count_diff(want.qrs, got.qrs, "qr scales", want.T), 0u);
  EXPECT_EQ(count_diff(want.q_pad, got.q_pad, "q_pad", want.T), 0u);
  EXPECT_EQ(count_diff(want.cache, got.cache, "window cache", want.T), 0u);
  EXPECT_EQ(to_host(want.err)[0], to_host(got.err)[0]) << "error counts";
}

// The unfused chain wrote what it should (so equality is not poison == poison).
void expect_written(const Outputs& o) {
  const std::vector<bf16_t> q = to_host(o.q_pad);
  size_t written = 0;
  for (bf16_t v : q) written += v != static_cast<bf16_t>(0xABAB);
  const size_t live_rows = static_cast<size_t>(o.T > 2 ? o.T - 1 : o.T);
  EXPECT_EQ(written, live_rows * kHeads * kHd) << "q_pad rows written by the unfused chain";
  const std::vector<uint8_t> c = to_host(o.cache);
  size_t cw = 0;
  for (uint8_t v : c) cw += v != kPoison;
  EXPECT_GT(cw, 0u);
}

TEST(GpuQChainFused, MatchesUnfusedChainBytes) {
  V4_REQUIRE_GPU();
  const Weights w(41);
  const size_t ws_bytes = qchain_fused_workspace_bytes(kQChainMaxRows, kDim, kQRank);
  ASSERT_GT(ws_bytes, 0u);
  DeviceBuffer<uint8_t> ws(ws_bytes);
  ws.fill_bytes(0xCD);  // the partials may hold anything; the counters must start at zero
  init_qchain_workspace(ws.get(), ws.size(), nullptr);
  uint64_t seed = 70;
  for (int T : {1, 2, 3, 6, 8, 9, 16}) {
    ASSERT_TRUE(qchain_fused_supported(T, kDim, kQRank, kHeads)) << T;
    ASSERT_TRUE(qchain_fused_supported(T, kDim, kQRank, kHeads, -1, true)) << T;
    for (bool pdl : {false, true}) {
      const Step s(T, ++seed);
      Outputs want(T);
      run_unfused(w, s, want, pdl);
      expect_written(want);
      // Both q hand-offs, each twice on the same workspace (the counters were left at zero), and
      // the other form in between: each leaves the counters as the other expects them.
      for (bool direct : {false, true, false}) {
        const std::string form = std::string(direct ? " direct" : " tiles") + (pdl ? " pdl" : "");
        Outputs got(T);
        run_qchain_fused(fused_params(w, s, got, ws, direct), nullptr, pdl);
        V4_CUDA_CHECK(cudaDeviceSynchronize());
        expect_same(want, got, "eager T " + std::to_string(T) + form);
        got.poison();
        run_qchain_fused(fused_params(w, s, got, ws, direct), nullptr, pdl);
        V4_CUDA_CHECK(cudaDeviceSynchronize());
        expect_same(want, got, "second launch T " + std::to_string(T) + form);
      }
    }
  }
}

TEST(GpuQChainFused, GraphReplaysMatch) {
  V4_REQUIRE_GPU();
  const Weights w(43);
  DeviceBuffer<uint8_t> ws(qchain_fused_workspace_bytes(kQChainMaxRows, kDim, kQRank));
  init_qchain_workspace(ws.get(), ws.size(), nullptr);
  for (int T : {1, 6, 16}) {
    // Each form's bytes from a replayed graph: three chains back to back (PDL between them, each
    // waiting for the previous one's grid), the checked form last, the other form before it (so the
    // counters are also handed from each form to the other).
    for (bool direct_last : {false, true}) {
      const Step s(T, 500 + static_cast<uint64_t>(T));
      Outputs want(T), got(T);
      run_unfused(w, s, want, true);
      cudaStream_t st;
      V4_CUDA_CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
      cudaGraph_t graph;
      V4_CUDA_CHECK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
      for (int i = 0; i < 3; ++i) run_qchain_fused(fused_params(w, s, got, ws, i == 2 ? direct_last : !direct_last), st, true);
      V4_CUDA_CHECK(cudaStreamEndCapture(st, &graph));
      cudaGraphExec_t exec;
      V4_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
      const std::string form = direct_last ? " direct last" : " tiles last";
      for (int rep = 0; rep < 3; ++rep) {
        got.poison();
        V4_CUDA_CHECK(cudaGraphLaunch(exec, st));
        V4_CUDA_CHECK(cudaStreamSynchronize(st));
        // Each of the 3 launches counted the bad row once (the unfused chain: once; T 1 has none).
        const unsigned long long e = to_host(got.err)[0];
        EXPECT_EQ(e, 3 * to_host(want.err)[0]);
        got.err.fill_bytes(0);
        want.err.fill_bytes(0);
        expect_same(want, got, "graph replay " + std::to_string(rep) + " T " + std::to_string(T) + form);
        run_unfused(w, s, want, true);  // restore want's error count
      }
      V4_CUDA_CHECK(cudaGraphExecDestroy(exec));
      V4_CUDA_CHECK(cudaGraphDestroy(graph));
      V4_CUDA_CHECK(cudaStreamDestroy(st));
    }
  }
}

// The shape rule, without a GPU (runs in CI): the V4.1 TP1 shapes need 128 CTAs (the wq_b tiles;
// 14 x 8 = 112 QA units), so 132 SMs take them and 127 do not; rows 1..16 only; TP4 (16 heads:
// wq_b at v2's one-m64-tile plan) and shapes off the tiling are refused. The workspace: counters
// plus the partials of 8 splits.
TEST(GpuQChainHost, ShapeRuleAndWorkspace) {
  for (int T : {1, 6, 8, 9, 16}) EXPECT_EQ(qchain_fused_shape(T, kDim, kQRank, kHeads, 132).grid, 128) << T;
  EXPECT_EQ(qchain_fused_shape(6, kDim, kQRank, kHeads, 128).grid, 128);
  EXPECT_EQ(qchain_fused_shape(6, kDim, kQRank, kHeads, 127).grid, 0);
  EXPECT_EQ(qchain_fused_shape(0, kDim, kQRank, kHeads, 132).grid, 0);
  EXPECT_EQ(qchain_fused_shape(kQChainMaxRows + 1, kDim, kQRank, kHeads, 132).grid, 0);
  EXPECT_EQ(qchain_fused_shape(6, kDim, kQRank, 16, 132).grid, 0);           // TP4
  EXPECT_EQ(qchain_fused_shape(6, kDim + 32, kQRank, kHeads, 132).grid, 0);  // dim % 128
  EXPECT_EQ(qchain_fused_shape(6, kDim, kQRank + 128, kHeads, 132).grid, 0); // q_rank % 256
  EXPECT_EQ(qchain_fused_shape(6, kDim, kQRank, 0, 132).grid, 0);
  EXPECT_EQ(qchain_fused_workspace_bytes(kQChainMaxRows, kDim, kQRank),
            256u + 8u * kQChainMaxRows * static_cast<size_t>(kQa) * sizeof(float));
  EXPECT_EQ(qchain_fused_workspace_bytes(0, kDim, kQRank), 0u);
  // The direct q hand-off stages T x q_rank bf16 in the QA weight slots: V4.1's 80 KB QA slice
  // (three 32 KB slots) holds 16 rows; at dim 512 the slice is one slot, which holds 12 rows of
  // 1280 (30 KB) but not 13 (32.5 KB).
  for (int T : {1, 6, 16}) EXPECT_TRUE(qchain_fused_shape(T, kDim, kQRank, kHeads, 132).direct_ok) << T;
  ASSERT_EQ(qchain_fused_shape(16, 512, kQRank, kHeads, 132).grid, 128);
  EXPECT_TRUE(qchain_fused_shape(12, 512, kQRank, kHeads, 132).direct_ok);
  EXPECT_FALSE(qchain_fused_shape(13, 512, kQRank, kHeads, 132).direct_ok);
  EXPECT_FALSE(qchain_fused_shape(6, kDim, kQRank, kHeads, 127).direct_ok);  // no plan at all
  EXPECT_THROW(init_qchain_workspace(nullptr, 1024, nullptr), std::invalid_argument);
  // The wq_b ring at V4.1: 6 slots at 1-8 rows (3 of them free before q_norm beside the 80 KB QA
  // slice), 5 at 9-16 (the f16 operand of 16 rows takes 20 KB more); 0 without a plan.
  for (int T : {1, 6, 8}) EXPECT_EQ(qchain_fused_shape(T, kDim, kQRank, kHeads, 132).ring, 6) << T;
  for (int T : {9, 16}) EXPECT_EQ(qchain_fused_shape(T, kDim, kQRank, kHeads, 132).ring, 5) << T;
  EXPECT_EQ(qchain_fused_shape(6, kDim, kQRank, kHeads, 127).ring, 0);
}

// The CTAs spin on each other: under an MPS share of the GPU smaller than the grid the chain must
// be refused (the stack then runs the unfused chain), never launched. The driver reads the variable
// only when an MPS client starts, so setting it here changes nothing but the rule.
TEST(GpuQChainFused, RefusedUnderAnMpsShareSmallerThanTheGrid) {
  V4_REQUIRE_GPU();
  ASSERT_TRUE(qchain_fused_supported(6, kDim, kQRank, kHeads));  // 132 SMs, grid 128
  const char* old = std::getenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE");
  const std::string saved = old != nullptr ? old : "";
  ASSERT_EQ(setenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "50", 1), 0);
  EXPECT_FALSE(qchain_fused_supported(6, kDim, kQRank, kHeads));
  ASSERT_EQ(setenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "100", 1), 0);
  EXPECT_TRUE(qchain_fused_supported(6, kDim, kQRank, kHeads));
  if (old != nullptr) setenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", saved.c_str(), 1);
  else unsetenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE");
}

TEST(GpuQChainFused, RefusesBadInput) {
  V4_REQUIRE_GPU();
  EXPECT_FALSE(qchain_fused_supported(0, kDim, kQRank, kHeads));
  EXPECT_FALSE(qchain_fused_supported(kQChainMaxRows + 1, kDim, kQRank, kHeads));
  EXPECT_FALSE(qchain_fused_supported(6, kDim + 32, kQRank, kHeads));   // dim % 128
  EXPECT_FALSE(qchain_fused_supported(6, kDim, kQRank + 128, kHeads));  // q_rank % 256
  const Weights w(45);
  DeviceBuffer<uint8_t> ws(qchain_fused_workspace_bytes(kQChainMaxRows, kDim, kQRank));
  init_qchain_workspace(ws.get(), ws.size(), nullptr);
  const Step s(6, 9);
  Outputs o(6);
  const QChainFusedParams ok = fused_params(w, s, o, ws);
  auto refused = [&](QChainFusedParams p, const char* what) {
    EXPECT_THROW(run_qchain_fused(p, nullptr, false), std::invalid_argument) << what;
  };
  QChainFusedParams p = ok;
  p.T = 0;
  refused(p, "T 0");
  p = ok;
  p.T = 17;
  refused(p, "T 17");
  p = ok;
  p.x = nullptr;
  refused(p, "x null");
  p = ok;
  p.x_stride = kDim - 8;
  refused(p, "x_stride < dim");
  p = ok;
  p.qkv_a_stride = kQa - 8;
  refused(p, "qkv_a_stride < q_rank + 512");
  p = ok;
  p.q_pad_stride = 100;
  refused(p, "q_pad_stride < H * 512");
  p = ok;
  p.workspace_bytes = 256;
  refused(p, "workspace too small");
  p = ok;
  p.kv.n_slots = 0;
  refused(p, "no cache slots");
  p = ok;
  p.kv.table = nullptr;
  refused(p, "no table");
  p = ok;  // the direct q hand-off where its staged rows do not fit (checked before any pointer)
  p.dim = 512;
  p.T = 16;
  p.q_direct = true;
  refused(p, "q_direct, 16 rows at dim 512");
  V4_CUDA_CHECK(cudaDeviceSynchronize());
  // Nothing was written by the refused calls.
  const std::vector<bf16_t> q = to_host(o.q_pad);
  for (bf16_t v : q) ASSERT_EQ(v, static_cast<bf16_t>(0xABAB));
}

}  // namespace
}  // namespace v4attn::kernels
