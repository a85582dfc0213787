// The `pdserve` binary: one executable, one subcommand per job (score, generate, serve, prefill,
// decode, router, up, ...). Subcommands register themselves (command_registry.h).
#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "absl/synchronization/mutex.h"
#include "cli/command_registry.h"
#include "common/env_switch_log.h"
#include "common/fatal_signal.h"
#include "kernels/env_switch.h"

namespace pdserve::cli {
std::vector<CommandInstaller>& Installers() {
  static std::vector<CommandInstaller> installers;
  return installers;
}

namespace {
// A check that the value parses as a finite number passing `ok`; else "must be <what>, got X".
CLI::Validator NumberCheck(bool (*ok)(double), const char* what, const char* help) {
  return CLI::Validator(
      [ok, what](std::string& value) -> std::string {
        double number = 0.0;
        size_t used = 0;
        try {
          number = std::stod(value, &used);
        } catch (const std::exception&) {
          used = 0;
        }
        if (used == 0 || used != value.size() || !std::isfinite(number) || !ok(number)) {
          return std::string("must be ") + what + ", got " + value;
        }
        return "";
      },
      help, "");
}
}  // namespace

CLI::Validator Positive() {
  return NumberCheck([](double v) { return v > 0; }, "> 0", "POSITIVE");
}
CLI::Validator NonNegative() {
  return NumberCheck([](double v) { return v >= 0; }, ">= 0", "NONNEGATIVE");
}
}  // namespace pdserve::cli

int main(int argc, char** argv) {
  // A process started with stdin, stdout or stderr closed would hand those numbers to the first
  // files it opens (an eventfd, an epoll fd, a socket) and then write its log into them (a
  // breaker's finding, 2026-12-05): each closed one is opened on /dev/null first.
  for (int fd = 0; fd <= 2; ++fd) {
    if (fcntl(fd, F_GETFD) == -1 && errno == EBADF) {
      const int opened = open("/dev/null", O_RDWR);
      if (opened != fd && opened >= 0) close(opened);  // fd was taken meanwhile: nothing to do
    }
  }
  // Every subcommand: a crash leaves its signal, pid and backtrace on stderr (the log).
  pdserve::common::InstallFatalSignalHandlers();
  pdserve::common::MaybeCrashForTest();
  // A PDSERVE_* switch's value it does not accept is named in the log (kernels/env_switch.h).
  pdserve::common::LogSwitchWarnings();
  // absl's lock-order (deadlock) detection, on in Debian's build, makes a Mutex lock + unlock
  // 81 ns instead of 36 (measured 2026-12-04 on the Debian build machine; Mutex lock / unlock were
  // 24-29% of the transfer processes' perf samples, docs/perf.md "The path's own rate on the
  // CPU"). The test binaries keep it (their own main), so lock-order inversions are still caught
  // there; PDSERVE_ABSL_DEADLOCK_DETECTION=1 keeps it in a server process too.
  if (!pdserve::kernels::ReadSwitchFlag("PDSERVE_ABSL_DEADLOCK_DETECTION", false,
                                        "the default (detection off)")) {
    absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  }
  CLI::App app{
      "pdserve: disaggregated prefill/decode serving for DeepSeek sparse-attention models"};
  app.require_subcommand(1);
  int exit_code = 0;
  for (const auto& install : pdserve::cli::Installers()) install(app, &exit_code);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  return exit_code;
}
