// Collectives between the tensor-parallel ranks of one model on one host, through a shared-memory
// segment (what vLLM's and SGLang's CPU backends do too): MindSpore's own collectives on CPU (mccl)
// cost ~0.4-1 ms per call in a graph, a shared-memory all-reduce of a decode step's activations
// tens of microseconds. oneDNN has no collective primitive.
//
// Segment (created by the launcher, named per group; agent.tensor_parallel.Group): a header of one
// cache line per rank holding that rank's generation counter, then two buffers of `size` slots of
// `slot_floats` floats each. Call g (every rank makes the same calls in the same order: same graphs,
// same steps) writes its input into buffer g % 2, slot `rank`, publishes g, waits until every rank
// has published g, then reads every slot. A rank writes buffer g % 2 again only at call g + 2,
// after every rank published g + 1 (so each has finished reading call g): two buffers suffice.
// Every rank sums in rank order, so all ranks hold bit-identical results (and sample identically).
#include <fcntl.h>
#include <immintrin.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>

namespace {

constexpr int kLine = 64;
constexpr double kTimeoutS = 120.0;  // a rank that never arrives (killed): fail the step, the agent exits

struct Group {
  char *base = nullptr;
  size_t bytes = 0;
  int rank = 0, size = 1;
  int64_t slot_floats = 0;
  uint64_t gen = 0;
  std::atomic<uint64_t> *arrived(int r) { return reinterpret_cast<std::atomic<uint64_t> *>(base + r * kLine); }
  float *slot(uint64_t g, int r) {
    return reinterpret_cast<float *>(base + size * kLine) + ((g & 1) * size + r) * slot_floats;
  }
};

Group g_group;

// Publish this rank's input for the next call and wait for every rank's; false on timeout.
bool arrive(const float *x, int64_t n) {
  Group &g = g_group;
  const uint64_t gen = ++g.gen;
  std::memcpy(g.slot(gen, g.rank), x, n * sizeof(float));
  g.arrived(g.rank)->store(gen, std::memory_order_release);
  const auto start = std::chrono::steady_clock::now();
  for (int r = 0; r < g.size; ++r) {
    for (uint64_t spins = 0; g.arrived(r)->load(std::memory_order_acquire) < gen; ++spins) {
      _mm_pause();
      if ((spins & 1023) == 1023) {
        sched_yield();  // ranks may share a core (tests, an oversubscribed host)
        if (std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() > kTimeoutS) return false;
      }
    }
  }
  return true;
}

}  // namespace

// Map the group's segment (agent.tensor_parallel); 0 on success.
extern "C" int TpOpen(const char *path, int rank, int size, int64_t slot_floats) {
  const size_t bytes = size * kLine + 2 * size * slot_floats * sizeof(float);
  const int fd = open(path, O_RDWR);
  if (fd < 0) return 1;
  struct stat st;
  if (fstat(fd, &st) != 0 || static_cast<size_t>(st.st_size) < bytes) {
    close(fd);
    return 2;
  }
  void *p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (p == MAP_FAILED) return 3;
  g_group = Group{static_cast<char *>(p), bytes, rank, size, slot_floats, 0};
  return 0;
}

extern "C" int64_t TpSegmentBytes(int size, int64_t slot_floats) { return size * kLine + 2 * size * slot_floats * 4; }

// y = the sum of x over the ranks. Input x [n, d] float32; output y [n, d].
extern "C" int AllReduce(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *stream,
                         void *extra) {
  if (nparam != 2 || std::strcmp(dtypes[0], "float32") != 0) return 1;
  const float *x = static_cast<const float *>(params[0]);
  float *y = static_cast<float *>(params[1]);
  const int64_t n = shapes[0][0] * shapes[0][1];
  Group &g = g_group;
  if (g.base == nullptr || n > g.slot_floats) return 2;
  if (!arrive(x, n)) return 3;
  std::memcpy(y, g.slot(g.gen, 0), n * sizeof(float));
  for (int r = 1; r < g.size; ++r) {
    const float *s = g.slot(g.gen, r);
    for (int64_t i = 0; i < n; ++i) y[i] += s[i];
  }
  return 0;
}

// y = the ranks' x side by side along columns (a vocabulary-parallel LM head's logits).
// Input x [n, c] float32; output y [n, size * c].
extern "C" int AllGather(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *stream,
                         void *extra) {
  if (nparam != 2 || std::strcmp(dtypes[0], "float32") != 0) return 1;
  const float *x = static_cast<const float *>(params[0]);
  float *y = static_cast<float *>(params[1]);
  const int64_t n = shapes[0][0], c = shapes[0][1];
  Group &g = g_group;
  if (g.base == nullptr || n * c > g.slot_floats) return 2;
  if (!arrive(x, n * c)) return 3;
  for (int r = 0; r < g.size; ++r) {
    const float *s = g.slot(g.gen, r);
    for (int64_t i = 0; i < n; ++i) std::memcpy(y + i * g.size * c + r * c, s + i * c, c * sizeof(float));
  }
  return 0;
}
