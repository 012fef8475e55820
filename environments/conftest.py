"""Puts `environments/` on the import path, so every environment's tests import the shared kit `env_testkit`
(and verifiers can import it as the harness plugin `env_testkit`)."""

import sys
from pathlib import Path

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
