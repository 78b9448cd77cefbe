# The package tests (ctest label `package`), one STEP per ctest: cmake -DSTEP=<step> -D... -P package_test.cmake
#   install         cmake --install of the build tree into WORK_DIR/prefix; checks the installed files, the version
#                   file's answers, the installed benchmarks' --version, first line and JSON "version"
#   headers         every installed header compiles on its own as <seqpar/...> (no internal header missing), with the
#                   package's flags
#   consumer_folders an outside project with its own parallel/ and runtime/ folders (headers named like seqpar's,
#                   first on its include path) includes <seqpar/seqpar.h> and its own headers, builds and runs
#   find_package    examples/ as an outside project with find_package(seqpar 0.2 REQUIRED): configure, build, run
#   pkg_config      the example compiled with the compiler alone and `pkg-config --cflags --libs seqpar`, run
#   add_subdirectory examples/ as an outside project that includes the source tree (CUDA, tests, benchmarks off),
#                   with SEQPAR_NATIVE=ON: -march=native on seqpar's sources only
# Variables: SOURCE_DIR, BUILD_DIR, WORK_DIR, CXX (compiler), LAUNCHER (compiler launcher, may be empty),
# GENERATOR, MPIEXEC, NP_FLAG, VERSION (the project's). The runs use 2 ranks; the environment comes from ctest.
cmake_minimum_required(VERSION 3.24)
set(prefix ${WORK_DIR}/prefix)
set(example ${SOURCE_DIR}/examples/ring_attention_example.cc)

# Runs a command; on a non-zero exit prints its output and fails naming `what`. Output in `run_output`.
function(run what)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${what} failed (exit ${rc}): ${ARGN}\n${out}${err}")
  endif()
  set(run_output "${out}${err}" PARENT_SCOPE)
endfunction()

# Runs `program` under mpirun at 2 ranks and requires the example's success line.
function(run_example program)
  run("the example under ${MPIEXEC} ${NP_FLAG} 2" ${MPIEXEC} ${NP_FLAG} 2 ${program})
  if(NOT run_output MATCHES "ok: matches the single-rank result")
    message(FATAL_ERROR "the example did not report its check:\n${run_output}")
  endif()
  message("${run_output}")
endfunction()

# With SEQPAR_NATIVE=ON, seqpar's own sources compile with -march=native and the consumer's (the example) without.
function(check_native_is_private dir)
  file(READ ${dir}/compile_commands.json db)
  string(JSON n LENGTH "${db}")
  math(EXPR last "${n} - 1")
  set(seen_library FALSE)
  set(seen_example FALSE)
  foreach(i RANGE ${last})
    string(JSON file GET "${db}" ${i} file)
    string(JSON command GET "${db}" ${i} command)
    string(FIND "${command}" "-march=native" native)
    if(file MATCHES "examples/ring_attention_example.cc$")
      set(seen_example TRUE)
      if(native GREATER_EQUAL 0)
        message(FATAL_ERROR "-march=native reached the consumer's target: ${command}")
      endif()
    elseif(file MATCHES "/runtime/tensor.cc$")
      set(seen_library TRUE)
      if(native LESS 0)
        message(FATAL_ERROR "SEQPAR_NATIVE=ON but seqpar's own code compiles without -march=native: ${command}")
      endif()
    endif()
  endforeach()
  if(NOT seen_library OR NOT seen_example)
    message(FATAL_ERROR "compile_commands.json of ${dir} lacks runtime/tensor.cc or the example")
  endif()
  message("-march=native: on seqpar's sources, not on the consumer's")
endfunction()

# Configures the project in `src` into `build` with the test's generator, compiler and launcher, and the extra
# configure arguments.
function(configure_project src build)
  set(launcher "")
  if(LAUNCHER)
    set(launcher "-DCMAKE_CXX_COMPILER_LAUNCHER=${LAUNCHER}")
  endif()
  run("configure" ${CMAKE_COMMAND} -S ${src} -B ${build} -G ${GENERATOR} -DCMAKE_CXX_COMPILER=${CXX} ${launcher} ${ARGN})
  set(run_output "${run_output}" PARENT_SCOPE)
endfunction()

# Configures, builds and runs examples/ as a project of its own in `dir`, with the extra configure arguments.
function(build_and_run_examples dir)
  configure_project(${SOURCE_DIR}/examples ${dir} ${ARGN})
  if(check_native)
    check_native_is_private(${dir})
  endif()
  run("build" ${CMAKE_COMMAND} --build ${dir} --target ring_attention_example -j 2)
  run_example(${dir}/ring_attention_example)
endfunction()

# The flags of the installed seqpar.pc (`flags` is --cflags or --libs), as a list.
function(pkg_config_flags out flags)
  set(ENV{PKG_CONFIG_PATH} ${prefix}/lib/pkgconfig)
  find_program(pkg_config pkg-config REQUIRED)
  run("pkg-config ${flags} seqpar" ${pkg_config} ${flags} seqpar)
  string(STRIP "${run_output}" text)
  separate_arguments(list UNIX_COMMAND "${text}")
  set(${out} ${list} PARENT_SCOPE)
endfunction()

if(STEP STREQUAL "install")
  file(REMOVE_RECURSE ${prefix})
  run("cmake --install" ${CMAKE_COMMAND} --install ${BUILD_DIR} --prefix ${prefix})
  foreach(f lib/cmake/seqpar/seqparConfig.cmake lib/cmake/seqpar/seqparConfigVersion.cmake
            lib/cmake/seqpar/seqparTargets.cmake lib/pkgconfig/seqpar.pc lib/libseqpar_runtime.a
            lib/libseqpar_parallel.a include/seqpar/runtime/version.h include/seqpar/parallel/usp.h
            include/seqpar/attention/mha.h bin/sp_bench bin/comm_bench bin/kernel_bench bin/agreement_bench
            bin/sp_plan)
    if(NOT EXISTS ${prefix}/${f})
      message(FATAL_ERROR "not installed: ${f}")
    endif()
  endforeach()
  foreach(f include/seqpar/attention/boundary.h include/seqpar/attention/cpu include/seqpar/runtime/cuda_check.h
            include/seqpar/runtime/cuda_staging.h include/seqpar/parallel/decode_shared.h)
    if(EXISTS ${prefix}/${f})
      message(FATAL_ERROR "internal file installed: ${f}")
    endif()
  endforeach()
  # The version file: 0.2 and the exact version are accepted, 0.1, 0.3 and 1.0 are not.
  foreach(case "${VERSION};TRUE" "0.2;TRUE" "0.1;FALSE" "0.3;FALSE" "1.0;FALSE")
    list(GET case 0 PACKAGE_FIND_VERSION)
    list(GET case 1 expect)
    string(REPLACE "." ";" parts "${PACKAGE_FIND_VERSION}")
    list(GET parts 0 PACKAGE_FIND_VERSION_MAJOR)
    list(GET parts 1 PACKAGE_FIND_VERSION_MINOR)
    set(PACKAGE_FIND_VERSION_PATCH 0)
    set(PACKAGE_FIND_VERSION_COUNT 2)
    set(PACKAGE_VERSION_COMPATIBLE FALSE)
    include(${prefix}/lib/cmake/seqpar/seqparConfigVersion.cmake)
    if(NOT PACKAGE_VERSION_COMPATIBLE STREQUAL expect)
      message(FATAL_ERROR "seqparConfigVersion.cmake: version ${PACKAGE_FIND_VERSION} compatible = "
                          "${PACKAGE_VERSION_COMPATIBLE}, expected ${expect}")
    endif()
  endforeach()
  foreach(bench sp_bench comm_bench kernel_bench agreement_bench)
    run("${bench} --version" ${MPIEXEC} ${NP_FLAG} 1 ${prefix}/bin/${bench} --version)
    if(NOT run_output STREQUAL "${bench} (seqpar) ${VERSION}\n")
      message(FATAL_ERROR "${bench} --version printed '${run_output}', expected '${bench} (seqpar) ${VERSION}'")
    endif()
  endforeach()
  # The installed sp_bench and comm_bench run, print the version first and write it into their JSON.
  set(sp_bench_args --seq 384 --heads 4 --kv-heads 2 --head-dim 32 --warmup 0 --iters 1 --quiet)
  set(comm_bench_args --min-bytes 1K --max-bytes 1K --warmup 0 --iters 1 --ops sendrecv)
  foreach(bench sp_bench comm_bench)
    set(json ${WORK_DIR}/${bench}.json)
    file(REMOVE ${json})
    run("${bench}" ${MPIEXEC} ${NP_FLAG} 1 ${prefix}/bin/${bench} ${${bench}_args} --json ${json})
    if(NOT run_output MATCHES "^# seqpar ${bench} ${VERSION}\n")
      message(FATAL_ERROR "${bench}'s first line is not '# seqpar ${bench} ${VERSION}':\n${run_output}")
    endif()
    file(READ ${json} text)
    string(JSON json_version GET "${text}" version)
    if(NOT json_version STREQUAL VERSION)
      message(FATAL_ERROR "${bench} --json wrote version '${json_version}', expected ${VERSION}")
    endif()
  endforeach()
elseif(STEP STREQUAL "headers")
  # One translation unit per header (included twice), compiled as an outside project against the package: 2 jobs,
  # and ccache serves the later runs. A TU is rewritten only when its text changes.
  file(GLOB_RECURSE headers RELATIVE ${prefix}/include/seqpar ${prefix}/include/seqpar/*.h)
  list(LENGTH headers n)
  if(n LESS 20)
    message(FATAL_ERROR "only ${n} headers installed under ${prefix}/include/seqpar")
  endif()
  set(dir ${WORK_DIR}/headers)
  file(GLOB stale ${dir}/src/*.cc)
  foreach(h ${headers})
    string(MAKE_C_IDENTIFIER "${h}" id)
    set(tu ${dir}/src/${id}.cc)
    list(REMOVE_ITEM stale ${tu})
    set(text "#include <seqpar/${h}>\n#include <seqpar/${h}>\n")
    set(old "")
    if(EXISTS ${tu})
      file(READ ${tu} old)
    endif()
    if(NOT old STREQUAL text)
      file(WRITE ${tu} "${text}")
    endif()
  endforeach()
  if(stale)
    file(REMOVE ${stale})
  endif()
  file(WRITE ${dir}/src/CMakeLists.txt [=[
cmake_minimum_required(VERSION 3.24)
project(seqpar_headers LANGUAGES CXX)
find_package(seqpar 0.2 REQUIRED)
file(GLOB tus CONFIGURE_DEPENDS *.cc)
add_library(headers OBJECT ${tus})
target_link_libraries(headers PRIVATE seqpar::parallel)
]=])
  configure_project(${dir}/src ${dir}/build -DCMAKE_PREFIX_PATH=${prefix})
  run("compile every header alone" ${CMAKE_COMMAND} --build ${dir}/build -j 2)
  message("${n} installed headers compile on their own (and twice in one file)")
elseif(STEP STREQUAL "consumer_folders")
  # The consumer's parallel/usp.h and runtime/*.h stop the build if anything but the consumer's own code (after it
  # defines CONSUMER_OWN_HEADERS) includes them: seqpar's headers must resolve to seqpar's files.
  set(dir ${WORK_DIR}/consumer_folders)
  set(guard "#pragma once\n#ifndef CONSUMER_OWN_HEADERS\n#error \"a seqpar header included the consumer's own file\"\n#endif\n")
  foreach(h parallel/usp.h parallel/layout.h runtime/tensor.h runtime/error.h runtime/dtype.h attention/mha.h)
    string(MAKE_C_IDENTIFIER "${h}" id)
    file(WRITE ${dir}/src/${h} "${guard}inline int consumer_${id}() { return 1; }\n")
  endforeach()
  file(WRITE ${dir}/src/main.cc [=[
#include <seqpar/seqpar.h>

#include <cstdio>

#define CONSUMER_OWN_HEADERS
#include "parallel/usp.h"
#include "runtime/tensor.h"

int main() {
  const seqpar::DType dtype = seqpar::DType::kFloat32;
  std::printf("consumer: seqpar dtype %s, own header %d\n", seqpar::dtype_name(dtype), consumer_parallel_usp_h());
  return 0;
}
]=])
  file(WRITE ${dir}/src/CMakeLists.txt [=[
cmake_minimum_required(VERSION 3.24)
project(consumer_folders LANGUAGES CXX)
find_package(seqpar 0.2 REQUIRED)
add_executable(consumer main.cc)
target_include_directories(consumer PRIVATE ${CMAKE_CURRENT_SOURCE_DIR})
target_link_libraries(consumer PRIVATE seqpar::parallel)
]=])
  configure_project(${dir}/src ${dir}/build -DCMAKE_PREFIX_PATH=${prefix})
  run("build the consumer" ${CMAKE_COMMAND} --build ${dir}/build -j 2)
  run("the consumer" ${dir}/build/consumer)
  if(NOT run_output MATCHES "consumer: seqpar dtype fp32, own header 1")
    message(FATAL_ERROR "the consumer printed: ${run_output}")
  endif()
  message("${run_output}")
elseif(STEP STREQUAL "find_package")
  build_and_run_examples(${WORK_DIR}/find_package -DCMAKE_PREFIX_PATH=${prefix} -DCMAKE_BUILD_TYPE=Release)
elseif(STEP STREQUAL "pkg_config")
  pkg_config_flags(cflags --cflags)
  pkg_config_flags(libs --libs)
  set(ENV{PKG_CONFIG_PATH} ${prefix}/lib/pkgconfig)
  run("pkg-config --modversion" pkg-config --modversion seqpar)
  if(NOT run_output STREQUAL "${VERSION}\n")
    message(FATAL_ERROR "pkg-config --modversion seqpar printed '${run_output}', expected ${VERSION}")
  endif()
  file(MAKE_DIRECTORY ${WORK_DIR}/pkg_config)
  run("compile and link with pkg-config's flags" ${LAUNCHER} ${CXX} -std=c++20 -O1 ${cflags} ${example} ${libs}
      -o ${WORK_DIR}/pkg_config/ring_attention_example)
  run_example(${WORK_DIR}/pkg_config/ring_attention_example)
elseif(STEP STREQUAL "add_subdirectory")
  # A project without a build type that includes seqpar is warned (seqpar would compile unoptimised); examples/, a
  # project of its own, defaults to Release as seqpar does.
  set(dir ${WORK_DIR}/no_build_type)
  file(WRITE ${dir}/src/CMakeLists.txt "cmake_minimum_required(VERSION 3.24)\nproject(no_build_type LANGUAGES CXX)\n"
                                       "add_subdirectory(${SOURCE_DIR} seqpar)\n")
  file(REMOVE ${dir}/build/CMakeCache.txt)
  configure_project(${dir}/src ${dir}/build)
  string(REGEX REPLACE "[ \n]+" " " text "${run_output}")
  if(NOT text MATCHES "seqpar: the including project has no CMAKE_BUILD_TYPE, so seqpar's kernels compile without")
    message(FATAL_ERROR "no warning about the empty build type when included:\n${run_output}")
  endif()
  # SEQPAR_NATIVE=ON (off by default inside a project) to check that it stays private.
  set(check_native TRUE)
  build_and_run_examples(${WORK_DIR}/add_subdirectory -DSEQPAR_SOURCE_DIR=${SOURCE_DIR} -DSEQPAR_NATIVE=ON
                         -DCMAKE_EXPORT_COMPILE_COMMANDS=ON)
  file(STRINGS ${WORK_DIR}/add_subdirectory/CMakeCache.txt build_type REGEX "^CMAKE_BUILD_TYPE:")
  if(NOT build_type MATCHES "=Release$")
    message(FATAL_ERROR "examples/ without a build type: ${build_type} (expected Release)")
  endif()
else()
  message(FATAL_ERROR "package_test.cmake: unknown STEP '${STEP}'")
endif()
