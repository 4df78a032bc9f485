#include "kvd/common/logging.h"

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>

#include "kvd/common/utf8.h"

namespace kvd {
namespace {

LogLevel InitialLevel() {
  LogLevel level = LogLevel::kInfo;
  if (const char* env = std::getenv("KVD_LOG_LEVEL")) ParseLogLevel(env, &level);
  return level;
}
LogFormat InitialFormat() {
  const char* env = std::getenv("KVD_LOG_FORMAT");
  return (env && std::strcmp(env, "json") == 0) ? LogFormat::kJson : LogFormat::kText;
}

std::atomic<int>& Level() {
  static std::atomic<int> level{static_cast<int>(InitialLevel())};
  return level;
}
std::atomic<int>& Format() {
  static std::atomic<int> format{static_cast<int>(InitialFormat())};
  return format;
}

char LevelChar(LogLevel l) {
  switch (l) {
    case LogLevel::kDebug:
      return 'D';
    case LogLevel::kInfo:
      return 'I';
    case LogLevel::kWarning:
      return 'W';
    case LogLevel::kError:
      return 'E';
    case LogLevel::kFatal:
      return 'F';
  }
  return '?';
}

// One byte as \xNN (in JSON with its backslash escaped): a control byte, or one that is not part
// of well-formed UTF-8 (a log line is text, whatever a peer sent).
void AppendHexByte(std::string* out, char c, bool json) {
  char buf[8];
  std::snprintf(buf, sizeof buf, json ? "\\\\x%02x" : "\\x%02x", static_cast<unsigned char>(c));
  *out += buf;
}

// s[*i] >= 0x80: appends the well-formed UTF-8 sequence starting there (and moves *i to its
// last byte), or the one byte as \xNN when none starts there.
void AppendNonAscii(std::string* out, std::string_view s, size_t* i, bool json) {
  const size_t n = Utf8SequenceBytes(s, *i);
  if (n == 0) return AppendHexByte(out, s[*i], json);
  out->append(s.substr(*i, n));
  *i += n - 1;
}

void AppendJsonString(std::string* out, std::string_view s) {
  out->push_back('"');
  for (size_t i = 0; i < s.size(); ++i) {
    const char c = s[i];
    if (static_cast<unsigned char>(c) >= 0x80) {
      AppendNonAscii(out, s, &i, true);
      continue;
    }
    switch (c) {
      case '"':
        *out += "\\\"";
        break;
      case '\\':
        *out += "\\\\";
        break;
      case '\n':
        *out += "\\n";
        break;
      case '\t':
        *out += "\\t";
        break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", c);
          *out += buf;
        } else {
          out->push_back(c);
        }
    }
  }
  out->push_back('"');
}

// Text format: one record is one line whatever its message and fields hold. Backslash,
// control bytes (newline, carriage return, tab, others as \xNN) and bytes that are not
// well-formed UTF-8 (\xNN) are escaped; everything else is kept as it is.
void AppendTextEscaped(std::string* out, std::string_view s) {
  for (size_t i = 0; i < s.size(); ++i) {
    const char c = s[i];
    const auto u = static_cast<unsigned char>(c);
    if (u >= 0x80) {
      AppendNonAscii(out, s, &i, false);
    } else if (c == '\\') {
      *out += "\\\\";
    } else if (c == '\n') {
      *out += "\\n";
    } else if (c == '\r') {
      *out += "\\r";
    } else if (c == '\t') {
      *out += "\\t";
    } else if (u < 0x20 || u == 0x7f) {
      AppendHexByte(out, c, false);
    } else {
      out->push_back(c);
    }
  }
}

std::string Timestamp() {
  auto now = std::chrono::system_clock::now();
  auto secs = std::chrono::system_clock::to_time_t(now);
  auto ms =
      std::chrono::duration_cast<std::chrono::milliseconds>(now.time_since_epoch()).count() % 1000;
  std::tm tm{};
  gmtime_r(&secs, &tm);
  char buf[64];
  std::snprintf(buf, sizeof buf, "%04d-%02d-%02dT%02d:%02d:%02d.%03dZ", tm.tm_year + 1900,
                tm.tm_mon + 1, tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec, static_cast<int>(ms));
  return buf;
}

const char* Basename(const char* file) {
  const char* slash = std::strrchr(file, '/');
  return slash ? slash + 1 : file;
}

}  // namespace

void SetLogLevel(LogLevel level) { Level().store(static_cast<int>(level)); }
LogLevel GetLogLevel() { return static_cast<LogLevel>(Level().load(std::memory_order_relaxed)); }
void SetLogFormat(LogFormat format) { Format().store(static_cast<int>(format)); }

bool ParseLogLevel(std::string_view name, LogLevel* level) {
  if (name == "debug")
    *level = LogLevel::kDebug;
  else if (name == "info")
    *level = LogLevel::kInfo;
  else if (name == "warning" || name == "warn")
    *level = LogLevel::kWarning;
  else if (name == "error")
    *level = LogLevel::kError;
  else
    return false;
  return true;
}

namespace internal {

LogMessage::LogMessage(LogLevel level, const char* file, int line)
    : level_(level), file_(file), line_(line) {}

LogMessage::~LogMessage() {
  std::string out;
  if (static_cast<LogFormat>(Format().load()) == LogFormat::kJson) {
    out = "{\"ts\":\"" + Timestamp() + "\",\"level\":\"";
    out.push_back(LevelChar(level_));
    out += "\",\"src\":";
    AppendJsonString(&out, std::string(Basename(file_)) + ":" + std::to_string(line_));
    out += ",\"msg\":";
    AppendJsonString(&out, msg_.str());
    for (const auto& f : fields_) {
      out.push_back(',');
      AppendJsonString(&out, f.key);
      out.push_back(':');
      AppendJsonString(&out, f.value);
    }
    out += "}\n";
  } else {
    out = Timestamp() + " ";
    out.push_back(LevelChar(level_));
    out += " " + std::string(Basename(file_)) + ":" + std::to_string(line_) + "] ";
    AppendTextEscaped(&out, msg_.str());
    for (const auto& f : fields_) {
      out.push_back(' ');
      AppendTextEscaped(&out, f.key);
      out.push_back('=');
      AppendTextEscaped(&out, f.value);
    }
    out.push_back('\n');
  }
  ssize_t ignored = ::write(STDERR_FILENO, out.data(), out.size());
  (void)ignored;
  if (level_ == LogLevel::kFatal) std::abort();
}

}  // namespace internal
}  // namespace kvd
