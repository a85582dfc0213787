// ReceiveTransport over UCX active messages: the decode side of UcxTransport. Page headers reach
// the sink before any byte lands (the AM handler sees the header of a rendezvous message first);
// eager payloads are copied into the sink's target, rendezvous ones received into it with
// ucp_am_recv_data_nbx. A refused rendezvous page completes its sender's send with Cancelled,
// except under UCX 1.13's v2 protocols over tcp, which drop that status: the send completes OK
// (the page is refused either way; docs/protocol.md, "UCX protocols").
//
// Lanes (docs/protocol.md, "Lanes"): with `lanes` > 1 there is one UCX worker and one thread per
// lane; address() is the bundle of the lanes' addresses (kvtransfer/ucx/lane_address.h) and each
// lane's thread lands its own pages, calling the sink under the owner's mutex (SetSinkMutex):
// the checks run one page at a time as before, the copies and receives in parallel. One lane runs
// exactly as before lanes: no thread, the owner's Progress() drives it.
//
// Thread-safety: not thread-safe; the owner serializes every call but the sleeper ArmWait returns.
#pragma once

#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "kvtransfer/receive_transport.h"
#include "kvtransfer/shm/pull.h"
#include "kvtransfer/transfer_receiver.h"
#include "kvtransfer/ucx/ucx.h"
#include "kvtransfer/ucx/ucx_lane.h"

namespace pdserve::kv {

class UcxReceiveTransport final : public ReceiveTransport {
 public:
  // Creates a UCX context and `lanes` workers (transports from UCX_TLS) and registers the
  // handlers for page and control messages on each. Threads start at SetSinkMutex.
  // `protocols`: UCX's protocol implementation (ucx.h; the senders must use the same).
  // Errors: InvalidArgument for lanes outside 1 .. kMaxTransferLanes; the UCX setup error.
  static absl::StatusOr<std::unique_ptr<UcxReceiveTransport>> Create(
      int lanes = 1, UcxProtocols protocols = UcxProtocols::kV1);
  ~UcxReceiveTransport() override;

  void SetSink(PageSink* sink) override { sink_ = sink; }
  std::vector<std::byte> address() const override { return address_; }
  absl::Status RegisterMemory(std::span<std::byte> memory) override;
  void Progress() override;
  std::function<void(absl::Duration timeout)> ArmWait() override;
  int lanes() const override { return static_cast<int>(lanes_.size()); }
  void SetSinkMutex(absl::Mutex* sink_mutex) override;
  absl::Status SetDeviceLanders(const DeviceLanderFactory& make) override;
  void Stop() override;
  // Page messages each lane's worker received so far (accepted or refused; index = lane).
  // Thread-safe.
  std::vector<uint64_t> pages_per_lane() const;
  // The protocols in effect (UCX_PROTO_ENABLE in the environment overrides the request).
  UcxProtocols protocols() const { return context_.protocols(); }

 private:
  struct Landing;
  struct Handler;
  UcxReceiveTransport(UcxContext context, std::vector<std::unique_ptr<UcxLane>> lanes);
  absl::Status RegisterHandlers();
  // Runs a sink callback: under the sink mutex when lane threads deliver; the owner holds it
  // already when its Progress() does.
  template <typename Fn>
  void CallSink(Fn&& fn);
  // Lands the GPU pages `handler`'s lane queued (its lander's Flush) and reports each to the
  // sink. Runs with the lane's mutex held.
  void FlushLander(Handler& handler);
  // Reports `landed` pages to the sink under one hold of its mutex.
  void ReportLanded(std::vector<shm::LandedPage>& landed);

  static ucs_status_t OnPage(void* arg, const void* header, size_t header_length, void* data,
                             size_t length, const ucp_am_recv_param_t* param);
  // A kPageRef message: lands the page from the sender's shared memory (kvtransfer/shm/pull.h),
  // the copy and checksum outside the sink mutex as for an eager page.
  static ucs_status_t OnPageRef(void* arg, const void* header, size_t header_length, void* data,
                                size_t length, const ucp_am_recv_param_t* param);
  static ucs_status_t OnControl(void* arg, const void* header, size_t header_length, void* data,
                                size_t length, const ucp_am_recv_param_t* param);
  static void OnLanded(void* request, ucs_status_t status, size_t length, void* user_data);

  UcxContext context_;
  // After context_, before lanes_: unmapped after the workers (and their receives) go.
  UcxRegistrations registered_;
  shm::PeerRegions regions_;  // Senders' page regions mapped for kPageRef messages.
  absl::Time next_region_check_ = absl::InfinitePast();  // Progress's owner thread only.
  std::vector<std::unique_ptr<UcxLane>> lanes_;
  std::vector<std::unique_ptr<Handler>> handlers_;  // Index = lane: the AM handlers' argument.
  std::vector<std::byte> address_;
  PageSink* sink_ = nullptr;
  absl::Mutex* sink_mutex_ = nullptr;
};

// A TransferReceiver over a fresh UcxReceiveTransport with `lanes` lanes and `protocols` (the
// decode worker's receiver).
absl::StatusOr<std::unique_ptr<TransferReceiver>> CreateUcxReceiver(
    ReceiverOptions options, const Clock& clock, TransferReceiver::ReleaseFn on_release,
    TransferReceiver::OutcomeFn on_outcome = nullptr, int lanes = 1,
    UcxProtocols protocols = UcxProtocols::kV1);

}  // namespace pdserve::kv
