// CPU reference of the Q chain (spec 3.1): fused wq_a|wkv fp8 GEMM, q_norm, wq_b fp8 GEMM,
// RoPE into the head-padded Q buffer.
#include <string>

#include "reference/ref_internal.h"
#include "v4attn/reference/gemm.h"
#include "v4attn/reference/layer.h"
#include "v4attn/reference/prepare_ops.h"

namespace v4attn::ref {

QChainOut q_chain(const LayerWeights& w, const bf16_t* x, int64_t T, const int32_t* pos, const float* table,
                  int64_t max_pos, int H, int H_pad, float eps) {
  using detail::require;
  const char* who = "q_chain";
  constexpr int64_t kHd = 512;
  const int64_t width = w.wqkv_a.n, q_rank = width - kHd, dim = w.wqkv_a.k;
  require(T >= 0 && H >= 0, who, "negative row or head count");
  require(q_rank > 0 && q_rank % 8 == 0, who, "wqkv_a must have q_lora_rank + 512 rows");
  require(static_cast<int64_t>(w.q_norm.size()) == q_rank, who, "q_norm size != q_lora_rank");
  require(w.wq_b.k == q_rank, who, "wq_b k " + std::to_string(w.wq_b.k) + " != q_lora_rank " + std::to_string(q_rank));
  require(w.wq_b.n == static_cast<int64_t>(H) * kHd, who,
          "wq_b has " + std::to_string(w.wq_b.n) + " rows, not H * 512 = " + std::to_string(static_cast<int64_t>(H) * kHd));
  require(H_pad >= H, who, "H_pad < H");
  QChainOut out;
  out.qkv_a.assign(static_cast<size_t>(T * width), 0);
  out.qr.assign(static_cast<size_t>(T * q_rank), 0);
  out.q.assign(static_cast<size_t>(T * H * kHd), 0);
  out.q_pad.assign(static_cast<size_t>(T * H_pad * kHd), 0);
  if (T == 0) return out;
  detail::require_ptr(x, who, "x");
  detail::require_ptr(pos, who, "pos");
  detail::require_ptr(table, who, "table");
  detail::require_positions(pos, T, max_pos, who);
  gemm_fp8(x, T, dim, w.wqkv_a, out.qkv_a.data(), width);
  rmsnorm_rows(out.qkv_a.data(), T, static_cast<int>(q_rank), width, w.q_norm.data(), eps, out.qr.data(), q_rank);
  gemm_fp8(out.qr.data(), T, q_rank, w.wq_b, out.q.data(), static_cast<int64_t>(H) * kHd);
  q_rope_store(out.q.data(), T, H, pos, table, max_pos, out.q_pad.data(), H_pad);
  return out;
}

}  // namespace v4attn::ref
