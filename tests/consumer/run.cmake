# Installs the build tree into a prefix, then configures, builds and runs tests/consumer against
# it with find_package(moekit): the CMake package as a user sees it.
#   cmake -DBUILD_DIR=... -DSOURCE_DIR=... -DWORK=... -P run.cmake
foreach(v BUILD_DIR SOURCE_DIR WORK)
  if(NOT DEFINED ${v})
    message(FATAL_ERROR "run.cmake: ${v} is not set")
  endif()
endforeach()
file(REMOVE_RECURSE "${WORK}")
function(step)
  execute_process(COMMAND ${ARGV} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${ARGV}\n${out}")
  endif()
  message(STATUS "${out}")
endfunction()
step(${CMAKE_COMMAND} --install "${BUILD_DIR}" --prefix "${WORK}/prefix")
step(${CMAKE_COMMAND} -S "${SOURCE_DIR}" -B "${WORK}/build" -G Ninja -DCMAKE_BUILD_TYPE=Release
     "-DCMAKE_PREFIX_PATH=${WORK}/prefix")
step(${CMAKE_COMMAND} --build "${WORK}/build")
step("${WORK}/build/consumer")
