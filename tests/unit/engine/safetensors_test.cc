// safetensors I/O: round trips, the file layout byte for byte, one test per
// kind of corruption (each error must name the file and the problem), and a
// cross-check with PyTorch, which reads aidn's file and writes its own by the
// published layout (python3-safetensors is not packaged in Debian).

#include "worker/engine/safetensors.h"

#include <stdlib.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <random>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "tests/support/process.h"

namespace aidn::engine {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

class TempDir {
 public:
  TempDir() {
    std::string tmpl = (std::filesystem::temp_directory_path() / "aidn_st_XXXXXX").string();
    if (mkdtemp(tmpl.data()) != nullptr) path_ = tmpl;
  }
  ~TempDir() {
    if (!path_.empty()) std::filesystem::remove_all(path_);
  }
  const std::string& path() const { return path_; }
  std::string File(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

void WriteAll(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(out.good()) << path;
}

Parameter MakeParam(std::string name, std::vector<int64_t> shape, uint32_t seed) {
  Parameter p;
  p.name = std::move(name);
  p.value = Tensor(shape);
  p.grad = Tensor(shape);
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int64_t i = 0; i < p.value.numel(); ++i) p.value[i] = normal(rng);
  return p;
}

// A small model-like set: odd sizes, a scalar and an empty tensor.
std::vector<Parameter> SampleParams(uint32_t seed) {
  std::vector<Parameter> params;
  params.push_back(MakeParam("1.weight", {7, 5}, seed));
  params.push_back(MakeParam("1.bias", {7}, seed + 1));
  params.push_back(MakeParam("conv.weight", {2, 1, 3, 3}, seed + 2));
  params.push_back(MakeParam("scale", {}, seed + 3));
  params.push_back(MakeParam("empty", {0, 4}, seed + 4));
  return params;
}

std::vector<const Parameter*> ConstPointers(const std::vector<Parameter>& params) {
  std::vector<const Parameter*> out;
  for (const Parameter& p : params) out.push_back(&p);
  return out;
}

std::vector<Parameter*> Pointers(std::vector<Parameter>& params) {
  std::vector<Parameter*> out;
  for (Parameter& p : params) out.push_back(&p);
  return out;
}

bool SameBits(const Tensor& a, const Tensor& b) {
  return a.shape() == b.shape() &&
         (a.numel() == 0 ||
          std::memcmp(a.data(), b.data(), static_cast<size_t>(a.numel()) * sizeof(float)) == 0);
}

// A file of `header` (padded to 8 bytes unless `pad` is false) and `data`.
std::string MakeFile(std::string header, const std::string& data, bool pad = true) {
  if (pad) header.append((8 - header.size() % 8) % 8, ' ');
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i)
    out[static_cast<size_t>(i)] = static_cast<char>(header.size() >> (8 * i));
  return out + header + data;
}

std::string Floats(std::vector<float> values) {
  return std::string(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(float));
}

TEST(Safetensors, SaveThenLoadRestoresEveryValueBitForBit) {
  TempDir dir;
  ASSERT_FALSE(dir.path().empty());
  const std::string path = dir.File("w.safetensors");
  std::vector<Parameter> saved = SampleParams(1);
  ASSERT_TRUE(SaveSafetensors(path, ConstPointers(saved)).ok());

  std::vector<Parameter> loaded = SampleParams(100);  // same shapes, other values
  const absl::Status status = LoadSafetensors(path, Pointers(loaded));
  ASSERT_TRUE(status.ok()) << status;
  for (size_t i = 0; i < saved.size(); ++i) {
    EXPECT_TRUE(SameBits(saved[i].value, loaded[i].value)) << saved[i].name;
  }
  EXPECT_FALSE(std::filesystem::exists(path + ".tmp"));
}

TEST(Safetensors, LoadFindsTensorsByNameInAnyOrderAndIgnoresOthers) {
  TempDir dir;
  const std::string path = dir.File("w.safetensors");
  std::vector<Parameter> saved = SampleParams(1);
  ASSERT_TRUE(SaveSafetensors(path, ConstPointers(saved)).ok());
  std::vector<Parameter> subset;
  subset.push_back(MakeParam("conv.weight", {2, 1, 3, 3}, 7));
  subset.push_back(MakeParam("1.weight", {7, 5}, 8));
  const absl::Status status = LoadSafetensors(path, Pointers(subset));
  ASSERT_TRUE(status.ok()) << status;
  EXPECT_TRUE(SameBits(subset[0].value, saved[2].value));
  EXPECT_TRUE(SameBits(subset[1].value, saved[0].value));
}

TEST(Safetensors, ReadReturnsEveryTensorAndTheMetadata) {
  TempDir dir;
  const std::string path = dir.File("w.safetensors");
  std::vector<Parameter> saved = SampleParams(3);
  const std::map<std::string, std::string> metadata = {
      {"format", "pt"}, {"step", "120"}, {"quote\"and\\slash\n", "ünïcode ✓"}};
  ASSERT_TRUE(SaveSafetensors(path, ConstPointers(saved), metadata).ok());
  std::map<std::string, std::string> got_metadata;
  absl::StatusOr<std::map<std::string, Tensor>> tensors = ReadSafetensors(path, &got_metadata);
  ASSERT_TRUE(tensors.ok()) << tensors.status();
  EXPECT_EQ(got_metadata, metadata);
  ASSERT_EQ(tensors->size(), saved.size());
  for (const Parameter& p : saved) {
    ASSERT_EQ(tensors->count(p.name), 1u) << p.name;
    EXPECT_TRUE(SameBits(tensors->at(p.name), p.value)) << p.name;
  }
}

TEST(Safetensors, SavedFileFollowsThePublishedLayout) {
  TempDir dir;
  const std::string path = dir.File("w.safetensors");
  Parameter a = MakeParam("a", {2, 3}, 1);
  Parameter b = MakeParam("b", {1}, 2);
  ASSERT_TRUE(SaveSafetensors(path, {&a, &b}, {{"k", "v"}}).ok());
  const std::string bytes = ReadAll(path);
  ASSERT_GE(bytes.size(), 8u);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i)
    n = (n << 8) | static_cast<unsigned char>(bytes[static_cast<size_t>(i)]);
  EXPECT_EQ(n % 8, 0u) << "the data should start 8-byte aligned";
  ASSERT_EQ(bytes.size(), 8 + n + 7 * sizeof(float));
  const std::string header = bytes.substr(8, n);
  EXPECT_EQ(header.substr(0, header.find_last_not_of(' ') + 1),
            "{\"__metadata__\":{\"k\":\"v\"},"
            "\"a\":{\"dtype\":\"F32\",\"shape\":[2,3],\"data_offsets\":[0,24]},"
            "\"b\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[24,28]}}");
  EXPECT_EQ(std::memcmp(bytes.data() + 8 + n, a.value.data(), 24), 0);
  EXPECT_EQ(std::memcmp(bytes.data() + 8 + n + 24, b.value.data(), 4), 0);
}

TEST(Safetensors, SaveReplacesAnExistingFileWhole) {
  TempDir dir;
  const std::string path = dir.File("w.safetensors");
  WriteAll(path, std::string(100000, 'x'));
  std::vector<Parameter> saved = SampleParams(5);
  ASSERT_TRUE(SaveSafetensors(path, ConstPointers(saved)).ok());
  std::vector<Parameter> loaded = SampleParams(6);
  ASSERT_TRUE(LoadSafetensors(path, Pointers(loaded)).ok());
  EXPECT_TRUE(SameBits(saved[0].value, loaded[0].value));
  EXPECT_FALSE(std::filesystem::exists(path + ".tmp"));
}

TEST(Safetensors, SaveRefusesNamesThatCannotRoundTrip) {
  TempDir dir;
  const std::string path = dir.File("w.safetensors");
  Parameter a = MakeParam("a", {2}, 1);
  Parameter a2 = MakeParam("a", {3}, 2);
  Parameter meta = MakeParam("__metadata__", {1}, 3);
  Parameter unnamed = MakeParam("", {1}, 4);
  EXPECT_THAT(SaveSafetensors(path, {&a, &a2}).message(), HasSubstr("duplicate tensor name"));
  EXPECT_THAT(SaveSafetensors(path, {&meta}).message(), HasSubstr("reserved"));
  EXPECT_THAT(SaveSafetensors(path, {&unnamed}).message(), HasSubstr("without a name"));
  EXPECT_EQ(SaveSafetensors(path, {&a, nullptr}).code(), absl::StatusCode::kInvalidArgument);
  // No reader accepts a header that is not UTF-8.
  Parameter latin1 = MakeParam("caf\xe9", {1}, 5);
  const absl::Status not_utf8 = SaveSafetensors(path, {&latin1});
  EXPECT_EQ(not_utf8.code(), absl::StatusCode::kInvalidArgument) << not_utf8;
  EXPECT_THAT(not_utf8.message(), HasSubstr("not valid UTF-8"));
  EXPECT_EQ(SaveSafetensors(path, {&a}, {{"k", "\xff"}}).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_FALSE(std::filesystem::exists(path));
  EXPECT_FALSE(std::filesystem::exists(path + ".tmp"));
}

TEST(Safetensors, SaveIntoAMissingDirectoryNamesThePath) {
  TempDir dir;
  const std::string path = dir.File("no/such/dir/w.safetensors");
  Parameter a = MakeParam("a", {2}, 1);
  const absl::Status status = SaveSafetensors(path, {&a});
  EXPECT_EQ(status.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(status.message(), HasSubstr(path));
}

TEST(Safetensors, LoadOfAMissingFileIsNotFoundAndNamesIt) {
  TempDir dir;
  const std::string path = dir.File("absent.safetensors");
  std::vector<Parameter> params = SampleParams(1);
  const absl::Status status = LoadSafetensors(path, Pointers(params));
  EXPECT_EQ(status.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(status.message(), HasSubstr(path));
}

TEST(Safetensors, LoadNamesAMissingTensorAndChangesNothing) {
  TempDir dir;
  const std::string path = dir.File("w.safetensors");
  std::vector<Parameter> saved = SampleParams(1);
  ASSERT_TRUE(SaveSafetensors(path, ConstPointers(saved)).ok());
  std::vector<Parameter> params = SampleParams(50);
  params.push_back(MakeParam("3.bias", {4}, 9));
  std::vector<Parameter> before = SampleParams(50);
  const absl::Status status = LoadSafetensors(path, Pointers(params));
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), AllOf(HasSubstr(path), HasSubstr("no tensor \"3.bias\"")));
  for (size_t i = 0; i < before.size(); ++i) {
    EXPECT_TRUE(SameBits(params[i].value, before[i].value)) << params[i].name << " was changed";
  }
}

TEST(Safetensors, LoadRefusesAShapeMismatchAndChangesNothing) {
  TempDir dir;
  const std::string path = dir.File("w.safetensors");
  std::vector<Parameter> saved = SampleParams(1);
  ASSERT_TRUE(SaveSafetensors(path, ConstPointers(saved)).ok());
  std::vector<Parameter> params;
  params.push_back(MakeParam("1.bias", {7}, 11));
  params.push_back(MakeParam("1.weight", {5, 7}, 12));  // transposed
  const Tensor bias_before = params[0].value.Clone();
  const absl::Status status = LoadSafetensors(path, Pointers(params));
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(),
              AllOf(HasSubstr(path), HasSubstr("\"1.weight\" has shape [7, 5] in the file"),
                    HasSubstr("[5, 7]")));
  EXPECT_TRUE(SameBits(params[0].value, bias_before));
}

TEST(Safetensors, LoadAndReadRefuseADtypeOtherThanF32) {
  TempDir dir;
  const std::string path = dir.File("half.safetensors");
  WriteAll(path, MakeFile("{\"w\":{\"dtype\":\"F16\",\"shape\":[2],\"data_offsets\":[0,4]}}",
                          std::string(4, '\0')));
  Parameter w = MakeParam("w", {2}, 1);
  const absl::Status load = LoadSafetensors(path, {&w});
  EXPECT_EQ(load.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(load.message(), AllOf(HasSubstr(path), HasSubstr("dtype F16")));
  EXPECT_THAT(ReadSafetensors(path).status().message(), HasSubstr("dtype F16"));
}

// One corrupt file per case: the error is DATA_LOSS and names the file and
// the problem.
struct Corruption {
  std::string label;
  std::string bytes;
  std::string expected;
};

std::vector<Corruption> Corruptions() {
  const std::string one = Floats({1.0f});
  const std::string two = Floats({1.0f, 2.0f});
  const std::string ok_entry = "\"w\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}";
  std::string valid = MakeFile("{" + ok_entry + "}", two);
  std::vector<Corruption> cases = {
      {"shorter than the length field", std::string(5, '\0'), "truncated"},
      {"header cut short", valid.substr(0, 20), "truncated"},
      {"data cut short", valid.substr(0, valid.size() - 3), "truncated"},
      {"header length absurd", std::string("\xff\xff\xff\xff\xff\xff\x00\x00", 8) + "{}",
       "100 MiB"},
      {"header not an object", MakeFile("[1, 2]", ""), "does not start with '{'"},
      {"header missing a colon", MakeFile("{\"w\" {}}", ""), "bad header JSON at byte 5"},
      {"trailing text", MakeFile("{}x", ""), "expected end of input"},
      {"missing closing quote", MakeFile("{\"w", ""), "missing closing quote"},
      {"literal true", MakeFile("{\"w\":true}", ""), "unexpected true"},
      {"fractional number",
       MakeFile("{\"w\":{\"dtype\":\"F32\",\"shape\":[2.5],\"data_offsets\":[0,8]}}", two),
       "not an integer"},
      {"integer overflow",
       MakeFile("{\"w\":{\"dtype\":\"F32\",\"shape\":[99999999999999999999],"
                "\"data_offsets\":[0,8]}}",
                two),
       "integer out of range"},
      {"duplicate key", MakeFile("{" + ok_entry + "," + ok_entry + "}", two),
       "duplicate key \"w\""},
      {"invalid UTF-8", MakeFile("{\"\xc3\x28\":{}}", ""), "ill-formed UTF-8"},
      {"nested too deeply",
       MakeFile("{\"__metadata__\":" + std::string(100, '[') + std::string(100, ']') + "}", ""),
       "nested too deeply"},
      {"metadata value not a string", MakeFile("{\"__metadata__\":{\"k\":1}}", ""),
       "\"__metadata__\" value of \"k\" is not a string"},
      {"tensor info not an object", MakeFile("{\"w\":\"x\"}", ""),
       "tensor \"w\": expected an object"},
      {"missing dtype", MakeFile("{\"w\":{\"shape\":[2],\"data_offsets\":[0,8]}}", two),
       "tensor \"w\": no \"dtype\""},
      {"missing shape", MakeFile("{\"w\":{\"dtype\":\"F32\",\"data_offsets\":[0,8]}}", two),
       "tensor \"w\": no \"shape\""},
      {"missing offsets", MakeFile("{\"w\":{\"dtype\":\"F32\",\"shape\":[2]}}", two),
       "tensor \"w\": no \"data_offsets\""},
      {"unknown field",
       MakeFile("{\"w\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8],\"x\":1}}", two),
       "unknown field \"x\""},
      {"unknown dtype",
       MakeFile("{\"w\":{\"dtype\":\"F31\",\"shape\":[2],\"data_offsets\":[0,8]}}", two),
       "unknown dtype \"F31\""},
      {"negative dimension",
       MakeFile("{\"w\":{\"dtype\":\"F32\",\"shape\":[-2],\"data_offsets\":[0,8]}}", two),
       "non-negative integer"},
      {"offsets not a pair",
       MakeFile("{\"w\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0]}}", two),
       "\"data_offsets\" is not a pair"},
      {"offsets reversed",
       MakeFile("{\"w\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[8,0]}}", two),
       "end before they begin"},
      {"offsets disagree with the shape",
       MakeFile("{\"w\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[0,8]}}", two),
       "span 8 bytes, but F32 [3] needs 12"},
      {"offsets out of range",
       MakeFile("{\"w\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]}}", two),
       "data_offsets [4, 12] run past the end of the data (8 bytes"},
      {"offsets overlap",
       MakeFile("{" + ok_entry + ",\"v\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}}",
                two),
       "overlap those of"},
      {"offsets leave a gap",
       MakeFile("{\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}}", two),
       "gap of 4 bytes"},
      {"bytes after the last tensor", MakeFile("{" + ok_entry + "}", two + one),
       "4 bytes after the last tensor's data belong to no tensor"},
  };
  return cases;
}

TEST(Safetensors, EveryKindOfCorruptionIsDataLossNamingFileAndProblem) {
  TempDir dir;
  ASSERT_FALSE(dir.path().empty());
  int index = 0;
  for (const Corruption& c : Corruptions()) {
    SCOPED_TRACE(c.label);
    const std::string path = dir.File(absl::StrCat("bad", index++, ".safetensors"));
    WriteAll(path, c.bytes);
    const absl::StatusOr<std::map<std::string, Tensor>> read = ReadSafetensors(path);
    ASSERT_FALSE(read.ok());
    EXPECT_EQ(read.status().code(), absl::StatusCode::kDataLoss) << read.status();
    EXPECT_THAT(read.status().message(),
                AllOf(HasSubstr("safetensors file " + path + ": "), HasSubstr(c.expected)))
        << read.status();
    Parameter w = MakeParam("w", {2}, 1);
    const Tensor before = w.value.Clone();
    const absl::Status load = LoadSafetensors(path, {&w});
    EXPECT_EQ(load.code(), absl::StatusCode::kDataLoss) << load;
    EXPECT_THAT(load.message(), HasSubstr(c.expected));
    EXPECT_TRUE(SameBits(w.value, before));
  }
}

TEST(Safetensors, ReadsUnpaddedHeadersEscapesAndZeroSizedTensors) {
  TempDir dir;
  const std::string path = dir.File("odd.safetensors");
  // Whitespace, escapes (\u00e9 and a surrogate pair), an empty tensor
  // sharing its offset, and data that does not start 8-byte aligned.
  const std::string header =
      "{ \"__metadata__\" : { \"n\\u00e9\\ud83d\\ude00\" : \"a\\\"b\\\\c\\n\" } ,\n"
      "  \"z\" : { \"shape\" : [ 0, 3 ], \"dtype\" : \"F32\", \"data_offsets\" : [ 4, 4 ] },\n"
      "  \"b\" : { \"dtype\" : \"F32\", \"shape\" : [ ], \"data_offsets\" : [ 4, 8 ] },\n"
      "  \"a\" : { \"dtype\" : \"F32\", \"shape\" : [ 1 ], \"data_offsets\" : [ 0, 4 ] } }";
  ASSERT_NE((header.size() + 1) % 8, 0u);
  WriteAll(path, MakeFile(header + " ", Floats({1.5f, -2.25f}), /*pad=*/false));
  std::map<std::string, std::string> metadata;
  absl::StatusOr<std::map<std::string, Tensor>> tensors = ReadSafetensors(path, &metadata);
  ASSERT_TRUE(tensors.ok()) << tensors.status();
  EXPECT_EQ(metadata.at("n\xc3\xa9\xf0\x9f\x98\x80"), "a\"b\\c\n");
  ASSERT_EQ(tensors->size(), 3u);
  EXPECT_EQ(tensors->at("a").shape(), std::vector<int64_t>{1});
  EXPECT_EQ(tensors->at("a")[0], 1.5f);
  EXPECT_EQ(tensors->at("b").shape(), std::vector<int64_t>{});
  EXPECT_EQ(tensors->at("b")[0], -2.25f);
  EXPECT_EQ(tensors->at("z").shape(), (std::vector<int64_t>{0, 3}));
}

// The cross-check with PyTorch. The script reads aidn's file by the layout
// (json + torch.frombuffer), checks it as the reference implementation would,
// and writes every tensor back, plus one of its own, in a file of its own
// making: reversed order, metadata last, data offsets not in header order.
constexpr char kRoundTripScript[] = R"PY(
import json, struct, sys
import torch

d = sys.argv[1]
with open(f"{d}/aidn.safetensors", "rb") as f:
    raw = f.read()
(n,) = struct.unpack("<Q", raw[:8])
assert n % 8 == 0, n
header = json.loads(raw[8:8 + n].decode("utf-8"))
data = raw[8 + n:]
meta = header.pop("__metadata__")
assert meta == {"producer": "aidn", "step": "7"}, meta
tensors = {}
end = 0
for name, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"]):
    assert info["dtype"] == "F32", info
    b, e = info["data_offsets"]
    assert b == end, (name, b, end)
    end = e
    if e == b:  # frombuffer refuses an empty buffer
        t = torch.empty(info["shape"], dtype=torch.float32)
    else:
        t = torch.frombuffer(bytearray(data[b:e]), dtype=torch.float32).reshape(info["shape"])
    tensors[name] = t
assert end == len(data), (end, len(data))
assert list(header) == ["1.weight", "1.bias", "conv.weight", "scale", "empty"], list(header)
assert tensors["scale"].dim() == 0 and tensors["empty"].shape == (0, 4)

# Torch's own arithmetic on what it read, for aidn to check: 2x + 1, exact in float32
# for these values (no overflow, and doubling and adding one round the same way).
out = {name: (t * 2 + 1).contiguous() for name, t in reversed(list(tensors.items()))}
out["torch.arange"] = torch.arange(6, dtype=torch.float32).reshape(2, 3)
hdr, blobs, offset = {}, [], 0
for name, t in reversed(list(out.items())):  # data order: reverse of the header order
    b = t.numpy().tobytes()
    blobs.append(b)
    hdr[name] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [offset, offset + len(b)]}
    offset += len(b)
ordered = {name: hdr[name] for name in out}
ordered["__metadata__"] = {"format": "pt"}
text = json.dumps(ordered).encode("utf-8")
text += b" " * ((8 - len(text) % 8) % 8)
with open(f"{d}/torch.safetensors", "wb") as f:
    f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))
print("ok")
)PY";

TEST(Safetensors, PyTorchReadsAidnFilesAndAidnReadsPyTorchFiles) {
  if (!testing::PythonHasTorch()) {
    GTEST_SKIP() << "/usr/bin/python3 cannot import torch (install python3-torch): skipping the "
                    "safetensors cross-check with PyTorch";
  }
  TempDir dir;
  ASSERT_FALSE(dir.path().empty());
  std::vector<Parameter> saved = SampleParams(21);
  ASSERT_TRUE(SaveSafetensors(dir.File("aidn.safetensors"), ConstPointers(saved),
                              {{"producer", "aidn"}, {"step", "7"}})
                  .ok());
  WriteAll(dir.File("check.py"), kRoundTripScript);
  const std::string command = absl::StrCat("/usr/bin/python3 ", dir.File("check.py"), " ",
                                           dir.path(), " >", dir.File("log"), " 2>&1");
  ASSERT_EQ(std::system(command.c_str()), 0) << "torch side failed:\n" << ReadAll(dir.File("log"));

  std::map<std::string, std::string> metadata;
  absl::StatusOr<std::map<std::string, Tensor>> tensors =
      ReadSafetensors(dir.File("torch.safetensors"), &metadata);
  ASSERT_TRUE(tensors.ok()) << tensors.status();
  EXPECT_EQ(metadata, (std::map<std::string, std::string>{{"format", "pt"}}));
  ASSERT_EQ(tensors->size(), saved.size() + 1);
  for (const Parameter& p : saved) {
    ASSERT_EQ(tensors->count(p.name), 1u) << p.name;
    const Tensor& t = tensors->at(p.name);
    ASSERT_EQ(t.shape(), p.value.shape()) << p.name;
    for (int64_t i = 0; i < t.numel(); ++i) {
      ASSERT_EQ(t[i], p.value[i] * 2.0f + 1.0f) << p.name << "[" << i << "]";
    }
  }
  const Tensor& arange = tensors->at("torch.arange");
  ASSERT_EQ(arange.shape(), (std::vector<int64_t>{2, 3}));
  for (int64_t i = 0; i < 6; ++i) EXPECT_EQ(arange[i], static_cast<float>(i));

  // And LoadSafetensors into parameters from torch's file.
  std::vector<Parameter> loaded = SampleParams(99);
  ASSERT_TRUE(LoadSafetensors(dir.File("torch.safetensors"), Pointers(loaded)).ok());
  EXPECT_EQ(loaded[0].value[3], saved[0].value[3] * 2.0f + 1.0f);
}

}  // namespace
}  // namespace aidn::engine
