#ifndef AIDN_COMMON_COMMAND_ENV_H_
#define AIDN_COMMON_COMMAND_ENV_H_

// The environment variables aidn sets for every rank of a command job
// (JobSpec.command): torchrun's contract, so a PyTorch script cannot tell it
// from torchrun, and aidn's own for the Python client. A spec's command.env
// may not set them (coordinator/command_spec.cc refuses it, naming the
// variable); the worker sets them (worker/launch.cc).

#include <string_view>

namespace aidn::command_env {

// Every variable aidn sets itself, exactly.
inline constexpr std::string_view kReserved[] = {
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "ROLE_NAME",
    "MASTER_ADDR",
    "MASTER_PORT",
    "OMP_NUM_THREADS",
    "CUDA_VISIBLE_DEVICES",
    "PYTHONUNBUFFERED",
};
// Every variable starting with one of these is aidn's.
inline constexpr std::string_view kReservedPrefixes[] = {"TORCHELASTIC_", "AIDN_"};

inline bool IsReserved(std::string_view name) {
  for (std::string_view r : kReserved) {
    if (name == r) return true;
  }
  for (std::string_view p : kReservedPrefixes) {
    if (name.substr(0, p.size()) == p) return true;
  }
  return false;
}

}  // namespace aidn::command_env

#endif  // AIDN_COMMON_COMMAND_ENV_H_
