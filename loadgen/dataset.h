// Prompts for `pdserve bench` and `pdserve check`, and the OpenAI request bodies built from them.
//
// Sources: synthetic prompts with set input and output lengths (optionally sharing one of a few
// common prefixes, to exercise prefix-aware routing and prefix caches) and JSONL prompt files.
// Synthetic lengths count words drawn from a fixed list of common English words (about one
// token each in byte-level BPE vocabularies), or exact token ids with `token_ids` (completions
// only: OpenAI's /v1/completions accepts a prompt given as an array of token ids).
//
// Pure functions (no I/O except LoadPromptFile); thread-safe.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"

namespace pdserve::loadgen {

enum class Api { kCompletions, kChat };
// "/v1/completions" or "/v1/chat/completions".
const char* ApiPath(Api api);

struct PromptItem {
  std::string id;                  // a name for reports ("" for synthetic prompts)
  std::string prompt;              // completions text (or a chat user message when no messages)
  std::vector<int32_t> token_ids;  // completions prompt as token ids, when non-empty
  nlohmann::json messages;         // chat messages array, or null
  int64_t max_tokens = 0;          // 0: the run's default
  nlohmann::json extra;            // any other fields of a prompt file line, kept for the caller
};

struct SyntheticOptions {
  int64_t num_prompts = 100;
  int64_t input_len = 128;        // words (or token ids) per prompt, prefix included
  int64_t output_len = 128;       // max_tokens of each request
  int64_t shared_prefix_len = 0;  // leading words shared with the other prompts of a group
  int64_t num_prefixes = 1;       // prompts are spread round-robin over this many prefixes
  bool token_ids = false;
  int32_t token_id_min = 10;  // token ids are drawn uniformly from [min, max]
  int32_t token_id_max = 4000;
  uint64_t seed = 0;
};
// Errors: InvalidArgument when lengths are negative, shared_prefix_len > input_len, or
// num_prefixes < 1.
absl::StatusOr<std::vector<PromptItem>> MakeSyntheticPrompts(const SyntheticOptions& options);

// Reads a JSONL file: one object per non-blank line with "prompt" (string) or "messages"
// (array of {role, content}), optional "id" and "max_tokens"; other keys go to `extra`.
// Errors: NotFound (unreadable file), InvalidArgument naming the line for malformed lines.
absl::StatusOr<std::vector<PromptItem>> LoadPromptFile(const std::string& path);

struct BodyOptions {
  Api api = Api::kCompletions;
  std::string model;  // omitted from the body when empty
  int64_t default_max_tokens = 128;
  bool ignore_eos = false;            // vLLM/pdserve extension: generate exactly max_tokens
  std::optional<double> temperature;  // unset: the server's default sampling settings apply
  std::optional<uint64_t> seed;
  bool logprobs = false;  // ask for per-token logprobs (token strings)
};
// The streamed request body ("stream": true with usage in the stream) for `item`.
std::string RequestBody(const PromptItem& item, const BodyOptions& options);

}  // namespace pdserve::loadgen
