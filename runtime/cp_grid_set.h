// Grids of several CP degrees over one world, for dynamic context parallelism (docs/design.md, "Dynamic CP"): for
// each degree d (d divides the world size W), the grid dp = W / d x ulysses_size x ring_size = d (placement
// ulysses_inner), so that the W / d groups of degree d are consecutive ranks (group g: world ranks g d .. g d + d - 1)
// and each rank belongs to exactly one group of each degree. All sub-communicators are created once, collectively,
// in ascending order of degree on every rank; a micro-batch of degree d then runs on grid(d) (CpGroups::from) while
// the other groups of that degree run other micro-batches.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "comm.h"
#include "cp_grid.h"

namespace seqpar {

class CpGridSet {
 public:
  // Ring grids (ulysses_size 1, ring_size d) of the given degrees.
  // Errors: see the general constructor.
  // Sync: collective over `world`.
  CpGridSet(Communicator& world, const std::vector<int>& degrees);

  // One grid per configuration; a configuration's dp_size is ignored (it is W / (ulysses_size x ring_size)), its
  // degree is ulysses_size x ring_size.
  // Errors, the same on every rank and before any message but one small all-reduce over `world` (the agreement
  // check): ranks that passed different lists; an empty list; a size below 1; a degree that does not divide the
  // world size; two configurations of one degree.
  // Sync: collective over `world` (one all-reduce, then CpGrid's construction for each degree, in ascending order).
  CpGridSet(Communicator& world, std::vector<CpGridConfig> configs);

  // The degrees, ascending; whether one was built; its grid (Error naming the degree and the built ones).
  // Sync: host-only.
  const std::vector<int>& degrees() const { return degrees_; }
  bool has(int degree) const;
  const CpGrid& grid(int degree) const;

  // This rank's group of degree d (its grid's dp_rank): it runs the micro-batches of (d, group_of(d)).
  // Errors: as grid(). Sync: host-only.
  int group_of(int degree) const { return grid(degree).coords().dp_rank; }

  int world_size() const { return world_size_; }
  int world_rank() const { return world_rank_; }

  // "degrees 1, 2, 4 over 4 ranks". Sync: host-only.
  std::string str() const;

 private:
  int world_size_ = 1, world_rank_ = 0;
  std::vector<int> degrees_;
  std::vector<std::unique_ptr<CpGrid>> grids_;  // same order as degrees_
};

}  // namespace seqpar
