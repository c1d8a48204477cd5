"""Backend implementations of the ``fusedres`` ops. Each module defines ``unavailable_reason``,
``batch_stats``, ``forward`` and ``backward`` with the signatures of :mod:`fusedres.ops`."""
