"""Ray resources and placement-group bundles each pool asks for (no GPU or Ray needed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from pdserve.deploy.config import secret_env
from pdserve.deploy.placement import Placement, cluster_has_pool_resources

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
