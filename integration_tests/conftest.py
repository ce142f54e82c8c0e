import sys
from pathlib import Path

# Spawned workers import the suite's modules (cases, models) by name.
sys.path.insert(0, str(Path(__file__).parent))
