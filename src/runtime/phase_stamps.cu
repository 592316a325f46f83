// Host side of the phase stamps (see runtime/phase_stamps.cuh).
#include "runtime/phase_stamps.h"

#include <cstdio>
#include <stdexcept>
#include <vector>

#include "runtime/cuda_utils.h"
#include "runtime/phase_stamps.cuh"

namespace v4attn::stamps {

#ifdef V4ATTN_PHASE_STAMPS
namespace {
constexpr unsigned int kRecords = 1u << 16;  // stamping threads per recorded cycle
std::vector<void (*)(void*, void*, unsigned int)>& units() {
  static std::vector<void (*)(void*, void*, unsigned int)> u;
  return u;
}
Entry* d_entries = nullptr;
unsigned int* d_count = nullptr;
}  // namespace

int register_unit(void (*bind)(void*, void*, unsigned int)) {
  units().push_back(bind);
  return static_cast<int>(units().size());
}
bool available() { return true; }
void reset() {
  if (d_entries == nullptr) {
    V4_CUDA_CHECK(cudaMalloc(&d_entries, sizeof(Entry) * kRecords * kPhases));
    V4_CUDA_CHECK(cudaMalloc(&d_count, sizeof(unsigned int)));
    for (auto bind : units()) bind(d_entries, d_count, kRecords);
  }
  V4_CUDA_CHECK(cudaDeviceSynchronize());
  V4_CUDA_CHECK(cudaMemset(d_entries, 0, sizeof(Entry) * kRecords * kPhases));
  V4_CUDA_CHECK(cudaMemset(d_count, 0, sizeof(unsigned int)));
  V4_CUDA_CHECK(cudaDeviceSynchronize());
}
long dump(const std::string& path) {
  V4_CUDA_CHECK(cudaDeviceSynchronize());
  unsigned int n = 0;
  V4_CUDA_CHECK(cudaMemcpy(&n, d_count, sizeof(n), cudaMemcpyDeviceToHost));
  if (n > kRecords) n = kRecords;
  std::vector<Entry> e(static_cast<size_t>(n) * kPhases);
  if (n) V4_CUDA_CHECK(cudaMemcpy(e.data(), d_entries, sizeof(Entry) * e.size(), cudaMemcpyDeviceToHost));
  FILE* f = std::fopen(path.c_str(), "w");
  if (!f) throw std::runtime_error("cannot write " + path);
  std::fprintf(f, "# v4attn phase stamps v2: global_ns gridid kind sm cta_x cta_y phase record\n");
  long written = 0;
  for (const Entry& x : e) {
    if (x.global_ns == 0) continue;
    // global_ns gridid kind sm cta_x cta_y phase record
    std::fprintf(f, "%llu %llu %llu %llu %llu %llu %llu %llu\n", x.global_ns, x.gridid, x.meta >> 56, (x.meta >> 48) & 0xff,
                 (x.meta >> 32) & 0xffff, (x.meta >> 24) & 0xff, x.meta & 0xff, x.record);
    ++written;
  }
  std::fclose(f);
  return written;
}
#else
bool available() { return false; }
void reset() {}
long dump(const std::string&) { return 0; }
#endif

}  // namespace v4attn::stamps
