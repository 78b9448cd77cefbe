#include "runtime/logging.h"

#include <cstdio>

#include "runtime/error.h"

namespace seqpar {

LogLine::~LogLine() {
  static const char* kNames[] = {"ERROR", "WARN", "INFO", "DEBUG"};
  const std::string line =
      str_cat("[seqpar rank ", process_rank(), " ", kNames[static_cast<int>(level_)], "] ", os_.str(), "\n");
  std::fwrite(line.data(), 1, line.size(), stderr);  // one write per line keeps ranks' lines whole
}

}  // namespace seqpar
