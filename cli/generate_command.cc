// `pdserve generate`: one request on the colocated engine, text streamed to stdout.
//
//   pdserve generate [--model DIR] --prompt TEXT [--chat] [--temperature T --top-p P --top-k K
//                    --min-p M --seed S --max-tokens N --n N --stop STR ...]
//
// The request goes through the same colocated::ColocatedService as `pdserve serve`, so its
// defaults (generation_config.json), chat formatting, stop strings and sampling are the server's.
// With --n > 1 each choice is printed after the request ends, headed by its index.
#include <cstdint>
#include <cstdio>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "cli/command_registry.h"
#include "colocated/service.h"
#include "common/status.h"

namespace pdserve::cli {
namespace {

struct GenerateOptions {
  std::string model_dir = "models/kjv-v4-tiny";
  std::string prompt;
  bool chat = false;
  std::optional<double> temperature;
  std::optional<double> top_p;
  std::optional<int64_t> top_k;
  std::optional<double> min_p;
  std::optional<uint64_t> seed;
  int64_t max_tokens = 128;
  int n = 1;
  std::vector<std::string> stop;
};

// Prints choice 0 as it streams when n == 1, else collects every choice.
class StdoutSink : public frontend::GenerationSink {
 public:
  explicit StdoutSink(bool stream) : stream_(stream) {}
  void OnDelta(frontend::ChoiceDelta delta) override {
    absl::MutexLock lock(&mu_);
    if (stream_) {
      std::fputs(delta.text.c_str(), stdout);
      std::fflush(stdout);
    } else {
      texts_[delta.index] += delta.text;
    }
    if (delta.finish_reason) finish_[delta.index] = *delta.finish_reason;
  }
  void OnComplete(frontend::Usage usage) override {
    absl::MutexLock lock(&mu_);
    usage_ = usage;
    done_.Notify();
  }
  void OnError(frontend::ApiError error) override {
    absl::MutexLock lock(&mu_);
    error_ = error.message;
    done_.Notify();
  }
  absl::Status Wait() {
    done_.WaitForNotification();
    absl::MutexLock lock(&mu_);
    if (!stream_) {
      for (const auto& [index, text] : texts_) std::printf("[%d]\n%s\n", index, text.c_str());
    } else {
      std::fputs("\n", stdout);
    }
    std::fflush(stdout);  // the text ends before the summary on stderr
    for (const auto& [index, reason] : finish_) {
      std::fprintf(stderr, "choice %d: finish_reason %s\n", index, reason.c_str());
    }
    std::fprintf(stderr, "usage: %lld prompt + %lld completion tokens\n",
                 static_cast<long long>(usage_.prompt_tokens),
                 static_cast<long long>(usage_.completion_tokens));
    return error_.empty() ? absl::OkStatus() : absl::InternalError(error_);
  }

 private:
  const bool stream_;
  absl::Mutex mu_;
  absl::Notification done_;
  std::map<int, std::string> texts_;
  std::map<int, std::string> finish_;
  frontend::Usage usage_;
  std::string error_;
};

absl::Status Generate(const GenerateOptions& options) {
  colocated::ServiceOptions service_options;
  service_options.model_dir = options.model_dir;
  service_options.max_batch = std::max(1, options.n);
  service_options.token_budget = std::max<int64_t>(512, service_options.max_batch + 1);
  service_options.model = engine::WithTestFaultsFromEnvironment({});
  if (const std::string warning = engine::TestFaultWarning(service_options.model);
      !warning.empty()) {
    std::fprintf(stderr, "pdserve generate: %s\n", warning.c_str());
  }
  PDSERVE_ASSIGN_OR_RETURN(std::unique_ptr<colocated::ColocatedService> service,
                           colocated::ColocatedService::Create(service_options));
  frontend::ApiRequest req;
  req.model = service->ModelNames().front();
  if (options.chat) {
    req.endpoint = frontend::Endpoint::kChatCompletions;
    req.messages.push_back({"user", options.prompt});
  } else {
    req.prompt_text = options.prompt;
  }
  req.temperature = options.temperature;
  req.top_p = options.top_p;
  req.top_k = options.top_k;
  req.min_p = options.min_p;
  req.seed = options.seed;
  req.max_tokens = options.max_tokens;
  req.n = options.n;
  req.stop = options.stop;
  auto sink = std::make_shared<StdoutSink>(options.n == 1);
  frontend::StartResult started = service->Start(req, sink);
  if (auto* error = std::get_if<frontend::ApiError>(&started)) {
    return absl::InvalidArgumentError(error->message);
  }
  return sink->Wait();
}

const CommandRegistrar kRegistrar([](CLI::App& app, int* exit_code) {
  auto o = std::make_shared<GenerateOptions>();
  CLI::App* cmd = app.add_subcommand("generate", "Generate text from a prompt on the CPU engine");
  cmd->add_option("--model", o->model_dir, "Hugging Face model directory")->capture_default_str();
  cmd->add_option("--prompt", o->prompt, "Prompt text")->required();
  cmd->add_flag("--chat", o->chat, "Send the prompt as a user message through the chat format");
  cmd->add_option("--temperature", o->temperature, "Default: generation_config.json, else 0.6");
  cmd->add_option("--top-p", o->top_p, "Nucleus sampling mass in (0, 1]");
  cmd->add_option("--top-k", o->top_k, "Keep the k most likely tokens (0: all)");
  cmd->add_option("--min-p", o->min_p, "Keep tokens with p >= min_p * p_max");
  cmd->add_option("--seed", o->seed, "Random seed")->check(NonNegative());
  cmd->add_option("--max-tokens", o->max_tokens, "Tokens to generate per choice")
      ->capture_default_str()
      ->check(Positive());
  cmd->add_option("--n", o->n, "Independent choices")
      ->capture_default_str()
      ->check(CLI::Range(1, 128));
  cmd->add_option("--stop", o->stop, "Stop string (repeatable)");
  cmd->callback([o, exit_code] {
    const absl::Status status = Generate(*o);
    if (!status.ok()) {
      std::fprintf(stderr, "pdserve generate: %s\n", status.ToString().c_str());
      *exit_code = 1;
    }
  });
});

}  // namespace
}  // namespace pdserve::cli
