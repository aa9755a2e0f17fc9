"""Clusters, Sia's configuration set and goodput tables."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
from hypothesis import given
from hypothesis import strategies as st

from goodput import Cluster, GoodputTable, ValidationError, load_tables, save_tables
from goodput.errors import DataFormatError, UnknownGPUTypeError


def test_sia_configuration_set_for_the_three_type_cluster():
    cluster = Cluster.parse("t4:6x4,a100:2x8,rtx2080ti:3x8")
    configs = cluster.configurations()
    assert len(configs) == 19
    assert [c for c in configs if c[0] == "t4"] == [
        ("t4", 1, 1), ("t4", 1, 2), ("t4", 1, 4), ("t4", 2, 8), ("t4", 3, 12), ("t4", 4, 16), ("t4", 5, 20), ("t4", 6, 24)
    ]
    assert [c for c in configs if c[0] == "a100"] == [("a100", 1, 1), ("a100", 1, 2), ("a100", 1, 4), ("a100", 1, 8), ("a100", 2, 16)]
    assert cluster.total_gpus == 24 + 16 + 24
    assert cluster.capacity("RTX2080TI") == 24


def test_from_dict_equals_parse_and_round_trips():
    spec = {"t4": {"nodes": 6, "gpus_per_node": 4}, "a100": {"nodes": 2, "gpus_per_node": 8}}
    cluster = Cluster.from_dict(spec)
    assert cluster == Cluster.parse("t4:6x4,a100:2x8")
    assert str(cluster) == "t4:6x4,a100:2x8"
    assert Cluster.from_dict(cluster.to_dict()) == cluster


def test_non_power_of_two_node():
    assert Cluster.parse("v100:2x6").configurations() == [("v100", 1, 1), ("v100", 1, 2), ("v100", 1, 4), ("v100", 1, 6), ("v100", 2, 12)]


@pytest.mark.parametrize("spec", ["", "t4", "t4:6", "t4:0x4", "t4:6x0", "t4:6x4,t4:1x1", "T4 :6y4", "t4:-1x4"])
def test_bad_specs_raise(spec):
    with pytest.raises(ValidationError):
        Cluster.parse(spec)


def test_bad_dicts_raise():
    with pytest.raises(ValidationError, match="gpus_per_node"):
        Cluster.from_dict({"t4": {"nodes": 2}})
    with pytest.raises(ValidationError, match="colour"):
        Cluster.from_dict({"t4": {"nodes": 2, "gpus_per_node": 4, "colour": "red"}})
    with pytest.raises(UnknownGPUTypeError):
        Cluster.parse("t4:1x1").pool("h100")


@given(st.dictionaries(st.sampled_from(["t4", "a100", "v100", "h100"]),
                       st.tuples(st.integers(1, 16), st.integers(1, 16)), min_size=1))
def test_property_configurations(spec):
    cluster = Cluster.from_dict({k: {"nodes": n, "gpus_per_node": g} for k, (n, g) in spec.items()})
    configs = cluster.configurations()
    assert len(configs) == len(set(configs))
    for gpu, nodes, gpus in configs:
        pool = cluster.pool(gpu)
        assert gpus <= pool.gpus and nodes <= pool.nodes
        assert (nodes == 1 and gpus <= pool.gpus_per_node) or gpus == nodes * pool.gpus_per_node


def rows():
    return [
        {"gpu_type": "t4", "num_nodes": 1, "num_gpus": 1, "goodput": 400.0, "std": 4.0},
        {"gpu_type": "t4", "num_nodes": 1, "num_gpus": 2, "goodput": 700.0, "std": 9.0},
        {"gpu_type": "a100", "num_nodes": 1, "num_gpus": 1, "goodput": 1600.0, "std": 1.0},
        {"gpu_type": "a100", "num_nodes": 2, "num_gpus": 16, "goodput": 0.0, "std": 0.0},
    ]


def test_normalized_goodput_row_minimum_is_one():
    table = GoodputTable("job", rows())
    norm = table.normalized()
    assert norm[norm > 0].min() == pytest.approx(1.0)
    assert norm.tolist() == pytest.approx([1.0, 1.75, 4.0, 0.0])
    assert table.best()["gpu_type"] == "a100"
    assert table.lookup("T4", 1, 2)["goodput"] == 700.0
    assert table.lookup("t4", 2, 8) is None


def test_normalized_goodput_stays_finite_beside_a_subnormal_goodput():
    table = GoodputTable("job", [{"gpu_type": "t4", "num_nodes": 1, "num_gpus": 1, "goodput": 5e-324},
                                 {"gpu_type": "t4", "num_nodes": 1, "num_gpus": 2, "goodput": 10.0}])
    norm = table.normalized()
    assert np.isfinite(norm).all() and norm.tolist() == [1.0, np.finfo(float).max]
    assert json.loads(json.dumps(norm.tolist(), allow_nan=False))  # strict JSON (an allocation's details): no Infinity


@pytest.mark.parametrize(
    "change, field",
    [
        ({"goodput": float("nan")}, "goodput"),
        ({"goodput": -1.0}, "goodput"),
        ({"num_gpus": 0}, "num_gpus"),
        ({"num_nodes": 3}, "num_nodes"),
        ({"gpu_type": "T4?"}, "gpu_type"),
        ({"num_gpus": 1.5}, "num_gpus"),
        ({"goodput": 1 + 5j}, "goodput"),  # numpy had dropped the imaginary part with a warning
    ],
)
def test_bad_rows_raise_naming_the_column(change, field):
    data = rows()
    data[1] = {**data[1], **change}
    with pytest.raises(ValidationError, match=field):
        GoodputTable("job", data)


def test_a_table_keeps_what_it_validated_when_the_callers_data_change():
    """The table's float columns had been the caller's own buffers: editing the frame afterwards put a negative
    goodput past validation, and from_columns made the caller's arrays read-only (found in review)."""
    import numpy as np

    frame = pd.DataFrame(rows())
    table = GoodputTable("job", frame)
    before = table.frame["goodput"].tolist()
    frame.loc[0, "goodput"] = -5.0
    assert table.frame["goodput"].tolist() == before
    goodput = np.array([100.0, 200.0])
    table = GoodputTable.from_columns("job", {"gpu_type": ["t4", "t4"], "num_nodes": [1, 1], "num_gpus": [1, 2],
                                              "goodput": goodput})
    goodput[0] = -1.0  # still the caller's to change, and the table's unchanged
    assert table.column_arrays()["goodput"].tolist() == [100.0, 200.0]


def test_duplicates_and_missing_columns_raise():
    with pytest.raises(ValidationError, match="twice"):
        GoodputTable("job", rows() + [rows()[0]])
    with pytest.raises(ValidationError, match="goodput"):
        GoodputTable("job", pd.DataFrame(rows()).drop(columns="goodput"))


def test_unreadable_table_files_are_data_format_errors_and_save_tables_writes_only_what_loads(tmp_path):
    """Raw UnicodeDecodeError/ParserError had escaped the readers; save_tables had written two tables of one job
    (which load_tables refuses) and dropped the mapping's keys."""
    from goodput.allocator import Allocation

    (tmp_path / "t.xlsx").write_bytes(b"PK\x03\x04\xff\xfe binary")
    (tmp_path / "ragged.csv").write_text("job,gpu_type,num_nodes,num_gpus,goodput\nj,t4,1,1,2.0\nj,t4,1,2,3.0,9\n")
    for read, name, field in ((load_tables, "t.xlsx", "encoding"), (GoodputTable.from_json, "t.xlsx", "encoding"),
                              (Allocation.from_json, "t.xlsx", "encoding"), (GoodputTable.from_csv, "t.xlsx", "encoding"),
                              (GoodputTable.from_csv, "ragged.csv", "csv")):
        with pytest.raises(DataFormatError) as info:
            read(tmp_path / name)
        assert info.value.field == field, (read, name)
    table = GoodputTable("cifar10", rows())
    with pytest.raises(ValidationError, match="two tables of one job"):
        save_tables([table, table.at_quantile(0.1)], tmp_path / "dup.json")
    with pytest.raises(ValidationError, match="key must be its job"):
        save_tables({"cifar10-cautious": table}, tmp_path / "dup.json")
    assert not (tmp_path / "dup.json").exists()
    assert list(load_tables(save_tables({"cifar10": table}, tmp_path / "ok.json"))) == ["cifar10"]


def test_large_counts_are_not_taken_for_duplicates():
    """Duplicates had been found by packing (type, nodes, gpus) into one int64, which wrapped at counts that
    validation accepts: distinct rows were refused as 'appears twice'."""
    big = [{"gpu_type": t, "num_nodes": n, "num_gpus": g, "goodput": 1.0}
           for t, n, g in (("t4", 1, 8), ("a100", 1, 8), ("t4", 2**31 - 1, 2**33 - 1))]
    assert len(GoodputTable("job", big).frame) == 3
    with pytest.raises(ValidationError, match="twice"):
        GoodputTable("job", big + [dict(big[2])])


def test_json_csv_and_multi_table_round_trips(tmp_path):
    table = GoodputTable("job", rows(), missing_gpu_types=["v100"])
    back = GoodputTable.from_json(table.to_json(tmp_path / "t.json"))
    pd.testing.assert_frame_equal(back.frame, table.frame)
    assert back.missing_gpu_types == ("v100",)
    back = GoodputTable.from_csv(table.to_csv(tmp_path / "t.csv"))
    pd.testing.assert_frame_equal(back.frame, table.frame)
    other = GoodputTable("other", rows()[:1])
    loaded = load_tables(save_tables({"job": table, "other": other}, tmp_path / "all.json"))
    assert set(loaded) == {"job", "other"}
    pd.testing.assert_frame_equal(loaded["other"].frame, other.frame)


def test_load_tables_reports_bad_files(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text("{not json")
    with pytest.raises(DataFormatError, match="bad.json:1"):
        load_tables(path)
    path.write_text(json.dumps({"tables": [{"job": "a", "rows": [{"gpu_type": "t4", "num_nodes": 1, "num_gpus": 1, "goodput": -5}]}]}))
    with pytest.raises(DataFormatError, match=r"tables\[0\]"):
        load_tables(path)


def test_atomic_write_replaces_whole_files_with_the_usual_mode(tmp_path):
    import os
    import stat

    from goodput.io import atomic_write_text

    path = tmp_path / "sub" / "table.json"
    atomic_write_text(path, "old")
    atomic_write_text(path, "new")
    assert path.read_text() == "new"
    assert [p.name for p in path.parent.iterdir()] == ["table.json"]  # no temporary left behind
    mask = os.umask(0)
    os.umask(mask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~mask  # not mkstemp's 0600


def test_reading_the_umask_does_not_change_it_meanwhile(monkeypatch):
    """Set to 0 even briefly, it would make files other threads create meanwhile world-writable."""
    import os
    from pathlib import Path

    from goodput.io import _umask

    mask = os.umask(0o022)
    os.umask(mask)
    calls = []
    real = os.umask
    monkeypatch.setattr(os, "umask", lambda value: calls.append(value) or real(value))
    assert _umask() == mask
    assert calls == [] if Path("/proc/self/status").exists() else 0 not in calls


def test_from_columns_matches_the_frame_path_and_builds_no_frame_until_read():
    data = pd.DataFrame(rows())
    table = GoodputTable.from_columns("job", {c: data[c].to_numpy() for c in data.columns}, missing_gpu_types=["V100"])
    assert table._frame_cache is None  # nothing built yet: the allocator reads column_arrays
    arrays = table.column_arrays()
    assert arrays["gpu_type"].tolist() == ["t4", "t4", "a100", "a100"]
    assert arrays["normalized_goodput"].tolist() == pytest.approx([1.0, 1.75, 4.0, 0.0])
    with pytest.raises(ValueError):
        arrays["goodput"][0] = 1.0  # read-only: a table never changes
    pd.testing.assert_frame_equal(table.frame, GoodputTable("job", rows()).frame, check_exact=True)
    assert table.missing_gpu_types == ("v100",) and len(table) == 4
    scalar = GoodputTable.from_columns("job", {"gpu_type": "t4", "num_nodes": [1, 1], "num_gpus": [1, 2],
                                               "goodput": [1.0, 2.0], "std": 0.0})
    assert scalar.frame["std"].tolist() == [0.0, 0.0] and scalar.gpu_types == ["t4"]


@pytest.mark.parametrize(
    "change, field",
    [({"goodput": [1.0, float("nan")]}, "goodput"), ({"num_gpus": [1, 0]}, "num_gpus"), ({"num_nodes": [True, 1]}, "boolean"),
     ({"gpu_type": ["t4", 7]}, "gpu_type"), ({"num_gpus": [1, 1]}, "twice"), ({"goodput": [1.0]}, "lengths")],
)
def test_from_columns_validates_like_the_frame_path(change, field):
    columns = {"gpu_type": ["t4", "t4"], "num_nodes": [1, 1], "num_gpus": [1, 2], "goodput": [1.0, 2.0], **change}
    with pytest.raises(ValidationError, match=field):
        GoodputTable.from_columns("job", columns)
