// Runtime basics in one process: the memory ledger (current and peak bytes per category and of the total,
// reset_peaks), owning tensors charged to it (moves never double count, zero-size tensors), tensor views, the
// error type, the environment knobs (SEQPAR_LOG_LEVEL, SEQPAR_COMM_TIMEOUT_S, raw readers) and log lines.
//
// Knobs are read once per process, so every test of a knob's value runs in a fresh child process (a gtest death
// test in "threadsafe" style re-executes this binary) that sets the variable before anything reads it.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "runtime/env.h"
#include "runtime/error.h"
#include "runtime/logging.h"
#include "runtime/memory.h"
#include "runtime/tensor.h"
#include "runtime/tensor_checks.h"
#include "tests/util/device_collectives.h"

namespace seqpar {
namespace {

constexpr MemCategory kAllCategories[] = {MemCategory::kModelState, MemCategory::kSavedActivation,
                                          MemCategory::kPersistentCache, MemCategory::kWorkspace,
                                          MemCategory::kCommBuffer};
int idx(MemCategory c) { return static_cast<int>(c); }

// ---- ledger arithmetic on a private ledger -----------------------------------------------------------------

TEST(Ledger, CategoryNames) {
  const char* names[] = {"model_state", "saved_activation", "persistent_cache", "workspace", "comm_buffer"};
  for (int i = 0; i < kNumMemCategories; ++i) EXPECT_STREQ(mem_category_name(kAllCategories[i]), names[i]);
}

TEST(Ledger, ScriptedSequenceGivesHandComputedCurrentAndPeaks) {
  MemoryLedger ledger;
  auto expect = [&](std::int64_t ws, std::int64_t ws_peak, std::int64_t comm, std::int64_t comm_peak,
                    std::int64_t model, std::int64_t model_peak, std::int64_t total, std::int64_t total_peak) {
    const MemorySnapshot s = ledger.snapshot();
    EXPECT_EQ(s.current[idx(MemCategory::kWorkspace)], ws);
    EXPECT_EQ(s.peak[idx(MemCategory::kWorkspace)], ws_peak);
    EXPECT_EQ(s.current[idx(MemCategory::kCommBuffer)], comm);
    EXPECT_EQ(s.peak[idx(MemCategory::kCommBuffer)], comm_peak);
    EXPECT_EQ(s.current[idx(MemCategory::kModelState)], model);
    EXPECT_EQ(s.peak[idx(MemCategory::kModelState)], model_peak);
    EXPECT_EQ(s.current[idx(MemCategory::kSavedActivation)], 0);
    EXPECT_EQ(s.peak[idx(MemCategory::kPersistentCache)], 0);
    EXPECT_EQ(s.total_current, total);
    EXPECT_EQ(s.total_peak, total_peak);
  };
  expect(0, 0, 0, 0, 0, 0, 0, 0);
  ledger.on_alloc(MemCategory::kWorkspace, 100);
  expect(100, 100, 0, 0, 0, 0, 100, 100);
  ledger.on_alloc(MemCategory::kCommBuffer, 50);
  expect(100, 100, 50, 50, 0, 0, 150, 150);
  ledger.on_free(MemCategory::kWorkspace, 100);
  expect(0, 100, 50, 50, 0, 0, 50, 150);
  ledger.on_alloc(MemCategory::kModelState, 30);
  expect(0, 100, 50, 50, 30, 30, 80, 150);
  ledger.reset_peaks();
  expect(0, 0, 50, 50, 30, 30, 80, 80);
  ledger.on_alloc(MemCategory::kWorkspace, 10);
  expect(10, 10, 50, 50, 30, 30, 90, 90);
  ledger.on_free(MemCategory::kCommBuffer, 50);
  ledger.on_free(MemCategory::kModelState, 30);
  ledger.on_free(MemCategory::kWorkspace, 10);
  expect(0, 10, 0, 50, 0, 30, 0, 90);
}

// The peak of the total is the peak of the sum, not the sum of the per-category peaks (docs/design.md, "Memory ledger").
TEST(Ledger, TotalPeakIsPeakOfSumNotSumOfPeaks) {
  MemoryLedger ledger;
  ledger.on_alloc(MemCategory::kWorkspace, 100);
  ledger.on_free(MemCategory::kWorkspace, 100);
  ledger.on_alloc(MemCategory::kCommBuffer, 70);
  const MemorySnapshot s = ledger.snapshot();
  EXPECT_EQ(s.peak[idx(MemCategory::kWorkspace)], 100);
  EXPECT_EQ(s.peak[idx(MemCategory::kCommBuffer)], 70);
  EXPECT_EQ(s.total_peak, 100);
  EXPECT_EQ(s.total_current, 70);
}

// Random allocations, frees and peak resets against a plain model of the same bookkeeping.
TEST(Ledger, RandomSequenceMatchesModel) {
  MemoryLedger ledger;
  std::mt19937 gen(12345);
  struct Live {
    MemCategory category;
    std::int64_t bytes;
  };
  std::vector<Live> live;
  std::int64_t cur[kNumMemCategories] = {}, peak[kNumMemCategories] = {};
  std::int64_t total = 0, total_peak = 0;
  for (int step = 0; step < 3000; ++step) {
    const unsigned action = gen() % 10;
    if (action < 5 || live.empty()) {
      const MemCategory c = kAllCategories[gen() % kNumMemCategories];
      const std::int64_t bytes = static_cast<std::int64_t>(gen() % 100000);
      ledger.on_alloc(c, bytes);
      live.push_back({c, bytes});
      cur[idx(c)] += bytes;
      total += bytes;
    } else if (action < 9) {
      const std::size_t k = gen() % live.size();
      ledger.on_free(live[k].category, live[k].bytes);
      cur[idx(live[k].category)] -= live[k].bytes;
      total -= live[k].bytes;
      live.erase(live.begin() + static_cast<std::ptrdiff_t>(k));
    } else {
      ledger.reset_peaks();
      for (int c = 0; c < kNumMemCategories; ++c) peak[c] = cur[c];
      total_peak = total;
    }
    for (int c = 0; c < kNumMemCategories; ++c) peak[c] = std::max(peak[c], cur[c]);
    total_peak = std::max(total_peak, total);
    const MemorySnapshot s = ledger.snapshot();
    for (int c = 0; c < kNumMemCategories; ++c) {
      ASSERT_EQ(s.current[c], cur[c]) << "step " << step << " category " << c;
      ASSERT_EQ(s.peak[c], peak[c]) << "step " << step << " category " << c;
    }
    ASSERT_EQ(s.total_current, total) << "step " << step;
    ASSERT_EQ(s.total_peak, total_peak) << "step " << step;
  }
}

// ---- tensors charged to the process ledger ---------------------------------------------------------------

// Differences of the process ledger since construction (other tests may leave nothing behind, but do not rely
// on a zero start).
struct LedgerDelta {
  MemorySnapshot base = memory_ledger().snapshot();
  std::int64_t current(MemCategory c) const {
    return memory_ledger().snapshot().current[idx(c)] - base.current[idx(c)];
  }
  std::int64_t total() const { return memory_ledger().snapshot().total_current - base.total_current; }
};

TEST(Tensor, AllocationIsChargedToItsCategoryAndReleased) {
  const LedgerDelta d;
  {
    Tensor t = Tensor::empty({2, 3, 4}, DType::kFloat32, MemCategory::kSavedActivation);
    EXPECT_TRUE(t.defined());
    EXPECT_EQ(t.numel(), 24);
    EXPECT_EQ(t.nbytes(), 96u);
    EXPECT_EQ(t.category(), MemCategory::kSavedActivation);
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(t.data()) % 64, 0u);
    EXPECT_EQ(d.current(MemCategory::kSavedActivation), 96);
    EXPECT_EQ(d.current(MemCategory::kWorkspace), 0);
    EXPECT_EQ(d.total(), 96);
    Tensor u = Tensor::empty({5}, DType::kBFloat16, MemCategory::kPersistentCache);
    EXPECT_EQ(d.current(MemCategory::kPersistentCache), 10);
    EXPECT_EQ(d.total(), 106);
  }
  for (MemCategory c : kAllCategories) EXPECT_EQ(d.current(c), 0) << mem_category_name(c);
  EXPECT_EQ(d.total(), 0);
}

TEST(Tensor, WithoutACategoryIsWorkspace) {
  const LedgerDelta d;
  {
    Tensor t = Tensor::empty({3, 4}, DType::kFloat64);
    Tensor z = Tensor::zeros({2}, DType::kFloat32);
    EXPECT_EQ(t.category(), MemCategory::kWorkspace);
    EXPECT_EQ(z.category(), MemCategory::kWorkspace);
    EXPECT_EQ(d.current(MemCategory::kWorkspace), 104);
    EXPECT_EQ(d.total(), 104);
  }
  EXPECT_EQ(d.total(), 0);
}

TEST(Tensor, MovesNeverDoubleCount) {
  const LedgerDelta d;
  {
    Tensor a = Tensor::empty({10}, DType::kFloat64, MemCategory::kModelState);  // 80 bytes
    void* const ptr = a.data();
    Tensor b(std::move(a));
    EXPECT_EQ(d.current(MemCategory::kModelState), 80);
    EXPECT_FALSE(a.defined());  // NOLINT(bugprone-use-after-move): moved-from state is specified
    EXPECT_EQ(a.data(), nullptr);
    EXPECT_EQ(b.data(), ptr);
    EXPECT_TRUE(b.defined());

    Tensor c = Tensor::empty({10}, DType::kInt32, MemCategory::kWorkspace);  // 40 bytes
    EXPECT_EQ(d.total(), 120);
    c = std::move(b);  // frees c's 40 workspace bytes, takes b's 80 model_state bytes
    EXPECT_EQ(d.current(MemCategory::kWorkspace), 0);
    EXPECT_EQ(d.current(MemCategory::kModelState), 80);
    EXPECT_EQ(c.category(), MemCategory::kModelState);
    EXPECT_EQ(c.data(), ptr);

    Tensor& alias = c;
    c = std::move(alias);  // self move-assignment keeps the tensor
    EXPECT_EQ(c.data(), ptr);
    EXPECT_EQ(d.total(), 80);

    // A growing vector moves its tensors on every reallocation.
    std::vector<Tensor> many;
    for (int i = 0; i < 33; ++i) many.push_back(Tensor::empty({i + 1}, DType::kFloat16, MemCategory::kCommBuffer));
    EXPECT_EQ(d.current(MemCategory::kCommBuffer), 2 * 33 * 34 / 2);
    many.erase(many.begin(), many.begin() + 10);  // frees sizes 1..10
    EXPECT_EQ(d.current(MemCategory::kCommBuffer), 2 * (33 * 34 / 2 - 10 * 11 / 2));
  }
  EXPECT_EQ(d.total(), 0);
  for (MemCategory c : kAllCategories) EXPECT_EQ(d.current(c), 0) << mem_category_name(c);
}

TEST(Tensor, ZeroSizeAndScalarShapes) {
  const LedgerDelta d;
  {
    Tensor z = Tensor::empty({0, 5}, DType::kBFloat16, MemCategory::kWorkspace);
    EXPECT_TRUE(z.defined());
    EXPECT_EQ(z.numel(), 0);
    EXPECT_EQ(z.nbytes(), 0u);
    EXPECT_TRUE(z.view().empty());
    EXPECT_EQ(d.total(), 0);
    Tensor z2 = Tensor::zeros({3, 0}, DType::kFloat32, MemCategory::kCommBuffer);  // fill of nothing
    EXPECT_EQ(d.total(), 0);
    Tensor moved = std::move(z);
    EXPECT_TRUE(moved.defined());
    EXPECT_FALSE(z.defined());  // NOLINT(bugprone-use-after-move)

    Tensor scalar = Tensor::empty({}, DType::kInt64, MemCategory::kWorkspace);  // 0-d: one element
    EXPECT_TRUE(scalar.defined());
    EXPECT_EQ(scalar.numel(), 1);
    EXPECT_FALSE(scalar.view().empty());
    EXPECT_EQ(d.current(MemCategory::kWorkspace), 8);
  }
  EXPECT_EQ(d.total(), 0);
  EXPECT_FALSE(Tensor().defined());
  EXPECT_TRUE(TensorView().empty());
}

TEST(Tensor, PeaksSeeTransientAllocationsAndResetToCurrent) {
  Tensor keep = Tensor::empty({25}, DType::kFloat32, MemCategory::kModelState);  // 100 bytes, live throughout
  memory_ledger().reset_peaks();
  const MemorySnapshot base = memory_ledger().snapshot();
  EXPECT_EQ(base.total_peak, base.total_current);
  for (MemCategory c : kAllCategories) EXPECT_EQ(base.peak[idx(c)], base.current[idx(c)]);
  { Tensor a = Tensor::empty({250}, DType::kFloat32, MemCategory::kWorkspace); }   // 1000 bytes, transient
  { Tensor b = Tensor::empty({150}, DType::kFloat32, MemCategory::kCommBuffer); }  // 600 bytes, transient
  {
    Tensor w = Tensor::empty({100}, DType::kFloat32, MemCategory::kWorkspace);  // 400 + 400 bytes at once
    Tensor c = Tensor::empty({100}, DType::kFloat32, MemCategory::kCommBuffer);
  }
  const MemorySnapshot s = memory_ledger().snapshot();
  EXPECT_EQ(s.peak[idx(MemCategory::kWorkspace)] - base.current[idx(MemCategory::kWorkspace)], 1000);
  EXPECT_EQ(s.peak[idx(MemCategory::kCommBuffer)] - base.current[idx(MemCategory::kCommBuffer)], 600);
  EXPECT_EQ(s.peak[idx(MemCategory::kModelState)], base.current[idx(MemCategory::kModelState)]);
  EXPECT_EQ(s.total_peak - base.total_current, 1000);
  EXPECT_EQ(s.total_current, base.total_current);
  for (MemCategory c : kAllCategories) EXPECT_EQ(s.current[idx(c)], base.current[idx(c)]);
  memory_ledger().reset_peaks();
  const MemorySnapshot r = memory_ledger().snapshot();
  EXPECT_EQ(r.total_peak, r.total_current);
  for (MemCategory c : kAllCategories) EXPECT_EQ(r.peak[idx(c)], r.current[idx(c)]);
  EXPECT_GE(r.current[idx(MemCategory::kModelState)], 100);
}

TEST(Tensor, NegativeDimensionIsRejected) {
  const LedgerDelta d;
  try {
    Tensor::empty({2, -1}, DType::kFloat32, MemCategory::kWorkspace);
    ADD_FAILURE() << "no throw";
  } catch (const Error& e) {
    EXPECT_NE(e.message().find("[2, -1] has a negative dimension"), std::string::npos) << e.message();
  }
  EXPECT_EQ(d.total(), 0);
}

TEST(Tensor, ZerosFillZeroAndCopyOf) {
  Tensor t = Tensor::empty({7}, DType::kFloat32, MemCategory::kWorkspace);
  std::memset(t.data(), 0xab, t.nbytes());
  t.fill_zero();
  for (int i = 0; i < 7; ++i) EXPECT_EQ(float_bits(t.data_as<float>()[i]), 0u) << i;
  Tensor z = Tensor::zeros({3, 2}, DType::kInt64, MemCategory::kWorkspace);
  for (int i = 0; i < 6; ++i) EXPECT_EQ(z.data_as<std::int64_t>()[i], 0) << i;

  float src[4] = {1.0f, 1.0f + 0x1p-8f, 3.0f, -0.5f};  // 1 + 2^-8 is a bf16 tie: rounds to even (1.0)
  const LedgerDelta d;
  Tensor c = Tensor::copy_of(TensorView(src, DType::kFloat32, {2, 2}), DType::kBFloat16, MemCategory::kSavedActivation);
  EXPECT_EQ(d.current(MemCategory::kSavedActivation), 8);
  EXPECT_EQ(c.shape(), (Shape{2, 2}));
  EXPECT_EQ(c.category(), MemCategory::kSavedActivation);
  const std::uint16_t want[4] = {0x3f80, 0x3f80, 0x4040, 0xbf00};
  for (int i = 0; i < 4; ++i) EXPECT_EQ(c.data_as<bf16>()[i].bits, want[i]) << i;

  // The copy of a device tensor is made on that device (copy_convert on the stream): without such a device (no
  // CUDA build, no driver, one GPU) the allocation is an Error, never a host copy.
  if (cuda_device_count() < 2) {
    EXPECT_THROW(Tensor::copy_of(TensorView(src, DType::kFloat32, {4}, Device::cuda(1)), DType::kFloat32,
                                 MemCategory::kWorkspace),
                 Error);
  }
}

// The host block cache (runtime/memory.h): a freed block of 1 MiB or more waits for the next allocation of its size
// class and is handed back (the same memory), the ledger counting it free meanwhile; smaller blocks, blocks over the
// limit and a limit of 0 go straight back to the C library.
TEST(HostCache, ReusesFreedLargeBlocksWithinTheLimit) {
  const std::size_t old_limit = host_cache_limit();
  set_host_cache_limit(0);
  EXPECT_EQ(host_cache_bytes(), 0u);
  set_host_cache_limit(std::size_t{8} << 20);
  const std::int64_t before = memory_ledger().snapshot().total_current;
  const std::int64_t n = (std::int64_t{3} << 20) / 4;  // 3 MiB of fp32
  const void* first = nullptr;
  {
    const Tensor t = Tensor::empty({n}, DType::kFloat32, MemCategory::kWorkspace);
    first = t.data();
  }
  EXPECT_EQ(memory_ledger().snapshot().total_current, before) << "a cached block is free for the ledger";
  EXPECT_EQ(host_cache_bytes(), std::size_t{3} << 20);
  {
    const Tensor t = Tensor::empty({n - 3}, DType::kFloat32, MemCategory::kCommBuffer);  // same 64 KiB class
    EXPECT_EQ(t.data(), first) << "the cached block is handed back";
    EXPECT_EQ(host_cache_bytes(), 0u);
    const Tensor z = Tensor::zeros({n}, DType::kFloat32, MemCategory::kWorkspace);  // a fresh block, zero-filled
    const float* zp = static_cast<const float*>(z.data());
    EXPECT_TRUE(std::all_of(zp, zp + n, [](float x) { return x == 0.0f; }));
  }
  EXPECT_EQ(host_cache_bytes(), std::size_t{6} << 20);  // both kept: 6 MiB <= 8 MiB
  {
    const Tensor big = Tensor::empty({(std::int64_t{5} << 20) / 4}, DType::kFloat32, MemCategory::kWorkspace);
    const Tensor small = Tensor::empty({1000}, DType::kFloat32, MemCategory::kWorkspace);
  }
  EXPECT_EQ(host_cache_bytes(), std::size_t{6} << 20) << "over the limit or under 1 MiB: freed";
  set_host_cache_limit(std::size_t{4} << 20);
  EXPECT_LE(host_cache_bytes(), std::size_t{4} << 20) << "a lower limit frees blocks";
  set_host_cache_limit(0);
  EXPECT_EQ(host_cache_bytes(), 0u);
  set_host_cache_limit(old_limit);
}

TEST(TensorView, ReshapeSliceAndDescribe) {
  float buf[24];
  TensorView v(buf, DType::kFloat32, {2, 3, 4});
  EXPECT_EQ(v.str(), "fp32[2, 3, 4]@cpu");
  EXPECT_EQ(v.ndim(), 3);
  EXPECT_EQ(v.dim(-1), 4);
  EXPECT_EQ(v.dim(0), 2);
  EXPECT_EQ(v.nbytes(), 96u);
  EXPECT_FALSE(v.empty());
  const TensorView r = v.reshape({6, 4});
  EXPECT_EQ(r.data(), v.data());
  EXPECT_EQ(r.shape(), (Shape{6, 4}));
  EXPECT_THROW(v.reshape({5, 5}), Error);
  const TensorView s = v.slice0(1, 2);
  EXPECT_EQ(s.data(), static_cast<void*>(buf + 12));
  EXPECT_EQ(s.shape(), (Shape{1, 3, 4}));
  EXPECT_TRUE(v.slice0(2, 2).empty());
  EXPECT_THROW(v.slice0(1, 3), Error);
  EXPECT_THROW(v.slice0(2, 1), Error);
  EXPECT_THROW(v.slice0(-1, 1), Error);
  EXPECT_EQ(v.data_as<float>(), buf);
  EXPECT_THROW(v.data_as<double>(), Error);
  EXPECT_EQ(shape_str({}), "[]");
  EXPECT_EQ(shape_numel({}), 1);
  EXPECT_EQ(Device::cuda(3).str(), "cuda:3");
  try {
    check_shape(v, {2, 3, 5}, "q");
    ADD_FAILURE() << "no throw";
  } catch (const Error& e) {
    EXPECT_EQ(e.message(), "q has shape [2, 3, 4], expected [2, 3, 5]");
  }
  try {
    check_dtype(v, DType::kBFloat16, "k");
    ADD_FAILURE() << "no throw";
  } catch (const Error& e) {
    EXPECT_EQ(e.message(), "k has dtype fp32, expected bf16");
  }
}

// ---- errors ---------------------------------------------------------------------------------------------

TEST(Error, MessageCarriesRankPrefix) {
  const int saved = process_rank();
  set_process_rank(-1);
  EXPECT_STREQ(Error("x").what(), "x");
  set_process_rank(3);
  const Error e("bad thing");
  EXPECT_STREQ(e.what(), "rank 3: bad thing");
  EXPECT_EQ(e.message(), "bad thing");
  try {
    SEQPAR_CHECK(1 + 1 == 3, "seq_len ", 8190, " must be divisible by ", 8);
    ADD_FAILURE() << "no throw";
  } catch (const Error& err) {
    EXPECT_EQ(err.message(), "seq_len 8190 must be divisible by 8");
    EXPECT_STREQ(err.what(), "rank 3: seq_len 8190 must be divisible by 8");
  }
  try {
    SEQPAR_ASSERT(2 < 1, "context ", 7);
    ADD_FAILURE() << "no throw";
  } catch (const Error& err) {
    EXPECT_NE(err.message().find("internal check failed: 2 < 1 context 7"), std::string::npos) << err.message();
    EXPECT_NE(err.message().find("test_ledger.cc:"), std::string::npos) << err.message();
  }
  set_process_rank(saved);
}

// ---- environment knobs -----------------------------------------------------------------------------------

TEST(Env, RawReadersParseFallBackAndReadOnce) {
  ::setenv("SEQPAR_TEST_INT", "-42", 1);
  EXPECT_EQ(env::get_int("SEQPAR_TEST_INT", 0), -42);
  ::setenv("SEQPAR_TEST_INT", "7", 1);
  EXPECT_EQ(env::get_int("SEQPAR_TEST_INT", 0), -42) << "values are read once";
  ::unsetenv("SEQPAR_TEST_UNSET");
  EXPECT_EQ(env::get_int("SEQPAR_TEST_UNSET", 5), 5);
  EXPECT_EQ(env::get_double("SEQPAR_TEST_UNSET", 0.5), 0.5);
  EXPECT_EQ(env::get_string("SEQPAR_TEST_UNSET", "dflt"), "dflt");
  ::setenv("SEQPAR_TEST_EMPTY", "", 1);
  EXPECT_EQ(env::get_int("SEQPAR_TEST_EMPTY", 9), 9);
  EXPECT_EQ(env::get_double("SEQPAR_TEST_EMPTY", 1.5), 1.5);
  EXPECT_EQ(env::get_string("SEQPAR_TEST_EMPTY", "dflt"), "");
  ::setenv("SEQPAR_TEST_BIG", "9223372036854775807", 1);
  EXPECT_EQ(env::get_int("SEQPAR_TEST_BIG", 0), INT64_MAX);
  ::setenv("SEQPAR_TEST_DOUBLE", "2.5e-1", 1);
  EXPECT_EQ(env::get_double("SEQPAR_TEST_DOUBLE", 0), 0.25);
  ::setenv("SEQPAR_TEST_STRING", "ring_inner", 1);
  EXPECT_EQ(env::get_string("SEQPAR_TEST_STRING", ""), "ring_inner");

  struct Bad {
    const char* name;
    const char* value;
    bool integer;  // read by get_int, else by get_double
    const char* message;
  };
  const Bad bad[] = {{"SEQPAR_TEST_BAD_INT", "12abc", true, "SEQPAR_TEST_BAD_INT=12abc is not an integer"},
                     {"SEQPAR_TEST_HUGE_INT", "99999999999999999999", true,
                      "SEQPAR_TEST_HUGE_INT=99999999999999999999 is out of the range of a 64-bit integer"},
                     {"SEQPAR_TEST_BAD_DOUBLE", "1.5s", false, "SEQPAR_TEST_BAD_DOUBLE=1.5s is not a finite number"},
                     {"SEQPAR_TEST_INF_DOUBLE", "inf", false, "SEQPAR_TEST_INF_DOUBLE=inf is not a finite number"}};
  for (const Bad& b : bad) {
    ::setenv(b.name, b.value, 1);
    EXPECT_EQ(test::error_of([&] {
                if (b.integer) {
                  env::get_int(b.name, 0);
                } else {
                  env::get_double(b.name, 0);
                }
              }),
              b.message);
  }
}

// Knob values, each checked in a fresh process (see the top of the file).
class EnvDeathTest : public ::testing::Test {
 protected:
  void SetUp() override { GTEST_FLAG_SET(death_test_style, "threadsafe"); }
};

void set_or_unset(const char* name, const char* value) {
  if (value) {
    ::setenv(name, value, 1);
  } else {
    ::unsetenv(name);
  }
}

// In a death test's child: sets `name` to `value` and runs `read`; exits 3 after printing the message of the Error it
// throws to stderr, or 0 when it throws none.
template <typename Read>
[[noreturn]] void exit_on_error(const char* name, const char* value, Read read) {
  ::setenv(name, value, 1);
  try {
    read();
  } catch (const Error& e) {
    std::fprintf(stderr, "%s\n", e.what());
    std::exit(3);
  }
  std::exit(0);
}

TEST_F(EnvDeathTest, LogLevelValues) {
  struct Case {
    const char* value;
    env::LogLevel want;
  };
  const Case cases[] = {{nullptr, env::LogLevel::kWarn},   {"", env::LogLevel::kWarn},
                        {"error", env::LogLevel::kError},  {"warn", env::LogLevel::kWarn},
                        {"warning", env::LogLevel::kWarn}, {"INFO", env::LogLevel::kInfo},
                        {"Debug", env::LogLevel::kDebug}};
  for (const Case& c : cases) {
    EXPECT_EXIT(
        {
          set_or_unset("SEQPAR_LOG_LEVEL", c.value);
          const bool ok = env::log_level() == c.want && log_enabled(c.want) && log_enabled(env::LogLevel::kError) &&
                          (c.want == env::LogLevel::kDebug ||
                           !log_enabled(static_cast<env::LogLevel>(static_cast<int>(c.want) + 1)));
          std::exit(ok ? 0 : 1);
        },
        ::testing::ExitedWithCode(0), "")
        << "SEQPAR_LOG_LEVEL=" << (c.value ? c.value : "<unset>");
  }
}

TEST_F(EnvDeathTest, HostCacheLimitValues) {
  const std::pair<const char*, std::size_t> cases[] = {
      {nullptr, std::size_t{1024} << 20}, {"0", 0}, {"16", std::size_t{16} << 20}};
  for (const auto& [value, want] : cases) {
    EXPECT_EXIT(
        {
          set_or_unset("SEQPAR_HOST_CACHE_MB", value);
          std::exit(host_cache_limit() == want ? 0 : 1);
        },
        ::testing::ExitedWithCode(0), "")
        << "SEQPAR_HOST_CACHE_MB=" << (value ? value : "<unset>");
  }
  EXPECT_EXIT(
      {
        ::setenv("SEQPAR_HOST_CACHE_MB", "-1", 1);
        const std::string e = test::error_of([] { host_cache_limit(); });
        std::exit(e == "SEQPAR_HOST_CACHE_MB=-1 must be >= 0 (0: no host block cache)" ? 0 : 1);
      },
      ::testing::ExitedWithCode(0), "");
  // 2^44 MiB is 2^64 bytes: it wrapped to a limit of 0 (the cache off without a word).
  EXPECT_EXIT(
      {
        ::setenv("SEQPAR_HOST_CACHE_MB", "17592186044416", 1);
        const std::string e = test::error_of([] { host_cache_limit(); });
        std::fprintf(stderr, "%s\n", e.c_str());
        std::exit(e.find("SEQPAR_HOST_CACHE_MB=17592186044416 must be <= 8796093022207") == 0 ? 0 : 1);
      },
      ::testing::ExitedWithCode(0), "");
  EXPECT_EXIT(
      {
        ::setenv("SEQPAR_HOST_CACHE_MB", "8796093022207", 1);
        std::exit(host_cache_limit() == std::size_t{8796093022207} << 20 ? 0 : 1);
      },
      ::testing::ExitedWithCode(0), "");
}

TEST_F(EnvDeathTest, MalformedLogLevelIsAnErrorNamingTheValue) {
  EXPECT_EXIT(exit_on_error("SEQPAR_LOG_LEVEL", "loud", [] { env::log_level(); }), ::testing::ExitedWithCode(3),
              "SEQPAR_LOG_LEVEL=loud must be one of error, warn, info, debug");
}

TEST_F(EnvDeathTest, LogLinesCarryRankAndLevelAndRespectTheLevel) {
  EXPECT_EXIT(
      {
        ::setenv("SEQPAR_LOG_LEVEL", "info", 1);
        set_process_rank(2);
        int evaluated = 0;
        auto side_effect = [&] { return ++evaluated; };
        ::testing::internal::CaptureStderr();
        SEQPAR_LOG(kInfo) << "ring step " << 3;
        SEQPAR_LOG(kDebug) << "hidden " << side_effect();
        SEQPAR_LOG(kWarn) << "slow peer";
        SEQPAR_LOG(kError) << "bad";
        const std::string out = ::testing::internal::GetCapturedStderr();
        const std::string want =
            "[seqpar rank 2 INFO] ring step 3\n[seqpar rank 2 WARN] slow peer\n[seqpar rank 2 ERROR] bad\n";
        std::fprintf(stderr, "captured: <%s> evaluated=%d\n", out.c_str(), evaluated);
        std::exit(out == want && evaluated == 0 ? 0 : 1);
      },
      ::testing::ExitedWithCode(0), "");
}

TEST_F(EnvDeathTest, CommTimeoutValues) {
  EXPECT_EXIT(
      {
        ::unsetenv("SEQPAR_COMM_TIMEOUT_S");
        std::exit(env::comm_timeout_s() == 300.0 ? 0 : 1);
      },
      ::testing::ExitedWithCode(0), "");
  EXPECT_EXIT(
      {
        ::setenv("SEQPAR_COMM_TIMEOUT_S", "2.5", 1);
        std::exit(env::comm_timeout_s() == 2.5 ? 0 : 1);
      },
      ::testing::ExitedWithCode(0), "");
  struct Bad {
    const char* value;
    const char* message;
  };
  const Bad bad[] = {{"abc", "SEQPAR_COMM_TIMEOUT_S=abc is not a finite number"},
                     {"inf", "SEQPAR_COMM_TIMEOUT_S=inf is not a finite number"},
                     {"0", "SEQPAR_COMM_TIMEOUT_S=0 must be positive"},
                     {"-3", "SEQPAR_COMM_TIMEOUT_S=-3 must be positive"}};
  for (const Bad& b : bad) {
    EXPECT_EXIT(exit_on_error("SEQPAR_COMM_TIMEOUT_S", b.value, [] { env::comm_timeout_s(); }),
                ::testing::ExitedWithCode(3), b.message)
        << b.value;
  }
}

}  // namespace
}  // namespace seqpar
