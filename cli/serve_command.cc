// `pdserve serve`: the colocated OpenAI-compatible HTTP server (prefill and decode in one process).
//
//   pdserve serve [--model DIR] [--host H] [--port P] [--max-batch N] [--pool-tokens T]
//                 [--token-budget B] [--reject-when-full] [--degeneration flag|stop]
//                 [--paranoid] [--canary-every N] [--canary-tolerance E]
//                 [--backend cpu|cuda] [--device N]
//                 [--devices LIST] [--expert-comm auto|nccl|local] [--weights bf16|fp8]
//                 [--fp8-activations bf16|fp8] [--state-tokens T|auto]
//
// --state-tokens (cuda only) sizes the device page pools of compressed state (0, the default:
// every slot full; auto: engine::AutoStateTokens, what the memory plan of an H200 leaves free,
// printed at start); admission reserves each request's pages, so one that does not fit waits
// (colocated::ServiceOptions::device_state_tokens).
// --backend cuda serves on the CUDA engine (engine/gpu, runtime/cuda/gpu_backend.h) on GPU
// --device, one state slot per --max-batch sequence; the HTTP behaviour is the CPU backend's.
// --devices "0,1" instead spans several GPUs as one expert-parallel group (experts split over the
// GPUs, requests spread over them; docs/engine-gpu.md, "Several GPUs") whose MoE collectives go
// through --expert-comm (auto: NCCL where libnccl.so.2 loads and the GPUs are distinct, else the
// in-process one, which also runs several ranks on one GPU: --devices 0,0).
// --weights fp8 (cuda only) keeps the projections the checkpoint stores FP8 e4m3 with 128 x 128
// scales in FP8 on the GPU, copied from the mmapped shards, and multiplies them with
// kernels/cuda/fp8_gemm (docs/engine-gpu.md, "FP8 weights"); bf16 (the default) rounds every
// weight to bf16 as before. --fp8-activations (with --weights fp8): the FP8 products take bf16
// activations (W8A16, the default: kernels/cuda fp8_gemm_w8a16, the weights converted to bf16 in
// registers) or e4m3 ones quantized per 1 x 128 (W8A8, fp8_gemm), engine/gpu/gpu_model.h.
// NCCL_NVLS_ENABLE=0 is set before anything starts (NVLink multicast stays off).
// The canary recomputes on the GPU and --paranoid checks the GPU's own state pages
// (runtime/cuda/gpu_step_runner.h). Without a GPU (or in a build without CUDA) it exits 1 with a
// FailedPrecondition message.
//
// Guards (docs/guards.md): --paranoid and --canary-every as deploy config guards.paranoid /
// guards.canary_every; --canary-tolerance E overrides the canary's bound (default: the backend's,
// guards/canary.h). The environment variable PDSERVE_TEST_SCRAMBLE_INDEXER=1 makes the
// lightning indexer deliberately wrong for the coherence tests (on CUDA the fixed-shape decode
// indexer: engine/gpu/gpu_model.h, test_lowest_score_indexer); it is logged as a warning.
//
// Prints "pdserve serve: listening on http://HOST:PORT" once bound (--port 0 picks a free port),
// serves until SIGINT or SIGTERM, then stops the server and the engine loop.
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "cli/command_registry.h"
#include "cli/memory_check.h"
#include "colocated/service.h"
#include "common/api_keys.h"
#ifdef PDSERVE_HAVE_CUDA_BACKEND
#include "runtime/cuda/gpu_backend.h"
#endif
#include "common/deploy_config.h"
#include "common/fatal_signal.h"
#include "common/host_port.h"
#include "common/server_log.h"
#include "common/status.h"
#include "frontend/http_server.h"

namespace pdserve::cli {
namespace {

struct ServeOptions {
  std::string model_dir = "models/kjv-v4-tiny";
  std::string host = "127.0.0.1";
  uint16_t port = 8000;
  int64_t max_batch = 64;
  int64_t pool_tokens = 0;
  // --backend cuda: GpuModelOptions::state_tokens, an integer >= 0 or "auto" ("": not given).
  std::string state_tokens;
  int64_t token_budget = 512;
  bool reject_when_full = false;
  std::string degeneration = "flag";
  bool paranoid = false;
  int64_t canary_every = 0;
  double canary_tolerance = 0;  // 0: the backend's default
  std::string backend = "cpu";
  int device = 0;
  std::string devices;  // "0,1": an expert-parallel group (overrides device)
  std::string expert_comm = "auto";
  std::string weights = "bf16";          // --backend cuda: bf16 or fp8 (engine::gpu::WeightFormat)
  std::string fp8_activations = "bf16";  // --weights fp8: bf16 or fp8 (engine::gpu::Fp8Activations)
  int64_t prefill_chunk = 0;  // --backend cuda: runtime::GpuBackendOptions::prefill_chunk
  std::string api_keys_file;  // docs/security.md
  std::string tls_cert_file;
  std::string tls_key_file;
  bool allow_half_close = false;  // frontend::HttpServerOptions::allow_half_close
};

// The runner factory of `--backend`: empty for cpu.
absl::StatusOr<runtime::RunnerFactory> BackendFactory(
    const ServeOptions& options, [[maybe_unused]] const engine::ModelOptions& model) {
  if (options.fp8_activations != "bf16" && options.weights != "fp8") {
    return absl::InvalidArgumentError(
        "--fp8-activations chooses the activations of the FP8 products: only with --weights fp8");
  }
  if (options.backend == "cpu") {
    // Flags that would do nothing on the CPU engine are refused rather than ignored.
    if (!options.devices.empty() || options.expert_comm != "auto") {
      return absl::InvalidArgumentError(
          "--devices and --expert-comm choose the GPUs of --backend cuda; the CPU engine uses "
          "neither");
    }
    if (options.weights != "bf16") {
      return absl::InvalidArgumentError(
          "--weights chooses the weight format on the GPU of --backend cuda; the CPU engine "
          "dequantizes every weight to float32");
    }
    if (options.prefill_chunk != 0) {
      return absl::InvalidArgumentError(
          "--prefill-chunk sizes the CUDA engine's prefill forward calls (--backend cuda); the "
          "CPU engine cuts prompts at every 64 tokens");
    }
    return runtime::RunnerFactory();
  }
#ifdef PDSERVE_HAVE_CUDA_BACKEND
  runtime::GpuBackendOptions gpu;
  gpu.devices = {options.device};
  if (!options.devices.empty()) {
    // Several ranks may share a GPU with the local communicator (a one-GPU trial of the sharding).
    absl::StatusOr<std::vector<int>> devices =
        config::ParseGpuList(options.devices, /*allow_repeats=*/options.expert_comm != "nccl");
    if (!devices.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--devices \"", options.devices, "\" ", devices.status().message(),
          options.expert_comm == "nccl" ? "; with NCCL each rank needs a GPU of its own "
                                          "(--expert-comm local can put several ranks on one GPU)"
                                        : ""));
    }
    gpu.devices = *devices;
  }
  PDSERVE_ASSIGN_OR_RETURN(gpu.comm, engine::gpu::ParseExpertCommKind(options.expert_comm));
  gpu.reference_pieces = model.reference_pieces;
  gpu.indexer_fault = model.indexer_fault;
  if (options.weights == "fp8") gpu.weight_format = engine::gpu::WeightFormat::kFp8Block;
  if (options.fp8_activations == "fp8") gpu.fp8_activations = engine::gpu::Fp8Activations::kFp8;
  gpu.prefill_chunk = options.prefill_chunk;
  return runtime::GpuRunnerFactory(gpu);
#else
  return absl::FailedPreconditionError(
      "--backend cuda: this pdserve was built without the CUDA backend (-DPDSERVE_CUDA=OFF, or no "
      "nvcc at configure time)");
#endif
}

// --state-tokens of --backend cuda: 0 when not given; auto: ResolveStateTokens for a worker on
// these GPUs, printed. InvalidArgument for anything but auto or an integer >= 0.
absl::StatusOr<int64_t> StateTokens(const ServeOptions& options) {
  if (options.state_tokens.empty()) return 0;
  config::WorkerConfig worker;
  worker.name = "serve";
  worker.backend = "cuda";
  worker.gpus = options.devices.empty() ? std::to_string(options.device) : options.devices;
  worker.weights = options.weights;
  if (options.prefill_chunk > 0) worker.prefill_chunk = options.prefill_chunk;
  if (options.state_tokens != "auto") {
    if (!absl::SimpleAtoi(options.state_tokens, &worker.state_tokens) || worker.state_tokens < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("--state-tokens \"", options.state_tokens, "\": auto or an integer >= 0"));
    }
    return worker.state_tokens;
  }
  worker.state_tokens = config::kAutoStateTokens;
  const WorkerPlanOptions plan{.max_batch = options.max_batch, .pool_tokens = options.pool_tokens};
  PDSERVE_ASSIGN_OR_RETURN(const int64_t tokens,
                           ResolveStateTokens(worker, options.model_dir, plan));
  std::fprintf(stderr,
               "pdserve serve: --state-tokens auto: %lld tokens of paged device state (the "
               "memory plan's %lld GiB GPU less weights, activations, graphs and allowances, "
               "less a %d%% margin)\n",
               static_cast<long long>(tokens),
               static_cast<long long>(plan.gpu_bytes / engine::kGiB),
               static_cast<int>(engine::kAutoStateMargin * 100));
  return tokens;
}

absl::Status Serve(const ServeOptions& options) {
  // NVLink multicast stays off whatever the environment says (it can take a host's shared GPUs
  // out of service). Before any thread starts.
  setenv("NCCL_NVLS_ENABLE", "0", /*overwrite=*/1);
  colocated::ServiceOptions service_options;
  service_options.model_dir = options.model_dir;
  service_options.max_batch = options.max_batch;
  service_options.pool_tokens = options.pool_tokens;
  if (options.backend == "cuda") {
    PDSERVE_ASSIGN_OR_RETURN(service_options.device_state_tokens, StateTokens(options));
  } else if (!options.state_tokens.empty()) {
    return absl::InvalidArgumentError(
        "--state-tokens sizes the CUDA engine's device page pools: it needs --backend cuda");
  }
  service_options.token_budget = options.token_budget;
  service_options.policy = options.reject_when_full ? serving::AdmissionPolicy::kReject
                                                    : serving::AdmissionPolicy::kWait;
  service_options.runner.degeneration = options.degeneration == "stop"
                                            ? runtime::DegenerationAction::kStop
                                            : runtime::DegenerationAction::kFlag;
  service_options.runner.paranoid = options.paranoid;
  service_options.canary_every = options.canary_every;
  service_options.runner.canary_tolerance = options.canary_tolerance;
  service_options.model = engine::WithTestFaultsFromEnvironment({});
  PDSERVE_ASSIGN_OR_RETURN(service_options.runner_factory,
                           BackendFactory(options, service_options.model));
  if (const std::string warning = engine::TestFaultWarning(service_options.model);
      !warning.empty()) {
    std::fprintf(stderr, "pdserve serve: %s\n", warning.c_str());
  }
  if (options.backend == "cpu") {
    std::fprintf(stderr, "pdserve serve: %s\n",
                 engine::ImplementationSummary(service_options.model).c_str());
  } else {
    std::fprintf(
        stderr, "pdserve serve: backend cuda on device(s) %s\n",
        options.devices.empty() ? std::to_string(options.device).c_str() : options.devices.c_str());
  }
  // Block the signals before any thread starts, so only sigwait below receives them.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  PDSERVE_ASSIGN_OR_RETURN(std::unique_ptr<colocated::ColocatedService> service,
                           colocated::ColocatedService::Create(service_options));
  frontend::HttpServerOptions http;
  http.host = options.host;
  http.port = options.port;
  if (!options.api_keys_file.empty()) {
    PDSERVE_ASSIGN_OR_RETURN(http.api_keys, common::ApiKeys::LoadFile(options.api_keys_file));
  }
  http.tls_cert_file = options.tls_cert_file;
  http.tls_key_file = options.tls_key_file;
  http.allow_half_close = options.allow_half_close;
  PDSERVE_ASSIGN_OR_RETURN(std::unique_ptr<frontend::HttpServer> server,
                           frontend::HttpServer::Start(http, service.get()));
  std::printf("pdserve serve: listening on %s://%s\n",
              options.tls_cert_file.empty() ? "http" : "https",
              common::HostPort(options.host, server->port()).c_str());
  std::fflush(stdout);
  int received = 0;
  sigwait(&signals, &received);
  std::fprintf(stderr, "pdserve serve: signal %d, stopping\n", received);
  server->Stop();
  return absl::OkStatus();
}

const CommandRegistrar kRegistrar([](CLI::App& app, int* exit_code) {
  auto o = std::make_shared<ServeOptions>();
  CLI::App* cmd = app.add_subcommand("serve", "Run the colocated OpenAI-compatible HTTP server");
  cmd->add_option("--model", o->model_dir, "Hugging Face model directory")->capture_default_str();
  cmd->add_option("--host", o->host, "Address to bind")->capture_default_str();
  cmd->add_option("--port", o->port, "Port (0: any free port)")->capture_default_str();
  cmd->add_option("--max-batch", o->max_batch, "Sequences running at once")
      ->capture_default_str()
      ->check(Positive());
  cmd->add_option("--pool-tokens", o->pool_tokens,
                  "Tokens of decode state the page pool holds (0: max-batch * context length)")
      ->capture_default_str()
      ->check(NonNegative());
  cmd->add_option("--state-tokens", o->state_tokens,
                  "--backend cuda: tokens of compressed state the device page pools hold over all "
                  "running sequences (0: every slot full; auto: what the memory plan leaves "
                  "free); a request that does not fit waits");
  cmd->add_option("--token-budget", o->token_budget, "Tokens per engine step")
      ->capture_default_str();
  cmd->add_flag("--reject-when-full", o->reject_when_full,
                "Answer 503 when the pool is full instead of queueing");
  cmd->add_flag("--allow-half-close", o->allow_half_close,
                "A client's end of stream during its request does not cancel it (nc -N)");
  cmd->add_option("--degeneration", o->degeneration,
                  "On degenerate output: flag (keep going) or stop (finish_reason degenerate)")
      ->capture_default_str()
      ->check(CLI::IsMember({"flag", "stop"}));
  cmd->add_flag("--paranoid", o->paranoid,
                "Verify every page's owner and epoch before each state load and after each store");
  cmd->add_option("--canary-every", o->canary_every,
                  "Recompute the last-token logits of 1 in N requests from scratch (0: never)")
      ->capture_default_str()
      ->check(NonNegative());
  cmd->add_option("--canary-tolerance", o->canary_tolerance,
                  "Canary bound on max|diff| / max|ref| (0: the backend's default, "
                  "guards/canary.h)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--backend", o->backend, "Engine: cpu, or cuda (the CUDA engine on --device)")
      ->capture_default_str()
      ->check(CLI::IsMember({"cpu", "cuda"}));
  cmd->add_option("--device", o->device, "CUDA device ordinal for --backend cuda")
      ->capture_default_str()
      ->check(NonNegative());
  cmd->add_option("--devices", o->devices,
                  "CUDA device ordinals, e.g. 0,1: one expert-parallel group (overrides --device)")
      ->check([](const std::string& list) {
        return list.empty() ? std::string("an empty list names no GPU") : std::string();
      });
  cmd->add_option("--expert-comm", o->expert_comm,
                  "Collectives of a --devices group: auto (NCCL where it loads), nccl or local")
      ->capture_default_str()
      ->check(CLI::IsMember({"auto", "nccl", "local"}));
  cmd->add_option("--weights", o->weights,
                  "Weights on the GPU (--backend cuda): bf16, or fp8 (projections stored FP8 "
                  "with block scales stay FP8)")
      ->capture_default_str()
      ->check(CLI::IsMember({"bf16", "fp8"}));
  cmd->add_option("--fp8-activations", o->fp8_activations,
                  "With --weights fp8: activations of the FP8 products, bf16 (W8A16) or fp8 "
                  "(e4m3 per 1 x 128, W8A8)")
      ->capture_default_str()
      ->check(CLI::IsMember({"bf16", "fp8"}));
  cmd->add_option("--prefill-chunk", o->prefill_chunk,
                  "--backend cuda: tokens per prefill forward call, a multiple of 64 up to 8192; "
                  "prompts are cut at its multiples, within --token-budget per step (0: at every "
                  "64 tokens)")
      ->capture_default_str()
      ->check([](const std::string& text) {
        int64_t n = 0;
        if (!absl::SimpleAtoi(text, &n) ||
            (n != 0 && (n < config::kPrefillChunkAlign || n > config::kMaxPrefillChunk ||
                        n % config::kPrefillChunkAlign != 0))) {
          return absl::StrCat("must be 0 or a multiple of ", config::kPrefillChunkAlign, " in [",
                              config::kPrefillChunkAlign, ", ", config::kMaxPrefillChunk, "]");
        }
        return std::string();
      });
  cmd->add_option("--api-keys-file", o->api_keys_file,
                  "Keys /v1/ requests must send as 'Authorization: Bearer <key>', one per line "
                  "(docs/security.md)");
  auto* cert = cmd->add_option("--tls-cert", o->tls_cert_file, "Serve HTTPS with this PEM chain");
  auto* key = cmd->add_option("--tls-key", o->tls_key_file, "The PEM private key of --tls-cert");
  cert->needs(key);
  key->needs(cert);
  cmd->callback([o, exit_code] {
    common::IgnoreBrokenPipe();             // a log reader that went away must not stop a server
    common::UseServerLog("pdserve-serve");  // a stopped reader must not block it
    const absl::Status status = Serve(*o);
    if (!status.ok()) {
      std::fprintf(stderr, "pdserve serve: %s\n", status.ToString().c_str());
      *exit_code = 1;
    }
  });
});

}  // namespace
}  // namespace pdserve::cli
