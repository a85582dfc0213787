#include "structured/tool_call_grammar.h"

#include <algorithm>
#include <functional>
#include <limits>
#include <optional>
#include <queue>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/json_depth.h"
#include "common/ordered_json.h"
#include "common/status.h"
#include "structured/json_matcher.h"

namespace pdserve::structured {
namespace {

using ordered_json = nlohmann::ordered_json;

constexpr int64_t kCostCap = int64_t{1} << 40;
constexpr uint32_t kStart = 0;        // the block's opening and the first name
constexpr uint32_t kAfterInvoke = 1;  // another invoke, or the block's end

// The wrapper frame: frame 0 of every stack. Its phase says what it reads; index is the point
// (kAlternative) or the value (kRaw, kJson); a / b are the leading alternative and the bytes of
// it read (kAlternative), the closing tag's bytes read and the UTF-8 state (kRaw), or the bytes
// of the forbidden character just read (kJson).
constexpr uint8_t kWrapperKind = 0x80;
enum : uint8_t { kAlternative, kRaw, kJson, kDone };

Frame Wrapper(uint8_t phase, uint32_t index, uint32_t a = 0, uint32_t b = 0) {
  Frame f;
  f.kind = kWrapperKind;
  f.phase = phase;
  f.index = index;
  f.a = a;
  f.b = b;
  return f;
}

void Emit(std::span<const Frame> stack, MatcherState* out) {
  if (out->ends.size() >= kMaxStacks) return;
  out->frames.insert(out->frames.end(), stack.begin(), stack.end());
  out->ends.push_back(static_cast<uint16_t>(out->frames.size()));
}

int64_t Add(int64_t a, int64_t b) { return std::min(kCostCap, a + b); }

// Raw text's UTF-8 state in a wrapper frame's b: continuation bytes still needed, the range of
// the next one, and how many bytes of the current character match the forbidden one.
struct Utf8 {
  uint32_t need = 0, lo = 0x80, hi = 0xBF, match = 0;
  static Utf8 Of(uint32_t b) { return {b & 0xFF, (b >> 8) & 0xFF, (b >> 16) & 0xFF, b >> 24}; }
  uint32_t Pack() const { return need | (lo << 8) | (hi << 16) | (match << 24); }
  // Reads `byte`; false when it is not valid UTF-8 here (or NUL).
  bool Read(uint8_t byte) {
    if (need > 0) {
      if (byte < lo || byte > hi) return false;
      --need;
      lo = 0x80;
      hi = 0xBF;
      return true;
    }
    if (byte == 0) return false;
    return byte < 0x80 || structured::Utf8Lead(byte, &need, &lo, &hi);
  }
};

// The first UTF-8 character of `text` (its lead byte's length).
std::string FirstCharacter(std::string_view text) {
  const auto lead = static_cast<uint8_t>(text[0]);
  const size_t n = lead < 0x80 ? 1 : lead < 0xE0 ? 2 : lead < 0xF0 ? 3 : 4;
  return std::string(text.substr(0, std::min(n, text.size())));
}

// The strings a raw value may be: any (`free`), or one of `literals` (decoded enum / const).
void RawStrings(const SchemaNode& node, bool* free, std::vector<std::string>* literals) {
  if (!node.any_of.empty()) {
    for (const SchemaNode* alt : node.any_of) RawStrings(*alt, free, literals);
    return;
  }
  if (!node.literals.empty()) {
    for (const std::string& l : node.literals) {
      if (l[0] == '"') literals->push_back(ordered_json::parse(l).get<std::string>());
    }
    return;
  }
  if (node.types & kTypeString) *free = true;
}

// The node admits a value that is not a string.
bool AdmitsNonString(const SchemaNode& node) {
  if (!node.any_of.empty()) {
    return std::any_of(node.any_of.begin(), node.any_of.end(),
                       [](const SchemaNode* alt) { return AdmitsNonString(*alt); });
  }
  if (!node.literals.empty()) {
    return std::any_of(node.literals.begin(), node.literals.end(),
                       [](const std::string& l) { return l[0] != '"'; });
  }
  return (node.types & kTypeAny & ~kTypeString) != 0;
}

absl::Status CheckName(const std::string& what, const std::string& name, std::string_view dsml) {
  if (name.empty() || name.find('"') != std::string::npos || name.find(dsml) != std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, " '", name, "' cannot be enforced: it is empty or holds '\"' or the DSML marker"));
  }
  return absl::OkStatus();
}

}  // namespace

// Builds the points and values of a spec.
class ToolCallGrammar::Builder {
 public:
  Builder(ToolCallGrammar* g, std::string dsml) : g_(g), dsml_(std::move(dsml)) {}

  absl::Status Run(const ordered_json& spec) {
    g_->tag_ = absl::StrCat("</", dsml_, "parameter>");
    g_->forbidden_ = FirstCharacter(dsml_);
    g_->points_.resize(2);
    const ordered_json& tools = spec["tools"];
    std::vector<uint32_t> first_points;
    for (const ordered_json& tool : tools) {
      PDSERVE_ASSIGN_OR_RETURN(uint32_t first, Tool(tool));
      first_points.push_back(first);
    }
    const std::string open = absl::StrCat("\n\n<", dsml_, "tool_calls>\n");
    for (size_t t = 0; t < tools.size(); ++t) {
      const std::string invoke =
          absl::StrCat("<", dsml_, "invoke name=\"", tools[t]["name"].get<std::string>(), "\">\n");
      AddAlternative(kStart, open + invoke, {Next::kPoint, first_points[t]});
      if (spec.value("parallel", true)) {
        AddAlternative(kAfterInvoke, "\n" + invoke, {Next::kPoint, first_points[t]});
      }
    }
    AddAlternative(kAfterInvoke, absl::StrCat("\n</", dsml_, "tool_calls>"), {Next::kDone, 0});
    return Finish();
  }

 private:
  // A function's points; returns the first (right after its invoke line).
  absl::StatusOr<uint32_t> Tool(const ordered_json& tool) {
    const std::string name = tool.value("name", "");
    PDSERVE_RETURN_IF_ERROR(CheckName("function", name, dsml_));
    if (!names_.insert(name).second) {
      return absl::InvalidArgumentError(absl::StrCat("function '", name, "' is declared twice"));
    }
    const ordered_json parameters =
        tool.contains("parameters") ? tool["parameters"] : ordered_json::object();
    absl::StatusOr<std::shared_ptr<const JsonSchema>> schema = JsonSchema::Compile(parameters);
    if (!schema.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("function '", name, "' parameters: ", schema.status().message()));
    }
    const SchemaNode& root = (*schema)->root();
    if (!root.any_of.empty() || !root.literals.empty() || !(root.types & kTypeObject)) {
      return absl::InvalidArgumentError(
          absl::StrCat("function '", name,
                       "' parameters: the schema must be an object schema (no 'anyOf', "
                       "'enum' or 'const' at its root)"));
    }
    g_->schemas_.push_back(*schema);
    const auto n = static_cast<uint32_t>(root.properties.size());
    const auto first = static_cast<uint32_t>(g_->points_.size());
    g_->points_.resize(g_->points_.size() + n + 1);  // P(i): properties [0, i) decided
    for (uint32_t i = 0; i <= n; ++i) {
      PDSERVE_RETURN_IF_ERROR(Parameters(name, (*schema).get(), root, first, i));
    }
    return first;
  }

  // The alternatives of point first + i: each candidate property, or the invoke's end.
  absl::Status Parameters(const std::string& name, const JsonSchema* schema, const SchemaNode& root,
                          uint32_t first, uint32_t i) {
    const auto n = static_cast<uint32_t>(root.properties.size());
    bool required_left = false;
    for (uint32_t j = i; j < n && !required_left; ++j) {
      if (alternatives_ >= kMaxToolCallAlternatives) {
        return absl::InvalidArgumentError(absl::StrCat(
            "the tool calls cannot be enforced: they need more than ", kMaxToolCallAlternatives,
            " alternatives (function '", name, "' has ", n,
            " parameters; each optional one before the next required one is an alternative "
            "after every earlier one: mark parameters required or declare fewer)"));
      }
      const SchemaProperty& p = root.properties[j];
      PDSERVE_RETURN_IF_ERROR(
          CheckName(absl::StrCat("function '", name, "' property"), p.name, dsml_));
      const std::string head =
          absl::StrCat(i == 0 ? "" : "\n", "<", dsml_, "parameter name=\"", p.name, "\" string=\"");
      const uint32_t after = first + j + 1;
      bool free = false;
      std::vector<std::string> literals;
      RawStrings(*p.value, &free, &literals);
      if (free) {
        AddAlternative(first + i, head + "true\">",
                       {Next::kRaw, NewValue({schema, nullptr, after})});
      } else {
        for (const std::string& s : literals) {
          if (s.find(dsml_) != std::string::npos) {
            return absl::InvalidArgumentError(absl::StrCat("function '", name, "' property '",
                                                           p.name,
                                                           "': an enum value holds the DSML "
                                                           "marker"));
          }
          AddAlternative(first + i, absl::StrCat(head, "true\">", s, g_->tag_),
                         {Next::kPoint, after});
        }
      }
      if (AdmitsNonString(*p.value)) {
        const auto close = static_cast<uint32_t>(g_->points_.size());
        g_->points_.emplace_back();
        AddAlternative(close, g_->tag_, {Next::kPoint, after});
        AddAlternative(first + i, head + "false\">",
                       {Next::kJson, NewValue({schema, p.value, close})});
      }
      required_left = p.required;
    }
    if (!required_left) {
      AddAlternative(first + i, absl::StrCat("\n</", dsml_, "invoke>"),
                     {Next::kPoint, kAfterInvoke});
    }
    return absl::OkStatus();
  }

  uint32_t NewValue(Value value) {
    g_->values_.push_back(value);
    return static_cast<uint32_t>(g_->values_.size() - 1);
  }
  void AddAlternative(uint32_t point, std::string text, Target target) {
    g_->points_[point].alternatives.push_back({std::move(text), target, 0});
    ++alternatives_;
  }

  // Sorts each point's alternatives, checks they are prefix-free, and computes the costs
  // (shortest completions): Costs().
  absl::Status Finish() {
    for (Point& p : g_->points_) {
      std::sort(p.alternatives.begin(), p.alternatives.end(),
                [](const Alternative& x, const Alternative& y) { return x.text < y.text; });
      for (size_t k = 0; k + 1 < p.alternatives.size(); ++k) {
        if (p.alternatives[k + 1].text.starts_with(p.alternatives[k].text)) {
          return absl::InvalidArgumentError(
              absl::StrCat("the tool calls cannot be enforced: '", p.alternatives[k].text,
                           "' is a prefix of '", p.alternatives[k + 1].text, "'"));
        }
      }
      p.cost = kCostCap;
    }
    Costs();
    return absl::OkStatus();
  }

  // The point an alternative's cost depends on (none for kDone), and the bytes it adds besides
  // that point's cost.
  std::pair<std::optional<uint32_t>, int64_t> Dependency(const Alternative& alt) const {
    const auto text = static_cast<int64_t>(alt.text.size());
    switch (alt.target.next) {
      case Next::kDone:
        return {std::nullopt, text};
      case Next::kPoint:
        return {alt.target.id, text};
      case Next::kRaw:
        return {g_->values_[alt.target.id].next, Add(text, static_cast<int64_t>(g_->tag_.size()))};
      default: {
        const Value& v = g_->values_[alt.target.id];
        return {v.next, Add(text, v.node->min_bytes)};
      }
    }
  }

  // Every point's shortest completion: shortest paths to the end over the alternatives (every
  // alternative adds bytes), by Dijkstra from the alternatives that end the answer. A
  // relaxation sweep in point order needed a sweep per point of a parameter chain (cubic).
  void Costs() {
    std::vector<std::vector<std::pair<uint32_t, int64_t>>> waiting(g_->points_.size());
    using Entry = std::pair<int64_t, uint32_t>;  // (cost, point)
    std::priority_queue<Entry, std::vector<Entry>, std::greater<>> queue;
    for (uint32_t p = 0; p < g_->points_.size(); ++p) {
      for (const Alternative& alt : g_->points_[p].alternatives) {
        const auto [on, bytes] = Dependency(alt);
        if (on) {
          waiting[*on].push_back({p, bytes});
        } else if (bytes < g_->points_[p].cost) {
          g_->points_[p].cost = bytes;
          queue.push({bytes, p});
        }
      }
    }
    while (!queue.empty()) {
      const auto [cost, q] = queue.top();
      queue.pop();
      if (cost != g_->points_[q].cost) continue;  // superseded
      for (const auto& [p, bytes] : waiting[q]) {
        const int64_t through = Add(bytes, cost);
        if (through < g_->points_[p].cost) {
          g_->points_[p].cost = through;
          queue.push({through, p});
        }
      }
    }
    for (Point& p : g_->points_) {
      for (Alternative& alt : p.alternatives) {
        alt.total = Add(static_cast<int64_t>(alt.text.size()), TargetCost(alt.target));
      }
    }
  }

  int64_t TargetCost(Target target) const {
    switch (target.next) {
      case Next::kDone:
        return 0;
      case Next::kPoint:
        return g_->points_[target.id].cost;
      case Next::kRaw:
        return Add(static_cast<int64_t>(g_->tag_.size()),
                   g_->points_[g_->values_[target.id].next].cost);
      default: {
        const Value& v = g_->values_[target.id];
        return Add(v.node->min_bytes, g_->points_[v.next].cost);
      }
    }
  }

  ToolCallGrammar* g_;
  std::string dsml_;
  std::set<std::string> names_;
  size_t alternatives_ = 0;  // added so far (kMaxToolCallAlternatives)
};

std::string ToolCallGrammar::Spec(std::string_view dsml, bool parallel,
                                  std::span<const ordered_json> functions) {
  ordered_json spec = {{"dsml", dsml}, {"parallel", parallel}, {"tools", ordered_json::array()}};
  for (const ordered_json& f : functions) {
    ordered_json tool = {{"name", f.value("name", "")}};
    if (f.contains("parameters")) tool["parameters"] = f["parameters"];
    spec["tools"].push_back(std::move(tool));
  }
  return spec.dump();
}

absl::StatusOr<std::shared_ptr<const ToolCallGrammar>> ToolCallGrammar::Parse(
    std::string_view spec_text) {
  PDSERVE_RETURN_IF_ERROR(CheckJsonDepth(spec_text, "the tool-call grammar spec"));
  const ordered_json spec = ParseOrderedJson(spec_text);
  if (!spec.is_object() || !spec.contains("dsml") || !spec["dsml"].is_string() ||
      spec["dsml"].get<std::string>().empty() || !spec.contains("tools") ||
      !spec["tools"].is_array() || spec["tools"].empty() ||
      (spec.contains("parallel") && !spec["parallel"].is_boolean())) {
    return absl::InvalidArgumentError(
        "a tool-call grammar is {\"dsml\": marker, \"parallel\": bool, \"tools\": [...]} with at "
        "least one tool");
  }
  for (const ordered_json& tool : spec["tools"]) {
    if (!tool.is_object() || !tool.contains("name") || !tool["name"].is_string()) {
      return absl::InvalidArgumentError("each tool of a tool-call grammar needs a string 'name'");
    }
  }
  std::shared_ptr<ToolCallGrammar> g(new ToolCallGrammar());
  Builder builder(g.get(), spec["dsml"].get<std::string>());
  PDSERVE_RETURN_IF_ERROR(builder.Run(spec));
  return std::shared_ptr<const ToolCallGrammar>(std::move(g));
}

MatcherState ToolCallGrammar::Start() const {
  MatcherState state;
  state.frames.push_back(Wrapper(kAlternative, kStart));
  state.ends.push_back(1);
  return state;
}

void ToolCallGrammar::Enter(Target target, MatcherState* out) const {
  switch (target.next) {
    case Next::kDone: {
      const Frame w = Wrapper(kDone, 0);
      return Emit({&w, 1}, out);
    }
    case Next::kPoint: {
      const Frame w = Wrapper(kAlternative, target.id);
      return Emit({&w, 1}, out);
    }
    case Next::kRaw: {
      const Frame w = Wrapper(kRaw, target.id, 0, Utf8().Pack());
      return Emit({&w, 1}, out);
    }
    default: {
      const Frame stack[2] = {Wrapper(kJson, target.id),
                              JsonDocumentFrame(*values_[target.id].node)};
      return Emit(stack, out);
    }
  }
}

void ToolCallGrammar::StepAlternative(const Frame& w, uint8_t byte, MatcherState* out) const {
  const std::vector<Alternative>& alts = points_[w.index].alternatives;
  const std::string_view read = std::string_view(alts[w.a].text).substr(0, w.b);
  for (size_t k = w.a; k < alts.size() && alts[k].text.starts_with(read); ++k) {
    const std::string& text = alts[k].text;
    if (text.size() <= w.b || static_cast<uint8_t>(text[w.b]) != byte) continue;
    if (w.b + 1 == text.size()) return Enter(alts[k].target, out);
    const Frame next = Wrapper(kAlternative, w.index, static_cast<uint32_t>(k), w.b + 1);
    return Emit({&next, 1}, out);
  }
}

void ToolCallGrammar::StepRaw(const Frame& w, uint8_t byte, MatcherState* out) const {
  const uint32_t committed = static_cast<uint32_t>(2 + forbidden_.size());  // "</" + character
  uint32_t k = w.a;
  if (k >= committed) {  // inside the closing tag
    if (static_cast<uint8_t>(tag_[k]) != byte) return;
    if (k + 1 == tag_.size()) return Enter({Next::kPoint, values_[w.index].next}, out);
    const Frame next = Wrapper(kRaw, w.index, k + 1, w.b);
    return Emit({&next, 1}, out);
  }
  Utf8 utf8 = Utf8::Of(w.b);
  const bool starts = utf8.need == 0;
  if (!utf8.Read(byte)) return;
  const auto f = [&](uint32_t i) { return static_cast<uint8_t>(forbidden_[i]); };
  utf8.match =
      (starts ? byte == f(0) : utf8.match > 0 && byte == f(utf8.match)) ? utf8.match + 1 : 0;
  k = static_cast<uint8_t>(tag_[k]) == byte ? k + 1 : (byte == '<' ? 1 : 0);
  if (utf8.need == 0 && utf8.match == forbidden_.size()) {
    if (k != committed) return;  // the forbidden character outside the closing tag
    utf8.match = 0;
  }
  const Frame next = Wrapper(kRaw, w.index, k, utf8.Pack());
  Emit({&next, 1}, out);
}

bool ToolCallGrammar::Step(const MatcherState& in, uint8_t byte, MatcherState* out) const {
  out->Clear();
  size_t begin = 0;
  for (uint16_t end : in.ends) {
    const std::span<const Frame> stack =
        std::span<const Frame>(in.frames).subspan(begin, end - begin);
    begin = end;
    const Frame& w = stack[0];
    switch (w.phase) {
      case kAlternative:
        StepAlternative(w, byte, out);
        break;
      case kRaw:
        StepRaw(w, byte, out);
        break;
      case kJson: {
        // a: the bytes of the forbidden character just read (never all of it: inside a JSON
        // string it would let the value hold the closing tag).
        const Value& v = values_[w.index];
        const auto f = [&](uint32_t i) { return static_cast<uint8_t>(forbidden_[i]); };
        Frame next = w;
        next.a = byte == f(w.a) ? w.a + 1 : (byte == f(0) ? 1 : 0);
        if (next.a < forbidden_.size()) {
          StepJsonStack(*v.schema, {&next, 1}, stack.subspan(1), byte, out,
                        [this](std::span<const Frame> s) { return StackCost(s); });
        }
        if (JsonStackCompletionBytes(stack.subspan(1)) == 0) {
          StepAlternative(Wrapper(kAlternative, v.next), byte, out);
        }
        break;
      }
      default:  // kDone: only the end may follow
        break;
    }
  }
  DeduplicateStacks(out);
  return !out->empty();
}

int64_t ToolCallGrammar::StackCost(std::span<const Frame> stack) const {
  const Frame& w = stack[0];
  switch (w.phase) {
    case kAlternative: {
      const std::vector<Alternative>& alts = points_[w.index].alternatives;
      const std::string_view read = std::string_view(alts[w.a].text).substr(0, w.b);
      int64_t best = kCostCap;
      for (size_t k = w.a; k < alts.size() && alts[k].text.starts_with(read); ++k) {
        best = std::min(best, alts[k].total - w.b);
      }
      return best;
    }
    case kRaw: {
      const int64_t tag = static_cast<int64_t>(tag_.size());
      const int64_t close = w.a > 0 ? tag - w.a : Utf8::Of(w.b).need + tag;
      return Add(close, points_[values_[w.index].next].cost);
    }
    case kJson:
      return Add(JsonStackCompletionBytes(stack.subspan(1)), points_[values_[w.index].next].cost);
    default:
      return 0;
  }
}

int64_t ToolCallGrammar::MinCompletionBytes(const MatcherState& state) const {
  int64_t best = std::numeric_limits<int64_t>::max();
  size_t begin = 0;
  for (uint16_t end : state.ends) {
    best =
        std::min(best, StackCost(std::span<const Frame>(state.frames).subspan(begin, end - begin)));
    begin = end;
  }
  return best;
}

}  // namespace pdserve::structured
