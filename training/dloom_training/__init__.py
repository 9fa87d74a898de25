"""dloom's training tools, kept out of the installed package: the zoo's trainer
(:mod:`dloom_training.train`). Run from a source checkout with ``training/`` on the path::

    PYTHONPATH=training python -m dloom_training.train --help
"""
