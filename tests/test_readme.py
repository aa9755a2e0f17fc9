"""The README's examples run as written: every command line parses, every Python block executes.

The README is the first thing a user copies from, so its snippets are checked against the code rather than
trusted. Each Python block runs in a namespace holding what its prose assumes (a ``cifar10.jsonl`` profile,
other jobs' observations, a live service with a token); only ``profile_job``'s call is bound to its signature
without profiling (``tests/test_profile_job.py`` profiles for real) and the reporter's block runs in a child
process with a one-replica gloo group, since DistributedDataParallel needs one.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import os
import re
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from goodput import Cluster, JobModel, Observation, Profile
from goodput.throughput import ThroughputParams, predict_step_time
from tests.service_helpers import PROFILES, live_server
from tests.test_throughput import synthetic

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
CLUSTER = "t4:6x4,a100:2x8"
TOKEN = "readme-token"
# Pollux's parameters (alpha_c, beta_c, alpha_n, beta_n, alpha_r, beta_r, gamma) of a job on each type, seconds.
T4 = ThroughputParams(0.03, 0.002, 0.25, 0.02, 0.08, 0.01, 1.6)
A100 = ThroughputParams(0.012, 0.0006, 0.12, 0.01, 0.04, 0.005, 1.6)
PLACEHOLDERS = {"SPEC": "t4:6x4", "URL": "http://127.0.0.1:8470", "J": "cifar10", "csv|json": "csv"}


def blocks(language: str) -> list[str]:
    """The README's fenced blocks of ``language``, in order."""
    return re.findall(rf"^```{language}\n(.*?)^```", README.read_text(), flags=re.M | re.S)


def commands() -> list[str]:
    """Every command of the README's bash blocks: comments cut, continuation lines joined."""
    out = []
    for block in blocks("bash"):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #", 1)[0].strip()
            if line and not line.startswith("#"):
                out.append(line)
    return out


def python_block(containing: str) -> str:
    """The one Python block of the README that contains ``containing``."""
    found = [block for block in blocks("python") if containing in block]
    assert len(found) == 1, f"{len(found)} README Python blocks contain {containing!r}"
    return found[0]


def test_the_readme_has_the_blocks_these_tests_check():
    assert commands()[:2] == ["make demo", "make test"]  # the README starts with exactly the two set-up commands
    assert len(blocks("python")) == 6


@pytest.mark.parametrize("command", [c for c in commands() if c.startswith("goodput")])
def test_every_goodput_command_line_parses(command, capsys):
    from cli import build_parser

    argv = [PLACEHOLDERS.get(word, word) for word in shlex.split(command)[1:]]
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as stop:  # only --help may stop the parser, and successfully
        assert argv == ["--help"] and stop.code == 0, capsys.readouterr().err
        return
    assert callable(args.func), command


def test_every_other_command_names_a_make_target_or_a_module_that_exists():
    targets = set(re.findall(r"^([a-z][\w-]*):", (ROOT / "Makefile").read_text(), flags=re.M))
    others = [c for c in commands() if not c.startswith("goodput")]
    assert others, "the README's bash blocks hold only goodput commands"
    for command in others:
        words = shlex.split(command)
        if words[0] == "make":
            assert words[1] in targets, command
        else:
            assert words[:2] == ["python", "-m"], command
            assert importlib.util.find_spec(words[2]) is not None, command


# ---------------------------------------------------------------------- the Python blocks
def observations(job: str, params: dict[str, ThroughputParams], configs, bszs=(32, 64, 128, 256), seed=0):
    """Step times of ``job`` drawn from known parameters per GPU type, 3% log-normal noise."""
    return [obs for i, (gpu, p) in enumerate(params.items())
            for obs in synthetic(p, configs, bszs=bszs, job=job, gpu=gpu, seed=seed + i)]


MULTI_GPU = [(1, 1), (1, 2), (1, 4), (2, 8)]


@pytest.fixture
def cifar10_profile() -> Profile:
    """``cifar10.jsonl`` in the test's directory: a job measured on a T4 and an A100, 1 to 8 GPUs."""
    profile = Profile(observations("cifar10", {"t4": T4, "a100": A100}, MULTI_GPU), job="cifar10", init_batch_size=128)
    profile.save("cifar10.jsonl")
    return profile


def test_the_first_example_fits_predicts_and_writes_a_table(cifar10_profile):
    namespace: dict = {}
    exec(python_block('Profile.load("cifar10.jsonl")'), namespace)
    assert namespace["best"].goodput > 0 and namespace["best"].batch_size >= 128
    truth = float(predict_step_time(T4, 1, 4, 128, 0))  # the README's predict() call, against the parameters measured
    assert namespace["model"].predict("t4", num_nodes=1, num_replicas=4, local_bsz=128).step_time == pytest.approx(truth, rel=0.1)
    frame = namespace["table"].frame
    assert {"goodput", "batch_size", "std"} <= set(frame.columns) and len(frame) > 0
    assert json.loads(Path("cifar10-table.json").read_text())


def test_the_profiling_example_calls_profile_job_with_arguments_it_takes(monkeypatch):
    import profilers

    calls, signature = [], inspect.signature(profilers.profile_job)

    def bound(*args, **kwargs):
        calls.append(signature.bind(*args, **kwargs))  # TypeError if the README drifted
        return Profile.load(PROFILES / "cpu-zoo-resnet.jsonl")

    monkeypatch.setattr(profilers, "profile_job", bound)
    namespace: dict = {}
    exec(python_block("profile_job("), namespace)
    assert calls and calls[0].arguments["job"] == "resnet"
    assert list(namespace["model"].table(Cluster.parse("cpu:2x2")).frame["gpu_type"].unique()) == ["cpu"]


def test_the_bayesian_example_transfers_from_other_jobs_and_updates_online(cifar10_profile):
    one_gpu = [o for o in cifar10_profile.observations if o.num_replicas == 1]
    report = Observation(job="cifar10", gpu_type="t4", num_nodes=1, num_replicas=4, local_bsz=128, accum_steps=0,
                         step_time=0.5)
    namespace = {
        "bert_obs": observations("bert", {"t4": T4, "a100": A100}, MULTI_GPU, seed=5),
        "yolo_obs": observations("yolov3", {"t4": T4, "a100": A100}, MULTI_GPU, seed=9),
        "one_gpu_profiles": one_gpu, "step_time_reported_by_the_job": report,
    }
    exec(python_block("ClusterPrior.from_observations("), namespace)
    prediction = namespace["p"]
    low, high = prediction.interval(0.9)
    assert 0 < low < prediction.step_time < high and prediction.std > 0
    assert namespace["model"].diagnostics


def test_the_allocation_example_allocates_a_round(cifar10_profile):
    bert = Profile(observations("bert-3", {"t4": T4, "a100": A100}, MULTI_GPU, seed=3), job="bert-3", init_batch_size=64)
    namespace = {"models": {"cifar10": JobModel.from_profile(cifar10_profile), "bert-3": JobModel.from_profile(bert)},
                 "last_round": None}
    exec(python_block("allocate(tables, cluster"), namespace)
    allocation = namespace["allocation"]
    assert allocation["bert-3"].num_gpus == 8  # rigid_gpus=8; 40 GPUs leave room for both jobs
    assert allocation["cifar10"].num_gpus >= 1 and not allocation.unallocated
    assert allocation.info.status == "optimal"


def test_the_client_example_talks_to_a_live_service(tmp_path, cifar10_profile):
    with live_server(f"sqlite:///{tmp_path / 'g.db'}", cluster=CLUSTER, tokens=(TOKEN,)) as (url, client):
        code = python_block("Client(").replace("http://127.0.0.1:8470", url)
        exec(code, {"token": TOKEN, "profile": cifar10_profile, "last": None})
        assert len(client.stored("cifar10")["records"]) == len(cifar10_profile.observations)


def test_the_reporter_example_reports_a_ddp_training_loop_to_a_live_service(tmp_path):
    with live_server(f"sqlite:///{tmp_path / 'g.db'}", tokens=(TOKEN,), model_options={"bayesian": False}) as (url, client):
        block = python_block("GoodputReporter(").replace("http://goodput:8470", url)
        code = textwrap.dedent("""
            import tempfile, torch, torch.distributed as dist
            dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
            ddp_model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(16, 1))
            optimizer = torch.optim.SGD(ddp_model.parameters(), lr=0.01)
            loader = [torch.randn(64, 16) for _ in range(12)]
            loss_fn = lambda output: output.pow(2).mean()
            token = {token!r}
        """).format(token=TOKEN) + block + "\ndist.destroy_process_group()\nprint('trained')\n"
        env = os.environ | {"GOODPUT_REPORTER_DIR": str(tmp_path / "buffer")}
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env,
                                cwd=ROOT)
        assert "trained" in result.stdout, result.stderr[-2000:]
        stored = [r["observation"] for r in client.stored("cifar10")["records"]]
        assert stored and {(o["local_bsz"], o["gpu_type"]) for o in stored} == {(64, "cpu")}
        assert all(0 < o["sync_time"] < o["step_time"] for o in stored)  # attach(): DDP's all-reduce timed
