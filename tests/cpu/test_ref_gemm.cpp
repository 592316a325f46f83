// Tests of the CPU reference GEMMs and fp8 (de)quantisation (gemm.h, spec section 2). Expected
// values are written by hand or computed in double from the quantised operands, decoded by the
// independent format decoders of ref_test_util.h.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <stdexcept>
#include <vector>

#include "ref_test_util.h"
#include "v4attn/reference/gemm.h"

namespace {

using namespace v4attn;
using namespace reftest;
using ref::ActQuant;
using ref::Bf16Matrix;
using ref::F32Matrix;
using ref::Fp8Matrix;

// Restores the GEMM thread count after a test that changes it.
struct ThreadsGuard {
  int saved = ref::gemm_threads();
  ~ThreadsGuard() { ref::set_gemm_threads(saved); }
};

// ---- act_quant --------------------------------------------------------------------------------

TEST(RefGemmActQuant, HandMadeBlocksGiveTheExpectedCodesAndScales) {
  // Block 0: amax 1 -> 1 * fp32(1/448) = 2^-8.8.. -> pow2ceil 2^-8 (ue8m0 119); x / s = x * 256.
  // Block 1: all zero -> amax floored at 1e-4 -> 2.2e-7 -> pow2ceil 2^-22 (ue8m0 105); codes 0.
  std::vector<bf16_t> x(64, bf16_exact(0.0));
  x[0] = bf16_exact(1.0);          // 256 = 2^8            -> e 15, m 0 -> 0x78
  x[1] = bf16_exact(0.5);          // 128                  -> 0x70
  x[2] = bf16_exact(-0.25);        // -64                  -> 0xE8
  x[3] = bf16_exact(0.30078125);   // 77 -> 1.203*64, m 1.625 rounds to 2 -> 80 -> 0x6A
  x[4] = bf16_exact(std::ldexp(1.0, -20));  // 2^-12 < half the smallest subnormal 2^-10 -> 0
  x[5] = bf16_exact(std::ldexp(1.0, -17));  // 2^-9: the smallest subnormal -> 0x01
  x[6] = bf16_exact(-0.75);        // -192 = -1.5 * 128    -> 0xF4
  x[7] = bf16_exact(std::ldexp(3.0, -18));  // 3 * 2^-10 = 1.5 subnormal steps: tie -> even 2 -> 0x02
  const ActQuant a = ref::act_quant(x.data(), 1, 64, 64);
  ASSERT_EQ(a.q.size(), 64u);
  ASSERT_EQ(a.scale.size(), 2u);
  EXPECT_EQ(a.scale[0], 119);
  EXPECT_EQ(a.scale[1], 105);
  const uint8_t want[8] = {0x78, 0x70, 0xE8, 0x6A, 0x00, 0x01, 0xF4, 0x02};
  for (int i = 0; i < 8; ++i) EXPECT_EQ(a.q[i], want[i]) << "element " << i;
  for (int i = 8; i < 64; ++i) EXPECT_EQ(a.q[i], 0) << "element " << i;
}

TEST(RefGemmActQuant, RefusesBadShapes) {
  std::vector<bf16_t> x(64);
  EXPECT_THROW(ref::act_quant(x.data(), 1, 48, 64), std::invalid_argument);   // k not a multiple of 32
  EXPECT_THROW(ref::act_quant(x.data(), 1, 64, 32), std::invalid_argument);   // stride < k
  EXPECT_THROW(ref::act_quant(nullptr, 1, 64, 64), std::invalid_argument);
}

// ---- fp8 GEMM: hand-made operands ----------------------------------------------------------------

// Builds an fp8 weight / activation directly from codes and scale bytes.
Fp8Matrix fp8_matrix(int64_t n, int64_t k, std::vector<uint8_t> codes, std::vector<uint8_t> scales) {
  Fp8Matrix w;
  w.n = n;
  w.k = k;
  w.w = std::move(codes);
  w.scale = std::move(scales);
  return w;
}
ActQuant act(int64_t m, int64_t k, std::vector<uint8_t> codes, std::vector<uint8_t> scales) {
  ActQuant a;
  a.m = m;
  a.k = k;
  a.q = std::move(codes);
  a.scale = std::move(scales);
  return a;
}

TEST(RefGemmFp8, ThirtyTwoWideHandComputed) {
  // M = 2, N = 3, K = 32. Codes from {+-0.5, +-1, +-1.5, +-2}: every product and partial sum is a
  // multiple of 1/4 below 2^10, so the fp32 evaluation is exact and equals the double one.
  const uint8_t kCodes[8] = {0x30, 0x38, 0x3C, 0x40, 0xB0, 0xB8, 0xBC, 0xC0};  // .5 1 1.5 2 -.5 -1 -1.5 -2
  std::vector<uint8_t> qa(2 * 32), qw(3 * 32);
  for (int i = 0; i < 64; ++i) qa[i] = kCodes[(i * 5 + 1) % 8];
  for (int i = 0; i < 96; ++i) qw[i] = kCodes[(i * 3 + 2) % 8];
  // Activation scales 2^-3 (row 0) and 2^2 (row 1); weight scale 2^1 (one 32x32 block).
  const ActQuant a = act(2, 32, qa, {124, 129});
  const Fp8Matrix w = fp8_matrix(3, 32, qw, {128});
  std::vector<bf16_t> out(2 * 5, kPoisonBf16);
  ref::gemm_fp8(a, w, out.data(), 5);
  const double sa[2] = {0.125, 4.0}, sw = 2.0;
  for (int m = 0; m < 2; ++m) {
    for (int n = 0; n < 3; ++n) {
      double s = 0;
      for (int k = 0; k < 32; ++k) s += e4m3_value(qa[m * 32 + k]) * e4m3_value(qw[n * 32 + k]);
      const double want = s * sa[m] * sw;
      EXPECT_EQ(out[m * 5 + n], num::bf16_from_f32(static_cast<float>(want))) << m << "," << n << " want " << want;
    }
    EXPECT_EQ(out[m * 5 + 3], kPoisonBf16);  // the row padding is not written
    EXPECT_EQ(out[m * 5 + 4], kPoisonBf16);
  }
}

TEST(RefGemmFp8, SumsInsideABlockInKOrder) {
  // Block terms: 2^16, then 30 x 2^-8 (each exactly half an fp32 ulp of 2^16: the tie rounds
  // back to 2^16), then -2^16. In k order the result is exactly 0; any other order (small terms
  // first, pairwise) keeps some of the 30 * 2^-8 = 0.1171875.
  std::vector<uint8_t> qa(32), qw(32);
  qa[0] = 0x78;  // 256
  qw[0] = 0x78;  // 256
  for (int k = 1; k < 31; ++k) qa[k] = qw[k] = 0x18;  // 2^-4 * 2^-4 = 2^-8
  qa[31] = 0xF8;  // -256
  qw[31] = 0x78;
  const ActQuant a = act(1, 32, qa, {127});
  const Fp8Matrix w = fp8_matrix(1, 32, qw, {127});
  bf16_t out = kPoisonBf16;
  ref::gemm_fp8(a, w, &out, 1);
  EXPECT_EQ(out, 0x0000);
}

TEST(RefGemmFp8, AccumulatesKBlocksInOrder) {
  // Block sums (after scales): 2^24, 1, -2^24. In order: 2^24 + 1 ties back to 2^24, then 0.
  // Summing the 1 last would give 1 (bf16 0x3F80).
  std::vector<uint8_t> qa(96, 0), qw(96, 0);
  qa[0] = 0x38;  qw[0] = 0x38;    // 1 * 1, scales 2^12 * 2^12
  qa[32] = 0x38; qw[32] = 0x38;   // 1 * 1, scales 1 * 1
  qa[64] = 0xB8; qw[64] = 0x38;   // -1 * 1, scales 2^12 * 2^12
  const ActQuant a = act(1, 96, qa, {139, 127, 139});
  const Fp8Matrix w = fp8_matrix(1, 96, qw, {139, 127, 139});
  bf16_t out = kPoisonBf16;
  ref::gemm_fp8(a, w, &out, 1);
  EXPECT_EQ(out, 0x0000);
}

// ---- GEMMs against a double evaluation of the same operands -------------------------------------

// Compares bf16 outputs with double values: all within 1 bf16 ulp, or within the fp32
// accumulation bound (gamma_k * sum |terms|) where cancellation makes the result small.
void expect_near_double(const std::vector<bf16_t>& out, const std::vector<double>& want, const std::vector<double>& mag,
                        int64_t k, const char* what) {
  size_t exact = 0, one = 0;
  const double gamma = static_cast<double>(k) * std::ldexp(1.0, -24) * 1.01;
  for (size_t i = 0; i < out.size(); ++i) {
    const int32_t ulps = bf16_ulps(out[i], want[i]);
    exact += ulps == 0;
    one += ulps <= 1;
    if (ulps > 1) {
      const double err = std::fabs(bf16_value(out[i]) - want[i]);
      const double bound = gamma * mag[i] + std::fabs(want[i]) * std::ldexp(1.0, -8);
      EXPECT_LE(err, bound) << what << " element " << i << ": got " << bf16_value(out[i]) << " want " << want[i];
    }
  }
  const double n = static_cast<double>(out.size());
  std::printf("[ %s ] %zu elements: %.4f%% identical to bf16(double), %.4f%% within 1 bf16 ulp\n", what, out.size(),
              100.0 * exact / n, 100.0 * one / n);
  ::testing::Test::RecordProperty(std::string(what) + "_within_1ulp_fraction", std::to_string(one / n));
  EXPECT_GE(one / n, 0.999) << what;
}

TEST(RefGemmFp8, MatchesDoubleWithinOneUlp) {
  std::mt19937_64 rng(1001);
  const int64_t M = 7, N = 70, K = 512;  // N not a multiple of 32 or 8: partial panels and scale blocks
  const std::vector<bf16_t> x = random_bf16(static_cast<size_t>(M * K), rng);
  std::vector<float> wf = random_f32(static_cast<size_t>(N * K), rng, 1.0 / std::sqrt(K));
  const Fp8Matrix w = ref::quantize_fp8_blocks(wf, N, K);
  const ActQuant a = ref::act_quant(x.data(), M, K, K);
  std::vector<bf16_t> out(static_cast<size_t>(M * N), kPoisonBf16);
  ref::gemm_fp8(a, w, out.data(), N);
  std::vector<double> want(out.size()), mag(out.size());
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      double s = 0, sm = 0;
      for (int64_t k = 0; k < K; ++k) {
        const double t = e4m3_value(a.q[m * K + k]) * ue8m0_value(a.scale[m * (K / 32) + k / 32]) *
                         e4m3_value(w.w[n * K + k]) * ue8m0_value(w.scale[(n / 32) * (K / 32) + k / 32]);
        s += t;
        sm += std::fabs(t);
      }
      want[m * N + n] = s;
      mag[m * N + n] = sm;
    }
  expect_near_double(out, want, mag, K, "fp8 gemm");
  // The convenience overload (act_quant inside) gives the same bytes.
  std::vector<bf16_t> out2(out.size(), kPoisonBf16);
  ref::gemm_fp8(x.data(), M, K, w, out2.data(), N);
  EXPECT_EQ(out, out2);
}

TEST(RefGemmBf16, MatchesDoubleWithinOneUlp) {
  std::mt19937_64 rng(1002);
  const int64_t M = 5, N = 37, K = 640, XS = K + 16, OS = N + 3;
  const std::vector<bf16_t> x = random_bf16(static_cast<size_t>(M * XS), rng);
  Bf16Matrix w;
  w.n = N;
  w.k = K;
  w.w = random_bf16(static_cast<size_t>(N * K), rng, 1.0 / std::sqrt(K));
  std::vector<bf16_t> out(static_cast<size_t>(M * OS), kPoisonBf16);
  ref::gemm_bf16(x.data(), M, XS, w, out.data(), OS);
  std::vector<bf16_t> got;
  std::vector<double> want, mag;
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t n = 0; n < N; ++n) {
      double s = 0, sm = 0;
      for (int64_t k = 0; k < K; ++k) {
        const double t = static_cast<double>(bf16_value(x[m * XS + k])) * bf16_value(w.w[n * K + k]);
        s += t;
        sm += std::fabs(t);
      }
      got.push_back(out[m * OS + n]);
      want.push_back(s);
      mag.push_back(sm);
    }
    for (int64_t n = N; n < OS; ++n) EXPECT_EQ(out[m * OS + n], kPoisonBf16) << "row padding written";
  }
  expect_near_double(got, want, mag, K, "bf16 gemm");
}

TEST(RefGemmF32, MatchesDoubleWithinTheFp32Bound) {
  std::mt19937_64 rng(1003);
  const int64_t M = 3, N = 20, K = 256;
  const std::vector<bf16_t> x = random_bf16(static_cast<size_t>(M * K), rng);
  F32Matrix w;
  w.n = N;
  w.k = K;
  w.w = random_f32(static_cast<size_t>(N * K), rng, 1.0 / 16);
  std::vector<float> out(static_cast<size_t>(M * N), std::nanf(""));
  ref::gemm_f32(x.data(), M, K, w, out.data(), N);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      double s = 0, sm = 0;
      float seq = 0.0f;  // the defined order: one fp32 accumulator, k ascending, no FMA
      for (int64_t k = 0; k < K; ++k) {
        const double t = static_cast<double>(bf16_value(x[m * K + k])) * w.w[n * K + k];
        s += t;
        sm += std::fabs(t);
        seq = static_cast<float>(static_cast<double>(seq) +
                                 static_cast<double>(static_cast<float>(static_cast<double>(bf16_value(x[m * K + k])) * w.w[n * K + k])));
      }
      EXPECT_LE(std::fabs(out[m * N + n] - s), K * std::ldexp(1.0, -24) * sm) << m << "," << n;
      EXPECT_EQ(out[m * N + n], seq) << "fp32 accumulation is not in k order at " << m << "," << n;
    }
}

TEST(RefGemm, ResultsDoNotDependOnThreadCount) {
  ThreadsGuard guard;
  std::mt19937_64 rng(1004);
  const int64_t M = 8, N = 520, K = 512;  // above the threading threshold
  const std::vector<bf16_t> x = random_bf16(static_cast<size_t>(M * K), rng);
  const Fp8Matrix w8 = ref::quantize_fp8_blocks(random_f32(static_cast<size_t>(N * K), rng, 0.05), N, K);
  Bf16Matrix wb;
  wb.n = N;
  wb.k = K;
  wb.w = random_bf16(static_cast<size_t>(N * K), rng, 0.05);
  std::vector<bf16_t> o8[2], ob[2];
  for (int threads = 1; threads <= 2; ++threads) {
    ref::set_gemm_threads(threads);
    EXPECT_EQ(ref::gemm_threads(), threads);
    o8[threads - 1].assign(static_cast<size_t>(M * N), kPoisonBf16);
    ob[threads - 1].assign(static_cast<size_t>(M * N), kPoisonBf16);
    ref::gemm_fp8(x.data(), M, K, w8, o8[threads - 1].data(), N);
    ref::gemm_bf16(x.data(), M, K, wb, ob[threads - 1].data(), N);
  }
  EXPECT_EQ(o8[0], o8[1]);
  EXPECT_EQ(ob[0], ob[1]);
  EXPECT_EQ(std::count(o8[1].begin(), o8[1].end(), kPoisonBf16), 0);
  // A single row gives the same bytes as that row inside the batch (rows are independent).
  std::vector<bf16_t> row(static_cast<size_t>(N), kPoisonBf16);
  ref::gemm_fp8(x.data() + 5 * K, 1, K, w8, row.data(), N);
  EXPECT_TRUE(std::equal(row.begin(), row.end(), o8[1].begin() + 5 * N));
}

TEST(RefGemm, RefusesMismatchedShapes) {
  std::vector<bf16_t> x(64), out(64);
  Fp8Matrix w = ref::quantize_fp8_blocks(std::vector<float>(2 * 64, 0.5f), 2, 64);
  EXPECT_THROW(ref::gemm_fp8(x.data(), 1, 32, w, out.data(), 2), std::invalid_argument);  // stride < k
  EXPECT_THROW(ref::gemm_fp8(x.data(), 1, 64, w, nullptr, 2), std::invalid_argument);
  EXPECT_THROW(ref::gemm_fp8(x.data(), 1, 64, w, out.data(), 1), std::invalid_argument);  // out_stride < n
  const ActQuant a = ref::act_quant(x.data(), 1, 32, 32);
  EXPECT_THROW(ref::gemm_fp8(a, w, out.data(), 2), std::invalid_argument);  // k mismatch
  Bf16Matrix wb;
  wb.n = 2;
  wb.k = 64;
  wb.w.resize(100);  // wrong size
  EXPECT_THROW(ref::gemm_bf16(x.data(), 1, 64, wb, out.data(), 2), std::invalid_argument);
  EXPECT_THROW(ref::quantize_fp8_blocks(std::vector<float>(2 * 40), 2, 40), std::invalid_argument);
}

// ---- quantize_fp8_blocks / dequant_fp8 ----------------------------------------------------------

TEST(RefGemmQuantize, BlockScalesAndCodesByHand) {
  // n = 40 (a full 32-row block and a partial 8-row one), k = 64.
  const int64_t N = 40, K = 64;
  std::vector<float> w(N * K, 0.0f);
  w[0 * K + 0] = 1.0f;     // block (0,0): amax 1 -> 2^-8 (119); 1 -> 0x78
  w[31 * K + 31] = -0.5f;  //              -> -128 -> 0xF0
  w[5 * K + 40] = 3.0f;    // block (0,1): amax 3 -> 3/448 -> 2^-7 (120); 3 * 128 = 384 -> 0x7C
  w[6 * K + 41] = 0.1f;    //              12.8 -> 1.6 * 8 -> m 4.8 -> 5 -> 13 -> 0x55
  w[35 * K + 3] = 448.0f * 16;  // block (1,0): amax 7168 -> 16 (131); 7168 / 16 = 448 -> 0x7E
  // block (1,1) all zero: amax floored at 1e-4 -> 2^-22 (105).
  const Fp8Matrix q = ref::quantize_fp8_blocks(w, N, K);
  ASSERT_EQ(q.scale.size(), 4u);
  EXPECT_EQ(q.scale[0], 119);
  EXPECT_EQ(q.scale[1], 120);
  EXPECT_EQ(q.scale[2], 131);
  EXPECT_EQ(q.scale[3], 105);
  EXPECT_EQ(q.w[0 * K + 0], 0x78);
  EXPECT_EQ(q.w[31 * K + 31], 0xF0);
  EXPECT_EQ(q.w[5 * K + 40], 0x7C);
  EXPECT_EQ(q.w[6 * K + 41], 0x55);
  EXPECT_EQ(q.w[35 * K + 3], 0x7E);
  EXPECT_EQ(q.w[1 * K + 1], 0x00);
  const std::vector<float> d = ref::dequant_fp8(q);
  EXPECT_EQ(d[0], 1.0f);
  EXPECT_EQ(d[31 * K + 31], -0.5f);
  EXPECT_EQ(d[5 * K + 40], 3.0f);
  EXPECT_EQ(d[6 * K + 41], 0.1015625f);  // 13 / 128
  EXPECT_EQ(d[35 * K + 3], 7168.0f);
}

TEST(RefGemmQuantize, RoundTripWithinHalfAnE4m3Step) {
  std::mt19937_64 rng(1005);
  const int64_t N = 70, K = 96;
  const std::vector<float> w = random_f32(static_cast<size_t>(N * K), rng, 0.03);
  const Fp8Matrix q = ref::quantize_fp8_blocks(w, N, K);
  const std::vector<float> d = ref::dequant_fp8(q);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < K; ++k) {
      const double s = ue8m0_value(q.scale[(n / 32) * (K / 32) + k / 32]);
      const double x = w[n * K + k] / s;  // in units of the block scale, |x| <= 448
      ASSERT_LE(std::fabs(x), 448.0);
      const double step = std::fabs(x) < std::ldexp(1.0, -6) ? std::ldexp(1.0, -9)
                                                             : std::ldexp(1.0, std::ilogb(std::fabs(x)) - 3);
      EXPECT_LE(std::fabs(d[n * K + k] / s - x), step / 2) << n << "," << k;
      EXPECT_EQ(d[n * K + k], static_cast<float>(e4m3_value(q.w[n * K + k]) * s));
    }
}

TEST(RefGemmQuantize, CodesAreTheActQuantRuleAcrossMagnitudes) {
  // Values spread over 2^-40 .. 2^9 inside each block (e4m3 subnormals, underflow to 0, RNE ties
  // and the top of the range), plus exact ties: the codes must be act_quant_code(w / s, s).
  std::mt19937_64 rng(1006);
  std::uniform_real_distribution<double> mant(1.0, 2.0);
  std::uniform_int_distribution<int> expo(-40, 9);
  const int64_t N = 64, K = 256;
  std::vector<float> w(static_cast<size_t>(N * K));
  for (size_t i = 0; i < w.size(); ++i) {
    const double m = (i % 7 == 0) ? 1.0 + (static_cast<double>(i % 16) + 0.5) / 16.0 : mant(rng);  // some ties
    w[i] = static_cast<float>(std::ldexp((i & 1) ? -m : m, expo(rng)));
  }
  const Fp8Matrix q = ref::quantize_fp8_blocks(w, N, K);
  size_t subnormal = 0;
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < K; ++k) {
      const uint8_t sb = q.scale[static_cast<size_t>((n / 32) * (K / 32) + k / 32)];
      const float s = static_cast<float>(ue8m0_value(sb));
      const uint8_t want = num::act_quant_code(w[static_cast<size_t>(n * K + k)], s);
      subnormal += (want & 0x78) == 0 && (want & 7) != 0;
      ASSERT_EQ(q.w[static_cast<size_t>(n * K + k)], want) << n << "," << k << " value " << w[static_cast<size_t>(n * K + k)];
    }
  EXPECT_GT(subnormal, 100u);  // the subnormal codes were exercised
}

}  // namespace
