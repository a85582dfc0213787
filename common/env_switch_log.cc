#include "common/env_switch_log.h"

#include <string>

#include "kernels/env_switch.h"
#include "spdlog/spdlog.h"

namespace pdserve::common {

void LogSwitchWarnings() {
  kernels::SetSwitchWarningSink([](const std::string& message) { spdlog::warn("{}", message); });
}

}  // namespace pdserve::common
