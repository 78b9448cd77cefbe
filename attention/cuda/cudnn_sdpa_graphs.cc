// The cuDNN SDPA graphs of the lowered calls (cudnn_sdpa_graphs.h): the only translation unit that includes the
// cuDNN frontend.
#include "attention/cuda/cudnn_sdpa_graphs.h"

#include <cudnn_frontend.h>

#include <cmath>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <unordered_map>
#include <utility>

#include <cuda_runtime_api.h>

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

// Row counts that set the strides of a graph's tensors inside the caller's full tensors (0: compact, the key's
// own sq / sk): q, o and do of the inputs have batch stride q_rows H D, k / v k_rows Hkv D, the backward's Stats
// input lse_rows per head. Outputs (o of the forward, Stats, dq, dk, dv) are compact.
struct Strides {
  std::int64_t q_rows = 0, k_rows = 0, lse_rows = 0;
};

struct Built {
  std::shared_ptr<fe::graph::Graph> graph;
  std::string status;  // "" when validate() accepted it
  TensorPtr q, k, v, o, stats, dout, dq, dk, dv;
};

Built build(const SdpaGraphKey& k, int sm_version, const Strides& st = {}) {
  Built out;
  auto g = std::make_shared<fe::graph::Graph>();
  g->set_io_data_type(io_type(k.dtype))
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  g->set_sm_version(sm_version);
  const std::int64_t b = k.batch, d = k.head_dim;
  const float scale = k.scale > 0.0f ? k.scale : static_cast<float>(1.0 / std::sqrt(static_cast<double>(d)));
  // [B, S, H, D] row-major read as cuDNN's [B, H, S, D]; `rows` (>= s) rows per batch entry in memory
  auto bshd = [&](const char* name, std::int64_t s, std::int64_t h, std::int64_t rows = 0) {
    const std::int64_t r = rows > 0 ? rows : s;
    return g->tensor(
        fe::graph::Tensor_attributes().set_name(name).set_dim({b, h, s, d}).set_stride({r * h * d, d, h * d, 1}));
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
  const TensorPtr q = bshd("Q", k.sq, k.hq, st.q_rows), kk = bshd("K", k.sk, k.hkv, st.k_rows),
                  v = bshd("V", k.sk, k.hkv, st.k_rows);
  out.q = q;
  out.k = kk;
  out.v = v;
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
    out.o = o;
    out.stats = stats;
  } else {
    const TensorPtr o = bshd("O", k.sq, k.hq, st.q_rows), dout = bshd("dO", k.sq, k.hq, st.q_rows);
    const std::int64_t lse_rows = st.lse_rows > 0 ? st.lse_rows : k.sq;
    ragged(o, "o_offsets");
    ragged(dout, "do_offsets");
    const TensorPtr stats = g->tensor(fe::graph::Tensor_attributes()
                                          .set_name("Stats")
                                          .set_dim({b, k.hq, k.sq, 1})
                                          .set_stride({k.hq * lse_rows, lse_rows, 1, 1})
                                          .set_data_type(fe::DataType_t::FLOAT));
    fe::graph::SDPA_backward_attributes a;
    a.set_name("sdpa_backward").set_attn_scale(scale).set_deterministic_algorithm(true);
    set_mask(a, k.mask);
    if (k.ragged) a.set_padding_mask(true).set_seq_len_q(seq_q).set_seq_len_kv(seq_kv);
    auto [dq, dk, dv] = g->sdpa_backward(q, kk, v, o, dout, stats, a);
    set_out(dq, k.sq, k.hq, "dq_offsets");
    set_out(dk, k.sk, k.hkv, "dk_offsets");
    set_out(dv, k.sk, k.hkv, "dv_offsets");
    out.o = o;
    out.dout = dout;
    out.stats = stats;
    out.dq = dq;
    out.dk = dk;
    out.dv = dv;
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

std::string check_sdpa_support(const SdpaGraphKey& key, const std::string& device_properties_json, int sm_version) {
  auto props = std::make_shared<fe::DeviceProperties>();
  std::vector<std::uint8_t> buf(device_properties_json.begin(), device_properties_json.end());
  buf.push_back(0);
  auto status = props->deserialize(buf);
  if (!status.is_good()) return "DeviceProperties::deserialize: " + status.get_message();
  Built b = build(key, sm_version);
  if (!b.status.empty()) return "validate: " + b.status;
  b.graph->set_device_properties(props);
  status = b.graph->build_operation_graph();
  if (!status.is_good()) return "build_operation_graph: " + status.get_message();
  status = b.graph->create_execution_plans({fe::HeurMode_t::A});
  if (!status.is_good()) return "create_execution_plans: " + status.get_message();
  status = b.graph->check_support();
  if (!status.is_good()) return "check_support: " + status.get_message();
  return "";
}

namespace {

// A graph built for execution on the current device: plans built, workspace size known; or why not.
struct Executable {
  Built b;
  std::string why;  // "" when runnable
  std::int64_t workspace = 0;
};

cudnnHandle_t handle_for(int device) {  // one per device and thread, never destroyed (cuDNN handles are cheap)
  thread_local std::map<int, cudnnHandle_t> handles;
  auto it = handles.find(device);
  if (it != handles.end()) return it->second;
  cudnnHandle_t h = nullptr;
  const cudnnStatus_t rc = cudnnCreate(&h);
  SEQPAR_CHECK(rc == CUDNN_STATUS_SUCCESS, "cudnnCreate on device ", device, ": ", cudnnGetErrorString(rc));
  handles.emplace(device, h);
  return h;
}

Executable make_executable(const SdpaRectCall& c, int device, int sm_version, cudnnHandle_t h) {
  Executable e;
  e.b = build(c.key, sm_version, Strides{c.q_rows, c.k_rows, c.lse_rows});
  if (!e.b.status.empty()) {
    e.why = "validate: " + e.b.status;
    return e;
  }
  auto& g = *e.b.graph;
  auto status = g.build_operation_graph(h);
  if (status.is_good()) status = g.create_execution_plans({fe::HeurMode_t::A});
  if (status.is_good()) status = g.check_support(h);
  if (status.is_good()) status = g.build_plans(h, fe::BuildPlanPolicy_t::HEURISTICS_CHOICE);
  if (status.is_good()) status = g.get_workspace_size(e.workspace);
  if (!status.is_good()) e.why = "device " + std::to_string(device) + ": " + status.get_message();
  return e;
}

std::mutex g_exec_mutex;
std::map<std::string, Executable>& exec_cache() {
  static std::map<std::string, Executable> c;
  return c;
}

}  // namespace

std::string sdpa_call_key_str(const SdpaRectCall& c) {
  std::ostringstream id;
  id << sdpa_key_str(c.key) << " scale " << std::hexfloat << c.key.scale << " rows q" << c.q_rows << " k" << c.k_rows
     << " lse" << c.lse_rows;
  return id.str();
}

bool run_sdpa(const SdpaRectCall& c, void* stream, std::string* why) {
  int device = 0;
  SEQPAR_CHECK(cudaGetDevice(&device) == cudaSuccess, "cuDNN SDPA: cudaGetDevice failed");
  cudaDeviceProp prop{};
  SEQPAR_CHECK(cudaGetDeviceProperties(&prop, device) == cudaSuccess, "cuDNN SDPA: cudaGetDeviceProperties failed");
  const cudnnHandle_t h = handle_for(device);
  const cudnnStatus_t rc = cudnnSetStream(h, static_cast<cudaStream_t>(stream));
  SEQPAR_CHECK(rc == CUDNN_STATUS_SUCCESS, "cudnnSetStream: ", cudnnGetErrorString(rc));
  const std::string id = sdpa_call_key_str(c) + " dev" + std::to_string(device);
  const std::lock_guard<std::mutex> lock(g_exec_mutex);  // plans are shared; execution on one stream at a time
  auto& cache = exec_cache();
  auto it = cache.find(id);
  if (it == cache.end()) it = cache.emplace(id, make_executable(c, device, prop.major * 10 + prop.minor, h)).first;
  Executable& e = it->second;
  if (!e.why.empty()) {
    if (why != nullptr) *why = e.why;
    return false;
  }
  std::unordered_map<TensorPtr, void*> pack;
  pack[e.b.q] = const_cast<void*>(c.q);
  pack[e.b.k] = const_cast<void*>(c.k);
  pack[e.b.v] = const_cast<void*>(c.v);
  pack[e.b.o] = c.o;
  pack[e.b.stats] = c.stats;
  if (c.key.backward) {
    pack[e.b.dout] = const_cast<void*>(c.dout);
    pack[e.b.dq] = c.dq;
    pack[e.b.dk] = c.dk;
    pack[e.b.dv] = c.dv;
  }
  void* ws = nullptr;
  if (e.workspace > 0) {
    SEQPAR_CHECK(cudaMallocAsync(&ws, static_cast<std::size_t>(e.workspace), static_cast<cudaStream_t>(stream)) ==
                     cudaSuccess,
                 "cuDNN SDPA: cudaMallocAsync of a ", e.workspace, "-byte workspace failed");
  }
  auto status = e.b.graph->execute(h, pack, ws);
  if (ws != nullptr) cudaFreeAsync(ws, static_cast<cudaStream_t>(stream));
  SEQPAR_CHECK(status.is_good(), "cuDNN SDPA execute (", id, "): ", status.get_message());
  return true;
}

std::string serialized_device_properties(int device_id) {
  fe::DeviceProperties props;
  props.set_device_id(device_id);
  auto status = props.build();
  SEQPAR_CHECK(status.is_good(), "cuDNN DeviceProperties of device ", device_id, ": ", status.get_message());
  std::vector<std::uint8_t> buf;
  status = props.serialize(buf);
  SEQPAR_CHECK(status.is_good(), "cuDNN DeviceProperties::serialize of device ", device_id, ": ", status.get_message());
  std::string text(buf.begin(), buf.end());
  while (!text.empty() && text.back() == '\0') text.pop_back();
  return text;
}

}  // namespace seqpar::attn::cudnn
