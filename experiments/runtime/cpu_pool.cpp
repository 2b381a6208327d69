// PyTorch's CPU allocator for `trainer.cpu_allocator=pooled` (see allocator.py): each block of at
// least `threshold` bytes is a mapping of its own, kept when freed and handed to the next request of
// its size, as PyTorch's CUDA allocator keeps device memory. A training step asks for the same
// sizes every step, so after the first few its blocks come back already faulted in. What is kept is
// bounded: a request no kept block fits unmaps kept blocks, largest first, until the mapped bytes
// are within 1/8 of the most the live blocks ever held. Unlike one heap, whose holes between
// long-lived tensors can only grow it, the resident memory follows what the tensors need.
// Smaller blocks go to the allocator that was in place (the C heap).

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <map>
#include <mutex>
#include <new>
#include <unordered_map>

namespace {

constexpr size_t kPage = size_t(4) << 10;
constexpr size_t kHugePage = size_t(2) << 20;
constexpr size_t kHugeFrom = size_t(16) << 20;  // blocks this large are huge-page aligned: 512x fewer faults

size_t round_up(size_t n, size_t unit) { return (n + unit - 1) / unit * unit; }

// `bytes` of fresh zero pages; huge-page aligned (and advised) from kHugeFrom, as THP's "madvise"
// setting asks, so that a fault maps 2 MB at once.
void* map_block(size_t bytes) {
  const int prot = PROT_READ | PROT_WRITE, flags = MAP_PRIVATE | MAP_ANONYMOUS;
  if (bytes < kHugeFrom) {
    void* p = mmap(nullptr, bytes, prot, flags, -1, 0);
    return p == MAP_FAILED ? nullptr : p;
  }
  void* raw = mmap(nullptr, bytes + kHugePage, prot, flags, -1, 0);
  if (raw == MAP_FAILED) return nullptr;
  uintptr_t start = reinterpret_cast<uintptr_t>(raw), aligned = round_up(start, kHugePage);
  uintptr_t end = start + bytes + kHugePage;
  if (aligned > start) munmap(raw, aligned - start);
  if (end > aligned + bytes) munmap(reinterpret_cast<void*>(aligned + bytes), end - aligned - bytes);
  madvise(reinterpret_cast<void*>(aligned), bytes, MADV_HUGEPAGE);
  return reinterpret_cast<void*>(aligned);
}

struct Pool final : c10::Allocator {
  c10::Allocator* const heap;  // the allocator in place before: small blocks, and everything when off
  const size_t threshold;
  std::mutex mutex;
  std::atomic<bool> on{true};
  std::multimap<size_t, void*> kept;           // freed blocks by size
  struct Block { size_t bytes, requested; };
  std::unordered_map<void*, Block> in_use;     // live blocks
  size_t live = 0, cached = 0, peak_live = 0;  // bytes
  int64_t maps = 0, reuses = 0, unmaps = 0;

  Pool(c10::Allocator* heap, size_t threshold) : heap(heap), threshold(threshold) {}

  c10::DataPtr allocate(size_t n) override {
    if (n < threshold || !on) return heap->allocate(n);
    size_t bytes = round_up(n, n >= kHugeFrom ? kHugePage : kPage);
    void* p = take(bytes, n);
    if (p == nullptr) throw std::bad_alloc();
    return {p, p, &release, c10::Device(c10::kCPU)};
  }

  // raw_deallocate (inside ATen) passes a pointer from raw_allocate, which may be the heap's
  c10::DeleterFnPtr raw_deleter() const override { return &release; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  void* take(size_t bytes, size_t requested) {
    std::lock_guard<std::mutex> lock(mutex);
    void* p = nullptr;
    auto fit = kept.lower_bound(bytes);
    if (fit != kept.end() && fit->first <= bytes + bytes / 8) {  // a kept block at most 1/8 larger
      bytes = fit->first;
      p = fit->second;
      kept.erase(fit);
      cached -= bytes;
      reuses++;
    } else {
      size_t bound = std::max(peak_live, live + bytes);
      bound += bound / 8;
      while (!kept.empty() && live + bytes + cached > bound) drop(std::prev(kept.end()));
      p = map_block(bytes);
      if (p == nullptr && !kept.empty()) {  // no memory left to map: unmap everything kept, and try again
        while (!kept.empty()) drop(kept.begin());
        p = map_block(bytes);
      }
      if (p == nullptr) return nullptr;
      maps++;
    }
    in_use.emplace(p, Block{bytes, requested});
    live += bytes;
    peak_live = std::max(peak_live, live);
    report(p, static_cast<int64_t>(requested));
    return p;
  }

  // false where p is not one of this pool's blocks
  bool give_back(void* p) {
    std::lock_guard<std::mutex> lock(mutex);
    auto block = in_use.find(p);
    if (block == in_use.end()) return false;
    size_t bytes = block->second.bytes, requested = block->second.requested;
    in_use.erase(block);
    live -= bytes;
    if (on) {
      kept.emplace(bytes, p);
      cached += bytes;
    } else {
      munmap(p, bytes);
      unmaps++;
    }
    report(p, -static_cast<int64_t>(requested));
    return true;
  }

  // the profiler's tensor memory sees these blocks too: under the lock, so that its events for one
  // address come in the order the blocks changed hands
  void report(void* p, int64_t bytes) {
    if (c10::memoryProfilingEnabled())
      c10::reportMemoryUsageToProfiler(p, bytes, live, live + cached, c10::Device(c10::kCPU));
  }

  void drop(std::multimap<size_t, void*>::iterator block) {
    munmap(block->second, block->first);
    cached -= block->first;
    kept.erase(block);
    unmaps++;
  }

  // unmap every kept block and start the peak afresh (a sweep's next job, or the pool switched off)
  void unmap_kept(bool stay_on) {
    std::lock_guard<std::mutex> lock(mutex);
    while (!kept.empty()) drop(kept.begin());
    peak_live = live;
    on = stay_on;
  }

  static Pool* instance;
  static void release(void* p) {
    if (!instance->give_back(p)) instance->heap->raw_deleter()(p);
  }
};

Pool* Pool::instance = nullptr;

}  // namespace

// Installs the pool as PyTorch's CPU allocator (once; later calls switch it on again); blocks from
// `threshold` bytes are pooled. 0 on success.
extern "C" int pool_install(int64_t threshold) {
  if (Pool::instance == nullptr) {
    c10::Allocator* heap = c10::GetCPUAllocator();
    if (heap->raw_deleter() == nullptr) return 1;  // the pool frees the heap's raw blocks through it
    Pool::instance = new Pool(heap, static_cast<size_t>(threshold));
    c10::SetCPUAllocator(Pool::instance, /*priority=*/UINT8_MAX);
  }
  Pool::instance->unmap_kept(/*stay_on=*/true);
  return 0;
}

// Blocks allocated from now on come from the heap; pooled blocks are unmapped as they are freed.
extern "C" void pool_switch_off() {
  if (Pool::instance != nullptr) Pool::instance->unmap_kept(/*stay_on=*/false);
}

// Unmaps the kept blocks and starts the peak afresh (the pool stays on).
extern "C" void pool_release() {
  if (Pool::instance != nullptr) Pool::instance->unmap_kept(/*stay_on=*/true);
}

// [live, kept, most ever live] bytes and [maps, reuses, unmaps] counts, for tests and benchmarks.
extern "C" void pool_stats(int64_t* out) {
  Pool* p = Pool::instance;
  if (p == nullptr) return;
  std::lock_guard<std::mutex> lock(p->mutex);
  int64_t stats[] = {int64_t(p->live), int64_t(p->cached), int64_t(p->peak_live), p->maps, p->reuses, p->unmaps};
  std::copy(stats, stats + 6, out);
}
