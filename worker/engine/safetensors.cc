#include "worker/engine/safetensors.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "common/file.h"
#include "common/status.h"
#include "nlohmann/json.hpp"

namespace aidn::engine {
namespace {

// The format stores little-endian data and aidn copies it byte for byte.
static_assert(std::endian::native == std::endian::little, "safetensors I/O assumes little-endian");

constexpr absl::string_view kMetadataKey = "__metadata__";
// The reference implementation refuses headers above 100 MB; so does aidn,
// which also keeps a corrupt length from allocating gigabytes.
constexpr uint64_t kMaxHeaderBytes = uint64_t{100} << 20;
constexpr int kMaxJsonDepth = 64;

// nlohmann's ordered_json keeps the header's keys in file order.
using Json = nlohmann::ordered_json;

// nlohmann's parser accepts more than a safetensors header may hold (true,
// false, null, fractions, duplicate keys, any depth). This first, SAX pass
// over the text refuses those, and turns nlohmann's syntax errors into a
// message without its exception prefix, so the DOM pass after it cannot
// fail on anything but memory.
class HeaderChecker final : public nlohmann::json_sax<Json> {
 public:
  // Empty while the text is acceptable.
  const std::string& error() const { return error_; }

  bool null() override { return Refuse("null"); }
  bool boolean(bool value) override { return Refuse(value ? "true" : "false"); }
  bool number_integer(number_integer_t /*value*/) override { return true; }
  bool number_unsigned(number_unsigned_t value) override {
    return value <= static_cast<number_unsigned_t>(INT64_MAX) || Fail("integer out of range");
  }
  // nlohmann reads an integer too large for 64 bits as a float; `text` is
  // the number as written.
  bool number_float(number_float_t /*value*/, const string_t& text) override {
    if (text.find_first_of(".eE") == string_t::npos) return Fail("integer out of range");
    return Fail(absl::StrCat("a number that is not an integer: ", text));
  }
  bool string(string_t& /*value*/) override { return true; }
  bool binary(binary_t& /*value*/) override { return true; }  // never from JSON text
  bool start_object(std::size_t /*elements*/) override {
    keys_.emplace_back();
    return Enter();
  }
  bool key(string_t& key) override {
    return keys_.back().insert(key).second || Fail(absl::StrCat("duplicate key \"", key, "\""));
  }
  bool end_object() override {
    keys_.pop_back();
    --depth_;
    return true;
  }
  bool start_array(std::size_t /*elements*/) override { return Enter(); }
  bool end_array() override {
    --depth_;
    return true;
  }
  bool parse_error(std::size_t position, const std::string& /*last_token*/,
                   const Json::exception& e) override {
    // "[json.exception.parse_error.101] parse error at line 1, column 6:
    // syntax error ..." -> "syntax error ..."; `position` counts from 1.
    absl::string_view what = e.what();
    const size_t column = what.find("column ");
    const size_t colon = what.find(": ", column == absl::string_view::npos ? 0 : column);
    if (colon != absl::string_view::npos) what.remove_prefix(colon + 2);
    // nlohmann quotes what it last read, which may be bytes that are not
    // UTF-8: escaped, so the message stays printable text.
    std::string printable;
    for (const char c : what) {
      const auto u = static_cast<unsigned char>(c);
      if (u < 0x20 || u >= 0x7f) {
        absl::StrAppend(&printable, "\\x", absl::Hex(u, absl::kZeroPad2));
      } else {
        printable.push_back(c);
      }
    }
    error_ =
        absl::StrCat("bad header JSON at byte ", position > 0 ? position - 1 : 0, ": ", printable);
    return false;
  }

 private:
  bool Fail(std::string what) {
    if (error_.empty()) error_ = absl::StrCat("bad header JSON: ", what);
    return false;
  }
  bool Refuse(absl::string_view literal) {
    return Fail(absl::StrCat("unexpected ", literal,
                             " (a safetensors header holds only objects, arrays, strings and "
                             "integers)"));
  }
  // The top-level value is at depth 0.
  bool Enter() { return ++depth_ <= kMaxJsonDepth + 1 || Fail("nested too deeply"); }

  int depth_ = 0;
  std::vector<std::set<std::string>> keys_;
  std::string error_;
};

// The header text as JSON, checked by HeaderChecker.
absl::StatusOr<Json> ParseJson(absl::string_view text) {
  HeaderChecker checker;
  bool ok = false;
  try {
    ok = Json::sax_parse(text.begin(), text.end(), &checker);
  } catch (const Json::exception& e) {
    return absl::DataLossError(absl::StrCat("bad header JSON: ", e.what()));
  }
  if (!ok || !checker.error().empty()) {
    return absl::DataLossError(checker.error().empty() ? "bad header JSON" : checker.error());
  }
  try {
    return Json::parse(text.begin(), text.end());
  } catch (const Json::exception& e) {
    return absl::DataLossError(absl::StrCat("bad header JSON: ", e.what()));
  }
}

// ---------------------------------------------------------------------------
// The header, validated.

struct TensorEntry {
  std::string name;
  std::string dtype;
  std::vector<int64_t> shape;
  uint64_t begin = 0;
  uint64_t end = 0;
};

struct Header {
  std::map<std::string, std::string> metadata;
  std::vector<TensorEntry> tensors;  // in file (header) order
  // File offset of the data section (8 + header length).
  uint64_t data_start = 0;
};

// Bytes per element of the dtypes the format defines; 0 for an unknown one.
uint64_t DtypeSize(absl::string_view dtype) {
  static const std::map<std::string, uint64_t, std::less<>> kSizes = {
      {"BOOL", 1}, {"U8", 1},  {"I8", 1},  {"F8_E5M2", 1}, {"F8_E4M3", 1},
      {"I16", 2},  {"U16", 2}, {"F16", 2}, {"BF16", 2},    {"I32", 4},
      {"U32", 4},  {"F32", 4}, {"I64", 8}, {"U64", 8},     {"F64", 8},
  };
  const auto it = kSizes.find(dtype);
  return it == kSizes.end() ? 0 : it->second;
}

std::string ShapeString(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

std::string Quote(absl::string_view name) { return absl::StrCat("\"", name, "\""); }

absl::StatusOr<TensorEntry> ParseTensorEntry(const std::string& name, const Json& info) {
  auto bad = [&](absl::string_view what) {
    return absl::DataLossError(absl::StrCat("tensor ", Quote(name), ": ", what));
  };
  if (!info.is_object()) {
    return bad(absl::StrCat("expected an object, found ", info.is_array() ? "an " : "a ",
                            info.type_name()));
  }
  TensorEntry entry;
  entry.name = name;
  bool has_dtype = false, has_shape = false, has_offsets = false;
  for (const auto& [key, value] : info.items()) {
    if (key == "dtype") {
      if (!value.is_string()) return bad("\"dtype\" is not a string");
      entry.dtype = value.get<std::string>();
      has_dtype = true;
    } else if (key == "shape") {
      if (!value.is_array()) return bad("\"shape\" is not an array");
      for (const Json& d : value) {
        if (!d.is_number_integer() || d.get<int64_t>() < 0) {
          return bad("\"shape\" holds something other than a non-negative integer");
        }
        entry.shape.push_back(d.get<int64_t>());
      }
      has_shape = true;
    } else if (key == "data_offsets") {
      if (!value.is_array() || value.size() != 2 || !value[0].is_number_integer() ||
          !value[1].is_number_integer() || value[0].get<int64_t>() < 0 ||
          value[1].get<int64_t>() < 0) {
        return bad("\"data_offsets\" is not a pair of non-negative integers");
      }
      entry.begin = value[0].get<uint64_t>();
      entry.end = value[1].get<uint64_t>();
      has_offsets = true;
    } else {
      return bad(absl::StrCat("unknown field ", Quote(key)));
    }
  }
  if (!has_dtype) return bad("no \"dtype\"");
  if (!has_shape) return bad("no \"shape\"");
  if (!has_offsets) return bad("no \"data_offsets\"");
  const uint64_t element_size = DtypeSize(entry.dtype);
  if (element_size == 0) return bad(absl::StrCat("unknown dtype ", Quote(entry.dtype)));
  if (entry.end < entry.begin) {
    return bad(
        absl::StrCat("data_offsets [", entry.begin, ", ", entry.end, "] end before they begin"));
  }
  uint64_t bytes = element_size;
  for (const int64_t d : entry.shape) {
    const auto ud = static_cast<uint64_t>(d);
    if (ud != 0 && bytes > UINT64_MAX / ud) return bad("shape too large");
    bytes *= ud;
  }
  if (entry.end - entry.begin != bytes) {
    return bad(absl::StrCat("data_offsets [", entry.begin, ", ", entry.end, "] span ",
                            entry.end - entry.begin, " bytes, but ", entry.dtype, " ",
                            ShapeString(entry.shape), " needs ", bytes));
  }
  return entry;
}

// Parses and validates the header text against a data section of
// `data_bytes`.
absl::StatusOr<Header> ParseHeader(absl::string_view text, uint64_t data_bytes) {
  if (text.empty() || text[0] != '{') {
    return absl::DataLossError("bad header JSON: the header does not start with '{'");
  }
  AIDN_ASSIGN_OR_RETURN(Json root, ParseJson(text));
  Header header;
  for (const auto& [key, value] : root.items()) {
    if (key == kMetadataKey) {
      if (!value.is_object()) {
        return absl::DataLossError("\"__metadata__\" is not an object");
      }
      for (const auto& [mkey, mvalue] : value.items()) {
        if (!mvalue.is_string()) {
          return absl::DataLossError(
              absl::StrCat("\"__metadata__\" value of ", Quote(mkey), " is not a string"));
        }
        header.metadata[mkey] = mvalue.get<std::string>();
      }
      continue;
    }
    AIDN_ASSIGN_OR_RETURN(TensorEntry entry, ParseTensorEntry(key, value));
    header.tensors.push_back(std::move(entry));
  }
  // Every byte of the data belongs to exactly one tensor.
  std::vector<const TensorEntry*> by_offset;
  for (const TensorEntry& t : header.tensors) by_offset.push_back(&t);
  std::stable_sort(by_offset.begin(), by_offset.end(),
                   [](const TensorEntry* a, const TensorEntry* b) {
                     return std::pair(a->begin, a->end) < std::pair(b->begin, b->end);
                   });
  uint64_t expected = 0;
  const TensorEntry* previous = nullptr;
  for (const TensorEntry* t : by_offset) {
    if (t->end > data_bytes) {
      return absl::DataLossError(absl::StrCat(
          "tensor ", Quote(t->name), ": data_offsets [", t->begin, ", ", t->end,
          "] run past the end of the data (", data_bytes,
          " bytes follow the header): the file is truncated or the offsets are out of range"));
    }
    if (t->begin < expected) {
      return absl::DataLossError(absl::StrCat("tensor ", Quote(t->name), ": data_offsets [",
                                              t->begin, ", ", t->end, "] overlap those of ",
                                              Quote(previous->name)));
    }
    if (t->begin > expected) {
      return absl::DataLossError(absl::StrCat("tensor ", Quote(t->name), ": data_offsets [",
                                              t->begin, ", ", t->end, "] leave a gap of ",
                                              t->begin - expected, " bytes before them"));
    }
    expected = t->end;
    previous = t;
  }
  if (expected != data_bytes) {
    return absl::DataLossError(absl::StrCat(data_bytes - expected,
                                            " bytes after the last tensor's data belong to "
                                            "no tensor"));
  }
  return header;
}

// ---------------------------------------------------------------------------
// File access.

// Reads exactly `size` bytes at `offset`; DATA_LOSS if the file ends first.
absl::Status PreadAll(int fd, void* buf, size_t size, uint64_t offset) {
  auto* p = static_cast<char*>(buf);
  while (size > 0) {
    const ssize_t n = ::pread(fd, p, size, static_cast<off_t>(offset));
    if (n < 0) {
      if (errno == EINTR) continue;
      return PosixError("read", errno);
    }
    if (n == 0) return absl::DataLossError("the file is truncated (it shrank while being read)");
    p += n;
    size -= static_cast<size_t>(n);
    offset += static_cast<uint64_t>(n);
  }
  return absl::OkStatus();
}

absl::Status WriteAll(int fd, const void* buf, size_t size) {
  const auto* p = static_cast<const char*>(buf);
  while (size > 0) {
    const ssize_t n = ::write(fd, p, size);
    if (n < 0) {
      if (errno == EINTR) continue;
      return PosixError("write", errno);
    }
    p += n;
    size -= static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

// An open file and its validated header.
struct OpenFile {
  std::unique_ptr<ScopedFd> fd;
  Header header;
};

absl::StatusOr<OpenFile> OpenAndParse(const std::string& path) {
  OpenFile file;
  file.fd = std::make_unique<ScopedFd>(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (file.fd->get() < 0) return PosixError("open", errno);
  struct stat st;
  if (::fstat(file.fd->get(), &st) != 0) return PosixError("stat", errno);
  if (!S_ISREG(st.st_mode)) return absl::InvalidArgumentError("not a regular file");
  const auto size = static_cast<uint64_t>(st.st_size);
  if (size < 8) {
    return absl::DataLossError(absl::StrCat("the file is truncated: ", size,
                                            " bytes, fewer than the 8-byte header length"));
  }
  unsigned char length_bytes[8];
  AIDN_RETURN_IF_ERROR(PreadAll(file.fd->get(), length_bytes, 8, 0));
  uint64_t header_bytes = 0;
  for (int i = 7; i >= 0; --i) header_bytes = (header_bytes << 8) | length_bytes[i];
  if (header_bytes > kMaxHeaderBytes) {
    return absl::DataLossError(absl::StrCat("header length ", header_bytes,
                                            " is over the 100 MiB limit: not a safetensors file?"));
  }
  if (header_bytes > size - 8) {
    return absl::DataLossError(absl::StrCat("the file is truncated: the header needs ",
                                            header_bytes, " bytes, but only ", size - 8,
                                            " follow the length"));
  }
  std::string text(header_bytes, '\0');
  AIDN_RETURN_IF_ERROR(PreadAll(file.fd->get(), text.data(), text.size(), 8));
  AIDN_ASSIGN_OR_RETURN(file.header, ParseHeader(text, size - 8 - header_bytes));
  file.header.data_start = 8 + header_bytes;
  return file;
}

absl::Status ReadInto(const OpenFile& file, const TensorEntry& entry, Tensor* out) {
  if (entry.end == entry.begin) return absl::OkStatus();
  return PreadAll(file.fd->get(), out->data(), entry.end - entry.begin,
                  file.header.data_start + entry.begin);
}

absl::Status NotF32(const TensorEntry& entry) {
  return absl::InvalidArgumentError(absl::StrCat("tensor ", Quote(entry.name), " has dtype ",
                                                 entry.dtype, "; aidn reads F32 only"));
}

absl::Status InFile(const std::string& path, const absl::Status& status) {
  return Annotate(status, absl::StrCat("safetensors file ", path));
}

absl::Status Save(const std::string& path, const std::vector<NamedTensor>& tensors,
                  const std::map<std::string, std::string>& metadata) {
  std::set<std::string> names;
  for (const auto& [name, value] : tensors) {
    if (value == nullptr) return absl::InvalidArgumentError("null tensor");
    if (name.empty()) return absl::InvalidArgumentError("a tensor without a name");
    if (name == kMetadataKey) {
      return absl::InvalidArgumentError("a tensor named \"__metadata__\" (reserved)");
    }
    if (!names.insert(name).second) {
      return absl::InvalidArgumentError(absl::StrCat("duplicate tensor name ", Quote(name)));
    }
    if (value->device() != Device::kCpu) {
      return absl::UnimplementedError(absl::StrCat("tensor ", Quote(name), " is not on the CPU"));
    }
  }

  Json json = Json::object();
  if (!metadata.empty()) json[std::string(kMetadataKey)] = metadata;
  uint64_t offset = 0;
  for (const auto& [name, value] : tensors) {
    const uint64_t bytes = static_cast<uint64_t>(value->numel()) * sizeof(float);
    Json& entry = json[name];
    entry["dtype"] = "F32";
    entry["shape"] = value->shape();
    entry["data_offsets"] = Json::array({offset, offset + bytes});
    offset += bytes;
  }
  std::string header;
  try {
    header = json.dump();
  } catch (const Json::exception& e) {
    // Only strings that are not UTF-8 (type_error 316), which no reader
    // would accept.
    return absl::InvalidArgumentError(
        absl::StrCat("a tensor name or metadata entry that is not valid UTF-8: ", e.what()));
  }
  // Pad so the data starts 8-byte aligned, as the reference writer does.
  header.append((8 - header.size() % 8) % 8, ' ');
  unsigned char length_bytes[8];
  for (int i = 0; i < 8; ++i)
    length_bytes[i] = static_cast<unsigned char>(header.size() >> (8 * i));

  const std::string tmp = path + ".tmp";
  ScopedFd fd(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  if (fd.get() < 0) return PosixError(absl::StrCat("create ", tmp), errno);
  absl::Status status = WriteAll(fd.get(), length_bytes, sizeof(length_bytes));
  if (status.ok()) status = WriteAll(fd.get(), header.data(), header.size());
  for (const auto& [name, value] : tensors) {
    if (!status.ok()) break;
    if (value->numel() == 0) continue;
    status = WriteAll(fd.get(), value->data(), static_cast<size_t>(value->numel()) * sizeof(float));
  }
  if (status.ok() && ::fsync(fd.get()) != 0) status = PosixError("fsync", errno);
  if (fd.Close() != 0 && status.ok()) status = PosixError("close", errno);
  if (status.ok() && ::rename(tmp.c_str(), path.c_str()) != 0) {
    status = PosixError(absl::StrCat("rename ", tmp), errno);
  }
  if (!status.ok()) {
    ::unlink(tmp.c_str());
    return status;
  }
  // The rename is durable only once the directory entry is.
  const std::filesystem::path parent = std::filesystem::path(path).parent_path();
  const std::string dir = parent.empty() ? std::string(".") : parent.string();
  ScopedFd dir_fd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (dir_fd.get() < 0) return PosixError(absl::StrCat("open directory ", dir), errno);
  if (::fsync(dir_fd.get()) != 0) return PosixError(absl::StrCat("fsync directory ", dir), errno);
  return absl::OkStatus();
}

absl::Status Load(const std::string& path, const std::vector<Parameter*>& params) {
  std::set<std::string> names;
  for (const Parameter* p : params) {
    if (p == nullptr) return absl::InvalidArgumentError("null parameter");
    if (!names.insert(p->name).second) {
      return absl::InvalidArgumentError(absl::StrCat("duplicate parameter name ", Quote(p->name)));
    }
    if (p->value.device() != Device::kCpu) {
      return absl::UnimplementedError(
          absl::StrCat("parameter ", Quote(p->name), " is not on the CPU"));
    }
  }
  AIDN_ASSIGN_OR_RETURN(OpenFile file, OpenAndParse(path));
  std::map<std::string, const TensorEntry*> by_name;
  for (const TensorEntry& t : file.header.tensors) by_name[t.name] = &t;
  // Check everything, then read into staging tensors, then copy: on any
  // error no parameter has changed.
  std::vector<const TensorEntry*> entries;
  for (const Parameter* p : params) {
    const auto it = by_name.find(p->name);
    if (it == by_name.end()) {
      std::vector<std::string> have;
      for (const TensorEntry& t : file.header.tensors) have.push_back(t.name);
      return absl::InvalidArgumentError(
          absl::StrCat("no tensor ", Quote(p->name),
                       " in the file (it holds: ", absl::StrJoin(have, ", "), ")"));
    }
    const TensorEntry& entry = *it->second;
    if (entry.dtype != "F32") return NotF32(entry);
    if (entry.shape != p->value.shape()) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor ", Quote(p->name), " has shape ", ShapeString(entry.shape),
                       " in the file, but the parameter has ", ShapeString(p->value.shape())));
    }
    entries.push_back(&entry);
  }
  std::vector<Tensor> staged;
  staged.reserve(params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    staged.emplace_back(entries[i]->shape);
    AIDN_RETURN_IF_ERROR(ReadInto(file, *entries[i], &staged.back()));
  }
  for (size_t i = 0; i < params.size(); ++i) {
    if (staged[i].numel() == 0) continue;
    std::memcpy(params[i]->value.data(), staged[i].data(),
                static_cast<size_t>(staged[i].numel()) * sizeof(float));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::map<std::string, Tensor>> Read(const std::string& path,
                                                   std::map<std::string, std::string>* metadata) {
  AIDN_ASSIGN_OR_RETURN(OpenFile file, OpenAndParse(path));
  for (const TensorEntry& t : file.header.tensors) {
    if (t.dtype != "F32") return NotF32(t);
  }
  std::map<std::string, Tensor> tensors;
  for (const TensorEntry& t : file.header.tensors) {
    Tensor tensor(t.shape);
    AIDN_RETURN_IF_ERROR(ReadInto(file, t, &tensor));
    tensors.emplace(t.name, std::move(tensor));
  }
  if (metadata != nullptr) *metadata = std::move(file.header.metadata);
  return tensors;
}

}  // namespace

absl::Status SaveSafetensors(const std::string& path, const std::vector<const Parameter*>& params,
                             const std::map<std::string, std::string>& metadata) {
  std::vector<NamedTensor> tensors;
  for (const Parameter* p : params) {
    if (p == nullptr) return InFile(path, absl::InvalidArgumentError("null parameter"));
    tensors.emplace_back(p->name, &p->value);
  }
  return InFile(path, Save(path, tensors, metadata));
}

absl::Status SaveTensorsSafetensors(const std::string& path,
                                    const std::vector<NamedTensor>& tensors,
                                    const std::map<std::string, std::string>& metadata) {
  return InFile(path, Save(path, tensors, metadata));
}

absl::Status LoadSafetensors(const std::string& path, const std::vector<Parameter*>& params) {
  return InFile(path, Load(path, params));
}

absl::StatusOr<std::map<std::string, Tensor>> ReadSafetensors(
    const std::string& path, std::map<std::string, std::string>* metadata) {
  absl::StatusOr<std::map<std::string, Tensor>> tensors = Read(path, metadata);
  if (!tensors.ok()) return InFile(path, tensors.status());
  return tensors;
}

absl::StatusOr<std::unique_ptr<SafetensorsFile>> SafetensorsFile::Open(const std::string& path) {
  absl::StatusOr<OpenFile> file = OpenAndParse(path);
  if (!file.ok()) return InFile(path, file.status());
  std::unique_ptr<SafetensorsFile> out(new SafetensorsFile());
  out->path_ = path;
  out->fd_ = std::move(file->fd);
  out->metadata_ = std::move(file->header.metadata);
  for (const TensorEntry& t : file->header.tensors) {
    Entry e{t.name, t.dtype, t.shape, 1};
    for (const int64_t d : t.shape) e.numel *= d;
    out->offsets_[t.name] = file->header.data_start + t.begin;
    out->tensors_.push_back(std::move(e));
  }
  return out;
}

SafetensorsFile::~SafetensorsFile() = default;

absl::Status SafetensorsFile::ReadFloats(const std::string& name, size_t first, size_t count,
                                         float* out) const {
  const auto it = std::find_if(tensors_.begin(), tensors_.end(),
                               [&](const Entry& e) { return e.name == name; });
  if (it == tensors_.end()) {
    return InFile(path_, absl::InvalidArgumentError(absl::StrCat("no tensor ", Quote(name))));
  }
  if (it->dtype != "F32") {
    return InFile(path_,
                  absl::InvalidArgumentError(absl::StrCat("tensor ", Quote(name), " has dtype ",
                                                          it->dtype, "; aidn reads F32 only")));
  }
  if (first > static_cast<size_t>(it->numel) || count > static_cast<size_t>(it->numel) - first) {
    return InFile(path_, absl::InvalidArgumentError(
                             absl::StrCat("elements [", first, ", ", first + count, ") of tensor ",
                                          Quote(name), ", which has ", it->numel)));
  }
  if (count == 0) return absl::OkStatus();
  return InFile(path_, PreadAll(fd_->get(), out, count * sizeof(float),
                                offsets_.at(name) + first * sizeof(float)));
}

}  // namespace aidn::engine
