// The deployment description shared by `pdserve up`, the systemd units and
// `pdserve validate-config`: which model, which router, which prefill and decode workers run
// where (host, ports, backend, GPUs), and the per-deployment guard switches.
//
// Schema (YAML; every key below is known, any other key is an error; deploy/README.md documents
// it with examples in deploy/config/):
//   name: string (required)
//   model: {path: string (required), served_name: string}
//   router: {host, http_port (required), grpc_port, prefill_policy, decode_policy,
//            health_interval_ms, health_timeout_ms, max_body_bytes, prefill_timeout_ms,
//            queue_timeout_ms, max_prefills_per_worker, allow_half_close}
//     policies: round_robin | least_load | power_of_two | prefix_aware
//   prefill: [worker, ...] (at least one)      decode: [worker, ...] (at least one)
//     worker: {name (required, unique), host (required), port (required), metrics_port,
//              backend: cpu | cuda (required), gpus: "0" / "0,1" (required iff cuda; several
//              distinct GPUs make the worker one expert-parallel group, docs/engine-gpu.md),
//              threads (cpu only), weights: bf16 | fp8 (cuda only, default bf16: fp8 keeps
//              the projections the checkpoint stores FP8 in FP8 on the GPU, docs/engine-gpu.md)}
//   transfer: {transport: ucx, lease_ms (>= kMinLeaseMs), lanes: 0 .. 16 (0, the default: one per
//   four cores of
//              the worker's host, 1 .. 16; docs/protocol.md, "Lanes")}
//   security: {api_keys_file, tls: {cert_file, key_file}, cluster_tls: {ca_file, cert_file,
//   key_file}}
//     (all optional; docs/security.md): API keys on the router's HTTP and gRPC fronts, TLS on
//     those fronts, and mutual TLS between the router and the workers' gRPC.
//   grpc: {handshake_timeout_ms, max_connection_idle_ms, max_connection_age_ms,
//          max_connection_age_grace_ms} (GrpcConfig: every gRPC listener's connection limits)
//   share_gpus: bool (default false): workers of a host may name the same GPU (a one-GPU trial of
//     prefill and decode on the CUDA engine; each worker holds its own weights and state there)
//   guards: {degeneration_action: flag | stop, paranoid: bool, canary_every: int >= 0,
//            canary_tolerance: number >= 0 (0: the backend's default),
//            reference_kernels: [sparse_attention | indexer | fp8_state, ...]}
// Cross-field rules: (host, port) pairs unique over the router's and workers' ports; a GPU of a
// host is given to at most one worker unless share_gpus; ports in 1..65535.
//
// Errors carry the file, the 1-based line and column (yaml-cpp's Mark) and the key path
// ("prefill[1].gpus"). Thread-safe: pure functions over their arguments.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace pdserve::config {

struct ConfigError {
  std::string file;
  int line = 0;    // 1-based; 0 when unknown
  int column = 0;  // 1-based
  std::string key;
  std::string message;
  // "file:line:column: key: message"
  std::string ToString() const;
};

// WorkerConfig::state_tokens of `state_tokens: auto`.
inline constexpr int64_t kAutoStateTokens = -1;

struct WorkerConfig {
  std::string name;
  std::string host;
  int port = 0;
  int metrics_port = 0;  // 0: /metrics on `port`'s HTTP side is not served separately
  std::string backend;   // "cpu" or "cuda"
  // CUDA_VISIBLE_DEVICES value, "" for cpu. Several GPUs ("0,1"): one expert-parallel group,
  // a rank per GPU (engine/gpu/gpu_model_group.h).
  std::string gpus;
  int threads = 0;               // cpu backend threads, 0: all cores
  std::string weights = "bf16";  // cuda: "bf16" or "fp8" (engine::gpu::WeightFormat)
  // weights fp8 only: the activations of the FP8 products, "bf16" (W8A16) or "fp8" (W8A8)
  // (engine::gpu::Fp8Activations).
  std::string fp8_activations = "bf16";
  // Decode workers with backend cuda: tokens of paged device state the GPU engine's pools hold
  // over all requests (GpuModelOptions::state_tokens, decode::DecodeWorkerOptions::
  // device_state_tokens; Reserve reserves each request's pages); 0: every slot full;
  // kAutoStateTokens (`state_tokens: auto`): what the memory plan leaves free
  // (engine::AutoStateTokens, resolved at start by cli::ResolveStateTokens).
  int64_t state_tokens = 0;
  // Prefill workers with backend cuda: tokens per prefill forward call, a multiple of
  // kPrefillChunkAlign in [kPrefillChunkAlign, kMaxPrefillChunk]; the prompt is cut at its
  // multiples and the GPU's activations are sized for it (runtime::GpuBackendOptions::
  // prefill_chunk). 0 (default): cut at every 64 tokens, activations for 256 rows.
  int64_t prefill_chunk = 0;
};

inline constexpr int64_t kPrefillChunkAlign = 64;
inline constexpr int64_t kMaxPrefillChunk = 8192;

struct RouterConfig {
  std::string host = "127.0.0.1";
  int http_port = 0;
  int grpc_port = 0;  // 0: no gRPC front
  std::string prefill_policy = "least_load";
  std::string decode_policy = "least_load";
  int health_interval_ms = 1000;
  // Deadline of the health check's Health and Stats RPCs, in [100, 600000]: raise it
  // where workers share few cores with their engines and answer late under load.
  int health_timeout_ms = 2000;
  int64_t max_body_bytes = 4 << 20;
  int prefill_timeout_ms = 60000;  // the Prefill RPC's deadline, in [100, 3600000]
  // Longest wait for decode room or prefill room, in [0, 3600000]; 0: no waiting.
  int queue_timeout_ms = 60000;
  // Requests one router sends to one prefill worker at a time, in [0, 1024]; 0: no cap
  // (router::RouterOptions::max_prefills_per_worker).
  int max_prefills_per_worker = 2;
  // The HTTP front's frontend::HttpServerOptions::allow_half_close: a client's end of stream
  // during its request does not cancel it (docs/operations.md, "Half-closed clients").
  bool allow_half_close = false;
};

// Connection limits of every gRPC listener of the deployment: the router's front and each
// worker's server (rpc::ApplyConnectionLimits; docs/operations.md, "Idle gRPC connections").
// Milliseconds. In the max_* fields 0 means no limit; any other value is in
// [kMinGrpcLimitMs, kMaxGrpcLimitMs].
struct GrpcConfig {
  // A connection that has not finished its handshake (TLS where configured, and the client's
  // HTTP/2 settings) by then is closed; gRPC's own default is 120000. In [kMinGrpcLimitMs,
  // kMaxGrpcHandshakeMs].
  int handshake_timeout_ms = 10000;
  // A connection with no call for this long gets GOAWAY and is closed (clients reconnect for
  // their next call). HTTP/2 pings do not count as calls.
  int max_connection_idle_ms = 60000;
  // A connection this old gets GOAWAY (no new calls on it; those in flight go on). 0: none.
  int max_connection_age_ms = 0;
  // After max_connection_age_ms: how long calls in flight may go on before the connection is
  // closed under them. 0: until they end. Only with max_connection_age_ms.
  int max_connection_age_grace_ms = 0;
};

inline constexpr int kMinGrpcLimitMs = 1000;
inline constexpr int kMaxGrpcLimitMs = 86400000;  // a day
inline constexpr int kMaxGrpcHandshakeMs = 600000;

struct GuardsConfig {
  std::string degeneration_action = "flag";
  bool paranoid = false;
  int canary_every = 0;  // 0: no canary
  // The canary's bound on max|diff| / max|ref| (runtime::RunnerOptions::canary_tolerance); 0: the
  // backend's default (guards/canary.h).
  double canary_tolerance = 0;
  std::vector<std::string> reference_kernels;
};

// Who may call the cluster (docs/security.md). Empty strings: off (the default, for loopback).
struct SecurityConfig {
  // Keys the router's HTTP and gRPC fronts accept as `Authorization: Bearer <key>`, one per line.
  std::string api_keys_file;
  // PEM certificate chain and private key the router's fronts serve TLS with (HTTPS, gRPC TLS).
  std::string tls_cert_file;
  std::string tls_key_file;
  // Mutual TLS between the router and the workers: every worker's gRPC requires a client
  // certificate signed by ca_file, and the router verifies the workers against it; both sides
  // present cert_file / key_file (the cluster's certificate).
  std::string cluster_ca_file;
  std::string cluster_cert_file;
  std::string cluster_key_file;

  bool cluster_tls() const { return !cluster_ca_file.empty(); }
  bool front_tls() const { return !tls_cert_file.empty(); }
};

inline constexpr int kMaxConfigTransferLanes = 16;
// transfer.cuda_ipc_arena_tokens at most (the longest context any supported model has, 16x over).
inline constexpr int64_t kMaxCudaIpcArenaTokens = int64_t{1} << 24;
// transfer.cuda_ipc_arena_tokens when 0: the model's context, at most this many tokens. A 1M-token
// V4-Flash context would make the prefill worker's arena ~7.5 GB and the decode worker's device
// page pool (4 requests) ~30 GB of GPU memory; 128K tokens keep them at 0.89 and 3.54 GB
// (runtime/cuda_ipc_memory.h; `pdserve plan` counts them), and a longer request goes by host
// pages.
inline constexpr int64_t kDefaultCudaIpcArenaTokens = int64_t{1} << 17;

// transfer.lease_ms below this is refused: a transfer's first heartbeat comes only after the UCX
// connect and the first prefill block, and a prefill waiting in its worker's queue gives up
// after half the lease (docs/protocol.md, "Prefill worker"); under 1 s, a loaded host's
// scheduling alone ends healthy transfers and refuses queued requests (breaker53: 100 ms served
// 1 request in 32 and counted lease isolation failures).
inline constexpr int kMinLeaseMs = 1000;
// validate-config warns below this: a request queued on a prefill worker behind one prefill
// that takes longer than half the lease (a long prompt on the CPU engine takes seconds) is
// refused with 429 prefill_busy.
inline constexpr int kLeaseWarnBelowMs = 10000;

struct DeployConfig {
  std::string name;
  std::string model_path;
  std::string served_name;
  RouterConfig router;
  std::vector<WorkerConfig> prefill;
  std::vector<WorkerConfig> decode;
  std::string transport = "ucx";
  int lease_ms = 30000;  // in [kMinLeaseMs, 3600000]
  // UCX workers, endpoints and threads per transfer endpoint; 0: chosen from the host's cores
  // (kv::DefaultTransferLanes). At most kMaxConfigTransferLanes (= kv::kMaxTransferLanes).
  int transfer_lanes = 0;
  // UCX's protocol implementation for the transfer (kv::UcxProtocols): "v1" (default, UCX
  // 1.13's own) or "v2" (UCX_PROTO_ENABLE=y; docs/protocol.md, "UCX protocols"). Prefill and
  // decode must agree; UCX_PROTO_ENABLE in a worker's environment overrides it.
  std::string transfer_ucx_protocols = "v1";
  // Both workers register their page pool's host memory with UCX once (ucp_mem_map) and pass
  // that handle with each page send and rendezvous receive (docs/protocol.md, "Registered page
  // memory"). Off by default: measured no better on this machine, and not run on the GPU host.
  bool transfer_register_pages = false;
  // Same-host pages by shared memory (docs/protocol.md, "Same-host pages by shared memory"): the
  // prefill worker's page pool lives in a memfd the decode worker maps read-only, and the decode
  // worker copies each page out of it after its header passed every check, instead of receiving
  // it over UCX. Used per ticket only where both workers have it on and run on one host as one
  // user; otherwise active messages. On by default since 2026-12-05: on the H200 host it moved
  // 1.2-1.8x the active-message rate on host pages and 1.15-1.2x on the CUDA -> CUDA path, its
  // state equal (docs/perf.md, "Same-host pages by shared memory").
  bool transfer_shm_pull = true;
  // A CUDA decode worker imports each transferred layer into the request's GPU slot as it
  // arrives (runtime/early_import.h) instead of at the first step (docs/engine-gpu.md, "Early
  // import"). On by default since its H200 run of 2026-12-04; false: the import at the first step.
  bool transfer_early_import = true;
  // Same-host device-to-device pages between CUDA workers (docs/protocol.md, "Same-host
  // device-to-device pages (CUDA IPC)"): "auto" (default) uses them where both workers are
  // backend cuda on one host and the decode worker's process can map the prefill worker's GPU
  // memory, and host pages otherwise; "on" is auto that also refuses to start a cuda worker
  // that cannot set its side up (the arena or the device page pool); "off": host pages always.
  std::string transfer_cuda_ipc = "auto";
  // Tokens of state the prefill worker's GPU arena holds (one request's prompt + max_tokens at
  // most); 0 (default): the model's context up to kDefaultCudaIpcArenaTokens.
  int64_t transfer_cuda_ipc_arena_tokens = 0;
  GuardsConfig guards;
  SecurityConfig security;
  GrpcConfig grpc;
  bool share_gpus = false;
};

struct ParsedDeployConfig {
  DeployConfig config;              // meaningful only when errors is empty
  std::vector<ConfigError> errors;  // every problem found, in file order
};

// A worker's `gpus` value as GPU indices in order: "0,1" -> {0, 1}. InvalidArgument for an empty
// list, an entry that is not plain decimal digits (no spaces, signs or leading zeros: the value
// becomes CUDA_VISIBLE_DEVICES as written) or above kMaxGpuIndex, or an index named twice (one
// rank per GPU) unless allow_repeats (`pdserve serve --devices 0,0 --expert-comm local`: several
// ranks on one GPU, for trying the expert sharding where only one GPU exists).
inline constexpr int kMaxGpuIndex = 1023;
absl::StatusOr<std::vector<int>> ParseGpuList(absl::string_view gpus, bool allow_repeats = false);

// Parses and validates YAML text; `file` names it in errors.
ParsedDeployConfig ParseDeployConfig(absl::string_view yaml, const std::string& file);
// Reads `path` and parses it. A missing file is one error with line 0.
ParsedDeployConfig LoadDeployConfigFile(const std::string& path);
// LoadDeployConfigFile as a StatusOr: InvalidArgument listing every error, one per line.
absl::StatusOr<DeployConfig> LoadDeployConfig(const std::string& path);

// OK when `config.model_path` holds a config.json as seen from the current working directory
// (the directory the workers and the router resolve a relative path against). Else
// FailedPrecondition naming the path and the working directory. `pdserve up` refuses to start
// on it; `pdserve validate-config` warns (the file may be checked where the model is not).
absl::Status CheckModelPath(const DeployConfig& config);

// Empty when the router's health checks keep its channels to the workers connected: a check
// goes to each worker every router.health_interval_ms, and a worker closes a connection that
// carried no call for grpc.max_connection_idle_ms (0: never). Else a warning naming both: each
// channel then goes idle between two checks, and the next call on it (a check, a request's
// Reserve) first connects again. Not an error: such calls still work, a connection's set-up
// later. `pdserve validate-config` and `pdserve router` print it.
std::string IdleChannelWarning(const DeployConfig& config);

// transfer.cuda_ipc_arena_tokens, 0 read as kDefaultCudaIpcArenaTokens (each worker then takes
// the smaller of it and its model's context: runtime::CudaIpcRequestTokens).
inline int64_t CudaIpcArenaTokens(const DeployConfig& config) {
  return config.transfer_cuda_ipc_arena_tokens > 0 ? config.transfer_cuda_ipc_arena_tokens
                                                   : kDefaultCudaIpcArenaTokens;
}

// transfer.cuda_ipc as the workers act on it: "auto" read as "off" where no request could ever
// go by GPU pages (no backend cuda prefill worker on one GPU, no backend cuda decode worker on
// one GPU, or transfer.early_import false): the prefill arena and the decode device page pool
// would take HBM for nothing (0.82 + 3.30 GiB for V4-Flash at 131072 tokens). "on" and "off"
// are returned as they are (validation refuses "on" without the pair or the early import).
std::string EffectiveCudaIpc(const DeployConfig& config);

}  // namespace pdserve::config
