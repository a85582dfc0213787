// A GenerationService for loadgen tests: each request's choice 0 "generates" tokens on its own
// thread with an injected delay before the first token and between tokens, so the measured
// TTFT / ITL / E2E have known true values. The token texts come from a function of the token
// index (varied words, one repeated tag, nothing at all, ...). With logprobs requested, each
// delta carries its token string.
#pragma once

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "frontend/generation_service.h"

namespace pdserve::loadgen {

class FakeTokenService : public frontend::GenerationService {
 public:
  std::chrono::milliseconds first_token_delay{0};
  std::chrono::milliseconds token_delay{0};
  // Text of token t; an empty string sends no delta for it (the token still counts in usage).
  std::function<std::string(int t)> token_text = [](int t) { return " w" + std::to_string(t); };
  int fail_after = -1;  // send an in-stream error instead of token fail_after

  ~FakeTokenService() override {
    absl::MutexLock lock(&mu_);
    for (auto& t : threads_) t.join();
  }

  std::vector<std::string> ModelNames() const override { return {"fake"}; }
  bool Ready() const override { return true; }
  std::string MetricsText() const override { return ""; }

  frontend::StartResult Start(const frontend::ApiRequest& req,
                              std::shared_ptr<frontend::GenerationSink> sink) override {
    if (req.prompt_text && *req.prompt_text == "overflow") {
      return frontend::InvalidRequest("prompt is too long", "prompt", "context_length_exceeded");
    }
    auto gen = std::make_unique<FakeGeneration>();
    std::shared_ptr<std::atomic<bool>> stop = gen->stop;
    const int tokens = static_cast<int>(req.max_tokens.value_or(8));
    const bool logprobs = req.logprobs;
    absl::MutexLock lock(&mu_);
    threads_.emplace_back([this, sink, stop, tokens, logprobs] {
      std::this_thread::sleep_for(first_token_delay);
      for (int t = 0; t < tokens; ++t) {
        if (stop->load()) return;
        if (t == fail_after) return sink->OnError({500, "worker lost", "server_error"});
        frontend::ChoiceDelta d;
        d.text = token_text(t);
        if (logprobs && !d.text.empty()) d.logprobs.push_back({d.text, -1.0f, {}});
        if (t == tokens - 1) d.finish_reason = "length";
        if (!d.text.empty() || d.finish_reason) sink->OnDelta(std::move(d));
        if (t + 1 < tokens) std::this_thread::sleep_for(token_delay);
      }
      sink->OnComplete({5, tokens});
    });
    return std::unique_ptr<frontend::Generation>(std::move(gen));
  }

 private:
  struct FakeGeneration : frontend::Generation {
    ~FakeGeneration() override { Cancel(); }
    void Cancel() override { stop->store(true); }
    std::shared_ptr<std::atomic<bool>> stop = std::make_shared<std::atomic<bool>>(false);
  };
  absl::Mutex mu_;
  std::vector<std::thread> threads_ ABSL_GUARDED_BY(mu_);
};

}  // namespace pdserve::loadgen
