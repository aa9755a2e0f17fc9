"""Profiler cost and timing accuracy (issue: profilers).

(a) Profiling cost: wall seconds per device type of ``profile_job`` on each zoo
    model at default settings (20 s budget, default grid, default replicas).
    Target: within the 20 s budget, as Sia's bootstrap (~10 batch sizes per GPU
    type in under 20 GPU-seconds; Jayaram Subramanya et al., SOSP'23).
(b) Timing accuracy: the step time ``profile_job`` records for one batch size
    against ``torch.utils.benchmark.Timer`` timing the same step (same model,
    optimizer, batch and thread count) in the same process. Target: within 5%.
    The two are measured alternately, three times each, and their medians compared.

Run: ``python -m experiments.bench_profiler`` (or ``make bench``); ``--quick``
profiles the MLP alone with a 4 s budget. Figures go to
``bench-results/bench_profiler_cost.json`` and ``bench_profiler_accuracy.json``.
"""

from __future__ import annotations

import copy
import statistics
import sys
import time

from experiments.benchutil import parser, report


def _step_for_timer(work, device: str, bsz: int):
    """The profiler's step (forward, backward, optimizer step) on a fresh copy, as a closure."""
    model = copy.deepcopy(work.model).to(device)
    model.train()
    optimizer = work.optimizer_factory(model.parameters())
    batch = work.make_batch(bsz, device)
    loss_fn = work.loss_fn

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model, batch)
        loss.backward()
        optimizer.step()

    return step


def profiling_cost(names: list[str], budget: float) -> list[dict]:
    from profilers import profile_job, zoo

    rows = []
    for name in names:
        work = zoo.get(name)
        start = time.perf_counter()
        profile = profile_job(**work.profile_args(), time_budget_s=budget, progress=False)
        wall = time.perf_counter() - start
        for gpu in profile.gpu_types:
            info = profile.metadata[f"profiler.{gpu}"]
            sync = ";".join(f"{r}x:{','.join(map(str, v.get('measured', [])))} ({v.get('stopped')})"
                            for r, v in info["sync"].items())
            rows.append({
                "what": f"profiling cost {name}",
                "device": f"{gpu} ({info['names'][0]})",
                "seconds": info["seconds"],
                "budget_s": budget,
                "within_budget": info["seconds"] <= budget,
                "batch_sizes": len(info["measured"]),
                "largest": info["max_local_bsz"],
                "stopped": info["sweep_stopped"],
                "noise_rounds": (info.get("grad") or {}).get("rounds", "-"),
                "sync": sync or "-",
                "phases_s": "warm-up {warm_up} / noise {noise} / sweep {sweep} / sync {sync}".format(
                    **{k: info["phase_seconds"].get(k, "-") for k in ("warm_up", "noise", "sweep", "sync")}),
                "call_wall_s": round(wall, 2),
            })
    return rows


def timing_accuracy(cases: list[tuple[str, int]], repeats: int = 3) -> list[dict]:
    import torch
    from torch.utils.benchmark import Timer

    from profilers import profile_job, zoo
    from profilers.devices import resolve_devices

    device_type = resolve_devices(None)[0]
    device = device_type.device
    threads = 1  # what profile_job uses per CPU replica on a 2-core host with 2 replicas
    rows = []
    for name, bsz in cases:
        work = zoo.get(name)
        ours, theirs = [], []
        for _ in range(repeats):
            profile = profile_job(**work.profile_args(), batch_sizes=[bsz], replicas=[], cpu_threads=threads,
                                  devices=device, time_budget_s=20, min_steps=10, progress=False)
            ours.append(next(o.step_time for o in profile.observations if o.local_bsz == bsz))
            step = _step_for_timer(work, device, bsz)
            step()  # warm-up, as the profiler's
            old = torch.get_num_threads()
            timer = Timer(stmt="step()", globals={"step": step}, num_threads=threads)  # synchronises CUDA itself
            measurement = timer.blocked_autorange(min_run_time=1.0)
            torch.set_num_threads(old)
            theirs.append(measurement.median)
        p, t = statistics.median(ours), statistics.median(theirs)
        rows.append({
            "what": f"timing accuracy {name} b={bsz}",
            "device": f"{device_type.gpu_type} ({device_type.names[0]})",
            "profiler_ms": p * 1e3,
            "timer_ms": t * 1e3,
            "rel_error_pct": 100.0 * abs(p - t) / t,
            "target_pct": 5.0,
            "within_target": abs(p - t) / t <= 0.05,
        })
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parser("bench_profiler", __doc__).parse_args(argv)
    if args.quick:
        cost = profiling_cost(["mlp"], budget=4.0)
        accuracy = timing_accuracy([("mlp", 64)], repeats=1)
    else:
        cost = profiling_cost(["resnet", "transformer", "mlp"], budget=20.0)
        accuracy = timing_accuracy([("mlp", 64), ("resnet", 64), ("transformer", 32)])
    # Two tables (and two JSON files): bench_profiler_cost.json, bench_profiler_accuracy.json.
    report("bench_profiler_cost", cost, args)
    report("bench_profiler_accuracy", accuracy, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
