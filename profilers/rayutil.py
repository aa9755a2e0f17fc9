"""Ray helpers shared by :func:`profilers.profile_cluster` and the experiments' ``--ray`` sweeps.

Ray is an optional dependency (``pip install 'goodput[ray]'``); nothing here
imports it until asked, and :func:`import_ray` says how to install it when it
is missing. What is here:

* :func:`connected`: a connection to a Ray cluster for the length of a call
  (``None``: Ray's own choice, a new local instance for a newcomer; ``"auto"``:
  the cluster this machine belongs to; ``"ray://host:10001"``: a remote one
  through Ray Client), reusing one the caller already opened;
* :func:`cluster_types` / :func:`discover_types`: the device types a cluster
  offers, from its nodes' resources. Ray labels every GPU node with
  ``accelerator_type:<NAME>`` (``A100``, ``T4``, ``H100`` …, from the GPU's
  name); the type is that name in the vocabulary of DESIGN.md
  (:func:`ray_type_name`: ``accelerator_type:A100`` → ``a100``). A label on
  nodes without GPUs names a CPU type (profiled on the node's CPU, under that
  name); ``"cpu"`` is the host CPU of any node;
* :func:`map_tasks`: a function over items as Ray tasks, results as they
  complete, a failure raised as the task's own exception;
* :func:`local_cluster`: a private multi-node Ray on this machine (tests and
  benchmarks): its session files in a fresh temporary directory and every port
  picked by the OS, so it neither meets nor disturbs another Ray on the machine.

Example::

    with connected("auto") as ray:
        for t in discover_types():
            print(t.gpu_type, t.gpus_per_node, len(t.nodes))
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import re
import shutil
import socket
import tempfile
import urllib.parse
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from goodput.errors import UnknownGPUTypeError, ValidationError
from goodput.validation import normalize_gpu_type

from .devices import CPU, normalize_device_name

__all__ = ["INSTALL_HINT", "RayNotInstalledError", "RayConnectionError", "ClusterType", "import_ray", "check_address",
           "add_ray_option", "ray_option", "connected", "ray_type_name", "cluster_types", "discover_types", "map_tasks", "local_cluster",
           "ACCELERATOR_LABEL"]

INSTALL_HINT = "pip install 'goodput[ray]'"
ACCELERATOR_LABEL = "accelerator_type:"  # Ray's resource on every node of a GPU type: accelerator_type:A100
# Ray's accelerator resources other than CUDA GPUs (TPU, Trainium/Inferentia, Gaudi, Ascend …): profile_job measures torch on
# CUDA devices and CPUs only, so a type of such nodes is not profiled. Ray lists them itself where it can.
_OTHER_ACCELERATORS_FALLBACK = frozenset({"TPU", "neuron_cores", "HPU", "NPU", "RBLN", "FURIOSA", "MBLT", "TTNPU"})
_TYPE_LABEL_SHARE = 0.001  # how much of a type's label resource a task asks for (Ray's own convention for accelerator_type)


class RayNotInstalledError(ImportError):
    """Ray is needed for this and is not installed; the message says how to install it."""

    def __init__(self, what: str = "this") -> None:
        super().__init__(f"{what} needs Ray, which is not installed: {INSTALL_HINT}")


class RayConnectionError(ConnectionError):
    """No Ray cluster could be reached at the address given (named in the message)."""


def import_ray(what: str = "this") -> Any:
    """The ``ray`` module, or :class:`RayNotInstalledError` (naming ``what`` needed it and how to install Ray)."""
    try:
        import ray
    except ImportError as exc:
        raise RayNotInstalledError(what) from exc
    return ray


_ADDRESS = re.compile(r"^(auto|local|ray://[\w.\-\[\]:]+|[\w.\-\[\]:]+:\d{1,5})$")


def check_address(address: Any) -> str | None:
    """A Ray address: ``None``, ``"auto"``, ``"local"``, ``"host:port"`` or ``"ray://host[:port]"``
    (:class:`~goodput.errors.ValidationError` otherwise).

    >>> check_address("10.0.0.1:6379"), check_address("ray://head:10001"), check_address(None)
    ('10.0.0.1:6379', 'ray://head:10001', None)
    """
    if address is None:
        return None
    if not isinstance(address, str) or not _ADDRESS.match(address.strip()):
        raise ValidationError("address", address, "expected a Ray address: 'auto', 'local', 'host:port' or "
                              "'ray://host:port' (on a command line, write --ray=ADDRESS or put --ray after the positionals)")
    return address.strip()


def add_ray_option(parser: argparse.ArgumentParser, what: str) -> None:
    """``--ray [ADDRESS]`` on a command line: ``what`` as Ray tasks (read it back with :func:`ray_option`)."""
    parser.add_argument("--ray", nargs="?", const=True, default=None, metavar="ADDRESS",
                        help=f"{what} as Ray tasks: on a new local Ray instance (no ADDRESS: Ray's default), or the cluster "
                             f"at ADDRESS ('auto', 'host:port', 'ray://host:10001'); needs {INSTALL_HINT}")


def ray_option(args: argparse.Namespace) -> tuple[bool, str | None]:
    """``(use Ray, its address)`` from :func:`add_ray_option`'s ``--ray`` (address checked)."""
    value = getattr(args, "ray", None)
    if value is None:
        return False, None
    return True, None if value is True else check_address(value)


CONNECT_TIMEOUT_S = 5.0  # how long a cluster's address may take to accept a TCP connection


def _check_reachable(address: str | None) -> None:
    """Raise :class:`RayConnectionError` at once when nothing accepts TCP connections at a ``host:port`` or
    ``ray://host[:port]`` address: ``ray.init`` retries a silent ``host:port`` for many minutes (20 tries of
    its GCS client), printing only warnings."""
    if address is None or address in ("auto", "local"):
        return
    parts = urllib.parse.urlsplit("//" + address.removeprefix("ray://"))
    try:
        host, port = parts.hostname or "127.0.0.1", parts.port or 10001  # Ray client's default port
    except ValueError:  # a port beyond 65535: Ray's own message says so
        return
    try:
        with socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S):
            pass
    except OSError as exc:
        raise RayConnectionError(f"no Ray cluster at address={address!r}: nothing accepts connections at "
                                 f"{host}:{port} within {CONNECT_TIMEOUT_S:g} s ({exc})") from None


@contextlib.contextmanager
def connected(address: str | None = None, what: str = "this") -> Iterator[Any]:
    """Yield the ``ray`` module connected to a cluster; disconnect afterwards if this call connected.

    Args:
        address: ``None`` (Ray's own resolution: ``RAY_ADDRESS``, else the
            cluster last started on this machine, else a new local instance),
            ``"auto"`` (an existing cluster, or an error), ``"local"`` (always a
            new local instance) or a cluster's address (``"10.0.0.1:6379"``,
            ``"ray://head:10001"``). A connection this process already has is
            used as it is (then ``address`` must be ``None`` or name it).
        what: what needs Ray, for the message when it is not installed.

    Raises:
        RayNotInstalledError: Ray is not installed.
        RayConnectionError: nothing answers at ``address``.
        ValidationError: ``address`` is malformed, or names another cluster than the one connected.
    """
    address = check_address(address)
    ray = import_ray(what)
    if ray.is_initialized():
        current = ray.get_runtime_context().gcs_address
        if address not in (None, "auto") and address.removeprefix("ray://") != current:
            raise ValidationError("address", address, f"this process is already connected to Ray at {current}; "
                                  "pass address=None to use that connection, or call ray.shutdown() first")
        yield ray
        return
    _check_reachable(address)
    try:
        ray.init(address=address, logging_level=logging.WARNING)
    except ConnectionError as exc:
        raise RayConnectionError(f"no Ray cluster at address={address!r}: {exc}") from None
    try:
        yield ray
    finally:
        ray.shutdown()


# ---------------------------------------------------------------------------- device types of a cluster


def ray_type_name(label: str) -> str:
    """The device type (DESIGN.md's vocabulary) of a Ray accelerator label, the same name
    :func:`profilers.devices.normalize_device_name` gives the device's own name.

    >>> [ray_type_name(x) for x in ("A100", "accelerator_type:T4", "L40S", "GeForce-RTX-5090", "xeon-a")]
    ['a100', 't4', 'l40s', 'rtx5090', 'xeon-a']
    """
    text = label.removeprefix(ACCELERATOR_LABEL).replace("-", " ").replace("_", " ")
    return normalize_gpu_type(normalize_device_name(text), "gpu_types")


@dataclass(frozen=True)
class ClusterType:
    """One device type a Ray cluster offers.

    Attributes:
        gpu_type: its name (``"a100"``; ``"cpu"`` for the host CPU of any node).
        resource: the Ray resource every node of the type carries
            (``"accelerator_type:A100"``, or a custom label); ``None`` for ``"cpu"``.
        gpus_per_node: GPUs of the type's largest node (0: a CPU type).
        cpus_per_node: logical CPUs of that node (Ray's ``CPU`` resource).
        nodes: Ray node ids of the type's alive nodes.
    """

    gpu_type: str
    resource: str | None
    gpus_per_node: int
    cpus_per_node: int
    nodes: tuple[str, ...]

    @property
    def is_cuda(self) -> bool:
        return self.gpus_per_node > 0

    def task_options(self, replicas: Sequence[int]) -> dict[str, Any]:
        """Ray task options that place one task on one node of this type with what profiling needs: the GPUs
        of the most replicas (at least 1: the sweep runs on one), or as many CPUs on a CPU type."""
        most = max([1, *replicas])
        options: dict[str, Any] = {"num_gpus": most, "num_cpus": 1} if self.is_cuda else {"num_cpus": most}
        if self.resource is not None:
            options["resources"] = {self.resource: _TYPE_LABEL_SHARE}
        return options


def _other_accelerators() -> frozenset[str]:
    try:
        from ray._private.accelerators import get_all_accelerator_resource_names
    except ImportError:  # pragma: no cover - a Ray without it
        return _OTHER_ACCELERATORS_FALLBACK
    return frozenset(get_all_accelerator_resource_names()) - {"GPU"}


def cluster_types(nodes: Sequence[Mapping[str, Any]], gpu_types: Any = None,
                  other_accelerators: frozenset[str] = _OTHER_ACCELERATORS_FALLBACK) -> list[ClusterType]:
    """The device types to profile on a cluster whose nodes are ``nodes`` (``ray.nodes()`` records).

    Args:
        nodes: records with ``NodeID``, ``Alive`` and ``Resources`` (dead nodes are left out).
        gpu_types: ``None``: every type the nodes' ``accelerator_type:*`` labels
            name that can be profiled (CUDA GPUs, or labelled nodes without any
            accelerator: their CPU), else ``["cpu"]``; a list (or comma-separated
            string) of those names, ``"cpu"`` included; or a mapping ``{name: resource}``
            naming custom resources that label each type's nodes (KubeRay's
            ``rayStartParams: {resources: '"{\\"t4\\": 1}"'}``).
        other_accelerators: resource names of accelerators other than CUDA GPUs (their types are not profiled).

    Returns:
        The types, ordered by name (``"cpu"`` last).

    Raises:
        UnknownGPUTypeError: a name in ``gpu_types`` that the cluster does not offer (lists the ones it does).
        ValidationError: a mapping's resource that no alive node carries, or a type of accelerators other than GPUs.
    """
    alive = [n for n in nodes if n.get("Alive", True)]
    if not alive:
        raise ValidationError("address", None, "the Ray cluster has no alive node")
    host = _cpu_type(alive)
    if isinstance(gpu_types, Mapping):
        chosen = []
        for name, resource in gpu_types.items():
            field = f"gpu_types[{name!r}]"
            name = normalize_gpu_type(name, "gpu_types")
            if name == CPU:
                raise ValidationError(field, resource, "'cpu' is the host CPU of any node; name a labelled type otherwise")
            if not isinstance(resource, str) or not resource:
                raise ValidationError(field, resource, "expected the name of a Ray resource that labels the type's nodes")
            found = _typed(name, resource, alive, other_accelerators)
            if isinstance(found, str):
                raise ValidationError(field, resource, found)
            chosen.append(found)
        return sorted(chosen, key=lambda t: t.gpu_type)
    labelled: dict[str, ClusterType | str] = {}
    for label in sorted({r for n in alive for r in n.get("Resources", {}) if r.startswith(ACCELERATOR_LABEL)}):
        found = _typed(ray_type_name(label), label, alive, other_accelerators)
        # a type that cannot be profiled keeps its label's own spelling (TPU-V4 is "tpu-v4", not a GPU name)
        name = found.gpu_type if isinstance(found, ClusterType) else label.removeprefix(ACCELERATOR_LABEL).lower()
        previous = labelled.get(name)
        if isinstance(previous, ClusterType) and (isinstance(found, str) or len(previous.nodes) >= len(found.nodes)):
            continue  # two labels of one type (A100 and A100-80G): the one on more nodes selects it
        labelled[name] = found
    offered = {name: t for name, t in labelled.items() if isinstance(t, ClusterType)}
    if gpu_types is None:
        return [offered[k] for k in sorted(offered)] or [host]
    names = gpu_types.split(",") if isinstance(gpu_types, str) else gpu_types
    if isinstance(names, (bytes, Mapping)) or not isinstance(names, Sequence):
        raise ValidationError("gpu_types", gpu_types, "expected type names (a list or 'a100,t4'), or {name: resource}")
    chosen = {}
    for raw in names:
        name = normalize_gpu_type(raw.strip() if isinstance(raw, str) else raw, "gpu_types")
        if name == CPU:
            chosen[name] = host
        elif name in offered:
            chosen[name] = offered[name]
        elif isinstance(labelled.get(name), str):
            raise ValidationError("gpu_types", raw, labelled[name])
        else:
            raise UnknownGPUTypeError(raw, [*offered, CPU], field="gpu_types")
    if not chosen:
        raise ValidationError("gpu_types", gpu_types, "names no type")
    return sorted(chosen.values(), key=lambda t: (t.gpu_type == CPU, t.gpu_type))


def _typed(name: str, resource: str, nodes: Sequence[Mapping[str, Any]], other: frozenset[str]) -> ClusterType | str:
    """The type whose nodes carry ``resource``, or why it cannot be profiled."""
    members = [n for n in nodes if float(n.get("Resources", {}).get(resource, 0)) > 0]
    if not members:
        carried = sorted({r for n in nodes for r in n.get("Resources", {}) if not r.startswith(("node:", "memory", "object_store"))})
        return f"no alive node carries this resource (the nodes carry: {', '.join(carried)})"
    gpus = [int(float(n["Resources"].get("GPU", 0))) for n in members]
    if max(gpus) == 0:
        foreign = sorted({r for n in members for r in n["Resources"] if r in other})
        if foreign:
            return f"{name!r} nodes carry {', '.join(foreign)}, not CUDA GPUs: profile_job measures CUDA devices and CPUs only"
    largest = max(members, key=lambda n: (float(n["Resources"].get("GPU", 0)), float(n["Resources"].get("CPU", 0))))
    return ClusterType(name, resource, max(gpus), int(float(largest["Resources"].get("CPU", 0))),
                       tuple(str(n["NodeID"]) for n in members))


def _cpu_type(nodes: Sequence[Mapping[str, Any]]) -> ClusterType:
    """``"cpu"``: the host CPU of any node (the one with most CPUs sets how many a task may ask for)."""
    cpus = max(int(float(n.get("Resources", {}).get("CPU", 0))) for n in nodes)
    return ClusterType(CPU, None, 0, cpus, tuple(str(n["NodeID"]) for n in nodes))


def discover_types(gpu_types: Any = None) -> list[ClusterType]:
    """:func:`cluster_types` of the cluster this process is connected to (see :func:`connected`)."""
    ray = import_ray("discover_types")
    return cluster_types(ray.nodes(), gpu_types, _other_accelerators())


# ---------------------------------------------------------------------------- fan-out


def map_tasks(fn: Callable[[Any], Any], items: Sequence[Any], *, num_cpus: float = 1,
              on_result: Callable[[int, Any], None] | None = None) -> list[Any]:
    """``[fn(item) for item in items]``, each call a Ray task of ``num_cpus`` CPUs, on the connected cluster.

    ``on_result(index, result)`` runs here as each task finishes (in completion order); the list comes
    back in ``items``' order. A task's failure cancels the others and raises that task's own exception
    (its remote traceback in the exception's notes), so callers see the same errors as a local run.
    """
    ray = import_ray("map_tasks")
    remote = ray.remote(num_cpus=num_cpus, max_retries=0)(fn)
    refs = [remote.remote(item) for item in items]
    index = {ref: i for i, ref in enumerate(refs)}
    results: dict[int, Any] = {}
    pending = list(refs)
    try:
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            for ref in ready:
                result = get_result(ray, ref)
                results[index[ref]] = result
                if on_result is not None:
                    on_result(index[ref], result)
    finally:
        for ref in pending:
            ray.cancel(ref, force=True)
    return [results[i] for i in range(len(refs))]


def get_result(ray: Any, ref: Any) -> Any:
    """``ray.get(ref)``, raising a failed task's own exception rather than Ray's wrapper."""
    try:
        return ray.get(ref)
    except ray.exceptions.RayTaskError as exc:
        raise task_error(exc) from None


def task_error(exc: BaseException) -> BaseException:
    """The exception a Ray task raised (with its remote traceback as a note), or ``exc`` when it has none."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, Exception):
        cause.add_note(f"raised in a Ray task:\n{exc}")
        return cause
    return exc


# ---------------------------------------------------------------------------- a private local cluster


LOOPBACK_ONLY = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # "0": Ray's nodes and drivers take 127.0.0.1 as their address


@contextlib.contextmanager
def local_cluster(nodes: Sequence[Mapping[str, Any]]) -> Iterator[Any]:
    """Start a private Ray cluster of ``nodes`` on this machine, connect this process, yield the
    ``ray.cluster_utils.Cluster``; disconnect and stop every process of it afterwards.

    Each node is a mapping of Ray's node arguments, e.g. ``{"num_cpus": 2, "resources":
    {"accelerator_type:xeon-a": 1}}``. Private: its session files, and the address file that a
    plain ``ray.init()`` looks for, live in a fresh temporary directory (``RAY_TMPDIR`` while it
    runs), every port is picked by the OS (the GCS, node managers, workers, the dashboard agent;
    Ray's defaults 6379 and 52365 are not used), no dashboard starts, and every server of it listens
    on 127.0.0.1 only (Ray's single-machine mode, ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``: its node
    address is the loopback one; by default the GCS and node managers, which take unauthenticated
    tasks, had listened on every interface). For tests and benchmarks.
    """
    if not nodes:
        raise ValidationError("nodes", nodes, "expected at least one node")
    import_ray("local_cluster")
    from ray.cluster_utils import Cluster

    import ray

    if ray.is_initialized():
        raise ValidationError("local_cluster", ray.get_runtime_context().gcs_address,
                              "this process is already connected to Ray; call ray.shutdown() first")
    from unittest import mock

    from ray._private import ray_constants

    temp = tempfile.mkdtemp(prefix="goodput-ray-", dir="/tmp" if os.path.isdir("/tmp") else None)  # short: socket paths
    cluster = None
    with contextlib.ExitStack() as restore:
        restore.callback(shutil.rmtree, temp, ignore_errors=True)
        # the nodes' processes read the environment at start; this process read the flag when Ray was imported
        restore.enter_context(mock.patch.dict(os.environ, {"RAY_TMPDIR": temp, LOOPBACK_ONLY: "0"}))
        restore.enter_context(mock.patch.object(ray_constants, "ENABLE_RAY_CLUSTER", False, create=True))
        try:
            private = {"include_dashboard": False, "dashboard_agent_listen_port": None, "metrics_export_port": None,
                       "node_ip_address": "127.0.0.1"}
            head, *workers = nodes
            cluster = Cluster(initialize_head=True, head_node_args={**private, **head})
            for node in workers:
                cluster.add_node(**{**private, **node})
            cluster.wait_for_nodes()
            ray.init(address=cluster.address, logging_level=logging.WARNING)
            yield cluster
        finally:
            if ray.is_initialized():
                ray.shutdown()
            if cluster is not None:
                cluster.shutdown()
