// Dynamic CP: micro-batches of one step's documents, each on a grid of its own degree (CpGridSet, built once), MHA
// forward and backward through MhaCp. The independent check: every token's out, lse, dq, dk, dv equals its document
// run alone on one rank in fp64 (per_document_result), and the gradient of a small linear parameter w (out * w,
// summed over this rank's tokens and all-reduced over the world) equals the one-rank sum, at 1e-10; for plans that
// mix every degree dividing the world and for the static plans (all at degree 1, all at degree W). Bad plans and
// grid sets fail on every rank with the same error, before any message but the agreement check.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>

#include "parallel/dynamic_cp.h"
#include "parallel/usp.h"
#include "runtime/cp_grid_set.h"
#include "tests/util/cp_test.h"
#include "tests/util/mha_problem.h"
#include "tests/util/mpi_test.h"
#include "tests/util/test_util.h"

namespace seqpar {
namespace {

using test::world;

constexpr std::int64_t kHq = 4, kHkv = 2, kDim = 16;

std::vector<int> divisors(int n) {
  std::vector<int> d;
  for (int i = 1; i <= n; ++i)
    if (n % i == 0) d.push_back(i);
  return d;
}

// The step's documents: lengths from 1 to 90, an odd total.
const std::vector<std::int64_t> kDocs = {37, 5, 64, 1, 20, 90, 12, 3, 48, 7, 30, 16, 2, 55};

// Documents dealt round-robin, longest first, over the slots (degree, group) of the given degrees (largest degree
// first): every degree and group gets documents when there are enough.
std::vector<DynamicCpMicroBatch> dealt_plan(const std::vector<int>& degrees, int world_size) {
  std::vector<DynamicCpMicroBatch> slots;
  std::vector<int> desc = degrees;
  std::sort(desc.rbegin(), desc.rend());
  for (int d : desc)
    for (int g = 0; g < world_size / d; ++g) slots.push_back({d, g, {}});
  std::vector<std::int64_t> order(kDocs.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [](std::int64_t a, std::int64_t b) { return kDocs[a] > kDocs[b]; });
  for (std::size_t i = 0; i < order.size(); ++i) slots[i % slots.size()].doc_ids.push_back(order[i]);
  std::erase_if(slots, [](const DynamicCpMicroBatch& m) { return m.doc_ids.empty(); });
  return slots;
}

struct StepResult {
  test::MhaResult mha;     // every step token, all-reduced over the world
  std::vector<double> dw;  // [kDim]
};

// Runs every micro-batch of this rank in plan order; each writes its local rows into the step's arrays; one
// all-reduce (sum) over the world gathers them (each token is held by exactly one rank of one group).
StepResult run_step(const CpGridSet& grids, const std::vector<DynamicCpMicroBatch>& plan, const test::MhaShape& s,
                    const test::MhaProblem& p, const Tensor& w, RingImpl impl, LayoutKind kind) {
  const DynamicCpSchedule sched(world(), grids, kDocs, plan);
  const std::int64_t T = sched.num_tokens();
  const std::vector<double> wv = test::to_double(w.view()), g = test::to_double(p.dout.view());
  // dout of the attention: w * g (the loss is sum(out * w * g)).
  Tensor dout = Tensor::empty(p.dout.shape(), DType::kFloat64, MemCategory::kWorkspace);
  for (std::int64_t i = 0; i < dout.numel(); ++i) dout.view().data_as<double>()[i] = g[i] * wv[i % kDim];
  std::vector<double> acc(static_cast<std::size_t>(T * (2 * kHq * kDim + 2 * kHkv * kDim + kHq) + kDim), 0.0);
  double* out = acc.data();
  double* dq = out + T * kHq * kDim;
  double* dk = dq + T * kHq * kDim;
  double* dv = dk + T * kHkv * kDim;
  double* lse = dv + T * kHkv * kDim;
  double* dw = lse + T * kHq;
  for (int m : sched.local()) {
    const CpGrid& grid = sched.grid(m);
    const CpGroups groups = CpGroups::from(grid);
    const SequenceLayout layout = sched.layout(m, kind);
    const std::vector<std::int64_t> step_tok = sched.step_tokens(m);
    auto mb_piece = [&](const Tensor& full) {
      const Tensor rows = test::local_piece(full.view(), step_tok);  // the micro-batch's packed row
      return test::layout_piece(layout, groups.cp_rank(), rows);
    };
    Tensor q = mb_piece(p.q), k = mb_piece(p.k), v = mb_piece(p.v), d = mb_piece(dout);
    MhaCp attn(groups, layout, test::cp_config(s, impl));
    MhaCpOutput o = attn.forward(q.view(), k.view(), v.view());
    MhaCpGrads gr = attn.backward(std::move(o.ctx), d.view());
    const std::vector<std::int64_t> tok = layout.token_index(groups.cp_rank());
    const std::int64_t n = layout.local_len();
    const std::vector<double> lo = test::to_double(o.out.view()), ll = test::to_double(o.lse.view()),
                              lq = test::to_double(gr.dq.view()), lk = test::to_double(gr.dk.view()),
                              lv = test::to_double(gr.dv.view());
    for (std::int64_t i = 0; i < n; ++i) {
      if (tok[i] < 0) continue;
      const std::int64_t t = step_tok[tok[i]];
      for (std::int64_t e = 0; e < kHq * kDim; ++e) {
        out[t * kHq * kDim + e] = lo[i * kHq * kDim + e];
        dq[t * kHq * kDim + e] = lq[i * kHq * kDim + e];
        dw[e % kDim] += lo[i * kHq * kDim + e] * g[t * kHq * kDim + e];
      }
      for (std::int64_t e = 0; e < kHkv * kDim; ++e) {
        dk[t * kHkv * kDim + e] = lk[i * kHkv * kDim + e];
        dv[t * kHkv * kDim + e] = lv[i * kHkv * kDim + e];
      }
      for (std::int64_t h = 0; h < kHq; ++h) lse[h * T + t] = ll[h * n + i];
    }
  }
  world()
      .all_reduce(TensorView(acc.data(), DType::kFloat64, {static_cast<std::int64_t>(acc.size())}), ReduceOp::kSum)
      ->wait();
  StepResult r;
  r.mha.out.assign(out, out + T * kHq * kDim);
  r.mha.dq.assign(dq, dq + T * kHq * kDim);
  r.mha.dk.assign(dk, dk + T * kHkv * kDim);
  r.mha.dv.assign(dv, dv + T * kHkv * kDim);
  r.mha.lse.assign(lse, lse + T * kHq);
  r.dw.assign(dw, dw + kDim);
  return r;
}

TEST(DynamicCp, EveryPlanMatchesOneRank) {
  const int W = world().size();
  const CpGridSet grids(world(), divisors(W));
  const std::vector<std::int64_t> cu = cu_seqlens_of(kDocs);
  const test::MhaShape s = test::one_row_fp64(cu.back(), kHq, kHkv, kDim, {true, 0});
  const test::MhaProblem p(s);
  const Tensor w = test::random_tensor({kDim}, DType::kFloat64, 77);
  // The one-rank reference: each document alone with dout = w * g; dw = sum over tokens and heads of out * g.
  test::MhaProblem pw(s);  // the same seeds: the same q, k, v
  {
    const std::vector<double> wv = test::to_double(w.view()), g = test::to_double(p.dout.view());
    pw.dout = Tensor::empty(p.dout.shape(), DType::kFloat64, MemCategory::kWorkspace);
    for (std::int64_t i = 0; i < pw.dout.numel(); ++i) pw.dout.view().data_as<double>()[i] = g[i] * wv[i % kDim];
  }
  const test::MhaResult want = test::per_document_result(s, pw, cu);
  std::vector<double> want_dw(kDim, 0.0);
  const std::vector<double> g = test::to_double(p.dout.view());
  for (std::size_t i = 0; i < want.out.size(); ++i) want_dw[i % kDim] += want.out[i] * g[i];

  struct Case {
    std::string name;
    std::vector<DynamicCpMicroBatch> plan;
  };
  std::vector<Case> cases = {{"mixed degrees", dealt_plan(divisors(W), W)},
                             {"static 1", dealt_plan({1}, W)},
                             {str_cat("static ", W), dealt_plan({W}, W)}};
  // The largest degree once, then degree 1 (a long document on every rank, the short ones data-parallel).
  if (W > 1) {
    std::vector<DynamicCpMicroBatch> two = dealt_plan({1}, W);
    DynamicCpMicroBatch big{W, 0, {5, 2}};  // the two longest documents
    for (DynamicCpMicroBatch& m : two) std::erase_if(m.doc_ids, [](std::int64_t d) { return d == 5 || d == 2; });
    std::erase_if(two, [](const DynamicCpMicroBatch& m) { return m.doc_ids.empty(); });
    two.insert(two.begin(), big);
    cases.push_back({"largest degree then 1", two});
  }
  for (const Case& c : cases) {
    for (RingImpl impl : {RingImpl::kP2P, RingImpl::kAllGather}) {
      for (LayoutKind kind : {LayoutKind::kZigzag, LayoutKind::kBalanced}) {
        const std::string what =
            str_cat(c.name, " ", ring_impl_name(impl), " ", layout_name(kind), " at ", W, " rank(s)");
        const StepResult got = run_step(grids, c.plan, s, p, w, impl, kind);
        test::expect_mha_close(got.mha, want, 1e-10, what);
        for (int e = 0; e < kDim; ++e)
          EXPECT_NEAR(got.dw[e], want_dw[e], 1e-10 * (1 + std::abs(want_dw[e]))) << what << ": dw[" << e << "]";
      }
    }
  }
}

// Bad grid sets and plans: the same error on every rank, and no rank left waiting (a rank that did not throw would
// go on to build grids or run, and the job would hang).
TEST(DynamicCp, BadInputFailsOnEveryRank) {
  const int W = world().size();
  if (W > 1) {
    test::expect_error([&] { CpGridSet g(world(), std::vector<int>{1, W + 1}); }, "must divide the world size");
    test::expect_error([&] { CpGridSet g(world(), std::vector<int>{1, 1}); }, "is given twice");
    // One rank passes other degrees.
    const std::vector<int> mine = world().rank() == W - 1 ? std::vector<int>{W} : std::vector<int>{1, W};
    test::expect_error([&] { CpGridSet g(world(), mine); }, "ranks disagree on the grids");
  }
  test::expect_error([&] { CpGridSet g(world(), std::vector<int>{}); }, "no degree");
  const CpGridSet grids(world(), divisors(W));
  std::vector<DynamicCpMicroBatch> plan = dealt_plan(divisors(W), W);
  // A degree without a grid (W x 2 does not divide W).
  std::vector<DynamicCpMicroBatch> bad = plan;
  bad[0].degree = 2 * W;
  test::expect_error([&] { DynamicCpSchedule s(world(), grids, kDocs, bad); }, "not one of the grids'");
  bad = plan;
  bad[0].group = W / bad[0].degree;
  test::expect_error([&] { DynamicCpSchedule s(world(), grids, kDocs, bad); }, "groups of that degree");
  bad = plan;
  bad.back().doc_ids.push_back(bad.front().doc_ids.front());
  test::expect_error([&] { DynamicCpSchedule s(world(), grids, kDocs, bad); }, "every document must be in exactly one");
  bad = plan;
  bad.back().doc_ids.pop_back();
  test::expect_error([&] { DynamicCpSchedule s(world(), grids, kDocs, bad); }, "is in no micro-batch");
  // A micro-batch of no tokens: no documents, or only documents of length 0 (its group failed at layout(), the other
  // ranks went on to the next micro-batch's messages).
  bad = plan;
  bad.insert(bad.begin(), DynamicCpMicroBatch{W, 0, {}});
  test::expect_error([&] { DynamicCpSchedule s(world(), grids, kDocs, bad); },
                     "micro-batch 0 (degree " + std::to_string(W) + ", group 0) holds no tokens (documents [])");
  std::vector<std::int64_t> with_empty = kDocs;
  with_empty.push_back(0);
  with_empty.push_back(0);
  bad = plan;
  bad.push_back(DynamicCpMicroBatch{
      1, W - 1, {static_cast<std::int64_t>(kDocs.size()), static_cast<std::int64_t>(kDocs.size()) + 1}});
  test::expect_error([&] { DynamicCpSchedule s(world(), grids, with_empty, bad); },
                     "micro-batch " + std::to_string(plan.size()) + " (degree 1, group " + std::to_string(W - 1) +
                         ") holds no tokens");
  // A document of length 0 beside others is fine.
  bad = plan;
  bad.back().doc_ids.push_back(static_cast<std::int64_t>(kDocs.size()));
  bad.back().doc_ids.push_back(static_cast<std::int64_t>(kDocs.size()) + 1);
  EXPECT_EQ(DynamicCpSchedule(world(), grids, with_empty, bad).cu_seqlens(static_cast<int>(bad.size()) - 1).back(),
            DynamicCpSchedule(world(), grids, kDocs, plan).cu_seqlens(static_cast<int>(plan.size()) - 1).back());
  if (W > 1) {
    // Ranks disagreeing on the plan: the last rank moves a document; and on the documents.
    bad = plan;
    if (world().rank() == W - 1) std::swap(bad.front().doc_ids.front(), bad.back().doc_ids.back());
    test::expect_error([&] { DynamicCpSchedule s(world(), grids, kDocs, bad); }, "disagree on micro-batch 0");
    std::vector<std::int64_t> docs = kDocs;
    if (world().rank() == 0) docs[3] += 1;
    test::expect_error([&] { DynamicCpSchedule s(world(), grids, docs, plan); }, "disagree on doc_lens");
  }
  // A micro-batch this rank does not run.
  const DynamicCpSchedule ok(world(), grids, kDocs, plan);
  for (int m = 0; m < static_cast<int>(plan.size()); ++m) {
    if (std::find(ok.local().begin(), ok.local().end(), m) == ok.local().end())
      test::expect_error([&] { ok.grid(m); }, "not in group");
  }
}

}  // namespace
}  // namespace seqpar
