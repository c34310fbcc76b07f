"""Sequence-parallel attention: ``attention`` (checks, then dispatch by mode), ``ulysses``
(all-to-all around an inner attention) and ``ring`` (KV ring with LSE merge). The hybrid
mode is the Ulysses all-to-all around the ring."""
