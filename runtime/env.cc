#include "runtime/env.h"

#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <map>
#include <mutex>
#include <optional>

#include "runtime/error.h"

namespace seqpar::env {
namespace {

// Reads each variable once; later changes to the process environment are not seen (by design).
std::optional<std::string> read_once(const char* name) {
  static std::mutex mu;
  static std::map<std::string, std::optional<std::string>> cache;
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find(name);
  if (it == cache.end()) {
    const char* value = std::getenv(name);
    it = cache.emplace(name, value ? std::optional<std::string>(value) : std::nullopt).first;
  }
  return it->second;
}

}  // namespace

std::int64_t get_int(const char* name, std::int64_t fallback) {
  auto value = read_once(name);
  if (!value || value->empty()) return fallback;
  char* end = nullptr;
  errno = 0;
  const long long parsed = std::strtoll(value->c_str(), &end, 10);
  // strtoll skips leading white space; the knobs take the digits alone (as SEQPAR_LOWERED_ATTENTION's 0 / 1).
  SEQPAR_CHECK(end && *end == '\0' && !std::isspace(static_cast<unsigned char>(value->front())), name, "=", *value,
               " is not an integer");
  SEQPAR_CHECK(errno != ERANGE, name, "=", *value, " is out of the range of a 64-bit integer");
  return parsed;
}

double get_double(const char* name, double fallback) {
  auto value = read_once(name);
  if (!value || value->empty()) return fallback;
  char* end = nullptr;
  const double parsed = std::strtod(value->c_str(), &end);
  SEQPAR_CHECK(
      end && *end == '\0' && std::isfinite(parsed) && !std::isspace(static_cast<unsigned char>(value->front())), name,
      "=", *value, " is not a finite number");
  return parsed;
}

std::string get_string(const char* name, const std::string& fallback) {
  auto value = read_once(name);
  return value ? *value : fallback;
}

bool lowered_attention() {
  static const bool on = [] {
    const std::string v = get_string("SEQPAR_LOWERED_ATTENTION", "0");
    SEQPAR_CHECK(v.empty() || v == "0" || v == "1", "SEQPAR_LOWERED_ATTENTION=", v, " must be 0 or 1");
    return v == "1";
  }();
  return on;
}

namespace {
bool switch_on(const char* name) {
  const std::int64_t v = get_int(name, 1);
  SEQPAR_CHECK(v == 0 || v == 1, name, "=", v, " must be 0 or 1");
  return v == 1;
}
}  // namespace

bool gdn_work_ahead() {
  static const bool on = switch_on("SEQPAR_GDN_WORK_AHEAD");
  return on;
}

bool gdn_defer_copies() {
  static const bool on = switch_on("SEQPAR_GDN_DEFER_COPIES");
  return on;
}

bool gdn_ahead_last_first() {
  static const bool on = switch_on("SEQPAR_GDN_AHEAD_LAST_FIRST");
  return on;
}

bool gdn_lean_backward() {
  static const bool on = switch_on("SEQPAR_GDN_LEAN_BACKWARD");
  return on;
}

LogLevel log_level() {
  static const LogLevel level = [] {
    const std::string raw = get_string("SEQPAR_LOG_LEVEL", "warn");
    std::string v = raw;
    for (char& ch : v) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
    if (v.empty()) return LogLevel::kWarn;  // set but empty: the default, as for the numeric knobs
    if (v == "error") return LogLevel::kError;
    if (v == "warn" || v == "warning") return LogLevel::kWarn;
    if (v == "info") return LogLevel::kInfo;
    if (v == "debug") return LogLevel::kDebug;
    SEQPAR_THROW("SEQPAR_LOG_LEVEL=", raw, " must be one of error, warn, info, debug");
  }();
  return level;
}

double comm_timeout_s() {
  static const double timeout = [] {
    const double t = get_double("SEQPAR_COMM_TIMEOUT_S", 300.0);
    SEQPAR_CHECK(t > 0, "SEQPAR_COMM_TIMEOUT_S=", t, " must be positive");
    return t;
  }();
  return timeout;
}

}  // namespace seqpar::env
