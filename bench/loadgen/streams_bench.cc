// How many concurrent streams `pdserve bench`'s client holds: N streamed requests at once
// against an in-process frontend::HttpServer whose service emits one token to every open stream
// each tick (one generator thread, so the server side is not the limit being measured).
//
//   build/bench/loadgen/loadgen_streams_bench [streams=2000] [tokens=20] [tick_ms=50]
//
// Prints the run summary table; every request must complete with `tokens` tokens.
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "frontend/http_server.h"
#include "loadgen/dataset.h"
#include "loadgen/runner.h"
#include "loadgen/stats.h"

namespace pdserve::loadgen {
namespace {

class TickService : public frontend::GenerationService {
 public:
  TickService(int tokens, std::chrono::milliseconds tick) : tokens_(tokens), tick_(tick) {
    thread_ = std::thread([this] { Loop(); });
  }
  ~TickService() override {
    stop_ = true;
    thread_.join();
  }
  std::vector<std::string> ModelNames() const override { return {"tick"}; }
  bool Ready() const override { return true; }
  std::string MetricsText() const override { return ""; }
  frontend::StartResult Start(const frontend::ApiRequest&,
                              std::shared_ptr<frontend::GenerationSink> sink) override {
    auto stream = std::make_shared<Stream>();
    stream->sink = std::move(sink);
    absl::MutexLock lock(&mu_);
    streams_.push_back(stream);
    return std::unique_ptr<frontend::Generation>(std::make_unique<Handle>(stream));
  }

 private:
  struct Stream {
    std::shared_ptr<frontend::GenerationSink> sink;
    std::atomic<bool> cancelled{false};
    int sent = 0;
  };
  struct Handle : frontend::Generation {
    explicit Handle(std::shared_ptr<Stream> s) : stream(std::move(s)) {}
    ~Handle() override { Cancel(); }
    void Cancel() override { stream->cancelled = true; }
    std::shared_ptr<Stream> stream;
  };

  void Loop() {
    while (!stop_) {
      std::this_thread::sleep_for(tick_);
      std::vector<std::shared_ptr<Stream>> live;
      {
        absl::MutexLock lock(&mu_);
        live.swap(streams_);
      }
      std::vector<std::shared_ptr<Stream>> keep;
      for (auto& s : live) {
        if (s->cancelled) continue;
        frontend::ChoiceDelta d;
        d.text = " tok";
        if (++s->sent == tokens_) d.finish_reason = "length";
        s->sink->OnDelta(std::move(d));
        if (s->sent == tokens_) {
          s->sink->OnComplete({1, tokens_});
        } else {
          keep.push_back(std::move(s));
        }
      }
      absl::MutexLock lock(&mu_);
      streams_.insert(streams_.end(), keep.begin(), keep.end());
    }
  }

  const int tokens_;
  const std::chrono::milliseconds tick_;
  std::atomic<bool> stop_{false};
  absl::Mutex mu_;
  std::vector<std::shared_ptr<Stream>> streams_ ABSL_GUARDED_BY(mu_);
  std::thread thread_;
};

int Main(int argc, char** argv) {
  const int streams = argc > 1 ? std::atoi(argv[1]) : 2000;
  const int tokens = argc > 2 ? std::atoi(argv[2]) : 20;
  const int tick_ms = argc > 3 ? std::atoi(argv[3]) : 50;
  TickService service(tokens, std::chrono::milliseconds(tick_ms));
  frontend::HttpServerOptions options;
  options.port = 0;
  auto server = frontend::HttpServer::Start(options, &service);
  if (!server.ok()) {
    std::fprintf(stderr, "%s\n", server.status().ToString().c_str());
    return 1;
  }
  RunOptions run;
  run.url = *ParseEndpointUrl("http://127.0.0.1:" + std::to_string((*server)->port()));
  PromptItem item;
  item.prompt = "hi";
  run.requests = {{ApiPath(Api::kCompletions),
                   RequestBody(item, {.model = "tick", .default_max_tokens = tokens})}};
  run.num_requests = streams;
  run.max_concurrency = streams;
  run.request_timeout_s = 120;
  auto result = Run(run);
  (*server)->Stop();
  if (!result.ok()) {
    std::fprintf(stderr, "%s\n", result.status().ToString().c_str());
    return 1;
  }
  const RunSummary summary = Summarize(result->samples, result->duration_s, std::nullopt);
  std::printf("%d concurrent streams x %d tokens, one token per stream every %d ms\n%s", streams,
              tokens, tick_ms, ToTable(summary).c_str());
  return summary.failed == 0 && summary.output_tokens == int64_t{streams} * tokens ? 0 : 1;
}

}  // namespace
}  // namespace pdserve::loadgen

int main(int argc, char** argv) { return pdserve::loadgen::Main(argc, argv); }
