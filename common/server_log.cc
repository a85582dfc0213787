#include "common/server_log.h"

#include <memory>
#include <mutex>
#include <utility>

#include "spdlog/async.h"
#include "spdlog/sinks/stdout_color_sinks.h"
#include "spdlog/spdlog.h"

namespace pdserve::common {

void UseServerLog(const std::string& name) {
  static std::once_flag pool_once;
  // One writer thread: lines stay in the order they were logged.
  std::call_once(pool_once, [] { spdlog::init_thread_pool(kQueuedLines, 1); });
  spdlog::sink_ptr sink = std::make_shared<spdlog::sinks::stderr_color_sink_mt>();
  auto logger = std::make_shared<spdlog::async_logger>(
      name, std::move(sink), spdlog::thread_pool(), spdlog::async_overflow_policy::overrun_oldest);
  if (const std::shared_ptr<spdlog::logger> previous = spdlog::default_logger()) {
    logger->set_level(previous->level());
    logger->flush_on(previous->flush_level());
  }
  // A named logger of the same name made earlier in this process would make register fail.
  spdlog::drop(name);
  spdlog::set_default_logger(std::move(logger));
}

size_t DroppedLogLines() {
  const std::shared_ptr<spdlog::details::thread_pool> pool = spdlog::thread_pool();
  return pool ? pool->overrun_counter() : 0;
}

}  // namespace pdserve::common
