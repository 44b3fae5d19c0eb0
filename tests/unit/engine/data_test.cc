#include "worker/engine/data.h"

#include <stdlib.h>
#include <sys/resource.h>
#include <zlib.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <numeric>
#include <set>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace aidn::engine {
namespace {

using ::testing::HasSubstr;

// ---------------------------------------------------------------------------
// The real Fashion-MNIST (Debian's dataset-fashion-mnist).

bool HaveFashionMnist() {
  return std::filesystem::exists(std::string(kFashionMnistDir) + "/train-images-idx3-ubyte.gz");
}

void ExpectNormalisedAndBalanced(const Dataset& d, int64_t size) {
  ASSERT_EQ(d.size, size);
  EXPECT_EQ(d.rows, 28);
  EXPECT_EQ(d.cols, 28);
  EXPECT_EQ(d.classes, 10);
  ASSERT_EQ(d.images.size(), static_cast<size_t>(size) * 28 * 28);
  ASSERT_EQ(d.labels.size(), static_cast<size_t>(size));
  EXPECT_EQ(d.labels[0], 9);  // both splits start with an ankle boot
  std::map<int32_t, int64_t> per_class;
  for (int32_t l : d.labels) ++per_class[l];
  ASSERT_EQ(per_class.size(), 10u);
  for (const auto& [label, n] : per_class) EXPECT_EQ(n, size / 10) << "class " << label;
  const float lo = (0.0f - kFashionMnistMean) / kFashionMnistStd;
  const float hi = (1.0f - kFashionMnistMean) / kFashionMnistStd;
  const auto [min, max] = std::minmax_element(d.images.begin(), d.images.end());
  EXPECT_FLOAT_EQ(*min, lo);
  EXPECT_FLOAT_EQ(*max, hi);
}

TEST(LoadFashionMnist, ReadsTheTrainSetNormalisedToZeroMeanUnitStd) {
  if (!HaveFashionMnist()) GTEST_SKIP() << "no Fashion-MNIST in " << kFashionMnistDir;
  auto train = LoadFashionMnist(kFashionMnistDir, /*train=*/true);
  ASSERT_TRUE(train.ok()) << train.status();
  ExpectNormalisedAndBalanced(*train, 60000);
  double sum = 0, sum_sq = 0;
  for (float x : train->images) {
    sum += x;
    sum_sq += static_cast<double>(x) * x;
  }
  const double n = static_cast<double>(train->images.size());
  const double mean = sum / n;
  EXPECT_NEAR(mean, 0.0, 2e-3);
  EXPECT_NEAR(std::sqrt(sum_sq / n - mean * mean), 1.0, 2e-3);
}

TEST(LoadFashionMnist, ReadsTheTestSet) {
  if (!HaveFashionMnist()) GTEST_SKIP() << "no Fashion-MNIST in " << kFashionMnistDir;
  auto test = LoadFashionMnist(kFashionMnistDir, /*train=*/false);
  ASSERT_TRUE(test.ok()) << test.status();
  ExpectNormalisedAndBalanced(*test, 10000);
}

// ---------------------------------------------------------------------------
// Crafted files.

class IdxFiles : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/aidn_data_test_XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  static std::string Header(uint32_t magic, const std::vector<uint32_t>& dims) {
    std::string h;
    auto put = [&h](uint32_t v) {
      for (int shift = 24; shift >= 0; shift -= 8)
        h.push_back(static_cast<char>((v >> shift) & 0xff));
    };
    put(magic);
    for (uint32_t d : dims) put(d);
    return h;
  }
  static std::string Images(uint32_t count, uint32_t rows, uint32_t cols, size_t pixel_bytes) {
    std::string s = Header(0x803, {count, rows, cols});
    for (size_t i = 0; i < pixel_bytes; ++i) s.push_back(static_cast<char>((i * 37) % 256));
    return s;
  }
  static std::string Images(uint32_t count, uint32_t rows, uint32_t cols) {
    return Images(count, rows, cols, size_t{count} * rows * cols);
  }
  static std::string Labels(const std::vector<uint8_t>& labels) {
    std::string s = Header(0x801, {static_cast<uint32_t>(labels.size())});
    s.append(labels.begin(), labels.end());
    return s;
  }

  // Writes `content` gzip'd (the default, as the real files are) or plain.
  std::string Write(const std::string& name, const std::string& content, bool gzip = true) {
    const std::string path = dir_ + "/" + name;
    if (gzip) {
      gzFile f = gzopen(path.c_str(), "wb");
      EXPECT_NE(f, nullptr);
      if (!content.empty()) {
        EXPECT_EQ(gzwrite(f, content.data(), static_cast<unsigned>(content.size())),
                  static_cast<int>(content.size()));
      }
      gzclose(f);
    } else {
      std::ofstream(path, std::ios::binary) << content;
    }
    return path;
  }

  // Expects `status` to carry `code` and a message that starts with `path`
  // and contains every one of `words`.
  static void ExpectError(const absl::Status& status, absl::StatusCode code,
                          const std::string& path, const std::vector<std::string>& words) {
    EXPECT_EQ(status.code(), code) << status;
    const std::string message(status.message());
    EXPECT_EQ(message.rfind(path, 0), 0u) << message;
    for (const std::string& w : words) EXPECT_THAT(message, HasSubstr(w));
  }

  std::string dir_;
};

TEST_F(IdxFiles, ReadsGzipAndPlainFilesAndNormalisesLikeTorchvision) {
  for (bool gzip : {true, false}) {
    SCOPED_TRACE(gzip ? "gzip" : "plain");
    const std::string images = Write("img", Images(3, 2, 3), gzip);
    const std::string labels = Write("lbl", Labels({4, 0, 9}), gzip);
    auto d = LoadIdx(images, labels, 0.5f, 0.25f);
    ASSERT_TRUE(d.ok()) << d.status();
    EXPECT_EQ(d->size, 3);
    EXPECT_EQ(d->rows, 2);
    EXPECT_EQ(d->cols, 3);
    EXPECT_EQ(d->labels, (std::vector<int32_t>{4, 0, 9}));
    ASSERT_EQ(d->images.size(), 18u);
    for (size_t i = 0; i < 18; ++i) {
      const float byte = static_cast<float>((i * 37) % 256);
      EXPECT_EQ(d->images[i], (byte / 255.0f - 0.5f) / 0.25f) << i;
    }
  }
}

TEST_F(IdxFiles, TruncatedPixelsAreDataLossNamingTheFileAndTheCounts) {
  const std::string images = Write("train-images-idx3-ubyte.gz", Images(60, 28, 28, 1000));
  const std::string labels = Write("lbl", Labels(std::vector<uint8_t>(60, 1)));
  ExpectError(LoadIdx(images, labels, 0, 1).status(), absl::StatusCode::kDataLoss, images,
              {"truncated", "expected 47040 bytes of pixels, got 1000"});
}

TEST_F(IdxFiles, ACutGzipStreamIsTruncation) {
  const std::string full = Write("full.gz", Images(50, 28, 28));
  std::ifstream in(full, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const std::string cut = Write("cut.gz", bytes.substr(0, bytes.size() / 2), /*gzip=*/false);
  const std::string labels = Write("lbl", Labels(std::vector<uint8_t>(50, 1)));
  ExpectError(LoadIdx(cut, labels, 0, 1).status(), absl::StatusCode::kDataLoss, cut,
              {"truncated", "expected 39200 bytes of pixels"});
}

TEST_F(IdxFiles, AGzipFileIsInflatedOnceIntoTheCacheAndReadFromThereAfter) {
  const std::string cache = dir_ + "/cache";
  const std::string images = Write("img.gz", Images(50, 28, 28));
  const std::string labels = Write("lbl.gz", Labels(std::vector<uint8_t>(50, 3)));
  const std::string cached = DecompressedPath(images, cache);
  ASSERT_NE(cached, images);
  EXPECT_EQ(cached.rfind(cache + "/img-", 0), 0u) << cached;
  const auto written = std::filesystem::last_write_time(cached);
  EXPECT_EQ(DecompressedPath(images, cache), cached) << "a second call reuses it";
  EXPECT_EQ(std::filesystem::last_write_time(cached), written);
  auto a = LoadIdx(images, labels, 0.5f, 0.25f);
  auto b = LoadIdx(cached, DecompressedPath(labels, cache), 0.5f, 0.25f);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->images, b->images);
  EXPECT_EQ(a->labels, b->labels);
  // A rewritten file (new size / mtime / inode) gets a new cache entry.
  std::filesystem::remove(images);
  Write("img.gz", Images(40, 28, 28));
  EXPECT_NE(DecompressedPath(images, cache), cached);
  // Not gzip'd, or no cache: the path itself.
  const std::string plain = Write("plain", Images(2, 2, 2), /*gzip=*/false);
  EXPECT_EQ(DecompressedPath(plain, cache), plain);
  EXPECT_EQ(DecompressedPath(images, ""), images);
}

TEST_F(IdxFiles, ADamagedGzipFileIsNotCachedAndKeepsItsOwnName) {
  const std::string cache = dir_ + "/cache";
  const std::string full = Write("full.gz", Images(50, 28, 28));
  std::ifstream in(full, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const std::string cut = Write("cut.gz", bytes.substr(0, bytes.size() / 2), /*gzip=*/false);
  EXPECT_EQ(DecompressedPath(cut, cache), cut);
  // Nothing half-written is left in the cache.
  for (const auto& e : std::filesystem::directory_iterator(cache)) {
    EXPECT_EQ(e.path().filename().string().find("cut"), std::string::npos) << e.path();
  }
}

TEST_F(IdxFiles, TruncatedLabelsAndHeadersAreDataLoss) {
  const std::string images = Write("img", Images(4, 2, 2));
  std::string short_labels = Labels({1, 2, 3, 4});
  short_labels.resize(short_labels.size() - 2);
  const std::string labels = Write("lbl", short_labels);
  ExpectError(LoadIdx(images, labels, 0, 1).status(), absl::StatusCode::kDataLoss, labels,
              {"truncated", "expected 4 bytes of labels, got 2"});
  const std::string stub = Write("stub", Header(0x803, {4}));
  ExpectError(LoadIdx(stub, labels, 0, 1).status(), absl::StatusCode::kDataLoss, stub,
              {"truncated", "IDX header"});
}

TEST_F(IdxFiles, WrongMagicIsInvalidArgumentNamingTheFile) {
  const std::string labels = Write("lbl", Labels({1, 2}));
  // A label file passed as the images.
  ExpectError(LoadIdx(labels, labels, 0, 1).status(), absl::StatusCode::kInvalidArgument, labels,
              {"magic 0x00000801", "0x00000803"});
  // Float pixels (type 0x0d) are not supported.
  const std::string floats = Write("float", Header(0x00000d03, {2, 2, 2}) + std::string(32, 0));
  ExpectError(LoadIdx(floats, labels, 0, 1).status(), absl::StatusCode::kInvalidArgument, floats,
              {"data type 0x0d"});
  const std::string images = Write("img", Images(2, 2, 2));
  ExpectError(LoadIdx(images, images, 0, 1).status(), absl::StatusCode::kInvalidArgument, images,
              {"0x00000801"});
}

TEST_F(IdxFiles, AGarbageFileIsNotAnIdxFile) {
  const std::string garbage = Write("garbage", "<html>404 not found</html>\n", /*gzip=*/false);
  const std::string labels = Write("lbl", Labels({1}));
  ExpectError(LoadIdx(garbage, labels, 0, 1).status(), absl::StatusCode::kInvalidArgument, garbage,
              {"not an IDX file"});
}

TEST_F(IdxFiles, CorruptGzipDataIsDataLoss) {
  // A gzip header followed by bytes that are no deflate stream.
  std::string bytes = "\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\x03";
  bytes += std::string(64, '\xff');
  const std::string corrupt = Write("corrupt.gz", bytes, /*gzip=*/false);
  const std::string labels = Write("lbl", Labels({1}));
  ExpectError(LoadIdx(corrupt, labels, 0, 1).status(), absl::StatusCode::kDataLoss, corrupt,
              {"corrupt gzip data"});
}

TEST_F(IdxFiles, CountMismatchNamesBothFiles) {
  const std::string images = Write("img", Images(3, 2, 2));
  const std::string labels = Write("lbl", Labels({1, 2}));
  ExpectError(LoadIdx(images, labels, 0, 1).status(), absl::StatusCode::kInvalidArgument, images,
              {"3 images", labels, "2 labels"});
}

TEST_F(IdxFiles, AMissingFileIsNotFound) {
  const std::string labels = Write("lbl", Labels({1}));
  const std::string missing = dir_ + "/nope.gz";
  ExpectError(LoadIdx(missing, labels, 0, 1).status(), absl::StatusCode::kNotFound, missing, {});
  const std::string images = Write("img", Images(1, 2, 2));
  ExpectError(LoadIdx(images, missing, 0, 1).status(), absl::StatusCode::kNotFound, missing, {});
  auto status = LoadFashionMnist(dir_, true).status();
  ExpectError(status, absl::StatusCode::kNotFound, dir_ + "/train-images-idx3-ubyte.gz", {});
}

TEST_F(IdxFiles, ADirectoryIsRefused) {
  const std::string labels = Write("lbl", Labels({1}));
  const absl::Status s = LoadIdx(dir_, labels, 0, 1).status();
  EXPECT_FALSE(s.ok());
  EXPECT_EQ(std::string(s.message()).rfind(dir_, 0), 0u) << s;
}

TEST_F(IdxFiles, AbsurdDimensionsAreRefusedBeforeAllocating) {
  const std::string labels = Write("lbl", Labels({1}));
  const std::string huge_side = Write("side", Header(0x803, {1, 100000, 28}));
  ExpectError(LoadIdx(huge_side, labels, 0, 1).status(), absl::StatusCode::kInvalidArgument,
              huge_side, {"absurd image size 100000x28"});
  const std::string zero = Write("zero", Header(0x803, {1, 0, 28}));
  ExpectError(LoadIdx(zero, labels, 0, 1).status(), absl::StatusCode::kInvalidArgument, zero,
              {"absurd"});
  const std::string huge_count = Write("count", Header(0x803, {0xffffffffu, 4096, 4096}));
  ExpectError(LoadIdx(huge_count, labels, 0, 1).status(), absl::StatusCode::kInvalidArgument,
              huge_count, {"absurd size"});
  const std::string empty = Write("empty", Header(0x803, {0, 28, 28}));
  ExpectError(LoadIdx(empty, labels, 0, 1).status(), absl::StatusCode::kInvalidArgument, empty,
              {"no images"});
}

// A header may announce as many as kMaxPixels pixels; memory follows the
// bytes that are really there, so a short file fails as truncated without
// first allocating what its header claims (16 GiB of floats here).
TEST_F(IdxFiles, AHugeHeaderOverAFewBytesIsTruncationNotAnAllocation) {
  rusage before{};
  ASSERT_EQ(getrusage(RUSAGE_SELF, &before), 0);
  const std::string images = Write("img", Images(1u << 20, 64, 64, 10));
  const std::string few_labels = Write("few", Header(0x801, {1u << 20}) + "\x01\x02\x03");
  ExpectError(LoadIdx(images, few_labels, 0, 1).status(), absl::StatusCode::kDataLoss, few_labels,
              {"truncated", "expected 1048576 bytes of labels, got 3"});
  const std::string labels = Write("lbl", Labels(std::vector<uint8_t>(1u << 20, 1)));
  ExpectError(LoadIdx(images, labels, 0, 1).status(), absl::StatusCode::kDataLoss, images,
              {"truncated", "expected 4294967296 bytes of pixels, got 10"});
  rusage after{};
  ASSERT_EQ(getrusage(RUSAGE_SELF, &after), 0);
  EXPECT_LT(after.ru_maxrss - before.ru_maxrss, 256 * 1024) << "KiB of peak growth";
}

TEST_F(IdxFiles, ALabelOutOfRangeIsDataLossNamingItsIndex) {
  const std::string images = Write("img", Images(3, 2, 2));
  const std::string labels = Write("lbl", Labels({1, 10, 2}));
  ExpectError(LoadIdx(images, labels, 0, 1).status(), absl::StatusCode::kDataLoss, labels,
              {"label 10 at index 1", "[0, 10)"});
  EXPECT_TRUE(LoadIdx(images, labels, 0, 1, /*classes=*/11).ok());
}

TEST_F(IdxFiles, TrailingBytesAreDataLoss) {
  const std::string images = Write("img", Images(2, 2, 2) + "xyz");
  const std::string labels = Write("lbl", Labels({1, 2}));
  ExpectError(LoadIdx(images, labels, 0, 1).status(), absl::StatusCode::kDataLoss, images,
              {"3 unexpected bytes after the 8"});
}

TEST_F(IdxFiles, BadNormalisationIsRefused) {
  const std::string images = Write("img", Images(1, 2, 2));
  const std::string labels = Write("lbl", Labels({1}));
  EXPECT_EQ(LoadIdx(images, labels, 0, 0).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(LoadIdx(images, labels, NAN, 1).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(IdxFiles, GatherBatchCopiesTheChosenSamplesInOrder) {
  const std::string images = Write("img", Images(4, 2, 3));
  const std::string labels = Write("lbl", Labels({5, 6, 7, 8}));
  auto d = LoadIdx(images, labels, 0, 1);
  ASSERT_TRUE(d.ok()) << d.status();
  const std::vector<int64_t> indices = {3, 1, 0, 2};
  Tensor batch;
  std::vector<int32_t> batch_labels;
  GatherBatch(*d, indices, 1, 2, &batch, &batch_labels);
  EXPECT_EQ(batch.shape(), (std::vector<int64_t>{2, 1, 2, 3}));
  EXPECT_EQ(batch_labels, (std::vector<int32_t>{6, 5}));
  for (int64_t i = 0; i < 6; ++i) {
    EXPECT_EQ(batch[i], d->images[static_cast<size_t>(6 + i)]);  // sample 1
    EXPECT_EQ(batch[6 + i], d->images[static_cast<size_t>(i)]);  // sample 0
  }
  // A smaller last batch reuses the storage.
  GatherBatch(*d, indices, 3, 1, &batch, &batch_labels);
  EXPECT_EQ(batch.shape(), (std::vector<int64_t>{1, 1, 2, 3}));
  EXPECT_EQ(batch_labels, (std::vector<int32_t>{7}));  // sample 2
  EXPECT_EQ(batch[0], d->images[12]);
}

// ---------------------------------------------------------------------------
// DistributedSampler.

std::vector<std::vector<int64_t>> AllRanks(int64_t n, int world, bool shuffle, uint64_t seed,
                                           bool drop_last, int64_t epoch) {
  std::vector<std::vector<int64_t>> out;
  for (int r = 0; r < world; ++r) {
    // A separate sampler per rank, as separate processes would have.
    out.push_back(DistributedSampler(n, world, r, shuffle, seed, drop_last).EpochIndices(epoch));
  }
  return out;
}

// Interleaves the ranks' slices back into the padded epoch order.
std::vector<int64_t> Interleave(const std::vector<std::vector<int64_t>>& ranks) {
  std::vector<int64_t> order;
  for (size_t i = 0; i < ranks[0].size(); ++i) {
    for (const auto& r : ranks) order.push_back(r[i]);
  }
  return order;
}

TEST(DistributedSampler, UnshuffledSlicesAreTorchsStridedSlicesWithWrapAroundPadding) {
  // torch: indices = list(range(10)) + [0, 1]; rank r takes indices[r:12:3].
  auto ranks = AllRanks(10, 3, false, 0, false, 0);
  EXPECT_EQ(ranks[0], (std::vector<int64_t>{0, 3, 6, 9}));
  EXPECT_EQ(ranks[1], (std::vector<int64_t>{1, 4, 7, 0}));
  EXPECT_EQ(ranks[2], (std::vector<int64_t>{2, 5, 8, 1}));
  EXPECT_EQ(DistributedSampler(10, 3, 0, false, 0, false).num_samples(), 4);
  EXPECT_EQ(DistributedSampler(10, 3, 0, false, 0, false).total_size(), 12);
}

TEST(DistributedSampler, DropLastTruncatesToAMultipleOfTheWorld) {
  auto ranks = AllRanks(10, 3, false, 0, true, 0);
  EXPECT_EQ(ranks[0], (std::vector<int64_t>{0, 3, 6}));
  EXPECT_EQ(ranks[1], (std::vector<int64_t>{1, 4, 7}));
  EXPECT_EQ(ranks[2], (std::vector<int64_t>{2, 5, 8}));
  EXPECT_EQ(DistributedSampler(10, 3, 2, false, 0, true).num_samples(), 3);
  // Fewer samples than ranks: nothing for anyone (torch: ceil((2 - 5) / 5) = 0).
  EXPECT_EQ(DistributedSampler(2, 5, 0, true, 0, true).num_samples(), 0);
  EXPECT_TRUE(DistributedSampler(2, 5, 4, true, 0, true).EpochIndices(0).empty());
}

TEST(DistributedSampler, PaddingLongerThanTheDatasetRepeatsItSeveralTimes) {
  // torch: [0, 1] padded to 5 is [0, 1, 0, 1, 0].
  auto ranks = AllRanks(2, 5, false, 0, false, 0);
  EXPECT_EQ(Interleave(ranks), (std::vector<int64_t>{0, 1, 0, 1, 0}));
}

TEST(DistributedSampler, AnEmptyDatasetGivesEmptyEpochs) {
  DistributedSampler s(0, 4, 1, true, 7, false);
  EXPECT_EQ(s.num_samples(), 0);
  EXPECT_TRUE(s.EpochIndices(3).empty());
}

TEST(DistributedSampler, ShuffledRanksShareOnePermutationAndCoverThePaddedEpoch) {
  for (int world : {1, 2, 3, 4, 8}) {
    for (int64_t n : {1, 7, 64, 1000, 1001}) {
      SCOPED_TRACE(::testing::Message() << "world " << world << " n " << n);
      auto ranks = AllRanks(n, world, true, 1234, false, 5);
      const int64_t per_rank = (n + world - 1) / world;
      for (const auto& r : ranks) ASSERT_EQ(static_cast<int64_t>(r.size()), per_rank);
      const std::vector<int64_t> order = Interleave(ranks);
      // The first n positions are the epoch's permutation, the same one on
      // every rank; the rest repeats its start.
      const std::vector<int64_t> perm = Permutation(n, 1234 + 5);
      for (int64_t i = 0; i < static_cast<int64_t>(order.size()); ++i) {
        ASSERT_EQ(order[static_cast<size_t>(i)], perm[static_cast<size_t>(i % n)]) << i;
      }
      std::vector<int64_t> sorted(perm);
      std::sort(sorted.begin(), sorted.end());
      std::vector<int64_t> iota(static_cast<size_t>(n));
      std::iota(iota.begin(), iota.end(), int64_t{0});
      ASSERT_EQ(sorted, iota);
      if (n % world == 0) {
        // Without padding the slices are disjoint.
        std::set<int64_t> seen;
        for (const auto& r : ranks) {
          for (int64_t idx : r) EXPECT_TRUE(seen.insert(idx).second) << idx;
        }
      }
    }
  }
}

TEST(DistributedSampler, EpochsDifferSeedsDifferAndEverythingIsDeterministic) {
  const DistributedSampler a(1000, 2, 1, true, 42, false);
  const DistributedSampler b(1000, 2, 1, true, 42, false);
  const DistributedSampler other_seed(1000, 2, 1, true, 43, false);
  EXPECT_EQ(a.EpochIndices(0), b.EpochIndices(0));
  EXPECT_EQ(a.EpochIndices(3), a.EpochIndices(3));
  EXPECT_NE(a.EpochIndices(0), a.EpochIndices(1));
  EXPECT_NE(a.EpochIndices(0), other_seed.EpochIndices(0));
  // seed + epoch, as torch: seed 42 epoch 1 is seed 43 epoch 0.
  EXPECT_EQ(a.EpochIndices(1), other_seed.EpochIndices(0));
  // A shuffled epoch is not the identity.
  std::vector<int64_t> mine = a.EpochIndices(0);
  std::sort(mine.begin(), mine.end());
  EXPECT_NE(a.EpochIndices(0), mine);
}

TEST(Permutation, IsAFixedSequenceForASeed) {
  // Pinned so that a change of algorithm (which would change every run's
  // data order and so what a resumed run sees) does not go unnoticed.
  EXPECT_EQ(Permutation(8, 0), (std::vector<int64_t>{4, 5, 2, 0, 7, 1, 3, 6}));
  EXPECT_EQ(Permutation(10, 42), (std::vector<int64_t>{1, 7, 9, 0, 3, 8, 4, 2, 5, 6}));
  EXPECT_TRUE(Permutation(0, 1).empty());
  EXPECT_EQ(Permutation(1, 1), (std::vector<int64_t>{0}));
}

TEST(Permutation, DrawsEveryOrderOfThreeAboutEquallyOften) {
  std::map<std::vector<int64_t>, int> counts;
  const int trials = 6000;
  for (int seed = 0; seed < trials; ++seed) ++counts[Permutation(3, static_cast<uint64_t>(seed))];
  ASSERT_EQ(counts.size(), 6u);
  // Expected 1000 each; 5 standard deviations (~ 5 * 29) either side.
  for (const auto& [order, n] : counts) {
    EXPECT_GT(n, 850);
    EXPECT_LT(n, 1150);
  }
}

}  // namespace
}  // namespace aidn::engine
