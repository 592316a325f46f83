// v5 "skinny" bf16 / fp32 GEMMs (GemmVersion::kSkinny, src/gemm/gemm_skinny.cu) against the CPU
// reference (reference/gemm.h).
//
// Data as in test_gemm.cu: "exact" (small integers: every fp32 sum in any order is exact, so v5 must
// equal the reference BYTE FOR BYTE whatever its split / warp / cluster structure -- any indexing,
// ring, fragment or reduction bug is a mismatch) and "realistic" (wide-range values: bf16 within 1 ulp
// of the reference except where terms cancel, the differing fraction printed and bounded (<= 1%); fp32
// within 2 (k + 8) 2^-24 sum |x w|). Every output has two extra rows and a row stride > n (and x a
// row stride > k holding 1e30 junk), poisoned (0xAB) before each call: everything outside
// [0, m) x [0, n) must still be poison afterwards.
//
// Coverage: the model's shapes (weights_proj 32x5120, wk 128x512, ratio-1 wkv 512x5120 bf16, ratio-2
// [wkv; wgate] 1024x5120 and wkv 512x5120 fp32) at m = 1, 6, 8, 24, 48, 64; small shapes that reach
// every path (S = 1..8 cluster splits, 1 / 2 / 4 m16 tiles per CTA including dead tiles past n, warps
// with empty K parts, one-block parts, rings shallower than the part (slot reuse), partial fp32 tiles
// (n % 32 != 0), groups, every token count class); a token's output independent of the batch (the
// numerics never depend on m); determinism with and without PDL; kAuto's choice; fp8 calls given
// kSkinny; the host plan; refused arguments.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "gpu_test_util.h"
#include "v4attn/kernels/gemm.h"
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
  explicit Rng(uint64_t seed) : s(seed * 0x9E3779B97F4A7C15ull + 4242) {}
  uint64_t next() {
    uint64_t z = (s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  float uniform() { return static_cast<float>(static_cast<double>(next() >> 11) * 0x1.0p-53 * 2.0 - 1.0); }  // [-1, 1)
  int range(int lo, int hi) { return lo + static_cast<int>(next() % static_cast<uint64_t>(hi - lo + 1)); }
};

// kWide (fp32 GEMM): weights over 2^-40 .. 2^8 and activations over 2^-30 .. 2^10, so that the split
// of every weight into three bf16 parts (v5 fp32) meets parts of very different magnitudes.
enum class Data { kExact, kRealistic, kWide };

// bf16 rows [m, stride]; columns >= k hold 1e30 junk that must never reach a result.
std::vector<bf16_t> make_x(int m, int64_t k, int64_t stride, Data d, uint64_t seed) {
  Rng rng(seed);
  std::vector<bf16_t> x(static_cast<size_t>(m) * static_cast<size_t>(stride));
  for (int r = 0; r < m; ++r) {
    for (int64_t b = 0; b < (k + 31) / 32; ++b) {
      const int e = d == Data::kWide ? rng.range(-30, 10) : rng.range(-6, 3);
      for (int64_t c = b * 32; c < std::min(k, b * 32 + 32); ++c) {
        const float v = d == Data::kExact ? static_cast<float>(rng.range(-8, 8)) : std::ldexp(rng.uniform(), e);
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
  for (auto& v : w.w)
    v = d == Data::kExact  ? static_cast<float>(rng.range(-8, 8))
        : d == Data::kWide ? std::ldexp(rng.uniform(), rng.range(-40, 8))
                           : rng.uniform() * 0.015625f;
  return w;
}

using test_util::to_device;
using test_util::to_host;

int32_t bf16_ordinal(bf16_t b) {
  const int32_t mag = b & 0x7fff;
  return (b & 0x8000) ? -mag : mag;
}

struct DiffStats {
  int64_t total = 0, differ = 0, cancelled = 0;
  int max_ulps = 0;  // over the elements that are not `cancelled`
  void add(const DiffStats& o) {
    total += o.total;
    differ += o.differ;
    cancelled += o.cancelled;
    max_ulps = std::max(max_ulps, o.max_ulps);
  }
};

// ---- bf16 harness ---------------------------------------------------------------------------------
struct Bf16Case {
  int64_t n = 0, k = 0;
  int groups = 1;
  int force_splits = 0, force_mtiles = 0;
};

std::string bf16_name(const Bf16Case& cs, int m) {
  return "bf16 " + std::to_string(cs.n) + "x" + std::to_string(cs.k) + (cs.groups > 1 ? " g" + std::to_string(cs.groups) : "") +
         " m" + std::to_string(m) + (cs.force_splits ? " S" + std::to_string(cs.force_splits) : "") +
         (cs.force_mtiles ? " R" + std::to_string(cs.force_mtiles) : "");
}

// One bf16 problem: x holds the groups side by side ([m, groups * k] + pad, like o viewed [T, 8, 4096]),
// weights stacked, output [m + 2 rows, groups * n + 24 columns] (group g at column g * n).
struct Bf16Problem {
  Bf16Case cs;
  int m = 0;
  int64_t x_stride = 0, out_stride = 0;
  int rows_alloc = 0;
  std::vector<bf16_t> x;
  std::vector<ref::Bf16Matrix> w;
  DeviceBuffer<bf16_t> dx, dw;
  std::vector<std::vector<bf16_t>> want;  // per group, dense [m, n]
};

Bf16Problem make_bf16_problem(const Bf16Case& cs, int m, Data d, uint64_t seed) {
  Bf16Problem pr;
  pr.cs = cs;
  pr.m = m;
  pr.x_stride = cs.groups * cs.k + 56;
  pr.out_stride = cs.groups * cs.n + 24;
  pr.rows_alloc = m + 2;
  pr.x = make_x(m, cs.groups * cs.k, pr.x_stride, d, seed);
  std::vector<bf16_t> hw;
  for (int g = 0; g < cs.groups; ++g) {
    pr.w.push_back(make_bf16_weight(cs.n, cs.k, d, seed * 5 + static_cast<uint64_t>(g)));
    hw.insert(hw.end(), pr.w.back().w.begin(), pr.w.back().w.end());
  }
  for (int g = 0; g < cs.groups; ++g) {
    pr.want.emplace_back(static_cast<size_t>(m * cs.n));
    ref::gemm_bf16(pr.x.data() + g * cs.k, m, pr.x_stride, pr.w[static_cast<size_t>(g)], pr.want.back().data(), cs.n);
  }
  pr.dx = to_device(pr.x);
  pr.dw = to_device(hw);
  return pr;
}

Bf16GemmParams bf16_params(const Bf16Problem& pr, bf16_t* out) {
  Bf16GemmParams p;
  p.x = pr.dx.get();
  p.x_stride = pr.x_stride;
  p.w = pr.dw.get();
  p.out = out;
  p.out_stride = pr.out_stride;
  p.m = pr.m;
  p.n = pr.cs.n;
  p.k = pr.cs.k;
  p.groups = pr.cs.groups;
  p.x_group_stride = pr.cs.k;
  p.w_group_stride = pr.cs.n * pr.cs.k;
  p.out_group_stride = pr.cs.n;
  p.force_splits = pr.cs.force_splits;
  p.force_mtiles = pr.cs.force_mtiles;
  return p;
}

// Runs one version on a poisoned output, returns the whole output buffer.
std::vector<bf16_t> run_bf16(const Bf16Problem& pr, GemmVersion v, bool pdl = false) {
  DeviceBuffer<bf16_t> out(static_cast<size_t>(pr.rows_alloc) * static_cast<size_t>(pr.out_stride));
  out.fill_bytes(kPoisonByte);
  // v1's workspace (kAuto may fall back to v1; v5 needs none), for its plan with the case's overrides.
  const size_t ws_bytes = plan_gemm_tc(pr.m, pr.cs.n, pr.cs.k, pr.cs.groups, pr.cs.force_splits,
                                       pr.cs.force_mtiles <= 2 ? pr.cs.force_mtiles : 0)
                              .workspace_bytes;
  DeviceBuffer<uint8_t> ws(std::max<size_t>(ws_bytes, 1));
  const GemmWorkspace gws{ws.get(), ws_bytes};
  init_gemm_workspace(gws, nullptr);
  run_gemm_bf16(bf16_params(pr, out.get()), gws, v, nullptr, pdl);
  V4_CUDA_CHECK(cudaDeviceSynchronize());
  return to_host(out);
}

// At most max_ulps bf16 ulps in the written region (with `tolerant`: elements whose terms cancel may
// differ by more, if within 2^-16 of the row's largest |want|; counted apart), poison elsewhere.
DiffStats check_bf16(const std::vector<bf16_t>& got, const Bf16Problem& pr, int max_ulps, const std::string& what,
                     bool tolerant) {
  DiffStats st;
  const int64_t n = pr.cs.n;
  std::vector<char> in_region(got.size(), 0);
  int reported = 0;
  for (int g = 0; g < pr.cs.groups; ++g)
    for (int r = 0; r < pr.m; ++r) {
      const bf16_t* want = pr.want[static_cast<size_t>(g)].data() + r * n;
      double row_scale = 0.0;
      for (int64_t c = 0; c < n; ++c) row_scale = std::max(row_scale, std::fabs(static_cast<double>(num::f32_from_bf16(want[c]))));
      for (int64_t c = 0; c < n; ++c) {
        const size_t idx = static_cast<size_t>(r * pr.out_stride + g * n + c);
        in_region[idx] = 1;
        const bf16_t w = want[c], o = got[idx];
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
          ADD_FAILURE() << what << ": group " << g << " row " << r << " col " << c << ": got 0x" << std::hex << o << " want 0x"
                        << w << std::dec << " (" << ulps << " ulps)";
      }
    }
  for (size_t i = 0; i < got.size(); ++i)
    if (!in_region[i] && got[i] != kPoisonBf16 && reported++ < 8)
      ADD_FAILURE() << what << ": element " << i << " (row " << i / static_cast<size_t>(pr.out_stride) << ", col "
                    << i % static_cast<size_t>(pr.out_stride) << ") outside the output was written";
  return st;
}

void expect_realistic_stats(const DiffStats& st, const std::string& what) {
  std::printf("[ skinny ] %-44s %8lld elements, %6lld differ (%.4f%%), %lld by > 1 ulp within the cancellation tolerance\n",
              what.c_str(), static_cast<long long>(st.total), static_cast<long long>(st.differ),
              st.total ? 100.0 * static_cast<double>(st.differ) / static_cast<double>(st.total) : 0.0,
              static_cast<long long>(st.cancelled));
  EXPECT_LE(st.max_ulps, 1) << what;
  EXPECT_LE(st.differ, std::max<int64_t>(2, st.total / 100)) << what << ": more than 1% of the elements differ";
  EXPECT_LE(st.cancelled, std::max<int64_t>(2, st.total / 10000)) << what << ": too many large (cancellation) differences";
}

// v5 on one bf16 problem: bytes on exact data, <= 1 ulp on realistic data. Returns the stats.
DiffStats check_bf16_case(const Bf16Case& cs, int m, Data d, uint64_t seed) {
  const Bf16Problem pr = make_bf16_problem(cs, m, d, seed);
  const std::string name = bf16_name(cs, m) + (d == Data::kExact ? " exact" : " realistic");
  const DiffStats st = check_bf16(run_bf16(pr, GemmVersion::kSkinny), pr, d == Data::kExact ? 0 : 1, name, d == Data::kRealistic);
  if (d == Data::kExact) EXPECT_EQ(st.differ, 0) << name << ": v5 on exact data must equal the reference";
  return st;
}

// ---- fp32 harness ---------------------------------------------------------------------------------
struct F32Problem {
  int64_t n = 0, k = 0;
  int m = 0;
  int64_t x_stride = 0, out_stride = 0;
  int rows_alloc = 0;
  std::vector<bf16_t> x;
  ref::F32Matrix w;
  DeviceBuffer<bf16_t> dx;
  DeviceBuffer<float> dw;
  std::vector<float> want;  // dense [m, n]
};

F32Problem make_f32_problem(int64_t n, int64_t k, int m, Data d, uint64_t seed) {
  F32Problem pr;
  pr.n = n;
  pr.k = k;
  pr.m = m;
  pr.x_stride = k + 24;  // a multiple of 8 (v5 copies x rows in 16-byte pieces)
  pr.out_stride = n + 20;
  pr.rows_alloc = m + 2;
  pr.x = make_x(m, k, pr.x_stride, d, seed);
  pr.w = make_f32_weight(n, k, d, seed * 3 + 1);
  pr.want.resize(static_cast<size_t>(m * n));
  ref::gemm_f32(pr.x.data(), m, pr.x_stride, pr.w, pr.want.data(), n);
  pr.dx = to_device(pr.x);
  pr.dw = to_device(pr.w.w);
  return pr;
}

F32GemmParams f32_params(const F32Problem& pr, float* out, int force_splits = 0, int v5_path = 0) {
  F32GemmParams p;
  p.x = pr.dx.get();
  p.x_stride = pr.x_stride;
  p.w = pr.dw.get();
  p.out = out;
  p.out_stride = pr.out_stride;
  p.m = pr.m;
  p.n = pr.n;
  p.k = pr.k;
  p.force_splits = force_splits;
  p.v5_path = v5_path;
  return p;
}

std::vector<float> run_f32(const F32Problem& pr, GemmVersion v, int force_splits = 0, bool pdl = false, int v5_path = 0) {
  DeviceBuffer<float> out(static_cast<size_t>(pr.rows_alloc) * static_cast<size_t>(pr.out_stride));
  out.fill_bytes(kPoisonByte);
  run_gemm_f32(f32_params(pr, out.get(), force_splits, v5_path), v, nullptr, pdl);
  V4_CUDA_CHECK(cudaDeviceSynchronize());
  return to_host(out);
}

// Bytes on exact data; |got - ref| <= 2 (k + 8) 2^-24 sum_k |x w| on realistic data (gemm.h: v5's
// bound is (2k + 8) 2^-24 sum |x w|); poison outside. Returns the worst |diff| / sum |x w|.
double check_f32(const std::vector<float>& got, const F32Problem& pr, bool exact, const std::string& what) {
  uint32_t poison_bits;
  std::memset(&poison_bits, kPoisonByte, 4);
  int reported = 0;
  double worst = 0.0;
  for (int r = 0; r < pr.rows_alloc; ++r)
    for (int64_t c = 0; c < pr.out_stride; ++c) {
      const float o = got[static_cast<size_t>(r * pr.out_stride + c)];
      if (r >= pr.m || c >= pr.n) {
        if (num::f32_bits(o) != poison_bits && reported++ < 8) ADD_FAILURE() << what << ": wrote outside at " << r << "," << c;
        continue;
      }
      const float e = pr.want[static_cast<size_t>(r * pr.n + c)];
      if (exact) {
        if (num::f32_bits(o) != num::f32_bits(e) && reported++ < 8)
          ADD_FAILURE() << what << ": row " << r << " col " << c << " got " << o << " want " << e;
        continue;
      }
      double mag = 0.0;
      for (int64_t i = 0; i < pr.k; ++i)
        mag += std::fabs(static_cast<double>(num::f32_from_bf16(pr.x[static_cast<size_t>(r * pr.x_stride + i)])) *
                         static_cast<double>(pr.w.w[static_cast<size_t>(c * pr.k + i)]));
      const double diff = std::fabs(static_cast<double>(o) - static_cast<double>(e));
      const double bound = 2.0 * static_cast<double>(pr.k + 8) * 0x1.0p-24 * mag;
      worst = std::max(worst, mag > 0 ? diff / mag : 0.0);
      if (!(diff <= bound) && reported++ < 8)
        ADD_FAILURE() << what << ": row " << r << " col " << c << " got " << o << " want " << e << " (bound " << bound << ")";
    }
  return worst;
}

void check_f32_case(int64_t n, int64_t k, int m, Data d, uint64_t seed, int force_splits = 0) {
  const F32Problem pr = make_f32_problem(n, k, m, d, seed);
  const std::string name = "f32 " + std::to_string(n) + "x" + std::to_string(k) + " m" + std::to_string(m) +
                           (force_splits ? " S" + std::to_string(force_splits) : "") +
                           (d == Data::kExact ? " exact" : d == Data::kWide ? " wide" : " realistic");
  // Both data paths of v5 fp32 (rings; direct register loads up to 32 rows): checked against the
  // reference, and the same bytes as each other (the same parts, blocks and arithmetic).
  const std::vector<float> ring = run_f32(pr, GemmVersion::kSkinny, force_splits, false, 2);
  const double worst = check_f32(ring, pr, d == Data::kExact, name + " rings");
  if (m <= kF32DirectMaxRows) {
    const std::vector<float> direct = run_f32(pr, GemmVersion::kSkinny, force_splits, false, 1);
    EXPECT_EQ(0, std::memcmp(direct.data(), ring.data(), ring.size() * sizeof(float))) << name << ": direct path != rings";
  }
  if (d != Data::kExact) std::printf("[ skinny ] %-44s max |diff| / sum|x*w| = %.3g\n", name.c_str(), worst);
}

struct RealShape {
  const char* name;
  int64_t n, k;
};
constexpr RealShape kBf16Shapes[] = {{"ratio-1 wkv", 512, 5120}, {"weights_proj", 32, 5120}, {"wk", 128, 512}};

}  // namespace

// ======================================================================================================

TEST(GpuGemmSkinny, Bf16RealShapes) {
  V4_REQUIRE_GPU();
  use_all_cores();
  uint64_t seed = 9100;
  for (const RealShape& sh : kBf16Shapes) {
    DiffStats agg;
    for (int m : kAllM) {
      agg.add(check_bf16_case({sh.n, sh.k}, m, Data::kRealistic, ++seed));
      check_bf16_case({sh.n, sh.k}, m, Data::kExact, ++seed);
    }
    expect_realistic_stats(agg, std::string(sh.name) + " v5, all m");
  }
}

// The ratio-2 compressor's [wkv; wgate] in one call (the stack's), and wkv alone.
TEST(GpuGemmSkinny, F32RealShapes) {
  V4_REQUIRE_GPU();
  use_all_cores();
  uint64_t seed = 9200;
  for (int m : kAllM) {
    check_f32_case(1024, 5120, m, Data::kExact, ++seed);
    check_f32_case(1024, 5120, m, Data::kRealistic, ++seed);
  }
  for (int m : {1, 6}) {
    check_f32_case(512, 5120, m, Data::kExact, ++seed);
    check_f32_case(512, 5120, m, Data::kRealistic, ++seed);
  }
  // Magnitudes far apart inside a row and a block (the tensor-core path splits each weight into
  // three bf16 parts; the products are exact, the sums within the fp32 rounding bound).
  for (int m : {1, 6, 24, 64}) check_f32_case(1024, 5120, m, Data::kWide, ++seed);
}

// Small shapes through every path: S = 1..8 (cluster reductions of every size, S = 1 without a
// cluster), 1 / 2 / 4 m16 tiles per CTA (n not a multiple of the CTA's rows: dead m16 tiles), k = 32
// (one block: all but one warp of the tile have empty parts), parts longer than the ring (slot reuse:
// k = 5120 with S = 1 is 40 blocks per warp), groups, and token counts in every n8 class.
TEST(GpuGemmSkinny, Bf16SmallShapesAllPaths) {
  V4_REQUIRE_GPU();
  use_all_cores();
  const Bf16Case cases[] = {{32, 32, 1, 0, 0},    {96, 160, 1, 0, 0},  {160, 416, 1, 3, 2},  {224, 288, 1, 1, 4},
                            {64, 800, 1, 7, 1},   {96, 224, 3, 2, 0},  {128, 128, 2, 8, 4},  {32, 5120, 1, 1, 0},
                            {288, 1056, 1, 5, 2}, {32, 96, 1, 8, 4},   {480, 2080, 1, 4, 0}, {64, 64, 2, 6, 1}};
  const int ms[] = {1, 3, 7, 8, 9, 16, 17, 25, 31, 33, 47, 57, 64};
  uint64_t seed = 9300;
  DiffStats agg;
  for (const Bf16Case& cs : cases)
    for (int m : ms) {
      check_bf16_case(cs, m, Data::kExact, ++seed);
      if (m == 9 || m == 64) agg.add(check_bf16_case(cs, m, Data::kRealistic, ++seed));
    }
  expect_realistic_stats(agg, "bf16 small shapes v5, realistic");
}

TEST(GpuGemmSkinny, F32SmallShapesAllPaths) {
  V4_REQUIRE_GPU();
  use_all_cores();
  uint64_t seed = 9400;
  for (int64_t n : {4, 12, 36, 64, 100})
    for (int64_t k : {32, 96, 1056, 2080})
      for (int s : {0, 1, 3, 8})
        for (int m : {1, 2, 3, 5, 8, 9, 16, 17, 31, 33, 64}) {
          check_f32_case(n, k, m, Data::kExact, ++seed, s);
          if (m == 5 || m == 33) check_f32_case(n, k, m, Data::kRealistic, ++seed, s);
        }
  // Every cluster size on a longer K, and a ring shallower than the part (S = 1: 40 blocks per warp).
  for (int s = 1; s <= 8; ++s) check_f32_case(64, 5120, 6, Data::kExact, ++seed, s);
  check_f32_case(96, 5120, 64, Data::kRealistic, ++seed, 1);
}

// The numerics never depend on m (S from (n, k) only; rows per CTA move no addition): row r of a
// batch equals the same token computed alone or in a batch of another size, byte for byte; and the
// result does not depend on PDL or on the run.
TEST(GpuGemmSkinny, TokenOutputDoesNotDependOnBatchOrPdl) {
  V4_REQUIRE_GPU();
  use_all_cores();
  {  // bf16 wkv: the 64-row batch runs 4 m16 tiles per CTA, the 24-row one 2, a single token 1
    const Bf16Problem big = make_bf16_problem({512, 5120}, 64, Data::kRealistic, 9501);
    const std::vector<bf16_t> all = run_bf16(big, GemmVersion::kSkinny);
    EXPECT_TRUE(run_bf16(big, GemmVersion::kSkinny, true) == all) << "bf16 v5 with PDL differs";
    for (int sub_m : {1, 24}) {
      for (int r0 : {0, 17, 64 - sub_m}) {
        DeviceBuffer<bf16_t> out(static_cast<size_t>(sub_m) * 512);
        out.fill_bytes(kPoisonByte);
        Bf16GemmParams p = bf16_params(big, out.get());
        p.x = big.dx.get() + static_cast<size_t>(r0) * static_cast<size_t>(big.x_stride);
        p.m = sub_m;
        p.out_stride = 512;
        run_gemm_bf16(p, GemmWorkspace{}, GemmVersion::kSkinny, nullptr, false);
        V4_CUDA_CHECK(cudaDeviceSynchronize());
        const std::vector<bf16_t> got = to_host(out);
        for (int r = 0; r < sub_m; ++r)
          EXPECT_EQ(0, std::memcmp(got.data() + r * 512, all.data() + (r0 + r) * big.out_stride, 512 * sizeof(bf16_t)))
              << "bf16 token " << r0 + r << " alone / in " << sub_m << " rows differs from the 64-row batch";
      }
    }
  }
  {  // fp32 [wkv; wgate]
    const F32Problem big = make_f32_problem(1024, 5120, 64, Data::kRealistic, 9502);
    const std::vector<float> all = run_f32(big, GemmVersion::kSkinny);
    const std::vector<float> again = run_f32(big, GemmVersion::kSkinny, 0, true);
    EXPECT_EQ(0, std::memcmp(all.data(), again.data(), all.size() * sizeof(float))) << "f32 v5 with PDL differs";
    for (int sub_m : {1, 6}) {
      for (int r0 : {0, 29, 64 - sub_m}) {
        DeviceBuffer<float> out(static_cast<size_t>(sub_m) * 1024);
        out.fill_bytes(kPoisonByte);
        F32GemmParams p = f32_params(big, out.get());
        p.x = big.dx.get() + static_cast<size_t>(r0) * static_cast<size_t>(big.x_stride);
        p.m = sub_m;
        p.out_stride = 1024;
        run_gemm_f32(p, GemmVersion::kSkinny, nullptr, false);
        V4_CUDA_CHECK(cudaDeviceSynchronize());
        const std::vector<float> got = to_host(out);
        for (int r = 0; r < sub_m; ++r)
          EXPECT_EQ(0, std::memcmp(got.data() + r * 1024, all.data() + (r0 + r) * big.out_stride, 1024 * sizeof(float)))
              << "f32 token " << r0 + r << " alone / in " << sub_m << " rows differs from the 64-row batch";
      }
    }
  }
}

// kAuto runs v5 where skinny_gemm_preferred says so (and the arguments allow it), v1 otherwise;
// fp8 calls given kSkinny run kAuto's fp8 version.
TEST(GpuGemmSkinny, AutoDispatch) {
  // The measured rule (gemm_skinny.cu): m >= 24, or k <= 1024, or n >= 128 with m >= 9.
  for (int m : kAllM) {
    EXPECT_EQ(skinny_gemm_preferred(m, 512, 5120), m >= 9) << m;
    EXPECT_EQ(skinny_gemm_preferred(m, 32, 5120), m >= 24) << m;
    EXPECT_TRUE(skinny_gemm_preferred(m, 128, 512)) << m;
    EXPECT_EQ(skinny_gemm_preferred(m, 1024, 5120), m >= 9) << m;
  }
  EXPECT_FALSE(skinny_gemm_preferred(0, 512, 5120));
  EXPECT_FALSE(skinny_gemm_preferred(65, 512, 5120));
  EXPECT_FALSE(skinny_gemm_preferred(6, 512, 5124));
  // The version run_gemm_bf16 runs (and the stack's fused compressor tail asks for): the rule above
  // for kAuto / kGemv, v1 for the fp8-only versions, kSimple / kSkinny as asked.
  for (int m : kAllM) {
    EXPECT_EQ(bf16_gemm_version(GemmVersion::kAuto, m, 128, 512), GemmVersion::kSkinny) << m;
    EXPECT_EQ(bf16_gemm_version(GemmVersion::kGemv, m, 32, 5120), m >= 24 ? GemmVersion::kSkinny : GemmVersion::kTensorCore) << m;
  }
  EXPECT_EQ(bf16_gemm_version(GemmVersion::kAuto, 65, 128, 512), GemmVersion::kTensorCore);
  EXPECT_EQ(bf16_gemm_version(GemmVersion::kWgmma, 6, 128, 512), GemmVersion::kTensorCore);
  EXPECT_EQ(bf16_gemm_version(GemmVersion::kWgmmaPipelined, 6, 128, 512), GemmVersion::kTensorCore);
  EXPECT_EQ(bf16_gemm_version(GemmVersion::kSimple, 6, 128, 512), GemmVersion::kSimple);
  EXPECT_EQ(bf16_gemm_version(GemmVersion::kSkinny, 1, 32, 5120), GemmVersion::kSkinny);
  // fp32 (session 26): v5 from 2 rows (the compressor's [wkv; wgate] 1024 x 5120), v1 at one row.
  for (int m : kAllM) EXPECT_EQ(f32_skinny_preferred(m, 1024, 5120), m >= 2) << m;
  EXPECT_FALSE(f32_skinny_preferred(65, 1024, 5120));
  EXPECT_FALSE(f32_skinny_preferred(6, 1024, 5124));
  EXPECT_STREQ(gemm_version_name(GemmVersion::kSkinny), "v5 skinny");
  {
    const GemmPlan a = plan_gemm(GemmVersion::kSkinny, 6, 512, 5120, 1), b = plan_gemm_skinny(6, 512, 5120, 1, false);
    EXPECT_EQ(a.splits, b.splits);
    EXPECT_EQ(a.tiles_n, b.tiles_n);
    EXPECT_EQ(a.block_n, b.block_n);
  }
  V4_REQUIRE_GPU();
  use_all_cores();
  {  // bf16: kAuto == kSkinny bytes; grouped / v1-overridden calls keep v1
    const Bf16Problem pr = make_bf16_problem({512, 5120}, 6, Data::kRealistic, 9601);
    const std::vector<bf16_t> v5 = run_bf16(pr, GemmVersion::kSkinny);
    EXPECT_TRUE(run_bf16(pr, GemmVersion::kAuto) == v5);
    const Bf16Problem grouped = make_bf16_problem({512, 1024, 2}, 6, Data::kRealistic, 9602);
    EXPECT_TRUE(run_bf16(grouped, GemmVersion::kAuto) == run_bf16(grouped, GemmVersion::kTensorCore));
    const Bf16Problem forced = make_bf16_problem({512, 5120, 1, 3, 0}, 6, Data::kRealistic, 9603);
    EXPECT_TRUE(run_bf16(forced, GemmVersion::kAuto) == run_bf16(forced, GemmVersion::kTensorCore));
  }
  {  // fp32: kAuto == v1 bytes at one row, v5 bytes from 2 (f32_skinny_preferred); x not 16-byte aligned -> v1
    for (int m : {1, 2, 6, 15, 16, 24}) {
      const F32Problem pr = make_f32_problem(1024, 5120, m, Data::kRealistic, 9604 + static_cast<uint64_t>(m));
      const std::vector<float> v1 = run_f32(pr, GemmVersion::kTensorCore), v5 = run_f32(pr, GemmVersion::kSkinny);
      const std::vector<float> a = run_f32(pr, GemmVersion::kAuto);
      // The two versions round differently on this data, so the byte check below can fail.
      EXPECT_NE(0, std::memcmp(v1.data(), v5.data(), v1.size() * sizeof(float))) << "m " << m;
      const std::vector<float>& want = m >= 2 ? v5 : v1;
      EXPECT_EQ(0, std::memcmp(want.data(), a.data(), a.size() * sizeof(float))) << "kAuto at m " << m;
      check_f32(a, pr, false, "f32 kAuto m" + std::to_string(m));
    }
    // x starting 4 elements (8 bytes) into a row: v1 takes it, v5 refuses it, kAuto runs v1 at 20 rows.
    const F32Problem odd = make_f32_problem(64, 1024, 20, Data::kRealistic, 9605);
    auto run_shifted = [&](GemmVersion v) {
      DeviceBuffer<float> out(static_cast<size_t>(odd.m) * 64);
      out.fill_bytes(kPoisonByte);
      F32GemmParams p = f32_params(odd, out.get());
      p.x = odd.dx.get() + 4;
      p.k = 1024 - 32;  // the shifted rows still fit in the stride
      p.out_stride = 64;
      run_gemm_f32(p, v, nullptr, false);
      V4_CUDA_CHECK(cudaDeviceSynchronize());
      return to_host(out);
    };
    const std::vector<float> auto_out = run_shifted(GemmVersion::kAuto), v1_out = run_shifted(GemmVersion::kTensorCore);
    EXPECT_EQ(0, std::memcmp(auto_out.data(), v1_out.data(), auto_out.size() * sizeof(float)));
    EXPECT_THROW(run_shifted(GemmVersion::kSkinny), std::invalid_argument);
  }
  {  // fp8 given kSkinny: the same bytes as kAuto (v3 for this shape)
    const int m = 6;
    const int64_t n = 1792, k = 5120, kb = k / 32;
    Rng rng(9606);
    std::vector<uint8_t> aq(static_cast<size_t>(m * k)), as(static_cast<size_t>(m * kb)), w(static_cast<size_t>(n * k)),
        ws(static_cast<size_t>((n / 32) * kb));
    for (auto& c : aq) c = num::e4m3_from_f32(static_cast<float>(rng.range(-7, 7)));
    for (auto& c : w) c = num::e4m3_from_f32(static_cast<float>(rng.range(-7, 7)));
    for (auto& s : as) s = static_cast<uint8_t>(127 + rng.range(0, 1));
    for (auto& s : ws) s = static_cast<uint8_t>(127 + rng.range(-2, 0));
    const DeviceBuffer<uint8_t> daq = to_device(aq), das = to_device(as), dw = to_device(w), dws = to_device(ws);
    const size_t wsb = gemm_workspace_bytes(m, n, k, 1);
    DeviceBuffer<uint8_t> work(std::max<size_t>(wsb, 256));
    const GemmWorkspace gws{work.get(), wsb};
    init_gemm_workspace(gws, nullptr);
    auto run = [&](GemmVersion v) {
      DeviceBuffer<bf16_t> out(static_cast<size_t>(m * n));
      out.fill_bytes(kPoisonByte);
      Fp8GemmParams p;
      p.a_q = daq.get();
      p.a_stride = k;
      p.a_scale = das.get();
      p.a_scale_stride = kb;
      p.w = dw.get();
      p.w_scale = dws.get();
      p.out = out.get();
      p.out_stride = n;
      p.m = m;
      p.n = n;
      p.k = k;
      run_gemm_fp8(p, gws, v, nullptr, false);
      V4_CUDA_CHECK(cudaDeviceSynchronize());
      return to_host(out);
    };
    const std::vector<bf16_t> a = run(GemmVersion::kAuto), s = run(GemmVersion::kSkinny);
    EXPECT_TRUE(a == s);
    EXPECT_TRUE(std::none_of(a.begin(), a.end(), [](bf16_t v) { return v == kPoisonBf16; }));
  }
}

// The automatic plans: S from (n, k, groups) only, <= 8 (one cluster per tile), no workspace, shared
// memory within the limit at every m; the model's big shapes get >= 128 CTAs at m = 1 and, at m <= 8,
// a ring that holds a warp's whole K part (every load issued before the first use). Host only.
TEST(GpuGemmSkinny, PlanCoversTheMachine) {
  const struct {
    const char* name;
    int64_t n, k;
    bool f32;
    int min_ctas;
  } shapes[] = {{"ratio-1 wkv", 512, 5120, false, 128},
                {"weights_proj", 32, 5120, false, 16},
                {"wk", 128, 512, false, 32},
                {"ratio-2 wkv|wgate", 1024, 5120, true, 128}};
  for (const auto& s : shapes) {
    const GemmPlan first = plan_gemm_skinny(1, s.n, s.k, 1, s.f32);
    for (int m = 1; m <= kGemmMaxRows; ++m) {
      const GemmPlan p = plan_gemm_skinny(m, s.n, s.k, 1, s.f32);
      EXPECT_EQ(p.splits, first.splits) << s.name << " m " << m;
      EXPECT_EQ(p.cluster, p.splits);
      EXPECT_LE(p.splits, 8);
      EXPECT_GE(p.splits, 1);
      EXPECT_EQ(p.workspace_bytes, 0u);
      EXPECT_LE(p.smem_bytes, size_t{227 * 1024}) << s.name << " m " << m;
      EXPECT_GE(p.stages, 1);
      EXPECT_LE(p.stages, 8);
      EXPECT_GE(static_cast<int64_t>(p.tiles_n) * p.block_n, s.n);
      if (!s.f32) EXPECT_TRUE(p.warp_mtiles == 1 || p.tiles_n * p.splits >= 128) << s.name << " m " << m;
      const int64_t max_part = (s.k / 32 + 4 * p.splits - 1) / (4 * p.splits);
      if (m <= 8) EXPECT_EQ(p.stages, std::min<int64_t>(8, max_part)) << s.name << " m " << m << ": the whole part in flight";
      if (m == 1 || m == 6 || m == 64)
        std::printf("[ skinny ] plan %-18s m %2d: rows/CTA %d, tiles %d, S %d -> %d CTAs, ring %d slots/warp, smem %zu B\n",
                    s.name, m, p.block_n, p.tiles_n, p.splits, p.tiles_n * p.splits, p.stages, p.smem_bytes);
    }
    EXPECT_GE(first.tiles_n * first.splits, s.min_ctas) << s.name;
  }
  // Overrides: S capped at 8 and at k / 32; the rows per CTA as forced.
  EXPECT_EQ(plan_gemm_skinny(4, 64, 1024, 1, false, 64).splits, 8);
  EXPECT_EQ(plan_gemm_skinny(4, 64, 64, 1, false, 8).splits, 2);
  EXPECT_EQ(plan_gemm_skinny(4, 64, 1024, 1, false, 0, 4).block_n, 64);
  EXPECT_EQ(plan_gemm_skinny(4, 64, 1024, 1, true).block_n, 32);
}

// Host-side validation: runs with or without a GPU (the launchers throw before touching CUDA).
TEST(GpuGemmSkinny, RefusesBadArguments) {
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
  const GemmWorkspace no_ws{};
  auto valid_bf16 = [&] {
    Bf16GemmParams p;
    p.x = reinterpret_cast<const bf16_t*>(base);
    p.x_stride = 64;
    p.w = reinterpret_cast<const bf16_t*>(base + 16384);
    p.out = reinterpret_cast<bf16_t*>(base + 131072);
    p.out_stride = 64;
    p.m = 4;
    p.n = 64;
    p.k = 64;
    return p;
  };
  auto valid_f32 = [&] {
    F32GemmParams p;
    p.x = reinterpret_cast<const bf16_t*>(base);
    p.x_stride = 64;
    p.w = reinterpret_cast<const float*>(base + 16384);
    p.out = reinterpret_cast<float*>(base + 131072);
    p.out_stride = 64;
    p.m = 4;
    p.n = 64;
    p.k = 64;
    return p;
  };
  const GemmVersion v5 = GemmVersion::kSkinny;
  {
    Bf16GemmParams p = valid_bf16();
    p.m = 65;
    p.x_stride = 64;
    EXPECT_THROW(run_gemm_bf16(p, no_ws, v5, nullptr, false), std::invalid_argument) << "m > 64";
    p = valid_bf16();
    p.force_mtiles = 3;
    EXPECT_THROW(run_gemm_bf16(p, no_ws, v5, nullptr, false), std::invalid_argument) << "force_mtiles 3";
    p = valid_bf16();
    p.force_splits = -1;
    EXPECT_THROW(run_gemm_bf16(p, no_ws, v5, nullptr, false), std::invalid_argument) << "force_splits < 0";
    p = valid_bf16();
    p.k = 48;
    EXPECT_THROW(run_gemm_bf16(p, no_ws, v5, nullptr, false), std::invalid_argument) << "k % 32";
    p = valid_bf16();
    p.n = 48;
    EXPECT_THROW(run_gemm_bf16(p, no_ws, v5, nullptr, false), std::invalid_argument) << "n % 32";
    p = valid_bf16();
    p.x = reinterpret_cast<const bf16_t*>(base + 8);
    EXPECT_THROW(run_gemm_bf16(p, no_ws, v5, nullptr, false), std::invalid_argument) << "x not 16-byte aligned";
    p = valid_bf16();
    p.x_stride = 68;
    EXPECT_THROW(run_gemm_bf16(p, no_ws, v5, nullptr, false), std::invalid_argument) << "x_stride % 8";
    p = valid_bf16();
    p.out_stride = 63;
    EXPECT_THROW(run_gemm_bf16(p, no_ws, v5, nullptr, false), std::invalid_argument) << "out_stride < n";
    p = valid_bf16();
    p.w = nullptr;
    EXPECT_THROW(run_gemm_bf16(p, no_ws, v5, nullptr, false), std::invalid_argument) << "null w";
    p = valid_bf16();
    p.groups = 0;
    EXPECT_THROW(run_gemm_bf16(p, no_ws, v5, nullptr, false), std::invalid_argument) << "groups 0";
  }
  {
    F32GemmParams p = valid_f32();
    p.m = 65;
    EXPECT_THROW(run_gemm_f32(p, v5, nullptr, false), std::invalid_argument) << "f32 m > 64";
    p = valid_f32();
    p.k = 36;  // a multiple of 4 (v1 takes it), not of 32
    EXPECT_THROW(run_gemm_f32(p, v5, nullptr, false), std::invalid_argument) << "f32 k % 32";
    p = valid_f32();
    p.x = reinterpret_cast<const bf16_t*>(base + 8);  // 8-byte aligned (v1 takes it)
    EXPECT_THROW(run_gemm_f32(p, v5, nullptr, false), std::invalid_argument) << "f32 x not 16-byte aligned";
    p = valid_f32();
    p.x_stride = 68;  // % 4 (v1 takes it), not % 8
    EXPECT_THROW(run_gemm_f32(p, v5, nullptr, false), std::invalid_argument) << "f32 x_stride % 8";
    p = valid_f32();
    p.force_splits = -1;
    EXPECT_THROW(run_gemm_f32(p, v5, nullptr, false), std::invalid_argument) << "f32 force_splits < 0";
    for (int path : {-1, 3}) {
      p = valid_f32();
      p.v5_path = path;
      EXPECT_THROW(run_gemm_f32(p, v5, nullptr, false), std::invalid_argument) << "f32 v5_path " << path;
    }
    p = valid_f32();
    p.m = kF32DirectMaxRows + 1;
    p.v5_path = 1;  // the direct path takes m <= kF32DirectMaxRows
    EXPECT_THROW(run_gemm_f32(p, v5, nullptr, false), std::invalid_argument) << "f32 direct path at 33 rows";
    p = valid_f32();
    p.n = 6;
    p.out_stride = 8;
    EXPECT_THROW(run_gemm_f32(p, v5, nullptr, false), std::invalid_argument) << "f32 n % 4";
  }
  EXPECT_THROW(plan_gemm_skinny(65, 64, 64, 1, false), std::invalid_argument);
  EXPECT_THROW(plan_gemm_skinny(4, 64, 48, 1, false), std::invalid_argument);
  EXPECT_THROW(plan_gemm_skinny(4, 64, 64, 0, false), std::invalid_argument);
  EXPECT_THROW(plan_gemm_skinny(4, 64, 64, 1, false, -1), std::invalid_argument);
  EXPECT_THROW(plan_gemm_skinny(4, 64, 64, 1, false, 0, 3), std::invalid_argument);
  EXPECT_THROW(plan_gemm_skinny(4, 64, 64, 1, true, 0, 2), std::invalid_argument);
  // m == 0 launches nothing and is accepted.
  {
    Bf16GemmParams p = valid_bf16();
    p.m = 0;
    EXPECT_NO_THROW(run_gemm_bf16(p, no_ws, v5, nullptr, false));
    F32GemmParams q = valid_f32();
    q.m = 0;
    EXPECT_NO_THROW(run_gemm_f32(q, v5, nullptr, false));
  }
  // The valid controls really run (GPU only), including a cluster split: a refusal test that refused
  // everything would pass the checks above.
  if (gpu) {
    EXPECT_NO_THROW(run_gemm_bf16(valid_bf16(), no_ws, v5, nullptr, false));
    Bf16GemmParams split = valid_bf16();
    split.force_splits = 2;
    EXPECT_NO_THROW(run_gemm_bf16(split, no_ws, v5, nullptr, false));
    EXPECT_NO_THROW(run_gemm_f32(valid_f32(), v5, nullptr, false));
    V4_CUDA_CHECK(cudaDeviceSynchronize());
  } else {
    try {
      run_gemm_bf16(valid_bf16(), no_ws, v5, nullptr, false);
    } catch (const std::invalid_argument& e) {
      ADD_FAILURE() << "valid bf16 arguments refused: " << e.what();
    } catch (...) {  // no device: the launch fails, which is fine here
    }
    try {
      run_gemm_f32(valid_f32(), v5, nullptr, false);
    } catch (const std::invalid_argument& e) {
      ADD_FAILURE() << "valid f32 arguments refused: " << e.what();
    } catch (...) {
    }
  }
}
