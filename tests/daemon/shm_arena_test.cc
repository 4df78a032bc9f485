// ShmArena (daemon-private): segment replacement at a handover, with and without prepared spare
// segments. What a client sees is a mapping of a memfd it was given (DupSegment), as here.
#include "shm_arena.h"

#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>

namespace kvd::daemon {
namespace {

constexpr uint64_t kSegment = uint64_t{1} << 20;

size_t OpenFds() {
  return static_cast<size_t>(std::distance(std::filesystem::directory_iterator("/proc/self/fd"),
                                           std::filesystem::directory_iterator()));
}

// A client's view of a segment: a shared mapping of a duplicate of its memfd.
struct ClientView {
  explicit ClientView(const ShmArena& arena, uint32_t segment) {
    auto fd = arena.DupSegment(segment);
    EXPECT_TRUE(fd.ok()) << fd.status();
    if (!fd.ok()) return;
    generation = fd->generation;
    size = fd->size;
    struct stat st {};
    EXPECT_EQ(::fstat(fd->fd, &st), 0);
    allocated = static_cast<uint64_t>(st.st_blocks) * 512;
    void* p = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd->fd, 0);
    ::close(fd->fd);
    EXPECT_NE(p, MAP_FAILED);
    if (p != MAP_FAILED) data = static_cast<std::byte*>(p);
  }
  ~ClientView() {
    if (data != nullptr) ::munmap(data, size);
  }
  bool AllZero() const {
    return std::all_of(data, data + size, [](std::byte b) { return b == std::byte{0}; });
  }
  std::byte* data = nullptr;
  uint64_t size = 0;
  uint64_t generation = 0;
  uint64_t allocated = 0;  // bytes of the memfd backed by pages
};

TEST(ShmArenaTest, HandedOverSegmentTakesAPreparedSpareAndTheOldMemoryGoes) {
  auto arena = ShmArena::Create(4 * kSegment, kSegment, /*spare_segments=*/1);
  ASSERT_TRUE(arena.ok()) << arena.status();
  ShmArena& a = **arena;
  a.WaitForSpares();
  ClientView before(a, 1);
  ASSERT_NE(before.data, nullptr);
  std::byte* daemon_view = a.base() + kSegment;
  std::memset(daemon_view, 0x5a, kSegment);
  EXPECT_EQ(before.data[123], std::byte{0x5a});  // the same memory

  ASSERT_TRUE(a.OnSegmentHandover(1).ok());
  EXPECT_EQ(a.replacements(), 1u);
  EXPECT_EQ(a.spares_used(), 1u);
  a.WaitForSpares();  // the old memfd is retired, a new spare prepared
  ClientView after(a, 1);
  ASSERT_NE(after.data, nullptr);
  EXPECT_EQ(after.generation, before.generation + 1);
  // The spare's pages were allocated before it was needed (nothing to fault in on first use).
  EXPECT_GE(after.allocated, kSegment);
  EXPECT_TRUE(after.AllZero());
  EXPECT_EQ(daemon_view[0], std::byte{0});  // the daemon's addresses now show the new memory
  // The old memfd's pages were punched out: whoever still maps it reads zeros, and what is
  // written into the segment now never shows there.
  EXPECT_TRUE(before.AllZero());
  std::memset(daemon_view, 0x77, kSegment);
  EXPECT_EQ(after.data[kSegment - 1], std::byte{0x77});
  EXPECT_EQ(before.data[kSegment - 1], std::byte{0});
  // Other segments are untouched.
  ClientView other(a, 0);
  EXPECT_EQ(other.generation, before.generation);
}

TEST(ShmArenaTest, WithoutSparesTheOldMemoryGoesAtOnce) {
  auto arena = ShmArena::Create(2 * kSegment, kSegment, /*spare_segments=*/0);
  ASSERT_TRUE(arena.ok()) << arena.status();
  ShmArena& a = **arena;
  a.WaitForSpares();  // returns at once: no thread
  ClientView before(a, 0);
  std::memset(a.base(), 0x33, kSegment);
  ASSERT_TRUE(a.OnSegmentHandover(0).ok());
  EXPECT_EQ(a.replacements(), 1u);
  EXPECT_EQ(a.spares_used(), 0u);
  EXPECT_TRUE(before.AllZero());
  ClientView after(a, 0);
  EXPECT_EQ(after.generation, before.generation + 1);
  EXPECT_TRUE(after.AllZero());
}

TEST(ShmArenaTest, AShortLastSegmentGetsFreshMemoryOfItsOwnSize) {
  const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  auto arena = ShmArena::Create(2 * kSegment + 4 * page, kSegment, /*spare_segments=*/1);
  ASSERT_TRUE(arena.ok()) << arena.status();
  ShmArena& a = **arena;
  a.WaitForSpares();
  ASSERT_TRUE(a.OnSegmentHandover(2).ok());
  EXPECT_EQ(a.replacements(), 1u);
  EXPECT_EQ(a.spares_used(), 0u);  // a spare has a whole segment's size
  ClientView last(a, 2);
  EXPECT_EQ(last.size, 4 * page);
  EXPECT_EQ(last.generation, 2u);
}

TEST(ShmArenaTest, RepeatedTurnoverUsesSparesAndLeaksNoDescriptor) {
  const size_t fds_before = OpenFds();
  {
    auto arena = ShmArena::Create(2 * kSegment, kSegment, /*spare_segments=*/1);
    ASSERT_TRUE(arena.ok()) << arena.status();
    ShmArena& a = **arena;
    for (int i = 0; i < 10; ++i) {
      a.WaitForSpares();
      std::memset(a.base(), i + 1, kSegment);
      ASSERT_TRUE(a.OnSegmentHandover(static_cast<uint32_t>(i % 2)).ok());
    }
    EXPECT_EQ(a.replacements(), 10u);
    EXPECT_EQ(a.spares_used(), 10u);
    // Handed over while replacements are still being retired: the destructor finishes them.
    ASSERT_TRUE(a.OnSegmentHandover(0).ok());
    ASSERT_TRUE(a.OnSegmentHandover(1).ok());
  }
  EXPECT_EQ(OpenFds(), fds_before);
}

TEST(ShmArenaTest, OutOfRangeSegmentIsRefusedOrIgnored) {
  auto arena = ShmArena::Create(2 * kSegment, kSegment, /*spare_segments=*/1);
  ASSERT_TRUE(arena.ok()) << arena.status();
  auto fd = (*arena)->DupSegment(2);
  ASSERT_FALSE(fd.ok());
  EXPECT_EQ(fd.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(fd.status().message().find("out of range"), std::string::npos) << fd.status();
  EXPECT_EQ((*arena)->Generation(2).status().code(), StatusCode::kInvalidArgument);
  const Status out_of_range = (*arena)->OnSegmentHandover(7);  // must not touch anything
  EXPECT_EQ(out_of_range.code(), StatusCode::kInvalidArgument) << out_of_range;
  EXPECT_EQ((*arena)->replacements(), 0u);
}

// Generation says what DupSegment would give, and grows with each replacement.
TEST(ShmArenaTest, GenerationMatchesTheDescriptorsAndGrowsOnReplacement) {
  auto arena = ShmArena::Create(2 * kSegment, kSegment);
  ASSERT_TRUE(arena.ok()) << arena.status();
  ShmArena& a = **arena;
  for (uint32_t round = 0; round < 3; ++round) {
    for (uint32_t segment = 0; segment < 2; ++segment) {
      auto g = a.Generation(segment);
      auto fd = a.DupSegment(segment);
      ASSERT_TRUE(g.ok() && fd.ok());
      EXPECT_EQ(*g, fd->generation) << "segment " << segment;
      ::close(fd->fd);
    }
    const uint64_t before = *a.Generation(1);
    ASSERT_TRUE(a.OnSegmentHandover(1).ok());
    EXPECT_EQ(*a.Generation(1), before + 1);
  }
  EXPECT_EQ(*a.Generation(0), 1u);
}

}  // namespace
}  // namespace kvd::daemon
