// The sequence-parallel process grid (docs/design.md section 4): world = DP x Pu x Pr.
//
// Rank numbering: dp_rank = world_rank / (Pu * Pr) (data-parallel replicas are outermost); inside a replica,
// `ulysses_inner` (default) makes each Ulysses group consecutive ranks (ulysses_rank = local % Pu,
// ring_rank = local / Pu), so all-to-all stays inside a node; `ring_inner` is the transpose.
// The SP communicator (Pu x Pr ranks of one replica) orders ranks by sequence piece:
// sp_rank = ring_rank * Pu + ulysses_rank (ring shard r is cut into Pu pieces across its Ulysses group).
//
// Construction is collective over `world`: one small all-reduce checks that every rank passed the same
// configuration; then the product is checked against the world size. Both errors are raised on every rank with
// the same message, before any other communication.
#pragma once

#include <memory>
#include <string>
#include <string_view>

#include "comm.h"

namespace seqpar {

enum class Placement : std::uint8_t { kUlyssesInner, kRingInner };
const char* placement_name(Placement placement);  // "ulysses_inner", "ring_inner"
Placement parse_placement(std::string_view name);

struct SpGridConfig {
  int dp_size = 1;
  int ulysses_size = 1;
  int ring_size = 1;
  Placement placement = Placement::kUlyssesInner;
};

struct SpCoords {
  int dp_rank = 0;
  int ulysses_rank = 0;
  int ring_rank = 0;
  int sp_rank = 0;  // ring_rank * ulysses_size + ulysses_rank
};

// Pure arithmetic of the grid, usable without communication (tests, launch planning).
SpCoords sp_coords_of(const SpGridConfig& config, int world_rank);
int world_rank_of(const SpGridConfig& config, const SpCoords& coords);

class SpGrid {
 public:
  SpGrid(Communicator& world, const SpGridConfig& config);

  const SpGridConfig& config() const { return config_; }
  const SpCoords& coords() const { return coords_; }
  int world_rank() const { return world_rank_; }

  // Each named after its group in error messages: "ulysses", "ring", "sp", "dp".
  Communicator& ulysses() const { return *ulysses_; }  // size ulysses_size, rank = ulysses_rank
  Communicator& ring() const { return *ring_; }        // size ring_size, rank = ring_rank
  Communicator& sp() const { return *sp_; }            // size ulysses_size * ring_size, rank = sp_rank
  Communicator& dp() const { return *dp_; }            // size dp_size, rank = dp_rank

  std::string str() const;  // "dp=1 x ulysses=2 x ring=4 (ulysses_inner)"

 private:
  SpGridConfig config_;
  SpCoords coords_;
  int world_rank_ = 0;
  std::unique_ptr<Communicator> ulysses_, ring_, sp_, dp_;
};

}  // namespace seqpar
