"""The service's registry between the store and the models: what it queues, refuses and retries."""

from __future__ import annotations

import time

import pytest
import sqlalchemy as sa

from goodput.errors import ValidationError
from service.registry import NotReadyError, Registry
from service.store import Store, record_id
from tests.service_helpers import profile


def _registry(url: str, store: Store | None = None) -> Registry:
    return Registry(store or Store(url), model_options={"bayesian": False}, coalesce_s=0, min_interval_s=0).start()


def _settings(prof, **extra) -> dict:
    return {"init_batch_size": prof.init_batch_size, "max_batch_size": prof.max_batch_size, **extra}


def test_an_id_repeated_in_one_batch_keeps_its_first_record_in_the_store_and_the_model(tmp_path):
    url = f"sqlite:///{tmp_path / 'goodput.db'}"
    prof = profile("mlp")
    registry = _registry(url)
    registry.register(prof.job, _settings(prof))
    assert registry.wait_idle(60)  # built (empty): the batch below reaches the model through the queue
    first = prof.observations[0]
    second = type(first).from_dict({**first.to_dict(), "gpu_type": "a100", "timestamp": first.timestamp + 1.0})
    rest = prof.observations[1:]
    result = registry.add(prof.job, [first, second, *rest], ["dup", "dup", *(record_id(o.to_dict()) for o in rest)])
    assert result.accepted == len(prof.observations)
    assert registry.wait_idle(60)
    assert registry.published(prof.job).gpu_types == ["cpu"]  # the store's record, not the repeat's
    registry.close()
    restarted = _registry(url)
    assert restarted.wait_idle(60)
    assert restarted.published(prof.job).gpu_types == ["cpu"]
    restarted.close()


def test_a_stage_count_the_stored_observations_contradict_is_refused(tmp_path):
    prof = profile("mlp")
    registry = _registry(f"sqlite:///{tmp_path / 'goodput.db'}")
    registry.register(prof.job, _settings(prof))
    registry.add(prof.job, prof.observations, [record_id(o.to_dict()) for o in prof.observations])
    for stages in (2, {"cpu": 2}):
        with pytest.raises(ValidationError) as caught:
            registry.register(prof.job, _settings(prof, num_stages=stages))
        assert caught.value.field == "num_stages" and caught.value.value == stages
    assert "num_stages" not in registry.record(prof.job).settings
    registry.register(prof.job, _settings(prof, num_stages={"a100": 4}))  # no stored observation disagrees
    assert registry.wait_idle(60)
    assert registry.published(prof.job).observations == len(prof.observations)
    registry.register("fresh", {"init_batch_size": 8, "num_stages": 2})  # nothing stored: anything goes
    registry.close()


def test_an_update_that_failed_on_the_store_is_retried_by_itself(tmp_path):
    url = f"sqlite:///{tmp_path / 'goodput.db'}"
    prof = profile("mlp")
    registry = _registry(url)
    registry.register(prof.job, _settings(prof))
    registry.add(prof.job, prof.observations, [record_id(o.to_dict()) for o in prof.observations])
    assert registry.wait_idle(60)
    registry.close()

    store = Store(url)
    reads, real = [], store.iter_observations

    def blips_once(*args, **kwargs):  # a database failover: the first read fails, the next ones work
        reads.append(time.monotonic())
        if len(reads) == 1:
            raise sa.exc.OperationalError("SELECT", {}, Exception("connection reset"))
        return real(*args, **kwargs)

    store.iter_observations = blips_once
    restarted = _registry(url, store)
    assert restarted.wait_idle(60)
    deadline = time.monotonic() + 30
    while True:
        try:
            published = restarted.published(prof.job)
            break
        except NotReadyError as exc:
            assert time.monotonic() < deadline, "the failed rebuild was never retried"
            assert len(reads) > 1 or "OperationalError" in str(exc.error)
            time.sleep(0.05)
    assert published.observations == len(prof.observations) and len(reads) == 2
    assert reads[1] - reads[0] >= 0.9  # after FAILED_RETRY_S's first wait, not at once
    restarted.close()


def test_a_published_model_caches_the_tables_of_a_few_clusters_and_computes_the_rest():
    from goodput import Cluster, JobModel
    from service.registry import CACHED_CLUSTERS, Published

    prof = profile("mlp")
    model = JobModel(prof.job, prof.init_batch_size, prof.max_batch_size, bayesian=False).observe(prof.observations)
    published = Published(prof.job, 1, model, {}, 0)
    clusters = [Cluster.parse(f"cpu:{n}x2") for n in range(1, CACHED_CLUSTERS + 4)]
    bodies = [published.table_json(cluster, str(cluster)) for cluster in clusters]
    assert all(published.cached(("table-json", str(c))) is not None for c in clusters[:CACHED_CLUSTERS])
    assert all(published.cached(("table-json", str(c))) is None for c in clusters[CACHED_CLUSTERS:])
    assert bodies[-1] == published.table_json(clusters[-1], str(clusters[-1]))  # computed again, the same answer
    assert published.table(clusters[0]) is published.table(clusters[0])  # a cached cluster's table is kept
    # respellings of one cluster ("cpu:01x2", " cpu:1x2", ...) are that cluster: a few answers kept, not one per spelling
    from service.registry import ANSWERS_PER_CLUSTER

    spellings = [f"cpu:{'0' * k}1x2" for k in range(1, 3 * ANSWERS_PER_CLUSTER)]
    for spelling in spellings:
        published.table_json(Cluster.parse(spelling), spelling)
    assert sum(published.cached(("table-json", s)) is not None for s in spellings) < ANSWERS_PER_CLUSTER
    # the server's own answers, computed ahead by the worker, are kept whatever the queries before them asked
    published.table_json(clusters[0], None, reserved=True)
    assert published.cached(("table-json", None)) is not None


def test_a_change_of_a_job_s_speed_in_its_reports_is_read_through_the_store_and_after_a_restart(tmp_path):
    """The reporter's steps, slower than the profile's from some moment on: the published (Bayesian) model reads
    the change from the stored timestamps, predicts the new speed, and a restart rebuilding from the store agrees."""
    url = f"sqlite:///{tmp_path / 'goodput.db'}"
    prof = profile("mlp")
    start = max(o.timestamp for o in prof.observations) + 60.0
    reports = [type(o).from_dict({**o.to_dict(), "step_time": 1.5 * o.step_time, "timestamp": start + k, "source": "training"})
               for k, o in enumerate(prof.observations[i] for i in [4, 5, 6, 4, 5, 6, 4, 5, 6, 4])]
    records = list(prof.observations) + reports

    def check(registry: Registry) -> list:
        assert registry.wait_idle(120)
        published = registry.published(prof.job)
        (shift,) = published.diagnostics["level_shifts"]
        # after the profile's last step at a configuration the reports repeat, at the latest with the first report
        # (the profile's 2-replica steps between, each configuration measured once, leave the moment open)
        assert prof.observations[6].timestamp < shift["at"] <= start
        assert shift["factor"] == pytest.approx(1 / 1.5, rel=0.1)
        o = prof.observations[5]
        predicted = published.answer(("test-predict",), lambda m: float(m.predict(o.gpu_type, o.num_nodes, o.num_replicas,
                                                                                  o.local_bsz).step_time))
        assert predicted == pytest.approx(1.5 * o.step_time, rel=0.1)
        return published.diagnostics["level_shifts"]

    registry = Registry(Store(url), coalesce_s=0, min_interval_s=0).start()
    registry.register(prof.job, _settings(prof))
    registry.add(prof.job, records, [record_id(o.to_dict()) for o in records])
    found = check(registry)
    registry.close()
    restarted = Registry(Store(url), coalesce_s=0, min_interval_s=0).start()
    assert check(restarted) == found
    restarted.close()
