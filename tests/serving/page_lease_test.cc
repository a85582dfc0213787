// serving::PageLease: the pages go back to the pool when the last holder lets go, whichever
// holder that is, and not before.
#include "serving/page_lease.h"

#include <gtest/gtest.h>

#include <memory>
#include <utility>

namespace pdserve::serving {
namespace {

std::unique_ptr<PagePool> SmallPool() {
  auto pool = PagePool::Create({.kinds = {{"window", 4, 8, 16}}});
  EXPECT_TRUE(pool.ok()) << pool.status();
  return std::move(*pool);
}

TEST(PageLeaseTest, PagesGoBackWhenTheLastHolderLetsGo) {
  for (bool first_goes_first : {true, false}) {
    SCOPED_TRACE(first_goes_first);
    std::unique_ptr<PagePool> pool = SmallPool();
    auto table = pool->Allocate(7, {3});
    ASSERT_TRUE(table.ok()) << table.status();
    std::shared_ptr<const PageLease> first = PageLease::Hold(pool.get(), *table);
    std::shared_ptr<const PageLease> second = first;
    EXPECT_EQ(first->table(), *table);
    (first_goes_first ? first : second).reset();
    EXPECT_EQ(pool->pages_free(0), 1);
    EXPECT_TRUE(pool->Table(7).ok());
    (first_goes_first ? second : first).reset();
    EXPECT_EQ(pool->pages_free(0), 4);
    EXPECT_TRUE(absl::IsNotFound(pool->Table(7).status()));
    // The freed pages are the next request's.
    EXPECT_TRUE(pool->Allocate(8, {4}).ok());
  }
}

}  // namespace
}  // namespace pdserve::serving
