// The router service test fixture: the router against in-process fake workers
// (tests/router/fake_workers.h), with a sink that records what a client would see.
#pragma once

#include <gtest/gtest.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/synchronization/notification.h"
#include "router/service.h"
#include "tests/router/fake_workers.h"

namespace pdserve::router::testing {

class CollectingSink : public frontend::GenerationSink {
 public:
  void OnDelta(frontend::ChoiceDelta delta) override {
    absl::MutexLock lock(&mu);
    if (static_cast<size_t>(delta.index) >= text.size()) {
      text.resize(delta.index + 1);
      finish.resize(delta.index + 1);
      logprobs.resize(delta.index + 1);
      kinds.resize(delta.index + 1);
    }
    kinds[delta.index].push_back(delta.degeneration_kind.value_or(""));
    text[delta.index] += delta.text;
    for (auto& lp : delta.logprobs) logprobs[delta.index].push_back(lp);
    if (delta.finish_reason) finish[delta.index] = *delta.finish_reason;
  }
  void OnComplete(frontend::Usage u) override {
    usage = u;
    done.Notify();
  }
  void OnError(frontend::ApiError e) override {
    error = e;
    failed = true;
    done.Notify();
  }
  absl::Mutex mu;
  std::vector<std::string> text;
  std::vector<std::string> finish;
  std::vector<std::vector<frontend::TokenLogprob>> logprobs;
  std::vector<std::vector<std::string>> kinds;  // per choice, per delta: degeneration_kind or ""
  frontend::Usage usage;
  frontend::ApiError error;
  bool failed = false;
  absl::Notification done;
};

// Polls `done` (calls that end asynchronously: a stream's last event reaches the client before the
// stream's own end); gives up after 10 s.
template <typename F>
bool Eventually(F done) {
  for (int i = 0; i < 2000; ++i) {
    if (done()) return true;
    absl::SleepFor(absl::Milliseconds(5));
  }
  return done();
}

inline config::WorkerConfig WorkerAt(const std::string& name, int port) {
  config::WorkerConfig w;
  w.name = name;
  w.host = "127.0.0.1";
  w.port = port;
  w.backend = "cpu";
  return w;
}

class RouterServiceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    testing::KeepCallbackQueueAlive();
    for (int i = 0; i < 2; ++i) {
      decode_.push_back(std::make_unique<FakeDecode>());
      decode_servers_.push_back(std::make_unique<FakeServer>(decode_.back().get()));
    }
    prefill_ = std::make_unique<FakePrefill>();
    prefill_server_ = std::make_unique<FakeServer>(prefill_.get());
  }

  // `expect_ready`: the first checks leave a prefill and a decode worker up.
  std::unique_ptr<RouterService> MakeService(int decode_workers = 1,
                                             PolicyKind decode_policy = PolicyKind::kRoundRobin,
                                             bool expect_ready = true) {
    RouterOptions options;
    options.model_dir = PDSERVE_BUNDLED_MODEL;
    options.served_name = "tiny";
    options.prefill = {WorkerAt("p0", prefill_server_->port())};
    for (int i = 0; i < decode_workers; ++i) {
      options.decode.push_back(WorkerAt("d" + std::to_string(i), decode_servers_[i]->port()));
    }
    options.decode_policy = decode_policy;
    if (second_prefill_) options.prefill.push_back(WorkerAt("p1", second_prefill_server_->port()));
    options.prefill_policy = prefill_policy_;
    if (prefill_timeout_) options.prefill_timeout = *prefill_timeout_;
    if (reserve_timeout_) options.reserve_timeout = *reserve_timeout_;
    if (queue_timeout_) options.queue_timeout = *queue_timeout_;
    if (max_prefills_per_worker_) options.max_prefills_per_worker = *max_prefills_per_worker_;
    options.canary = canary_timeout_.has_value();
    if (canary_timeout_) options.canary_timeout = *canary_timeout_;
    if (stall_timeout_) options.stall_timeout = *stall_timeout_;
    options.background_checks = false;  // checks run from the test
    auto service = RouterService::Create(options);
    EXPECT_TRUE(service.ok()) << service.status();
    (*service)->pool().CheckAll();
    if (expect_ready) {
      EXPECT_TRUE((*service)->Ready());
    }
    return std::move(*service);
  }

  // A prefill worker with queued work whose canaries outlast their 150 ms and that sends
  // nothing (a long prompt's forward runs), whose other Stats progress the test set, stays up
  // through three checks.
  void ExpectBusyPrefillStaysUp() {
    prefill_->delay_ms = 400;
    prefill_->stats_waiting = 3;
    prefill_->stats_bytes_per_call = 0;
    canary_timeout_ = absl::Milliseconds(150);
    auto service = MakeService();
    for (int i = 0; i < 3; ++i) service->pool().CheckAll();
    EXPECT_TRUE(service->pool().prefill()[0]->up());
  }

  // Runs `req` to completion.
  std::shared_ptr<CollectingSink> Run(RouterService& service, const frontend::ApiRequest& req) {
    auto sink = std::make_shared<CollectingSink>();
    frontend::StartResult started = service.Start(req, sink);
    if (auto* error = std::get_if<frontend::ApiError>(&started)) {
      sink->OnError(*error);
      return sink;
    }
    sink->done.WaitForNotification();
    return sink;
  }

  static frontend::ApiRequest Completion(std::vector<int32_t> prompt, int max_tokens) {
    frontend::ApiRequest req;
    req.model = "tiny";
    req.prompt_tokens = std::move(prompt);
    req.max_tokens = max_tokens;
    req.seed = 42;
    return req;
  }

  std::string Decode(const RouterService& service, const std::vector<int32_t>& ids) {
    return *service.preparer().tokenizer().Decode(ids);
  }

  std::vector<std::unique_ptr<FakeDecode>> decode_;
  std::vector<std::unique_ptr<FakeServer>> decode_servers_;
  std::unique_ptr<FakePrefill> prefill_;
  std::unique_ptr<FakeServer> prefill_server_;
  // Set before MakeService: a second prefill worker "p1" / another Prefill deadline.
  std::unique_ptr<FakePrefill> second_prefill_;
  std::unique_ptr<FakeServer> second_prefill_server_;
  std::optional<absl::Duration> prefill_timeout_;
  std::optional<absl::Duration> reserve_timeout_;
  std::optional<absl::Duration> queue_timeout_;
  std::optional<int64_t> max_prefills_per_worker_;
  PolicyKind prefill_policy_ = PolicyKind::kRoundRobin;
  std::optional<absl::Duration> canary_timeout_;
  std::optional<absl::Duration> stall_timeout_;  // set: canaries on, with this deadline

  void AddSecondPrefill() {
    second_prefill_ = std::make_unique<FakePrefill>();
    second_prefill_server_ = std::make_unique<FakeServer>(second_prefill_.get());
  }
};

}  // namespace pdserve::router::testing
