// A KV sync's gathers in one launch (gather_segments) against the same copies made on the host:
// fresh random rows and positions, gathers of awkward lengths (none, one row, more rows than a
// block walks at once), some copying positions alone, rows read in any order and more than once.
// A copy is exact, so every half and position must be equal.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "tests/op_harness.h"

#ifdef KVLENS_HAVE_CUDA
#include <cuda_runtime.h>

#include "kernels/cuda/kernels.h"
#include "tests/device_buffer.h"
#endif

using namespace kvlens;
using namespace kvlens::testing;

TEST(SyncGather, EveryGatherInOneLaunchCopiesItsRowsAndPositions) {
#ifndef KVLENS_HAVE_CUDA
  GTEST_SKIP() << "built without the CUDA backend";
#else
  KVLENS_NEED_GPU();
  std::mt19937_64& r = rng();
  for (const int D : {8, 64, 72, 128, 256}) {
    SCOPED_TRACE("head size " + std::to_string(D));
    const std::vector<int64_t> lengths = {0, 1, 5, 33, 1000, 4100, 2};
    const int64_t pool_rows = 3000;
    std::vector<uint16_t> pool(static_cast<size_t>(pool_rows * D));
    for (uint16_t& x : pool) x = static_cast<uint16_t>(r());
    const Dev dpool(pool);
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
    const Dev k_out(static_cast<size_t>(out_rows * D) * 2), v_out(static_cast<size_t>(out_rows * D) * 2);
    const Dev pos_out(static_cast<size_t>(out_rows) * 4);
    // Poisoned, so a row the launch skips shows.
    ASSERT_EQ(cudaMemset(k_out.p, 0xff, static_cast<size_t>(out_rows * D) * 2), cudaSuccess);
    ASSERT_EQ(cudaMemset(v_out.p, 0xff, static_cast<size_t>(out_rows * D) * 2), cudaSuccess);
    ASSERT_EQ(cudaMemset(pos_out.p, 0xff, static_cast<size_t>(out_rows) * 4), cudaSuccess);
    int64_t at = 0, longest = 0;
    for (size_t g = 0; g < jobs.size(); ++g) {
      jobs[g].k = with_rows[g] ? k_out.as<__half>() + at * D : nullptr;
      jobs[g].v = with_rows[g] ? v_out.as<__half>() + at * D : nullptr;
      jobs[g].pos = pos_out.as<int32_t>() + at;
      at += jobs[g].rows;
      longest = std::max(longest, jobs[g].rows);
    }
    std::vector<const __half*> src;
    for (int64_t x : src_row) src.push_back(dpool.as<const __half>() + x * D);
    const Dev dsrc(src), dpos(pos_in), djobs(jobs);
    cuda::gather_segments(djobs.as<cuda::RowGather>(), static_cast<int>(jobs.size()), longest,
                          dsrc.as<const __half* const>(), dpos.as<int32_t>(), D, nullptr);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const std::vector<uint16_t> k = k_out.host<uint16_t>(static_cast<size_t>(out_rows * D)),
                                v = v_out.host<uint16_t>(static_cast<size_t>(out_rows * D));
    const std::vector<int32_t> pos = pos_out.host<int32_t>(static_cast<size_t>(out_rows));
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
#endif
}
