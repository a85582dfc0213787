// Issue 11's benchmark (docs/perf.md, "Several GPUs"): a model with DeepSeek-V4-Flash layer
// shapes (engine::ModelConfig's defaults: hidden 4096, 256 routed experts of 2048, top-6, 64
// heads x 512, indexer 64 x 128, top-k 512, hc 4, vocab 129280) and random weights, on two GPUs:
//
//   transfer: one request's decode state (prefilled on GPU 0 to --transfer-context tokens) moved
//     to a model on GPU 1 as the PD workers' engines move it (GpuModel::ExportState to host, then
//     ImportState; the workers add UCX between the two), against a plain cudaMemcpyPeerAsync and
//     an NCCL send / recv of the same bytes, in the same run. Median of --repeats.
//   decode: tokens/s of decode steps at each batch of --batches (graph decode, logits copied to
//     the host each step, as the servers run it) for PD's decode worker (one GPU, every expert:
//     GPU 1) and for a colocated 2-GPU expert-parallel group (GPUs 0 and 1, NCCL; the batch split
//     over the ranks). Each sequence is prefilled with --prompt tokens first.
//
// The layer count is --layers: the host holds the random weights in fp32 (25.8 GB of experts per
// layer) before they are uploaded, so the host's memory, not the GPUs', bounds it (bf16 on the
// GPU: 12.9 GB per layer on one GPU, half that per rank of the group). Decode cost grows linearly
// with the layers; the tokens/s of the 43-layer model are about layers / 43 of these.
//
// Prints one table row per measurement (markdown) and nothing else on stdout. Needs two CUDA
// devices and NCCL for the 2-GPU rows; with one device it runs the one-GPU rows only.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/status/status.h"
#include "absl/strings/str_split.h"
#include "bench/ep/flash_shapes.h"
#include "common/status.h"
#include "engine/config.h"
#include "engine/expert_parallel.h"
#include "engine/gpu/device_memory.h"
#include "engine/gpu/gpu_model.h"
#include "engine/gpu/gpu_model_group.h"
#include "engine/random_weights.h"
#include "engine/weights.h"
#ifdef PDSERVE_HAVE_NCCL
#include "engine/gpu/nccl_comm.h"
#endif

namespace pdserve::bench {
namespace {

using engine::gpu::GpuModel;
using engine::gpu::GpuModelGroup;

struct Flags {
  int64_t layers = 4;
  std::string batches = "1,2,4,8,16,32,64";
  int64_t prompt = 64;
  int64_t steps = 32;
  int64_t transfer_context = 4096;
  int64_t repeats = 5;
  int64_t vocab = 129280;
  // The expert-parallel group's GPUs and communicator ("0,0" with "local": two ranks on one GPU,
  // which checks the path on a one-GPU machine; its figures say nothing about two GPUs).
  std::string ep_devices = "0,1";
  std::string ep_comm = "nccl";
};

absl::StatusOr<std::unique_ptr<GpuModelGroup>> MakeGroup(
    const engine::ModelConfig& config, const engine::Weights& weights, std::vector<int> devices,
    int64_t slots, int64_t max_context,
    engine::gpu::ExpertCommKind comm = engine::gpu::ExpertCommKind::kNccl) {
  engine::gpu::GpuGroupOptions options;
  options.devices = std::move(devices);
  options.comm = comm;
  options.model.slots = slots;
  options.model.max_context = max_context;
  options.model.max_chunk = 256;
  return GpuModelGroup::Create(config, weights, options);
}

// Decode tokens/s of `batch` sequences spread over the group's ranks (sequence i on rank
// i % world), each prefilled with `prompt` tokens, over `steps` graph decode steps after 3 warm-up
// steps.
absl::StatusOr<double> DecodeRate(GpuModelGroup& group, int64_t batch, const Flags& flags) {
  const int64_t world = group.world();
  std::vector<std::vector<int64_t>> slots(static_cast<size_t>(world));
  for (int64_t i = 0; i < batch; ++i) {
    slots[static_cast<size_t>(i % world)].push_back(i / world);
  }
  std::vector<int32_t> prompt(static_cast<size_t>(flags.prompt));
  for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = static_cast<int32_t>(7 + 13 * i);
  for (size_t round = 0; round < slots[0].size(); ++round) {
    for (const absl::Status& s : group.Run([&](int64_t r, GpuModel&gpu) -> absl::Status {
           const auto& mine = slots[static_cast<size_t>(r)];
           if (round >= mine.size()) return gpu.Idle(flags.prompt);
           PDSERVE_RETURN_IF_ERROR(gpu.ResetSlot(mine[round]));
           return gpu.Forward(mine[round], prompt, flags.prompt).status();
         })) {
      PDSERVE_RETURN_IF_ERROR(s);
    }
  }
  std::vector<int64_t> sizes;
  for (const auto& s : slots) sizes.push_back(static_cast<int64_t>(s.size()));
  PDSERVE_ASSIGN_OR_RETURN(const int64_t rows,
                           engine::GroupDecodeRows(sizes, group.rank(0).decode_buckets()));
  auto step = [&](int64_t t) -> absl::Status {
    for (const absl::Status& s : group.Run([&](int64_t r, GpuModel&gpu) -> absl::Status {
           const auto& mine = slots[static_cast<size_t>(r)];
           std::vector<int32_t> tokens(mine.size(), static_cast<int32_t>(100 + t));
           return gpu.DecodeStep(mine, tokens, /*use_graph=*/true, world > 1 ? rows : 0).status();
         })) {
      PDSERVE_RETURN_IF_ERROR(s);
    }
    return absl::OkStatus();
  };
  for (int64_t t = 0; t < 3; ++t) PDSERVE_RETURN_IF_ERROR(step(t));
  const Clock::time_point start = Clock::now();
  for (int64_t t = 0; t < flags.steps; ++t) PDSERVE_RETURN_IF_ERROR(step(3 + t));
  return static_cast<double>(batch * flags.steps) / Seconds(start);
}

// Device bytes of a request's state: window rows, entries and indexer keys bf16, the compressors'
// partial windows and overlaps fp32 (GpuModel's pools).
int64_t StateBytes(const engine::ModelState& state) {
  int64_t bytes = 0;
  for (const engine::LayerState& l : state.layers) {
    bytes += 2 * l.window_kv.numel();
    for (const engine::CompressorState* c : {&l.compressor, &l.indexer}) {
      bytes += 2 * c->entries.numel();
      bytes += 4 * (c->buffer_kv.numel() + c->buffer_gate.numel() + c->overlap_kv.numel() +
                    c->overlap_gate.numel());
    }
  }
  return bytes;
}

absl::Status Transfer(const engine::ModelConfig& config, const engine::Weights& weights,
                      const Flags& flags) {
  const int64_t context = flags.transfer_context;
  PDSERVE_ASSIGN_OR_RETURN(auto prefill, MakeGroup(config, weights, {0}, 1, context + 64));
  PDSERVE_ASSIGN_OR_RETURN(auto decode, MakeGroup(config, weights, {1}, 1, context + 64));
  std::fprintf(stderr, "transfer: two 1-GPU models loaded\n");
  GpuModel& p = prefill->rank(0);
  GpuModel& d = decode->rank(0);
  for (int64_t from = 0; from < context; from += p.max_chunk()) {
    std::vector<int32_t> chunk;
    for (int64_t i = from; i < std::min(context, from + p.max_chunk()); ++i) {
      chunk.push_back(static_cast<int32_t>((31 * i + 5) % config.vocab_size));
    }
    PDSERVE_RETURN_IF_ERROR(p.Forward(0, chunk).status());
  }
  std::vector<double> staged;
  int64_t bytes = 0;
  for (int64_t i = 0; i < flags.repeats; ++i) {
    const Clock::time_point start = Clock::now();
    PDSERVE_ASSIGN_OR_RETURN(engine::ModelState state, p.ExportState(0));
    PDSERVE_RETURN_IF_ERROR(d.ImportState(0, state));
    staged.push_back(Seconds(start));
    bytes = StateBytes(state);
  }
  const auto b = static_cast<size_t>(bytes);
  engine::gpu::DeviceArray<unsigned char> src, dst;
  PDSERVE_RETURN_IF_ERROR(engine::gpu::CudaStatus(cudaSetDevice(0), "cudaSetDevice"));
  PDSERVE_RETURN_IF_ERROR(src.Allocate(b));
  PDSERVE_RETURN_IF_ERROR(src.Fill(0x5A));
  PDSERVE_RETURN_IF_ERROR(engine::gpu::CudaStatus(cudaSetDevice(1), "cudaSetDevice"));
  PDSERVE_RETURN_IF_ERROR(dst.Allocate(b));
  std::vector<double> peer;
  for (int64_t i = 0; i < flags.repeats + 1; ++i) {
    const Clock::time_point start = Clock::now();
    PDSERVE_CUDA_RETURN(cudaMemcpyPeer(dst.get(), 1, src.get(), 0, b));
    PDSERVE_CUDA_RETURN(cudaDeviceSynchronize());
    if (i > 0) peer.push_back(Seconds(start));  // the first pays for the peer mapping
  }
  std::printf(
      "| transfer | state of %lld tokens, %lld layers | %.1f MB | export + import "
      "(host-staged) %.2f GB/s | cudaMemcpyPeer %.2f GB/s |",
      static_cast<long long>(context), static_cast<long long>(config.num_hidden_layers),
      static_cast<double>(bytes) / 1e6, static_cast<double>(bytes) / Median(staged) / 1e9,
      static_cast<double>(bytes) / Median(peer) / 1e9);
#ifdef PDSERVE_HAVE_NCCL
  PDSERVE_ASSIGN_OR_RETURN(auto comms, engine::gpu::CreateNcclComms({0, 1}));
  cudaStream_t s0 = nullptr;
  cudaStream_t s1 = nullptr;
  cudaSetDevice(0);
  PDSERVE_CUDA_RETURN(cudaStreamCreate(&s0));
  cudaSetDevice(1);
  PDSERVE_CUDA_RETURN(cudaStreamCreate(&s1));
  std::vector<double> nccl;
  for (int64_t i = 0; i < flags.repeats + 1; ++i) {
    const Clock::time_point start = Clock::now();
    PDSERVE_RETURN_IF_ERROR(
        engine::gpu::NcclSendRecv(*comms[0], src.get(), s0, *comms[1], dst.get(), s1, b));
    PDSERVE_CUDA_RETURN(cudaStreamSynchronize(s0));
    PDSERVE_CUDA_RETURN(cudaStreamSynchronize(s1));
    if (i > 0) nccl.push_back(Seconds(start));  // the first sets up the connection
  }
  std::printf(" NCCL send/recv %.2f GB/s |\n", static_cast<double>(bytes) / Median(nccl) / 1e9);
  cudaStreamDestroy(s0);
  cudaStreamDestroy(s1);
#else
  std::printf(" NCCL: not built |\n");
#endif
  return absl::OkStatus();
}

absl::Status Run(const Flags& flags) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    return absl::FailedPreconditionError("no CUDA device");
  }
  std::vector<int64_t> batches;
  for (absl::string_view b : absl::StrSplit(flags.batches, ',')) {
    batches.push_back(std::stoll(std::string(b)));
  }
  const int64_t max_batch = *std::max_element(batches.begin(), batches.end());
  const engine::ModelConfig config = FlashShapes(flags.layers, flags.vocab);
  const Clock::time_point made = Clock::now();
  const engine::Weights weights = engine::FastRandomWeights(config, 1);
  std::fprintf(stderr, "random weights of %lld layers in %.1f s\n",
               static_cast<long long>(flags.layers), Seconds(made));
  if (devices >= 2) PDSERVE_RETURN_IF_ERROR(Transfer(config, weights, flags));
  const int64_t context = flags.prompt + flags.steps + 8;
  std::printf("| decode | setup | layers | batch | tokens/s |\n");
  struct Setup {
    std::string name;
    std::vector<int> devices;
  };
  std::vector<Setup> setups = {{"PD decode worker, 1 GPU", {devices >= 2 ? 1 : 0}}};
  PDSERVE_ASSIGN_OR_RETURN(const engine::gpu::ExpertCommKind comm,
                           engine::gpu::ParseExpertCommKind(flags.ep_comm));
  std::vector<int> ep_devices;
  for (absl::string_view d : absl::StrSplit(flags.ep_devices, ',')) {
    ep_devices.push_back(std::stoi(std::string(d)));
  }
  if (*std::max_element(ep_devices.begin(), ep_devices.end()) < devices) {
    setups.push_back(
        {"colocated EP, GPUs " + flags.ep_devices + " (" + flags.ep_comm + ")", ep_devices});
  }
  for (const Setup& setup : setups) {
    const auto world = static_cast<int64_t>(setup.devices.size());
    const Clock::time_point load = Clock::now();
    PDSERVE_ASSIGN_OR_RETURN(auto group, MakeGroup(config, weights, setup.devices,
                                                   (max_batch + world - 1) / world, context, comm));
    std::fprintf(stderr, "%s: %s loaded in %.1f s\n", setup.name.c_str(), group->Describe().c_str(),
                 Seconds(load));
    for (int64_t batch : batches) {
      PDSERVE_ASSIGN_OR_RETURN(const double rate, DecodeRate(*group, batch, flags));
      std::printf("| decode | %s | %lld | %lld | %.1f |\n", setup.name.c_str(),
                  static_cast<long long>(flags.layers), static_cast<long long>(batch), rate);
      std::fflush(stdout);
    }
  }
  return absl::OkStatus();
}

}  // namespace
}  // namespace pdserve::bench

int main(int argc, char** argv) {
  pdserve::bench::Flags flags;
  CLI::App app("Issue 11's benchmark: GPU -> GPU state transfer and 1-GPU vs 2-GPU decode");
  app.add_option("--layers", flags.layers, "Layers (bounded by host memory: 26 GB each)");
  app.add_option("--batches", flags.batches, "Decode batches, comma-separated");
  app.add_option("--prompt", flags.prompt, "Tokens prefilled per sequence before decode");
  app.add_option("--steps", flags.steps, "Timed decode steps per batch");
  app.add_option("--transfer-context", flags.transfer_context, "Tokens of the moved state");
  app.add_option("--repeats", flags.repeats, "Transfers timed (median)");
  app.add_option("--vocab", flags.vocab, "Vocabulary (V4-Flash: 129280)");
  app.add_option("--ep-devices", flags.ep_devices, "The expert-parallel group's GPUs");
  app.add_option("--ep-comm", flags.ep_comm, "Its communicator: nccl, local or auto");
  CLI11_PARSE(app, argc, argv);
  setenv("NCCL_NVLS_ENABLE", "0", /*overwrite=*/1);
  const absl::Status status = pdserve::bench::Run(flags);
  if (!status.ok()) {
    std::fprintf(stderr, "ep_bench: %s\n", status.ToString().c_str());
    return 1;
  }
  return 0;
}
