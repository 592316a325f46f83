// Public entry points of the GEMM family: validate once (std::invalid_argument, nothing launched),
// then dispatch to v0 (gemm_simple.cu), v1 (gemm_tc.cu, gemm_f32.cu), v2 (gemm_wgmma.cu), v3
// (gemm_wgmma_pipelined.cu), v5 (gemm_skinny.cu, bf16 / fp32) or v6 (gemm_gemv.cu, fp8).
#include <algorithm>
#include <cmath>
#include <string>

#include "gemm/gemm_internal.h"

namespace v4attn::kernels {

namespace {

[[noreturn]] void fail(const char* who, const std::string& what) { throw std::invalid_argument(std::string(who) + ": " + what); }

using detail::aligned_to;

void check_nk(const char* who, int64_t n, int64_t k) {
  if (n <= 0 || n % kGemmBlock != 0) fail(who, "n " + std::to_string(n) + " is not a positive multiple of 32");
  if (k <= 0 || k % kGemmBlock != 0) fail(who, "k " + std::to_string(k) + " is not a positive multiple of 32");
  if (n > (int64_t{1} << 30) || k > (int64_t{1} << 30)) fail(who, "n or k too large");
}

void check_rows_groups(const char* who, int m, int groups) {
  if (m > 65535) fail(who, "m > 65535");
  if (groups < 1 || groups > 65535) fail(who, "groups must be 1..65535");
}

// v1 / v2 / v3 need m <= 64 and, when the plan splits K, a workspace large enough (v3: never);
// v2 / v3 need the CTA's K range to fit in shared memory.
GemmPlan check_tc(const char* who, GemmVersion version, int m, int64_t n, int64_t k, int groups, int force_splits,
                  int force_mtiles, const GemmWorkspace& ws, int force_stages = 0) {
  if (m > kGemmMaxRows) fail(who, "tensor-core versions take m <= 64 (got " + std::to_string(m) + ")");
  const GemmPlan plan =
      version == GemmVersion::kWgmma            ? plan_gemm_wgmma(m, n, k, groups, force_splits, force_mtiles, force_stages)
      : version == GemmVersion::kWgmmaPipelined ? plan_gemm_wgmma_pipelined(m, n, k, groups, force_splits, force_mtiles,
                                                                            force_stages)
                                                : plan_gemm(version, m, n, k, groups, force_splits, force_mtiles);
  if ((version == GemmVersion::kWgmma || version == GemmVersion::kWgmmaPipelined) && plan.stages < 1)
    fail(who, std::string(version == GemmVersion::kWgmma ? "v2" : "v3") + ": the K range of one CTA (" +
                  std::to_string((k / kGemmBlock + plan.splits - 1) / plan.splits) +
                  " blocks) does not fit in shared memory; use more splits");
  if (plan.tiles_n > 65535 * 64 || plan.splits > 65535) fail(who, "grid too large");
  if (plan.splits > 1 && plan.workspace_bytes > 0) {  // v3 reduces in its cluster: no workspace
    if (ws.data == nullptr || ws.bytes < plan.workspace_bytes)
      fail(who, "split-K plan (S = " + std::to_string(plan.splits) + ") needs a workspace of " +
                    std::to_string(plan.workspace_bytes) + " bytes (got " + std::to_string(ws.bytes) + ")");
    if (!aligned_to(ws.data, 256)) fail(who, "workspace must be 256-byte aligned");
  }
  return plan;
}

}  // namespace

const char* gemm_version_name(GemmVersion v) {
  switch (v) {
    case GemmVersion::kSimple: return "v0 simple";
    case GemmVersion::kTensorCore: return "v1 tensor-core";
    case GemmVersion::kWgmma: return "v2 wgmma";
    case GemmVersion::kAuto: return "auto (fp8: v2/v3 by shape; bf16/fp32: v5/v1 by shape)";
    case GemmVersion::kWgmmaPipelined: return "v3 wgmma-pipelined";
    case GemmVersion::kSkinny: return "v5 skinny";
    case GemmVersion::kGemv: return "v6 gemv";
  }
  return "?";
}

GemmVersion best_fp8_gemm_version(int m) { return m >= 1 && m <= kGemmMaxRows ? GemmVersion::kWgmma : GemmVersion::kSimple; }

GemmVersion best_fp8_gemm_version(int m, int64_t n, int64_t k) {
  if (m < 1 || m > kGemmMaxRows) return GemmVersion::kSimple;
  // Measured (docs/perf.md, session 3 runs 12 and 19, graph + PDL): v3 wins on wq_a|wkv at every
  // m (8.2 vs 10.2 us at m = 6) and, with its one-wave cluster plan, on the indexer's wq_b at every
  // m (6.3 vs 8.0 us at m = 6, 7.5 vs 13.7 at 24); v2 elsewhere (wq_b: 12.7 vs 16.8 us at m = 1,
  // 26.6 vs 30.9 at 64).
  const bool v3 = (n <= 2048 && k >= 4096) || (n <= 4096 && k <= 2048);
  return v3 ? GemmVersion::kWgmmaPipelined : GemmVersion::kWgmma;
}

GemmPlan plan_gemm(GemmVersion version, int m, int64_t n, int64_t k, int groups, int force_splits, int force_mtiles) {
  switch (version) {
    case GemmVersion::kSimple: {
      GemmPlan plan;
      plan.block_n = static_cast<int>(n);
      plan.tiles_n = 1;
      return plan;
    }
    case GemmVersion::kTensorCore: return plan_gemm_tc(m, n, k, groups, force_splits, force_mtiles);
    case GemmVersion::kWgmma: return plan_gemm_wgmma(m, n, k, groups, force_splits, force_mtiles);
    case GemmVersion::kWgmmaPipelined: return plan_gemm_wgmma_pipelined(m, n, k, groups, force_splits, force_mtiles);
    case GemmVersion::kAuto: return plan_gemm(best_fp8_gemm_version(m, n, k), m, n, k, groups, force_splits, force_mtiles);
    case GemmVersion::kSkinny: return plan_gemm_skinny(m, n, k, groups, false, force_splits, force_mtiles);
    case GemmVersion::kGemv: return plan_gemm_gemv(m, n, k);
  }
  throw std::invalid_argument("plan_gemm: unknown version");
}

size_t gemm_workspace_bytes(int m_max, int64_t n, int64_t k, int groups) {
  const size_t v1 = plan_gemm_tc(m_max, n, k, groups).workspace_bytes;
  const size_t v2 = plan_gemm_wgmma(std::clamp(m_max, 0, kGemmMaxRows), n, k, groups).workspace_bytes;
  return std::max(v1, v2);
}

// One validation for every fp8 form: plain, the v3 fused act quant (a_bf16) and the v2 fused
// RoPE store (rope_table); run_gemm_fp8_fused_quant / run_gemm_fp8_rope_store are thin wrappers.
void run_gemm_fp8(const Fp8GemmParams& p, const GemmWorkspace& ws, GemmVersion version, cudaStream_t stream,
                  bool pdl) {
  const char* who = "run_gemm_fp8";
  if (p.m < 0) fail(who, "m < 0");
  // kSkinny has no fp8 kernel: the fp8 GEMMs of a stack run with kSkinny take kAuto's choice.
  if (version == GemmVersion::kAuto || version == GemmVersion::kSkinny) version = best_fp8_gemm_version(p.m, p.n, p.k);
  const bool fused_quant = p.a_bf16 != nullptr;
  const bool rope = p.rope_table != nullptr || p.rope_pos != nullptr;
  const bool qnorm = p.qnorm_x != nullptr || p.qnorm_w != nullptr;
  if (fused_quant && version != GemmVersion::kWgmmaPipelined) fail(who, "a_bf16 needs GemmVersion::kWgmmaPipelined");
  if (qnorm && version != GemmVersion::kWgmma) fail(who, "the fused q_norm (qnorm_x) needs GemmVersion::kWgmma");
  if (qnorm && fused_quant) fail(who, "qnorm_x and a_bf16 exclude each other");
  if (rope && version != GemmVersion::kWgmma) fail(who, "the fused RoPE store (rope_table) needs GemmVersion::kWgmma");
  if (p.prewait_stages < -1) fail(who, "prewait_stages must be >= -1 (-1: every stage of the first ring fill)");
  if (p.prewait_pace_ns < 0 || p.prewait_pace_ns > 100000) fail(who, "prewait_pace_ns must be in [0, 100000]");
  if (p.v2_overlap < -1 || p.v2_overlap > 2) fail(who, "v2_overlap must be -1 (default), 0, 1 or 2");
  if (p.m == 0) return;
  check_nk(who, p.n, p.k);
  check_rows_groups(who, p.m, p.groups);
  if (!p.w || !p.w_scale || !p.out) fail(who, "null pointer");
  if (fused_quant) {  // the GEMM quantises x itself
    if (p.a_q != nullptr || p.a_scale != nullptr) fail(who, "a_q and a_scale must be null when a_bf16 is set");
    if (p.groups != 1) fail(who, "the fused act quant takes groups == 1");
    if (p.a_bf16_stride < p.k) fail(who, "a_bf16_stride < k");
    if (!aligned_to(p.a_bf16, 16) || p.a_bf16_stride % 8 != 0)
      fail(who, "a_bf16 must be 16-byte aligned with a_bf16_stride % 8 == 0");
  } else if (qnorm) {  // the GEMM normalises and quantises x itself
    if (!p.qnorm_x || !p.qnorm_w) fail(who, "the fused q_norm needs qnorm_x and qnorm_w");
    if (p.qnorm_dist_bar != nullptr) {  // the distributed form writes a_q / a_scale, then reads them by TMA
      if (!p.a_q || !p.a_scale) fail(who, "the distributed q_norm writes a_q and a_scale: both must be set");
      if (p.a_stride < p.k || p.a_scale_stride < p.k / kGemmBlock) fail(who, "a_stride < k or a_scale_stride < k/32");
      if (!aligned_to(p.a_q, 16) || p.a_stride % 16 != 0) fail(who, "a_q must be 16-byte aligned with a_stride % 16 == 0");
      if (!aligned_to(p.qnorm_dist_bar, 8)) fail(who, "qnorm_dist_bar must be 8-byte aligned");
      if (p.qnorm_y != nullptr && (p.qnorm_y_stride < p.k || !aligned_to(p.qnorm_y, 16) || p.qnorm_y_stride % 8 != 0))
        fail(who, "qnorm_y must be 16-byte aligned with qnorm_y_stride >= k and % 8 == 0");
    } else if (p.a_q != nullptr || p.a_scale != nullptr) {
      fail(who, "a_q and a_scale must be null when qnorm_x is set (unless qnorm_dist_bar is)");
    }
    if (p.groups != 1 || p.force_splits != 0 || p.force_mtiles != 0)
      fail(who, "the fused q_norm takes groups == 1 and no plan overrides");
    if (p.qnorm_x_stride < p.k) fail(who, "qnorm_x_stride < k");
    if (!aligned_to(p.qnorm_x, 16) || p.qnorm_x_stride % 8 != 0)
      fail(who, "qnorm_x must be 16-byte aligned with qnorm_x_stride % 8 == 0");
    if (!aligned_to(p.qnorm_w, 16)) fail(who, "qnorm_w must be 16-byte aligned");
    if (p.k > 2048) fail(who, "the fused q_norm takes k <= 2048");
    if (!(p.qnorm_eps > 0.0f) || !std::isfinite(p.qnorm_eps)) fail(who, "qnorm_eps must be finite and > 0");
  } else {
    if (!p.a_q || !p.a_scale) fail(who, "null pointer");
    if (p.a_stride < p.k) fail(who, "a_stride < k");
    if (p.a_scale_stride < p.k / kGemmBlock) fail(who, "a_scale_stride < k/32");
    if (!aligned_to(p.a_q, 16) || p.a_stride % 16 != 0 || p.a_group_stride % 16 != 0)
      fail(who, "a_q must be 16-byte aligned with a_stride and a_group_stride multiples of 16");
  }
  if (rope) {
    if (!p.rope_pos || !p.rope_table || p.rope_max_pos <= 0)
      fail(who, "the fused RoPE store needs rope_pos, rope_table and rope_max_pos > 0");
    if (!aligned_to(p.rope_table, 16)) fail(who, "the fused RoPE store needs a 16-byte aligned rope_table");
    if (p.groups != 1 || p.force_splits != 0 || p.force_mtiles != 0)
      fail(who, "the fused RoPE store takes groups == 1 and no plan overrides");
    if (p.n % 512 != 0) fail(who, "the fused RoPE store needs whole heads of 512 columns");
  }
  if (p.out_stride < p.n) fail(who, "out_stride < n");
  if (!aligned_to(p.w, 16) || p.w_group_stride % 16 != 0) fail(who, "w must be 16-byte aligned with w_group_stride % 16 == 0");
  switch (version) {
    case GemmVersion::kAuto:
    case GemmVersion::kSkinny: break;  // resolved above
    case GemmVersion::kSimple: detail::launch_gemm_fp8_simple(p, stream, pdl); return;
    case GemmVersion::kGemv: {
      if (fused_quant || rope || qnorm) fail(who, "v6 gemv has no fused act quant, q_norm or RoPE store");
      if (p.force_splits != 0 || p.force_mtiles != 0 || p.force_stages != 0) fail(who, "v6 gemv takes no plan overrides");
      if (!gemm_gemv_supported(p.m, p.n, p.k, p.groups))
        fail(who, "v6 gemv takes 1 <= m <= " + std::to_string(kGemvMaxRows) + ", groups == 1 and k <= " +
                      std::to_string(kGemvMaxK) + " (<= " + std::to_string(kGemvMaxK / 2) + " above 8 rows) (got m " +
                      std::to_string(p.m) + ", groups " + std::to_string(p.groups) + ", k " + std::to_string(p.k) + ")");
      detail::launch_gemm_fp8_gemv(p, stream, pdl);
      return;
    }
    case GemmVersion::kTensorCore: {
      const GemmPlan plan = check_tc(who, version, p.m, p.n, p.k, p.groups, p.force_splits, p.force_mtiles, ws);
      detail::launch_gemm_fp8_tc(p, plan, ws, stream, pdl);
      return;
    }
    case GemmVersion::kWgmma: {
      if (p.force_stages < 0) fail(who, "force_stages < 0");
      const GemmPlan plan =
          check_tc(who, version, p.m, p.n, p.k, p.groups, p.force_splits, p.force_mtiles, ws, p.force_stages);
      if (rope && (plan.splits != 1 || plan.warp_mtiles != 2))
        fail(who, "the fused RoPE store needs v2's plan with one split and two m64 tiles per warpgroup "
                  "(gemm_v2_rope_store_supported)");
      if (qnorm && p.qnorm_dist_bar != nullptr) {
        if (!gemm_v2_qnorm_dist_supported(p.m, p.n, p.k))
          fail(who, "the distributed q_norm needs v2's plan with two m64 tiles per warpgroup, k <= 2048 and a grid the "
                    "SMs hold at once (gemm_v2_qnorm_dist_supported)");
      } else if (qnorm && !gemm_v2_qnorm_supported(p.m, p.n, p.k))
        fail(who, "the fused q_norm needs v2's plan with one split and two m64 tiles per warpgroup and its codes "
                  "in shared memory (gemm_v2_qnorm_supported)");
      detail::launch_gemm_fp8_wgmma(p, plan, ws, stream, pdl);
      return;
    }
    case GemmVersion::kWgmmaPipelined: {
      if (p.force_stages < 0) fail(who, "force_stages < 0");
      if (p.v3_int_mask < -1 || p.v3_int_mask > 15) fail(who, "v3_int_mask must be -1 (default) or 0..15");
      if (fused_quant) {  // every stage of a CTA writes its own ring slot: the ring must hold them all
        if (p.m > kGemmMaxRows) fail(who, "tensor-core versions take m <= 64 (got " + std::to_string(p.m) + ")");
        const GemmPlan plan =
            plan_gemm_wgmma_pipelined(p.m, p.n, p.k, 1, p.force_splits, p.force_mtiles, p.force_stages);
        const int need = detail::v3_max_cta_stages(plan, p.k);
        if (plan.stages < 1 || plan.stages < need)
          fail(who, "the fused act quant needs the whole K range of a CTA in its ring: " + std::to_string(need) +
                        " stages of 128 K, but the plan has " + std::to_string(plan.stages) +
                        " (see gemm_v3_fused_quant_supported)");
      }
      const GemmPlan plan =
          check_tc(who, version, p.m, p.n, p.k, p.groups, p.force_splits, p.force_mtiles, ws, p.force_stages);
      detail::launch_gemm_fp8_wgmma_pipelined(p, plan, stream, pdl);
      return;
    }
  }
  fail(who, "unknown version");
}

void run_gemm_fp8_fused_quant(const Fp8GemmParams& p, GemmVersion version, cudaStream_t stream, bool pdl) {
  if (p.a_bf16 == nullptr)
    throw std::invalid_argument("run_gemm_fp8_fused_quant: a_bf16 is null (use run_gemm_fp8 for quantised activations)");
  run_gemm_fp8(p, GemmWorkspace{}, version, stream, pdl);  // v3 needs no workspace
}

void run_gemm_fp8_qnorm(const Fp8GemmParams& p, cudaStream_t stream, bool pdl) {
  if (p.qnorm_x == nullptr) throw std::invalid_argument("run_gemm_fp8_qnorm: qnorm_x is null");
  run_gemm_fp8(p, GemmWorkspace{}, GemmVersion::kWgmma, stream, pdl);  // one split: no workspace
}

void run_gemm_fp8_rope_store(const Fp8GemmParams& p, cudaStream_t stream, bool pdl) {
  if (p.rope_table == nullptr) throw std::invalid_argument("run_gemm_fp8_rope_store: rope_table is null");
  run_gemm_fp8(p, GemmWorkspace{}, GemmVersion::kWgmma, stream, pdl);  // one split: no workspace
}

void run_gemm_bf16(const Bf16GemmParams& p, const GemmWorkspace& ws, GemmVersion version, cudaStream_t stream,
                   bool pdl) {
  const char* who = "run_gemm_bf16";
  if (p.m < 0) fail(who, "m < 0");
  if (p.m == 0) return;
  check_nk(who, p.n, p.k);
  check_rows_groups(who, p.m, p.groups);
  if (!p.x || !p.w || !p.out) fail(who, "null pointer");
  if (p.x_stride < p.k) fail(who, "x_stride < k");
  if (p.out_stride < p.n) fail(who, "out_stride < n");
  if (!aligned_to(p.x, 16) || p.x_stride % 8 != 0 || p.x_group_stride % 8 != 0)
    fail(who, "x must be 16-byte aligned with x_stride and x_group_stride multiples of 8");
  if (!aligned_to(p.w, 16) || p.w_group_stride % 8 != 0) fail(who, "w must be 16-byte aligned with w_group_stride % 8 == 0");
  const bool plain = p.groups == 1 && p.force_splits == 0 && p.force_mtiles == 0;
  if (!plain && (version == GemmVersion::kAuto || version == GemmVersion::kGemv))
    version = GemmVersion::kTensorCore;  // grouped calls and v1 plan overrides (tests, bench) keep v1
  version = bf16_gemm_version(version, p.m, p.n, p.k);
  switch (version) {
    case GemmVersion::kSimple: detail::launch_gemm_bf16_simple(p, stream, pdl); return;
    case GemmVersion::kSkinny: {
      if (p.m > kGemmMaxRows) fail(who, "v5 skinny takes m <= 64 (got " + std::to_string(p.m) + ")");
      if (p.force_splits < 0) fail(who, "force_splits < 0");
      if (p.force_mtiles != 0 && p.force_mtiles != 1 && p.force_mtiles != 2 && p.force_mtiles != 4)
        fail(who, "v5 skinny: force_mtiles must be 0, 1, 2 or 4 (got " + std::to_string(p.force_mtiles) + ")");
      const GemmPlan plan = plan_gemm_skinny(p.m, p.n, p.k, p.groups, false, p.force_splits, p.force_mtiles);
      detail::launch_gemm_bf16_skinny(p, plan, stream, pdl);
      return;
    }
    case GemmVersion::kTensorCore:
    case GemmVersion::kWgmma:
    case GemmVersion::kWgmmaPipelined:
    case GemmVersion::kGemv:
    case GemmVersion::kAuto: {  // no v2 / v3 of the bf16 GEMM: v1 (kAuto, kGemv: resolved above)
      const GemmPlan plan =
          check_tc(who, GemmVersion::kTensorCore, p.m, p.n, p.k, p.groups, p.force_splits, p.force_mtiles, ws);
      detail::launch_gemm_bf16_tc(p, plan, ws, stream, pdl);
      return;
    }
  }
  fail(who, "unknown version");
}

GemmVersion bf16_gemm_version(GemmVersion version, int m, int64_t n, int64_t k) {
  switch (version) {
    case GemmVersion::kSimple:
    case GemmVersion::kSkinny: return version;
    case GemmVersion::kAuto:
    case GemmVersion::kGemv:  // v6 is fp8 only: the bf16 choice
      return skinny_gemm_preferred(m, n, k) ? GemmVersion::kSkinny : GemmVersion::kTensorCore;
    case GemmVersion::kTensorCore:
    case GemmVersion::kWgmma:
    case GemmVersion::kWgmmaPipelined: return GemmVersion::kTensorCore;  // no v2 / v3 of the bf16 GEMM
  }
  return GemmVersion::kTensorCore;
}

void run_gemm_f32(const F32GemmParams& p, GemmVersion version, cudaStream_t stream, bool pdl) {
  const char* who = "run_gemm_f32";
  if (p.m < 0) fail(who, "m < 0");
  if (p.m == 0) return;
  if (p.n <= 0 || p.n % 4 != 0) fail(who, "n " + std::to_string(p.n) + " is not a positive multiple of 4");
  if (p.k <= 0 || p.k % 4 != 0) fail(who, "k " + std::to_string(p.k) + " is not a positive multiple of 4");
  if (p.n / 4 > 65535) fail(who, "n > 262140");
  if (p.m > 65535) fail(who, "m > 65535");
  if (!p.x || !p.w || !p.out) fail(who, "null pointer");
  if (p.x_stride < p.k) fail(who, "x_stride < k");
  if (p.out_stride < p.n) fail(who, "out_stride < n");
  if (!aligned_to(p.w, 16)) fail(who, "w must be 16-byte aligned");
  if (!aligned_to(p.x, 8) || p.x_stride % 4 != 0) fail(who, "x must be 8-byte aligned with x_stride % 4 == 0");
  if (p.force_splits < 0) fail(who, "force_splits < 0");
  if (p.v5_path < 0 || p.v5_path > 2 || (p.v5_path == 1 && p.m > kF32DirectMaxRows))
    fail(who, "v5_path must be 0, 1 (m <= " + std::to_string(kF32DirectMaxRows) + ") or 2 (got " +
                  std::to_string(p.v5_path) + " at m " + std::to_string(p.m) + ")");
  // kAuto: v5 (tensor cores) where f32_skinny_preferred and its requirements hold, else v1.
  if (version == GemmVersion::kGemv) version = GemmVersion::kAuto;  // v6 is fp8 only
  if (version == GemmVersion::kAuto)
    version = f32_skinny_preferred(p.m, p.n, p.k) && aligned_to(p.x, 16) && p.x_stride % 8 == 0 ? GemmVersion::kSkinny
                                                                                                : GemmVersion::kTensorCore;
  switch (version) {
    case GemmVersion::kSimple: detail::launch_gemm_f32_simple(p, stream, pdl); return;
    case GemmVersion::kSkinny: {
      if (p.m > kGemmMaxRows) fail(who, "v5 skinny takes m <= 64 (got " + std::to_string(p.m) + ")");
      if (p.k % kGemmBlock != 0) fail(who, "v5 skinny: k " + std::to_string(p.k) + " is not a multiple of 32");
      if (!aligned_to(p.x, 16) || p.x_stride % 8 != 0)
        fail(who, "v5 skinny: x must be 16-byte aligned with x_stride % 8 == 0");
      const GemmPlan plan = plan_gemm_skinny(p.m, p.n, p.k, 1, true, p.force_splits, 0);
      detail::launch_gemm_f32_skinny(p, plan, stream, pdl);
      return;
    }
    case GemmVersion::kTensorCore:
    case GemmVersion::kWgmma:
    case GemmVersion::kWgmmaPipelined:
    case GemmVersion::kGemv:
    case GemmVersion::kAuto: detail::launch_gemm_f32_warp(p, stream, pdl); return;  // no v2 / v3: v1 (kAuto: resolved above)
  }
  fail(who, "unknown version");
}

}  // namespace v4attn::kernels
