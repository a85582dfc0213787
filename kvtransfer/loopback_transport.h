// An in-memory wire: send ends (PageTransport) and receive ends (ReceiveTransport) of one
// LoopbackNetwork in one process, so the receiver's rules run in process tests with the injected
// clock and fault injection on both sides (FaultInjectingTransport,
// FaultInjectingReceiveTransport).
//
// It models what the receiver relies on in UCX active messages, deterministically: control
// messages and pages under LoopbackOptions::rendezvous_bytes are "eager" (copied at Send, the send
// completes at once); larger pages go "by rendezvous": the receive end shows the header to its
// sink in one Progress(), lands the payload from the sender's memory in its next Progress(), and
// only then completes the send; a page the sink refuses completes its send with Cancelled. A send
// cancelled or destroyed before its payload landed never lands (the landing fails). Nothing moves
// on its own: a receive end delivers only inside its Progress(), in send order; send ends'
// Progress() does nothing.
//
// Thread-safety: every method of the network, its ends and their ops is thread-safe (one mutex);
// sink callbacks run without it, inside the receive end's Progress().
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "kvtransfer/page_transport.h"
#include "kvtransfer/receive_transport.h"

namespace pdserve::kv {

struct LoopbackOptions {
  size_t rendezvous_bytes = 8192;  // Pages at least this large go by rendezvous.
};

class LoopbackNetwork {
 public:
  explicit LoopbackNetwork(LoopbackOptions options = {});
  ~LoopbackNetwork();
  LoopbackNetwork(const LoopbackNetwork&) = delete;
  LoopbackNetwork& operator=(const LoopbackNetwork&) = delete;

  // A receive end with a fresh address. Destroying it fails sends still waiting on it
  // (Unavailable) and every connection to it. The network must outlive its ends.
  std::unique_ptr<ReceiveTransport> NewReceiveEnd();
  // A send end; Connect() reaches receive ends of this network by address.
  std::unique_ptr<PageTransport> NewSendEnd();

  // Messages sent and not yet delivered (taken by a receive end's Progress), over all ends.
  size_t pending() const;

 private:
  class ReceiveEnd;
  class SendEnd;
  class Op;
  struct State;
  std::shared_ptr<State> state_;
};

}  // namespace pdserve::kv
