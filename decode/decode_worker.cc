#include "decode/decode_worker.h"

#include <algorithm>
#include <cstdint>
#include <map>
#include <random>
#include <span>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/histogram_buckets.h"
#include "common/status.h"
#include "guards/canary.h"
#include "kvtransfer/isolation_error.h"
#include "kvtransfer/ticket_proto.h"
#include "kvtransfer/ucx/ucx_lane.h"
#include "runtime/paged_state.h"
#include "serving/sampler.h"
#include "serving/state_layout.h"
#include "spdlog/spdlog.h"
#include "worker/wire.h"
#include "worker/worker_model.h"
#include "worker/worker_process.h"

namespace pdserve::decode {
namespace v1 = pdserve::worker::v1;

namespace {

// How long a finished request nobody streams is kept for a late Generate.
constexpr absl::Duration kKeepFinished = absl::Seconds(60);
// How many ids of requests aborted before (or while) they were reserved are remembered, so that
// their Reserve is refused (the router's ids are unique, so a few thousand cover any race).
constexpr size_t kAbortedRemembered = 4096;

int64_t TablePages(const serving::PageTable& table) {
  int64_t pages = 0;
  for (const auto& kind : table.pages) pages += static_cast<int64_t>(kind.size());
  return pages;
}

}  // namespace

absl::StatusOr<std::unique_ptr<DecodeWorker>> DecodeWorker::Create(DecodeWorkerOptions options) {
  if (options.max_batch < 1 || options.pool_tokens < 0 || options.lease <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("need max_batch >= 1, pool_tokens >= 0 and a positive lease");
  }
  std::unique_ptr<DecodeWorker> w(new DecodeWorker());
  w->options_ = std::move(options);
  w->options_.runner.canary = w->options_.canary_every > 0;
  PDSERVE_ASSIGN_OR_RETURN(w->model_,
                           worker::LoadWorkerModel(w->options_.model_dir, w->options_.model,
                                                   /*cpu_engine=*/!w->options_.runner_factory));
  const engine::ModelConfig& config = w->model_.config;
  const int64_t pool_tokens = w->options_.pool_tokens > 0
                                  ? w->options_.pool_tokens
                                  : w->options_.max_batch * config.max_position_embeddings;
  const int64_t max_context = std::min(config.max_position_embeddings, pool_tokens);
  serving::PagePoolOptions pool_options =
      w->model_.layout->PoolOptions(w->options_.max_batch, pool_tokens);
  if (w->options_.device_state_tokens.has_value()) {
    if (*w->options_.device_state_tokens < 0) {
      return absl::InvalidArgumentError(
          "device_state_tokens (worker key state_tokens) must be >= 0");
    }
    w->device_pools_ = runtime::DeviceStatePools::For(config, w->options_.max_batch, max_context,
                                                      *w->options_.device_state_tokens);
    w->device_pools_->AddKinds(&pool_options);
  }
  PDSERVE_ASSIGN_OR_RETURN(w->pool_, serving::PagePool::Create(std::move(pool_options)));
  kv::ReceiverOptions receiver_options;
  receiver_options.lease = w->options_.lease;
  receiver_options.heartbeat_interval = std::min(absl::Seconds(1), w->options_.lease / 4);
  receiver_options.incarnation = std::random_device{}() | (uint64_t{std::random_device{}()} << 32);
  // A stall of this process does not count against the missing-page grace (ReceiverOptions).
  receiver_options.run_clock = &w->clock_;
  PDSERVE_ASSIGN_OR_RETURN(w->transfer_metrics_,
                           kv::TransferMetrics::Create(w->registry_, "receive"));
  receiver_options.metrics = w->transfer_metrics_.get();
  receiver_options.metrics_path = w->options_.transfer_path;
  // Device pages need the ack words too (docs/protocol.md: the shm-pull protocol on GPU memory).
  if (w->options_.transfer_shm_pull || w->options_.device_landing.has_value()) {
    // One word per page of the tickets in flight: 2^20 words (8 MiB) cover tens of 128K-token
    // V4-Flash requests; a ticket that finds none free goes without an offer.
    PDSERVE_ASSIGN_OR_RETURN(w->acks_, kv::shm::AckTable::Create(uint64_t{1} << 20));
    receiver_options.acks = w->acks_.get();
    spdlog::info("transfer: shm pull offered in every ticket ({} ack words in memfd fd {})",
                 w->acks_->words(), w->acks_->name().fd);
  }
  DecodeWorker* self = w.get();
  receiver_options.on_layer = [self](uint64_t, uint64_t request_id, uint32_t layer) {
    self->OnLayer(request_id, layer);
  };
  PDSERVE_ASSIGN_OR_RETURN(
      w->receiver_,
      kv::CreateUcxReceiver(
          receiver_options, w->clock_,
          [self](uint64_t ticket_id, uint64_t, const absl::Status& outcome) {
            self->OnRelease(ticket_id, outcome);
          },
          [self](uint64_t ticket_id, uint64_t request_id, const kv::TransferOutcome& outcome) {
            self->OnOutcome(ticket_id, request_id, outcome);
          },
          w->options_.transfer_lanes, w->options_.transfer_ucx_protocols));
  w->ucx_protocols_ = kv::EffectiveUcxProtocols(w->options_.transfer_ucx_protocols);
  size_t registered = 0;
  if (w->options_.transfer_register_pages) {
    // The pool outlives the receiver (members in that order), whose transport unmaps these.
    for (std::span<std::byte> block : w->pool_->HostBlocks()) {
      PDSERVE_RETURN_IF_ERROR(w->receiver_->RegisterMemory(block));
      ++registered;
    }
  }
  spdlog::info("transfer: {} receive lane(s), UCX protocols {}, {} page-pool region(s) registered",
               w->options_.transfer_lanes, kv::UcxProtocolsName(w->ucx_protocols_), registered);
  // Read at start, so that a value the switch does not accept is warned about now even where no
  // lane thread uses it (one lane).
  kv::LaneLinger();
  if (w->options_.runner_factory) {
    const runtime::RunnerContext context{w->options_.model_dir,
                                         &config,
                                         w->model_.layout.get(),
                                         w->pool_.get(),
                                         w->options_.runner,
                                         w->options_.max_batch,
                                         max_context,
                                         w->options_.device_state_tokens.value_or(0)};
    PDSERVE_ASSIGN_OR_RETURN(w->runner_, w->options_.runner_factory(context));
  } else {
    w->runner_ = std::make_unique<runtime::EngineStepRunner>(*w->model_.model, *w->model_.layout,
                                                             w->pool_.get(), w->options_.runner);
  }

  // Set before any ticket exists: OnLayer reads it without a lock.
  w->early_importer_ = w->runner_->early_importer();
  if (w->early_importer_ != nullptr) {
    spdlog::info("transfer: early import (each layer into its GPU slot as it arrives)");
  }
  // The device page pool only serves the early import (DevicePagesRefusal sends every request by
  // host pages without one: more than one GPU, or transfer.early_import off), so without it
  // none is allocated: ~3.3 GB of HBM for V4-Flash at the default 131072 tokens a request.
  if (w->options_.device_landing.has_value() && w->early_importer_ == nullptr) {
    spdlog::warn(
        "transfer: cuda ipc {}: no device page pool (it serves the early import, which this "
        "worker has not: transfer.early_import off or more than one GPU); host pages only",
        w->options_.device_landing->required ? "on" : "auto");
  } else if (w->options_.device_landing.has_value()) {
    if (absl::Status pool = w->CreateDevicePool(); !pool.ok()) {
      if (w->options_.device_landing->required) return pool;
      spdlog::warn("transfer: cuda ipc off (host pages only): {}", pool.ToString());
      w->device_page_pool_.reset();
    }
  }
  PDSERVE_RETURN_IF_ERROR(w->AddMetrics());
  w->transfer_thread_ = std::thread([self] { self->TransferLoop(); });
  w->decode_thread_ = std::thread([self] { self->DecodeLoop(); });
  return w;
}

serving::PageDemand DecodeWorker::Demand(int64_t total_tokens) const {
  return device_pools_ ? device_pools_->Demand(*model_.layout, total_tokens)
                       : model_.layout->Demand(total_tokens);
}

absl::Status DecodeWorker::AddMetrics() {
  metrics::Registry& r = registry_;
  PDSERVE_RETURN_IF_ERROR(metrics::AddBuildInfo(r, "decode"));
  PDSERVE_ASSIGN_OR_RETURN(auto* running, r.AddGauge("pdserve_decode_requests_running",
                                                     "Requests in the continuous batch"));
  running_gauge_ = &running->Get();
  PDSERVE_ASSIGN_OR_RETURN(auto* waiting,
                           r.AddGauge("pdserve_decode_requests_waiting",
                                      "Reserved requests waiting for state or a batch slot"));
  waiting_gauge_ = &waiting->Get();
  PDSERVE_ASSIGN_OR_RETURN(
      auto* batch, r.AddHistogram("pdserve_decode_batch_size", "Requests per decode step", {},
                                  metrics::GeometricBuckets(1, 2, 1024)));
  batch_size_ = &batch->Get();
  PDSERVE_ASSIGN_OR_RETURN(auto* step,
                           r.AddHistogram("pdserve_decode_step_seconds", "One decode step", {},
                                          metrics::LatencyBucketsSeconds()));
  step_seconds_ = &step->Get();
  PDSERVE_ASSIGN_OR_RETURN(auto* tokens,
                           r.AddCounter("pdserve_decode_tokens_total", "Tokens generated"));
  tokens_total_ = &tokens->Get();
  PDSERVE_ASSIGN_OR_RETURN(
      pages_used_, r.AddGauge("pdserve_decode_pool_pages_used", "State pages allocated", {"kind"}));
  PDSERVE_ASSIGN_OR_RETURN(
      pages_free_, r.AddGauge("pdserve_decode_pool_pages_free", "State pages free", {"kind"}));
  PDSERVE_ASSIGN_OR_RETURN(
      isolation_failures_,
      r.AddCounter("pdserve_decode_isolation_failures_total",
                   "Requests failed by a state-page isolation check", {"kind"}));
  PDSERVE_ASSIGN_OR_RETURN(auto* fenced, r.AddGauge("pdserve_decode_fenced_pages",
                                                    "Pages quarantined until their lease ends"));
  fenced_pages_ = &fenced->Get();
  PDSERVE_ASSIGN_OR_RETURN(degenerate_, r.AddCounter("pdserve_decode_degenerate_generations_total",
                                                     "Generations the degeneration detector caught",
                                                     {"kind", "action"}));
  // The series alerts and dashboards read exist at 0 from the start, so increase() sees the
  // first event (docs/metrics.md).
  std::vector<std::string> isolation_kinds = {"page_owner"};
  for (kv::IsolationError kind : kv::kAllIsolationErrors) {
    isolation_kinds.emplace_back(kv::IsolationErrorName(kind));
  }
  isolation_failures_->ExportAtZero({isolation_kinds});
  degenerate_->ExportAtZero({{"repeat", "whitespace", "empty"}, {"flag", "stop"}});

  PDSERVE_ASSIGN_OR_RETURN(
      auto* canary_checks,
      r.AddCounter("pdserve_decode_canary_checks_total",
                   "Requests whose last-token logits the canary recomputed from scratch"));
  canary_checks_ = &canary_checks->Get();
  PDSERVE_ASSIGN_OR_RETURN(
      auto* canary_mismatches,
      r.AddCounter("pdserve_decode_canary_mismatches_total",
                   "Canary checks whose logits differed from a fresh one-shot forward"));
  canary_mismatches_ = &canary_mismatches->Get();
  canary_ = guards::CanarySampler(options_.canary_every);
  return absl::OkStatus();
}

DecodeWorker::~DecodeWorker() {
  Stop();
  // The receiver's lane threads call back into this worker: they stop before its members go.
  receiver_.reset();
}

void DecodeWorker::Stop() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  if (transfer_thread_.joinable()) transfer_thread_.join();
  if (decode_thread_.joinable()) decode_thread_.join();
}

bool DecodeWorker::Drain(absl::Duration timeout) {
  BeginDrain();
  std::vector<uint64_t> tickets;
  {
    absl::MutexLock lock(&mu_);
    auto idle = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      for (const auto& [id, r] : requests_) {
        if (!Ended(r->state) || r->attached) return false;
      }
      return true;
    };
    if (mu_.AwaitWithTimeout(absl::Condition(&idle), timeout)) return true;
    int64_t open = 0;
    for (const auto& [id, r] : requests_) {
      if (Ended(r->state)) continue;
      ++open;
      if (Receiving(r->state) && r->ticket_id != 0 && r->fork == 0) {
        tickets.push_back(r->ticket_id);
      }
      // "abort", not "error": the worker ended it (the router answers 503, retry later).
      Finish(*r, RequestEvent::kAbort, "abort", absl::UnavailableError("worker shutting down"));
    }
    spdlog::warn("drain: {} requests still open after {}; ending them", open,
                 absl::FormatDuration(timeout));
  }
  for (uint64_t ticket_id : tickets) receiver_->Abort(ticket_id).IgnoreError();
  absl::MutexLock lock(&mu_);
  auto streams_ended = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    for (const auto& [id, r] : requests_) {
      if (r->attached) return false;
    }
    return true;
  };
  mu_.AwaitWithTimeout(absl::Condition(&streams_ended), absl::Seconds(2));
  return false;
}

void DecodeWorker::TransferLoop() {
  bool joins_waiting = false;
  for (;;) {
    // A request waiting for its import's last copies joins within 0.2 ms of them.
    receiver_->RunFor(joins_waiting ? absl::Microseconds(200) : absl::Milliseconds(2));
    std::vector<Decided> decided;  // pushed by the receiver (OnOutcome) meanwhile
    {
      absl::MutexLock lock(&mu_);
      if (stopping_) return;
      decided.swap(decided_);
      SweepFinished();
    }
    for (const Decided& d : decided) HandleOutcome(d);
    if (early_importer_ == nullptr) continue;
    RunEarlyImports();
    absl::MutexLock lock(&mu_);
    joins_waiting = !deferred_joins_.empty();
  }
}

void DecodeWorker::SweepFinished() {
  const absl::Time now = absl::Now();
  std::vector<uint64_t> stale;
  for (const auto& [id, r] : requests_) {
    if (Ended(r->state) && !r->attached && now - r->done_at > kKeepFinished) stale.push_back(id);
  }
  for (uint64_t id : stale) {
    requests_[id]->events.clear();
    requests_[id]->done_at = absl::InfinitePast();
    MaybeForget(id);
  }
}

void DecodeWorker::OnOutcome(uint64_t ticket_id, uint64_t request_id,
                             const kv::TransferOutcome& outcome) {
  absl::MutexLock lock(&mu_);
  decided_.push_back({request_id, ticket_id, outcome});
}

void DecodeWorker::HandleOutcome(const Decided& d) {
  if (d.outcome.state == kv::TransferState::kVerified && d.outcome.commit) {
    {
      absl::MutexLock lock(&mu_);
      auto it = requests_.find(d.request_id);
      if (it == requests_.end() || it->second->ticket_id != d.ticket_id) return;
    }
    StartDecoding(d.request_id, *d.outcome.commit);
    return;
  }
  EndTransfer(d);
}

void DecodeWorker::EndTransfer(const Decided& d) {
  const kv::TransferOutcome& outcome = d.outcome;
  absl::MutexLock lock(&mu_);
  auto it = requests_.find(d.request_id);
  if (it == requests_.end() || !Receiving(it->second->state) ||
      it->second->ticket_id != d.ticket_id) {
    return;
  }
  Request& r = *it->second;
  if (outcome.state == kv::TransferState::kAbandoned) {
    // The prefill side stopped (failed, aborted, shut down) and fenced: not an isolation
    // error. The receiver releases the pages once no receive is in flight.
    spdlog::warn("request {}: {}", d.request_id, outcome.status.ToString());
    Finish(r, RequestEvent::kTransferEnded, "error", outcome.status);
  } else if (outcome.state == kv::TransferState::kFailed) {
    const std::optional<kv::IsolationError> kind = kv::GetIsolationError(outcome.status);
    if (kind) {
      isolation_failures_->WithLabels({std::string(kv::IsolationErrorName(*kind))}).Increment();
    }
    spdlog::warn("request {}: transfer failed verification: {}", d.request_id,
                 outcome.status.ToString());
    Finish(r, RequestEvent::kTransferEnded, "error", outcome.status);
  } else {
    Finish(r, RequestEvent::kTransferEnded, "abort", absl::OkStatus());
  }
  // The shared state never verified: no fork of it decodes.
  EndForks(r, outcome.state == kv::TransferState::kAborted ? "abort" : "error", outcome.status);
  MaybeForget(d.request_id);
}

void DecodeWorker::StartDecoding(uint64_t request_id, const kv::ControlMessage& commit) {
  std::shared_ptr<Request> record;
  {
    absl::MutexLock lock(&mu_);
    auto it = requests_.find(request_id);
    if (it == requests_.end() || !Receiving(it->second->state)) return;
    record = it->second;
  }
  if (absl::Status bad = CheckCommit(*record, commit); !bad.ok()) {
    // The pages verified against the ticket, but the commit does not fit the reservation:
    // nothing is forked or decoded from them.
    spdlog::error("{}", bad.ToString());
    absl::MutexLock lock(&mu_);
    if (!Receiving(record->state)) return;
    EndForks(*record, "error", bad);
    Finish(*record, RequestEvent::kEndAtStart, "error", bad);
    MaybeForget(request_id);
    return;
  }
  // The forks copy the verified pages before fork 0 may decode into (or free) them.
  for (size_t k = 0; k < record->forks.size(); ++k) {
    StartFork(*record, record->forks[k], commit.more_first_tokens[k]);
  }
  StartSequence(record, commit.first_token);
}

void DecodeWorker::StartSequence(const std::shared_ptr<Request>& record, int32_t first_token) {
  const uint64_t request_id = record->request_id;
  {
    absl::MutexLock lock(&mu_);
    if (!Receiving(record->state)) return;
    if (record->state == RequestState::kAbortedReceiving) {
      // Verified after the abort: the pages are ours, and nothing decodes them.
      Apply(*record, RequestEvent::kEndAtStart);
      MaybeForget(request_id);
      return;
    }
  }
  // The seed string is the reservation's (fork 0's id), as the prefill worker derives it.
  absl::StatusOr<serving::RequestSampler> sampler = serving::RequestSampler::Create(
      record->params, worker::SeedRequestId(record->group), model_.eos_ids, record->prompt,
      model_.config.vocab_size, model_.vocabulary);
  absl::StatusOr<std::optional<serving::FinishReason>> finish =
      sampler.ok() ? sampler->Record(record->choice, first_token)
                   : absl::StatusOr<std::optional<serving::FinishReason>>(sampler.status());
  absl::MutexLock lock(&mu_);
  Request& r = *record;
  if (!Receiving(r.state)) return;
  if (r.state == RequestState::kAbortedReceiving || !finish.ok()) {
    Finish(r, RequestEvent::kEndAtStart, "error", finish.status());
    MaybeForget(request_id);
    return;
  }
  if (EmitFirstToken(r, first_token, *finish)) return;
  r.context = MakeContext(record, std::move(*sampler));
  if (!DeferJoin(record, first_token)) JoinBatch(r, first_token);
}

bool DecodeWorker::EmitFirstToken(Request& r, int32_t first_token,
                                  const std::optional<serving::FinishReason>& finish) {
  v1::GenerateResponse first;
  first.add_token_ids(first_token);
  first.add_tokens()->set_token_id(first_token);
  r.generated = 1;
  tokens_total_->Increment();
  if (!finish) {
    r.events.push_back(std::move(first));
    return false;
  }
  first.set_finish_reason(serving::FinishReasonName(*finish));
  r.events.push_back(std::move(first));
  r.done_at = absl::Now();
  Apply(r, RequestEvent::kEndAtStart);
  return true;
}

std::shared_ptr<runtime::RequestContext> DecodeWorker::MakeContext(
    const std::shared_ptr<Request>& record, serving::RequestSampler sampler) {
  auto context = std::make_shared<runtime::RequestContext>(std::move(sampler));
  std::weak_ptr<Request> weak = record;
  const std::string action =
      options_.runner.degeneration == runtime::DegenerationAction::kStop ? "stop" : "flag";
  context->on_token = [this, weak, action](const runtime::TokenEvent& event) {
    std::shared_ptr<Request> req = weak.lock();
    if (!req) return true;
    absl::MutexLock inner(&mu_);
    if (req->state != RequestState::kDecoding) return true;
    v1::GenerateResponse response;
    response.add_token_ids(event.sampled.token);
    *response.add_tokens() = worker::SampledTokenToProto(event.sampled);
    if (event.degenerate && req->degeneration_kind.empty()) {
      req->degeneration_kind = event.degeneration_kind.empty() ? "repeat" : event.degeneration_kind;
      degenerate_->WithLabels({req->degeneration_kind, action}).Increment();
    }
    response.set_degenerate(!req->degeneration_kind.empty());
    response.set_degeneration_kind(req->degeneration_kind);
    ++req->generated;
    tokens_total_->Increment();
    const bool last = !event.finish_reason.empty();
    if (last) response.set_finish_reason(event.finish_reason);
    req->events.push_back(std::move(response));
    if (last) Apply(*req, RequestEvent::kFinalQueued);
    return false;
  };
  context->on_error = [this, weak](int32_t, const absl::Status& status) {
    std::shared_ptr<Request> req = weak.lock();
    if (!req) return;
    absl::MutexLock inner(&mu_);
    if (req->state == RequestState::kDecoding) {
      Finish(*req, RequestEvent::kFinalQueued, "error", status);
    }
  };
  return context;
}

void DecodeWorker::JoinBatch(Request& r, int32_t first_token) {
  runtime::SequenceSetup setup;
  setup.request = r.context;
  setup.choice = r.choice;
  setup.prompt = r.prompt;
  setup.max_tokens = r.params.max_tokens;
  setup.first_token = first_token;
  setup.canary = canary_.Picks(worker::SeedRequestId(r.request_id));
  absl::Status added = runner_->Add(r.sequence, std::move(setup));
  if (!added.ok()) {
    Finish(r, RequestEvent::kEndAtStart, "error", added);
    return;
  }
  Apply(r, RequestEvent::kJoinBatch);
}

void DecodeWorker::DecodeLoop() {
  const absl::Time loop_start = absl::Now();
  for (;;) {
    progress_.Beat();
    if (options_.faults.StallsLoop(loop_start)) {
      spdlog::warn("TEST-ONLY: the decode loop stalls (PDSERVE_TEST_STALL_DECODE_LOOP_MS)");
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(&stopping_));
      return;
    }
    serving::StepPlan plan;
    if (!PlanStep(plan)) return;
    if (!plan.decode.empty()) {
      const absl::Time start = absl::Now();
      runner_->Run(plan).IgnoreError();  // Never fails; per-sequence errors reach on_error.
      step_seconds_->Observe(absl::ToDoubleSeconds(absl::Now() - start));
      batch_size_->Observe(static_cast<double>(plan.decode.size()));
    }
    LeaveBatch();
  }
}

bool DecodeWorker::PlanStep(serving::StepPlan& plan) {
  absl::MutexLock lock(&mu_);
  auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (stopping_) return true;
    for (const auto& [id, r] : requests_) {
      if (InBatch(r->state)) return true;
    }
    return false;
  };
  mu_.AwaitWithTimeout(absl::Condition(&ready), absl::Milliseconds(20));
  if (stopping_) return false;
  for (const auto& [id, r] : requests_) {
    if (r->state != RequestState::kDecoding) continue;
    plan.decode.push_back({r->sequence, static_cast<int64_t>(r->prompt.size()) + r->generated - 1});
  }
  std::sort(plan.decode.begin(), plan.decode.end(),
            [](const serving::DecodeSlot& a, const serving::DecodeSlot& b) { return a.id < b.id; });
  return true;
}

void DecodeWorker::LeaveBatch() {
  // The step that used their pages is over, so the pages are free to go.
  absl::MutexLock lock(&mu_);
  std::vector<uint64_t> done;
  for (const auto& [id, r] : requests_) {
    if (InBatch(r->state) && r->state != RequestState::kDecoding) done.push_back(id);
  }
  for (uint64_t id : done) {
    Request& r = *requests_[id];
    runner_->Remove(r.sequence);
    r.done_at = absl::Now();
    Apply(r, RequestEvent::kLeaveBatch);
    MaybeForget(id);
  }
}

bool DecodeWorker::Apply(Request& request, RequestEvent event) {
  absl::StatusOr<RequestState> next = NextRequestState(request.state, event);
  if (!next.ok()) {
    // A bug: the request must not go on as if nothing happened. It fails; a decoding one leaves
    // the batch after the step, a receiving one waits for its transfer's end as an aborted one.
    spdlog::error("request {}: {}", request.request_id, next.status().ToString());
    if (FinalQueued(request.state)) return false;
    QueueFinal(request, "error", absl::InternalError(next.status().message()));
    Apply(request, request.state == RequestState::kDecoding ? RequestEvent::kFinalQueued
                                                            : RequestEvent::kAbort);
    return false;
  }
  const bool frees = HoldsPages(request.state) && !HoldsPages(*next);
  request.state = *next;
  // Ended without joining the batch: its early-imported slot goes back.
  if (!Receiving(request.state)) QueueImportCancel(request);
  // The worker's hold goes; the pages follow once an early import reading them lets go too.
  if (frees) {
    request.pages.reset();
    request.device_pages.reset();
  }
  return true;
}

void DecodeWorker::Finish(Request& request, RequestEvent event, std::string reason,
                          absl::Status error) {
  if (!FinalQueued(request.state)) QueueFinal(request, std::move(reason), error);
  Apply(request, event);
}

void DecodeWorker::QueueFinal(Request& request, std::string reason, const absl::Status& error) {
  v1::GenerateResponse response;
  response.set_finish_reason(std::move(reason));
  response.set_degenerate(!request.degeneration_kind.empty());
  response.set_degeneration_kind(request.degeneration_kind);
  if (!error.ok()) {
    response.set_isolation_error(kv::IsolationErrorToProto(error));
    response.set_error_message(std::string(error.message()));
  }
  request.events.push_back(std::move(response));
  request.done_at = absl::Now();
}

void DecodeWorker::MaybeForget(uint64_t request_id) {
  auto it = requests_.find(request_id);
  if (it == requests_.end()) return;
  Request& r = *it->second;
  if (r.state != RequestState::kDone || r.attached || !r.events.empty()) return;
  // A fork shares fork 0's ticket, which only fork 0 maps.
  if (r.ticket_id != 0 && r.fork == 0) by_ticket_.erase(r.ticket_id);
  requests_.erase(it);
}

void DecodeWorker::RememberAborted(uint64_t request_id) {
  if (!aborted_ids_.insert(request_id).second) return;
  aborted_order_.push_back(request_id);
  if (aborted_order_.size() > kAbortedRemembered) {
    aborted_ids_.erase(aborted_order_.front());
    aborted_order_.pop_front();
  }
}

void DecodeWorker::OnRelease(uint64_t ticket_id, const absl::Status& outcome) {
  absl::MutexLock lock(&mu_);
  auto found = by_ticket_.find(ticket_id);
  if (found == by_ticket_.end()) return;
  const uint64_t id = found->second;
  auto it = requests_.find(id);
  if (it == requests_.end()) return;
  Request& r = *it->second;
  if (r.state != RequestState::kReceiving) {
    if (Receiving(r.state)) {
      EndForks(r, "error", absl::AbortedError("the shared transfer was released unverified"));
    }
    Apply(r, RequestEvent::kReleased);
    MaybeForget(id);
    return;
  }
  // Released before the transfer loop saw an outcome: the receiver decided and released the
  // ticket in one sweep (a lease that ended unverified, or the sender's fence: abandoned).
  absl::Status error = outcome;
  if (error.ok()) {
    error = kv::MakeIsolationError(
        kv::IsolationError::kLease,
        absl::StrCat("ticket ", ticket_id, " was not verified before its lease ended"));
  }
  if (const std::optional<kv::IsolationError> kind = kv::GetIsolationError(error); kind) {
    isolation_failures_->WithLabels({std::string(kv::IsolationErrorName(*kind))}).Increment();
    spdlog::warn("request {}: transfer failed verification: {}", id, error.ToString());
  } else {
    spdlog::warn("request {}: {}", id, error.ToString());
  }
  EndForks(r, "error", error);
  Finish(r, RequestEvent::kReleased, "error", std::move(error));
  MaybeForget(id);
}

bool DecodeWorker::AbortRequest(uint64_t request_id, bool prefill_quiesced) {
  uint64_t ticket_id = 0;
  uint64_t fence_ticket_id = 0;
  {
    absl::MutexLock lock(&mu_);
    auto it = requests_.find(request_id);
    if (it == requests_.end()) {
      // Possibly an Abort that overtook its Reserve: that Reserve is refused.
      RememberAborted(request_id);
      return true;
    }
    Request& r = *it->second;
    Finish(r, RequestEvent::kAbort, "abort", absl::OkStatus());
    // The receiver knows the reservation by fork 0's ticket: it is aborted once no record of
    // the reservation waits for the state any more (a fork aborted alone leaves the transfer
    // to the others; its pages go back when the transfer ends).
    auto base = r.fork == 0 ? it : requests_.find(r.group);
    if (base != requests_.end() && Receiving(base->second->state) && !GroupWaiting(*base->second)) {
      ticket_id = base->second->ticket_id;
    }
    // Also for a request aborted before (e.g. its Generate was cancelled) whose pages still wait.
    if (prefill_quiesced && r.fork == 0 && HoldsPages(r.state) && !GroupWaiting(r)) {
      fence_ticket_id = r.ticket_id;
    }
  }
  if (ticket_id != 0) {
    // Pages go back through OnRelease behind the fence; a verified ticket is freed by
    // StartDecoding, which sees the abort.
    receiver_->Abort(ticket_id).IgnoreError();
  }
  // The prefill worker vouched that nothing is or will be in flight: the fence.
  if (fence_ticket_id != 0) receiver_->ConfirmFence(fence_ticket_id);
  absl::MutexLock lock(&mu_);
  auto it = requests_.find(request_id);
  return it == requests_.end() || !HoldsPages(it->second->state);
}

bool DecodeWorker::AbortRequests(uint64_t request_id, uint32_t count, bool prefill_quiesced) {
  bool quiesced = true;
  // Forks first: fork 0's abort then finds nothing waiting and aborts the transfer.
  for (uint32_t k = std::max<uint32_t>(count, 1); k-- > 0;) {
    quiesced = AbortRequest(request_id + k, prefill_quiesced) && quiesced;
  }
  return quiesced;
}

grpc::Status DecodeWorker::Generate(grpc::ServerContext* context,
                                    const v1::GenerateRequest* request,
                                    grpc::ServerWriter<v1::GenerateResponse>* writer) {
  const uint64_t id = request->request_id();
  std::shared_ptr<Request> record;
  {
    absl::MutexLock lock(&mu_);
    auto it = requests_.find(id);
    if (it == requests_.end()) {
      return grpc::Status(grpc::StatusCode::NOT_FOUND,
                          absl::StrCat("request ", id, " has no reservation"));
    }
    record = it->second;
    if (record->ticket_id != request->ticket_id()) {
      return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                          absl::StrCat("request ", id, " holds ticket ", record->ticket_id,
                                       ", not ", request->ticket_id()));
    }
    if (record->attached) {
      return grpc::Status(grpc::StatusCode::ALREADY_EXISTS,
                          absl::StrCat("request ", id, " is already being streamed"));
    }
    record->attached = true;
  }
  bool finished = false;
  while (!finished) {
    std::deque<v1::GenerateResponse> events;
    {
      absl::MutexLock lock(&mu_);
      auto has_events = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return !record->events.empty() || stopping_;
      };
      mu_.AwaitWithTimeout(absl::Condition(&has_events), absl::Milliseconds(50));
      events.swap(record->events);
      if (stopping_ && events.empty()) break;
    }
    for (v1::GenerateResponse& event : events) {
      finished = finished || !event.finish_reason().empty();
      if (!writer->Write(event)) break;
    }
    if (!finished && context->IsCancelled()) {
      AbortRequest(id, /*prefill_quiesced=*/false);
      break;
    }
  }
  absl::MutexLock lock(&mu_);
  record->attached = false;
  record->events.clear();
  MaybeForget(id);
  return grpc::Status::OK;
}

grpc::Status DecodeWorker::Abort(grpc::ServerContext*, const v1::AbortRequest* request,
                                 v1::AbortResponse* response) {
  // A shared reservation has at most kMaxChoices forks (Reserve refuses more), and their ids must
  // not wrap: anything else names no reservation and would only spin here.
  if (request->choice_count() > static_cast<uint32_t>(serving::kMaxChoices) ||
      request->request_id() > UINT64_MAX - std::max<uint32_t>(request->choice_count(), 1) + 1) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        absl::StrCat("choice_count must be in [0, ", serving::kMaxChoices,
                                     "] and request_id + choice_count must not wrap; got ",
                                     request->request_id(), " + ", request->choice_count()));
  }
  response->set_quiesced(
      AbortRequests(request->request_id(), request->choice_count(), request->prefill_quiesced()));
  return grpc::Status::OK;
}

DecodeWorker::RequestCounts DecodeWorker::CountRequests() const {
  absl::MutexLock lock(&mu_);
  RequestCounts counts;
  for (const auto& [id, r] : requests_) {
    counts.running += InBatch(r->state);
    counts.waiting += r->state == RequestState::kReceiving;
  }
  counts.quarantined_pages = QuarantinedPages();
  return counts;
}

int64_t DecodeWorker::QuarantinedPages() const {
  int64_t pages = 0;
  for (const auto& [id, r] : requests_) {
    if (Quarantined(r->state)) pages += TablePages(r->table);
  }
  return pages;
}

grpc::Status DecodeWorker::Stats(grpc::ServerContext*, const v1::StatsRequest*,
                                 v1::StatsResponse* response) {
  const kv::ReceiverStats stats = receiver_->stats();
  const RequestCounts counts = CountRequests();
  response->set_running_requests(static_cast<int32_t>(counts.running));
  response->set_waiting_requests(static_cast<int32_t>(counts.waiting));
  response->set_pages_quarantined(counts.quarantined_pages);
  worker::SetPoolPages(*pool_, response);
  for (int kind = 0; kind <= static_cast<int>(kv::IsolationError::kMissing); ++kind) {
    auto it = stats.isolation_errors.find(static_cast<kv::IsolationError>(kind));
    response->add_isolation_errors(
        it == stats.isolation_errors.end() ? 0 : static_cast<int64_t>(it->second));
  }
  response->set_transfer_bytes(static_cast<int64_t>(stats.bytes_landed));
  return grpc::Status::OK;
}

grpc::Status DecodeWorker::Health(grpc::ServerContext*, const v1::HealthRequest*,
                                  v1::HealthResponse* response) {
  response->set_state(draining_ ? v1::HealthResponse::STATE_DRAINING
                                : v1::HealthResponse::STATE_SERVING);
  response->set_role("decode");
  response->set_incarnation(receiver_->incarnation());
  response->set_model(options_.model_name);
  response->set_max_batch(options_.max_batch);
  response->set_model_fingerprint(model_.fingerprint);
  response->set_page_geometry(model_.page_geometry);
  return grpc::Status::OK;
}

std::string DecodeWorker::MetricsText() const {
  const RequestCounts counts = CountRequests();
  // The runner keeps the guard counts; the counters catch up to them here.
  const runtime::GuardCounts guards = runner_->guard_counts();
  canary_checks_->Increment(static_cast<double>(guards.canary_checks) - canary_checks_->Value());
  canary_mismatches_->Increment(static_cast<double>(guards.canary_mismatches) -
                                canary_mismatches_->Value());
  metrics::Counter& page_owner = isolation_failures_->WithLabels({"page_owner"});
  page_owner.Increment(static_cast<double>(guards.isolation_errors) - page_owner.Value());
  running_gauge_->Set(static_cast<double>(counts.running));
  waiting_gauge_->Set(static_cast<double>(counts.waiting));
  fenced_pages_->Set(static_cast<double>(counts.quarantined_pages));
  for (const auto& [label, pages] : serving::PoolPagesByLabel(*pool_)) {
    pages_used_->WithLabels({label}).Set(static_cast<double>(pages.used));
    pages_free_->WithLabels({label}).Set(static_cast<double>(pages.free));
  }
  return registry_.Serialize();
}

}  // namespace pdserve::decode
