#include "kvtransfer/loopback_transport.h"

#include <cstring>
#include <deque>
#include <map>
#include <optional>
#include <set>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kvtransfer/shm/pull.h"

namespace pdserve::kv {

// The network's one lock and everything it guards. Ends and ops share it (shared_ptr), so an op
// outliving its end stays safe.
struct LoopbackNetwork::State {
  // One send's completion, shared by the op and its queued message.
  struct Completion {
    std::optional<absl::Status> result;
  };
  struct Message {
    uint64_t end = 0;  // The receive end it goes to.
    PeerId peer = 0;
    WireKind kind = WireKind::kPage;
    std::vector<std::byte> header;
    std::vector<std::byte> eager_payload;     // Copied at Send (eager).
    std::span<const std::byte> sender_bytes;  // Read at landing (rendezvous).
    std::shared_ptr<Completion> completion;   // Null for eager messages.
  };
  struct Peer {
    uint64_t end = 0;
    absl::Status status;
  };

  explicit State(LoopbackOptions opts) : options(opts) {}

  const LoopbackOptions options;
  mutable absl::Mutex mu;
  std::map<uint64_t, std::deque<Message>> inboxes ABSL_GUARDED_BY(mu);  // Per live receive end.
  std::map<PeerId, Peer> peers ABSL_GUARDED_BY(mu);
  uint64_t next_end ABSL_GUARDED_BY(mu) = 1;
  PeerId next_peer ABSL_GUARDED_BY(mu) = 1;
};

namespace {

std::vector<std::byte> AddressOf(uint64_t end) {
  std::vector<std::byte> address(12);
  std::memcpy(address.data(), "loop", 4);
  std::memcpy(address.data() + 4, &end, 8);
  return address;
}

std::optional<uint64_t> EndOf(std::span<const std::byte> address) {
  if (address.size() != 12 || std::memcmp(address.data(), "loop", 4) != 0) return std::nullopt;
  uint64_t end = 0;
  std::memcpy(&end, address.data() + 4, 8);
  return end;
}

}  // namespace

class LoopbackNetwork::Op final : public SendOp {
 public:
  Op(std::shared_ptr<State> state, std::shared_ptr<State::Completion> completion)
      : state_(std::move(state)), completion_(std::move(completion)) {}
  // A pending op that goes away cancels: its payload is never read again.
  ~Op() override { Cancel(); }

  std::optional<absl::Status> Test() override {
    absl::MutexLock lock(&state_->mu);
    return completion_->result;
  }
  void Cancel() override {
    absl::MutexLock lock(&state_->mu);
    if (!completion_->result.has_value()) {
      completion_->result = absl::CancelledError("loopback send cancelled");
    }
  }

 private:
  std::shared_ptr<State> state_;
  std::shared_ptr<State::Completion> completion_;
};

class LoopbackNetwork::SendEnd final : public PageTransport {
 public:
  explicit SendEnd(std::shared_ptr<State> state) : state_(std::move(state)) {}

  absl::StatusOr<PeerId> Connect(std::span<const std::byte> worker_address,
                                 uint64_t /*incarnation*/) override {
    const std::optional<uint64_t> end = EndOf(worker_address);
    absl::MutexLock lock(&state_->mu);
    if (!end.has_value() || !state_->inboxes.contains(*end)) {
      return absl::UnavailableError("no loopback receive end at that address");
    }
    for (const auto& [id, peer] : state_->peers) {
      if (owned_.contains(id) && peer.end == *end && peer.status.ok()) return id;
    }
    const PeerId id = state_->next_peer++;
    state_->peers[id] = {*end, absl::OkStatus()};
    owned_.insert(id);
    return id;
  }

  absl::StatusOr<std::unique_ptr<SendOp>> Send(PeerId peer, WireKind kind,
                                               std::span<const std::byte> header,
                                               std::span<const std::byte> payload) override {
    absl::MutexLock lock(&state_->mu);
    auto found = state_->peers.find(peer);
    if (found == state_->peers.end() || !owned_.contains(peer)) {
      return absl::NotFoundError(absl::StrCat("loopback peer ", peer, " is not connected"));
    }
    if (!found->second.status.ok()) return found->second.status;
    auto inbox = state_->inboxes.find(found->second.end);
    if (inbox == state_->inboxes.end()) return absl::UnavailableError("loopback receiver gone");
    State::Message message{.end = found->second.end,
                           .peer = peer,
                           .kind = kind,
                           .header = {header.begin(), header.end()}};
    auto completion = std::make_shared<State::Completion>();
    if (kind == WireKind::kPage && payload.size() >= state_->options.rendezvous_bytes) {
      message.sender_bytes = payload;
      message.completion = completion;
    } else {
      message.eager_payload.assign(payload.begin(), payload.end());
      completion->result = absl::OkStatus();
    }
    inbox->second.push_back(std::move(message));
    return std::make_unique<Op>(state_, std::move(completion));
  }

  void Progress() override {}

  absl::Status PeerStatus(PeerId peer) const override {
    absl::MutexLock lock(&state_->mu);
    auto found = state_->peers.find(peer);
    if (found == state_->peers.end() || !owned_.contains(peer)) {
      return absl::NotFoundError(absl::StrCat("loopback peer ", peer, " is not connected"));
    }
    if (!state_->inboxes.contains(found->second.end)) {
      return absl::UnavailableError("loopback receiver gone");
    }
    return found->second.status;
  }

  void Disconnect(PeerId peer) override {
    absl::MutexLock lock(&state_->mu);
    auto found = state_->peers.find(peer);
    if (found == state_->peers.end() || !owned_.contains(peer)) return;
    found->second.status = absl::UnavailableError("loopback connection closed");
    // In-flight rendezvous sends of this connection fail; eager ones already left.
    for (auto& [end, inbox] : state_->inboxes) {
      for (State::Message& message : inbox) {
        if (message.peer == peer && message.completion && !message.completion->result) {
          message.completion->result = found->second.status;
        }
      }
    }
  }

 private:
  std::shared_ptr<State> state_;
  std::set<PeerId> owned_;  // Peers this end connected; guarded by state_->mu.
};

class LoopbackNetwork::ReceiveEnd final : public ReceiveTransport {
 public:
  explicit ReceiveEnd(std::shared_ptr<State> state) : state_(std::move(state)) {
    absl::MutexLock lock(&state_->mu);
    id_ = state_->next_end++;
    state_->inboxes[id_];
  }
  ~ReceiveEnd() override {
    absl::MutexLock lock(&state_->mu);
    const absl::Status gone = absl::UnavailableError("loopback receiver gone");
    for (State::Message& message : state_->inboxes[id_]) {
      if (message.completion && !message.completion->result) message.completion->result = gone;
    }
    for (Landing& landing : landings_) {
      if (!landing.message.completion->result) landing.message.completion->result = gone;
    }
    state_->inboxes.erase(id_);
  }

  void SetSink(PageSink* sink) override { sink_ = sink; }
  std::vector<std::byte> address() const override { return AddressOf(id_); }
  absl::Status RegisterMemory(std::span<std::byte> /*memory*/) override { return absl::OkStatus(); }
  void Progress() override;
  std::function<void(absl::Duration)> ArmWait() override;
  absl::Status SetDeviceLanders(const DeviceLanderFactory& make) override {
    absl::StatusOr<std::unique_ptr<shm::DevicePageLander>> lander = make();
    if (!lander.ok()) return lander.status();
    lander_ = std::move(*lander);
    return absl::OkStatus();
  }

 private:
  // An accepted rendezvous page, landed in the next Progress().
  struct Landing {
    State::Message message;
    LandingTarget target;
  };
  void Deliver(State::Message& message);
  void FinishLandings();

  std::shared_ptr<State> state_;
  uint64_t id_ = 0;
  PageSink* sink_ = nullptr;
  shm::PeerRegions regions_;       // Senders' page regions mapped for kPageRef messages.
  std::vector<Landing> landings_;  // Only Progress() touches it (the owner serializes).
  std::unique_ptr<shm::DevicePageLander> lander_;  // Pages in GPU arenas (SetDeviceLanders).
};

void LoopbackNetwork::ReceiveEnd::Progress() {
  FinishLandings();
  std::deque<State::Message> arrived;
  {
    absl::MutexLock lock(&state_->mu);
    arrived.swap(state_->inboxes[id_]);
  }
  for (State::Message& message : arrived) Deliver(message);
  // The pulled GPU pages of this round, in one batch (as a UCX lane after its progress).
  if (lander_ != nullptr && lander_->pending() > 0) {
    lander_->Flush([&](const LandingTarget& target, absl::Status status, uint64_t xxh3) {
      sink_->OnPageLanded(target.ticket_id, target.slot, std::move(status), xxh3);
    });
  }
}

void LoopbackNetwork::ReceiveEnd::Deliver(State::Message& message) {
  if (message.kind == WireKind::kPageRef) {
    // Every page of the message (any version: shm::ParsePageRefs).
    shm::LandPageRef(
        regions_, message.eager_payload,
        [&](std::span<const std::byte> header, size_t length) {
          return sink_->OnPageHeader(header, length);
        },
        [&](uint64_t ticket_id, uint32_t slot, absl::Status status, uint64_t finished) {
          sink_->OnPageLanded(ticket_id, slot, std::move(status), finished);
        },
        lander_.get());
    return;
  }
  if (message.kind != WireKind::kPage) {
    sink_->OnControl(message.eager_payload);
    return;
  }
  const bool rendezvous = message.completion != nullptr;
  size_t length = message.eager_payload.size();
  if (rendezvous) {
    absl::MutexLock lock(&state_->mu);
    if (message.completion->result.has_value()) return;  // Cancelled before it arrived.
    length = message.sender_bytes.size();
  }
  const std::optional<LandingTarget> target = sink_->OnPageHeader(message.header, length);
  if (!target.has_value()) {
    if (rendezvous) {
      absl::MutexLock lock(&state_->mu);
      if (!message.completion->result) {
        message.completion->result = absl::CancelledError("the receiver refused the page");
      }
    }
    return;
  }
  if (target->device) {
    // A page message carries host bytes; GPU pages take only pulled pages of a GPU arena.
    if (rendezvous) {
      absl::MutexLock lock(&state_->mu);
      if (!message.completion->result) {
        message.completion->result = absl::CancelledError("the receiver refused the page");
      }
    }
    sink_->OnPageLanded(target->ticket_id, target->slot,
                        absl::UnavailableError("cuda ipc: a page message cannot land in GPU pages"),
                        0);
    return;
  }
  if (rendezvous) {
    landings_.push_back({std::move(message), *target});
    return;
  }
  std::memcpy(target->destination.data(), message.eager_payload.data(), length);
  sink_->OnPageLanded(target->ticket_id, target->slot, absl::OkStatus(), FinishLanding(*target));
}

void LoopbackNetwork::ReceiveEnd::FinishLandings() {
  std::vector<Landing> landings;
  landings.swap(landings_);
  for (Landing& landing : landings) {
    absl::Status status;
    {
      absl::MutexLock lock(&state_->mu);
      std::optional<absl::Status>& result = landing.message.completion->result;
      if (result.has_value()) {
        // The sender cancelled or went away mid-page: nothing of it lands.
        status = absl::UnavailableError(
            absl::StrCat("rendezvous send ended before landing: ", result->ToString()));
      } else {
        std::memcpy(landing.target.destination.data(), landing.message.sender_bytes.data(),
                    landing.message.sender_bytes.size());
        result = absl::OkStatus();
      }
    }
    const uint64_t finished = status.ok() ? FinishLanding(landing.target) : 0;
    sink_->OnPageLanded(landing.target.ticket_id, landing.target.slot, std::move(status), finished);
  }
}

std::function<void(absl::Duration)> LoopbackNetwork::ReceiveEnd::ArmWait() {
  if (!landings_.empty()) return [](absl::Duration) {};
  struct Mailbox {
    State* state;
    uint64_t id;
    static bool HasMail(const Mailbox* box) ABSL_NO_THREAD_SAFETY_ANALYSIS {
      auto inbox = box->state->inboxes.find(box->id);
      return inbox == box->state->inboxes.end() || !inbox->second.empty();
    }
  };
  return [state = state_, id = id_](absl::Duration timeout) {
    const Mailbox box{state.get(), id};
    absl::MutexLock lock(&state->mu);
    state->mu.AwaitWithTimeout(absl::Condition(&Mailbox::HasMail, &box), timeout);
  };
}

LoopbackNetwork::LoopbackNetwork(LoopbackOptions options)
    : state_(std::make_shared<State>(options)) {}

LoopbackNetwork::~LoopbackNetwork() = default;

std::unique_ptr<ReceiveTransport> LoopbackNetwork::NewReceiveEnd() {
  return std::make_unique<ReceiveEnd>(state_);
}

std::unique_ptr<PageTransport> LoopbackNetwork::NewSendEnd() {
  return std::make_unique<SendEnd>(state_);
}

size_t LoopbackNetwork::pending() const {
  absl::MutexLock lock(&state_->mu);
  size_t count = 0;
  for (const auto& [end, inbox] : state_->inboxes) count += inbox.size();
  return count;
}

}  // namespace pdserve::kv
