# Finds NCCL (nccl.h and libnccl) and defines the imported target seqpar::nccl (include directory and library).
# Shared by seqpar's own build and by the installed seqparConfig.cmake, so that both find NCCL the same way.
# Looks next to the CUDA toolkit (CUDAToolkit_INCLUDE_DIRS, CUDAToolkit_LIBRARY_DIR) and in the system directories;
# NCCL_INCLUDE_DIR and NCCL_LIBRARY may be set to point elsewhere. Sets SEQPAR_NCCL_FOUND.
find_path(NCCL_INCLUDE_DIR nccl.h HINTS ${CUDAToolkit_INCLUDE_DIRS})
find_library(NCCL_LIBRARY nccl HINTS ${CUDAToolkit_LIBRARY_DIR})
set(SEQPAR_NCCL_FOUND OFF)
if(NCCL_INCLUDE_DIR AND NCCL_LIBRARY)
  set(SEQPAR_NCCL_FOUND ON)
  if(NOT TARGET seqpar::nccl)
    add_library(seqpar::nccl INTERFACE IMPORTED)
    set_target_properties(seqpar::nccl PROPERTIES INTERFACE_INCLUDE_DIRECTORIES "${NCCL_INCLUDE_DIR}"
                                                  INTERFACE_LINK_LIBRARIES "${NCCL_LIBRARY}")
  endif()
endif()
