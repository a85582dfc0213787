// How far a TCP peer has taken what was sent to it, from the kernel (Linux TCP_INFO).
//
// Thread-safety: a plain query of the socket; callable from any thread.
#pragma once

#include <cstdint>
#include <optional>

namespace pdserve::frontend {

// Bytes of the connection's output the peer has acknowledged so far (tcpi_bytes_acked, Linux
// 4.1+). Data goes out only as the peer's receive window opens, so the count grows while the peer
// reads and stops while it does not: it shows a client taking its stream even when no write of
// ours completes (a large send buffer wakes a writer only once a third of it is free).
// nullopt when `fd` is not a TCP socket or the kernel does not report it.
std::optional<uint64_t> TcpBytesAcked(int fd);

}  // namespace pdserve::frontend
