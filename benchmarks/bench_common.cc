#include "benchmarks/bench_common.h"

#include "seqpar_git_commit.h"  // generated: SEQPAR_GIT_COMMIT

#include <mpi.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>

#include "parallel/cp_common.h"
#include "runtime/error.h"
#include "runtime/mpi_comm.h"
#include "runtime/version.h"

namespace seqpar::bench {
namespace {

// Whether a file can be created in `dir` (a probe file, removed again).
bool can_create_in(const std::filesystem::path& dir) {
  std::error_code ec;
  if (!std::filesystem::is_directory(dir, ec)) return false;
  const std::filesystem::path probe_path = dir / ".seqpar_bench_write_probe";
  const bool ok = std::ofstream(probe_path).good();
  std::filesystem::remove(probe_path, ec);
  return ok;
}

}  // namespace

WorldPlace mpi_world_place() {
  WorldPlace p;
  SEQPAR_CHECK_MPI(MPI_Comm_size(MPI_COMM_WORLD, &p.size));
  SEQPAR_CHECK_MPI(MPI_Comm_rank(MPI_COMM_WORLD, &p.rank));
  return p;
}

NodeInfo node_info() {
  NodeInfo n;
  char name[256] = {};
  n.host = gethostname(name, sizeof name - 1) == 0 ? name : "unknown";
  MPI_Comm node = MPI_COMM_NULL;
  SEQPAR_CHECK_MPI(MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node));
  const int ok = MPI_Comm_size(node, &n.ranks_per_node);
  MPI_Comm_free(&node);
  SEQPAR_CHECK(ok == MPI_SUCCESS, "MPI_Comm_size of the node communicator failed");
  const long cores = sysconf(_SC_NPROCESSORS_ONLN);
  n.cores_per_node = cores > 0 ? static_cast<int>(cores) : 1;
  return n;
}

std::string oversubscription_warning(const NodeInfo& node, int threads_per_rank) {
  const long used = static_cast<long>(node.ranks_per_node) * threads_per_rank;
  if (used <= node.cores_per_node) return "";
  return str_cat("ranks per node ", node.ranks_per_node, " x threads per rank ", threads_per_rank, " = ", used,
                 " exceeds the ", node.cores_per_node, " cores of node ", node.host,
                 " (oversubscribed: timings are not meaningful)");
}

std::string single_copy_note(const NodeInfo& node) {
  const char* mech = std::getenv("OMPI_MCA_btl_vader_single_copy_mechanism");
  if (node.ranks_per_node < 2 || mech == nullptr) return "";
  const std::string m = mech;
  if (m != "none" && m != "emulated") return "";
  return str_cat("OMPI_MCA_btl_vader_single_copy_mechanism=", m,
                 ": large messages between ranks of a node are copied twice and move only inside MPI calls, so "
                 "ring transfers show as exposed communication (unset it where cross-memory attach works: "
                 "scripts/mpi_single_copy.sh)");
}

std::string utc_now_iso8601() {
  const std::time_t now = std::time(nullptr);
  std::tm utc{};
  gmtime_r(&now, &utc);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &utc);
  return buf;
}

const char* git_commit() { return SEQPAR_GIT_COMMIT; }  // seqpar_git_commit.h, written at every build

std::optional<cxxopts::ParseResult> parse_command_line(cxxopts::Options& spec, int argc, char** argv, int world_rank,
                                                       const std::vector<std::string>& help_groups) {
  cxxopts::ParseResult r;
  try {
    r = spec.parse(argc, argv);
  } catch (const cxxopts::exceptions::exception& e) {
    SEQPAR_THROW("bad command line: ", e.what(), " (see --help)");
  }
  const char* exit_flag = r.count("help") ? "--help" : r.count("version") ? "--version" : nullptr;
  if (exit_flag != nullptr) {
    check_ranks_agree(options_fingerprint_start(spec.program(), exit_flag));  // every rank leaves, or every rank stops
    if (world_rank == 0 && r.count("help")) std::fputs(spec.help(help_groups).c_str(), stdout);
    if (world_rank == 0 && !r.count("help")) std::printf("%s (seqpar) %s\n", spec.program().c_str(), version());
    return std::nullopt;
  }
  if (!r.unmatched().empty()) {
    const std::string& extra = r.unmatched().front();
    // "--causal false": a switch takes its value after '=' (cxxopts leaves the word unmatched)
    std::string hint;
    for (int i = 2; i < argc && (extra == "true" || extra == "false"); ++i) {
      if (extra == argv[i] && std::string_view(argv[i - 1]).starts_with("--")) {
        hint = str_cat("; a switch takes its value after '=': ", argv[i - 1], "=", extra);
        break;
      }
    }
    SEQPAR_THROW("unexpected argument '", extra, "' (every option is a --flag; see --help)", hint);
  }
  return r;
}

Fingerprint options_fingerprint_start(std::string_view program, const char* exit_flag) {
  Fingerprint fp(str_cat(program, " options"));
  fp.add_text("--help / --version", exit_flag != nullptr ? exit_flag : "(neither)");
  return fp;
}

void check_ranks_agree(const Fingerprint& options) {
  AgreementCheck(AgreementMode::kAlways).run(*MpiCommunicator::world(), options);
}

std::int64_t parse_size(const std::string& text, const char* flag) {
  SEQPAR_CHECK(!text.empty(), "--", flag, ": empty value (expected an integer, optionally with a K or M suffix)");
  std::size_t digits = 0;
  while (digits < text.size() && std::isdigit(static_cast<unsigned char>(text[digits]))) ++digits;
  const std::string suffix = text.substr(digits);
  std::int64_t mult = 1;
  if (suffix == "k" || suffix == "K") {
    mult = 1024;
  } else if (suffix == "m" || suffix == "M") {
    mult = 1024 * 1024;
  } else {
    SEQPAR_CHECK(suffix.empty(), "--", flag, " ", text,
                 ": not a size (expected a non-negative integer, optionally with a K or M suffix: 4096, 8K, 1M)");
  }
  SEQPAR_CHECK(digits > 0, "--", flag, " ", text,
               ": not a size (expected a non-negative integer, optionally with a K or M suffix: 4096, 8K, 1M)");
  SEQPAR_CHECK(digits <= 12, "--", flag, " ", text,
               ": too large (a size has at most 12 digits, below 10^12, before its K or M suffix)");
  return std::stoll(text.substr(0, digits)) * mult;
}

std::vector<std::string> split_commas(const std::string& text) {
  std::vector<std::string> out;
  for (std::size_t b = 0; b <= text.size();) {
    const std::size_t e = std::min(text.find(',', b), text.size());
    out.push_back(text.substr(b, e - b));
    b = e + 1;
  }
  return out;
}

double now_s() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

double median(std::vector<double> v) {
  SEQPAR_ASSERT(!v.empty(), "median of no values");
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

void all_reduce(Communicator& comm, std::vector<double>& values, ReduceOp op, double timeout_s) {
  if (values.empty()) return;
  TensorView view(values.data(), DType::kFloat64, {static_cast<std::int64_t>(values.size())});
  WorkHandle w = comm.all_reduce(view, op);
  if (timeout_s > 0) {
    w->wait(timeout_s);
  } else {
    w->wait();
  }
}

void barrier(Communicator& comm, double timeout_s) {
  WorkHandle w = comm.barrier();
  if (timeout_s > 0) {
    w->wait(timeout_s);
  } else {
    w->wait();
  }
}

// Each through a probe file in the target directory, on rank 0 only.
void check_output_paths(Communicator& world, const std::string& json_path, const std::string& dump_dir) {
  std::int32_t bad[2] = {0, 0};  // json, dump
  if (world.rank() == 0) {
    // First, so that --json may name a file in the --dump directory.
    if (!dump_dir.empty()) {
      std::error_code ec;
      std::filesystem::create_directories(dump_dir, ec);
      bad[1] = !ec && can_create_in(dump_dir) ? 0 : 1;
    }
    if (!json_path.empty()) {
      const std::filesystem::path dir = std::filesystem::path(json_path).parent_path();
      bad[0] =
          can_create_in(dir.empty() ? std::filesystem::path(".") : dir) && !std::filesystem::is_directory(json_path)
              ? 0
              : 1;
    }
  }
  world.all_reduce(TensorView(bad, DType::kInt32, {2}), ReduceOp::kMax)->wait();
  SEQPAR_CHECK(!bad[0], "--json ", json_path,
               ": cannot create a file in its directory (checked on rank 0, which writes it)");
  SEQPAR_CHECK(!bad[1], "--dump ", dump_dir,
               ": cannot create the directory or write into it (checked on rank 0, which writes it)");
}

}  // namespace seqpar::bench
