"""Readers for published measurements: formats, line-numbered errors, real files."""

from __future__ import annotations

import pytest

from experiments.datasets import (
    parse_placement,
    read_gavel_throughputs,
    read_placements,
    read_pollux_trace,
    read_scalability,
    read_validation,
)
from goodput.errors import DataFormatError


def test_placement_strings():
    assert parse_placement("1") == (1,)
    assert parse_placement("22") == (2, 2)
    assert parse_placement("1234") == (1, 2, 3, 4)
    for bad in ("", "2a", "00", "-1"):
        with pytest.raises(ValueError):
            parse_placement(bad)


def test_read_placements(tmp_path):
    path = tmp_path / "placements.csv"
    path.write_text("placement,local_bsz,step_time,sync_time\n1,32,0.04,0.0005\n22,64,0.2,0.05\n")
    obs = read_placements(path, "cifar10", "T4")
    assert [(o.num_nodes, o.num_replicas, o.placement) for o in obs] == [(1, 1, (1,)), (2, 4, (2, 2))]
    assert obs[1].gpu_type == "t4" and obs[1].sync_time == 0.05


@pytest.mark.parametrize(
    "row, field",
    [
        ("2x,64,0.2,0.05", "placement"),
        ("2,0,0.2,0.05", "local_bsz"),
        ("2,64,nan,0.05", "step_time"),
        ("2,64,-0.2,0.05", "step_time"),
        ("2,64,0.2", "row"),
        ("2,64,0.2,0.5", "sync_time"),  # more sync than step
    ],
)
def test_malformed_rows_name_the_line(tmp_path, row, field):
    path = tmp_path / "placements.csv"
    path.write_text(f"placement,local_bsz,step_time,sync_time\n1,32,0.04,0.0005\n{row}\n")
    with pytest.raises(DataFormatError) as info:
        read_placements(path, "j", "t4")
    assert info.value.line == 3 and info.value.field == field
    assert "placements.csv:3" in str(info.value)


def test_missing_column_and_empty_file(tmp_path):
    path = tmp_path / "s.csv"
    path.write_text("num_nodes,num_replicas,local_bsz,sync_time\n1,1,8,0.1\n")
    with pytest.raises(DataFormatError, match="step_time"):
        read_scalability(path, "j", "t4")
    path.write_text("")
    with pytest.raises(DataFormatError, match="empty"):
        read_scalability(path, "j", "t4")


def test_sync_time_is_optional_and_extra_columns_are_ignored(tmp_path):
    path = tmp_path / "s.csv"
    path.write_text("num_nodes,num_replicas,local_bsz,step_time,note\n1,1,8,0.1,a\n2,4,8,0.3,b\n")
    obs = read_scalability(path, "j", "t4")
    assert [(o.num_replicas, o.step_time, o.sync_time) for o in obs] == [(1, 0.1, None), (4, 0.3, None)]
    path.write_text("num_nodes,num_replicas,local_bsz,step_time,sync_time\n2,4,8,0.3,\n")
    assert read_scalability(path, "j", "t4")[0].sync_time is None


def test_spreadsheet_spellings_are_read(tmp_path):
    """A byte-order mark, integers written as "32.0" and a placement written as "22.0"."""
    path = tmp_path / "placements.csv"
    path.write_text("\ufeffplacement,local_bsz,step_time,sync_time\n22.0,32.0,0.2,0.05\n", encoding="utf-8")
    (obs,) = read_placements(path, "j", "t4")
    assert (obs.placement, obs.local_bsz) == ((2, 2), 32)
    path.write_text("placement,local_bsz,step_time,sync_time\n22,32.5,0.2,0.05\n")
    with pytest.raises(DataFormatError, match="local_bsz"):
        read_placements(path, "j", "t4")


def test_unmeasured_rows_are_reported_not_read(tmp_path):
    path = tmp_path / "placements.csv"
    path.write_text("placement,local_bsz,step_time,sync_time\n1,32,0.04,0\n2,64,,\n2,128,0.0,0\n4,64,nan,0.1\n"
                    "22,64,0.2,0.3\n")
    with pytest.raises(DataFormatError):  # strict without a list to report them in
        read_placements(path, "j", "t4")
    skipped: list[tuple[str, str]] = []
    obs = read_placements(path, "j", "t4", skipped=skipped)
    assert [(o.placement, o.sync_time) for o in obs] == [((1,), 0.0), ((2, 2), None)]
    assert [entry for entry, _ in skipped] == ["placements.csv:3", "placements.csv:4", "placements.csv:5", "placements.csv:6"]
    assert "sync_time not used" in skipped[-1][1]
    path.write_text("placement,local_bsz,step_time,sync_time\n2,64,-0.2,0\n")  # negative is malformed, not a marker
    with pytest.raises(DataFormatError, match="step_time"):
        read_placements(path, "j", "t4", skipped=[])


def test_measurement_directories(tmp_path):
    """<root>/<model>/ tables, tables directly in <root> (one model), and what the notes say."""
    from experiments.datasets import read_measurements

    header = "placement,local_bsz,step_time,sync_time\n"
    one_model = tmp_path / "bert"
    one_model.mkdir()
    (one_model / "placements-V100.csv").write_text(header + "1,8,0.1,0\n2,8,0.15,0.05\n2,16,0,0\n")
    (one_model / "placements-t4.csv").write_text(header + "1,8,0.3,0\n")
    (one_model / "validation-8.csv").write_text("progress,iteration,metric,grad_sqr,grad_var\n")
    data = read_measurements(one_model)
    assert list(data.models) == ["bert"]
    assert sorted({o.gpu_type for o in data.models["bert"]}) == ["t4", "v100"] and len(data.models["bert"]) == 3
    assert data.notes == ["bert/placements-V100.csv: 1 row(s) not used as read: line 4: step_time=0: infeasible or not measured"]
    other = tmp_path / "ncf"
    other.mkdir()
    (other / "scalability-t4.csv").write_text("num_nodes,num_replicas,local_bsz,step_time\n1,1,64,0.02\n")
    (tmp_path / "notes.csv").write_text("a\n")  # the parent holds no tables: not a model, not noted
    data = read_measurements(tmp_path)
    assert sorted(data.models) == ["bert", "ncf"] and not any("notes.csv" in n for n in data.notes)
    empty = tmp_path / "resnet"  # a header and no rows: had left the model out without a word
    empty.mkdir()
    (empty / "placements-v100.csv").write_text(header)
    data = read_measurements(tmp_path)
    assert sorted(data.models) == ["bert", "ncf"]
    assert "resnet/placements-v100.csv: no rows" in data.notes and "resnet: no measured rows in its tables, left out" in data.notes


def test_what_a_directory_holds_is_read_or_named(tmp_path):
    """Data a held-out run could bring, each of which had changed the figures without a word: a .CSV suffix
    (the model left out), a model's files one folder deeper or gzipped, exact copies of rows (they had
    counted as repeated measurements: P4@40 at 0.2%), and one type spelled two ways."""
    from experiments.datasets import read_measurements

    header = "placement,local_bsz,step_time\n"
    rows = "1,8,0.10\n2,8,0.15\n4,8,0.20\n"
    for model, files in {"bert": {"placements-T4.CSV": rows + rows, "placements-V100.csv": rows},
                         "cifar10": {"placements-RTX_6000.csv": rows, "placements-a100.csv.gz": "x"},
                         "ncf": {"placements-rtx6000.csv": rows}}.items():
        (tmp_path / model).mkdir()
        for name, text in files.items():
            (tmp_path / model / name).write_text(header + text)
    (tmp_path / "yolov3" / "t4").mkdir(parents=True)
    (tmp_path / "yolov3" / "t4" / "placements.csv").write_text(header + rows)
    data = read_measurements(tmp_path)
    assert sorted(data.models) == ["bert", "cifar10", "ncf"]
    assert sorted(o.gpu_type for o in data.models["bert"]) == ["t4"] * 3 + ["v100"] * 3  # the copies read once
    assert {o.gpu_type for o in data.models["cifar10"]} == {"rtx-6000"}  # '_' is a separator, as ' ' is
    assert data.notes == [
        "bert/placements-T4.CSV: 3 row(s) exact copies of rows read before (in placements-T4.CSV: same "
        "configuration, step and sync time), each read once",
        "cifar10/placements-a100.csv.gz: not a plain .csv table, left out",
        "yolov3/: no placements[-<gpu_type>].csv or scalability[-<gpu_type>].csv in it, left out (it holds: t4/)",
        "GPU types rtx-6000, rtx6000 differ only in separators: read as 2 types (name their files alike to make them one)",
    ]


@pytest.mark.parametrize("column, first, second, ok", [
    ("gpu_type", "v100", "V100", True), ("gpu", "Tesla V100-SXM2-16GB", "Tesla V100-SXM2-16GB", True),
    ("gpu", "v100", "a100", False), ("model", "bert", " BERT", True), ("job", "bert", "ncf", False)])
def test_a_column_naming_the_type_or_model_must_hold_one_value_per_file(tmp_path, column, first, second, ok):
    """A table holding several types or models in a column had been read as one, every row under the file's
    type: such a row is refused by line and column. One value throughout (a device's full name) is read."""
    path = tmp_path / "placements-v100.csv"
    path.write_text(f"placement,local_bsz,step_time,{column}\n1,8,0.1,{first}\n2,8,0.2,{second}\n")
    if ok:
        assert [o.step_time for o in read_placements(path, "bert", "v100")] == [0.1, 0.2]
    else:
        with pytest.raises(DataFormatError) as info:
            read_placements(path, "bert", "v100")
        assert info.value.line == 3 and info.value.field == column and info.value.value == second


def test_the_report_names_the_rows_each_protocol_could_not_test():
    from experiments.accuracy_protocols import untested
    from goodput import Observation

    def obs(gpu, nodes, replicas):
        return Observation(job="m", gpu_type=gpu, num_nodes=nodes, num_replicas=replicas, local_bsz=8, step_time=0.1)

    models = {"m": [obs("t4", 1, 1), obs("t4", 1, 2), obs("v100", 2, 4), obs("v100", 2, 8)]}
    notes = untested(models, {"P1": {("m", "t4")}, "P3": set()})
    assert notes == ["P1: m/v100: 2 multi-GPU row(s) not tested (it needs 1-GPU rows on that type)",
                     "P3: m/v100: 2 multi-node row(s) not tested (it needs single-node multi-GPU rows on that type)"]


def test_a_file_that_is_not_utf8_is_a_data_format_error(tmp_path):
    """A spreadsheet's cp1252 export had ended in a UnicodeDecodeError traceback."""
    path = tmp_path / "placements.csv"
    path.write_bytes("placement,local_bsz,step_time\n1,32,0.1\xe9\n".encode("latin-1"))
    with pytest.raises(DataFormatError, match="not UTF-8") as info:
        read_placements(path, "j", "t4")
    assert info.value.field == "encoding"
    gavel = tmp_path / "g.json"
    gavel.write_bytes('{"v100": {"caf\xe9": 1}}'.encode("latin-1"))
    with pytest.raises(DataFormatError, match="not UTF-8"):
        read_gavel_throughputs(gavel)


def test_gavel_reader(tmp_path):
    path = tmp_path / "g.json"
    path.write_text(
        '{"v100": {"(\'ResNet-50 (batch size 32)\', 1)": {"null": 8.0}, "(\'ResNet-50 (batch size 32)\', 4)": {"null": 16.0},'
        ' "(\'A3C\', 1)": {"null": 5.0}, "(\'ResNet-50 (batch size 128)\', 8)": {"null": 0.0}},'
        ' "v100_unconsolidated": {"(\'ResNet-50 (batch size 32)\', 4)": {"null": 12.0}}}'
    )
    data = read_gavel_throughputs(path)
    by_key = {(o.num_nodes, o.num_replicas): o for o in data.observations}
    assert by_key[(1, 1)].step_time == pytest.approx(1 / 8.0)
    assert by_key[(1, 4)].step_time == pytest.approx(4 / 16.0)  # steps/s are summed over workers
    assert by_key[(4, 4)].step_time == pytest.approx(4 / 12.0)
    assert {o.job for o in data.observations} == {"resnet-50"}
    assert len(data.skipped) == 2


@pytest.mark.data
def test_real_files_load(data_dir):
    profile = read_pollux_trace(data_dir / "pollux" / "traces" / "cifar10")
    assert len(profile) > 1000 and profile.gpu_types == ["t4"]
    assert max(o.num_replicas for o in profile) == 64
    rows = read_validation(data_dir / "pollux" / "traces" / "cifar10" / "validation-128.csv")
    assert rows and all(r.grad_sqr > 0 for r in rows)
    gavel = read_gavel_throughputs(data_dir / "gavel" / "simulation_throughputs.json")
    assert {o.gpu_type for o in gavel.observations} == {"k80", "p100", "v100"}
    assert {o.num_replicas for o in gavel.observations} == {1, 2, 4, 8}


def test_zeus_reader_picks_one_optimizer_and_the_largest_power_limit(tmp_path):
    from experiments.datasets import ZEUS_DATASET_SIZES, read_zeus

    header = "dataset,network,batch_size,optimizer,power_limit,time_per_epoch,average_power\n"
    (tmp_path / "summary_power_v100.csv").write_text(
        header + "cifar100,shufflenetv2,128,adadelta,250,20.0,200\ncifar100,shufflenetv2,128,adadelta,150,30.0,140\n"
        "cifar100,shufflenetv2,128,adam,250,18.0,200\ncifar100,shufflenetv2,256,adadelta,250,15.0,210\n")
    (tmp_path / "summary_power_a40.csv").write_text(header + "cifar100,shufflenetv2,128,adadelta,300,12.0,250\n")
    data = read_zeus(tmp_path)
    assert data.choices["cifar100-shufflenetv2"] == {"optimizer": "adadelta", "power_limit": {"a40": 300.0, "v100": 250.0}}
    v100 = {o.local_bsz: o.step_time for o in data.observations if o.gpu_type == "v100"}
    assert v100 == {128: pytest.approx(20.0 * 128 / ZEUS_DATASET_SIZES["cifar100"]), 256: pytest.approx(15.0 * 256 / 50_000)}
    (tmp_path / "summary_power_p100.csv").write_text(header + "mnist,lenet,64,sgd,250,5.0,100\n")
    with pytest.raises(DataFormatError, match="dataset"):
        read_zeus(tmp_path)
