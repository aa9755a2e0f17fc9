"""Ray: profile_cluster on a private two-node Ray with two labelled CPU types, and the --ray sweeps.

The cluster (``profilers.rayutil.local_cluster``) is started once for the module: its own temporary
directory, OS-picked ports, no dashboard, two nodes of 2 CPUs each labelled ``accelerator_type:xeon-a``
and ``accelerator_type:xeon-b``, as Ray labels GPU nodes ``accelerator_type:A100``. The tests of this
module run in one xdist worker (``--dist loadgroup``, see the Makefile) so they share it.
"""

from __future__ import annotations

import json
import socket
import sys
import time

import pytest

from cli import main
from goodput import Profile
from goodput.errors import UnknownGPUTypeError, ValidationError
from profilers import ClusterProfileError, profile_cluster
from profilers.rayutil import RayConnectionError, RayNotInstalledError, check_address, cluster_types, local_cluster, ray_type_name
from tests.profiler_jobs import tiny_mlp

pytestmark = pytest.mark.xdist_group("ray")

TYPES = ("xeon-a", "xeon-b")


# ---------------------------------------------------------------------------- without a cluster


def _node(node_id: str, alive: bool = True, **resources: float) -> dict:
    return {"NodeID": node_id, "Alive": alive, "Resources": {"CPU": 16.0, "memory": 1e11, f"node:{node_id}": 1.0, **resources}}


NODES = [
    _node("head"),  # CPUs only, no label
    _node("a1", GPU=8.0, **{"accelerator_type:A100": 1.0}),
    _node("a2", GPU=4.0, **{"accelerator_type:A100": 1.0}),
    _node("t1", GPU=4.0, **{"accelerator_type:T4": 1.0}),
    _node("tpu", TPU=4.0, **{"accelerator_type:TPU-V4": 1.0}),
    _node("h1", alive=False, GPU=8.0, **{"accelerator_type:H100": 1.0}),
    _node("c1", CPU=32.0, **{"accelerator_type:Xeon-8480": 1.0, "spot-t4": 2.0}),
]


def test_a_clusters_types_come_from_rays_accelerator_labels():
    types = {t.gpu_type: t for t in cluster_types(NODES)}
    assert list(types) == ["a100", "t4", "xeon-8480"]  # the dead H100 node and the TPU node are not offered
    a100 = types["a100"]
    assert (a100.resource, a100.gpus_per_node, a100.nodes, a100.is_cuda) == ("accelerator_type:A100", 8, ("a1", "a2"), True)
    # 1 GPU for the sweep, the node's GPUs for the replicas: one task asks for the most replicas' GPUs
    assert a100.task_options([2, 4, 8]) == {"num_gpus": 8, "num_cpus": 1, "resources": {"accelerator_type:A100": 0.001}}
    assert types["t4"].task_options([]) == {"num_gpus": 1, "num_cpus": 1, "resources": {"accelerator_type:T4": 0.001}}
    xeon = types["xeon-8480"]  # a labelled node without GPUs: a CPU type, profiled on its cores
    assert not xeon.is_cuda and xeon.task_options([2]) == {"num_cpus": 2, "resources": {"accelerator_type:Xeon-8480": 0.001}}
    chosen = cluster_types(NODES, "t4, cpu")
    assert [t.gpu_type for t in chosen] == ["t4", "cpu"] and chosen[1].resource is None and chosen[1].cpus_per_node == 32
    with pytest.raises(UnknownGPUTypeError, match=r"gpu_types='h100'.*known: a100, cpu, t4, xeon-8480"):
        cluster_types(NODES, ["h100"])
    with pytest.raises(ValidationError, match="TPU, not CUDA GPUs"):
        cluster_types(NODES, ["tpu-v4"])
    custom = cluster_types(NODES, {"T4-Spot": "spot-t4"})  # KubeRay-style custom labels
    assert [(t.gpu_type, t.nodes, t.cpus_per_node) for t in custom] == [("t4-spot", ("c1",), 32)]
    with pytest.raises(ValidationError, match=r"gpu_types\['v100'\].*no alive node carries"):
        cluster_types(NODES, {"v100": "accelerator_type:V100"})
    assert [t.gpu_type for t in cluster_types([_node("laptop")])] == ["cpu"]  # no GPU anywhere: the host CPU
    assert [ray_type_name(x) for x in ("A100", "accelerator_type:H100", "GeForce-RTX-2080-Ti")] == ["a100", "h100", "rtx2080ti"]


def test_bad_arguments_are_refused_before_ray_is_touched():
    work = tiny_mlp()
    for option, message in (({"devices": "cpu"}, "gpu_types"), ({"budget": 3}, "not an option of profile_job"),
                            ({"time_budget_s": -1}, "time_budget_s"), ({"address": "mypkg.jobs:make"}, "Ray address")):
        with pytest.raises(ValidationError, match=message):
            profile_cluster(**work.profile_args(), **option)
    with pytest.raises(ValidationError, match="--ray=ADDRESS"):
        check_address("/data/measurements")


def test_an_address_where_nothing_listens_is_refused_at_once():
    """ray.init had retried a silent host:port for many minutes (20 tries of its GCS client) without an error."""
    from profilers.rayutil import connected
    from tests.service_helpers import free_port

    port = free_port()
    for address in (f"127.0.0.1:{port}", f"ray://127.0.0.1:{port}"):
        started = time.monotonic()
        with pytest.raises(RayConnectionError, match=f"nothing accepts connections at 127.0.0.1:{port}"):
            with connected(address):
                pass
        assert time.monotonic() - started < 10


def test_missing_ray_says_how_to_install(monkeypatch, tmp_path, capsys):
    from experiments.simulator.runner import Task, run_sweep

    monkeypatch.setitem(sys.modules, "ray", None)  # as if it were not installed
    work = tiny_mlp()
    with pytest.raises(RayNotInstalledError, match=r"profile_cluster needs Ray.*pip install 'goodput\[ray\]'"):
        profile_cluster(**work.profile_args(), progress=False)
    with pytest.raises(RayNotInstalledError, match=r"pip install 'goodput\[ray\]'"):
        run_sweep([Task("w", (), "fifo", "t4:1x4")], backend="ray")
    assert main(["simulate", "--synthetic", "2", "--no-mlflow", "--out", str(tmp_path / "o"), "--ray"]) == 2
    assert "needs Ray, which is not installed: pip install 'goodput[ray]'" in capsys.readouterr().err


# ---------------------------------------------------------------------------- on a private Ray cluster


@pytest.fixture(scope="module")
def private_ray():
    """The private cluster (its head also serving Ray Client, on a free port), this process connected."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        client_port = probe.getsockname()[1]
    nodes = [{"num_cpus": 2, "resources": {f"accelerator_type:{name}": 1}} for name in TYPES]
    nodes[0]["ray_client_server_port"] = client_port
    with local_cluster(nodes) as cluster:
        cluster.client_address = f"ray://127.0.0.1:{client_port}"
        yield cluster


@pytest.fixture(scope="module")
def ray_nodes(private_ray):
    """``{type: the id of the node labelled with it}``."""
    import ray

    return {name: n["NodeID"] for n in ray.nodes() for name in TYPES if f"accelerator_type:{name}" in n["Resources"]}


def test_the_private_cluster_listens_on_loopback_only(ray_nodes):
    """Its GCS, node managers and workers, which take unauthenticated tasks, had listened on every interface."""
    psutil = pytest.importorskip("psutil")
    listening = []
    for process in [psutil.Process(), *psutil.Process().children(recursive=True)]:
        try:
            sockets = process.net_connections(kind="inet")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        listening += [(process.name(), s.laddr.ip, s.laddr.port) for s in sockets if s.status == psutil.CONN_LISTEN]
    assert any(name.startswith(("gcs_server", "raylet")) for name, _, _ in listening)  # the check sees Ray's servers
    assert not [entry for entry in listening if entry[1] not in ("127.0.0.1", "::1", "::ffff:127.0.0.1")], listening


def test_each_type_runs_on_its_own_node_and_the_results_merge(ray_nodes, tmp_path):
    work = tiny_mlp()
    out = tmp_path / "cluster.jsonl"
    arrived: dict[str, list] = {}
    # the budget is a ceiling the tiny job stays far below; generous, so a loaded machine still reaches the sync phase
    profile = profile_cluster(
        work.model, work.optimizer_factory,
        lambda model, batch: work.loss_fn(model, batch),  # lambdas travel (cloudpickle), to the replicas too
        lambda bsz, device: work.make_batch(bsz, device),
        job="tiny", init_batch_size=16, batch_sizes=[4, 8], time_budget_s=30, sync_sizes=1, cpu_threads=1, out=out, progress=False,
        on_observations=lambda gpu_type, observations: arrived.setdefault(gpu_type, []).extend(observations))
    assert sorted(profile.gpu_types) == list(TYPES)
    for name in TYPES:
        report = profile.metadata[f"profiler.{name}"]
        assert report["node_id"] == ray_nodes[name] and report["complete"]  # landed where its label is
        mine = [o for o in profile.observations if o.gpu_type == name]
        assert sorted(o.local_bsz for o in mine if o.num_replicas == 1) == [4, 8]
        synced = [o for o in mine if o.num_replicas == 2]  # the node's 2 CPUs for the sync phase (gloo)
        assert len(synced) == 1 and synced[0].sync_time is not None and synced[0].placement == (2,)
        assert any(o.grad_sqr is not None for o in mine) and profile.max_local_bsz[name] == 8
        assert arrived[name] == mine  # told as they arrived, in order
    saved = Profile.load(out)
    assert saved.observations == profile.observations and saved.max_local_bsz == profile.max_local_bsz
    assert saved.metadata["profiler.xeon-a"]["node_id"] == ray_nodes["xeon-a"] and saved.job == "tiny"


def test_a_failing_type_is_named_the_other_kept_and_a_rerun_redoes_only_it(ray_nodes, tmp_path):
    import ray

    work = tiny_mlp()
    out = tmp_path / "resume.jsonl"
    bad_node = ray_nodes["xeon-b"]

    def broken_on_xeon_b(model, batch):  # a closure: shipped by value
        on_bad = ray.is_initialized() and ray.get_runtime_context().get_node_id() == bad_node
        if on_bad and batch[0].shape[0] >= 8:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return work.loss_fn(model, batch)

    options = dict(job="tiny", init_batch_size=16, batch_sizes=[4, 8], replicas=[], time_budget_s=10, out=out, progress=False)
    with pytest.raises(ClusterProfileError, match=r"xeon-b: ModelFailureError: .*'xeon-b' at local batch size 8.*illegal") as info:
        profile_cluster(work.model, work.optimizer_factory, broken_on_xeon_b, work.make_batch, **options)
    assert list(info.value.failures) == ["xeon-b"]
    kept = info.value.profile
    assert sorted((o.gpu_type, o.local_bsz) for o in kept.observations) == [("xeon-a", 4), ("xeon-a", 8), ("xeon-b", 4)]
    assert Profile.load(out).observations == kept.observations  # on disk as they arrived, the failed type's too
    assert "profiler.xeon-b" not in Profile.load(out).metadata  # not finished: a rerun redoes it

    arrived: dict[str, list] = {}
    profile = profile_cluster(work.model, work.optimizer_factory, work.loss_fn, work.make_batch, **options,
                              on_observations=lambda t, obs: arrived.setdefault(t, []).extend(obs))
    assert list(arrived) == ["xeon-b"]  # xeon-a was complete in out: not redone
    assert [o.local_bsz for o in arrived["xeon-b"]] == [8]  # b=4 resumed from out, not measured again
    assert sorted((o.gpu_type, o.local_bsz) for o in profile.observations) == [
        ("xeon-a", 4), ("xeon-a", 8), ("xeon-b", 4), ("xeon-b", 8)]
    assert profile.metadata["profiler.xeon-b"]["node_id"] == bad_node and Profile.load(out).max_local_bsz == {"xeon-a": 8, "xeon-b": 8}


def test_a_fresh_workers_first_call_costs_fall_in_the_types_budget_and_on_no_timed_step(ray_nodes, tmp_path):
    """The actor's process is new, as ``profile_job``'s is in a fresh process: what its first calls cost (here a
    1.5 s first optimizer, as torch's first optimizer imports ``torch._dynamo``) is charged to the type's budget,
    in its warm-up step before the noise phase's share starts, and lands in no timed step; not in wall seconds outside the budget."""
    import time

    work = tiny_mlp()
    first = {"pending": True}  # shipped by value: the actor's own copy

    def slow_first_optimizer(params):
        if first["pending"]:
            first["pending"] = False
            time.sleep(1.5)
        return work.optimizer_factory(params)

    profile = profile_cluster(work.model, slow_first_optimizer, work.loss_fn, work.make_batch, job="tiny", init_batch_size=16,
                              gpu_types="xeon-a", batch_sizes=[4, 8], replicas=[], time_budget_s=6, progress=False)
    report = profile.metadata["profiler.xeon-a"]
    assert "warm_up_s" not in report and report["phase_seconds"]["warm_up"] >= 1.5  # profile_job's clock ran during it
    assert report["ray_wall_s"] >= report["seconds"] >= 1.5 and report["ray_start_s"] <= report["ray_wall_s"] - report["seconds"]
    steps = [o.step_time for o in profile.observations]  # b=4, and b=8 where a loaded host left time for it
    assert 4 in report["measured"] and steps and max(steps) < 0.5  # no timed step took the sleep


def test_observations_reach_the_goodput_service_as_they_arrive_and_a_rerun_posts_nothing_twice(ray_nodes, tmp_path):
    from goodput.client import Client
    from service.app import create_app
    from service.server import BackgroundServer

    work = tiny_mlp()
    out = tmp_path / "served.jsonl"
    options = dict(job="tiny", init_batch_size=16, batch_sizes=[4, 8], replicas=[], time_budget_s=8, out=out, progress=False)
    with BackgroundServer(create_app(f"sqlite:///{tmp_path / 'goodput.db'}", tokens=("s3cret",))) as server:
        with pytest.raises(ValidationError, match="token"):  # refused before Ray is touched
            profile_cluster(work.model, work.optimizer_factory, work.loss_fn, work.make_batch, server=server.url, token=" ", **options)
        seen = []
        profile = profile_cluster(work.model, work.optimizer_factory, work.loss_fn, work.make_batch, server=server.url,
                                  token="s3cret", on_observations=lambda t, obs: seen.append(t), **options)
        with Client(server.url) as client:
            record = client.job("tiny")
            assert record["observations"] == len(profile.observations) == 4 and record["settings"]["init_batch_size"] == 16
            assert record["settings"]["model_size"] == profile.metadata["num_parameters"]  # the size the prior scales by
            assert sorted(set(seen)) == list(TYPES)  # the caller's callback still runs after each post
            # a rerun resends what out holds (the service stores each record once) and measures nothing new
            profile_cluster(work.model, work.optimizer_factory, work.loss_fn, work.make_batch, server=server.url,
                            token="s3cret", **options)
            assert client.job("tiny")["observations"] == 4
        with pytest.raises(Exception, match="401"):  # a wrong token stops the profiling at the registration
            profile_cluster(work.model, work.optimizer_factory, work.loss_fn, work.make_batch, server=server.url,
                            token="wrong", **options)


def test_cli_profile_with_ray(ray_nodes, tmp_path, capsys):
    out = tmp_path / "cli.jsonl"
    assert main(["profile", "tests.profiler_jobs:workload_dict", "--ray", "--gpu-types", "xeon-b", "--batch-sizes", "4",
                 "--replicas", "0", "--time-budget", "2", "--no-progress", "--out", str(out)]) == 0
    assert "observations of dict-job on xeon-b in" in capsys.readouterr().out
    assert Profile.load(out).metadata["profiler.xeon-b"]["node_id"] == ray_nodes["xeon-b"]
    assert main(["profile", "tests.profiler_jobs:workload_dict", "--ray", "--gpu-types", "h100", "--out", str(out)]) == 2
    assert "gpu_types='h100': unknown GPU type (known: cpu, xeon-a, xeon-b)" in capsys.readouterr().err


def test_simulate_over_ray_gives_the_local_sweeps_outputs_and_mlflow_runs(ray_nodes, tmp_path):
    import mlflow

    common = ["simulate", "--synthetic", "3", "--hours", "1", "--seed", "3", "--policy", "sia,fifo", "--cluster", "t4:2x4,a100:1x8"]
    assert main([*common, "--processes", "1", "--out", str(tmp_path / "local"), "--experiment", "local"]) == 0
    assert main([*common, "--ray", "--out", str(tmp_path / "ray"), "--experiment", "ray"]) == 0
    for summary in sorted((tmp_path / "local").rglob("summary.json")):
        twin = tmp_path / "ray" / summary.relative_to(tmp_path / "local")
        ours, theirs = (json.loads(p.read_text()) for p in (summary, twin))
        for payload in (ours, theirs):
            payload["metrics"].pop("wall_seconds")
        assert ours == theirs
        for table in ("jobs.csv", "rounds.csv"):
            assert (summary.parent / table).read_text() == (twin.parent / table).read_text()
    runs = {name: mlflow.search_runs(experiment_names=[name]) for name in ("local", "ray")}
    metrics = {name: {(r["tags.mlflow.runName"]): {k: v for k, v in r.items() if k.startswith("metrics.") and "wall" not in k}
                      for _, r in frame.iterrows()} for name, frame in runs.items()}
    assert len(runs["ray"]) == len(runs["local"]) == 3  # the sweep's parent run and a run per (workload, policy)
    assert json.dumps(metrics["local"], sort_keys=True, default=str) == json.dumps(metrics["ray"], sort_keys=True, default=str)


def test_accuracy_over_ray_gives_the_local_rows_and_mlflow_run(ray_nodes, tmp_path):
    import mlflow

    from experiments import accuracy
    from tests.test_accuracy import _write_layout

    layout = _write_layout(tmp_path / "measured")
    # the GP methods take 10+ s per model here; the Ray path runs the same evaluate_model on each unit
    settings = dict(models=["resnet", "small"], protocols=["P1", "P2", "P5"], methods=["pollux", "sia", "linear"], seeds=1,
                    progress=False)
    local = accuracy.run(layout, tmp_path / "local", **settings)
    over_ray = accuracy.run(layout, tmp_path / "ray", **settings, backend="ray")
    assert local.equals(over_ray)
    for name in ("rows-resnet.csv", "rows-small.csv", "summary.csv", "reference.csv"):
        assert (tmp_path / "local" / name).read_text() == (tmp_path / "ray" / name).read_text()
    runs = mlflow.search_runs(experiment_names=["goodput-accuracy"])
    metrics = runs[[c for c in runs.columns if c.startswith("metrics.")]]
    assert len(runs) == 2 and metrics.iloc[0].equals(metrics.iloc[1])
    with pytest.raises(ValidationError, match="backend='threads'"):
        accuracy.run(layout, tmp_path / "x", backend="threads")


def test_profile_cluster_from_a_laptop_through_ray_client(private_ray, ray_nodes, tmp_path):
    """``address="ray://head:10001"``: Ray Client, where streaming generators do not work (actors do)."""
    import ray

    ray.shutdown()  # this process now reaches the cluster only as a client would
    try:
        work = tiny_mlp()

        def through_client():
            return profile_cluster(**work.profile_args(), address=private_ray.client_address, gpu_types="xeon-a",
                                   batch_sizes=[4, 8], replicas=[], time_budget_s=10, out=tmp_path / "client.jsonl",
                                   progress=False)

        # Ray's client proxy starts a server process per client. In full suites on 2 busy cores that start failed
        # twice, on the server's side ("Initialization failure from server"): the process exited at start
        # ("Starting Ray client server failed"), or the proxy read it while it was a zombie (psutil.ZombieProcess).
        # A Ray-side transient, not the profiler's: up to three tries, each from a clean state.
        for attempt in range(3):
            try:
                profile = through_client()
                break
            except RayConnectionError as exc:
                transient = "Initialization failure from server" in str(exc) or "Starting Ray client server failed" in str(exc)
                if not transient or attempt == 2:
                    raise
                ray.shutdown()
                time.sleep(1.0)
        assert not ray.is_initialized()  # the connection it opened is closed again
        assert [o.local_bsz for o in profile.observations if o.num_replicas == 1] == [4, 8]
        assert profile.metadata["profiler.xeon-a"]["node_id"] == ray_nodes["xeon-a"]
    finally:
        ray.shutdown()  # a failed client connection can leave half a session behind
        ray.init(address=private_ray.address, logging_level="WARNING")


@pytest.mark.cuda
def test_profile_cluster_on_this_machines_gpus(tmp_path):
    """A local Ray instance on a CUDA machine: its GPU type by Ray's own label, observations on that GPU."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    pytest.importorskip("ray")  # a CUDA machine without Ray (the CPU suite installs it)
    from profilers.devices import cuda_device_types

    expected = cuda_device_types()[0].gpu_type
    work = tiny_mlp()
    with local_cluster([{"num_cpus": 2, "num_gpus": torch.cuda.device_count()}]):
        profile = profile_cluster(**work.profile_args(), batch_sizes=[4, 8], time_budget_s=5, out=tmp_path / "gpu.jsonl",
                                  progress=False)
    assert expected in profile.gpu_types
    assert all(d.startswith("cuda") for d in profile.metadata[f"profiler.{expected}"]["devices"])
