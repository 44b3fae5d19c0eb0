#include "common/log.h"

#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <cstring>

#include "absl/strings/ascii.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace aidn {
namespace {

std::atomic<int> g_min_level{static_cast<int>(LogLevel::kInfo)};

const char* LevelName(LogLevel level) {
  switch (level) {
    case LogLevel::kDebug:
      return "DEBUG";
    case LogLevel::kInfo:
      return "INFO ";
    case LogLevel::kWarning:
      return "WARN ";
    case LogLevel::kError:
      return "ERROR";
    case LogLevel::kFatal:
      return "FATAL";
  }
  return "?";
}

const char* Basename(const char* path) {
  const char* slash = std::strrchr(path, '/');
  return slash == nullptr ? path : slash + 1;
}

}  // namespace

void SetMinLogLevel(LogLevel level) { g_min_level.store(static_cast<int>(level)); }
LogLevel MinLogLevel() { return static_cast<LogLevel>(g_min_level.load()); }

bool ParseLogLevel(std::string_view text, LogLevel* level) {
  const std::string t = absl::AsciiStrToLower(std::string(text));
  if (t == "debug") {
    *level = LogLevel::kDebug;
  } else if (t == "info") {
    *level = LogLevel::kInfo;
  } else if (t == "warning" || t == "warn") {
    *level = LogLevel::kWarning;
  } else if (t == "error") {
    *level = LogLevel::kError;
  } else {
    return false;
  }
  return true;
}

LogMessage::LogMessage(LogLevel level, const char* file, int line) : level_(level) {
  stream_ << absl::FormatTime("%Y-%m-%dT%H:%M:%E3SZ", absl::Now(), absl::UTCTimeZone()) << ' '
          << LevelName(level) << ' ' << Basename(file) << ':' << line << "] ";
}

LogMessage& LogMessage::operator<<(const Kv& kv) {
  stream_ << ' ' << kv.key << '=';
  if (kv.value.empty() || kv.value.find_first_of(" \t\"=") != std::string::npos) {
    stream_ << '"';
    for (char c : kv.value) {
      if (c == '"' || c == '\\') stream_ << '\\';
      stream_ << c;
    }
    stream_ << '"';
  } else {
    stream_ << kv.value;
  }
  return *this;
}

LogMessage::~LogMessage() {
  stream_ << '\n';
  const std::string line = stream_.str();
  // One write so that lines from several threads do not interleave.
  ssize_t unused = ::write(STDERR_FILENO, line.data(), line.size());
  (void)unused;
  if (level_ == LogLevel::kFatal) std::abort();
}

void LogConfigTable(std::string_view title,
                    const std::vector<std::pair<std::string, std::string>>& rows) {
  size_t width = 0;
  for (const auto& [key, value] : rows) width = std::max(width, key.size());
  std::ostringstream os;
  os << title;
  for (const auto& [key, value] : rows) {
    os << "\n  " << key << std::string(width - key.size() + 2, ' ') << value;
  }
  AIDN_LOG(INFO) << os.str();
}

}  // namespace aidn
