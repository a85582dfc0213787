#include "loadgen/stream_client.h"

#include <array>
#include <limits>
#include <memory>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "boost/asio/connect.hpp"
#include "boost/asio/ip/address.hpp"
#include "boost/asio/steady_timer.hpp"
#include "boost/beast/core/flat_buffer.hpp"
#include "boost/beast/core/tcp_stream.hpp"
#include "boost/beast/http.hpp"
#include "common/status.h"
#include "loadgen/sse_parser.h"
#include "nlohmann/json.hpp"

namespace pdserve::loadgen {
namespace {

namespace net = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = net::ip::tcp;
using Clock = std::chrono::steady_clock;
using json = nlohmann::json;

constexpr size_t kMaxErrorDetail = 2048;

double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

// What a refused connection means: nothing listens at host:port (yet).
std::string ConnectionRefused(const EndpointUrl& url) {
  return absl::StrCat("connection refused at ", url.host, ":", url.port,
                      ": nothing listens there (is the server started? `pdserve up` prints "
                      "\"ready on ...\" once it serves)");
}

// The content text of choice 0 in a chunk of either endpoint; `*timed` says whether the chunk
// carried generated output at all (reasoning text counts for timing, not for content).
std::string ChunkText(const json& choice, bool* timed) {
  std::string text;
  if (auto it = choice.find("text"); it != choice.end() && it->is_string()) {
    text = it->get<std::string>();
  } else if (auto d = choice.find("delta"); d != choice.end() && d->is_object()) {
    if (auto c = d->find("content"); c != d->end() && c->is_string()) text = c->get<std::string>();
    if (auto r = d->find("reasoning_content"); r != d->end() && r->is_string() && !r->empty()) {
      *timed = true;
    }
  }
  if (!text.empty()) *timed = true;
  return text;
}

// Token strings of choice 0's logprobs in either endpoint's shape.
void AppendLogprobTokens(const json& choice, std::vector<std::string>* out) {
  auto lp = choice.find("logprobs");
  if (lp == choice.end() || !lp->is_object()) return;
  if (auto t = lp->find("tokens"); t != lp->end() && t->is_array()) {
    for (const json& tok : *t) {
      if (tok.is_string()) out->push_back(tok.get<std::string>());
    }
  } else if (auto c = lp->find("content"); c != lp->end() && c->is_array()) {
    for (const json& e : *c) {
      if (e.is_object() && e.contains("token") && e["token"].is_string()) {
        out->push_back(e["token"].get<std::string>());
      }
    }
  }
}

class StreamCall : public std::enable_shared_from_this<StreamCall> {
 public:
  StreamCall(net::io_context& ioc, const EndpointUrl& url, StreamCallSpec spec, StreamDone done)
      : socket_(ioc),
        timer_(ioc),
        spec_(std::move(spec)),
        done_(std::move(done)),
        refused_(ConnectionRefused(url)) {
    request_ = {http::verb::post, spec_.target, 11};
    request_.set(http::field::host, url.HostHeader());
    request_.set(http::field::content_type, "application/json");
    request_.set(http::field::accept, "text/event-stream");
    request_.body() = spec_.body;
    request_.prepare_payload();
    parser_.body_limit(std::numeric_limits<std::uint64_t>::max());
  }

  void Start(const tcp::resolver::results_type& addresses) {
    start_ = Clock::now();
    timer_.expires_at(spec_.deadline);
    timer_.async_wait([self = shared_from_this()](beast::error_code ec) {
      if (!ec) self->Fail("timeout", "deadline passed");
    });
    net::async_connect(socket_, addresses,
                       [self = shared_from_this()](beast::error_code ec, const tcp::endpoint&) {
                         if (ec == net::error::connection_refused) {
                           return self->Fail("connect", self->refused_);
                         }
                         if (ec) return self->Fail("connect", ec.message());
                         self->Write();
                       });
  }

 private:
  void Write() {
    http::async_write(socket_, request_, [self = shared_from_this()](beast::error_code ec, size_t) {
      if (ec) return self->Fail("write", ec.message());
      self->ReadHeader();
    });
  }

  void ReadHeader() {
    http::async_read_header(socket_, buffer_, parser_,
                            [self = shared_from_this()](beast::error_code ec, size_t) {
                              if (ec) return self->Fail("read", ec.message());
                              self->status_ = self->parser_.get().result_int();
                              self->ReadSome();
                            });
  }

  void ReadSome() {
    if (parser_.is_done()) return End();
    parser_.get().body().data = chunk_.data();
    parser_.get().body().size = chunk_.size();
    http::async_read_some(
        socket_, buffer_, parser_, [self = shared_from_this()](beast::error_code ec, size_t) {
          if (self->finished_) return;
          const size_t got = self->chunk_.size() - self->parser_.get().body().size;
          self->OnBytes(std::string_view(self->chunk_.data(), got), Clock::now());
          if (self->finished_) return;
          if (ec == http::error::need_buffer) ec = {};
          if (ec == http::error::end_of_stream || ec == net::error::eof) return self->End();
          if (ec) return self->Fail("read", ec.message());
          self->ReadSome();
        });
  }

  void OnBytes(std::string_view bytes, Clock::time_point now) {
    if (status_ != 200) {
      const size_t room = kMaxErrorDetail - std::min(kMaxErrorDetail, error_body_.size());
      error_body_.append(bytes.substr(0, room));
      return;
    }
    for (const std::string& event : sse_.Feed(bytes)) {
      OnEvent(event, now);
      if (finished_) return;
    }
  }

  void OnEvent(const std::string& data, Clock::time_point now) {
    if (data == "[DONE]") {
      saw_done_ = true;
      return;
    }
    json j = json::parse(data, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded() || !j.is_object()) return Fail("protocol", "event is not JSON: " + data);
    if (auto e = j.find("error"); e != j.end()) return Fail("stream_error", e->dump());
    if (auto u = j.find("usage"); u != j.end() && u->is_object()) {
      sample_.input_tokens = u->value("prompt_tokens", int64_t{0});
      usage_output_tokens_ = u->value("completion_tokens", int64_t{0});
    }
    auto choices = j.find("choices");
    if (choices == j.end() || !choices->is_array()) return;
    for (const json& choice : *choices) {
      if (!choice.is_object() || choice.value("index", 0) != 0) continue;
      bool timed = false;
      sample_.text += ChunkText(choice, &timed);
      AppendLogprobTokens(choice, &sample_.token_texts);
      if (!timed) continue;
      if (chunks_ == 0) {
        sample_.ttft_s = Seconds(now - start_);
      } else {
        sample_.itl_s.push_back(Seconds(now - last_chunk_));
      }
      last_chunk_ = now;
      ++chunks_;
    }
  }

  void End() {
    if (finished_) return;
    if (status_ != 200) return Fail(absl::StrCat("http_", status_), error_body_);
    if (!saw_done_) return Fail("incomplete", "stream ended without data: [DONE]");
    sample_.e2e_s = Seconds(Clock::now() - start_);
    if (chunks_ == 0) sample_.ttft_s = sample_.e2e_s;
    sample_.output_tokens = usage_output_tokens_ > 0 ? usage_output_tokens_ : chunks_;
    Finish();
  }

  void Fail(std::string kind, std::string detail) {
    if (finished_) return;
    sample_.error_kind = std::move(kind);
    sample_.error_detail = std::move(detail);
    sample_.e2e_s = Seconds(Clock::now() - start_);
    Finish();
  }

  void Finish() {
    finished_ = true;
    timer_.cancel();
    beast::error_code ignored;
    socket_.shutdown(tcp::socket::shutdown_both, ignored);
    socket_.close(ignored);
    done_(std::move(sample_));
  }

  tcp::socket socket_;
  net::steady_timer timer_;
  StreamCallSpec spec_;
  StreamDone done_;
  http::request<http::string_body> request_;
  http::response_parser<http::buffer_body> parser_;
  beast::flat_buffer buffer_;
  std::array<char, 8192> chunk_{};
  SseParser sse_;
  Clock::time_point start_, last_chunk_;
  int status_ = 0;
  int64_t chunks_ = 0;
  int64_t usage_output_tokens_ = 0;
  bool saw_done_ = false;
  bool finished_ = false;
  std::string error_body_;
  std::string refused_;  // the "connect" error detail when the connection is refused
  RequestSample sample_;
};

}  // namespace

std::string EndpointUrl::HostHeader() const {
  return port == "80" ? host : absl::StrCat(host, ":", port);
}

absl::StatusOr<EndpointUrl> ParseEndpointUrl(absl::string_view url) {
  constexpr absl::string_view kScheme = "http://";
  if (!absl::StartsWithIgnoreCase(url, kScheme)) {
    return absl::InvalidArgumentError(
        absl::StrCat("endpoint must start with http:// (TLS is not supported): ", url));
  }
  absl::string_view rest = url.substr(kScheme.size());
  const size_t slash = rest.find('/');
  absl::string_view authority = rest.substr(0, slash);
  absl::string_view path = slash == absl::string_view::npos ? "" : rest.substr(slash);
  EndpointUrl out;
  if (!authority.empty() && authority.front() == '[') {
    const size_t close = authority.find(']');
    if (close == absl::string_view::npos) return absl::InvalidArgumentError("bad IPv6 host");
    out.host = std::string(authority.substr(1, close - 1));
    authority.remove_prefix(close + 1);
    if (!authority.empty()) {
      if (authority.front() != ':') return absl::InvalidArgumentError("bad host:port");
      out.port = std::string(authority.substr(1));
    }
  } else {
    const size_t colon = authority.rfind(':');
    out.host = std::string(authority.substr(0, colon));
    if (colon != absl::string_view::npos) out.port = std::string(authority.substr(colon + 1));
  }
  int port = 0;
  if (out.host.empty() || !absl::SimpleAtoi(out.port, &port) || port <= 0 || port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("endpoint needs host[:port]: ", url));
  }
  while (!path.empty() && path.back() == '/') path.remove_suffix(1);
  if (absl::EndsWith(path, "/v1")) path.remove_suffix(3);
  out.path_prefix = std::string(path);
  return out;
}

bool IsLoopbackHost(absl::string_view host) {
  if (absl::AsciiStrToLower(host) == "localhost") return true;
  beast::error_code ec;
  const net::ip::address address = net::ip::make_address(std::string(host), ec);
  return !ec && address.is_loopback();
}

absl::StatusOr<EndpointUrl> ParseTargetUrl(absl::string_view url, bool allow_remote) {
  PDSERVE_ASSIGN_OR_RETURN(EndpointUrl parsed, ParseEndpointUrl(url));
  if (!allow_remote && !IsLoopbackHost(parsed.host)) {
    return absl::PermissionDeniedError(absl::StrCat(
        parsed.host, " is not a loopback address; pass --allow-remote to load a remote server"));
  }
  return parsed;
}

absl::StatusOr<std::string> FirstServedModel(const EndpointUrl& url) {
  PDSERVE_ASSIGN_OR_RETURN(std::string body,
                           HttpGet(url, "/v1/models", std::chrono::milliseconds(10000)));
  const json j = json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (j.is_object() && j.contains("data") && j["data"].is_array() && !j["data"].empty() &&
      j["data"][0].is_object() && j["data"][0].contains("id") && j["data"][0]["id"].is_string()) {
    return j["data"][0]["id"].get<std::string>();
  }
  return absl::FailedPreconditionError("GET /v1/models listed no model");
}

void StartStreamCall(net::io_context& ioc, const tcp::resolver::results_type& addresses,
                     const EndpointUrl& url, StreamCallSpec spec, StreamDone done) {
  std::make_shared<StreamCall>(ioc, url, std::move(spec), std::move(done))->Start(addresses);
}

absl::StatusOr<std::string> HttpGet(const EndpointUrl& url, absl::string_view path,
                                    std::chrono::milliseconds timeout) {
  net::io_context ioc;
  beast::tcp_stream stream(ioc);
  http::request<http::empty_body> request{http::verb::get, url.path_prefix + std::string(path), 11};
  request.set(http::field::host, url.HostHeader());
  beast::flat_buffer buffer;
  http::response<http::string_body> response;
  beast::error_code error;
  tcp::resolver resolver(ioc);
  resolver.async_resolve(url.host, url.port, [&](beast::error_code ec, auto results) {
    if (ec) return void(error = ec);
    stream.expires_after(timeout);
    stream.async_connect(results, [&](beast::error_code ec2, const tcp::endpoint&) {
      if (ec2) return void(error = ec2);
      http::async_write(stream, request, [&](beast::error_code ec3, size_t) {
        if (ec3) return void(error = ec3);
        http::async_read(stream, buffer, response,
                         [&](beast::error_code ec4, size_t) { error = ec4; });
      });
    });
  });
  ioc.run();
  if (error == boost::asio::error::connection_refused) {
    return absl::UnavailableError(absl::StrCat("GET ", path, ": ", ConnectionRefused(url)));
  }
  if (error) {
    return absl::UnavailableError(absl::StrCat("GET ", path, ": ", error.message()));
  }
  if (response.result_int() != 200) {
    return absl::FailedPreconditionError(
        absl::StrCat("GET ", path, ": HTTP ", response.result_int(), " ", response.body()));
  }
  return response.body();
}

}  // namespace pdserve::loadgen
