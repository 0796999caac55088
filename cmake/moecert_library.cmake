# moecert_add_library(NAME CAP off|check|audit|full): the library from every
# source, with its contract cap compiled in. The installed library is built
# at MOECERT_CONTRACT_CAP; the tests also build one at cap `off` to show that
# checks compile out. Call it from the top directory only: per-file ISA flags
# (set_source_files_properties) are scoped to the directory that sets them.

set(MOECERT_SOURCES
  contracts/engine/engine.cpp
  contracts/engine/json.cpp
  contracts/layer/config.cpp
  contracts/engine/registry.cpp
  contracts/engine/compare.cpp
  ops/core/build_info.cpp
  ops/core/memory.cpp
  ops/core/guard.cpp
  contracts/gemm/gemm.cpp
  contracts/gemm/formats.cpp
  contracts/gemm/pack_quantized.cpp
  contracts/experts/experts.cpp
  contracts/bounds/experts_forward.cpp
  contracts/experts/train.cpp
  contracts/experts/scans.cpp
  contracts/experts/backward_probe.cpp
  contracts/probes/verify.cpp
  contracts/router/kinds.cpp
  contracts/router/softmax_topk.cpp contracts/router/sigmoid_topk.cpp contracts/router/product_key.cpp
  contracts/judge/ops.cpp contracts/judge/router.cpp contracts/judge/experts.cpp
  contracts/judge/layer.cpp
  contracts/reference/experts_model.cpp
  contracts/reference/experts_projection.cpp
  ops/router/kinds.cpp
  ops/router/softmax_topk.cpp
  ops/router/sigmoid_topk.cpp
  ops/router/product_key.cpp
  ops/experts/grouping.cpp
  ops/experts/pack.cpp
  ops/experts/backward.cpp
  ops/experts/forward.cpp
  ops/experts/lora.cpp
  ops/experts/train.cpp
  ops/experts/saved_view.cpp
  ops/layer/forward.cpp
  ops/layer/router_linear.cpp
  ops/layer/backward.cpp
  contracts/layer/layer.cpp
  contracts/layer/bounds.cpp
  contracts/layer/router_linear.cpp
  contracts/layer/router_linear_probe.cpp
  ops/workspace/plan.cpp
  ops/workspace/arena.cpp
  contracts/workspace/workspace.cpp
  ops/gemm/dispatch.cpp
  ops/gemm/pack.cpp
  ops/gemm/pack_quantized.cpp
  ops/gemm/formats.cpp
  ops/gemm/decode_scalar.cpp
  ops/gemm/decode_avx512.cpp
  ops/gemm/loops.cpp
  ops/gemm/matmul.cpp
  ops/gemm/stream.cpp
  ops/gemm/ukernel_scalar.cpp
  ops/gemm/ukernel_avx2.cpp
  ops/gemm/ukernel_avx512_bf16.cpp
  ops/gemm/ukernel_amx_bf16.cpp
  ops/gemm/ukernel_amx_emu.cpp
  ops/gemm/epilogue_scalar.cpp
  ops/gemm/epilogue_avx512.cpp
)

# ISA flags on the microkernel files only (one binary carries every ISA and
# picks at run time; ops/gemm/dispatch.cpp).
set_source_files_properties(${PROJECT_SOURCE_DIR}/ops/gemm/ukernel_avx512_bf16.cpp
                            ${PROJECT_SOURCE_DIR}/ops/gemm/epilogue_avx512.cpp
                            ${PROJECT_SOURCE_DIR}/ops/gemm/decode_avx512.cpp PROPERTIES
  COMPILE_OPTIONS "-mavx512f;-mavx512bw;-mavx512vl;-mavx512bf16")
set_source_files_properties(${PROJECT_SOURCE_DIR}/ops/gemm/ukernel_avx2.cpp PROPERTIES
  COMPILE_OPTIONS "-mavx2")
set_source_files_properties(${PROJECT_SOURCE_DIR}/ops/gemm/ukernel_amx_bf16.cpp PROPERTIES
  COMPILE_OPTIONS "-mamx-tile;-mamx-bf16")

if(CMAKE_BUILD_TYPE STREQUAL "Debug")
  set(MOECERT_DEFAULT_LEVEL 2)  # audit
else()
  set(MOECERT_DEFAULT_LEVEL 1)  # check (docs/PERFORMANCE.md: its cost)
endif()

# The commit (and whether the tree was dirty) is taken at every build, not at
# configure time: generated/git_commit.inc, included by ops/core/build_info.cpp.
find_package(Git QUIET)
set(MOECERT_GIT_INC ${PROJECT_BINARY_DIR}/generated/git_commit.inc)
add_custom_target(moecert_git_commit
  COMMAND ${CMAKE_COMMAND} -DSRC=${PROJECT_SOURCE_DIR} -DOUT=${MOECERT_GIT_INC} -DGIT=${GIT_EXECUTABLE}
          -P ${PROJECT_SOURCE_DIR}/cmake/git_commit.cmake
  BYPRODUCTS ${MOECERT_GIT_INC}
  COMMENT "" VERBATIM)

function(moecert_add_library name)
  cmake_parse_arguments(ARG "" "CAP" "" ${ARGN})
  set(_levels off check audit full)
  list(FIND _levels "${ARG_CAP}" _cap)
  if(_cap LESS 0)
    message(FATAL_ERROR "contract cap '${ARG_CAP}': expected off, check, audit or full")
  endif()
  list(TRANSFORM MOECERT_SOURCES PREPEND ${PROJECT_SOURCE_DIR}/ OUTPUT_VARIABLE _sources)
  add_library(${name} STATIC ${_sources})
  target_include_directories(${name}
    PUBLIC $<BUILD_INTERFACE:${PROJECT_SOURCE_DIR}/include> $<INSTALL_INTERFACE:${CMAKE_INSTALL_INCLUDEDIR}>
    PRIVATE ${PROJECT_SOURCE_DIR})
  target_compile_features(${name} PUBLIC cxx_std_20)
  string(TOUPPER "${CMAKE_BUILD_TYPE}" _bt)
  target_compile_definitions(${name} PRIVATE
    MOECERT_CONTRACT_CAP_LEVEL=${_cap}
    MOECERT_DEFAULT_LEVEL=${MOECERT_DEFAULT_LEVEL}
    MOECERT_VERSION="${PROJECT_VERSION}"
    MOECERT_BUILD_TYPE="${CMAKE_BUILD_TYPE}"
    MOECERT_CXX_FLAGS="${CMAKE_CXX_FLAGS} ${CMAKE_CXX_FLAGS_${_bt}}")
  target_include_directories(${name} PRIVATE ${PROJECT_BINARY_DIR}/generated)
  add_dependencies(${name} moecert_git_commit)
  # Boost is header-only and used privately: not part of the installed interface.
  target_link_libraries(${name} PUBLIC fmt::fmt TBB::tbb PRIVATE $<BUILD_INTERFACE:Boost::headers>)
  if(MOECERT_FUZZ)  # coverage for libFuzzer; the sanitizer runtime's no-op hooks elsewhere
    target_compile_options(${name} PRIVATE -fsanitize=fuzzer-no-link)
  endif()
  if(MOECERT_SANITIZE)
    # A sanitized static library needs the runtime in whatever links it.
    target_link_options(${name} INTERFACE -fsanitize=address,undefined)
  elseif(MOECERT_TSAN)
    target_link_options(${name} INTERFACE -fsanitize=thread)
  endif()
endfunction()
