# Install rules (SEQPAR_INSTALL; included by the top CMakeLists.txt after the targets exist). `cmake --install build
# [--prefix P]` installs:
#   lib/libseqpar_*.a                           the libraries (static)
#   include/seqpar/seqpar.h                     the umbrella header (#include <seqpar/seqpar.h>)
#   include/seqpar/{runtime,attention,parallel}  the public headers, with runtime/version.h; consumers include them
#                                               as <seqpar/parallel/usp.h>, with <prefix>/include on their path
#   bin/{sp_bench,comm_bench,kernel_bench,agreement_bench} the benchmarks (when SEQPAR_BUILD_BENCHMARKS)
#   lib/cmake/seqpar/                           seqparConfig.cmake, seqparConfigVersion.cmake, the targets
#                                               seqpar::runtime, ::attention_base, ::mha, ::dsa, ::gdn, ::rope,
#                                               ::attention, ::parallel, and seqparNccl.cmake (NCCL builds)
#   lib/pkgconfig/seqpar.pc                     the same for pkg-config (every seqpar library and its dependencies)
include(CMakePackageConfigHelpers)
set(SEQPAR_INSTALL_CMAKEDIR ${CMAKE_INSTALL_LIBDIR}/cmake/seqpar)
get_property(_seqpar_targets GLOBAL PROPERTY SEQPAR_EXPORTED_TARGETS)

install(TARGETS ${_seqpar_targets} EXPORT seqparTargets
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR})
install(EXPORT seqparTargets NAMESPACE seqpar:: DESTINATION ${SEQPAR_INSTALL_CMAKEDIR})

# Public headers only: not the CPU or CUDA kernels (attention/cpu, attention/cuda), the ops table (attention/ops, not
# installed yet), the fp64 references of the tests, the helpers internal
# to their folder (attention/boundary.h, runtime/cuda_check.h, runtime/cuda_staging.h, runtime/tensor_checks.h,
# parallel/decode_shared.h).
foreach(_dir runtime attention parallel)
  install(DIRECTORY ${PROJECT_SOURCE_DIR}/${_dir} DESTINATION ${SEQPAR_INSTALL_INCLUDEDIR}
          FILES_MATCHING PATTERN "*.h"
          PATTERN cpu EXCLUDE PATTERN cuda EXCLUDE PATTERN reference EXCLUDE PATTERN ops EXCLUDE
          PATTERN boundary.h EXCLUDE PATTERN cuda_check.h EXCLUDE PATTERN cuda_staging.h EXCLUDE
          PATTERN decode_shared.h EXCLUDE PATTERN tensor_checks.h EXCLUDE)
endforeach()
if(SEQPAR_NATIVE)
  install(CODE "message(STATUS \"seqpar: these libraries were compiled with -march=native (SEQPAR_NATIVE=ON): they \"
                \"run only on CPUs with this machine's instruction set\")")
endif()
install(FILES ${PROJECT_BINARY_DIR}/generated/runtime/version.h DESTINATION ${SEQPAR_INSTALL_INCLUDEDIR}/runtime)
# The umbrella header, found as <seqpar/seqpar.h> on the installed include path.
install(FILES ${PROJECT_SOURCE_DIR}/include/seqpar/seqpar.h DESTINATION ${SEQPAR_INSTALL_INCLUDEDIR})

if(SEQPAR_BUILD_BENCHMARKS)
  # The installed benchmarks find shared libraries outside the system paths (CUDA) where they were linked from.
  set_target_properties(sp_bench comm_bench kernel_bench agreement_bench sp_plan PROPERTIES INSTALL_RPATH_USE_LINK_PATH TRUE)
  install(TARGETS sp_bench comm_bench kernel_bench agreement_bench sp_plan RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
endif()

# ---- CMake package ----
configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/seqparConfig.cmake.in
                              ${PROJECT_BINARY_DIR}/seqparConfig.cmake INSTALL_DESTINATION ${SEQPAR_INSTALL_CMAKEDIR})
# 0.x: a new minor version may change the API, so find_package(seqpar 0.2) accepts 0.2.* only.
write_basic_package_version_file(${PROJECT_BINARY_DIR}/seqparConfigVersion.cmake COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/seqparConfig.cmake ${PROJECT_BINARY_DIR}/seqparConfigVersion.cmake
        DESTINATION ${SEQPAR_INSTALL_CMAKEDIR})
if(SEQPAR_NCCL_ENABLED)
  install(FILES ${PROJECT_SOURCE_DIR}/cmake/seqparNccl.cmake DESTINATION ${SEQPAR_INSTALL_CMAKEDIR})
endif()

# ---- pkg-config ----
# The libraries in link order (each before what it uses: the reverse of their creation order), then the flags of
# their dependencies as this build found them. Static libraries: everything goes into Libs.
set(_pc_libs "")
foreach(_t ${_seqpar_targets})
  get_target_property(_type ${_t} TYPE)
  if(_type STREQUAL "STATIC_LIBRARY")
    list(PREPEND _pc_libs "-l${_t}")
  endif()
endforeach()
set(_pc_cflags "-I\${includedir}")
set(_pc_dep_libs "")
foreach(_dir ${MPI_CXX_INCLUDE_DIRS})
  list(APPEND _pc_cflags "-I${_dir}")
endforeach()
list(APPEND _pc_cflags ${MPI_CXX_COMPILE_OPTIONS})
foreach(_def ${MPI_CXX_COMPILE_DEFINITIONS})
  list(APPEND _pc_cflags "-D${_def}")
endforeach()
list(APPEND _pc_dep_libs ${MPI_CXX_LINK_FLAGS} ${MPI_CXX_LIBRARIES})
if(SEQPAR_WITH_OPENMP)
  list(APPEND _pc_cflags ${OpenMP_CXX_FLAGS})
  list(APPEND _pc_dep_libs ${OpenMP_CXX_FLAGS})
endif()
if(SEQPAR_CUDA_ENABLED)
  list(APPEND _pc_cflags "-DSEQPAR_WITH_CUDA=1")
  foreach(_dir ${CUDAToolkit_INCLUDE_DIRS})
    list(APPEND _pc_cflags "-I${_dir}")
  endforeach()
  list(APPEND _pc_dep_libs "${CUDA_cudart_LIBRARY}")
endif()
if(SEQPAR_NCCL_ENABLED)
  list(APPEND _pc_cflags "-DSEQPAR_WITH_NCCL=1" "-I${NCCL_INCLUDE_DIR}")
  list(APPEND _pc_dep_libs "${NCCL_LIBRARY}")
endif()
get_property(_ops_table_libs GLOBAL PROPERTY SEQPAR_OPS_TABLE_LIBRARIES)
list(APPEND _pc_dep_libs ${_ops_table_libs})
list(APPEND _pc_dep_libs ${CMAKE_THREAD_LIBS_INIT})
list(REMOVE_DUPLICATES _pc_cflags)
list(JOIN _pc_cflags " " SEQPAR_PC_CFLAGS)
list(JOIN _pc_libs " " SEQPAR_PC_LIBS)
list(JOIN _pc_dep_libs " " SEQPAR_PC_DEP_LIBS)
# prefix relative to the .pc file, so that the installed tree may be moved (lib/pkgconfig -> ../..).
string(REGEX REPLACE "[^/]+" ".." SEQPAR_PC_UP "${CMAKE_INSTALL_LIBDIR}/pkgconfig")
configure_file(${PROJECT_SOURCE_DIR}/cmake/seqpar.pc.in ${PROJECT_BINARY_DIR}/seqpar.pc @ONLY)
install(FILES ${PROJECT_BINARY_DIR}/seqpar.pc DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig)
