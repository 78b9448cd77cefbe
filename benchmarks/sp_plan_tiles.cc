// sp_plan's tile model of an attention call (sp_plan_tiles.h).
#include "benchmarks/sp_plan_tiles.h"

#include <algorithm>
#include <limits>

#include "runtime/error.h"

namespace seqpar::bench::plan {

namespace {

std::int64_t ceil_div(std::int64_t a, std::int64_t b) { return a <= 0 ? 0 : (a + b - 1) / b; }

}  // namespace

TileCount tile_count(const TilePhase& ph, bool bwd, const std::vector<TileSeq>& seqs, int heads, int kv_heads) {
  TileCount c;
  for (const TileSeq& s : seqs) {
    if (s.q_len <= 0 || s.k_len <= 0) continue;
    const std::int64_t M = s.causal ? ph.causal_block_m : ph.block_m, N = s.causal ? ph.causal_block_n : ph.block_n;
    const std::int64_t shift = s.k_len - s.q_len;  // query i sees keys j <= i + shift (causal)
    double it = 0, units = 0;
    if (!bwd) {
      // M blocks of rows; packed GQA: row = token x g + head, so a block holds M / g tokens' rows of g heads.
      const std::int64_t g = ph.pack_gqa ? std::max(1, heads / std::max(1, kv_heads)) : 1;
      const std::int64_t rows = s.q_len * g;
      for (std::int64_t m = 0; m < ceil_div(rows, M); ++m) {
        const std::int64_t last_query = (std::min(rows, (m + 1) * M) - 1) / g;
        const std::int64_t keys = s.causal ? std::clamp<std::int64_t>(last_query + shift + 1, 0, s.k_len) : s.k_len;
        it += static_cast<double>(ceil_div(keys, N));
        units += 1;
      }
      const double copies = static_cast<double>(heads) / static_cast<double>(g);
      c.iterations += it * copies;
      c.units += units * copies;
    } else {
      for (std::int64_t n = 0; n < ceil_div(s.k_len, N); ++n) {
        // The first query that sees key n N; the M blocks from the one holding it to the end.
        const std::int64_t first = s.causal ? std::max<std::int64_t>(0, n * N - shift) : 0;
        it += first < s.q_len ? static_cast<double>(ceil_div(s.q_len, M) - first / M) : 0.0;
        units += 1;
      }
      c.iterations += it * heads;
      c.units += units * heads;
    }
  }
  return c;
}

double tile_call_seconds(const AttnTiles& t, bool bwd, const std::vector<TileSeq>& seqs, int heads, int kv_heads,
                         int head_dim, double plateau_flops_per_s) {
  const TilePhase& ph = bwd ? t.bwd : t.fwd;
  double s = 0;
  // The two tile shapes (with and without a causal mask) are costed apart: a call holds one kind in practice.
  for (const bool causal : {false, true}) {
    std::vector<TileSeq> part;
    for (const TileSeq& q : seqs)
      if (q.causal == causal) part.push_back(q);
    if (part.empty()) continue;
    const TileCount c = tile_count(ph, bwd, part, heads, kv_heads);
    const double M = causal ? ph.causal_block_m : ph.block_m, N = causal ? ph.causal_block_n : ph.block_n;
    const double tile_flops = (bwd ? 2.5 : 1.0) * 4.0 * M * N * head_dim;
    const double rate = causal ? ph.causal_unit_flops_per_s : ph.unit_flops_per_s,
                 overhead = causal ? ph.causal_overhead_blocks : ph.overhead_blocks;
    const double at_units = (c.iterations + overhead * c.units) * tile_flops / rate;
    const double at_plateau = c.iterations * tile_flops / plateau_flops_per_s;
    s += std::max(at_units, at_plateau);
  }
  return s;
}

double unpad_pad_bytes(bool bwd, const std::vector<TileSeq>& seqs, int heads, int kv_heads, int head_dim,
                       double elem_bytes) {
  double q = 0, k = 0;
  for (const TileSeq& s : seqs) {
    if (s.q_len <= 0 || s.k_len <= 0) continue;
    q += static_cast<double>(s.q_len);
    k += static_cast<double>(s.k_len);
  }
  const double qh = q * heads, kh = k * kv_heads, ed = elem_bytes * head_dim;
  return bwd ? ed * (9 * qh + 10 * kh) + 8 * qh : ed * (5 * qh + 4 * kh) + 12 * qh;
}

double half_read_bytes(bool bwd, const std::vector<TileSeq>& seqs, int heads, int kv_heads, int head_dim,
                       double elem_bytes) {
  double q = 0, k = 0;
  for (const TileSeq& s : seqs) {
    if (s.q_len <= 0 || s.k_len <= 0) continue;
    if (s.q_len < s.k_len) q += static_cast<double>(s.q_len);
    if (s.k_len < s.q_len) k += static_cast<double>(s.k_len);
  }
  const double ed = elem_bytes * head_dim;
  return ed * ((bwd ? 6.0 : 2.0) * q * heads + 4.0 * k * kv_heads);
}

double ring_copy_pass_bytes(bool bwd, bool first_step, double rows, double hq, double hkv, int head_dim,
                            double elem_bytes, double grad_bytes, double lse_bytes) {
  const double e = elem_bytes, a = grad_bytes, l = lse_bytes, D = head_dim;
  if (!bwd) return first_step ? rows * (4 * e * hkv * D + hq * (D * (e + 3 * a) + 2 * l)) : 0.0;
  return first_step ? rows * D * (8 * e * hkv + 2 * a * hq + 4 * a * hkv) : rows * 4 * e * hkv * D;
}

namespace {

TilePhase phase_from_json(const nlohmann::json& j, const std::string& what) {
  SEQPAR_CHECK(j.is_object(), what, " must be an object");
  TilePhase p;
  const auto block = [&](const char* k) {
    // Read as int64 first: get<int> would wrap 2^32 + 64 to 64.
    SEQPAR_CHECK(j.contains(k) && j[k].is_number_integer(), what, ".", k, " must be an integer in [1, 2^31 - 1]");
    const bool is_unsigned = j[k].is_number_unsigned();
    const std::int64_t v = is_unsigned && j[k].get<std::uint64_t>() > std::numeric_limits<std::int64_t>::max()
                               ? std::numeric_limits<std::int64_t>::max()
                               : j[k].get<std::int64_t>();
    SEQPAR_CHECK(v > 0 && v <= std::numeric_limits<int>::max(), what, ".", k, " ", j[k].dump(),
                 " must be an integer in [1, 2^31 - 1]");
    return static_cast<int>(v);
  };
  p.block_m = block("block_m");
  p.block_n = block("block_n");
  p.causal_block_m = block("causal_block_m");
  p.causal_block_n = block("causal_block_n");
  const auto number = [&](const char* k, bool positive, double dflt) {
    if (!j.contains(k) && dflt >= 0) return dflt;
    SEQPAR_CHECK(j.contains(k) && j[k].is_number() && (positive ? j[k].get<double>() > 0 : j[k].get<double>() >= 0),
                 what, ".", k, " must be a number ", positive ? "> 0" : ">= 0");
    return j[k].get<double>();
  };
  p.unit_flops_per_s = number("unit_flops_per_s", true, -1);
  p.overhead_blocks = number("overhead_blocks", false, -1);
  p.causal_unit_flops_per_s = number("causal_unit_flops_per_s", true, p.unit_flops_per_s);
  p.causal_overhead_blocks = number("causal_overhead_blocks", false, p.overhead_blocks);
  if (j.contains("pack_gqa")) {
    SEQPAR_CHECK(j["pack_gqa"].is_boolean(), what, ".pack_gqa must be true or false (is ", j["pack_gqa"].dump(), ")");
    p.pack_gqa = j["pack_gqa"].get<bool>();
  }
  return p;
}

nlohmann::json phase_json(const TilePhase& p) {
  return {{"block_m", p.block_m},
          {"block_n", p.block_n},
          {"causal_block_m", p.causal_block_m},
          {"causal_block_n", p.causal_block_n},
          {"unit_flops_per_s", p.unit_flops_per_s},
          {"overhead_blocks", p.overhead_blocks},
          {"causal_unit_flops_per_s", p.causal_unit_flops_per_s},
          {"causal_overhead_blocks", p.causal_overhead_blocks},
          {"pack_gqa", p.pack_gqa}};
}

}  // namespace

AttnTiles tiles_from_json(const nlohmann::json& j, const std::string& what) {
  SEQPAR_CHECK(j.is_object() && j.contains("fwd") && j.contains("bwd"), what, " must hold \"fwd\" and \"bwd\"");
  AttnTiles t;
  t.present = true;
  t.fwd = phase_from_json(j["fwd"], what + ".fwd");
  t.bwd = phase_from_json(j["bwd"], what + ".bwd");
  return t;  // the caller reads the source (sp_plan_model.cc's source_text)
}

nlohmann::json tiles_json(const AttnTiles& t) {
  return {{"fwd", phase_json(t.fwd)}, {"bwd", phase_json(t.bwd)}, {"source", t.source}};
}

}  // namespace seqpar::bench::plan
