#include "structured/json_matcher.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

namespace pdserve::structured {
namespace {

enum Kind : uint8_t { kDocument, kObject, kArray, kString, kNumber, kLiteral };

// Phases per kind.
enum : uint8_t { kDocBefore, kDocAfter };
enum : uint8_t { kObjStart, kObjKeyStart, kObjKey, kObjColon, kObjValue, kObjAfter };
enum : uint8_t { kArrStart, kArrItemStart, kArrAfter };
enum : uint8_t { kStrChars, kStrEscape, kStrUnicode, kStrUtf8 };
enum : uint8_t {
  kNumSign,
  kNumZero,
  kNumInt,
  kNumFracStart,
  kNumFrac,
  kNumExpStart,
  kNumExpSign,
  kNumExp
};

// Stack frames at most: the document, kMaxNesting containers and a scalar inside the deepest.
constexpr size_t kMaxFrames = kMaxNesting + 3;
constexpr int64_t kCostCap = int64_t{1} << 40;

bool IsWhitespace(uint8_t b) { return b == ' ' || b == '\n' || b == '\t' || b == '\r'; }
bool IsDigit(uint8_t b) { return b >= '0' && b <= '9'; }
bool IsHex(uint8_t b) { return IsDigit(b) || (b >= 'a' && b <= 'f') || (b >= 'A' && b <= 'F'); }

bool Declared(const SchemaNode& node) { return !node.properties.empty(); }
// A required property at index >= i remains.
bool RequiredFrom(const SchemaNode& node, uint32_t i) { return node.tail[i] > 1; }
// The last property that may come next once [0, i) are decided (SchemaNode::last_candidate).
uint32_t LastCandidate(const SchemaNode& node, uint32_t i) { return node.last_candidate[i]; }
const SchemaNode& PendingValue(const Frame& f) {
  return Declared(*f.node) ? *f.node->properties[f.index - 1].value : *f.node->additional;
}

Frame Make(const SchemaNode* node, uint8_t kind, uint8_t phase) {
  Frame f;
  f.node = node;
  f.kind = kind;
  f.phase = phase;
  return f;
}

int64_t Add(int64_t a, int64_t b) { return std::min(kCostCap, a + b); }

int64_t ObjectCost(const Frame& f) {
  const SchemaNode& node = *f.node;
  if (!Declared(node)) {
    const int64_t value = node.additional ? node.additional->min_bytes : 0;
    switch (f.phase) {
      case kObjKeyStart:
        return Add(4, value);
      case kObjColon:
        return Add(2, value);
      case kObjValue:
        return Add(1, value);
      default:
        return 1;
    }
  }
  switch (f.phase) {
    case kObjStart:
      return RequiredFrom(node, 0) ? node.tail[0] - 1 : 1;
    case kObjKeyStart:
      return node.key_start_cost[f.index];
    case kObjKey: {
      int64_t best = kCostCap;
      const std::string& lead = node.properties[f.a].key;
      const uint32_t last = LastCandidate(node, f.index);
      for (uint32_t j = f.a; j <= last; ++j) {
        const std::string& key = node.properties[j].key;
        if (key.compare(0, f.b, lead, 0, f.b) == 0) best = std::min(best, node.via_key[j] - f.b);
      }
      return best;
    }
    case kObjColon:
      return Add(1 + PendingValue(f).min_bytes, node.tail[f.index]);
    case kObjValue:
      return Add(PendingValue(f).min_bytes, node.tail[f.index]);
    default:
      return node.tail[f.index];
  }
}

int64_t ArrayCost(const Frame& f) {
  const SchemaNode& node = *f.node;
  const int64_t m = node.items->min_bytes;
  const int64_t k = node.min_items;
  const int64_t i = f.index;
  switch (f.phase) {
    case kArrStart:
      return k == 0 ? 1 : Add(k * m, k);
    case kArrItemStart:
      return Add(Add(m, std::max<int64_t>(0, k - i - 1) * (m + 1)), 1);
    default:
      return Add(std::max<int64_t>(0, k - i) * (m + 1), 1);
  }
}

int64_t LiteralCost(const Frame& f) {
  const std::vector<std::string>& literals = f.node->literals;
  int64_t best = kCostCap;
  for (uint32_t j = f.a; j < f.b; ++j) {
    best = std::min<int64_t>(best, static_cast<int64_t>(literals[j].size()) - f.index);
  }
  return best;
}

int64_t FrameCost(const Frame& f) {
  switch (f.kind) {
    case kDocument:
      return f.phase == kDocBefore ? f.node->min_bytes : 0;
    case kObject:
      return ObjectCost(f);
    case kArray:
      return ArrayCost(f);
    case kString:
      switch (f.phase) {
        case kStrChars:
          return 1;
        case kStrEscape:
          return 2;
        default:
          return f.index + 1;
      }
    case kNumber:
      return f.phase == kNumZero || f.phase == kNumInt || f.phase == kNumFrac || f.phase == kNumExp
                 ? 0
                 : 1;
    default:
      return LiteralCost(f);
  }
}

// Steps single stacks, appending what each becomes to `out`.
class Stepper {
 public:
  // `stack_cost`: what a stack of `out` (below frames included) costs to complete; null: `out`
  // holds JSON stacks only (JsonStackCompletionBytes).
  Stepper(const JsonSchema& schema, std::span<const Frame> below, MatcherState* out,
          const StackCostFn* stack_cost = nullptr)
      : schema_(schema), below_(below), out_(out), stack_cost_(stack_cost) {}

  // Steps the stack frames[0, n) by `byte`.
  void Stack(const Frame* frames, size_t n, uint8_t byte) {
    Frame top = frames[n - 1];
    switch (top.kind) {
      case kDocument:
        return Document(frames, n, top, byte);
      case kObject:
        return Object(frames, n, top, byte);
      case kArray:
        return Array(frames, n, top, byte);
      case kString:
        return String(frames, n, top, byte);
      case kNumber:
        return Number(frames, n, top, byte);
      default:
        return Literal(frames, n, top, byte);
    }
  }

 private:
  // Appends frames[0, n), then `top` and `child` where given.
  void Emit(const Frame* frames, size_t n, const Frame* top, const Frame* child) {
    if (out_->ends.size() >= kMaxStacks) return KeepCheapest(frames, n, top, child);
    out_->frames.insert(out_->frames.end(), below_.begin(), below_.end());
    out_->frames.insert(out_->frames.end(), frames, frames + n);
    if (top) out_->frames.push_back(*top);
    if (child) out_->frames.push_back(*child);
    out_->ends.push_back(static_cast<uint16_t>(out_->frames.size()));
  }
  // A full state keeps the kMaxStacks that are cheapest to complete: the new stack replaces the
  // costliest kept one when it is cheaper. Dropping whichever came last lost the cheap
  // alternative of a wide anyOf (20 long consts and "z"), while the costs above it still counted
  // on it, so a document the budget fitted was cut off unfinished.
  void KeepCheapest(const Frame* frames, size_t n, const Frame* top, const Frame* child) {
    const auto cost = [this](std::span<const Frame> stack) {
      return stack_cost_ != nullptr ? (*stack_cost_)(stack) : JsonStackCompletionBytes(stack);
    };
    std::vector<Frame> stack(below_.begin(), below_.end());
    stack.insert(stack.end(), frames, frames + n);
    if (top) stack.push_back(*top);
    if (child) stack.push_back(*child);
    size_t worst = 0;
    size_t worst_begin = 0;
    int64_t worst_cost = -1;
    size_t begin = 0;
    for (size_t i = 0; i < out_->ends.size(); ++i) {
      const int64_t kept =
          cost(std::span<const Frame>(out_->frames).subspan(begin, out_->ends[i] - begin));
      if (kept > worst_cost) {
        worst = i;
        worst_begin = begin;
        worst_cost = kept;
      }
      begin = out_->ends[i];
    }
    if (cost(stack) >= worst_cost) return;
    const size_t worst_end = out_->ends[worst];
    const auto removed = static_cast<uint16_t>(worst_end - worst_begin);
    out_->frames.erase(out_->frames.begin() + static_cast<std::ptrdiff_t>(worst_begin),
                       out_->frames.begin() + static_cast<std::ptrdiff_t>(worst_end));
    out_->ends.erase(out_->ends.begin() + static_cast<std::ptrdiff_t>(worst));
    for (size_t i = worst; i < out_->ends.size(); ++i) out_->ends[i] -= removed;
    out_->frames.insert(out_->frames.end(), stack.begin(), stack.end());
    out_->ends.push_back(static_cast<uint16_t>(out_->frames.size()));
  }
  void Replace(const Frame* frames, size_t n, const Frame& top) {
    Emit(frames, n - 1, &top, nullptr);
  }
  void Pop(const Frame* frames, size_t n) { Emit(frames, n - 1, nullptr, nullptr); }
  // Whitespace at a frame that allows it; true when `byte` was whitespace (taken or refused).
  bool Whitespace(const Frame* frames, size_t n, Frame top, uint8_t byte) {
    if (!IsWhitespace(byte)) return false;
    if (top.ws < kMaxWhitespace) {
      ++top.ws;
      Replace(frames, n, top);
    }
    return true;
  }

  // The first byte of a value of `node`, below which `parent` (already in its after-value
  // phase) replaces frames[n - 1].
  void StartValue(const Frame* frames, size_t n, const Frame& parent, const SchemaNode& node,
                  uint8_t byte) {
    if (!node.any_of.empty()) {
      for (const SchemaNode* alt : node.any_of) StartValue(frames, n, parent, *alt, byte);
      return;
    }
    if (!node.literals.empty()) return StartLiteral(frames, n, parent, node, byte);
    const bool room = n + 1 < kMaxFrames;  // a container leaves room for a scalar inside it
    if (byte == '{' && (node.types & kTypeObject) && room) {
      const Frame child = Make(&node, kObject, kObjStart);
      Emit(frames, n - 1, &parent, &child);
    } else if (byte == '[' && (node.types & kTypeArray) && room) {
      const Frame child = Make(&node, kArray, kArrStart);
      Emit(frames, n - 1, &parent, &child);
    } else if (byte == '"' && (node.types & kTypeString)) {
      const Frame child = Make(&node, kString, kStrChars);
      Emit(frames, n - 1, &parent, &child);
    } else if ((byte == '-' || IsDigit(byte)) && (node.types & (kTypeNumber | kTypeInteger))) {
      Frame child = Make(&node, kNumber, byte == '-' ? kNumSign : byte == '0' ? kNumZero : kNumInt);
      child.index = 1;
      Emit(frames, n - 1, &parent, &child);
    } else if ((byte == 't' || byte == 'f') && (node.types & kTypeBoolean)) {
      StartLiteral(frames, n, parent, schema_.boolean(), byte);
    } else if (byte == 'n' && (node.types & kTypeNull)) {
      StartLiteral(frames, n, parent, schema_.null(), byte);
    }
  }

  void StartLiteral(const Frame* frames, size_t n, const Frame& parent, const SchemaNode& node,
                    uint8_t byte) {
    Frame child = Make(&node, kLiteral, 0);
    child.b = static_cast<uint32_t>(node.literals.size());
    if (!NarrowLiteral(child, byte)) return;
    Emit(frames, n - 1, &parent, LiteralDone(child) ? nullptr : &child);
  }

  // Extends the literal frame `f` by `byte`; false when no candidate continues with it.
  static bool NarrowLiteral(Frame& f, uint8_t byte) {
    const std::vector<std::string>& literals = f.node->literals;
    uint32_t lo = f.a;
    while (lo < f.b && !(literals[lo].size() > f.index &&
                         static_cast<uint8_t>(literals[lo][f.index]) == byte)) {
      ++lo;
    }
    if (lo == f.b) return false;
    uint32_t hi = lo + 1;
    while (hi < f.b && literals[hi].size() > f.index &&
           static_cast<uint8_t>(literals[hi][f.index]) == byte) {
      ++hi;
    }
    f.a = lo;
    f.b = hi;
    ++f.index;
    return true;
  }
  // Exactly one candidate is left and it is whole: nothing can follow inside the literal.
  static bool LiteralDone(const Frame& f) {
    return f.b - f.a == 1 && f.node->literals[f.a].size() == f.index;
  }

  void Document(const Frame* frames, size_t n, Frame top, uint8_t byte) {
    if (top.phase != kDocBefore || Whitespace(frames, n, top, byte)) return;
    top.phase = kDocAfter;
    top.ws = 0;
    StartValue(frames, n, top, *top.node, byte);
  }

  void BeginKey(const Frame* frames, size_t n, Frame top) {
    const SchemaNode& node = *top.node;
    top.ws = 0;
    if (!Declared(node)) {
      if (!node.additional) return;
      top.phase = kObjColon;
      const Frame key = Make(nullptr, kString, kStrChars);
      return Emit(frames, n - 1, &top, &key);
    }
    if (top.index >= node.properties.size()) return;
    top.phase = kObjKey;
    top.a = top.index;
    top.b = 1;  // the key's opening quote
    Replace(frames, n, top);
  }

  void ObjectKey(const Frame* frames, size_t n, Frame top, uint8_t byte) {
    const SchemaNode& node = *top.node;
    const std::string& lead = node.properties[top.a].key;
    const uint32_t last = LastCandidate(node, top.index);
    for (uint32_t j = top.a; j <= last; ++j) {
      const std::string& key = node.properties[j].key;
      if (key.size() > top.b && static_cast<uint8_t>(key[top.b]) == byte &&
          key.compare(0, top.b, lead, 0, top.b) == 0) {
        top.a = j;
        ++top.b;
        if (top.b == key.size()) {
          top.phase = kObjColon;
          top.index = j + 1;
        }
        return Replace(frames, n, top);
      }
    }
  }

  void Object(const Frame* frames, size_t n, Frame top, uint8_t byte) {
    const SchemaNode& node = *top.node;
    if (top.phase != kObjKey && Whitespace(frames, n, top, byte)) return;
    switch (top.phase) {
      case kObjStart:
      case kObjAfter:
        if (byte == '}' && !RequiredFrom(node, top.phase == kObjStart ? 0 : top.index)) {
          return Pop(frames, n);
        }
        if (top.phase == kObjStart && byte == '"') return BeginKey(frames, n, top);
        if (top.phase == kObjAfter && byte == ',' &&
            (Declared(node) ? top.index < node.properties.size() : node.additional != nullptr)) {
          top.phase = kObjKeyStart;
          top.ws = 0;
          return Replace(frames, n, top);
        }
        return;
      case kObjKeyStart:
        if (byte == '"') BeginKey(frames, n, top);
        return;
      case kObjKey:
        return ObjectKey(frames, n, top, byte);
      case kObjColon:
        if (byte == ':') {
          top.phase = kObjValue;
          top.ws = 0;
          Replace(frames, n, top);
        }
        return;
      default: {  // kObjValue
        const SchemaNode& value = PendingValue(top);
        top.phase = kObjAfter;
        top.ws = 0;
        return StartValue(frames, n, top, value, byte);
      }
    }
  }

  void Array(const Frame* frames, size_t n, Frame top, uint8_t byte) {
    const SchemaNode& node = *top.node;
    if (Whitespace(frames, n, top, byte)) return;
    top.ws = 0;
    if (top.phase != kArrItemStart && byte == ']') {
      if (top.index >= node.min_items) Pop(frames, n);
      return;
    }
    if (top.phase == kArrAfter) {
      if (byte == ',' && top.index < node.max_items) {
        top.phase = kArrItemStart;
        Replace(frames, n, top);
      }
      return;
    }
    if (top.index >= node.max_items) return;
    ++top.index;
    top.phase = kArrAfter;
    StartValue(frames, n, top, *node.items, byte);
  }

  void String(const Frame* frames, size_t n, Frame top, uint8_t byte) {
    switch (top.phase) {
      case kStrChars:
        if (byte == '"') return Pop(frames, n);
        if (byte == '\\') {
          top.phase = kStrEscape;
        } else if (byte < 0x20) {
          return;
        } else if (byte >= 0x80 && !StartUtf8(top, byte)) {
          return;
        }
        return Replace(frames, n, top);
      case kStrUtf8:
        if (byte < top.a || byte > top.b) return;
        top.a = 0x80;
        top.b = 0xBF;
        if (--top.index == 0) top.phase = kStrChars;
        return Replace(frames, n, top);
      case kStrEscape:
        if (byte == 'u') {
          top.phase = kStrUnicode;
          top.index = 4;
          top.a = 0;
        } else if (std::strchr("\"\\/bfnrt", byte) != nullptr && byte != 0) {
          top.phase = kStrChars;
        } else {
          return;
        }
        return Replace(frames, n, top);
      default:  // kStrUnicode: no surrogate code units (\uD800-\uDFFF)
        if (!IsHex(byte)) return;
        if (top.index == 3 && top.a == 1 && !(byte >= '0' && byte <= '7')) return;
        top.a = top.index == 4 && (byte == 'd' || byte == 'D') ? 1 : 0;
        if (--top.index == 0) top.phase = kStrChars;
        return Replace(frames, n, top);
    }
  }

  // A UTF-8 lead byte: the continuation bytes it needs and the range of the first.
  static bool StartUtf8(Frame& top, uint8_t byte) {
    uint32_t more = 0, lo = 0, hi = 0;
    if (!structured::Utf8Lead(byte, &more, &lo, &hi)) return false;
    top.phase = kStrUtf8;
    top.index = more;
    top.a = lo;
    top.b = hi;
    return true;
  }

  void Number(const Frame* frames, size_t n, Frame top, uint8_t byte) {
    const bool integer = !(top.node->types & kTypeNumber);
    auto next = [&](uint8_t phase, uint32_t digits) {
      top.phase = phase;
      top.index = digits;
      Replace(frames, n, top);
    };
    auto digit_in = [&](uint32_t limit) {
      if (top.index < limit) next(top.phase, top.index + 1);
    };
    const bool exponent = (byte == 'e' || byte == 'E') && !integer;
    switch (top.phase) {
      case kNumSign:
        if (IsDigit(byte)) next(byte == '0' ? kNumZero : kNumInt, 1);
        return;
      case kNumZero:
      case kNumInt:
        if (IsDigit(byte) && top.phase == kNumZero) return;
        if (IsDigit(byte)) return digit_in(kMaxIntegerDigits);
        if (byte == '.' && !integer) return next(kNumFracStart, 0);
        if (exponent) return next(kNumExpStart, 0);
        return Stack(frames, n - 1, byte);
      case kNumFracStart:
        if (IsDigit(byte)) next(kNumFrac, 1);
        return;
      case kNumFrac:
        if (IsDigit(byte)) return digit_in(kMaxFractionDigits);
        if (exponent) return next(kNumExpStart, 0);
        return Stack(frames, n - 1, byte);
      case kNumExpStart:
        if (byte == '+' || byte == '-') return next(kNumExpSign, 0);
        if (IsDigit(byte)) next(kNumExp, 1);
        return;
      case kNumExpSign:
        if (IsDigit(byte)) next(kNumExp, 1);
        return;
      default:  // kNumExp
        if (IsDigit(byte)) return digit_in(kMaxExponentDigits);
        return Stack(frames, n - 1, byte);
    }
  }

  void Literal(const Frame* frames, size_t n, Frame top, uint8_t byte) {
    const bool whole = top.node->literals[top.a].size() == top.index;
    if (NarrowLiteral(top, byte)) {
      return LiteralDone(top) ? Pop(frames, n) : Replace(frames, n, top);
    }
    if (whole) Stack(frames, n - 1, byte);  // the literal ended before `byte`
  }

  const JsonSchema& schema_;
  std::span<const Frame> below_;
  MatcherState* out_;
  const StackCostFn* stack_cost_;
};

}  // namespace

bool StepState(const JsonSchema& schema, const MatcherState& in, uint8_t byte, MatcherState* out) {
  out->Clear();
  Stepper stepper(schema, {}, out);
  size_t begin = 0;
  for (uint16_t end : in.ends) {
    stepper.Stack(in.frames.data() + begin, end - begin, byte);
    begin = end;
  }
  DeduplicateStacks(out);
  return !out->empty();
}

int64_t MinCompletionBytes(const MatcherState& state) {
  int64_t best = std::numeric_limits<int64_t>::max();
  size_t begin = 0;
  for (uint16_t end : state.ends) {
    best = std::min(best, JsonStackCompletionBytes(
                              std::span<const Frame>(state.frames).subspan(begin, end - begin)));
    begin = end;
  }
  return best;
}

int64_t JsonStackCompletionBytes(std::span<const Frame> stack) {
  int64_t cost = 0;
  for (const Frame& f : stack) cost = Add(cost, FrameCost(f));
  return cost;
}

Frame JsonDocumentFrame(const SchemaNode& node) { return Make(&node, kDocument, kDocBefore); }

void StepJsonStack(const JsonSchema& schema, std::span<const Frame> below,
                   std::span<const Frame> stack, uint8_t byte, MatcherState* out,
                   const StackCostFn& stack_cost) {
  Stepper stepper(schema, below, out, &stack_cost);
  stepper.Stack(stack.data(), stack.size(), byte);
}

absl::StatusOr<std::shared_ptr<const JsonGrammar>> JsonGrammar::Parse(
    std::string_view schema_text) {
  absl::StatusOr<std::shared_ptr<const JsonSchema>> schema = JsonSchema::Parse(schema_text);
  if (!schema.ok()) return schema.status();
  return std::make_shared<const JsonGrammar>(std::move(*schema));
}

MatcherState JsonGrammar::Start() const {
  MatcherState state;
  // The answer starts at the value: its whitespace allowance used up, the document frame refuses
  // leading whitespace (a response_format answer opening with "\n\n" surprises clients; inside
  // the value whitespace stays allowed). Embedded values (tool-call arguments) keep theirs.
  Frame document = JsonDocumentFrame(schema_->root());
  document.ws = kMaxWhitespace;
  state.frames.push_back(document);
  state.ends.push_back(1);
  return state;
}

}  // namespace pdserve::structured
