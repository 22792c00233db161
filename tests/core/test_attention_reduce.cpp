// The host reference of the attention reductions (core/attention_reduce.h) against properties
// that hold whatever the order of its sums: over every query row of a causal softmax each head's
// column sums add up to T (each row sums to 1), a column's sum equals the sum of its entries
// taken in another order in long double within T ulps of T, p = 0 counts nothing below (and
// only exact zeros with zeros_below), p = 1 counts every visible entry but the row's maxima,
// and bad query lists are refused.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>

#include "core/attention_reduce.h"
#include "core/errors.h"
#include "core/parallel.h"
#include "core/team.h"

using namespace kvlens;

namespace {

// Causal softmax rows of random scores [H][T][T], with a few exact zeros (underflowed entries)
// and tied maxima.
std::vector<float> causal_probs(int H, int T, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> n(0.0f, 3.0f);
  std::vector<float> P(static_cast<size_t>(H) * T * T, 0.0f);
  for (int h = 0; h < H; ++h)
    for (int i = 0; i < T; ++i) {
      float* row = P.data() + (static_cast<size_t>(h) * T + i) * T;
      std::vector<float> s(i + 1);
      for (float& x : s) x = n(rng);
      if (i % 5 == 1) s[0] = -200.0f;          // exp underflows to 0
      if (i % 7 == 3 && i > 0) s[i] = s[i - 1];  // a tie, maybe at the maximum
      const float mx = *std::max_element(s.begin(), s.end());
      double z = 0;
      for (float x : s) z += std::exp(static_cast<double>(x - mx));
      for (int j = 0; j <= i; ++j) row[j] = static_cast<float>(std::exp(static_cast<double>(s[j] - mx)) / z);
    }
  return P;
}

}  // namespace

TEST(AttentionReduce, ColumnSumsAndCountsHaveTheirProperties) {
  const int H = 3, T = 57;
  const std::vector<float> P = causal_probs(H, T, 11);
  for (const std::vector<int>& q : {AttentionReduction::range(0, T, T), AttentionReduction::range(40, 99, T),
                                    std::vector<int>{2, 9, 30, 56}}) {
    std::vector<double> sums(static_cast<size_t>(H) * T, -1.0);
    AttentionReduction r;
    r.queries = q;
    r.column_sums = sums.data();
    reduce_attention(P.data(), H, T, r);
    for (int h = 0; h < H; ++h) {
      double total = 0;
      for (int j = 0; j < T; ++j) {
        long double other = 0;  // rows in descending order, long double
        for (auto it = q.rbegin(); it != q.rend(); ++it)
          if (j <= *it) other += P[(static_cast<size_t>(h) * T + *it) * T + j];
        const double got = sums[static_cast<size_t>(h) * T + j];
        EXPECT_NEAR(got, static_cast<double>(other), 1e-15 * q.size() + 1e-300) << "head " << h << " column " << j;
        total += got;
      }
      EXPECT_NEAR(total, static_cast<double>(q.size()), 1e-5 * q.size()) << "every row sums to 1";
    }
  }
  // Counts: p = 0 finds nothing below (exact zeros with zeros_below); p = 1 all but the maxima.
  int64_t zeros = 0, not_max = 0;
  for (int h = 0; h < H; ++h)
    for (int i = 0; i < T; ++i) {
      const float* row = P.data() + (static_cast<size_t>(h) * T + i) * T;
      const float mx = *std::max_element(row, row + i + 1);
      for (int j = 0; j <= i; ++j) {
        zeros += row[j] == 0.0f;
        not_max += row[j] != mx;
      }
    }
  ASSERT_GT(zeros, 0) << "the case must hold exact zeros";
  auto count = [&](double p, bool z) {
    std::vector<int64_t> b(H, -1);
    AttentionReduction r;
    r.queries = AttentionReduction::range(0, T, T);
    r.below = b.data();
    r.p = p;
    r.zeros_below = z;
    reduce_attention(P.data(), H, T, r);
    int64_t s = 0;
    for (int64_t x : b) s += x;
    return s;
  };
  EXPECT_EQ(count(0.0, false), 0);
  EXPECT_EQ(count(0.0, true), zeros);
  EXPECT_EQ(count(1.0, false), not_max);
  EXPECT_EQ(count(1.0, true), not_max);
  const int64_t mid = count(0.01, false);
  EXPECT_GT(mid, zeros);
  EXPECT_LT(mid, not_max);
}

// The contract the device twins follow: each column's sum taken in double in ascending query
// row from 0.0, bit for bit, whether the heads run on one thread or several (16 heads of 512
// rows over every query row: 2^22 entries, four threads' worth, so the heads are spread).
TEST(AttentionReduce, ColumnSumsAreAscendingRowSumsOnAnyThreadCount) {
  const int H = 16, T = 512;
  const std::vector<float> P = causal_probs(H, T, 23);
  struct Restore {
    int was = product_threads();
    ~Restore() { set_product_threads(was); }
  } restore;
  for (const std::vector<int>& q : {AttentionReduction::range(0, T, T), std::vector<int>{3, 50, 51, 260, 399}}) {
    std::vector<double> want(static_cast<size_t>(H) * T);
    for (int h = 0; h < H; ++h)
      for (int j = 0; j < T; ++j) {
        double acc = 0.0;
        for (int i : q)
          if (j <= i) acc += P[(static_cast<size_t>(h) * T + i) * T + j];
        want[static_cast<size_t>(h) * T + j] = acc;
      }
    std::vector<int64_t> below_one;
    for (int threads : {1, 4}) {
      set_product_threads(threads);
      std::vector<double> sums(want.size(), -1.0);
      std::vector<int64_t> below(H, -1);
      AttentionReduction r;
      r.queries = q;
      r.column_sums = sums.data();
      r.below = below.data();
      r.p = 0.02;
      reduce_attention(P.data(), H, T, r);
      for (size_t x = 0; x < want.size(); ++x)
        ASSERT_EQ(sums[x], want[x]) << threads << " threads, head " << x / T << " column " << x % T;
      if (threads == 1) below_one = below;
      EXPECT_EQ(below, below_one) << threads << " threads";
    }
  }
  if (machine_cores() >= 2) {
    EXPECT_GT(team_size(), 0) << "the heads never ran on the team";
  }
}

TEST(AttentionReduce, QueryListsAreCheckedAndKeyed) {
  const int T = 10;
  const std::vector<float> P = causal_probs(1, T, 3);
  std::vector<double> sums(T);
  AttentionReduction r;
  r.column_sums = sums.data();
  for (const std::vector<int>& bad : {std::vector<int>{3, 2}, std::vector<int>{4, 4}, std::vector<int>{-1},
                                      std::vector<int>{T}}) {
    r.queries = bad;
    EXPECT_THROW(reduce_attention(P.data(), 1, T, r), InternalError);
  }
  EXPECT_EQ(AttentionReduction::range(-3, 4, T), (std::vector<int>{0, 1, 2, 3}));
  EXPECT_TRUE(AttentionReduction::range(8, 3, T).empty());
  // Keys tell apart what is asked, the rows and p.
  AttentionReduction a, b;
  a.queries = b.queries = AttentionReduction::range(2, 9, T);
  EXPECT_EQ(a.key(), b.key());
  b.queries = {2, 3, 4, 5, 6, 7, 9};
  EXPECT_NE(a.key(), b.key());
  b.queries = a.queries;
  b.p = 0.5;
  EXPECT_NE(a.key(), b.key());
  a.p = 0.001;
  b.p = 0.0014;
  EXPECT_NE(a.key(), b.key());
  b.p = a.p;
  b.zeros_below = true;
  EXPECT_NE(a.key(), b.key());
}

// The pooled map against a direct computation by cells (each cell's head mean, then the block's
// mean over its causal cells in long double): blocks of uneven size, a key axis longer than the
// prompt, scattered query rows, one bin each way and as many bins as positions (the map itself).
// Both are means of float probabilities ≤ 1 taken in another order: within 2⁻²³ (the float
// result's rounding, twice) plus the double sums' error.
TEST(AttentionReduce, PooledMapIsEachBlocksMeanOverItsCausalCells) {
  const int H = 3, T = 41;
  const std::vector<float> P = causal_probs(H, T, 5);
  std::vector<int> scattered;
  for (int i = 0; i < T; i += 3) scattered.push_back(i);
  struct Case {
    std::vector<int> queries;
    int rows, cols, keys;
    AttentionReduction request(float* into) const {
      AttentionReduction r;
      r.queries = queries;
      r.map = into;
      r.map_rows = rows;
      r.map_cols = cols;
      r.map_keys = keys;
      return r;
    }
  };
  for (const Case& k : {Case{AttentionReduction::range(0, T, T), 6, 9, T + 4}, Case{scattered, 5, 7, T},
                        Case{AttentionReduction::range(0, T, T), 1, 1, T}, Case{AttentionReduction::range(0, T, T), T, T, T},
                        Case{std::vector<int>{}, 2, 2, T}}) {
    std::vector<float> map(static_cast<size_t>(k.rows) * k.cols, -1.0f);
    reduce_attention(P.data(), H, T, k.request(map.data()));
    for (int b = 0; b < k.rows; ++b)
      for (int c = 0; c < k.cols; ++c) {
        long double sum = 0;
        int64_t cells = 0;
        for (int i : k.queries) {
          if (static_cast<int64_t>(i) * k.rows / T != b) continue;
          for (int j = 0; j <= i; ++j) {
            if (static_cast<int64_t>(j) * k.cols / k.keys != c) continue;
            long double cell = 0;
            for (int h = 0; h < H; ++h) cell += P[(static_cast<size_t>(h) * T + i) * T + j];
            sum += cell / H;
            ++cells;
          }
        }
        const double want = cells ? static_cast<double>(sum / cells) : 0.0;
        EXPECT_NEAR(map[static_cast<size_t>(b) * k.cols + c], want, 2.4e-7 * want + 1e-12)
            << k.rows << "x" << k.cols << " block " << b << "," << c;
      }
    if (k.rows == T && k.cols == T)  // every row of the map sums to 1 (a softmax row's mean over heads)
      for (int i = 0; i < T; ++i) {
        double row = 0;
        for (int j = 0; j < T; ++j) row += map[static_cast<size_t>(i) * T + j];
        EXPECT_NEAR(row, 1.0, 1e-5) << "row " << i;
      }
  }
  // Decode rows pooled the same way: a row's keys after its own position do not count.
  const std::vector<float> rows{1, 2, 3, 4, 5, 6,  //
                                7, 8, 9, 10, 11, 12};
  std::vector<float> out(6, -1.0f);
  pool_map_rows(rows.data(), 2, 3, 6, 3, out.data());  // queries at positions 3 and 4; bins {0,1} {2,3} {4,5}
  EXPECT_EQ(out, (std::vector<float>{1.5f, 3.5f, 0.0f, 7.5f, 9.5f, 11.0f}));
  // Maps that do not fit the prompt are refused.
  std::vector<float> m(4);
  for (const Case& bad : {Case{{0}, 0, 2, T}, Case{{0}, T + 1, 2, T}, Case{{0}, 2, 2, T - 1}, Case{{0}, 2, T + 1, T}}) {
    EXPECT_THROW(reduce_attention(P.data(), H, T, bad.request(m.data())), InternalError) << bad.rows << "x" << bad.cols << "/" << bad.keys;
  }
}
