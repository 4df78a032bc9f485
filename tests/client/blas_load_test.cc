// libkvd_client carries the compression kernels (compact chunk expansion), whose CBLAS is loaded
// on first use (kernels/src/cpu/blas.h) instead of at program start: a client process that only
// connects, puts and gets never maps BLAS, so OpenBLAS's worker threads never start spinning in
// it. Its own binary: no other test may have called BLAS earlier in this process.
#include <gtest/gtest.h>

#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "fake_daemon.h"
#include "kvd/client/client.h"
#include "kvd/kernels/vector.h"

namespace kvd::client {
namespace {

// The lines of /proc/self/maps that map a BLAS library (libopenblas*, libblas*, libcblas*).
std::vector<std::string> BlasMappings() {
  std::ifstream maps("/proc/self/maps");
  std::vector<std::string> out;
  for (std::string line; std::getline(maps, line);) {
    const size_t slash = line.rfind('/');
    if (slash == std::string::npos) continue;
    const std::string file = line.substr(slash + 1);
    if (file.rfind("lib", 0) == 0 && file.find("blas") != std::string::npos) {
      out.push_back(line);
    }
  }
  return out;
}

std::string Joined(const std::vector<std::string>& lines) {
  std::string s;
  for (const auto& l : lines) s += "\n  " + l;
  return s;
}

TEST(ClientBlasLoadTest, AClientThatMovesChunksNeverMapsBlasAndTheKernelsLoadItOnFirstUse) {
  ASSERT_TRUE(BlasMappings().empty()) << "mapped at start:" << Joined(BlasMappings());

  // A plain client: connect, put a chunk, read it back.
  const std::string domain = "client-blas-load-test";
  testing::FakeDaemon daemon(domain, {});
  testing::PutAndGetOneHostChunk(daemon, domain, {1, 2});
  EXPECT_TRUE(BlasMappings().empty()) << "mapped by the client:" << Joined(BlasMappings());

  // The first kernel call that needs BLAS loads it (a VECTOR value rebuild, out = kpre W^T),
  // and computes what the definition says.
  const int64_t n = 3;
  const int64_t d = 4;
  std::vector<float> kpre(n * d);
  std::vector<float> w(d * d);
  for (size_t i = 0; i < kpre.size(); ++i) kpre[i] = static_cast<float>(i % 5) - 2.0f;
  for (size_t i = 0; i < w.size(); ++i) w[i] = static_cast<float>(i % 3) - 1.0f;
  std::vector<float> out(n * d, -99.0f);
  ASSERT_TRUE(
      kernels::RebuildValues({kpre.data(), n, d, d}, {w.data(), d, d, d}, {out.data(), n, d, d})
          .ok());
  EXPECT_FALSE(BlasMappings().empty()) << "the rebuild ran without mapping a BLAS library";
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t r = 0; r < d; ++r) {
      float want = 0.0f;  // small integers: every partial sum is exact in float32
      for (int64_t c = 0; c < d; ++c) want += kpre[i * d + c] * w[r * d + c];
      EXPECT_EQ(out[i * d + r], want) << "row " << i << ", column " << r;
    }
  }
}

}  // namespace
}  // namespace kvd::client
