// Thin PTX wrappers for the sm_90a GEMMs v2 and v3 (gemm_wgmma.cu, gemm_wgmma_pipelined.cu), the
// fused Q chain (gemm_qchain.cu) and the selection v3's histogram exchange
// (kernels/indexer_select_v3.cu): mbarriers, TMA, ldmatrix, wgmma fences / groups, setmaxnreg,
// thread-block clusters and distributed shared memory, and the two ways of widening e4m3 codes to
// f16 (the cvt instruction, or integer ops with the result scaled by 2^-8). Device-only; every function is one or a few instructions.
#pragma once

#include <cstdint>

#include "gemm/ring_pos.h"  // RingPos (host and device)
#include "kernels/device_common.cuh"

namespace v4attn::kernels::hopper {

__device__ __forceinline__ uint32_t smem_u32(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }

// ---- mbarriers ------------------------------------------------------------------------------------
__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
// Makes the initialised barriers visible to the async proxy (TMA) and to the other threads.
__device__ __forceinline__ void fence_mbarrier_init() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }
// Release semantics (CTA scope): this thread's earlier memory accesses are ordered before the arrival.
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
// The spin loop around one mbarrier.try_wait form (TRY_WAIT: the instruction up to its predicate).
#define V4ATTN_MBAR_WAIT_LOOP(TRY_WAIT) \
  "{\n.reg .pred P1;\nWAIT_LOOP:\n" TRY_WAIT " P1, [%0], %1;\n@P1 bra WAIT_DONE;\nbra WAIT_LOOP;\nWAIT_DONE:\n}\n"
// Blocks until the phase with parity `parity` of the barrier has completed (acquire, CTA scope).
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  asm volatile(V4ATTN_MBAR_WAIT_LOOP("mbarrier.try_wait.parity.shared::cta.b64") ::"r"(bar), "r"(parity) : "memory");
}
// The same, with cluster-scope acquire: data that other CTAs of the cluster wrote into this CTA's
// shared memory with st.async (completing on this barrier) is visible after it returns.
__device__ __forceinline__ void mbar_wait_cluster(uint32_t bar, uint32_t parity) {
  asm volatile(V4ATTN_MBAR_WAIT_LOOP("mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64")::"r"(bar),
               "r"(parity)
               : "memory");
}
#undef V4ATTN_MBAR_WAIT_LOOP

// ---- TMA ----------------------------------------------------------------------------------------------
// 3-D tile load into this CTA's shared memory, completing on `bar` (bytes counted by tx).
__device__ __forceinline__ void tma_load_3d(uint32_t dst, const void* map, uint32_t bar, int c0, int c1, int c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5}], [%2];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}
// The same with an L2 cache policy (createpolicy's 64-bit descriptor) for the loaded lines.
__device__ __forceinline__ void tma_load_3d_hint(uint32_t dst, const void* map, uint32_t bar, int c0, int c1, int c2,
                                                 uint64_t policy) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint"
      " [%0], [%1, {%3, %4, %5}], [%2], %6;\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "l"(policy)
      : "memory");
}
// A weight tile: a 3-D TMA load under dev::l2_policy_stream (device_common.cuh: why).
__device__ __forceinline__ void tma_load_weights_3d(uint32_t dst, const void* map, uint32_t bar, int c0, int c1, int c2) {
  tma_load_3d_hint(dst, map, bar, c0, c1, c2, dev::l2_policy_stream());
}
__device__ __forceinline__ void prefetch_tensormap(const void* map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}
// Ordinary shared-memory stores of this thread become visible to the async proxy (wgmma operands).
__device__ __forceinline__ void fence_proxy_async_smem() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// ---- CTA-level -------------------------------------------------------------------------------------------
__device__ __forceinline__ void named_barrier_sync(uint32_t id, uint32_t threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
// Register budget of this warp (sm_90a); executed by all warps of a warpgroup.
template <uint32_t kRegs>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}
template <uint32_t kRegs>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}

// ---- thread-block clusters -------------------------------------------------------------------------
// Every thread of every CTA of the cluster arrives (release: its earlier shared-memory writes become
// visible cluster-wide) and waits for all of them (acquire). Non-.aligned forms: the threads of a
// warp may reach it after divergent code.
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;\n" ::: "memory");
}
// The same without release semantics: only for the final barrier that keeps every CTA's shared
// memory alive until the cluster's remote reads of it are done (their values are consumed before
// it, so the reads are complete; no writes need publishing, and a release would wait for this
// thread's outstanding global stores).
__device__ __forceinline__ void cluster_sync_relaxed() {
  asm volatile("barrier.cluster.arrive.relaxed;\nbarrier.cluster.wait.acquire;\n" ::: "memory");
}
// The shared::cluster address of `local_addr` (a shared::cta address of this CTA) in CTA `rank`
// of the cluster.
__device__ __forceinline__ uint32_t map_to_cluster_rank(uint32_t local_addr, uint32_t rank) {
  uint32_t r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(r) : "r"(local_addr), "r"(rank));
  return r;
}
// Fire-and-forget 16-byte store into the shared memory of a CTA of the cluster (`cluster_addr`, from
// map_to_cluster_rank) that signals its 16 bytes as complete-tx on that CTA's mbarrier `cluster_bar`
// (also a shared::cluster address): the receiver waits on its barrier, no cluster barrier and no
// memory fence on the sender.
__device__ __forceinline__ void st_async_v4(uint32_t cluster_addr, uint4 v, uint32_t cluster_bar) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32 [%0], {%1, %2, %3, %4}, [%5];\n" ::"r"(
                   cluster_addr),
               "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w), "r"(cluster_bar)
               : "memory");
}
__device__ __forceinline__ float4 ld_cluster_f32x4(uint32_t cluster_addr) {
  float4 v;
  asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];\n"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
               : "r"(cluster_addr)
               : "memory");
  return v;
}

// ---- wgmma ----------------------------------------------------------------------------------------------
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
// Waits until at most kPending of this warpgroup's committed wgmma groups are still in flight.
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}
// Keeps the compiler from moving reads of the accumulators above the wgmma wait.
template <int R>
__device__ __forceinline__ void fence_registers(float (&d)[R]) {
#pragma unroll
  for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
// wgmma shared-memory matrix descriptor, 128B-swizzle K-major: start address >> 4 (bits 0-13),
// leading byte offset 1 (unused for swizzled K-major layouts), stride byte offset 1024 >> 4 (the
// next 8-row group), layout type 1 = 128B swizzle (bits 62-63), base offset 0 (atoms 1024-aligned).
__device__ __forceinline__ uint64_t make_desc_sw128(uint32_t smem_addr) {
  return static_cast<uint64_t>((smem_addr & 0x3FFFFu) >> 4) | (uint64_t{1} << 16) | (uint64_t{1024 >> 4} << 32) |
         (uint64_t{1} << 62);
}

// ---- e4m3 -> f16 ------------------------------------------------------------------------------------
// (a) The cvt instruction: the byte pair (b0, b1) of the low 16 bits / (b2, b3) of the high 16 bits
//     of a word -> f16x2. Exact (every e4m3 value is an f16 value). One F2FP per pair, but the
//     conversion pipe of Hopper is slow (16 results / clock / SM).
__device__ __forceinline__ uint32_t e4m3x2_lo_to_f16x2(uint32_t w) {
  uint32_t r;
  asm("{\n.reg .b16 lo, hi;\nmov.b32 {lo, hi}, %1;\ncvt.rn.f16x2.e4m3x2 %0, lo;\n}\n" : "=r"(r) : "r"(w));
  return r;
}
__device__ __forceinline__ uint32_t e4m3x2_hi_to_f16x2(uint32_t w) {
  uint32_t r;
  asm("{\n.reg .b16 lo, hi;\nmov.b32 {lo, hi}, %1;\ncvt.rn.f16x2.e4m3x2 %0, hi;\n}\n" : "=r"(r) : "r"(w));
  return r;
}
// (b) Integer ops (ALU pipe): an e4m3 byte s.eeee.mmm placed as the f16 bit pattern s.0eeee.mmm0000000
//     is the f16 value x * 2^-8, exactly, for every finite code: normal codes (e >= 1) become f16
//     normals with exponent e - 15 = (e - 7) - 8, subnormal codes (m / 8 * 2^-6) become the f16
//     subnormals m / 8 * 2^-14. (The e4m3fn NaN codes 0x7F / 0xFF become +-480 * 2^-8; the
//     quantizers never produce them.) Pairs are (b0, b2) and (b1, b3), the first byte in the low half.
__device__ __forceinline__ uint32_t e4m3x4_even_to_f16x2_scaled(uint32_t w) {  // (b0, b2) * 2^-8
  return ((w << 8) & 0x80008000u) | ((w << 7) & 0x3F803F80u);
}
__device__ __forceinline__ uint32_t e4m3x4_odd_to_f16x2_scaled(uint32_t w) {  // (b1, b3) * 2^-8
  return (w & 0x80008000u) | ((w >> 1) & 0x3F803F80u);
}
// f16x2 * 256 (exact for the values above: it only undoes their 2^-8).
__device__ __forceinline__ uint32_t f16x2_times_256(uint32_t h) {
  uint32_t r;
  asm("mul.rn.f16x2 %0, %1, %2;\n" : "=r"(r) : "r"(h), "r"(0x5C005C00u));
  return r;
}

// ---- mma.sync m16n8k16, fp32 accumulate ---------------------------------------------------------------
// d = A * B + c; A 16 x 16 (a0..a3), B 16 x 8 (b0, b1), f16 inputs (kF16) or bf16 (v1, v5, v6).
template <bool kF16>
__device__ __forceinline__ void mma_m16n8k16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1,
                                             const float (&c)[4]) {
  if constexpr (kF16) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%10,%11,%12,%13};\n"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
  } else {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%10,%11,%12,%13};\n"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
  }
}

}  // namespace v4attn::kernels::hopper
