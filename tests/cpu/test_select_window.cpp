// The selections' window exchange (src/kernels/indexer_select_window.h, used by the v3 top-k and
// candidate-mask kernels with v3_window): a CPU model of one cluster's exchange, built on the same
// functions the kernel calls -- each CTA's statistics and window histogram over its chunk, every
// CTA's combine of the cluster's windows under the largest top, the decision, and the bin that holds
// the k-th key with the counts above it and before each CTA -- checked against a direct count over
// the whole row. The GPU tests (GpuIndexerSelectV3.*Window*, and every selection test in both forms)
// compare the kernels' bytes; this one runs in CI and pins the alignment arithmetic: a window base
// off by one prefix, a CTA whose window misses or overlaps the cluster's partly, +inf keys, rows
// whose k-th key lies just inside or just outside the window.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "kernels/indexer_select_keys.h"
#include "kernels/indexer_select_window.h"
#include "v4attn/numerics.h"

namespace {

using namespace v4attn;
namespace sw = kernels::select_window;

// A score's key as the kernels load it (-inf and NaN: 0, never selected).
uint32_t key_of(float v) {
  return v > -std::numeric_limits<float>::infinity() ? kernels::select_keys::value_key(v) : 0u;
}

// What one CTA (rank) of the model computes from the cluster's exchange.
struct Outcome {
  bool all = false;       // at most k valid keys
  bool decided = false;   // the k-th key's 16-bit prefix found
  uint32_t prefix = 0u;   // its prefix
  uint32_t above = 0u;    // cluster keys ranked above that prefix (+inf keys included)
  uint32_t total_d = 0u;  // cluster keys of that prefix
  uint32_t before_above = 0u, before_d = 0u;  // of those, in the lower ranks' chunks
};

// The exchange of one row split into `cluster` chunks as the v3 kernels split it (ceil(n / cluster)
// rounded up to 8 per CTA), seen by CTA `rank`.
Outcome model_exchange(const std::vector<uint32_t>& keys, int cluster, int rank, uint32_t k) {
  const int64_t n = static_cast<int64_t>(keys.size());
  const int64_t per = ((n + cluster - 1) / cluster + 7) / 8 * 8;
  struct Slot {
    std::vector<uint32_t> hist = std::vector<uint32_t>(sw::kBins, 0u);
    uint32_t top = 0u, n_inf = 0u, n_valid = 0u;
  };
  std::vector<Slot> slots(static_cast<size_t>(cluster));
  for (int r = 0; r < cluster; ++r) {
    Slot& s = slots[static_cast<size_t>(r)];
    const int64_t b = std::min(r * per, n), e = std::min(b + per, n);
    for (int64_t j = b; j < e; ++j) {  // window_stats
      const uint32_t key = keys[static_cast<size_t>(j)];
      s.n_valid += key != 0u;
      s.n_inf += key >= sw::kInfKey;
      if (key < sw::kInfKey) s.top = std::max(s.top, key);
    }
    const uint32_t lo = sw::base(s.top) << 16;  // window_histogram
    for (int64_t j = b; j < e; ++j) {
      const uint32_t key = keys[static_cast<size_t>(j)];
      if (sw::counts(key, lo)) {
        const uint32_t bin = sw::bin(key, lo);
        EXPECT_LT(bin, static_cast<uint32_t>(sw::kBins)) << "a counted key outside its CTA's window";
        if (bin < sw::kBins) ++s.hist[bin];
      }
    }
  }
  // The combine (window_exchange): the cluster's statistics, then prefix top - i for i = 0..255.
  uint32_t top_key = 0u, inf_all = 0u, inf_bef = 0u, val_all = 0u, val_bef = 0u;
  for (int r = 0; r < cluster; ++r) {
    const Slot& s = slots[static_cast<size_t>(r)];
    top_key = std::max(top_key, s.top);
    inf_all += s.n_inf;
    val_all += s.n_valid;
    inf_bef += r < rank ? s.n_inf : 0u;
    val_bef += r < rank ? s.n_valid : 0u;
  }
  Outcome o;
  if (val_all <= k) {
    o.all = true;
    return o;
  }
  const uint32_t top = top_key >> 16;
  std::vector<uint32_t> tot(sw::kBins, 0u), bef(sw::kBins, 0u);
  uint32_t in_window = 0u;
  for (uint32_t i = 0; i < sw::kBins && i <= top; ++i)
    for (int r = 0; r < cluster; ++r) {
      const Slot& s = slots[static_cast<size_t>(r)];
      const uint32_t v = sw::bin_count(s.hist.data(), s.top, top - i);
      tot[i] += v;
      bef[i] += r < rank ? v : 0u;
      in_window += v;
    }
  if (!sw::decides(inf_all, in_window, k)) return o;
  uint32_t incl_t = inf_all, incl_b = inf_bef;
  for (uint32_t i = 0; i < sw::kBins; ++i) {
    incl_t += tot[i];
    incl_b += bef[i];
    const uint32_t above = incl_t - tot[i];
    if (above < k && k <= incl_t) {
      o.decided = true;
      o.prefix = top - i;
      o.above = above;
      o.total_d = tot[i];
      o.before_above = incl_b - bef[i];
      o.before_d = bef[i];
      return o;
    }
  }
  ADD_FAILURE() << "decides() held but no bin holds the k-th key";
  return o;
}

// The direct counts over the row, and whether the exchange should decide: the k-th key (ties of equal
// keys are one value here) is finite and its prefix within 255 of the largest finite key's.
void check_row(const std::vector<float>& row, uint32_t k, const std::string& what, int* n_decided = nullptr,
               int* n_fallback = nullptr) {
  std::vector<uint32_t> keys(row.size());
  for (size_t j = 0; j < row.size(); ++j) keys[j] = key_of(row[j]);
  std::vector<uint32_t> valid;
  uint32_t top = 0u, n_inf = 0u;
  for (uint32_t key : keys)
    if (key != 0u) {
      valid.push_back(key);
      if (key >= sw::kInfKey) ++n_inf;
      else top = std::max(top, key);
    }
  const bool all = valid.size() <= k;
  uint32_t kth = 0u;
  if (!all) {
    std::nth_element(valid.begin(), valid.begin() + (k - 1), valid.end(), std::greater<uint32_t>());
    kth = valid[k - 1];
  }
  const bool want_decided = !all && n_inf < k && kth < sw::kInfKey && (kth >> 16) >= sw::base(top);
  const int64_t n = static_cast<int64_t>(keys.size());
  for (int cluster : {1, 2, 4, 8, 16}) {
    const int64_t per = ((n + cluster - 1) / cluster + 7) / 8 * 8;
    for (int rank : {0, cluster / 2, cluster - 1}) {
      SCOPED_TRACE(what + ", cluster " + std::to_string(cluster) + ", rank " + std::to_string(rank));
      const Outcome o = model_exchange(keys, cluster, rank, k);
      ASSERT_EQ(o.all, all);
      ASSERT_EQ(o.decided, want_decided);
      if (!o.decided) continue;
      const uint32_t p = kth >> 16;
      uint32_t above = 0u, total_d = 0u, before_above = 0u, before_d = 0u;
      for (int64_t j = 0; j < n; ++j) {
        const uint32_t key = keys[static_cast<size_t>(j)];
        if (key == 0u) continue;
        const bool lower = j < std::min<int64_t>(int64_t{rank} * per, n);
        if ((key >> 16) > p) above += 1, before_above += lower;
        if ((key >> 16) == p) total_d += 1, before_d += lower;
      }
      EXPECT_EQ(o.prefix, p);
      EXPECT_EQ(o.above, above);
      EXPECT_EQ(o.total_d, total_d);
      EXPECT_EQ(o.before_above, before_above);
      EXPECT_EQ(o.before_d, before_d);
    }
  }
  if (n_decided != nullptr && want_decided) ++*n_decided;
  if (n_fallback != nullptr && !all && !want_decided) ++*n_fallback;
}

TEST(SelectWindow, BaseAndBins) {
  EXPECT_EQ(sw::base(0u), 0u);
  EXPECT_EQ(sw::base(0x00fe0000u), 0u);             // top prefix 254: the window starts at 0
  EXPECT_EQ(sw::base(0x00ff0000u), 0u);             // 255: exactly 0..255
  EXPECT_EQ(sw::base(0x01000000u), 1u);             // 256: 1..256
  EXPECT_EQ(sw::base(0xc000ffffu), 0xc000u - 255u);  // key of 2.0f's neighbourhood
  // The lowest and highest prefix of a window land in bins 0 and 255; one below is not counted.
  const uint32_t top = 0xc0001234u, lo = sw::base(top) << 16;
  EXPECT_TRUE(sw::counts(lo, lo));
  EXPECT_EQ(sw::bin(lo, lo), 0u);
  EXPECT_TRUE(sw::counts(top, lo));
  EXPECT_EQ(sw::bin(top, lo), 255u);
  EXPECT_FALSE(sw::counts(lo - 1u, lo));
  EXPECT_FALSE(sw::counts(0u, 0u));            // never-selected keys
  EXPECT_FALSE(sw::counts(sw::kInfKey, lo));   // +inf ranks above every bin
  EXPECT_FALSE(sw::counts(sw::kInfKey, 0u));
  EXPECT_TRUE(sw::counts(sw::kInfKey - 1u, 0u));  // the largest finite key
  EXPECT_EQ(key_of(std::numeric_limits<float>::infinity()), sw::kInfKey);
  EXPECT_EQ(key_of(std::numeric_limits<float>::max()), sw::kInfKey - 1u);
  // bin_count: a CTA's window holds [base, top] only.
  std::vector<uint32_t> hist(sw::kBins);
  for (int i = 0; i < sw::kBins; ++i) hist[static_cast<size_t>(i)] = static_cast<uint32_t>(i + 1);
  EXPECT_EQ(sw::bin_count(hist.data(), top, top >> 16), 256u);
  EXPECT_EQ(sw::bin_count(hist.data(), top, sw::base(top)), 1u);
  EXPECT_EQ(sw::bin_count(hist.data(), top, sw::base(top) - 1u), 0u);
  EXPECT_EQ(sw::bin_count(hist.data(), top, (top >> 16) + 1u), 0u);
  // decides: the k-th key among the +inf keys, in the window, below it.
  EXPECT_FALSE(sw::decides(5, 100, 5));
  EXPECT_TRUE(sw::decides(4, 100, 5));
  EXPECT_TRUE(sw::decides(0, 100, 100));
  EXPECT_FALSE(sw::decides(0, 100, 101));
}

// Random rows of the shapes the kernels see (up to 64K positions), each cluster size, several k.
TEST(SelectWindow, ModelMatchesDirectCounts) {
  std::mt19937_64 rng(0x5e1ec7);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::uniform_real_distribution<float> u01(0.0f, 1.0f);
  int decided = 0, fallback = 0;
  for (int flavour = 0; flavour < 6; ++flavour)
    for (int64_t n : {700, 4097, 65537}) {
      std::vector<float> row(static_cast<size_t>(n));
      for (int64_t j = 0; j < n; ++j) {
        float v = 0.0f;
        switch (flavour) {
          case 0: v = 3.0f * nd(rng); break;                                        // N(0, 3)
          case 1: v = std::exp2(-0.1f * static_cast<float>(j * 16 / n)) * (0.5f + 0.5f * u01(rng)); break;
          case 2: v = -(1.0f + 0.2f * u01(rng)); break;                            // negative, narrow
          case 3: v = -(1.0f + 1000.0f * u01(rng)); break;                         // negative, wide
          case 4: v = static_cast<float>(rng() % 5); break;                        // few levels, ties
          case 5: v = u01(rng) < 0.7f ? -std::numeric_limits<float>::infinity() : nd(rng); break;
        }
        row[static_cast<size_t>(j)] = v;
      }
      if (flavour == 3) row[13] = -0.001f;  // the largest, far above the k-th
      if (flavour == 0) row[static_cast<size_t>(n / 3)] = std::numeric_limits<float>::infinity();
      for (uint32_t k : {1u, 64u, 512u, 2048u})
        check_row(row, k, "flavour " + std::to_string(flavour) + " n " + std::to_string(n) + " k " + std::to_string(k),
                  &decided, &fallback);
    }
  // Not vacuous: both outcomes of the exchange occur.
  EXPECT_GT(decided, 10);
  EXPECT_GT(fallback, 3);
}

// The edges the window is built around: the k-th key in the window's lowest prefix (P - 255) or one
// below it (P - 256), with ties; CTA maxima a fraction of a binade apart (windows that overlap the
// cluster's partly); +inf keys below and past k; an outlier far above the rest; valid keys in the
// last chunk only (CTAs with no valid key send a top of 0).
TEST(SelectWindow, EdgeRows) {
  std::mt19937_64 rng(0x5e1ec8);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  const int64_t n = 65536;
  const float ninf = -std::numeric_limits<float>::infinity(), inf = std::numeric_limits<float>::infinity();
  for (uint32_t kstar_bits : {0x3f010000u, 0x3f00ffffu, 0x3f01ffffu}) {
    std::vector<float> row(static_cast<size_t>(n), 0.3f);
    row[40000] = 2.0f;  // prefix 0xc000
    for (int i = 0; i < 510; ++i) row[static_cast<size_t>((i * 127 + 11) % n)] = 1.5f;
    for (int i = 0; i < 30; ++i) row[static_cast<size_t>((i * 2111 + 5) % n)] = num::f32_from_bits(kstar_bits);
    int decided = 0, fallback = 0;
    check_row(row, 512, "k-th at bits " + std::to_string(kstar_bits), &decided, &fallback);
    EXPECT_EQ(decided, kstar_bits == 0x3f00ffffu ? 0 : 1);  // prefix 0xbf00 = P - 256: below the window
    EXPECT_EQ(fallback, kstar_bits == 0x3f00ffffu ? 1 : 0);
  }
  std::vector<float> row(static_cast<size_t>(n));
  for (int64_t j = 0; j < n; ++j)
    row[static_cast<size_t>(j)] =
        std::exp2(-0.37f * static_cast<float>(j / 4096 % 13)) * (0.25f + 0.75f * std::abs(nd(rng)) / 4.0f);
  for (uint32_t k : {1u, 512u, 8192u, 30000u}) check_row(row, k, "staggered maxima, k " + std::to_string(k));
  for (int n_inf : {100, 511, 512, 600}) {
    for (int64_t j = 0; j < n; ++j) row[static_cast<size_t>(j)] = nd(rng);
    for (int i = 0; i < n_inf; ++i) row[static_cast<size_t>((int64_t{i} * 104729 + 7) % n)] = inf;
    int decided = 0;
    check_row(row, 512, "+inf keys " + std::to_string(n_inf), &decided);
    EXPECT_EQ(decided, n_inf < 512 ? 1 : 0);
  }
  for (int64_t j = 0; j < n; ++j) row[static_cast<size_t>(j)] = 1.0f + 0.01f * nd(rng);
  row[777] = 1e6f;
  int decided = 0;
  check_row(row, 512, "outlier", &decided);
  EXPECT_EQ(decided, 0);
  for (int64_t j = 0; j < n; ++j) row[static_cast<size_t>(j)] = j < 61440 ? ninf : nd(rng);
  decided = 0;
  check_row(row, 512, "valid keys in the last chunk only", &decided);
  EXPECT_EQ(decided, 1);
}

}  // namespace
