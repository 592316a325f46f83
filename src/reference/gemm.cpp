// CPU reference GEMMs (spec section 2, "Block-scaled FP8 GEMM" and the bf16 / fp32 linears).
//
// Every output element is computed by exactly one sequence of fp32 operations (the one the spec
// defines), independent of how the work is split: threads own whole output columns (weight rows),
// and the vectorised inner loops run 8 output columns side by side, each lane with its own
// accumulator in k order. So the result is the same for any thread count and any panel width.
#include "v4attn/reference/gemm.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <exception>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "reference/ref_internal.h"

namespace v4attn::ref {
namespace {

constexpr int64_t kBlock = 32;  // K-block of the fp8 GEMM and of act quant; N-block of weight scales
constexpr int kPanel = 8;       // weight rows decoded together (one vector lane each)
constexpr int kRowGroup = 4;    // activation rows processed together (independent accumulators)

std::atomic<int> g_gemm_threads{2};

[[noreturn]] void fail(const std::string& what) { throw std::invalid_argument(what); }

// 256-entry e4m3 -> fp32 table (the conversion itself is numerics.h's).
const std::array<float, 256>& e4m3_table() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int i = 0; i < 256; ++i) t[i] = num::f32_from_e4m3(static_cast<uint8_t>(i));
    return t;
  }();
  return table;
}

// Runs body(begin, end) over [0, count) panels, on up to gemm_threads() threads when the work is
// large enough to pay for a thread start. The split never changes a result (see file comment).
template <class Body>
void parallel_panels(int64_t count, int64_t work, Body body) {
  const int threads = static_cast<int>(std::min<int64_t>(gemm_threads(), count));
  if (threads <= 1 || work < (int64_t{1} << 21)) {
    body(int64_t{0}, count);
    return;
  }
  std::vector<std::thread> pool;
  std::exception_ptr error;
  std::atomic<bool> failed{false};
  for (int t = 1; t < threads; ++t) {
    const int64_t b = count * t / threads, e = count * (t + 1) / threads;
    pool.emplace_back([&, b, e] {
      try {
        body(b, e);
      } catch (...) {
        if (!failed.exchange(true)) error = std::current_exception();
      }
    });
  }
  try {
    body(int64_t{0}, count / threads);
  } catch (...) {
    if (!failed.exchange(true)) error = std::current_exception();
  }
  for (auto& th : pool) th.join();  // always joined: a joinable std::thread must not be destroyed
  if (error) std::rethrow_exception(error);
}

void check_out(const void* out, int64_t out_stride, int64_t n, const char* who) {
  if (out == nullptr) fail(std::string(who) + ": out is null");
  if (out_stride < n) fail(std::string(who) + ": out_stride " + std::to_string(out_stride) + " < n " + std::to_string(n));
}

void check_x(const void* x, int64_t m, int64_t k, int64_t x_stride, const char* who) {
  if (m < 0) fail(std::string(who) + ": negative row count");
  if (m > 0 && x == nullptr) fail(std::string(who) + ": x is null");
  if (x_stride < k) fail(std::string(who) + ": x_stride " + std::to_string(x_stride) + " < k " + std::to_string(k));
}

// Plain (unscaled) dense GEMM with one fp32 accumulator per output running over all of k in
// order: out[m][n] = sum_k a[m][k] * w[n][k]. `a` is fp32 [m, k] (already widened), the weight
// row panel is widened by `load_panel(n0, panel)` into panel[k][kPanel]. `store(m, n, acc)`.
template <class LoadPanel, class Store>
void dense_gemm(const std::vector<float>& a, int64_t m, int64_t n, int64_t k, LoadPanel load_panel, Store store) {
  const int64_t panels = (n + kPanel - 1) / kPanel;
  parallel_panels(panels, m * n * k, [&](int64_t p_begin, int64_t p_end) {
    std::vector<float> panel(static_cast<size_t>(k) * kPanel);
    for (int64_t p = p_begin; p < p_end; ++p) {
      const int64_t n0 = p * kPanel;
      load_panel(n0, panel.data());
      for (int64_t m0 = 0; m0 < m; m0 += kRowGroup) {
        const int rows = static_cast<int>(std::min<int64_t>(kRowGroup, m - m0));
        float acc[kRowGroup][kPanel] = {};
        for (int64_t kk = 0; kk < k; ++kk) {
          const float* wk = panel.data() + kk * kPanel;
          for (int r = 0; r < kRowGroup; ++r) {
            const float av = a[static_cast<size_t>((m0 + (r < rows ? r : 0)) * k + kk)];
            for (int j = 0; j < kPanel; ++j) acc[r][j] = num::add_rn(acc[r][j], num::mul_rn(av, wk[j]));
          }
        }
        for (int r = 0; r < rows; ++r)
          for (int j = 0; j < kPanel && n0 + j < n; ++j) store(m0 + r, n0 + j, acc[r][j]);
      }
    }
  });
}

}  // namespace

int gemm_threads() { return g_gemm_threads.load(); }
void set_gemm_threads(int threads) { g_gemm_threads.store(std::max(1, threads)); }

ActQuant act_quant(const bf16_t* x, int64_t m, int64_t k, int64_t x_stride) {
  check_x(x, m, k, x_stride, "act_quant");
  if (k % kBlock != 0) fail("act_quant: k " + std::to_string(k) + " is not a multiple of 32");
  ActQuant out;
  out.m = m;
  out.k = k;
  out.q.resize(static_cast<size_t>(m * k));
  out.scale.resize(static_cast<size_t>(m * (k / kBlock)));
  for (int64_t r = 0; r < m; ++r) {
    const bf16_t* row = x + r * x_stride;
    for (int64_t b = 0; b < k / kBlock; ++b) {
      float v[kBlock];
      float amax = 0.0f;
      for (int i = 0; i < kBlock; ++i) {
        v[i] = num::f32_from_bf16(row[b * kBlock + i]);
        amax = num::block_amax_step(amax, v[i]);
      }
      const int e = num::act_quant_scale_exp(amax);
      const float s = num::pow2_f32(e);
      for (int i = 0; i < kBlock; ++i) out.q[static_cast<size_t>(r * k + b * kBlock + i)] = num::act_quant_code(v[i], s);
      out.scale[static_cast<size_t>(r * (k / kBlock) + b)] = num::ue8m0_from_exp(e);
    }
  }
  return out;
}

void gemm_fp8(const ActQuant& a, const Fp8Matrix& w, bf16_t* out, int64_t out_stride) {
  const int64_t m = a.m, n = w.n, k = w.k;
  if (a.k != k) fail("gemm_fp8: activation k " + std::to_string(a.k) + " != weight k " + std::to_string(k));
  if (k % kBlock != 0) fail("gemm_fp8: k " + std::to_string(k) + " is not a multiple of 32");
  const int64_t kb = k / kBlock, nb = (n + kBlock - 1) / kBlock;
  if (static_cast<int64_t>(a.q.size()) != m * k || static_cast<int64_t>(a.scale.size()) != m * kb)
    fail("gemm_fp8: activation arrays do not match m x k");
  if (static_cast<int64_t>(w.w.size()) != n * k || static_cast<int64_t>(w.scale.size()) != nb * kb)
    fail("gemm_fp8: weight arrays do not match n x k (scales ceil(n/32) x k/32)");
  if (m > 0 && n > 0) check_out(out, out_stride, n, "gemm_fp8");
  if (m == 0 || n == 0) return;

  const auto& lut = e4m3_table();
  std::vector<float> af(static_cast<size_t>(m * k)), sa(static_cast<size_t>(m * kb));
  for (size_t i = 0; i < af.size(); ++i) af[i] = lut[a.q[i]];
  for (size_t i = 0; i < sa.size(); ++i) sa[i] = num::f32_from_ue8m0(a.scale[i]);

  // A panel of 8 weight rows never straddles a 32-row scale block (32 % 8 == 0), so the whole
  // panel shares one weight scale per K-block.
  static_assert(kBlock % kPanel == 0);
  const int64_t panels = (n + kPanel - 1) / kPanel;
  parallel_panels(panels, m * n * k, [&](int64_t p_begin, int64_t p_end) {
    std::vector<float> panel(static_cast<size_t>(k) * kPanel);
    for (int64_t p = p_begin; p < p_end; ++p) {
      const int64_t n0 = p * kPanel;
      for (int j = 0; j < kPanel; ++j) {
        const bool live = n0 + j < n;
        const uint8_t* wr = live ? w.w.data() + (n0 + j) * k : nullptr;
        for (int64_t kk = 0; kk < k; ++kk) panel[static_cast<size_t>(kk * kPanel + j)] = live ? lut[wr[kk]] : 0.0f;
      }
      const uint8_t* sw_row = w.scale.data() + (n0 / kBlock) * kb;
      for (int64_t m0 = 0; m0 < m; m0 += kRowGroup) {
        const int rows = static_cast<int>(std::min<int64_t>(kRowGroup, m - m0));
        float acc[kRowGroup][kPanel] = {};
        for (int64_t b = 0; b < kb; ++b) {
          float bs[kRowGroup][kPanel] = {};
          for (int64_t kk = b * kBlock; kk < (b + 1) * kBlock; ++kk) {
            const float* wk = panel.data() + kk * kPanel;
            for (int r = 0; r < kRowGroup; ++r) {
              const float av = af[static_cast<size_t>((m0 + (r < rows ? r : 0)) * k + kk)];
              for (int j = 0; j < kPanel; ++j) bs[r][j] = num::add_rn(bs[r][j], num::mul_rn(av, wk[j]));
            }
          }
          const float swb = num::f32_from_ue8m0(sw_row[b]);
          for (int r = 0; r < kRowGroup; ++r) {
            const float sab = sa[static_cast<size_t>((m0 + (r < rows ? r : 0)) * kb + b)];
            for (int j = 0; j < kPanel; ++j)
              acc[r][j] = num::add_rn(acc[r][j], num::mul_rn(num::mul_rn(bs[r][j], sab), swb));
          }
        }
        for (int r = 0; r < rows; ++r)
          for (int j = 0; j < kPanel && n0 + j < n; ++j) out[(m0 + r) * out_stride + n0 + j] = num::bf16_from_f32(acc[r][j]);
      }
    }
  });
}

void gemm_fp8(const bf16_t* x, int64_t m, int64_t x_stride, const Fp8Matrix& w, bf16_t* out, int64_t out_stride) {
  gemm_fp8(act_quant(x, m, w.k, x_stride), w, out, out_stride);
}

namespace {
// The bf16- and fp32-weight linears: x (bf16 rows) widened to fp32 once, the weight panels widened
// by `weight_f32`, each fp32 output element stored by `store` (rounded to bf16 or kept).
template <class Matrix, class Out, class WeightF32, class Store>
void dense_linear(const bf16_t* x, int64_t m, int64_t x_stride, const Matrix& w, Out* out, int64_t out_stride,
                  const char* who, WeightF32 weight_f32, Store store) {
  const int64_t n = w.n, k = w.k;
  check_x(x, m, k, x_stride, who);
  if (static_cast<int64_t>(w.w.size()) != n * k) fail(std::string(who) + ": weight array does not match n x k");
  if (m == 0 || n == 0) return;
  check_out(out, out_stride, n, who);
  std::vector<float> a(static_cast<size_t>(m * k));
  for (int64_t r = 0; r < m; ++r)
    for (int64_t kk = 0; kk < k; ++kk) a[static_cast<size_t>(r * k + kk)] = num::f32_from_bf16(x[r * x_stride + kk]);
  dense_gemm(
      a, m, n, k,
      [&](int64_t n0, float* panel) {
        for (int j = 0; j < kPanel; ++j)
          for (int64_t kk = 0; kk < k; ++kk)
            panel[kk * kPanel + j] = n0 + j < n ? weight_f32(w.w[static_cast<size_t>((n0 + j) * k + kk)]) : 0.0f;
      },
      [&](int64_t r, int64_t c, float v) { out[r * out_stride + c] = store(v); });
}
}  // namespace

void gemm_bf16(const bf16_t* x, int64_t m, int64_t x_stride, const Bf16Matrix& w, bf16_t* out, int64_t out_stride) {
  dense_linear(x, m, x_stride, w, out, out_stride, "gemm_bf16", [](bf16_t v) { return num::f32_from_bf16(v); },
               [](float v) { return num::bf16_from_f32(v); });
}

void gemm_f32(const bf16_t* x, int64_t m, int64_t x_stride, const F32Matrix& w, float* out, int64_t out_stride) {
  dense_linear(x, m, x_stride, w, out, out_stride, "gemm_f32", [](float v) { return v; }, [](float v) { return v; });
}

std::vector<float> dequant_fp8(const Fp8Matrix& w) {
  const int64_t kb = w.k / kBlock, nb = (w.n + kBlock - 1) / kBlock;
  if (w.k % kBlock != 0 || static_cast<int64_t>(w.w.size()) != w.n * w.k ||
      static_cast<int64_t>(w.scale.size()) != nb * kb)
    fail("dequant_fp8: arrays do not match n x k (k a multiple of 32)");
  const auto& lut = e4m3_table();
  std::vector<float> out(w.w.size());
  for (int64_t r = 0; r < w.n; ++r)
    for (int64_t c = 0; c < w.k; ++c) {
      const float s = num::f32_from_ue8m0(w.scale[static_cast<size_t>((r / kBlock) * kb + c / kBlock)]);
      out[static_cast<size_t>(r * w.k + c)] = num::mul_rn(lut[w.w[static_cast<size_t>(r * w.k + c)]], s);
    }
  return out;
}

namespace {

// Memo of num::e4m3_from_f32 for the quantiser of large weight matrices. Round-to-nearest-even
// to 3 mantissa bits (or to a subnormal step, which is coarser) depends only on the sign, the
// exponent, the top 7 mantissa bits (they hold the kept bits and the round bit) and whether any
// lower bit is set (sticky). So the code of an fp32 with bits u is the code of the representative
// (u & 0xffff0000) | (low 16 bits != 0): a 2^17-entry table filled by e4m3_from_f32 itself.
const std::vector<uint8_t>& e4m3_memo() {
  static const std::vector<uint8_t> memo = [] {
    std::vector<uint8_t> t(size_t{1} << 17);
    for (uint32_t i = 0; i < t.size(); ++i) t[i] = num::e4m3_from_f32(num::f32_from_bits(((i >> 1) << 16) | (i & 1u)));
    return t;
  }();
  return memo;
}
uint8_t e4m3_memo_code(const std::vector<uint8_t>& memo, float v) {
  const uint32_t u = num::f32_bits(v);
  return memo[((u >> 16) << 1) | ((u & 0xffffu) != 0 ? 1u : 0u)];
}

}  // namespace

void quantize_fp8_strip(const float* w, int64_t rows, int64_t k, uint8_t* codes, uint8_t* scales) {
  if (rows < 1 || rows > kBlock || k % kBlock != 0) fail("quantize_fp8_strip: rows must be 1..32 and k a multiple of 32");
  const std::vector<uint8_t>& memo = e4m3_memo();
  for (int64_t b = 0; b < k / kBlock; ++b) {
    // = num::block_amax_step over the block: std::max(a, |x|) also skips a NaN x (a never is NaN).
    float amax = 0.0f;
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = b * kBlock; c < (b + 1) * kBlock; ++c) amax = std::max(amax, num::abs_f(w[r * k + c]));
    const int e = num::act_quant_scale_exp(amax);
    scales[b] = num::ue8m0_from_exp(e);
    // = num::act_quant_code(x, 2^e) (num::div_by_scale: x * 2^-e where that is exact), the e4m3
    // conversion through the memo above.
    const float s = num::pow2_f32(e);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = b * kBlock; c < (b + 1) * kBlock; ++c) {
        const float v = num::div_by_scale(w[r * k + c], s);
        codes[r * k + c] = e4m3_memo_code(memo, num::clamp_f(v, -num::kE4m3Max, num::kE4m3Max));
      }
  }
}

Fp8Matrix quantize_fp8_blocks(const std::vector<float>& w, int64_t n, int64_t k) {
  if (n < 0 || k < 0 || k % kBlock != 0) fail("quantize_fp8_blocks: k must be a multiple of 32");
  if (static_cast<int64_t>(w.size()) != n * k) fail("quantize_fp8_blocks: w.size() != n * k");
  Fp8Matrix out;
  out.n = n;
  out.k = k;
  out.w.resize(static_cast<size_t>(n * k));
  const int64_t nb = (n + kBlock - 1) / kBlock;
  out.scale.resize(static_cast<size_t>(nb * (k / kBlock)));
  for (int64_t s = 0; s < nb; ++s) {
    const int64_t r0 = s * kBlock, rows = std::min(kBlock, n - r0);
    quantize_fp8_strip(w.data() + r0 * k, rows, k, out.w.data() + r0 * k, out.scale.data() + s * (k / kBlock));
  }
  return out;
}

}  // namespace v4attn::ref
