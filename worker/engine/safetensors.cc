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
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "common/file.h"
#include "common/status.h"

namespace aidn::engine {
namespace {

// The format stores little-endian data and aidn copies it byte for byte.
static_assert(std::endian::native == std::endian::little, "safetensors I/O assumes little-endian");

constexpr absl::string_view kMetadataKey = "__metadata__";
// The reference implementation refuses headers above 100 MB; so does aidn,
// which also keeps a corrupt length from allocating gigabytes.
constexpr uint64_t kMaxHeaderBytes = uint64_t{100} << 20;
constexpr int kMaxJsonDepth = 64;

// ---------------------------------------------------------------------------
// A strict parser for the JSON subset a safetensors header uses: objects,
// arrays, strings and integers (true, false, null and fractions never occur
// in one, so they are errors). Duplicate object keys are errors too.

struct Json {
  enum class Kind { kObject, kArray, kString, kInteger };
  Kind kind = Kind::kObject;
  std::string string;
  int64_t integer = 0;
  std::vector<Json> array;
  std::vector<std::pair<std::string, Json>> object;  // in file order
};

const char* KindName(Json::Kind kind) {
  switch (kind) {
    case Json::Kind::kObject:
      return "an object";
    case Json::Kind::kArray:
      return "an array";
    case Json::Kind::kString:
      return "a string";
    case Json::Kind::kInteger:
      return "an integer";
  }
  return "?";
}

// True if `s` is valid UTF-8 (no overlongs, no surrogates, at most U+10FFFF).
bool IsValidUtf8(absl::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    const auto c = static_cast<unsigned char>(s[i]);
    int extra;
    uint32_t cp;
    if (c < 0x80) {
      ++i;
      continue;
    } else if ((c & 0xE0) == 0xC0) {
      extra = 1;
      cp = c & 0x1F;
    } else if ((c & 0xF0) == 0xE0) {
      extra = 2;
      cp = c & 0x0F;
    } else if ((c & 0xF8) == 0xF0) {
      extra = 3;
      cp = c & 0x07;
    } else {
      return false;
    }
    if (i + static_cast<size_t>(extra) >= s.size()) return false;
    for (int k = 1; k <= extra; ++k) {
      const auto cc = static_cast<unsigned char>(s[i + static_cast<size_t>(k)]);
      if ((cc & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (cc & 0x3F);
    }
    static constexpr uint32_t kMin[] = {0, 0x80, 0x800, 0x10000};
    if (cp < kMin[extra] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return false;
    i += static_cast<size_t>(extra) + 1;
  }
  return true;
}

void AppendUtf8(uint32_t cp, std::string* out) {
  if (cp < 0x80) {
    out->push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out->push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out->push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out->push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

class JsonParser {
 public:
  explicit JsonParser(absl::string_view text) : text_(text) {}

  // The whole text as one value, with only whitespace around it. Errors are
  // "bad header JSON at byte <k>: <what>".
  absl::StatusOr<Json> Parse() {
    Json value;
    SkipSpace();
    AIDN_RETURN_IF_ERROR(ParseValue(0, &value));
    SkipSpace();
    if (pos_ != text_.size()) return Error("unexpected text after the top-level value");
    return value;
  }

 private:
  absl::Status Error(absl::string_view what) const {
    return absl::DataLossError(absl::StrCat("bad header JSON at byte ", pos_, ": ", what));
  }
  bool AtEnd() const { return pos_ >= text_.size(); }
  char Peek() const { return text_[pos_]; }
  void SkipSpace() {
    while (!AtEnd() && (Peek() == ' ' || Peek() == '\t' || Peek() == '\n' || Peek() == '\r')) {
      ++pos_;
    }
  }
  absl::Status Expect(char c) {
    if (AtEnd() || Peek() != c) {
      return Error(AtEnd() ? absl::StrCat("expected '", std::string(1, c), "', found the end")
                           : absl::StrCat("expected '", std::string(1, c), "', found '",
                                          std::string(1, Peek()), "'"));
    }
    ++pos_;
    return absl::OkStatus();
  }

  absl::Status ParseValue(int depth, Json* out) {
    if (depth > kMaxJsonDepth) return Error("nested too deeply");
    if (AtEnd()) return Error("expected a value, found the end");
    const char c = Peek();
    if (c == '{') return ParseObject(depth, out);
    if (c == '[') return ParseArray(depth, out);
    if (c == '"') {
      out->kind = Json::Kind::kString;
      return ParseString(&out->string);
    }
    if (c == '-' || (c >= '0' && c <= '9')) return ParseInteger(out);
    return Error(absl::StrCat("unexpected '", std::string(1, c),
                              "' (a safetensors header holds only objects, arrays, strings and "
                              "integers)"));
  }

  absl::Status ParseObject(int depth, Json* out) {
    out->kind = Json::Kind::kObject;
    ++pos_;  // '{'
    SkipSpace();
    if (!AtEnd() && Peek() == '}') {
      ++pos_;
      return absl::OkStatus();
    }
    std::set<std::string> keys;
    while (true) {
      SkipSpace();
      if (AtEnd() || Peek() != '"') return Error("expected a string key");
      const size_t key_pos = pos_;
      std::string key;
      AIDN_RETURN_IF_ERROR(ParseString(&key));
      if (!keys.insert(key).second) {
        pos_ = key_pos;
        return Error(absl::StrCat("duplicate key \"", key, "\""));
      }
      SkipSpace();
      AIDN_RETURN_IF_ERROR(Expect(':'));
      SkipSpace();
      Json value;
      AIDN_RETURN_IF_ERROR(ParseValue(depth + 1, &value));
      out->object.emplace_back(std::move(key), std::move(value));
      SkipSpace();
      if (!AtEnd() && Peek() == ',') {
        ++pos_;
        continue;
      }
      return Expect('}');
    }
  }

  absl::Status ParseArray(int depth, Json* out) {
    out->kind = Json::Kind::kArray;
    ++pos_;  // '['
    SkipSpace();
    if (!AtEnd() && Peek() == ']') {
      ++pos_;
      return absl::OkStatus();
    }
    while (true) {
      SkipSpace();
      Json value;
      AIDN_RETURN_IF_ERROR(ParseValue(depth + 1, &value));
      out->array.push_back(std::move(value));
      SkipSpace();
      if (!AtEnd() && Peek() == ',') {
        ++pos_;
        continue;
      }
      return Expect(']');
    }
  }

  absl::Status ParseHex4(uint32_t* out) {
    uint32_t v = 0;
    for (int k = 0; k < 4; ++k, ++pos_) {
      if (AtEnd()) return Error("truncated \\u escape");
      const char c = Peek();
      v <<= 4;
      if (c >= '0' && c <= '9') {
        v |= static_cast<uint32_t>(c - '0');
      } else if (c >= 'a' && c <= 'f') {
        v |= static_cast<uint32_t>(c - 'a' + 10);
      } else if (c >= 'A' && c <= 'F') {
        v |= static_cast<uint32_t>(c - 'A' + 10);
      } else {
        return Error("bad hex digit in a \\u escape");
      }
    }
    *out = v;
    return absl::OkStatus();
  }

  absl::Status ParseString(std::string* out) {
    ++pos_;  // '"'
    while (true) {
      if (AtEnd()) return Error("unterminated string");
      const char c = Peek();
      if (c == '"') {
        ++pos_;
        return absl::OkStatus();
      }
      if (static_cast<unsigned char>(c) < 0x20) return Error("control character in a string");
      if (c != '\\') {
        out->push_back(c);
        ++pos_;
        continue;
      }
      ++pos_;
      if (AtEnd()) return Error("unterminated escape");
      const char e = Peek();
      ++pos_;
      switch (e) {
        case '"':
        case '\\':
        case '/':
          out->push_back(e);
          break;
        case 'b':
          out->push_back('\b');
          break;
        case 'f':
          out->push_back('\f');
          break;
        case 'n':
          out->push_back('\n');
          break;
        case 'r':
          out->push_back('\r');
          break;
        case 't':
          out->push_back('\t');
          break;
        case 'u': {
          uint32_t cp = 0;
          AIDN_RETURN_IF_ERROR(ParseHex4(&cp));
          if (cp >= 0xDC00 && cp <= 0xDFFF) return Error("unpaired low surrogate");
          if (cp >= 0xD800 && cp <= 0xDBFF) {
            if (text_.substr(pos_, 2) != "\\u") return Error("unpaired high surrogate");
            pos_ += 2;
            uint32_t low = 0;
            AIDN_RETURN_IF_ERROR(ParseHex4(&low));
            if (low < 0xDC00 || low > 0xDFFF) return Error("unpaired high surrogate");
            cp = 0x10000 + ((cp - 0xD800) << 10) + (low - 0xDC00);
          }
          AppendUtf8(cp, out);
          break;
        }
        default:
          --pos_;
          return Error(absl::StrCat("bad escape '\\", std::string(1, e), "'"));
      }
    }
  }

  absl::Status ParseInteger(Json* out) {
    out->kind = Json::Kind::kInteger;
    const bool negative = Peek() == '-';
    if (negative) ++pos_;
    if (AtEnd() || Peek() < '0' || Peek() > '9') return Error("expected a digit");
    if (Peek() == '0' && pos_ + 1 < text_.size() && text_[pos_ + 1] >= '0' &&
        text_[pos_ + 1] <= '9') {
      return Error("leading zero in a number");
    }
    uint64_t v = 0;
    while (!AtEnd() && Peek() >= '0' && Peek() <= '9') {
      const auto digit = static_cast<uint64_t>(Peek() - '0');
      if (v > (uint64_t{INT64_MAX} - digit) / 10) return Error("integer out of range");
      v = v * 10 + digit;
      ++pos_;
    }
    if (!AtEnd() && (Peek() == '.' || Peek() == 'e' || Peek() == 'E')) {
      return Error("a number that is not an integer");
    }
    out->integer = negative ? -static_cast<int64_t>(v) : static_cast<int64_t>(v);
    return absl::OkStatus();
  }

  absl::string_view text_;
  size_t pos_ = 0;
};

void AppendJsonString(absl::string_view s, std::string* out) {
  out->push_back('"');
  for (const char c : s) {
    if (c == '"' || c == '\\') {
      out->push_back('\\');
      out->push_back(c);
    } else if (static_cast<unsigned char>(c) < 0x20) {
      absl::StrAppend(out, absl::StrFormat("\\u%04x", static_cast<unsigned char>(c)));
    } else {
      out->push_back(c);
    }
  }
  out->push_back('"');
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
  if (info.kind != Json::Kind::kObject) {
    return bad(absl::StrCat("expected an object, found ", KindName(info.kind)));
  }
  TensorEntry entry;
  entry.name = name;
  bool has_dtype = false, has_shape = false, has_offsets = false;
  for (const auto& [key, value] : info.object) {
    if (key == "dtype") {
      if (value.kind != Json::Kind::kString) return bad("\"dtype\" is not a string");
      entry.dtype = value.string;
      has_dtype = true;
    } else if (key == "shape") {
      if (value.kind != Json::Kind::kArray) return bad("\"shape\" is not an array");
      for (const Json& d : value.array) {
        if (d.kind != Json::Kind::kInteger || d.integer < 0) {
          return bad("\"shape\" holds something other than a non-negative integer");
        }
        entry.shape.push_back(d.integer);
      }
      has_shape = true;
    } else if (key == "data_offsets") {
      if (value.kind != Json::Kind::kArray || value.array.size() != 2 ||
          value.array[0].kind != Json::Kind::kInteger ||
          value.array[1].kind != Json::Kind::kInteger || value.array[0].integer < 0 ||
          value.array[1].integer < 0) {
        return bad("\"data_offsets\" is not a pair of non-negative integers");
      }
      entry.begin = static_cast<uint64_t>(value.array[0].integer);
      entry.end = static_cast<uint64_t>(value.array[1].integer);
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
  if (!IsValidUtf8(text)) return absl::DataLossError("bad header JSON: not valid UTF-8");
  AIDN_ASSIGN_OR_RETURN(Json root, JsonParser(text).Parse());
  Header header;
  for (const auto& [key, value] : root.object) {
    if (key == kMetadataKey) {
      if (value.kind != Json::Kind::kObject) {
        return absl::DataLossError("\"__metadata__\" is not an object");
      }
      for (const auto& [mkey, mvalue] : value.object) {
        if (mvalue.kind != Json::Kind::kString) {
          return absl::DataLossError(
              absl::StrCat("\"__metadata__\" value of ", Quote(mkey), " is not a string"));
        }
        header.metadata[mkey] = mvalue.string;
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

  std::string header = "{";
  if (!metadata.empty()) {
    AppendJsonString(kMetadataKey, &header);
    header += ":{";
    bool first = true;
    for (const auto& [key, value] : metadata) {
      if (!first) header += ",";
      first = false;
      AppendJsonString(key, &header);
      header += ":";
      AppendJsonString(value, &header);
    }
    header += "}";
  }
  uint64_t offset = 0;
  for (const auto& [name, value] : tensors) {
    if (header.size() > 1) header += ",";
    AppendJsonString(name, &header);
    const uint64_t bytes = static_cast<uint64_t>(value->numel()) * sizeof(float);
    absl::StrAppend(&header, ":{\"dtype\":\"F32\",\"shape\":", ShapeString(value->shape()),
                    ",\"data_offsets\":[", offset, ",", offset + bytes, "]}");
    offset += bytes;
  }
  header += "}";
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

}  // namespace aidn::engine
