// Indexer q pack (spec 3.4): qi [T, heads*128] bf16 (wq_b_idx output) -> RoPE at pos on each
// head's last 64 dims (bf16) -> FP4 indexer quant (block 32, ue8m0) -> codes [T, heads, 64] +
// scales [T, heads, 4]; and the head weights w = fp32(weights_proj output) * 128^-0.5 *
// heads_total^-0.5. Twin of ref::indexer_q_pack + ref::indexer_weights (same numerics.h steps in
// the same order, so the bytes agree).
//
// Grid: T CTAs of 128 threads; one CTA owns one row. Thread i quantizes (head i/4, block i%4):
// it loads its 32 bf16 values (four 16-byte loads), rotates them if the block is in the RoPE half
// (blocks 2 and 3 = dims 64..127), takes the block amax, and stores 16 code bytes (one 16-byte
// store) and one scale byte. Threads i < heads also write weight i.
//
// PDL: pos is step metadata (written before the predecessor started), the RoPE table a constant;
// both are read before dev::pdl_wait(). qi and wproj_out (GEMM outputs) are read after it; the
// trigger follows the thread's last store.
#include "v4attn/kernels/indexer_kernels.h"

#include <cmath>
#include <stdexcept>
#include <string>

#include "kernels/device_common.cuh"
#include "runtime/launch.h"

namespace v4attn::kernels {

namespace {

constexpr int kThreads = 128;
constexpr int kBlocksPerHead = kIndexerHeadDim / num::kIndexerQuantBlock;  // 4
constexpr int kRopeFirstBlock = (kIndexerHeadDim - num::kRopeDim) / num::kIndexerQuantBlock;  // 2

__global__ void __launch_bounds__(kThreads) indexer_q_pack_kernel(const __grid_constant__ IndexerQPackParams p,
                                                                       float weight_scale) {
  const int64_t t = blockIdx.x;
  const int32_t pos = p.pos[t];
  const bool pos_ok = pos >= 0 && pos < p.max_pos;
  if (!pos_ok && threadIdx.x == 0) dev::count_error(p.err_count);  // reference refuses it on the host

  dev::pdl_wait();  // qi and wproj_out are the predecessor GEMMs' outputs

  if (static_cast<int>(threadIdx.x) < p.heads) {
    const float w = num::f32_from_bf16(p.wproj_out[t * p.wproj_stride + threadIdx.x]);
    p.weights[t * p.heads + threadIdx.x] = num::mul_rn(w, weight_scale);
  }
  if (pos_ok) {
    for (int hb = threadIdx.x; hb < p.heads * kBlocksPerHead; hb += kThreads) {
      const int h = hb / kBlocksPerHead, b = hb % kBlocksPerHead;
      const num::bf16_t* src = p.qi + t * p.qi_stride + h * kIndexerHeadDim + b * num::kIndexerQuantBlock;
      float x[num::kIndexerQuantBlock];
#pragma unroll
      for (int v = 0; v < 4; ++v) {
        const uint4 raw = reinterpret_cast<const uint4*>(src)[v];
        const uint32_t w4[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          x[8 * v + 2 * i] = num::f32_from_bf16(static_cast<num::bf16_t>(w4[i] & 0xffffu));
          x[8 * v + 2 * i + 1] = num::f32_from_bf16(static_cast<num::bf16_t>(w4[i] >> 16));
        }
      }
      if (b >= kRopeFirstBlock) {
        // Pair m of the 64-dim tail = dims (64 + 2m, 65 + 2m); this block holds m in
        // [(b-2)*16, (b-2)*16 + 16). Table row pos: (cos, sin) of pair m at 2m, 2m+1.
        const float* cs = p.rope_table + static_cast<int64_t>(pos) * num::kRopeDim +
                          2 * (b - kRopeFirstBlock) * (num::kIndexerQuantBlock / 2);
#pragma unroll
        for (int i = 0; i < num::kIndexerQuantBlock / 2; ++i) {
          float re, im;
          num::rope_rotate(x[2 * i], x[2 * i + 1], cs[2 * i], cs[2 * i + 1], re, im);
          x[2 * i] = num::round_bf16(re);
          x[2 * i + 1] = num::round_bf16(im);
        }
      }
      float amax = 0.0f;  // from 0 like the reference (max is exact and order-free)
#pragma unroll
      for (int i = 0; i < num::kIndexerQuantBlock; ++i) amax = num::block_amax_step(amax, x[i]);
      const int e = num::indexer_quant_scale_exp(amax);
      const float s = num::pow2_f32(e);
      uint32_t packed[4] = {0u, 0u, 0u, 0u};
#pragma unroll
      for (int i = 0; i < num::kIndexerQuantBlock / 2; ++i)
        packed[i / 4] |= static_cast<uint32_t>(num::pack_e2m1(num::fp4_code(x[2 * i], s), num::fp4_code(x[2 * i + 1], s)))
                         << (8 * (i % 4));
      const int64_t head_row = t * p.heads + h;
      *reinterpret_cast<uint4*>(p.q_codes + head_row * kIndexerCodeBytes + b * 16) =
          make_uint4(packed[0], packed[1], packed[2], packed[3]);
      p.q_scales[head_row * kIndexerScaleBytes + b] = num::ue8m0_from_exp(e);
    }
  }

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
  cfg.grid = dim3(static_cast<unsigned>(p.T), 1, 1);
  cfg.block = dim3(kThreads, 1, 1);
  cfg.stream = stream;
  cfg.pdl = pdl;
  launch_kernel("indexer_q_pack", indexer_q_pack_kernel, cfg, p, indexer_weight_scale(p.heads_total));
}

}  // namespace v4attn::kernels
