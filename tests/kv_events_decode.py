"""Decode KV-event batch payloads with an engine's own types; run by an engine's python.

Usage: ``python kv_events_decode.py vllm|sglang [FILE]``. Reads payloads from FILE (else
stdin), each framed by a 4-byte big-endian length, decodes each with
``msgspec.msgpack.Decoder(type=KVEventBatch)`` of vLLM (``vllm.distributed.kv_events``)
or SGLang (``sglang.srt.disaggregation.kv_events``), and prints one JSON line per batch:
``{"ts", "dp_rank", "events": [{"type": <class name>, "module": ..., <every field>}]}``.
Bytes print as ``{"hex": ...}`` and tuples as lists. A payload the types reject prints
``{"error": ...}`` instead, so the caller sees which one and why.
"""

from __future__ import annotations

import json
import sys
from typing import Any


def _engine_types(engine: str) -> Any:
    if engine == "vllm":
        from vllm.distributed import kv_events

        return kv_events
    if engine == "sglang":
        import torch

        # As tests/sglang_kit/driver.py: torchvision's CUDA-only wheel registers fake
        # kernels for two operators its missing native library would define.
        lib = torch.library.Library("torchvision", "DEF")
        lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        _engine_types.keep = lib  # type: ignore[attr-defined]
        from sglang.srt.disaggregation import kv_events

        return kv_events
    raise SystemExit(f"unknown engine {engine!r}: vllm or sglang")


def _plain(value: Any) -> Any:
    import msgspec

    if isinstance(value, msgspec.Struct):
        out = {"type": type(value).__name__, "module": type(value).__module__}
        out.update({k: _plain(v) for k, v in msgspec.structs.asdict(value).items()})
        return out
    if isinstance(value, bytes):
        return {"hex": value.hex()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def _frames(stream: Any) -> list[bytes]:
    frames = []
    while head := stream.read(4):
        frames.append(stream.read(int.from_bytes(head, "big")))
    return frames


def main() -> None:
    import msgspec

    engine = sys.argv[1]
    types = _engine_types(engine)
    decoder = msgspec.msgpack.Decoder(type=types.KVEventBatch)
    rank = "data_parallel_rank" if engine == "vllm" else "attn_dp_rank"
    if len(sys.argv) > 2:
        with open(sys.argv[2], "rb") as stream:
            frames = _frames(stream)
    else:
        frames = _frames(sys.stdin.buffer)
    for payload in frames:
        try:
            got = decoder.decode(payload)
        except msgspec.ValidationError as exc:
            print(json.dumps({"error": str(exc)}), flush=True)
            continue
        line = {"ts": got.ts, "dp_rank": getattr(got, rank), "events": _plain(got.events)}
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
