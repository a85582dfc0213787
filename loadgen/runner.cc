#include "loadgen/runner.h"

#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <memory>
#include <optional>
#include <random>

#include "absl/strings/str_cat.h"
#include "boost/asio/io_context.hpp"
#include "boost/asio/steady_timer.hpp"

namespace pdserve::loadgen {
namespace {

namespace net = boost::asio;
using tcp = net::ip::tcp;
using Clock = std::chrono::steady_clock;

Clock::duration FromSeconds(double s) {
  return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s));
}

// Each stream holds a socket: let the process use as many descriptors as it is allowed to.
void RaiseOpenFileLimit() {
  rlimit limit{};
  if (getrlimit(RLIMIT_NOFILE, &limit) == 0 && limit.rlim_cur < limit.rlim_max) {
    limit.rlim_cur = limit.rlim_max;
    setrlimit(RLIMIT_NOFILE, &limit);
  }
}

// The event loop state of one run; everything runs on the io_context's single thread.
class Driver {
 public:
  Driver(const RunOptions& options, tcp::resolver::results_type addresses)
      : o_(options),
        addresses_(std::move(addresses)),
        arrival_timer_(ioc_),
        stop_timer_(ioc_),
        progress_timer_(ioc_),
        rng_(options.seed) {}

  RunResult Run() {
    start_ = Clock::now();
    next_arrival_ = start_;
    if (o_.duration_s > 0) {
      hard_deadline_ = start_ + FromSeconds(o_.duration_s + o_.drain_timeout_s);
      stop_timer_.expires_at(start_ + FromSeconds(o_.duration_s));
      stop_timer_.async_wait([this](boost::system::error_code ec) {
        if (ec) return;
        stop_issuing_ = true;
        waiting_ = 0;
        arrival_timer_.cancel();
        MaybeFinish();
      });
    }
    if (o_.progress) ScheduleProgress();
    if (o_.rate > 0) {
      ScheduleArrival();
    } else {
      FillSlots();
    }
    ioc_.run();
    RunResult result;
    result.duration_s = std::chrono::duration<double>(end_ - start_).count();
    result.samples = std::move(samples_);
    return result;
  }

 private:
  bool LimitReached() const {
    return stop_issuing_ || (o_.num_requests > 0 && issued_ >= o_.num_requests);
  }
  bool SlotFree() const { return o_.max_concurrency <= 0 || in_flight_ < o_.max_concurrency; }

  void ScheduleArrival() {
    std::exponential_distribution<double> gap(o_.rate);
    next_arrival_ += FromSeconds(gap(rng_));
    arrival_timer_.expires_at(next_arrival_);
    arrival_timer_.async_wait([this](boost::system::error_code ec) {
      if (ec || LimitReached()) return;
      if (SlotFree()) {
        Issue();
      } else {
        ++waiting_;
      }
      if (o_.num_requests <= 0 || issued_ + waiting_ < o_.num_requests) ScheduleArrival();
    });
  }

  void FillSlots() {
    while (!LimitReached() && SlotFree()) Issue();
    MaybeFinish();
  }

  void Issue() {
    const size_t index = samples_.size();
    samples_.emplace_back();
    ++issued_;
    ++in_flight_;
    const RequestTemplate& t = o_.requests[index % o_.requests.size()];
    StreamCallSpec spec;
    spec.target = o_.url.path_prefix + t.target;
    spec.body = t.body;
    spec.deadline = Clock::now() + FromSeconds(o_.request_timeout_s);
    if (hard_deadline_) spec.deadline = std::min(spec.deadline, *hard_deadline_);
    StartStreamCall(ioc_, addresses_, o_.url, std::move(spec),
                    [this, index](RequestSample sample) { OnDone(index, std::move(sample)); });
  }

  void OnDone(size_t index, RequestSample sample) {
    if (sample.ok()) {
      ++completed_;
    } else {
      ++failed_;
    }
    samples_[index] = std::move(sample);
    --in_flight_;
    end_ = Clock::now();
    if (o_.rate > 0) {
      if (waiting_ > 0 && !LimitReached()) {
        --waiting_;
        Issue();
      }
      MaybeFinish();
    } else {
      FillSlots();
    }
  }

  void MaybeFinish() {
    const bool no_more = LimitReached() && waiting_ == 0;
    if (!no_more || in_flight_ > 0) return;
    if (end_ < start_) end_ = Clock::now();
    arrival_timer_.cancel();
    stop_timer_.cancel();
    progress_timer_.cancel();
    finished_ = true;
    if (o_.progress) o_.progress(Snapshot());
  }

  Progress Snapshot() const {
    return {issued_, completed_, failed_, in_flight_,
            std::chrono::duration<double>(Clock::now() - start_).count()};
  }

  void ScheduleProgress() {
    progress_timer_.expires_after(FromSeconds(o_.progress_interval_s));
    progress_timer_.async_wait([this](boost::system::error_code ec) {
      if (ec || finished_) return;
      o_.progress(Snapshot());
      ScheduleProgress();
    });
  }

  const RunOptions& o_;
  net::io_context ioc_;
  tcp::resolver::results_type addresses_;
  net::steady_timer arrival_timer_, stop_timer_, progress_timer_;
  std::mt19937_64 rng_;
  Clock::time_point start_, end_, next_arrival_;
  std::optional<Clock::time_point> hard_deadline_;
  std::vector<RequestSample> samples_;
  int64_t issued_ = 0, completed_ = 0, failed_ = 0, in_flight_ = 0, waiting_ = 0;
  bool stop_issuing_ = false;
  bool finished_ = false;
};

}  // namespace

absl::StatusOr<RunResult> Run(const RunOptions& options) {
  if (options.requests.empty()) return absl::InvalidArgumentError("no requests to send");
  // NaN passes every "<= 0" test below; an infinite time overflows the clock's arithmetic.
  if (std::isnan(options.rate) || !std::isfinite(options.duration_s) ||
      !std::isfinite(options.request_timeout_s) || !std::isfinite(options.drain_timeout_s)) {
    return absl::InvalidArgumentError(
        "the rate must be a number and the duration and timeouts finite numbers");
  }
  if (options.num_requests <= 0 && options.duration_s <= 0) {
    return absl::InvalidArgumentError("set a number of requests or a duration");
  }
  if (options.rate <= 0 && options.max_concurrency <= 0 && options.num_requests <= 0) {
    return absl::InvalidArgumentError("a run by duration needs a rate or a concurrency cap");
  }
  if (options.rate < 0 || options.request_timeout_s <= 0 || options.drain_timeout_s < 0) {
    return absl::InvalidArgumentError("rate and timeouts must be positive");
  }
  RaiseOpenFileLimit();
  net::io_context resolver_ioc;
  tcp::resolver resolver(resolver_ioc);
  boost::system::error_code ec;
  auto addresses = resolver.resolve(options.url.host, options.url.port, ec);
  if (ec) {
    return absl::UnavailableError(
        absl::StrCat("cannot resolve ", options.url.host, ": ", ec.message()));
  }
  Driver driver(options, std::move(addresses));
  return driver.Run();
}

}  // namespace pdserve::loadgen
