#include "common/fatal_signal.h"

#include <execinfo.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <csignal>
#include <cstdlib>
#include <cstring>

namespace pdserve::common {
namespace {

constexpr int kSignals[] = {SIGSEGV, SIGBUS, SIGABRT, SIGFPE, SIGILL};
constexpr int kMaxFrames = 64;
constexpr size_t kAltStackBytes = 64 * 1024;

const char* SignalName(int signal) {
  switch (signal) {
    case SIGSEGV:
      return "SIGSEGV";
    case SIGBUS:
      return "SIGBUS";
    case SIGABRT:
      return "SIGABRT";
    case SIGFPE:
      return "SIGFPE";
    case SIGILL:
      return "SIGILL";
    default:
      return "signal";
  }
}

void WriteString(const char* text) {
  size_t left = std::strlen(text);
  while (left > 0) {
    const ssize_t n = ::write(STDERR_FILENO, text, left);
    if (n <= 0) return;
    text += n;
    left -= static_cast<size_t>(n);
  }
}

// Decimal text of `value` (snprintf is not async-signal-safe).
void WriteNumber(long value) {
  char digits[24];
  int i = sizeof(digits) - 1;
  digits[i] = '\0';
  const bool negative = value < 0;
  unsigned long v = negative ? 0ul - static_cast<unsigned long>(value) : value;
  do {
    digits[--i] = static_cast<char>('0' + v % 10);
    v /= 10;
  } while (v != 0 && i > 1);
  if (negative) digits[--i] = '-';
  WriteString(digits + i);
}

void OnFatalSignal(int signal) {
  // SA_RESETHAND restored the default action already; a second fault inside this handler kills
  // the process as it would have without it.
  WriteString("pdserve: fatal signal ");
  WriteString(SignalName(signal));
  WriteString(" (");
  WriteNumber(signal);
  WriteString(") in pid ");
  WriteNumber(static_cast<long>(::getpid()));
  WriteString("; backtrace:\n");
  void* frames[kMaxFrames];
  const int depth = ::backtrace(frames, kMaxFrames);
  ::backtrace_symbols_fd(frames, depth, STDERR_FILENO);
  // Re-raise with the default action: delivered when the handler returns (the signal is blocked
  // while it runs). A fault re-executes its instruction and faults again with the default too.
  ::raise(signal);
}

}  // namespace

void IgnoreBrokenPipe() { std::signal(SIGPIPE, SIG_IGN); }

void InstallFatalSignalHandlers() {
  static std::atomic<bool> installed{false};
  if (installed.exchange(true)) return;
  // backtrace loads libgcc on its first call (which allocates): do it now, not in the handler.
  void* warm[1];
  ::backtrace(warm, 1);
  static char* alt_stack = new char[kAltStackBytes];  // lives for the process
  stack_t stack{};
  stack.ss_sp = alt_stack;
  stack.ss_size = kAltStackBytes;
  ::sigaltstack(&stack, nullptr);
  struct sigaction action {};
  action.sa_handler = OnFatalSignal;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESETHAND | SA_ONSTACK;
  for (int signal : kSignals) ::sigaction(signal, &action, nullptr);
}

void MaybeCrashForTest() {
  const char* what = std::getenv("PDSERVE_TEST_FATAL_SIGNAL");
  if (what == nullptr) return;
  if (std::strcmp(what, "segv") == 0) {
    // Both volatile: the compiler can neither see that the pointer is null nor drop the store.
    volatile int* volatile null_pointer = nullptr;
    *null_pointer = 1;
  } else if (std::strcmp(what, "abort") == 0) {
    std::abort();
  }
}

}  // namespace pdserve::common
