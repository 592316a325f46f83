// Phase stamps: an opt-in measurement build (-DV4ATTN_PHASE_STAMPS) in which kernels record
// (%globaltimer, %gridid, kernel kind, CTA, phase) at points of their critical path into one
// device buffer, so that the time between, say, a GEMM's PDL wait and its first consumed stage can
// be read per CTA inside the real cycle (CUPTI only gives kernel begin and end). Without the
// definition every stamp compiles to nothing. Host side: runtime/phase_stamps.h.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/device_common.cuh"

namespace v4attn::stamps {

enum Kind : uint32_t { kGemmV2 = 1, kGemmV3 = 2, kRmsNorm = 3, kActQuant = 4, kQRopeStore = 5, kQChain = 6,
                    kSelectTopk = 7, kSelectMask = 8, kGemv = 9, kQPack = 10, kScores = 11 };

#ifdef V4ATTN_PHASE_STAMPS
// A stamping thread takes a record of kPhases entries with one atomic (its first stamp, placed
// where its latency is hidden, e.g. before a PDL wait) and then writes entries without any round
// trip, so that the stamps barely move the timeline they measure.
constexpr unsigned int kPhases = 128;
struct Entry {
  // gridid: the launch's %gridid (unique per grid launch, graph replays included), so that a script
  // groups CTAs into launches exactly. record: the stamping thread's record index.
  unsigned long long global_ns, gridid, meta, record;
};
// One copy per translation unit (no relocatable device code); runtime/phase_stamps.cu binds each.
static __device__ Entry* g_entries = nullptr;
static __device__ unsigned int* g_count = nullptr;
static __device__ unsigned int g_records = 0;

// t: a %globaltimer value read earlier (e.g. at kernel entry, before a record is taken), or 0 for now.
__device__ __forceinline__ void write_entry(unsigned int record, uint32_t kind, uint32_t phase, unsigned long long t = 0) {
  if (g_entries == nullptr || record >= g_records || phase >= kPhases) return;
  if (t == 0) t = dev::globaltimer_ns();
  unsigned long long c;
  asm volatile("mov.u64 %0, %%gridid;" : "=l"(c));
  unsigned int sm;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
  g_entries[record * kPhases + phase] =
      Entry{t, c,
            (static_cast<unsigned long long>(kind) << 56) | (static_cast<unsigned long long>(sm) << 48) |
                (static_cast<unsigned long long>(blockIdx.x & 0xffffu) << 32) |
                (static_cast<unsigned long long>(blockIdx.y & 0xffu) << 24) | phase,
            static_cast<unsigned long long>(record)};
}
__device__ __forceinline__ unsigned int begin(uint32_t kind, uint32_t phase) {
  if (g_entries == nullptr) return 0xffffffffu;
  const unsigned int r = atomicAdd(g_count, 1u);
  write_entry(r, kind, phase);
  return r;
}
// Binds this translation unit's copy of the buffer pointers (host; called through the registry).
static inline void bind_this_unit(void* entries, void* count, unsigned int records) {
  cudaMemcpyToSymbol(g_entries, &entries, sizeof(void*));
  cudaMemcpyToSymbol(g_count, &count, sizeof(void*));
  cudaMemcpyToSymbol(g_records, &records, sizeof(unsigned int));
}
int register_unit(void (*bind)(void*, void*, unsigned int));
#define V4ATTN_STAMP_UNIT() \
  static const int v4attn_stamp_unit_registered = ::v4attn::stamps::register_unit(&::v4attn::stamps::bind_this_unit)
#define V4ATTN_STAMP_BEGIN(rec, kind, phase) rec = ::v4attn::stamps::begin((kind), (phase))
#define V4ATTN_STAMP_AT(rec, kind, phase) ::v4attn::stamps::write_entry((rec), (kind), (phase))
// The time now into `t` (no memory access), to be written later as a phase: V4ATTN_STAMP_AT_TIME.
#define V4ATTN_STAMP_NOW(t) ((t) = ::v4attn::dev::globaltimer_ns())
#define V4ATTN_STAMP_AT_TIME(rec, kind, phase, t) ::v4attn::stamps::write_entry((rec), (kind), (phase), (t))
#else
#define V4ATTN_STAMP_UNIT() static_assert(true, "")
#define V4ATTN_STAMP_BEGIN(rec, kind, phase) ((void)(rec))
#define V4ATTN_STAMP_AT(rec, kind, phase) ((void)(rec))
#define V4ATTN_STAMP_NOW(t) ((void)(t))
#define V4ATTN_STAMP_AT_TIME(rec, kind, phase, t) ((void)(rec), (void)(t))
#endif

}  // namespace v4attn::stamps
