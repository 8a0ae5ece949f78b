"""The bottom layer of everything that runs local processes, written once and importing nothing of
tinkerrpc's: child processes that report the ports they bound and whose exit is awaited (`children`),
one owner per data dir and port (`ownership`), HTTP readiness probes (`probes`), who is on the other end of a connection (`peers`), and how an HTTP server
runs under uvicorn and stops on a signal (`http_serving`). The harness above it (`local/`) and the
engine, sidecar and gRPC entry points use it; nothing here knows which program it serves."""
