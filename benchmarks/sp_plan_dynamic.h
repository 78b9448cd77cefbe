// sp_plan --dynamic-cp: dynamic context parallelism (docs/benchmarks.md, "sp_plan --dynamic-cp").
//
// A training step over a set of documents (lengths) on a world of W ranks. The documents are packed into
// micro-batches; each micro-batch gets a CP degree d (d divides W) and runs on one group of d consecutive ranks (the
// grids of runtime/cp_grid_set.h: the W / d groups of degree d are data-parallel over micro-batches). A micro-batch
// of degree d holds at most d x tokens_per_rank tokens (the activation budget of a rank). Its time is sp_plan's
// prediction (predict()) of the packed row on a ring of d ranks. The step's predicted time is the makespan of a list
// schedule: micro-batches in order of degree (largest first), then predicted time (longest first), each on the
// aligned group of its degree that is free first, starting when all its ranks are free. Gradient all-reduces are the
// same for every plan and left out.
//
// The plan: documents of one degree are packed longest first into the micro-batch with the least causal work that
// has room. Starting points: each document at the smallest degree it fits; all at max(that, D) for each degree D;
// split at 8 length quantiles, longer documents at one degree and shorter at a lower one. The best start is improved
// by local moves (raise a document to the next degree, longest first; lower one, shortest first) while the makespan
// drops: the "mixed" plan. Every static degree (all micro-batches at d, packed to d x tokens_per_rank) is planned
// the same way, and the dynamic plan is the best of the mixed plan and the statics, so its predicted gain over the
// best static degree is >= 0 by construction.
#pragma once

#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "benchmarks/sp_plan.h"

namespace seqpar::bench::plan {

// One micro-batch of a plan: its documents (indices into the step's documents, in packing order), its degree, the
// group of that degree that runs it (ranks group * degree .. group * degree + degree - 1) and its predicted times.
struct DynamicMicroBatch {
  std::vector<int> docs;
  std::int64_t tokens = 0;
  int degree = 1;
  int group = 0;
  double predicted_s = 0, start_s = 0;
};

// A plan: micro-batches in execution order (start time, then index); every rank runs the micro-batches of its
// groups in this order.
struct DynamicPlan {
  std::string name;      // "dynamic" or "static <d>"
  std::string excluded;  // empty: valid; else why (a document that does not fit at this degree)
  std::vector<DynamicMicroBatch> micro_batches;
  double step_s = 0;               // the makespan
  double busy_s = 0;               // sum over micro-batches of degree x time: rank-seconds of work
  std::vector<int> degree_of_doc;  // per document
};

struct DynamicInput {
  std::vector<std::int64_t> doc_lens;
  std::string doc_source;            // how the lengths were given ("--doc-lens", "--doc-dist NAME ...")
  std::int64_t tokens_per_rank = 0;  // 0: ceil(total tokens / W), the tokens a rank holds under static CP W
  std::vector<int> degrees;          // candidate degrees (divisors of W); empty: every divisor
  std::string layout = "zigzag";     // sp_bench --layout of every micro-batch of degree > 1
  std::string impl = "p2p";          // sp_bench --impl (MHA)
  bool impl_given = false;           // impl was chosen (sp_plan's --mb-impl): refused for a kind other than MHA
};

struct DynamicResult {
  std::int64_t tokens_per_rank = 0;
  std::vector<int> degrees;
  DynamicPlan dynamic;               // the chosen plan (the mixed plan, or a static one when no better)
  DynamicPlan mixed;                 // the mixed plan, also when a static one is chosen
  std::vector<DynamicPlan> statics;  // one per degree, ascending
  int best_static_degree = 0;        // 0 when no static degree is valid
  double best_static_s = 0;
  double gain = 0;  // best_static_s / dynamic.step_s - 1 (>= 0); 0 when no static degree is valid
};

// The predicted time of one micro-batch: the documents' lengths on a group of `degree` ranks (infinite: it cannot
// run there).
using MicroBatchTime = std::function<double(int degree, const std::vector<std::int64_t>& lens)>;
// Why a micro-batch cannot run at a degree (its time is infinite), in words, for the error messages and the
// excluded static plans.
using MicroBatchRefusal = std::function<std::string(int degree, const std::vector<std::int64_t>& lens)>;

// The planner's bounds: at most kMaxDynamicDocs documents (it predicts micro-batches of them many times over: about
// 5-10 ms per document on this machine, so the limit is minutes, not hours) and kMaxDynamicTokens tokens in all (a
// layout's limit, 2^48, which also keeps the sums of lengths from overflowing).
inline constexpr std::int64_t kMaxDynamicDocs = std::int64_t{1} << 16;
inline constexpr std::int64_t kMaxDynamicTokens = std::int64_t{1} << 48;

// Named document mixes: "longtail" and "short" (parallel/layout.h synthetic_doc_lens), and "loguniform:LO:HI"
// (lengths log-uniform in [LO, HI], K/M suffixes; the last document cut to what remains), `total` tokens.
// Errors: an unknown name, LO < 1, HI < LO, total < 1, total below the mix's shortest document (LO; longtail's 64),
// more than kMaxDynamicDocs documents (refused as soon as the mix passes the limit, without drawing the rest).
std::vector<std::int64_t> doc_mix(const std::string& name, std::int64_t total, std::uint64_t seed);

// The list schedule of micro-batches whose degree and predicted_s are set, on `world` ranks: fills group and
// start_s, sorts them into execution order; returns the makespan. Errors: a degree that does not divide world.
double schedule_micro_batches(int world, std::vector<DynamicMicroBatch>& mbs);

// The plan with a given time function (tests use closed forms). Errors: no document lengths, a length < 1, a
// degree that does not divide the world, a document longer than max(degrees) x tokens_per_rank, a document that
// runs at no degree (the message gives each degree's reason: its length over d x tokens_per_rank, or `why`'s words;
// without `why`, "its predicted time is not finite").
DynamicResult plan_dynamic(int world, const DynamicInput& din, const MicroBatchTime& time,
                           const MicroBatchRefusal& why = {});

// The plan with sp_plan's prediction: each micro-batch is the problem of `in` (its sp_bench flags, mode, threads,
// devices per node) as a packed row (--doc-lens) on --ring-size d with din.layout and din.impl; a micro-batch that
// sp_bench refuses, or that does not fit in in.memory_per_device (sp_bench's estimate), is not planned at that
// degree (sp_bench's error or the memory verdict is the reason given). Errors: those above; din.impl_given with a
// problem other than --attn mha (the ring impl is MHA's).
DynamicResult plan_dynamic(const PlanInput& in, const DeviceProfile& profile, const DynamicInput& din);

// The sp_bench problem flags of one micro-batch (in.problem_flags, --doc-lens, the grid flags).
std::vector<std::string> micro_batch_flags(const PlanInput& in, const DynamicInput& din, int degree,
                                           const std::vector<std::int64_t>& lens);

nlohmann::json dynamic_json(const PlanInput& in, const DeviceProfile& profile, const DynamicInput& din,
                            const DynamicResult& r);
std::string dynamic_table(const PlanInput& in, const DeviceProfile& profile, const DynamicInput& din,
                          const DynamicResult& r);

}  // namespace seqpar::bench::plan
