// A ReceiveTransport decorator that injects faults into chosen arriving messages, for tests: the
// receive-side mirror of FaultInjectingTransport, with the same FaultRule (matched by kind and,
// for pages, by slot; the first matching rule with uses left applies).
//
// A faulted page is received into a staging buffer of the decorator (its sender's send completes
// as usual) and then shown to the sink as the fault shapes it: kDrop never shows it; kCorruptByte
// lands it with byte `offset` inverted; kDuplicate shows it twice; kDelay holds it until `delay`
// passed on the clock and shows it in a later Progress(), after what arrived meanwhile (a
// reordering); kDisconnect lets the sink accept it and then fails the landing (a sender lost
// mid-page); kRewriteHeader shows it under the rewritten header. Control messages take kDrop,
// kDuplicate and kDelay. Untouched messages pass straight through.
//
// Thread-safety: as the wrapped transport (the owner serializes every call); AddRule and held()
// are serialized with it by the caller too.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <vector>

#include "common/clock.h"
#include "kvtransfer/fault_transport.h"
#include "kvtransfer/receive_transport.h"

namespace pdserve::kv {

class FaultInjectingReceiveTransport final : public ReceiveTransport, private PageSink {
 public:
  // `clock` must outlive this object.
  FaultInjectingReceiveTransport(std::unique_ptr<ReceiveTransport> inner, const Clock& clock);

  void AddRule(FaultRule rule) { rules_.push_back(std::move(rule)); }
  // Messages held back by kDelay rules and not yet shown to the sink.
  size_t held() const { return held_.size(); }

  void SetSink(PageSink* sink) override { sink_ = sink; }
  std::vector<std::byte> address() const override { return inner_->address(); }
  absl::Status RegisterMemory(std::span<std::byte> memory) override {
    return inner_->RegisterMemory(memory);
  }
  void Progress() override;
  std::function<void(absl::Duration)> ArmWait() override;
  // A threaded inner transport calls this decorator's sink side under the owner's mutex, which
  // also serializes Progress: the decorator's state needs no lock of its own.
  int lanes() const override { return inner_->lanes(); }
  void SetSinkMutex(absl::Mutex* sink_mutex) override { inner_->SetSinkMutex(sink_mutex); }
  void Stop() override { inner_->Stop(); }

 private:
  // One faulted message, owned here until it is shown to the sink.
  struct Staged {
    WireKind kind = WireKind::kPage;
    std::vector<std::byte> header;  // Pages.
    std::vector<std::byte> bytes;   // The page's payload or the control message.
    FaultRule::Action action = FaultRule::Action::kDrop;
    size_t offset = 0;
    absl::Time release_at;
  };
  // Staged pages land under ticket ids with this bit set (a receiver never issues one).
  static constexpr uint64_t kStagedBit = uint64_t{1} << 63;

  // PageSink of the inner transport.
  std::optional<LandingTarget> OnPageHeader(std::span<const std::byte> header,
                                            size_t length) override;
  void OnPageLanded(uint64_t ticket_id, uint32_t slot, absl::Status status,
                    uint64_t finished) override;
  void OnControl(std::span<const std::byte> bytes) override;

  const FaultRule* Match(WireKind kind, std::optional<uint64_t> ticket_id,
                         std::optional<uint32_t> slot);
  // Shapes `staged` by its action and shows it to the sink (or holds it).
  void Apply(Staged staged);
  // Shows one message to the sink as it stands.
  void Show(const Staged& staged);

  std::unique_ptr<ReceiveTransport> inner_;
  const Clock& clock_;
  PageSink* sink_ = nullptr;
  std::vector<FaultRule> rules_;
  std::map<uint64_t, Staged> landing_;  // Staged pages the inner transport is landing, by id.
  uint64_t next_staged_ = 1;
  std::vector<Staged> held_;  // kDelay, in arrival order.
};

}  // namespace pdserve::kv
