// Tickets, commits and isolation errors survive the trip through pdserve.worker.v1 messages.
#include "kvtransfer/ticket_proto.h"

#include <gtest/gtest.h>

#include <string>

namespace pdserve::kv {
namespace {

namespace v1 = pdserve::worker::v1;

TEST(TicketProtoTest, TicketRoundTripsThroughTheProto) {
  const Ticket ticket{
      .ticket_id = 3,
      .epoch = 4,
      .request_id = 5,
      .worker_address = {std::byte{0}, std::byte{0xFF}, std::byte{7}},
      .receiver_incarnation = 6,
      .pages = {{.layer = 0, .page_index = 0, .token_begin = 0, .token_end = 128, .bytes = 131072},
                {.layer = 1,
                 .page_index = 2,
                 .token_begin = 512,
                 .token_end = 768,
                 .bytes = 65536,
                 .element = serving::ElementType::kBfloat16}},
      .lease_deadline = absl::FromUnixMillis(1'800'000'000'123),
      .heartbeat_interval = absl::Milliseconds(500)};
  const absl::Time now = absl::FromUnixMillis(1'799'999'990'000);
  const v1::TransferTicket proto = TicketToProto(ticket, now);
  EXPECT_EQ(proto.pages(1).slot(), 1u);
  EXPECT_EQ(proto.pages(0).element(), 0u);  // fp32: the field's default
  EXPECT_EQ(proto.pages(1).element(), 1u);
  auto back = TicketFromProto(proto, now);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(*back, ticket);
}

// The lease travels as the time left, read against the reading worker's own clock: a prefill
// host whose wall clock runs 40 s ahead of the decode host's still gets the whole 30 s lease
// (it read every ticket as already over), and one 1 h behind does not get 1 h more.
TEST(TicketProtoTest, TheLeaseIsTheTimeLeftOnTheReadersClock) {
  const absl::Time decode_now = absl::FromUnixMillis(1'800'000'000'000);
  const Ticket ticket{.ticket_id = 1,
                      .epoch = 1,
                      .request_id = 2,
                      .lease_deadline = decode_now + absl::Seconds(30),
                      .heartbeat_interval = absl::Milliseconds(500)};
  const v1::TransferTicket proto = TicketToProto(ticket, decode_now);
  EXPECT_EQ(proto.lease_remaining_ms(), 30000);
  EXPECT_EQ(proto.lease_deadline_unix_ms(), 1'800'000'030'000);
  for (const absl::Duration skew : {absl::Seconds(40), -absl::Hours(1), absl::ZeroDuration()}) {
    const absl::Time prefill_now = decode_now + skew;
    auto read = TicketFromProto(proto, prefill_now);
    ASSERT_TRUE(read.ok()) << read.status();
    EXPECT_EQ(read->lease_deadline, prefill_now + absl::Seconds(30)) << skew;
  }
}

// A decode worker that predates lease_remaining_ms states only the deadline: that is used.
TEST(TicketProtoTest, ATicketWithoutTheLeaseLeftUsesItsDeadline) {
  v1::TransferTicket proto;
  proto.set_lease_deadline_unix_ms(1'800'000'030'000);
  auto read = TicketFromProto(proto, absl::FromUnixMillis(1'800'000'000'000));
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(read->lease_deadline, absl::FromUnixMillis(1'800'000'030'000));
}

TEST(TicketProtoTest, RejectsASlotOutOfPlace) {
  v1::TransferTicket proto;
  proto.add_pages()->set_slot(1);
  EXPECT_EQ(TicketFromProto(proto, absl::UnixEpoch()).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(TicketProtoTest, AMalformedShmPullOfferNamesItsField) {
  const auto error = [](auto mutate) {
    v1::TransferTicket proto;
    proto.mutable_shm_pull()->set_token(std::string(16, 'x'));
    mutate(proto.mutable_shm_pull());
    const absl::Status status = TicketFromProto(proto, absl::UnixEpoch()).status();
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
    return std::string(status.message());
  };
  EXPECT_EQ(error([](v1::ShmPullOffer* o) { o->set_token("abc"); }),
            "ticket's shm_pull offer: token of 3 bytes (16 expected)");
  EXPECT_EQ(error([](v1::ShmPullOffer* o) { o->set_boot_id(std::string(65, 'b')); }),
            "ticket's shm_pull offer: boot id of 65 bytes (at most 64)");
  EXPECT_EQ(error([](v1::ShmPullOffer* o) { o->set_device_pci_bus_id(std::string(5000, 'A')); }),
            "ticket's shm_pull offer: PCI bus id of 5000 bytes (at most 31)");
  v1::TransferTicket fine;
  fine.mutable_shm_pull()->set_token(std::string(16, 'x'));
  fine.mutable_shm_pull()->set_device_pci_bus_id("0000:19:00.0");
  EXPECT_TRUE(TicketFromProto(fine, absl::UnixEpoch()).ok());
}

TEST(TicketProtoTest, CommitCarriesDigestsAndFirstToken) {
  const v1::TransferCommit proto = CommitToProto({.kind = WireKind::kCommit,
                                                  .ticket_id = 1,
                                                  .epoch = 2,
                                                  .pages_sent = 3,
                                                  .prompt_tokens = 40,
                                                  .first_token = 99,
                                                  .layer_digests = {10, 20}});
  EXPECT_EQ(proto.first_token(), 99);
  EXPECT_EQ(proto.prompt_tokens(), 40);
  ASSERT_EQ(proto.layer_digests_size(), 2);
  EXPECT_EQ(proto.layer_digests(1), 20u);
}

TEST(TicketProtoTest, IsolationErrorKindsMapOneToOne) {
  EXPECT_EQ(IsolationErrorToProto(MakeIsolationError(IsolationError::kChecksum, "x")),
            v1::ISOLATION_ERROR_CHECKSUM);
  EXPECT_EQ(IsolationErrorToProto(MakeIsolationError(IsolationError::kMissing, "x")),
            v1::ISOLATION_ERROR_MISSING);
  EXPECT_EQ(IsolationErrorToProto(MakeIsolationError(IsolationError::kLease, "x")),
            v1::ISOLATION_ERROR_LEASE);
  EXPECT_EQ(IsolationErrorToProto(absl::UnavailableError("x")), v1::ISOLATION_ERROR_UNSPECIFIED);
}

}  // namespace
}  // namespace pdserve::kv
