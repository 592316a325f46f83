// Device-side helpers shared by every kernel: PDL wrappers, the out-of-range error counter,
// warp reductions in the LaneSum order of numerics.h.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "v4attn/numerics.h"

namespace v4attn::dev {

// Programmatic dependent launch (sm_90). pdl_wait: block until the stream predecessor's memory
// is visible (no-op when the kernel was launched without PDL). pdl_launch_dependents: allow the
// successor to start its prologue. Both compile to nothing below sm_90.
//
// Trigger policy (V4ATTN_PDL_TRIGGER_AT_WAIT, default 1): pdl_wait() also issues
// launch_dependents BEFORE it waits, so a kernel's successor may launch as soon as every CTA of
// this kernel has reached its wait, i.e. while this kernel still runs, and start its own prologue
// (weight TMA / weight loads) early. This is safe by construction: the successor's own
// griddepcontrol.wait still blocks until this grid has COMPLETED and its memory is visible (the
// trigger only moves the successor's launch, never what it may read), and every kernel here reads
// nothing a predecessor writes before its wait. No deadlock: the successor launches only after
// all CTAs of this grid are resident (each CTA triggers when it runs). The kernels keep their
// trigger after the last store too (a repeated trigger is a no-op), which is the whole policy
// with V4ATTN_PDL_TRIGGER_AT_WAIT=0.
#ifndef V4ATTN_PDL_TRIGGER_AT_WAIT
#define V4ATTN_PDL_TRIGGER_AT_WAIT 1
#endif
// The SM's nanosecond global timer (%globaltimer): the wq_b GEMM's paced weight stages and the
// phase stamps of measurement builds.
__device__ __forceinline__ uint64_t globaltimer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#if V4ATTN_PDL_TRIGGER_AT_WAIT
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
// The value is computed at this point of the program: an empty volatile asm that reads and
// writes it is ordered with the other volatile asms (pdl_wait's griddepcontrol.wait among them), so
// an integer division of launch constants placed before pdl_wait() is paid there, while the CTA
// waits for its predecessor, and not on the critical path right after the wait (where ptxas would
// otherwise schedule it, next to its first use).
__device__ __forceinline__ void pin_here(int& v) { asm volatile("" : "+r"(v)); }
// griddepcontrol.wait without the trigger of pdl_wait(): for a kernel that wants its successor
// launched only after its last store (per-kernel opt-out of the trigger policy above).
__device__ __forceinline__ void pdl_wait_no_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// ---- L2 policy of streamed bytes -----------------------------------------------------------------------
// A prepare cycle streams 2.16 GB of weights (and the index-K cache) through a 60 MB L2, each byte
// once. Loaded under the default policy they push out, every layer, what IS reused: the kernels'
// code (every launch fetched its instructions from DRAM again), activations, split-K partials,
// hand-off counters, the scores between the scores kernel and the top-k. Loads of bytes read once
// per cycle take this policy (evict first) instead; the bytes are the same, only L2 replacement
// changes. createpolicy is one instruction (no memory access), so callers make it where they load.
__device__ __forceinline__ uint64_t l2_policy_stream() {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
  return policy;
}
// cp.async of 16 bytes (L2 only) under `policy`; src_bytes < 16 zero-fills the rest (0: no read).
__device__ __forceinline__ void cp_async16_stream(uint32_t dst, const void* src, uint64_t policy, int src_bytes = 16) {
  asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2, %3;\n" ::"r"(dst), "l"(src), "r"(src_bytes),
               "l"(policy)
               : "memory");
}
// cp.async of 4 bytes (L1 + L2) under `policy`; src_bytes 0 zero-fills without reading.
__device__ __forceinline__ void cp_async4_stream(uint32_t dst, const void* src, uint64_t policy, int src_bytes = 4) {
  asm volatile("cp.async.ca.shared.global.L2::cache_hint [%0], [%1], 4, %2, %3;\n" ::"r"(dst), "l"(src), "r"(src_bytes),
               "l"(policy)
               : "memory");
}
// __ldg of a float4 under `policy`.
__device__ __forceinline__ float4 ldg_stream(const float4* p, uint64_t policy) {
  float4 v;
  asm volatile("ld.global.nc.L2::cache_hint.v4.f32 {%0, %1, %2, %3}, [%4], %5;\n"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
               : "l"(p), "l"(policy));
  return v;
}

// Kernels never write outside the cache they are given: a slot outside [0, n_slots) is skipped
// and counted here (one counter per error class; the host reads and resets it).
struct ErrorCounters {
  unsigned long long* slot_out_of_range = nullptr;  // device pointer, may be null (no counting)
};
__device__ __forceinline__ void count_error(unsigned long long* counter) {
  if (counter) atomicAdd(counter, 1ull);
}

// Butterfly sum over the 32 lanes of a warp (offsets 16, 8, 4, 2, 1): the combine step of the
// LaneSum order. Every lane returns the same total (IEEE addition is commutative).
__device__ __forceinline__ float warp_lane_sum(float partial) {
#pragma unroll
  for (int off = 16; off >= 1; off >>= 1) partial = num::add_rn(partial, __shfl_xor_sync(0xffffffffu, partial, off));
  return partial;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int off = 16; off >= 1; off >>= 1) v = num::max_f(v, __shfl_xor_sync(0xffffffffu, v, off));
  return v;
}

}  // namespace v4attn::dev
