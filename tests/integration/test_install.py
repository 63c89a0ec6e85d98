"""The install commands in the README and the docs work from a checkout: each names this checkout,
an extra that pyproject.toml defines, or the wheel that `make wheel` builds. The package-index form
is allowed only in a block marked as not working yet."""

import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import tomllib
from locations import ROOT

import unbroken

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("**/*.md"))]
EXTRAS = set(
    tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
)
WHEEL = f"dist/unbroken-{unbroken.__version__}-py3-none-any.whl"
# A shell block: its language is bash or sh; ```text blocks are shown, not run.
_SHELL_BLOCK = re.compile(r"```(?:bash|sh|shell)\n(.*?)```", re.DOTALL)
_TARGET = re.compile(r"^(?P<path>\.|" + re.escape(WHEEL) + r")(?:\[(?P<extras>[a-z0-9_,-]+)\])?$")


def _install_lines() -> list[tuple[str, str]]:
    found = []
    for page in PAGES:
        for block in _SHELL_BLOCK.findall(page.read_text()):
            for line in block.splitlines():
                command = line.split("#", 1)[0].strip()
                if command.startswith("pip install"):
                    found.append((page.relative_to(ROOT).as_posix(), command))
    return found


def test_the_docs_show_install_commands():
    pages = {page for page, _ in _install_lines()}
    assert {"README.md", "docs/install.md"} <= pages


@pytest.mark.parametrize(("page", "command"), _install_lines())
def test_every_install_command_names_the_checkout_or_its_wheel(page, command):
    """``pip install unbroken`` fails while no such package is on the index: a shell block may
    only install this checkout (``.``, ``".[hf]"``) or the wheel ``make wheel`` builds."""
    targets = [word.strip("'\"") for word in command.split()[2:] if not word.startswith("-")]
    for target in targets:
        if not target.startswith(("unbroken", ".", "dist/")):
            continue  # another project's package, which the index has
        match = _TARGET.match(target)
        assert match, (
            f"{page}: `{command}` installs {target!r}, which no package index has yet; "
            f"install the checkout (pip install '.[extra]') or {WHEEL}"
        )
        extras = set(filter(None, (match["extras"] or "").split(",")))
        assert extras <= EXTRAS, (
            f"{page}: `{command}` names extras {extras - EXTRAS} not in pyproject"
        )


def test_the_index_form_is_marked_as_not_working_yet():
    text = (ROOT / "docs" / "install.md").read_text()
    released = text.split("## Once released", 1)
    assert len(released) == 2, "docs/install.md keeps the index form under '## Once released'"
    assert "do not\nwork yet" in released[1] or "do not work yet" in released[1]


def test_make_wheel_builds_the_documented_wheel_and_it_imports(tmp_path):
    """The wheel the install page names is what ``make wheel``'s command builds; installed alone
    (no checkout on the path) it imports, declares every extra and carries the CLI."""
    makefile = (ROOT / "Makefile").read_text()
    assert "-m pip wheel" in makefile.split("\nwheel:", 1)[1].split("\n\n", 1)[0]
    out = tmp_path / "dist"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--disable-pip-version-check", "--no-deps"]
        + ["--no-build-isolation", "-w", str(out), str(ROOT)],
        check=True,
        timeout=300,
    )
    wheel = out / Path(WHEEL).name
    assert wheel.exists(), sorted(p.name for p in out.iterdir())
    with zipfile.ZipFile(wheel) as archive:
        metadata = archive.read(f"unbroken-{unbroken.__version__}.dist-info/METADATA").decode()
        entry_points = archive.read(f"unbroken-{unbroken.__version__}.dist-info/entry_points.txt")
    assert set(re.findall(r"^Provides-Extra: (\S+)$", metadata, re.MULTILINE)) == EXTRAS
    assert b"unbroken = unbroken.cli:main" in entry_points
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps"]
        + ["--target", str(target), str(wheel)],
        check=True,
        timeout=300,
    )
    where = subprocess.run(
        [
            sys.executable,
            "-c",
            "import unbroken, sys; print(unbroken.__file__, unbroken.__version__)",
        ],
        cwd=tmp_path,
        env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout.split()
    assert Path(where[0]).is_relative_to(target) and where[1] == unbroken.__version__
