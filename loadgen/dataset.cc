#include "loadgen/dataset.h"

#include <cerrno>
#include <filesystem>
#include <fstream>
#include <random>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/regular_file.h"
#include "common/status.h"

namespace pdserve::loadgen {
namespace {

using json = nlohmann::json;

constexpr const char* kWords[] = {
    "the",  "of",   "and",   "to",    "in",    "that",  "is",    "was",   "he",    "for",
    "it",   "with", "as",    "his",   "on",    "be",    "at",    "by",    "had",   "not",
    "are",  "but",  "from",  "or",    "have",  "an",    "they",  "which", "one",   "you",
    "were", "her",  "all",   "she",   "there", "would", "their", "we",    "him",   "been",
    "has",  "when", "who",   "will",  "more",  "no",    "if",    "out",   "so",    "said",
    "what", "up",   "its",   "about", "into",  "than",  "them",  "can",   "only",  "other",
    "new",  "some", "could", "time",  "these", "two",   "may",   "then",  "do",    "first",
    "any",  "my",   "now",   "such",  "like",  "our",   "over",  "man",   "me",    "even",
    "most", "made", "after", "also",  "did",   "many",  "land",  "day",   "house", "great"};
constexpr size_t kNumWords = sizeof(kWords) / sizeof(kWords[0]);

}  // namespace

const char* ApiPath(Api api) {
  return api == Api::kChat ? "/v1/chat/completions" : "/v1/completions";
}

absl::StatusOr<std::vector<PromptItem>> MakeSyntheticPrompts(const SyntheticOptions& o) {
  if (o.num_prompts < 0 || o.input_len < 0 || o.output_len < 0 || o.shared_prefix_len < 0) {
    return absl::InvalidArgumentError("synthetic lengths must be >= 0");
  }
  if (o.shared_prefix_len > o.input_len) {
    return absl::InvalidArgumentError("shared prefix is longer than the input");
  }
  if (o.num_prefixes < 1) return absl::InvalidArgumentError("num_prefixes must be >= 1");
  if (o.token_ids && o.token_id_min > o.token_id_max) {
    return absl::InvalidArgumentError("token id range is empty");
  }
  std::mt19937_64 rng(o.seed);
  std::uniform_int_distribution<size_t> word(0, kNumWords - 1);
  std::uniform_int_distribution<int32_t> id(o.token_id_min, o.token_id_max);
  auto draw = [&](int64_t n, std::vector<int32_t>* ids) {
    for (int64_t i = 0; i < n; ++i) {
      ids->push_back(o.token_ids ? id(rng) : static_cast<int32_t>(word(rng)));
    }
  };
  std::vector<std::vector<int32_t>> prefixes(o.num_prefixes);
  for (auto& p : prefixes) draw(o.shared_prefix_len, &p);
  std::vector<PromptItem> out(o.num_prompts);
  for (int64_t i = 0; i < o.num_prompts; ++i) {
    std::vector<int32_t> ids = prefixes[i % o.num_prefixes];
    draw(o.input_len - o.shared_prefix_len, &ids);
    out[i].max_tokens = o.output_len;
    if (o.token_ids) {
      out[i].token_ids = std::move(ids);
    } else {
      out[i].prompt =
          absl::StrJoin(ids, " ", [](std::string* s, int32_t w) { absl::StrAppend(s, kWords[w]); });
    }
  }
  return out;
}

absl::StatusOr<std::vector<PromptItem>> LoadPromptFile(const std::string& path) {
  PDSERVE_RETURN_IF_ERROR(common::CheckRegularFile(path, "prompt file"));
  std::ifstream in(path);
  if (!in) return common::OpenError(path, errno, "prompt file");
  std::vector<PromptItem> out;
  std::string line;
  for (int line_no = 1; std::getline(in, line); ++line_no) {
    if (absl::StripAsciiWhitespace(line).empty()) continue;
    auto bad = [&](const char* why) {
      return absl::InvalidArgumentError(absl::StrCat(path, ":", line_no, ": ", why));
    };
    json j = json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded() || !j.is_object()) return bad("not a JSON object");
    PromptItem item;
    if (auto p = j.find("prompt"); p != j.end()) {
      if (!p->is_string()) return bad("\"prompt\" must be a string");
      item.prompt = p->get<std::string>();
    } else if (auto m = j.find("messages"); m != j.end()) {
      if (!m->is_array() || m->empty()) return bad("\"messages\" must be a non-empty array");
      for (const json& msg : *m) {
        if (!msg.is_object() || !msg.contains("role") || !msg["role"].is_string() ||
            !msg.contains("content") || !msg["content"].is_string()) {
          return bad("each message needs string \"role\" and \"content\"");
        }
      }
      item.messages = *m;
    } else {
      return bad("needs \"prompt\" or \"messages\"");
    }
    if (auto id = j.find("id"); id != j.end()) {
      if (!id->is_string()) return bad("\"id\" must be a string");
      item.id = id->get<std::string>();
    } else {
      item.id = absl::StrCat("line", line_no);
    }
    if (auto mt = j.find("max_tokens"); mt != j.end()) {
      if (!mt->is_number_integer() || mt->get<int64_t>() < 1) {
        return bad("\"max_tokens\" must be a positive integer");
      }
      item.max_tokens = mt->get<int64_t>();
    }
    for (const char* key : {"prompt", "messages", "id", "max_tokens"}) j.erase(key);
    item.extra = std::move(j);
    out.push_back(std::move(item));
  }
  if (out.empty()) return absl::InvalidArgumentError(absl::StrCat(path, ": no prompts"));
  return out;
}

std::string RequestBody(const PromptItem& item, const BodyOptions& o) {
  json body = {{"stream", true},
               {"stream_options", {{"include_usage", true}}},
               {"max_tokens", item.max_tokens > 0 ? item.max_tokens : o.default_max_tokens}};
  if (!o.model.empty()) body["model"] = o.model;
  if (o.api == Api::kChat) {
    body["messages"] = item.messages.is_array()
                           ? item.messages
                           : json::array({{{"role", "user"}, {"content", item.prompt}}});
    if (o.logprobs) body["logprobs"] = true;
  } else {
    if (!item.token_ids.empty()) {
      body["prompt"] = item.token_ids;
    } else if (item.messages.is_array()) {
      // A chat prompt sent to /v1/completions: its contents, one per line.
      std::string text;
      for (const json& m : item.messages)
        absl::StrAppend(&text, m["content"].get<std::string>(), "\n");
      body["prompt"] = text;
    } else {
      body["prompt"] = item.prompt;
    }
    if (o.logprobs) body["logprobs"] = 0;
  }
  if (o.ignore_eos) body["ignore_eos"] = true;
  if (o.temperature) body["temperature"] = *o.temperature;
  if (o.seed) body["seed"] = *o.seed;
  return body.dump();
}

}  // namespace pdserve::loadgen
