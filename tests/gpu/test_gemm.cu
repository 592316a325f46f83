// GPU GEMMs (include/v4attn/kernels/gemm.h) against the CPU reference (reference/gemm.h).
//
// Two kinds of data:
//  - exact: small integers (fp8: codes in -7..7, scales 2^0..2^2) for which every fp32 sum in
//    every order is exact, so v1 must equal the reference BYTE FOR BYTE whatever its summation
//    order: any indexing, layout, split-K or fragment bug shows up as a mismatch;
//  - realistic: wide-range random codes / values; v0 must be byte-identical to the reference (same
//    order), v1 and v2 within 1 bf16 ulp (spec section 6) except where the terms cancel (then within
//    2^-16 of the row's largest output; counted and bounded too), and the fraction of elements
//    that differ is printed and bounded (<= 1%).
// v2 (kWgmma, fp8 only) is checked on every real shape, on small shapes that reach every path
// (every token padding NP = 8..64, one and two m64 tiles per warpgroup, partial tiles in n, forced
// splits, partial last stages, TMA ring and f16 ring wrap-around, forced shallow rings, groups),
// for determinism of its split-K reduction, and for refusing bad arguments. v3
// (kWgmmaPipelined) the same, plus: cluster split-K with every S = 2..8, partial last stages and
// absent second stages of its 8-unit iterations (dummy units), every integer / cvt widening mask,
// output strides that allow 16-byte, 8-byte or only scalar stores, and e4m3 subnormal codes
// (exact data made of subnormal weights or activations: the integer widening turns subnormal
// weights into f16 subnormals, which the tensor core must take as they are).
// Every output buffer has extra rows and a row stride > n, poisoned (0xAB) before each call;
// everything outside [0, m) x [0, n) must still be poison afterwards.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "gpu_test_util.h"
#include "v4attn/kernels/gemm.h"
#include "v4attn/kernels/norm_kernels.h"
#include "v4attn/kernels/prepare_kernels.h"
#include "v4attn/reference/gemm.h"

namespace {

using namespace v4attn;
using namespace v4attn::kernels;
using num::bf16_t;

constexpr int kPoisonByte = 0xAB;
constexpr bf16_t kPoisonBf16 = 0xABAB;
constexpr int kAllM[] = {1, 6, 8, 24, 48, 64};

void use_all_cores() { ref::set_gemm_threads(static_cast<int>(std::max(2u, std::thread::hardware_concurrency()))); }

// splitmix64: fast, seeded, plenty for test data.
struct Rng {
  uint64_t s;
  explicit Rng(uint64_t seed) : s(seed * 0x9E3779B97F4A7C15ull + 12345) {}
  uint64_t next() {
    uint64_t z = (s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  float uniform() { return static_cast<float>(static_cast<double>(next() >> 11) * 0x1.0p-53 * 2.0 - 1.0); }  // [-1, 1)
  int range(int lo, int hi) { return lo + static_cast<int>(next() % static_cast<uint64_t>(hi - lo + 1)); }
};

// kSubnormalW / kSubnormalA: exact data (every sum exact in fp32) whose weight / activation codes
// are all e4m3 subnormals (+-k * 2^-9, k = 0..7) and whose other operand is an integer in -7..7.
enum class Data { kExact, kRealistic, kSubnormalW, kSubnormalA };

uint8_t e4m3_subnormal_code(int k) { return static_cast<uint8_t>((k < 0 ? 0x80 : 0x00) | std::abs(k)); }  // k * 2^-9

ref::Fp8Matrix make_fp8_weight(int64_t n, int64_t k, Data d, uint64_t seed) {
  Rng rng(seed);
  ref::Fp8Matrix w;
  w.n = n;
  w.k = k;
  w.w.resize(static_cast<size_t>(n * k));
  w.scale.resize(static_cast<size_t>(((n + 31) / 32) * (k / 32)));
  for (auto& c : w.w)
    c = d == Data::kRealistic    ? num::e4m3_from_f32(rng.uniform() * 448.0f * std::fabs(rng.uniform()))
        : d == Data::kSubnormalW ? e4m3_subnormal_code(rng.range(-7, 7))
                                 : num::e4m3_from_f32(static_cast<float>(rng.range(-7, 7)));
  for (auto& s : w.scale) s = static_cast<uint8_t>(127 + (d != Data::kRealistic ? rng.range(0, 2) : rng.range(-14, -6)));
  return w;
}

// Exact-regime activations given directly as codes + scales (scales 2^0..2^1); codes integers in
// -7..7, or subnormals +-k * 2^-9.
ref::ActQuant make_exact_act(int m, int64_t k, uint64_t seed, bool subnormal = false) {
  Rng rng(seed);
  ref::ActQuant a;
  a.m = m;
  a.k = k;
  a.q.resize(static_cast<size_t>(m * k));
  a.scale.resize(static_cast<size_t>(m * (k / 32)));
  for (auto& c : a.q)
    c = subnormal ? e4m3_subnormal_code(rng.range(-7, 7)) : num::e4m3_from_f32(static_cast<float>(rng.range(-7, 7)));
  for (auto& s : a.scale) s = static_cast<uint8_t>(127 + rng.range(0, 1));
  return a;
}

// bf16 rows [m, stride] (columns >= k hold junk that must never be read into the result).
std::vector<bf16_t> make_x(int m, int64_t k, int64_t stride, Data d, uint64_t seed) {
  Rng rng(seed);
  std::vector<bf16_t> x(static_cast<size_t>(m * stride));
  for (int r = 0; r < m; ++r) {
    for (int64_t b = 0; b < (k + 31) / 32; ++b) {
      const int e = rng.range(-6, 3);
      const bool zero_block = d == Data::kRealistic && rng.range(0, 15) == 0;  // exercises the amax floor
      for (int64_t c = b * 32; c < std::min(k, b * 32 + 32); ++c) {
        float v;
        if (d == Data::kExact) v = static_cast<float>(rng.range(-8, 8));
        else v = zero_block ? 0.0f : std::ldexp(rng.uniform(), e);
        x[static_cast<size_t>(r * stride + c)] = num::bf16_from_f32(v);
      }
    }
    for (int64_t c = k; c < stride; ++c) x[static_cast<size_t>(r * stride + c)] = num::bf16_from_f32(1.0e30f);
  }
  return x;
}

ref::Bf16Matrix make_bf16_weight(int64_t n, int64_t k, Data d, uint64_t seed) {
  Rng rng(seed);
  ref::Bf16Matrix w;
  w.n = n;
  w.k = k;
  w.w.resize(static_cast<size_t>(n * k));
  for (auto& v : w.w)
    v = num::bf16_from_f32(d == Data::kExact ? static_cast<float>(rng.range(-8, 8)) : std::ldexp(rng.uniform(), rng.range(-8, -4)));
  return w;
}

ref::F32Matrix make_f32_weight(int64_t n, int64_t k, Data d, uint64_t seed) {
  Rng rng(seed);
  ref::F32Matrix w;
  w.n = n;
  w.k = k;
  w.w.resize(static_cast<size_t>(n * k));
  for (auto& v : w.w) v = d == Data::kExact ? static_cast<float>(rng.range(-8, 8)) : rng.uniform() * 0.015625f;
  return w;
}

using test_util::to_device;
using test_util::to_host;

int32_t bf16_ordinal(bf16_t b) {
  const int32_t mag = b & 0x7fff;
  return (b & 0x8000) ? -mag : mag;
}

// Output layout: rows_alloc rows of `stride` elements; group g's [m, n] block starts at column
// g * group_stride. Everything else is poison.
struct OutLayout {
  int m = 0, rows_alloc = 0, groups = 1;
  int64_t n = 0, stride = 0, group_stride = 0;
  size_t elems() const { return static_cast<size_t>(rows_alloc) * static_cast<size_t>(stride); }
};
// pad: extra columns per row (24: the row stride is a multiple of 8 elements, 16-byte rows; 28:
// of 4 only; 25: odd -- v3 picks 16-byte, 8-byte or scalar output stores by the stride).
OutLayout make_layout(int m, int64_t n, int groups = 1, int pad = 24) {
  OutLayout l;
  l.m = m;
  l.n = n;
  l.groups = groups;
  l.group_stride = n;
  l.rows_alloc = m + 2;                // rows m, m+1 must stay poison
  l.stride = groups * n + pad;         // columns past the last group must stay poison
  return l;
}

struct DiffStats {
  int64_t total = 0, differ = 0;
  int64_t cancelled = 0;  // > 1 ulp apart, but by less than the cancellation tolerance (see below)
  int max_ulps = 0;       // over the elements that are not `cancelled`
  void add(const DiffStats& o) {
    total += o.total;
    differ += o.differ;
    cancelled += o.cancelled;
    max_ulps = std::max(max_ulps, o.max_ulps);
  }
};

// Checks a bf16 output against want(g, r, c): at most max_ulps bf16 ulps everywhere in the
// written region, poison everywhere else. Reports the first failures, returns the statistics.
// With `tolerant` (realistic data, max_ulps == 1): an output whose terms cancel can move by more
// than 1 ulp under another fp32 summation order; such an element is accepted when
// |got - want| <= 2^-16 * max_c |want(g, r, c)| (a reordering error is ~2^-23 of the partial
// sums; a real bug, e.g. a lost K block, is ~1/sqrt(blocks) of them). They are counted apart.
DiffStats check_bf16(const std::vector<bf16_t>& got, const OutLayout& l, const std::function<bf16_t(int, int, int64_t)>& want,
                     int max_ulps, const std::string& what, bool tolerant = false) {
  DiffStats st;
  std::vector<char> in_region(l.elems(), 0);
  int reported = 0;
  for (int g = 0; g < l.groups; ++g)
    for (int r = 0; r < l.m; ++r) {
      double row_scale = 0.0;
      if (tolerant)
        for (int64_t c = 0; c < l.n; ++c) row_scale = std::max(row_scale, std::fabs(static_cast<double>(num::f32_from_bf16(want(g, r, c)))));
      for (int64_t c = 0; c < l.n; ++c) {
        const size_t idx = static_cast<size_t>(r * l.stride + g * l.group_stride + c);
        in_region[idx] = 1;
        const bf16_t w = want(g, r, c), o = got[idx];
        const int ulps = std::abs(bf16_ordinal(o) - bf16_ordinal(w));
        ++st.total;
        if (o != w) ++st.differ;
        if (tolerant && ulps > max_ulps &&
            std::fabs(static_cast<double>(num::f32_from_bf16(o)) - static_cast<double>(num::f32_from_bf16(w))) <=
                0x1.0p-16 * row_scale) {
          ++st.cancelled;
          continue;
        }
        st.max_ulps = std::max(st.max_ulps, ulps);
        if (ulps > max_ulps && reported++ < 8)
          ADD_FAILURE() << what << ": group " << g << " row " << r << " col " << c << ": got 0x" << std::hex << o
                        << " want 0x" << w << std::dec << " (" << ulps << " ulps)";
      }
    }
  for (size_t i = 0; i < got.size(); ++i)
    if (!in_region[i] && got[i] != kPoisonBf16 && reported++ < 8)
      ADD_FAILURE() << what << ": element " << i << " (row " << i / l.stride << ", col " << i % l.stride
                    << ") outside the output was written";
  return st;
}

void expect_realistic_stats(const DiffStats& st, const std::string& what) {
  std::printf("[ gemm ] %-48s %8lld elements, %6lld differ (%.4f%%), %lld by > 1 ulp within the cancellation tolerance\n",
              what.c_str(), static_cast<long long>(st.total), static_cast<long long>(st.differ),
              st.total ? 100.0 * static_cast<double>(st.differ) / static_cast<double>(st.total) : 0.0,
              static_cast<long long>(st.cancelled));
  EXPECT_LE(st.max_ulps, 1) << what;
  EXPECT_LE(st.differ, std::max<int64_t>(2, st.total / 100)) << what << ": more than 1% of the elements differ";
  EXPECT_LE(st.cancelled, std::max<int64_t>(2, st.total / 10000)) << what << ": too many large (cancellation) differences";
}

// ---- fp8 harness ----------------------------------------------------------------------------------
struct Fp8Case {
  int64_t n = 0, k = 0;
  int groups = 1;
  int force_splits = 0, force_mtiles = 0;
  int force_stages = 0;  // v2, v3 only
  int int_mask = -1;     // v3 only (Fp8GemmParams::v3_int_mask)
};

// One fp8 problem: weights (per group, stacked in one device buffer) and activations (act codes
// either from run_act_quant_fp8 on realistic bf16 x, checked against ref::act_quant byte for
// byte, or uploaded directly in the exact regime). Groups' activation rows are stacked.
struct Fp8Weights {
  Fp8Case cs;
  std::vector<ref::Fp8Matrix> w;  // per group
  DeviceBuffer<uint8_t> d_w, d_ws;
};
struct Fp8Acts {
  int m = 0;
  int64_t a_stride = 0, a_scale_stride = 0;
  std::vector<ref::ActQuant> act;  // per group
  DeviceBuffer<uint8_t> d_aq, d_as;
};

Fp8Weights make_fp8_weights(const Fp8Case& cs, Data d, uint64_t seed) {
  Fp8Weights w;
  w.cs = cs;
  std::vector<uint8_t> hw, hws;
  for (int g = 0; g < cs.groups; ++g) {
    w.w.push_back(make_fp8_weight(cs.n, cs.k, d, seed * 7 + g));
    hw.insert(hw.end(), w.w.back().w.begin(), w.w.back().w.end());
    hws.insert(hws.end(), w.w.back().scale.begin(), w.w.back().scale.end());
  }
  w.d_w = to_device(hw);
  w.d_ws = to_device(hws);
  return w;
}

Fp8Acts make_fp8_acts(const Fp8Case& cs, int m, Data d, uint64_t seed) {
  Fp8Acts a;
  a.m = m;
  const int64_t k = cs.k, kb = k / 32;
  a.a_stride = k + 48;  // > k, a multiple of 16
  a.a_scale_stride = kb + 3;
  const size_t rows = static_cast<size_t>(cs.groups) * static_cast<size_t>(m);
  a.d_aq.resize(rows * static_cast<size_t>(a.a_stride));
  a.d_as.resize(rows * static_cast<size_t>(a.a_scale_stride));
  a.d_aq.fill_bytes(kPoisonByte);
  a.d_as.fill_bytes(kPoisonByte);
  if (d != Data::kRealistic) {
    std::vector<uint8_t> hq(a.d_aq.size(), kPoisonByte), hs(a.d_as.size(), kPoisonByte);
    for (int g = 0; g < cs.groups; ++g) {
      a.act.push_back(make_exact_act(m, k, seed * 13 + g, d == Data::kSubnormalA));
      for (int r = 0; r < m; ++r) {
        std::copy_n(a.act.back().q.begin() + r * k, k, hq.begin() + (g * m + r) * a.a_stride);
        std::copy_n(a.act.back().scale.begin() + r * kb, kb, hs.begin() + (g * m + r) * a.a_scale_stride);
      }
    }
    a.d_aq.upload(hq.data(), hq.size());
    a.d_as.upload(hs.data(), hs.size());
    return a;
  }
  const int64_t x_stride = k + 40;
  for (int g = 0; g < cs.groups; ++g) {
    const std::vector<bf16_t> x = make_x(m, k, x_stride, d, seed * 13 + g);
    a.act.push_back(ref::act_quant(x.data(), m, k, x_stride));
    DeviceBuffer<bf16_t> dx = to_device(x);
    ActQuantParams aq;
    aq.x = dx.get();
    aq.x_stride = x_stride;
    aq.q = a.d_aq.get() + static_cast<size_t>(g) * m * a.a_stride;
    aq.q_stride = a.a_stride;
    aq.scale = a.d_as.get() + static_cast<size_t>(g) * m * a.a_scale_stride;
    aq.scale_stride = a.a_scale_stride;
    aq.m = m;
    aq.k = k;
    run_act_quant_fp8(aq, nullptr, false);
    V4_CUDA_CHECK(cudaDeviceSynchronize());
  }
  // The act quant must reproduce ref::act_quant byte for byte (and leave the stride gaps alone).
  const std::vector<uint8_t> hq = to_host(a.d_aq), hs = to_host(a.d_as);
  int bad = 0;
  for (int g = 0; g < cs.groups; ++g)
    for (int r = 0; r < m; ++r) {
      for (int64_t c = 0; c < a.a_stride; ++c) {
        const uint8_t got = hq[static_cast<size_t>((g * m + r) * a.a_stride + c)];
        const uint8_t want = c < k ? a.act[g].q[static_cast<size_t>(r * k + c)] : kPoisonByte;
        if (got != want && bad++ < 5) ADD_FAILURE() << "act codes g" << g << " r" << r << " c" << c;
      }
      for (int64_t c = 0; c < a.a_scale_stride; ++c) {
        const uint8_t got = hs[static_cast<size_t>((g * m + r) * a.a_scale_stride + c)];
        const uint8_t want = c < kb ? a.act[g].scale[static_cast<size_t>(r * kb + c)] : kPoisonByte;
        if (got != want && bad++ < 5) ADD_FAILURE() << "act scales g" << g << " r" << r << " c" << c;
      }
    }
  return a;
}

Fp8GemmParams fp8_params(const Fp8Weights& w, const Fp8Acts& a, bf16_t* out, const OutLayout& l) {
  Fp8GemmParams g;
  const int64_t k = w.cs.k, n = w.cs.n, kb = k / 32;
  g.a_q = a.d_aq.get();
  g.a_stride = a.a_stride;
  g.a_scale = a.d_as.get();
  g.a_scale_stride = a.a_scale_stride;
  g.w = w.d_w.get();
  g.w_scale = w.d_ws.get();
  g.out = out;
  g.out_stride = l.stride;
  g.m = a.m;
  g.n = n;
  g.k = k;
  g.groups = w.cs.groups;
  g.a_group_stride = a.m * a.a_stride;  // groups stacked: group g's rows follow group g-1's
  g.a_scale_group_stride = a.m * a.a_scale_stride;
  g.w_group_stride = n * k;
  g.w_scale_group_stride = ((n + 31) / 32) * kb;
  g.out_group_stride = l.group_stride;
  g.force_splits = w.cs.force_splits;
  g.force_mtiles = w.cs.force_mtiles;
  g.force_stages = w.cs.force_stages;
  g.v3_int_mask = w.cs.int_mask;
  return g;
}

GemmPlan fp8_plan(const Fp8Case& cs, int m, GemmVersion v) {
  if (v == GemmVersion::kWgmma) return plan_gemm_wgmma(m, cs.n, cs.k, cs.groups, cs.force_splits, cs.force_mtiles, cs.force_stages);
  if (v == GemmVersion::kWgmmaPipelined)
    return plan_gemm_wgmma_pipelined(m, cs.n, cs.k, cs.groups, cs.force_splits, cs.force_mtiles, cs.force_stages);
  return plan_gemm(v, m, cs.n, cs.k, cs.groups, cs.force_splits, cs.force_mtiles);
}

// Runs one version (fresh workspace), returns the whole (poisoned-before) output buffer.
std::vector<bf16_t> run_fp8(const Fp8Weights& w, const Fp8Acts& a, const OutLayout& l, GemmVersion v, bool pdl = false) {
  DeviceBuffer<bf16_t> out(l.elems());
  out.fill_bytes(kPoisonByte);
  const GemmPlan plan = fp8_plan(w.cs, a.m, v);
  DeviceBuffer<uint8_t> ws(std::max<size_t>(plan.workspace_bytes, 1));
  const GemmWorkspace gws{ws.get(), plan.workspace_bytes};
  init_gemm_workspace(gws, nullptr);
  run_gemm_fp8(fp8_params(w, a, out.get(), l), gws, v, nullptr, pdl);
  V4_CUDA_CHECK(cudaDeviceSynchronize());
  return to_host(out);
}

// Reference outputs per group, dense [m, n].
std::vector<std::vector<bf16_t>> ref_fp8(const Fp8Weights& w, const Fp8Acts& a) {
  std::vector<std::vector<bf16_t>> out;
  for (int g = 0; g < w.cs.groups; ++g) {
    out.emplace_back(static_cast<size_t>(a.m * w.cs.n));
    ref::gemm_fp8(a.act[g], w.w[g], out.back().data(), w.cs.n);
  }
  return out;
}

std::function<bf16_t(int, int, int64_t)> dense_want(const std::vector<std::vector<bf16_t>>& want, int64_t n) {
  return [&want, n](int g, int r, int64_t c) { return want[g][static_cast<size_t>(r * n + c)]; };
}

std::string fp8_name(const Fp8Case& cs, int m) {
  return "fp8 " + std::to_string(cs.n) + "x" + std::to_string(cs.k) + (cs.groups > 1 ? " g" + std::to_string(cs.groups) : "") +
         " m" + std::to_string(m) + (cs.force_splits ? " S" + std::to_string(cs.force_splits) : "") +
         (cs.force_mtiles ? " MT" + std::to_string(cs.force_mtiles) : "") +
         (cs.force_stages ? " ST" + std::to_string(cs.force_stages) : "") +
         (cs.int_mask >= 0 ? " int" + std::to_string(cs.int_mask) : "");
}

// The model's fp8 shapes; wq_b (TP1) and wo_b are checked at fewer m (the CPU reference costs
// m * 42 M MACs).
struct RealFp8Shape {
  const char* name;
  int64_t n, k;
  bool big;
};
constexpr RealFp8Shape kRealFp8[] = {
    {"wq_a|wkv", 1792, 5120, false}, {"wq_b TP1", 32768, 1280, true}, {"wq_b TP4", 8192, 1280, false},
    {"indexer wq_b", 4096, 1280, false}, {"wo_b", 5120, 8192, true}};

// ---- bf16 harness -----------------------------------------------------------------------------------
struct Bf16Case {
  int64_t n = 0, k = 0;
  int groups = 1;
  int force_splits = 0, force_mtiles = 0;
};

// x holds all groups side by side in one row ([m, groups * k] + pad), like o viewed [T, 8, 4096].
std::vector<bf16_t> run_bf16(const Bf16Case& cs, int m, const DeviceBuffer<bf16_t>& dx, int64_t x_stride,
                             const DeviceBuffer<bf16_t>& dw, const OutLayout& l, GemmVersion v, bool pdl = false) {
  DeviceBuffer<bf16_t> out(l.elems());
  out.fill_bytes(kPoisonByte);
  const GemmPlan plan = plan_gemm_tc(m, cs.n, cs.k, cs.groups, cs.force_splits, cs.force_mtiles);
  DeviceBuffer<uint8_t> ws(std::max<size_t>(plan.workspace_bytes, 1));
  const GemmWorkspace gws{ws.get(), plan.workspace_bytes};
  init_gemm_workspace(gws, nullptr);
  Bf16GemmParams p;
  p.x = dx.get();
  p.x_stride = x_stride;
  p.w = dw.get();
  p.out = out.get();
  p.out_stride = l.stride;
  p.m = m;
  p.n = cs.n;
  p.k = cs.k;
  p.groups = cs.groups;
  p.x_group_stride = cs.k;
  p.w_group_stride = cs.n * cs.k;
  p.out_group_stride = l.group_stride;
  p.force_splits = cs.force_splits;
  p.force_mtiles = cs.force_mtiles;
  run_gemm_bf16(p, gws, v, nullptr, pdl);
  V4_CUDA_CHECK(cudaDeviceSynchronize());
  return to_host(out);
}

// Runs v0 and v1 on one bf16 problem and checks them (v0 bytes; v1 bytes for exact data, <= 1 ulp
// otherwise). Returns v1's stats.
DiffStats check_bf16_case(const Bf16Case& cs, int m, Data d, uint64_t seed, bool run_v0) {
  const int64_t x_stride = cs.groups * cs.k + 56;
  const std::vector<bf16_t> x = make_x(m, cs.groups * cs.k, x_stride, d, seed);
  std::vector<ref::Bf16Matrix> w;
  std::vector<bf16_t> hw;
  for (int g = 0; g < cs.groups; ++g) {
    w.push_back(make_bf16_weight(cs.n, cs.k, d, seed * 5 + g));
    hw.insert(hw.end(), w.back().w.begin(), w.back().w.end());
  }
  std::vector<std::vector<bf16_t>> want;
  for (int g = 0; g < cs.groups; ++g) {
    want.emplace_back(static_cast<size_t>(m * cs.n));
    ref::gemm_bf16(x.data() + g * cs.k, m, x_stride, w[g], want.back().data(), cs.n);
  }
  const DeviceBuffer<bf16_t> dx = to_device(x), dw = to_device(hw);
  const OutLayout l = make_layout(m, cs.n, cs.groups);
  const std::string name = "bf16 " + std::to_string(cs.n) + "x" + std::to_string(cs.k) +
                           (cs.groups > 1 ? " g" + std::to_string(cs.groups) : "") + " m" + std::to_string(m) +
                           (cs.force_splits ? " S" + std::to_string(cs.force_splits) : "") +
                           (cs.force_mtiles ? " MT" + std::to_string(cs.force_mtiles) : "");
  if (run_v0) {
    const DiffStats s0 = check_bf16(run_bf16(cs, m, dx, x_stride, dw, l, GemmVersion::kSimple), l, dense_want(want, cs.n), 0,
                                    name + " v0");
    EXPECT_EQ(s0.differ, 0) << name << " v0 must be byte-identical to the reference";
  }
  const DiffStats s1 = check_bf16(run_bf16(cs, m, dx, x_stride, dw, l, GemmVersion::kTensorCore), l,
                                  dense_want(want, cs.n), d == Data::kExact ? 0 : 1, name + " v1", d == Data::kRealistic);
  if (d == Data::kExact) EXPECT_EQ(s1.differ, 0) << name << " v1 on exact data";
  return s1;
}

// ---- fp32 harness -----------------------------------------------------------------------------------
// Runs one version; checks v0 bytes, v1 bytes on exact data, and v1 within the rounding bound on
// realistic data: |got - ref| <= 2 * (k + 8) * 2^-24 * sum_k |x * w| (two fp32 sums of k terms).
void check_f32_case(int64_t n, int64_t k, int m, Data d, uint64_t seed, GemmVersion v) {
  const int64_t x_stride = k + 12;
  const std::vector<bf16_t> x = make_x(m, k, x_stride, d, seed);
  const ref::F32Matrix w = make_f32_weight(n, k, d, seed * 3 + 1);
  std::vector<float> want(static_cast<size_t>(m * n));
  ref::gemm_f32(x.data(), m, x_stride, w, want.data(), n);
  const DeviceBuffer<bf16_t> dx = to_device(x);
  const DeviceBuffer<float> dw = to_device(w.w);
  const int64_t out_stride = n + 20;
  const int rows_alloc = m + 2;
  DeviceBuffer<float> out(static_cast<size_t>(rows_alloc * out_stride));
  out.fill_bytes(kPoisonByte);
  F32GemmParams p;
  p.x = dx.get();
  p.x_stride = x_stride;
  p.w = dw.get();
  p.out = out.get();
  p.out_stride = out_stride;
  p.m = m;
  p.n = n;
  p.k = k;
  run_gemm_f32(p, v, nullptr, false);
  V4_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<float> got = to_host(out);
  const std::string name = "f32 " + std::to_string(n) + "x" + std::to_string(k) + " m" + std::to_string(m) + " " +
                           gemm_version_name(v) + (d == Data::kExact ? " exact" : " realistic");
  const bool exact = v == GemmVersion::kSimple || d == Data::kExact;
  uint32_t poison_bits;
  std::memset(&poison_bits, kPoisonByte, 4);
  int reported = 0;
  double worst = 0.0;
  for (int r = 0; r < rows_alloc; ++r)
    for (int64_t c = 0; c < out_stride; ++c) {
      const float o = got[static_cast<size_t>(r * out_stride + c)];
      if (r >= m || c >= n) {
        if (num::f32_bits(o) != poison_bits && reported++ < 8) ADD_FAILURE() << name << ": wrote outside at " << r << "," << c;
        continue;
      }
      const float e = want[static_cast<size_t>(r * n + c)];
      if (exact) {
        if (num::f32_bits(o) != num::f32_bits(e) && reported++ < 8)
          ADD_FAILURE() << name << ": row " << r << " col " << c << " got " << o << " want " << e;
        continue;
      }
      double mag = 0.0;
      for (int64_t i = 0; i < k; ++i)
        mag += std::fabs(static_cast<double>(num::f32_from_bf16(x[static_cast<size_t>(r * x_stride + i)])) *
                         static_cast<double>(w.w[static_cast<size_t>(c * k + i)]));
      const double diff = std::fabs(static_cast<double>(o) - static_cast<double>(e));
      const double bound = 2.0 * static_cast<double>(k + 8) * 0x1.0p-24 * mag;
      worst = std::max(worst, mag > 0 ? diff / mag : 0.0);
      if (!(diff <= bound) && reported++ < 8)
        ADD_FAILURE() << name << ": row " << r << " col " << c << " got " << o << " want " << e << " (bound " << bound << ")";
    }
  if (!exact) std::printf("[ gemm ] %-48s max |diff| / sum|x*w| = %.3g\n", name.c_str(), worst);
}

}  // namespace

// ======================================================================================================

TEST(GpuGemm, ActQuantMatchesReferenceBytes) {
  V4_REQUIRE_GPU();
  uint64_t seed = 1;
  int run = 0;
  for (int64_t k : {32, 96, 1280, 5120, 8192})
    for (int m : kAllM) {
      // The CTA size rotates (warps_per_cta: default, 1, 7 -- a partial last CTA --, 32): same bytes.
      const int warps = std::array<int, 4>{0, 1, 7, 32}[static_cast<size_t>(run++ % 4)];
      // Odd strides for k = 96: the act quant has no alignment requirement.
      const int64_t x_stride = k + (k == 96 ? 3 : 24), q_stride = k + (k == 96 ? 5 : 16), s_stride = k / 32 + 5;
      const std::vector<bf16_t> x = make_x(m, k, x_stride, Data::kRealistic, ++seed);
      const ref::ActQuant want = ref::act_quant(x.data(), m, k, x_stride);
      const DeviceBuffer<bf16_t> dx = to_device(x);
      DeviceBuffer<uint8_t> q(static_cast<size_t>((m + 1) * q_stride)), s(static_cast<size_t>((m + 1) * s_stride));
      q.fill_bytes(kPoisonByte);
      s.fill_bytes(kPoisonByte);
      ActQuantParams p;
      p.x = dx.get();
      p.x_stride = x_stride;
      p.q = q.get();
      p.q_stride = q_stride;
      p.scale = s.get();
      p.scale_stride = s_stride;
      p.m = m;
      p.k = k;
      p.warps_per_cta = warps;
      run_act_quant_fp8(p, nullptr, (m & 1) != 0);  // pdl on for odd m: same bytes
      const std::vector<uint8_t> hq = to_host(q), hs = to_host(s);
      int bad = 0;
      for (int r = 0; r <= m; ++r) {
        for (int64_t c = 0; c < q_stride; ++c) {
          const uint8_t w = (r < m && c < k) ? want.q[static_cast<size_t>(r * k + c)] : kPoisonByte;
          if (hq[static_cast<size_t>(r * q_stride + c)] != w && bad++ < 5)
            ADD_FAILURE() << "k " << k << " m " << m << " warps " << warps << ": code row " << r << " col " << c;
        }
        for (int64_t c = 0; c < s_stride; ++c) {
          const uint8_t w = (r < m && c < k / 32) ? want.scale[static_cast<size_t>(r * (k / 32) + c)] : kPoisonByte;
          if (hs[static_cast<size_t>(r * s_stride + c)] != w && bad++ < 5)
            ADD_FAILURE() << "k " << k << " m " << m << " warps " << warps << ": scale row " << r << " col " << c;
        }
      }
    }
}

// Real model shapes, realistic data: v0 byte-identical, v1, v2 and v3 within 1 ulp (fraction printed).
// The big shapes (wq_b TP1, wo_b) at m = 64 are in Fp8BigShapesM64 (the CPU reference is slow).
void check_real_fp8_realistic(const RealFp8Shape& sh, const std::vector<int>& ms, uint64_t seed) {
  const Fp8Case cs{sh.n, sh.k};
  DiffStats agg1, agg2, agg3;
  const Fp8Weights w = make_fp8_weights(cs, Data::kRealistic, seed);
  for (int m : ms) {
    const Fp8Acts a = make_fp8_acts(cs, m, Data::kRealistic, seed * 31 + static_cast<uint64_t>(m));
    const auto want = ref_fp8(w, a);
    const OutLayout l = make_layout(m, cs.n);
    const std::string name = std::string(sh.name) + " " + fp8_name(cs, m);
    if (m <= 8) {  // v0 is slow (one thread per output); its order is the reference's
      const DiffStats s0 = check_bf16(run_fp8(w, a, l, GemmVersion::kSimple), l, dense_want(want, cs.n), 0, name + " v0");
      EXPECT_EQ(s0.differ, 0) << name << ": v0 must be byte-identical to the reference";
    }
    const DiffStats s1 = check_bf16(run_fp8(w, a, l, GemmVersion::kTensorCore), l, dense_want(want, cs.n), 1, name + " v1", true);
    expect_realistic_stats(s1, name + " v1");
    agg1.add(s1);
    const DiffStats s2 = check_bf16(run_fp8(w, a, l, GemmVersion::kWgmma), l, dense_want(want, cs.n), 1, name + " v2", true);
    expect_realistic_stats(s2, name + " v2");
    agg2.add(s2);
    const DiffStats s3 =
        check_bf16(run_fp8(w, a, l, GemmVersion::kWgmmaPipelined), l, dense_want(want, cs.n), 1, name + " v3", true);
    expect_realistic_stats(s3, name + " v3");
    agg3.add(s3);
  }
  expect_realistic_stats(agg1, std::string(sh.name) + " all m v1");
  expect_realistic_stats(agg2, std::string(sh.name) + " all m v2");
  expect_realistic_stats(agg3, std::string(sh.name) + " all m v3");
}

TEST(GpuGemm, Fp8RealShapesRealistic) {
  V4_REQUIRE_GPU();
  use_all_cores();
  uint64_t seed = 100;
  for (const RealFp8Shape& sh : kRealFp8)
    check_real_fp8_realistic(sh, sh.big ? std::vector<int>{1, 6, 13} : std::vector<int>(std::begin(kAllM), std::end(kAllM)),
                             ++seed);
}

// wq_b (TP1) and wo_b at the largest batch: the M the v2 kernel is tuned for.
TEST(GpuGemm, Fp8BigShapesM64) {
  V4_REQUIRE_GPU();
  use_all_cores();
  uint64_t seed = 150;
  for (const RealFp8Shape& sh : kRealFp8)
    if (sh.big) check_real_fp8_realistic(sh, {64}, ++seed);
}

// Real model shapes, exact data: v1, v2 and v3 byte-identical whatever their summation order.
TEST(GpuGemm, Fp8RealShapesExact) {
  V4_REQUIRE_GPU();
  use_all_cores();
  uint64_t seed = 200;
  for (const RealFp8Shape& sh : kRealFp8) {
    const Fp8Case cs{sh.n, sh.k};
    const std::vector<int> ms = sh.big ? std::vector<int>{13} : std::vector<int>{13, 64};
    const Fp8Weights w = make_fp8_weights(cs, Data::kExact, ++seed);
    for (int m : ms) {
      const Fp8Acts a = make_fp8_acts(cs, m, Data::kExact, ++seed);
      const auto want = ref_fp8(w, a);
      const OutLayout l = make_layout(m, cs.n);
      for (GemmVersion v : {GemmVersion::kTensorCore, GemmVersion::kWgmma, GemmVersion::kWgmmaPipelined}) {
        const DiffStats s = check_bf16(run_fp8(w, a, l, v), l, dense_want(want, cs.n), 0,
                                       std::string(sh.name) + " " + fp8_name(cs, m) + " exact " + gemm_version_name(v));
        EXPECT_EQ(s.differ, 0);
      }
    }
  }
}

// Every code path on small shapes: m 1..64 (every n8 tile count, partial tiles), forced splits
// (S = 1, uneven ranges, one block per split), forced 1 or 2 m16 tiles per warp, n not a multiple
// of the CTA's rows, partial pipeline stages, groups.
TEST(GpuGemm, Fp8SmallShapesAllPaths) {
  V4_REQUIRE_GPU();
  use_all_cores();
  const Fp8Case cases[] = {
      {32, 32, 1, 0, 0},   {96, 160, 1, 0, 0},  {96, 160, 1, 1, 1},  {160, 416, 1, 3, 2}, {224, 416, 1, 13, 1},
      {224, 288, 1, 1, 2}, {64, 800, 1, 2, 1},  {32, 96, 1, 3, 0},   {96, 224, 3, 2, 0},  {128, 128, 2, 0, 2},
      {352, 544, 1, 0, 0}, {288, 1056, 1, 5, 2}};
  const int ms[] = {1, 2, 3, 5, 7, 8, 9, 15, 16, 17, 23, 31, 33, 40, 47, 56, 57, 63, 64};
  uint64_t seed = 300;
  for (const Fp8Case& cs : cases) {
    const Fp8Weights w = make_fp8_weights(cs, Data::kExact, ++seed);
    for (int m : ms) {
      const Fp8Acts a = make_fp8_acts(cs, m, Data::kExact, ++seed);
      const auto want = ref_fp8(w, a);
      const OutLayout l = make_layout(m, cs.n, cs.groups);
      const DiffStats s = check_bf16(run_fp8(w, a, l, GemmVersion::kTensorCore), l, dense_want(want, cs.n), 0, fp8_name(cs, m) + " exact v1");
      EXPECT_EQ(s.differ, 0) << fp8_name(cs, m);
      if (m == 5 || m == 64) {  // v0 handles groups and strides the same way
        const DiffStats s0 = check_bf16(run_fp8(w, a, l, GemmVersion::kSimple), l, dense_want(want, cs.n), 0, fp8_name(cs, m) + " v0");
        EXPECT_EQ(s0.differ, 0);
      }
    }
  }
  // Realistic data through the same paths (<= 1 ulp).
  DiffStats agg;
  for (const Fp8Case& cs : cases) {
    const Fp8Weights w = make_fp8_weights(cs, Data::kRealistic, ++seed);
    for (int m : {4, 29, 64}) {
      const Fp8Acts a = make_fp8_acts(cs, m, Data::kRealistic, ++seed);
      const auto want = ref_fp8(w, a);
      const OutLayout l = make_layout(m, cs.n, cs.groups);
      agg.add(check_bf16(run_fp8(w, a, l, GemmVersion::kTensorCore), l, dense_want(want, cs.n), 1, fp8_name(cs, m) + " v1", true));
    }
  }
  expect_realistic_stats(agg, "fp8 small shapes, realistic");
}

// v2: every code path on small shapes. m covers every token padding NP = 8..64 (and both sides of
// each multiple of 8); the cases cover one and two m64 tiles per consumer warpgroup, tiles that are
// partly beyond n, forced splits (uneven K ranges, one block per CTA), a partial last stage, the TMA
// ring and the f16 ring wrapping around (more stages than slots), forced shallow rings (1..3 slots)
// and groups. Exact data: byte equality; realistic data: <= 1 ulp.
TEST(GpuGemm, Fp8WgmmaSmallShapesAllPaths) {
  V4_REQUIRE_GPU();
  use_all_cores();
  const Fp8Case cases[] = {
      {32, 32, 1, 0, 0, 0},       // one block, n < one tile
      {160, 416, 1, 1, 1, 0},     // S = 1: 13 blocks = 3 full stages + 1 block; 2nd tile has 32 rows
      {160, 416, 1, 0, 1, 0},     // automatic plan (one block per CTA)
      {288, 2080, 1, 1, 2, 0},    // MT = 2, 65 blocks = 17 stages > ring slots; 2nd tile has 32 rows
      {288, 2080, 1, 3, 2, 2},    // uneven splits (22/22/21 blocks), 2-slot ring
      {96, 1056, 1, 2, 1, 1},     // 1-slot ring (producer waits for every stage), S = 2
      {64, 800, 1, 7, 1, 3},      // S = 7 uneven, 3 slots
      {96, 224, 3, 2, 0, 0},      // 3 groups, split-K
      {128, 128, 2, 0, 2, 0},     // 2 groups, MT = 2 with half of the tile beyond n
      {256, 512, 1, 0, 0, 0},     // automatic plan
  };
  const int ms[] = {1, 2, 7, 8, 9, 15, 16, 17, 24, 25, 31, 33, 40, 41, 47, 48, 49, 56, 57, 63, 64};
  uint64_t seed = 900;
  for (const Fp8Case& cs : cases) {
    const Fp8Weights w = make_fp8_weights(cs, Data::kExact, ++seed);
    for (int m : ms) {
      const Fp8Acts a = make_fp8_acts(cs, m, Data::kExact, ++seed);
      const auto want = ref_fp8(w, a);
      const OutLayout l = make_layout(m, cs.n, cs.groups);
      const DiffStats s = check_bf16(run_fp8(w, a, l, GemmVersion::kWgmma, (m & 1) != 0), l, dense_want(want, cs.n), 0,
                                     fp8_name(cs, m) + " exact v2");
      EXPECT_EQ(s.differ, 0) << fp8_name(cs, m);
    }
    // An output row stride that is not a multiple of 8 elements: the one-split epilogue's element-
    // by-element stores instead of its 16-byte pieces.
    for (int m : {7, 33}) {
      const Fp8Acts a = make_fp8_acts(cs, m, Data::kExact, ++seed);
      const OutLayout l = make_layout(m, cs.n, cs.groups, 3);
      const DiffStats s = check_bf16(run_fp8(w, a, l, GemmVersion::kWgmma), l, dense_want(ref_fp8(w, a), cs.n), 0,
                                     fp8_name(cs, m) + " exact v2, odd stride");
      EXPECT_EQ(s.differ, 0) << fp8_name(cs, m) << " odd stride";
    }
  }
  DiffStats agg;
  for (const Fp8Case& cs : cases) {
    const Fp8Weights w = make_fp8_weights(cs, Data::kRealistic, ++seed);
    for (int m : {3, 29, 64}) {
      const Fp8Acts a = make_fp8_acts(cs, m, Data::kRealistic, ++seed);
      const auto want = ref_fp8(w, a);
      const OutLayout l = make_layout(m, cs.n, cs.groups);
      agg.add(check_bf16(run_fp8(w, a, l, GemmVersion::kWgmma), l, dense_want(want, cs.n), 1, fp8_name(cs, m) + " v2", true));
    }
  }
  expect_realistic_stats(agg, "fp8 small shapes, realistic, v2");
}

// v2's two tuning fields change the schedule, never the arithmetic: the pipelined consumer loops
// (v2_overlap 1 on full stages, 2 on pairs of full stages -- the cases below have pairs, a full stage
// left over, partial last stages and a one-slot ring, which runs one stage at a time) and the
// one-block-at-a-time loop give the same bytes, and so does
// any split of the first ring fill around the PDL wait (prewait_stages 0, 1, all). Realistic data
// (so that a changed order of operations would show), partial last stages, split-K, MT = 1 and 2,
// with and without PDL; the first variant is also checked against the reference (<= 1 ulp).
TEST(GpuGemm, Fp8WgmmaOverlapAndPrewaitAreByteNeutral) {
  V4_REQUIRE_GPU();
  use_all_cores();
  const Fp8Case cases[] = {
      {288, 2080, 1, 1, 2, 0},  // MT = 2, 65 blocks: 16 full stages + a partial one, ring of 8
      {160, 416, 1, 1, 1, 2},   // MT = 1, 13 blocks, 2-slot ring
      {96, 1056, 1, 2, 1, 1},   // S = 2, 1-slot ring
      {512, 1280, 1, 0, 0, 0},  // automatic plan, wq_b-like K (40 blocks = 10 full stages)
  };
  struct Variant {
    int overlap, prewait, pace_ns = 0;
  };
  const Variant variants[] = {{0, -1}, {1, -1}, {2, -1}, {1, 0}, {2, 1}, {0, 0}, {2, -1, 1000}, {1, 2, 300}, {2, 0, 500}};
  uint64_t seed = 1900;
  DiffStats agg;
  for (const Fp8Case& cs : cases) {
    const Fp8Weights w = make_fp8_weights(cs, Data::kRealistic, ++seed);
    for (int m : {1, 6, 24, 64}) {
      const Fp8Acts a = make_fp8_acts(cs, m, Data::kRealistic, ++seed);
      const OutLayout l = make_layout(m, cs.n, cs.groups);
      const GemmPlan plan = fp8_plan(cs, m, GemmVersion::kWgmma);
      DeviceBuffer<uint8_t> ws(std::max<size_t>(plan.workspace_bytes, 1));
      const GemmWorkspace gws{ws.get(), plan.workspace_bytes};
      init_gemm_workspace(gws, nullptr);
      std::vector<bf16_t> first;
      for (const Variant& v : variants) {
        DeviceBuffer<bf16_t> out(l.elems());
        out.fill_bytes(kPoisonByte);
        Fp8GemmParams p = fp8_params(w, a, out.get(), l);
        p.v2_overlap = v.overlap;
        p.prewait_stages = v.prewait;
        p.prewait_pace_ns = v.pace_ns;
        run_gemm_fp8(p, gws, GemmVersion::kWgmma, nullptr, (m & 1) != 0);
        V4_CUDA_CHECK(cudaDeviceSynchronize());
        std::vector<bf16_t> got = to_host(out);
        const std::string name = fp8_name(cs, m) + " overlap" + std::to_string(v.overlap) + " prewait" +
                                 std::to_string(v.prewait) + " pace" + std::to_string(v.pace_ns);
        if (first.empty()) {
          agg.add(check_bf16(got, l, dense_want(ref_fp8(w, a), cs.n), 1, name + " v2", true));
          first = std::move(got);
        } else {
          EXPECT_EQ(0, std::memcmp(first.data(), got.data(), first.size() * sizeof(bf16_t))) << name;
        }
      }
    }
  }
  expect_realistic_stats(agg, "fp8 v2 overlap / prewait variants, realistic");
}

// v2 with four m64 tiles per consumer warpgroup (force_mtiles 4: 512 weight rows per CTA, each stage
// two 256-row TMA boxes; the stack's qb_side_mtiles): the bytes of the two-tile plan at every m it
// takes (<= 16), with and without PDL, and within 1 ulp of the reference. Shapes: wq_b, a last tile
// half beyond n (its second box entirely), one tile smaller than a box, a partial last stage.
TEST(GpuGemm, Fp8WgmmaFourTilesPerWarpgroupMatchTwo) {
  V4_REQUIRE_GPU();
  use_all_cores();
  const Fp8Case cases[] = {
      {32768, 1280, 1, 1, 4, 0},  // wq_b: 64 CTAs, 10 full stages
      {4352, 1280, 1, 1, 4, 0},   // 8.5 tiles of 512: the last one's second box beyond n
      {160, 416, 1, 1, 4, 0},     // one tile, 160 of 512 rows; 13 blocks = 3 full stages + 1 block
  };
  uint64_t seed = 2900;
  DiffStats agg;
  for (const Fp8Case& cs : cases) {
    const Fp8Weights w4 = make_fp8_weights(cs, Data::kRealistic, ++seed);
    for (int m : {1, 6, 8, 9, 16}) {
      const Fp8Acts a = make_fp8_acts(cs, m, Data::kRealistic, ++seed);
      const OutLayout l = make_layout(m, cs.n, cs.groups);
      ASSERT_EQ(plan_gemm_wgmma(m, cs.n, cs.k, 1, 1, 4).warp_mtiles, 4);
      ASSERT_EQ(plan_gemm_wgmma(m, cs.n, cs.k, 1, 1, 4).tiles_n, static_cast<int>((cs.n + 511) / 512));
      for (bool pdl : {false, true}) {
        const std::vector<bf16_t> got = run_fp8(w4, a, l, GemmVersion::kWgmma, pdl);
        Fp8GemmParams p = fp8_params(w4, a, nullptr, l);
        DeviceBuffer<bf16_t> out(l.elems());
        out.fill_bytes(kPoisonByte);
        p.out = out.get();
        p.force_mtiles = 2;  // the same weights and activations under the two-tile plan
        run_gemm_fp8(p, GemmWorkspace{}, GemmVersion::kWgmma, nullptr, pdl);
        V4_CUDA_CHECK(cudaDeviceSynchronize());
        const std::vector<bf16_t> want = to_host(out);
        const std::string name = fp8_name(cs, m) + (pdl ? " pdl" : "");
        ASSERT_EQ(got.size(), want.size());
        EXPECT_EQ(0, std::memcmp(got.data(), want.data(), got.size() * sizeof(bf16_t))) << name << ": MT 4 vs MT 2";
        if (!pdl) agg.add(check_bf16(got, l, dense_want(ref_fp8(w4, a), cs.n), 1, name + " v2 MT4", true));
      }
    }
  }
  expect_realistic_stats(agg, "fp8 v2 four tiles per warpgroup, realistic");
  // The predicate the stack asks: wq_b at TP1 (one-split automatic plan) yes up to 16 rows; TP4's
  // wq_b (8192 x 1280: a split-K automatic plan, which forcing one split would re-order) no.
  for (int m : {1, 8, 16}) EXPECT_TRUE(gemm_v2_four_tiles_supported(m, 32768, 1280)) << m;
  EXPECT_FALSE(gemm_v2_four_tiles_supported(17, 32768, 1280));
  EXPECT_FALSE(gemm_v2_four_tiles_supported(0, 32768, 1280));
  EXPECT_GT(plan_gemm_wgmma(1, 8192, 1280, 1).splits, 1);
  EXPECT_FALSE(gemm_v2_four_tiles_supported(1, 8192, 1280));
  // Refused: more than 16 rows, a forced split, v3.
  EXPECT_THROW(plan_gemm_wgmma(17, 32768, 1280, 1, 1, 4), std::invalid_argument);
  EXPECT_THROW(plan_gemm_wgmma(8, 32768, 1280, 1, 2, 4), std::invalid_argument);
  EXPECT_THROW(plan_gemm_wgmma_pipelined(8, 32768, 1280, 1, 1, 4), std::invalid_argument);
}

// v3: every code path on small shapes. m covers every token padding NP = 8..64; the cases cover
// one and two m64 tiles per consumer warpgroup, tiles partly beyond n, cluster split-K with
// S = 2..8 (uneven K ranges, one block per CTA, MT = 2 partial tiles of 256 rows), 8-unit
// iterations that end in a partial stage or lack their second stage (dummy units), the TMA ring
// and the f16 ring wrapping around, forced shallow rings (1..3 slots) and groups. The widening mask
// rotates over m (all-cvt, all-integer, mixed) and the output stride over 16-byte / 8-byte /
// scalar stores. Exact data: byte equality whatever the mask; realistic data: <= 1 ulp.
TEST(GpuGemm, Fp8WgmmaPipelinedSmallShapesAllPaths) {
  V4_REQUIRE_GPU();
  use_all_cores();
  const Fp8Case cases[] = {
      {32, 32, 1, 0, 0, 0},       // one block: one real unit, the rest of the iteration dummies; S = 1
      {160, 416, 1, 1, 1, 0},     // S = 1, MT = 1: 13 blocks = stages 4, 4, 4, 1; 2nd tile has 32 rows
      {160, 416, 1, 0, 1, 0},     // automatic plan: S = 8 (13 blocks: 1 or 2 per CTA)
      {288, 2080, 1, 1, 2, 0},    // MT = 2, 65 blocks = 17 stages > ring slots; 2nd tile has 32 rows
      {288, 2080, 1, 3, 2, 2},    // MT = 2 cluster of 3 (22/22/21 blocks), 2-slot ring
      {96, 1056, 1, 2, 1, 1},     // 1-slot ring (producer waits for every stage), S = 2
      {64, 800, 1, 7, 1, 3},      // S = 7 uneven (3-4 blocks per CTA), 3 slots
      {96, 224, 3, 2, 0, 0},      // 3 groups, clusters of 2
      {128, 128, 2, 0, 2, 0},     // 2 groups, MT = 2 with half of the tile beyond n, automatic S
      {256, 512, 1, 0, 0, 0},     // automatic plan
      {64, 8192, 1, 8, 1, 0},     // S = 8: 32 blocks per CTA (8 stages through the ring)
      {96, 1696, 1, 5, 1, 2},     // S = 5, 10/11 blocks per CTA: 3 stages (the 2nd iteration lacks its 2nd), 2 slots
  };
  const int ms[] = {1, 2, 7, 8, 9, 15, 16, 17, 24, 25, 31, 33, 40, 41, 47, 48, 49, 56, 57, 63, 64};
  const int masks[] = {-1, 0, 15, 5, 3};
  const int pads[] = {24, 28, 25};
  uint64_t seed = 950;
  int run = 0;
  for (const Fp8Case& base_cs : cases) {
    const Fp8Weights w = make_fp8_weights(base_cs, Data::kExact, ++seed);
    for (int m : ms) {
      Fp8Case cs = base_cs;
      cs.int_mask = masks[run % 5];
      const Fp8Acts a = make_fp8_acts(cs, m, Data::kExact, ++seed);
      const auto want = ref_fp8(w, a);
      const OutLayout l = make_layout(m, cs.n, cs.groups, pads[run % 3]);
      ++run;
      // The weights' device copies are shared (the mask and layout only change the launch).
      Fp8GemmParams p = fp8_params(w, a, nullptr, l);
      p.v3_int_mask = cs.int_mask;
      DeviceBuffer<bf16_t> out(l.elems());
      out.fill_bytes(kPoisonByte);
      p.out = out.get();
      run_gemm_fp8(p, GemmWorkspace{}, GemmVersion::kWgmmaPipelined, nullptr, (m & 1) != 0);
      V4_CUDA_CHECK(cudaDeviceSynchronize());
      const DiffStats st = check_bf16(to_host(out), l, dense_want(want, cs.n), 0,
                                      fp8_name(cs, m) + " pad" + std::to_string(l.stride - cs.groups * cs.n) + " exact v3");
      EXPECT_EQ(st.differ, 0) << fp8_name(cs, m);
    }
  }
  DiffStats agg;
  for (const Fp8Case& base_cs : cases) {
    const Fp8Weights w = make_fp8_weights(base_cs, Data::kRealistic, ++seed);
    for (int m : {3, 29, 64})
      for (int mask : {-1, 0, 15}) {
        Fp8Case cs = base_cs;
        cs.int_mask = mask;
        const Fp8Acts a = make_fp8_acts(cs, m, Data::kRealistic, ++seed);
        const auto want = ref_fp8(w, a);
        const OutLayout l = make_layout(m, cs.n, cs.groups);
        Fp8GemmParams p = fp8_params(w, a, nullptr, l);
        p.v3_int_mask = mask;
        DeviceBuffer<bf16_t> out(l.elems());
        out.fill_bytes(kPoisonByte);
        p.out = out.get();
        run_gemm_fp8(p, GemmWorkspace{}, GemmVersion::kWgmmaPipelined, nullptr, false);
        V4_CUDA_CHECK(cudaDeviceSynchronize());
        agg.add(check_bf16(to_host(out), l, dense_want(want, cs.n), 1, fp8_name(cs, m) + " v3", true));
      }
  }
  expect_realistic_stats(agg, "fp8 small shapes, realistic, v3");
}

// e4m3 subnormal codes, exactly: weights all subnormal (activations integers) and the reverse, on
// small shapes and two real ones, every tensor-core version, v3 with each widening. The integer
// widening turns subnormal weights into f16 subnormals (x * 2^-8); were they flushed, whole block
// sums would vanish and the outputs would not match.
TEST(GpuGemm, Fp8SubnormalCodesExact) {
  V4_REQUIRE_GPU();
  use_all_cores();
  const Fp8Case cases[] = {{96, 160, 1, 0, 0, 0}, {288, 2080, 1, 3, 2, 0}, {64, 8192, 1, 8, 1, 0},
                           {1792, 5120, 1, 0, 0, 0}, {4096, 1280, 1, 0, 0, 0}};
  uint64_t seed = 1300;
  for (Data d : {Data::kSubnormalW, Data::kSubnormalA})
    for (const Fp8Case& cs : cases) {
      const Fp8Weights w = make_fp8_weights(cs, d, ++seed);
      for (int m : {1, 9, 64}) {
        if (cs.n * cs.k > 1 << 22 && m == 64) continue;  // the CPU reference of the real shapes at m = 64 is slow
        const Fp8Acts a = make_fp8_acts(cs, m, d, ++seed);
        const auto want = ref_fp8(w, a);
        const OutLayout l = make_layout(m, cs.n, cs.groups);
        const std::string name =
            fp8_name(cs, m) + (d == Data::kSubnormalW ? " subnormal weights" : " subnormal activations");
        for (GemmVersion v : {GemmVersion::kTensorCore, GemmVersion::kWgmma}) {
          const DiffStats st = check_bf16(run_fp8(w, a, l, v), l, dense_want(want, cs.n), 0, name + " " + gemm_version_name(v));
          EXPECT_EQ(st.differ, 0) << name << " " << gemm_version_name(v);
        }
        for (int mask : {-1, 0, 15}) {
          Fp8GemmParams p = fp8_params(w, a, nullptr, l);
          p.v3_int_mask = mask;
          DeviceBuffer<bf16_t> out(l.elems());
          out.fill_bytes(kPoisonByte);
          p.out = out.get();
          run_gemm_fp8(p, GemmWorkspace{}, GemmVersion::kWgmmaPipelined, nullptr, false);
          V4_CUDA_CHECK(cudaDeviceSynchronize());
          const DiffStats st = check_bf16(to_host(out), l, dense_want(want, cs.n), 0, name + " v3 int" + std::to_string(mask));
          EXPECT_EQ(st.differ, 0) << name << " v3 int mask " << mask;
        }
      }
    }
}

// ---- v6 (kGemv): registers-first gemv for m <= 16 ---------------------------------------------------
// Exact data: byte-identical to the reference on every shape (one and several K splits, uneven
// ranges, n not a multiple of 64, the real indexer wq_b and wq_a|wkv at K = kGemvMaxK), every m it
// takes (one and two n8 tiles of tokens), subnormal codes on either side, PDL on / off; realistic
// data: within 1 ulp, with v3's statistics. The output buffer is poisoned before each run
// (check_bf16 checks the pad too).
TEST(GpuGemmGemv, ExactDataMatchesReferenceBytes) {
  V4_REQUIRE_GPU();
  use_all_cores();
  const Fp8Case cases[] = {{32, 32},    {64, 320},    {96, 352},   {160, 640},  {32, 3200},
                           {256, 1056}, {4096, 1280}, {1792, 5120}, {480, 4768}};
  uint64_t seed = 2300;
  for (const Fp8Case& cs : cases) {
    ASSERT_TRUE(gemm_gemv_supported(1, cs.n, cs.k)) << fp8_name(cs, 1);
    for (Data d : {Data::kExact, Data::kSubnormalW, Data::kSubnormalA}) {
      if (d != Data::kExact && cs.n * cs.k > (1 << 22)) continue;
      const Fp8Weights w = make_fp8_weights(cs, d, ++seed);
      for (int m = 1; m <= kGemvMaxRows; ++m) {
        if (!gemm_gemv_supported(m, cs.n, cs.k)) continue;  // two tiles: k <= 2560
        if (d != Data::kExact && m != 1 && m != 9 && m != kGemvMaxRows) continue;
        const Fp8Acts a = make_fp8_acts(cs, m, d, ++seed);
        const auto want = ref_fp8(w, a);
        const OutLayout l = make_layout(m, cs.n);
        const std::string name = fp8_name(cs, m) + " v6" + (d == Data::kExact ? "" : d == Data::kSubnormalW ? " subnormal w" : " subnormal a");
        const DiffStats st = check_bf16(run_fp8(w, a, l, GemmVersion::kGemv, m % 2 == 0), l, dense_want(want, cs.n), 0, name);
        EXPECT_EQ(st.differ, 0) << name;
      }
    }
  }
}

TEST(GpuGemmGemv, RealShapesRealisticWithinOneUlp) {
  V4_REQUIRE_GPU();
  use_all_cores();
  uint64_t seed = 2400;
  for (const RealFp8Shape& sh : kRealFp8) {
    if (!gemm_gemv_supported(1, sh.n, sh.k) || sh.big) continue;
    const Fp8Case cs{sh.n, sh.k};
    const Fp8Weights w = make_fp8_weights(cs, Data::kRealistic, ++seed);
    DiffStats agg;
    for (int m : {1, 2, 5, 6, 8, 9, 12, 16}) {
      if (!gemm_gemv_supported(m, cs.n, cs.k)) continue;
      const Fp8Acts a = make_fp8_acts(cs, m, Data::kRealistic, ++seed);
      const auto want = ref_fp8(w, a);
      const OutLayout l = make_layout(m, cs.n);
      const std::string name = std::string(sh.name) + " " + fp8_name(cs, m) + " v6";
      const std::vector<bf16_t> got = run_fp8(w, a, l, GemmVersion::kGemv);
      const DiffStats st = check_bf16(got, l, dense_want(want, cs.n), 1, name, true);
      expect_realistic_stats(st, name);
      agg.add(st);
      // Deterministic, and PDL does not change a byte.
      EXPECT_TRUE(run_fp8(w, a, l, GemmVersion::kGemv, true) == got) << name << ": PDL changed the output";
      EXPECT_TRUE(run_fp8(w, a, l, GemmVersion::kGemv) == got) << name << ": a second run differs";
    }
    expect_realistic_stats(agg, std::string(sh.name) + " all m v6");
  }
}

// A token's output does not depend on the batch it is in: row r of a 16-row call (two n8 tiles of
// tokens) equals the one-row call on row r alone (the plan depends on (n, k) only).
TEST(GpuGemmGemv, RowsDoNotDependOnTheBatch) {
  V4_REQUIRE_GPU();
  const Fp8Case cs{4096, 1280};
  const Fp8Weights w = make_fp8_weights(cs, Data::kRealistic, 2500);
  const int m = kGemvMaxRows;
  const Fp8Acts a = make_fp8_acts(cs, m, Data::kRealistic, 2501);
  const OutLayout l = make_layout(m, cs.n);
  const std::vector<bf16_t> all = run_fp8(w, a, l, GemmVersion::kGemv);
  const OutLayout l1 = make_layout(1, cs.n);
  for (int r : {0, 3, 8, 11, m - 1}) {  // rows of the first and the second n8 tile
    Fp8GemmParams p = fp8_params(w, a, nullptr, l1);
    p.a_q = a.d_aq.get() + r * a.a_stride;
    p.a_scale = a.d_as.get() + r * a.a_scale_stride;
    p.m = 1;
    DeviceBuffer<bf16_t> out(l1.elems());
    out.fill_bytes(kPoisonByte);
    p.out = out.get();
    run_gemm_fp8(p, GemmWorkspace{}, GemmVersion::kGemv, nullptr, false);
    V4_CUDA_CHECK(cudaDeviceSynchronize());
    const std::vector<bf16_t> one = to_host(out);
    int bad = 0;
    for (int64_t c = 0; c < cs.n; ++c)
      if (one[static_cast<size_t>(c)] != all[static_cast<size_t>(r * l.stride + c)] && bad++ < 3)
        ADD_FAILURE() << "row " << r << " col " << c << " differs alone and in the batch of " << m;
  }
}

// What v6 refuses: nothing launched, the output untouched; the support predicate and plan.
TEST(GpuGemmGemv, SupportPlanAndRefusals) {
  V4_REQUIRE_GPU();
  EXPECT_STREQ(gemm_version_name(GemmVersion::kGemv), "v6 gemv");
  EXPECT_TRUE(gemm_gemv_supported(1, 4096, 1280));
  EXPECT_TRUE(gemm_gemv_supported(kGemvMaxRows, 4096, 1280));
  EXPECT_TRUE(gemm_gemv_supported(8, 1792, kGemvMaxK));
  EXPECT_FALSE(gemm_gemv_supported(9, 1792, kGemvMaxK));  // two token tiles: at most 8 warps, k <= 2560
  EXPECT_TRUE(gemm_gemv_supported(9, 1792, 2560));
  EXPECT_FALSE(gemm_gemv_supported(9, 1792, 2592));
  EXPECT_FALSE(gemm_gemv_supported(kGemvMaxRows + 1, 4096, 1280));
  EXPECT_FALSE(gemm_gemv_supported(0, 4096, 1280));
  EXPECT_FALSE(gemm_gemv_supported(1, 4096, kGemvMaxK + 32));
  EXPECT_FALSE(gemm_gemv_supported(1, 4096, 1280, 2));
  EXPECT_FALSE(gemm_gemv_supported(1, 4096 + 16, 1280));
  {
    const GemmPlan a = plan_gemm_gemv(1, 4096, 1280), b = plan_gemm(GemmVersion::kGemv, 7, 4096, 1280, 1);
    EXPECT_EQ(a.tiles_n, 256);
    EXPECT_EQ(a.block_n, 16);
    EXPECT_EQ(a.splits, 4);
    EXPECT_EQ(b.splits, a.splits);
    EXPECT_EQ(plan_gemm_gemv(1, 1792, 5120).splits, 16);
  }
  const Fp8Case cs{64, 320};
  const Fp8Weights w = make_fp8_weights(cs, Data::kExact, 2600);
  const Fp8Acts a = make_fp8_acts(cs, kGemvMaxRows + 1, Data::kExact, 2601);
  const OutLayout l = make_layout(kGemvMaxRows + 1, cs.n);
  DeviceBuffer<bf16_t> out(l.elems());
  out.fill_bytes(kPoisonByte);
  const auto refuse = [&](const char* what, const std::function<void(Fp8GemmParams&)>& edit) {
    Fp8GemmParams p = fp8_params(w, a, out.get(), l);
    p.m = 1;
    edit(p);
    EXPECT_THROW(run_gemm_fp8(p, GemmWorkspace{}, GemmVersion::kGemv, nullptr, false), std::invalid_argument) << what;
  };
  refuse("m 17", [](Fp8GemmParams& p) { p.m = kGemvMaxRows + 1; });
  refuse("groups 2", [](Fp8GemmParams& p) { p.groups = 2; });
  refuse("force_splits", [](Fp8GemmParams& p) { p.force_splits = 2; });
  refuse("force_mtiles", [](Fp8GemmParams& p) { p.force_mtiles = 1; });
  refuse("force_stages", [](Fp8GemmParams& p) { p.force_stages = 1; });
  refuse("rope", [](Fp8GemmParams& p) { p.rope_pos = reinterpret_cast<const int32_t*>(p.a_q); });
  V4_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<bf16_t> h = to_host(out);
  for (const bf16_t v : h) ASSERT_EQ(v, static_cast<bf16_t>(kPoisonByte * 0x101)) << "a refused call wrote the output";
  {  // k beyond kGemvMaxK (a valid GEMM otherwise)
    const Fp8Case big{32, kGemvMaxK + 32};
    const Fp8Weights wb = make_fp8_weights(big, Data::kExact, 2602);
    const Fp8Acts ab = make_fp8_acts(big, 1, Data::kExact, 2603);
    const OutLayout lb = make_layout(1, big.n);
    DeviceBuffer<bf16_t> ob(lb.elems());
    EXPECT_THROW(run_gemm_fp8(fp8_params(wb, ab, ob.get(), lb), GemmWorkspace{}, GemmVersion::kGemv, nullptr, false),
                 std::invalid_argument);
  }
}

// Split-K results do not depend on timing, on PDL, or on a reused workspace (v1, v2 and v3 (v3
// does not use it); the versions also share one workspace, as an engine's lanes do when the
// version is switched).
TEST(GpuGemm, DeterministicAcrossRunsPdlAndWorkspaceReuse) {
  V4_REQUIRE_GPU();
  use_all_cores();
  const Fp8Case cs{1792, 5120};
  const int m = 24;
  const Fp8Weights w = make_fp8_weights(cs, Data::kRealistic, 76);
  const Fp8Acts a = make_fp8_acts(cs, m, Data::kRealistic, 77);
  const size_t ws_bytes = gemm_workspace_bytes(m, cs.n, cs.k, 1);
  DeviceBuffer<uint8_t> ws(ws_bytes);
  const GemmWorkspace gws{ws.get(), ws_bytes};
  init_gemm_workspace(gws, nullptr);
  const auto want = ref_fp8(w, a);
  const OutLayout l = make_layout(m, cs.n);
  DeviceBuffer<bf16_t> out(l.elems());
  for (GemmVersion v :
       {GemmVersion::kTensorCore, GemmVersion::kWgmma, GemmVersion::kWgmmaPipelined, GemmVersion::kTensorCore}) {
    const GemmPlan plan = plan_gemm(v, m, cs.n, cs.k, 1);
    ASSERT_GT(plan.splits, 1) << "this test is about the split-K reduction";
    ASSERT_LE(plan.workspace_bytes, ws_bytes);
    std::vector<bf16_t> first;
    for (int rep = 0; rep < 6; ++rep) {  // one workspace, stream-ordered GEMMs, pdl alternating
      out.fill_bytes(kPoisonByte);
      run_gemm_fp8(fp8_params(w, a, out.get(), l), gws, v, nullptr, rep % 2 == 1);
      V4_CUDA_CHECK(cudaDeviceSynchronize());
      const std::vector<bf16_t> got = to_host(out);
      if (rep == 0) first = got;
      else EXPECT_TRUE(got == first) << gemm_version_name(v) << " rep " << rep << " differs from rep 0";
    }
    // The arrival counters are back to zero after every GEMM.
    std::vector<uint32_t> counters(static_cast<size_t>(plan.tiles_n));
    V4_CUDA_CHECK(cudaMemcpy(counters.data(), ws.get(), counters.size() * 4, cudaMemcpyDeviceToHost));
    for (uint32_t c : counters) EXPECT_EQ(c, 0u) << gemm_version_name(v);
    const DiffStats s = check_bf16(first, l, dense_want(want, cs.n), 1, std::string("determinism case ") + gemm_version_name(v), true);
    EXPECT_LE(s.max_ulps, 1);
  }
}

// run_gemm_bf16 / run_gemm_f32 take kWgmma / kWgmmaPipelined as "the best version" and run their
// v1: same bytes.
TEST(GpuGemm, WgmmaVersionRunsV1ForBf16AndF32) {
  V4_REQUIRE_GPU();
  const Bf16Case cs{512, 5120};
  const int m = 7;
  const int64_t x_stride = cs.k + 56;
  const std::vector<bf16_t> x = make_x(m, cs.k, x_stride, Data::kRealistic, 1234);
  const ref::Bf16Matrix w = make_bf16_weight(cs.n, cs.k, Data::kRealistic, 1235);
  const DeviceBuffer<bf16_t> dx = to_device(x), dw = to_device(w.w);
  const OutLayout l = make_layout(m, cs.n);
  EXPECT_TRUE(run_bf16(cs, m, dx, x_stride, dw, l, GemmVersion::kWgmma) == run_bf16(cs, m, dx, x_stride, dw, l, GemmVersion::kTensorCore));
  EXPECT_TRUE(run_bf16(cs, m, dx, x_stride, dw, l, GemmVersion::kWgmmaPipelined) ==
              run_bf16(cs, m, dx, x_stride, dw, l, GemmVersion::kTensorCore));
  // v6 is fp8 only: a bf16 call given it runs the bf16 kAuto choice.
  EXPECT_TRUE(run_bf16(cs, m, dx, x_stride, dw, l, GemmVersion::kGemv) == run_bf16(cs, m, dx, x_stride, dw, l, GemmVersion::kAuto));
  const ref::F32Matrix wf = make_f32_weight(64, 260, Data::kRealistic, 1236);
  const DeviceBuffer<float> dwf = to_device(wf.w);
  std::vector<float> outs[4];
  for (int i = 0; i < 4; ++i) {
    DeviceBuffer<float> out(static_cast<size_t>(m * 64));
    out.fill_bytes(kPoisonByte);
    F32GemmParams p;
    p.x = dx.get();
    p.x_stride = x_stride;
    p.w = dwf.get();
    p.out = out.get();
    p.out_stride = 64;
    p.m = m;
    p.n = 64;
    p.k = 260;
    run_gemm_f32(p,
                 i == 0   ? GemmVersion::kWgmma
                 : i == 1 ? GemmVersion::kTensorCore
                 : i == 2 ? GemmVersion::kWgmmaPipelined
                          : GemmVersion::kGemv,  // v6 is fp8 only: kAuto's choice (v1 at m 7)
                 nullptr, false);
    V4_CUDA_CHECK(cudaDeviceSynchronize());
    outs[i] = to_host(out);
  }
  EXPECT_EQ(0, std::memcmp(outs[0].data(), outs[1].data(), outs[0].size() * sizeof(float)));
  EXPECT_EQ(0, std::memcmp(outs[2].data(), outs[1].data(), outs[0].size() * sizeof(float)));
  EXPECT_EQ(0, std::memcmp(outs[3].data(), outs[1].data(), outs[0].size() * sizeof(float)));
}

TEST(GpuGemm, Bf16RealShapes) {
  V4_REQUIRE_GPU();
  use_all_cores();
  const struct {
    const char* name;
    Bf16Case cs;
  } shapes[] = {{"compressor r1 wkv", {512, 5120}}, {"weights_proj", {32, 5120}}, {"wk", {128, 512}}};
  uint64_t seed = 400;
  for (const auto& sh : shapes) {
    DiffStats agg;
    for (int m : kAllM) {
      agg.add(check_bf16_case(sh.cs, m, Data::kRealistic, ++seed, m <= 8));
      check_bf16_case(sh.cs, m, Data::kExact, ++seed, false);
    }
    expect_realistic_stats(agg, std::string(sh.name) + " all m");
  }
}

// wo_a: 8 groups of [1024, 4096] on o viewed [T, 8, 4096], output [T, 8192].
TEST(GpuGemm, Bf16WoAGrouped) {
  V4_REQUIRE_GPU();
  use_all_cores();
  const Bf16Case cs{1024, 4096, 8};
  DiffStats agg;
  uint64_t seed = 500;
  for (int m : {1, 6, 13}) {
    agg.add(check_bf16_case(cs, m, Data::kRealistic, ++seed, m == 1));
  }
  check_bf16_case(cs, 13, Data::kExact, ++seed, false);
  expect_realistic_stats(agg, "wo_a grouped");
}

TEST(GpuGemm, Bf16SmallShapesAllPaths) {
  V4_REQUIRE_GPU();
  use_all_cores();
  const Bf16Case cases[] = {{32, 32, 1, 0, 0},   {96, 160, 1, 0, 0}, {160, 416, 1, 3, 2}, {224, 288, 1, 1, 2},
                            {64, 800, 1, 7, 1},  {96, 224, 3, 2, 0}, {128, 128, 2, 0, 2}, {32, 5120, 1, 0, 0},
                            {288, 1056, 1, 5, 2}};
  // m = 25..32 with 64-row CTAs is exactly 48 KB of dynamic shared memory (the launch must raise
  // the limit although it is not above 48 KB: the kernel also has static shared memory).
  const int ms[] = {1, 3, 7, 8, 9, 16, 17, 25, 31, 32, 33, 47, 57, 64};
  uint64_t seed = 600;
  DiffStats agg;
  for (const Bf16Case& cs : cases)
    for (int m : ms) {
      check_bf16_case(cs, m, Data::kExact, ++seed, m == 3);
      if (m == 9 || m == 64) agg.add(check_bf16_case(cs, m, Data::kRealistic, ++seed, false));
    }
  expect_realistic_stats(agg, "bf16 small shapes, realistic");
}

// Ratio-2 compressor [wkv; wgate]: 1024 x 5120 fp32.
TEST(GpuGemm, F32CompressorShape) {
  V4_REQUIRE_GPU();
  use_all_cores();
  uint64_t seed = 700;
  for (int m : kAllM) {
    check_f32_case(1024, 5120, m, Data::kExact, ++seed, GemmVersion::kTensorCore);
    check_f32_case(1024, 5120, m, Data::kRealistic, ++seed, GemmVersion::kTensorCore);
  }
  check_f32_case(1024, 5120, 6, Data::kRealistic, ++seed, GemmVersion::kSimple);
}

TEST(GpuGemm, F32SmallShapes) {
  V4_REQUIRE_GPU();
  use_all_cores();
  uint64_t seed = 800;
  for (int64_t n : {4, 12, 64})
    for (int64_t k : {4, 36, 260, 1028, 2052})
      for (int m : {1, 5, 16, 17, 33, 64, 70}) {
        check_f32_case(n, k, m, Data::kExact, ++seed, GemmVersion::kTensorCore);
        if (m == 17) check_f32_case(n, k, m, Data::kRealistic, ++seed, GemmVersion::kTensorCore);
        if (m == 5) check_f32_case(n, k, m, Data::kRealistic, ++seed, GemmVersion::kSimple);
      }
}

// Host-side validation: runs with or without a GPU (the launchers throw before touching CUDA).
TEST(GpuGemm, RefusesBadArguments) {
  const bool gpu = gpu_available();
  // Backing storage: device buffers on a GPU machine (so the valid control call really runs),
  // 256-byte aligned host memory otherwise (never dereferenced: every call below throws first).
  const size_t bytes = 1 << 20;
  DeviceBuffer<uint8_t> dbuf;
  std::vector<uint8_t> hbuf;
  uint8_t* base = nullptr;
  if (gpu) {
    dbuf.resize(bytes);
    dbuf.fill_bytes(0);
    base = dbuf.get();
  } else {
    hbuf.resize(bytes + 256);
    base = hbuf.data() + (256 - reinterpret_cast<uintptr_t>(hbuf.data()) % 256) % 256;
  }
  const GemmWorkspace no_ws{};
  auto valid_fp8 = [&] {
    Fp8GemmParams p;
    p.a_q = base;
    p.a_stride = 64;
    p.a_scale = base + 8192;
    p.a_scale_stride = 2;
    p.w = base + 16384;
    p.w_scale = base + 65536;
    p.out = reinterpret_cast<bf16_t*>(base + 131072);
    p.out_stride = 64;
    p.m = 4;
    p.n = 64;
    p.k = 64;
    p.force_splits = 1;
    return p;
  };
  auto expect_refused = [&](const Fp8GemmParams& p, GemmVersion v, const GemmWorkspace& ws, const char* what) {
    EXPECT_THROW(run_gemm_fp8(p, ws, v, nullptr, false), std::invalid_argument) << what;
  };
  for (GemmVersion v : {GemmVersion::kSimple, GemmVersion::kTensorCore, GemmVersion::kWgmma, GemmVersion::kWgmmaPipelined}) {
    Fp8GemmParams p = valid_fp8();
    p.n = 48;
    expect_refused(p, v, no_ws, "n % 32");
    p = valid_fp8();
    p.k = 40;
    p.a_stride = 48;
    expect_refused(p, v, no_ws, "k % 32");
    p = valid_fp8();
    p.m = -1;
    expect_refused(p, v, no_ws, "m < 0");
    p = valid_fp8();
    p.w = nullptr;
    expect_refused(p, v, no_ws, "null w");
    p = valid_fp8();
    p.a_q = base + 1;
    expect_refused(p, v, no_ws, "misaligned a_q");
    p = valid_fp8();
    p.a_stride = 72;
    expect_refused(p, v, no_ws, "a_stride % 16");
    p = valid_fp8();
    p.a_stride = 32;
    expect_refused(p, v, no_ws, "a_stride < k");
    p = valid_fp8();
    p.out_stride = 63;
    expect_refused(p, v, no_ws, "out_stride < n");
    p = valid_fp8();
    p.a_scale_stride = 1;
    expect_refused(p, v, no_ws, "a_scale_stride < k/32");
    p = valid_fp8();
    p.groups = 0;
    expect_refused(p, v, no_ws, "groups 0");
  }
  for (GemmVersion v : {GemmVersion::kTensorCore, GemmVersion::kWgmma}) {
    Fp8GemmParams p = valid_fp8();
    p.m = 65;
    expect_refused(p, v, no_ws, "m > 64");
    p = valid_fp8();
    p.force_splits = 2;  // needs a workspace
    expect_refused(p, v, no_ws, "missing workspace");
    const GemmPlan plan = plan_gemm(v, p.m, p.n, p.k, 1, 2, 0);
    ASSERT_GT(plan.workspace_bytes, 8u);
    expect_refused(p, v, GemmWorkspace{base + 262144, plan.workspace_bytes - 4}, "small workspace");
    expect_refused(p, v, GemmWorkspace{base + 262148, plan.workspace_bytes}, "misaligned workspace");
  }
  {  // v2: a CTA's K range must fit in shared memory (here 8192 blocks in one CTA), and no negative overrides
    Fp8GemmParams p = valid_fp8();
    p.k = 32 * 8192;
    p.a_stride = p.k;
    p.a_scale_stride = 8192;
    p.force_splits = 1;
    EXPECT_EQ(plan_gemm_wgmma(p.m, p.n, p.k, 1, 1, 0).stages, 0);
    expect_refused(p, GemmVersion::kWgmma, no_ws, "v2 K range too long for one CTA");
    p = valid_fp8();
    p.force_stages = -1;
    expect_refused(p, GemmVersion::kWgmma, no_ws, "v2 force_stages < 0");
    p = valid_fp8();
    p.prewait_stages = -2;
    expect_refused(p, GemmVersion::kWgmma, no_ws, "prewait_stages < -1");
    p = valid_fp8();
    p.v2_overlap = 3;
    expect_refused(p, GemmVersion::kWgmma, no_ws, "v2_overlap 3");
    p = valid_fp8();
    p.prewait_pace_ns = -1;
    expect_refused(p, GemmVersion::kWgmma, no_ws, "prewait_pace_ns < 0");
    EXPECT_THROW(plan_gemm_wgmma(65, 64, 64, 1), std::invalid_argument);
    EXPECT_THROW(plan_gemm_wgmma(4, 64, 64, 1, 0, 3), std::invalid_argument);
  }
  {  // v3: m <= 64, the K range of a CTA must fit (at most 8 splits), no negative overrides, a valid
     // widening mask; it never needs a workspace.
    Fp8GemmParams p = valid_fp8();
    p.m = 65;
    expect_refused(p, GemmVersion::kWgmmaPipelined, no_ws, "v3 m > 64");
    p = valid_fp8();
    p.k = 32 * 65536;  // 8192 blocks per CTA with the most splits (8)
    p.a_stride = p.k;
    p.a_scale_stride = 65536;
    p.force_splits = 8;
    EXPECT_EQ(plan_gemm_wgmma_pipelined(p.m, p.n, p.k, 1, 8, 0).stages, 0);
    EXPECT_EQ(plan_gemm_wgmma_pipelined(p.m, p.n, p.k, 1, 64, 0).splits, 8);  // capped at the cluster size
    expect_refused(p, GemmVersion::kWgmmaPipelined, no_ws, "v3 K range too long for one CTA");
    p = valid_fp8();
    p.force_stages = -1;
    expect_refused(p, GemmVersion::kWgmmaPipelined, no_ws, "v3 force_stages < 0");
    p = valid_fp8();
    p.v3_int_mask = 16;
    expect_refused(p, GemmVersion::kWgmmaPipelined, no_ws, "v3 int mask 16");
    p.v3_int_mask = -2;
    expect_refused(p, GemmVersion::kWgmmaPipelined, no_ws, "v3 int mask -2");
    EXPECT_THROW(plan_gemm_wgmma_pipelined(65, 64, 64, 1), std::invalid_argument);
    EXPECT_THROW(plan_gemm_wgmma_pipelined(4, 64, 64, 1, 0, 3), std::invalid_argument);
    EXPECT_EQ(plan_gemm_wgmma_pipelined(4, 64, 64, 1, 2, 0).workspace_bytes, 0u);
  }
  // bf16 / f32 / act quant.
  {
    Bf16GemmParams p;
    p.x = reinterpret_cast<const bf16_t*>(base);
    p.x_stride = 64;
    p.w = reinterpret_cast<const bf16_t*>(base + 16384);
    p.out = reinterpret_cast<bf16_t*>(base + 131072);
    p.out_stride = 64;
    p.m = 4;
    p.n = 64;
    p.k = 64;
    Bf16GemmParams q = p;
    q.k = 48;
    EXPECT_THROW(run_gemm_bf16(q, no_ws, GemmVersion::kTensorCore, nullptr, false), std::invalid_argument);
    q = p;
    q.x_stride = 68;
    EXPECT_THROW(run_gemm_bf16(q, no_ws, GemmVersion::kTensorCore, nullptr, false), std::invalid_argument);
    q = p;
    q.x = reinterpret_cast<const bf16_t*>(base + 2);
    EXPECT_THROW(run_gemm_bf16(q, no_ws, GemmVersion::kSimple, nullptr, false), std::invalid_argument);
    q = p;
    q.m = 100;
    EXPECT_THROW(run_gemm_bf16(q, no_ws, GemmVersion::kTensorCore, nullptr, false), std::invalid_argument);
  }
  {
    F32GemmParams p;
    p.x = reinterpret_cast<const bf16_t*>(base);
    p.x_stride = 64;
    p.w = reinterpret_cast<const float*>(base + 16384);
    p.out = reinterpret_cast<float*>(base + 131072);
    p.out_stride = 64;
    p.m = 4;
    p.n = 64;
    p.k = 64;
    F32GemmParams q = p;
    q.n = 6;
    q.out_stride = 6;
    EXPECT_THROW(run_gemm_f32(q, GemmVersion::kTensorCore, nullptr, false), std::invalid_argument);
    q = p;
    q.k = 66;
    q.x_stride = 68;
    EXPECT_THROW(run_gemm_f32(q, GemmVersion::kSimple, nullptr, false), std::invalid_argument);
    q = p;
    q.w = reinterpret_cast<const float*>(base + 16388);
    EXPECT_THROW(run_gemm_f32(q, GemmVersion::kTensorCore, nullptr, false), std::invalid_argument);
    q = p;
    q.out = nullptr;
    EXPECT_THROW(run_gemm_f32(q, GemmVersion::kTensorCore, nullptr, false), std::invalid_argument);
  }
  {
    ActQuantParams p;
    p.x = reinterpret_cast<const bf16_t*>(base);
    p.x_stride = 64;
    p.q = base + 16384;
    p.q_stride = 64;
    p.scale = base + 32768;
    p.scale_stride = 2;
    p.m = 4;
    p.k = 64;
    ActQuantParams q = p;
    q.k = 48;
    EXPECT_THROW(run_act_quant_fp8(q, nullptr, false), std::invalid_argument);
    q = p;
    q.q_stride = 48;  // < k
    EXPECT_THROW(run_act_quant_fp8(q, nullptr, false), std::invalid_argument);
    q = p;
    q.x_stride = 63;  // < k
    EXPECT_THROW(run_act_quant_fp8(q, nullptr, false), std::invalid_argument);
    q = p;
    q.warps_per_cta = 33;
    EXPECT_THROW(run_act_quant_fp8(q, nullptr, false), std::invalid_argument);
    q.warps_per_cta = -1;
    EXPECT_THROW(run_act_quant_fp8(q, nullptr, false), std::invalid_argument);
    q = p;
    q.scale = nullptr;
    EXPECT_THROW(run_act_quant_fp8(q, nullptr, false), std::invalid_argument);
    q = p;
    q.scale_stride = 1;
    EXPECT_THROW(run_act_quant_fp8(q, nullptr, false), std::invalid_argument);
  }
  // m == 0 launches nothing and is accepted.
  {
    Fp8GemmParams p = valid_fp8();
    p.m = 0;
    EXPECT_NO_THROW(run_gemm_fp8(p, no_ws, GemmVersion::kTensorCore, nullptr, false));
  }
  // The valid control really runs (GPU only): a refusal test that refuses everything would pass
  // the checks above.
  if (gpu) {
    EXPECT_NO_THROW(run_gemm_fp8(valid_fp8(), no_ws, GemmVersion::kTensorCore, nullptr, false));
    EXPECT_NO_THROW(run_gemm_fp8(valid_fp8(), no_ws, GemmVersion::kWgmma, nullptr, false));
    EXPECT_NO_THROW(run_gemm_fp8(valid_fp8(), no_ws, GemmVersion::kWgmmaPipelined, nullptr, false));
    Fp8GemmParams split = valid_fp8();  // v3 splits K without a workspace (cluster reduction)
    split.force_splits = 2;
    EXPECT_NO_THROW(run_gemm_fp8(split, no_ws, GemmVersion::kWgmmaPipelined, nullptr, false));
    EXPECT_NO_THROW(run_gemm_fp8(valid_fp8(), no_ws, GemmVersion::kSimple, nullptr, false));
    V4_CUDA_CHECK(cudaDeviceSynchronize());
  } else {
    for (GemmVersion v : {GemmVersion::kTensorCore, GemmVersion::kWgmma, GemmVersion::kWgmmaPipelined}) {
      try {
        run_gemm_fp8(valid_fp8(), no_ws, v, nullptr, false);
      } catch (const std::invalid_argument& e) {
        ADD_FAILURE() << "valid arguments refused: " << e.what();
      } catch (...) {  // no device: the launch (or the tensor-map encoding) fails, which is fine here
      }
    }
  }
}

// The automatic plans: S depends on (n, k, groups) only; v1 gives the model's shapes ~256 CTAs,
// v2 and v3 ~one CTA per SM (>= 110 of 132) with a ring of >= 2 stages (or all of a CTA's stages)
// at any m. gemm_workspace_bytes covers v1 and v2; v3 needs none.
TEST(GpuGemm, PlanCoversTheMachine) {
  const struct {
    int64_t n, k;
    int groups;
    bool fp8;  // v2 plans only for the fp8 shapes
  } shapes[] = {{1792, 5120, 1, true}, {32768, 1280, 1, true}, {8192, 1280, 1, true}, {4096, 1280, 1, true},
                {5120, 8192, 1, true}, {512, 5120, 1, false},  {32, 5120, 1, false},  {128, 512, 1, false},
                {1024, 4096, 8, false}};
  for (const auto& s : shapes) {
    const GemmPlan a = plan_gemm_tc(1, s.n, s.k, s.groups), b = plan_gemm_tc(64, s.n, s.k, s.groups);
    EXPECT_EQ(a.splits, b.splits);
    EXPECT_EQ(a.warp_mtiles, b.warp_mtiles);
    const int64_t ctas = static_cast<int64_t>(a.tiles_n) * a.splits * s.groups;
    EXPECT_GE(ctas, std::min<int64_t>(128, static_cast<int64_t>(a.tiles_n) * s.groups * (s.k / 32 / 4)))
        << s.n << "x" << s.k;
    EXPECT_LE(a.splits, s.k / 32);
    EXPECT_GE(gemm_workspace_bytes(64, s.n, s.k, s.groups), b.workspace_bytes);
    std::printf("[ gemm ] v1 plan %6lldx%-5lld g%d: MT %d, tiles %d, S %d -> %lld CTAs, workspace(m=64) %zu B\n",
                static_cast<long long>(s.n), static_cast<long long>(s.k), s.groups, a.warp_mtiles, a.tiles_n,
                a.splits, static_cast<long long>(ctas), b.workspace_bytes);
    if (!s.fp8) continue;
    const int64_t kb = s.k / 32;
    GemmPlan v2_first;
    for (int m = 1; m <= 64; ++m) {
      const GemmPlan p = plan_gemm_wgmma(m, s.n, s.k, s.groups);
      if (m == 1) v2_first = p;
      EXPECT_EQ(p.splits, v2_first.splits) << "m " << m;
      EXPECT_EQ(p.warp_mtiles, v2_first.warp_mtiles) << "m " << m;
      const int n_iter = static_cast<int>(((kb + p.splits - 1) / p.splits + 3) / 4);
      EXPECT_GE(p.stages, std::min(2, n_iter)) << s.n << "x" << s.k << " m " << m;
      EXPECT_LE(p.smem_bytes, size_t{227 * 1024});
      EXPECT_GE(gemm_workspace_bytes(64, s.n, s.k, s.groups), p.workspace_bytes);
    }
    const GemmPlan p1 = plan_gemm_wgmma(1, s.n, s.k, s.groups), p64 = plan_gemm_wgmma(64, s.n, s.k, s.groups);
    const int64_t ctas2 = static_cast<int64_t>(p1.tiles_n) * p1.splits * s.groups;
    EXPECT_GE(ctas2, 110) << s.n << "x" << s.k;
    EXPECT_LE(ctas2, 132) << s.n << "x" << s.k << ": one wave of one CTA per SM";
    std::printf("[ gemm ] v2 plan %6lldx%-5lld g%d: MT %d, tiles %d, S %d -> %lld CTAs, stages %d (m=1) / %d (m=64), "
                "smem %zu / %zu B, workspace(m=64) %zu B\n",
                static_cast<long long>(s.n), static_cast<long long>(s.k), s.groups, p1.warp_mtiles, p1.tiles_n, p1.splits,
                static_cast<long long>(ctas2), p1.stages, p64.stages, p1.smem_bytes, p64.smem_bytes, p64.workspace_bytes);
    // v3: the same rules, S <= 8 (one cluster per output tile), no workspace; above 120 CTAs two
    // m64 tiles per warpgroup and ~96 CTAs (clusters of S need S free SMs of one GPC).
    GemmPlan v3_first;
    for (int m = 1; m <= 64; ++m) {
      const GemmPlan p = plan_gemm_wgmma_pipelined(m, s.n, s.k, s.groups);
      if (m == 1) v3_first = p;
      EXPECT_EQ(p.splits, v3_first.splits) << "m " << m;
      EXPECT_EQ(p.warp_mtiles, v3_first.warp_mtiles) << "m " << m;
      EXPECT_LE(p.splits, 8);
      EXPECT_EQ(p.cluster, p.splits);
      EXPECT_EQ(p.workspace_bytes, 0u);
      const int n_iter = static_cast<int>(((kb + p.splits - 1) / p.splits + 3) / 4);
      EXPECT_GE(p.stages, std::min(2, n_iter)) << s.n << "x" << s.k << " m " << m;
      EXPECT_LE(p.smem_bytes, size_t{227 * 1024});
    }
    const GemmPlan q1 = plan_gemm_wgmma_pipelined(1, s.n, s.k, s.groups), q64 = plan_gemm_wgmma_pipelined(64, s.n, s.k, s.groups);
    const int64_t ctas3 = static_cast<int64_t>(q1.tiles_n) * q1.splits * s.groups;
    // One wave of clusters (gemm_wgmma_pipelined.cu: kOneWaveCtas, kClusterCtas): 90..120 CTAs.
    EXPECT_GE(ctas3, 90) << s.n << "x" << s.k;
    EXPECT_LE(ctas3, q1.splits > 1 ? 120 : 132) << s.n << "x" << s.k << ": one wave (of clusters) of one CTA per SM";
    std::printf("[ gemm ] v3 plan %6lldx%-5lld g%d: MT %d, tiles %d, S %d -> %lld CTAs, stages %d (m=1) / %d (m=64), "
                "smem %zu / %zu B\n",
                static_cast<long long>(s.n), static_cast<long long>(s.k), s.groups, q1.warp_mtiles, q1.tiles_n, q1.splits,
                static_cast<long long>(ctas3), q1.stages, q64.stages, q1.smem_bytes, q64.smem_bytes);
  }
  EXPECT_EQ(best_fp8_gemm_version(1), GemmVersion::kWgmma);
  EXPECT_EQ(best_fp8_gemm_version(64), GemmVersion::kWgmma);
  EXPECT_EQ(best_fp8_gemm_version(65), GemmVersion::kSimple);
}

// Host-only: the stack's default (kAuto) picks what run 9 measured fastest per shape, and its plan is
// that version's plan.
TEST(GpuGemm, AutoPicksTheMeasuredVersionPerShape) {
  using v4attn::kernels::GemmVersion;
  using v4attn::kernels::best_fp8_gemm_version;
  for (int m : {1, 6, 8, 24, 48, 64}) {
    EXPECT_EQ(best_fp8_gemm_version(m, 1792, 5120), GemmVersion::kWgmmaPipelined) << m;  // wq_a|wkv
    EXPECT_EQ(best_fp8_gemm_version(m, 32768, 1280), GemmVersion::kWgmma) << m;          // wq_b
    EXPECT_EQ(best_fp8_gemm_version(m, 4096, 1280), GemmVersion::kWgmmaPipelined) << m;  // indexer wq_b
    EXPECT_EQ(best_fp8_gemm_version(m, 5120, 8192), GemmVersion::kWgmma) << m;           // wo_b
  }
  EXPECT_EQ(best_fp8_gemm_version(65, 1792, 5120), GemmVersion::kSimple);
  const auto a = v4attn::kernels::plan_gemm(GemmVersion::kAuto, 6, 1792, 5120, 1);
  const auto b = v4attn::kernels::plan_gemm(GemmVersion::kWgmmaPipelined, 6, 1792, 5120, 1);
  EXPECT_EQ(a.splits, b.splits);
  EXPECT_EQ(a.tiles_n, b.tiles_n);
}

// ---- v3 with the act quant fused in (run_gemm_fp8_fused_quant) ------------------------------------
// The fused GEMM must give exactly the bytes of run_act_quant_fp8 + run_gemm_fp8(kWgmmaPipelined) on
// the same x (the whole output buffer, poison included), with and without PDL, and stay within the
// realistic-data allowance of the CPU reference (ref::act_quant + ref::gemm_fp8).
namespace {

// x [rows_alloc, stride] bf16 with every kind of 32-block: all zeros (amax floor), tiny (below the
// 1e-4 floor), large, mixed magnitudes (a few big values among tiny ones: most codes round to 0
// or subnormals), negative zeros, ordinary. Columns >= k and rows >= m hold junk (1e30) that must never
// reach the result.
std::vector<bf16_t> make_fused_x(int m, int rows_alloc, int64_t k, int64_t stride, uint64_t seed) {
  Rng rng(seed);
  std::vector<bf16_t> x(static_cast<size_t>(rows_alloc * stride), num::bf16_from_f32(1.0e30f));
  for (int r = 0; r < m; ++r)
    for (int64_t b = 0; b < k / 32; ++b) {
      const int kind = rng.range(0, 7);
      const int e = rng.range(-6, 3);
      for (int64_t c = b * 32; c < b * 32 + 32; ++c) {
        float v;
        switch (kind) {
          case 0: v = 0.0f; break;
          case 1: v = std::ldexp(rng.uniform(), rng.range(-40, -16)); break;  // tiny: amax < 1e-4
          case 2: v = std::ldexp(rng.uniform(), rng.range(8, 40)); break;     // large
          case 3: v = c == b * 32 + rng.range(0, 31) ? std::ldexp(1.0f, 12) : std::ldexp(rng.uniform(), -12); break;
          case 4: v = rng.range(0, 1) ? -0.0f : std::ldexp(rng.uniform(), e); break;
          default: v = std::ldexp(rng.uniform(), e); break;
        }
        x[static_cast<size_t>(r * stride + c)] = num::bf16_from_f32(v);
      }
    }
  return x;
}

struct FusedCase {
  int64_t n = 0, k = 0;
  int force_splits = 0, force_mtiles = 0;
};

Fp8GemmParams fused_params(const Fp8Weights& w, const bf16_t* x, int64_t x_stride, int m, bf16_t* out,
                           const OutLayout& l) {
  Fp8GemmParams g;
  g.a_bf16 = x;
  g.a_bf16_stride = x_stride;
  g.w = w.d_w.get();
  g.w_scale = w.d_ws.get();
  g.out = out;
  g.out_stride = l.stride;
  g.m = m;
  g.n = w.cs.n;
  g.k = w.cs.k;
  g.force_splits = w.cs.force_splits;
  g.force_mtiles = w.cs.force_mtiles;
  return g;
}

// One shape at every supported m: fused vs unfused bytes (pdl off / on), fused vs the reference.
void check_fused_case(const FusedCase& fc, uint64_t seed, bool whole_set_supported) {
  Fp8Case cs;
  cs.n = fc.n;
  cs.k = fc.k;
  cs.force_splits = fc.force_splits;
  cs.force_mtiles = fc.force_mtiles;
  const Fp8Weights w = make_fp8_weights(cs, Data::kRealistic, seed);
  const int64_t k = fc.k, kb = k / 32;
  const int64_t x_stride = k + 40;  // a multiple of 8, junk in the gap
  int ran = 0;
  for (int m : kAllM) {
    const bool auto_plan = fc.force_splits == 0 && fc.force_mtiles == 0;
    if (auto_plan && !gemm_v3_fused_quant_supported(m, fc.n, fc.k)) {
      EXPECT_FALSE(whole_set_supported) << fc.n << "x" << fc.k << " m " << m << " must support the fused act quant";
      continue;
    }
    const std::string name = "fused " + fp8_name(cs, m);
    const std::vector<bf16_t> hx = make_fused_x(m, m + 8, k, x_stride, seed * 41 + static_cast<uint64_t>(m));
    const DeviceBuffer<bf16_t> dx = to_device(hx);
    const OutLayout l = make_layout(m, fc.n);
    // Unfused: act quant into poisoned buffers, then v3 on its codes.
    Fp8Acts a;
    a.m = m;
    a.a_stride = k + 48;
    a.a_scale_stride = kb + 3;
    a.d_aq.resize(static_cast<size_t>(m * a.a_stride));
    a.d_as.resize(static_cast<size_t>(m * a.a_scale_stride));
    a.d_aq.fill_bytes(kPoisonByte);
    a.d_as.fill_bytes(kPoisonByte);
    a.act.push_back(ref::act_quant(hx.data(), m, k, x_stride));
    for (bool pdl : {false, true}) {
      ActQuantParams aq;
      aq.x = dx.get();
      aq.x_stride = x_stride;
      aq.q = a.d_aq.get();
      aq.q_stride = a.a_stride;
      aq.scale = a.d_as.get();
      aq.scale_stride = a.a_scale_stride;
      aq.m = m;
      aq.k = k;
      run_act_quant_fp8(aq, nullptr, pdl);
      const std::vector<bf16_t> unfused = run_fp8(w, a, l, GemmVersion::kWgmmaPipelined, pdl);
      DeviceBuffer<bf16_t> out(l.elems());
      out.fill_bytes(kPoisonByte);
      run_gemm_fp8_fused_quant(fused_params(w, dx.get(), x_stride, m, out.get(), l), GemmVersion::kWgmmaPipelined, nullptr,
                               pdl);
      V4_CUDA_CHECK(cudaDeviceSynchronize());
      const std::vector<bf16_t> fused = to_host(out);
      ASSERT_EQ(fused.size(), unfused.size());
      int bad = 0;
      for (size_t i = 0; i < fused.size(); ++i)
        if (fused[i] != unfused[i] && bad++ < 8)
          ADD_FAILURE() << name << (pdl ? " pdl" : "") << ": element " << i << " (row " << i / l.stride << ", col "
                        << i % l.stride << "): fused 0x" << std::hex << fused[i] << " unfused 0x" << unfused[i] << std::dec;
      EXPECT_EQ(bad, 0) << name << (pdl ? " pdl" : "") << ": fused output differs from act quant + v3";
      if (!pdl) {  // against the CPU reference (the same bytes with pdl, checked above)
        const auto want = ref_fp8(w, a);
        expect_realistic_stats(check_bf16(fused, l, dense_want(want, fc.n), 1, name, true), name);
      }
    }
    ++ran;
  }
  EXPECT_GT(ran, 0) << fc.n << "x" << fc.k << ": no m ran";
}

}  // namespace

TEST(GpuGemmV3FusedQuant, WqaWkvMatchesUnfusedBytes) {
  V4_REQUIRE_GPU();
  use_all_cores();
  check_fused_case({1792, 5120}, 501, true);
}

// Split-K clusters (automatic S = 8 at k 2048), forced S = 3 (partial last stages: 21 / 21 / 22 K
// blocks), two m64 tiles per warpgroup (block_n 256), a partial n tile with an odd number of K
// blocks.
TEST(GpuGemmV3FusedQuant, SmallShapesMatchUnfusedBytes) {
  V4_REQUIRE_GPU();
  use_all_cores();
  uint64_t seed = 510;
  check_fused_case({256, 2048}, ++seed, true);
  check_fused_case({256, 2048, 3, 0}, ++seed, false);
  check_fused_case({512, 1024, 0, 2}, ++seed, false);
  check_fused_case({160, 1056}, ++seed, false);
  check_fused_case({64, 96, 1, 0}, ++seed, false);  // one CTA, one partial stage of 3 K blocks
}

// Host-only: which shapes the fused form supports (the stack relies on wq_a|wkv at every m <= 64).
TEST(GpuGemmV3FusedQuant, SupportPredicate) {
  for (int m = 1; m <= 64; ++m) EXPECT_TRUE(gemm_v3_fused_quant_supported(m, 1792, 5120)) << m;
  EXPECT_TRUE(gemm_v3_fused_quant_supported(6, 256, 2048));
  EXPECT_FALSE(gemm_v3_fused_quant_supported(0, 1792, 5120));
  EXPECT_FALSE(gemm_v3_fused_quant_supported(65, 1792, 5120));
  EXPECT_FALSE(gemm_v3_fused_quant_supported(8, 1800, 5120));
  EXPECT_FALSE(gemm_v3_fused_quant_supported(8, 1792, 5100));
  // 2048 K blocks over <= 8 splits: 64 stages of 4 blocks per CTA, more than the ring holds.
  EXPECT_FALSE(gemm_v3_fused_quant_supported(8, 256, 65536));
  // The predicate is exactly "the automatic plan's ring holds a CTA's whole K range".
  for (int m : kAllM)
    for (int64_t k : {1024, 5120, 8192, 16384, 32768}) {
      const GemmPlan plan = plan_gemm_wgmma_pipelined(m, 1792, k, 1);
      const int64_t msb = (k / 32 + plan.splits - 1) / plan.splits;
      EXPECT_EQ(gemm_v3_fused_quant_supported(m, 1792, k), plan.stages >= (msb + 3) / 4) << m << " " << k;
    }
}

// Host refusals (nothing is launched: every call throws before it; pointers are never dereferenced).
TEST(GpuGemmV3FusedQuant, RefusesBadArguments) {
  const bool gpu = gpu_available();
  const size_t bytes = 1 << 20;
  DeviceBuffer<uint8_t> dbuf;
  std::vector<uint8_t> hbuf;
  uint8_t* base = nullptr;
  if (gpu) {
    dbuf.resize(bytes);
    dbuf.fill_bytes(0);
    base = dbuf.get();
  } else {
    hbuf.resize(bytes + 256);
    base = hbuf.data() + (256 - reinterpret_cast<uintptr_t>(hbuf.data()) % 256) % 256;
  }
  auto valid = [&] {
    Fp8GemmParams p;
    p.a_bf16 = reinterpret_cast<const bf16_t*>(base);
    p.a_bf16_stride = 64;
    p.w = base + 16384;
    p.w_scale = base + 65536;
    p.out = reinterpret_cast<bf16_t*>(base + 131072);
    p.out_stride = 64;
    p.m = 4;
    p.n = 64;
    p.k = 64;
    return p;
  };
  auto refused = [&](const Fp8GemmParams& p, GemmVersion v, const char* what, const char* needle = nullptr) {
    try {
      run_gemm_fp8_fused_quant(p, v, nullptr, false);
      ADD_FAILURE() << what << ": not refused";
    } catch (const std::invalid_argument& e) {
      if (needle) EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << what << ": " << e.what();
    }
  };
  for (GemmVersion v : {GemmVersion::kSimple, GemmVersion::kTensorCore, GemmVersion::kWgmma})
    refused(valid(), v, "not v3", "a_bf16 needs GemmVersion::kWgmmaPipelined");
  Fp8GemmParams p = valid();
  p.a_bf16 = nullptr;
  refused(p, GemmVersion::kWgmmaPipelined, "a_bf16 null");
  p = valid();
  p.a_q = base + 4096;
  refused(p, GemmVersion::kWgmmaPipelined, "a_q with a_bf16");
  p = valid();
  p.a_scale = base + 8192;
  refused(p, GemmVersion::kWgmmaPipelined, "a_scale with a_bf16");
  p = valid();
  p.m = 65;
  refused(p, GemmVersion::kWgmmaPipelined, "m > 64");
  p = valid();
  p.m = -1;
  refused(p, GemmVersion::kWgmmaPipelined, "m < 0");
  p = valid();
  p.n = 48;
  refused(p, GemmVersion::kWgmmaPipelined, "n % 32");
  p = valid();
  p.k = 40;
  refused(p, GemmVersion::kWgmmaPipelined, "k % 32");
  p = valid();
  p.groups = 2;
  refused(p, GemmVersion::kWgmmaPipelined, "groups");
  p = valid();
  p.a_bf16_stride = 32;
  refused(p, GemmVersion::kWgmmaPipelined, "a_bf16_stride < k");
  p = valid();
  p.a_bf16_stride = 68;
  refused(p, GemmVersion::kWgmmaPipelined, "a_bf16_stride % 8");
  p = valid();
  p.a_bf16 = reinterpret_cast<const bf16_t*>(base + 2);
  refused(p, GemmVersion::kWgmmaPipelined, "a_bf16 misaligned");
  p = valid();
  p.w = base + 16384 + 8;
  refused(p, GemmVersion::kWgmmaPipelined, "w misaligned");
  p = valid();
  p.w_scale = nullptr;
  refused(p, GemmVersion::kWgmmaPipelined, "w_scale null");
  p = valid();
  p.out_stride = 32;
  refused(p, GemmVersion::kWgmmaPipelined, "out_stride < n");
  p = valid();
  p.v3_int_mask = 16;
  refused(p, GemmVersion::kWgmmaPipelined, "int mask");
  // k 4096 in one split: 128 K blocks = 32 stages of 4, more than the ring can hold.
  p = valid();
  p.k = 4096;
  p.a_bf16_stride = 4096;
  p.force_splits = 1;
  refused(p, GemmVersion::kWgmmaPipelined, "CTA K range larger than the ring", "whole K range");
  // A forced shallow ring: 2 stages per CTA, 1 in the ring.
  p = valid();
  p.k = 256;
  p.a_bf16_stride = 256;
  p.force_splits = 1;
  p.force_stages = 1;
  refused(p, GemmVersion::kWgmmaPipelined, "force_stages below the CTA's stages", "whole K range");
  if (gpu) {  // the control call runs (m 4, n 64, k 64 over zeros)
    EXPECT_NO_THROW(run_gemm_fp8_fused_quant(valid(), GemmVersion::kWgmmaPipelined, nullptr, false));
    V4_CUDA_CHECK(cudaDeviceSynchronize());
  }
}

// ---- wq_b with q_rope_store fused into the v2 epilogue ---------------------------------------------
namespace {

// The fused GEMM (run_gemm_fp8_rope_store) against the unfused pair (v2 GEMM, then
// run_q_rope_store) on the same inputs: the whole head-padded q_pad buffer byte for byte (padding
// heads and rows past m stay poison), including a row whose position is past the table (not
// written by either, counted once by each).
void check_rope_store_case(int m, uint64_t seed, bool pdl) {
  constexpr int kHeads = 64, kHeadsPad = 72, kHd = 512;
  const Fp8Case cs{static_cast<int64_t>(kHeads) * kHd, 1280};
  ASSERT_TRUE(gemm_v2_rope_store_supported(m, cs.n, cs.k)) << m;
  const Fp8Weights w = make_fp8_weights(cs, Data::kRealistic, seed);
  const Fp8Acts a = make_fp8_acts(cs, m, Data::kRealistic, seed * 3 + 1);
  const int64_t max_pos = 4096;
  Rng rng(seed * 5 + 2);
  std::vector<float> table(static_cast<size_t>(max_pos * 64));
  for (auto& v : table) v = rng.uniform();
  std::vector<int32_t> pos(static_cast<size_t>(m));
  for (auto& p : pos) p = rng.range(0, static_cast<int>(max_pos) - 1);
  if (m > 1) pos[static_cast<size_t>(m / 2)] = static_cast<int32_t>(max_pos);  // past the table: skipped + counted
  const auto d_table = to_device(table);
  const auto d_pos = to_device(pos);
  const size_t pad_elems = static_cast<size_t>(m + 2) * kHeadsPad * kHd;
  DeviceBuffer<bf16_t> q(static_cast<size_t>(m) * kHeads * kHd), want(pad_elems), got(pad_elems);
  DeviceBuffer<unsigned long long> err(2);
  want.fill_bytes(kPoisonByte);
  got.fill_bytes(kPoisonByte);
  err.fill_bytes(0);
  OutLayout l = make_layout(m, cs.n, 1, 0);
  // Unfused: the GEMM into q [m, 64*512], then q_rope_store into q_pad.
  Fp8GemmParams g = fp8_params(w, a, q.get(), l);
  g.out_stride = cs.n;
  run_gemm_fp8(g, GemmWorkspace{}, GemmVersion::kWgmma, nullptr, pdl);
  QRopeStoreParams r;
  r.q = q.get();
  r.q_row_stride = cs.n;
  r.q_pad = want.get();
  r.q_pad_row_stride = static_cast<int64_t>(kHeadsPad) * kHd;
  r.pos = d_pos.get();
  r.table = d_table.get();
  r.max_pos = max_pos;
  r.T = m;
  r.H = kHeads;
  r.H_pad = kHeadsPad;
  r.err_count = err.get();
  run_q_rope_store(r, nullptr, pdl);
  // Fused.
  Fp8GemmParams f = fp8_params(w, a, got.get(), l);
  f.out_stride = static_cast<int64_t>(kHeadsPad) * kHd;
  f.rope_pos = d_pos.get();
  f.rope_table = d_table.get();
  f.rope_max_pos = max_pos;
  f.rope_err = err.get() + 1;
  run_gemm_fp8_rope_store(f, nullptr, pdl);
  V4_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<bf16_t> hw = to_host(want), hg = to_host(got);
  const std::vector<unsigned long long> he = to_host(err);
  EXPECT_EQ(he[0], m > 1 ? 1u : 0u);
  EXPECT_EQ(he[1], he[0]);
  size_t differ = 0, written = 0;
  for (size_t i = 0; i < hw.size(); ++i) {
    if (hw[i] != static_cast<bf16_t>(kPoisonBf16)) ++written;
    if (hw[i] != hg[i] && differ++ < 5) ADD_FAILURE() << "q_pad element " << i << ": fused " << hg[i] << ", unfused " << hw[i];
  }
  EXPECT_EQ(differ, 0u) << "m " << m;
  EXPECT_GT(written, static_cast<size_t>(m - 1) * kHeads * kHd / 2) << "the unfused path wrote almost nothing";
}

}  // namespace

TEST(GpuGemmRopeStore, MatchesGemmThenQRopeStoreBytes) {
  V4_REQUIRE_GPU();
  use_all_cores();
  uint64_t seed = 900;
  for (int m : {1, 6, 16, 24, 32, 40, 64})
    for (bool pdl : {false, true}) check_rope_store_case(m, ++seed, pdl);
}

TEST(GpuGemmRopeStore, SupportPredicateAndRefusals) {
  EXPECT_TRUE(gemm_v2_rope_store_supported(6, 32768, 1280));
  EXPECT_FALSE(gemm_v2_rope_store_supported(6, 32768 + 64, 1280));  // not whole heads
  EXPECT_FALSE(gemm_v2_rope_store_supported(65, 32768, 1280));
  EXPECT_FALSE(gemm_v2_rope_store_supported(6, 4096, 1280));  // v2 splits K / one m64 tile per warpgroup here
  Fp8GemmParams p;
  p.m = 6;
  p.n = 4096;
  p.k = 1280;
  EXPECT_THROW(run_gemm_fp8_rope_store(p, nullptr, false), std::invalid_argument);
  p.n = 32768;
  EXPECT_THROW(run_gemm_fp8_rope_store(p, nullptr, false), std::invalid_argument);  // null pointers, no table
}

// Every operand a real device buffer of its full size (so that a launch, were the check missing,
// would run and write `out` rather than fault on a host address) but a RoPE table the prologue's
// 16-byte loads could not read: refused, and the poisoned output stays untouched; the same call
// with an aligned table is accepted and writes it (so the first half can fail).
TEST(GpuGemmRopeStore, MisalignedTableRefusedOutputUntouched) {
  V4_REQUIRE_GPU();
  const int64_t n = 32768, k = 1280, m = 6;
  DeviceBuffer<uint8_t> w(static_cast<size_t>(n * k)), w_scale(static_cast<size_t>(n / 32 * (k / 32)));
  DeviceBuffer<uint8_t> a_q(static_cast<size_t>(m * k)), a_scale(static_cast<size_t>(m * (k / 32)));
  DeviceBuffer<bf16_t> out(static_cast<size_t>(m * n));
  DeviceBuffer<int32_t> pos(static_cast<size_t>(m));
  DeviceBuffer<float> table(static_cast<size_t>(8 * 64 + 4));
  for (auto* b : {&w, &w_scale, &a_q, &a_scale}) b->fill_bytes(0x38);  // e4m3 1.0, scale 2^-71
  pos.fill_bytes(0);
  table.fill_bytes(0);
  out.fill_bytes(kPoisonByte);
  Fp8GemmParams p;
  p.m = static_cast<int>(m);
  p.n = n;
  p.k = k;
  p.a_q = a_q.get();
  p.a_scale = a_scale.get();
  p.w = w.get();
  p.w_scale = w_scale.get();
  p.out = out.get();
  p.a_stride = k;
  p.a_scale_stride = k / 32;
  p.out_stride = n;
  p.rope_pos = pos.get();
  p.rope_table = table.get() + 1;  // 4-byte aligned, not 16
  p.rope_max_pos = 8;
  EXPECT_THROW(run_gemm_fp8_rope_store(p, nullptr, false), std::invalid_argument);
  V4_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<bf16_t> h = to_host(out);
  EXPECT_TRUE(std::all_of(h.begin(), h.end(), [](bf16_t v) { return v == kPoisonBf16; })) << "a refused call wrote its output";
  p.rope_table = table.get();
  EXPECT_NO_THROW(run_gemm_fp8_rope_store(p, nullptr, false));
  V4_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<bf16_t> h2 = to_host(out);
  EXPECT_FALSE(std::all_of(h2.begin(), h2.end(), [](bf16_t v) { return v == kPoisonBf16; }))
      << "the accepted call wrote nothing (so the refusal above proves nothing)";
}

namespace {

// The fused q_norm (run_gemm_fp8_qnorm) against the two kernels it replaces -- run_rmsnorm with its
// act quant, then the plain v2 GEMM on those codes (and, with rope, the fused RoPE store of both) --
// byte for byte on the wq_b shape, x rows with a stride like the QA output's, poisoned outputs
// (rows m, m + 1 and the columns past n must stay poison).
// dist: the distributed form (qnorm_dist_bar), which also writes the codes, scales and y that
// run_rmsnorm writes: those are compared too, and its two counter words serve several launches in a row.
void check_qnorm_case(int m, uint64_t seed, bool rope, bool pdl, bool dist = false) {
  constexpr int kHeads = 64, kHd = 512;
  constexpr int64_t kQRank = 1280, kXStride = 1792;  // x = the q part of the wq_a|wkv output
  const Fp8Case cs{static_cast<int64_t>(kHeads) * kHd, kQRank};
  if (dist) ASSERT_TRUE(gemm_v2_qnorm_dist_supported(m, cs.n, cs.k)) << m;
  else ASSERT_TRUE(gemm_v2_qnorm_supported(m, cs.n, cs.k)) << m;
  const Fp8Weights w = make_fp8_weights(cs, Data::kRealistic, seed);
  Rng rng(seed * 11 + 3);
  std::vector<bf16_t> x(static_cast<size_t>(m) * kXStride);
  for (auto& v : x) v = num::bf16_from_f32(rng.uniform() * (rng.range(0, 15) == 0 ? 40.0f : 2.0f));
  std::vector<float> qw(static_cast<size_t>(kQRank));
  for (auto& v : qw) v = 1.0f + 0.25f * rng.uniform();
  const float eps = 1e-6f;
  const auto d_x = to_device(x);
  const auto d_qw = to_device(qw);
  const int64_t max_pos = 4096;
  std::vector<float> table(static_cast<size_t>(max_pos * 64));
  for (auto& v : table) v = rng.uniform();
  std::vector<int32_t> pos(static_cast<size_t>(m));
  for (auto& p : pos) p = rng.range(0, static_cast<int>(max_pos) - 1);
  const auto d_table = to_device(table);
  const auto d_pos = to_device(pos);
  DeviceBuffer<unsigned long long> err(2);
  err.fill_bytes(0);
  // Unfused: q_norm with its act quant, then the plain GEMM (or its fused RoPE store form).
  DeviceBuffer<bf16_t> y(static_cast<size_t>(m) * kQRank);
  DeviceBuffer<uint8_t> codes(static_cast<size_t>(m) * kQRank), scales(static_cast<size_t>(m) * (kQRank / 32));
  codes.fill_bytes(kPoisonByte);
  scales.fill_bytes(kPoisonByte);
  RmsNormParams rn;
  rn.x = d_x.get();
  rn.x_stride = kXStride;
  rn.w = d_qw.get();
  rn.eps = eps;
  rn.y = y.get();
  rn.y_stride = kQRank;
  rn.q_codes = codes.get();
  rn.q_stride = kQRank;
  rn.q_scales = scales.get();
  rn.s_stride = kQRank / 32;
  rn.rows = m;
  rn.n = static_cast<int>(kQRank);
  run_rmsnorm(rn, nullptr, pdl);
  const OutLayout l = make_layout(m, cs.n, 1, rope ? 4 * kHd : 24);  // rope: whole padding heads past n
  DeviceBuffer<bf16_t> want(l.elems()), got(l.elems());
  want.fill_bytes(kPoisonByte);
  got.fill_bytes(kPoisonByte);
  Fp8GemmParams g;
  g.a_q = codes.get();
  g.a_stride = kQRank;
  g.a_scale = scales.get();
  g.a_scale_stride = kQRank / 32;
  g.w = w.d_w.get();
  g.w_scale = w.d_ws.get();
  g.out = want.get();
  g.out_stride = l.stride;
  g.m = m;
  g.n = cs.n;
  g.k = cs.k;
  if (rope) {
    g.rope_pos = d_pos.get();
    g.rope_table = d_table.get();
    g.rope_max_pos = max_pos;
    g.rope_err = err.get();
  }
  run_gemm_fp8(g, GemmWorkspace{}, GemmVersion::kWgmma, nullptr, pdl);
  // Fused.
  Fp8GemmParams f = g;
  f.a_q = nullptr;
  f.a_scale = nullptr;
  f.a_stride = f.a_scale_stride = 0;
  f.qnorm_x = d_x.get();
  f.qnorm_x_stride = kXStride;
  f.qnorm_w = d_qw.get();
  f.qnorm_eps = eps;
  f.out = got.get();
  if (rope) f.rope_err = err.get() + 1;
  if (dist) {  // the kernel writes codes / scales / y itself: poisoned copies, compared below
    DeviceBuffer<uint32_t> bar(2);
    bar.fill_bytes(0);
    DeviceBuffer<bf16_t> y2(static_cast<size_t>(m) * kQRank);
    DeviceBuffer<uint8_t> codes2(static_cast<size_t>(m) * kQRank), scales2(static_cast<size_t>(m) * (kQRank / 32));
    f.a_q = codes2.get();
    f.a_stride = kQRank;
    f.a_scale = scales2.get();
    f.a_scale_stride = kQRank / 32;
    f.qnorm_dist_bar = bar.get();
    f.qnorm_y = y2.get();
    f.qnorm_y_stride = kQRank;
    for (int launch = 0; launch < 3; ++launch) {  // the counters serve launch after launch (rewound)
      y2.fill_bytes(kPoisonByte);
      codes2.fill_bytes(kPoisonByte);
      scales2.fill_bytes(kPoisonByte);
      got.fill_bytes(kPoisonByte);
      run_gemm_fp8(f, GemmWorkspace{}, GemmVersion::kWgmma, nullptr, pdl);
      V4_CUDA_CHECK(cudaDeviceSynchronize());
      EXPECT_TRUE(to_host(codes2) == to_host(codes)) << "m " << m << " launch " << launch << ": codes differ";
      EXPECT_TRUE(to_host(scales2) == to_host(scales)) << "m " << m << " launch " << launch << ": scales differ";
      EXPECT_TRUE(to_host(y2) == to_host(y)) << "m " << m << " launch " << launch << ": y differs";
      EXPECT_TRUE(to_host(got) == to_host(want)) << "m " << m << " launch " << launch << ": out differs";
    }
    const std::vector<uint32_t> hb = to_host(bar);
    EXPECT_EQ(hb[0], 0u) << "the rows' count is rewound";
    EXPECT_EQ(hb[1], 0u) << "the CTAs' count is rewound";
  } else {
    run_gemm_fp8_qnorm(f, nullptr, pdl);
  }
  V4_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<bf16_t> hw = to_host(want), hg = to_host(got);
  size_t differ = 0, written = 0;
  for (size_t i = 0; i < hw.size(); ++i) {
    if (hw[i] != kPoisonBf16) ++written;
    if (hw[i] != hg[i] && differ++ < 5)
      ADD_FAILURE() << "element " << i << " (row " << i / static_cast<size_t>(l.stride) << "): fused " << hg[i] << ", unfused " << hw[i];
  }
  EXPECT_EQ(differ, 0u) << "m " << m << " rope " << rope << " pdl " << pdl;
  EXPECT_GT(written, static_cast<size_t>(m) * static_cast<size_t>(cs.n) / 2) << "the unfused path wrote almost nothing";
  if (rope) {
    const std::vector<unsigned long long> he = to_host(err);
    EXPECT_EQ(he[0], 0u);
    EXPECT_EQ(he[1], 0u);
  }
}

}  // namespace

TEST(GpuGemmQNorm, MatchesRmsNormThenGemmBytes) {
  V4_REQUIRE_GPU();
  use_all_cores();
  uint64_t seed = 1300;
  for (int m : {1, 6, 9, 16, 24, 32, 40, 64})
    for (bool rope : {false, true})
      for (bool pdl : {false, true}) check_qnorm_case(m, ++seed, rope, pdl);
}

TEST(GpuGemmQNorm, DistributedMatchesRmsNormThenGemmBytes) {
  V4_REQUIRE_GPU();
  use_all_cores();
  uint64_t seed = 1400;
  for (int m : {1, 6, 17, 24, 32, 40, 64})
    for (bool rope : {false, true})
      for (bool pdl : {false, true}) check_qnorm_case(m, ++seed, rope, pdl, /*dist=*/true);
}

TEST(GpuGemmQNorm, SupportAndRefusals) {
  EXPECT_TRUE(gemm_v2_qnorm_supported(24, 32768, 1280));
  EXPECT_TRUE(gemm_v2_qnorm_supported(64, 32768, 1280));
  EXPECT_FALSE(gemm_v2_qnorm_supported(24, 32768, 2048 + 32));  // k > 2048
  EXPECT_FALSE(gemm_v2_qnorm_supported(24, 4096, 1280));        // v2 splits K here
  EXPECT_FALSE(gemm_v2_qnorm_supported(0, 32768, 1280));
  Fp8GemmParams p;
  p.m = 6;
  p.n = 32768;
  p.k = 1280;
  EXPECT_THROW(run_gemm_fp8_qnorm(p, nullptr, false), std::invalid_argument);  // qnorm_x null
  alignas(16) static const bf16_t fake_x[16] = {};
  alignas(16) static const float fake_w[16] = {};
  p.qnorm_x = fake_x;
  p.qnorm_w = fake_w;
  p.qnorm_x_stride = 1280;
  p.qnorm_eps = 1e-6f;
  alignas(16) static uint8_t fake_bytes[64];  // every other check passes: each refusal below is its own
  p.w = fake_bytes;
  p.w_scale = fake_bytes;
  p.out = reinterpret_cast<bf16_t*>(fake_bytes);
  p.out_stride = p.n;
  p.a_q = fake_bytes;  // a_q with qnorm_x: refused before anything runs
  EXPECT_THROW(run_gemm_fp8_qnorm(p, nullptr, false), std::invalid_argument);
  p.a_q = nullptr;
  p.qnorm_eps = 0.0f;
  EXPECT_THROW(run_gemm_fp8_qnorm(p, nullptr, false), std::invalid_argument);  // eps must be > 0
  p.qnorm_eps = 1e-6f;
  p.qnorm_x_stride = 1000;
  EXPECT_THROW(run_gemm_fp8_qnorm(p, nullptr, false), std::invalid_argument);  // stride < k
  p.qnorm_x_stride = 1280;
  {  // the distributed form writes a_q / a_scale: both must be set
    alignas(8) static uint32_t fake_bar[2];
    Fp8GemmParams d = p;
    d.qnorm_dist_bar = fake_bar;
    EXPECT_THROW(run_gemm_fp8(d, GemmWorkspace{}, GemmVersion::kWgmma, nullptr, false), std::invalid_argument);
    d.a_q = fake_bytes;
    d.a_stride = 1280;
    d.a_scale_stride = 40;
    EXPECT_THROW(run_gemm_fp8(d, GemmWorkspace{}, GemmVersion::kWgmma, nullptr, false), std::invalid_argument);  // a_scale null
  }
  Fp8GemmParams v3 = p;
  EXPECT_THROW(run_gemm_fp8(v3, GemmWorkspace{}, GemmVersion::kWgmmaPipelined, nullptr, false), std::invalid_argument);
}
