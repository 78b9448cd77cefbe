// sp_plan --dynamic-cp on one process: the list schedule against a hand-computed one, a whole plan against a
// hand-computed one (a closed-form time per micro-batch), the limits (only long documents -> the largest degree,
// only short documents -> degree 1), every document in exactly one micro-batch, and the gain >= 0 over the best
// static degree, with sp_plan's own prediction.
#include <gtest/gtest.h>

#include <algorithm>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

#include "benchmarks/sp_plan.h"
#include "benchmarks/sp_plan_dynamic.h"
#include "runtime/error.h"

namespace seqpar::bench::plan {
namespace {

// Flat kernel curves at `flops_per_s`, both links at `latency_s` and `bandwidth`.
DeviceProfile flat_profile(double flops_per_s, double latency_s, double bandwidth) {
  DeviceProfile p;
  p.name = "flat";
  for (const char* k : {"mha_fwd", "mha_bwd", "gdn_fwd", "gdn_bwd", "dsa_fwd", "dsa_bwd"})
    p.kernels[k].points = {{1.0, flops_per_s}};
  p.intra = {latency_s, bandwidth, "test"};
  p.inter = p.intra;
  return p;
}

PlanInput mha_input(int world) {
  PlanInput in;
  in.problem_flags = {"--attn", "mha", "--heads", "2", "--head-dim", "16", "--causal"};
  in.world_size = world;
  in.devices_per_node = world;
  return in;
}

// `call` throws Error whose message holds `what`.
template <typename Call>
void refused(const Call& call, const std::string& what) {
  try {
    call();
    ADD_FAILURE() << "accepted: " << what;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
  }
}

DynamicMicroBatch mb(int degree, double t) {
  DynamicMicroBatch m;
  m.degree = degree;
  m.predicted_s = t;
  return m;
}

// Every document in exactly one micro-batch; degree_of_doc agrees; tokens add up; ranks of one group never run two
// micro-batches at once (the schedule's intervals on each rank are disjoint) and the makespan is the last finish.
void expect_valid(const DynamicPlan& p, const std::vector<std::int64_t>& lens, int world, const std::string& what) {
  ASSERT_TRUE(p.excluded.empty()) << what << ": " << p.excluded;
  std::vector<int> seen(lens.size(), 0);
  std::vector<std::vector<std::pair<double, double>>> busy(world);
  double last = 0;
  for (const DynamicMicroBatch& m : p.micro_batches) {
    std::int64_t tokens = 0;
    for (int d : m.docs) {
      ++seen[d];
      tokens += lens[d];
      EXPECT_EQ(p.degree_of_doc[d], m.degree) << what << ": document " << d;
    }
    EXPECT_EQ(tokens, m.tokens) << what;
    ASSERT_EQ(world % m.degree, 0) << what;
    ASSERT_LT(m.group, world / m.degree) << what;
    for (int r = m.group * m.degree; r < (m.group + 1) * m.degree; ++r)
      busy[r].emplace_back(m.start_s, m.start_s + m.predicted_s);
    last = std::max(last, m.start_s + m.predicted_s);
  }
  for (std::size_t d = 0; d < lens.size(); ++d) EXPECT_EQ(seen[d], 1) << what << ": document " << d;
  for (int r = 0; r < world; ++r) {
    std::sort(busy[r].begin(), busy[r].end());
    for (std::size_t i = 1; i < busy[r].size(); ++i)
      EXPECT_LE(busy[r][i - 1].second, busy[r][i].first * (1 + 1e-12)) << what << ": rank " << r;
  }
  EXPECT_DOUBLE_EQ(p.step_s, last) << what;
  // Execution order is start order.
  for (std::size_t i = 1; i < p.micro_batches.size(); ++i)
    EXPECT_LE(p.micro_batches[i - 1].start_s, p.micro_batches[i].start_s) << what;
}

// W = 2: a degree-2 micro-batch of 4 first on both ranks [0, 4]; then degree 1, longest first, each on the group
// free first (the lower group on ties): 3 on rank 0 [4, 7], 2 on rank 1 [4, 6], 1 on rank 1 [6, 7]. Makespan 7.
TEST(SpPlanDynamic, ScheduleByHand) {
  std::vector<DynamicMicroBatch> mbs = {mb(1, 2), mb(1, 3), mb(2, 4), mb(1, 1)};
  EXPECT_DOUBLE_EQ(schedule_micro_batches(2, mbs), 7.0);
  ASSERT_EQ(mbs.size(), 4u);
  const double want[4][4] = {{2, 4, 0, 0}, {1, 3, 0, 4}, {1, 2, 1, 4}, {1, 1, 1, 6}};  // degree, time, group, start
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(mbs[i].degree, want[i][0]) << i;
    EXPECT_EQ(mbs[i].predicted_s, want[i][1]) << i;
    EXPECT_EQ(mbs[i].group, want[i][2]) << i;
    EXPECT_EQ(mbs[i].start_s, want[i][3]) << i;
  }
  std::vector<DynamicMicroBatch> bad = {mb(3, 1)};
  EXPECT_THROW(schedule_micro_batches(4, bad), Error);
}

// Closed-form time sum(L^2) / d + (d > 1 ? 1 : 0), W = 2, tokens_per_rank 10, documents {10, 10, 2, 2, 2, 2}.
//   static 1 (capacity 10, 3 micro-batches, balanced by causal work): {10}, {10}, {2, 2, 2, 2}: 100, 100, 16 ->
//     ranks 0 and 1 run the 100s, then rank 0 the 16: 116.
//   static 2 (capacity 20, 2 micro-batches): {10, 2, 2}, {10, 2, 2}: (100 + 8) / 2 + 1 = 55 each, one after the
//     other: 110.
//   starts: all at their smallest degree, 1: 116; all at 2: 110; length cuts (quantiles 2 and 10) with 1 < 2: cut 2
//     is all at 2 (110), cut 10 puts {10, 10} at degree 2 (one micro-batch, 200 / 2 + 1 = 101) and {2, 2} | {2, 2}
//     at degree 1 (8 each, side by side): 109.
//   moves from the smallest-degree start (searched first): raising a 10 to 2 gives 51 + 100 + 16 = 167 (kept at 1);
//     raising the 2s one by one gives 3 + 100 + 12 = 115, 5 + 100 + 8 = 113, 7 + 100 + 4 = 111, 9 + 100 = 109;
//     lowering a 2 back or raising a 10 is worse. From cut 10 (109), raising a 2 gives degree 2 {10, 2} + {10}
//     (53 + 51) then {2, 2} | {2} (8): 112, lowering a 10 gives 51 + 100 = 151: it stays at 109, not better than the
//     first. Plan: {2, 2, 2, 2} at degree 2 (9), then {10} | {10} (100): 109; gain 110 / 109 - 1.
TEST(SpPlanDynamic, WholePlanByHand) {
  DynamicInput din;
  din.doc_lens = {10, 10, 2, 2, 2, 2};
  din.tokens_per_rank = 10;
  const MicroBatchTime time = [](int d, const std::vector<std::int64_t>& lens) {
    double s = 0;
    for (std::int64_t l : lens) s += static_cast<double>(l * l);
    return s / d + (d > 1 ? 1.0 : 0.0);
  };
  const DynamicResult r = plan_dynamic(2, din, time);
  ASSERT_EQ(r.statics.size(), 2u);
  EXPECT_DOUBLE_EQ(r.statics[0].step_s, 116.0);
  EXPECT_DOUBLE_EQ(r.statics[1].step_s, 110.0);
  EXPECT_EQ(r.best_static_degree, 2);
  EXPECT_EQ(r.dynamic.name, "dynamic");
  EXPECT_DOUBLE_EQ(r.dynamic.step_s, 109.0);
  EXPECT_EQ(r.dynamic.degree_of_doc, (std::vector<int>{1, 1, 2, 2, 2, 2}));
  EXPECT_DOUBLE_EQ(r.gain, 110.0 / 109.0 - 1.0);
  expect_valid(r.dynamic, din.doc_lens, 2, "by hand");
  // Bad input: a degree that does not divide the world, a document that fits no degree, an empty list.
  DynamicInput bad = din;
  bad.degrees = {1, 3};
  EXPECT_THROW(plan_dynamic(2, bad, time), Error);
  bad = din;
  bad.doc_lens = {10, 30};
  EXPECT_THROW(plan_dynamic(2, bad, time), Error);
  bad.doc_lens = {};
  EXPECT_THROW(plan_dynamic(2, bad, time), Error);
}

// Only long documents: every one longer than (W / 2) x tokens_per_rank runs at W, and so does the plan.
TEST(SpPlanDynamic, OnlyLongDocumentsPickTheLargestDegree) {
  const DeviceProfile prof = flat_profile(1e9, 1e-5, 1e9);
  for (int world : {2, 4}) {
    DynamicInput din;
    din.doc_lens = {1024, 900, 1000, 960};
    din.tokens_per_rank = 1024 / world + 64;  // > 1024 / W: the longest fits at W; < 900 / (W / 2): none below
    const DynamicResult r = plan_dynamic(mha_input(world), prof, din);
    const std::string what = str_cat("world ", world);
    expect_valid(r.dynamic, din.doc_lens, world, what);
    for (int d : r.dynamic.degree_of_doc) EXPECT_EQ(d, world) << what;
    EXPECT_EQ(r.best_static_degree, world) << what;
    EXPECT_DOUBLE_EQ(r.dynamic.step_s, r.best_static_s) << what;
    for (const DynamicPlan& p : r.statics) {
      if (p.name != str_cat("static ", world)) {
        EXPECT_FALSE(p.excluded.empty()) << what << ": " << p.name;
      }
    }
  }
  // One long document and room everywhere (tokens_per_rank its length): CP over the whole world beats leaving
  // ranks idle when compute dominates (fast links).
  DynamicInput one;
  one.doc_lens = {4096};
  one.tokens_per_rank = 4096;
  const DynamicResult r = plan_dynamic(mha_input(4), flat_profile(1e9, 1e-9, 1e12), one);
  EXPECT_EQ(r.dynamic.degree_of_doc, std::vector<int>{4});
  EXPECT_EQ(r.best_static_degree, 4);
}

// Only short documents (as many of each length on every rank) with a slow link: every micro-batch at degree 1 (the
// ring's latency buys nothing).
TEST(SpPlanDynamic, OnlyShortDocumentsPickDegreeOne) {
  const DeviceProfile prof = flat_profile(1e9, 1e-3, 1e8);
  for (int world : {2, 4, 8}) {
    DynamicInput din;
    for (int i = 0; i < 64; ++i) din.doc_lens.push_back(i % 2 == 0 ? 96 : 48);
    const DynamicResult r = plan_dynamic(mha_input(world), prof, din);
    const std::string what = str_cat("world ", world);
    expect_valid(r.dynamic, din.doc_lens, world, what);
    for (int d : r.dynamic.degree_of_doc) EXPECT_EQ(d, 1) << what;
    EXPECT_EQ(r.best_static_degree, 1) << what;
    EXPECT_GE(r.gain, 0.0) << what;
  }
}

// A long-tailed mix: every plan (dynamic and static) is a valid schedule covering every document once, and the
// dynamic plan is no slower than the best static degree, on a fast and a slow link.
TEST(SpPlanDynamic, LongTailCoversEveryDocumentAndNeverLoses) {
  for (const DeviceProfile& prof : {flat_profile(1e9, 1e-6, 1e10), flat_profile(1e9, 1e-3, 1e8)}) {
    for (int world : {2, 4, 8}) {
      for (std::uint64_t seed : {1u, 2u}) {
        DynamicInput din;
        din.doc_lens = doc_mix("loguniform:16:2K", 8192, seed);
        const DynamicResult r = plan_dynamic(mha_input(world), prof, din);
        const std::string what = str_cat("world ", world, " seed ", seed, " latency ", prof.intra.latency_s);
        expect_valid(r.dynamic, din.doc_lens, world, what + " dynamic");
        for (const DynamicPlan& p : r.statics)
          if (p.excluded.empty()) expect_valid(p, din.doc_lens, world, what + " " + p.name);
        ASSERT_GT(r.best_static_degree, 0) << what;
        EXPECT_LE(r.dynamic.step_s, r.best_static_s) << what;
        EXPECT_GE(r.gain, 0.0) << what;
      }
    }
  }
}

TEST(SpPlanDynamic, DocMix) {
  const std::vector<std::int64_t> a = doc_mix("loguniform:256:32K", 1 << 18, 7);
  EXPECT_EQ(std::accumulate(a.begin(), a.end(), std::int64_t{0}), 1 << 18);
  for (std::size_t i = 0; i + 1 < a.size(); ++i) {
    EXPECT_GE(a[i], 256);
    EXPECT_LE(a[i], 32768);
  }
  EXPECT_EQ(a, doc_mix("loguniform:256:32K", 1 << 18, 7));
  EXPECT_THROW(doc_mix("loguniform:300:200", 1000, 1), Error);
  EXPECT_THROW(doc_mix("nosuchmix", 1000, 1), Error);
  // A total below the mix's shortest document would draw one shorter document: refused, naming LO and --tokens.
  refused([] { doc_mix("loguniform:300:400", 200, 1); }, "LO 300 must be <= --tokens 200");
  EXPECT_EQ(doc_mix("loguniform:300:400", 300, 1), std::vector<std::int64_t>{300});
  refused([] { doc_mix("longtail", 63, 1); }, "--doc-dist longtail draws documents of 64 to 16384 tokens: --tokens 63");
  EXPECT_EQ(doc_mix("longtail", 64, 1), std::vector<std::int64_t>{64});
  EXPECT_EQ(doc_mix("short", 1, 1), std::vector<std::int64_t>{1});
}

// A document that runs at no degree: the error gives each degree's reason in degree order, its length over
// d x tokens_per_rank or the refusal's words where the time is infinite ("its predicted time is not finite" without
// them); a static degree that cannot run names the reason too.
TEST(SpPlanDynamic, NoDegreeNamesEachDegreesReason) {
  DynamicInput din;
  din.doc_lens = {15, 4};
  din.tokens_per_rank = 10;
  const MicroBatchTime time = [](int d, const std::vector<std::int64_t>& lens) {
    return d == 2 ? std::numeric_limits<double>::infinity() : static_cast<double>(lens.size());
  };
  const MicroBatchRefusal why = [](int d, const std::vector<std::int64_t>& lens) {
    return str_cat("refused at degree ", d, " with ", lens.size(), " document(s)");
  };
  refused([&] { plan_dynamic(2, din, time, why); },
          "document 0 (15 tokens) cannot run at any degree; degree 1: 15 tokens exceed 1 x tokens_per_rank 10 = 10; "
          "degree 2: refused at degree 2 with 1 document(s)");
  refused([&] { plan_dynamic(2, din, time); }, "degree 2: its predicted time is not finite");
  din.doc_lens = {4, 4};
  const DynamicResult r = plan_dynamic(2, din, time, why);
  ASSERT_EQ(r.statics.size(), 2u);
  EXPECT_EQ(r.statics[1].excluded,
            "a micro-batch of 8 tokens (2 document(s)) cannot run at degree 2: refused at degree 2 with 2 document(s)");
  EXPECT_EQ(r.best_static_degree, 1);
}

// The planner's bounds, refused at once with the limit named: a mix that draws more than kMaxDynamicDocs documents
// (1M documents of one token used to run for hours; 2^50 tokens never ended), more documents than that given
// directly, and lengths whose sum passes 2^48 (ten of 2^60 wrapped the total to a negative tokens_per_rank).
TEST(SpPlanDynamic, Bounds) {
  refused([] { doc_mix("loguniform:1:1", 1 << 20, 1); }, "makes more than 65536 documents (65537 so far)");
  refused([] { doc_mix("short", std::int64_t{1} << 40, 1); }, "makes more than 65536 documents (0 so far)");
  refused([] { doc_mix("short", std::int64_t{1} << 50, 1); }, "--tokens 1125899906842624 must be in [1, 2^48]");
  refused([] { doc_mix("short", std::int64_t{1} << 22, 1); }, "makes more than 65536 documents");
  EXPECT_EQ(doc_mix("loguniform:1:1", 1 << 16, 1).size(), 1u << 16);  // the limit itself is taken
  int calls = 0;
  const MicroBatchTime time = [&](int, const std::vector<std::int64_t>& lens) {
    ++calls;
    return static_cast<double>(lens.size());
  };
  DynamicInput din;
  din.doc_lens.assign(kMaxDynamicDocs + 1, 1);
  refused([&] { plan_dynamic(2, din, time); }, "65537 documents; the planner takes at most 65536");
  din.doc_lens.assign(10, std::int64_t{1} << 60);
  refused([&] { plan_dynamic(2, din, time); }, "document 0 (length 1152921504606846976) hold more than 2^48 tokens");
  din.doc_lens.assign(3, (std::int64_t{1} << 47) + 1);
  refused([&] { plan_dynamic(2, din, time); }, "up to document 1 (length 140737488355329) hold more than 2^48");
  EXPECT_EQ(calls, 0) << "refused before any prediction";
}

}  // namespace
}  // namespace seqpar::bench::plan
