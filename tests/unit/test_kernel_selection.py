"""The choice of a linear kernel per row count (`conveyor.kernels.selection`) on timings made up here, so
the rule is checked for CPUs this machine is not: what wins, what a noisy bucket or a small gain does, the
override's syntax, and which cached table a machine reads."""

from __future__ import annotations

import json

import pytest

from conveyor.kernels import selection
from conveyor.kernels.selection import RowDispatch, choose, parse_override

ORDER = ["panel", "onednn", "torch"]


def timings(**per_kernel: dict[int, float]) -> dict[int, dict[str, float]]:
    """`timings(panel={1: 1.0, ...}, onednn={...})` as choose takes them: bucket -> kernel -> seconds."""
    buckets = sorted({b for times in per_kernel.values() for b in times})
    return {b: {name: times[b] for name, times in per_kernel.items() if b in times} for b in buckets}


BUCKETS = selection.ROW_BUCKETS


def test_a_matrix_kernel_takes_the_large_row_counts_where_it_wins():
    """A decode kernel fast at few rows, a GEMM twice as fast from 64 rows on (AMX-like)."""
    table = choose(
        timings(
            panel={b: b * 1.0 for b in BUCKETS},
            onednn={b: b * (2.0 if b < 64 else 0.5) for b in BUCKETS},
            torch={b: b * 3.0 for b in BUCKETS},
        ),
        ORDER,
    )
    assert table == RowDispatch(((1, "panel"), (33, "onednn")))
    assert [table.pick(n) for n in (0, 1, 32, 33, 64, 5000)] == [
        "panel",
        "panel",
        "panel",
        "onednn",
        "onednn",
        "onednn",
    ]
    assert str(table) == "panel 1-32, onednn 33+"


def test_one_kernel_fastest_everywhere_is_used_alone():
    table = choose(timings(panel={b: 2.0 for b in BUCKETS}, onednn={b: 1.0 for b in BUCKETS}), ORDER)
    assert table == RowDispatch(((1, "onednn"),))


def test_a_gain_within_the_margin_keeps_the_first_kernel_and_one_copy_of_the_weights():
    table = choose(timings(panel={b: 1.0 for b in BUCKETS}, onednn={b: 0.97 for b in BUCKETS}), ORDER)
    assert table == RowDispatch(((1, "panel"),))


def test_a_single_noisy_bucket_does_not_split_a_range():
    """torch wins at 8 rows by 30 % once (an interrupted sample of the others), loses everywhere else."""
    table = choose(
        timings(panel={b: 1.0 for b in BUCKETS}, torch={b: (0.7 if b == 8 else 2.0) for b in BUCKETS}),
        ORDER,
    )
    assert table == RowDispatch(((1, "panel"),))


def test_a_measurement_stopped_early_extends_its_last_choice():
    """The budget ended the measurement at 64 rows: every larger step keeps the 64-row choice."""
    measured = [b for b in BUCKETS if b <= 64]
    table = choose(
        timings(panel={b: 1.0 for b in measured}, onednn={b: 5.0 if b < 16 else 0.5 for b in measured}), ORDER
    )
    assert table == RowDispatch(((1, "panel"), (9, "onednn")))
    assert table.pick(100_000) == "onednn"


def test_a_kernel_missing_from_a_bucket_is_not_a_choice():
    times = timings(panel={b: 1.0 for b in BUCKETS}, onednn={b: 0.1 for b in BUCKETS if b != 4})
    assert choose(times, ORDER) == RowDispatch(((1, "panel"),))
    with pytest.raises(ValueError, match="no timings"):
        choose({}, ORDER)


def test_the_override_names_kernels_and_first_rows():
    assert parse_override("panel", ORDER) == RowDispatch(((1, "panel"),))
    assert parse_override("panel, onednn@256", ORDER) == RowDispatch(((1, "panel"), (256, "onednn")))
    assert parse_override("onednn@1,torch@9", ORDER).pick(9) == "torch"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "amx",
            "CONVEYOR_CPU_KERNELS: 'amx' is not a kernel this model can use here .available: panel, onednn, torch",
        ),
        ("panel,onednn", "needs a first row count, as onednn@256"),
        ("panel,onednn@many", "'many' in 'onednn@many' is not a row count"),
        ("panel,onednn@1", "must start at 1 and ascend"),
        ("onednn@4", "must start at 1 and ascend"),
    ],
)
def test_a_bad_override_is_an_error_naming_the_variable(text: str, message: str):
    with pytest.raises(ValueError, match=message) as error:
        parse_override(text, ORDER)
    assert selection.OVERRIDE_ENV in str(error.value)


MACHINE = {
    "cpu": "AMD EPYC",
    "flags": "abc",
    "build": "b",
    "source": "s",
    "torch": "2",
    "threads": "2",
    "version": "1",
}


def test_each_cpu_build_kernel_and_shape_has_its_own_table(tmp_path, monkeypatch):
    import torch

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    base = selection.table_path(MACHINE, (576, 1536), torch.float32, ORDER)
    assert base.parent == tmp_path / "conveyor" / "kernels"
    others = [
        selection.table_path({**MACHINE, field: "other"}, (576, 1536), torch.float32, ORDER)
        for field in MACHINE
    ]
    others += [
        selection.table_path(MACHINE, (1536, 576), torch.float32, ORDER),
        selection.table_path(MACHINE, (576, 1536), torch.bfloat16, ORDER),
        selection.table_path(MACHINE, (576, 1536), torch.float32, ["panel", "torch"]),
    ]
    assert len({base, *others}) == len(others) + 1
    assert selection.table_path(dict(MACHINE), (576, 1536), torch.float32, list(ORDER)) == base


def test_a_cached_table_is_read_back_and_a_broken_one_measured_again(tmp_path, monkeypatch):
    import torch
    from torch import nn

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    measured = []

    def fake_measure(linear, candidates, dtype, buckets=BUCKETS):
        measured.append((linear.in_features, linear.out_features))
        return timings(panel={1: 1.0, 2: 1.0}, torch={1: 2.0, 2: 0.5})

    monkeypatch.setattr(selection, "measure", fake_measure)
    linear = nn.Linear(8, 4)
    candidates = {"panel": lambda linear: linear, "torch": lambda linear: linear}
    first, how = selection.cached_timings(linear, candidates, MACHINE, torch.float32)
    assert how.startswith("measured") and measured == [(8, 4)]
    again, how = selection.cached_timings(linear, candidates, MACHINE, torch.float32)
    assert (again, how, len(measured)) == (first, "cached", 1)
    path = selection.table_path(MACHINE, (8, 4), torch.float32, candidates)
    assert json.loads(path.read_text())["key"] == MACHINE
    path.write_text("{not json")
    assert selection.cached_timings(linear, candidates, MACHINE, torch.float32)[1].startswith("measured")
    assert len(measured) == 2
