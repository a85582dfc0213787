#include "runtime/cuda/gpu_step_runner.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <span>
#include <string>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "engine/expert_parallel.h"
#include "guards/canary.h"
#include "kernels/env_switch.h"
#include "runtime/choice_step.h"
#include "runtime/paged_state.h"
#include "spdlog/spdlog.h"

namespace pdserve::runtime {

struct GpuStepRunner::Sequence {
  Sequence(serving::RequestId sequence_id, SequenceSetup sequence_setup,
           guards::DegenerationThresholds thresholds)
      : id(sequence_id), setup(std::move(sequence_setup)), progress(thresholds) {}
  const serving::RequestId id;
  const SequenceSetup setup;
  int64_t rank = -1;        // the group rank holding the slot
  int64_t slot = -1;        // set once (with rank) under the runner's mutex, by the step loop
  int64_t early_slot = -1;  // the slot its early import holds (rank 0), until placed there
  // Touched only by the step loop.
  int64_t computed = 0;  // tokens whose state is in the slot (or, before placement, the pages)
  ChoiceProgress progress;

  int32_t TokenAt(int64_t position) const {
    const auto prompt_length = static_cast<int64_t>(setup.prompt.size());
    return position < prompt_length
               ? setup.prompt[static_cast<size_t>(position)]
               : progress.generated[static_cast<size_t>(position - prompt_length)];
  }
  int64_t known_tokens() const {
    return static_cast<int64_t>(setup.prompt.size() + progress.generated.size());
  }
};

namespace {

// PDSERVE_HOST_SAMPLER=1: the A/B switch back to the host sampler (gpu_step_runner.h).
bool HostSamplerForced() {
  return kernels::ReadSwitchFlag("PDSERVE_HOST_SAMPLER", false,
                                 "the default (RunnerOptions::gpu_sampling decides)");
}

}  // namespace

GpuStepRunner::GpuStepRunner(std::unique_ptr<engine::gpu::GpuModelGroup> group,
                             const serving::StateLayout& layout, serving::PagePool* pool,
                             RunnerOptions options)
    : group_(std::move(group)),
      layout_(layout),
      pool_(pool),
      options_(std::move(options)),
      gpu_sampling_(options_.gpu_sampling && !HostSamplerForced()) {
  samplers_.resize(static_cast<size_t>(group_->world()));
  free_slots_.resize(static_cast<size_t>(group_->world()));
  for (int64_t r = 0; r < group_->world(); ++r) {
    // With the canary, the last slot of each rank is its recompute slot.
    const int64_t slots = group_->rank(r).slots();
    if (options_.canary) canary_slots_.push_back(slots - 1);
    for (int64_t s = slots - (options_.canary ? 2 : 1); s >= 0; --s) {
      free_slots_[static_cast<size_t>(r)].push_back(s);
    }
  }
}

GpuStepRunner::~GpuStepRunner() = default;

absl::StatusOr<std::unique_ptr<GpuStepRunner>> GpuStepRunner::Create(
    std::unique_ptr<engine::gpu::GpuModelGroup> group, const serving::StateLayout& layout,
    serving::PagePool* pool, RunnerOptions options) {
  const engine::gpu::GpuModel& gpu = group->rank(0);
  if (options.prefill_block < 1 || options.prefill_block > gpu.max_chunk()) {
    return absl::InvalidArgumentError(absl::StrCat("GPU runner: prefill_block ",
                                                   options.prefill_block, " outside [1, max_chunk ",
                                                   gpu.max_chunk(), "]"));
  }
  for (int64_t r = 0; options.canary && r < group->world(); ++r) {
    if (group->rank(r).slots() < 2) {
      return absl::InvalidArgumentError(absl::StrCat(
          "GPU runner: the canary needs a recompute slot besides the sequences' on every rank; "
          "rank ",
          r, " has ", group->rank(r).slots()));
    }
  }
  const bool early = options.early_import;
  std::unique_ptr<GpuStepRunner> runner(
      new GpuStepRunner(std::move(group), layout, pool, std::move(options)));
  if (early) PDSERVE_RETURN_IF_ERROR(runner->StartEarlyImport());
  return runner;
}

absl::Status GpuStepRunner::StartEarlyImport() {
  if (group_->world() != 1) {
    spdlog::info("GPU runner: early import is for one GPU; {} ranks import at the first step",
                 group_->world());
    return absl::OkStatus();
  }
  early_pool_ =
      std::make_unique<TaskPool>(DefaultTransferHostThreads(std::thread::hardware_concurrency()));
  GpuSlotImporterOptions o;
  o.gpu = &group_->rank(0);
  o.layout = &layout_;
  o.pool = pool_;
  o.lock = &model_lock_;
  o.fill_pool = early_pool_.get();
  o.take_slot = [this](serving::RequestId id) -> absl::StatusOr<int64_t> {
    absl::MutexLock lock(&mutex_);
    std::vector<int64_t>& slots = free_slots_[0];
    if (!slots.empty()) {
      const int64_t slot = slots.back();
      slots.pop_back();
      // A removed sequence's slot whose reset (ReleaseRemovedSlots, at the next step) is still to
      // come is taken off that list: the reset would free the pages the import writes, and
      // BeginStagedImport resets the slot itself first (its old pages back). Without this, the
      // slots of sequences removed since the last step (every slot, after the batch emptied)
      // would all be passed over until a step ran.
      std::erase(to_release_, std::pair<int64_t, int64_t>{0, slot});
      return slot;
    }
    return absl::ResourceExhaustedError(
        absl::StrCat("sequence ", id,
                     ": no free GPU state slot for its early import (it imports at its "
                     "first step)"));
  };
  o.return_slot = [this](serving::RequestId, int64_t slot) {
    absl::MutexLock lock(&mutex_);
    free_slots_[0].push_back(slot);
  };
  PDSERVE_ASSIGN_OR_RETURN(slot_importer_, GpuSlotImporter::Create(std::move(o)));
  early_importer_ = std::make_unique<EarlyImporter>(
      slot_importer_.get(), static_cast<int64_t>(group_->rank(0).config().num_hidden_layers));
  return absl::OkStatus();
}

void GpuStepRunner::CancelEarlyImports() {
  std::vector<serving::RequestId> cancels;
  {
    absl::MutexLock lock(&mutex_);
    cancels.swap(early_cancels_);
  }
  for (serving::RequestId id : cancels) slot_importer_->ReleaseWithLockHeld(id);
}

absl::StatusOr<std::unique_ptr<GpuStepRunner>> GpuStepRunner::Create(
    engine::gpu::GpuModel* gpu, const serving::StateLayout& layout, serving::PagePool* pool,
    RunnerOptions options) {
  return Create(engine::gpu::GpuModelGroup::Single(gpu), layout, pool, std::move(options));
}

engine::gpu::GpuModel& GpuStepRunner::Model(const Sequence& seq) { return group_->rank(seq.rank); }

absl::Status GpuStepRunner::Add(serving::RequestId id, SequenceSetup setup) {
  absl::Status added = AddSequence(id, std::move(setup));
  if (!added.ok() && slot_importer_ != nullptr && slot_importer_->SlotOf(id).ok() &&
      !absl::IsAlreadyExists(added)) {
    // Refused: its early import's slot goes back at the next step.
    absl::MutexLock lock(&mutex_);
    early_cancels_.push_back(id);
  }
  return added;
}

absl::Status GpuStepRunner::AddSequence(serving::RequestId id, SequenceSetup setup) {
  PDSERVE_RETURN_IF_ERROR(CheckSequenceSetup(id, setup));
  if (setup.canary && !options_.canary) {
    return absl::FailedPreconditionError(
        "GPU runner: a canary choice needs RunnerOptions::canary (its recompute slot)");
  }
  const int64_t total = static_cast<int64_t>(setup.prompt.size()) + setup.max_tokens;
  if (total > group_->rank(0).max_context()) {
    return absl::InvalidArgumentError(absl::StrCat("sequence ", id, " needs ", total,
                                                   " tokens of context, the GPU holds ",
                                                   group_->rank(0).max_context()));
  }
  const std::optional<int32_t> first_token = setup.first_token;
  auto sequence = std::make_shared<Sequence>(id, std::move(setup), options_.thresholds);
  if (first_token) {
    sequence->computed = static_cast<int64_t>(sequence->setup.prompt.size());
    sequence->progress.Record(*first_token);
    // Its prompt state is (being) imported into the slot its early import holds.
    if (slot_importer_ != nullptr) {
      if (absl::StatusOr<int64_t> slot = slot_importer_->SlotOf(id); slot.ok()) {
        sequence->early_slot = *slot;
      }
    }
  }
  absl::MutexLock lock(&mutex_);
  if (!sequences_.emplace(id, std::move(sequence)).second) {
    return absl::AlreadyExistsError(absl::StrCat("sequence ", id, " is already registered"));
  }
  return absl::OkStatus();
}

void GpuStepRunner::Remove(serving::RequestId id) {
  absl::MutexLock lock(&mutex_);
  auto it = sequences_.find(id);
  if (it == sequences_.end()) return;
  const Sequence& seq = *it->second;
  if (seq.slot >= 0) {
    free_slots_[static_cast<size_t>(seq.rank)].push_back(seq.slot);
    to_release_.push_back({seq.rank, seq.slot});  // its state pages, at the next step
  } else if (seq.early_slot >= 0) {
    early_cancels_.push_back(id);  // never placed: its import is cancelled at the next step
  }
  sequences_.erase(it);
}

int64_t GpuStepRunner::num_sequences() const {
  absl::MutexLock lock(&mutex_);
  return static_cast<int64_t>(sequences_.size());
}

int64_t GpuStepRunner::free_slots() const {
  absl::MutexLock lock(&mutex_);
  int64_t n = 0;
  for (const std::vector<int64_t>& rank : free_slots_) n += static_cast<int64_t>(rank.size());
  return n;
}

GuardCounts GpuStepRunner::guard_counts() const {
  return {canary_checks_.load(), canary_mismatches_.load(), isolation_errors_.load()};
}

absl::StatusOr<std::vector<float>> GpuStepRunner::Recompute(const Sequence& seq) {
  const int64_t n = seq.known_tokens() - 1;
  const int64_t world = group_->world();
  const int64_t slot = canary_slots_[static_cast<size_t>(seq.rank)];
  // Chunks end at multiples of the largest multiple of prefill_block that fits in max_chunk, so
  // the prompt's part is cut as the runner's prefill cuts it.
  const int64_t block = Model(seq).max_chunk() / options_.prefill_block * options_.prefill_block;
  PDSERVE_RETURN_IF_ERROR(Model(seq).ResetSlot(slot));
  engine::Tensor out;
  for (int64_t from = 0; from < n;) {
    const int64_t to = std::min(n, (from / block + 1) * block);
    std::vector<int32_t> tokens;
    for (int64_t pos = from; pos < to; ++pos) tokens.push_back(seq.TokenAt(pos));
    const int64_t rows = to - from;
    // A group runs the chunk in lock step: the other ranks idle through its collectives.
    const std::vector<absl::Status> ran =
        group_->Run([&](int64_t r, engine::gpu::GpuModel& gpu) -> absl::Status {
          if (r != seq.rank) return gpu.Idle(rows);
          absl::StatusOr<engine::Tensor> logits =
              gpu.Forward(slot, tokens, world > 1 ? rows : 0, engine::gpu::ServingChunkLogits());
          if (!logits.ok()) return logits.status();
          out = std::move(*logits);
          return absl::OkStatus();
        });
    for (const absl::Status& s : ran) PDSERVE_RETURN_IF_ERROR(s);
    from = to;
  }
  // The slot's state pages go back to the pool for the sequences.
  PDSERVE_RETURN_IF_ERROR(Model(seq).ResetSlot(slot));
  const int64_t vocab = out.dim(1);
  const float* last = out.ptr() + (out.dim(0) - 1) * vocab;
  return std::vector<float>(last, last + vocab);
}

absl::Status GpuStepRunner::RunCanary(const Sequence& seq, std::span<const float> last) {
  const int64_t position = seq.known_tokens() - 1;
  const double tolerance =
      options_.canary_tolerance > 0 ? options_.canary_tolerance : guards::kGpuCanaryTolerance;
  PDSERVE_ASSIGN_OR_RETURN(std::vector<float> ref, Recompute(seq));
  PDSERVE_ASSIGN_OR_RETURN(guards::CanaryResult result,
                           guards::CompareLogits(last, ref, tolerance));
  ++canary_checks_;
  const std::string who = absl::StrCat("sequence ", seq.id, " at position ", position);
  if (result.pass) {
    spdlog::info(
        "canary pass: {}: error {:.3g} (max|diff| {:.3g}, max|ref| {:.3g}, tolerance "
        "{:.3g})",
        who, result.error, result.max_abs_diff, result.max_abs_ref, tolerance);
    return absl::OkStatus();
  }
  ++canary_mismatches_;
  absl::Status mismatch = guards::CanaryMismatchError(who, result, tolerance);
  spdlog::error("{}", std::string(mismatch.message()));
  return mismatch;
}

std::function<absl::Status()> GpuStepRunner::CanaryHook(const Sequence& seq,
                                                        std::span<const float> last) {
  if (!seq.setup.canary) return {};
  return [this, &seq, last] { return RunCanary(seq, last); };
}

bool GpuStepRunner::Fail(const Sequence& seq, const absl::Status& status) {
  RequestContext& request = *seq.setup.request;
  absl::MutexLock lock(&request.mu);
  if (request.on_error) request.on_error(seq.setup.choice, status);
  return true;
}

absl::Status GpuStepRunner::Place(Sequence& seq) {
  engine::gpu::GpuModel& gpu = Model(seq);
  if (!seq.setup.first_token) return gpu.ResetSlot(seq.slot);
  // Imported while its transfer ran: the slot reads the state from this step on.
  if (seq.early_slot >= 0) return slot_importer_->Finish(seq.id);
  // PD decode: the prompt's state arrived in the sequence's pages.
  PDSERVE_ASSIGN_OR_RETURN(serving::PageTable table, pool_->Table(seq.id));
  PDSERVE_ASSIGN_OR_RETURN(SequencePages pages, MapPages(*pool_, table));
  const int64_t total = static_cast<int64_t>(seq.setup.prompt.size()) + seq.setup.max_tokens;
  const PagedState paged(gpu.config(), layout_, total);
  // Straight from the pages into pinned buffers (no CPU-layout state), each layer's copy
  // overlapping the next layer's fill.
  if (import_staging_.empty()) import_staging_.resize(static_cast<size_t>(group_->world()));
  std::unique_ptr<engine::gpu::StateStaging>& staging =
      import_staging_[static_cast<size_t>(seq.rank)];
  if (staging == nullptr) {
    const auto layers = static_cast<int64_t>(gpu.config().num_hidden_layers);
    PDSERVE_ASSIGN_OR_RETURN(staging, gpu.NewStateStaging(std::min<int64_t>(2, layers)));
  }
  std::call_once(import_pool_once_, [this] {
    import_pool_ =
        std::make_unique<TaskPool>(DefaultTransferHostThreads(std::thread::hardware_concurrency()));
  });
  const int64_t position = seq.computed;
  return gpu.ImportLayers(seq.slot, position, staging.get(),
                          [&](int64_t layer, const engine::RingLayerGeometry& geometry,
                              const engine::MutableRingLayerBlocks& blocks) {
                            return paged.LoadLayerRing(layer, geometry, position, pages, blocks,
                                                       import_pool_.get());
                          });
}

void GpuStepRunner::ReleaseRemovedSlots() {
  std::vector<std::pair<int64_t, int64_t>> released;
  {
    absl::MutexLock lock(&mutex_);
    released.swap(to_release_);
  }
  // The slots' pages go back to the pool now, not when the slot is next placed, so the state
  // pool holds only live sequences. A slot placed again meanwhile is reset by Place too.
  for (const auto& [rank, slot] : released) {
    absl::Status reset = group_->rank(rank).ResetSlot(slot);
    if (!reset.ok()) spdlog::error("GPU runner: releasing slot {}: {}", slot, reset.ToString());
  }
}

std::vector<std::shared_ptr<GpuStepRunner::Sequence>> GpuStepRunner::VerifyPages(
    const std::vector<Work>& decode, const std::vector<Work>& prefill) {
  std::vector<std::shared_ptr<Sequence>> failed;
  for (const std::vector<Work>* works : {&decode, &prefill}) {
    for (const Work& work : *works) {
      const Sequence& seq = *work.sequence;
      absl::Status ok = Model(seq).VerifySlotPages(seq.slot);
      if (ok.ok()) continue;
      ++isolation_errors_;
      absl::Status isolation = absl::FailedPreconditionError(
          absl::StrCat("paranoid: sequence ", seq.id, ": ", ok.message()));
      spdlog::error("{}", isolation.ToString());
      Fail(seq, isolation);
      failed.push_back(work.sequence);
    }
  }
  return failed;
}

std::vector<std::shared_ptr<GpuStepRunner::Sequence>> GpuStepRunner::ShortOfPages(
    const std::vector<Work>& decode, const std::vector<Work>& prefill) {
  std::vector<std::shared_ptr<Sequence>> failed;
  for (int64_t r = 0; r < group_->world(); ++r) {
    // The rank's works oldest first (decoding sequences were admitted before prefilling ones,
    // each list is in admission order) with the position each one's step grows its slot to.
    std::vector<const Work*> works;
    std::vector<std::pair<int64_t, int64_t>> targets;
    for (const std::vector<Work>* list : {&decode, &prefill}) {
      for (const Work& work : *list) {
        if (work.sequence->rank != r) continue;
        works.push_back(&work);
        targets.push_back({work.sequence->slot, work.start + work.length});
      }
    }
    engine::gpu::GpuModel& model = group_->rank(r);
    while (!targets.empty() && !model.CanHold(targets)) {
      const Sequence& newest = *works.back()->sequence;
      absl::Status exhausted = absl::ResourceExhaustedError(absl::StrCat(
          "sequence ", newest.id, ": the device state page pool of rank ", r,
          " cannot hold this step (admission reserves prompt + max_tokens against "
          "state_tokens; over several ranks a rank can still run short); the newest sequence "
          "of the step is stopped"));
      spdlog::error("{}", exhausted.ToString());
      Fail(newest, exhausted);
      // Its pages go back now (it runs no more), so the older sequences can take them; the slot
      // stays the sequence's until Remove.
      if (absl::Status reset = model.ResetSlot(newest.slot); !reset.ok()) {
        spdlog::error("GPU runner: resetting slot {}: {}", newest.slot, reset.ToString());
      }
      failed.push_back(works.back()->sequence);
      works.pop_back();
      targets.pop_back();
    }
  }
  return failed;
}

absl::StatusOr<serving::StepOutcome> GpuStepRunner::Run(const serving::StepPlan& plan) {
  // The early imports' model calls wait for this step (and go first before the next one).
  model_lock_.LockForStep();
  absl::StatusOr<serving::StepOutcome> outcome = RunLocked(plan);
  model_lock_.Unlock();
  return outcome;
}

absl::StatusOr<serving::StepOutcome> GpuStepRunner::RunLocked(const serving::StepPlan& plan) {
  if (slot_importer_ != nullptr) CancelEarlyImports();
  ReleaseRemovedSlots();
  std::vector<Work> decode;
  std::vector<Work> prefill;
  std::vector<std::shared_ptr<Sequence>> to_place;
  std::vector<std::shared_ptr<Sequence>> no_slot;
  {
    // A sequence cancelled after the plan was built is skipped: the scheduler releases it when
    // the step completes.
    absl::MutexLock lock(&mutex_);
    auto add = [&](std::vector<Work>* into, serving::RequestId id, int64_t start, int64_t length,
                   bool samples) {
      auto it = sequences_.find(id);
      if (it == sequences_.end()) return;
      Sequence& seq = *it->second;
      if (seq.slot < 0 && seq.early_slot >= 0) {
        seq.rank = 0;
        seq.slot = seq.early_slot;
        to_place.push_back(it->second);
      } else if (seq.slot < 0) {
        std::vector<int64_t> free;
        for (const std::vector<int64_t>& rank : free_slots_) {
          free.push_back(static_cast<int64_t>(rank.size()));
        }
        const int64_t rank = engine::PickRank(free);
        if (rank < 0) {
          no_slot.push_back(it->second);
          return;
        }
        std::vector<int64_t>& slots = free_slots_[static_cast<size_t>(rank)];
        seq.rank = rank;
        seq.slot = slots.back();
        slots.pop_back();
        to_place.push_back(it->second);
      }
      into->push_back({it->second, start, length, samples});
    };
    for (const serving::DecodeSlot& slot : plan.decode) {
      add(&decode, slot.id, slot.position, 1, true);
    }
    for (const serving::PrefillChunk& chunk : plan.prefill) {
      add(&prefill, chunk.id, chunk.start, chunk.length, chunk.completes_prompt);
    }
  }
  serving::StepOutcome outcome;
  for (const auto& seq : no_slot) {
    Fail(*seq, absl::ResourceExhaustedError(
                   absl::StrCat("sequence ", seq->id,
                                ": every GPU state slot is taken (the scheduler admitted "
                                "more sequences than the runner's ",
                                group_->world() * group_->rank(0).slots(), " slots)")));
    outcome.stopped.push_back(seq->id);
  }
  std::vector<std::shared_ptr<Sequence>> failed;
  for (const auto& seq : to_place) {
    absl::Status placed = Place(*seq);
    if (placed.ok()) continue;
    Fail(*seq, placed);
    failed.push_back(seq);
  }
  auto is_failed = [&](const Work& w) {
    return std::find(failed.begin(), failed.end(), w.sequence) != failed.end();
  };
  decode.erase(std::remove_if(decode.begin(), decode.end(), is_failed), decode.end());
  prefill.erase(std::remove_if(prefill.begin(), prefill.end(), is_failed), prefill.end());
  if (options_.paranoid) {
    // Every page each sequence's step reads, against the allocator, before anything is launched:
    // a failure stops that sequence only.
    const std::vector<std::shared_ptr<Sequence>> foreign = VerifyPages(decode, prefill);
    failed.insert(failed.end(), foreign.begin(), foreign.end());
    decode.erase(std::remove_if(decode.begin(), decode.end(), is_failed), decode.end());
    prefill.erase(std::remove_if(prefill.begin(), prefill.end(), is_failed), prefill.end());
  }
  {
    // Before anything is launched: a step the page pools cannot hold would fail in the middle
    // (and break a group), so the newest sequences that do not fit stop here instead.
    const std::vector<std::shared_ptr<Sequence>> short_of_pages = ShortOfPages(decode, prefill);
    failed.insert(failed.end(), short_of_pages.begin(), short_of_pages.end());
    decode.erase(std::remove_if(decode.begin(), decode.end(), is_failed), decode.end());
    prefill.erase(std::remove_if(prefill.begin(), prefill.end(), is_failed), prefill.end());
  }
  for (const auto& seq : failed) outcome.stopped.push_back(seq->id);

  std::vector<char> prefill_stopped(prefill.size(), 0);
  RunPrefill(prefill, &prefill_stopped);
  for (size_t i = 0; i < prefill.size(); ++i) {
    if (prefill_stopped[i]) outcome.stopped.push_back(prefill[i].sequence->id);
  }
  std::vector<char> stopped(decode.size(), 0);
  RunDecode(decode, &stopped);
  for (size_t i = 0; i < decode.size(); ++i) {
    if (stopped[i]) outcome.stopped.push_back(decode[i].sequence->id);
  }
  return outcome;
}

void GpuStepRunner::RunPrefill(const std::vector<Work>& works, std::vector<char>* stopped) {
  // One Forward of works[work] over positions [from, to) of its sequence.
  struct Call {
    size_t work = 0;
    int64_t from = 0;
    int64_t to = 0;
  };
  const int64_t world = group_->world();
  const int64_t block = options_.prefill_block;
  std::vector<std::vector<Call>> calls(static_cast<size_t>(world));
  std::vector<absl::Status> status(works.size());
  std::vector<engine::Tensor> logits(works.size());
  for (size_t i = 0; i < works.size(); ++i) {
    const Work& work = works[i];
    Sequence& seq = *work.sequence;
    const int64_t end = work.start + work.length;
    // Prefill computes up to the last block boundary the chunk reaches, or the whole prompt.
    const int64_t target = work.samples ? end : end / block * block;
    if (target <= seq.computed && !work.samples) continue;
    if (end > seq.known_tokens() || Model(seq).Position(seq.slot) != seq.computed) {
      status[i] = absl::InternalError(absl::StrCat(
          "sequence ", seq.id, " scheduled up to position ", end, " with ", seq.known_tokens(),
          " tokens known and ", Model(seq).Position(seq.slot), " in its slot"));
      continue;
    }
    for (int64_t from = seq.computed; from < target;) {
      const int64_t to = std::min(target, (from / block + 1) * block);
      calls[static_cast<size_t>(seq.rank)].push_back({i, from, to});
      from = to;
    }
  }
  std::vector<std::vector<int64_t>> lengths(static_cast<size_t>(world));
  for (int64_t r = 0; r < world; ++r) {
    for (const Call& c : calls[static_cast<size_t>(r)]) {
      lengths[static_cast<size_t>(r)].push_back(c.to - c.from);
    }
  }
  const std::vector<int64_t> rounds = engine::PrefillRoundRows(lengths);
  for (size_t round = 0; round < rounds.size(); ++round) {
    // One rank alone pads nothing; a group pads every rank to the round's longest chunk.
    const int64_t rows = world > 1 ? rounds[round] : 0;
    // Each rank touches only its own calls, works and sequences.
    const std::vector<absl::Status> ran =
        group_->Run([&](int64_t r, engine::gpu::GpuModel& gpu) -> absl::Status {
          const std::vector<Call>& mine = calls[static_cast<size_t>(r)];
          if (round >= mine.size() || !status[mine[round].work].ok()) {
            return world > 1 ? gpu.Idle(rounds[round]) : absl::OkStatus();
          }
          const Call& c = mine[round];
          Sequence& seq = *works[c.work].sequence;
          std::vector<int32_t> tokens;
          for (int64_t pos = c.from; pos < c.to; ++pos) tokens.push_back(seq.TokenAt(pos));
          absl::StatusOr<engine::Tensor> out =
              gpu.Forward(seq.slot, tokens, rows, engine::gpu::ServingChunkLogits());
          if (!out.ok()) {
            status[c.work] = out.status();
            return out.status();
          }
          seq.computed = c.to;
          logits[c.work] = std::move(*out);
          return absl::OkStatus();
        });
    // A rank that failed outside its own call (Idle, an aborted group) fails its pending works.
    for (int64_t r = 0; r < world; ++r) {
      const absl::Status& s = ran[static_cast<size_t>(r)];
      if (s.ok()) continue;
      for (const Call& c : calls[static_cast<size_t>(r)]) {
        if (status[c.work].ok()) status[c.work] = s;
      }
    }
  }
  for (size_t i = 0; i < works.size(); ++i) {
    const Work& work = works[i];
    Sequence& seq = *work.sequence;
    if (!status[i].ok()) {
      (*stopped)[i] = Fail(seq, status[i]);
      continue;
    }
    if (!work.samples) continue;
    const engine::Tensor& out = logits[i];
    if (out.data.empty()) {
      (*stopped)[i] = Fail(seq, absl::InternalError(absl::StrCat(
                                    "sequence ", seq.id, " was asked to sample at position ",
                                    work.start + work.length, " with no new input")));
      continue;
    }
    const int64_t vocab = out.dim(1);
    std::span<const float> last(out.ptr() + (out.dim(0) - 1) * vocab, static_cast<size_t>(vocab));
    absl::StatusOr<bool> stop = SampleAndDeliver(seq.setup, last, options_.degeneration,
                                                 &seq.progress, CanaryHook(seq, last));
    (*stopped)[i] = stop.ok() ? *stop : Fail(seq, stop.status());
  }
}

void GpuStepRunner::RunDecode(const std::vector<Work>& works, std::vector<char>* stopped) {
  const int64_t world = group_->world();
  const auto ranks = static_cast<size_t>(world);
  const int64_t vocab = group_->rank(0).config().vocab_size;
  DecodeBatch batch;
  batch.rows.resize(ranks);
  batch.slots.resize(ranks);
  batch.tokens.resize(ranks);
  batch.sizes.assign(ranks, 0);
  std::vector<std::vector<GpuSampleRow>> draws(ranks);
  for (size_t i = 0; i < works.size(); ++i) {
    Sequence& seq = *works[i].sequence;
    // A decode input is the newest token, at position computed (the slot's position).
    if (works[i].start != seq.computed || works[i].start >= seq.known_tokens() ||
        Model(seq).Position(seq.slot) != seq.computed) {
      (*stopped)[i] =
          Fail(seq, absl::InternalError(absl::StrCat(
                        "sequence ", seq.id, " decode at position ", works[i].start, " but ",
                        seq.computed, " computed and ", seq.known_tokens(), " tokens known")));
      continue;
    }
    const auto r = static_cast<size_t>(seq.rank);
    if (gpu_sampling_) {
      // The inputs point into the request's sampler, which only this step loop advances (here
      // and in CommitAndDeliver), so they stay valid after the lock is released.
      RequestContext& request = *seq.setup.request;
      absl::MutexLock lock(&request.mu);
      absl::StatusOr<GpuSampleRow> draw = request.sampler.PrepareDraw(seq.setup.choice, vocab);
      if (!draw.ok()) {
        (*stopped)[i] = Fail(seq, draw.status());
        continue;
      }
      draws[r].push_back(*draw);
    }
    batch.slots[r].push_back(seq.slot);
    batch.tokens[r].push_back(seq.TokenAt(seq.computed));
    batch.rows[r].push_back(i);
    ++batch.sizes[r];
  }
  absl::StatusOr<int64_t> rows =
      engine::GroupDecodeRows(batch.sizes, group_->rank(0).decode_buckets());
  if (rows.ok() && *rows == 0) return;
  if (rows.ok() && gpu_sampling_) {
    DecodeOnDevice(works, batch, *rows, draws, stopped);
    return;
  }
  std::vector<absl::StatusOr<engine::Tensor>> logits(ranks, absl::UnknownError("not run"));
  if (rows.ok()) {
    const std::vector<absl::Status> ran =
        group_->Run([&](int64_t r, engine::gpu::GpuModel& gpu) -> absl::Status {
          const auto i = static_cast<size_t>(r);
          logits[i] = gpu.DecodeStep(batch.slots[i], batch.tokens[i], /*use_graph=*/true,
                                     world > 1 ? *rows : 0);
          return logits[i].status();
        });
    for (size_t r = 0; r < ranks; ++r) {
      if (!ran[r].ok()) logits[r] = ran[r];
    }
  } else {
    for (auto& l : logits) l = rows.status();
  }
  for (size_t r = 0; r < ranks; ++r) {
    if (!logits[r].ok()) {
      for (size_t i : batch.rows[r]) (*stopped)[i] = Fail(*works[i].sequence, logits[r].status());
      continue;
    }
    SampleOnHost(works, batch.rows[r], *logits[r], stopped);
  }
}

void GpuStepRunner::SampleOnHost(const std::vector<Work>& works, const std::vector<size_t>& rows,
                                 const engine::Tensor& logits, std::vector<char>* stopped) {
  const int64_t vocab = logits.dim(1);
  for (size_t row = 0; row < rows.size(); ++row) {
    Sequence& seq = *works[rows[row]].sequence;
    seq.computed += 1;
    std::span<const float> out(logits.ptr() + static_cast<int64_t>(row) * vocab,
                               static_cast<size_t>(vocab));
    absl::StatusOr<bool> stop = SampleAndDeliver(seq.setup, out, options_.degeneration,
                                                 &seq.progress, CanaryHook(seq, out));
    (*stopped)[rows[row]] = stop.ok() ? *stop : Fail(seq, stop.status());
  }
}

void GpuStepRunner::DecodeOnDevice(const std::vector<Work>& works, const DecodeBatch& batch,
                                   int64_t rows,
                                   const std::vector<std::vector<GpuSampleRow>>& draws,
                                   std::vector<char>* stopped) {
  const int64_t world = group_->world();
  const auto ranks = static_cast<size_t>(world);
  using Sampled = std::vector<absl::StatusOr<serving::SampledToken>>;
  std::vector<absl::StatusOr<Sampled>> sampled(ranks, absl::UnknownError("not run"));
  // Per rank and batch row: the host copy of a canary choice's logits (empty for the others).
  std::vector<std::vector<std::vector<float>>> canary_logits(ranks);
  // On rank r's thread (its device current): the step, then its rows' draws on its stream.
  auto step = [&](size_t r, engine::gpu::GpuModel& gpu) -> absl::StatusOr<Sampled> {
    PDSERVE_ASSIGN_OR_RETURN(engine::gpu::GpuModel::DeviceLogits logits,
                             gpu.DecodeStepOnDevice(batch.slots[r], batch.tokens[r],
                                                    /*use_graph=*/true, world > 1 ? rows : 0));
    if (samplers_[r] == nullptr) {
      absl::StatusOr<std::unique_ptr<GpuSampler>> made =
          GpuSampler::Create(gpu.decode_buckets().back(), gpu.config().vocab_size);
      if (!made.ok()) {
        return absl::Status(
            made.status().code(),
            absl::StrCat(made.status().message(), " (PDSERVE_HOST_SAMPLER=1 samples on the host)"));
      }
      samplers_[r] = std::move(*made);
    }
    PDSERVE_ASSIGN_OR_RETURN(Sampled tokens,
                             samplers_[r]->Sample(logits.data, logits.stride, draws[r],
                                                  static_cast<cudaStream_t>(logits.stream)));
    // Canary choices keep their row's logits: whether this token ends the choice is known
    // only now, and the recompute will overwrite the device's logits.
    const std::vector<size_t>& mine = batch.rows[r];
    canary_logits[r].resize(mine.size());
    const auto vocab = static_cast<size_t>(gpu.config().vocab_size);
    for (size_t row = 0; row < mine.size(); ++row) {
      if (!works[mine[row]].sequence->setup.canary) continue;
      std::vector<float>& copy = canary_logits[r][row];
      copy.resize(vocab);
      const auto stream = static_cast<cudaStream_t>(logits.stream);
      cudaError_t e =
          cudaMemcpyAsync(copy.data(), logits.data + static_cast<int64_t>(row) * logits.stride,
                          vocab * sizeof(float), cudaMemcpyDeviceToHost, stream);
      if (e == cudaSuccess) e = cudaStreamSynchronize(stream);
      if (e != cudaSuccess) {
        return absl::InternalError(
            absl::StrCat("canary: copying a decode row's logits: ", cudaGetErrorString(e)));
      }
    }
    return tokens;
  };
  const std::vector<absl::Status> ran =
      group_->Run([&](int64_t r, engine::gpu::GpuModel& gpu) -> absl::Status {
        const auto i = static_cast<size_t>(r);
        sampled[i] = step(i, gpu);
        return sampled[i].status();
      });
  for (size_t r = 0; r < ranks; ++r) {
    if (!ran[r].ok() && sampled[r].ok()) sampled[r] = ran[r];
    const std::vector<size_t>& mine = batch.rows[r];
    if (!sampled[r].ok()) {
      for (size_t i : mine) (*stopped)[i] = Fail(*works[i].sequence, sampled[r].status());
      continue;
    }
    for (size_t row = 0; row < mine.size(); ++row) {
      Sequence& seq = *works[mine[row]].sequence;
      seq.computed += 1;
      absl::StatusOr<serving::SampledToken>& token = (*sampled[r])[row];
      const std::vector<float>& logits = canary_logits[r][row];
      absl::StatusOr<bool> stop =
          token.ok() ? CommitAndDeliver(seq.setup, std::move(*token), options_.degeneration,
                                        &seq.progress, CanaryHook(seq, logits))
                     : absl::StatusOr<bool>(token.status());
      (*stopped)[mine[row]] = stop.ok() ? *stop : Fail(seq, stop.status());
    }
  }
}

}  // namespace pdserve::runtime
