// Benchmark of the prepare-path GEMMs (include/v4attn/kernels/gemm.h) at M = 1..64.
//
// For every shape of the model (--shapes, default all) and row count m (--m, default
// 1,6,8,24,48,64): build seeded random inputs with realistic magnitudes, validate against the CPU
// reference (v0 byte for byte, v1 / v2 / v3 within 1 bf16 ulp / the fp32 rounding bound, act quant byte
// for byte), then time each version two ways:
//  - us_event: CUDA events around ONE eager launch (3 warm-ups, then --reps launches, a 128 MB
//    memset before each one so that every launch starts with a cold L2), median. Includes the
//    launch latency of a lone kernel (~4 us; see the act_quant rows).
//  - us_graph: --graph-launches (20) launches back to back captured in a CUDA graph, replayed
//    (2 warm-ups, then 15 timed replays; median replay time / launches). The weights rotate over
//    C >= 4 copies (C = ceil(192 MB / weight bytes), at most the launch count), so every launch
//    reads weights that are not in the 60 MB L2 (activations and outputs stay hot, as in the
//    engine). No launch latency: this is how the engine runs them (graph replay).
//  - us_gpdl: the same graph with the GEMMs launched with PDL (the weight prologue of launch i+1
//    overlaps the tail of launch i): the figure for a GEMM whose predecessor triggers early.
// %floor uses us_graph (%fl_ev: us_event).
//
// Rows per shape and m:
//   fp8:  act_quant (bf16 x -> codes + scales), v0, v1, v2, v3 (GEMM on quantized x; v3 once per
//         --v3-masks entry: "v3" = the default widening mask (0, all cvt), "v3 int<mask>" otherwise, e.g.
//         "v3 int0" = all cvt, "v3 int15" = all integer), "v6" (gemv, m <= 8, gemm_gemv_supported),
//         v1+quant / v2+quant / v3+quant
//         (act_quant then the GEMM; with PDL in the event and gpdl columns), "v3 fused-quant"
//         (run_gemm_fp8_fused_quant: the act quant inside v3, where gemm_v3_fused_quant_supported;
//         valid when byte-identical to act_quant + v3; compare with "v3+quant"), the peer
//         "cublasLt bf16 (2x bytes)": a bf16 cublasLtMatmul on a dequantised bf16 copy of the
//         weight (exact: every e4m3 * 2^e is a bf16) and the unquantized bf16 x, validated against
//         our bf16 v1 on the same copy, and the peer "cublasLt fp8 blk128": cuBLASLt's block-scaled
//         fp8 GEMM (128x128 weight scales, 1x128 activation scales) on the same e4m3 codes with unit
//         scales -- a speed reference only (V4.1's 32x32 scales are not expressible there; its
//         output is not compared; cuBLASLt has no algorithm for it at M = 1).
//   bf16: v0, v1, v5 (kSkinny), "cublasLt bf16" (wo_a: one strided-batched call for the 8 groups).
//   f32:  v0, v1, v5 (kSkinny), "cublasLt f32" (x widened to fp32 for it; CUBLAS_COMPUTE_32F, no TF32).
//   ("auto" in a v1 / v5 row's note says which of them kAuto runs for that shape and m.)
// v0 (one thread per output) is slow: when one launch takes > 2 ms it is timed with 5 launches
// (the "reps" column says so); v0 is not graph-timed; --no-v0 skips it.
//
// "bytes" = weights + weight scales + activations (+ their scales) + outputs, what a kernel must
// move at least; "floor" = bytes at 4.27 TB/s (measured D2D copy rate of the H200). Split-K
// partial sums are not counted (they are overhead, mostly in L2).
//
// Usage: bench_gemm [--m 1,6,8,24,48,64] [--shapes wq_b,wo_b,...] [--reps 50] [--no-v0]
//                   [--no-peer] [--no-graph] [--graph-launches 20] [--splits S] [--mtiles 1|2]
//                   [--stages N] [--v3-masks -1,0,15] [--json FILE]
// --splits / --mtiles override the v1, v2, v3 and v5 plans (v3, v5: S <= 8), --stages v2's and v3's
// ring depth (tuning; the note column shows the plan used).
#include <CLI/CLI.hpp>
#include <cublasLt.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "bench_common.h"
#include "runtime/cuda_utils.h"
#include "runtime/phase_stamps.h"
#include "v4attn/kernels/gemm.h"
#include "v4attn/reference/gemm.h"

namespace {

using namespace v4attn;
using num::bf16_t;
namespace kn = v4attn::kernels;

using bench::to_device;
using bench::to_host;

constexpr double kSlowLaunchMs = 2.0;
constexpr double kRotateBytes = 192.0 * 1024 * 1024;  // weight copies per graph: > 3x the 60 MB L2
constexpr int kGraphWarmups = 2, kGraphReplays = 15;

enum class Kind { kFp8, kBf16, kF32 };

struct Shape {
  const char* name;
  Kind kind;
  int64_t n, k;
  int groups;
};
constexpr Shape kShapes[] = {
    {"wq_a_wkv", Kind::kFp8, 1792, 5120, 1},   {"wq_b", Kind::kFp8, 32768, 1280, 1},
    {"wq_b_tp4", Kind::kFp8, 8192, 1280, 1},   {"idx_wq_b", Kind::kFp8, 4096, 1280, 1},
    {"wo_b", Kind::kFp8, 5120, 8192, 1},       {"c1_wkv", Kind::kBf16, 512, 5120, 1},
    {"weights_proj", Kind::kBf16, 32, 5120, 1}, {"wk", Kind::kBf16, 128, 512, 1},
    {"wo_a", Kind::kBf16, 1024, 4096, 8},      {"c2_wkv_wgate", Kind::kF32, 1024, 5120, 1}};

struct Row {
  std::string shape, kernel, version;
  int m = 0;
  double median_us = 0.0;     // event-timed single launch (L2 flushed)
  double graph_us = 0.0;      // per launch in a graph replay (0: not measured)
  double graph_pdl_us = 0.0;  // the same with PDL launches (0: not measured)
  int copies = 0;             // weight copies rotated in the graph
  int64_t bytes = 0;
  int reps = 0;
  bool valid = false;
  std::string note;
  double floor_us() const { return bench::floor_us(bytes); }
  double pct(double us) const { return bench::pct_of_floor(bytes, us); }
};

// splitmix64
struct Rng {
  uint64_t s;
  explicit Rng(uint64_t seed) : s(seed * 0x9E3779B97F4A7C15ull + 777) {}
  uint64_t next() {
    uint64_t z = (s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  float uniform() { return static_cast<float>(static_cast<double>(next() >> 11) * 0x1.0p-53 * 2.0 - 1.0); }
  int range(int lo, int hi) { return lo + static_cast<int>(next() % static_cast<uint64_t>(hi - lo + 1)); }
};

// `copies` copies of a host array in one device buffer (copy c at c * h.size()).
template <class T>
DeviceBuffer<T> to_device_copies(const std::vector<T>& h, int copies) {
  DeviceBuffer<T> d(std::max<size_t>(h.size() * static_cast<size_t>(copies), 1));
  for (int c = 0; c < copies; ++c)
    V4_CUDA_CHECK(cudaMemcpy(d.get() + static_cast<size_t>(c) * h.size(), h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
  return d;
}

int32_t bf16_ordinal(bf16_t b) {
  const int32_t mag = b & 0x7fff;
  return (b & 0x8000) ? -mag : mag;
}
// Max ulps and count of differing elements between two dense [m, n] bf16 arrays (got, want).
// Elements whose terms cancel may legitimately move by more than 1 ulp under another fp32
// summation order: an element more than 1 ulp away but within 2^-16 of its row's largest |want|
// is not counted in the max (same rule as tests/gpu/test_gemm.cu).
std::pair<int, int64_t> ulp_diff(const std::vector<bf16_t>& got, const std::vector<bf16_t>& want, int64_t n) {
  int mx = 0;
  int64_t differ = 0;
  for (size_t r0 = 0; r0 < want.size(); r0 += static_cast<size_t>(n)) {
    double scale = 0.0;
    for (int64_t c = 0; c < n; ++c) scale = std::max(scale, std::fabs(static_cast<double>(num::f32_from_bf16(want[r0 + c]))));
    for (int64_t c = 0; c < n; ++c) {
      const size_t i = r0 + static_cast<size_t>(c);
      const int ulps = std::abs(bf16_ordinal(got[i]) - bf16_ordinal(want[i]));
      differ += got[i] != want[i];
      const double diff = std::fabs(static_cast<double>(num::f32_from_bf16(got[i])) - static_cast<double>(num::f32_from_bf16(want[i])));
      if (ulps > 1 && diff <= 0x1.0p-16 * scale) continue;
      mx = std::max(mx, ulps);
    }
  }
  return {mx, differ};
}

// A timed operation: launch(stream, weight copy index, pdl).
using Launch = std::function<void(cudaStream_t, int, bool)>;

// Median over `reps` eager launches (copy 0), each after an L2 flush; reps drops to 5 when one
// launch is slow. Not bench::cold_l2_median_us: here the 3 warm-ups are flushed and timed too,
// because the first one's time decides the rep count.
double event_median_us(const Launch& launch, bool pdl, int reps, bench::L2Flush& l2, cudaStream_t s, int* reps_used) {
  bench::EventTimer timer;
  std::vector<float> ms;
  for (int i = 0; i < 3 + reps; ++i) {
    l2.flush(s, i);
    const float t = timer.time_ms(s, [&] { launch(s, 0, pdl); });
    if (i == 0 && t > kSlowLaunchMs) reps = std::min(reps, 5);
    if (i >= 3) ms.push_back(t);
  }
  *reps_used = static_cast<int>(ms.size());
  return bench::median_us(std::move(ms));
}

// Per-launch time of `launches` back-to-back launches (launch i on weight copy i % copies) in one
// CUDA graph (bench::graph_per_launch_us).
double graph_us(const Launch& launch, bool pdl, int copies, int launches, cudaStream_t s) {
  return bench::graph_per_launch_us([&](cudaStream_t st, int i) { launch(st, i % copies, pdl); }, launches, s,
                                    kGraphWarmups, kGraphReplays);
}

// Weight copies for a graph: enough that each launch reads weights no longer in L2.
int rotation_copies(double weight_bytes, int launches) {
  const int c = static_cast<int>(std::ceil(kRotateBytes / std::max(weight_bytes, 1.0)));
  return std::clamp(c, 4, std::max(4, launches));
}

// ---- cuBLASLt peers -----------------------------------------------------------------------------------
// out[m, n] (row-major, ld out_stride) = x[m, k] (row-major, ld x_stride) @ w[n, k]^T, per group.
// Column-major view: D^T [n, m] (ld out_stride) = op(A) [n, k] * B [k, m] with A = w viewed as a
// col-major k x n matrix (ld k) and op = T, B = x viewed as col-major k x m (ld x_stride), op = N.
// Groups: strided batch with offsets n*k (w), k (x: the group's columns), n (out: its columns).
// fp8 block-scaled variant (speed reference): A and B e4m3, A scales one fp32 per 128x128 block,
// B scales one fp32 per 128 elements of K per token, D bf16 (cuBLASLt's Hopper block scaling).
class LtMatmul {
 public:
  LtMatmul(cudaDataType_t type, int m, int64_t n, int64_t k, int groups, int64_t x_stride, int64_t out_stride,
           cublasLtHandle_t handle, void* ws, size_t ws_bytes, bool fp8_block_scaled = false,
           const void* a_scales = nullptr, const void* b_scales = nullptr)
      : handle_(handle), ws_(ws), ws_bytes_(ws_bytes) {
    check(cublasLtMatmulDescCreate(&op_, CUBLAS_COMPUTE_32F, CUDA_R_32F), "desc");
    const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    check(cublasLtMatmulDescSetAttribute(op_, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)), "transa");
    check(cublasLtMatmulDescSetAttribute(op_, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)), "transb");
    const cudaDataType_t out_type = fp8_block_scaled ? CUDA_R_16BF : type;
    if (fp8_block_scaled) {
      const int32_t a_mode = CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F, b_mode = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
      check(cublasLtMatmulDescSetAttribute(op_, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &a_mode, sizeof(a_mode)), "A scale mode");
      check(cublasLtMatmulDescSetAttribute(op_, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &b_mode, sizeof(b_mode)), "B scale mode");
      check(cublasLtMatmulDescSetAttribute(op_, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &a_scales, sizeof(a_scales)), "A scales");
      check(cublasLtMatmulDescSetAttribute(op_, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &b_scales, sizeof(b_scales)), "B scales");
    }
    check(cublasLtMatrixLayoutCreate(&la_, type, static_cast<uint64_t>(k), static_cast<uint64_t>(n), k), "A");
    check(cublasLtMatrixLayoutCreate(&lb_, type, static_cast<uint64_t>(k), static_cast<uint64_t>(m), x_stride), "B");
    check(cublasLtMatrixLayoutCreate(&lc_, out_type, static_cast<uint64_t>(n), static_cast<uint64_t>(m), out_stride), "C");
    if (groups > 1) {
      const int32_t count = groups;
      const int64_t sa = n * k, sb = k, sc = n;
      for (auto [l, stride] : {std::pair{la_, sa}, std::pair{lb_, sb}, std::pair{lc_, sc}}) {
        check(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, sizeof(count)), "batch");
        check(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride, sizeof(stride)),
              "batch stride");
      }
    }
    cublasLtMatmulPreference_t pref;
    check(cublasLtMatmulPreferenceCreate(&pref), "pref");
    check(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes_,
                                               sizeof(ws_bytes_)),
          "pref ws");
    int found = 0;
    const cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(handle_, op_, la_, lb_, lc_, lc_, pref, 1, &algo_, &found);
    cublasLtMatmulPreferenceDestroy(pref);
    if (st != CUBLAS_STATUS_SUCCESS || found < 1) {
      destroy();
      throw std::runtime_error("cuBLASLt: no algorithm");
    }
  }
  ~LtMatmul() { destroy(); }
  LtMatmul(const LtMatmul&) = delete;
  LtMatmul& operator=(const LtMatmul&) = delete;
  void run(const void* w, const void* x, void* out, cudaStream_t s) const {
    const float alpha = 1.0f, beta = 0.0f;
    check(cublasLtMatmul(handle_, op_, &alpha, w, la_, x, lb_, &beta, out, lc_, out, lc_, &algo_.algo, ws_, ws_bytes_, s),
          "matmul");
  }

 private:
  void destroy() {
    if (la_) cublasLtMatrixLayoutDestroy(la_);
    if (lb_) cublasLtMatrixLayoutDestroy(lb_);
    if (lc_) cublasLtMatrixLayoutDestroy(lc_);
    if (op_) cublasLtMatmulDescDestroy(op_);
    la_ = lb_ = lc_ = nullptr;
    op_ = nullptr;
  }
  static void check(cublasStatus_t st, const char* what) {
    if (st != CUBLAS_STATUS_SUCCESS) throw std::runtime_error(std::string("cuBLASLt ") + what + " failed: status " + std::to_string(st));
  }
  cublasLtHandle_t handle_;
  void* ws_;
  size_t ws_bytes_;
  cublasLtMatmulDesc_t op_ = nullptr;
  cublasLtMatrixLayout_t la_ = nullptr, lb_ = nullptr, lc_ = nullptr;
  cublasLtMatmulHeuristicResult_t algo_{};
};

struct Env {
  int reps = 50;
  std::vector<int> v3_masks = {-1, 0, 15};  // v3 rows: Fp8GemmParams::v3_int_mask per row (-1 = default)
  int force_splits = 0, force_mtiles = 0, force_stages = 0;  // v1 / v2 plan overrides (0 = automatic)
  int v2_overlap = -1, prewait_stages = -1;                   // Fp8GemmParams tuning fields (-1 = default)
  bool run_v0 = true, run_peer = true, run_graph = true;
  int graph_launches = 20;
  cudaStream_t stream = nullptr;
  bench::L2Flush* l2 = nullptr;
  cublasLtHandle_t lt = nullptr;
  DeviceBuffer<uint8_t>* lt_ws = nullptr;
  DeviceBuffer<uint8_t>* gemm_ws = nullptr;
};

Row make_row(const Shape& sh, const char* version, int m, int64_t bytes) {
  Row r;
  r.shape = sh.name;
  r.kernel = sh.kind == Kind::kFp8 ? "gemm_fp8" : sh.kind == Kind::kBf16 ? "gemm_bf16" : "gemm_f32";
  r.version = version;
  r.m = m;
  r.bytes = bytes;
  return r;
}

// Times `launch` the three ways (event; graph without / with PDL when `graph_pdl`) into `r`.
void time_row(Row& r, Env& env, const Launch& launch, bool event_pdl, int copies, bool graph, bool graph_pdl) {
  r.median_us = event_median_us(launch, event_pdl, env.reps, *env.l2, env.stream, &r.reps);
  if (!env.run_graph || !graph) return;
  r.copies = copies;
  r.graph_us = graph_us(launch, false, copies, env.graph_launches, env.stream);
  if (graph_pdl) r.graph_pdl_us = graph_us(launch, true, copies, env.graph_launches, env.stream);
  // Measurement builds (-DV4ATTN_PHASE_STAMPS): the in-kernel phase stamps of one more graph
  // replay (PDL as in us_gpdl when measured), written to $V4ATTN_STAMPS_OUT.<shape>.<version>.m<M>
  // for scripts/phase_stamps.py.
  if (const char* out = std::getenv("V4ATTN_STAMPS_OUT"); out != nullptr && stamps::available()) {
    stamps::reset();
    graph_us(launch, graph_pdl, copies, env.graph_launches, env.stream);
    std::string tag = r.version;
    for (char& ch : tag)
      if (ch == ' ' || ch == '+' || ch == '|') ch = '_';
    const std::string path = std::string(out) + "." + r.shape + "." + tag + ".m" + std::to_string(r.m);
    const long n = stamps::dump(path);
    std::fprintf(stderr, "bench_gemm: wrote %ld phase stamps to %s\n", n, path.c_str());
  }
}

// The shared split-K workspace, grown (and zeroed) when a plan needs more.
kn::GemmWorkspace workspace(Env& env, int m, int64_t n, int64_t k, int groups) {
  const size_t need = std::max(kn::plan_gemm_tc(m, n, k, groups, env.force_splits, env.force_mtiles).workspace_bytes,
                               kn::plan_gemm_wgmma(m, n, k, groups, env.force_splits, env.force_mtiles, env.force_stages)
                                   .workspace_bytes);
  if (need > env.gemm_ws->bytes()) {
    env.gemm_ws->resize(need);
    env.gemm_ws->fill_bytes(0, env.stream);
  }
  return kn::GemmWorkspace{env.gemm_ws->get(), env.gemm_ws->bytes()};
}

std::string plan_note(kn::GemmVersion v, int m, int64_t n, int64_t k, int groups, const Env& env) {
  char note[128];
  if (v == kn::GemmVersion::kWgmmaPipelined) {
    const kn::GemmPlan p =
        kn::plan_gemm_wgmma_pipelined(m, n, k, groups, env.force_splits, env.force_mtiles, env.force_stages);
    std::snprintf(note, sizeof(note), "MT %d S %d (cluster) ST %d smem %zu", p.warp_mtiles, p.splits, p.stages, p.smem_bytes);
  } else if (v == kn::GemmVersion::kWgmma) {
    const kn::GemmPlan p = kn::plan_gemm_wgmma(m, n, k, groups, env.force_splits, env.force_mtiles, env.force_stages);
    std::snprintf(note, sizeof(note), "MT %d S %d ST %d smem %zu", p.warp_mtiles, p.splits, p.stages, p.smem_bytes);
  } else if (v == kn::GemmVersion::kGemv) {
    const kn::GemmPlan p = kn::plan_gemm_gemv(m, n, k);
    std::snprintf(note, sizeof(note), "rows %d S %d (warps)", p.block_n, p.splits);
  } else if (v == kn::GemmVersion::kSkinny) {
    const kn::GemmPlan p = kn::plan_gemm_skinny(m, n, k, groups, false, env.force_splits, env.force_mtiles);
    std::snprintf(note, sizeof(note), "rows %d S %d (cluster) ST %d smem %zu", p.block_n, p.splits, p.stages, p.smem_bytes);
  } else {
    const kn::GemmPlan p = kn::plan_gemm_tc(m, n, k, groups, env.force_splits, env.force_mtiles);
    std::snprintf(note, sizeof(note), "MT %d S %d", p.warp_mtiles, p.splits);
  }
  return note;
}

// ---- fp8 ------------------------------------------------------------------------------------------------
void bench_fp8(const Shape& sh, const std::vector<int>& ms, Env& env, std::vector<Row>& rows) {
  const int64_t n = sh.n, k = sh.k, kb = k / 32;
  Rng rng(static_cast<uint64_t>(n * 31 + k));
  ref::Fp8Matrix w;
  w.n = n;
  w.k = k;
  w.w.resize(static_cast<size_t>(n * k));
  w.scale.resize(static_cast<size_t>((n / 32) * kb));
  for (auto& c : w.w) c = num::e4m3_from_f32(rng.uniform() * 448.0f * std::fabs(rng.uniform()));
  for (auto& s : w.scale) s = static_cast<uint8_t>(127 + rng.range(-14, -6));
  const int copies = rotation_copies(static_cast<double>(n * k + (n / 32) * kb), env.graph_launches);
  const DeviceBuffer<uint8_t> dw = to_device_copies(w.w, env.run_graph ? copies : 1),
                              dws = to_device_copies(w.scale, env.run_graph ? copies : 1);
  auto w_copy = [&](int c) { return dw.get() + static_cast<size_t>(c) * w.w.size(); };
  auto ws_copy = [&](int c) { return dws.get() + static_cast<size_t>(c) * w.scale.size(); };
  // The bf16 peer's weight: the exact bf16 dequantisation (2x bytes, its own rotation).
  DeviceBuffer<bf16_t> dw_bf16;
  int copies_bf16 = 1;
  if (env.run_peer) {
    const std::vector<float> deq = ref::dequant_fp8(w);
    std::vector<bf16_t> hb(deq.size());
    for (size_t i = 0; i < deq.size(); ++i) hb[i] = num::bf16_from_f32(deq[i]);
    copies_bf16 = env.run_graph ? rotation_copies(static_cast<double>(2 * n * k), env.graph_launches) : 1;
    dw_bf16 = to_device_copies(hb, copies_bf16);
  }
  auto wb_copy = [&](int c) { return dw_bf16.get() + static_cast<size_t>(c) * static_cast<size_t>(n * k); };
  // The fp8 peer's scales (unit scales: a speed reference; sized with slack for any padding rule).
  DeviceBuffer<float> lt_a_scales, lt_b_scales;
  if (env.run_peer) {
    const std::vector<float> ones_a(static_cast<size_t>((k / 128 + 8) * (n / 128 + 8)), 1.0f),
        ones_b(static_cast<size_t>((k / 128 + 8) * (kn::kGemmMaxRows + 8)), 1.0f);
    lt_a_scales = to_device(ones_a);
    lt_b_scales = to_device(ones_b);
  }

  for (int m : ms) {
    std::vector<bf16_t> x(static_cast<size_t>(m * k));
    for (int r = 0; r < m; ++r)
      for (int64_t b = 0; b < kb; ++b) {
        const int e = rng.range(-6, 3);
        for (int i = 0; i < 32; ++i) x[static_cast<size_t>(r * k + b * 32 + i)] = num::bf16_from_f32(std::ldexp(rng.uniform(), e));
      }
    const ref::ActQuant aq = ref::act_quant(x.data(), m, k, k);
    std::vector<bf16_t> want(static_cast<size_t>(m * n));
    ref::gemm_fp8(aq, w, want.data(), n);

    const DeviceBuffer<bf16_t> dx = to_device(x);
    DeviceBuffer<uint8_t> dq(static_cast<size_t>(m * k)), dsa(static_cast<size_t>(m * kb));
    DeviceBuffer<bf16_t> out(static_cast<size_t>(m * n)), out_peer(static_cast<size_t>(m * n));
    kn::ActQuantParams qp;
    qp.x = dx.get();
    qp.x_stride = k;
    qp.q = dq.get();
    qp.q_stride = k;
    qp.scale = dsa.get();
    qp.scale_stride = kb;
    qp.m = m;
    qp.k = k;
    kn::Fp8GemmParams gp;
    gp.a_q = dq.get();
    gp.a_stride = k;
    gp.a_scale = dsa.get();
    gp.a_scale_stride = kb;
    gp.w = w_copy(0);
    gp.w_scale = ws_copy(0);
    gp.out = out.get();
    gp.out_stride = n;
    gp.m = m;
    gp.n = n;
    gp.k = k;
    gp.force_splits = env.force_splits;
    gp.force_mtiles = env.force_mtiles;
    gp.force_stages = env.force_stages;
    gp.v2_overlap = env.v2_overlap;
    gp.prewait_stages = env.prewait_stages;
    const kn::GemmWorkspace ws = workspace(env, m, n, k, 1);
    kn::init_gemm_workspace(ws, env.stream);
    auto gemm = [&](kn::GemmVersion v, int v3_mask = -1) -> Launch {
      return [&, v, v3_mask](cudaStream_t s, int c, bool pdl) {
        kn::Fp8GemmParams p = gp;
        p.w = w_copy(c);
        p.w_scale = ws_copy(c);
        p.v3_int_mask = v3_mask;
        kn::run_gemm_fp8(p, ws, v, s, pdl);
      };
    };

    // Validate: act quant bytes, v0 bytes, v1 / v2 <= 1 ulp.
    kn::run_act_quant_fp8(qp, env.stream, false);
    V4_CUDA_CHECK(cudaStreamSynchronize(env.stream));
    const bool quant_ok = to_host(dq, dq.size()) == aq.q && to_host(dsa, dsa.size()) == aq.scale;
    const int64_t quant_bytes = m * k * 2 + m * k + m * kb;
    const int64_t gemm_bytes = n * k + (n / 32) * kb + m * k + m * kb + m * n * 2;
    {
      Row r = make_row(sh, "act_quant", m, quant_bytes);
      r.valid = quant_ok;
      time_row(r, env, [&](cudaStream_t s, int, bool pdl) { kn::run_act_quant_fp8(qp, s, pdl); }, false, 1, true, false);
      rows.push_back(r);
    }
    bool version_valid[4] = {false, false, false, false};
    // (version, v3 mask) per row: v0, v1, v2, then v3 once per --v3-masks entry, then v6 where it runs.
    std::vector<std::pair<kn::GemmVersion, int>> variants = {
        {kn::GemmVersion::kSimple, -1}, {kn::GemmVersion::kTensorCore, -1}, {kn::GemmVersion::kWgmma, -1}};
    for (int mask : env.v3_masks) variants.emplace_back(kn::GemmVersion::kWgmmaPipelined, mask);
    if (kn::gemm_gemv_supported(m, n, k)) variants.emplace_back(kn::GemmVersion::kGemv, -1);
    for (const auto& [v, v3_mask] : variants) {
      if (v == kn::GemmVersion::kSimple && !env.run_v0) continue;
      out.fill_bytes(0xAB, env.stream);
      kn::Fp8GemmParams p = gp;
      p.v3_int_mask = v3_mask;
      kn::run_gemm_fp8(p, ws, v, env.stream, false);
      V4_CUDA_CHECK(cudaStreamSynchronize(env.stream));
      const auto [ulps, differ] = ulp_diff(to_host(out, out.size()), want, n);
      const std::string name = v == kn::GemmVersion::kSimple       ? "v0"
                               : v == kn::GemmVersion::kTensorCore ? "v1"
                               : v == kn::GemmVersion::kWgmma      ? "v2"
                               : v == kn::GemmVersion::kGemv       ? "v6"
                               : v3_mask < 0                       ? "v3"
                                                                   : "v3 int" + std::to_string(v3_mask);
      Row r = make_row(sh, name.c_str(), m, gemm_bytes);
      r.valid = quant_ok && (v == kn::GemmVersion::kSimple ? differ == 0 : ulps <= 1);
      if (v3_mask < 0 && static_cast<int>(v) < 4) version_valid[static_cast<int>(v)] = r.valid;
      if (v != kn::GemmVersion::kSimple) {
        char pct[48];
        std::snprintf(pct, sizeof(pct), "%.3f%% differ; ", 100.0 * static_cast<double>(differ) / static_cast<double>(want.size()));
        r.note = pct + plan_note(v, m, n, k, 1, env);
      }
      time_row(r, env, gemm(v, v3_mask), false, copies, v != kn::GemmVersion::kSimple, true);
      rows.push_back(r);
    }
    for (kn::GemmVersion v : {kn::GemmVersion::kTensorCore, kn::GemmVersion::kWgmma, kn::GemmVersion::kWgmmaPipelined}) {
      if (v == kn::GemmVersion::kWgmmaPipelined &&
          std::find(env.v3_masks.begin(), env.v3_masks.end(), -1) == env.v3_masks.end())
        continue;  // v3+quant uses the default mask
      Row r = make_row(sh, v == kn::GemmVersion::kTensorCore ? "v1+quant" : v == kn::GemmVersion::kWgmma ? "v2+quant" : "v3+quant",
                       m, gemm_bytes + m * k * 2);
      r.valid = version_valid[static_cast<int>(v)];
      r.note = "act_quant, then the GEMM (PDL in the event / gpdl columns)";
      const Launch g = gemm(v);
      time_row(r, env,
               [&](cudaStream_t s, int c, bool pdl) {
                 kn::run_act_quant_fp8(qp, s, false);
                 g(s, c, pdl);
               },
               true, copies, true, true);
      rows.push_back(r);
    }
    // v3 with the act quant fused in (run_gemm_fp8_fused_quant): the GEMM quantises x itself; valid
    // when its output is byte-identical to act_quant + v3 (compare with the "v3+quant" row).
    if (version_valid[static_cast<int>(kn::GemmVersion::kWgmmaPipelined)] && kn::gemm_v3_fused_quant_supported(m, n, k)) {
      kn::Fp8GemmParams fp = gp;
      fp.a_q = nullptr;
      fp.a_scale = nullptr;
      fp.a_bf16 = dx.get();
      fp.a_bf16_stride = k;
      Row r = make_row(sh, "v3 fused-quant", m, gemm_bytes - m * k - m * kb + m * k * 2);
      try {
        kn::run_gemm_fp8(gp, ws, kn::GemmVersion::kWgmmaPipelined, env.stream, false);
        V4_CUDA_CHECK(cudaStreamSynchronize(env.stream));
        const std::vector<bf16_t> unfused = to_host(out, out.size());
        out.fill_bytes(0xAB, env.stream);
        kn::run_gemm_fp8_fused_quant(fp, kn::GemmVersion::kWgmmaPipelined, env.stream, false);
        V4_CUDA_CHECK(cudaStreamSynchronize(env.stream));
        r.valid = to_host(out, out.size()) == unfused;
        r.note = "x quantised inside the GEMM; bytes == act_quant + v3: " + std::string(r.valid ? "yes" : "NO");
        time_row(r, env,
                 [&](cudaStream_t s, int c, bool pdl) {
                   kn::Fp8GemmParams q = fp;
                   q.w = w_copy(c);
                   q.w_scale = ws_copy(c);
                   kn::run_gemm_fp8_fused_quant(q, kn::GemmVersion::kWgmmaPipelined, s, pdl);
                 },
                 false, copies, true, true);
      } catch (const std::invalid_argument& e) {  // a forced plan (--splits / --stages) the fused form refuses
        r.valid = false;
        r.note = std::string("not run: ") + e.what();
      }
      rows.push_back(r);
    }
    if (env.run_peer) {
      // Reference for the bf16 peer: our bf16 v1 (validated by the tests) on the same bf16 weight and x.
      kn::Bf16GemmParams bp;
      bp.x = dx.get();
      bp.x_stride = k;
      bp.w = wb_copy(0);
      bp.out = out.get();
      bp.out_stride = n;
      bp.m = m;
      bp.n = n;
      bp.k = k;
      bp.force_splits = env.force_splits;
      bp.force_mtiles = env.force_mtiles;
      kn::run_gemm_bf16(bp, workspace(env, m, n, k, 1), kn::GemmVersion::kTensorCore, env.stream, false);
      const LtMatmul lt(CUDA_R_16BF, m, n, k, 1, k, n, env.lt, env.lt_ws->get(), env.lt_ws->bytes());
      lt.run(wb_copy(0), dx.get(), out_peer.get(), env.stream);
      V4_CUDA_CHECK(cudaStreamSynchronize(env.stream));
      const auto [ulps, differ] = ulp_diff(to_host(out_peer, out_peer.size()), to_host(out, out.size()), n);
      Row r = make_row(sh, "cublasLt bf16 (2x bytes)", m, 2 * n * k + m * k * 2 + m * n * 2);
      r.valid = ulps <= 2;
      r.note = "max " + std::to_string(ulps) + " ulp vs our bf16 v1";
      time_row(r, env, [&](cudaStream_t s, int c, bool) { lt.run(wb_copy(c), dx.get(), out_peer.get(), s); }, false,
               copies_bf16, true, false);
      rows.push_back(r);

      // fp8 block-scaled peer (speed only): same e4m3 codes, unit 128x128 / 1x128 scales.
      Row f = make_row(sh, "cublasLt fp8 blk128", m, n * k + (n / 128) * (k / 128) * 4 + m * k + m * (k / 128) * 4 + m * n * 2);
      try {
        const LtMatmul lt8(CUDA_R_8F_E4M3, m, n, k, 1, k, n, env.lt, env.lt_ws->get(), env.lt_ws->bytes(), true,
                           lt_a_scales.get(), lt_b_scales.get());
        lt8.run(w_copy(0), dq.get(), out_peer.get(), env.stream);
        V4_CUDA_CHECK(cudaStreamSynchronize(env.stream));
        f.valid = true;
        f.note = "speed reference only (1x128 / 128x128 scales, output not compared)";
        time_row(f, env, [&](cudaStream_t s, int c, bool) { lt8.run(w_copy(c), dq.get(), out_peer.get(), s); }, false,
                 copies, true, false);
      } catch (const std::exception& e) {
        (void)cudaGetLastError();
        f.valid = false;
        f.note = std::string("not run: ") + e.what();
      }
      rows.push_back(f);
    }
  }
}

// ---- bf16 -----------------------------------------------------------------------------------------------
void bench_bf16(const Shape& sh, const std::vector<int>& ms, Env& env, std::vector<Row>& rows) {
  const int64_t n = sh.n, k = sh.k;
  const int groups = sh.groups;
  Rng rng(static_cast<uint64_t>(n * 37 + k + groups));
  std::vector<ref::Bf16Matrix> w(static_cast<size_t>(groups));
  std::vector<bf16_t> hw;
  for (auto& wg : w) {
    wg.n = n;
    wg.k = k;
    wg.w.resize(static_cast<size_t>(n * k));
    for (auto& v : wg.w) v = num::bf16_from_f32(std::ldexp(rng.uniform(), rng.range(-8, -4)));
    hw.insert(hw.end(), wg.w.begin(), wg.w.end());
  }
  const int copies = env.run_graph ? rotation_copies(static_cast<double>(hw.size() * 2), env.graph_launches) : 1;
  const DeviceBuffer<bf16_t> dw = to_device_copies(hw, copies);
  auto w_copy = [&](int c) { return dw.get() + static_cast<size_t>(c) * hw.size(); };
  const int64_t x_stride = groups * k, out_stride = groups * n;
  for (int m : ms) {
    std::vector<bf16_t> x(static_cast<size_t>(m * x_stride));
    for (auto& v : x) v = num::bf16_from_f32(std::ldexp(rng.uniform(), rng.range(-4, 1)));
    std::vector<bf16_t> want(static_cast<size_t>(m * out_stride)), tmp(static_cast<size_t>(m * n));
    for (int g = 0; g < groups; ++g) {
      ref::gemm_bf16(x.data() + g * k, m, x_stride, w[static_cast<size_t>(g)], tmp.data(), n);
      for (int r = 0; r < m; ++r) std::copy_n(tmp.begin() + r * n, n, want.begin() + r * out_stride + g * n);
    }
    const DeviceBuffer<bf16_t> dx = to_device(x);
    DeviceBuffer<bf16_t> out(want.size());
    kn::Bf16GemmParams p;
    p.x = dx.get();
    p.x_stride = x_stride;
    p.w = w_copy(0);
    p.out = out.get();
    p.out_stride = out_stride;
    p.m = m;
    p.n = n;
    p.k = k;
    p.groups = groups;
    p.x_group_stride = k;
    p.w_group_stride = n * k;
    p.out_group_stride = n;
    p.force_splits = env.force_splits;
    p.force_mtiles = env.force_mtiles;
    const kn::GemmWorkspace ws = workspace(env, m, n, k, groups);
    kn::init_gemm_workspace(ws, env.stream);
    const int64_t bytes = groups * (n * k * 2 + m * k * 2 + m * n * 2);
    // What kAuto runs here (run_gemm_bf16's rule; the bench's overrides make it v1).
    const bool auto_v5 = groups == 1 && env.force_splits == 0 && env.force_mtiles == 0 && kn::skinny_gemm_preferred(m, n, k);
    for (kn::GemmVersion v : {kn::GemmVersion::kSimple, kn::GemmVersion::kTensorCore, kn::GemmVersion::kSkinny}) {
      if (v == kn::GemmVersion::kSimple && !env.run_v0) continue;
      out.fill_bytes(0xAB, env.stream);
      kn::run_gemm_bf16(p, ws, v, env.stream, false);
      V4_CUDA_CHECK(cudaStreamSynchronize(env.stream));
      const auto [ulps, differ] = ulp_diff(to_host(out, out.size()), want, n);
      Row r = make_row(sh, v == kn::GemmVersion::kSimple ? "v0" : v == kn::GemmVersion::kTensorCore ? "v1" : "v5 skinny", m, bytes);
      r.valid = v == kn::GemmVersion::kSimple ? differ == 0 : ulps <= 1;
      if (v != kn::GemmVersion::kSimple) {
        char pct[48];
        std::snprintf(pct, sizeof(pct), "%.3f%% differ; ", 100.0 * static_cast<double>(differ) / static_cast<double>(want.size()));
        r.note = pct + plan_note(v, m, n, k, groups, env);
        if ((v == kn::GemmVersion::kSkinny) == auto_v5) r.note += "; auto";
      }
      time_row(r, env,
               [&, v](cudaStream_t s, int c, bool pdl) {
                 kn::Bf16GemmParams q = p;
                 q.w = w_copy(c);
                 kn::run_gemm_bf16(q, ws, v, s, pdl);
               },
               false, copies, v != kn::GemmVersion::kSimple, true);
      rows.push_back(r);
    }
    if (env.run_peer) {
      const LtMatmul lt(CUDA_R_16BF, m, n, k, groups, x_stride, out_stride, env.lt, env.lt_ws->get(), env.lt_ws->bytes());
      out.fill_bytes(0xAB, env.stream);
      lt.run(w_copy(0), dx.get(), out.get(), env.stream);
      V4_CUDA_CHECK(cudaStreamSynchronize(env.stream));
      const auto [ulps, differ] = ulp_diff(to_host(out, out.size()), want, n);
      Row r = make_row(sh, "cublasLt bf16", m, bytes);
      r.valid = ulps <= 2;
      r.note = "max " + std::to_string(ulps) + " ulp vs reference";
      time_row(r, env, [&](cudaStream_t s, int c, bool) { lt.run(w_copy(c), dx.get(), out.get(), s); }, false, copies, true,
               false);
      rows.push_back(r);
    }
  }
}

// ---- f32 ------------------------------------------------------------------------------------------------
void bench_f32(const Shape& sh, const std::vector<int>& ms, Env& env, std::vector<Row>& rows) {
  const int64_t n = sh.n, k = sh.k;
  Rng rng(static_cast<uint64_t>(n * 41 + k));
  ref::F32Matrix w;
  w.n = n;
  w.k = k;
  w.w.resize(static_cast<size_t>(n * k));
  for (auto& v : w.w) v = rng.uniform() * 0.015625f;
  const int copies = env.run_graph ? rotation_copies(static_cast<double>(w.w.size() * 4), env.graph_launches) : 1;
  const DeviceBuffer<float> dw = to_device_copies(w.w, copies);
  auto w_copy = [&](int c) { return dw.get() + static_cast<size_t>(c) * w.w.size(); };
  for (int m : ms) {
    std::vector<bf16_t> x(static_cast<size_t>(m * k));
    std::vector<float> xf(x.size());
    for (size_t i = 0; i < x.size(); ++i) {
      x[i] = num::bf16_from_f32(std::ldexp(rng.uniform(), rng.range(-4, 1)));
      xf[i] = num::f32_from_bf16(x[i]);
    }
    std::vector<float> want(static_cast<size_t>(m * n));
    ref::gemm_f32(x.data(), m, k, w, want.data(), n);
    // Rounding bound per element: 2 (k + 8) 2^-24 sum |x w|.
    std::vector<double> bound(want.size());
    for (int r = 0; r < m; ++r)
      for (int64_t c = 0; c < n; ++c) {
        double mag = 0.0;
        for (int64_t i = 0; i < k; ++i) mag += std::fabs(static_cast<double>(xf[static_cast<size_t>(r * k + i)]) * w.w[static_cast<size_t>(c * k + i)]);
        bound[static_cast<size_t>(r * n + c)] = 2.0 * static_cast<double>(k + 8) * 0x1.0p-24 * mag;
      }
    auto within = [&](const std::vector<float>& got, bool exact) {
      for (size_t i = 0; i < got.size(); ++i) {
        if (exact ? num::f32_bits(got[i]) != num::f32_bits(want[i])
                  : !(std::fabs(static_cast<double>(got[i]) - static_cast<double>(want[i])) <= bound[i]))
          return false;
      }
      return true;
    };
    const DeviceBuffer<bf16_t> dx = to_device(x);
    const DeviceBuffer<float> dxf = to_device(xf);
    DeviceBuffer<float> out(want.size());
    kn::F32GemmParams p;
    p.x = dx.get();
    p.x_stride = k;
    p.w = w_copy(0);
    p.out = out.get();
    p.out_stride = n;
    p.m = m;
    p.n = n;
    p.k = k;
    p.force_splits = env.force_splits;  // v5 only
    const int64_t bytes = n * k * 4 + m * k * 2 + m * n * 4;
    const bool auto_v5 = kn::skinny_gemm_preferred(m, n, k) && k % 32 == 0;  // x is dense and aligned here
    for (kn::GemmVersion v : {kn::GemmVersion::kSimple, kn::GemmVersion::kTensorCore, kn::GemmVersion::kSkinny}) {
      if (v == kn::GemmVersion::kSimple && !env.run_v0) continue;
      out.fill_bytes(0xAB, env.stream);
      kn::run_gemm_f32(p, v, env.stream, false);
      V4_CUDA_CHECK(cudaStreamSynchronize(env.stream));
      Row r = make_row(sh, v == kn::GemmVersion::kSimple ? "v0" : v == kn::GemmVersion::kTensorCore ? "v1" : "v5 skinny", m, bytes);
      r.valid = within(to_host(out, out.size()), v == kn::GemmVersion::kSimple);
      if (v == kn::GemmVersion::kSkinny) {
        const kn::GemmPlan sp = kn::plan_gemm_skinny(m, n, k, 1, true, env.force_splits);
        char note[96];
        std::snprintf(note, sizeof(note), "rows %d S %d (cluster) ST %d smem %zu", sp.block_n, sp.splits, sp.stages, sp.smem_bytes);
        r.note = note;
      }
      if (v != kn::GemmVersion::kSimple && (v == kn::GemmVersion::kSkinny) == auto_v5)
        r.note += r.note.empty() ? "auto" : "; auto";
      time_row(r, env,
               [&, v](cudaStream_t s, int c, bool pdl) {
                 kn::F32GemmParams q = p;
                 q.w = w_copy(c);
                 kn::run_gemm_f32(q, v, s, pdl);
               },
               false, copies, v != kn::GemmVersion::kSimple, true);
      rows.push_back(r);
    }
    if (env.run_peer) {
      const LtMatmul lt(CUDA_R_32F, m, n, k, 1, k, n, env.lt, env.lt_ws->get(), env.lt_ws->bytes());
      out.fill_bytes(0xAB, env.stream);
      lt.run(w_copy(0), dxf.get(), out.get(), env.stream);
      V4_CUDA_CHECK(cudaStreamSynchronize(env.stream));
      Row r = make_row(sh, "cublasLt f32", m, n * k * 4 + m * k * 4 + m * n * 4);
      r.valid = within(to_host(out, out.size()), false);
      r.note = "x widened to fp32 for it";
      time_row(r, env, [&](cudaStream_t s, int c, bool) { lt.run(w_copy(c), dxf.get(), out.get(), s); }, false, copies, true,
               false);
      rows.push_back(r);
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"bench_gemm: validate, then time the prepare-path GEMMs at M = 1..64"};
  v4attn::bench::add_version_flag(app, "bench_gemm");
  std::vector<int> ms = {1, 6, 8, 24, 48, 64};
  std::vector<std::string> shapes;
  Env env;
  bool no_v0 = false, no_peer = false, no_graph = false;
  std::string json_path;
  std::string shape_names;
  for (const Shape& s : kShapes) shape_names += std::string(shape_names.empty() ? "" : ", ") + s.name;
  app.add_option("--m", ms, "row counts m (1..64)")->delimiter(',');
  app.add_option("--shapes", shapes, "shapes to run (default all): " + shape_names)->delimiter(',');
  app.add_option("--reps", env.reps, "timed eager launches per case (>= 50)")->check(CLI::Range(50, 100000));
  app.add_flag("--no-v0", no_v0, "skip the (slow) v0 baseline");
  app.add_option("--splits", env.force_splits, "v1 / v2 / v3 / v5: force S K-splits (0 = automatic plan; v3 and v5 cap it at 8)")
      ->check(CLI::Range(0, 4096));
  app.add_option("--mtiles", env.force_mtiles, "v1: force 1 or 2 m16 tiles per warp; v2, v3: 1 or 2 m64 tiles per warpgroup; v5 bf16: 1 or 2 m16 tiles per CTA (0 = automatic)")
      ->check(CLI::Range(0, 2));
  app.add_option("--stages", env.force_stages, "v2, v3: at most this many TMA ring stages (0 = automatic)")->check(CLI::Range(0, 8));
  app.add_option("--v2-overlap", env.v2_overlap,
                 "v2 consumer loop: 0 one K block at a time, 1 widening overlapped, 2 fully pipelined across pairs of "
                 "stages (m <= 32), -1 default")
      ->check(CLI::Range(-1, 2));
  app.add_option("--prewait-stages", env.prewait_stages,
                 "v2: weight stages fetched before the PDL wait (-1 = the whole first ring fill)")
      ->check(CLI::Range(-1, 8));
  app.add_option("--v3-masks", env.v3_masks,
                 "v3 rows: one per integer-widening mask (-1 = default (0), 0 = all cvt, 15 = all integer; bit j = "
                 "block j of each 4-block stage)")
      ->delimiter(',')
      ->check(CLI::Range(-1, 15));
  app.add_flag("--no-peer", no_peer, "skip the cuBLASLt peers");
  app.add_flag("--no-graph", no_graph, "skip the graph-replay timings (us_graph, us_gpdl)");
  app.add_option("--graph-launches", env.graph_launches, "launches per captured graph (>= 4)")->check(CLI::Range(4, 1000));
  app.add_option("--json", json_path, "also write the rows to this JSON file");
  CLI11_PARSE(app, argc, argv);
  env.run_v0 = !no_v0;
  env.run_peer = !no_peer;
  env.run_graph = !no_graph;

  try {
    if (!bench::gpu_present("bench_gemm")) return 2;
    for (int m : ms)
      if (m < 1 || m > kn::kGemmMaxRows) throw std::invalid_argument("--m values must be in [1, 64]");
    for (const std::string& s : shapes)
      if (std::none_of(std::begin(kShapes), std::end(kShapes), [&](const Shape& k) { return s == k.name; }))
        throw std::invalid_argument("unknown shape '" + s + "' (known: " + shape_names + ")");
    ref::set_gemm_threads(static_cast<int>(std::max(2u, std::thread::hardware_concurrency())));

    V4_CUDA_CHECK(cudaStreamCreateWithFlags(&env.stream, cudaStreamNonBlocking));
    bench::L2Flush l2;
    DeviceBuffer<uint8_t> lt_ws(size_t{32} << 20);
    size_t ws_bytes = 0;
    for (const Shape& s : kShapes)
      if (s.kind != Kind::kF32) ws_bytes = std::max(ws_bytes, kn::gemm_workspace_bytes(kn::kGemmMaxRows, s.n, s.k, s.groups));
    DeviceBuffer<uint8_t> gemm_ws(std::max<size_t>(ws_bytes, 256));
    gemm_ws.fill_bytes(0, env.stream);
    env.l2 = &l2;
    env.lt_ws = &lt_ws;
    env.gemm_ws = &gemm_ws;
    if (cublasLtCreate(&env.lt) != CUBLAS_STATUS_SUCCESS) throw std::runtime_error("cublasLtCreate failed");

    std::vector<Row> rows;
    std::printf("%-13s %-24s %3s %9s %9s %9s %11s %9s %7s %7s %7s %5s %3s %-8s %s\n", "shape", "version", "m", "us_event",
                "us_graph", "us_gpdl", "bytes", "floor_us", "%floor", "%fl_pdl", "%fl_ev", "reps", "cp", "valid", "note");
    size_t printed = 0;
    for (const Shape& sh : kShapes) {
      if (!shapes.empty() && std::find(shapes.begin(), shapes.end(), sh.name) == shapes.end()) continue;
      if (sh.kind == Kind::kFp8) bench_fp8(sh, ms, env, rows);
      else if (sh.kind == Kind::kBf16) bench_bf16(sh, ms, env, rows);
      else bench_f32(sh, ms, env, rows);
      for (; printed < rows.size(); ++printed) {
        const Row& r = rows[printed];
        std::printf("%-13s %-24s %3d %9s %9s %9s %11lld %9.3f %7s %7s %7s %5d %3d %-8s %s\n", r.shape.c_str(), r.version.c_str(),
                    r.m, bench::fmt_us(r.median_us).c_str(), bench::fmt_us(r.graph_us).c_str(),
                    bench::fmt_us(r.graph_pdl_us).c_str(),
                    static_cast<long long>(r.bytes), r.floor_us(), bench::fmt_pct(r.pct(r.graph_us)).c_str(),
                    bench::fmt_pct(r.pct(r.graph_pdl_us)).c_str(), bench::fmt_pct(r.pct(r.median_us)).c_str(), r.reps, r.copies,
                    r.valid ? "ok" : "MISMATCH", r.note.c_str());
      }
      std::fflush(stdout);
    }

    bool all_valid = true;
    for (const Row& r : rows)
      if (r.version.rfind("cublasLt", 0) != 0) all_valid = all_valid && r.valid;  // peers are informational
    if (!json_path.empty()) {
      nlohmann::json j = nlohmann::json::array();
      for (const Row& r : rows)
        j.push_back({{"shape", r.shape}, {"kernel", r.kernel}, {"version", r.version}, {"m", r.m}, {"median_us", r.median_us},
                     {"graph_us", r.graph_us}, {"graph_pdl_us", r.graph_pdl_us}, {"graph_launches", env.graph_launches},
                     {"weight_copies", r.copies}, {"bytes", r.bytes}, {"floor_us", r.floor_us()},
                     {"pct_of_floor", r.pct(r.median_us)}, {"pct_of_floor_graph", r.pct(r.graph_us)},
                     {"pct_of_floor_graph_pdl", r.pct(r.graph_pdl_us)}, {"ratio", r.median_us / r.floor_us()},
                     {"reps", r.reps}, {"valid", r.valid}, {"note", r.note}});
      bench::write_json(json_path, j);
    }
    cublasLtDestroy(env.lt);
    V4_CUDA_CHECK(cudaStreamDestroy(env.stream));
    return bench::validity_exit_code("bench_gemm", all_valid);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_gemm: %s\n", e.what());
    return 1;
  }
}
