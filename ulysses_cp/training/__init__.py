"""Training through DeepSpeed: ``engine`` (the one module that imports deepspeed),
``build`` (model, optimizer, checks before any collective), ``trainer`` (the loop),
``checkpoint``, ``data``, ``nonfinite`` and ``tracking``."""
