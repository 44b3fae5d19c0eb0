// Tests of the coordinator's gRPC server: what its health service answers.

#include "coordinator/server.h"

#include <chrono>
#include <future>
#include <memory>
#include <string>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "coordinator/auth.h"
#include "coordinator/coordinator.h"
#include "coordinator/store.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/byte_buffer.h"

namespace aidn::coordinator {
namespace {

using ::testing::ElementsAre;

// grpc.health.v1 (health.proto) by hand: Debian's gRPC ships no generated
// client for it. HealthCheckRequest{string service = 1} and
// HealthCheckResponse{ServingStatus status = 1}.
constexpr int kServing = 1;

struct HealthAnswer {
  grpc::StatusCode code = grpc::StatusCode::UNKNOWN;
  int status = 0;  // ServingStatus: 0 UNKNOWN, 1 SERVING, 2 NOT_SERVING
};

HealthAnswer CheckHealth(grpc::GenericStub* stub, const std::string& service) {
  std::string request = {'\x0a', static_cast<char>(service.size())};
  request += service;
  grpc::Slice slice(request);
  grpc::ByteBuffer request_buffer(&slice, 1);
  grpc::ByteBuffer response_buffer;
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  std::promise<grpc::Status> done;
  stub->UnaryCall(&context, "/grpc.health.v1.Health/Check", grpc::StubOptions(), &request_buffer,
                  &response_buffer, [&done](grpc::Status status) { done.set_value(status); });
  HealthAnswer answer;
  answer.code = done.get_future().get().error_code();
  std::vector<grpc::Slice> slices;
  if (answer.code == grpc::StatusCode::OK && response_buffer.Dump(&slices).ok()) {
    std::string bytes;
    for (const grpc::Slice& s : slices) bytes.append(s.begin(), s.end());
    if (bytes.size() == 2 && bytes[0] == '\x08') answer.status = bytes[1];
  }
  return answer;
}

class ServerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auth_ = Authenticator::CreateEmpty();
    auto store = Store::Open({.path = ":memory:"});
    ASSERT_TRUE(store.ok()) << store.status();
    auto coordinator = Coordinator::Create(CoordinatorOptions(), *std::move(store), auth_.get());
    ASSERT_TRUE(coordinator.ok()) << coordinator.status();
    coordinator_ = *std::move(coordinator);
    ServerOptions options;
    options.listen = "127.0.0.1:0";
    auto server = Server::Start(options, coordinator_.get(), auth_.get());
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    stub_ = std::make_unique<grpc::GenericStub>(
        grpc::CreateChannel(server_->address(), grpc::InsecureChannelCredentials()));
  }
  void TearDown() override {
    if (coordinator_ != nullptr) coordinator_->Shutdown();
    if (server_ != nullptr) server_->Shutdown(std::chrono::milliseconds(0));
  }

  std::unique_ptr<Authenticator> auth_;
  std::unique_ptr<Coordinator> coordinator_;
  std::unique_ptr<Server> server_;
  std::unique_ptr<grpc::GenericStub> stub_;
};

TEST(ServerServices, AreTheCoordinatorAndClusterServices) {
  EXPECT_THAT(Server::ServedServices(),
              ElementsAre("aidn.v1.CoordinatorService", "aidn.v1.ClusterService"));
}

TEST_F(ServerTest, HealthAnswersServingForTheServerAndEachService) {
  for (const std::string& name : {std::string(), std::string("aidn.v1.CoordinatorService"),
                                  std::string("aidn.v1.ClusterService")}) {
    const HealthAnswer answer = CheckHealth(stub_.get(), name);
    EXPECT_EQ(answer.code, grpc::StatusCode::OK) << "\"" << name << "\"";
    EXPECT_EQ(answer.status, kServing) << "\"" << name << "\"";
  }
}

TEST_F(ServerTest, HealthAnswersNotFoundForAServiceItDoesNotServe) {
  EXPECT_EQ(CheckHealth(stub_.get(), "aidn.v1.NoSuchService").code, grpc::StatusCode::NOT_FOUND);
}

}  // namespace
}  // namespace aidn::coordinator
