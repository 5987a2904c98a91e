"""Put tests/integration/scripts on sys.path, so the GPU scripts share its helpers (imported first, for effect)."""

import sys
from pathlib import Path

INTEGRATION_SCRIPTS = Path(__file__).resolve().parents[2] / "integration" / "scripts"
if str(INTEGRATION_SCRIPTS) not in sys.path:
    sys.path.insert(0, str(INTEGRATION_SCRIPTS))
