"""Observation validation, Profile JSON Lines storage and DataFrame conversion."""

from __future__ import annotations

import json
import math
import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from goodput import Observation, Profile, ProfileWriter, ValidationError
from goodput.errors import DataFormatError
from goodput.observations import TornRecordWarning, by_gpu_type, indices_by_gpu_type

BASE = dict(job="cifar10", gpu_type="t4", num_nodes=1, num_replicas=2, local_bsz=64, step_time=0.1, sync_time=0.02)


def make(**changes):
    return Observation(**{**BASE, **changes})


def test_valid_observation_normalises_and_derives():
    obs = make(gpu_type=" T4 ", accum_steps=2)
    assert obs.gpu_type == "t4"
    assert obs.batch_size == 2 * 64 * 3
    assert obs.throughput == pytest.approx(384 / 0.1)
    assert obs.compute_time == pytest.approx((0.1 - 0.02) / 3)


BAD_NUMBERS = [float("nan"), float("inf"), -float("inf"), -1.0, 0.0, 1e300, 2e6]  # 1e300 had broken its job's tables for good


@pytest.mark.parametrize("field", ["step_time"])
@pytest.mark.parametrize("value", BAD_NUMBERS)
def test_bad_times_raise_naming_field(field, value):
    with pytest.raises(ValidationError) as info:
        make(**{field: value})
    assert info.value.field == field
    assert field in str(info.value)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -0.5])
def test_bad_sync_time(value):
    with pytest.raises(ValidationError, match="sync_time"):
        make(sync_time=value)


def test_sync_time_beyond_step_time():
    with pytest.raises(ValidationError, match="sync_time"):
        make(sync_time=0.2)


@given(
    field=st.sampled_from(["num_nodes", "num_replicas", "local_bsz", "accum_steps", "step_time", "sync_time",
                           "grad_sqr", "grad_var", "memory_bytes"]),
    value=st.one_of(
        st.floats(allow_nan=True, allow_infinity=True).filter(lambda x: not (x > 0 and math.isfinite(x))),
        st.text(max_size=3),
        st.just([1]),
        st.just(True),
        st.none(),
    ),
)
@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow], deadline=None)
def test_property_invalid_values_name_their_field(field, value):
    """NaN, inf, negative, zero, strings, lists and bools all raise, naming the field."""
    values = {**BASE, field: value}
    if field in ("grad_sqr", "grad_var"):
        values.setdefault("grad_sqr", 1.0)
        values.setdefault("grad_var", 1.0)
        values[field] = value
    allowed_none = field in ("sync_time", "memory_bytes", "grad_sqr", "grad_var")
    allowed_zero = field in ("accum_steps", "sync_time", "grad_var", "memory_bytes")
    if value is None and allowed_none:
        if field in ("grad_sqr", "grad_var"):
            with pytest.raises(ValidationError):  # one without the other
                Observation(**values)
        return
    if value == 0 and not isinstance(value, bool) and allowed_zero:
        Observation(**values)
        return
    if field == "sync_time" and isinstance(value, float) and value == 0.0:
        return
    with pytest.raises(ValidationError) as info:
        Observation(**values)
    assert info.value.field in (field, "grad_sqr", "grad_var", "num_replicas")


@given(num_nodes=st.integers(2, 16), deficit=st.integers(1, 8))
def test_property_inconsistent_placement(num_nodes, deficit):
    replicas = max(num_nodes - deficit, 1)
    with pytest.raises(ValidationError, match="num_replicas"):
        make(num_nodes=num_nodes, num_replicas=replicas)


def test_placement_must_agree():
    assert make(num_nodes=2, num_replicas=4, placement=(2, 2)).placement == (2, 2)
    with pytest.raises(ValidationError, match="placement"):
        make(num_nodes=2, num_replicas=4, placement=(1, 2))
    with pytest.raises(ValidationError, match="placement"):
        make(num_nodes=2, num_replicas=4, placement=(4,))


def test_gpu_type_and_job_validation():
    with pytest.raises(ValidationError, match="gpu_type"):
        make(gpu_type="T4 GPU!")
    with pytest.raises(ValidationError, match="gpu_type"):
        make(gpu_type=4)
    with pytest.raises(ValidationError, match="job"):
        make(job="")


def test_grad_stats_come_together():
    with pytest.raises(ValidationError, match="grad_var"):
        make(grad_sqr=1.0)
    obs = make(grad_sqr=1.0, grad_var=0.0)
    assert obs.grad_var == 0.0


def test_from_dict_rejects_unknown_fields():
    with pytest.raises(ValidationError, match="colour"):
        Observation.from_dict({**BASE, "colour": "red"})


observation_strategy = st.builds(
    lambda nodes, extra, bsz, step, frac, accum, grads: Observation(
        job="j",
        gpu_type="a100",
        num_nodes=nodes,
        num_replicas=nodes + extra,
        local_bsz=bsz,
        step_time=step,
        sync_time=step * frac,
        accum_steps=accum,
        grad_sqr=grads[0] if grads else None,
        grad_var=grads[1] if grads else None,
    ),
    st.integers(1, 8),
    st.integers(0, 8),
    st.integers(1, 4096),
    st.floats(1e-5, 1e3),
    st.floats(0, 1),
    st.integers(0, 4),
    st.one_of(st.none(), st.tuples(st.floats(1e-6, 1e6), st.floats(0, 1e6))),
)


@given(observations=st.lists(observation_strategy, max_size=20))
@settings(max_examples=60, suppress_health_check=[HealthCheck.function_scoped_fixture], deadline=None)
def test_property_profile_round_trips_through_jsonl(tmp_path_factory, observations):
    path = tmp_path_factory.mktemp("p") / "profile.jsonl"
    profile = Profile(observations, job="j", init_batch_size=32, max_local_bsz={"a100": 512}, metadata={"k": [1, 2]})
    profile.save(path)
    loaded = Profile.load(path)
    assert loaded.observations == profile.observations
    assert (loaded.job, loaded.init_batch_size, loaded.max_local_bsz, loaded.metadata) == ("j", 32, {"a100": 512}, {"k": [1, 2]})


def _profile(n=5):
    return Profile([make(local_bsz=2**i) for i in range(n)], job="cifar10", init_batch_size=64)


def test_save_is_append_only_and_idempotent(tmp_path):
    path = tmp_path / "p.jsonl"
    profile = _profile(3)
    profile.save(path)
    first = path.read_bytes()
    profile.save(path)  # nothing new
    assert path.read_bytes() == first
    profile.append(make(local_bsz=999))
    profile.save(path)
    assert path.read_bytes().startswith(first)  # old records untouched
    assert len(Profile.load(path)) == 4


def test_saving_a_profile_whose_meta_is_split_over_records_back_to_its_file_adds_nothing(tmp_path):
    path = tmp_path / "p.jsonl"
    with ProfileWriter(path) as writer:  # as profile_job writes: the job first, a type's memory limit later
        writer.write_meta(job="j", init_batch_size=64)
        writer.write(make(job="j"))
        writer.write_meta(max_local_bsz={"t4": 256})
    first = path.read_bytes()
    Profile.load(path).save(path)
    assert path.read_bytes() == first
    changed = Profile.load(path)
    changed.max_local_bsz["v100"] = 128
    changed.save(path)
    assert Profile.load(path).max_local_bsz == {"t4": 256, "v100": 128}


def test_saving_a_hand_written_file_s_profile_back_to_it_adds_nothing(tmp_path):
    path = tmp_path / "hand.jsonl"
    lines = [{"record": "meta", "job": "a", "init_batch_size": 32},
             {"job": "a", "gpu_type": "t4", "num_nodes": 1, "num_replicas": 1, "local_bsz": 32, "step_time": 0.1},
             {"record": "observation", "job": "a", "gpu_type": "T4", "num_nodes": 1, "num_replicas": 2, "local_bsz": 32,
              "step_time": 0.2},
             {"record": "observation", "job": "a", "gpu_type": "t4", "num_nodes": 1, "num_replicas": 1, "local_bsz": 64,
              "step_time": 1, "accum_steps": 0}]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    first = path.read_bytes()
    Profile.load(path).save(path)
    assert path.read_bytes() == first and len(Profile.load(path)) == 3


def test_meta_values_are_checked_before_anything_is_written(tmp_path):
    path = tmp_path / "p.jsonl"
    with ProfileWriter(path) as writer:
        writer.write_meta(job="j", init_batch_size=64)
        for bad, field in (({"max_local_bsz": {"t4": 0}}, "max_local_bsz['t4']"), ({"init_batch_size": float("nan")},
                           "init_batch_size"), ({"metadata": {"loss": float("nan")}}, "metadata")):
            with pytest.raises(ValidationError) as caught:
                writer.write_meta(**bad)
            assert caught.value.field == field
        writer.write_meta(max_local_bsz={"T4": 256})
    assert Profile.load(path).max_local_bsz == {"t4": 256}
    for metadata in ({"num_parameters": np.int64(7)}, {"loss": float("inf")}, {"ok": [1, {"x": object()}]}):
        with pytest.raises(ValidationError) as caught:
            Profile([], job="j", metadata=metadata)
        assert caught.value.field == "metadata"


@given(cut=st.integers(2, 200))
@settings(max_examples=40, suppress_health_check=[HealthCheck.function_scoped_fixture], deadline=None)
def test_property_torn_file_loads_everything_before_the_tear(tmp_path_factory, cut):
    path = tmp_path_factory.mktemp("t") / "p.jsonl"
    _profile(5).save(path)
    data = path.read_bytes()
    lines = data.split(b"\n")[:-1]
    total = len(data)
    cut_at = total - min(cut, len(lines[-1]))  # tear inside the last record
    path.write_bytes(data[:cut_at])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = Profile.load(path)
    complete = data[:cut_at].count(b"\n")
    obs_lines = complete - 1  # the first line is the meta record
    assert len(loaded) == obs_lines
    assert loaded.observations == _profile(5).observations[:obs_lines]
    assert any(issubclass(w.category, TornRecordWarning) for w in caught)
    assert loaded.load_warnings


def test_record_missing_only_its_newline_is_whole(tmp_path):
    path = tmp_path / "p.jsonl"
    _profile(3).save(path)
    path.write_bytes(path.read_bytes()[:-1])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loaded = Profile.load(path)
    assert len(loaded) == 3 and not loaded.load_warnings


def test_malformed_middle_line_names_its_number(tmp_path):
    path = tmp_path / "p.jsonl"
    _profile(4).save(path)
    lines = path.read_text().splitlines()
    lines[2] = lines[2][:-5]  # corrupt line 3
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataFormatError) as info:
        Profile.load(path)
    assert info.value.line == 3
    assert ":3:" in str(info.value)


def test_invalid_record_in_file_names_line_and_field(tmp_path):
    path = tmp_path / "p.jsonl"
    _profile(2).save(path)
    lines = path.read_text().splitlines()
    record = json.loads(lines[1])
    record["step_time"] = -1
    lines[1] = json.dumps(record)
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataFormatError) as info:
        Profile.load(path)
    assert info.value.line == 2 and info.value.field == "step_time"


def test_writer_cuts_torn_tail_before_appending(tmp_path):
    path = tmp_path / "p.jsonl"
    _profile(3).save(path)
    path.write_bytes(path.read_bytes()[:-7])
    with pytest.warns(TornRecordWarning):
        writer = ProfileWriter(path)
    assert len(writer.existing) == 2
    writer.write(make(local_bsz=4))  # re-measured
    writer.write(make(local_bsz=777))
    writer.close()
    loaded = Profile.load(path)
    assert [o.local_bsz for o in loaded] == [1, 2, 4, 777]
    assert not loaded.load_warnings


@pytest.mark.skipif(__import__("importlib").util.find_spec("fcntl") is None, reason="POSIX file locks")
def test_a_writer_opening_the_file_waits_for_a_record_being_appended(tmp_path):
    """A second writer opening the file mid-append had taken the record for a torn one and cut it after the
    first writer had fsynced it (the record was lost; only the opener was warned)."""
    import threading

    path = tmp_path / "shared.jsonl"
    first = ProfileWriter(path)
    record = json.dumps({"record": "observation", **make(local_bsz=5).to_dict()}).encode()
    opened = []
    with first._turn():  # first's append, caught halfway
        first._file.write(record[:20])
        first._file.flush()
        opener = threading.Thread(target=lambda: opened.append(ProfileWriter(path)))
        with warnings.catch_warnings():
            warnings.simplefilter("error", TornRecordWarning)
            opener.start()
            opener.join(0.5)
            assert opener.is_alive()  # waiting for its turn
            first._file.write(record[20:] + b"\n")
            first._file.flush()
    opener.join(10)
    assert [o.local_bsz for o in opened[0].existing] == [5]
    opened[0].write(make(local_bsz=6))
    for writer in (first, opened[0]):
        writer.close()
    assert [o.local_bsz for o in Profile.load(path)] == [5, 6]


def test_saving_onto_a_file_that_is_not_a_profile_leaves_it_untouched(tmp_path):
    """Its last line, lacking a newline, had been cut as a torn record before the file was refused."""
    path = tmp_path / "settings.json"
    path.write_text(json.dumps({"a": [1, 2], "b": "c"}, indent=2))  # no final newline
    before = path.read_bytes()
    with warnings.catch_warnings():
        warnings.simplefilter("error", TornRecordWarning)
        with pytest.raises(DataFormatError, match="settings.json:1"):
            _profile(2).save(path)
    assert path.read_bytes() == before
    # one line without a newline: a list (a complete value, not an object) or text is not a torn record
    for name, text in (("list.json", '[{"a": 1}, {"b": 2}]'), ("notes.txt", "my notes, no newline")):
        path = tmp_path / name
        path.write_text(text)
        with warnings.catch_warnings():
            warnings.simplefilter("error", TornRecordWarning)
            with pytest.raises(DataFormatError, match=f"{name}:1"):
                ProfileWriter(path)
        assert path.read_text() == text


def test_a_bad_meta_value_names_its_line(tmp_path):
    """A meta record's bad value had been reported without its line (an observation's had its line)."""
    record = json.dumps({"record": "observation", **make().to_dict()})
    for bad, field in (('{"record":"meta","job":"a","init_batch_size":"128"}', "init_batch_size"),
                       ('{"record":"meta","max_local_bsz":{"t4":0}}', "max_local_bsz")):
        path = tmp_path / "p.jsonl"
        path.write_text(f"{record}\n{bad}\n{record}\n")
        with pytest.raises(DataFormatError) as info:
            Profile.load(path)
        assert info.value.line == 2 and info.value.field.startswith(field)


def test_frame_round_trip():
    profile = Profile([make(), make(num_nodes=2, num_replicas=4, placement=(2, 2), grad_sqr=2.0, grad_var=3.0)])
    frame = profile.to_frame()
    assert list(frame["num_replicas"]) == [2, 4]
    back = Profile.from_frame(frame)
    assert back.observations == profile.observations


def test_from_frame_names_bad_row():
    frame = _profile(3).to_frame()
    frame.loc[1, "step_time"] = float("nan")
    frame.loc[2, "local_bsz"] = -3
    with pytest.raises(ValidationError, match="row 1: step_time"):
        Profile.from_frame(frame)
    frame.loc[1, "step_time"] = 0.5
    with pytest.raises(ValidationError, match="row 2: local_bsz"):
        Profile.from_frame(frame)


def test_profile_select_and_types():
    profile = Profile([make(), make(gpu_type="a100"), make(job="other")])
    assert profile.gpu_types == ["t4", "a100"]
    assert len(profile.select(gpu_type="A100")) == 1
    assert len(profile.select(job="other")) == 1
    with pytest.raises(ValidationError):
        Profile([object()])


def test_by_gpu_type_groups_in_order_of_appearance():
    obs = [Observation("j", "T4", 1, 1, 16, 0.1), Observation("j", "a100", 1, 1, 16, 0.05), Observation("j", "t4", 1, 2, 32, 0.3)]
    groups = by_gpu_type(obs)
    assert list(groups) == ["t4", "a100"]  # gpu types are lower-cased by Observation
    assert [o.local_bsz for o in groups["t4"]] == [16, 32] and by_gpu_type([]) == {}
    assert indices_by_gpu_type(obs) == {"t4": [0, 2], "a100": [1]} and indices_by_gpu_type([]) == {}
