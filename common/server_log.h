// The log of a server process (up, serve, router, prefill, decode): spdlog's default logger made
// asynchronous, so no thread that logs ever waits for the log's reader. A stderr / stdout piped
// into a reader that stops reading (a stopped `tee` or log shipper, ssh flow control, Ctrl-S)
// used to fill the 64 KiB pipe and then block every thread that logged: the router stopped
// answering requests, /ready and /metrics (a breaker's finding, 2026-12-05). Now lines go to a
// queue of kQueuedLines messages written by one background thread; when the queue is full the
// oldest lines are dropped (spdlog's overrun_oldest), and DroppedLogLines() counts them.
//
// Thread-safety: UseServerLog from the main thread before the server's threads start (it may be
// called again, e.g. by a worker naming its logger; the queue and its thread are made once).
// Logging itself is thread-safe, as with any spdlog logger. DroppedLogLines from any thread.
#pragma once

#include <cstddef>
#include <string>

namespace pdserve::common {

// Lines the queue holds before the oldest are dropped (each a formatted spdlog message).
inline constexpr size_t kQueuedLines = 8192;

// Replaces spdlog's default logger with an asynchronous one named `name` ("" for none, as
// spdlog's own default) writing colour-coded lines to stderr, at the level and with the pattern
// the previous default logger had. Every server logs to stderr, so that under `pdserve up` the
// router's and the workers' lines share one stream (stdout carries only each command's "pdserve
// ...: listening on" / "ready on" lines).
void UseServerLog(const std::string& name);

// Lines dropped because the queue was full since the process started (0 without UseServerLog).
size_t DroppedLogLines();

}  // namespace pdserve::common
