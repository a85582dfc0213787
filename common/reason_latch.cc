#include "common/reason_latch.h"

namespace pdserve {

std::string WithoutRequestId(std::string_view message) {
  constexpr std::string_view kPrefix = "request ";
  if (!message.starts_with(kPrefix)) return std::string(message);
  const size_t end = message.find_first_not_of("0123456789", kPrefix.size());
  if (end == kPrefix.size() || end == std::string_view::npos ||
      message.compare(end, 2, ": ") != 0) {
    return std::string(message);
  }
  return std::string(message.substr(end + 2));
}

}  // namespace pdserve
