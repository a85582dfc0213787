// The colocated generation service: one process holds the model, the state pool, the scheduler
// and the engine runner, and serves frontend::GenerationService (what `pdserve serve` puts behind
// frontend::HttpServer and `pdserve generate` drives directly).
//
// Start() prepares the request as frontend::RequestPreparer does (tokenization, chat template,
// generation_config.json defaults, 400 context_length_exceeded; the router shares it), and submits
// one scheduler sequence per choice (429 when the waiting queue is full, 503 when the pool is full
// and the policy rejects). A loop thread steps the scheduler over an EngineStepRunner; each token
// is detokenized incrementally with the request's stop strings held back and streamed to the sink;
// the last delta of a choice carries finish_reason ("stop", "length", "degenerate"), then
// OnComplete reports usage. Generation::Cancel ends the request: its sequences leave the scheduler
// and their pages are freed at once (or when the step in flight completes).
//
// Thread-safety: every method is thread-safe.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/clock.h"
#include "common/metrics.h"
#include "engine/model.h"
#include "frontend/generation_service.h"
#include "frontend/request_preparer.h"
#include "guards/canary.h"
#include "runtime/step_runner.h"
#include "serving/page_pool.h"
#include "serving/sampling_params.h"
#include "serving/scheduler.h"
#include "serving/state_layout.h"
#include "structured/token_vocabulary.h"
#include "text/tokenizer.h"

namespace pdserve::colocated {

struct ServiceOptions {
  std::string model_dir = "models/kjv-v4-tiny";
  int64_t max_batch = 64;  // sequences holding pages at once (scheduler max_running)
  // Tokens of state the pool holds over all sequences; 0: max_batch * max_position_embeddings.
  int64_t pool_tokens = 0;
  // The CUDA backend's paged state (GpuModelOptions::state_tokens, engine/paged_state_plan.h):
  // set, the runner's device page pools hold this many tokens of compressed state over all
  // sequences (0: every slot full, max_batch * context), and admission counts them too: the
  // scheduler's pool gets one bookkeeping kind per compression rate with the device pool's pages
  // (PagedPoolKinds) and each sequence reserves PagedRequestPages of prompt + max_tokens at
  // admission. So a request that does not fit now waits in the queue (or gets 503 with
  // policy kReject), one that could never fit gets 400 naming the pages, and a running sequence
  // never finds its device pool short. With runner_factory set, the scheduler's pool then holds
  // no host bytes (the runner keeps all state on the device). Exact for one GPU; over several ranks
  // the ledger sums the ranks' pools, so a rank can still run short (the step then fails on that
  // rank). Unset: the CPU engine, or a runner without paged device state.
  std::optional<int64_t> device_state_tokens;
  int64_t token_budget = 512;  // tokens per engine step (decode + prefill)
  int64_t max_waiting = 1024;  // sequences queued beyond this get 429
  serving::AdmissionPolicy policy = serving::AdmissionPolicy::kWait;
  runtime::RunnerOptions runner;  // runner.paranoid: paranoid mode (step_runner.h)
  // The canary checks 1 in canary_every requests (guards::CanarySampler over the response id;
  // 0: none): every choice of a picked request has its last-token logits recomputed.
  int64_t canary_every = 0;
  // Implementation switches and test-only faults passed to engine::Model::Load.
  engine::ModelOptions model;
  // Empty: the CPU engine (engine::Model::Load with `model`, EngineStepRunner). Set: the runner
  // it returns, and no CPU model is loaded (the CUDA runner recomputes the canary on the GPU).
  // Either way Create sets runner.canary when canary_every > 0.
  runtime::RunnerFactory runner_factory;
};

class ColocatedService : public frontend::GenerationService {
 public:
  // Loads the model, tokenizer, chat format (optional: without one, chat requests get 400) and
  // generation_config.json, builds the pool and starts the loop thread. Errors from loading, or
  // InvalidArgument for bad options.
  static absl::StatusOr<std::unique_ptr<ColocatedService>> Create(const ServiceOptions& options);
  // Stops the loop; requests still running are cancelled without further sink calls.
  ~ColocatedService() override;

  // Accepted: the model directory's name and its path as given; listed: the name alone.
  std::vector<std::string> ModelNames() const override;
  std::vector<std::string> ListedModelNames() const override;
  int64_t MaxModelLength() const override { return preparer_->context_length(); }
  frontend::StartResult Start(const frontend::ApiRequest& req,
                              std::shared_ptr<frontend::GenerationSink> sink) override;
  bool Ready() const override { return true; }
  std::string MetricsText() const override;

  const engine::ModelConfig& config() const { return config_; }
  const text::Tokenizer& tokenizer() const { return preparer_->tokenizer(); }
  const serving::PagePool& pool() const { return *pool_; }
  const serving::Scheduler& scheduler() const { return *scheduler_; }
  // Sequences registered with the runner (zero once every request has finished or been cancelled).
  int64_t active_sequences() const { return runner_->num_sequences(); }

 private:
  struct Request;
  class RequestGeneration;
  ColocatedService() = default;
  // Registers the /metrics families. Errors: those of metrics::Registry.
  absl::Status AddMetrics();
  void Loop();
  // Takes the request's sequences out of the scheduler and the runner.
  void CancelSequences(const Request& request);
  void Forget(const Request& request);

  ServiceOptions options_;
  std::unique_ptr<frontend::RequestPreparer> preparer_;
  // The tokenizer's tokens as bytes, for response_format's token mask.
  std::shared_ptr<const structured::TokenVocabulary> vocabulary_;
  std::unique_ptr<engine::Model> model_;  // the CPU engine; null with a runner_factory
  engine::ModelConfig config_;
  std::unique_ptr<serving::StateLayout> layout_;
  std::unique_ptr<serving::PagePool> pool_;
  SystemClock clock_;
  std::unique_ptr<serving::Scheduler> scheduler_;
  std::unique_ptr<runtime::SequenceRunner> runner_;
  guards::CanarySampler canary_{0};
  std::atomic<uint64_t> next_sequence_{1};
  // /metrics (docs/metrics.md, "Colocated server"); the pointers are into registry_.
  metrics::Registry registry_;
  metrics::Gauge* running_ = nullptr;
  metrics::Gauge* waiting_ = nullptr;
  metrics::Counter* generation_tokens_ = nullptr;
  metrics::Counter* degenerate_choices_ = nullptr;
  metrics::Family<metrics::Gauge>* pages_used_ = nullptr;
  metrics::Family<metrics::Gauge>* pages_free_ = nullptr;
  metrics::Counter* canary_checks_ = nullptr;
  metrics::Counter* canary_mismatches_ = nullptr;
  metrics::Counter* page_owner_failures_ = nullptr;

  mutable absl::Mutex mutex_;
  bool stopping_ ABSL_GUARDED_BY(mutex_) = false;
  // Live requests by sequence id, for sequences the scheduler drops (expired).
  absl::flat_hash_map<serving::RequestId, std::shared_ptr<Request>> by_sequence_
      ABSL_GUARDED_BY(mutex_);
  std::thread loop_;
};

}  // namespace pdserve::colocated
