"""More evidence never hurts: a property of the model on synthetic jobs drawn from its own prior.

Issue 34: giving the model one GPU type's multi-GPU observations must not make its predictions for the
job's other types worse. Jobs are drawn from the hierarchical model itself (tests/hierarchy_jobs.py: type
means, a shared job effect, job × type effects); a cluster of such jobs is the prior. For each drawn job
the model predicts the other types' multi-GPU step times from 1-GPU observations on every type (P1), then
from those plus one type's single-node multi-GPU observations (P2).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from goodput import JobModel
from goodput.hierarchy import ClusterPrior
from tests.hierarchy_jobs import BSZS, MULTI_NODE, SINGLE, SINGLE_NODE, TYPES, cluster, draw_job, observe, true_log_step

JOBS_PER_EXAMPLE = 10


@pytest.fixture(scope="module")
def prior():
    return ClusterPrior.from_observations(cluster(8, seed=1))


def _errors(model: JobModel, truth, targets):
    """Squared log error of the median and the predicted log-variance at the targets' multi-GPU configurations."""
    configs = SINGLE_NODE + MULTI_NODE
    nodes, replicas, bsz = (np.array(v, dtype=float) for v in zip(*[(n, r, b) for n, r in configs for b in BSZS]))
    sq, var = [], []
    for gpu in targets:
        pred = model.predict(gpu, nodes, replicas, bsz)
        sq.append((np.log(pred.step_time) - true_log_step(truth[gpu], configs)) ** 2)
        var.append(np.asarray(pred.log_std) ** 2)
    return np.concatenate(sq), np.concatenate(var)


@given(seed=st.integers(0, 2**16), warm=st.sampled_from(TYPES))
@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
def test_one_types_multi_gpu_observations_never_make_the_others_worse(prior, seed, warm):
    """Over jobs drawn from the prior, the expected squared error on the other types does not rise beyond
    what the sample of jobs can tell (3 standard errors of the mean difference) and the measurement noise,
    and the predicted variance falls on average over the jobs. Not job by job: the prior is Student-t, so
    evidence that a job is unusual widens its own prior (the scale's E-step), and with it the other types'
    intervals (seed 494, warm v100: one job of ten 0.023 -> 0.026 while the ten fell 0.29 -> 0.036); the
    relinearisation at a new MAP may also move single configurations."""
    rng = np.random.default_rng(seed)
    hyper = prior.gp_prior.initial(len(TYPES))
    others = [t for t in TYPES if t != warm]
    before, after, var_before, var_after = [], [], [], []
    for j in range(JOBS_PER_EXAMPLE):
        truth = draw_job(rng)
        cold = [o for t in TYPES for o in observe(f"new{j}", t, truth[t], SINGLE, rng)]
        extra = observe(f"new{j}", warm, truth[warm], SINGLE_NODE, rng)
        p1 = JobModel(f"new{j}", 8, cluster_prior=prior, gp_hyperparameters=hyper).observe(cold)
        p2 = JobModel(f"new{j}", 8, cluster_prior=prior, gp_hyperparameters=hyper).observe(cold + extra)
        (sq1, var1), (sq2, var2) = _errors(p1, truth, others), _errors(p2, truth, others)
        var_before.append(var1.mean())
        var_after.append(var2.mean())
        before.append(sq1.mean())
        after.append(sq2.mean())
    assert np.mean(var_after) <= np.mean(var_before)
    diff = np.array(after) - np.array(before)
    noise = 0.03**2  # the observations' measurement noise, log scale
    assert diff.mean() <= 3 * diff.std(ddof=1) / np.sqrt(diff.size) + 2 * noise
