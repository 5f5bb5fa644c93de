# Locates the official ONNX Runtime C/C++ API headers (API version 21 = ONNX Runtime 1.21).
#
# The onnxruntime wheels ship no headers, so they come from Debian's `libonnxruntime-dev` 1.21.0 package
# (Debian 13), fetched by name through the machine's apt configuration, hash-checked, unpacked and cached in the
# build tree. They are never committed. Overrides, in order:
#   -DORT_INCLUDE_DIR=/path           (or the ORT_INCLUDE_DIR environment variable): a directory holding
#                                      onnxruntime_c_api.h from an ONNX Runtime release or distro package
#   -DDSV4_ORT_HEADERS_DEB=/path.deb  a downloaded libonnxruntime-dev_1.21.0+dfsg-1_amd64.deb
# A library built against headers of API N loads only into ONNX Runtime >= N, hence the pin to 21.

set(DSV4_ORT_API_VERSION 21)
set(DSV4_ORT_HEADERS_PACKAGE "libonnxruntime-dev")
set(DSV4_ORT_HEADERS_VERSION "1.21.0+dfsg-1")
set(DSV4_ORT_HEADERS_SUITE "trixie")
set(DSV4_ORT_HEADERS_SHA256 "14f7d959d5deacbcf1504830d4189f91fc67382b399ed9ae9d3aa9c4050ced08")

set(ORT_INCLUDE_DIR "$ENV{ORT_INCLUDE_DIR}" CACHE PATH "Directory containing onnxruntime_c_api.h (overrides the package)")
set(DSV4_ORT_HEADERS_DEB "" CACHE FILEPATH "Path to a downloaded ${DSV4_ORT_HEADERS_PACKAGE} ${DSV4_ORT_HEADERS_VERSION} .deb")

set(_dsv4_ort_help
  "Provide the ONNX Runtime C API headers in one of these ways:\n"
  "  1. On Debian/Ubuntu with network access to the distribution archive, nothing: the build downloads\n"
  "     ${DSV4_ORT_HEADERS_PACKAGE}=${DSV4_ORT_HEADERS_VERSION} (suite ${DSV4_ORT_HEADERS_SUITE}) with apt-get.\n"
  "  2. Download that .deb yourself and pass -DDSV4_ORT_HEADERS_DEB=/path/to/file.deb\n"
  "     (pip: pip install . -Ccmake.define.DSV4_ORT_HEADERS_DEB=/path/to/file.deb).\n"
  "  3. Point ORT_INCLUDE_DIR (environment variable or -DORT_INCLUDE_DIR=...) at the include directory of an\n"
  "     ONNX Runtime 1.21 release (the folder holding onnxruntime_c_api.h). Newer headers work too, but the\n"
  "     library then loads only into that ONNX Runtime version or newer.")

function(_dsv4_check_ort_include dir out_version)
  if(NOT EXISTS "${dir}/onnxruntime_c_api.h" OR NOT EXISTS "${dir}/onnxruntime_cxx_api.h")
    message(FATAL_ERROR "ORT_INCLUDE_DIR='${dir}' does not contain onnxruntime_c_api.h and onnxruntime_cxx_api.h.\n"
                        ${_dsv4_ort_help})
  endif()
  file(STRINGS "${dir}/onnxruntime_c_api.h" _line REGEX "^#define ORT_API_VERSION [0-9]+")
  string(REGEX REPLACE "^#define ORT_API_VERSION ([0-9]+).*" "\\1" _ver "${_line}")
  if(NOT _ver OR _ver LESS DSV4_ORT_API_VERSION)
    message(FATAL_ERROR "ONNX Runtime headers in '${dir}' have API version '${_ver}'; need >= ${DSV4_ORT_API_VERSION}.")
  endif()
  set(${out_version} ${_ver} PARENT_SCOPE)
endfunction()

function(dsv4_find_ort_headers out_dir)
  if(ORT_INCLUDE_DIR)
    _dsv4_check_ort_include("${ORT_INCLUDE_DIR}" _ver)
    if(NOT _ver EQUAL DSV4_ORT_API_VERSION)
      message(WARNING "Using ONNX Runtime headers of API ${_ver}: the library will need onnxruntime >= 1.${_ver}.")
    endif()
    set(${out_dir} "${ORT_INCLUDE_DIR}" PARENT_SCOPE)
    return()
  endif()

  set(_cache "${CMAKE_BINARY_DIR}/_deps/ort-headers")
  set(_inc "${_cache}/usr/include/onnxruntime")
  set(_stamp "${_cache}/${DSV4_ORT_HEADERS_SHA256}.stamp")
  if(NOT EXISTS "${_stamp}")
    file(REMOVE_RECURSE "${_cache}")
    file(MAKE_DIRECTORY "${_cache}")
    if(DSV4_ORT_HEADERS_DEB)
      set(_deb "${DSV4_ORT_HEADERS_DEB}")
    else()
      message(STATUS "Fetching ${DSV4_ORT_HEADERS_PACKAGE} ${DSV4_ORT_HEADERS_VERSION} (ONNX Runtime API headers)")
      execute_process(
        COMMAND sh "${CMAKE_CURRENT_FUNCTION_LIST_DIR}/fetch_ort_headers.sh" "${_cache}"
                "${DSV4_ORT_HEADERS_PACKAGE}" "${DSV4_ORT_HEADERS_VERSION}" "${DSV4_ORT_HEADERS_SUITE}"
        RESULT_VARIABLE _rc ERROR_VARIABLE _err OUTPUT_QUIET)
      file(GLOB _debs "${_cache}/*.deb")
      list(LENGTH _debs _n)
      if(NOT _rc EQUAL 0 OR NOT _n EQUAL 1)
        message(FATAL_ERROR "Could not download ${DSV4_ORT_HEADERS_PACKAGE} ${DSV4_ORT_HEADERS_VERSION} "
                            "(exit ${_rc}): ${_err}\n" ${_dsv4_ort_help})
      endif()
      list(GET _debs 0 _deb)
    endif()
    file(SHA256 "${_deb}" _sha)
    if(NOT _sha STREQUAL DSV4_ORT_HEADERS_SHA256)
      message(FATAL_ERROR "${_deb} has SHA256 ${_sha}, expected ${DSV4_ORT_HEADERS_SHA256}.\n" ${_dsv4_ort_help})
    endif()
    # A .deb is an ar archive; CMake's tar (libarchive) reads it, then the inner data.tar.*.
    execute_process(COMMAND ${CMAKE_COMMAND} -E tar xf "${_deb}" WORKING_DIRECTORY "${_cache}" RESULT_VARIABLE _rc)
    file(GLOB _data "${_cache}/data.tar.*")
    if(NOT _rc EQUAL 0 OR NOT _data)
      message(FATAL_ERROR "Could not unpack ${_deb}.")
    endif()
    execute_process(COMMAND ${CMAKE_COMMAND} -E tar xf "${_data}" WORKING_DIRECTORY "${_cache}" RESULT_VARIABLE _rc)
    if(NOT _rc EQUAL 0 OR NOT EXISTS "${_inc}/onnxruntime_c_api.h")
      message(FATAL_ERROR "${_deb} did not contain usr/include/onnxruntime/onnxruntime_c_api.h.")
    endif()
    file(TOUCH "${_stamp}")
  endif()
  _dsv4_check_ort_include("${_inc}" _ver)
  set(${out_dir} "${_inc}" PARENT_SCOPE)
endfunction()
