#include "common/rpc/client.h"

#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/channel_arguments.h"

namespace aidn::rpc {

std::shared_ptr<grpc::Channel> MakeChannel(const ChannelOptions& options) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(options.max_message_bytes);
  args.SetMaxSendMessageSize(options.max_message_bytes);
  // Reconnect quickly after a coordinator restart instead of waiting out
  // gRPC's default backoff (up to 120 s).
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 2000);
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  return grpc::CreateCustomChannel(options.address, grpc::InsecureChannelCredentials(), args);
}

void PrepareContext(grpc::ClientContext* context, const std::string& token,
                    std::chrono::milliseconds timeout) {
  if (!token.empty()) context->AddMetadata("authorization", "Bearer " + token);
  if (timeout.count() > 0) context->set_deadline(std::chrono::system_clock::now() + timeout);
}

}  // namespace aidn::rpc
