#include "worker/engine/checkpoint_reader.h"

#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/status.h"
#include "worker/engine/checkpoint.h"

namespace aidn::engine {
namespace {

absl::StatusOr<std::map<std::string, std::string>> ReadState(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return PosixError(absl::StrCat("open ", path), errno);
  std::map<std::string, std::string> state;
  std::string line;
  int n = 0;
  while (std::getline(in, line)) {
    ++n;
    const size_t space = line.find(' ');
    if (space == std::string::npos || space == 0) {
      return absl::DataLossError(absl::StrCat(kStateFile, " line ", n, ": expected \"key value\""));
    }
    state[line.substr(0, space)] = line.substr(space + 1);
  }
  return state;
}

// "fc1.weight[0:96]" -> "fc1.weight", 0, 96.
bool ParsePieceName(const std::string& name, std::string* whole, size_t* begin, size_t* end) {
  const size_t open = name.rfind('[');
  if (open == std::string::npos || open == 0 || name.back() != ']') return false;
  const std::vector<std::string> bounds =
      absl::StrSplit(name.substr(open + 1, name.size() - open - 2), ':');
  if (bounds.size() != 2 || !absl::SimpleAtoi(bounds[0], begin) ||
      !absl::SimpleAtoi(bounds[1], end) || *end < *begin) {
    return false;
  }
  *whole = name.substr(0, open);
  return true;
}

bool ParseShape(const std::string& text, std::vector<int64_t>* shape) {
  shape->clear();
  if (text.empty()) return true;  // a scalar
  for (absl::string_view d : absl::StrSplit(text, ',')) {
    int64_t v = 0;
    if (!absl::SimpleAtoi(d, &v) || v < 0) return false;
    shape->push_back(v);
  }
  return true;
}

size_t Numel(const std::vector<int64_t>& shape) {
  size_t n = 1;
  for (int64_t d : shape) n *= static_cast<size_t>(d);
  return n;
}

std::string ShapeText(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

}  // namespace

absl::StatusOr<std::unique_ptr<CheckpointReader>> CheckpointReader::Open(const std::string& path) {
  std::unique_ptr<CheckpointReader> reader(new CheckpointReader());
  reader->path_ = path;
  AIDN_ASSIGN_OR_RETURN(reader->manifest_, ReadManifest(path));
  std::map<std::string, const ManifestEntry*> files;
  for (const ManifestEntry& f : reader->manifest_.files) {
    struct stat st;
    const std::string file = absl::StrCat(path, "/", f.name);
    if (::stat(file.c_str(), &st) != 0) {
      return absl::DataLossError(absl::StrCat(f.name, ": missing"));
    }
    if (st.st_size != f.bytes) {
      return absl::DataLossError(
          absl::StrCat(f.name, ": ", st.st_size, " bytes, the manifest says ", f.bytes));
    }
    files[f.name] = &f;
  }
  auto state = files.find(kStateFile);
  if (state == files.end()) {
    return absl::DataLossError(absl::StrCat(kManifestName, " names no ", kStateFile));
  }
  AIDN_RETURN_IF_ERROR(VerifyManifestFile(path, *state->second));
  AIDN_ASSIGN_OR_RETURN(reader->state_, ReadState(absl::StrCat(path, "/", kStateFile)));

  if (files.contains(kModelFile)) {
    AIDN_RETURN_IF_ERROR(reader->AddFile(Part::kModel, kModelFile, /*sharded=*/false));
    AIDN_RETURN_IF_ERROR(reader->AddFile(Part::kOptimizer, kOptimizerFile, /*sharded=*/false));
  } else {
    // model-00000-of-NNNNN.safetensors says how many ranks wrote it.
    int world = 0;
    for (const auto& [name, entry] : files) {
      int r = 0, n = 0;
      if (std::sscanf(name.c_str(), "model-%d-of-%d.safetensors", &r, &n) == 2 && r == 0) world = n;
    }
    if (world <= 0) {
      return absl::DataLossError(absl::StrCat(kManifestName, " names no ", kModelFile,
                                              " and no model-00000-of-N.safetensors"));
    }
    for (int r = 0; r < world; ++r) {
      for (auto [part, prefix] :
           {std::pair{Part::kModel, "model"}, std::pair{Part::kOptimizer, "optimizer"}}) {
        const std::string name = ShardFileName(prefix, r, world);
        if (!files.contains(name)) {
          return absl::DataLossError(absl::StrCat(kManifestName, " names no ", name, " (", world,
                                                  " ranks wrote this checkpoint)"));
        }
        AIDN_RETURN_IF_ERROR(reader->AddFile(part, name, /*sharded=*/true));
      }
    }
    reader->shards_ = world;
  }
  for (const auto& f : reader->files_) {
    reader->entries_.push_back(files.at(f->path().substr(path.size() + 1)));
  }
  AIDN_RETURN_IF_ERROR(reader->CheckCoverage());
  return reader;
}

absl::Status CheckpointReader::AddFile(Part part, const std::string& name, bool sharded) {
  absl::StatusOr<std::unique_ptr<SafetensorsFile>> file =
      SafetensorsFile::Open(absl::StrCat(path_, "/", name));
  if (!file.ok()) return absl::DataLossError(absl::StrCat(name, ": ", file.status().message()));
  const SafetensorsFile& f = **file;
  const bool first_model = part == Part::kModel && model_metadata_.empty();
  Index& index = index_[static_cast<int>(part)];
  for (const SafetensorsFile::Entry& t : f.tensors()) {
    auto bad = [&](const std::string& what) {
      return absl::DataLossError(absl::StrCat(name, ": tensor \"", t.name, "\" ", what));
    };
    if (t.dtype != "F32") return bad(absl::StrCat("has dtype ", t.dtype, "; aidn reads F32 only"));
    std::string whole = t.name;
    std::vector<int64_t> shape = t.shape;
    size_t begin = 0, end = static_cast<size_t>(t.numel);
    if (sharded) {
      if (!ParsePieceName(t.name, &whole, &begin, &end)) {
        return bad("is not named as a piece, <tensor>[begin:end]");
      }
      auto it = f.metadata().find(absl::StrCat(kShapeKeyPrefix, whole));
      if (it == f.metadata().end() || !ParseShape(it->second, &shape)) {
        return bad(absl::StrCat("has no shape of ", whole, " in the metadata"));
      }
      if (end - begin != static_cast<size_t>(t.numel) || end > Numel(shape)) {
        return bad(absl::StrCat("does not fit ", whole, ", whose shape is ", ShapeText(shape)));
      }
    }
    auto [it, added] = index.by_name.try_emplace(whole);
    Whole& w = it->second;
    if (added) {
      w.shape = shape;
      w.numel = Numel(shape);
      index.order.emplace_back(whole, shape);
    } else if (w.shape != shape) {
      return bad(absl::StrCat("gives ", whole, " the shape ", ShapeText(shape), ", another file ",
                              ShapeText(w.shape)));
    }
    w.pieces.push_back({files_.size(), t.name, begin, end});
  }
  if (first_model) {
    for (const auto& [key, value] : f.metadata()) {
      if (key == kParametersKey) {
        order_text_ = value;
      } else if (!key.starts_with(kShapeKeyPrefix)) {
        model_metadata_[key] = value;
      }
    }
  }
  files_.push_back(*std::move(file));
  return absl::OkStatus();
}

absl::Status CheckpointReader::CheckCoverage() {
  // Sharded: the model's order, as the writers listed it.
  if (!order_text_.empty()) {
    Index& model = index_[static_cast<int>(Part::kModel)];
    std::vector<std::pair<std::string, std::vector<int64_t>>> order;
    for (const std::string& name : std::vector<std::string>(absl::StrSplit(order_text_, ','))) {
      auto it = model.by_name.find(name);
      if (it == model.by_name.end()) {
        return absl::DataLossError(
            absl::StrCat(kParametersKey, " names ", name, ", which no model file holds"));
      }
      order.emplace_back(name, it->second.shape);
    }
    if (order.size() != model.order.size()) {
      return absl::DataLossError(absl::StrCat(kParametersKey, " names ", order.size(),
                                              " parameters, the model files hold ",
                                              model.order.size()));
    }
    model.order = std::move(order);
  }
  for (Index& index : index_) {
    for (auto& [name, w] : index.by_name) {
      std::sort(w.pieces.begin(), w.pieces.end(),
                [](const Piece& a, const Piece& b) { return a.begin < b.begin; });
      size_t at = 0;
      for (const Piece& p : w.pieces) {
        if (p.begin != at) {
          return absl::DataLossError(absl::StrCat(
              "the pieces of ", name, p.begin < at ? " overlap at element " : " leave a gap at ",
              std::min(p.begin, at), " (", entries_[p.file]->name, ")"));
        }
        at = p.end;
      }
      if (at != w.numel) {
        return absl::DataLossError(
            absl::StrCat("the pieces of ", name, " end at element ", at, " of ", w.numel));
      }
    }
  }
  return absl::OkStatus();
}

absl::Status CheckpointReader::Verify(size_t file) {
  if (verified_.contains(file)) return absl::OkStatus();
  AIDN_RETURN_IF_ERROR(VerifyManifestFile(path_, *entries_[file]));
  verified_.insert(file);
  return absl::OkStatus();
}

absl::Status CheckpointReader::Read(Part part, const std::string& name, size_t begin, size_t end,
                                    float* out) {
  const Index& index = index_[static_cast<int>(part)];
  auto it = index.by_name.find(name);
  if (it == index.by_name.end()) {
    return absl::NotFoundError(
        absl::StrCat("the checkpoint holds no ",
                     part == Part::kModel ? "parameter " : "optimizer state ", name));
  }
  const Whole& w = it->second;
  if (end < begin || end > w.numel) {
    return absl::InvalidArgumentError(
        absl::StrCat("elements [", begin, ", ", end, ") of ", name, ", which has ", w.numel));
  }
  for (const Piece& p : w.pieces) {
    const size_t lo = std::max(begin, p.begin), hi = std::min(end, p.end);
    if (lo >= hi) continue;
    AIDN_RETURN_IF_ERROR(Verify(p.file));
    AIDN_RETURN_IF_ERROR(
        files_[p.file]->ReadFloats(p.name, lo - p.begin, hi - lo, out + (lo - begin)));
  }
  return absl::OkStatus();
}

absl::Status CheckpointReader::ReadParameters(const std::vector<Parameter*>& params) {
  const Index& index = index_[static_cast<int>(Part::kModel)];
  for (const Parameter* p : params) {
    auto it = index.by_name.find(p->name);
    if (it == index.by_name.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat("the checkpoint holds no parameter ", p->name));
    }
    if (it->second.shape != p->value.shape()) {
      return absl::InvalidArgumentError(
          absl::StrCat("parameter ", p->name, " has shape ", ShapeText(it->second.shape),
                       " in the checkpoint, ", ShapeText(p->value.shape()), " here"));
    }
  }
  std::vector<Tensor> staged;
  staged.reserve(params.size());
  for (const Parameter* p : params) {
    staged.emplace_back(p->value.shape());
    AIDN_RETURN_IF_ERROR(Read(Part::kModel, p->name, 0, static_cast<size_t>(p->value.numel()),
                              staged.back().data()));
  }
  for (size_t i = 0; i < params.size(); ++i) {
    if (staged[i].numel() == 0) continue;
    std::memcpy(params[i]->value.data(), staged[i].data(),
                static_cast<size_t>(staged[i].numel()) * sizeof(float));
  }
  return absl::OkStatus();
}

absl::Status CheckpointReader::Consolidate(const std::string& out) {
  std::vector<std::pair<std::string, Tensor>> tensors;
  for (const auto& [name, shape] : Tensors(Part::kModel)) {
    Tensor t(shape);
    AIDN_RETURN_IF_ERROR(Read(Part::kModel, name, 0, static_cast<size_t>(t.numel()), t.data()));
    tensors.emplace_back(name, std::move(t));
  }
  std::vector<NamedTensor> named;
  for (const auto& [name, t] : tensors) named.emplace_back(name, &t);
  std::map<std::string, std::string> metadata = model_metadata_;
  metadata["format"] = "pt";
  return SaveTensorsSafetensors(out, named, metadata);
}

}  // namespace aidn::engine
