// Indexer scores (spec 3.4): for row t and compressed position j < clen[t],
//   score[t, j] = sum over heads h = 0..31, in order, of relu(dot(t, h, j)) * w[t, h],
//   dot = ((b0 + b1) + b2) + b3,  b_i = exact block sum of 32 products of dequantized e2m1 values,
// with the K vector read from the paged index-K cache at slot comp_slot_table[req[t]][j]; -inf for
// j in [clen, score_stride). Twin of ref::indexer_scores, bit for bit.
//
// Exactness. Twice an e2m1 value is an integer in [-12, 12], so each product of two codes times 4
// is an integer and a 32-term block sum times 4 (|.| <= 32 * 144 = 4608) is an exact int32: the
// int8 tensor-core MMA (mma.sync m16n8k32 s8.s8.s32) computes it exactly, in any internal order
// (the per-block path sums one block over the 4 k-steps, see below). The block sum is then
// isum * 2^(eq + ek - 2): converted exactly (magic-number conversion: the accumulator starts at
// the bits of 1.5 * 2^23, so the result's bits are the float 1.5 * 2^23 + isum, and subtracting
// 1.5 * 2^23 is exact) and scaled by the power of two sq * (sk * 1/4), which is exact whenever the
// block sum is a normal fp32 number, as is the reference's ldexp. Everything after that rounds, in exactly the reference's order.
//
// Grid: (ceil(T / group_rows), position tiles). One CTA = 4 warps = a group of consecutive rows
// and a tile of 128 * n positions (n = steps per warp, 1..64); warp w takes the 32 positions
// [tile + (k*4 + w) * 32, +32) at step k (the masked kernel: the tile's kept blocks, compacted).
// The group's rows are processed as runs of equal req: the rows of a run (the verify rows of one
// request) share the K of the tile, read once, and the A fragments decoded from it; each row then
// runs its own MMAs (its q = the B operand) and epilogue.
//
// Per CTA: the group's q (2 KB of codes per row) is decoded once into shared memory as the MMA's
// B operand (n = head, 4 n-tiles of 8 heads, 4 k-steps of 32); head and k are permuted so that
// lane (g, tq) accumulates heads 8tq..8tq+7 and, in k-step s, its k-slots hold elements
// 32tq + 8s .. + 7 (word s of block tq), for A and B alike: over the 4 k-steps a lane holds
// exactly block tq, so its A words for a position are one 16-byte chunk (one LDS.128) decoded
// with one block shift (session 6: the per-block mapping, one word per block and a shift per
// block, made the A decode ~45 % of the kernel's instructions at decode shapes). Per warp and
// run: the slot-table entries of the first S steps are loaded at once, then their K (64 B codes +
// 4 B scales per position, each lane its own position's, cp.async) into a ring of S buffers, one
// commit group per step; after each step its buffer takes the K of step k + S, whose slot was
// loaded a step ahead, so a warp waits for one table and one K latency per run and the later
// loads overlap the compute (a dependent table load per step cost ~1 us per 32 positions in an
// earlier form). Per step: the A operand (m = position,
// two m-tiles of 16) is decoded from shared memory once (e2m1 nibbles -> int8 with two PRMTs);
// per row, each lane forms relu(dot) * w for its (position, head) pairs and writes the 8 head
// terms of a position to a shared buffer; lane l finally adds the 32 terms of position l in head
// order and stores the score (one coalesced 128-byte store).
//
// Two exact ways to form dot, chosen per (m-tile, row, n-tile):
//  - per-block path (any scales): block b's sum = the 4 k-steps' MMAs with the A of the lanes
//    tq != b zeroed, into a fresh accumulator (16 MMAs per n-tile), each block sum scaled by its
//    own power of two, ((b0 + b1) + b2) + b3 in fp32 exactly like the reference.
//    ~16 fp32 ops per (position, head).
//  - fused path, when the 8 q heads of the n-tile and all usable K slots of the m-tile have their
//    4 block scale exponents within 3 of their minimum (and within [-60, 50]), and sq_min * w of
//    each of the 8 heads is exact: the int8 operands carry the 2^(e_b - e_min) factors (shifted
//    PRMT tables, |values| <= 96), the four k-steps chain into one accumulator, one FMA gives
//    I * sk_min / 4 exactly and one product with sq_min * w rounds like the reference (see the
//    proof at the path). 3 fp32 ops per (position, head).
//  Vectors whose block amaxes are within ~8x of each other take the fused path (whether real q
//  heads do, RoPE half vs nope half, is to be measured); the per-block path keeps every input
//  exact. When all 32 heads of a row and the whole m-tile are fused, the m-tile's 16 MMAs run as
//  four independent chains (one per n-tile) issued block by block, so the tensor core's latency
//  is paid per block, not per MMA (-33 % for 32 decode rows at 64K; docs/perf.md session 4).
//
// Bytes per position read (once per run): 68 (index K) + 4 (slot table); per row and stride slot:
// 4 (score write).
//
// PDL: req and clen (step metadata) are read before dev::pdl_wait(); q, weights, the slot table
// and the index-K cache after it (q/w come from the q-pack kernel, K from the index-K store).
// The trigger follows the CTA's last store.
#include "v4attn/kernels/indexer_kernels.h"

#include <algorithm>
#include <initializer_list>
#include <stdexcept>
#include <string>

#include "kernels/device_common.cuh"
#include "runtime/launch.h"
#include "runtime/phase_stamps.cuh"

namespace v4attn::kernels {

V4ATTN_STAMP_UNIT();

namespace {

constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
constexpr int kStepPositions = 32;  // positions per warp step
constexpr int kMaxGroupRows = 8;    // rows per CTA (their B fragments live in shared memory)
constexpr int kTransStride = 36;    // floats per position row of the term buffer (conflict-free)
constexpr int kBlocks = kIndexerHeadDim / num::kIndexerQuantBlock;  // 4
constexpr int kMaxSteps = 64;  // steps per warp per CTA (the tile: 128 * steps positions)
constexpr uint32_t kFullMask = 0xffffffffu;
constexpr int kMagicBits = 0x4B400000;   // 1.5 * 2^23
constexpr float kMagicFloat = 12582912.0f;

// ---- device helpers ---------------------------------------------------------------------------
__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
}

// Four e2m1 codes (nibbles of sel[15:0], nibble i -> byte i) -> four int8 = twice their value.
// prmt's generic mode copies source byte (nibble & 7) when the nibble's bit 3 is clear and
// replicates that byte's sign bit (0 for our table, all values < 128) when it is set. So `pos`
// holds the magnitude of the positive codes (0 for negative ones) and `neg`, with bit 3 flipped,
// the magnitude of the negative codes (0 for positive ones): each byte is 0 in one of them. Per
// byte, 128 - neg never borrows (neg <= 96) and xor 0x80 turns it into -neg mod 256 (0 for
// neg == 0), which OR pos merges: two ops (IADD3, LOP3) after the PRMTs where
// ((pos | 0x80) - neg) ^ 0x80 takes three (measured neutral in time; docs/perf.md session 15).
// With the table shifted left by s (s <= 3: every byte stays < 128, no carry between bytes) the
// same two PRMTs give twice the value times 2^s (|.| <= 96, still int8 and still borrow-free).
constexpr uint32_t kTwiceLo = 0x03020100u;  // codes 0..3 -> 0, 1, 2, 3   (twice 0, .5, 1, 1.5)
constexpr uint32_t kTwiceHi = 0x0C080604u;  // codes 4..7 -> 4, 6, 8, 12  (twice 2, 3, 4, 6)
__device__ __forceinline__ uint32_t e2m1x4_to_s8(uint32_t sel, uint32_t lo, uint32_t hi) {
  const uint32_t pos = prmt(lo, hi, sel);
  const uint32_t neg = prmt(lo, hi, sel ^ 0x8888u);
  return ((0x80808080u - neg) ^ 0x80808080u) | pos;
}

// D = A * B + C, int8 x int8 -> int32, m16n8k32 (exact; no saturation needed: |D| < 2^31).
__device__ __forceinline__ void mma_s8_m16n8k32(int (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2], int c) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%10, %10, %10, %10};\n"
      : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "r"(c));
}
// D += A * B.
__device__ __forceinline__ void mma_s8_m16n8k32_acc(int (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// The fused path (below) needs the 4 block scale bytes of a vector within a span of 3 (so the
// int8 operands can absorb 2^(e_b - e_min)) and in a range where every partial sum is an exact
// fp32 number: exponents in [-60, 50] (byte - 127).
constexpr int kFusedSpan = 3;
constexpr uint32_t kFusedMinByte = 127 - 60, kFusedMaxByte = 127 + 50;
__device__ __forceinline__ uint32_t byte_of(uint32_t w, int b) { return (w >> (8 * b)) & 0xffu; }
__device__ __forceinline__ uint32_t min_byte(uint32_t w) {
  return min(min(byte_of(w, 0), byte_of(w, 1)), min(byte_of(w, 2), byte_of(w, 3)));
}
__device__ __forceinline__ bool fused_ok(uint32_t w) {
  const uint32_t lo = min_byte(w);
  const uint32_t hi = max(max(byte_of(w, 0), byte_of(w, 1)), max(byte_of(w, 2), byte_of(w, 3)));
  return hi - lo <= kFusedSpan && lo >= kFusedMinByte && hi <= kFusedMaxByte;
}

// Swizzle of the four 16-byte chunks of a position's codes in shared memory: a quarter-warp's
// chunk copies (8 positions, one chunk each) and its A reads (2 positions, 4 chunks) both hit 32
// distinct banks.
__device__ __forceinline__ int chunk_swizzle(int p) { return (p >> 1) & 3; }

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}


// sq_min * w is exact (so the fused path may fold the q scale into the head weight): w is +-0,
// or w is normal and the product with the power of two 2^(hmin - 127) is normal too.
__device__ __forceinline__ bool qw_exact(uint32_t hmin_byte, float w) {
  const uint32_t wb = num::f32_bits(w);
  if ((wb & 0x7fffffffu) == 0u) return true;
  const int ew = static_cast<int>((wb >> 23) & 0xffu);
  if (ew == 0 || ew == 255) return false;
  const int e = ew + static_cast<int>(hmin_byte) - 127;
  return e >= 1 && e <= 254;
}

// Per group row, in shared memory.
struct RowConst {
  float qw[kIndexerHeads];           // fused path: sq_min(h) * w(h) (exact where head_ok)
  float wt[kIndexerHeads];           // w(h)
  float sq[kIndexerHeads][kBlocks];  // per-block path: the q scale of (h, b) for h's B fragments
};
struct RowMeta {
  int32_t req;
  int32_t c;          // visible positions, contained
  uint32_t head_ok;   // bit h: h's B fragments carry its block shifts and qw[h] is exact
  int32_t unused;
};

// Dynamic shared memory of a CTA with S K buffers per warp and G group rows (offsets, 16-aligned).
struct SmemLayout {
  size_t kscale = 0, terms = 0, qfrag = 0, rc = 0, meta = 0, list = 0, total = 0;
};
// list_entries: masked kernel, the per-warp block list (entries per warp; 0 = none).
__host__ __device__ __forceinline__ SmemLayout smem_layout(int S, int G, int RS = 1, int list_entries = 0) {
  SmemLayout L;
  const size_t warps = static_cast<size_t>(kWarps) * RS;
  L.kscale = warps * S * kStepPositions * 16 * 4;  // K codes: [warp][buffer][pos][16 words]
  L.terms = L.kscale + warps * S * kStepPositions * 4;  // K scales: [warp][buffer][pos]
  L.qfrag = L.terms + warps * kStepPositions * kTransStride * 4;  // [warp][pos][36]
  L.rc = L.qfrag + static_cast<size_t>(G) * 4 * 32 * 32;  // B fragments: [row][n-tile][lane] 32 B
  L.meta = L.rc + static_cast<size_t>(G) * sizeof(RowConst);
  L.list = L.meta + static_cast<size_t>(kMaxGroupRows) * sizeof(RowMeta);
  L.total = L.list + warps * static_cast<size_t>(list_entries) * 4;
  return L;
}

// The index-K pool's page geometry, computed on the host: the per-step address math uses it
// directly (CacheLayout::page_bytes() in the loop compiled to a 64-bit division per step, ~35
// instructions of a step's ~780 at decode shapes: 32 rows x 64K 111.7 -> 104.6 us, 8 rows 34.9 ->
// 32.4). The one-step kernels (ring of 1: one issue per run) keep the inline page_bytes(): with
// the host value the 6-row verify tile measured 1 us slower (20.1 -> 21.2 us, code layout of a
// one-shot kernel rather than arithmetic; docs/perf.md session 15).
struct PageGeom {
  int64_t page_bytes;  // layout.page_bytes()
  int64_t scale_base;  // page_size * 64: the scales' offset in a page
  int32_t shift;       // log2(page_size)
  int32_t unused;
};

// Context of one run of equal-req rows [r0, r1) of the CTA's group over the CTA's tile, streamed
// by each warp through a ring of S K buffers (one cp.async commit group per step).
struct RunCtx {
  int r0, r1;
  int64_t cmax;         // the run's largest visible length
  uint32_t valid_bits;  // bit b: this lane's position of the step in ring buffer b has a usable slot
  int nsel;             // masked: blocks of the tile some row of the run keeps (the warp's list)
  int64_t tile_end;     // unmasked: end of the CTA's positions (<= score_stride)
  int64_t table_row;    // slot-table row of the run's request
  int32_t next_slot;    // this lane's slot for the next step to issue (loaded one step ahead)
};

// Step k of this warp. Unmasked: the 32 positions tile_base + (4k + w) * 32 + lane. Masked
// (candidate mask): the warp's list (shared memory) holds the tile's kept blocks in position
// order, entry = block index in the tile | (bit r: row r of the group keeps it and sees part of
// it) << 8; step k of warp w takes entries 4 * (4k + w) .. + 3, lane l the position
// 8 * block + l % 8 of entry l / 8.
struct StepPos {
  bool live;      // warp-uniform: the step exists (unmasked: inside the tile; masked: has entries)
  bool has;       // this lane writes position j (masked: its entry exists)
  int64_t j;      // this lane's position
  uint32_t rows;  // masked: this lane's entry's row bits (0 when !has)
};
template <bool kMasked>
__device__ __forceinline__ StepPos step_pos(const RunCtx& run, const uint32_t* list, int64_t tile_base, int k) {
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int w = (static_cast<int>(threadIdx.x) / 32) % kWarps;  // row split: warps w and w + 4 share positions
  StepPos sp;
  if constexpr (kMasked) {
    const int rank0 = 4 * (4 * k + w);
    const int rk = rank0 + lane / 8;
    sp.live = rank0 < run.nsel;
    sp.has = rk < run.nsel;
    const uint32_t e = sp.has ? list[rk] : 0u;
    sp.j = tile_base + 8 * static_cast<int64_t>(e & 0xffu) + lane % 8;
    sp.rows = e >> 8;
  } else {
    const int64_t p0 = tile_base + (static_cast<int64_t>(k) * kWarps + w) * kStepPositions;
    sp.live = p0 < run.tile_end;
    sp.has = true;
    sp.j = p0 + lane;
    sp.rows = 0u;
  }
  return sp;
}

// This lane's slot of step k (-1: no position to read).
template <bool kMasked>
__device__ __forceinline__ int32_t load_slot(const IndexerScoresParams& p, const RunCtx& run, const uint32_t* list,
                                             int64_t tile_base, int k) {
  const StepPos sp = step_pos<kMasked>(run, list, tile_base, k);
  const bool use = sp.live && sp.has && sp.j < run.cmax;
  // One predicated load whose destination is the value itself: written as `use ? table[..] : -1`,
  // ptxas loaded into a scratch register and copied it into the loop-carried `next_slot` right
  // away, so the copy waited for the load's full latency every step (Nsight Compute, decode 32 rows
  // x 64K: that move was 13 % of the kernel's stall samples, docs/perf.md session 31). Here the
  // -1 and the load share one register, and the value is first read a step later.
  int32_t slot;
  asm volatile(
      "{\n .reg .pred q;\n setp.ne.u32 q, %2, 0;\n mov.b32 %0, -1;\n @q ld.global.b32 %0, [%1];\n}\n"
      : "=r"(slot)
      : "l"(p.comp_slot_table + (use ? run.table_row + sp.j : 0)), "r"(static_cast<uint32_t>(use)));
  return slot;
}

// K of step k (its slots loaded: `slot`) into ring buffer `buf` with cp.async, then one commit
// group (empty when the step has nothing to read). Sets the buffer's valid bit.
template <bool kMasked, bool kInlinePageBytes>
__device__ __forceinline__ void issue_step(const IndexerScoresParams& p, const PageGeom& pg, RunCtx& run,
                                           const uint32_t* list, int64_t tile_base, int k, int32_t slot, int buf,
                                           uint32_t* kd_warp, uint32_t* ks_warp) {
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const StepPos sp = step_pos<kMasked>(run, list, tile_base, k);
  const bool in_c = sp.live && sp.has && sp.j < run.cmax;
  const bool ok = in_c && slot >= 0 && slot < p.n_slots;
  // reference refuses it; here: score -inf. Counted by row set 0 only (row split: the other
  // set's warp reads the same positions).
  if (in_c && !ok && static_cast<int>(threadIdx.x) < kThreads) dev::count_error(p.err_count);
  run.valid_bits = (run.valid_bits & ~(1u << buf)) | (static_cast<uint32_t>(ok) << buf);
  if (__any_sync(kFullMask, in_c)) {  // warp-uniform
    const int64_t page_bytes = kInlinePageBytes ? p.layout.page_bytes() : pg.page_bytes;
    const int32_t page_mask = (int32_t{1} << pg.shift) - 1;
    const int64_t scale_base = pg.scale_base;
    // Each lane copies its own position's 64 code bytes (4 chunks, swizzled: conflict-free both for
    // these writes and for the A reads) and its 4 scale bytes; zero-filled when unusable.
    const int32_t use = ok ? slot : 0;
    const uint8_t* page = p.index_k_cache + static_cast<int64_t>(use >> pg.shift) * page_bytes;
    const int32_t in_page = use & page_mask;
    const uint8_t* codes = page + in_page * kIndexerCodeBytes;
    uint32_t* kd = kd_warp + buf * (kStepPositions * 16) + lane * 16;
    const int n = ok ? 16 : 0;
    // The index-K cache is read once per cycle: dev::l2_policy_stream.
    const uint64_t stream = dev::l2_policy_stream();
#pragma unroll
    for (int ch = 0; ch < 4; ++ch) dev::cp_async16_stream(smem_addr(&kd[(ch ^ chunk_swizzle(lane)) * 4]), codes + 16 * ch, stream, n);
    dev::cp_async4_stream(smem_addr(&ks_warp[buf * kStepPositions + lane]), page + scale_base + in_page * kIndexerScaleBytes,
                          stream, ok ? 4 : 0);
  }
  cp_async_commit();
}

// Start of one run, by this warp: the slot-table entries of its first S steps (issued together),
// their K (one commit group each), and the slot of step S (used when step 0 is done); a warp then
// waits for one table latency and one K latency per run, and the later steps' loads overlap the
// computing of the earlier ones.
template <int S, bool kMasked>
__device__ RunCtx issue_run(const IndexerScoresParams& p, const PageGeom& pg, int r0, int r1, int64_t tile_base,
                            int64_t tile_end, const RowMeta* meta, uint32_t* kd_warp, uint32_t* ks_warp,
                            const uint32_t* list, int nsel) {
  RunCtx run{r0, r1, 0, 0u, nsel, tile_end, 0, -1};
  const int32_t req = meta[r0].req;
  for (int r = r0; r < r1; ++r) run.cmax = max(run.cmax, static_cast<int64_t>(meta[r].c));
  run.table_row = req >= 0 ? static_cast<int64_t>(req) * p.comp_table_stride : 0;
  int32_t slot[S];
#pragma unroll
  for (int k = 0; k < S; ++k) slot[k] = load_slot<kMasked>(p, run, list, tile_base, k);
#pragma unroll
  for (int k = 0; k < S; ++k) issue_step<kMasked, S == 1>(p, pg, run, list, tile_base, k, slot[k], k, kd_warp, ks_warp);
  run.next_slot = load_slot<kMasked>(p, run, list, tile_base, S);
  return run;
}

// Masked kernel: this warp's list of the tile's blocks (8 positions each) that some row r of the
// run [r0, r1) keeps (mask byte != 0) and sees part of (block * 8 < c_r), in position order, entry =
// block index in the tile | (bit r: row r keeps it) << 8. Blocks that no row of the run keeps get
// -inf in every row of the run here (positions < score_stride): with the list, every position of
// the tile is written once per row. Every warp builds the same list into its own copy (no CTA
// barrier); returns the entry count.
template <int TBLK>
__device__ int build_block_list(const IndexerScoresParams& p, int64_t row0, int r0, int r1, int64_t tile_base,
                                const RowMeta* meta, uint32_t* list) {
  static_assert(TBLK <= 256, "a list entry holds the block index in its low 8 bits");
  constexpr int kChunks = (TBLK + 31) / 32;
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int warp = (static_cast<int>(threadIdx.x) / 32) % kWarps;
  const int64_t blk0 = tile_base / 8;
  uint32_t bits[kChunks] = {};
  for (int r = r0; r < r1; ++r) {
    const int64_t c = meta[r].c;
    const uint8_t* mrow = p.candidate_mask + (row0 + r) * p.mask_stride;
#pragma unroll
    for (int k = 0; k < kChunks; ++k) {
      const int b = lane + 32 * k;
      const int64_t blk = blk0 + b;
      if (b < TBLK && blk * 8 < c && mrow[blk] != 0) bits[k] |= 1u << r;
    }
  }
  int n = 0;
  uint32_t keep[kChunks];
#pragma unroll
  for (int k = 0; k < kChunks; ++k) {
    keep[k] = __ballot_sync(kFullMask, bits[k] != 0u);
    if (bits[k] != 0u) list[n + __popc(keep[k] & ((1u << lane) - 1u))] = static_cast<uint32_t>(lane + 32 * k) | (bits[k] << 8);
    n += __popc(keep[k]);
  }
  __syncwarp();
  // -inf for the blocks no row keeps: warp w takes the 32-position chunks w, w + 4, ... (4 blocks each)
  for (int q = warp; q < TBLK / 4; q += kWarps) {
    const int b = 4 * q + lane / 8;
    uint32_t word = keep[0];
#pragma unroll
    for (int k = 1; k < kChunks; ++k)
      if (b >= 32 * k) word = keep[k];
    const int64_t j = tile_base + 8 * b + lane % 8;
    if (((word >> (b % 32)) & 1u) == 0u && j < p.score_stride)
      for (int r = r0; r < r1; ++r) p.scores[(row0 + r) * p.score_stride + j] = -__int_as_float(0x7f800000);
  }
  return n;
}

// The fused path's MMAs of m-tiles [mt0, mt0 + nmt) (constants once inlined into unrolled code):
// 4 * nmt independent chains (one per m-tile and n-tile) issued k-step by k-step, so that the
// tensor core's latency is paid per k-step rather than per MMA, each B fragment loaded once for
// all the m-tiles; 16 fragment registers live at a time. The accumulators start at the magic
// 1.5 * 2^23 (see the fused path's proof in compute_run).
__device__ __forceinline__ void fused_mma_chains(int (&acc)[2][4][4], const uint32_t (&A)[2][kBlocks][4], const uint4* qf,
                                                 int lane, int mt0, int nmt) {
#pragma unroll
  for (int half = 0; half < 2; ++half) {  // k-steps 0-1, then 2-3
    uint4 f[4];
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) f[nt] = qf[(nt * 32 + lane) * 2 + half];
#pragma unroll
    for (int bb = 0; bb < 2; ++bb) {
      const int b = 2 * half + bb;
#pragma unroll
      for (int mt = 0; mt < 2; ++mt) {
        if (mt < mt0 || mt >= mt0 + nmt) continue;
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) {
          const uint32_t B[2] = {bb == 0 ? f[nt].x : f[nt].z, bb == 0 ? f[nt].y : f[nt].w};
          if (b == 0) mma_s8_m16n8k32(acc[mt][nt], A[mt][0], B, kMagicBits);
          else mma_s8_m16n8k32_acc(acc[mt][nt], A[mt][b], B);
        }
      }
    }
  }
}

// Compute of one run, by this warp: per step, the A fragments once, then per row the MMAs and the
// epilogue; after each step its ring buffer takes the K of step k + S (slot loaded a step ahead),
// and the slot of step k + S + 1 is loaded. Leaves the warp's K buffers free (all copies waited).
// Masked (kMasked): the step's positions come from the warp's list (step_pos); a lane without an
// entry writes nothing, a row that keeps none of the step's blocks writes -inf and skips its MMAs,
// and an m-tile (two blocks) that the row does not keep skips its MMAs (its positions get -inf).
template <int S, int RS, bool kMasked = false>
__device__ void compute_run(const IndexerScoresParams& p, const PageGeom& pg, RunCtx& run, int64_t row0, int64_t tile_base,
                            const RowMeta* meta, const uint4* qfrag, const RowConst* rc, uint32_t* kd_warp,
                            uint32_t* ks_warp, float* terms, const uint32_t* list = nullptr) {
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int g = lane >> 2, tq = lane & 3;
  const int r0 = run.r0, r1 = run.r1;
  const int row_set = static_cast<int>(threadIdx.x) / kThreads;  // 0..RS-1
  const int64_t cmax = run.cmax;

#pragma unroll 1
  for (int k = 0;; ++k) {
    const StepPos sp = step_pos<kMasked>(run, list, tile_base, k);
    if (!sp.live) break;  // warp-uniform; later steps do not exist either
    const int buf = k % S;
    cp_async_wait<S - 1>();  // this lane's copies of step k have landed (one group per step issued)
    __syncwarp();            // ... and every other lane's
    const int64_t j = sp.j;           // this lane's position
    const bool has = sp.has;          // masked: the lane has an entry (it writes its position's scores)
    const uint32_t lane_rows = sp.rows;  // masked: the rows that keep this lane's block
    const int64_t p0 = j - lane;      // unmasked: the step's first position
    if (!kMasked && p0 >= cmax) {  // warp-uniform: no row of the run sees this step
      for (int r = r0 + row_set; r < r1; r += RS) p.scores[(row0 + r) * p.score_stride + j] = -__int_as_float(0x7f800000);
    } else {
      const uint32_t* kd = kd_warp + buf * (kStepPositions * 16);
      const uint32_t* ks = ks_warp + buf * kStepPositions;
      const uint32_t valid_bits = run.valid_bits >> buf;  // bit 0: this step
      const uint32_t vmask = __ballot_sync(kFullMask, valid_bits & 1u);

      // ---- A fragments (positions 16mt + g + 8r), decoded once for all rows of the run ----
      // kf[mt]: every usable position of the m-tile has its 4 K block scales within 2^3 (fused_ok);
      // then A carries 2^(ek_b - ek_min) and the K scale of every block is sk_min (for both paths).
      // k-slot mapping (A and B alike): in k-step s, lane (g, tq)'s 8 k-slots hold the elements
      // 32tq + 8s .. 32tq + 8s + 7, i.e. word s of block tq: over the 4 k-steps a lane holds exactly
      // block tq, so its A words are one 16-byte chunk of the position's codes and one block shift
      // serves them all. A k-step then mixes the 4 blocks: the fused path (one accumulator for all
      // four) does not care; the per-block path separates block b by zeroing the other lanes' A.
      uint32_t A[2][kBlocks][4];  // [mt][k-step s][a0..a3]
      uint32_t sc[2][2];
      bool kf[2];
      float s4[2][2], c4[2][2];  // sk_min / 4 and -1.5 * 2^23 * sk_min / 4 per (mt, r)
      // The scale checks once per position: lane l for position l (unusable positions: zeros, any
      // path); m-tile mt = positions 16mt .. 16mt + 15.
      const uint32_t own_sc = ks[lane];
      const uint32_t own_min = min_byte(own_sc);
      const uint32_t fused_bits = __ballot_sync(kFullMask, ((vmask >> lane) & 1u) == 0u || fused_ok(own_sc));
      kf[0] = (fused_bits & 0xffffu) == 0xffffu;
      kf[1] = (fused_bits >> 16) == 0xffffu;
#pragma unroll
      for (int mt = 0; mt < 2; ++mt) {
        uint4 kw[2];
        uint32_t pmin[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int pp = 16 * mt + g + 8 * r;
          kw[r] = *reinterpret_cast<const uint4*>(&kd[pp * 16 + (tq ^ chunk_swizzle(pp)) * 4]);  // block tq of pp
          sc[mt][r] = __shfl_sync(kFullMask, own_sc, pp);
          pmin[r] = __shfl_sync(kFullMask, own_min, pp);
        }
        uint32_t lo[2], hi[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const uint32_t kmin = kf[mt] ? pmin[r] : 0u;
          s4[mt][r] = num::mul_rn(num::f32_from_ue8m0(static_cast<uint8_t>(kmin)), 0.25f);
          c4[mt][r] = num::mul_rn(-kMagicFloat, s4[mt][r]);
          const uint32_t shift = kf[mt] ? byte_of(sc[mt][r], tq) - kmin : 0u;  // 2^(ek_tq - ek_min), <= 2^3
          lo[r] = kTwiceLo << shift;
          hi[r] = kTwiceHi << shift;
        }
        const uint32_t w0[4] = {kw[0].x, kw[0].y, kw[0].z, kw[0].w}, w1[4] = {kw[1].x, kw[1].y, kw[1].z, kw[1].w};
#pragma unroll
        for (int s = 0; s < kBlocks; ++s) {
          A[mt][s][0] = e2m1x4_to_s8(w0[s], lo[0], hi[0]);
          A[mt][s][1] = e2m1x4_to_s8(w1[s], lo[1], hi[1]);
          A[mt][s][2] = e2m1x4_to_s8(w0[s] >> 16, lo[0], hi[0]);
          A[mt][s][3] = e2m1x4_to_s8(w1[s] >> 16, lo[1], hi[1]);
        }
      }

      for (int r = r0 + row_set; r < r1; r += RS) {  // row split: row set k takes rows r0 + k, r0 + k + RS, ...
        float* out_row = p.scores + (row0 + r) * p.score_stride;
        const int64_t c_r = meta[r].c;
        uint32_t row_mt = 3u;  // bit mt: the row computes m-tile mt
        if constexpr (kMasked) {
          // m-tile mt = the lanes 16mt .. 16mt + 15 (blocks 2mt, 2mt + 1 of the step)
          const uint32_t keeps = __ballot_sync(kFullMask, (lane_rows >> r) & 1u);
          row_mt = (keeps & 0xffffu ? 1u : 0u) | (keeps >> 16 ? 2u : 0u);
          if (row_mt == 0u) {  // warp-uniform: the row keeps none of the step's blocks
            if (has) out_row[j] = -__int_as_float(0x7f800000);
            continue;
          }
        } else if (p0 >= c_r) {  // warp-uniform
          out_row[j] = -__int_as_float(0x7f800000);
          continue;
        }
        const uint32_t head_ok = meta[r].head_ok;
        const RowConst& rcr = rc[r];
        const uint4* qf = qfrag + static_cast<size_t>(r) * 4 * 32 * 2;
        float qw[8];
        {
          const float4 a = *reinterpret_cast<const float4*>(&rcr.qw[8 * tq]);
          const float4 b = *reinterpret_cast<const float4*>(&rcr.qw[8 * tq + 4]);
          qw[0] = a.x, qw[1] = a.y, qw[2] = a.z, qw[3] = a.w, qw[4] = b.x, qw[5] = b.y, qw[6] = b.z, qw[7] = b.w;
        }
        // Fused-path epilogue of one n-tile's accumulator (see the proof at the general loop's fused
        // path): I * sk_min / 4 by one exact FMA, relu, one rounded product with sq_min * w.
        auto fused_terms = [&](const int (&acc)[4], int mt, int nt, float (&term)[2][8]) {
#pragma unroll
          for (int rr = 0; rr < 2; ++rr)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const int hl = 2 * nt + e;
              const float y = __fmaf_rn(__int_as_float(acc[2 * rr + e]), s4[mt][rr], c4[mt][rr]);  // exact
              term[rr][hl] = num::mul_rn(y > 0.0f ? y : 0.0f, qw[hl]);
            }
        };
        auto store_terms = [&](int mt, const float (&term)[2][8]) {
#pragma unroll
          for (int rr = 0; rr < 2; ++rr) {
            float4* dst = reinterpret_cast<float4*>(terms + (16 * mt + g + 8 * rr) * kTransStride + 8 * tq);
            dst[0] = make_float4(term[rr][0], term[rr][1], term[rr][2], term[rr][3]);
            dst[1] = make_float4(term[rr][4], term[rr][5], term[rr][6], term[rr][7]);
          }
        };
        if (kf[0] && kf[1] && head_ok == 0xffffffffu && row_mt == 3u) {
          // Both m-tiles and every head fused (the common case): the m-tiles' 32 MMAs as eight
          // independent chains, each B fragment loaded once per row and step for both m-tiles (8
          // LDS.128 instead of 16; shared-memory loads were the verify shape's top stall, session 6).
          int acc[2][4][4];
          fused_mma_chains(acc, A, qf, lane, 0, 2);
#pragma unroll
          for (int mt = 0; mt < 2; ++mt) {
            float term[2][8];
#pragma unroll
            for (int nt = 0; nt < 4; ++nt) fused_terms(acc[mt][nt], mt, nt, term);
            store_terms(mt, term);
          }
        } else
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) {
          if (kMasked && ((row_mt >> mt) & 1u) == 0u) continue;  // warp-uniform; its positions get -inf
          float term[2][8];
          if (kf[mt] && head_ok == 0xffffffffu) {
            // Every head of the row and every usable slot of the m-tile take the fused path (below):
            // the same MMAs and epilogue, issued as four independent chains (one per n-tile) block by
            // block, so that the tensor core's latency is paid once per block rather than once per
            // MMA (the per-n-tile branch of the general loop keeps the chains apart; Nsight: the
            // IMMA chains' fixed-latency waits were the kernel's top stall, docs/perf.md session 4).
            int acc[2][4][4];
            fused_mma_chains(acc, A, qf, lane, mt, 1);
#pragma unroll
            for (int nt = 0; nt < 4; ++nt) fused_terms(acc[mt][nt], mt, nt, term);
          } else {
#pragma unroll
          for (int nt = 0; nt < 4; ++nt) {
            const uint4 f01 = qf[(nt * 32 + lane) * 2], f23 = qf[(nt * 32 + lane) * 2 + 1];
            const uint32_t B[kBlocks][2] = {{f01.x, f01.y}, {f01.z, f01.w}, {f23.x, f23.y}, {f23.z, f23.w}};
            const uint32_t nt_heads = 0x03030303u << (2 * nt);  // heads 8tq' + 2nt + e of n-tile nt
            if (kf[mt] && (head_ok & nt_heads) == nt_heads) {
              // Fused path: the four k-steps accumulate I = sum_b isum_b * 2^(eq_b + ek_b - eq_min -
              // ek_min) in one int32. Each block sum and every partial sum of ((b0 + b1) + b2) + b3 is
              // an integer multiple of 2^Emin (Emin = eq_min + ek_min - 2) below 2^21 * 2^Emin
              // (|isum_b| <= 4608, shifts <= 6), hence an exact fp32 number: the reference's rounded
              // sums are exact here and its dot is D = I * 2^Emin. One FMA forms I * sk_min / 4
              // exactly (the accumulator's float is 1.5 * 2^23 + I), relu keeps its sign, and one
              // product with the exact sq_min * w rounds D * w once, like the reference.
              int acc[4];
              mma_s8_m16n8k32(acc, A[mt][0], B[0], kMagicBits);
              mma_s8_m16n8k32_acc(acc, A[mt][1], B[1]);
              mma_s8_m16n8k32_acc(acc, A[mt][2], B[2]);
              mma_s8_m16n8k32_acc(acc, A[mt][3], B[3]);
              fused_terms(acc, mt, nt, term);
            } else {
              // Per-block path (any scales): four exact block sums, combined like the reference.
              // Block b = the k-slots of the lanes tq == b in all 4 k-steps: the others' A zeroed.
              // (not unrolled: the rare path's code and registers stay small)
              float dot[2][2];
#pragma unroll 1
              for (int b = 0; b < kBlocks; ++b) {
                const uint32_t keep = tq == b ? ~0u : 0u;
                int acc[4];
#pragma unroll
                for (int s = 0; s < kBlocks; ++s) {
                  const uint32_t Ab[4] = {A[mt][s][0] & keep, A[mt][s][1] & keep, A[mt][s][2] & keep, A[mt][s][3] & keep};
                  if (s == 0) mma_s8_m16n8k32(acc, Ab, B[s], kMagicBits);
                  else mma_s8_m16n8k32_acc(acc, Ab, B[s]);
                }
#pragma unroll
                for (int rr = 0; rr < 2; ++rr)
#pragma unroll
                  for (int e = 0; e < 2; ++e) {
                    const int head = 8 * tq + 2 * nt + e;
                    const float sk4 = kf[mt] ? s4[mt][rr]
                                             : num::mul_rn(num::f32_from_ue8m0(static_cast<uint8_t>(byte_of(sc[mt][rr], b))), 0.25f);
                    const float isum = num::sub_rn(__int_as_float(acc[2 * rr + e]), kMagicFloat);  // exact
                    const float block_sum = num::mul_rn(isum, num::mul_rn(rcr.sq[head][b], sk4));
                    dot[rr][e] = b == 0 ? block_sum : num::add_rn(dot[rr][e], block_sum);
                  }
              }
#pragma unroll
              for (int rr = 0; rr < 2; ++rr)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                  const float d = dot[rr][e];
                  term[rr][2 * nt + e] = num::mul_rn(d > 0.0f ? d : 0.0f, rcr.wt[8 * tq + 2 * nt + e]);
                }
            }
          }
          }
          store_terms(mt, term);
        }
        __syncwarp();
        float score = 0.0f;
        const float4* trow = reinterpret_cast<const float4*>(terms + lane * kTransStride);
#pragma unroll
        for (int h4 = 0; h4 < kIndexerHeads / 4; ++h4) {
          const float4 v = trow[h4];
          score = num::add_rn(num::add_rn(num::add_rn(num::add_rn(score, v.x), v.y), v.z), v.w);
        }
        const bool valid = (valid_bits & 1u) != 0u && j < c_r && (!kMasked || ((lane_rows >> r) & 1u) != 0u);
        if (has) out_row[j] = valid ? score : -__int_as_float(0x7f800000);
        __syncwarp();  // the term buffer is rewritten by the next row
      }
    }
    __syncwarp();  // every lane is done with ring buffer buf: it takes step k + S
    issue_step<kMasked, S == 1>(p, pg, run, list, tile_base, k + S, run.next_slot, buf, kd_warp, ks_warp);
    run.next_slot = load_slot<kMasked>(p, run, list, tile_base, k + S + 1);
  }
  cp_async_wait<0>();
  __syncwarp();  // this warp's K buffers are free for the next run
}

// Grid (groups, tiles), 128 * RS threads, dynamic shared memory smem_layout(S, group_rows, RS).
// Row split RS: warps w and w + 4k take the same positions (each loads its own copy of their K:
// the second read hits L2) and the rows r0 + k, r0 + k + RS, ... of each run, so a warp walks
// 1/RS of the rows serially (the per-row MMAs + epilogue + ordered head sum are the kernel's
// critical path at small T: ~25 us for 6 rows at 64K in the stack, run 21). Measured slower than
// RS = 1 (run 22), so it is a tuning knob only.
// S: K buffers per warp (the ring a warp streams its steps through). Unmasked: a CTA's tile is
// span_steps steps per warp (128 * span_steps positions). TBLK > 0: the masked kernel (candidate
// mask), tiles of TBLK blocks of 8 positions whose kept blocks are compacted into each warp's
// list, 4 per step; RS must be 1.
template <int S, int RS, int MB = 3, int TBLK = 0>
__global__ void __launch_bounds__(kThreads * RS, RS == 1 ? MB : 1)
    indexer_scores_kernel(const __grid_constant__ IndexerScoresParams p, int group_rows, const PageGeom pg,
                          int span_steps) {
  constexpr bool kMasked = TBLK > 0;
  static_assert(!kMasked || RS == 1, "the masked kernel has one warp set");
  extern __shared__ __align__(16) uint8_t smem[];
  const SmemLayout L = smem_layout(S, group_rows, RS, TBLK);
  const int warp = static_cast<int>(threadIdx.x) / 32;
  uint32_t* kd_warp = reinterpret_cast<uint32_t*>(smem) + warp * S * (kStepPositions * 16);
  uint32_t* ks_warp = reinterpret_cast<uint32_t*>(smem + L.kscale) + warp * S * kStepPositions;
  float* terms = reinterpret_cast<float*>(smem + L.terms) + warp * kStepPositions * kTransStride;
  uint4* qfrag = reinterpret_cast<uint4*>(smem + L.qfrag);
  RowConst* rc = reinterpret_cast<RowConst*>(smem + L.rc);
  RowMeta* meta = reinterpret_cast<RowMeta*>(smem + L.meta);
  uint32_t* list = reinterpret_cast<uint32_t*>(smem + L.list) + warp * TBLK;

  [[maybe_unused]] unsigned int stamp_rec = 0u;
  if (threadIdx.x == 0) V4ATTN_STAMP_BEGIN(stamp_rec, stamps::kScores, 0);
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * group_rows;
  const int n_rows = static_cast<int>(min(static_cast<int64_t>(group_rows), p.T - row0));
  const int64_t tile_span = kMasked ? 8 * TBLK : static_cast<int64_t>(kWarps) * kStepPositions * span_steps;
  const int64_t tile_base = static_cast<int64_t>(blockIdx.y) * tile_span;
  const int64_t tile_end = min(tile_base + tile_span, p.score_stride);

  // ---- row metadata (step metadata: read before the PDL wait), contained like the reference refuses it
  if (static_cast<int>(threadIdx.x) < n_rows) {
    const int64_t t = row0 + threadIdx.x;
    const int32_t req = p.req[t];
    int64_t c = p.clen[t];
    bool row_error = false;
    if (c < 0) { c = 0; row_error = true; }
    if (c > p.score_stride) { c = p.score_stride; row_error = true; }
    if (req < 0) {
      c = 0;  // padded row: sees no position (not an error)
    } else if (req >= p.comp_table_rows) {
      if (c > 0) row_error = true;  // unknown request
      c = 0;
    } else if (c > p.comp_table_stride) {
      c = p.comp_table_stride;
      row_error = true;
    }
    if (row_error && blockIdx.y == 0) dev::count_error(p.err_count);
    meta[threadIdx.x] = RowMeta{req, static_cast<int32_t>(c), 0u, 0};
  }
  __syncthreads();
  int64_t c_any = 0;
  for (int r = 0; r < n_rows; ++r) c_any = max(c_any, static_cast<int64_t>(meta[r].c));

  // q, weights, slot table and index K are written by predecessors
  if (p.trigger_at_wait) dev::pdl_wait();
  else dev::pdl_wait_no_trigger();
  if (threadIdx.x == 0) V4ATTN_STAMP_AT(stamp_rec, stamps::kScores, 1);

  // ---- q of the group's rows, when some row sees a position of this tile (CTA-uniform) ----
  // B fragments (n = head, 4 n-tiles of 8 heads, 4 k-steps of 32), head and k permuted so that
  // lane (g, tq) accumulates heads 8tq..8tq+7 and, in k-step s, its k-slots hold the elements
  // 32tq + 8s .. + 7 (word s of block tq; the same mapping as the A operand: any common
  // permutation of k is fine, the sums being exact integers). A head whose 4 block scales fit the
  // fused path (fused_ok) carries 2^(eq_tq - eq_min) in this lane's int8 values, and its scale is
  // sq_min for every block (both paths).
  // Thread i owns item (row r, n-tile i / 32, lane i % 32) of every row r, and the head constants
  // of items i and i + 128 of (row, head). The loads are issued first, then the first run's
  // slot-table loads and K copies, and only then are the q words decoded: one latency for all.
  // The q setup below maps 128 threads (row split: the first 128 do it for the whole CTA).
  const bool has_work = tile_base < c_any && static_cast<int>(threadIdx.x) < kThreads;
  const int n_item = static_cast<int>(threadIdx.x) >> 5, l_item = static_cast<int>(threadIdx.x) & 31;
  const int head_item = 8 * ((l_item >> 2) >> 1) + 2 * n_item + ((l_item >> 2) & 1);  // MMA column g of n-tile n
  const int tq_item = l_item & 3;
  uint32_t q_hs[kMaxGroupRows] = {};
  uint4 q_words[kMaxGroupRows] = {};  // block tq_item of the item's head
  uint32_t c_hs[2] = {};
  float c_w[2] = {};
  if (has_work) {
#pragma unroll
    for (int r = 0; r < kMaxGroupRows; ++r)
      if (r < n_rows) {
        const int64_t hrow = (row0 + r) * kIndexerHeads + head_item;
        q_hs[r] = *reinterpret_cast<const uint32_t*>(p.q_scales + hrow * kIndexerScaleBytes);
        q_words[r] = *reinterpret_cast<const uint4*>(p.q_codes + hrow * kIndexerCodeBytes + 16 * tq_item);
      }
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      const int it = static_cast<int>(threadIdx.x) + kThreads * k;
      if (it < n_rows * kIndexerHeads) {
        const int64_t hrow = (row0 + it / kIndexerHeads) * kIndexerHeads + it % kIndexerHeads;
        c_hs[k] = *reinterpret_cast<const uint32_t*>(p.q_scales + hrow * kIndexerScaleBytes);
        c_w[k] = p.weights[hrow];
      }
    }
  }

  // ---- the first run of consecutive rows with the same req: issued before the q decode ----
  int r1 = 1;
  while (r1 < n_rows && meta[r1].req == meta[0].req) ++r1;
  int nsel = 0;
  if constexpr (kMasked) nsel = build_block_list<TBLK>(p, row0, 0, r1, tile_base, meta, list);
  RunCtx run = issue_run<S, kMasked>(p, pg, 0, r1, tile_base, tile_end, meta, kd_warp, ks_warp, list, nsel);

  if (has_work) {
#pragma unroll
    for (int r = 0; r < kMaxGroupRows; ++r)
      if (r < n_rows) {
        const uint32_t hs = q_hs[r];
        const bool shifted = fused_ok(hs);
        const uint32_t hmin = min_byte(hs);
        const uint32_t shift = shifted ? byte_of(hs, tq_item) - hmin : 0u;
        const uint32_t lo = kTwiceLo << shift, hi = kTwiceHi << shift;
        const uint32_t w[4] = {q_words[r].x, q_words[r].y, q_words[r].z, q_words[r].w};
        uint32_t f[kBlocks][2];  // [k-step s]
#pragma unroll
        for (int s = 0; s < kBlocks; ++s) {
          f[s][0] = e2m1x4_to_s8(w[s], lo, hi);        // elements 32tq + 8s .. +3 -> k-slots 4tq..4tq+3
          f[s][1] = e2m1x4_to_s8(w[s] >> 16, lo, hi);  // elements 32tq + 8s + 4 .. +7 -> k-slots 16+4tq..
        }
        uint4* dst = qfrag + ((r * 4 + n_item) * 32 + l_item) * 2;
        dst[0] = make_uint4(f[0][0], f[0][1], f[1][0], f[1][1]);
        dst[1] = make_uint4(f[2][0], f[2][1], f[3][0], f[3][1]);
      }
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      const int it = static_cast<int>(threadIdx.x) + kThreads * k;
      if (it < n_rows * kIndexerHeads) {
        const int r = it / kIndexerHeads, h = it % kIndexerHeads;
        const uint32_t hs = c_hs[k];
        const bool shifted = fused_ok(hs);
        const uint32_t hmin = min_byte(hs);
        const float sq_min = num::f32_from_ue8m0(static_cast<uint8_t>(hmin));
#pragma unroll
        for (int b = 0; b < kBlocks; ++b)
          rc[r].sq[h][b] = shifted ? sq_min : num::f32_from_ue8m0(static_cast<uint8_t>(byte_of(hs, b)));
        rc[r].wt[h] = c_w[k];
        rc[r].qw[h] = num::mul_rn(sq_min, c_w[k]);
        if (shifted && qw_exact(hmin, c_w[k])) atomicOr(&meta[r].head_ok, 1u << h);
      }
    }
  }
  __syncthreads();

  // ---- runs (one per group for verify rows; the next one is issued when this one is done) ----
  for (;;) {
    compute_run<S, RS, kMasked>(p, pg, run, row0, tile_base, meta, qfrag, rc, kd_warp, ks_warp, terms, list);
    if (run.r1 >= n_rows) break;
    int e = run.r1 + 1;
    while (e < n_rows && meta[e].req == meta[run.r1].req) ++e;
    if constexpr (kMasked) nsel = build_block_list<TBLK>(p, row0, run.r1, e, tile_base, meta, list);
    run = issue_run<S, kMasked>(p, pg, run.r1, e, tile_base, tile_end, meta, kd_warp, ks_warp, list, nsel);
  }

  if (threadIdx.x == 0) V4ATTN_STAMP_AT(stamp_rec, stamps::kScores, 4);
  dev::pdl_launch_dependents();  // after this thread's last store
}

void require(bool ok, const char* who, const std::string& what) {
  if (!ok) throw std::invalid_argument(std::string(who) + ": " + what);
}
bool aligned(const void* ptr, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(ptr) % bytes == 0; }

}  // namespace

bool indexer_scores_mask_tile_ok(int tile_blocks) {
  return tile_blocks == 0 || tile_blocks == 16 || tile_blocks == 32 || tile_blocks == 64 || tile_blocks == 128 ||
         tile_blocks == 256;
}

IndexerScoresShape indexer_scores_shape(const IndexerScoresParams& p) {
  IndexerScoresShape sh;
  const int G = std::max(p.group_rows, 1);
  sh.masked = p.candidate_mask != nullptr;
  sh.groups = (std::max<int64_t>(p.T, 0) + G - 1) / G;
  // Automatic tiles: the largest of `positions` (largest first) that still gives >= min_ctas
  // CTAs, else the smallest.
  const auto largest_tile = [&](std::initializer_list<int64_t> positions, int64_t min_ctas) {
    for (const int64_t t : positions)
      if (sh.groups * ((p.score_stride + t - 1) / t) >= min_ctas) return t;
    return *(positions.end() - 1);
  };
  if (sh.masked) {
    // Tiles of TBLK blocks whose kept blocks are compacted (the kept fraction is unknown here:
    // ~1/4 of the blocks for one row at 64K, the union of a verify request's rows more), at least
    // 16 blocks (128 positions, one step per warp, one K buffer): the largest tile giving >= 1024
    // CTAs, or >= 384 (about one wave of 3 CTAs on 132 SMs) for one-row groups, whose CTAs hold a
    // quarter of a verify group's kept blocks and pay the same prologue. Three-lane cycles
    // (docs/perf.md session 15): decode bs 6 (tile 32 -> 128) -1.5 %; decode bs 2 / 4 / 8 / 16
    // (16 -> 32, 32 -> 64, 64 -> 128, 128 -> 256) within the noise; verify groups stay at 1024
    // (384 measured +0.6 % at verify bs 2, +1 % at verify bs 8).
    const int64_t min_ctas = G == 1 ? 384 : 1024;
    sh.mask_tile_blocks = p.mask_tile_blocks != 0
                              ? p.mask_tile_blocks
                              : static_cast<int>(largest_tile({8 * 256, 8 * 128, 8 * 64, 8 * 32, 8 * 16}, min_ctas) / 8);
    sh.tile_positions = 8 * sh.mask_tile_blocks;
    sh.ring = sh.mask_tile_blocks == 16 ? 1 : 2;
    sh.threads = kThreads;
    // Register cap: 4 CTAs per SM for the 16-block tile (one-step warps, small grids) unless
    // min_blocks asks for 3; 3 for the larger tiles.
    sh.min_blocks = sh.mask_tile_blocks == 16 ? (p.min_blocks != 0 ? p.min_blocks : 4) : 3;
    sh.smem_bytes = smem_layout(sh.ring, G, 1, sh.mask_tile_blocks).total;
  } else {
    // Steps per warp per CTA (the tile = 128 * steps positions, streamed through a ring of 2 K
    // buffers per warp; 1 buffer for one-step tiles): automatic as largest_tile of 16, 8, 4, 2, 1
    // steps. Small grids take one step per warp for parallelism (verify bs 1 at 64K, 6 rows per
    // CTA: 1 step (512 CTAs) beat 2 (256) by 37 us per 40-layer cycle, docs/perf.md session 2);
    // large ones amortise the CTA's prologue (meta, q decode, first table and K latencies) over
    // more steps whose loads overlap the compute (session 6). One-row (decode) groups: from 768
    // CTAs (a CTA does a sixth of a verify group's work per step for the same prologue); three-lane
    // decode bs 3 / 6 / 12 / 24 -0.4 / -1.0 / -1.0 / -0.5 %, every other batch unchanged
    // (docs/perf.md session 15).
    constexpr int64_t kStep = int64_t{kWarps} * kStepPositions;  // positions per step of the 4 warps
    sh.span_steps = p.steps_per_warp != 0
                        ? p.steps_per_warp
                        : static_cast<int>(largest_tile({16 * kStep, 8 * kStep, 4 * kStep, 2 * kStep, kStep},
                                                        G == 1 ? 768 : 1024) / kStep);
    sh.tile_positions = kStep * sh.span_steps;
    sh.ring = sh.span_steps == 1 ? 1 : 2;
    // Row split: 1 unless asked. Two warp sets were measured slower in the stack (verify bs 1:
    // 1752.8 / 1755.7 vs 1689.9 / 1680.5 us per cycle; bs 4: 2887.0 vs 2708.4; docs/perf.md run 22):
    // twice the threads per CTA and a second read of the tile's K cost more than the halved row walk.
    const int RS = p.row_split != 0 ? p.row_split : 1;
    sh.threads = kThreads * RS;
    // Register cap: 3 CTAs per SM (168 registers, no spill) for one group (verify bs 1: 4 measured
    // +0.6 % per cycle, sessions 6 and 17) and for one-row (decode) groups; 4 (128 registers, a few
    // spilled bytes) for two or more multi-row groups, whose CTAs fill more than a wave at 3 per SM
    // (three-lane cycles, docs/perf.md session 17: verify bs 2 -0.9 %, with 3-row groups verify bs 4
    // -1.2 %, bs 8 -0.8 %). (Row split: one CTA per SM, whatever the knob.)
    const int auto_min_blocks = G > 1 && sh.groups >= 2 ? 4 : 3;
    sh.min_blocks = RS == 2 ? 1 : p.min_blocks != 0 ? p.min_blocks : auto_min_blocks;
    sh.smem_bytes = smem_layout(sh.ring, G, RS).total;
  }
  sh.tiles = p.score_stride > 0 ? (p.score_stride + sh.tile_positions - 1) / sh.tile_positions : 0;
  return sh;
}

void run_indexer_scores(const IndexerScoresParams& p, cudaStream_t stream, bool pdl) {
  const char* who = "run_indexer_scores";
  require(p.T >= 0, who, "negative T");
  require(p.score_stride > 0 && p.score_stride % 64 == 0, who,
          "score_stride " + std::to_string(p.score_stride) + " must be a positive multiple of 64");
  const CacheLayout want = cache_layout(CacheKind::kIndexK, p.layout.page_size > 0 ? p.layout.page_size : 1);
  require(p.layout.data_bytes == want.data_bytes && p.layout.scale_bytes == want.scale_bytes &&
              p.layout.align == want.align,
          who, "layout is not the index-K layout (64 + 4 bytes per slot)");
  const int P = p.layout.page_size;
  require(P >= 4 && P <= (1 << 20) && (P & (P - 1)) == 0, who,
          "index-K page size " + std::to_string(P) + " must be a power of two in [4, 2^20] (16-byte aligned slots)");
  require(p.n_slots >= 0, who, "negative n_slots");
  require(p.comp_table_stride >= 0 && p.comp_table_rows >= 0, who, "negative slot table shape");
  require(p.steps_per_warp >= 0 && p.steps_per_warp <= kMaxSteps, who, "steps_per_warp must be in [0, 64]");
  require(p.row_split >= 0 && p.row_split <= 2, who, "row_split must be 0 (automatic), 1 or 2");
  require(p.min_blocks == 0 || p.min_blocks == 3 || p.min_blocks == 4, who,
          "min_blocks must be 0 (automatic), 3 or 4");
  require(p.group_rows >= 1 && p.group_rows <= kMaxGroupRows, who,
          "group_rows " + std::to_string(p.group_rows) + " must be in [1, " + std::to_string(kMaxGroupRows) + "]");
  if (p.T == 0) return;
  require(p.T <= 0x7fffffff, who, "T too large for one grid dimension");
  require(p.q_codes != nullptr && p.q_scales != nullptr && p.weights != nullptr && p.req != nullptr &&
              p.clen != nullptr && p.scores != nullptr,
          who, "null pointer");
  require(p.index_k_cache != nullptr || p.n_slots == 0, who, "null index-K cache");
  require(p.comp_slot_table != nullptr || p.comp_table_rows == 0, who, "null slot table");
  require(aligned(p.q_codes, 16) && aligned(p.q_scales, 16) && aligned(p.index_k_cache, 16), who,
          "q_codes, q_scales and index_k_cache must be 16-byte aligned");
  require(p.n_slots < (int64_t{1} << 31), who, "n_slots must fit in int32 slots");

  const bool masked = p.candidate_mask != nullptr;
  if (masked) {
    require(p.mask_block == 8, who, "mask_block " + std::to_string(p.mask_block) + " must be 8 (the masked kernel's block)");
    require(p.mask_stride >= p.score_stride / 8, who,
            "mask_stride " + std::to_string(p.mask_stride) + " is smaller than score_stride / 8 = " +
                std::to_string(p.score_stride / 8));
    require(p.row_split <= 1, who, "row_split 2 is not available with a candidate mask");
    require(indexer_scores_mask_tile_ok(p.mask_tile_blocks), who,
            "mask_tile_blocks must be 0 (automatic), 16, 32, 64, 128 or 256");
  }

  PageGeom pg{p.layout.page_bytes(), int64_t{P} * kIndexerCodeBytes, 0, 0};
  while ((1 << pg.shift) < P) ++pg.shift;
  const IndexerScoresShape sh = indexer_scores_shape(p);
  require(sh.tiles <= 65535, who, "score_stride too large for the tile grid");
  using Kernel = void (*)(IndexerScoresParams, int, PageGeom, int);
  Kernel kernel = nullptr;
  if (sh.masked) {
    switch (sh.mask_tile_blocks) {
      case 16: kernel = sh.min_blocks == 3 ? indexer_scores_kernel<1, 1, 3, 16> : indexer_scores_kernel<1, 1, 4, 16>; break;
      case 32: kernel = indexer_scores_kernel<2, 1, 3, 32>; break;
      case 64: kernel = indexer_scores_kernel<2, 1, 3, 64>; break;
      case 256: kernel = indexer_scores_kernel<2, 1, 3, 256>; break;
      default: kernel = indexer_scores_kernel<2, 1, 3, 128>; break;
    }
  } else if (sh.threads == 2 * kThreads) {  // row split
    kernel = sh.ring == 1 ? indexer_scores_kernel<1, 2> : indexer_scores_kernel<2, 2>;
  } else if (sh.min_blocks == 4) {  // registers capped at 128 (a few spills) for 4 CTAs per SM
    kernel = sh.ring == 1 ? indexer_scores_kernel<1, 1, 4> : indexer_scores_kernel<2, 1, 4>;
  } else {
    kernel = sh.ring == 1 ? indexer_scores_kernel<1, 1> : indexer_scores_kernel<2, 1>;
  }
  LaunchConfig cfg;
  cfg.grid = dim3(static_cast<unsigned>(sh.groups), static_cast<unsigned>(sh.tiles), 1);
  cfg.block = dim3(static_cast<unsigned>(sh.threads), 1, 1);
  cfg.smem_bytes = sh.smem_bytes;
  cfg.stream = stream;
  cfg.pdl = pdl;
  launch_kernel(sh.masked ? "indexer_scores_masked" : "indexer_scores", kernel, cfg, p, p.group_rows, pg,
                sh.span_steps);
}

}  // namespace v4attn::kernels
