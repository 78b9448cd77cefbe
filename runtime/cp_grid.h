// The sequence-parallel process grid (docs/design.md, "Process groups"): world = DP x Pu x Pr.
//
// Rank numbering: dp_rank = world_rank / (Pu * Pr) (data-parallel replicas are outermost); inside a replica,
// `ulysses_inner` (default) makes each Ulysses group consecutive ranks (ulysses_rank = local % Pu,
// ring_rank = local / Pu), so all-to-all stays inside a node; `ring_inner` is the transpose.
// The CP communicator (Pu x Pr ranks of one replica) orders ranks by sequence piece:
// cp_rank = ring_rank * Pu + ulysses_rank (ring shard r is cut into Pu pieces across its Ulysses group).
#pragma once

#include <memory>
#include <string>
#include <string_view>

#include "comm.h"

namespace seqpar {

// Which group gets consecutive ranks inside a replica: Ulysses (kUlyssesInner) or ring (kRingInner).
enum class Placement : std::uint8_t { kUlyssesInner, kRingInner };

// The name of a placement.
// Returns: "ulysses_inner" or "ring_inner".
// Errors: none.
// Sync: host-only, no communication.
const char* placement_name(Placement placement);

// The placement named `name`.
// Args: name: "ulysses_inner" or "ring_inner".
// Returns: the Placement.
// Errors: any other name.
// Sync: host-only, no communication.
Placement parse_placement(std::string_view name);

// The grid's shape: dp_size x ulysses_size (Pu) x ring_size (Pr) ranks, and which group is inner.
struct CpGridConfig {
  int dp_size = 1;
  int ulysses_size = 1;
  int ring_size = 1;
  Placement placement = Placement::kUlyssesInner;
};

// One rank's coordinates in the grid (rank numbering: the file comment).
struct CpCoords {
  int dp_rank = 0;
  int ulysses_rank = 0;
  int ring_rank = 0;
  int cp_rank = 0;  // ring_rank * ulysses_size + ulysses_rank
};

// The coordinates of `world_rank` in the grid; pure arithmetic, usable without communication (tests, launch
// planning).
// Returns: dp, ulysses, ring and cp ranks.
// Errors: a size below 1, or world_rank outside [0, dp_size * ulysses_size * ring_size).
// Sync: host-only, no communication.
CpCoords cp_coords_of(const CpGridConfig& config, int world_rank);

// The world rank at `coords`; the inverse of cp_coords_of, pure arithmetic.
// Returns: the world rank.
// Errors: a size below 1, or a coordinate outside its group.
// Sync: host-only, no communication.
int world_rank_of(const CpGridConfig& config, const CpCoords& coords);

// The sequence-parallel process grid: this rank's coordinates and its four sub-communicators.
class CpGrid {
 public:
  // Splits `world` into the Ulysses, ring, SP and DP groups of `config`.
  // Errors: ranks that passed different configurations (checked by one small all-reduce first); a size below 1;
  //   dp_size * ulysses_size * ring_size != world.size(). Raised on every rank with the same message, before any
  //   other communication.
  // Sync: collective over `world`.
  CpGrid(Communicator& world, const CpGridConfig& config);

  // Adopts groups built elsewhere (the Python module's torch.distributed groups), renamed "ulysses", "ring", "cp"
  // and "dp"; the sizes come from the groups, this rank's coordinates from its ranks in them.
  // Errors: cp.size() != ulysses.size() * ring.size(), or cp.rank() != ring.rank() * ulysses.size() +
  //   ulysses.rank() on this rank. The caller checks across ranks that the groups form one grid.
  // Sync: host-only, no communication.
  CpGrid(std::unique_ptr<Communicator> ulysses, std::unique_ptr<Communicator> ring, std::unique_ptr<Communicator> cp,
         std::unique_ptr<Communicator> dp, int world_rank, Placement placement);

  // Accessors: the configuration, this rank's coordinates, its world rank.
  // Sync: host-only, no communication.
  const CpGridConfig& config() const { return config_; }
  const CpCoords& coords() const { return coords_; }
  int world_rank() const { return world_rank_; }

  // The group communicators, each named after its group in error messages: "ulysses", "ring", "cp", "dp".
  // Returns: a communicator owned by the grid, valid while the grid lives.
  // Sync: host-only accessors; collectives on the returned communicator are over that group.
  Communicator& ulysses() const { return *ulysses_; }  // size ulysses_size, rank = ulysses_rank
  Communicator& ring() const { return *ring_; }        // size ring_size, rank = ring_rank
  Communicator& cp() const { return *cp_; }            // size ulysses_size * ring_size, rank = cp_rank
  Communicator& dp() const { return *dp_; }            // size dp_size, rank = dp_rank

  // A one-line description of the grid.
  // Returns: e.g. "dp=1 x ulysses=2 x ring=4 (ulysses_inner)".
  // Sync: host-only, no communication.
  std::string str() const;

 private:
  CpGridConfig config_;
  CpCoords coords_;
  int world_rank_ = 0;
  std::unique_ptr<Communicator> ulysses_, ring_, cp_, dp_;
};

}  // namespace seqpar
