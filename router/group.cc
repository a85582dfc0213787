// RouterService's shared reservations: the n choices of a request go as one group (router/
// request.h): the lead's members, its Prefill answer given to each, and whether the group may be
// tried again.
#include <memory>
#include <utility>

#include "router/request.h"
#include "router/service.h"

namespace pdserve::router {

// Whether a failed attempt's group may be tried again on other workers: no token of any of its
// choices reached the client, the request is still wanted, and it has tries left (counted on
// choice 0, the lead's). The group is retried as a whole (one Reserve, one prefill).
bool RouterService::CanRetry(Request& request, const Attempt& attempt) const {
  const Attempt& lead = attempt.lead != nullptr ? *attempt.lead : attempt;
  for (const Choice& choice : request.choices) {
    if (choice.any_token()) return false;
  }
  return !request.ended && !request.cancelled.load() && !lead.over() &&
         request.choices[static_cast<size_t>(lead.choice)].attempts < options_.max_attempts;
}

void RouterService::PrefillAnswered(Request& request, const Attempt& lead, Attempt& attempt,
                                    bool* retry, bool* retry_decode, Actions* actions) {
  if (&attempt != &lead) {
    const int k = attempt.choice - lead.choice;
    if (k - 1 < lead.prefilled.more_first_tokens_size()) {
      *attempt.prefilled.mutable_first_token() = lead.prefilled.more_first_tokens(k - 1);
    }
  }
  request.Move(attempt, AttemptEvent::kPrefillAnswered, actions);
  // Replays what Generate sent while the first token's logprobs were awaited.
  while (!attempt.held.empty() && !attempt.over() && !request.ended) {
    wv1::GenerateResponse event = std::move(attempt.held.front());
    attempt.held.pop_front();
    *retry = HandleEvent(request, attempt, event, actions) || *retry;
  }
  attempt.held.clear();
  if (attempt.held_done) {
    const grpc::Status done = *attempt.held_done;
    attempt.held_done.reset();
    *retry_decode = HandleDone(request, attempt, done, actions) || *retry_decode;
  }
}

int RouterService::GroupChoice(const Attempt& attempt) {
  return attempt.lead != nullptr ? attempt.lead->choice : attempt.choice;
}

bool RouterService::AddMembers(Request& request, Attempt& lead, Actions* actions) {
  for (int k = 1; k < lead.count; ++k) {
    auto member = std::make_shared<Attempt>();
    member->choice = lead.choice + k;
    member->count = 0;
    member->lead = lead.shared_from_this();
    member->prefill_index = lead.prefill_index;
    member->decode_index = lead.decode_index;
    member->prefill = lead.prefill;
    member->decode = lead.decode;
    member->request_id = lead.request_id + static_cast<uint64_t>(k);
    member->ticket_id = lead.ticket_id;
    member->generate.set_request_id(member->request_id);
    member->generate.set_ticket_id(member->ticket_id);
    if (!request.Move(*member, AttemptEvent::kReserved, actions)) return false;
    request.choices[static_cast<size_t>(member->choice)].current = member;
    lead.members.push_back(member);
  }
  return true;
}

}  // namespace pdserve::router
