"""``goodput profile``: profile a training job on every device type present, or of a Ray cluster.

    goodput profile --zoo resnet --out resnet.jsonl
    goodput profile mypackage.jobs:make_job --devices cuda --replicas 2,4 --mlflow
    goodput profile --zoo resnet --ray auto --gpu-types a100,t4     # one node of each type, in parallel

``MODULE:FACTORY`` names a function that returns the job's pieces: a
:class:`profilers.zoo.Workload`, or a mapping with ``model``,
``optimizer_factory``, ``loss_fn``, ``make_batch``, ``job`` and
``init_batch_size`` (optionally ``max_batch_size``) — what
:func:`profilers.profile_job` takes. Observations are appended to ``--out`` as
they are measured; rerunning with the same file resumes. With ``--ray``, the job
is shipped to one node of every GPU type of the cluster
(:func:`profilers.profile_cluster`); a rerun redoes only the types missing or
failed in ``--out``.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import sys
import warnings
from typing import Any

from goodput.errors import ValidationError


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    from profilers.rayutil import add_ray_option

    parser = subparsers.add_parser(
        "profile",
        help="measure a training job on every device type (real minibatches) and write its profile",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("factory", nargs="?", metavar="MODULE:FACTORY",
                        help="a function returning the job's pieces (a profilers.zoo.Workload or a mapping)")
    source.add_argument("--zoo", metavar="NAME", help="a built-in job: resnet, transformer or mlp")
    parser.add_argument("--out", help="JSON Lines profile to append to (default: <job>.jsonl); a rerun resumes it")
    parser.add_argument("--devices", help="comma-separated: cpu, cuda, cuda:N or a GPU type (default: every CUDA type, else cpu)")
    add_ray_option(parser, "profile one node of every GPU type of a Ray cluster, in parallel,")
    parser.add_argument("--gpu-types", help="with --ray: comma-separated types of the cluster to profile, 'cpu' for a node's "
                        "host CPU (default: every GPU type Ray labels, else cpu)")
    parser.add_argument("--time-budget", type=float, default=20.0, help="seconds per device type (default 20)")
    parser.add_argument("--replicas", type=_int_list, help="replica counts for synchronisation, e.g. 2,4; 0 for none "
                        "(default: powers of two up to the GPUs of a type; 2 on a CPU host)")
    parser.add_argument("--batch-sizes", type=_int_list, help="local batch sizes to sweep, e.g. 8,16,32 (default: a geometric grid)")
    parser.add_argument("--memory-cap", type=_bytes, help="largest step memory allowed, bytes (suffixes K, M, G, e.g. 2G)")
    parser.add_argument("--init-batch-size", type=int, help="override the job's reference batch size M0")
    parser.add_argument("--cpu-threads", type=int, help="intra-op threads per CPU replica (default: cores // most replicas)")
    parser.add_argument("--mlflow", action="store_true", help="log the profile as an MLflow run")
    parser.add_argument("--server", metavar="URL", help="the goodput service (goodput serve): register the job and post its "
                        "observations there (with --ray as each type's arrive; resending a rerun's is harmless)")
    parser.add_argument("--token", default=os.environ.get("GOODPUT_TOKEN"),
                        help="bearer token for --server's writes (default $GOODPUT_TOKEN)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar or summary table")
    parser.set_defaults(func=run)


def _int_list(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


_UNITS = {"": 1, "B": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def _bytes(text: str) -> int:
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:I?B)?\s*", text.upper())
    if not match:
        raise argparse.ArgumentTypeError(f"expected bytes such as 2000000, 512M or 2G, got {text!r}")
    return int(float(match.group(1)) * _UNITS[match.group(2)])


def load_factory(spec: str) -> Any:
    """Import ``module:function`` and call it; return what it returns.

    The working directory goes first on ``sys.path`` (as ``python -m`` puts it, and uvicorn
    does): the console script's ``sys.path[0]`` is its own ``bin/``, so a package beside the
    user would not import otherwise.
    """
    if ":" not in spec:
        raise ValidationError("factory", spec, "expected MODULE:FACTORY, e.g. mypackage.jobs:make_job")
    module_name, _, attr = spec.partition(":")
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValidationError("factory", spec, f"cannot import {module_name!r}: {exc}") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ValidationError("factory", spec, f"{module_name!r} has no callable {attr!r}")
    return factory()


def job_arguments(pieces: Any) -> dict[str, Any]:
    """``profile_job`` keyword arguments from a Workload or a mapping of the same names."""
    required = ("model", "optimizer_factory", "loss_fn", "make_batch", "job", "init_batch_size")
    if hasattr(pieces, "profile_args"):
        return dict(pieces.profile_args())
    if isinstance(pieces, dict):
        missing = [k for k in required if k not in pieces]
        if missing:
            raise ValidationError("factory", sorted(pieces), f"the returned mapping lacks {', '.join(missing)}")
        return {k: pieces[k] for k in (*required, "max_batch_size") if k in pieces}
    raise ValidationError("factory", type(pieces).__name__, "expected a profilers.zoo.Workload or a mapping of profile_job's pieces")


def run(args: argparse.Namespace) -> int:
    from goodput.client import Client
    from profilers import ClusterProfileError, profile_cluster, profile_job, zoo
    from profilers.profile import trainable_parameters
    from profilers.rayutil import ray_option

    use_ray, address = ray_option(args)
    if use_ray and args.devices:
        raise ValidationError("devices", args.devices, "picks devices of this machine; with --ray, choose with --gpu-types")
    if args.gpu_types and not use_ray:
        raise ValidationError("gpu_types", args.gpu_types, "chooses types of a Ray cluster (with --ray); here use --devices")
    pieces = zoo.get(args.zoo) if args.zoo else load_factory(args.factory)
    kwargs = job_arguments(pieces)
    if args.init_batch_size is not None:
        kwargs["init_batch_size"] = args.init_batch_size
    out = args.out or f"{kwargs['job']}.jsonl"
    replicas = args.replicas
    if replicas is not None and replicas in ([0], []):
        replicas = []
    options = dict(batch_sizes=args.batch_sizes, time_budget_s=args.time_budget, replicas=replicas, out=out,
                   progress=not args.no_progress, memory_cap_bytes=args.memory_cap, mlflow=args.mlflow,
                   cpu_threads=args.cpu_threads)
    if not use_ray:
        if args.server is not None:
            # registered first: an unreachable server or a refused token stops the run before the profiling
            with Client(args.server, args.token) as client:
                client.put_job(kwargs["job"], init_batch_size=kwargs["init_batch_size"], max_batch_size=kwargs.get("max_batch_size"),
                               model_size=trainable_parameters(kwargs["model"]) or None)
        with warnings.catch_warnings(record=True) as caught:
            warnings.filterwarnings("always", message="profile_job: nothing measured", category=RuntimeWarning)
            profile = profile_job(**kwargs, devices=args.devices, **options)
        for warning in caught:
            text = str(warning.message)
            if not text.startswith("profile_job: nothing measured"):
                warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)
            elif profile.observations:  # others did measure: said once, in the CLI's form (else the error below)
                print(f"goodput profile: warning: {text.split(': ', 1)[1]}", file=sys.stderr)
        if args.server is not None:
            with Client(args.server, args.token) as client:
                answer = client.post_observations(kwargs["job"], profile.observations)
            print(f"posted to {args.server}: {answer['accepted']} new of {len(profile.observations)} observations "
                  f"({answer['total']} stored for {kwargs['job']})")
    else:
        try:
            profile = profile_cluster(**kwargs, address=address, gpu_types=args.gpu_types, server=args.server,
                                      token=args.token, **options)
        except ClusterProfileError as exc:
            _print_result(exc.profile, out)
            for gpu_type, error in exc.failures.items():
                print(f"goodput profile: {gpu_type} failed: {error}", file=sys.stderr)
            print(f"goodput profile: rerun the same command to redo {', '.join(exc.failures)} (the rest is kept)", file=sys.stderr)
            return 1
    _print_result(profile, out)
    if not profile.observations:  # e.g. the smallest batch over --memory-cap, or out of memory at it
        stops = {k.split(".", 1)[1]: v.get("sweep_stopped") for k, v in profile.metadata.items()
                 if k.startswith("profiler.") and isinstance(v, dict)}
        why = ", ".join(f"{t}: {s}" for t, s in stops.items() if s) or "no device type measured a step"
        print(f"goodput profile: error: nothing measured ({why})", file=sys.stderr)
        return 1
    return 0


def _print_result(profile: Any, out: str) -> None:
    print(f"{len(profile.observations)} observations of {profile.job} on {', '.join(profile.gpu_types) or 'no device'} in {out}")
