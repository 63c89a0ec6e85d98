"""A run directory in object storage whose ``metrics.csv`` was truncated or deleted in the bucket:
``unbroken verify`` fails on it (a resume needs the log as long as the newest checkpoint
records, and those bytes as they were: their sha256 is under its seal), and both it and the
resume name the ``s3://`` object and the way out; once the object
is restored, the resume goes through. (Against the moto S3 server on 127.0.0.1.)"""

from __future__ import annotations

import hashlib
import json
import secrets

import pytest

import unbroken.cli
from unbroken.checkpoint import FsspecStorage
from unbroken.errors import CorruptState


def _verify(url: str, s3, capsys) -> tuple[int, dict, str]:
    options = ["--storage-options", json.dumps(s3.storage_options)]
    status = unbroken.cli.main(["verify", url, *options, "--json"])
    document = json.loads(capsys.readouterr().out)
    assert unbroken.cli.main(["verify", url, *options]) == status
    return status, document, capsys.readouterr().out


def test_a_damaged_log_in_the_bucket_fails_verify_and_the_resume_naming_the_object(s3, capsys):
    from trainer_job import run

    url = s3.make_bucket(f"log-{secrets.token_hex(4)}") + "/runs/exp1"
    options = {"storage_options": s3.storage_options, "lease_seconds": 2.0}
    run(url, epochs=1, **options)
    log = f"{url}/metrics.csv"
    fs = FsspecStorage(url, s3.storage_options, cache=False).fs
    whole = fs.cat_file(log)
    for damage, found in [("truncated", f"has {len(whole) // 2} bytes"), ("deleted", "is missing")]:
        if damage == "truncated":
            fs.pipe_file(log, whole[: len(whole) // 2])
        else:
            fs.rm_file(log)
        status, document, text = _verify(url, s3, capsys)
        assert status == 1 and document["ok"] is False, damage
        said = f"{log} {found}, and checkpoint step-000000015 says {len(whole)} were logged"
        assert said in text and "Restore the log" in text, text
        assert document["resume"]["fails"].startswith(said)
        assert document["log"]["ok"] is False and document["log"]["expected"] == len(whole)
        with pytest.raises(CorruptState) as raised:
            run(url, epochs=2, **options)
        assert f"{log} has " in str(raised.value) and "Restore it" in str(raised.value)
        assert f"says {len(whole)} were logged" in str(raised.value)
    changed = whole.replace(b",train,", b",tra1n,", 1)  # as many bytes, one changed
    fs.pipe_file(log, changed)
    status, document, text = _verify(url, s3, capsys)
    said = f"{log} changed since checkpoint step-000000015 was taken: the sha256 of its first"
    assert status == 1 and said in text and document["resume"]["fails"].startswith(said)
    with pytest.raises(CorruptState, match=f"{log} changed since the checkpoint was taken"):
        run(url, epochs=2, **options)
    fs.pipe_file(log, whole)  # the way out: the object restored
    status, document, _ = _verify(url, s3, capsys)
    assert status == 0 and document["log"] == {
        "path": log,
        "bytes": len(whole),
        "expected": len(whole),  # the final checkpoint records the whole log
        "sha256": hashlib.sha256(whole).hexdigest(),  # and the sha256 of it
        "ok": True,
        "problem": None,
    }
    run(url, epochs=2, **options)
    assert fs.cat_file(log).startswith(whole)
