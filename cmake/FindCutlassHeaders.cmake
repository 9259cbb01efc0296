# Locates the CUTLASS/CuTe headers shipped in the `nvidia-cutlass` PyPI package (pinned in
# scripts/requirements.txt; scripts/setup.sh installs it into .deps/python). Order:
#   1. -DTESSERA_CUTLASS_INCLUDE_DIR=<dir holding cutlass/ and cute/>
#   2. <repo>/.deps/python/cutlass_library/source/include (what scripts/setup.sh installs)
#   3. the cutlass_library package importable by python3
set(TESSERA_CUTLASS_INCLUDE_DIR "" CACHE PATH "Directory holding cutlass/cutlass.h and cute/")
if(NOT TESSERA_CUTLASS_INCLUDE_DIR)
  set(_local "${CMAKE_CURRENT_SOURCE_DIR}/.deps/python/cutlass_library/source/include")
  if(EXISTS "${_local}/cutlass/cutlass.h")
    set(TESSERA_CUTLASS_INCLUDE_DIR "${_local}" CACHE PATH "" FORCE)
  else()
    find_package(Python3 COMPONENTS Interpreter QUIET)
    if(Python3_Interpreter_FOUND)
      execute_process(
        COMMAND ${Python3_EXECUTABLE} -c "import cutlass_library, os; print(os.path.join(os.path.dirname(cutlass_library.__file__), 'source', 'include'))"
        OUTPUT_VARIABLE _py_dir OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
      if(_py_dir AND EXISTS "${_py_dir}/cutlass/cutlass.h")
        set(TESSERA_CUTLASS_INCLUDE_DIR "${_py_dir}" CACHE PATH "" FORCE)
      endif()
    endif()
  endif()
endif()
if(NOT EXISTS "${TESSERA_CUTLASS_INCLUDE_DIR}/cutlass/cutlass.h" OR NOT EXISTS "${TESSERA_CUTLASS_INCLUDE_DIR}/cute/tensor.hpp")
  message(FATAL_ERROR "CUTLASS/CuTe headers not found. Run scripts/setup.sh (installs the pinned "
    "nvidia-cutlass package into .deps/python) or pass -DTESSERA_CUTLASS_INCLUDE_DIR=<dir>.")
endif()
file(STRINGS "${TESSERA_CUTLASS_INCLUDE_DIR}/cutlass/version.h" _maj REGEX "#define CUTLASS_MAJOR ")
message(STATUS "CUTLASS headers: ${TESSERA_CUTLASS_INCLUDE_DIR} (${_maj})")
