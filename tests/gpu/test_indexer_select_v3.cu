// Indexer selection v3 (src/kernels/indexer_select_v3.cu: one thread-block cluster per row) against
// the CPU reference (ref::topk_to_slots, ref::apply_candidate_mask + topk for the fused mask,
// ref::candidate_mask), byte for byte, and against v1 / v2 where cheap. Every output (plus a guard
// tail) is poisoned before the call and compared whole, so an unwritten element or a write past the
// end fails. Each case runs under several cluster sizes (1, 2, 8, 16 CTAs per row and the
// automatic choice): the chunk edges, the cross-CTA tie counts and the DSMEM exchange differ per
// cluster size, the result must not. The check helpers also run both forms of the radix select:
// plain, and starting with the window exchange (v3_window; its own paths: TopkWindowExchangePaths,
// MaskWindowExchangePaths).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <iterator>
#include <limits>
#include <numeric>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "gpu_test_util.h"
#include "kernels/device_common.cuh"
#include "kernels/indexer_select_keys.h"
#include "kernels/indexer_select_window.h"
#include "runtime/cuda_utils.h"
#include "runtime/launch.h"
#include "v4attn/kernels/indexer_kernels.h"
#include "v4attn/numerics.h"
#include "v4attn/reference/indexer.h"

namespace {

using namespace v4attn;

constexpr uint8_t kPoison = test_util::kOutputPoison;
constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr int kClusters[] = {0, 1, 2, 8, 16};  // 0 = automatic
constexpr bool kWindowForms[] = {false, true};  // v3_window

std::string cl_name(int cluster) { return cluster == 0 ? "cluster auto" : "cluster " + std::to_string(cluster); }
std::string form_name(bool window) { return window ? "window exchange" : "radix passes"; }

// ---- buffers ------------------------------------------------------------------------------------
using test_util::ErrorCount;
using test_util::PoisonedOutput;
using test_util::to_device;

template <class T>
void expect_same_bytes(const std::vector<T>& got, const std::vector<T>& want, const std::string& what,
                       int64_t row_len = 0) {
  ASSERT_EQ(got.size(), want.size()) << what;
  if (std::memcmp(got.data(), want.data(), got.size() * sizeof(T)) == 0) return;
  size_t bad = 0, n_bad = 0;
  for (size_t i = 0; i < got.size(); ++i)
    if (std::memcmp(&got[i], &want[i], sizeof(T)) != 0) {
      if (n_bad++ == 0) bad = i;
    }
  std::string where = "element " + std::to_string(bad);
  if (row_len > 0) where += " (row " + std::to_string(bad / row_len) + ", col " + std::to_string(bad % row_len) + ")";
  ADD_FAILURE() << what << ": " << n_bad << " element(s) differ; first at " << where << ": got " << +got[bad]
                << ", want " << +want[bad];
}

// ---- launch modes -------------------------------------------------------------------------------
// kPdlLate: the scores are written by a "late producer" that lets its dependents launch at once,
// spins ~25 us, then copies the scores in; a kernel that reads them before griddepcontrol.wait
// sees poison and fails the comparison.
using test_util::Launch;
using test_util::launch_name;
using test_util::pdl_of;
using test_util::TestStream;
void late_feed(Launch mode, DeviceBuffer<float>& input, DeviceBuffer<float>& staging, cudaStream_t s) {
  test_util::late_feed(mode, input, staging, kPoison, s);
}

// ---- inputs -------------------------------------------------------------------------------------
struct SlotTable {
  int64_t rows = 0, stride = 0;
  std::vector<int32_t> v;
};
SlotTable shuffled_table(int64_t rows, int64_t stride, int64_t n_slots, std::mt19937_64& rng) {
  SlotTable tab;
  tab.rows = rows;
  tab.stride = stride;
  tab.v.resize(static_cast<size_t>(rows * stride));
  std::vector<int32_t> perm(static_cast<size_t>(n_slots));
  std::iota(perm.begin(), perm.end(), 0);
  for (int64_t r = 0; r < rows; ++r) {
    std::shuffle(perm.begin(), perm.end(), rng);
    for (int64_t j = 0; j < stride; ++j) tab.v[r * stride + j] = perm[j % n_slots];
  }
  return tab;
}

// Score flavours:
//  kNormal: N(0, 3) (continuous: the radix select mostly ends on a whole bucket before pass 4).
//  kTies:   a handful of small integers, +0.0 and -0.0, some continuous values, -inf, NaN, +inf.
//  kAdjacent: runs of neighbouring floats (1.0 + i ulp, many exact duplicates, keys that differ by
//           1), so the threshold K* - 1 and K* are both present: the bucket short cut and the
//           tie budget at their sharpest.
// Entries past clen are large finite garbage (must be ignored).
enum class Flavour { kNormal, kTies, kAdjacent };
const char* flavour_name(Flavour f) {
  return f == Flavour::kNormal ? "normal" : (f == Flavour::kTies ? "ties" : "adjacent");
}

std::vector<float> make_scores(int64_t T, int64_t stride, const std::vector<int32_t>& clen, std::mt19937_64& rng,
                               Flavour f, int levels = 5) {
  std::vector<float> s(static_cast<size_t>(T * stride));
  std::normal_distribution<float> nd(0.0f, 3.0f);
  std::uniform_int_distribution<int> lvl(0, levels - 1);
  std::uniform_real_distribution<float> cont(-4.0f, 4.0f);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < stride; ++j) {
      float v;
      const uint64_t r = rng() % 1000;
      if (j >= clen[t]) {
        v = 100.0f + static_cast<float>(j % 7);
      } else if (f == Flavour::kNormal) {
        v = r < 3 ? -kInf : nd(rng);
      } else if (f == Flavour::kTies) {
        if (r < 60) v = -kInf;
        else if (r < 62) v = std::numeric_limits<float>::quiet_NaN();
        else if (r < 63) v = kInf;
        else if (r < 200) v = cont(rng);
        else if (r < 260) v = -0.0f;
        else if (r < 300) v = 0.0f;
        else v = static_cast<float>(lvl(rng));
      } else {
        if (r < 20) v = -kInf;
        else if (r < 25) v = std::numeric_limits<float>::quiet_NaN();
        else v = num::f32_from_bits(num::f32_bits(1.0f) + static_cast<uint32_t>(rng() % 1200));
      }
      s[t * stride + j] = v;
    }
  return s;
}

// ---- top-k --------------------------------------------------------------------------------------
struct TopkProblem {
  int64_t T = 0, stride = 0;
  std::vector<float> scores;
  std::vector<int32_t> req, clen;
  SlotTable table;
  int topk = 512;
  int64_t out_stride = 576;
  std::vector<uint8_t> mask;  // optional [T, mask_stride]
  int64_t mask_stride = 0;
  int mask_block = 8;
};

TopkProblem make_topk_problem(const std::vector<int32_t>& clen, int64_t stride, int topk, int64_t out_stride,
                              std::mt19937_64& rng, Flavour f) {
  TopkProblem pb;
  pb.T = static_cast<int64_t>(clen.size());
  pb.stride = stride;
  pb.clen = clen;
  pb.topk = topk;
  pb.out_stride = out_stride;
  const int64_t n_req = 3;
  pb.req.resize(clen.size());
  for (size_t t = 0; t < clen.size(); ++t) pb.req[t] = static_cast<int32_t>(rng() % n_req);
  pb.table = shuffled_table(n_req, stride, stride + 11, rng);
  pb.scores = make_scores(pb.T, stride, clen, rng, f);
  return pb;
}

// The reference on well-formed rows (the caller fixes the expectation of contained rows).
std::vector<int32_t> reference_topk(const TopkProblem& pb) {
  std::vector<float> s = pb.scores;
  if (!pb.mask.empty())
    ref::apply_candidate_mask(s.data(), pb.T, pb.stride, pb.clen.data(), pb.mask_block, pb.mask.data(), pb.mask_stride);
  std::vector<int32_t> out(static_cast<size_t>(pb.T * pb.out_stride));
  ref::topk_to_slots(s.data(), pb.T, pb.stride, pb.clen.data(), pb.topk, pb.req.data(), pb.table.v.data(),
                     pb.table.stride, out.data(), pb.out_stride);
  return out;
}

// Which entry point runs: v3 through run_indexer_topk (version 3) or run_indexer_topk_v3, or the
// older versions (v1: no workspace, v2: a zeroed workspace) for the cross-version check.
enum class Entry { kDispatch, kDirect, kV1, kV2 };

struct TopkRun {
  int cluster = 0;
  bool window = false;  // v3_window
  Launch mode = Launch::kPlain;
  Entry entry = Entry::kDispatch;
  unsigned long long* errors = nullptr;  // null: expect no error counted
  std::vector<uint8_t>* paths = nullptr;  // window: the v3_window_paths record ([T * kMaxRanks], poison where unwritten)
};

// A top-k problem on the device: inputs, the poisoned output and the params (v3; the caller adds
// the cluster size, the version, an error counter).
struct TopkOnDevice {
  DeviceBuffer<float> scores;
  DeviceBuffer<int32_t> req, clen, table;
  DeviceBuffer<uint8_t> topk_mask;  // the fused candidate mask (pb.mask), if any
  PoisonedOutput<int32_t> out;
  kernels::IndexerTopkParams tp;
  explicit TopkOnDevice(const TopkProblem& pb)
      : scores(to_device(pb.scores)),
        req(to_device(pb.req)),
        clen(to_device(pb.clen)),
        table(to_device(pb.table.v)),
        topk_mask(to_device(pb.mask)),
        out(static_cast<size_t>(pb.T * pb.out_stride)) {
    tp.scores = scores.get();
    tp.score_stride = pb.stride;
    tp.clen = clen.get();
    tp.req = req.get();
    tp.T = pb.T;
    tp.comp_slot_table = table.get();
    tp.comp_table_stride = pb.table.stride;
    tp.comp_table_rows = pb.table.rows;
    if (!pb.mask.empty()) {
      tp.candidate_mask = topk_mask.get();
      tp.mask_stride = pb.mask_stride;
      tp.mask_block = pb.mask_block;
    }
    tp.topk = pb.topk;
    tp.out = out.get();
    tp.out_stride = pb.out_stride;
    tp.version = 3;
  }
};

std::vector<int32_t> gpu_topk(const TopkProblem& pb, const TopkRun& run = {}) {
  TopkOnDevice d(pb);
  ErrorCount err;
  DeviceBuffer<uint8_t> ws;
  kernels::IndexerTopkParams& p = d.tp;
  p.err_count = err.get();
  p.v3_cluster = run.cluster;
  p.v3_window = run.window;
  PoisonedOutput<uint8_t> paths(static_cast<size_t>(pb.T) * kernels::select_window_path::kMaxRanks);
  if (run.paths != nullptr) p.v3_window_paths = paths.get();
  if (run.entry != Entry::kDispatch) p.version = 0;  // direct: ignored; v1 / v2: by the workspace
  if (run.entry == Entry::kV2) {
    ws.resize(std::max<size_t>(kernels::indexer_topk_workspace_bytes(pb.T, pb.stride, pb.topk), 16));
    ws.fill_bytes(0);
    p.workspace = ws.get();
    p.workspace_bytes = ws.bytes();
  }
  {
    TestStream stream;
    DeviceBuffer<float> staging;
    late_feed(run.mode, d.scores, staging, stream.s);
    if (run.entry == Entry::kDirect) kernels::run_indexer_topk_v3(p, stream.s, pdl_of(run.mode));
    else kernels::run_indexer_topk(p, stream.s, pdl_of(run.mode));
    V4_CUDA_CHECK_LAUNCH();
    V4_CUDA_CHECK(cudaStreamSynchronize(stream.s));
  }
  auto got = d.out.download_checked();
  if (run.paths != nullptr) *run.paths = paths.download_checked();
  const auto e = err.read();
  if (run.errors != nullptr) *run.errors = e;
  else EXPECT_EQ(e, 0u);
  return got;
}

// Every cluster size, both forms, against `want`.
void check_topk_all_clusters(const TopkProblem& pb, const std::vector<int32_t>& want, const std::string& what,
                             Launch mode = Launch::kPlain) {
  for (bool window : kWindowForms)
    for (int cl : kClusters) {
      TopkRun run;
      run.cluster = cl;
      run.window = window;
      run.mode = mode;
      expect_same_bytes(gpu_topk(pb, run), want,
                        what + ", " + cl_name(cl) + ", " + form_name(window) + ", " + launch_name(mode), pb.out_stride);
    }
}

// Row lengths cycled over the rows of a batch of T.
std::vector<int32_t> cycled_clen(int64_t T, const std::vector<int32_t>& lengths, int64_t offset) {
  std::vector<int32_t> clen(static_cast<size_t>(T));
  for (int64_t t = 0; t < T; ++t) clen[t] = lengths[(t + offset) % lengths.size()];
  return clen;
}

const std::vector<int32_t> kLengths = {0, 1, 511, 512, 513, 4095, 32768, 65536};

// ---- candidate mask -----------------------------------------------------------------------------
struct MaskProblem {
  int64_t T = 0, stride = 0, mask_stride = 0;
  std::vector<float> scores;
  std::vector<int32_t> clen;
  int block = 8, topk_blocks = 2048;
};

std::vector<uint8_t> reference_mask(const MaskProblem& pb) {
  std::vector<uint8_t> m(static_cast<size_t>(pb.T * pb.mask_stride));
  ref::candidate_mask(pb.scores.data(), pb.T, pb.stride, pb.clen.data(), pb.block, pb.topk_blocks, m.data(),
                      pb.mask_stride);
  return m;
}

std::vector<uint8_t> gpu_mask(const MaskProblem& pb, int cluster, Launch mode = Launch::kPlain,
                              Entry entry = Entry::kDispatch, unsigned long long* errors = nullptr,
                              bool window = false, std::vector<uint8_t>* paths = nullptr) {
  auto d_scores = to_device(pb.scores);
  auto d_clen = to_device(pb.clen);
  PoisonedOutput<uint8_t> out(static_cast<size_t>(pb.T * pb.mask_stride));
  ErrorCount err;
  DeviceBuffer<uint8_t> ws;
  kernels::CandidateMaskParams p;
  p.scores = d_scores.get();
  p.score_stride = pb.stride;
  p.clen = d_clen.get();
  p.T = pb.T;
  p.block = pb.block;
  p.topk_blocks = pb.topk_blocks;
  p.mask = out.get();
  p.mask_stride = pb.mask_stride;
  p.err_count = err.get();
  p.v3_cluster = cluster;
  p.v3_window = window;
  PoisonedOutput<uint8_t> path_rec(static_cast<size_t>(pb.T) * kernels::select_window_path::kMaxRanks);
  if (paths != nullptr) p.v3_window_paths = path_rec.get();
  if (entry == Entry::kDispatch) p.version = 3;
  if (entry == Entry::kV2) {
    ws.resize(std::max<size_t>(kernels::candidate_mask_workspace_bytes(pb.T, pb.stride, pb.block, pb.topk_blocks), 16));
    ws.fill_bytes(0);
    p.workspace = ws.get();
    p.workspace_bytes = ws.bytes();
  }
  {
    TestStream stream;
    DeviceBuffer<float> staging;
    late_feed(mode, d_scores, staging, stream.s);
    if (entry == Entry::kDirect) kernels::run_candidate_mask_v3(p, stream.s, pdl_of(mode));
    else kernels::run_candidate_mask(p, stream.s, pdl_of(mode));
    V4_CUDA_CHECK_LAUNCH();
    V4_CUDA_CHECK(cudaStreamSynchronize(stream.s));
  }
  const auto e = err.read();
  if (errors != nullptr) *errors = e;
  else EXPECT_EQ(e, 0u);
  if (paths != nullptr) *paths = path_rec.download_checked();
  return out.download_checked();
}

void check_mask_all_clusters(const MaskProblem& pb, const std::string& what, Launch mode = Launch::kPlain) {
  const auto want = reference_mask(pb);
  for (bool window : kWindowForms)
    for (int cl : kClusters)
      expect_same_bytes(gpu_mask(pb, cl, mode, Entry::kDispatch, nullptr, window), want,
                        what + ", " + cl_name(cl) + ", " + form_name(window) + ", " + launch_name(mode),
                        pb.mask_stride);
}

// ---- the window exchange (cluster_select with v3_window) ----------------------------------------
// The window form first counts, in one exchange, the 16-bit key prefixes of each CTA's finite keys in
// the 256 prefixes up to the CTA's own largest finite key, aligned under the cluster's largest; it
// falls back to radix pass 0 when the k-th key is not in that window (further down, or among the
// +inf keys), and selects every valid key when there are at most k. The rows below are built so
// that each path is taken, and which one a row takes is derived here from the data by the same rule
// (window_path) and asserted, so that a change of the data cannot leave a path untested.
enum class WindowPath { kAll, kWindow, kFallback, kNone };
WindowPath window_path(const float* row, int64_t n, int64_t k) {
  using kernels::select_window::kInfKey;
  if (k == 0) return WindowPath::kNone;  // nothing to select: no exchange at all
  std::vector<uint32_t> keys;
  uint32_t top = 0;
  int64_t n_inf = 0;
  for (int64_t j = 0; j < n; ++j)
    if (row[j] > -kInf) {  // NaN and -inf are never selected
      const uint32_t key = kernels::select_keys::value_key(row[j]);
      keys.push_back(key);
      if (key >= kInfKey) ++n_inf;
      else top = std::max(top, key);
    }
  if (static_cast<int64_t>(keys.size()) <= k) return WindowPath::kAll;
  std::nth_element(keys.begin(), keys.begin() + (k - 1), keys.end(), std::greater<uint32_t>());
  const uint32_t kth = keys[static_cast<size_t>(k - 1)];
  return n_inf < k && kth < kInfKey && (kth >> 16) >= kernels::select_window::base(top) ? WindowPath::kWindow
                                                                                       : WindowPath::kFallback;
}

// Checks a launch's v3_window_paths record against the host's prediction for each row: every CTA of a
// row's cluster recorded the same way (the decision must be cluster-uniform, or the exchanges that
// follow would not pair up), the ranks past the cluster wrote nothing, `cluster` CTAs (when given)
// took part, and the way is the predicted one: kAll, kBucket or kPrefix (the window decided), or
// kFallback -- or kNone where `none_allowed` (chunks too long for shared memory skip the window).
void expect_window_paths(const std::vector<uint8_t>& rec, const std::vector<WindowPath>& want, int cluster,
                         bool none_allowed, const std::string& what) {
  namespace wp = kernels::select_window_path;
  ASSERT_EQ(rec.size(), want.size() * wp::kMaxRanks) << what;
  for (size_t t = 0; t < want.size(); ++t) {
    const uint8_t* r = rec.data() + t * wp::kMaxRanks;
    int used = 0;
    while (used < wp::kMaxRanks && r[used] != kPoison) ++used;
    for (int i = used; i < wp::kMaxRanks; ++i) EXPECT_EQ(r[i], kPoison) << what << ", row " << t << ": rank " << i;
    ASSERT_TRUE(used == 1 || used == 2 || used == 4 || used == 8 || used == 16) << what << ", row " << t << ": " << used;
    if (cluster > 0) EXPECT_EQ(used, cluster) << what << ", row " << t;
    for (int i = 1; i < used; ++i)
      EXPECT_EQ(r[i], r[0]) << what << ", row " << t << ": rank " << i << " took another way than rank 0";
    const uint8_t got = r[0];
    bool ok = false;
    switch (want[t]) {
      case WindowPath::kAll: ok = got == wp::kAll; break;
      case WindowPath::kWindow: ok = got == wp::kBucket || got == wp::kPrefix; break;
      case WindowPath::kFallback: ok = got == wp::kFallback; break;
      case WindowPath::kNone: ok = got == wp::kNone; break;
    }
    if (none_allowed && got == wp::kNone) ok = true;
    EXPECT_TRUE(ok) << what << ", row " << t << ": recorded way " << +got << ", predicted "
                    << static_cast<int>(want[t]) << " (0 all, 1 window, 2 fallback, 3 none)";
  }
}

// One row per window case, 65536 positions each (16 chunks of 4096 in the 16-CTA clusters).
struct WindowRow {
  const char* name;
  WindowPath path;  // for the unmasked top-k with k = 512
};
const WindowRow kWindowRows[] = {
    {"one outlier far above the rest", WindowPath::kFallback},
    {"CTA maxima a fraction of a binade apart", WindowPath::kWindow},
    {"negative, narrow", WindowPath::kWindow},
    {"negative, the k-th far below the largest", WindowPath::kFallback},
    {"+inf keys below k", WindowPath::kWindow},
    {"+inf keys past k (ties among them)", WindowPath::kFallback},
    {"k-th in the window's lowest bin, with ties", WindowPath::kWindow},
    {"k-th one prefix below the window, with ties", WindowPath::kFallback},
    {"fewer valid keys than k", WindowPath::kAll},
    {"valid keys in the last quarter only", WindowPath::kWindow},
    {"k-th alone in the window's lowest bin (its whole bucket)", WindowPath::kWindow},
};
std::vector<float> window_rows(std::mt19937_64& rng) {
  const int64_t n = 65536, T = std::size(kWindowRows);
  std::vector<float> s(static_cast<size_t>(T * n));
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::uniform_real_distribution<float> u01(0.0f, 1.0f);
  for (int64_t t = 0; t < T; ++t) {
    float* row = s.data() + t * n;
    for (int64_t j = 0; j < n; ++j) {
      float v = 0.0f;
      switch (t) {
        case 0: v = 1.0f + 0.01f * nd(rng); break;
        case 1: v = std::exp2(-0.1f * static_cast<float>(j / 4096)) * (0.5f + 0.5f * u01(rng)); break;
        case 2: v = -(1.0f + 0.2f * u01(rng)); break;
        case 3: v = -(1.0f + 1000.0f * u01(rng)); break;
        case 4: case 5: case 9: v = nd(rng); break;
        case 6: case 7: case 10: v = 0.3f; break;
        case 8: v = -kInf; break;
      }
      row[j] = v;
    }
    if (t == 0) row[777] = 1e6f;
    if (t == 3) for (int i = 0; i < 10; ++i) row[(i * 6007 + 13) % n] = -0.001f;
    if (t == 4 || t == 5)
      for (int i = 0; i < (t == 4 ? 100 : 600); ++i) row[(static_cast<int64_t>(i) * 104729 + 7) % n] = kInf;
    if (t == 6 || t == 7 || t == 10) {
      // 2.0 is the largest finite key (prefix P = 0xc000); 510 values of 1.5; 30 ties at K* with
      // prefix P - 255 (the window's lowest bin, row 6) or P - 256 (just below it, row 7); row 10:
      // one K* in the lowest bin, so that the k-th key's bucket holds it alone (the whole bucket).
      const float kstar = num::f32_from_bits(t == 7 ? 0x3f00ffffu : 0x3f010000u);
      row[40000] = 2.0f;
      for (int i = 0; i < 510; ++i) row[(static_cast<int64_t>(i) * 127 + 11) % n] = 1.5f;
      for (int i = 0; i < (t == 10 ? 1 : 30); ++i) {
        int64_t j = (static_cast<int64_t>(i) * 2111 + 5) % n;
        while (row[j] != 0.3f) j = (j + 1) % n;
        row[j] = kstar;
      }
    }
    if (t == 8) for (int i = 0; i < 300; ++i) row[(static_cast<int64_t>(i) * 211 + 3) % n] = nd(rng);
    if (t == 9) for (int64_t j = 0; j < 49152; ++j) row[j] = -kInf;
  }
  return s;
}

// The predicted way of each row of a top-k problem (its mask applied, k = min(topk, clen)).
std::vector<WindowPath> predicted_paths(const TopkProblem& pb) {
  std::vector<WindowPath> w(static_cast<size_t>(pb.T));
  for (int64_t t = 0; t < pb.T; ++t) {
    std::vector<float> row(pb.scores.begin() + t * pb.stride, pb.scores.begin() + t * pb.stride + pb.clen[t]);
    if (!pb.mask.empty())
      for (size_t j = 0; j < row.size(); ++j)
        if (pb.mask[static_cast<size_t>(t * pb.mask_stride) + j / pb.mask_block] == 0) row[j] = -kInf;
    w[static_cast<size_t>(t)] = window_path(row.data(), static_cast<int64_t>(row.size()),
                                            std::min<int64_t>(pb.topk, pb.clen[t]));
  }
  return w;
}

// The window form at every cluster size with its path record: the bytes, and the ways the rows took.
// A top-k chunk of these 64K rows is held in shared memory from 4 CTAs up (the automatic size picks
// 8 or 16); at 1 or 2 CTAs it needs more rounds than the resident cap, so there (only) a row may skip
// the window. Returns the 16-CTA record.
std::vector<uint8_t> check_topk_window_paths(const TopkProblem& pb, const std::string& what,
                                             Launch mode = Launch::kPlain) {
  const auto want = reference_topk(pb);
  const auto paths = predicted_paths(pb);
  std::vector<uint8_t> rec16;
  for (int cl : kClusters) {
    std::vector<uint8_t> rec;
    TopkRun run;
    run.cluster = cl;
    run.window = true;
    run.mode = mode;
    run.paths = &rec;
    const std::string name = what + ", " + cl_name(cl) + ", path record, " + launch_name(mode);
    expect_same_bytes(gpu_topk(pb, run), want, name, pb.out_stride);
    expect_window_paths(rec, paths, cl, cl == 1 || cl == 2, name);
    if (cl == 16) rec16 = rec;
  }
  return rec16;
}

TEST(GpuIndexerSelectV3, TopkWindowExchangePaths) {
  V4_REQUIRE_GPU();
  std::mt19937_64 rng(0x5e1e3201);
  const int64_t T = std::size(kWindowRows);
  auto pb = make_topk_problem(std::vector<int32_t>(static_cast<size_t>(T), 65536), 65536, 512, 576, rng,
                              Flavour::kNormal);
  pb.scores = window_rows(rng);
  for (int64_t t = 0; t < T; ++t)
    ASSERT_EQ(window_path(pb.scores.data() + t * pb.stride, pb.stride, pb.topk), kWindowRows[t].path)
        << "row " << t << " (" << kWindowRows[t].name << ") does not take the path it is meant to";
  check_topk_all_clusters(pb, reference_topk(pb), "window rows, k 512");
  {
    namespace wp = kernels::select_window_path;
    const auto rec = check_topk_window_paths(pb, "window rows, k 512");
    ASSERT_EQ(rec.size(), static_cast<size_t>(T) * wp::kMaxRanks);
    EXPECT_EQ(rec[6 * wp::kMaxRanks], wp::kPrefix) << "row 6: 30 ties in the k-th key's bucket";
    EXPECT_EQ(rec[10 * wp::kMaxRanks], wp::kBucket) << "row 10: the k-th key alone in its bucket";
  }
  // A k whose k-th key is shared by more CTAs (row 1: a wide band under CTA maxima that differ).
  pb.topk = 8192;
  pb.out_stride = 8192;
  check_topk_all_clusters(pb, reference_topk(pb), "window rows, k 8192");
  check_topk_window_paths(pb, "window rows, k 8192");
  // The compacted walk (a candidate mask keeping 1 block in 4; the 1e6 outlier's block kept).
  pb.topk = 512;
  pb.out_stride = 576;
  pb.mask_block = 8;
  pb.mask_stride = 8192 + 64;
  pb.mask.assign(static_cast<size_t>(T * pb.mask_stride), 0);
  for (auto& m : pb.mask) m = (rng() % 4 == 0) ? 1 : 0;
  pb.mask[777 / 8] = 1;
  check_topk_all_clusters(pb, reference_topk(pb), "window rows, masked", Launch::kPdlLate);
  check_topk_window_paths(pb, "window rows, masked", Launch::kPdlLate);
}

// The predicted way of each row of a candidate-mask problem: over the blocks' maxima (positions < clen;
// the newest block pinned to +inf), k = min(topk_blocks, n_blocks).
std::vector<WindowPath> predicted_mask_paths(const MaskProblem& pb) {
  std::vector<WindowPath> w;
  for (int64_t t = 0; t < pb.T; ++t) {
    const int64_t c = pb.clen[t], nb = (c + pb.block - 1) / pb.block;
    std::vector<float> bmax(static_cast<size_t>(nb), -kInf);
    for (int64_t j = 0; j < c; ++j) bmax[j / pb.block] = num::max_f(bmax[j / pb.block], pb.scores[t * pb.stride + j]);
    if (nb > 0) bmax[static_cast<size_t>(nb - 1)] = kInf;
    w.push_back(window_path(bmax.data(), nb, std::min<int64_t>(pb.topk_blocks, nb)));
  }
  return w;
}

TEST(GpuIndexerSelectV3, MaskWindowExchangePaths) {
  V4_REQUIRE_GPU();
  std::mt19937_64 rng(0x5e1e3202);
  MaskProblem pb;
  pb.T = std::size(kWindowRows);
  pb.stride = 65536;
  pb.mask_stride = 8192 + 64;
  pb.clen.assign(static_cast<size_t>(pb.T), 65536);
  pb.scores = window_rows(rng);
  // The blocks' maxima (the newest block pinned to +inf): which rows reach the k-th block in the
  // window, for the budget of 2048 blocks.
  int paths[3] = {0, 0, 0};
  const std::vector<WindowPath> want_paths = predicted_mask_paths(pb);
  for (const WindowPath w : want_paths) ++paths[static_cast<int>(w)];
  EXPECT_GT(paths[static_cast<int>(WindowPath::kWindow)], 0);
  EXPECT_GT(paths[static_cast<int>(WindowPath::kFallback)], 0);
  EXPECT_GT(paths[static_cast<int>(WindowPath::kAll)], 0);
  check_mask_all_clusters(pb, "mask window rows");
  // The path record: every cluster's CTAs took one way, the predicted one.
  const auto want = reference_mask(pb);
  for (int cl : kClusters) {
    std::vector<uint8_t> rec;
    const std::string name = "mask window rows, " + cl_name(cl) + ", path record";
    expect_same_bytes(gpu_mask(pb, cl, Launch::kPlain, Entry::kDispatch, nullptr, true, &rec), want, name,
                      pb.mask_stride);
    expect_window_paths(rec, want_paths, cl, false, name);  // a mask chunk of 8192 blocks is always held
  }
}

// =================================================================================================
// top-k
// =================================================================================================

TEST(GpuIndexerSelectV3, TopkBatchesOfMixedRowLengths) {
  V4_REQUIRE_GPU();
  std::mt19937_64 rng(0x5e1e3001);
  // T rows cycling through the edge lengths (T = 1: one full row), each flavour of scores.
  for (int64_t T : {1, 6, 8, 32, 64}) {
    const auto clen = T == 1 ? std::vector<int32_t>{65536} : cycled_clen(T, kLengths, T);
    for (Flavour f : {Flavour::kNormal, Flavour::kTies, Flavour::kAdjacent}) {
      if (T >= 32 && f == Flavour::kAdjacent) continue;  // covered by the smaller batches
      const auto pb = make_topk_problem(clen, 65536, 512, 576, rng, f);
      const auto want = reference_topk(pb);
      check_topk_all_clusters(pb, want, "T=" + std::to_string(T) + " " + flavour_name(f));
    }
  }
}

TEST(GpuIndexerSelectV3, TopkEqualsV1AndV2) {
  V4_REQUIRE_GPU();
  std::mt19937_64 rng(0x5e1e3002);
  const auto pb = make_topk_problem(cycled_clen(8, kLengths, 0), 65536, 512, 512, rng, Flavour::kTies);
  const auto want = reference_topk(pb);
  for (Entry e : {Entry::kV1, Entry::kV2, Entry::kDirect, Entry::kDispatch}) {
    TopkRun run;
    run.entry = e;
    expect_same_bytes(gpu_topk(pb, run), want, "entry " + std::to_string(static_cast<int>(e)), pb.out_stride);
  }
}

TEST(GpuIndexerSelectV3, TopkPdlLaunches) {
  V4_REQUIRE_GPU();
  std::mt19937_64 rng(0x5e1e3003);
  const auto pb = make_topk_problem({65536, 65535, 65534, 65533, 65532, 65531}, 65536, 512, 512, rng, Flavour::kNormal);
  const auto want = reference_topk(pb);
  for (bool window : kWindowForms)
    for (Launch mode : {Launch::kPdl, Launch::kPdlLate})
      for (int cl : {0, 16}) {
        TopkRun run;
        run.cluster = cl;
        run.window = window;
        run.mode = mode;
        expect_same_bytes(gpu_topk(pb, run), want,
                          std::string("verify rows ") + launch_name(mode) + " " + cl_name(cl) + " " + form_name(window),
                          pb.out_stride);
      }
}

TEST(GpuIndexerSelectV3, TopkAllEqualRowsTakeTheLowestPositions) {
  V4_REQUIRE_GPU();
  std::mt19937_64 rng(0x5e1e3004);
  auto pb = make_topk_problem({65536, 3000, 512, 40000}, 65536, 512, 512, rng, Flavour::kNormal);
  for (int64_t t = 0; t < pb.T; ++t)
    for (int64_t j = 0; j < pb.clen[t]; ++j) pb.scores[t * pb.stride + j] = 0.5f;
  // Row 1: the equal run starts at 100 after -inf positions; one larger value at the end.
  for (int64_t j = 0; j < 100; ++j) pb.scores[1 * pb.stride + j] = -kInf;
  pb.scores[1 * pb.stride + 2999] = 1.0f;
  // Row 3: +0.0 and -0.0 alternating (one key), a single larger value in the last chunk.
  for (int64_t j = 0; j < 40000; ++j) pb.scores[3 * pb.stride + j] = (j % 3 == 0) ? -0.0f : 0.0f;
  pb.scores[3 * pb.stride + 39999] = 1e-30f;
  const auto want = reference_topk(pb);
  for (bool window : kWindowForms)
    for (int cl : kClusters) {
      TopkRun run;
      run.cluster = cl;
      run.window = window;
      const auto got = gpu_topk(pb, run);
      expect_same_bytes(got, want, "all equal, " + cl_name(cl) + ", " + form_name(window), pb.out_stride);
      // Independent of the reference: row 0 is the slots of positions 0..511.
      for (int i = 0; i < 512; ++i)
        ASSERT_EQ(got[i], pb.table.v[pb.req[0] * pb.table.stride + i])
            << cl_name(cl) << " " << form_name(window) << " " << i;
    }
}

// Ties that straddle CTA chunks: K* occurs in several chunks and the budget k_eq ends inside a
// later chunk; the values above K* are spread over all chunks.
TEST(GpuIndexerSelectV3, TopkTieBudgetAcrossChunks) {
  V4_REQUIRE_GPU();
  std::mt19937_64 rng(0x5e1e3005);
  auto pb = make_topk_problem({65536, 65536, 20000, 4096}, 65536, 512, 512, rng, Flavour::kNormal);
  for (int64_t t = 0; t < pb.T; ++t) {
    float* row = pb.scores.data() + t * pb.stride;
    for (int64_t j = 0; j < pb.clen[t]; ++j) row[j] = -1.0f;
    // 300 values above K* spread evenly; K* = 2.0 every 97th position (many more than 212).
    for (int i = 0; i < 300; ++i) row[(static_cast<int64_t>(i) * 7919 + t) % pb.clen[t]] = 3.0f + static_cast<float>(i % 5);
    for (int64_t j = 5 + t; j < pb.clen[t]; j += 97)
      if (row[j] < 0.0f) row[j] = 2.0f;
  }
  check_topk_all_clusters(pb, reference_topk(pb), "tie budget across chunks");
}

TEST(GpuIndexerSelectV3, TopkOtherKAndWidths) {
  V4_REQUIRE_GPU();
  std::mt19937_64 rng(0x5e1e3006);
  for (int topk : {0, 1, 64, 500, 2048}) {
    const std::vector<int32_t> clen = {0, 63, 2000, 2049, 9000, 33000};
    const int64_t out_stride = std::max<int64_t>(64, (topk + 63) / 64 * 64);
    const auto pb = make_topk_problem(clen, 33024, topk, out_stride, rng, topk % 2 == 0 ? Flavour::kTies : Flavour::kNormal);
    check_topk_all_clusters(pb, reference_topk(pb), "topk " + std::to_string(topk));
  }
}

// Rows longer than the resident key capacity of a CTA (6 rounds of 4096 positions): the chunk is
// re-read from global memory every pass. Cluster 1 at 65536 positions, cluster 2 at 65536 and
// cluster 16 at 600064; short rows of the same launch stay resident.
TEST(GpuIndexerSelectV3, TopkTiledPathForLongRows) {
  V4_REQUIRE_GPU();
  std::mt19937_64 rng(0x5e1e3007);
  for (Flavour f : {Flavour::kNormal, Flavour::kTies}) {
    const auto pb = make_topk_problem({65536, 24577, 24576, 100, 49153}, 65536, 512, 576, rng, f);
    const auto want = reference_topk(pb);
    for (bool window : kWindowForms)  // the window kernels skip the window on chunks they cannot hold
      for (int cl : {1, 2}) {
        TopkRun run;
        run.cluster = cl;
        run.window = window;
        expect_same_bytes(gpu_topk(pb, run), want,
                          std::string("tiled 64K, ") + flavour_name(f) + ", " + cl_name(cl) + ", " + form_name(window),
                          pb.out_stride);
      }
  }
  const auto pb = make_topk_problem({600000, 393217, 70000}, 600064, 2048, 2048, rng, Flavour::kTies);
  const auto want = reference_topk(pb);
  for (bool window : kWindowForms)
    for (int cl : {0, 16}) {
      TopkRun run;
      run.cluster = cl;
      run.window = window;
      expect_same_bytes(gpu_topk(pb, run), want, "tiled 600K, " + cl_name(cl) + ", " + form_name(window),
                        pb.out_stride);
    }
}

TEST(GpuIndexerSelectV3, TopkFusedCandidateMask) {
  V4_REQUIRE_GPU();
  std::mt19937_64 rng(0x5e1e3008);
  const std::vector<int32_t> clen = {0, 9, 800, 4100, 30000, 65536};
  for (int mask_block : {8, 5}) {
    for (Flavour f : {Flavour::kNormal, Flavour::kTies}) {
      auto pb = make_topk_problem(clen, 65536, 512, 512, rng, f);
      pb.mask_block = mask_block;
      pb.mask_stride = (pb.stride + mask_block - 1) / mask_block + 64;
      pb.mask.resize(static_cast<size_t>(pb.T * pb.mask_stride));
      for (auto& m : pb.mask) m = (rng() % 4 == 0) ? 1 : 0;
      check_topk_all_clusters(pb, reference_topk(pb),
                              "fused mask, block " + std::to_string(mask_block) + ", " + flavour_name(f));
    }
  }
}

// With a candidate mask the resident chunks keep only the groups of 8 positions that hold a valid
// key (compact_groups) and select over those: masks that keep every block (no group dropped, the
// kept keys fill the chunk exactly), none, one block per row, 3 in 4 and 1 in 4 blocks; ties at the
// threshold across kept groups (adjacent floats); PDL with late scores; a long row whose chunks are
// not resident (the uncompacted walk) beside short ones.
TEST(GpuIndexerSelectV3, TopkCompactedMaskEdges) {
  V4_REQUIRE_GPU();
  std::mt19937_64 rng(0x5e1e3009);
  const std::vector<int32_t> clen = {65536, 65535, 4103, 512, 0, 65536};
  for (int keep : {0, 1, 2, 3, 4}) {  // all, none, one block, 3 in 4, 1 in 4
    auto pb = make_topk_problem(clen, 65536, 512, 576, rng, keep == 2 ? Flavour::kTies : Flavour::kAdjacent);
    pb.mask_stride = 8192 + 16;
    pb.mask.assign(static_cast<size_t>(pb.T * pb.mask_stride), 0);
    for (int64_t t = 0; t < pb.T; ++t)
      for (int64_t b = 0; b < pb.mask_stride; ++b) {
        uint8_t& m = pb.mask[static_cast<size_t>(t * pb.mask_stride + b)];
        if (keep == 0) m = 7;  // any nonzero byte keeps the block
        else if (keep == 2) m = b == (37 * t) % 513;
        else if (keep == 3) m = rng() % 4 != 0;
        else if (keep == 4) m = rng() % 4 == 0;
      }
    const std::string what = "compacted, keep rule " + std::to_string(keep);
    check_topk_all_clusters(pb, reference_topk(pb), what);
    for (bool window : kWindowForms) {
      TopkRun run;
      run.mode = Launch::kPdlLate;
      run.window = window;
      expect_same_bytes(gpu_topk(pb, run), reference_topk(pb), what + ", pdl late, " + form_name(window),
                        pb.out_stride);
    }
  }
  auto pb = make_topk_problem({200000, 3000, 150001}, 200000, 512, 512, rng, Flavour::kNormal);
  pb.mask_stride = 25000;
  pb.mask.resize(static_cast<size_t>(pb.T * pb.mask_stride));
  for (auto& m : pb.mask) m = rng() % 4 == 0;
  for (bool window : kWindowForms)
    for (int cl : {1, 4, 16}) {
      TopkRun run;
      run.cluster = cl;
      run.window = window;
      expect_same_bytes(gpu_topk(pb, run), reference_topk(pb),
                        "long rows with a mask, " + cl_name(cl) + ", " + form_name(window), pb.out_stride);
    }
}

// How many rows of clen walk a chunk tail in clusters of cl CTAs over rows of `stride` slots (the
// kernels' rule, kernels::select_v3_topk_takes_tail): the tail tests assert that theirs do, so that
// a change of the rule cannot leave the tail path untested while they still pass.
int tail_rows(const std::vector<int32_t>& clen, int64_t stride, int cl) {
  int n = 0;
  for (int32_t c : clen) n += c >= 1 && kernels::select_v3_topk_takes_tail(c, stride, cl) ? 1 : 0;
  return n;
}

// Chunk tails (launches of clusters of at most 8 CTAs): a resident chunk whose last round would
// hold at most 512 positions ends with one position per thread after its full rounds instead
// (rows just past a multiple of cluster x 4096, like the benchmark's 65537 = 8 x 8192 + 1).
// Lengths around the tail ranges of every cluster size (cluster 1: 4097..4608 and 8193..8704; 8:
// 32769..36864 and 65537..69632; 16, which takes none: 65537..73728) and just past them (a
// near-full last round, no tail), with ties of the threshold at the tail positions (kTies,
// kAdjacent: their order after every round's positions decides which are taken), a candidate
// mask (the compacted walk, both mask block sizes; and the uncompacted walk), PDL with late
// scores. The pair kernel: PairRowsWithChunkTails.
TEST(GpuIndexerSelectV3, TopkChunkTails) {
  V4_REQUIRE_GPU();
  std::mt19937_64 rng(0x5e1e300a);
  const std::vector<int32_t> clen = {4097, 4100, 4608, 4609, 8193, 8704, 32769, 34817, 36864, 36865,
                                     65537, 65543, 69632, 69633, 73728, 73729, 0, 1};
  const int64_t stride = 73736;
  for (int cl : {1, 2, 4, 8}) EXPECT_GE(tail_rows(clen, stride, cl), 2) << "rows with a tail at cluster " << cl;
  EXPECT_EQ(tail_rows(clen, stride, 16), 0);
  for (Flavour f : {Flavour::kNormal, Flavour::kTies, Flavour::kAdjacent}) {
    const auto pb = make_topk_problem(clen, stride, 512, 576, rng, f);
    const auto want = reference_topk(pb);
    check_topk_all_clusters(pb, want, std::string("tails ") + flavour_name(f));
    for (bool window : kWindowForms) {
      TopkRun run;
      run.mode = Launch::kPdlLate;
      run.cluster = 8;
      run.window = window;
      expect_same_bytes(gpu_topk(pb, run), want,
                        std::string("tails, pdl late, ") + flavour_name(f) + ", " + form_name(window), pb.out_stride);
    }
  }
  // One row per launch (65537 positions and a little more): the 8-CTA chunks' tail positions
  // (the last per - 8192 of each chunk of per positions) made the row's largest scores, with ties
  // among them, so that the tails hold the selected positions.
  for (int32_t n : {65537, 65540, 69000}) {
    EXPECT_EQ(tail_rows({n}, stride, 8), 1) << n;
    auto pb = make_topk_problem({n}, stride, 512, 512, rng, Flavour::kNormal);
    const int64_t per = ((n + 7) / 8 + 7) / 8 * 8;
    for (int64_t r = 0; r < 8; ++r)
      for (int64_t j = r * per + 8192; j < std::min<int64_t>((r + 1) * per, n); ++j)
        pb.scores[static_cast<size_t>(j)] = 1000.0f + static_cast<float>(j % 3);
    check_topk_all_clusters(pb, reference_topk(pb), "one row of " + std::to_string(n) + ", hot tail");
  }
  for (int mask_block : {8, 5}) {
    for (bool compact : {true, false}) {
      auto pb = make_topk_problem(clen, stride, 512, 512, rng, Flavour::kTies);
      pb.mask_block = mask_block;
      pb.mask_stride = (stride + mask_block - 1) / mask_block + 8;
      pb.mask.resize(static_cast<size_t>(pb.T * pb.mask_stride));
      for (auto& m : pb.mask) m = (rng() % 4 == 0) ? 1 : 0;
      // Every tail range's first block kept, so that kept tail groups exist at every cluster size.
      for (int64_t t = 0; t < pb.T; ++t)
        for (int64_t j : {4096, 8192, 32768, 36864, 65536})
          pb.mask[static_cast<size_t>(t * pb.mask_stride + j / mask_block)] = 1;
      const auto want = reference_topk(pb);
      const std::string what = "tails with a mask, block " + std::to_string(mask_block) +
                               (compact ? ", compacted" : ", uncompacted");
      for (bool window : kWindowForms)
        for (int cl : kClusters) {
          TopkOnDevice d(pb);
          d.tp.v3_cluster = cl;
          d.tp.v3_compact = compact;
          d.tp.v3_window = window;
          ErrorCount err;
          d.tp.err_count = err.get();
          TestStream stream;
          kernels::run_indexer_topk(d.tp, stream.s, false);
          V4_CUDA_CHECK_LAUNCH();
          V4_CUDA_CHECK(cudaStreamSynchronize(stream.s));
          EXPECT_EQ(err.read(), 0u) << what;
          expect_same_bytes(d.out.download_checked(), want, what + ", " + cl_name(cl) + ", " + form_name(window),
                            pb.out_stride);
        }
    }
  }
}

TEST(GpuIndexerSelectV3, TopkPaddedAndBadRowsAreContainedAndCounted) {
  V4_REQUIRE_GPU();
  std::mt19937_64 rng(0x5e1e3009);
  // Rows: 0 ok; 1 padded (req -1, stale clen: all -1, not counted); 2 unknown request (req 3 of 3
  // table rows: all -1, counted); 3 clen past the score stride (clamped to 4096, counted); 4 clen
  // < 0 (all -1, counted); 5 ok (a short row); 6 clen past the slot table's stride (the table is
  // 4000 wide: clamped to 4000, counted).
  auto pb = make_topk_problem({3000, 3000, 3000, 3000, 3000, 300, 3000}, 4096, 512, 512, rng, Flavour::kTies);
  pb.table = shuffled_table(3, 4000, 4100, rng);
  auto good = pb;  // the expectation from well-formed rows
  good.req[1] = 0;
  good.req[2] = 0;
  good.clen[3] = 4000;  // rows 3 and 6 are compared to their clamped twins
  good.clen[4] = 0;
  good.clen[6] = 4000;
  auto want = reference_topk(good);
  std::fill_n(want.begin() + 1 * 512, 512, -1);
  std::fill_n(want.begin() + 2 * 512, 512, -1);
  // Row 3 clamps to the score stride (4096) first, then to the table stride (4000): its twin has
  // clen 4000 above.
  pb.req[1] = -1;
  pb.req[2] = 3;
  pb.clen[3] = 5000;
  pb.clen[4] = -7;
  pb.clen[6] = 4096;
  for (bool window : kWindowForms)
    for (int cl : kClusters) {
      unsigned long long errors = 0;
      TopkRun run;
      run.cluster = cl;
      run.window = window;
      run.errors = &errors;
      const auto got = gpu_topk(pb, run);
      EXPECT_EQ(errors, 4u) << cl_name(cl) << " " << form_name(window);
      expect_same_bytes(got, want, "contained rows, " + cl_name(cl) + ", " + form_name(window), pb.out_stride);
    }
}

TEST(GpuIndexerSelectV3, TopkDecodeShapesWithPaddedRows) {
  V4_REQUIRE_GPU();
  std::mt19937_64 rng(0x5e1e300a);
  for (int64_t T : {1, 6, 8, 32, 64}) {
    std::vector<int32_t> clen(static_cast<size_t>(T));
    for (auto& c : clen) c = static_cast<int32_t>(rng() % 32769);
    auto pb = make_topk_problem(clen, 32768, 512, 512, rng, T % 2 == 0 ? Flavour::kTies : Flavour::kNormal);
    if (T > 2) {
      pb.req[T - 1] = -1;  // padded rows give all -1
      pb.clen[T - 2] = 0;
    }
    const auto want = reference_topk(pb);
    TopkRun run;
    run.mode = T == 6 ? Launch::kPdlLate : Launch::kPlain;
    expect_same_bytes(gpu_topk(pb, run), want, "decode T=" + std::to_string(T), pb.out_stride);
    run.cluster = 8;
    run.entry = Entry::kDirect;
    expect_same_bytes(gpu_topk(pb, run), want, "decode T=" + std::to_string(T) + " direct", pb.out_stride);
  }
}

// =================================================================================================
// candidate mask
// =================================================================================================

TEST(GpuIndexerSelectV3, MaskMatchesReference) {
  V4_REQUIRE_GPU();
  std::mt19937_64 rng(0x5e1e3101);
  // Row lengths on both sides of the budget (2048 blocks = 16384 positions) and of the edges.
  const std::vector<int32_t> clen = {0, 1, 7, 8, 9, 511, 512, 513, 4095, 16383, 16384, 16385, 16393, 32768, 65536};
  for (Flavour f : {Flavour::kNormal, Flavour::kTies, Flavour::kAdjacent}) {
    MaskProblem pb;
    pb.T = static_cast<int64_t>(clen.size());
    pb.stride = 65536;
    pb.mask_stride = 8192 + 128;
    pb.clen = clen;
    pb.scores = make_scores(pb.T, pb.stride, clen, rng, f, 3);
    // A few blocks of only -inf (never kept unless newest).
    for (int64_t t = 0; t < pb.T; ++t)
      for (int64_t j = 800; j < std::min<int64_t>(clen[t], 880); ++j) pb.scores[t * pb.stride + j] = -kInf;
    check_mask_all_clusters(pb, std::string("mask ") + flavour_name(f), f == Flavour::kTies ? Launch::kPdlLate : Launch::kPlain);
  }
}

TEST(GpuIndexerSelectV3, MaskBatchesAndBudgets) {
  V4_REQUIRE_GPU();
  std::mt19937_64 rng(0x5e1e3102);
  for (int64_t T : {1, 6, 8, 32, 64}) {
    const auto clen = T == 1 ? std::vector<int32_t>{65536} : cycled_clen(T, kLengths, T + 3);
    for (int budget : {0, 3, 100, 2048, 9000}) {
      if (T >= 32 && budget != 2048) continue;
      MaskProblem pb;
      pb.T = T;
      pb.stride = 65536;
      pb.mask_stride = 8192 + 64;
      pb.clen = clen;
      pb.topk_blocks = budget;
      pb.scores = make_scores(pb.T, pb.stride, clen, rng, budget % 2 == 0 ? Flavour::kTies : Flavour::kNormal, 4);
      check_mask_all_clusters(pb, "mask T=" + std::to_string(T) + " budget " + std::to_string(budget));
    }
  }
}

TEST(GpuIndexerSelectV3, MaskOtherBlockSizes) {
  V4_REQUIRE_GPU();
  std::mt19937_64 rng(0x5e1e3103);
  const std::vector<int32_t> clen = {0, 5, 333, 4000, 12345};
  for (int block : {1, 5, 8, 16}) {
    for (int budget : {3, 100, 2048}) {
      MaskProblem pb;
      pb.T = static_cast<int64_t>(clen.size());
      pb.stride = 12352;
      pb.block = block;
      pb.topk_blocks = budget;
      pb.mask_stride = (pb.stride + block - 1) / block + 3;
      pb.clen = clen;
      pb.scores = make_scores(pb.T, pb.stride, clen, rng, Flavour::kTies, 4);
      check_mask_all_clusters(pb, "block " + std::to_string(block) + " budget " + std::to_string(budget));
    }
  }
}

// The candidate mask at rows whose chunks' last 1024-block round holds few blocks (cluster 1:
// 1025..1536 blocks; 8: 8193..12288, like the benchmark's 65537 positions = 8193 blocks, whose
// newest block is always kept) and just past those ranges, block 8 and 5, both budgets, ties, PDL
// with late scores. (Chunk tails, as the top-k has, measured no gain in the mask: docs/perf.md
// session 19, run 14.)
TEST(GpuIndexerSelectV3, MaskNearlyEmptyLastRounds) {
  V4_REQUIRE_GPU();
  std::mt19937_64 rng(0x5e1e3104);
  for (int block : {8, 5}) {
    const std::vector<int32_t> clen = {1025 * block,     1536 * block,     1536 * block + 1, 8193 * block,
                                       8192 * block + 1, 12288 * block,    12289 * block,    0,
                                       16385 * block,    9000 * block + 3, 4097 * block,     1};
    for (int budget : {100, 2048}) {
      for (Flavour f : {Flavour::kNormal, Flavour::kTies}) {
        MaskProblem pb;
        pb.T = static_cast<int64_t>(clen.size());
        pb.stride = 16392 * block;
        pb.block = block;
        pb.topk_blocks = budget;
        pb.mask_stride = (pb.stride + block - 1) / block + 5;
        pb.clen = clen;
        pb.scores = make_scores(pb.T, pb.stride, clen, rng, f);
        const std::string what = "mask last rounds, block " + std::to_string(block) + " budget " + std::to_string(budget) +
                                 " " + flavour_name(f);
        check_mask_all_clusters(pb, what);
        if (budget == 2048) check_mask_all_clusters(pb, what, Launch::kPdlLate);
      }
    }
  }
}

// More blocks than a CTA keeps resident (24 rounds of 1024 blocks): cluster 1 at 262144 positions
// (32768 blocks), and the same launch's short rows resident; plus v1 / v2 agreement.
TEST(GpuIndexerSelectV3, MaskTiledPathAndOlderVersions) {
  V4_REQUIRE_GPU();
  std::mt19937_64 rng(0x5e1e3104);
  MaskProblem pb;
  pb.clen = {262144, 196609, 70001, 0};
  pb.T = 4;
  pb.stride = 262144;
  pb.mask_stride = 32768 + 16;
  pb.scores = make_scores(pb.T, pb.stride, pb.clen, rng, Flavour::kTies, 3);
  for (int budget : {2048, 30000}) {
    pb.topk_blocks = budget;
    const auto want = reference_mask(pb);
    for (bool window : kWindowForms)
      for (int cl : {1, 2, 0})
        expect_same_bytes(gpu_mask(pb, cl, Launch::kPlain, Entry::kDispatch, nullptr, window), want,
                          "tiled mask, budget " + std::to_string(budget) + ", " + cl_name(cl) + ", " + form_name(window),
                          pb.mask_stride);
    for (Entry e : {Entry::kV1, Entry::kV2, Entry::kDirect})
      expect_same_bytes(gpu_mask(pb, 0, Launch::kPlain, e), want,
                        "mask entry " + std::to_string(static_cast<int>(e)) + ", budget " + std::to_string(budget),
                        pb.mask_stride);
  }
}

TEST(GpuIndexerSelectV3, MaskBadClenIsClampedAndCounted) {
  V4_REQUIRE_GPU();
  std::mt19937_64 rng(0x5e1e3105);
  MaskProblem pb;
  pb.clen = {4096, 9000, -3};
  pb.T = 3;
  pb.stride = 4096;
  pb.mask_stride = 512 + 64;
  pb.scores = make_scores(pb.T, pb.stride, {4096, 4096, 0}, rng, Flavour::kNormal);
  MaskProblem good = pb;
  good.clen = {4096, 4096, 0};
  const auto want = reference_mask(good);
  for (int cl : kClusters) {
    unsigned long long errors = 0;
    const auto got = gpu_mask(pb, cl, Launch::kPlain, Entry::kDispatch, &errors);
    EXPECT_EQ(errors, 2u) << cl_name(cl);
    expect_same_bytes(got, want, "clamped mask rows, " + cl_name(cl), pb.mask_stride);
  }
}

// A top-k problem and a mask problem over the same scores on the device: inputs, poisoned outputs
// and the v3 params of both halves (the caller adds clusters, error counters).
struct SelectionOnDevice : TopkOnDevice {
  PoisonedOutput<uint8_t> mask;
  kernels::CandidateMaskParams mp;
  SelectionOnDevice(const TopkProblem& pb, const MaskProblem& m)
      : TopkOnDevice(pb), mask(static_cast<size_t>(m.T * m.mask_stride)) {
    mp.scores = scores.get();
    mp.score_stride = m.stride;
    mp.clen = clen.get();
    mp.T = m.T;
    mp.block = m.block;
    mp.topk_blocks = m.topk_blocks;
    mp.mask = mask.get();
    mp.mask_stride = m.mask_stride;
    mp.version = 3;
  }
};

// The launchers query (once per device, kernel, cluster size and smem size) whether 16-CTA
// clusters fit; the first such query may happen while a stream is being captured into a graph
// (the prepare cycle is a graph). Shapes no other test uses make the query happen inside the
// capture here.
TEST(GpuIndexerSelectV3, FirstLaunchInsideGraphCapture) {
  V4_REQUIRE_GPU();
  std::mt19937_64 rng(0x5e1e3201);
  const auto pb = make_topk_problem({100000, 99999, 70000, 5000, 100000, 1}, 100000, 512, 512, rng, Flavour::kNormal);
  MaskProblem mp;
  mp.T = pb.T;
  mp.stride = pb.stride;
  mp.clen = pb.clen;
  mp.block = 1;
  mp.topk_blocks = 2048;
  mp.mask_stride = mp.stride + 8;
  mp.scores = pb.scores;
  SelectionOnDevice d(pb, mp);
  {
    TestStream stream;
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    V4_CUDA_CHECK(cudaStreamBeginCapture(stream.s, cudaStreamCaptureModeThreadLocal));
    kernels::run_candidate_mask(d.mp, stream.s, true);
    kernels::run_indexer_topk(d.tp, stream.s, true);
    V4_CUDA_CHECK(cudaStreamEndCapture(stream.s, &graph));
    V4_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    V4_CUDA_CHECK(cudaGraphLaunch(exec, stream.s));
    V4_CUDA_CHECK(cudaStreamSynchronize(stream.s));
    V4_CUDA_CHECK(cudaGraphExecDestroy(exec));
    V4_CUDA_CHECK(cudaGraphDestroy(graph));
  }
  expect_same_bytes(d.out.download_checked(), reference_topk(pb), "top-k in a graph", pb.out_stride);
  expect_same_bytes(d.mask.download_checked(), reference_mask(mp), "mask in a graph", mp.mask_stride);
}

// =================================================================================================
// the pair launch (candidate source: its top-k and its mask over the same scores, one launch)
// =================================================================================================

struct PairResult {
  std::vector<int32_t> topk;
  std::vector<uint8_t> mask;
  bool one_launch = false;
};

// The top-k of `pb` and the mask of its scores (block 8, budget 2048) through
// run_indexer_select_pair_v3, both outputs poisoned.
PairResult gpu_pair(const TopkProblem& pb, const MaskProblem& mp, int cluster, Launch mode, bool window = false) {
  SelectionOnDevice d(pb, mp);
  ErrorCount err;
  d.tp.err_count = d.mp.err_count = err.get();
  d.tp.v3_cluster = d.mp.v3_cluster = cluster;
  d.tp.v3_window = d.mp.v3_window = window;
  PairResult r;
  {
    TestStream stream;
    DeviceBuffer<float> staging;
    late_feed(mode, d.scores, staging, stream.s);
    r.one_launch = kernels::run_indexer_select_pair_v3(d.tp, d.mp, stream.s, pdl_of(mode));
    V4_CUDA_CHECK_LAUNCH();
    V4_CUDA_CHECK(cudaStreamSynchronize(stream.s));
  }
  EXPECT_EQ(err.read(), 0u);
  r.topk = d.out.download_checked();
  r.mask = d.mask.download_checked();
  return r;
}

MaskProblem mask_of(const TopkProblem& pb) {
  MaskProblem mp;
  mp.T = pb.T;
  mp.stride = pb.stride;
  mp.clen = pb.clen;
  mp.scores = pb.scores;
  mp.mask_stride = (pb.stride + mp.block - 1) / mp.block + 24;  // a tail the mask must zero
  return mp;
}

// Both halves against the reference, for the row counts around the one-wave rule (the pair
// launches when 2T clusters of the size the top-k alone takes fit 2 CTAs per SM: at 64K rows on
// 132 SMs T <= 8 and T = 32 (4-CTA clusters), not 9 or 24), every cluster size, plain and PDL.
TEST(GpuIndexerSelectV3, PairMatchesTheTwoSelections) {
  V4_REQUIRE_GPU();
  int dev = 0, sms = 0;
  V4_CUDA_CHECK(cudaGetDevice(&dev));
  V4_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  std::mt19937_64 rng(0x5e1e3301);
  for (int64_t T : {1, 6, 8, 9, 24, 32}) {
    const auto clen = T == 1 ? std::vector<int32_t>{65536} : cycled_clen(T, kLengths, T);
    const Flavour f = T % 2 == 0 ? Flavour::kTies : Flavour::kNormal;
    const auto pb = make_topk_problem(clen, 65536, 512, 576, rng, f);
    const auto mp = mask_of(pb);
    const auto want_t = reference_topk(pb);
    const auto want_m = reference_mask(mp);
    for (bool window : kWindowForms)
      for (int cl : kClusters)
        for (Launch mode : {Launch::kPlain, Launch::kPdlLate}) {
          if (mode == Launch::kPdlLate && cl != 0 && cl != 16) continue;
          const std::string what = "pair T " + std::to_string(T) + " " + flavour_name(f) + ", " + cl_name(cl) + ", " +
                                   form_name(window) + ", " + launch_name(mode);
          const PairResult r = gpu_pair(pb, mp, cl, mode, window);
          expect_same_bytes(r.topk, want_t, what + " (top-k)", pb.out_stride);
          expect_same_bytes(r.mask, want_m, what + " (mask)", mp.mask_stride);
          // An explicit cluster size is one launch whatever T; automatic: the documented rule.
          const bool want_one = cl != 0 || kernels::select_v3_pair_is_one_launch(T, pb.stride, sms);
          EXPECT_EQ(r.one_launch, want_one) << what;
        }
  }
}

// The pair's top-k half over rows with chunk tails (the candidate source at the benchmark's
// 65537 positions; tails at explicit clusters of 1 and 8 CTAs), every cluster size, plain and
// PDL.
TEST(GpuIndexerSelectV3, PairRowsWithChunkTails) {
  V4_REQUIRE_GPU();
  std::mt19937_64 rng(0x5e1e3303);
  for (const std::vector<int32_t>& clen :
       {std::vector<int32_t>{65537}, std::vector<int32_t>{65537, 65540, 36864, 4100, 69632, 65537}}) {
    EXPECT_GE(tail_rows(clen, 73736, 8), 1);
    if (clen.size() > 1) EXPECT_EQ(tail_rows(clen, 73736, 1), 1);  // 4100
    const auto pb = make_topk_problem(clen, 73736, 512, 576, rng, Flavour::kTies);
    const auto mp = mask_of(pb);
    const auto want_t = reference_topk(pb);
    const auto want_m = reference_mask(mp);
    for (bool window : kWindowForms)
      for (int cl : kClusters)
        for (Launch mode : {Launch::kPlain, Launch::kPdlLate}) {
          const std::string what = "pair with tails, T " + std::to_string(pb.T) + ", " + cl_name(cl) + ", " +
                                   form_name(window) + ", " + launch_name(mode);
          const PairResult r = gpu_pair(pb, mp, cl, mode, window);
          expect_same_bytes(r.topk, want_t, what + " (top-k)", pb.out_stride);
          expect_same_bytes(r.mask, want_m, what + " (mask)", mp.mask_stride);
        }
  }
}

// Rows of different kinds in one pair: short rows (fewer valid positions than k / fewer blocks
// than the budget: everything selected), empty rows, and a top-k that reads another layer's mask.
TEST(GpuIndexerSelectV3, PairShortRowsAndAFusedMask) {
  V4_REQUIRE_GPU();
  std::mt19937_64 rng(0x5e1e3302);
  auto pb = make_topk_problem({0, 7, 300, 4096, 16385, 65536}, 65536, 512, 576, rng, Flavour::kAdjacent);
  const auto mp = mask_of(pb);
  pb.mask_stride = 8192;
  pb.mask.resize(static_cast<size_t>(pb.T * pb.mask_stride));
  for (auto& b : pb.mask) b = static_cast<uint8_t>(rng() % 4 == 0);
  const auto want_t = reference_topk(pb);  // with the other mask applied
  const auto want_m = reference_mask(mp);
  for (bool window : kWindowForms) {
    SelectionOnDevice d(pb, mp);  // pb.mask: the top-k's fused (other) mask
    d.tp.v3_window = d.mp.v3_window = window;
    TestStream stream;
    EXPECT_TRUE(kernels::run_indexer_select_pair_v3(d.tp, d.mp, stream.s, false));
    V4_CUDA_CHECK_LAUNCH();
    V4_CUDA_CHECK(cudaStreamSynchronize(stream.s));
    const std::string what = "pair with a fused other mask, " + form_name(window);
    expect_same_bytes(d.out.download_checked(), want_t, what + " (top-k)", pb.out_stride);
    expect_same_bytes(d.mask.download_checked(), want_m, what + " (mask)", mp.mask_stride);
  }
}

// The window rows one position longer (65537: the candidate source's length in the benchmark), so that
// 8-CTA clusters walk chunk tails (topk_tail_walk / topk_tail_compact, out of line): the tails' walks
// record the way as the others do, unmasked and masked.
TEST(GpuIndexerSelectV3, TopkWindowPathsWithChunkTails) {
  V4_REQUIRE_GPU();
  std::mt19937_64 rng(0x5e1e3204);
  const int64_t T = std::size(kWindowRows), n = 65537, stride = 73736;
  auto pb = make_topk_problem(std::vector<int32_t>(static_cast<size_t>(T), n), stride, 512, 576, rng, Flavour::kNormal);
  const std::vector<float> rows = window_rows(rng);
  for (int64_t t = 0; t < T; ++t) {
    std::copy(rows.begin() + t * 65536, rows.begin() + (t + 1) * 65536, pb.scores.begin() + t * stride);
    pb.scores[static_cast<size_t>(t * stride + 65536)] = rows[static_cast<size_t>(t * 65536)];
    for (int64_t j = n; j < stride; ++j) pb.scores[static_cast<size_t>(t * stride + j)] = -kInf;
  }
  ASSERT_EQ(tail_rows(pb.clen, stride, 8), T) << "every row must walk a chunk tail at 8 CTAs";
  for (bool masked : {false, true}) {
    if (masked) {
      pb.mask_block = 8;
      pb.mask_stride = (stride + 7) / 8 + 64;
      pb.mask.assign(static_cast<size_t>(T * pb.mask_stride), 0);
      for (auto& m : pb.mask) m = (rng() % 4 == 0) ? 1 : 0;
      for (int64_t t = 0; t < T; ++t) pb.mask[static_cast<size_t>(t * pb.mask_stride + 777 / 8)] = 1;
    }
    std::vector<uint8_t> rec;
    TopkRun run;
    run.cluster = 8;
    run.window = true;
    run.paths = &rec;
    const std::string what = std::string("window rows with tails, ") + (masked ? "masked" : "unmasked");
    expect_same_bytes(gpu_topk(pb, run), reference_topk(pb), what, pb.out_stride);
    expect_window_paths(rec, predicted_paths(pb), 8, false, what);
  }
}

// The pair over the window rows with both halves' path records: the bytes of both, and each half's
// rows took the predicted ways (the halves are separate clusters and may differ from each other).
TEST(GpuIndexerSelectV3, PairWindowPathRecords) {
  V4_REQUIRE_GPU();
  namespace wp = kernels::select_window_path;
  std::mt19937_64 rng(0x5e1e3203);
  const int64_t T = std::size(kWindowRows);
  auto pb = make_topk_problem(std::vector<int32_t>(static_cast<size_t>(T), 65536), 65536, 512, 576, rng,
                              Flavour::kNormal);
  pb.scores = window_rows(rng);
  const auto mp = mask_of(pb);
  const auto want_t = reference_topk(pb);
  const auto want_m = reference_mask(mp);
  for (int cl : {8, 16}) {
    SelectionOnDevice d(pb, mp);
    d.tp.v3_window = d.mp.v3_window = true;
    d.tp.v3_cluster = d.mp.v3_cluster = cl;
    PoisonedOutput<uint8_t> rec_t(static_cast<size_t>(T) * wp::kMaxRanks), rec_m(static_cast<size_t>(T) * wp::kMaxRanks);
    d.tp.v3_window_paths = rec_t.get();
    d.mp.v3_window_paths = rec_m.get();
    TestStream stream;
    EXPECT_TRUE(kernels::run_indexer_select_pair_v3(d.tp, d.mp, stream.s, false));  // an explicit cluster: one launch
    V4_CUDA_CHECK_LAUNCH();
    V4_CUDA_CHECK(cudaStreamSynchronize(stream.s));
    const std::string what = "pair, window rows, " + cl_name(cl);
    expect_same_bytes(d.out.download_checked(), want_t, what + " (top-k)", pb.out_stride);
    expect_same_bytes(d.mask.download_checked(), want_m, what + " (mask)", mp.mask_stride);
    expect_window_paths(rec_t.download_checked(), predicted_paths(pb), cl, false, what + " (top-k record)");
    expect_window_paths(rec_m.download_checked(), predicted_mask_paths(mp), cl, false, what + " (mask record)");
  }
}

// =================================================================================================
// host checks (no GPU needed: every case is refused before any CUDA call)
// =================================================================================================

template <class T>
T* fake_ptr() {
  return reinterpret_cast<T*>(uintptr_t{0x10000});
}

kernels::IndexerTopkParams valid_topk_params() {
  kernels::IndexerTopkParams p;
  p.scores = fake_ptr<float>();
  p.score_stride = 1024;
  p.clen = fake_ptr<int32_t>();
  p.req = fake_ptr<int32_t>();
  p.T = 2;
  p.comp_slot_table = fake_ptr<int32_t>();
  p.comp_table_stride = 1024;
  p.comp_table_rows = 1;
  p.topk = 512;
  p.out = fake_ptr<int32_t>();
  p.out_stride = 512;
  p.version = 3;
  return p;
}

kernels::CandidateMaskParams valid_mask_params() {
  kernels::CandidateMaskParams p;
  p.scores = fake_ptr<float>();
  p.score_stride = 1024;
  p.clen = fake_ptr<int32_t>();
  p.T = 1;
  p.mask = fake_ptr<uint8_t>();
  p.mask_stride = 128;
  p.version = 3;
  return p;
}

TEST(GpuIndexerSelectV3, HostRefusesBadParams) {
  using kernels::run_indexer_topk;
  using kernels::run_indexer_topk_v3;
  auto refuse_topk = [](const kernels::IndexerTopkParams& p, const char* what) {
    EXPECT_THROW(run_indexer_topk(p, nullptr, false), std::invalid_argument) << what;
    EXPECT_THROW(run_indexer_topk_v3(p, nullptr, false), std::invalid_argument) << what << " (direct)";
  };
  auto p = valid_topk_params();
  p.out_stride = 500;
  refuse_topk(p, "out_stride not a multiple of 64");
  p = valid_topk_params();
  p.topk = 576;
  refuse_topk(p, "topk wider than the output");
  p = valid_topk_params();
  p.topk = -1;
  refuse_topk(p, "negative topk");
  p = valid_topk_params();
  p.score_stride = 0;
  refuse_topk(p, "score_stride 0");
  p = valid_topk_params();
  p.candidate_mask = fake_ptr<uint8_t>();
  p.mask_stride = 100;  // < 1024 / 8
  refuse_topk(p, "mask_stride too small");
  p = valid_topk_params();
  p.candidate_mask = fake_ptr<uint8_t>();
  p.mask_stride = 1024;
  p.mask_block = 0;
  refuse_topk(p, "mask_block 0");
  p = valid_topk_params();
  p.out = nullptr;
  refuse_topk(p, "null out");
  p = valid_topk_params();
  p.scores = nullptr;
  refuse_topk(p, "null scores");
  p = valid_topk_params();
  p.comp_slot_table = nullptr;
  refuse_topk(p, "null table");
  p = valid_topk_params();
  p.T = -1;
  refuse_topk(p, "negative T");
  for (int cl : {3, 5, 32, -1}) {
    p = valid_topk_params();
    p.v3_cluster = cl;
    refuse_topk(p, "v3_cluster not in {0, 1, 2, 4, 8, 16}");
  }
  p = valid_topk_params();
  p.version = 4;
  EXPECT_THROW(run_indexer_topk(p, nullptr, false), std::invalid_argument) << "unknown version";
  p.version = 1;
  EXPECT_THROW(run_indexer_topk(p, nullptr, false), std::invalid_argument) << "version 1 is not selectable";
  // T == 0 launches nothing and needs no pointers (any version).
  p = valid_topk_params();
  p.T = 0;
  p.scores = nullptr;
  EXPECT_NO_THROW(run_indexer_topk(p, nullptr, false));

  using kernels::run_candidate_mask;
  using kernels::run_candidate_mask_v3;
  auto refuse_mask = [](const kernels::CandidateMaskParams& m, const char* what) {
    EXPECT_THROW(run_candidate_mask(m, nullptr, false), std::invalid_argument) << what;
    EXPECT_THROW(run_candidate_mask_v3(m, nullptr, false), std::invalid_argument) << what << " (direct)";
  };
  auto m = valid_mask_params();
  m.mask_stride = 127;
  refuse_mask(m, "mask_stride too small");
  m = valid_mask_params();
  m.block = 0;
  refuse_mask(m, "block 0");
  m = valid_mask_params();
  m.topk_blocks = -1;
  refuse_mask(m, "negative budget");
  m = valid_mask_params();
  m.mask = nullptr;
  refuse_mask(m, "null mask");
  m = valid_mask_params();
  m.score_stride = 0;
  refuse_mask(m, "score_stride 0");
  m = valid_mask_params();
  m.v3_cluster = 12;
  refuse_mask(m, "v3_cluster 12");
  m = valid_mask_params();
  m.version = 2;
  EXPECT_THROW(run_candidate_mask(m, nullptr, false), std::invalid_argument) << "version 2 is not selectable";
  m = valid_mask_params();
  m.T = 0;
  m.mask = nullptr;
  EXPECT_NO_THROW(run_candidate_mask(m, nullptr, false));

  // The pair: whatever either half refuses, and its own rules.
  using kernels::run_indexer_select_pair_v3;
  auto pair_t = valid_topk_params();
  auto pair_m = valid_mask_params();
  pair_m.T = pair_t.T;
  auto refuse_pair = [](const kernels::IndexerTopkParams& tp, const kernels::CandidateMaskParams& mp, const char* what) {
    EXPECT_THROW(run_indexer_select_pair_v3(tp, mp, nullptr, false), std::invalid_argument) << what << " (pair)";
  };
  p = pair_t;
  p.out_stride = 500;
  refuse_pair(p, pair_m, "pair: top-k out_stride not a multiple of 64");
  m = pair_m;
  m.block = 0;
  refuse_pair(pair_t, m, "pair: mask block 0");
  m = pair_m;
  m.T = pair_t.T + 1;
  refuse_pair(pair_t, m, "pair: different T");
  m = pair_m;
  m.v3_cluster = 4;
  refuse_pair(pair_t, m, "pair: different v3_cluster");
  m = pair_m;
  m.v3_window = true;
  refuse_pair(pair_t, m, "pair: different v3_window");
  p = pair_t;
  p.candidate_mask = pair_m.mask;
  p.mask_stride = 1024;
  refuse_pair(p, pair_m, "pair: the top-k reads the mask being written");
  p = pair_t;
  m = pair_m;
  p.T = m.T = 0;
  p.scores = m.scores = nullptr;
  EXPECT_NO_THROW(run_indexer_select_pair_v3(p, m, nullptr, false));
}

}  // namespace
