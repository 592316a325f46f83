// Indexer selection v3 (spec 3.4): top-k -> slots and the candidate-source block mask, built for
// LATENCY (a few rows of up to 64K+ positions while the GPU is otherwise idle). Twins of
// ref::topk_to_slots (optionally after ref::apply_candidate_mask, fused) and ref::candidate_mask,
// bit-identical to v1 / v2 (src/kernels/indexer_topk.cu): exact indices, exact tie order.
//
// Grid: cluster * T CTAs of 512 threads, one thread-block CLUSTER of `cluster` CTAs (1..16) per
// row (row t = blockIdx.x / cluster, chunk = the CTA's rank in its cluster). One CTA owns the
// contiguous chunk [rank * per, (rank + 1) * per) of the row's elements (positions for top-k,
// candidate blocks for the mask; per = ceil(n / cluster) rounded up to 8), processed in "rounds"
// of 512 * N elements (thread i owns the N consecutive elements i*N .. i*N+N-1 of each round).
// The pair kernel (run_indexer_select_pair_v3) runs T top-k clusters then T mask clusters of one
// size in one grid. Up to 2 CTAs per SM (the register cap); launches of at most
// kOneCtaPerSmMaxCtas CTAs take one SM per CTA (launch_plan); the automatic cluster size is in
// make_plan.
//
// Keys: each element's order-preserving 32-bit key (-0.0 folded onto +0.0, since the reference
// compares floats and -0.0 == +0.0), 0 for an element that can never be selected (value not >
// -inf: -inf, NaN, masked, past clen). Valid keys are >= 0x00800000. The reference order is
// (value descending, index ascending); the top k is {key > K*} plus the lowest-index k_eq keys
// == K*, K* the k-th largest key.
//
// 1. Load: the CTA reads its chunk from global memory ONCE and keeps the keys in shared memory
//    ("resident"). A chunk larger than the CTA's key capacity (rows longer than cluster * 24K
//    positions / 192K blocks) is not kept: each pass re-reads it (from L2), same results.
//    A resident top-k chunk whose last round would hold at most 512 positions (rows just past a
//    multiple of cluster * 4096) ends with one position per thread instead (Chunk's kTail; in
//    launches of clusters of at most kTailsMaxCluster CTAs).
//    Top-k with a candidate mask (resident chunks): only the groups of 8 positions holding a
//    selectable key are kept, compacted in position order (one block scan per round) with each
//    group's first position; the passes and the compaction below then walk 2 keys per thread of
//    those (~1/4 of the row under V4.1's mask) instead of 8 of every group (compact_groups).
// 2. Radix select of K* over the cluster: 4 passes of 8-bit digits from the top. Per pass: a
//    local shared-memory histogram of the digit of the keys that match the prefix chosen so far
//    (one atomic per warp when the taking lanes share the digit, else one per lane), PUSHED into
//    slot `rank` of every cluster CTA's receive buffer with st.async, whose bytes complete on that
//    CTA's mbarrier of the buffer (no cluster barrier per pass, no release fence on the sender:
//    the fence of a cluster barrier's release arrive was the top stall of the old exchange). Each
//    CTA waits on its own barrier for the cluster's bytes, then combines the cluster's histograms
//    from its own shared memory and finds the digit holding the k-th key by a block scan over the
//    bins in descending order, redundantly (all CTAs compute the same integers, so the same
//    choice; no broadcast step). The receive buffers (and their barriers) alternate by pass
//    parity: a CTA pushes into buffer b for pass p + 2 only after it received every CTA's pass
//    p + 1 histogram, which each CTA sends after it finished reading its buffer b in pass p; so
//    a phase's bytes never land in a buffer still being read, or on a barrier still in the
//    previous phase. The first push waits for the kernel-start cluster barrier (every CTA runs
//    and has initialised its barriers). Every remote write lands before its target's own wait
//    returns, so a CTA may exit without a final cluster barrier.
//    The same scan also sums, per bin, the histograms of the LOWER ranks only: summed over the
//    bins above the chosen digit (and over the passes) that is the number of keys > K* in the
//    chunks before this CTA's; at the chosen digit of the last pass, the number of ties before
//    it. So the CTA's output offset and tie budget come without another exchange.
//    Short cuts (cluster-uniform): after pass 1, when at most k keys are valid, every valid key
//    is selected (K* = 0); after any pass, when the chosen digit's bucket holds exactly the keys
//    still needed, the selection is {key >= bucket start} and the remaining passes are skipped.
// 3. Ordered compaction per round: one block scan of the packed (count > K*, count == K*) per
//    thread gives each thread the number of keys > K* and of ties before its elements in position
//    order (plus the lower ranks' counts), hence which of its ties are among the first k_eq and
//    its output offset: top-k writes comp_slot_table[req * stride + j] of its selected positions
//    at out[offset..] (sorted by position by construction), the mask writes 1 / 0 bytes for its
//    chunk. The compacted top-k loads the slot-table entries of its candidates (valid keys >= K*,
//    known before the scan) ahead of each round's scan, so that the gather is not a round trip
//    after it (emit_selected's prefetch). The cluster then fills out[total, out_stride) with -1 / mask[n_blocks, mask_stride)
//    with 0, interleaved over its CTAs.
//
// Bytes: the row's visible scores read once (resident), the selected slot table entries, the
// output row. Shared memory: 2 * cluster KB of receive buffers + the chunk's keys (+ one word
// per group for the compacted top-k's first positions).
// PDL: clen and req are read before dev::pdl_wait(); scores, the mask and the slot table after
// it. Every CTA triggers after its last store.
#include "v4attn/kernels/indexer_kernels.h"

#include <algorithm>
#include <cstdint>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>

#include "kernels/device_common.cuh"
#include "gemm/hopper_ptx.cuh"
#include "kernels/indexer_select_common.cuh"
#include "kernels/indexer_select_window.h"
#include "runtime/phase_stamps.cuh"
#include "runtime/cuda_utils.h"
#include "runtime/launch.h"

V4ATTN_STAMP_UNIT();

namespace v4attn::kernels {

namespace {
namespace v3 {

// Measurement builds (phase_stamps.cuh): thread 0 of every CTA stamps 0 entry, 1 after the PDL
// wait, 2 keys ready, per radix pass p: 4+4p local histogram done, 5+4p the cluster's histograms
// received, 6+4p digit chosen; the window exchange (window kernels): 22 its histogram done, 23 the
// cluster's received, 24 the prefix chosen (when it decides); 20 compaction done, 21 end.
struct StampCtx {
  unsigned int rec = 0u;
  uint32_t kind = 0u;
  __device__ __forceinline__ void at([[maybe_unused]] uint32_t phase) const {
    if (threadIdx.x == 0) V4ATTN_STAMP_AT(rec, kind, phase);
  }
};

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
// 2 CTAs per SM (64 registers; a few bytes spill): one launch plans up to 3/2 CTAs per SM and the
// pair 2 (make_plan), which needs two resident per SM to run both selections of 8 rows at once.
constexpr int kMinCtas = 2;
constexpr int kDigitBits = 8;
constexpr int kBins = 1 << kDigitBits;       // 256
constexpr int kPasses = 32 / kDigitBits;     // 4
constexpr int kBinWarps = kBins / 32;        // warps that own one bin per thread in the combine
// Words per CTA slot of a receive buffer: the histogram, and in the window kernels (kWindow) the
// window statistics after it (window_exchange).
template <bool kWindow>
constexpr int slot_words() {
  return kWindow ? kBins + 4 : kBins;
}
constexpr int kMaxCluster = 16;
static_assert(kMaxCluster == select_window_path::kMaxRanks, "the path record has one entry per rank");
constexpr int kTopkPer = 8;                  // top-k: consecutive positions per thread and round
constexpr int kMaskPer = 2;                  // mask: consecutive blocks per thread and round
constexpr size_t kMaxKeyBytes = 96 * 1024;   // resident key capacity per CTA
constexpr uint32_t kFullMask = 0xffffffffu;
static_assert(kThreads >= 2 * kBins, "the combine uses threads [0, kBins), the zeroing [kBins, 2*kBins)");
static_assert(kThreads * kTopkPer < 65536 && kThreads * kMaskPer < 65536, "packed 16-bit round counts");

// Rounds of 512 * per_thread elements that cover one CTA's chunk of a row of n elements (the
// same formula on host and device: the host sizes the resident keys with it).
__host__ __device__ inline int64_t chunk_elems(int64_t n, int cluster) {
  return ((n + cluster - 1) / cluster + 7) / 8 * 8;
}
__host__ __device__ inline int chunk_rounds(int64_t n, int cluster, int per_thread) {
  const int64_t round = int64_t{kThreads} * per_thread;
  return static_cast<int>((chunk_elems(n, cluster) + round - 1) / round);
}

// The digit choice of one pass, written by the thread that owns the chosen bin.
struct Found {
  uint32_t bin;           // the digit holding the k_rem-th key
  uint32_t above;         // cluster keys in higher digits
  uint32_t before_above;  // of those, keys in the lower ranks' chunks
  uint32_t before_d;      // keys of the chosen digit in the lower ranks' chunks
  uint32_t total_d;       // cluster keys of the chosen digit
};

struct alignas(16) Smem {
  uint32_t hloc[kBins];                // this CTA's histogram of the current pass (read as uint4)
  uint32_t comb[2][kBinWarps][2];      // combine scan: per-warp (total, lower-rank) sums, by parity
  uint32_t scan[2][kWarps];            // compaction scan: per-warp packed sums, by round parity
  uint32_t scan_tail[kWarps];          // the tail's per-warp packed counts (once per output walk)
  Found found[2];                      // by pass parity
  uint64_t mbar[2];                    // clustered: receive buffer b's arrivals (st.async tx bytes)
};

struct Args {
  int cluster = 1;       // CTAs per row (the launch's cluster size)
  int rounds_cap = 1;    // rounds of keys the dynamic shared memory holds
  bool vec = false;      // score rows 16-byte aligned (float4 loads)
  bool compact = false;  // top-k with a candidate mask: resident chunks keep only groups with a valid key
};

// Dynamic shared memory: receive buffers [2][cluster][slot_words], the keys [rounds_cap][round],
// and with `compact` the first positions of the kept groups [rounds_cap][kThreads].
inline size_t dyn_smem_bytes(int cluster, int rounds_cap, int per_thread, bool compact = false, bool window = false) {
  const size_t slot = window ? slot_words<true>() : slot_words<false>();
  return (size_t{2} * cluster * slot + size_t(rounds_cap) * kThreads * (per_thread + (compact ? 1 : 0))) *
         sizeof(uint32_t);
}

using select_keys::neg_inf;
using select_keys::value_key;

// ---- cluster primitives (sm_90 PTX) ----
__device__ __forceinline__ uint32_t cluster_ctarank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}
// The kernel-start arrive: only "this CTA runs" matters (its shared memory exists), no data.
__device__ __forceinline__ void cluster_arrive_relaxed() {
  asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
}
__device__ __forceinline__ void cluster_wait_acquire() {
  asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
}
using hopper::map_to_cluster_rank;
using hopper::smem_u32;

// Kernel start, before the cluster arrive: the two receive-buffer barriers (one arrival per phase:
// this CTA's expect_tx; the cluster's pushes complete the bytes), published to the cluster.
__device__ __forceinline__ void init_exchange(Smem& sm, int cluster) {
  if (cluster > 1 && threadIdx.x == 0) {
    hopper::mbar_init(smem_u32(&sm.mbar[0]), 1);
    hopper::mbar_init(smem_u32(&sm.mbar[1]), 1);
    hopper::fence_mbarrier_init();
  }
}

// ---- one CTA's chunk ----
template <int N, bool kTail = false>
struct Chunk {
  static constexpr int kRound = kThreads * N;
  int64_t begin = 0, end = 0;  // this CTA's elements [begin, end)
  int rounds = 0;              // full rounds covering a chunk (cluster-uniform)
  bool resident = false;       // keys kept in shared memory (else re-read every pass)
  bool preloaded = false;      // resident keys already in shared memory (the compacted top-k)
  __device__ int64_t first(int q) const {
    return begin + int64_t{q} * kRound + int64_t{threadIdx.x} * N;
  }
  // kTail: a chunk whose last round would hold at most kThreads elements (rows just past a
  // multiple of cluster * kRound, like the benchmark's 65537 = 8 * 8192 + 1 positions in 8-CTA
  // clusters) ends with one element per thread (tail_elem) instead of that nearly empty round,
  // its key kept in the round's place in shared memory (tail_key_index; the host's sizing holds).
  // The round cost a load round trip, a block scan, a gather and N elements' histogram code per
  // pass (docs/perf.md session 18, run 13); the tail's loads go with round 0's, its counts into
  // the last round's scan, its histogram code is one element's. A compile-time variant whose
  // walks run out of line (topk_tail_*), so that the walks without a tail keep their code.
  __device__ int64_t tail_elem() const { return begin + int64_t{rounds} * kRound + threadIdx.x; }
  __device__ int64_t tail_key_index() const { return int64_t{rounds} * kRound + threadIdx.x; }
};

template <int N>
__device__ Chunk<N> make_chunk(int64_t n, int cluster, uint32_t rank, int rounds_cap) {
  const int64_t per = chunk_elems(n, cluster);
  Chunk<N> ch;
  ch.begin = min(int64_t{rank} * per, n);
  ch.end = min(ch.begin + per, n);
  ch.rounds = chunk_rounds(n, cluster, N);
  ch.resident = ch.rounds <= rounds_cap;
  return ch;
}
// Whether a chunk of `rounds` rounds of a row of n elements takes a tail (cluster-uniform):
// resident, and its last round would hold at most kThreads elements. One formula for the kernels
// (takes_tail) and the host's select_v3_topk_takes_tail, which the tail tests use to show that
// their rows do walk the tail.
__host__ __device__ inline bool tail_after_rounds(int64_t n, int cluster, int per_thread, int rounds, bool resident) {
  return resident && rounds >= 2 && chunk_elems(n, cluster) - int64_t{rounds - 1} * kThreads * per_thread <= kThreads;
}
template <int N>
__device__ bool takes_tail(const Chunk<N>& ch, int64_t n, int cluster) {
  return tail_after_rounds(n, cluster, N, ch.rounds, ch.resident);
}
template <int N>
__device__ Chunk<N, true> with_tail(const Chunk<N>& ch) {
  Chunk<N, true> t;
  t.begin = ch.begin;
  t.end = ch.end;
  t.rounds = ch.rounds - 1;
  t.resident = ch.resident;
  t.preloaded = ch.preloaded;
  return t;
}

// This thread's keys of round q: from shared memory (resident) or through load(q, key).
template <int N, bool kTail, class Load>
__device__ __forceinline__ void round_keys(const Chunk<N, kTail>& ch, const Load& load, const uint32_t* keys_sm, int q,
                                           uint32_t (&key)[N]) {
  if (ch.resident) {
    const uint32_t* src = keys_sm + int64_t{q} * Chunk<N>::kRound + int64_t{threadIdx.x} * N;
    if constexpr (N % 4 == 0) {
#pragma unroll
      for (int i = 0; i < N / 4; ++i) {
        const uint4 v = reinterpret_cast<const uint4*>(src)[i];
        key[4 * i] = v.x, key[4 * i + 1] = v.y, key[4 * i + 2] = v.z, key[4 * i + 3] = v.w;
      }
    } else if constexpr (N == 2) {
      const uint2 v = *reinterpret_cast<const uint2*>(src);
      key[0] = v.x, key[1] = v.y;
    } else {
#pragma unroll
      for (int e = 0; e < N; ++e) key[e] = src[e];
    }
  } else {
    load(q, key);
  }
}

template <int N>
__device__ __forceinline__ void store_round_keys(uint32_t* keys_sm, int q, const uint32_t (&key)[N]) {
  uint32_t* dst = keys_sm + int64_t{q} * Chunk<N>::kRound + int64_t{threadIdx.x} * N;
  if constexpr (N % 4 == 0) {
#pragma unroll
    for (int i = 0; i < N / 4; ++i)
      reinterpret_cast<uint4*>(dst)[i] = make_uint4(key[4 * i], key[4 * i + 1], key[4 * i + 2], key[4 * i + 3]);
  } else if constexpr (N == 2) {
    *reinterpret_cast<uint2*>(dst) = make_uint2(key[0], key[1]);
  } else {
#pragma unroll
    for (int e = 0; e < N; ++e) dst[e] = key[e];
  }
}

// ---- radix select over the cluster ----
// The selection, in the terms every CTA needs for its part of the output.
struct Selection {
  uint32_t thr = 0;        // selected: valid keys > thr, plus the first k_eq valid keys == thr
  uint32_t k_eq = 0;
  uint32_t gt_before = 0;  // valid keys > thr in the lower ranks' chunks (= before this chunk)
  uint32_t eq_before = 0;  // valid keys == thr in the lower ranks' chunks
  uint32_t total = 0;      // keys the row selects: min(k, valid keys)
};

// One key's share of a pass's local histogram (every lane of the warp calls it alike).
__device__ __forceinline__ void histogram_key(uint32_t k, int pass, int shift, uint32_t prefix, unsigned lane,
                                              Smem& sm) {
  const bool take = k != 0u && (pass == 0 || (k >> (shift + kDigitBits)) == prefix);
  const uint32_t active = __ballot_sync(kFullMask, take);
  if (take) {
    // One atomic per warp when the taking lanes share the digit (the top digits of a row's keys
    // mostly do), else one per lane: cheaper than grouping the lanes by digit
    // (__match_any_sync), whose latency was the histogram's top stall.
    const uint32_t digit = (k >> shift) & (kBins - 1u);
    const int leader = __ffs(active) - 1;
    const uint32_t lead_digit = __shfl_sync(active, digit, leader);
    if (__all_sync(active, digit == lead_digit)) {
      if (lane == static_cast<unsigned>(leader)) atomicAdd(&sm.hloc[digit], __popc(active));
    } else {
      atomicAdd(&sm.hloc[digit], 1u);
    }
  }
}

// Local histogram of digit (key >> shift) & 255 over the valid keys whose higher digits equal
// `prefix` (all valid keys in pass 0), added into sm.hloc (zero on entry).
template <int N, bool kTail, class Load>
__device__ void local_histogram(const Chunk<N, kTail>& ch, const Load& load, const uint32_t* keys_sm, int pass,
                                uint32_t prefix, Smem& sm) {
  const int shift = 32 - kDigitBits * (pass + 1);
  const unsigned lane = threadIdx.x & 31u;
  for (int q = 0; q < ch.rounds; ++q) {  // cluster-uniform trip count: every lane iterates alike
    uint32_t key[N];
    round_keys(ch, load, keys_sm, q, key);
#pragma unroll
    for (int e = 0; e < N; ++e) histogram_key(key[e], pass, shift, prefix, lane, sm);
  }
  if constexpr (kTail) histogram_key(keys_sm[ch.tail_key_index()], pass, shift, prefix, lane, sm);  // resident
}

// ---- the window exchange (kWindow kernels) ----
// A row's scores share their sign and exponent to within a few binades, so radix pass 0 (the top 8
// bits of a key: sign and 7 exponent bits) puts nearly every key into one or two bins and decides
// little: a selection took three exchanges (passes 0-2, the fourth skipped by the whole-bucket
// short cut). The window exchange replaces passes 0 and 1 with one: each CTA counts the 16-bit
// prefixes of its finite keys in the 256 prefixes up to its own largest finite key's (about two
// binades) and sends that window's top with the histogram; the receivers align the windows under
// the cluster's largest. When the k-th key lies in that global window (the k-th largest within
// about 1/4 of the row's largest finite value, ignoring +inf keys, which rank above every bin), its
// 16-bit prefix is decided in one exchange and pass 2 follows; otherwise pass 0 starts with nothing
// decided (the same selection, one exchange later). Resident chunks only (the statistics walk reads
// the keys from shared memory). The kernels without it compile to the PTX they had before it, but
// for the declared size of CandidateMaskParams (its new flag; scripts/ptx_compare.py).
// The arithmetic (the windows' alignment, the decision) is in indexer_select_window.h, which its CPU
// model test shares.
using select_window::kInfKey;  // value_key(+inf); finite keys are below it, NaN has none

// The statistics a CTA sends after its window histogram: x its largest finite key (0: none), y its
// +inf keys, z its valid keys (w unused). At namespace scope like v3_sm; only the window kernels use it.
__shared__ uint4 v3_wstats;
// Which way this CTA's window exchange went (select_window_path::k*; kNone until it runs), for the
// params' v3_window_paths record (diagnostics and the GPU tests: the fallback gives the same bytes,
// so only this record shows that the window decides where it should).
__shared__ uint32_t v3_wpath;

// This CTA's statistics into v3_wstats (zero on entry; visible after the caller's barrier).
template <int N, bool kTail, class Load>
__device__ void window_stats(const Chunk<N, kTail>& ch, const Load& load, const uint32_t* keys_sm) {
  uint32_t top = 0u, n_inf = 0u, n_valid = 0u;
  const auto add = [&](uint32_t k) {
    n_valid += k != 0u ? 1u : 0u;
    n_inf += k >= kInfKey ? 1u : 0u;
    top = k < kInfKey ? max(top, k) : top;
  };
  for (int q = 0; q < ch.rounds; ++q) {
    uint32_t key[N];
    round_keys(ch, load, keys_sm, q, key);
#pragma unroll
    for (int e = 0; e < N; ++e) add(key[e]);
  }
  if constexpr (kTail) add(keys_sm[ch.tail_key_index()]);
  top = __reduce_max_sync(kFullMask, top);
  n_inf = __reduce_add_sync(kFullMask, n_inf);
  n_valid = __reduce_add_sync(kFullMask, n_valid);
  if ((threadIdx.x & 31u) == 0u) {
    if (top != 0u) atomicMax(&v3_wstats.x, top);
    if (n_inf != 0u) atomicAdd(&v3_wstats.y, n_inf);
    if (n_valid != 0u) atomicAdd(&v3_wstats.z, n_valid);
  }
}

// Local histogram of the 16-bit prefixes of the finite keys >= lo (lo = select_window::base(top) << 16).
template <int N, bool kTail, class Load>
__device__ void window_histogram(const Chunk<N, kTail>& ch, const Load& load, const uint32_t* keys_sm, uint32_t lo,
                                 Smem& sm) {
  const unsigned lane = threadIdx.x & 31u;
  const auto count = [&](uint32_t k) {  // histogram_key's warp-aggregated count
    const bool take = select_window::counts(k, lo);
    const uint32_t active = __ballot_sync(kFullMask, take);
    if (take) {
      const uint32_t digit = select_window::bin(k, lo);
      const int leader = __ffs(active) - 1;
      const uint32_t lead_digit = __shfl_sync(active, digit, leader);
      if (__all_sync(active, digit == lead_digit)) {
        if (lane == static_cast<unsigned>(leader)) atomicAdd(&sm.hloc[digit], __popc(active));
      } else {
        atomicAdd(&sm.hloc[digit], 1u);
      }
    }
  };
  for (int q = 0; q < ch.rounds; ++q) {  // CTA-uniform trip count: every lane iterates alike
    uint32_t key[N];
    round_keys(ch, load, keys_sm, q, key);
#pragma unroll
    for (int e = 0; e < N; ++e) count(key[e]);
  }
  if constexpr (kTail) count(keys_sm[ch.tail_key_index()]);  // resident
}

// What the window exchange decided.
struct WindowOutcome {
  bool done = false;   // `s` is the selection (every valid key, or a whole bucket)
  bool found = false;  // else: the k-th key's 16-bit prefix is `prefix` (pass 2 next), or unknown (pass 0 next)
  uint32_t path = select_window_path::kFallback;  // which of the four ways (v3_window_paths)
  Selection s;
  uint32_t k_rem = 0u, prefix = 0u, gt_before = 0u;
};

// The window exchange: the selection's first exchange (x = 0: receive buffer 0, barrier phase 0) in
// the window kernels, for resident chunks. sm.hloc and v3_wstats zero and visible on entry;
// clustered: the caller has issued cluster_arrive_relaxed(). Out of line: it runs once per launch,
// and inlined it raised the pair kernels' spills from 20 to 84 bytes (ptxas -v), beside walks that
// run per round; the call costs its arguments and result through the stack once.
template <int N, bool kTail, class Load>
__device__ __noinline__ WindowOutcome window_exchange(const Chunk<N, kTail>& ch, const Load& load, uint32_t k, Smem& sm,
                                         uint32_t* recv, const uint32_t* keys_sm, int cluster, uint32_t rank,
                                         const StampCtx& st) {
  constexpr int kStride = slot_words<true>();
  constexpr int kQuads = kStride / 4;  // the histogram's quads, then the statistics
  const bool clustered = cluster > 1;
  const int tid = static_cast<int>(threadIdx.x), lane = tid & 31, wid = tid >> 5;
  window_stats(ch, load, keys_sm);
  __syncthreads();  // v3_wstats: this CTA's largest finite key
  window_histogram(ch, load, keys_sm, select_window::base(v3_wstats.x) << 16, sm);
  __syncthreads();  // hloc complete
  st.at(22);
  if (clustered) cluster_wait_acquire();  // every CTA of the cluster runs

  uint32_t* my_slot = recv + int64_t{rank} * kStride;  // buffer 0
  const auto quad_of = [&](int q) { return q < kBins / 4 ? reinterpret_cast<const uint4*>(sm.hloc)[q] : v3_wstats; };
  if (clustered) {
    const uint32_t bar = smem_u32(&sm.mbar[0]);
    if (tid == 0) hopper::mbar_arrive_expect_tx(bar, static_cast<uint32_t>(cluster * kStride * sizeof(uint32_t)));
    for (int item = tid; item < cluster * kQuads; item += kThreads) {
      const uint32_t r = static_cast<uint32_t>(item / kQuads);
      const int quad = item % kQuads;
      hopper::st_async_v4(map_to_cluster_rank(smem_u32(my_slot + 4 * quad), r), quad_of(quad),
                          map_to_cluster_rank(bar, r));
    }
    hopper::mbar_wait_cluster(bar, 0u);
    st.at(23);
  } else {
    for (int quad = tid; quad < kQuads; quad += kThreads) reinterpret_cast<uint4*>(my_slot)[quad] = quad_of(quad);
    __syncthreads();
  }

  // The cluster's statistics (every thread: the same integers in every CTA): the largest finite
  // key, the +inf and the valid keys, in all chunks and in the lower ranks' chunks.
  uint32_t top_key = 0u, inf_all = 0u, inf_bef = 0u, val_all = 0u, val_bef = 0u;
  for (int r = 0; r < cluster; ++r) {
    const uint4 w = *reinterpret_cast<const uint4*>(recv + int64_t{r} * kStride + kBins);
    const bool lower = static_cast<uint32_t>(r) < rank;
    top_key = max(top_key, w.x);
    inf_all += w.y;
    val_all += w.z;
    inf_bef += lower ? w.y : 0u;
    val_bef += lower ? w.z : 0u;
  }
  // Combine: thread i < 256 owns the 16-bit prefix (top_key >> 16) - i and sums it over the ranks
  // whose window holds it.
  uint32_t tot = 0u, bef = 0u, incl_t = 0u, incl_b = 0u;
  const uint32_t top = top_key >> 16, bin = top - static_cast<uint32_t>(tid);
  if (tid < kBins) {
    if (static_cast<uint32_t>(tid) <= top)
      for (int r = 0; r < cluster; ++r) {
        const uint32_t* slot = recv + int64_t{r} * kStride;
        const uint32_t v = select_window::bin_count(slot, slot[kBins], bin);
        tot += v;
        bef += static_cast<uint32_t>(r) < rank ? v : 0u;
      }
    // cluster_select's combine scan, over prefixes from the top. A copy, as are the warp sums below
    // and window_histogram's count: shared as helpers they changed the PTX of the kernels without
    // the window (register numbering, operand order), whose sameness is what lets this form exist
    // unmeasured. One form can serve both once a GPU run has chosen.
    incl_t = tot;
    incl_b = bef;
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
      const uint32_t nt = __shfl_up_sync(kFullMask, incl_t, off);
      const uint32_t nb = __shfl_up_sync(kFullMask, incl_b, off);
      if (lane >= off) incl_t += nt, incl_b += nb;
    }
    if (lane == 31) {
      sm.comb[0][wid][0] = incl_t;
      sm.comb[0][wid][1] = incl_b;
    }
  }
  __syncthreads();  // every thread's pushes (its reads of hloc) are done: hloc may be zeroed
  uint32_t all_t = 0u, warp_t = 0u, warp_b = 0u;
#pragma unroll
  for (int w = 0; w < kBinWarps; ++w) {
    const uint32_t ct = sm.comb[0][w][0], cb = sm.comb[0][w][1];
    all_t += ct;
    if (w < wid) warp_t += ct, warp_b += cb;
  }
  WindowOutcome o;
  if (val_all <= k) {  // at most k valid keys: all of them (cluster-uniform)
    o.done = true;
    o.path = select_window_path::kAll;
    o.s.thr = 0u;
    o.s.k_eq = 0u;
    o.s.gt_before = val_bef;
    o.s.eq_before = 0u;
    o.s.total = val_all;
    return o;
  }
  if (tid >= kBins && tid < 2 * kBins) sm.hloc[tid - kBins] = 0u;  // for the next pass
  if (!select_window::decides(inf_all, all_t, k)) {  // the k-th key is not in the window (cluster-uniform)
    __syncthreads();  // hloc zeroed before pass 0 counts into it
    return o;
  }
  if (tid < kBins) {
    incl_t += warp_t + inf_all;  // the +inf keys rank above every bin
    incl_b += warp_b + inf_bef;
    const uint32_t above = incl_t - tot;
    if (above < k && k <= incl_t) sm.found[0] = Found{bin, above, incl_b - bef, bef, tot};
  }
  __syncthreads();
  st.at(24);
  const Found f = sm.found[0];
  o.k_rem = k - f.above;
  o.gt_before = f.before_above;
  o.prefix = f.bin;
  if (f.total_d == o.k_rem) {  // the whole bucket is taken: {key >= its first key}, no ties
    o.done = true;
    o.path = select_window_path::kBucket;
    o.s.thr = (f.bin << 16) - 1u;  // a finite key's prefix is >= 0x0080
    o.s.k_eq = 0u;
    o.s.gt_before = o.gt_before + f.before_d;
    o.s.eq_before = 0u;
    o.s.total = k;
    return o;
  }
  o.found = true;
  o.path = select_window_path::kPrefix;
  return o;
}

// The top k (k >= 1) of the row over the cluster. All threads of all CTAs of the cluster call it
// with the same k and cluster-uniform chunk shapes. sm.hloc must be zero and visible (synced).
// Clustered: the caller has issued cluster_arrive_relaxed() (matched here before the first push).
// kWindow: resident chunks start with the window exchange (above; v3_wstats zero and visible too).
template <bool kWindow, int N, bool kTail, class Load>
__device__ Selection cluster_select(const Chunk<N, kTail>& ch, const Load& load, uint32_t k, Smem& sm, uint32_t* recv,
                                    uint32_t* keys_sm, int cluster, uint32_t rank, const StampCtx& st) {
  const bool clustered = cluster > 1;
  const int tid = static_cast<int>(threadIdx.x), lane = tid & 31, wid = tid >> 5;
  if (ch.resident && !ch.preloaded)
    for (int q = 0; q < ch.rounds; ++q) {
      uint32_t key[N];
      load(q, key);
      store_round_keys(keys_sm, q, key);  // read back by this thread only: no barrier needed
    }

  constexpr int kStride = slot_words<kWindow>();
  Selection s;
  uint32_t k_rem = k, prefix = 0u, gt_before = 0u;
  // The exchange of pass p is x = p + x0 (0, 1, ...): its receive buffer and barrier alternate by
  // the parity of x. The window exchange is x = 0; after it pass 2 (x 1) or pass 0 (x 1).
  int first_pass = 0, x0 = 0;
  if constexpr (kWindow) {
    if (ch.resident) {
      const WindowOutcome w = window_exchange(ch, load, k, sm, recv, keys_sm, cluster, rank, st);
      if (tid == 0) v3_wpath = w.path;  // read back by thread 0 only (the path record)
      if (w.done) return w.s;
      first_pass = w.found ? 2 : 0;
      x0 = 1 - first_pass;
      if (w.found) k_rem = w.k_rem, prefix = w.prefix, gt_before = w.gt_before;
    }
  }
  for (int pass = first_pass; pass < kPasses; ++pass) {
    const int x = pass + x0;
    const int b = x & 1;
    const int shift = 32 - kDigitBits * (pass + 1);
    local_histogram(ch, load, keys_sm, pass, prefix, sm);
    __syncthreads();  // hloc complete
    st.at(4 + 4 * pass);
    if (x == 0 && clustered) cluster_wait_acquire();  // every CTA of the cluster runs

    // Push hloc into slot `rank` of receive buffer b of every CTA (this one included).
    uint32_t* my_slot = recv + (int64_t{b} * cluster + rank) * kStride;
    if (clustered) {
      // st.async completing on the receiver's barrier b: each CTA waits for the cluster's bytes
      // only (no cluster barrier, no release fence on the pushes). Phase (x >> 1) of barrier b.
      const uint32_t bar = smem_u32(&sm.mbar[b]);
      if (tid == 0) hopper::mbar_arrive_expect_tx(bar, static_cast<uint32_t>(cluster * kBins * sizeof(uint32_t)));
      for (int item = tid; item < cluster * (kBins / 4); item += kThreads) {
        const uint32_t r = static_cast<uint32_t>(item / (kBins / 4));
        const int quad = item % (kBins / 4);
        const uint4 v = reinterpret_cast<const uint4*>(sm.hloc)[quad];
        hopper::st_async_v4(map_to_cluster_rank(smem_u32(my_slot + 4 * quad), r), v, map_to_cluster_rank(bar, r));
      }
      hopper::mbar_wait_cluster(bar, static_cast<uint32_t>(x >> 1) & 1u);  // every CTA's pushes into buffer b
      st.at(5 + 4 * pass);
    } else {
      for (int quad = tid; quad < kBins / 4; quad += kThreads)
        reinterpret_cast<uint4*>(my_slot)[quad] = reinterpret_cast<const uint4*>(sm.hloc)[quad];
      __syncthreads();
    }

    // Combine: thread i < 256 owns bin 255 - i (descending), sums it over the cluster and over the
    // lower ranks.
    uint32_t tot = 0u, bef = 0u, incl_t = 0u, incl_b = 0u;
    const uint32_t bin = static_cast<uint32_t>(kBins - 1 - tid);
    if (tid < kBins) {
      const uint32_t* col = recv + int64_t{b} * cluster * kStride + bin;
      for (int r = 0; r < cluster; ++r) {
        const uint32_t v = col[int64_t{r} * kStride];
        tot += v;
        bef += static_cast<uint32_t>(r) < rank ? v : 0u;
      }
      incl_t = tot;
      incl_b = bef;
#pragma unroll
      for (int off = 1; off < 32; off <<= 1) {
        const uint32_t nt = __shfl_up_sync(kFullMask, incl_t, off);
        const uint32_t nb = __shfl_up_sync(kFullMask, incl_b, off);
        if (lane >= off) incl_t += nt, incl_b += nb;
      }
      if (lane == 31) {
        sm.comb[b][wid][0] = incl_t;
        sm.comb[b][wid][1] = incl_b;
      }
    }
    __syncthreads();  // every thread's pushes (its reads of hloc) are done: hloc may be zeroed
    uint32_t all_t = 0u, all_b = 0u, warp_t = 0u, warp_b = 0u;
#pragma unroll
    for (int w = 0; w < kBinWarps; ++w) {
      const uint32_t ct = sm.comb[b][w][0], cb = sm.comb[b][w][1];
      all_t += ct;
      all_b += cb;
      if (w < wid) warp_t += ct, warp_b += cb;
    }
    if (pass == 0 && all_t <= k) {  // at most k valid keys: all of them (cluster-uniform)
      s.thr = 0u;
      s.k_eq = 0u;
      s.gt_before = all_b;
      s.eq_before = 0u;
      s.total = all_t;
      return s;
    }
    if (tid >= kBins && tid < 2 * kBins) sm.hloc[tid - kBins] = 0u;  // for the next pass
    if (tid < kBins) {
      incl_t += warp_t;
      incl_b += warp_b;
      const uint32_t above = incl_t - tot;
      if (above < k_rem && k_rem <= incl_t) sm.found[b] = Found{bin, above, incl_b - bef, bef, tot};
    }
    __syncthreads();
    st.at(6 + 4 * pass);
    const Found f = sm.found[b];
    k_rem -= f.above;
    gt_before += f.before_above;
    prefix = (prefix << kDigitBits) | f.bin;
    if (f.total_d == k_rem) {  // the whole bucket is taken: {key >= its first key}, no ties
      const uint32_t lo = prefix << shift;
      s.thr = lo == 0u ? 0u : lo - 1u;
      s.k_eq = 0u;
      s.gt_before = gt_before + f.before_d;
      s.eq_before = 0u;
      s.total = k;
      return s;
    }
    if (pass == kPasses - 1) {
      s.thr = prefix;
      s.k_eq = k_rem;
      s.gt_before = gt_before;
      s.eq_before = f.before_d;
      s.total = k;
    }
  }
  return s;
}

// Exclusive prefix sum of one uint32 per thread over the CTA (one barrier); `total` gets the sum.
// warp_tot (kWarps words) must not be read by anyone any more (callers alternate two).
__device__ __forceinline__ uint32_t block_excl_scan(uint32_t v, uint32_t& total, uint32_t* warp_tot) {
  const int lane = static_cast<int>(threadIdx.x) & 31, wid = static_cast<int>(threadIdx.x) >> 5;
  uint32_t incl = v;
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const uint32_t n = __shfl_up_sync(kFullMask, incl, off);
    if (lane >= off) incl += n;
  }
  if (lane == 31) warp_tot[wid] = incl;
  __syncthreads();
  uint32_t before = 0u;
  total = 0u;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) {
    const uint32_t x = warp_tot[w];
    total += x;
    before += w < wid ? x : 0u;
  }
  return before + incl - v;
}

// One round of emit_selected after its scan: the thread's selected elements and output offset.
template <int N, class Pf, class Emit>
__device__ __forceinline__ void emit_round(const uint32_t (&key)[N], const Selection& s, uint32_t gt_seen,
                                           uint32_t eq_seen, uint32_t excl, int64_t first, const Pf& pf,
                                           const Emit& emit) {
  const uint32_t gt = gt_seen + (excl >> 16);
  uint32_t eq = eq_seen + (excl & 0xffffu);
  const uint32_t off = gt + min(eq, s.k_eq);
  uint32_t sel = 0u;
#pragma unroll
  for (int e = 0; e < N; ++e) {
    const bool valid = key[e] != 0u;
    const bool is_eq = valid && key[e] == s.thr;
    const bool take = (valid && key[e] > s.thr) || (is_eq && eq < s.k_eq);
    eq += is_eq ? 1u : 0u;
    sel |= static_cast<uint32_t>(take) << e;
  }
  emit(first, sel, off, pf);
}

// Ordered compaction of this CTA's chunk: emit(first_element, selected_bits, output_offset, pf)
// once per thread and round (bit e = element first + e; offsets count from the row's first
// output), pf = prefetch(first_element, candidate_bits) issued before the round's block scan:
// what the emit reads from global memory for the candidates (valid keys >= thr, a superset of
// the selected ones that does not wait for the scan) is then in flight during the scan instead of
// a dependent round trip after it. A chunk's tail (resident) is counted in its last round's scan
// (its elements follow every round's in position order) and emitted after that round through
// tail.prefetch(element, candidate) / tail.emit(element, selected, output_offset, pf).
template <int N, bool kTail, class Load, class Prefetch, class Emit, class Tail>
__device__ void emit_selected(const Chunk<N, kTail>& ch, const Load& load, const uint32_t* keys_sm, const Selection& s,
                              Smem& sm, const Prefetch& prefetch, const Emit& emit, const Tail& tail) {
  uint32_t gt_seen = s.gt_before, eq_seen = s.eq_before;
  for (int q = 0; q < ch.rounds; ++q) {
    uint32_t key[N];
    round_keys(ch, load, keys_sm, q, key);
    uint32_t n_gt = 0u, n_eq = 0u, cand = 0u;
#pragma unroll
    for (int e = 0; e < N; ++e) {
      const bool valid = key[e] != 0u;
      n_gt += (valid && key[e] > s.thr) ? 1u : 0u;
      n_eq += (valid && key[e] == s.thr) ? 1u : 0u;
      cand |= static_cast<uint32_t>(valid && key[e] >= s.thr) << e;
    }
    const auto pf = prefetch(ch.first(q), cand);
    const uint32_t packed = (n_gt << 16) | n_eq;
    uint32_t excl, total;
    if (kTail && q == ch.rounds - 1) {  // cluster-uniform
      // The tail's counts by warp ballots, its warps' sums published by the round's scan barrier.
      const uint32_t tk = keys_sm[ch.tail_key_index()];
      const bool t_valid = tk != 0u;
      const auto t_pf = tail.prefetch(ch.tail_elem(), t_valid && tk >= s.thr);
      const uint32_t b_gt = __ballot_sync(kFullMask, t_valid && tk > s.thr);
      const uint32_t b_eq = __ballot_sync(kFullMask, t_valid && tk == s.thr);
      const unsigned lane = threadIdx.x & 31u, wid = threadIdx.x >> 5;
      if (lane == 0) sm.scan_tail[wid] = (static_cast<uint32_t>(__popc(b_gt)) << 16) | __popc(b_eq);
      excl = block_excl_scan(packed, total, sm.scan[q & 1]);
      uint32_t t_before = 0u;
      for (unsigned w = 0; w < wid; ++w) t_before += sm.scan_tail[w];
      const uint32_t lower = (1u << lane) - 1u;
      const uint32_t t_gt = gt_seen + (total >> 16) + (t_before >> 16) + __popc(b_gt & lower);
      const uint32_t t_eq = eq_seen + (total & 0xffffu) + (t_before & 0xffffu) + __popc(b_eq & lower);
      const bool t_take = t_valid && (tk > s.thr || (tk == s.thr && t_eq < s.k_eq));
      emit_round(key, s, gt_seen, eq_seen, excl, ch.first(q), pf, emit);
      tail.emit(ch.tail_elem(), t_take, t_gt + min(t_eq, s.k_eq), t_pf);
    } else {
      excl = block_excl_scan(packed, total, sm.scan[q & 1]);
      emit_round(key, s, gt_seen, eq_seen, excl, ch.first(q), pf, emit);
    }
    gt_seen += total >> 16;
    eq_seen += total & 0xffffu;
  }
}

// The selection kernels' static shared memory at namespace scope, so that the out-of-line tail
// walks (topk_tail_*) address it as shared memory too.
__shared__ Smem v3_sm;

__device__ __forceinline__ uint32_t* recv_buffers() {
  extern __shared__ __align__(16) uint8_t v3_dyn_smem[];
  return reinterpret_cast<uint32_t*>(v3_dyn_smem);
}

// emit_selected's prefetch for walks that read nothing ahead (the unmasked top-k, the mask).
struct NoPrefetch {
  __device__ int operator()(int64_t, uint32_t) const { return 0; }
};
// emit_selected's tail handler for walks without a tail (the mask, the compacted top-k).
struct NoTail {
  __device__ int prefetch(int64_t, bool) const { return 0; }
  __device__ void emit(int64_t, bool, uint32_t, int) const {}
};

// ---- top-k ----
// The slot-table entries of a thread's candidate elements of one round (emit_selected's prefetch).
template <int N>
struct SlotPrefetch {
  int32_t slot[N];
};

// Keys of this thread's 8 consecutive positions j0.. (0 at or past `end`, for -inf / NaN, and
// where the candidate mask is 0).
__device__ __forceinline__ void load_score_keys(const float* row, const uint8_t* mask, int mask_block, int64_t j0,
                                                int64_t end, bool vec, uint32_t (&key)[kTopkPer]) {
  // V4.1's mask block (8 positions, j0 a multiple of 8): one byte for the thread's 8 positions,
  // loaded before the scores so that both loads share one latency (the general block size below
  // computes its byte index with a 64-bit division and loaded it after the keys: two latencies).
  const bool mask8 = mask != nullptr && mask_block == kTopkPer;
  const uint8_t m8 = mask8 && j0 < end ? mask[j0 >> 3] : uint8_t{1};
  float v[kTopkPer];
  if (vec && j0 + kTopkPer <= end) {
    const float4 a = *reinterpret_cast<const float4*>(row + j0);
    const float4 c = *reinterpret_cast<const float4*>(row + j0 + 4);
    v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = c.x, v[5] = c.y, v[6] = c.z, v[7] = c.w;
  } else {
#pragma unroll
    for (int e = 0; e < kTopkPer; ++e) v[e] = j0 + e < end ? row[j0 + e] : neg_inf();
  }
#pragma unroll
  for (int e = 0; e < kTopkPer; ++e) key[e] = (j0 + e < end && v[e] > neg_inf()) ? value_key(v[e]) : 0u;
  if (mask8) {
    if (m8 == 0) {
#pragma unroll
      for (int e = 0; e < kTopkPer; ++e) key[e] = 0u;
    }
  } else if (mask != nullptr && j0 < end) {
    int64_t m = j0 / mask_block;
    int r = static_cast<int>(j0 - m * mask_block);
    uint8_t mv = mask[m];
#pragma unroll
    for (int e = 0; e < kTopkPer; ++e) {
      if (mv == 0) key[e] = 0u;
      if (++r == mask_block) {
        r = 0;
        ++m;
        mv = j0 + e + 1 < end ? mask[m] : uint8_t{1};  // no read past the row's last block
      }
    }
  }
}

// A chunk tail's element (Chunk's kTail): its score and mask byte (ScoreRow::tail_load, issued
// before round 0's keys so that both share one latency), and its key once they are used.
struct TailLoad {
  float v;
  uint8_t m;
};
__device__ __forceinline__ uint32_t tail_key(const TailLoad& t) {
  return (t.m != 0 && t.v > neg_inf()) ? value_key(t.v) : 0u;
}

// Containment of the row metadata, exactly like v1 / v2 (counted once per row by the caller).
__device__ __forceinline__ int64_t clamp_topk_row(int32_t req, int64_t c, const IndexerTopkParams& p, bool& err) {
  err = false;
  if (c < 0) {
    c = 0;
    err = true;
  }
  if (c > p.score_stride) {
    c = p.score_stride;
    err = true;
  }
  if (req < 0) {
    c = 0;
  } else if (req >= p.comp_table_rows) {
    if (c > 0) err = true;
    c = 0;
  } else if (c > p.comp_table_stride) {
    c = p.comp_table_stride;
    err = true;
  }
  return c;
}

// The compacted top-k (rows with a candidate mask, whose ~3/4 masked positions have key 0): the
// chunk is loaded once and only the groups of kTopkPer positions with a valid key are kept, in
// position order, at keys_sm[kTopkPer * g ..] with their first position at first_pos[g]; returns
// the group count. The radix passes and the compaction then walk kCompactPer keys per thread of
// the kept groups instead of kTopkPer of every group. Dropping keys that are 0 changes no count
// the selection uses (they are never selected), so the output is the same bit for bit.
constexpr int kCompactPer = 2;
// A chunk's tail (kTail, its element's loads in `tl`) is kept as a group of its one key (7 zeros
// after it), after the last round's groups: one scan counts both (tail groups in the high half).
template <bool kTail, class Load>
__device__ uint32_t compact_groups(const Chunk<kTopkPer, kTail>& ch, const Load& load, const TailLoad& tl,
                                   uint32_t* keys_sm, int32_t* first_pos, Smem& sm) {
  static_assert(kTopkPer == 8, "two uint4 per group");
  uint32_t n = 0;
  for (int q = 0; q < ch.rounds; ++q) {
    uint32_t key[kTopkPer];
    load(q, key);
    bool any = false;
#pragma unroll
    for (int e = 0; e < kTopkPer; ++e) any = any || key[e] != 0u;
    const uint32_t tk = kTail && q == ch.rounds - 1 ? tail_key(tl) : 0u;  // cluster-uniform
    uint32_t total;
    const uint32_t excl =
        block_excl_scan((static_cast<uint32_t>(tk != 0u) << 16) | (any ? 1u : 0u), total, sm.scan[q & 1]);
    if (any) {
      const uint32_t g = n + (excl & 0xffffu);
      uint4* dst = reinterpret_cast<uint4*>(keys_sm + int64_t{g} * kTopkPer);
      dst[0] = make_uint4(key[0], key[1], key[2], key[3]);
      dst[1] = make_uint4(key[4], key[5], key[6], key[7]);
      first_pos[g] = static_cast<int32_t>(ch.first(q));
    }
    if (tk != 0u) {
      const uint32_t g = n + (total & 0xffffu) + (excl >> 16);
      uint4* dst = reinterpret_cast<uint4*>(keys_sm + int64_t{g} * kTopkPer);
      dst[0] = make_uint4(tk, 0u, 0u, 0u);
      dst[1] = make_uint4(0u, 0u, 0u, 0u);
      first_pos[g] = static_cast<int32_t>(ch.tail_elem());
    }
    n += (total & 0xffffu) + (total >> 16);
  }
  return n;
}

// The unmasked top-k's emit: the selected positions' slot-table entries, gathered first, then
// stored at the thread's output offsets. Also emit_selected's tail handler: a tail candidate's
// entry loaded before the last round's scan, stored at its output offset when selected.
struct SlotEmit {
  const int32_t* table;
  int32_t* out;
  int64_t out_stride;
  __device__ void operator()(int64_t j0, uint32_t sel, uint32_t off, int) const {
    int32_t slot[kTopkPer];
#pragma unroll
    for (int e = 0; e < kTopkPer; ++e) slot[e] = ((sel >> e) & 1u) ? table[j0 + e] : -1;
#pragma unroll
    for (int e = 0; e < kTopkPer; ++e)
      if ((sel >> e) & 1u) {
        if (off < out_stride) out[off] = slot[e];
        ++off;
      }
  }
  __device__ int32_t prefetch(int64_t j, bool cand) const { return cand ? table[j] : -1; }
  __device__ void emit(int64_t, bool take, uint32_t off, int32_t slot) const {
    if (take && off < out_stride) out[off] = slot;
  }
};

// The row's score keys and candidate mask: how topk_cta's walks and the out-of-line tail walks
// load them.
struct ScoreRow {
  const float* row;
  const uint8_t* mask;  // null: no candidate mask
  int mask_block;
  bool vec;
  // Keys of a thread's kTopkPer positions j0.. of a chunk ending at `end` (load_score_keys).
  __device__ __forceinline__ void keys(int64_t j0, int64_t end, uint32_t (&key)[kTopkPer]) const {
    load_score_keys(row, mask, mask_block, j0, end, vec, key);
  }
  // The loads of a chunk tail's position j (tail_key makes its key).
  __device__ TailLoad tail_load(int64_t j, int64_t end) const {
    const bool in = j < end;
    TailLoad t;
    t.v = in ? row[j] : neg_inf();
    t.m = mask != nullptr && in ? mask[mask_block == kTopkPer ? j >> 3 : j / mask_block] : uint8_t{1};
    return t;
  }
};

// The walks of chunks with a tail, out of line: inlined beside the walks without one, their
// registers reshaped those walks' allocation (~1 us slower at 24-32 rows, docs/perf.md session 19).
// The compacted top-k's compaction of a chunk with a tail: returns the kept keys' count.
template <bool kWindow>
__device__ __noinline__ uint32_t topk_tail_compact(const Chunk<kTopkPer> ch, const ScoreRow r, int cluster,
                                                   int rounds_cap) {
  uint32_t* keys_sm = recv_buffers() + 2 * cluster * slot_words<kWindow>();
  int32_t* first_pos = reinterpret_cast<int32_t*>(keys_sm + int64_t{rounds_cap} * Chunk<kTopkPer>::kRound);
  const auto cht = with_tail(ch);
  const TailLoad tl = r.tail_load(cht.tail_elem(), cht.end);  // before round 0's
  const auto load = [&](int q, uint32_t (&key)[kTopkPer]) { r.keys(cht.first(q), cht.end, key); };
  return kTopkPer * compact_groups(cht, load, tl, keys_sm, first_pos, v3_sm);
}
// The uncompacted top-k of a chunk with a tail (resident): keys loaded here, the tail's with round
// 0's latency, then the selection and the ordered output; returns the row's selected count.
template <bool kWindow>
__device__ __noinline__ uint32_t topk_tail_walk(const Chunk<kTopkPer> ch, const ScoreRow r, int cluster, uint32_t rank,
                                                uint32_t k, const SlotEmit emit, const StampCtx st) {
  uint32_t* recv = recv_buffers();
  uint32_t* keys_sm = recv + 2 * cluster * slot_words<kWindow>();
  auto cht = with_tail(ch);
  const TailLoad tl = r.tail_load(cht.tail_elem(), cht.end);
  const auto load = [&](int q, uint32_t (&key)[kTopkPer]) { r.keys(cht.first(q), cht.end, key); };
  for (int q = 0; q < cht.rounds; ++q) {
    uint32_t key[kTopkPer];
    load(q, key);
    store_round_keys(keys_sm, q, key);  // read back by this thread only: no barrier needed
  }
  keys_sm[cht.tail_key_index()] = tail_key(tl);
  cht.preloaded = true;
  const Selection s = cluster_select<kWindow>(cht, load, k, v3_sm, recv, keys_sm, cluster, rank, st);
  emit_selected(cht, load, keys_sm, s, v3_sm, NoPrefetch{}, emit, emit);
  return s.total;
}

// One CTA of row t's cluster (the top-k kernel, or the top-k half of the pair kernel). kTails:
// chunks take a tail where they can (Chunk's kTail; the host's choice, kTailsMaxCluster); without,
// none of the tail walks' code is in the kernel. kWindow: the selection starts with the window
// exchange (cluster_select).
template <bool kTails, bool kWindow>
__device__ __forceinline__ void topk_cta(const IndexerTopkParams& p, const Args& a, int64_t t, Smem& sm) {
  uint32_t* recv = recv_buffers();
  uint32_t* keys_sm = recv + 2 * a.cluster * slot_words<kWindow>();
  const int tid = static_cast<int>(threadIdx.x);
  const uint32_t rank = a.cluster > 1 ? cluster_ctarank() : 0u;
  StampCtx st;
  st.kind = stamps::kSelectTopk;
  if (tid == 0) V4ATTN_STAMP_BEGIN(st.rec, st.kind, 0);
  const int32_t req = p.req[t];
  bool err;
  const int64_t c = clamp_topk_row(req, p.clen[t], p, err);
  if (err && rank == 0 && tid == 0) dev::count_error(p.err_count);
  const uint32_t k = static_cast<uint32_t>(min(static_cast<int64_t>(p.topk), c));  // cluster-uniform
  for (int i = tid; i < kBins; i += kThreads) sm.hloc[i] = 0u;
  if constexpr (kWindow) {
    if (tid == 0) v3_wstats = make_uint4(0u, 0u, 0u, 0u), v3_wpath = select_window_path::kNone;
  }
  init_exchange(sm, a.cluster);
  if (k > 0 && a.cluster > 1) cluster_arrive_relaxed();

  dev::pdl_wait();  // scores, the mask and the slot table come from predecessors
  st.at(1);

  int32_t* out = p.out + t * p.out_stride;
  uint32_t n_out = 0;
  if (k > 0) {
    __syncthreads();  // hloc zeroed
    const Chunk<kTopkPer> ch = make_chunk<kTopkPer>(c, a.cluster, rank, a.rounds_cap);
    const bool tail = kTails && takes_tail(ch, c, a.cluster);
    const uint8_t* mrow = p.candidate_mask != nullptr ? p.candidate_mask + t * p.mask_stride : nullptr;
    const ScoreRow sr{p.scores + t * p.score_stride, mrow, p.mask_block, a.vec};
    const auto load = [&](int q, uint32_t (&key)[kTopkPer]) { sr.keys(ch.first(q), ch.end, key); };
    const int32_t* table = p.comp_slot_table + static_cast<int64_t>(req) * p.comp_table_stride;
    const int64_t out_stride = p.out_stride;
    if (a.compact && mrow != nullptr && ch.resident) {
      int32_t* first_pos = reinterpret_cast<int32_t*>(keys_sm + int64_t{a.rounds_cap} * Chunk<kTopkPer>::kRound);
      uint32_t n_keys = 0;
      if constexpr (kTails) {
        if (tail) n_keys = topk_tail_compact<kWindow>(ch, sr, a.cluster, a.rounds_cap);
      }
      if (!tail) n_keys = kTopkPer * compact_groups(ch, load, TailLoad{}, keys_sm, first_pos, sm);
      Chunk<kCompactPer> cc;  // flat indices into the kept groups' keys
      cc.begin = 0;
      cc.end = n_keys;
      cc.rounds = static_cast<int>((n_keys + Chunk<kCompactPer>::kRound - 1) / Chunk<kCompactPer>::kRound);
      cc.resident = cc.preloaded = true;
      for (int64_t i = n_keys + tid; i < int64_t{cc.rounds} * Chunk<kCompactPer>::kRound; i += kThreads) keys_sm[i] = 0u;
      __syncthreads();  // the kept keys (written by other threads) and the zeroed tail
      st.at(2);
      const auto no_load = [](int, uint32_t (&key)[kCompactPer]) {  // resident: never called
#pragma unroll
        for (int e = 0; e < kCompactPer; ++e) key[e] = 0u;
      };
      const Selection s = cluster_select<kWindow>(cc, no_load, k, sm, recv, keys_sm, a.cluster, rank, st);
      const auto prefetch = [&](int64_t f0, uint32_t cand) {  // the candidates' slots
        SlotPrefetch<kCompactPer> pf;
#pragma unroll
        for (int e = 0; e < kCompactPer; ++e) {
          const int64_t f = f0 + e;
          pf.slot[e] = ((cand >> e) & 1u) ? table[first_pos[f / kTopkPer] + f % kTopkPer] : -1;
        }
        return pf;
      };
      emit_selected(
          cc, no_load, keys_sm, s, sm, prefetch,
          [&](int64_t, uint32_t sel, uint32_t off, const SlotPrefetch<kCompactPer>& pf) {
            const int32_t* slot = pf.slot;
#pragma unroll
            for (int e = 0; e < kCompactPer; ++e)
              if ((sel >> e) & 1u) {
                if (off < out_stride) out[off] = slot[e];
                ++off;
              }
          },
          NoTail{});
      st.at(20);
      n_out = s.total;
    } else {
      // No prefetch here: the candidates' slots loaded before the scan (as the compacted walk
      // does) measured slower in the cycle (docs/perf.md session 18, run 9).
      const SlotEmit emit{table, out, out_stride};
      if constexpr (kTails) {
        if (tail) n_out = topk_tail_walk<kWindow>(ch, sr, a.cluster, rank, k, emit, st);
      }
      if (!tail) {
        const Selection s = cluster_select<kWindow>(ch, load, k, sm, recv, keys_sm, a.cluster, rank, st);
        emit_selected(ch, load, keys_sm, s, sm, NoPrefetch{}, emit, NoTail{});
        n_out = s.total;
      }
      st.at(20);
    }
  }
  const int64_t step = int64_t{a.cluster} * kThreads;
  for (int64_t i = int64_t{n_out} + int64_t{rank} * kThreads + tid; i < p.out_stride; i += step) out[i] = -1;
  if constexpr (kWindow) {
    if (p.v3_window_paths != nullptr && tid == 0)
      p.v3_window_paths[t * select_window_path::kMaxRanks + rank] = static_cast<uint8_t>(v3_wpath);
  }
  st.at(21);

  dev::pdl_launch_dependents();  // after this thread's last store
}

template <bool kTails, bool kWindow>
__global__ void __launch_bounds__(kThreads, kMinCtas)
    indexer_topk_v3_kernel(const __grid_constant__ IndexerTopkParams p, const Args a) {
  topk_cta<kTails, kWindow>(p, a, blockIdx.x / static_cast<unsigned>(a.cluster), v3_sm);
}

// ---- candidate mask ----
using select_keys::block_key;  // indexer_select_common.cuh

template <bool kWindow>
__device__ __forceinline__ void mask_cta(const CandidateMaskParams& p, const Args& a, int64_t t, Smem& sm) {
  uint32_t* recv = recv_buffers();
  uint32_t* keys_sm = recv + 2 * a.cluster * slot_words<kWindow>();
  const int tid = static_cast<int>(threadIdx.x);
  const uint32_t rank = a.cluster > 1 ? cluster_ctarank() : 0u;
  StampCtx st;
  st.kind = stamps::kSelectMask;
  if (tid == 0) V4ATTN_STAMP_BEGIN(st.rec, st.kind, 0);
  int64_t c = p.clen[t];
  if (c < 0 || c > p.score_stride) {
    if (rank == 0 && tid == 0) dev::count_error(p.err_count);
    c = c < 0 ? 0 : p.score_stride;
  }
  const int64_t n_blocks = (c + p.block - 1) / p.block;
  const uint32_t k = static_cast<uint32_t>(min(static_cast<int64_t>(p.topk_blocks), n_blocks));
  for (int i = tid; i < kBins; i += kThreads) sm.hloc[i] = 0u;
  if constexpr (kWindow) {
    if (tid == 0) v3_wstats = make_uint4(0u, 0u, 0u, 0u), v3_wpath = select_window_path::kNone;
  }
  init_exchange(sm, a.cluster);
  if (k > 0 && a.cluster > 1) cluster_arrive_relaxed();

  dev::pdl_wait();
  st.at(1);

  uint8_t* mask = p.mask + t * p.mask_stride;
  int64_t zero_from = 0;  // the cluster zeroes [zero_from, mask_stride)
  if (k > 0) {
    __syncthreads();  // hloc zeroed
    const Chunk<kMaskPer> ch = make_chunk<kMaskPer>(n_blocks, a.cluster, rank, a.rounds_cap);
    const float* row = p.scores + t * p.score_stride;
    const bool vec8 = a.vec && p.block == 8;
    const auto load = [&](int q, uint32_t (&key)[kMaskPer]) {
      const int64_t b0 = ch.first(q);
#pragma unroll
      for (int e = 0; e < kMaskPer; ++e)
        key[e] = b0 + e < ch.end ? block_key(row, c, p.block, b0 + e, n_blocks - 1, vec8) : 0u;
    };
    const Selection s = cluster_select<kWindow>(ch, load, k, sm, recv, keys_sm, a.cluster, rank, st);
    emit_selected(
        ch, load, keys_sm, s, sm, NoPrefetch{},
        [&](int64_t b0, uint32_t sel, uint32_t, int) {
#pragma unroll
          for (int e = 0; e < kMaskPer; ++e)
            if (b0 + e < ch.end) mask[b0 + e] = static_cast<uint8_t>((sel >> e) & 1u);
        },
        NoTail{});
    st.at(20);
    zero_from = n_blocks;
  }
  const int64_t step = int64_t{a.cluster} * kThreads;
  for (int64_t i = zero_from + int64_t{rank} * kThreads + tid; i < p.mask_stride; i += step) mask[i] = 0;
  if constexpr (kWindow) {
    if (p.v3_window_paths != nullptr && tid == 0)
      p.v3_window_paths[t * select_window_path::kMaxRanks + rank] = static_cast<uint8_t>(v3_wpath);
  }
  st.at(21);

  dev::pdl_launch_dependents();
}

template <bool kWindow>
__global__ void __launch_bounds__(kThreads, kMinCtas)
    candidate_mask_v3_kernel(const __grid_constant__ CandidateMaskParams p, const Args a) {
  mask_cta<kWindow>(p, a, blockIdx.x / static_cast<unsigned>(a.cluster), v3_sm);
}

// The candidate source's two selections over the same scores in one launch: clusters [0, T) of the
// grid run the top-k of rows 0..T-1, clusters [T, 2T) the candidate mask (both kinds of cluster
// have the same size; a cluster never mixes them). Neither needs the other's output.
template <bool kTails, bool kWindow>
__global__ void __launch_bounds__(kThreads, kMinCtas)
    select_pair_v3_kernel(const __grid_constant__ IndexerTopkParams tp, const __grid_constant__ CandidateMaskParams mp,
                          const Args ta, const Args ma) {
  const int64_t c = blockIdx.x / static_cast<unsigned>(ta.cluster);
  if (c < tp.T) topk_cta<kTails, kWindow>(tp, ta, c, v3_sm);
  else mask_cta<kWindow>(mp, ma, c - tp.T, v3_sm);
}

}  // namespace v3

void require(bool ok, const char* who, const std::string& what) {
  if (!ok) throw std::invalid_argument(std::string(who) + ": " + what);
}
bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

// This thread's stream-capture mode set to relaxed for the scope: the occupancy query below is
// not a stream operation, but a launcher may be called while its stream is being captured into a
// graph (the prepare cycle), and the relaxed mode is the documented way to make such calls then.
struct RelaxedCaptureMode {
  cudaStreamCaptureMode prev = cudaStreamCaptureModeRelaxed;
  RelaxedCaptureMode() { V4_CUDA_CHECK(cudaThreadExchangeStreamCaptureMode(&prev)); }
  ~RelaxedCaptureMode() { (void)cudaThreadExchangeStreamCaptureMode(&prev); }
  RelaxedCaptureMode(const RelaxedCaptureMode&) = delete;
  RelaxedCaptureMode& operator=(const RelaxedCaptureMode&) = delete;
};

// Whether clusters of `cluster` CTAs of `kernel` with `smem` dynamic bytes can be resident on the
// current device (cached per device, kernel, cluster size and smem size).
bool cluster_fits(const void* kernel, int cluster, size_t smem) {
  static std::mutex mu;
  static std::map<std::tuple<int, const void*, int, size_t>, bool> cache;
  int dev = 0;
  V4_CUDA_CHECK(cudaGetDevice(&dev));
  const auto key = std::make_tuple(dev, kernel, cluster, smem);
  std::lock_guard<std::mutex> lock(mu);
  const auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  const RelaxedCaptureMode relaxed;
  V4_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  if (cluster > 8) V4_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
  cudaLaunchConfig_t lc{};
  lc.gridDim = dim3(static_cast<unsigned>(cluster), 1, 1);
  lc.blockDim = dim3(v3::kThreads, 1, 1);
  lc.dynamicSmemBytes = smem;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = static_cast<unsigned>(cluster);
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  lc.attrs = attr;
  lc.numAttrs = 1;
  int n = 0;
  const cudaError_t e = cudaOccupancyMaxActiveClusters(&n, kernel, &lc);
  if (e != cudaSuccess) (void)cudaGetLastError();  // treated as "does not fit"
  const bool fits = e == cudaSuccess && n > 0;
  cache.emplace(key, fits);
  return fits;
}

// Launch plan of one v3 launch: the cluster size, the resident rounds and the smem bytes.
struct Plan {
  int cluster = 1;
  int rounds_cap = 1;
  size_t smem = 0;
  bool compact = false;  // top-k with a candidate mask: the compacted walk (room for first_pos)
  bool window = false;   // the window kernels (their receive slots hold the window statistics)
};

// An attribute of the current device (cached per device and attribute).
int device_attribute(cudaDeviceAttr attr) {
  static std::mutex mu;
  static std::map<std::pair<int, int>, int> cache;
  int dev = 0;
  V4_CUDA_CHECK(cudaGetDevice(&dev));
  std::lock_guard<std::mutex> lock(mu);
  const auto key = std::make_pair(dev, static_cast<int>(attr));
  const auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  int n = 0;
  V4_CUDA_CHECK(cudaDeviceGetAttribute(&n, attr, dev));
  cache.emplace(key, n);
  return n;
}
// Multiprocessors of the current device.
int sm_count() { return device_attribute(cudaDevAttrMultiProcessorCount); }

// requested: 0 = automatic: the smallest power of two that gives each CTA at most `target`
// elements of the longest possible row (2048 positions / 512 blocks when the rows are few,
// twice that above 16 rows), at most 16 CTAs, and at most `max_ctas` CTAs in all. One launch
// takes 3/2 CTAs per multiprocessor: for 64K-position rows on 132 SMs (T * cluster <= 198) 16 up
// to 12 rows, 8 up to 24, 4 up to 49, 2 up to 99 (select_v3_auto_cluster; pinned by
// GpuIndexerHostChecks.SelectV3LaunchRules). Measured in the cycle (docs/perf.md session 7, run
// 10): at 32 rows 4-CTA clusters, one CTA per SM, beat 8 (256 CTAs, two on most SMs) by 1.6 % per
// decode bs 32 cycle, while at 24 rows 8 (192 CTAs) beat 4; a second wave costs more than bigger
// chunks. 8 when 16 cannot be resident.
void require_cluster_choice(int requested, const char* who) {
  require(requested == 0 || requested == 1 || requested == 2 || requested == 4 || requested == 8 || requested == 16,
          who, "v3_cluster must be 0 (automatic), 1, 2, 4, 8 or 16, not " + std::to_string(requested));
}
// The automatic cluster size before the residency check (select_v3_auto_cluster's rule).
int auto_cluster(int64_t T, int64_t n_max, int per_thread, int64_t max_ctas) {
  const int64_t round = int64_t{v3::kThreads} * per_thread;
  const int64_t target = (T <= 16 ? 4 : 8) * round / 8;  // 2048 / 4096 positions, 512 / 1024 blocks
  int cap = v3::kMaxCluster;
  while (cap > 1 && T * cap > max_ctas) cap /= 2;
  int cluster = 1;
  while (cluster < cap && cluster * target < n_max) cluster *= 2;
  return cluster;
}

// The rounds of keys a CTA keeps in shared memory for rows of at most n_max elements.
int resident_rounds_cap(int64_t n_max, int cluster, int per_thread) {
  const int64_t round = int64_t{v3::kThreads} * per_thread;
  const int max_resident = static_cast<int>(v3::kMaxKeyBytes / (static_cast<size_t>(round) * sizeof(uint32_t)));
  return std::max(1, std::min(v3::chunk_rounds(n_max, cluster, per_thread), max_resident));
}

Plan make_plan(const void* kernel, int requested, int64_t T, int64_t n_max, int per_thread, const char* who,
               bool compact = false, int64_t max_ctas = 0, bool window = false) {
  auto plan_for = [&](int cluster) {
    Plan pl;
    pl.cluster = cluster;
    pl.rounds_cap = resident_rounds_cap(n_max, cluster, per_thread);
    pl.compact = compact;
    pl.window = window;
    pl.smem = v3::dyn_smem_bytes(cluster, pl.rounds_cap, per_thread, compact, window);
    return pl;
  };
  if (requested != 0) {
    const Plan pl = plan_for(requested);
    if (pl.cluster > 8 && !cluster_fits(kernel, pl.cluster, pl.smem))
      throw std::runtime_error(std::string(who) + ": clusters of " + std::to_string(pl.cluster) +
                               " CTAs cannot be resident on this device");
    return pl;
  }
  const int cluster = auto_cluster(T, n_max, per_thread, max_ctas > 0 ? max_ctas : 3 * int64_t{sm_count()} / 2);
  Plan pl = plan_for(cluster);
  if (cluster > 8 && !cluster_fits(kernel, cluster, pl.smem)) pl = plan_for(8);
  return pl;
}

// Launches of at most this many CTAs take a whole SM per CTA (their dynamic shared memory raised
// past half an SM's): two CTAs of a selection on one SM slow each other more than the SMs they
// leave free are worth. Three-lane cycles, docs/perf.md session 18 (same binary, two repetitions):
// verify bs 1 (6 rows x 16 CTAs) -1.0 / -1.1 %, decode bs 4 -1.3 %, decode bs 2 -0.7 %, decode bs 1
// even; with 128-CTA launches too, decode bs 8 +3.0 % and decode bs 32 +1.9 % (their clusters then
// wait for whole free GPCs).
constexpr int64_t kOneCtaPerSmMaxCtas = 96;

// Shared memory per multiprocessor of the current device.
size_t smem_per_sm() { return static_cast<size_t>(device_attribute(cudaDevAttrMaxSharedMemoryPerMultiprocessor)); }

void launch_plan(const char* who, const void* kernel_ptr, const Plan& pl, int64_t T, cudaStream_t stream, bool pdl,
                 LaunchConfig& cfg) {
  require(T * pl.cluster <= 0x7fffffff, who, "T too large for one grid dimension");
  cfg.grid = dim3(static_cast<unsigned>(T * pl.cluster), 1, 1);
  cfg.block = dim3(v3::kThreads, 1, 1);
  cfg.smem_bytes = pl.smem;
  if (T * pl.cluster <= kOneCtaPerSmMaxCtas) {  // half an SM's shared memory: one CTA per SM
    const size_t one = std::max(pl.smem, smem_per_sm() / 2);
    if (pl.cluster == 1 || cluster_fits(kernel_ptr, pl.cluster, one)) cfg.smem_bytes = one;
  }
  cfg.stream = stream;
  cfg.pdl = pdl;
  cfg.cluster = dim3(static_cast<unsigned>(pl.cluster), 1, 1);
  if (pl.cluster > 8)
    V4_CUDA_CHECK(cudaFuncSetAttribute(kernel_ptr, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
}

}  // namespace

namespace {

// Argument checks of the v3 launchers (the pair checks both); false: nothing to launch (T == 0).
bool check_topk_v3(const IndexerTopkParams& p, const char* who) {
  require(p.T >= 0, who, "negative T");
  require(p.out_stride > 0 && p.out_stride % 64 == 0, who,
          "out_stride " + std::to_string(p.out_stride) + " must be a positive multiple of 64");
  require(p.topk >= 0 && p.topk <= p.out_stride, who,
          "topk " + std::to_string(p.topk) + " must be in [0, out_stride]");
  require(p.score_stride > 0 && p.score_stride < (int64_t{1} << 31), who, "score_stride must be in [1, 2^31)");
  require(p.comp_table_stride >= 0 && p.comp_table_rows >= 0, who, "negative slot table shape");
  if (p.candidate_mask != nullptr) {
    require(p.mask_block > 0, who, "mask_block must be > 0");
    require(p.mask_stride >= (p.score_stride + p.mask_block - 1) / p.mask_block, who,
            "mask_stride must be >= ceil(score_stride / mask_block)");
  }
  require_cluster_choice(p.v3_cluster, who);
  if (p.T == 0) return false;
  require(p.scores != nullptr && p.clen != nullptr && p.req != nullptr && p.out != nullptr, who, "null pointer");
  require(p.comp_slot_table != nullptr || p.comp_table_rows == 0, who, "null slot table");
  return true;
}
bool check_mask_v3(const CandidateMaskParams& p, const char* who) {
  require(p.T >= 0, who, "negative T");
  require(p.block > 0, who, "block must be > 0");
  require(p.topk_blocks >= 0, who, "topk_blocks must be >= 0");
  require(p.score_stride > 0 && p.score_stride < (int64_t{1} << 31), who, "score_stride must be in [1, 2^31)");
  require(p.mask_stride >= (p.score_stride + p.block - 1) / p.block && p.mask_stride < (int64_t{1} << 31), who,
          "mask_stride must be >= ceil(score_stride / block) (and < 2^31)");
  require_cluster_choice(p.v3_cluster, who);
  if (p.T == 0) return false;
  require(p.scores != nullptr && p.clen != nullptr && p.mask != nullptr, who, "null pointer");
  return true;
}
int64_t mask_blocks(const CandidateMaskParams& p) { return (p.score_stride + p.block - 1) / p.block; }

v3::Args args_of(const Plan& pl, const float* scores, int64_t score_stride) {
  v3::Args a;
  a.cluster = pl.cluster;
  a.rounds_cap = pl.rounds_cap;
  a.vec = aligned16(scores) && score_stride % 4 == 0;
  a.compact = pl.compact;
  return a;
}
// Launches of clusters of at most this many CTAs run the top-k kernels with chunk tails (Chunk's
// kTail); larger clusters the ones without their code. Three-lane cycles (docs/perf.md session 19,
// runs 9-10, against the session-start binary in the same run): at 65537-position rows verify bs 4
// (8-CTA clusters) -0.8 %, verify bs 8, decode bs 16 / 32 (4-CTA clusters) -0.5 to -0.9 %; at
// 60001-position rows (no tail) within +-0.3 %. With tails in the 16-CTA launches too (up to 12
// rows), verify bs 1 +0.3 %: there the bench's gain (one row 17.6 -> 14.7 us) does not reach the
// cycle.
constexpr int kTailsMaxCluster = 8;
bool takes_tails(const Plan& pl) { return pl.cluster <= kTailsMaxCluster; }

// The top-k's rows with a candidate mask take the compacted walk (compact_groups).
bool topk_compacts(const IndexerTopkParams& p) { return p.candidate_mask != nullptr && p.v3_compact; }

}  // namespace

namespace {
// The kernel instantiations by chunk tails and the window exchange.
using TopkKernel = void (*)(IndexerTopkParams, v3::Args);
using MaskKernel = void (*)(CandidateMaskParams, v3::Args);
using PairKernel = void (*)(IndexerTopkParams, CandidateMaskParams, v3::Args, v3::Args);
TopkKernel topk_kernel(bool tails, bool window) {
  if (tails) return window ? v3::indexer_topk_v3_kernel<true, true> : v3::indexer_topk_v3_kernel<true, false>;
  return window ? v3::indexer_topk_v3_kernel<false, true> : v3::indexer_topk_v3_kernel<false, false>;
}
MaskKernel mask_kernel(bool window) {
  return window ? v3::candidate_mask_v3_kernel<true> : v3::candidate_mask_v3_kernel<false>;
}
PairKernel pair_kernel(bool tails, bool window) {
  if (tails) return window ? v3::select_pair_v3_kernel<true, true> : v3::select_pair_v3_kernel<true, false>;
  return window ? v3::select_pair_v3_kernel<false, true> : v3::select_pair_v3_kernel<false, false>;
}
const void* ptr(TopkKernel k) { return reinterpret_cast<const void*>(k); }
const void* ptr(MaskKernel k) { return reinterpret_cast<const void*>(k); }
const void* ptr(PairKernel k) { return reinterpret_cast<const void*>(k); }
}  // namespace

void run_indexer_topk_v3(const IndexerTopkParams& p, cudaStream_t stream, bool pdl) {
  const char* who = "run_indexer_topk_v3";
  if (!check_topk_v3(p, who)) return;
  const Plan pl = make_plan(ptr(topk_kernel(false, p.v3_window)), p.v3_cluster, p.T, p.score_stride, v3::kTopkPer, who,
                            topk_compacts(p), 0, p.v3_window);
  const auto kernel = topk_kernel(takes_tails(pl), p.v3_window);
  LaunchConfig cfg;
  launch_plan(who, reinterpret_cast<const void*>(kernel), pl, p.T, stream, pdl, cfg);
  launch_kernel("indexer_topk_v3", kernel, cfg, p, args_of(pl, p.scores, p.score_stride));
}

void run_candidate_mask_v3(const CandidateMaskParams& p, cudaStream_t stream, bool pdl) {
  const char* who = "run_candidate_mask_v3";
  if (!check_mask_v3(p, who)) return;
  const auto kernel = mask_kernel(p.v3_window);
  const Plan pl = make_plan(ptr(kernel), p.v3_cluster, p.T, mask_blocks(p), v3::kMaskPer, who, false, 0, p.v3_window);
  LaunchConfig cfg;
  launch_plan(who, reinterpret_cast<const void*>(kernel), pl, p.T, stream, pdl, cfg);
  launch_kernel("candidate_mask_v3", kernel, cfg, p, args_of(pl, p.scores, p.score_stride));
}

int select_v3_auto_cluster(int64_t T, int64_t n, bool mask, int sms) {
  if (T < 1 || n < 1 || sms < 1) throw std::invalid_argument("select_v3_auto_cluster: T, n and sms must be >= 1");
  return auto_cluster(T, n, mask ? v3::kMaskPer : v3::kTopkPer, 3 * int64_t{sms} / 2);
}

bool select_v3_topk_takes_tail(int64_t n, int64_t score_stride, int cluster) {
  const char* who = "select_v3_topk_takes_tail";
  if (cluster == 0) throw std::invalid_argument(std::string(who) + ": an explicit cluster size (1, 2, 4, 8 or 16)");
  require_cluster_choice(cluster, who);
  if (n < 1 || n > score_stride) throw std::invalid_argument(std::string(who) + ": n must be in [1, score_stride]");
  if (cluster > kTailsMaxCluster) return false;  // the kernels without tail code (takes_tails)
  const int rounds = v3::chunk_rounds(n, cluster, v3::kTopkPer);
  return v3::tail_after_rounds(n, cluster, v3::kTopkPer, rounds,
                               rounds <= resident_rounds_cap(score_stride, cluster, v3::kTopkPer));
}

bool select_v3_pair_is_one_launch(int64_t T, int64_t score_stride, int sms) {
  if (T < 1 || score_stride < 1 || sms < 1)
    throw std::invalid_argument("select_v3_pair_is_one_launch: T, score_stride and sms must be >= 1");
  return auto_cluster(2 * T, score_stride, v3::kTopkPer, 2 * int64_t{sms}) ==
         auto_cluster(T, score_stride, v3::kTopkPer, 3 * int64_t{sms} / 2);
}

bool run_indexer_select_pair_v3(const IndexerTopkParams& tp, const CandidateMaskParams& mp, cudaStream_t stream,
                                bool pdl) {
  const char* who = "run_indexer_select_pair_v3";
  const bool any_t = check_topk_v3(tp, who);
  check_mask_v3(mp, who);
  require(tp.T == mp.T, who, "the top-k and the mask must cover the same rows (T " + std::to_string(tp.T) + " vs " +
                                 std::to_string(mp.T) + ")");
  require(tp.v3_cluster == mp.v3_cluster, who, "one cluster size for both halves (v3_cluster differs)");
  require(tp.v3_window == mp.v3_window, who, "one selection form for both halves (v3_window differs)");
  require(tp.candidate_mask == nullptr || tp.candidate_mask != mp.mask, who,
          "the top-k cannot read the mask the same launch writes");
  if (!any_t) return true;
  const bool window = tp.v3_window;
  const void* pair_ptr = ptr(pair_kernel(false, window));
  // The automatic cluster for 2T rows within one wave of 2 CTAs per SM (the pair's two halves);
  // when that is smaller than what the top-k alone takes (9..31 rows on 132 SMs), two launches
  // one after the other are faster than a pair of smaller clusters: then the caller's order
  // (mask, top-k) is kept. At 32 rows both take 4-CTA clusters: one launch of 256 CTAs (run 10).
  const Plan alone = make_plan(ptr(topk_kernel(false, window)), tp.v3_cluster, tp.T, tp.score_stride, v3::kTopkPer, who,
                               topk_compacts(tp), 0, window);
  const Plan pt = make_plan(pair_ptr, tp.v3_cluster, 2 * tp.T, tp.score_stride, v3::kTopkPer, who, topk_compacts(tp),
                            2 * int64_t{sm_count()}, window);
  Plan pm = make_plan(pair_ptr, pt.cluster, mp.T, mask_blocks(mp), v3::kMaskPer, who, false, 0, window);
  const size_t smem = std::max(pt.smem, pm.smem);
  if (pt.cluster < alone.cluster || (pt.cluster > 8 && !cluster_fits(pair_ptr, pt.cluster, smem))) {
    run_candidate_mask_v3(mp, stream, pdl);
    run_indexer_topk_v3(tp, stream, pdl);
    return false;
  }
  pm.smem = smem;
  const auto pair = pair_kernel(takes_tails(pt), window);
  LaunchConfig cfg;
  launch_plan(who, reinterpret_cast<const void*>(pair), pm, 2 * tp.T, stream, pdl, cfg);
  launch_kernel("select_pair_v3", pair, cfg, tp, mp, args_of(pt, tp.scores, tp.score_stride),
                args_of(pm, mp.scores, mp.score_stride));
  return true;
}

}  // namespace v4attn::kernels
