// kernels/cuda/page_copy against std::memcpy per page (its CPU twin): random lengths (0 to
// 300 KiB), aligned and misaligned sources and destinations, a shuffled destination order, and
// guard bands around the destination pool; fresh random bytes each run (seed printed).
#include "kernels/cuda/page_copy.cuh"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "tests/kernels_cuda/cuda_test_util.h"

namespace pdserve::kernels::cuda {
namespace {

using testing::FreshRng;
using testing::GuardedBuffer;

void CheckBatch(bool aligned, std::mt19937_64& rng) {
  constexpr int kPages = 300;
  std::vector<uint64_t> length(kPages), src_at(kPages), dst_at(kPages);
  uint64_t src_bytes = 0;
  for (int i = 0; i < kPages; ++i) {
    length[i] = rng() % 5 == 0 ? rng() % 300 : rng() % (300 << 10);
    if (aligned) length[i] &= ~uint64_t{15};
    src_bytes += aligned ? 0 : rng() % 16;
    src_at[i] = src_bytes;
    src_bytes = (src_bytes + length[i] + 15) / 16 * 16;
  }
  std::vector<int> order(kPages);
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), rng);
  uint64_t dst_bytes = 0;
  for (int i : order) {
    dst_bytes += aligned ? 0 : rng() % 16;
    dst_at[i] = dst_bytes;
    dst_bytes = (dst_bytes + length[i] + 15) / 16 * 16;
  }
  std::vector<uint8_t> src(src_bytes + 16);
  for (auto& b : src) b = static_cast<uint8_t>(rng());
  std::vector<uint8_t> want(dst_bytes + 16, 0xEE);

  GuardedBuffer<uint8_t> d_src(src.size());
  GuardedBuffer<uint8_t> d_dst(want.size());
  GuardedBuffer<PageCopy> d_copies(kPages);
  ASSERT_TRUE(d_src.ok() && d_dst.ok() && d_copies.ok());
  d_src.Upload(src);
  d_dst.Upload(want);
  std::vector<PageCopy> copies(kPages);
  for (int i = 0; i < kPages; ++i) {
    copies[i] = {d_src.get() + src_at[i], d_dst.get() + dst_at[i], length[i]};
  }
  d_copies.Upload(copies);
  PDSERVE_CUDA_OK(copy_pages(d_copies.get(), kPages, nullptr));
  PDSERVE_CUDA_OK(cudaDeviceSynchronize());
  const std::vector<uint8_t> got = d_dst.Download();

  for (int i = 0; i < kPages; ++i) {
    std::memcpy(want.data() + dst_at[i], src.data() + src_at[i], length[i]);
  }
  EXPECT_TRUE(d_dst.GuardsIntact());
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) ASSERT_EQ(got[i], want[i]) << "destination byte " << i;
}

TEST(CudaPageCopyTest, AlignedPages) {
  PDSERVE_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng = FreshRng();
  CheckBatch(true, rng);
}

TEST(CudaPageCopyTest, MisalignedPages) {
  PDSERVE_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng = FreshRng();
  CheckBatch(false, rng);
}

}  // namespace
}  // namespace pdserve::kernels::cuda
