"""A real `goodput serve` process, SIGKILLed during ingest from 8 concurrent senders, then restarted on the same store."""

from __future__ import annotations

import httpx

from experiments.bench_service import ServerProcess, kill_during_ingest, register, wait_ready


def test_a_killed_server_loses_no_acknowledged_observation_and_stores_none_twice(tmp_path):
    counts = kill_during_ingest(tmp_path, jobs=4, clients=8, batch=20, records_per_job=150, kill_at=0.4)
    assert counts["acknowledged"] >= 0.4 * counts["sent"]  # killed mid-ingest, not before or after
    assert counts["acknowledged"] < counts["sent"] and counts["failed_requests"] > 0
    assert counts["lost"] == 0, counts  # every acknowledged observation is there
    assert counts["duplicates"] == 0 and counts["unknown"] == 0, counts
    assert counts["stored"] == counts["acknowledged"] + counts["in_flight"] == counts["counted"], counts


def test_the_restarted_server_rebuilds_its_models_and_takes_resent_records_once(tmp_path):
    store = f"sqlite:///{tmp_path / 'goodput.db'}"
    record = {"gpu_type": "t4", "num_nodes": 1, "num_replicas": 2, "local_bsz": 32, "step_time": 0.05}
    records = [{**record, "local_bsz": 16 * (k + 1), "step_time": 0.02 + 0.01 * k, "id": f"r{k}"} for k in range(6)]
    with ServerProcess(store, "--model", "plain") as server:
        register(server.url, ["j"])
        assert httpx.post(f"{server.url}/v1/jobs/j/observations", json={"observations": records[:4]}).json()["accepted"] == 4
        wait_ready(server.url, ["j"], timeout=60)
        before = httpx.get(f"{server.url}/v1/jobs/j/goodput", params={"gpu_type": "t4", "num_gpus": 2}).json()
        server.kill()
    with ServerProcess(store, "--model", "plain") as server:
        # a sender that did not hear the answer resends: stored once
        assert httpx.post(f"{server.url}/v1/jobs/j/observations", json={"observations": records}).json() == \
               {"accepted": 2, "total": 6}
        wait_ready(server.url, ["j"], timeout=60)
        after = httpx.get(f"{server.url}/v1/jobs/j").json()
        assert after["observations"] == after["model"]["observations"] == 6
        again = httpx.get(f"{server.url}/v1/jobs/j/goodput", params={"gpu_type": "t4", "num_gpus": 2}).json()
        assert again["goodput"] > 0 and before["goodput"] > 0
