#include "parallel/dynamic_cp.h"

#include <utility>

#include "runtime/error.h"

namespace seqpar {
namespace {

std::string join(std::span<const std::int64_t> v) {
  std::string s;
  for (std::size_t i = 0; i < v.size(); ++i) {
    if (i > 0) s += ',';
    s += std::to_string(v[i]);
  }
  return s;
}

}  // namespace

DynamicCpSchedule::DynamicCpSchedule(Communicator& world, const CpGridSet& grids, std::vector<std::int64_t> doc_lens,
                                     std::vector<DynamicCpMicroBatch> plan)
    : grids_(grids), doc_lens_(std::move(doc_lens)), plan_(std::move(plan)) {
  // Agreement first: every later check then sees the same plan on every rank and raises the same error.
  Fingerprint fp("DynamicCpSchedule");
  fp.add_int("world_size", world.size()).add_text("grid degrees", grids.str());
  fp.add_int("num_docs", static_cast<std::int64_t>(doc_lens_.size())).add_text("doc_lens", join(doc_lens_));
  fp.add_int("num_micro_batches", static_cast<std::int64_t>(plan_.size()));
  for (std::size_t m = 0; m < plan_.size(); ++m) {
    fp.add_text(str_cat("micro-batch ", m),
                str_cat("degree ", plan_[m].degree, " group ", plan_[m].group, " docs ", join(plan_[m].doc_ids)));
  }
  AgreementCheck(AgreementMode::kAlways).run(world, fp);

  SEQPAR_CHECK(world.size() == grids.world_size(), "DynamicCpSchedule: the world has ", world.size(),
               " ranks but the grids were built over ", grids.world_size());
  doc_start_.assign(1, 0);
  for (std::size_t d = 0; d < doc_lens_.size(); ++d) {
    SEQPAR_CHECK(doc_lens_[d] >= 0, "DynamicCpSchedule: document ", d, " has length ", doc_lens_[d],
                 "; lengths must be >= 0");
    doc_start_.push_back(doc_start_.back() + doc_lens_[d]);
  }
  std::vector<int> seen(doc_lens_.size(), -1);
  for (std::size_t m = 0; m < plan_.size(); ++m) {
    const DynamicCpMicroBatch& mb = plan_[m];
    SEQPAR_CHECK(grids.has(mb.degree), "DynamicCpSchedule: micro-batch ", m, " has degree ", mb.degree,
                 ", which is not one of the grids' (", grids.str(), "); a degree must divide the world size ",
                 world.size(), " and have its grid built");
    const int groups = world.size() / mb.degree;
    SEQPAR_CHECK(0 <= mb.group && mb.group < groups, "DynamicCpSchedule: micro-batch ", m, " has group ", mb.group,
                 " of degree ", mb.degree, "; there are ", groups, " groups of that degree (0 .. ", groups - 1, ")");
    for (std::int64_t d : mb.doc_ids) {
      SEQPAR_CHECK(0 <= d && d < static_cast<std::int64_t>(doc_lens_.size()), "DynamicCpSchedule: micro-batch ", m,
                   " names document ", d, " of ", doc_lens_.size());
      SEQPAR_CHECK(seen[d] < 0, "DynamicCpSchedule: document ", d, " is in micro-batch ", seen[d], " and in ", m,
                   "; every document must be in exactly one");
      seen[d] = static_cast<int>(m);
    }
  }
  for (std::size_t d = 0; d < seen.size(); ++d) {
    SEQPAR_CHECK(seen[d] >= 0, "DynamicCpSchedule: document ", d, " (", doc_lens_[d],
                 " tokens) is in no micro-batch; every document must be in exactly one");
  }
  // A packed row of no tokens has no layout: its group would fail at layout(), the other ranks going on.
  for (std::size_t m = 0; m < plan_.size(); ++m) {
    std::int64_t tokens = 0;
    for (std::int64_t d : plan_[m].doc_ids) tokens += doc_lens_[d];
    SEQPAR_CHECK(tokens > 0, "DynamicCpSchedule: micro-batch ", m, " (degree ", plan_[m].degree, ", group ",
                 plan_[m].group, ") holds no tokens (documents [", join(plan_[m].doc_ids),
                 "]); every micro-batch must hold at least one token (leave it out of the plan)");
  }
  for (std::size_t m = 0; m < plan_.size(); ++m) {
    if (grids.group_of(plan_[m].degree) == plan_[m].group) local_.push_back(static_cast<int>(m));
  }
}

const CpGrid& DynamicCpSchedule::grid(int m) const {
  SEQPAR_CHECK(0 <= m && m < static_cast<int>(plan_.size()), "DynamicCpSchedule: micro-batch ", m, " of ",
               plan_.size());
  const DynamicCpMicroBatch& mb = plan_[m];
  SEQPAR_CHECK(grids_.group_of(mb.degree) == mb.group, "DynamicCpSchedule: world rank ", grids_.world_rank(),
               " is in group ", grids_.group_of(mb.degree), " of degree ", mb.degree, ", not in group ", mb.group,
               " that runs micro-batch ", m);
  return grids_.grid(mb.degree);
}

std::vector<std::int64_t> DynamicCpSchedule::cu_seqlens(int m) const {
  SEQPAR_CHECK(0 <= m && m < static_cast<int>(plan_.size()), "DynamicCpSchedule: micro-batch ", m, " of ",
               plan_.size());
  std::vector<std::int64_t> cu = {0};
  for (std::int64_t d : plan_[m].doc_ids) cu.push_back(cu.back() + doc_lens_[d]);
  return cu;
}

std::vector<std::int64_t> DynamicCpSchedule::step_tokens(int m) const {
  SEQPAR_CHECK(0 <= m && m < static_cast<int>(plan_.size()), "DynamicCpSchedule: micro-batch ", m, " of ",
               plan_.size());
  std::vector<std::int64_t> t;
  for (std::int64_t d : plan_[m].doc_ids)
    for (std::int64_t i = doc_start_[d]; i < doc_start_[d + 1]; ++i) t.push_back(i);
  return t;
}

SequenceLayout DynamicCpSchedule::layout(int m, LayoutKind kind) const {
  const CpGroups groups = CpGroups::from(grid(m));
  const std::vector<std::int64_t> cu = cu_seqlens(m);
  return SequenceLayout::packed_for_groups(groups, cu, kind);
}

}  // namespace seqpar
