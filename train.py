"""``deepspeed train.py --deepspeed_config CFG ...``: the training entry point, kept at the
repository's root so that existing commands keep working. The code is
:mod:`ulysses_cp.train`, also run as ``python -m ulysses_cp.train``, ``deepspeed --module
ulysses_cp.train`` and the ``ulysses-cp-train`` console script."""

from ulysses_cp.train import main, parse_args, run_main

__all__ = ["main", "parse_args", "run_main"]

if __name__ == "__main__":
    run_main()
