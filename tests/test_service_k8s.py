"""The Kubernetes scheduler extender: ExtenderArgs in, ExtenderFilterResult / HostPriorityList out, as kube-scheduler speaks them.

Field names are those of k8s.io/kube-scheduler/extender/v1 (types.go): no JSON tags since 1.17, so Go writes
``Pod``, ``Nodes``, ``NodeNames``, ``FailedNodes``, ``FailedAndUnresolvableNodes``, ``Error``, ``Host``,
``Score`` and reads keys case-insensitively; before 1.17 they were tagged ``pod``, ``nodes``, ``nodenames``.
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import httpx
import pytest

from experiments.bench_core import observations
from service.k8s import Extender, gpu_type_of_product
from tests.service_helpers import live_server, wait_for

FILTER_RESULT_FIELDS = {"Nodes", "NodeNames", "FailedNodes", "FailedAndUnresolvableNodes", "Error"}
HOST_PRIORITY_FIELDS = {"Host", "Score"}


def _node(name: str, product: str | None, gpus: int = 8) -> dict:
    labels = {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux", "node.kubernetes.io/instance-type": "p4d"}
    if product is not None:
        labels.update({"nvidia.com/gpu.product": product, "nvidia.com/gpu.count": str(gpus),
                       "nvidia.com/gpu.memory": "81920"})
    return {"metadata": {"name": name, "uid": f"uid-{name}", "resourceVersion": "4711", "labels": labels},
            "spec": {"podCIDR": "10.244.1.0/24"},
            "status": {"capacity": {"cpu": "96", "memory": "1056946100Ki", "nvidia.com/gpu": str(gpus), "pods": "110"},
                       "allocatable": {"cpu": "95", "memory": "1044363188Ki", "nvidia.com/gpu": str(gpus), "pods": "110"},
                       "conditions": [{"type": "Ready", "status": "True"}]}}


NODES = [_node("a100-0", "NVIDIA-A100-SXM4-80GB"), _node("t4-0", "Tesla-T4", 4),
         _node("v100-0", "Tesla-V100-SXM2-16GB"), _node("cpu-0", None)]


def _pod(job: str | None, gpus: int = 2, annotations: dict | None = None) -> dict:
    labels = {"app": "trainer", "batch.kubernetes.io/job-name": "cifar10-train"}
    if job is not None:
        labels["goodput/job"] = job
    return {"metadata": {"name": "cifar10-train-0-x7k2p", "namespace": "research", "uid": "0b6b9a6e-3d3f-4c1e",
                         "labels": labels, "annotations": annotations or {}},
            "spec": {"schedulerName": "default-scheduler", "restartPolicy": "Never",
                     "containers": [{"name": "trainer", "image": "registry.example/cifar10:1.4",
                                     "command": ["torchrun", "--nproc-per-node=2", "train.py"],
                                     "resources": {"limits": {"nvidia.com/gpu": str(gpus), "cpu": "8", "memory": "32Gi"},
                                                   "requests": {"cpu": "8", "memory": "32Gi"}}},
                                    {"name": "log-shipper", "image": "fluent-bit:3", "resources": {}}]},
            "status": {"phase": "Pending", "qosClass": "Burstable"}}


def _args(job: str | None, **pod_options) -> dict:
    """An ExtenderArgs as kube-scheduler >= 1.17 sends it (nodeCacheCapable: false)."""
    return {"Pod": _pod(job, **pod_options), "Nodes": {"metadata": {"resourceVersion": "4711"}, "items": copy.deepcopy(NODES)},
            "NodeNames": None}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("k8s")
    with live_server(f"sqlite:///{folder / 'goodput.db'}", model_options={"bayesian": False}) as (url, client):
        client.put_job("cifar10", 128, 1024, gpu_types=["a100", "t4"])
        client.post_observations("cifar10", observations("a100", 30, job="cifar10") + observations("t4", 30, job="cifar10"))
        wait_for(lambda: client.goodput("cifar10", "a100", 1, 2))
        wait_for(lambda: client.goodput("cifar10", "t4", 1, 2))
        yield url, client


def test_gpu_product_labels_map_to_gpu_types():
    assert gpu_type_of_product("NVIDIA-A100-SXM4-80GB") == "a100"
    assert gpu_type_of_product("NVIDIA-A100-SXM4-40GB-MIG-1g.5gb") == "a100-mig-1g.5gb"  # a slice, not a whole A100
    assert gpu_type_of_product("Tesla-T4") == "t4"
    assert gpu_type_of_product("NVIDIA-H100-80GB-HBM3") == "h100"
    assert gpu_type_of_product("Tesla-V100-SXM2-16GB") == "v100"
    assert gpu_type_of_product("NVIDIA-GeForce-RTX-2080-Ti") == "rtx2080ti"
    assert gpu_type_of_product("NVIDIA-L4") == "l4"


def test_filter_keeps_the_jobs_gpu_types_in_kube_schedulers_field_names(server):
    url, client = server
    result = httpx.post(f"{url}/v1/k8s/filter", json=_args("cifar10")).json()
    assert set(result) == FILTER_RESULT_FIELDS
    assert [n["metadata"]["name"] for n in result["Nodes"]["items"]] == ["a100-0", "t4-0", "cpu-0"]
    assert result["Nodes"]["items"][0] == NODES[0]  # the node objects come back whole
    assert result["NodeNames"] is None and result["Error"] == ""
    assert set(result["FailedAndUnresolvableNodes"]) == set(result["FailedNodes"]) == {"v100-0"}
    assert "a100, t4" in result["FailedNodes"]["v100-0"]


def test_prioritize_scores_nodes_by_goodput_on_their_type(server):
    url, client = server
    ranked = httpx.post(f"{url}/v1/k8s/prioritize", json=_args("cifar10")).json()
    assert all(set(item) == HOST_PRIORITY_FIELDS for item in ranked)
    scores = {item["Host"]: item["Score"] for item in ranked}
    a100, t4 = (client.goodput("cifar10", gpu, 1, 2)["goodput"] for gpu in ("a100", "t4"))
    assert a100 > t4 > 0
    assert scores == {"a100-0": 10, "t4-0": round(10 * t4 / a100), "v100-0": 0, "cpu-0": 0}
    # the job's whole shape from the pod's annotations: 2 nodes x 8 GPUs
    shaped = httpx.post(f"{url}/v1/k8s/prioritize",
                        json=_args("cifar10", annotations={"goodput/num-nodes": "2", "goodput/num-replicas": "16"})).json()
    a100, t4 = (client.goodput("cifar10", gpu, 2, 16)["goodput"] for gpu in ("a100", "t4"))
    assert {i["Host"]: i["Score"] for i in shaped}["t4-0"] == round(10 * t4 / a100)


def test_pre_117_spelling_node_names_and_pods_that_are_not_ours(server):
    url, _ = server
    legacy = {"pod": _pod("cifar10"), "nodes": {"items": copy.deepcopy(NODES)}}
    result = httpx.post(f"{url}/v1/k8s/filter", json=legacy).json()
    assert [n["metadata"]["name"] for n in result["Nodes"]["items"]] == ["a100-0", "t4-0", "cpu-0"]
    # nodeCacheCapable: names only; types of nodes seen in earlier calls are remembered
    names = {"Pod": _pod("cifar10"), "NodeNames": ["t4-0", "v100-0", "unseen-7"]}
    result = httpx.post(f"{url}/v1/k8s/filter", json=names).json()
    assert result["NodeNames"] == ["t4-0", "unseen-7"] and result["Nodes"] is None
    scores = {i["Host"]: i["Score"] for i in httpx.post(f"{url}/v1/k8s/prioritize", json=names).json()}
    assert scores == {"t4-0": 10, "v100-0": 0, "unseen-7": 0}
    # a pod without the goodput/job label, or of a job the service does not know: every node passes, scores 0
    for job in (None, "unknown-job"):
        result = httpx.post(f"{url}/v1/k8s/filter", json=_args(job)).json()
        assert len(result["Nodes"]["items"]) == 4 and result["FailedNodes"] == {}
        assert {i["Score"] for i in httpx.post(f"{url}/v1/k8s/prioritize", json=_args(job)).json()} == {0}
    for bad in ({"Pod": _pod("cifar10"), "Nodes": {"items": "a100-0"}}, {"Nodes": {"items": []}},
                {"Pod": _pod("cifar10", annotations={"goodput/num-nodes": "two"}), "NodeNames": []}, [1, 2]):
        assert httpx.post(f"{url}/v1/k8s/filter", json=bad).status_code == 422, bad


def test_the_gpu_type_label_is_the_services_gpu_type_and_odd_pod_fields_read_as_absent():
    goodput = {"a100-80gb": 900.0, "a100": 300.0}
    extender = Extender(lambda job, gpu, nodes, gpus, replicas: goodput.get(gpu), lambda job: None)
    node = _node("big-0", "NVIDIA-A100-SXM4-80GB")
    node["metadata"]["labels"]["goodput/gpu-type"] = "A100-80GB"  # overrides the product's a100
    assert extender.node_type("big-0", node) == "a100-80gb"
    assert extender.node_type("plain-0", _node("plain-0", "NVIDIA-A100-SXM4-80GB")) == "a100"
    args = {"Pod": _pod("cifar10"), "Nodes": {"items": [node, _node("plain-0", "NVIDIA-A100-SXM4-80GB")]}}
    assert {i["Host"]: i["Score"] for i in extender.prioritize(args)} == {"big-0": 10, "plain-0": 3}
    for odd in ([1], "8", None):  # limits of the wrong kind: no GPU request read, one GPU scored
        pod = _pod("cifar10")
        pod["spec"]["containers"][0]["resources"]["limits"] = odd
        assert extender.prioritize({"Pod": pod, "Nodes": {"items": [node]}}) == [{"Host": "big-0", "Score": 10}]
    pod = _pod("cifar10")
    pod["spec"] = ["not", "a", "spec"]
    assert extender.prioritize({"Pod": pod, "Nodes": {"items": [node]}}) == [{"Host": "big-0", "Score": 10}]


def test_filter_drops_types_where_no_batch_fits():
    extender = Extender(lambda job, gpu, nodes, gpus, replicas: {"a100": 900.0, "t4": 0.0}.get(gpu), lambda job: None)
    result = extender.filter(_args("cifar10"))
    assert [n["metadata"]["name"] for n in result["Nodes"]["items"]] == ["a100-0", "v100-0", "cpu-0"]
    assert "no batch size" in result["FailedAndUnresolvableNodes"]["t4-0"]
    hundred = Extender(lambda job, gpu, nodes, gpus, replicas: {"a100": 900.0, "t4": 300.0}.get(gpu), lambda job: None, max_score=100)
    assert {i["Host"]: i["Score"] for i in hundred.prioritize(_args("cifar10"))}["t4-0"] == 33


def test_the_shipped_kube_scheduler_configuration_points_at_the_extender():
    import yaml

    from service import create_app

    config = yaml.safe_load((Path(__file__).resolve().parents[1] / "deploy" / "kube-scheduler-config.yaml").read_text())
    assert config["apiVersion"] == "kubescheduler.config.k8s.io/v1" and config["kind"] == "KubeSchedulerConfiguration"
    (extender,) = config["extenders"]
    assert extender["nodeCacheCapable"] is False and extender["ignorable"] is True
    prefix = extender["urlPrefix"].split(":8470", 1)[1]
    routes = {route.path for route in create_app("sqlite:///unused.db").routes}
    assert f"{prefix}/{extender['filterVerb']}" in routes and f"{prefix}/{extender['prioritizeVerb']}" in routes


def test_the_shipped_deployment_s_arguments_are_goodput_serve_s():
    import yaml

    from cli import build_parser

    documents = yaml.safe_load_all((Path(__file__).resolve().parents[1] / "deploy" / "goodput-serve.yaml").read_text())
    (deployment,) = [d for d in documents if d and d["kind"] == "Deployment"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    args = build_parser().parse_args(container["args"])
    assert args.command == "serve" and args.learn_prior and args.host == "0.0.0.0"
    assert str(args.cluster) == "a100:4x8,t4:8x4"


def test_the_replicas_annotation_counts_pipelines_and_the_requests_count_gpus():
    asked = []

    def goodput_of(job, gpu, nodes, gpus, replicas):
        asked.append((nodes, gpus, replicas))
        return 100.0

    extender = Extender(goodput_of, lambda job: None)
    extender.prioritize(_args("pp", annotations={"goodput/num-nodes": "1", "goodput/num-replicas": "3"}))
    extender.prioritize(_args("pp", gpus=4, annotations={"goodput/num-nodes": "2"}))
    assert asked == [(1, 2, 3)] * 3 + [(2, 8, None)] * 3  # once per node type (a100, t4, v100); replicas win when given


def test_a_pipeline_job_s_replicas_are_scored_as_whole_pipelines(tmp_path):
    with live_server(f"sqlite:///{tmp_path / 'goodput.db'}", model_options={"bayesian": False}) as (url, client):
        client.put_job("pp", 128, 1024, gpu_types=["a100"], num_stages=2)
        client.post_observations("pp", [dataclasses.replace(o, num_stages=2) for o in observations("a100", 30, job="pp")])
        wait_for(lambda: client.goodput("pp", "a100", 1, 6))
        three = _args("pp", annotations={"goodput/num-nodes": "1", "goodput/num-replicas": "3"})  # 3 pipelines, 6 GPUs
        result = httpx.post(f"{url}/v1/k8s/filter", json=three).json()
        assert set(result["FailedNodes"]) == {"t4-0", "v100-0"}, result["FailedNodes"]  # its gpu_types; a100 fits
        assert [n["metadata"]["name"] for n in result["Nodes"]["items"]] == ["a100-0", "cpu-0"]
        scores = {i["Host"]: i["Score"] for i in httpx.post(f"{url}/v1/k8s/prioritize", json=three).json()}
        assert scores["a100-0"] == 10
        # one pipeline over two nodes (one GPU each): fewer replicas than nodes is a hybrid job's shape
        spread = _args("pp", annotations={"goodput/num-nodes": "2", "goodput/num-replicas": "1"})
        assert client.goodput("pp", "a100", 2, 2)["goodput"] > 0
        assert {i["Host"]: i["Score"] for i in httpx.post(f"{url}/v1/k8s/prioritize", json=spread).json()}["a100-0"] == 10
        # a data-parallel job cannot take that shape: the node fails, the call does not
        client.put_job("dp", 128, 1024, gpu_types=["a100"])
        client.post_observations("dp", observations("a100", 30, job="dp"))
        wait_for(lambda: client.goodput("dp", "a100", 1, 2))
        result = httpx.post(f"{url}/v1/k8s/filter", json=_args("dp", annotations={"goodput/num-nodes": "2",
                                                                                 "goodput/num-replicas": "1"})).json()
        assert "no batch size" in result["FailedNodes"]["a100-0"]


def test_pods_that_are_not_ours_are_not_read_and_zero_gpus_is_a_quantity(server):
    url, client = server
    sidecar = _pod(None, annotations={"goodput/num-nodes": "stray"})
    sidecar["spec"]["containers"][1]["resources"] = {"limits": {"nvidia.com/gpu": "0"}}
    for verb in ("filter", "prioritize"):
        assert httpx.post(f"{url}/v1/k8s/{verb}", json={"Pod": sidecar, "Nodes": {"items": copy.deepcopy(NODES)}}).status_code == 200
    ours = _pod("cifar10")
    ours["spec"]["containers"][1]["resources"] = {"limits": {"nvidia.com/gpu": "0"}}  # a sidecar without GPUs: 2 GPUs scored
    scores = {i["Host"]: i["Score"] for i in httpx.post(f"{url}/v1/k8s/prioritize", json={"Pod": ours, "Nodes": {"items": copy.deepcopy(NODES)}}).json()}
    a100, t4 = (client.goodput("cifar10", gpu, 1, 2)["goodput"] for gpu in ("a100", "t4"))
    assert scores["t4-0"] == round(10 * t4 / a100)
    ours["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] = "-1"
    answer = httpx.post(f"{url}/v1/k8s/filter", json={"Pod": ours, "NodeNames": []})
    assert answer.status_code == 422
    assert answer.json()["detail"][0]["loc"][-1] == "limits[nvidia.com/gpu]", answer.json()  # not split at its dots


def test_a_mig_slice_is_not_scored_as_its_whole_gpu():
    extender = Extender(lambda job, gpu, nodes, gpus, replicas: {"a100": 900.0, "t4": 300.0}.get(gpu), lambda job: None)
    nodes = [_node("a100-0", "NVIDIA-A100-SXM4-80GB"), _node("slice-0", "NVIDIA-A100-SXM4-80GB-MIG-1g.10gb", 7),
             _node("t4-0", "Tesla-T4", 4)]
    scores = {i["Host"]: i["Score"] for i in extender.prioritize({"Pod": _pod("cifar10"), "Nodes": {"items": nodes}})}
    assert scores == {"a100-0": 10, "slice-0": 0, "t4-0": 3}
