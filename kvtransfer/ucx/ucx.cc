#include "kvtransfer/ucx/ucx.h"

#include <poll.h>

#include <cstddef>
#include <cstdlib>
#include <string>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "kvtransfer/ucx/ucs_status.h"

namespace pdserve::kv {

absl::StatusOr<UcxProtocols> ParseUcxProtocols(absl::string_view name) {
  if (name == "v1") return UcxProtocols::kV1;
  if (name == "v2") return UcxProtocols::kV2;
  return absl::InvalidArgumentError(
      absl::StrCat("UCX protocols \"", name, "\": expected v1 or v2"));
}

const char* UcxProtocolsName(UcxProtocols protocols) {
  return protocols == UcxProtocols::kV2 ? "v2" : "v1";
}

UcxProtocols EffectiveUcxProtocols(UcxProtocols requested) {
  const char* env = std::getenv("UCX_PROTO_ENABLE");
  if (env == nullptr) return requested;
  const std::string value = absl::AsciiStrToLower(env);
  return value == "y" || value == "yes" || value == "on" || value == "1" ? UcxProtocols::kV2
                                                                         : UcxProtocols::kV1;
}

absl::StatusOr<UcxContext> UcxContext::Create(bool shared_by_threads, UcxProtocols protocols) {
  ucp_config_t* config = nullptr;
  ucs_status_t status = ucp_config_read(nullptr, nullptr, &config);
  if (status != UCS_OK) return UcsToStatus(status, "ucp_config_read");
  const UcxProtocols effective = EffectiveUcxProtocols(protocols);
  if (std::getenv("UCX_PROTO_ENABLE") == nullptr) {
    // Set either way: what a context uses must not depend on the UCX build's default.
    status = ucp_config_modify(config, "PROTO_ENABLE", effective == UcxProtocols::kV2 ? "y" : "n");
    if (status != UCS_OK) {
      ucp_config_release(config);
      return UcsToStatus(status, "ucp_config_modify PROTO_ENABLE");
    }
  }
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED;
  params.features = UCP_FEATURE_AM | UCP_FEATURE_RMA | UCP_FEATURE_TAG | UCP_FEATURE_WAKEUP;
  params.mt_workers_shared = shared_by_threads ? 1 : 0;
  ucp_context_h context = nullptr;
  status = ucp_init(&params, config, &context);
  ucp_config_release(config);
  if (status != UCS_OK) return UcsToStatus(status, "ucp_init");
  return UcxContext(context, effective);
}

UcxContext::UcxContext(UcxContext&& other) noexcept
    : context_(std::exchange(other.context_, nullptr)), protocols_(other.protocols_) {}

UcxContext& UcxContext::operator=(UcxContext&& other) noexcept {
  if (this != &other) {
    if (context_ != nullptr) ucp_cleanup(context_);
    context_ = std::exchange(other.context_, nullptr);
    protocols_ = other.protocols_;
  }
  return *this;
}

UcxContext::~UcxContext() {
  if (context_ != nullptr) ucp_cleanup(context_);
}

absl::StatusOr<UcxWorker> UcxWorker::Create(const UcxContext& context) {
  ucp_worker_params_t params{};
  params.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  params.thread_mode = UCS_THREAD_MODE_SERIALIZED;
  ucp_worker_h worker = nullptr;
  ucs_status_t status = ucp_worker_create(context.get(), &params, &worker);
  if (status != UCS_OK) return UcsToStatus(status, "ucp_worker_create");
  ucp_address_t* address = nullptr;
  size_t address_bytes = 0;
  status = ucp_worker_get_address(worker, &address, &address_bytes);
  if (status != UCS_OK) {
    ucp_worker_destroy(worker);
    return UcsToStatus(status, "ucp_worker_get_address");
  }
  const auto* begin = reinterpret_cast<const std::byte*>(address);
  std::vector<std::byte> packed(begin, begin + address_bytes);
  ucp_worker_release_address(worker, address);
  return UcxWorker(worker, std::move(packed));
}

UcxWorker::UcxWorker(UcxWorker&& other) noexcept
    : worker_(std::exchange(other.worker_, nullptr)), address_(std::move(other.address_)) {}

UcxWorker& UcxWorker::operator=(UcxWorker&& other) noexcept {
  if (this != &other) {
    if (worker_ != nullptr) ucp_worker_destroy(worker_);
    worker_ = std::exchange(other.worker_, nullptr);
    address_ = std::move(other.address_);
  }
  return *this;
}

UcxWorker::~UcxWorker() {
  if (worker_ != nullptr) ucp_worker_destroy(worker_);
}

bool UcxWorker::Progress() {
  bool any = false;
  while (ucp_worker_progress(worker_) != 0) any = true;
  return any;
}

absl::Status UcxWorker::Wait(int timeout_ms) {
  absl::StatusOr<int> fd = Arm();
  if (!fd.ok()) return fd.status();
  WaitReadable(*fd, timeout_ms);
  return absl::OkStatus();
}

absl::StatusOr<int> UcxWorker::Arm() {
  int fd = -1;
  ucs_status_t status = ucp_worker_get_efd(worker_, &fd);
  if (status != UCS_OK) return UcsToStatus(status, "ucp_worker_get_efd");
  status = ucp_worker_arm(worker_);
  if (status == UCS_ERR_BUSY) return -1;  // Events are already pending.
  if (status != UCS_OK) return UcsToStatus(status, "ucp_worker_arm");
  return fd;
}

void UcxWorker::Signal() { ucp_worker_signal(worker_); }

void UcxWorker::WaitReadable(int fd, int timeout_ms) {
  if (fd < 0) return;
  pollfd pfd{fd, POLLIN, 0};
  poll(&pfd, 1, timeout_ms);
}

absl::Status CheckPeerAddress(std::span<const std::byte> address) {
  // UCX's packed worker address (src/ucp/wireup/address.c): a header byte whose low 4 bits are
  // the address format version (0: v1, 1: v2), then the worker's 64-bit uuid, then the devices.
  constexpr size_t kHeaderBytes = 1 + 8;
  constexpr unsigned kKnownVersions = 2;
  if (address.size() < kHeaderBytes) {
    return absl::InvalidArgumentError(absl::StrCat("the peer's UCX worker address has ",
                                                   address.size(), " bytes, fewer than its ",
                                                   kHeaderBytes, "-byte header"));
  }
  const unsigned version = std::to_integer<unsigned>(address[0]) & 0x0Fu;
  if (version >= kKnownVersions) {
    return absl::InvalidArgumentError(
        absl::StrCat("the peer's UCX worker address has format version ", version,
                     ", which this UCX does not know (a corrupt ticket, or another UCX build)"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<UcxEndpoint>> UcxEndpoint::Create(const UcxWorker& worker,
                                                                 std::span<const std::byte> address,
                                                                 bool detect_peer_failure,
                                                                 ErrorFn on_error) {
  if (absl::Status checked = CheckPeerAddress(address); !checked.ok()) return checked;
  std::unique_ptr<UcxEndpoint> endpoint(new UcxEndpoint(worker.get(), std::move(on_error)));
  ucp_ep_params_t params{};
  params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                      UCP_EP_PARAM_FIELD_ERR_HANDLER;
  params.address = reinterpret_cast<const ucp_address_t*>(address.data());
  params.err_mode = detect_peer_failure ? UCP_ERR_HANDLING_MODE_PEER : UCP_ERR_HANDLING_MODE_NONE;
  params.err_handler.cb = &UcxEndpoint::OnError;
  params.err_handler.arg = endpoint.get();
  const ucs_status_t status = ucp_ep_create(worker.get(), &params, &endpoint->ep_);
  if (status != UCS_OK) {
    endpoint->ep_ = nullptr;
    return UcsToStatus(status, "ucp_ep_create");
  }
  return endpoint;
}

void UcxEndpoint::OnError(void* arg, ucp_ep_h /*ep*/, ucs_status_t status) {
  auto* self = static_cast<UcxEndpoint*>(arg);
  if (self->on_error_) self->on_error_(status);
}

UcxEndpoint::~UcxEndpoint() {
  if (ep_ == nullptr) return;
  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  param.flags = UCP_EP_CLOSE_FLAG_FORCE;
  ucs_status_ptr_t request = ucp_ep_close_nbx(ep_, &param);
  if (UCS_PTR_IS_PTR(request)) {
    while (ucp_request_check_status(request) == UCS_INPROGRESS) ucp_worker_progress(worker_);
    ucp_request_free(request);
  }
}

absl::StatusOr<UcxMemory> UcxMemory::Register(const UcxContext& context, void* data, size_t bytes) {
  ucp_mem_map_params_t params{};
  params.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
  params.address = data;
  params.length = bytes;
  ucp_mem_h memh = nullptr;
  const ucs_status_t status = ucp_mem_map(context.get(), &params, &memh);
  if (status != UCS_OK) return UcsToStatus(status, "ucp_mem_map");
  return UcxMemory(context.get(), memh, static_cast<std::byte*>(data));
}

absl::StatusOr<UcxMemory> UcxMemory::Allocate(const UcxContext& context, size_t bytes) {
  ucp_mem_map_params_t params{};
  params.field_mask = UCP_MEM_MAP_PARAM_FIELD_LENGTH | UCP_MEM_MAP_PARAM_FIELD_FLAGS;
  params.length = bytes;
  params.flags = UCP_MEM_MAP_ALLOCATE;
  ucp_mem_h memh = nullptr;
  ucs_status_t status = ucp_mem_map(context.get(), &params, &memh);
  if (status != UCS_OK) return UcsToStatus(status, "ucp_mem_map allocate");
  UcxMemory memory(context.get(), memh, nullptr);
  ucp_mem_attr_t attr{};
  attr.field_mask = UCP_MEM_ATTR_FIELD_ADDRESS;
  status = ucp_mem_query(memh, &attr);
  if (status != UCS_OK) return UcsToStatus(status, "ucp_mem_query");
  memory.data_ = static_cast<std::byte*>(attr.address);
  return memory;
}

UcxMemory::UcxMemory(UcxMemory&& other) noexcept
    : context_(other.context_),
      memh_(std::exchange(other.memh_, nullptr)),
      data_(std::exchange(other.data_, nullptr)) {}

UcxMemory& UcxMemory::operator=(UcxMemory&& other) noexcept {
  if (this != &other) {
    if (memh_ != nullptr) ucp_mem_unmap(context_, memh_);
    context_ = other.context_;
    memh_ = std::exchange(other.memh_, nullptr);
    data_ = std::exchange(other.data_, nullptr);
  }
  return *this;
}

UcxMemory::~UcxMemory() {
  if (memh_ != nullptr) ucp_mem_unmap(context_, memh_);
}

absl::StatusOr<std::vector<std::byte>> UcxMemory::PackRemoteKey() const {
  void* buffer = nullptr;
  size_t bytes = 0;
  const ucs_status_t status = ucp_rkey_pack(context_, memh_, &buffer, &bytes);
  if (status != UCS_OK) return UcsToStatus(status, "ucp_rkey_pack");
  const auto* begin = static_cast<const std::byte*>(buffer);
  std::vector<std::byte> packed(begin, begin + bytes);
  ucp_rkey_buffer_release(buffer);
  return packed;
}

absl::Status UcxRegistrations::Add(const UcxContext& context, std::span<const std::byte> memory) {
  if (memory.empty()) return absl::InvalidArgumentError("registering empty memory");
  // ucp_mem_map takes a non-const address; registration does not write the bytes.
  auto registered =
      UcxMemory::Register(context, const_cast<std::byte*>(memory.data()), memory.size());
  if (!registered.ok()) return registered.status();
  absl::MutexLock lock(&mu_);
  regions_.push_back({memory.data(), memory.data() + memory.size(), std::move(*registered)});
  return absl::OkStatus();
}

ucp_mem_h UcxRegistrations::Find(const void* data, size_t bytes) const {
  const auto begin = reinterpret_cast<uintptr_t>(data);
  absl::ReaderMutexLock lock(&mu_);
  for (const Region& region : regions_) {
    const auto region_begin = reinterpret_cast<uintptr_t>(region.begin);
    const auto region_end = reinterpret_cast<uintptr_t>(region.end);
    if (begin >= region_begin && begin <= region_end && bytes <= region_end - begin) {
      return region.memory.get();
    }
  }
  return nullptr;
}

size_t UcxRegistrations::size() const {
  absl::ReaderMutexLock lock(&mu_);
  return regions_.size();
}

absl::StatusOr<UcxRemoteKey> UcxRemoteKey::Unpack(const UcxEndpoint& ep,
                                                  std::span<const std::byte> packed) {
  ucp_rkey_h rkey = nullptr;
  const ucs_status_t status = ucp_ep_rkey_unpack(ep.get(), packed.data(), &rkey);
  if (status != UCS_OK) return UcsToStatus(status, "ucp_ep_rkey_unpack");
  return UcxRemoteKey(rkey);
}

UcxRemoteKey::UcxRemoteKey(UcxRemoteKey&& other) noexcept
    : rkey_(std::exchange(other.rkey_, nullptr)) {}

UcxRemoteKey& UcxRemoteKey::operator=(UcxRemoteKey&& other) noexcept {
  if (this != &other) {
    if (rkey_ != nullptr) ucp_rkey_destroy(rkey_);
    rkey_ = std::exchange(other.rkey_, nullptr);
  }
  return *this;
}

UcxRemoteKey::~UcxRemoteKey() {
  if (rkey_ != nullptr) ucp_rkey_destroy(rkey_);
}

absl::Status WaitRequest(UcxWorker& worker, ucs_status_ptr_t request, absl::string_view what) {
  if (request == nullptr) return absl::OkStatus();
  if (UCS_PTR_IS_ERR(request)) return UcsToStatus(UCS_PTR_STATUS(request), what);
  ucs_status_t status;
  while ((status = ucp_request_check_status(request)) == UCS_INPROGRESS) worker.Progress();
  ucp_request_free(request);
  return UcsToStatus(status, what);
}

}  // namespace pdserve::kv
