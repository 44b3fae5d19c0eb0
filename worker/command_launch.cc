#include "worker/command_launch.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <set>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "nlohmann/json.hpp"

namespace aidn::worker {
namespace {

// ROLE_NAME: torchrun's default role.
constexpr char kRoleName[] = "default";

absl::StatusOr<std::pair<std::string, int>> SplitHostPort(const std::string& address) {
  const size_t colon = address.rfind(':');
  int port = 0;
  if (colon == std::string::npos || colon == 0 ||
      !absl::SimpleAtoi(address.substr(colon + 1), &port) || port <= 0 || port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("store address: want host:port, got \"", address, "\""));
  }
  std::string host = address.substr(0, colon);
  // [::1]:29500
  if (host.size() > 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  return std::make_pair(host, port);
}

}  // namespace

absl::StatusOr<CommandPlacement> CommandPlacementOf(const v1::JoinRendezvousResponse& rendezvous,
                                                    int rank) {
  const v1::Peer* self = nullptr;
  const v1::Peer* rank0 = nullptr;
  // Each worker's lowest rank orders the workers (torchrun's node ranks).
  std::map<std::string, int> lowest_rank;
  for (const v1::Peer& peer : rendezvous.peers()) {
    if (peer.rank() == rank) self = &peer;
    if (peer.rank() == 0) rank0 = &peer;
    auto [it, inserted] = lowest_rank.try_emplace(peer.worker_id(), peer.rank());
    if (!inserted) it->second = std::min(it->second, peer.rank());
  }
  if (self == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("rendezvous: rank ", rank, " is not a peer"));
  }
  if (rank0 == nullptr || rank0->address().empty()) {
    return absl::InvalidArgumentError("rendezvous: rank 0 has no store address");
  }
  CommandPlacement placement;
  absl::StatusOr<std::pair<std::string, int>> store = SplitHostPort(rank0->address());
  if (!store.ok()) return store.status();
  placement.master_addr = store->first;
  placement.master_port = store->second;

  std::set<std::pair<int, std::string>> workers;  // (lowest rank, worker)
  for (const auto& [worker, lowest] : lowest_rank) workers.insert({lowest, worker});
  placement.group_world_size = static_cast<int>(workers.size());
  placement.group_rank = static_cast<int>(std::distance(
      workers.begin(), workers.find({lowest_rank[self->worker_id()], self->worker_id()})));
  placement.local_rank = 0;
  placement.local_world_size = 0;
  for (const v1::Peer& peer : rendezvous.peers()) {
    if (peer.worker_id() != self->worker_id()) continue;
    ++placement.local_world_size;
    if (peer.rank() < rank) ++placement.local_rank;
  }
  if (rendezvous.has_resume_from()) placement.resume_from = rendezvous.resume_from();
  return placement;
}

std::string CommandCheckpointDir(const v1::TrainerAssignment& a,
                                 const std::string& checkpoint_root) {
  const std::string& dir = a.spec().checkpoint().dir();
  if (dir.empty()) return "";
  std::filesystem::path path(dir);
  if (path.is_relative()) path = std::filesystem::path(checkpoint_root) / path;
  return (path / a.job_id()).lexically_normal().string();
}

absl::StatusOr<LaunchSpec> CommandLaunchSpecFor(const v1::TrainerAssignment& a,
                                                const CommandPlacement& p, const LaunchOptions& o) {
  if (absl::Status s = CheckLaunch(a, o); !s.ok()) return s;
  const v1::CommandSpec& command = a.spec().command();
  if (!a.spec().has_command() || command.argv_size() == 0) {
    return absl::InvalidArgumentError("spec.command: the assignment has no command");
  }
  LaunchSpec launch;
  launch.program = command.argv(0);
  launch.argv.assign(command.argv().begin(), command.argv().end());
  launch.job_dir = absl::StrCat(o.work_dir, "/jobs/", a.job_id());
  launch.log_path = absl::StrCat(o.work_dir, "/logs/", a.job_id(), "/gen-", a.generation(),
                                 "/rank-", a.rank(), ".log");
  const std::string& wd = command.working_dir();
  launch.cwd = wd.empty()          ? launch.job_dir
               : wd.front() == '/' ? wd
                                   : (std::filesystem::path(launch.job_dir) / wd).string();
  const std::string error_dir = absl::StrCat(launch.job_dir, "/.aidn/gen-", a.generation());
  launch.error_file = absl::StrCat(error_dir, "/rank-", a.rank(), "-error.json");
  launch.make_dirs = {error_dir};
  const std::string checkpoint_dir = CommandCheckpointDir(a, o.checkpoint_root);
  if (!checkpoint_dir.empty()) launch.make_dirs.push_back(checkpoint_dir);
  launch.run_as = o.command_user;

  // Not the built-in trainer's trainer_env (its BLAS kernel choice, say):
  // a program of the user's runs as it would by hand.
  std::vector<std::string>& env = launch.env;
  // Variables the spec sets come first, so that aidn's own win (the
  // coordinator refuses a spec that sets them, and a later entry wins).
  // As torchrun: a peer's death fails NCCL collectives instead of hanging
  // them (the spec may say otherwise).
  env.push_back("NCCL_ASYNC_ERROR_HANDLING=1");
  env.push_back("TORCH_NCCL_ASYNC_ERROR_HANDLING=1");
  for (const auto& [name, value] : command.env()) env.push_back(absl::StrCat(name, "=", value));
  if (o.command_user.has_value()) {
    env.push_back("HOME=" + o.command_user->home);
    env.push_back("USER=" + o.command_user->name);
    env.push_back("LOGNAME=" + o.command_user->name);
  }
  const int threads = std::max(1, a.spec().threads_per_rank());
  const int restarts = a.restarts();
  const bool agent_store = command.store() != v1::CommandSpec::RANK0;
  for (const auto& [name, value] : std::vector<std::pair<const char*, std::string>>{
           {"RANK", absl::StrCat(a.rank())},
           {"LOCAL_RANK", absl::StrCat(p.local_rank)},
           {"WORLD_SIZE", absl::StrCat(a.world_size())},
           {"LOCAL_WORLD_SIZE", absl::StrCat(p.local_world_size)},
           {"GROUP_RANK", absl::StrCat(p.group_rank)},
           {"GROUP_WORLD_SIZE", absl::StrCat(p.group_world_size)},
           {"ROLE_RANK", absl::StrCat(a.rank())},
           {"ROLE_WORLD_SIZE", absl::StrCat(a.world_size())},
           {"ROLE_NAME", kRoleName},
           {"MASTER_ADDR", p.master_addr},
           {"MASTER_PORT", absl::StrCat(p.master_port)},
           {"TORCHELASTIC_RUN_ID", a.job_id()},
           {"TORCHELASTIC_RESTART_COUNT", absl::StrCat(restarts)},
           {"TORCHELASTIC_MAX_RESTARTS", absl::StrCat(a.spec().max_restarts())},
           {"TORCHELASTIC_USE_AGENT_STORE", agent_store ? "True" : "False"},
           {"TORCHELASTIC_ERROR_FILE", launch.error_file},
           {"OMP_NUM_THREADS", absl::StrCat(threads)},
           {"PYTHONUNBUFFERED", "1"},
           {"AIDN_COORDINATOR", o.coordinator},
           {"AIDN_TLS_CA", o.insecure ? "" : o.tls_ca_file},
           {"AIDN_INSECURE", o.insecure ? "1" : ""},
           {"AIDN_JOB_ID", a.job_id()},
           {"AIDN_GENERATION", absl::StrCat(a.generation())},
           {"AIDN_RANK", absl::StrCat(a.rank())},
           {"AIDN_WORLD_SIZE", absl::StrCat(a.world_size())},
           {"AIDN_WORKER_ID", o.worker_id},
       }) {
    env.push_back(absl::StrCat(name, "=", value));
  }
  if (!checkpoint_dir.empty()) env.push_back("AIDN_CHECKPOINT_DIR=" + checkpoint_dir);
  if (p.resume_from.has_value()) {
    env.push_back(absl::StrCat("AIDN_RESUME_STEP=", p.resume_from->step()));
    env.push_back("AIDN_RESUME_PATH=" + p.resume_from->path());
  }
  if (!o.python_path.empty()) {
    const char* inherited = nullptr;
    for (const auto& [name, value] : command.env()) {
      if (name == "PYTHONPATH") inherited = value.c_str();
    }
    if (inherited == nullptr) inherited = getenv("PYTHONPATH");
    env.push_back(absl::StrCat("PYTHONPATH=", o.python_path,
                               inherited != nullptr && *inherited != '\0' ? ":" : "",
                               inherited != nullptr ? inherited : ""));
  }
  if (a.spec().device() == v1::JobSpec::GPU) {
    // The job's GPUs on this worker in local-rank order, as torchrun leaves
    // them: a script's torch.cuda.set_device(LOCAL_RANK) picks its own.
    std::vector<int> slots = p.local_gpu_slots;
    if (slots.empty()) slots = {a.slot()};
    std::vector<std::string> visible;
    for (int slot : slots) {
      absl::StatusOr<std::string> device =
          TrainerVisibleDevice(slot, o.gpus, o.cuda_visible_devices);
      if (!device.ok()) return device.status();
      visible.push_back(*device);
    }
    env.push_back("CUDA_VISIBLE_DEVICES=" + absl::StrJoin(visible, ","));
  }
  env.push_back(absl::StrCat(kTrainerTokenVariable, "=", a.trainer_token()));
  return launch;
}

std::string ReadErrorFile(const std::string& path, uid_t owner) {
  constexpr size_t kMaxFileBytes = 1 << 20;
  constexpr size_t kMaxMessageBytes = 2048;
  const int fd = open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) return "";
  struct stat st = {};
  std::string text;
  if (fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && st.st_uid == owner) {
    text.resize(std::min<size_t>(static_cast<size_t>(st.st_size), kMaxFileBytes));
    const ssize_t n = pread(fd, text.data(), text.size(), 0);
    text.resize(n > 0 ? static_cast<size_t>(n) : 0);
  }
  close(fd);
  nlohmann::json doc = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded() || !doc.is_object() || !doc.contains("message")) return "";
  const nlohmann::json& message = doc["message"];
  std::string out;
  if (message.is_string()) {
    out = message.get<std::string>();
  } else if (message.is_object() && message.contains("message") && message["message"].is_string()) {
    out = message["message"].get<std::string>();
  }
  if (out.size() > kMaxMessageBytes) out = out.substr(0, kMaxMessageBytes) + "...";
  return out;
}

}  // namespace aidn::worker
