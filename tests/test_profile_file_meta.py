"""Profile files' meta records: max_local_bsz across reruns, several jobs in one file, the fit command's messages."""

from __future__ import annotations

import pytest

from goodput import JobModel, Observation, Profile, ProfileWriter
from cli import build_parser, main
from goodput.errors import ValidationError
from profilers import profile_job
from profilers.type_run import TypeReport
from tests.profiler_jobs import HostOomFromBatch, tiny_mlp

QUICK = {"replicas": [], "progress": False, "cpu_threads": 1, "min_steps": 3, "max_steps": 10, "time_budget_s": 10}


def _obs(job: str, local_bsz: int, step_time: float = 0.01, **values) -> Observation:
    return Observation(job=job, gpu_type="cpu", num_nodes=1, num_replicas=1, local_bsz=local_bsz, step_time=step_time, **values)


def _write_job(path, job: str, init_batch_size: int, max_batch_size: int, largest: int, num_parameters: int) -> None:
    """Append one job's records as profile_job writes them: a meta naming the job, observations, a meta without it."""
    with ProfileWriter(path) as writer:
        writer.write_meta(job=job, init_batch_size=init_batch_size, max_batch_size=max_batch_size,
                          metadata={"num_parameters": num_parameters})
        for bsz in (8, 16, largest):
            writer.write(_obs(job, bsz, 0.001 * bsz, **({"grad_sqr": 1.0, "grad_var": 2.0} if bsz == 16 else {})))
        writer.write_meta(max_local_bsz={"cpu": largest}, metadata={"profiler.cpu": {"max_local_bsz": largest}})


def _two_jobs(tmp_path):
    """``cat a.jsonl b.jsonl > both.jsonl``: two single-job files appended."""
    a, b, both = tmp_path / "a.jsonl", tmp_path / "b.jsonl", tmp_path / "both.jsonl"
    _write_job(a, "zoo-a", 64, 1024, 512, 78_042)
    _write_job(b, "zoo-b", 32, 4096, 4096, 669_706)
    both.write_bytes(a.read_bytes() + b.read_bytes())
    return both


# ---------------------------------------------------------------- 1. max_local_bsz across reruns


def test_a_rerun_with_a_narrower_grid_keeps_the_larger_max_local_bsz(tmp_path):
    out = tmp_path / "mlp.jsonl"
    first = profile_job(**tiny_mlp().profile_args(), batch_sizes=[4, 8, 16, 32, 64], out=out, **QUICK)
    assert first.max_local_bsz == {"cpu": 64}
    narrow = profile_job(**tiny_mlp().profile_args(), batch_sizes=[8, 16], out=out, **QUICK)
    assert narrow.metadata["profiler.cpu"]["max_local_bsz"] == 16  # what this run did
    assert narrow.max_local_bsz == {"cpu": 64} and Profile.load(out).max_local_bsz == {"cpu": 64}
    # The same narrow settings again: the type is skipped as done, and the limit still stands.
    again = profile_job(**tiny_mlp().profile_args(), batch_sizes=[8, 16], out=out, **QUICK)
    assert again.max_local_bsz == {"cpu": 64} and Profile.load(out).max_local_bsz == {"cpu": 64}
    assert JobModel.from_profile(Profile.load(out)).limits("cpu").max_local_bsz == 64


def test_a_rerun_that_runs_out_of_memory_below_the_old_limit_tightens_it(tmp_path):
    out = tmp_path / "oom.jsonl"
    work = tiny_mlp()
    pieces = (work.optimizer_factory, work.loss_fn, work.make_batch)
    free = profile_job(HostOomFromBatch(threshold=10**9), *pieces, job="oom", init_batch_size=16, batch_sizes=[8, 16, 128],
                       out=out, **QUICK)
    assert free.max_local_bsz == {"cpu": 128}
    # Sizes already measured are resumed, not run again: 32 is new, 64 (<= 128) runs out of memory.
    tight = profile_job(HostOomFromBatch(threshold=64), *pieces, job="oom", init_batch_size=16,
                        batch_sizes=[8, 16, 32, 64, 128], out=out, **QUICK)
    assert tight.metadata["profiler.cpu"]["sweep_stopped"] == "oom"
    assert tight.max_local_bsz == {"cpu": 32} and Profile.load(out).max_local_bsz == {"cpu": 32}


@pytest.mark.parametrize(("previous", "stopped", "measured", "expected"), [
    (None, "grid_end", [8, 16], 16),          # nothing earlier
    (4096, "grid_end", [8, 16], 4096),        # a narrower grid
    (4096, "time_budget", [8, 16], 4096),     # a shorter budget
    (4096, "oom", [8, 16], 16),               # out of memory at 32 <= 4096: tighter
    (4096, "memory_cap", [8, 16], 16),        # a tighter cap
    (16, "oom", [8, 16, 32], 32),             # out of memory above the old limit: the new, larger one
    (16, "oom", [8], 16),                     # out of memory at 32 > 16: 16 still known to fit
    (64, "grid_end", [], 64),                 # nothing ran this time
])
def test_max_local_bsz_rule(previous, stopped, measured, expected):
    from profilers.profile import _max_local_bsz

    report = TypeReport("cpu", ["cpu"], ["cpu"], grid=[8, 32] if measured == [8] else [8, 16, 32, 64],
                        measured=measured, max_local_bsz=max(measured) if measured else None, sweep_stopped=stopped)
    assert _max_local_bsz(previous, report) == expected


# ---------------------------------------------------------------- 2. several jobs in one file


def test_a_file_of_two_jobs_keeps_each_jobs_settings(tmp_path):
    profile = Profile.load(_two_jobs(tmp_path))
    assert profile.jobs == ["zoo-a", "zoo-b"] and profile.job is None
    a, b = profile.select(job="zoo-a"), profile.select(job="zoo-b")
    assert (a.job, a.init_batch_size, a.max_batch_size, a.max_local_bsz) == ("zoo-a", 64, 1024, {"cpu": 512})
    assert (b.job, b.init_batch_size, b.max_batch_size, b.max_local_bsz) == ("zoo-b", 32, 4096, {"cpu": 4096})
    assert a.metadata == {"num_parameters": 78_042, "profiler.cpu": {"max_local_bsz": 512}}
    assert {o.job for o in a} == {"zoo-a"} and not a.job_meta
    model = JobModel.from_profile(a)
    assert (model.job, model.init_batch_size, model.max_batch_size, model.model_size) == ("zoo-a", 64, 1024, 78_042)
    assert model.limits("cpu").max_local_bsz == 512
    with pytest.raises(ValidationError, match="zoo-a"):
        JobModel.from_profile(profile)  # several jobs: choose one


def test_a_profile_of_two_jobs_saves_and_loads_back_each_jobs_settings(tmp_path):
    profile = Profile.load(_two_jobs(tmp_path))
    copy = tmp_path / "copy.jsonl"
    profile.save(copy)
    loaded = Profile.load(copy)
    assert loaded == profile and loaded.job_meta == profile.job_meta
    for job in ("zoo-a", "zoo-b"):
        assert loaded.select(job=job) == profile.select(job=job)
    first = copy.read_bytes()
    loaded.save(copy)  # nothing new
    Profile.load(tmp_path / "both.jsonl").save(tmp_path / "both.jsonl")
    assert copy.read_bytes() == first and Profile.load(tmp_path / "both.jsonl") == profile
    # Appending a record without a job after the jobs are named belongs to the job named last.
    with ProfileWriter(copy) as writer:
        writer.write_meta(max_local_bsz={"cpu": 2048})
    again = Profile.load(copy)
    assert again.select(job="zoo-b").max_local_bsz == {"cpu": 2048}
    assert again.select(job="zoo-a").max_local_bsz == {"cpu": 512}


def test_shared_settings_before_the_first_job_apply_to_every_job(tmp_path):
    path = tmp_path / "p.jsonl"
    profile = Profile([_obs("a", 8), _obs("b", 8)], init_batch_size=16, metadata={"host": "h"},
                      job_meta={"a": {"max_local_bsz": {"cpu": 8}}, "b": {"init_batch_size": 32}})
    profile.save(path)
    loaded = Profile.load(path)
    assert (loaded.job, loaded.init_batch_size, loaded.metadata) == (None, 16, {"host": "h"})
    a, b = loaded.select(job="a"), loaded.select(job="b")
    assert (a.init_batch_size, a.max_local_bsz, a.metadata) == (16, {"cpu": 8}, {"host": "h"})
    assert (b.init_batch_size, b.max_local_bsz, b.metadata) == (32, {}, {"host": "h"})
    with pytest.raises(ValidationError, match=r"job_meta\['a'\].init_batch_size"):
        Profile(job_meta={"a": {"init_batch_size": 0}})
    with pytest.raises(ValidationError, match="unknown job setting"):
        Profile(job_meta={"a": {"job": "b"}})


def test_a_single_job_file_loads_as_before(tmp_path):
    path = tmp_path / "one.jsonl"
    _write_job(path, "zoo-a", 64, 1024, 512, 78_042)
    profile = Profile.load(path)
    assert (profile.job, profile.init_batch_size, profile.max_local_bsz) == ("zoo-a", 64, {"cpu": 512})
    first = path.read_bytes()
    profile.save(path)
    assert path.read_bytes() == first


def test_fit_asks_for_a_job_on_a_file_of_several(tmp_path, capsys):
    both = _two_jobs(tmp_path)
    args = build_parser().parse_args(["fit", str(both), "--cluster", "cpu:1x2"])
    with pytest.raises(ValidationError, match=r"--job.*\['zoo-a', 'zoo-b'\]"):
        args.func(args)
    assert main(["fit", str(both), "--cluster", "cpu:1x2", "--job", "zoo-a", "--json"]) == 0
    assert '"job": "zoo-a"' in capsys.readouterr().out


def test_profiling_into_a_file_of_several_jobs_resumes_from_the_jobs_own_settings(tmp_path):
    out = tmp_path / "both.jsonl"
    first = profile_job(**tiny_mlp().profile_args(), batch_sizes=[4, 8, 16, 32], out=out, **QUICK)
    assert first.job == "zoo-mlp" and first.max_local_bsz == {"cpu": 32}
    Profile([_obs("other", 8)], job="other", init_batch_size=64, max_local_bsz={"cpu": 999}).save(out)
    rerun = profile_job(**tiny_mlp().profile_args(), batch_sizes=[4, 8], out=out, **QUICK)
    assert (rerun.job, rerun.init_batch_size, rerun.max_local_bsz) == ("zoo-mlp", 16, {"cpu": 32})
    loaded = Profile.load(out)
    assert loaded.job is None and loaded.select(job="zoo-mlp").max_local_bsz == {"cpu": 32}
    assert loaded.select(job="other").max_local_bsz == {"cpu": 999}


def test_the_accuracy_reader_takes_each_jobs_parameter_count_from_a_file_of_several(tmp_path):
    from experiments.datasets import read_measurements

    folder = tmp_path / "profiles"
    folder.mkdir()
    _two_jobs(tmp_path).rename(folder / "both.jsonl")
    _write_job(folder / "c.jsonl", "zoo-c", 16, 256, 256, 1_000)
    data = read_measurements(folder)
    assert sorted(data.models) == ["zoo-a", "zoo-b", "zoo-c"]
    assert data.sizes == {"zoo-a": 78_042, "zoo-b": 669_706, "zoo-c": 1_000}


# ---------------------------------------------------------------- 3. the fit command's messages


def test_fit_on_an_empty_file_says_it_is_empty(tmp_path, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.touch()
    assert main(["fit", str(empty), "--init-batch-size", "32", "--cluster", "cpu:1x1"]) == 2
    err = capsys.readouterr().err
    assert "empty" in err and "job=None" not in err
    args = build_parser().parse_args(["fit", str(empty), "--init-batch-size", "32"])
    with pytest.raises(ValidationError, match="no records"):
        args.func(args)


def test_fit_names_the_init_batch_size_flag(tmp_path, capsys):
    path = tmp_path / "p.jsonl"
    Profile([_obs("j", 8), _obs("j", 16, 0.02)]).save(path)  # no M0 recorded
    assert main(["fit", str(path), "--cluster", "cpu:1x1"]) == 2
    err = capsys.readouterr().err
    assert "--init-batch-size" in err and "init_batch_size=" not in err
    assert main(["fit", str(path), "--cluster", "cpu:1x1", "--init-batch-size", "16", "--json"]) == 0
