// DecodeWorker's shared reservations (worker.v1 SamplingParams.choice_count = n > 1): the n
// choices of a request share one Reserve, one prefill and one transfer. Reserve gives every fork
// its own batch slot and pages (all or nothing); only fork 0's pages are the transfer's
// destination. Once the transfer verified (checksums, epoch, ownership: never before), each fork
// copies fork 0's transferred pages into its own, each page read and written through its owner's
// handle (so the pool's ownership checks hold for every fork), records its own first token from
// the commit and decodes with its own stream (seed, choice + k, position), exactly as choice
// choice + k runs colocated. A transfer that fails ends every fork; no fork is ever started from
// unverified state.
#include <cstring>
#include <span>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "decode/decode_worker.h"
#include "kvtransfer/transfer_plan.h"
#include "spdlog/spdlog.h"

namespace pdserve::decode {

absl::Status DecodeWorker::CheckForkFit(const Request& record, int32_t choice_count) const {
  if (choice_count <= 1) return absl::OkStatus();
  if (choice_count > options_.max_batch) {
    return absl::FailedPreconditionError(absl::StrCat(
        "n = ", choice_count, " choices share one prefill and decode on one worker, which needs ",
        choice_count, " batch slots; this decode worker runs at most ", options_.max_batch,
        " sequences (max_batch): lower n"));
  }
  const int64_t total = static_cast<int64_t>(record.prompt.size()) + record.params.max_tokens;
  const serving::PageDemand demand = Demand(total);
  for (int32_t k = 0; k < pool_->num_kinds() && k < static_cast<int32_t>(demand.size()); ++k) {
    if (demand[k] * choice_count > pool_->pages_total(k)) {
      return absl::FailedPreconditionError(absl::StrCat(
          "n = ", choice_count, " choices of prompt ", record.prompt.size(), " + max_tokens ",
          record.params.max_tokens, " tokens need ", demand[k] * choice_count,
          " state pages of kind '", pool_->kind(k).name, "' (", demand[k],
          " per choice), more than this decode worker's whole pool holds (", pool_->pages_total(k),
          "): lower n or max_tokens"));
    }
  }
  return absl::OkStatus();
}

absl::Status DecodeWorker::AdmitForksLocked(Request& record, int32_t choice_count) {
  const int64_t total = static_cast<int64_t>(record.prompt.size()) + record.params.max_tokens;
  const serving::PageDemand demand = Demand(total);
  std::vector<std::shared_ptr<Request>> forks;
  absl::Status status;
  for (int32_t k = 1; k < choice_count && status.ok(); ++k) {
    const uint64_t id = record.request_id + static_cast<uint64_t>(k);
    if (requests_.contains(id) || aborted_ids_.contains(id)) {
      status = absl::AlreadyExistsError(absl::StrCat("worker request ", id, " (fork ", k,
                                                     " of request ", record.request_id,
                                                     ") is already reserved or was aborted"));
      break;
    }
    auto fork = std::make_shared<Request>();
    fork->request_id = id;
    fork->group = record.request_id;
    fork->fork = k;
    fork->choice = record.choice + k;
    fork->params = record.params;
    fork->prompt = record.prompt;
    fork->sequence = next_sequence_++;
    absl::StatusOr<serving::PageTable> table = pool_->Allocate(fork->sequence, demand);
    if (!table.ok()) {
      status = absl::Status(
          table.status().code(),
          absl::StrCat("request ", record.request_id, ": out of state pages for fork ", k, " of ",
                       choice_count, " choices (prompt ", record.prompt.size(), " + max_tokens ",
                       record.params.max_tokens, " tokens each): ", table.status().message()));
      break;
    }
    fork->table = std::move(*table);
    fork->pages = serving::PageLease::Hold(pool_.get(), fork->table);
    forks.push_back(std::move(fork));
  }
  if (!status.ok()) {
    forks.clear();  // their holds go, and with them their pages
    return status;
  }
  record.forks = std::move(forks);
  return absl::OkStatus();
}

absl::Status DecodeWorker::CheckCommit(const Request& record, const kv::ControlMessage& commit) {
  if (commit.prompt_tokens != static_cast<int64_t>(record.prompt.size())) {
    return absl::FailedPreconditionError(
        absl::StrCat("request ", record.request_id, ": the commit says ", commit.prompt_tokens,
                     " prompt tokens, Reserve reserved ", record.prompt.size()));
  }
  if (commit.more_first_tokens.size() != record.forks.size()) {
    return absl::FailedPreconditionError(
        absl::StrCat("request ", record.request_id, ": the commit carries first tokens for ",
                     commit.more_first_tokens.size() + 1, " choices, Reserve reserved ",
                     record.forks.size() + 1, ": no choice is decoded from this state"));
  }
  return absl::OkStatus();
}

absl::Status DecodeWorker::CopyVerifiedPages(const Request& base, const Request& fork) {
  const int64_t prompt = static_cast<int64_t>(base.prompt.size());
  const int64_t total = prompt + base.params.max_tokens;
  PDSERVE_ASSIGN_OR_RETURN(
      std::vector<kv::PlannedPage> from,
      kv::PlanTransfer(*model_.layout, model_.layers, base.table, prompt, total));
  PDSERVE_ASSIGN_OR_RETURN(
      std::vector<kv::PlannedPage> to,
      kv::PlanTransfer(*model_.layout, model_.layers, fork.table, prompt, total));
  if (from.size() != to.size()) {
    return absl::InternalError(absl::StrCat("fork ", fork.fork, " plans ", to.size(),
                                            " pages, the transferred state has ", from.size()));
  }
  for (size_t slot = 0; slot < from.size(); ++slot) {
    // Each side through its owner's handle: the pool refuses a page the sequence does not own.
    PDSERVE_ASSIGN_OR_RETURN(std::span<std::byte> src,
                             pool_->Data(base.sequence, from[slot].handle));
    PDSERVE_ASSIGN_OR_RETURN(std::span<std::byte> dst, pool_->Data(fork.sequence, to[slot].handle));
    if (src.size() != dst.size()) {
      return absl::InternalError(absl::StrCat("slot ", slot, ": page sizes differ"));
    }
    std::memcpy(dst.data(), src.data(), src.size());
  }
  return absl::OkStatus();
}

void DecodeWorker::StartFork(const Request& base, const std::shared_ptr<Request>& fork,
                             int32_t first_token) {
  {
    absl::MutexLock lock(&mu_);
    if (fork->state == RequestState::kAbortedReceiving) {
      // Aborted while the state was on its way: its pages were never written; they go back.
      Apply(*fork, RequestEvent::kEndAtStart);
      MaybeForget(fork->request_id);
      return;
    }
    if (fork->state != RequestState::kReceiving) return;
  }
  // Neither sequence is in the batch yet: this thread is the only one touching their pages.
  if (absl::Status copied = CopyVerifiedPages(base, *fork); !copied.ok()) {
    spdlog::error("request {}: fork {} of request {} could not copy the verified state: {}",
                  fork->request_id, fork->fork, base.request_id, copied.ToString());
    absl::MutexLock lock(&mu_);
    if (!Receiving(fork->state)) return;
    Finish(*fork, RequestEvent::kEndAtStart, "error", copied);
    MaybeForget(fork->request_id);
    return;
  }
  StartSequence(fork, first_token);
}

void DecodeWorker::EndForks(Request& base, const std::string& reason, const absl::Status& error) {
  for (const std::shared_ptr<Request>& fork : base.forks) {
    if (!Receiving(fork->state)) continue;
    Finish(*fork, RequestEvent::kEndAtStart, reason, error);
    MaybeForget(fork->request_id);
  }
}

bool DecodeWorker::GroupWaiting(const Request& base) {
  if (base.state == RequestState::kReceiving) return true;
  for (const std::shared_ptr<Request>& fork : base.forks) {
    if (fork->state == RequestState::kReceiving) return true;
  }
  return false;
}

}  // namespace pdserve::decode
