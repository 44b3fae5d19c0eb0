#include "worker/engine/text_data.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <system_error>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/log.h"

namespace aidn::engine {
namespace {

absl::Status ReadFileInto(const std::string& path, std::string* out) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    const int err = errno;
    const std::string why = std::strerror(err);
    if (err == EACCES) return absl::PermissionDeniedError(absl::StrCat(path, ": ", why));
    return absl::NotFoundError(absl::StrCat(path, ": ", why));
  }
  out->assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  if (in.bad()) return absl::DataLossError(absl::StrCat(path, ": read failed"));
  return absl::OkStatus();
}

// splitmix64: the epoch's shift from the seed, the same on every rank.
uint64_t Mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

}  // namespace

absl::StatusOr<std::string> LoadText(const std::vector<std::string>& paths) {
  if (paths.empty()) return absl::InvalidArgumentError("text dataset: no files named");
  std::string text;
  for (const std::string& path : paths) {
    std::error_code ec;
    const std::filesystem::file_status status = std::filesystem::status(path, ec);
    if (ec) return absl::NotFoundError(absl::StrCat(path, ": ", ec.message()));
    if (std::filesystem::is_directory(status)) {
      std::vector<std::string> files;
      for (const auto& entry : std::filesystem::directory_iterator(path, ec)) {
        const std::string name = entry.path().filename().string();
        if (name.starts_with(".") || entry.is_symlink() || !entry.is_regular_file()) continue;
        files.push_back(entry.path().string());
      }
      if (ec) return absl::PermissionDeniedError(absl::StrCat(path, ": ", ec.message()));
      std::sort(files.begin(), files.end());
      for (const std::string& file : files) {
        std::string bytes;
        if (absl::Status s = ReadFileInto(file, &bytes); !s.ok()) return s;
        if (bytes.find('\0') != std::string::npos) continue;  // binary, not text
        text += bytes;
      }
      continue;
    }
    std::string bytes;
    if (absl::Status s = ReadFileInto(path, &bytes); !s.ok()) return s;
    if (bytes.find('\0') != std::string::npos) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": holds NUL bytes: not a text file"));
    }
    text += bytes;
  }
  if (text.empty()) return absl::InvalidArgumentError("text dataset: the files hold no text");
  return text;
}

TextSplit SplitText(std::string text, double val_fraction) {
  AIDN_CHECK(val_fraction >= 0.0 && val_fraction < 1.0) << "val_fraction " << val_fraction;
  const auto val_bytes = static_cast<size_t>(static_cast<double>(text.size()) * val_fraction);
  TextSplit split;
  split.val = text.substr(text.size() - val_bytes);
  text.resize(text.size() - val_bytes);
  split.train = std::move(text);
  return split;
}

int64_t TextWindowCount(int64_t tokens, int block_size) {
  AIDN_CHECK(block_size >= 1) << "block_size " << block_size;
  if (tokens < 2 * int64_t{block_size}) return 0;
  return (tokens - block_size) / block_size;
}

int64_t TextWindowShift(uint64_t seed, int64_t epoch, int block_size) {
  AIDN_CHECK(block_size >= 1) << "block_size " << block_size;
  return static_cast<int64_t>(Mix(seed ^ Mix(static_cast<uint64_t>(epoch))) %
                              static_cast<uint64_t>(block_size));
}

void GatherTextWindows(const std::string& text, int64_t shift, int block_size,
                       const std::vector<int64_t>& indices, size_t begin, size_t count, int32_t* x,
                       int32_t* y) {
  const int64_t windows = TextWindowCount(static_cast<int64_t>(text.size()), block_size);
  AIDN_CHECK(begin + count <= indices.size()) << "windows " << begin << "+" << count;
  AIDN_CHECK(shift >= 0 && shift < block_size) << "shift " << shift;
  const auto* bytes = reinterpret_cast<const unsigned char*>(text.data());
  for (size_t r = 0; r < count; ++r) {
    const int64_t w = indices[begin + r];
    AIDN_CHECK(w >= 0 && w < windows) << "window " << w << " of " << windows;
    const unsigned char* src = bytes + shift + w * block_size;
    int32_t* xr = x + static_cast<int64_t>(r) * block_size;
    int32_t* yr = y + static_cast<int64_t>(r) * block_size;
    for (int t = 0; t < block_size; ++t) {
      xr[t] = src[t];
      yr[t] = src[t + 1];
    }
  }
}

}  // namespace aidn::engine
