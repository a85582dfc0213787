#include "guards/page_ownership.h"

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace pdserve::guards {
namespace {

absl::Status Violation(absl::string_view where, serving::RequestId owner, absl::string_view what) {
  return absl::FailedPreconditionError(
      absl::StrCat("isolation error (page_owner): ", where, ": sequence ", owner, ": ", what));
}

}  // namespace

absl::Status VerifyPinnedPages(const serving::PagePool& pool, const serving::PageTable& pinned,
                               absl::string_view where) {
  absl::StatusOr<serving::PageTable> current = pool.Table(pinned.owner);
  if (!current.ok()) {
    return Violation(where, pinned.owner,
                     absl::StrCat("holds no pages any more (", current.status().message(), ")"));
  }
  for (const std::vector<serving::PageHandle>& kind : pinned.pages) {
    for (const serving::PageHandle& handle : kind) {
      const absl::Status ok = pool.Check(pinned.owner, handle);
      if (!ok.ok()) return Violation(where, pinned.owner, ok.message());
    }
  }
  if (!(*current == pinned)) {
    return Violation(where, pinned.owner, "its page table was replaced");
  }
  return absl::OkStatus();
}

bool IsPageIsolationError(const absl::Status& status) {
  return absl::IsFailedPrecondition(status) &&
         absl::StartsWith(status.message(), "isolation error (page_owner)");
}

}  // namespace pdserve::guards
