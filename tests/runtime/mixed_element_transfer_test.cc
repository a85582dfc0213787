// Pages travel in the producer's element type and the receiver converts only when its own pages
// hold another one (docs/protocol.md, "Element types"): a CPU prefill's fp32 pages into a bf16
// pool (the CUDA decode worker's, emulated on the CPU: PagedState over a bf16 layout) decode to
// the tokens of the bf16-rounded state; bf16 pages into an fp32 pool (CUDA prefill -> CPU decode)
// land exactly; a corrupted bf16 byte fails the request with the checksum isolation error, with
// or without a conversion behind it. The whole path runs: PlanTransfer on each side, the ticket,
// TransferSender / TransferReceiver over the loopback transport.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <vector>

#include "common/clock.h"
#include "engine/model.h"
#include "gtest/gtest.h"
#include "kvtransfer/fault_transport.h"
#include "kvtransfer/isolation_error.h"
#include "kvtransfer/loopback_transport.h"
#include "kvtransfer/transfer_plan.h"
#include "kvtransfer/transfer_receiver.h"
#include "kvtransfer/transfer_sender.h"
#include "runtime/paged_state.h"
#include "tests/runtime/state_compare.h"
#include "worker/worker_model.h"

namespace pdserve::runtime {
namespace {

using serving::ElementType;

constexpr char kModelDir[] = PDSERVE_ENGINE_FIXTURES_DIR "/mixed_yarn_f32/model";
constexpr int64_t kPrompt = 29;
constexpr int64_t kTotal = 48;

std::vector<int32_t> Prompt() {
  std::vector<int32_t> tokens;
  for (int i = 0; i < kPrompt; ++i) tokens.push_back((i * 37 + 27) % 384);
  return tokens;
}

using testing::ExpectSameState;
using testing::SameBits;

void RoundTensor(engine::Tensor* t) {
  for (float& v : t->data) v = serving::Bf16ToFloat(serving::FloatToBf16(v));
}

// What the CUDA engine keeps of `state`: window rows, compressed entries and indexer keys in
// bf16, the compressors' open windows and overlaps in fp32.
engine::ModelState RoundedAsTheCudaEngineStoresIt(engine::ModelState state) {
  for (engine::LayerState& layer : state.layers) {
    RoundTensor(&layer.window_kv);
    RoundTensor(&layer.compressor.entries);
    RoundTensor(&layer.indexer.entries);
  }
  return state;
}

// One side of a transfer: a pool in `layout` with one sequence and its transfer plan.
struct Side {
  std::unique_ptr<serving::PagePool> pool;
  serving::PageTable table;
  SequencePages pages;
  std::vector<kv::PlannedPage> plan;
};

class MixedElementTransferTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<engine::Model> model = engine::Model::Load(kModelDir);
    ASSERT_TRUE(model.ok()) << model.status();
    model_ = std::make_unique<engine::Model>(std::move(*model));
    fp32_ = std::make_unique<serving::StateLayout>(
        *LayoutForModel(model_->config(), 4, ElementType::kFloat32));
    bf16_ = std::make_unique<serving::StateLayout>(
        *LayoutForModel(model_->config(), 4, ElementType::kBfloat16));
    layers_ = worker::LayerAttentions(model_->config());
    state_ = model_->NewState();
    ASSERT_TRUE(model_->Forward(&state_, Prompt()).ok());
    rounded_ = RoundedAsTheCudaEngineStoresIt(state_);
  }

  const serving::StateLayout& Layout(ElementType element) const {
    return element == ElementType::kBfloat16 ? *bf16_ : *fp32_;
  }

  Side MakeSide(ElementType element, serving::RequestId owner) {
    const serving::StateLayout& layout = Layout(element);
    Side side;
    serving::PagePoolOptions options = layout.PoolOptions(1, kTotal);
    options.poison_freed = true;  // fresh pages hold kPoisonWord: a stray write shows
    side.pool = *serving::PagePool::Create(options);
    side.table = *side.pool->Allocate(owner, layout.Demand(kTotal));
    side.pages = *MapPages(*side.pool, side.table);
    side.plan = *kv::PlanTransfer(layout, layers_, side.table, kPrompt, kTotal);
    return side;
  }

  // Stores `state` into a fresh `from` pool, sends its pages to a fresh `to` pool with `faults`
  // on the sender's side, and returns the outcome; the receiving side stays in receiver_.
  kv::TransferOutcome Transfer(ElementType from, ElementType to, const engine::ModelState& state,
                               std::vector<kv::FaultRule> faults = {}) {
    sender_side_ = MakeSide(from, 1);
    const PagedState sender_paged(model_->config(), Layout(from), kTotal);
    EXPECT_TRUE(sender_paged.Store(state, 0, sender_side_.pages).ok());
    receiver_side_ = MakeSide(to, 2);

    auto receive_end = network_.NewReceiveEnd();
    receiver_ = std::make_unique<kv::TransferReceiver>(
        std::move(receive_end), kv::ReceiverOptions{}, clock_,
        [](uint64_t, uint64_t, const absl::Status&) {});
    kv::ReceiveSpec spec{.request_id = 9, .epoch = kv::TableEpoch(receiver_side_.table)};
    for (const kv::PlannedPage& page : receiver_side_.plan) {
      spec.pages.push_back(page.descriptor);
      spec.destinations.push_back(*receiver_side_.pool->Data(2, page.handle));
    }
    absl::StatusOr<kv::Ticket> ticket = receiver_->Expect(std::move(spec));
    EXPECT_TRUE(ticket.ok()) << ticket.status();

    std::unique_ptr<kv::PageTransport> send_end = network_.NewSendEnd();
    kv::FaultInjectingTransport faulty(*send_end, clock_);
    for (kv::FaultRule& rule : faults) faulty.AddRule(std::move(rule));
    kv::TransferSender sender(faulty, clock_);
    std::vector<kv::SourcePage> sources;
    sent_bytes_ = 0;
    for (const kv::PlannedPage& page : sender_side_.plan) {
      sources.push_back({*sender_side_.pool->Data(1, page.handle), page.descriptor.element});
      sent_bytes_ += page.descriptor.bytes;
    }
    absl::StatusOr<std::unique_ptr<kv::Transfer>> transfer =
        sender.PrepareWithElements(*ticket, std::move(sources));
    EXPECT_TRUE(transfer.ok()) << transfer.status();
    if (!transfer.ok()) return {};
    EXPECT_TRUE((*transfer)->PostAll().ok());
    EXPECT_TRUE((*transfer)->Commit(static_cast<int32_t>(kPrompt), 0).ok());
    for (int i = 0; i < 200; ++i) {
      (void)(*transfer)->Poll();
      receiver_->Progress();
      absl::StatusOr<kv::TransferOutcome> outcome = receiver_->Outcome(ticket->ticket_id);
      if (outcome.ok() && outcome->state != kv::TransferState::kReceiving) return *outcome;
    }
    return {kv::TransferState::kReceiving, absl::DeadlineExceededError("undecided")};
  }

  // The state rebuilt from the receiver's pages.
  engine::ModelState Received(ElementType to) const {
    const PagedState paged(model_->config(), Layout(to), kTotal);
    engine::ModelState state = model_->NewState();
    EXPECT_TRUE(paged.Load(kPrompt, receiver_side_.pages, &state).ok());
    return state;
  }

  uint64_t ReceiverBytes() const {
    uint64_t bytes = 0;
    for (const kv::PlannedPage& page : receiver_side_.plan) bytes += page.descriptor.bytes;
    return bytes;
  }

  std::unique_ptr<engine::Model> model_;
  std::unique_ptr<serving::StateLayout> fp32_;
  std::unique_ptr<serving::StateLayout> bf16_;
  std::vector<kv::LayerAttention> layers_;
  engine::ModelState state_;
  engine::ModelState rounded_;
  SystemClock clock_;
  kv::LoopbackNetwork network_;
  Side sender_side_;
  Side receiver_side_;
  uint64_t sent_bytes_ = 0;
  std::unique_ptr<kv::TransferReceiver> receiver_;
};

// fp32 CPU prefill -> bf16 "CUDA" decode: the receiver narrows, and decoding from its bf16 pages
// (state stored back into them after every step, as a bf16 pool keeps it) gives the logits, bit
// for bit, and so the tokens of decoding the bf16-rounded state.
TEST_F(MixedElementTransferTest, Fp32PrefillIntoBf16PagesDecodesAsTheRoundedState) {
  const kv::TransferOutcome outcome =
      Transfer(ElementType::kFloat32, ElementType::kBfloat16, state_);
  ASSERT_EQ(outcome.state, kv::TransferState::kVerified) << outcome.status;
  EXPECT_EQ(receiver_->stats().bytes_landed, sent_bytes_);  // fp32 on the wire
  EXPECT_LT(ReceiverBytes(), sent_bytes_);
  engine::ModelState received = Received(ElementType::kBfloat16);
  ExpectSameState(rounded_, received);

  const PagedState paged(model_->config(), *bf16_, kTotal);
  engine::ModelState reference = rounded_;
  engine::ModelState unrounded = state_;
  int32_t token = 0;
  bool rounding_mattered = false;
  std::vector<int32_t> pd_tokens;
  std::vector<int32_t> reference_tokens;
  for (int step = 0; step < 12; ++step) {
    const int64_t from = received.position;
    absl::StatusOr<engine::Tensor> a = model_->Forward(&received, {token});
    absl::StatusOr<engine::Tensor> b = model_->Forward(&reference, {token});
    absl::StatusOr<engine::Tensor> c = model_->Forward(&unrounded, {token});
    ASSERT_TRUE(a.ok() && b.ok() && c.ok());
    EXPECT_TRUE(SameBits(*a, *b)) << "logits differ at position " << from;
    rounding_mattered = rounding_mattered || !SameBits(*b, *c);
    // Greedy: the next token is the argmax of the reference's logits.
    const std::vector<float>& logits = b->data;
    token = static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
    reference_tokens.push_back(token);
    pd_tokens.push_back(
        static_cast<int32_t>(std::max_element(a->data.begin(), a->data.end()) - a->data.begin()));
    // The decode side keeps its state in its bf16 pages; the reference rounds the same rows.
    ASSERT_TRUE(paged.Store(received, from, receiver_side_.pages).ok());
    received = model_->NewState();
    ASSERT_TRUE(paged.Load(from + 1, receiver_side_.pages, &received).ok());
    reference = RoundedAsTheCudaEngineStoresIt(std::move(reference));
  }
  EXPECT_EQ(pd_tokens, reference_tokens);
  EXPECT_TRUE(rounding_mattered) << "the bf16 rounding changed no logit: the test proves nothing";
}

// bf16 CUDA prefill -> fp32 CPU decode: half the bytes on the wire, widened exactly.
TEST_F(MixedElementTransferTest, Bf16PagesIntoAnFp32PoolLandExactly) {
  const kv::TransferOutcome outcome =
      Transfer(ElementType::kBfloat16, ElementType::kFloat32, rounded_);
  ASSERT_EQ(outcome.state, kv::TransferState::kVerified) << outcome.status;
  EXPECT_EQ(receiver_->stats().bytes_landed, sent_bytes_);
  EXPECT_LT(sent_bytes_, ReceiverBytes());
  ExpectSameState(rounded_, Received(ElementType::kFloat32));
}

// bf16 -> bf16 (CUDA prefill -> CUDA decode): no conversion, the producer's bytes as they are.
TEST_F(MixedElementTransferTest, Bf16PagesIntoABf16PoolLandAsSent) {
  const kv::TransferOutcome outcome =
      Transfer(ElementType::kBfloat16, ElementType::kBfloat16, rounded_);
  ASSERT_EQ(outcome.state, kv::TransferState::kVerified) << outcome.status;
  EXPECT_EQ(receiver_->stats().bytes_landed, sent_bytes_);
  EXPECT_EQ(sent_bytes_, ReceiverBytes());
  for (size_t slot = 0; slot < sender_side_.plan.size(); ++slot) {
    const auto sent = *sender_side_.pool->Data(1, sender_side_.plan[slot].handle);
    const auto landed = *receiver_side_.pool->Data(2, receiver_side_.plan[slot].handle);
    EXPECT_EQ(std::memcmp(sent.data(), landed.data(), sent.size()), 0) << slot;
  }
  ExpectSameState(rounded_, Received(ElementType::kBfloat16));
}

// A corrupted byte of a bf16 page fails the request with `checksum`, whether the receiver stores
// bf16 (lands as is) or fp32 (converts after the check); the conversion never writes the page.
TEST_F(MixedElementTransferTest, CorruptedBf16PageFailsWithTheChecksumError) {
  for (ElementType to : {ElementType::kBfloat16, ElementType::kFloat32}) {
    SCOPED_TRACE(serving::ElementTypeName(to));
    const kv::TransferOutcome outcome =
        Transfer(ElementType::kBfloat16, to, rounded_,
                 {{.action = kv::FaultRule::Action::kCorruptByte, .slot = 0, .offset = 5}});
    EXPECT_EQ(outcome.state, kv::TransferState::kFailed);
    EXPECT_EQ(kv::GetIsolationError(outcome.status), kv::IsolationError::kChecksum)
        << outcome.status;
    if (to == ElementType::kFloat32) {
      const auto page = *receiver_side_.pool->Data(2, receiver_side_.plan[0].handle);
      uint32_t word;
      std::memcpy(&word, page.data(), sizeof(word));
      EXPECT_EQ(word, serving::kPoisonWord) << "a page that failed its checksum was written";
    }
  }
}

// A header naming another element type than the payload's size fits is a `header` error.
TEST_F(MixedElementTransferTest, AnElementTypeThatDoesNotFitThePayloadIsAHeaderError) {
  const kv::TransferOutcome outcome =
      Transfer(ElementType::kBfloat16, ElementType::kBfloat16, rounded_,
               {{.action = kv::FaultRule::Action::kRewriteHeader,
                 .slot = 0,
                 .rewrite = [](kv::PageHeader& h) { h.element = ElementType::kFloat32; }}});
  EXPECT_EQ(outcome.state, kv::TransferState::kFailed);
  EXPECT_EQ(kv::GetIsolationError(outcome.status), kv::IsolationError::kHeader) << outcome.status;
}

// The prefill worker's own check: a sender page whose size does not match the ticket's page in
// its element type is refused before a byte moves.
TEST(WireBytesTest, ScalesThePageByTheElementSize) {
  const kv::PageDescriptor fp32{.bytes = 4096, .element = ElementType::kFloat32};
  const kv::PageDescriptor bf16{.bytes = 2048, .element = ElementType::kBfloat16};
  EXPECT_EQ(*kv::WireBytes(fp32, ElementType::kBfloat16), 2048u);
  EXPECT_EQ(*kv::WireBytes(fp32, ElementType::kFloat32), 4096u);
  EXPECT_EQ(*kv::WireBytes(bf16, ElementType::kFloat32), 4096u);
  EXPECT_FALSE(
      kv::WireBytes({.bytes = 4094, .element = ElementType::kFloat32}, ElementType::kBfloat16)
          .ok());
  EXPECT_FALSE(kv::WireBytes(fp32, static_cast<ElementType>(7)).ok());
}

TEST(ElementTypeTest, Bf16RoundsToNearestEven) {
  EXPECT_EQ(serving::FloatToBf16(1.0f), 0x3F80);
  // 1 + 2^-8 is halfway between bf16 1.0 and 1.0078125: ties to even (1.0).
  EXPECT_EQ(serving::FloatToBf16(1.00390625f), 0x3F80);
  // 1 + 3 * 2^-8 is halfway between 1.0078125 (odd) and 1.015625 (even): up.
  EXPECT_EQ(serving::FloatToBf16(1.01171875f), 0x3F82);
  EXPECT_EQ(serving::FloatToBf16(-2.0f), 0xC000);
  EXPECT_EQ(serving::Bf16ToFloat(0x3F82), 1.015625f);
  const uint16_t nan = serving::FloatToBf16(std::numeric_limits<float>::quiet_NaN());
  EXPECT_TRUE(std::isnan(serving::Bf16ToFloat(nan)));
}

}  // namespace
}  // namespace pdserve::runtime
