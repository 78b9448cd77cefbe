// Environment knobs. Each is read once (first use) from a variable with the SEQPAR_ prefix; docs/operations.md lists
// them all. A malformed value is an error naming the variable and the value.
#pragma once

#include <cstdint>
#include <string>

namespace seqpar::env {

// Log level: SEQPAR_LOG_LEVEL = error | warn | info | debug (any case; default warn, also when set but empty).
enum class LogLevel : int { kError = 0, kWarn = 1, kInfo = 2, kDebug = 3 };
LogLevel log_level();

// Default timeout for communication waits, in seconds: SEQPAR_COMM_TIMEOUT_S (default 300).
double comm_timeout_s();

// The lowered-attention test mode: SEQPAR_LOWERED_ATTENTION = 0 | 1 exactly (default 0, also when set but empty).
bool lowered_attention();

// GDN context parallelism's work ahead: SEQPAR_GDN_WORK_AHEAD = 0 | 1 (default 1, also when set but empty); another
// value is an error naming it.
bool gdn_work_ahead();
// GDN context parallelism's deferred saved copies: SEQPAR_GDN_DEFER_COPIES = 0 | 1, the same rules.
bool gdn_defer_copies();
// GDN context parallelism's forward work ahead, last waiting window first: SEQPAR_GDN_AHEAD_LAST_FIRST = 0 | 1, the
// same rules.
bool gdn_ahead_last_first();
// GDN context parallelism's lean backward (no dout copy or zero fill where not needed, key-head sums in idle time):
// SEQPAR_GDN_LEAN_BACKWARD = 0 | 1, the same rules.
bool gdn_lean_backward();

// Raw readers; `name` includes the SEQPAR_ prefix. Values are cached after the first read of each name.
std::int64_t get_int(const char* name, std::int64_t fallback);
double get_double(const char* name, double fallback);
std::string get_string(const char* name, const std::string& fallback);

}  // namespace seqpar::env
