import sys
from pathlib import Path

# bench/ lives at the repository root, outside the installed packages.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
