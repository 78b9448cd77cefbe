// Logging with a rank prefix: `SEQPAR_LOG(kInfo) << "ring step " << step;` writes
// "[seqpar rank 2 INFO] ring step 1" to stderr when SEQPAR_LOG_LEVEL allows it. Thread-safe per line.
#pragma once

#include <sstream>

#include "env.h"

namespace seqpar {

class LogLine {
 public:
  explicit LogLine(env::LogLevel level) : level_(level) {}
  ~LogLine();
  template <typename T>
  LogLine& operator<<(const T& value) {
    os_ << value;
    return *this;
  }

 private:
  env::LogLevel level_;
  std::ostringstream os_;
};

inline bool log_enabled(env::LogLevel level) { return static_cast<int>(level) <= static_cast<int>(env::log_level()); }

}  // namespace seqpar

#define SEQPAR_LOG(level)                                       \
  if (!::seqpar::log_enabled(::seqpar::env::LogLevel::level)) { \
  } else                                                        \
    ::seqpar::LogLine(::seqpar::env::LogLevel::level)
