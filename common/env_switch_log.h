// The environment switches' warnings (kernels/env_switch.h: a PDSERVE_* value a switch does not
// accept) in the process's log instead of bare stderr lines.
//
// Thread-safety: LogSwitchWarnings from main before the process's threads start; afterwards the
// warnings are logged from whichever thread reads a switch (spdlog's default logger is
// thread-safe).
#pragma once

namespace pdserve::common {

// Sends every later switch warning to spdlog's default logger at level warn (whichever logger is
// the default when the warning is made, e.g. the server log of common/server_log.h).
void LogSwitchWarnings();

}  // namespace pdserve::common
