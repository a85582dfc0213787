// The decode worker's Reserve against the GPU engine's paged device state pools
// (DecodeWorkerOptions::device_state_tokens, worker key `state_tokens`;
// runtime/device_state_pools.h), on the CPU engine (the pools are counted, nothing holds them) with
// the bundled model and a real UCX receiver: admission, not decoding, is what is checked here; the
// GPU run is tools/gpu/run_admission.sh's PD part.
//
// device_state_tokens 1 on 4 batch slots: each device pool is its 4 slack pages (one a slot, as
// engine::PagedPoolPages sizes it), and a request of 4 + 400 tokens holds 2 pages of the rate-4
// pool (101 entries, 64 a page): two are reserved at once although max_batch allows four, the
// third is RESOURCE_EXHAUSTED (not now: the router waits or asks another decode worker). A
// request larger than a whole device pool (FAILED_PRECONDITION naming state_tokens, the router's
// 400) needs a longer context than this model's 512 tokens: kjv-v4-wide's 4096.
#include <gtest/gtest.h>

#include <memory>
#include <string>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "decode/decode_worker.h"
#include "serving/state_layout.h"

namespace pdserve::decode {
namespace {

namespace v1 = pdserve::worker::v1;

std::unique_ptr<DecodeWorker> NewWorker(std::optional<int64_t> device_state_tokens,
                                        const char* model = "kjv-v4-tiny",
                                        absl::Duration lease = absl::Seconds(30)) {
  DecodeWorkerOptions options;
  options.model_dir = std::string(PDSERVE_SOURCE_DIR) + "/models/" + model;
  options.lease = lease;
  options.max_batch = 4;
  options.device_state_tokens = device_state_tokens;
  auto worker = DecodeWorker::Create(std::move(options));
  EXPECT_TRUE(worker.ok()) << worker.status();
  return worker.ok() ? std::move(*worker) : nullptr;
}

grpc::Status Reserve(DecodeWorker& worker, uint64_t id, int32_t prompt, int32_t max_tokens) {
  v1::ReserveRequest request;
  request.set_request_id(id);
  request.set_prompt_tokens(prompt);
  request.mutable_sampling()->set_max_tokens(max_tokens);
  request.mutable_sampling()->set_temperature(0.6f);
  v1::ReserveResponse response;
  return worker.Reserve(nullptr, &request, &response);
}

TEST(DecodeDevicePagesTest, ReserveCountsTheDevicePoolsPagesNotJustTheBatchSlots) {
  auto worker = NewWorker(1);
  ASSERT_NE(worker, nullptr);
  EXPECT_TRUE(Reserve(*worker, 1000, 4, 400).ok());
  EXPECT_TRUE(Reserve(*worker, 2000, 4, 400).ok());
  const grpc::Status third = Reserve(*worker, 3000, 4, 400);
  EXPECT_EQ(third.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << third.error_message();
  EXPECT_NE(third.error_message().find("device_state_rate4"), std::string::npos)
      << third.error_message();
  // Freed pages make room again: the abort of a reservation whose ticket never left.
  v1::AbortRequest abort;
  abort.set_request_id(1000);
  abort.set_prefill_quiesced(true);
  v1::AbortResponse aborted;
  ASSERT_TRUE(worker->Abort(nullptr, &abort, &aborted).ok());
  EXPECT_TRUE(Reserve(*worker, 4000, 4, 400).ok());
  worker->Stop();
}

// A transfer that never comes (the prefill worker died before its first page): the ticket fails
// at its lease and its device pages go back with its host pages, so a request refused for pages
// is reserved afterwards.
TEST(DecodeDevicePagesTest, AFailedTransfersDevicePagesComeBackAtItsLease) {
  auto worker = NewWorker(1, "kjv-v4-tiny", absl::Milliseconds(300));
  ASSERT_NE(worker, nullptr);
  EXPECT_TRUE(Reserve(*worker, 1000, 4, 400).ok());
  EXPECT_TRUE(Reserve(*worker, 2000, 4, 400).ok());
  grpc::Status later = Reserve(*worker, 3000, 4, 400);
  EXPECT_EQ(later.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << later.error_message();
  const absl::Time until = absl::Now() + absl::Seconds(10);
  while (!later.ok() && absl::Now() < until) {
    absl::SleepFor(absl::Milliseconds(50));
    later = Reserve(*worker, 3000, 4, 400);
  }
  EXPECT_TRUE(later.ok()) << later.error_message();
  worker->Stop();
}

TEST(DecodeDevicePagesTest, WithoutDevicePoolsTheBatchSlotsAloneLimit) {
  auto unbounded = NewWorker(std::nullopt);
  ASSERT_NE(unbounded, nullptr);
  for (uint64_t id : {1000u, 2000u, 3000u, 4000u}) {
    EXPECT_TRUE(Reserve(*unbounded, id, 4, 400).ok()) << id;
  }
  EXPECT_EQ(Reserve(*unbounded, 5000, 4, 400).error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  unbounded->Stop();
}

// kjv-v4-wide (context 4096): state_tokens 1 on 4 slots gives the rate-4 pool its 4 slack pages;
// a request of 4 + 1500 tokens needs 6 (376 entries) and can never be reserved:
// FAILED_PRECONDITION naming state_tokens, which the router answers 400 (router/dispatch.cc,
// ReserveError), with nothing held; one of 4 + 1000 (251 entries, 4 pages) is reserved.
TEST(DecodeDevicePagesTest, ARequestLargerThanAWholeDevicePoolIsRefusedForGood) {
  auto worker = NewWorker(1, "kjv-v4-wide");
  ASSERT_NE(worker, nullptr);
  const grpc::Status never = Reserve(*worker, 1000, 4, 1500);
  EXPECT_EQ(never.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << never.error_message();
  EXPECT_NE(never.error_message().find("need 6 state pages of kind 'device_state_rate4', more "
                                       "than this decode worker's whole pool holds (4; its GPU "
                                       "state pools hold state_tokens 1 tokens)"),
            std::string::npos)
      << never.error_message();
  EXPECT_TRUE(Reserve(*worker, 2000, 4, 1000).ok());
  worker->Stop();
}

// Abort and Reserve refuse fork counts and ids no reservation can have (the breaker's Abort of
// request_id .. + 2^32 - 1 spun the worker for half an hour).
TEST(DecodeDevicePagesTest, AbortAndReserveRefuseImpossibleForkRanges) {
  auto worker = NewWorker(std::nullopt);
  ASSERT_NE(worker, nullptr);
  v1::AbortRequest abort;
  abort.set_request_id(777ull << 32);
  abort.set_choice_count(4294967295u);
  v1::AbortResponse aborted;
  EXPECT_EQ(worker->Abort(nullptr, &abort, &aborted).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  abort.set_choice_count(2);
  abort.set_request_id(UINT64_MAX);  // ids UINT64_MAX and 0: wraps
  EXPECT_EQ(worker->Abort(nullptr, &abort, &aborted).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  abort.set_choice_count(128);
  abort.set_request_id(1000);
  EXPECT_TRUE(worker->Abort(nullptr, &abort, &aborted).ok());
  v1::ReserveRequest reserve;
  reserve.set_request_id(UINT64_MAX);
  reserve.set_prompt_tokens(4);
  reserve.mutable_sampling()->set_max_tokens(8);
  reserve.mutable_sampling()->set_choice_count(64);
  v1::ReserveResponse reserved;
  EXPECT_EQ(worker->Reserve(nullptr, &reserve, &reserved).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  worker->Stop();
}

TEST(DecodeDevicePagesTest, NegativeStateTokensAreRefused) {
  DecodeWorkerOptions options;
  options.model_dir = std::string(PDSERVE_SOURCE_DIR) + "/models/kjv-v4-tiny";
  options.device_state_tokens = -1;
  EXPECT_FALSE(DecodeWorker::Create(std::move(options)).ok());
}

}  // namespace
}  // namespace pdserve::decode
