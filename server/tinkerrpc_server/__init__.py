"""tinkerrpc server side: the gRPC service, the embedded engine, the OpenAI sidecar and the CLI."""
