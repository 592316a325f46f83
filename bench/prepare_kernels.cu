// Benchmark of the per-layer prepare kernels (include/v4attn/kernels/prepare_kernels.h), plus the
// indexer q pack (indexer_kernels.h) and the FP8 act quant of the layer input (gemm.h).
//
// For every kernel and row count T: build seeded random inputs and step metadata (T < 6: decode
// rows; otherwise verify blocks of 6 rows padded to T, like tests/gpu/test_prepare_kernels.cu),
// validate the kernel's output bytes against the CPU reference once, then time it with CUDA events
// around each launch (warm-up, then --reps launches, a 128 MB memset before each one so that
// every launch starts with a cold L2), and report the median. "bytes" counts what the kernel must
// move (inputs it reads, outputs it writes, metadata, table rows, norm weights); "floor" is that at
// 4.27 TB/s. Tiny kernels sit far above their floor: they are launch- and latency-bound, which is
// what PDL and graph capture are for.
//
// Versions: v1 = the kernels of src/kernels and the FP8 act quant of src/gemm (launched without
// PDL; nothing precedes them here).
//
// Usage: bench_prepare_kernels [--T 1,6,8,48,64] [--reps 100] [--heads 64] [--json FILE]
#include <CLI/CLI.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "bench_common.h"
#include "runtime/cuda_utils.h"
#include "runtime/device_error_counter.h"
#include "v4attn/kernels/gemm.h"
#include "v4attn/kernels/indexer_kernels.h"
#include "v4attn/kernels/prepare_kernels.h"
#include "v4attn/reference/gemm.h"
#include "v4attn/reference/indexer.h"
#include "v4attn/reference/prepare_ops.h"
#include "v4attn/reference/step.h"
#include "v4attn/rope_table.h"

namespace {

using namespace v4attn;
using num::bf16_t;
namespace kn = v4attn::kernels;

constexpr int kMaxPos = 4096;
constexpr int kMaxContext = 2048;
constexpr int kQaWidth = 1792;
constexpr int kKvColumn = 1280;
constexpr float kEps = 1e-20f;
constexpr uint8_t kPoison = 0xAB;

struct Row {
  std::string kernel, version;
  int T = 0;
  double median_us = 0.0;
  int64_t bytes = 0;
  bool valid = false;
  double floor_us() const { return bench::floor_us(bytes); }
};

// ---- inputs -------------------------------------------------------------------------------------
std::mt19937_64& rng() {
  static std::mt19937_64 r(20240611);
  return r;
}
std::vector<bf16_t> random_bf16(size_t n) {
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<bf16_t> v(n);
  for (auto& x : v) x = num::bf16_from_f32(d(rng()));
  return v;
}
std::vector<float> random_weight(int n) {
  std::uniform_real_distribution<float> d(0.25f, 2.0f);
  std::vector<float> v(static_cast<size_t>(n));
  for (auto& x : v) x = d(rng());
  return v;
}
std::vector<float> random_kvs(int64_t rows) {
  std::normal_distribution<float> kv(0.0f, 1.0f), score(0.0f, 3.0f);
  std::vector<float> v(static_cast<size_t>(rows * 1024));
  for (int64_t r = 0; r < rows; ++r)
    for (int d = 0; d < 512; ++d) {
      v[static_cast<size_t>(r * 1024 + d)] = kv(rng());
      v[static_cast<size_t>(r * 1024 + 512 + d)] = score(rng());
    }
  return v;
}
struct Batch {
  RequestPool pool;
  StepMeta meta;
};
// T < 6: T decode rows; otherwise T / 6 verify blocks of 6 rows, padded to T.
Batch make_batch(int T) {
  const int v = T < 6 ? 1 : 6;
  const int n_req = T < 6 ? T : T / 6;
  std::uniform_int_distribution<int32_t> start(0, kMaxContext - 7);
  std::vector<int32_t> ctx(static_cast<size_t>(n_req));
  for (auto& c : ctx) c = start(rng());
  Batch b;
  b.pool = make_request_pool(n_req, kMaxContext, 6, 128);
  b.meta = build_step_meta(make_verify_batch(ctx, v, T), b.pool, kMaxPos);
  return b;
}
const std::vector<float>& main_table() {
  static const std::vector<float> t = [] {
    RopeParams p;
    return build_rope_table(p, kMaxPos);
  }();
  return t;
}
const std::vector<float>& compressed_table() {
  static const std::vector<float> t = [] {
    RopeParams p;
    p.base = 160000.0;
    p.yarn = true;
    return build_rope_table(p, kMaxPos);
  }();
  return t;
}
template <class T>
std::shared_ptr<DeviceBuffer<T>> dev(const std::vector<T>& h) {
  auto d = std::make_shared<DeviceBuffer<T>>(h.size());
  d->upload(h.data(), h.size());
  return d;
}
template <class T>
std::shared_ptr<DeviceBuffer<T>> dev_poisoned(size_t n) {
  auto d = std::make_shared<DeviceBuffer<T>>(n);
  d->fill_bytes(kPoison);
  return d;
}
template <class T>
std::vector<T> host_poisoned(size_t n) {
  std::vector<T> h(n);
  std::memset(h.data(), kPoison, n * sizeof(T));
  return h;
}
template <class T>
bool same_bytes(const std::vector<T>& want, const DeviceBuffer<T>& got) {
  std::vector<T> h(got.size());
  got.download(h.data(), h.size());
  return h.size() == want.size() && std::memcmp(h.data(), want.data(), h.size() * sizeof(T)) == 0;
}

// A prepared kernel: `launch` queues one run on a stream; `valid` is the validation result.
struct Case {
  std::string kernel;
  int T = 0;
  int64_t bytes = 0;
  bool valid = false;
  std::function<void(cudaStream_t)> launch;
  std::vector<std::shared_ptr<void>> keep;  // device buffers the launch uses
};

// ---- one case per kernel -------------------------------------------------------------------------
Case q_rope_store_case(int T, int H) {
  const int H_pad = H;
  std::uniform_int_distribution<int32_t> pd(0, kMaxPos - 1);
  std::vector<int32_t> pos(static_cast<size_t>(T));
  for (auto& p : pos) p = pd(rng());
  const std::vector<bf16_t> q = random_bf16(static_cast<size_t>(T) * H * 512);
  std::vector<bf16_t> want = host_poisoned<bf16_t>(q.size());
  ref::q_rope_store(q.data(), T, H, pos.data(), main_table().data(), kMaxPos, want.data(), H_pad);
  auto d_q = dev(q);
  auto d_pad = dev_poisoned<bf16_t>(q.size());
  auto d_pos = dev(pos);
  auto d_table = dev(main_table());
  kn::QRopeStoreParams p;
  p.q = d_q->get();
  p.q_row_stride = static_cast<int64_t>(H) * 512;
  p.q_pad = d_pad->get();
  p.q_pad_row_stride = static_cast<int64_t>(H_pad) * 512;
  p.pos = d_pos->get();
  p.table = d_table->get();
  p.max_pos = kMaxPos;
  p.T = T;
  p.H = H;
  p.H_pad = H_pad;
  Case c;
  c.kernel = "q_rope_store";
  c.T = T;
  c.bytes = 2 * static_cast<int64_t>(T) * H * 512 * 2 + static_cast<int64_t>(T) * (4 + 256);
  c.launch = [p](cudaStream_t s) { kn::run_q_rope_store(p, s, false); };
  c.launch(nullptr);
  c.valid = same_bytes(want, *d_pad);
  c.keep = {d_q, d_pad, d_pos, d_table};
  return c;
}

Case window_k_case(int T, CacheKind kind) {
  const Batch b = make_batch(T);
  const CacheLayout layout = cache_layout(kind);
  const int64_t n_slots = b.pool.window_pool_slots();
  const std::vector<bf16_t> qa = random_bf16(static_cast<size_t>(T) * kQaWidth);
  const std::vector<float> w = random_weight(512);
  std::vector<uint8_t> want = host_poisoned<uint8_t>(static_cast<size_t>(layout.pool_bytes(n_slots)));
  ref::window_k_store(qa.data() + kKvColumn, T, kQaWidth, w.data(), kEps, b.meta.pos.data(), main_table().data(), kMaxPos,
                      b.meta.swa_loc.data(), kind, layout, want.data(), n_slots);
  auto d_qa = dev(qa);
  auto d_w = dev(w);
  auto d_pos = dev(b.meta.pos);
  auto d_loc = dev(b.meta.swa_loc);
  auto d_table = dev(main_table());
  auto d_cache = dev_poisoned<uint8_t>(want.size());
  kn::WindowKStoreParams p;
  p.kv = d_qa->get() + kKvColumn;
  p.kv_row_stride = kQaWidth;
  p.kv_norm = d_w->get();
  p.eps = kEps;
  p.pos = d_pos->get();
  p.table = d_table->get();
  p.max_pos = kMaxPos;
  p.swa_loc = d_loc->get();
  p.kind = kind;
  p.layout = layout;
  p.cache = d_cache->get();
  p.n_slots = n_slots;
  p.T = T;
  int64_t live = 0;
  for (int t = 0; t < T; ++t) live += b.meta.swa_loc[t] >= 0;
  Case c;
  c.kernel = kind == CacheKind::kWindowV41 ? "window_k_v41" : "window_k_v4";
  c.T = T;
  c.bytes = 512 * 4 + static_cast<int64_t>(T) * 4 + live * (4 + 1024 + 256 + layout.data_bytes + layout.scale_bytes);
  c.launch = [p](cudaStream_t s) { kn::run_window_k_store(p, s, false); };
  c.launch(nullptr);
  c.valid = same_bytes(want, *d_cache);
  c.keep = {d_qa, d_w, d_pos, d_loc, d_table, d_cache};
  return c;
}

Case c1_case(int T) {
  const Batch b = make_batch(T);
  const CacheLayout layout = cache_layout(CacheKind::kCompressedFp4);
  const int64_t n_slots = b.pool.full_pool_slots() + 1;
  const std::vector<bf16_t> proj = random_bf16(static_cast<size_t>(T) * 512);
  const std::vector<float> w = random_weight(512);
  const std::vector<int32_t>& loc = b.meta.c_out_loc[1];
  std::vector<uint8_t> want_cache = host_poisoned<uint8_t>(static_cast<size_t>(layout.pool_bytes(n_slots)));
  std::vector<bf16_t> want_latent = host_poisoned<bf16_t>(static_cast<size_t>(T) * 512);
  ref::c1_fused(proj.data(), T, w.data(), kEps, b.meta.pos.data(), compressed_table().data(), kMaxPos, loc.data(), layout,
                want_cache.data(), n_slots, want_latent.data());
  auto d_proj = dev(proj);
  auto d_w = dev(w);
  auto d_pos = dev(b.meta.pos);
  auto d_loc = dev(loc);
  auto d_table = dev(compressed_table());
  auto d_cache = dev_poisoned<uint8_t>(want_cache.size());
  auto d_latent = dev_poisoned<bf16_t>(want_latent.size());
  kn::C1FusedParams p;
  p.proj = d_proj->get();
  p.proj_row_stride = 512;
  p.c_norm = d_w->get();
  p.eps = kEps;
  p.pos = d_pos->get();
  p.table = d_table->get();
  p.max_pos = kMaxPos;
  p.out_loc = d_loc->get();
  p.layout = layout;
  p.cache = d_cache->get();
  p.n_slots = n_slots;
  p.latent_pre_rope = d_latent->get();
  p.latent_row_stride = 512;
  p.N = T;
  int64_t stores = 0;
  for (int t = 0; t < T; ++t) stores += loc[t] > 0;
  Case c;
  c.kernel = "c1_fused";
  c.T = T;
  c.bytes = 512 * 4 + static_cast<int64_t>(T) * (8 + 1024 + 1024 + 256) + stores * 288;
  c.launch = [p](cudaStream_t s) { kn::run_c1_fused(p, s, false); };
  c.launch(nullptr);
  c.valid = same_bytes(want_cache, *d_cache) && same_bytes(want_latent, *d_latent);
  c.keep = {d_proj, d_w, d_pos, d_loc, d_table, d_cache, d_latent};
  return c;
}

Case c2_case(int T) {
  const Batch b = make_batch(T);
  const StepMeta& m = b.meta;
  const CacheLayout layout = cache_layout(CacheKind::kCompressedFp4);
  const int64_t n_slots = b.pool.full_pool_slots() / 2 + 1;
  const int64_t state_rows = static_cast<int64_t>(b.pool.n_requests) * b.pool.pair_ring;
  const std::vector<float> kvs = random_kvs(T);
  std::vector<float> state = random_kvs(state_rows);  // arbitrary parked partners
  const std::vector<float> w = random_weight(512);
  const std::vector<int32_t>& loc = m.c_out_loc[2];
  auto d_state = dev(state);  // before the reference updates the host copy
  std::vector<uint8_t> want_cache = host_poisoned<uint8_t>(static_cast<size_t>(layout.pool_bytes(n_slots)));
  std::vector<bf16_t> want_latent = host_poisoned<bf16_t>(static_cast<size_t>(T) * 512);
  ref::c2_fused(kvs.data(), T, m.pos.data(), m.pair_state_row.data(), m.pair_partner_state_row.data(), m.pair_prev_row.data(),
                state.data(), state_rows, w.data(), kEps, compressed_table().data(), kMaxPos, loc.data(), layout,
                want_cache.data(), n_slots, want_latent.data());
  auto d_kvs = dev(kvs);
  auto d_pos = dev(m.pos);
  auto d_srow = dev(m.pair_state_row);
  auto d_partner = dev(m.pair_partner_state_row);
  auto d_prev = dev(m.pair_prev_row);
  auto d_loc = dev(loc);
  auto d_w = dev(w);
  auto d_table = dev(compressed_table());
  auto d_cache = dev_poisoned<uint8_t>(want_cache.size());
  auto d_latent = dev_poisoned<bf16_t>(want_latent.size());
  kn::C2FusedParams p;
  p.kvs = d_kvs->get();
  p.kvs_row_stride = 1024;
  p.pos = d_pos->get();
  p.state_row = d_srow->get();
  p.partner_state_row = d_partner->get();
  p.prev_row = d_prev->get();
  p.state = d_state->get();
  p.state_rows = state_rows;
  p.c_norm = d_w->get();
  p.eps = kEps;
  p.table = d_table->get();
  p.max_pos = kMaxPos;
  p.out_loc = d_loc->get();
  p.layout = layout;
  p.cache = d_cache->get();
  p.n_slots = n_slots;
  p.latent_pre_rope = d_latent->get();
  p.latent_row_stride = 512;
  p.N = T;
  int64_t bytes = 512 * 4 + static_cast<int64_t>(T) * 4;
  for (int t = 0; t < T; ++t) {
    if (m.pair_state_row[t] < 0) continue;
    bytes += 12 + 4096;  // metadata, own kv | score
    if (m.pos[t] % 2 == 0) {
      bytes += 4096;  // park
    } else {
      bytes += 4096 + 1024 + 256 + (loc[t] > 0 ? 288 : 0);  // partner, latent, table row, slot
    }
  }
  Case c;
  c.kernel = "c2_fused";
  c.T = T;
  c.bytes = bytes;
  c.launch = [p](cudaStream_t s) { kn::run_c2_fused(p, s, false); };
  c.launch(nullptr);
  c.valid = same_bytes(want_cache, *d_cache) && same_bytes(want_latent, *d_latent) && same_bytes(state, *d_state);
  c.keep = {d_kvs, d_pos, d_srow, d_partner, d_prev, d_loc, d_w, d_table, d_cache, d_latent, d_state};
  return c;  // later launches re-park the same values: the state stays what was validated
}

Case index_k_case(int T) {
  const Batch b = make_batch(T);
  const CacheLayout layout = cache_layout(CacheKind::kIndexK);
  const int64_t n_slots = b.pool.full_pool_slots() + 1;
  const std::vector<bf16_t> kproj = random_bf16(static_cast<size_t>(T) * 128);
  const std::vector<float> w = random_weight(128);
  const std::vector<int32_t>& loc = b.meta.c_out_loc[1];  // ratio-1 source: every live row stores
  std::vector<uint8_t> want = host_poisoned<uint8_t>(static_cast<size_t>(layout.pool_bytes(n_slots)));
  ref::index_k_store(kproj.data(), T, w.data(), kEps, b.meta.pos.data(), compressed_table().data(), kMaxPos, loc.data(),
                     layout, want.data(), n_slots);
  auto d_kproj = dev(kproj);
  auto d_w = dev(w);
  auto d_g = dev(b.meta.pos);
  auto d_loc = dev(loc);
  auto d_table = dev(compressed_table());
  auto d_cache = dev_poisoned<uint8_t>(want.size());
  kn::IndexKStoreParams p;
  p.kproj = d_kproj->get();
  p.kproj_row_stride = 128;
  p.k_norm = d_w->get();
  p.eps = kEps;
  p.g = d_g->get();
  p.table = d_table->get();
  p.max_pos = kMaxPos;
  p.out_loc = d_loc->get();
  p.layout = layout;
  p.cache = d_cache->get();
  p.n_slots = n_slots;
  p.N = T;
  int64_t stores = 0;
  for (int t = 0; t < T; ++t) stores += loc[t] > 0;
  Case c;
  c.kernel = "index_k_store";
  c.T = T;
  c.bytes = 128 * 4 + static_cast<int64_t>(T) * 4 + stores * (8 + 256 + 256 + 68);
  c.launch = [p](cudaStream_t s) { kn::run_index_k_store(p, s, false); };
  c.launch(nullptr);
  c.valid = same_bytes(want, *d_cache);
  c.keep = {d_kproj, d_w, d_g, d_loc, d_table, d_cache};
  return c;
}

// FP8 act quant of the layer input x [T, 5120] (block 32, ue8m0): the quant ahead of the fp8
// GEMMs (kernels/gemm.h run_act_quant_fp8).
Case act_quant_case(int T) {
  constexpr int64_t kHidden = 5120;
  const std::vector<bf16_t> x = random_bf16(static_cast<size_t>(T) * kHidden);
  const ref::ActQuant want = ref::act_quant(x.data(), T, kHidden, kHidden);
  auto d_x = dev(x);
  auto d_q = dev_poisoned<uint8_t>(want.q.size());
  auto d_scale = dev_poisoned<uint8_t>(want.scale.size());
  kn::ActQuantParams p;
  p.x = d_x->get();
  p.x_stride = kHidden;
  p.q = d_q->get();
  p.q_stride = kHidden;
  p.scale = d_scale->get();
  p.scale_stride = kHidden / 32;
  p.m = T;
  p.k = kHidden;
  Case c;
  c.kernel = "act_quant_fp8";
  c.T = T;
  c.bytes = static_cast<int64_t>(T) * (2 * kHidden + kHidden + kHidden / 32);
  c.launch = [p](cudaStream_t s) { kn::run_act_quant_fp8(p, s, false); };
  c.launch(nullptr);
  c.valid = same_bytes(want.q, *d_q) && same_bytes(want.scale, *d_scale);
  c.keep = {d_x, d_q, d_scale};
  return c;
}

// Indexer q pack (32 heads): qi [T, 4096] -> RoPE -> FP4 codes + scales, and the head weights.
Case q_pack_case(int T) {
  constexpr int kHeads = kn::kIndexerHeads;
  constexpr int64_t kQi = int64_t{kHeads} * kn::kIndexerHeadDim;
  const std::vector<bf16_t> qi = random_bf16(static_cast<size_t>(T) * kQi);
  const std::vector<bf16_t> wproj = random_bf16(static_cast<size_t>(T) * kHeads);
  std::uniform_int_distribution<int32_t> pd(0, kMaxPos - 1);
  std::vector<int32_t> pos(static_cast<size_t>(T));
  for (auto& x : pos) x = pd(rng());
  const ref::IndexerQ want = ref::indexer_q_pack(qi.data(), T, kHeads, pos.data(), compressed_table().data(), kMaxPos);
  const std::vector<float> want_w = ref::indexer_weights(wproj.data(), T, kHeads, kHeads);
  auto d_qi = dev(qi);
  auto d_wproj = dev(wproj);
  auto d_pos = dev(pos);
  auto d_table = dev(compressed_table());
  auto d_codes = dev_poisoned<uint8_t>(want.codes.size());
  auto d_scales = dev_poisoned<uint8_t>(want.scales.size());
  auto d_weights = dev_poisoned<float>(want_w.size());
  kn::IndexerQPackParams p;
  p.qi = d_qi->get();
  p.qi_stride = kQi;
  p.wproj_out = d_wproj->get();
  p.wproj_stride = kHeads;
  p.pos = d_pos->get();
  p.rope_table = d_table->get();
  p.max_pos = kMaxPos;
  p.T = T;
  p.heads = kHeads;
  p.heads_total = kHeads;
  p.q_codes = d_codes->get();
  p.q_scales = d_scales->get();
  p.weights = d_weights->get();
  Case c;
  c.kernel = "indexer_q_pack";
  c.T = T;
  c.bytes = static_cast<int64_t>(T) * (2 * kQi + 2 * kHeads + 4 + 128 + kHeads * (64 + 4 + 4));
  c.launch = [p](cudaStream_t s) { kn::run_indexer_q_pack(p, s, false); };
  c.launch(nullptr);
  c.valid = same_bytes(want.codes, *d_codes) && same_bytes(want.scales, *d_scales) && same_bytes(want_w, *d_weights);
  c.keep = {d_qi, d_wproj, d_pos, d_table, d_codes, d_scales, d_weights};
  return c;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"bench_prepare_kernels: validate, then time the per-layer prepare kernels"};
  v4attn::bench::add_version_flag(app, "bench_prepare_kernels");
  std::vector<int> Ts = {1, 6, 8, 48, 64};
  int reps = 100;
  int heads = 64;
  std::string json_path;
  app.add_option("--T", Ts, "row counts T")->delimiter(',');
  app.add_option("--reps", reps, "timed launches per case (>= 50)")->check(CLI::Range(50, 100000));
  app.add_option("--heads", heads, "query heads H for q_rope_store")->check(CLI::Range(1, 128));
  app.add_option("--json", json_path, "also write the rows to this JSON file");
  CLI11_PARSE(app, argc, argv);

  try {
    if (!bench::gpu_present("bench_prepare_kernels")) return 2;
    for (int T : Ts)
      if (T < 1 || T > 4096) throw std::invalid_argument("--T values must be in [1, 4096]");
    cudaStream_t stream;
    V4_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    bench::L2Flush l2;

    std::vector<Row> rows;
    bool all_valid = true;
    const std::vector<std::function<Case(int)>> makers = {
        [&](int T) { return q_rope_store_case(T, heads); },
        [](int T) { return window_k_case(T, CacheKind::kWindowV41); },
        [](int T) { return window_k_case(T, CacheKind::kWindowV4); },
        [](int T) { return c1_case(T); },
        [](int T) { return c2_case(T); },
        [](int T) { return index_k_case(T); },
        [](int T) { return q_pack_case(T); },
        [](int T) { return act_quant_case(T); },
    };
    std::printf("%-16s %-4s %5s %11s %10s %9s %7s %s\n", "kernel", "ver", "T", "median_us", "bytes", "floor_us", "ratio",
                "valid");
    for (const auto& make : makers)
      for (int T : Ts) {
        Case c = make(T);
        V4_CUDA_CHECK(cudaDeviceSynchronize());
        Row r;
        r.kernel = c.kernel;
        r.version = "v1";
        r.T = T;
        r.bytes = c.bytes;
        r.valid = c.valid;
        all_valid = all_valid && c.valid;
        r.median_us = bench::cold_l2_median_us(c.launch, reps, l2, stream);
        std::printf("%-16s %-4s %5d %11.2f %10lld %9.3f %7.1f %s\n", r.kernel.c_str(), r.version.c_str(), r.T, r.median_us,
                    static_cast<long long>(r.bytes), r.floor_us(), r.median_us / r.floor_us(), r.valid ? "ok" : "MISMATCH");
        rows.push_back(r);
      }

    if (!json_path.empty()) {
      nlohmann::json j = nlohmann::json::array();
      for (const Row& r : rows)
        j.push_back({{"kernel", r.kernel}, {"version", r.version}, {"T", r.T}, {"median_us", r.median_us},
                     {"bytes", r.bytes}, {"floor_us", r.floor_us()}, {"ratio", r.median_us / r.floor_us()},
                     {"valid", r.valid}});
      bench::write_json(json_path, j);
    }
    V4_CUDA_CHECK(cudaStreamDestroy(stream));
    return bench::validity_exit_code("bench_prepare_kernels", all_valid);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_prepare_kernels: %s\n", e.what());
    return 1;
  }
}
