#include "serving/page_pool.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace pdserve::serving {
namespace {

using ::testing::HasSubstr;

// Two kinds: "window" pages of 4 rows x 16 bytes, "compressed" pages of 2 rows x 8 bytes.
PagePoolOptions TwoKinds(int64_t window_pages, int64_t compressed_pages, bool poison = false) {
  PagePoolOptions options;
  options.kinds = {{"window", window_pages, 4, 16}, {"compressed", compressed_pages, 2, 8}};
  options.poison_freed = poison;
  return options;
}

std::unique_ptr<PagePool> MakePool(PagePoolOptions options) {
  auto pool = PagePool::Create(std::move(options));
  EXPECT_TRUE(pool.ok()) << pool.status();
  return std::move(pool).value();
}

TEST(PagePoolTest, CreateRejectsMalformedKinds) {
  EXPECT_EQ(PagePool::Create({}).status().code(), absl::StatusCode::kInvalidArgument);
  PagePoolOptions repeated;
  repeated.kinds = {{"window", 1, 1, 4}, {"window", 1, 1, 4}};
  EXPECT_EQ(PagePool::Create(repeated).status().message(), "page kind 'window' is repeated");
  PagePoolOptions odd_row;
  odd_row.kinds = {{"window", 1, 1, 6}};
  EXPECT_EQ(PagePool::Create(odd_row).status().message(),
            "page kind 'window' row_bytes 6 is not a multiple of 4");
  PagePoolOptions empty_kind;
  empty_kind.kinds = {{"window", 0, 1, 4}};
  EXPECT_EQ(PagePool::Create(empty_kind).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(PagePoolTest, AllocateTakesPagesOfEachKindAndCountsThem) {
  auto pool = MakePool(TwoKinds(8, 4));
  auto table = pool->Allocate(7, {3, 1});
  ASSERT_TRUE(table.ok()) << table.status();
  EXPECT_EQ(table->owner, 7u);
  ASSERT_EQ(table->pages.size(), 2u);
  EXPECT_EQ(table->pages[0].size(), 3u);
  EXPECT_EQ(table->pages[1].size(), 1u);
  EXPECT_EQ(pool->pages_used(0), 3);
  EXPECT_EQ(pool->pages_free(0), 5);
  EXPECT_EQ(pool->pages_used(1), 1);
  EXPECT_EQ(pool->pages_free(1), 3);
  EXPECT_EQ(pool->num_owners(), 1);
  EXPECT_EQ(*pool->Table(7), *table);
  auto data = pool->Data(7, table->pages[0][2]);
  ASSERT_TRUE(data.ok()) << data.status();
  EXPECT_EQ(data->size(), 64u);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(data->data()) % 64, 0u);
}

TEST(PagePoolTest, CanAllocateIsSeparateFromAllocate) {
  auto pool = MakePool(TwoKinds(4, 2));
  EXPECT_TRUE(pool->CanAllocate({4, 2}));
  EXPECT_FALSE(pool->CanAllocate({5, 0}));
  EXPECT_FALSE(pool->CanAllocate({0, 3}));
  EXPECT_FALSE(pool->CanAllocate({1}));  // wrong number of kinds
  EXPECT_EQ(pool->pages_free(0), 4);     // asking takes nothing
  ASSERT_TRUE(pool->Allocate(1, {3, 1}).ok());
  EXPECT_TRUE(pool->CanAllocate({1, 1}));
  EXPECT_FALSE(pool->CanAllocate({2, 0}));
}

TEST(PagePoolTest, ExhaustedPoolRefusesWithoutTouchingOtherRequests) {
  auto pool = MakePool(TwoKinds(4, 4));
  auto first = pool->Allocate(1, {3, 1});
  ASSERT_TRUE(first.ok());
  std::span<std::byte> bytes = *pool->Data(1, first->pages[0][0]);
  std::memset(bytes.data(), 0x5A, bytes.size());

  auto second = pool->Allocate(2, {2, 1});
  EXPECT_EQ(second.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(second.status().message(), "request 2 needs 2 pages of kind 'window', 1 of 4 are free");
  EXPECT_EQ(pool->pages_free(0), 1);
  EXPECT_EQ(pool->pages_free(1), 3);  // the fitting kind was not taken either
  EXPECT_EQ(*pool->Table(1), *first);
  EXPECT_EQ(pool->Table(2).status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(
      std::all_of(bytes.begin(), bytes.end(), [](std::byte b) { return b == std::byte{0x5A}; }));
}

TEST(PagePoolTest, SecondAllocationForOneOwnerIsAlreadyExists) {
  auto pool = MakePool(TwoKinds(4, 4));
  ASSERT_TRUE(pool->Allocate(1, {1, 1}).ok());
  EXPECT_EQ(pool->Allocate(1, {1, 1}).status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(pool->pages_used(0), 1);
}

TEST(PagePoolTest, FreeReturnsPages) {
  auto pool = MakePool(TwoKinds(4, 4));
  auto table = pool->Allocate(1, {4, 2});
  ASSERT_TRUE(table.ok());
  ASSERT_TRUE(pool->Free(*table).ok());
  EXPECT_EQ(pool->pages_free(0), 4);
  EXPECT_EQ(pool->pages_free(1), 4);
  EXPECT_EQ(pool->num_owners(), 0);
  EXPECT_EQ(pool->Table(1).status().code(), absl::StatusCode::kNotFound);
}

TEST(PagePoolTest, DoubleFreeIsFailedPrecondition) {
  auto pool = MakePool(TwoKinds(4, 4));
  auto table = pool->Allocate(3, {1, 0});
  ASSERT_TRUE(table.ok());
  const PageHandle handle = table->pages[0][0];
  ASSERT_TRUE(pool->Free(*table).ok());
  const absl::Status status = pool->Free(*table);
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(status.message(),
            absl::StrCat("double free: request 3 holds stale window page 0 (epoch ", handle.epoch,
                         "); the page is now free at epoch ", handle.epoch + 1));
  EXPECT_EQ(pool->pages_free(0), 4);
}

TEST(PagePoolTest, UseAfterFreeIsFailedPrecondition) {
  auto pool = MakePool(TwoKinds(4, 4));
  auto table = pool->Allocate(3, {1, 0});
  ASSERT_TRUE(table.ok());
  ASSERT_TRUE(pool->Free(*table).ok());
  auto data = pool->Data(3, table->pages[0][0]);
  EXPECT_EQ(data.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(data.status().message(),
              HasSubstr("use after free: request 3 holds stale window page 0"));
}

TEST(PagePoolTest, HandleFromBeforeReuseNamesTheNewOwner) {
  auto pool = MakePool(TwoKinds(1, 1));
  auto old_table = pool->Allocate(3, {1, 0});
  ASSERT_TRUE(old_table.ok());
  ASSERT_TRUE(pool->Free(*old_table).ok());
  auto new_table = pool->Allocate(4, {1, 0});
  ASSERT_TRUE(new_table.ok());
  const PageHandle stale = old_table->pages[0][0];
  const PageHandle fresh = new_table->pages[0][0];
  ASSERT_EQ(stale.page, fresh.page);
  EXPECT_NE(stale.epoch, fresh.epoch);
  const absl::Status status = pool->Check(3, stale);
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(status.message(),
              HasSubstr(absl::StrCat("now owned by request 4 at epoch ", fresh.epoch)));
  // Another owner's handle is refused even when its epoch is current.
  EXPECT_EQ(pool->Check(3, fresh).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(pool->Check(4, fresh).ok());
  // Freeing with the stale table must not free the new owner's page.
  EXPECT_EQ(pool->Free(*old_table).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(pool->Check(4, fresh).ok());
}

TEST(PagePoolTest, EpochChangesOnEveryReuse) {
  auto pool = MakePool(TwoKinds(1, 1));
  std::vector<uint64_t> epochs;
  for (RequestId owner = 0; owner < 5; ++owner) {
    auto table = pool->Allocate(owner, {1, 0});
    ASSERT_TRUE(table.ok());
    epochs.push_back(table->pages[0][0].epoch);
    ASSERT_TRUE(pool->Free(*table).ok());
  }
  for (size_t i = 1; i < epochs.size(); ++i) EXPECT_GT(epochs[i], epochs[i - 1]);
}

TEST(PagePoolTest, OutOfRangeHandleIsOutOfRange) {
  auto pool = MakePool(TwoKinds(2, 2));
  EXPECT_EQ(pool->Check(1, {0, 2, 1}).code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(pool->Check(1, {2, 0, 1}).code(), absl::StatusCode::kOutOfRange);
}

bool AllPoison(std::span<const std::byte> bytes) {
  for (size_t i = 0; i < bytes.size(); i += 4) {
    float value;
    std::memcpy(&value, bytes.data() + i, 4);
    if (!std::isnan(value)) return false;
    uint32_t word;
    std::memcpy(&word, bytes.data() + i, 4);
    if (word != kPoisonWord) return false;
  }
  return true;
}

TEST(PagePoolTest, PoisonedPoolFillsFreePagesWithNaN) {
  auto pool = MakePool(TwoKinds(1, 1, /*poison=*/true));
  auto table = pool->Allocate(1, {1, 0});
  ASSERT_TRUE(table.ok());
  std::span<std::byte> bytes = *pool->Data(1, table->pages[0][0]);
  EXPECT_TRUE(AllPoison(bytes)) << "never-written pages read as NaN";
  std::memset(bytes.data(), 0, bytes.size());
  ASSERT_TRUE(pool->Free(*table).ok());
  EXPECT_TRUE(AllPoison(bytes)) << "a stale pointer reads NaN, not the old state";
}

TEST(PagePoolTest, UnpoisonedPoolLeavesFreedBytes) {
  auto pool = MakePool(TwoKinds(1, 1, /*poison=*/false));
  auto table = pool->Allocate(1, {1, 0});
  ASSERT_TRUE(table.ok());
  std::span<std::byte> bytes = *pool->Data(1, table->pages[0][0]);
  std::memset(bytes.data(), 0, bytes.size());
  ASSERT_TRUE(pool->Free(*table).ok());
  EXPECT_EQ(bytes[0], std::byte{0});
}

TEST(PagePoolTest, PoisonWordIsNaNInEveryHalfPrecisionView) {
  // bf16 and fp16 are NaN when the exponent bits are all ones and the mantissa is nonzero.
  const uint16_t half = kPoisonWord & 0xFFFF;
  EXPECT_EQ(half, kPoisonWord >> 16);
  EXPECT_EQ(half & 0x7F80, 0x7F80);  // bf16 exponent
  EXPECT_NE(half & 0x007F, 0);       // bf16 mantissa
  EXPECT_EQ(half & 0x7C00, 0x7C00);  // fp16 exponent
  EXPECT_NE(half & 0x03FF, 0);       // fp16 mantissa
}

TEST(PagePoolTest, ConcurrentAllocateAndFreeKeepCountsConsistent) {
  auto pool = MakePool(TwoKinds(16, 16));
  std::vector<std::thread> threads;
  std::atomic<int> failures = 0;
  for (RequestId thread = 0; thread < 4; ++thread) {
    threads.emplace_back([&, thread] {
      for (RequestId i = 0; i < 500; ++i) {
        auto table = pool->Allocate(thread * 1000 + i, {4, 4});
        if (!table.ok() || !pool->Free(*table).ok()) ++failures;
      }
    });
  }
  for (auto& thread : threads) thread.join();
  EXPECT_EQ(failures, 0);  // 4 threads x 4 pages never exceed 16
  EXPECT_EQ(pool->pages_free(0), 16);
  EXPECT_EQ(pool->num_owners(), 0);
}

}  // namespace
}  // namespace pdserve::serving

namespace pdserve::serving {
namespace {

TEST(PagePoolExtendTest, ExtendAppendsToTheOwnersTableAllOrNothing) {
  PagePoolOptions options;
  options.kinds = {{"a", 4, 1, 4}, {"b", 2, 1, 4}};
  auto pool = std::move(PagePool::Create(options)).value();
  absl::StatusOr<PageTable> first = pool->Extend(7, {1, 0});  // no table yet: made
  ASSERT_TRUE(first.ok()) << first.status();
  ASSERT_EQ(first->pages[0].size(), 1u);
  absl::StatusOr<PageTable> grown = pool->Extend(7, {2, 1});
  ASSERT_TRUE(grown.ok()) << grown.status();
  ASSERT_EQ(grown->pages[0].size(), 3u);
  EXPECT_EQ(grown->pages[0][0], first->pages[0][0]);  // earlier pages stay, in order
  EXPECT_EQ(grown->pages[1].size(), 1u);
  EXPECT_EQ(*pool->Table(7), *grown);
  EXPECT_EQ(pool->Extend(7, {2, 0}).status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(*pool->Table(7), *grown);  // unchanged
  EXPECT_EQ(pool->pages_free(0), 1);
  for (const PageHandle& h : grown->pages[0]) EXPECT_TRUE(pool->Check(7, h).ok());
  ASSERT_TRUE(pool->Free(*grown).ok());
  EXPECT_EQ(pool->pages_free(0), 4);
  EXPECT_EQ(pool->num_owners(), 0);
}

TEST(PagePoolExtendTest, BookkeepingOnlyPoolHasNoBytes) {
  PagePoolOptions options;
  options.kinds = {{"device", 1000, 1 << 20, 4096}};  // 4 TB: far beyond host memory
  options.host_memory = false;
  options.poison_freed = true;
  auto pool = PagePool::Create(options);
  ASSERT_TRUE(pool.ok()) << pool.status();
  EXPECT_FALSE((*pool)->poison_freed());
  absl::StatusOr<PageTable> table = (*pool)->Allocate(1, {2});
  ASSERT_TRUE(table.ok());
  EXPECT_TRUE((*pool)->Check(1, table->pages[0][0]).ok());
  EXPECT_EQ((*pool)->Data(1, table->pages[0][0]).status().code(),
            absl::StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace pdserve::serving
