"""Local attention kernels: the call's spec (``spec``), the backends behind one signature
(``backends``: the choice; ``math_backend``, ``torch_backend``, ``flash_backend``), block
planning and the work counter (``blocks``), sinks and the autograd function (``sinks``),
and the one signature that returns ``(out, lse)`` (``dispatch``)."""
