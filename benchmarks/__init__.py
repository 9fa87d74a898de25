"""dloom's benchmarks: a package of this checkout, not of the installed wheel.

Run a benchmark from the repository root as a module, e.g. ``python -m benchmarks.report``
or ``python -m benchmarks.operating_points``; the modules import one another as
``benchmarks.<module>``. ``report`` and ``operating_points`` are the published reports
(``report_*`` are their parts: measuring, storing, tables, plots, targets), ``bench_*`` the
focused benchmarks, ``gpu/`` the probes run on a GPU machine. Each module's docstring names
its command and the results file it writes under ``benchmarks/results/``.
"""
