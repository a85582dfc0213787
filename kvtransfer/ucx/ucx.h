// RAII wrappers over the UCX ucp objects pdserve uses: context, worker, endpoint, registered
// memory and unpacked remote keys. Each owns exactly one ucp handle and releases it in its
// destructor; all are move-only.
//
// Thread-safety: a Worker and the endpoints, requests and remote keys made from it are used by
// one thread at a time (UCS_THREAD_MODE_SERIALIZED); callers serialize with their own mutex.
// Transports come from the environment (UCX_TLS, e.g. "tcp" or "shm,self"), as in every UCX tool.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "ucp/api/ucp.h"

namespace pdserve::kv {

// Which of UCX 1.13's two protocol implementations a context selects its protocols with
// (docs/protocol.md, "UCX protocols"): v1, UCX 1.13's default, or v2 (UCX_PROTO_ENABLE=y; the
// default from UCX 1.14 on). Both ends of a transfer must use the same one.
enum class UcxProtocols {
  kV1,
  kV2,
};

// "v1" / "v2" (config transfer.ucx_protocols). Errors: InvalidArgument naming the value.
absl::StatusOr<UcxProtocols> ParseUcxProtocols(absl::string_view name);
const char* UcxProtocolsName(UcxProtocols protocols);

// The protocols a context created with `requested` uses: UCX_PROTO_ENABLE, where the environment
// sets it, wins over the request (as every UCX variable does), so one run can compare both
// without a config change; y / yes / on / 1 (any case) is v2, anything else v1.
UcxProtocols EffectiveUcxProtocols(UcxProtocols requested);

// A ucp_context_h with the AM, RMA and WAKEUP features (and TAG, for benchmarks) enabled.
class UcxContext {
 public:
  // Reads the UCX configuration from the environment, then selects `protocols` (unless the
  // environment names them: EffectiveUcxProtocols). `shared_by_threads`: workers of this
  // context are driven by several threads at once (lanes, ucx_lane.h), so UCX makes the context
  // thread-safe. Errors: UcsToStatus of ucp_config_modify or ucp_init.
  static absl::StatusOr<UcxContext> Create(bool shared_by_threads = false,
                                           UcxProtocols protocols = UcxProtocols::kV1);
  UcxContext(UcxContext&& other) noexcept;
  UcxContext& operator=(UcxContext&& other) noexcept;
  UcxContext(const UcxContext&) = delete;
  UcxContext& operator=(const UcxContext&) = delete;
  ~UcxContext();

  ucp_context_h get() const { return context_; }
  // The protocols in effect (EffectiveUcxProtocols of the request).
  UcxProtocols protocols() const { return protocols_; }

 private:
  UcxContext(ucp_context_h context, UcxProtocols protocols)
      : context_(context), protocols_(protocols) {}
  ucp_context_h context_ = nullptr;
  UcxProtocols protocols_ = UcxProtocols::kV1;
};

// A ucp_worker_h (serialized thread mode) and its packed address.
class UcxWorker {
 public:
  static absl::StatusOr<UcxWorker> Create(const UcxContext& context);
  UcxWorker(UcxWorker&& other) noexcept;
  UcxWorker& operator=(UcxWorker&& other) noexcept;
  UcxWorker(const UcxWorker&) = delete;
  UcxWorker& operator=(const UcxWorker&) = delete;
  ~UcxWorker();

  ucp_worker_h get() const { return worker_; }
  // The packed worker address a peer passes to UcxEndpoint::Create.
  const std::vector<std::byte>& address() const { return address_; }
  // Runs ucp_worker_progress until it reports no more work; returns true if anything progressed.
  bool Progress();
  // Blocks until the worker has events or `timeout_ms` passes (poll on the worker's event fd).
  // Errors: UcsToStatus of ucp_worker_arm / get_efd.
  absl::Status Wait(int timeout_ms);
  // The two halves of Wait, for a caller that serializes UCX calls under a lock it must not hold
  // while sleeping: Arm() (a UCX call) returns the event fd to poll, or -1 when events are
  // already pending; WaitReadable (no UCX call) sleeps on that fd. Errors as Wait.
  absl::StatusOr<int> Arm();
  static void WaitReadable(int fd, int timeout_ms);
  // Wakes a thread sleeping in Wait / WaitReadable on this worker (ucp_worker_signal; callable
  // from any thread).
  void Signal();

 private:
  UcxWorker(ucp_worker_h worker, std::vector<std::byte> address)
      : worker_(worker), address_(std::move(address)) {}
  ucp_worker_h worker_ = nullptr;
  std::vector<std::byte> address_;
};

// Checks what can be checked of a peer's packed UCX worker address before ucp_ep_create parses
// it: UCX aborts the process (an assertion) on an unknown address format version, and a ticket
// is input from the network. InvalidArgument for a short address or an unknown version. Other
// corruption is caught by UCX's own checks or fails the connection.
absl::Status CheckPeerAddress(std::span<const std::byte> address);

// A ucp_ep_h. With `detect_peer_failure` (UCP_ERR_HANDLING_MODE_PEER) `on_error` runs inside
// Progress() of the owning worker when UCX declares the peer lost; after that every operation on
// the endpoint fails. UCX 1.13 offers that mode only over transports that can detect a lost peer
// (tcp, not shared memory alone), where ucp_ep_create answers Unavailable.
class UcxEndpoint {
 public:
  using ErrorFn = std::function<void(ucs_status_t)>;
  // Errors: UcsToStatus of ucp_ep_create (e.g. InvalidArgument for a malformed address,
  // Unavailable when no transport reaches the address in the requested error mode).
  static absl::StatusOr<std::unique_ptr<UcxEndpoint>> Create(const UcxWorker& worker,
                                                             std::span<const std::byte> address,
                                                             bool detect_peer_failure,
                                                             ErrorFn on_error);
  UcxEndpoint(const UcxEndpoint&) = delete;
  UcxEndpoint& operator=(const UcxEndpoint&) = delete;
  // Closes the endpoint with UCP_EP_CLOSE_FLAG_FORCE (no flush: a failed or restarted peer must
  // not stall the closer) and progresses `worker` until the close completes.
  ~UcxEndpoint();

  ucp_ep_h get() const { return ep_; }

 private:
  UcxEndpoint(ucp_worker_h worker, ErrorFn on_error) : worker_(worker), on_error_(on_error) {}
  static void OnError(void* arg, ucp_ep_h ep, ucs_status_t status);
  ucp_worker_h worker_;
  ucp_ep_h ep_ = nullptr;
  ErrorFn on_error_;
};

// Memory registered with ucp_mem_map for zero-copy transfers; `Pack` gives the remote key bytes a
// peer unpacks into a UcxRemoteKey.
class UcxMemory {
 public:
  // Registers [data, data + bytes); the memory must outlive the UcxMemory.
  static absl::StatusOr<UcxMemory> Register(const UcxContext& context, void* data, size_t bytes);
  // Lets UCX allocate `bytes` (ucp_mem_map with UCP_MEM_MAP_ALLOCATE) in the first way
  // UCX_ALLOC_PRIO names that works: over shared memory a sysv or posix segment a peer on the
  // same host attaches, so a peer's get or put is a plain copy from or into it, with no kernel
  // copy (cma). The memory lives until the UcxMemory goes; data() is where it starts.
  // Errors: UcsToStatus of ucp_mem_map or ucp_mem_query.
  static absl::StatusOr<UcxMemory> Allocate(const UcxContext& context, size_t bytes);
  UcxMemory(UcxMemory&& other) noexcept;
  UcxMemory& operator=(UcxMemory&& other) noexcept;
  UcxMemory(const UcxMemory&) = delete;
  UcxMemory& operator=(const UcxMemory&) = delete;
  ~UcxMemory();

  ucp_mem_h get() const { return memh_; }
  // The first byte of the mapped range (the registered address, or where UCX allocated).
  std::byte* data() const { return data_; }
  absl::StatusOr<std::vector<std::byte>> PackRemoteKey() const;

 private:
  UcxMemory(ucp_context_h context, ucp_mem_h memh, std::byte* data)
      : context_(context), memh_(memh), data_(data) {}
  ucp_context_h context_ = nullptr;
  ucp_mem_h memh_ = nullptr;
  std::byte* data_ = nullptr;
};

// The memory a transport registered once with ucp_mem_map (a page pool's blocks), so a send or
// a rendezvous receive of a page inside it passes that handle (UCP_OP_ATTR_FIELD_MEMH) instead of
// UCX registering the page per operation (docs/protocol.md, "Registered page memory").
//
// Ownership: the registrations belong to the transport that made them and are unmapped when it
// goes, after its workers (so after every send and receive that used one completed or was
// purged) and before its context. The memory itself belongs to the caller and must outlive the
// transport. Thread-safety: Add and Find from any thread (a reader lock; Find runs on lane
// threads).
class UcxRegistrations {
 public:
  // Registers [memory.data(), + size()) with `context`. Errors: UcsToStatus of ucp_mem_map;
  // InvalidArgument for empty memory.
  absl::Status Add(const UcxContext& context, std::span<const std::byte> memory);
  // The handle of a registration that holds all of [data, data + bytes), or nullptr.
  ucp_mem_h Find(const void* data, size_t bytes) const;
  size_t size() const;

 private:
  struct Region {
    const std::byte* begin;
    const std::byte* end;
    UcxMemory memory;
  };
  mutable absl::Mutex mu_;
  std::vector<Region> regions_ ABSL_GUARDED_BY(mu_);
};

// A remote key unpacked for one endpoint (valid only with that endpoint).
class UcxRemoteKey {
 public:
  static absl::StatusOr<UcxRemoteKey> Unpack(const UcxEndpoint& ep,
                                             std::span<const std::byte> packed);
  UcxRemoteKey(UcxRemoteKey&& other) noexcept;
  UcxRemoteKey& operator=(UcxRemoteKey&& other) noexcept;
  UcxRemoteKey(const UcxRemoteKey&) = delete;
  UcxRemoteKey& operator=(const UcxRemoteKey&) = delete;
  ~UcxRemoteKey();

  ucp_rkey_h get() const { return rkey_; }

 private:
  explicit UcxRemoteKey(ucp_rkey_h rkey) : rkey_(rkey) {}
  ucp_rkey_h rkey_ = nullptr;
};

// Waits for a request returned by a ucp *_nbx call: progresses `worker` until it completes and
// frees it. Returns the request's final status. `request` may be NULL or an error pointer.
absl::Status WaitRequest(UcxWorker& worker, ucs_status_ptr_t request, absl::string_view what);

}  // namespace pdserve::kv
