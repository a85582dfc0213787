// Incremental parser of a text/event-stream body (the WHATWG server-sent events format that
// OpenAI streaming uses): bytes in, complete events' data out, whatever the chunk boundaries.
//
// Only the `data` field matters to OpenAI streams; several data lines of one event are joined
// with "\n", comment lines (":...") and other fields are skipped, CRLF and LF both end lines.
// Not thread-safe: one parser per stream.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace pdserve::loadgen {

class SseParser {
 public:
  // Feeds the next bytes of the body; returns the data of every event completed by them.
  std::vector<std::string> Feed(std::string_view bytes);

 private:
  void EndLine(std::vector<std::string>* events);

  std::string line_;
  std::string data_;
  bool has_data_ = false;
};

}  // namespace pdserve::loadgen
