#!/usr/bin/env bash
# The op tests, the end-to-end runtime tests and the fuzz tests against an AddressSanitizer + UndefinedBehavior-
# Sanitizer build of the custom-op library (CMake option DSV4_SANITIZE), built into build/sanitize.
#
#   tests/sanitize.sh [extra pytest arguments]       e.g. tests/sanitize.sh -x -k Linear
#
# Needs the test environment of the README (.venv with '.[export,test]'), a C++ compiler with libasan/libubsan (GCC
# here: the runtime preloaded below must be the one the library was built against) and the ONNX Runtime headers
# (found as for any build; a .deb already cached in another build directory is reused). Environment:
#   PYTHON        interpreter with the test environment      (default: .venv/bin/python, else python3)
#   CXX           C++ compiler for the sanitizer build         (default: c++)
#   SANITIZE_DIR  build directory                              (default: build/sanitize)
# Python itself is not instrumented, so ASan is preloaded (with libstdc++, so that ASan's __cxa_throw interceptor
# resolves in an interpreter that does not link it) and leak checking is off. Any ASan or UBSan report aborts the
# process that hit it: a test that spawns it (the fuzz tests) fails with the report; a report in the pytest process
# itself ends the run with the report on stderr and a non-zero status. The RSS leak test is left out: ASan's
# quarantine and shadow memory make RSS meaningless (the plain test run has it).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
CXX=${CXX:-c++}
BUILD=${SANITIZE_DIR:-build/sanitize}
bin_dir=$(dirname "$(command -v "$PYTHON")")
export PATH="$bin_dir:$PATH"  # cmake and ninja of the test extra

cmake_args=(-S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DDSV4_SANITIZE=ON
            -DDSV4_BUILD_ROOFLINE=OFF -DCMAKE_CXX_COMPILER="$CXX")
if [ ! -e "$BUILD/CMakeCache.txt" ]; then
  deb=$(ls build/*/_deps/ort-headers/libonnxruntime-dev_*.deb 2>/dev/null | head -n 1 || true)
  [ -n "$deb" ] && cmake_args+=(-DDSV4_ORT_HEADERS_DEB="$PWD/$deb")
fi
cmake "${cmake_args[@]}" >/dev/null
cmake --build "$BUILD" --target dsv4_ort -j "$(nproc)"

lib="$(cd "$BUILD" && pwd)/custom_ops/libdsv4_ort.so"
export DSV4_ORT_LIBRARY="$lib"
export LD_PRELOAD="$("$CXX" -print-file-name=libasan.so) $("$CXX" -print-file-name=libstdc++.so)"
# allocator_may_return_null + a 2 GiB allocation cap: a malloc that large fails (onnxruntime reports it) instead of
# reserving the memory; a failing C++ `new` is still an ASan abort, which is how the fuzz tests catch a buffer sized
# from a huge dimension.
export ASAN_OPTIONS="detect_leaks=0:allocator_may_return_null=1:max_allocation_size_mb=2048:detect_stack_use_after_return=0"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
echo "sanitizer build: $lib" >&2
# --capture=sys: a sanitizer report is written to file descriptor 2 just before the process aborts; fd-level capture
# would swallow it.
# -P: the checkout's dsv4_ort/ folder (the cwd) must not shadow the installed package.
exec "$PYTHON" -P -m pytest -q -p no:cacheprovider --capture=sys tests/custom_ops/ops tests/runtime tests/fuzz \
  --deselect tests/runtime/test_concurrency.py::test_repeated_sessions_do_not_leak "$@"
