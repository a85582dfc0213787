// UcxMemory (kvtransfer/ucx/ucx.h): memory registered with UCX or allocated by it names where it
// starts, and a peer reads it through a remote key with ucp_get_nbx byte for byte, at the
// offset it asks for (what kv_transfer_bench's get modes rely on; docs/perf.md, "A
// receiver-pulled data path"). Two workers of one context stand for the two processes; over
// shared memory a get from UCX-allocated memory is a copy from the sysv / posix segment. And
// UcxRegistrations finds the one registration that holds a page.
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "kvtransfer/ucx/ucs_status.h"
#include "kvtransfer/ucx/ucx.h"

namespace pdserve::kv::testing {
namespace {

constexpr size_t kBytes = size_t{1} << 20;

std::byte PatternByte(size_t i) { return static_cast<std::byte>((i * 131 + 7) & 0xFF); }

class UcxMemoryTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override { setenv("UCX_TLS", GetParam().c_str(), 1); }
  void TearDown() override { unsetenv("UCX_TLS"); }
};

// Reads `bytes` at `remote_address` of `owner`'s memory from `reader`'s endpoint into `out`,
// progressing both workers (an emulated get, over tcp, needs the owner's progress).
absl::Status Get(UcxWorker& reader, UcxWorker& owner, const UcxEndpoint& endpoint,
                 const UcxRemoteKey& rkey, uint64_t remote_address, std::span<std::byte> out) {
  ucp_request_param_t param{};
  ucs_status_ptr_t request =
      ucp_get_nbx(endpoint.get(), out.data(), out.size(), remote_address, rkey.get(), &param);
  if (request == nullptr) return absl::OkStatus();
  if (UCS_PTR_IS_ERR(request)) return UcsToStatus(UCS_PTR_STATUS(request), "ucp_get_nbx");
  ucs_status_t status;
  while ((status = ucp_request_check_status(request)) == UCS_INPROGRESS) {
    reader.Progress();
    owner.Progress();
  }
  ucp_request_free(request);
  return UcsToStatus(status, "get");
}

void ExpectReadableByPeer(const UcxContext& context, UcxWorker& owner, const UcxMemory& memory) {
  auto reader = UcxWorker::Create(context);
  ASSERT_TRUE(reader.ok()) << reader.status();
  auto endpoint = UcxEndpoint::Create(*reader, owner.address(), false, nullptr);
  ASSERT_TRUE(endpoint.ok()) << endpoint.status();
  auto packed = memory.PackRemoteKey();
  ASSERT_TRUE(packed.ok()) << packed.status();
  auto rkey = UcxRemoteKey::Unpack(**endpoint, *packed);
  ASSERT_TRUE(rkey.ok()) << rkey.status();
  // The whole range, then 64 KiB from an odd offset (the address arithmetic of a page's get).
  std::vector<std::byte> whole(kBytes);
  const uint64_t base = reinterpret_cast<uint64_t>(memory.data());
  ASSERT_TRUE(Get(*reader, owner, **endpoint, *rkey, base, whole).ok());
  for (size_t i = 0; i < kBytes; ++i) ASSERT_EQ(whole[i], PatternByte(i)) << "byte " << i;
  constexpr size_t kOffset = 3 * 65536 + 17;
  std::vector<std::byte> page(65536);
  ASSERT_TRUE(Get(*reader, owner, **endpoint, *rkey, base + kOffset, page).ok());
  for (size_t i = 0; i < page.size(); ++i) {
    ASSERT_EQ(page[i], PatternByte(kOffset + i)) << "byte " << i;
  }
}

TEST_P(UcxMemoryTest, AllocatedMemoryIsReadByAPeersGet) {
  auto context = UcxContext::Create();
  ASSERT_TRUE(context.ok()) << context.status();
  auto owner = UcxWorker::Create(*context);
  ASSERT_TRUE(owner.ok()) << owner.status();
  auto memory = UcxMemory::Allocate(*context, kBytes);
  ASSERT_TRUE(memory.ok()) << memory.status();
  ASSERT_NE(memory->data(), nullptr);
  for (size_t i = 0; i < kBytes; ++i) memory->data()[i] = PatternByte(i);
  ExpectReadableByPeer(*context, *owner, *memory);
}

TEST_P(UcxMemoryTest, RegisteredMemoryIsReadByAPeersGet) {
  auto context = UcxContext::Create();
  ASSERT_TRUE(context.ok()) << context.status();
  auto owner = UcxWorker::Create(*context);
  ASSERT_TRUE(owner.ok()) << owner.status();
  std::vector<std::byte> bytes(kBytes);
  for (size_t i = 0; i < kBytes; ++i) bytes[i] = PatternByte(i);
  auto memory = UcxMemory::Register(*context, bytes.data(), bytes.size());
  ASSERT_TRUE(memory.ok()) << memory.status();
  EXPECT_EQ(memory->data(), bytes.data());
  ExpectReadableByPeer(*context, *owner, *memory);
}

TEST_P(UcxMemoryTest, AMoveHandsOverTheAddress) {
  auto context = UcxContext::Create();
  ASSERT_TRUE(context.ok()) << context.status();
  auto memory = UcxMemory::Allocate(*context, 4096);
  ASSERT_TRUE(memory.ok()) << memory.status();
  std::byte* const data = memory->data();
  UcxMemory moved = std::move(*memory);
  EXPECT_EQ(moved.data(), data);
  EXPECT_EQ(memory->data(), nullptr);
  EXPECT_EQ(memory->get(), nullptr);
}

// UcxRegistrations (docs/protocol.md, "Registered page memory"): a page inside a registered block
// gets that block's handle, one outside every block or straddling a block's end gets none, so a
// send never passes a handle that does not cover its bytes (UCX refuses a mismatched one).
TEST_P(UcxMemoryTest, RegistrationsFindOnlyRangesInsideABlock) {
  auto context = UcxContext::Create();
  ASSERT_TRUE(context.ok()) << context.status();
  std::vector<std::byte> first(kBytes);
  std::vector<std::byte> second(kBytes);
  UcxRegistrations registrations;
  EXPECT_EQ(registrations.Find(first.data(), 4096), nullptr);
  ASSERT_TRUE(registrations.Add(*context, first).ok());
  ASSERT_TRUE(registrations.Add(*context, second).ok());
  EXPECT_EQ(registrations.size(), 2u);
  const ucp_mem_h a = registrations.Find(first.data(), kBytes);
  const ucp_mem_h b = registrations.Find(second.data(), 4096);
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  EXPECT_NE(a, b);
  EXPECT_EQ(registrations.Find(first.data() + 65536, 65536), a);
  EXPECT_EQ(registrations.Find(first.data() + kBytes - 4096, 4096), a);
  EXPECT_EQ(registrations.Find(first.data() + kBytes - 4096, 4097), nullptr);
  EXPECT_EQ(registrations.Find(first.data() + kBytes + 1, 1), nullptr);
  std::vector<std::byte> elsewhere(4096);
  EXPECT_EQ(registrations.Find(elsewhere.data(), elsewhere.size()), nullptr);
  EXPECT_EQ(registrations.Add(*context, std::span<const std::byte>()).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(registrations.size(), 2u);
}

std::string TransportName(const ::testing::TestParamInfo<std::string>& param) {
  return param.param == "tcp" ? "tcp" : "shm";
}

INSTANTIATE_TEST_SUITE_P(Transports, UcxMemoryTest, ::testing::Values("shm,self", "tcp"),
                         TransportName);

}  // namespace
}  // namespace pdserve::kv::testing
