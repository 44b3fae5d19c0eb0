// aidn's c10d store against real PyTorch clients (/usr/bin/python3's torch,
// 1.13 on these machines): TCPStore(is_master=False) calls, and a two-rank
// gloo job whose ranks rendezvous through the store as they do under an
// elastic agent (TORCHELASTIC_USE_AGENT_STORE=True).

#include <chrono>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/support/files.h"
#include "tests/support/process.h"
#include "worker/c10d/store_server.h"

namespace aidn::worker::c10d {
namespace {

using aidn::testing::Process;
using aidn::testing::TempDir;

constexpr char kPython[] = "/usr/bin/python3";
constexpr std::chrono::seconds kRankTimeout{90};

bool TorchAvailable() {
  static const bool available =
      std::system(
          absl::StrCat(kPython, " -c 'import torch.distributed' >/dev/null 2>&1").c_str()) == 0;
  return available;
}

std::string Script(const std::string& name) {
  return absl::StrCat(AIDN_SOURCE_DIR, "/tests/integration/", name);
}

class C10dStoreTorchTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!TorchAvailable()) {
      GTEST_SKIP() << kPython << " cannot import torch.distributed (install python3-torch)";
    }
    auto server = StoreServer::Start(StoreServerOptions{});
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::move(*server);
  }

  // Waits for every process to exit and expects exit 0 and `marker` in its
  // stdout; on failure the logs are kept and printed.
  void ExpectAllSucceed(std::vector<std::unique_ptr<Process>>& processes,
                        const std::string& marker) {
    for (size_t i = 0; i < processes.size(); ++i) {
      auto code = processes[i]->Wait(kRankTimeout);
      const bool ok =
          code.ok() && *code == 0 && processes[i]->Stdout().find(marker) != std::string::npos;
      EXPECT_TRUE(ok) << "process " << i << " exit " << (code.ok() ? *code : -1) << "\nstdout:\n"
                      << processes[i]->Stdout() << "\nstderr:\n"
                      << processes[i]->Stderr();
      if (!ok) dir_.Keep();
    }
  }

  TempDir dir_{"c10d_store_torch"};
  std::unique_ptr<StoreServer> server_;
};

TEST_F(C10dStoreTorchTest, TorchTcpStoreClientsUseEveryCall) {
  const std::string port = std::to_string(server_->port());
  std::vector<std::unique_ptr<Process>> clients;
  for (const std::string role : {"first", "second"}) {
    auto process =
        Process::Start({kPython, Script("c10d_store_client.py"), "127.0.0.1", port, role},
                       {"PYTHONUNBUFFERED=1"}, dir_ / (role + ".out"), dir_ / (role + ".err"));
    ASSERT_TRUE(process.ok()) << process.status();
    clients.push_back(std::move(*process));
  }
  ExpectAllSucceed(clients, "OK");
  EXPECT_EQ(server_->num_dropped(), 0u);
  EXPECT_GT(server_->num_keys(), 5u);
}

TEST_F(C10dStoreTorchTest, GlooJobRendezvousesThroughTheStoreAsUnderAnAgent) {
  constexpr int kWorld = 2;
  std::vector<std::unique_ptr<Process>> ranks;
  for (int rank = 0; rank < kWorld; ++rank) {
    const std::vector<std::string> env = {
        "MASTER_ADDR=127.0.0.1",
        absl::StrCat("MASTER_PORT=", server_->port()),
        absl::StrCat("RANK=", rank),
        absl::StrCat("LOCAL_RANK=", rank),
        absl::StrCat("WORLD_SIZE=", kWorld),
        "TORCHELASTIC_USE_AGENT_STORE=True",
        "TORCHELASTIC_RESTART_COUNT=0",
        "OMP_NUM_THREADS=1",
        "PYTHONUNBUFFERED=1",
    };
    const std::string log = dir_ / absl::StrCat("rank", rank);
    auto process =
        Process::Start({kPython, Script("c10d_store_ddp.py")}, env, log + ".out", log + ".err");
    ASSERT_TRUE(process.ok()) << process.status();
    ranks.push_back(std::move(*process));
  }
  ExpectAllSucceed(ranks, "all_reduce 3");
  EXPECT_EQ(server_->num_dropped(), 0u);
  // Gloo's rendezvous keys live under the agent store's attempt prefix.
  EXPECT_GT(server_->num_keys(), 2u);
}

}  // namespace
}  // namespace aidn::worker::c10d
