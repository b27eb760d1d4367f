"""boostmpi/train/metrics.py: the row holds what docs/FORMATS.md lists (a mutant that drops a memory
figure is caught), trimming on resume, and a refused row reported once."""

import errno
import json
import re
from pathlib import Path

from boostmpi import files
from boostmpi.parallel.comm import CommCounter, HostCollectives
from boostmpi.train import metrics

FORMATS = Path(__file__).resolve().parents[3] / "docs" / "FORMATS.md"


def documented():
    """(row keys, memory keys) from the metrics table of docs/FORMATS.md."""
    text = FORMATS.read_text().split("## Runs and metrics")[1].split("\n## ")[0]
    keys, memory = set(), set()
    for line in text.splitlines():
        if line.startswith("| `"):
            first, meaning = line.split("|")[1:3]
            keys |= set(re.findall(r"`(\w+)`", first))
            if "`memory`" in first:
                memory = set(re.findall(r"`(\w+)`", meaning))
    return keys, memory


def written(memory_keys):
    """(row keys, memory keys) of a row as the trainer makes it on a logged, validating step of a GPU
    whose machine profile is known (the one case with `mfu`; without it the key is left out)."""
    counter = CommCounter()
    counter.add("tp", 64)
    assert "mfu" not in metrics.step_row(3, 2.5, 1e-3, 0.7, 0.5, 1024, metrics.counter_floats(counter))
    row = metrics.step_row(3, 2.5, 1e-3, 0.7, 0.5, 1024, metrics.counter_floats(counter), mfu=0.41)
    assert row["comm_bytes"] == {"tp": 64, "pp": 0, "dp": 0} and row["comm_calls"]["tp"] == 1
    assert row["tokens"] == 3 * 1024 and row["tokens_per_s"] == 2048
    figures = [float(i) for i in range(len(memory_keys))]
    row["memory"] = {k: int(v) for k, v in zip(memory_keys, HostCollectives(None).max(figures))}
    row["val_loss"] = 2.4
    return set(row), set(row["memory"])


def test_a_row_holds_what_the_formats_doc_lists():
    assert written(metrics.MEMORY_KEYS) == documented()


def test_the_mutant_without_the_snapshot_figure_is_caught():
    assert written(tuple(k for k in metrics.MEMORY_KEYS if k != "checkpoint_snapshot")) != documented()


def test_trim_drops_rows_past_the_step_or_all_of_them(tmp_path):
    path = tmp_path / metrics.FILE
    path.write_text("".join(json.dumps({"step": s}) + "\n" for s in (1, 2, 3, 4)))
    assert metrics.trim(tmp_path, 2) == ['{"step": 3}\n', '{"step": 4}\n']
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2]
    path.write_text('{"step": 1}\n{"step": 2, "lo\n')  # all dropped without reading them: a torn last row is fine
    assert len(metrics.trim(tmp_path, None)) == 2 and path.read_text() == ""
    assert metrics.set_aside([]) is None and metrics.set_aside(['{"step": 3}\n']) == {"metrics.jsonl": '{"step": 3}\n'}


def test_a_refused_row_is_reported_once_and_later_rows_are_dropped(tmp_path, monkeypatch):
    log = metrics.MetricsFile(tmp_path)
    assert log.append({"step": 1}) is None

    def refuse(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(files, "_write_all", refuse)
    failure = log.append({"step": 2})
    assert isinstance(failure, files.FilesystemError) and "no space left on device" in str(failure)
    monkeypatch.undo()
    assert log.append({"step": 3}) is None  # dropped: the run stops at the next agreement
    log.close()
    assert (tmp_path / metrics.FILE).read_text() == '{"step": 1}\n'
