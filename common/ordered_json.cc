#include "common/ordered_json.h"

#include <cstddef>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace pdserve {
namespace {

using ordered_json = nlohmann::ordered_json;

// Builds the value as nlohmann's DOM parser does, except that an object's members are appended
// without ordered_map's linear search: each open object keeps a key -> position index.
class LinearOrderedBuilder {
 public:
  explicit LinearOrderedBuilder(ordered_json& root) : root_(root) {}

  bool null() { return Put(nullptr); }
  bool boolean(bool v) { return Put(v); }
  bool number_integer(ordered_json::number_integer_t v) { return Put(v); }
  bool number_unsigned(ordered_json::number_unsigned_t v) { return Put(v); }
  bool number_float(ordered_json::number_float_t v, const std::string&) { return Put(v); }
  bool string(std::string& v) { return Put(std::move(v)); }
  bool binary(ordered_json::binary_t&) { return false; }  // JSON text has none

  bool start_object(std::size_t) {
    ordered_json* value = Put(ordered_json::object());
    if (value == nullptr) return false;
    stack_.push_back({value, {}});
    return true;
  }
  bool key(std::string& k) {
    Open& open = stack_.back();
    auto& members = open.value->get_ref<ordered_json::object_t&>();
    auto [it, inserted] = open.index.try_emplace(k, members.size());
    if (inserted) {
      // ordered_map is a std::vector of pairs: append without its duplicate search.
      using Vector = std::vector<std::pair<const std::string, ordered_json>>;
      static_cast<Vector&>(members).emplace_back(std::move(k), nullptr);
      slot_ = &static_cast<Vector&>(members).back().second;
    } else {
      slot_ = &(members.begin() + static_cast<std::ptrdiff_t>(it->second))->second;
      *slot_ = nullptr;
    }
    return true;
  }
  bool end_object() {
    stack_.pop_back();
    return true;
  }
  bool start_array(std::size_t) {
    ordered_json* value = Put(ordered_json::array());
    if (value == nullptr) return false;
    stack_.push_back({value, {}});
    return true;
  }
  bool end_array() {
    stack_.pop_back();
    return true;
  }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception&) {
    return false;
  }

 private:
  struct Open {
    ordered_json* value;
    std::unordered_map<std::string, std::size_t> index;  // objects only
  };

  // Places `v` where the parse stands: the root, the slot of the last key, or the end of the
  // open array. The pointer stays valid while the value is open: its container grows only
  // after it closes.
  template <typename V>
  ordered_json* Put(V&& v) {
    if (stack_.empty()) {
      root_ = ordered_json(std::forward<V>(v));
      return &root_;
    }
    ordered_json& parent = *stack_.back().value;
    if (parent.is_array()) {
      parent.get_ref<ordered_json::array_t&>().emplace_back(std::forward<V>(v));
      return &parent.get_ref<ordered_json::array_t&>().back();
    }
    *slot_ = ordered_json(std::forward<V>(v));
    return slot_;
  }

  ordered_json& root_;
  std::vector<Open> stack_;
  ordered_json* slot_ = nullptr;
};

}  // namespace

ordered_json ParseOrderedJson(std::string_view text) {
  ordered_json result;
  LinearOrderedBuilder builder(result);
  if (!ordered_json::sax_parse(text.begin(), text.end(), &builder)) {
    return ordered_json(ordered_json::value_t::discarded);
  }
  return result;
}

}  // namespace pdserve
