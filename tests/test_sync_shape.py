"""The cluster's inter-node sync shape: lookup, learning from jobs, use by a new job's model."""

from __future__ import annotations

import json

import numpy as np
import pytest

from goodput import JobModel, Observation
from goodput.errors import ValidationError
from goodput.sync_shape import SyncShape, learn_sync_shape
from goodput.throughput import ThroughputParams, fit_throughput, predict_compute_time, predict_step_time
from goodput.hierarchy import ClusterPrior

# A cluster whose network bends Pollux's inter-node sync: 2 nodes full of GPUs wait long,
# one GPU per node waits little (as on Pollux's T4 traces).
TRUE_SHAPE = SyncShape({(2, 2): 0.7, (2, 4): 1.2, (2, 8): 1.8, (4, 4): 0.7, (4, 8): 1.0, (4, 16): 1.1})
CELLS = [(1, 1), (1, 2), (1, 4), (2, 2), (2, 4), (2, 8), (4, 4), (4, 8), (4, 16)]
BASE = ThroughputParams(0.02, 0.001, 0.15, 0.004, 0.03, 0.002, 1.3)


def _job(name: str, compute: float, sync: float, seed: int, cells=CELLS, gpu: str = "t4", noise: float = 0.03) -> list[Observation]:
    """Observations of a job whose sync costs ``sync`` × BASE's, on a cluster with TRUE_SHAPE."""
    p = BASE
    params = ThroughputParams(p.alpha_c * compute, p.beta_c * compute, p.alpha_n * sync, p.beta_n * sync, p.alpha_r * sync,
                              p.beta_r * sync, p.gamma)
    rng = np.random.default_rng(seed)
    out = []
    for nodes, replicas in cells:
        for bsz in (8, 16, 32, 64, 128):
            factor = float(np.exp(rng.normal(0.0, noise)))
            step = float(predict_step_time(params, nodes, replicas, bsz, 0, sync_shape=TRUE_SHAPE)) * factor
            compute_time = float(predict_compute_time(params, bsz)) * factor
            out.append(Observation(job=name, gpu_type=gpu, num_nodes=nodes, num_replicas=replicas, local_bsz=bsz,
                                   step_time=step, sync_time=max(step - compute_time, 0.0)))
    return out


def _cluster(n: int = 4) -> dict[str, list[Observation]]:
    return {f"j{i}": _job(f"j{i}", 1.0 + 0.4 * i, 0.6 + 0.5 * i, seed=i) for i in range(n)}


def test_shape_looks_up_its_cells_and_is_one_elsewhere():
    nodes = np.array([1, 2, 2, 4, 3, 8, 4])
    replicas = np.array([4, 2, 8, 16, 6, 32, 5])
    assert TRUE_SHAPE(nodes, replicas).tolist() == [1.0, 0.7, 1.8, 1.1, 1.0, 1.0, 1.0]
    assert float(TRUE_SHAPE(2, 8)) == 1.8 and TRUE_SHAPE(np.full((2, 3), 2), 4).shape == (2, 3)
    assert not SyncShape({}) and np.all(SyncShape({})(nodes, replicas) == 1.0)
    loaded = SyncShape.from_dict(json.loads(json.dumps(TRUE_SHAPE.to_dict())))
    assert loaded == TRUE_SHAPE and loaded(nodes, replicas).tolist() == TRUE_SHAPE(nodes, replicas).tolist()
    for bad, field in [({(1, 2): 1.2}, "factors"), ({(2, 1): 1.2}, "factors"), ({(2, 4): -1.0}, "factors[(2, 4)]"),
                       ({(2, 4): 50.0}, "factors[(2, 4)]"), ({"24": 1.0}, "factors")]:
        with pytest.raises(ValidationError) as info:
            SyncShape(bad)
        assert info.value.field == field
    with pytest.raises(ValidationError, match="sync_shape"):
        SyncShape.from_dict({"cells": []})


def test_learning_recovers_the_shape_the_jobs_share():
    jobs = _cluster()
    shape = learn_sync_shape(jobs.values())
    assert shape is not None and shape.jobs == 4 and set(shape.factors) == set(TRUE_SHAPE.factors)
    # each job's own α_n, β_n absorb a common level and a slope in the replicas, so compare
    # cells of as many replicas on different numbers of nodes
    for a, b in [((2, 8), (4, 8)), ((2, 4), (4, 4))]:
        learned, truth = shape.factors[a] / shape.factors[b], TRUE_SHAPE.factors[a] / TRUE_SHAPE.factors[b]
        assert learned == pytest.approx(truth, rel=0.15), (a, b, learned, truth)
    # one job cannot tell the cluster's shape from its own misfit; a cell only one job ran gets no factor
    assert learn_sync_shape([jobs["j0"]]) is None
    assert learn_sync_shape([jobs["j0"], [o for o in jobs["j1"] if o.num_nodes == 1]]) is None
    partial = learn_sync_shape([jobs["j0"], jobs["j1"], [o for o in jobs["j2"] if (o.num_nodes, o.num_replicas) != (2, 8)]])
    assert (2, 8) in partial.factors
    lone = learn_sync_shape([jobs["j0"], [o for o in jobs["j1"] if (o.num_nodes, o.num_replicas) != (2, 8)]])
    assert (2, 8) not in lone.factors and (4, 16) in lone.factors


def test_a_new_job_predicts_placements_it_has_not_run_from_the_clusters_shape():
    prior = ClusterPrior.from_observations(_cluster())
    shape = prior.sync_shape("t4")
    assert shape is not None and prior.sync_shape("a100") is None
    seen = [(1, 1), (1, 2), (1, 4), (4, 4), (4, 8), (4, 16)]
    new = _job("new", 1.6, 1.3, seed=9, cells=seen)
    truth = _job("new", 1.6, 1.3, seed=10, cells=[(2, 2), (2, 4), (2, 8)], noise=0.0)
    step = np.array([o.step_time for o in truth])
    nodes, replicas, bsz = (np.array([getattr(o, k) for o in truth]) for k in ("num_nodes", "num_replicas", "local_bsz"))
    plain = fit_throughput(new)
    shaped = fit_throughput(new, sync_shape=shape)
    err_plain = np.median(np.abs(predict_step_time(plain, nodes, replicas, bsz) / step - 1))
    err_shaped = np.median(np.abs(predict_step_time(shaped, nodes, replicas, bsz, sync_shape=shape) / step - 1))
    assert err_shaped < 0.05 < err_plain  # Pollux's form alone misses the 2-node placements
    # the job's model takes the shape from its prior, in its own fit and in its Bayesian mean
    model = JobModel("new", 8, cluster_prior=prior).observe(new)
    assert model.sync_shape("t4") is shape
    assert model.own_fit("t4").alpha_n == pytest.approx(shaped.alpha_n, rel=1e-3)
    assert model.diagnostics["sync_shape"]["t4"]["2x8"] == pytest.approx(shape.factors[(2, 8)], abs=1e-3)
    bayes = model.predict("t4", nodes, replicas, bsz).step_time
    assert np.median(np.abs(bayes / step - 1)) < 0.05
    # saved and loaded with the prior; leaving a job out relearns it from the others
    loaded = ClusterPrior.from_dict(json.loads(json.dumps(prior.to_dict())))
    assert loaded.sync_shape("t4") == shape
    with pytest.raises(ValidationError, match="sync_shape"):
        ClusterPrior.from_dict({"summaries": [], "sync_shapes": {"t4": {"cells": []}}})
    with pytest.raises(ValidationError, match="sync_shapes"):
        ClusterPrior.from_dict({"summaries": [], "sync_shapes": [1, 2]})
    left_out = prior.exclude("j0")
    assert left_out.sync_shape("t4").jobs == 3 and left_out.jobs == ["j1", "j2", "j3"]
    assert prior.exclude("j0") is left_out  # memoised
    assert ClusterPrior(prior.summaries).exclude("j0").sync_shape("t4") is None  # no observations: what it holds
    # other jobs' models teach the same shape as their observations
    models = [JobModel(job, 8, bayesian=False).observe(obs) for job, obs in _cluster().items()]
    from_models = ClusterPrior.from_models(models).sync_shape("t4")
    assert from_models.factors == pytest.approx(shape.factors)
