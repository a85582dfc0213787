// A last word from a crashing process: on SIGSEGV, SIGBUS, SIGABRT, SIGFPE or SIGILL the handler
// writes one line naming the signal and the pid, then a backtrace (glibc backtrace_symbols_fd),
// to stderr (where every pdserve process logs), and re-raises the signal with its default action,
// so the exit status (killed by the signal) and core dumps are what they were without it
// (docs/operations.md, "Crashes").
//
// Thread-safety: InstallFatalSignalHandlers once, from main, before other threads start; the
// handler itself uses only async-signal-safe calls (write, backtrace after its warm-up, sigaction,
// raise).
#pragma once

namespace pdserve::common {

// Installs the handler for the five fatal signals (on an alternate stack for the calling thread,
// so a stack overflow there is reported too). Idempotent.
void InstallFatalSignalHandlers();

// For a server process (up, serve, router, prefill, decode): SIGPIPE ignored, so a write to a
// pipe whose reader is gone (stderr piped to `tee` or a log shipper that exited, an ssh session
// that dropped) fails with EPIPE instead of killing the process at its next log line; the log
// line is lost, the server keeps serving. Sockets are unaffected (asio sends with MSG_NOSIGNAL).
// Inherited by the children `pdserve up` starts (exec keeps an ignored signal ignored).
// Thread-safety: call from the main thread before other threads start. Idempotent.
void IgnoreBrokenPipe();

// Test hook, off by default: when the environment names PDSERVE_TEST_FATAL_SIGNAL=segv the
// process dereferences a null pointer (a real SIGSEGV), with =abort it calls abort(); any other
// value or none does nothing.
void MaybeCrashForTest();

}  // namespace pdserve::common
