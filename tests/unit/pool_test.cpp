// The kernels' held threads (lib/kernels/pool.h): every task runs once, on
// the thread it names; exceptions of either side come back; a background
// task stops when asked; nesting and one thread fall back to plain calls.
#include <ATen/Parallel.h>
#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <set>
#include <stdexcept>
#include <thread>
#include <vector>

#include "kernels/pool.h"

namespace {

namespace k = dmi::kernels;

struct Threads {
  int before = at::get_num_threads();
  explicit Threads(int n) { at::set_num_threads(n); }
  ~Threads() { at::set_num_threads(before); }
};

int threads_here() { return static_cast<int>(std::max(2u, std::thread::hardware_concurrency())); }

}  // namespace

TEST_CASE("pool: parallel() runs each task once, on distinct threads, held or not") {
  Threads use(threads_here());
  auto check = [](int n) {
    std::vector<std::atomic<int>> runs(static_cast<std::size_t>(n));
    std::vector<std::thread::id> ids(static_cast<std::size_t>(n));
    k::parallel(n, [&](int t) {
      runs[static_cast<std::size_t>(t)]++;
      ids[static_cast<std::size_t>(t)] = std::this_thread::get_id();
    });
    for (auto& r : runs) CHECK(r.load() == 1);
    // Task 0 is the caller's; the first pool_threads() tasks each have a thread.
    if (n > 0) CHECK(ids[0] == std::this_thread::get_id());
    const std::size_t first = static_cast<std::size_t>(std::min(n, k::pool_threads()));
    CHECK(std::set<std::thread::id>(ids.begin(), ids.begin() + static_cast<std::ptrdiff_t>(first)).size() == first);
  };
  for (int n : {0, 1, 2, 3, 7}) {
    CAPTURE(n);
    check(n);
    bool inside = false;
    k::hold_threads([&] {
      inside = k::holding_threads();
      CHECK(k::pool_threads() == at::get_num_threads());
      check(n);
      check(n);  // the held threads serve one task after another
    });
    CHECK(inside);
    CHECK_FALSE(k::holding_threads());
  }
}

TEST_CASE("pool: parallel_for covers the range once, in at::parallel_for's chunks, held or not") {
  Threads use(threads_here());
  for (std::int64_t grain : {1, 3, 100, 1000}) {
    for (std::int64_t n : {0, 1, 5, 64, 999}) {
      CAPTURE(grain);
      CAPTURE(n);
      auto chunks = [&] {
        std::vector<std::atomic<int>> hits(static_cast<std::size_t>(n));
        std::atomic<int> calls{0};
        k::parallel_for(0, n, grain, [&](std::int64_t b, std::int64_t e) {
          CHECK(b < e);
          calls++;
          for (std::int64_t i = b; i < e; ++i) hits[static_cast<std::size_t>(i)]++;
        });
        for (auto& h : hits) CHECK(h.load() == 1);
        return calls.load();
      };
      const int plain = chunks();
      int held = 0;
      k::hold_threads([&] { held = chunks(); });
      CHECK(held == plain);
    }
  }
}

TEST_CASE("pool: exceptions of the caller and of held threads come back; the threads are released") {
  Threads use(threads_here());
  CHECK_THROWS_WITH_AS(k::hold_threads([] { throw std::runtime_error("from the caller"); }), "from the caller",
                       std::runtime_error);
  CHECK_FALSE(k::holding_threads());
  k::hold_threads([] {
    CHECK_THROWS_WITH_AS(k::parallel(2, [](int t) {
                           if (t == 1) throw std::runtime_error("from thread 1");
                         }),
                         "from thread 1", std::runtime_error);
    CHECK_THROWS_WITH_AS(k::parallel(2, [](int t) {
                           if (t == 0) throw std::runtime_error("from thread 0");
                         }),
                         "from thread 0", std::runtime_error);
    std::atomic<int> runs{0};
    k::parallel(2, [&](int) { runs++; });  // still served after both
    CHECK(runs.load() == 2);
  });
  // A background task's exception surfaces at the next parallel() call.
  k::hold_threads([] {
    CHECK(k::in_background([](const std::atomic<bool>&) { throw std::runtime_error("from the background"); }));
    CHECK_THROWS_WITH_AS(k::parallel(2, [](int) {}), "from the background", std::runtime_error);
  });
  // Work after the failures: the pool is whole.
  std::atomic<int> runs{0};
  k::hold_threads([&] { k::parallel(2, [&](int) { runs++; }); });
  CHECK(runs.load() == 2);
}

TEST_CASE("pool: a background task runs on held thread 1 until the next parallel call stops it") {
  Threads use(threads_here());
  CHECK_FALSE(k::in_background([](const std::atomic<bool>&) { FAIL("ran without held threads"); }));
  k::hold_threads([] {
    std::atomic<bool> started{false}, stopped{false};
    std::thread::id bg;
    const std::thread::id me = std::this_thread::get_id();
    REQUIRE(k::in_background([&](const std::atomic<bool>& stop) {
      bg = std::this_thread::get_id();
      started = true;
      while (!stop.load()) std::this_thread::yield();  // runs until told
      stopped = true;
    }));
    while (!started.load()) std::this_thread::yield();
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    CHECK_FALSE(stopped.load());
    std::thread::id t1;
    k::parallel(2, [&](int t) {
      if (t == 1) t1 = std::this_thread::get_id();
    });
    CHECK(stopped.load());  // parallel() waited for it
    CHECK(bg == t1);
    CHECK(bg != me);
    // wait_background() and the end of the hold stop one too.
    std::atomic<int> ended{0};
    auto task = [&](const std::atomic<bool>& stop) {
      while (!stop.load()) std::this_thread::yield();
      ended++;
    };
    REQUIRE(k::in_background(task));
    k::wait_background();
    CHECK(ended.load() == 1);
    REQUIRE(k::in_background(task));
  });
}

TEST_CASE("pool: nested holds, one thread and calls from inside a parallel region run inline") {
  {
    Threads one(1);
    bool ran = false;
    k::hold_threads([&] {
      ran = true;
      CHECK_FALSE(k::holding_threads());
      CHECK(k::pool_threads() == 1);
    });
    CHECK(ran);
  }
  Threads use(threads_here());
  k::hold_threads([] {
    k::hold_threads([] { CHECK(k::holding_threads()); });  // the outer hold goes on
    std::atomic<int> inner{0};
    k::parallel(2, [&](int) {
      // Inside a task, the caller's or a held thread's: no threads to hand out.
      CHECK_FALSE(k::holding_threads());
      CHECK(k::pool_threads() == 1);
      k::parallel(2, [&](int) { inner++; });
    });
    CHECK(k::holding_threads());
    CHECK(inner.load() == 4);
  });
}
