"""Makes sched_factories importable whatever pytest's import mode is."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
