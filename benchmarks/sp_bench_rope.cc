#include "benchmarks/sp_bench_rope.h"

#include <nlohmann/json.hpp>

#include "attention/reference/rope_reference.h"
#include "runtime/error.h"

namespace seqpar::bench {

std::vector<std::string> rope_flags() {
  return {"rope", "rope-dim", "rope-theta", "rope-scaling", "rope-factor", "rope-original-max-pos"};
}

std::string describe_rope(const SpBenchOptions& o, const attn::RopeConfig& cfg) {
  if (!o.rope) return "";
  std::string s = str_cat("rope=", attn::rope_pairing_name(cfg.pairing));
  if (cfg.rotary_dim > 0)
    s += str_cat(" r=", cfg.rotary_dim, cfg.column_offset > 0 ? str_cat("@", cfg.column_offset) : "");
  s += str_cat(" theta=", cfg.theta);
  if (cfg.scaling == attn::RopeScaling::kLlama3) {
    s += str_cat(" llama3(factor ", cfg.llama3.factor, ", original ", cfg.llama3.original_max_position_embeddings, ")");
  } else if (cfg.scaling == attn::RopeScaling::kYarn) {
    s += str_cat(" yarn(factor ", cfg.yarn.factor, ", original ", cfg.yarn.original_max_position_embeddings, ")");
  }
  return s;
}

void add_rope_json(const SpBenchOptions& o, nlohmann::json& j) {
  if (!o.rope) {
    j["rope"] = nullptr;
    return;
  }
  const attn::RopeConfig& c = o.rope_cfg;
  nlohmann::json r = {{"pairing", attn::rope_pairing_name(c.pairing)},
                      {"rotary_dim", c.rotary_dim},
                      {"theta", c.theta},
                      {"scaling", attn::rope_scaling_name(c.scaling)}};
  if (c.scaling == attn::RopeScaling::kLlama3) {
    r["factor"] = c.llama3.factor;
    r["low_freq_factor"] = c.llama3.low_freq_factor;
    r["high_freq_factor"] = c.llama3.high_freq_factor;
    r["original_max_position_embeddings"] = c.llama3.original_max_position_embeddings;
  } else if (c.scaling == attn::RopeScaling::kYarn) {
    r["factor"] = c.yarn.factor;
    r["beta_fast"] = c.yarn.beta_fast;
    r["beta_slow"] = c.yarn.beta_slow;
    r["mscale"] = c.yarn.mscale;
    r["mscale_all_dim"] = c.yarn.mscale_all_dim;
    r["original_max_position_embeddings"] = c.yarn.original_max_position_embeddings;
    r["attention_factor"] = attn::rope_attention_factor(c);
  }
  j["rope"] = r;
}

void check_rope_fits(const attn::RopeConfig& cfg, std::int64_t head_dim, const char* what,
                     const std::string& rope_dim_note, const std::string& head_dim_note) {
  SEQPAR_CHECK(cfg.column_offset + cfg.rotary_dim <= head_dim, "--rope-dim ", cfg.rotary_dim, rope_dim_note,
               " must be <= ", what, " ", head_dim - cfg.column_offset, head_dim_note);
  SEQPAR_CHECK(cfg.rotary_dim > 0 || (head_dim - cfg.column_offset) % 2 == 0, "--rope: ", what, " ", head_dim,
               " must be even to rotate every column (or give an even --rope-dim)");
}

std::vector<Tensor> rope_rotated_copies(const std::vector<RopeTarget>& targets, const std::vector<TensorView>& inputs,
                                        std::span<const std::int64_t> positions, Stream stream) {
  std::vector<Tensor> r;
  for (std::size_t i = 0; i < targets.size(); ++i) {
    r.push_back(Tensor::copy_of(inputs[i], inputs[i].dtype(), MemCategory::kWorkspace, stream));
    attn::rope_forward(r.back().view(), positions, targets[i].cfg);
  }
  return r;
}

void rope_backward_all(const std::vector<RopeTarget>& targets, const std::vector<TensorView>& grads,
                       std::span<const std::int64_t> positions) {
  for (std::size_t i = 0; i < targets.size(); ++i) attn::rope_backward(grads[i], positions, targets[i].cfg);
}

void rope_host(const attn::RopeConfig& cfg, npy::HostArray& a, bool backward, bool fp64_reference,
               std::span<const std::int64_t> positions) {
  const std::vector<std::int64_t> pos =
      positions.empty() ? all_positions(a.shape.at(1)) : std::vector<std::int64_t>(positions.begin(), positions.end());
  if (!fp64_reference) {
    backward ? attn::rope_backward(a.view(), pos, cfg) : attn::rope_forward(a.view(), pos, cfg);
    return;
  }
  const npy::HostArray in = a;
  backward ? attn::reference::rope_backward(cfg, pos, in.view(), a.view())
           : attn::reference::rope_forward(cfg, pos, in.view(), a.view());
}

void rope_named(const std::vector<RopeTarget>& targets, NamedArrays& arrays, bool backward, bool fp64_reference,
                std::span<const std::int64_t> positions) {
  for (const RopeTarget& t : targets) {
    const std::string name = backward ? "d" + t.name : t.name;
    bool found = false;
    for (auto& [n, a] : arrays) {
      if (n != name) continue;
      rope_host(t.cfg, a, backward, fp64_reference, positions);
      found = true;
    }
    SEQPAR_CHECK(found, "sp_bench RoPE: no array named ", name);
  }
}

}  // namespace seqpar::bench
