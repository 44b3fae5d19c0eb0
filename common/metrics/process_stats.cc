#include "common/metrics/process_stats.h"

#include <dirent.h>
#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <string>
#include <string_view>
#include <vector>

#include "absl/base/const_init.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "common/metrics/registry.h"
#include "common/status.h"

namespace aidn::metrics {
namespace {

// Reads a whole /proc file. stat(2) reports size 0 for these, so read until
// EOF rather than by size.
absl::StatusOr<std::string> ReadProcFile(const std::string& path) {
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return PosixError(path, errno);
  std::string content;
  char buf[4096];
  while (true) {
    const ssize_t n = read(fd, buf, sizeof(buf));
    if (n == 0) break;
    if (n < 0) {
      if (errno == EINTR) continue;
      const int error = errno;
      close(fd);
      // ESRCH: the process went away between open and read.
      return error == ESRCH ? absl::NotFoundError(absl::StrCat(path, ": process is gone"))
                            : PosixError(path, error);
    }
    content.append(buf, static_cast<size_t>(n));
  }
  close(fd);
  return content;
}

// The system boot time (seconds since the epoch), from /proc/stat's "btime"
// line. It does not change while we run, so it is read once.
absl::StatusOr<int64_t> BootTimeSeconds() {
  static const absl::StatusOr<int64_t>* const boot_time = [] {
    auto content = ReadProcFile("/proc/stat");
    if (!content.ok()) return new absl::StatusOr<int64_t>(content.status());
    for (absl::string_view line : absl::StrSplit(*content, '\n')) {
      if (!absl::ConsumePrefix(&line, "btime ")) continue;
      int64_t btime = 0;
      if (absl::SimpleAtoi(line, &btime)) return new absl::StatusOr<int64_t>(btime);
      break;
    }
    return new absl::StatusOr<int64_t>(absl::InternalError("/proc/stat: no btime line"));
  }();
  return *boot_time;
}

// Counts the entries of /proc/<pid>/fd: -1 when the directory cannot be
// read (another user's process), NOT_FOUND when the process is gone.
absl::StatusOr<int64_t> CountOpenFds(const std::string& proc_dir) {
  const std::string path = proc_dir + "/fd";
  DIR* dir = opendir(path.c_str());
  if (dir == nullptr) {
    if (errno == ENOENT) return PosixError(path, errno);
    return -1;
  }
  int64_t count = 0;
  while (const dirent* entry = readdir(dir)) {
    const std::string_view name = entry->d_name;
    if (name != "." && name != "..") ++count;
  }
  closedir(dir);
  return count;
}

}  // namespace

absl::StatusOr<ProcessStats> ReadProcessStats(pid_t pid) {
  if (pid < 0) return absl::InvalidArgumentError(absl::StrCat("invalid pid ", pid));
  const std::string proc_dir = pid == 0 ? "/proc/self" : absl::StrCat("/proc/", pid);

  AIDN_ASSIGN_OR_RETURN(const std::string stat, ReadProcFile(proc_dir + "/stat"));
  // "pid (comm) state ppid ...": comm may hold spaces and ')' itself, so the
  // fields proper start after the LAST ')'.
  const size_t paren = stat.rfind(')');
  if (paren == std::string::npos) {
    return absl::InternalError(absl::StrCat(proc_dir, "/stat: no ')' in \"", stat, "\""));
  }
  const std::vector<absl::string_view> fields =
      absl::StrSplit(absl::string_view(stat).substr(paren + 1), ' ', absl::SkipWhitespace());
  // fields[0] is field 3 of proc(5) (state), so field N is fields[N - 3].
  constexpr size_t kUtime = 14 - 3, kStime = 15 - 3, kNumThreads = 20 - 3, kStartTime = 22 - 3,
                   kVsize = 23 - 3;
  uint64_t utime = 0, stime = 0, start_ticks = 0, vsize = 0;
  int64_t threads = 0;
  if (fields.size() <= kVsize || !absl::SimpleAtoi(fields[kUtime], &utime) ||
      !absl::SimpleAtoi(fields[kStime], &stime) ||
      !absl::SimpleAtoi(fields[kNumThreads], &threads) ||
      !absl::SimpleAtoi(fields[kStartTime], &start_ticks) ||
      !absl::SimpleAtoi(fields[kVsize], &vsize)) {
    return absl::InternalError(absl::StrCat(proc_dir, "/stat: cannot parse \"", stat, "\""));
  }

  AIDN_ASSIGN_OR_RETURN(const std::string statm, ReadProcFile(proc_dir + "/statm"));
  // "size resident shared text lib data dt", in pages.
  const std::vector<absl::string_view> pages = absl::StrSplit(statm, ' ', absl::SkipWhitespace());
  int64_t resident_pages = 0;
  if (pages.size() < 2 || !absl::SimpleAtoi(pages[1], &resident_pages)) {
    return absl::InternalError(absl::StrCat(proc_dir, "/statm: cannot parse \"", statm, "\""));
  }

  AIDN_ASSIGN_OR_RETURN(const int64_t open_fds, CountOpenFds(proc_dir));
  AIDN_ASSIGN_OR_RETURN(const int64_t boot_time, BootTimeSeconds());

  const double ticks_per_second = static_cast<double>(sysconf(_SC_CLK_TCK));
  ProcessStats stats;
  stats.cpu_seconds = static_cast<double>(utime + stime) / ticks_per_second;
  stats.resident_bytes = resident_pages * static_cast<int64_t>(sysconf(_SC_PAGESIZE));
  stats.virtual_bytes = static_cast<int64_t>(vsize);
  stats.open_fds = open_fds;
  stats.start_time_seconds =
      static_cast<double>(boot_time) + static_cast<double>(start_ticks) / ticks_per_second;
  stats.threads = threads;
  return stats;
}

void AddProcessMetrics(Registry* registry) {
  Counter& cpu = registry
                     ->AddCounter("process_cpu_seconds_total",
                                  "Total user and system CPU time spent in seconds.")
                     .Add({});
  Gauge& resident =
      registry->AddGauge("process_resident_memory_bytes", "Resident memory size in bytes.").Add({});
  Gauge& virtual_memory =
      registry->AddGauge("process_virtual_memory_bytes", "Virtual memory size in bytes.").Add({});
  Gauge& open_fds =
      registry->AddGauge("process_open_fds", "Number of open file descriptors.").Add({});
  Gauge& start_time = registry
                          ->AddGauge("process_start_time_seconds",
                                     "Start time of the process since unix epoch in seconds.")
                          .Add({});
  Gauge& threads =
      registry->AddGauge("process_threads", "Number of OS threads in the process.").Add({});

  registry->AddCollectHook([&cpu, &resident, &virtual_memory, &open_fds, &start_time, &threads] {
    // The counter only goes up, so it is advanced by the CPU time used since
    // it was last brought up to date; using the counter itself as "the last
    // reading" keeps this right when two hooks (two AddProcessMetrics calls,
    // or concurrent Serialize calls) update the same counter, as long as
    // they do so one at a time.
    ABSL_CONST_INIT static absl::Mutex mu(absl::kConstInit);
    absl::MutexLock lock(&mu);
    const absl::StatusOr<ProcessStats> stats = ReadProcessStats();
    if (!stats.ok()) return;  // Cannot happen for a live process; keep the old values.
    const double delta = stats->cpu_seconds - cpu.Value();
    if (delta > 0) cpu.Increment(delta);
    resident.Set(static_cast<double>(stats->resident_bytes));
    virtual_memory.Set(static_cast<double>(stats->virtual_bytes));
    if (stats->open_fds >= 0) open_fds.Set(static_cast<double>(stats->open_fds));
    start_time.Set(stats->start_time_seconds);
    threads.Set(static_cast<double>(stats->threads));
  });
}

}  // namespace aidn::metrics
