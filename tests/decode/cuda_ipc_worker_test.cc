// The workers' CUDA IPC path (prefill/device_pages.cc, decode/device_pages.cc; docs/protocol.md,
// "Same-host device-to-device pages (CUDA IPC)") on the CPU, with a host stand-in for the GPU:
// the prefill worker's "arena" and the decode worker's "device page pool" are host memory, the
// lander is tests/kvtransfer/fake_device_lander.h's, the prefill engine's RunToDevice runs the
// CPU engine into the arena's pages and checksums them with the CPU's XXH3, and the decode
// runner's device import copies the device pages into the sequence's host pages before the CPU
// engine's runner decodes them. A prefill worker and two decode workers in this process (bundled
// model, UCX over tcp, gRPC on loopback): one decode worker lands by host pages only, the other
// has the path. Checked: a prefill worker with an arena states it in Health; a Reserve that
// passes it on gets a ticket asking for GPU pages, the pages go by reference and are imported
// from the device pages, the tokens equal the host path's, and both sides' transfer metrics say
// path "cuda-ipc"; without the capability at Reserve, or with an arena this process cannot map,
// the same decode worker asks for host pages; a CPU prefill worker states no arena and refuses a
// ticket that asks for GPU pages (never sends it anything else).
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <stdlib.h>

#include <atomic>
#include <cstring>
#include <map>
#include <memory>
#include <new>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/synchronization/mutex.h"
#include "decode/decode_worker.h"
#include "engine/model.h"
#include "kvtransfer/page_header.h"
#include "kvtransfer/shm/shared_memory.h"
#include "prefill/prefill_worker.h"
#include "runtime/early_import.h"
#include "runtime/prefill_engine.h"
#include "runtime/step_runner.h"
#include "tests/kvtransfer/fake_device_lander.h"

namespace pdserve::decode {
namespace {

namespace v1 = pdserve::worker::v1;
constexpr char kBusId[] = "0000:19:00.0";
constexpr uint8_t kArenaId = 7;

// Page-aligned host memory standing in for device memory; freed with its owner.
std::pair<std::span<std::byte>, std::shared_ptr<void>> HostMemory(size_t bytes) {
  constexpr std::align_val_t kAlign{4096};
  void* memory = ::operator new[](bytes, kAlign);
  std::memset(memory, 0, bytes);
  return {{static_cast<std::byte*>(memory), bytes},
          std::shared_ptr<void>(memory, [](void* p) { ::operator delete[](p, kAlign); })};
}

// The CPU engine with RunToDevice: the prompt into the "device" pages, checksums by the CPU.
class HostDeviceEngine final : public runtime::PrefillEngine {
 public:
  HostDeviceEngine(std::unique_ptr<engine::Model> model, std::unique_ptr<PrefillEngine> inner)
      : model_(std::move(model)), inner_(std::move(inner)) {}
  absl::StatusOr<std::vector<float>> Run(std::span<const int32_t> prompt,
                                         const runtime::PagedState& paged,
                                         const runtime::SequencePages& pages,
                                         const LayerStored& layer_stored,
                                         const ChunkDone& chunk_done) override {
    return inner_->Run(prompt, paged, pages, layer_stored, chunk_done);
  }
  absl::StatusOr<DeviceRun> RunToDevice(
      std::span<const int32_t> prompt, const runtime::PagedState& paged,
      const runtime::SequencePages& device_pages,
      const std::vector<std::vector<runtime::PagedState::PageId>>& checksum_pages,
      const ChunkDone& chunk_done) override {
    ++device_runs;
    DeviceRun run;
    // chunk_delay: a slow engine (each chunk that long before its chunk_done).
    const ChunkDone slow = [&](int64_t tokens) {
      absl::SleepFor(absl::Milliseconds(chunk_delay_ms.load()));
      return chunk_done(tokens);
    };
    auto logits = inner_->Run(
        prompt, paged, device_pages, [](int64_t) { return absl::OkStatus(); }, slow);
    if (!logits.ok()) return logits.status();
    run.logits = std::move(*logits);
    for (const auto& layer : checksum_pages) {
      run.checksums.emplace_back();
      for (const runtime::PagedState::PageId& id : layer) {
        const int32_t kind = *paged.layout().KindIndex(id.kind);
        run.checksums.back().push_back(kv::PayloadChecksum(
            device_pages.pages[static_cast<size_t>(kind)][static_cast<size_t>(id.page)]));
      }
    }
    return run;
  }
  bool stores_device_pages() const override { return true; }
  int64_t max_context() const override { return inner_->max_context(); }
  std::string Describe() const override { return "cpu with host device pages (test)"; }
  std::atomic<int> device_runs{0};
  std::atomic<int64_t> chunk_delay_ms{0};

 private:
  std::unique_ptr<engine::Model> model_;
  std::unique_ptr<PrefillEngine> inner_;
};

// The early import's slots: host claims counted, device claims keep their source until the
// runner's Add copies it into the sequence's host pages (the stand-in for the device import).
class DeviceSlots final : public runtime::SlotImporter {
 public:
  absl::Status Claim(serving::RequestId, int64_t, int64_t) override {
    absl::MutexLock lock(&mu_);
    ++host_claims_;
    return absl::OkStatus();
  }
  absl::Status ClaimFromDevice(serving::RequestId id, int64_t, int64_t,
                               runtime::DevicePageSource source) override {
    absl::MutexLock lock(&mu_);
    ++device_claims_;
    sources_[id] = std::move(source);
    return absl::OkStatus();
  }
  absl::Status ImportLayer(serving::RequestId, int64_t) override { return absl::OkStatus(); }
  absl::StatusOr<bool> Copied(serving::RequestId) override { return true; }
  void Release(serving::RequestId id) override {
    absl::MutexLock lock(&mu_);
    sources_.erase(id);
  }
  // The device pages of `id` (if it was claimed from them) into its pages of `pool`.
  absl::Status Import(serving::RequestId id, serving::PagePool& pool) {
    absl::MutexLock lock(&mu_);
    auto it = sources_.find(id);
    if (it == sources_.end()) return absl::OkStatus();
    auto table = pool.Table(id);
    if (!table.ok()) return table.status();
    for (size_t k = 0; k < table->pages.size(); ++k) {
      for (size_t i = 0; i < table->pages[k].size(); ++i) {
        auto bytes = pool.Data(id, table->pages[k][i]);
        if (!bytes.ok()) return bytes.status();
        std::memcpy(bytes->data(), it->second.pages[k][i], bytes->size());
      }
    }
    sources_.erase(it);
    return absl::OkStatus();
  }
  int host_claims() {
    absl::MutexLock lock(&mu_);
    return host_claims_;
  }
  int device_claims() {
    absl::MutexLock lock(&mu_);
    return device_claims_;
  }

 private:
  absl::Mutex mu_;
  int host_claims_ = 0;
  int device_claims_ = 0;
  std::map<serving::RequestId, runtime::DevicePageSource> sources_;
};

class DeviceRunner final : public runtime::SequenceRunner {
 public:
  DeviceRunner(std::unique_ptr<engine::Model> model, const runtime::RunnerContext& context,
               DeviceSlots* slots, bool early)
      : early_(early),
        model_(std::move(model)),
        pool_(context.pool),
        inner_(*model_, *context.layout, context.pool, context.options),
        slots_(slots),
        importer_(slots, context.config->num_hidden_layers) {}
  absl::Status Add(serving::RequestId id, runtime::SequenceSetup setup) override {
    if (absl::Status imported = slots_->Import(id, *pool_); !imported.ok()) return imported;
    return inner_.Add(id, std::move(setup));
  }
  void Remove(serving::RequestId id) override { inner_.Remove(id); }
  int64_t num_sequences() const override { return inner_.num_sequences(); }
  runtime::GuardCounts guard_counts() const override { return inner_.guard_counts(); }
  absl::StatusOr<serving::StepOutcome> Run(const serving::StepPlan& plan) override {
    return inner_.Run(plan);
  }
  runtime::EarlyImporter* early_importer() override { return early_ ? &importer_ : nullptr; }

 private:
  const bool early_;
  std::unique_ptr<engine::Model> model_;
  serving::PagePool* pool_;
  runtime::EngineStepRunner inner_;
  DeviceSlots* slots_;
  runtime::EarlyImporter importer_;
};

struct Result {
  std::vector<int32_t> tokens;
  std::string finish_reason;
  v1::TransferTicket ticket;
  grpc::Status prefill;
};

// Serves `service` on loopback (`server` keeps it) and returns a stub of it.
template <typename Service, typename MakeStub>
auto Serve(Service* service, std::unique_ptr<grpc::Server>* server, MakeStub make) {
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(service);
  *server = builder.BuildAndStart();
  EXPECT_NE(*server, nullptr);
  return make(
      grpc::CreateChannel("127.0.0.1:" + std::to_string(port), grpc::InsecureChannelCredentials()),
      grpc::StubOptions());
}

class CudaIpcWorkerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    setenv("UCX_TLS", "tcp", 1);
    const std::string model = PDSERVE_BUNDLED_MODEL;
    absl::StatusOr<std::string> boot = kv::shm::HostBootId();
    ASSERT_TRUE(boot.ok()) << boot.status();
    boot_id_ = *boot;
    prefill::PrefillWorkerOptions p;
    p.model_dir = model;
    p.engine_factory = [this](const runtime::PrefillEngineContext& context)
        -> absl::StatusOr<std::unique_ptr<runtime::PrefillEngine>> {
      auto cpu = engine::Model::Load(context.model_dir);
      if (!cpu.ok()) return cpu.status();
      auto owned = std::make_unique<engine::Model>(std::move(*cpu));
      auto inner = runtime::CpuPrefillEngine(*owned, context.prefill_block);
      if (!inner.ok()) return inner.status();
      auto engine = std::make_unique<HostDeviceEngine>(std::move(owned), std::move(*inner));
      engine_ = engine.get();
      return std::unique_ptr<runtime::PrefillEngine>(std::move(engine));
    };
    p.device_arena = prefill::DeviceArenaOptions{
        .allocate = [this](size_t bytes) -> absl::StatusOr<prefill::DeviceArena> {
          auto [memory, owner] = HostMemory(bytes);
          {
            absl::MutexLock lock(&arenas_.mu);
            arenas_.arenas[kArenaId] = memory;
          }
          prefill::DeviceArena arena{.memory = memory, .owner = owner};
          arena.name.memory[0] = std::byte{kArenaId};
          arena.name.bytes = bytes;
          arena.name.pci_bus_id = kBusId;
          arena.name.boot_id = boot_id_;
          return arena;
        },
        .required = true};
    auto prefill = prefill::PrefillWorker::Create(p);
    ASSERT_TRUE(prefill.ok()) << prefill.status();
    prefill_ = std::move(*prefill);
    prefill_stub_ = Serve(prefill_.get(), &prefill_server_, &v1::PrefillWorker::NewStub);

    DecodeWorkerOptions plain;
    plain.model_dir = model;
    plain.max_batch = 8;
    plain.runner_factory = [this](const runtime::RunnerContext& context) {
      return MakeRunner(context, &plain_slots_);
    };
    DecodeWorkerOptions ipc = plain;
    ipc.runner_factory = [this](const runtime::RunnerContext& context) {
      return MakeRunner(context, &ipc_slots_);
    };
    ipc.device_landing = DeviceLanding{
        .pci_bus_id = kBusId,
        .allocate = [](size_t bytes) -> absl::StatusOr<DeviceLanding::Memory> {
          auto [memory, owner] = HostMemory(bytes);
          return DeviceLanding::Memory{memory, owner};
        },
        .landers = [this]() -> absl::StatusOr<std::unique_ptr<kv::shm::DevicePageLander>> {
          return std::make_unique<kv::testing::FakeLander>(arenas_, nullptr, &gate_);
        },
        .can_map = [this](const v1::CudaIpcSource& source) -> absl::Status {
          if (source.boot_id() != boot_id_) {
            return absl::FailedPreconditionError("cuda ipc: the arena is on another host");
          }
          if (source.pci_bus_id() != kBusId) {
            return absl::FailedPreconditionError("cuda ipc: the arena's GPU is not visible");
          }
          return absl::OkStatus();
        },
        .required = true};
    ipc_options_ = ipc;
    for (auto* options : {&plain, &ipc}) {
      auto decode = DecodeWorker::Create(*options);
      ASSERT_TRUE(decode.ok()) << decode.status();
      decode_.push_back(std::move(*decode));
      decode_servers_.emplace_back();
      decode_stubs_.push_back(
          Serve(decode_.back().get(), &decode_servers_.back(), &v1::DecodeWorker::NewStub));
    }
  }

  void TearDown() override {
    for (auto& s : decode_servers_) s->Shutdown();
    if (prefill_server_) prefill_server_->Shutdown();
    for (auto& d : decode_) d->Stop();
  }

  absl::StatusOr<std::unique_ptr<runtime::SequenceRunner>> MakeRunner(
      const runtime::RunnerContext& context, DeviceSlots* slots, bool early = true) {
    auto cpu = engine::Model::Load(context.model_dir);
    if (!cpu.ok()) return cpu.status();
    return std::make_unique<DeviceRunner>(std::make_unique<engine::Model>(std::move(*cpu)), context,
                                          slots, early);
  }
  // Another decode worker of `options`, served as decode_stubs_.back().
  void AddDecode(const DecodeWorkerOptions& options) {
    auto decode = DecodeWorker::Create(options);
    ASSERT_TRUE(decode.ok()) << decode.status();
    decode_.push_back(std::move(*decode));
    decode_servers_.emplace_back();
    decode_stubs_.push_back(
        Serve(decode_.back().get(), &decode_servers_.back(), &v1::DecodeWorker::NewStub));
  }

  v1::HealthResponse PrefillHealth(v1::PrefillWorker::Stub& stub) {
    v1::HealthResponse health;
    grpc::ClientContext context;
    EXPECT_TRUE(stub.Health(&context, v1::HealthRequest(), &health).ok());
    return health;
  }

  // The router's flow for one request on decode worker `d` (0: host only, 1: cuda ipc), the
  // Reserve carrying `source` when set, prefilled by `prefill`.
  Result Run(int d, uint64_t id, const std::vector<int32_t>& prompt,
             const std::optional<v1::CudaIpcSource>& source,
             v1::PrefillWorker::Stub* prefill = nullptr) {
    if (prefill == nullptr) prefill = prefill_stub_.get();
    v1::SamplingParams sampling;
    sampling.set_max_tokens(10);
    sampling.set_temperature(0.8f);
    sampling.set_seed(id);
    Result result;
    v1::ReserveRequest reserve;
    reserve.set_request_id(id);
    reserve.set_prompt_tokens(static_cast<int32_t>(prompt.size()));
    *reserve.mutable_sampling() = sampling;
    for (int32_t t : prompt) reserve.add_prompt_token_ids(t);
    if (source.has_value()) *reserve.mutable_prefill_cuda_ipc() = *source;
    v1::ReserveResponse reserved;
    {
      grpc::ClientContext context;
      const grpc::Status s = decode_stubs_[d]->Reserve(&context, reserve, &reserved);
      EXPECT_TRUE(s.ok()) << s.error_message();
      if (!s.ok()) return result;
    }
    result.ticket = reserved.ticket();
    v1::PrefillRequest request;
    request.set_request_id(id);
    for (int32_t t : prompt) request.add_token_ids(t);
    *request.mutable_sampling() = sampling;
    *request.mutable_ticket() = result.ticket;
    std::thread prefilling([&] {
      v1::PrefillResponse response;
      grpc::ClientContext context;
      result.prefill = prefill->Prefill(&context, request, &response);
    });
    prefilling.join();
    if (!result.prefill.ok()) {
      v1::AbortRequest abort;
      abort.set_request_id(id);
      abort.set_ticket_id(result.ticket.ticket_id());
      abort.set_prefill_quiesced(true);
      v1::AbortResponse aborted;
      grpc::ClientContext context;
      decode_stubs_[d]->Abort(&context, abort, &aborted).ok();
      return result;
    }
    grpc::ClientContext context;
    v1::GenerateRequest generate;
    generate.set_request_id(id);
    generate.set_ticket_id(result.ticket.ticket_id());
    auto reader = decode_stubs_[d]->Generate(&context, generate);
    v1::GenerateResponse event;
    while (reader->Read(&event)) {
      for (int32_t t : event.token_ids()) result.tokens.push_back(t);
      if (!event.finish_reason().empty()) result.finish_reason = event.finish_reason();
    }
    reader->Finish().ok();
    return result;
  }

  // Request `id` of `prompt` on the cuda ipc decode worker with `source` at Reserve: it
  // succeeds, its ticket asks for GPU pages or not (`gpu_pages`), and its tokens are the host
  // path's (the same request on the host-only decode worker).
  void ExpectHostPathTokens(uint64_t id, const std::vector<int32_t>& prompt,
                            const v1::CudaIpcSource& source, bool gpu_pages) {
    const Result got = Run(1, id, prompt, source);
    ASSERT_TRUE(got.prefill.ok()) << got.prefill.error_message();
    EXPECT_EQ(AsksGpuPages(got.ticket), gpu_pages);
    EXPECT_EQ(got.tokens, Run(0, id, prompt, std::nullopt).tokens);
    EXPECT_FALSE(got.tokens.empty());
  }

  static std::vector<int32_t> Prompt(int64_t n, int32_t salt) {
    std::vector<int32_t> prompt;
    for (int64_t i = 0; i < n; ++i) prompt.push_back(static_cast<int32_t>((i * 37 + salt) % 4000));
    return prompt;
  }
  static bool AsksGpuPages(const v1::TransferTicket& ticket) {
    return ticket.has_shm_pull() && ticket.shm_pull().device_pci_bus_id() == kBusId;
  }

  std::string boot_id_;
  DecodeWorkerOptions ipc_options_;  // the cuda ipc decode worker's (a test may make another)
  kv::testing::FakeArenas arenas_;
  kv::testing::FakeLanderGate gate_;  // the cuda ipc decode workers' landers
  HostDeviceEngine* engine_ = nullptr;
  DeviceSlots plain_slots_;
  DeviceSlots ipc_slots_;
  DeviceSlots late_slots_;  // a test's decode worker without an early importer
  std::unique_ptr<prefill::PrefillWorker> prefill_;
  std::unique_ptr<grpc::Server> prefill_server_;
  std::unique_ptr<v1::PrefillWorker::Stub> prefill_stub_;
  std::vector<std::unique_ptr<DecodeWorker>> decode_;
  std::vector<std::unique_ptr<grpc::Server>> decode_servers_;
  std::vector<std::unique_ptr<v1::DecodeWorker::Stub>> decode_stubs_;
};

TEST_F(CudaIpcWorkerTest, APrefillWorkerWithAnArenaStatesItInHealth) {
  const v1::HealthResponse health = PrefillHealth(*prefill_stub_);
  ASSERT_TRUE(health.has_cuda_ipc());
  EXPECT_EQ(health.cuda_ipc().boot_id(), boot_id_);
  EXPECT_EQ(health.cuda_ipc().pci_bus_id(), kBusId);
}

TEST_F(CudaIpcWorkerTest, WithTheCapabilityAtReservePagesGoDeviceToDeviceAndTokensAreUnchanged) {
  const v1::CudaIpcSource source = PrefillHealth(*prefill_stub_).cuda_ipc();
  uint64_t id = 100;
  for (int64_t length : {1, 63, 150}) {
    SCOPED_TRACE(length);
    const std::vector<int32_t> prompt = Prompt(length, static_cast<int32_t>(length % 5));
    const Result want = Run(0, id, prompt, std::nullopt);
    const Result got = Run(1, id, prompt, source);
    ASSERT_TRUE(got.prefill.ok()) << got.prefill.error_message();
    EXPECT_FALSE(AsksGpuPages(want.ticket));
    EXPECT_TRUE(AsksGpuPages(got.ticket));
    EXPECT_EQ(got.tokens, want.tokens);
    EXPECT_EQ(got.finish_reason, want.finish_reason);
    EXPECT_FALSE(got.tokens.empty());
    ++id;
  }
  EXPECT_EQ(ipc_slots_.device_claims(), 3);
  EXPECT_EQ(ipc_slots_.host_claims(), 0);
  EXPECT_EQ(engine_->device_runs.load(), 3);
  EXPECT_TRUE(absl::StrContains(decode_[1]->MetricsText(), "path=\"cuda-ipc\""));
  EXPECT_FALSE(absl::StrContains(decode_[0]->MetricsText(), "path=\"cuda-ipc\""));
  EXPECT_TRUE(absl::StrContains(prefill_->MetricsText(), "path=\"cuda-ipc\""));
}

// A prompt that runs longer than the decode worker's lease (5 chunks of 64 tokens, 500 ms each,
// against a 1.2 s lease) keeps it: the transfer is prepared before the prompt runs and its polls
// between chunks send the heartbeats, as on the host path.
TEST_F(CudaIpcWorkerTest, APromptLongerThanTheLeaseKeepsItByTheTransfersHeartbeats) {
  DecodeWorkerOptions short_lease = ipc_options_;
  short_lease.lease = absl::Milliseconds(1200);
  short_lease.runner_factory = [this](const runtime::RunnerContext& context) {
    return MakeRunner(context, &late_slots_);
  };
  AddDecode(short_lease);
  const v1::CudaIpcSource source = PrefillHealth(*prefill_stub_).cuda_ipc();
  const std::vector<int32_t> prompt = Prompt(300, 3);
  const Result want = Run(0, 700, prompt, std::nullopt);
  engine_->chunk_delay_ms = 500;
  const absl::Time started = absl::Now();
  const Result got = Run(2, 700, prompt, source);
  EXPECT_GT(absl::Now() - started, absl::Milliseconds(2400));  // twice the lease at least
  engine_->chunk_delay_ms = 0;
  ASSERT_TRUE(got.prefill.ok()) << got.prefill.error_message();
  EXPECT_TRUE(AsksGpuPages(got.ticket));
  EXPECT_EQ(got.tokens, want.tokens);
  EXPECT_EQ(got.finish_reason, want.finish_reason);
  EXPECT_EQ(late_slots_.device_claims(), 1);
}

TEST_F(CudaIpcWorkerTest, WithoutTheCapabilityAtReserveTheTicketAsksForHostPages) {
  const std::vector<int32_t> prompt = Prompt(70, 2);
  const Result want = Run(0, 200, prompt, std::nullopt);
  const Result got = Run(1, 200, prompt, std::nullopt);
  ASSERT_TRUE(got.prefill.ok()) << got.prefill.error_message();
  EXPECT_FALSE(AsksGpuPages(got.ticket));
  EXPECT_EQ(got.tokens, want.tokens);
  EXPECT_EQ(ipc_slots_.device_claims(), 0);
  EXPECT_EQ(ipc_slots_.host_claims(), 1);
  EXPECT_EQ(engine_->device_runs.load(), 0);
}

TEST_F(CudaIpcWorkerTest, AnArenaThisProcessCannotMapGoesByHostPages) {
  v1::CudaIpcSource elsewhere = PrefillHealth(*prefill_stub_).cuda_ipc();
  elsewhere.set_boot_id("another-host");
  const std::vector<int32_t> prompt = Prompt(40, 1);
  const Result want = Run(0, 300, prompt, std::nullopt);
  const Result got = Run(1, 300, prompt, elsewhere);
  ASSERT_TRUE(got.prefill.ok()) << got.prefill.error_message();
  EXPECT_FALSE(AsksGpuPages(got.ticket));
  EXPECT_EQ(got.tokens, want.tokens);
  EXPECT_EQ(ipc_slots_.device_claims(), 0);
}

// A request longer than the arena's tokens (transfer.cuda_ipc_arena_tokens, the same key on
// both workers) goes by host pages: the prefill worker's arena could not hold it.
TEST_F(CudaIpcWorkerTest, ARequestLongerThanTheArenaTokensGoesByHostPages) {
  DecodeWorkerOptions small = ipc_options_;
  small.device_landing->request_tokens = 40;
  AddDecode(small);
  const v1::CudaIpcSource source = PrefillHealth(*prefill_stub_).cuda_ipc();
  const Result fits = Run(2, 500, Prompt(30, 4), source);    // 30 + 10 tokens
  const Result longer = Run(2, 501, Prompt(31, 4), source);  // 31 + 10
  EXPECT_TRUE(AsksGpuPages(fits.ticket));
  EXPECT_FALSE(AsksGpuPages(longer.ticket));
  EXPECT_EQ(fits.tokens, Run(0, 500, Prompt(30, 4), std::nullopt).tokens);
  EXPECT_EQ(longer.tokens, Run(0, 501, Prompt(31, 4), std::nullopt).tokens);
  EXPECT_FALSE(longer.tokens.empty());
}

// The device pages are read by the early import: a decode worker without one (transfer.
// early_import false, or an expert-parallel runner) allocates no device page pool and lands
// every request in host pages.
TEST_F(CudaIpcWorkerTest, WithoutAnEarlyImporterEveryRequestGoesByHostPages) {
  DecodeWorkerOptions late = ipc_options_;
  late.runner_factory = [this](const runtime::RunnerContext& context) {
    return MakeRunner(context, &late_slots_, /*early=*/false);
  };
  auto allocations = std::make_shared<std::atomic<int>>(0);
  late.device_landing->allocate =
      [allocations](size_t bytes) -> absl::StatusOr<DeviceLanding::Memory> {
    ++*allocations;
    auto [memory, owner] = HostMemory(bytes);
    return DeviceLanding::Memory{memory, owner};
  };
  AddDecode(late);
  EXPECT_EQ(allocations->load(), 0);
  const std::vector<int32_t> prompt = Prompt(50, 6);
  const Result got = Run(2, 600, prompt, PrefillHealth(*prefill_stub_).cuda_ipc());
  ASSERT_TRUE(got.prefill.ok()) << got.prefill.error_message();
  EXPECT_FALSE(AsksGpuPages(got.ticket));
  EXPECT_EQ(got.tokens, Run(0, 600, prompt, std::nullopt).tokens);
  EXPECT_EQ(late_slots_.device_claims(), 0);
}

// An arena the decode worker's lander cannot map fails that request loudly (never decoded), and
// the next requests from that prefill worker go by host pages.
TEST_F(CudaIpcWorkerTest, AnArenaTheLanderCannotMapFailsThatRequestAndLaterOnesGoByHostPages) {
  const v1::CudaIpcSource source = PrefillHealth(*prefill_stub_).cuda_ipc();
  std::span<std::byte> arena;
  {
    absl::MutexLock lock(&arenas_.mu);
    arena = arenas_.arenas[kArenaId];
    arenas_.arenas.erase(kArenaId);  // as a cudaIpcOpenMemHandle that fails
  }
  const Result failed = Run(1, 700, Prompt(20, 1), source);
  EXPECT_TRUE(AsksGpuPages(failed.ticket));
  EXPECT_FALSE(failed.prefill.ok());
  EXPECT_TRUE(failed.tokens.empty());
  {
    absl::MutexLock lock(&arenas_.mu);
    arenas_.arenas[kArenaId] = arena;
  }
  ExpectHostPathTokens(701, Prompt(20, 2), source, /*gpu_pages=*/false);
}

// A lander batch that fails part way (a CUDA error after some pages' copies ran) fails its
// request loudly, never decoded, and gives its device pages back: more such failures than the
// device page pool holds requests, and the next request still lands in device pages (a batch
// that failed is not an arena the lander refused: no suspension) with the host path's tokens.
TEST_F(CudaIpcWorkerTest, AFailedLanderBatchFailsItsRequestAndGivesItsDevicePagesBack) {
  const v1::CudaIpcSource source = PrefillHealth(*prefill_stub_).cuda_ipc();
  for (uint64_t id = 800; id < 806; ++id) {
    SCOPED_TRACE(id);
    gate_.fail = 1000;
    const Result failed = Run(1, id, Prompt(25, 3), source);
    EXPECT_TRUE(AsksGpuPages(failed.ticket));
    EXPECT_FALSE(failed.prefill.ok());
    EXPECT_TRUE(failed.tokens.empty());
  }
  gate_.fail = 0;
  ExpectHostPathTokens(806, Prompt(25, 4), source, /*gpu_pages=*/true);
}

// A CPU prefill worker (its engine stores no device pages) states no arena, so a router never
// passes one for it; a ticket that asks for GPU pages anyway is refused before anything is sent.
TEST_F(CudaIpcWorkerTest, ACpuPrefillWorkerStatesNoArenaAndRefusesATicketForGpuPages) {
  prefill::PrefillWorkerOptions p;
  p.model_dir = PDSERVE_BUNDLED_MODEL;
  p.device_arena = prefill::DeviceArenaOptions{
      .allocate = [](size_t) -> absl::StatusOr<prefill::DeviceArena> {
        return absl::InternalError("never called: the CPU engine stores no device pages");
      },
      .required = true};
  auto cpu = prefill::PrefillWorker::Create(p);
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  std::unique_ptr<grpc::Server> server;
  auto stub = Serve(cpu->get(), &server, &v1::PrefillWorker::NewStub);
  EXPECT_FALSE(PrefillHealth(*stub).has_cuda_ipc());
  // A decode worker told (wrongly) that this prefill worker has an arena asks for GPU pages.
  const Result got =
      Run(1, 400, Prompt(30, 3), PrefillHealth(*prefill_stub_).cuda_ipc(), stub.get());
  EXPECT_TRUE(AsksGpuPages(got.ticket));
  EXPECT_EQ(got.prefill.error_code(), grpc::StatusCode::FAILED_PRECONDITION)
      << got.prefill.error_message();
  EXPECT_TRUE(got.tokens.empty());
  server->Shutdown();
}

}  // namespace
}  // namespace pdserve::decode
