// A shared hold on one request's pages in a PagePool: the pages go back to the pool
// (PagePool::Free) when the last holder lets go, on that holder's thread.
//
// For pages that more than one party reads with no order between their ends. The decode worker
// holds each request's pages while its lifecycle says they are held (decode/request_state.h);
// the early import (runtime/early_import.h) holds a transferred request's pages while an import
// call may still read them. A request that ends while such a call runs (the receiver released
// its ticket, or it was aborted) gives up its hold at once, and its pages are reused only after
// the read is over.
//
// Thread-safety: holders may copy and drop their std::shared_ptr on any thread. The last drop
// frees the table, taking only the pool's mutex (no lock of the holder's is needed or taken).
#pragma once

#include <memory>
#include <utility>

#include "serving/page_pool.h"

namespace pdserve::serving {

class PageLease {
 public:
  // A hold on `table`, which `pool` allocated; `pool` must outlive every copy.
  static std::shared_ptr<const PageLease> Hold(PagePool* pool, PageTable table);
  // Frees the table. A failure (the table was freed elsewhere: a bug) is logged.
  ~PageLease();
  PageLease(const PageLease&) = delete;
  PageLease& operator=(const PageLease&) = delete;

  const PageTable& table() const { return table_; }

 private:
  PageLease(PagePool* pool, PageTable table) : pool_(pool), table_(std::move(table)) {}

  PagePool* const pool_;
  const PageTable table_;
};

}  // namespace pdserve::serving
