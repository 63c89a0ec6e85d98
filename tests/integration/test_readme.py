"""Every python block of the README and the docs runs as written; the data quickstart survives SIGKILL."""

import json
import logging
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from locations import ROOT

import unbroken

README = ROOT / "README.md"


DOCS = sorted((README.parent / "docs").glob("**/*.md"))


def _blocks(language: str, page: Path = README) -> list[tuple[str, str]]:
    """(the heading above it, code) of every fenced block in `language`."""
    found, heading = [], "top"
    lines = page.read_text().splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("#"):
            heading = line.lstrip("# ").strip()
        elif line.strip() == f"```{language}":
            end = lines.index("```", i + 1)
            found.append((heading, "\n".join(lines[i + 1 : end]) + "\n"))
            i = end
        i += 1
    return found


PYTHON = _blocks("python")


def _id(heading: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", heading.lower()).strip("-")


# Blocks in these languages run; `bash` and `text` blocks are shown, not run (commands, output,
# diagrams). Any other language, or a fence without one, would go unnoticed: refused.
LANGUAGES = {"python", "json", "sh", "bash", "text"}


def test_the_readme_has_the_blocks_this_file_tests():
    fences = [line for line in README.read_text().splitlines() if line.startswith("```")]
    languages = {fence[3:] for fence in fences if fence != "```"}
    assert languages <= LANGUAGES, languages
    assert len(PYTHON) >= 1  # the Trainer quickstart
    assert len(DOC_PYTHON) >= 15


DOC_PYTHON = [
    (page.relative_to(README.parent).as_posix(), heading, code)
    for page in DOCS
    for heading, code in _blocks("python", page)
]


@pytest.mark.parametrize("heading, code", PYTHON, ids=[_id(h) for h, _ in PYTHON])
def test_a_python_block_runs_as_written(heading, code, tmp_path, monkeypatch):
    _run_twice(f"README.md ({heading})", code, tmp_path, monkeypatch)


@pytest.mark.parametrize(
    "page, heading, code", DOC_PYTHON, ids=[f"{p}-{_id(h)}" for p, h, _ in DOC_PYTHON]
)
def test_a_python_block_of_the_docs_runs_as_written(page, heading, code, tmp_path, monkeypatch):
    _run_twice(f"{page} ({heading})", code, tmp_path, monkeypatch)


def test_the_docs_blocks_are_python_or_shell():
    for page in DOCS:
        fences = [line for line in page.read_text().splitlines() if line.startswith("```")]
        assert {fence[3:] for fence in fences if fence != "```"} <= LANGUAGES, page
        opened = [fence for fence in fences[::2] if fence == "```"]
        assert not opened, f"{page}: a block without a language"


def _run_twice(name: str, code: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # blocks write runs/, checkpoints/ ... relative to the cwd
    program = compile(code, name, "exec")
    # A block may configure logging, as a user would: the next tests get the suite's back.
    root, ours = logging.getLogger(), logging.getLogger("unbroken")
    saved = list(root.handlers), root.level, ours.level, list(ours.filters)
    try:
        for _ in range(2):  # the second run finds what the first left, as a restarted job does
            exec(program, {"__name__": "__readme__"})
    finally:
        root.handlers[:], ours.filters[:] = saved[0], saved[3]
        root.setLevel(saved[1])
        ours.setLevel(saved[2])


def test_the_state_format_block_is_what_state_dict_returns():
    ((heading, block),) = _blocks("json", README.parent / "docs" / "guides" / "resume-contract.md")
    documented = json.loads(block)
    loader = unbroken.DataLoader(
        torch.utils.data.TensorDataset(torch.arange(50_000.0)),
        batch_size=32,
        shuffle=True,
        seed=1234,
    )
    state = loader.state_dict()
    assert documented.keys() == state.keys()
    assert documented["fingerprint"].keys() == state["fingerprint"].keys()
    assert {k: documented[k] for k in ("format", "version")} == {
        k: state[k] for k in ("format", "version")
    }


def test_the_data_quickstart_resumes_after_sigkills_at_random_moments(tmp_path):
    """The old quickstart's `json.dump(open(..., "w"))` left an empty file in 12 of 15 kills."""
    data = README.parent / "docs" / "quickstart" / "data.md"
    code = next(
        code for heading, code in _blocks("python", data) if heading == "Quickstart: only the data"
    )
    script = tmp_path / "quickstart.py"
    script.write_text(code)
    checkpoints = tmp_path / "data-checkpoints"
    rng = random.Random(os.environ.get("UNBROKEN_KILL_SEED"))
    kills = 0
    for _ in range(6):
        process = subprocess.Popen(
            [sys.executable, str(script)], cwd=tmp_path, stderr=subprocess.PIPE, text=True
        )
        before = _steps(checkpoints)
        while process.poll() is None and _steps(checkpoints) == before:  # some progress first
            time.sleep(0.001)
        time.sleep(rng.uniform(0, 0.05))
        if process.poll() is not None:
            break
        process.send_signal(signal.SIGKILL)
        process.wait()
        kills += 1
    final = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True
    )
    assert final.returncode == 0, final.stderr
    assert kills >= 3
    assert "skipping checkpoint" not in final.stderr  # every committed checkpoint was whole


def _steps(directory: Path) -> set:
    try:
        return {p.name for p in directory.iterdir() if p.name.startswith("step-")}
    except FileNotFoundError:
        return set()
