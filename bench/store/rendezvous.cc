// Rendezvous of N clients through a c10d store: every client connects, ADDs 1
// to a counter, and the one that brings it to N SETs a key the others WAIT
// for -- what a job's ranks do at start-up. The same client code (one thread
// per client speaking the wire protocol, PyTorch 1.13's dialect) runs against
// aidn's store and against PyTorch's own TCPStore server, each in its own
// process, interleaved repetition by repetition; medians and the ratio are
// printed.
//
//   store_rendezvous --clients 1000 --reps 5 --torch_master bench/store/torch_master.py
//   store_rendezvous --serve        (aidn's store alone; the benchmark starts it)

#include <signal.h>
#include <spawn.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <iostream>
#include <latch>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_format.h"
#include "worker/c10d/store_server.h"
#include "worker/c10d/wire_client.h"

ABSL_FLAG(int, clients, 1000, "clients that rendezvous");
ABSL_FLAG(int, reps, 5, "repetitions per server (medians are reported)");
ABSL_FLAG(std::string, python, "/usr/bin/python3", "python with torch, for the peer server");
ABSL_FLAG(std::string, torch_master, "bench/store/torch_master.py",
          "script that serves PyTorch's TCPStore (empty: aidn only)");
ABSL_FLAG(bool, serve, false, "serve aidn's store, print its port, stop when stdin closes");

extern char** environ;

namespace aidn::worker::c10d {
namespace {

using Clock = std::chrono::steady_clock;

// A server in a child process: stdin is a pipe it watches, its first stdout
// line is "port N".
struct ServerProcess {
  pid_t pid = -1;
  int stdin_fd = -1;
  int port = 0;
};

ServerProcess Spawn(const std::vector<std::string>& argv) {
  int in[2], out[2];
  if (pipe(in) != 0 || pipe(out) != 0) std::abort();
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, in[0], 0);
  posix_spawn_file_actions_adddup2(&actions, out[1], 1);
  posix_spawn_file_actions_addclose(&actions, in[1]);
  posix_spawn_file_actions_addclose(&actions, out[0]);
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  ServerProcess server;
  if (posix_spawn(&server.pid, args[0], &actions, nullptr, args.data(), environ) != 0) {
    std::cerr << "cannot start " << argv[0] << "\n";
    std::exit(1);
  }
  posix_spawn_file_actions_destroy(&actions);
  close(in[0]);
  close(out[1]);
  server.stdin_fd = in[1];
  FILE* f = fdopen(out[0], "r");
  if (fscanf(f, "port %d", &server.port) != 1) {
    std::cerr << "no port from " << argv[0] << "\n";
    std::exit(1);
  }
  fclose(f);
  return server;
}

void Finish(ServerProcess& server) {
  close(server.stdin_fd);
  int status = 0;
  waitpid(server.pid, &status, 0);
}

struct RunResult {
  double ms = 0;
  int wrong = 0;  // clients that failed or saw a wrong reply
};

RunResult Rendezvous(int port, int n) {
  const std::string counter = "rdzv/count", go = "rdzv/go";
  std::latch start(n + 1);
  std::atomic<int> wrong{0};
  std::vector<std::atomic<bool>> seen(n + 1);
  std::vector<std::thread> threads;
  threads.reserve(n);
  for (int i = 0; i < n; ++i) {
    threads.emplace_back([&] {
      start.arrive_and_wait();
      constexpr Dialect d = Dialect::kTorch1;
      const auto timeout = std::chrono::seconds(120);
      auto client = WireClient::Connect("127.0.0.1", port, timeout);
      if (!client.ok()) return (void)wrong.fetch_add(1);
      Request add;
      add.op = Op::kAdd;
      add.keys = {counter};
      add.delta = 1;
      if (!(*client)->Send(d, add).ok()) return (void)wrong.fetch_add(1);
      auto count = (*client)->ReadI64(timeout);
      if (!count.ok() || *count < 1 || *count > n || seen[*count].exchange(true)) {
        return (void)wrong.fetch_add(1);
      }
      Request next;
      next.keys = {go};
      if (*count == n) {
        next.op = Op::kSet;
        next.values = {"1"};
        if (!(*client)->Send(d, next).ok()) wrong.fetch_add(1);
        return;
      }
      next.op = Op::kWait;
      auto reply = (*client)->Send(d, next).ok() ? (*client)->ReadU8(timeout)
                                                 : absl::StatusOr<uint8_t>(absl::UnknownError(""));
      if (!reply.ok() || *reply != kStopWaiting) wrong.fetch_add(1);
    });
  }
  const auto t0 = Clock::now();
  start.arrive_and_wait();
  for (auto& t : threads) t.join();
  RunResult result;
  result.ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
  result.wrong = wrong.load();
  return result;
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

void RaiseFdLimit(int clients) {
  rlimit rl{};
  getrlimit(RLIMIT_NOFILE, &rl);
  rl.rlim_cur = rl.rlim_max;
  setrlimit(RLIMIT_NOFILE, &rl);
  if (rl.rlim_cur < static_cast<rlim_t>(2 * clients + 64)) {
    std::cerr << "warning: RLIMIT_NOFILE " << rl.rlim_cur << " is low for " << clients
              << " clients\n";
  }
}

int Serve() {
  StoreServerOptions options;
  options.max_clients = 1 << 16;
  auto server = StoreServer::Start(options);
  if (!server.ok()) {
    std::cerr << server.status() << "\n";
    return 1;
  }
  std::printf("port %d\n", (*server)->port());
  std::fflush(stdout);
  char buffer[256];
  while (read(0, buffer, sizeof(buffer)) > 0) {
  }
  (*server)->Stop();
  return 0;
}

int Bench(const char* self) {
  const int n = absl::GetFlag(FLAGS_clients);
  const int reps = absl::GetFlag(FLAGS_reps);
  const std::string master = absl::GetFlag(FLAGS_torch_master);
  RaiseFdLimit(n);
#ifndef NDEBUG
  std::printf("# WARNING: built with assertions (no NDEBUG)\n");
#endif
  std::printf("# %d clients: connect, ADD a counter, the last SETs a key the others WAIT for\n", n);
  std::printf("# %-4s %12s %12s %7s\n", "rep", "aidn ms", "torch ms", "#wrong");
  std::vector<double> ours, theirs;
  int wrong = 0;
  for (int rep = 0; rep < reps; ++rep) {
    ServerProcess aidn = Spawn({self, "--serve"});
    RunResult a = Rendezvous(aidn.port, n);
    Finish(aidn);
    ours.push_back(a.ms);
    wrong += a.wrong;
    RunResult t;
    if (!master.empty()) {
      ServerProcess torch = Spawn({absl::GetFlag(FLAGS_python), master});
      t = Rendezvous(torch.port, n);
      Finish(torch);
      theirs.push_back(t.ms);
      wrong += t.wrong;
    }
    std::printf("  %-4d %12.1f %12.1f %7d\n", rep, a.ms, t.ms, a.wrong + t.wrong);
    std::fflush(stdout);
  }
  const double mine = Median(ours), peer = Median(theirs);
  std::printf(
      "rendezvous of %d clients (median of %d): aidn %.1f ms | PyTorch 1.13 TCPStore %.1f "
      "ms | PyTorch / aidn %.2f | #wrong %d\n",
      n, reps, mine, peer, mine > 0 ? peer / mine : 0.0, wrong);
  return wrong == 0 ? 0 : 1;
}

}  // namespace
}  // namespace aidn::worker::c10d

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  signal(SIGPIPE, SIG_IGN);
  if (absl::GetFlag(FLAGS_serve)) return aidn::worker::c10d::Serve();
  char self[4096];
  const ssize_t len = readlink("/proc/self/exe", self, sizeof(self) - 1);
  if (len <= 0) return 1;
  self[len] = '\0';
  return aidn::worker::c10d::Bench(self);
}
