// The GPU prepare stack (include/v4attn/prepare/stack.h): buffers, weights, step metadata and the
// per-layer work items wired to the kernels of include/v4attn/kernels/ and issued through
// issue_layer (runtime/lanes.h).
#include "v4attn/prepare/stack.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "prepare/stack_kernels.h"
#include "runtime/cuda_utils.h"
#include "runtime/device_error_counter.h"
#include "v4attn/cache_layout.h"
#include "v4attn/kernels/indexer_kernels.h"
#include "v4attn/kernels/norm_kernels.h"
#include "v4attn/kernels/prepare_kernels.h"
#include "v4attn/kernels/qchain.h"
#include "v4attn/reference/stack.h"
#include "v4attn/reference/weights.h"
#include "v4attn/rope_table.h"
#include "v4attn/runtime/nvtx.h"

namespace v4attn::prepare {

using num::bf16_t;
namespace kn = v4attn::kernels;

namespace {

constexpr int kHd = 512;        // head_dim / latent width
constexpr int kIdxHd = 128;     // index_head_dim
constexpr int kStateRow = 1024; // ratio-2 pair state row: kv | score
constexpr int kScoreHeads = kn::kIndexerHeads;  // the scores kernel's head count (32)

[[noreturn]] void fail(const std::string& what) { throw std::invalid_argument("GpuPrepareStack: " + what); }

int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

int effective_rows_per_request(const ModelPlan& plan, const GpuStackOptions& o) {
  return o.rows_per_request == 0 ? plan.config.verify_rows_per_request() : o.rows_per_request;
}

std::vector<int> default_buckets(StepKind kind, const ModelPlan& plan, int max_rows) {
  std::vector<int> b;
  if (kind == StepKind::kDecode) {
    for (int r : {1, 2, 4, 8, 16, 24, 32, 48, 64})
      if (r < max_rows) b.push_back(r);
  } else {
    const int v = plan.config.verify_rows_per_request();
    for (int m : {1, 2, 3, 4, 6, 8, 10})
      if (v * m < max_rows) b.push_back(v * m);
  }
  b.push_back(max_rows);
  return b;
}

// Step metadata fields of the static device block [kMFields, max_rows] int32.
enum MetaField : int {
  kMPos,         // position (0 for padded rows)
  kMReq,         // request (-1 for padded rows)
  kMSwaLoc,      // window ring slot (-1: no write)
  kMCLoc1,       // ratio-1 compressed slot (<= 0: skip)
  kMCLoc2,       // ratio-2 compressed slot (<= 0: skip)
  kMClen1,       // (pos + 1) / 1 (0 for padded rows)
  kMClen2,       // (pos + 1) / 2
  kMStateRow,   // pair-state row (-1: padded)
  kMPrevRow,     // ratio-2 partner row in the batch (-1: read the state)
  kMPartnerRow,  // pair-state row of the partner (odd pos) or -1
  kMGroup2,      // ratio-2 group position pos - 1 for rows completing a group, else 0 (store skipped)
  kMFields
};

struct LayerWeightsDev {
  uint8_t* wqkv_a = nullptr;   // [q_rank + 512, dim] e4m3
  uint8_t* wqkv_a_s = nullptr; // [(q_rank + 512) / 32, dim / 32] ue8m0
  float* q_norm = nullptr;     // [q_rank]
  uint8_t* wq_b = nullptr;     // [H * 512, q_rank]
  uint8_t* wq_b_s = nullptr;
  float* kv_norm = nullptr;    // [512]
  bf16_t* wkv_c = nullptr;     // ratio-1 compressor [512, dim]
  float* wkv_gate = nullptr;   // ratio-2 compressor [wkv; wgate] = [1024, dim]
  float* c_norm = nullptr;     // [512]
  bf16_t* wk = nullptr;        // [128, 512]
  float* k_norm = nullptr;     // [128]
  uint8_t* iwq_b = nullptr;    // indexer [Hi * 128, q_rank]
  uint8_t* iwq_b_s = nullptr;
  bf16_t* wproj = nullptr;     // [wproj_rows, dim]; rows >= Hi are zero
};

}  // namespace

int scores_auto_group_rows(bool verify, int64_t rows, int rows_per_request) {
  if (!verify) return 1;
  const int rpr = std::clamp(rows_per_request, 1, 8);
  const int64_t requests = (std::max<int64_t>(rows, 0) + rpr - 1) / rpr;
  return requests >= kScoresHalfGroupRequests ? (rpr + 1) / 2 : rpr;
}

const char* to_string(WeightSource w) {
  switch (w) {
    case WeightSource::kReference: return "reference";
    case WeightSource::kDeviceRandom: return "device-random";
  }
  return "?";
}

const char* to_string(Fusion f) {
  switch (f) {
    case Fusion::kOff: return "off";
    case Fusion::kAuto: return "auto";
    case Fusion::kOn: return "on";
  }
  return "?";
}

// Whether a Fusion knob of GpuStackOptions applies to a step of T rows: kOn up to on_max rows (the
// fused form's own limit), kAuto within its measured range [auto_min, auto_max], kOff never.
static bool fusion_applies(Fusion f, int T, int auto_min, int auto_max, int on_max = std::numeric_limits<int>::max()) {
  switch (f) {
    case Fusion::kOff: return false;
    case Fusion::kAuto: return T >= auto_min && T <= auto_max;
    case Fusion::kOn: return T <= on_max;
  }
  return false;
}

void check_qb_side_mtiles(int v) {
  if (v != 0 && v != 2 && v != 4) fail("qb_side_mtiles must be 0, 2 or 4 (got " + std::to_string(v) + ")");
}

void validate_options(const ModelPlan& plan, const GpuStackOptions& o) {
  const ModelConfig& c = plan.config;
  if (c.n_layers < 1) fail("the config has no backbone layer");
  if (static_cast<int>(plan.layers.size()) != c.total_layers()) fail("the plan has the wrong number of layers");
  if (plan.parallel.tp < 1 || plan.parallel.local_heads < 1) fail("the plan has no local heads");
  if (o.n_requests < 1) fail("n_requests must be >= 1 (got " + std::to_string(o.n_requests) + ")");
  // >= 2: a ratio-2 pool then has at least one compressed position (slot tables are never empty).
  if (o.max_context < 2) fail("max_context must be >= 2 (got " + std::to_string(o.max_context) + ")");
  if (o.rows_per_request < 0) fail("rows_per_request must be >= 0 (0: the config's verify rows)");
  if (o.max_rows < 1 || o.max_rows > kn::kGemmMaxRows)
    fail("max_rows must be in [1, " + std::to_string(kn::kGemmMaxRows) + "] (got " + std::to_string(o.max_rows) + ")");
  if (o.weights == WeightSource::kReference && plan.parallel.tp != 1)
    fail("reference weights need tp 1 (the CPU reference runs tp 1 only; got tp " + std::to_string(plan.parallel.tp) + ")");
  if (c.head_dim != kHd || c.rope_head_dim != 64) fail("head_dim must be 512 and rope_head_dim 64");
  if (c.q_lora_rank % 32 != 0 || c.q_lora_rank > 8192) fail("q_lora_rank must be a multiple of 32 and <= 8192");
  if (c.dim % 32 != 0) fail("dim must be a multiple of 32");
  if (!c.index_source_layers.empty()) {
    if (c.index_head_dim != kIdxHd) fail("index_head_dim must be 128");
    if (c.index_n_heads < 1 || c.index_n_heads > kScoreHeads)
      fail("index_n_heads " + std::to_string(c.index_n_heads) + " is not in [1, 32] (the scores kernel is written for 32)");
    if (c.index_topk < 1) fail("index_topk must be >= 1");
  }
  for (int s : c.kv_source_layers) {
    const int r = plan.layers[static_cast<size_t>(s)].ratio;
    if (r != 1 && r != 2) fail("kv source " + std::to_string(s) + " has ratio " + std::to_string(r) + " (must be 1 or 2)");
  }
  const auto check_buckets = [&](const std::vector<int>& b, const char* name) {
    for (int r : b)
      if (r < 1 || r > o.max_rows)
        fail(std::string(name) + " bucket " + std::to_string(r) + " is outside [1, max_rows " + std::to_string(o.max_rows) + "]");
  };
  check_buckets(o.decode_buckets, "decode");
  check_buckets(o.verify_buckets, "verify");
  if (o.scores_group_rows < 0 || o.scores_group_rows > 8)
    fail("scores_group_rows must be in [0, 8] (got " + std::to_string(o.scores_group_rows) + ")");
  if (o.idx_scores_on_main && !o.idx_gemm_on_main)
    fail("idx_scores_on_main needs idx_gemm_on_main (the scores read the indexer GEMM's output on main)");
  if (o.idx_gemm_on_main && o.s_fork == LayerIssue::SFork::kIdxGemmsOnK)
    fail("idx_gemm_on_main and s_fork idx-gemms-on-k place the indexer's GEMM on two different lanes");
  if (o.select_cluster != 0 && o.select_cluster != 1 && o.select_cluster != 2 && o.select_cluster != 4 &&
      o.select_cluster != 8 && o.select_cluster != 16)
    fail("select_cluster must be 0 (automatic), 1, 2, 4, 8 or 16 (got " + std::to_string(o.select_cluster) + ")");
  if (o.select_version != 2 && o.select_version != 3)
    fail("select_version must be 2 or 3 (got " + std::to_string(o.select_version) + ")");
  if (o.qb_prewait_stages < -1) fail("qb_prewait_stages must be >= -1 (got " + std::to_string(o.qb_prewait_stages) + ")");
  if (o.qb_overlap < -1 || o.qb_overlap > 2) fail("qb_overlap must be -1, 0, 1 or 2 (got " + std::to_string(o.qb_overlap) + ")");
  check_qb_side_mtiles(o.qb_side_mtiles);
  if (o.aq_warps < -1 || o.aq_warps > 32)
    fail("aq_warps must be -1 (automatic) or 0..32 (got " + std::to_string(o.aq_warps) + ")");
  if (o.v3_int_mask < -1 || o.v3_int_mask > 15)
    fail("v3_int_mask must be -1 (the v3 default) or 0..15 (got " + std::to_string(o.v3_int_mask) + ")");
  if (o.qb_prewait_pace_ns < -1 || o.qb_prewait_pace_ns > 100000)
    fail("qb_prewait_pace_ns must be -1 (automatic) or 0..100000 (got " + std::to_string(o.qb_prewait_pace_ns) + ")");
  if (!kn::indexer_scores_mask_tile_ok(o.scores_mask_tile))
    fail("scores_mask_tile must be 0 (automatic), 16, 32, 64, 128 or 256 (got " + std::to_string(o.scores_mask_tile) + ")");
  if (o.scores_min_blocks != 0 && o.scores_min_blocks != 3 && o.scores_min_blocks != 4)
    fail("scores_min_blocks must be 0, 3 or 4 (got " + std::to_string(o.scores_min_blocks) + ")");
  if (o.scores_row_split < 0 || o.scores_row_split > 2)
    fail("scores_row_split must be 0 (automatic), 1 or 2 (got " + std::to_string(o.scores_row_split) + ")");
  if (o.scores_steps < 0 || o.scores_steps > 64)
    fail("scores_steps must be in [0, 64] (got " + std::to_string(o.scores_steps) + ")");
}

// ---------------------------------------------------------------------------------------------------
struct GpuPrepareStack::Impl {
  // Declared first so that it is destroyed last: every device pointer below points into it.
  std::vector<DeviceBuffer<uint8_t>> owned;
  size_t bytes = 0, weight_bytes = 0;

  ModelPlan plan;
  GpuStackOptions o;
  RequestPool pool;
  int n_layers = 0, dim = 0, q_rank = 0, qkv_w = 0, H = 0, H_pad = 0, Hi = 0, wproj_rows = 0;
  float eps = 0.0f;
  int rows_per_request = 0;
  int64_t max_pos = 0, window_slots = 0, full_slots = 0, pair_rows = 0, topk_width = 0, mask_stride = 0;
  int64_t comp_stride[3] = {0, 0, 0};    // slot-table stride per ratio (max_context / r)
  int64_t score_stride_r[3] = {0, 0, 0}; // score row stride per ratio
  int cand_ratio = 0;

  PrepareStreams lanes;
  GraphCache graphs;
  DeviceErrorCounter err;
  kn::GemmWorkspace ws[kNumLanes];  // one per lane: GEMMs on different lanes may run concurrently

  float* rope[2] = {nullptr, nullptr};  // [max_pos, 64]: ratio-0 table, compressed (YaRN) table
  int32_t* comp_table[3] = {nullptr, nullptr, nullptr};
  int32_t* meta = nullptr;   // [kMFields, max_rows]
  int32_t* ctx_dev = nullptr;  // [n_requests] (prefill)
  uint32_t* cycle_scratch = nullptr;  // [4]: the cycle prologue's memset targets
  uint32_t* qdist_bar = nullptr;      // [2]: the distributed q_norm's counters (zero at rest)
  // s_fork == kIdxGemmsOnK: recorded on lane K after the indexer's GEMMs, waited for on lane S
  // before the rest of IDX. One event serves every layer: each layer's wait is issued (at
  // join(S)) right after that layer's record (at join(K)), before the next record.
  cudaEvent_t idx_gemms_done = nullptr;
  cudaEvent_t idx_x_done = nullptr;  // idx_x_on_k: recorded on lane K after weights_proj, waited for on S
  bf16_t* x_all = nullptr;   // [n_layers, max_rows, dim]
  int64_t x_layer_stride = 0;
  std::vector<LayerWeightsDev> w;
  std::vector<uint8_t*> window;     // per backbone layer
  std::vector<uint8_t*> comp, index_k;  // per layer id (kv sources)
  std::vector<float*> pair;             // per layer id (ratio-2 kv sources)
  std::vector<int64_t> comp_slots;      // per layer id (kv sources)
  std::vector<bf16_t*> q_pad;           // per backbone layer [max_rows, H_pad, 512]
  std::vector<int32_t*> topk;           // per layer id (index sources) [max_rows, topk_width]
  uint8_t* cand_mask = nullptr;         // [max_rows, mask_stride]
  // Scratch, main lane: QA / q_norm / QB.
  uint8_t* xq = nullptr;   // [max_rows, dim] e4m3
  uint8_t* xs = nullptr;   // [max_rows, dim / 32]
  bf16_t* qkv_a = nullptr; // [max_rows, qkv_w]
  bf16_t* qr = nullptr;    // [max_rows, q_rank]
  uint8_t* qrq = nullptr;  // [max_rows, q_rank]
  uint8_t* qrs = nullptr;  // [max_rows, q_rank / 32]
  bf16_t* q = nullptr;     // [max_rows, H * 512]
  // Scratch, CMP (lane S or main).
  bf16_t* proj = nullptr;   // [max_rows, 512]
  float* kvs = nullptr;     // [max_rows, 1024]
  bf16_t* latent = nullptr; // [max_rows, 512] (zeroed once: ratio-2 rows without a group keep old values)
  bf16_t* kproj = nullptr;  // [max_rows, 128]
  // Scratch, IDX (lane S or main).
  bf16_t* qi = nullptr;          // [max_rows, Hi * 128]
  bf16_t* wproj_out = nullptr;   // [max_rows, wproj_rows]
  uint8_t* iq_codes = nullptr;   // [max_rows, 32, 64]
  uint8_t* iq_scales = nullptr;  // [max_rows, 32, 4]
  float* iw = nullptr;           // [max_rows, 32]
  uint8_t* iq_codes_c = nullptr; // Hi < 32: compact q pack output [max_rows, Hi, 64]
  uint8_t* iq_scales_c = nullptr;
  float* iw_c = nullptr;
  float* scores = nullptr;       // [max_rows, max score stride]
  uint8_t* qchain_ws = nullptr;  // kernels/qchain.h workspace (null: the shape has no fused chain)
  size_t qchain_ws_bytes = 0;
  // qchain_fused_supported at T rows (bit T), asked once at init: the rule queries the driver
  // (SM count, execution affinity) and the MPS share, which a stack's life does not change.
  uint32_t qchain_rows_ok = 0;
  uint32_t qchain_direct_ok = 0;  // the same, for the direct q hand-off
  uint8_t* select_ws = nullptr;  // multi-CTA top-k / candidate mask workspace (zeroed once; null: v1 kernels)
  size_t select_ws_bytes = 0;

  bool has_step = false;
  StepMeta step_meta;
  StepInfo info;
  int64_t steps = 0;
  std::vector<int32_t> meta_staging;             // host copy source of the last metadata upload
  std::vector<std::vector<bf16_t>> x_staging;    // host copy sources of the last input upload

  Impl(const ModelPlan& p, const GpuStackOptions& opt)
      : plan(p),
        o(opt),
        graphs(opt.decode_buckets.empty() ? default_buckets(StepKind::kDecode, p, opt.max_rows) : opt.decode_buckets,
               opt.verify_buckets.empty() ? default_buckets(StepKind::kVerify, p, opt.max_rows) : opt.verify_buckets),
        err(lanes.main_stream()) {
    if (opt.side_priority != 0) lanes.set_side_priority(opt.side_priority);
  }

  ~Impl() {
    // Nothing may still run on the buffers when they are freed.
    if (lanes.main_stream()) cudaStreamSynchronize(lanes.main_stream());
    cudaDeviceSynchronize();
    if (idx_gemms_done) cudaEventDestroy(idx_gemms_done);
    if (idx_x_done) cudaEventDestroy(idx_x_done);
  }

  cudaStream_t main() const { return lanes.main_stream(); }
  void progress(const std::string& line) const {
    if (o.progress) o.progress(line);
  }

  template <class T>
  T* alloc(size_t n, bool is_weight = false) {
    const size_t b = std::max<size_t>(1, n) * sizeof(T);
    owned.emplace_back(b);
    bytes += b;
    if (is_weight) weight_bytes += b;
    return reinterpret_cast<T*>(owned.back().get());
  }
  void zero(void* p, size_t b) { V4_CUDA_CHECK(cudaMemsetAsync(p, 0, b, main())); }
  template <class T>
  void upload(T* dst, const T* src, size_t n) {
    V4_CUDA_CHECK(cudaMemcpyAsync(dst, src, n * sizeof(T), cudaMemcpyHostToDevice, main()));
  }
  template <class T>
  std::vector<T> download(const T* src, size_t n) {
    std::vector<T> h(n);
    V4_CUDA_CHECK(cudaStreamSynchronize(main()));
    if (n) V4_CUDA_CHECK(cudaMemcpy(h.data(), src, n * sizeof(T), cudaMemcpyDeviceToHost));
    return h;
  }
  void sync() { V4_CUDA_CHECK(cudaStreamSynchronize(main())); }

  const LayerPlan& lp(int L) const { return plan.layers[static_cast<size_t>(L)]; }
  int64_t window_bytes() const { return cache_layout(CacheKind::kWindowV41).pool_bytes(window_slots); }
  int64_t comp_bytes(int s) const { return cache_layout(CacheKind::kCompressedFp4).pool_bytes(comp_slots[static_cast<size_t>(s)]); }
  int64_t index_k_bytes(int s) const { return cache_layout(CacheKind::kIndexK).pool_bytes(comp_slots[static_cast<size_t>(s)]); }
  const int32_t* mf(MetaField f) const { return meta + static_cast<int64_t>(f) * o.max_rows; }
  const float* table(int L) const { return rope[lp(L).ratio > 0 ? 1 : 0]; }
  bf16_t* x(int L) const { return x_all + static_cast<int64_t>(L) * x_layer_stride; }
  // out [m, n] = x [m, k] @ w [n, k]^T, dense rows, with the small-GEMM version on stream s.
  void gemm_bf16_dense(const bf16_t* xin, const bf16_t* wt, bf16_t* out, int m, int64_t n, int64_t k,
                       cudaStream_t s) const {
    kn::Bf16GemmParams g;
    g.x = xin;
    g.x_stride = k;
    g.w = wt;
    g.out = out;
    g.out_stride = n;
    g.m = m;
    g.n = n;
    g.k = k;
    kn::run_gemm_bf16(g, ws_for(s), small_gemm(), s, pdl_rest());
  }
  // The version run_gemm_fp8 runs for an m x n x k GEMM under o.gemm (kAuto / kSkinny resolve by shape).
  kn::GemmVersion fp8_version(int m, int64_t n, int64_t k) const {
    return o.gemm == kn::GemmVersion::kAuto || o.gemm == kn::GemmVersion::kSkinny ? kn::best_fp8_gemm_version(m, n, k)
                                                                                    : o.gemm;
  }
  // The bf16 / fp32 GEMMs' version: gemm_small unless it is kAuto, then the cycle's version.
  kn::GemmVersion small_gemm() const { return o.gemm_small != kn::GemmVersion::kAuto ? o.gemm_small : o.gemm; }
  // GpuStackOptions::fuse_cmp_tail: the fused tail has GEMM v5's bytes for wk, so it runs only where
  // the unfused wk GEMM (gemm_bf16_dense) would run v5.
  bool cmp_tail_fused(int T) const {
    return o.fuse_cmp_tail != Fusion::kOff &&
           kn::bf16_gemm_version(small_gemm(), T, kIdxHd, kHd) == kn::GemmVersion::kSkinny;
  }

  const kn::GemmWorkspace& ws_for(cudaStream_t s) const {
    if (s == lanes.stream(Lane::kS)) return ws[static_cast<int>(Lane::kS)];
    if (s == lanes.stream(Lane::kK)) return ws[static_cast<int>(Lane::kK)];
    return ws[static_cast<int>(Lane::kMain)];
  }

  void init();
  void init_weights_reference();
  void init_weights_device_random();
  void issue_cycle(int T);
  void issue_qa(int L, int T, cudaStream_t s);
  void issue_q_norm(int L, int T, cudaStream_t s);
  // Where layer L's q_norm runs at T rows: its own kernel, or inside the wq_b GEMM -- every CTA all
  // rows (GpuStackOptions::fuse_qnorm) or the first CTAs one row each (GpuStackOptions::qnorm_dist).
  enum class QNormAt : uint8_t { kKernel, kGemmEveryCta, kGemmRowCtas };
  QNormAt qnorm_at(int L, int T) const;
  void issue_qb(int L, int T, cudaStream_t s);
  // GpuStackOptions::fuse_qchain / fuse_qchain_index: whether layer L (plain / reindex) runs its Q
  // chain as the fused kernel at T rows, and that kernel.
  bool qchain_fused_layer(int L, int T) const;
  bool qchain_fused_index_layer(int L, int T) const;
  // The row rule both share: the knob f (kAuto up to auto_rows) and rows the kernel was built for.
  bool qchain_fused_rows(Fusion f, int auto_rows, int T) const;
  bool src_idx_main_layer(int L, int T) const;  // GpuStackOptions::src_idx_main applies to layer L
  // GpuStackOptions::idx_gemv / qa_gemv: whether an m = T x n x k fp8 GEMM runs v6 under the knob f
  // (kAuto up to auto_rows, and only with `gemm` kAuto) where v6 takes the shape.
  bool gemv_applies(Fusion f, int auto_rows, int T, int64_t n, int64_t k) const;
  void issue_qchain_fused(int L, int T, cudaStream_t s);
  void issue_kv(int L, int T, cudaStream_t s);
  kn::WindowKStoreParams window_k_params(int L, int T) const;
  void issue_cmp(int L, int T, cudaStream_t s);
  void issue_idx(int L, int T, cudaStream_t s);         // indexer GEMMs + the rest
  void issue_idx_gemms(int L, int T, cudaStream_t s);   // qi = wq_b_idx(qr)
  void issue_idx_x(int L, int T, cudaStream_t s);       // weights_proj(x): reads only x
  void issue_idx_rest(int L, int T, cudaStream_t s);    // issue_idx_score then issue_idx_select
  // q pack, scores; before_qb: the wq_b GEMM follows on this stream (idx_scores_on_main)
  void issue_idx_score(int L, int T, cudaStream_t s, bool before_qb = false);
  void issue_idx_select(int L, int T, cudaStream_t s);  // candidate mask, top-k
  // PDL for the kernels other than q_rope_store (GpuStackOptions::pdl_everywhere).
  bool pdl_rest() const { return o.pdl && o.pdl_everywhere; }

  void invalidate_graphs() {
    sync();
    graphs.invalidate();
  }
  // The options setters: a new value drops the captured graphs (they hold the old choice).
  template <class T>
  void set_option(T GpuStackOptions::*field, T v) {
    if (o.*field == v) return;
    invalidate_graphs();
    o.*field = v;
  }
};

void GpuPrepareStack::Impl::init() {
  const ModelConfig& c = plan.config;
  rows_per_request = effective_rows_per_request(plan, o);
  pool = make_request_pool(o.n_requests, o.max_context, rows_per_request, c.window_size);
  n_layers = c.n_layers;
  dim = c.dim;
  q_rank = c.q_lora_rank;
  qkv_w = q_rank + kHd;
  H = plan.parallel.local_heads;
  H_pad = static_cast<int>(round_up(H, 8));
  Hi = c.index_source_layers.empty() ? 0 : c.index_n_heads;
  wproj_rows = static_cast<int>(round_up(std::max(Hi, 1), 32));
  eps = c.norm_eps;
  max_pos = pool.max_context;
  window_slots = pool.window_pool_slots();
  full_slots = pool.full_pool_slots();
  pair_rows = static_cast<int64_t>(pool.n_requests) * pool.pair_ring;
  topk_width = round_up(std::max(c.index_topk, 1), 64);
  const int R = o.max_rows;
  const size_t nl = static_cast<size_t>(c.total_layers());

  progress("GPU stack: " + std::to_string(n_layers) + " layers, tp " + std::to_string(plan.parallel.tp) + " (" +
           std::to_string(H) + " heads, H_pad " + std::to_string(H_pad) + ", " + std::to_string(Hi) +
           " index heads), " + std::to_string(o.n_requests) + " requests x " + std::to_string(o.max_context) +
           " positions, max " + std::to_string(R) + " rows, weights " + to_string(o.weights));

  // RoPE tables and slot tables.
  {
    const std::vector<float> base = build_rope_table(rope_params_for(c, false), max_pos);
    const std::vector<float> comp_t = build_rope_table(rope_params_for(c, true), max_pos);
    rope[0] = alloc<float>(base.size());
    rope[1] = alloc<float>(comp_t.size());
    upload(rope[0], base.data(), base.size());
    upload(rope[1], comp_t.data(), comp_t.size());
    sync();  // the host tables go out of scope
  }
  bool ratio_used[3] = {false, false, false};
  for (int s : c.kv_source_layers) ratio_used[lp(s).ratio] = true;
  for (int r = 1; r <= 2; ++r) {
    if (!ratio_used[r]) continue;
    comp_stride[r] = pool.max_context / r;
    score_stride_r[r] = round_up(comp_stride[r], 64);
    std::vector<int32_t> t(static_cast<size_t>(pool.n_requests * comp_stride[r]));
    for (int q = 0; q < pool.n_requests; ++q)
      for (int64_t j = 0; j < comp_stride[r]; ++j)
        t[static_cast<size_t>(q * comp_stride[r] + j)] = pool.full_slot(q, static_cast<int>(j * r)) / r;
    comp_table[r] = alloc<int32_t>(t.size());
    upload(comp_table[r], t.data(), t.size());
    sync();
  }
  if (c.candidate_source_layer >= 0) {
    cand_ratio = lp(c.candidate_source_layer).ratio;
    mask_stride = (score_stride_r[cand_ratio] + c.candidate_block_size - 1) / c.candidate_block_size;
  }

  // Step metadata and inputs.
  meta = alloc<int32_t>(static_cast<size_t>(kMFields) * R);
  ctx_dev = alloc<int32_t>(static_cast<size_t>(o.n_requests));
  cycle_scratch = alloc<uint32_t>(4);
  qdist_bar = alloc<uint32_t>(2);
  zero(qdist_bar, 2 * sizeof(uint32_t));
  V4_CUDA_CHECK(cudaEventCreateWithFlags(&idx_gemms_done, cudaEventDisableTiming));
  V4_CUDA_CHECK(cudaEventCreateWithFlags(&idx_x_done, cudaEventDisableTiming));
  zero(ctx_dev, sizeof(int32_t) * o.n_requests);
  x_layer_stride = static_cast<int64_t>(R) * dim;
  x_all = alloc<bf16_t>(static_cast<size_t>(n_layers) * x_layer_stride);
  zero(x_all, sizeof(bf16_t) * n_layers * x_layer_stride);

  // Caches and per-layer outputs.
  window.assign(static_cast<size_t>(n_layers), nullptr);
  q_pad.assign(static_cast<size_t>(n_layers), nullptr);
  comp.assign(nl, nullptr);
  index_k.assign(nl, nullptr);
  pair.assign(nl, nullptr);
  comp_slots.assign(nl, 0);
  topk.assign(nl, nullptr);
  for (int L = 0; L < n_layers; ++L) {
    window[static_cast<size_t>(L)] = alloc<uint8_t>(static_cast<size_t>(window_bytes()));
    zero(window[static_cast<size_t>(L)], static_cast<size_t>(window_bytes()));
    q_pad[static_cast<size_t>(L)] = alloc<bf16_t>(static_cast<size_t>(R) * H_pad * kHd);
    zero(q_pad[static_cast<size_t>(L)], sizeof(bf16_t) * R * H_pad * kHd);
  }
  for (int s : c.kv_source_layers) {
    const size_t i = static_cast<size_t>(s);
    comp_slots[i] = full_slots / lp(s).ratio + 1;
    comp[i] = alloc<uint8_t>(static_cast<size_t>(comp_bytes(s)));
    index_k[i] = alloc<uint8_t>(static_cast<size_t>(index_k_bytes(s)));
    zero(comp[i], static_cast<size_t>(comp_bytes(s)));
    zero(index_k[i], static_cast<size_t>(index_k_bytes(s)));
    if (lp(s).ratio == 2) {
      pair[i] = alloc<float>(static_cast<size_t>(pair_rows) * kStateRow);
      // ctx_dev is zero: every row gets the initial state (kv 0, score -inf), as pair_state_init.
      detail::prefill_pair_state(pair[i], ctx_dev, pool.n_requests, pool.pair_ring, 0, main());
    }
  }
  for (int s : c.index_source_layers) {
    topk[static_cast<size_t>(s)] = alloc<int32_t>(static_cast<size_t>(R) * topk_width);
    zero(topk[static_cast<size_t>(s)], sizeof(int32_t) * R * topk_width);
  }
  if (mask_stride > 0) {
    cand_mask = alloc<uint8_t>(static_cast<size_t>(R) * mask_stride);
    zero(cand_mask, static_cast<size_t>(R * mask_stride));
  }

  // Scratch.
  xq = alloc<uint8_t>(static_cast<size_t>(R) * dim);
  xs = alloc<uint8_t>(static_cast<size_t>(R) * (dim / 32));
  qkv_a = alloc<bf16_t>(static_cast<size_t>(R) * qkv_w);
  qr = alloc<bf16_t>(static_cast<size_t>(R) * q_rank);
  qrq = alloc<uint8_t>(static_cast<size_t>(R) * q_rank);
  qrs = alloc<uint8_t>(static_cast<size_t>(R) * (q_rank / 32));
  q = alloc<bf16_t>(static_cast<size_t>(R) * H * kHd);
  if (!c.kv_source_layers.empty()) {
    proj = alloc<bf16_t>(static_cast<size_t>(R) * kHd);
    kvs = alloc<float>(static_cast<size_t>(R) * kStateRow);
    latent = alloc<bf16_t>(static_cast<size_t>(R) * kHd);
    zero(latent, sizeof(bf16_t) * R * kHd);
    kproj = alloc<bf16_t>(static_cast<size_t>(R) * kIdxHd);
  }
  int64_t max_score_stride = 0;
  for (int r = 1; r <= 2; ++r) max_score_stride = std::max(max_score_stride, score_stride_r[r]);
  if (Hi > 0) {
    qi = alloc<bf16_t>(static_cast<size_t>(R) * Hi * kIdxHd);
    wproj_out = alloc<bf16_t>(static_cast<size_t>(R) * wproj_rows);
    iq_codes = alloc<uint8_t>(static_cast<size_t>(R) * kScoreHeads * kn::kIndexerCodeBytes);
    iq_scales = alloc<uint8_t>(static_cast<size_t>(R) * kScoreHeads * kn::kIndexerScaleBytes);
    iw = alloc<float>(static_cast<size_t>(R) * kScoreHeads);
    if (Hi < kScoreHeads) {
      iq_codes_c = alloc<uint8_t>(static_cast<size_t>(R) * Hi * kn::kIndexerCodeBytes);
      iq_scales_c = alloc<uint8_t>(static_cast<size_t>(R) * Hi * kn::kIndexerScaleBytes);
      iw_c = alloc<float>(static_cast<size_t>(R) * Hi);
    }
    scores = alloc<float>(static_cast<size_t>(R) * std::max<int64_t>(max_score_stride, 64));
    // One workspace serves the top-k of every index source and the candidate mask: they run in
    // order (like the shared scores buffer: each layer's side lanes join before the next layer),
    // and each launch leaves it ready for the next (zeroed once here).
    select_ws_bytes = kn::indexer_topk_workspace_bytes(R, std::max<int64_t>(max_score_stride, 64), c.index_topk);
    if (mask_stride > 0)
      select_ws_bytes = std::max(select_ws_bytes,
                                 kn::candidate_mask_workspace_bytes(R, score_stride_r[cand_ratio], c.candidate_block_size,
                                                                    c.candidate_topk_blocks));
    if (select_ws_bytes > 0) {  // 0: more rows than v2 serves; the v1 kernels run
      select_ws = alloc<uint8_t>(select_ws_bytes);
      zero(select_ws, select_ws_bytes);
    }
  }

  // GEMM workspaces: the largest split-K need of any GEMM of the cycle, one per lane.
  {
    size_t need = 0;
    const auto consider = [&](int64_t n, int64_t k) { need = std::max(need, kn::gemm_workspace_bytes(R, n, k, 1)); };
    consider(qkv_w, dim);
    consider(static_cast<int64_t>(H) * kHd, q_rank);
    if (!c.kv_source_layers.empty()) {
      consider(kHd, dim);
      consider(kIdxHd, kHd);
    }
    if (Hi > 0) {
      consider(static_cast<int64_t>(Hi) * kIdxHd, q_rank);
      consider(wproj_rows, dim);
    }
    for (auto& wsp : ws) {
      if (need == 0) continue;
      wsp.data = alloc<uint8_t>(need);
      wsp.bytes = need;
      kn::init_gemm_workspace(wsp, main());
    }
  }

  // The fused Q chain's workspace (main lane only): counters zeroed once, left zero by every launch.
  qchain_ws_bytes = kn::qchain_fused_workspace_bytes(std::min(R, kn::kQChainMaxRows), dim, q_rank);
  if (qchain_ws_bytes > 0) {
    qchain_ws = alloc<uint8_t>(qchain_ws_bytes);
    kn::init_qchain_workspace(qchain_ws, qchain_ws_bytes, main());
    for (int T = 1; T <= std::min(R, kn::kQChainMaxRows); ++T)
      if (kn::qchain_fused_supported(T, dim, q_rank, H)) {
        qchain_rows_ok |= 1u << T;
        if (kn::qchain_fused_supported(T, dim, q_rank, H, -1, true)) qchain_direct_ok |= 1u << T;
      }
  }

  // Weights.
  w.assign(static_cast<size_t>(n_layers), LayerWeightsDev{});
  for (int L = 0; L < n_layers; ++L) {
    LayerWeightsDev& d = w[static_cast<size_t>(L)];
    const LayerPlan& l = lp(L);
    d.wqkv_a = alloc<uint8_t>(static_cast<size_t>(qkv_w) * dim, true);
    d.wqkv_a_s = alloc<uint8_t>(static_cast<size_t>(qkv_w / 32) * (dim / 32), true);
    d.q_norm = alloc<float>(static_cast<size_t>(q_rank), true);
    d.wq_b = alloc<uint8_t>(static_cast<size_t>(H) * kHd * q_rank, true);
    d.wq_b_s = alloc<uint8_t>(static_cast<size_t>(H * kHd / 32) * (q_rank / 32), true);
    d.kv_norm = alloc<float>(kHd, true);
    if (l.is_kv_source) {
      if (l.ratio == 1) d.wkv_c = alloc<bf16_t>(static_cast<size_t>(kHd) * dim, true);
      else d.wkv_gate = alloc<float>(static_cast<size_t>(2 * kHd) * dim, true);
      d.c_norm = alloc<float>(kHd, true);
      d.wk = alloc<bf16_t>(static_cast<size_t>(kIdxHd) * kHd, true);
      d.k_norm = alloc<float>(kIdxHd, true);
    }
    if (l.is_index_source) {
      d.iwq_b = alloc<uint8_t>(static_cast<size_t>(Hi) * kIdxHd * q_rank, true);
      d.iwq_b_s = alloc<uint8_t>(static_cast<size_t>(Hi * kIdxHd / 32) * (q_rank / 32), true);
      d.wproj = alloc<bf16_t>(static_cast<size_t>(wproj_rows) * dim, true);
      zero(d.wproj, sizeof(bf16_t) * wproj_rows * dim);  // padding rows stay zero
    }
  }
  sync();
  progress("GPU stack: " + std::to_string(bytes / 1000000) + " MB allocated (" + std::to_string(weight_bytes / 1000000) +
           " MB weights); initialising weights (" + to_string(o.weights) + ")");
  if (o.weights == WeightSource::kReference) init_weights_reference();
  else init_weights_device_random();
  sync();
  progress("GPU stack: weights ready");
}

void GpuPrepareStack::Impl::init_weights_reference() {
  for (int L = 0; L < n_layers; ++L) {
    const ref::LayerWeights rw = ref::make_synthetic_layer_weights(plan, L, o.seed);
    const LayerWeightsDev& d = w[static_cast<size_t>(L)];
    const LayerPlan& l = lp(L);
    const auto fp8 = [&](const ref::Fp8Matrix& m, int64_t n, int64_t k, uint8_t* codes, uint8_t* scales, const char* name) {
      if (m.n != n || m.k != k || static_cast<int64_t>(m.w.size()) != n * k ||
          static_cast<int64_t>(m.scale.size()) != (n + 31) / 32 * (k / 32))
        fail(std::string("reference weight ") + name + " of layer " + std::to_string(L) + " has an unexpected shape");
      upload(codes, m.w.data(), m.w.size());
      upload(scales, m.scale.data(), m.scale.size());
    };
    const auto vec = [&](const std::vector<float>& v, size_t n, float* dst, const char* name) {
      if (v.size() != n) fail(std::string("reference weight ") + name + " of layer " + std::to_string(L) + " has the wrong size");
      upload(dst, v.data(), n);
    };
    fp8(rw.wqkv_a, qkv_w, dim, d.wqkv_a, d.wqkv_a_s, "wqkv_a");
    vec(rw.q_norm, static_cast<size_t>(q_rank), d.q_norm, "q_norm");
    fp8(rw.wq_b, static_cast<int64_t>(H) * kHd, q_rank, d.wq_b, d.wq_b_s, "wq_b");
    vec(rw.kv_norm, kHd, d.kv_norm, "kv_norm");
    if (l.is_kv_source) {
      if (!rw.compressor || rw.compressor->ratio != l.ratio) fail("reference compressor of layer " + std::to_string(L) + " missing");
      const ref::CompressorWeights& cw = *rw.compressor;
      if (l.ratio == 1) {
        if (cw.wkv_c.n != kHd || cw.wkv_c.k != dim) fail("reference wkv_c has an unexpected shape");
        upload(d.wkv_c, cw.wkv_c.w.data(), cw.wkv_c.w.size());
      } else {
        if (cw.wkv.n != kHd || cw.wkv.k != dim || cw.wgate.n != kHd || cw.wgate.k != dim)
          fail("reference wkv / wgate have an unexpected shape");
        upload(d.wkv_gate, cw.wkv.w.data(), cw.wkv.w.size());
        upload(d.wkv_gate + static_cast<int64_t>(kHd) * dim, cw.wgate.w.data(), cw.wgate.w.size());
      }
      vec(cw.c_norm, kHd, d.c_norm, "compressor.norm");
      if (cw.wk.n != kIdxHd || cw.wk.k != kHd) fail("reference wk has an unexpected shape");
      upload(d.wk, cw.wk.w.data(), cw.wk.w.size());
      vec(cw.k_norm, kIdxHd, d.k_norm, "compressor.k_norm");
    }
    if (l.is_index_source) {
      if (!rw.indexer) fail("reference indexer of layer " + std::to_string(L) + " missing");
      fp8(rw.indexer->wq_b, static_cast<int64_t>(Hi) * kIdxHd, q_rank, d.iwq_b, d.iwq_b_s, "indexer.wq_b");
      const ref::Bf16Matrix& wp = rw.indexer->weights_proj;
      if (wp.n != Hi || wp.k != dim) fail("reference indexer.weights_proj has an unexpected shape");
      upload(d.wproj, wp.w.data(), wp.w.size());  // rows Hi..wproj_rows-1 stay zero
    }
    sync();  // rw goes out of scope
    progress("GPU stack: reference weights of layer " + std::to_string(L) + " uploaded");
  }
}

void GpuPrepareStack::Impl::init_weights_device_random() {
  using detail::tensor_key;
  const auto inv_sqrt = [](int64_t k) { return static_cast<float>(1.0 / std::sqrt(static_cast<double>(k))); };
  for (int L = 0; L < n_layers; ++L) {
    const LayerWeightsDev& d = w[static_cast<size_t>(L)];
    const LayerPlan& l = lp(L);
    const uint64_t s = o.seed;
    detail::init_fp8_weight(d.wqkv_a, d.wqkv_a_s, qkv_w, dim, tensor_key(s, L, "wqkv_a"), main());
    detail::init_norm(d.q_norm, q_rank, tensor_key(s, L, "q_norm"), main());
    detail::init_fp8_weight(d.wq_b, d.wq_b_s, static_cast<int64_t>(H) * kHd, q_rank, tensor_key(s, L, "wq_b"), main());
    detail::init_norm(d.kv_norm, kHd, tensor_key(s, L, "kv_norm"), main());
    if (l.is_kv_source) {
      if (l.ratio == 1)
        detail::init_bf16(d.wkv_c, static_cast<int64_t>(kHd) * dim, inv_sqrt(dim), tensor_key(s, L, "compressor.wkv"), main());
      else
        detail::init_f32(d.wkv_gate, static_cast<int64_t>(2 * kHd) * dim, inv_sqrt(dim), tensor_key(s, L, "compressor.wkv_gate"),
                         main());
      detail::init_norm(d.c_norm, kHd, tensor_key(s, L, "compressor.norm"), main());
      detail::init_bf16(d.wk, static_cast<int64_t>(kIdxHd) * kHd, inv_sqrt(kHd), tensor_key(s, L, "compressor.wk"), main());
      detail::init_norm(d.k_norm, kIdxHd, tensor_key(s, L, "compressor.k_norm"), main());
    }
    if (l.is_index_source) {
      detail::init_fp8_weight(d.iwq_b, d.iwq_b_s, static_cast<int64_t>(Hi) * kIdxHd, q_rank, tensor_key(s, L, "indexer.wq_b"),
                              main());
      detail::init_bf16(d.wproj, static_cast<int64_t>(Hi) * dim, inv_sqrt(dim), tensor_key(s, L, "indexer.weights_proj"),
                        main());
    }
  }
}

// ---- the cycle ---------------------------------------------------------------------------------------
void GpuPrepareStack::Impl::issue_cycle(int T) {
  // Main-stream work before the first fork (see GpuStackOptions::lane_prologue).
  uint32_t* scratch = cycle_scratch;
  const IssueFn anchor = [scratch](cudaStream_t s) { V4_CUDA_CHECK(cudaMemsetAsync(scratch, 0, sizeof(uint32_t), s)); };
  if (o.lane_prologue && o.schedule != Schedule::kSerial)  // serial has no side lane to anchor
    lanes.lane_prologue(scratch + 1, anchor);  // 8 bytes: one word per side lane
  else lanes.on_main(anchor);
  for (int L = 0; L < n_layers; ++L) {
    NvtxRange range("layer", L);
    if (qchain_fused_layer(L, T)) {  // the whole layer in one kernel on main: nothing to fork
      lanes.on_main([this, L, T](cudaStream_t s) { issue_qchain_fused(L, T, s); });
      continue;
    }
    if (qchain_fused_index_layer(L, T)) {
      // A reindex layer's Q chain as the fused chain on main (it writes qr and its codes); lane S:
      // weights_proj from x. KV and QB are inside the chain: lane K stays empty.
      if (o.fused_index_on_main && o.schedule != Schedule::kSerial) {
        // GpuStackOptions::fused_index_on_main: main runs the chain, the indexer's wq_b GEMM, then
        // (joined with S: the q pack reads weights_proj's output) q pack, scores and selection,
        // PDL-chained, and the next layer's chain PDL-chained after the selection.
        // weights_proj is forked after the chain: at the layer's start its CTAs ran beside the
        // chain (~7.6 -> ~15 us own) and slowed it by ~1.6 us; after it, they run beside the
        // indexer's GEMM (v3 leaves SMs free) and end before it (perf.md session 21, run 7: verify
        // bs 1 -0.35 %, decode bs 2 / 4 -0.5 / -0.45 %, decode bs 1 / 8 even).
        lanes.on_main([this, L, T](cudaStream_t s) { issue_qchain_fused(L, T, s); });
        lanes.fork(Lane::kS).defer([this, L, T](cudaStream_t s) { issue_idx_x(L, T, s); });
        lanes.on_main([this, L, T](cudaStream_t s) { issue_idx_gemms(L, T, s); });
        lanes.join(Lane::kS);
        lanes.on_main([this, L, T](cudaStream_t s) { issue_idx_rest(L, T, s); });
        continue;
      }
      // Otherwise (and in the serial schedule, where every lane is main) the whole indexer after
      // the chain, on lane S.
      LayerIssue li;
      li.work = lp(L).work;
      li.s_fork = o.s_fork == LayerIssue::SFork::kAfterQNorm ? o.s_fork : LayerIssue::SFork::kAtLayerStart;
      li.qa = [this, L, T](cudaStream_t s) { issue_qchain_fused(L, T, s); };
      li.qb = [](cudaStream_t) {};
      li.kv = [](cudaStream_t) {};
      li.idx = [this, L, T](cudaStream_t s) { issue_idx(L, T, s); };
      li.idx_x = [this, L, T](cudaStream_t s) { issue_idx_x(L, T, s); };
      issue_layer(lanes, o.schedule, li);
      continue;
    }
    if (src_idx_main_layer(L, T)) {
      // GpuStackOptions::src_idx_main: an index source with a compressor, its indexer on main.
      lanes.fork(Lane::kS).defer([this, L, T](cudaStream_t s) { issue_cmp(L, T, s); });    // after x
      lanes.fork(Lane::kK).defer([this, L, T](cudaStream_t s) { issue_idx_x(L, T, s); });  // after x
      lanes.on_main([this, L, T](cudaStream_t s) { issue_qa(L, T, s); });
      lanes.fork(Lane::kK).defer([this, L, T](cudaStream_t s) { issue_kv(L, T, s); });  // after QA
      lanes.on_main([this, L, T](cudaStream_t s) {
        issue_q_norm(L, T, s);
        issue_idx_gemms(L, T, s);
      });
      lanes.join(Lane::kK);  // weights_proj (the q pack reads it)
      lanes.join(Lane::kS);  // this step's index K (the scores read it)
      lanes.on_main([this, L, T](cudaStream_t s) { issue_idx_score(L, T, s); });
      lanes.fork(Lane::kK).defer([this, L, T](cudaStream_t s) { issue_qb(L, T, s); });  // after qr
      lanes.on_main([this, L, T](cudaStream_t s) { issue_idx_select(L, T, s); });
      lanes.join(Lane::kK);
      continue;
    }
    LayerIssue li;
    li.work = lp(L).work;
    li.s_fork = o.s_fork;
    li.qa = [this, L, T](cudaStream_t s) { issue_qa(L, T, s); };
    li.q_norm = [this, L, T](cudaStream_t s) { issue_q_norm(L, T, s); };
    // idx_gemm_on_main: the indexer's wq_b GEMM runs on main right after q_norm (with the whole
    // machine, before the wq_b GEMM takes every SM), and lane S forks after it with qi ready.
    const bool idx_gemm_main = o.idx_gemm_on_main && (li.work & kWorkIDX);
    // idx_scores_on_main, index sources without CMP (their index-K cache was written by an
    // earlier layer, already joined): weights_proj, q pack and the scores run on main too, before
    // the wq_b GEMM, and lane S keeps only the selection.
    const bool idx_scores_main = idx_gemm_main && o.idx_scores_on_main && !(li.work & kWorkCMP);
    if (idx_scores_main)
      li.q_norm = [this, L, T](cudaStream_t s) {
        issue_idx_x(L, T, s);
        issue_q_norm(L, T, s);
        issue_idx_gemms(L, T, s);
        issue_idx_score(L, T, s, /*before_qb=*/true);
      };
    else if (idx_gemm_main)
      li.q_norm = [this, L, T](cudaStream_t s) {
        issue_q_norm(L, T, s);
        issue_idx_gemms(L, T, s);
      };
    li.qb = [this, L, T](cudaStream_t s) { issue_qb(L, T, s); };
    li.kv = [this, L, T](cudaStream_t s) { issue_kv(L, T, s); };
    if (li.work & kWorkCMP) li.cmp = [this, L, T](cudaStream_t s) { issue_cmp(L, T, s); };
    if ((li.work & kWorkIDX) && o.s_fork == LayerIssue::SFork::kIdxGemmsOnK) {
      cudaEvent_t ev = idx_gemms_done;
      li.idx_pre = [this, L, T, ev](cudaStream_t s) {
        issue_idx_gemms(L, T, s);
        V4_CUDA_CHECK(cudaEventRecord(ev, s));
      };
      li.idx = [this, L, T, ev](cudaStream_t s) {
        V4_CUDA_CHECK(cudaStreamWaitEvent(s, ev, 0));
        issue_idx_rest(L, T, s);
      };
    } else if (idx_scores_main) {
      li.idx = [this, L, T](cudaStream_t s) { issue_idx_select(L, T, s); };
    } else if (idx_gemm_main) {
      li.idx = [this, L, T](cudaStream_t s) { issue_idx_rest(L, T, s); };
    } else if (li.work & kWorkIDX) {
      li.idx = [this, L, T](cudaStream_t s) { issue_idx(L, T, s); };
    }
    // weights_proj reads only x: on a side lane it runs at the layer's start (behind CMP), not
    // after qr, which takes one GEMM off the S lane's qr -> top-k critical path.
    if ((li.work & kWorkIDX) && !idx_scores_main) li.idx_x = [this, L, T](cudaStream_t s) { issue_idx_x(L, T, s); };
    if (o.idx_x_on_k && (li.work & kWorkIDX) && (li.work & kWorkCMP) && li.idx_x) {
      // weights_proj on lane K: the event orders it before the indexer on S (on any other
      // schedule both run on one stream and the wait is a no-op).
      li.idx_x_on_k = true;
      cudaEvent_t ev = idx_x_done;
      li.idx_x = [this, L, T, ev](cudaStream_t s) {
        issue_idx_x(L, T, s);
        V4_CUDA_CHECK(cudaEventRecord(ev, s));
      };
      li.idx = [ev, idx = std::move(li.idx)](cudaStream_t s) {
        V4_CUDA_CHECK(cudaStreamWaitEvent(s, ev, 0));
        idx(s);
      };
    }
    issue_layer(lanes, o.schedule, li);
  }
  lanes.require_all_joined();
}

void GpuPrepareStack::Impl::issue_qa(int L, int T, cudaStream_t s) {
  const LayerWeightsDev& d = w[static_cast<size_t>(L)];
  kn::Fp8GemmParams g;
  // fuse_x_quant: when the QA GEMM runs v3 and its plan holds a CTA's whole K range, v3 quantises x
  // itself (the same bytes as act quant + v3), which takes the act-quant launch off the main lane.
  const bool fuse_x = fusion_applies(o.fuse_x_quant, T, 1, kXQuantAutoRows);
  g.v3_int_mask = o.v3_int_mask;
  // GpuStackOptions::qa_gemv: v6 after the act quant kernel in the layers with a compressor (v6 has
  // no fused act quant).
  const bool gemv = (lp(L).work & kWorkCMP) != 0 && gemv_applies(o.qa_gemv, kQaGemvAutoRows, T, qkv_w, dim);
  if (!gemv && fuse_x && fp8_version(T, qkv_w, dim) == kn::GemmVersion::kWgmmaPipelined &&
      kn::gemm_v3_fused_quant_supported(T, qkv_w, dim)) {
    g.a_bf16 = x(L);
    g.a_bf16_stride = dim;
  } else {
    kn::ActQuantParams a;
    a.x = x(L);
    a.x_stride = dim;
    a.q = xq;
    a.q_stride = dim;
    a.scale = xs;
    a.scale_stride = dim / 32;
    a.m = T;
    a.k = dim;
    a.warps_per_cta = o.aq_warps >= 0 ? o.aq_warps : kn::act_quant_auto_warps(T);  // GpuStackOptions::aq_warps
    kn::run_act_quant_fp8(a, s, pdl_rest());
    g.a_q = xq;
    g.a_stride = dim;
    g.a_scale = xs;
    g.a_scale_stride = dim / 32;
  }
  g.w = d.wqkv_a;
  g.w_scale = d.wqkv_a_s;
  g.out = qkv_a;
  g.out_stride = qkv_w;
  g.m = T;
  g.n = qkv_w;
  g.k = dim;
  kn::run_gemm_fp8(g, ws_for(s), gemv ? kn::GemmVersion::kGemv : o.gemm, s, pdl_rest());
}

GpuPrepareStack::Impl::QNormAt GpuPrepareStack::Impl::qnorm_at(int L, int T) const {
  // Only where nothing reads q_norm's output but the wq_b GEMM: the indexer's wq_b reads its codes.
  const int64_t n = static_cast<int64_t>(H) * kHd;
  if ((lp(L).work & kWorkIDX) || fp8_version(T, n, q_rank) != kn::GemmVersion::kWgmma) return QNormAt::kKernel;
  // fuse_qnorm first; its kAuto row range is empty: measured slower at every row count it applies to
  // (perf.md session 13 run 14).
  if (fusion_applies(o.fuse_qnorm, T, 1, 0) && kn::gemm_v2_qnorm_supported(T, n, q_rank)) return QNormAt::kGemmEveryCta;
  // qnorm_dist: kAuto at exactly kQNormDistAutoRows rows (GpuStackOptions::qnorm_dist says why).
  if (fusion_applies(o.qnorm_dist, T, kQNormDistAutoRows, kQNormDistAutoRows) &&
      kn::gemm_v2_qnorm_dist_supported(T, n, q_rank))
    return QNormAt::kGemmRowCtas;
  return QNormAt::kKernel;
}

void GpuPrepareStack::Impl::issue_q_norm(int L, int T, cudaStream_t s) {
  if (qnorm_at(L, T) != QNormAt::kKernel) return;  // the wq_b GEMM normalises its input itself (issue_qb)
  kn::RmsNormParams p;
  p.x = qkv_a;
  p.x_stride = qkv_w;
  p.w = w[static_cast<size_t>(L)].q_norm;
  p.eps = eps;
  p.y = qr;
  p.y_stride = q_rank;
  p.q_codes = qrq;  // the fused act quant: exactly what wq_b (and the indexer's wq_b) would compute from qr
  p.q_stride = q_rank;
  p.q_scales = qrs;
  p.s_stride = q_rank / 32;
  p.rows = T;
  p.n = q_rank;
  p.trigger_at_wait = !o.qnorm_trigger_late;
  kn::run_rmsnorm(p, s, pdl_rest());
}

void GpuPrepareStack::Impl::issue_qb(int L, int T, cudaStream_t s) {
  const LayerWeightsDev& d = w[static_cast<size_t>(L)];
  kn::Fp8GemmParams g;
  g.a_q = qrq;
  g.a_stride = q_rank;
  g.a_scale = qrs;
  g.a_scale_stride = q_rank / 32;
  g.w = d.wq_b;
  g.w_scale = d.wq_b_s;
  g.out = q;
  g.out_stride = static_cast<int64_t>(H) * kHd;
  g.m = T;
  g.n = static_cast<int64_t>(H) * kHd;
  g.k = q_rank;
  g.prewait_stages = o.qb_prewait_stages;
  g.v2_overlap = o.qb_overlap;
  g.prewait_pace_ns = o.qb_prewait_pace_ns >= 0 ? o.qb_prewait_pace_ns : (T == 1 ? 1000 : 0);
  // q_norm + act quant inside the GEMM, from the QA output: every CTA all rows into its shared memory
  // (fuse_qnorm), or the first CTAs one row each into the buffers issue_q_norm would write (qnorm_dist).
  const QNormAt qn = qnorm_at(L, T);
  if (qn != QNormAt::kKernel) {
    g.qnorm_x = qkv_a;
    g.qnorm_x_stride = qkv_w;
    g.qnorm_w = d.q_norm;
    g.qnorm_eps = eps;
  }
  if (qn == QNormAt::kGemmEveryCta) {
    g.a_q = nullptr;
    g.a_scale = nullptr;
    g.a_stride = g.a_scale_stride = 0;
  } else if (qn == QNormAt::kGemmRowCtas) {
    g.qnorm_dist_bar = qdist_bar;
    g.qnorm_y = qr;
    g.qnorm_y_stride = q_rank;
  }
  // fuse_rope_store: the GEMM writes q_pad itself with the RoPE applied (v2 epilogue; same bytes).
  const bool fuse_rope = fusion_applies(o.fuse_rope_store, T, kRopeStoreAutoMinRows, kRopeStoreAutoMaxRows);
  if (fuse_rope && fp8_version(T, g.n, g.k) == kn::GemmVersion::kWgmma &&
      kn::gemm_v2_rope_store_supported(T, g.n, g.k)) {
    g.out = q_pad[static_cast<size_t>(L)];
    g.out_stride = static_cast<int64_t>(H_pad) * kHd;
    g.rope_pos = mf(kMPos);
    g.rope_table = table(L);
    g.rope_max_pos = max_pos;
    g.rope_err = err.get();
    kn::run_gemm_fp8(g, ws_for(s), o.gemm, s, pdl_rest());
    return;
  }
  // The plain v2 form in a layer with side lanes: optionally half the CTAs (qb_side_mtiles), where
  // the automatic plan is one split (so that the bytes are its: a split-K plan adds in another order).
  const int side_mtiles = o.qb_side_mtiles != 0 ? o.qb_side_mtiles : (T == 1 ? 4 : 2);
  if (side_mtiles == 4 && g.qnorm_x == nullptr && (lp(L).work & (kWorkIDX | kWorkCMP)) != 0 &&
      fp8_version(T, g.n, g.k) == kn::GemmVersion::kWgmma && kn::gemm_v2_four_tiles_supported(T, g.n, g.k)) {
    g.force_mtiles = 4;
    g.force_splits = 1;
  }
  kn::run_gemm_fp8(g, ws_for(s), o.gemm, s, pdl_rest());
  kn::QRopeStoreParams r;
  r.q = q;
  r.q_row_stride = static_cast<int64_t>(H) * kHd;
  r.q_pad = q_pad[static_cast<size_t>(L)];
  r.q_pad_row_stride = static_cast<int64_t>(H_pad) * kHd;
  r.pos = mf(kMPos);
  r.table = table(L);
  r.max_pos = max_pos;
  r.T = T;
  r.H = H;
  r.H_pad = H_pad;
  r.err_count = err.get();
  kn::run_q_rope_store(r, s, o.pdl);  // the kernel right after the wq_b GEMM (prepare-schedule.md "PDL")
}

bool GpuPrepareStack::Impl::qchain_fused_rows(Fusion f, int auto_rows, int T) const {
  // kAuto only where the GEMMs are the automatic choice too: a forced GEMM version (kSimple for
  // the reference's bytes, a version under measurement) keeps the unfused chain that runs it.
  const int auto_max = o.gemm == kn::GemmVersion::kAuto ? auto_rows : 0;
  // fusion_applies holds only at T <= kQChainMaxRows (both row limits are), which guards the shift.
  return fusion_applies(f, T, 1, auto_max, kn::kQChainMaxRows) && (qchain_rows_ok >> T & 1u) != 0;
}

bool GpuPrepareStack::Impl::gemv_applies(Fusion f, int auto_rows, int T, int64_t n, int64_t k) const {
  // kAuto only where the GEMMs are the automatic choice too (a forced version keeps its GEMMs).
  const int auto_max = o.gemm == kn::GemmVersion::kAuto ? auto_rows : 0;
  return fusion_applies(f, T, 1, auto_max) && kn::gemm_gemv_supported(T, n, k);
}

bool GpuPrepareStack::Impl::qchain_fused_layer(int L, int T) const {
  static_assert(kn::kQChainMaxRows < 32 && kQChainAutoRows <= kn::kQChainMaxRows,
                "qchain_rows_ok holds one bit per row count, and kAuto stays within it");
  return qchain_fused_rows(o.fuse_qchain, kQChainAutoRows, T) && lp(L).work == (kWorkQA | kWorkQB | kWorkKV);
}

bool GpuPrepareStack::Impl::src_idx_main_layer(int L, int T) const {
  const uint32_t work = lp(L).work;
  return o.schedule == Schedule::kThreeLane && (work & kWorkCMP) && (work & kWorkIDX) &&
         fusion_applies(o.src_idx_main, T, 1, kSrcIdxMainAutoRows);
}

bool GpuPrepareStack::Impl::qchain_fused_index_layer(int L, int T) const {
  static_assert(kQChainIndexAutoRows <= kn::kQChainMaxRows, "kAuto stays within qchain_rows_ok");
  return qchain_fused_rows(o.fuse_qchain_index, kQChainIndexAutoRows, T) &&
         lp(L).work == (kWorkQA | kWorkQB | kWorkKV | kWorkIDX);
}

void GpuPrepareStack::Impl::issue_qchain_fused(int L, int T, cudaStream_t s) {
  const LayerWeightsDev& d = w[static_cast<size_t>(L)];
  kn::QChainFusedParams p;
  p.x = x(L);
  p.x_stride = dim;
  p.wqkv_a = d.wqkv_a;
  p.wqkv_a_scale = d.wqkv_a_s;
  p.q_norm = d.q_norm;
  p.eps = eps;
  p.wq_b = d.wq_b;
  p.wq_b_scale = d.wq_b_s;
  p.qkv_a = qkv_a;
  p.qkv_a_stride = qkv_w;
  p.qr = qr;
  p.qr_codes = qrq;
  p.qr_scales = qrs;
  p.q_pad = q_pad[static_cast<size_t>(L)];
  p.q_pad_stride = static_cast<int64_t>(H_pad) * kHd;
  p.kv = window_k_params(L, T);
  p.T = T;
  p.dim = dim;
  p.q_rank = q_rank;
  p.H = H;
  p.workspace = qchain_ws;
  p.workspace_bytes = qchain_ws_bytes;
  static_assert(kQChainDirectAutoRows <= kn::kQChainMaxRows, "kAuto stays within qchain_direct_ok");
  p.q_direct = fusion_applies(o.qchain_q_direct, T, 1, kQChainDirectAutoRows) && (qchain_direct_ok >> T & 1u) != 0;
  kn::run_qchain_fused(p, s, pdl_rest());
}

kn::WindowKStoreParams GpuPrepareStack::Impl::window_k_params(int L, int T) const {
  kn::WindowKStoreParams p;
  p.kv = qkv_a + q_rank;
  p.kv_row_stride = qkv_w;
  p.kv_norm = w[static_cast<size_t>(L)].kv_norm;
  p.eps = eps;
  p.pos = mf(kMPos);
  p.table = table(L);
  p.max_pos = max_pos;
  p.swa_loc = mf(kMSwaLoc);
  p.kind = CacheKind::kWindowV41;
  p.layout = cache_layout(CacheKind::kWindowV41);
  p.cache = window[static_cast<size_t>(L)];
  p.n_slots = window_slots;
  p.T = T;
  p.err_count = err.get();
  return p;
}

void GpuPrepareStack::Impl::issue_kv(int L, int T, cudaStream_t s) {
  kn::run_window_k_store(window_k_params(L, T), s, pdl_rest());
}

void GpuPrepareStack::Impl::issue_cmp(int L, int T, cudaStream_t s) {
  const LayerWeightsDev& d = w[static_cast<size_t>(L)];
  const int r = lp(L).ratio;
  const size_t i = static_cast<size_t>(L);
  kn::IndexKStoreParams k;
  k.kproj = kproj;
  k.kproj_row_stride = kIdxHd;
  k.k_norm = d.k_norm;
  k.eps = eps;
  k.g = r == 1 ? mf(kMPos) : mf(kMGroup2);
  k.table = rope[1];
  k.max_pos = max_pos;
  k.out_loc = r == 1 ? mf(kMCLoc1) : mf(kMCLoc2);
  k.layout = cache_layout(CacheKind::kIndexK);
  k.cache = index_k[i];
  k.n_slots = comp_slots[i];
  k.N = T;
  k.err_count = err.get();
  if (r == 1) {
    gemm_bf16_dense(x(L), d.wkv_c, proj, T, kHd, dim, s);
    kn::C1FusedParams c;
    c.proj = proj;
    c.proj_row_stride = kHd;
    c.c_norm = d.c_norm;
    c.eps = eps;
    c.pos = mf(kMPos);
    c.table = rope[1];
    c.max_pos = max_pos;
    c.out_loc = mf(kMCLoc1);
    c.layout = cache_layout(CacheKind::kCompressedFp4);
    c.cache = comp[i];
    c.n_slots = comp_slots[i];
    c.latent_pre_rope = latent;
    c.latent_row_stride = kHd;
    c.N = T;
    c.err_count = err.get();
    if (cmp_tail_fused(T)) {  // c1, the wk GEMM and the index-K store in one launch (same bytes)
      kn::run_c1_index_fused({c, d.wk, k}, s, pdl_rest());
      return;
    }
    kn::run_c1_fused(c, s, pdl_rest());
  } else {
    kn::F32GemmParams g;
    g.x = x(L);
    g.x_stride = dim;
    g.w = d.wkv_gate;
    g.out = kvs;
    g.out_stride = kStateRow;
    g.m = T;
    g.n = kStateRow;
    g.k = dim;
    kn::run_gemm_f32(g, small_gemm(), s, pdl_rest());
    kn::C2FusedParams c;
    c.kvs = kvs;
    c.kvs_row_stride = kStateRow;
    c.pos = mf(kMPos);
    c.state_row = mf(kMStateRow);
    c.partner_state_row = mf(kMPartnerRow);
    c.prev_row = mf(kMPrevRow);
    c.state = pair[i];
    c.state_rows = pair_rows;
    c.c_norm = d.c_norm;
    c.eps = eps;
    c.table = rope[1];
    c.max_pos = max_pos;
    c.out_loc = mf(kMCLoc2);
    c.layout = cache_layout(CacheKind::kCompressedFp4);
    c.cache = comp[i];
    c.n_slots = comp_slots[i];
    c.latent_pre_rope = latent;
    c.latent_row_stride = kHd;
    c.N = T;
    c.err_count = err.get();
    if (cmp_tail_fused(T)) {  // c2, the wk GEMM and the index-K store in one launch (same bytes)
      kn::run_c2_index_fused({c, d.wk, k}, s, pdl_rest());
      return;
    }
    kn::run_c2_fused(c, s, pdl_rest());
  }
  // Index keys from the latent BEFORE its RoPE. Ratio 2: rows completing no group have a stale
  // latent (the GEMM runs over all rows; their store is skipped by out_loc <= 0).
  gemm_bf16_dense(latent, d.wk, kproj, T, kIdxHd, kHd, s);
  kn::run_index_k_store(k, s, pdl_rest());
}

void GpuPrepareStack::Impl::issue_idx(int L, int T, cudaStream_t s) {
  issue_idx_gemms(L, T, s);
  issue_idx_rest(L, T, s);
}

void GpuPrepareStack::Impl::issue_idx_gemms(int L, int T, cudaStream_t s) {
  const LayerWeightsDev& d = w[static_cast<size_t>(L)];
  const kn::GemmWorkspace& wsp = ws_for(s);
  {
    kn::Fp8GemmParams g;  // qi = indexer wq_b(qr) on the qr codes of q_norm
    g.a_q = qrq;
    g.a_stride = q_rank;
    g.a_scale = qrs;
    g.a_scale_stride = q_rank / 32;
    g.w = d.iwq_b;
    g.w_scale = d.iwq_b_s;
    g.out = qi;
    g.out_stride = static_cast<int64_t>(Hi) * kIdxHd;
    g.m = T;
    g.n = static_cast<int64_t>(Hi) * kIdxHd;
    g.k = q_rank;
    g.v3_int_mask = o.v3_int_mask;
    const bool gemv = gemv_applies(o.idx_gemv, kIdxGemvAutoRows, T, g.n, g.k);  // GpuStackOptions::idx_gemv
    kn::run_gemm_fp8(g, wsp, gemv ? kn::GemmVersion::kGemv : o.gemm, s, pdl_rest());
  }
}

void GpuPrepareStack::Impl::issue_idx_x(int L, int T, cudaStream_t s) {
  // weights_proj(x), padded to wproj_rows outputs (zero rows)
  gemm_bf16_dense(x(L), w[static_cast<size_t>(L)].wproj, wproj_out, T, wproj_rows, dim, s);
}

void GpuPrepareStack::Impl::issue_idx_rest(int L, int T, cudaStream_t s) {
  issue_idx_score(L, T, s);
  issue_idx_select(L, T, s);
}

void GpuPrepareStack::Impl::issue_idx_score(int L, int T, cudaStream_t s, bool before_qb) {
  const ModelConfig& c = plan.config;
  const LayerPlan& l = lp(L);
  const int r = l.ratio;
  const size_t src = static_cast<size_t>(l.kv_src);
  const bool compact = Hi < kScoreHeads;
  {
    kn::IndexerQPackParams p;
    p.qi = qi;
    p.qi_stride = static_cast<int64_t>(Hi) * kIdxHd;
    p.wproj_out = wproj_out;
    p.wproj_stride = wproj_rows;
    p.pos = mf(kMPos);
    p.rope_table = table(L);
    p.max_pos = max_pos;
    p.T = T;
    p.heads = Hi;
    p.heads_total = c.index_n_heads;
    p.q_codes = compact ? iq_codes_c : iq_codes;
    p.q_scales = compact ? iq_scales_c : iq_scales;
    p.weights = compact ? iw_c : iw;
    p.err_count = err.get();
    kn::run_indexer_q_pack(p, s, pdl_rest());
  }
  if (compact) detail::pad_indexer_heads(iq_codes_c, iq_scales_c, iw_c, Hi, T, iq_codes, iq_scales, iw, s);
  const MetaField clen = r == 1 ? kMClen1 : kMClen2;
  {
    kn::IndexerScoresParams p;
    p.q_codes = iq_codes;
    p.q_scales = iq_scales;
    p.weights = iw;
    p.index_k_cache = index_k[src];
    p.layout = cache_layout(CacheKind::kIndexK);
    p.n_slots = comp_slots[src];
    p.req = mf(kMReq);
    p.clen = mf(clen);
    p.comp_slot_table = comp_table[r];
    p.comp_table_stride = comp_stride[r];
    p.comp_table_rows = pool.n_requests;
    p.scores = scores;
    p.score_stride = score_stride_r[r];
    p.T = T;
    p.err_count = err.get();
    // Verify rows of one request are consecutive: one CTA scores them on one read of their K. From
    // kScoresHalfGroupRequests requests on, half a request per CTA: twice the CTAs, each walking
    // half the rows (K read twice, from L2). Three-lane cycles, docs/perf.md session 17: verify bs 4
    // -1.2 %, bs 6 -1.1 %, bs 8 -1.0 % (with the 4-CTA register cap the launcher then takes); 3-row
    // groups at verify bs 1 +0.9 %, bs 3 +0.4 % (whole requests kept there).
    p.group_rows = scores_auto_group_rows(info.kind == StepKind::kVerify, T, rows_per_request);
    if (o.scores_group_rows > 0) p.group_rows = o.scores_group_rows;
    p.steps_per_warp = o.scores_steps;
    p.row_split = o.scores_row_split;
    p.min_blocks = o.scores_min_blocks;
    // Score only the kept blocks (the top-k still applies the mask); the masked kernel's block is 8
    // positions (V4.1's candidate_block_size): another block size scores every position.
    if (l.uses_candidates && o.scores_masked && c.candidate_block_size == 8) {
      p.candidate_mask = cand_mask;
      p.mask_stride = mask_stride;
      p.mask_block = c.candidate_block_size;
      p.mask_tile_blocks = o.scores_mask_tile;
      p.row_split = 0;  // the masked kernel has one warp set
    }
    // Before the wq_b GEMM (idx_scores_on_main): let it launch only after the last store, so that
    // its CTAs do not take the SMs while the scores run.
    p.trigger_at_wait = !before_qb;
    kn::run_indexer_scores(p, s, pdl_rest());
  }
}

void GpuPrepareStack::Impl::issue_idx_select(int L, int T, cudaStream_t s) {
  const ModelConfig& c = plan.config;
  const LayerPlan& l = lp(L);
  const int r = l.ratio;
  const MetaField clen = r == 1 ? kMClen1 : kMClen2;
  // The candidate source's own top-k is unmasked (uses_candidates is for the layers after it): its
  // two selections read the same scores and not each other, so v3 runs them as one pair launch.
  const bool pair = l.is_candidate_source && o.select_pair && o.select_version == 3;
  kn::CandidateMaskParams mp;  // the candidate source's: published for the index sources after it
  if (l.is_candidate_source) {
    kn::CandidateMaskParams& p = mp;
    p.scores = scores;
    p.score_stride = score_stride_r[r];
    p.clen = mf(clen);
    p.T = T;
    p.block = c.candidate_block_size;
    p.topk_blocks = c.candidate_topk_blocks;
    p.mask = cand_mask;
    p.mask_stride = mask_stride;
    p.err_count = err.get();
    p.workspace = select_ws;
    p.workspace_bytes = select_ws_bytes;
    p.version = o.select_version == 3 ? 3 : 0;  // 0: v2 with the workspace
    p.v3_cluster = o.select_cluster;
    p.v3_window = o.select_window;
    if (!pair) kn::run_candidate_mask(p, s, pdl_rest());
  }
  kn::IndexerTopkParams p;
  p.scores = scores;
  p.score_stride = score_stride_r[r];
  p.clen = mf(clen);
  p.req = mf(kMReq);
  p.T = T;
  p.comp_slot_table = comp_table[r];
  p.comp_table_stride = comp_stride[r];
  p.comp_table_rows = pool.n_requests;
  if (l.uses_candidates) {  // = apply_candidate_mask then top-k, fused (one pass over the scores less)
    p.candidate_mask = cand_mask;
    p.mask_stride = mask_stride;
    p.mask_block = c.candidate_block_size;
  }
  p.topk = c.index_topk;
  p.out = topk[static_cast<size_t>(L)];
  p.out_stride = topk_width;
  p.err_count = err.get();
  p.workspace = select_ws;
  p.workspace_bytes = select_ws_bytes;
  p.version = o.select_version == 3 ? 3 : 0;  // 0: v2 with the workspace
  p.v3_cluster = o.select_cluster;
  p.v3_window = o.select_window;
  if (pair) (void)kn::run_indexer_select_pair_v3(p, mp, s, pdl_rest());
  else kn::run_indexer_topk(p, s, pdl_rest());
}

// ---- GpuPrepareStack -----------------------------------------------------------------------------------
GpuPrepareStack::GpuPrepareStack(const ModelPlan& plan, const GpuStackOptions& options) {
  validate_options(plan, options);
  const ModelConfig& c = plan.config;
  // Relations the kernels rely on that validate_config guarantees; checked again because a plan
  // can be hand-built.
  for (int L = 0; L < c.n_layers; ++L) {
    const LayerPlan& l = plan.layers[static_cast<size_t>(L)];
    if ((l.work & (kWorkQA | kWorkQB | kWorkKV)) != (kWorkQA | kWorkQB | kWorkKV))
      fail("layer " + std::to_string(L) + " lacks QA, QB or KV");
    if (l.ratio > 0 && (l.kv_src < 0 || l.idx_src < 0 || plan.layers[static_cast<size_t>(l.kv_src)].ratio != l.ratio))
      fail("layer " + std::to_string(L) + " has no kv / index source of its ratio");
    if (l.uses_candidates && (c.candidate_source_layer < 0 ||
                              plan.layers[static_cast<size_t>(c.candidate_source_layer)].kv_src != l.kv_src))
      fail("layer " + std::to_string(L) + " uses candidates of another kv source");
  }
  impl_ = std::make_unique<Impl>(plan, options);
  impl_->init();
}

GpuPrepareStack::~GpuPrepareStack() = default;

const ModelPlan& GpuPrepareStack::plan() const { return impl_->plan; }
const GpuStackOptions& GpuPrepareStack::options() const { return impl_->o; }
const RequestPool& GpuPrepareStack::pool() const { return impl_->pool; }
int GpuPrepareStack::n_layers() const { return impl_->n_layers; }
int GpuPrepareStack::local_heads() const { return impl_->H; }
int GpuPrepareStack::h_pad() const { return impl_->H_pad; }
int GpuPrepareStack::index_heads() const { return impl_->Hi; }
int64_t GpuPrepareStack::max_pos() const { return impl_->max_pos; }
int64_t GpuPrepareStack::window_slots() const { return impl_->window_slots; }
int64_t GpuPrepareStack::pair_state_rows() const { return impl_->pair_rows; }
int64_t GpuPrepareStack::topk_width() const { return impl_->topk_width; }
int64_t GpuPrepareStack::candidate_mask_stride() const { return impl_->mask_stride; }
size_t GpuPrepareStack::device_bytes() const { return impl_->bytes; }
size_t GpuPrepareStack::weight_bytes() const { return impl_->weight_bytes; }
cudaStream_t GpuPrepareStack::main_stream() const { return impl_->main(); }
GraphCache& GpuPrepareStack::graphs() { return impl_->graphs; }
int GpuPrepareStack::bucket_for(StepKind kind, int rows) const { return impl_->graphs.bucket_for(kind, rows); }

int64_t GpuPrepareStack::comp_slots(int kv_source) const {
  if (kv_source < 0 || kv_source >= static_cast<int>(impl_->comp_slots.size()) ||
      impl_->comp[static_cast<size_t>(kv_source)] == nullptr)
    fail("layer " + std::to_string(kv_source) + " is not a kv source");
  return impl_->comp_slots[static_cast<size_t>(kv_source)];
}

int64_t GpuPrepareStack::score_stride(int ratio) const {
  if (ratio != 1 && ratio != 2) fail("score_stride: ratio must be 1 or 2");
  return impl_->score_stride_r[ratio];
}

void GpuPrepareStack::set_schedule(Schedule s) { impl_->set_option(&GpuStackOptions::schedule, s); }
void GpuPrepareStack::set_pdl(bool pdl) { impl_->set_option(&GpuStackOptions::pdl, pdl); }
void GpuPrepareStack::set_pdl_everywhere(bool on) { impl_->set_option(&GpuStackOptions::pdl_everywhere, on); }
void GpuPrepareStack::set_gemm_version(kernels::GemmVersion v) { impl_->set_option(&GpuStackOptions::gemm, v); }
void GpuPrepareStack::set_s_fork(LayerIssue::SFork f) { impl_->set_option(&GpuStackOptions::s_fork, f); }
void GpuPrepareStack::set_fuse_rope_store(Fusion f) { impl_->set_option(&GpuStackOptions::fuse_rope_store, f); }
void GpuPrepareStack::set_fuse_qnorm(Fusion f) { impl_->set_option(&GpuStackOptions::fuse_qnorm, f); }
void GpuPrepareStack::set_qnorm_dist(Fusion f) { impl_->set_option(&GpuStackOptions::qnorm_dist, f); }
void GpuPrepareStack::set_fuse_qchain(Fusion f) { impl_->set_option(&GpuStackOptions::fuse_qchain, f); }
void GpuPrepareStack::set_fuse_qchain_index(Fusion f) {
  impl_->set_option(&GpuStackOptions::fuse_qchain_index, f);
}
void GpuPrepareStack::set_qchain_q_direct(Fusion f) { impl_->set_option(&GpuStackOptions::qchain_q_direct, f); }
void GpuPrepareStack::set_idx_gemv(Fusion f) { impl_->set_option(&GpuStackOptions::idx_gemv, f); }
void GpuPrepareStack::set_qa_gemv(Fusion f) { impl_->set_option(&GpuStackOptions::qa_gemv, f); }
void GpuPrepareStack::set_fuse_cmp_tail(Fusion f) { impl_->set_option(&GpuStackOptions::fuse_cmp_tail, f); }
void GpuPrepareStack::set_src_idx_main(Fusion f) { impl_->set_option(&GpuStackOptions::src_idx_main, f); }
void GpuPrepareStack::set_qb_side_mtiles(int mtiles) {
  check_qb_side_mtiles(mtiles);
  impl_->set_option(&GpuStackOptions::qb_side_mtiles, mtiles);
}
void GpuPrepareStack::set_fused_index_on_main(bool on) { impl_->set_option(&GpuStackOptions::fused_index_on_main, on); }
void GpuPrepareStack::set_fuse_x_quant(Fusion f) { impl_->set_option(&GpuStackOptions::fuse_x_quant, f); }
void GpuPrepareStack::set_lane_prologue(bool on) { impl_->set_option(&GpuStackOptions::lane_prologue, on); }

void GpuPrepareStack::prefill_device_random(const std::vector<int32_t>& context) {
  Impl& m = *impl_;
  const ModelConfig& c = m.plan.config;
  if (static_cast<int>(context.size()) != m.pool.n_requests)
    fail("prefill: " + std::to_string(context.size()) + " context lengths for " + std::to_string(m.pool.n_requests) +
         " requests");
  for (size_t q = 0; q < context.size(); ++q)
    if (context[q] < 0 || context[q] > m.pool.max_context)
      fail("prefill: request " + std::to_string(q) + " context " + std::to_string(context[q]) + " is outside [0, " +
           std::to_string(m.pool.max_context) + "]");
  m.sync();
  m.upload(m.ctx_dev, context.data(), context.size());
  const uint64_t seed = m.o.seed;
  for (int L = 0; L < m.n_layers; ++L) {
    uint8_t* cache = m.window[static_cast<size_t>(L)];
    m.zero(cache, static_cast<size_t>(m.window_bytes()));
    detail::prefill_window(cache, cache_layout(CacheKind::kWindowV41), m.window_slots, m.ctx_dev, m.pool.n_requests,
                           c.window_size, m.pool.window_ring, detail::tensor_key(seed, L, "prefill.window"), m.main());
  }
  int64_t groups = 0;
  for (int s : c.kv_source_layers) {
    const size_t i = static_cast<size_t>(s);
    const int r = m.lp(s).ratio;
    m.zero(m.comp[i], static_cast<size_t>(m.comp_bytes(s)));
    m.zero(m.index_k[i], static_cast<size_t>(m.index_k_bytes(s)));
    detail::prefill_compressed(m.comp[i], cache_layout(CacheKind::kCompressedFp4), m.index_k[i],
                               cache_layout(CacheKind::kIndexK), m.comp_slots[i], m.comp_table[r], m.comp_stride[r],
                               m.ctx_dev, m.pool.n_requests, r, detail::tensor_key(seed, s, "prefill.compressed"), m.main());
    if (r == 2)
      detail::prefill_pair_state(m.pair[i], m.ctx_dev, m.pool.n_requests, m.pool.pair_ring,
                                 detail::tensor_key(seed, s, "prefill.pair_state"), m.main());
    for (int32_t ctx : context) groups += ctx / r;
  }
  m.sync();
  m.progress("prefill (device): window caches of " + std::to_string(m.n_layers) + " layers, " + std::to_string(groups) +
             " compressed groups over " + std::to_string(c.kv_source_layers.size()) + " kv sources");
}

CacheState GpuPrepareStack::download_caches() {
  Impl& m = *impl_;
  CacheState st;
  const size_t nl = m.comp.size();
  st.window.resize(static_cast<size_t>(m.n_layers));
  st.comp.resize(nl);
  st.index_k.resize(nl);
  st.pair_state.resize(nl);
  for (int L = 0; L < m.n_layers; ++L)
    st.window[static_cast<size_t>(L)] = m.download(m.window[static_cast<size_t>(L)], static_cast<size_t>(m.window_bytes()));
  for (size_t s = 0; s < nl; ++s) {
    if (!m.comp[s]) continue;
    st.comp[s] = m.download(m.comp[s], static_cast<size_t>(m.comp_bytes(static_cast<int>(s))));
    st.index_k[s] = m.download(m.index_k[s], static_cast<size_t>(m.index_k_bytes(static_cast<int>(s))));
    if (m.pair[s]) st.pair_state[s] = m.download(m.pair[s], static_cast<size_t>(m.pair_rows) * kStateRow);
  }
  return st;
}

void GpuPrepareStack::upload_caches(const CacheState& st) {
  Impl& m = *impl_;
  const size_t nl = m.comp.size();
  if (st.window.size() != static_cast<size_t>(m.n_layers) || st.comp.size() != nl || st.index_k.size() != nl ||
      st.pair_state.size() != nl)
    fail("upload_caches: the state has the wrong number of layers");
  for (int L = 0; L < m.n_layers; ++L)
    if (st.window[static_cast<size_t>(L)].size() != static_cast<size_t>(m.window_bytes()))
      fail("upload_caches: window cache of layer " + std::to_string(L) + " has " +
           std::to_string(st.window[static_cast<size_t>(L)].size()) + " bytes, expected " + std::to_string(m.window_bytes()));
  for (size_t s = 0; s < nl; ++s) {
    const bool src = m.comp[s] != nullptr;
    const size_t cb = src ? static_cast<size_t>(m.comp_bytes(static_cast<int>(s))) : 0;
    const size_t ib = src ? static_cast<size_t>(m.index_k_bytes(static_cast<int>(s))) : 0;
    const size_t pb = m.pair[s] ? static_cast<size_t>(m.pair_rows) * kStateRow : 0;
    if (st.comp[s].size() != cb || st.index_k[s].size() != ib || st.pair_state[s].size() != pb)
      fail("upload_caches: the caches of layer " + std::to_string(s) + " do not have this stack's sizes");
  }
  m.sync();
  for (int L = 0; L < m.n_layers; ++L)
    m.upload(m.window[static_cast<size_t>(L)], st.window[static_cast<size_t>(L)].data(), st.window[static_cast<size_t>(L)].size());
  for (size_t s = 0; s < nl; ++s) {
    if (!m.comp[s]) continue;
    m.upload(m.comp[s], st.comp[s].data(), st.comp[s].size());
    m.upload(m.index_k[s], st.index_k[s].data(), st.index_k[s].size());
    if (m.pair[s]) m.upload(m.pair[s], st.pair_state[s].data(), st.pair_state[s].size());
  }
  m.sync();  // the caller's host buffers may go away after return
}

void GpuPrepareStack::load_reference_caches(ref::RefStack& reference) {
  Impl& m = *impl_;
  const RequestPool& rp = reference.pool();
  if (rp.n_requests != m.pool.n_requests || rp.max_context != m.pool.max_context || rp.window_ring != m.pool.window_ring ||
      rp.pair_ring != m.pool.pair_ring || rp.req_to_token != m.pool.req_to_token)
    fail("load_reference_caches: the reference's request pool differs (n_requests, max_context, rows_per_request)");
  if (reference.config().n_layers != m.n_layers || reference.config().kv_source_layers != m.plan.config.kv_source_layers)
    fail("load_reference_caches: the reference runs another config");
  CacheState st;
  const size_t nl = m.comp.size();
  st.window.resize(static_cast<size_t>(m.n_layers));
  st.comp.resize(nl);
  st.index_k.resize(nl);
  st.pair_state.resize(nl);
  for (int L = 0; L < m.n_layers; ++L) st.window[static_cast<size_t>(L)] = reference.window_cache(L);
  for (int s : m.plan.config.kv_source_layers) {
    const size_t i = static_cast<size_t>(s);
    st.comp[i] = reference.comp_cache(s);
    st.index_k[i] = reference.index_k_cache(s);
    if (m.pair[i]) st.pair_state[i] = reference.pair_state(s);
  }
  upload_caches(st);
}

StepInfo GpuPrepareStack::set_step(StepKind kind, const BatchDesc& batch, const HostInputFn& host_x) {
  Impl& m = *impl_;
  const int rows = batch.rows();
  if (batch.pos.size() != batch.req.size()) fail("set_step: batch has different numbers of requests and positions");
  if (rows < 1 || rows > m.o.max_rows)
    fail("set_step: " + std::to_string(rows) + " rows is outside [1, max_rows " + std::to_string(m.o.max_rows) + "]");
  const int bucket = m.graphs.bucket_for(kind, rows);
  BatchDesc padded = batch;
  while (padded.rows() < bucket) {
    padded.req.push_back(-1);
    padded.pos.push_back(0);
  }
  StepMeta meta = build_step_meta(padded, m.pool, static_cast<int>(m.max_pos));  // refuses bad rows
  {
    std::vector<int> per_req(static_cast<size_t>(m.pool.n_requests), 0);
    for (int32_t r : meta.req)
      if (r >= 0 && ++per_req[static_cast<size_t>(r)] > m.rows_per_request)
        fail("set_step: request " + std::to_string(r) + " has more than " + std::to_string(m.rows_per_request) +
             " rows (rows_per_request)");
  }
  std::vector<std::vector<bf16_t>> xs;
  if (host_x) {
    for (int L = 0; L < m.n_layers; ++L) {
      xs.push_back(host_x(L, meta));
      if (xs.back().size() != static_cast<size_t>(bucket) * m.dim)
        fail("set_step: host input of layer " + std::to_string(L) + " has " + std::to_string(xs.back().size()) +
             " values, expected rows " + std::to_string(bucket) + " x dim " + std::to_string(m.dim));
      // Non-finite activations of live rows are refused where the host sees them (cache-layouts.md),
      // before anything of the stack changes; padded rows write nothing, so their values do not matter.
      for (int t = 0; t < bucket; ++t) {
        if (meta.req[static_cast<size_t>(t)] < 0) continue;
        const num::bf16_t* row = xs.back().data() + static_cast<int64_t>(t) * m.dim;
        const int64_t bad = num::first_non_finite_bf16(row, m.dim);
        if (bad < 0) continue;
        char bits[8];
        std::snprintf(bits, sizeof bits, "%04x", static_cast<unsigned>(row[bad]));
        fail("set_step: host input of layer " + std::to_string(L) + " row " + std::to_string(t) + " element " +
             std::to_string(bad) + " is not finite (bf16 0x" + bits + ")");
      }
    }
  }

  // The previous uploads' host sources are released only after their copies completed.
  m.sync();
  const int R = m.o.max_rows;
  m.meta_staging.assign(static_cast<size_t>(kMFields) * R, 0);
  const auto field = [&](MetaField f) { return m.meta_staging.data() + static_cast<int64_t>(f) * R; };
  for (int t = 0; t < R; ++t) {  // rows past the bucket: padded-row values (never read by a cycle)
    const bool in = t < bucket;
    const size_t u = static_cast<size_t>(t);
    field(kMPos)[t] = in ? meta.pos[u] : 0;
    field(kMReq)[t] = in ? meta.req[u] : -1;
    field(kMSwaLoc)[t] = in ? meta.swa_loc[u] : -1;
    field(kMCLoc1)[t] = in ? meta.c_out_loc[1][u] : -1;
    field(kMCLoc2)[t] = in ? meta.c_out_loc[2][u] : -1;
    field(kMClen1)[t] = in ? meta.clen[1][u] : 0;
    field(kMClen2)[t] = in ? meta.clen[2][u] : 0;
    field(kMStateRow)[t] = in ? meta.pair_state_row[u] : -1;
    field(kMPrevRow)[t] = in ? meta.pair_prev_row[u] : -1;
    field(kMPartnerRow)[t] = in ? meta.pair_partner_state_row[u] : -1;
    field(kMGroup2)[t] = in && meta.pair_state_row[u] >= 0 && meta.pos[u] % 2 == 1 ? meta.pos[u] - 1 : 0;
  }
  m.upload(m.meta, m.meta_staging.data(), m.meta_staging.size());
  m.x_staging = std::move(xs);
  if (host_x) {
    for (int L = 0; L < m.n_layers; ++L)
      m.upload(m.x(L), m.x_staging[static_cast<size_t>(L)].data(), m.x_staging[static_cast<size_t>(L)].size());
  } else {
    detail::generate_inputs(m.x_all, m.x_layer_stride, m.n_layers, bucket, m.dim, m.mf(kMReq), m.mf(kMPos), m.o.seed,
                            m.steps, m.main());
  }
  m.info = StepInfo{kind, rows, bucket, m.steps++};
  m.step_meta = std::move(meta);
  m.has_step = true;
  return m.info;
}

const StepMeta& GpuPrepareStack::step_meta() const {
  if (!impl_->has_step) fail("no step set (call set_step first)");
  return impl_->step_meta;
}
const StepInfo& GpuPrepareStack::step_info() const {
  if (!impl_->has_step) fail("no step set (call set_step first)");
  return impl_->info;
}

void GpuPrepareStack::run_eager() {
  Impl& m = *impl_;
  if (!m.has_step) fail("run_eager: no step set (call set_step first)");
  m.issue_cycle(m.info.bucket);
}

void GpuPrepareStack::run_graph() {
  Impl& m = *impl_;
  if (!m.has_step) fail("run_graph: no step set (call set_step first)");
  Impl* self = &m;
  const int used = m.graphs.launch(m.info.kind, m.info.bucket, m.main(), [self](cudaStream_t s, int bucket_rows) {
    if (s != self->main()) throw std::logic_error("GpuPrepareStack: capture on a stream other than the lanes' main");
    self->issue_cycle(bucket_rows);
  });
  if (used != m.info.bucket) throw std::logic_error("GpuPrepareStack: the graph cache picked another bucket");
}

void GpuPrepareStack::synchronize() { impl_->sync(); }

std::vector<bf16_t> GpuPrepareStack::q_pad(int layer) {
  Impl& m = *impl_;
  if (layer < 0 || layer >= m.n_layers) fail("q_pad: no backbone layer " + std::to_string(layer));
  return m.download(m.q_pad[static_cast<size_t>(layer)], static_cast<size_t>(m.o.max_rows) * m.H_pad * kHd);
}

std::vector<int32_t> GpuPrepareStack::topk(int index_source) {
  Impl& m = *impl_;
  if (index_source < 0 || index_source >= static_cast<int>(m.topk.size()) || !m.topk[static_cast<size_t>(index_source)])
    fail("topk: layer " + std::to_string(index_source) + " is not an index source");
  return m.download(m.topk[static_cast<size_t>(index_source)], static_cast<size_t>(m.o.max_rows * m.topk_width));
}

std::vector<uint8_t> GpuPrepareStack::candidate_mask() {
  Impl& m = *impl_;
  if (!m.cand_mask) return {};
  return m.download(m.cand_mask, static_cast<size_t>(m.o.max_rows * m.mask_stride));
}

void GpuPrepareStack::poison_outputs(uint8_t byte) {
  Impl& m = *impl_;
  const int R = m.o.max_rows;
  for (bf16_t* p : m.q_pad) V4_CUDA_CHECK(cudaMemsetAsync(p, byte, sizeof(bf16_t) * R * m.H_pad * kHd, m.main()));
  for (int32_t* p : m.topk)
    if (p) V4_CUDA_CHECK(cudaMemsetAsync(p, byte, sizeof(int32_t) * R * m.topk_width, m.main()));
  if (m.cand_mask) V4_CUDA_CHECK(cudaMemsetAsync(m.cand_mask, byte, static_cast<size_t>(R * m.mask_stride), m.main()));
}

unsigned long long GpuPrepareStack::error_count() { return impl_->err.read(impl_->main()); }
void GpuPrepareStack::reset_error_count() { impl_->err.reset(impl_->main()); }

}  // namespace v4attn::prepare
