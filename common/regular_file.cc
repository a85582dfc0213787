#include "common/regular_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace pdserve::common {
namespace {

std::string Name(const std::string& path, const std::string& what) {
  return what.empty() ? path : absl::StrCat(what, " ", path);
}

}  // namespace

absl::Status CheckRegularFile(const std::string& path, const std::string& what) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    const int err = errno;
    const std::string name = Name(path, what);
    switch (err) {
      case ENOENT:
      case ENOTDIR:
        return absl::NotFoundError(absl::StrCat(name, " does not exist"));
      case ELOOP:
        return absl::InvalidArgumentError(
            absl::StrCat(name, " is a symlink loop (too many levels of symbolic links)"));
      case EACCES:
        return absl::PermissionDeniedError(
            absl::StrCat(name, ": permission denied (a directory on the path is not searchable)"));
      default:
        return absl::UnknownError(absl::StrCat(name, ": ", std::strerror(err)));
    }
  }
  if (S_ISREG(st.st_mode)) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(Name(path, what), " is not a regular file (",
                   S_ISDIR(st.st_mode) ? "a directory" : "a FIFO, socket or device", ")"));
}

absl::Status OpenError(const std::string& path, int err, const std::string& what) {
  const std::string msg = absl::StrCat("cannot open ", Name(path, what), ": ", std::strerror(err));
  if (err == EACCES || err == EPERM) return absl::PermissionDeniedError(msg);
  if (err == ENOENT) return absl::NotFoundError(msg);
  return absl::UnknownError(msg);
}

absl::Status WriteFile(const std::string& path, std::string_view text, const std::string& what) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return OpenError(path, errno, what);
  auto failed = [&](int err) {
    return absl::UnknownError(
        absl::StrCat("cannot write ", Name(path, what), ": ", std::strerror(err)));
  };
  while (!text.empty()) {
    const ssize_t n = ::write(fd, text.data(), text.size());
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int err = n < 0 ? errno : EIO;
      ::close(fd);
      return failed(err);
    }
    text.remove_prefix(static_cast<size_t>(n));
  }
  if (::close(fd) != 0) return failed(errno);
  return absl::OkStatus();
}

}  // namespace pdserve::common
