#include "colocated/service.h"

#include <algorithm>
#include <filesystem>
#include <map>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "runtime/device_state_pools.h"
#include "serving/generation_config.h"
#include "serving/sampler.h"
#include "spdlog/spdlog.h"

namespace pdserve::colocated {
// One API request: its choices' detokenizers and the sink. Guarded by context->mu, which the
// runner holds while it delivers a token.
struct ColocatedService::Request {
  struct Choice {
    frontend::ChoiceText text;
    bool flagged = false;           // counted in pdserve_serve_degenerate_generations_total
    std::string degeneration_kind;  // with flagged: TokenEvent::degeneration_kind
  };
  std::string id;  // the response id ("cmpl-..."), for logs
  std::shared_ptr<runtime::RequestContext> context;
  std::shared_ptr<frontend::GenerationSink> sink;
  std::vector<serving::RequestId> sequences;
  std::vector<Choice> choices;
  int64_t prompt_tokens = 0;
  int remaining = 0;
  std::atomic<bool> cancelled{false};
};

class ColocatedService::RequestGeneration : public frontend::Generation {
 public:
  RequestGeneration(ColocatedService* service, std::shared_ptr<Request> request)
      : service_(service), request_(std::move(request)) {}
  ~RequestGeneration() override { Cancel(); }
  void Cancel() override {
    if (request_->cancelled.exchange(true)) return;
    service_->CancelSequences(*request_);
  }

 private:
  ColocatedService* service_;
  std::shared_ptr<Request> request_;
};

absl::StatusOr<std::unique_ptr<ColocatedService>> ColocatedService::Create(
    const ServiceOptions& options) {
  if (options.max_batch < 1 || options.token_budget <= options.max_batch ||
      options.pool_tokens < 0 || options.max_waiting < 0 ||
      options.device_state_tokens.value_or(0) < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "need max_batch >= 1, token_budget > max_batch, pool_tokens >= 0, max_waiting >= 0, "
        "device_state_tokens >= 0; got ",
        options.max_batch, ", ", options.token_budget, ", ", options.pool_tokens, ", ",
        options.max_waiting, ", ", options.device_state_tokens.value_or(0)));
  }
  if (options.canary_every < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("canary_every must be >= 0, got ", options.canary_every));
  }
  std::unique_ptr<ColocatedService> s(new ColocatedService());
  s->options_ = options;
  s->options_.runner.canary = options.canary_every > 0;
  s->canary_ = guards::CanarySampler(options.canary_every);
  PDSERVE_ASSIGN_OR_RETURN(s->preparer_, frontend::RequestPreparer::Load(options.model_dir));
  if (options.runner_factory) {
    PDSERVE_ASSIGN_OR_RETURN(s->config_, engine::ModelConfig::Load(options.model_dir));
  } else {
    PDSERVE_ASSIGN_OR_RETURN(engine::Model model,
                             engine::Model::Load(options.model_dir, options.model));
    s->model_ = std::make_unique<engine::Model>(std::move(model));
    s->config_ = s->model_->config();
  }
  const engine::ModelConfig& config = s->config_;
  PDSERVE_ASSIGN_OR_RETURN(serving::StateLayout layout, runtime::LayoutForModel(config));
  s->layout_ = std::make_unique<serving::StateLayout>(layout);
  const int64_t pool_tokens = options.pool_tokens > 0
                                  ? options.pool_tokens
                                  : options.max_batch * config.max_position_embeddings;
  const int64_t max_context = std::min(config.max_position_embeddings, pool_tokens);
  serving::PagePoolOptions pool_options = s->layout_->PoolOptions(options.max_batch, pool_tokens);
  // Without device_state_tokens: no device kinds, the layout's demand alone.
  const runtime::DeviceStatePools device_pools = runtime::DeviceStatePools::For(
      config, options.max_batch, max_context, options.device_state_tokens.value_or(0));
  const bool count_device = options.device_state_tokens.has_value();
  if (count_device) {
    // Another runner keeps every sequence's state on the device: the host pool is bookkeeping.
    pool_options.host_memory = !options.runner_factory;
    device_pools.AddKinds(&pool_options);
  }
  PDSERVE_ASSIGN_OR_RETURN(s->pool_, serving::PagePool::Create(std::move(pool_options)));
  serving::SchedulerOptions scheduler_options;
  scheduler_options.token_budget = options.token_budget;
  scheduler_options.max_running = options.max_batch;
  scheduler_options.policy = options.policy;
  const serving::StateLayout* layout_ptr = s->layout_.get();
  PDSERVE_ASSIGN_OR_RETURN(
      s->scheduler_, serving::Scheduler::Create(
                         scheduler_options, s->pool_.get(),
                         [layout_ptr, device_pools, count_device](int64_t total_tokens) {
                           return count_device ? device_pools.Demand(*layout_ptr, total_tokens)
                                               : layout_ptr->Demand(total_tokens);
                         },
                         &s->clock_, nullptr));
  if (options.runner_factory) {
    runtime::RunnerContext context{options.model_dir,  &config,
                                   s->layout_.get(),   s->pool_.get(),
                                   s->options_.runner, options.max_batch,
                                   max_context,        options.device_state_tokens.value_or(0)};
    PDSERVE_ASSIGN_OR_RETURN(s->runner_, options.runner_factory(context));
  } else {
    s->runner_ = std::make_unique<runtime::EngineStepRunner>(*s->model_, *s->layout_,
                                                             s->pool_.get(), s->options_.runner);
  }
  PDSERVE_ASSIGN_OR_RETURN(s->vocabulary_,
                           structured::TokenVocabulary::FromTokenizer(s->preparer_->tokenizer()));
  PDSERVE_RETURN_IF_ERROR(s->AddMetrics());
  s->loop_ = std::thread([svc = s.get()] { svc->Loop(); });
  return s;
}

absl::Status ColocatedService::AddMetrics() {
  metrics::Registry& r = registry_;
  PDSERVE_RETURN_IF_ERROR(metrics::AddBuildInfo(r, "serve"));
  PDSERVE_ASSIGN_OR_RETURN(auto* running,
                           r.AddGauge("pdserve_serve_sequences_running",
                                      "Sequences (one per choice) in the continuous batch"));
  running_ = &running->Get();
  PDSERVE_ASSIGN_OR_RETURN(auto* waiting, r.AddGauge("pdserve_serve_sequences_waiting",
                                                     "Sequences waiting for admission"));
  waiting_ = &waiting->Get();
  PDSERVE_ASSIGN_OR_RETURN(
      auto* tokens, r.AddCounter("pdserve_serve_generation_tokens_total", "Tokens generated"));
  generation_tokens_ = &tokens->Get();
  PDSERVE_ASSIGN_OR_RETURN(
      auto* degenerate,
      r.AddCounter("pdserve_serve_degenerate_generations_total",
                   "Choices the degeneration detector caught", {"kind", "action"}));
  // The detector's one test is repetition (guards::DegenerationDetector::Repetitive).
  degenerate_choices_ = &degenerate->WithLabels(
      {"repeat",
       options_.runner.degeneration == runtime::DegenerationAction::kStop ? "stop" : "flag"});
  PDSERVE_ASSIGN_OR_RETURN(
      pages_used_, r.AddGauge("pdserve_serve_pool_pages_used", "State pages allocated", {"kind"}));
  PDSERVE_ASSIGN_OR_RETURN(
      pages_free_, r.AddGauge("pdserve_serve_pool_pages_free", "State pages free", {"kind"}));
  PDSERVE_ASSIGN_OR_RETURN(auto* checks,
                           r.AddCounter("pdserve_serve_canary_checks_total",
                                        "Choices whose last-token logits the canary recomputed"));
  canary_checks_ = &checks->Get();
  PDSERVE_ASSIGN_OR_RETURN(
      auto* mismatches,
      r.AddCounter("pdserve_serve_canary_mismatches_total",
                   "Canary checks whose logits differed from a fresh one-shot forward"));
  canary_mismatches_ = &mismatches->Get();
  PDSERVE_ASSIGN_OR_RETURN(
      auto* isolation, r.AddCounter("pdserve_serve_isolation_failures_total",
                                    "Choices failed by a state-page isolation check", {"kind"}));
  // Colocated state never crosses a process: paranoid mode's owner check is the one kind.
  page_owner_failures_ = &isolation->WithLabels({"page_owner"});
  return absl::OkStatus();
}

ColocatedService::~ColocatedService() {
  std::vector<std::shared_ptr<Request>> live;
  {
    absl::MutexLock lock(&mutex_);
    stopping_ = true;
    for (auto& [id, request] : by_sequence_) live.push_back(request);
  }
  if (loop_.joinable()) loop_.join();
  for (auto& request : live) {
    if (!request->cancelled.exchange(true)) CancelSequences(*request);
  }
}

std::vector<std::string> ColocatedService::ModelNames() const { return preparer_->model_names(); }

std::vector<std::string> ColocatedService::ListedModelNames() const {
  return {preparer_->model_names().front()};
}

frontend::StartResult ColocatedService::Start(const frontend::ApiRequest& req,
                                              std::shared_ptr<frontend::GenerationSink> sink) {
  frontend::Prepared prepared = preparer_->Prepare(req);
  if (auto* error = std::get_if<frontend::ApiError>(&prepared)) return *error;
  frontend::PreparedRequest& ready = std::get<frontend::PreparedRequest>(prepared);
  const std::vector<int32_t>* prompt = &ready.prompt;
  const engine::ModelConfig& config = config_;
  const int64_t prompt_length = static_cast<int64_t>(prompt->size());
  serving::SamplingParams& params = ready.params;
  const int64_t max_tokens = params.max_tokens;
  const std::string& request_id = ready.request_id;
  const bool canary = canary_.Picks(request_id);
  std::vector<int32_t> eos = req.ignore_eos ? std::vector<int32_t>{} : preparer_->eos_ids();
  absl::StatusOr<serving::RequestSampler> sampler = serving::RequestSampler::Create(
      params, request_id, eos, *prompt, config.vocab_size, vocabulary_);
  if (!sampler.ok()) return frontend::InvalidRequest(std::string(sampler.status().message()));
  // Under the reject policy the choices must run at once; more than fit can never be admitted,
  // which is the client's error (400), not a full server (a 503 would be retried forever).
  if (options_.policy == serving::AdmissionPolicy::kReject && params.n > options_.max_batch) {
    return frontend::InvalidRequest(
        absl::StrCat("'n' is ", params.n, " but this server runs at most ", options_.max_batch,
                     " sequences at once"),
        "n");
  }
  // With nobody waiting the request may be admitted at once, so only a queue already there counts.
  const int64_t waiting = scheduler_->num_waiting();
  if (waiting > 0 && waiting + params.n > options_.max_waiting) {
    return frontend::ServerError(429, "too many requests are waiting; retry later",
                                 "rate_limit_exceeded");
  }

  auto request = std::make_shared<Request>();
  request->context = std::make_shared<runtime::RequestContext>(std::move(*sampler));
  request->id = request_id;
  request->sink = std::move(sink);
  request->prompt_tokens = prompt_length;
  request->remaining = params.n;
  for (int c = 0; c < params.n; ++c) {
    request->choices.push_back({frontend::ChoiceText(*preparer_, req, c)});
    request->sequences.push_back(next_sequence_++);
  }
  // The callbacks live in the request's context, so they hold the request weakly; locking it keeps
  // it alive while a sink call may drop the last Generation.
  std::weak_ptr<Request> weak = request;
  request->context->on_token = [this, weak](const runtime::TokenEvent& event) {
    std::shared_ptr<Request> r = weak.lock();
    if (!r || r->cancelled.load()) return true;
    Request::Choice& choice = r->choices[event.choice];
    generation_tokens_->Increment();
    frontend::SampledText sampled{event.sampled.token, event.sampled.logprob, {}};
    for (const serving::TokenLogprob& top : event.sampled.top_logprobs) {
      sampled.top.emplace_back(top.token, top.logprob);
    }
    frontend::ChoiceDelta delta = choice.text.Add(sampled, event.finish_reason);
    const bool stop_string = delta.finish_reason && event.finish_reason.empty();
    if (event.degenerate && !choice.flagged) {
      choice.flagged = true;
      choice.degeneration_kind = event.degeneration_kind;
      degenerate_choices_->Increment();
      spdlog::warn("serve: choice {} of {} is degenerate ({})", event.choice, r->id,
                   choice.degeneration_kind);
    }
    if (choice.flagged) delta.degeneration_kind = choice.degeneration_kind;
    if (delta.finish_reason) --r->remaining;
    if (delta.HasPayload()) {
      r->sink->OnDelta(std::move(delta));
    }
    if (r->remaining == 0) {
      frontend::Usage usage{r->prompt_tokens, 0};
      for (const Request::Choice& c : r->choices) {
        usage.completion_tokens += c.text.tokens();
        usage.reasoning_tokens += c.text.reasoning_tokens();
      }
      r->sink->OnComplete(usage);
      Forget(*r);
    }
    return stop_string;
  };
  request->context->on_error = [this, weak](int32_t choice, const absl::Status& status) {
    std::shared_ptr<Request> r = weak.lock();
    if (!r || r->cancelled.exchange(true)) return;
    r->sink->OnError(frontend::ServerError(
        500, absl::StrCat("choice ", choice, " failed: ", status.message()), "server_error"));
    CancelSequences(*r);
  };

  {
    absl::MutexLock lock(&mutex_);
    for (serving::RequestId id : request->sequences) by_sequence_[id] = request;
  }
  for (int c = 0; c < params.n; ++c) {
    const serving::RequestId id = request->sequences[c];
    runtime::SequenceSetup setup{request->context, c, *prompt, max_tokens};
    setup.canary = canary;
    absl::Status added = runner_->Add(id, std::move(setup));
    absl::Status submitted =
        added.ok() ? scheduler_->Submit({id, prompt_length, max_tokens}) : added;
    if (!submitted.ok()) {
      request->cancelled = true;
      CancelSequences(*request);
      if (absl::IsUnavailable(submitted)) {
        return frontend::ServerError(503, std::string(submitted.message()), "server_error",
                                     "pool_exhausted");
      }
      if (runtime::DeviceStatePools::Names(std::string(submitted.message()))) {
        return frontend::InvalidRequest(
            absl::StrCat("prompt + max_tokens (", prompt_length + max_tokens,
                         " tokens) can never fit this server's device state pool (state_tokens ",
                         options_.device_state_tokens.value_or(0), "): ", submitted.message()),
            "max_tokens", "context_length_exceeded");
      }
      return frontend::InvalidRequest(std::string(submitted.message()), "max_tokens");
    }
  }
  return std::unique_ptr<frontend::Generation>(new RequestGeneration(this, request));
}

void ColocatedService::CancelSequences(const Request& request) {
  for (serving::RequestId id : request.sequences) {
    // The runner first: a GPU runner's slot is then free before the scheduler may admit another
    // sequence in this one's place. NotFound: the sequence already finished or was never submitted.
    runner_->Remove(id);
    scheduler_->Cancel(id).IgnoreError();
  }
  Forget(request);
}

void ColocatedService::Forget(const Request& request) {
  absl::MutexLock lock(&mutex_);
  for (serving::RequestId id : request.sequences) by_sequence_.erase(id);
}

void ColocatedService::Loop() {
  while (true) {
    {
      absl::MutexLock lock(&mutex_);
      if (stopping_) return;
    }
    if (scheduler_->num_waiting() + scheduler_->num_running() == 0) {
      absl::MutexLock lock(&mutex_);
      mutex_.AwaitWithTimeout(absl::Condition(&stopping_), absl::Milliseconds(2));
      continue;
    }
    absl::StatusOr<serving::Scheduler::StepResult> result = scheduler_->Step(*runner_);
    if (!result.ok()) continue;
    for (serving::RequestId id : result->finished) runner_->Remove(id);
    for (serving::RequestId id : result->plan.expired) {
      std::shared_ptr<Request> request;
      {
        absl::MutexLock lock(&mutex_);
        auto it = by_sequence_.find(id);
        if (it != by_sequence_.end()) request = it->second;
      }
      if (!request || request->cancelled.exchange(true)) continue;
      {
        absl::MutexLock lock(&request->context->mu);
        request->sink->OnError(frontend::ServerError(
            503, "the request waited too long for state pages", "server_error", "queue_timeout"));
      }
      CancelSequences(*request);
    }
  }
}

std::string ColocatedService::MetricsText() const {
  running_->Set(static_cast<double>(scheduler_->num_running()));
  waiting_->Set(static_cast<double>(scheduler_->num_waiting()));
  // The runner keeps the guard counts; the counters catch up to them here.
  const runtime::GuardCounts guards = runner_->guard_counts();
  canary_checks_->Increment(static_cast<double>(guards.canary_checks) - canary_checks_->Value());
  canary_mismatches_->Increment(static_cast<double>(guards.canary_mismatches) -
                                canary_mismatches_->Value());
  page_owner_failures_->Increment(static_cast<double>(guards.isolation_errors) -
                                  page_owner_failures_->Value());
  for (const auto& [label, pages] : serving::PoolPagesByLabel(*pool_)) {
    pages_used_->WithLabels({label}).Set(static_cast<double>(pages.used));
    pages_free_->WithLabels({label}).Set(static_cast<double>(pages.free));
  }
  return registry_.Serialize();
}

}  // namespace pdserve::colocated
