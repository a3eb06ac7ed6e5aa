"""The parts of the NCCL KV transport that run without a GPU: loading ``libnccl.so.2`` from the
``nvidia-nccl-cu12`` wheel, its version, unique ids, the control-frame codec, the unique-id
exchange over a real control connection (up to the communicator init, which needs CUDA), the
errors when the library or CUDA is missing, and backend selection. The data path (ncclSend/ncclRecv
between two GPUs) is exercised by tests/test_kvtransfer_conformance*.py on a machine with 2 GPUs.
"""

from __future__ import annotations

import ctypes.util
import importlib.metadata
import importlib.util
import os
import re
import socket
import threading
from pathlib import Path

import pytest
import torch

# NCCL reads this once, at its first call: keep its bootstrap socket (opened by ncclGetUniqueId) on loopback.
os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")

from pdserve.kvtransfer.backends import backend_of_address, choose_backend  # noqa: E402
from pdserve.kvtransfer.base import TransferError  # noqa: E402
from pdserve.kvtransfer.nccl import NcclKVReceiver, NcclKVSender  # noqa: E402
from pdserve.kvtransfer.nccl.comms import CommCache  # noqa: E402
from pdserve.kvtransfer.nccl.control import Bye, ClearToSend, Hello, Welcome, encode_control, read_any  # noqa: E402
from pdserve.kvtransfer.nccl.handshake import negotiate_receiver, negotiate_sender  # noqa: E402
from pdserve.kvtransfer.nccl.library import (  # noqa: E402
    RESULT_NAMES,
    UNIQUE_ID_BYTES,
    NcclError,
    NcclLibrary,
    NcclUnavailable,
    load_library,
)
from pdserve.kvtransfer.select import (  # noqa: E402
    explain_no_backend,
    local_backends,
    make_receiver,
    make_sender,
    nccl_status,
)
from pdserve.kvtransfer.wire.frames import Ack, Done, FrameError, Pages, encode  # noqa: E402
from pdserve.model.kv_cache import KVCacheSpec  # noqa: E402

pytestmark = pytest.mark.timeout(30)
WHEEL = importlib.util.find_spec("nvidia.nccl")
needs_wheel = pytest.mark.skipif(WHEEL is None, reason="nvidia-nccl-cu12 is not installed (Linux x86_64 only)")
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the errors of a machine without CUDA")
SPEC = KVCacheSpec(num_blocks=4, num_layers=2, block_size=4, num_kv_heads=1, head_dim=8)


@pytest.fixture(scope="module")
def lib() -> NcclLibrary:
    if WHEEL is None:
        pytest.skip("nvidia-nccl-cu12 is not installed")
    return load_library()


def _header_version() -> tuple[int, int, int]:
    text = (Path(WHEEL.submodule_search_locations[0]) / "include" / "nccl.h").read_text()
    return tuple(int(re.search(rf"#define NCCL_{k}\s+(\d+)", text).group(1)) for k in ("MAJOR", "MINOR", "PATCH"))


# -- the library --------------------------------------------------------------------------------


@needs_wheel
def test_library_is_loaded_once_from_the_wheel(lib):
    assert lib.path == str(Path(WHEEL.submodule_search_locations[0]) / "lib" / "libnccl.so.2")
    assert load_library() is lib


@needs_wheel
def test_version_matches_the_wheels_header_and_metadata(lib):
    version = lib.version()
    assert version.parts == _header_version()
    assert str(version) == importlib.metadata.version("nvidia-nccl-cu12")
    assert version.code == version.parts[0] * 10000 + version.parts[1] * 100 + version.parts[2]


@needs_wheel
def test_unique_ids_are_fresh_128_byte_ids_without_a_gpu(lib):
    a, b = lib.get_unique_id(), lib.get_unique_id()
    assert len(a) == len(b) == UNIQUE_ID_BYTES
    assert a != b


def test_missing_or_wrong_library_gives_a_clear_error(tmp_path):
    missing = tmp_path / "libnccl.so.2"
    with pytest.raises(NcclUnavailable, match=rf"nvidia-nccl-cu12.*{re.escape(str(missing))}"):
        NcclLibrary(str(missing))
    libm = ctypes.util.find_library("m")
    with pytest.raises(NcclUnavailable, match="missing symbols .*ncclGetVersion"):
        NcclLibrary(libm)
    assert str(missing) in nccl_status(str(missing))


@needs_wheel
@no_cuda
def test_communicator_init_without_cuda_fails_with_nccls_reason(lib):
    with pytest.raises(NcclError, match="ncclUnhandledCudaError.*CUDA driver") as info:
        lib.comm_init_rank(2, lib.get_unique_id(), 1, timeout_s=2.0)
    assert info.value.code == 1 and info.value.call == "ncclCommInitRankConfig"
    with pytest.raises(ValueError, match="128 bytes"):
        lib.comm_init_rank(2, b"short", 0, timeout_s=1.0)


@needs_wheel
def test_every_result_code_has_a_name_and_text(lib):
    for code, name in RESULT_NAMES.items():
        assert lib.error_string(code)
        assert name in str(NcclError("ncclSend", code, lib.error_string(code)))


# -- control frames -----------------------------------------------------------------------------


def test_control_frames_round_trip_next_to_the_tcp_frames():
    frames = [Hello("r1", "c" * 32, "s1", 23203, bytes(range(128))), Welcome("r1", True, False, True, ""),
              ClearToSend("r1"), Bye("c" * 32)]
    tcp_frames = [Pages("r1", 0, 2, (1, 3), "float32", (2, 2, 2, 4, 1, 8), 1024), Done("r1", 9), Ack("r1", False, "x")]
    a, b = socket.socketpair()
    with a, b:
        a.sendall(b"".join(encode_control(f) for f in frames) + b"".join(encode(f) for f in tcp_frames))
        a.shutdown(socket.SHUT_WR)
        assert [read_any(b) for _ in range(len(frames) + len(tcp_frames))] == frames + tcp_frames
        assert read_any(b) is None


@pytest.mark.parametrize("field, value", [("unique_id", "not bytes"), ("nccl_version", True), ("comm_id", None)])
def test_malformed_control_frames_are_refused_with_the_field_named(field, value):
    import msgpack

    header = {"type": "nccl_hello", "request_id": "r1", "comm_id": "c", "sender_id": "s", "nccl_version": 1,
              "unique_id": b"", field: value}
    body = msgpack.packb(header, use_bin_type=True)
    a, b = socket.socketpair()
    with a, b:
        a.sendall(len(body).to_bytes(4, "big") + body)
        with pytest.raises(FrameError, match=f"field '{field}'") as info:
            read_any(b)
        assert info.value.request_id == "r1"


# -- the unique-id exchange over a real control connection ---------------------------------------


def _connected() -> tuple[socket.socket, socket.socket]:
    with socket.create_server(("127.0.0.1", 0)) as server:
        client = socket.create_connection(server.getsockname(), timeout=5.0)
        conn, _ = server.accept()
    conn.settimeout(5.0)
    return client, conn


@needs_wheel
@no_cuda
def test_unique_id_reaches_the_receiver_and_both_inits_fail_cleanly_without_cuda(lib):
    client, conn = _connected()
    made: list[bytes] = []
    seen: list[Hello] = []
    errors: dict[str, BaseException] = {}
    tx_comms, rx_comms = (CommCache(lib, torch.device("cpu"), init_timeout_s=2.0) for _ in range(2))

    def make_unique_id() -> bytes:
        made.append(lib.get_unique_id())
        return made[-1]

    def receiver() -> None:
        try:
            hello = read_any(conn)
            seen.append(hello)
            negotiate_receiver(conn, hello, rx_comms, lib.version().code)
        except BaseException as e:
            errors["rx"] = e

    thread = threading.Thread(target=receiver)
    thread.start()
    with client, conn:
        with pytest.raises(NcclError, match="ncclUnhandledCudaError") as info:
            negotiate_sender(client, "r1", "127.0.0.1:1", tx_comms, lib.version().code, "sender-a", make_unique_id)
        thread.join(5.0)
    assert len(made) == 1 and len(seen) == 1
    assert seen[0] == Hello("r1", seen[0].comm_id, "sender-a", lib.version().code, made[0])
    assert re.fullmatch("[0-9a-f]{32}", seen[0].comm_id)
    assert isinstance(errors["rx"], NcclError) and errors["rx"].code == info.value.code == 1
    assert tx_comms.keys() == [] and rx_comms.keys() == []  # nothing half-built is cached


@needs_wheel
def test_receiver_refuses_a_different_nccl_version_or_a_bad_id(lib):
    code = lib.version().code
    comms = CommCache(lib, torch.device("cpu"), init_timeout_s=1.0)
    a, b = socket.socketpair()
    with a, b:
        with pytest.raises(FrameError, match="same NCCL version"):
            negotiate_receiver(b, Hello("r1", "c1", "s", code + 1, b"\0" * 128), comms, code)
        with pytest.raises(FrameError, match="unique_id is 5 bytes"):
            negotiate_receiver(b, Hello("r1", "c1", "s", code, b"short"), comms, code)
        # an unknown communicator without an id: the receiver asks for one, and gives up on a second refusal
        a.sendall(encode_control(Hello("r1", "c1", "s", code, b"")))
        with pytest.raises(FrameError, match="no unique id"):
            negotiate_receiver(b, Hello("r1", "c1", "s", code, b""), comms, code)
        assert read_any(a) == Welcome("r1", True, False, True, "")  # asked once
        a.setblocking(False)
        with pytest.raises(BlockingIOError):
            a.recv(1)


@needs_wheel
def test_sender_reports_the_receivers_refusal_and_out_of_protocol_answers(lib):
    code = lib.version().code
    comms = CommCache(lib, torch.device("cpu"), init_timeout_s=1.0)
    for answer, text in [(encode(Ack("r1", False, "unknown request 'r1'")), "refused the transfer: unknown request"),
                         (encode_control(Welcome("r1", True, False, True, "")), "does not answer hello"),
                         (encode_control(ClearToSend("r1")), "expected nccl_welcome")]:
        a, b = socket.socketpair()
        with a, b:
            b.sendall(answer)
            with pytest.raises(FrameError, match=text):
                negotiate_sender(a, "r1", "k", comms, code, "s", lib.get_unique_id)
            assert isinstance(read_any(b), Hello)
    assert comms.keys() == []


# -- construction and selection ------------------------------------------------------------------


@needs_wheel
def test_nccl_transport_refuses_cpu_caches():
    cache = SPEC.allocate()
    for cls in (NcclKVSender, NcclKVReceiver):
        with pytest.raises(ValueError, match="needs a contiguous CUDA kv_cache"):
            cls(cache, SPEC)


def test_choose_backend_prefers_nccl_and_explains_a_mismatch():
    assert choose_backend(["nccl"], ["nccl"]) == "nccl"
    assert choose_backend(["tcp", "nccl"], ["nccl", "tcp"]) == "nccl"
    assert choose_backend(["tcp"], ["tcp"]) == "tcp"
    with pytest.raises(ValueError, match=r"no common KV transport.*\['nccl'\].*\['tcp'\]"):
        choose_backend(["nccl"], ["tcp"])
    with pytest.raises(ValueError, match=r"unknown KV transport backends \['rdma'\]"):
        choose_backend(["rdma"], ["tcp"])
    assert [backend_of_address(a) for a in ("nccl://10.0.0.1:9", "10.0.0.1:9", "[::1]:9")] == ["nccl", "tcp", "tcp"]
    with pytest.raises(ValueError, match="unknown KV transport"):
        backend_of_address("rdma://10.0.0.1:9")


def test_cache_memory_decides_the_local_backend():
    assert local_backends(SPEC.allocate()) == ("tcp",)
    meta = torch.empty(SPEC.shape, device="meta")
    assert local_backends(meta) == ()
    assert "meta KV cache" in explain_no_backend(meta)
    with pytest.raises(RuntimeError, match="no KV transport handles a meta KV cache"):
        make_receiver(meta, SPEC)


def test_kv_transport_setting_narrows_the_backends():
    """``--kv-transport``: ``tcp`` keeps a CUDA cache off NCCL (two workers on one GPU), ``nccl`` on a CPU
    cache leaves nothing and says why before anything binds; an unknown name is refused."""
    cache = SPEC.allocate()
    assert local_backends(cache, transport="tcp") == ("tcp",) == local_backends(cache, transport="auto")
    assert local_backends(cache, transport="nccl") == ()
    assert "NCCL moves CUDA memory only" in explain_no_backend(cache, transport="nccl")
    with pytest.raises(RuntimeError, match="--kv-transport nccl: NCCL moves CUDA memory only"):
        make_receiver(cache, SPEC, transport="nccl")
    with pytest.raises(RuntimeError, match="--kv-transport nccl"):
        make_sender(cache, SPEC, transport="nccl")
    with pytest.raises(ValueError, match="kv transport must be one of"):
        local_backends(cache, transport="rdma")


def test_cpu_sender_refuses_an_nccl_receiver_before_connecting():
    tx = make_sender(SPEC.allocate(), SPEC, connect_timeout_s=0.5)
    try:
        assert tx.backends == ("tcp",)
        with socket.create_server(("127.0.0.1", 0)) as server:  # would accept, but must never be dialled
            server.settimeout(0.2)
            with pytest.raises(TransferError, match=r"'r1'.*no common KV transport"):
                tx.open("r1", f"nccl://127.0.0.1:{server.getsockname()[1]}")
            with pytest.raises(TimeoutError):
                server.accept()
    finally:
        tx.close()
