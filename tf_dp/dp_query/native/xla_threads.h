// Threads for tf_dp's XLA CPU custom-call targets (patches_op.cc, gaussian_noise_op.cc): XLA's
// legacy custom-call API passes no thread pool, so a call splits its work over std::threads.
#ifndef TF_DP_NATIVE_XLA_THREADS_H_
#define TF_DP_NATIVE_XLA_THREADS_H_

#include <sched.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <thread>
#include <vector>

namespace tf_dp {

// The CPUs this process may run on (its affinity mask), at least 1.
inline int64_t UsableCpus() {
  static const int64_t count = [] {
    cpu_set_t set;
    CPU_ZERO(&set);
    if (sched_getaffinity(0, sizeof(set), &set) == 0 && CPU_COUNT(&set) > 0) {
      return static_cast<int64_t>(CPU_COUNT(&set));
    }
    return std::max<int64_t>(1, std::thread::hardware_concurrency());
  }();
  return count;
}

// Runs fn(u0, u1) over [0, units) split into contiguous ranges of at least `min_units` units,
// one per usable CPU at most: this thread and std::threads started for the call.
inline void ThreadShard(int64_t units, int64_t min_units,
                        const std::function<void(int64_t, int64_t)>& fn) {
  const int64_t shards =
      std::max<int64_t>(1, std::min(UsableCpus(), units / std::max<int64_t>(1, min_units)));
  std::vector<std::thread> threads;
  for (int64_t i = 1; i < shards; ++i) {
    threads.emplace_back(fn, units * i / shards, units * (i + 1) / shards);
  }
  fn(0, units / shards);
  for (auto& t : threads) t.join();
}

}  // namespace tf_dp

#endif  // TF_DP_NATIVE_XLA_THREADS_H_
