// DecodeWorker's Reserve: the request record, its admission (a batch slot and its state pages)
// and its registration with the transfer receiver, which issues the ticket.
#include <algorithm>
#include <cstdint>
#include <span>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "common/status.h"
#include "decode/decode_worker.h"
#include "kvtransfer/ticket_proto.h"
#include "kvtransfer/transfer_plan.h"
#include "serving/sampler.h"
#include "worker/wire.h"
#include "worker/worker_model.h"
#include "worker/worker_process.h"

namespace pdserve::decode {
namespace v1 = pdserve::worker::v1;

grpc::Status DecodeWorker::Reserve(grpc::ServerContext*, const v1::ReserveRequest* request,
                                   v1::ReserveResponse* response) {
  absl::StatusOr<v1::TransferTicket> ticket = DoReserve(*request);
  if (!ticket.ok()) return worker::ToGrpc(ticket.status());
  *response->mutable_ticket() = std::move(*ticket);
  return grpc::Status::OK;
}

absl::StatusOr<v1::TransferTicket> DecodeWorker::DoReserve(const v1::ReserveRequest& request) {
  if (draining_) return absl::UnavailableError("the worker is draining");
  PDSERVE_ASSIGN_OR_RETURN(std::shared_ptr<Request> record, NewRequest(request));
  const auto choice_count = static_cast<int32_t>(worker::ChoiceCount(request.sampling()));
  if (request.request_id() > UINT64_MAX - static_cast<uint64_t>(std::max(choice_count, 1)) + 1) {
    return absl::InvalidArgumentError(absl::StrCat("request_id ", request.request_id(), " + ",
                                                   choice_count,
                                                   " choices would wrap the worker request ids"));
  }
  PDSERVE_RETURN_IF_ERROR(CheckForkFit(*record, choice_count));
  kv::ReceiveSpec spec;
  {
    absl::MutexLock lock(&mu_);
    PDSERVE_ASSIGN_OR_RETURN(spec, AdmitLocked(*record, choice_count));
    requests_[record->request_id] = record;
    for (const std::shared_ptr<Request>& fork : record->forks) requests_[fork->request_id] = fork;
  }
  // The GPU slot is claimed with the reservation, before the ticket can leave: with the pages
  // landed in device memory where the request's prefill worker and this worker can, else as
  // host pages.
  if (!BeginDeviceImport(*record, request, choice_count, &spec)) {
    BeginEarlyImport(*record, choice_count);
  }
  return Register(std::move(record), std::move(spec));
}

absl::StatusOr<std::shared_ptr<DecodeWorker::Request>> DecodeWorker::NewRequest(
    const v1::ReserveRequest& request) const {
  const engine::ModelConfig& config = model_.config;
  const uint64_t id = request.request_id();
  PDSERVE_ASSIGN_OR_RETURN(serving::SamplingParams params,
                           worker::SamplingFromProto(request.sampling(), config.vocab_size));
  PDSERVE_RETURN_IF_ERROR(
      serving::CheckMinTokensReachable(params, model_.eos_ids, config.vocab_size));
  const int64_t prompt_length = request.prompt_tokens();
  if (prompt_length < 1) return absl::InvalidArgumentError("prompt_tokens must be >= 1");
  if (prompt_length + params.max_tokens > config.max_position_embeddings) {
    return absl::InvalidArgumentError(
        absl::StrCat("prompt_tokens (", prompt_length, ") + max_tokens (", params.max_tokens,
                     ") exceeds the context of ", config.max_position_embeddings));
  }
  auto record = std::make_shared<Request>();
  record->request_id = id;
  record->group = id;
  record->choice = static_cast<int32_t>(request.sampling().choice());
  record->params = params;
  if (request.prompt_token_ids_size() > 0) {
    if (request.prompt_token_ids_size() != prompt_length) {
      return absl::InvalidArgumentError(absl::StrCat("prompt_token_ids has ",
                                                     request.prompt_token_ids_size(),
                                                     " ids, prompt_tokens says ", prompt_length));
    }
    record->prompt.assign(request.prompt_token_ids().begin(), request.prompt_token_ids().end());
  } else if (params.repetition_penalty != 1.0) {
    return absl::InvalidArgumentError(
        "repetition_penalty needs the prompt: send prompt_token_ids with Reserve");
  } else {
    record->prompt.assign(prompt_length, 0);
  }
  // Fails early on a bad id or parameter, before anything is allocated.
  PDSERVE_RETURN_IF_ERROR(serving::RequestSampler::Create(params, worker::SeedRequestId(id),
                                                          model_.eos_ids, record->prompt,
                                                          config.vocab_size, model_.vocabulary)
                              .status());
  // A demand larger than the whole pool can never be met, however long one waits: refused with
  // its own code before anything is reserved (RESOURCE_EXHAUSTED means "not now").
  const serving::PageDemand demand = Demand(prompt_length + params.max_tokens);
  for (int32_t k = 0; k < pool_->num_kinds() && k < static_cast<int32_t>(demand.size()); ++k) {
    if (demand[k] > pool_->pages_total(k)) {
      return absl::FailedPreconditionError(absl::StrCat(
          "prompt ", prompt_length, " + max_tokens ", params.max_tokens, " tokens need ", demand[k],
          " state pages of kind '", pool_->kind(k).name,
          "', more than this decode worker's whole pool holds (", pool_->pages_total(k),
          runtime::DeviceStatePools::Names(pool_->kind(k).name)
              ? absl::StrCat("; its GPU state pools hold state_tokens ",
                             options_.device_state_tokens.value_or(0), " tokens")
              : "",
          "): the request can never be served here; lower max_tokens"));
    }
  }
  return record;
}

absl::StatusOr<kv::ReceiveSpec> DecodeWorker::AdmitLocked(Request& record, int32_t choice_count) {
  const uint64_t id = record.request_id;
  const int64_t prompt_length = static_cast<int64_t>(record.prompt.size());
  const int64_t total = prompt_length + record.params.max_tokens;
  if (stopping_) return absl::UnavailableError("the worker is stopping");
  if (requests_.contains(id)) {
    return absl::AlreadyExistsError(absl::StrCat("request ", id, " is already reserved"));
  }
  if (aborted_ids_.contains(id)) {
    return absl::AbortedError(absl::StrCat("request ", id, " was aborted before it was reserved"));
  }
  // A batch slot is taken by a request in the batch (an aborted one until the step in flight is
  // over: it still holds its runner slot) or one that may still join it. One aborted or failed
  // before joining only holds pages (behind its fence), which the pool's own check below counts.
  int64_t holding = 0;
  for (const auto& [rid, r] : requests_) {
    holding += InBatch(r->state) || r->state == RequestState::kReceiving;
  }
  if (holding + choice_count > options_.max_batch) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "no free batch slot",
        choice_count > 1 ? absl::StrCat("s for ", choice_count, " choices") : "", ": ", holding,
        " requests are receiving or decoding (max_batch ", options_.max_batch, ")"));
  }
  record.sequence = next_sequence_++;
  absl::StatusOr<serving::PageTable> table = pool_->Allocate(record.sequence, Demand(total));
  if (!table.ok()) {
    // The pool names its owner, our internal sequence number; the caller knows the request id.
    const std::string detail = absl::StrReplaceAll(
        table.status().message(), {{absl::StrCat("request ", record.sequence, " "), ""}});
    const int64_t fenced = QuarantinedPages();
    return absl::Status(
        table.status().code(),
        absl::StrCat("request ", id, " (prompt ", prompt_length, " + max_tokens ",
                     record.params.max_tokens, " tokens): out of state pages: ", detail,
                     fenced > 0 ? absl::StrCat(" (", fenced,
                                               " pages are held by aborted or failed requests "
                                               "until their fence or lease)")
                                : ""));
  }
  record.table = std::move(*table);
  record.pages = serving::PageLease::Hold(pool_.get(), record.table);
  absl::StatusOr<kv::ReceiveSpec> spec = ReceiveSpecFor(record, total);
  if (spec.ok()) {
    if (absl::Status forks = AdmitForksLocked(record, choice_count); !forks.ok()) spec = forks;
  }
  if (!spec.ok()) record.pages.reset();
  return spec;
}

absl::StatusOr<kv::ReceiveSpec> DecodeWorker::ReceiveSpecFor(const Request& record,
                                                             int64_t total_tokens) {
  PDSERVE_ASSIGN_OR_RETURN(
      std::vector<kv::PlannedPage> plan,
      kv::PlanTransfer(*model_.layout, model_.layers, record.table,
                       static_cast<int64_t>(record.prompt.size()), total_tokens));
  kv::ReceiveSpec spec;
  spec.request_id = record.request_id;
  spec.epoch = kv::TableEpoch(record.table);
  for (const kv::PlannedPage& page : plan) {
    PDSERVE_ASSIGN_OR_RETURN(std::span<std::byte> bytes, pool_->Data(record.sequence, page.handle));
    spec.pages.push_back(page.descriptor);
    spec.destinations.push_back(bytes);
  }
  return spec;
}

absl::StatusOr<v1::TransferTicket> DecodeWorker::Register(std::shared_ptr<Request> record,
                                                          kv::ReceiveSpec spec) {
  const uint64_t id = record->request_id;
  absl::StatusOr<kv::Ticket> ticket = receiver_->Expect(std::move(spec));
  bool aborted = false;
  {
    absl::MutexLock lock(&mu_);
    if (!ticket.ok()) {
      Apply(*record, RequestEvent::kTransferLost);  // the receiver never held the pages
      requests_.erase(id);
      for (const std::shared_ptr<Request>& fork : record->forks) {
        Apply(*fork, RequestEvent::kEndAtStart);
        requests_.erase(fork->request_id);
      }
      return ticket.status();
    }
    record->ticket_id = ticket->ticket_id;
    for (const std::shared_ptr<Request>& fork : record->forks) fork->ticket_id = ticket->ticket_id;
    by_ticket_[ticket->ticket_id] = id;
    aborted = record->state == RequestState::kAbortedReceiving;
  }
  if (aborted) {
    // Aborted while its pages were being registered (AbortRequest saw no ticket yet). The ticket
    // never left this process, so nothing can write into the pages: they go back at once.
    receiver_->Abort(ticket->ticket_id).IgnoreError();
    receiver_->ConfirmFence(ticket->ticket_id);
    absl::MutexLock lock(&mu_);
    Apply(*record, RequestEvent::kRefused);
    record->events.clear();  // the "abort" event: nobody will stream a refused reservation
    MaybeForget(id);
    RememberAborted(id);
    for (const std::shared_ptr<Request>& fork : record->forks) {
      // The whole reservation is refused; its forks' pages were never anyone else's.
      if (Receiving(fork->state)) Apply(*fork, RequestEvent::kEndAtStart);
      fork->events.clear();
      MaybeForget(fork->request_id);
      RememberAborted(fork->request_id);
    }
    return absl::AbortedError(absl::StrCat("request ", id, " was aborted while being reserved"));
  }
  v1::TransferTicket proto = kv::TicketToProto(*ticket, clock_.Now());
  proto.set_reserved_prompt_tokens(static_cast<int32_t>(record->prompt.size()));
  proto.set_reserved_max_tokens(record->params.max_tokens);
  proto.set_model_fingerprint(model_.fingerprint);
  proto.set_ucx_protocols(worker::UcxProtocolsToProto(ucx_protocols_));
  return proto;
}

}  // namespace pdserve::decode
