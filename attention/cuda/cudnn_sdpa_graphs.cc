// The cuDNN SDPA graphs of the lowered calls (cudnn_sdpa_graphs.h): the only translation unit that includes the
// cuDNN frontend.
#include "attention/cuda/cudnn_sdpa_graphs.h"

#include <cudnn_frontend.h>

#include <cmath>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <utility>

#include "runtime/error.h"

namespace seqpar::attn::cudnn {
namespace {

namespace fe = cudnn_frontend;
using TensorPtr = std::shared_ptr<fe::graph::Tensor_attributes>;

fe::DataType_t io_type(DType d) {
  switch (d) {
    case DType::kBFloat16: return fe::DataType_t::BFLOAT16;
    case DType::kFloat16: return fe::DataType_t::HALF;
    case DType::kFloat32: return fe::DataType_t::FLOAT;
    default: SEQPAR_THROW("cuDNN SDPA: dtype ", dtype_name(d), " has no cuDNN SDPA graph (bf16, fp16, fp32 only)");
  }
}

// The mask parameters of `m` on SDPA_attributes or SDPA_backward_attributes.
template <typename Attrs>
void set_mask(Attrs& a, const SdpaMask& m) {
  const auto align = m.align == DiagonalAlignment::kBottomRight ? fe::DiagonalAlignment_t::BOTTOM_RIGHT
                                                                : fe::DiagonalAlignment_t::TOP_LEFT;
  if (m.causal || m.left_bound > 0) a.set_diagonal_alignment(align);
  if (m.causal) a.set_diagonal_band_right_bound(0);
  if (m.left_bound > 0) a.set_diagonal_band_left_bound(static_cast<int>(m.left_bound));
}

struct Built {
  std::shared_ptr<fe::graph::Graph> graph;
  std::string status;  // "" when validate() accepted it
};

Built build(const SdpaGraphKey& k, int sm_version) {
  Built out;
  auto g = std::make_shared<fe::graph::Graph>();
  g->set_io_data_type(io_type(k.dtype))
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  g->set_sm_version(sm_version);
  const std::int64_t b = k.batch, d = k.head_dim;
  const float scale = k.scale > 0.0f ? k.scale : static_cast<float>(1.0 / std::sqrt(static_cast<double>(d)));
  // [B, S, H, D] row-major read as cuDNN's [B, H, S, D]
  auto bshd = [&](const char* name, std::int64_t s, std::int64_t h) {
    return g->tensor(
        fe::graph::Tensor_attributes().set_name(name).set_dim({b, h, s, d}).set_stride({s * h * d, d, h * d, 1}));
  };
  auto int_tensor = [&](const char* name, std::int64_t n) {
    return g->tensor(fe::graph::Tensor_attributes()
                         .set_name(name)
                         .set_dim({n, 1, 1, 1})
                         .set_stride({1, 1, 1, 1})
                         .set_data_type(fe::DataType_t::INT32));
  };
  auto ragged = [&](const TensorPtr& t, const char* name) {
    if (k.ragged) t->set_ragged_offset(int_tensor(name, b + 1));
  };
  TensorPtr seq_q, seq_kv;
  if (k.ragged) {
    seq_q = int_tensor("seq_len_q", b);
    seq_kv = int_tensor("seq_len_kv", b);
  }
  const TensorPtr q = bshd("Q", k.sq, k.hq), kk = bshd("K", k.sk, k.hkv), v = bshd("V", k.sk, k.hkv);
  ragged(q, "q_offsets");
  ragged(kk, "k_offsets");
  ragged(v, "v_offsets");
  auto set_out = [&](const TensorPtr& t, std::int64_t s, std::int64_t h, const char* off) {
    t->set_output(true).set_dim({b, h, s, d}).set_stride({s * h * d, d, h * d, 1});
    ragged(t, off);
  };
  if (!k.backward) {
    fe::graph::SDPA_attributes a;
    a.set_name("sdpa_forward").set_generate_stats(true).set_attn_scale(scale);
    set_mask(a, k.mask);
    if (k.ragged) a.set_padding_mask(true).set_seq_len_q(seq_q).set_seq_len_kv(seq_kv);
    auto [o, stats] = g->sdpa(q, kk, v, a);
    set_out(o, k.sq, k.hq, "o_offsets");
    stats->set_output(true).set_data_type(fe::DataType_t::FLOAT);
  } else {
    const TensorPtr o = bshd("O", k.sq, k.hq), dout = bshd("dO", k.sq, k.hq);
    ragged(o, "o_offsets");
    ragged(dout, "do_offsets");
    const TensorPtr stats = g->tensor(fe::graph::Tensor_attributes()
                                          .set_name("Stats")
                                          .set_dim({b, k.hq, k.sq, 1})
                                          .set_stride({k.hq * k.sq, k.sq, 1, 1})
                                          .set_data_type(fe::DataType_t::FLOAT));
    fe::graph::SDPA_backward_attributes a;
    a.set_name("sdpa_backward").set_attn_scale(scale).set_deterministic_algorithm(true);
    set_mask(a, k.mask);
    if (k.ragged) a.set_padding_mask(true).set_seq_len_q(seq_q).set_seq_len_kv(seq_kv);
    auto [dq, dk, dv] = g->sdpa_backward(q, kk, v, o, dout, stats, a);
    set_out(dq, k.sq, k.hq, "dq_offsets");
    set_out(dk, k.sk, k.hkv, "dk_offsets");
    set_out(dv, k.sk, k.hkv, "dv_offsets");
  }
  auto status = g->validate();
  if (!status.is_good()) out.status = status.get_message().empty() ? "validate() refused" : status.get_message();
  out.graph = std::move(g);
  return out;
}

std::mutex g_mutex;
std::map<std::string, Built>& cache() {  // by sdpa_key_str, scale and SM
  static std::map<std::string, Built> c;
  return c;
}

}  // namespace

std::string sdpa_key_str(const SdpaGraphKey& k) {
  std::ostringstream s;
  s << (k.backward ? "bwd " : "fwd ") << dtype_name(k.dtype) << " b" << k.batch << " h" << k.hq << "/" << k.hkv << " s"
    << k.sq << "x" << k.sk << " d" << k.head_dim << (k.ragged ? " ragged " : " ") << sdpa_mask_str(k.mask);
  return s.str();
}

std::vector<SdpaGraphKey> sdpa_graph_keys(const std::vector<LoweredCall>& calls, std::int64_t batch, std::int64_t hq,
                                          std::int64_t hkv, std::int64_t head_dim, DType dtype) {
  std::vector<SdpaGraphKey> keys;
  for (const LoweredCall& c : calls) {
    SdpaGraphKey k;
    k.dtype = dtype;
    k.hq = hq;
    k.hkv = hkv;
    k.head_dim = head_dim;
    k.mask = c.mask;
    k.ragged = c.segments.size() > 1;
    k.batch = k.ragged ? batch * static_cast<std::int64_t>(c.segments.size()) : batch;
    for (const LoweredRect& r : c.segments) {
      k.sq = std::max(k.sq, r.sq());
      k.sk = std::max(k.sk, r.sk());
    }
    keys.push_back(k);
    k.backward = true;
    keys.push_back(k);
  }
  return keys;
}

std::string sdpa_fallback_reason(const SdpaGraphKey& key) {
  if (key.dtype == DType::kFloat64) return "fp64 has no cuDNN SDPA engine";
  if (key.dtype == DType::kFloat32 && key.backward) return "fp32 has a forward cuDNN SDPA engine only";
  if (key.backward && key.sq == 1 && key.sk == 1) return "cuDNN refuses the backward with s_q = s_kv = 1";
  return "";
}

std::int64_t cudnn_version() { return static_cast<std::int64_t>(cudnnGetVersion()); }

std::string validate_sdpa_graph(const SdpaGraphKey& key, int sm_version) {
  const std::lock_guard<std::mutex> lock(g_mutex);
  auto& c = cache();
  std::ostringstream id;
  id << sdpa_key_str(key) << " scale " << std::hexfloat << key.scale << " sm" << sm_version;
  auto it = c.find(id.str());
  if (it == c.end()) it = c.emplace(id.str(), build(key, sm_version)).first;
  return it->second.status;
}

std::int64_t sdpa_graph_cache_size() {
  const std::lock_guard<std::mutex> lock(g_mutex);
  return static_cast<std::int64_t>(cache().size());
}

}  // namespace seqpar::attn::cudnn
