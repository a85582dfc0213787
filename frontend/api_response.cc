#include "frontend/api_response.h"

#include <algorithm>
#include <random>
#include <string_view>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "nlohmann/json.hpp"

namespace pdserve::frontend {
namespace {

// Objects keep their insertion order: the legacy completions format's top_logprobs entries are
// {token: logprob} dicts whose order is the ranking (most likely first), and the envelope keys
// come out in OpenAI's order (id, object, created, model, choices, usage).
using json = nlohmann::ordered_json;

std::string Dump(const json& j) {
  // Token text can hold a partial UTF-8 sequence; replace invalid bytes instead of throwing.
  return j.dump(-1, ' ', false, json::error_handler_t::replace);
}

json Bytes(const std::string& s) {
  json b = json::array();
  for (unsigned char c : s) b.push_back(static_cast<int>(c));
  return b;
}

bool IsChat(const ApiRequest& req) { return req.endpoint == Endpoint::kChatCompletions; }

json ChatLogprobs(const std::vector<TokenLogprob>& lps) {
  json content = json::array();
  for (const auto& lp : lps) {
    json top = json::array();
    for (size_t i = 0; i < lp.top.size(); ++i) {
      const auto& [tok, p] = lp.top[i];
      const bool raw = i < lp.top_bytes.size() && !lp.top_bytes[i].empty();
      top.push_back(
          {{"token", tok}, {"logprob", p}, {"bytes", Bytes(raw ? lp.top_bytes[i] : tok)}});
    }
    content.push_back({{"token", lp.token},
                       {"logprob", lp.logprob},
                       {"bytes", Bytes(lp.bytes.empty() ? lp.token : lp.bytes)},
                       {"top_logprobs", top}});
  }
  return {{"content", content}};
}

json CompletionLogprobs(const std::vector<TokenLogprob>& lps, size_t text_offset_start) {
  json tokens = json::array(), token_logprobs = json::array(), top = json::array(),
       offsets = json::array();
  size_t offset = text_offset_start;
  for (const auto& lp : lps) {
    tokens.push_back(lp.token);
    token_logprobs.push_back(lp.logprob);
    json alternatives = json::object();
    // Best first; two ids with the same text (partial UTF-8 pieces) keep the better logprob.
    for (const auto& [tok, p] : lp.top) {
      if (!alternatives.contains(tok)) alternatives[tok] = p;
    }
    top.push_back(alternatives);
    offsets.push_back(offset);
    offset += lp.token.size();
  }
  return {{"tokens", tokens},
          {"token_logprobs", token_logprobs},
          {"top_logprobs", top},
          {"text_offset", offsets}};
}

json ToolCalls(const std::vector<ToolCallDelta>& calls, bool stream) {
  json out = json::array();
  for (const ToolCallDelta& call : calls) {
    json j = json::object();
    if (stream) j["index"] = call.index;
    j["id"] = call.id;
    j["type"] = "function";
    j["function"] = {{"name", call.name}, {"arguments", call.arguments}};
    out.push_back(std::move(j));
  }
  return out;
}

// The chat message (whole response) or delta (stream). A message always has content (null when
// the answer is only tool calls, as OpenAI), reasoning_content in thinking mode, tool_calls when
// there are any. A delta carries only what it has; the first one has content "" when it has
// nothing else (OpenAI's opening chunk), a later one none (OpenAI's last chunk is "delta": {}):
// content "" there made SDK accumulators end a tool-call answer with content "" instead of null.
json ChatMessageJson(const ApiRequest& req, const ChoiceDelta& d, bool stream, bool first) {
  json msg = json::object();
  if (!stream || first) msg["role"] = "assistant";
  if (stream) {
    if (!d.reasoning.empty()) msg["reasoning_content"] = d.reasoning;
    if (!d.text.empty() || (first && d.reasoning.empty() && d.tool_calls.empty())) {
      msg["content"] = d.text;
    }
    if (!d.tool_calls.empty()) msg["tool_calls"] = ToolCalls(d.tool_calls, true);
    return msg;
  }
  msg["content"] = d.text.empty() && !d.tool_calls.empty() ? json(nullptr) : json(d.text);
  if (ThinkingOn(req) || !d.reasoning.empty()) msg["reasoning_content"] = d.reasoning;
  if (!d.tool_calls.empty()) msg["tool_calls"] = ToolCalls(d.tool_calls, false);
  return msg;
}

json Choice(const ApiRequest& req, const ChoiceDelta& d, bool stream, bool first,
            size_t text_offset = 0) {
  json c = {{"index", d.index}};
  if (IsChat(req)) {
    c[stream ? "delta" : "message"] = ChatMessageJson(req, d, stream, first);
    c["logprobs"] = req.logprobs ? ChatLogprobs(d.logprobs) : json(nullptr);
  } else {
    c["text"] = d.text;
    c["logprobs"] = req.logprobs ? CompletionLogprobs(d.logprobs, text_offset) : json(nullptr);
  }
  c["finish_reason"] = d.finish_reason ? json(*d.finish_reason) : json(nullptr);
  if (d.degeneration_kind) {
    c["degenerate"] = true;
    c["degeneration_kind"] = *d.degeneration_kind;
  }
  return c;
}

json Envelope(const ApiRequest& req, const ResponseMeta& meta, bool stream) {
  const char* object =
      IsChat(req) ? (stream ? "chat.completion.chunk" : "chat.completion") : "text_completion";
  return {{"id", meta.id}, {"object", object}, {"created", meta.created}, {"model", meta.model}};
}

json UsageJson(const ApiRequest& req, const Usage& u) {
  json j = {{"prompt_tokens", u.prompt_tokens},
            {"completion_tokens", u.completion_tokens},
            {"total_tokens", u.prompt_tokens + u.completion_tokens}};
  if (IsChat(req)) j["completion_tokens_details"] = {{"reasoning_tokens", u.reasoning_tokens}};
  return j;
}

// The non-streamed response written straight into one string, byte for byte what Dump() of the
// tree (FullResponseTree) gives: the bulk, the choices' logprobs, never becomes a JSON tree (a
// tree costs several times its text: 50 MB of logprobs raised the router's peak by 420 MB).
// Scalars go through Dump() of a one-value json, so escaping (and the replacement of invalid
// UTF-8) and number formats are nlohmann's own.
class ResponseWriter {
 public:
  explicit ResponseWriter(std::string& out) : out_(out) {}

  void Raw(std::string_view s) { out_.append(s); }
  void Value(const json& j) { out_ += Dump(j); }
  void String(const std::string& s) { Value(json(s)); }
  // A float as the tree stores it (a double).
  void Number(float f) { Value(json(f)); }
  void Key(std::string_view key) {
    String(std::string(key));
    out_ += ':';
  }
  void Bytes(const std::string& s) {
    out_ += '[';
    for (size_t i = 0; i < s.size(); ++i) {
      if (i > 0) out_ += ',';
      absl::StrAppend(&out_, static_cast<int>(static_cast<unsigned char>(s[i])));
    }
    out_ += ']';
  }

  // ChatLogprobs(lps) as text.
  void ChatLogprobs(const std::vector<TokenLogprob>& lps) {
    Raw(R"({"content":[)");
    for (size_t k = 0; k < lps.size(); ++k) {
      const TokenLogprob& lp = lps[k];
      if (k > 0) out_ += ',';
      Raw(R"({"token":)");
      String(lp.token);
      Raw(R"(,"logprob":)");
      Number(lp.logprob);
      Raw(R"(,"bytes":)");
      Bytes(lp.bytes.empty() ? lp.token : lp.bytes);
      Raw(R"(,"top_logprobs":[)");
      for (size_t i = 0; i < lp.top.size(); ++i) {
        const auto& [tok, p] = lp.top[i];
        const bool raw = i < lp.top_bytes.size() && !lp.top_bytes[i].empty();
        if (i > 0) out_ += ',';
        Raw(R"({"token":)");
        String(tok);
        Raw(R"(,"logprob":)");
        Number(p);
        Raw(R"(,"bytes":)");
        Bytes(raw ? lp.top_bytes[i] : tok);
        out_ += '}';
      }
      Raw("]}");
    }
    Raw("]}");
  }

  // CompletionLogprobs(lps, 0) as text.
  void CompletionLogprobs(const std::vector<TokenLogprob>& lps) {
    Raw(R"({"tokens":[)");
    for (size_t k = 0; k < lps.size(); ++k) {
      if (k > 0) out_ += ',';
      String(lps[k].token);
    }
    Raw(R"(],"token_logprobs":[)");
    for (size_t k = 0; k < lps.size(); ++k) {
      if (k > 0) out_ += ',';
      Number(lps[k].logprob);
    }
    Raw(R"(],"top_logprobs":[)");
    std::vector<const std::string*> seen;
    for (size_t k = 0; k < lps.size(); ++k) {
      if (k > 0) out_ += ',';
      out_ += '{';
      seen.clear();
      // Best first; a text seen before (partial UTF-8 pieces) keeps the better logprob.
      for (const auto& [tok, p] : lps[k].top) {
        if (std::any_of(seen.begin(), seen.end(), [&](const std::string* s) { return *s == tok; }))
          continue;
        if (!seen.empty()) out_ += ',';
        seen.push_back(&tok);
        Key(tok);
        Number(p);
      }
      out_ += '}';
    }
    Raw(R"(],"text_offset":[)");
    size_t offset = 0;
    for (size_t k = 0; k < lps.size(); ++k) {
      if (k > 0) out_ += ',';
      absl::StrAppend(&out_, offset);
      offset += lps[k].token.size();
    }
    Raw("]}");
  }

  // Choice(req, d, false, false) as text.
  void Choice(const ApiRequest& req, const ChoiceDelta& d) {
    Raw(R"({"index":)");
    absl::StrAppend(&out_, d.index);
    if (IsChat(req)) {
      Raw(R"(,"message":)");
      Value(ChatMessageJson(req, d, false, false));
      Raw(R"(,"logprobs":)");
      req.logprobs ? ChatLogprobs(d.logprobs) : Raw("null");
    } else {
      Raw(R"(,"text":)");
      String(d.text);
      Raw(R"(,"logprobs":)");
      req.logprobs ? CompletionLogprobs(d.logprobs) : Raw("null");
    }
    Raw(R"(,"finish_reason":)");
    d.finish_reason ? String(*d.finish_reason) : Raw("null");
    if (d.degeneration_kind) {
      Raw(R"(,"degenerate":true,"degeneration_kind":)");
      String(*d.degeneration_kind);
    }
    out_ += '}';
  }

 private:
  std::string& out_;
};

std::string RandomHex24() {
  thread_local std::mt19937_64 rng{std::random_device{}()};
  return absl::StrFormat("%012x%012x", rng() & 0xFFFFFFFFFFFFull, rng() & 0xFFFFFFFFFFFFull);
}

}  // namespace

std::string StreamChunk(const ApiRequest& req, const ResponseMeta& meta, const ChoiceDelta& delta,
                        bool first, size_t text_offset) {
  json j = Envelope(req, meta, true);
  j["choices"] = json::array({Choice(req, delta, true, first, text_offset)});
  if (req.include_usage) j["usage"] = nullptr;
  return absl::StrCat("data: ", Dump(j), "\n\n");
}

size_t StreamTextLength(const ChoiceDelta& delta) {
  size_t length = 0;
  for (const TokenLogprob& lp : delta.logprobs) length += lp.token.size();
  return length;
}

std::string StreamUsageChunk(const ApiRequest& req, const ResponseMeta& meta, const Usage& usage) {
  json j = Envelope(req, meta, true);
  j["choices"] = json::array();
  j["usage"] = UsageJson(req, usage);
  return absl::StrCat("data: ", Dump(j), "\n\n");
}

std::string StreamErrorEvent(const ApiError& error) {
  return absl::StrCat("data: ", error.ToJson(), "\n\n");
}

std::string FullResponse(const ApiRequest& req, const ResponseMeta& meta,
                         const std::vector<ChoiceDelta>& choices, const Usage& usage) {
  std::string out = Dump(Envelope(req, meta, false));
  out.pop_back();  // the envelope's closing brace: the choices and usage follow
  ResponseWriter w(out);
  w.Raw(R"(,"choices":[)");
  for (size_t i = 0; i < choices.size(); ++i) {
    if (i > 0) w.Raw(",");
    w.Choice(req, choices[i]);
  }
  w.Raw(R"(],"usage":)");
  w.Value(UsageJson(req, usage));
  w.Raw("}");
  return out;
}

std::string FullResponseTree(const ApiRequest& req, const ResponseMeta& meta,
                             const std::vector<ChoiceDelta>& choices, const Usage& usage) {
  json j = Envelope(req, meta, false);
  j["choices"] = json::array();
  for (const auto& c : choices) j["choices"].push_back(Choice(req, c, false, false));
  j["usage"] = UsageJson(req, usage);
  return Dump(j);
}

std::string NewResponseId(Endpoint endpoint) {
  return absl::StrCat(endpoint == Endpoint::kChatCompletions ? "chatcmpl-" : "cmpl-",
                      RandomHex24());
}

std::string NewToolCallId() { return absl::StrCat("call_", RandomHex24()); }

void AppendDelta(ChoiceDelta delta, ChoiceDelta& into) {
  into.text += delta.text;
  into.reasoning += delta.reasoning;
  for (auto& call : delta.tool_calls) into.tool_calls.push_back(std::move(call));
  for (auto& lp : delta.logprobs) into.logprobs.push_back(std::move(lp));
  if (delta.finish_reason) into.finish_reason = std::move(delta.finish_reason);
  if (delta.degeneration_kind) into.degeneration_kind = std::move(delta.degeneration_kind);
}

}  // namespace pdserve::frontend
