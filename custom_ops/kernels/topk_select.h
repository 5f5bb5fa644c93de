// Top-k of a score vector in the Indexer's order, without sorting every score: descending score, equal scores by
// lower index, NaN above every number, +0 == -0 (kernels/indexer.h; ref::SelectTopK is the reference, a partial
// sort). Built at the baseline; the Indexer variants call it after scoring.
//
// Method: every score becomes a 32-bit key whose unsigned order is the score order (NaN highest, both zeros equal).
// A radix select (histograms of 11, 11 and 10 key bits) finds the k-th largest key T and how many of the winners
// equal T; one pass then collects, in index order, every key above T and the first of those equal to T, and a
// stable least-significant-digit radix sort of those k by key (descending) leaves equal keys in index order. O(n)
// for the selection plus O(k) per sort pass.
#pragma once

#include <cstdint>

namespace dsv4 {

// out[0, k) = the first k of the order above among indices [0, n); requires 0 <= k <= n. Uses the calling thread's
// scratch slot 3 (platform/thread_scratch.h).
void SelectTopKRadix(const float* score, int64_t n, int64_t k, int64_t* out);

}  // namespace dsv4
