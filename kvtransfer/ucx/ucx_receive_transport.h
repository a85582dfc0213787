// ReceiveTransport over UCX active messages: the decode side of UcxTransport. Page headers reach
// the sink before any byte lands (the AM handler sees the header of a rendezvous message first);
// eager payloads are copied into the sink's target, rendezvous ones received into it with
// ucp_am_recv_data_nbx. A refused rendezvous page completes its sender's send with Cancelled.
//
// Thread-safety: not thread-safe; the owner serializes every call but the sleeper ArmWait returns.
#pragma once

#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "kvtransfer/receive_transport.h"
#include "kvtransfer/transfer_receiver.h"
#include "kvtransfer/ucx/ucx.h"

namespace pdserve::kv {

class UcxReceiveTransport final : public ReceiveTransport {
 public:
  // Creates a UCX context and worker (transports from UCX_TLS) and registers the handlers for
  // page and control messages. Errors: the UCX setup error.
  static absl::StatusOr<std::unique_ptr<UcxReceiveTransport>> Create();

  void SetSink(PageSink* sink) override { sink_ = sink; }
  std::vector<std::byte> address() const override { return worker_.address(); }
  absl::Status RegisterMemory(std::span<std::byte> memory) override;
  void Progress() override { worker_.Progress(); }
  std::function<void(absl::Duration timeout)> ArmWait() override;

 private:
  struct Landing;
  UcxReceiveTransport(UcxContext context, UcxWorker worker)
      : context_(std::move(context)), worker_(std::move(worker)) {}
  absl::Status RegisterHandlers();

  static ucs_status_t OnPage(void* arg, const void* header, size_t header_length, void* data,
                             size_t length, const ucp_am_recv_param_t* param);
  static ucs_status_t OnControl(void* arg, const void* header, size_t header_length, void* data,
                                size_t length, const ucp_am_recv_param_t* param);
  static void OnLanded(void* request, ucs_status_t status, size_t length, void* user_data);

  UcxContext context_;
  std::vector<UcxMemory> registered_;  // Outlives the worker's receives.
  UcxWorker worker_;
  PageSink* sink_ = nullptr;
};

// A TransferReceiver over a fresh UcxReceiveTransport (the decode worker's receiver).
absl::StatusOr<std::unique_ptr<TransferReceiver>> CreateUcxReceiver(
    ReceiverOptions options, const Clock& clock, TransferReceiver::ReleaseFn on_release,
    TransferReceiver::OutcomeFn on_outcome = nullptr);

}  // namespace pdserve::kv
