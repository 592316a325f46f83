// Indexer q pack (spec 3.4): qi [T, heads*128] bf16 (wq_b_idx output) -> RoPE at pos on each
// head's last 64 dims (bf16) -> FP4 indexer quant (block 32, ue8m0) -> codes [T, heads, 64] +
// scales [T, heads, 4]; and the head weights w = fp32(weights_proj output) * 128^-0.5 *
// heads_total^-0.5. Twin of ref::indexer_q_pack + ref::indexer_weights (same numerics.h steps in
// the same order, so the bytes agree).
//
// Grid: (T, ceil(heads / 4)) CTAs of 256 threads; one CTA owns 4 heads of one row, thread i the
// pair of dims (2m, 2m+1), m = i % 64, of head i / 64: it loads the pair (4 bytes), rotates it if
// it is in the RoPE half (m >= 32), takes the 32-value block's amax with a 16-lane butterfly max
// (max of |x| is exact and order-free), quantizes its two values and stores their code byte; the
// block's first thread stores the scale byte. Threads i < heads of the first CTA of a row also
// write weight i. (The previous version had one thread per block: 32 dependent divisions per
// thread on 4 warps per row made it latency-bound at ~7 us.)
//
// PDL: pos is step metadata (written before the predecessor started), the RoPE table a constant;
// both are read before dev::pdl_wait(). qi and wproj_out (GEMM outputs) are read after it, both
// before the first store (see the kernel); the trigger follows the thread's last store.
#include "v4attn/kernels/indexer_kernels.h"

#include <cmath>
#include <stdexcept>
#include <string>

#include "kernels/device_common.cuh"
#include "runtime/launch.h"
#include "runtime/phase_stamps.cuh"

namespace v4attn::kernels {

V4ATTN_STAMP_UNIT();

namespace {

constexpr int kThreads = 256;
constexpr int kPairsPerHead = kIndexerHeadDim / 2;                            // 64
constexpr int kHeadsPerCta = kThreads / kPairsPerHead;                        // 4
constexpr int kRopeFirstPair = (kIndexerHeadDim - num::kRopeDim) / 2;         // 32
constexpr int kPairsPerBlock = num::kIndexerQuantBlock / 2;                   // 16

__global__ void __launch_bounds__(kThreads) indexer_q_pack_kernel(const __grid_constant__ IndexerQPackParams p,
                                                                       float weight_scale) {
  const int64_t t = blockIdx.x;
  const int h = static_cast<int>(blockIdx.y) * kHeadsPerCta + static_cast<int>(threadIdx.x) / kPairsPerHead;
  const int m = static_cast<int>(threadIdx.x) % kPairsPerHead;  // pair m: dims 2m, 2m+1
  [[maybe_unused]] unsigned int stamp_rec = 0u;
  if (threadIdx.x == 0) V4ATTN_STAMP_BEGIN(stamp_rec, stamps::kQPack, 0);
  const int32_t pos = p.pos[t];
  const bool pos_ok = pos >= 0 && pos < p.max_pos;
  if (!pos_ok && blockIdx.y == 0 && threadIdx.x == 0) dev::count_error(p.err_count);  // reference refuses it
  const bool active = pos_ok && h < p.heads;  // uniform over the 2 warps of a head
  const bool rope = m >= kRopeFirstPair;
  float cs_c = 1.0f, cs_s = 0.0f;
  if (active && rope) {  // table row pos: (cos, sin) of tail pair m - 32 at 2(m - 32), 2(m - 32) + 1
    const float* cs = p.rope_table + static_cast<int64_t>(pos) * num::kRopeDim + 2 * (m - kRopeFirstPair);
    cs_c = cs[0];
    cs_s = cs[1];
  }

  dev::pdl_wait();  // qi and wproj_out are the predecessor GEMMs' outputs
  if (threadIdx.x == 0) V4ATTN_STAMP_AT(stamp_rec, stamps::kQPack, 1);

  // Both GEMM outputs are loaded before the first store: the compiler must assume that a store
  // to weights may alias qi, so a qi load placed after it would wait for the wproj round trip
  // (two dependent L2 round trips on the weight-writing warp).
  const bool writes_weight = blockIdx.y == 0 && static_cast<int>(threadIdx.x) < p.heads;
  uint32_t raw = 0u;
  if (active)
    raw = *reinterpret_cast<const uint32_t*>(p.qi + t * p.qi_stride + static_cast<int64_t>(h) * kIndexerHeadDim + 2 * m);
  float wproj = 0.0f;
  if (writes_weight) wproj = num::f32_from_bf16(p.wproj_out[t * p.wproj_stride + threadIdx.x]);
  if (writes_weight) p.weights[t * p.heads + threadIdx.x] = num::mul_rn(wproj, weight_scale);
  if (active) {
    float x0 = num::f32_from_bf16(static_cast<num::bf16_t>(raw & 0xffffu));
    float x1 = num::f32_from_bf16(static_cast<num::bf16_t>(raw >> 16));
    if (rope) {
      float re, im;
      num::rope_rotate(x0, x1, cs_c, cs_s, re, im);
      x0 = num::round_bf16(re);
      x1 = num::round_bf16(im);
    }
    // Block amax from 0 like the reference (max of |x|, NaN-skipping: exact and order-free).
    float amax = num::block_amax_step(num::block_amax_step(0.0f, x0), x1);
#pragma unroll
    for (int off = kPairsPerBlock / 2; off >= 1; off >>= 1)
      amax = num::max_f(amax, __shfl_xor_sync(0xffffffffu, amax, off));  // within the 16 lanes of the block
    const int e = num::indexer_quant_scale_exp(amax);
    const float s = num::pow2_f32(e);
    const int64_t head_row = t * p.heads + h;
    p.q_codes[head_row * kIndexerCodeBytes + m] = num::pack_e2m1(num::fp4_code(x0, s), num::fp4_code(x1, s));
    if (m % kPairsPerBlock == 0) p.q_scales[head_row * kIndexerScaleBytes + m / kPairsPerBlock] = num::ue8m0_from_exp(e);
  }

  if (threadIdx.x == 0) V4ATTN_STAMP_AT(stamp_rec, stamps::kQPack, 4);
  dev::pdl_launch_dependents();  // after this thread's last store
}

void require(bool ok, const char* who, const std::string& what) {
  if (!ok) throw std::invalid_argument(std::string(who) + ": " + what);
}
bool aligned(const void* ptr, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(ptr) % bytes == 0; }

}  // namespace

float indexer_weight_scale(int heads_total) {
  if (heads_total <= 0) throw std::invalid_argument("indexer_weight_scale: heads_total must be > 0");
  // Exactly ref::indexer_weights: once in double (sqrt correctly rounded), rounded once to fp32;
  // 1/sqrt(4096) = 1/64 exactly for the real 32 heads.
  return static_cast<float>(1.0 / std::sqrt(128.0 * static_cast<double>(heads_total)));
}

void run_indexer_q_pack(const IndexerQPackParams& p, cudaStream_t stream, bool pdl) {
  const char* who = "run_indexer_q_pack";
  require(p.T >= 0, who, "negative T");
  require(p.heads >= 1 && p.heads <= kIndexerHeads, who,
          "heads " + std::to_string(p.heads) + " must be in [1, " + std::to_string(kIndexerHeads) + "]");
  require(p.heads_total >= p.heads, who, "heads_total must be >= heads");
  require(p.qi_stride >= static_cast<int64_t>(p.heads) * kIndexerHeadDim && p.qi_stride % 8 == 0, who,
          "qi_stride " + std::to_string(p.qi_stride) + " must be >= heads*128 and a multiple of 8");
  require(p.wproj_stride >= p.heads, who, "wproj_stride must be >= heads");
  require(p.max_pos > 0, who, "max_pos must be > 0");
  if (p.T == 0) return;
  require(p.T <= 0x7fffffff, who, "T too large for one grid dimension");
  require(p.qi != nullptr && p.wproj_out != nullptr && p.pos != nullptr && p.rope_table != nullptr, who,
          "null input pointer");
  require(p.q_codes != nullptr && p.q_scales != nullptr && p.weights != nullptr, who, "null output pointer");
  require(aligned(p.qi, 16) && aligned(p.q_codes, 16), who, "qi and q_codes must be 16-byte aligned");

  LaunchConfig cfg;
  cfg.grid = dim3(static_cast<unsigned>(p.T), static_cast<unsigned>((p.heads + kHeadsPerCta - 1) / kHeadsPerCta), 1);
  cfg.block = dim3(kThreads, 1, 1);
  cfg.stream = stream;
  cfg.pdl = pdl;
  launch_kernel("indexer_q_pack", indexer_q_pack_kernel, cfg, p, indexer_weight_scale(p.heads_total));
}

}  // namespace v4attn::kernels
