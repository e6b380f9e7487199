"""Benchmarks of the BST implementation, a package: run each from the repository root as a module,

    python -m benchmarks.layer_speed --quick
    python -m benchmarks.train_throughput --quick
    python -m benchmarks.generation_speed --quick
    bash benchmarks/gpu_suite.sh OUTDIR      # = python -m benchmarks.gpu_suite OUTDIR

and import shared pieces as ``benchmarks.bench_common`` / ``benchmarks.docs_section`` (and ``reporting``, shared with
research/: the machine's name, the docs section writer). No module edits ``sys.path``.
"""
