#include "colocated/service.h"

#include <algorithm>
#include <filesystem>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "serving/generation_config.h"
#include "serving/sampler.h"
#include "text/incremental_detokenizer.h"

namespace pdserve::colocated {
namespace {

frontend::ApiError ServiceError(int http_status, std::string message, std::string type,
                                std::string code = "") {
  frontend::ApiError e;
  e.http_status = http_status;
  e.message = std::move(message);
  e.type = std::move(type);
  e.code = std::move(code);
  return e;
}

serving::SamplingParams RequestParams(const frontend::ApiRequest& req,
                                      serving::SamplingParams params) {
  if (req.temperature) params.temperature = *req.temperature;
  if (req.top_p) params.top_p = *req.top_p;
  if (req.top_k) params.top_k = static_cast<int32_t>(*req.top_k);
  if (req.min_p) params.min_p = *req.min_p;
  if (req.presence_penalty) params.presence_penalty = *req.presence_penalty;
  if (req.frequency_penalty) params.frequency_penalty = *req.frequency_penalty;
  if (req.repetition_penalty) params.repetition_penalty = *req.repetition_penalty;
  params.logit_bias = req.logit_bias;
  params.seed = req.seed;
  params.stop_token_ids = req.stop_token_ids;
  if (req.min_tokens) params.min_tokens = static_cast<int32_t>(*req.min_tokens);
  params.n = req.n;
  if (req.logprobs) params.logprobs = req.top_logprobs;
  return params;
}

}  // namespace

// One API request: its choices' detokenizers and the sink. Guarded by context->mu, which the
// runner holds while it delivers a token.
struct ColocatedService::Request {
  struct Choice {
    text::IncrementalDetokenizer detokenizer;
    int64_t tokens = 0;
    bool done = false;
    bool flagged = false;  // counted in degenerate_choices_
  };
  std::shared_ptr<RequestContext> context;
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
      options.pool_tokens < 0 || options.max_waiting < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "need max_batch >= 1, token_budget > max_batch, pool_tokens >= 0, max_waiting >= 0; got ",
        options.max_batch, ", ", options.token_budget, ", ", options.pool_tokens, ", ",
        options.max_waiting));
  }
  if (options.canary_every < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("canary_every must be >= 0, got ", options.canary_every));
  }
  std::unique_ptr<ColocatedService> s(new ColocatedService());
  s->options_ = options;
  s->canary_ = guards::CanarySampler(options.canary_every);
  s->model_names_ = {std::filesystem::path(options.model_dir).filename().string(),
                     options.model_dir};
  PDSERVE_ASSIGN_OR_RETURN(engine::Model model,
                           engine::Model::Load(options.model_dir, options.model));
  s->model_ = std::make_unique<engine::Model>(std::move(model));
  PDSERVE_ASSIGN_OR_RETURN(s->tokenizer_, text::Tokenizer::Load(options.model_dir));
  absl::StatusOr<std::unique_ptr<text::ChatFormat>> chat =
      text::LoadChatFormat(options.model_dir, *s->tokenizer_);
  if (chat.ok()) s->chat_format_ = std::move(*chat);
  PDSERVE_ASSIGN_OR_RETURN(serving::GenerationConfig generation,
                           serving::GenerationConfig::Load(options.model_dir));
  s->defaults_ = serving::SamplingParams::FromGenerationConfig(generation);
  const engine::ModelConfig& config = s->model_->config();
  s->eos_ids_ = generation.eos_token_ids;
  if (s->eos_ids_.empty()) {
    for (int64_t id : config.eos_token_ids) s->eos_ids_.push_back(static_cast<int32_t>(id));
  }
  PDSERVE_ASSIGN_OR_RETURN(serving::StateLayout layout, LayoutForModel(config));
  s->layout_ = std::make_unique<serving::StateLayout>(layout);
  const int64_t pool_tokens = options.pool_tokens > 0
                                  ? options.pool_tokens
                                  : options.max_batch * config.max_position_embeddings;
  PDSERVE_ASSIGN_OR_RETURN(
      s->pool_, serving::PagePool::Create(s->layout_->PoolOptions(options.max_batch, pool_tokens)));
  serving::SchedulerOptions scheduler_options;
  scheduler_options.token_budget = options.token_budget;
  scheduler_options.max_running = options.max_batch;
  scheduler_options.policy = options.policy;
  const serving::StateLayout* layout_ptr = s->layout_.get();
  PDSERVE_ASSIGN_OR_RETURN(s->scheduler_, serving::Scheduler::Create(
                                              scheduler_options, s->pool_.get(),
                                              [layout_ptr](int64_t total_tokens) {
                                                return layout_ptr->Demand(total_tokens);
                                              },
                                              &s->clock_, nullptr));
  s->runner_ =
      std::make_unique<EngineStepRunner>(*s->model_, *s->layout_, s->pool_.get(), options.runner);
  s->loop_ = std::thread([svc = s.get()] { svc->Loop(); });
  return s;
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

std::vector<std::string> ColocatedService::ModelNames() const { return model_names_; }

absl::StatusOr<std::vector<int32_t>> ColocatedService::PromptTokens(
    const frontend::ApiRequest& req) const {
  if (req.endpoint == frontend::Endpoint::kCompletions) {
    if (req.prompt_tokens) return *req.prompt_tokens;
    return tokenizer_->Encode(req.prompt_text.value_or(""));
  }
  if (!chat_format_) {
    return absl::InvalidArgumentError(
        absl::StrCat("model ", model_names_[0], " has no chat format; use /v1/completions"));
  }
  std::vector<text::ChatMessage> messages;
  for (const frontend::ChatMessage& m : req.messages) {
    messages.push_back({m.role == "developer" ? "system" : m.role, m.content, ""});
  }
  text::ChatOptions chat_options;
  chat_options.thinking = req.thinking.value_or(false);
  PDSERVE_ASSIGN_OR_RETURN(std::vector<text::ChatSegment> segments,
                           chat_format_->Render(messages, chat_options));
  return text::EncodeChat(*tokenizer_, segments);
}

frontend::StartResult ColocatedService::Start(const frontend::ApiRequest& req,
                                              std::shared_ptr<frontend::GenerationSink> sink) {
  absl::StatusOr<std::vector<int32_t>> prompt = PromptTokens(req);
  if (!prompt.ok()) {
    return frontend::InvalidRequest(
        std::string(prompt.status().message()),
        req.endpoint == frontend::Endpoint::kCompletions ? "prompt" : "messages");
  }
  if (prompt->empty()) return frontend::InvalidRequest("the prompt has no tokens", "prompt");
  const engine::ModelConfig& config = model_->config();
  const int64_t context = config.max_position_embeddings;
  const int64_t prompt_length = static_cast<int64_t>(prompt->size());
  const int64_t max_tokens = req.max_tokens.value_or(context - prompt_length);
  if (prompt_length + std::max<int64_t>(max_tokens, 1) > context) {
    return frontend::InvalidRequest(
        absl::StrCat("This model's maximum context length is ", context,
                     " tokens. However, you "
                     "requested ",
                     prompt_length + max_tokens, " tokens (", prompt_length, " in the prompt, ",
                     max_tokens, " for the completion)."),
        "max_tokens", "context_length_exceeded");
  }
  serving::SamplingParams params = RequestParams(req, defaults_);
  params.max_tokens = static_cast<int32_t>(max_tokens);
  const std::string request_id = frontend::NewResponseId(req.endpoint);
  const bool canary = canary_.Picks(request_id);
  std::vector<int32_t> eos = req.ignore_eos ? std::vector<int32_t>{} : eos_ids_;
  absl::StatusOr<serving::RequestSampler> sampler =
      serving::RequestSampler::Create(params, request_id, eos, *prompt, config.vocab_size);
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
    return ServiceError(429, "too many requests are waiting; retry later", "rate_limit_exceeded");
  }

  auto request = std::make_shared<Request>();
  request->context = std::make_shared<RequestContext>(std::move(*sampler));
  request->sink = std::move(sink);
  request->prompt_tokens = prompt_length;
  request->remaining = params.n;
  for (int c = 0; c < params.n; ++c) {
    request->choices.push_back(
        {text::IncrementalDetokenizer(*tokenizer_, {req.skip_special_tokens, req.stop})});
    request->sequences.push_back(next_sequence_++);
  }
  // The callbacks live in the request's context, so they hold the request weakly; locking it keeps
  // it alive while a sink call may drop the last Generation.
  std::weak_ptr<Request> weak = request;
  const bool want_logprobs = req.logprobs;
  request->context->on_token = [this, weak, want_logprobs](const TokenEvent& event) {
    std::shared_ptr<Request> r = weak.lock();
    if (!r || r->cancelled.load()) return true;
    Request::Choice& choice = r->choices[event.choice];
    ++choice.tokens;
    ++generated_tokens_;
    frontend::ChoiceDelta delta;
    delta.index = event.choice;
    absl::StatusOr<text::DetokenizeStep> step = choice.detokenizer.Add(event.sampled.token);
    if (step.ok()) delta.text = step->text;
    if (want_logprobs) {
      frontend::TokenLogprob lp;
      lp.token = tokenizer_->Decode(std::vector<int32_t>{event.sampled.token}).value_or("");
      lp.logprob = event.sampled.logprob;
      for (const serving::TokenLogprob& top : event.sampled.top_logprobs) {
        lp.top.emplace_back(tokenizer_->Decode(std::vector<int32_t>{top.token}).value_or(""),
                            top.logprob);
      }
      delta.logprobs.push_back(std::move(lp));
    }
    const bool stop_string = step.ok() && step->stopped;
    if (event.degenerate && !choice.flagged) {
      choice.flagged = true;
      ++degenerate_choices_;
    }
    if (stop_string || !event.finish_reason.empty()) {
      if (!stop_string) delta.text += choice.detokenizer.Finish().text;
      delta.finish_reason = stop_string ? "stop" : event.finish_reason;
      choice.done = true;
      --r->remaining;
    }
    if (!delta.text.empty() || !delta.logprobs.empty() || delta.finish_reason) {
      r->sink->OnDelta(std::move(delta));
    }
    if (r->remaining == 0) {
      frontend::Usage usage{r->prompt_tokens, 0};
      for (const Request::Choice& c : r->choices) usage.completion_tokens += c.tokens;
      r->sink->OnComplete(usage);
      Forget(*r);
    }
    return stop_string;
  };
  request->context->on_error = [this, weak](int32_t choice, const absl::Status& status) {
    std::shared_ptr<Request> r = weak.lock();
    if (!r || r->cancelled.exchange(true)) return;
    r->sink->OnError(ServiceError(
        500, absl::StrCat("choice ", choice, " failed: ", status.message()), "server_error"));
    CancelSequences(*r);
  };

  {
    absl::MutexLock lock(&mutex_);
    for (serving::RequestId id : request->sequences) by_sequence_[id] = request;
  }
  for (int c = 0; c < params.n; ++c) {
    const serving::RequestId id = request->sequences[c];
    SequenceSetup setup{request->context, c, *prompt, max_tokens};
    setup.canary = canary;
    absl::Status added = runner_->Add(id, std::move(setup));
    absl::Status submitted =
        added.ok() ? scheduler_->Submit({id, prompt_length, max_tokens}) : added;
    if (!submitted.ok()) {
      request->cancelled = true;
      CancelSequences(*request);
      if (absl::IsUnavailable(submitted)) {
        return ServiceError(503, std::string(submitted.message()), "server_error",
                            "pool_exhausted");
      }
      return frontend::InvalidRequest(std::string(submitted.message()), "max_tokens");
    }
  }
  return std::unique_ptr<frontend::Generation>(new RequestGeneration(this, request));
}

void ColocatedService::CancelSequences(const Request& request) {
  for (serving::RequestId id : request.sequences) {
    // NotFound: the sequence already finished or was never submitted.
    scheduler_->Cancel(id).IgnoreError();
    runner_->Remove(id);
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
        request->sink->OnError(ServiceError(503, "the request waited too long for state pages",
                                            "server_error", "queue_timeout"));
      }
      CancelSequences(*request);
    }
  }
}

std::string ColocatedService::MetricsText() const {
  std::string out;
  auto gauge = [&out](const std::string& name, const std::string& help, double value) {
    absl::StrAppend(&out, "# HELP ", name, " ", help, "\n# TYPE ", name, " gauge\n", name, " ",
                    value, "\n");
  };
  gauge("pdserve_sequences_waiting", "Sequences waiting for admission.",
        static_cast<double>(scheduler_->num_waiting()));
  gauge("pdserve_sequences_running", "Sequences holding state pages.",
        static_cast<double>(scheduler_->num_running()));
  gauge("pdserve_generated_tokens", "Tokens generated since start.",
        static_cast<double>(generated_tokens_.load()));
  gauge("pdserve_degenerate_choices", "Choices the degeneration detector flagged.",
        static_cast<double>(degenerate_choices_.load()));
  const GuardCounts guards = runner_->guard_counts();
  auto counter = [&out](const std::string& name, const std::string& help, int64_t value) {
    absl::StrAppend(&out, "# HELP ", name, " ", help, "\n# TYPE ", name, " counter\n", name, " ",
                    value, "\n");
  };
  counter("pdserve_canary_checks_total", "Choices whose last-token logits the canary recomputed.",
          guards.canary_checks);
  counter("pdserve_canary_mismatches_total",
          "Canary checks whose logits differed from a fresh one-shot forward (request failed).",
          guards.canary_mismatches);
  counter("pdserve_isolation_errors_total",
          "Paranoid-mode page checks that found a page with another owner or epoch.",
          guards.isolation_errors);
  for (int32_t k = 0; k < pool_->num_kinds(); ++k) {
    absl::StrAppend(&out, "# HELP pdserve_state_pages_free_", pool_->kind(k).name,
                    " Free state pages of this kind.\n# TYPE pdserve_state_pages_free_",
                    pool_->kind(k).name, " gauge\npdserve_state_pages_free_", pool_->kind(k).name,
                    " ", pool_->pages_free(k), "\n");
  }
  return out;
}

}  // namespace pdserve::colocated
