#ifndef AIDN_TESTS_SUPPORT_PROCESS_H_
#define AIDN_TESTS_SUPPORT_PROCESS_H_

// Child processes for tests: real binaries started in their own process
// group, commands run to completion, and a look through /proc for processes
// a test left behind. Wait for their states with WaitFor (wait.h).

#include <sys/types.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "tests/support/files.h"
#include "tests/support/wait.h"

namespace aidn::testing {

// A child process in its own process group, stdout and stderr redirected to
// files (appended to; both may name the same file). The child is SIGKILLed if
// the thread that started it dies. The destructor SIGKILLs the group and
// reaps the child if still running. Not thread-safe.
class Process {
 public:
  // argv[0] is the program path. `env` entries ("K=V") are added to (or
  // replace in) the test's environment.
  static absl::StatusOr<std::unique_ptr<Process>> Start(const std::vector<std::string>& argv,
                                                        const std::vector<std::string>& env,
                                                        const std::string& stdout_path,
                                                        const std::string& stderr_path);
  ~Process();
  Process(const Process&) = delete;
  Process& operator=(const Process&) = delete;

  pid_t pid() const { return pid_; }
  // Sends `sig` to the child (not its group).
  void Signal(int sig);
  // Waits for exit up to `timeout`. The exit code, or 128 + signal number if
  // it was killed; DEADLINE_EXCEEDED if still running.
  absl::StatusOr<int> Wait(std::chrono::milliseconds timeout);
  bool Running();
  std::string Stdout() const;
  std::string Stderr() const;

 private:
  Process(pid_t pid, std::string stdout_path, std::string stderr_path);
  pid_t pid_;
  bool reaped_ = false;
  int exit_code_ = -1;
  std::string stdout_path_;
  std::string stderr_path_;
};

struct CommandResult {
  int exit_code = -1;  // 128 + signal if killed; -1 if it could not start
  std::string out;
  std::string err;
};

// Runs a command to completion, killing it after `timeout`.
CommandResult RunCommand(const std::vector<std::string>& argv,
                         const std::vector<std::string>& env = {},
                         std::chrono::milliseconds timeout = std::chrono::seconds(30));

// PIDs of live (not zombie) processes other than this one whose command line
// (arguments joined by spaces) contains every one of `needles`. Tests that
// run beside each other share job ids ("job-1"): pass the test's own
// directory as one of the needles.
std::vector<pid_t> ProcessesWith(const std::vector<std::string>& needles);

// The state letter of /proc/<pid>/stat ('R', 'S', 'T' for stopped, 'Z' for
// a zombie...), or '\0' if there is no such process.
char ProcessState(pid_t pid);
// Gone, or a zombie (dead, waiting for some parent to reap it).
bool IsDead(pid_t pid);

// Whether Debian's /usr/bin/python3 can import torch (python3-torch), for
// the tests that use PyTorch as their oracle and skip without it.
bool PythonHasTorch();

}  // namespace aidn::testing

#endif  // AIDN_TESTS_SUPPORT_PROCESS_H_
