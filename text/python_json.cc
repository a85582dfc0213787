#include "text/python_json.h"

namespace pdserve::text {
namespace {

using ojson = nlohmann::ordered_json;

void Append(const ojson& value, std::string* out) {
  switch (value.type()) {
    case ojson::value_t::object: {
      out->push_back('{');
      bool first = true;
      for (auto it = value.begin(); it != value.end(); ++it) {
        if (!first) out->append(", ");
        first = false;
        out->append(PythonJsonString(it.key()));
        out->append(": ");
        Append(it.value(), out);
      }
      out->push_back('}');
      return;
    }
    case ojson::value_t::array: {
      out->push_back('[');
      for (size_t i = 0; i < value.size(); ++i) {
        if (i > 0) out->append(", ");
        Append(value[i], out);
      }
      out->push_back(']');
      return;
    }
    default:
      // Scalars: nlohmann escapes strings as Python does (\" \\ \b \f \n \r \t, other control
      // characters as lowercase \u00xx) and writes floats as the shortest round-trip form with a
      // two-digit exponent, as Python's repr.
      out->append(value.dump(-1, ' ', false, ojson::error_handler_t::replace));
  }
}

}  // namespace

std::string PythonJsonDumps(const ojson& value) {
  std::string out;
  Append(value, &out);
  return out;
}

std::string PythonJsonString(std::string_view text) {
  return ojson(std::string(text)).dump(-1, ' ', false, ojson::error_handler_t::replace);
}

}  // namespace pdserve::text
