// One streamed OpenAI request over HTTP/1.1 (Boost.Beast on Asio), measured as it arrives:
// connect, POST, read the SSE body chunk by chunk, time each content chunk.
//
// Event-driven: a call is a chain of completion handlers on the caller's io_context, so one
// thread holds thousands of streams (one TCP connection each). Plain HTTP only; TLS endpoints
// are rejected by ParseEndpointUrl.
//
// Thread-safety: StartStreamCall and the handlers run on the io_context's thread(s); `done` is
// called exactly once, on that thread.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "boost/asio/io_context.hpp"
#include "boost/asio/ip/tcp.hpp"
#include "loadgen/stats.h"

namespace pdserve::loadgen {

// An endpoint URL "http://host[:port][/prefix]" split for requests. An OpenAI-style base URL
// ending in "/v1" is accepted: the prefix drops it, since the paths carry "/v1/...".
struct EndpointUrl {
  std::string host;
  std::string port = "80";
  std::string path_prefix;  // "" or "/something", never ending in '/'
  // Host header value ("host" or "host:port").
  std::string HostHeader() const;
};
// Errors: InvalidArgument for anything but http:// with a host.
absl::StatusOr<EndpointUrl> ParseEndpointUrl(absl::string_view url);
// True for "localhost", 127.0.0.0/8 and ::1 (the addresses `pdserve bench` may use unasked).
bool IsLoopbackHost(absl::string_view host);

struct StreamCallSpec {
  std::string target;                              // e.g. "/v1/chat/completions"
  std::string body;                                // JSON with "stream": true
  std::chrono::steady_clock::time_point deadline;  // the call fails with "timeout" after it
};

using StreamDone = std::function<void(RequestSample)>;

// Starts the call; `done` gets its sample (error_kind set on failure: "connect", "write",
// "read", "http_<status>", "stream_error", "incomplete", "timeout", "protocol").
void StartStreamCall(boost::asio::io_context& ioc,
                     const boost::asio::ip::tcp::resolver::results_type& addresses,
                     const EndpointUrl& url, StreamCallSpec spec, StreamDone done);

// ParseEndpointUrl, refusing hosts other than loopback unless `allow_remote`: a load generator
// pointed at someone else's server by a typo is a denial of service.
// Errors: InvalidArgument (bad URL), PermissionDenied (remote host without allow_remote).
absl::StatusOr<EndpointUrl> ParseTargetUrl(absl::string_view url, bool allow_remote);

// The first model id the endpoint's GET /v1/models lists. Errors: as HttpGet, and
// FailedPrecondition when the list is empty or not OpenAI-shaped.
absl::StatusOr<std::string> FirstServedModel(const EndpointUrl& url);

// A blocking GET of `path` (prefixed by the endpoint's path prefix) returning the body.
// Errors: Unavailable (connect/read failures or timeout), FailedPrecondition for a non-200
// status. For set-up queries such as /v1/models; not for measured traffic.
absl::StatusOr<std::string> HttpGet(const EndpointUrl& url, absl::string_view path,
                                    std::chrono::milliseconds timeout);

}  // namespace pdserve::loadgen
