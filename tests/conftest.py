import os

# Tests run torch in-process beside server and engine processes on few cores: spinning OpenMP
# workers would make every step many times slower (see tinkerrpc_server.settings; the tests keep the
# workers from spinning at all, the safest on a busy CI machine). Set before torch loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TINKER_TELEMETRY", "0")
