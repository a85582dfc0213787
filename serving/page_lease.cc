#include "serving/page_lease.h"

#include <utility>

#include "spdlog/spdlog.h"

namespace pdserve::serving {

std::shared_ptr<const PageLease> PageLease::Hold(PagePool* pool, PageTable table) {
  return std::shared_ptr<const PageLease>(new PageLease(pool, std::move(table)));
}

PageLease::~PageLease() {
  if (absl::Status freed = pool_->Free(table_); !freed.ok()) {
    spdlog::error("pages of request {}: {}", table_.owner, freed.ToString());
  }
}

}  // namespace pdserve::serving
