// Chaos: for --minutes, jobs of every kind keep being submitted to a real
// cluster (an aidn-coordinator and three aidn-worker daemons, one of them in
// its own network namespace where the machine allows) while trainers,
// workers and the coordinator are killed with SIGKILL, the namespaced
// worker's link is cut and mended, and jobs are cancelled, at random. Then
// the faults stop, every job is waited for, and it checks:
//   - every job ended: SUCCEEDED, FAILED with a message, or CANCELLED by us;
//     the kind that fails by design FAILED;
//   - no job's step metrics hold a step twice;
//   - every checkpoint the coordinator lists verifies against its MANIFEST
//     and the MANIFEST against the digest the coordinator committed;
//   - once the daemons stop, no process of the cluster is left, and no new
//     entry is left in the temporary directory;
//   - the long-lived daemons' file descriptors did not grow (their resident
//     memory is printed beside them).
// It prints the figures (jobs by outcome, faults by kind, restarts) and exits
// non-zero when a check fails. bench/chaos.sh builds and runs it.

#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/checkpoint_manifest.h"
#include "common/digest.h"
#include "tests/integration/cluster_fixture.h"
#include "tests/support/netns.h"
#include "tests/support/process.h"

ABSL_FLAG(double, minutes, 5, "how long jobs keep coming and faults keep happening");
ABSL_FLAG(int, seed, 1, "seed of the random faults and job kinds");
ABSL_FLAG(int, in_flight, 4, "unfinished jobs kept at once");
ABSL_FLAG(double, fault_every_s, 8, "mean seconds between faults");
ABSL_FLAG(int, drain_minutes, 15, "how long the jobs may take to end once the faults stop");
ABSL_FLAG(bool, keep, false, "keep the cluster's directory (logs, state, checkpoints)");

namespace aidn::bench {
namespace {

using std::chrono::milliseconds;
using std::chrono::seconds;
using Clock = std::chrono::steady_clock;
using testing::TestCluster;
using testing::WorkerOptions;

constexpr char kFortunes[] = "/usr/share/games/fortunes";
constexpr char kScripts[] = AIDN_SOURCE_DIR "/tests/integration/command_scripts";

double Since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// ---------------------------------------------------------------------------
// Job kinds

struct Kind {
  std::string name;
  bool fails_by_design = false;
};

const std::vector<Kind>& Kinds() {
  static const std::vector<Kind> kinds = {
      {"mlp-ddp-2"},  {"cnn-1"},         {"gpt-zero1-2"},
      {"gpt-fsdp-2"}, {"command-ddp-2"}, {"command-raises-1", true},
  };
  return kinds;
}

v1::JobSpec MakeSpec(const std::string& kind, int n, const std::string& scripts) {
  v1::JobSpec spec;
  spec.set_name(absl::StrCat("chaos-", kind));
  spec.set_device(v1::JobSpec::CPU);
  spec.set_seed(static_cast<uint64_t>(n));
  spec.set_max_restarts(30);
  (*spec.mutable_labels())["chaos"] = kind;
  v1::CheckpointSpec* ckpt = spec.mutable_checkpoint();
  ckpt->set_dir(absl::StrCat("chaos/", n));
  ckpt->set_keep_last(2);
  if (kind == "mlp-ddp-2") {
    spec.set_world_size(2);
    spec.mutable_model()->set_name("mlp");
    spec.set_max_steps(800);
    spec.set_batch_size(64);
    ckpt->set_every_steps(100);
  } else if (kind == "cnn-1") {
    spec.set_world_size(1);
    spec.mutable_model()->set_name("cnn");
    spec.set_max_steps(150);
    spec.set_batch_size(32);
    ckpt->set_every_steps(30);
  } else if (kind == "gpt-zero1-2" || kind == "gpt-fsdp-2") {
    spec.set_world_size(2);
    spec.set_strategy(kind == "gpt-zero1-2" ? v1::JobSpec::ZERO1 : v1::JobSpec::FSDP);
    v1::ModelSpec* m = spec.mutable_model();
    m->set_name("gpt");
    m->set_n_layer(2);
    m->set_n_head(2);
    m->set_n_embd(64);
    m->set_block_size(64);
    v1::DatasetSpec* d = spec.mutable_dataset();
    d->set_kind("text");
    d->add_files(kFortunes);
    d->set_val_fraction(0.1);
    d->set_eval_windows(8);
    spec.mutable_optimizer()->set_name("adamw");
    spec.mutable_optimizer()->set_lr(0.003);
    spec.set_batch_size(8);
    spec.set_max_steps(200);
    ckpt->set_every_steps(40);
  } else if (kind == "command-ddp-2") {
    spec.set_world_size(2);
    v1::CommandSpec* c = spec.mutable_command();
    c->add_argv("/usr/bin/python3");  // Debian's, with torch
    c->add_argv(scripts + "/ddp_env.py");
  } else if (kind == "command-raises-1") {
    spec.set_world_size(1);
    spec.set_max_restarts(1);
    v1::CommandSpec* c = spec.mutable_command();
    c->add_argv("/usr/bin/python3");
    c->add_argv(scripts + "/raises.py");
  }
  if (spec.has_command()) {
    // A command job runs its own program: the built-in trainer's fields
    // stay unset.
    spec.clear_checkpoint();
    spec.clear_seed();
    spec.clear_device();
  }
  return spec;
}

// ---------------------------------------------------------------------------
// Daemon health: resident memory and open descriptors.

struct Usage {
  double seconds = 0;
  long rss_kib = 0;
  int fds = 0;
};

std::optional<Usage> UsageOf(pid_t pid, Clock::time_point start) {
  std::ifstream status(absl::StrCat("/proc/", pid, "/status"));
  if (!status) return std::nullopt;
  Usage u;
  u.seconds = Since(start);
  for (std::string line; std::getline(status, line);) {
    if (line.rfind("VmRSS:", 0) == 0) u.rss_kib = std::stol(line.substr(6));
  }
  std::error_code ec;
  for (auto it = std::filesystem::directory_iterator(absl::StrCat("/proc/", pid, "/fd"), ec);
       !ec && it != std::filesystem::directory_iterator(); it.increment(ec)) {
    u.fds++;
  }
  return u;
}

std::vector<std::string> Entries(const std::string& dir) {
  std::vector<std::string> names;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
    names.push_back(e.path().filename().string());
  }
  return names;
}

// ---------------------------------------------------------------------------

class Chaos {
 public:
  Chaos() : rng_(static_cast<uint32_t>(absl::GetFlag(FLAGS_seed))) {}

  int Run() {
    start_ = Clock::now();
    // A temporary directory of the run's own, as TMPDIR for everything it
    // starts (and for the cluster's directory), so what is left there at
    // the end was left by aidn. Open to all like /tmp: command jobs run as
    // another user.
    std::string tmp = std::filesystem::temp_directory_path() / "aidn-chaos-tmp.XXXXXX";
    if (::mkdtemp(tmp.data()) == nullptr || ::chmod(tmp.c_str(), 01777) != 0) {
      std::perror("chaos: mkdtemp");
      return 2;
    }
    tmp_ = tmp;
    ::setenv("TMPDIR", tmp_.c_str(), 1);
    if (!Setup()) return 2;
    const double fault_phase = absl::GetFlag(FLAGS_minutes) * 60;
    std::printf(
        "chaos: %.1f min of faults, seed %d, %s\n", fault_phase / 60, absl::GetFlag(FLAGS_seed),
        netns_ ? "worker c in a network namespace" : "no network namespace here: no partitions");
    next_fault_ = Since(start_) + NextGap();
    double next_sample = 0;
    while (Since(start_) < fault_phase) {
      RefreshJobs();
      while (static_cast<int>(unfinished_.size()) < absl::GetFlag(FLAGS_in_flight)) Submit();
      const double now = Since(start_);
      RunDue(now);
      if (now >= next_fault_) {
        Inject(now / fault_phase);
        next_fault_ = now + NextGap();
      }
      if (now >= next_sample) {
        Sample(now / fault_phase);
        next_sample = now + 10;
      }
      std::this_thread::sleep_for(milliseconds(200));
    }
    std::printf("chaos: faults stop after %.1f min; %d jobs submitted; draining\n",
                Since(start_) / 60, static_cast<int>(jobs_.size()));
    Heal();
    Drain();
    Sample(1.0);
    return Check() ? 0 : 1;
  }

 private:
  bool Setup() {
    std::string why;
    netns_ = testing::Netns::Create(&why);
    if (netns_ == nullptr) std::printf("chaos: %s\n", why.c_str());
    cluster_ = std::make_unique<TestCluster>("aidn-chaos");
    ::chmod(cluster_->dir().c_str(), 0755);  // command jobs' ranks run as nobody
    if (absl::GetFlag(FLAGS_keep)) cluster_->Keep();
    const std::string host = netns_ ? netns_->host_ip() : "127.0.0.1";
    absl::Status s = cluster_->StartCoordinator({"--listen=" + host + ":0", "--worker-timeout=3s",
                                                 "--heartbeat-interval=500ms", "--stop-grace=1s"});
    if (!s.ok()) {
      std::printf("chaos: coordinator: %s\n", s.ToString().c_str());
      return false;
    }
    for (const std::string id : {"a", "b", "c"}) {
      WorkerOptions& o = worker_options_[id];
      o.cpu_slots = 2;
      o.args = {"--checkpoint-root=" + cluster_->Path("ckpt"), "--stop-grace=1s"};
      // As root, command jobs run as another user or not at all.
      if (::geteuid() == 0) o.args.push_back("--command-user=nobody");
      if (id == "c" && netns_) o.wrapper = netns_->Exec();
      if (!StartWorker(id)) return false;
    }
    if (!cluster_->WaitForAliveWorkers(3)) {
      std::printf("chaos: the workers did not come up\n");
      cluster_->PrintLogTails();
      return false;
    }
    return true;
  }

  bool StartWorker(const std::string& id) {
    absl::Status s = cluster_->StartWorker(id, worker_options_[id]);
    if (!s.ok()) std::printf("chaos: worker %s: %s\n", id.c_str(), s.ToString().c_str());
    return s.ok();
  }

  double NextGap() {
    std::exponential_distribution<double> gap(1.0 / absl::GetFlag(FLAGS_fault_every_s));
    return std::min(gap(rng_), 4 * absl::GetFlag(FLAGS_fault_every_s));
  }
  double Uniform(double lo, double hi) {
    return std::uniform_real_distribution<double>(lo, hi)(rng_);
  }
  template <typename T>
  const T& Pick(const std::vector<T>& v) {
    return v[std::uniform_int_distribution<size_t>(0, v.size() - 1)(rng_)];
  }

  void Submit() {
    const Kind& kind = Pick(Kinds());
    const int n = static_cast<int>(jobs_.size()) + 1;
    absl::StatusOr<std::string> id = cluster_->Submit(MakeSpec(kind.name, n, kScripts));
    if (!id.ok()) {
      // The coordinator may be down this instant: counted, tried again.
      // Any other refusal is a fault of this bench: said once.
      submit_refusals_++;
      if (id.status().code() != absl::StatusCode::kUnavailable &&
          refusals_seen_.insert(std::string(id.status().message())).second) {
        std::printf("chaos: %s refused: %s\n", kind.name.c_str(), id.status().ToString().c_str());
      }
      std::this_thread::sleep_for(milliseconds(200));
      return;
    }
    jobs_[*id] = kind;
    unfinished_.insert(*id);
  }

  void RefreshJobs() {
    for (auto it = unfinished_.begin(); it != unfinished_.end();) {
      const v1::Job job = cluster_->GetJob(*it);
      if (!job.id().empty() && testing::JobEnded(job)) {
        it = unfinished_.erase(it);
      } else {
        ++it;
      }
    }
  }

  // Work scheduled for later: restarting a killed worker, mending a link.
  struct Due {
    double at;
    std::string what;
  };
  void RunDue(double now) {
    for (auto it = due_.begin(); it != due_.end();) {
      if (it->at > now) {
        ++it;
        continue;
      }
      if (it->what == "mend") {
        netns_->SetLink(true);
        partitioned_ = false;
      } else {
        StartWorker(it->what);
        down_.erase(it->what);
      }
      it = due_.erase(it);
    }
  }

  // One fault; `progress` is the share of the fault phase gone.
  void Inject(double progress) {
    std::vector<std::string> choices = {"kill-trainer", "kill-trainer", "kill-trainer",
                                        "kill-worker", "cancel"};
    // The coordinator is killed only in the first 60 % of the phase, so its
    // last incarnation lives long enough to be measured.
    if (progress < 0.6) choices.push_back("kill-coordinator");
    if (netns_ && !partitioned_) {
      choices.push_back("partition");
      choices.push_back("partition");
    }
    const std::string fault = Pick(choices);
    const double now = Since(start_);
    if (fault == "kill-trainer") {
      const std::vector<pid_t> pids = testing::ProcessesWith({cluster_->dir(), "--job="});
      if (pids.empty()) return;
      ::kill(Pick(pids), SIGKILL);
    } else if (fault == "kill-worker") {
      // Worker a lives through the run (its usage is measured).
      std::vector<std::string> up;
      for (const std::string id : {"b", "c"}) {
        if (!down_.count(id)) up.push_back(id);
      }
      if (up.empty()) return;
      const std::string id = Pick(up);
      cluster_->RemoveWorker(id);
      down_.insert(id);
      due_.push_back({now + Uniform(1, 6), id});
    } else if (fault == "kill-coordinator") {
      absl::Status s = cluster_->RestartCoordinator(true);
      if (!s.ok()) {
        std::printf("chaos: coordinator restart: %s\n", s.ToString().c_str());
        failures_.push_back("the coordinator did not restart: " + s.ToString());
      }
    } else if (fault == "partition") {
      if (!netns_->SetLink(false)) return;
      partitioned_ = true;
      // Some shorter than the worker timeout (3 s), some longer.
      due_.push_back({now + Uniform(1, 8), "mend"});
    } else if (fault == "cancel") {
      if (unfinished_.empty()) return;
      const std::string id = Pick(std::vector<std::string>(unfinished_.begin(), unfinished_.end()));
      if (cluster_->Cancel(id, "chaos").ok()) cancelled_.insert(id);
    }
    faults_[fault]++;
  }

  void Heal() {
    for (Due& d : due_) d.at = 0;
    RunDue(Since(start_));
    if (!cluster_->WaitForAliveWorkers(3)) failures_.push_back("not all workers came back");
  }

  void Drain() {
    const auto deadline = Clock::now() + std::chrono::minutes(absl::GetFlag(FLAGS_drain_minutes));
    while (Clock::now() < deadline) {
      RefreshJobs();
      if (unfinished_.empty()) return;
      std::this_thread::sleep_for(milliseconds(500));
    }
    failures_.push_back(absl::StrCat(unfinished_.size(), " jobs did not end within ",
                                     absl::GetFlag(FLAGS_drain_minutes),
                                     " minutes: ", absl::StrJoin(unfinished_, ", ")));
  }

  // The coordinator once it has lived past 70 % of the phase; worker a
  // from 30 %.
  void Sample(double progress) {
    if (cluster_->coordinator().process != nullptr && progress >= 0.7) {
      if (auto u = UsageOf(cluster_->coordinator().process->pid(), start_)) {
        coordinator_usage_.push_back(*u);
      }
    }
    if (testing::Process* a = cluster_->worker("a"); a != nullptr && progress >= 0.3) {
      if (auto u = UsageOf(a->pid(), start_)) worker_usage_.push_back(*u);
    }
  }

  std::string CheckCheckpoint(const v1::Checkpoint& c) {
    absl::StatusOr<Manifest> m = VerifyCheckpointDir(c.path());
    if (!m.ok()) return m.status().ToString();
    if (m->step != c.step()) return absl::StrCat("MANIFEST holds step ", m->step);
    std::ifstream in(c.path() + "/MANIFEST", std::ios::binary);
    const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    if (!c.manifest_sha256().empty() && Sha256Hex(text) != c.manifest_sha256()) {
      return "MANIFEST is not the one committed";
    }
    return "";
  }

  void ReportUsage(const char* who, const std::vector<Usage>& samples, int fd_slack) {
    if (samples.size() < 2) {
      std::printf("  %-12s too few samples\n", who);
      return;
    }
    const Usage& a = samples.front();
    const Usage& b = samples.back();
    std::printf("  %-12s RSS %.1f -> %.1f MiB, fds %d -> %d (t = %.0f s -> %.0f s)\n", who,
                a.rss_kib / 1024.0, b.rss_kib / 1024.0, a.fds, b.fds, a.seconds, b.seconds);
    if (b.fds > a.fds + fd_slack) {
      failures_.push_back(
          absl::StrCat(who, "'s file descriptors grew from ", a.fds, " to ", b.fds));
    }
  }

  bool Check() {
    std::map<std::string, int> outcomes;
    std::map<std::string, std::map<std::string, int>> by_kind;
    int restarts = 0, checkpoints = 0, steps = 0, duplicates = 0;
    for (const auto& [id, kind] : jobs_) {
      const v1::Job job = cluster_->GetJob(id);
      const std::string state = v1::Job::State_Name(job.state());
      outcomes[state]++;
      by_kind[kind.name][state]++;
      restarts += job.restarts();
      if (job.state() == v1::Job::FAILED && job.message().empty()) {
        failures_.push_back(id + " FAILED without a message");
      }
      if (job.state() == v1::Job::CANCELLED && !cancelled_.count(id)) {
        failures_.push_back(id + " was CANCELLED, not by us: " + job.message());
      }
      if (kind.fails_by_design && job.state() == v1::Job::SUCCEEDED) {
        failures_.push_back(id + " (" + kind.name + ") SUCCEEDED");
      }
      if (job.state() == v1::Job::FAILED && !kind.fails_by_design) {
        std::printf("  %s (%s) FAILED: %s\n", id.c_str(), kind.name.c_str(), job.message().c_str());
      }
      std::set<std::pair<int, int64_t>> seen;  // (kind, step): TRAIN and EVAL share steps
      for (const v1::StepMetrics& m : cluster_->Metrics(id)) {
        steps++;
        if (!seen.insert({m.kind(), m.step()}).second) {
          duplicates++;
          failures_.push_back(absl::StrCat(id, " holds ", v1::MetricRecord::Kind_Name(m.kind()),
                                           " metrics of step ", m.step(), " twice"));
        }
      }
      for (const v1::Checkpoint& c : cluster_->Checkpoints(id)) {
        checkpoints++;
        if (std::string bad = CheckCheckpoint(c); !bad.empty()) {
          failures_.push_back(
              absl::StrCat(id, "'s checkpoint of step ", c.step(), " at ", c.path(), ": ", bad));
        }
      }
    }
    std::printf("chaos: %.1f min in all, %d jobs:", Since(start_) / 60,
                static_cast<int>(jobs_.size()));
    for (const auto& [state, n] : outcomes) std::printf(" %s %d", state.c_str(), n);
    std::printf("\n");
    for (const auto& [kind, states] : by_kind) {
      std::printf("  %-18s", kind.c_str());
      for (const auto& [state, n] : states) std::printf(" %s %d", state.c_str(), n);
      std::printf("\n");
    }
    std::printf("  faults:");
    int total = 0;
    for (const auto& [fault, n] : faults_) {
      std::printf(" %s %d", fault.c_str(), n);
      total += n;
    }
    std::printf(" (%d in all); submissions refused while the coordinator was down: %d\n", total,
                submit_refusals_);
    std::printf(
        "  restarts of jobs: %d; step records: %d, %d of them twice; checkpoints verified: %d\n",
        restarts, steps, duplicates, checkpoints);
    ReportUsage("coordinator", coordinator_usage_, 8);
    ReportUsage("worker a", worker_usage_, 8);

    // Stop everything; nothing of the cluster may stay.
    const std::string dir = cluster_->dir();
    cluster_->StopAll();
    const auto deadline = Clock::now() + seconds(15);
    std::vector<pid_t> left = testing::ProcessesWith({dir});
    while (!left.empty() && Clock::now() < deadline) {
      std::this_thread::sleep_for(milliseconds(100));
      left = testing::ProcessesWith({dir});
    }
    if (!left.empty()) {
      failures_.push_back(
          absl::StrCat(left.size(), " processes of the cluster left, e.g. pid ", left[0]));
    }
    const bool keep = absl::GetFlag(FLAGS_keep) || !failures_.empty();
    if (keep) {
      cluster_->Keep();
      std::printf("  the cluster's directory is kept: %s\n", dir.c_str());
    }
    cluster_.reset();
    netns_.reset();
    std::vector<std::string> left_tmp = Entries(tmp_);
    std::erase(left_tmp, std::filesystem::path(dir).filename().string());  // kept on purpose
    if (!left_tmp.empty()) {
      failures_.push_back("left in the temporary directory " + tmp_ + ": " +
                          absl::StrJoin(left_tmp, ", "));
    } else if (!keep) {
      ::rmdir(tmp_.c_str());
    }
    if (failures_.empty()) {
      std::printf("chaos: every check passed\n");
      return true;
    }
    for (const std::string& f : failures_) std::printf("chaos: FAILED: %s\n", f.c_str());
    return false;
  }

  std::mt19937 rng_;
  Clock::time_point start_;
  std::unique_ptr<testing::Netns> netns_;
  std::unique_ptr<TestCluster> cluster_;
  std::map<std::string, WorkerOptions> worker_options_;
  std::map<std::string, Kind> jobs_;
  std::set<std::string> unfinished_;
  std::set<std::string> cancelled_;
  std::set<std::string> down_;
  std::vector<Due> due_;
  bool partitioned_ = false;
  double next_fault_ = 0;
  std::map<std::string, int> faults_;
  int submit_refusals_ = 0;
  std::set<std::string> refusals_seen_;
  std::vector<Usage> coordinator_usage_;
  std::vector<Usage> worker_usage_;
  std::string tmp_;
  std::vector<std::string> failures_;
};

}  // namespace
}  // namespace aidn::bench

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  signal(SIGPIPE, SIG_IGN);
  aidn::bench::Chaos chaos;
  return chaos.Run();
}
