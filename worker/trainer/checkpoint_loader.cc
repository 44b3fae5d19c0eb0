#include "worker/trainer/checkpoint_loader.h"

#include <cstring>
#include <filesystem>
#include <fstream>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/digest.h"
#include "common/file.h"
#include "common/log.h"
#include "common/status.h"
#include "worker/engine/checkpoint.h"

namespace aidn::trainer {
namespace {

// Another job's checkpoint (the spec's checkpoint.resume_from).
bool Foreign(const v1::Checkpoint& c, const std::string& job_id) {
  return !c.job_id().empty() && c.job_id() != job_id;
}

absl::Status ForeignFailed(const v1::Checkpoint& c, const std::string& why) {
  return absl::FailedPreconditionError(
      absl::StrCat("checkpoint.resume_from: the checkpoint of step ", c.step(), " of job ",
                   c.job_id(), " at ", c.path(), ": ", why));
}

}  // namespace

absl::Status CheckSharedDirectory(const std::string& dir, const std::string& nonce,
                                  engine::Communicator* comm) {
  const std::string probe = absl::StrCat(dir, "/.tmp-shared-", nonce);
  float seen = 1.0f;
  if (comm->rank() == 0) {
    std::ofstream out(probe, std::ios::binary | std::ios::trunc);
    out << nonce;
    out.close();
    if (!out) return absl::InternalError(absl::StrCat("checkpoint.dir: cannot write ", probe));
  }
  // Everyone looks once rank 0 has written it.
  AIDN_RETURN_IF_ERROR(comm->Barrier());
  if (comm->rank() != 0) {
    std::ifstream in(probe, std::ios::binary);
    std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    seen = text == nonce ? 1.0f : 0.0f;
  }
  std::vector<float> all(static_cast<size_t>(comm->world_size()));
  AIDN_RETURN_IF_ERROR(comm->AllGather(&seen, 1, all.data()));
  if (comm->rank() == 0) {
    std::error_code ignored;
    std::filesystem::remove(probe, ignored);
  }
  std::vector<int> blind;
  for (size_t r = 0; r < all.size(); ++r) {
    if (all[r] == 0.0f) blind.push_back(static_cast<int>(r));
  }
  if (blind.empty()) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "checkpoint.dir: rank(s) ", absl::StrJoin(blind, ", "), " do not see ", dir,
      " as rank 0 does: under ZeRO and FSDP every rank writes its own shard of each checkpoint "
      "there, so every worker needs the same storage at that path (a shared --checkpoint-root, "
      "or an absolute checkpoint.dir on shared storage)"));
}

absl::Status CheckpointLoader::TryLoad(const std::string& path, int64_t step,
                                       const std::string& manifest_sha256,
                                       const std::vector<engine::Parameter*>& params) {
  if (!manifest_sha256.empty()) {
    absl::StatusOr<std::string> manifest = ReadFileToString(absl::StrCat(path, "/", kManifestName));
    if (!manifest.ok()) return manifest.status();
    if (const std::string sha = Sha256Hex(*manifest); sha != manifest_sha256) {
      return absl::DataLossError(absl::StrCat(
          kManifestName, ": sha256 ", sha.substr(0, 12), ", not the ",
          manifest_sha256.substr(0, 12),
          " committed: the directory was written again after its commit (by a generation that "
          "was superseded, cut off from the coordinator?)"));
    }
  }
  absl::StatusOr<std::unique_ptr<engine::CheckpointReader>> reader =
      engine::CheckpointReader::Open(path);
  if (!reader.ok()) return reader.status();
  if ((*reader)->step() != step) {
    return absl::DataLossError(absl::StrCat(kManifestName, ": says step ", (*reader)->step()));
  }
  AIDN_RETURN_IF_ERROR((*reader)->ReadParameters(params));
  reader_ = *std::move(reader);
  return absl::OkStatus();
}

absl::Status CheckpointLoader::LoadNewest(const std::vector<v1::Checkpoint>& candidates,
                                          const std::vector<engine::Parameter*>& params) {
  const bool reads = options_.every_rank || options_.comm->rank() == 0;
  // With every rank reading, a candidate counts only where all of them
  // could: the weights wait in a copy until they agree.
  std::vector<engine::Parameter> staged;
  std::vector<engine::Parameter*> targets = params;
  if (options_.every_rank) {
    staged.resize(params.size());
    targets.clear();
    for (size_t i = 0; i < params.size(); ++i) {
      staged[i].name = params[i]->name;
      staged[i].value = engine::Tensor(params[i]->value.shape());
      targets.push_back(&staged[i]);
    }
  }
  for (const v1::Checkpoint& c : candidates) {
    const bool foreign = Foreign(c, options_.job_id);
    const std::string path =
        foreign ? c.path() : absl::StrCat(options_.dir, "/", engine::CheckpointDirName(c.step()));
    if (foreign && path.empty()) {
      return ForeignFailed(c, "it is no longer registered (its job's keep_last retired it?)");
    }
    absl::Status status =
        reads ? TryLoad(path, c.step(), c.manifest_sha256(), targets) : absl::OkStatus();
    bool everywhere = status.ok();
    if (options_.every_rank) {
      float failed = status.ok() ? 0.0f : 1.0f;
      AIDN_RETURN_IF_ERROR(options_.comm->AllReduce(&failed, 1, engine::ReduceOp::kSum));
      everywhere = failed == 0.0f;
    }
    if (everywhere) {
      for (size_t i = 0; i < staged.size(); ++i) {
        std::memcpy(params[i]->value.data(), staged[i].value.data(),
                    sizeof(float) * static_cast<size_t>(staged[i].value.numel()));
      }
      loaded_ = c;
      if (reads) {
        AIDN_LOG(INFO) << "resuming from a checkpoint" << Kv("job", c.job_id())
                       << Kv("step", c.step()) << Kv("path", path)
                       << Kv("written_by_ranks", reader_->shards());
      }
      return absl::OkStatus();
    }
    reader_.reset();
    if (foreign) {
      return ForeignFailed(
          c, status.ok() ? "another rank could not read it" : std::string(status.message()));
    }
    if (!status.ok()) options_.report_invalid(c, path, status);
  }
  return absl::OkStatus();
}

absl::Status CheckpointLoader::LoadOptimizerState(
    const std::vector<engine::ShardMap::Piece>& pieces, int64_t optimizer_steps,
    engine::Optimizer* optimizer) {
  AIDN_ASSIGN_OR_RETURN(std::vector<engine::Tensor> buffers, ReadOptimizerState(pieces));
  std::vector<engine::Optimizer::StateEntry> entries;
  for (size_t i = 0; i < pieces.size(); ++i) entries.emplace_back(pieces[i].name, &buffers[i]);
  return optimizer->LoadState(entries, optimizer_steps);
}

absl::StatusOr<std::vector<engine::Tensor>> CheckpointLoader::ReadOptimizerState(
    const std::vector<engine::ShardMap::Piece>& pieces) {
  const bool reads = reader_ != nullptr;
  std::vector<engine::Tensor> buffers;
  absl::Status status;
  for (const engine::ShardMap::Piece& p : pieces) {
    buffers.emplace_back(p.tensor->shape());
    if (!reads || !status.ok()) continue;
    status = reader_->Read(engine::CheckpointReader::Part::kOptimizer, p.whole, p.begin, p.end,
                           buffers.back().data());
    if (absl::IsNotFound(status)) {
      status = absl::DataLossError(absl::StrCat("optimizer state \"", p.whole, "\" is missing"));
    }
  }
  if (!status.ok()) {
    status = absl::Status(status.code(), absl::StrCat("the checkpoint of step ", loaded_.step(),
                                                      ": ", status.message()));
    if (absl::IsDataLoss(status) && !Foreign(loaded_, options_.job_id)) {
      options_.report_invalid(loaded_, reader_->path(), status);
    }
  }
  if (!options_.every_rank) {
    // Rank 0 read the whole state: its verdict, then the buffers.
    float failed = status.ok() ? 0.0f : 1.0f;
    AIDN_RETURN_IF_ERROR(options_.comm->Broadcast(&failed, 1, 0));
    if (failed != 0.0f) {
      return status.ok() ? absl::DataLossError("rank 0 could not read the optimizer state")
                         : status;
    }
    for (engine::Tensor& t : buffers) {
      AIDN_RETURN_IF_ERROR(options_.comm->Broadcast(t.data(), static_cast<size_t>(t.numel()), 0));
    }
  }
  AIDN_RETURN_IF_ERROR(status);
  return buffers;
}

}  // namespace aidn::trainer
