"""The benchmarks' shared harness: machine metadata and load probes (``env``), JSON results
(``results``), medians with intervals and interleaved rounds (``stats``), the workloads
(``workloads``: imports torch), scripts and workers under torchrun (``jobs``), S3 request counts
(``s3``) and the one figure shape (``plot``: imports matplotlib).

Scripts put ``benchmarks/`` on ``sys.path`` and import from here; nothing is imported at
package import but the standard library and numpy.
"""

from .env import (
    REPO,
    ForeignLoad,
    command_line,
    environment,
    environment_info,
    git,
    load_line,
    table,
)
from .results import Results, add_json_option, add_options, add_round_options, jsonable, parser
from .stats import (
    interleaved,
    median,
    median_ci,
    probe_note,
    probed_rounds,
    quartiles,
    rotated,
    spread,
)

__all__ = [
    "REPO",
    "ForeignLoad",
    "Results",
    "add_json_option",
    "add_options",
    "add_round_options",
    "command_line",
    "environment",
    "environment_info",
    "git",
    "interleaved",
    "jsonable",
    "load_line",
    "median",
    "median_ci",
    "parser",
    "probe_note",
    "probed_rounds",
    "quartiles",
    "rotated",
    "spread",
    "table",
]
