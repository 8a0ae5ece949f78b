import sys
from pathlib import Path

# tests/procs.py is shared by every test package.
sys.path.insert(0, str(Path(__file__).parent))
