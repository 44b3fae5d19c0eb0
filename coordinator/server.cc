#include "coordinator/server.h"

#include "absl/strings/str_cat.h"
#include "aidn/v1/cluster.grpc.pb.h"
#include "aidn/v1/coordinator.grpc.pb.h"
#include "coordinator/metrics.h"
#include "coordinator/service.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/health_check_service_interface.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server_builder.h"

namespace aidn::coordinator {

absl::StatusOr<std::unique_ptr<Server>> Server::Start(const ServerOptions& options,
                                                      Coordinator* coordinator,
                                                      const Authenticator* auth) {
  const size_t colon = options.listen.rfind(':');
  if (colon == std::string::npos || colon == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("listen: expected host:port, got \"", options.listen, "\""));
  }
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();

  std::unique_ptr<Server> server(new Server());
  server->coordinator_service_ = std::make_unique<CoordinatorServiceImpl>(coordinator, auth);
  server->cluster_service_ = std::make_unique<ClusterServiceImpl>(coordinator, auth);

  grpc::ServerBuilder builder;
  int port = 0;
  std::shared_ptr<grpc::ServerCredentials> credentials = grpc::InsecureServerCredentials();
  if (!options.tls_cert_pem.empty()) {
    grpc::SslServerCredentialsOptions tls;
    tls.pem_key_cert_pairs.push_back({options.tls_key_pem, options.tls_cert_pem});
    if (!options.tls_client_ca_pem.empty()) {
      // Asked for and verified when presented: aidnctl and trainers present
      // none; worker tokens need one (AuthenticateCall).
      tls.pem_root_certs = options.tls_client_ca_pem;
      tls.client_certificate_request = GRPC_SSL_REQUEST_CLIENT_CERTIFICATE_AND_VERIFY;
    }
    credentials = grpc::SslServerCredentials(tls);
  }
  builder.AddListeningPort(options.listen, credentials, &port);
  builder.SetMaxReceiveMessageSize(options.max_message_bytes);
  builder.SetMaxSendMessageSize(options.max_message_bytes);
  builder.RegisterService(server->coordinator_service_.get());
  builder.RegisterService(server->cluster_service_.get());
  // Every call is counted and timed by method and status code (/metrics).
  std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> creators;
  creators.push_back(NewRpcMetricsInterceptor(coordinator->metrics()));
  builder.experimental().SetInterceptorCreators(std::move(creators));
  server->server_ = builder.BuildAndStart();
  if (server->server_ == nullptr || port == 0) {
    return absl::UnavailableError(
        absl::StrCat("could not listen on ", options.listen, " (address in use or not local?)"));
  }
  server->address_ = absl::StrCat(options.listen.substr(0, colon), ":", port);
  // gRPC's health service answers SERVING for "" (the server) on its own;
  // each service is known to it only once named here.
  grpc::HealthCheckServiceInterface* health = server->server_->GetHealthCheckService();
  for (const std::string& name : ServedServices()) health->SetServingStatus(name, true);
  return server;
}

std::vector<std::string> Server::ServedServices() {
  return {v1::CoordinatorService::service_full_name(), v1::ClusterService::service_full_name()};
}

std::shared_ptr<grpc::Channel> Server::InProcessChannel() {
  grpc::ChannelArguments args;
  // No client-side limit: the server's own limits decide, and an in-process
  // caller (the web UI) takes the large answers aidnctl takes in pages.
  args.SetMaxReceiveMessageSize(-1);
  return server_->InProcessChannel(args);
}

Server::~Server() { Shutdown(std::chrono::milliseconds(0)); }

void Server::Shutdown(std::chrono::milliseconds grace) {
  if (server_ == nullptr) return;
  // Every service (and "") NOT_SERVING from here on, for health watchers
  // and checks that still get through while the calls drain.
  server_->GetHealthCheckService()->Shutdown();
  server_->Shutdown(std::chrono::system_clock::now() + grace);
  server_->Wait();
  server_.reset();
}

}  // namespace aidn::coordinator
