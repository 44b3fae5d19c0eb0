#include "common/rpc/client.h"

#include <cstdlib>

#include "common/log.h"
#include "common/tls.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/channel_arguments.h"

namespace aidn::rpc {

std::shared_ptr<grpc::Channel> MakeChannel(const ChannelOptions& options) {
  // A synchronous client polls its sockets only inside calls, and a call
  // made while the channel is down fails at once; between calls, only
  // gRPC's backup poller (every 5 s by default) finishes a connection
  // attempt. A worker or trainer retrying a restarted coordinator then
  // needs up to tens of seconds to see it back. Poll every 100 ms instead.
  // Read once, when gRPC initialises (the first channel), and a value set
  // by the user wins.
  setenv("GRPC_CLIENT_CHANNEL_BACKUP_POLL_INTERVAL_MS", "100", /*overwrite=*/0);
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(options.max_message_bytes);
  args.SetMaxSendMessageSize(options.max_message_bytes);
  // Reconnect quickly after a coordinator restart instead of waiting out
  // gRPC's default backoff (up to 120 s).
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 2000);
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  std::shared_ptr<grpc::ChannelCredentials> credentials;
  if (options.insecure) {
    credentials = grpc::InsecureChannelCredentials();
  } else {
    grpc::SslCredentialsOptions tls;
    if (!options.tls_ca_file.empty()) {
      absl::StatusOr<std::string> pem = ReadCaFile(options.tls_ca_file);
      if (pem.ok()) {
        tls.pem_root_certs = *pem;
      } else {
        AIDN_LOG(ERROR) << pem.status();
      }
    }
    credentials = grpc::SslCredentials(tls);
  }
  return grpc::CreateCustomChannel(options.address, credentials, args);
}

absl::Status CheckChannelOptions(const ChannelOptions& options) {
  if (options.insecure || options.tls_ca_file.empty()) return absl::OkStatus();
  return ReadCaFile(options.tls_ca_file).status();
}

void ResetBackoffAfter(const grpc::Status& status, grpc::Channel* channel) {
  if (channel == nullptr || status.error_code() != grpc::StatusCode::UNAVAILABLE) return;
  grpc::experimental::ChannelResetConnectionBackoff(channel);
}

void PrepareContext(grpc::ClientContext* context, const std::string& token,
                    std::chrono::milliseconds timeout) {
  if (!token.empty()) context->AddMetadata("authorization", "Bearer " + token);
  if (timeout.count() > 0) context->set_deadline(std::chrono::system_clock::now() + timeout);
}

}  // namespace aidn::rpc
