#include "frontend/api_request.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <set>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "common/json_depth.h"
#include "common/json_parse_failure.h"
#include "common/ordered_json.h"
#include "frontend/chat_history.h"
#include "frontend/response_format.h"
#include "frontend/tool_request.h"
#include "nlohmann/json.hpp"
#include "spdlog/spdlog.h"

namespace pdserve::frontend {
namespace {

using json = nlohmann::json;

constexpr int kMaxN = 128;
constexpr int kMaxTopLogprobs = 20;
constexpr size_t kMaxStopStrings = 4;
// Longest stop string, in bytes: text that may still become a stop string is held back and
// matched against every prefix of each stop string after every token (O(length^2) each), so an
// unbounded stop string let one request make its detokenization arbitrarily slow.
constexpr size_t kMaxStopBytes = 512;

// Logs an ignored field the first time its name is seen (at most kMaxLoggedFields names are
// remembered, so that bodies full of random keys cannot grow the set without bound).
void LogIgnoredOnce(const std::string& name) {
  constexpr size_t kMaxLoggedFields = 256;
  constexpr size_t kMaxShownBytes = 64;
  static absl::Mutex mutex(absl::kConstInit);
  static auto* seen ABSL_GUARDED_BY(mutex) = new absl::flat_hash_set<std::string>();
  {
    absl::MutexLock lock(&mutex);
    if (seen->size() >= kMaxLoggedFields || !seen->insert(name).second) return;
  }
  // The name as a JSON string (quoted, control characters escaped).
  spdlog::warn("ignoring unknown request field {} (logged once per field name)",
               nlohmann::json(name.substr(0, kMaxShownBytes))
                   .dump(-1, ' ', false, nlohmann::json::error_handler_t::replace));
}

// A logit_bias key as clients write a token id: decimal digits without sign, spaces or leading
// zeros, in int32 range (absl::SimpleAtoi alone also took "+5" and " 5").
bool ReadTokenIdKey(const std::string& key, int32_t* token) {
  if (key.empty() || (key.size() > 1 && key[0] == '0')) return false;
  for (char c : key) {
    if (c < '0' || c > '9') return false;
  }
  return absl::SimpleAtoi(key, token);
}

// obj[key] when it is a string, else "" (never throws, unlike json::value()).
std::string StringField(const json& obj, const char* key) {
  auto it = obj.find(key);
  return it != obj.end() && it->is_string() ? it->get<std::string>() : std::string();
}

// Reads typed, range-checked fields out of one JSON object; the first error wins and later
// reads become no-ops, so call sites read linearly.
class FieldReader {
 public:
  explicit FieldReader(const json& obj) : obj_(obj) {}

  bool ok() const { return !error_.has_value(); }
  ApiError error() const { return *error_; }
  void Fail(std::string message, std::string param) {
    if (ok()) error_ = InvalidRequest(std::move(message), std::move(param));
  }

  // The field's value, or nullptr when absent or JSON null. Marks the key as known.
  const json* Get(const std::string& key) {
    known_.insert(key);
    auto it = obj_.find(key);
    if (it == obj_.end() || it->is_null()) return nullptr;
    return &*it;
  }

  void Number(const std::string& key, double lo, double hi, bool lo_open,
              std::optional<double>* out) {
    const json* v = Get(key);
    if (!v || !ok()) return;
    if (!v->is_number()) return Fail(absl::StrCat("'", key, "' must be a number"), key);
    const double d = v->get<double>();
    if (!std::isfinite(d) || d < lo || d > hi || (lo_open && d == lo)) {
      return Fail(absl::StrCat("'", key, "' must be ", lo_open ? "> " : ">= ", lo, " and <= ", hi,
                               ", got ", d),
                  key);
    }
    *out = d;
  }

  // An integer: a JSON integer, or a number without a fractional part however it is written
  // (5.0, 1e10), as JSON Schema's "integer" counts it; OpenAI's reference says only "integer".
  // Out of [lo, hi] names the range whatever the spelling, so 1e10 reads as 10000000000 does.
  void Integer(const std::string& key, int64_t lo, int64_t hi, std::optional<int64_t>* out) {
    const json* v = Get(key);
    if (!v || !ok()) return;
    auto out_of_range = [&](const std::string& got) {
      Fail(absl::StrCat("'", key, "' must be between ", lo, " and ", hi, ", got ", got), key);
    };
    const bool integral_float = v->is_number_float() && std::isfinite(v->get<double>()) &&
                                v->get<double>() == std::trunc(v->get<double>());
    if (!v->is_number_integer() && !integral_float) {
      return Fail(absl::StrCat("'", key, "' must be an integer"), key);
    }
    if (integral_float) {
      const double d = v->get<double>();
      // The bounds of int64 first, so that the cast below is defined.
      if (d < -0x1p63 || d >= 0x1p63) {  // digits up to 1e21 (as JavaScript writes numbers)
        return out_of_range(absl::StrFormat(std::fabs(d) < 1e21 ? "%.0f" : "%g", d));
      }
      if (static_cast<int64_t>(d) < lo || static_cast<int64_t>(d) > hi) {
        return out_of_range(absl::StrCat(static_cast<int64_t>(d)));  // -0.0 reads as 0
      }
      *out = static_cast<int64_t>(d);
      return;
    }
    if (v->is_number_unsigned() && v->get<uint64_t>() > static_cast<uint64_t>(hi)) {
      return out_of_range(absl::StrCat(v->get<uint64_t>()));
    }
    const int64_t i = v->get<int64_t>();
    if (i < lo || i > hi) return out_of_range(absl::StrCat(i));
    *out = i;
  }

  void Bool(const std::string& key, bool* out) {
    const json* v = Get(key);
    if (!v || !ok()) return;
    if (!v->is_boolean()) return Fail(absl::StrCat("'", key, "' must be a boolean"), key);
    *out = v->get<bool>();
  }

  void String(const std::string& key, std::string* out) {
    const json* v = Get(key);
    if (!v || !ok()) return;
    if (!v->is_string()) return Fail(absl::StrCat("'", key, "' must be a string"), key);
    *out = v->get<std::string>();
  }

  // Fields no Get() asked for are ignored and logged once per name (prefixed with `where`, e.g.
  // "messages[]."), as vLLM does: SDKs add fields faster than servers learn them. Call after
  // every Get().
  void IgnoreUnknown(const std::string& where = "") {
    if (!ok()) return;
    for (auto it = obj_.begin(); it != obj_.end(); ++it) {
      if (!known_.count(it.key())) LogIgnoredOnce(where + it.key());
    }
  }

  // A field that asks for what pdserve cannot do: 400 naming it when present (not null).
  void Unsupported(const std::string& key, const std::string& what) {
    if (Get(key) && ok()) Fail(absl::StrCat("'", key, "' is not supported: ", what), key);
  }

 private:
  const json& obj_;
  std::set<std::string> known_;
  std::optional<ApiError> error_;
};

void ReadStop(FieldReader& r, ApiRequest& req) {
  const json* v = r.Get("stop");
  if (!v || !r.ok()) return;
  if (v->is_string()) {
    req.stop.push_back(v->get<std::string>());
  } else if (v->is_array()) {
    if (v->size() > kMaxStopStrings) {
      return r.Fail(absl::StrCat("'stop' may hold at most ", kMaxStopStrings, " strings"), "stop");
    }
    for (const auto& s : *v) {
      if (!s.is_string()) return r.Fail("'stop' must be a string or an array of strings", "stop");
      req.stop.push_back(s.get<std::string>());
    }
  } else {
    return r.Fail("'stop' must be a string or an array of strings", "stop");
  }
  for (const auto& s : req.stop) {
    if (s.empty()) return r.Fail("'stop' strings must not be empty", "stop");
    if (s.size() > kMaxStopBytes) {
      return r.Fail(absl::StrCat("'stop' strings may be at most ", kMaxStopBytes,
                                 " bytes long, got ", s.size()),
                    "stop");
    }
  }
}

// A token id in a JSON array: a non-negative integer that fits int32, written as an integer or
// as a number without a fractional part (5.0, 1e3), as the integer fields read them.
std::optional<int32_t> TokenId(const json& t) {
  double value = 0;
  if (t.is_number_unsigned()) {
    if (t.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int32_t>::max())) {
      return std::nullopt;
    }
    return static_cast<int32_t>(t.get<uint64_t>());
  }
  if (t.is_number_integer()) {
    value = static_cast<double>(t.get<int64_t>());
  } else if (t.is_number_float() && std::isfinite(t.get<double>()) &&
             t.get<double>() == std::trunc(t.get<double>())) {
    value = t.get<double>();
  } else {
    return std::nullopt;
  }
  if (value < 0 || value > std::numeric_limits<int32_t>::max()) return std::nullopt;
  return static_cast<int32_t>(value);
}

void ReadTokenList(FieldReader& r, const std::string& key, std::vector<int32_t>* out) {
  const json* v = r.Get(key);
  if (!v || !r.ok()) return;
  if (!v->is_array()) return r.Fail(absl::StrCat("'", key, "' must be an array of integers"), key);
  for (const auto& t : *v) {
    const std::optional<int32_t> id = TokenId(t);
    if (!id) return r.Fail(absl::StrCat("'", key, "' must hold non-negative token ids"), key);
    out->push_back(*id);
  }
}

void ReadLogitBias(FieldReader& r, ApiRequest& req) {
  const json* v = r.Get("logit_bias");
  if (!v || !r.ok()) return;
  if (!v->is_object()) return r.Fail("'logit_bias' must be an object", "logit_bias");
  for (auto it = v->begin(); it != v->end(); ++it) {
    int32_t token = 0;
    if (!ReadTokenIdKey(it.key(), &token)) {
      return r.Fail(absl::StrCat("'logit_bias' key '", it.key(), "' is not a token id"),
                    "logit_bias");
    }
    if (!it->is_number() || it->get<double>() < -100 || it->get<double>() > 100) {
      return r.Fail("'logit_bias' values must be numbers between -100 and 100", "logit_bias");
    }
    req.logit_bias[token] = it->get<double>();
  }
}

void ReadCommon(FieldReader& r, ApiRequest& req) {
  r.String("model", &req.model);
  if (r.ok() && req.model.empty()) r.Fail("'model' is required", "model");
  r.Bool("stream", &req.stream);
  if (const json* so = r.Get("stream_options"); so && r.ok()) {
    if (!so->is_object()) return r.Fail("'stream_options' must be an object", "stream_options");
    if (!req.stream) return r.Fail("'stream_options' requires 'stream': true", "stream_options");
    FieldReader sr(*so);
    sr.Bool("include_usage", &req.include_usage);
    sr.IgnoreUnknown("stream_options.");
    if (!sr.ok()) return r.Fail(sr.error().message, "stream_options");
  }
  std::optional<int64_t> n;
  r.Integer("n", 1, kMaxN, &n);
  if (n) req.n = static_cast<int>(*n);
  r.Number("temperature", 0, 2, false, &req.temperature);
  r.Number("top_p", 0, 1, true, &req.top_p);
  r.Integer("top_k", -1, std::numeric_limits<int32_t>::max(), &req.top_k);
  r.Number("min_p", 0, 1, false, &req.min_p);
  r.Number("presence_penalty", -2, 2, false, &req.presence_penalty);
  r.Number("frequency_penalty", -2, 2, false, &req.frequency_penalty);
  r.Number("repetition_penalty", 0, 10, true, &req.repetition_penalty);
  r.Integer("min_tokens", 0, std::numeric_limits<int32_t>::max(), &req.min_tokens);
  std::optional<int64_t> seed;
  r.Integer("seed", std::numeric_limits<int64_t>::min(), std::numeric_limits<int64_t>::max(),
            &seed);
  if (seed) req.seed = static_cast<uint64_t>(*seed);
  ReadStop(r, req);
  ReadTokenList(r, "stop_token_ids", &req.stop_token_ids);
  ReadLogitBias(r, req);
  r.Bool("ignore_eos", &req.ignore_eos);
  r.Bool("skip_special_tokens", &req.skip_special_tokens);
  r.String("user", &req.user);
  // Accepted, and change nothing here: metadata and store (nothing is stored), service_tier.
  if (const json* metadata = r.Get("metadata"); metadata && r.ok() && !metadata->is_object()) {
    return r.Fail("'metadata' must be an object", "metadata");
  }
  bool store = false;
  r.Bool("store", &store);
  std::string service_tier;
  r.String("service_tier", &service_tier);
}

// A non-empty JSON array whose first element is a number: the prompt as token ids.
bool IsTokenIdArray(const json& p) { return p.is_array() && !p.empty() && p[0].is_number(); }

void ReadCompletionPrompt(FieldReader& r, ApiRequest& req) {
  const json* p = r.Get("prompt");
  if (!r.ok()) return;
  if (!p) return r.Fail("'prompt' is required", "prompt");
  // A batch of one (["text"] or [[ids]]: what batching clients such as lm-eval send with batch
  // size 1) is that one prompt.
  if (p->is_array() && p->size() == 1 && ((*p)[0].is_string() || IsTokenIdArray((*p)[0]))) {
    p = &(*p)[0];
  }
  if (p->is_string()) {
    req.prompt_text = p->get<std::string>();
  } else if (IsTokenIdArray(*p)) {
    std::vector<int32_t> ids;
    for (const auto& t : *p) {
      const std::optional<int32_t> id = TokenId(t);
      if (!id) return r.Fail("'prompt' token ids must be non-negative integers", "prompt");
      ids.push_back(*id);
    }
    req.prompt_tokens = std::move(ids);
  } else if (p->is_array() && p->size() > 1) {
    return r.Fail("batched prompts are not supported; send one prompt per request", "prompt");
  } else {
    return r.Fail("'prompt' must be a string or an array of token ids", "prompt");
  }
  if (req.prompt_text && req.prompt_text->empty()) {
    return r.Fail("'prompt' must not be empty", "prompt");
  }
}

void ReadCompletion(FieldReader& r, ApiRequest& req) {
  ReadCommon(r, req);
  ReadCompletionPrompt(r, req);
  r.Integer("max_tokens", 1, std::numeric_limits<int32_t>::max(), &req.max_tokens);
  if (r.ok() && !req.max_tokens) req.max_tokens = 16;  // OpenAI's completions default
  std::optional<int64_t> logprobs;
  r.Integer("logprobs", 0, kMaxTopLogprobs, &logprobs);
  if (logprobs) {
    req.logprobs = true;
    req.top_logprobs = static_cast<int>(*logprobs);
  }
  bool echo = false;
  r.Bool("echo", &echo);
  if (r.ok() && echo) r.Fail("'echo' is not supported", "echo");
  std::string suffix;
  r.String("suffix", &suffix);
  if (r.ok() && !suffix.empty()) r.Fail("'suffix' is not supported", "suffix");
  std::optional<int64_t> best_of;
  r.Integer("best_of", 1, kMaxN, &best_of);
  if (r.ok() && best_of && *best_of != req.n) {
    r.Fail("'best_of' other than 'n' is not supported", "best_of");
  }
}

// One message's content into out.content: a string, or a non-empty array of text parts (a tool
// message's parts are joined by blank lines, as encoding_dsv4.py does; others directly). Only an
// assistant message may leave it out (null). Returns the error message, naming `where`.
std::optional<std::string> ReadContent(const json* content, const std::string& where,
                                       ChatMessage& out) {
  if (content && content->is_string()) {
    out.content = content->get<std::string>();
    return std::nullopt;
  }
  if (content == nullptr) {
    if (out.role != "assistant") {
      return absl::StrCat(where, ".content must be a string or an array of text parts");
    }
    out.content_null = true;
    return std::nullopt;
  }
  if (!content->is_array()) {
    return absl::StrCat(where, ".content must be a string or an array of text parts");
  }
  if (content->empty()) return absl::StrCat(where, ".content must not be an empty array");
  const char* joiner = out.role == "tool" ? "\n\n" : "";
  for (size_t p = 0; p < content->size(); ++p) {
    const json& part = (*content)[p];
    const std::string type = part.is_object() ? StringField(part, "type") : "";
    if (!type.empty() && type != "text") {
      // image_url, input_audio, file, ...: say so plainly rather than describe the text shape.
      return absl::StrCat(where, ".content[", p, "] is a '", type.substr(0, 64),
                          "' part: this model accepts text only (parts of type \"text\")");
    }
    if (type != "text" || !part.contains("text") || !part["text"].is_string()) {
      return absl::StrCat(where, ".content[", p, "] must be {\"type\": \"text\", \"text\": ...}");
    }
    if (p > 0) out.content += joiner;
    out.content += part["text"].get<std::string>();
  }
  return std::nullopt;
}

void ReadMessages(FieldReader& r, ApiRequest& req) {
  const json* m = r.Get("messages");
  if (!r.ok()) return;
  if (!m) return r.Fail("'messages' is required", "messages");
  if (!m->is_array() || m->empty()) {
    return r.Fail("'messages' must be a non-empty array", "messages");
  }
  for (size_t i = 0; i < m->size(); ++i) {
    const json& msg = (*m)[i];
    const std::string where = absl::StrCat("messages[", i, "]");
    if (!msg.is_object()) return r.Fail(absl::StrCat(where, " must be an object"), "messages");
    FieldReader mr(msg);
    ChatMessage out;
    mr.String("role", &out.role);
    std::string name;
    mr.String("name", &name);
    const json* content = mr.Get("content");
    const json* tool_calls = mr.Get("tool_calls");
    mr.String("tool_call_id", &out.tool_call_id);
    mr.String("reasoning_content", &out.reasoning_content);
    bool prefix = false;
    mr.Bool("prefix", &prefix);
    mr.IgnoreUnknown("messages[].");
    if (!mr.ok()) return r.Fail(absl::StrCat(where, ": ", mr.error().message), "messages");
    if (out.role != "system" && out.role != "developer" && out.role != "user" &&
        out.role != "assistant" && out.role != "tool") {
      return r.Fail(
          absl::StrCat(where, ".role must be one of system, developer, user, assistant, tool"),
          "messages");
    }
    if (tool_calls && out.role == "assistant") {
      if (auto error = ReadToolCalls(*tool_calls, where, &out.tool_calls)) {
        return r.Fail(error->message, "messages");
      }
    }
    if (prefix) {
      // DeepSeek's chat prefix completion: only on the last message, an assistant message.
      if (out.role != "assistant" || i + 1 != m->size()) {
        return r.Fail(absl::StrCat(where,
                                   ": \"prefix\": true is for the last message only, an "
                                   "assistant message (the answer continues it)"),
                      "messages");
      }
      req.continue_final_message = true;
    }
    if (auto error = ReadContent(content, where, out)) return r.Fail(*error, "messages");
    req.messages.push_back(std::move(out));
  }
}

constexpr const char* kReasoningEfforts[] = {"none", "minimal", "low", "medium", "high", "max"};

// DeepSeek's own API switch: "thinking": {"type": "enabled" | "disabled"}; nullopt when absent.
// Other members (Anthropic's budget_tokens) are ignored like unknown fields.
std::optional<bool> ReadThinkingObject(FieldReader& r) {
  const json* t = r.Get("thinking");
  if (!t || !r.ok()) return std::nullopt;
  const std::string type = t->is_object() ? StringField(*t, "type") : "";
  if (type != "enabled" && type != "disabled") {
    r.Fail(R"('thinking' must be an object, {"type": "enabled"} or {"type": "disabled"})",
           "thinking");
    return std::nullopt;
  }
  FieldReader tr(*t);
  tr.Get("type");
  tr.IgnoreUnknown("thinking.");
  return type == "enabled";
}

void ReadThinking(FieldReader& r, ApiRequest& req) {
  const std::optional<bool> switched = ReadThinkingObject(r);
  std::string kwargs_key;  // the chat_template_kwargs key that set req.thinking
  if (const json* kw = r.Get("chat_template_kwargs"); kw && r.ok()) {
    if (!kw->is_object()) {
      return r.Fail("'chat_template_kwargs' must be an object", "chat_template_kwargs");
    }
    FieldReader kr(*kw);
    for (const char* key : {"thinking", "enable_thinking"}) {
      bool thinking = false;
      kr.Bool(key, &thinking);
      if (!kr.ok() || !kw->contains(key) || (*kw)[key].is_null()) continue;
      if (req.thinking && *req.thinking != thinking) {
        return r.Fail(
            "'chat_template_kwargs.thinking' and 'chat_template_kwargs.enable_thinking' disagree; "
            "send one of the two",
            "chat_template_kwargs");
      }
      req.thinking = thinking;
      kwargs_key = key;
    }
    kr.IgnoreUnknown("chat_template_kwargs.");
    if (!kr.ok()) return r.Fail(kr.error().message, "chat_template_kwargs");
  }
  if (switched && req.thinking && *switched != *req.thinking) {
    return r.Fail(absl::StrCat("'thinking' and 'chat_template_kwargs.", kwargs_key,
                               "' disagree; send one of the two"),
                  "thinking");
  }
  if (switched) req.thinking = switched;
  r.String("reasoning_effort", &req.reasoning_effort);
  if (r.ok() && !req.reasoning_effort.empty() &&
      std::find(std::begin(kReasoningEfforts), std::end(kReasoningEfforts), req.reasoning_effort) ==
          std::end(kReasoningEfforts)) {
    r.Fail(absl::StrCat("'reasoning_effort' must be one of none, minimal, low, medium, high, max; "
                        "got '",
                        req.reasoning_effort, "'"),
           "reasoning_effort");
  }
}

// vLLM's continue_final_message and add_generation_prompt (after the messages, whose last may
// carry DeepSeek's "prefix"). A new assistant turn is always opened after a user or tool message,
// so add_generation_prompt only says, as in vLLM, which of the two the client wants.
void ReadContinuation(FieldReader& r, ApiRequest& req) {
  bool continue_final = false;
  r.Bool("continue_final_message", &continue_final);
  req.continue_final_message = req.continue_final_message || continue_final;
  const json* add = r.Get("add_generation_prompt");
  if (!add || !r.ok()) return;
  if (!add->is_boolean()) {
    return r.Fail("'add_generation_prompt' must be a boolean", "add_generation_prompt");
  }
  if (add->get<bool>() && req.continue_final_message) {
    return r.Fail(
        "'add_generation_prompt' true and 'continue_final_message' true cannot be combined: the "
        "first opens a new assistant turn, the second continues the last message",
        "add_generation_prompt");
  }
  if (!add->get<bool>() && !req.continue_final_message) {
    return r.Fail(
        "'add_generation_prompt' false is only supported with 'continue_final_message' true (a "
        "prompt without a generation prompt has no answer to write)",
        "add_generation_prompt");
  }
}

void ReadChat(FieldReader& r, ApiRequest& req) {
  ReadCommon(r, req);
  ReadMessages(r, req);
  ReadContinuation(r, req);
  std::optional<int64_t> max_tokens, max_completion_tokens;
  r.Integer("max_tokens", 1, std::numeric_limits<int32_t>::max(), &max_tokens);
  r.Integer("max_completion_tokens", 1, std::numeric_limits<int32_t>::max(),
            &max_completion_tokens);
  req.max_tokens = max_completion_tokens ? max_completion_tokens : max_tokens;
  r.Bool("logprobs", &req.logprobs);
  std::optional<int64_t> top;
  r.Integer("top_logprobs", 0, kMaxTopLogprobs, &top);
  if (r.ok() && top) {
    if (!req.logprobs) return r.Fail("'top_logprobs' requires 'logprobs': true", "top_logprobs");
    req.top_logprobs = static_cast<int>(*top);
  }
  ReadThinking(r, req);
  r.Bool("parallel_tool_calls", &req.parallel_tool_calls);
  r.Unsupported("functions", "use 'tools'");
  r.Unsupported("function_call", "use 'tool_choice'");
  r.Unsupported("audio", "this server writes text only");
  r.Unsupported("prediction", "predicted outputs are not implemented");
  r.Unsupported("web_search_options", "this server does not search the web");
  if (const json* modalities = r.Get("modalities"); modalities && r.ok()) {
    if (*modalities != json::array({"text"})) {
      r.Fail("'modalities' is not supported: this server writes text only", "modalities");
    }
  }
}

// The 400 for `what` (a constrained output) in a request whose thinking is on, naming the field
// the client turned it on with: the `thinking` object (gRPC's `thinking` arrives as that too),
// chat_template_kwargs.thinking, or reasoning_effort alone.
ApiError NeedsThinkingOff(FieldReader& r, const ApiRequest& req, const std::string& what,
                          const std::string& why) {
  std::string param = "reasoning_effort";
  std::string source = absl::StrCat("'reasoning_effort' \"", req.reasoning_effort, "\"");
  if (r.Get("thinking")) {
    param = "thinking";
    source = "'thinking'";
  } else if (req.thinking) {
    param = "chat_template_kwargs";
    // The key the client sent: `thinking`, or its alias `enable_thinking`.
    std::string key = "thinking";
    if (const json* kw = r.Get("chat_template_kwargs"); kw && kw->is_object()) {
      const auto on = [kw](const char* k) {
        return kw->contains(k) && (*kw)[k].is_boolean() && (*kw)[k].get<bool>();
      };
      if (!on("thinking") && on("enable_thinking")) key = "enable_thinking";
    }
    source = absl::StrCat("'chat_template_kwargs.", key, "'");
  }
  return InvalidRequest(
      absl::StrCat(what, " needs thinking off, which ", source, " turned on", why), param);
}

// tools, then tool_choice (which may name one of them).
std::optional<ApiError> ReadChatTools(FieldReader& r, std::string_view body, ApiRequest& req) {
  if (r.Get("tools")) {
    // Parsed again keeping key order: the prompt shows each tool as the client wrote it. The
    // body's depth was checked before the first parse.
    const auto ordered = ParseOrderedJson(body);
    if (auto error = ReadTools(ordered["tools"], &req.tools)) return error;
  }
  if (const json* choice = r.Get("tool_choice")) {
    if (auto error = ReadToolChoice(*choice, req.tools, &req)) return error;
  }
  const bool forced =
      req.tool_choice == ToolChoice::kRequired || req.tool_choice == ToolChoice::kNamed;
  if (forced && ThinkingOn(req)) {
    // The call is enforced by a grammar that starts at the answer's first token (the DSML
    // tool-call block, structured/tool_call_grammar.h), which thinking mode cannot take: there the
    // answer opens with the reasoning.
    return NeedsThinkingOff(r, req, "'tool_choice' \"required\" or a named function", "");
  }
  // A stop string matched inside the constrained output would cut the JSON document or the
  // tool-call block short and still report finish_reason "stop" (found by a breaker,
  // 2026-12-04); the grammar's own end (EOS when the output is complete) ends these choices.
  if ((forced || !req.json_schema.empty()) && !req.stop.empty()) {
    return InvalidRequest(
        absl::StrCat(
            "'stop' cannot be combined with ",
            forced ? "'tool_choice' \"required\" or a named function" : "'response_format' json",
            ": the constrained output ends by itself when it is complete"),
        "stop");
  }
  return std::nullopt;
}

// The 400 for a body that did not parse. A number beyond a double is valid JSON that nlohmann
// refuses like broken grammar; it is named as such, with the field that holds it.
ApiError NotJson(std::string_view body) {
  const std::optional<JsonParseFailure> failure = FindJsonParseFailure(body);
  if (!failure) return InvalidRequest("request body is not valid JSON");
  if (failure->kind == JsonParseFailure::Kind::kNumberOutOfRange) {
    return InvalidRequest(NumberOutOfRangeMessage("", *failure), failure->top_key);
  }
  // The end of the input counts as a byte read (JsonParseFailure::byte).
  if (failure->byte > body.size()) {
    return InvalidRequest("request body is not valid JSON (it ends before the JSON value does)");
  }
  return InvalidRequest(
      absl::StrCat("request body is not valid JSON (at byte ", failure->byte, ")"));
}

}  // namespace

bool ThinkingOn(const ApiRequest& req) {
  if (req.reasoning_effort == "none") return false;
  if (req.thinking) return *req.thinking;
  return !req.reasoning_effort.empty();
}

std::string ApiError::ToJson() const {
  json j = {{"error",
             {{"message", message},
              {"type", type},
              {"param", param.empty() ? json(nullptr) : json(param)},
              {"code", code.empty() ? json(nullptr) : json(code)}}}};
  return j.dump(-1, ' ', false, json::error_handler_t::replace);
}

ApiError ServerError(int http_status, std::string message, std::string type, std::string code) {
  ApiError e;
  e.http_status = http_status;
  e.message = std::move(message);
  e.type = std::move(type);
  e.code = std::move(code);
  return e;
}

ApiError InvalidApiKey() {
  return ServerError(401,
                     "missing or invalid API key: send the header 'Authorization: Bearer <key>'",
                     "invalid_request_error", "invalid_api_key");
}

ApiError StreamStalled(int64_t idle_ms) {
  return ServerError(
      408,
      absl::StrCat("the client read none of its stream for ", idle_ms, " ms; the stream was ended"),
      "invalid_request_error", "stream_stalled");
}

ApiError StreamTooSlow(uint64_t queued_bytes) {
  return ServerError(408,
                     absl::StrCat("the client read its stream slower than it was produced: ",
                                  queued_bytes, " bytes were waiting; the stream was ended"),
                     "invalid_request_error", "stream_too_slow");
}

ApiError ShuttingDown() {
  return ServerError(503, "the server is shutting down; retry elsewhere", "server_error",
                     "shutting_down");
}

ApiError ModelNotFound(std::string_view model) {
  constexpr size_t kShown = 256;
  std::string shown(model);
  if (shown.size() > kShown) {
    size_t cut = kShown;
    while (cut > 0 && (static_cast<unsigned char>(shown[cut]) & 0xC0) == 0x80) --cut;
    shown = absl::StrCat(shown.substr(0, cut), "...");
  }
  ApiError e = InvalidRequest(absl::StrCat("The model '", shown, "' does not exist"), "model",
                              "model_not_found");
  e.http_status = 404;
  return e;
}

ApiError InvalidRequest(std::string message, std::string param, std::string code) {
  ApiError e;
  e.http_status = 400;
  e.message = std::move(message);
  e.param = std::move(param);
  e.code = std::move(code);
  return e;
}

ParsedRequest ParseRequest(Endpoint endpoint, std::string_view body, int max_depth) {
  // Before any parse: the chat fields are parsed again as ordered_json, and copying or dumping a
  // value recurses once per level (common/json_depth.h).
  if (JsonNestsDeeperThan(body, max_depth)) {
    return InvalidRequest(
        absl::StrCat("request body nests deeper than ", max_depth, " JSON levels"));
  }
  json doc = json::parse(body.begin(), body.end(), nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded()) return NotJson(body);
  if (!doc.is_object()) return InvalidRequest("request body must be a JSON object");
  ApiRequest req;
  req.endpoint = endpoint;
  FieldReader r(doc);
  if (endpoint == Endpoint::kCompletions) {
    ReadCompletion(r, req);
    // Ignoring it would answer without the format the client asked for.
    if (r.Get("response_format") != nullptr && r.ok()) {
      r.Fail(
          "'response_format' is supported on /v1/chat/completions only (a /v1/completions answer "
          "would not follow it)",
          "response_format");
    }
  } else {
    ReadChat(r, req);
    if (const json* rf = r.Get("response_format"); rf && r.ok()) {
      std::variant<std::string, ApiError> schema = ReadResponseFormat(*rf, body);
      if (auto* error = std::get_if<ApiError>(&schema)) r.Fail(error->message, error->param);
      if (auto* text = std::get_if<std::string>(&schema)) req.json_schema = std::move(*text);
      // The document's grammar starts at the answer's first token; in thinking mode the answer
      // opens with the reasoning, which then took the JSON and left `content` empty.
      if (r.ok() && !req.json_schema.empty() && ThinkingOn(req)) {
        const ApiError error = NeedsThinkingOff(
            r, req, "'response_format'", ": the JSON is enforced from the answer's first token");
        r.Fail(error.message, error.param);
      }
    }
  }
  if (r.ok() && endpoint == Endpoint::kChatCompletions) {
    if (auto error = ReadChatTools(r, body, req)) return *error;
    if (auto error = CheckChatHistory(req)) return *error;
  }
  r.IgnoreUnknown();
  if (!r.ok()) return r.error();
  return req;
}

}  // namespace pdserve::frontend
