import sys
from pathlib import Path

# Spawned workers import the helper modules (_ring_cases, models, harness) by name.
root = Path(__file__).resolve().parents[3]
for p in (Path(__file__).parent, root / "integration_tests"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))
