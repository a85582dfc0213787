// Paranoid mode's page check (issue 9): before a sequence's state is read from its pages and after
// it is written back, every page of the sequence's page table must still be the sequence's own live
// allocation, with the epoch it had when the table was first handed to the engine.
//
// serving::PagePool already refuses a stale handle when pages are mapped (PagePool::Data), but a
// caller that fetches the owner's *current* table every step cannot tell that its pages were freed
// and reallocated in between: it would silently compute on fresh (or another request's) pages.
// Pinning the table at the sequence's first step and verifying the pinned table turns that into an
// explicit isolation error. Cost: one pool lock and O(pages) comparisons per call.
//
// Thread-safety: as PagePool (every call locks the pool).
#pragma once

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "serving/page_pool.h"

namespace pdserve::guards {

// OK when pool.Table(pinned.owner) is exactly `pinned` and each of its handles passes
// PagePool::Check for that owner. Otherwise FailedPrecondition
// "isolation error (page_owner): <where>: sequence <owner>: <what changed>", where what changed
// is the pool's own message (page, current owner and epoch) or the table difference.
// `where` says which read or write was guarded, e.g. "before load" / "after store".
absl::Status VerifyPinnedPages(const serving::PagePool& pool, const serving::PageTable& pinned,
                               absl::string_view where);

// True when `status` came from VerifyPinnedPages (its message starts "isolation error").
bool IsPageIsolationError(const absl::Status& status);

}  // namespace pdserve::guards
