// Threads for dmi's kernels.
//
// A decode step runs ~140 parallel operations (a 28-layer model's
// projections and attention), each a few to a hundred microseconds long.
// Forking an OpenMP team for each costs ~3.7 us on a 2-core VM, the fork and
// the join, and memory idles while the small operations between two
// projections run on one thread. hold_threads() keeps LibTorch's OpenMP
// threads in one parallel region for a whole forward pass instead: the
// calling thread runs the pass, the others spin until it hands them work by
// writing one word (~0.5 us a round trip there), and in between one of them
// can read the next projection's weights into its cache (in_background()).
//
// Outside hold_threads() parallel() and parallel_for() are at::parallel_for,
// and ATen's own operations are unchanged. Inside, ATen's operations run on
// the calling thread only (it is in a parallel region): hold the threads for
// forward passes whose operations are small, decode steps.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>

namespace dmi::kernels {

// Runs fn() on the calling thread while LibTorch's other OpenMP threads wait
// for its parallel() calls; the threads are released when fn returns or
// throws (the exception propagates). Without other threads, inside a
// parallel region, or when the caller holds them already, just fn().
void hold_threads(const std::function<void()>& fn);

// Whether the calling thread is inside hold_threads() and holds other threads.
bool holding_threads();

// The threads a parallel() call from this thread can use: the held ones with
// the caller; else at::get_num_threads(), or 1 inside a parallel region.
int pool_threads();

// fn(t) for every t in [0, n): thread i of the min(n, pool_threads())
// threads runs t = i, i + threads, ...; the caller is thread 0. The first
// exception is rethrown once all are done.
void parallel(int n, const std::function<void(int)>& fn);

// at::parallel_for's contract and partition: [begin, end) in one chunk per
// thread, at least `grain` items each, on the calling thread alone when the
// range is shorter than grain.
void parallel_for(std::int64_t begin, std::int64_t end, std::int64_t grain,
                  const std::function<void(std::int64_t, std::int64_t)>& fn);

// Hands fn to held thread 1 and returns at once: fn(stop) should return soon
// after stop becomes true, which the next parallel() call, wait_background()
// or the end of the hold sets, each waiting for it to return. Returns false
// and runs nothing unless the caller holds threads. Exceptions in fn are
// rethrown by that next call.
bool in_background(std::function<void(const std::atomic<bool>& stop)> fn);

// Stops a task of in_background() and waits for it to return; nothing if none runs.
void wait_background();

}  // namespace dmi::kernels
