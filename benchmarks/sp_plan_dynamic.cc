// sp_plan --dynamic-cp: the plan of micro-batches and CP degrees (benchmarks/sp_plan_dynamic.h).
#include "benchmarks/sp_plan_dynamic.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <map>
#include <numeric>
#include <optional>
#include <utility>

#include "benchmarks/bench_common.h"
#include "benchmarks/sp_bench_memory.h"
#include "parallel/layout.h"
#include "runtime/error.h"

namespace seqpar::bench::plan {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// Documents (indices, any order) of one degree into micro-batches of at most `capacity` tokens, balanced over the
// `groups` groups of that degree: longest first, each into the open micro-batch with the least causal work
// (sum of L (L + 1) / 2) that has room; at least `groups` micro-batches when there are that many documents.
std::vector<DynamicMicroBatch> pack(std::vector<int> docs, const std::vector<std::int64_t>& lens, int degree,
                                    std::int64_t capacity, int groups) {
  std::stable_sort(docs.begin(), docs.end(), [&](int a, int b) { return lens[a] > lens[b]; });
  std::int64_t tokens = 0;
  for (int d : docs) tokens += lens[d];
  const auto bins = static_cast<std::size_t>(std::min<std::int64_t>(
      static_cast<std::int64_t>(docs.size()), std::max<std::int64_t>(groups, (tokens + capacity - 1) / capacity)));
  std::vector<DynamicMicroBatch> mbs(bins);
  std::vector<double> work(bins, 0.0);
  for (DynamicMicroBatch& mb : mbs) mb.degree = degree;
  for (int d : docs) {
    std::size_t into = mbs.size();
    for (std::size_t b = 0; b < mbs.size(); ++b) {
      if (mbs[b].tokens + lens[d] <= capacity && (into == mbs.size() || work[b] < work[into])) into = b;
    }
    if (into == mbs.size()) {
      mbs.emplace_back();
      mbs.back().degree = degree;
      work.push_back(0.0);
    }
    mbs[into].docs.push_back(d);
    mbs[into].tokens += lens[d];
    work[into] += 0.5 * static_cast<double>(lens[d]) * static_cast<double>(lens[d] + 1);
  }
  std::erase_if(mbs, [](const DynamicMicroBatch& mb) { return mb.docs.empty(); });
  return mbs;
}

std::vector<std::int64_t> lens_of(const DynamicMicroBatch& mb, const std::vector<std::int64_t>& lens) {
  std::vector<std::int64_t> out;
  for (int d : mb.docs) out.push_back(lens[d]);
  return out;
}

// Predicted times (cached by degree and lengths), schedule, totals.
class Planner {
 public:
  Planner(int world, const std::vector<std::int64_t>& lens, const MicroBatchTime& time, const MicroBatchRefusal& why)
      : world_(world), lens_(lens), time_(time), why_(why) {}

  double time_of(int degree, const DynamicMicroBatch& mb) {
    std::vector<std::int64_t> key = lens_of(mb, lens_);
    key.push_back(degree);
    const auto it = cache_.find(key);
    if (it != cache_.end()) return it->second;
    key.pop_back();
    const double t = time_(degree, key);
    key.push_back(degree);
    cache_[key] = t;
    return t;
  }

  // Why micro-batch `mb` cannot run at `degree` (its time is infinite).
  std::string why_not(int degree, const DynamicMicroBatch& mb) const {
    return why_ ? why_(degree, lens_of(mb, lens_)) : "its predicted time is not finite";
  }

  // Predicts and schedules `mbs` into a plan; excluded when a micro-batch cannot run at its degree (with the reason
  // when `explain`: the search's trial plans go without, as the reason costs a prediction).
  DynamicPlan finish(std::string name, std::vector<DynamicMicroBatch> mbs, bool explain = false) {
    DynamicPlan p;
    p.name = std::move(name);
    for (DynamicMicroBatch& mb : mbs) {
      mb.predicted_s = time_of(mb.degree, mb);
      if (!std::isfinite(mb.predicted_s)) {
        p.excluded =
            str_cat("a micro-batch of ", mb.tokens, " tokens (", mb.docs.size(), " document(s)) cannot run at degree ",
                    mb.degree, explain ? str_cat(": ", why_not(mb.degree, mb)) : std::string());
        return p;
      }
    }
    p.step_s = schedule_micro_batches(world_, mbs);
    p.micro_batches = std::move(mbs);
    p.degree_of_doc.assign(lens_.size(), 0);
    for (const DynamicMicroBatch& mb : p.micro_batches) {
      p.busy_s += mb.degree * mb.predicted_s;
      for (int d : mb.docs) p.degree_of_doc[d] = mb.degree;
    }
    return p;
  }

 private:
  int world_;
  const std::vector<std::int64_t>& lens_;
  const MicroBatchTime& time_;
  const MicroBatchRefusal& why_;
  std::map<std::vector<std::int64_t>, double> cache_;
};

}  // namespace

std::vector<std::int64_t> doc_mix(const std::string& name, std::int64_t total, std::uint64_t seed) {
  SEQPAR_CHECK(total >= 1 && total <= kMaxDynamicTokens, "sp_plan: --tokens ", total, " must be in [1, 2^48]");
  const auto too_many = [&](std::size_t docs) {
    return str_cat("sp_plan: --doc-dist ", name, " --tokens ", total, " makes more than ", kMaxDynamicDocs,
                   " documents (", docs, " so far), the dynamic planner's limit: fewer --tokens or longer documents");
  };
  if (name.rfind("loguniform:", 0) != 0) {
    // longtail's documents are of 64 tokens or more (parallel/layout.h): fewer tokens would draw one shorter one.
    SEQPAR_CHECK(name != "longtail" || total >= 64, "sp_plan: --doc-dist longtail draws documents of 64 to 16384 ",
                 "tokens: --tokens ", total, " must be >= 64");
    // The named mixes draw documents of 1 token or more: bound the tokens before drawing, then count.
    SEQPAR_CHECK(total <= kMaxDynamicDocs * 16384, too_many(0));
    std::vector<std::int64_t> lens = synthetic_doc_lens(name, total, seed);
    SEQPAR_CHECK(static_cast<std::int64_t>(lens.size()) <= kMaxDynamicDocs, too_many(lens.size()));
    return lens;
  }
  const std::string rest = name.substr(11);
  const std::size_t colon = rest.find(':');
  SEQPAR_CHECK(colon != std::string::npos, "sp_plan: --doc-dist ", name, ": expected loguniform:LO:HI");
  const std::int64_t lo = bench::parse_size(rest.substr(0, colon), "doc-dist LO");
  const std::int64_t hi = bench::parse_size(rest.substr(colon + 1), "doc-dist HI");
  SEQPAR_CHECK(lo >= 1 && hi >= lo, "sp_plan: --doc-dist ", name, ": LO ", lo, " must be >= 1 and HI ", hi, " >= LO");
  // Lengths at least LO, but for the last one (cut to what remains): LO above the total would draw one document of
  // the total, shorter than LO.
  SEQPAR_CHECK(lo <= total, "sp_plan: --doc-dist ", name, ": LO ", lo, " must be <= --tokens ", total,
               " (every document but the last is at least LO tokens)");
  std::uint64_t state = seed;
  auto next = [&state] {  // splitmix64 (Steele, Lea, Flood 2014), as synthetic_doc_lens
    std::uint64_t z = (state += 0x9E3779B97F4A7C15ULL);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
  };
  std::vector<std::int64_t> lens;
  const double ratio = static_cast<double>(hi) / static_cast<double>(lo);
  for (std::int64_t sum = 0; sum < total;) {
    const double u = static_cast<double>(next() >> 11) * 0x1.0p-53;
    const auto len =
        std::min(total - sum, std::min(hi, static_cast<std::int64_t>(static_cast<double>(lo) * std::pow(ratio, u))));
    lens.push_back(len);
    sum += len;
    SEQPAR_CHECK(static_cast<std::int64_t>(lens.size()) <= kMaxDynamicDocs, too_many(lens.size()));
  }
  return lens;
}

double schedule_micro_batches(int world, std::vector<DynamicMicroBatch>& mbs) {
  std::vector<int> order(mbs.size());
  std::iota(order.begin(), order.end(), 0);
  for (const DynamicMicroBatch& mb : mbs) {
    SEQPAR_CHECK(mb.degree >= 1 && world % mb.degree == 0, "sp_plan: degree ", mb.degree,
                 " must divide the world size ", world);
  }
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
    if (mbs[a].degree != mbs[b].degree) return mbs[a].degree > mbs[b].degree;
    return mbs[a].predicted_s > mbs[b].predicted_s;
  });
  std::vector<double> free_at(world, 0.0);
  double makespan = 0;
  for (int i : order) {
    DynamicMicroBatch& mb = mbs[i];
    const int d = mb.degree;
    int best = 0;
    double best_ready = kInf;
    for (int g = 0; g < world / d; ++g) {
      const double ready = *std::max_element(free_at.begin() + g * d, free_at.begin() + (g + 1) * d);
      if (ready < best_ready) best_ready = ready, best = g;
    }
    mb.group = best;
    mb.start_s = best_ready;
    std::fill(free_at.begin() + best * d, free_at.begin() + (best + 1) * d, best_ready + mb.predicted_s);
    makespan = std::max(makespan, best_ready + mb.predicted_s);
  }
  // Execution order: start time, then the schedule's order (a micro-batch of zero time never overtakes another).
  std::vector<int> rank_in_order(mbs.size());
  for (std::size_t k = 0; k < order.size(); ++k) rank_in_order[order[k]] = static_cast<int>(k);
  std::vector<int> exec(mbs.size());
  std::iota(exec.begin(), exec.end(), 0);
  std::stable_sort(exec.begin(), exec.end(), [&](int a, int b) {
    if (mbs[a].start_s != mbs[b].start_s) return mbs[a].start_s < mbs[b].start_s;
    return rank_in_order[a] < rank_in_order[b];
  });
  std::vector<DynamicMicroBatch> sorted;
  for (int i : exec) sorted.push_back(std::move(mbs[i]));
  mbs = std::move(sorted);
  return makespan;
}

DynamicResult plan_dynamic(int world, const DynamicInput& din, const MicroBatchTime& time,
                           const MicroBatchRefusal& why) {
  const std::vector<std::int64_t>& lens = din.doc_lens;
  SEQPAR_CHECK(world >= 1, "sp_plan: --world ", world, " must be >= 1");
  SEQPAR_CHECK(!lens.empty(), "sp_plan --dynamic-cp: no documents (--doc-lens or --doc-dist)");
  SEQPAR_CHECK(static_cast<std::int64_t>(lens.size()) <= kMaxDynamicDocs, "sp_plan --dynamic-cp: ", lens.size(),
               " documents; the planner takes at most ", kMaxDynamicDocs);
  std::int64_t total = 0;
  for (std::size_t i = 0; i < lens.size(); ++i) {
    SEQPAR_CHECK(lens[i] >= 1, "sp_plan --dynamic-cp: document ", i, " has length ", lens[i], "; lengths must be >= 1");
    // Both <= 2^48 before the sum: it cannot overflow.
    SEQPAR_CHECK(lens[i] <= kMaxDynamicTokens - total, "sp_plan --dynamic-cp: the documents up to document ", i,
                 " (length ", lens[i], ") hold more than 2^48 tokens, a layout's limit");
    total += lens[i];
  }
  DynamicResult r;
  r.degrees = din.degrees;
  if (r.degrees.empty()) {
    for (int d = 1; d <= world; ++d)
      if (world % d == 0) r.degrees.push_back(d);
  }
  std::sort(r.degrees.begin(), r.degrees.end());
  r.degrees.erase(std::unique(r.degrees.begin(), r.degrees.end()), r.degrees.end());
  for (int d : r.degrees) {
    SEQPAR_CHECK(d >= 1 && world % d == 0, "sp_plan --dynamic-cp: degree ", d, " must divide the world size ", world);
  }
  r.tokens_per_rank = din.tokens_per_rank > 0 ? din.tokens_per_rank : (total + world - 1) / world;
  const std::int64_t C = r.tokens_per_rank;
  const std::int64_t longest = *std::max_element(lens.begin(), lens.end());
  SEQPAR_CHECK(longest <= r.degrees.back() * C, "sp_plan --dynamic-cp: a document of ", longest,
               " tokens does not fit in the largest degree ", r.degrees.back(), " x tokens_per_rank ", C, " = ",
               r.degrees.back() * C, " tokens");
  Planner planner(world, lens, time, why);

  // Every static degree.
  std::vector<int> all(lens.size());
  std::iota(all.begin(), all.end(), 0);
  for (int d : r.degrees) {
    if (longest > d * C) {
      DynamicPlan p;
      p.name = str_cat("static ", d);
      p.excluded = str_cat("a document of ", longest, " tokens exceeds ", d, " x tokens_per_rank ", C);
      r.statics.push_back(std::move(p));
      continue;
    }
    r.statics.push_back(planner.finish(str_cat("static ", d), pack(all, lens, d, d * C, world / d), true));
  }
  for (const DynamicPlan& p : r.statics) {
    if (p.excluded.empty() && (r.best_static_degree == 0 || p.step_s < r.best_static_s)) {
      r.best_static_s = p.step_s;
      r.best_static_degree = p.micro_batches.front().degree;
    }
  }

  // Each document at the smallest degree it fits (alone in a micro-batch), packed per degree.
  std::vector<int> degree_of(lens.size(), 0);
  for (int i = 0; i < static_cast<int>(lens.size()); ++i) {
    DynamicMicroBatch alone;
    alone.docs = {i};
    alone.tokens = lens[i];
    for (int d : r.degrees) {
      if (lens[i] <= d * C && std::isfinite(planner.time_of(d, alone))) {
        degree_of[i] = d;
        break;
      }
    }
    if (degree_of[i] > 0) continue;
    std::string reasons;  // each degree's, in order
    for (int d : r.degrees) {
      reasons +=
          str_cat("; degree ", d, ": ",
                  lens[i] > d * C ? str_cat(lens[i], " tokens exceed ", d, " x tokens_per_rank ", C, " = ", d * C)
                                  : planner.why_not(d, alone));
    }
    SEQPAR_THROW("sp_plan --dynamic-cp: document ", i, " (", lens[i], " tokens) cannot run at any degree", reasons);
  }
  const auto plan_of = [&](const std::vector<int>& deg) {
    std::map<int, std::vector<int>> docs_at;
    for (int i = 0; i < static_cast<int>(lens.size()); ++i) docs_at[deg[i]].push_back(i);
    std::vector<DynamicMicroBatch> mbs;
    for (const auto& [d, docs] : docs_at) {
      for (DynamicMicroBatch& mb : pack(docs, lens, d, d * C, world / d)) mbs.push_back(std::move(mb));
    }
    return planner.finish("dynamic", std::move(mbs));
  };
  // Starting points: every document at its smallest degree; every document at max(smallest, D) for each degree D;
  // and split by length, documents from a length quantile up at max(smallest, hi), the rest at max(smallest, lo),
  // for each pair of degrees lo < hi and 8 quantiles.
  const std::vector<int> d_min = degree_of;
  const auto at_least = [&](int i, int d) { return std::max(d_min[i], d); };
  std::vector<std::vector<int>> starts = {d_min};
  for (int D : r.degrees) {
    std::vector<int> deg(lens.size());
    for (std::size_t i = 0; i < lens.size(); ++i) deg[i] = at_least(static_cast<int>(i), D);
    starts.push_back(std::move(deg));
  }
  std::vector<std::int64_t> sorted_lens = lens;
  std::sort(sorted_lens.begin(), sorted_lens.end());
  std::vector<std::int64_t> cuts;
  const std::size_t n = sorted_lens.size();
  for (std::size_t q = 1; q <= 8; ++q) cuts.push_back(sorted_lens[std::min(n - 1, n * q / 9)]);
  std::sort(cuts.begin(), cuts.end());
  cuts.erase(std::unique(cuts.begin(), cuts.end()), cuts.end());
  for (std::int64_t cut : cuts) {
    for (std::size_t lo = 0; lo < r.degrees.size(); ++lo) {
      for (std::size_t hi = lo + 1; hi < r.degrees.size(); ++hi) {
        std::vector<int> deg(lens.size());
        for (std::size_t i = 0; i < lens.size(); ++i)
          deg[i] = at_least(static_cast<int>(i), lens[i] >= cut ? r.degrees[hi] : r.degrees[lo]);
        starts.push_back(std::move(deg));
      }
    }
  }
  // Local moves while the makespan drops (a few passes): raise documents, longest first, to the next degree; lower
  // documents, shortest first, to the previous degree they fit. From the smallest-degree start and the two best
  // other starts; the best result is the mixed plan.
  std::vector<int> by_len(lens.size());
  std::iota(by_len.begin(), by_len.end(), 0);
  std::stable_sort(by_len.begin(), by_len.end(), [&](int a, int b) { return lens[a] > lens[b]; });
  const auto improve = [&](std::vector<int> deg, DynamicPlan cur) {
    const auto try_move = [&](int i, int to) {
      std::vector<int> trial = deg;
      trial[i] = to;
      DynamicPlan t = plan_of(trial);
      if (!t.excluded.empty() || t.step_s >= cur.step_s * (1 - 1e-9)) return false;
      cur = std::move(t);
      deg = std::move(trial);
      return true;
    };
    for (int pass = 0; pass < 3; ++pass) {
      bool improved = false;
      for (int i : by_len) {
        for (;;) {
          const auto next = std::upper_bound(r.degrees.begin(), r.degrees.end(), deg[i]);
          if (next == r.degrees.end() || !try_move(i, *next)) break;
          improved = true;
        }
      }
      for (auto it = by_len.rbegin(); it != by_len.rend(); ++it) {
        const int i = *it;
        for (;;) {
          const auto here = std::lower_bound(r.degrees.begin(), r.degrees.end(), deg[i]);
          if (here == r.degrees.begin() || *(here - 1) < d_min[i] || !try_move(i, *(here - 1))) break;
          improved = true;
        }
      }
      if (!improved) break;
    }
    return cur;
  };
  std::vector<std::pair<double, std::size_t>> ranked;  // (step, start index) of the valid starts but the first
  std::vector<DynamicPlan> start_plans;
  for (std::size_t k = 0; k < starts.size(); ++k) {
    start_plans.push_back(plan_of(starts[k]));
    if (k > 0 && start_plans.back().excluded.empty()) ranked.emplace_back(start_plans.back().step_s, k);
  }
  std::stable_sort(ranked.begin(), ranked.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  std::vector<std::size_t> from = {0};
  for (std::size_t k = 0; k < ranked.size() && k < 2; ++k) from.push_back(ranked[k].second);
  DynamicPlan cur;
  for (std::size_t k : from) {
    if (!start_plans[k].excluded.empty()) continue;
    DynamicPlan t = improve(starts[k], start_plans[k]);
    if (cur.micro_batches.empty() || t.step_s < cur.step_s * (1 - 1e-9)) cur = std::move(t);
  }
  SEQPAR_CHECK(!cur.micro_batches.empty(), "sp_plan --dynamic-cp: no plan can run every document");
  r.mixed = cur;
  r.mixed.name = "mixed";
  r.dynamic = std::move(cur);
  for (const DynamicPlan& p : r.statics) {
    if (p.excluded.empty() && p.step_s < r.dynamic.step_s) {
      r.dynamic = p;
      r.dynamic.name = str_cat("dynamic (= ", p.name, ")");
    }
  }
  r.gain = r.best_static_degree > 0 ? r.best_static_s / r.dynamic.step_s - 1 : 0.0;
  return r;
}

// ---- with sp_plan's prediction ------------------------------------------------------------------------------------

namespace {

std::string attn_kind(const PlanInput& in) {
  std::vector<std::string> args = {"sp_bench"};
  args.insert(args.end(), in.problem_flags.begin(), in.problem_flags.end());
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  const std::optional<SpBenchOptions> o =
      parse_sp_bench_options(static_cast<int>(argv.size()), argv.data(), 1, 1, kPlanProblemHasNoGrid);
  SEQPAR_CHECK(o.has_value(), "sp_plan: --help is not a problem flag");
  return o->attn;
}

std::string join_lens(const std::vector<std::int64_t>& lens) {
  std::string s;
  for (std::size_t i = 0; i < lens.size(); ++i) {
    if (i > 0) s += ',';
    s += std::to_string(lens[i]);
  }
  return s;
}

PlanConfig micro_batch_config(const DynamicInput& din, const std::string& attn, int degree) {
  PlanConfig c;
  c.ulysses_size = 1;
  c.ring_size = degree;
  c.layout = din.layout;
  c.impl = attn == "mha" ? din.impl : "";
  return c;
}

}  // namespace

std::vector<std::string> micro_batch_flags(const PlanInput& in, const DynamicInput& din, int degree,
                                           const std::vector<std::int64_t>& lens) {
  std::vector<std::string> f = in.problem_flags;
  f.insert(f.end(), {"--doc-lens", join_lens(lens)});
  const std::vector<std::string> g = micro_batch_config(din, attn_kind(in), degree).flags();
  f.insert(f.end(), g.begin(), g.end());
  return f;
}

DynamicResult plan_dynamic(const PlanInput& in, const DeviceProfile& profile, const DynamicInput& din) {
  const std::string attn = attn_kind(in);
  SEQPAR_CHECK(!din.impl_given || attn == "mha", "sp_plan --dynamic-cp: --mb-impl ", din.impl,
               " is the ring impl of --attn mha; the problem is --attn ", attn, " (drop --mb-impl)");
  for (const std::string& f : in.problem_flags) {
    SEQPAR_CHECK(f != "--seq" && f != "--doc-lens" && f != "--doc-dist" && f != "--batch", "sp_plan --dynamic-cp: ", f,
                 " is not a problem flag here: the micro-batches are packed rows of the "
                 "documents of sp_plan's --doc-lens / --doc-dist, given before \"--\"");
  }
  // The predicted time, or infinity with the reason in *why (may be null): sp_bench's error or the memory verdict.
  const auto evaluate = [&](int degree, const std::vector<std::int64_t>& lens, std::string* why) {
    PlanInput sub = in;
    sub.problem_flags.insert(sub.problem_flags.end(), {"--doc-lens", join_lens(lens)});
    sub.world_size = degree;
    // Links and oversubscription: the group's ranks are consecutive on nodes of in.devices_per_node ranks, all of
    // them busy (the other groups run at the same time).
    sub.nodes = std::max(1, degree / in.devices_per_node);
    try {
      const SpBenchOptions o = config_options(sub, micro_batch_config(din, attn, degree));
      if (in.memory_per_device > 0) {
        PlanInput mem = sub;
        mem.nodes = 1;
        mem.devices_per_node = degree;
        std::string verdict = memory_verdict(o, mem, nullptr);
        if (!verdict.empty()) {
          if (why != nullptr) *why = std::move(verdict);
          return kInf;
        }
      }
      return predict(o, sub, profile).step_s;
    } catch (const Error& e) {
      if (why != nullptr) *why = e.message();
      return kInf;
    }
  };
  const MicroBatchTime time = [&](int degree, const std::vector<std::int64_t>& lens) {
    return evaluate(degree, lens, nullptr);
  };
  const MicroBatchRefusal why = [&](int degree, const std::vector<std::int64_t>& lens) {
    std::string reason = "its predicted time is not finite";
    evaluate(degree, lens, &reason);
    return reason;
  };
  return plan_dynamic(in.world_size, din, time, why);
}

// ---- output -------------------------------------------------------------------------------------------------------

namespace {

nlohmann::json plan_json_of(const DynamicPlan& p, const std::vector<std::int64_t>& lens) {
  nlohmann::json j = {{"name", p.name}};
  if (!p.excluded.empty()) {
    j["excluded"] = p.excluded;
    return j;
  }
  j["step_s"] = p.step_s;
  j["busy_rank_s"] = p.busy_s;
  j["degree_of_doc"] = p.degree_of_doc;
  j["micro_batches"] = nlohmann::json::array();
  for (const DynamicMicroBatch& mb : p.micro_batches) {
    j["micro_batches"].push_back({{"docs", mb.docs},
                                  {"doc_lens", lens_of(mb, lens)},
                                  {"tokens", mb.tokens},
                                  {"degree", mb.degree},
                                  {"group", mb.group},
                                  {"ranks", {mb.group * mb.degree, mb.group * mb.degree + mb.degree - 1}},
                                  {"predicted_s", mb.predicted_s},
                                  {"start_s", mb.start_s}});
  }
  return j;
}

}  // namespace

nlohmann::json dynamic_json(const PlanInput& in, const DeviceProfile& profile, const DynamicInput& din,
                            const DynamicResult& r) {
  nlohmann::json j;
  j["input"] = {{"problem_flags", in.problem_flags},
                {"mode", in.mode},
                {"world_size", in.world_size},
                {"devices_per_node", in.devices_per_node},
                {"memory_per_device_bytes", in.memory_per_device},
                {"threads", in.threads},
                {"doc_source", din.doc_source},
                {"doc_lens", din.doc_lens},
                {"num_docs", din.doc_lens.size()},
                {"tokens", std::accumulate(din.doc_lens.begin(), din.doc_lens.end(), std::int64_t{0})},
                {"tokens_per_rank", r.tokens_per_rank},
                {"degrees", r.degrees},
                {"layout", din.layout},
                {"impl", din.impl}};
  j["profile"] = profile.name;
  j["dynamic"] = plan_json_of(r.dynamic, din.doc_lens);
  j["mixed"] = plan_json_of(r.mixed, din.doc_lens);
  j["statics"] = nlohmann::json::array();
  for (const DynamicPlan& p : r.statics) j["statics"].push_back(plan_json_of(p, din.doc_lens));
  j["best_static_degree"] = r.best_static_degree;
  j["best_static_step_s"] = r.best_static_s;
  j["predicted_gain"] = r.gain;
  return j;
}

std::string dynamic_table(const PlanInput& in, const DeviceProfile& profile, const DynamicInput& din,
                          const DynamicResult& r) {
  const std::int64_t total = std::accumulate(din.doc_lens.begin(), din.doc_lens.end(), std::int64_t{0});
  std::string s = str_cat("# sp_plan --dynamic-cp: ", in.mode, ", world ", in.world_size, ", ", din.doc_lens.size(),
                          " documents (", din.doc_source, "), ", total, " tokens, longest ",
                          *std::max_element(din.doc_lens.begin(), din.doc_lens.end()), ", tokens_per_rank ",
                          r.tokens_per_rank, ", profile ", profile.name, "\n# problem:");
  for (const std::string& f : in.problem_flags) s += " " + f;
  s += str_cat("; micro-batches: --layout ", din.layout, " --impl ", din.impl, " on rings of each degree\n");
  s += "#  plan                          step(ms)   busy(rank-ms)   util   micro-batches by degree\n";
  auto line = [&](const DynamicPlan& p) {
    if (!p.excluded.empty()) {
      s += str_cat("#  excluded ", p.name, ": ", p.excluded, "\n");
      return;
    }
    std::map<int, int> n;
    for (const DynamicMicroBatch& mb : p.micro_batches) ++n[mb.degree];
    std::string by;
    for (const auto& [d, c] : n) by += str_cat(by.empty() ? "" : " ", "d", d, ":", c);
    char buf[256];
    std::snprintf(buf, sizeof buf, "   %-28s %10.3f %15.3f %6.2f   %s\n", p.name.c_str(), p.step_s * 1e3,
                  p.busy_s * 1e3, p.busy_s / (in.world_size * p.step_s), by.c_str());
    s += buf;
  };
  line(r.dynamic);
  if (r.dynamic.name != "dynamic") line(r.mixed);
  for (const DynamicPlan& p : r.statics) line(p);
  std::map<int, std::pair<int, std::int64_t>> docs;
  for (std::size_t i = 0; i < din.doc_lens.size(); ++i) {
    auto& e = docs[r.dynamic.degree_of_doc[i]];
    ++e.first;
    e.second += din.doc_lens[i];
  }
  s += "# dynamic plan, documents by degree:";
  for (const auto& [d, e] : docs) s += str_cat(" d", d, ": ", e.first, " docs / ", e.second, " tokens;");
  s += "\n";
  if (r.best_static_degree > 0) {
    char buf[160];
    std::snprintf(buf, sizeof buf, "# predicted gain over the best static degree (%d): %.1f%% (%.3f ms -> %.3f ms)\n",
                  r.best_static_degree, 100 * r.gain, r.best_static_s * 1e3, r.dynamic.step_s * 1e3);
    s += buf;
  } else {
    s += "# no static degree can run every document\n";
  }
  return s;
}

}  // namespace seqpar::bench::plan
