"""The v1 API's messages and gRPC stubs, generated from proto/aidn/v1 at
build time: job_pb2, cluster_pb2 (+ _grpc), coordinator_pb2 (+ _grpc)."""
