// Indexer selection kernels (spec 3.4): top-k -> slots, the candidate-source block mask, and the
// mask applied by later index sources. Twins of ref::topk_to_slots, ref::candidate_mask and
// ref::apply_candidate_mask (exact indices, exact tie order).
//
// Two versions of top-k and of the candidate mask: v2 (many CTAs per row, needs a workspace; see
// the v2 section below) and v1 (one CTA of 1024 threads per row, no workspace; ~95 us for a 64K
// row on an H200, which made it the critical path of the prepare cycle). run_* picks v2 when the
// params carry a workspace.
//
// ---- v1 ----
// v1 selection core (one CTA of 1024 threads per row). Each element i < n has a 32-bit key: the
// order-preserving transform of its fp32 value (-0.0 folded onto +0.0, since the reference
// compares floats and -0.0 == +0.0), or 0 for an element that can never be selected (value not
// > -inf: -inf, NaN, masked). Valid keys are >= 0x00800000, so 0 is free. The reference order is
// (value descending, index ascending); its top k is {key > K*} plus the lowest-index k_eq
// elements with key == K*, where K* is the key of the k-th element. K* comes from a radix select
// over the keys: digits of 12, 10 and 10 bits from the top, each a shared-memory histogram
// (warp-aggregated atomics) and a block scan that finds the digit holding the k-th element.
// When every valid element fits (n_valid <= k) there is no select: K* = 0, k_eq = 0.
//
// Output: bitmaps over the elements, {key > K*} and {key == K*}, one 32-bit word per 32 elements,
// in chunks of 65536 elements; a block scan over the words' tie counts keeps the first k_eq ties,
// a second scan over the selected counts gives each word's output offset. Each thread owns 2
// consecutive words, so the output comes in index order by construction (the reference's sort by
// position for free).
//
// Two ways through (chosen per row, uniformly):
//  - short path (n <= 65536 and at most 4096 elements share the top-12-bit digit of the k-th):
//    pass 1 reads the row for the first histogram; pass 2 reads it again, writes the bitmap of
//    {digit above} and appends the elements of the threshold digit (key, index) to a shared list;
//    the last two digits and the tie bits come from that list. 2 reads of the row.
//  - general path: 3 histogram passes + 1 bitmap pass over the row (4 reads), chunked, any n.
//
// Bytes (top-k, per row): the clen scores are read twice (short path) or 4 times (general path)
// when clen > topk, once when clen <= topk (the row is L2-resident after its first read); plus k
// slot table entries and out_stride ints written.
//
// PDL: clen and req are read before dev::pdl_wait(); scores and the mask after it. The trigger
// follows the CTA's last store.
#include "v4attn/kernels/indexer_kernels.h"

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "kernels/device_common.cuh"
#include "kernels/indexer_select_common.cuh"
#include "runtime/launch.h"

namespace v4attn::kernels {

namespace {

constexpr int kThreads = 1024;
constexpr int kWarps = kThreads / 32;
constexpr int kDigit1Bits = 12, kDigit2Bits = 10, kDigit3Bits = 10;  // 32 bits from the top
constexpr int kShift1 = 32 - kDigit1Bits, kShift2 = kShift1 - kDigit2Bits;  // 20, 10
constexpr int kHistBins = 1 << kDigit1Bits;   // 4096
constexpr int kChunkWords = 2 * kThreads;     // bitmap words per output chunk
constexpr int64_t kChunkElems = 32 * int64_t{kChunkWords};  // 65536
constexpr int kCandCap = 4096;                // short path: threshold-digit list capacity
constexpr uint32_t kFullMask = 0xffffffffu;
constexpr uint32_t kKeyNone = 0xffffffffu;  // threshold that selects nothing (with k_eq = 0)

struct SelectSmem {
  int hist[kHistBins];
  uint32_t bm_gt[kChunkWords];
  uint32_t bm_eq[kChunkWords];
  uint32_t cand_key[kCandCap];
  int32_t cand_idx[kCandCap];
  int warp_total[kWarps];
  int found_bin;
  int found_above;
  int cand_count;
};
constexpr size_t kSelectSmemBytes = sizeof(SelectSmem);  // ~80 KB: dynamic shared memory

__device__ __forceinline__ SelectSmem& select_smem() {
  extern __shared__ __align__(16) uint8_t smem_raw[];
  return *reinterpret_cast<SelectSmem*>(smem_raw);
}

using select_keys::neg_inf;  // indexer_select_common.cuh
using select_keys::value_key;

// Scores of one row (positions < clen), optionally masked by candidate blocks.
struct ScoreKeys {
  const float* row;
  const uint8_t* mask;  // null: no mask
  int mask_block;
  __device__ __forceinline__ uint32_t key(int64_t j) const {
    const float v = row[j];
    if (mask != nullptr && mask[j / mask_block] == 0) return 0u;
    return v > neg_inf() ? value_key(v) : 0u;
  }
};

// Candidate blocks of one row: max over `block` positions below clen (num::max_f from -inf, as
// the reference), the newest block pinned to +inf.
struct BlockKeys {
  const float* row;
  int64_t clen;
  int block;
  int64_t newest;
  __device__ __forceinline__ uint32_t key(int64_t i) const {
    float v = neg_inf();
    if (i == newest) {
      v = __int_as_float(0x7f800000);
    } else {
      const int64_t end = min((i + 1) * block, clen);
      for (int64_t j = i * block; j < end; ++j) v = num::max_f(v, row[j]);
    }
    return v > neg_inf() ? value_key(v) : 0u;
  }
};

// Inclusive scan of one int per thread over the CTA; `total` gets the CTA sum. All threads call.
__device__ __forceinline__ int block_scan_inclusive(int v, int& total, SelectSmem& sm) {
  const int lane = static_cast<int>(threadIdx.x) % 32, wid = static_cast<int>(threadIdx.x) / 32;
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const int n = __shfl_up_sync(kFullMask, v, off);
    if (lane >= off) v += n;
  }
  if (lane == 31) sm.warp_total[wid] = v;
  __syncthreads();
  if (wid == 0) {
    int w = sm.warp_total[lane];
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
      const int n = __shfl_up_sync(kFullMask, w, off);
      if (lane >= off) w += n;
    }
    sm.warp_total[lane] = w;
  }
  __syncthreads();
  const int result = v + (wid > 0 ? sm.warp_total[wid - 1] : 0);
  total = sm.warp_total[kWarps - 1];
  __syncthreads();  // warp_total is reused by the next scan
  return result;
}

__device__ __forceinline__ void zero_hist(int bins, SelectSmem& sm) {
  for (int i = threadIdx.x; i < bins; i += kThreads) sm.hist[i] = 0;
  __syncthreads();
}

// Histogram (over the row, from global memory) of the digit (key >> shift) & (2^digit_bits - 1)
// of valid keys whose bits from shift + digit_bits up equal `prefix` (all valid keys when
// shift + digit_bits == 32). Warp-aggregated shared atomics: equal digits in a warp (ties) cost
// one atomic.
template <class Keys>
__device__ void histogram_pass(const Keys& keys, int64_t n, int shift, int digit_bits, uint32_t prefix,
                               SelectSmem& sm) {
  const int prefix_shift = shift + digit_bits;
  const uint32_t digit_mask = (1u << digit_bits) - 1u;
  zero_hist(1 << digit_bits, sm);
  const int64_t n_round = (n + kThreads - 1) / kThreads * kThreads;  // every lane of a warp iterates alike
  for (int64_t j = threadIdx.x; j < n_round; j += kThreads) {
    const uint32_t k = j < n ? keys.key(j) : 0u;
    const bool take = k != 0u && (prefix_shift >= 32 || (k >> prefix_shift) == prefix);
    const uint32_t active = __ballot_sync(kFullMask, take);
    if (take) {
      const uint32_t digit = (k >> shift) & digit_mask;
      const uint32_t peers = __match_any_sync(active, digit);
      if ((threadIdx.x % 32) == static_cast<unsigned>(__ffs(peers) - 1)) atomicAdd(&sm.hist[digit], __popc(peers));
    }
  }
  __syncthreads();
}

// After a histogram of `bins` (<= 4096) bins: the digit holding the k_rem-th largest element
// (1-based) and the number of elements in higher digits. Precondition: total >= k_rem >= 1.
__device__ void find_digit(int k_rem, int bins, int& digit, int& above, SelectSmem& sm) {
  // Thread i owns the `per` descending bins bins-1-per*i, ..., bins-per*(i+1).
  const int per = (bins + kThreads - 1) / kThreads;
  const int top = bins - 1 - per * static_cast<int>(threadIdx.x);
  int h[kHistBins / kThreads];
  int sum = 0;
#pragma unroll
  for (int q = 0; q < kHistBins / kThreads; ++q) {
    h[q] = (q < per && top - q >= 0) ? sm.hist[top - q] : 0;
    sum += h[q];
  }
  int total;
  const int incl = block_scan_inclusive(sum, total, sm);
  int acc = incl - sum;
  if (acc < k_rem && k_rem <= incl) {
#pragma unroll
    for (int q = 0; q < kHistBins / kThreads; ++q) {
      if (q < per && acc + h[q] >= k_rem) {
        sm.found_bin = top - q;
        sm.found_above = acc;
        break;
      }
      acc += h[q];
    }
  }
  __syncthreads();
  digit = sm.found_bin;
  above = sm.found_above;
  __syncthreads();
}

// The lowest n set bits of m.
__device__ __forceinline__ uint32_t lowest_set_bits(uint32_t m, int n) {
  if (n >= __popc(m)) return m;
  uint32_t r = 0u;
  for (int i = 0; i < n; ++i) {
    const uint32_t b = m & (0u - m);
    r |= b;
    m ^= b;
  }
  return r;
}

// Output of one chunk whose bitmaps are in shared memory: keeps the first (k_eq - eq_seen) tie
// bits in index order, then calls emit(first_index, selected_bits, out_offset) for this thread's
// two words (elements base + 64*tid .. +64). Updates eq_seen and out_count (CTA-uniform).
template <class Emit>
__device__ void compact_and_emit(int64_t base, int k_eq, int& eq_seen, int& out_count, SelectSmem& sm,
                                 const Emit& emit) {
  const int w0 = 2 * static_cast<int>(threadIdx.x), w1 = w0 + 1;
  const uint32_t eq0 = sm.bm_eq[w0], eq1 = sm.bm_eq[w1];
  const uint32_t gt0 = sm.bm_gt[w0], gt1 = sm.bm_gt[w1];
  const int e0 = __popc(eq0), e1 = __popc(eq1);
  int eq_total;
  const int eq_incl = block_scan_inclusive(e0 + e1, eq_total, sm);
  const int before0 = eq_seen + eq_incl - e0 - e1, before1 = before0 + e0;
  const uint32_t sel0 = gt0 | lowest_set_bits(eq0, max(0, min(e0, k_eq - before0)));
  const uint32_t sel1 = gt1 | lowest_set_bits(eq1, max(0, min(e1, k_eq - before1)));
  const int cnt = __popc(sel0) + __popc(sel1);
  int sel_total;
  const int sel_incl = block_scan_inclusive(cnt, sel_total, sm);  // ends with __syncthreads
  const int off = out_count + sel_incl - cnt;
  emit(base + 32 * int64_t{w0}, sel0, off);
  emit(base + 32 * int64_t{w1}, sel1, off + __popc(sel0));
  eq_seen += eq_total;
  out_count += sel_total;
}

// General output stage over elements [0, n_out) (keys exist below n_keyed <= n_out): per chunk,
// the bitmaps from a warp ballot per word, then compact_and_emit. Returns the number selected.
template <class Keys, class Emit>
__device__ int select_and_emit(const Keys& keys, int64_t n_out, int64_t n_keyed, uint32_t thr, int k_eq,
                               SelectSmem& sm, const Emit& emit) {
  const int lane = static_cast<int>(threadIdx.x) % 32, wid = static_cast<int>(threadIdx.x) / 32;
  int eq_seen = 0, out_count = 0;
  for (int64_t base = 0; base < n_out; base += kChunkElems) {
    for (int w = wid; w < kChunkWords; w += kWarps) {
      const int64_t j = base + 32 * int64_t{w} + lane;
      const uint32_t k = j < n_keyed ? keys.key(j) : 0u;
      const uint32_t gt = __ballot_sync(kFullMask, k != 0u && k > thr);
      const uint32_t eq = __ballot_sync(kFullMask, k != 0u && k == thr);
      if (lane == 0) {
        sm.bm_gt[w] = gt;
        sm.bm_eq[w] = eq;
      }
    }
    __syncthreads();
    compact_and_emit(base, k_eq, eq_seen, out_count, sm, emit);  // its last scan syncs: bitmaps free
  }
  return out_count;
}

// Selects the top k of the n keyed elements (index order output over [0, n_out), n_out >= n) and
// emits them; returns the number selected (min(k, valid elements)). k <= 0 selects nothing (but
// still emits every word, so a mask gets its zeros).
template <class Keys, class Emit>
__device__ int select_topk(const Keys& keys, int64_t n, int64_t n_out, int k, SelectSmem& sm, const Emit& emit) {
  if (k <= 0) return select_and_emit(keys, n_out, n, kKeyNone, 0, sm, emit);
  if (n <= k) return select_and_emit(keys, n_out, n, 0u, 0, sm, emit);  // every valid element

  // Digit 1 (bits 31..20) over the row; its total is the number of valid elements.
  histogram_pass(keys, n, kShift1, kDigit1Bits, 0u, sm);
  int n_valid;
  {
    int v = 0;
    for (int i = threadIdx.x; i < kHistBins; i += kThreads) v += sm.hist[i];
    block_scan_inclusive(v, n_valid, sm);
  }
  if (n_valid <= k) return select_and_emit(keys, n_out, n, 0u, 0, sm, emit);
  int d1, above;
  find_digit(k, kHistBins, d1, above, sm);
  int k_rem = k - above;
  const int in_d1 = sm.hist[d1];
  __syncthreads();  // everyone has read hist[d1] before it is zeroed

  if (n_out <= kChunkElems && in_d1 <= kCandCap) {
    // ---- short path: one more read of the row gives {digit > d1} and the list of digit d1 ----
    const int lane = static_cast<int>(threadIdx.x) % 32, wid = static_cast<int>(threadIdx.x) / 32;
    if (threadIdx.x == 0) sm.cand_count = 0;
    __syncthreads();
    for (int w = wid; w < kChunkWords; w += kWarps) {
      const int64_t j = 32 * int64_t{w} + lane;
      const uint32_t key = j < n ? keys.key(j) : 0u;
      const uint32_t digit = key >> kShift1;
      const uint32_t gt = __ballot_sync(kFullMask, key != 0u && digit > static_cast<uint32_t>(d1));
      const bool is_cand = key != 0u && digit == static_cast<uint32_t>(d1);
      const uint32_t cand = __ballot_sync(kFullMask, is_cand);
      if (lane == 0) {
        sm.bm_gt[w] = gt;
        sm.bm_eq[w] = 0u;
      }
      if (cand != 0u) {  // warp-uniform
        int slot0 = 0;
        if (lane == 0) slot0 = atomicAdd(&sm.cand_count, __popc(cand));
        slot0 = __shfl_sync(kFullMask, slot0, 0);
        if (is_cand) {
          const int slot = slot0 + __popc(cand & ((1u << lane) - 1u));
          sm.cand_key[slot] = key;
          sm.cand_idx[slot] = static_cast<int32_t>(j);
        }
      }
    }
    __syncthreads();
    const int nc = in_d1;  // == cand_count
    // Digit 2 (bits 19..10) and digit 3 (bits 9..0) over the list (all of digit d1).
    zero_hist(1 << kDigit2Bits, sm);
    for (int i = threadIdx.x; i < nc; i += kThreads)
      atomicAdd(&sm.hist[(sm.cand_key[i] >> kShift2) & ((1u << kDigit2Bits) - 1u)], 1);
    __syncthreads();
    int d2;
    find_digit(k_rem, 1 << kDigit2Bits, d2, above, sm);
    k_rem -= above;
    const uint32_t prefix = (static_cast<uint32_t>(d1) << kDigit2Bits) | static_cast<uint32_t>(d2);
    zero_hist(1 << kDigit3Bits, sm);
    for (int i = threadIdx.x; i < nc; i += kThreads) {
      const uint32_t key = sm.cand_key[i];
      if ((key >> kShift2) == prefix) atomicAdd(&sm.hist[key & ((1u << kDigit3Bits) - 1u)], 1);
    }
    __syncthreads();
    int d3;
    find_digit(k_rem, 1 << kDigit3Bits, d3, above, sm);
    k_rem -= above;
    const uint32_t thr = (prefix << kDigit3Bits) | static_cast<uint32_t>(d3);
    for (int i = threadIdx.x; i < nc; i += kThreads) {
      const uint32_t key = sm.cand_key[i];
      const int32_t j = sm.cand_idx[i];
      if (key > thr) atomicOr(&sm.bm_gt[j >> 5], 1u << (j & 31));
      else if (key == thr) atomicOr(&sm.bm_eq[j >> 5], 1u << (j & 31));
    }
    __syncthreads();
    int eq_seen = 0, out_count = 0;
    compact_and_emit(0, k_rem, eq_seen, out_count, sm, emit);
    return out_count;
  }

  // ---- general path: digits 2 and 3 over the row, then the chunked output ----
  histogram_pass(keys, n, kShift2, kDigit2Bits, static_cast<uint32_t>(d1), sm);
  int d2;
  find_digit(k_rem, 1 << kDigit2Bits, d2, above, sm);
  k_rem -= above;
  const uint32_t prefix = (static_cast<uint32_t>(d1) << kDigit2Bits) | static_cast<uint32_t>(d2);
  histogram_pass(keys, n, 0, kDigit3Bits, prefix, sm);
  int d3;
  find_digit(k_rem, 1 << kDigit3Bits, d3, above, sm);
  k_rem -= above;
  const uint32_t thr = (prefix << kDigit3Bits) | static_cast<uint32_t>(d3);
  return select_and_emit(keys, n_out, n, thr, k_rem, sm, emit);
}

// Row metadata shared by top-k: clamps like the reference refuses, counts once per row.
__device__ __forceinline__ int64_t clamp_row(int32_t req, int64_t c, const IndexerTopkParams& p, bool& err) {
  err = false;
  if (c < 0) { c = 0; err = true; }
  if (c > p.score_stride) { c = p.score_stride; err = true; }
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

// ---- top-k -> slots ---------------------------------------------------------------------------
// Grid T, block 1024: one CTA per row.
__global__ void __launch_bounds__(kThreads) indexer_topk_kernel(const __grid_constant__ IndexerTopkParams p) {
  SelectSmem& sm = select_smem();
  const int64_t t = blockIdx.x;
  const int32_t req = p.req[t];
  bool err;
  const int64_t c = clamp_row(req, p.clen[t], p, err);
  if (err && threadIdx.x == 0) dev::count_error(p.err_count);

  dev::pdl_wait();  // scores (and the mask) come from predecessors

  int32_t* out = p.out + t * p.out_stride;
  const int k = static_cast<int>(min(static_cast<int64_t>(p.topk), c));
  int n_out = 0;
  if (k > 0) {
    const ScoreKeys keys{p.scores + t * p.score_stride,
                         p.candidate_mask != nullptr ? p.candidate_mask + t * p.mask_stride : nullptr, p.mask_block};
    const int32_t* table = p.comp_slot_table + static_cast<int64_t>(req) * p.comp_table_stride;
    const int64_t out_stride = p.out_stride;
    n_out = select_topk(keys, c, c, k, sm, [&](int64_t first, uint32_t bits, int off) {
      while (bits != 0u) {
        const int b = __ffs(bits) - 1;
        bits &= bits - 1u;
        if (off < out_stride) out[off] = table[first + b];
        ++off;
      }
    });
  }
  for (int64_t i = n_out + threadIdx.x; i < p.out_stride; i += kThreads) out[i] = -1;

  dev::pdl_launch_dependents();  // after this thread's last store
}

// ---- candidate mask ---------------------------------------------------------------------------
// Grid T, block 1024: one CTA per row; elements are the row's blocks of `block` positions.
__global__ void __launch_bounds__(kThreads) candidate_mask_kernel(const __grid_constant__ CandidateMaskParams p) {
  SelectSmem& sm = select_smem();
  const int64_t t = blockIdx.x;
  int64_t c = p.clen[t];
  if (c < 0 || c > p.score_stride) {
    if (threadIdx.x == 0) dev::count_error(p.err_count);
    c = c < 0 ? 0 : p.score_stride;
  }
  const int64_t n_blocks = (c + p.block - 1) / p.block;

  dev::pdl_wait();

  const BlockKeys keys{p.scores + t * p.score_stride, c, p.block, n_blocks - 1};
  const int k = static_cast<int>(min(static_cast<int64_t>(p.topk_blocks), n_blocks));
  uint8_t* mask = p.mask + t * p.mask_stride;
  // Every byte of [0, mask_stride) is written: blocks >= n_blocks have key 0 (never selected).
  select_topk(keys, n_blocks, p.mask_stride, k, sm, [&](int64_t first, uint32_t bits, int) {
    const int64_t end = min(first + 32, p.mask_stride);
    for (int64_t i = first; i < end; ++i) mask[i] = static_cast<uint8_t>((bits >> (i - first)) & 1u);
  });

  dev::pdl_launch_dependents();
}

// =================================================================================================
// v2: many CTAs per row (grid (chunks, T), 512 threads), no grid-wide barrier.
//
// Each chunk CTA reads its chunk (4096 positions, or 1024 candidate blocks; each thread 8 / 2
// consecutive elements, kept in registers), selects the chunk's own top k (same order: key
// descending, index ascending) and writes it in index order to the chunk's fixed place in the
// row's list (keys 0 pad the place to its capacity). The global top k is the top k of the union of
// the chunk lists (an element among the global top k has fewer than k elements before it in the
// global order, so also in its chunk's order). The CTA that arrives last at the row's counter
// (threadfence + atomicAdd, the classic last-block pattern) merges: a radix select over the lists
// (read from L2) and an ordered compaction over them (list order = chunk order then index order =
// position order, so the output comes sorted by position and ties resolve to the lowest position
// by construction). It resets the counter for the next launch. A row of one chunk is finished by
// its own CTA without touching the workspace.
//
// Radix select (shared by both phases): digits of 12, 10 and 10 bits from the top of the key,
// each a shared-memory histogram with warp-aggregated atomics and a block scan that finds the
// digit of the k-th element; when at most k elements are valid the threshold is 0 (all valid).
// Ordered compaction: per thread the count of ties (key == K*) and a block scan give each tie
// its rank in index order (the first k_eq are kept); a second scan gives the output offsets.
// The phases' global loads are issued in batches (all loads, then all uses) so that a thread
// never waits for two dependent latencies per element.
//
// Bytes (top-k, one row of clen positions): the scores once (4 B per position), the chunk lists
// (8 B per entry, written once, read at most twice from L2), the selected slot-table entries and
// the output row.
// PDL: clen and req are read before dev::pdl_wait(); scores, the mask and the workspace after it.
// Every CTA triggers after its last store.
// =================================================================================================
namespace v2 {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr int kTopkPer = 8;                                       // consecutive positions per thread
constexpr int64_t kTopkChunk = int64_t{kThreads} * kTopkPer;      // 4096 positions per CTA
constexpr int kMaskPer = 2;                                       // consecutive blocks per thread
constexpr int64_t kMaskChunk = int64_t{kThreads} * kMaskPer;      // 1024 blocks per CTA
constexpr int kMergePer = 16;                                     // list entries per thread per round
constexpr int64_t kMergeRound = int64_t{kThreads} * kMergePer;    // 8192 (one round for 64K rows)
constexpr int64_t kCounterBytes = kSelectMaxRows * 4;             // uint32 arrival counter per row

struct Smem {
  int hist[kHistBins];
  int warp_total[kWarps];
  int found_bin;
  int found_above;
  int is_last;
};

// Workspace: [kCounterBytes of counters] then per row keys[n_chunks * cap] (uint32, 0 = empty)
// and idx[n_chunks * cap] (int32 positions or blocks).
struct Layout {
  int64_t n_chunks = 1, cap = 1;
  __host__ __device__ int64_t idx_offset() const { return (n_chunks * cap * 4 + 15) / 16 * 16; }
  __host__ __device__ int64_t row_bytes() const { return (idx_offset() + n_chunks * cap * 4 + 255) / 256 * 256; }
  int64_t total(int64_t T) const { return kCounterBytes + T * row_bytes(); }
};
Layout make_layout(int64_t n_elems, int64_t chunk, int64_t k) {
  Layout L;
  L.n_chunks = std::max<int64_t>(1, (n_elems + chunk - 1) / chunk);
  L.cap = std::max<int64_t>(1, std::min(k, chunk));
  return L;
}

struct Args {
  Layout lay;
  uint8_t* ws = nullptr;
  bool vec = false;  // the score rows are 16-byte aligned (float4 loads)
};

// Exclusive prefix sum of one int per thread over the CTA; `total` gets the sum. All threads call.
__device__ __forceinline__ int block_excl_scan(int v, int& total, Smem& sm) {
  const int lane = static_cast<int>(threadIdx.x) & 31, wid = static_cast<int>(threadIdx.x) >> 5;
  int incl = v;
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const int n = __shfl_up_sync(kFullMask, incl, off);
    if (lane >= off) incl += n;
  }
  if (lane == 31) sm.warp_total[wid] = incl;
  __syncthreads();
  if (wid == 0) {
    int w = lane < kWarps ? sm.warp_total[lane] : 0;
#pragma unroll
    for (int off = 1; off < kWarps; off <<= 1) {
      const int n = __shfl_up_sync(kFullMask, w, off);
      if (lane >= off) w += n;
    }
    if (lane < kWarps) sm.warp_total[lane] = w;
  }
  __syncthreads();
  const int excl = incl - v + (wid > 0 ? sm.warp_total[wid - 1] : 0);
  total = sm.warp_total[kWarps - 1];
  __syncthreads();  // warp_total is reused by the next scan
  return excl;
}

// Histogram of digit (key >> shift) & (2^bits - 1) over the valid keys whose bits from
// prefix_shift up equal `prefix` (all valid keys when prefix_shift == 32). visit(f) calls f(key)
// for each of this thread's keys, the same number of times on every lane of a warp.
template <class Visit>
__device__ void hist_pass(const Visit& visit, int shift, int bits, int prefix_shift, uint32_t prefix, Smem& sm) {
  const uint32_t digit_mask = (1u << bits) - 1u;
  for (int i = threadIdx.x; i < (1 << bits); i += kThreads) sm.hist[i] = 0;
  __syncthreads();
  const unsigned lane = threadIdx.x & 31u;
  visit([&](uint32_t key) {
    const bool take = key != 0u && (prefix_shift >= 32 || (key >> prefix_shift) == prefix);
    const uint32_t active = __ballot_sync(kFullMask, take);
    if (take) {
      const uint32_t digit = (key >> shift) & digit_mask;
      const uint32_t peers = __match_any_sync(active, digit);  // ties cost one atomic per warp
      if (lane == static_cast<unsigned>(__ffs(peers) - 1)) atomicAdd(&sm.hist[digit], __popc(peers));
    }
  });
  __syncthreads();
}

// After a histogram of `bins` (a multiple of kThreads, <= 4096) bins: the digit holding the
// k_rem-th largest element (1-based) and the number of elements in higher digits.
// Precondition: the histogram's total >= k_rem >= 1.
__device__ void find_digit(int k_rem, int bins, int& digit, int& above, Smem& sm) {
  constexpr int kMaxPer = kHistBins / kThreads;
  const int per = bins / kThreads;  // thread i owns the descending bins bins-1-per*i ... bins-per*(i+1)
  const int top = bins - 1 - per * static_cast<int>(threadIdx.x);
  int h[kMaxPer];
  int sum = 0;
#pragma unroll
  for (int q = 0; q < kMaxPer; ++q) {
    h[q] = q < per ? sm.hist[top - q] : 0;
    sum += h[q];
  }
  int total;
  int acc = block_excl_scan(sum, total, sm);
  if (acc < k_rem && k_rem <= acc + sum) {
#pragma unroll
    for (int q = 0; q < kMaxPer; ++q) {
      if (q < per && acc + h[q] >= k_rem) {
        sm.found_bin = top - q;
        sm.found_above = acc;
        break;
      }
      acc += h[q];
    }
  }
  __syncthreads();
  digit = sm.found_bin;
  above = sm.found_above;
  __syncthreads();
}

// The key K* of the k-th largest valid key (k >= 1) and the number k_eq of elements equal to K*
// that belong to the top k; thr = 0, k_eq = 0 when at most k keys are valid (select all valid).
template <class Visit>
__device__ void radix_select(const Visit& visit, int k, uint32_t& thr, int& k_eq, Smem& sm) {
  int mine = 0;
  visit([&](uint32_t key) { mine += key != 0u ? 1 : 0; });
  int n_valid;
  block_excl_scan(mine, n_valid, sm);
  if (n_valid <= k) {
    thr = 0u;
    k_eq = 0;
    return;
  }
  int d1, d2, d3, above;
  hist_pass(visit, kShift1, kDigit1Bits, 32, 0u, sm);
  find_digit(k, 1 << kDigit1Bits, d1, above, sm);
  k -= above;
  hist_pass(visit, kShift2, kDigit2Bits, kShift1, static_cast<uint32_t>(d1), sm);
  find_digit(k, 1 << kDigit2Bits, d2, above, sm);
  k -= above;
  const uint32_t prefix = (static_cast<uint32_t>(d1) << kDigit2Bits) | static_cast<uint32_t>(d2);
  hist_pass(visit, 0, kDigit3Bits, kShift2, prefix, sm);
  find_digit(k, 1 << kDigit3Bits, d3, above, sm);
  k -= above;
  thr = (prefix << kDigit3Bits) | static_cast<uint32_t>(d3);
  k_eq = k;
}

// Ordered compaction of one round: thread i owns the N consecutive elements i*N .. i*N+N-1 of the
// round (rounds follow each other in element order). Selected: valid and (key > thr, or key == thr
// among the first k_eq ties in element order counted from the first round). Calls
// emit(selected_bits, first_output_offset) once per thread (bit e = element e). Updates eq_seen
// and out_count (CTA-uniform).
template <int N, class Emit>
__device__ void select_round(const uint32_t (&key)[N], uint32_t thr, int k_eq, int& eq_seen, int& out_count, Smem& sm,
                             const Emit& emit) {
  int n_eq = 0;
#pragma unroll
  for (int e = 0; e < N; ++e) n_eq += (key[e] != 0u && key[e] == thr) ? 1 : 0;
  int eq_total;
  int eq_before = eq_seen + block_excl_scan(n_eq, eq_total, sm);
  uint32_t sel = 0u;
  int n_sel = 0;
#pragma unroll
  for (int e = 0; e < N; ++e) {
    const bool valid = key[e] != 0u;
    const bool is_eq = valid && key[e] == thr;
    const bool take = valid && (key[e] > thr || (is_eq && eq_before < k_eq));
    eq_before += is_eq ? 1 : 0;
    sel |= static_cast<uint32_t>(take) << e;
    n_sel += take ? 1 : 0;
  }
  int sel_total;
  const int off = out_count + block_excl_scan(n_sel, sel_total, sm);  // ends with __syncthreads
  emit(sel, off);
  eq_seen += eq_total;
  out_count += sel_total;
}

// The arrival of one chunk CTA at its row's counter; true for the last of n_active (which resets
// the counter). Its list stores are made visible device-wide first; the last CTA fences again
// before it reads the other lists (with ld.global.cg, from L2).
__device__ bool arrive_last(uint32_t* counter, int64_t n_active, Smem& sm) {
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    const uint32_t prev = atomicAdd(counter, 1u);
    const bool last = static_cast<int64_t>(prev) + 1 == n_active;
    if (last) atomicExch(counter, 0u);  // every CTA of the row has arrived
    sm.is_last = last ? 1 : 0;
  }
  __syncthreads();
  const bool last = sm.is_last != 0;
  if (last) __threadfence();
  return last;
}

// Row list of the workspace.
struct RowList {
  uint32_t* keys;
  int32_t* idx;
};
__device__ __forceinline__ RowList row_list(const Args& a, int64_t t) {
  uint8_t* base = a.ws + kCounterBytes + t * a.lay.row_bytes();
  return {reinterpret_cast<uint32_t*>(base), reinterpret_cast<int32_t*>(base + a.lay.idx_offset())};
}
__device__ __forceinline__ uint32_t* row_counter(const Args& a, int64_t t) {
  return reinterpret_cast<uint32_t*>(a.ws) + t;
}

// The chunk's list: selected (key, index) in index order at [0, n_sel), key 0 up to the capacity.
template <int N>
__device__ void write_chunk_list(const uint32_t (&key)[N], int64_t first, uint32_t thr, int k_eq, uint32_t* keys_l,
                                 int32_t* idx_l, int64_t cap, Smem& sm) {
  int eq_seen = 0, n_sel = 0;
  select_round(key, thr, k_eq, eq_seen, n_sel, sm, [&](uint32_t sel, int off) {
#pragma unroll
    for (int e = 0; e < N; ++e)
      if ((sel >> e) & 1u) {
        keys_l[off] = key[e];
        idx_l[off] = static_cast<int32_t>(first + e);
        ++off;
      }
  });
  for (int64_t i = n_sel + static_cast<int64_t>(threadIdx.x); i < cap; i += kThreads) keys_l[i] = 0u;
}

// Merge of a row's chunk lists (m_pad entries, keys 0 = empty): the top k in list order.
// emit(selected_bits, offset, first_entry) per thread and round; returns the number selected.
template <class Emit>
__device__ int merge_lists(const RowList& list, int64_t m_pad, int k, Smem& sm, const Emit& emit) {
  const int64_t rounds = (m_pad + kMergeRound - 1) / kMergeRound;
  const uint32_t* keys = list.keys;
  auto load_round = [&](int64_t r, uint32_t (&dst)[kMergePer]) {
    const int64_t f0 = r * kMergeRound + int64_t{threadIdx.x} * kMergePer;
#pragma unroll
    for (int q = 0; q < kMergePer / 4; ++q) {
      const int64_t f = f0 + 4 * q;
      if (f + 4 <= m_pad) {
        const uint4 v = __ldcg(reinterpret_cast<const uint4*>(keys + f));
        dst[4 * q] = v.x;
        dst[4 * q + 1] = v.y;
        dst[4 * q + 2] = v.z;
        dst[4 * q + 3] = v.w;
      } else {
#pragma unroll
        for (int i = 0; i < 4; ++i) dst[4 * q + i] = f + i < m_pad ? __ldcg(keys + f + i) : 0u;
      }
    }
  };
  uint32_t kept[kMergePer] = {};  // the only round's keys, when there is one round (rows up to 64K)
  if (rounds == 1) load_round(0, kept);
  auto visit = [&](auto&& f) {
    if (rounds == 1) {
#pragma unroll
      for (int e = 0; e < kMergePer; ++e) f(kept[e]);
    } else {
      for (int64_t r = 0; r < rounds; ++r) {
        uint32_t tmp[kMergePer];
        load_round(r, tmp);
#pragma unroll
        for (int e = 0; e < kMergePer; ++e) f(tmp[e]);
      }
    }
  };
  uint32_t thr;
  int k_eq;
  radix_select(visit, k, thr, k_eq, sm);
  int eq_seen = 0, n_sel = 0;
  if (rounds == 1) {
    select_round(kept, thr, k_eq, eq_seen, n_sel, sm,
                 [&](uint32_t sel, int off) { emit(sel, off, int64_t{threadIdx.x} * kMergePer); });
  } else {
    for (int64_t r = 0; r < rounds; ++r) {
      uint32_t tmp[kMergePer];
      load_round(r, tmp);
      const int64_t f0 = r * kMergeRound + int64_t{threadIdx.x} * kMergePer;
      select_round(tmp, thr, k_eq, eq_seen, n_sel, sm, [&](uint32_t sel, int off) { emit(sel, off, f0); });
    }
  }
  return n_sel;
}

// ---- top-k ----------------------------------------------------------------------------------------
// This thread's 8 consecutive positions j0.. (key 0 past clen, for -inf / NaN, and where masked).
__device__ __forceinline__ void load_score_keys(const float* row, const uint8_t* mask, int mask_block, int64_t c,
                                                int64_t j0, bool vec, uint32_t (&key)[kTopkPer]) {
  float v[kTopkPer];
  if (vec && j0 + kTopkPer <= c) {
    const float4 a = *reinterpret_cast<const float4*>(row + j0);
    const float4 b = *reinterpret_cast<const float4*>(row + j0 + 4);
    v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
  } else {
#pragma unroll
    for (int e = 0; e < kTopkPer; ++e) v[e] = j0 + e < c ? row[j0 + e] : neg_inf();
  }
#pragma unroll
  for (int e = 0; e < kTopkPer; ++e) key[e] = (j0 + e < c && v[e] > neg_inf()) ? value_key(v[e]) : 0u;
  if (mask != nullptr && j0 < c) {
    int64_t m = j0 / mask_block;
    int r = static_cast<int>(j0 - m * mask_block);
#pragma unroll
    for (int e = 0; e < kTopkPer; ++e) {
      if (j0 + e < c && mask[m] == 0) key[e] = 0u;
      if (++r == mask_block) {
        r = 0;
        ++m;
      }
    }
  }
}

// Writes the slots of the selected positions (gathered first, then stored) from `off` on.
template <int N, class PosOf>
__device__ __forceinline__ void store_slots(int32_t* out, int64_t out_stride, const int32_t* table, uint32_t sel,
                                            int off, const PosOf& pos_of) {
  int64_t pos[N] = {};
#pragma unroll
  for (int e = 0; e < N; ++e)
    if ((sel >> e) & 1u) pos[e] = pos_of(e);
  int32_t slot[N] = {};
#pragma unroll
  for (int e = 0; e < N; ++e)
    if ((sel >> e) & 1u) slot[e] = table[pos[e]];
#pragma unroll
  for (int e = 0; e < N; ++e)
    if ((sel >> e) & 1u) {
      if (off < out_stride) out[off] = slot[e];
      ++off;
    }
}

__global__ void __launch_bounds__(kThreads, 2) indexer_topk_v2_kernel(const __grid_constant__ IndexerTopkParams p,
                                                                        const Args a) {
  __shared__ Smem sm;
  const int64_t t = blockIdx.y, chunk = blockIdx.x;
  const int32_t req = p.req[t];
  bool err;
  const int64_t c = clamp_row(req, p.clen[t], p, err);
  if (err && chunk == 0 && threadIdx.x == 0) dev::count_error(p.err_count);
  const int k = static_cast<int>(min(static_cast<int64_t>(p.topk), c));
  const int64_t n_active = k == 0 ? 1 : (c + kTopkChunk - 1) / kTopkChunk;
  if (chunk >= n_active) {  // CTA-uniform: past the row's positions
    dev::pdl_launch_dependents();
    return;
  }

  dev::pdl_wait();  // scores (and the mask) come from predecessors

  const int64_t j0 = chunk * kTopkChunk + int64_t{threadIdx.x} * kTopkPer;
  uint32_t key[kTopkPer];
#pragma unroll
  for (int e = 0; e < kTopkPer; ++e) key[e] = 0u;
  if (k > 0)
    load_score_keys(p.scores + t * p.score_stride,
                    p.candidate_mask != nullptr ? p.candidate_mask + t * p.mask_stride : nullptr, p.mask_block, c, j0,
                    a.vec, key);
  uint32_t thr = kKeyNone;
  int k_eq = 0;
  const auto visit_keys = [&](auto&& f) {
#pragma unroll
    for (int e = 0; e < kTopkPer; ++e) f(key[e]);
  };
  if (k > 0) radix_select(visit_keys, k, thr, k_eq, sm);

  int32_t* out = p.out + t * p.out_stride;
  const int32_t* table = p.comp_slot_table + (req >= 0 ? static_cast<int64_t>(req) * p.comp_table_stride : 0);
  int n_sel = 0;
  if (n_active == 1) {  // the chunk's top k is the row's
    int eq_seen = 0;
    select_round(key, thr, k_eq, eq_seen, n_sel, sm, [&](uint32_t sel, int off) {
      store_slots<kTopkPer>(out, p.out_stride, table, sel, off, [&](int e) { return j0 + e; });
    });
  } else {
    const RowList list = row_list(a, t);
    write_chunk_list(key, j0, thr, k_eq, list.keys + chunk * a.lay.cap, list.idx + chunk * a.lay.cap, a.lay.cap, sm);
    if (!arrive_last(row_counter(a, t), n_active, sm)) {
      dev::pdl_launch_dependents();
      return;
    }
    n_sel = merge_lists(list, n_active * a.lay.cap, k, sm, [&](uint32_t sel, int off, int64_t f0) {
      store_slots<kMergePer>(out, p.out_stride, table, sel, off,
                             [&](int e) { return static_cast<int64_t>(__ldcg(list.idx + f0 + e)); });
    });
  }
  for (int64_t i = n_sel + static_cast<int64_t>(threadIdx.x); i < p.out_stride; i += kThreads) out[i] = -1;

  dev::pdl_launch_dependents();  // after this thread's last store
}

// ---- candidate mask -------------------------------------------------------------------------------
using select_keys::block_key;  // indexer_select_common.cuh

__device__ __forceinline__ void zero_bytes(uint8_t* dst, int64_t n) {
  for (int64_t i = threadIdx.x; i < n; i += kThreads) dst[i] = 0;
}

__global__ void __launch_bounds__(kThreads, 2) candidate_mask_v2_kernel(const __grid_constant__ CandidateMaskParams p,
                                                                          const Args a) {
  __shared__ Smem sm;
  const int64_t t = blockIdx.y, chunk = blockIdx.x;
  int64_t c = p.clen[t];
  if (c < 0 || c > p.score_stride) {
    if (chunk == 0 && threadIdx.x == 0) dev::count_error(p.err_count);
    c = c < 0 ? 0 : p.score_stride;
  }
  const int64_t n_blocks = (c + p.block - 1) / p.block;
  const int k = static_cast<int>(min(static_cast<int64_t>(p.topk_blocks), n_blocks));
  const int64_t n_active = k == 0 ? 1 : (n_blocks + kMaskChunk - 1) / kMaskChunk;
  if (chunk >= n_active) {
    dev::pdl_launch_dependents();
    return;
  }

  dev::pdl_wait();

  const float* row = p.scores + t * p.score_stride;
  uint8_t* mask = p.mask + t * p.mask_stride;
  const int64_t b0 = chunk * kMaskChunk + int64_t{threadIdx.x} * kMaskPer;
  const bool vec8 = a.vec && p.block == 8;
  uint32_t key[kMaskPer];
#pragma unroll
  for (int e = 0; e < kMaskPer; ++e)
    key[e] = (k > 0 && b0 + e < n_blocks) ? block_key(row, c, p.block, b0 + e, n_blocks - 1, vec8) : 0u;
  uint32_t thr = kKeyNone;
  int k_eq = 0;
  const auto visit_keys = [&](auto&& f) {
#pragma unroll
    for (int e = 0; e < kMaskPer; ++e) f(key[e]);
  };
  if (k > 0) radix_select(visit_keys, k, thr, k_eq, sm);

  if (n_active == 1) {  // the chunk's top k is the row's: the whole mask row from this CTA
    zero_bytes(mask, p.mask_stride);
    __syncthreads();  // the zeros are ordered before the ones below (same CTA)
    int eq_seen = 0, n_sel = 0;
    select_round(key, thr, k_eq, eq_seen, n_sel, sm, [&](uint32_t sel, int) {
#pragma unroll
      for (int e = 0; e < kMaskPer; ++e)
        if ((sel >> e) & 1u) mask[b0 + e] = 1;
    });
  } else {
    const RowList list = row_list(a, t);
    write_chunk_list(key, b0, thr, k_eq, list.keys + chunk * a.lay.cap, list.idx + chunk * a.lay.cap, a.lay.cap, sm);
    if (!arrive_last(row_counter(a, t), n_active, sm)) {
      dev::pdl_launch_dependents();
      return;
    }
    zero_bytes(mask, p.mask_stride);
    __syncthreads();
    merge_lists(list, n_active * a.lay.cap, k, sm, [&](uint32_t sel, int, int64_t f0) {
      int32_t blk[kMergePer] = {};
#pragma unroll
      for (int e = 0; e < kMergePer; ++e)
        if ((sel >> e) & 1u) blk[e] = __ldcg(list.idx + f0 + e);
#pragma unroll
      for (int e = 0; e < kMergePer; ++e)
        if ((sel >> e) & 1u) mask[blk[e]] = 1;
    });
  }

  dev::pdl_launch_dependents();
}

}  // namespace v2

// ---- apply candidate mask ---------------------------------------------------------------------
// Grid (ceil(score_stride / 1024), T), block 256: each thread 4 positions of one row.
constexpr int kApplyThreads = 256;
constexpr int kApplyPerCta = 4 * kApplyThreads;

__global__ void __launch_bounds__(kApplyThreads)
    apply_candidate_mask_kernel(const __grid_constant__ ApplyCandidateMaskParams p) {
  const int64_t t = blockIdx.y;
  int64_t c = p.clen[t];
  if (c < 0 || c > p.score_stride) {
    if (blockIdx.x == 0 && threadIdx.x == 0) dev::count_error(p.err_count);
    c = c < 0 ? 0 : p.score_stride;
  }
  dev::pdl_wait();
  float* row = p.scores + t * p.score_stride;
  const uint8_t* mask = p.mask + t * p.mask_stride;
  const int64_t base = static_cast<int64_t>(blockIdx.x) * kApplyPerCta + threadIdx.x;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int64_t j = base + i * kApplyThreads;
    if (j < c && mask[j / p.block] == 0) row[j] = neg_inf();
  }
  dev::pdl_launch_dependents();
}

void require(bool ok, const char* who, const std::string& what) {
  if (!ok) throw std::invalid_argument(std::string(who) + ": " + what);
}
bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

}  // namespace

size_t indexer_topk_workspace_bytes(int64_t T, int64_t score_stride, int topk) {
  require(T >= 0 && score_stride >= 0 && topk >= 0, "indexer_topk_workspace_bytes", "negative argument");
  if (T > kSelectMaxRows) return 0;
  return static_cast<size_t>(v2::make_layout(score_stride, v2::kTopkChunk, topk).total(T));
}

size_t candidate_mask_workspace_bytes(int64_t T, int64_t score_stride, int block, int topk_blocks) {
  require(T >= 0 && score_stride >= 0 && topk_blocks >= 0 && block > 0, "candidate_mask_workspace_bytes",
          "negative argument or block <= 0");
  if (T > kSelectMaxRows) return 0;
  return static_cast<size_t>(v2::make_layout((score_stride + block - 1) / block, v2::kMaskChunk, topk_blocks).total(T));
}

void run_indexer_topk(const IndexerTopkParams& p, cudaStream_t stream, bool pdl) {
  const char* who = "run_indexer_topk";
  if (p.version == 3) return run_indexer_topk_v3(p, stream, pdl);  // src/kernels/indexer_select_v3.cu
  require(p.version == 0, who, "version must be 0 (v2 with a workspace, else v1) or 3");
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
  if (p.T == 0) return;
  require(p.T <= 0x7fffffff, who, "T too large for one grid dimension");
  require(p.scores != nullptr && p.clen != nullptr && p.req != nullptr && p.out != nullptr, who, "null pointer");
  require(p.comp_slot_table != nullptr || p.comp_table_rows == 0, who, "null slot table");

  LaunchConfig cfg;
  cfg.stream = stream;
  cfg.pdl = pdl;
  if (p.workspace != nullptr && p.T <= kSelectMaxRows) {
    const v2::Layout lay = v2::make_layout(p.score_stride, v2::kTopkChunk, p.topk);
    require(p.workspace_bytes >= static_cast<size_t>(lay.total(p.T)), who,
            "workspace_bytes " + std::to_string(p.workspace_bytes) + " < indexer_topk_workspace_bytes = " +
                std::to_string(lay.total(p.T)));
    require(aligned16(p.workspace), who, "workspace must be 16-byte aligned");
    v2::Args a;
    a.lay = lay;
    a.ws = static_cast<uint8_t*>(p.workspace);
    a.vec = aligned16(p.scores) && p.score_stride % 4 == 0;
    cfg.grid = dim3(static_cast<unsigned>(lay.n_chunks), static_cast<unsigned>(p.T), 1);
    cfg.block = dim3(v2::kThreads, 1, 1);
    launch_kernel("indexer_topk_v2", v2::indexer_topk_v2_kernel, cfg, p, a);
    return;
  }
  cfg.grid = dim3(static_cast<unsigned>(p.T), 1, 1);
  cfg.block = dim3(kThreads, 1, 1);
  cfg.smem_bytes = kSelectSmemBytes;
  launch_kernel("indexer_topk", indexer_topk_kernel, cfg, p);
}

void run_candidate_mask(const CandidateMaskParams& p, cudaStream_t stream, bool pdl) {
  const char* who = "run_candidate_mask";
  if (p.version == 3) return run_candidate_mask_v3(p, stream, pdl);  // src/kernels/indexer_select_v3.cu
  require(p.version == 0, who, "version must be 0 (v2 with a workspace, else v1) or 3");
  require(p.T >= 0, who, "negative T");
  require(p.block > 0, who, "block must be > 0");
  require(p.topk_blocks >= 0, who, "topk_blocks must be >= 0");
  require(p.score_stride > 0 && p.score_stride < (int64_t{1} << 31), who, "score_stride must be in [1, 2^31)");
  require(p.mask_stride >= (p.score_stride + p.block - 1) / p.block && p.mask_stride < (int64_t{1} << 31), who,
          "mask_stride must be >= ceil(score_stride / block) (and < 2^31)");
  if (p.T == 0) return;
  require(p.T <= 0x7fffffff, who, "T too large for one grid dimension");
  require(p.scores != nullptr && p.clen != nullptr && p.mask != nullptr, who, "null pointer");

  LaunchConfig cfg;
  cfg.stream = stream;
  cfg.pdl = pdl;
  if (p.workspace != nullptr && p.T <= kSelectMaxRows) {
    const v2::Layout lay = v2::make_layout((p.score_stride + p.block - 1) / p.block, v2::kMaskChunk, p.topk_blocks);
    require(p.workspace_bytes >= static_cast<size_t>(lay.total(p.T)), who,
            "workspace_bytes " + std::to_string(p.workspace_bytes) + " < candidate_mask_workspace_bytes = " +
                std::to_string(lay.total(p.T)));
    require(aligned16(p.workspace), who, "workspace must be 16-byte aligned");
    v2::Args a;
    a.lay = lay;
    a.ws = static_cast<uint8_t*>(p.workspace);
    a.vec = aligned16(p.scores) && p.score_stride % 4 == 0;
    cfg.grid = dim3(static_cast<unsigned>(lay.n_chunks), static_cast<unsigned>(p.T), 1);
    cfg.block = dim3(v2::kThreads, 1, 1);
    launch_kernel("candidate_mask_v2", v2::candidate_mask_v2_kernel, cfg, p, a);
    return;
  }
  cfg.grid = dim3(static_cast<unsigned>(p.T), 1, 1);
  cfg.block = dim3(kThreads, 1, 1);
  cfg.smem_bytes = kSelectSmemBytes;
  launch_kernel("candidate_mask", candidate_mask_kernel, cfg, p);
}

void run_apply_candidate_mask(const ApplyCandidateMaskParams& p, cudaStream_t stream, bool pdl) {
  const char* who = "run_apply_candidate_mask";
  require(p.T >= 0, who, "negative T");
  require(p.block > 0, who, "block must be > 0");
  require(p.score_stride > 0, who, "score_stride must be > 0");
  require(p.mask_stride >= (p.score_stride + p.block - 1) / p.block, who,
          "mask_stride must be >= ceil(score_stride / block)");
  if (p.T == 0) return;
  require(p.T <= 65535, who, "T must be <= 65535 (grid y)");
  require(p.scores != nullptr && p.clen != nullptr && p.mask != nullptr, who, "null pointer");
  const int64_t tiles = (p.score_stride + kApplyPerCta - 1) / kApplyPerCta;
  require(tiles <= 0x7fffffff, who, "score_stride too large");

  LaunchConfig cfg;
  cfg.grid = dim3(static_cast<unsigned>(tiles), static_cast<unsigned>(p.T), 1);
  cfg.block = dim3(kApplyThreads, 1, 1);
  cfg.stream = stream;
  cfg.pdl = pdl;
  launch_kernel("apply_candidate_mask", apply_candidate_mask_kernel, cfg, p);
}

}  // namespace v4attn::kernels
