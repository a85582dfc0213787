// The prefill worker's CUDA engine (runtime/cuda/gpu_prefill_engine.h) on the bundled model with
// fp32 GEMMs: it writes a prompt's state into pool pages and returns the last logits, the first
// token is sampled from them as the prefill worker samples it, and decoding from those pages (on
// the CPU engine and on runtime::GpuStepRunner) gives the tokens of the CPU prefill engine's
// pages decoded on the CPU engine (which emulates the GPU's bf16 storage with its rounded
// weights): greedy exactly, seeded T=0.6 with at most 3 of 12 requests parting at one draw. The
// pages hold the exported slot state bit for bit. Skips without a CUDA device.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstddef>
#include <cstdlib>
#include <memory>
#include <span>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "engine/gpu/gpu_model.h"
#include "engine/model.h"
#include "kvtransfer/page_header.h"
#include "runtime/cuda/gpu_backend.h"
#include "runtime/cuda/gpu_prefill_engine.h"
#include "runtime/cuda/gpu_step_runner.h"
#include "runtime/paged_state.h"
#include "runtime/prefill_engine.h"
#include "runtime/step_runner.h"
#include "serving/page_pool.h"
#include "serving/sampler.h"
#include "tests/engine_gpu/gpu_test_models.h"
#include "tests/engine_gpu/runner_outputs.h"

namespace pdserve::runtime {
namespace {

using engine::gpu::GemmInputs;
using engine::gpu::GpuModel;
using runtime::Outputs;
using runtime::RequestSpec;

constexpr int64_t kPrefillBlock = 64;  // the prefill worker's default

// A prompt prefilled by an engine: the state rebuilt from its pages and the first token.
struct Prefilled {
  std::vector<engine::ModelState> states;
  std::vector<int32_t> first;
};

class GpuPrefillTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!engine::gpu::HasGpu()) GTEST_SKIP() << "no CUDA device";
    engine::gpu::LoadByName("kjv-v4-tiny", &model_);
    cpu_ = engine::gpu::CpuLikeGpu(model_);
    ASSERT_NE(cpu_, nullptr);
    layout_ = std::make_unique<serving::StateLayout>(*runtime::LayoutForModel(model_.config));
    gpu_ = engine::gpu::MakeGpu(model_, 3, 256, GemmInputs::kFp32);
    ASSERT_NE(gpu_, nullptr);
  }

  // Twelve prompts of 1 .. 250 tokens (the window is 64, the HCA rate 32, the block 64).
  std::vector<RequestSpec> Specs(double temperature) const {
    std::vector<std::vector<int32_t>> prompts(model_.prompts.begin(), model_.prompts.end() - 1);
    const std::vector<int32_t>& long_text = model_.prompts.back();
    for (size_t length : {1, 64, 97, 250}) {
      prompts.emplace_back(long_text.begin(), long_text.begin() + static_cast<long>(length));
    }
    prompts.resize(12);
    std::vector<RequestSpec> specs;
    for (size_t i = 0; i < prompts.size(); ++i) {
      RequestSpec s;
      s.prompt = prompts[i];
      s.params.temperature = temperature;
      s.params.top_p = temperature > 0 ? 0.95 : 1.0;
      s.params.seed = 2000 + static_cast<int64_t>(i);
      s.params.max_tokens = 20;
      specs.push_back(s);
    }
    return specs;
  }

  // What the prefill worker does per request: the engine fills fresh pages, the first token is
  // sampled from its last logits with the request's key (as colocated::MakeContext keys it);
  // here the state is then rebuilt from the pages, as the decode worker's runner loads it.
  Prefilled Prefill(PrefillEngine& engine, const std::vector<RequestSpec>& specs) {
    Prefilled out;
    auto pool = *serving::PagePool::Create(layout_->PoolOptions(1, 1024));
    std::vector<int32_t> eos;
    for (int64_t id : model_.config.eos_token_ids) eos.push_back(static_cast<int32_t>(id));
    for (size_t i = 0; i < specs.size(); ++i) {
      const RequestSpec& spec = specs[i];
      const int64_t total = static_cast<int64_t>(spec.prompt.size()) + spec.params.max_tokens;
      auto table = pool->Allocate(1, layout_->Demand(total));
      EXPECT_TRUE(table.ok()) << table.status();
      if (!table.ok()) return out;
      auto pages = runtime::MapPages(*pool, *table);
      EXPECT_TRUE(pages.ok());
      const runtime::PagedState paged(model_.config, *layout_, total);
      auto logits = engine.Run(
          spec.prompt, paged, *pages, [](int64_t) { return absl::OkStatus(); },
          [](int64_t) { return absl::OkStatus(); });
      EXPECT_TRUE(logits.ok()) << logits.status();
      if (!logits.ok()) return out;
      auto sampler = serving::RequestSampler::Create(spec.params, absl::StrCat("req-", i), eos,
                                                     spec.prompt, model_.config.vocab_size);
      EXPECT_TRUE(sampler.ok());
      auto first = sampler->Next(0, *logits);
      EXPECT_TRUE(first.ok());
      out.first.push_back(first->sampled.token);
      out.states.push_back(cpu_->NewState());
      EXPECT_TRUE(
          paged.Load(static_cast<int64_t>(spec.prompt.size()), *pages, &out.states.back()).ok());
      EXPECT_TRUE(pool->Free(*table).ok());
    }
    return out;
  }

  Outputs DecodeOnCpu(const std::vector<RequestSpec>& specs, const Prefilled& p) {
    return runtime::RunTransferred<runtime::EngineStepRunner>(
        model_.config, specs, p.states, p.first,
        [&](const serving::StateLayout& layout, serving::PagePool* pool) {
          runtime::RunnerOptions options;
          options.prefill_block = kPrefillBlock;
          return std::make_unique<runtime::EngineStepRunner>(*cpu_, layout, pool, options);
        });
  }

  Outputs DecodeOnGpu(const std::vector<RequestSpec>& specs, const Prefilled& p,
                      GpuModel* decode_gpu) {
    return runtime::RunTransferred<runtime::GpuStepRunner>(
        model_.config, specs, p.states, p.first,
        [&](const serving::StateLayout& layout, serving::PagePool* pool) {
          runtime::RunnerOptions options;
          options.prefill_block = kPrefillBlock;
          auto runner = runtime::GpuStepRunner::Create(decode_gpu, layout, pool, options);
          EXPECT_TRUE(runner.ok()) << runner.status();
          return runner.ok() ? std::move(*runner) : nullptr;
        });
  }

  // The reference: the CPU prefill engine's pages decoded on the CPU engine.
  Outputs CpuPath(const std::vector<RequestSpec>& specs) {
    auto cpu_engine = CpuPrefillEngine(*cpu_, kPrefillBlock);
    EXPECT_TRUE(cpu_engine.ok());
    return DecodeOnCpu(specs, Prefill(**cpu_engine, specs));
  }

  engine::gpu::TestModel model_;
  std::unique_ptr<engine::Model> cpu_;
  std::unique_ptr<serving::StateLayout> layout_;
  std::unique_ptr<GpuModel> gpu_;
};

TEST_F(GpuPrefillTest, GreedyPagesDecodeToTheCpuPrefillsTokens) {
  auto engine = GpuPrefillEngine::Create(gpu_.get(), kPrefillBlock);
  ASSERT_TRUE(engine.ok()) << engine.status();
  const std::vector<RequestSpec> specs = Specs(0.0);
  const Prefilled gpu = Prefill(**engine, specs);
  const Outputs want = CpuPath(specs);
  runtime::ExpectSameTokens(DecodeOnCpu(specs, gpu), want);
  auto decode_gpu = engine::gpu::MakeGpu(model_, 12, 256, GemmInputs::kFp32);
  ASSERT_NE(decode_gpu, nullptr);
  runtime::ExpectSameTokens(DecodeOnGpu(specs, gpu, decode_gpu.get()), want);
}

// T = 0.6, top_p 0.95, fixed seeds: the first token is drawn from the GPU's logits with the
// request's key, as on the CPU (at most 3 of 12 requests may part at one draw that falls between
// the engines' probabilities: ExpectSameTokens).
TEST_F(GpuPrefillTest, SeededPagesDecodeToTheCpuPrefillsTokens) {
  auto engine = GpuPrefillEngine::Create(gpu_.get(), kPrefillBlock);
  ASSERT_TRUE(engine.ok()) << engine.status();
  const std::vector<RequestSpec> specs = Specs(0.6);
  const Prefilled gpu = Prefill(**engine, specs);
  const Outputs want = CpuPath(specs);
  runtime::ExpectSameTokens(DecodeOnCpu(specs, gpu), want, /*max_diverged=*/3);
  auto decode_gpu = engine::gpu::MakeGpu(model_, 12, 256, GemmInputs::kFp32);
  ASSERT_NE(decode_gpu, nullptr);
  runtime::ExpectSameTokens(DecodeOnGpu(specs, gpu, decode_gpu.get()), want,
                            /*max_diverged=*/3);
}

// A prefill_chunk of 256 (runtime::GpuBackendOptions::prefill_chunk: the block is the model's
// max_chunk): the 250-token prompt runs as one forward call instead of four, and the pages still
// decode to the CPU prefill's tokens (the CPU engine's logits do not depend on the cut; greedy
// and seeded, as the 64-token block above).
TEST_F(GpuPrefillTest, WholeChunkBlockDecodesToTheCpuPrefillsTokens) {
  runtime::GpuBackendOptions options;
  options.prefill_chunk = 256;
  const int64_t block = runtime::GpuPrefillBlock(options, kPrefillBlock);
  ASSERT_EQ(block, 256);
  ASSERT_EQ(runtime::GpuMaxChunk(options), 256);
  auto engine = GpuPrefillEngine::Create(gpu_.get(), block);
  ASSERT_TRUE(engine.ok()) << engine.status();
  auto decode_gpu = engine::gpu::MakeGpu(model_, 12, 256, GemmInputs::kFp32);
  ASSERT_NE(decode_gpu, nullptr);
  for (const double temperature : {0.0, 0.6}) {
    const std::vector<RequestSpec> specs = Specs(temperature);
    const Prefilled gpu = Prefill(**engine, specs);
    const Outputs want = CpuPath(specs);
    const int diverged = temperature > 0 ? 3 : 0;
    runtime::ExpectSameTokens(DecodeOnCpu(specs, gpu), want, diverged);
    runtime::ExpectSameTokens(DecodeOnGpu(specs, gpu, decode_gpu.get()), want, diverged);
  }
}

// The pages hold exactly the slot's state: a slot imported from them continues bit for bit as a
// slot that ran the prompt itself (same cuts) would. Layers are handed over in order, once each,
// after chunks cut at absolute multiples of the block.
TEST_F(GpuPrefillTest, PagesHoldTheSlotStateBitForBit) {
  auto engine = GpuPrefillEngine::Create(gpu_.get(), kPrefillBlock);
  ASSERT_TRUE(engine.ok()) << engine.status();
  const std::vector<int32_t>& text = model_.prompts.back();
  const std::vector<int32_t> prompt(text.begin(), text.begin() + 150);
  const int64_t total = 160;
  auto pool = *serving::PagePool::Create(layout_->PoolOptions(1, 1024));
  auto table = *pool->Allocate(1, layout_->Demand(total));
  auto pages = *runtime::MapPages(*pool, table);
  const runtime::PagedState paged(model_.config, *layout_, total);
  std::vector<int64_t> layers;
  std::vector<int64_t> chunks;
  auto logits = (*engine)->Run(
      prompt, paged, pages,
      [&](int64_t layer) {
        layers.push_back(layer);
        return absl::OkStatus();
      },
      [&](int64_t tokens) {
        chunks.push_back(tokens);
        return absl::OkStatus();
      });
  ASSERT_TRUE(logits.ok()) << logits.status();
  EXPECT_EQ(chunks, (std::vector<int64_t>{64, 64, 22}));
  ASSERT_EQ(static_cast<int64_t>(layers.size()), model_.config.num_hidden_layers);
  for (size_t l = 0; l < layers.size(); ++l) EXPECT_EQ(layers[l], static_cast<int64_t>(l));

  // Slot 1 runs the prompt itself; slot 2 imports the pages. Both then take the same token.
  ASSERT_TRUE(gpu_->ResetSlot(1).ok());
  engine::Tensor direct;
  for (int64_t from = 0; from < 150;) {
    const int64_t to = PrefillBlockEnd(from, 150, kPrefillBlock);
    direct = *gpu_->Forward(1, std::vector<int32_t>(prompt.begin() + from, prompt.begin() + to));
    from = to;
  }
  const int64_t vocab = model_.config.vocab_size;
  EXPECT_EQ(*logits, std::vector<float>(direct.ptr() + (direct.dim(0) - 1) * vocab,
                                        direct.ptr() + direct.dim(0) * vocab));
  engine::ModelState loaded = gpu_->NewState();
  ASSERT_TRUE(paged.Load(150, pages, &loaded).ok());
  ASSERT_TRUE(gpu_->ImportState(2, loaded).ok());
  auto next_direct = gpu_->Forward(1, {text[150]});
  auto next_imported = gpu_->Forward(2, {text[150]});
  ASSERT_TRUE(next_direct.ok() && next_imported.ok());
  EXPECT_EQ(next_direct->data, next_imported->data);
}

// Fills every page of `pages` with one byte pattern, so pages written the same way compare equal
// byte for byte (pool memory starts uninitialized).
void FillPages(const runtime::SequencePages& pages) {
  for (const auto& kind : pages.pages) {
    for (std::span<std::byte> page : kind) std::fill(page.begin(), page.end(), std::byte{0xA5});
  }
}

bool SamePageBytes(const runtime::SequencePages& a, const runtime::SequencePages& b) {
  if (a.pages.size() != b.pages.size()) return false;
  for (size_t k = 0; k < a.pages.size(); ++k) {
    if (a.pages[k].size() != b.pages[k].size()) return false;
    for (size_t i = 0; i < a.pages[k].size(); ++i) {
      if (!std::equal(a.pages[k][i].begin(), a.pages[k][i].end(), b.pages[k][i].begin(),
                      b.pages[k][i].end())) {
        return false;
      }
    }
  }
  return true;
}

// The staged export (1 pinned layer buffer, 2, and the default: every layer; the pages stored on
// 1 host thread, on 4, and on the default) writes the pages the whole-slot export wrote
// (GpuModel::ExportState, then PagedState::StoreLayer per layer), byte for byte, for prompts of
// 1, 64, 97 and 250 tokens, into fp32 pages and into bf16 pages (the staged export stores the
// device's blocks as they are: StoreLayerRing). The engine runs each prompt's last chunk as
// GpuModel::ForwardExporting, so this also checks the copies made during that chunk.
TEST_F(GpuPrefillTest, StagedPagesEqualTheWholeSlotExportsPages) {
  const int64_t layers = model_.config.num_hidden_layers;
  std::vector<std::unique_ptr<GpuPrefillEngine>> engines;
  for (auto [buffers, threads] :
       {std::pair<int64_t, int>{1, 1}, {std::min<int64_t>(2, layers), 4}, {0, 0}}) {
    auto engine = GpuPrefillEngine::Create(gpu_.get(), kPrefillBlock, buffers, threads);
    ASSERT_TRUE(engine.ok()) << engine.status();
    engines.push_back(std::move(*engine));
  }
  EXPECT_TRUE(
      absl::IsInvalidArgument(GpuPrefillEngine::Create(gpu_.get(), kPrefillBlock, 0, -1).status()));
  EXPECT_TRUE(
      absl::IsInvalidArgument(GpuPrefillEngine::Create(gpu_.get(), kPrefillBlock, 0, 65).status()));
  EXPECT_TRUE(
      absl::IsInvalidArgument(GpuPrefillEngine::Create(gpu_.get(), kPrefillBlock, -1).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(
      GpuPrefillEngine::Create(gpu_.get(), kPrefillBlock, layers + 1).status()));
  const std::vector<int32_t>& text = model_.prompts.back();
  auto ok = [](int64_t) { return absl::OkStatus(); };
  // fp32 pages (a CPU decode worker's) and bf16 pages (what the CUDA prefill worker sends).
  for (serving::ElementType element :
       {serving::ElementType::kFloat32, serving::ElementType::kBfloat16}) {
    SCOPED_TRACE(serving::ElementTypeName(element));
    const serving::StateLayout layout = *runtime::LayoutForModel(model_.config, 64, element);
    auto pool = *serving::PagePool::Create(layout.PoolOptions(2, 1024));
    for (int64_t length : {1, 64, 97, 250}) {
      const std::vector<int32_t> prompt(text.begin(), text.begin() + length);
      const int64_t total = length + 8;
      const runtime::PagedState paged(model_.config, layout, total);
      auto want_table = *pool->Allocate(1, layout.Demand(total));
      auto want = *runtime::MapPages(*pool, want_table);
      FillPages(want);
      ASSERT_TRUE(gpu_->ResetSlot(1).ok());
      for (int64_t from = 0; from < length;) {
        const int64_t to = PrefillBlockEnd(from, length, kPrefillBlock);
        ASSERT_TRUE(
            gpu_->Forward(1, std::vector<int32_t>(prompt.begin() + from, prompt.begin() + to))
                .ok());
        from = to;
      }
      auto state = gpu_->ExportState(1);
      ASSERT_TRUE(state.ok()) << state.status();
      for (int64_t l = 0; l < layers; ++l) {
        ASSERT_TRUE(
            paged.StoreLayer(l, state->layers[static_cast<size_t>(l)], length, 0, want).ok());
      }
      auto got_table = *pool->Allocate(2, layout.Demand(total));
      auto got = *runtime::MapPages(*pool, got_table);
      for (auto& engine : engines) {
        FillPages(got);
        auto logits = engine->Run(prompt, paged, got, ok, ok);
        ASSERT_TRUE(logits.ok()) << logits.status();
        EXPECT_TRUE(SamePageBytes(got, want)) << length << " tokens, " << engine->Describe();
      }
      ASSERT_TRUE(pool->Free(want_table).ok());
      ASSERT_TRUE(pool->Free(got_table).ok());
    }
  }
}

// A callback's error stops the prefill and comes back; the slot serves the next prompt as new.
TEST_F(GpuPrefillTest, ACallbackErrorStopsThePrefill) {
  auto engine = GpuPrefillEngine::Create(gpu_.get(), kPrefillBlock);
  ASSERT_TRUE(engine.ok()) << engine.status();
  EXPECT_TRUE(absl::IsInvalidArgument(GpuPrefillEngine::Create(gpu_.get(), 0).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(GpuPrefillEngine::Create(gpu_.get(), 257).status()));
  const std::vector<int32_t>& text = model_.prompts.back();
  const std::vector<int32_t> prompt(text.begin(), text.begin() + 100);
  auto pool = *serving::PagePool::Create(layout_->PoolOptions(1, 1024));
  auto table = *pool->Allocate(1, layout_->Demand(110));
  auto pages = *runtime::MapPages(*pool, table);
  const runtime::PagedState paged(model_.config, *layout_, 110);
  auto ok = [](int64_t) { return absl::OkStatus(); };
  int64_t chunks = 0;
  auto stopped = (*engine)->Run(prompt, paged, pages, ok, [&](int64_t) {
    ++chunks;
    return absl::CancelledError("aborted");
  });
  EXPECT_TRUE(absl::IsCancelled(stopped.status())) << stopped.status();
  EXPECT_EQ(chunks, 1);
  auto layer_failed = (*engine)->Run(
      prompt, paged, pages, [](int64_t) { return absl::UnavailableError("peer gone"); }, ok);
  EXPECT_TRUE(absl::IsUnavailable(layer_failed.status())) << layer_failed.status();
  auto again = (*engine)->Run(prompt, paged, pages, ok, ok);
  ASSERT_TRUE(again.ok()) << again.status();
  ASSERT_TRUE(gpu_->ResetSlot(1).ok());
  engine::Tensor direct =
      *gpu_->Forward(1, std::vector<int32_t>(prompt.begin(), prompt.begin() + 64));
  direct = *gpu_->Forward(1, std::vector<int32_t>(prompt.begin() + 64, prompt.end()));
  const int64_t vocab = model_.config.vocab_size;
  EXPECT_EQ(*again, std::vector<float>(direct.ptr() + (direct.dim(0) - 1) * vocab,
                                       direct.ptr() + direct.dim(0) * vocab));
}

// The CUDA IPC store (RunToDevice) request after request with the buffers it keeps (descriptors
// in one mapped ring, the checksum arrays; all layers in one StoreLayers), with them and the
// stores during the last chunk (PDSERVE_CUDA_IPC_OVERLAP=1), and with fresh buffers a request
// and a StoreLayer a layer (PDSERVE_DEVICE_PAGES=fresh): the device pages equal, byte for byte,
// the bf16 host pages Run writes for the same prompt, and each checksum is libxxhash's of the
// page, for prompts of 1, 64, 97 and 250 tokens.
TEST_F(GpuPrefillTest, DevicePagesEqualTheHostPagesWithKeptAndFreshBuffers) {
  auto engine = GpuPrefillEngine::Create(gpu_.get(), kPrefillBlock);
  ASSERT_TRUE(engine.ok()) << engine.status();
  const int64_t layers = model_.config.num_hidden_layers;
  const serving::StateLayout layout =
      *runtime::LayoutForModel(model_.config, 64, serving::ElementType::kBfloat16);
  auto host_pool = *serving::PagePool::Create(layout.PoolOptions(1, 1024));
  serving::PagePoolOptions options = layout.PoolOptions(1, 1024);
  options.poison_freed = false;
  const size_t block_bytes = serving::PagePool::HostBytesNeeded(options);
  void* block = nullptr;
  ASSERT_EQ(cudaMalloc(&block, block_bytes), cudaSuccess);
  options.host_block = {static_cast<std::byte*>(block), block_bytes};
  auto device_pool = *serving::PagePool::Create(std::move(options));
  const std::vector<int32_t>& text = model_.prompts.back();
  auto ok = [](int64_t) { return absl::OkStatus(); };
  struct Mode {
    const char* pages;    // PDSERVE_DEVICE_PAGES
    const char* overlap;  // PDSERVE_CUDA_IPC_OVERLAP
  };
  for (int request = 0; request < 2; ++request) {
    for (int64_t length : {1, 64, 97, 250}) {
      const std::vector<int32_t> prompt(text.begin(), text.begin() + length);
      const int64_t total = length + 8;
      const runtime::PagedState paged(model_.config, layout, total);
      auto want_table = *host_pool->Allocate(1, layout.Demand(total));
      auto want = *runtime::MapPages(*host_pool, want_table);
      FillPages(want);
      ASSERT_TRUE((*engine)->Run(prompt, paged, want, ok, ok).ok());
      std::vector<std::vector<PagedState::PageId>> ids;
      for (int64_t l = 0; l < layers; ++l) ids.push_back(paged.LayerPages(l));
      for (const Mode mode : {Mode{"kept", "0"}, Mode{"kept", "1"}, Mode{"fresh", "0"}}) {
        SCOPED_TRACE(absl::StrCat(length, " tokens, request ", request, ", ", mode.pages,
                                  " buffers, overlap ", mode.overlap));
        setenv("PDSERVE_DEVICE_PAGES", mode.pages, 1);
        setenv("PDSERVE_CUDA_IPC_OVERLAP", mode.overlap, 1);
        ASSERT_EQ(cudaMemset(block, 0xA5, block_bytes), cudaSuccess);
        auto table = *device_pool->Allocate(1, layout.Demand(total));
        auto got = *runtime::MapPages(*device_pool, table);
        auto run = (*engine)->RunToDevice(prompt, paged, got, ids, ok);
        unsetenv("PDSERVE_DEVICE_PAGES");
        unsetenv("PDSERVE_CUDA_IPC_OVERLAP");
        ASSERT_TRUE(run.ok()) << run.status();
        ASSERT_EQ(run->checksums.size(), ids.size());
        for (int64_t l = 0; l < layers; ++l) {
          const auto li = static_cast<size_t>(l);
          ASSERT_EQ(run->checksums[li].size(), ids[li].size());
          for (size_t i = 0; i < ids[li].size(); ++i) {
            const int k = *layout.KindIndex(ids[li][i].kind);
            const std::span<std::byte> page = want.pages[k][ids[li][i].page];
            std::vector<std::byte> bytes(page.size());
            ASSERT_EQ(cudaMemcpy(bytes.data(), got.pages[k][ids[li][i].page].data(), bytes.size(),
                                 cudaMemcpyDeviceToHost),
                      cudaSuccess);
            EXPECT_TRUE(std::equal(bytes.begin(), bytes.end(), page.begin(), page.end()))
                << "layer " << l << " page " << i;
            EXPECT_EQ(run->checksums[li][i], kv::PayloadChecksum(page)) << "layer " << l;
          }
        }
        ASSERT_TRUE(device_pool->Free(table).ok());
      }
      ASSERT_TRUE(host_pool->Free(want_table).ok());
    }
  }
  device_pool.reset();
  cudaFree(block);
}

}  // namespace
}  // namespace pdserve::runtime
