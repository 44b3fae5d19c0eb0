// The coordinator's TLS material (common/tls.h) against real gRPC servers
// and clients on loopback: the CA made once and kept, a new server
// certificate at every start that clients of the old one still accept, and
// the refusals (another CA, plaintext either way, an expired certificate),
// each said in words by DiagnoseTls.

#include "common/tls.h"

#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "aidn/v1/cluster.grpc.pb.h"
#include "common/rpc/client.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/security/server_credentials.h"
#include "gtest/gtest.h"

namespace aidn {
namespace {

using ::testing::HasSubstr;
namespace fs = std::filesystem;

// One test dials "localhost": gRPC's default resolver (c-ares) keeps a
// 10-byte allocation that LeakSanitizer reports at exit; the native one
// (getaddrinfo) resolves it as well and keeps nothing. Set before gRPC
// starts.
const bool kNativeResolver = setenv("GRPC_DNS_RESOLVER", "native", /*overwrite=*/0) == 0;

std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

// A gRPC server with a service that implements nothing, serving `tls` (or
// plaintext) on loopback.
class Server {
 public:
  explicit Server(const ServerTls* tls, int port = 0) {
    grpc::ServerBuilder builder;
    builder.RegisterService(&service_);
    std::shared_ptr<grpc::ServerCredentials> credentials = grpc::InsecureServerCredentials();
    if (tls != nullptr) {
      grpc::SslServerCredentialsOptions o;
      o.pem_key_cert_pairs.push_back({tls->key_pem, tls->cert_pem});
      credentials = grpc::SslServerCredentials(o);
    }
    builder.AddListeningPort(absl::StrCat("127.0.0.1:", port), credentials, &port_);
    server_ = builder.BuildAndStart();
  }
  ~Server() { server_->Shutdown(std::chrono::system_clock::now()); }
  std::string address() const { return absl::StrCat("127.0.0.1:", port_); }
  int port() const { return port_; }

 private:
  v1::ClusterService::Service service_;
  int port_ = 0;
  std::unique_ptr<grpc::Server> server_;
};

// Whether a channel made as the products make theirs gets through the
// handshake within `within` (a refused one takes all of it).
bool Connects(const rpc::ChannelOptions& options,
              std::chrono::milliseconds within = std::chrono::milliseconds(1500)) {
  std::shared_ptr<grpc::Channel> channel = rpc::MakeChannel(options);
  return channel->WaitForConnected(std::chrono::system_clock::now() + within);
}

class TlsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = absl::StrCat(::testing::TempDir(), "/tls-", getpid(), "-",
                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string dir_;
};

TEST_F(TlsTest, TheCaIsMadeOnceAndEveryStartsCertificateVerifiesWithIt) {
  absl::StatusOr<ServerTls> first = EnsureAutoTls({.dir = dir_ + "/tls"});
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(first->ca_file, dir_ + "/tls/ca.pem");
  for (const char* key : {"/tls/ca.key", "/tls/server.key"}) {
    struct stat st;
    ASSERT_EQ(::stat((dir_ + key).c_str(), &st), 0) << key;
    EXPECT_EQ(st.st_mode & 0777, 0600u) << key;
  }
  struct stat st;
  ASSERT_EQ(::stat((dir_ + "/tls").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0700u);
  EXPECT_GT(first->not_after, absl::Now() + absl::Hours(24 * 360));
  const std::string ca = ReadAll(first->ca_file);

  // A client connected to this start's server ...
  auto server = std::make_unique<Server>(&*first);
  const int port = server->port();
  const rpc::ChannelOptions verified = {.address = server->address(),
                                        .tls_ca_file = first->ca_file};
  std::shared_ptr<grpc::Channel> channel = rpc::MakeChannel(verified);
  ASSERT_TRUE(
      channel->WaitForConnected(std::chrono::system_clock::now() + std::chrono::seconds(3)));
  EXPECT_EQ(DiagnoseTls(server->address(), first->ca_file, false), "");

  // ... reconnects to the next start's, whose certificate is new but signed
  // by the same CA: rotation the clients do not notice.
  absl::StatusOr<ServerTls> second = EnsureAutoTls({.dir = dir_ + "/tls"});
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ(ReadAll(second->ca_file), ca);
  EXPECT_NE(second->cert_pem, first->cert_pem);
  server.reset();
  server = std::make_unique<Server>(&*second, port);
  ASSERT_EQ(server->port(), port);
  EXPECT_TRUE(
      channel->WaitForConnected(std::chrono::system_clock::now() + std::chrono::seconds(5)));
  EXPECT_TRUE(
      Connects({.address = "localhost:" + std::to_string(port), .tls_ca_file = second->ca_file},
               std::chrono::seconds(5)));

  // Half a CA is refused, saying what to do.
  fs::remove(dir_ + "/tls/ca.key");
  absl::Status half = EnsureAutoTls({.dir = dir_ + "/tls"}).status();
  EXPECT_EQ(half.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(half.message()), HasSubstr("ca.pem but no ca.key"));
}

TEST_F(TlsTest, ClientsThatCannotVerifyAreRefusedAndToldWhy) {
  absl::StatusOr<ServerTls> tls = EnsureAutoTls({.dir = dir_ + "/ours"});
  ASSERT_TRUE(tls.ok()) << tls.status();
  absl::StatusOr<ServerTls> other = EnsureAutoTls({.dir = dir_ + "/theirs"});
  ASSERT_TRUE(other.ok()) << other.status();
  Server server(&*tls);

  // Another CA.
  EXPECT_FALSE(Connects({.address = server.address(), .tls_ca_file = other->ca_file}));
  EXPECT_THAT(DiagnoseTls(server.address(), other->ca_file, false),
              HasSubstr("not signed by the CA in " + other->ca_file));
  // The system's roots.
  EXPECT_FALSE(Connects({.address = server.address()}));
  EXPECT_THAT(DiagnoseTls(server.address(), "", false), HasSubstr("not signed by a CA"));
  // Plaintext against TLS.
  EXPECT_FALSE(Connects({.address = server.address(), .insecure = true}));
  EXPECT_THAT(DiagnoseTls(server.address(), "", true), HasSubstr("it serves TLS"));
  // TLS against plaintext.
  Server plain(nullptr);
  EXPECT_FALSE(Connects({.address = plain.address(), .tls_ca_file = tls->ca_file}));
  EXPECT_THAT(DiagnoseTls(plain.address(), tls->ca_file, false), HasSubstr("serves plaintext"));
  EXPECT_TRUE(Connects({.address = plain.address(), .insecure = true}, std::chrono::seconds(5)));
  // A CA file that is not one.
  const std::string junk = dir_ + "/junk.pem";
  std::ofstream(junk) << "not a certificate\n";
  absl::Status bad = rpc::CheckChannelOptions({.tls_ca_file = junk});
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(bad.message()), HasSubstr(junk));
}

TEST_F(TlsTest, AnExpiredCertificateIsRefusedByTheServerAndByClients) {
  // Valid from an hour ago to half an hour ago.
  absl::StatusOr<ServerTls> expired =
      EnsureAutoTls({.dir = dir_ + "/tls", .validity = absl::Minutes(-30)});
  ASSERT_TRUE(expired.ok()) << expired.status();
  absl::Status refused = LoadServerTls(dir_ + "/tls/server.pem", dir_ + "/tls/server.key").status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(refused.message()), HasSubstr("the certificate expired on"));

  Server server(&*expired);
  EXPECT_FALSE(Connects({.address = server.address(), .tls_ca_file = expired->ca_file}));
  EXPECT_THAT(DiagnoseTls(server.address(), expired->ca_file, false),
              HasSubstr("its certificate expired on"));

  // A key that is not the certificate's.
  absl::StatusOr<ServerTls> other = EnsureAutoTls({.dir = dir_ + "/other"});
  ASSERT_TRUE(other.ok()) << other.status();
  absl::Status mismatched =
      LoadServerTls(dir_ + "/other/server.pem", dir_ + "/tls/server.key").status();
  EXPECT_THAT(std::string(mismatched.message()), HasSubstr("is not the key of the certificate"));
}

TEST(Loopback, OnlyLoopbackHostsAreLoopback) {
  for (const char* host : {"127.0.0.1", "127.1.2.3", "localhost", "::1", "[::1]"}) {
    EXPECT_TRUE(IsLoopbackHost(host)) << host;
  }
  for (const char* host : {"0.0.0.0", "10.0.0.1", "::", "[::]", "example.com", ""}) {
    EXPECT_FALSE(IsLoopbackHost(host)) << host;
  }
}

}  // namespace
}  // namespace aidn
