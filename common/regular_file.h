// Checking that a path names a readable regular file before reading it, with the real cause when
// it does not: a FIFO or device (/dev/zero) would hang or never end, and "not a regular file"
// for a path that does not exist sends an operator looking in the wrong place.
#pragma once

#include <string>
#include <string_view>

#include "absl/status/status.h"

namespace pdserve::common {

// OK when `path` (symbolic links followed) is a regular file. Otherwise, naming `what` ("prompt
// file", may be empty) and the path:
//   NotFound "... does not exist" (ENOENT, ENOTDIR), InvalidArgument "... is a symlink loop"
//   (ELOOP), PermissionDenied "... permission denied" (EACCES on a directory of the path),
//   InvalidArgument "... is not a regular file (a directory)" / "(a FIFO, socket or device)",
//   Unknown with strerror for any other stat() error.
// Thread-safe.
absl::Status CheckRegularFile(const std::string& path, const std::string& what = "");

// The status for a failed open() / std::ifstream of `path` with `err` (errno): PermissionDenied
// for EACCES / EPERM, NotFound for ENOENT, Unknown otherwise, each with strerror. Thread-safe.
absl::Status OpenError(const std::string& path, int err, const std::string& what = "");

// Writes `text` to `path` (created or truncated, mode 0644 less the umask) and closes it; OK only
// when every byte was written and the close succeeded, so a full disk (ENOSPC, also at close on
// network file systems) is an error: Unknown "cannot write <what> PATH: <strerror>"; an open
// that fails gives OpenError's status. Thread-safe.
absl::Status WriteFile(const std::string& path, std::string_view text,
                       const std::string& what = "");

}  // namespace pdserve::common
