#include "coordinator/command_spec.h"

#include <string>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "common/command_env.h"
#include "common/status.h"
#include "coordinator/spec_checks.h"

namespace aidn::coordinator {
namespace {

absl::Status CheckString(absl::string_view field, absl::string_view s) {
  if (s.size() > kMaxCommandStringBytes) {
    return Invalid(
        field, absl::StrCat("must be at most ", kMaxCommandStringBytes, " bytes, got ", s.size()));
  }
  if (s.find('\0') != absl::string_view::npos) return Invalid(field, "must not contain NUL");
  return absl::OkStatus();
}

absl::Status CheckNoParent(absl::string_view field, absl::string_view path) {
  for (absl::string_view component : absl::StrSplit(path, '/')) {
    if (component == "..")
      return Invalid(field, absl::StrCat("must not contain \"..\", got ", Quote(path)));
  }
  return absl::OkStatus();
}

bool ValidEnvName(absl::string_view name) {
  if (name.empty() || name.size() > 256) return false;
  auto alpha = [](char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_'; };
  if (!alpha(name[0])) return false;
  for (char c : name) {
    if (!alpha(c) && !(c >= '0' && c <= '9')) return false;
  }
  return true;
}

absl::Status ValidateArgv(const v1::CommandSpec& command, size_t* total) {
  if (command.argv_size() == 0) {
    return Invalid("command.argv", "required: the program and its arguments");
  }
  if (command.argv_size() > kMaxCommandArgs) {
    return Invalid("command.argv", absl::StrCat("at most ", kMaxCommandArgs, " entries, got ",
                                                command.argv_size()));
  }
  if (command.argv(0).empty()) return Invalid("command.argv[0]", "the program must not be empty");
  for (int i = 0; i < command.argv_size(); ++i) {
    const std::string field = absl::StrCat("command.argv[", i, "]");
    AIDN_RETURN_IF_ERROR(CheckString(field, command.argv(i)));
    *total += command.argv(i).size();
  }
  return CheckNoParent("command.argv[0]", command.argv(0));
}

absl::Status ValidateEnv(const v1::CommandSpec& command, size_t* total) {
  if (command.env_size() > kMaxCommandEnv) {
    return Invalid("command.env",
                   absl::StrCat("at most ", kMaxCommandEnv, " entries, got ", command.env_size()));
  }
  for (const auto& [name, value] : command.env()) {
    if (!ValidEnvName(name)) {
      return Invalid("command.env", absl::StrCat("name ", Quote(name),
                                                 " must match [A-Za-z_][A-Za-z0-9_]{0,255}"));
    }
    const std::string field = absl::StrCat("command.env.", name);
    if (command_env::IsReserved(name)) {
      return Invalid(field,
                     "aidn sets this variable for every rank (torchrun's contract or its own); "
                     "it cannot be overridden");
    }
    AIDN_RETURN_IF_ERROR(CheckString(field, value));
    *total += name.size() + value.size();
  }
  return absl::OkStatus();
}

// The built-in trainer's fields, which a command job must leave unset.
absl::Status CheckBuiltInFieldsUnset(const v1::JobSpec& spec) {
  struct Field {
    const char* name;
    bool set;
  };
  const Field fields[] = {
      {"model", spec.has_model()},
      {"dataset", spec.has_dataset()},
      {"optimizer", spec.has_optimizer()},
      {"lr_schedule", spec.has_lr_schedule()},
      {"batch_size", spec.batch_size() != 0},
      {"epochs", spec.epochs() != 0},
      {"max_steps", spec.max_steps() != 0},
      {"seed", spec.seed() != 0},
      {"strategy", spec.strategy() != v1::JobSpec::STRATEGY_UNSPECIFIED},
      {"fsdp", spec.has_fsdp()},
      {"parallel", spec.has_parallel()},
      {"ddp", spec.has_ddp()},
      {"bucket_mb", spec.has_bucket_mb()},
      {"grad_accum_steps", spec.grad_accum_steps() != 0},
      {"precision", spec.precision() != v1::JobSpec::PRECISION_UNSPECIFIED},
      {"comm_backend", spec.comm_backend() != v1::JobSpec::COMM_BACKEND_UNSPECIFIED},
      {"allow_tf32", spec.allow_tf32()},
      {"fast_convolutions", spec.fast_convolutions()},
      {"cuda_graphs", spec.cuda_graphs()},
      {"eval_every_steps", spec.eval_every_steps() != 0},
  };
  for (const Field& f : fields) {
    if (f.set) {
      return Invalid(f.name,
                     "configures the built-in trainer; a job with a command runs its own program "
                     "and must leave it unset");
    }
  }
  return absl::OkStatus();
}

}  // namespace

void ApplyCommandDefaults(v1::JobSpec* spec) {
  v1::CommandSpec* command = spec->mutable_command();
  if (command->store() == v1::CommandSpec::STORE_UNSPECIFIED) {
    command->set_store(v1::CommandSpec::AGENT);
  }
}

absl::Status ValidateCommandSpec(const v1::JobSpec& spec) {
  AIDN_RETURN_IF_ERROR(CheckBuiltInFieldsUnset(spec));
  const v1::CommandSpec& command = spec.command();
  size_t total = 0;
  AIDN_RETURN_IF_ERROR(ValidateArgv(command, &total));
  AIDN_RETURN_IF_ERROR(ValidateEnv(command, &total));
  if (total > kMaxCommandTotalBytes) {
    return Invalid("command", absl::StrCat("argv and env must be at most ", kMaxCommandTotalBytes,
                                           " bytes together, got ", total));
  }
  if (!command.working_dir().empty()) {
    AIDN_RETURN_IF_ERROR(CheckString("command.working_dir", command.working_dir()));
    AIDN_RETURN_IF_ERROR(CheckNoParent("command.working_dir", command.working_dir()));
  }
  if (!v1::CommandSpec::Store_IsValid(command.store()) ||
      command.store() == v1::CommandSpec::STORE_UNSPECIFIED) {
    return Invalid("command.store", absl::StrCat("must be AGENT or RANK0, got ", command.store()));
  }
  return absl::OkStatus();
}

}  // namespace aidn::coordinator
