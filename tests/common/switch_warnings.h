// The environment switches' warnings (kernels/env_switch.h) a test makes, captured instead of
// written to stderr, so it can assert each one's text and count.
//
// Thread-safety: one CapturedSwitchWarnings at a time, made and read on the test's thread.
#pragma once

#include <string>
#include <vector>

#include "kernels/env_switch.h"

namespace pdserve::testing {

// While it lives, every switch warning of the process is appended to lines(); afterwards they go
// to stderr again.
class CapturedSwitchWarnings {
 public:
  CapturedSwitchWarnings() {
    Lines().clear();
    kernels::SetSwitchWarningSink([](const std::string& message) { Lines().push_back(message); });
  }
  ~CapturedSwitchWarnings() { kernels::SetSwitchWarningSink(&kernels::WriteSwitchWarningToStderr); }
  CapturedSwitchWarnings(const CapturedSwitchWarnings&) = delete;
  CapturedSwitchWarnings& operator=(const CapturedSwitchWarnings&) = delete;

  const std::vector<std::string>& lines() const { return Lines(); }

 private:
  static std::vector<std::string>& Lines() {
    static std::vector<std::string> lines;
    return lines;
  }
};

}  // namespace pdserve::testing
