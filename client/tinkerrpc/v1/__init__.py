"""Generated protobuf and gRPC code for tinkerrpc.v1 (do not edit)."""
