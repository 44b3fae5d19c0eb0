#include "common/rpc/client.h"

#include <cstdlib>

#include "absl/strings/str_cat.h"
#include "common/file.h"
#include "common/log.h"
#include "common/status.h"
#include "common/tls.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/channel_arguments.h"

namespace aidn::rpc {

namespace {

// A PEM file's text; INVALID_ARGUMENT naming it when it cannot be read.
absl::StatusOr<std::string> ReadPem(const std::string& path) {
  absl::StatusOr<std::string> text = ReadFileToString(path);
  if (!text.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("TLS file ", text.status().message()));
  }
  if (text->find("-----BEGIN ") == std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat("TLS file ", path, ": no PEM in it"));
  }
  return text;
}

}  // namespace

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
    if (!options.tls_cert_file.empty()) {
      absl::StatusOr<std::string> cert = ReadPem(options.tls_cert_file);
      absl::StatusOr<std::string> key = ReadPem(options.tls_key_file);
      if (cert.ok() && key.ok()) {
        tls.pem_cert_chain = *cert;
        tls.pem_private_key = *key;
      } else {
        AIDN_LOG(ERROR) << (cert.ok() ? key.status() : cert.status());
      }
    }
    credentials = grpc::SslCredentials(tls);
  }
  return grpc::CreateCustomChannel(options.address, credentials, args);
}

absl::Status CheckChannelOptions(const ChannelOptions& options) {
  if (options.insecure) return absl::OkStatus();
  if (options.tls_cert_file.empty() != options.tls_key_file.empty()) {
    return absl::InvalidArgumentError("a TLS client certificate and its key go together");
  }
  if (!options.tls_cert_file.empty()) {
    AIDN_RETURN_IF_ERROR(ReadPem(options.tls_cert_file).status());
    AIDN_RETURN_IF_ERROR(ReadPem(options.tls_key_file).status());
  }
  if (options.tls_ca_file.empty()) return absl::OkStatus();
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
