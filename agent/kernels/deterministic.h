// Batch invariance (serving_config.deterministic): every output element summed in one order whatever
// else its call holds. The float projections then run the streaming loop at every row count (each
// output sums its k products in order, one FMA each, in any tile: oneDNN's blocking follows the row
// count), and attention gives each token its own pass over its keys in order (no GEMM over a chunk's
// queries, no split of one token's keys over the cores). Per process: the agent sets it once at load
// (SetDeterministic, agent/runner.py).
#pragma once
#include <atomic>

namespace kernels {

inline std::atomic<bool> &deterministic_flag() {
  static std::atomic<bool> on{false};
  return on;
}

inline bool deterministic() { return deterministic_flag().load(std::memory_order_relaxed); }

}  // namespace kernels
