// GPU tests of the prepare kernels (include/v4attn/kernels/prepare_kernels.h) against their CPU
// reference twins (include/v4attn/reference/prepare_ops.h): outputs and caches compared byte for
// byte over whole buffers that both sides poisoned (0xAB) first, so a missing write, a stray write
// and a wrong byte all fail. Step metadata comes from the reference's step.h (verify batches with
// padded rows). Every kernel runs twice per case: plain, and with PDL behind a "late producer"
// kernel that lets it launch at once but writes its input ~25 us later (so a load before
// griddepcontrol.wait would read poison); both runs must give the reference's bytes.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "gpu_test_util.h"
#include "kernels/device_common.cuh"
#include "runtime/device_error_counter.h"
#include "runtime/launch.h"
#include "v4attn/kernels/gemm.h"
#include "v4attn/kernels/prepare_kernels.h"
#include "v4attn/reference/prepare_ops.h"
#include "v4attn/reference/step.h"
#include "v4attn/rope_table.h"

namespace {

using namespace v4attn;
using num::bf16_t;
namespace kn = v4attn::kernels;

constexpr uint8_t kPoison = 0xAB;
constexpr int kMaxPos = 2048;       // RoPE table rows
constexpr int kMaxContext = 600;    // positions per request in the pool
constexpr int kQaWidth = 1792;      // fused wq_a|wkv output: 1280 + 512
constexpr int kKvColumn = 1280;
constexpr float kEps = 1e-20f;      // norm_eps of deepseek-v4.1-flash.json
const int kTs[] = {1, 6, 8, 48, 64};

enum class Mode { kPlain, kPdl };
const Mode kModes[] = {Mode::kPlain, Mode::kPdl};
const char* mode_name(Mode m) { return m == Mode::kPlain ? "plain" : "pdl"; }

// ---- tables, random inputs, batches ---------------------------------------------------------------
const std::vector<float>& main_table() {
  static const std::vector<float> t = [] {
    RopeParams p;
    p.base = 10000.0;
    p.yarn = false;
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

// Rows of normal values with a per-row magnitude 2^((r % 9) - 4); for rows >= 3 (when there are
// that many) row 2 is all zeros (RMSNorm's eps path, quant amax floors) and row 3 is scaled by 2^100
// (its sum of squares overflows to inf: the norm gives zeros on both sides).
std::vector<bf16_t> random_rows_bf16(int64_t rows, int64_t width, std::mt19937_64& rng) {
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<bf16_t> v(static_cast<size_t>(rows * width));
  for (int64_t r = 0; r < rows; ++r) {
    float scale = std::ldexp(1.0f, static_cast<int>(r % 9) - 4);
    if (rows > 3 && r == 2) scale = 0.0f;
    if (rows > 3 && r == 3) scale = std::ldexp(1.0f, 100);
    for (int64_t i = 0; i < width; ++i) v[static_cast<size_t>(r * width + i)] = num::bf16_from_f32(dist(rng) * scale);
  }
  return v;
}
std::vector<float> random_norm_weight(int n, std::mt19937_64& rng) {
  std::uniform_real_distribution<float> dist(0.25f, 2.0f);
  std::vector<float> w(static_cast<size_t>(n));
  for (auto& x : w) x = dist(rng);
  return w;
}
// kvs rows of the ratio-2 compressor: kv ~ N(0, 1), score ~ N(0, 3).
std::vector<float> random_kvs(int64_t rows, std::mt19937_64& rng) {
  std::normal_distribution<float> kv(0.0f, 1.0f), score(0.0f, 3.0f);
  std::vector<float> v(static_cast<size_t>(rows * 1024));
  for (int64_t r = 0; r < rows; ++r)
    for (int d = 0; d < 512; ++d) {
      v[static_cast<size_t>(r * 1024 + d)] = kv(rng);
      v[static_cast<size_t>(r * 1024 + 512 + d)] = score(rng);
    }
  return v;
}

struct Batch {
  RequestPool pool;
  StepMeta meta;
};
// T = 1: one decode row; T = 6: one verify request; 8, 48, 64: 1, 7, 10 verify requests of 6
// rows padded to T (padded rows: out_cache_loc 0, swa_loc -1, no pair-state row).
Batch make_batch(int T, std::mt19937_64& rng) {
  const int v = T == 1 ? 1 : 6;
  const int n_req = T == 1 ? 1 : (T == 48 ? 7 : T / 6);
  std::uniform_int_distribution<int32_t> start(0, kMaxContext - 7);
  std::vector<int32_t> ctx(static_cast<size_t>(n_req));
  for (auto& c : ctx) c = start(rng);
  Batch b;
  b.pool = make_request_pool(n_req, kMaxContext, 6, 128);
  b.meta = build_step_meta(make_verify_batch(ctx, v, T), b.pool, kMaxPos);
  EXPECT_EQ(b.meta.rows, T);
  return b;
}
int64_t compressed_slots(const RequestPool& pool, int ratio) { return pool.full_pool_slots() / ratio + 1; }

// ---- device helpers ----------------------------------------------------------------------------
template <class T>
DeviceBuffer<T> to_device(const std::vector<T>& h, cudaStream_t s) {
  DeviceBuffer<T> d(h.size());
  d.upload(h.data(), h.size(), s);
  return d;
}
template <class T>
std::vector<T> to_host(const DeviceBuffer<T>& d, cudaStream_t s) {
  std::vector<T> h(d.size());
  d.download(h.data(), h.size(), s);
  return h;
}
template <class T>
DeviceBuffer<T> poisoned(size_t n, cudaStream_t s) {
  DeviceBuffer<T> d(n);
  d.fill_bytes(kPoison, s);
  return d;
}
template <class T>
std::vector<T> poisoned_host(size_t n) {
  std::vector<T> h(n);
  std::memset(h.data(), kPoison, n * sizeof(T));
  return h;
}

void feed_input(Mode m, const void* staging, void* input, size_t bytes, cudaStream_t s) {
  ASSERT_EQ(bytes % 16, 0u);
  if (m == Mode::kPlain) {
    V4_CUDA_CHECK(cudaMemcpyAsync(input, staging, bytes, cudaMemcpyDeviceToDevice, s));
    return;
  }
  test_util::queue_late_producer(staging, input, bytes, kPoison, s);  // PDL: poisoned until the late copy
}

// Byte comparison with the first mismatch and the count in the message.
template <class T>
::testing::AssertionResult same_bytes(const std::vector<T>& want, const std::vector<T>& got) {
  if (want.size() != got.size())
    return ::testing::AssertionFailure() << "sizes differ: " << want.size() << " vs " << got.size();
  const size_t n = want.size() * sizeof(T);
  const auto* a = reinterpret_cast<const uint8_t*>(want.data());
  const auto* b = reinterpret_cast<const uint8_t*>(got.data());
  if (std::memcmp(a, b, n) == 0) return ::testing::AssertionSuccess();
  size_t first = n, count = 0;
  for (size_t i = 0; i < n; ++i)
    if (a[i] != b[i]) {
      if (first == n) first = i;
      ++count;
    }
  return ::testing::AssertionFailure() << count << " of " << n << " bytes differ; first at byte " << first
                                       << " (element " << first / sizeof(T) << "): want 0x" << std::hex
                                       << int{a[first]} << " got 0x" << int{b[first]};
}

class PrepareKernelTest : public ::testing::Test {
 protected:
  void SetUp() override {
    V4_REQUIRE_GPU();
    V4_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  }
  void TearDown() override {
    if (stream_) cudaStreamDestroy(stream_);
  }
  void sync() { V4_CUDA_CHECK(cudaStreamSynchronize(stream_)); }
  cudaStream_t stream_ = nullptr;
  std::mt19937_64 rng_{20240611};
};

using GpuQRopeStore = PrepareKernelTest;
using GpuWindowK = PrepareKernelTest;
using GpuC1Fused = PrepareKernelTest;
using GpuC2Fused = PrepareKernelTest;
using GpuIndexK = PrepareKernelTest;

// =====================================================================================================
// q_rope_store
// =====================================================================================================
struct QCase {
  int T, H, H_pad;
  int64_t q_row_stride;  // >= H * 512
};

// Runs one q_rope_store case in both modes; returns the q_pad bytes of each mode.
void check_q_rope_store(const QCase& c, cudaStream_t s, std::mt19937_64& rng) {
  SCOPED_TRACE("T " + std::to_string(c.T) + " H " + std::to_string(c.H) + " H_pad " + std::to_string(c.H_pad) +
               " q_row_stride " + std::to_string(c.q_row_stride));
  std::uniform_int_distribution<int32_t> pos_dist(0, kMaxPos - 1);
  std::vector<int32_t> pos(static_cast<size_t>(c.T));
  for (auto& p : pos) p = pos_dist(rng);
  // Strided q: the reference takes contiguous rows, so it gets the compacted copy.
  const std::vector<bf16_t> q = random_rows_bf16(c.T, c.q_row_stride, rng);
  std::vector<bf16_t> q_dense(static_cast<size_t>(c.T) * c.H * 512);
  for (int t = 0; t < c.T; ++t)
    std::memcpy(q_dense.data() + static_cast<size_t>(t) * c.H * 512, q.data() + static_cast<size_t>(t) * c.q_row_stride,
                static_cast<size_t>(c.H) * 512 * sizeof(bf16_t));
  const size_t pad_elems = static_cast<size_t>(c.T) * c.H_pad * 512;
  std::vector<bf16_t> want = poisoned_host<bf16_t>(pad_elems);
  ref::q_rope_store(q_dense.data(), c.T, c.H, pos.data(), main_table().data(), kMaxPos, want.data(), c.H_pad);

  DeviceBuffer<bf16_t> d_staging = to_device(q, s);
  DeviceBuffer<bf16_t> d_q(q.size());
  DeviceBuffer<int32_t> d_pos = to_device(pos, s);
  DeviceBuffer<float> d_table = to_device(main_table(), s);
  DeviceErrorCounter errors;
  std::vector<bf16_t> got_by_mode[2];
  for (Mode m : kModes) {
    SCOPED_TRACE(mode_name(m));
    DeviceBuffer<bf16_t> d_q_pad = poisoned<bf16_t>(pad_elems, s);
    feed_input(m, d_staging.get(), d_q.get(), q.size() * sizeof(bf16_t), s);
    kn::QRopeStoreParams p;
    p.q = d_q.get();
    p.q_row_stride = c.q_row_stride;
    p.q_pad = d_q_pad.get();
    p.q_pad_row_stride = static_cast<int64_t>(c.H_pad) * 512;
    p.pos = d_pos.get();
    p.table = d_table.get();
    p.max_pos = kMaxPos;
    p.T = c.T;
    p.H = c.H;
    p.H_pad = c.H_pad;
    p.err_count = errors.get();
    kn::run_q_rope_store(p, s, m == Mode::kPdl);
    std::vector<bf16_t> got = to_host(d_q_pad, s);
    EXPECT_TRUE(same_bytes(want, got));
    EXPECT_TRUE(same_bytes(q, to_host(d_q, s))) << "q must not be modified";
    got_by_mode[m == Mode::kPdl] = std::move(got);
  }
  EXPECT_TRUE(same_bytes(got_by_mode[0], got_by_mode[1])) << "pdl on and off differ";
  EXPECT_EQ(errors.read(s), 0u);
  // Padding heads: never written (still poison), checked explicitly besides the whole-buffer match.
  const std::vector<bf16_t>& got = got_by_mode[0];
  for (int t = 0; t < c.T; ++t)
    for (size_t i = static_cast<size_t>(t * c.H_pad + c.H) * 512; i < static_cast<size_t>(t + 1) * c.H_pad * 512; ++i)
      ASSERT_EQ(got[i], 0xABABu) << "padding head written at row " << t;
}

TEST_F(GpuQRopeStore, MatchesReferenceAllRowCounts) {
  for (int T : kTs) {
    check_q_rope_store({T, 64, 64, 64 * 512}, stream_, rng_);
    check_q_rope_store({T, 61, 64, 61 * 512}, stream_, rng_);  // odd head count: half-used last CTA
  }
}

TEST_F(GpuQRopeStore, StridedRowsAndSmallHeadCounts) {
  check_q_rope_store({6, 3, 8, 3 * 512 + 64}, stream_, rng_);
  check_q_rope_store({48, 1, 16, 4 * 512}, stream_, rng_);
  check_q_rope_store({1, 64, 72, 64 * 512 + 8}, stream_, rng_);
}

// A position outside the table (refused by the host reference) is contained on the device: the
// row is skipped (still poison) and counted once.
TEST_F(GpuQRopeStore, BadPositionSkippedAndCounted) {
  const int T = 6, H = 4;
  std::vector<int32_t> pos = {5, kMaxPos, 17, 0, kMaxPos - 1, 300};
  const std::vector<bf16_t> q = random_rows_bf16(T, H * 512, rng_);
  std::vector<int32_t> pos_ok = pos;
  pos_ok[1] = 0;
  std::vector<bf16_t> want = poisoned_host<bf16_t>(q.size());
  ref::q_rope_store(q.data(), T, H, pos_ok.data(), main_table().data(), kMaxPos, want.data(), H);
  std::memset(want.data() + H * 512, kPoison, H * 512 * sizeof(bf16_t));  // row 1 stays poison

  DeviceBuffer<bf16_t> d_q = to_device(q, stream_);
  DeviceBuffer<int32_t> d_pos = to_device(pos, stream_);
  DeviceBuffer<float> d_table = to_device(main_table(), stream_);
  DeviceBuffer<bf16_t> d_q_pad = poisoned<bf16_t>(q.size(), stream_);
  DeviceErrorCounter errors;
  kn::QRopeStoreParams p;
  p.q = d_q.get();
  p.q_row_stride = H * 512;
  p.q_pad = d_q_pad.get();
  p.q_pad_row_stride = H * 512;
  p.pos = d_pos.get();
  p.table = d_table.get();
  p.max_pos = kMaxPos;
  p.T = T;
  p.H = H;
  p.H_pad = H;
  p.err_count = errors.get();
  kn::run_q_rope_store(p, stream_, false);
  EXPECT_TRUE(same_bytes(want, to_host(d_q_pad, stream_)));
  EXPECT_EQ(errors.read(stream_), 1u);
  errors.reset(stream_);
  EXPECT_EQ(errors.read(stream_), 0u);
}

// Captured into a CUDA graph behind the late producer (a PDL edge), replayed with new q and new
// positions written into the graph's input buffers between replays.
TEST_F(GpuQRopeStore, CudaGraphReplayWithNewInputs) {
  const int T = 8, H = 64, H_pad = 64;
  const size_t elems = static_cast<size_t>(T) * H * 512;
  DeviceBuffer<bf16_t> d_staging(elems), d_q(elems), d_q_pad(elems);
  DeviceBuffer<int32_t> d_pos(T);
  DeviceBuffer<float> d_table = to_device(main_table(), stream_);
  DeviceErrorCounter errors;
  sync();

  kn::QRopeStoreParams p;
  p.q = d_q.get();
  p.q_row_stride = H * 512;
  p.q_pad = d_q_pad.get();
  p.q_pad_row_stride = H_pad * 512;
  p.pos = d_pos.get();
  p.table = d_table.get();
  p.max_pos = kMaxPos;
  p.T = T;
  p.H = H;
  p.H_pad = H_pad;
  p.err_count = errors.get();

  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  V4_CUDA_CHECK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
  feed_input(Mode::kPdl, d_staging.get(), d_q.get(), elems * sizeof(bf16_t), stream_);
  kn::run_q_rope_store(p, stream_, true);
  V4_CUDA_CHECK(cudaStreamEndCapture(stream_, &graph));
  V4_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));

  std::uniform_int_distribution<int32_t> pos_dist(0, kMaxPos - 1);
  for (int replay = 0; replay < 3; ++replay) {
    SCOPED_TRACE("replay " + std::to_string(replay));
    const std::vector<bf16_t> q = random_rows_bf16(T, H * 512, rng_);
    std::vector<int32_t> pos(T);
    for (auto& x : pos) x = pos_dist(rng_);
    std::vector<bf16_t> want = poisoned_host<bf16_t>(elems);
    ref::q_rope_store(q.data(), T, H, pos.data(), main_table().data(), kMaxPos, want.data(), H_pad);
    d_staging.upload(q.data(), q.size(), stream_);
    d_pos.upload(pos.data(), pos.size(), stream_);
    d_q_pad.fill_bytes(kPoison, stream_);
    V4_CUDA_CHECK(cudaGraphLaunch(exec, stream_));
    EXPECT_TRUE(same_bytes(want, to_host(d_q_pad, stream_)));
  }
  EXPECT_EQ(errors.read(stream_), 0u);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
}

// =====================================================================================================
// window-K
// =====================================================================================================
// Runs window_k_store on a batch in both modes against the reference; `swa_loc` overrides the
// metadata's slots (for the out-of-range case); returns nothing, asserts inside.
void check_window_k(CacheKind kind, const Batch& b, const std::vector<int32_t>& swa_loc, int64_t expect_skipped,
                    cudaStream_t s, std::mt19937_64& rng) {
  const int T = b.meta.rows;
  SCOPED_TRACE("window kind " + std::to_string(static_cast<int>(kind)) + " T " + std::to_string(T));
  const CacheLayout layout = cache_layout(kind);
  const int64_t n_slots = b.pool.window_pool_slots();
  const size_t cache_bytes = static_cast<size_t>(layout.pool_bytes(n_slots));
  const std::vector<bf16_t> qa = random_rows_bf16(T, kQaWidth, rng);
  const std::vector<float> kv_norm = random_norm_weight(512, rng);

  std::vector<uint8_t> want = poisoned_host<uint8_t>(cache_bytes);
  const int64_t skipped = ref::window_k_store(qa.data() + kKvColumn, T, kQaWidth, kv_norm.data(), kEps, b.meta.pos.data(),
                                              main_table().data(), kMaxPos, swa_loc.data(), kind, layout, want.data(),
                                              n_slots);
  EXPECT_EQ(skipped, expect_skipped);

  DeviceBuffer<bf16_t> d_staging = to_device(qa, s);
  DeviceBuffer<bf16_t> d_qa(qa.size());
  DeviceBuffer<float> d_norm = to_device(kv_norm, s);
  DeviceBuffer<int32_t> d_pos = to_device(b.meta.pos, s);
  DeviceBuffer<int32_t> d_loc = to_device(swa_loc, s);
  DeviceBuffer<float> d_table = to_device(main_table(), s);
  std::vector<uint8_t> got_by_mode[2];
  for (Mode m : kModes) {
    SCOPED_TRACE(mode_name(m));
    DeviceErrorCounter errors;
    DeviceBuffer<uint8_t> d_cache = poisoned<uint8_t>(cache_bytes, s);
    feed_input(m, d_staging.get(), d_qa.get(), qa.size() * sizeof(bf16_t), s);
    kn::WindowKStoreParams p;
    p.kv = d_qa.get() + kKvColumn;
    p.kv_row_stride = kQaWidth;
    p.kv_norm = d_norm.get();
    p.eps = kEps;
    p.pos = d_pos.get();
    p.table = d_table.get();
    p.max_pos = kMaxPos;
    p.swa_loc = d_loc.get();
    p.kind = kind;
    p.layout = layout;
    p.cache = d_cache.get();
    p.n_slots = n_slots;
    p.T = T;
    p.err_count = errors.get();
    kn::run_window_k_store(p, s, m == Mode::kPdl);
    got_by_mode[m == Mode::kPdl] = to_host(d_cache, s);
    EXPECT_TRUE(same_bytes(want, got_by_mode[m == Mode::kPdl]));
    EXPECT_EQ(errors.read(s), static_cast<unsigned long long>(expect_skipped));
  }
  EXPECT_TRUE(same_bytes(got_by_mode[0], got_by_mode[1])) << "pdl on and off differ";
}

TEST_F(GpuWindowK, MatchesReferenceBothLayouts) {
  for (CacheKind kind : {CacheKind::kWindowV41, CacheKind::kWindowV4})
    for (int T : kTs) {
      const Batch b = make_batch(T, rng_);
      check_window_k(kind, b, b.meta.swa_loc, 0, stream_, rng_);
    }
}

TEST_F(GpuWindowK, OutOfRangeSlotSkippedAndCounted) {
  for (CacheKind kind : {CacheKind::kWindowV41, CacheKind::kWindowV4}) {
    const Batch b = make_batch(8, rng_);
    std::vector<int32_t> loc = b.meta.swa_loc;
    loc[0] = static_cast<int32_t>(b.pool.window_pool_slots());         // first slot past the pool
    loc[3] = static_cast<int32_t>(b.pool.window_pool_slots()) + 4321;  // far past it
    check_window_k(kind, b, loc, 2, stream_, rng_);
  }
}

// =====================================================================================================
// c1 fused
// =====================================================================================================
void check_c1(const Batch& b, const std::vector<int32_t>& out_loc, int64_t expect_skipped, cudaStream_t s,
              std::mt19937_64& rng) {
  const int N = b.meta.rows;
  SCOPED_TRACE("c1 N " + std::to_string(N));
  const CacheLayout layout = cache_layout(CacheKind::kCompressedFp4);
  const int64_t n_slots = compressed_slots(b.pool, 1);
  const size_t cache_bytes = static_cast<size_t>(layout.pool_bytes(n_slots));
  const std::vector<bf16_t> proj = random_rows_bf16(N, 512, rng);
  const std::vector<float> c_norm = random_norm_weight(512, rng);

  std::vector<uint8_t> want_cache = poisoned_host<uint8_t>(cache_bytes);
  std::vector<bf16_t> want_latent = poisoned_host<bf16_t>(static_cast<size_t>(N) * 512);
  const int64_t skipped = ref::c1_fused(proj.data(), N, c_norm.data(), kEps, b.meta.pos.data(), compressed_table().data(),
                                        kMaxPos, out_loc.data(), layout, want_cache.data(), n_slots, want_latent.data());
  EXPECT_EQ(skipped, expect_skipped);

  DeviceBuffer<bf16_t> d_staging = to_device(proj, s);
  DeviceBuffer<bf16_t> d_proj(proj.size());
  DeviceBuffer<float> d_norm = to_device(c_norm, s);
  DeviceBuffer<int32_t> d_pos = to_device(b.meta.pos, s);
  DeviceBuffer<int32_t> d_loc = to_device(out_loc, s);
  DeviceBuffer<float> d_table = to_device(compressed_table(), s);
  std::vector<uint8_t> cache_by_mode[2];
  std::vector<bf16_t> latent_by_mode[2];
  for (Mode m : kModes) {
    SCOPED_TRACE(mode_name(m));
    DeviceErrorCounter errors;
    DeviceBuffer<uint8_t> d_cache = poisoned<uint8_t>(cache_bytes, s);
    DeviceBuffer<bf16_t> d_latent = poisoned<bf16_t>(static_cast<size_t>(N) * 512, s);
    feed_input(m, d_staging.get(), d_proj.get(), proj.size() * sizeof(bf16_t), s);
    kn::C1FusedParams p;
    p.proj = d_proj.get();
    p.proj_row_stride = 512;
    p.c_norm = d_norm.get();
    p.eps = kEps;
    p.pos = d_pos.get();
    p.table = d_table.get();
    p.max_pos = kMaxPos;
    p.out_loc = d_loc.get();
    p.layout = layout;
    p.cache = d_cache.get();
    p.n_slots = n_slots;
    p.latent_pre_rope = d_latent.get();
    p.latent_row_stride = 512;
    p.N = N;
    p.err_count = errors.get();
    kn::run_c1_fused(p, s, m == Mode::kPdl);
    const int i = m == Mode::kPdl;
    cache_by_mode[i] = to_host(d_cache, s);
    latent_by_mode[i] = to_host(d_latent, s);
    EXPECT_TRUE(same_bytes(want_latent, latent_by_mode[i])) << "latent_pre_rope";
    EXPECT_TRUE(same_bytes(want_cache, cache_by_mode[i])) << "compressed cache";
    EXPECT_EQ(errors.read(s), static_cast<unsigned long long>(expect_skipped));
  }
  EXPECT_TRUE(same_bytes(cache_by_mode[0], cache_by_mode[1])) << "pdl on and off differ";
  EXPECT_TRUE(same_bytes(latent_by_mode[0], latent_by_mode[1])) << "pdl on and off differ";
}

TEST_F(GpuC1Fused, MatchesReferenceDecodeAndVerify) {
  for (int T : kTs) {
    const Batch b = make_batch(T, rng_);
    check_c1(b, b.meta.c_out_loc[1], 0, stream_, rng_);
  }
}

TEST_F(GpuC1Fused, OutOfRangeSlotSkippedAndCounted) {
  const Batch b = make_batch(8, rng_);
  std::vector<int32_t> loc = b.meta.c_out_loc[1];
  loc[1] = static_cast<int32_t>(compressed_slots(b.pool, 1));
  loc[4] = static_cast<int32_t>(compressed_slots(b.pool, 1)) + 999;
  check_c1(b, loc, 2, stream_, rng_);
}

// =====================================================================================================
// c2 fused
// =====================================================================================================
// Device-side state of one ratio-2 compressor (pair state and compressed cache), carried across
// steps next to the host copies.
struct C2State {
  int64_t state_rows = 0, n_slots = 0;
  CacheLayout layout = cache_layout(CacheKind::kCompressedFp4);
  std::vector<float> state;      // host reference state
  std::vector<uint8_t> cache;    // host reference cache
  DeviceBuffer<float> d_state;
  DeviceBuffer<uint8_t> d_cache;
};
C2State make_c2_state(const RequestPool& pool, bool random_state, std::mt19937_64& rng, cudaStream_t s) {
  C2State st;
  st.state_rows = static_cast<int64_t>(pool.n_requests) * pool.pair_ring;
  st.n_slots = compressed_slots(pool, 2);
  st.state.assign(static_cast<size_t>(st.state_rows * 1024), 0.0f);
  ref::pair_state_init(st.state.data(), st.state_rows);
  if (random_state) st.state = random_kvs(st.state_rows, rng);  // arbitrary parked partners
  st.cache = poisoned_host<uint8_t>(static_cast<size_t>(st.layout.pool_bytes(st.n_slots)));
  st.d_state = to_device(st.state, s);
  st.d_cache = to_device(st.cache, s);
  return st;
}

// One c2 step on both sides; compares latent, state and cache bytes afterwards.
void c2_step(C2State& st, const StepMeta& meta, const std::vector<int32_t>& out_loc, int64_t expect_skipped, Mode m,
             const std::vector<float>& c_norm, cudaStream_t s, std::mt19937_64& rng) {
  const int N = meta.rows;
  SCOPED_TRACE(std::string("c2 N ") + std::to_string(N) + " " + mode_name(m));
  const std::vector<float> kvs = random_kvs(N, rng);
  std::vector<bf16_t> want_latent = poisoned_host<bf16_t>(static_cast<size_t>(N) * 512);
  const int64_t skipped = ref::c2_fused(kvs.data(), N, meta.pos.data(), meta.pair_state_row.data(),
                                        meta.pair_partner_state_row.data(), meta.pair_prev_row.data(), st.state.data(),
                                        st.state_rows, c_norm.data(), kEps, compressed_table().data(), kMaxPos,
                                        out_loc.data(), st.layout, st.cache.data(), st.n_slots, want_latent.data());
  EXPECT_EQ(skipped, expect_skipped);

  DeviceBuffer<float> d_staging = to_device(kvs, s);
  DeviceBuffer<float> d_kvs(kvs.size());
  DeviceBuffer<int32_t> d_pos = to_device(meta.pos, s);
  DeviceBuffer<int32_t> d_srow = to_device(meta.pair_state_row, s);
  DeviceBuffer<int32_t> d_partner = to_device(meta.pair_partner_state_row, s);
  DeviceBuffer<int32_t> d_prev = to_device(meta.pair_prev_row, s);
  DeviceBuffer<int32_t> d_loc = to_device(out_loc, s);
  DeviceBuffer<float> d_norm = to_device(c_norm, s);
  DeviceBuffer<float> d_table = to_device(compressed_table(), s);
  DeviceBuffer<bf16_t> d_latent = poisoned<bf16_t>(static_cast<size_t>(N) * 512, s);
  DeviceErrorCounter errors;
  feed_input(m, d_staging.get(), d_kvs.get(), kvs.size() * sizeof(float), s);
  kn::C2FusedParams p;
  p.kvs = d_kvs.get();
  p.kvs_row_stride = 1024;
  p.pos = d_pos.get();
  p.state_row = d_srow.get();
  p.partner_state_row = d_partner.get();
  p.prev_row = d_prev.get();
  p.state = st.d_state.get();
  p.state_rows = st.state_rows;
  p.c_norm = d_norm.get();
  p.eps = kEps;
  p.table = d_table.get();
  p.max_pos = kMaxPos;
  p.out_loc = d_loc.get();
  p.layout = st.layout;
  p.cache = st.d_cache.get();
  p.n_slots = st.n_slots;
  p.latent_pre_rope = d_latent.get();
  p.latent_row_stride = 512;
  p.N = N;
  p.err_count = errors.get();
  kn::run_c2_fused(p, s, m == Mode::kPdl);
  EXPECT_TRUE(same_bytes(want_latent, to_host(d_latent, s))) << "latent_pre_rope";
  EXPECT_TRUE(same_bytes(st.state, to_host(st.d_state, s))) << "pair state";
  EXPECT_TRUE(same_bytes(st.cache, to_host(st.d_cache, s))) << "compressed cache";
  EXPECT_EQ(errors.read(s), static_cast<unsigned long long>(expect_skipped));
}

TEST_F(GpuC2Fused, MatchesReferenceDecodeAndVerify) {
  const std::vector<float> c_norm = random_norm_weight(512, rng_);
  for (int T : kTs) {
    const Batch b = make_batch(T, rng_);
    // pdl on and off from the same starting state: both must match the reference (and so each other).
    for (Mode m : kModes) {
      std::mt19937_64 rng_step(1000 + T);  // same kvs and state for both modes
      C2State st = make_c2_state(b.pool, true, rng_step, stream_);
      c2_step(st, b.meta, b.meta.c_out_loc[2], 0, m, c_norm, stream_, rng_step);
    }
  }
}

TEST_F(GpuC2Fused, OutOfRangeSlotSkippedAndCounted) {
  const std::vector<float> c_norm = random_norm_weight(512, rng_);
  const Batch b = make_batch(8, rng_);
  C2State st = make_c2_state(b.pool, true, rng_, stream_);
  std::vector<int32_t> loc = b.meta.c_out_loc[2];
  int set = 0;
  for (int t = 0; t < b.meta.rows && set < 2; ++t)
    if (loc[t] > 0) loc[t] = static_cast<int32_t>(st.n_slots) + 77 * set++;  // completing rows only
  ASSERT_EQ(set, 2);
  c2_step(st, b.meta, loc, 2, Mode::kPlain, c_norm, stream_, rng_);
}

// A sequence of decode steps and verify blocks (with padded rows) on 3 requests: the pair state
// and the compressed cache are carried on the GPU and on the CPU side by side; both compared after
// every step. Odd first rows read partners parked by earlier steps.
TEST_F(GpuC2Fused, MultiStepSequenceCarriesState) {
  const std::vector<float> c_norm = random_norm_weight(512, rng_);
  const RequestPool pool = make_request_pool(3, kMaxContext, 6, 128);
  C2State st = make_c2_state(pool, false, rng_, stream_);  // initial state: kv 0, score -inf
  std::vector<int32_t> ctx = {0, 5, 122};
  std::uniform_int_distribution<int> accept(1, 6);
  const bool verify_step[] = {false, true, true, false, true, false, false, true, true, false, true, true};
  int step = 0;
  for (bool verify : verify_step) {
    SCOPED_TRACE("step " + std::to_string(step) + (verify ? " verify" : " decode"));
    const BatchDesc batch = verify ? make_verify_batch(ctx, 6, 20) : make_decode_batch(ctx, 4);
    const StepMeta meta = build_step_meta(batch, pool, kMaxPos);
    c2_step(st, meta, meta.c_out_loc[2], 0, step % 2 ? Mode::kPdl : Mode::kPlain, c_norm, stream_, rng_);
    for (auto& c : ctx) c += verify ? accept(rng_) : 1;
    ++step;
  }
}

// =====================================================================================================
// index-K
// =====================================================================================================
void check_index_k(const Batch& b, int ratio, const std::vector<int32_t>& out_loc, int64_t expect_skipped,
                   cudaStream_t s, std::mt19937_64& rng) {
  const int N = b.meta.rows;
  SCOPED_TRACE("index-K N " + std::to_string(N) + " ratio " + std::to_string(ratio));
  const CacheLayout layout = cache_layout(CacheKind::kIndexK);
  const int64_t n_slots = compressed_slots(b.pool, ratio);
  const size_t cache_bytes = static_cast<size_t>(layout.pool_bytes(n_slots));
  const std::vector<bf16_t> kproj = random_rows_bf16(N, 128, rng);
  const std::vector<float> k_norm = random_norm_weight(128, rng);
  std::vector<int32_t> g(static_cast<size_t>(N));
  for (int t = 0; t < N; ++t) g[t] = std::max(b.meta.pos[t] - (ratio - 1), 0);  // completing rows: pos + 1 - r

  std::vector<uint8_t> want = poisoned_host<uint8_t>(cache_bytes);
  const int64_t skipped = ref::index_k_store(kproj.data(), N, k_norm.data(), kEps, g.data(), compressed_table().data(),
                                             kMaxPos, out_loc.data(), layout, want.data(), n_slots);
  EXPECT_EQ(skipped, expect_skipped);

  DeviceBuffer<bf16_t> d_staging = to_device(kproj, s);
  DeviceBuffer<bf16_t> d_kproj(kproj.size());
  DeviceBuffer<float> d_norm = to_device(k_norm, s);
  DeviceBuffer<int32_t> d_g = to_device(g, s);
  DeviceBuffer<int32_t> d_loc = to_device(out_loc, s);
  DeviceBuffer<float> d_table = to_device(compressed_table(), s);
  std::vector<uint8_t> got_by_mode[2];
  for (Mode m : kModes) {
    SCOPED_TRACE(mode_name(m));
    DeviceErrorCounter errors;
    DeviceBuffer<uint8_t> d_cache = poisoned<uint8_t>(cache_bytes, s);
    // kproj is N x 256 bytes: a multiple of 16, as the late producer needs.
    feed_input(m, d_staging.get(), d_kproj.get(), kproj.size() * sizeof(bf16_t), s);
    kn::IndexKStoreParams p;
    p.kproj = d_kproj.get();
    p.kproj_row_stride = 128;
    p.k_norm = d_norm.get();
    p.eps = kEps;
    p.g = d_g.get();
    p.table = d_table.get();
    p.max_pos = kMaxPos;
    p.out_loc = d_loc.get();
    p.layout = layout;
    p.cache = d_cache.get();
    p.n_slots = n_slots;
    p.N = N;
    p.err_count = errors.get();
    kn::run_index_k_store(p, s, m == Mode::kPdl);
    got_by_mode[m == Mode::kPdl] = to_host(d_cache, s);
    EXPECT_TRUE(same_bytes(want, got_by_mode[m == Mode::kPdl]));
    EXPECT_EQ(errors.read(s), static_cast<unsigned long long>(expect_skipped));
  }
  EXPECT_TRUE(same_bytes(got_by_mode[0], got_by_mode[1])) << "pdl on and off differ";
}

TEST_F(GpuIndexK, MatchesReferenceBothRatios) {
  for (int ratio : {1, 2})
    for (int T : kTs) {
      const Batch b = make_batch(T, rng_);
      check_index_k(b, ratio, b.meta.c_out_loc[ratio], 0, stream_, rng_);
    }
}

// =====================================================================================================
// c2 + wk + index-K, fused (run_c2_index_fused) against the three launches it replaces
// =====================================================================================================
// Both sides start from the same state, poisoned latent / caches / kproj and a stale latent row
// (rows c2 does not complete keep an earlier step's latent, which the wk GEMM still reads), then
// every buffer is compared byte for byte: latent, pair state, compressed cache, index-K cache,
// the kproj rows that store an index key, and the error count. loc_kv / loc_ik: the two caches'
// slots (the stack passes the same array to both; separate here to reach each error path).
// Returns how many rows stored an index key (so that the callers can see the GEMM part ran).
// ratio 2: c2 (kvs and the pair state in), g = pos - 1; ratio 1: c1 (proj in), g = pos.
int index_fused_case(int ratio, const Batch& b, const std::vector<int32_t>& loc_kv, const std::vector<int32_t>& loc_ik,
                     Mode m, cudaStream_t s, std::mt19937_64& rng) {
  const int N = b.meta.rows;
  SCOPED_TRACE(std::string(ratio == 2 ? "c2" : "c1") + " + index-K N " + std::to_string(N) + " " + mode_name(m));
  const std::vector<float> kvs = random_kvs(N, rng);
  const std::vector<bf16_t> proj = random_rows_bf16(N, 512, rng);
  const std::vector<float> c_norm = random_norm_weight(512, rng), k_norm = random_norm_weight(128, rng);
  const std::vector<bf16_t> wk = random_rows_bf16(128, 512, rng);
  const std::vector<bf16_t> stale = random_rows_bf16(N, 512, rng);  // the latent buffer before the step
  const int64_t state_rows = static_cast<int64_t>(b.pool.n_requests) * b.pool.pair_ring;
  const std::vector<float> state = random_kvs(state_rows, rng);
  const CacheLayout kv_layout = cache_layout(CacheKind::kCompressedFp4), ik_layout = cache_layout(CacheKind::kIndexK);
  const int64_t n_slots = compressed_slots(b.pool, ratio);
  std::vector<int32_t> g(static_cast<size_t>(N));
  for (int t = 0; t < N; ++t) g[t] = std::max(b.meta.pos[t] - (ratio - 1), 0);

  DeviceBuffer<bf16_t> d_proj_staging = to_device(proj, s);
  DeviceBuffer<float> d_staging = to_device(kvs, s), d_norm = to_device(c_norm, s), d_knorm = to_device(k_norm, s);
  DeviceBuffer<float> d_table = to_device(compressed_table(), s);
  DeviceBuffer<bf16_t> d_wk = to_device(wk, s);
  DeviceBuffer<int32_t> d_pos = to_device(b.meta.pos, s), d_srow = to_device(b.meta.pair_state_row, s);
  DeviceBuffer<int32_t> d_partner = to_device(b.meta.pair_partner_state_row, s), d_prev = to_device(b.meta.pair_prev_row, s);
  DeviceBuffer<int32_t> d_loc_kv = to_device(loc_kv, s), d_loc_ik = to_device(loc_ik, s), d_g = to_device(g, s);
  struct Side {
    DeviceBuffer<float> kvs, state;
    DeviceBuffer<bf16_t> proj, latent, kproj;
    DeviceBuffer<uint8_t> kv_cache, ik_cache;
    DeviceErrorCounter errors;
  };
  Side side[2];  // 0: the three launches, 1: fused
  for (int f = 0; f < 2; ++f) {
    Side& d = side[f];
    d.kvs = DeviceBuffer<float>(kvs.size());
    d.proj = DeviceBuffer<bf16_t>(proj.size());
    d.state = to_device(state, s);
    d.latent = to_device(stale, s);
    d.kproj = poisoned<bf16_t>(static_cast<size_t>(N) * 128, s);
    d.kv_cache = poisoned<uint8_t>(static_cast<size_t>(kv_layout.pool_bytes(n_slots)), s);
    d.ik_cache = poisoned<uint8_t>(static_cast<size_t>(ik_layout.pool_bytes(n_slots)), s);
    if (ratio == 2) feed_input(m, d_staging.get(), d.kvs.get(), kvs.size() * sizeof(float), s);
    else feed_input(m, d_proj_staging.get(), d.proj.get(), proj.size() * sizeof(bf16_t), s);
    kn::C1FusedParams c1;
    c1.proj = d.proj.get();
    c1.proj_row_stride = 512;
    c1.c_norm = d_norm.get();
    c1.eps = kEps;
    c1.pos = d_pos.get();
    c1.table = d_table.get();
    c1.max_pos = kMaxPos;
    c1.out_loc = d_loc_kv.get();
    c1.layout = kv_layout;
    c1.cache = d.kv_cache.get();
    c1.n_slots = n_slots;
    c1.latent_pre_rope = d.latent.get();
    c1.latent_row_stride = 512;
    c1.N = N;
    c1.err_count = d.errors.get();
    kn::C2FusedParams c;
    c.kvs = d.kvs.get();
    c.kvs_row_stride = 1024;
    c.pos = d_pos.get();
    c.state_row = d_srow.get();
    c.partner_state_row = d_partner.get();
    c.prev_row = d_prev.get();
    c.state = d.state.get();
    c.state_rows = state_rows;
    c.c_norm = d_norm.get();
    c.eps = kEps;
    c.table = d_table.get();
    c.max_pos = kMaxPos;
    c.out_loc = d_loc_kv.get();
    c.layout = kv_layout;
    c.cache = d.kv_cache.get();
    c.n_slots = n_slots;
    c.latent_pre_rope = d.latent.get();
    c.latent_row_stride = 512;
    c.N = N;
    c.err_count = d.errors.get();
    kn::IndexKStoreParams k;
    k.kproj = d.kproj.get();
    k.kproj_row_stride = 128;
    k.k_norm = d_knorm.get();
    k.eps = kEps;
    k.g = d_g.get();
    k.table = d_table.get();
    k.max_pos = kMaxPos;
    k.out_loc = d_loc_ik.get();
    k.layout = ik_layout;
    k.cache = d.ik_cache.get();
    k.n_slots = n_slots;
    k.N = N;
    k.err_count = d.errors.get();
    if (f == 0) {
      if (ratio == 2) kn::run_c2_fused(c, s, m == Mode::kPdl);
      else kn::run_c1_fused(c1, s, m == Mode::kPdl);
      kn::Bf16GemmParams w;
      w.x = d.latent.get();
      w.x_stride = 512;
      w.w = d_wk.get();
      w.out = d.kproj.get();
      w.out_stride = 128;
      w.m = N;
      w.n = 128;
      w.k = 512;
      kn::run_gemm_bf16(w, kn::GemmWorkspace{}, kn::GemmVersion::kSkinny, s, m == Mode::kPdl);
      kn::run_index_k_store(k, s, m == Mode::kPdl);
    } else if (ratio == 2) {
      kn::C2IndexFusedParams p;
      p.c2 = c;
      p.wk = d_wk.get();
      p.ik = k;
      kn::run_c2_index_fused(p, s, m == Mode::kPdl);
    } else {
      kn::C1IndexFusedParams p;
      p.c1 = c1;
      p.wk = d_wk.get();
      p.ik = k;
      kn::run_c1_index_fused(p, s, m == Mode::kPdl);
    }
  }
  EXPECT_TRUE(same_bytes(to_host(side[0].latent, s), to_host(side[1].latent, s))) << "latent_pre_rope";
  EXPECT_TRUE(same_bytes(to_host(side[0].state, s), to_host(side[1].state, s))) << "pair state";
  EXPECT_TRUE(same_bytes(to_host(side[0].kv_cache, s), to_host(side[1].kv_cache, s))) << "compressed cache";
  const std::vector<uint8_t> ik0 = to_host(side[0].ik_cache, s), ik1 = to_host(side[1].ik_cache, s);
  EXPECT_TRUE(same_bytes(ik0, ik1)) << "index-K cache";
  const std::vector<bf16_t> kp0 = to_host(side[0].kproj, s), kp1 = to_host(side[1].kproj, s);
  int stored = 0;
  for (int t = 0; t < N; ++t) {
    if (loc_ik[t] <= 0 || loc_ik[t] >= n_slots || g[t] >= kMaxPos) continue;
    ++stored;
    EXPECT_EQ(0, std::memcmp(&kp0[static_cast<size_t>(t) * 128], &kp1[static_cast<size_t>(t) * 128], 256)) << "kproj row " << t;
  }
  EXPECT_EQ(side[0].errors.read(s), side[1].errors.read(s));
  return stored;
}

TEST_F(GpuIndexK, FusedWithCompressorMatchesThreeLaunches) {
  // One decode row and verify batches of 6, 8, 48, 64, both ratios.
  for (int ratio : {2, 1}) {
    int stored = 0;
    for (int T : kTs)
      for (Mode m : kModes) {
        const Batch b = make_batch(T, rng_);
        stored += index_fused_case(ratio, b, b.meta.c_out_loc[ratio], b.meta.c_out_loc[ratio], m, stream_, rng_);
      }
    EXPECT_GT(stored, 0) << "ratio " << ratio << ": no row stored an index key: the fused GEMM part went untested";
  }
  // Every row storing an index key, completing or not (rows c2 skips read an earlier step's latent),
  // and each cache's out-of-range slot on its own (both count once per row, fused or not).
  const Batch b = make_batch(48, rng_);
  const int64_t n_slots = compressed_slots(b.pool, 2);
  std::vector<int32_t> every(static_cast<size_t>(b.meta.rows));
  for (int t = 0; t < b.meta.rows; ++t) every[t] = 1 + t;
  for (int ratio : {2, 1}) EXPECT_GE(index_fused_case(ratio, b, b.meta.c_out_loc[ratio], every, Mode::kPlain, stream_, rng_), 40);
  std::vector<int32_t> bad_kv = b.meta.c_out_loc[2], bad_ik = b.meta.c_out_loc[2];
  int set = 0;
  for (int t = 0; t < b.meta.rows && set < 2; ++t)
    if (bad_kv[t] > 0) (set++ == 0 ? bad_kv : bad_ik)[t] = static_cast<int32_t>(n_slots) + 5;
  ASSERT_EQ(set, 2);
  index_fused_case(2, b, bad_kv, bad_ik, Mode::kPdl, stream_, rng_);
  std::vector<int32_t> bad_kv1 = b.meta.c_out_loc[1], bad_ik1 = b.meta.c_out_loc[1];
  bad_kv1[1] = static_cast<int32_t>(compressed_slots(b.pool, 1)) + 3;
  bad_ik1[4] = static_cast<int32_t>(compressed_slots(b.pool, 1)) + 9;
  index_fused_case(1, b, bad_kv1, bad_ik1, Mode::kPdl, stream_, rng_);
}

// The fused launcher's own refusals (the c2 and index-K checks are the unfused launchers').
TEST(GpuIndexKHost, FusedRefusesMismatchedRows) {
  kn::C2IndexFusedParams p;
  p.c2.N = 4;
  p.ik.N = 3;
  EXPECT_THROW(kn::run_c2_index_fused(p, nullptr, false), std::invalid_argument);
  p.ik.N = 0;
  p.c2.N = 0;
  p.ik.kproj_row_stride = 64;  // < 128
  EXPECT_THROW(kn::run_c2_index_fused(p, nullptr, false), std::invalid_argument);
  kn::C1IndexFusedParams q;
  q.c1.N = 2;
  q.ik.N = 5;
  EXPECT_THROW(kn::run_c1_index_fused(q, nullptr, false), std::invalid_argument);
}

TEST_F(GpuIndexK, OutOfRangeSlotSkippedAndCounted) {
  const Batch b = make_batch(8, rng_);
  std::vector<int32_t> loc = b.meta.c_out_loc[1];
  loc[2] = static_cast<int32_t>(compressed_slots(b.pool, 1));
  loc[5] = static_cast<int32_t>(compressed_slots(b.pool, 1)) + 31;
  check_index_k(b, 1, loc, 2, stream_, rng_);
}

// =====================================================================================================
// host API: bad shapes and pointers are refused before any launch. Runs without a GPU too (then the
// pointers are fake and the valid baseline fails at the launch with a CudaError, never earlier).
// =====================================================================================================
class ApiScratch {
 public:
  ApiScratch() : gpu_(gpu_available()) {
    if (gpu_) {
      V4_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
      buf_.resize(kRegions * kRegionBytes);
      buf_.fill_bytes(0, stream_);  // zero metadata is valid: pos 0, slot 0, state row 0
      V4_CUDA_CHECK(cudaStreamSynchronize(stream_));
      base_ = reinterpret_cast<uintptr_t>(buf_.get());
    } else {
      base_ = uintptr_t{1} << 32;  // never dereferenced: every call below fails before or at launch
    }
  }
  ~ApiScratch() {
    if (stream_) cudaStreamDestroy(stream_);
  }
  template <class T>
  T* region(int i) const {
    return reinterpret_cast<T*>(base_ + static_cast<uintptr_t>(i) * kRegionBytes);
  }
  // A valid call is accepted: it runs on a GPU; without one it gets as far as the launch.
  void expect_accepted(const std::function<void(cudaStream_t)>& call, const char* what) const {
    if (gpu_) {
      EXPECT_NO_THROW(call(stream_)) << what;
      V4_CUDA_CHECK(cudaStreamSynchronize(stream_));
      return;
    }
    try {
      call(stream_);
      ADD_FAILURE() << what << ": a launch without a GPU did not fail";
    } catch (const std::invalid_argument& e) {
      ADD_FAILURE() << what << ": valid call refused: " << e.what();
    } catch (const CudaError&) {
    }
  }
  cudaStream_t stream() const { return stream_; }

  static constexpr int kRegions = 16;
  static constexpr size_t kRegionBytes = 256 * 1024;

 private:
  bool gpu_;
  cudaStream_t stream_ = nullptr;
  DeviceBuffer<uint8_t> buf_;
  uintptr_t base_ = 0;
};

template <class P, class Mutate>
void expect_refused(const P& valid, void (*run)(const P&, cudaStream_t, bool), Mutate mutate, const char* what,
                    cudaStream_t s) {
  P bad = valid;
  mutate(bad);
  EXPECT_THROW(run(bad, s, false), std::invalid_argument) << what;
}

TEST(GpuPrepareHostApi, RefusesBadShapesAndPointers) {
  ApiScratch m;
  const cudaStream_t s = m.stream();
  // Regions: 0 activation in, 1 activation out / latent, 2 metadata A, 3 metadata B, 4 metadata C,
  // 5 metadata D, 6 table (row 0 only), 7 norm weights, 8 cache, 9 pair state.
  kn::QRopeStoreParams q;
  q.q = m.region<bf16_t>(0);
  q.q_row_stride = 2 * 512;
  q.q_pad = m.region<bf16_t>(1);
  q.q_pad_row_stride = 3 * 512;
  q.pos = m.region<int32_t>(2);
  q.table = m.region<float>(6);
  q.max_pos = 1;
  q.T = 2;
  q.H = 2;
  q.H_pad = 3;
  m.expect_accepted([&](cudaStream_t st) { kn::run_q_rope_store(q, st, false); }, "q_rope_store baseline");
  using QP = kn::QRopeStoreParams;
  expect_refused(q, kn::run_q_rope_store, [](QP& p) { p.H_pad = 1; }, "H_pad < H", s);
  expect_refused(q, kn::run_q_rope_store, [](QP& p) { p.head_dim = 256; }, "head_dim 256", s);
  expect_refused(q, kn::run_q_rope_store, [](QP& p) { p.head_dim = 576; }, "head_dim 576", s);
  expect_refused(q, kn::run_q_rope_store, [](QP& p) { p.q = nullptr; }, "null q", s);
  expect_refused(q, kn::run_q_rope_store, [](QP& p) { p.q_pad = nullptr; }, "null q_pad", s);
  expect_refused(q, kn::run_q_rope_store, [](QP& p) { p.pos = nullptr; }, "null pos", s);
  expect_refused(q, kn::run_q_rope_store, [](QP& p) { p.table = nullptr; }, "null table", s);
  expect_refused(q, kn::run_q_rope_store, [](QP& p) { p.max_pos = 0; }, "empty table", s);
  expect_refused(q, kn::run_q_rope_store, [](QP& p) { p.q += 1; }, "misaligned q", s);
  expect_refused(q, kn::run_q_rope_store, [](QP& p) { p.q_row_stride = 512; }, "q stride < H * 512", s);
  expect_refused(q, kn::run_q_rope_store, [](QP& p) { p.q_pad_row_stride = 2 * 512; }, "q_pad stride < H_pad * 512", s);
  expect_refused(q, kn::run_q_rope_store, [](QP& p) { p.q_row_stride = 2 * 512 + 4; }, "q stride not a multiple of 8", s);
  expect_refused(q, kn::run_q_rope_store, [](QP& p) { p.T = -1; }, "negative T", s);

  kn::WindowKStoreParams w;
  w.kv = m.region<bf16_t>(0) + kKvColumn;
  w.kv_row_stride = kQaWidth;
  w.kv_norm = m.region<float>(7);
  w.eps = kEps;
  w.pos = m.region<int32_t>(2);
  w.table = m.region<float>(6);
  w.max_pos = 1;
  w.swa_loc = m.region<int32_t>(3);
  w.kind = CacheKind::kWindowV41;
  w.layout = cache_layout(CacheKind::kWindowV41);
  w.cache = m.region<uint8_t>(8);
  w.n_slots = 1;
  w.T = 2;
  m.expect_accepted([&](cudaStream_t st) { kn::run_window_k_store(w, st, false); }, "window_k baseline");
  using WP = kn::WindowKStoreParams;
  expect_refused(w, kn::run_window_k_store, [](WP& p) { p.kind = CacheKind::kWindowV4; }, "layout of another kind", s);
  expect_refused(w, kn::run_window_k_store, [](WP& p) { p.kind = CacheKind::kCompressedFp4; p.layout = cache_layout(CacheKind::kCompressedFp4); }, "not a window kind", s);
  expect_refused(w, kn::run_window_k_store, [](WP& p) { p.layout.page_size = 0; }, "page size 0", s);
  expect_refused(w, kn::run_window_k_store, [](WP& p) { p.n_slots = 0; }, "no slots", s);
  expect_refused(w, kn::run_window_k_store, [](WP& p) { p.cache = nullptr; }, "null cache", s);
  expect_refused(w, kn::run_window_k_store, [](WP& p) { p.kv = nullptr; }, "null kv", s);
  expect_refused(w, kn::run_window_k_store, [](WP& p) { p.kv_norm = nullptr; }, "null kv_norm", s);
  expect_refused(w, kn::run_window_k_store, [](WP& p) { p.swa_loc = nullptr; }, "null swa_loc", s);
  expect_refused(w, kn::run_window_k_store, [](WP& p) { p.kv_row_stride = 500; }, "kv stride < 512", s);
  expect_refused(w, kn::run_window_k_store, [](WP& p) { p.kv += 4; }, "misaligned kv", s);

  kn::C1FusedParams c1;
  c1.proj = m.region<bf16_t>(0);
  c1.proj_row_stride = 512;
  c1.c_norm = m.region<float>(7);
  c1.eps = kEps;
  c1.pos = m.region<int32_t>(2);
  c1.table = m.region<float>(6);
  c1.max_pos = 1;
  c1.out_loc = m.region<int32_t>(3);
  c1.layout = cache_layout(CacheKind::kCompressedFp4);
  c1.cache = m.region<uint8_t>(8);
  c1.n_slots = 1;
  c1.latent_pre_rope = m.region<bf16_t>(1);
  c1.latent_row_stride = 512;
  c1.N = 2;
  m.expect_accepted([&](cudaStream_t st) { kn::run_c1_fused(c1, st, false); }, "c1 baseline");
  using C1P = kn::C1FusedParams;
  expect_refused(c1, kn::run_c1_fused, [](C1P& p) { p.proj = nullptr; }, "null proj", s);
  expect_refused(c1, kn::run_c1_fused, [](C1P& p) { p.latent_pre_rope = nullptr; }, "null latent", s);
  expect_refused(c1, kn::run_c1_fused, [](C1P& p) { p.latent_row_stride = 256; }, "latent stride < 512", s);
  expect_refused(c1, kn::run_c1_fused, [](C1P& p) { p.proj_row_stride = 1020; }, "proj stride not a multiple of 8", s);
  expect_refused(c1, kn::run_c1_fused, [](C1P& p) { p.layout = cache_layout(CacheKind::kWindowV41); }, "window layout", s);
  expect_refused(c1, kn::run_c1_fused, [](C1P& p) { p.out_loc = nullptr; }, "null out_loc", s);
  expect_refused(c1, kn::run_c1_fused, [](C1P& p) { p.c_norm = nullptr; }, "null c_norm", s);
  expect_refused(c1, kn::run_c1_fused, [](C1P& p) { p.N = -3; }, "negative N", s);

  kn::C2FusedParams c2;
  c2.kvs = m.region<float>(0);
  c2.kvs_row_stride = 1024;
  c2.pos = m.region<int32_t>(2);
  c2.state_row = m.region<int32_t>(3);
  c2.partner_state_row = m.region<int32_t>(4);
  c2.prev_row = m.region<int32_t>(5);
  c2.state = m.region<float>(9);
  c2.state_rows = 1;
  c2.c_norm = m.region<float>(7);
  c2.eps = kEps;
  c2.table = m.region<float>(6);
  c2.max_pos = 1;
  c2.out_loc = m.region<int32_t>(3);
  c2.layout = cache_layout(CacheKind::kCompressedFp4);
  c2.cache = m.region<uint8_t>(8);
  c2.n_slots = 1;
  c2.latent_pre_rope = m.region<bf16_t>(1);
  c2.latent_row_stride = 512;
  c2.N = 2;
  m.expect_accepted([&](cudaStream_t st) { kn::run_c2_fused(c2, st, false); }, "c2 baseline");
  using C2P = kn::C2FusedParams;
  expect_refused(c2, kn::run_c2_fused, [](C2P& p) { p.kvs_row_stride = 512; }, "kvs stride < 1024", s);
  expect_refused(c2, kn::run_c2_fused, [](C2P& p) { p.state = nullptr; }, "null state", s);
  expect_refused(c2, kn::run_c2_fused, [](C2P& p) { p.state_rows = 0; }, "no state rows", s);
  expect_refused(c2, kn::run_c2_fused, [](C2P& p) { p.prev_row = nullptr; }, "null prev_row", s);
  expect_refused(c2, kn::run_c2_fused, [](C2P& p) { p.partner_state_row = nullptr; }, "null partner_state_row", s);
  expect_refused(c2, kn::run_c2_fused, [](C2P& p) { p.state_row = nullptr; }, "null state_row", s);
  expect_refused(c2, kn::run_c2_fused, [](C2P& p) { p.kvs = nullptr; }, "null kvs", s);
  expect_refused(c2, kn::run_c2_fused, [](C2P& p) { p.layout = cache_layout(CacheKind::kIndexK); }, "index-K layout", s);

  kn::IndexKStoreParams ik;
  ik.kproj = m.region<bf16_t>(0);
  ik.kproj_row_stride = 128;
  ik.k_norm = m.region<float>(7);
  ik.eps = kEps;
  ik.g = m.region<int32_t>(2);
  ik.table = m.region<float>(6);
  ik.max_pos = 1;
  ik.out_loc = m.region<int32_t>(3);
  ik.layout = cache_layout(CacheKind::kIndexK);
  ik.cache = m.region<uint8_t>(8);
  ik.n_slots = 1;
  ik.N = 2;
  m.expect_accepted([&](cudaStream_t st) { kn::run_index_k_store(ik, st, false); }, "index-K baseline");
  using IP = kn::IndexKStoreParams;
  expect_refused(ik, kn::run_index_k_store, [](IP& p) { p.kproj_row_stride = 64; }, "kproj stride < 128", s);
  expect_refused(ik, kn::run_index_k_store, [](IP& p) { p.g = nullptr; }, "null g", s);
  expect_refused(ik, kn::run_index_k_store, [](IP& p) { p.k_norm = nullptr; }, "null k_norm", s);
  expect_refused(ik, kn::run_index_k_store, [](IP& p) { p.kproj = nullptr; }, "null kproj", s);
  expect_refused(ik, kn::run_index_k_store, [](IP& p) { p.layout = cache_layout(CacheKind::kCompressedFp4); }, "compressed layout", s);
  expect_refused(ik, kn::run_index_k_store, [](IP& p) { p.cache += 2; }, "misaligned cache", s);
}


// =====================================================================================================
// Pair-per-thread kernels (c1, c2, window-K, index-K): strided rows, a batch of 130 rows (21 verify
// requests + 4 padded rows; more CTAs than any bucket above), and the device-side containment of
// metadata the reference refuses: such a row is skipped entirely and counted ONCE, whatever the
// number of CTAs/warps that share the row.
// =====================================================================================================
constexpr int kManyRows = 130;

// Copies rows of `width` elements from a dense [rows, width] array into a [rows, stride] array
// that starts poisoned (the padding between rows stays poison).
template <class T>
std::vector<T> to_strided(const std::vector<T>& dense, int64_t rows, int64_t width, int64_t stride) {
  std::vector<T> out = poisoned_host<T>(static_cast<size_t>(rows * stride));
  for (int64_t r = 0; r < rows; ++r)
    std::memcpy(out.data() + r * stride, dense.data() + r * width, static_cast<size_t>(width) * sizeof(T));
  return out;
}
template <class T>
std::vector<T> to_dense(const std::vector<T>& strided, int64_t rows, int64_t width, int64_t stride) {
  std::vector<T> out(static_cast<size_t>(rows * width));
  for (int64_t r = 0; r < rows; ++r)
    std::memcpy(out.data() + r * width, strided.data() + r * stride, static_cast<size_t>(width) * sizeof(T));
  return out;
}

// c1: proj rows at stride 520, latent rows at stride 528; row 7 has a position outside the table
// (whole row skipped: latent and slot stay poison; counted once), row 100 a slot past the pool
// (store skipped, latent written; counted once).
TEST_F(GpuC1Fused, StridedRowsContainedPositionAndManyRows) {
  const int N = kManyRows;
  const int64_t proj_stride = 520, latent_stride = 528;
  const int bad_pos_row = 7, bad_slot_row = 100;
  const Batch b = make_batch(N, rng_);
  const CacheLayout layout = cache_layout(CacheKind::kCompressedFp4);
  const int64_t n_slots = compressed_slots(b.pool, 1);
  const size_t cache_bytes = static_cast<size_t>(layout.pool_bytes(n_slots));
  const std::vector<bf16_t> proj = random_rows_bf16(N, proj_stride, rng_);
  const std::vector<float> c_norm = random_norm_weight(512, rng_);
  std::vector<int32_t> pos = b.meta.pos, loc = b.meta.c_out_loc[1];
  ASSERT_GT(b.meta.req[bad_pos_row], -1);
  ASSERT_GT(loc[bad_slot_row], 0);
  pos[bad_pos_row] = kMaxPos + 3;
  loc[bad_slot_row] = static_cast<int32_t>(n_slots) + 5;

  // Reference: the bad-position row gets a valid position and no slot, then its latent is poisoned.
  std::vector<int32_t> pos_ref = pos, loc_ref = loc;
  pos_ref[bad_pos_row] = 0;
  loc_ref[bad_pos_row] = 0;
  const std::vector<bf16_t> proj_dense = to_dense(proj, N, 512, proj_stride);
  std::vector<uint8_t> want_cache = poisoned_host<uint8_t>(cache_bytes);
  std::vector<bf16_t> want_dense = poisoned_host<bf16_t>(static_cast<size_t>(N) * 512);
  EXPECT_EQ(ref::c1_fused(proj_dense.data(), N, c_norm.data(), kEps, pos_ref.data(), compressed_table().data(), kMaxPos,
                          loc_ref.data(), layout, want_cache.data(), n_slots, want_dense.data()),
            1);
  std::memset(want_dense.data() + static_cast<size_t>(bad_pos_row) * 512, kPoison, 512 * sizeof(bf16_t));
  const std::vector<bf16_t> want_latent = to_strided(want_dense, N, 512, latent_stride);

  DeviceBuffer<bf16_t> d_staging = to_device(proj, stream_);
  DeviceBuffer<bf16_t> d_proj(proj.size());
  DeviceBuffer<float> d_norm = to_device(c_norm, stream_);
  DeviceBuffer<int32_t> d_pos = to_device(pos, stream_);
  DeviceBuffer<int32_t> d_loc = to_device(loc, stream_);
  DeviceBuffer<float> d_table = to_device(compressed_table(), stream_);
  for (Mode m : kModes) {
    SCOPED_TRACE(mode_name(m));
    DeviceErrorCounter errors;
    DeviceBuffer<uint8_t> d_cache = poisoned<uint8_t>(cache_bytes, stream_);
    DeviceBuffer<bf16_t> d_latent = poisoned<bf16_t>(want_latent.size(), stream_);
    feed_input(m, d_staging.get(), d_proj.get(), proj.size() * sizeof(bf16_t), stream_);
    kn::C1FusedParams p;
    p.proj = d_proj.get();
    p.proj_row_stride = proj_stride;
    p.c_norm = d_norm.get();
    p.eps = kEps;
    p.pos = d_pos.get();
    p.table = d_table.get();
    p.max_pos = kMaxPos;
    p.out_loc = d_loc.get();
    p.layout = layout;
    p.cache = d_cache.get();
    p.n_slots = n_slots;
    p.latent_pre_rope = d_latent.get();
    p.latent_row_stride = latent_stride;
    p.N = N;
    p.err_count = errors.get();
    kn::run_c1_fused(p, stream_, m == Mode::kPdl);
    EXPECT_TRUE(same_bytes(want_latent, to_host(d_latent, stream_))) << "latent_pre_rope";
    EXPECT_TRUE(same_bytes(want_cache, to_host(d_cache, stream_))) << "compressed cache";
    EXPECT_EQ(errors.read(stream_), 2u);
  }
}

// c2: kvs rows at stride 1028, latent rows at stride 520, 130 rows; five completing (odd) rows get
// metadata the reference refuses, one per device-side check: prev_row == t, prev_row >= N, a state
// row past the state, a position past the table, and (prev_row -1) a partner state row past the
// state. Each is skipped entirely (no latent, no slot, no state write) and counted once; the other
// rows (parks included) match the reference run with those five rows padded. Odd rows are never
// another row's prev_row, so padding them leaves the reference's view of the rest unchanged.
TEST_F(GpuC2Fused, StridedRowsContainedMetadataAndManyRows) {
  const int N = kManyRows;
  const int64_t kvs_stride = 1028, latent_stride = 520;
  const std::vector<float> c_norm = random_norm_weight(512, rng_);
  const Batch b = make_batch(N, rng_);
  const StepMeta& meta = b.meta;
  std::vector<int> odd_rows;
  for (int t = 0; t < N && odd_rows.size() < 5; ++t)
    if (meta.pair_state_row[t] >= 0 && meta.pos[t] % 2 == 1 && meta.pair_prev_row[t] >= 0) odd_rows.push_back(t);
  ASSERT_EQ(odd_rows.size(), 5u);
  std::vector<int32_t> pos = meta.pos, srow = meta.pair_state_row, prev = meta.pair_prev_row,
                       partner = meta.pair_partner_state_row;
  const int64_t state_rows = static_cast<int64_t>(b.pool.n_requests) * b.pool.pair_ring;
  prev[odd_rows[0]] = odd_rows[0];
  prev[odd_rows[1]] = N + 2;
  srow[odd_rows[2]] = static_cast<int32_t>(state_rows);
  pos[odd_rows[3]] = kMaxPos + 1;
  prev[odd_rows[4]] = -1;
  partner[odd_rows[4]] = static_cast<int32_t>(state_rows) + 1;
  std::vector<int32_t> srow_ref = meta.pair_state_row;
  for (int t : odd_rows) srow_ref[t] = -1;

  std::mt19937_64 rng_kvs(4242);
  const std::vector<float> kvs_dense = random_kvs(N, rng_kvs);
  const std::vector<float> kvs = to_strided(kvs_dense, N, 1024, kvs_stride);
  for (Mode m : kModes) {
    SCOPED_TRACE(mode_name(m));
    std::mt19937_64 rng_state(777);  // the same parked partners for both modes
    C2State st = make_c2_state(b.pool, true, rng_state, stream_);
    ASSERT_EQ(st.state_rows, state_rows);
    std::vector<bf16_t> want_dense = poisoned_host<bf16_t>(static_cast<size_t>(N) * 512);
    EXPECT_EQ(ref::c2_fused(kvs_dense.data(), N, meta.pos.data(), srow_ref.data(), meta.pair_partner_state_row.data(),
                            meta.pair_prev_row.data(), st.state.data(), st.state_rows, c_norm.data(), kEps,
                            compressed_table().data(), kMaxPos, meta.c_out_loc[2].data(), st.layout, st.cache.data(),
                            st.n_slots, want_dense.data()),
              0);
    const std::vector<bf16_t> want_latent = to_strided(want_dense, N, 512, latent_stride);

    DeviceBuffer<float> d_staging = to_device(kvs, stream_);
    DeviceBuffer<float> d_kvs(kvs.size());
    DeviceBuffer<int32_t> d_pos = to_device(pos, stream_);
    DeviceBuffer<int32_t> d_srow = to_device(srow, stream_);
    DeviceBuffer<int32_t> d_partner = to_device(partner, stream_);
    DeviceBuffer<int32_t> d_prev = to_device(prev, stream_);
    DeviceBuffer<int32_t> d_loc = to_device(meta.c_out_loc[2], stream_);
    DeviceBuffer<float> d_norm = to_device(c_norm, stream_);
    DeviceBuffer<float> d_table = to_device(compressed_table(), stream_);
    DeviceBuffer<bf16_t> d_latent = poisoned<bf16_t>(want_latent.size(), stream_);
    DeviceErrorCounter errors;
    feed_input(m, d_staging.get(), d_kvs.get(), kvs.size() * sizeof(float), stream_);
    kn::C2FusedParams p;
    p.kvs = d_kvs.get();
    p.kvs_row_stride = kvs_stride;
    p.pos = d_pos.get();
    p.state_row = d_srow.get();
    p.partner_state_row = d_partner.get();
    p.prev_row = d_prev.get();
    p.state = st.d_state.get();
    p.state_rows = st.state_rows;
    p.c_norm = d_norm.get();
    p.eps = kEps;
    p.table = d_table.get();
    p.max_pos = kMaxPos;
    p.out_loc = d_loc.get();
    p.layout = st.layout;
    p.cache = st.d_cache.get();
    p.n_slots = st.n_slots;
    p.latent_pre_rope = d_latent.get();
    p.latent_row_stride = latent_stride;
    p.N = N;
    p.err_count = errors.get();
    kn::run_c2_fused(p, stream_, m == Mode::kPdl);
    EXPECT_TRUE(same_bytes(want_latent, to_host(d_latent, stream_))) << "latent_pre_rope";
    EXPECT_TRUE(same_bytes(st.state, to_host(st.d_state, stream_))) << "pair state";
    EXPECT_TRUE(same_bytes(st.cache, to_host(st.d_cache, stream_))) << "compressed cache";
    EXPECT_EQ(errors.read(stream_), 5u);
  }
}

// index-K: kproj rows at stride 136, 130 rows (ratio-1 slots). Containment and its counts, once
// per row: row 5 has a group position past the table (skipped entirely, counted), row 9 the same
// but no slot (nothing to do: not counted), row 20 a slot past the pool AND a bad position (the
// slot check comes first: counted once), row 100 a slot past the pool (counted).
TEST_F(GpuIndexK, StridedRowsContainedPositionAndManyRows) {
  const int N = kManyRows;
  const int64_t kproj_stride = 136;
  const Batch b = make_batch(N, rng_);
  const CacheLayout layout = cache_layout(CacheKind::kIndexK);
  const int64_t n_slots = compressed_slots(b.pool, 1);
  const size_t cache_bytes = static_cast<size_t>(layout.pool_bytes(n_slots));
  const std::vector<bf16_t> kproj = random_rows_bf16(N, kproj_stride, rng_);
  const std::vector<float> k_norm = random_norm_weight(128, rng_);
  std::vector<int32_t> g = b.meta.pos, loc = b.meta.c_out_loc[1];
  for (int t : {5, 20, 100}) ASSERT_GT(loc[t], 0) << t;
  std::vector<int32_t> g_ref = g, loc_ref = loc;
  g[5] = kMaxPos;
  loc_ref[5] = 0;
  g[9] = -1;
  loc[9] = 0;
  loc_ref[9] = 0;
  g[20] = kMaxPos + 7;
  loc[20] = static_cast<int32_t>(n_slots) + 1;
  loc_ref[20] = loc[20];
  loc[100] = static_cast<int32_t>(n_slots);
  loc_ref[100] = loc[100];

  const std::vector<bf16_t> kproj_dense = to_dense(kproj, N, 128, kproj_stride);
  std::vector<uint8_t> want = poisoned_host<uint8_t>(cache_bytes);
  EXPECT_EQ(ref::index_k_store(kproj_dense.data(), N, k_norm.data(), kEps, g_ref.data(), compressed_table().data(), kMaxPos,
                               loc_ref.data(), layout, want.data(), n_slots),
            2);

  DeviceBuffer<bf16_t> d_staging = to_device(kproj, stream_);
  DeviceBuffer<bf16_t> d_kproj(kproj.size());
  DeviceBuffer<float> d_norm = to_device(k_norm, stream_);
  DeviceBuffer<int32_t> d_g = to_device(g, stream_);
  DeviceBuffer<int32_t> d_loc = to_device(loc, stream_);
  DeviceBuffer<float> d_table = to_device(compressed_table(), stream_);
  for (Mode m : kModes) {
    SCOPED_TRACE(mode_name(m));
    DeviceErrorCounter errors;
    DeviceBuffer<uint8_t> d_cache = poisoned<uint8_t>(cache_bytes, stream_);
    feed_input(m, d_staging.get(), d_kproj.get(), kproj.size() * sizeof(bf16_t), stream_);
    kn::IndexKStoreParams p;
    p.kproj = d_kproj.get();
    p.kproj_row_stride = kproj_stride;
    p.k_norm = d_norm.get();
    p.eps = kEps;
    p.g = d_g.get();
    p.table = d_table.get();
    p.max_pos = kMaxPos;
    p.out_loc = d_loc.get();
    p.layout = layout;
    p.cache = d_cache.get();
    p.n_slots = n_slots;
    p.N = N;
    p.err_count = errors.get();
    kn::run_index_k_store(p, stream_, m == Mode::kPdl);
    EXPECT_TRUE(same_bytes(want, to_host(d_cache, stream_)));
    EXPECT_EQ(errors.read(stream_), 3u);
  }
}

// window-K, both layouts: 130 rows of the fused QA output (stride 1792). Containment and its
// counts, once per row: row 4 has a position past the table (skipped entirely, counted), row 11
// the same but no slot (swa_loc -1: not counted), row 30 a slot past the pool AND a bad position
// (the slot check comes first: counted once), row 90 a slot past the pool (counted).
TEST_F(GpuWindowK, ContainedPositionAndManyRows) {
  const int T = kManyRows;
  const Batch b = make_batch(T, rng_);
  for (CacheKind kind : {CacheKind::kWindowV41, CacheKind::kWindowV4}) {
    SCOPED_TRACE("window kind " + std::to_string(static_cast<int>(kind)));
    const CacheLayout layout = cache_layout(kind);
    const int64_t n_slots = b.pool.window_pool_slots();
    const size_t cache_bytes = static_cast<size_t>(layout.pool_bytes(n_slots));
    const std::vector<bf16_t> qa = random_rows_bf16(T, kQaWidth, rng_);
    const std::vector<float> kv_norm = random_norm_weight(512, rng_);
    std::vector<int32_t> pos = b.meta.pos, loc = b.meta.swa_loc;
    for (int t : {4, 11, 30, 90}) ASSERT_GE(loc[t], 0) << t;
    std::vector<int32_t> pos_ref = pos, loc_ref = loc;
    pos[4] = kMaxPos;
    loc_ref[4] = -1;
    pos[11] = -5;
    loc[11] = -1;
    loc_ref[11] = -1;
    pos[30] = kMaxPos + 1;
    loc[30] = static_cast<int32_t>(n_slots) + 2;
    loc_ref[30] = loc[30];
    loc[90] = static_cast<int32_t>(n_slots);
    loc_ref[90] = loc[90];

    std::vector<uint8_t> want = poisoned_host<uint8_t>(cache_bytes);
    EXPECT_EQ(ref::window_k_store(qa.data() + kKvColumn, T, kQaWidth, kv_norm.data(), kEps, pos_ref.data(),
                                  main_table().data(), kMaxPos, loc_ref.data(), kind, layout, want.data(), n_slots),
              2);

    DeviceBuffer<bf16_t> d_staging = to_device(qa, stream_);
    DeviceBuffer<bf16_t> d_qa(qa.size());
    DeviceBuffer<float> d_norm = to_device(kv_norm, stream_);
    DeviceBuffer<int32_t> d_pos = to_device(pos, stream_);
    DeviceBuffer<int32_t> d_loc = to_device(loc, stream_);
    DeviceBuffer<float> d_table = to_device(main_table(), stream_);
    for (Mode m : kModes) {
      SCOPED_TRACE(mode_name(m));
      DeviceErrorCounter errors;
      DeviceBuffer<uint8_t> d_cache = poisoned<uint8_t>(cache_bytes, stream_);
      feed_input(m, d_staging.get(), d_qa.get(), qa.size() * sizeof(bf16_t), stream_);
      kn::WindowKStoreParams p;
      p.kv = d_qa.get() + kKvColumn;
      p.kv_row_stride = kQaWidth;
      p.kv_norm = d_norm.get();
      p.eps = kEps;
      p.pos = d_pos.get();
      p.table = d_table.get();
      p.max_pos = kMaxPos;
      p.swa_loc = d_loc.get();
      p.kind = kind;
      p.layout = layout;
      p.cache = d_cache.get();
      p.n_slots = n_slots;
      p.T = T;
      p.err_count = errors.get();
      kn::run_window_k_store(p, stream_, m == Mode::kPdl);
      EXPECT_TRUE(same_bytes(want, to_host(d_cache, stream_)));
      EXPECT_EQ(errors.read(stream_), 3u);
    }
  }
}

}  // namespace
