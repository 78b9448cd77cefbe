// sp_bench --mode decode's arrays (benchmarks/sp_bench_decode_arrays.h).
#include "benchmarks/sp_bench_decode_arrays.h"

#include <algorithm>

#include "runtime/error.h"
#include "runtime/tensor_ops.h"

namespace seqpar::bench {
namespace {

// Uniform in [lo, hi) from (seed, salt, index): a counter-based hash, so that every rank makes the elements of any
// token without the others.
double input_value(std::uint64_t seed, int salt, std::uint64_t index, double lo, double hi) {
  std::uint64_t z = seed * 0x9e3779b97f4a7c15ull + static_cast<std::uint64_t>(salt) * 0xbf58476d1ce4e5b9ull + index;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  z ^= z >> 31;
  return lo + (hi - lo) * static_cast<double>(z >> 11) * 0x1.0p-53;
}

// Element i of a loaded (fp32 or fp64) array.
double element(const npy::HostArray& a, std::int64_t i) {
  return a.dtype == DType::kFloat64 ? a.view().data_as<double>()[i] : a.view().data_as<float>()[i];
}

}  // namespace

std::vector<std::int64_t> token_range(std::int64_t begin, std::int64_t end) {
  std::vector<std::int64_t> v;
  for (std::int64_t t = begin; t < end; ++t) v.push_back(t);
  return v;
}

// ---- the arrays of --inputs / --dump ---------------------------------------------------------------------------

DecodeArrays decode_arrays(const SpBenchOptions& o) {
  const std::int64_t B = o.batch, steps = o.decode.decode_steps * o.decode.new_tokens;
  DecodeArrays a;
  if (o.attn == "mha") {
    const std::int64_t hq = o.heads, hkv = o.kv_heads, D = o.head_dim;
    a.inputs = {{"q", {hq, D}, true, 1}, {"k", {hkv, D}, true, 2}, {"v", {hkv, D}, true, 3}};
    a.outputs = {{"out_dec", {B, steps, hq, D}}, {"lse_dec", {B, hq, steps}}};
    return a;
  }
  if (o.attn == "dsa") {
    const std::int64_t H = o.heads, dqk = o.head_dim, dv = o.dim_v, hi = o.indexer_heads, di = o.indexer_dim;
    a.inputs = {{"q", {H, dqk}, true, 1},
                {"c", {dqk}, true, 2},
                {"q_idx", {hi, di}, true, 3},
                {"k_idx", {di}, true, 4},
                {"w", {hi}, true, 5}};
    a.outputs = {{"out_dec", {B, steps, H, dv}}, {"lse_dec", {B, H, steps}}, {"topk_indices_dec", {B, steps, o.topk}}};
    return a;
  }
  SEQPAR_CHECK(o.attn == "gdn", "--mode decode: --attn ", o.attn, " has no decode");
  const std::int64_t hv = o.heads, hk = o.kv_heads, K = o.head_dim, V = o.dim_v > 0 ? o.dim_v : o.head_dim;
  // g: the log decay in [-0.1, -0.001) (weak: the prompt's state matters), beta in [0.05, 0.5).
  a.inputs = {{"q", {hk, K}, true, 1},
              {"k", {hk, K}, true, 2},
              {"v", {hv, V}, true, 3},
              {"g", {hv}, true, 4, -0.1, -0.001},
              {"beta", {hv}, true, 5, 0.05, 0.5},
              {"initial_state", {B, hv, K, V}, false, 6, -0.5, 0.5, true}};
  if (o.conv_width > 0) a.inputs.push_back({"conv_weight", {2 * hk * K + hv * V, o.conv_width}, false, 7, -0.5, 0.5});
  a.outputs = {{"out_dec", {B, steps, hv, V}}, {"final_state", {B, hv, K, V}}};
  return a;
}

std::vector<TensorSpec> decode_input_specs(const SpBenchOptions& o, const std::vector<DecodeInput>& inputs) {
  const std::int64_t steps = o.decode.decode_steps * o.decode.new_tokens;
  std::vector<TensorSpec> specs, dec;
  for (const DecodeInput& in : inputs) {
    if (!in.per_token) continue;
    Shape prompt{o.batch, o.decode.context}, tokens{o.batch, steps};
    prompt.insert(prompt.end(), in.row.begin(), in.row.end());
    tokens.insert(tokens.end(), in.row.begin(), in.row.end());
    specs.push_back({in.name, prompt});
    dec.push_back({in.name + "_dec", tokens});
  }
  specs.insert(specs.end(), dec.begin(), dec.end());
  for (const DecodeInput& in : inputs) {
    if (!in.per_token) specs.push_back({in.name, in.row});
  }
  return specs;
}

DecodeInputs::DecodeInputs(const SpBenchOptions& o, std::vector<DecodeInput> inputs, const NamedArrays* loaded)
    : o_(o),
      inputs_(std::move(inputs)),
      loaded_(loaded),
      prompt_(o.decode.context),
      first_step_(o.decode.context + o.decode.chunk),
      total_(first_step_ + o.decode.decode_steps * o.decode.new_tokens) {}

const DecodeInput* DecodeInputs::lookup(const std::string& name) const {
  const auto it = std::find_if(inputs_.begin(), inputs_.end(), [&](const DecodeInput& in) { return in.name == name; });
  return it == inputs_.end() ? nullptr : &*it;
}

const DecodeInput& DecodeInputs::find(const std::string& name) const {
  const DecodeInput* in = lookup(name);
  SEQPAR_CHECK(in != nullptr, "sp_bench decode: no input named ", name);
  return *in;
}

Tensor DecodeInputs::rows(const std::string& name, std::span<const std::int64_t> tokens) const {
  const DecodeInput& in = find(name);
  const std::int64_t B = o_.batch, n = static_cast<std::int64_t>(tokens.size()), w = shape_numel(in.row);
  const std::int64_t steps = total_ - first_step_;
  // The files of the prompt's rows and of the steps' (with --inputs).
  const npy::HostArray* prompt = loaded_ != nullptr ? &find_array(*loaded_, name) : nullptr;
  const npy::HostArray* dec = loaded_ != nullptr ? &find_array(*loaded_, name + "_dec") : nullptr;
  std::vector<double> values(static_cast<std::size_t>(B * n * w), 0.0);
  for (std::int64_t i = 0; i < n; ++i) {
    const std::int64_t t = tokens[static_cast<std::size_t>(i)];
    SEQPAR_CHECK(t < total_ && (loaded_ == nullptr || t < prompt_ || t >= first_step_), "sp_bench decode: token ", t,
                 " of ", name, " has no input");
    if (t < 0) continue;  // a padding row
    for (std::int64_t b = 0; b < B; ++b) {
      double* dst = values.data() + (b * n + i) * w;
      for (std::int64_t e = 0; e < w; ++e) {
        dst[e] = loaded_ == nullptr
                     ? input_value(o_.seed, in.salt, static_cast<std::uint64_t>((b * total_ + t) * w + e), in.lo, in.hi)
                 : t < prompt_ ? element(*prompt, (b * prompt_ + t) * w + e)
                               : element(*dec, (b * steps + t - first_step_) * w + e);
      }
    }
  }
  Shape shape{B, n};
  shape.insert(shape.end(), in.row.begin(), in.row.end());
  Tensor t = Tensor::empty(shape, in.state_dtype ? accumulator_dtype(o_.dtype) : o_.dtype, MemCategory::kWorkspace);
  copy_convert(TensorView(values.data(), DType::kFloat64, shape), t);
  return t;
}

Tensor DecodeInputs::whole(const std::string& name) const {
  const DecodeInput* in = lookup(name);
  if (in == nullptr) return Tensor();
  const std::int64_t w = shape_numel(in->row);
  const npy::HostArray* file = loaded_ != nullptr ? &find_array(*loaded_, name) : nullptr;
  std::vector<double> values(static_cast<std::size_t>(w));
  for (std::int64_t e = 0; e < w; ++e) {
    values[static_cast<std::size_t>(e)] =
        file != nullptr ? element(*file, e) : input_value(o_.seed, in->salt, e, in->lo, in->hi);
  }
  Tensor t = Tensor::empty(in->row, in->state_dtype ? accumulator_dtype(o_.dtype) : o_.dtype, MemCategory::kWorkspace);
  copy_convert(TensorView(values.data(), DType::kFloat64, in->row), t);
  return t;
}

NamedArrays DecodeInputs::full() const {
  NamedArrays out;
  const std::vector<std::int64_t> prompt = token_range(0, prompt_), steps = token_range(first_step_, total_);
  for (const TensorSpec& s : decode_input_specs(o_, inputs_)) {
    // Not an input's own name: the file x_dec of token input x.
    const bool dec = lookup(s.name) == nullptr;
    const std::string base = dec ? s.name.substr(0, s.name.size() - 4) : s.name;
    const Tensor t = find(base).per_token ? rows(base, dec ? steps : prompt) : whole(base);
    npy::HostArray a(t.dtype(), t.shape());
    copy_convert(t, a.view());
    out.emplace_back(s.name, std::move(a));
  }
  return out;
}

}  // namespace seqpar::bench
