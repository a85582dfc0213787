// Router overhead, against in-process fake workers that cost nothing (so the router is what is
// measured): a fake decode worker (gRPC callback API) sends one token to every open Generate
// stream each tick from one thread; a fake prefill worker answers at once.
//
//   build/bench/router/router_bench overhead [tokens=200] [tick_ms=5]
//     One stream. Per-token latency = arrival at the client - the fake worker's write, for (a) a
//     gRPC client reading the decode stream directly and (b) an HTTP SSE client through the
//     router (RouterService + frontend::HttpServer). The difference is the router's overhead.
//   build/bench/router/router_bench streams [streams=2000] [tokens=20] [tick_ms=50]
//     `pdserve bench`'s client (loadgen) holds `streams` concurrent SSE streams through the
//     router; every one must complete with `tokens` tokens.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "frontend/http_server.h"
#include "grpcpp/grpcpp.h"
#include "loadgen/dataset.h"
#include "loadgen/runner.h"
#include "loadgen/stats.h"
#include "pdserve/worker/v1/worker.grpc.pb.h"
#include "router/service.h"

namespace pdserve::router {
namespace {

namespace wv1 = worker::v1;
using Clock = std::chrono::steady_clock;

double Ms(Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }

// Fake decode worker: Reserve remembers max_tokens; Generate streams token_id each tick.
class TickDecode final : public wv1::DecodeWorker::CallbackService {
 public:
  explicit TickDecode(std::chrono::milliseconds tick) : tick_(tick) {
    thread_ = std::thread([this] { Loop(); });
  }
  ~TickDecode() override {
    stop_ = true;
    thread_.join();
  }

  grpc::ServerUnaryReactor* Reserve(grpc::CallbackServerContext* context,
                                    const wv1::ReserveRequest* request,
                                    wv1::ReserveResponse* response) override {
    {
      absl::MutexLock lock(&mu_);
      max_tokens_[request->request_id()] = request->sampling().max_tokens();
    }
    response->mutable_ticket()->set_ticket_id(request->request_id());
    auto* reactor = context->DefaultReactor();
    reactor->Finish(grpc::Status::OK);
    return reactor;
  }
  grpc::ServerWriteReactor<wv1::GenerateResponse>* Generate(
      grpc::CallbackServerContext*, const wv1::GenerateRequest* request) override {
    auto* stream = new Stream(this);
    absl::MutexLock lock(&mu_);
    stream->total = max_tokens_[request->request_id()];
    max_tokens_.erase(request->request_id());
    streams_.push_back(stream);
    return stream;
  }
  grpc::ServerUnaryReactor* Abort(grpc::CallbackServerContext* context, const wv1::AbortRequest*,
                                  wv1::AbortResponse*) override {
    auto* reactor = context->DefaultReactor();
    reactor->Finish(grpc::Status::OK);
    return reactor;
  }
  grpc::ServerUnaryReactor* Health(grpc::CallbackServerContext* context, const wv1::HealthRequest*,
                                   wv1::HealthResponse* response) override {
    response->set_state(wv1::HealthResponse::STATE_SERVING);
    auto* reactor = context->DefaultReactor();
    reactor->Finish(grpc::Status::OK);
    return reactor;
  }

  // Write times of the tokens of the first stream (overhead mode).
  std::vector<Clock::time_point> first_stream_writes() {
    absl::MutexLock lock(&mu_);
    return first_writes_;
  }

 private:
  struct Stream : grpc::ServerWriteReactor<wv1::GenerateResponse> {
    explicit Stream(TickDecode* d) : decode(d) {}
    void OnWriteDone(bool ok) override {
      absl::MutexLock lock(&decode->mu_);
      writing = false;
      if (!ok) failed = true;
    }
    void OnDone() override {
      absl::MutexLock lock(&decode->mu_);
      done = true;
    }
    TickDecode* decode;
    wv1::GenerateResponse event;
    int total = 0;
    int sent = 0;
    bool writing = false;
    bool failed = false;
    bool finished = false;
    bool done = false;
    bool first = false;
  };

  void Loop() {
    bool any = false;
    while (!stop_) {
      std::this_thread::sleep_for(tick_);
      absl::MutexLock lock(&mu_);
      std::vector<Stream*> keep;
      for (Stream* s : streams_) {
        if (s->done) {
          delete s;
          continue;
        }
        keep.push_back(s);
        if (s->writing || s->finished) continue;
        if (s->failed) {
          s->finished = true;
          s->Finish(grpc::Status::CANCELLED);
          continue;
        }
        if (!any) {
          any = true;
          s->first = true;
        }
        s->event.Clear();
        if (s->sent < s->total) {
          s->event.add_token_ids(token_id.load());
          if (++s->sent == s->total) s->event.set_finish_reason("length");
          if (s->first) first_writes_.push_back(Clock::now());
          s->writing = true;
          s->StartWrite(&s->event);
        } else {
          s->finished = true;
          s->Finish(grpc::Status::OK);
        }
      }
      streams_.swap(keep);
    }
    absl::MutexLock lock(&mu_);
    for (Stream* s : streams_) {
      if (!s->finished) s->Finish(grpc::Status::CANCELLED);
    }
  }

  const std::chrono::milliseconds tick_;
  std::atomic<bool> stop_{false};

 public:
  // The token every stream repeats: one that detokenizes to whole ASCII text on its own, so each
  // token is one SSE event (the router sets it to the id of " and"; Encode may add BOS first).
  std::atomic<int32_t> token_id{100};

 private:
  absl::Mutex mu_;
  std::map<uint64_t, int> max_tokens_ ABSL_GUARDED_BY(mu_);
  std::vector<Stream*> streams_ ABSL_GUARDED_BY(mu_);
  std::vector<Clock::time_point> first_writes_ ABSL_GUARDED_BY(mu_);
  std::thread thread_;
};

class InstantPrefill final : public wv1::PrefillWorker::CallbackService {
 public:
  grpc::ServerUnaryReactor* Prefill(grpc::CallbackServerContext* context,
                                    const wv1::PrefillRequest*, wv1::PrefillResponse*) override {
    auto* reactor = context->DefaultReactor();
    reactor->Finish(grpc::Status::OK);
    return reactor;
  }
  grpc::ServerUnaryReactor* Abort(grpc::CallbackServerContext* context, const wv1::AbortRequest*,
                                  wv1::AbortResponse*) override {
    auto* reactor = context->DefaultReactor();
    reactor->Finish(grpc::Status::OK);
    return reactor;
  }
  grpc::ServerUnaryReactor* Health(grpc::CallbackServerContext* context, const wv1::HealthRequest*,
                                   wv1::HealthResponse* response) override {
    response->set_state(wv1::HealthResponse::STATE_SERVING);
    auto* reactor = context->DefaultReactor();
    reactor->Finish(grpc::Status::OK);
    return reactor;
  }
};

struct Cluster {
  explicit Cluster(std::chrono::milliseconds tick) : decode(tick) {
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &decode_port);
    builder.RegisterService(&decode);
    decode_server = builder.BuildAndStart();
    grpc::ServerBuilder pbuilder;
    pbuilder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &prefill_port);
    pbuilder.RegisterService(&prefill);
    prefill_server = pbuilder.BuildAndStart();
  }
  ~Cluster() {
    decode_server->Shutdown(std::chrono::system_clock::now());
    prefill_server->Shutdown(std::chrono::system_clock::now());
  }
  // Starts the router in front of the fakes; the HTTP port.
  int StartRouter() {
    RouterOptions options;
    options.model_dir = PDSERVE_BUNDLED_MODEL;
    options.served_name = "tiny";
    config::WorkerConfig p, d;
    p.name = "p0";
    p.host = d.host = "127.0.0.1";
    p.port = prefill_port;
    d.name = "d0";
    d.port = decode_port;
    options.prefill = {p};
    options.decode = {d};
    options.canary = false;
    options.max_in_flight = 100000;
    service = std::move(*RouterService::Create(options));
    decode.token_id = service->preparer().tokenizer().Encode(" and")->back();
    while (!service->Ready()) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    frontend::HttpServerOptions http;
    http.port = 0;
    server = std::move(*frontend::HttpServer::Start(http, service.get()));
    return server->port();
  }
  void Stop() {
    if (server) server->Stop();
  }

  TickDecode decode;
  InstantPrefill prefill;
  int decode_port = 0, prefill_port = 0;
  std::unique_ptr<grpc::Server> decode_server, prefill_server;
  std::unique_ptr<RouterService> service;
  std::unique_ptr<frontend::HttpServer> server;
};

void PrintLatencies(const char* what, std::vector<double> ms) {
  std::sort(ms.begin(), ms.end());
  auto pct = [&](double p) { return ms[static_cast<size_t>(p / 100 * (ms.size() - 1))]; };
  std::printf("%-28s tokens %zu  p50 %.3f ms  p90 %.3f ms  p99 %.3f ms  max %.3f ms\n", what,
              ms.size(), pct(50), pct(90), pct(99), ms.back());
}

int Overhead(int tokens, int tick_ms) {
  // (a) Direct: read the decode stream with a gRPC client.
  std::vector<double> direct;
  {
    Cluster cluster{std::chrono::milliseconds(tick_ms)};
    auto stub = wv1::DecodeWorker::NewStub(grpc::CreateChannel(
        "127.0.0.1:" + std::to_string(cluster.decode_port), grpc::InsecureChannelCredentials()));
    wv1::ReserveRequest reserve;
    reserve.set_request_id(1);
    reserve.mutable_sampling()->set_max_tokens(tokens);
    wv1::ReserveResponse reserved;
    grpc::ClientContext rc;
    stub->Reserve(&rc, reserve, &reserved);
    wv1::GenerateRequest generate;
    generate.set_request_id(1);
    grpc::ClientContext gc;
    auto reader = stub->Generate(&gc, generate);
    wv1::GenerateResponse event;
    std::vector<Clock::time_point> arrivals;
    while (reader->Read(&event)) {
      if (event.token_ids_size() > 0) arrivals.push_back(Clock::now());
    }
    reader->Finish();
    const auto writes = cluster.decode.first_stream_writes();
    for (size_t i = 0; i < arrivals.size() && i < writes.size(); ++i) {
      direct.push_back(Ms(arrivals[i] - writes[i]));
    }
  }
  // (b) Through the router: an SSE client on a raw socket.
  std::vector<double> routed;
  {
    Cluster cluster{std::chrono::milliseconds(tick_ms)};
    const int port = cluster.StartRouter();
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<uint16_t>(port));
    inet_pton(AF_INET, "127.0.0.1", &addr.sin_addr);
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) return 1;
    const std::string body =
        "{\"model\":\"tiny\",\"prompt\":[1,2,3],\"stream\":true,\"max_tokens\":" +
        std::to_string(tokens) + ",\"temperature\":0}";
    const std::string request =
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        "Content-Length: " +
        std::to_string(body.size()) + "\r\n\r\n" + body;
    if (write(fd, request.data(), request.size()) < 0) return 1;
    std::vector<Clock::time_point> arrivals;
    std::string pending;
    char buffer[65536];
    bool done = false;
    while (!done) {
      const ssize_t n = read(fd, buffer, sizeof(buffer));
      if (n <= 0) break;
      const auto now = Clock::now();
      pending.append(buffer, static_cast<size_t>(n));
      if (std::getenv("ROUTER_BENCH_DEBUG")) {
        std::fprintf(stderr, "read %zd bytes: %.200s\n", n, std::string(buffer, n).c_str());
      }
      size_t pos;
      while ((pos = pending.find("\n\n")) != std::string::npos) {
        const std::string event = pending.substr(0, pos);
        pending.erase(0, pos + 2);
        if (event.find("data: [DONE]") != std::string::npos)
          done = true;
        else if (event.find("\"text\"") != std::string::npos)
          arrivals.push_back(now);
      }
    }
    close(fd);
    const auto writes = cluster.decode.first_stream_writes();
    for (size_t i = 0; i < arrivals.size() && i < writes.size(); ++i) {
      routed.push_back(Ms(arrivals[i] - writes[i]));
    }
    cluster.Stop();
  }
  if (direct.empty() || routed.empty()) return 1;
  std::printf("one stream, %d tokens, one token every %d ms\n", tokens, tick_ms);
  PrintLatencies("decode stream, direct gRPC", direct);
  PrintLatencies("through the router (SSE)", routed);
  return 0;
}

int Streams(int streams, int tokens, int tick_ms) {
  Cluster cluster{std::chrono::milliseconds(tick_ms)};
  const int port = cluster.StartRouter();
  loadgen::RunOptions run;
  run.url = *loadgen::ParseEndpointUrl("http://127.0.0.1:" + std::to_string(port));
  loadgen::PromptItem item;
  item.prompt = "In the beginning";
  run.requests = {{loadgen::ApiPath(loadgen::Api::kCompletions),
                   loadgen::RequestBody(item, {.model = "tiny", .default_max_tokens = tokens})}};
  run.num_requests = streams;
  run.max_concurrency = streams;
  run.request_timeout_s = 300;
  auto result = loadgen::Run(run);
  cluster.Stop();
  if (!result.ok()) {
    std::fprintf(stderr, "%s\n", result.status().ToString().c_str());
    return 1;
  }
  const loadgen::RunSummary summary =
      loadgen::Summarize(result->samples, result->duration_s, std::nullopt);
  std::printf(
      "%d concurrent streams x %d tokens through the router, one token per stream every "
      "%d ms\n%s",
      streams, tokens, tick_ms, loadgen::ToTable(summary).c_str());
  return summary.failed == 0 && summary.output_tokens == int64_t{streams} * tokens ? 0 : 1;
}

}  // namespace
}  // namespace pdserve::router

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "overhead";
  auto arg = [&](int i, int fallback) { return argc > i ? std::atoi(argv[i]) : fallback; };
  if (mode == "streams") return pdserve::router::Streams(arg(2, 2000), arg(3, 20), arg(4, 50));
  return pdserve::router::Overhead(arg(2, 200), arg(3, 5));
}
