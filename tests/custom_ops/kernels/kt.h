// kt: a minimal test framework for the C++ kernel tests (no dependencies beyond the standard library).
//
//   KT_TEST(moe_routing_ref_hand_values) { KT_CHECK(x == 1) << "x = " << x; }
//   kt::Register("hyper_connection_pre_f32_avx2", [] { ... });   // parametrised tests, from a static initialiser
//   kt::Skip("AVX512 not supported by this CPU");                 // inside a test: ends it as skipped
//
// Checks never abort the test: a failed check records the failure (file:line, expression, streamed message) and
// the test goes on; only the first kMaxReportedFailures per test are printed. An exception escaping a test is a
// failure. A skipped test prints its reason and counts as passed.
//
// The binary (main is in test_main.cc):
//   dsv4_kernel_tests                  run every test
//   dsv4_kernel_tests SUBSTR...        run the tests whose name contains any SUBSTR
//   dsv4_kernel_tests --exact NAME     run the test called NAME
//   dsv4_kernel_tests --list           print the test names, one per line, and run nothing
// It prints one line per test and ends with the line "<passed> passed, <failed> failed"; the exit code is 1 when
// a test failed or when a filter matched nothing, else 0.
#pragma once

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <exception>
#include <functional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace kt {

constexpr int kMaxReportedFailures = 8;

struct TestCase {
  std::string name;
  std::function<void()> fn;
};

inline std::vector<TestCase>& Registry() {
  static std::vector<TestCase> tests;
  return tests;
}

inline bool Register(std::string name, std::function<void()> fn) {
  Registry().push_back({std::move(name), std::move(fn)});
  return true;
}

// State of the running test.
struct Current {
  int failures = 0;
  bool skipped = false;
  std::string skip_reason;
};

inline Current& Now() {
  static Current current;
  return current;
}

struct SkipSignal {};

// Ends the current test as skipped (must be called from the test body, not from another thread).
[[noreturn]] inline void Skip(const std::string& reason) {
  Now().skipped = true;
  Now().skip_reason = reason;
  throw SkipSignal{};
}

// Collects the streamed message of a failed check and reports it when destroyed.
class Failure {
 public:
  Failure(const char* file, int line, const std::string& what) {
    ++Now().failures;
    report_ = Now().failures <= kMaxReportedFailures;
    if (report_) message_ << "    " << file << ":" << line << ": check failed: " << what;
  }
  Failure(const Failure&) = delete;
  Failure& operator=(const Failure&) = delete;
  ~Failure() {
    if (report_) std::printf("%s\n", message_.str().c_str());
    if (Now().failures == kMaxReportedFailures + 1) std::printf("    (further failures of this test not shown)\n");
  }
  template <class T>
  Failure& operator<<(const T& v) {
    if (report_) {
      if (!separated_) message_ << " -- ";
      separated_ = true;
      message_ << v;
    }
    return *this;
  }

 private:
  std::ostringstream message_;
  bool report_ = false;
  bool separated_ = false;
};

template <class A, class B>
std::string DescribePair(const char* expr, const A& a, const B& b) {
  std::ostringstream os;
  os.precision(9);
  os << expr << " (" << a << " vs " << b << ")";
  return os.str();
}

// |a - b| <= atol + rtol * |b| (b is the expected value); NaN == NaN counts as close.
inline bool Close(double a, double b, double atol, double rtol) {
  if (std::isnan(a) || std::isnan(b)) return std::isnan(a) && std::isnan(b);
  if (a == b) return true;  // equal infinities
  return std::fabs(a - b) <= atol + rtol * std::fabs(b);
}

// Runs the tests selected by argv; see the header comment.
inline int Main(int argc, char** argv) {
  std::vector<std::string> filters;
  std::string exact;
  bool list = false, has_exact = false;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--list") == 0) {
      list = true;
    } else if (std::strcmp(argv[i], "--exact") == 0 && i + 1 < argc) {
      exact = argv[++i];
      has_exact = true;
    } else if (std::strcmp(argv[i], "--help") == 0 || std::strcmp(argv[i], "-h") == 0) {
      std::printf("usage: %s [--list] [--exact NAME] [SUBSTRING...]\n", argv[0]);
      return 0;
    } else {
      filters.push_back(argv[i]);
    }
  }
  const auto selected = [&](const std::string& name) {
    if (has_exact) return name == exact;
    if (filters.empty()) return true;
    for (const auto& f : filters) {
      if (name.find(f) != std::string::npos) return true;
    }
    return false;
  };

  if (list) {
    for (const auto& t : Registry()) {
      if (selected(t.name)) std::printf("%s\n", t.name.c_str());
    }
    return 0;
  }

  int passed = 0, failed = 0, skipped = 0;
  for (const auto& t : Registry()) {
    if (!selected(t.name)) continue;
    Now() = Current{};
    std::fflush(stdout);
    const auto start = std::chrono::steady_clock::now();
    try {
      t.fn();
    } catch (const SkipSignal&) {
    } catch (const std::exception& e) {
      Failure(__FILE__, __LINE__, "exception escaped the test") << e.what();
    } catch (...) {
      Failure(__FILE__, __LINE__, "unknown exception escaped the test");
    }
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    if (Now().failures > 0) {
      ++failed;
      std::printf("[FAIL] %s (%d failed checks, %.1f ms)\n", t.name.c_str(), Now().failures, ms);
    } else if (Now().skipped) {
      ++passed;
      ++skipped;
      std::printf("[SKIP] %s: %s\n", t.name.c_str(), Now().skip_reason.c_str());
    } else {
      ++passed;
      std::printf("[ OK ] %s (%.1f ms)\n", t.name.c_str(), ms);
    }
  }
  if (skipped > 0) std::printf("(%d of the passed tests were skipped)\n", skipped);
  std::printf("%d passed, %d failed\n", passed, failed);
  if (passed + failed == 0) return 1;
  return failed == 0 ? 0 : 1;
}

}  // namespace kt

#define KT_CONCAT_INNER(a, b) a##b
#define KT_CONCAT(a, b) KT_CONCAT_INNER(a, b)

// Defines and registers a test; `name` must be an identifier, unique in the binary.
#define KT_TEST(name)                                                    \
  static void KT_CONCAT(kt_test_, name)();                               \
  static const bool KT_CONCAT(kt_registered_, name) =                    \
      ::kt::Register(#name, &KT_CONCAT(kt_test_, name));                 \
  static void KT_CONCAT(kt_test_, name)()

// Each check may be followed by `<< message`, streamed only when it fails.
#define KT_CHECK(cond) \
  if (cond) {          \
  } else               \
    ::kt::Failure(__FILE__, __LINE__, #cond)

#define KT_CHECK_EQ(a, b)                     \
  if ((a) == (b)) {                           \
  } else                                      \
    ::kt::Failure(__FILE__, __LINE__, ::kt::DescribePair(#a " == " #b, (a), (b)))

// |a - b| <= atol + rtol * |b|, b being the expected value.
#define KT_CHECK_CLOSE(a, b, atol, rtol)                           \
  if (::kt::Close((a), (b), (atol), (rtol))) {                     \
  } else                                                           \
    ::kt::Failure(__FILE__, __LINE__,                              \
                  ::kt::DescribePair(#a " ~ " #b, (a), (b)) + " atol " + std::to_string(atol) + \
                      " rtol " + std::to_string(rtol))
