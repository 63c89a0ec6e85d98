import hashlib

import pytest

from unbroken.errors import CorruptState
from unbroken.train.csvlog import CSVLog, log_state


def test_loading_a_state_rewinds_the_log_to_the_checkpoint(tmp_path):
    path = tmp_path / "metrics.csv"
    log = CSVLog(path)
    log.log(1, 0, "train", "loss", 0.1 + 0.2)
    state = log.state_dict()
    expected = path.read_text()
    log.log(2, 0, "train", "loss", 0.5)  # logged after the checkpoint, before the kill
    log.close()

    resumed = CSVLog(path)
    resumed.load_state_dict(state)
    resumed.log(2, 0, "train", "loss", 0.25)
    resumed.close()
    assert path.read_text() == expected + "2,0,train,loss,0.25\n"
    rows = CSVLog.read(path)
    assert rows[0]["value"] == 0.1 + 0.2  # repr round-trips floats exactly
    assert [r["step"] for r in rows] == [1, 2]


def test_a_log_shorter_than_its_checkpoint_is_an_error(tmp_path):
    log = CSVLog(tmp_path / "m.csv")
    log.log(1, 0, "train", "loss", 1.0)
    state = log.state_dict()
    log.close()
    (tmp_path / "m.csv").write_text("step,epoch,phase,name,value\n")
    with pytest.raises(ValueError, match="was truncated or replaced"):
        CSVLog(tmp_path / "m.csv").load_state_dict(state)
    with pytest.raises(ValueError, match="expected"):
        CSVLog(tmp_path / "m.csv").load_state_dict({"bytes": "x"})


def test_restart_empties_the_log_to_its_header(tmp_path):
    log = CSVLog(tmp_path / "m.csv")
    log.log(1, 0, "train", "loss", 1.0)
    log.restart()
    log.log(1, 0, "train", "loss", 2.0)
    log.close()
    assert [r["value"] for r in CSVLog.read(tmp_path / "m.csv")] == [2.0]


def _logged(path, rows=3):
    log = CSVLog(path)
    for step in range(rows):
        log.log(step, 0, "train", "loss", 1.0 / (step + 1))
    state = log.state_dict()
    log.close()
    return state


def test_the_state_seals_the_logged_bytes_with_their_sha256_kept_as_rows_are_written(tmp_path):
    path = tmp_path / "m.csv"
    state = _logged(path)
    assert state == {"bytes": path.stat().st_size, "sha256": _sha256(path.read_bytes())}
    # Resumed, cut back, logged on: the running hash goes on from the cut.
    log = CSVLog(path)
    log.log(9, 0, "train", "loss", 9.0)  # after the checkpoint, before a kill
    log.close()
    resumed = CSVLog(path)
    resumed.load_state_dict(state)
    resumed.log(3, 0, "train", "loss", 0.25)
    after = resumed.state_dict()
    resumed.close()
    assert after == {"bytes": path.stat().st_size, "sha256": _sha256(path.read_bytes())}
    resumed = CSVLog(path)
    resumed.restart()
    assert resumed.state_dict()["sha256"] == _sha256(b"step,epoch,phase,name,value\n")
    resumed.close()


def _one_digit_changed(data: bytes) -> bytes:
    at = data.index(b"0.5")  # a value of the second row, inside the checkpoint's bytes
    return data[:at] + b"0.6" + data[at + 3 :]


@pytest.mark.parametrize(
    "damage",
    [_one_digit_changed, lambda data: b"x" * len(data)],
    ids=["one digit changed", "replaced by as many x bytes"],
)
def test_a_log_changed_within_its_checkpoints_bytes_is_refused_naming_both_hashes(tmp_path, damage):
    path = tmp_path / "m.csv"
    state = _logged(path)
    good = path.read_bytes()
    path.write_bytes(damage(good) + b"5,0,train,loss,1.0\n")  # and a row after the checkpoint
    found = _sha256(damage(good))
    with pytest.raises(CorruptState) as raised:
        CSVLog(path).load_state_dict(state)
    message = str(raised.value)
    assert raised.value.field == "sha256"
    assert f"{path} changed since the checkpoint was taken" in message
    assert f"first {len(good)} bytes" in message and "Restore it" in message
    assert f"is {found}, and the checkpoint says {state['sha256']}" in message
    assert path.read_bytes().startswith(damage(good))  # refused before anything was cut
    path.write_bytes(good + b"5,0,train,loss,1.0\n")  # restored: the resume goes through
    log = CSVLog(path)
    log.load_state_dict(state)
    log.close()
    assert path.read_bytes() == good


def test_a_state_without_its_sha256_loads_by_its_size_with_a_warning(tmp_path):
    """Saved by unbroken before the log's hash was recorded: accepted, said, and sealed from
    the next checkpoint on."""
    path = tmp_path / "m.csv"
    state = _logged(path)
    with pytest.warns(UserWarning, match=r"no sha256 of them .* checked by their size only"):
        log = CSVLog(path)
        log.load_state_dict({"bytes": state["bytes"]})
    assert log.state_dict() == state
    log.close()
    with pytest.raises(CorruptState, match="64 hex digits"):
        CSVLog(path).load_state_dict({**state, "sha256": "abc"})


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_log_state_reads_the_hash_of_a_logs_first_bytes_from_the_file(tmp_path):
    """What a survivor that saves for the job records of rank 0's log (``train.jit``)."""
    path = tmp_path / "m.csv"
    state = _logged(path, rows=2)
    with open(path, "a") as file:
        file.write("7,0,train,loss,7.0\n")  # logged after the record
    assert log_state(path, state["bytes"]) == state
    assert log_state(tmp_path / "gone.csv", 40) == {"bytes": 40}  # unreadable: no hash
