import pytest

from unbroken.train.csvlog import CSVLog


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
