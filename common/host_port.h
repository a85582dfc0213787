// "host:port" as gRPC targets, listening addresses and URLs write it: an IPv6 literal in
// brackets ("[::1]:8001", RFC 3986 3.2.2), since "::1:8001" reads as a host name. The deploy
// config's hosts are IPv4 or IPv6 literals or host names (common/deploy_config.h), written bare.
#pragma once

#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace pdserve::common {

// `host` (a bare IPv6 literal gets brackets; any other host as it is) and `port`. Thread-safe.
inline std::string HostPort(absl::string_view host, int port) {
  if (host.find(':') != absl::string_view::npos) return absl::StrCat("[", host, "]:", port);
  return absl::StrCat(host, ":", port);
}

}  // namespace pdserve::common
