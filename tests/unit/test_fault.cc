// SEQPAR_FAULT parsing (runtime/fault.h) and the out-of-memory message of the ledger. The injected faults themselves
// are exercised end to end under mpirun by tests/fault/fault_injection.py.
#include <gtest/gtest.h>

#include <cstddef>
#include <string>

#include "runtime/error.h"
#include "runtime/fault.h"
#include "runtime/memory.h"

namespace seqpar {
namespace {

void expect_error(const std::string& value, const std::string& fragment) {
  try {
    fault::parse_plan(value);
    FAIL() << "SEQPAR_FAULT=" << value << " was accepted";
  } catch (const Error& e) {
    EXPECT_NE(e.message().find(fragment), std::string::npos) << e.message();
    EXPECT_NE(e.message().find(value), std::string::npos) << "the message must quote the value: " << e.message();
  }
}

TEST(Fault, ParsesEveryKind) {
  EXPECT_EQ(fault::parse_plan("").kind, fault::Kind::kNone);
  const fault::Plan c = fault::parse_plan("comm_error,rank=3,at=7");
  EXPECT_EQ(c.kind, fault::Kind::kCommError);
  EXPECT_EQ(c.rank, 3);
  EXPECT_EQ(c.at, 7);
  const fault::Plan o = fault::parse_plan("oom,at=12,rank=0");
  EXPECT_EQ(o.kind, fault::Kind::kOom);
  EXPECT_EQ(o.rank, 0);
  EXPECT_EQ(o.at, 12);
  const fault::Plan s = fault::parse_plan("stall,rank=1,at=2,seconds=6.5");
  EXPECT_EQ(s.kind, fault::Kind::kStall);
  EXPECT_DOUBLE_EQ(s.seconds, 6.5);
  EXPECT_EQ(fault::parse_plan("count,rank=2").kind, fault::Kind::kCount);
}

TEST(Fault, RejectsMalformedValues) {
  expect_error("crash,rank=1,at=1", "unknown kind");
  expect_error("comm_error,at=1", "rank=<world rank> is missing");
  expect_error("comm_error,rank=1", "at=<n> is missing");
  expect_error("comm_error,rank=1,at=0", "must be >= 1");
  expect_error("comm_error,rank=-1,at=1", "non-negative integer");
  expect_error("comm_error,rank=x,at=1", "non-negative integer");
  expect_error("stall,rank=1,at=1", "stall needs seconds");
  expect_error("stall,rank=1,at=1,seconds=-2", "positive number of seconds");
  expect_error("oom,rank=1,at=1,seconds=2", "applies to stall only");
  expect_error("oom,rank=1,at=1,when=now", "unknown key");
  expect_error("oom,rank=1,at", "not key=value");
  // Out of range: strtoll would clamp to LLONG_MAX and the cast to int wrap (4294967297 became rank 1).
  expect_error("comm_error,rank=4294967297,at=1", "at most 2147483647");
  expect_error("comm_error,rank=1,at=99999999999999999999", "non-negative integer");
  expect_error("comm_error,rank=+1,at=1", "non-negative integer");
  expect_error("comm_error,rank= 1,at=1", "non-negative integer");
  // A key given twice is ambiguous (which one did the caller mean?).
  expect_error("comm_error,rank=1,at=2,rank=3", "rank= is given twice");
}

TEST(Fault, RankMustBeInTheWorld) {
  fault::check_rank_in_world(fault::parse_plan(""), 1);
  fault::check_rank_in_world(fault::parse_plan("comm_error,rank=3,at=1"), 4);
  try {
    fault::check_rank_in_world(fault::parse_plan("comm_error,rank=4,at=1"), 4);
    FAIL() << "rank=4 of a 4-rank job was accepted";
  } catch (const Error& e) {
    EXPECT_NE(e.message().find("rank=4 is not a world rank of this job (4 ranks: 0..3)"), std::string::npos)
        << e.message();
  }
}

TEST(Fault, OutOfMemoryNamesTheBytesAndTheLedger) {
  const std::size_t huge = std::size_t{1} << 62;  // no machine has 4 EiB: aligned_alloc returns null
  try {
    void* p = ledger_allocate(huge, MemCategory::kWorkspace, Device{});
    ledger_free(p, huge, MemCategory::kWorkspace, Device{});
    FAIL() << "allocating 4 EiB succeeded";
  } catch (const Error& e) {
    const std::string& m = e.message();
    EXPECT_NE(m.find("out of memory"), std::string::npos) << m;
    EXPECT_NE(m.find(std::to_string(huge)), std::string::npos) << m;
    EXPECT_NE(m.find("workspace"), std::string::npos) << m;
    EXPECT_NE(m.find("saved_activation"), std::string::npos) << "the ledger's categories: " << m;
    EXPECT_NE(m.find("total"), std::string::npos) << m;
  }
}

}  // namespace
}  // namespace seqpar
