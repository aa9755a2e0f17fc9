"""The Kubernetes scheduler-extender protocol: filter and prioritize nodes by a pod's job's goodput.

kube-scheduler POSTs an ``ExtenderArgs`` to ``<urlPrefix>/filter`` and
``<urlPrefix>/prioritize`` (``deploy/kube-scheduler-config.yaml``). The types
are ``k8s.io/kube-scheduler/extender/v1`` (``staging/src/k8s.io/kube-scheduler/
extender/v1/types.go``). Since Kubernetes 1.17 their fields carry no JSON tags,
so Go writes the field names as they are — ``Pod``, ``Nodes``, ``NodeNames``;
``Nodes``, ``NodeNames``, ``FailedNodes``, ``FailedAndUnresolvableNodes``,
``Error``; ``Host``, ``Score`` — and reads keys case-insensitively (before 1.17,
``pkg/scheduler/api/v1`` tagged them ``pod``, ``nodes``, ``nodenames``,
``failedNodes``, ``error``, ``host``, ``score``). This module reads either
spelling, as Go does, and writes the Go field names, which every version reads.
The pod and nodes inside are ordinary ``v1.Pod`` / ``v1.NodeList`` objects
(``metadata.labels``, ``items``, …).

Which job a pod belongs to: the pod's label or annotation ``goodput/job``
(:data:`JOB_KEY`). A pod without it, or of a job the service does not know or
has not modelled yet, is not this extender's business: every node passes and
scores 0.

A node's GPU type: its label ``goodput/gpu-type`` (:data:`TYPE_LABEL`) when set
(the ``gpu_type`` as the service knows it, lower-cased and otherwise as given),
else ``nvidia.com/gpu.product`` (:data:`GPU_LABEL`, set by NVIDIA's GPU feature
discovery / GPU operator, e.g. ``NVIDIA-A100-SXM4-80GB``, ``Tesla-T4``),
turned into this project's lower-case ``gpu_type`` by the profiler's own
normalisation (:func:`profilers.devices.normalize_device_name`, dashes read
as spaces): ``a100``, ``t4``, ``h100``, ``rtx2080ti``. A MIG slice (GPU feature
discovery's ``mig.strategy=single``: ``NVIDIA-A100-SXM4-80GB-MIG-1g.10gb``) is a
type of its own, ``a100-mig-1g.10gb``, as the profiler names it on that slice;
a job not profiled there passes such nodes with score 0.

Which allocation is scored: the pod's annotations ``goodput/num-nodes`` and
``goodput/num-replicas`` when set (the job's whole shape: its data-parallel
replicas, each ``num_stages`` GPUs for a hybrid job), else the GPUs the pod's
containers request (``nvidia.com/gpu`` limits, else requests; 1 if none) on
each of ``goodput/num-nodes`` nodes (1 if unset).

Filter: nodes of a GPU type outside the job's registered ``gpu_types``, or of a
type where no batch within the job's limits fits (goodput 0), fail — in
``FailedAndUnresolvableNodes`` (preemption cannot help) and ``FailedNodes``
(for schedulers older than that field). Every other node passes (types the
model has not seen yet, nodes without a GPU label).

Prioritize: each node's score is ``round(max_score × goodput / best)``, the
job's goodput on the node's type relative to the best type among the
candidates; 0 for unknown types. kube-scheduler's extender scores are 0–10
(``MaxExtenderPriority``) in every version since the API's start; it multiplies
them by the extender's ``weight`` and by 10 to reach its own 0–100 node scores.
``max_score=100`` serves callers that want 0–100 directly.

With ``nodeCacheCapable: true`` kube-scheduler sends node names only; types are
then looked up among nodes seen in earlier calls with full node objects.
Configure ``nodeCacheCapable: false`` (the shipped example does).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Any

from goodput.errors import ValidationError
from goodput.validation import normalize_gpu_type
from profilers.devices import normalize_device_name

__all__ = ["GPU_LABEL", "TYPE_LABEL", "JOB_KEY", "NODES_KEY", "REPLICAS_KEY", "GPU_RESOURCE", "gpu_type_of_product",
           "Extender"]

GPU_LABEL = "nvidia.com/gpu.product"
TYPE_LABEL = "goodput/gpu-type"
JOB_KEY = "goodput/job"
NODES_KEY = "goodput/num-nodes"
REPLICAS_KEY = "goodput/num-replicas"
GPU_RESOURCE = "nvidia.com/gpu"
_NODE_CACHE_LIMIT = 100_000


def gpu_type_of_product(product: str) -> str:
    """``gpu_type`` of an ``nvidia.com/gpu.product`` label value (``"NVIDIA-A100-SXM4-80GB"`` -> ``"a100"``)."""
    return normalize_device_name(str(product).replace("-", " ").replace("_", " "))


def _get(mapping: Any, name: str) -> Any:
    """``mapping[name]`` with Go's case-insensitive key match (exact match first)."""
    if not isinstance(mapping, Mapping):
        return None
    if name in mapping:
        return mapping[name]
    lowered = name.lower()
    for key, value in mapping.items():
        if isinstance(key, str) and key.lower() == lowered:
            return value
    return None


def _mapping(value: Any) -> Mapping[str, Any]:
    """``value`` if it is a mapping, else an empty one (a field of the wrong kind reads as absent)."""
    return value if isinstance(value, Mapping) else {}


def _metadata(obj: Any) -> Mapping[str, Any]:
    return _mapping(_mapping(obj).get("metadata"))


def _strings(mapping: Any) -> dict[str, str]:
    return {str(k): str(v) for k, v in mapping.items()} if isinstance(mapping, Mapping) else {}


def _count(text: Any, what: str, minimum: int) -> int:
    try:
        value = int(str(text).strip())
    except ValueError:
        value = None
    if value is None or value < minimum:
        kind = "a positive integer" if minimum else "a whole number of GPUs"
        raise ValidationError(what, text, f"expected {kind}")
    return value


class _Pod:
    """What the extender reads from a ``v1.Pod``: its job and the allocation to score, as GPUs
    (:attr:`num_gpus`, from the containers' requests) or as replicas (:attr:`num_replicas`, the
    annotation; a hybrid job's replica is a pipeline of several GPUs). Nothing else is read from a
    pod without a job: it is not this extender's business."""

    def __init__(self, pod: Any) -> None:
        meta = _metadata(pod)
        labels, annotations = _strings(meta.get("labels")), _strings(meta.get("annotations"))
        self.name = str(meta.get("name", ""))
        self.job = labels.get(JOB_KEY) or annotations.get(JOB_KEY)
        self.num_nodes, self.num_gpus, self.num_replicas = 1, 1, None
        if self.job is None:
            return
        gpus = 0
        containers = _mapping(_mapping(pod).get("spec")).get("containers")
        for index, container in enumerate(containers if isinstance(containers, list) else []):
            resources = _mapping(_mapping(container).get("resources"))
            for kind in ("limits", "requests"):  # a limit is the request for extended resources
                amount = _mapping(resources.get(kind)).get(GPU_RESOURCE)
                if amount is not None:
                    gpus += _count(amount, f"Pod.spec.containers[{index}].resources.{kind}[{GPU_RESOURCE}]", 0)
                    break
        nodes = annotations.get(NODES_KEY)
        replicas = annotations.get(REPLICAS_KEY)
        self.num_nodes = _count(nodes, f"Pod.metadata.annotations[{NODES_KEY}]", 1) if nodes is not None else 1
        if replicas is not None:  # a hybrid job's pipeline may span nodes: the model checks replicas × stages >= nodes
            self.num_replicas = _count(replicas, f"Pod.metadata.annotations[{REPLICAS_KEY}]", 1)
        self.num_gpus = max(gpus, 1) * self.num_nodes

    def shape(self) -> str:
        """The allocation scored, in words (a failed node's reason)."""
        what = f"{self.num_replicas} replica(s)" if self.num_replicas is not None else f"{self.num_gpus} GPU(s)"
        return f"{what} on {self.num_nodes} node(s)"


class Extender:
    """Filter and prioritize for kube-scheduler (see the module docstring).

    Args:
        goodput_of: ``goodput_of(job, gpu_type, num_nodes, num_gpus, num_replicas)`` -> goodput
            (samples/s) of the allocation given by its replicas when ``num_replicas`` is not ``None``,
            else by its GPUs; ``None`` when unknown (job not modelled, type not seen); raises nothing.
        allowed_types: ``allowed_types(job)`` -> the job's registered ``gpu_types`` or ``None``.
        max_score: the top score (10, kube-scheduler's ``MaxExtenderPriority``).
    """

    def __init__(self, goodput_of: Callable[[str, str, int, int, int | None], float | None],
                 allowed_types: Callable[[str], list[str] | None], max_score: int = 10) -> None:
        if max_score not in (10, 100):
            raise ValidationError("max_score", max_score, "expected 10 (kube-scheduler) or 100")
        self.goodput_of = goodput_of
        self.allowed_types = allowed_types
        self.max_score = max_score
        self._node_types: dict[str, str | None] = {}
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ reading ExtenderArgs
    def _candidates(self, args: Mapping[str, Any]) -> tuple[list[tuple[str, Any]], bool]:
        """``[(node name, node object or None)]`` and whether they came as full objects (``Nodes``)."""
        if not isinstance(args, Mapping):
            raise ValidationError("ExtenderArgs", type(args).__name__, "expected a JSON object")
        nodes = _get(args, "Nodes")
        if nodes is not None:
            items = _get(nodes, "items")
            if not isinstance(items, list):
                raise ValidationError("Nodes.items", items, "expected a list of v1.Node objects")
            out = []
            for index, node in enumerate(items):
                name = _metadata(node).get("name")
                if not isinstance(name, str) or not name:
                    raise ValidationError(f"Nodes.items[{index}].metadata.name", name, "expected the node's name")
                out.append((name, node))
            self._remember(out)
            return out, True
        names = _get(args, "NodeNames")
        if names is None:
            return [], False
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise ValidationError("NodeNames", names, "expected a list of node names")
        return [(n, None) for n in names], False

    def _remember(self, nodes: list[tuple[str, Any]]) -> None:
        with self._lock:
            if len(self._node_types) > _NODE_CACHE_LIMIT:
                self._node_types.clear()
            for name, node in nodes:
                self._node_types[name] = self._type_of(node)

    @staticmethod
    def _type_of(node: Any) -> str | None:
        labels = _strings(_metadata(node).get("labels"))
        if labels.get(TYPE_LABEL):  # the gpu_type itself (``a100-80gb`` stays apart from ``a100``)
            try:
                return normalize_gpu_type(labels[TYPE_LABEL], TYPE_LABEL)
            except ValidationError:
                return None
        if labels.get(GPU_LABEL):
            return gpu_type_of_product(labels[GPU_LABEL])
        return None

    def node_type(self, name: str, node: Any) -> str | None:
        if node is not None:
            return self._type_of(node)
        with self._lock:
            return self._node_types.get(name)

    def _pod(self, args: Mapping[str, Any]) -> _Pod:
        pod = _get(args, "Pod")
        if not isinstance(pod, Mapping):
            raise ValidationError("Pod", pod, "expected the v1.Pod being scheduled")
        return _Pod(pod)

    # ------------------------------------------------------------------ the two verbs
    def filter(self, args: Mapping[str, Any]) -> dict[str, Any]:
        """An ``ExtenderFilterResult`` for ``args`` (an ``ExtenderArgs``)."""
        candidates, full = self._candidates(args)
        pod = self._pod(args)
        failed: dict[str, str] = {}
        if pod.job is not None:
            allowed = self.allowed_types(pod.job)
            goodputs: dict[str, float | None] = {}
            for name, node in candidates:
                gpu = self.node_type(name, node)
                if gpu is None:
                    continue
                if allowed and gpu not in allowed:
                    failed[name] = f"goodput: job {pod.job} may run on {', '.join(allowed)} only; node has {gpu}"
                    continue
                if gpu not in goodputs:
                    goodputs[gpu] = self.goodput_of(pod.job, gpu, pod.num_nodes, pod.num_gpus, pod.num_replicas)
                if goodputs[gpu] is not None and goodputs[gpu] <= 0:
                    failed[name] = f"goodput: no batch size within job {pod.job}'s limits fits {pod.shape()} of {gpu}"
        kept = [(name, node) for name, node in candidates if name not in failed]
        return {
            "Nodes": {"apiVersion": "v1", "kind": "NodeList", "items": [node for _, node in kept]} if full else None,
            "NodeNames": None if full else [name for name, _ in kept],
            "FailedNodes": dict(failed),
            "FailedAndUnresolvableNodes": dict(failed),
            "Error": "",
        }

    def prioritize(self, args: Mapping[str, Any]) -> list[dict[str, Any]]:
        """A ``HostPriorityList`` for ``args``: every candidate node with a score in 0..max_score."""
        candidates, _ = self._candidates(args)
        pod = self._pod(args)
        scores = dict.fromkeys((name for name, _ in candidates), 0)
        if pod.job is not None:
            goodputs: dict[str, float | None] = {}
            types = {name: self.node_type(name, node) for name, node in candidates}
            for gpu in {t for t in types.values() if t is not None}:
                goodputs[gpu] = self.goodput_of(pod.job, gpu, pod.num_nodes, pod.num_gpus, pod.num_replicas)
            best = max((g for g in goodputs.values() if g is not None), default=0.0)
            if best > 0:
                for name, gpu in types.items():
                    value = goodputs.get(gpu) if gpu is not None else None
                    if value is not None and value > 0:
                        scores[name] = int(round(self.max_score * value / best))
        return [{"Host": name, "Score": score} for name, score in scores.items()]
