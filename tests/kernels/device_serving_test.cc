// DeviceCompactChunk (device_serving.h): the compact and dense serving forms written on the
// device must equal the CPU's (BuildServingHead, ExpandDenseChunk) bit for bit: the device only
// moves data and converts dtype <-> float32 with the CPU's rounding; ln l_j and routed values
// come from the CPU code. Device cases skip without a CUDA device.
#include "kvd/kernels/device_serving.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>

#include "kernels_testing.h"
#include "kvd/kernels/serving.h"
#include "mean_value_stage.h"
#include "reference.h"
#include "serving_cases.h"

#if KVD_HAVE_CUDA
#include <cuda_runtime.h>
#endif

namespace kvd::kernels {
namespace {

using ::testing::HasSubstr;
using testing::MakeCase;
using testing::ServingCase;

TEST(DeviceServing, ReportsWhyItCannotRun) {
  if (CudaDeviceAvailable()) GTEST_SKIP() << "a CUDA device is present: the CUDA cases run";
  ServingCase f = MakeCase(DType::kBFloat16, 1, 1, 64, 4, false, 1);
  auto dev = DeviceCompactChunk::Upload(f.chunk, nullptr, nullptr, nullptr);
  ASSERT_FALSE(dev.ok());
#if KVD_HAVE_CUDA
  EXPECT_EQ(dev.status().code(), StatusCode::kUnavailable);
  EXPECT_THAT(dev.status().message(), HasSubstr("no CUDA device"));
#else
  EXPECT_EQ(dev.status().code(), StatusCode::kUnimplemented);
  EXPECT_THAT(dev.status().message(), HasSubstr("no CUDA kernels"));
#endif
}

// The host image that Upload copies to the device (device_serving_internal.h), for a chunk of a
// route stage without a device rebuild (mean_value_stage.h): its rebuilt rows are the CPU
// rebuild's (BuildServingHead), without RoPE or weights, so DeviceCompactChunk serves the stage.
TEST(DeviceServing, TheImageCarriesTheHostRebuildOfARouteStage) {
  ASSERT_TRUE(testing::RegisterMeanValueStage().ok());
  ServingCase f = MakeCase(DType::kFloat32, 1, 2, 8, 12, true, 3);
  f.chunk.codec.route = testing::kMeanValue;
  f.chunk.codec.calibration_version = 0;
  std::vector<uint8_t> image;
  auto heads = PackDeviceImage(f.chunk, nullptr, nullptr, [&](size_t n) {
    image.resize(n);
    return image.data();
  });
  ASSERT_TRUE(heads.ok()) << heads.status();
  int64_t rebuilt = 0;
  for (int h = 0; h < 2; ++h) {
    auto served = BuildServingHead(f.chunk, 0, h, nullptr, nullptr);
    ASSERT_TRUE(served.ok()) << served.status();
    const CompactHead& src = f.chunk.Head(0, h);
    const auto* rows = reinterpret_cast<const float*>(image.data() + (*heads)[h].rebuilt);
    int64_t r = 0;
    for (int64_t j = 0; j < src.slots(); ++j) {
      if (!(src.flags[j] & kSlotRebuildValue)) continue;
      EXPECT_EQ(std::memcmp(rows + r * 8, served->values.Row(j), 8 * sizeof(float)), 0)
          << "head " << h << " slot " << j;
      ++r;
    }
    rebuilt += r;
  }
  EXPECT_GT(rebuilt, 0);
}

#if KVD_HAVE_CUDA

template <typename T>
struct DeviceArray {
  explicit DeviceArray(size_t n) : n(n) {
    EXPECT_EQ(cudaMalloc(&p, n * sizeof(T) + 1), cudaSuccess);
  }
  ~DeviceArray() { cudaFree(p); }
  std::vector<T> Read() const {
    std::vector<T> out(n);
    EXPECT_EQ(cudaMemcpy(out.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
    return out;
  }
  T* p = nullptr;
  size_t n;
};

TEST(DeviceServingCuda, DenseAndCompactFormsEqualTheCpuBitForBit) {
  if (!CudaDeviceAvailable()) GTEST_SKIP() << "no CUDA device: DeviceCompactChunk needs one";
  for (DType dtype : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
    for (bool routed : {false, true}) {
      for (int d : {64, 128}) {
        SCOPED_TRACE(std::string(DTypeName(dtype)) + (routed ? " routed" : "") +
                     " d=" + std::to_string(d));
        ServingCase f = MakeCase(dtype, 3, 2, d, 97, routed, 40 + d);
        auto rope = RopeTable::Create(f.rope_config, d);
        ASSERT_TRUE(rope.ok());
        const VectorWeights* w = routed ? &f.weights : nullptr;
        int64_t tokens = 0;
        auto cpu = ExpandDenseChunk(f.chunk, &*rope, w, &tokens);
        ASSERT_TRUE(cpu.ok()) << cpu.status();
        cudaStream_t stream;
        ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
        auto dev = DeviceCompactChunk::Upload(f.chunk, &*rope, w, stream);
        ASSERT_TRUE(dev.ok()) << dev.status();
        ASSERT_EQ((*dev)->DenseTokens().value(), tokens);
        // Dense: every layer into one device copy of the raw chunk layout.
        DeviceArray<uint8_t> out(cpu->size());
        const size_t half =
            static_cast<size_t>(tokens) * f.chunk.num_kv_heads * d * DTypeSize(dtype);
        for (int l = 0; l < f.chunk.num_layers; ++l) {
          uint8_t* k = out.p + 2 * l * half;
          ASSERT_TRUE((*dev)->DenseLayer(l, k, k + half, stream).ok());
        }
        ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
        EXPECT_TRUE(out.Read() == *cpu) << "dense bytes differ";
        // Compact: each head against BuildServingHead.
        for (int l = 0; l < f.chunk.num_layers; ++l) {
          for (int h = 0; h < f.chunk.num_kv_heads; ++h) {
            auto sh = BuildServingHead(f.chunk, l, h, &*rope, w);
            ASSERT_TRUE(sh.ok()) << sh.status();
            const size_t s = static_cast<size_t>((*dev)->Slots(l, h));
            DeviceArray<float> keys(s * d), values(s * d), bias(s);
            DeviceArray<int64_t> positions(s);
            ASSERT_TRUE(
                (*dev)->CompactHead(l, h, keys.p, values.p, bias.p, positions.p, stream).ok());
            ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
            auto bits = [](const std::vector<float>& a, const std::vector<float>& b) {
              return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * 4) == 0;
            };
            EXPECT_TRUE(bits(keys.Read(), sh->keys.values)) << "keys " << l << "/" << h;
            EXPECT_TRUE(bits(values.Read(), sh->values.values)) << "values " << l << "/" << h;
            EXPECT_TRUE(bits(bias.Read(), sh->bias)) << "bias " << l << "/" << h;
            EXPECT_EQ(positions.Read(), sh->positions);
          }
        }
        dev->reset();
        cudaStreamDestroy(stream);
      }
    }
  }
}

TEST(DeviceServingCuda, RefusesWhatTheCpuRefuses) {
  if (!CudaDeviceAvailable()) GTEST_SKIP() << "no CUDA device: DeviceCompactChunk needs one";
  ServingCase f = MakeCase(DType::kBFloat16, 1, 1, 64, 10, true, 3);
  auto rope = RopeTable::Create(f.rope_config, 64);
  auto missing = DeviceCompactChunk::Upload(f.chunk, &*rope, nullptr, nullptr);
  EXPECT_EQ(missing.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_THAT(missing.status().message(), HasSubstr("needs VECTOR weights"));
  f.chunk.heads[0].cardinality.pop_back();
  EXPECT_EQ(DeviceCompactChunk::Upload(f.chunk, &*rope, &f.weights, nullptr).status().code(),
            StatusCode::kInvalidArgument);
}

#endif  // KVD_HAVE_CUDA

}  // namespace
}  // namespace kvd::kernels
