#include "worker/engine/data.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <array>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <numeric>
#include <random>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/log.h"
#include "common/status.h"

namespace aidn::engine {
namespace {

constexpr uint32_t kIdxImagesMagic = 0x00000803;  // unsigned byte, 3 dims
constexpr uint32_t kIdxLabelsMagic = 0x00000801;  // unsigned byte, 1 dim
// Far above any IDX dataset in use; these catch headers that are garbage.
constexpr uint32_t kMaxSide = 4096;
constexpr uint64_t kMaxPixels = uint64_t{1} << 32;
// Big reads: the train images are 47 MB uncompressed.
constexpr size_t kChunk = size_t{1} << 20;

// A zlib reader over one file that turns every failure into a status naming
// the file. zlib reads plain files transparently, so an uncompressed IDX
// file works too.
class GzReader {
 public:
  static absl::StatusOr<GzReader> Open(const std::string& path) {
    // open(2) ourselves: gzopen does not reliably leave errno set, and a
    // directory would otherwise only fail at the first read.
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return PosixError(path, errno);
    struct stat st;
    if (::fstat(fd, &st) != 0) {
      const int err = errno;
      ::close(fd);
      return PosixError(path, err);
    }
    if (S_ISDIR(st.st_mode)) {
      ::close(fd);
      return PosixError(path, EISDIR);
    }
    gzFile file = gzdopen(fd, "rb");
    if (file == nullptr) {
      ::close(fd);
      return absl::ResourceExhaustedError(absl::StrCat(path, ": zlib could not open the file"));
    }
    gzbuffer(file, 1 << 18);
    return GzReader(path, file, static_cast<uint64_t>(st.st_size));
  }

  GzReader(GzReader&& other) noexcept
      : path_(std::move(other.path_)),
        file_(std::exchange(other.file_, nullptr)),
        file_bytes_(other.file_bytes_) {}
  GzReader& operator=(GzReader&&) = delete;
  GzReader(const GzReader&) = delete;
  ~GzReader() {
    if (file_ != nullptr) gzclose(file_);
  }

  const std::string& path() const { return path_; }
  // After a first read: whether the file is plain (not gzip), so that its
  // size is its content's.
  bool Plain() const { return gzdirect(file_) == 1; }
  uint64_t file_bytes() const { return file_bytes_; }

  // Reads up to `n` bytes, stopping early only at the end of the data.
  // Returns how many were read; DATA_LOSS for corrupt compressed data.
  absl::StatusOr<size_t> Read(void* buf, size_t n) {
    size_t done = 0;
    char* out = static_cast<char*>(buf);
    while (done < n) {
      const unsigned want = static_cast<unsigned>(std::min(n - done, kChunk));
      const int got = gzread(file_, out + done, want);
      if (got < 0) return Error();
      if (got == 0) {
        // A gzip stream cut short reads as a short read with Z_BUF_ERROR;
        // the caller reports it as truncation.
        int err = Z_OK;
        gzerror(file_, &err);
        if (err != Z_OK && err != Z_BUF_ERROR) return Error();
        break;
      }
      done += static_cast<size_t>(got);
    }
    return done;
  }

  // Whether the compressed stream was cut short (set after a short Read).
  bool GzipTruncated() const {
    int err = Z_OK;
    gzerror(file_, &err);
    return err == Z_BUF_ERROR;
  }

 private:
  GzReader(std::string path, gzFile file, uint64_t file_bytes)
      : path_(std::move(path)), file_(file), file_bytes_(file_bytes) {}

  absl::Status Error() const {
    int err = Z_OK;
    const char* message = gzerror(file_, &err);
    if (err == Z_ERRNO) return PosixError(path_, errno);
    return absl::DataLossError(
        absl::StrCat(path_, ": corrupt gzip data: ", message != nullptr ? message : "unknown"));
  }

  std::string path_;
  gzFile file_;
  uint64_t file_bytes_ = 0;
};

uint32_t BigEndian32(const unsigned char* p) {
  return (uint32_t{p[0]} << 24) | (uint32_t{p[1]} << 16) | (uint32_t{p[2]} << 8) | uint32_t{p[3]};
}

absl::Status Truncated(const GzReader& reader, absl::string_view what, uint64_t expected,
                       uint64_t got) {
  return absl::DataLossError(
      absl::StrCat(reader.path(), ": truncated: expected ", expected, " bytes of ", what, ", got ",
                   got, reader.GzipTruncated() ? " (gzip stream ends early)" : ""));
}

// Reads and checks the header: the magic and `dims.size()` big-endian sizes.
absl::Status ReadHeader(GzReader& reader, uint32_t magic, absl::string_view kind,
                        std::vector<uint32_t>* dims) {
  const size_t want_dims = magic & 0xff;
  std::array<unsigned char, 4 + 4 * 3> header{};
  const size_t header_bytes = 4 + 4 * want_dims;
  AIDN_ASSIGN_OR_RETURN(size_t got, reader.Read(header.data(), 4));
  if (got < 4) return Truncated(reader, "IDX header", header_bytes, got);
  const uint32_t found = BigEndian32(header.data());
  if (found != magic) {
    if (header[0] == 0 && header[1] == 0) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s: wrong IDX magic 0x%08x (data type 0x%02x, %d dimensions); an IDX %s file has "
          "0x%08x (unsigned bytes, %d dimensions)",
          reader.path(), found, header[2], header[3], std::string(kind), magic, want_dims));
    }
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: not an IDX file: magic 0x%08x, want 0x%08x (IDX %s)", reader.path(),
                        found, magic, std::string(kind)));
  }
  AIDN_ASSIGN_OR_RETURN(got, reader.Read(header.data() + 4, 4 * want_dims));
  if (got < 4 * want_dims) return Truncated(reader, "IDX header", header_bytes, 4 + got);
  dims->clear();
  for (size_t i = 0; i < want_dims; ++i) dims->push_back(BigEndian32(header.data() + 4 + 4 * i));
  return absl::OkStatus();
}

// After the expected payload the file must end.
absl::Status ExpectEnd(GzReader& reader, uint64_t payload_bytes) {
  char extra[4096];
  AIDN_ASSIGN_OR_RETURN(size_t got, reader.Read(extra, sizeof(extra)));
  if (got == 0) return absl::OkStatus();
  return absl::DataLossError(
      absl::StrCat(reader.path(), ": ", got == sizeof(extra) ? "at least " : "", got,
                   " unexpected bytes after the ", payload_bytes, " bytes its header announces"));
}

}  // namespace

absl::StatusOr<Dataset> LoadIdx(const std::string& images_path, const std::string& labels_path,
                                float mean, float stddev, int classes) {
  if (!std::isfinite(mean) || !std::isfinite(stddev) || !(stddev > 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat(images_path, ": normalisation needs a finite mean and stddev > 0, got mean ",
                     mean, " stddev ", stddev));
  }
  if (classes < 1 || classes > 256) {
    return absl::InvalidArgumentError(
        absl::StrCat(labels_path, ": class count ", classes, " is not in [1, 256]"));
  }

  AIDN_ASSIGN_OR_RETURN(GzReader images, GzReader::Open(images_path));
  AIDN_ASSIGN_OR_RETURN(GzReader labels, GzReader::Open(labels_path));
  std::vector<uint32_t> image_dims;
  std::vector<uint32_t> label_dims;
  AIDN_RETURN_IF_ERROR(ReadHeader(images, kIdxImagesMagic, "image", &image_dims));
  AIDN_RETURN_IF_ERROR(ReadHeader(labels, kIdxLabelsMagic, "label", &label_dims));

  const uint32_t count = image_dims[0];
  const uint32_t rows = image_dims[1];
  const uint32_t cols = image_dims[2];
  if (rows == 0 || cols == 0 || rows > kMaxSide || cols > kMaxSide) {
    return absl::InvalidArgumentError(absl::StrCat(images_path, ": absurd image size ", rows, "x",
                                                   cols, " (each side must be in [1, ", kMaxSide,
                                                   "])"));
  }
  if (count == 0) {
    return absl::InvalidArgumentError(absl::StrCat(images_path, ": holds no images"));
  }
  const uint64_t pixels = uint64_t{count} * rows * cols;
  if (pixels > kMaxPixels) {
    return absl::InvalidArgumentError(absl::StrCat(images_path, ": absurd size: ", count,
                                                   " images of ", rows, "x", cols, " is over ",
                                                   kMaxPixels, " pixels"));
  }
  if (label_dims[0] != count) {
    return absl::InvalidArgumentError(absl::StrCat(images_path, ": ", count, " images but ",
                                                   labels_path, " holds ", label_dims[0],
                                                   " labels"));
  }

  Dataset data;
  data.size = count;
  data.rows = static_cast<int>(rows);
  data.cols = static_cast<int>(cols);
  data.classes = classes;

  // Memory follows the bytes that arrive, never the header's claim: a
  // header announcing 2^32 pixels over a few bytes of data fails as
  // truncated without allocating for them.
  std::vector<unsigned char> raw(kChunk);

  // Labels first: small, and a bad one fails before the big read.
  while (data.labels.size() < count) {
    const size_t done = data.labels.size();
    const size_t want = std::min<size_t>(count - done, kChunk);
    AIDN_ASSIGN_OR_RETURN(size_t n, labels.Read(raw.data(), want));
    for (size_t i = 0; i < n; ++i) {
      if (raw[i] >= classes) {
        return absl::DataLossError(absl::StrCat(labels_path, ": label ", raw[i], " at index ",
                                                done + i, " is out of range [0, ", classes, ")"));
      }
    }
    data.labels.insert(data.labels.end(), raw.begin(), raw.begin() + n);
    if (n < want) return Truncated(labels, "labels", count, done + n);
  }
  AIDN_RETURN_IF_ERROR(ExpectEnd(labels, count));

  // Pixels: streamed in chunks through a lookup table, computed as
  // torchvision's ToTensor (x / 255 in float) then Normalize ((x - m) / s).
  // Capacity doubles up to the announced count, so a whole file ends in
  // exactly `pixels` floats; a plain file whose size holds them all (the
  // decompressed cache's) gets them at once.
  if (images.Plain() && images.file_bytes() >= 16 + pixels) {
    data.images.reserve(static_cast<size_t>(pixels));
  }
  std::array<float, 256> table;
  for (int b = 0; b < 256; ++b) table[b] = (static_cast<float>(b) / 255.0f - mean) / stddev;
  uint64_t done = 0;
  while (done < pixels) {
    const size_t want = static_cast<size_t>(std::min<uint64_t>(pixels - done, kChunk));
    AIDN_ASSIGN_OR_RETURN(size_t n, images.Read(raw.data(), want));
    if (done + n > data.images.capacity()) {
      data.images.reserve(static_cast<size_t>(
          std::min<uint64_t>(pixels, std::max<uint64_t>(2 * data.images.capacity(), done + n))));
    }
    data.images.resize(done + n);
    float* out = data.images.data() + done;
    for (size_t i = 0; i < n; ++i) out[i] = table[raw[i]];
    done += n;
    if (n < want) return Truncated(images, "pixels", pixels, done);
  }
  AIDN_RETURN_IF_ERROR(ExpectEnd(images, pixels));
  return data;
}

std::string DecompressedPath(const std::string& path, const std::string& cache_dir) {
  if (cache_dir.empty() || !absl::EndsWith(path, ".gz")) return path;
  struct stat st;
  if (::stat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) return path;
  const std::string base = std::filesystem::path(path).filename().string();
  const std::string cached = absl::StrCat(
      cache_dir, "/", base.substr(0, base.size() - 3), "-", static_cast<int64_t>(st.st_size), "-",
      static_cast<int64_t>(st.st_mtim.tv_sec) * 1'000'000'000 + st.st_mtim.tv_nsec, "-",
      static_cast<uint64_t>(st.st_ino), ".raw");
  if (::access(cached.c_str(), R_OK) == 0) return cached;
  std::error_code error;
  std::filesystem::create_directories(cache_dir, error);
  if (error) return path;
  const std::string tmp = absl::StrCat(cached, ".tmp-", static_cast<int64_t>(::getpid()));
  const int in = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (in < 0) return path;
  gzFile gz = gzdopen(in, "rb");
  if (gz == nullptr) {
    ::close(in);
    return path;
  }
  gzbuffer(gz, 1 << 18);
  FILE* out = std::fopen(tmp.c_str(), "wb");
  bool ok = out != nullptr;
  std::vector<char> buffer(1 << 20);
  while (ok) {
    const int n = gzread(gz, buffer.data(), static_cast<unsigned>(buffer.size()));
    if (n < 0) ok = false;
    if (n <= 0) break;
    ok = std::fwrite(buffer.data(), 1, static_cast<size_t>(n), out) == static_cast<size_t>(n);
  }
  int err = Z_OK;
  gzerror(gz, &err);
  // A stream cut short reads as a short read with Z_BUF_ERROR.
  ok = ok && (err == Z_OK || err == Z_STREAM_END);
  gzclose(gz);
  if (out != nullptr && std::fclose(out) != 0) ok = false;
  if (!ok || std::rename(tmp.c_str(), cached.c_str()) != 0) {
    ::unlink(tmp.c_str());
    return path;
  }
  return cached;
}

absl::StatusOr<Dataset> LoadFashionMnist(const std::string& dir, bool train,
                                         const std::string& cache_dir) {
  const std::string prefix = absl::StrCat(dir, "/", train ? "train" : "t10k");
  const std::string images = prefix + "-images-idx3-ubyte.gz";
  const std::string labels = prefix + "-labels-idx1-ubyte.gz";
  if (!cache_dir.empty()) {
    absl::StatusOr<Dataset> cached =
        LoadIdx(DecompressedPath(images, cache_dir), DecompressedPath(labels, cache_dir),
                kFashionMnistMean, kFashionMnistStd, /*classes=*/10);
    if (cached.ok()) return cached;
    // Errors name the files the user gave: read those.
  }
  return LoadIdx(images, labels, kFashionMnistMean, kFashionMnistStd, /*classes=*/10);
}

std::vector<int64_t> Permutation(int64_t n, uint64_t seed) {
  std::vector<int64_t> order(static_cast<size_t>(std::max<int64_t>(n, 0)));
  std::iota(order.begin(), order.end(), int64_t{0});
  std::mt19937_64 engine(seed);
  // Unbiased draw in [0, range): reject the low values that would make the
  // modulo uneven. std::uniform_int_distribution is avoided because its
  // algorithm differs between standard libraries.
  auto bounded = [&engine](uint64_t range) {
    const uint64_t threshold = (0 - range) % range;
    uint64_t x;
    do {
      x = engine();
    } while (x < threshold);
    return x % range;
  };
  for (size_t i = order.size(); i > 1; --i) {
    const size_t j = static_cast<size_t>(bounded(i));
    std::swap(order[i - 1], order[j]);
  }
  return order;
}

DistributedSampler::DistributedSampler(int64_t dataset_size, int world_size, int rank, bool shuffle,
                                       uint64_t seed, bool drop_last)
    : dataset_size_(dataset_size),
      world_size_(world_size),
      rank_(rank),
      shuffle_(shuffle),
      seed_(seed),
      drop_last_(drop_last) {
  AIDN_CHECK(dataset_size >= 0) << "dataset_size " << dataset_size;
  AIDN_CHECK(world_size >= 1) << "world_size " << world_size;
  AIDN_CHECK(rank >= 0 && rank < world_size) << "rank " << rank << " of " << world_size;
  // torch: drop_last ? ceil((n - w) / w) (= floor(n / w)) : ceil(n / w).
  num_samples_ =
      drop_last ? dataset_size / world_size : (dataset_size + world_size - 1) / world_size;
}

std::vector<int64_t> DistributedSampler::EpochIndices(int64_t epoch) const {
  std::vector<int64_t> order;
  if (shuffle_) {
    order = Permutation(dataset_size_, seed_ + static_cast<uint64_t>(epoch));
  } else {
    order.resize(static_cast<size_t>(dataset_size_));
    std::iota(order.begin(), order.end(), int64_t{0});
  }
  const int64_t total = total_size();
  if (drop_last_) {
    order.resize(static_cast<size_t>(total));
  } else {
    // torch repeats the list from its start (several times when the
    // padding is longer than the dataset).
    const int64_t n = dataset_size_;
    order.reserve(static_cast<size_t>(total));
    for (int64_t k = 0; n > 0 && static_cast<int64_t>(order.size()) < total; ++k) {
      order.push_back(order[static_cast<size_t>(k % n)]);
    }
  }
  std::vector<int64_t> mine;
  mine.reserve(static_cast<size_t>(num_samples_));
  for (int64_t i = rank_; i < total; i += world_size_)
    mine.push_back(order[static_cast<size_t>(i)]);
  return mine;
}

void GatherBatch(const Dataset& dataset, const std::vector<int64_t>& indices, size_t begin,
                 size_t count, Tensor* images, std::vector<int32_t>* labels) {
  AIDN_CHECK(begin <= indices.size() && count <= indices.size() - begin)
      << "batch [" << begin << ", +" << count << ") of " << indices.size() << " indices";
  const size_t pixels = static_cast<size_t>(dataset.rows) * static_cast<size_t>(dataset.cols);
  images->Resize({static_cast<int64_t>(count), 1, dataset.rows, dataset.cols});
  labels->resize(count);
  float* out = images->data();
  for (size_t i = 0; i < count; ++i) {
    const int64_t index = indices[begin + i];
    AIDN_CHECK(index >= 0 && index < dataset.size) << "index " << index << " of " << dataset.size;
    std::memcpy(out + i * pixels, dataset.images.data() + static_cast<size_t>(index) * pixels,
                pixels * sizeof(float));
    (*labels)[i] = dataset.labels[static_cast<size_t>(index)];
  }
}

}  // namespace aidn::engine
