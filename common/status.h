// Status helpers shared by every pdserve component.
//
// pdserve uses absl::Status / absl::StatusOr<T> at every boundary (house style). These macros keep
// call sites short; they evaluate their argument exactly once. Thread-safe: they hold no state.
#pragma once

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define PDSERVE_STATUS_CONCAT_INNER(a, b) a##b
#define PDSERVE_STATUS_CONCAT(a, b) PDSERVE_STATUS_CONCAT_INNER(a, b)

// Returns from the enclosing function when `expr` (an absl::Status) is not OK.
#define PDSERVE_RETURN_IF_ERROR(expr)                          \
  do {                                                         \
    ::absl::Status pdserve_status_tmp_ = (expr);               \
    if (!pdserve_status_tmp_.ok()) return pdserve_status_tmp_; \
  } while (0)

// `PDSERVE_ASSIGN_OR_RETURN(auto x, MakeX());` declares x from the StatusOr's value, or returns
// the error from the enclosing function.
#define PDSERVE_ASSIGN_OR_RETURN(lhs, expr) \
  PDSERVE_ASSIGN_OR_RETURN_IMPL(PDSERVE_STATUS_CONCAT(pdserve_statusor_, __LINE__), lhs, expr)
#define PDSERVE_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                                  \
  if (!tmp.ok()) return std::move(tmp).status();      \
  lhs = std::move(tmp).value()
