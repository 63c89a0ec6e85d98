"""Where the suite's files are, computed in one place: the repository's root, and this folder
of job scripts and shared helpers (``tests/conftest.py`` puts it on ``sys.path``)."""

from pathlib import Path

SUPPORT = Path(__file__).resolve().parent
"""``tests/support``: the job scripts the tests start (``ddp_job.py``, ``trainer_job.py``, ...)."""
ROOT = SUPPORT.parents[1]
"""The repository's root (README.md, docs/, benchmarks/, src/)."""
