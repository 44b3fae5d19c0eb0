#include "bench/coordinator/coordinator_process.h"

#include <signal.h>
#include <sys/resource.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/metrics/process_stats.h"
#include "common/tls.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/channel_arguments.h"

namespace aidn::bench {

absl::StatusOr<CoordinatorProcess> StartCoordinatorProcess(const Options& o) {
  CoordinatorProcess c;
  c.dir = absl::StrCat("/tmp/aidn-coordinator-load-", getpid());
  std::filesystem::create_directories(c.dir);
  absl::StatusOr<testing::CoordinatorHandle> handle =
      testing::StartCoordinator(c.dir + "/state", o.coordinator_args);
  if (!handle.ok()) return handle.status();
  c.handle = *std::move(handle);
  c.pid = c.handle.process->pid();
  c.stub = testing::CoordinatorStub(c.handle.address);
  return c;
}

void StopCoordinatorProcess(CoordinatorProcess* c) {
  c->handle.process->Signal(SIGTERM);
  c->handle.process->Wait(seconds(20)).IgnoreError();
}

void MakeStubs(const std::string& address, int count, Load* load) {
  for (int i = 0; i < count; ++i) {
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(64 * 1024 * 1024);
    args.SetMaxSendMessageSize(4 * 1024 * 1024);
    // A connection of its own per channel: without it channels with equal
    // arguments share one subchannel, i.e. one TCP connection.
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    args.SetInt("aidn.bench.channel", i);
    // TLS as the coordinator serves it by default, verified with its CA.
    const rpc::ChannelOptions to = testing::ChannelTo(address);
    std::shared_ptr<grpc::ChannelCredentials> credentials = grpc::InsecureChannelCredentials();
    if (!to.insecure) {
      grpc::SslCredentialsOptions tls;
      tls.pem_root_certs = ReadCaFile(to.tls_ca_file).value_or("");
      credentials = grpc::SslCredentials(tls);
    }
    std::shared_ptr<grpc::Channel> channel = grpc::CreateCustomChannel(address, credentials, args);
    load->stubs.push_back(v1::ClusterService::NewStub(channel));
    load->generic_stubs.push_back(std::make_unique<grpc::GenericStub>(channel));
  }
}

v1::JobSpec Spec(const std::string& name, int world_size, const std::string& role) {
  v1::JobSpec spec;
  spec.set_name(name);
  spec.set_world_size(world_size);
  spec.mutable_model()->set_name("mlp");
  spec.set_epochs(1);
  (*spec.mutable_labels())[kRoleLabel] = role;
  return spec;
}

std::pair<double, double> ResidentMiB(pid_t pid) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  double rss = -1, anon = -1;
  while (std::getline(in, line)) {
    const bool is_rss = line.rfind("VmRSS:", 0) == 0;
    const bool is_anon = line.rfind("RssAnon:", 0) == 0;
    if (!is_rss && !is_anon) continue;
    int64_t kib = 0;
    std::vector<std::string> parts = absl::StrSplit(line, ' ', absl::SkipWhitespace());
    if (parts.size() < 2 || !absl::SimpleAtoi(parts[1], &kib)) continue;
    (is_rss ? rss : anon) = static_cast<double>(kib) / 1024.0;
  }
  return {rss, anon};
}

double CpuSeconds(pid_t pid) {
  absl::StatusOr<metrics::ProcessStats> s = metrics::ReadProcessStats(pid);
  return s.ok() ? s->cpu_seconds : -1;
}

std::string LoadAverage() {
  std::ifstream in("/proc/loadavg");
  std::string a, b, c;
  in >> a >> b >> c;
  return absl::StrCat(a, " ", b, " ", c);
}

void RaiseFileLimit() {
  struct rlimit rl;
  if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
    rl.rlim_cur = rl.rlim_max;
    setrlimit(RLIMIT_NOFILE, &rl);
  }
}

}  // namespace aidn::bench
