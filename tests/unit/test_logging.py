"""The run messages go through ``logging.getLogger("unbroken")`` (``unbroken._log``): shown as
before to a user who configures nothing, taken over, filtered or silenced by one who does.
Run in a fresh interpreter: pytest puts capture handlers of its own on the root logger."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = r"""
import logging, sys
from unbroken.train.progress import say

say("nothing configured")
print("--", file=sys.stderr, flush=True)
logging.basicConfig(format="%(name)s|%(levelname)s|%(message)s")
say("basicConfig")
print("--", file=sys.stderr, flush=True)
logging.getLogger("unbroken").setLevel(logging.WARNING)
say("silenced")
print("--", file=sys.stderr, flush=True)
logging.getLogger("unbroken").setLevel(logging.INFO)
logging.getLogger("unbroken").addFilter(lambda record: "keep" in record.getMessage())
say("filtered out")
say("keep this")
"""


def test_messages_show_by_default_and_follow_the_users_logging_config():
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120, check=True
    )
    default, configured, silenced, filtered = result.stderr.split("--\n")
    assert default == "unbroken: nothing configured\n"
    assert configured == "unbroken|INFO|basicConfig\n"  # once: the default line steps aside
    assert silenced == ""
    assert filtered == "unbroken|INFO|keep this\n"
    assert result.stdout == ""
