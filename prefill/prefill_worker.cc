#include "prefill/prefill_worker.h"

#include <algorithm>
#include <random>
#include <span>
#include <thread>
#include <utility>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "common/histogram_buckets.h"
#include "common/model_fingerprint.h"
#include "common/status.h"
#include "kvtransfer/fault_transport.h"
#include "kvtransfer/ticket_proto.h"
#include "kvtransfer/ucx/ucx_lane.h"
#include "runtime/paged_state.h"
#include "serving/sampler.h"
#include "spdlog/spdlog.h"
#include "worker/transfer_peer.h"
#include "worker/wire.h"
#include "worker/worker_model.h"
#include "worker/worker_process.h"

namespace pdserve::prefill {
namespace v1 = pdserve::worker::v1;

namespace {

constexpr size_t kAbortedRemembered = 4096;

}  // namespace

absl::StatusOr<std::unique_ptr<PrefillWorker>> PrefillWorker::Create(PrefillWorkerOptions options) {
  std::unique_ptr<PrefillWorker> w(new PrefillWorker());
  w->options_ = std::move(options);
  PDSERVE_ASSIGN_OR_RETURN(w->model_,
                           worker::LoadWorkerModel(w->options_.model_dir, w->options_.model,
                                                   /*cpu_engine=*/!w->options_.engine_factory));
  const engine::ModelConfig& config = w->model_.config;
  if (w->options_.engine_factory) {
    const runtime::PrefillEngineContext context{w->options_.model_dir, &config,
                                                w->options_.prefill_block};
    PDSERVE_ASSIGN_OR_RETURN(w->engine_, w->options_.engine_factory(context));
  } else {
    PDSERVE_ASSIGN_OR_RETURN(
        w->engine_, runtime::CpuPrefillEngine(*w->model_.model, w->options_.prefill_block));
  }
  spdlog::info("prefill engine: {}", w->engine_->Describe());
  // Progress inside a chunk (Stats' forward_layers, the watchdog): a chunk of a long prompt can
  // take many seconds on a slow host. The engine is the worker's member, so `self` outlives it.
  w->engine_->set_layer_forwarded([self = w.get()](int64_t) {
    self->forward_layers_.fetch_add(1, std::memory_order_relaxed);
    self->progress_.Beat();
  });
  // One sequence at a time, of up to the context length.
  serving::PagePoolOptions pool_options =
      w->model_.layout->PoolOptions(1, config.max_position_embeddings);
  if (w->options_.transfer_shm_pull) {
    PDSERVE_ASSIGN_OR_RETURN(
        w->shared_pages_,
        kv::shm::SharedRegion::Create(
            kv::shm::kPagesPurpose,
            std::max<size_t>(1, serving::PagePool::HostBytesNeeded(pool_options))));
    pool_options.host_block = w->shared_pages_->bytes();
  }
  PDSERVE_ASSIGN_OR_RETURN(w->pool_, serving::PagePool::Create(std::move(pool_options)));
  if (w->shared_pages_ != nullptr) {
    PDSERVE_ASSIGN_OR_RETURN(w->pull_sender_, kv::shm::PullSender::Create(*w->shared_pages_));
    spdlog::info("transfer: shm pull on ({:.1f} MB page pool in memfd fd {})",
                 static_cast<double>(w->shared_pages_->bytes().size()) / 1e6,
                 w->shared_pages_->name().fd);
  }
  {
    absl::MutexLock lock(&w->run_mu_);
    PDSERVE_ASSIGN_OR_RETURN(
        w->transport_,
        kv::UcxTransport::Create(w->options_.transfer_lanes,
                                 /*post_on_lanes=*/true, w->options_.transfer_ucx_protocols));
    w->ucx_protocols_ = w->transport_->protocols();
    if (w->options_.device_arena.has_value()) {
      if (absl::Status arena = w->CreateDeviceArena(); !arena.ok()) {
        if (w->options_.device_arena->required) return arena;
        spdlog::warn("transfer: cuda ipc not offered (host pages only): {}", arena.ToString());
        w->arena_pool_.reset();
      }
    }
    if (w->options_.transfer_register_pages) {
      // The pool outlives the transport (members in that order), which unmaps these at its end.
      for (std::span<std::byte> block : w->pool_->HostBlocks()) {
        PDSERVE_RETURN_IF_ERROR(w->transport_->RegisterMemory(block));
      }
    }
  }
  w->incarnation_ = std::random_device{}() | (uint64_t{std::random_device{}()} << 32);

  metrics::Registry& r = w->registry_;
  PDSERVE_RETURN_IF_ERROR(metrics::AddBuildInfo(r, "prefill"));
  PDSERVE_ASSIGN_OR_RETURN(auto* tokens,
                           r.AddCounter("pdserve_prefill_tokens_total", "Prompt tokens prefilled"));
  w->tokens_total_ = &tokens->Get();
  PDSERVE_ASSIGN_OR_RETURN(
      auto* runs, r.AddCounter("pdserve_prefill_runs_total",
                               "Prompts run through the engine: one per Prefill, however many "
                               "choices it covers; kind shared: choice_count > 1",
                               {"kind"}));
  w->runs_single_ = &runs->WithLabels({"single"});
  w->runs_shared_ = &runs->WithLabels({"shared"});
  PDSERVE_ASSIGN_OR_RETURN(
      auto* depth, r.AddGauge("pdserve_prefill_queue_depth", "Requests waiting to be prefilled"));
  w->queue_depth_ = &depth->Get();
  PDSERVE_ASSIGN_OR_RETURN(
      auto* queue_timeouts,
      r.AddCounter("pdserve_prefill_queue_timeouts_total",
                   "Requests refused in the queue because their transfer lease would end first"));
  w->queue_timeouts_ = &queue_timeouts->Get();
  PDSERVE_ASSIGN_OR_RETURN(
      auto* chunk, r.AddHistogram("pdserve_prefill_chunk_tokens", "Tokens per prefill chunk", {},
                                  metrics::GeometricBuckets(16, 2, 16384)));
  w->chunk_tokens_ = &chunk->Get();
  PDSERVE_ASSIGN_OR_RETURN(auto* latency, r.AddHistogram("pdserve_prefill_latency_seconds",
                                                         "Prefill RPC received -> commit sent", {},
                                                         metrics::LatencyBucketsSeconds()));
  w->latency_ = &latency->Get();
  PDSERVE_ASSIGN_OR_RETURN(auto* bytes, r.AddCounter("pdserve_prefill_transfer_bytes_total",
                                                     "State-page bytes written to decode workers"));
  w->transfer_bytes_total_ = &bytes->Get();
  PDSERVE_ASSIGN_OR_RETURN(auto* seconds,
                           r.AddHistogram("pdserve_prefill_transfer_seconds",
                                          "One request's transfer: first post -> commit", {},
                                          metrics::LatencyBucketsSeconds()));
  w->transfer_seconds_ = &seconds->Get();
  PDSERVE_ASSIGN_OR_RETURN(auto* bandwidth,
                           r.AddHistogram("pdserve_prefill_transfer_bandwidth_bytes_per_second",
                                          "Per request bytes / transfer time", {},
                                          metrics::GeometricBuckets(1e8, 2.5, 1e11)));
  w->bandwidth_ = &bandwidth->Get();
  PDSERVE_ASSIGN_OR_RETURN(w->failures_, r.AddCounter("pdserve_prefill_transfer_failures_total",
                                                      "Failed transfers", {"reason"}));
  // At 0 from the start, so the transfer-failure alert's increase() sees the first one.
  w->failures_->ExportAtZero(
      {{"connect", "lease_expired", "cancelled", "remote_error", "prefill_error"}});
  PDSERVE_ASSIGN_OR_RETURN(auto* in_flight,
                           r.AddGauge("pdserve_prefill_transfers_in_flight",
                                      "Transfers posted and not yet committed or released"));
  w->in_flight_ = &in_flight->Get();
  PDSERVE_ASSIGN_OR_RETURN(w->transfer_metrics_, kv::TransferMetrics::Create(r, "send"));
  spdlog::info("transfer: {} send lane(s), UCX protocols {}, {} page-pool region(s) registered",
               w->options_.transfer_lanes, kv::UcxProtocolsName(w->transport_->protocols()),
               w->transport_->registered_regions());
  // Read at start, so that a value the switch does not accept is warned about now even where no
  // lane thread uses it (one lane).
  kv::LaneLinger();
  return w;
}

PrefillWorker::~PrefillWorker() = default;

bool PrefillWorker::Aborted(uint64_t request_id) const {
  absl::MutexLock lock(&mu_);
  return aborted_.contains(request_id);
}

void PrefillWorker::CountFailure(const absl::Status& status, bool aborted) {
  const char* reason = "remote_error";
  if (aborted) {
    reason = "cancelled";
  } else if (status.code() == absl::StatusCode::kDeadlineExceeded) {
    reason = "lease_expired";
  }
  failures_->WithLabels({reason}).Increment();
}

grpc::Status PrefillWorker::Prefill(grpc::ServerContext* context, const v1::PrefillRequest* request,
                                    v1::PrefillResponse* response) {
  const uint64_t id = request->request_id();
  {
    absl::MutexLock lock(&mu_);
    if (draining_) return grpc::Status(grpc::StatusCode::UNAVAILABLE, "the worker is draining");
    if (static_cast<int64_t>(active_.size()) - running_ >= options_.max_waiting) {
      return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                          absl::StrCat("the prefill queue holds ", options_.max_waiting,
                                       " requests (max_waiting); retry later"));
    }
    if (!active_.insert(id).second) {
      return grpc::Status(grpc::StatusCode::ALREADY_EXISTS,
                          absl::StrCat("request ", id, " is already being prefilled"));
    }
    queue_depth_->Set(static_cast<double>(active_.size() - running_));
  }
  const absl::Time start = absl::Now();
  absl::StatusOr<v1::PrefillResponse> result = RunPrefill(*request, *context);
  {
    absl::MutexLock lock(&mu_);
    active_.erase(id);
    queue_depth_->Set(static_cast<double>(active_.size() - running_));
  }
  if (!result.ok()) {
    LogFailure(id, result.status(), context->IsCancelled() || Aborted(id));
    return worker::ToGrpc(result.status());
  }
  latency_->Observe(absl::ToDoubleSeconds(absl::Now() - start));
  *response = std::move(*result);
  return grpc::Status::OK;
}

void PrefillWorker::LogFailure(uint64_t id, const absl::Status& status, bool cancelled_by_caller) {
  spdlog::level::level_enum level = worker::FailureLogLevel(status, cancelled_by_caller);
  // A misconfigured pair has every ticket refused, one per router health check: a warning when
  // the reason changes, the repeats at debug.
  const bool refused = worker::IsTicketMismatch(status);
  if (refused && !ticket_refusals_.Record({WithoutRequestId(std::string(status.message()))})) {
    level = spdlog::level::debug;
  }
  spdlog::log(level, "prefill of request {} failed: {}{}", id, status.ToString(),
              refused ? " (a refused ticket is logged again when the reason changes)" : "");
}

absl::StatusOr<PrefillWorker::Admitted> PrefillWorker::Admit(
    const v1::PrefillRequest& request) const {
  const engine::ModelConfig& config = model_.config;
  Admitted a;
  a.id = request.request_id();
  a.choice = static_cast<int32_t>(request.sampling().choice());
  a.choice_count = static_cast<int32_t>(worker::ChoiceCount(request.sampling()));
  a.prompt.assign(request.token_ids().begin(), request.token_ids().end());
  if (a.prompt.empty()) return absl::InvalidArgumentError("token_ids is empty");
  for (int32_t token : a.prompt) {
    if (token < 0 || token >= config.vocab_size) {
      return absl::InvalidArgumentError(
          absl::StrCat("token id ", token, " is outside the vocabulary of ", config.vocab_size));
    }
  }
  PDSERVE_ASSIGN_OR_RETURN(serving::SamplingParams params,
                           worker::SamplingFromProto(request.sampling(), config.vocab_size));
  a.prompt_length = static_cast<int64_t>(a.prompt.size());
  a.max_tokens = params.max_tokens;
  a.total = a.prompt_length + params.max_tokens;
  if (a.total > config.max_position_embeddings) {
    return absl::InvalidArgumentError(absl::StrCat("prompt (", a.prompt_length, ") + max_tokens (",
                                                   params.max_tokens, ") exceeds the context of ",
                                                   config.max_position_embeddings));
  }
  if (a.prompt_length > engine_->max_context()) {
    return absl::InvalidArgumentError(
        absl::StrCat("a prompt of ", a.prompt_length,
                     " tokens exceeds the prefill engine's context of ", engine_->max_context()));
  }
  PDSERVE_ASSIGN_OR_RETURN(
      a.ticket, CheckTicket(request, a, model_.fingerprint, ucx_protocols_, clock_.Now()));
  PDSERVE_ASSIGN_OR_RETURN(
      serving::RequestSampler sampler,
      serving::RequestSampler::Create(params, worker::SeedRequestId(a.id), model_.eos_ids, a.prompt,
                                      config.vocab_size, model_.vocabulary));
  a.sampler.emplace(std::move(sampler));
  return a;
}

absl::StatusOr<kv::Ticket> PrefillWorker::CheckTicket(const v1::PrefillRequest& request,
                                                      const Admitted& a, uint64_t fingerprint,
                                                      kv::UcxProtocols protocols, absl::Time now) {
  // The ticket states what Reserve reserved the pages for (0: not stated); any other prompt or
  // max_tokens would write pages the decode worker cannot use.
  const v1::TransferTicket& ticket_proto = request.ticket();
  if ((ticket_proto.reserved_prompt_tokens() != 0 &&
       ticket_proto.reserved_prompt_tokens() != a.prompt_length) ||
      (ticket_proto.reserved_max_tokens() != 0 &&
       ticket_proto.reserved_max_tokens() != a.max_tokens)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "request ", a.id, ": Prefill has a prompt of ", a.prompt_length, " tokens and max_tokens ",
        a.max_tokens, "; Reserve reserved ", ticket_proto.reserved_prompt_tokens(), " and ",
        ticket_proto.reserved_max_tokens()));
  }
  // A decode worker of another model would get state that means nothing to it.
  if (ticket_proto.model_fingerprint() != 0 && fingerprint != 0 &&
      ticket_proto.model_fingerprint() != fingerprint) {
    return worker::MarkTicketMismatch(absl::FailedPreconditionError(
        absl::StrCat("request ", a.id, ": the ticket's decode worker serves model fingerprint ",
                     common::FingerprintText(ticket_proto.model_fingerprint()), ", this worker ",
                     common::FingerprintText(fingerprint))));
  }
  // Pages sent under one UCX protocol implementation to a receiver under the other: UCX does not
  // promise the two interoperate, so the pair is refused before it connects.
  const v1::UcxProtocols mine = worker::UcxProtocolsToProto(protocols);
  if (ticket_proto.ucx_protocols() != v1::UCX_PROTOCOLS_UNSPECIFIED &&
      ticket_proto.ucx_protocols() != mine) {
    return worker::MarkTicketMismatch(absl::FailedPreconditionError(
        absl::StrCat("request ", a.id, ": the ticket's decode worker uses UCX protocols ",
                     worker::UcxProtocolsProtoName(ticket_proto.ucx_protocols()), ", this worker ",
                     worker::UcxProtocolsProtoName(mine),
                     " (transfer.ucx_protocols or UCX_PROTO_ENABLE must agree on both workers)")));
  }
  PDSERVE_ASSIGN_OR_RETURN(kv::Ticket ticket, kv::TicketFromProto(ticket_proto, now));
  if (ticket.request_id != a.id) {
    return absl::InvalidArgumentError(
        absl::StrCat("the ticket belongs to request ", ticket.request_id, ", not ", a.id));
  }
  return ticket;
}

absl::Status PrefillWorker::AwaitTurn(uint64_t id, absl::Time lease_deadline,
                                      const grpc::ServerContext& context) {
  // Waits for this request's turn (FIFO) or its abort / cancellation, whichever comes first: an
  // aborted queued request leaves at once (its Abort answers quiesced) and never starts. Nothing
  // renews the decode worker's lease before the transfer starts, so a request that has waited
  // half of the lease it came with gives up as RESOURCE_EXHAUSTED: the worker is busy, not
  // broken, the decode worker hears of it from the router before its lease turns into an
  // isolation error, and a request that does start has half its lease left for the transfer's
  // first heartbeats (the sender renews by the lease length it sees at Prepare).
  const absl::Time arrival = clock_.Now();
  const absl::Time give_up = arrival + (lease_deadline - arrival) / 2;
  absl::MutexLock lock(&mu_);
  run_queue_.push_back(id);
  auto turn = [this, id]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return aborted_.contains(id) || (!run_busy_ && run_queue_.front() == id);
  };
  // The timeout only re-checks the client's cancellation and the lease, which no Condition can
  // see.
  bool lease_ending = false;
  while (!mu_.AwaitWithTimeout(absl::Condition(&turn), absl::Milliseconds(50)) &&
         !context.IsCancelled()) {
    if (clock_.Now() >= give_up) {
      lease_ending = true;
      break;
    }
  }
  const bool mine = !lease_ending && !aborted_.contains(id) && !context.IsCancelled() &&
                    !run_busy_ && run_queue_.front() == id;
  run_queue_.erase(std::find(run_queue_.begin(), run_queue_.end(), id));
  if (lease_ending) {
    queue_timeouts_->Increment();
    return absl::ResourceExhaustedError(
        absl::StrCat("request ", id, " waited ", absl::FormatDuration(clock_.Now() - arrival),
                     " in the prefill queue and its transfer lease ends in ",
                     absl::FormatDuration(lease_deadline - clock_.Now()),
                     ": the prefill worker is busy; retry later"));
  }
  if (!mine) return absl::CancelledError(absl::StrCat("request ", id, " was aborted"));
  run_busy_ = true;
  progress_.Beat();
  ++running_;
  queue_depth_->Set(static_cast<double>(active_.size() - running_));
  return absl::OkStatus();
}

absl::StatusOr<std::vector<kv::PlannedPage>> PrefillWorker::CheckedPlan(
    const Admitted& a, const serving::PageTable& table) const {
  PDSERVE_ASSIGN_OR_RETURN(
      std::vector<kv::PlannedPage> plan,
      kv::PlanTransfer(*model_.layout, model_.layers, table, a.prompt_length, a.total));
  if (plan.size() != a.ticket.pages.size()) {
    return worker::MarkTicketMismatch(absl::FailedPreconditionError(absl::StrCat(
        "the ticket names ", a.ticket.pages.size(), " pages; a prompt of ", a.prompt_length,
        " tokens with max_tokens ", a.max_tokens, " has ", plan.size(),
        " (did Reserve get another prompt length or max_tokens, or does the decode worker serve "
        "another page geometry?)")));
  }
  // The pages go out in this worker's element type; the ticket's descriptors are the decode
  // worker's pages, in its own (docs/protocol.md, "Element types"): the same page when the
  // position and the values' count agree.
  for (size_t slot = 0; slot < plan.size(); ++slot) {
    const kv::PageDescriptor& mine = plan[slot].descriptor;
    const kv::PageDescriptor& theirs = a.ticket.pages[slot];
    const absl::StatusOr<uint64_t> wire = kv::WireBytes(theirs, mine.element);
    if (mine.layer != theirs.layer || mine.page_index != theirs.page_index ||
        mine.token_begin != theirs.token_begin || mine.token_end != theirs.token_end ||
        !wire.ok() || *wire != mine.bytes) {
      return worker::MarkTicketMismatch(absl::FailedPreconditionError(
          absl::StrCat("slot ", slot, " of the ticket does not match this worker's plan")));
    }
  }
  return plan;
}

absl::StatusOr<std::vector<kv::SourcePage>> PrefillWorker::PlanSources(
    const Admitted& a, serving::RequestId sequence, const serving::PageTable& table) {
  PDSERVE_ASSIGN_OR_RETURN(const std::vector<kv::PlannedPage> plan, CheckedPlan(a, table));
  std::vector<kv::SourcePage> sources;
  for (const kv::PlannedPage& page : plan) {
    PDSERVE_ASSIGN_OR_RETURN(std::span<std::byte> bytes, pool_->Data(sequence, page.handle));
    sources.push_back({bytes, page.descriptor.element});
  }
  return sources;
}

absl::StatusOr<std::unique_ptr<kv::Transfer>> PrefillWorker::StartTransfer(
    const Admitted& a, std::vector<kv::SourcePage> sources, kv::FaultInjectingTransport& faulty) {
  kv::PageTransport* transport = transport_.get();
  if (options_.faults.Apply(a.id, a.prompt_length, faulty)) {
    spdlog::warn("request {}: TEST-ONLY transfer faults applied", a.id);
    transport = &faulty;
  }
  // Test faults act on page messages: a transfer they apply to goes by active messages.
  kv::TransferSender sender(*transport, clock_,
                            {.max_in_flight_bytes = kv::InFlightBytesForLanes(transport->lanes()),
                             .metrics = transfer_metrics_.get(),
                             .path = options_.transfer_path,
                             .checksum_pool = engine_->transfer_pool(),
                             .shm_pull = transport == &faulty ? nullptr : pull_sender_.get()});
  absl::StatusOr<std::unique_ptr<kv::Transfer>> prepared =
      sender.PrepareWithElements(a.ticket, std::move(sources));
  if (!prepared.ok()) return PrepareFailed(prepared.status());
  // Only refusals are recorded: pulled transfers between two alike refusals log nothing.
  if (const absl::Status& refused = (*prepared)->pull_refusal();
      !refused.ok() && pull_refusals_.Record({std::string(refused.message())})) {
    spdlog::warn(
        "transfer: request {} goes by active messages, not shm pull: {} (logged again "
        "when the reason changes)",
        a.id, std::string(refused.message()));
  }
  return prepared;
}

absl::Status PrefillWorker::PrepareFailed(absl::Status status) {
  // Prepare says DeadlineExceeded for a ticket whose lease already ended.
  failures_
      ->WithLabels(
          {status.code() == absl::StatusCode::kDeadlineExceeded ? "lease_expired" : "connect"})
      .Increment();
  return worker::MarkTransferPeerFailure(std::move(status));
}

absl::Status PrefillWorker::Check(uint64_t id, Sending& sending) {
  progress_.Beat();  // a chunk, a layer posted, or a poll of the transfer
  if (Aborted(id) || sending.context.IsCancelled()) {
    return sending.Fail(absl::CancelledError(absl::StrCat("request ", id, " was aborted")));
  }
  absl::StatusOr<bool> polled = sending.transfer.Poll();
  if (!polled.ok()) return sending.Fail(polled.status());
  return absl::OkStatus();
}

absl::StatusOr<std::vector<serving::SampledToken>> PrefillWorker::PrefillPages(
    Admitted& a, const serving::PageTable& table, Sending& sending, Timing* t) {
  // Chunked prefill on the engine (runtime/prefill_engine.h): each layer's pages are posted as
  // soon as the engine has stored the layer's final state (on the CPU engine while later layers
  // compute; on the CUDA engine after the forward, while later layers copy to the host).
  PDSERVE_ASSIGN_OR_RETURN(runtime::SequencePages pages, runtime::MapPages(*pool_, table));
  const runtime::PagedState paged(model_.config, *model_.layout, a.total);
  const runtime::PrefillEngine::LayerStored post_layer = [&](int64_t layer) -> absl::Status {
    t->first_post = std::min(t->first_post, absl::Now());
    if (absl::Status posted = sending.transfer.PostLayer(static_cast<uint32_t>(layer));
        !posted.ok()) {
      return sending.Fail(posted);
    }
    return Check(a.id, sending);
  };
  const runtime::PrefillEngine::ChunkDone chunk_done = [&](int64_t tokens) {
    chunk_tokens_->Observe(static_cast<double>(tokens));
    prefilled_tokens_.fetch_add(tokens);
    return Check(a.id, sending);
  };
  t->prefill_start = absl::Now();
  PDSERVE_ASSIGN_OR_RETURN(std::vector<float> last,
                           engine_->Run(a.prompt, paged, pages, post_layer, chunk_done));
  PDSERVE_ASSIGN_OR_RETURN(std::vector<serving::SampledToken> first, SampleFirst(a, last));
  t->prefill_end = absl::Now();
  return first;
}

absl::StatusOr<std::vector<serving::SampledToken>> PrefillWorker::SampleFirst(
    Admitted& a, std::span<const float> last) {
  tokens_total_->Increment(static_cast<double>(a.prompt_length));
  (a.choice_count > 1 ? runs_shared_ : runs_single_)->Increment();
  // Each covered choice draws from its own stream (seed, choice, position): the same logits give
  // every choice the first token the colocated service samples for it.
  std::vector<serving::SampledToken> first;
  for (int32_t k = 0; k < a.choice_count; ++k) {
    PDSERVE_ASSIGN_OR_RETURN(serving::SampleStep step, a.sampler->Next(a.choice + k, last));
    first.push_back(std::move(step.sampled));
  }
  return first;
}

absl::Status PrefillWorker::Deliver(const Admitted& a, std::span<const serving::SampledToken> first,
                                    Sending& sending) {
  std::vector<int32_t> more;
  for (size_t k = 1; k < first.size(); ++k) more.push_back(first[k].token);
  if (absl::Status committed = sending.transfer.Commit(static_cast<int32_t>(a.prompt_length),
                                                       first[0].token, std::move(more));
      !committed.ok()) {
    return sending.Fail(committed);
  }
  for (;;) {
    PDSERVE_RETURN_IF_ERROR(Check(a.id, sending));
    absl::StatusOr<bool> delivered = sending.transfer.Poll();
    if (!delivered.ok()) return sending.Fail(delivered.status());
    if (*delivered) break;
    std::this_thread::yield();
  }
  if (absl::Status released = sending.transfer.Release(); !released.ok()) {
    return sending.Fail(released);
  }
  return absl::OkStatus();
}

void PrefillWorker::RecordTransfer(const kv::Ticket& ticket, const Timing& t, bool pulled) {
  const uint64_t bytes = ticket.total_bytes();
  transfer_bytes_ += static_cast<int64_t>(bytes);
  if (pulled) transfer_bytes_pulled_ += static_cast<int64_t>(bytes);
  transfer_bytes_total_->Increment(static_cast<double>(bytes));
  const double transfer_seconds = absl::ToDoubleSeconds(t.transfer_end - t.first_post);
  transfer_seconds_->Observe(transfer_seconds);
  if (transfer_seconds > 0) bandwidth_->Observe(static_cast<double>(bytes) / transfer_seconds);
}

v1::PrefillResponse PrefillWorker::Response(const Admitted& a,
                                            std::span<const serving::SampledToken> first,
                                            const Timing& t) {
  v1::PrefillResponse response;
  v1::TransferCommit* commit = response.mutable_commit();
  commit->set_ticket_id(a.ticket.ticket_id);
  commit->set_epoch(a.ticket.epoch);
  commit->set_pages_sent(static_cast<uint32_t>(a.ticket.pages.size()));
  commit->set_prompt_tokens(static_cast<int32_t>(a.prompt_length));
  commit->set_first_token(first[0].token);
  for (size_t k = 1; k < first.size(); ++k) {
    commit->add_more_first_tokens(first[k].token);
    *response.add_more_first_tokens() = worker::SampledTokenToProto(first[k]);
  }
  response.set_prefill_us(absl::ToInt64Microseconds(t.prefill_end - t.prefill_start));
  response.set_transfer_us(absl::ToInt64Microseconds(t.transfer_end - t.first_post));
  *response.mutable_first_token() = worker::SampledTokenToProto(first[0]);
  response.set_transfer_bytes(a.ticket.total_bytes());
  return response;
}

absl::StatusOr<v1::PrefillResponse> PrefillWorker::PrefillAndSend(Admitted& a,
                                                                  const serving::PageTable& table,
                                                                  Sending& sending) {
  Timing t;
  PDSERVE_ASSIGN_OR_RETURN(std::vector<serving::SampledToken> first,
                           PrefillPages(a, table, sending, &t));
  PDSERVE_RETURN_IF_ERROR(Deliver(a, first, sending));
  t.transfer_end = absl::Now();
  RecordTransfer(a.ticket, t, sending.transfer.pulled());
  return Response(a, first, t);
}

absl::Status PrefillWorker::Failed(absl::Status status, bool transfer_error, bool aborted) {
  if (!transfer_error) {
    failures_->WithLabels({"prefill_error"}).Increment();
    return status;
  }
  CountFailure(status, aborted);
  // A cancellation this worker was asked for (the router's Abort or cancelled call, or the
  // drain's abort) is not the decode worker's doing. Any other, e.g. "the decode worker refused
  // the page", is: marked, so the router neither reads it as this worker's drain nor counts it
  // against this worker (router/request.h RefusedByDrainAsDown).
  if (status.code() == absl::StatusCode::kCancelled && aborted) return status;
  return worker::MarkTransferPeerFailure(status);
}

absl::StatusOr<v1::PrefillResponse> PrefillWorker::RunPrefill(const v1::PrefillRequest& request,
                                                              const grpc::ServerContext& context) {
  PDSERVE_ASSIGN_OR_RETURN(Admitted a, Admit(request));
  PDSERVE_RETURN_IF_ERROR(AwaitTurn(a.id, a.ticket.lease_deadline, context));
  absl::Cleanup not_running = [this] {
    absl::MutexLock lock(&mu_);
    --running_;
    run_busy_ = false;
    progress_.Idle();  // no prefill runs: nothing to be stuck in
  };
  absl::MutexLock run(&run_mu_);  // Uncontended: run_busy_ admits one prefill at a time.
  if (AsksDevicePages(a.ticket)) return RunDevicePrefill(a, context);

  // This worker's own copy of the request's pages: the transfer's sources.
  const serving::RequestId sequence = next_sequence_++;
  PDSERVE_ASSIGN_OR_RETURN(serving::PageTable table,
                           pool_->Allocate(sequence, model_.layout->Demand(a.total)));
  absl::Cleanup free_table = [this, &table] { pool_->Free(table).IgnoreError(); };
  PDSERVE_ASSIGN_OR_RETURN(std::vector<kv::SourcePage> sources, PlanSources(a, sequence, table));
  kv::FaultInjectingTransport faulty(*transport_, clock_);
  PDSERVE_ASSIGN_OR_RETURN(std::unique_ptr<kv::Transfer> transfer,
                           StartTransfer(a, std::move(sources), faulty));
  in_flight_->Add(1);
  absl::Cleanup not_in_flight = [this] { in_flight_->Add(-1); };
  // Every failure from here on is one failed transfer (the Transfer fences on destruction):
  // counted once, by the transfer's error, or "prefill_error" when the prefill itself failed.
  Sending sending{*transfer, context};
  absl::StatusOr<v1::PrefillResponse> result = PrefillAndSend(a, table, sending);
  if (!result.ok())
    return Failed(result.status(), sending.transfer_error, Aborted(a.id) || context.IsCancelled());
  return result;
}

void PrefillWorker::RememberAborted(uint64_t request_id) {
  if (aborted_.insert(request_id).second) {
    aborted_order_.push_back(request_id);
    if (aborted_order_.size() > kAbortedRemembered) {
      aborted_.erase(aborted_order_.front());
      aborted_order_.pop_front();
    }
  }
}

void PrefillWorker::BeginDrain() {
  absl::MutexLock lock(&mu_);
  draining_ = true;
}

bool PrefillWorker::Drain(absl::Duration timeout) {
  BeginDrain();
  absl::MutexLock lock(&mu_);
  auto idle = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return active_.empty(); };
  if (mu_.AwaitWithTimeout(absl::Condition(&idle), timeout)) return true;
  spdlog::warn("drain: {} prefills still running after {}; aborting them", active_.size(),
               absl::FormatDuration(timeout));
  for (uint64_t id : active_) RememberAborted(id);
  mu_.AwaitWithTimeout(absl::Condition(&idle), absl::Seconds(5));
  return false;
}

grpc::Status PrefillWorker::Abort(grpc::ServerContext*, const v1::AbortRequest* request,
                                  v1::AbortResponse* response) {
  const uint64_t id = request->request_id();
  absl::MutexLock lock(&mu_);
  RememberAborted(id);
  // The prefill's Transfer cancels its sends and fences before the RPC leaves active_.
  auto gone = [this, id]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !active_.contains(id); };
  const bool quiesced = mu_.AwaitWithTimeout(absl::Condition(&gone), absl::Seconds(5));
  response->set_quiesced(quiesced);
  return grpc::Status::OK;
}

grpc::Status PrefillWorker::Stats(grpc::ServerContext*, const v1::StatsRequest*,
                                  v1::StatsResponse* response) {
  {
    absl::MutexLock lock(&mu_);
    response->set_running_requests(running_);
    response->set_waiting_requests(static_cast<int32_t>(active_.size()) - running_);
  }
  worker::SetPoolPages(*pool_, response);
  response->set_pages_quarantined(0);
  response->set_transfer_bytes(transfer_bytes_.load());
  response->set_transfer_bytes_pulled(transfer_bytes_pulled_.load());
  response->set_prefilled_tokens(prefilled_tokens_.load());
  response->set_forward_layers(forward_layers_.load(std::memory_order_relaxed));
  return grpc::Status::OK;
}

grpc::Status PrefillWorker::Health(grpc::ServerContext*, const v1::HealthRequest*,
                                   v1::HealthResponse* response) {
  response->set_state(draining_ ? v1::HealthResponse::STATE_DRAINING
                                : v1::HealthResponse::STATE_SERVING);
  response->set_role("prefill");
  response->set_incarnation(incarnation_);
  response->set_model(options_.model_name);
  response->set_model_fingerprint(model_.fingerprint);
  response->set_page_geometry(model_.page_geometry);
  if (arena_pool_ != nullptr) {
    response->mutable_cuda_ipc()->set_boot_id(arena_.name.boot_id);
    response->mutable_cuda_ipc()->set_pci_bus_id(arena_.name.pci_bus_id);
  }
  return grpc::Status::OK;
}

}  // namespace pdserve::prefill
