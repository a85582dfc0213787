// A PageTransport decorator that injects faults into chosen messages, for tests (house style:
// a fault-injecting wrapper around the real transport, as leveldb's fault Env).
//
// Rules match a message by kind, optionally by ticket and, for pages, by slot; the first matching
// rule that still has uses left applies. Thread-safety: as the wrapped transport.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "absl/time/time.h"
#include "common/clock.h"
#include "kvtransfer/page_header.h"
#include "kvtransfer/page_transport.h"

namespace pdserve::kv {

struct FaultRule {
  enum class Action {
    kDrop,          // Report success without sending.
    kCorruptByte,   // Send a copy of the payload with byte `offset` inverted.
    kDuplicate,     // Send the message twice.
    kDelay,         // Hold the message until `delay` has passed on the clock.
    kDisconnect,    // Close the connection instead of sending.
    kRewriteHeader  // Send with `rewrite` applied to the decoded page header.
  };
  Action action = Action::kDrop;
  WireKind kind = WireKind::kPage;
  std::optional<uint32_t> slot;  // Pages only; nullopt matches every slot.
  size_t offset = 0;
  absl::Duration delay = absl::ZeroDuration();
  std::function<void(PageHeader&)> rewrite;
  int uses = 1;                       // How many messages the rule applies to; -1 for all.
  std::optional<uint64_t> ticket_id;  // nullopt matches every ticket.
};

// Whether `rule` (with uses left) applies to a message of `kind` for `ticket_id` and, for pages,
// `slot` (nullopt: the message could not be decoded). Shared by both fault decorators.
bool RuleMatches(const FaultRule& rule, WireKind kind, std::optional<uint64_t> ticket_id,
                 std::optional<uint32_t> slot);

class FaultInjectingTransport final : public PageTransport {
 public:
  // `inner` and `clock` must outlive this object.
  FaultInjectingTransport(PageTransport& inner, const Clock& clock)
      : inner_(inner), clock_(clock) {}

  void AddRule(FaultRule rule) { rules_.push_back(std::move(rule)); }
  // Messages held back by kDelay rules and not yet sent.
  size_t delayed() const;

  absl::StatusOr<PeerId> Connect(std::span<const std::byte> worker_address,
                                 uint64_t incarnation) override {
    return inner_.Connect(worker_address, incarnation);
  }
  absl::StatusOr<std::unique_ptr<SendOp>> Send(PeerId peer, WireKind kind,
                                               std::span<const std::byte> header,
                                               std::span<const std::byte> payload) override;
  void Progress() override;
  absl::Status PeerStatus(PeerId peer) const override { return inner_.PeerStatus(peer); }
  void Disconnect(PeerId peer) override { inner_.Disconnect(peer); }
  int lanes() const override { return inner_.lanes(); }

 private:
  class FaultOp;
  FaultRule* Match(WireKind kind, std::span<const std::byte> header,
                   std::span<const std::byte> payload);

  PageTransport& inner_;
  const Clock& clock_;
  std::vector<FaultRule> rules_;
  std::vector<FaultOp*> held_;  // Delayed ops, owned by their callers.
};

}  // namespace pdserve::kv
