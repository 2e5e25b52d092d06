#include "kernels/pool.h"

#include <ATen/Parallel.h>
#include <omp.h>

#include <algorithm>
#include <exception>
#include <mutex>
#include <thread>

namespace dmi::kernels {
namespace {

inline void relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#else
  std::this_thread::yield();
#endif
}

// One hold_threads() call, shared by the holding thread (thread 0) and the
// held ones. At most one task is posted at a time: the holder waits until
// every held thread has finished one before it posts the next.
struct Hold {
  enum class Kind { parallel, background, release };

  int threads = 1;  // the holder and the held
  // The task, written by the holder before it increments `posted`.
  Kind kind = Kind::parallel;
  int n = 0;
  const std::function<void(int)>* fn = nullptr;
  std::function<void(const std::atomic<bool>&)> background;
  bool background_posted = false;  // the holder's own bookkeeping

  alignas(64) std::atomic<std::uint64_t> posted{0};
  alignas(64) std::atomic<int> finished{0};  // held threads done with the task
  alignas(64) std::atomic<bool> stop{false};

  std::mutex error_mutex;
  std::exception_ptr error;  // the first exception of a held thread

  void record(std::exception_ptr e) {
    std::lock_guard<std::mutex> lock(error_mutex);
    if (!error) error = std::move(e);
  }
  void rethrow() {
    std::exception_ptr e;
    {
      std::lock_guard<std::mutex> lock(error_mutex);
      std::swap(e, error);
    }
    if (e) std::rethrow_exception(e);
  }

  void post(Kind k) {
    kind = k;
    finished.store(0, std::memory_order_relaxed);
    posted.fetch_add(1, std::memory_order_release);
  }
  void wait_finished() const {
    while (finished.load(std::memory_order_acquire) < threads - 1) relax();
  }
  void finish_background() {
    if (!background_posted) return;
    stop.store(true, std::memory_order_relaxed);
    wait_finished();
    stop.store(false, std::memory_order_relaxed);
    background_posted = false;
  }

  // A held thread's loop, until the holder posts `release`.
  void serve(int t) {
    std::uint64_t seen = 0;
    for (;;) {
      std::uint64_t p;
      while ((p = posted.load(std::memory_order_acquire)) == seen) relax();
      seen = p;
      if (kind == Kind::release) return;
      try {
        if (kind == Kind::parallel) {
          for (int i = t; i < n; i += threads) (*fn)(i);
        } else if (t == 1) {
          background(stop);
        }
      } catch (...) {
        record(std::current_exception());
      }
      finished.fetch_add(1, std::memory_order_release);
    }
  }
};

thread_local Hold* held = nullptr;  // on the holding thread, inside hold_threads()

}  // namespace

void hold_threads(const std::function<void()>& fn) {
  const int threads = at::get_num_threads();
  if (held || threads < 2 || omp_in_parallel()) {
    fn();
    return;
  }
  Hold h;
  std::exception_ptr error;
#pragma omp parallel num_threads(threads)
  {
    const int t = omp_get_thread_num();
    if (t == 0) {
      h.threads = omp_get_num_threads();  // the held threads read it only after a post
      held = h.threads > 1 ? &h : nullptr;
      try {
        fn();
      } catch (...) {
        error = std::current_exception();
      }
      held = nullptr;
      h.finish_background();
      h.post(Hold::Kind::release);
    } else {
      h.serve(t);
    }
  }
  if (error) std::rethrow_exception(error);
  h.rethrow();  // a background task's exception nobody collected
}

bool holding_threads() { return held != nullptr; }

int pool_threads() {
  if (held) return held->threads;
  return omp_in_parallel() ? 1 : at::get_num_threads();
}

void parallel(int n, const std::function<void(int)>& fn) {
  if (n <= 1) {
    if (n == 1) fn(0);
    return;
  }
  Hold* h = held;
  if (!h) {
    const int threads = std::min(n, pool_threads());
    at::parallel_for(0, threads, 1, [&](std::int64_t begin, std::int64_t end) {
      for (std::int64_t i = begin; i < end; ++i)
        for (std::int64_t t = i; t < n; t += threads) fn(static_cast<int>(t));
    });
    return;
  }
  h->finish_background();
  h->rethrow();
  h->n = n;
  h->fn = &fn;
  h->post(Hold::Kind::parallel);
  // The caller's tasks run as the held threads' do: a parallel() call in
  // them runs inline instead of posting to threads that are busy.
  held = nullptr;
  std::exception_ptr error;
  try {
    for (int i = 0; i < n; i += h->threads) fn(i);
  } catch (...) {
    error = std::current_exception();
  }
  held = h;
  h->wait_finished();
  h->fn = nullptr;
  if (error) std::rethrow_exception(error);
  h->rethrow();
}

void parallel_for(std::int64_t begin, std::int64_t end, std::int64_t grain,
                  const std::function<void(std::int64_t, std::int64_t)>& fn) {
  if (begin >= end) return;
  if (!held) {
    at::parallel_for(begin, end, grain, fn);
    return;
  }
  const std::int64_t g = std::max<std::int64_t>(grain, 1);
  const std::int64_t n = std::min<std::int64_t>(held->threads, (end - begin + g - 1) / g);
  if (n <= 1) {
    fn(begin, end);
    return;
  }
  const std::int64_t chunk = (end - begin + n - 1) / n;
  parallel(static_cast<int>(n), [&](int t) {
    const std::int64_t b = begin + t * chunk;
    if (b < end) fn(b, std::min(end, b + chunk));
  });
}

bool in_background(std::function<void(const std::atomic<bool>& stop)> fn) {
  Hold* h = held;
  if (!h) return false;
  h->finish_background();
  h->background = std::move(fn);
  h->post(Hold::Kind::background);
  h->background_posted = true;
  return true;
}

void wait_background() {
  if (held) held->finish_background();
}

}  // namespace dmi::kernels
