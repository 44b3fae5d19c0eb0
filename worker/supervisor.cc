#include "worker/supervisor.h"

#include <fcntl.h>
#include <grp.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <filesystem>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/log.h"
#include "common/status.h"

#ifndef CLOSE_RANGE_CLOEXEC
#define CLOSE_RANGE_CLOEXEC (1U << 2)
#endif

extern char** environ;

namespace aidn::worker {
namespace {

// The daemon's environment with `overrides` ("K=V") added or replacing the
// entries with the same key.
std::vector<std::string> MergedEnvironment(const std::vector<std::string>& overrides) {
  std::vector<std::string> env;
  for (char** e = environ; e != nullptr && *e != nullptr; ++e) env.emplace_back(*e);
  for (const std::string& entry : overrides) {
    const std::string key = entry.substr(0, entry.find('=') + 1);  // "K="
    auto same_key = [&key](const std::string& existing) {
      return existing.compare(0, key.size(), key) == 0;
    };
    env.erase(std::remove_if(env.begin(), env.end(), same_key), env.end());
    env.push_back(entry);
  }
  return env;
}

std::vector<char*> CStrings(std::vector<std::string>& strings) {
  std::vector<char*> out;
  out.reserve(strings.size() + 1);
  for (std::string& s : strings) out.push_back(s.data());
  out.push_back(nullptr);
  return out;
}

void CloseIfOpen(int fd) {
  if (fd >= 0) close(fd);
}

// What the child reports through the error pipe when it cannot exec.
struct ExecFailure {
  enum Stage : int { kNone = 0, kChdir, kSetUser, kMkdir, kExec };
  int stage = kNone;
  int error = 0;
};

[[noreturn]] void ReportFailure(int fd, ExecFailure::Stage stage, int error) {
  const ExecFailure failure{stage, error};
  ssize_t ignored = write(fd, &failure, sizeof(failure));
  (void)ignored;
  _exit(127);
}

struct ExecPlan {
  const char* program;
  char* const* argv;
  char* const* envp;
  const char* cwd;  // null: stay
  const ChildSpec::RunAs* run_as;
  // Every prefix of every make_dirs entry, parents first.
  const std::vector<std::string>* mkdirs;
  const char* remove_file;  // null: none
};

// "/a/b/c" -> "/a", "/a/b", "/a/b/c": what `mkdir -p` creates, in order.
std::vector<std::string> DirPrefixes(const std::vector<std::string>& dirs) {
  std::vector<std::string> prefixes;
  for (const std::string& dir : dirs) {
    for (size_t i = 1; i <= dir.size(); ++i) {
      if (i == dir.size() || dir[i] == '/') prefixes.push_back(dir.substr(0, i));
    }
  }
  return prefixes;
}

// Runs in the forked child: only async-signal-safe calls until execve (the
// daemon has gRPC threads, whose locks may be held by threads that do not
// exist in the child). Never returns.
[[noreturn]] void ExecChild(pid_t parent, int log_fd, int null_fd, int error_fd,
                            const ExecPlan& plan) {
  // Its own process group, so that a stop reaches whatever it spawns.
  setpgid(0, 0);
  // Die with the daemon. The parent may have died before prctl took effect:
  // then we were re-parented and must go at once.
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (getppid() != parent) _exit(127);

  dup2(null_fd, STDIN_FILENO);
  dup2(log_fd, STDOUT_FILENO);
  dup2(log_fd, STDERR_FILENO);
  for (int fd = 0; fd <= 2; ++fd) fcntl(fd, F_SETFD, 0);
  // Nothing else the daemon holds (gRPC sockets, other children's log files)
  // leaks into the child: mark every other descriptor close-on-exec (Linux
  // 5.11+; on older kernels the call fails and only O_CLOEXEC protects). The
  // error pipe is CLOEXEC already and still works if exec fails.
  syscall(SYS_close_range, 3U, ~0U, CLOSE_RANGE_CLOEXEC);

  // The daemon blocks SIGTERM and SIGINT (it takes them with sigwait) and
  // gRPC ignores SIGPIPE; a trainer must start from the defaults.
  struct sigaction dfl = {};
  dfl.sa_handler = SIG_DFL;
  sigemptyset(&dfl.sa_mask);
  for (int sig = 1; sig < NSIG; ++sig) {
    if (sig != SIGKILL && sig != SIGSTOP) sigaction(sig, &dfl, nullptr);
  }
  sigset_t none;
  sigemptyset(&none);
  sigprocmask(SIG_SETMASK, &none, nullptr);

  if (plan.run_as != nullptr) {
    // Group first: after setuid there is no right left to change it.
    if (setgroups(0, nullptr) != 0 || setgid(plan.run_as->gid) != 0 ||
        setuid(plan.run_as->uid) != 0) {
      ReportFailure(error_fd, ExecFailure::kSetUser, errno);
    }
    // A change of credentials clears the parent-death signal: set it again.
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(127);
  }
  for (const std::string& dir : *plan.mkdirs) {
    if (mkdir(dir.c_str(), 0755) != 0 && errno != EEXIST) {
      ReportFailure(error_fd, ExecFailure::kMkdir, errno);
    }
  }
  if (plan.remove_file != nullptr) unlink(plan.remove_file);
  if (plan.cwd != nullptr && chdir(plan.cwd) != 0) {
    ReportFailure(error_fd, ExecFailure::kChdir, errno);
  }
  execve(plan.program, plan.argv, plan.envp);
  ReportFailure(error_fd, ExecFailure::kExec, errno);
}

ExecFailure ReadExecFailure(int fd) {
  ExecFailure failure;
  ssize_t n;
  do {
    n = read(fd, &failure, sizeof(failure));
  } while (n < 0 && errno == EINTR);
  return n == static_cast<ssize_t>(sizeof(failure)) ? failure : ExecFailure{};
}

absl::Status ExecFailureStatus(const ExecFailure& failure, const std::string& program,
                               const ChildSpec& spec) {
  switch (failure.stage) {
    case ExecFailure::kChdir:
      return PosixError(absl::StrCat("working directory ", spec.cwd), failure.error);
    case ExecFailure::kMkdir:
      return PosixError("creating the process's directories", failure.error);
    case ExecFailure::kSetUser:
      return PosixError(
          absl::StrCat("switching to uid ", spec.run_as->uid, " gid ", spec.run_as->gid),
          failure.error);
    default:
      return PosixError(absl::StrCat("exec ", program), failure.error);
  }
}

// The PATH of the child's environment, or the default execvp uses.
std::string PathOf(const std::vector<std::string>& env) {
  for (const std::string& entry : env) {
    if (entry.rfind("PATH=", 0) == 0) return entry.substr(5);
  }
  return "/usr/local/bin:/usr/bin:/bin";
}

void WaitBlocking(pid_t pid, int* status) {
  while (waitpid(pid, status, 0) < 0 && errno == EINTR) {
  }
}

}  // namespace

Supervisor::Supervisor(SupervisorOptions options)
    : options_(std::move(options)),
      clock_(options_.clock != nullptr ? options_.clock : Clock::Real()) {}

Supervisor::~Supervisor() {
  absl::MutexLock lock(&mu_);
  for (auto& [id, child] : children_) {
    kill(-child.pid, SIGKILL);
    int status = 0;
    WaitBlocking(child.pid, &status);
    AIDN_LOG(WARNING) << "killed child at shutdown" << Kv("child", id) << Kv("pid", child.pid);
  }
  children_.clear();
}

absl::StatusOr<std::string> FindProgram(const std::string& program, const std::string& path) {
  if (program.empty()) return absl::InvalidArgumentError("program: empty");
  if (program.find('/') != std::string::npos) return program;
  for (absl::string_view dir : absl::StrSplit(path, ':')) {
    // An empty entry means the current directory, as for execvp.
    const std::string candidate = absl::StrCat(dir.empty() ? "." : dir, "/", program);
    struct stat st = {};
    if (stat(candidate.c_str(), &st) == 0 && S_ISREG(st.st_mode) &&
        access(candidate.c_str(), X_OK) == 0) {
      return candidate;
    }
  }
  return absl::NotFoundError(
      absl::StrCat("program \"", program, "\" not found on PATH (", path, ")"));
}

absl::StatusOr<Supervisor::ChildId> Supervisor::Start(const ChildSpec& spec) {
  if (spec.argv.empty()) return absl::InvalidArgumentError("argv: empty");
  if (spec.log_path.empty()) return absl::InvalidArgumentError("log_path: empty");
  const std::filesystem::path parent_dir = std::filesystem::path(spec.log_path).parent_path();
  if (!parent_dir.empty()) {
    std::error_code error;
    std::filesystem::create_directories(parent_dir, error);
    if (error) {
      return absl::InternalError(
          absl::StrCat("mkdir ", parent_dir.string(), ": ", error.message()));
    }
  }

  // Everything the child needs is prepared before fork.
  std::vector<std::string> env_strings = MergedEnvironment(spec.env);
  AIDN_ASSIGN_OR_RETURN(
      const std::string program,
      FindProgram(spec.program.empty() ? spec.argv[0] : spec.program, PathOf(env_strings)));
  std::vector<std::string> argv_strings = spec.argv;
  std::vector<char*> child_argv = CStrings(argv_strings);
  std::vector<char*> child_env = CStrings(env_strings);
  const std::vector<std::string> mkdirs = DirPrefixes(spec.make_dirs);

  const int log_fd = open(spec.log_path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (log_fd < 0) return PosixError(spec.log_path, errno);
  const int null_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
  if (null_fd < 0) {
    const int error = errno;
    close(log_fd);
    return PosixError("/dev/null", error);
  }
  // The child writes errno here if exec fails; a successful exec closes it.
  int exec_pipe[2];
  if (pipe2(exec_pipe, O_CLOEXEC) != 0) {
    const int error = errno;
    close(log_fd);
    close(null_fd);
    return PosixError("pipe2", error);
  }

  absl::MutexLock lock(&mu_);
  const pid_t self = getpid();
  const pid_t pid = fork();
  if (pid == 0) {
    const ExecPlan plan{
        .program = program.c_str(),
        .argv = child_argv.data(),
        .envp = child_env.data(),
        .cwd = spec.cwd.empty() ? nullptr : spec.cwd.c_str(),
        .run_as = spec.run_as ? &*spec.run_as : nullptr,
        .mkdirs = &mkdirs,
        .remove_file = spec.remove_file.empty() ? nullptr : spec.remove_file.c_str()};
    ExecChild(self, log_fd, null_fd, exec_pipe[1], plan);
  }
  const int fork_error = errno;
  close(exec_pipe[1]);
  CloseIfOpen(log_fd);
  CloseIfOpen(null_fd);
  if (pid < 0) {
    close(exec_pipe[0]);
    return PosixError("fork", fork_error);
  }
  // Also here, so the group exists whichever of the two runs first (EACCES
  // once the child has exec'd, harmless: it did it itself).
  setpgid(pid, pid);
  const ExecFailure failure = ReadExecFailure(exec_pipe[0]);
  close(exec_pipe[0]);
  if (failure.stage != ExecFailure::kNone) {
    int status = 0;
    WaitBlocking(pid, &status);
    return ExecFailureStatus(failure, program, spec);
  }

  const ChildId id = next_id_++;
  Child& child = children_[id];
  child.pid = pid;
  child.log_path = spec.log_path;
  AIDN_LOG(DEBUG) << "child started" << Kv("child", id) << Kv("pid", pid) << Kv("program", program)
                  << Kv("log", spec.log_path);
  return id;
}

absl::Status Supervisor::Stop(ChildId id, std::chrono::milliseconds grace) {
  absl::MutexLock lock(&mu_);
  auto it = children_.find(id);
  if (it == children_.end()) {
    return absl::NotFoundError(absl::StrCat("child ", id, " is not running"));
  }
  Child& child = it->second;
  const Clock::TimePoint kill_at = clock_->Now() + grace;
  if (!child.stopping) {
    child.stopping = true;
    child.kill_at = kill_at;
    kill(-child.pid, SIGTERM);
  } else {
    child.kill_at = std::min(child.kill_at, kill_at);
  }
  if (grace.count() <= 0 && !child.killed) {
    kill(-child.pid, SIGKILL);
    child.killed = true;
    child.killed_at = clock_->Now();
  }
  return absl::OkStatus();
}

std::vector<ChildExit> Supervisor::Reap() {
  std::vector<ChildExit> exits;
  absl::MutexLock lock(&mu_);
  const Clock::TimePoint now = clock_->Now();
  abandoned_.erase(std::remove_if(abandoned_.begin(), abandoned_.end(),
                                  [](pid_t pid) {
                                    int status = 0;
                                    return waitpid(pid, &status, WNOHANG) != 0;
                                  }),
                   abandoned_.end());
  for (auto it = children_.begin(); it != children_.end();) {
    Child& child = it->second;
    siginfo_t info = {};
    // WNOWAIT: the zombie keeps its pid (and so its group id) reserved while
    // what is left of the group is killed below.
    const int r = waitid(P_PID, child.pid, &info, WEXITED | WNOHANG | WNOWAIT);
    const bool ended = r == 0 && info.si_pid == child.pid;
    const bool lost = r < 0 && errno == ECHILD;
    if (!ended && !lost) {
      if (child.stopping && !child.killed && now >= child.kill_at) {
        AIDN_LOG(WARNING) << "child ignored SIGTERM for its grace period; sending SIGKILL"
                          << Kv("child", it->first) << Kv("pid", child.pid);
        kill(-child.pid, SIGKILL);
        child.killed = true;
        child.killed_at = now;
      }
      if (child.killed && now - child.killed_at >= options_.kill_timeout) {
        AIDN_LOG(ERROR) << "child has not ended after SIGKILL (stuck in the kernel?); "
                           "reporting it as ended and reaping it when it does"
                        << Kv("child", it->first) << Kv("pid", child.pid)
                        << Kv("kill_timeout_ms", options_.kill_timeout.count());
        ChildExit exit;
        exit.id = it->first;
        exit.pid = child.pid;
        exit.signal = SIGKILL;
        exit.stopped = child.stopping;
        exit.killed_after_grace = true;
        exit.abandoned = true;
        exit.log_tail = LogTail(child.log_path);
        exits.push_back(std::move(exit));
        abandoned_.push_back(child.pid);
        it = children_.erase(it);
        continue;
      }
      ++it;
      continue;
    }
    ChildExit exit;
    exit.id = it->first;
    exit.pid = child.pid;
    exit.stopped = child.stopping;
    exit.killed_after_grace = child.killed;
    if (ended) {
      kill(-child.pid, SIGKILL);
      int status = 0;
      WaitBlocking(child.pid, &status);
      if (WIFEXITED(status)) exit.exit_code = WEXITSTATUS(status);
      if (WIFSIGNALED(status)) exit.signal = WTERMSIG(status);
    } else {
      // Reaped by someone else (SIGCHLD set to SIG_IGN, say): how it ended
      // is unknown.
      exit.exit_code = -1;
    }
    exit.log_tail = LogTail(child.log_path);
    exits.push_back(std::move(exit));
    it = children_.erase(it);
  }
  return exits;
}

std::vector<ChildExit> Supervisor::StopAllAndWait(std::chrono::milliseconds grace,
                                                  std::chrono::milliseconds poll) {
  std::vector<ChildId> ids;
  for (const ChildStatus& child : Running()) ids.push_back(child.id);
  for (ChildId id : ids) Stop(id, grace).IgnoreError();  // NOT_FOUND: it ended meanwhile
  std::vector<ChildExit> exits;
  while (true) {
    for (ChildExit& e : Reap()) exits.push_back(std::move(e));
    {
      absl::MutexLock lock(&mu_);
      if (children_.empty()) break;
    }
    std::this_thread::sleep_for(poll);
  }
  return exits;
}

std::vector<ChildStatus> Supervisor::Running() const {
  absl::MutexLock lock(&mu_);
  std::vector<ChildStatus> running;
  running.reserve(children_.size());
  for (const auto& [id, child] : children_) {
    running.push_back({.id = id, .pid = child.pid, .stopping = child.stopping});
  }
  return running;
}

std::string Supervisor::LogTail(const std::string& path) const {
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return "";
  struct stat st = {};
  std::string data;
  if (fstat(fd, &st) == 0 && st.st_size > 0) {
    const off_t size = st.st_size;
    const off_t want = std::min<off_t>(size, static_cast<off_t>(options_.log_tail_max_bytes));
    data.resize(static_cast<size_t>(want));
    const ssize_t n = pread(fd, data.data(), data.size(), size - want);
    data.resize(n > 0 ? static_cast<size_t>(n) : 0);
    // A read that starts mid-file starts mid-line: drop that partial line.
    if (want < size) {
      const size_t newline = data.find('\n');
      data = newline == std::string::npos ? "" : data.substr(newline + 1);
    }
  }
  close(fd);
  std::vector<std::string> lines = absl::StrSplit(data, '\n');
  while (!lines.empty() && lines.back().empty()) lines.pop_back();
  const size_t keep = static_cast<size_t>(std::max(0, options_.log_tail_lines));
  if (lines.size() > keep) lines.erase(lines.begin(), lines.end() - keep);
  return absl::StrJoin(lines, "\n");
}

}  // namespace aidn::worker
