"""Starting and stopping local processes: the engine child (`engine_process`, `engine_child`), the stack
used by the demo, tests and benchmarks (`stack`), free ports, health probes and the SIGTERM-then-SIGKILL
stop (`processes`), and how an HTTP server under uvicorn stops on a signal (`uvicorn_serving`)."""
