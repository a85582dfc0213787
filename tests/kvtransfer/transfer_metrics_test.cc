// The transfer metrics (kvtransfer/transfer_metrics.h) after known transfers over the loopback
// transport with a fake clock: exact bytes, seconds and bandwidth per side, failures by cause on
// each side, and an exposition that promtool accepts.
#include "kvtransfer/transfer_metrics.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "kvtransfer/fault_transport.h"
#include "kvtransfer/loopback_transport.h"
#include "kvtransfer/transfer_receiver.h"
#include "kvtransfer/transfer_sender.h"
#include "tests/kvtransfer/test_support.h"

namespace pdserve::kv::testing {
namespace {

constexpr uint32_t kPages = 4;
constexpr uint64_t kPageBytes = 256 << 10;  // By rendezvous on the loopback (>= 8 KiB).

// The value of the series `name`{labels} in Prometheus text `text`; -1 when absent. Label order
// does not matter.
double Value(const std::string& text, const std::string& name,
             const std::map<std::string, std::string>& labels) {
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    if (!absl::StartsWith(line, name + "{")) continue;
    bool all = true;
    for (const auto& [key, value] : labels) {
      all = all && absl::StrContains(line, key + "=\"" + value + "\"");
    }
    if (!all) continue;
    double v = 0;
    if (absl::SimpleAtod(line.substr(line.rfind(' ') + 1), &v)) return v;
  }
  return -1;
}

class TransferMetricsTest : public ::testing::Test {
 protected:
  TransferMetricsTest() {
    send_metrics_ = *TransferMetrics::Create(send_registry_, "send");
    receive_metrics_ = *TransferMetrics::Create(receive_registry_, "receive");
    receiver_ =
        std::make_unique<TransferReceiver>(network_.NewReceiveEnd(),
                                           ReceiverOptions{.lease = absl::Seconds(10),
                                                           .heartbeat_interval = absl::Seconds(1),
                                                           .metrics = receive_metrics_.get(),
                                                           .metrics_path = "loopback"},
                                           clock_, [](uint64_t, uint64_t, const absl::Status&) {});
    pool_.assign(2 * kPages, std::vector<std::byte>(kPageBytes));
    sources_.assign(kPages, std::vector<std::byte>(kPageBytes));
    for (uint32_t slot = 0; slot < kPages; ++slot) FillPattern(sources_[slot], 3, slot);
  }

  Ticket Expect(uint64_t request_id, uint32_t first) {
    auto ticket = receiver_->Expect(SpecOverPool(pool_, request_id, 1, first, kPages, kPageBytes));
    EXPECT_TRUE(ticket.ok()) << ticket.status();
    return *ticket;
  }

  SenderOptions Options() { return {.metrics = send_metrics_.get(), .path = "loopback"}; }

  // Drives `transfer` and the receiver `rounds` times; no time passes.
  absl::StatusOr<bool> Pump(Transfer& transfer, int rounds = 16) {
    absl::StatusOr<bool> polled = false;
    for (int i = 0; i < rounds; ++i) {
      polled = transfer.Poll();
      receiver_->Progress();
      if (!polled.ok()) break;
    }
    return polled;
  }

  std::string SendText() const { return send_registry_.Serialize(); }
  std::string ReceiveText() const { return receive_registry_.Serialize(); }

  FakeClock clock_;
  LoopbackNetwork network_;
  std::unique_ptr<PageTransport> send_end_ = network_.NewSendEnd();
  metrics::Registry send_registry_;
  metrics::Registry receive_registry_;
  std::unique_ptr<TransferMetrics> send_metrics_;
  std::unique_ptr<TransferMetrics> receive_metrics_;
  std::unique_ptr<TransferReceiver> receiver_;
  std::vector<std::vector<std::byte>> pool_;
  std::vector<std::vector<std::byte>> sources_;
};

// 1 MiB in 250 ms on the fake clock: both sides observe exactly 1048576 bytes, 0.25 s and
// 4194304 B/s (in the 8e6 bucket: 1e6, 2e6, 4e6 < 4194304 <= 8e6), labelled path loopback, 1 lane.
TEST_F(TransferMetricsTest, ACompletedTransferIsObservedOnBothSides) {
  const Ticket ticket = Expect(1, 0);
  TransferSender sender(*send_end_, clock_, Options());
  auto transfer = sender.Prepare(ticket, {sources_.begin(), sources_.end()});
  ASSERT_TRUE(transfer.ok());
  ASSERT_TRUE((*transfer)->PostAll().ok());
  ASSERT_TRUE(Pump(**transfer).ok());  // Every page lands at the start time.
  clock_.Advance(absl::Milliseconds(250));
  ASSERT_TRUE((*transfer)->Commit(256, 7).ok());
  absl::StatusOr<bool> delivered = Pump(**transfer);
  ASSERT_TRUE(delivered.ok() && *delivered) << delivered.status();
  ASSERT_TRUE((*transfer)->Release().ok());
  ASSERT_EQ(receiver_->Outcome(ticket.ticket_id)->state, TransferState::kVerified);

  for (const auto& [side, text] :
       {std::pair<std::string, std::string>{"send", SendText()}, {"receive", ReceiveText()}}) {
    const std::map<std::string, std::string> labels = {
        {"side", side}, {"path", "loopback"}, {"lanes", "1"}};
    EXPECT_EQ(Value(text, "pdserve_kv_transfer_bytes_count", labels), 1) << side;
    EXPECT_EQ(Value(text, "pdserve_kv_transfer_bytes_sum", labels), 1048576) << side;
    EXPECT_EQ(Value(text, "pdserve_kv_transfer_seconds_sum", labels), 0.25) << side;
    EXPECT_EQ(Value(text, "pdserve_kv_transfer_bandwidth_bytes_per_second_sum", labels), 4194304)
        << side;
    auto bucket = labels;
    bucket["le"] = "4000000";
    EXPECT_EQ(Value(text, "pdserve_kv_transfer_bandwidth_bytes_per_second_bucket", bucket), 0);
    bucket["le"] = "8000000";
    EXPECT_EQ(Value(text, "pdserve_kv_transfer_bandwidth_bytes_per_second_bucket", bucket), 1);
  }
  // No failure, and every cause is exported at 0 from the start.
  EXPECT_EQ(Value(SendText(), "pdserve_kv_transfer_failures_total",
                  {{"side", "send"}, {"cause", "endpoint_closed"}}),
            0);
  EXPECT_EQ(Value(ReceiveText(), "pdserve_kv_transfer_failures_total",
                  {{"side", "receive"}, {"cause", "checksum"}}),
            0);
}

// A corrupted page: the receiver counts one checksum failure and no completed transfer.
TEST_F(TransferMetricsTest, ACorruptedPageCountsAChecksumFailure) {
  const Ticket ticket = Expect(1, 0);
  FaultInjectingTransport faulty(*send_end_, clock_);
  faulty.AddRule({.action = FaultRule::Action::kCorruptByte, .slot = 2, .offset = 9});
  TransferSender sender(faulty, clock_, Options());
  auto transfer = sender.Prepare(ticket, {sources_.begin(), sources_.end()});
  ASSERT_TRUE(transfer.ok());
  ASSERT_TRUE((*transfer)->PostAll().ok());
  ASSERT_TRUE((*transfer)->Commit(256, 7).ok());
  Pump(**transfer).IgnoreError();
  ASSERT_EQ(receiver_->Outcome(ticket.ticket_id)->state, TransferState::kFailed);
  const std::string text = ReceiveText();
  EXPECT_EQ(Value(text, "pdserve_kv_transfer_failures_total",
                  {{"side", "receive"}, {"cause", "checksum"}}),
            1);
  EXPECT_EQ(Value(text, "pdserve_kv_transfer_bytes_count", {{"side", "receive"}}), -1)
      << "a failed transfer is not a completed one";
}

// The sender's causes: a ticket whose lease passed (timeout), a lost connection
// (endpoint_closed) and a transfer dropped before its commit (abort; the receiver, fenced before
// any commit, counts it abandoned).
TEST_F(TransferMetricsTest, SenderFailuresAreCountedByCause) {
  TransferSender sender(*send_end_, clock_, Options());
  {
    const Ticket ticket = Expect(1, 0);
    auto transfer = sender.Prepare(ticket, {sources_.begin(), sources_.end()});
    ASSERT_TRUE(transfer.ok());
    ASSERT_TRUE((*transfer)->PostLayer(0).ok());
    Pump(**transfer).IgnoreError();
  }  // Destroyed before its commit: fences.
  for (int i = 0; i < 4; ++i) receiver_->Progress();
  {
    const Ticket ticket = Expect(2, kPages);
    FaultInjectingTransport faulty(*send_end_, clock_);
    faulty.AddRule({.action = FaultRule::Action::kDisconnect});
    TransferSender cut(faulty, clock_, Options());
    auto transfer = cut.Prepare(ticket, {sources_.begin(), sources_.end()});
    ASSERT_TRUE(transfer.ok());
    ASSERT_TRUE((*transfer)->PostAll().ok());
    EXPECT_EQ(Pump(**transfer).status().code(), absl::StatusCode::kUnavailable);
  }
  Ticket late = Expect(3, 0);
  late.lease_deadline = clock_.Now() - absl::Seconds(1);
  EXPECT_EQ(sender.Prepare(late, {sources_.begin(), sources_.end()}).status().code(),
            absl::StatusCode::kDeadlineExceeded);

  const std::string text = SendText();
  for (const auto& [cause, count] : std::map<std::string, double>{{"abort", 1},
                                                                  {"endpoint_closed", 1},
                                                                  {"timeout", 1},
                                                                  {"connect", 0},
                                                                  {"rejected", 0},
                                                                  {"send_error", 0}}) {
    EXPECT_EQ(
        Value(text, "pdserve_kv_transfer_failures_total", {{"side", "send"}, {"cause", cause}}),
        count)
        << cause;
  }
  EXPECT_EQ(Value(ReceiveText(), "pdserve_kv_transfer_failures_total",
                  {{"side", "receive"}, {"cause", "abandoned"}}),
            1);
}

TEST_F(TransferMetricsTest, ExpositionPassesPromtool) {
  const std::string promtool = PDSERVE_PROMTOOL;
  if (promtool.empty() || promtool.find("NOTFOUND") != std::string::npos ||
      access(promtool.c_str(), X_OK) != 0) {
    GTEST_SKIP() << "promtool not installed (Debian package prometheus)";
  }
  send_metrics_->RecordTransfer("host", 4, 1 << 20, absl::Milliseconds(3));
  receive_metrics_->RecordTransfer("host-staged", 2, 1 << 20, absl::Milliseconds(4));
  receive_metrics_->RecordFailure("checksum");
  for (const std::string& text : {SendText(), ReceiveText()}) {
    const std::string path = ::testing::TempDir() + "/kv_transfer_metrics.prom";
    std::ofstream(path) << text;
    const std::string cmd = promtool + " check metrics < " + path + " 2>&1";
    FILE* p = popen(cmd.c_str(), "r");
    ASSERT_NE(p, nullptr);
    std::string output;
    char buf[256];
    while (fgets(buf, sizeof(buf), p)) output += buf;
    EXPECT_EQ(pclose(p), 0) << output;
    EXPECT_EQ(output, "") << output;
  }
}

TEST(TransferMetricsCauseTest, SendCausesFollowTheStatusCode) {
  EXPECT_EQ(SendFailureCause(absl::UnavailableError("x")), "endpoint_closed");
  EXPECT_EQ(SendFailureCause(absl::DeadlineExceededError("x")), "timeout");
  EXPECT_EQ(SendFailureCause(absl::CancelledError("x")), "rejected");
  EXPECT_EQ(SendFailureCause(absl::InternalError("x")), "send_error");
}

}  // namespace
}  // namespace pdserve::kv::testing
