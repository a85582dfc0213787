#include "tests/pd/pd_cluster.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <deque>
#include <fstream>
#include <mutex>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "engine/model.h"
#include "router/convert.h"
#include "runtime/paged_state.h"
#include "runtime/step_runner.h"
#include "serving/generation_config.h"
#include "serving/scheduler.h"
#include "worker/wire.h"

namespace pdserve::pd::testing {
namespace v1 = pdserve::worker::v1;

namespace {

uint32_t Bits(float f) {
  uint32_t u = 0;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

void AppendLogprobs(const v1::SampledToken& token, std::vector<uint32_t>* bits) {
  bits->push_back(Bits(token.logprob()));
  for (const v1::TokenLogprob& top : token.top_logprobs()) {
    bits->push_back(static_cast<uint32_t>(top.token_id()));
    bits->push_back(Bits(top.logprob()));
  }
}

// Starts `pdserve ROLE` and returns it with the port it printed.
absl::StatusOr<std::pair<std::unique_ptr<kv::testing::PeerProcess>, int>> StartWorker(
    const std::string& role, const std::string& config, std::vector<std::string> extra_args,
    const std::vector<std::string>& env) {
  std::vector<std::string> argv = {PDSERVE_BINARY, role, "--config",       config,
                                   "--port",       "0",  "--metrics-port", "0"};
  argv.insert(argv.end(), extra_args.begin(), extra_args.end());
  absl::StatusOr<std::unique_ptr<kv::testing::PeerProcess>> process =
      kv::testing::PeerProcess::Start(argv, env);
  if (!process.ok()) return process.status();
  absl::StatusOr<std::string> line = (*process)->ReadLine(absl::Seconds(60));
  if (!line.ok()) return line.status();
  const size_t colon = line->rfind(':');
  int port = 0;
  if (!absl::StartsWith(*line, "pdserve " + role + ": serving on ") || colon == std::string::npos ||
      !absl::SimpleAtoi(line->substr(colon + 1), &port)) {
    return absl::InternalError("unexpected first line: " + *line);
  }
  return std::make_pair(std::move(*process), port);
}

template <typename Stub>
absl::Status WaitServing(Stub& stub) {
  const absl::Time until = absl::Now() + absl::Seconds(30);
  while (absl::Now() < until) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
    v1::HealthResponse health;
    if (stub.Health(&context, v1::HealthRequest(), &health).ok() &&
        health.state() == v1::HealthResponse::STATE_SERVING) {
      return absl::OkStatus();
    }
    absl::SleepFor(absl::Milliseconds(50));
  }
  return absl::DeadlineExceededError("worker not serving after 30 s");
}

}  // namespace

absl::StatusOr<std::unique_ptr<PdCluster>> PdCluster::Start(const ClusterOptions& options) {
  std::unique_ptr<PdCluster> cluster(new PdCluster());
  char dir_template[] = "/tmp/pdserve_pd_test_XXXXXX";
  if (mkdtemp(dir_template) == nullptr) return absl::InternalError("mkdtemp failed");
  cluster->dir_ = dir_template;
  const std::string config = cluster->dir_ + "/deploy.yaml";
  {
    std::ofstream out(config);
    out << "name: pd-test\nmodel:\n  path: " << PDSERVE_BUNDLED_MODEL
        << "\n  served_name: kjv-v4-tiny\nrouter:\n  host: 127.0.0.1\n  http_port: 18000\n"
        << "prefill:\n  - name: prefill-0\n    host: 127.0.0.1\n    port: 18100\n"
        << "    backend: cpu\ndecode:\n  - name: decode-0\n    host: 127.0.0.1\n"
        << "    port: 18200\n    backend: cpu\ntransfer:\n  transport: ucx\n  lease_ms: "
        << options.lease_ms << "\n"
        << (options.transfer_lanes > 0 ? absl::StrCat("  lanes: ", options.transfer_lanes, "\n")
                                       : "")
        << (options.ucx_protocols.empty()
                ? ""
                : absl::StrCat("  ucx_protocols: ", options.ucx_protocols, "\n"))
        << (options.register_pages ? "  register_pages: true\n" : "")
        << "  shm_pull: " << (options.shm_pull ? "true" : "false") << "\n"
        << options.guards_yaml;
  }
  std::vector<std::string> env = {"UCX_TLS=" + options.ucx_tls};
  std::vector<std::string> prefill_env = env;
  prefill_env.insert(prefill_env.end(), options.prefill_env.begin(), options.prefill_env.end());
  auto decode = StartWorker("decode", config,
                            {"--max-batch", absl::StrCat(options.decode_max_batch), "--pool-tokens",
                             absl::StrCat(options.decode_pool_tokens), "--drain-timeout-ms",
                             absl::StrCat(options.drain_timeout_ms)},
                            env);
  if (!decode.ok()) return decode.status();
  auto prefill = StartWorker("prefill", config,
                             {"--drain-timeout-ms", absl::StrCat(options.drain_timeout_ms),
                              "--max-waiting", absl::StrCat(options.prefill_max_waiting)},
                             prefill_env);
  if (!prefill.ok()) return prefill.status();
  cluster->decode_process_ = std::move(decode->first);
  cluster->prefill_process_ = std::move(prefill->first);
  cluster->decode_port_ = decode->second;
  cluster->prefill_port_ = prefill->second;
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 200);
  cluster->decode_stub_ = v1::DecodeWorker::NewStub(grpc::CreateCustomChannel(
      absl::StrCat("127.0.0.1:", decode->second), grpc::InsecureChannelCredentials(), args));
  cluster->prefill_stub_ = v1::PrefillWorker::NewStub(grpc::CreateCustomChannel(
      absl::StrCat("127.0.0.1:", prefill->second), grpc::InsecureChannelCredentials(), args));
  if (absl::Status s = WaitServing(*cluster->decode_stub_); !s.ok()) return s;
  if (absl::Status s = WaitServing(*cluster->prefill_stub_); !s.ok()) return s;
  return cluster;
}

PdCluster::~PdCluster() {
  prefill_process_.reset();
  decode_process_.reset();
  if (!dir_.empty()) {
    std::remove((dir_ + "/deploy.yaml").c_str());
    rmdir(dir_.c_str());
  }
}

v1::ReserveRequest ReserveFor(const RequestSpec& spec) {
  v1::ReserveRequest request;
  request.set_request_id(spec.request_id);
  request.set_prompt_tokens(static_cast<int32_t>(spec.prompt.size()));
  *request.mutable_sampling() = router::ToProto(spec.params, spec.choice);
  request.set_lease_ms(30000);
  for (int32_t id : spec.prompt) request.add_prompt_token_ids(id);
  return request;
}

v1::PrefillRequest PrefillFor(const RequestSpec& spec, const v1::TransferTicket& ticket) {
  v1::PrefillRequest request;
  request.set_request_id(spec.request_id);
  for (int32_t id : spec.prompt) request.add_token_ids(id);
  *request.mutable_sampling() = router::ToProto(spec.params, spec.choice);
  *request.mutable_ticket() = ticket;
  return request;
}

void ReadGenerate(grpc::ClientReader<v1::GenerateResponse>& reader, Outcome* outcome) {
  v1::GenerateResponse event;
  while (reader.Read(&event)) {
    for (int i = 0; i < event.token_ids_size(); ++i) {
      outcome->tokens.push_back(event.token_ids(i));
      // The first token's logprobs come from the Prefill response (the decode worker gets only
      // its id in the commit).
      if (outcome->tokens.size() > 1 && i < event.tokens_size()) {
        AppendLogprobs(event.tokens(i), &outcome->logprob_bits);
      }
    }
    if (!event.finish_reason().empty()) {
      outcome->finish_reason = event.finish_reason();
      outcome->isolation_error = event.isolation_error();
      outcome->error = event.error_message();
    }
  }
  grpc::Status status = reader.Finish();
  if (!status.ok()) outcome->error = "Generate: " + status.error_message();
}

Outcome PdCluster::Run(const RequestSpec& spec) {
  Outcome outcome;
  v1::ReserveResponse reserved;
  {
    grpc::ClientContext context;
    grpc::Status status = decode_stub_->Reserve(&context, ReserveFor(spec), &reserved);
    if (!status.ok()) {
      outcome.error = "Reserve: " + status.error_message();
      return outcome;
    }
  }
  v1::PrefillResponse prefilled;
  grpc::Status prefill_status;
  std::thread prefill([&] {
    grpc::ClientContext context;
    prefill_status =
        prefill_stub_->Prefill(&context, PrefillFor(spec, reserved.ticket()), &prefilled);
  });
  grpc::ClientContext context;
  v1::GenerateRequest generate;
  generate.set_request_id(spec.request_id);
  generate.set_ticket_id(reserved.ticket().ticket_id());
  std::unique_ptr<grpc::ClientReader<v1::GenerateResponse>> reader =
      decode_stub_->Generate(&context, generate);
  ReadGenerate(*reader, &outcome);
  prefill.join();
  outcome.prefill_status = prefill_status.ok() ? "OK" : prefill_status.error_message();
  if (prefill_status.ok() && !outcome.tokens.empty()) {
    std::vector<uint32_t> first;
    AppendLogprobs(prefilled.first_token(), &first);
    outcome.logprob_bits.insert(outcome.logprob_bits.begin(), first.begin(), first.end());
  }
  return outcome;
}

std::vector<Outcome> PdCluster::RunAll(const std::vector<RequestSpec>& specs, int clients) {
  std::vector<Outcome> outcomes(specs.size());
  std::atomic<size_t> next{0};
  std::vector<std::thread> threads;
  for (int c = 0; c < clients; ++c) {
    threads.emplace_back([&] {
      for (size_t i = next++; i < specs.size(); i = next++) outcomes[i] = Run(specs[i]);
    });
  }
  for (std::thread& t : threads) t.join();
  return outcomes;
}

v1::StatsResponse DecodeStats(PdCluster& cluster) {
  grpc::ClientContext context;
  v1::StatsResponse stats;
  EXPECT_TRUE(cluster.decode().Stats(&context, v1::StatsRequest(), &stats).ok());
  return stats;
}

v1::StatsResponse AwaitAllPagesFree(PdCluster& cluster, absl::Duration timeout) {
  v1::StatsResponse stats;
  const absl::Time until = absl::Now() + timeout;
  do {
    stats = DecodeStats(cluster);
    if (stats.pages_free() == stats.pages_total()) break;
    absl::SleepFor(absl::Milliseconds(50));
  } while (absl::Now() < until);
  return stats;
}

std::vector<Outcome> RunColocated(const std::vector<RequestSpec>& specs) {
  static const engine::Model* model =
      new engine::Model(*engine::Model::Load(PDSERVE_BUNDLED_MODEL));
  const serving::GenerationConfig generation =
      *serving::GenerationConfig::Load(PDSERVE_BUNDLED_MODEL);
  const serving::StateLayout layout = *runtime::LayoutForModel(model->config());
  std::unique_ptr<serving::PagePool> pool = *serving::PagePool::Create(
      layout.PoolOptions(64, 64 * model->config().max_position_embeddings));
  SystemClock clock;
  serving::SchedulerOptions options;
  options.token_budget = 512;
  options.max_running = 64;
  std::unique_ptr<serving::Scheduler> scheduler = *serving::Scheduler::Create(
      options, pool.get(), [&layout](int64_t total) { return layout.Demand(total); }, &clock,
      nullptr);
  runtime::EngineStepRunner runner(*model, layout, pool.get(), runtime::RunnerOptions{});
  std::vector<Outcome> outcomes(specs.size());
  for (size_t i = 0; i < specs.size(); ++i) {
    serving::SamplingParams params = specs[i].params;
    params.n = specs[i].choice + 1;
    auto sampler = serving::RequestSampler::Create(
        params, worker::SeedRequestId(specs[i].request_id), generation.eos_token_ids,
        specs[i].prompt, model->config().vocab_size);
    if (!sampler.ok()) {
      outcomes[i].error = sampler.status().ToString();
      continue;
    }
    auto context = std::make_shared<runtime::RequestContext>(std::move(*sampler));
    Outcome* out = &outcomes[i];
    context->on_token = [out](const runtime::TokenEvent& event) {
      out->tokens.push_back(event.sampled.token);
      v1::SampledToken proto = worker::SampledTokenToProto(event.sampled);
      AppendLogprobs(proto, &out->logprob_bits);
      out->finish_reason = event.finish_reason;
      return false;
    };
    context->on_error = [out](int32_t, const absl::Status& status) {
      out->error = status.ToString();
    };
    const serving::RequestId id = i + 1;
    (void)runner.Add(id, {context, specs[i].choice, specs[i].prompt, params.max_tokens});
    (void)scheduler->Submit({id, static_cast<int64_t>(specs[i].prompt.size()), params.max_tokens});
  }
  while (scheduler->num_waiting() + scheduler->num_running() > 0) {
    absl::StatusOr<serving::Scheduler::StepResult> result = scheduler->Step(runner);
    if (!result.ok()) break;
    for (serving::RequestId id : result->finished) runner.Remove(id);
  }
  for (Outcome& o : outcomes) o.prefill_status = "OK";
  return outcomes;
}

}  // namespace pdserve::pd::testing
