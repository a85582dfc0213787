#include "kvtransfer/shm/shared_memory.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <random>

#include "absl/strings/str_cat.h"

namespace pdserve::kv::shm {
namespace {

absl::Status Errno(const std::string& what) {
  const int error = errno;
  const std::string text = absl::StrCat(what, ": ", std::strerror(error));
  if (error == ENOMEM || error == ENOSPC) return absl::ResourceExhaustedError(text);
  if (error == EACCES || error == EPERM) return absl::PermissionDeniedError(text);
  return absl::InternalError(text);
}

constexpr int kSizeSeals = F_SEAL_SHRINK | F_SEAL_GROW;

Token RandomToken() {
  std::random_device device;
  Token token;
  for (size_t i = 0; i < token.size(); i += 4) {
    const uint32_t word = device();
    std::memcpy(token.data() + i, &word, 4);
  }
  return token;
}

}  // namespace

absl::StatusOr<std::string> HostBootId() {
  std::ifstream in("/proc/sys/kernel/random/boot_id");
  std::string id;
  if (!std::getline(in, id) || id.empty()) {
    return absl::UnavailableError("cannot read /proc/sys/kernel/random/boot_id");
  }
  return id;
}

std::string MemfdName(const std::string& purpose, const Token& token) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string name = absl::StrCat("pdserve-", purpose, "-");
  for (uint8_t b : token) {
    name.push_back(kHex[b >> 4]);
    name.push_back(kHex[b & 15]);
  }
  return name;
}

absl::StatusOr<std::unique_ptr<SharedRegion>> SharedRegion::Create(const std::string& purpose,
                                                                   uint64_t bytes) {
  if (bytes == 0) return absl::InvalidArgumentError("SharedRegion: 0 bytes");
  const Token token = RandomToken();
  const int fd = memfd_create(MemfdName(purpose, token).c_str(), MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) return Errno("memfd_create");
  if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    absl::Status status = Errno(absl::StrCat("ftruncate of a memfd to ", bytes, " bytes"));
    close(fd);
    return status;
  }
  // Its size is fixed for good: a peer's mapping can never reach past the end of the file (a
  // shrunk memfd would kill the peer's copy with SIGBUS). Peers refuse an unsealed one.
  if (fcntl(fd, F_ADD_SEALS, kSizeSeals | F_SEAL_SEAL) != 0) {
    absl::Status status = Errno("sealing a memfd's size");
    close(fd);
    return status;
  }
  void* base = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (base == MAP_FAILED) {
    absl::Status status = Errno(absl::StrCat("mmap of a ", bytes, "-byte memfd"));
    close(fd);
    return status;
  }
  const RegionName name{.pid = static_cast<uint32_t>(getpid()),
                        .fd = static_cast<uint32_t>(fd),
                        .bytes = bytes,
                        .token = token};
  return std::unique_ptr<SharedRegion>(
      new SharedRegion(static_cast<std::byte*>(base), bytes, fd, name));
}

SharedRegion::~SharedRegion() {
  munmap(base_, size_);
  close(fd_);
}

bool SharedRegion::Contains(const void* data, size_t size) const {
  const auto* p = static_cast<const std::byte*>(data);
  return p >= base_ && p <= base_ + size_ && size <= static_cast<size_t>(base_ + size_ - p);
}

uint64_t SharedRegion::OffsetOf(const void* data) const {
  return static_cast<uint64_t>(static_cast<const std::byte*>(data) - base_);
}

absl::StatusOr<std::unique_ptr<PeerRegion>> PeerRegion::Map(const std::string& purpose,
                                                            const RegionName& name, bool writable) {
  if (name.bytes == 0) return absl::FailedPreconditionError("shm: a region of 0 bytes");
  const std::string path = absl::StrCat("/proc/", name.pid, "/fd/", name.fd);
  // The memfd's name behind the fd must carry the token (readlink shows "/memfd:NAME (deleted)").
  char link[256] = {};
  const ssize_t n = readlink(path.c_str(), link, sizeof(link) - 1);
  if (n < 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("shm: cannot read ", path, ": ", std::strerror(errno),
                     " (the peer is gone, in another pid namespace, on another host, or runs "
                     "as another user)"));
  }
  const std::string expected = absl::StrCat("/memfd:", MemfdName(purpose, name.token));
  if (std::string(link, static_cast<size_t>(n)).rfind(expected, 0) != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("shm: ", path, " is not the announced region (its name is '",
                     std::string(link, static_cast<size_t>(n)), "')"));
  }
  const int fd = open(path.c_str(), (writable ? O_RDWR : O_RDONLY) | O_CLOEXEC);
  if (fd < 0) return Errno(absl::StrCat("shm: open ", path));
  // The fd may have been closed and reused since the readlink: check what was opened.
  char opened[256] = {};
  const std::string self = absl::StrCat("/proc/self/fd/", fd);
  const ssize_t m = readlink(self.c_str(), opened, sizeof(opened) - 1);
  if (m < 0 || std::string(opened, static_cast<size_t>(m)).rfind(expected, 0) != 0) {
    close(fd);
    return absl::FailedPreconditionError(
        absl::StrCat("shm: ", path, " changed while it was opened"));
  }
  // Without the size seals the exporter could shrink the file under the mapping: this process's
  // next read of the lost range would die of SIGBUS.
  const int seals = fcntl(fd, F_GET_SEALS);
  if (seals < 0 || (seals & kSizeSeals) != kSizeSeals) {
    close(fd);
    return absl::FailedPreconditionError(
        absl::StrCat("shm: ", path, " is not sealed against resizing"));
  }
  struct stat st {};
  if (fstat(fd, &st) != 0 || static_cast<uint64_t>(st.st_size) != name.bytes) {
    close(fd);
    return absl::FailedPreconditionError(absl::StrCat(
        "shm: ", path, " holds ", st.st_size, " bytes, the announcement says ", name.bytes));
  }
  void* base =
      mmap(nullptr, name.bytes, PROT_READ | (writable ? PROT_WRITE : 0), MAP_SHARED, fd, 0);
  close(fd);  // The mapping keeps the memory.
  if (base == MAP_FAILED) return Errno(absl::StrCat("shm: mmap of ", path));
  return std::unique_ptr<PeerRegion>(
      new PeerRegion(static_cast<std::byte*>(base), name.bytes, name));
}

PeerRegion::~PeerRegion() { munmap(base_, size_); }

}  // namespace pdserve::kv::shm
