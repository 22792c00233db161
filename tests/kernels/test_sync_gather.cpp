// A KV sync's gathers in one launch (gather_segments) against the same copies made on the host:
// fresh random rows and positions, gathers of awkward lengths (none, one row, more rows than a
// block walks at once), some copying positions alone, rows read in any order and more than once.
// A copy is exact, so every half and position must be equal.
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "kernels/cuda/kernels.h"
#include "tests/op_harness.h"

using namespace kvlens;
using namespace kvlens::testing;

namespace {

// Device memory of `n` T's, freed with the object.
template <class T>
struct Dev {
  T* p = nullptr;
  explicit Dev(size_t n) { EXPECT_EQ(cudaMalloc(&p, std::max<size_t>(n, 1) * sizeof(T)), cudaSuccess); }
  ~Dev() { cudaFree(p); }
  Dev(const Dev&) = delete;
  Dev& operator=(const Dev&) = delete;
  void up(const std::vector<T>& h) { ASSERT_EQ(cudaMemcpy(p, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess); }
  std::vector<T> down(size_t n) const {
    std::vector<T> h(n);
    EXPECT_EQ(cudaMemcpy(h.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
    return h;
  }
};

}  // namespace

TEST(SyncGather, EveryGatherInOneLaunchCopiesItsRowsAndPositions) {
  KVLENS_NEED_GPU();
  std::mt19937_64& r = rng();
  for (const int D : {8, 64, 72, 128, 256}) {
    SCOPED_TRACE("head size " + std::to_string(D));
    const std::vector<int64_t> lengths = {0, 1, 5, 33, 1000, 4100, 2};
    const int64_t pool_rows = 3000;
    std::vector<uint16_t> pool(static_cast<size_t>(pool_rows * D));
    for (uint16_t& x : pool) x = static_cast<uint16_t>(r());
    Dev<uint16_t> dpool(pool.size());
    dpool.up(pool);
    // Each gather's K rows then V rows in the pointer list, its positions in one list.
    std::vector<int64_t> src_row;  // (pool rows; pointers made below)
    std::vector<int32_t> pos_in;
    std::vector<cuda::RowGather> jobs;
    std::vector<bool> with_rows;
    int64_t out_rows = 0;
    for (size_t g = 0; g < lengths.size(); ++g) {
      cuda::RowGather j;
      j.first = static_cast<int64_t>(src_row.size());
      j.rows = lengths[g];
      j.pos_first = static_cast<int64_t>(pos_in.size());
      for (int64_t i = 0; i < 2 * j.rows; ++i) src_row.push_back(static_cast<int64_t>(r() % pool_rows));
      for (int64_t i = 0; i < j.rows; ++i) pos_in.push_back(static_cast<int32_t>(r() % 100000));
      with_rows.push_back(g % 3 != 2);
      jobs.push_back(j);
      out_rows += j.rows;
    }
    Dev<uint16_t> k_out(static_cast<size_t>(out_rows * D)), v_out(static_cast<size_t>(out_rows * D));
    Dev<int32_t> pos_out(static_cast<size_t>(out_rows));
    // Poisoned, so a row the launch skips shows.
    ASSERT_EQ(cudaMemset(k_out.p, 0xff, static_cast<size_t>(out_rows * D) * 2), cudaSuccess);
    ASSERT_EQ(cudaMemset(v_out.p, 0xff, static_cast<size_t>(out_rows * D) * 2), cudaSuccess);
    ASSERT_EQ(cudaMemset(pos_out.p, 0xff, static_cast<size_t>(out_rows) * 4), cudaSuccess);
    int64_t at = 0, longest = 0;
    for (size_t g = 0; g < jobs.size(); ++g) {
      jobs[g].k = with_rows[g] ? reinterpret_cast<__half*>(k_out.p) + at * D : nullptr;
      jobs[g].v = with_rows[g] ? reinterpret_cast<__half*>(v_out.p) + at * D : nullptr;
      jobs[g].pos = pos_out.p + at;
      at += jobs[g].rows;
      longest = std::max(longest, jobs[g].rows);
    }
    std::vector<const __half*> src;
    for (int64_t x : src_row) src.push_back(reinterpret_cast<const __half*>(dpool.p) + x * D);
    Dev<const __half*> dsrc(src.size());
    dsrc.up(src);
    Dev<int32_t> dpos(pos_in.size());
    dpos.up(pos_in);
    Dev<cuda::RowGather> djobs(jobs.size());
    djobs.up(jobs);
    cuda::gather_segments(djobs.p, static_cast<int>(jobs.size()), longest, dsrc.p, dpos.p, D, nullptr);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const std::vector<uint16_t> k = k_out.down(static_cast<size_t>(out_rows * D)), v = v_out.down(static_cast<size_t>(out_rows * D));
    const std::vector<int32_t> pos = pos_out.down(static_cast<size_t>(out_rows));
    at = 0;
    for (size_t g = 0; g < jobs.size(); ++g) {
      const cuda::RowGather& j = jobs[g];
      int64_t wrong_rows = 0, wrong_pos = 0;
      for (int64_t i = 0; i < j.rows; ++i) {
        wrong_pos += pos[static_cast<size_t>(at + i)] != pos_in[static_cast<size_t>(j.pos_first + i)];
        for (int c = 0; c < D; ++c) {
          const size_t o = static_cast<size_t>((at + i) * D + c);
          const uint16_t want_k = with_rows[g] ? pool[static_cast<size_t>(src_row[static_cast<size_t>(j.first + i)] * D + c)] : 0xffff;
          const uint16_t want_v =
              with_rows[g] ? pool[static_cast<size_t>(src_row[static_cast<size_t>(j.first + j.rows + i)] * D + c)] : 0xffff;
          wrong_rows += (k[o] != want_k) + (v[o] != want_v);
        }
      }
      EXPECT_EQ(wrong_rows, 0) << "gather " << g << " of " << j.rows << " rows: halves that differ";
      EXPECT_EQ(wrong_pos, 0) << "gather " << g << " of " << j.rows << " rows: positions that differ";
      at += j.rows;
    }
  }
}
