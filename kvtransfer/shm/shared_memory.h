// Same-host shared memory for the shm-pull data path (docs/protocol.md, "Same-host pages by
// shared memory"): a region this process exports (an anonymous memfd mapped read-write) and a
// peer's region mapped from its /proc/<pid>/fd/<fd> entry.
//
// A region is named by (pid, fd, bytes, token): the token is 16 random bytes carried in the memfd's
// name, so a mapper checks the name behind /proc/<pid>/fd/<fd> before it opens it, and a reused pid
// or fd, a peer in another pid namespace or on another host (boot ids differ) is refused, never
// mapped by chance. Opening another process's fd needs the same user (ptrace read access to it):
// two workers under different users, or in containers that do not share /proc, cannot map each
// other, and the caller keeps the active-message path.
//
// Thread-safety: SharedRegion and PeerRegion are immutable after creation (their bytes are not
// guarded: their users synchronize, e.g. through AckTable's atomics).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace pdserve::kv::shm {

using Token = std::array<uint8_t, 16>;

// What a peer needs to map a region.
struct RegionName {
  uint32_t pid = 0;
  uint32_t fd = 0;
  uint64_t bytes = 0;
  Token token{};
  bool operator==(const RegionName&) const = default;
};

// This host's boot id (/proc/sys/kernel/random/boot_id): equal on two processes only when they
// run on the same booted host. Unavailable when it cannot be read.
absl::StatusOr<std::string> HostBootId();

// The memfd name a region of `token` carries ("pdserve-<purpose>-<32 hex digits>").
std::string MemfdName(const std::string& purpose, const Token& token);

// An exported region: `bytes` of zeroed, page-aligned memory in a memfd (close-on-exec, sealed
// against shrinking and growing, so no mapper can meet SIGBUS), mapped read-write, unmapped and
// closed on destruction (a peer's mapping stays valid until the peer unmaps it: the kernel keeps
// the memory until its last mapping goes).
class SharedRegion {
 public:
  // `purpose` goes into the memfd's name (letters and digits). Errors: InvalidArgument for 0
  // bytes; Internal with errno's text when memfd_create, ftruncate or mmap fails;
  // ResourceExhausted when the memory is not there.
  static absl::StatusOr<std::unique_ptr<SharedRegion>> Create(const std::string& purpose,
                                                              uint64_t bytes);
  ~SharedRegion();
  SharedRegion(const SharedRegion&) = delete;
  SharedRegion& operator=(const SharedRegion&) = delete;

  std::span<std::byte> bytes() const { return {base_, size_}; }
  const RegionName& name() const { return name_; }
  // Whether [data, data + size) lies inside the region; its offset there when it does.
  bool Contains(const void* data, size_t size) const;
  uint64_t OffsetOf(const void* data) const;

 private:
  SharedRegion(std::byte* base, size_t size, int fd, RegionName name)
      : base_(base), size_(size), fd_(fd), name_(name) {}
  std::byte* base_;
  size_t size_;
  int fd_;
  RegionName name_;
};

// A peer's region mapped here, unmapped on destruction.
class PeerRegion {
 public:
  // Maps `name` (read-only unless `writable`). `purpose` must be the one the exporter used.
  // Errors: FailedPrecondition naming the check that failed (no such fd, its name is not the
  // token's, its size differs, it is not sealed against resizing), PermissionDenied when
  // /proc/<pid>/fd/<fd> cannot be opened (another user, ptrace restrictions), Internal for a failed
  // mmap.
  static absl::StatusOr<std::unique_ptr<PeerRegion>> Map(const std::string& purpose,
                                                         const RegionName& name, bool writable);
  ~PeerRegion();
  PeerRegion(const PeerRegion&) = delete;
  PeerRegion& operator=(const PeerRegion&) = delete;

  std::span<std::byte> bytes() const { return {base_, size_}; }
  const RegionName& name() const { return name_; }
  // [offset, offset + length) of the region, or nullopt-like empty span with ok=false when it
  // does not lie inside (overflow-safe).
  bool InRange(uint64_t offset, uint64_t length) const {
    return offset <= size_ && length <= size_ - offset;
  }

 private:
  PeerRegion(std::byte* base, size_t size, RegionName name)
      : base_(base), size_(size), name_(name) {}
  std::byte* base_;
  size_t size_;
  RegionName name_;
};

}  // namespace pdserve::kv::shm
