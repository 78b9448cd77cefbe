#include "runtime/fault.h"

#include <atomic>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <mutex>
#include <set>
#include <sstream>
#include <thread>
#include <vector>

#include "runtime/env.h"
#include "runtime/error.h"

namespace seqpar::fault {
namespace {

std::atomic<long long> g_comm_calls{0};
std::atomic<long long> g_allocations{0};
std::mutex g_ops_mutex;
std::vector<std::string> g_ops;  // kind=count: every communication call's "<group>: <op>", in order

bool applies_here(const Plan& p) { return p.kind != Kind::kNone && p.rank == process_rank(); }

// With kind=count, prints the totals when the process exits (after MPI is gone: plain stderr); with another kind
// whose call or allocation was never reached (at= beyond what this rank made), says so, since the run then tested
// nothing.
struct CountReport {
  ~CountReport() {
    const Plan& p = plan();
    if (p.kind == Kind::kNone || p.rank != process_rank()) return;
    if (p.kind != Kind::kCount) {
      const bool oom = p.kind == Kind::kOom;
      const long long made = oom ? g_allocations.load() : g_comm_calls.load();
      if (made < p.at) {
        std::fprintf(stderr,
                     "rank %d: warning: SEQPAR_FAULT: the fault at %s %lld was never injected (this rank made %lld)\n",
                     p.rank, oom ? "allocation" : "communication call", p.at, made);
      }
      return;
    }
    std::string ops;
    for (const std::string& op : g_ops) ops += (ops.empty() ? "" : ",") + op;
    std::fprintf(stderr, "rank %d: SEQPAR_FAULT count: %lld communication calls, %lld allocations\n", p.rank,
                 g_comm_calls.load(), g_allocations.load());
    std::fprintf(stderr, "rank %d: SEQPAR_FAULT calls: %s\n", p.rank, ops.c_str());
  }
};

// A non-negative integer of at most `max` (strtoll alone would clamp an overflow to LLONG_MAX and accept it).
long long parse_positive(const std::string& value, const std::string& key, const std::string& text, long long max) {
  char* end = nullptr;
  errno = 0;
  const long long v = std::strtoll(text.c_str(), &end, 10);
  SEQPAR_CHECK(!text.empty() && std::isdigit(static_cast<unsigned char>(text[0])) && end && *end == '\0' &&
                   errno == 0 && v >= 0 && v <= max,
               "SEQPAR_FAULT=", value, ": ", key, "=", text, " must be a non-negative integer of at most ", max);
  return v;
}

}  // namespace

Plan parse_plan(const std::string& value) {
  Plan p;
  if (value.empty()) return p;
  constexpr const char* kRule =
      " (expected <comm_error|oom|stall|count>,rank=<world rank>,at=<n>[,seconds=<t>], e.g. comm_error,rank=1,at=5)";
  std::vector<std::string> fields;
  std::stringstream ss(value);
  for (std::string field; std::getline(ss, field, ',');) fields.push_back(field);
  SEQPAR_CHECK(!fields.empty(), "SEQPAR_FAULT=", value, " is empty", kRule);
  const std::string& kind = fields[0];
  if (kind == "comm_error") {
    p.kind = Kind::kCommError;
  } else if (kind == "oom") {
    p.kind = Kind::kOom;
  } else if (kind == "stall") {
    p.kind = Kind::kStall;
  } else if (kind == "count") {
    p.kind = Kind::kCount;
  } else {
    SEQPAR_THROW("SEQPAR_FAULT=", value, ": unknown kind '", kind, "'", kRule);
  }
  bool has_rank = false, has_at = false, has_seconds = false;
  std::set<std::string> seen;
  for (std::size_t i = 1; i < fields.size(); ++i) {
    const std::string& f = fields[i];
    const auto eq = f.find('=');
    SEQPAR_CHECK(eq != std::string::npos, "SEQPAR_FAULT=", value, ": field '", f, "' is not key=value", kRule);
    const std::string key = f.substr(0, eq), text = f.substr(eq + 1);
    SEQPAR_CHECK(seen.insert(key).second, "SEQPAR_FAULT=", value, ": ", key, "= is given twice", kRule);
    if (key == "rank") {
      p.rank = static_cast<int>(parse_positive(value, key, text, std::numeric_limits<int>::max()));
      has_rank = true;
    } else if (key == "at") {
      p.at = parse_positive(value, key, text, std::numeric_limits<long long>::max());
      SEQPAR_CHECK(p.at >= 1, "SEQPAR_FAULT=", value, ": at=", text, " must be >= 1 (calls are counted from 1)");
      has_at = true;
    } else if (key == "seconds") {
      char* end = nullptr;
      p.seconds = std::strtod(text.c_str(), &end);
      SEQPAR_CHECK(!text.empty() && end && *end == '\0' && p.seconds > 0 && p.seconds < 1e6, "SEQPAR_FAULT=", value,
                   ": seconds=", text, " must be a positive number of seconds");
      has_seconds = true;
    } else {
      SEQPAR_THROW("SEQPAR_FAULT=", value, ": unknown key '", key, "'", kRule);
    }
  }
  SEQPAR_CHECK(has_rank, "SEQPAR_FAULT=", value, ": rank=<world rank> is missing", kRule);
  SEQPAR_CHECK(has_at || p.kind == Kind::kCount, "SEQPAR_FAULT=", value, ": at=<n> is missing", kRule);
  SEQPAR_CHECK(has_seconds == (p.kind == Kind::kStall), "SEQPAR_FAULT=", value,
               p.kind == Kind::kStall ? ": stall needs seconds=<t>" : ": seconds= applies to stall only", kRule);
  return p;
}

void check_rank_in_world(const Plan& p, int world_size) {
  SEQPAR_CHECK(p.kind == Kind::kNone || p.rank < world_size, "SEQPAR_FAULT: rank=", p.rank,
               " is not a world rank of this job (", world_size, " ranks: 0..", world_size - 1,
               "); the fault would never be injected");
}

const Plan& plan() {
  static const Plan p = parse_plan(env::get_string("SEQPAR_FAULT", ""));
  static CountReport report;
  return p;
}

void on_comm_call(const char* op) {
  const Plan& p = plan();
  if (p.kind == Kind::kNone) return;
  const long long n = ++g_comm_calls;
  if (p.kind == Kind::kCount && applies_here(p)) {
    std::lock_guard<std::mutex> lock(g_ops_mutex);
    g_ops.emplace_back(op);
  }
  if (!applies_here(p) || n != p.at) return;
  if (p.kind == Kind::kCommError) {
    SEQPAR_THROW("injected fault (SEQPAR_FAULT): communication call ", n, " (", op, ") fails");
  }
  if (p.kind == Kind::kStall) {
    std::fprintf(stderr, "rank %d: SEQPAR_FAULT: stalling %.1f s in communication call %lld (%s)\n", p.rank, p.seconds,
                 n, op);
    std::fflush(stderr);
    std::this_thread::sleep_for(std::chrono::duration<double>(p.seconds));
  }
}

bool fail_allocation() {
  const Plan& p = plan();
  if (p.kind == Kind::kNone) return false;
  const long long n = ++g_allocations;
  return applies_here(p) && p.kind == Kind::kOom && n == p.at;
}

}  // namespace seqpar::fault
