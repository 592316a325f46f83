// v4attn shared numerics: every elementwise primitive of DeepSeek-V4.1-Flash attention, written
// once for the host (CPU reference) and the device (CUDA kernels). Spec: v41-attention.md
// sections 2 and 6. Including this header needs no CUDA runtime on the host side.
//
// Rules that make host and device produce identical bytes:
//  - every fp32 operation that the spec rounds is an explicit *_rn helper below (device:
//    __fmul_rn etc., never contracted into an FMA; host: plain operators, built with
//    -ffp-contract=off);
//  - conversions (bf16, e4m3, e2m1, ue8m0) are integer bit manipulation, no libm;
//  - division and square root are IEEE correctly rounded on both sides (__fdiv_rn, __fsqrt_rn);
//  - transcendentals (exp of the pair softmax) are evaluated in double and rounded to fp32:
//    both sides call the correctly-rounded-in-practice double exp of their own libm, which is
//    the one place we depend on two libraries agreeing; the device result is checked against the
//    host on every test input;
//  - reductions follow the one order defined by `LaneSum` below.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define V4_HD __host__ __device__ __forceinline__
#else
#define V4_HD inline
#endif

namespace v4attn::num {

// ---- bit casts and correctly rounded fp32 arithmetic -----------------------------------------
V4_HD uint32_t f32_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}
V4_HD float f32_from_bits(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}
V4_HD float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
V4_HD float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
V4_HD float sub_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}
V4_HD float div_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}
V4_HD float sqrt_rn(float a) {
#if defined(__CUDA_ARCH__)
  return __fsqrt_rn(a);
#else
  return std::sqrt(a);
#endif
}
V4_HD bool is_nan(float f) { return (f32_bits(f) & 0x7fffffffu) > 0x7f800000u; }
V4_HD bool is_finite(float f) { return (f32_bits(f) & 0x7f800000u) != 0x7f800000u; }
V4_HD float abs_f(float f) { return f32_from_bits(f32_bits(f) & 0x7fffffffu); }
// max/min that return the non-NaN operand, like fmaxf/fminf (and CUDA's fmaxf/fminf).
V4_HD float max_f(float a, float b) { return is_nan(a) ? b : (is_nan(b) ? a : (a > b ? a : b)); }
V4_HD float min_f(float a, float b) { return is_nan(a) ? b : (is_nan(b) ? a : (a < b ? a : b)); }
V4_HD float clamp_f(float x, float lo, float hi) { return min_f(max_f(x, lo), hi); }

// exp for the ratio-2 pair softmax: double exp, rounded once to fp32 (spec section 6).
V4_HD float exp_f32_via_f64(float x) { return static_cast<float>(exp(static_cast<double>(x))); }

// ---- bf16 -----------------------------------------------------------------------------------
using bf16_t = uint16_t;  // raw bits; arithmetic always happens in fp32

V4_HD bf16_t bf16_from_f32(float f) {  // round to nearest even; NaN -> canonical quiet NaN
  uint32_t u = f32_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<bf16_t>(((u >> 16) & 0x8000u) | 0x7fc0u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<bf16_t>(u >> 16);
}
V4_HD float f32_from_bf16(bf16_t b) { return f32_from_bits(static_cast<uint32_t>(b) << 16); }
V4_HD float round_bf16(float f) { return f32_from_bf16(bf16_from_f32(f)); }
// Finite (not +-inf, not NaN): the exponent field is not all ones.
V4_HD bool bf16_is_finite(bf16_t b) { return (b & 0x7f80u) != 0x7f80u; }
// The index of the first non-finite value of p[0..n), or -1 when all are finite (host-side input
// checks: cache-layouts.md asks non-finite activations to be refused where the host can see them).
inline int64_t first_non_finite_bf16(const bf16_t* p, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    if (!bf16_is_finite(p[i])) return i;
  return -1;
}

// ---- round-to-nearest-even integer shift helper (shift in 1..31) -----------------------------
V4_HD uint32_t shr_rne(uint32_t v, uint32_t shift) {
  if (shift >= 32) return 0;
  uint32_t q = v >> shift;
  uint32_t rem = v & ((1u << shift) - 1u);
  uint32_t half = 1u << (shift - 1);
  if (rem > half || (rem == half && (q & 1u))) ++q;
  return q;
}

// ---- e4m3 (float8_e4m3fn: bias 7, no inf, 0x7f/0xff NaN, max 448) ---------------------------
constexpr float kE4m3Max = 448.0f;

// Round to nearest even, saturating to +-448 (inf included); NaN -> 0x7f with the sign.
V4_HD uint8_t e4m3_from_f32(float f) {
  const uint32_t u = f32_bits(f);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return static_cast<uint8_t>(sign | 0x7fu);
  if (a >= 0x43e00000u) return static_cast<uint8_t>(sign | 0x7eu);  // >= 448 (and inf)
  const int exp = static_cast<int>(a >> 23) - 127;
  if (exp < -6) {
    // e4m3 subnormal range: value = q * 2^-9, q = rne(a * 2^9). fp32 subnormals round to 0.
    if ((a >> 23) == 0) return sign;
    const uint32_t mant = (a & 0x7fffffu) | 0x800000u;  // a = mant * 2^(exp-23)
    const uint32_t q = shr_rne(mant, static_cast<uint32_t>(14 - exp));  // 14-exp >= 21
    return static_cast<uint8_t>(sign | q);  // q == 8 is exactly the smallest normal (0x08)
  }
  uint32_t q = shr_rne(a & 0x7fffffu, 20);  // 3 mantissa bits, may carry to 8
  int e = exp + 7;
  if (q == 8) { q = 0; ++e; }
  uint32_t code = (static_cast<uint32_t>(e) << 3) | q;
  if (code > 0x7eu) code = 0x7eu;
  return static_cast<uint8_t>(sign | code);
}
V4_HD float f32_from_e4m3(uint8_t b) {
  const uint32_t sign = static_cast<uint32_t>(b & 0x80u) << 24;
  const uint32_t e = (b >> 3) & 0xfu, m = b & 7u;
  if (e == 0xfu && m == 7u) return f32_from_bits(sign | 0x7fc00000u);
  if (e == 0) {
    const float v = static_cast<float>(m) * 0.001953125f;  // m * 2^-9, exact
    return f32_from_bits(f32_bits(v) | sign);
  }
  return f32_from_bits(sign | ((e - 7u + 127u) << 23) | (m << 20));
}

// ---- e2m1 (fp4): grid {0, .5, 1, 1.5, 2, 3, 4, 6}; sign in bit 3 -----------------------------
// Round to nearest, ties to the even code (0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4,
// 5->4); |x| > 6 saturates to 6. Callers clamp first (spec); NaN encodes as 0x7 with its sign.
// The sign bit is kept for every input, -0.0 and values rounding to zero included.
V4_HD uint8_t e2m1_from_f32(float f) {
  const uint8_t sign = (f32_bits(f) >> 31) ? 0x8u : 0x0u;
  const float a = abs_f(f);
  uint8_t c;
  if (a <= 0.25f) c = 0;
  else if (a < 0.75f) c = 1;
  else if (a <= 1.25f) c = 2;
  else if (a < 1.75f) c = 3;
  else if (a <= 2.5f) c = 4;
  else if (a < 3.5f) c = 5;
  else if (a <= 5.0f) c = 6;
  else c = 7;  // (5, inf] and NaN
  return static_cast<uint8_t>(sign | c);
}
V4_HD float f32_from_e2m1(uint8_t code) {
  const uint8_t c = code & 7u;
  // grid values: c<4 -> c*0.5; 4->2, 5->3, 6->4, 7->6
  const float mag = c < 4 ? static_cast<float>(c) * 0.5f : (c == 4 ? 2.0f : (c == 5 ? 3.0f : (c == 6 ? 4.0f : 6.0f)));
  return (code & 8u) ? -mag : mag;
}
// Two codes per byte: even element in the low nibble.
V4_HD uint8_t pack_e2m1(uint8_t even, uint8_t odd) { return static_cast<uint8_t>((even & 0xfu) | ((odd & 0xfu) << 4)); }

// ---- ue8m0 and pow2ceil ---------------------------------------------------------------------
// pow2ceil(v) = 2^ceil(log2 v) from the fp32 bits: e = exponent(v) - 127 + (mantissa != 0).
// Defined for positive normal v (every caller floors its amax so that v is normal).
V4_HD int pow2ceil_exp(float v) {
  const uint32_t u = f32_bits(v);
  return static_cast<int>((u >> 23) & 0xffu) - 127 + ((u & 0x7fffffu) != 0 ? 1 : 0);
}
V4_HD float pow2_f32(int e) {  // 2^e for -126 <= e <= 127
  return f32_from_bits(static_cast<uint32_t>(e + 127) << 23);
}
V4_HD float pow2ceil(float v) { return pow2_f32(pow2ceil_exp(v)); }
V4_HD uint8_t ue8m0_from_exp(int e) { return static_cast<uint8_t>(e + 127); }
V4_HD float f32_from_ue8m0(uint8_t b) {  // 2^(b-127); b = 0 would be 2^-127 (subnormal)
  return b == 0 ? f32_from_bits(0x00400000u) : f32_from_bits(static_cast<uint32_t>(b) << 23);
}
// The fp32 value of the ue8m0 scale byte of exponent e (what a kernel reads back after storing it).
V4_HD float f32_from_scale_exp(int e) { return f32_from_ue8m0(ue8m0_from_exp(e)); }

// ---- the three block quantizers of spec section 2 -------------------------------------------
// Each takes the block's values as fp32 (already bf16-rounded where the spec says bf16) and
// writes codes + one scale byte. amax is the max of |x| over the block (NaN-skipping max).

constexpr int kActQuantBlock = 32;     // FP8 act quant, ue8m0 scale
constexpr int kIndexerQuantBlock = 32; // FP4 indexer quant, ue8m0 scale
constexpr int kKvFp4Block = 16;        // FP4 KV quant, e4m3 scale

// amax = max(amax, |x|), skipping a NaN x. Callers start amax at 0 and fold |values| (or another
// amax) into it, so amax is never NaN and never -0; for such an amax, fmaxf(amax, |x|) is the same
// value in every case (both operands >= +0 or |x| NaN, which fmaxf skips as max_f does): one FMNMX
// with an |.| operand on the device instead of max_f's NaN tests. GpuNumerics checks it for every
// fp32 x against max_f at several amax values.
V4_HD float block_amax_step(float amax, float x) {
#if defined(__CUDA_ARCH__)
  return fmaxf(amax, fabsf(x));
#else
  return max_f(amax, abs_f(x));
#endif
}

// FP8 act quant: amax = max(amax, 1e-4); s = pow2ceil(amax * fp32(1/448)); q = e4m3(clamp(x/s)).
V4_HD int act_quant_scale_exp(float amax) {
#if defined(__CUDA_ARCH__)
  // max_f against a non-zero, non-NaN constant is fmaxf (no signed-zero tie, NaN gives the constant).
  return pow2ceil_exp(mul_rn(fmaxf(amax, 1e-4f), 1.0f / 448.0f));
#else
  return pow2ceil_exp(mul_rn(max_f(amax, 1e-4f), 1.0f / 448.0f));
#endif
}
// x / s for a block scale s. When s is a power of two whose reciprocal is a normal fp32 (every
// ue8m0 scale of the spec's quantizers: 2^-126 < s < 2^127), x * (1/s) is the same correctly
// rounded value as x / s (both round the same real number x * 2^-e), so both sides take the one
// multiplication; any other s (e.g. an e4m3 KV scale) divides.
V4_HD float div_by_scale(float x, float s) {
  const uint32_t u = f32_bits(s);
  const uint32_t e = (u >> 23) & 0xffu;
  if ((u & 0x807fffffu) == 0u && e >= 1u && e <= 253u) return mul_rn(x, f32_from_bits((254u - e) << 23));
  return div_rn(x, s);
}

// e4m3 of a value already clamped to [-448, 448] (never NaN). Device: the hardware conversion
// (cvt.rn.satfinite.e4m3x2.f32: round to nearest even, the same subnormals; one instruction instead
// of the bit manipulation), which GpuNumerics.E4m3HardwareMatchesSoftwareForEveryFloat checks
// against e4m3_from_f32 for all 2^32 fp32 bit patterns after the clamp; host: e4m3_from_f32.
V4_HD uint8_t e4m3_from_clamped_f32(float x) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  uint16_t r;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(0.0f), "f"(x));  // x -> the low byte
  return static_cast<uint8_t>(r & 0xffu);
#else
  return e4m3_from_f32(x);
#endif
}

V4_HD uint8_t act_quant_code(float x, float s) {
  return e4m3_from_clamped_f32(clamp_f(div_by_scale(x, s), -kE4m3Max, kE4m3Max));
}
// The same code with div_by_scale's test hoisted out of a block's elements: for the act quant's
// scale 2^e, act_quant_inv_scale(e) is the reciprocal div_by_scale multiplies by (exactly when
// -126 <= e <= 126, the exponents whose 2^e and 2^-e are both normal), else 0, and then
// act_quant_code_by_inv(x, inv) == act_quant_code(x, pow2_f32(e)) for every x. Callers test inv
// once per block and take act_quant_code (the division) when it is 0 (infinite / NaN amax only).
// Why: per element, div_by_scale's fallback puts a branch and a division subroutine around every
// multiplication, which serialises the exact act quant of a chunk on the device.
V4_HD float act_quant_inv_scale(int e) { return (e >= -126 && e <= 126) ? pow2_f32(-e) : 0.0f; }
V4_HD uint8_t act_quant_code_by_inv(float x, float inv_s) {
  return e4m3_from_clamped_f32(clamp_f(mul_rn(x, inv_s), -kE4m3Max, kE4m3Max));
}
// Two codes at once: act_quant_code_by_inv(lo, inv_s) | act_quant_code_by_inv(hi, inv_s) << 8. Device:
// one cvt.rn.satfinite.e4m3x2.f32 per pair after a lower clamp only (fmaxf(v, -448): a NaN product
// becomes -448 as clamp_f makes it; the conversion's saturation takes values above 448 and +inf to 448,
// the upper clamp's result), 4 instructions per pair instead of ~14. GpuNumerics checks it against
// act_quant_code_by_inv for every fp32 product.
V4_HD uint16_t act_quant_code2_by_inv(float lo, float hi, float inv_s) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  const float a = fmaxf(__fmul_rn(lo, inv_s), -kE4m3Max), b = fmaxf(__fmul_rn(hi, inv_s), -kE4m3Max);
  uint16_t r;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(b), "f"(a));  // the second source -> the low byte
  return r;
#else
  return static_cast<uint16_t>(act_quant_code_by_inv(lo, inv_s) | (act_quant_code_by_inv(hi, inv_s) << 8));
#endif
}

// FP4 indexer quant: amax = max(amax, 6 * 2^-126); s = pow2ceil(amax * fp32(1/6)).
V4_HD int indexer_quant_scale_exp(float amax) {
  return pow2ceil_exp(mul_rn(max_f(amax, 6.0f * 1.17549435e-38f), 1.0f / 6.0f));
}
V4_HD uint8_t fp4_code(float x, float s) { return e2m1_from_f32(clamp_f(div_by_scale(x, s), -6.0f, 6.0f)); }

// FP4 KV quant: amax = max(amax, 6 * 2^-9); s = e4m3(clamp(amax / 6, -448, 448)) (as a float).
V4_HD uint8_t kv_fp4_scale_byte(float amax) {
  return e4m3_from_f32(clamp_f(div_rn(max_f(amax, 6.0f * 0.001953125f), 6.0f), -kE4m3Max, kE4m3Max));
}

// ---- the one reduction order: LaneSum ---------------------------------------------------------
// Sums (of squares, of products) over a row of n values, n a multiple of 8, are defined as what
// one warp computes: the row is cut into chunks of 8 consecutive elements; chunk c belongs to
// lane c % 32; each lane accumulates its chunks in increasing order, each chunk's 8 terms in
// order (acc = acc + term, every term already rounded); then the 32 lane partials are combined
// by the xor butterfly with offsets 16, 8, 4, 2, 1 (p[l] = p[l] + p[l ^ off]). IEEE addition is
// commutative, so every lane ends with the same value. The CPU mirror is lane_sum_combine().
constexpr int kLaneSumLanes = 32;
constexpr int kLaneSumChunk = 8;

// Host mirror of the butterfly: combines 32 partials in place and returns the total.
inline float lane_sum_combine(float* p) {
  for (int off = 16; off >= 1; off >>= 1) {
    float next[kLaneSumLanes];
    for (int l = 0; l < kLaneSumLanes; ++l) next[l] = add_rn(p[l], p[l ^ off]);
    for (int l = 0; l < kLaneSumLanes; ++l) p[l] = next[l];
  }
  return p[0];
}
// Host: sum of squares of x[0..n) in the LaneSum order.
inline float lane_sum_squares(const float* x, int n) {
  float p[kLaneSumLanes] = {};
  for (int c = 0; c * kLaneSumChunk < n; ++c)
    for (int k = 0; k < kLaneSumChunk; ++k) {
      const float v = x[c * kLaneSumChunk + k];
      p[c % kLaneSumLanes] = add_rn(p[c % kLaneSumLanes], mul_rn(v, v));
    }
  return lane_sum_combine(p);
}

// RMSNorm's scalar part, given the LaneSum'd sum of squares: r = 1 / sqrt(ss / n + eps).
V4_HD float rmsnorm_rstd(float sum_sq, int n, float eps) {
  return div_rn(1.0f, sqrt_rn(add_rn(div_rn(sum_sq, static_cast<float>(n)), eps)));
}
// w * (x * r) in fp32, the weight multiplied after the normalisation (before the bf16 rounding).
V4_HD float rmsnorm_product(float x, float r, float w) { return mul_rn(w, mul_rn(x, r)); }
// y = bf16(w * (x * r)).
V4_HD bf16_t rmsnorm_apply(float x, float r, float w) { return bf16_from_f32(rmsnorm_product(x, r, w)); }
// The bf16 bits of two fp32 results of device arithmetic (lo in the low half): bf16_from_f32 of each,
// except that a NaN may come out with another payload. Device: one cvt.rn.bf16x2.f32 (round to nearest
// even, like bf16_from_f32; GpuNumerics checks every fp32 bit pattern). A NaN that device arithmetic
// produces is the positive canonical NaN, which both conversions turn into a positive NaN, so
// bf16_from_f32 of the widened result gives the same bits either way.
V4_HD uint32_t bf16x2_from_f32_arith(float lo, float hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  uint32_t r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));  // the second source -> the low half
  return r;
#else
  return static_cast<uint32_t>(bf16_from_f32(lo)) | (static_cast<uint32_t>(bf16_from_f32(hi)) << 16);
#endif
}
// round_bf16 (the float value of bf16_from_f32) of one result of device arithmetic: the same value,
// a NaN possibly with another payload (as bf16x2_from_f32_arith, whose conversion it is).
V4_HD float round_bf16_arith(float f) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  return f32_from_bits(bf16x2_from_f32_arith(f, 0.0f) << 16);
#else
  return round_bf16(f);
#endif
}
// round_bf16_arith of two results in place, with one conversion (the pair helpers' form).
V4_HD void round_bf16_pair_arith(float& lo, float& hi) {
  const uint32_t h = bf16x2_from_f32_arith(lo, hi);
  lo = f32_from_bits(h << 16);
  hi = f32_from_bits(h & 0xffff0000u);
}

// ---- RoPE -----------------------------------------------------------------------------------
// Table: fp32 [max_pos, 64] = 32 interleaved (cos, sin) pairs per position (built on the host
// by rope_table.h). Applied to the last 64 dims of a vector, adjacent pairs as one complex
// number (GPT-J style): re' = re*c - im*s, im' = re*s + im*c, each product rounded first.
constexpr int kRopeDim = 64;
constexpr int kRopePairs = 32;

V4_HD void rope_rotate(float re, float im, float c, float s, float& out_re, float& out_im) {
  out_re = sub_rn(mul_rn(re, c), mul_rn(im, s));
  out_im = add_rn(mul_rn(re, s), mul_rn(im, c));
}
// Inverse RoPE uses (c, -s).
V4_HD void rope_rotate_inverse(float re, float im, float c, float s, float& out_re, float& out_im) {
  rope_rotate(re, im, c, -s, out_re, out_im);
}

// ---- ratio-2 pair softmax -------------------------------------------------------------------
// pooled = kv_a * p_a + kv_b * p_b, p = softmax(score_a, score_b) per dimension:
// m = max(a, b); ea = exp(a - m); eb = exp(b - m); p_a = ea / (ea + eb); p_b = eb / (ea + eb).
V4_HD float pair_softmax_pool(float kv_a, float score_a, float kv_b, float score_b) {
  const float m = max_f(score_a, score_b);
  const float ea = exp_f32_via_f64(sub_rn(score_a, m));
  const float eb = exp_f32_via_f64(sub_rn(score_b, m));
  const float den = add_rn(ea, eb);
  const float pa = div_rn(ea, den), pb = div_rn(eb, den);
  return add_rn(mul_rn(kv_a, pa), mul_rn(kv_b, pb));
}

}  // namespace v4attn::num
