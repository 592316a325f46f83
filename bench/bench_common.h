// Helpers shared by the benchmark harnesses (bench/*.cu): the HBM bytes floor, the L2 flush,
// CUDA-event timing, the median of timings, host <-> device copies and the JSON row file.
// Header-only (inline): every bench is one translation unit of its own.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <functional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "runtime/cuda_utils.h"
#include "v4attn/build_info.h"
#include "v4attn/cycle_floor.h"

namespace v4attn::bench {

// The measured D2D copy rate of the H200: what "floor" (the least time to move a kernel's bytes)
// is computed at, so that %floor compares against what the memory really delivers.
constexpr double kHbmBytesPerSecond = kFloorBytesPerUs * 1e6;  // the cycle floor's rate (cycle_floor.h)
// More than twice the 60 MB L2: a memset of it evicts whatever the previous launch left there.
constexpr size_t kFlushBytes = size_t{128} << 20;

// Microseconds to move `bytes` at kHbmBytesPerSecond.
inline double floor_us(int64_t bytes) { return static_cast<double>(bytes) / kHbmBytesPerSecond * 1e6; }
// Percent of the floor reached by a run of `us` microseconds; 0 when `us` was not measured.
inline double pct_of_floor(int64_t bytes, double us) { return us > 0.0 ? 100.0 * floor_us(bytes) / us : 0.0; }

// Table cells: "-" for a figure that was not measured (<= 0), so a skipped column is not read as 0.
inline std::string fmt_us(double us) {
  if (us <= 0.0) return "-";
  char b[32];
  std::snprintf(b, sizeof(b), "%.2f", us);
  return b;
}
inline std::string fmt_pct(double pct) {
  if (pct <= 0.0) return "-";
  char b[32];
  std::snprintf(b, sizeof(b), "%.1f%%", pct);
  return b;
}

// The median of event timings (ms) in microseconds. The upper median for an even count: the
// benches have always reported that element, and changing it would shift their history.
inline double median_us(std::vector<float> ms) {
  if (ms.empty()) throw std::invalid_argument("bench::median_us: no timings");
  std::nth_element(ms.begin(), ms.begin() + ms.size() / 2, ms.end());
  return static_cast<double>(ms[ms.size() / 2]) * 1000.0;
}

// Evicts L2 before a timed launch so that every launch starts cold, like the first touch of a
// layer's weights in the engine.
class L2Flush {
 public:
  L2Flush() : buf_(kFlushBytes) {}
  // Queues the memset on `s`; the fill byte follows `i` so that no two flushes in a row are alike.
  void flush(cudaStream_t s, int i) { V4_CUDA_CHECK(cudaMemsetAsync(buf_.get(), i & 0xff, buf_.bytes(), s)); }

 private:
  DeviceBuffer<uint8_t> buf_;
};

// A start / stop pair of CUDA events, owned (freed on every exit path, exceptions included).
class EventTimer {
 public:
  EventTimer() {
    V4_CUDA_CHECK(cudaEventCreate(&start_));
    try {
      V4_CUDA_CHECK(cudaEventCreate(&stop_));
    } catch (...) {
      cudaEventDestroy(start_);
      throw;
    }
  }
  ~EventTimer() {
    cudaEventDestroy(start_);
    cudaEventDestroy(stop_);
  }
  EventTimer(const EventTimer&) = delete;
  EventTimer& operator=(const EventTimer&) = delete;

  // Milliseconds between events recorded on `s` before and after `queue()` (which queues work on
  // `s`); waits for the stop event.
  template <class Queue>
  float time_ms(cudaStream_t s, Queue&& queue) {
    V4_CUDA_CHECK(cudaEventRecord(start_, s));
    queue();
    V4_CUDA_CHECK(cudaEventRecord(stop_, s));
    V4_CUDA_CHECK(cudaEventSynchronize(stop_));
    float t = 0.0f;
    V4_CUDA_CHECK(cudaEventElapsedTime(&t, start_, stop_));
    return t;
  }

 private:
  cudaEvent_t start_ = nullptr, stop_ = nullptr;
};

// Median time of one launch with a cold L2: 5 warm-ups (module load, the launch path's caches),
// then `reps` launches, each after an L2 flush and timed alone with events.
inline double cold_l2_median_us(const std::function<void(cudaStream_t)>& launch, int reps, L2Flush& l2,
                                cudaStream_t s) {
  EventTimer timer;
  for (int i = 0; i < 5; ++i) launch(s);
  std::vector<float> ms;
  ms.reserve(static_cast<size_t>(reps));
  for (int i = 0; i < reps; ++i) {
    l2.flush(s, i);
    ms.push_back(timer.time_ms(s, [&] { launch(s); }));
  }
  return median_us(std::move(ms));
}

// Per-launch time of `launches` back-to-back launches (launch(s, i) queues launch i on `s`)
// captured in one CUDA graph: median over `replays` timed replays (after `warmups`) of
// (replay time / launches). No host launch latency between the launches: how the engine runs them.
// The caller rotates whatever must not stay in L2 (weight copies) by i.
inline double graph_per_launch_us(const std::function<void(cudaStream_t, int)>& launch, int launches, cudaStream_t s,
                                  int warmups = 2, int replays = 15) {
  cudaGraph_t graph = nullptr;
  V4_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeRelaxed));
  try {
    for (int i = 0; i < launches; ++i) launch(s, i);
  } catch (...) {
    cudaGraph_t junk = nullptr;
    cudaStreamEndCapture(s, &junk);
    if (junk) cudaGraphDestroy(junk);
    throw;
  }
  V4_CUDA_CHECK(cudaStreamEndCapture(s, &graph));
  cudaGraphExec_t exec = nullptr;
  const cudaError_t inst = cudaGraphInstantiate(&exec, graph, 0);
  cudaGraphDestroy(graph);
  V4_CUDA_CHECK(inst);
  EventTimer timer;
  std::vector<float> ms;
  try {
    for (int r = 0; r < warmups + replays; ++r) {
      const float t = timer.time_ms(s, [&] { V4_CUDA_CHECK(cudaGraphLaunch(exec, s)); });
      if (r >= warmups) ms.push_back(t);
    }
  } catch (...) {
    cudaGraphExecDestroy(exec);
    throw;
  }
  V4_CUDA_CHECK(cudaGraphExecDestroy(exec));
  return median_us(std::move(ms)) / launches;
}

// A device copy of a host vector (one element when it is empty, so that get() is never null).
template <class T>
DeviceBuffer<T> to_device(const std::vector<T>& h) {
  DeviceBuffer<T> d(std::max<size_t>(h.size(), 1));
  if (!h.empty()) d.upload(h.data(), h.size());
  return d;
}
// The first `n` elements of a device buffer.
template <class T>
std::vector<T> to_host(const DeviceBuffer<T>& d, size_t n) {
  std::vector<T> h(n);
  d.download(h.data(), n);
  return h;
}

// Writes the rows (a JSON array) to `path`, indented; throws when the file cannot be opened.
inline void write_json(const std::string& path, const nlohmann::json& rows) {
  std::ofstream f(path);
  if (!f) throw std::runtime_error("cannot write " + path);
  f << rows.dump(2) << "\n";
}

// `--version`: the bench's name and the build (version, commit, options) it was built from.
inline void add_version_flag(CLI::App& app, const char* bench_name) {
  app.set_version_flag("--version", std::string(bench_name) + ": v4attn " + build_string());
}

// False (after saying why on stderr, prefixed by the bench's name) when no sm_90 GPU is present;
// true after printing the build line (which commit the figures that follow come from).
inline bool gpu_present(const char* bench_name) {
  std::string reason;
  if (gpu_available(&reason)) {
    std::printf("%s: build v4attn %s\n", bench_name, build_string().c_str());
    return true;
  }
  std::fprintf(stderr, "%s: needs an sm_90 GPU: %s\n", bench_name, reason.c_str());
  return false;
}

// The exit status of a run that got this far: 1 (saying so on stderr) when a kernel did not match
// its reference, so that a script never takes a wrong kernel's timings for a result.
inline int validity_exit_code(const char* bench_name, bool all_valid) {
  if (all_valid) return 0;
  std::fprintf(stderr, "%s: some kernels do not match the reference (see 'valid')\n", bench_name);
  return 1;
}

}  // namespace v4attn::bench
