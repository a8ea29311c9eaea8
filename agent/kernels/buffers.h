// Scratch buffers that start on a cache line. A std::vector's storage (malloc) starts 16 bytes past
// one, so with rows a multiple of 64 bytes long every other 32-byte load of a row spans two lines.
#pragma once
#include <cstddef>
#include <new>
#include <vector>

namespace kernels {

constexpr std::size_t CACHE_LINE = 64;

template <typename T>
struct LineAllocator {
  using value_type = T;
  LineAllocator() = default;
  template <typename U>
  LineAllocator(const LineAllocator<U> &) {}
  T *allocate(std::size_t n) { return static_cast<T *>(::operator new(n * sizeof(T), std::align_val_t(CACHE_LINE))); }
  void deallocate(T *p, std::size_t) { ::operator delete(p, std::align_val_t(CACHE_LINE)); }
  bool operator==(const LineAllocator &) const { return true; }
  bool operator!=(const LineAllocator &) const { return false; }
};

template <typename T>
using line_vector = std::vector<T, LineAllocator<T>>;

}  // namespace kernels
