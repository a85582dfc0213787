// `pdserve up`: the main job on one machine. Starts every prefill and decode worker of the
// deploy config and the router, as child processes of this one (the same binary, via
// /proc/self/exe: `pdserve prefill|decode --config F --name NAME`, `pdserve router --config F`),
// waits until the router's /ready answers 200, and prints where it serves.
//
//   pdserve up --config FILE [--ready-timeout SECONDS]
//
// Before starting anything it checks that the model path holds a config.json as seen from the
// working directory (config::CheckModelPath; the children resolve a relative path against it),
// and that every configured port (router HTTP and gRPC, each worker's port and metrics port) is
// free, so a second `up`, or processes left from an earlier one, are reported instead of
// half-serving (gRPC would otherwise share a port with SO_REUSEPORT).
// Each child gets PR_SET_PDEATHSIG, so it is stopped (SIGTERM) even when `up` itself is killed.
// Ctrl-C (SIGINT) or SIGTERM stops every child and exits 0: the router first, then the workers
// (SIGTERM; SIGKILL for one still running 15 s past the drain), so requests the router is
// draining still have their workers and the router does not report them down on the way out.
// The workers are started with --drain-timeout-ms 2000 (`up --drain-timeout-ms` changes it), so
// Ctrl-C stays fast: a worker lets running requests finish for at most 2 s, then ends the rest
// with a final "error" event (a production unit keeps the 30 s default); the router gets the same
// drain. A child still running 15 s past the drain is killed (SIGKILL).
// The children are started from the binary's own path (readlink of /proc/self/exe), so they show
// as `pdserve` in ps / pgrep.
// If a child exits on its own, `up` names it and its exit status, stops the others and exits 1:
// a deployment with a missing part is not served half-way (systemd units restart parts
// individually; `up` is for one machine and development).
#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/address.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/ssl.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <boost/beast/ssl.hpp>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "cli/command_registry.h"
#include "common/deploy_config.h"
#include "common/fatal_signal.h"
#include "common/host_port.h"
#include "common/server_log.h"
#include "common/status.h"

namespace pdserve::cli {
namespace {

struct UpOptions {
  std::string config;
  int ready_timeout_s = 600;
  int drain_timeout_ms = 2000;  // the children's --drain-timeout-ms (see the file comment)
};

// This binary's path, so that children are named after it; /proc/self/exe when it cannot be
// read (or the file was replaced since: the link then ends in " (deleted)").
std::string SelfPath() {
  char path[4096];
  const ssize_t n = readlink("/proc/self/exe", path, sizeof(path) - 1);
  if (n <= 0) return "/proc/self/exe";
  const std::string self(path, static_cast<size_t>(n));
  return access(self.c_str(), X_OK) == 0 ? self : "/proc/self/exe";
}

struct Child {
  std::string name;
  pid_t pid = -1;
  bool exited = false;
  int status = 0;
  bool router = false;
};

// Starts `pdserve args...` with the default signal mask. Errors: Internal when fork fails.
absl::StatusOr<pid_t> Spawn(const std::vector<std::string>& args) {
  static const std::string self = SelfPath();
  std::vector<char*> argv;
  for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  const pid_t parent = getpid();
  const pid_t pid = fork();
  if (pid < 0) return absl::InternalError(absl::StrCat("fork: ", std::strerror(errno)));
  if (pid == 0) {
    // Stop with `up`, even when it is SIGKILLed; if it died before prctl took effect, stop now.
    if (prctl(PR_SET_PDEATHSIG, SIGTERM) != 0 || getppid() != parent) _exit(1);
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, nullptr);
    execv(self.c_str(), argv.data());
    std::fprintf(stderr, "pdserve up: exec failed: %s\n", std::strerror(errno));
    _exit(127);
  }
  return pid;
}

// OK when nothing listens on host:port (a plain bind without SO_REUSEPORT succeeds).
absl::Status CheckPortFree(const std::string& what, const std::string& host, int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return absl::InternalError(absl::StrCat("socket: ", std::strerror(errno)));
  const int one = 1;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));  // TIME_WAIT is not "in use"
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  if (inet_pton(AF_INET, host.c_str(), &addr.sin_addr) != 1) {
    close(fd);
    return absl::OkStatus();  // not an IPv4 literal: leave the check to the child's own bind
  }
  const bool free = bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
  const int error = errno;
  close(fd);
  if (free) return absl::OkStatus();
  if (error == EADDRNOTAVAIL) {
    // Not a busy port: the host is another machine's address (a multi-host config).
    return absl::FailedPreconditionError(absl::StrCat(
        what, " host ", host, " is not an address of this machine (", std::strerror(error),
        "); `pdserve up` runs every process of the config here: on several hosts start each "
        "process with its systemd unit on its own host (deploy/README.md, \"Multi-host "
        "install\")"));
  }
  return absl::FailedPreconditionError(absl::StrCat(what, " port ", common::HostPort(host, port),
                                                    " is not free (", std::strerror(error),
                                                    "); is another pdserve running?"));
}

// Every port the deployment will listen on, checked before anything starts.
absl::Status CheckPortsFree(const config::DeployConfig& config) {
  PDSERVE_RETURN_IF_ERROR(
      CheckPortFree("router HTTP", config.router.host, config.router.http_port));
  if (config.router.grpc_port > 0) {
    PDSERVE_RETURN_IF_ERROR(
        CheckPortFree("router gRPC", config.router.host, config.router.grpc_port));
  }
  for (const auto* workers : {&config.prefill, &config.decode}) {
    for (const config::WorkerConfig& w : *workers) {
      PDSERVE_RETURN_IF_ERROR(CheckPortFree(w.name, w.host, w.port));
      if (w.metrics_port > 0) {
        PDSERVE_RETURN_IF_ERROR(CheckPortFree(w.name + " metrics", w.host, w.metrics_port));
      }
    }
  }
  return absl::OkStatus();
}

// Where `up` reaches a router that listens on `host`: a wildcard address through its loopback.
std::string ProbeHost(const std::string& host) {
  if (host == "0.0.0.0") return "127.0.0.1";
  if (host == "::") return "::1";
  return host;
}

// GET `path` on host:port; the HTTP status, or 0 when nothing answered. `host` may be an IPv4 or
// IPv6 literal or a name (each of its addresses is tried).
int HttpStatus(const std::string& host, int port, const std::string& path) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (getaddrinfo(ProbeHost(host).c_str(), std::to_string(port).c_str(), &hints, &found) != 0) {
    return 0;
  }
  const std::string request =
      absl::StrCat("GET ", path, " HTTP/1.1\r\nHost: ", common::HostPort(host, port),
                   "\r\nConnection: close\r\n\r\n");
  int status = 0;
  for (const addrinfo* a = found; a != nullptr && status == 0; a = a->ai_next) {
    const int fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    timeval timeout{2, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
    if (connect(fd, a->ai_addr, a->ai_addrlen) == 0 &&
        write(fd, request.data(), request.size()) == static_cast<ssize_t>(request.size())) {
      char buffer[64] = {};
      if (read(fd, buffer, sizeof(buffer) - 1) > 12) status = std::atoi(buffer + 9);
    }
    close(fd);
  }
  freeaddrinfo(found);
  return status;
}

// The same probe over TLS, for a router with security.tls. The certificate is not verified: the
// probe only asks whether the router `up` started on this machine answers yet.
int HttpsStatus(const std::string& host, int port, const std::string& path) {
  namespace net = boost::asio;
  namespace http = boost::beast::http;
  try {
    net::io_context ioc;
    net::ssl::context context(net::ssl::context::tls_client);
    context.set_verify_mode(net::ssl::verify_none);
    boost::beast::ssl_stream<boost::beast::tcp_stream> stream(ioc, context);
    auto& tcp = boost::beast::get_lowest_layer(stream);
    tcp.expires_after(std::chrono::seconds(2));
    tcp.connect(net::ip::tcp::resolver(ioc).resolve(ProbeHost(host), std::to_string(port)));
    stream.handshake(net::ssl::stream_base::client);
    http::request<http::empty_body> request{http::verb::get, path, 11};
    request.set(http::field::host, common::HostPort(host, port));
    http::write(stream, request);
    boost::beast::flat_buffer buffer;
    http::response<http::string_body> response;
    http::read(stream, buffer, response);
    return response.result_int();
  } catch (const std::exception&) {
    return 0;
  }
}

// Reaps children that exited; true when one did.
bool Reap(std::vector<Child>& children) {
  bool any = false;
  for (Child& c : children) {
    if (c.exited) continue;
    int status = 0;
    if (waitpid(c.pid, &status, WNOHANG) == c.pid) {
      c.exited = true;
      c.status = status;
      any = true;
    }
  }
  return any;
}

std::string Describe(int status) {
  if (WIFEXITED(status)) return absl::StrCat("exited with status ", WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return absl::StrCat("was killed by signal ", WTERMSIG(status));
  return "stopped";
}

// SIGTERM to the children `which` selects, then waits for them (drain + 15 s) and kills those
// still running.
template <typename Which>
void StopSome(std::vector<Child>& children, int drain_timeout_ms, Which which) {
  for (Child& c : children) {
    if (!c.exited && which(c)) kill(c.pid, SIGTERM);
  }
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::milliseconds(drain_timeout_ms) + std::chrono::seconds(15);
  while (std::chrono::steady_clock::now() < deadline) {
    Reap(children);
    bool all = true;
    for (const Child& c : children) all &= c.exited || !which(c);
    if (all) return;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  for (Child& c : children) {
    if (c.exited || !which(c)) continue;
    std::fprintf(stderr, "pdserve up: %s (pid %d) did not stop; killing it\n", c.name.c_str(),
                 c.pid);
    kill(c.pid, SIGKILL);
    waitpid(c.pid, &c.status, 0);
    c.exited = true;
  }
}

// The router first (it lets its running requests finish, up to the drain, while the workers
// still serve them, and stops health-checking), then the workers.
void StopAll(std::vector<Child>& children, int drain_timeout_ms) {
  if (std::any_of(children.begin(), children.end(), [](const Child& c) { return c.router; })) {
    StopSome(children, drain_timeout_ms, [](const Child& c) { return c.router; });
    std::fprintf(stderr, "pdserve up: router stopped; stopping the workers\n");
  }
  StopSome(children, drain_timeout_ms, [](const Child&) { return true; });
}

// Exit status of `up`: 0 after a signal, 1 when a child died or startup failed.
int Up(const UpOptions& options) {
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGCHLD);
  sigprocmask(SIG_BLOCK, &signals, nullptr);
  absl::StatusOr<config::DeployConfig> config = config::LoadDeployConfig(options.config);
  if (!config.ok()) {
    std::fprintf(stderr, "pdserve up: %s\n", std::string(config.status().message()).c_str());
    return 1;
  }
  // Every child would load the model and fail on a path that is not there: say so once, first.
  if (absl::Status model = config::CheckModelPath(*config); !model.ok()) {
    std::fprintf(stderr, "pdserve up: %s: %s\n", options.config.c_str(),
                 std::string(model.message()).c_str());
    return 1;
  }
  if (absl::Status ports = CheckPortsFree(*config); !ports.ok()) {
    std::fprintf(stderr, "pdserve up: %s\n", std::string(ports.message()).c_str());
    return 1;
  }
  // NVLink multicast off in every child, whatever the environment says (the workers force it
  // too). Set here, single-threaded, before any fork.
  setenv("NCCL_NVLS_ENABLE", "0", /*overwrite=*/1);
  std::vector<Child> children;
  auto start = [&](const std::string& name, std::vector<std::string> args) {
    absl::StatusOr<pid_t> pid = Spawn(args);
    if (!pid.ok()) {
      std::fprintf(stderr, "pdserve up: cannot start %s: %s\n", name.c_str(),
                   std::string(pid.status().message()).c_str());
      return false;
    }
    std::fprintf(stderr, "pdserve up: started %s (pid %d)\n", name.c_str(), *pid);
    children.push_back({name, *pid});
    return true;
  };
  const std::string drain = std::to_string(options.drain_timeout_ms);
  bool ok = true;
  for (const config::WorkerConfig& w : config->prefill) {
    ok = ok && start(w.name, {"pdserve", "prefill", "--config", options.config, "--name", w.name,
                              "--drain-timeout-ms", drain});
  }
  for (const config::WorkerConfig& w : config->decode) {
    ok = ok && start(w.name, {"pdserve", "decode", "--config", options.config, "--name", w.name,
                              "--drain-timeout-ms", drain});
  }
  ok = ok && start("router",
                   {"pdserve", "router", "--config", options.config, "--drain-timeout-ms", drain});
  if (ok) children.back().router = true;
  if (!ok) {
    StopAll(children, options.drain_timeout_ms);
    return 1;
  }
  const std::string& host = config->router.host;
  const int port = config->router.http_port;
  const auto ready_deadline =
      std::chrono::steady_clock::now() + std::chrono::seconds(options.ready_timeout_s);
  bool ready = false;
  while (true) {
    timespec wait{0, 200 * 1000 * 1000};
    const int signal = sigtimedwait(&signals, nullptr, &wait);
    if (signal == SIGINT || signal == SIGTERM) {
      std::fprintf(stderr, "pdserve up: signal %d, stopping everything\n", signal);
      StopAll(children, options.drain_timeout_ms);
      return 0;
    }
    if (Reap(children)) {
      for (const Child& c : children) {
        if (c.exited) {
          std::fprintf(stderr, "pdserve up: %s (pid %d) %s; stopping the others\n", c.name.c_str(),
                       c.pid, Describe(c.status).c_str());
        }
      }
      StopAll(children, options.drain_timeout_ms);
      return 1;
    }
    if (!ready) {
      const bool tls = config->security.front_tls();
      if ((tls ? HttpsStatus : HttpStatus)(host, port, "/ready") == 200) {
        ready = true;
        std::printf("pdserve up: ready on %s://%s (%zu prefill, %zu decode)\n",
                    tls ? "https" : "http", common::HostPort(host, port).c_str(),
                    config->prefill.size(), config->decode.size());
        std::fflush(stdout);
      } else if (std::chrono::steady_clock::now() > ready_deadline) {
        std::fprintf(stderr, "pdserve up: not ready after %d s; stopping everything\n",
                     options.ready_timeout_s);
        StopAll(children, options.drain_timeout_ms);
        return 1;
      }
    }
  }
}

const CommandRegistrar kRegistrar([](CLI::App& app, int* exit_code) {
  auto o = std::make_shared<UpOptions>();
  CLI::App* cmd = app.add_subcommand(
      "up", "Start a whole deployment on this machine: workers and router (Ctrl-C stops all)");
  cmd->add_option("--config", o->config, "Deployment config (YAML, deploy/README.md)")->required();
  cmd->add_option("--ready-timeout", o->ready_timeout_s, "Seconds to wait for /ready")
      ->capture_default_str()
      ->check(Positive());
  cmd->add_option("--drain-timeout-ms", o->drain_timeout_ms,
                  "On Ctrl-C / SIGTERM: how long the workers and the router let running requests "
                  "finish before they end them with an error event")
      ->capture_default_str()
      ->check(NonNegative());
  cmd->callback([o, exit_code] {
    common::IgnoreBrokenPipe();          // a log reader that went away must not stop a server
    common::UseServerLog("pdserve-up");  // a stopped reader must not block it
    *exit_code = Up(*o);
  });
});

}  // namespace
}  // namespace pdserve::cli
