// The receiver's view of the wire, mirroring PageTransport on the send side: a transport delivers
// page and control messages to a PageSink (the receiver's rules, TransferReceiver) and lands a
// page's payload only where the sink said, after the sink checked its header. UcxReceiveTransport
// (kvtransfer/ucx/) is the real one, LoopbackNetwork's receive end
// (kvtransfer/loopback_transport.h) the in-process one, FaultInjectingReceiveTransport
// (kvtransfer/fault_receive_transport.h) decorates any.
//
// Thread-safety: the owner serializes every call (TransferReceiver holds its mutex), except Wait.
// Sink callbacks run inside Progress(), on its thread, except in a transport with lane threads
// (lanes() > 1): its threads call the sink holding the mutex SetSinkMutex named.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace pdserve::kv {

namespace shm {
class DevicePageLander;  // kvtransfer/shm/pull.h
}  // namespace shm

// Makes one DevicePageLander (one per lane: each has its own GPU stream), or an error saying
// why this process cannot land GPU pages.
using DeviceLanderFactory = std::function<absl::StatusOr<std::unique_ptr<shm::DevicePageLander>>()>;

// Where one accepted page lands: `destination` (exactly the payload's size), and the (ticket,
// slot) the transport hands back to PageSink::OnPageLanded.
struct LandingTarget {
  std::span<std::byte> destination;
  uint64_t ticket_id = 0;
  uint32_t slot = 0;
  // The sink's work on the landed bytes that needs none of its state (TransferReceiver: the
  // payload's xxh3-64 and, when it matches and the page arrived in another element type, the
  // conversion into the destination). It touches only memory of this landing, which the sink
  // keeps alive and unshared until OnPageLanded. Empty: nothing to do. Run through FinishLanding.
  std::function<uint64_t()> finish;
  // The destination is GPU memory (a CUDA decode worker's device pages): only a pulled page in a
  // GPU arena can land there (shm::DevicePageLander copies it and takes the landed bytes' XXH3 on
  // the GPU, which is `finished`); `finish` is then empty and no host code touches the bytes.
  // A page message or a shared-memory reference for such a target fails its landing.
  bool device = false;
};

// Runs `target.finish` (0 when empty): a transport calls it once a payload landed intact and
// before OnPageLanded, on the landing thread; a transport with lane threads calls it without the
// sink mutex, so lanes checksum in parallel. Its result goes to OnPageLanded as `finished`.
inline uint64_t FinishLanding(const LandingTarget& target) {
  return target.finish ? target.finish() : 0;
}

class PageSink {
 public:
  virtual ~PageSink() = default;
  // A page message's `header` (the encoded PageHeader) and its payload's length, before any byte
  // lands. Returns where to land the payload, or nullopt to refuse it: the payload is dropped and
  // a sender whose page was refused before landing sees its send complete with Cancelled (not
  // over UCX with v2 protocols over tcp: docs/protocol.md, "UCX protocols").
  virtual std::optional<LandingTarget> OnPageHeader(std::span<const std::byte> header,
                                                    size_t length) = 0;
  // The payload of an accepted page landed in its target (`status` OK; `finished` is what
  // FinishLanding returned for it) or could not (the sender vanished mid-page; the target's bytes
  // are then unspecified, `finished` 0 and meaningless). Called exactly once per accepted page,
  // possibly inside the OnPageHeader's Progress() call or a later one.
  virtual void OnPageLanded(uint64_t ticket_id, uint32_t slot, absl::Status status,
                            uint64_t finished) = 0;
  // A control message (commit, heartbeat, fence): its encoded bytes.
  virtual void OnControl(std::span<const std::byte> bytes) = 0;
};

class ReceiveTransport {
 public:
  virtual ~ReceiveTransport() = default;

  // Sets the sink messages go to; called once, before the first Progress(). `sink` must outlive
  // every later call.
  virtual void SetSink(PageSink* sink) = 0;

  // The address a sender's PageTransport::Connect takes (carried in the ticket).
  virtual std::vector<std::byte> address() const = 0;

  // Registers memory destinations will point into (e.g. the whole page pool), so large payloads
  // land without per-message registration. The memory must outlive the transport. Errors: the
  // transport's registration error.
  virtual absl::Status RegisterMemory(std::span<std::byte> memory) = 0;

  // Delivers what arrived: sink callbacks run inside this call. Non-blocking.
  virtual void Progress() = 0;

  // Prepares to sleep (serialized with Progress) and returns the sleeper, which the caller runs
  // without its lock: it returns when a message may have arrived or after its timeout.
  virtual std::function<void(absl::Duration timeout)> ArmWait() = 0;

  // Lanes (docs/protocol.md, "Lanes"): how many UCX workers and threads receive. A transport with
  // lanes() > 1 delivers on its own threads and locks `sink_mutex` (the owner's, which it holds
  // around every other call) around each sink callback; its Progress() then only needs to sweep.
  // Called once, with SetSink, before any message can arrive. Others ignore it.
  virtual int lanes() const { return 1; }
  virtual void SetSinkMutex(absl::Mutex* /*sink_mutex*/) {}
  // Lets pages in a peer's GPU arena land in GPU destinations (LandingTarget::device): makes
  // one lander per lane, flushed whenever the lane has delivered what had arrived. Called once,
  // before any message can arrive. Errors: the factory's. A transport that was never given one
  // fails every such landing (Unavailable "cuda ipc: ...").
  virtual absl::Status SetDeviceLanders(const DeviceLanderFactory& /*make*/) {
    return absl::UnimplementedError("this transport does not land GPU pages");
  }
  // Stops delivering: no sink callback runs after it returns. Called without the sink mutex held,
  // before the sink goes away. Idempotent.
  virtual void Stop() {}
};

}  // namespace pdserve::kv
