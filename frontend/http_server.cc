#include "frontend/http_server.h"

#include <algorithm>
#include <atomic>
#include <boost/asio.hpp>
#include <boost/beast.hpp>
#include <chrono>
#include <ctime>
#include <deque>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/api_keys.h"
#include "common/status.h"
#include "frontend/session_stream.h"
#include "frontend/tcp_progress.h"
#include "nlohmann/json.hpp"
#include "spdlog/spdlog.h"

namespace pdserve::frontend {

namespace net = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = net::ip::tcp;

namespace {

// After an accept error (EMFILE, ENFILE, ...) wait before accepting again instead of spinning.
constexpr auto kAcceptBackoff = std::chrono::milliseconds(100);
// How long a connection answered before its request was read to the end (413, 431, 503
// server_busy, malformed) keeps reading and dropping what the client still sends (Linger).
constexpr auto kLingerTimeout = std::chrono::seconds(30);
constexpr size_t kLingerReadBytes = 16384;
// What the disconnect watch (Session::WatchDisconnect) reads ahead of the next request at most.
constexpr size_t kReadAheadBytes = 16384;
// Empty lines skipped before a request line (Session::SkipEmptyLines); past them, a 400.
constexpr int kMaxEmptyLines = 8;
// How long a read cancelled at its deadline may take to end (for its 408) before the connection
// is closed (Session::OnReadDeadline).
constexpr auto kCancelledReadGrace = std::chrono::seconds(2);
// How often the event loop beats HttpServerOptions::heartbeat.
constexpr auto kHeartbeatPeriod = std::chrono::milliseconds(100);

class Session;

// A path segment with its percent-encoded octets decoded (RFC 3986 2.1); "%" not followed by
// two hex digits is kept as sent.
std::string PercentDecode(std::string_view segment) {
  auto hex = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  std::string out;
  out.reserve(segment.size());
  for (size_t i = 0; i < segment.size(); ++i) {
    if (segment[i] == '%' && i + 2 < segment.size() && hex(segment[i + 1]) >= 0 &&
        hex(segment[i + 2]) >= 0) {
      out.push_back(static_cast<char>(hex(segment[i + 1]) * 16 + hex(segment[i + 2])));
      i += 2;
    } else {
      out.push_back(segment[i]);
    }
  }
  return out;
}

// Errors of a request Beast could not parse: answered with 400 before closing.
bool IsHttpParseError(const beast::error_code& ec) {
  return ec.category() == http::make_error_code(http::error::bad_method).category() &&
         ec != http::error::end_of_stream && ec != http::error::partial_message;
}

// The path of a request target: absolute form ("http://host/v1/models", RFC 9112 3.2.2) names
// the same resource as its path; the query is not part of it.
std::string_view TargetPath(std::string_view target) {
  for (std::string_view scheme : {"http://", "https://"}) {
    if (target.substr(0, scheme.size()) == scheme) {
      const size_t slash = target.find('/', scheme.size());
      target = slash == std::string_view::npos ? std::string_view("/") : target.substr(slash);
    }
  }
  return target.substr(0, target.find('?'));
}

// The generation endpoint `target` names, if any.
std::optional<Endpoint> ApiEndpoint(std::string_view target) {
  const std::string_view path = TargetPath(target);
  if (path == "/v1/completions") return Endpoint::kCompletions;
  if (path == "/v1/chat/completions") return Endpoint::kChatCompletions;
  return std::nullopt;
}

}  // namespace

struct HttpServer::Impl {
  HttpServerOptions options;
  GenerationService* service = nullptr;
  // /v1/models "created": when this server started (Unix seconds), the time its models were
  // made available.
  int64_t started = static_cast<int64_t>(std::time(nullptr));
  net::io_context ioc;
  // The acceptor and its retry timer are used only on this strand: accept completions, the
  // retry and the close of Drain()/Stop() run on different io threads otherwise (a concurrent
  // close crashed in epoll deregistration).
  net::strand<net::io_context::executor_type> accept_strand{net::make_strand(ioc)};
  tcp::acceptor acceptor{ioc};
  net::steady_timer accept_timer{ioc};
  net::steady_timer heartbeat_timer{ioc};  // used only by its own handler chain
  std::vector<std::thread> threads;
  // Runs GenerationService::Start (HttpServerOptions::prepare_threads).
  std::unique_ptr<net::thread_pool> prepare_pool;
  std::atomic<bool> stopped{false};
  std::atomic<int> active{0};               // sessions with a request in flight
  std::atomic<int64_t> session_objects{0};  // Session objects alive (HttpServer::SessionObjects)
  std::atomic<size_t> body_bytes{0};        // reserved by request bodies being read
  std::atomic<bool> draining{false};        // Drain(): no new connections
  std::unique_ptr<net::ssl::context> tls;   // HTTPS: set when options name a certificate
  absl::Mutex mu;
  std::set<std::shared_ptr<Session>> sessions ABSL_GUARDED_BY(mu);

  void Accept();
  // Beats options.heartbeat and runs again after kHeartbeatPeriod, until the server stops.
  void Heartbeat() {
    options.heartbeat->Beat();
    heartbeat_timer.expires_after(kHeartbeatPeriod);
    heartbeat_timer.async_wait([this](beast::error_code ec) {
      if (!ec && !stopped.load()) Heartbeat();
    });
  }
};

namespace {

// Forwards a service's callbacks (any thread) onto the session's strand.
class SessionSink;

class Session : public std::enable_shared_from_this<Session> {
 public:
  Session(tcp::socket socket, HttpServer::Impl* server)
      : stream_(server->tls ? SessionStream(std::move(socket), *server->tls)
                            : SessionStream(std::move(socket))),
        server_(server),
        read_timer_(stream_.get_executor()),
        write_timer_(stream_.get_executor()) {
    server_->session_objects.fetch_add(1);
  }

  ~Session() {
    server_->session_objects.fetch_sub(1);
    if (active_) server_->active.fetch_sub(1);
    ReleaseBody();
  }

  // Called on the strand: active_ and the server's count together.
  void SetActive(bool active) {
    if (active != active_) server_->active.fetch_add(active ? 1 : -1);
    active_ = active;
    live_gen_.store(active ? generation_id_ : 0);
  }

  // Called on the strand (HttpServer::Drain): a request still running ends with a 503 (an SSE
  // error event once the stream's headers are out; never a cut event), then the connection closes.
  bool EndForShutdown() {
    if (!active_) return false;
    keep_alive_ = false;
    ending_ = true;
    OnError(generation_id_, ShuttingDown());
    return true;
  }
  bool Ending() const { return ending_.load(); }

  // A TLS connection must finish its handshake within header_timeout; then requests are read.
  void Run() {
    net::dispatch(stream_.get_executor(), [self = shared_from_this()] {
      const auto header_timeout = self->server_->options.header_timeout;
      if (self->stream_.tls()) self->ArmReadTimer(header_timeout, OnDeadline::kClose);
      self->stream_.Handshake([self, header_timeout](beast::error_code ec) {
        self->StopReadTimer();
        if (ec) return self->Finish();
        self->ArmReadTimer(header_timeout, OnDeadline::kCancelRead);
        self->Read();
      });
    });
  }

  // Called on the strand. Cancels any generation and closes the connection.
  void Shutdown() {
    closed_ = true;
    CancelGeneration();
    StopReadTimer();
    ClearWriteTimeout();
    beast::error_code ec;
    stream_.tcp().socket().shutdown(tcp::socket::shutdown_both, ec);
    stream_.tcp().close();
  }

  template <typename F>
  void Post(F&& f) {
    net::post(stream_.get_executor(), std::forward<F>(f));
  }

  void OnDelta(uint64_t gen, ChoiceDelta delta);
  void OnComplete(uint64_t gen, Usage usage);
  void OnError(uint64_t gen, ApiError error);
  void OnStarted(uint64_t gen, StartResult started);

 private:
  // Reads a request; the caller has armed its header deadline (ArmReadTimer, kCancelRead).
  void Read() {
    if (closed_) return;
    parser_.emplace();
    parser_->body_limit(server_->options.max_body_bytes);
    empty_lines_ = 0;
    ReadRequestStart();
  }
  // Reads until buffer_ holds more than empty lines, then the header (OnHeader).
  void ReadRequestStart() {
    if (SkipEmptyLines()) {
      return http::async_read_header(
          stream_, buffer_, *parser_,
          [self = shared_from_this()](beast::error_code ec, size_t) { self->OnHeader(ec); });
    }
    stream_.async_read_some(buffer_.prepare(kReadAheadBytes),
                            [self = shared_from_this()](beast::error_code ec, size_t n) {
                              self->buffer_.commit(n);
                              if (ec) return self->OnHeader(ec);
                              self->ReadRequestStart();
                            });
  }
  // RFC 9112 2.2: a server SHOULD ignore at least one empty line received before the request
  // line (clients may send a CRLF after a POST body). Beast's parser reads one as a bad method,
  // so they are dropped here, up to kMaxEmptyLines per request: those already buffered (the last
  // request's leftovers or the disconnect watch's read-ahead) and those that arrive when the read
  // starts. Past the bound the parser gets them (400). True when buffer_ holds what the parser
  // is to read; false when it holds nothing or a lone CR, whose LF may still come.
  bool SkipEmptyLines() {
    const auto bytes = static_cast<const char*>(buffer_.data().data());
    const size_t size = buffer_.size();
    size_t n = 0;
    while (n < size && empty_lines_ < kMaxEmptyLines &&
           (bytes[n] == '\n' || (bytes[n] == '\r' && n + 1 < size && bytes[n + 1] == '\n'))) {
      n += bytes[n] == '\r' ? 2 : 1;
      ++empty_lines_;
    }
    const bool lone_cr = n + 1 == size && bytes[n] == '\r' && empty_lines_ < kMaxEmptyLines;
    buffer_.consume(n);
    return n < size && !lone_cr;
  }

  // Counts the body bytes received so far in the server-wide budget (they are counted as they
  // arrive, not as declared: connections that announce large bodies and send nothing hold
  // nothing); false, with what was counted before kept, when the new bytes do not fit.
  bool ReserveArrived() {
    const size_t have = parser_->get().body().size();
    if (have <= reserved_body_) return true;
    const size_t more = have - reserved_body_;
    if (server_->body_bytes.fetch_add(more) + more > server_->options.max_buffered_body_bytes) {
      server_->body_bytes.fetch_sub(more);
      return false;
    }
    reserved_body_ = have;
    return true;
  }
  void ReleaseBody() {
    if (reserved_body_ == 0) return;
    server_->body_bytes.fetch_sub(reserved_body_);
    reserved_body_ = 0;
  }

  // Answers "Expect: 100-continue" (curl sends it for large bodies) before reading the body.
  void OnHeader(beast::error_code ec) {
    if (ec) return OnRead(ec);
    StopReadTimer();  // ReadBody arms the body's; a 100 Continue needs none
    if (beast::iequals(parser_->get()[http::field::expect], "100-continue")) {
      auto cont = std::make_shared<http::response<http::empty_body>>(http::status::continue_,
                                                                     parser_->get().version());
      ArmWriteTimeout();
      http::async_write(stream_, *cont,
                        [self = shared_from_this(), cont](beast::error_code wec, size_t) {
                          self->ClearWriteTimeout();
                          if (wec) return self->Finish();
                          self->ReadBody();
                        });
      return;
    }
    ReadBody();
  }

  // Deadlines. Reads and writes each have a timer of their own, never the tcp_stream's expiry:
  // that one is shared by the stream's reads and writes and applies to whichever is not pending
  // when it is set, so over TLS (where a read may write a record, a write may read) a write's
  // deadline could land on the disconnect watch's read or the next request's header read.
  // `*_timer_id_` tells a current expiry from one already queued when its operation finished
  // (cancel() cannot withdraw that one).
  //
  // What a read deadline does when it passes.
  enum class OnDeadline {
    kCancelRead,  // header or body: the read is cancelled, so that a 408 can still be written
    kClose,       // TLS handshake, Linger, a cancelled read that did not end: the connection closes
  };
  void ArmReadTimer(std::chrono::milliseconds timeout, OnDeadline on_deadline) {
    const uint64_t id = ++read_timer_id_;
    if (closed_) return;  // a completion that ran after Finish: nothing to time
    read_timer_.expires_after(timeout);
    read_timer_.async_wait([self = shared_from_this(), id, on_deadline](beast::error_code ec) {
      if (ec || id != self->read_timer_id_) return;
      self->OnReadDeadline(on_deadline);
    });
  }
  void StopReadTimer() {
    ++read_timer_id_;
    read_timed_out_ = false;
    read_timer_.cancel();
  }
  // Cancelling the socket ends every operation pending on it, also a record the TLS layer writes
  // inside a read; the read's handler then sees read_timed_out_. A read that does not end anyway
  // (a step that completed as the cancel ran starts the next one uncancelled) is closed after
  // kCancelledReadGrace. With the disconnect watch not yet ended since ReadNext cancelled it
  // (a cancel that did not take), the connection closes without a 408, even where the watch
  // had read part of the next request ahead.
  void OnReadDeadline(OnDeadline on_deadline) {
    if (on_deadline == OnDeadline::kClose || read_after_watch_) return Finish();
    beast::error_code ignored;
    stream_.tcp().socket().cancel(ignored);
    ArmReadTimer(kCancelledReadGrace, OnDeadline::kClose);
    read_timed_out_ = true;
  }
  // Each response write must be taken by the client within write_timeout, else the connection
  // closes (Finish: closing ends the write, also one the TLS layer waits to start) and its
  // request is cancelled. Cleared when the write completes.
  void ArmWriteTimeout() {
    const uint64_t id = ++write_timer_id_;
    if (closed_) return;
    write_timer_.expires_after(server_->options.write_timeout);
    write_timer_.async_wait([self = shared_from_this(), id](beast::error_code ec) {
      if (ec || id != self->write_timer_id_) return;
      self->Finish();
    });
  }
  void ClearWriteTimeout() {
    ++write_timer_id_;
    write_timer_.cancel();
  }

  // A read cut off by its deadline: 408 when any of the request arrived, else (an idle
  // keep-alive connection) a silent close.
  void OnReadTimeout() {
    const bool started = parser_->is_header_done() || parser_->got_some() || buffer_.size() > 0;
    if (!started) return Finish();
    CountRefused(408);
    keep_alive_ = false;
    linger_ = true;
    const unsigned version = parser_->is_header_done() ? parser_->get().version() : 11;
    request_ = {};
    request_.version(version);
    SendError(ServerError(408,
                          parser_->is_header_done() ? "the request body did not arrive in time"
                                                    : "the request headers did not arrive in time",
                          "invalid_request_error", "request_timeout"));
  }

  void ReadBody() {
    ArmReadTimer(server_->options.body_timeout, OnDeadline::kCancelRead);
    ReadSomeBody();
  }
  // The body a piece at a time, each piece counted in the budget as it lands.
  void ReadSomeBody() {
    if (parser_->is_done()) return OnRead({});
    http::async_read_some(
        stream_, buffer_, *parser_,
        [self = shared_from_this()](beast::error_code ec, size_t) { self->OnBodyPiece(ec); });
  }
  void OnBodyPiece(beast::error_code ec) {
    if (ec) return OnRead(ec);
    if (!ReserveArrived()) {
      StopReadTimer();
      ReleaseBody();
      CountRefused(503);
      keep_alive_ = false;
      linger_ = true;
      const unsigned version = parser_->get().version();
      request_ = {};
      request_.version(version);
      return SendError(ServerError(503, "too many request bodies are being received; retry later",
                                   "server_error", "server_busy"));
    }
    ReadSomeBody();
  }

  void OnRead(beast::error_code ec) {
    // (A read that completed as its deadline fired is served.)
    const bool timed_out = read_timed_out_ && ec;
    StopReadTimer();
    if (timed_out) {
      ReleaseBody();
      return OnReadTimeout();
    }
    if (ec == http::error::body_limit) {
      CountRefused(413);
      keep_alive_ = false;
      linger_ = true;
      ApiError e = InvalidRequest(
          absl::StrCat("request body exceeds ", server_->options.max_body_bytes, " bytes"));
      e.http_status = 413;
      return SendJson(413, e.ToJson());
    }
    if (ec == http::error::header_limit) {
      CountRefused(431);
      keep_alive_ = false;
      linger_ = true;
      ApiError e = InvalidRequest("request header fields too large");
      e.http_status = 431;
      return SendJson(431, e.ToJson());
    }
    if (ec && IsHttpParseError(ec)) {
      CountRefused(400);
      keep_alive_ = false;
      linger_ = true;
      return SendError(InvalidRequest(absl::StrCat("malformed HTTP request: ", ec.message())));
    }
    ReleaseBody();
    if (ec) return Finish();
    request_ = parser_->release();
    keep_alive_ = request_.keep_alive();
    Route();
  }

  // Counts a refusal of the request being read (the service's RecordRefused): under the API
  // endpoint its request line named; not at all for another path (as its 404 is not); without
  // an endpoint when the request line did not arrive or parse. (Beast parses the request line
  // as soon as it is there, so a header over the limit or cut off still names its target; a
  // Content-Length over the body limit is refused before the header counts as done.)
  void CountRefused(int http_status) {
    std::optional<Endpoint> endpoint;
    const auto target = parser_ ? parser_->get().target() : beast::string_view();
    if (!target.empty()) {
      endpoint = ApiEndpoint(std::string_view(target.data(), target.size()));
      if (!endpoint) return;
    }
    server_->service->RecordRefused(endpoint, http_status);
  }

  void Route();
  void Generate(Endpoint endpoint);
  void WatchDisconnect();
  // The next request on this connection, whose header deadline starts now, with the response
  // out. A disconnect watch still reading is cancelled first and its end starts the read
  // (ReadAfterWatch): a stream takes one read at a time.
  void ReadNext() {
    if (closed_) return;  // Finish ran (e.g. the write deadline) before the write's handler
    ArmReadTimer(server_->options.header_timeout, OnDeadline::kCancelRead);
    if (!watch_reading_) return Read();
    read_after_watch_ = true;
    beast::error_code ignored;
    stream_.tcp().socket().cancel(ignored);
  }
  void ReadAfterWatch(beast::error_code ec) {
    read_after_watch_ = false;
    if (closed_ || !stream_.tcp().socket().is_open()) return StopReadTimer();
    if (ec && ec != net::error::operation_aborted) return Finish();  // gone after its response
    Read();
  }
  void CancelGeneration() {
    if (generation_) {
      generation_->Cancel();
      generation_.reset();
    }
    ++generation_id_;
    SetActive(false);
  }

  // `allow`: the Allow header of a 405 (RFC 9110 15.5.6). A HEAD request gets the header of the
  // GET response (Content-Length included) and no body.
  void SendJson(int status, std::string body, const char* content_type = "application/json",
                const char* allow = nullptr) {
    auto res = std::make_shared<http::response<http::string_body>>(
        static_cast<http::status>(status), request_.version());
    res->set(http::field::server, "pdserve");
    res->set(http::field::content_type, content_type);
    if (status == 429) res->set(http::field::retry_after, "1");
    if (allow != nullptr) res->set(http::field::allow, allow);
    res->keep_alive(keep_alive_);
    res->body() = std::move(body);
    res->prepare_payload();
    if (request_.method() == http::verb::head) res->body().clear();
    ArmWriteTimeout();
    http::async_write(stream_, *res,
                      [self = shared_from_this(), res](beast::error_code ec, size_t) {
                        self->ClearWriteTimeout();
                        if (!ec && self->linger_) return self->Linger();
                        if (ec || !self->keep_alive_) return self->Finish();
                        self->ReadNext();
                      });
  }

  // Called on the strand once the error response is out. Closing a socket that holds unread
  // input resets the connection, and a client still writing its request (most send the whole
  // body before reading) then loses the response too. So, as RFC 9112 9.6 asks: close the sending
  // side, read and drop what still comes until the client closes or kLingerTimeout passes (no
  // buffering: one scratch buffer), then close.
  void Linger() {
    linger_ = false;
    if (closed_) return;
    ReleaseBody();
    beast::error_code ignored;
    stream_.tcp().socket().shutdown(tcp::socket::shutdown_send, ignored);
    linger_buffer_.resize(kLingerReadBytes);
    ArmReadTimer(kLingerTimeout, OnDeadline::kClose);
    DropInput();
  }
  void DropInput() {
    stream_.async_read_some(net::buffer(linger_buffer_),
                            [self = shared_from_this()](beast::error_code ec, size_t) {
                              if (ec) return self->Finish();
                              self->DropInput();
                            });
  }

  void SendError(const ApiError& e) { SendJson(e.http_status, e.ToJson()); }
  // 405 naming the methods `target` takes.
  void SendMethodNotAllowed(bool post) {
    const ApiError e{405, post ? "use POST" : "use GET", "invalid_request_error"};
    SendJson(e.http_status, e.ToJson(), "application/json", post ? "POST" : "GET, HEAD");
  }

  // Streaming: header, then chunks, then the last chunk; one write in flight at a time.
  enum class OutKind { kChunk, kLast };
  void Enqueue(OutKind kind, std::string data) {
    queued_bytes_ += data.size();
    out_.push_back({kind, std::move(data)});
    if (kind == OutKind::kChunk && active_ && queued_bytes_ > server_->options.stream_queue_bytes &&
        !SlowReaderKeepsUp()) {
      return;
    }
    // The stream's header goes out with its first event, so that an error before any output
    // still gets its own HTTP status and JSON body (OnError).
    if (!header_started_) {
      header_started_ = true;
      return WriteHeader();
    }
    if (!writing_ && header_written_) WriteNext();
  }
  // Called with more than stream_queue_bytes queued (HttpServerOptions): whether the stream may
  // go on. A client that has taken nothing for its StallAllowance(), or that has let
  // max_stream_queue_bytes pile up, has its stream ended (EndSlowStream) and false is returned.
  // Taking something: a write completed, or the peer acknowledged more bytes (TcpBytesAcked)
  // than at the previous look; a client reading slowly through a large send buffer completes no
  // write for seconds.
  bool SlowReaderKeepsUp() {
    const auto& options = server_->options;
    const auto now = std::chrono::steady_clock::now();
    SampleAcked(now);
    const auto idle = std::chrono::duration_cast<std::chrono::milliseconds>(now - last_progress_);
    if (idle >= StallAllowance()) {
      spdlog::warn(
          "client took none of its stream for {} ms ({} bytes queued, {} written, {} acknowledged "
          "by the client, longest earlier pause {} ms); ending {}",
          idle.count(), queued_bytes_, sent_bytes_, acked_bytes_,
          longest_pause_ ? longest_pause_->count() : -1, meta_.id);
      EndSlowStream(StreamStalled(idle.count()));
      return false;
    }
    if (queued_bytes_ > std::max(options.max_stream_queue_bytes, options.stream_queue_bytes)) {
      spdlog::warn(
          "client reads its stream slower than it is produced ({} bytes queued, {} sent); ending "
          "{}",
          queued_bytes_, sent_bytes_, meta_.id);
      EndSlowStream(StreamTooSlow(queued_bytes_));
      return false;
    }
    return true;
  }
  // Reads the peer's acknowledged byte count (at most every stall timeout / 50); growth is
  // progress. The first look of a stream is only the baseline its pauses are measured from.
  void SampleAcked(std::chrono::steady_clock::time_point now) {
    const auto timeout = server_->options.stream_stall_timeout;
    if (pause_from_ && now - last_ack_look_ < timeout / 50) return;
    last_ack_look_ = now;
    const std::optional<uint64_t> acked = TcpBytesAcked(stream_.tcp().socket().native_handle());
    const bool grew = acked && *acked != acked_bytes_;
    if (acked) acked_bytes_ = *acked;
    if (!pause_from_) {
      pause_from_ = now;
      if (grew) last_progress_ = now;
      return;
    }
    if (grew) NoteProgress(now);
  }
  // The client took something at `now`. While the stream is past stream_queue_bytes (its client
  // is what holds it back), a time without progress of a tenth of the stall timeout or more is a
  // pause of the client, remembered for StallAllowance().
  void NoteProgress(std::chrono::steady_clock::time_point now) {
    if (pause_from_) {
      const auto pause = std::chrono::duration_cast<std::chrono::milliseconds>(now - *pause_from_);
      if (pause >= server_->options.stream_stall_timeout / 10) {
        longest_pause_ = std::max(longest_pause_.value_or(pause), pause);
      }
      pause_from_ = now;
    }
    last_progress_ = now;
  }
  // How long the client may take nothing before its stream counts as stalled: twice its longest
  // pause so far, within one to two stall timeouts; two before it has paused at all. A client
  // that reads from a full receive buffer is acknowledged only when its kernel opens the window
  // again, after it has read a part of the buffer (docs/operations.md, "Slow stream readers"):
  // seconds with a large buffer, and a stopped client looks the same until then.
  std::chrono::milliseconds StallAllowance() const {
    const auto timeout = server_->options.stream_stall_timeout;
    if (!longest_pause_) return 2 * timeout;
    return std::clamp(2 * *longest_pause_, timeout, 2 * timeout);
  }
  // Ends the current stream at an event boundary: cancels the request, drops the events not yet
  // started (the one being written, if any, finishes), then sends `error` as an error event and
  // the end of the body; the connection closes after it (as OnError's).
  void EndSlowStream(const ApiError& error) {
    server_->service->RecordStreamEnded(api_.endpoint, Front::kHttp, error.code);
    CancelGeneration();
    close_after_stream_ = true;
    const size_t keep = writing_ && header_written_ ? 1 : 0;
    while (out_.size() > keep) {
      queued_bytes_ -= out_.back().data.size();
      out_.pop_back();
    }
    std::string event = StreamErrorEvent(error);
    queued_bytes_ += event.size();
    out_.push_back({OutKind::kChunk, std::move(event)});
    out_.push_back({OutKind::kLast, ""});
    if (!header_started_) {
      header_started_ = true;
      return WriteHeader();
    }
    if (!writing_ && header_written_) WriteNext();
  }
  void WriteHeader() {
    stream_res_.emplace(http::status::ok, request_.version());
    stream_res_->set(http::field::server, "pdserve");
    stream_res_->set(http::field::content_type, "text/event-stream");
    stream_res_->set(http::field::cache_control, "no-cache");
    // HTTP/1.0 has no chunked encoding: the body is the events, ended by closing.
    chunked_ = request_.version() >= 11;
    if (!chunked_) keep_alive_ = false;
    // A connection that closes after the stream says so ("Connection: close" on HTTP/1.1): the
    // client asked for it, half-closed (allow_half_close) or has its stream ended already.
    stream_res_->keep_alive(keep_alive_ && !close_after_stream_);
    stream_res_->chunked(chunked_);
    stream_sr_.emplace(*stream_res_);
    writing_ = true;
    last_progress_ = std::chrono::steady_clock::now();
    acked_bytes_ = TcpBytesAcked(stream_.tcp().socket().native_handle()).value_or(0);
    pause_from_.reset();
    longest_pause_.reset();
    sent_bytes_ = 0;
    ArmWriteTimeout();
    http::async_write_header(stream_, *stream_sr_,
                             [self = shared_from_this()](beast::error_code ec, size_t) {
                               self->ClearWriteTimeout();
                               self->writing_ = false;
                               self->header_written_ = true;
                               if (ec) return self->Finish();
                               self->WriteNext();
                             });
  }
  void WriteNext() {
    if (out_.empty() || writing_) return;
    writing_ = true;
    auto done = [self = shared_from_this()](beast::error_code ec, size_t) {
      self->ClearWriteTimeout();
      self->writing_ = false;
      const bool last = self->out_.front().kind == OutKind::kLast;
      self->queued_bytes_ -= self->out_.front().data.size();
      self->sent_bytes_ += self->out_.front().data.size();
      self->NoteProgress(std::chrono::steady_clock::now());
      self->out_.pop_front();
      if (ec) return self->Finish();
      if (last) {
        self->header_written_ = false;
        self->header_started_ = false;
        if (!self->keep_alive_ || self->close_after_stream_) return self->Finish();
        return self->ReadNext();
      }
      self->WriteNext();
    };
    ArmWriteTimeout();
    if (!chunked_) {
      // kLast is an empty write: `done` then closes the connection (keep_alive_ is off).
      net::async_write(stream_, net::buffer(out_.front().data), std::move(done));
    } else if (out_.front().kind == OutKind::kLast) {
      net::async_write(stream_, http::make_chunk_last(), std::move(done));
    } else {
      net::async_write(stream_, http::make_chunk(net::buffer(out_.front().data)), std::move(done));
    }
  }

  void Finish();

  SessionStream stream_;
  HttpServer::Impl* server_;
  beast::flat_buffer buffer_;
  std::optional<http::request_parser<http::string_body>> parser_;
  http::request<http::string_body> request_;
  bool keep_alive_ = true;
  bool linger_ = false;  // the response answers a request not read to its end: Linger() after it
  std::vector<char> linger_buffer_;
  net::steady_timer read_timer_;  // the handshake / header / body / linger deadline (ArmReadTimer)
  uint64_t read_timer_id_ = 0;
  bool read_timed_out_ = false;
  // Shutdown ran: completions that arrive after it start no read and arm no timer, so nothing
  // holds the session past its close (a write's handler may still run after its deadline's Finish).
  bool closed_ = false;
  int empty_lines_ = 0;            // skipped before the current request line (SkipEmptyLines)
  net::steady_timer write_timer_;  // the deadline of the write in flight (ArmWriteTimeout)
  uint64_t write_timer_id_ = 0;
  bool watch_reading_ = false;     // WatchDisconnect's read is in flight
  bool read_after_watch_ = false;  // ReadNext waits for it to end

  // The request being served.
  ApiRequest api_;
  ResponseMeta meta_;
  std::unique_ptr<Generation> generation_;
  uint64_t generation_id_ = 0;
  bool active_ = false;
  // generation_id_ while a request is active, else 0: the prepare pool skips the Start of a
  // request that ended while it waited (client gone, drain).
  std::atomic<uint64_t> live_gen_{0};
  std::atomic<bool> ending_{false};   // EndForShutdown ran
  std::vector<ChoiceDelta> choices_;  // non-streamed: accumulated per choice
  std::vector<bool> first_sent_;      // streamed: role delta sent per choice
  std::vector<size_t> text_offsets_;  // streamed: each choice's text_offset so far
  std::optional<http::response<http::empty_body>> stream_res_;
  std::optional<http::response_serializer<http::empty_body>> stream_sr_;
  struct Out {
    OutKind kind;
    std::string data;
  };
  std::deque<Out> out_;
  size_t queued_bytes_ = 0;
  size_t sent_bytes_ = 0;  // of the current stream's events
  // The current stream's client (SlowReaderKeepsUp): when it last took something; the peer's
  // acknowledged byte count at the last look, and when that was; since when its current pause
  // is measured (set from the first look past stream_queue_bytes) and its longest pause so far.
  std::chrono::steady_clock::time_point last_progress_;
  uint64_t acked_bytes_ = 0;
  std::chrono::steady_clock::time_point last_ack_look_;
  std::optional<std::chrono::steady_clock::time_point> pause_from_;
  std::optional<std::chrono::milliseconds> longest_pause_;
  bool writing_ = false;
  bool header_written_ = false;
  bool header_started_ = false;  // WriteHeader() called for the current stream
  bool close_after_stream_ = false;
  bool chunked_ = true;       // the current stream's body is chunked (HTTP/1.1)
  size_t reserved_body_ = 0;  // bytes of the server's body budget held while reading
};

class SessionSink : public GenerationSink {
 public:
  SessionSink(std::weak_ptr<Session> session, uint64_t gen)
      : session_(std::move(session)), gen_(gen) {}
  void OnDelta(ChoiceDelta delta) override {
    if (auto s = session_.lock())
      s->Post([s, g = gen_, d = std::move(delta)]() mutable { s->OnDelta(g, std::move(d)); });
  }
  void OnComplete(Usage usage) override {
    if (auto s = session_.lock()) s->Post([s, g = gen_, usage] { s->OnComplete(g, usage); });
  }
  void OnError(ApiError error) override {
    if (auto s = session_.lock())
      s->Post([s, g = gen_, e = std::move(error)]() mutable { s->OnError(g, std::move(e)); });
  }

 private:
  std::weak_ptr<Session> session_;
  uint64_t gen_;
};

// A body this server cannot read as sent: a transfer coding other than chunked (501, RFC 9112
// 6.1: Beast frames only chunked and Content-Length bodies, so "gzip, chunked" would reach the
// JSON parser compressed) or a content coding other than identity (415, RFC 9110 15.5.16; the
// API takes uncompressed JSON). nullopt when the body can be read.
std::optional<ApiError> UnsupportedCoding(const http::request<http::string_body>& request) {
  auto lower = [](beast::string_view v) {
    std::string out(v.data(), v.size());
    absl::AsciiStrToLower(&out);
    return std::string(absl::StripAsciiWhitespace(out));
  };
  for (const auto& field : request.base()) {
    if (field.name() == http::field::transfer_encoding) {
      const std::string value = lower(field.value());
      if (value != "chunked") {
        return ApiError{501,
                        absl::StrCat("Transfer-Encoding \"", value,
                                     "\" is not supported: send the body with Content-Length or "
                                     "Transfer-Encoding: chunked"),
                        "invalid_request_error", "", "unsupported_transfer_encoding"};
      }
    } else if (field.name() == http::field::content_encoding) {
      const std::string value = lower(field.value());
      if (value != "identity" && !value.empty()) {
        return ApiError{415,
                        absl::StrCat("Content-Encoding \"", value,
                                     "\" is not supported: send the JSON body uncompressed"),
                        "invalid_request_error", "", "unsupported_content_encoding"};
      }
    }
  }
  return std::nullopt;
}

void Session::Route() {
  const std::string_view target =
      TargetPath(std::string_view(request_.target().data(), request_.target().size()));
  const auto method = request_.method();
  const bool get = method == http::verb::get || method == http::verb::head;
  auto* service = server_->service;
  // Probes and Prometheus reach /health, /ready and /metrics without a key; the API needs one,
  // in exactly one Authorization header (two are refused: a proxy and the client disagreeing).
  const auto& keys = server_->options.api_keys;
  const auto authorization = request_[http::field::authorization];
  if (keys && target.starts_with("/v1/") &&
      (request_.count(http::field::authorization) != 1 ||
       !keys->Matches(std::string_view(authorization.data(), authorization.size())))) {
    if (target == "/v1/completions" || target == "/v1/chat/completions") {
      service->RecordRejected(
          target == "/v1/completions" ? Endpoint::kCompletions : Endpoint::kChatCompletions,
          Front::kHttp, 401);
    }
    return SendError(InvalidApiKey());
  }
  if (target == "/health") {
    if (!get) return SendMethodNotAllowed(false);
    return SendJson(200, R"({"status":"ok"})");
  }
  if (target == "/ready") {
    if (!get) return SendMethodNotAllowed(false);
    return service->Ready() ? SendJson(200, R"({"status":"ready"})")
                            : SendJson(503, R"({"status":"not ready"})");
  }
  if (target == "/metrics") {
    if (!get) return SendMethodNotAllowed(false);
    return SendJson(200, service->MetricsText(), "text/plain; version=0.0.4");
  }
  if (target == "/v1/models") {
    if (!get) return SendMethodNotAllowed(false);
    nlohmann::json data = nlohmann::json::array();
    for (const auto& name : service->ListedModelNames()) {
      data.push_back({{"id", name},
                      {"object", "model"},
                      {"created", server_->started},
                      {"owned_by", "pdserve"}});
      if (service->MaxModelLength() > 0) data.back()["max_model_len"] = service->MaxModelLength();
    }
    return SendJson(200, nlohmann::json{{"object", "list"}, {"data", data}}.dump());
  }
  // OpenAI's retrieve model: GET /v1/models/{model}, any name the server accepts.
  if (constexpr std::string_view kModel = "/v1/models/"; target.starts_with(kModel)) {
    if (!get) return SendMethodNotAllowed(false);
    // Percent-decoded: a client that encodes path parameters sends "org/model" as org%2Fmodel.
    const std::string name = PercentDecode(target.substr(kModel.size()));
    const auto names = service->ModelNames();
    if (std::find(names.begin(), names.end(), name) == names.end()) {
      return SendError(ModelNotFound(name));
    }
    nlohmann::json model = {
        {"id", name}, {"object", "model"}, {"created", server_->started}, {"owned_by", "pdserve"}};
    // The same fields as the list's entry (vLLM's max_model_len included).
    if (service->MaxModelLength() > 0) model["max_model_len"] = service->MaxModelLength();
    return SendJson(200, model.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace));
  }
  if (target == "/v1/completions" || target == "/v1/chat/completions") {
    if (method != http::verb::post) return SendMethodNotAllowed(true);
    const Endpoint endpoint =
        target == "/v1/completions" ? Endpoint::kCompletions : Endpoint::kChatCompletions;
    if (std::optional<ApiError> coding = UnsupportedCoding(request_)) {
      service->RecordRejected(endpoint, Front::kHttp, coding->http_status);
      // An unknown transfer coding leaves the body's end unknown: the connection closes after.
      if (coding->http_status == 501) keep_alive_ = false;
      return SendError(*coding);
    }
    return Generate(endpoint);
  }
  SendError({404, absl::StrCat("no route for ", std::string(target)), "invalid_request_error"});
}

void Session::Generate(Endpoint endpoint) {
  ParsedRequest parsed = ParseRequest(endpoint, request_.body());
  if (auto* err = std::get_if<ApiError>(&parsed)) {
    server_->service->RecordRejected(endpoint, Front::kHttp, err->http_status);
    return SendError(*err);
  }
  api_ = std::move(std::get<ApiRequest>(parsed));
  const auto names = server_->service->ModelNames();
  if (std::find(names.begin(), names.end(), api_.model) == names.end()) {
    ApiError e = ModelNotFound(api_.model);
    server_->service->RecordRejected(endpoint, Front::kHttp, e.http_status);
    return SendError(e);
  }
  // The body stays in the budget of buffered bodies until Start has run (max_buffered_body_bytes):
  // requests waiting for a prepare thread hold their bodies (and a copy) too.
  const size_t held = request_.body().size();
  if (server_->body_bytes.fetch_add(held) + held > server_->options.max_buffered_body_bytes) {
    server_->body_bytes.fetch_sub(held);
    server_->service->RecordRejected(endpoint, Front::kHttp, 503);
    return SendError(ServerError(503, "too many request bodies are being received; retry later",
                                 "server_error", "server_busy"));
  }
  meta_ = {NewResponseId(endpoint),
           std::chrono::duration_cast<std::chrono::seconds>(
               std::chrono::system_clock::now().time_since_epoch())
               .count(),
           api_.model};
  choices_.assign(static_cast<size_t>(api_.n), ChoiceDelta{});
  for (int i = 0; i < api_.n; ++i) choices_[static_cast<size_t>(i)].index = i;
  first_sent_.assign(static_cast<size_t>(api_.n), false);
  text_offsets_.assign(static_cast<size_t>(api_.n), 0);
  const uint64_t gen = ++generation_id_;
  SetActive(true);
  close_after_stream_ = false;
  header_started_ = false;
  WatchDisconnect();
  // Start tokenizes the prompt (a second or more for megabytes) and admits the request: on the
  // prepare pool, not on this I/O thread, which serves other connections meanwhile. Deltas may
  // reach the strand before OnStarted does; api_ and the choices are set already, and a request
  // that ended meanwhile (client gone, drain) has moved generation_id_ on.
  net::post(*server_->prepare_pool, [self = shared_from_this(), gen, held, api = api_] {
    HttpServer::Impl* server = self->server_;
    // A request that ended while it waited is not started (OnStarted drops this result).
    const bool ended = self->live_gen_.load() != gen;
    StartResult started =
        server->stopped.load() || ended
            ? StartResult(ShuttingDown())
            : server->service->Start(api, std::make_shared<SessionSink>(self, gen));
    server->body_bytes.fetch_sub(held);
    self->Post([self, gen, started = std::move(started)]() mutable {
      self->OnStarted(gen, std::move(started));
    });
  });
}

// Called on the strand with Start's result for request `gen`.
void Session::OnStarted(uint64_t gen, StartResult started) {
  auto* generation = std::get_if<std::unique_ptr<Generation>>(&started);
  if (gen != generation_id_ || !active_) {
    // Ended before its Start returned (client gone, drain, or already complete): stop its work.
    if (generation != nullptr && *generation) (*generation)->Cancel();
    return;
  }
  if (auto* err = std::get_if<ApiError>(&started)) return OnError(gen, std::move(*err));
  generation_ = std::move(*generation);
}

// The peer closed (or reset) its side: cancel the request's work. The watch is a read of the
// stream into buffer_, where the next request's parse finds what it took: bytes the client sends
// meanwhile (a pipelined request, a stray CRLF) are kept and the watch goes on, and over TLS only
// a read through the TLS layer tells a close_notify alert (curl, Go and others send one when they
// give up on a request) from data. At most kReadAheadBytes are read ahead; past them the watch
// stops and the request runs to its end. ReadNext() cancels a watch still reading when the
// response is out, since a stream takes one read at a time.
// With allow_half_close, end of stream is not proof either: a client that half-closed after its
// request (shutdown(SHUT_WR), as `nc -N` does) may still read the response (RFC 9112 9.6), and
// here it looks the same as one that closed. The request goes on, the connection closes after
// its response, and a client that is really gone is found by the first write that fails (the
// next streamed chunk, or the response: Finish). The watch stops then.
void Session::WatchDisconnect() {
  if (watch_reading_ || buffer_.size() >= kReadAheadBytes) return;
  watch_reading_ = true;
  stream_.async_read_some(
      buffer_.prepare(kReadAheadBytes - buffer_.size()),
      [self = shared_from_this(), gen = generation_id_](beast::error_code ec, size_t n) {
        self->watch_reading_ = false;
        self->buffer_.commit(n);
        if (self->read_after_watch_) return self->ReadAfterWatch(ec);
        if (gen != self->generation_id_ || !self->active_) return;
        if (!ec) return self->WatchDisconnect();  // read ahead of the next request
        const bool end_of_stream = ec == net::error::eof || ec == net::ssl::error::stream_truncated;
        if (end_of_stream && self->server_->options.allow_half_close) {
          spdlog::debug("client half-closed; {} goes on, the connection closes after it",
                        self->meta_.id);
          self->keep_alive_ = false;
          return;
        }
        spdlog::info("client disconnected; cancelling {}", self->meta_.id);
        self->Finish();
      });
}

void Session::OnDelta(uint64_t gen, ChoiceDelta delta) {
  if (gen != generation_id_ || !active_) return;
  const size_t i = static_cast<size_t>(delta.index);
  if (i >= choices_.size()) return;
  if (api_.stream) {
    const bool first = !first_sent_[i];
    first_sent_[i] = true;
    const size_t offset = text_offsets_[i];
    text_offsets_[i] += StreamTextLength(delta);
    Enqueue(OutKind::kChunk, StreamChunk(api_, meta_, delta, first, offset));
    return;
  }
  AppendDelta(std::move(delta), choices_[i]);
}

void Session::OnComplete(uint64_t gen, Usage usage) {
  if (gen != generation_id_ || !active_) return;
  SetActive(false);
  generation_.reset();
  if (api_.stream) {
    if (api_.include_usage) Enqueue(OutKind::kChunk, StreamUsageChunk(api_, meta_, usage));
    Enqueue(OutKind::kChunk, kStreamDone);
    Enqueue(OutKind::kLast, "");
    return;
  }
  SendJson(200, FullResponse(api_, meta_, choices_, usage));
}

void Session::OnError(uint64_t gen, ApiError error) {
  if (gen != generation_id_ || !active_) return;
  SetActive(false);
  generation_.reset();
  if (api_.stream && header_started_) {
    // Headers are out: an error event, then end the body and close; no [DONE].
    close_after_stream_ = true;
    Enqueue(OutKind::kChunk, StreamErrorEvent(error));
    Enqueue(OutKind::kLast, "");
    return;
  }
  SendError(error);
}

void Session::Finish() {
  Shutdown();
  absl::MutexLock lock(&server_->mu);
  server_->sessions.erase(shared_from_this());
}

}  // namespace

namespace {

// TLS 1.2 or later with the options' PEM certificate chain and key. Errors: InvalidArgument
// naming the file that could not be used.
absl::StatusOr<std::unique_ptr<net::ssl::context>> TlsContext(const HttpServerOptions& options) {
  auto context = std::make_unique<net::ssl::context>(net::ssl::context::tls_server);
  context->set_options(net::ssl::context::default_workarounds | net::ssl::context::no_sslv2 |
                       net::ssl::context::no_sslv3 | net::ssl::context::no_tlsv1 |
                       net::ssl::context::no_tlsv1_1 | net::ssl::context::single_dh_use);
  beast::error_code ec;
  context->use_certificate_chain_file(options.tls_cert_file, ec);
  if (ec) {
    return absl::InvalidArgumentError(
        absl::StrCat("TLS certificate '", options.tls_cert_file, "': ", ec.message()));
  }
  context->use_private_key_file(options.tls_key_file, net::ssl::context::pem, ec);
  if (ec) {
    return absl::InvalidArgumentError(
        absl::StrCat("TLS key '", options.tls_key_file, "': ", ec.message()));
  }
  return context;
}

}  // namespace

void HttpServer::Impl::Accept() {
  acceptor.async_accept(
      net::make_strand(ioc),
      net::bind_executor(accept_strand, [this](beast::error_code ec, tcp::socket socket) {
        if (stopped || draining) return;
        if (ec) {
          if (ec == net::error::operation_aborted) return;
          spdlog::warn("accept failed: {}; retrying in {} ms", ec.message(),
                       kAcceptBackoff.count());
          accept_timer.expires_after(kAcceptBackoff);
          accept_timer.async_wait(net::bind_executor(accept_strand, [this](beast::error_code) {
            if (!stopped && !draining) Accept();
          }));
          return;
        }
        std::shared_ptr<Session> session;
        {
          absl::MutexLock lock(&mu);
          if (sessions.size() < options.max_connections) {
            session = std::make_shared<Session>(std::move(socket), this);
            sessions.insert(session);
          }
        }
        if (session) {
          session->Run();
        } else {
          beast::error_code ignored;
          socket.close(ignored);  // over the connection cap: refuse rather than queue
        }
        Accept();
      }));
}

HttpServer::HttpServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
HttpServer::~HttpServer() { Stop(); }

absl::StatusOr<std::unique_ptr<HttpServer>> HttpServer::Start(const HttpServerOptions& options,
                                                              GenerationService* service) {
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  // One body of the largest allowed size always fits an idle server: a budget below it would
  // answer such a request "server busy, retry later" forever.
  impl->options.max_buffered_body_bytes =
      std::max(options.max_buffered_body_bytes, options.max_body_bytes);
  impl->service = service;
  if (!options.tls_cert_file.empty() || !options.tls_key_file.empty()) {
    PDSERVE_ASSIGN_OR_RETURN(impl->tls, TlsContext(options));
  }
  beast::error_code ec;
  tcp::endpoint endpoint;
  if (auto address = net::ip::make_address(options.host, ec); !ec) {
    endpoint = tcp::endpoint(address, options.port);
  } else {
    // A host name ("localhost"): its first address.
    tcp::resolver resolver(impl->ioc);
    auto resolved = resolver.resolve(options.host, std::to_string(options.port), ec);
    if (ec || resolved.empty()) {
      return absl::InvalidArgumentError(absl::StrCat("bad listen address '", options.host,
                                                     "': ", ec ? ec.message() : "no address"));
    }
    endpoint = resolved.begin()->endpoint();
  }
  impl->acceptor.open(endpoint.protocol(), ec);
  if (!ec) impl->acceptor.set_option(net::socket_base::reuse_address(true), ec);
  if (!ec) impl->acceptor.bind(endpoint, ec);
  if (!ec) impl->acceptor.listen(net::socket_base::max_listen_connections, ec);
  if (ec) {
    return absl::UnavailableError(
        absl::StrCat("cannot listen on ", options.host, ":", options.port, ": ", ec.message()));
  }
  impl->prepare_pool = std::make_unique<net::thread_pool>(std::max(1, options.prepare_threads));
  net::post(impl->accept_strand, [raw = impl.get()] { raw->Accept(); });
  if (options.heartbeat != nullptr) net::post(impl->ioc, [raw = impl.get()] { raw->Heartbeat(); });
  for (int i = 0; i < std::max(1, options.io_threads); ++i) {
    impl->threads.emplace_back([raw = impl.get()] { raw->ioc.run(); });
  }
  return std::unique_ptr<HttpServer>(new HttpServer(std::move(impl)));
}

uint16_t HttpServer::port() const {
  beast::error_code ec;
  return impl_->acceptor.local_endpoint(ec).port();
}

int64_t HttpServer::SessionObjects() const { return impl_->session_objects.load(); }

void HttpServer::Drain(std::chrono::milliseconds grace) {
  if (!impl_ || impl_->stopped.load() || impl_->draining.exchange(true)) return;
  net::post(impl_->accept_strand, [impl = impl_.get()] {
    beast::error_code ec;
    impl->acceptor.close(ec);
    impl->accept_timer.cancel();
  });
  const auto deadline = std::chrono::steady_clock::now() + grace;
  while (impl_->active.load() > 0 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  if (impl_->active.load() == 0) return;
  spdlog::warn("drain: {} requests still running after {} ms; ending them with an error event",
               impl_->active.load(), grace.count());
  std::set<std::shared_ptr<Session>> sessions;
  {
    absl::MutexLock lock(&impl_->mu);
    sessions = impl_->sessions;
  }
  auto ended = std::make_shared<std::atomic<int>>(0);
  auto posted = std::make_shared<std::atomic<int>>(static_cast<int>(sessions.size()));
  for (const auto& s : sessions) {
    s->Post([s, ended, posted] {
      if (s->EndForShutdown()) ended->fetch_add(1);
      posted->fetch_sub(1);
    });
  }
  // The error events go out, then those connections close (Finish leaves the set); bounded.
  const auto flush_deadline = std::chrono::steady_clock::now() + std::chrono::seconds(2);
  while (std::chrono::steady_clock::now() < flush_deadline) {
    if (posted->load() == 0) {
      int open = 0;
      {
        absl::MutexLock lock(&impl_->mu);
        for (const auto& s : sessions) open += impl_->sessions.count(s) > 0 && s->Ending();
      }
      if (open == 0) break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

void HttpServer::Stop() {
  if (!impl_ || impl_->stopped.exchange(true)) return;
  net::post(impl_->accept_strand, [impl = impl_.get()] {
    beast::error_code ec;
    impl->acceptor.close(ec);
    impl->accept_timer.cancel();
  });
  // Starts under way finish (later ones answer 503): their results reach the sessions' strands
  // before the shutdowns below, which cancel them.
  impl_->prepare_pool->join();
  std::set<std::shared_ptr<Session>> sessions;
  {
    absl::MutexLock lock(&impl_->mu);
    sessions.swap(impl_->sessions);
  }
  // Each session cancels its request and closes on its own strand; wait (bounded) for them.
  auto pending = std::make_shared<std::atomic<int>>(static_cast<int>(sessions.size()));
  for (const auto& s : sessions) {
    s->Post([s, pending] {
      s->Shutdown();
      pending->fetch_sub(1);
    });
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(2);
  while (pending->load() > 0 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  impl_->ioc.stop();
  for (auto& t : impl_->threads) {
    if (t.joinable()) t.join();
  }
}

}  // namespace pdserve::frontend
