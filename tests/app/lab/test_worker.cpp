// The app's recompute worker (no window): what it replaces is freed on its own thread once no
// snapshot holds it, and a report whose parts did not change is kept, not rebuilt.
#include <gtest/gtest.h>

#include <chrono>
#include <functional>
#include <memory>
#include <thread>

#include "app/lab/worker.h"
#include "core/compress/method.h"
#include "tests/test_util.h"

#ifdef _OPENMP
#include <omp.h>
#endif

namespace kt = kvlens::testing;
using namespace kvlens;

namespace {

bool wait_for(const std::function<bool()>& ok, double seconds) {
  const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (std::chrono::steady_clock::now() < end) {
    if (ok()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return ok();
}

bool idle_at(const Worker& w, uint64_t v) {
  const auto s = w.latest();
  return s->setup_version == v && !s->busy;
}

}  // namespace

// An object stays until a sweep finds no other holder; one still held elsewhere stays through it.
TEST(Worker, RetiredObjectsAreFreedBySweepOnceNoOneElseHoldsThem) {
  Retired r;
  auto a = std::make_shared<int>(1), b = std::make_shared<int>(2);
  const std::weak_ptr<int> wa = a, wb = b;
  r.add(a);
  r.add(b);
  r.add(nullptr);
  EXPECT_EQ(r.size(), 2u);
  a.reset();  // the last other holder lets go: not freed here
  EXPECT_FALSE(wa.expired());
  r.sweep();
  EXPECT_TRUE(wa.expired());
  EXPECT_FALSE(wb.expired());
  EXPECT_EQ(r.size(), 1u);
  b.reset();
  r.sweep();
  EXPECT_TRUE(wb.expired());
  EXPECT_TRUE(r.empty());
}

// An object that holds host memory alone is freed on the list's own thread (the sweeping thread
// does not wait for its destructor); any other is freed by the sweep itself.
TEST(Worker, HostOnlyObjectsAreFreedOffTheSweepingThread) {
  struct Noted {
    Noted(std::thread::id* on, int ms) : freed_on(on), takes(ms) {}
    Noted(const Noted&) = delete;
    std::thread::id* freed_on;
    std::chrono::milliseconds takes;
    ~Noted() {
      std::this_thread::sleep_for(takes);
      *freed_on = std::this_thread::get_id();
    }
  };
  std::thread::id host_freed_on, device_freed_on;
  Retired r;
  auto host = std::make_shared<Noted>(&host_freed_on, 1000);
  auto device = std::make_shared<Noted>(&device_freed_on, 0);
  r.add(host, true);
  r.add(device);
  host.reset();
  device.reset();
  const auto t0 = std::chrono::steady_clock::now();
  r.sweep();
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_TRUE(r.empty());
  EXPECT_EQ(device_freed_on, std::this_thread::get_id()) << "the device object is freed by the sweep";
  EXPECT_LT(ms, 500.0) << "the sweep waited for the host object's destructor";
  r.drain();
  EXPECT_NE(host_freed_on, std::thread::id()) << "the host object was not freed";
  EXPECT_NE(host_freed_on, std::this_thread::get_id());
}

// An edit replaces the method's run and the report; once the caller drops the snapshot that held
// them, the worker frees them (nothing leaks). A setup submitted again unchanged keeps the very
// report it had.
TEST(Worker, ReplacedRunsAndReportsAreFreedAndAnUnchangedReportIsKept) {
  Worker w;
  kvlens::Setup s;
  s.model_dir = kt::source_dir() + "/assets/models/kvlens-scenes-6m";
  s.image_path = kt::source_dir() + "/assets/images/scene_000.png";
  s.backend.kind = "cpu";
  s.opt.max_new_tokens = 6;
  s.methods = {{1, parse_method_spec("snapkv:budget=0.3"), ""}};
  uint64_t v = w.submit(s);
  ASSERT_TRUE(wait_for([&] { return idle_at(w, v); }, 120));
  std::shared_ptr<const Snapshot> old = w.latest();
  ASSERT_EQ(old->runs.size(), 1u) << old->base_error << old->model_error;
  ASSERT_TRUE(old->report);
  const std::weak_ptr<const nlohmann::json> report = old->report;
  const std::weak_ptr<const MethodRun> run = old->runs[0].run;

  s.methods[0].params = parse_method_spec("snapkv:budget=0.5");
  v = w.submit(s);
  ASSERT_TRUE(wait_for([&] { return idle_at(w, v); }, 120));
  const std::shared_ptr<const Snapshot> now = w.latest();
  ASSERT_EQ(now->runs.size(), 1u);
  EXPECT_NE(now->runs[0].run, old->runs[0].run);
  EXPECT_NE(now->report, old->report);
  old.reset();
  EXPECT_TRUE(wait_for([&] { return report.expired() && run.expired(); }, 10));

  v = w.submit(s);
  ASSERT_TRUE(wait_for([&] { return idle_at(w, v); }, 120));
  EXPECT_EQ(w.latest()->report, now->report);
  EXPECT_EQ(w.latest()->runs[0].run, now->runs[0].run);
}

#ifdef _OPENMP
// The worker's OpenMP loops run as its creator's do (the app and the CLI set one thread): a thread
// of its own would otherwise start with OpenMP's default team of every core.
TEST(Worker, LoopsRunOnTheCreatorsOpenMpThreads) {
  const int before = omp_get_max_threads();
  for (int n : {1, 3}) {
    omp_set_num_threads(n);
    Worker w;
    ASSERT_TRUE(wait_for([&] { return w.loop_threads() != 0; }, 10));
    EXPECT_EQ(w.loop_threads(), n);
  }
  omp_set_num_threads(before);
}
#endif
