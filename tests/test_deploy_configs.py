"""The shipped cluster configs keep the security model: Redis with a password from a mounted secret
and protected mode on, the Ray dashboard (whose job API runs code on every node) on loopback only,
and the cluster secret read from a mounted file, never written into the config."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent


def test_ray_up_config():
    text = (ROOT / "deploy" / "ray" / "cluster.yaml").read_text()
    cfg = yaml.safe_load(text)
    commands = " ".join(cfg["head_start_ray_commands"])
    redis = next(c for c in cfg["head_start_ray_commands"] if c.startswith("redis-server"))
    assert "--protected-mode yes" in redis and "--protected-mode no" not in text
    assert re.search(r'--requirepass "\$\(cat ~/\.pdserve-secrets/redis-password\)"', redis)
    assert "--dashboard-host=127.0.0.1" in commands and "--dashboard-host=0.0.0.0" not in text
    assert cfg["file_mounts"]["~/.pdserve-secrets"] == "~/.pdserve-secrets"  # the secrets come from files
    setup = " ".join(cfg["setup_commands"])
    assert "PDSERVE_CLUSTER_SECRET_FILE=$HOME/.pdserve-secrets/cluster-secret" in setup
    assert "chmod 600 ~/.pdserve-secrets/*" in setup
    assert "PDSERVE_CLUSTER_SECRET=" not in text.replace("PDSERVE_CLUSTER_SECRET_FILE=", "")


def test_kuberay_config():
    docs = {d["kind"]: d for d in yaml.safe_load_all((ROOT / "deploy" / "kuberay" / "raycluster.yaml").read_text())}
    redis = docs["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    start = " ".join(redis["command"])
    assert '--requirepass "$REDIS_PASSWORD"' in start and "--protected-mode yes" in start
    assert "--protected-mode no" not in start + " ".join(redis.get("args", []))
    assert redis["env"][0]["valueFrom"]["secretKeyRef"] == {"name": "pdserve-secret", "key": "redis-password"}
    spec = docs["RayCluster"]["spec"]
    assert spec["headGroupSpec"]["rayStartParams"]["dashboard-host"] == "127.0.0.1"
    pods = [spec["headGroupSpec"]["template"]["spec"]] + [g["template"]["spec"] for g in spec["workerGroupSpecs"]]
    for pod in pods:
        (container,) = pod["containers"]
        env = {e["name"]: e for e in container["env"]}
        assert "PDSERVE_CLUSTER_SECRET" not in env  # the file, not the value in the pod spec
        path = env["PDSERVE_CLUSTER_SECRET_FILE"]["value"]
        mount = next(m for m in container["volumeMounts"] if path.startswith(m["mountPath"] + "/"))
        volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
        assert volume["secret"]["secretName"] == "pdserve-secret" and mount["readOnly"]
        assert env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]["key"] == "redis-password"
        assert env["PDSERVE_REDIS_URL"]["value"].startswith("redis://:$(REDIS_PASSWORD)@")
        assert all(p.get("name") != "dashboard" for p in container.get("ports", []))
