"""The residual GP's hyperprior with several modes: kept by the cluster's fit, chosen per job, saved and loaded."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import numpy as np
import pytest

import goodput.gp_fit as gp_fit
from goodput import JobModel, Observation, ValidationError
from goodput.gp import HyperPrior, config_features
from goodput.gp_fit import fit_hyperparameters_over_modes, fit_shared_hyperparameters

NOISY = HyperPrior((2.0,) * 6, 0.001, 0.01)  # the residual is mostly noise
ROUGH = HyperPrior((2.0, 0.5, 2.0, 2.0, 2.0, 2.0), 0.02, 1e-5)  # a residual that varies on a short scale, no noise


def _per_gpu_count_offsets(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """One job's residuals, measured once per configuration: an offset per GPU count, the same at every batch size."""
    rng = np.random.default_rng(seed)
    replicas, bsz = (grid.ravel() for grid in np.meshgrid([1, 2, 4, 8], [16, 32, 64, 128, 256]))
    offsets = dict(zip((1, 2, 4, 8), rng.normal(0.0, 0.2, 4)))
    y = np.array([offsets[r] for r in replicas]) + rng.normal(0.0, 0.005, replicas.size)
    return config_features(np.ones(replicas.size), replicas, bsz, np.zeros(replicas.size)), y


def test_a_job_takes_the_mode_its_data_favour_unless_the_cluster_weighs_it_down_too_far():
    x, y = _per_gpu_count_offsets()
    t, s = np.zeros(y.size, dtype=int), np.zeros((y.size, 0))
    start = NOISY.initial(1)
    mild = replace(NOISY, alternatives=((ROUGH, -2.0),))
    hyper, mode = fit_hyperparameters_over_modes(x, t, s, y, start, mild)
    assert mode == 1 and hyper.noise < 1e-3  # the offsets are signal: 4 levels, not 20 draws of noise
    alone, alone_mode = fit_hyperparameters_over_modes(x, t, s, y, start, NOISY)
    assert alone_mode == 0 and alone.noise > hyper.noise
    far = replace(NOISY, alternatives=((ROUGH, -1e6),))
    assert fit_hyperparameters_over_modes(x, t, s, y, start, far)[1] == 0
    # without alternatives: fit_hyperparameters itself
    assert alone == gp_fit.fit_hyperparameters(x, t, s, y, start, hyper_prior=NOISY)


def test_the_shared_fit_keeps_each_optimum_best_first_with_its_log_evidence(monkeypatch):
    """Two basins in the noise (log 1e-4, the deeper; log 1e-2): the starts find both, and the worse is kept as an
    alternative weighted by the difference of the two objectives (summed over points)."""
    deep, shallow = math.log(1e-4), math.log(1e-2)

    def two_basins(params, groups, total):
        ln = params[-2]
        a, b = math.exp(-((ln - deep) ** 2)), 0.5 * math.exp(-((ln - shallow) ** 2))
        value = -math.log(a + b) + 0.5 * float(np.sum(params**2)) - 0.5 * ln**2
        grad = params.copy()
        grad[-2] = (2 * (ln - deep) * a + 2 * (ln - shallow) * b) / (a + b)
        return value / total, grad / total

    monkeypatch.setattr(gp_fit, "_shared_negative_log_likelihood", two_basins)
    rng = np.random.default_rng(0)
    groups = [(rng.normal(size=(10, 6)), rng.normal(0.0, 0.1, 10)) for _ in range(3)]  # variance 0.01: starts at 3e-3, 1e-4, 9.5e-3
    prior = fit_shared_hyperparameters(groups)
    assert prior.noise == pytest.approx(1e-4 + gp_fit.NOISE_FLOOR, rel=1e-3)
    (other, weight), = prior.alternatives
    assert other.noise == pytest.approx(1e-2 + gp_fit.NOISE_FLOOR, rel=1e-3)
    assert weight == pytest.approx(-math.log(2.0), abs=0.01)  # the shallow basin is half as deep: log 2 worse (×1)


def test_modes_carry_the_clusters_spread_and_tails_and_round_trip():
    prior = replace(NOISY, log_std=0.7, noise_dof=6.0, alternatives=((ROUGH, -8.0),))
    (first, w0), (second, w1) = prior.modes()
    assert (w0, w1) == (0.0, -8.0) and first.alternatives == ()
    assert (second.log_std, second.noise_dof, second.noise) == (0.7, 6.0, ROUGH.noise)
    again = HyperPrior.from_dict(json.loads(json.dumps(prior.to_dict())))
    assert again == prior
    assert "alternatives" not in NOISY.to_dict() and HyperPrior.from_dict(NOISY.to_dict()) == NOISY  # files from before load
    for bad, field in (((ROUGH, 1.0), "log_weight"), ((prior, -1.0), "alternatives"), ((ROUGH,), "alternatives"),
                       (("x", -1.0), "alternatives")):
        with pytest.raises(ValidationError, match=field):
            replace(NOISY, alternatives=(bad,))
    with pytest.raises(ValidationError, match="alternatives"):
        HyperPrior.from_dict({**NOISY.to_dict(), "alternatives": [{"prior": ROUGH.to_dict()}]})


def test_a_job_model_reports_the_mode_its_refit_chose():
    _, y = _per_gpu_count_offsets(seed=1)
    replicas, bsz = (grid.ravel() for grid in np.meshgrid([1, 2, 4, 8], [16, 32, 64, 128, 256]))
    obs = [Observation(job="j", gpu_type="v100", num_nodes=1, num_replicas=int(r), local_bsz=int(b),
                       step_time=float((0.02 + 0.001 * b) * (1 + 0.1 * math.log2(r)) * math.exp(e)))
           for r, b, e in zip(replicas, bsz, y)]
    from goodput.hierarchy import ClusterPrior

    base = ClusterPrior.from_observations({"other": [replace(o, job="other") for o in obs]})
    for gp_prior, mode in ((replace(NOISY, alternatives=((ROUGH, -2.0),)), 1), (NOISY, 0)):
        model = JobModel("j", init_batch_size=16, cluster_prior=replace(base, gp_prior=gp_prior)).observe(obs)
        assert model.diagnostics["gp_prior_mode"] == mode


def test_a_saved_cluster_prior_keeps_its_modes(tmp_path):
    from goodput.hierarchy import ClusterPrior

    obs = [Observation(job="a", gpu_type="t4", num_nodes=1, num_replicas=r, local_bsz=b, step_time=0.01 * r + 0.001 * b)
           for r in (1, 2) for b in (8, 16, 32)]
    prior = replace(ClusterPrior.from_observations({"a": obs}), gp_prior=replace(NOISY, alternatives=((ROUGH, -3.5),)))
    loaded = ClusterPrior.load(prior.save(tmp_path / "prior.json"))
    assert loaded.gp_prior == prior.gp_prior and loaded.gp_prior.alternatives[0][1] == -3.5


def test_one_job_leaving_gavels_cluster_no_longer_flips_the_others_models(data_dir):
    """With every job, Gavel's residuals favour the short-scale mode by 43 in log evidence; without lm, the noise
    mode by 9 (restricted likelihoods; 40 and 8 by the plain one). A job's model under the one prior or the other: its predictions moved by up to 0.33 in log when
    the hyperprior was the cluster's best mode alone; with the modes mixed, its own data keep its mode."""
    from experiments.datasets import read_measurements, resolve_model_sizes
    from goodput.hierarchy import ClusterPrior

    gavel = data_dir / "gavel"
    measured = read_measurements(gavel)
    sizes = resolve_model_sizes("auto", gavel, sorted(measured.models)).sizes
    full = ClusterPrior.from_observations(measured.models, sizes)
    without_lm = full.exclude("lm")
    assert full.gp_prior.noise < 1e-4 < without_lm.gp_prior.noise  # the best mode flips
    assert [round(w) for _, w in full.gp_prior.alternatives] == [-43]
    assert [round(w) for _, w in without_lm.gp_prior.alternatives] == [-9]
    v100 = [o for o in measured.models["resnet-18"] if o.gpu_type == "v100"]
    train = [v100[i] for i in np.random.default_rng(0).permutation(len(v100))[:20]]
    logs = []
    for gp_prior in (full.gp_prior, without_lm.gp_prior):
        prior = replace(full.exclude("resnet-18"), gp_prior=gp_prior)
        model = JobModel("resnet-18", init_batch_size=min(o.local_bsz for o in train), cluster_prior=prior,
                         model_size=sizes.get("resnet-18")).observe(train)
        logs.append(np.log([model.predict("v100", o.num_nodes, o.num_replicas, o.local_bsz).step_time for o in v100]))
    assert np.max(np.abs(logs[0] - logs[1])) < 0.1  # 0.33 with the best mode alone
