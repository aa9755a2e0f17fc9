"""The summary printed after profiling: one row per device type."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from goodput.efficiency import describe_noise_scale
from goodput.observations import Profile

__all__ = ["summary_rows", "summary_table"]


def _range(values: list[float], scale: float = 1.0, fmt: str = "{:.3g}") -> str:
    if not values:
        return "-"
    low, high = min(values) * scale, max(values) * scale
    return fmt.format(low) if low == high else f"{fmt.format(low)}–{fmt.format(high)}"


def _noise_scale(grad: Mapping[str, Any], init_batch_size: int | None) -> str:
    """The report's φ (samples), or why there is none."""
    if "grad_sqr" not in grad or init_batch_size is None:
        return "-"
    return describe_noise_scale(grad["grad_sqr"], grad["grad_var"], init_batch_size)


def summary_rows(profile: Profile, reports: Mapping[str, Any] | None = None) -> list[dict[str, str]]:
    """Per device type: batch sizes measured, step-time range, largest batch, synchronisation, seconds spent."""
    rows = []
    profiled = [key.split(".", 1)[1] for key, value in profile.metadata.items()
                if key.startswith("profiler.") and isinstance(value, dict)]
    # a type that measured nothing (out of memory at the smallest batch, or the memory cap below it) has a
    # row too, saying so, not a table with a header alone
    for gpu in dict.fromkeys([*profile.gpu_types, *(reports or {}), *profiled]):
        single = sorted((o for o in profile.observations if o.gpu_type == gpu and o.num_replicas == 1), key=lambda o: o.local_bsz)
        multi = [o for o in profile.observations if o.gpu_type == gpu and o.num_replicas > 1]
        report = (reports or {}).get(gpu)
        info = report.to_dict() if hasattr(report, "to_dict") else dict(profile.metadata.get(f"profiler.{gpu}", {}))
        sizes = sorted({o.local_bsz for o in single})
        largest = profile.max_local_bsz.get(gpu)
        stopped = info.get("sweep_stopped")
        grad = info.get("grad") or {}
        by_replicas: dict[int, list[Any]] = {}
        for o in multi:
            by_replicas.setdefault(o.num_replicas, []).append(o)
        sync = "; ".join(
            f"{r}× b={','.join(str(o.local_bsz) for o in sorted(obs, key=lambda o: o.local_bsz))} "
            f"sync {_range([o.sync_time or 0.0 for o in obs], 1e3)} ms"
            for r, obs in sorted(by_replicas.items())
        )
        rows.append({
            "device type": gpu,
            "batch sizes": f"{len(sizes)}: {sizes[0]}–{sizes[-1]}" if sizes else "0",
            "step time (ms)": _range([o.step_time for o in single], 1e3),
            "largest batch": f"{largest or '-'} ({stopped})" if stopped else str(largest or "-"),
            "replicas": sync or "-",
            "noise scale": _noise_scale(grad, profile.init_batch_size),
            "seconds": f"{info['seconds']:.1f}" if info.get("seconds") is not None else "-",
        })
    return rows


def summary_table(profile: Profile, reports: Mapping[str, Any] | None = None) -> Any:
    """A rich Table of :func:`summary_rows`."""
    from rich.table import Table

    table = Table(title=f"profile of {profile.job or 'job'} (M0={profile.init_batch_size})")
    rows = summary_rows(profile, reports)
    for column in (rows[0] if rows else {"device type": ""}):
        table.add_column(column, justify="left" if column in ("device type", "replicas") else "right")
    for row in rows:
        table.add_row(*row.values())
    return table
