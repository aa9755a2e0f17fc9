"""Faults a code review found at the library's boundaries: non-ASCII cluster specs, corrupt saved
sync shapes, and statistical efficiency at extreme gradient magnitudes."""

from __future__ import annotations

import json
import math
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from goodput import Cluster, ValidationError
from goodput import sync_shape as sync_shape_module
from goodput.efficiency import efficiency
from goodput.sync_shape import SyncShape

# ---------------------------------------------------------------------- Cluster.parse


@pytest.mark.parametrize("spec, item", [
    ("t4:٤x4", "t4:٤x4"),  # Arabic-Indic four
    ("t4:6x４", "t4:6x４"),  # full-width four
    ("a100:2x8,t4:१x4", "t4:१x4"),  # Devanagari one, after a good item
    ("t4:６x٤", "t4:６x٤"),
])
def test_cluster_spec_counts_must_be_ascii_digits(spec, item):
    with pytest.raises(ValidationError, match="ASCII digits") as info:
        Cluster.parse(spec)
    assert (info.value.field, info.value.value) == ("cluster", item)


def test_cluster_spec_with_ascii_digits_still_parses():
    assert Cluster.parse(" t4 : 6 x 4 ,a100:2X8").to_dict() == {"t4": {"nodes": 6, "gpus_per_node": 4},
                                                                 "a100": {"nodes": 2, "gpus_per_node": 8}}


# ---------------------------------------------------------------------- SyncShape.from_dict


class _NumpyRefusingHugeGrids:
    """numpy, except that ``ones`` fails the test instead of allocating the grid of a corrupt shape."""

    def __getattr__(self, name):
        return getattr(np, name)

    @staticmethod
    def ones(shape, *args, **kwargs):
        assert math.prod(shape) <= 2**24, f"allocated a {shape} grid for a corrupt shape"
        return np.ones(shape, *args, **kwargs)


@pytest.fixture
def no_huge_grids(monkeypatch):
    monkeypatch.setattr(sync_shape_module, "np", _NumpyRefusingHugeGrids())


@pytest.mark.parametrize("record, field, value", [
    ({"factors": [[2, 10**9, 1.0]]}, "sync_shape.factors", (2, 10**9)),
    ({"factors": [[10**6, 10**6, 1.0]]}, "sync_shape.factors", (10**6, 10**6)),
    ({"factors": [[2, 4, 1.0], [4096, 8192, 1.2]]}, "factors", (4096, 8192)),  # each cell sane, the grid not
    ({"factors": [[2, 2**70, 1.0]]}, "sync_shape.factors", (2, 2**70)),
    ({"factors": [[2, float("inf"), 1.0]]}, "sync_shape.factors", (2, float("inf"))),
    ({"factors": [[2.5, 4, 1.0]]}, "sync_shape.factors", (2.5, 4)),
    ({"factors": [["2", "4", 1.0]]}, "sync_shape.factors", ("2", "4")),
    ({"factors": [[True, 4, 1.0]]}, "sync_shape.factors", (True, 4)),
    ({"factors": [[2, 4, 1.0]], "jobs": float("inf")}, "sync_shape.jobs", float("inf")),
    ({"factors": [[2, 4, 1.0]], "jobs": -3}, "sync_shape.jobs", -3),
    ({"factors": [[2, 4, 1.0]], "jobs": "many"}, "sync_shape.jobs", "many"),
])
def test_corrupt_saved_shape_raises_naming_field_and_value(no_huge_grids, record, field, value):
    with pytest.raises(ValidationError) as info:
        SyncShape.from_dict(record)
    assert info.value.field == field
    assert info.value.value == value


def test_corrupt_shape_built_directly_raises_too(no_huge_grids):
    with pytest.raises(ValidationError) as info:
        SyncShape({(2, 10**9): 1.0})
    assert (info.value.field, info.value.value) == ("factors", (2, 10**9))


@pytest.mark.parametrize("factors, jobs", [
    ({}, 0),
    ({(2, 2): 0.7, (2, 8): 1.8, (4, 16): 1.1}, 4),
    ({(2, 4): 0.1, (64, 512): 10.0, (512, 4096): 1.3}, 12),  # a large but legitimate cluster
])
def test_saved_shapes_load_as_before(no_huge_grids, factors, jobs):
    shape = SyncShape(factors, jobs=jobs)
    loaded = SyncShape.from_dict(json.loads(json.dumps(shape.to_dict())))
    assert loaded == shape and loaded.jobs == jobs
    nodes, replicas = np.array([1, 2, 2, 4, 64, 512, 3]), np.array([4, 2, 8, 16, 512, 4096, 6])
    assert loaded(nodes, replicas).tolist() == shape(nodes, replicas).tolist()
    # numpy numbers and integral floats, as a hand-edited or numpy-written record may hold, still load
    numeric = {"jobs": np.int64(jobs), "factors": [[float(n), np.int32(r), f] for (n, r), f in factors.items()]}
    assert SyncShape.from_dict(numeric) == shape


# ---------------------------------------------------------------------- efficiency


def _exact_efficiency(grad_sqr: float, grad_var: float, m0: float, m: float) -> float:
    """(φ + M0)/(φ + M), φ = M0·grad_var/grad_sqr, in exact rational arithmetic, rounded once."""
    phi = Fraction(m0) * Fraction(grad_var) / Fraction(grad_sqr)
    return float((phi + Fraction(m0)) / (phi + Fraction(m)))


@pytest.mark.parametrize("grad_sqr, grad_var, m0, m, expected", [
    (1e-30, 1e290, 128, 512, 1.0),  # φ overflows: every sample is as good as at M0
    (1e-300, 1e300, 1, 1e308, 1.0),
    (1.0, 1e308, 1.5, 1e308, 0.6),  # φ + M overflows, though φ does not
    (1e300, 1e-300, 1, 1e308, 1e-308),  # no noise to speak of: E = M0/M
    (1e-300, 1e300, 1e-300, 1e300, 0.5),  # φ = M
    (1e-320, 1e-320, 128, 512, 0.4),  # subnormal inputs
])
def test_efficiency_at_extreme_magnitudes_is_the_finite_limit(grad_sqr, grad_var, m0, m, expected):
    assert efficiency(grad_sqr, grad_var, m0, m) == pytest.approx(expected, rel=1e-12, abs=0.0)
    out = efficiency(grad_sqr, grad_var, m0, np.array([m0, m]))
    assert np.all(np.isfinite(out)) and out[0] == 1.0


@given(
    grad_sqr_exp=st.floats(-320, 307),
    grad_var_exp=st.one_of(st.none(), st.floats(-320, 307)),
    m0_exp=st.floats(-3, 6),
    m_exp=st.floats(0, 300),
)
@example(grad_sqr_exp=-30, grad_var_exp=290, m0_exp=2, m_exp=0.5)  # φ overflows
@example(grad_sqr_exp=0, grad_var_exp=308, m0_exp=0, m_exp=308)  # φ + M overflows
@example(grad_sqr_exp=300, grad_var_exp=-300, m0_exp=-3, m_exp=300)  # grad_var/grad_sqr underflows
def test_property_efficiency_is_finite_in_unit_interval_and_exact_at_any_magnitude(grad_sqr_exp, grad_var_exp, m0_exp, m_exp):
    grad_sqr = 10.0**grad_sqr_exp
    grad_var = 0.0 if grad_var_exp is None else 10.0**grad_var_exp
    m0 = 10.0**m0_exp
    m = min(m0 * 10.0**m_exp, 1e308)
    if grad_sqr == 0.0:
        grad_sqr = 5e-324
    e = efficiency(grad_sqr, grad_var, m0, m)
    assert math.isfinite(e) and 0.0 <= e <= 1.0
    assert e == pytest.approx(_exact_efficiency(grad_sqr, grad_var, m0, m), rel=1e-12, abs=1e-300)


@pytest.mark.parametrize("grad_sqr, grad_var, m0, m", [
    (1.0, 3.0, 128, 512), (1.0, 0.0, 100, 400), (0.02, 7.5, 32, 32), (3e-4, 2e-2, 64, 4096), (1e4, 1e-3, 1, 1e6),
])
def test_efficiency_at_normal_magnitudes_matches_pollux_formula(grad_sqr, grad_var, m0, m):
    phi = m0 * grad_var / grad_sqr
    assert efficiency(grad_sqr, grad_var, m0, m) == pytest.approx((phi + m0) / (phi + m), rel=4 * np.finfo(float).eps)


# ---------------------------------------------------------------------- a fifth review round: the public API fuzzed


@pytest.mark.parametrize("spec, field", [("t4:1000000000x8", "t4.nodes"), ("a100:2x4096", "a100.gpus_per_node")])
def test_a_pool_beyond_any_real_cluster_is_refused_by_name(spec, field):
    """Sia's set holds one configuration per whole-node count: 10⁹ nodes had been accepted, and building the
    set then filled the machine's memory (OOM-killed at 24 GB)."""
    with pytest.raises(ValidationError) as info:
        Cluster.parse(spec)
    assert info.value.field == field
    assert Cluster.parse("t4:100000x8").total_gpus == 800_000  # the bounds themselves are allowed


def test_appending_to_a_profile_with_a_nan_record_names_file_line_and_field(tmp_path):
    """A record another tool wrote with json's default NaN: appending had raised json's bare ValueError."""
    from goodput import Observation, Profile, ProfileWriter
    from goodput.errors import DataFormatError

    path = tmp_path / "p.jsonl"
    good = {"job": "j", "gpu_type": "t4", "num_nodes": 1, "num_replicas": 1, "local_bsz": 8, "step_time": 0.1}
    path.write_text(json.dumps(good) + "\n" + json.dumps({**good, "step_time": float("nan")}) + "\n")
    for append in (lambda: ProfileWriter(path),
                   lambda: Profile([Observation(**{**good, "step_time": 0.2})]).save(path)):
        with pytest.raises(DataFormatError) as info:
            append()
        assert info.value.line == 2 and info.value.field == "step_time" and str(path) in str(info.value)


def test_table_cells_holding_numpy_arrays_are_read_or_refused_by_name():
    """A 0-d array (what predict_step_time returns for scalars) is its number; an array or a list as a GPU
    type is refused by name. They had raised TypeError (len() of unsized object, unhashable type)."""
    from goodput import GoodputTable

    row = {"gpu_type": "t4", "num_nodes": 1, "num_gpus": 1, "goodput": np.array(4.0)}
    assert GoodputTable("j", [row]).best()["goodput"] == 4.0
    for bad in (np.array(["t4"]), ["t4"]):
        with pytest.raises(ValidationError, match="gpu_type"):
            GoodputTable("j", [{**row, "gpu_type": bad}])


@pytest.mark.parametrize("make, field", [
    (lambda: __import__("goodput").Observation(job="j", gpu_type="t4", num_nodes=1, num_replicas=2, local_bsz=8,
                                               step_time=0.1, placement=np.array(2)), "placement"),
    (lambda: __import__("goodput").JobSpec(gpu_types=np.array("t4")), "gpu_types"),
    (lambda: __import__("goodput").Profile(observations=1.5), "observations"),
    (lambda: __import__("goodput").Profile(observations=None), "observations"),
    (lambda: __import__("goodput.throughput").throughput.fit_throughput(None), "observations"),
    (lambda: __import__("goodput").save_tables(5, "never-written.json"), "tables"),
    (lambda: __import__("goodput.throughput").throughput.ThroughputParams(0.1, 0.01, 0.1, 0.01, 0.1, 0.01, 2.0,
                                                                          fixed=1.5), "fixed"),
    (lambda: __import__("goodput.throughput").throughput.ThroughputParams.from_dict(None), "params"),
    (lambda: __import__("goodput").Observation(job="j", gpu_type="t4", num_nodes=1, num_replicas=1, local_bsz=8,
                                               step_time=1e-320), "step_time"),
])
def test_arguments_of_the_wrong_kind_are_refused_by_name(make, field):
    """0-d arrays where a sequence is expected, numbers or None where a collection is, and a subnormal step
    time (its throughput had been inf): each had raised TypeError or passed."""
    with pytest.raises(ValidationError) as info:
        make()
    assert info.value.field == field


def test_profile_metadata_is_kept_as_it_loads_back(tmp_path):
    """JSON turns tuples into lists and keys into strings: a saved profile had loaded back unequal."""
    from goodput import Profile

    profile = Profile([], job="j", metadata={"grid": (16, 32), 1: "x"})
    assert profile.metadata == {"grid": [16, 32], "1": "x"}
    profile.save(tmp_path / "p.jsonl")
    assert Profile.load(tmp_path / "p.jsonl") == profile
