"""Applications built on the library: the command-line dispatcher (``fusedres``), the trainer,
the benchmarks, the experiments on trained runs, the demo and the self-test.

They use the library's public API, as a user's code would; the library never imports them
(tests/test_layout.py). ``fusedres <command>`` starts them (:mod:`fusedres.apps.cli`).
"""
