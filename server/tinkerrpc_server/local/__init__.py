"""The local harness, above the bottom layer (`tinkerrpc_server.processes`): `launch` starts a tinkerrpc
process and awaits its ready report (`LocalProcess`), with the one engine launcher (`EngineProcess`,
and `EmbeddedEngine`, `serve`'s engine child); `engine_child` is that child's entry point; `stack` holds
the processes the demo, the examples, the benchmarks and the tests run (serve, engine, sidecar)."""
