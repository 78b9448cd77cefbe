// --json FILE of a benchmark of one process (kernel_bench, ops_bench), which writes it at the end of the run: whether
// that write can work is found out before the run (sp_bench, comm_bench and dyncp_bench: check_output_paths of
// bench_common.h, over their ranks).
#pragma once

#include <unistd.h>

#include <filesystem>
#include <string>

#include "runtime/error.h"

namespace seqpar::bench {

// Errors: the directory of `json_path` does not exist or takes no new file (access(2), W_OK), or `json_path` is a
// directory; the message names --json and the path.
inline void check_json_path(const std::string& json_path) {
  const std::filesystem::path dir = std::filesystem::path(json_path).parent_path();
  const std::string where = dir.empty() ? std::string(".") : dir.string();
  std::error_code ec;
  SEQPAR_CHECK(std::filesystem::is_directory(where, ec) && ::access(where.c_str(), W_OK | X_OK) == 0 &&
                   !std::filesystem::is_directory(json_path, ec),
               "--json ", json_path, ": cannot create a file there (checked before the run, which writes it at the end)");
}

}  // namespace seqpar::bench
