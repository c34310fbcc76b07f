"""The groups and the tokens' layout: collectives (``comm``), process groups and the run's
choices (``topology``, ``options``), token layouts (``sharding``, ``varlen``), per-batch
derived data (``derived``), type names (``protocols``) and logging (``log``).

Nothing here imports from ``modes``, ``models`` or ``training``."""
