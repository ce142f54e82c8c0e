import sys
from pathlib import Path

# The shared integration helpers (models, harness) are imported by name.
root = Path(__file__).resolve().parents[3]
if str(root / "integration_tests") not in sys.path:
    sys.path.insert(0, str(root / "integration_tests"))
