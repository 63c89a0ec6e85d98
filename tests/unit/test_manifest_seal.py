"""A manifest vouches for its checkpoint only when sealed and of its directory's step: one
without its seal, or sealed for another step, is refused by ``read_manifest``, skipped by
``load_latest`` with the reason, and failed by ``unbroken verify``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import reseal

import unbroken.cli
from unbroken.checkpoint import Checkpointer, LocalStorage
from unbroken.checkpoint.layout import MANIFEST, SEAL, read_manifest
from unbroken.errors import CorruptCheckpoint


def _unsealed(checkpoint: Path) -> None:
    manifest = json.loads((checkpoint / MANIFEST).read_text())
    del manifest[SEAL]  # every other field as written
    (checkpoint / MANIFEST).write_text(json.dumps(manifest))


DAMAGE = {
    "no seal": (_unsealed, "does not match its own sha256"),
    "an earlier step": (lambda c: reseal(c, step=1), "says step 1, its directory 2"),
    "a later step": (lambda c: reseal(c, step=5), "says step 5, its directory 2"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_manifest_without_its_seal_or_of_another_step_is_refused(tmp_path, damage, capsys):
    make, reason = DAMAGE[damage]
    checkpointer = Checkpointer(tmp_path)
    checkpointer.save(1, {"value": "one"})
    newest = Path(checkpointer.save(2, {"value": "two"}))
    make(newest)
    with pytest.raises(CorruptCheckpoint, match=reason):
        read_manifest(LocalStorage(), str(newest), 2)
    with pytest.warns(UserWarning, match=f"skipping checkpoint {newest}: .*{reason}"):
        restored = Checkpointer(tmp_path).load_latest({"value": None})
    assert restored is not None and (restored.step, restored.values) == (1, {"value": "one"})
    assert unbroken.cli.main(["verify", str(tmp_path), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    verdicts = {c["step"]: (c["status"], c["problems"]) for c in report["checkpoints"]}
    assert verdicts[1] == ("ok", [])
    assert verdicts[2][0] == "corrupt" and reason in " ".join(verdicts[2][1])
