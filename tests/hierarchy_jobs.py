"""Synthetic jobs drawn from the hierarchical model itself (goodput.hierarchy), for its tests.

A cluster of GPU types with known type means ``m[t]``, job effects ``a ~ N(0, A)`` and job × type effects
``e ~ N(0, diag(E))`` in the coordinates of goodput.parametric; each job's observations are its Pollux
step times on a grid of configurations with multiplicative log-normal noise.
"""

from __future__ import annotations

import numpy as np

from goodput import Observation
from goodput.parametric import K, Rows, log_step_time

TYPES = ("t4", "a100", "v100")
REF_BSZ = 32.0
# typical jobs on each type: compute 60 / 20 / 30 ms at the reference batch, 60% of it per sample (logit 0.4),
# α_r 20 / 8 / 12 ms, α_n 80 / 40 / 60 ms, growth 5%, γ = 1.5, compute's power 1 / 1.5 / 1.2
TYPE_MEANS = {
    gpu: np.array([np.log(c), 0.4, np.log(a_r), np.log(a_n), np.log(0.05), np.log(0.05), np.log(0.5), np.log(p)])
    for gpu, c, a_r, a_n, p in (("t4", 0.06, 0.02, 0.08, 1.0), ("a100", 0.02, 0.008, 0.04, 1.5), ("v100", 0.03, 0.012, 0.06, 1.2))
}
# a job's shared effect (none on the intra-node growth: goodput.hierarchy.NO_JOB_EFFECT) ...
JOB_STD = np.array([0.8, 0.8, 0.6, 0.6, 0.0, 0.3, 0.3, 0.2])
JOB_TYPE_STD = np.array([0.2, 0.2, 0.15, 0.15, 0.3, 0.1, 0.1, 0.1])  # ... and what is particular to one type
SYNC_CORR = 0.9  # the job effects of α_r and α_n
SINGLE = [(1, 1)]
SINGLE_NODE = [(1, 2), (1, 4)]
MULTI_NODE = [(2, 4), (2, 8), (4, 16)]
BSZS = (8, 32, 128)


def job_effect_cov() -> np.ndarray:
    cov = np.diag(JOB_STD**2)
    cov[2, 3] = cov[3, 2] = SYNC_CORR * JOB_STD[2] * JOB_STD[3]
    return cov


def draw_job(rng: np.random.Generator, types=TYPES) -> dict[str, np.ndarray]:
    """True coordinates of one job on each type."""
    shared = rng.multivariate_normal(np.zeros(K), job_effect_cov())
    return {t: TYPE_MEANS[t] + shared + rng.normal(0.0, JOB_TYPE_STD) for t in types}


def observe(job: str, gpu: str, u: np.ndarray, configs, rng: np.random.Generator, noise: float = 0.03,
            bszs=BSZS, noise_dof: float = np.inf) -> list[Observation]:
    """Noisy observations of ``u`` on ``gpu`` at ``configs`` × ``bszs`` (the log's noise: ``noise`` × a
    Student-t with ``noise_dof`` degrees of freedom, normal when infinite)."""
    out = []
    for nodes, replicas in configs:
        for bsz in bszs:
            rows = Rows(np.array([float(nodes)]), np.array([float(replicas)]), np.array([float(bsz)]), np.zeros(1), REF_BSZ)
            draw = rng.standard_normal() if np.isinf(noise_dof) else rng.standard_t(noise_dof)
            step = float(np.exp(log_step_time(u, rows, jacobian=False)[0][0] + noise * draw))
            out.append(Observation(job=job, gpu_type=gpu, num_nodes=nodes, num_replicas=replicas, local_bsz=bsz, step_time=step))
    return out


def true_log_step(u: np.ndarray, configs, bszs=BSZS) -> np.ndarray:
    nodes, replicas, bsz = (np.array(v, dtype=float) for v in zip(*[(n, r, b) for n, r in configs for b in bszs]))
    return log_step_time(u, Rows(nodes, replicas, bsz, np.zeros(nodes.size), REF_BSZ), jacobian=False)[0]


def cluster(num_jobs: int, seed: int) -> dict[str, list[Observation]]:
    """``num_jobs`` jobs with every configuration on every type."""
    rng = np.random.default_rng(seed)
    out = {}
    for j in range(num_jobs):
        truth = draw_job(rng)
        out[f"job{j}"] = [o for t in TYPES for o in observe(f"job{j}", t, truth[t], SINGLE + SINGLE_NODE + MULTI_NODE, rng)]
    return out


def t4_cluster(num_jobs: int, seed: int, noise_dof: float = np.inf) -> dict[str, list[Observation]]:
    """``num_jobs`` jobs on T4 alone, every configuration at 16 batch sizes (8 to 128), the log's noise Student-t
    with ``noise_dof`` (normal when infinite): a folder for the benchmarks' tests."""
    rng = np.random.default_rng(seed)
    out = {}
    for j in range(num_jobs):
        truth = draw_job(rng, ("t4",))["t4"]
        out[f"job{j}"] = observe(f"job{j}", "t4", truth, SINGLE + SINGLE_NODE + MULTI_NODE, rng, bszs=tuple(range(8, 136, 8)),
                                 noise_dof=noise_dof)
    return out
