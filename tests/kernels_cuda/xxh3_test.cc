// kernels/cuda/xxh3 (XXH3-64 of a batch of device pages, and copy_pages_xxh3: copy, then the
// hash of the landed bytes) against libxxhash's XXH3_64bits, on
// fresh random bytes each run (seed printed; PDSERVE_TEST_SEED replays). Where xxhash.h is
// absent (the device machine) the reference is kernels/cuda/xxh3_scalar.cuh on the host, which
// Xxh3ScalarTest compares with libxxhash wherever xxhash.h is present (no GPU needed).
// PDSERVE_XXH3_DUMP=<file>: EveryLengthClass also writes its cases there (per page: u64 length,
// u64 GPU hash, the bytes) for a check by another implementation (tools/gpu/run_ipc54.sh: Python's
// xxhash).
#include "kernels/cuda/xxh3.cuh"

#include <gtest/gtest.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kernels/cuda/xxh3_scalar.cuh"
#include "tests/kernels_cuda/cuda_test_util.h"

#if __has_include(<xxhash.h>)
#define XXH_INLINE_ALL
#include <xxhash.h>
#define PDSERVE_HAVE_LIBXXHASH 1
#else
#define PDSERVE_HAVE_LIBXXHASH 0
#endif

namespace pdserve::kernels::cuda {
namespace {

using testing::FreshRng;
using testing::GuardedBuffer;

uint64_t Reference(const uint8_t* p, uint64_t n) {
#if PDSERVE_HAVE_LIBXXHASH
  return XXH3_64bits(p, n);
#else
  return xxh3::Xxh3Scalar(p, n, xxh3::kDefaultSecret.bytes);
#endif
}

// Every length class and its edges: 0, 1-3, 4-8, 9-16, 17-128, 129-240 and the long form's
// stripe (64), block (1024) and tile (32 blocks) boundaries, up to several MiB.
std::vector<uint64_t> ClassLengths() {
  std::vector<uint64_t> lengths;
  for (uint64_t n = 0; n <= 2112; ++n) lengths.push_back(n);
  for (uint64_t blocks : {3, 4, 16, 31, 32, 33, 64, 65, 128, 1024, 4096}) {
    for (int64_t d : {-65, -64, -63, -1, 0, 1, 63, 64, 65}) {
      lengths.push_back(blocks * 1024 + d);
    }
  }
  lengths.push_back((5u << 20) + 37);
  return lengths;
}

struct Batch {
  std::vector<uint8_t> bytes;    // all pages, back to back
  std::vector<uint64_t> offset;  // page i starts at bytes[offset[i]]
  std::vector<uint64_t> length;
};

// Pages of the given lengths at random start misalignments (0-15 bytes) in one random buffer.
Batch MakeBatch(const std::vector<uint64_t>& lengths, std::mt19937_64& rng) {
  Batch b;
  uint64_t at = 0;
  for (uint64_t n : lengths) {
    at += rng() % 16;
    b.offset.push_back(at);
    b.length.push_back(n);
    at += n;
  }
  b.bytes.resize(at + 16);
  for (auto& c : b.bytes) c = static_cast<uint8_t>(rng());
  return b;
}

// The kernel's hashes of `b` (kernel first, before the reference allocates anything).
std::vector<uint64_t> GpuHashes(const Batch& b, bool* ok) {
  *ok = false;
  GuardedBuffer<uint8_t> bytes(b.bytes.size());
  GuardedBuffer<uint64_t> hashes(b.length.size());
  GuardedBuffer<Xxh3Page> pages(b.length.size());
  if (!bytes.ok() || !hashes.ok() || !pages.ok()) return {};
  bytes.Upload(b.bytes);
  std::vector<Xxh3Page> host_pages;
  for (size_t i = 0; i < b.length.size(); ++i) {
    host_pages.push_back({bytes.get() + b.offset[i], b.length[i]});
  }
  pages.Upload(host_pages);
  if (xxh3_64_pages(pages.get(), static_cast<int64_t>(host_pages.size()), hashes.get(), nullptr) !=
          cudaSuccess ||
      cudaDeviceSynchronize() != cudaSuccess) {
    return {};
  }
  std::vector<uint64_t> got = hashes.Download();
  *ok = hashes.GuardsIntact() && bytes.GuardsIntact();
  return got;
}

void ExpectReferenceHashes(const Batch& b, const std::vector<uint64_t>& got) {
  ASSERT_EQ(got.size(), b.length.size());
  int wrong = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const uint64_t want = Reference(b.bytes.data() + b.offset[i], b.length[i]);
    if (got[i] != want && ++wrong <= 10) {
      ADD_FAILURE() << "page " << i << " length " << b.length[i] << " start misaligned by "
                    << b.offset[i] % 16 << ": got " << std::hex << got[i] << " want " << want;
    }
  }
  EXPECT_EQ(wrong, 0) << "of " << got.size() << " pages";
}

void Dump(const Batch& b, const std::vector<uint64_t>& got, const char* path) {
  FILE* f = std::fopen(path, "wb");
  ASSERT_NE(f, nullptr) << path;
  for (size_t i = 0; i < got.size(); ++i) {
    std::fwrite(&b.length[i], sizeof(uint64_t), 1, f);
    std::fwrite(&got[i], sizeof(uint64_t), 1, f);
    std::fwrite(b.bytes.data() + b.offset[i], 1, b.length[i], f);
  }
  std::fclose(f);
}

TEST(Xxh3ScalarTest, MatchesLibxxhashInEveryLengthClass) {
#if !PDSERVE_HAVE_LIBXXHASH
  GTEST_SKIP() << "xxhash.h not found";
#else
  std::mt19937_64 rng = FreshRng();
  const Batch b = MakeBatch(ClassLengths(), rng);
  for (size_t i = 0; i < b.length.size(); ++i) {
    const uint8_t* p = b.bytes.data() + b.offset[i];
    ASSERT_EQ(xxh3::Xxh3Scalar(p, b.length[i], xxh3::kDefaultSecret.bytes),
              XXH3_64bits(p, b.length[i]))
        << "length " << b.length[i];
  }
#endif
}

TEST(CudaXxh3Test, EveryLengthClass) {
  PDSERVE_SKIP_WITHOUT_GPU();
  std::printf("reference: %s\n", PDSERVE_HAVE_LIBXXHASH ? "libxxhash" : "xxh3_scalar.cuh");
  std::mt19937_64 rng = FreshRng();
  const Batch b = MakeBatch(ClassLengths(), rng);
  bool ok = false;
  const std::vector<uint64_t> got = GpuHashes(b, &ok);
  ASSERT_TRUE(ok) << "launch failed or a guard band was overwritten";
  ExpectReferenceHashes(b, got);
  if (const char* path = std::getenv("PDSERVE_XXH3_DUMP")) Dump(b, got, path);
}

// State-page-like batches: many pages of random lengths up to 256 KiB, mostly 8-aligned.
TEST(CudaXxh3Test, RandomPageBatches) {
  PDSERVE_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng = FreshRng();
  for (int round = 0; round < 3; ++round) {
    std::vector<uint64_t> lengths;
    for (int i = 0; i < 500; ++i) {
      lengths.push_back(rng() % 4 == 0 ? rng() % 4096 : rng() % (256 << 10));
    }
    const Batch b = MakeBatch(lengths, rng);
    bool ok = false;
    const std::vector<uint64_t> got = GpuHashes(b, &ok);
    ASSERT_TRUE(ok) << "launch failed or a guard band was overwritten";
    ExpectReferenceHashes(b, got);
  }
}

// One flipped bit anywhere in a page changes its hash, and only that page's.
TEST(CudaXxh3Test, FlippedBitChangesOnlyItsPage) {
  PDSERVE_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng = FreshRng();
  Batch b = MakeBatch({65536, 65536, 131072, 1000}, rng);
  bool ok = false;
  const std::vector<uint64_t> before = GpuHashes(b, &ok);
  ASSERT_TRUE(ok);
  const uint64_t at = b.offset[2] + rng() % b.length[2];
  b.bytes[at] ^= static_cast<uint8_t>(1u << (rng() % 8));
  const std::vector<uint64_t> after = GpuHashes(b, &ok);
  ASSERT_TRUE(ok);
  EXPECT_EQ(after[0], before[0]);
  EXPECT_EQ(after[1], before[1]);
  EXPECT_NE(after[2], before[2]) << "byte " << at - b.offset[2];
  EXPECT_EQ(after[3], before[3]);
  ExpectReferenceHashes(b, after);
}

// copy_pages_xxh3: every page of every length class (and state-page-like random lengths) lands
// byte for byte at a destination misaligned independently of its source, its hash is the
// reference hash of those bytes, and nothing outside the destinations is written (guard bands
// and the gaps between pages keep their fill). Kernel first, then the reference.
void CheckFusedCopy(const std::vector<uint64_t>& lengths, std::mt19937_64& rng) {
  const Batch b = MakeBatch(lengths, rng);
  std::vector<uint64_t> dst_at;
  uint64_t dst_bytes = 0;
  for (uint64_t n : b.length) {
    dst_bytes += rng() % 16;
    dst_at.push_back(dst_bytes);
    dst_bytes += n;
  }
  std::vector<uint8_t> want(dst_bytes + 16, 0xEE);
  GuardedBuffer<uint8_t> src(b.bytes.size());
  GuardedBuffer<uint8_t> dst(want.size());
  GuardedBuffer<PageCopy> copies(b.length.size());
  GuardedBuffer<uint64_t> hashes(b.length.size());
  ASSERT_TRUE(src.ok() && dst.ok() && copies.ok() && hashes.ok());
  src.Upload(b.bytes);
  dst.Upload(want);
  std::vector<PageCopy> host_copies;
  for (size_t i = 0; i < b.length.size(); ++i) {
    host_copies.push_back({src.get() + b.offset[i], dst.get() + dst_at[i], b.length[i]});
  }
  copies.Upload(host_copies);
  PDSERVE_CUDA_OK(copy_pages_xxh3(copies.get(), static_cast<int64_t>(host_copies.size()),
                                  hashes.get(), nullptr));
  PDSERVE_CUDA_OK(cudaDeviceSynchronize());
  const std::vector<uint8_t> got = dst.Download();
  const std::vector<uint64_t> got_hashes = hashes.Download();
  EXPECT_TRUE(dst.GuardsIntact() && hashes.GuardsIntact() && src.GuardsIntact());
  for (size_t i = 0; i < b.length.size(); ++i) {
    std::memcpy(want.data() + dst_at[i], b.bytes.data() + b.offset[i], b.length[i]);
  }
  ASSERT_EQ(got, want) << "a destination differs, or a byte outside them was written";
  ExpectReferenceHashes(b, got_hashes);
}

TEST(CudaCopyXxh3Test, EveryLengthClassLandsAndHashesTheLandedBytes) {
  PDSERVE_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng = FreshRng();
  CheckFusedCopy(ClassLengths(), rng);
}

TEST(CudaCopyXxh3Test, StatePageBatches) {
  PDSERVE_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng = FreshRng();
  std::vector<uint64_t> lengths;
  for (int i = 0; i < 500; ++i) lengths.push_back(rng() % 2 == 0 ? 43008 : rng() % (96 << 10));
  CheckFusedCopy(lengths, rng);
}

TEST(CudaCopyXxh3Test, RefusesBadArguments) {
  EXPECT_EQ(copy_pages_xxh3(nullptr, -1, nullptr, nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(copy_pages_xxh3(nullptr, 3, nullptr, nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(copy_pages_xxh3(nullptr, 0, nullptr, nullptr), cudaSuccess);
}

}  // namespace
}  // namespace pdserve::kernels::cuda
