// sp_plan's model: the device profile, the event simulation of one layer per configuration, the enumeration and
// the output (benchmarks/sp_plan.h).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <numeric>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "benchmarks/flop_models.h"
#include "benchmarks/sp_bench_decode.h"
#include "benchmarks/sp_bench_memory.h"
#include "benchmarks/sp_bench_workload.h"
#include "benchmarks/sp_plan.h"
#include "parallel/comm_volume.h"
#include "parallel/gdn_cp.h"
#include "parallel/layout.h"
#include "runtime/cp_grid.h"
#include "runtime/dtype.h"
#include "runtime/error.h"

namespace seqpar::bench::plan {

// ---- the profile ------------------------------------------------------------------------------------------------

double KernelCurve::rate(double flops) const {
  SEQPAR_CHECK(!points.empty(), "sp_plan: an empty kernel curve");
  if (flops <= points.front().first) return points.front().second;
  if (flops >= points.back().first) return points.back().second;
  for (std::size_t i = 1; i < points.size(); ++i) {
    if (flops <= points[i].first) {
      const auto& [x0, y0] = points[i - 1];
      const auto& [x1, y1] = points[i];
      const double w = (std::log(flops) - std::log(x0)) / (std::log(x1) - std::log(x0));
      return y0 + w * (y1 - y0);
    }
  }
  return points.back().second;
}

const KernelCurve& DeviceProfile::kernel(const std::string& key) const {
  const auto it = kernels.find(key);
  SEQPAR_CHECK(it != kernels.end() && !it->second.points.empty(), "sp_plan: profile ", name, " has no curve \"", key,
               "\" (kernels: mha_fwd, mha_bwd, gdn_fwd, gdn_bwd, dsa_fwd, dsa_bwd)");
  return it->second;
}

namespace {

// A block's "source": a non-empty string, or a non-empty array of objects each with a non-empty "what" and a
// non-empty "url" or "assumption". Returns it as one line of text; Error naming the block otherwise.
std::string source_text(const nlohmann::json& j, const std::string& what) {
  const std::string rule =
      "must name where its numbers come from: \"source\" a non-empty string or a non-empty array of {\"what\", "
      "\"url\"} / {\"what\", \"assumption\"} objects";
  SEQPAR_CHECK(j.is_object() && j.contains("source"), what, ": no \"source\" field; the block ", rule);
  const nlohmann::json& s = j["source"];
  if (s.is_string()) {
    SEQPAR_CHECK(!s.get<std::string>().empty(), what, ": \"source\" is empty; the block ", rule);
    return s.get<std::string>();
  }
  SEQPAR_CHECK(s.is_array() && !s.empty(), what, ": \"source\" is ", s.dump(), "; the block ", rule);
  std::string text;
  for (std::size_t i = 0; i < s.size(); ++i) {
    const nlohmann::json& e = s[i];
    const auto nonempty = [&](const char* k) {
      return e.is_object() && e.contains(k) && e[k].is_string() && !e[k].get<std::string>().empty();
    };
    SEQPAR_CHECK(nonempty("what") && (nonempty("url") || nonempty("assumption")), what, ": source[", i, "] ", e.dump(),
                 " needs a non-empty \"what\" and a non-empty \"url\" or \"assumption\"");
    text += str_cat(i > 0 ? "; " : "", e["what"].get<std::string>(), " (",
                    nonempty("url") ? e["url"].get<std::string>() : "assumption: " + e["assumption"].get<std::string>(),
                    ")");
  }
  return text;
}

double number_at(const nlohmann::json& j, const char* key, const std::string& what) {
  SEQPAR_CHECK(j.contains(key) && j[key].is_number(), what, ": field \"", key, "\" must be a number");
  return j[key].get<double>();
}

// An optional number of block `j`: `fallback` when absent, else a number (a string or another type is refused, naming
// the field; nlohmann's own type error named neither the file nor the field).
double optional_number(const nlohmann::json& j, const char* key, double fallback, const std::string& what) {
  if (!j.contains(key)) return fallback;
  SEQPAR_CHECK(j[key].is_number(), what, ": field \"", key, "\" must be a number (is ", j[key].dump(), ")");
  return j[key].get<double>();
}

LinkClass link_from_json(const nlohmann::json& j, const std::string& what) {
  LinkClass l;
  l.latency_s = number_at(j, "latency_s", what);
  l.bandwidth_bps = number_at(j, "bandwidth_bytes_per_s", what);
  SEQPAR_CHECK(l.latency_s >= 0 && l.bandwidth_bps > 0, what, ": latency_s ", l.latency_s,
               " must be >= 0 and bandwidth_bytes_per_s ", l.bandwidth_bps, " > 0");
  l.source = source_text(j, what);
  return l;
}

nlohmann::json link_json(const LinkClass& l) {
  return {{"latency_s", l.latency_s}, {"bandwidth_bytes_per_s", l.bandwidth_bps}, {"source", l.source}};
}

}  // namespace

DeviceProfile profile_from_json(const nlohmann::json& j, const std::string& what) {
  DeviceProfile p;
  SEQPAR_CHECK(j.is_object(), what, ": must be a JSON object (is ", j.type_name(), ")");
  for (const char* k : {"name", "note"})
    SEQPAR_CHECK(!j.contains(k) || j[k].is_string(), what, ": field \"", k, "\" must be a string (is ", j[k].dump(), ")");
  p.name = j.value("name", "unnamed");
  p.note = j.value("note", "");
  SEQPAR_CHECK(j.contains("kernels") && j["kernels"].is_object(), what, ": field \"kernels\" must be an object");
  for (const auto& [key, curve] : j["kernels"].items()) {
    KernelCurve c;
    c.source = source_text(curve, what + ": kernels." + key);
    SEQPAR_CHECK(curve.contains("points") && curve["points"].is_array(), what, ": kernels.", key,
                 ".points must be an array of [flops_per_call, flops_per_s]");
    for (const auto& pt : curve["points"]) {
      SEQPAR_CHECK(pt.is_array() && pt.size() == 2 && pt[0].is_number() && pt[1].is_number(), what, ": kernels.", key,
                   ".points: each point is [flops_per_call, flops_per_s]");
      const double x = pt[0].get<double>(), y = pt[1].get<double>();
      SEQPAR_CHECK(x > 0 && y > 0, what, ": kernels.", key, ".points: [", x, ", ", y, "] must be positive");
      // A rate below 1 FLOP/s turns a call's predicted time (flops / rate) into inf or nan.
      SEQPAR_CHECK(std::isfinite(x) && std::isfinite(y) && y >= 1, what, ": kernels.", key, ".points: [", x, ", ", y,
                   "]: the rate flops_per_s must be finite and >= 1 (it divides every predicted time)");
      c.points.emplace_back(x, y);
    }
    std::sort(c.points.begin(), c.points.end());
    p.kernels[key] = std::move(c);
  }
  SEQPAR_CHECK(j.contains("links") && j["links"].is_object() && j["links"].contains("intra") &&
                   j["links"].contains("inter"),
               what, ": field \"links\" must hold \"intra\" and \"inter\"");
  p.intra = link_from_json(j["links"]["intra"], what + ": links.intra");
  p.inter = link_from_json(j["links"]["inter"], what + ": links.inter");
  p.intra_p2p_bandwidth_bps =
      optional_number(j["links"]["intra"], "p2p_bandwidth_bytes_per_s", 0.0, what + ": links.intra");
  SEQPAR_CHECK(p.intra_p2p_bandwidth_bps >= 0, what, ": links.intra.p2p_bandwidth_bytes_per_s ",
               p.intra_p2p_bandwidth_bps, " must be >= 0 (0: links.intra's bandwidth)");
  const double ranks_per_nic = optional_number(j["links"], "ranks_per_nic", 1, what + ": links");
  SEQPAR_CHECK(ranks_per_nic >= 1 && ranks_per_nic <= 1 << 20 && ranks_per_nic == std::floor(ranks_per_nic), what,
               ": links.ranks_per_nic ", ranks_per_nic, " must be an integer >= 1");
  p.ranks_per_nic = static_cast<int>(ranks_per_nic);
  // The scalar factors multiply predicted times: zero or negative ones would predict times of zero or below (a
  // silently wrong plan). cores_per_node 0 means unknown (no oversubscription slowdown).
  p.cores_per_node = optional_number(j, "cores_per_node", 0.0, what);
  p.gdn_map_factor = optional_number(j, "gdn_map_factor", 1.0, what);
  p.gdn_sweep_factor = optional_number(j, "gdn_sweep_factor", 1.0, what);
  SEQPAR_CHECK(p.cores_per_node >= 0, what, ": cores_per_node ", p.cores_per_node, " must be >= 0 (0: unknown)");
  SEQPAR_CHECK(p.gdn_map_factor > 0 && p.gdn_sweep_factor > 0, what, ": gdn_map_factor ", p.gdn_map_factor,
               " and gdn_sweep_factor ", p.gdn_sweep_factor, " must be > 0 (they multiply predicted times)");
  if (j.contains("mha_tile_pairs")) {
    SEQPAR_CHECK(j["mha_tile_pairs"].is_boolean(), what, ": mha_tile_pairs must be true or false (is ",
                 j["mha_tile_pairs"].dump(), ")");
    p.mha_tile_pairs = j["mha_tile_pairs"].get<bool>();
  }
  // The scalar factors name their source in "factors": {"source": ...}.
  if (j.contains("cores_per_node") || j.contains("gdn_map_factor") || j.contains("gdn_sweep_factor") ||
      j.contains("mha_tile_pairs")) {
    SEQPAR_CHECK(j.contains("factors"), what,
                 ": cores_per_node / gdn_map_factor / gdn_sweep_factor / mha_tile_pairs need a \"factors\" block with "
                 "their source");
    source_text(j["factors"], what + ": factors");
  }
  if (j.contains("ring")) {
    const nlohmann::json& r = j["ring"];
    const auto flag = [&](const char* k, bool dflt) {
      if (!r.contains(k)) return dflt;
      SEQPAR_CHECK(r[k].is_boolean(), what, ": ring.", k, " must be true or false (is ", r[k].dump(), ")");
      return r[k].get<bool>();
    };
    p.ring_transfer_overlaps_compute = flag("transfer_overlaps_compute", true);
    p.ring_merge_pass = flag("merge_pass", false);
    p.ring_storage_dtype_gradients = flag("storage_dtype_gradients", false);
    p.ring_copy_passes = flag("copy_passes", false);
    p.ring_source = source_text(r, what + ": ring");
  }
  if (j.contains("ulysses")) {
    const nlohmann::json& u = j["ulysses"];
    SEQPAR_CHECK(u.contains("layout_pass") && u["layout_pass"].is_boolean(), what,
                 ": ulysses.layout_pass must be true or false");
    p.ulysses_layout_pass = u["layout_pass"].get<bool>();
    p.ulysses_source = source_text(u, what + ": ulysses");
  }
  if (j.contains("fa3_calls")) {
    const nlohmann::json& f = j["fa3_calls"];
    SEQPAR_CHECK(f.is_object() && f.contains("unpad_pad_pass") && f["unpad_pad_pass"].is_boolean(), what,
                 ": fa3_calls.unpad_pad_pass must be true or false");
    p.fa3_unpad_pad_pass = f["unpad_pad_pass"].get<bool>();
    p.fa3_calls_source = source_text(f, what + ": fa3_calls");
  }
  if (j.contains("device")) {
    const nlohmann::json& d = j["device"];
    SEQPAR_CHECK(d.is_object(), what, ": field \"device\" must be an object (is ", d.dump(), ")");
    p.memory_bytes = optional_number(d, "memory_bytes", 0.0, what + ": device");
    p.memory_bandwidth_bps = optional_number(d, "memory_bandwidth_bytes_per_s", 0.0, what + ": device");
    p.decode_overhead_s = optional_number(d, "decode_overhead_s", 0.0, what + ": device");
    SEQPAR_CHECK(p.memory_bytes >= 0 && p.memory_bandwidth_bps >= 0, what, ": device.memory_bytes ", p.memory_bytes,
                 " and device.memory_bandwidth_bytes_per_s ", p.memory_bandwidth_bps, " must be >= 0");
    SEQPAR_CHECK(p.decode_overhead_s >= 0, what, ": device.decode_overhead_s ", p.decode_overhead_s,
                 " must be >= 0 (seconds added to a decode step)");
    p.device_source = source_text(d, what + ": device");
  }
  if (j.contains("gdn_work_ahead")) {
    const nlohmann::json& a = j["gdn_work_ahead"];
    const std::string w = what + ": gdn_work_ahead";
    SEQPAR_CHECK(a.is_object(), w, " must be an object (is ", a.dump(), ")");
    DeviceProfile::GdnWorkAhead& g = p.gdn_work_ahead;
    g.fwd_ahead = optional_number(a, "forward_ahead", 0.0, w);
    g.fwd_rest = optional_number(a, "forward_rest", 1.0, w);
    g.bwd_ahead = optional_number(a, "backward_ahead", 0.0, w);
    g.bwd_rest = optional_number(a, "backward_rest", 1.0, w);
    SEQPAR_CHECK(g.fwd_ahead >= 0 && g.bwd_ahead >= 0, w, ": forward_ahead ", g.fwd_ahead, " and backward_ahead ",
                 g.bwd_ahead, " must be >= 0 (a share of a window's time; 0: no work ahead)");
    SEQPAR_CHECK(g.fwd_rest > 0 && g.bwd_rest > 0, w, ": forward_rest ", g.fwd_rest, " and backward_rest ", g.bwd_rest,
                 " must be > 0 (a share of a window's time)");
    g.source = source_text(a, w);
  }
  if (j.contains("shared_node")) {
    const nlohmann::json& n = j["shared_node"];
    const std::string w = what + ": shared_node";
    SEQPAR_CHECK(n.is_object() && n.contains("slowdown") && n["slowdown"].is_object() && !n["slowdown"].empty(), w,
                 ": must be an object with a non-empty object \"slowdown\" (kernel key: factor)");
    DeviceProfile::SharedNode& sn = p.shared_node;
    for (const auto& [key, v] : n["slowdown"].items()) {
      SEQPAR_CHECK(p.kernels.count(key) > 0, w, ": slowdown.", key, ": no kernel curve \"", key,
                   "\" in the profile (a factor slows one of its curves)");
      SEQPAR_CHECK(v.is_number(), w, ": slowdown.", key, " must be a number (is ", v.dump(), ")");
      const double f = v.get<double>();
      SEQPAR_CHECK(f >= 1 && f <= 100, w, ": slowdown.", key, " ", f,
                   " must be in [1, 100] (a kernel's time with the node's cores busy over its time alone)");
      sn.slowdown[key] = f;
    }
    sn.cores_busy = number_at(n, "cores_busy", w);
    SEQPAR_CHECK(sn.cores_busy >= 1 && sn.cores_busy <= 1 << 20 && sn.cores_busy == std::floor(sn.cores_busy), w,
                 ": cores_busy ", sn.cores_busy, " must be an integer >= 1 (the cores busy in the measurement)");
    sn.source = source_text(n, w);
  }
  if (j.contains("mha_tiles")) {
    p.mha_tiles = tiles_from_json(j["mha_tiles"], what + ": mha_tiles");
    p.mha_tiles.source = source_text(j["mha_tiles"], what + ": mha_tiles");
  }
  SEQPAR_CHECK(!p.ulysses_layout_pass || p.memory_bandwidth_bps > 0, what,
               ": ulysses.layout_pass is true but device.memory_bandwidth_bytes_per_s is ", p.memory_bandwidth_bps,
               " (the copies run at the memory bandwidth: give it, > 0)");
  SEQPAR_CHECK(!p.fa3_unpad_pad_pass || p.memory_bandwidth_bps > 0, what,
               ": fa3_calls.unpad_pad_pass is true but device.memory_bandwidth_bytes_per_s is ", p.memory_bandwidth_bps,
               " (the passes run at the memory bandwidth: give it, > 0)");
  SEQPAR_CHECK(!p.ring_merge_pass || p.memory_bandwidth_bps > 0, what,
               ": ring.merge_pass is true but device.memory_bandwidth_bytes_per_s is ", p.memory_bandwidth_bps,
               " (the merge pass runs at the memory bandwidth: give it, > 0)");
  SEQPAR_CHECK(!p.ring_copy_passes || p.memory_bandwidth_bps > 0, what,
               ": ring.copy_passes is true but device.memory_bandwidth_bytes_per_s is ", p.memory_bandwidth_bps,
               " (the copies run at the memory bandwidth: give it, > 0)");
  return p;
}

DeviceProfile load_profile(const std::string& path) {
  std::ifstream in(path);
  SEQPAR_CHECK(in.good(), "sp_plan: cannot read the profile ", path);
  nlohmann::json j;
  try {
    in >> j;
  } catch (const std::exception& e) {
    SEQPAR_THROW("sp_plan: profile ", path, " is not JSON: ", e.what());
  }
  return profile_from_json(j, "profile " + path);
}

nlohmann::json profile_json(const DeviceProfile& p) {
  nlohmann::json j = {{"name", p.name},
                      {"note", p.note},
                      {"cores_per_node", p.cores_per_node},
                      {"gdn_map_factor", p.gdn_map_factor},
                      {"gdn_sweep_factor", p.gdn_sweep_factor},
                      {"mha_tile_pairs", p.mha_tile_pairs},
                      {"factors", {{"source", p.note}}}};
  if (p.gdn_work_ahead.present()) {
    const DeviceProfile::GdnWorkAhead& g = p.gdn_work_ahead;
    j["gdn_work_ahead"] = {{"forward_ahead", g.fwd_ahead}, {"forward_rest", g.fwd_rest},
                           {"backward_ahead", g.bwd_ahead}, {"backward_rest", g.bwd_rest},
                           {"source", g.source}};
  }
  for (const auto& [key, c] : p.kernels) {
    nlohmann::json pts = nlohmann::json::array();
    for (const auto& [x, y] : c.points) pts.push_back({x, y});
    j["kernels"][key] = {{"points", pts}, {"source", c.source}};
  }
  j["links"] = {{"intra", link_json(p.intra)}, {"inter", link_json(p.inter)}, {"ranks_per_nic", p.ranks_per_nic}};
  if (p.intra_p2p_bandwidth_bps > 0) j["links"]["intra"]["p2p_bandwidth_bytes_per_s"] = p.intra_p2p_bandwidth_bps;
  if (!p.ring_source.empty()) {
    j["ring"] = {{"transfer_overlaps_compute", p.ring_transfer_overlaps_compute},
                 {"merge_pass", p.ring_merge_pass},
                 {"storage_dtype_gradients", p.ring_storage_dtype_gradients},
                 {"copy_passes", p.ring_copy_passes},
                 {"source", p.ring_source}};
  }
  if (p.mha_tiles.present) j["mha_tiles"] = tiles_json(p.mha_tiles);
  if (p.shared_node.present()) {
    j["shared_node"] = {{"slowdown", p.shared_node.slowdown},
                        {"cores_busy", p.shared_node.cores_busy},
                        {"source", p.shared_node.source}};
  }
  if (!p.ulysses_source.empty())
    j["ulysses"] = {{"layout_pass", p.ulysses_layout_pass}, {"source", p.ulysses_source}};
  if (!p.fa3_calls_source.empty())
    j["fa3_calls"] = {{"unpad_pad_pass", p.fa3_unpad_pad_pass}, {"source", p.fa3_calls_source}};
  if (p.memory_bytes > 0 || p.memory_bandwidth_bps > 0) {
    j["device"] = {{"memory_bytes", p.memory_bytes},
                   {"memory_bandwidth_bytes_per_s", p.memory_bandwidth_bps},
                   {"decode_overhead_s", p.decode_overhead_s},
                   {"source", p.device_source}};
  }
  return j;
}

// ---- configurations ---------------------------------------------------------------------------------------------

std::string PlanConfig::name() const {
  std::string s = str_cat("u", ulysses_size, "xr", ring_size, " ", layout);
  if (!impl.empty()) s += " " + impl;
  if (!gdn_mode.empty()) s += " " + gdn_mode;
  if (!dsa_select.empty()) s += " select-" + dsa_select;
  if (!cache_shard.empty()) s += " cache-" + cache_shard;
  return s;
}

std::vector<std::string> PlanConfig::flags() const {
  std::vector<std::string> f = {"--ulysses-size", std::to_string(ulysses_size), "--ring-size",
                                std::to_string(ring_size)};
  if (ring_size > 1) f.insert(f.end(), {"--layout", layout});  // a ring of one runs sp_bench's default, zigzag
  if (!impl.empty()) f.insert(f.end(), {"--impl", impl});
  if (!gdn_mode.empty()) f.insert(f.end(), {"--gdn-mode", gdn_mode});
  if (!dsa_select.empty()) f.insert(f.end(), {"--dsa-select", dsa_select});
  if (!cache_shard.empty()) f.insert(f.end(), {"--mode", "decode", "--cache-shard", cache_shard});
  return f;
}

namespace {

// The problem's flags as sp_bench takes them: with --tp T, each device's share of the heads (--heads H / T,
// --kv-heads Hkv / T after the preset's).
std::vector<std::string> problem_args(const PlanInput& in);

}  // namespace

SpBenchOptions config_options(const PlanInput& in, const PlanConfig& c) {
  std::vector<std::string> args = {"sp_bench"};
  const std::vector<std::string> problem = problem_args(in);
  args.insert(args.end(), problem.begin(), problem.end());
  const std::vector<std::string> cf = c.flags();
  args.insert(args.end(), cf.begin(), cf.end());
  args.insert(args.end(), {"--threads", std::to_string(in.threads)});
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  std::optional<SpBenchOptions> o = parse_sp_bench_options(static_cast<int>(argv.size()), argv.data(), in.world_size,
                                                           /*world_rank=*/1);  // rank 1: no --help printing
  SEQPAR_CHECK(o.has_value(), "sp_plan: --help is not a problem flag");
  return *o;
}

namespace {

MemoryEstimate estimate_of(const SpBenchOptions& o, int world_rank) {
  return o.decode.mode == "decode" ? estimate_decode_memory(o, world_rank) : estimate_memory(o, world_rank);
}

}  // namespace

std::string memory_verdict(const SpBenchOptions& o, const PlanInput& in, double* per_rank_total) {
  // sp_bench's rule (compare_with_node_memory): the estimates of the ranks of each node summed against what the
  // node has; every node holds devices_per_node ranks, so node 0 (world ranks 0 .. devices_per_node - 1) decides
  // unless a later node's ranks need more (they do not without --check: the estimates are the same).
  // An estimate depends on the world rank only through rank 0 (--dump-inputs) and the SP roots, cp_rank 0 (--check's
  // reference): one estimate per class, not one per rank (GDN's builds the layout).
  std::map<std::pair<bool, bool>, double> by_class;
  const auto estimate_total = [&](int r) {
    const std::pair<bool, bool> key{r == 0, cp_coords_of(o.grid, r).cp_rank == 0};
    auto it = by_class.find(key);
    if (it == by_class.end()) it = by_class.emplace(key, estimate_of(o, r).total_bytes()).first;
    return it->second;
  };
  double worst = 0, largest_rank = 0;
  for (int node = 0; node < in.nodes; ++node) {
    double need = 0;
    for (int r = node * in.devices_per_node; r < (node + 1) * in.devices_per_node && r < in.world_size; ++r) {
      const double t = estimate_total(r);
      need += t;
      largest_rank = std::max(largest_rank, t);
    }
    worst = std::max(worst, need);
    if (node == 0 && in.nodes > 1) break;  // every node's ranks estimate alike (no --check in the planned runs)
  }
  if (per_rank_total != nullptr) *per_rank_total = largest_rank;
  const double have = in.memory_per_device * in.devices_per_node;
  if (in.memory_per_device <= 0 || worst <= have) return "";
  return str_cat("does not fit in memory: the ", in.devices_per_node, " rank(s) of a node need ", bytes_str(worst),
                 " of the ", bytes_str(have), " available (", in.devices_per_node, " x --mem-per-device ",
                 bytes_str(in.memory_per_device), ")");
}

// ---- the event simulation ---------------------------------------------------------------------------------------

std::vector<double> simulate_ring(const std::vector<std::vector<double>>& compute, double transfer_s,
                                  std::vector<double>* exposed, bool overlap) {
  const int P = static_cast<int>(compute.size());
  std::vector<double> start(P, 0.0), next(P, 0.0), waited(P, 0.0);
  for (int s = 0; s + 1 < P; ++s) {
    for (int r = 0; r < P; ++r) {
      // The block for step s + 1 is posted by rank r - 1 when it starts step s (double buffering) and received by
      // rank r, whose receive is posted at its own start of step s.
      // Without overlap the transfer runs once both kernels of step s have ended.
      const int src = (r + P - 1) % P;
      const double done = start[r] + compute[r][s];
      const double arrival = overlap ? std::max(start[src], start[r]) + transfer_s
                                     : std::max(start[src] + compute[src][s], done) + transfer_s;
      next[r] = std::max(done, arrival);
      waited[r] += std::max(0.0, arrival - done);
    }
    start = next;
  }
  std::vector<double> finish(P);
  for (int r = 0; r < P; ++r) finish[r] = start[r] + compute[r][P - 1];
  if (exposed != nullptr) *exposed = waited;
  return finish;
}

double ring_forward_closed_form(int P, double compute_step_s, double transfer_s, bool overlap) {
  if (!overlap) return P * compute_step_s + (P - 1) * transfer_s;
  return compute_step_s + (P - 1) * std::max(compute_step_s, transfer_s);
}

double allgather_seconds(double block_bytes, int P, int members_per_node, int devices_per_node,
                         const DeviceProfile& p) {
  if (P <= 1 || block_bytes <= 0) return 0.0;
  SEQPAR_CHECK(members_per_node >= 1 && devices_per_node >= 1, "sp_plan: allgather_seconds: members_per_node ",
               members_per_node, " and devices_per_node ", devices_per_node, " must be >= 1");
  if (P <= members_per_node) return (P - 1) * p.intra.seconds(block_bytes);
  const double per_rank = p.inter.bandwidth_bps / std::min(p.ranks_per_nic, devices_per_node);
  const double bw = members_per_node > 1 ? std::min(p.intra.bandwidth_bps, members_per_node * per_rank) : per_rank;
  return (P - 1) * (p.inter.latency_s + block_bytes / bw);
}

namespace {

struct Links {
  LinkClass ring, ulysses;
  std::string ring_class, ulysses_class;
};

// The link classes of the ring and Ulysses groups (ulysses_inner placement, dp 1: CP rank = world rank, node =
// rank / devices_per_node). A ring that leaves the node runs at its slowest hop, the inter-node one, whose NIC's
// bandwidth divides among the ranks sharing it.
Links links_of(const SpBenchOptions& o, const PlanInput& in, const DeviceProfile& p) {
  LinkClass inter = p.inter;
  inter.bandwidth_bps /= std::min(p.ranks_per_nic, in.devices_per_node);
  Links l;
  const int pu = o.grid.ulysses_size, cp = pu * o.grid.ring_size;
  const bool ulysses_inside = pu <= in.devices_per_node && in.devices_per_node % pu == 0;
  l.ulysses = ulysses_inside ? p.intra : inter;
  l.ulysses_class = ulysses_inside ? "intra" : "inter";
  const bool ring_inside = cp <= in.devices_per_node;
  l.ring = ring_inside ? p.intra : inter;
  if (ring_inside && p.intra_p2p_bandwidth_bps > 0) l.ring.bandwidth_bps = p.intra_p2p_bandwidth_bps;
  l.ring_class = ring_inside ? "intra" : "inter";
  return l;
}

// Compute slows down when a CPU node runs more threads than it has cores.
double oversubscription(const PlanInput& in, const DeviceProfile& p) {
  if (p.cores_per_node <= 0) return 1.0;
  return std::max(1.0, static_cast<double>(in.devices_per_node) * in.threads / p.cores_per_node);
}

}  // namespace

double kernel_slowdown(const PlanInput& in, const DeviceProfile& p, const std::string& key) {
  const auto it = p.shared_node.slowdown.find(key);
  if (in.devices_per_node <= 1 || it == p.shared_node.slowdown.end()) return oversubscription(in, p);
  return it->second * std::max(1.0, static_cast<double>(in.devices_per_node) * in.threads / p.shared_node.cores_busy);
}

SharedNodeSamples shared_node_slowdown(const std::vector<std::vector<double>>& alone_ms,
                                       const std::vector<std::vector<std::vector<double>>>& busy_ms) {
  SEQPAR_CHECK(alone_ms.size() == busy_ms.size(), "shared_node_slowdown: ", alone_ms.size(), " runs alone and ",
               busy_ms.size(), " busy runs (one each per pair)");
  SharedNodeSamples out;
  std::vector<double> all;
  for (std::size_t p = 0; p < alone_ms.size(); ++p) {
    std::vector<double> pair;
    for (std::size_t c = 0; c < busy_ms[p].size(); ++c) {
      SEQPAR_CHECK(busy_ms[p][c].size() == alone_ms[p].size(), "shared_node_slowdown: pair ", p, " copy ", c, " has ",
                   busy_ms[p][c].size(), " lengths and the run alone ", alone_ms[p].size());
      for (std::size_t l = 0; l < alone_ms[p].size(); ++l) {
        if (alone_ms[p][l] > 0 && busy_ms[p][c][l] > 0) pair.push_back(busy_ms[p][c][l] / alone_ms[p][l]);
      }
    }
    out.pair_medians.push_back(pair.empty() ? 0.0 : median(pair));
    all.insert(all.end(), pair.begin(), pair.end());
  }
  SEQPAR_CHECK(!all.empty(), "shared_node_slowdown: no length has a time > 0 both alone and busy (", alone_ms.size(),
               " pairs)");
  out.samples = static_cast<int>(all.size());
  out.median = median(all);
  out.slowdown = std::max(1.0, out.median);
  return out;
}

namespace {

// The share of (ring rank r, step s) in the causal work of the layout (tile pairs, SequenceLayout::step_work);
// uniform without a causal mask.
std::vector<std::vector<double>> step_shares(const SequenceLayout& layout, bool causal) {
  const int P = layout.ring_size();
  std::vector<std::vector<double>> share(P, std::vector<double>(P, 1.0 / (static_cast<double>(P) * P)));
  if (!causal) return share;
  const std::vector<std::int64_t>& w = layout.step_work();
  const double total = static_cast<double>(std::accumulate(w.begin(), w.end(), std::int64_t{0}));
  if (total <= 0) return share;
  for (int r = 0; r < P; ++r)
    for (int s = 0; s < P; ++s) share[r][s] = static_cast<double>(w[r * P + s]) / total;
  return share;
}

// Visible (query, key) pairs of the whole row (batch included): per document L (L + 1) / 2 causal, L^2 otherwise.
double visible_pairs(const SpBenchOptions& o, const SequenceLayout& layout) {
  double pairs = 0;
  const auto cu = layout.cu_seqlens();
  for (std::size_t d = 0; d + 1 < cu.size(); ++d) {
    const double n = static_cast<double>(cu[d + 1] - cu[d]);
    pairs += o.causal ? n * (n + 1) / 2 : n * n;
  }
  return pairs * static_cast<double>(o.batch);
}

// Visible (query, key) pairs per computed tile pair of one causal row of `len` tokens on one rank: the row's
// len (len + 1) / 2 pairs over its n (n + 1) / 2 pairs of 64-row tiles, n = ceil(len / 64) (kTileAlign of the CPU
// kernels, SequenceLayout::step_work). The profile's MHA curves are measured on such rows (kernel_bench, causal), so
// FLOPs counted as tile pairs times this ratio times 4 H D run at the curves' rates.
constexpr std::int64_t kTileAlign = 64;  // the CPU kernels' kBlockQ = kBlockK, step_work's tile
double causal_pairs_per_tile(std::int64_t len) {
  const double n = static_cast<double>((len + kTileAlign - 1) / kTileAlign), l = static_cast<double>(len);
  return n > 0 ? l * (l + 1) / (n * (n + 1) * kTileAlign * kTileAlign) : 1.0;
}

// Forward FLOPs of (ring rank r, ring step s), every head, the whole batch. Under a causal mask the CPU kernels
// compute every 64 x 64 tile pair in which some query sees some key (SequenceLayout::step_work), masked or not: a
// packed row's tiles straddle its documents (the zigzag layout cuts each document into 2 P pieces, a document of 64
// tokens into pieces of 64 / 2P rows), so it costs its tile pairs, not its visible pairs. Counted as tile pairs x
// causal_pairs_per_tile(padded_len) x 4 H D, which is an unpacked row's visible-pair FLOPs when its tiles are those of
// the row on one rank (every layout's shards are whole tiles then). Without a causal mask: the visible pairs,
// uniformly over the steps. tile_pairs false (DeviceProfile::mha_tile_pairs): the visible pairs, spread over the
// steps by their shares of the tile pairs.
std::vector<std::vector<double>> step_flops(const SpBenchOptions& o, const SequenceLayout& layout, bool tile_pairs) {
  const int P = layout.ring_size();
  const double per_pair = 4.0 * o.heads * o.head_dim * static_cast<double>(o.batch);
  if (!o.causal || !tile_pairs) {  // the visible pairs, by the steps' shares of the tile pairs
    const auto share = step_shares(layout, o.causal);
    std::vector<std::vector<double>> f(P, std::vector<double>(P));
    const double total = 4.0 * o.heads * o.head_dim * visible_pairs(o, layout);  // batch included
    for (int r = 0; r < P; ++r)
      for (int s = 0; s < P; ++s) f[r][s] = total * share[r][s];
    return f;
  }
  const double pairs_per_tile = causal_pairs_per_tile(layout.padded_len()) * kTileAlign * kTileAlign;
  const std::vector<std::int64_t>& w = layout.step_work();
  std::vector<std::vector<double>> f(P, std::vector<double>(P));
  for (int r = 0; r < P; ++r)
    for (int s = 0; s < P; ++s) f[r][s] = per_pair * pairs_per_tile * static_cast<double>(w[r * P + s]);
  return f;
}

struct Phase {
  std::vector<double> finish, compute;  // per rank (ring ranks; every Ulysses rank of a ring rank alike)
  double bytes_ring = 0, bytes_a2a = 0;
};

// Summarises a phase: the slowest rank's finish, its compute, the mean compute.
void add_phase(Prediction& pr, const Phase& ph, double* phase_s) {
  const auto slow = std::max_element(ph.finish.begin(), ph.finish.end()) - ph.finish.begin();
  const double mean = std::accumulate(ph.compute.begin(), ph.compute.end(), 0.0) / ph.compute.size();
  *phase_s = ph.finish[slow];
  pr.step_s += ph.finish[slow];
  pr.compute_s += ph.compute[slow];
  pr.exposed_comm_s += ph.finish[slow] - ph.compute[slow];
  pr.imbalance_s += std::max(0.0, ph.compute[slow] - mean);
}

// The attention calls of ring rank r under the zigzag layout (profile.mha_tiles), per document of padded length p =
// 2 P c (slot_cu_seqlens): the rank holds chunks r and 2P - 1 - r of every document. The THD ring of
// TransformerEngine, which MagiAttention's FlashAttention-3 baselines follow (exps/dist_attn/baselines/ring_attn.py),
// calls at step 0 its 2c queries on its 2c keys (causal); at a later step, from the keys of ring rank k = (r - s) mod
// P, all 2c queries on the first chunk of k (c keys) when k < r, the second query chunk (c) on both of k's chunks when
// k > r; without a causal mask 2c on 2c. step < 0: the all-gather's calls, one per half of the local queries against
// the gathered document (chunk j of c queries on the (j + 1) c keys before its end, causal; on all p without a mask).
// A ring of one: every document whole.
std::vector<TileSeq> zigzag_calls(std::span<const std::int64_t> slot_cu, int P, int r, int step, bool causal) {
  std::vector<TileSeq> calls;
  for (std::size_t d = 0; d + 1 < slot_cu.size(); ++d) {
    const std::int64_t p = slot_cu[d + 1] - slot_cu[d];
    if (p <= 0) continue;
    if (P == 1) {
      calls.push_back({p, p, causal});
      continue;
    }
    const std::int64_t c = p / (2 * P);
    if (step < 0) {
      for (const std::int64_t j : {static_cast<std::int64_t>(r), static_cast<std::int64_t>(2 * P - 1 - r)})
        calls.push_back(causal ? TileSeq{c, (j + 1) * c, true} : TileSeq{c, p, false});
      continue;
    }
    const int k = ((r - step) % P + P) % P;
    if (!causal || step == 0)
      calls.push_back({2 * c, 2 * c, causal});
    else
      calls.push_back(k < r ? TileSeq{2 * c, c, false} : TileSeq{c, 2 * c, false});
  }
  return calls;
}

// ---- MHA: Ulysses all-to-alls around a ring (p2p or all-gather) ----

Prediction predict_mha(const SpBenchOptions& o, const PlanInput& in, const DeviceProfile& prof) {
  SEQPAR_CHECK(o.window == 0, "sp_plan: --window ", o.window, ": the windowed ring is not modelled");
  const SequenceLayout layout = sp_bench_layout(o);
  const int P = o.grid.ring_size, pu = o.grid.ulysses_size;
  const Links links = links_of(o, in, prof);
  const double slow = oversubscription(in, prof);
  MhaVolumeShape vs;
  vs.batch = o.batch;
  vs.padded_len = layout.padded_len();
  vs.heads = o.heads;
  vs.kv_heads = o.kv_heads;
  vs.head_dim = o.head_dim;
  vs.storage_bytes = static_cast<std::int64_t>(dtype_size(o.dtype));
  vs.accum_bytes = static_cast<std::int64_t>(dtype_size(accumulator_dtype(o.dtype)));
  vs.ring_size = P;
  vs.ulysses_size = pu;
  vs.impl = o.impl;
  const MhaVolume vol = mha_volume(vs);
  const double kv_block = P > 1 ? static_cast<double>(vol.ring_forward) / (P - 1) : 0.0;
  // The gradient blocks' bytes: seqpar's accumulator dtype, or the storage dtype (profile.ring_storage_dtype_gradients).
  const double grad_bytes = static_cast<double>(prof.ring_storage_dtype_gradients ? vs.storage_bytes : vs.accum_bytes);
  const double dkv_block = kv_block * grad_bytes / vs.storage_bytes;

  // The ring's per-step merge pass (DeviceProfile::ring_merge_pass), bytes at the memory bandwidth: forward, the
  // step's partial out (storage dtype) read and the running out (accumulator) read and written, the lse likewise;
  // backward, the step's dq read and the running dq read and written, and dk, dv into the travelling accumulator
  // (accumulator dtype throughout). Every step with work merges the rank's whole shard (B S / P rows, Hq / Pu heads).
  double merge_fwd_s = 0, merge_bwd_s = 0;
  if (prof.ring_merge_pass && P > 1) {
    const double rows = static_cast<double>(o.batch) * static_cast<double>(layout.padded_len()) / P;
    const double hq = static_cast<double>(o.heads) / pu,
                 hkv = static_cast<double>(std::max<std::int64_t>(o.kv_heads, pu)) / pu;
    const double e = static_cast<double>(vs.storage_bytes), a = grad_bytes,
                 l = static_cast<double>(vs.accum_bytes);  // the lse stays in the accumulator dtype
    const double fwd_bytes = rows * hq * (o.head_dim * (e + 2 * a) + 3 * l);
    const double bwd_bytes = rows * (hq + 2 * hkv) * o.head_dim * 3 * a;
    merge_fwd_s = slow * fwd_bytes / prof.memory_bandwidth_bps;
    merge_bwd_s = slow * bwd_bytes / prof.memory_bandwidth_bps;
  }
  // The all-gather's whole-sequence memory passes (profile.ring_merge_pass), E = elements of the gathered K (B S
  // Hkv / Pu D), storage bytes e: forward, K and V reordered after the gather (read, write: 4 e E); backward, the
  // same, dK and dV zeroed (2 e E), after each kernel call (zigzag: one per half of the local queries, else one)
  // the call's fp32 GQA accumulator zeroed and converted when query heads share a key head (2 (4 + 4 + e) E) and
  // its dK, dV added into the running ones (2 x 3 e E), and both reordered before the reduce-scatter (4 e E).
  double ag_pass_fwd_s = 0, ag_pass_bwd_s = 0;
  if (prof.ring_merge_pass && P > 1 && o.impl == RingImpl::kAllGather) {
    const double hq = static_cast<double>(o.heads) / pu,
                 hkv = static_cast<double>(std::max<std::int64_t>(o.kv_heads, pu)) / pu;
    const double E = static_cast<double>(o.batch) * static_cast<double>(layout.padded_len()) * hkv * o.head_dim;
    const double e = static_cast<double>(vs.storage_bytes);
    const double calls = o.layout == LayoutKind::kZigzag ? 2.0 : 1.0;
    const double per_call = 2 * 3 * e * E + (hq > hkv ? 2 * (8 + e) * E : 0.0);
    ag_pass_fwd_s = slow * 4 * e * E / prof.memory_bandwidth_bps;
    ag_pass_bwd_s = slow * (4 * e * E + 2 * e * E + calls * per_call + 4 * e * E) / prof.memory_bandwidth_bps;
  }
  const auto step_f = step_flops(o, layout, prof.mha_tile_pairs);  // forward, every head
  // profile.mha_tiles: the calls' tiles per document (zigzag_calls) instead of the curve at the FLOPs of a call.
  const bool tiles = prof.mha_tiles.present && (P == 1 || o.layout == LayoutKind::kZigzag);
  // profile.fa3_unpad_pad_pass: each call's gathers and scatters (and a p2p step's half reads) at the memory bandwidth.
  const bool unpad = prof.fa3_unpad_pad_pass && (P == 1 || o.layout == LayoutKind::kZigzag);
  // profile.ring_copy_passes: the ring function's copies over the rank's B S / P rows (ring_copy_pass_bytes).
  const bool copy_passes = prof.ring_copy_passes && o.impl == RingImpl::kP2P && (P > 1 || in.ring_function_at_one);
  const double copy_rows = static_cast<double>(o.batch) * static_cast<double>(layout.padded_len()) / P,
               hq_copy = static_cast<double>(o.heads) / pu,
               hkv_copy = static_cast<double>(std::max<std::int64_t>(o.kv_heads, pu)) / pu;
  const auto slot_cu = layout.slot_cu_seqlens();
  const int hq_rank = static_cast<int>(o.heads / pu),
            hkv_rank = static_cast<int>(std::max<std::int64_t>(o.kv_heads, pu) / pu);
  Prediction pr;
  pr.bytes_exact = true;
  pr.oversubscribed = slow > 1.0;
  // An all-to-all over a Ulysses group that spans nodes: of the pu - 1 peers, the node's own go over the intra link
  // and the rest over the inter link at the same time; the slower share decides.
  const auto a2a_s = [&](double bytes) {
    if (pu <= 1) return 0.0;
    if (links.ulysses_class == "intra" || in.devices_per_node <= 1)
      return 2 * (pu - 1) * links.ulysses.latency_s + bytes / links.ulysses.bandwidth_bps;
    const double local = std::min(pu, in.devices_per_node) - 1.0, remote = (pu - 1) - local;
    return 2 * (pu - 1) * links.ulysses.latency_s + std::max(bytes * local / (pu - 1) / prof.intra.bandwidth_bps,
                                                             bytes * remote / (pu - 1) / links.ulysses.bandwidth_bps);
  };
  for (int phase = 0; phase < (in.mode == "train" ? 2 : 1); ++phase) {
    const bool bwd = phase == 1;
    const KernelCurve& curve = prof.kernel(bwd ? "mha_bwd" : "mha_fwd");
    const double slow_k = kernel_slowdown(in, prof, bwd ? "mha_bwd" : "mha_fwd");  // the kernels (memory passes: slow)
    const double mult = bwd ? 2.5 : 1.0;
    std::vector<std::vector<double>> c(P, std::vector<double>(P));
    Phase ph;
    ph.compute.assign(P, 0.0);
    for (int r = 0; r < P; ++r) {
      for (int s = 0; s < P; ++s) {
        const double f = mult * step_f[r][s] / pu;  // one rank: its ring shard's pairs with H / Pu heads
        c[r][s] = f > 0 ? slow_k * f / curve.rate(f) : 0.0;
        if (f > 0 && tiles)
          c[r][s] = slow_k * o.batch *
                    tile_call_seconds(prof.mha_tiles, bwd, zigzag_calls(slot_cu, P, r, s, o.causal), hq_rank, hkv_rank,
                                      o.head_dim, curve.points.back().second);
        if (f > 0 && unpad) {
          const std::vector<TileSeq> calls = zigzag_calls(slot_cu, P, r, s, o.causal);
          const double e = static_cast<double>(vs.storage_bytes);
          c[r][s] += slow * o.batch *
                     (unpad_pad_bytes(bwd, calls, hq_rank, hkv_rank, o.head_dim, e) +
                      (P > 1 ? half_read_bytes(bwd, calls, hq_rank, hkv_rank, o.head_dim, e) : 0.0)) /
                     prof.memory_bandwidth_bps;
        }
        // Every later step with work folds its partial result into the running one (profile.ring_merge_pass).
        if (s > 0 && f > 0 && o.impl == RingImpl::kP2P) c[r][s] += bwd ? merge_bwd_s : merge_fwd_s;
        // The ring function's copies (profile.ring_copy_passes; a ring of one only with in.ring_function_at_one).
        if (copy_passes && (s == 0 || f > 0))
          c[r][s] += slow *
                     ring_copy_pass_bytes(bwd, s == 0, copy_rows, hq_copy, hkv_copy, o.head_dim,
                                          static_cast<double>(vs.storage_bytes), grad_bytes,
                                          static_cast<double>(vs.accum_bytes)) /
                     prof.memory_bandwidth_bps;
      }
    }
    double a2a = a2a_s(static_cast<double>(bwd ? vol.a2a_backward : vol.a2a_forward));
    // profile.ulysses_layout_pass: each crossing tensor (B S / (P Pu) local rows of all its heads; K and V with
    // max(Hkv, Pu) heads) copied into the all-to-all's layout and out of it, read and written; the output (forward
    // out, backward dout) only on the token-major side (it leaves the kernel in the all-to-all's layout): 2 e x rows
    // x D x (3 Hq + 4 Hkv), both phases alike.
    if (prof.ulysses_layout_pass && pu > 1) {
      const double rows = static_cast<double>(o.batch) * static_cast<double>(layout.padded_len()) / (P * pu);
      a2a += slow * 2.0 * static_cast<double>(vs.storage_bytes) * rows * o.head_dim *
             (3.0 * o.heads + 4.0 * hkv_rank * pu) / prof.memory_bandwidth_bps;
    }
    if (o.impl == RingImpl::kP2P || P == 1) {
      std::vector<double> exposed;
      const double transfer = links.ring.seconds(bwd ? kv_block + dkv_block : kv_block);
      ph.finish = simulate_ring(c, transfer, &exposed, prof.ring_transfer_overlaps_compute);
      for (int r = 0; r < P; ++r) {
        ph.compute[r] = std::accumulate(c[r].begin(), c[r].end(), 0.0);
        // Backward: the gradient accumulator's last hop home follows the last step.
        ph.finish[r] += a2a + (bwd && P > 1 ? links.ring.seconds(dkv_block) : 0.0);
      }
    } else {
      // All-gather of K and V (ring algorithm, P - 1 steps: allgather_seconds), one kernel call over the whole
      // sequence; the backward gathers again and reduce-scatters dK, dV.
      const int members = in.devices_per_node % pu == 0 ? std::max(1, in.devices_per_node / pu) : 1;
      const double gather = allgather_seconds(kv_block, P, members, in.devices_per_node, prof);
      const double scatter = bwd ? allgather_seconds(dkv_block, P, members, in.devices_per_node, prof) : 0.0;
      ph.finish.assign(P, 0.0);
      for (int r = 0; r < P; ++r) {
        double f = 0;
        for (int s = 0; s < P; ++s) f += mult * step_f[r][s] / pu;
        ph.compute[r] = f > 0 ? slow_k * f / curve.rate(f) : 0.0;
        if (f > 0 && tiles) {
          const std::vector<TileSeq> halves = zigzag_calls(slot_cu, P, r, -1, o.causal);
          ph.compute[r] =
              slow_k * o.batch *
              tile_call_seconds(prof.mha_tiles, bwd, halves, hq_rank, hkv_rank, o.head_dim, curve.points.back().second);
        }
        if (f > 0 && unpad) {
          // Each half's wrappers, and its queries read out of the local ones before the call and its output
          // collected back after it (forward q in, out back: 4 e; backward q and dout in, dq back: 6 e per element
          // of the half's Q rows x Hq x D). The backward's dk and dv are zero-filled at the gathered K's rows (the
          // whole padded row), not the call's K rows: 2 e Hkv D (padded length - K rows) more per half.
          const std::vector<TileSeq> halves = zigzag_calls(slot_cu, P, r, -1, o.causal);
          const double e = static_cast<double>(vs.storage_bytes);
          double q_rows = 0, k_rows = 0;
          for (const TileSeq& t : halves) {
            q_rows += static_cast<double>(t.q_len);
            k_rows += static_cast<double>(t.k_len);
          }
          const double whole = static_cast<double>(halves.empty() ? 0 : 2) * static_cast<double>(layout.padded_len());
          ph.compute[r] += slow * o.batch *
                           (unpad_pad_bytes(bwd, halves, hq_rank, hkv_rank, o.head_dim, e) +
                            (bwd ? 6.0 : 4.0) * e * q_rows * hq_rank * o.head_dim +
                            (bwd ? 2.0 * e * hkv_rank * o.head_dim * std::max(0.0, whole - k_rows) : 0.0)) /
                           prof.memory_bandwidth_bps;
        }
        ph.finish[r] = a2a + gather + ph.compute[r] + (bwd ? ag_pass_bwd_s : ag_pass_fwd_s) + scatter;
      }
    }
    double phase_s = 0;
    add_phase(pr, ph, &phase_s);
    (bwd ? pr.backward_s : pr.forward_s) = phase_s;
    (bwd ? pr.bytes_sent_backward : pr.bytes_sent_forward) = static_cast<double>(bwd ? vol.backward() : vol.forward());
    pr.bytes_per_link[links.ring_class] += static_cast<double>(bwd ? vol.ring_backward : vol.ring_forward);
    pr.bytes_per_link[links.ulysses_class] += static_cast<double>(bwd ? vol.a2a_backward : vol.a2a_forward);
  }
  return pr;
}

// ---- GDN: chain or scan over the segments of the ring, heads over Ulysses ----

// One rank's work ahead (GdnCp's AheadQueue): the windows that will wait for a state from another rank, in the order
// they run. While the rank waits it computes the state-independent part of the first window not done ahead (that
// window's time x `ahead` for all its chunks), at most kGdnAheadMaxWindows windows made ahead and not yet run, their
// buffers under kGdnAheadBudgetBytes (the first always fits); a window then costs its time x (done x rest + (1 -
// done)), done the share of its chunks computed ahead.
class GdnAheadSim {
 public:
  GdnAheadSim(double ahead, double rest) : ahead_(ahead), rest_(rest) {}
  void add(int seg, std::size_t head, double window_s, double bytes) {
    if (ahead_ <= 0 || window_s <= 0) return;
    index_[{seg, head}] = items_.size();
    items_.push_back({window_s, bytes});
    keys_.push_back({seg, head});
  }
  // The last window added is worked on first (GdnCp's forward with the last waiting window ahead first).
  void last_first() {
    if (items_.size() < 2) return;
    std::rotate(items_.begin(), items_.end() - 1, items_.end());
    std::rotate(keys_.begin(), keys_.end() - 1, keys_.end());
    for (std::size_t i = 0; i < items_.size(); ++i) index_[keys_[i]] = i;
  }
  // Works ahead for up to `seconds` of idle time; returns the seconds worked.
  double idle(double seconds) {
    double worked = 0;
    while (seconds > worked && next_ < items_.size()) {
      Item& it = items_[next_];
      if (it.used || it.done >= 1.0) {
        ++next_;
        continue;
      }
      if (!it.made) {
        if (held_windows_ > 0 &&
            (held_windows_ >= kGdnAheadMaxWindows || held_bytes_ + it.bytes > static_cast<double>(kGdnAheadBudgetBytes)))
          break;
        it.made = true;
        ++held_windows_;
        held_bytes_ += it.bytes;
      }
      const double full = ahead_ * it.window_s, step = std::min(seconds - worked, (1.0 - it.done) * full);
      it.done += step / full;
      worked += step;
      if (it.done >= 1.0 - 1e-12) it.done = 1.0;
    }
    return worked;
  }
  // The time of window (seg, head) now, given what was done ahead (its full time when not queued); it is then used.
  double run(int seg, std::size_t head, double window_s) {
    const auto f = index_.find({seg, head});
    if (f == index_.end()) return window_s;
    Item& it = items_[f->second];
    if (it.used) return window_s;
    it.used = true;
    if (it.made) {
      --held_windows_;
      held_bytes_ -= it.bytes;
    }
    return window_s * (it.done * rest_ + (1.0 - it.done));
  }

 private:
  struct Item {
    double window_s, bytes, done = 0;
    bool made = false, used = false;
  };
  double ahead_, rest_;
  std::vector<Item> items_;
  std::map<std::pair<int, std::size_t>, std::size_t> index_;
  std::vector<std::pair<int, std::size_t>> keys_;  // of items_, in their order
  std::size_t next_ = 0;
  std::int64_t held_windows_ = 0;
  double held_bytes_ = 0;
};

Prediction predict_gdn(const SpBenchOptions& o, const PlanInput& in, const DeviceProfile& prof) {
  const SequenceLayout layout = sp_bench_layout(o);
  const int P = o.grid.ring_size, pu = o.grid.ulysses_size;
  const Links links = links_of(o, in, prof);
  const double slow = oversubscription(in, prof);
  const std::int64_t hv = o.heads / pu, hk = std::max<std::int64_t>(1, o.kv_heads / pu), K = o.head_dim,
                     V = o.dim_v > 0 ? o.dim_v : o.head_dim;
  std::vector<std::vector<std::int64_t>> tokens(P);
  for (int r = 0; r < P; ++r) {
    const std::vector<std::int64_t> slots = layout.ring_shard_positions(r);
    tokens[r] = layout.tokens_of_slots(slots);
  }
  const std::vector<Segment> segs = segments_in_global_order(tokens);
  const std::vector<std::int64_t> cu(layout.cu_seqlens().begin(), layout.cu_seqlens().end());
  std::vector<std::vector<SegmentPiece>> pieces;
  for (const Segment& seg : segs) pieces.push_back(segment_pieces(seg, cu));
  const GdnScanPlan plan_fwd = gdn_scan_plan(pieces, +1), plan_bwd = gdn_scan_plan(pieces, -1);
  const double state_esize = o.dtype == DType::kFloat64 ? 8.0 : 4.0;
  const double state_bytes = static_cast<double>(o.batch * hv * K * V) * state_esize;
  const double map_bytes = static_cast<double>(o.batch * hv * K * (K + V)) * state_esize;
  const auto seg_flops = [&](std::int64_t len) {
    GdnFlopShape f{o.batch, len, hv, K, V, o.chunk_size, o.conv_width, (2 * hk * K + hv * V)};
    return gdn_forward_flops(f);
  };
  // Ulysses: q, k (Hk K), v (Hv V), g, beta (Hv) in and out (Hv V) back; the backward the gradients.
  const double s_local = static_cast<double>(layout.local_len());
  // Key heads fewer than Pu travel replicated to Pu heads (ulysses_kv_heads), their gradients back in the
  // accumulator dtype (as MHA's KV heads).
  const double e = static_cast<double>(dtype_size(o.dtype));
  const double hk_e = static_cast<double>(ulysses_kv_heads(o.kv_heads, pu));
  const double qk_grad_e = o.kv_heads % pu == 0 ? e : static_cast<double>(dtype_size(accumulator_dtype(o.dtype)));
  const auto a2a_bytes_of = [&](double qk_e) {
    return pu > 1 ? static_cast<double>(o.batch) * s_local *
                        (2.0 * hk_e * K * qk_e + (2.0 * o.heads * V + 2.0 * o.heads) * e) * (pu - 1) / pu
                  : 0.0;
  };
  const double a2a_bytes = a2a_bytes_of(e);
  const double a2a_s = pu > 1 ? 2 * (pu - 1) * links.ulysses.latency_s + a2a_bytes / links.ulysses.bandwidth_bps : 0.0;
  // final_state (forward) and dinitial_state (backward), every head's, all-gathered over the Ulysses group.
  const double state_gather_bytes = pu > 1 ? state_bytes * (pu - 1) : 0.0;
  // One ring rank holds every segment: nothing is passed, the scan computes no maps (it runs as the chain does).
  const bool chain = o.gdn_mode == "chain" || P == 1;
  Prediction pr;
  pr.oversubscribed = slow > 1.0;
  pr.bytes_exact = !o.packed();  // packed rows: the chain's document restarts and state gathers not modelled
  const int nseg = static_cast<int>(segs.size());
  const double H = static_cast<double>(std::max<std::int64_t>(1, hv));
  // A segment's map and the composition of two (gdn_map_flops, gdn_compose_flops), at the forward curve's rate.
  const double compose_flops = gdn_compose_flops(GdnFlopShape{o.batch, 0, hv, K, V, o.chunk_size, 0, 0});
  // Work ahead: the profile's shares (none without them), and the buffer of one value head's window of segment i
  // (attn::gdn_ahead_bytes: per chunk C (3 K + V + C + 1) values forward, K V backward, in the compute dtype).
  const DeviceProfile::GdnWorkAhead& wa = prof.gdn_work_ahead;
  const auto ahead_bytes = [&](int i, bool backward) {
    const double C = static_cast<double>(std::max<std::int64_t>(1, o.chunk_size));
    const double chunks = std::ceil(static_cast<double>(segs[i].length) / C);
    const double per_chunk = backward ? static_cast<double>(K * V) : C * (3.0 * K + V + C + 1);
    return static_cast<double>(o.batch) * chunks * per_chunk * (o.dtype == DType::kFloat64 ? 8.0 : 4.0);
  };
  for (int phase = 0; phase < (in.mode == "train" ? 2 : 1); ++phase) {
    const bool bwd = phase == 1;
    const KernelCurve& fcurve = prof.kernel("gdn_fwd");
    const KernelCurve& curve = prof.kernel(bwd ? "gdn_bwd" : "gdn_fwd");
    // The forward curve's terms (forward, maps, compositions, the sweep) slow as gdn_fwd, the backward's as gdn_bwd.
    const double slow_f = kernel_slowdown(in, prof, "gdn_fwd"), slow_b = kernel_slowdown(in, prof, "gdn_bwd");
    // Per segment (all this rank's value heads, as one kernel call would run them): its kernel, its map (the
    // forward: gdn_transition; the backward: the dS sweep, plus gdn_transition when the forward made no map).
    // A segment's kernel splits into the pieces that start a document (the backward: end one), which run as soon
    // as the phase starts, and the piece that waits for the state of the segment before it (known_s, wait_s).
    std::vector<double> seg_s(nseg), map_s(nseg), known_s(nseg, 0.0), wait_s(nseg, 0.0);
    for (int i = 0; i < nseg; ++i) {
      const double f = seg_flops(segs[i].length);
      const double fwd_s = f > 0 ? slow_f * f / fcurve.rate(f) : 0.0;
      for (const SegmentPiece& pc : pieces[i]) {
        const double pf = seg_flops(pc.length);
        const double ps =
            pf > 0 ? (bwd ? slow_b : slow_f) * (bwd ? 2.5 * pf / curve.rate(2.5 * f) : pf / fcurve.rate(f)) : 0.0;
        ((bwd ? pc.ends_doc : pc.starts_doc) ? known_s[i] : wait_s[i]) += ps;
      }
      const double mf = gdn_map_flops(GdnFlopShape{o.batch, segs[i].length, hv, K, V, o.chunk_size, 0, 0});
      const double transition_s = f > 0 ? slow_f * prof.gdn_map_factor * mf / fcurve.rate(f) : 0.0;
      seg_s[i] = bwd ? (f > 0 ? slow_b * 2.5 * f / curve.rate(2.5 * f) : 0.0) : fwd_s;
      map_s[i] = bwd ? prof.gdn_sweep_factor * fwd_s + (plan_fwd.computes_map(i) ? 0.0 : transition_s) : transition_s;
    }
    const double compose_s = slow_f * compose_flops / fcurve.rate(compose_flops);
    Phase ph;
    ph.compute.assign(P, 0.0);
    std::vector<double> clock(P, a2a_s / 2);  // the all-to-all in (half its time) before, out after
    double ring_bytes_max = 0;
    std::vector<double> sent(P, 0.0);
    // GdnCp runs one value head at a time (a window of the heads-layout tensors) and sends each head's state or map
    // as soon as it is final, so the next segment's owner starts head h while this one runs head h + 1. Each rank
    // works through its own list in the runtime's order; a head's step starts when the rank is free and its
    // messages have arrived.
    const auto order = [&](int k) { return bwd ? nseg - 1 - k : k; };
    if (chain) {
      // Each of a rank's segments in global order (the backward in reverse), heads 0 .. H-1 within; segment i's
      // head h waits for the end state of head h of the segment before it (a message when another rank owns it).
      const double head_msg = links.ring.seconds(state_bytes / H);
      std::vector<std::vector<double>> end(nseg, std::vector<double>(static_cast<std::size_t>(H), 0.0));
      // Work ahead for the windows whose state comes from another rank (the piece that waits), in the order they run.
      std::vector<GdnAheadSim> ahead(P, GdnAheadSim(bwd ? wa.bwd_ahead : wa.fwd_ahead, bwd ? wa.bwd_rest : wa.fwd_rest));
      for (int k = 1; k < nseg; ++k) {
        const int i = order(k), prev = order(k - 1);
        if (segs[prev].owner == segs[i].owner) continue;
        for (std::size_t h = 0; h < end[i].size(); ++h) ahead[segs[i].owner].add(i, h, wait_s[i] / H, ahead_bytes(i, bwd));
      }
      if (!bwd && kPlanGdnAheadLastFirst)
        for (GdnAheadSim& a : ahead) a.last_first();
      for (int k = 0; k < nseg; ++k) {
        const int i = order(k), owner = segs[i].owner;
        const int prev = k > 0 ? order(k - 1) : -1;
        const bool remote = prev >= 0 && segs[prev].owner != owner;
        if (remote) sent[segs[prev].owner] += state_bytes;
        for (std::size_t h = 0; h < end[i].size(); ++h) {
          const double ready = prev >= 0 ? end[prev][h] + (remote ? head_msg : 0.0) : 0.0;
          if (ready > clock[owner]) ph.compute[owner] += ahead[owner].idle(ready - clock[owner]);
          const double work = (seg_s[i] - wait_s[i]) / H + ahead[owner].run(i, h, wait_s[i] / H);
          clock[owner] = std::max(clock[owner], ready) + work;
          ph.compute[owner] += work;
          end[i][h] = clock[owner];
        }
      }
    } else {
      // The scan (run_scan): phase 1 (each segment's map, or its run when its start is known), the Kogge-Stone
      // rounds (a composition, or in round 1 a direct segment's run), the shift (each segment's run from the state
      // it receives), every stage head by head; round r's messages of head h leave when their sender has finished
      // head h of round r - 1, the shift's when their sender's last one of them is final (GdnScanPlan::ready).
      const int dir = bwd ? -1 : +1;
      const GdnScanPlan& sp = bwd ? plan_bwd : plan_fwd;
      const int R = sp.rounds, stages = R + 2;
      const std::size_t nh = static_cast<std::size_t>(H);
      // posted[r][stage][h]: when rank r finished head h of a stage.
      std::vector<std::vector<std::vector<double>>> posted(
          P, std::vector<std::vector<double>>(stages, std::vector<double>(nh, 0.0)));
      const auto in_range = [&](int i) { return i >= 0 && i < nseg; };
      // Bytes of one head's message from rank a to rank b in round r (packed: one message per peer) and the shift.
      std::vector<std::vector<std::vector<double>>> round_bytes(
          R + 1, std::vector<std::vector<double>>(P, std::vector<double>(P, 0.0)));
      std::vector<std::vector<double>> shift_bytes(P, std::vector<double>(P, 0.0));
      std::vector<std::vector<int>> shift_stage(P, std::vector<int>(P, 0));
      for (int r = 1, off = 1; r <= R; ++r, off *= 2) {
        for (int i = 0; i < nseg; ++i) {
          const int to = i + dir * off;
          if (in_range(to) && segs[i].owner != segs[to].owner && sp.composes(r, to)) {
            round_bytes[r][segs[i].owner][segs[to].owner] += map_bytes / H;
            sent[segs[i].owner] += map_bytes;
          }
        }
      }
      for (int i = 0; i < nseg; ++i) {
        const int to = i + dir;
        if (in_range(to) && segs[i].owner != segs[to].owner && sp.shifts(i, dir)) {
          shift_bytes[segs[i].owner][segs[to].owner] += state_bytes / H;
          shift_stage[segs[i].owner][segs[to].owner] =
              std::max(shift_stage[segs[i].owner][segs[to].owner], sp.ready[i]);
          sent[segs[i].owner] += state_bytes;
        }
      }
      // Work ahead (GdnCp::add_scan_waits): the windows that run from a state another rank sends, the direct
      // segments' (round 1) first, then the shift's, each head-major.
      std::vector<GdnAheadSim> ahead(P, GdnAheadSim(bwd ? wa.bwd_ahead : wa.fwd_ahead, bwd ? wa.bwd_rest : wa.fwd_rest));
      const auto waits_remote = [&](int i, bool direct_stage) {
        const int from = i - dir;
        if (!in_range(from) || segs[from].owner == segs[i].owner || wait_s[i] <= 0) return false;
        return direct_stage ? static_cast<bool>(sp.direct[i]) : sp.need[R][from] && !sp.direct[i];
      };
      for (const bool direct_stage : {true, false}) {
        for (std::size_t h = 0; h < nh; ++h) {
          for (int i = 0; i < nseg; ++i) {
            if (waits_remote(i, direct_stage)) ahead[segs[i].owner].add(i, h, wait_s[i] / H, ahead_bytes(i, bwd));
          }
        }
      }
      if (!bwd && kPlanGdnAheadLastFirst)
        for (GdnAheadSim& a : ahead) a.last_first();
      for (int stage = 0; stage < stages; ++stage) {
        for (std::size_t h = 0; h < nh; ++h) {
          for (int rank = 0; rank < P; ++rank) {
            double ready = 0, work = 0;
            std::vector<int> waiting;  // this step's windows that may have been worked on ahead
            for (int i = 0; i < nseg; ++i) {
              if (segs[i].owner != rank) continue;
              if (stage == 0) {  // phase 1
                if (sp.known[0][i])
                  work += known_s[i] / H;
                else if (sp.computes_map(i))
                  work += map_s[i] / H;
              } else if (stage <= R) {  // round `stage`
                if (!sp.composes(stage, i)) continue;
                const int from = i - dir * (1 << (stage - 1));
                if (!in_range(from)) continue;
                const int src = segs[from].owner;
                if (src != rank)
                  ready = std::max(ready, posted[src][stage - 1][h] + links.ring.seconds(round_bytes[stage][src][rank]));
                if (stage == 1 && sp.direct[i])
                  waiting.push_back(i);
                else
                  work += compose_s / H;
              } else {  // the shift
                const int from = i - dir;
                if (!in_range(from) || sp.direct[i] || !sp.need[R][from]) continue;
                const int src = segs[from].owner;
                if (src != rank)
                  ready = std::max(ready, posted[src][shift_stage[src][rank]][h] +
                                              links.ring.seconds(shift_bytes[src][rank]));
                waiting.push_back(i);
              }
            }
            if (ready > clock[rank]) ph.compute[rank] += ahead[rank].idle(ready - clock[rank]);
            for (const int i : waiting) work += ahead[rank].run(i, h, wait_s[i] / H);
            clock[rank] = std::max(clock[rank], ready) + work;
            ph.compute[rank] += work;
            posted[rank][stage][h] = clock[rank];
          }
        }
      }
    }
    ph.finish = clock;
    for (int r = 0; r < P; ++r) {
      ph.finish[r] += a2a_s / 2;
      ring_bytes_max = std::max(ring_bytes_max, sent[r]);
    }
    double phase_s = 0;
    add_phase(pr, ph, &phase_s);
    (bwd ? pr.backward_s : pr.forward_s) = phase_s;
    const double a2a_phase = bwd ? a2a_bytes_of(qk_grad_e) : a2a_bytes;
    (bwd ? pr.bytes_sent_backward : pr.bytes_sent_forward) = ring_bytes_max + a2a_phase + state_gather_bytes;
    pr.bytes_per_link[links.ring_class] += ring_bytes_max;
    pr.bytes_per_link[links.ulysses_class] += a2a_phase + state_gather_bytes;
  }
  return pr;
}

// ---- DSA: index keys around the CP group (or gathered), latent blocks around the ring ----

Prediction predict_dsa(const SpBenchOptions& o, const PlanInput& in, const DeviceProfile& prof) {
  const SequenceLayout layout = sp_bench_layout(o);
  const int P = o.grid.ring_size, pu = o.grid.ulysses_size, cp = P * pu;
  const Links links = links_of(o, in, prof);
  LinkClass cp_link = links.ring;  // the selection ring runs over the whole CP group
  if (links.ulysses_class == "inter") cp_link = links.ulysses;
  const double slow = oversubscription(in, prof);
  const std::vector<std::int64_t> cu(layout.cu_seqlens().begin(), layout.cu_seqlens().end());
  const SequenceLayout cp_layout =
      o.packed() ? SequenceLayout::packed(o.layout, cu, cp, 1) : SequenceLayout(o.layout, o.seq, cp, 1);
  const DsaFlopShape fs = {
      o.batch,         o.seq,         o.heads, o.head_dim, o.dim_v > 0 ? o.dim_v : o.head_dim,
      o.indexer_heads, o.indexer_dim, o.topk,  o.window,   o.packed() ? o.doc_lens : std::vector<std::int64_t>{}};
  const double e = static_cast<double>(dtype_size(o.dtype)),
               acc = static_cast<double>(dtype_size(accumulator_dtype(o.dtype)));
  const double s_local = static_cast<double>(layout.local_len()), s_ring = static_cast<double>(layout.ring_shard_len());
  const double kidx_block = static_cast<double>(o.batch) * s_local * o.indexer_dim * e;
  const double latent_block = static_cast<double>(o.batch) * s_ring * o.head_dim * e;
  // Ulysses: q to heads (all-to-all) and the ring shard's latent and indices gathered; back: out.
  const double a2a_bytes = pu > 1 ? static_cast<double>(o.batch) * s_local * (pu - 1) *
                                        ((2.0 * o.heads * o.head_dim) / pu * e + o.head_dim * e + o.topk * 8.0)
                                  : 0.0;
  const double a2a_s = pu > 1 ? 2 * (pu - 1) * links.ulysses.latency_s + a2a_bytes / links.ulysses.bandwidth_bps : 0.0;
  const auto cp_share = step_shares(cp_layout, true);
  const auto ring_share = step_shares(layout, true);
  Prediction pr;
  pr.oversubscribed = slow > 1.0;
  for (int phase = 0; phase < (in.mode == "train" ? 2 : 1); ++phase) {
    const bool bwd = phase == 1;
    const KernelCurve& curve = prof.kernel(bwd ? "dsa_bwd" : "dsa_fwd");
    const double slow_k = kernel_slowdown(in, prof, bwd ? "dsa_bwd" : "dsa_fwd");
    const double idx_flops = bwd ? dsa_selected_pairs(fs) * 3.0 * dsa_indexer_flops_per_pair(fs)
                                 : dsa_visible_pairs(fs) * dsa_indexer_flops_per_pair(fs);
    const double att_flops = dsa_selected_pairs(fs) * (bwd ? 2.5 : 1.0) * dsa_attention_flops_per_pair(fs);
    // Selection / index-key ring over the CP group, then the latent ring over the ring group.
    std::vector<std::vector<double>> ci(cp, std::vector<double>(cp)), ca(P, std::vector<double>(P));
    for (int r = 0; r < cp; ++r)
      for (int s = 0; s < cp; ++s) {
        const double f = idx_flops * cp_share[r][s];
        ci[r][s] = f > 0 ? slow_k * f / curve.rate(f) : 0.0;
      }
    for (int r = 0; r < P; ++r)
      for (int s = 0; s < P; ++s) {
        const double f = att_flops * ring_share[r][s] / pu;
        ca[r][s] = f > 0 ? slow_k * f / curve.rate(f) : 0.0;
      }
    std::vector<double> fi, fa, ex;
    double idx_bytes = 0;
    if (o.dsa_select == "allgather" && !bwd) {
      fi.assign(cp, (cp - 1) * cp_link.seconds(kidx_block));
      for (int r = 0; r < cp; ++r) fi[r] += std::accumulate(ci[r].begin(), ci[r].end(), 0.0);
      idx_bytes = (cp - 1) * kidx_block;
    } else {
      const double blk = bwd ? kidx_block * (1 + acc / e) : kidx_block;
      fi = simulate_ring(ci, cp_link.seconds(blk), &ex, prof.ring_transfer_overlaps_compute);
      idx_bytes = (cp - 1) * blk + (bwd ? kidx_block * acc / e : 0.0);
    }
    const double lat_blk = bwd ? latent_block * (1 + acc / e) : latent_block;
    fa = simulate_ring(ca, links.ring.seconds(lat_blk), &ex, prof.ring_transfer_overlaps_compute);
    const double lat_bytes = (P - 1) * lat_blk + (bwd && P > 1 ? latent_block * acc / e : 0.0);
    Phase ph;
    ph.finish.assign(P, 0.0);
    ph.compute.assign(P, 0.0);
    const double idx_done = *std::max_element(fi.begin(), fi.end());
    for (int r = 0; r < P; ++r) {
      double ci_r = 0;
      for (int u = 0; u < pu; ++u)
        ci_r = std::max(ci_r, std::accumulate(ci[r * pu + u].begin(), ci[r * pu + u].end(), 0.0));
      ph.compute[r] = ci_r + std::accumulate(ca[r].begin(), ca[r].end(), 0.0);
      ph.finish[r] = a2a_s + idx_done + fa[r];
    }
    double phase_s = 0;
    add_phase(pr, ph, &phase_s);
    (bwd ? pr.backward_s : pr.forward_s) = phase_s;
    (bwd ? pr.bytes_sent_backward : pr.bytes_sent_forward) = idx_bytes + lat_bytes + a2a_bytes;
    pr.bytes_per_link[links.ring_class] += lat_bytes + idx_bytes;
    pr.bytes_per_link[links.ulysses_class] += a2a_bytes;
  }
  return pr;
}

// ---- MHA decode: each rank attends the step's queries to its cache shard, the shards merge over the ring ----

// Tokens of ring rank r among the first `len` of a cache sharded like CacheSharding (parallel/decode_cp.h):
// contiguous blocks of ceil(capacity / P), or token t on rank (t / I) mod P.
double shard_tokens(const DecodeOptions& d, std::int64_t capacity, std::int64_t len, int P, int r) {
  if (d.cache_shard == "contiguous") {
    const std::int64_t blk = (capacity + P - 1) / P;
    return static_cast<double>(std::clamp<std::int64_t>(len - r * blk, 0, blk));
  }
  const std::int64_t I = std::max<std::int64_t>(1, d.interleave), period = I * P;
  const std::int64_t full = len / period, rest = len % period;
  return static_cast<double>(full * I + std::clamp<std::int64_t>(rest - r * I, 0, I));
}

Prediction predict_mha_decode(const SpBenchOptions& o, const PlanInput& in, const DeviceProfile& prof) {
  const DecodeOptions& d = o.decode;
  const int P = o.grid.ring_size, pu = o.grid.ulysses_size;
  const Links links = links_of(o, in, prof);
  const double slow = oversubscription(in, prof);
  const std::int64_t capacity = d.context + d.chunk + d.decode_steps * d.new_tokens;
  // The step in the middle of the run: the cache holds the prompt, the chunk and half the steps' tokens.
  const std::int64_t len = d.context + d.chunk + d.decode_steps * d.new_tokens / 2;
  const double e = static_cast<double>(dtype_size(o.dtype)),
               acc = static_cast<double>(dtype_size(accumulator_dtype(o.dtype)));
  const double hq = static_cast<double>(o.heads / pu),
               hkv = static_cast<double>(std::max<std::int64_t>(o.kv_heads, pu) / pu);
  const KernelCurve& curve = prof.kernel("mha_fwd");
  Prediction pr;
  pr.bytes_exact = true;
  pr.oversubscribed = slow > 1.0;
  std::vector<double> c(P);
  for (int r = 0; r < P; ++r) {
    const double t = shard_tokens(d, capacity, len, P, r) + d.new_tokens;  // the step's own tokens, on every rank
    const double flops = 4.0 * o.batch * d.new_tokens * hq * o.head_dim * t;
    const double bytes = 2.0 * o.batch * t * hkv * o.head_dim * e;  // the shard's K and V, read once
    // The larger of the FLOPs at the attention curve and the fixed cost plus the bytes at the memory bandwidth.
    double s = flops > 0 ? flops / curve.rate(flops) : 0.0;
    if (prof.memory_bandwidth_bps > 0) s = std::max(s, prof.decode_overhead_s + bytes / prof.memory_bandwidth_bps);
    c[r] = slow * s;
  }
  // The merge: one all-gather of every rank's (out, lse hi/lo) over the ring group (ring algorithm, P - 1 hops).
  const double block = static_cast<double>(o.batch) * d.new_tokens * hq * (o.head_dim + 2) * acc;
  const double merge = P > 1 ? (P - 1) * links.ring.seconds(block) : 0.0;
  const double slowest = *std::max_element(c.begin(), c.end());
  const double mean = std::accumulate(c.begin(), c.end(), 0.0) / P;
  pr.compute_s = slowest;
  pr.exposed_comm_s = merge;
  pr.imbalance_s = slowest - mean;
  pr.step_s = pr.forward_s = slowest + merge;
  pr.bytes_sent_forward = P > 1 ? (P - 1) * block : 0.0;
  pr.bytes_per_link[links.ring_class] += pr.bytes_sent_forward;
  return pr;
}

// The linear layers of a model (PlanInput::layers, linear_flops_per_token): every rank's own tokens, no
// communication, at the "gemm" curve; forward F per token, backward 2 F. Then the layer's time times the layers.
void add_linear_layers(Prediction& pr, const SpBenchOptions& o, const PlanInput& in, const DeviceProfile& prof) {
  if (in.linear_flops_per_token > 0) {
    const double tokens = static_cast<double>(o.batch) * static_cast<double>(sp_bench_padded_len(o)) /
                          (o.grid.ring_size * o.grid.ulysses_size);
    const double f = in.linear_flops_per_token / in.tp * tokens;
    const KernelCurve& g = prof.kernel("gemm");
    const double fwd = f / g.rate(f), bwd = in.mode == "train" ? 2 * f / g.rate(2 * f) : 0.0;
    pr.linear_s = fwd + bwd;
    pr.forward_s += fwd;
    pr.backward_s += bwd;
    pr.step_s += fwd + bwd;
    pr.compute_s += fwd + bwd;
  }
  const double L = in.layers;
  for (double* x : {&pr.step_s, &pr.compute_s, &pr.exposed_comm_s, &pr.imbalance_s, &pr.forward_s, &pr.backward_s,
                    &pr.linear_s, &pr.bytes_sent_forward, &pr.bytes_sent_backward})
    *x *= L;
  for (auto& [k, v] : pr.bytes_per_link) v *= L;
}

}  // namespace

Prediction predict(const SpBenchOptions& o, const PlanInput& in, const DeviceProfile& profile) {
  if (in.mode == "decode") {
    SEQPAR_CHECK(o.attn == "mha", "sp_plan: --mode decode models --attn mha only (not ", o.attn, ")");
    return predict_mha_decode(o, in, profile);
  }
  Prediction pr;
  if (o.attn == "mha")
    pr = predict_mha(o, in, profile);
  else if (o.attn == "gdn")
    pr = predict_gdn(o, in, profile);
  else if (o.attn == "dsa")
    pr = predict_dsa(o, in, profile);
  else
    SEQPAR_THROW("sp_plan: --attn ", o.attn, " is not modelled (mha, gdn, dsa)");
  add_linear_layers(pr, o, in, profile);
  return pr;
}

// ---- enumeration ------------------------------------------------------------------------------------------------

namespace {

// The problem parsed as sp_bench does at one rank with no grid flags.
SpBenchOptions problem_options(const std::vector<std::string>& flags) {
  std::vector<std::string> args = {"sp_bench"};
  args.insert(args.end(), flags.begin(), flags.end());
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  const std::optional<SpBenchOptions> o =
      parse_sp_bench_options(static_cast<int>(argv.size()), argv.data(), 1, 1, kPlanProblemHasNoGrid);
  SEQPAR_CHECK(o.has_value(), "sp_plan: --help is not a problem flag");
  return *o;
}

// The problem alone (with --mode decode when planning a decode step: its flags need it).
SpBenchOptions problem_options(const PlanInput& in) {
  std::vector<std::string> f = in.problem_flags;
  if (in.mode == "decode") f.insert(f.end(), {"--mode", "decode"});
  return problem_options(f);
}

std::string attn_of(const PlanInput& in) { return problem_options(in).attn; }

std::vector<std::string> problem_args(const PlanInput& in) {
  std::vector<std::string> f = in.problem_flags;
  if (in.tp > 1) {
    const SpBenchOptions o = problem_options(in);
    SEQPAR_CHECK(o.heads % in.tp == 0 && o.kv_heads % in.tp == 0, "sp_plan: --tp ", in.tp, " must divide --heads ",
                 o.heads, " and --kv-heads ", o.kv_heads, " (tensor parallelism splits whole heads)");
    f.insert(f.end(), {"--heads", std::to_string(o.heads / in.tp), "--kv-heads", std::to_string(o.kv_heads / in.tp)});
  }
  return f;
}

std::string command_of(const PlanInput& in, const PlanConfig& c) {
  std::string s = str_cat("mpirun -np ", in.world_size, " ", in.sp_bench);
  for (const std::string& f : problem_args(in)) s += " " + f;
  for (const std::string& f : c.flags()) s += " " + f;
  if (in.threads != 1) s += str_cat(" --threads ", in.threads);
  return s;
}

}  // namespace

std::vector<PlanRow> plan(const PlanInput& in, const DeviceProfile& profile) {
  SEQPAR_CHECK(in.world_size >= 1 && in.nodes >= 1 && in.devices_per_node >= 1 &&
                   in.world_size == in.nodes * in.devices_per_node,
               "sp_plan: --world ", in.world_size, " must equal --nodes ", in.nodes, " x --devices-per-node ",
               in.devices_per_node);
  SEQPAR_CHECK(in.mode == "train" || in.mode == "prefill" || in.mode == "decode", "sp_plan: --mode ", in.mode,
               ": train | prefill | decode");
  SEQPAR_CHECK(in.layers >= 1 && in.tp >= 1 && in.linear_flops_per_token >= 0, "sp_plan: --layers ", in.layers,
               " and --tp ", in.tp, " must be >= 1 and --linear-flops-per-token ", in.linear_flops_per_token, " >= 0");
  SEQPAR_CHECK(in.mode != "decode" || (in.layers == 1 && in.linear_flops_per_token == 0), "sp_plan: --mode decode ",
               "plans one layer's step (--layers ", in.layers, ", --linear-flops-per-token ", in.linear_flops_per_token,
               " are for train and prefill)");
  if (in.mode == "decode") {
    // The problem's own decode rules (a RoPE preset, a window, ...) refuse every grid alike: once, in sp_bench's
    // words, before any configuration is ranked (on a grid of one, where the head splits always hold).
    try {
      check_decode_options(problem_options(in));
    } catch (const Error& e) {
      SEQPAR_THROW("sp_plan --mode decode: sp_bench refuses this problem on every grid: ", e.message());
    }
  }
  const std::string attn = attn_of(in);
  std::vector<PlanConfig> configs;
  for (int pu = 1; pu <= in.world_size; ++pu) {
    if (in.world_size % pu != 0) continue;
    const int pr = in.world_size / pu;
    if (in.mode == "decode") {
      // A decode step: the grid and the cache's sharding (the prompt's prefill is sp_bench's, not planned here).
      for (const char* shard : {"contiguous", "interleave"}) {
        PlanConfig c;
        c.ulysses_size = pu;
        c.ring_size = pr;
        c.layout = "zigzag";
        c.impl.clear();
        c.cache_shard = shard;
        configs.push_back(c);
      }
      continue;
    }
    for (const char* layout : {"contiguous", "zigzag", "stripe", "balanced"}) {
      if (pr == 1 && std::string(layout) != "zigzag") continue;  // a ring of one: every layout is the same run
      PlanConfig c;
      c.ulysses_size = pu;
      c.ring_size = pr;
      c.layout = layout;
      if (attn == "mha") {
        for (const char* impl : {"p2p", "allgather"}) {
          if (pr == 1 && std::string(impl) == "allgather") continue;  // no ring: the same run
          c.impl = impl;
          configs.push_back(c);
        }
      } else if (attn == "gdn") {
        c.impl.clear();
        for (const char* m : {"chain", "scan"}) {
          c.gdn_mode = m;
          configs.push_back(c);
        }
      } else {
        c.impl.clear();
        for (const char* m : {"ring", "allgather"}) {
          c.dsa_select = m;
          configs.push_back(c);
        }
      }
    }
  }
  if (!in.only_configs.empty()) {
    std::vector<PlanConfig> kept;
    for (const PlanConfig& c : configs)
      if (std::find(in.only_configs.begin(), in.only_configs.end(), c.name()) != in.only_configs.end())
        kept.push_back(c);
    for (const std::string& n : in.only_configs) {
      SEQPAR_CHECK(std::any_of(kept.begin(), kept.end(), [&](const PlanConfig& c) { return c.name() == n; }),
                   "sp_plan: --configs names \"", n, "\", which is not a configuration of this problem at --world ",
                   in.world_size, " (names as the table prints them, e.g. \"u1xr8 zigzag p2p\")");
    }
    configs = kept;
  }
  std::vector<PlanRow> rows;
  for (const PlanConfig& c : configs) {
    PlanRow row;
    row.config = c;
    row.command = command_of(in, c);
    // Rings beyond what is planned are excluded before any layout is built (kPlanMaxRing).
    if (in.mode != "decode" && c.ring_size > (c.layout == "balanced" ? kPlanMaxBalancedRing : kPlanMaxRing)) {
      row.excluded =
          c.layout == "balanced"
              ? str_cat("ring_size ", c.ring_size, " exceeds the ", kPlanMaxBalancedRing,
                        " ring ranks sp_plan plans the balanced layout for (its step refinement costs O(ring_size^4))")
              : str_cat("ring_size ", c.ring_size, " exceeds the ", kPlanMaxRing,
                        " ring ranks sp_plan plans for (a layout's per-step work table has ring_size^2 entries)");
      rows.push_back(std::move(row));
      continue;
    }
    try {
      const SpBenchOptions o = config_options(in, c);
      if (in.mode == "decode") {
        // sp_bench --mode decode's rules (the grid's head splits, the attention options decode does not take), in its
        // words.
        check_decode_options(o);
      }
      const MemoryEstimate e = estimate_of(o, 0);
      row.memory = e.ledger;
      row.memory_total = e.total_bytes();
      // Unlimited memory: nothing to decide, rank 0's estimate is the report (the per-rank estimates of a long
      // sequence over many ranks are what the planner's time goes to).
      if (in.memory_per_device > 0) row.excluded = memory_verdict(o, in, &row.memory_total);
      if (row.excluded.empty()) {
        row.prediction = predict(o, in, profile);
        if (row.prediction.oversubscribed && !in.oversubscribed_ok) {
          row.excluded = str_cat("oversubscribed: ", in.devices_per_node, " ranks x ", in.threads,
                                 " threads exceed the profile's ", profile.cores_per_node, " cores per node");
        }
      }
    } catch (const Error& err) {
      row.excluded = err.what();
    }
    rows.push_back(std::move(row));
  }
  std::stable_sort(rows.begin(), rows.end(), [](const PlanRow& a, const PlanRow& b) {
    if (a.excluded.empty() != b.excluded.empty()) return a.excluded.empty();
    return a.excluded.empty() && a.prediction.step_s < b.prediction.step_s;
  });
  return rows;
}

// ---- output -----------------------------------------------------------------------------------------------------

nlohmann::json plan_json(const PlanInput& in, const DeviceProfile& profile, const std::vector<PlanRow>& rows) {
  nlohmann::json j;
  j["input"] = {{"problem_flags", in.problem_flags},
                {"mode", in.mode},
                {"world_size", in.world_size},
                {"nodes", in.nodes},
                {"devices_per_node", in.devices_per_node},
                {"memory_per_device_bytes", in.memory_per_device},
                {"threads", in.threads},
                {"layers", in.layers},
                {"linear_flops_per_token", in.linear_flops_per_token},
                {"tp", in.tp}};
  j["profile"] = profile.name;
  j["ranked"] = nlohmann::json::array();
  j["excluded"] = nlohmann::json::array();
  for (const PlanRow& r : rows) {
    nlohmann::json c = {
        {"name", r.config.name()},   {"ulysses_size", r.config.ulysses_size}, {"ring_size", r.config.ring_size},
        {"layout", r.config.layout}, {"sp_bench_flags", r.config.flags()},    {"command", r.command}};
    if (!r.config.impl.empty()) c["impl"] = r.config.impl;
    if (!r.config.gdn_mode.empty()) c["gdn_mode"] = r.config.gdn_mode;
    if (!r.config.dsa_select.empty()) c["dsa_select"] = r.config.dsa_select;
    if (!r.excluded.empty()) {
      c["reason"] = r.excluded;
      j["excluded"].push_back(c);
      continue;
    }
    const Prediction& p = r.prediction;
    if (!r.config.cache_shard.empty()) c["cache_shard"] = r.config.cache_shard;
    c["predicted"] = {{"step_s", p.step_s},
                      {"linear_s", p.linear_s},
                      {"forward_s", p.forward_s},
                      {"backward_s", p.backward_s},
                      {"compute_s", p.compute_s},
                      {"exposed_comm_s", p.exposed_comm_s},
                      {"imbalance_s", p.imbalance_s},
                      {"bytes_sent_per_rank", {{"forward", p.bytes_sent_forward}, {"backward", p.bytes_sent_backward}}},
                      {"bytes_per_link_class", p.bytes_per_link},
                      {"bytes_exact", p.bytes_exact},
                      {"oversubscribed", p.oversubscribed}};
    for (const auto& [name, bytes] : r.memory) c["memory_per_rank_bytes"][name] = bytes;
    c["memory_per_rank_total_bytes"] = r.memory_total;
    j["ranked"].push_back(c);
  }
  return j;
}

std::string plan_table(const PlanInput& in, const DeviceProfile& profile, const std::vector<PlanRow>& rows) {
  std::string s = str_cat("# sp_plan: ", in.mode, ", world ", in.world_size, " = ", in.nodes, " node(s) x ",
                          in.devices_per_node, ", memory per device ",
                          in.memory_per_device > 0 ? bytes_str(in.memory_per_device) : std::string("unlimited"),
                          ", profile ", profile.name, "\n# problem:");
  for (const std::string& f : in.problem_flags) s += " " + f;
  s += "\n#  rank  configuration                    step(ms)  compute(ms)  exposed(ms)  imbal(ms)   MiB sent/rank  "
       "mem/rank\n";
  int rank = 0;
  for (const PlanRow& r : rows) {
    if (!r.excluded.empty()) continue;
    const Prediction& p = r.prediction;
    char line[256];
    std::snprintf(line, sizeof line, "%7d  %-30s %10.3f %12.3f %12.3f %10.3f %15.2f  %s%s\n", ++rank,
                  r.config.name().c_str(), p.step_s * 1e3, p.compute_s * 1e3, p.exposed_comm_s * 1e3,
                  p.imbalance_s * 1e3, (p.bytes_sent_forward + p.bytes_sent_backward) / (1024.0 * 1024.0),
                  bytes_str(r.memory_total).c_str(), p.oversubscribed ? "  (oversubscribed)" : "");
    s += line;
  }
  for (const PlanRow& r : rows) {
    if (r.excluded.empty()) continue;
    s += str_cat("#  excluded ", r.config.name(), ": ", r.excluded, "\n");
  }
  for (const PlanRow& r : rows) {
    if (!r.excluded.empty()) continue;
    s += str_cat("# first choice: ", r.command, "\n");
    // Rows within 0.5 % of the first choice's step time (a ring of one: the layouts and impls run alike) tie.
    std::string ties;
    int num_ties = 0;
    for (const PlanRow& o : rows) {
      if (&o == &r || !o.excluded.empty() || o.prediction.step_s > r.prediction.step_s * 1.005) continue;
      ties += str_cat(num_ties++ == 0 ? "" : ", ", o.config.name());
    }
    if (num_ties > 0) {
      s += str_cat("# the first choice ties (within 0.5 % of its predicted step) with ", num_ties,
                   " other configuration(s): ", ties, "\n");
    }
    break;
  }
  if (profile.note.rfind("GPU profile", 0) == 0) {
    s += "# note: the command runs sp_bench on the CPU unless --device cuda is added; this profile's GPU curves come "
         "from published figures, never checked against a run here\n";
  }
  return s;
}

}  // namespace seqpar::bench::plan
