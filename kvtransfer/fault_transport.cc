#include "kvtransfer/fault_transport.h"

#include <algorithm>

#include "kvtransfer/ticket.h"

namespace pdserve::kv {

// One message as the faults shaped it: owns any rewritten header or payload copy, the inner ops
// that carry it, and, while delayed, everything needed to send it later.
class FaultInjectingTransport::FaultOp final : public SendOp {
 public:
  FaultOp(FaultInjectingTransport& owner, PeerId peer, WireKind kind,
          std::span<const std::byte> header, std::span<const std::byte> payload)
      : owner_(owner),
        peer_(peer),
        kind_(kind),
        header_(header.begin(), header.end()),
        payload_(payload) {}
  ~FaultOp() override {
    auto& held = owner_.held_;
    held.erase(std::remove(held.begin(), held.end(), this), held.end());
  }

  void CorruptPayload(size_t offset) {
    owned_payload_.assign(payload_.begin(), payload_.end());
    if (!owned_payload_.empty()) {
      owned_payload_[offset % owned_payload_.size()] ^= std::byte{0xFF};
    }
    payload_ = owned_payload_;
  }
  std::vector<std::byte>& header() { return header_; }
  void Hold(absl::Time until) {
    release_at_ = until;
    owner_.held_.push_back(this);
  }
  absl::Time release_at() const { return release_at_; }
  void Complete(absl::Status status) { result_ = std::move(status); }

  // Sends one copy of the message through the inner transport.
  void SendCopy() {
    auto op = owner_.inner_.Send(peer_, kind_, header_, payload_);
    if (op.ok()) {
      inner_.push_back(std::move(*op));
    } else {
      result_ = op.status();
    }
  }

  std::optional<absl::Status> Test() override {
    if (result_.has_value()) return result_;
    if (inner_.empty()) return std::nullopt;  // Still held back.
    absl::Status combined;
    for (auto& op : inner_) {
      std::optional<absl::Status> status = op->Test();
      if (!status.has_value()) return std::nullopt;
      combined.Update(*status);
    }
    return combined;
  }

  void Cancel() override {
    for (auto& op : inner_) op->Cancel();
    if (inner_.empty() && !result_.has_value()) {
      result_ = absl::CancelledError("delayed send cancelled");
      auto& held = owner_.held_;
      held.erase(std::remove(held.begin(), held.end(), this), held.end());
    }
  }

 private:
  FaultInjectingTransport& owner_;
  PeerId peer_;
  WireKind kind_;
  std::vector<std::byte> header_;
  std::span<const std::byte> payload_;
  std::vector<std::byte> owned_payload_;
  std::vector<std::unique_ptr<SendOp>> inner_;
  std::optional<absl::Status> result_;
  absl::Time release_at_ = absl::InfinitePast();
};

size_t FaultInjectingTransport::delayed() const { return held_.size(); }

bool RuleMatches(const FaultRule& rule, WireKind kind, std::optional<uint64_t> ticket_id,
                 std::optional<uint32_t> slot) {
  if (rule.uses == 0 || rule.kind != kind) return false;
  if (rule.ticket_id.has_value() && rule.ticket_id != ticket_id) return false;
  return !rule.slot.has_value() || rule.slot == slot;
}

FaultRule* FaultInjectingTransport::Match(WireKind kind, std::span<const std::byte> header,
                                          std::span<const std::byte> payload) {
  std::optional<uint32_t> slot;
  std::optional<uint64_t> ticket_id;
  if (kind == WireKind::kPage) {
    auto decoded = DecodePageHeader(header);
    if (decoded.ok()) {
      slot = decoded->slot;
      ticket_id = decoded->ticket_id;
    }
  } else if (auto decoded = DecodeControl(payload); decoded.ok()) {
    ticket_id = decoded->ticket_id;
  }
  for (FaultRule& rule : rules_) {
    if (!RuleMatches(rule, kind, ticket_id, slot)) continue;
    if (rule.uses > 0) --rule.uses;
    return &rule;
  }
  return nullptr;
}

absl::StatusOr<std::unique_ptr<SendOp>> FaultInjectingTransport::Send(
    PeerId peer, WireKind kind, std::span<const std::byte> header,
    std::span<const std::byte> payload) {
  auto op = std::make_unique<FaultOp>(*this, peer, kind, header, payload);
  const FaultRule* rule = Match(kind, header, payload);
  if (rule == nullptr) {
    op->SendCopy();
    return op;
  }
  switch (rule->action) {
    case FaultRule::Action::kDrop:
      op->Complete(absl::OkStatus());
      break;
    case FaultRule::Action::kCorruptByte:
      op->CorruptPayload(rule->offset);
      op->SendCopy();
      break;
    case FaultRule::Action::kDuplicate:
      op->SendCopy();
      op->SendCopy();
      break;
    case FaultRule::Action::kDelay:
      op->Hold(clock_.Now() + rule->delay);
      break;
    case FaultRule::Action::kDisconnect:
      inner_.Disconnect(peer);
      op->SendCopy();
      break;
    case FaultRule::Action::kRewriteHeader: {
      auto decoded = DecodePageHeader(op->header());
      if (decoded.ok()) {
        rule->rewrite(*decoded);
        const auto encoded = EncodePageHeader(*decoded);
        op->header().assign(encoded.begin(), encoded.end());
      }
      op->SendCopy();
      break;
    }
  }
  return op;
}

void FaultInjectingTransport::Progress() {
  const absl::Time now = clock_.Now();
  std::vector<FaultOp*> due;
  for (FaultOp* op : held_) {
    if (op->release_at() <= now) due.push_back(op);
  }
  for (FaultOp* op : due) {
    held_.erase(std::remove(held_.begin(), held_.end(), op), held_.end());
    op->SendCopy();
  }
  inner_.Progress();
}

}  // namespace pdserve::kv
