#ifndef AIDN_COMMON_RPC_CLIENT_H_
#define AIDN_COMMON_RPC_CLIENT_H_

// Client-side plumbing shared by aidnctl, the worker and the trainer: one
// place that builds channels (TLS, verifying the coordinator) and attaches
// the bearer token.

#include <chrono>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "grpcpp/channel.h"
#include "grpcpp/client_context.h"

namespace aidn::rpc {

struct ChannelOptions {
  // host:port of the coordinator.
  std::string address = "127.0.0.1:7070";
  // Largest message the client accepts or sends.
  int max_message_bytes = 4 * 1024 * 1024;
  // TLS, verifying the coordinator's certificate against this CA file
  // (PEM; empty: the system's roots) and its name against the address's
  // host. Or, with insecure, plaintext.
  std::string tls_ca_file;
  bool insecure = false;
  // Mutual TLS: the client certificate (PEM) and key this client presents
  // (a worker's, for a coordinator run with --tls-client-ca); both or none.
  std::string tls_cert_file;
  std::string tls_key_file;
};

// The options' CA file read and checked (INVALID_ARGUMENT naming it): for
// the programs to refuse a bad one at start. MakeChannel reads it again.
absl::Status CheckChannelOptions(const ChannelOptions& options);

// A channel that connects lazily. A CA file that cannot be read then is
// logged and the system's roots used, which verify nothing of ours: the
// calls fail (UNAVAILABLE), never go out unverified.
std::shared_ptr<grpc::Channel> MakeChannel(const ChannelOptions& options);

// After a failed call that our own loop retries with its own backoff: makes
// the channel try to connect at once on the next call. Without it gRPC's
// subchannel backoff (which here ignores the channel's max reconnect
// backoff once a connection was lost) keeps a client away from a restarted
// coordinator for tens of seconds. Only for UNAVAILABLE; a no-op otherwise.
void ResetBackoffAfter(const grpc::Status& status, grpc::Channel* channel);

// Adds "authorization: Bearer <token>" (if the token is not empty) and a
// deadline `timeout` from now (if it is positive).
void PrepareContext(grpc::ClientContext* context, const std::string& token,
                    std::chrono::milliseconds timeout);

}  // namespace aidn::rpc

#endif  // AIDN_COMMON_RPC_CLIENT_H_
