"""Simulator fidelity: our ``unaware`` policy on Pollux's traces beside Pollux's own simulator.

Pollux (OSDI'21) published its simulator's per-job completion times on 8
workloads of 160 jobs (Philly hours 3–10) on 16 nodes × 4 T4, at load 1.0:
``pollux/results/results-jobload/pollux-1.0/summary.json`` (mean JCT 2751 s).
This runs the same workloads on the same measured traces (interpolated as
Pollux's simulator does) with our heterogeneity-unaware goodput policy — the
closest of ours to Pollux's (one GPU type here, so unaware and Sia coincide up
to the objective's shape) — and reports mean JCT per workload, the per-job
ratio of completion times, and their rank correlation.

Run: ``python -m experiments.fidelity [--data-dir ../shared/data] [--policy unaware] [--processes 2]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np

from experiments.datasets import default_data_dir
from experiments.simulator.runner import Task, check_task, run_sweep
from experiments.simulator.workload import read_workload
from goodput.errors import ValidationError
from goodput.io import atomic_write_text, check_out_path
from goodput.validation import check_int

CLUSTER = "t4:16x4"
POLLUX_RESTART_COST_S = 30.0  # Pollux's simulator charges every job the same delay per reallocation (not Sia's per-application costs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.fidelity", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", type=Path, default=None)
    parser.add_argument("--policy", default="unaware")
    parser.add_argument("--workloads", default="1,2,3,4,5,6,7,8")
    parser.add_argument("--processes", type=int, default=None)
    parser.add_argument("--out", type=Path, default=Path("bench-results") / "fidelity.json")
    parser.add_argument("--mlflow", action="store_true", help="log the runs to MLflow (experiment 'fidelity')")
    args = parser.parse_args(argv)
    data = args.data_dir or default_data_dir()
    if data is None:
        parser.error("no data directory (../shared/data): pass --data-dir")
    try:  # every option checked before the simulations (minutes): one line, not a traceback
        reference = json.loads((data / "pollux" / "results" / "results-jobload" / "pollux-1.0" / "summary.json").read_text())
        names = [f"workload-{w.strip()}" for w in args.workloads.split(",")]
        tasks = [Task(name, tuple(read_workload(data / "pollux" / "workloads" / f"{name}.csv")), args.policy, CLUSTER,
                      truth=str(data / "pollux" / "traces"), default_gpu_type="t4",
                      config={"restart_cost_s": POLLUX_RESTART_COST_S}) for name in names]
        for task in tasks:
            check_task(task)
        if args.processes is not None:
            check_int("processes", args.processes, minimum=1)
        check_out_path("out", args.out, "file")
    except (ValidationError, OSError, json.JSONDecodeError) as exc:
        parser.error(str(exc))
    rows, ratios, correlations = [], [], []
    per_application: dict[str, list[tuple[float, float]]] = {}

    def done(task: Task, result) -> None:
        ours = result.summary["avg_jct_s"]
        theirs = reference["avgs"][task.workload_name]
        ref_jobs = reference["jcts"][task.workload_name]
        paired = [(row.jct_s, ref_jobs[row.name], row.application) for row in result.jobs.itertuples()
                  if row.name in ref_jobs and row.jct_s == row.jct_s]
        ours_jobs, ref_list = np.array([p[0] for p in paired]), np.array([p[1] for p in paired])
        for ours_s, theirs_s, application in paired:
            per_application.setdefault(application, []).append((ours_s, theirs_s))
        ratio = float(np.median(ours_jobs / ref_list))
        from scipy.stats import spearmanr

        rho = float(spearmanr(ours_jobs, ref_list).statistic)
        ratios.append(ratio)
        correlations.append(rho)
        rows.append({"workload": task.workload_name, "ours_avg_jct_s": ours, "pollux_avg_jct_s": theirs,
                     "difference": ours / theirs - 1.0, "median_job_ratio": ratio, "spearman": rho,
                     "restarts_per_job": result.summary["restarts_per_job"], "unfinished": result.summary["unfinished"],
                     "wall_s": result.summary["wall_seconds"]})
        print(f"{task.workload_name}: ours {ours:7.0f} s  Pollux {theirs:7.0f} s  ({ours / theirs - 1:+.1%}), "
              f"median per-job ratio {ratio:.2f}, Spearman {rho:.2f}", flush=True)
        if args.mlflow:
            from experiments.simulator.report import log_result, write_outputs

            folder = args.out.parent / "fidelity" / task.workload_name
            write_outputs(result, folder, task.workload_name)
            log_result(result, task.workload_name, folder, experiment="fidelity", params={"truth": "pollux traces"})

    run_sweep(tasks, processes=args.processes, on_done=done)
    rows.sort(key=lambda r: r["workload"])
    ours_mean = statistics.mean(r["ours_avg_jct_s"] for r in rows)
    theirs_mean = statistics.mean(r["pollux_avg_jct_s"] for r in rows)
    summary = {"policy": args.policy, "cluster": CLUSTER, "ours_mean_jct_s": ours_mean, "pollux_mean_jct_s": theirs_mean,
               "difference": ours_mean / theirs_mean - 1.0, "median_job_ratio": statistics.median(ratios),
               "mean_spearman": statistics.mean(correlations), "workloads": rows,
               "applications": _by_application(per_application)}
    atomic_write_text(args.out, json.dumps(summary, indent=2) + "\n")
    print("\nper application, over all workloads (share: of the difference in total JCT):")
    for name, row in summary["applications"].items():
        print(f"  {name:12s} {row['jobs']:4d} jobs  mean JCT ours {row['ours_mean_jct_s']:7.0f} s  "
              f"Pollux {row['pollux_mean_jct_s']:7.0f} s  median per-job ratio {row['median_job_ratio']:.2f}  "
              f"Spearman {row['spearman']:.2f}  share {row['share_of_difference']:+.0%}")
    print(f"\nmean JCT over {len(rows)} workloads: ours {ours_mean:.0f} s, Pollux's simulator {theirs_mean:.0f} s "
          f"({ours_mean / theirs_mean - 1:+.1%}); figures saved to {args.out}")
    return 0


def _by_application(pairs: dict[str, list[tuple[float, float]]]) -> dict[str, dict[str, float]]:
    """Per application: mean JCTs (seconds), median per-job ratio, Spearman, share of the total difference."""
    from scipy.stats import spearmanr

    total = sum(ours - theirs for rows in pairs.values() for ours, theirs in rows)
    out = {}
    for name in sorted(pairs):
        ours, theirs = np.array(pairs[name]).T
        out[name] = {"jobs": int(ours.size), "ours_mean_jct_s": float(ours.mean()), "pollux_mean_jct_s": float(theirs.mean()),
                     "median_job_ratio": float(np.median(ours / theirs)),
                     "spearman": float(spearmanr(ours, theirs).statistic) if ours.size > 2 else float("nan"),
                     "share_of_difference": float((ours - theirs).sum() / total) if total else 0.0}
    return out


if __name__ == "__main__":
    sys.exit(main())
