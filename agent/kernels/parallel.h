// Work splitting for the kernels: worker threads, one per extra core this process may run on (agents
// are pinned). A decode step makes ~150 kernel calls microseconds apart: starting threads per call
// cost ~20 us each and waking sleeping ones about as much, so workers spin a short while between
// calls before they sleep. A call waits only for the workers that joined it (took a ticket before
// the caller ran out of parts): a worker descheduled by another process on its core (the server,
// while steps overlap) then costs the call nothing instead of stalling it until that worker runs.
#pragma once
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace kernels {

constexpr auto SPIN = std::chrono::microseconds(200);

inline void relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

inline int64_t pinned_cores() {
  static const int64_t cores = [] {
    cpu_set_t set;
    return sched_getaffinity(0, sizeof(set), &set) == 0 ? std::max(1, CPU_COUNT(&set)) : 1;
  }();
  return cores;
}

class Pool {
 public:
  // Never destroyed: workers stay parked on it until the process exits.
  static Pool &get() {
    static Pool *pool = new Pool(pinned_cores() - 1);
    return *pool;
  }

  // Runs fn(0) .. fn(parts - 1) on the caller and the workers. MindSpore may run independent ops
  // concurrently: a call that finds the pool busy runs its parts on its own thread.
  void run(int64_t parts, const std::function<void(int64_t)> &fn) {
    std::unique_lock<std::mutex> busy(call_, std::try_to_lock);
    if (!busy.owns_lock() || workers_ == 0 || parts <= 1) {
      for (int64_t i = 0; i < parts; ++i) fn(i);
      return;
    }
    fn_ = &fn;
    parts_ = parts;
    next_.store(0);
    done_.store(0);
    tickets_.store(workers_, std::memory_order_release);
    {
      // Under the lock that sleepers check the generation with: none can miss this wake-up.
      std::lock_guard<std::mutex> g(m_);
      generation_.fetch_add(1);
    }
    wake_.notify_all();
    work();
    const int64_t joined = workers_ - tickets_.exchange(0);  // no worker joins after this
    while (done_.load(std::memory_order_acquire) != joined) relax();
  }

 private:
  explicit Pool(int64_t workers) : workers_(std::max<int64_t>(workers, 0)) {
    for (int64_t i = 0; i < workers_; ++i) std::thread([this] { loop(); }).detach();
  }

  void work() {
    for (int64_t i; (i = next_.fetch_add(1)) < parts_;) (*fn_)(i);
  }

  void loop() {
    uint64_t seen = 0;
    for (;;) {
      const auto until = std::chrono::steady_clock::now() + SPIN;
      while (generation_.load(std::memory_order_acquire) == seen && std::chrono::steady_clock::now() < until) relax();
      if (generation_.load(std::memory_order_acquire) == seen) {
        std::unique_lock<std::mutex> g(m_);
        wake_.wait(g, [&] { return generation_.load() != seen; });
      }
      seen = generation_.load(std::memory_order_acquire);
      int64_t t = tickets_.load(std::memory_order_acquire);
      while (t > 0 && !tickets_.compare_exchange_weak(t, t - 1, std::memory_order_acq_rel)) {
      }
      if (t > 0) {  // joined: the caller waits for this worker's parts
        work();
        done_.fetch_add(1, std::memory_order_release);
      }
    }
  }

  const int64_t workers_;
  std::mutex call_, m_;
  std::condition_variable wake_;
  const std::function<void(int64_t)> *fn_ = nullptr;
  int64_t parts_ = 0;
  std::atomic<int64_t> next_{0}, tickets_{0}, done_{0};
  std::atomic<uint64_t> generation_{0};
};

// fn(begin, end) over [0, n) in one contiguous range per core, ranges rounded to `align`.
template <typename F>
void parallel_ranges(int64_t n, int64_t align, F fn) {
  const int64_t parts = std::max<int64_t>(1, std::min(pinned_cores(), (n + align - 1) / align));
  const int64_t step = ((n + parts - 1) / parts + align - 1) / align * align;
  Pool::get().run(parts, [&](int64_t i) {
    const int64_t b = i * step, e = std::min(n, b + step);
    if (b < e) fn(b, e);
  });
}

// fn(begin, end) over [0, n) in chunks of `chunk`: each thread walks its own contiguous range
// front to back (one stream for the prefetchers), and a thread done with its range takes chunks
// from the back of the others'. A worker that starts late or runs slower then costs the caller
// at most a chunk. Two fixed halves left a one-token int8 step (Zen 3) waiting ~0.9 ms for the
// worker; chunks dealt round-robin to whoever was free balanced it but broke the streams (3-6% slower).
template <typename F>
void parallel_chunks(int64_t n, int64_t chunk, F fn) {
  chunk = std::max<int64_t>(chunk, 1);
  const int64_t chunks = (n + chunk - 1) / chunk, parts = std::max<int64_t>(1, std::min(pinned_cores(), chunks));
  struct alignas(64) Range {
    std::atomic<uint64_t> front_back;  // next chunk from the front << 32 | one past the last
  };
  std::vector<Range> ranges(parts);
  for (int64_t p = 0; p < parts; ++p)
    ranges[p].front_back.store(uint64_t(chunks * p / parts) << 32 | uint64_t(chunks * (p + 1) / parts));
  // Takes a chunk from range r's front (its owner) or back (a thief); -1 when it is empty.
  const auto take = [&](int64_t r, bool front) -> int64_t {
    uint64_t fb = ranges[r].front_back.load(std::memory_order_relaxed);
    for (;;) {
      const uint64_t f = fb >> 32, b = fb & 0xffffffffu;
      if (f >= b) return -1;
      const uint64_t next = front ? (f + 1) << 32 | b : f << 32 | (b - 1);
      if (ranges[r].front_back.compare_exchange_weak(fb, next, std::memory_order_acq_rel))
        return static_cast<int64_t>(front ? f : b - 1);
    }
  };
  const auto run = [&](int64_t c) { fn(c * chunk, std::min(n, (c + 1) * chunk)); };
  Pool::get().run(parts, [&](int64_t p) {
    for (int64_t c; (c = take(p, true)) >= 0;) run(c);
    for (int64_t q = 1; q < parts; ++q)
      for (int64_t c; (c = take((p + q) % parts, false)) >= 0;) run(c);
  });
}

}  // namespace kernels
