"""`make bench-sweep` (benchmarks/sweep.py): the grid and its requests, and a small grid run end to end
against a second conveyor server (`--peer conveyor`; vLLM's CPU build is a several-GB install the
test run does not make), real servers and HTTP."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conveyor.benchmarks import sweep


def test_the_grid_and_its_requests() -> None:
    cells = sweep.grid([128, 1024], [1, 16], [64], [768, 256, 16, 64])
    assert [c.name for c in cells] == [
        "prompt 128 x 1 seqs x out 64",
        "prompt 128 x 16 seqs x out 64",
        "prompt 1024 x 1 seqs x out 64",
        "prompt 1024 x 16 seqs x out 64",
        "prompt 1024 (shared 768) x 16 seqs x out 64",
    ]
    warm, timed = sweep.cell_requests(cells[-1], seed=3)
    assert [len(r.prompt) for r in timed] == [1024] * 16 and {r.output_len for r in timed} == {64}
    assert len({tuple(r.prompt[:768]) for r in timed}) == 1  # one prefix ...
    assert len({tuple(r.prompt[768:]) for r in timed}) == 16  # ... and tokens of their own
    assert len(warm) == 1 and warm[0].prompt[:768] == timed[0].prompt[:768] and warm[0].output_len == 1
    assert sweep.cell_requests(cells[-1], seed=3) == (warm, timed)  # the same for both servers
    plain_warm, plain = sweep.cell_requests(cells[1], seed=4)
    assert plain_warm == [] and len({tuple(r.prompt[:16]) for r in plain}) == 16


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--prompt-lens", "0"], "--prompt-lens: must be at least 1, got 0"),
        (["--shared-prefix", "1", "2"], "--shared-prefix: expected 4 arguments"),
        (["--peer", "bogus"], "--peer: invalid choice: 'bogus'"),
        (["--dtypes", "int8"], "--dtypes: invalid choice: 'int8'"),
    ],
)
def test_bad_arguments_are_refused_by_name(argv, message, capsys) -> None:
    with pytest.raises(SystemExit) as exited:
        sweep.main(argv)
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.slow
def test_a_small_sweep_against_a_second_server(tmp_path: Path) -> None:
    argv = ["--prompt-lens", "16", "48", "--running", "1", "3", "--output-lens", "4"]
    argv += ["--shared-prefix", "32", "8", "2", "4", "--peer", "conveyor", "--kv-cache-gib", "1"]
    assert sweep.main([*argv, "--out", str(tmp_path)]) == 0
    (record_path,) = tmp_path.glob("sweep_*.json")
    record = json.loads(record_path.read_text())
    assert record["max_num_seqs"] == 3 and record["max_model_len"] == 48 + 4
    assert len(record["rows"]) == 5
    for row in record["rows"]:
        for runs in (record["conveyor"], record["peer_runs"]):
            run = runs[row["cell"]]
            assert (run["failed"], run["completed"]) == (0, row["running"]), run["first_error"]
            assert run["output_tokens"] == row["running"] * row["output_len"]
        assert row["ratio"] == pytest.approx(row["ours"] / row["peer"])
    assert (tmp_path / record_path.name.replace(".json", ".png")).stat().st_size > 0
    text = (tmp_path / "sweep.md").read_text()
    assert "| prompt 40 (shared 32) x 2 seqs x out 4 |" in text
