#ifndef AIDN_COMMON_LOG_H_
#define AIDN_COMMON_LOG_H_

// Levelled, line-oriented logs on stderr:
//   2026-11-22T04:10:00.123Z INFO  coordinator.cc:120] job submitted job=job-1
// Structured fields are appended as key=value (values with spaces quoted)
// through aidn::Kv. Thread-safe: each line is written with one write(2).
//
//   AIDN_LOG(INFO) << "job submitted" << Kv("job", id) << Kv("world_size", n);
//   AIDN_CHECK(ptr != nullptr) << "programmer error";   // aborts

#include <sstream>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace aidn {

enum class LogLevel { kDebug = 0, kInfo = 1, kWarning = 2, kError = 3, kFatal = 4 };

// Lines below this level are dropped. Default kInfo.
void SetMinLogLevel(LogLevel level);
LogLevel MinLogLevel();
// Parses "debug", "info", "warning", "error"; false if unknown.
bool ParseLogLevel(std::string_view text, LogLevel* level);

// A structured field: streams as " key=value".
struct Kv {
  template <typename T>
  Kv(std::string_view k, const T& v) : key(k) {
    std::ostringstream os;
    os << v;
    value = os.str();
  }
  std::string key;
  std::string value;
};

class LogMessage {
 public:
  LogMessage(LogLevel level, const char* file, int line);
  ~LogMessage();
  LogMessage(const LogMessage&) = delete;
  LogMessage& operator=(const LogMessage&) = delete;

  template <typename T>
  LogMessage& operator<<(const T& v) {
    stream_ << v;
    return *this;
  }
  LogMessage& operator<<(const Kv& kv);

 private:
  LogLevel level_;
  std::ostringstream stream_;
};

// Turns a streamed LogMessage into void so AIDN_LOG can be a conditional
// expression (safe inside an unbraced if/else).
class LogVoidify {
 public:
  void operator&(const LogMessage&) {}
};

// Prints "title" and a two-column table of settings, one per line, at INFO.
void LogConfigTable(std::string_view title,
                    const std::vector<std::pair<std::string, std::string>>& rows);

}  // namespace aidn

#define AIDN_LOG_LEVEL_DEBUG ::aidn::LogLevel::kDebug
#define AIDN_LOG_LEVEL_INFO ::aidn::LogLevel::kInfo
#define AIDN_LOG_LEVEL_WARNING ::aidn::LogLevel::kWarning
#define AIDN_LOG_LEVEL_ERROR ::aidn::LogLevel::kError
#define AIDN_LOG_LEVEL_FATAL ::aidn::LogLevel::kFatal

#define AIDN_LOG(level)                            \
  (AIDN_LOG_LEVEL_##level < ::aidn::MinLogLevel()) \
      ? (void)0                                    \
      : ::aidn::LogVoidify() & ::aidn::LogMessage(AIDN_LOG_LEVEL_##level, __FILE__, __LINE__)

// For programmer errors only: logs and aborts when `cond` is false.
#define AIDN_CHECK(cond)                                                                           \
  (cond) ? (void)0                                                                                 \
         : ::aidn::LogVoidify() & ::aidn::LogMessage(::aidn::LogLevel::kFatal, __FILE__, __LINE__) \
                                      << "Check failed: " #cond " "

#endif  // AIDN_COMMON_LOG_H_
