// How a prefill worker computes a prompt: the prompt's state into the request's pages (the
// transfer format, runtime::PagedState), each layer handed over once its pages hold the layer's
// final prompt state, and the last position's logits, from which the worker samples the first
// token. Two engines:
//
// - CPU (CpuPrefillEngine, engine::Model): Forward calls cut at absolute multiples of
//   prefill_block, as the colocated runner cuts them (runtime/step_runner.h); in the final
//   block Model::Forward's LayerHook stores each layer's pages as soon as the layer's attention is
//   done, so the worker ships layer l while layers l+1.. compute.
// - CUDA (runtime/cuda, engine::gpu::GpuModel): the same cuts (prefill_block <= max_chunk) on a
//   GPU slot; after the last chunk the slot's state is copied to pinned host memory layer by
//   layer (GpuModel::ExportLayerAsync, an event per layer), and each layer is stored and handed
//   over as soon as its copy lands, while later layers still copy. Every layer is final only when
//   the whole prompt has run, so the pages go out after the forward rather than overlapped with
//   it (docs/protocol.md).
//
// Thread-safety: one Run at a time per engine (the worker serializes prefills).
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/config.h"
#include "engine/model.h"
#include "runtime/paged_state.h"
#include "serving/state_layout.h"

namespace pdserve::runtime {

class PrefillEngine {
 public:
  // Called once per layer, in layer order, right after the layer's pages hold its final prompt
  // state. A non-OK status stops the prefill and Run returns it.
  using LayerStored = std::function<absl::Status(int64_t layer)>;
  // Called after each Forward chunk with its token count (between chunks: aborts, heartbeats,
  // metrics). A non-OK status stops the prefill and Run returns it.
  using ChunkDone = std::function<absl::Status(int64_t tokens)>;
  // Called as each layer of each chunk has been computed (the CPU engine: right after the layer,
  // inside the forward; the CUDA engine: for every layer of a chunk once the chunk's forward has
  // returned), with the layer index. Progress only (the router's busy check and the systemd
  // watchdog): it must be cheap and must not fail or throw.
  using LayerForwarded = std::function<void(int64_t layer)>;

  virtual ~PrefillEngine() = default;

  // Runs `prompt` (1 .. the context's token ids, already checked against the vocabulary) from
  // position 0, stores every layer's state after the whole prompt into `pages` through `paged`,
  // calling `layer_stored` for each, and returns the logits of the prompt's last position,
  // fp32 [vocab_size]. Errors: the engine's (InvalidArgument for a prompt the engine cannot hold,
  // Internal for a device error), PagedState's, or the first non-OK callback status.
  virtual absl::StatusOr<std::vector<float>> Run(std::span<const int32_t> prompt,
                                                 const runtime::PagedState& paged,
                                                 const runtime::SequencePages& pages,
                                                 const LayerStored& layer_stored,
                                                 const ChunkDone& chunk_done) = 0;

  // The CUDA IPC path (docs/protocol.md, "Same-host device-to-device pages (CUDA IPC)"): runs
  // `prompt` as Run does, then stores every layer's final state into `device_pages` (pages of
  // `paged`'s layout in device memory the engine's GPU can write: the prefill worker's GPU
  // arena) and takes on the device the XXH3-64 of each page `checksum_pages[l]` names for layer
  // l, returned per layer in that order. Nothing leaves before the stores are done: the
  // checksums travel in the page references, which the sender needs whole at Prepare. Returns
  // the last position's logits and the checksums. Unimplemented for an engine without device
  // pages (the CPU engine); otherwise Run's errors and the stores'.
  struct DeviceRun {
    std::vector<float> logits;
    std::vector<std::vector<uint64_t>> checksums;  // [layer][i]: of checksum_pages[layer][i]
  };
  virtual absl::StatusOr<DeviceRun> RunToDevice(
      std::span<const int32_t> /*prompt*/, const runtime::PagedState& /*paged*/,
      const runtime::SequencePages& /*device_pages*/,
      const std::vector<std::vector<PagedState::PageId>>& /*checksum_pages*/,
      const ChunkDone& /*chunk_done*/) {
    return absl::UnimplementedError("this prefill engine stores no device pages");
  }
  // Whether RunToDevice works (the CUDA engine on one GPU).
  virtual bool stores_device_pages() const { return false; }

  // The longest prompt + max_tokens it serves (the CPU engine: max_position_embeddings).
  virtual int64_t max_context() const = 0;
  // For logs: "cpu", "cuda device 0 (...)".
  virtual std::string Describe() const = 0;
  // The host threads the engine stores pages on, which the worker may also give its transfer
  // sender for the page checksums (kv::SenderOptions::checksum_pool; the callbacks of Run run
  // between the engine's uses of it), or null (the CPU engine: its own threads compute).
  virtual TaskPool* transfer_pool() { return nullptr; }

  // Installs the progress callback above (replacing any earlier one; empty: none). Not
  // thread-safe against Run: set it before the first Run.
  void set_layer_forwarded(LayerForwarded f) { layer_forwarded_ = std::move(f); }

 protected:
  void NoteLayerForwarded(int64_t layer) const {
    if (layer_forwarded_) layer_forwarded_(layer);
  }

 private:
  LayerForwarded layer_forwarded_;
};

// What a factory gets: the model directory (weights), its config and the page layout. Both
// outlive the engine.
struct PrefillEngineContext {
  std::string model_dir;
  const engine::ModelConfig* config = nullptr;
  int64_t prefill_block = 64;
};
using PrefillEngineFactory =
    std::function<absl::StatusOr<std::unique_ptr<PrefillEngine>>(const PrefillEngineContext&)>;

// The CPU engine over `model` (which must outlive it). InvalidArgument for prefill_block < 1.
absl::StatusOr<std::unique_ptr<PrefillEngine>> CpuPrefillEngine(const engine::Model& model,
                                                                int64_t prefill_block);

// The exclusive end of the prefill block that starts at `from`: the next absolute multiple of
// `block`, capped at `length`. Shared by both engines so their chunks (and floats) match.
inline int64_t PrefillBlockEnd(int64_t from, int64_t length, int64_t block) {
  return std::min(length, (from / block + 1) * block);
}

}  // namespace pdserve::runtime
