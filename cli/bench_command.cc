// `pdserve bench`: a load generator for any OpenAI-compatible endpoint (loadgen/runner.h).
//
//   pdserve bench [--endpoint http://127.0.0.1:8000] [--allow-remote] [--api completions|chat]
//                 [--model NAME] (--num-requests N | --duration S) [--rate R] [--concurrency C]
//                 [--prompts FILE.jsonl | --input-len L --output-len O
//                  [--shared-prefix-len P --num-prefixes G] [--token-ids]]
//                 [--slo TTFT_MS,TPOT_MS] [--json] [--output FILE] ...
//
// Prints a table (or, with --json, the summary JSON) on stdout; a progress line is drawn only
// when stdout is a terminal. Exit status 0 when at least one request completed, 1 otherwise.
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "cli/command_registry.h"
#include "common/regular_file.h"
#include "loadgen/dataset.h"
#include "loadgen/runner.h"
#include "loadgen/stats.h"
#include "loadgen/stream_client.h"

namespace pdserve::cli {
namespace {

using loadgen::Api;

struct BenchArgs {
  std::string endpoint = "http://127.0.0.1:8000";
  bool allow_remote = false;
  std::string api = "completions";
  std::string model;
  std::string prompts;
  loadgen::SyntheticOptions synthetic;
  int64_t num_requests = 0;
  double duration_s = 0;
  double rate = 0;
  int64_t concurrency = 0;
  double request_timeout_s = 600;
  double drain_timeout_s = 30;
  std::string slo;
  bool ignore_eos = true;
  std::optional<double> temperature;
  uint64_t seed = 0;
  bool json = false;
  std::string output;
};

int Fail(const std::string& message) {
  std::fprintf(stderr, "error: %s\n", message.c_str());
  return 1;
}

absl::StatusOr<loadgen::Slo> ParseSlo(const std::string& text) {
  std::vector<std::string> parts = absl::StrSplit(text, ',');
  loadgen::Slo slo;
  if (parts.size() != 2 || !absl::SimpleAtod(parts[0], &slo.ttft_ms) ||
      !absl::SimpleAtod(parts[1], &slo.tpot_ms) || slo.ttft_ms <= 0 || slo.tpot_ms <= 0) {
    return absl::InvalidArgumentError("--slo takes TTFT_MS,TPOT_MS, both positive");
  }
  return slo;
}

// The bar fills with finished requests, or with elapsed time on a --duration run.
void DrawProgress(const loadgen::Progress& p, int64_t total, double duration_s) {
  constexpr int kWidth = 30;
  double frac = total > 0 ? static_cast<double>(p.completed + p.failed) / total : 0;
  if (duration_s > 0) frac = std::max(frac, p.elapsed_s / duration_s);
  frac = std::min(frac, 1.0);
  const int filled = static_cast<int>(frac * kWidth);
  std::printf("\r[%s%s] %lld done, %lld failed, %lld in flight, %.1f s ",
              std::string(filled, '#').c_str(), std::string(kWidth - filled, ' ').c_str(),
              static_cast<long long>(p.completed), static_cast<long long>(p.failed),
              static_cast<long long>(p.in_flight), p.elapsed_s);
  std::fflush(stdout);
}

int RunBench(BenchArgs args) {
  // Checked before anything is sent (loadgen::Run refuses these too, but after the model lookup).
  if (args.num_requests <= 0 && args.duration_s <= 0) {
    return Fail("give --num-requests N or --duration SECONDS (or both): the run needs a bound");
  }
  if (args.num_requests <= 0 && args.rate <= 0 && args.concurrency <= 0) {
    return Fail("a run by --duration alone needs --rate or --concurrency");
  }
  // JSON has no NaN or infinity: such a value would go out as null, the server's default.
  if (args.temperature && !(*args.temperature >= 0 && std::isfinite(*args.temperature))) {
    return Fail(
        absl::StrCat("--temperature must be a finite number >= 0, got ", *args.temperature));
  }
  auto url = loadgen::ParseTargetUrl(args.endpoint, args.allow_remote);
  if (!url.ok()) return Fail(std::string(url.status().message()));
  std::optional<loadgen::Slo> slo;
  if (!args.slo.empty()) {
    auto parsed = ParseSlo(args.slo);
    if (!parsed.ok()) return Fail(std::string(parsed.status().message()));
    slo = *parsed;
  }
  const Api api = args.api == "chat" ? Api::kChat : Api::kCompletions;
  if (args.synthetic.token_ids && api == Api::kChat) {
    return Fail("--token-ids needs --api completions");
  }
  if (args.model.empty()) {
    auto model = loadgen::FirstServedModel(*url);
    if (!model.ok()) return Fail(std::string(model.status().message()));
    args.model = *model;
  }
  absl::StatusOr<std::vector<loadgen::PromptItem>> prompts;
  if (!args.prompts.empty()) {
    prompts = loadgen::LoadPromptFile(args.prompts);
  } else {
    args.synthetic.num_prompts =
        args.num_requests > 0 ? std::min<int64_t>(args.num_requests, 4096) : 4096;
    args.synthetic.seed = args.seed;
    prompts = loadgen::MakeSyntheticPrompts(args.synthetic);
  }
  if (!prompts.ok()) return Fail(std::string(prompts.status().message()));

  loadgen::RunOptions run;
  run.url = *url;
  loadgen::BodyOptions body{.api = api,
                            .model = args.model,
                            .default_max_tokens = args.synthetic.output_len,
                            .ignore_eos = args.ignore_eos,
                            .temperature = args.temperature};
  for (const loadgen::PromptItem& item : *prompts) {
    run.requests.push_back({loadgen::ApiPath(api), loadgen::RequestBody(item, body)});
  }
  run.rate = args.rate;
  run.max_concurrency = args.concurrency;
  run.num_requests = args.num_requests;
  run.duration_s = args.duration_s;
  run.request_timeout_s = args.request_timeout_s;
  run.drain_timeout_s = args.drain_timeout_s;
  run.seed = args.seed;
  const bool tty = isatty(STDOUT_FILENO) == 1;
  if (tty) {
    run.progress = [total = args.num_requests, duration = args.duration_s](
                       const loadgen::Progress& p) { DrawProgress(p, total, duration); };
  }
  auto result = loadgen::Run(run);
  if (tty) std::printf("\n");
  if (!result.ok()) return Fail(std::string(result.status().message()));
  const loadgen::RunSummary summary =
      loadgen::Summarize(result->samples, std::max(result->duration_s, 1e-9), slo);
  const nlohmann::json json = loadgen::ToJson(summary);
  if (!args.output.empty()) {
    // Each write and the close checked: a stream buffers a small report whole and meets a full
    // disk only at its close.
    const absl::Status written = common::WriteFile(args.output, json.dump(2) + "\n", "--output");
    if (!written.ok()) return Fail(std::string(written.message()));
  }
  std::printf("%s", args.json ? (json.dump(2) + "\n").c_str() : loadgen::ToTable(summary).c_str());
  for (const loadgen::RequestSample& s : result->samples) {
    if (!s.ok()) {
      std::fprintf(stderr, "first error (%s): %s\n", s.error_kind.c_str(),
                   s.error_detail.substr(0, 300).c_str());
      break;
    }
  }
  return summary.completed > 0 ? 0 : 1;
}

const CommandRegistrar kBench([](CLI::App& app, int* exit_code) {
  auto args = std::make_shared<BenchArgs>();
  CLI::App* cmd = app.add_subcommand("bench", "Load-test an OpenAI-compatible endpoint");
  cmd->add_option("--endpoint", args->endpoint, "Base URL (http://host:port[/v1])")
      ->capture_default_str();
  cmd->add_flag("--allow-remote", args->allow_remote, "Allow a non-loopback endpoint");
  cmd->add_option("--api", args->api, "completions or chat")
      ->check(CLI::IsMember({"completions", "chat"}))
      ->capture_default_str();
  cmd->add_option("--model", args->model, "Model name (default: the first of GET /v1/models)");
  cmd->add_option("--prompts", args->prompts,
                  "JSONL prompt file ({\"prompt\"} or {\"messages\"} per line, optional "
                  "\"max_tokens\"); default: synthetic prompts");
  cmd->add_option("--input-len", args->synthetic.input_len, "Synthetic prompt length (words)")
      ->capture_default_str();
  cmd->add_option("--output-len", args->synthetic.output_len, "max_tokens per request")
      ->capture_default_str();
  cmd->add_option("--shared-prefix-len", args->synthetic.shared_prefix_len,
                  "Leading words shared within a prefix group")
      ->capture_default_str();
  cmd->add_option("--num-prefixes", args->synthetic.num_prefixes, "Number of prefix groups")
      ->capture_default_str();
  cmd->add_flag("--token-ids", args->synthetic.token_ids,
                "Send synthetic prompts as token ids (exact lengths; completions only)");
  cmd->add_option("--token-id-max", args->synthetic.token_id_max, "Largest synthetic token id")
      ->capture_default_str();
  cmd->add_option("--num-requests", args->num_requests,
                  "Requests to send (this, --duration or both is required)");
  cmd->add_option("--duration", args->duration_s,
                  "Seconds to send requests for (this, --num-requests or both is required)");
  cmd->add_option("--rate", args->rate, "Poisson arrival rate, requests/s (0: no pacing)");
  cmd->add_option("--concurrency", args->concurrency, "Most requests in flight (0: no cap)")
      ->check(NonNegative());
  cmd->add_option("--request-timeout", args->request_timeout_s, "Seconds per request")
      ->capture_default_str();
  cmd->add_option("--drain-timeout", args->drain_timeout_s,
                  "Seconds in-flight requests may run past --duration")
      ->capture_default_str();
  cmd->add_option("--slo", args->slo, "Goodput SLO as TTFT_MS,TPOT_MS");
  // Two flags, not CLI11's "--ignore-eos,!--no-ignore-eos" (its help reads
  // "--ignore-eos,--no-ignore-eos{false}", which looks like a default of off).
  CLI::Option* ignore_eos = cmd->add_flag_function(
      "--ignore-eos", [args](int64_t) { args->ignore_eos = true; },
      "Ask for exactly max_tokens tokens (the ignore_eos extension); the default");
  cmd->add_flag_function(
         "--no-ignore-eos", [args](int64_t) { args->ignore_eos = false; },
         "Let generations stop at EOS, so they may be shorter than max_tokens")
      ->excludes(ignore_eos);
  cmd->add_option("--temperature", args->temperature, "Override the server's temperature");
  cmd->add_option("--seed", args->seed, "Seed of prompts and arrivals")
      ->check(NonNegative())
      ->capture_default_str();
  cmd->add_flag("--json", args->json, "Print the summary as JSON");
  cmd->add_option("--output", args->output, "Also write the summary JSON to this file");
  cmd->footer(
      "Required: --num-requests N or --duration S, or both (the run ends at whichever comes "
      "first);\n--duration without --num-requests also needs --rate or --concurrency.");
  cmd->callback([args, exit_code] { *exit_code = RunBench(*args); });
});

}  // namespace
}  // namespace pdserve::cli
