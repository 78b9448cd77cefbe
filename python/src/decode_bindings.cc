// Bindings of the decode layers (parallel/decode_cp.h, parallel/dsa_decode_cp.h): MhaDecodeCp, DsaDecodeCp and
// GdnDecodeCp with their caches as Python objects (ShardedKvCache, ShardedDsaCache, GdnCache). The Python package
// wraps them in python/seqpar/decode.py. Tensors cross as DLPack views (dlpack_bridge.h); no autograd (inference).
// Devices: an MHA cache lives where make_cache's device says (the host, or a CUDA device in a CUDA build); its
// prefill, fill and decode take inputs on that device and run on torch's current stream of it.
#include "decode_bindings.h"

#include <pybind11/stl.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>

#include "dlpack_bridge.h"
#include "parallel/decode_cp.h"
#include "parallel/dsa_decode_cp.h"
#include "runtime/dtype.h"
#include "runtime/error.h"

namespace py = pybind11;

namespace seqpar::python {
namespace {

py::tuple decode_out(DecodeOutput&& r) {
  return py::make_tuple(to_torch(std::move(r.out)), r.lse.defined() ? to_torch(std::move(r.lse)) : py::none());
}

py::tuple prefill_out(PrefillOutput&& r) {
  return py::make_tuple(to_torch(std::move(r.out)), r.lse.defined() ? to_torch(std::move(r.lse)) : py::none());
}

// make_cache's device: "cpu", "cuda" (torch's current CUDA device, or device 0 when torch has none, which make_cache
// then refuses with the reason) or "cuda:N" (str() of a torch.device). Errors: any other device, by name and rule.
Device parse_cache_device(const std::string& name) {
  if (name == "cpu") return Device::cpu();
  if (name == "cuda") {
    const py::object cuda = py::module_::import("torch").attr("cuda");
    return Device::cuda(cuda.attr("is_available")().cast<bool>() ? cuda.attr("current_device")().cast<int>() : 0);
  }
  if (name.rfind("cuda:", 0) == 0 && name.size() > 5 &&
      name.find_first_not_of("0123456789", 5) == std::string::npos && name.size() < 15) {
    return Device::cuda(std::stoi(name.substr(5)));
  }
  SEQPAR_THROW("MhaDecodeCp.make_cache: device '", name,
               "' is not supported: a decode cache lives on 'cpu' or a CUDA device ('cuda' or 'cuda:N')");
}

// The stream of a call on `cache`: torch's current stream of the cache's CUDA device (as MhaCp's forward takes
// its inputs' stream), or the host. Inputs on another device are then refused by MhaDecodeCp's checks, by name,
// before any message (and before torch is asked for a stream of their device).
Stream cache_stream(const ShardedKvCache& cache) {
  const Device device = cache.local().spec().device;
  return device.is_cpu() ? Stream::cpu() : current_stream(TensorView(nullptr, DType::kFloat32, {0}, device));
}

template <typename Cache>
py::class_<Cache> bind_sharded_cache(py::module_& m, const char* name, const char* doc) {
  return py::class_<Cache>(m, name, doc)
      .def_property_readonly("length", &Cache::length, "Tokens in the whole cache (the same on every rank).")
      .def_property_readonly("num_steps", &Cache::num_steps, "Decode steps since the prefill.")
      .def_property_readonly("capacity", [](const Cache& c) { return c.sharding().capacity(); })
      .def_property_readonly("local_capacity", [](const Cache& c) { return c.local().spec().capacity; })
      .def_property_readonly("rank", &Cache::rank)
      .def_property_readonly("sharding", [](const Cache& c) { return c.sharding().str(); })
      .def("__repr__", [name](const Cache& c) {
        return str_cat(name, "(length=", c.length(), ", num_steps=", c.num_steps(), ", sharding='", c.sharding().str(),
                       "')");
      });
}

}  // namespace

void bind_decode(py::module_& m, GroupsOf groups_of) {
  bind_sharded_cache<ShardedKvCache>(m, "ShardedKvCache",
                                     "An MHA K/V cache sharded by token over the ring group (parallel/decode_cp.h)")
      .def_property_readonly(
          "device",
          [](const ShardedKvCache& c) {
            return py::module_::import("torch").attr("device")(c.local().spec().device.str());
          },
          "The torch.device holding this rank's shard (make_cache's device).");
  bind_sharded_cache<ShardedDsaCache>(
      m, "ShardedDsaCache",
      "A DSA indexer-key and latent cache sharded by token over the CP group (parallel/dsa_decode_cp.h)");
  py::class_<attn::GdnCache>(m, "GdnCache", "This rank's heads of a GDN state and its short-conv tail")
      .def_property_readonly("length", &attn::GdnCache::length)
      .def_property_readonly(
          "state",
          [](const attn::GdnCache& c) {
            return to_torch(Tensor::copy_of(c.state(), c.state().dtype(), MemCategory::kWorkspace));
          },
          "A copy of the state [B, Hv / P, K, V] of this rank's heads.");

  py::class_<MhaDecodeConfig> mha(m, "MhaDecodeConfig");
  mha.def(py::init([](const std::string& shard, std::int64_t interleave, double scale, const std::string& impl) {
            return MhaDecodeConfig{parse_cache_shard(shard), interleave, scale, parse_ring_impl(impl)};
          }),
          py::arg("shard") = "interleave", py::arg("interleave") = 1, py::arg("scale") = 0.0,
          py::arg("prefill_impl") = "p2p");

  py::class_<MhaDecodeCp>(m, "MhaDecodeCp", "MHA / GQA causal inference over a token-sharded cache")
      .def(py::init([groups_of](py::handle grid, const MhaDecodeConfig& c) {
             return std::make_unique<MhaDecodeCp>(groups_of(grid), c);
           }),
           py::arg("grid"), py::arg("config"), py::keep_alive<1, 2>())
      .def(
          "make_cache",
          [](const MhaDecodeCp& l, std::int64_t batch, std::int64_t capacity, std::int64_t kv_heads,
             std::int64_t head_dim, const std::string& dtype, const std::string& device) {
            return l.make_cache(batch, capacity, kv_heads, head_dim, parse_dtype(dtype), parse_cache_device(device));
          },
          py::arg("batch"), py::arg("capacity"), py::arg("kv_heads"), py::arg("head_dim"), py::arg("dtype"),
          py::arg("device") = "cpu")
      // prefill, fill and decode run on torch's current stream of the cache's device (cache_stream).
      .def("prefill",
           [](MhaDecodeCp& l, ShardedKvCache& cache, const SequenceLayout& layout, py::handle q, py::handle k,
              py::handle v) {
             l.set_stream(cache_stream(cache));
             return prefill_out(l.prefill(cache, layout, view_of(q, "q"), view_of(k, "k"), view_of(v, "v")));
           })
      .def("fill",
           [](MhaDecodeCp& l, ShardedKvCache& cache, const SequenceLayout& layout, py::handle k, py::handle v) {
             l.set_stream(cache_stream(cache));
             l.fill(cache, layout, view_of(k, "k"), view_of(v, "v"));
           })
      .def(
          "extend",
          [](MhaDecodeCp& l, ShardedKvCache& cache, const SequenceLayout& layout, py::handle q, py::handle k,
             py::handle v, const std::string& mode) {
            l.set_stream(Stream::cpu());  // host-only: a device cache or device inputs are refused by name
            return prefill_out(l.extend(cache, layout, view_of(q, "q"), view_of(k, "k"), view_of(v, "v"),
                                        parse_chunk_prefill_mode(mode)));
          },
          py::arg("cache"), py::arg("layout"), py::arg("q"), py::arg("k"), py::arg("v"), py::arg("mode") = "auto")
      .def("decode",
           [](MhaDecodeCp& l, ShardedKvCache& cache, py::handle q, py::handle k, py::handle v) {
             l.set_stream(cache_stream(cache));
             return decode_out(l.decode(cache, view_of(q, "q_new"), view_of(k, "k_new"), view_of(v, "v_new")));
           })
      .def("q_head_offset", &MhaDecodeCp::q_head_offset, py::arg("q_heads"));

  py::class_<DsaDecodeConfig> dsa(m, "DsaDecodeConfig");
  dsa.def(py::init([](const std::string& shard, std::int64_t interleave, std::int64_t topk, std::int64_t dim_v,
                      double scale, std::int64_t window, const std::string& select) {
            return DsaDecodeConfig{parse_cache_shard(shard),     interleave, topk, dim_v, scale, window,
                                   parse_dsa_select_mode(select)};
          }),
          py::arg("shard") = "interleave", py::arg("interleave") = 1, py::arg("topk") = attn::kDsaTopK,
          py::arg("dim_v") = attn::kDsaHeadDimV, py::arg("scale") = 0.0, py::arg("window") = 0,
          py::arg("prefill_select") = "ring");

  py::class_<DsaDecodeCp>(m, "DsaDecodeCp", "DSA inference over a token-sharded cache with a global top-k")
      .def(py::init([groups_of](py::handle grid, const DsaDecodeConfig& c) {
             return std::make_unique<DsaDecodeCp>(groups_of(grid), c);
           }),
           py::arg("grid"), py::arg("config"), py::keep_alive<1, 2>())
      .def(
          "make_cache",
          [](const DsaDecodeCp& l, std::int64_t batch, std::int64_t capacity, std::int64_t index_dim,
             std::int64_t latent_dim, const std::string& dtype) {
            return l.make_cache(batch, capacity, index_dim, latent_dim, parse_dtype(dtype));
          },
          py::arg("batch"), py::arg("capacity"), py::arg("index_dim"), py::arg("latent_dim"), py::arg("dtype"))
      .def("prefill",
           [](DsaDecodeCp& l, ShardedDsaCache& cache, const SequenceLayout& layout, py::handle q, py::handle c,
              py::handle q_idx, py::handle k_idx, py::handle w) {
             DsaPrefillOutput r = l.prefill(cache, layout, view_of(q, "q"), view_of(c, "c"), view_of(q_idx, "q_idx"),
                                            view_of(k_idx, "k_idx"), view_of(w, "w"));
             return py::make_tuple(to_torch(std::move(r.out)), to_torch(std::move(r.lse)),
                                   to_torch(std::move(r.topk_indices)));
           })
      .def("decode", [](DsaDecodeCp& l, ShardedDsaCache& cache, py::handle q, py::handle c, py::handle q_idx,
                        py::handle k_idx, py::handle w) {
        DsaDecodeOutput r = l.decode(cache, view_of(q, "q_new"), view_of(c, "c_new"), view_of(q_idx, "q_idx_new"),
                                     view_of(k_idx, "k_idx_new"), view_of(w, "w_new"));
        return py::make_tuple(to_torch(std::move(r.out)), to_torch(std::move(r.lse)),
                              to_torch(std::move(r.topk_indices)));
      });

  py::class_<GdnDecodeCp>(m, "GdnDecodeCp", "GDN inference with the value heads split over the CP group")
      .def(py::init([groups_of](py::handle grid, const GdnCpConfig& c, std::int64_t value_heads, std::int64_t key_heads,
                                const ShortConvCpConfig& conv) {
             return std::make_unique<GdnDecodeCp>(groups_of(grid), c, value_heads, key_heads, conv);
           }),
           py::arg("grid"), py::arg("config"), py::arg("value_heads"), py::arg("key_heads"),
           py::arg("conv") = ShortConvCpConfig{}, py::keep_alive<1, 2>())
      .def_property_readonly("local_value_heads", &GdnDecodeCp::local_value_heads)
      .def_property_readonly("local_key_heads", &GdnDecodeCp::local_key_heads)
      .def_property_readonly("head_offset", &GdnDecodeCp::head_offset)
      .def(
          "make_cache",
          [](const GdnDecodeCp& l, std::int64_t batch, std::int64_t key_dim, std::int64_t value_dim,
             const std::string& dtype, std::int64_t conv_width) {
            return l.make_cache(batch, key_dim, value_dim, parse_dtype(dtype), conv_width);
          },
          py::arg("batch"), py::arg("key_dim"), py::arg("value_dim"), py::arg("dtype"), py::arg("conv_width") = 0)
      .def(
          "prefill",
          [](GdnDecodeCp& l, attn::GdnCache& cache, const SequenceLayout& layout, py::handle q, py::handle k,
             py::handle v, py::handle g, py::handle beta, py::handle initial_state, py::handle conv_weight) {
            return to_torch(l.prefill(cache, layout, view_of(q, "q"), view_of(k, "k"), view_of(v, "v"), view_of(g, "g"),
                                      view_of(beta, "beta"), view_of(initial_state, "initial_state"),
                                      view_of(conv_weight, "conv_weight"))
                                .out);
          },
          py::arg("cache"), py::arg("layout"), py::arg("q"), py::arg("k"), py::arg("v"), py::arg("g"), py::arg("beta"),
          py::arg("initial_state") = py::none(), py::arg("conv_weight") = py::none())
      .def(
          "decode",
          [](GdnDecodeCp& l, attn::GdnCache& cache, py::handle q, py::handle k, py::handle v, py::handle g,
             py::handle beta, py::handle conv_weight) {
            return to_torch(l.decode(cache, view_of(q, "q_new"), view_of(k, "k_new"), view_of(v, "v_new"),
                                     view_of(g, "g_new"), view_of(beta, "beta_new"),
                                     view_of(conv_weight, "conv_weight"))
                                .out);
          },
          py::arg("cache"), py::arg("q"), py::arg("k"), py::arg("v"), py::arg("g"), py::arg("beta"),
          py::arg("conv_weight") = py::none());
}

}  // namespace seqpar::python
