"""Transfer across GPU types and jobs: sensitivities, ensembles, the cross-job prior, calibration."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest

from experiments.accuracy_baselines import predict_linear, predict_sia
from goodput import JobModel
from goodput.errors import DataFormatError
from goodput.throughput import ThroughputParams, _step_time, fit_throughput, predict_step_time
from goodput.transfer import (
    GROUPS,
    ClusterPrior,
    Regimes,
    build_transfer,
    compute_reference,
    config_regime,
    sensitivities,
    size_proxy,
)
from tests.test_throughput import synthetic


def _scaled(params: ThroughputParams, compute: float = 1.0, sync: float = 1.0) -> ThroughputParams:
    p = params
    return ThroughputParams(p.alpha_c * compute, p.beta_c * compute, p.alpha_n * sync, p.beta_n * sync,
                            p.alpha_r * sync, p.beta_r * sync, p.gamma)


# A fast type and a 4x slower one on the same interconnect: gradient sync moves the same bytes
# over the same links in the same seconds; it does not scale with compute, as Sia's ratio
# estimator assumes (nor does the model know which: its prior spans both).
FAST = ThroughputParams(0.010, 0.0005, 0.12, 0.006, 0.03, 0.003, 1.5)
SLOW = ThroughputParams(0.040, 0.0020, 0.12, 0.006, 0.03, 0.003, 1.5)
SINGLE = [(1, 1)]
INTRA = [(1, 2), (1, 4), (1, 8)]
TESTS = [(1, 2), (1, 4), (1, 8), (2, 8), (4, 16)]


def _job(name: str, compute: float, sync: float, seed: int, fast_configs=SINGLE + INTRA + [(2, 8)], slow_configs=SINGLE + INTRA + [(2, 8)]):
    return synthetic(_scaled(FAST, compute, sync), fast_configs, job=name, gpu="fast", seed=seed, accums=(0,)) + synthetic(
        _scaled(SLOW, compute, sync), slow_configs, job=name, gpu="slow", seed=seed + 100, accums=(0,)
    )


def _ape(pred: np.ndarray, obs) -> np.ndarray:
    return np.abs(pred / np.array([o.step_time for o in obs]) - 1)


def test_sensitivities_match_finite_differences():
    theta = np.array([0.02, 0.001, 0.25, 0.02, 0.08, 0.01, 1.6])
    nodes = np.array([1, 1, 1, 2, 4, 1.0])
    replicas = np.array([1, 2, 4, 8, 16, 4.0])
    bsz = np.array([16, 32, 64, 128, 64, 8.0])
    accum = np.array([0, 1, 0, 0, 2, 0.0])
    analytic = sensitivities(theta, nodes, replicas, bsz, accum)
    eps = 1e-6
    perturb = {
        "alpha_c": lambda th, d: th * np.r_[np.exp(d), 1, 1, 1, 1, 1, 1],
        "beta_c": lambda th, d: th * np.r_[1, np.exp(d), 1, 1, 1, 1, 1],
        "sync": lambda th, d: th * np.r_[1, 1, np.exp(d), np.exp(d), np.exp(d), np.exp(d), 1],
        "slope": lambda th, d: th * np.r_[1, 1, 1, np.exp(d), 1, np.exp(d), 1],
        "inter": lambda th, d: th * np.r_[1, 1, np.exp(d), np.exp(d), 1, 1, 1],
        "gamma": lambda th, d: th + np.r_[0, 0, 0, 0, 0, 0, d],
    }
    for k, group in enumerate(GROUPS):
        up = np.log(_step_time(perturb[group](theta, eps), nodes, replicas, bsz, accum))
        down = np.log(_step_time(perturb[group](theta, -eps), nodes, replicas, bsz, accum))
        np.testing.assert_allclose(analytic[:, k], (up - down) / (2 * eps), atol=1e-6, err_msg=group)


def test_regimes_and_what_they_identify():
    assert config_regime([1, 1, 1, 2], [1, 2, 4, 2]).tolist() == [0, 1, 2, 3]
    one_gpu = Regimes.of(synthetic(FAST, SINGLE, gpu="fast"))
    assert one_gpu.covered == (0,) and set(one_gpu.unidentified()) == {"sync", "slope", "inter", "gamma"}
    single_node = Regimes.of(synthetic(FAST, SINGLE + [(1, 2)], gpu="fast", bszs=(32,)))
    assert single_node.unidentified() == ("alpha_c", "slope", "inter")


def test_transfer_beats_the_ratio_estimator_on_two_types():
    """The slow type has only 1-GPU profiles; the fast one ran on 1, 2, 4, 8 GPUs of one node."""
    train = _job("j", 1.0, 1.0, seed=0, fast_configs=SINGLE + INTRA, slow_configs=SINGLE)
    test = synthetic(SLOW, TESTS, job="j", gpu="slow", seed=7, accums=(0,))
    model = JobModel("j", init_batch_size=8).observe(train)
    ours = model.predict("slow", *(np.array([getattr(o, k) for o in test], float) for k in ("num_nodes", "num_replicas", "local_bsz")))
    sia, _, _ = predict_sia(train, test, reference="fast")
    linear, _, _ = predict_linear(train, test)
    assert np.median(_ape(ours.step_time, test)) < 0.75 * np.median(_ape(sia, test))
    assert np.median(_ape(ours.step_time, test)) < np.median(_ape(linear, test))
    # the intervals are honest about the unknown relation between the two types' interconnects
    low, high = ours.interval(0.9)
    actual = np.array([o.step_time for o in test])
    assert np.mean((low <= actual) & (actual <= high)) > 0.8
    assert model.diagnostics["transfers"]["slow"]["sources"]["intra2"].startswith("fast")


def test_cross_job_prior_gives_a_brand_new_job_multi_gpu_predictions():
    others = {name: _job(name, c, s, seed=i) for i, (name, c, s) in enumerate([("a", 0.5, 0.6), ("b", 2.0, 1.7), ("c", 1.3, 1.4)])}
    prior = ClusterPrior.from_observations(others)
    assert prior.jobs == ["a", "b", "c"] and prior.gpu_types == ["fast", "slow"]
    new = _job("new", 1.0, 1.0, seed=11, fast_configs=SINGLE, slow_configs=SINGLE)  # 1-GPU profiles only
    test = synthetic(SLOW, TESTS, job="new", gpu="slow", seed=12, accums=(0,)) + synthetic(FAST, TESTS, job="new", gpu="fast", seed=13, accums=(0,))
    errors = {}
    for name, kwargs in {"prior": {"cluster_prior": prior}, "default": {}, "pollux": {"default_prior": False}}.items():
        model = JobModel("new", init_batch_size=8, **kwargs).observe(new)
        pred = np.array([model.predict(o.gpu_type, o.num_nodes, o.num_replicas, o.local_bsz).step_time for o in test])
        errors[name] = float(np.median(_ape(pred, test)))
    assert errors["prior"] < 0.06  # other jobs' sync, scaled by this job's compute
    assert errors["prior"] < errors["default"] < errors["pollux"]  # Pollux's default: linear scaling
    # and the prior informs a job that has run multi-GPU on one type only (P2): scaled as on that type
    warm = _job("new", 1.0, 1.0, seed=11, fast_configs=SINGLE + INTRA, slow_configs=SINGLE)
    model = JobModel("new", init_batch_size=8, cluster_prior=prior).observe(warm)
    slow = [o for o in test if o.gpu_type == "slow"]
    pred = np.array([model.predict("slow", o.num_nodes, o.num_replicas, o.local_bsz).step_time for o in slow])
    assert np.median(_ape(pred, slow)) < 0.08
    sources = model.diagnostics["transfers"]["slow"]["sources"]
    assert "scaled as on fast" in sources["intramany"]  # other jobs' sync profiles, scaled as on "fast"
    assert "own fit on fast" in sources["inter"]  # the job's own sync on "fast", carried over (P3's rule)


def test_cluster_prior_round_trip_and_exclude(tmp_path):
    prior = ClusterPrior.from_observations({"a": _job("a", 1, 1, 0), "b": _job("b", 2, 2, 1)}, sizes={"a": 1e7})
    path = prior.save(tmp_path / "prior.json")
    loaded = ClusterPrior.load(path)
    assert loaded.to_dict() == prior.to_dict()
    assert loaded.find("a", "fast").size_proxy == pytest.approx(prior.find("a", "fast").size_proxy)
    assert loaded.exclude("a").jobs == ["b"] and len(loaded.exclude("a")) == 2
    # a job the prior does not hold (a new job's name) leaves it whole, without refitting anything
    assert loaded.exclude("new job") is loaded and prior.exclude("new job") is prior
    assert prior.exclude("a").jobs == ["b"]
    (tmp_path / "bad.json").write_text("{\"summaries\": 3}")
    with pytest.raises(DataFormatError):
        ClusterPrior.load(tmp_path / "bad.json")
    saved = loaded.to_dict()
    saved["summaries"][0]["size_proxy"] = -1.0  # a size proxy is seconds of compute: > 0
    (tmp_path / "bad_proxy.json").write_text(json.dumps(saved))
    with pytest.raises(DataFormatError, match="size_proxy"):
        ClusterPrior.load(tmp_path / "bad_proxy.json")


def test_model_size_scales_sync_from_other_jobs():
    others = {"a": _job("a", 1.0, 0.5, 0), "b": _job("b", 1.0, 2.0, 1)}
    prior = ClusterPrior.from_observations(others, sizes={"a": 5e6, "b": 2e7})
    new = _job("new", 1.0, 1.0, seed=3, fast_configs=SINGLE, slow_configs=SINGLE)
    own = {t: JobModel("new", 8, bayesian=False).observe(new).params(t) for t in ("fast", "slow")}
    by_type = {t: [o for o in new if o.gpu_type == t] for t in own}
    transfer = build_transfer(own, by_type, prior, size=1e7)
    members = transfer["slow"].members[1]
    assert all("model size" in m.source for m in members if m.source.startswith("job"))
    mean = np.exp(sum(m.weight * np.log(m.theta[4]) for m in members if m.source.startswith("job")) /
                  sum(m.weight for m in members if m.source.startswith("job")))
    assert mean == pytest.approx(SLOW.alpha_r, rel=0.25)  # 0.5x at 5e6 and 2x at 2e7 parameters: 1x at 1e7


def test_size_proxy_is_the_geometric_mean_of_constant_and_total_compute():
    params = ThroughputParams(0.02, 0.001, 0.0, 0.0, 0.0, 0.0, 1.0)
    assert size_proxy(params, 8) == pytest.approx(np.sqrt(0.02 * 0.028))
    # a fit that put all compute per sample: α_c counts as SIZE_PROXY_FLOOR (5%) of c_ref
    per_sample = ThroughputParams(0.0, 0.001, 0.0, 0.0, 0.0, 0.0, 1.0)
    assert size_proxy(per_sample, 8) == pytest.approx(0.008 * np.sqrt(0.05))


def test_cold_job_scales_other_jobs_sync_by_size_proxy_not_by_compute():
    """Without model sizes, λ is the ratio of size proxies of 1-GPU fits (not of compute at a small batch)."""
    others = {"a": _job("a", 1.0, 1.0, 0), "b": _job("b", 2.0, 2.0, 1)}
    prior = ClusterPrior.from_observations(others)
    assert all(s.size_proxy is not None for s in prior.summaries)
    # the new job's per-sample compute is 4x job a's (more FLOPs per sample), its constant compute the same
    heavy = ThroughputParams(FAST.alpha_c, 4 * FAST.beta_c, FAST.alpha_n, FAST.beta_n, FAST.alpha_r, FAST.beta_r, FAST.gamma)
    new = synthetic(heavy, SINGLE, job="new", gpu="fast", seed=5, accums=(0,))
    own = {"fast": JobModel("new", 8, bayesian=False).observe(new).params("fast")}
    transfer = build_transfer(own, {"fast": new}, prior)
    member = next(m for m in transfer["fast"].members[1] if m.source.startswith("job a"))
    assert "size proxy" in member.source
    on_a = prior.find("a", "fast")
    lam = member.theta[4] / on_a.params_g.alpha_r
    assert lam == pytest.approx(size_proxy(own["fast"], 8) / on_a.size_proxy, rel=1e-6)
    assert lam < 0.9 * compute_reference(own["fast"], 8) / on_a.c_ref  # the compute ratio would say more
    # a prior saved by an older version (no proxy) falls back to the compute ratio
    old = ClusterPrior.from_dict({"summaries": [{k: v for k, v in s.to_dict().items() if k != "size_proxy"} for s in prior.summaries]})
    member = next(m for m in build_transfer(own, {"fast": new}, old)["fast"].members[1] if m.source.startswith("job a"))
    assert member.theta[4] / on_a.params_g.alpha_r == pytest.approx(compute_reference(own["fast"], 8) / old.find("a", "fast").c_ref, rel=1e-6)


def test_intervals_are_calibrated_on_held_out_configurations():
    rng = np.random.default_rng(5)
    configs = [(1, 1), (1, 2), (1, 3), (1, 4), (2, 4), (2, 8), (3, 12), (4, 16)]
    bszs = (8, 12, 16, 24, 32, 48, 64, 96, 128)
    obs = synthetic(SLOW, configs, bszs=bszs, accums=(0, 1), noise=0.05, seed=3, gpu="slow")
    order = rng.permutation(len(obs))
    train = [obs[i] for i in order[:40]]
    test = [obs[i] for i in order[40:]]
    model = JobModel("j", init_batch_size=8).observe(train)
    cols = {k: np.array([getattr(o, k) for o in test], float) for k in ("num_nodes", "num_replicas", "local_bsz", "accum_steps")}
    pred = model.predict("slow", cols["num_nodes"], cols["num_replicas"], cols["local_bsz"], cols["accum_steps"])
    low, high = pred.interval(0.9)
    actual = np.array([o.step_time for o in test])
    coverage = float(np.mean((low <= actual) & (actual <= high)))
    assert 0.8 <= coverage <= 0.98, coverage
    assert np.median(_ape(pred.step_time, test)) < 0.06
    truth = predict_step_time(SLOW, cols["num_nodes"], cols["num_replicas"], cols["local_bsz"], cols["accum_steps"])
    assert np.median(np.abs(pred.step_time / truth - 1)) < 0.03  # the noise-free truth: closer than the 5% noise


def _cluster(sync_factors: list[float]) -> dict[str, list]:
    return {f"j{i}": _job(f"j{i}", 1.0 + 0.3 * i, s, seed=20 + i) for i, s in enumerate(sync_factors)}


def test_cold_calibration_measures_how_well_other_jobs_transfer():
    alike = ClusterPrior.from_observations(_cluster([1.0, 1.1, 0.9, 1.05]))  # sync scales with compute everywhere
    unlike = ClusterPrior.from_observations(_cluster([0.2, 5.0, 0.4, 3.0]))  # the jobs' sync costs differ 25x
    a, u = alike.cold_calibration(), unlike.cold_calibration()
    assert set(a) == set(u) == {"*", "fast", "slow"}
    assert u["*"] > 1.2 and u["*"] > 1.5 * a["*"]  # intervals must widen where the jobs are unlike each other
    assert unlike.exclude("j0").observations.keys() == {"j1", "j2", "j3"}
    # two jobs suffice (each modelled from the other); one does not
    assert set(ClusterPrior.from_observations(_cluster([1.0, 2.0])).cold_calibration()) == {"*", "fast", "slow"}
    assert ClusterPrior.from_observations(_cluster([1.0])).cold_calibration() == {}
    # the factors are saved and loaded; a bad one is refused
    loaded = ClusterPrior.from_dict(unlike.to_dict())
    assert loaded.cold_calibration() == pytest.approx(u) and loaded.observations is None
    with pytest.raises(ValueError, match="calibration"):
        ClusterPrior.from_dict({"summaries": [], "calibration": {"fast": -1.0}})


def test_cold_share_stacks_the_default_beside_other_jobs_where_they_transfer_badly():
    # Leave-one-job-out on the cluster, the share of the weak default among a cold job's members
    # is the one whose mixture predicted the cluster's own jobs best (stacking).
    alike = ClusterPrior.from_observations(_cluster([1.0, 1.1, 0.9, 1.05]))
    unlike = ClusterPrior.from_observations(_cluster([0.2, 5.0, 0.4, 3.0]))  # sync costs 25x apart, unrelated to size
    assert 0.0 <= alike.cold_share() <= 0.3 and unlike.cold_share() >= 0.5
    cold = _job("new", 1.0, 1.0, seed=11, fast_configs=SINGLE, slow_configs=SINGLE)
    for prior in (alike, unlike):
        members = JobModel("new", 8, cluster_prior=prior).observe(cold)._current().transfers["slow"].members[3]
        default = sum(m.weight for m in members if m.source.startswith("weak default"))
        assert default == pytest.approx(prior.cold_share())
        assert sum(m.weight for m in members) == pytest.approx(1.0)
    # a job that has run multi-GPU is not cold: its members do not take the share
    warm = cold + synthetic(SLOW, [(1, 2), (1, 4)], job="new", gpu="slow", seed=14, accums=(0,))
    members = JobModel("new", 8, cluster_prior=unlike).observe(warm)._current().transfers["fast"].members[1]
    assert not any(m.source.startswith("weak default") for m in members)
    # fewer than two jobs with multi-GPU data: the other jobs only; saved and loaded; a bad share refused
    assert ClusterPrior.from_observations(_cluster([1.0])).cold_share() == 0.0
    assert ClusterPrior.from_dict(unlike.to_dict()).cold_share() == unlike.cold_share()
    with pytest.raises(ValueError, match="default_share"):
        ClusterPrior.from_dict({"summaries": [], "default_share": 1.5})


def test_cold_calibration_scales_only_a_cold_jobs_unobserved_regimes():
    prior = ClusterPrior.from_observations(_cluster([0.2, 5.0, 0.4, 3.0]))
    factor = prior.cold_factor("slow")
    neutral = ClusterPrior(prior.summaries, calibration={}, shapes=prior.shapes, default_share=prior.cold_share())
    cold = _job("new", 1.0, 1.0, seed=11, fast_configs=SINGLE, slow_configs=SINGLE)
    nodes, replicas = np.array([1, 1, 2, 4]), np.array([1, 4, 8, 16])
    scaled = JobModel("new", 8, cluster_prior=prior).observe(cold).predict("slow", nodes, replicas, 32).log_std
    plain = JobModel("new", 8, cluster_prior=neutral).observe(cold).predict("slow", nodes, replicas, 32).log_std
    assert scaled[0] == pytest.approx(plain[0])  # 1 GPU: observed, not scaled
    np.testing.assert_allclose(scaled[1:], factor * plain[1:], rtol=1e-9)
    # once the job has run multi-GPU, its own data speak: no cold scaling; the warm calibration
    # scales only the multi-node regime its single-node data on "slow" are carried to
    warm = cold + synthetic(SLOW, [(1, 2)], job="new", gpu="slow", seed=14, accums=(0,))
    scaled = JobModel("new", 8, cluster_prior=prior).observe(warm).predict("slow", nodes, replicas, 32).log_std
    plain = JobModel("new", 8, cluster_prior=neutral).observe(warm).predict("slow", nodes, replicas, 32).log_std
    multi_node = prior.warm_calibration()["same type, multi-node"]
    assert multi_node != pytest.approx(factor)
    np.testing.assert_allclose(scaled, plain * np.array([1.0, 1.0, multi_node, multi_node]), rtol=1e-9)


def _premium_cluster(premiums: list[float]) -> dict[str, list]:
    """Jobs whose inter-node sync is ``premium`` × the reference's (their intra-node sync alike)."""
    out = {}
    for i, premium in enumerate(premiums):
        params = {}
        for gpu, base in (("fast", FAST), ("slow", SLOW)):
            p = _scaled(base, 1.0 + 0.3 * i)
            params[gpu] = ThroughputParams(p.alpha_c, p.beta_c, p.alpha_n * premium, p.beta_n * premium, p.alpha_r, p.beta_r, p.gamma)
        configs = SINGLE + INTRA + [(2, 8), (4, 16)]
        out[f"j{i}"] = synthetic(params["fast"], configs, job=f"j{i}", gpu="fast", seed=40 + i, accums=(0,)) + synthetic(
            params["slow"], configs, job=f"j{i}", gpu="slow", seed=140 + i, accums=(0,))
    return out


def test_warm_calibration_measures_how_well_single_node_data_carry_to_multi_node():
    # P3's rule (own intra-node sync × other jobs' inter/intra ratio) holds where the jobs' networks
    # cost alike, and fails where one job's inter-node premium is 10x another's
    alike = ClusterPrior.from_observations(_premium_cluster([1.0, 1.1, 0.9, 1.05]))
    unlike = ClusterPrior.from_observations(_premium_cluster([0.3, 3.0, 0.5, 2.0]))
    a, u = alike.warm_calibration(), unlike.warm_calibration()
    situation = "same type, multi-node"
    assert situation in a and situation in u
    # the ensemble of ratio members spreads with the jobs' disagreement; the calibration sets how far
    # to trust that spread: narrower where the rule holds, about as wide where the jobs disagree
    assert a[situation] < 0.75 and u[situation] > 1.5 * a[situation]
    # where the rule holds this well, the measured factor falls below the cold calibration's floor and is kept
    from goodput.cluster_prior import CALIBRATION_RANGE, WARM_CALIBRATION_RANGE

    assert WARM_CALIBRATION_RANGE[0] <= min(a.values()) < CALIBRATION_RANGE[0]
    # the factor reaches the predictions: a warm job's multi-node std on a type with its single-node data
    new = [dataclasses.replace(o, job="new") for o in _premium_cluster([1.0])["j0"] if o.num_nodes == 1]
    neutral = ClusterPrior(unlike.summaries, calibration={}, warm={}, shapes=unlike.shapes)
    nodes, replicas = np.array([1, 1, 2, 4]), np.array([1, 8, 8, 16])
    scaled = JobModel("new", 8, cluster_prior=unlike).observe(new).predict("fast", nodes, replicas, 32).log_std
    plain = JobModel("new", 8, cluster_prior=neutral).observe(new).predict("fast", nodes, replicas, 32).log_std
    np.testing.assert_allclose(scaled, plain * np.array([1.0, 1.0, u[situation], u[situation]]), rtol=1e-9)
    # ... and on a type it ran on 1 GPU only, every multi-GPU regime (P2's situation)
    new = [o for o in new if o.gpu_type == "fast" or o.num_replicas == 1]
    scaled = JobModel("new", 8, cluster_prior=unlike).observe(new).predict("slow", nodes, replicas, 32).log_std
    plain = JobModel("new", 8, cluster_prior=neutral).observe(new).predict("slow", nodes, replicas, 32).log_std
    intra, inter = u["other type, single-node"], u["other type, multi-node"]
    np.testing.assert_allclose(scaled, plain * np.array([1.0, intra, inter, inter]), rtol=1e-9)
    spread = JobModel("new", 8, cluster_prior=unlike).observe(new).diagnostics["transfers"]
    assert spread["slow"]["spread_scale"] == pytest.approx({"intra2": intra, "intramany": intra, "inter": inter}, abs=1e-3)
    assert spread["fast"]["spread_scale"] == pytest.approx({"inter": u[situation]}, abs=1e-3)
    # saved and loaded with the prior; unknown situations and bad factors are refused
    loaded = ClusterPrior.from_dict(json.loads(json.dumps(unlike.to_dict())))
    assert loaded.warm_calibration() == pytest.approx(u) and loaded.observations is None
    with pytest.raises(ValueError, match="warm_calibration"):
        ClusterPrior.from_dict({"summaries": [], "warm_calibration": {"nowhere": 1.0}})
    with pytest.raises(ValueError, match="warm_calibration"):
        ClusterPrior.from_dict({"summaries": [], "warm_calibration": {situation: 0.0}})
    # one job: nothing to model it from, no calibration
    assert ClusterPrior.from_observations(_premium_cluster([1.0])).warm_calibration() == {}


def test_a_sync_hidden_behind_compute_on_the_reference_type_is_not_carried():
    from goodput.transfer import CARRY_MAX_GAMMA, Regimes, _carried_members

    others = {name: _job(name, c, s, seed=i) for i, (name, c, s) in enumerate([("a", 0.5, 0.6), ("b", 2.0, 1.7)])}
    prior = ClusterPrior.from_observations(others)
    on_ref, other = prior.find("a", "fast"), prior.find("a", "slow")
    single_node = Regimes.of(synthetic(FAST, SINGLE + INTRA, job="new", gpu="fast", seed=1, accums=(0,)))
    assert single_node.has_single_node_multi and not single_node.has_inter
    own = np.array([0.05, 0.002, 0.0, 0.0, 0.0, 0.0, 1.0])  # this type: compute only
    visible = np.array([0.05, 0.002, 0.04, 0.004, 0.04, 0.004, 1.5])
    (member,) = _carried_members(own, visible, None, single_node, 0.06, on_ref, other)
    assert member.theta[0] == 0.05 and member.theta[6] == 1.5 and member.weight == 1.0
    inter_ratio = on_ref.params_g.alpha_n / on_ref.params_g.alpha_r * other.params_g.alpha_n / on_ref.params_g.alpha_n
    assert member.theta[2] == pytest.approx(0.04 * inter_ratio)
    # with a posterior over γ on the reference type: one member per γ, each with its weight
    steep = visible.copy()
    steep[4], steep[6] = 0.08, 2.5
    members = _carried_members(own, visible, [(visible, 0.25), (steep, 0.75)], single_node, 0.06, on_ref, other)
    assert [m.weight for m in members] == [0.25, 0.75] and [m.theta[6] for m in members] == [1.5, 2.5]
    assert members[1].theta[2] == pytest.approx(0.08 * inter_ratio) and members[1].theta[0] == 0.05
    hidden = visible.copy()
    hidden[6] = CARRY_MAX_GAMMA + 1.0  # the fit could hide its sync behind compute: not identified
    assert _carried_members(own, hidden, None, single_node, 0.06, on_ref, other) == []
    one_gpu = Regimes.of(synthetic(FAST, SINGLE, job="new", gpu="fast", seed=1, accums=(0,)))
    assert _carried_members(own, visible, None, one_gpu, 0.06, on_ref, other) == []  # nothing of its own sync to carry


def test_gamma_posterior_weights_the_overlaps_single_node_data_allow():
    from goodput.throughput import fit_throughput
    from goodput.transfer import GAMMA_GRID, GAMMA_MIN_WEIGHT, _gamma_posterior

    truth = ThroughputParams(0.02, 0.001, 0.3, 0.02, 0.06, 0.006, 2.0)
    obs = synthetic(truth, SINGLE + INTRA, gpu="fast", seed=5, accums=(0,), noise=0.01)
    own = fit_throughput(obs)
    posterior = _gamma_posterior(obs, 0.02, own)
    gammas = np.array([theta[6] for theta, _ in posterior])
    weights = np.array([w for _, w in posterior])
    assert weights.sum() == pytest.approx(1.0) and np.all(weights >= GAMMA_MIN_WEIGHT * 0.999)
    assert set(gammas) <= {*GAMMA_GRID, own.gamma}
    mean_gamma = weights @ gammas
    assert mean_gamma >= 1.5 and mean_gamma <= 2.6  # around the truth's overlap
    # a looser structural error spreads the weight over more overlaps; a tighter one concentrates it
    loose = _gamma_posterior(obs, 0.2, own)
    tight = _gamma_posterior(obs, 0.002, own)
    assert len(loose) > len(tight) and max(w for _, w in tight) > max(weights)

    def spread(posterior) -> float:
        g = np.array([theta[6] for theta, _ in posterior])
        w = np.array([w for _, w in posterior])
        return float(np.sqrt(w @ (g - w @ g) ** 2))

    # the compute times measured beside the steps (step − sync wait) tell overlap from sync too
    noisy = synthetic(truth, SINGLE + INTRA, gpu="fast", seed=5, accums=(0,), noise=0.05)
    blind = [dataclasses.replace(o, sync_time=None) for o in noisy]
    assert spread(_gamma_posterior(noisy, 0.05, fit_throughput(noisy))) < 0.7 * spread(_gamma_posterior(blind, 0.05, fit_throughput(blind)))


def _in_unit(observations, factor: float):
    return [dataclasses.replace(o, step_time=o.step_time * factor, sync_time=None if o.sync_time is None else o.sync_time * factor)
            for o in observations]


@pytest.mark.parametrize("factor", [1e3, 1e-3])
def test_predictions_do_not_depend_on_the_unit_of_time(factor):
    # Every time in milliseconds (or kiloseconds) instead of seconds: the fits, the other jobs'
    # sync profiles, the transfer rules, the GP and the calibrations must give the same
    # predictions in that unit. A constant in seconds anywhere (a bound, a threshold, a prior)
    # would break this for jobs whose steps take milliseconds or minutes.
    others = {"a": _job("a", 1.0, 1.0, 1), "b": _job("b", 2.0, 3.0, 2)}
    # the new job: single-node data on the fast type, 1-GPU profiles on the slow one (P2's situation)
    target = [o for o in _job("c", 1.5, 0.7, 3) if (o.gpu_type == "fast" and o.num_nodes == 1) or o.num_replicas == 1]
    nodes, replicas = np.array([c[0] for c in TESTS]), np.array([c[1] for c in TESTS])
    for with_prior in (False, True):
        models = [
            JobModel("c", init_batch_size=32,
                     cluster_prior=ClusterPrior.from_observations({j: _in_unit(o, f) for j, o in others.items()}) if with_prior else None)
            .observe(_in_unit(target, f))
            for f in (1.0, factor)
        ]
        for gpu in ("fast", "slow"):
            seconds, other_unit = (m.predict(gpu, nodes, replicas, 64) for m in models)
            np.testing.assert_allclose(other_unit.step_time, seconds.step_time * factor, rtol=1e-6, err_msg=f"{gpu}, prior={with_prior}")
            np.testing.assert_allclose(other_unit.log_std, seconds.log_std, rtol=1e-6, err_msg=f"{gpu}, prior={with_prior}")
            assert np.all(seconds.log_std > 0)


def test_a_type_seen_at_one_batch_size_extrapolates_within_what_a_compute_split_allows():
    """A compute split near 1 (host-bound, like ncf) must not blow up far batch sizes.

    The type is first seen at one batch size b₀, so its split of compute between α_c
    and β_c·b₀ comes from the job's other type as a linear part of the GP. Observations
    at 2 and 6 b₀ are conditioned online; at 512 b₀ any split gives between c₀ and
    512 c₀. The tangent linearisation predicted e^80 s there on a case like this one.
    """
    host_bound = ThroughputParams(0.006, 1e-8, 0.02, 0.001, 0.004, 0.0005, 2.0)
    ref = synthetic(host_bound, SINGLE + INTRA, bszs=(64, 128, 256, 512, 1024), accums=(0,), seed=3, job="hb", gpu="ref")
    first = synthetic(host_bound, SINGLE * 3, bszs=(64,), accums=(0,), seed=4, job="hb", gpu="new")
    later = synthetic(host_bound, SINGLE, bszs=(128, 384), accums=(0,), seed=5, job="hb", gpu="new")
    model = JobModel("hb", init_batch_size=64).observe(ref + first).refit()
    refits = model.diagnostics["refits"]
    model.observe(later)
    assert model.diagnostics["refits"] == refits  # conditioned online, the split still a linear part
    c0 = float(predict_step_time(host_bound, 1, 1, 64))
    far = model.predict("new", 1, 1, 64 * 512)
    low, high = far.interval(0.9)
    truth = float(predict_step_time(host_bound, 1, 1, 64 * 512))
    assert low <= truth <= high
    assert c0 / 2 < far.step_time < 512 * c0 and high < 2 * 512 * c0


def test_the_weak_default_votes_only_when_it_can_match_a_warm_types_own_sync():
    """Sync 1000× the compute: the default's profile (sync ~ half the compute) must not pull it down.

    Observed on two GPUs of one node and on two nodes, the type's own sync is 0.1 s. Its
    more-GPUs regime is voted on by the job's other type and the weak default; unscaled, the
    default's members sat at 1e-5 s and the geometric mean of the votes predicted 2 GPUs
    (observed!) 40 times too fast.
    """
    sync_bound = ThroughputParams(1e-4, 1e-8, 0.1, 0.001, 0.1, 0.001, 1.0)
    ref = synthetic(sync_bound, SINGLE + INTRA + [(2, 8)], bszs=(8, 32, 128), accums=(0,), seed=1, job="sb", gpu="ref")
    new = synthetic(sync_bound, [(1, 1), (1, 2), (2, 4)], bszs=(8, 16), accums=(0,), seed=2, job="sb", gpu="new")
    model = JobModel("sb", init_batch_size=8).observe(ref + new)
    configs = [(1, 2, 256), (1, 4, 8), (1, 8, 64)]
    nodes, replicas, bsz = (np.array(v, dtype=float) for v in zip(*configs))
    truth = predict_step_time(sync_bound, nodes, replicas, bsz)
    assert np.all(np.abs(np.log(model.predict("new", nodes, replicas, bsz).step_time / truth)) < math.log(1.5))


def test_known_sizes_tell_the_overlap_that_single_node_data_leave_open():
    """Sync per parameter is a constant of the type: from other jobs' sizes it pins α_r, and with it γ."""
    from goodput.throughput import fit_throughput
    from goodput.transfer import SIZE_SYNC_MIN_STD, _gamma_posterior, _size_sync_prior

    others = {"a": _job("a", 1.0, 0.5, 0), "b": _job("b", 1.0, 2.0, 1)}
    prior = ClusterPrior.from_observations(others, sizes={"a": 5e6, "b": 2e7})
    mean, std = _size_sync_prior(1e7, prior.on("fast"))
    assert math.exp(mean) == pytest.approx(FAST.alpha_r, rel=0.15) and std == SIZE_SYNC_MIN_STD  # 0.5x at 5e6, 2x at 2e7
    assert _size_sync_prior(None, prior.on("fast")) is None
    one = ClusterPrior.from_observations(others, sizes={"a": 5e6})  # one job of known size: no constant to learn
    assert _size_sync_prior(1e7, one.on("fast")) is None

    # sync as large as compute on one node, no compute times measured: γ from 1 to 5 (α_r 0.016-0.19 s) fit alike
    truth = ThroughputParams(0.2, 0.002, 0.6, 0.02, 0.12, 0.0, 2.5)
    noisy = [dataclasses.replace(o, sync_time=None) for o in synthetic(truth, SINGLE + INTRA, gpu="fast", seed=5, accums=(0,), noise=0.05)]
    own = fit_throughput(noisy)

    def spread(posterior, column: int, transform=lambda v: v) -> float:
        values = np.array([transform(theta[column]) for theta, _ in posterior])
        w = np.array([w for _, w in posterior])
        return float(np.sqrt(w @ (values - w @ values) ** 2))

    blind = _gamma_posterior(noisy, 0.05, own)
    told = _gamma_posterior(noisy, 0.05, own, sync_prior=(math.log(truth.alpha_r), SIZE_SYNC_MIN_STD))
    assert spread(told, 4, math.log) < 0.5 * spread(blind, 4, math.log) and spread(told, 6) < 0.9 * spread(blind, 6)
    # centred on a wrong α_r, it moves the overlaps the other way
    off = _gamma_posterior(noisy, 0.05, own, sync_prior=(math.log(truth.alpha_r * 3), SIZE_SYNC_MIN_STD))
    assert sum(w * t[4] for t, w in off) > sum(w * t[4] for t, w in told)


def test_known_sizes_carry_other_jobs_inter_node_sync_per_parameter(monkeypatch):
    """Half of each other job's multi-node vote scales its inter-node sync by the ratio of parameter counts."""
    import goodput.transfer as transfer
    from goodput.transfer import SIZE_LAW_WEIGHT, _ratio_members, _size_law_member

    others = {"a": _job("a", 1.0, 0.5, 0), "b": _job("b", 1.0, 2.0, 1)}  # sync ∝ size: 5e6 and 2e7 parameters
    prior = ClusterPrior.from_observations(others, sizes={"a": 5e6, "b": 2e7})
    a = prior.find("a", "fast")
    own = FAST.as_array()
    member = _size_law_member(own, a, 1e7)
    assert member.theta[2] == pytest.approx(a.params_g.alpha_n * 2.0) and member.theta[3] / member.theta[2] == pytest.approx(
        a.params_g.beta_n / a.params_g.alpha_n)
    np.testing.assert_array_equal(np.delete(member.theta, [2, 3]), np.delete(own, [2, 3]))  # own compute, intra-node sync, γ
    assert _size_law_member(own, a, None) is None
    assert _size_law_member(own, ClusterPrior.from_observations(others).find("a", "fast"), 1e7) is None  # its size unknown
    grid = [(own, 0.75), (dataclasses.replace(FAST, gamma=2.0).as_array(), 0.25)]
    both = _ratio_members(grid, own, a, 1e7)
    law = [m for m in both if "parameter counts" in m.source]
    assert len(both) == 4 and sum(m.weight for m in both) == pytest.approx(1.0)
    assert [m.weight for m in law] == pytest.approx([0.75 * SIZE_LAW_WEIGHT, 0.25 * SIZE_LAW_WEIGHT])
    ratio_only = _ratio_members(grid, own, a)
    assert [m.theta.tolist() for m in ratio_only] == [m.theta.tolist() for m in both if m.source == ratio_only[0].source]

    nodes, replicas = np.array([2, 4]), np.array([8, 16])

    def log_errors(truth: ThroughputParams) -> tuple[np.ndarray, np.ndarray]:
        """Multi-node log errors of a new job of 1e7 parameters seen on one node: with the size law, and with the ratio rule alone."""
        new = synthetic(truth, SINGLE + INTRA, job="new", gpu="fast", seed=7, accums=(0,), noise=0.01)
        actual = predict_step_time(truth, nodes, replicas, 32)
        out = []
        for weight in (SIZE_LAW_WEIGHT, 0.0):
            monkeypatch.setattr(transfer, "SIZE_LAW_WEIGHT", weight)
            out.append(np.log(JobModel("new", 8, cluster_prior=prior, model_size=1e7).observe(new).predict("fast", nodes, replicas, 32).step_time / actual))
        return out[0], out[1]

    # a job whose intra-node sync is half the others' per parameter but whose network costs what
    # theirs does: the ratio rule (own intra-node × their inter/intra ratio) halves its multi-node
    # sync, the size law does not
    law, ratio = log_errors(dataclasses.replace(FAST, alpha_r=FAST.alpha_r / 2, beta_r=FAST.beta_r / 2))
    assert np.all(np.abs(law) < 0.75 * np.abs(ratio))
    # a job that follows both rules: they agree, and the size law changes nothing
    law, ratio = log_errors(FAST)
    np.testing.assert_allclose(law, ratio, atol=0.01)


# ---------------------------------------------------------------------------- faults a review found

_P = ThroughputParams(0.01, 0.0005, 0.12, 0.006, 0.03, 0.003, 1.5)
_Q = ThroughputParams(0.02, 0.001, 0.30, 0.01, 0.06, 0.004, 1.5)
_SHAPED = [(1, 1), (1, 2), (1, 4), (2, 4), (4, 4), (2, 8)]


def _shaped_cluster():
    """Two jobs whose 2 nodes × 4 replicas wait 60% longer than Pollux's form says: a sync shape on t4."""
    def bend(o):
        return dataclasses.replace(o, step_time=o.step_time * 1.6, sync_time=None) if (o.num_nodes, o.num_replicas) == (2, 4) else o

    return {j: [bend(o) for o in synthetic(p, _SHAPED, job=j, gpu="t4", seed=s, accums=(0,))] for j, p, s in (("j1", _P, 1), ("j2", _Q, 2))}


def test_the_reference_type_of_a_cold_type_does_not_depend_on_the_order_types_were_seen():
    params = {"a": _P, "b": _Q, "c": ThroughputParams(0.04, 0.002, 0.20, 0.01, 0.05, 0.003, 1.5)}
    other = [o for i, (g, p) in enumerate(params.items()) for o in synthetic(p, [(1, 1), (1, 2), (1, 4), (2, 8)], job="other", gpu=g, seed=i, accums=(0,))]
    prior = ClusterPrior.from_observations({"other": other})
    mine = {"a": synthetic(_P, [(1, 1), (1, 2), (1, 4)], job="me", gpu="a", seed=10, accums=(0,)),
            "b": synthetic(_Q, [(1, 1), (1, 2), (1, 4)], job="me", gpu="b", seed=11, accums=(0,)),
            "c": synthetic(params["c"], [(1, 1)], job="me", gpu="c", seed=12, accums=(0,))}
    config = tuple(np.array([v]) for v in (2.0, 8.0, 32.0, 0.0))
    seen = []
    for order in (["a", "b", "c"], ["b", "a", "c"]):  # a and b have as many multi-GPU rows: a tie
        observations = {t: mine[t] for t in order}
        transfer = build_transfer({t: fit_throughput(observations[t]) for t in order}, observations, prior)["c"]
        seen.append((transfer.predict_log(*config)[0][0], transfer.borrowed))
    assert seen[0][0] == pytest.approx(seen[1][0], rel=1e-9) and seen[0][1] == seen[1][1]


def test_a_loaded_prior_without_a_job_drops_the_sync_shapes_it_taught():
    full = ClusterPrior.from_observations(_shaped_cluster())
    assert full.sync_shape("t4") is not None and full.exclude("j2").sync_shape("t4") is None
    loaded = ClusterPrior.from_dict(json.loads(json.dumps(full.to_dict())))
    assert loaded.sync_shape("t4") is not None
    left = loaded.exclude("j2")
    assert left.jobs == ["j1"] and left.sync_shape("t4") is None


def test_the_cold_calibration_needs_two_jobs_not_one_job_on_two_types():
    cells = [(1, 1), (1, 2), (1, 4), (2, 8)]
    prior = ClusterPrior.from_observations({
        "A": synthetic(_P, cells, job="A", gpu="x", seed=1, accums=(0,)) + synthetic(_Q, cells, job="A", gpu="y", seed=2, accums=(0,)),
        "B": synthetic(_Q, [(1, 1)], job="B", gpu="x", seed=3, accums=(0,)),
    })
    assert prior.cold_calibration() == {}


def test_a_prior_from_models_refits_a_fit_made_under_another_sync_shape():
    shaped = ClusterPrior.from_observations(_shaped_cluster())
    mine = synthetic(_P, _SHAPED, job="me", gpu="t4", seed=5, accums=(0,))
    model = JobModel("me", init_batch_size=32, cluster_prior=shaped, bayesian=False).observe(mine)
    from_model = ClusterPrior.from_models([model]).find("me", "t4").params
    assert from_model == ClusterPrior.from_observations({"me": mine}).find("me", "t4").params
    assert from_model != model.own_fit("t4")  # the model's own, made under the shape, is not this prior's


@pytest.mark.parametrize("key, value", [("size", -1e6), ("size", "big"), ("c_ref", 0.0), ("struct_multi", -0.1), ("size_proxy", 0.0)])
def test_a_loaded_summary_with_a_bad_value_is_refused_at_load(key, value):
    from goodput.errors import ValidationError

    data = ClusterPrior.from_observations(_shaped_cluster()).to_dict()
    data["summaries"][0][key] = value
    with pytest.raises(ValidationError, match=key):
        ClusterPrior.from_dict(data)
