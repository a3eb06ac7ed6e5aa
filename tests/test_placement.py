"""Ray resources and placement-group bundles each pool asks for (no GPU or Ray needed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from pdserve.deploy.config import ClusterConfig, secret_env
from pdserve.deploy.placement import Placement, cluster_has_pool_resources, device_decision, router_node_id
from pdserve.deploy.ray_cluster import wait_for_device

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"


def test_cpu_workers_ask_for_cpus_only():
    p = Placement(cuda=False, cpus_per_worker=1.5)
    assert p.actor_options("prefill") == {"num_cpus": 1.5, "num_gpus": 0.0}
    assert p.bundles("decode", 3) == ([{"CPU": 1.5}] * 3, "PACK")


def test_gpu_workers_get_one_gpu_each_and_separate_pools():
    p = Placement(cuda=True, cpus_per_worker=4, separate_nodes=True, strategy="SPREAD")
    assert p.actor_options("prefill") == {"num_cpus": 4.0, "num_gpus": 1.0,
                                          "resources": {"pdserve_prefill_node": 1.0}}
    assert p.actor_options("decode") == {"num_cpus": 4.0, "num_gpus": 1.0,
                                         "resources": {"pdserve_decode_node": 1.0}}
    bundles, strategy = p.bundles("prefill", 2)
    assert bundles == [{"CPU": 4.0, "GPU": 1.0, "pdserve_prefill_node": 1.0}] * 2 and strategy == "SPREAD"
    # a colocated worker (role "both") decodes, so it lives on decode nodes
    assert p.worker_demand("both") == {"CPU": 4.0, "GPU": 1.0, "pdserve_decode_node": 1.0}


def test_gpu_workers_without_pool_nodes_still_take_distinct_gpus():
    p = Placement(cuda=True, cpus_per_worker=2)
    assert p.bundles("decode", 2) == ([{"CPU": 2.0, "GPU": 1.0}] * 2, "PACK")
    assert "resources" not in p.actor_options("decode")


def test_free_resources_bound_the_number_of_new_workers():
    p = Placement(cuda=True, cpus_per_worker=2, separate_nodes=True)
    free = {"CPU": 15.0, "GPU": 6.0, "pdserve_prefill_node": 2.0, "pdserve_decode_node": 4.0, "memory": 1e10}
    assert p.num_fit("prefill", free) == 2  # pool slots bind
    assert p.num_fit("decode", free) == 4
    assert p.num_fit("decode", {**free, "CPU": 5.0}) == 2  # CPUs bind
    assert p.num_fit("decode", {"CPU": 64.0}) == 0  # no GPU at all
    assert Placement(cpus_per_worker=0.5).num_fit("prefill", {"CPU": 1.9999999999}) == 4


@pytest.mark.parametrize("bad", [dict(cpus_per_worker=0), dict(strategy="RANDOM")])
def test_bad_placements_are_rejected(bad):
    with pytest.raises(ValueError):
        Placement(**bad)


def test_bad_role_and_empty_groups_are_rejected():
    with pytest.raises(ValueError, match="role"):
        Placement().worker_demand("router")
    with pytest.raises(ValueError, match="at least one"):
        Placement().bundles("prefill", 0)


def test_pool_separation_is_detected_from_cluster_resources():
    assert cluster_has_pool_resources({"CPU": 8, "pdserve_prefill_node": 8, "pdserve_decode_node": 8})
    assert not cluster_has_pool_resources({"CPU": 8, "GPU": 8, "pdserve_decode_node": 8})


def test_cluster_configs_declare_the_pool_resources_per_gpu():
    """The ray up and KubeRay configs give each pool's node type one pool unit per GPU."""
    cluster = yaml.safe_load((DEPLOY / "ray" / "cluster.yaml").read_text())
    types = cluster["available_node_types"]
    for pool in ("prefill", "decode"):
        node = next(t for t in types.values() if f"pdserve_{pool}_node" in t["resources"])
        assert node["resources"][f"pdserve_{pool}_node"] == node["resources"]["GPU"] >= 1
        assert node["max_workers"] >= node["min_workers"] >= 0
    docs = list(yaml.safe_load_all((DEPLOY / "kuberay" / "raycluster.yaml").read_text()))
    kuberay = next(d for d in docs if d["kind"] == "RayCluster")
    assert {g["groupName"] for g in kuberay["spec"]["workerGroupSpecs"]} == {"prefill-gpu", "decode-gpu"}
    for group in kuberay["spec"]["workerGroupSpecs"]:
        # KubeRay's quoting: the value is a JSON object inside double quotes, inner quotes escaped
        resources = json.loads(group["rayStartParams"]["resources"][1:-1].replace('\\"', '"'))
        container = group["template"]["spec"]["containers"][0]
        gpus = int(container["resources"]["limits"]["nvidia.com/gpu"])
        assert resources == {f"pdserve_{group['groupName'].split('-')[0]}_node": gpus}


def test_each_launch_gets_a_secret_unless_the_driver_has_one():
    a, b = secret_env({}), secret_env({})
    assert a.keys() == {"PDSERVE_CLUSTER_SECRET"} and a != b and len(a["PDSERVE_CLUSTER_SECRET"]) == 64
    assert secret_env({"PDSERVE_CLUSTER_SECRET": "x" * 20}) == {"PDSERVE_CLUSTER_SECRET": "x" * 20}
    assert secret_env({"PDSERVE_CLUSTER_SECRET_FILE": "/etc/s"}) == {"PDSERVE_CLUSTER_SECRET_FILE": "/etc/s"}


# ---- device choice, GPU wait and router node (`--device`, `--gpu-wait`, `--router-node`) -------------

POOLS = {"prefill": 2, "decode": 2}


def test_auto_and_cpu_never_wait():
    assert device_decision("auto", {"CPU": 64.0}, POOLS) == ("cpu", {})
    assert device_decision("auto", {"CPU": 64.0, "GPU": 1.0}, POOLS) == ("cuda", {})
    assert device_decision("cpu", {"CPU": 64.0, "GPU": 8.0}, POOLS) == ("cpu", {})
    with pytest.raises(ValueError):
        device_decision("tpu", {}, POOLS)


def test_cuda_waits_until_the_pools_gpus_have_joined():
    head_only = {"CPU": 8.0}
    assert device_decision("cuda", head_only, POOLS) == ("wait", {"GPU": 4.0})
    assert device_decision("cuda", {"CPU": 8.0, "GPU": 3.0}, POOLS) == ("wait", {"GPU": 1.0})
    assert device_decision("cuda", {"CPU": 8.0, "GPU": 4.0}, POOLS) == ("cuda", {})
    assert device_decision("cuda", {"CPU": 3.0, "GPU": 4.0}, POOLS) == ("wait", {"CPU": 1.0})
    assert device_decision("cuda", {"CPU": 8.0, "GPU": 1.0}, {"both": 1}) == ("cuda", {})


def test_cuda_with_pool_nodes_waits_for_each_pools_nodes():
    """Once either pool's node type has joined, the other pool waits for its own nodes (not for any GPU)."""
    prefill_joined = {"CPU": 64.0, "GPU": 8.0, "pdserve_prefill_node": 8.0}
    assert device_decision("cuda", prefill_joined, POOLS) == ("wait", {"pdserve_decode_node": 2.0})
    both = {**prefill_joined, "GPU": 16.0, "pdserve_decode_node": 8.0}
    assert device_decision("cuda", both, POOLS) == ("cuda", {})
    assert device_decision("cuda", prefill_joined, POOLS, separate_nodes=False) == ("cuda", {})


class _Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.t += s


def test_gpu_wait_reports_then_starts_when_nodes_join():
    clock, messages = _Clock(), []
    joined_at = 25.0
    cfg = ClusterConfig(model_dir="m", num_prefill=1, num_decode=1, ray_address="auto", device="cuda", gpu_wait_s=60)
    resources = lambda: {"CPU": 8.0, **({"GPU": 2.0} if clock.t >= joined_at else {})}  # noqa: E731
    assert wait_for_device(cfg, resources, messages.append, clock, clock.sleep, poll_s=2, report_every_s=10) == "cuda"
    assert 25 <= clock.t < 28
    assert len(messages) == 3 and all("waiting for GPU nodes" in m and "'GPU': 2.0" in m for m in messages)


def test_gpu_wait_is_bounded_and_a_local_ray_fails_at_once():
    clock, messages = _Clock(), []
    cfg = ClusterConfig(model_dir="m", ray_address="auto", device="cuda", gpu_wait_s=30)
    with pytest.raises(RuntimeError, match="after waiting 30 s"):
        wait_for_device(cfg, lambda: {"CPU": 8.0}, messages.append, clock, clock.sleep)
    assert 30 <= clock.t < 33 and messages
    local, clock = ClusterConfig(model_dir="m", device="cuda"), _Clock()
    with pytest.raises(RuntimeError, match="lacks"):
        wait_for_device(local, lambda: {"CPU": 8.0}, messages.append, clock, clock.sleep)
    assert clock.t == 0


def test_auto_on_a_gpu_less_remote_cluster_says_workers_run_on_cpus():
    messages = []
    cfg = ClusterConfig(model_dir="m", ray_address="auto")
    assert wait_for_device(cfg, lambda: {"CPU": 8.0}, messages.append) == "cpu"
    assert messages and "CPUs" in messages[0]
    assert wait_for_device(ClusterConfig(model_dir="m"), lambda: {"CPU": 8.0}, messages.append) == "cpu"
    assert len(messages) == 1  # a local cluster is CPU-only by design: no message


NODES = [
    {"NodeID": "w1", "Alive": True, "NodeManagerAddress": "10.0.0.7", "Resources": {"CPU": 8.0, "GPU": 8.0}},
    {"NodeID": "dead", "Alive": False, "NodeManagerAddress": "10.0.0.9", "Resources": {"CPU": 8.0}},
    {"NodeID": "head", "Alive": True, "NodeManagerAddress": "10.0.0.2",
     "Resources": {"CPU": 4.0, "node:__internal_head__": 1.0}},
]


def test_router_runs_on_the_head_or_the_named_node():
    assert router_node_id(NODES) == "head"
    assert router_node_id(NODES, "10.0.0.7") == "w1"
    with pytest.raises(ValueError, match="10.0.0.9"):
        router_node_id(NODES, "10.0.0.9")  # dead nodes do not count
    assert router_node_id(NODES[:1]) is None  # no head declared: let Ray choose


@pytest.mark.parametrize("bad", [dict(device="tpu"), dict(gpu_wait_s=-1), dict(cluster="a/b"), dict(cluster="x*")])
def test_bad_cluster_configs_are_rejected(bad):
    with pytest.raises(ValueError):
        ClusterConfig(model_dir="m", **bad)
