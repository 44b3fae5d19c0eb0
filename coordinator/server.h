#ifndef AIDN_COORDINATOR_SERVER_H_
#define AIDN_COORDINATOR_SERVER_H_

// The coordinator's gRPC server: both services, gRPC health checking and
// server reflection, on one port. Thread-safe.
//
// Health (grpc.health.v1.Health/Check): "" and each served service's full
// name ("aidn.v1.CoordinatorService", "aidn.v1.ClusterService") are SERVING
// while the server runs and NOT_SERVING once Shutdown begins.

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "coordinator/auth.h"
#include "coordinator/coordinator.h"
#include "grpcpp/server.h"

namespace aidn::coordinator {

class ClusterServiceImpl;
class CoordinatorServiceImpl;

struct ServerOptions {
  // host:port; port 0 picks a free one (see Server::address()).
  std::string listen = "127.0.0.1:7070";
  // Requests larger than this are refused by gRPC before they are read
  // into memory (RESOURCE_EXHAUSTED).
  int max_message_bytes = 4 * 1024 * 1024;
  // The server's certificate and key (PEM); both empty: plaintext (the
  // caller decides when that is allowed: --insecure).
  std::string tls_cert_pem;
  std::string tls_key_pem;
  // Mutual TLS: request client certificates and verify those presented
  // against these CA certificates (PEM); empty: none asked for.
  std::string tls_client_ca_pem;
};

class Server {
 public:
  // Neither pointer is owned; both must outlive the server.
  static absl::StatusOr<std::unique_ptr<Server>> Start(const ServerOptions& options,
                                                       Coordinator* coordinator,
                                                       const Authenticator* auth);
  ~Server();

  // host:port actually bound.
  const std::string& address() const { return address_; }
  // A channel to this server inside the process (no socket, no TLS, no
  // client certificate): for tests and fuzzing of the services.
  std::shared_ptr<grpc::Channel> InProcessChannel();
  // Stops accepting calls; calls still running after `grace` are cancelled.
  void Shutdown(std::chrono::milliseconds grace);

  // The full names of the services served, as health checks name them.
  static std::vector<std::string> ServedServices();

 private:
  Server() = default;
  std::unique_ptr<CoordinatorServiceImpl> coordinator_service_;
  std::unique_ptr<ClusterServiceImpl> cluster_service_;
  std::unique_ptr<grpc::Server> server_;
  std::string address_;
};

}  // namespace aidn::coordinator

#endif  // AIDN_COORDINATOR_SERVER_H_
