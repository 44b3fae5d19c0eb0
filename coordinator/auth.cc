#include "coordinator/auth.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <fstream>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/log.h"
#include "common/status.h"
#include "common/token.h"

namespace aidn::coordinator {
namespace {

constexpr size_t kMinTokenLength = 16;

absl::StatusOr<std::string> ReadTokenFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) return PosixError(absl::StrCat("read ", path), errno);
  std::stringstream ss;
  ss << in.rdbuf();
  std::string token(absl::StripAsciiWhitespace(ss.str()));
  if (token.size() < kMinTokenLength) {
    return absl::FailedPreconditionError(
        absl::StrCat(path, ": token shorter than ", kMinTokenLength, " characters"));
  }
  return token;
}

// Reads the token at `path`, or writes a new random one there (mode 0600,
// created exclusively so two coordinators never overwrite each other's).
absl::StatusOr<std::string> LoadOrCreateToken(const std::string& path, bool* created) {
  *created = false;
  if (::access(path.c_str(), F_OK) == 0) return ReadTokenFile(path);
  AIDN_ASSIGN_OR_RETURN(std::string token, RandomHex(24));
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) return PosixError(absl::StrCat("create ", path), errno);
  const std::string line = token + "\n";
  ssize_t n = ::write(fd, line.data(), line.size());
  int write_errno = errno;
  if (::fsync(fd) != 0 && n == static_cast<ssize_t>(line.size())) {
    write_errno = errno;
    n = -1;
  }
  ::close(fd);
  if (n != static_cast<ssize_t>(line.size())) {
    ::unlink(path.c_str());
    return PosixError(absl::StrCat("write ", path), write_errno);
  }
  *created = true;
  return token;
}

absl::StatusOr<Role> ParseRole(absl::string_view text) {
  if (text == "admin") return Role::kAdmin;
  if (text == "user") return Role::kUser;
  if (text == "worker") return Role::kWorker;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown role \"", text, "\" (known: admin, user, worker)"));
}

}  // namespace

const char* RoleName(Role role) {
  switch (role) {
    case Role::kAdmin:
      return "admin";
    case Role::kUser:
      return "user";
    case Role::kWorker:
      return "worker";
    case Role::kTrainer:
      return "trainer";
  }
  return "?";
}

std::unique_ptr<Authenticator> Authenticator::CreateEmpty() {
  return std::unique_ptr<Authenticator>(new Authenticator());
}

absl::StatusOr<std::unique_ptr<Authenticator>> Authenticator::Create(const AuthOptions& options) {
  std::unique_ptr<Authenticator> auth(new Authenticator());
  auth->admin_token_path_ = options.state_dir + "/admin.token";
  auth->worker_token_path_ = options.state_dir + "/worker.token";
  bool created = false;
  AIDN_ASSIGN_OR_RETURN(std::string admin, LoadOrCreateToken(auth->admin_token_path_, &created));
  if (created) AIDN_LOG(INFO) << "wrote a new admin token" << Kv("path", auth->admin_token_path_);
  AIDN_ASSIGN_OR_RETURN(std::string worker, LoadOrCreateToken(auth->worker_token_path_, &created));
  if (created) {
    AIDN_LOG(INFO) << "wrote a new worker join token" << Kv("path", auth->worker_token_path_);
  }
  auth->AddToken(admin, Principal{Role::kAdmin, "admin", "", {}});
  auth->AddToken(worker, Principal{Role::kWorker, "worker", "", {}});

  if (!options.token_file.empty()) {
    std::ifstream in(options.token_file);
    if (!in) return PosixError(absl::StrCat("read token file ", options.token_file), errno);
    std::string line;
    int line_no = 0;
    while (std::getline(in, line)) {
      ++line_no;
      absl::string_view text = absl::StripAsciiWhitespace(line);
      if (text.empty() || text[0] == '#') continue;
      std::vector<std::string> fields =
          absl::StrSplit(text, absl::ByAnyChar(" \t"), absl::SkipEmpty());
      const std::string where = absl::StrCat(options.token_file, ":", line_no);
      std::vector<std::string> projects;
      if (fields.size() >= 3 && absl::StartsWith(fields.back(), "projects=")) {
        projects = absl::StrSplit(fields.back().substr(9), ',', absl::SkipEmpty());
        fields.pop_back();
        if (projects.empty()) {
          return absl::InvalidArgumentError(absl::StrCat(where, ": projects= names none"));
        }
      }
      if (fields.size() < 2 || fields.size() > 3) {
        return absl::InvalidArgumentError(
            absl::StrCat(where, ": expected \"<token> <role> [<name>] [projects=<p>,...]\""));
      }
      if (fields[0].size() < kMinTokenLength) {
        return absl::InvalidArgumentError(
            absl::StrCat(where, ": token shorter than ", kMinTokenLength, " characters"));
      }
      absl::StatusOr<Role> role = ParseRole(fields[1]);
      if (!role.ok()) return Annotate(role.status(), where);
      Principal p{*role, fields.size() == 3 ? fields[2] : fields[1], "", projects};
      auth->AddToken(fields[0], p);
    }
  }
  return auth;
}

absl::StatusOr<Principal> Authenticator::Authenticate(absl::string_view authorization) const {
  if (authorization.empty()) {
    return absl::UnauthenticatedError("missing bearer token (authorization metadata)");
  }
  constexpr absl::string_view kPrefix = "Bearer ";
  if (!absl::StartsWithIgnoreCase(authorization, kPrefix)) {
    return absl::UnauthenticatedError("authorization metadata must be \"Bearer <token>\"");
  }
  const std::string token(absl::StripAsciiWhitespace(authorization.substr(kPrefix.size())));
  absl::MutexLock lock(&mu_);
  auto it = tokens_.find(token);
  if (it == tokens_.end()) return absl::UnauthenticatedError("unknown or revoked token");
  return it->second;
}

void Authenticator::AddToken(const std::string& token, const Principal& principal) {
  absl::MutexLock lock(&mu_);
  tokens_[token] = principal;
}

void Authenticator::RemoveToken(const std::string& token) {
  absl::MutexLock lock(&mu_);
  tokens_.erase(token);
}

bool MayAccess(const Principal& p, const v1::Job& job) {
  if (p.role == Role::kAdmin) return true;
  if (p.role != Role::kUser) return false;
  if (job.owner() == p.name) return true;
  auto project = job.spec().labels().find(kProjectLabel);
  return project != job.spec().labels().end() &&
         std::find(p.projects.begin(), p.projects.end(), project->second) != p.projects.end();
}

absl::Status RequireAccess(const Principal& p, const v1::Job& job) {
  if (MayAccess(p, job)) return absl::OkStatus();
  auto project = job.spec().labels().find(kProjectLabel);
  return absl::PermissionDeniedError(absl::StrCat(
      job.id(), " belongs to ", job.owner().empty() ? "another user" : job.owner(),
      project == job.spec().labels().end() ? "" : absl::StrCat(" (project ", project->second, ")"),
      "; ", p.name, " may use its own jobs",
      p.projects.empty()
          ? ""
          : absl::StrCat(" and those of projects ", absl::StrJoin(p.projects, ", "))));
}

absl::Status RequireUser(const Principal& p) {
  if (p.role == Role::kAdmin || p.role == Role::kUser) return absl::OkStatus();
  return absl::PermissionDeniedError(
      absl::StrCat("a ", RoleName(p.role), " token may not use the user API"));
}

absl::Status RequireAdmin(const Principal& p) {
  if (p.role == Role::kAdmin) return absl::OkStatus();
  return absl::PermissionDeniedError(absl::StrCat(
      "only an admin token may operate workers; this is a ", RoleName(p.role), " token"));
}

absl::Status RequireWorker(const Principal& p) {
  if (p.role == Role::kAdmin || p.role == Role::kWorker) return absl::OkStatus();
  return absl::PermissionDeniedError(
      absl::StrCat("a ", RoleName(p.role), " token may not act as a worker"));
}

absl::Status RequireTrainerOf(const Principal& p, const std::string& job_id) {
  if (p.role == Role::kAdmin || p.role == Role::kWorker) return absl::OkStatus();
  if (p.role == Role::kTrainer && p.job_id == job_id) return absl::OkStatus();
  if (p.role == Role::kTrainer) {
    return absl::PermissionDeniedError(
        absl::StrCat("this trainer token belongs to ", p.job_id, ", not ", job_id));
  }
  return absl::PermissionDeniedError(
      absl::StrCat("a ", RoleName(p.role), " token may not make trainer calls"));
}

}  // namespace aidn::coordinator
