"""Derive the simulator's built-in job catalog from public measurements.

Run: ``python -m experiments.simulator.build_catalog [--data-dir ../shared/data] [--out PATH]``.
It writes ``experiments/simulator/catalog.json`` (atomically), the embedded
default ground truth of ``goodput simulate``. Every number in it is derived
here, from these sources, and the file records how:

* **Throughput on T4** per job family: Pollux's throughput model fitted with
  :func:`goodput.throughput.fit_throughput` to the Pollux OSDI'21 artifact's
  T4 traces (``pollux/traces/<model>/placements.csv`` and ``scalability.csv``,
  AWS g4dn.12xlarge nodes with 4 T4 each).
* **Other GPU types**: compute terms divided by a relative speed. The speed of
  a type relative to another is modelled as ``(FP32 TFLOPS ratio)^a ·
  (memory-bandwidth ratio)^b``; ``a`` and ``b`` are fitted by least squares to
  every measured cross-type ratio of single-GPU step times in Gavel's
  isolated throughputs (K80/P100/V100, OSDI'20 artifact) and Zeus's epoch times
  at each GPU's highest power limit (A40/P100/RTX 6000/V100, NSDI'23
  artifact). TFLOPS and bandwidth are NVIDIA datasheet figures (cited in
  ``GPU_SPECS``). NCF is host-bound (data README): its compute is not scaled.
  Synchronisation terms are scaled by link bandwidth: intra-node terms by the
  ratio of GPU-to-GPU bandwidths, the inter-node premium by the ratio of node
  network bandwidths (``NODE_SPECS``: instance datasheets, and one stated
  assumption for the RTX 2080 Ti nodes). Memory-bound local batch limits are
  scaled by device memory.
* **Work and gradient noise**: Pollux's simulator runs each application for a
  fixed number of epochs (bert 2, cifar10 100, deepspeech2 80, imagenet 90,
  ncf 10, yolov3 50 — the artifact's application definitions); the work to
  finish is the progress (scale-invariant iterations at the reference batch)
  at that epoch, the minimum over the validated batch sizes as Pollux does.
  The gradient noise scale φ = M0·grad_var/grad_sqr along training is taken
  from every batch-size run's validation trace (φ differs markedly between
  them: cifar10 late in training, 2·10⁴ at batch 128 but 1.3·10⁵ at 4096),
  each summarised by 12 knots; the simulator interpolates between the runs that
  bracket a job's batch size, as Pollux's simulator does.
* **Restart cost** per application: the seconds Sia's simulator charges each
  reallocation, measured on a physical cluster (Jayaram Subramanya et al.,
  SOSP'23 artifact, ``sia-simulator/applications.py``: bert 120, cifar10 50,
  deepspeech2 25, imagenet 250, ncf 15, yolov3 80;
  :data:`experiments.simulator.truth.RESTART_COST_S`). Pollux's simulator
  charged every job 30 s.
* **Workload generator**: application mix from the 8 Pollux workloads
  (``pollux/workloads``), GPU-count distribution and hourly arrival profile
  from the Microsoft Philly trace (``pollux/traces/philly.csv``).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from experiments.datasets import default_data_dir, read_pollux_trace, read_validation
from experiments.simulator.truth import CATALOG_PATH, restart_cost_of
from goodput.io import atomic_write_text
from goodput.throughput import ThroughputParams, fit_throughput


# NVIDIA datasheets: FP32 peak TFLOPS (boost), memory bandwidth GB/s, memory GB.
GPU_SPECS: dict[str, dict[str, Any]] = {
    "k80": {"fp32_tflops": 4.37, "memory_gbps": 240, "memory_gb": 12, "source": "NVIDIA Tesla K80 datasheet (per GK210 GPU)"},
    "p100": {"fp32_tflops": 9.3, "memory_gbps": 732, "memory_gb": 16, "source": "NVIDIA Tesla P100 PCIe datasheet"},
    "v100": {"fp32_tflops": 15.7, "memory_gbps": 900, "memory_gb": 16, "source": "NVIDIA Tesla V100 SXM2 datasheet"},
    "t4": {"fp32_tflops": 8.1, "memory_gbps": 320, "memory_gb": 16, "source": "NVIDIA T4 datasheet"},
    "rtx2080ti": {"fp32_tflops": 13.4, "memory_gbps": 616, "memory_gb": 11, "source": "NVIDIA GeForce RTX 2080 Ti specifications"},
    "rtx6000": {"fp32_tflops": 16.3, "memory_gbps": 672, "memory_gb": 24, "source": "NVIDIA Quadro RTX 6000 datasheet"},
    "a40": {"fp32_tflops": 37.4, "memory_gbps": 696, "memory_gb": 48, "source": "NVIDIA A40 datasheet"},
    "a100": {"fp32_tflops": 19.5, "memory_gbps": 1555, "memory_gb": 40, "source": "NVIDIA A100 40GB SXM4 datasheet"},
}

# Node interconnects (GB/s GPU-to-GPU within a node, Gbit/s network between nodes).
NODE_SPECS: dict[str, dict[str, Any]] = {
    "t4": {"node": "AWS g4dn.12xlarge (4 x T4, PCIe gen3 x16)", "intra_gbps": 15.75 * 8, "network_gbps": 50,
           "source": "Pollux's testbed; AWS instance specifications", "assumed": False},
    "v100": {"node": "AWS p3.16xlarge (8 x V100, NVLink 2)", "intra_gbps": 150 * 8, "network_gbps": 25,
             "source": "AWS instance specifications; NVLink 2: 300 GB/s bidirectional per GPU", "assumed": False},
    "a100": {"node": "AWS p4d.24xlarge (8 x A100, NVSwitch)", "intra_gbps": 300 * 8, "network_gbps": 400,
             "source": "AWS instance specifications; NVLink 3: 600 GB/s bidirectional per GPU", "assumed": False},
    "rtx2080ti": {"node": "8 x RTX 2080 Ti on PCIe gen3 x16, 40 Gbit/s Ethernet", "intra_gbps": 15.75 * 8, "network_gbps": 40,
                  "source": "ASSUMPTION: a commodity 8-GPU PCIe server; no public measurement of such nodes is in ../shared/data",
                  "assumed": True},
}

# Epochs each application runs in Pollux's simulator (OSDI'21 artifact, simulator/applications.py).
POLLUX_EPOCHS = {"bert": 2, "cifar10": 100, "deepspeech2": 80, "imagenet": 90, "ncf": 10, "yolov3": 50}
# Largest local batch Pollux's simulator allows where it differs from the traces' range.
POLLUX_MAX_LOCAL = {"yolov3": 8}
HOST_BOUND = {"ncf"}  # data README: ncf is host-bound
NOISE_KNOTS = 12


def fit_speed_model(data_dir: Path) -> dict[str, Any]:
    """Fit log(speed ratio) = a·log(TFLOPS ratio) + b·log(bandwidth ratio) to Gavel and Zeus."""
    pairs: list[tuple[str, dict[str, float]]] = []  # (workload, {gpu: seconds})
    gavel = data_dir / "gavel" / "isolated_throughputs.csv"
    if gavel.exists():
        with open(gavel, newline="") as f:
            for row in csv.DictReader(f):
                if row["source"] != "simulation_throughputs.json" or row["scale_factor"] != "1":
                    continue
                rates = {t: float(row[f"{t}_steps_per_s"]) for t in ("k80", "p100", "v100")}
                if all(r > 0 for r in rates.values()):
                    pairs.append((f"gavel:{row['job_type']}", {t: 1.0 / r for t, r in rates.items()}))
    zeus_times: dict[tuple[str, ...], dict[str, float]] = {}
    for gpu in ("a40", "p100", "rtx6000", "v100"):
        path = data_dir / "zeus" / f"summary_power_{gpu}.csv"
        if not path.exists():
            continue
        best: dict[tuple[str, ...], tuple[float, float]] = {}
        with open(path, newline="") as f:
            for row in csv.DictReader(f):
                key = (row["dataset"], row["network"], row["batch_size"], row["optimizer"])
                limit = float(row["power_limit"])
                if key not in best or limit > best[key][0]:
                    best[key] = (limit, float(row["time_per_epoch"]))
        for key, (_, seconds) in best.items():
            zeus_times.setdefault(key, {})[gpu] = seconds
    pairs += [(f"zeus:{'/'.join(k)}", v) for k, v in zeus_times.items() if len(v) >= 2]
    rows, targets = [], []
    for _, times in pairs:
        ref = "v100" if "v100" in times else sorted(times)[0]
        for gpu, seconds in times.items():
            if gpu == ref:
                continue
            rows.append([math.log(GPU_SPECS[gpu]["fp32_tflops"] / GPU_SPECS[ref]["fp32_tflops"]),
                         math.log(GPU_SPECS[gpu]["memory_gbps"] / GPU_SPECS[ref]["memory_gbps"])])
            targets.append(math.log(times[ref] / seconds))
    if len(rows) < 4:
        raise SystemExit("not enough Gavel/Zeus measurements to fit the speed model")
    x, y = np.array(rows), np.array(targets)
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    resid = y - x @ coef
    return {
        "flops_exponent": float(coef[0]),
        "bandwidth_exponent": float(coef[1]),
        "rmse_log_ratio": float(np.sqrt(np.mean(resid**2))),
        "median_abs_log_error": float(np.median(np.abs(resid))),
        "ratios_fitted": len(y),
        "fitted_on": "Gavel isolated single-GPU throughputs (simulation_throughputs.json: K80, P100, V100) and "
        "Zeus epoch times at each GPU's highest power limit (A40, P100, RTX 6000, V100)",
    }


def relative_speed(gpu: str, ref: str, model: dict[str, Any]) -> float:
    a, b = model["flops_exponent"], model["bandwidth_exponent"]
    return (GPU_SPECS[gpu]["fp32_tflops"] / GPU_SPECS[ref]["fp32_tflops"]) ** a * (
        GPU_SPECS[gpu]["memory_gbps"] / GPU_SPECS[ref]["memory_gbps"]
    ) ** b


def derive_params(t4: ThroughputParams, gpu: str, speed: float) -> ThroughputParams:
    """Scale T4 parameters to another type: compute by speed, sync by link bandwidths."""
    if gpu == "t4":
        return t4
    intra = NODE_SPECS["t4"]["intra_gbps"] / NODE_SPECS[gpu]["intra_gbps"]
    network = NODE_SPECS["t4"]["network_gbps"] / NODE_SPECS[gpu]["network_gbps"]
    alpha_r, beta_r = t4.alpha_r * intra, t4.beta_r * intra
    return ThroughputParams(
        alpha_c=t4.alpha_c / speed,
        beta_c=t4.beta_c / speed,
        alpha_n=alpha_r + (t4.alpha_n - t4.alpha_r) * network,
        beta_n=beta_r + (t4.beta_n - t4.beta_r) * network,
        alpha_r=alpha_r,
        beta_r=beta_r,
        gamma=t4.gamma,
    )


def noise_knots(path: Path, m0: int) -> list[list[float]]:
    """(fraction of the run's progress, φ) knots from one validation trace (φ = M0·grad_var/grad_sqr)."""
    rows = read_validation(path)
    total = rows[-1].progress
    # Epochs whose |g|² estimate vanished (φ undefined) are skipped: φ is interpolated across them.
    rows = [r for r in rows if r.grad_sqr > 0]
    fraction = np.array([r.progress for r in rows]) / total
    phi = np.array([m0 * r.grad_var / r.grad_sqr for r in rows])
    # Knots evenly spaced in the index (epochs), the first and last always kept.
    picks = np.unique(np.round(np.linspace(0, len(rows) - 1, min(NOISE_KNOTS, len(rows)))).astype(int))
    return [[round(float(fraction[i]), 6), float(f"{phi[i]:.6g}")] for i in picks]


def noise_runs(trace_dir: Path, m0: int) -> dict[str, list[list[float]]]:
    """φ trajectories of every batch-size run (Pollux trained each application at several batch sizes)."""
    paths = sorted(trace_dir.glob("validation-*.csv"), key=lambda p: int(p.stem.split("-")[1]))
    return {p.stem.split("-")[1]: noise_knots(p, m0) for p in paths}


def family(trace_dir: Path, speed_model: dict[str, Any], gpu_types: list[str]) -> dict[str, Any]:
    name = trace_dir.name
    batch_sizes = sorted(int(p.stem.split("-")[1]) for p in trace_dir.glob("validation-*.csv"))
    m0, max_bs = batch_sizes[0], batch_sizes[-1]
    profile = read_pollux_trace(trace_dir, gpu_type="t4")
    t4 = fit_throughput(profile.observations)
    local = sorted({o.local_bsz for o in profile})
    max_local_t4 = POLLUX_MAX_LOCAL.get(name, local[-1])
    epochs = POLLUX_EPOCHS[name]
    work = min(read_validation(p)[epochs - 1].progress for p in trace_dir.glob("validation-*.csv"))
    params, max_local = {}, {}
    for gpu in gpu_types:
        speed = 1.0 if name in HOST_BOUND else relative_speed(gpu, "t4", speed_model)
        params[gpu] = {k: float(f"{v:.6g}") for k, v in derive_params(t4, gpu, speed).to_dict().items() if k != "fixed"}
        max_local[gpu] = max(local[0], int(max_local_t4 * GPU_SPECS[gpu]["memory_gb"] / GPU_SPECS["t4"]["memory_gb"]))
    return {
        "init_batch_size": m0,
        "max_batch_size": max_bs,
        "min_local_bsz": local[0],
        "max_local_bsz": max_local,
        "epochs": epochs,
        "work": round(float(work), 3),
        "noise": noise_runs(trace_dir, m0),
        "restart_cost_s": restart_cost_of(name),
        "host_bound": name in HOST_BOUND,
        "params": params,
        "t4_fit_observations": len(profile),
    }


def workload_stats(data_dir: Path) -> dict[str, Any]:
    apps: Counter[str] = Counter()
    for path in sorted((data_dir / "pollux" / "workloads").glob("workload-*.csv")):
        with open(path, newline="") as f:
            apps.update(row["application"] for row in csv.DictReader(f))
    gpus: Counter[int] = Counter()
    hours = np.zeros(24)
    with open(data_dir / "pollux" / "traces" / "philly.csv", newline="") as f:
        for row in csv.DictReader(f):
            count = int(float(row["num_gpus"]))
            bucket = 1 << max(0, math.ceil(math.log2(max(count, 1))))
            gpus[min(bucket, 64)] += 1
            hours[int(row["timestamp"][11:13])] += 1
    total_apps, total_gpus = sum(apps.values()), sum(gpus.values())
    return {
        "applications": {k: round(v / total_apps, 4) for k, v in sorted(apps.items())},
        "num_gpus": {str(k): round(v / total_gpus, 5) for k, v in sorted(gpus.items())},
        "hourly_arrivals": [round(float(h / hours.mean()), 4) for h in hours],
        "source": "application mix: the 8 Pollux workloads (pollux/workloads); GPU counts (rounded up to a "
        "power of two) and hour-of-day arrival profile: Microsoft Philly trace (pollux/traces/philly.csv)",
    }


def build(data_dir: Path, gpu_types: list[str]) -> dict[str, Any]:
    speed_model = fit_speed_model(data_dir)
    traces = data_dir / "pollux" / "traces"
    families = {}
    for name in sorted(POLLUX_EPOCHS):
        print(f"  fitting {name} ...", flush=True)
        families[name] = family(traces / name, speed_model, gpu_types)
    return {
        "version": 1,
        "provenance": (__doc__ or "").strip(),
        "speed_model": speed_model,
        "gpu_types": {
            g: {**GPU_SPECS[g], **NODE_SPECS[g], "speed_vs_t4": round(relative_speed(g, "t4", speed_model), 4)}
            for g in gpu_types
        },
        "families": families,
        "workload": workload_stats(data_dir),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.simulator.build_catalog", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", type=Path, default=None, help="../shared/data (default: found beside the checkout)")
    parser.add_argument("--out", type=Path, default=CATALOG_PATH)
    parser.add_argument("--gpu-types", default="t4,v100,a100,rtx2080ti")
    args = parser.parse_args(argv)
    data_dir = args.data_dir or default_data_dir()
    if data_dir is None:
        parser.error("no data directory: pass --data-dir")
    gpu_types = [g.strip() for g in args.gpu_types.split(",") if g.strip()]
    unknown = [g for g in gpu_types if g not in GPU_SPECS or g not in NODE_SPECS]
    if not gpu_types or unknown:
        parser.error(f"--gpu-types {args.gpu_types!r}: {'unknown ' + ', '.join(unknown) if unknown else 'none given'} "
                     f"(with specs: {', '.join(sorted(set(GPU_SPECS) & set(NODE_SPECS)))})")
    catalog = build(data_dir, gpu_types)
    atomic_write_text(args.out, json.dumps(catalog, indent=1) + "\n")
    print(f"catalog written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
