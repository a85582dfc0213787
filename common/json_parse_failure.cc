#include "common/json_parse_failure.h"

#include <vector>

#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"

namespace pdserve {
namespace {

using json = nlohmann::json;

constexpr size_t kMaxKeyBytes = 64;
constexpr size_t kMaxPathBytes = 256;
constexpr size_t kMaxTokenBytes = 32;
// nlohmann's out_of_range id for "number overflow parsing '...'" (parser.hpp).
constexpr int kNumberOverflowId = 406;

std::string Cut(std::string_view text, size_t limit) {
  if (text.size() <= limit) return std::string(text);
  return std::string(text.substr(0, limit)) + "...";
}

// A SAX consumer that builds nothing and keeps only where the parse stands: one frame per open
// array or object, with the last member name or the count of elements begun.
class Locator {
 public:
  bool null() { return Value(); }
  bool boolean(bool) { return Value(); }
  bool number_integer(json::number_integer_t) { return Value(); }
  bool number_unsigned(json::number_unsigned_t) { return Value(); }
  bool number_float(json::number_float_t, const std::string&) { return Value(); }
  bool string(std::string&) { return Value(); }
  bool binary(json::binary_t&) { return Value(); }
  bool start_object(std::size_t) { return Open(/*array=*/false); }
  bool key(std::string& k) {
    frames_.back().key = Cut(k, kMaxKeyBytes);
    return true;
  }
  bool end_object() { return Close(); }
  bool start_array(std::size_t) { return Open(/*array=*/true); }
  bool end_array() { return Close(); }
  bool parse_error(std::size_t position, const std::string& last_token,
                   const nlohmann::detail::exception& error) {
    JsonParseFailure f;
    f.kind = error.id == kNumberOverflowId ? JsonParseFailure::Kind::kNumberOutOfRange
                                           : JsonParseFailure::Kind::kSyntax;
    f.byte = position;
    f.token = Cut(last_token, kMaxTokenBytes);
    f.path = Path();
    if (!frames_.empty() && !frames_.front().array) f.top_key = frames_.front().key;
    failure_ = std::move(f);
    return false;
  }

  const std::optional<JsonParseFailure>& failure() const { return failure_; }

 private:
  struct Frame {
    bool array = false;
    size_t begun = 0;  // arrays: elements begun, the one being read included
    std::string key;   // objects: the member being read
  };

  bool Value() {
    if (!frames_.empty() && frames_.back().array) ++frames_.back().begun;
    return true;
  }
  bool Open(bool array) {
    Value();
    frames_.push_back({array, 0, ""});
    return true;
  }
  bool Close() {
    frames_.pop_back();
    return true;
  }

  // At an error the innermost array has not begun the failing element yet (its index is the
  // count begun); every outer array is inside the element it began last.
  std::string Path() const {
    std::string path;
    for (size_t i = 0; i < frames_.size(); ++i) {
      const Frame& f = frames_[i];
      if (f.array) {
        const size_t index = i + 1 == frames_.size() ? f.begun : f.begun - 1;
        absl::StrAppend(&path, "[", index, "]");
      } else {
        absl::StrAppend(&path, path.empty() ? "" : ".", f.key);
      }
      if (path.size() > kMaxPathBytes) return Cut(path, kMaxPathBytes);
    }
    return path;
  }

  std::vector<Frame> frames_;
  std::optional<JsonParseFailure> failure_;
};

}  // namespace

std::optional<JsonParseFailure> FindJsonParseFailure(std::string_view text) {
  Locator locator;
  if (json::sax_parse(text.begin(), text.end(), &locator)) return std::nullopt;
  if (locator.failure()) return locator.failure();
  return JsonParseFailure{};  // refused without a parse_error event: say "syntax", at byte 0
}

std::string NumberOutOfRangeMessage(std::string_view base, const JsonParseFailure& failure) {
  std::string where(base);
  if (!where.empty() && !failure.path.empty() && failure.path.front() != '[') where += ".";
  where += failure.path;
  return absl::StrCat(where.empty() ? "request body" : absl::StrCat("'", where, "'"),
                      ": the number ", failure.token,
                      " is out of range (a JSON number here must fit a double, at most about "
                      "1.8e308 in magnitude)");
}

}  // namespace pdserve
