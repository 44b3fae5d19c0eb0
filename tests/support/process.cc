#include "tests/support/process.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>
#include <cstdlib>

#include <cerrno>
#include <cstring>
#include <sstream>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/status.h"

extern char** environ;

namespace aidn::testing {
namespace {

// The environment of the test with `overrides` ("K=V") added or replacing
// the entries with the same key.
std::vector<std::string> MergedEnvironment(const std::vector<std::string>& overrides) {
  std::vector<std::string> env;
  for (char** e = environ; e != nullptr && *e != nullptr; ++e) env.emplace_back(*e);
  for (const std::string& entry : overrides) {
    const std::string key = entry.substr(0, entry.find('=') + 1);  // "K="
    bool replaced = false;
    for (std::string& existing : env) {
      if (existing.compare(0, key.size(), key) == 0) {
        existing = entry;
        replaced = true;
        break;
      }
    }
    if (!replaced) env.push_back(entry);
  }
  return env;
}

// The path execve should run: `program` itself if it names a path, else the
// first executable match on $PATH (resolved before fork, where allocating is
// still allowed).
std::string ResolveProgram(const std::string& program, const std::vector<std::string>& env) {
  if (program.find('/') != std::string::npos) return program;
  std::string path = "/usr/local/bin:/usr/bin:/bin";
  for (const std::string& entry : env) {
    if (entry.rfind("PATH=", 0) == 0) path = entry.substr(5);
  }
  std::stringstream dirs(path);
  std::string dir;
  while (std::getline(dirs, dir, ':')) {
    if (dir.empty()) dir = ".";
    std::string candidate = dir + "/" + program;
    if (access(candidate.c_str(), X_OK) == 0) return candidate;
  }
  return program;
}

std::vector<char*> CStrings(std::vector<std::string>& strings) {
  std::vector<char*> out;
  out.reserve(strings.size() + 1);
  for (std::string& s : strings) out.push_back(s.data());
  out.push_back(nullptr);
  return out;
}

int ExitCodeOf(int wait_status) {
  if (WIFEXITED(wait_status)) return WEXITSTATUS(wait_status);
  if (WIFSIGNALED(wait_status)) return 128 + WTERMSIG(wait_status);
  return -1;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Process>> Process::Start(const std::vector<std::string>& argv,
                                                        const std::vector<std::string>& env,
                                                        const std::string& stdout_path,
                                                        const std::string& stderr_path) {
  if (argv.empty()) return absl::InvalidArgumentError("Process::Start: empty argv");

  // Everything the child needs is prepared here: between fork and exec only
  // async-signal-safe calls are allowed (the test binary runs gRPC threads).
  std::vector<std::string> env_strings = MergedEnvironment(env);
  std::vector<std::string> argv_strings = argv;
  const std::string program = ResolveProgram(argv[0], env_strings);
  std::vector<char*> child_argv = CStrings(argv_strings);
  std::vector<char*> child_env = CStrings(env_strings);

  const int out_fd = open(stdout_path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (out_fd < 0) return PosixError(stdout_path, errno);
  const int err_fd = open(stderr_path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (err_fd < 0) {
    const int error = errno;
    close(out_fd);
    return PosixError(stderr_path, error);
  }
  const int null_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
  // The child writes errno here if exec fails; a successful exec closes it.
  int exec_pipe[2];
  if (pipe2(exec_pipe, O_CLOEXEC) != 0) {
    const int error = errno;
    close(out_fd);
    close(err_fd);
    if (null_fd >= 0) close(null_fd);
    return PosixError("pipe2", error);
  }

  const pid_t parent = getpid();
  const pid_t pid = fork();
  if (pid < 0) {
    const int error = errno;
    close(out_fd);
    close(err_fd);
    if (null_fd >= 0) close(null_fd);
    close(exec_pipe[0]);
    close(exec_pipe[1]);
    return PosixError("fork", error);
  }
  if (pid == 0) {
    // Child. Nothing must outlive a crashed test: die with the parent.
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(127);
    setpgid(0, 0);
    // Undo any signal dispositions and mask inherited from the test.
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, nullptr);
    signal(SIGPIPE, SIG_DFL);
    if (null_fd >= 0) dup2(null_fd, STDIN_FILENO);
    dup2(out_fd, STDOUT_FILENO);
    dup2(err_fd, STDERR_FILENO);
    execve(program.c_str(), child_argv.data(), child_env.data());
    const int error = errno;
    ssize_t ignored = write(exec_pipe[1], &error, sizeof(error));
    (void)ignored;
    _exit(127);
  }

  // Parent. Set the group here too, so that it exists before Start returns
  // whichever of the two runs first.
  setpgid(pid, pid);
  close(out_fd);
  close(err_fd);
  if (null_fd >= 0) close(null_fd);
  close(exec_pipe[1]);
  int exec_errno = 0;
  ssize_t n;
  do {
    n = read(exec_pipe[0], &exec_errno, sizeof(exec_errno));
  } while (n < 0 && errno == EINTR);
  close(exec_pipe[0]);
  if (n == static_cast<ssize_t>(sizeof(exec_errno))) {
    int status;
    waitpid(pid, &status, 0);
    return PosixError(absl::StrCat("exec ", program), exec_errno);
  }
  return std::unique_ptr<Process>(new Process(pid, stdout_path, stderr_path));
}

Process::Process(pid_t pid, std::string stdout_path, std::string stderr_path)
    : pid_(pid), stdout_path_(std::move(stdout_path)), stderr_path_(std::move(stderr_path)) {}

Process::~Process() {
  // The whole group: a child that spawned processes of its own takes them
  // along. Once the group is empty this fails with ESRCH, harmlessly.
  kill(-pid_, SIGKILL);
  if (!reaped_) {
    int status;
    while (waitpid(pid_, &status, 0) < 0 && errno == EINTR) {
    }
    reaped_ = true;
  }
}

void Process::Signal(int sig) {
  if (!reaped_) kill(pid_, sig);
}

absl::StatusOr<int> Process::Wait(std::chrono::milliseconds timeout) {
  absl::Status error;
  WaitFor(
      [&] {
        if (reaped_) return true;
        int status;
        const pid_t r = waitpid(pid_, &status, WNOHANG);
        if (r == pid_) {
          reaped_ = true;
          exit_code_ = ExitCodeOf(status);
          return true;
        }
        if (r < 0 && errno != EINTR) {
          error = PosixError(absl::StrCat("waitpid ", pid_), errno);
          return true;
        }
        return false;
      },
      timeout);
  if (!error.ok()) return error;
  if (!reaped_) {
    return absl::DeadlineExceededError(
        absl::StrCat("process ", pid_, " still running after ", timeout.count(), " ms"));
  }
  return exit_code_;
}

bool Process::Running() { return !Wait(std::chrono::milliseconds(0)).ok() && !reaped_; }

std::string Process::Stdout() const { return ReadFileOrEmpty(stdout_path_); }
std::string Process::Stderr() const { return ReadFileOrEmpty(stderr_path_); }

CommandResult RunCommand(const std::vector<std::string>& argv, const std::vector<std::string>& env,
                         std::chrono::milliseconds timeout) {
  CommandResult result;
  const std::string dir = MakeTempDir("aidn-cmd");
  const std::string out_path = dir + "/stdout";
  const std::string err_path = dir + "/stderr";
  auto process = Process::Start(argv, env, out_path, err_path);
  if (!process.ok()) {
    result.err = process.status().ToString();
    RemoveTree(dir);
    return result;
  }
  absl::StatusOr<int> code = (*process)->Wait(timeout);
  if (!code.ok()) {
    // Timed out: kill it (and its group) and report how it ended.
    kill(-(*process)->pid(), SIGKILL);
    code = (*process)->Wait(std::chrono::seconds(30));
  }
  result.exit_code = code.ok() ? *code : -1;
  process->reset();
  result.out = ReadFileOrEmpty(out_path);
  result.err = ReadFileOrEmpty(err_path);
  RemoveTree(dir);
  return result;
}

std::vector<pid_t> ProcessesWith(const std::vector<std::string>& needles) {
  std::vector<pid_t> found;
  DIR* proc = opendir("/proc");
  if (proc == nullptr) return found;
  while (dirent* entry = readdir(proc)) {
    const pid_t pid = static_cast<pid_t>(std::atoi(entry->d_name));
    if (pid <= 0 || pid == getpid()) continue;
    std::string cmdline = ReadFileOrEmpty(absl::StrCat("/proc/", pid, "/cmdline"));
    for (char& c : cmdline) {
      if (c == '\0') c = ' ';
    }
    const std::string status = ReadFileOrEmpty(absl::StrCat("/proc/", pid, "/status"));
    if (absl::StrContains(status, "State:\tZ")) continue;
    bool all = true;
    for (const std::string& needle : needles) all = all && absl::StrContains(cmdline, needle);
    if (all) found.push_back(pid);
  }
  closedir(proc);
  return found;
}

char ProcessState(pid_t pid) {
  // "pid (comm) S ...": the command may hold spaces and parentheses.
  const std::string stat = ReadFileOrEmpty(absl::StrCat("/proc/", pid, "/stat"));
  const size_t paren = stat.rfind(')');
  if (paren == std::string::npos || paren + 2 >= stat.size()) return '\0';
  return stat[paren + 2];
}

bool IsDead(pid_t pid) {
  if (kill(pid, 0) != 0 && errno == ESRCH) return true;
  const char state = ProcessState(pid);
  return state == '\0' || state == 'Z';
}

bool PythonHasTorch() {
  return std::system("/usr/bin/python3 -c 'import torch' >/dev/null 2>&1") == 0;
}

}  // namespace aidn::testing
