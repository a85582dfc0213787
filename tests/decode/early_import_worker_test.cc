// The decode worker's side of the early import (decode/early_import.cc) on the CPU engine: a
// prefill worker and two decode workers in this process (bundled model, UCX over tcp, gRPC on
// loopback), one of them with a runner whose early importer records what the worker asks of it
// (a real runtime::EarlyImporter over a recording SlotImporter; the tokens come from the CPU
// engine's runner, which decodes from the pages either way). Checked: the slot is claimed at
// Reserve, every layer is imported exactly once before the sequence is added, the tokens equal
// the other decode worker's (the same runner over the same bf16 pages, without the early
// import), and a corrupted transfer or an abort cancels the import (slot back, never added) and
// ends only that request; an abort while a layer's import reads the pages leaves them the
// sequence's until the import let go. Also the batch slot an aborted request holds until it left
// the batch (this fixture is the in-process PD flow). The GPU side is
// tests/engine_gpu/gpu_early_import_test.cc.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <stdlib.h>

#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "decode/decode_worker.h"
#include "engine/model.h"
#include "prefill/prefill_worker.h"
#include "runtime/early_import.h"
#include "runtime/step_runner.h"

namespace pdserve::decode {
namespace {

namespace v1 = pdserve::worker::v1;

// Records the early import's slot calls: claims, each layer imported, releases.
class RecordingSlots : public runtime::SlotImporter {
 public:
  absl::Status Claim(serving::RequestId id, int64_t, int64_t) override {
    absl::MutexLock lock(&mu_);
    claimed_.insert(id);
    ever_claimed_.insert(id);
    return absl::OkStatus();
  }
  absl::Status ImportLayer(serving::RequestId id, int64_t layer) override {
    if (block_first_ && !entered_.HasBeenNotified()) {
      // The import's read of the pages, cut in two: the first half before the block, the second
      // after it. Each half checks every page still belongs to the sequence, as the real
      // importer's read of the mapped pages assumes.
      ReadPages(id);
      entered_.Notify();
      blocked_.WaitForNotification();
      ReadPages(id);
    }
    absl::MutexLock lock(&mu_);
    layers_[id].push_back(layer);
    return absl::OkStatus();
  }
  absl::StatusOr<bool> Copied(serving::RequestId) override { return true; }
  void Release(serving::RequestId id) override {
    absl::MutexLock lock(&mu_);
    if (claimed_.erase(id) > 0) ++releases_;
  }
  // The runner took the slot and the sequence ran; its Remove frees it.
  void Removed(serving::RequestId id) {
    absl::MutexLock lock(&mu_);
    claimed_.erase(id);
  }
  std::vector<int64_t> layers(serving::RequestId id) {
    absl::MutexLock lock(&mu_);
    return layers_[id];
  }
  size_t claimed() {
    absl::MutexLock lock(&mu_);
    return claimed_.size();
  }
  size_t ever_claimed() {
    absl::MutexLock lock(&mu_);
    return ever_claimed_.size();
  }
  int64_t releases() {
    absl::MutexLock lock(&mu_);
    return releases_;
  }
  // Pages a read found gone from the sequence (freed or reused under the import).
  int64_t stale_reads() {
    absl::MutexLock lock(&mu_);
    return stale_reads_;
  }
  serving::RequestId last_claimed() {
    absl::MutexLock lock(&mu_);
    return ever_claimed_.empty() ? 0 : *ever_claimed_.rbegin();
  }

  // With block_first_, the first ImportLayer call reads half of its pages, notifies entered_ and
  // waits for blocked_ before it reads the rest. pool_: the early worker's page pool.
  bool block_first_ = false;
  absl::Notification entered_;
  absl::Notification blocked_;
  serving::PagePool* pool_ = nullptr;

 private:
  void ReadPages(serving::RequestId id) {
    absl::StatusOr<serving::PageTable> table = pool_->Table(id);
    absl::MutexLock lock(&mu_);
    if (!table.ok()) {
      ++stale_reads_;
      return;
    }
    for (const auto& kind : table->pages) {
      for (const serving::PageHandle& page : kind) stale_reads_ += !pool_->Check(id, page).ok();
    }
  }

  absl::Mutex mu_;
  std::set<serving::RequestId> claimed_;
  std::set<serving::RequestId> ever_claimed_;
  std::map<serving::RequestId, std::vector<int64_t>> layers_;
  int64_t releases_ = 0;
  int64_t stale_reads_ = 0;
};

// The CPU engine's runner, with (`early`) an early importer over RecordingSlots; records, at each
// Add, which layers had been imported.
class EarlyImportRunner : public runtime::SequenceRunner {
 public:
  EarlyImportRunner(std::unique_ptr<engine::Model> model, const runtime::RunnerContext& context,
                    RecordingSlots* slots, bool early)
      : early_(early),
        model_(std::move(model)),
        inner_(*model_, *context.layout, context.pool, context.options),
        slots_(slots),
        importer_(slots, context.config->num_hidden_layers),
        layers_(context.config->num_hidden_layers) {}
  absl::Status Add(serving::RequestId id, runtime::SequenceSetup setup) override {
    {
      absl::MutexLock lock(&mu_);
      layers_at_add_[id] = slots_->layers(id);
    }
    return inner_.Add(id, std::move(setup));
  }
  void Remove(serving::RequestId id) override {
    slots_->Removed(id);
    inner_.Remove(id);
  }
  int64_t num_sequences() const override { return inner_.num_sequences(); }
  runtime::GuardCounts guard_counts() const override { return inner_.guard_counts(); }
  absl::StatusOr<serving::StepOutcome> Run(const serving::StepPlan& plan) override {
    return inner_.Run(plan);
  }
  runtime::EarlyImporter* early_importer() override { return early_ ? &importer_ : nullptr; }
  runtime::EarlyImporter& importer() { return importer_; }
  int64_t layers() const { return layers_; }

  std::map<serving::RequestId, std::vector<int64_t>> layers_at_add() {
    absl::MutexLock lock(&mu_);
    return layers_at_add_;
  }

 private:
  const bool early_;
  std::unique_ptr<engine::Model> model_;
  runtime::EngineStepRunner inner_;
  RecordingSlots* slots_;
  runtime::EarlyImporter importer_;
  const int64_t layers_;
  absl::Mutex mu_;
  std::map<serving::RequestId, std::vector<int64_t>> layers_at_add_;
};

struct Result {
  std::vector<int32_t> tokens;
  std::string finish_reason;
  v1::IsolationError isolation_error = v1::ISOLATION_ERROR_UNSPECIFIED;
};

class EarlyImportWorkerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    setenv("UCX_TLS", "tcp", 1);
    const std::string model = PDSERVE_BUNDLED_MODEL;
    prefill::PrefillWorkerOptions p;
    p.model_dir = model;
    p.faults.corrupt_request = kCorrupted;
    p.faults.delay_request = kDelayed;
    p.faults.delay = absl::Seconds(1);
    auto prefill = prefill::PrefillWorker::Create(p);
    ASSERT_TRUE(prefill.ok()) << prefill.status();
    prefill_ = std::move(*prefill);
    // Both decode workers run the CPU engine's runner over the pages a runner factory's worker
    // keeps (bf16, as for the CUDA engine); only the second has an early importer.
    DecodeWorkerOptions plain;
    plain.model_dir = model;
    plain.max_batch = 8;
    plain.runner_factory = [this](const runtime::RunnerContext& context) {
      return MakeRunner(context, /*early=*/false);
    };
    auto decode = DecodeWorker::Create(plain);
    ASSERT_TRUE(decode.ok()) << decode.status();
    plain_ = std::move(*decode);
    DecodeWorkerOptions early = plain;
    early.runner_factory = [this](const runtime::RunnerContext& context) {
      return MakeRunner(context, /*early=*/true);
    };
    decode = DecodeWorker::Create(early);
    ASSERT_TRUE(decode.ok()) << decode.status();
    early_ = std::move(*decode);
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(prefill_.get());
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    auto channel = grpc::CreateChannel("127.0.0.1:" + std::to_string(port),
                                       grpc::InsecureChannelCredentials());
    prefill_stub_ = v1::PrefillWorker::NewStub(channel);
    for (DecodeWorker* w : {plain_.get(), early_.get()}) Serve(w);
  }

  // Serves `w` on loopback: decode_stubs_.back() is its stub.
  void Serve(DecodeWorker* w) {
    grpc::ServerBuilder b;
    int port = 0;
    b.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    b.RegisterService(w);
    decode_servers_.push_back(b.BuildAndStart());
    ASSERT_NE(decode_servers_.back(), nullptr);
    decode_stubs_.push_back(v1::DecodeWorker::NewStub(grpc::CreateChannel(
        "127.0.0.1:" + std::to_string(port), grpc::InsecureChannelCredentials())));
  }

  absl::StatusOr<std::unique_ptr<runtime::SequenceRunner>> MakeRunner(
      const runtime::RunnerContext& context, bool early) {
    auto cpu = engine::Model::Load(context.model_dir);
    if (!cpu.ok()) return cpu.status();
    auto runner = std::make_unique<EarlyImportRunner>(
        std::make_unique<engine::Model>(std::move(*cpu)), context, &slots_, early);
    if (early) {
      runner_ = runner.get();
      pool_ = context.pool;
      slots_.pool_ = context.pool;
    }
    return runner;
  }

  void TearDown() override {
    // A failed test may leave the importer blocked mid-read.
    if (!slots_.blocked_.HasBeenNotified()) slots_.blocked_.Notify();
    for (auto& s : decode_servers_) s->Shutdown();
    if (server_) server_->Shutdown();
    if (early_) early_->Stop();
    if (plain_) plain_->Stop();
    if (extra_) extra_->Stop();
  }

  // The router's flow for one request on decode worker `d` (0: plain, 1: early import).
  Result Run(int d, uint64_t id, const std::vector<int32_t>& prompt) {
    v1::SamplingParams sampling;
    sampling.set_max_tokens(12);
    sampling.set_temperature(0.8f);
    sampling.set_seed(id);
    Result result;
    const absl::StatusOr<v1::TransferTicket> ticket = Reserve(d, id, prompt, sampling);
    EXPECT_TRUE(ticket.ok()) << ticket.status();
    if (!ticket.ok()) return result;
    std::thread prefill = Prefill(id, prompt, sampling, *ticket);
    grpc::ClientContext context;
    v1::GenerateRequest generate;
    generate.set_request_id(id);
    generate.set_ticket_id(ticket->ticket_id());
    auto reader = decode_stubs_[d]->Generate(&context, generate);
    v1::GenerateResponse event;
    while (reader->Read(&event)) {
      for (int32_t t : event.token_ids()) result.tokens.push_back(t);
      if (!event.finish_reason().empty()) {
        result.finish_reason = event.finish_reason();
        result.isolation_error = event.isolation_error();
      }
    }
    reader->Finish().ok();
    prefill.join();
    return result;
  }

  // Reserve of `id` on decode worker `d`: its ticket.
  absl::StatusOr<v1::TransferTicket> Reserve(int d, uint64_t id, const std::vector<int32_t>& prompt,
                                             const v1::SamplingParams& sampling) {
    v1::ReserveRequest reserve;
    reserve.set_request_id(id);
    reserve.set_prompt_tokens(static_cast<int32_t>(prompt.size()));
    *reserve.mutable_sampling() = sampling;
    for (int32_t t : prompt) reserve.add_prompt_token_ids(t);
    v1::ReserveResponse reserved;
    grpc::ClientContext context;
    const grpc::Status s = decode_stubs_[d]->Reserve(&context, reserve, &reserved);
    if (!s.ok()) return absl::InternalError(s.error_message());
    return reserved.ticket();
  }

  // The prefill worker's Prefill of `id` into `ticket`, on a thread of its own (copies taken).
  std::thread Prefill(uint64_t id, const std::vector<int32_t>& prompt,
                      const v1::SamplingParams& sampling, const v1::TransferTicket& ticket) {
    v1::PrefillRequest request;
    request.set_request_id(id);
    for (int32_t t : prompt) request.add_token_ids(t);
    *request.mutable_sampling() = sampling;
    *request.mutable_ticket() = ticket;
    return std::thread([this, request] {
      v1::PrefillResponse response;
      grpc::ClientContext context;
      prefill_stub_->Prefill(&context, request, &response).ok();
    });
  }

  // A Generate stream of `id` from `ticket_id` on decode worker `d`; the context lives with it.
  struct GenerateStream {
    grpc::ClientContext context;
    std::unique_ptr<grpc::ClientReader<v1::GenerateResponse>> reader;
  };
  std::unique_ptr<GenerateStream> Generate(int d, uint64_t id, uint64_t ticket_id) {
    auto stream = std::make_unique<GenerateStream>();
    v1::GenerateRequest generate;
    generate.set_request_id(id);
    generate.set_ticket_id(ticket_id);
    stream->reader = decode_stubs_[d]->Generate(&stream->context, generate);
    return stream;
  }

  // Abort of `id` on decode worker `d` (and, with `prefill`, then on the prefill worker).
  void Abort(int d, uint64_t id, uint64_t ticket_id, bool prefill) {
    v1::AbortRequest abort;
    abort.set_request_id(id);
    abort.set_ticket_id(ticket_id);
    v1::AbortResponse aborted;
    {
      grpc::ClientContext context;
      ASSERT_TRUE(decode_stubs_[d]->Abort(&context, abort, &aborted).ok());
    }
    if (!prefill) return;
    grpc::ClientContext context;
    abort.set_ticket_id(0);
    ASSERT_TRUE(prefill_stub_->Abort(&context, abort, &aborted).ok());
  }

  static std::vector<int32_t> Prompt(int64_t n, int32_t salt) {
    std::vector<int32_t> prompt;
    for (int64_t i = 0; i < n; ++i) prompt.push_back(static_cast<int32_t>((i * 37 + salt) % 4000));
    return prompt;
  }

  static constexpr uint64_t kCorrupted = 777;
  static constexpr uint64_t kDelayed = 888;  // its pages are held 1 s after they are posted
  RecordingSlots slots_;
  EarlyImportRunner* runner_ = nullptr;
  serving::PagePool* pool_ = nullptr;  // the early worker's
  std::unique_ptr<prefill::PrefillWorker> prefill_;
  std::unique_ptr<DecodeWorker> plain_;
  std::unique_ptr<DecodeWorker> early_;
  std::unique_ptr<DecodeWorker> extra_;  // a test's own decode worker (decode_stubs_[2])
  std::unique_ptr<grpc::Server> server_;
  std::vector<std::unique_ptr<grpc::Server>> decode_servers_;
  std::unique_ptr<v1::PrefillWorker::Stub> prefill_stub_;
  std::vector<std::unique_ptr<v1::DecodeWorker::Stub>> decode_stubs_;
};

// Waits (at most 10 s: a hang is a failure, not a timing) until `done` holds.
template <typename F>
bool Eventually(F done) {
  const absl::Time until = absl::Now() + absl::Seconds(10);
  while (!done()) {
    if (absl::Now() > until) return false;
    absl::SleepFor(absl::Milliseconds(1));
  }
  return true;
}

TEST_F(EarlyImportWorkerTest, EveryLayerIsImportedBeforeTheSequenceJoinsAndTokensAreUnchanged) {
  ASSERT_NE(runner_, nullptr);
  const int64_t layers = runner_->layers();
  uint64_t id = 100;
  for (int64_t length : {1, 63, 100, 200}) {
    SCOPED_TRACE(length);
    const std::vector<int32_t> prompt = Prompt(length, static_cast<int32_t>(length % 7));
    const Result want = Run(0, id, prompt);
    const Result got = Run(1, id, prompt);
    EXPECT_EQ(got.tokens, want.tokens);
    EXPECT_EQ(got.finish_reason, want.finish_reason);
    ++id;
  }
  ASSERT_TRUE(Eventually([&] { return slots_.claimed() == 0; }));
  EXPECT_EQ(slots_.ever_claimed(), 4u);
  EXPECT_EQ(slots_.releases(), 0);  // every slot was taken by the runner
  const auto at_add = runner_->layers_at_add();
  ASSERT_EQ(at_add.size(), 4u);
  for (const auto& [sequence, imported] : at_add) {
    std::multiset<int64_t> each(imported.begin(), imported.end());
    EXPECT_EQ(each.size(), static_cast<size_t>(layers)) << sequence;
    for (int64_t l = 0; l < layers; ++l) EXPECT_EQ(each.count(l), 1u) << sequence;
  }
}

TEST_F(EarlyImportWorkerTest, ACorruptedTransferCancelsTheImportAndFailsOnlyThatRequest) {
  ASSERT_NE(runner_, nullptr);
  const Result bad = Run(1, kCorrupted, Prompt(100, 5));
  EXPECT_EQ(bad.finish_reason, "error");
  EXPECT_EQ(bad.isolation_error, v1::ISOLATION_ERROR_CHECKSUM);
  EXPECT_TRUE(bad.tokens.empty());
  // Its slot goes back without the runner ever seeing the sequence.
  ASSERT_TRUE(Eventually([&] { return slots_.releases() == 1; }));
  EXPECT_EQ(slots_.claimed(), 0u);
  EXPECT_TRUE(runner_->layers_at_add().empty());
  // The next request is untouched.
  const Result want = Run(0, 900, Prompt(100, 6));
  const Result good = Run(1, 900, Prompt(100, 6));
  EXPECT_EQ(good.tokens, want.tokens);
  EXPECT_FALSE(good.tokens.empty());
}

// An abort of a request whose pages have not arrived yet (the prefill worker holds them): the
// decode side ends the request with "abort" and its early import is cancelled: the slot goes back
// without the runner ever seeing the sequence.
TEST_F(EarlyImportWorkerTest, AnAbortBeforeThePagesArriveGivesTheSlotBack) {
  ASSERT_NE(runner_, nullptr);
  const std::vector<int32_t> prompt = Prompt(80, 3);
  v1::SamplingParams sampling;
  sampling.set_max_tokens(8);
  const absl::StatusOr<v1::TransferTicket> ticket = Reserve(1, kDelayed, prompt, sampling);
  ASSERT_TRUE(ticket.ok()) << ticket.status();
  EXPECT_EQ(slots_.claimed(), 1u);  // claimed at Reserve
  std::thread prefill = Prefill(kDelayed, prompt, sampling, *ticket);
  const std::unique_ptr<GenerateStream> stream = Generate(1, kDelayed, ticket->ticket_id());
  auto& reader = stream->reader;
  absl::SleepFor(absl::Milliseconds(200));  // the prefill has posted its (held) pages
  // The decode side first (a cancelled Generate's way): the request ends with "abort" at once
  // and its pages wait behind the fence; then the prefill side, whose abort sends that fence.
  Abort(1, kDelayed, ticket->ticket_id(), /*prefill=*/true);
  std::string finish;
  std::vector<int32_t> tokens;
  v1::GenerateResponse event;
  while (reader->Read(&event)) {
    for (int32_t t : event.token_ids()) tokens.push_back(t);
    if (!event.finish_reason().empty()) finish = event.finish_reason();
  }
  reader->Finish().ok();
  prefill.join();
  EXPECT_EQ(finish, "abort");
  EXPECT_TRUE(tokens.empty());
  ASSERT_TRUE(Eventually([&] { return slots_.releases() == 1; }));
  EXPECT_EQ(slots_.claimed(), 0u);
  EXPECT_TRUE(runner_->layers_at_add().empty());
}

// An abort after the transfer verified, while the importer still reads the pages of a layer
// (its call blocked mid-read): the request ends and its import is cancelled, but its pages stay
// the sequence's until the importer lets go of them, then go back to the pool. Without the
// importer's hold on the pages they were freed at once under its read.
TEST_F(EarlyImportWorkerTest, PagesStayUntilTheImporterLetsGoOfThem) {
  ASSERT_NE(runner_, nullptr);
  ASSERT_NE(pool_, nullptr);
  slots_.block_first_ = true;
  const std::vector<int32_t> prompt = Prompt(90, 4);
  constexpr uint64_t kId = 4242;
  v1::SamplingParams sampling;
  sampling.set_max_tokens(8);
  const absl::StatusOr<v1::TransferTicket> ticket = Reserve(1, kId, prompt, sampling);
  ASSERT_TRUE(ticket.ok()) << ticket.status();
  const serving::RequestId sequence = slots_.last_claimed();
  ASSERT_TRUE(pool_->Table(sequence).ok());
  std::thread prefill = Prefill(kId, prompt, sampling, *ticket);
  const std::unique_ptr<GenerateStream> stream = Generate(1, kId, ticket->ticket_id());
  auto& reader = stream->reader;
  // The first token comes once the transfer verified; the import is still blocked in its read.
  v1::GenerateResponse event;
  ASSERT_TRUE(reader->Read(&event));
  ASSERT_EQ(event.token_ids_size(), 1);
  ASSERT_TRUE(slots_.entered_.WaitForNotificationWithTimeout(absl::Seconds(10)));
  Abort(1, kId, ticket->ticket_id(), /*prefill=*/false);
  std::string finish;
  while (reader->Read(&event)) {
    if (!event.finish_reason().empty()) finish = event.finish_reason();
  }
  reader->Finish().ok();
  prefill.join();
  EXPECT_EQ(finish, "abort");
  // The worker is done with the request: it gave up its pages and cancelled the import, which
  // waits for the running call.
  ASSERT_TRUE(Eventually([&] {
    return runner_->importer().StateOf(sequence) == runtime::EarlyImportState::kCancelled;
  }));
  EXPECT_TRUE(pool_->Table(sequence).ok()) << "freed under the importer's read";
  slots_.blocked_.Notify();
  ASSERT_TRUE(Eventually([&] { return !pool_->Table(sequence).ok(); }));
  EXPECT_EQ(slots_.stale_reads(), 0);
  ASSERT_TRUE(Eventually([&] { return slots_.releases() == 1; }));
  EXPECT_EQ(runner_->importer().active(), 0);
  for (int32_t k = 0; k < pool_->num_kinds(); ++k) EXPECT_EQ(pool_->pages_used(k), 0) << k;
  EXPECT_TRUE(runner_->layers_at_add().empty());
}

// A request aborted while it decodes stays in the batch (and its runner slot) until the step in
// flight is over: Reserve counts its batch slot until then, as it counts a finishing one's, and
// refuses the next request for want of a batch slot. (The page pool refused it anyway: its
// window pages are max_batch requests' worth, aborted ones included. Only the reason was wrong:
// "pages held by aborted or failed requests until their fence or lease".) Here the decode loop
// never steps (its test fault), so the aborted request stays in the batch.
TEST_F(EarlyImportWorkerTest, AnAbortedRequestHoldsItsBatchSlotUntilItLeavesTheBatch) {
  DecodeWorkerOptions options;
  options.model_dir = PDSERVE_BUNDLED_MODEL;
  options.max_batch = 1;
  options.faults.stall_loop_after = absl::ZeroDuration();
  auto worker = DecodeWorker::Create(options);
  ASSERT_TRUE(worker.ok()) << worker.status();
  extra_ = std::move(*worker);
  Serve(extra_.get());
  const std::vector<int32_t> prompt = Prompt(40, 2);
  v1::SamplingParams sampling;
  sampling.set_max_tokens(8);
  const absl::StatusOr<v1::TransferTicket> ticket = Reserve(2, 500, prompt, sampling);
  ASSERT_TRUE(ticket.ok()) << ticket.status();
  std::thread prefill = Prefill(500, prompt, sampling, *ticket);
  const std::unique_ptr<GenerateStream> stream = Generate(2, 500, ticket->ticket_id());
  auto& reader = stream->reader;
  v1::GenerateResponse event;
  ASSERT_TRUE(reader->Read(&event));  // its first token: it joined the batch with it
  ASSERT_EQ(event.token_ids_size(), 1);
  prefill.join();
  for (bool aborted : {false, true}) {
    SCOPED_TRACE(aborted);
    if (aborted) {
      Abort(2, 500, ticket->ticket_id(), /*prefill=*/false);
      std::string finish;
      while (reader->Read(&event)) {
        if (!event.finish_reason().empty()) finish = event.finish_reason();
      }
      reader->Finish().ok();
      EXPECT_EQ(finish, "abort");
      v1::StatsResponse stats;
      grpc::ClientContext context;
      ASSERT_TRUE(decode_stubs_[2]->Stats(&context, v1::StatsRequest(), &stats).ok());
      EXPECT_EQ(stats.running_requests(), 1);  // still in the batch
    }
    const absl::StatusOr<v1::TransferTicket> refused = Reserve(2, 501, prompt, sampling);
    ASSERT_FALSE(refused.ok());
    EXPECT_NE(refused.status().message().find("no free batch slot"), std::string::npos)
        << refused.status();
  }
}

}  // namespace
}  // namespace pdserve::decode
