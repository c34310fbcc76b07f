"""Distributed attention on N CPU ranks against full float64 attention: the repository's
shim of :mod:`ulysses_cp.check_attention` (also ``python -m ulysses_cp.check_attention``
and the ``ulysses-cp-check`` console script)."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ulysses_cp.check_attention import main

if __name__ == "__main__":
    main()
