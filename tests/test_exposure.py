"""No process listens on the network unguarded by accident: without the cluster secret (and, for the
router, a bearer token or TLS) a non-loopback bind is refused unless ``--insecure`` is given, which
is then logged at start and every minute."""

from __future__ import annotations

import logging

import pytest

from pdserve.cluster.secret import InsecureBindError, InsecureReminder, check_exposure, is_loopback
from pdserve.deploy.config import router_env
from pdserve.deploy.processes import spawn_role

SECRET = b"0123456789abcdef0123456789abcdef"


@pytest.mark.parametrize("host, loopback", [("127.0.0.1", True), ("127.0.0.2", True), ("::1", True),
                                            ("[::1]", True), ("localhost", True), ("0.0.0.0", False),
                                            ("10.0.0.7", False), ("::", False), ("node.example", False)])
def test_is_loopback(host, loopback):
    assert is_loopback(host) is loopback


def test_exposure_rules():
    assert check_exposure("w", "127.0.0.1", None, insecure=False) is False  # local development: fine
    assert check_exposure("w", "10.0.0.7", SECRET, insecure=False) is False
    with pytest.raises(InsecureBindError, match=r"w would listen on 10\.0\.0\.7.*PDSERVE_CLUSTER_SECRET.*--insecure"):
        check_exposure("w", "10.0.0.7", None, insecure=False)
    with pytest.raises(InsecureBindError, match="bearer token") as err:
        check_exposure("the router", "0.0.0.0", SECRET, insecure=False, client_auth=False)
    assert "cluster secret" not in str(err.value)  # names only what is missing
    assert check_exposure("the router", "0.0.0.0", SECRET, insecure=False, client_auth=True) is False
    assert check_exposure("the router", "0.0.0.0", None, insecure=True, client_auth=False) is True


def test_insecure_reminder_warns_at_start_and_every_period(caplog):
    log = logging.getLogger("test-exposure")
    with caplog.at_level(logging.WARNING, logger="test-exposure"):
        reminder = InsecureReminder("worker d0", "0.0.0.0", period_s=60.0, log=log)
        start = reminder._last
        for dt in (1.0, 30.0, 59.9):
            reminder.tick(start + dt)
        assert reminder.num_warnings == 1
        reminder.tick(start + 60.5)      # not 60.0: (start + 60.0) - start can round below 60 at some uptimes
        reminder.tick(start + 61.0)
        reminder.tick(start + 121.0)
    assert reminder.num_warnings == 3
    assert [r.getMessage() for r in caplog.records].count(
        "INSECURE: worker d0 listens on 0.0.0.0 without authentication (--insecure): anyone who reaches this "
        "address can use it") == 3


@pytest.mark.parametrize("role, who", [("router", "the router"), ("decode_worker", "decode worker"),
                                       ("prefill_worker", "prefill worker")])
def test_a_process_on_a_network_address_without_a_secret_refuses_to_start(role, who, model_dir, redis_url):
    """Refused before anything binds (so this test opens no network port)."""
    flags = dict(model_dir=model_dir, cluster="exposure", redis_url=redis_url, host="0.0.0.0")
    if role != "router":
        flags["worker_id"] = "x0"
    env = {"PDSERVE_CLUSTER_SECRET": "", "PDSERVE_CLUSTER_SECRET_FILE": "", "PDSERVE_ROUTER_TOKEN": ""}
    with pytest.raises(RuntimeError, match=f"{who}.* would listen on 0.0.0.0.*--insecure"):
        spawn_role(role, flags, env=env, timeout_s=60)


def test_the_router_actor_gets_the_drivers_token():
    assert router_env({"PDSERVE_ROUTER_TOKEN": "t" * 20, "OTHER": "x"}) == {"PDSERVE_ROUTER_TOKEN": "t" * 20}
    assert router_env({"PDSERVE_ROUTER_TOKEN": "  "}) == {} and router_env({}) == {}
