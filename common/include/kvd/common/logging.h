// One logging macro family for all of kvd. Hot paths and kernels never log.
//
//   KVD_LOG(INFO) << "listening" << kvd::Kv("addr", addr) << kvd::Kv("port", port);
//
// Output goes to stderr, one line per record, either as text
//   2026-11-29T09:30:00.123Z I daemon/src/server.cc:42] listening addr=127.0.0.1 port=7400
// or, with SetLogFormat(LogFormat::kJson) (kvd --log-format=json, or KVD_LOG_FORMAT=json), as
//   {"ts":"...","level":"I","src":"server.cc:42","msg":"listening","addr":"127.0.0.1","port":"7400"}
// Thread-safe: each record is written with one write() call.
#pragma once

#include <sstream>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace kvd {

enum class LogLevel : int { kDebug = 0, kInfo = 1, kWarning = 2, kError = 3, kFatal = 4 };
enum class LogFormat { kText, kJson };

// Records below this level are dropped. Default kInfo, or KVD_LOG_LEVEL=debug|info|warning|error.
void SetLogLevel(LogLevel level);
LogLevel GetLogLevel();
void SetLogFormat(LogFormat format);
// Parses "debug", "info", "warning", "error"; returns false for anything else.
bool ParseLogLevel(std::string_view name, LogLevel* level);

// A structured field attached to a record.
struct LogField {
  std::string key;
  std::string value;
};
template <typename T>
LogField Kv(std::string key, const T& value) {
  std::ostringstream os;
  os << value;
  return LogField{std::move(key), os.str()};
}

namespace internal {
class LogMessage {
 public:
  LogMessage(LogLevel level, const char* file, int line);
  ~LogMessage();  // emits the record; aborts after a kFatal record
  LogMessage(const LogMessage&) = delete;
  LogMessage& operator=(const LogMessage&) = delete;
  LogMessage& operator<<(const LogField& field) {
    fields_.push_back(field);
    return *this;
  }
  template <typename T>
  LogMessage& operator<<(const T& v) {
    msg_ << v;
    return *this;
  }

 private:
  LogLevel level_;
  const char* file_;
  int line_;
  std::ostringstream msg_;
  std::vector<LogField> fields_;
};
}  // namespace internal
}  // namespace kvd

#define KVD_LOG_LEVEL_DEBUG ::kvd::LogLevel::kDebug
#define KVD_LOG_LEVEL_INFO ::kvd::LogLevel::kInfo
#define KVD_LOG_LEVEL_WARNING ::kvd::LogLevel::kWarning
#define KVD_LOG_LEVEL_ERROR ::kvd::LogLevel::kError
#define KVD_LOG_LEVEL_FATAL ::kvd::LogLevel::kFatal

#define KVD_LOG(severity)                                \
  if (KVD_LOG_LEVEL_##severity < ::kvd::GetLogLevel()) { \
  } else                                                 \
    ::kvd::internal::LogMessage(KVD_LOG_LEVEL_##severity, __FILE__, __LINE__)
