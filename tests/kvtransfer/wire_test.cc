// Wire formats and status adapters: page header, ticket, control messages, isolation errors.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include "kvtransfer/isolation_error.h"
#include "kvtransfer/page_header.h"
#include "kvtransfer/ticket.h"
#include "kvtransfer/ucx/ucs_status.h"
#include "kvtransfer/ucx/ucx.h"
#include "xxhash.h"

namespace pdserve::kv {
namespace {

PageHeader SampleHeader() {
  return {.request_id = 0x1122334455667788ull,
          .ticket_id = 42,
          .epoch = 7,
          .slot = 3,
          .layer = 2,
          .page_index = 1,
          .token_begin = 256,
          .token_end = 512,
          .payload_xxh3 = 0xDEADBEEFCAFEF00Dull};
}

TEST(PageHeaderTest, RoundTripsEveryField) {
  const auto bytes = EncodePageHeader(SampleHeader());
  auto decoded = DecodePageHeader(bytes);
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_EQ(*decoded, SampleHeader());
}

TEST(PageHeaderTest, LayoutIsLittleEndianAtDocumentedOffsets) {
  const auto bytes = EncodePageHeader(SampleHeader());
  EXPECT_EQ(LoadLe(bytes, 0, 4), kWireMagic);
  EXPECT_EQ(static_cast<char>(bytes[0]), 'P');
  EXPECT_EQ(LoadLe(bytes, 8, 8), 0x1122334455667788ull);
  EXPECT_EQ(static_cast<uint8_t>(bytes[8]), 0x88);
  EXPECT_EQ(LoadLe(bytes, 32, 4), 3u);
  EXPECT_EQ(LoadLe(bytes, 56, 8), 0xDEADBEEFCAFEF00Dull);
}

TEST(PageHeaderTest, RejectsForeignBytes) {
  auto bytes = EncodePageHeader(SampleHeader());
  bytes[0] = std::byte{'X'};
  EXPECT_EQ(DecodePageHeader(bytes).status().code(), absl::StatusCode::kInvalidArgument);
  bytes = EncodePageHeader(SampleHeader());
  bytes[54] = std::byte{1};  // Reserved.
  EXPECT_EQ(DecodePageHeader(bytes).status().code(), absl::StatusCode::kInvalidArgument);
  bytes = EncodePageHeader(SampleHeader());
  bytes[52] = std::byte{2};  // No such element type.
  EXPECT_EQ(DecodePageHeader(bytes).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(DecodePageHeader(std::span(bytes).first(63)).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// The element type sits in the former reserved word's low half; fp32 is 0, so an fp32 page's
// header is byte for byte what it was before element types existed.
TEST(PageHeaderTest, ElementTypeIsAtOffset52AndFp32EncodesAsZero) {
  PageHeader header = SampleHeader();
  EXPECT_EQ(LoadLe(EncodePageHeader(header), 52, 4), 0u);
  header.element = serving::ElementType::kBfloat16;
  const auto bytes = EncodePageHeader(header);
  EXPECT_EQ(LoadLe(bytes, 52, 2), 1u);
  EXPECT_EQ(LoadLe(bytes, 54, 2), 0u);
  auto decoded = DecodePageHeader(bytes);
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_EQ(decoded->element, serving::ElementType::kBfloat16);
}

TEST(PageHeaderTest, ChecksumIsXxh3OfThePayload) {
  std::vector<std::byte> payload(1000);
  for (size_t i = 0; i < payload.size(); ++i) payload[i] = static_cast<std::byte>(i * 7);
  EXPECT_EQ(PayloadChecksum(payload), XXH3_64bits(payload.data(), payload.size()));
  const uint64_t before = PayloadChecksum(payload);
  payload[500] ^= std::byte{1};
  EXPECT_NE(PayloadChecksum(payload), before);
}

// PayloadChecksum may take a vectorized path; every size class of XXH3 (short inputs, 129-240
// bytes, the striped loop and its tail) must still give libxxhash's reference value.
TEST(PageHeaderTest, ChecksumEqualsReferenceXxh3AtEverySizeClass) {
  std::vector<std::byte> buffer((1 << 20) + 64);
  for (size_t i = 0; i < buffer.size(); ++i) buffer[i] = static_cast<std::byte>(i * 131 + 7);
  for (size_t size :
       {size_t{0}, size_t{1}, size_t{3}, size_t{16}, size_t{17}, size_t{128}, size_t{129},
        size_t{240}, size_t{241}, size_t{1024}, size_t{4095}, size_t{65536 + 7}, size_t{1} << 20}) {
    for (size_t offset : {size_t{0}, size_t{1}, size_t{63}}) {
      const std::span<const std::byte> payload = std::span(buffer).subspan(offset, size);
      EXPECT_EQ(PayloadChecksum(payload), XXH3_64bits(payload.data(), payload.size()))
          << "size " << size << " offset " << offset;
    }
  }
}

TEST(TicketTest, RoundTripsEveryField) {
  Ticket ticket{
      .ticket_id = 9,
      .epoch = 77,
      .request_id = 5,
      .worker_address = {std::byte{1}, std::byte{2}, std::byte{3}},
      .receiver_incarnation = 1234,
      .pages = {{.layer = 0, .page_index = 0, .token_begin = 0, .token_end = 64, .bytes = 4096},
                {.layer = 1,
                 .page_index = 2,
                 .token_begin = 128,
                 .token_end = 192,
                 .bytes = 100,
                 .element = serving::ElementType::kBfloat16}},
      .lease_deadline = absl::FromUnixMicros(1'700'000'000'123'456),
      .heartbeat_interval = absl::Milliseconds(250)};
  auto decoded = DecodeTicket(EncodeTicket(ticket));
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_EQ(*decoded, ticket);
  EXPECT_EQ(ticket.total_bytes(), 4196u);
}

TEST(TicketTest, RejectsTruncatedBytes) {
  Ticket ticket{.ticket_id = 1, .pages = {{.bytes = 8}}};
  std::vector<std::byte> bytes = EncodeTicket(ticket);
  bytes.pop_back();
  EXPECT_EQ(DecodeTicket(bytes).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(ControlMessageTest, CommitRoundTripsWithDigests) {
  ControlMessage commit{.kind = WireKind::kCommit,
                        .request_id = 3,
                        .ticket_id = 4,
                        .epoch = 5,
                        .pages_sent = 6,
                        .prompt_tokens = 700,
                        .first_token = 12345,
                        .layer_digests = {1, 2, 0xFFFFFFFFFFFFFFFFull}};
  auto decoded = DecodeControl(EncodeControl(commit));
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_EQ(*decoded, commit);
}

// A shared prefill's commit (n > 1 choices) carries the other choices' first tokens after the
// digests; an n = 1 commit's bytes are exactly the old layout (48 + 8 per digest).
TEST(ControlMessageTest, SharedPrefillCommitCarriesTheOtherFirstTokens) {
  ControlMessage commit{.kind = WireKind::kCommit,
                        .request_id = 3,
                        .prompt_tokens = 290,
                        .first_token = 7,
                        .layer_digests = {9, 10}};
  EXPECT_EQ(EncodeControl(commit).size(), 48u + 16u);
  commit.more_first_tokens = {11, 0, 4095};
  const std::vector<std::byte> bytes = EncodeControl(commit);
  EXPECT_EQ(bytes.size(), 48u + 16u + 4u + 12u);
  auto decoded = DecodeControl(bytes);
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_EQ(*decoded, commit);
  // A cut token, a count that does not match, or a trailing stub is malformed.
  for (size_t cut : {1u, 4u, 14u}) {
    std::vector<std::byte> broken(bytes.begin(), bytes.end() - static_cast<std::ptrdiff_t>(cut));
    EXPECT_EQ(DecodeControl(broken).status().code(), absl::StatusCode::kInvalidArgument) << cut;
  }
  std::vector<std::byte> zero_count(bytes.begin(), bytes.begin() + 48 + 16);
  zero_count.resize(zero_count.size() + 4, std::byte{0});
  EXPECT_EQ(DecodeControl(zero_count).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(ControlMessageTest, RejectsAPageKind) {
  ControlMessage message{.kind = WireKind::kPage};
  EXPECT_EQ(DecodeControl(EncodeControl(message)).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(ControlMessageTest, LayerDigestDependsOnOrder) {
  const std::vector<uint64_t> a = {1, 2};
  const std::vector<uint64_t> b = {2, 1};
  EXPECT_NE(LayerDigest(a), LayerDigest(b));
}

TEST(IsolationErrorTest, KindSurvivesInTheStatus) {
  for (IsolationError kind :
       {IsolationError::kChecksum, IsolationError::kHeader, IsolationError::kEpoch,
        IsolationError::kLease, IsolationError::kDuplicate, IsolationError::kMissing}) {
    const absl::Status status = MakeIsolationError(kind, "detail");
    EXPECT_EQ(GetIsolationError(status), kind);
    EXPECT_NE(status.message().find(IsolationErrorName(kind)), absl::string_view::npos);
  }
  EXPECT_EQ(GetIsolationError(absl::InternalError("x")), std::nullopt);
  EXPECT_EQ(MakeIsolationError(IsolationError::kLease, "x").code(),
            absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(MakeIsolationError(IsolationError::kChecksum, "x").code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST(UcsStatusTest, PeerLossIsUnavailableAndNamesTheCall) {
  const absl::Status status = UcsToStatus(UCS_ERR_CONNECTION_RESET, "page send");
  EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(status.message().find("page send"), absl::string_view::npos);
  EXPECT_TRUE(UcsToStatus(UCS_OK, "x").ok());
  EXPECT_EQ(UcsToStatus(UCS_ERR_CANCELED, "x").code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(UcsToStatus(UCS_ERR_ENDPOINT_TIMEOUT, "x").code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(UcsToStatus(UCS_ERR_NO_MEMORY, "x").code(), absl::StatusCode::kResourceExhausted);
}

// A ticket's worker address is checked before UCX parses it: UCX aborts the process on an
// unknown address version (a breaker's ticket of 0xaa bytes crashed the prefill worker).
TEST(UcxAddressTest, UnknownVersionOrShortAddressIsRefusedBeforeUcxSeesIt) {
  absl::StatusOr<UcxContext> context = UcxContext::Create();
  ASSERT_TRUE(context.ok()) << context.status();
  absl::StatusOr<UcxWorker> worker = UcxWorker::Create(*context);
  ASSERT_TRUE(worker.ok()) << worker.status();
  const std::vector<std::byte>& own = worker->address();
  EXPECT_TRUE(CheckPeerAddress(own).ok());
  auto connected = UcxEndpoint::Create(*worker, own, /*detect_peer_failure=*/false, nullptr);
  EXPECT_TRUE(connected.ok()) << connected.status();

  const std::vector<std::byte> garbage(own.size(), std::byte{0xaa});
  auto refused = UcxEndpoint::Create(*worker, garbage, false, nullptr);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find("format version 10"), absl::string_view::npos)
      << refused.status();

  std::vector<std::byte> other_version = own;
  other_version[0] = (other_version[0] & std::byte{0xF0}) | std::byte{0x07};
  EXPECT_EQ(CheckPeerAddress(other_version).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CheckPeerAddress(std::span<const std::byte>(own.data(), 8)).code(),
            absl::StatusCode::kInvalidArgument);
}

// A decode worker killed while a prefill worker still held its ticket: connecting to its address
// must say "peer gone" (Unavailable: the router retries, else answers 503), not Internal (a 500
// "prefill_failed" that blamed the prefill worker). The peer here is a child process that
// publishes its worker address and dies without cleaning up, as kill -9 does; over shared
// memory ucp_ep_create then fails with UCS_ERR_SHMEM_SEGMENT (the dead peer's segment is gone).
TEST(UcxAddressTest, ConnectingToAKilledPeerIsUnavailable) {
  EXPECT_EQ(UcsToStatus(UCS_ERR_SHMEM_SEGMENT, "ucp_ep_create").code(),
            absl::StatusCode::kUnavailable);
  int fds[2];
  ASSERT_EQ(pipe(fds), 0);
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    close(fds[0]);
    absl::StatusOr<UcxContext> peer_context = UcxContext::Create();
    if (!peer_context.ok()) _exit(1);
    absl::StatusOr<UcxWorker> peer = UcxWorker::Create(*peer_context);
    if (!peer.ok()) _exit(1);
    const std::vector<std::byte>& address = peer->address();
    const ssize_t size = static_cast<ssize_t>(address.size());
    if (write(fds[1], address.data(), address.size()) != size) _exit(1);
    _exit(0);  // no ucp_worker_destroy / ucp_cleanup: as if killed
  }
  close(fds[1]);
  std::vector<std::byte> address;
  std::byte buffer[4096];
  for (ssize_t got; (got = read(fds[0], buffer, sizeof(buffer))) > 0;) {
    address.insert(address.end(), buffer, buffer + got);
  }
  close(fds[0]);
  int wait_status = 0;
  ASSERT_EQ(waitpid(child, &wait_status, 0), child);
  ASSERT_TRUE(WIFEXITED(wait_status) && WEXITSTATUS(wait_status) == 0);
  ASSERT_FALSE(address.empty());

  absl::StatusOr<UcxContext> context = UcxContext::Create();
  ASSERT_TRUE(context.ok()) << context.status();
  absl::StatusOr<UcxWorker> worker = UcxWorker::Create(*context);
  ASSERT_TRUE(worker.ok()) << worker.status();
  // Without peer failure detection: UcxTransport::Connect's fallback, the path shared memory
  // takes (with detection UCX answers UCS_ERR_UNREACHABLE, already Unavailable).
  auto connected = UcxEndpoint::Create(*worker, address, /*detect_peer_failure=*/false, nullptr);
  // Where UCX creates the endpoint anyway (tcp alone), the loss shows later, in the error
  // handler; a failure here must be Unavailable whatever the transport.
  if (!connected.ok()) {
    EXPECT_EQ(connected.status().code(), absl::StatusCode::kUnavailable) << connected.status();
  }
}

}  // namespace
}  // namespace pdserve::kv
