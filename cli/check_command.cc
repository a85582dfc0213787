// `pdserve check`: the coherence harness (loadgen/coherence_check.h).
//
//   pdserve check [--endpoint http://127.0.0.1:8000] [--allow-remote] [--prompts FILE.jsonl]
//                 [--samples K] [--api chat|completions] [--model NAME] [--max-tokens N]
//                 [--temperature T] [--no-greedy] [--no-logprobs] [--seed S]
//                 [--min-content-bytes B] [--max-repeats R] [--min-span-tokens S]
//                 [--max-ngram N] [--min-distinct2 D] [--max-failing-fraction F]
//                 [--greedy-must-pass] [--json] [--output FILE]
//
// Without --prompts it uses the first of deploy/check/prompts.jsonl and kjv-prompts.jsonl (looked
// up in the current directory, next to the binary's parent (a build tree) and in
// <prefix>/share/pdserve/check) whose every prompt fits the served model's context, as
// GET /v1/models lists it ("max_model_len"): prompt bytes (at least its token count under
// byte-level BPE) + kTemplateTokens + max_tokens. Prints a table
// (or JSON with --json); exit status 0 when every prompt passes, 1 when one fails, 2 on errors,
// including prompts the server refused as longer than the model's context (said first, in one
// line on stderr: loadgen::ContextLengthSummary).
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cli/command_registry.h"
#include "common/regular_file.h"
#include "loadgen/coherence_check.h"
#include "loadgen/dataset.h"
#include "loadgen/stream_client.h"

namespace pdserve::cli {
namespace {

namespace fs = std::filesystem;

struct CheckArgs {
  std::string endpoint = "http://127.0.0.1:8000";
  bool allow_remote = false;
  std::string prompts;
  std::string api = "chat";
  bool no_greedy = false;
  bool no_logprobs = false;
  std::optional<uint64_t> seed;
  bool json = false;
  std::string output;
  loadgen::CheckOptions options;
};

int Error(const std::string& message) {
  std::fprintf(stderr, "error: %s\n", message.c_str());
  return 2;
}

// Room for the chat template's control tokens around the messages.
constexpr int64_t kTemplateTokens = 32;

std::string DefaultPromptFile(const std::string& name) {
  const fs::path relative = fs::path("deploy") / "check" / name;
  std::vector<fs::path> candidates = {relative};
  std::error_code ec;
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (!ec) {
    candidates.push_back(exe.parent_path().parent_path() / relative);
    candidates.push_back(exe.parent_path().parent_path() / "share" / "pdserve" / "check" / name);
  }
  for (const fs::path& p : candidates) {
    if (fs::exists(p, ec)) return p.string();
  }
  return relative.string();
}

// "max_model_len" of `model` in GET /v1/models; 0 when the server does not say.
int64_t ServedContextLength(const loadgen::EndpointUrl& url, const std::string& model) {
  auto body = loadgen::HttpGet(url, "/v1/models", std::chrono::milliseconds(10000));
  if (!body.ok()) return 0;
  const nlohmann::json j = nlohmann::json::parse(*body, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object() || !j.contains("data") || !j["data"].is_array()) return 0;
  for (const nlohmann::json& m : j["data"]) {
    if (m.is_object() && m.value("id", "") == model && m.contains("max_model_len") &&
        m["max_model_len"].is_number_integer()) {
      return m["max_model_len"].get<int64_t>();
    }
  }
  return 0;
}

// Whether every prompt of `prompts` surely fits a context of `context` tokens.
bool AllFit(const std::vector<loadgen::PromptItem>& prompts, int64_t context,
            int64_t default_max_tokens) {
  for (const loadgen::PromptItem& p : prompts) {
    const int64_t bytes = static_cast<int64_t>(
        p.messages.is_null() ? p.prompt.size() + p.token_ids.size() : p.messages.dump().size());
    const int64_t max_tokens = p.max_tokens > 0 ? p.max_tokens : default_max_tokens;
    if (bytes + kTemplateTokens + max_tokens > context) return false;
  }
  return true;
}

// The prompt set for a run without --prompts (see the file comment).
absl::StatusOr<std::vector<loadgen::PromptItem>> DefaultPrompts(const loadgen::CheckOptions& o) {
  const int64_t context = ServedContextLength(o.url, o.model);
  std::string tried;
  for (const char* name : {"prompts.jsonl", "kjv-prompts.jsonl"}) {
    const std::string path = DefaultPromptFile(name);
    auto prompts = loadgen::LoadPromptFile(path);
    if (!prompts.ok()) return prompts.status();
    if (context == 0 || AllFit(*prompts, context, o.default_max_tokens)) return prompts;
    tried += (tried.empty() ? "" : ", ") + path;
  }
  return absl::FailedPreconditionError(
      absl::StrCat("no default prompt set fits the model's context of ", context, " tokens (",
                   tried, "); pass --prompts"));
}

int RunCheckCommand(CheckArgs args) {
  auto url = loadgen::ParseTargetUrl(args.endpoint, args.allow_remote);
  if (!url.ok()) return Error(std::string(url.status().message()));
  loadgen::CheckOptions& o = args.options;
  o.url = *url;
  o.api = args.api == "completions" ? loadgen::Api::kCompletions : loadgen::Api::kChat;
  o.greedy_control = !args.no_greedy;
  o.logprobs = !args.no_logprobs;
  o.seed = args.seed;
  // Asked even when --model is given: an unreachable server is an error (exit 2), not a
  // coherence failure (exit 1).
  auto served = loadgen::FirstServedModel(o.url);
  if (!served.ok()) return Error(std::string(served.status().message()));
  if (o.model.empty()) o.model = *served;
  auto prompts = args.prompts.empty() ? DefaultPrompts(o) : loadgen::LoadPromptFile(args.prompts);
  if (!prompts.ok()) return Error(std::string(prompts.status().message()));
  auto report = loadgen::RunCheck(*prompts, o);
  if (!report.ok()) return Error(std::string(report.status().message()));
  const nlohmann::json json = loadgen::ToJson(*report);
  if (!args.output.empty()) {
    // Each write and the close checked: a stream buffers a small report whole and meets a full
    // disk only at its close.
    const absl::Status written = common::WriteFile(args.output, json.dump(2) + "\n", "--output");
    if (!written.ok()) return Error(std::string(written.message()));
  }
  // Said first, in one line: otherwise only each request's 400 in the report tells.
  const std::string too_long = loadgen::ContextLengthSummary(*report);
  if (!too_long.empty()) {
    std::fprintf(stderr, "error: %s; %s\n", too_long.c_str(),
                 o.model.find("kjv-v4-tiny") != std::string::npos
                     ? "for the bundled kjv-v4-tiny use --prompts deploy/check/kjv-prompts.jsonl"
                     : "use prompts made for this model, or a lower max_tokens");
  }
  std::printf("%s", args.json ? (json.dump(2) + "\n").c_str() : loadgen::ToTable(*report).c_str());
  if (!too_long.empty()) return 2;
  return report->pass ? 0 : 1;
}

const CommandRegistrar kCheck([](CLI::App& app, int* exit_code) {
  auto args = std::make_shared<CheckArgs>();
  loadgen::CheckOptions& o = args->options;
  loadgen::CheckThresholds& t = o.thresholds;
  CLI::App* cmd = app.add_subcommand(
      "check", "Coherence harness: K samples per prompt at the server's settings + greedy");
  cmd->add_option("--endpoint", args->endpoint, "Base URL (http://host:port[/v1])")
      ->capture_default_str();
  cmd->add_flag("--allow-remote", args->allow_remote, "Allow a non-loopback endpoint");
  cmd->add_option("--prompts", args->prompts,
                  "JSONL prompts (default: the first of deploy/check/prompts.jsonl and "
                  "kjv-prompts.jsonl whose prompts fit the served model's context, from the "
                  "current directory, else beside the binary's parent directory (a build tree), "
                  "else <prefix>/share/pdserve/check/); lines may carry \"thresholds\" overrides "
                  "and an \"expect\" substring");
  cmd->add_option("--samples", o.samples, "Sampled completions per prompt")
      ->check(Positive())
      ->capture_default_str();
  cmd->add_option("--api", args->api,
                  "chat, or completions: raw text prompts only (\"prompt\" lines; no chat "
                  "template is applied)")
      ->check(CLI::IsMember({"completions", "chat"}))
      ->capture_default_str();
  cmd->add_option("--model", o.model, "Model name (default: the first of GET /v1/models)");
  cmd->add_option("--max-tokens", o.default_max_tokens, "max_tokens for prompts without one")
      ->capture_default_str();
  cmd->add_option("--temperature", o.temperature,
                  "Override the sampled requests' temperature (default: server's settings)");
  cmd->add_flag("--no-greedy", args->no_greedy, "Skip the greedy (temperature 0) control");
  cmd->add_flag("--no-logprobs", args->no_logprobs,
                "Do not ask for logprobs (judge over word tokens, not server tokens)");
  cmd->add_option("--seed", args->seed, "Sample k uses seed + k (default: no seed sent)")
      ->check(NonNegative());
  cmd->add_option("--concurrency", o.concurrency, "Requests in flight")
      ->check(Positive())
      ->capture_default_str();
  cmd->add_option("--request-timeout", o.request_timeout_s, "Seconds per request")
      ->capture_default_str();
  cmd->add_option("--min-content-bytes", t.min_content_bytes, "Shorter content fails")
      ->capture_default_str();
  cmd->add_option("--max-repeats", t.max_repeats, "n-gram copies in a row that fail")
      ->capture_default_str();
  cmd->add_option("--min-span-tokens", t.min_span_tokens, "... when covering this many tokens")
      ->capture_default_str();
  cmd->add_option("--max-ngram", t.max_ngram, "Longest n-gram period looked for")
      ->capture_default_str();
  cmd->add_option("--min-distinct2", t.min_distinct2, "Lowest passing distinct-2")
      ->capture_default_str();
  cmd->add_option("--max-failing-fraction", t.max_failing_fraction,
                  "Fraction of a prompt's samples allowed to fail")
      ->capture_default_str();
  cmd->add_flag("--greedy-must-pass", t.greedy_must_pass, "A failing greedy control fails");
  cmd->add_flag("--json", args->json, "Print the report as JSON");
  cmd->add_option("--output", args->output, "Also write the JSON report to this file");
  cmd->callback([args, exit_code] { *exit_code = RunCheckCommand(*args); });
});

}  // namespace
}  // namespace pdserve::cli
