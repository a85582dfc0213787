// Proof of issue 5: a request's tokens through `pdserve prefill` -> UCX -> `pdserve decode` are
// bit-identical (tokens, logprobs, finish reasons) to colocated mode, for 32 prompts x 3 seeds at
// temperature 0.6 and greedy, over UCX tcp and shared memory, with one transfer lane and with
// four; and one page corrupted in flight fails only its own request, with an isolation error and
// no decoded token.
#include <gtest/gtest.h>

#include <cstdint>
#include <map>
#include <vector>

#include "absl/strings/str_cat.h"
#include "tests/pd/pd_cluster.h"

namespace pdserve::pd::testing {
namespace {

namespace v1 = pdserve::worker::v1;

// Prompt lengths: 1; around the sliding window (64) and the CSA compressed page (64 entries x
// rate 4 = 256 tokens): page size - 1, page size, page size + 1; and longer than the window.
const std::vector<int> kPromptLengths = {1,  2,  3,  4,   5,   6,   7,   8,   9,   10, 11,
                                         12, 16, 20, 24,  31,  32,  33,  40,  48,  63, 64,
                                         65, 70, 96, 127, 128, 129, 255, 256, 257, 300};
constexpr uint64_t kCorruptRequest = 900001;

std::vector<RequestSpec> EquivalenceSpecs() {
  std::vector<RequestSpec> specs;
  uint64_t id = 1000;
  for (bool greedy : {false, true}) {
    for (uint64_t seed : {11u, 22u, 33u}) {
      for (size_t p = 0; p < kPromptLengths.size(); ++p) {
        RequestSpec s;
        s.request_id = ++id;
        for (int t = 0; t < kPromptLengths[p]; ++t) {
          s.prompt.push_back(2 + static_cast<int32_t>((p * 131 + t * 17 + t * t) % (kVocab - 2)));
        }
        s.params.temperature = greedy ? 0.0 : 0.6;
        s.params.top_p = 0.95;
        s.params.seed = seed;
        s.params.max_tokens = 4;
        s.params.logprobs = 2;
        s.choice = static_cast<int32_t>(p % 3 == 0 ? 1 : 0);
        specs.push_back(std::move(s));
      }
    }
  }
  return specs;
}

const std::vector<Outcome>& Reference() {
  static const std::vector<Outcome>* reference =
      new std::vector<Outcome>(RunColocated(EquivalenceSpecs()));
  return *reference;
}

void ExpectMatchesColocated(const std::string& tls, int transfer_lanes = 0,
                            const std::string& ucx_protocols = "", bool register_pages = false,
                            bool shm_pull = false) {
  std::vector<RequestSpec> specs = EquivalenceSpecs();
  const std::vector<Outcome>& reference = Reference();
  ASSERT_EQ(reference.size(), specs.size());
  for (const Outcome& r : reference) {
    ASSERT_TRUE(r.error.empty()) << r.error;
    ASSERT_FALSE(r.tokens.empty());
  }
  ClusterOptions options;
  options.ucx_tls = tls;
  options.transfer_lanes = transfer_lanes;
  options.ucx_protocols = ucx_protocols;
  options.register_pages = register_pages;
  options.shm_pull = shm_pull;
  options.prefill_env = {absl::StrCat("PDSERVE_TEST_CORRUPT_REQUEST=", kCorruptRequest)};
  absl::StatusOr<std::unique_ptr<PdCluster>> cluster = PdCluster::Start(options);
  ASSERT_TRUE(cluster.ok()) << cluster.status();

  // The corrupted request runs among the others; only it may fail.
  RequestSpec corrupt = specs[20];
  corrupt.request_id = kCorruptRequest;
  specs.insert(specs.begin() + 40, corrupt);
  std::vector<Outcome> outcomes = (*cluster)->RunAll(specs, 4);
  const Outcome& failed = outcomes[40];
  EXPECT_EQ(failed.finish_reason, "error");
  EXPECT_EQ(failed.isolation_error, v1::ISOLATION_ERROR_CHECKSUM) << failed.error;
  EXPECT_TRUE(failed.tokens.empty());
  outcomes.erase(outcomes.begin() + 40);
  specs.erase(specs.begin() + 40);

  int identical = 0;
  for (size_t i = 0; i < specs.size(); ++i) {
    const Outcome& pd = outcomes[i];
    EXPECT_EQ(pd.prefill_status, "OK") << "request " << specs[i].request_id;
    EXPECT_TRUE(pd.error.empty()) << "request " << specs[i].request_id << ": " << pd.error;
    EXPECT_EQ(pd.tokens, reference[i].tokens)
        << "request " << specs[i].request_id << " prompt " << specs[i].prompt.size();
    EXPECT_EQ(pd.logprob_bits, reference[i].logprob_bits) << "request " << specs[i].request_id;
    EXPECT_EQ(pd.finish_reason, reference[i].finish_reason) << "request " << specs[i].request_id;
    identical += pd.tokens == reference[i].tokens && pd.logprob_bits == reference[i].logprob_bits &&
                 pd.finish_reason == reference[i].finish_reason;
  }
  EXPECT_EQ(identical, 192);

  // Every request leaves the batch, and the corrupted request's failure is counted once. A
  // request's last event reaches its client during the engine step that produced it; the step
  // then ends and the request leaves the batch, so the count is polled (briefly) rather than
  // read once.
  v1::StatsResponse stats;
  const absl::Time until = absl::Now() + absl::Seconds(10);
  do {
    grpc::ClientContext context;
    ASSERT_TRUE((*cluster)->decode().Stats(&context, v1::StatsRequest(), &stats).ok());
    if (stats.running_requests() == 0) break;
    absl::SleepFor(absl::Milliseconds(20));
  } while (absl::Now() < until);
  ASSERT_GT(stats.isolation_errors_size(), v1::ISOLATION_ERROR_CHECKSUM);
  EXPECT_EQ(stats.isolation_errors(v1::ISOLATION_ERROR_CHECKSUM), 1);
  EXPECT_EQ(stats.running_requests(), 0);
  EXPECT_GT(stats.transfer_bytes(), 0);
  // The prefill worker counted the layers of every chunk of every prompt (the router's busy
  // check reads it): at least one chunk of every layer per request.
  v1::StatsResponse prefill_stats;
  grpc::ClientContext prefill_context;
  ASSERT_TRUE(
      (*cluster)->prefill().Stats(&prefill_context, v1::StatsRequest(), &prefill_stats).ok());
  EXPECT_GE(prefill_stats.forward_layers(), static_cast<int64_t>(specs.size()) * 2);
  EXPECT_GE(prefill_stats.prefilled_tokens(), static_cast<int64_t>(specs.size()));
  // Pulled: every transfer but the faulted one, which went by active messages (under v1 its
  // sends complete before the decode worker's checksum fails it, so the prefill worker counts
  // its bytes as sent; under v2 it fails first and counts nowhere); otherwise none.
  if (shm_pull) {
    EXPECT_LE(prefill_stats.transfer_bytes_pulled(), prefill_stats.transfer_bytes());
    EXPECT_GE(prefill_stats.transfer_bytes_pulled(), prefill_stats.transfer_bytes() * 99 / 100);
  } else {
    EXPECT_EQ(prefill_stats.transfer_bytes_pulled(), 0);
  }
}

TEST(PdEquivalenceTest, TcpMatchesColocatedBitForBit) { ExpectMatchesColocated("tcp"); }

// Both workers with 4 transfer lanes (docs/protocol.md, "Lanes"): the same tokens, and the
// corrupted page still fails only its request with the checksum error.
TEST(PdEquivalenceTest, FourLanesMatchColocatedBitForBit) { ExpectMatchesColocated("tcp", 4); }

// Both workers on UCX's v2 protocols (transfer.ucx_protocols: v2; docs/protocol.md, "UCX
// protocols"), over tcp with peer-failure handling as deployed, and over shared memory.
TEST(PdEquivalenceTest, UcxProtocolsV2MatchColocatedBitForBit) {
  ExpectMatchesColocated("tcp", 0, "v2");
  ExpectMatchesColocated("shm,self", 0, "v2");
}

// Both workers with their page pools registered with UCX (transfer.register_pages;
// docs/protocol.md, "Registered page memory"), under v1 (where UCX uses the handles) and v2, 4
// lanes under v2.
// Pages pulled from the prefill worker's shared memory (transfer.shm_pull; docs/protocol.md,
// "Same-host pages by shared memory"), the messages over tcp and shared memory, 4 lanes under
// v2. The corrupted request's transfer goes by active messages (test faults act on page
// messages); every other byte is pulled.
TEST(PdEquivalenceTest, PulledPagesMatchColocatedBitForBit) {
  ExpectMatchesColocated("tcp", 0, "v1", false, true);
  ExpectMatchesColocated("shm,self", 4, "v2", false, true);
}

TEST(PdEquivalenceTest, RegisteredPagesMatchColocatedBitForBit) {
  ExpectMatchesColocated("tcp", 0, "v1", true);
  ExpectMatchesColocated("tcp", 4, "v2", true);
}

// ignore_eos on both workers as in colocated mode: EOS (id 1, forced by logit_bias) is sampled
// and passed over; stop_token_ids still stop, after min_tokens.
TEST(PdEquivalenceTest, IgnoreEosMatchesColocated) {
  constexpr int32_t kEos = 1, kStop = 500;
  std::vector<RequestSpec> specs;
  auto add = [&](bool ignore_eos, std::map<int32_t, double> bias, std::vector<int32_t> stop,
                 int32_t min_tokens) {
    RequestSpec s;
    s.request_id = 5000 + specs.size();
    s.prompt = {5, 6, 7, 8, 9};
    s.params.temperature = 0.6;
    s.params.seed = 3;
    s.params.max_tokens = 4;
    s.params.min_tokens = min_tokens;
    s.params.ignore_eos = ignore_eos;
    s.params.logit_bias = std::move(bias);
    s.params.stop_token_ids = std::move(stop);
    s.params.logprobs = 1;
    specs.push_back(std::move(s));
  };
  add(true, {{kEos, 100.0}}, {}, 0);        // EOS every time, never an end: length
  add(true, {{kStop, 100.0}}, {kStop}, 0);  // the stop id stops at once
  add(true, {{kStop, 100.0}}, {kStop}, 2);  // ... after min_tokens
  add(false, {{kEos, 100.0}}, {}, 0);       // without it EOS stops
  add(true, {{kEos, 100.0}}, {kEos}, 0);    // EOS named in stop_token_ids still stops
  const std::vector<Outcome> reference = RunColocated(specs);
  auto cluster = PdCluster::Start({});
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  const std::vector<Outcome> pd = (*cluster)->RunAll(specs, 2);
  for (size_t i = 0; i < specs.size(); ++i) {
    ASSERT_TRUE(reference[i].error.empty()) << reference[i].error;
    EXPECT_TRUE(pd[i].error.empty()) << i << ": " << pd[i].error;
    EXPECT_EQ(pd[i].tokens, reference[i].tokens) << i;
    EXPECT_EQ(pd[i].logprob_bits, reference[i].logprob_bits) << i;
    EXPECT_EQ(pd[i].finish_reason, reference[i].finish_reason) << i;
  }
  EXPECT_EQ(pd[0].tokens, std::vector<int32_t>(4, kEos));
  EXPECT_EQ(pd[0].finish_reason, "length");
  EXPECT_EQ(pd[1].tokens, std::vector<int32_t>{kStop});
  EXPECT_EQ(pd[1].finish_reason, "stop");
  ASSERT_EQ(pd[2].tokens.size(), 3u);  // min_tokens 2 masks the stop id twice
  EXPECT_EQ(pd[2].tokens[2], kStop);
  EXPECT_EQ(pd[2].finish_reason, "stop");
  EXPECT_EQ(pd[3].tokens, std::vector<int32_t>{kEos});
  EXPECT_EQ(pd[3].finish_reason, "stop");
  EXPECT_EQ(pd[4].tokens, std::vector<int32_t>{kEos});
  EXPECT_EQ(pd[4].finish_reason, "stop");
}

// Issue 9 on the decode worker: with paranoid mode and a canary on every request, intact
// transferred state passes both guards (no false positive) and the tokens stay bit-identical.
TEST(PdEquivalenceTest, ParanoidAndCanaryOnEveryRequestPassIntactState) {
  std::vector<RequestSpec> specs = EquivalenceSpecs();
  specs.resize(kPromptLengths.size());  // the sampled seed-11 requests, every prompt length
  const std::vector<Outcome>& reference = Reference();
  ClusterOptions options;
  options.guards_yaml = "guards:\n  paranoid: true\n  canary_every: 1\n";
  absl::StatusOr<std::unique_ptr<PdCluster>> cluster = PdCluster::Start(options);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  const std::vector<Outcome> outcomes = (*cluster)->RunAll(specs, 4);
  for (size_t i = 0; i < specs.size(); ++i) {
    EXPECT_TRUE(outcomes[i].error.empty())
        << "request " << specs[i].request_id << ": " << outcomes[i].error;
    EXPECT_EQ(outcomes[i], reference[i]) << "request " << specs[i].request_id;
  }
}

TEST(PdEquivalenceTest, SharedMemoryMatchesColocatedBitForBit) {
  ExpectMatchesColocated("shm,self");
}

}  // namespace
}  // namespace pdserve::pd::testing
