#include "kvtransfer/fault_receive_transport.h"

#include <cstring>
#include <utility>

#include "kvtransfer/page_header.h"
#include "kvtransfer/ticket.h"

namespace pdserve::kv {

FaultInjectingReceiveTransport::FaultInjectingReceiveTransport(
    std::unique_ptr<ReceiveTransport> inner, const Clock& clock)
    : inner_(std::move(inner)), clock_(clock) {
  inner_->SetSink(this);
}

void FaultInjectingReceiveTransport::Progress() {
  inner_->Progress();
  const absl::Time now = clock_.Now();
  std::vector<Staged> due;
  for (auto it = held_.begin(); it != held_.end();) {
    if (it->release_at <= now) {
      due.push_back(std::move(*it));
      it = held_.erase(it);
    } else {
      ++it;
    }
  }
  for (const Staged& staged : due) Show(staged);
}

std::function<void(absl::Duration)> FaultInjectingReceiveTransport::ArmWait() {
  return inner_->ArmWait();
}

const FaultRule* FaultInjectingReceiveTransport::Match(WireKind kind,
                                                       std::optional<uint64_t> ticket_id,
                                                       std::optional<uint32_t> slot) {
  for (FaultRule& rule : rules_) {
    if (!RuleMatches(rule, kind, ticket_id, slot)) continue;
    if (rule.uses > 0) --rule.uses;
    return &rule;
  }
  return nullptr;
}

std::optional<LandingTarget> FaultInjectingReceiveTransport::OnPageHeader(
    std::span<const std::byte> header, size_t length) {
  auto decoded = DecodePageHeader(header);
  const FaultRule* rule = decoded.ok() ? Match(WireKind::kPage, decoded->ticket_id, decoded->slot)
                                       : Match(WireKind::kPage, std::nullopt, std::nullopt);
  if (rule == nullptr) return sink_->OnPageHeader(header, length);
  Staged staged{.kind = WireKind::kPage,
                .header = {header.begin(), header.end()},
                .bytes = std::vector<std::byte>(length),
                .action = rule->action,
                .offset = rule->offset,
                .release_at = clock_.Now() + rule->delay};
  if (rule->action == FaultRule::Action::kRewriteHeader && decoded.ok()) {
    rule->rewrite(*decoded);
    const auto encoded = EncodePageHeader(*decoded);
    staged.header.assign(encoded.begin(), encoded.end());
  }
  const uint64_t id = kStagedBit | next_staged_++;
  Staged& stored = landing_[id] = std::move(staged);
  return LandingTarget{stored.bytes, id, 0, {}};
}

void FaultInjectingReceiveTransport::OnPageLanded(uint64_t ticket_id, uint32_t slot,
                                                  absl::Status status, uint64_t finished) {
  if ((ticket_id & kStagedBit) == 0) {
    sink_->OnPageLanded(ticket_id, slot, std::move(status), finished);
    return;
  }
  auto found = landing_.find(ticket_id);
  if (found == landing_.end()) return;
  Staged staged = std::move(found->second);
  landing_.erase(found);
  if (status.ok()) Apply(std::move(staged));  // A page that never arrived has no fault to shape.
}

void FaultInjectingReceiveTransport::OnControl(std::span<const std::byte> bytes) {
  auto decoded = DecodeControl(bytes);
  const FaultRule* rule =
      decoded.ok() ? Match(decoded->kind, decoded->ticket_id, std::nullopt) : nullptr;
  if (rule == nullptr) {
    sink_->OnControl(bytes);
    return;
  }
  Apply({.kind = decoded->kind,
         .bytes = {bytes.begin(), bytes.end()},
         .action = rule->action,
         .release_at = clock_.Now() + rule->delay});
}

void FaultInjectingReceiveTransport::Apply(Staged staged) {
  switch (staged.action) {
    case FaultRule::Action::kDrop:
      return;
    case FaultRule::Action::kCorruptByte:
      if (!staged.bytes.empty())
        staged.bytes[staged.offset % staged.bytes.size()] ^= std::byte{0xFF};
      Show(staged);
      return;
    case FaultRule::Action::kDuplicate:
      Show(staged);
      Show(staged);
      return;
    case FaultRule::Action::kDelay:
      held_.push_back(std::move(staged));
      return;
    case FaultRule::Action::kDisconnect:
      if (staged.kind != WireKind::kPage) return;
      if (auto target = sink_->OnPageHeader(staged.header, staged.bytes.size())) {
        sink_->OnPageLanded(target->ticket_id, target->slot,
                            absl::UnavailableError("injected: sender lost mid-page"), 0);
      }
      return;
    case FaultRule::Action::kRewriteHeader:
      Show(staged);
      return;
  }
}

void FaultInjectingReceiveTransport::Show(const Staged& staged) {
  if (staged.kind != WireKind::kPage) {
    sink_->OnControl(staged.bytes);
    return;
  }
  const std::optional<LandingTarget> target =
      sink_->OnPageHeader(staged.header, staged.bytes.size());
  if (!target.has_value()) return;
  std::memcpy(target->destination.data(), staged.bytes.data(), staged.bytes.size());
  sink_->OnPageLanded(target->ticket_id, target->slot, absl::OkStatus(), FinishLanding(*target));
}

}  // namespace pdserve::kv
