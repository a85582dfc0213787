#include "loadgen/sse_parser.h"

namespace pdserve::loadgen {

std::vector<std::string> SseParser::Feed(std::string_view bytes) {
  std::vector<std::string> events;
  for (char c : bytes) {
    if (c == '\n') {
      EndLine(&events);
    } else {
      line_.push_back(c);
    }
  }
  return events;
}

void SseParser::EndLine(std::vector<std::string>* events) {
  if (!line_.empty() && line_.back() == '\r') line_.pop_back();
  if (line_.empty()) {
    if (has_data_) events->push_back(std::move(data_));
    data_.clear();
    has_data_ = false;
    return;
  }
  std::string_view line(line_);
  if (line.substr(0, 5) == "data:") {
    std::string_view value = line.substr(5);
    if (!value.empty() && value.front() == ' ') value.remove_prefix(1);
    if (has_data_) data_.push_back('\n');
    data_.append(value);
    has_data_ = true;
  }
  line_.clear();
}

}  // namespace pdserve::loadgen
