// guards::VerifyPinnedPages: a pinned table passes while it is the owner's, and fails with an
// isolation error once a page was freed and reallocated to another owner, or the owner's pages
// were replaced.
#include "guards/page_ownership.h"

#include <memory>

#include "gtest/gtest.h"

namespace pdserve::guards {
namespace {

std::unique_ptr<serving::PagePool> TwoPagePool() {
  serving::PagePoolOptions options;
  options.kinds = {{"window", 2, 4, 16}};
  return *serving::PagePool::Create(options);
}

TEST(PageOwnershipTest, LiveTablePasses) {
  auto pool = TwoPagePool();
  const serving::PageTable table = *pool->Allocate(1, {1});
  EXPECT_TRUE(VerifyPinnedPages(*pool, table, "before load").ok());
}

TEST(PageOwnershipTest, PageReallocatedToAnotherOwnerFails) {
  auto pool = TwoPagePool();
  const serving::PageTable pinned = *pool->Allocate(1, {2});
  ASSERT_TRUE(pool->Free(pinned).ok());
  ASSERT_TRUE(pool->Allocate(2, {1}).ok());  // takes one of owner 1's former pages
  ASSERT_TRUE(pool->Allocate(1, {1}).ok());  // owner 1 holds pages again, other ones
  const absl::Status status = VerifyPinnedPages(*pool, pinned, "after store");
  EXPECT_TRUE(IsPageIsolationError(status)) << status;
  EXPECT_NE(status.message().find("after store: sequence 1"), std::string::npos) << status;
}

TEST(PageOwnershipTest, FreedOwnerFails) {
  auto pool = TwoPagePool();
  const serving::PageTable pinned = *pool->Allocate(1, {1});
  ASSERT_TRUE(pool->Free(pinned).ok());
  const absl::Status status = VerifyPinnedPages(*pool, pinned, "before load");
  EXPECT_TRUE(IsPageIsolationError(status)) << status;
  EXPECT_NE(status.message().find("holds no pages"), std::string::npos) << status;
}

TEST(PageOwnershipTest, OtherErrorsAreNotIsolationErrors) {
  EXPECT_FALSE(IsPageIsolationError(absl::FailedPreconditionError("use after free")));
  EXPECT_FALSE(IsPageIsolationError(absl::OkStatus()));
}

}  // namespace
}  // namespace pdserve::guards
