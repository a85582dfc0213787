#include "frontend/tcp_progress.h"

// <linux/tcp.h>, not glibc's <netinet/tcp.h>: only the kernel's struct tcp_info has
// tcpi_bytes_acked, and the two headers cannot be included together (hence this file of its own).
#include <linux/tcp.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <cstddef>

namespace pdserve::frontend {

std::optional<uint64_t> TcpBytesAcked(int fd) {
  tcp_info info{};
  socklen_t length = sizeof(info);
  if (getsockopt(fd, IPPROTO_TCP, TCP_INFO, &info, &length) != 0) return std::nullopt;
  if (length < offsetof(tcp_info, tcpi_bytes_acked) + sizeof(info.tcpi_bytes_acked)) {
    return std::nullopt;
  }
  return info.tcpi_bytes_acked;
}

}  // namespace pdserve::frontend
