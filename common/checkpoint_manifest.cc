#include "common/checkpoint_manifest.h"

#include <sys/stat.h>

#include <cerrno>
#include <fstream>
#include <set>
#include <sstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "common/crc32c.h"
#include "common/status.h"

namespace aidn {
namespace {

constexpr char kHeader[] = "aidn-checkpoint 1";
constexpr size_t kMaxManifestBytes = 1 << 20;

absl::Status Bad(int line, absl::string_view what) {
  return absl::DataLossError(absl::StrCat(kManifestName, " line ", line, ": ", what));
}

bool PlainName(absl::string_view name) {
  if (name.empty() || name.size() > 255 || name[0] == '.') return false;
  for (char c : name) {
    const auto u = static_cast<unsigned char>(c);
    if (c == '/' || u <= 0x20 || u == 0x7F) return false;
  }
  return true;
}

}  // namespace

std::string FormatManifest(const Manifest& manifest) {
  std::string text = absl::StrCat(kHeader, "\nstep ", manifest.step, "\n");
  for (const ManifestEntry& f : manifest.files) {
    absl::StrAppendFormat(&text, "file %s %d %08x\n", f.name, f.bytes, f.crc32c);
  }
  return text;
}

absl::StatusOr<Manifest> ParseManifest(absl::string_view text) {
  if (text.empty() || text.back() != '\n') {
    return absl::DataLossError(absl::StrCat(kManifestName, ": truncated (no final newline)"));
  }
  text.remove_suffix(1);
  std::vector<absl::string_view> lines = absl::StrSplit(text, '\n');
  if (lines[0] != kHeader) {
    return Bad(1, absl::StrCat("expected \"", kHeader, "\""));
  }
  Manifest manifest;
  bool have_step = false;
  std::set<std::string> names;
  for (size_t i = 1; i < lines.size(); ++i) {
    const int n = static_cast<int>(i) + 1;
    std::vector<absl::string_view> f = absl::StrSplit(lines[i], ' ');
    if (f[0] == "step" && f.size() == 2 && !have_step) {
      if (!absl::SimpleAtoi(f[1], &manifest.step) || manifest.step < 0) {
        return Bad(n, "bad step");
      }
      have_step = true;
    } else if (f[0] == "file" && f.size() == 4 && have_step) {
      ManifestEntry entry;
      entry.name = std::string(f[1]);
      if (!PlainName(entry.name)) return Bad(n, "bad file name");
      if (!names.insert(entry.name).second) return Bad(n, "file named twice");
      if (!absl::SimpleAtoi(f[2], &entry.bytes) || entry.bytes < 0) return Bad(n, "bad size");
      if (f[3].size() != 8 || !absl::SimpleHexAtoi(f[3], &entry.crc32c)) {
        return Bad(n, "bad checksum");
      }
      manifest.files.push_back(std::move(entry));
    } else {
      return Bad(n, "unexpected line");
    }
  }
  if (!have_step) return absl::DataLossError(absl::StrCat(kManifestName, ": no step line"));
  if (manifest.files.empty()) {
    return absl::DataLossError(absl::StrCat(kManifestName, ": names no files"));
  }
  return manifest;
}

absl::StatusOr<Manifest> ReadManifest(const std::string& dir) {
  struct stat st;
  if (::stat(dir.c_str(), &st) != 0) return PosixError(dir, errno);
  if (!S_ISDIR(st.st_mode)) return absl::DataLossError(absl::StrCat(dir, ": not a directory"));
  const std::string path = absl::StrCat(dir, "/", kManifestName);
  std::ifstream in(path, std::ios::binary);
  if (!in) return PosixError(absl::StrCat(kManifestName, " in ", dir), errno);
  std::string text(kMaxManifestBytes + 1, '\0');
  in.read(text.data(), static_cast<std::streamsize>(text.size()));
  text.resize(static_cast<size_t>(in.gcount()));
  if (text.size() > kMaxManifestBytes) {
    return absl::DataLossError(absl::StrCat(kManifestName, ": over 1 MiB"));
  }
  return ParseManifest(text);
}

absl::Status VerifyManifestFile(const std::string& dir, const ManifestEntry& f) {
  absl::StatusOr<FileChecksum> sum = ChecksumFile(absl::StrCat(dir, "/", f.name));
  if (!sum.ok()) {
    if (absl::IsNotFound(sum.status())) {
      return absl::DataLossError(absl::StrCat(f.name, ": missing"));
    }
    return absl::DataLossError(absl::StrCat(f.name, ": ", sum.status().message()));
  }
  if (sum->bytes != f.bytes) {
    return absl::DataLossError(
        absl::StrCat(f.name, ": ", sum->bytes, " bytes, the manifest says ", f.bytes));
  }
  if (sum->crc32c != f.crc32c) {
    return absl::DataLossError(
        absl::StrFormat("%s: CRC-32C %08x, the manifest says %08x", f.name, sum->crc32c, f.crc32c));
  }
  return absl::OkStatus();
}

absl::StatusOr<Manifest> VerifyCheckpointDir(const std::string& dir) {
  AIDN_ASSIGN_OR_RETURN(Manifest manifest, ReadManifest(dir));
  for (const ManifestEntry& f : manifest.files) AIDN_RETURN_IF_ERROR(VerifyManifestFile(dir, f));
  return manifest;
}

}  // namespace aidn
