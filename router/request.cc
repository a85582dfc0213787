#include "router/request.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "spdlog/spdlog.h"

namespace pdserve::router {

void RunActions(Actions& actions) {
  for (auto& action : actions) action();
  actions.clear();
}

bool RouterService::Request::Move(int choice, ChoiceEvent event, Actions* actions) {
  Choice& c = choices[static_cast<size_t>(choice)];
  absl::StatusOr<ChoiceState> next = NextChoiceState(c.state, event);
  if (next.ok()) {
    c.state = *next;
    return true;
  }
  spdlog::error("router: request {} choice {}: {}", prepared.request_id, choice,
                next.status().ToString());
  Fail(frontend::ServerError(500, absl::StrCat("internal error: ", next.status().message()),
                             "server_error"),
       actions);
  return false;
}

bool RouterService::Request::Move(Attempt& attempt, AttemptEvent event, Actions* actions) {
  absl::StatusOr<AttemptState> next = NextAttemptState(attempt.state, event);
  if (next.ok()) {
    attempt.state = *next;
    return true;
  }
  spdlog::error("router: request {} attempt {}: {}", prepared.request_id, attempt.request_id,
                next.status().ToString());
  Fail(frontend::ServerError(500, absl::StrCat("internal error: ", next.status().message()),
                             "server_error"),
       actions);
  return false;
}

void RouterService::Request::AbortAttempt(Attempt& attempt, Actions* actions, bool whole_group) {
  if (attempt.state == AttemptState::kAborted) return;
  const bool started = StreamsStarted(attempt.state);
  if (!Move(attempt, AttemptEvent::kAbort, actions)) return;
  const uint64_t id = attempt.request_id, ticket = attempt.ticket_id;
  Worker* prefill = attempt.prefill;
  Worker* decode = attempt.decode;
  std::shared_ptr<Attempt> a = attempt.shared_from_this();
  RouterService* owner = service;
  const bool member = attempt.lead != nullptr;
  // A member's fork is covered by its lead's abort of the whole reservation.
  const bool covered = member && attempt.lead->group_aborted;
  uint32_t forks = 1;
  if (!member && whole_group) {
    attempt.group_aborted = true;
    forks = static_cast<uint32_t>(attempt.count);
  }
  actions->push_back([=] {
    if (!member) {
      owner->SendAbortPrefillThenDecode(*prefill, *decode, id, ticket, forks);
    } else if (!covered) {
      owner->SendAbort(*decode, id, ticket);  // its own fork; the prefill is the lead's
    }
    a->reserve_context.TryCancel();
    if (started) {
      if (!member) a->prefill_context.TryCancel();
      a->generate_context.TryCancel();
    }
  });
}

void RouterService::Request::AbortAll(Actions* actions) {
  // Choice 0 (a lead) comes first: its abort covers the forks its members stream.
  for (Choice& choice : choices) {
    if (choice.current && !choice.current->over()) {
      AbortAttempt(*choice.current, actions, /*whole_group=*/true);
    }
  }
}

std::vector<std::shared_ptr<RouterService::Attempt>> RouterService::Request::Group(Attempt& lead) {
  std::vector<std::shared_ptr<Attempt>> group = {lead.shared_from_this()};
  for (const std::weak_ptr<Attempt>& weak : lead.members) {
    if (std::shared_ptr<Attempt> member = weak.lock()) group.push_back(std::move(member));
  }
  return group;
}

void RouterService::Request::MoveOthers(ChoiceEvent event, Actions* actions) {
  for (size_t c = 1; c < choices.size(); ++c) {
    if (!Move(static_cast<int>(c), event, actions)) return;
  }
}

void RouterService::Request::Fail(frontend::ApiError error, Actions* actions) {
  if (ended) return;
  ended = true;
  spdlog::warn("router: request {} failed: {} {}", prepared.request_id, error.http_status,
               error.message);
  service->RecordFinish(*this, error.http_status, "error");
  // Before the answer: the metrics agree by the time the client sees it.
  Unqueue("cancelled", actions);
  if (!cancelled.load()) sink->OnError(std::move(error));
  AbortAll(actions);
}

void RouterService::Request::Unqueue(const char* outcome, Actions* actions) {
  for (size_t c = 0; c < choices.size(); ++c) {
    // Not waiting any more when the queue is trying it right now (its Reserve may be in flight);
    // that try finds the request ended and sends nothing. Its wait ends here all the same, or
    // no outcome would ever count it (pdserve_router_queued_total counted it).
    if (choices[c].state == ChoiceState::kQueued && choices[c].queue_ticket != 0 &&
        service->queue_ != nullptr) {
      service->queue_->Remove(choices[c].queue_ticket);
    }
    Move(static_cast<int>(c), ChoiceEvent::kRequestEnded, actions);
    EndWait(static_cast<int>(c), outcome);
  }
}

void RouterService::Request::EndWait(int choice, const char* outcome) {
  std::optional<absl::Time>& since = choices[static_cast<size_t>(choice)].queued_since;
  if (!since) return;
  service->queue_wait_->WithLabels({outcome}).Observe(absl::ToDoubleSeconds(absl::Now() - *since));
  since.reset();
}

void RouterService::Request::Emit(frontend::ChoiceDelta delta, int new_tokens) {
  const absl::Time now = absl::Now();
  if (new_tokens > 0) {
    if (!first_token) {
      first_token = now;
      service->ttft_->WithLabels({endpoint}).Observe(absl::ToDoubleSeconds(now - received));
    } else {
      service->itl_->WithLabels({endpoint}).Observe(absl::ToDoubleSeconds(now - last_token));
    }
    last_token = now;
    tokens += new_tokens;
    service->generation_tokens_->Get().Increment(new_tokens);
  }
  if (delta.HasPayload()) {
    const std::string& kind = choices[static_cast<size_t>(delta.index)].degeneration;
    if (!kind.empty()) delta.degeneration_kind = kind;
    if (!cancelled.load()) sink->OnDelta(std::move(delta));
  }
}

void RouterService::Request::ChoiceDone(Attempt& attempt, Actions* actions) {
  Move(attempt, AttemptEvent::kEnd, actions);
  Move(attempt.choice, ChoiceEvent::kFinish, actions);
  if (--remaining > 0 || ended) return;
  ended = true;
  frontend::Usage usage{static_cast<int64_t>(prepared.prompt.size()), 0};
  for (const Choice& c : choices) {
    usage.completion_tokens += c.text.tokens();
    usage.reasoning_tokens += c.text.reasoning_tokens();
  }
  const absl::Time now = absl::Now();
  service->e2e_->WithLabels({endpoint}).Observe(absl::ToDoubleSeconds(now - received));
  if (first_token && tokens > 1) {
    service->tpot_->WithLabels({endpoint})
        .Observe(absl::ToDoubleSeconds(now - *first_token) / static_cast<double>(tokens - 1));
  }
  service->RecordFinish(*this, 200, "");
  if (!cancelled.load()) sink->OnComplete(usage);
}

}  // namespace pdserve::router
