"""Starting and stopping local processes: the engine child, the stack used by the demo, tests and
benchmarks, free ports and health waits."""
