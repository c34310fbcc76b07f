"""``train.py`` with one injected fault (``tests/support/faults.py``), for the reliability tests:
the same arguments, and the fault from the ``UCP_FAULT`` variable the test sets."""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path[:0] = [
    str(Path(__file__).resolve().parents[2])
]  # the repository, for tests.support.faults

import train  # noqa: E402
from tests.support.faults import FaultHooks  # noqa: E402

if __name__ == "__main__":
    spec = os.environ.get("UCP_FAULT")
    train.run_main(hooks=FaultHooks(spec) if spec else None)
