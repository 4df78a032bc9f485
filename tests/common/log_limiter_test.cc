// LogLimiter: the first occurrence is logged, then one record per interval standing for the
// occurrences held back since the previous one (a clock driven by hand).
#include "kvd/common/log_limiter.h"

#include <gtest/gtest.h>

#include <thread>
#include <vector>

namespace kvd {
namespace {

using std::chrono::seconds;

TEST(LogLimiterTest, FirstOccurrenceThenOneRecordPerIntervalWithTheCountHeldBack) {
  ManualClock clock(1'000'000'000);
  LogLimiter limiter(seconds(60), &clock);
  EXPECT_EQ(limiter.Occur(), 1u);  // the first: logged at once
  for (int i = 0; i < 99; ++i) EXPECT_EQ(limiter.Occur(), 0u) << i;
  clock.AdvanceMillis(59'999);
  EXPECT_EQ(limiter.Occur(), 0u);  // still inside the interval
  clock.AdvanceMillis(1);
  EXPECT_EQ(limiter.Occur(), 101u);  // the 100 held back and this one
  EXPECT_EQ(limiter.Occur(), 0u);
  clock.AdvanceMillis(3'600'000);  // a quiet hour: the next one is logged at once
  EXPECT_EQ(limiter.Occur(), 2u);
  EXPECT_EQ(limiter.total(), 104u);
}

TEST(LogLimiterTest, ZeroIntervalLogsEveryOccurrence) {
  ManualClock clock;
  LogLimiter limiter(seconds(0), &clock);
  for (int i = 0; i < 5; ++i) EXPECT_EQ(limiter.Occur(), 1u);
  EXPECT_EQ(limiter.total(), 5u);
}

// Threads calling at once: every occurrence is counted once, in a record or in total().
TEST(LogLimiterTest, ConcurrentOccurrencesAreEachCountedOnce) {
  ManualClock clock;
  LogLimiter limiter(seconds(60), &clock);
  constexpr int kThreads = 4, kEach = 10'000;
  std::vector<uint64_t> logged(kThreads, 0);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kEach; ++i) logged[t] += limiter.Occur();
    });
  }
  for (auto& th : threads) th.join();
  uint64_t records = 0;
  for (uint64_t n : logged) records += n;
  EXPECT_EQ(records, 1u);  // only the first: the clock did not move
  clock.AdvanceMillis(60'000);
  EXPECT_EQ(limiter.Occur(), uint64_t{kThreads} * kEach);
  EXPECT_EQ(limiter.total(), uint64_t{kThreads} * kEach + 1);
}

}  // namespace
}  // namespace kvd
