#include "runtime/cuda/gpu_prefill_engine.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "engine/gpu/device_memory.h"
#include "kernels/env_switch.h"
#include "runtime/cuda/device_state_pages.h"

namespace pdserve::runtime {
namespace {

constexpr int64_t kSlot = 0;

}  // namespace

absl::StatusOr<std::unique_ptr<GpuPrefillEngine>> GpuPrefillEngine::Create(
    std::unique_ptr<engine::gpu::GpuModelGroup> group, int64_t prefill_block,
    int64_t staging_buffers, int host_threads) {
  if (group == nullptr) return absl::InvalidArgumentError("GPU prefill: no GpuModel");
  engine::gpu::GpuModel& gpu = group->rank(0);
  const int64_t max_chunk = gpu.max_chunk();
  if (prefill_block < 1 || prefill_block > max_chunk) {
    return absl::InvalidArgumentError(absl::StrCat("GPU prefill: prefill_block ", prefill_block,
                                                   " outside [1, max_chunk ", max_chunk, "]"));
  }
  const int64_t layers = gpu.config().num_hidden_layers;
  if (staging_buffers < 0 || staging_buffers > layers) {
    return absl::InvalidArgumentError(absl::StrCat("GPU prefill: ", staging_buffers,
                                                   " staging buffers outside [0, ", layers, "]"));
  }
  if (host_threads < 0 || host_threads > 64) {
    return absl::InvalidArgumentError(
        absl::StrCat("GPU prefill: ", host_threads, " host threads outside [0, 64]"));
  }
  if (host_threads == 0)
    host_threads = DefaultTransferHostThreads(std::thread::hardware_concurrency());
  if (staging_buffers == 0) {
    const auto fit =
        static_cast<int64_t>(kStagingBudgetBytes / std::max<size_t>(1, gpu.StagingLayerBytes()));
    staging_buffers = std::clamp<int64_t>(fit, std::min<int64_t>(2, layers), layers);
  }
  PDSERVE_ASSIGN_OR_RETURN(std::unique_ptr<engine::gpu::StateStaging> staging,
                           gpu.NewStateStaging(staging_buffers));
  return std::unique_ptr<GpuPrefillEngine>(
      new GpuPrefillEngine(std::move(group), std::move(staging), prefill_block, host_threads));
}

absl::StatusOr<std::unique_ptr<GpuPrefillEngine>> GpuPrefillEngine::Create(
    engine::gpu::GpuModel* gpu, int64_t prefill_block, int64_t staging_buffers, int host_threads) {
  if (gpu == nullptr) return absl::InvalidArgumentError("GPU prefill: no GpuModel");
  return Create(engine::gpu::GpuModelGroup::Single(gpu), prefill_block, staging_buffers,
                host_threads);
}

absl::StatusOr<std::vector<float>> GpuPrefillEngine::Run(std::span<const int32_t> prompt,
                                                         const runtime::PagedState& paged,
                                                         const runtime::SequencePages& pages,
                                                         const LayerStored& layer_stored,
                                                         const ChunkDone& chunk_done) {
  PDSERVE_RETURN_IF_ERROR(BeginPrompt(prompt));
  const auto length = static_cast<int64_t>(prompt.size());
  engine::gpu::GpuModel& gpu = group_->rank(0);
  engine::Tensor logits;
  // On one GPU the last chunk is only begun: its layers' state is stored and posted on this
  // thread as each layer's copy lands, while the later layers compute (GpuModel::
  // BeginForwardExporting); then the chunk is finished. A group runs every chunk whole (its
  // collectives synchronize inside the forward) and stores after it.
  const bool overlap = group_->world() == 1;
  // Only the last chunk's last row is sampled from; the other rows need not reach the host.
  const engine::gpu::ChunkLogits rows = engine::gpu::ServingChunkLogits();
  for (int64_t from = 0; from < length;) {
    const int64_t to = PrefillBlockEnd(from, length, prefill_block_);
    const std::vector<int32_t> tokens(prompt.begin() + from, prompt.begin() + to);
    if (overlap && to == length) {
      PDSERVE_RETURN_IF_ERROR(gpu.BeginForwardExporting(kSlot, tokens, staging_.get(), rows));
      const absl::Status stored =
          StoreSlotStaged(gpu, kSlot, *staging_, paged, pages, layer_stored, &pool_);
      absl::StatusOr<engine::Tensor> finished = gpu.FinishForward();
      PDSERVE_RETURN_IF_ERROR(stored);
      PDSERVE_RETURN_IF_ERROR(finished.status());
      logits = std::move(*finished);
      NoteChunkLayers();
      PDSERVE_RETURN_IF_ERROR(chunk_done(to - from));
      break;
    }
    // Rank 0 runs the chunk; the other ranks of a group meet its MoE collectives with padding.
    const std::vector<absl::Status> ran =
        group_->Run([&](int64_t r, engine::gpu::GpuModel& model) -> absl::Status {
          if (r > 0) return model.Idle(to - from);
          PDSERVE_ASSIGN_OR_RETURN(logits, model.Forward(kSlot, tokens, 0, rows));
          return absl::OkStatus();
        });
    for (const absl::Status& s : ran) PDSERVE_RETURN_IF_ERROR(s);
    NoteChunkLayers();
    PDSERVE_RETURN_IF_ERROR(chunk_done(to - from));
    from = to;
  }
  const int64_t vocab = logits.dim(1);
  const float* last = logits.ptr() + (logits.dim(0) - 1) * vocab;
  std::vector<float> last_logits(last, last + vocab);
  if (!overlap) {
    PDSERVE_RETURN_IF_ERROR(
        StoreSlotStaged(gpu, kSlot, *staging_, paged, pages, layer_stored, &pool_));
  }
  return last_logits;
}

absl::Status GpuPrefillEngine::BeginPrompt(std::span<const int32_t> prompt) {
  if (prompt.empty()) return absl::InvalidArgumentError("the prompt is empty");
  const auto length = static_cast<int64_t>(prompt.size());
  engine::gpu::GpuModel& gpu = group_->rank(0);
  if (length > gpu.max_context()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a prompt of ", length, " tokens exceeds the GPU slot's context of ", gpu.max_context()));
  }
  // A failed earlier prefill may have left the slot mid-prompt and copies in the staging.
  PDSERVE_RETURN_IF_ERROR(staging_->Discard());
  return gpu.ResetSlot(kSlot);
}

absl::StatusOr<std::vector<float>> GpuPrefillEngine::ForwardChunks(
    std::span<const int32_t> prompt, const ChunkDone& chunk_done,
    const engine::gpu::GpuModel::LayerFinal& last_chunk_final) {
  PDSERVE_RETURN_IF_ERROR(BeginPrompt(prompt));
  const auto length = static_cast<int64_t>(prompt.size());
  engine::gpu::GpuModel& gpu = group_->rank(0);
  const engine::gpu::ChunkLogits rows = engine::gpu::ServingChunkLogits();
  engine::Tensor logits;
  for (int64_t from = 0; from < length;) {
    const int64_t to = PrefillBlockEnd(from, length, prefill_block_);
    const std::vector<int32_t> tokens(prompt.begin() + from, prompt.begin() + to);
    if (last_chunk_final && to == length) {
      const absl::Status begun = gpu.BeginForwardStoring(kSlot, tokens, last_chunk_final, rows);
      absl::StatusOr<engine::Tensor> finished = gpu.FinishForward();  // also after an error
      PDSERVE_RETURN_IF_ERROR(begun);
      PDSERVE_ASSIGN_OR_RETURN(logits, std::move(finished));
    } else {
      PDSERVE_ASSIGN_OR_RETURN(logits, gpu.Forward(kSlot, tokens, 0, rows));
    }
    NoteChunkLayers();
    PDSERVE_RETURN_IF_ERROR(chunk_done(to - from));
    from = to;
  }
  const int64_t vocab = logits.dim(1);
  const float* last = logits.ptr() + (logits.dim(0) - 1) * vocab;
  return std::vector<float>(last, last + vocab);
}

absl::StatusOr<PrefillEngine::DeviceRun> GpuPrefillEngine::RunToDevice(
    std::span<const int32_t> prompt, const runtime::PagedState& paged,
    const runtime::SequencePages& device_pages,
    const std::vector<std::vector<PagedState::PageId>>& checksum_pages,
    const ChunkDone& chunk_done) {
  if (group_->world() != 1) {
    return absl::FailedPreconditionError(
        "device pages need a one-GPU prefill engine (this one is an expert-parallel group)");
  }
  engine::gpu::GpuModel& gpu = group_->rank(0);
  const int64_t layers = gpu.config().num_hidden_layers;
  if (static_cast<int64_t>(checksum_pages.size()) != layers) {
    return absl::InvalidArgumentError(absl::StrCat("checksum pages for ", checksum_pages.size(),
                                                   " layers; the model has ", layers));
  }
  const bool keep = KeepDevicePageBuffers();
  if (keep && device_buffers_.descriptors == nullptr) {
    PDSERVE_ASSIGN_OR_RETURN(
        device_buffers_.descriptors,
        DevicePageDescriptors::Create(static_cast<size_t>(2 * std::max<int64_t>(layers, 1)),
                                      /*mapped=*/true));
  }
  PDSERVE_ASSIGN_OR_RETURN(std::unique_ptr<DeviceStatePages> store,
                           DeviceStatePages::Create(&gpu, paged.layout(), paged.total_tokens(),
                                                    keep ? device_buffers_.descriptors : nullptr));
  DeviceSequencePages addresses;
  for (const std::vector<std::span<std::byte>>& kind : device_pages.pages) {
    addresses.pages.emplace_back();
    for (std::span<std::byte> page : kind) addresses.pages.back().push_back(page.data());
  }
  // Layer l's checksums go to sums[first[l], first[l] + checksum_pages[l].size()).
  std::vector<size_t> first;
  size_t count = 0;
  for (const auto& ids : checksum_pages) {
    first.push_back(count);
    count += ids.size();
  }
  engine::gpu::DeviceArray<uint64_t> fresh_sums;
  engine::gpu::DeviceArray<uint64_t>& sums = keep ? device_buffers_.sums : fresh_sums;
  if (sums.size() < std::max<size_t>(count, 1)) {
    PDSERVE_RETURN_IF_ERROR(sums.Allocate(std::max<size_t>(count, 1)));
  }
  const engine::gpu::GpuModel::LayerFinal store_layer = [&](int64_t l, int64_t position,
                                                            void* stream) {
    const auto i = static_cast<size_t>(l);
    return store->StoreLayer(kSlot, l, position, addresses,
                             {checksum_pages[i], sums.get() + first[i]}, stream);
  };
  // PDSERVE_CUDA_IPC_OVERLAP=1: each layer's store is enqueued during the last chunk, right after
  // the layer's attention (GpuModel::BeginForwardStoring); otherwise all after the forward.
  const bool overlap = kernels::ReadSwitchFlag("PDSERVE_CUDA_IPC_OVERLAP", false,
                                               "the default (every store after the forward)");
  DeviceRun run;
  PDSERVE_ASSIGN_OR_RETURN(run.logits,
                           ForwardChunks(prompt, chunk_done, overlap ? store_layer : nullptr));
  if (!overlap && keep) {
    std::vector<PagedState::PageId> every;  // in the order of `first`
    every.reserve(count);
    for (const auto& ids : checksum_pages) every.insert(every.end(), ids.begin(), ids.end());
    PDSERVE_RETURN_IF_ERROR(store->StoreLayers(kSlot, static_cast<int64_t>(prompt.size()),
                                               addresses, {every, sums.get()}));
  }
  for (int64_t l = 0; l < layers && !overlap && !keep; ++l) {
    PDSERVE_RETURN_IF_ERROR(store_layer(l, static_cast<int64_t>(prompt.size()), nullptr));
  }
  std::vector<uint64_t> fresh_host;
  uint64_t* host = nullptr;
  if (keep) {
    if (device_buffers_.host_sums.size() < std::max<size_t>(count, 1)) {
      PDSERVE_RETURN_IF_ERROR(device_buffers_.host_sums.Allocate(std::max<size_t>(count, 1)));
    }
    host = device_buffers_.host_sums.get();
  } else {
    fresh_host.resize(count);
    host = fresh_host.data();
  }
  PDSERVE_RETURN_IF_ERROR(engine::gpu::CudaStatus(
      cudaMemcpyAsync(host, sums.get(), count * sizeof(uint64_t), cudaMemcpyDeviceToHost,
                      static_cast<cudaStream_t>(gpu.cuda_stream())),
      "cudaMemcpyAsync (page checksums)"));
  PDSERVE_RETURN_IF_ERROR(
      engine::gpu::CudaStatus(cudaStreamSynchronize(static_cast<cudaStream_t>(gpu.cuda_stream())),
                              "cudaStreamSynchronize (device page stores)"));
  for (size_t l = 0; l < checksum_pages.size(); ++l) {
    const uint64_t* from = host + first[l];
    run.checksums.emplace_back(from, from + checksum_pages[l].size());
  }
  return run;
}

absl::Status StoreSlotStaged(engine::gpu::GpuModel& gpu, int64_t slot,
                             engine::gpu::StateStaging& staging, const runtime::PagedState& paged,
                             const runtime::SequencePages& pages,
                             const PrefillEngine::LayerStored& layer_stored, TaskPool* pool,
                             StagedStoreTimes* times) {
  StagedStoreTimes local;
  StagedStoreTimes& t = times != nullptr ? *times : local;
  auto since = [](std::chrono::steady_clock::time_point from) {
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - from)
        .count();
  };
  // Every buffer's layer copy is enqueued at once; each layer taken frees its buffer for the
  // layer `ahead` further on. So while the host stores layer L and the worker posts it, the
  // device is copying layers L + 1 .. L + ahead.
  const int64_t layers = gpu.config().num_hidden_layers;
  const int64_t ahead = staging.buffers();
  for (int64_t l = 0; l < std::min(ahead, layers); ++l) {
    // Layers GpuModel::ForwardExporting copied during the last chunk are held already.
    if (!staging.Holds(l)) PDSERVE_RETURN_IF_ERROR(gpu.ExportLayerAsync(slot, l, &staging));
  }
  // The pinned blocks go into the pages as the device stores them (bf16 pages: copied as they
  // are), and only then does their buffer take the copy of layer l + ahead.
  for (int64_t l = 0; l < layers; ++l) {
    auto started = std::chrono::steady_clock::now();
    PDSERVE_ASSIGN_OR_RETURN(const engine::gpu::StateStaging::LayerBlocks layer,
                             staging.TakeLayerBlocks(l));
    t.copy_wait_ms += since(started);
    started = std::chrono::steady_clock::now();
    PDSERVE_RETURN_IF_ERROR(
        paged.StoreLayerRing(l, *layer.geometry, layer.blocks, layer.position, pages, pool));
    if (l + ahead < layers)
      PDSERVE_RETURN_IF_ERROR(gpu.ExportLayerAsync(slot, l + ahead, &staging));
    t.store_ms += since(started);
    started = std::chrono::steady_clock::now();
    PDSERVE_RETURN_IF_ERROR(layer_stored(l));
    t.stored_callback_ms += since(started);
  }
  return absl::OkStatus();
}

std::string GpuPrefillEngine::Describe() const {
  return absl::StrCat("cuda (", group_->Describe(), ", one slot of ", group_->rank(0).max_context(),
                      " tokens, prefill block ", prefill_block_, ", state staged through ",
                      staging_->buffers(), " pinned layer buffers, pages stored on ",
                      pool_.threads(), " host threads)");
}

PrefillEngineFactory GpuPrefillEngineFactory(runtime::GpuBackendOptions options) {
  return
      [options](
          const PrefillEngineContext& context) -> absl::StatusOr<std::unique_ptr<PrefillEngine>> {
        const engine::ModelConfig& config = *context.config;
        PDSERVE_ASSIGN_OR_RETURN(
            std::unique_ptr<engine::gpu::GpuModelGroup> group,
            runtime::LoadGpuModelGroup(options, context.model_dir, config,
                                       /*slots_per_rank=*/1, config.max_position_embeddings));
        PDSERVE_ASSIGN_OR_RETURN(
            std::unique_ptr<GpuPrefillEngine> engine,
            GpuPrefillEngine::Create(std::move(group),
                                     GpuPrefillBlock(options, context.prefill_block)));
        return std::unique_ptr<PrefillEngine>(std::move(engine));
      };
}

}  // namespace pdserve::runtime
