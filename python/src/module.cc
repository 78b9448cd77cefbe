// seqpar._seqpar: the pybind11 bindings under the Python package seqpar (python/seqpar; docs/python.md,
// docs/design.md, "Python module"). One binding per C++ class, with the C++ names: CpGrid, SequenceLayout, the layers'
// configuration structs and the CP layers' forward / backward. Tensors cross as DLPack views (dlpack_bridge.h): the
// inputs are the caller's torch tensors, the outputs seqpar Tensors handed to torch, neither copied. A layer's
// forward returns its CpContext as an opaque Context object for the backward (which consumes it).
// seqpar::Error becomes seqpar.Error (a RuntimeError) with the same message. A build without MPI
// (SEQPAR_WITH_MPI=OFF) has only the torch.distributed grids: world(), mpi4py communicators and CpGrid over MPI raise.
#if SEQPAR_WITH_MPI
#include <mpi.h>
#endif
#include <pybind11/pybind11.h>
#include <cstdio>
#include <cstdlib>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "decode_bindings.h"
#include "dlpack_bridge.h"
#include "parallel/cp_common.h"
#include "parallel/dsa_cp.h"
#include "parallel/gdn_cp.h"
#include "parallel/layout.h"
#include "parallel/usp.h"
#include "runtime/error.h"
#if SEQPAR_WITH_MPI
#include "runtime/mpi_comm.h"
#endif
#include "runtime/cp_grid.h"
#include "runtime/version.h"
#include "torch_comm.h"

namespace py = pybind11;
using namespace seqpar;
using python::int64_tensor;
using python::to_torch;
using python::view_of;

namespace {

std::shared_ptr<Communicator> g_world;

#if SEQPAR_WITH_MPI
// MPI for the process: initialised at the first communicator (unless mpi4py or the caller already did), finalised
// by finalize() (registered with atexit by the package), which finalises only what this module initialised.
std::unique_ptr<MpiSession> g_session;

void ensure_mpi() {
  if (g_session) return;
  int argc = 0;
  char** argv = nullptr;
  g_session = std::make_unique<MpiSession>(&argc, &argv);
}

std::shared_ptr<Communicator> world() {
  ensure_mpi();
  if (!g_world) g_world = MpiCommunicator::world();
  return g_world;
}

// An mpi4py communicator, duplicated (seqpar's traffic never mixes with the caller's) and owned by the result.
std::shared_ptr<Communicator> from_mpi4py(const py::object& comm) {
  ensure_mpi();
  const auto address = py::module_::import("mpi4py.MPI").attr("_addressof")(comm).cast<std::uintptr_t>();
  MPI_Comm handle = *reinterpret_cast<MPI_Comm*>(address);
  MPI_Comm dup = MPI_COMM_NULL;
  SEQPAR_CHECK(MPI_Comm_dup(handle, &dup) == MPI_SUCCESS, "MPI_Comm_dup of the mpi4py communicator failed");
  auto result = std::make_shared<MpiCommunicator>(dup, /*owned=*/true);
  result->set_name("mpi4py");
  return result;
}
#else
[[noreturn]] void no_mpi(const char* what) {
  SEQPAR_THROW(what, ": this build of seqpar has no MPI (configured with SEQPAR_WITH_MPI=OFF); launch with torchrun "
               "and pass a torch.distributed group (seqpar.torch_grid(process_group=...) or device_mesh=, or the "
               "layers' process_group= / device_mesh= keywords; docs/python.md)");
}
std::shared_ptr<Communicator> world() { no_mpi("seqpar.world() (the MPI world)"); }
std::shared_ptr<Communicator> from_mpi4py(const py::object&) { no_mpi("a communicator from mpi4py"); }
#endif

// The grid with the communicator it was built over (the process's world, or a duplicate of an mpi4py one), or a
// grid over torch.distributed groups (python/src/torch_comm.h) with torch's world.
struct Grid {
  std::shared_ptr<Communicator> world;
  CpGrid grid;
  Grid(std::shared_ptr<Communicator> w, const CpGridConfig& config)
      : world(launched_alone(std::move(w), config)), grid(*world, config) {}
  Grid(std::shared_ptr<Communicator> w, CpGrid&& g) : world(std::move(w)), grid(std::move(g)) {}

  // A world of one process asked for a grid of more: the error says how to start the processes (a plain `python`
  // run, or torchrun, whose processes MPI does not connect, gives each process an MPI world of its own).
  static std::shared_ptr<Communicator> launched_alone(std::shared_ptr<Communicator> w, const CpGridConfig& c) {
    const std::int64_t n = std::int64_t{c.dp_size} * c.ulysses_size * c.ring_size;
    SEQPAR_CHECK(w->size() != 1 || n <= 1 || c.dp_size < 1 || c.ulysses_size < 1 || c.ring_size < 1,
                 "CpGrid: dp_size ", c.dp_size, " x ulysses_size ", c.ulysses_size, " x ring_size ", c.ring_size,
                 " needs ", n, " processes, but this one is alone (MPI world size 1): start ", n,
                 " with an MPI launcher, e.g. `mpirun -np ", n, " python3 script.py` (docs/python.md). A plain "
                 "`python` run is one process; under torchrun, build the grid from the torch.distributed group "
                 "instead: seqpar.torch_grid(process_group=dist.group.WORLD) (or ulysses_group= and ring_group=, "
                 "or device_mesh=; MPI does not connect torchrun's processes)");
    return w;
  }
};

std::shared_ptr<Communicator> resolve_comm(const py::object& comm) {
  if (comm.is_none()) return world();
  if (py::isinstance<Communicator>(comm)) return comm.cast<std::shared_ptr<Communicator>>();
  return from_mpi4py(comm);
}

// A list of ints or a 1-D integer torch tensor (anything with tolist()) as int64 values (cu_seqlens); anything else
// (floats, nested lists, values outside int64) is refused naming `what`.
std::vector<std::int64_t> int64_list(py::handle values, const char* what) {
  py::object obj = py::reinterpret_borrow<py::object>(values);
  if (py::hasattr(obj, "tolist")) {
    try {
      obj = obj.attr("tolist")();
    } catch (py::error_already_set& e) {  // a tensor without data (the meta device): torch's NotImplementedError
      const std::string device = py::hasattr(values, "device") ? std::string(py::str(values.attr("device"))) : "?";
      SEQPAR_THROW(what, ": the values of a tensor on device '", device, "' cannot be read (", e.what(),
                   "); pass a list of ints or a CPU integer tensor");
    }
  }
  SEQPAR_CHECK(py::isinstance<py::list>(obj) || py::isinstance<py::tuple>(obj), what,
               ": expected a list of ints or a 1-D integer tensor, got ",
               std::string(py::str(py::type::of(values).attr("__name__"))));
  std::vector<std::int64_t> out;
  std::size_t i = 0;
  for (const py::handle item : obj) {
    SEQPAR_CHECK(py::isinstance<py::int_>(item) && !py::isinstance<py::bool_>(item), what, "[", i, "] = ",
                 std::string(py::repr(item)), " is not an int: ", what, " holds integer token offsets");
    try {
      out.push_back(item.cast<std::int64_t>());
    } catch (const py::cast_error&) {
      SEQPAR_THROW(what, "[", i, "] = ", std::string(py::repr(item)), " does not fit in int64");
    }
    ++i;
  }
  return out;
}

ReduceOp parse_reduce_op(const std::string& op) {
  static constexpr const char* kNames[] = {"sum", "max"};
  return static_cast<ReduceOp>(parse_option_index(op, kNames, "reduce op"));
}

// A string property over an enum field with name / parse functions.
template <typename Class, typename Enum>
void enum_property(py::class_<Class>& cls, const char* name, Enum Class::*field, const char* (*to_name)(Enum),
                   Enum (*parse)(std::string_view)) {
  cls.def_property(
      name, [field, to_name](const Class& c) { return std::string(to_name(c.*field)); },
      [field, parse](Class& c, const std::string& value) { c.*field = parse(value); });
}

// Read-write attributes for the plain fields of a configuration struct: def_fields(cls, {"name", &Config::field}, ...).
template <typename Class, typename... Members>
void def_fields(py::class_<Class>& cls, std::pair<const char*, Members Class::*>... fields) {
  (cls.def_readwrite(fields.first, fields.second), ...);
}

py::tuple attention_grads(MhaCpGrads&& g) {
  return py::make_tuple(to_torch(std::move(g.dq)), to_torch(std::move(g.dk)), to_torch(std::move(g.dv)),
                        g.dsinks.defined() ? to_torch(std::move(g.dsinks)) : py::none());
}

// The constructor of every CP layer binding, Layer(grid, layout, config); the layer keeps the grid (which owns the
// communicators) alive.
template <typename Layer, typename Config>
void def_layer_init(py::class_<Layer>& cls) {
  cls.def(py::init([](const Grid& g, const SequenceLayout& layout, const Config& config) {
            return std::make_unique<Layer>(CpGroups::from(g.grid), layout, config);
          }),
          py::arg("grid"), py::arg("layout"), py::arg("config"), py::keep_alive<1, 2>());
}

// A CP layer binding with its constructor and the accessors of its layout and this rank's positions.
template <typename Layer, typename Config>
py::class_<Layer> bind_layer(py::module_& m, const char* name, const char* doc) {
  py::class_<Layer> cls(m, name, doc);
  def_layer_init<Layer, Config>(cls);
  cls.def_property_readonly("layout", [](const Layer& l) { return l.layout(); })
      .def_property_readonly("positions", [](const Layer& l) { return int64_tensor(l.positions()); });
  return cls;
}

// The MPI session (finalize, abort), communicators: world and mpi4py ones.
void bind_runtime(py::module_& m) {
  m.def(
      "finalize",
      [] {
        g_world.reset();
#if SEQPAR_WITH_MPI
        g_session.reset();
#endif
      },
      "Frees the world communicator and finalises MPI when seqpar initialised it (registered with atexit).");
#if SEQPAR_WITH_MPI
  m.def(
      "abort", [](int code) { MPI_Abort(MPI_COMM_WORLD, code); }, py::arg("code") = 1,
      "MPI_Abort(MPI_COMM_WORLD, code): stops every rank of the job.");
  m.def("mpi_initialized", [] {
    int flag = 0;
    MPI_Initialized(&flag);
    return flag != 0;
  });
#else
  m.def(
      "abort",
      [](int code) {
        std::fflush(stdout);
        std::fflush(stderr);
        std::_Exit(code);
      },
      py::arg("code") = 1, "Ends this process at once (a build without MPI: the launcher stops the others).");
  m.def("mpi_initialized", [] { return false; });
#endif
  m.attr("with_mpi") = py::bool_(SEQPAR_WITH_MPI != 0);

  py::class_<Communicator, std::shared_ptr<Communicator>>(m, "Communicator",
                                                          "A seqpar communicator: world, a grid's group (MPI, or "
                                                          "torch.distributed for seqpar.torch_grid), or a duplicate "
                                                          "of an mpi4py communicator")
      .def_property_readonly("rank", &Communicator::rank)
      .def_property_readonly("size", &Communicator::size)
      .def_property_readonly("name", &Communicator::name)
      .def(
          "all_reduce",
          [](Communicator& c, py::handle tensor, const std::string& op) {
            c.all_reduce(view_of(tensor, "all_reduce tensor"), parse_reduce_op(op))->wait();
          },
          py::arg("tensor"), py::arg("op") = "sum", "In place on every rank (collective); op 'sum' or 'max'.")
      .def(
          "broadcast",
          [](Communicator& c, py::handle tensor, int root) {
            c.broadcast(view_of(tensor, "broadcast tensor"), root)->wait();
          },
          py::arg("tensor"), py::arg("root") = 0)
      .def("barrier", [](Communicator& c) { c.barrier()->wait(); })
      .def(
          "_all_reduce_fake_device_buffer",
          [](Communicator& c, int index) {
            // Only where the buffer is refused before it is read: a torch.distributed group without nccl.
            const std::string backend = c.backend_name();
            SEQPAR_CHECK(backend.rfind("torch", 0) == 0 && backend.find("nccl") == std::string::npos,
                         "_all_reduce_fake_device_buffer: only for a torch.distributed group without nccl, not ",
                         backend);
            const TensorView fake(reinterpret_cast<void*>(std::uintptr_t{0x1000}), DType::kFloat32, {4},
                                  Device::cuda(index));
            c.all_reduce(fake, ReduceOp::kSum)->wait();
          },
          py::arg("index") = 0,
          "Test hook: an all_reduce of 4 fp32 at a fake address on cuda:index, which a torch.distributed group "
          "without nccl refuses before any message (the address is never read).");
  // What a Python layer decides beside the C++ layer's own fields (whether a backward follows, DSA's loss mode):
  // ranks that differ there would pair a collective of one rank with another's different one (a hang until the
  // communication timeout), so the layer checks them like the C++ layers check theirs (parallel/cp_common.h).
  py::class_<AgreementCheck>(m, "AgreementCheck",
                             "The agreement check of one Python entry point (parallel/cp_common.h): run(comm, call, "
                             "fields) raises seqpar.Error on every rank of comm when the ranks pass different fields")
      .def(py::init<>())
      .def(
          "run",
          [](AgreementCheck& check, Communicator& comm, const std::string& call,
             const std::vector<std::pair<std::string, std::string>>& fields) {
            Fingerprint fp(call);
            for (const auto& [name, value] : fields) fp.add_text(name, value);
            check.run(comm, fp);
          },
          py::arg("comm"), py::arg("call"), py::arg("fields"),
          "Collective over comm when it runs (SEQPAR_AGREEMENT_CHECK: the first call and every change); fields: "
          "(name, value) text pairs, compared in order.")
      .def_property_readonly("num_checks", &AgreementCheck::num_checks);
  m.def("world", &world, "The process's MPI world (MPI_COMM_WORLD duplicated); initialises MPI if needed.");
  m.def("from_mpi4py", &from_mpi4py, py::arg("comm"), "A seqpar communicator over a duplicate of an mpi4py one.");
}

// The TypeError of CpGrid(...) with arguments it does not take: an unknown keyword is named, with seqpar's name for
// YunChang's (docs/python.md, "Coming from flash-attn, flash-linear-attention or YunChang"); otherwise the signature.
std::string grid_arguments_error(const py::args& args, const py::kwargs& kwargs) {
  static const char* const kSignature =
      "CpGrid(dp_size: int = 1, ulysses_size: int = 1, ring_size: int = 1, placement: str = 'ulysses_inner' | "
      "'ring_inner', comm=None (the MPI world) | an mpi4py communicator)";
  static const std::vector<std::pair<std::string, std::string>> kForeign = {
      {"ulysses_degree", "ulysses_size= (YunChang's ulysses_degree)"},
      {"sp_ulysses_degree", "ulysses_size= (YunChang's sp_ulysses_degree)"},
      {"ring_degree", "ring_size= (YunChang's ring_degree)"},
      {"sp_ring_degree", "ring_size= (YunChang's sp_ring_degree)"}};
  const std::vector<std::string> known = {"dp_size", "ulysses_size", "ring_size", "placement", "comm"};
  for (const auto& [key, value] : kwargs) {
    const std::string name = py::str(key);
    if (std::find(known.begin(), known.end(), name) != known.end()) continue;
    std::string hint;
    for (const auto& [foreign, ours] : kForeign)
      if (foreign == name) hint = str_cat("; seqpar's name: ", ours);
    return str_cat("CpGrid() got an unexpected keyword argument '", name, "'", hint, " (its arguments: ", kSignature,
                   "; docs/python.md, \"Coming from flash-attn, flash-linear-attention or YunChang\")");
  }
  std::string given;
  for (const py::handle a : args) given += str_cat(given.empty() ? "" : ", ", std::string(py::repr(a)));
  for (const auto& [key, value] : kwargs)
    given += str_cat(given.empty() ? "" : ", ", std::string(py::str(key)), "=", std::string(py::repr(value)));
  return str_cat("CpGrid(", given, "): the arguments do not match ", kSignature);
}

// The SP process grid (runtime/cp_grid.h).
void bind_grid(py::module_& m) {
  py::class_<Grid>(m, "CpGrid", "The SP process grid (runtime/cp_grid.h): world = dp x ulysses x ring")
      .def(py::init(
               [](int dp_size, int ulysses_size, int ring_size, const std::string& placement, const py::object& comm) {
                 return std::make_unique<Grid>(
                     resolve_comm(comm), CpGridConfig{dp_size, ulysses_size, ring_size, parse_placement(placement)});
               }),
           py::arg("dp_size") = 1, py::arg("ulysses_size") = 1, py::arg("ring_size") = 1,
           py::arg("placement") = "ulysses_inner", py::arg("comm") = py::none())
      // Arguments the constructor above does not take (pybind11 tries it first): a TypeError naming the keyword and,
      // for another library's name of a field, seqpar's.
      .def(py::init([](const py::args& args, const py::kwargs& kwargs) -> std::unique_ptr<Grid> {
        throw py::type_error(grid_arguments_error(args, kwargs));
      }))
      .def_static(
          "_from_torch",
          [](py::handle world, py::handle ulysses, py::handle ring, py::handle cp, py::handle dp,
             const std::string& placement) {
            std::shared_ptr<Communicator> w = python::torch_communicator_from_spec(world, "world");
            CpGrid grid(python::torch_communicator_from_spec(ulysses, "ulysses"),
                        python::torch_communicator_from_spec(ring, "ring"),
                        python::torch_communicator_from_spec(cp, "cp"), python::torch_communicator_from_spec(dp, "dp"),
                        w->rank(), parse_placement(placement));
            return std::make_unique<Grid>(std::move(w), std::move(grid));
          },
          "A grid over torch.distributed groups, each (process_group or None, world_ranks, rank); use "
          "seqpar.torch_grid, which checks the groups across ranks first.")
      .def_property_readonly("dp_size", [](const Grid& g) { return g.grid.config().dp_size; })
      .def_property_readonly("ulysses_size", [](const Grid& g) { return g.grid.config().ulysses_size; })
      .def_property_readonly("ring_size", [](const Grid& g) { return g.grid.config().ring_size; })
      .def_property_readonly("placement",
                             [](const Grid& g) { return std::string(placement_name(g.grid.config().placement)); })
      .def_property_readonly("dp_rank", [](const Grid& g) { return g.grid.coords().dp_rank; })
      .def_property_readonly("ulysses_rank", [](const Grid& g) { return g.grid.coords().ulysses_rank; })
      .def_property_readonly("ring_rank", [](const Grid& g) { return g.grid.coords().ring_rank; })
      .def_property_readonly("cp_rank", [](const Grid& g) { return g.grid.coords().cp_rank; })
      .def_property_readonly("world_rank", [](const Grid& g) { return g.grid.world_rank(); })
      .def_property_readonly("world", [](const Grid& g) { return g.world; })
      // The groups are owned by the grid: borrowed references that keep it alive.
      .def_property_readonly(
          "ulysses", [](const Grid& g) -> Communicator& { return g.grid.ulysses(); },
          py::return_value_policy::reference_internal)
      .def_property_readonly(
          "ring", [](const Grid& g) -> Communicator& { return g.grid.ring(); },
          py::return_value_policy::reference_internal)
      .def_property_readonly(
          "cp", [](const Grid& g) -> Communicator& { return g.grid.cp(); }, py::return_value_policy::reference_internal)
      .def_property_readonly(
          "dp", [](const Grid& g) -> Communicator& { return g.grid.dp(); }, py::return_value_policy::reference_internal)
      .def("__str__", [](const Grid& g) { return g.grid.str(); });
}

// Sequence layouts (parallel/layout.h), the scatter / gather helpers and the context a layer's forward returns.
void bind_layout(py::module_& m) {
  py::class_<SequenceLayout>(
      m, "SequenceLayout",
      "Which tokens each CP rank holds, padded into slots; packed rows of documents (parallel/layout.h)")
      .def(py::init([](const std::string& kind, std::int64_t seq_len, int ring_size, int ulysses_size) {
             return SequenceLayout(parse_layout(kind), seq_len, ring_size, ulysses_size);
           }),
           py::arg("kind"), py::arg("seq_len"), py::arg("ring_size"), py::arg("ulysses_size") = 1)
      .def_static(
          "for_grid",
          [](const Grid& g, std::int64_t seq_len, const std::string& kind) {
            return SequenceLayout::for_groups(CpGroups::from(g.grid), seq_len, parse_layout(kind));
          },
          py::arg("grid"), py::arg("seq_len"), py::arg("kind") = "zigzag")
      .def_static(
          "packed",
          [](const std::string& kind, py::handle cu_seqlens, int ring_size, int ulysses_size) {
            return SequenceLayout::packed(parse_layout(kind), int64_list(cu_seqlens, "cu_seqlens"), ring_size, ulysses_size);
          },
          py::arg("kind"), py::arg("cu_seqlens"), py::arg("ring_size"), py::arg("ulysses_size") = 1,
          "One packed row: cu_seqlens [N+1] (list or int64 tensor; 0, non-decreasing, last = T >= 1).")
      .def_static(
          "packed_for_grid",
          [](const Grid& g, py::handle cu_seqlens, const std::string& kind) {
            return SequenceLayout::packed_for_groups(CpGroups::from(g.grid), int64_list(cu_seqlens, "cu_seqlens"),
                                                     parse_layout(kind));
          },
          py::arg("grid"), py::arg("cu_seqlens"), py::arg("kind") = "zigzag")
      .def_property_readonly("kind", [](const SequenceLayout& l) { return std::string(layout_name(l.kind())); })
      .def_property_readonly("padded_len", &SequenceLayout::padded_len)
      .def_property_readonly("is_packed", &SequenceLayout::is_packed)
      .def_property_readonly("cu_seqlens",
                             [](const SequenceLayout& l) {
                               const auto cu = l.cu_seqlens();
                               return int64_tensor(std::vector<std::int64_t>(cu.begin(), cu.end()));
                             })
      .def(
          "token_index", [](const SequenceLayout& l, int cp_rank) { return int64_tensor(l.token_index(cp_rank)); },
          py::arg("cp_rank"), "Per local row of this CP rank: its token in [0, seq_len), or -1 for padding.")
      .def(
          "rope_positions",
          [](const SequenceLayout& l, int cp_rank) { return int64_tensor(l.rope_positions(cp_rank)); },
          py::arg("cp_rank"), "Per local row: the offset inside its document (0 for padding), for RoPE.")
      .def_property_readonly("seq_len", &SequenceLayout::seq_len)
      .def_property_readonly("ring_size", &SequenceLayout::ring_size)
      .def_property_readonly("ulysses_size", &SequenceLayout::ulysses_size)
      .def_property_readonly("num_ranks", &SequenceLayout::num_ranks)
      .def_property_readonly("local_len", &SequenceLayout::local_len)
      .def(
          "positions", [](const SequenceLayout& l, int cp_rank) { return int64_tensor(l.positions(cp_rank)); },
          py::arg("cp_rank"), "This CP rank's increasing slot positions in [0, padded_len) (torch int64).")
      .def(
          "ring_shard_positions",
          [](const SequenceLayout& l, int ring_rank) { return int64_tensor(l.ring_shard_positions(ring_rank)); },
          py::arg("ring_rank"))
      .def_property_readonly("num_docs", &SequenceLayout::num_docs)
      .def("__repr__", [](const SequenceLayout& l) {
        // The kind, the sizes and what the kind made of them (the padded length); for a packed row the number of
        // documents, not cu_seqlens itself (it may be long).
        return str_cat("SequenceLayout(kind='", layout_name(l.kind()), "', seq_len=", l.seq_len(),
                       ", padded_len=", l.padded_len(), ", ring_size=", l.ring_size(),
                       ", ulysses_size=", l.ulysses_size(),
                       l.is_packed() ? str_cat(", num_docs=", l.num_docs()) : std::string(), ")");
      });

  m.def(
      "scatter_sequence",
      [](const Grid& g, const SequenceLayout& layout, py::handle full, py::handle local, int root) {
        scatter_sequence(g.grid.cp(), layout, view_of(full, "full"), view_of(local, "local"), root);
      },
      py::arg("grid"), py::arg("layout"), py::arg("full"), py::arg("local"), py::arg("root") = 0);
  m.def(
      "gather_sequence",
      [](const Grid& g, const SequenceLayout& layout, py::handle local, py::handle full, int seq_dim) {
        gather_sequence(g.grid.cp(), layout, view_of(local, "local"), view_of(full, "full"), seq_dim);
      },
      py::arg("grid"), py::arg("layout"), py::arg("local"), py::arg("full"), py::arg("seq_dim") = 1);

  py::class_<CpContext>(m, "Context", "What a forward saved for its backward (consumed by the backward)")
      .def_property_readonly("live", &CpContext::live);
}

// MHA / GQA: MhaCp (ring when ulysses_size = 1, Ulysses when ring_size = 1) and its config.
void bind_mha(py::module_& m) {
  py::class_<MhaCpConfig> mha_config(m, "MhaCpConfig");
  mha_config.def(py::init([](const std::string& impl, bool causal, std::int64_t window, double scale, double softcap,
                             double dropout_p, std::uint64_t dropout_seed) {
                   MhaCpConfig c;
                   c.impl = parse_ring_impl(impl);
                   c.causal = causal;
                   c.window = window;
                   c.scale = scale;
                   c.score_mods.softcap = softcap;
                   c.dropout = {dropout_p, dropout_seed};
                   return c;
                 }),
                 py::arg("impl") = "p2p", py::arg("causal") = true, py::arg("window") = 0, py::arg("scale") = 0.0,
                 py::arg("softcap") = 0.0, py::arg("dropout_p") = 0.0, py::arg("dropout_seed") = 0);
  enum_property(mha_config, "impl", &MhaCpConfig::impl, ring_impl_name, parse_ring_impl);
  def_fields(mha_config, std::pair{"causal", &MhaCpConfig::causal},
             std::pair{"window", &MhaCpConfig::window}, std::pair{"scale", &MhaCpConfig::scale});
  mha_config
      .def_property(
          "softcap", [](const MhaCpConfig& c) { return c.score_mods.softcap; },
          [](MhaCpConfig& c, double v) { c.score_mods.softcap = v; })
      .def_property(
          "dropout_p", [](const MhaCpConfig& c) { return c.dropout.p; },
          [](MhaCpConfig& c, double v) { c.dropout.p = v; })
      .def_property(
          "dropout_seed", [](const MhaCpConfig& c) { return c.dropout.seed; },
          [](MhaCpConfig& c, std::uint64_t v) { c.dropout.seed = v; })
      // ALiBi slopes and sinks are views: the caller keeps the tensors alive while a layer made from this
      // configuration is used (seqpar.MhaCp holds them).
      .def(
          "set_score_tensors",
          [](MhaCpConfig& c, py::handle alibi_slopes, py::handle sinks) {
            c.score_mods.alibi_slopes = view_of(alibi_slopes, "alibi_slopes");
            c.score_mods.sinks = view_of(sinks, "sinks");
          },
          py::arg("alibi_slopes") = py::none(), py::arg("sinks") = py::none(),
          "[Hq] fp32 / fp64 tensors (None: off), viewed without a copy.");
  m.def("alibi_slopes", &attn::alibi_slopes, py::arg("num_heads"),
        "The ALiBi slopes of Press et al. 2022 for num_heads heads (a list of floats).");

  bind_layer<MhaCp, MhaCpConfig>(m, "MhaCp", "MHA / GQA under USP (parallel/usp.h)")
      .def("forward",
           [](MhaCp& a, py::handle q, py::handle k, py::handle v) {
             const TensorView qv = view_of(q, "q");
             a.set_stream(python::current_stream(qv));  // CUDA tensors: torch's current stream
             MhaCpOutput r = a.forward(qv, view_of(k, "k"), view_of(v, "v"));
             return py::make_tuple(to_torch(std::move(r.out)), to_torch(std::move(r.lse)), std::move(r.ctx));
           })
      .def(
          "backward",
          [](MhaCp& a, CpContext& ctx, py::handle dout, py::handle dlse) {
            const TensorView dv = view_of(dout, "dout");
            a.set_stream(python::current_stream(dv));
            return attention_grads(a.backward(std::move(ctx), dv, view_of(dlse, "dlse")));
          },
          py::arg("ctx"), py::arg("dout"), py::arg("dlse") = py::none());
}

// GDN and its short conv under CP.
void bind_gdn(py::module_& m) {
  py::class_<GdnCpConfig> gdn_config(m, "GdnCpConfig");
  gdn_config.def(py::init([](const std::string& mode, bool use_qk_l2norm, double scale, std::int64_t chunk_size,
                             bool save_inputs) {
                   GdnCpConfig c{parse_gdn_cp_mode(mode), use_qk_l2norm, scale, chunk_size};
                   c.save_inputs = save_inputs;
                   return c;
                 }),
                 py::arg("mode") = "scan", py::arg("use_qk_l2norm") = true, py::arg("scale") = 0.0,
                 py::arg("chunk_size") = attn::kGdnDefaultChunkSize, py::arg("save_inputs") = true);
  enum_property(gdn_config, "mode", &GdnCpConfig::mode, gdn_cp_mode_name, parse_gdn_cp_mode);
  def_fields(gdn_config, std::pair{"use_qk_l2norm", &GdnCpConfig::use_qk_l2norm},
             std::pair{"scale", &GdnCpConfig::scale}, std::pair{"chunk_size", &GdnCpConfig::chunk_size},
             std::pair{"save_inputs", &GdnCpConfig::save_inputs});

  bind_layer<GdnCp, GdnCpConfig>(m, "GdnCp", "Gated delta rule under CP (parallel/gdn_cp.h)")
      .def("forward",
           [](GdnCp& l, py::handle q, py::handle k, py::handle v, py::handle g, py::handle beta,
              py::handle initial_state) {
             GdnCpOutput r = l.forward(view_of(q, "q"), view_of(k, "k"), view_of(v, "v"), view_of(g, "g"),
                                       view_of(beta, "beta"), view_of(initial_state, "initial_state"));
             return py::make_tuple(to_torch(std::move(r.out)), to_torch(std::move(r.final_state)), std::move(r.ctx));
           })
      .def(
          "backward",
          // inputs: the forward's q, k, v, g, beta when the config's save_inputs is false, else None
          [](GdnCp& l, CpContext& ctx, py::handle dout, py::handle dfinal_state, py::handle inputs) {
            GdnCpInputs in;
            if (!inputs.is_none()) {
              const py::tuple t = py::cast<py::tuple>(inputs);
              SEQPAR_CHECK(t.size() == 5, "GdnCp.backward: inputs must be (q, k, v, g, beta), got ", t.size(),
                           " tensors");
              in = {view_of(t[0], "q"), view_of(t[1], "k"), view_of(t[2], "v"), view_of(t[3], "g"),
                    view_of(t[4], "beta")};
            }
            GdnCpGrads r = l.backward(std::move(ctx), view_of(dout, "dout"), view_of(dfinal_state, "dfinal_state"), in);
            return py::make_tuple(to_torch(std::move(r.dq)), to_torch(std::move(r.dk)), to_torch(std::move(r.dv)),
                                  to_torch(std::move(r.dg)), to_torch(std::move(r.dbeta)),
                                  to_torch(std::move(r.dinitial_state)));
          },
          py::arg("ctx"), py::arg("dout"), py::arg("dfinal_state") = py::none(), py::arg("inputs") = py::none());

  py::class_<ShortConvCpConfig>(m, "ShortConvCpConfig")
      .def(py::init([](bool use_silu) { return ShortConvCpConfig{use_silu}; }), py::arg("use_silu") = true)
      .def_readwrite("use_silu", &ShortConvCpConfig::use_silu);

  py::class_<ShortConvCp> short_conv(m, "ShortConvCp",
                                                  "The short causal depthwise conv under CP (parallel/gdn_cp.h)");
  def_layer_init<ShortConvCp, ShortConvCpConfig>(short_conv);
  short_conv
      .def("forward",
           [](ShortConvCp& l, py::handle x, py::handle weight) {
             ShortConvCpOutput r = l.forward(view_of(x, "x"), view_of(weight, "weight"));
             return py::make_tuple(to_torch(std::move(r.out)), std::move(r.ctx));
           })
      .def("backward", [](ShortConvCp& l, CpContext& ctx, py::handle dout, py::handle dweight) {
        return to_torch(l.backward(std::move(ctx), view_of(dout, "dout"), view_of(dweight, "dweight")));
      });
}

// DeepSeek sparse attention under CP.
void bind_dsa(py::module_& m) {
  py::class_<DsaCpConfig> dsa_config(m, "DsaCpConfig");
  dsa_config.def(
      py::init([](const std::string& select, std::int64_t topk, std::int64_t dim_v, double scale, std::int64_t window) {
        return DsaCpConfig{parse_dsa_select_mode(select), topk, dim_v, scale, window};
      }),
      py::arg("select") = "ring", py::arg("topk") = attn::kDsaTopK, py::arg("dim_v") = attn::kDsaHeadDimV,
      py::arg("scale") = 0.0, py::arg("window") = 0);
  enum_property(dsa_config, "select", &DsaCpConfig::select, dsa_select_mode_name, parse_dsa_select_mode);
  def_fields(dsa_config, std::pair{"topk", &DsaCpConfig::topk}, std::pair{"dim_v", &DsaCpConfig::dim_v},
             std::pair{"scale", &DsaCpConfig::scale}, std::pair{"window", &DsaCpConfig::window});

  m.def(
      "dsa_topk_slots_to_tokens",
      [](const SequenceLayout& layout, py::handle topk_indices) {
        dsa_topk_slots_to_tokens(layout, view_of(topk_indices, "topk_indices"));
      },
      py::arg("layout"), py::arg("topk_indices"),
      "Rewrites DsaCp's topk_indices (int64, CPU) in place from the layout's slot positions to token indices of the "
      "row; -1 stays -1 (parallel/dsa_cp.h).");
  bind_layer<DsaCp, DsaCpConfig>(m, "DsaCp", "DeepSeek sparse attention under CP (parallel/dsa_cp.h)")
      .def("forward",
           [](DsaCp& l, py::handle q, py::handle c, py::handle q_idx, py::handle k_idx, py::handle w) {
             DsaCpOutput r = l.forward(view_of(q, "q"), view_of(c, "c"), view_of(q_idx, "q_idx"),
                                       view_of(k_idx, "k_idx"), view_of(w, "w"));
             return py::make_tuple(to_torch(std::move(r.out)), to_torch(std::move(r.lse)),
                                   to_torch(std::move(r.topk_indices)), std::move(r.ctx));
           })
      .def("backward", [](DsaCp& l, CpContext& ctx, py::handle dout, double loss_grad_scale) {
        DsaCpGrads r = l.backward(std::move(ctx), view_of(dout, "dout"), loss_grad_scale);
        return py::make_tuple(to_torch(std::move(r.dq)), to_torch(std::move(r.dc)), to_torch(std::move(r.dq_idx)),
                              to_torch(std::move(r.dk_idx)), to_torch(std::move(r.dw)), r.loss);
      });
}

}  // namespace

PYBIND11_MODULE(_seqpar, m) {
  m.doc() = "seqpar's compiled bindings (use the package seqpar)";
  m.attr("__version__") = version();
#if defined(SEQPAR_WITH_CUDA)
  m.attr("with_cuda") = true;  // the layers that run on CUDA (MhaCp) take CUDA tensors
#else
  m.attr("with_cuda") = false;
#endif
  py::register_exception<Error>(m, "Error", PyExc_RuntimeError);

  bind_runtime(m);
  bind_grid(m);
  bind_layout(m);
  bind_mha(m);
  bind_gdn(m);
  bind_dsa(m);
  python::bind_decode(m, [](py::handle grid) { return CpGroups::from(grid.cast<const Grid&>().grid); });
}
