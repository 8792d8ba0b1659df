"""One vLLM engine for scripts/bench vllm, driven by JSON lines on stdin.

Run with the vLLM venv's python, ``tests/e2e_vllm`` and the repository on PYTHONPATH::

    bench/vllm_worker.py MODEL --kind plain|fs|tierd|tierd-ev|tierd-desc|pool|own
                         [--socket S] [--fs-root D] [--events E] [--block-tokens N]
                         [--cpu-bytes B] [--max-model-len L] [--namespace N]
                         [--gpu-blocks G]

``pool`` is tierd's pool as vLLM's CPU tier (``TierdPoolSpec``), ``own`` vLLM's own CPU
tier alone, ``tierd`` vLLM's own CPU tier with tierd behind it.

``tierd-ev`` publishes vLLM's KV events through its zmq publisher bound at ``--events``
with tierd's tier not describing blocks; ``tierd-desc`` the same with the tier describing
each stored chunk to the daemon from those events (``describe_blocks``).

It prints ``{"ready": true}`` once the engine is built, then answers each command with
one JSON line:

- ``{"op": "gen", "prompts": [[ids...], ...]}``: one ``generate`` of every prompt with one
  output token (the prefill: TTFT); ``{"seconds", "cached": [num_cached_tokens, ...]}``,
  and for an engine with secondary tiers ``"tier"``: what their calls and jobs took during
  that ``generate`` (:class:`TierClock`, the same wrapper for vLLM's fs tier and tierd's);
- ``{"op": "reset"}``: ``reset_prefix_cache(reset_connector=True)`` (vLLM's prefix cache
  and its CPU tier emptied; secondary tiers kept); ``{"seconds", "ok"}``;
  ``{"op": "resetgpu"}`` the same with vLLM's CPU tier kept; ``{"op": "held"}``: the rows
  of vLLM's own CPU tier that hold a block, ``{"rows"}``;
- ``{"op": "settle"}``: three steps of a 4-token prompt (under a block: nothing stored),
  0.2 s apart, so that the stores of the last generate reach the secondary tiers. An
  idle offline engine takes no step: the copies of a generate's last request to vLLM's
  CPU tier finish after it, and their cascade to the secondary tiers is only submitted
  at the engine's next step. Without this, the next generate's first step looked those
  chunks up before they were written (one prompt of a burst served 320 of 2,048 tokens,
  from vLLM's fs tier and tierd alike); ``{"seconds"}``;
- ``{"op": "quit"}``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any


class TierClock:
    """Times vLLM's secondary tiers from outside, the same way for every tier (vLLM's fs
    tier, tierd's): each tier's methods are wrapped on the instance, on vLLM's scheduler
    thread, where vLLM's tiering manager calls them.

    - a job's wall time runs from just before ``submit_load`` / ``submit_store`` to the
      return of the ``get_finished_jobs`` that hands its result back (so it includes the
      wait for the manager's next poll, at most a scheduler step, as vLLM sees it);
    - ``transfer_time`` is what the tier itself reported in the job's ``JobResult``: the
      value vLLM's ``vllm:kv_offload_tiering_read_time`` / ``write_time`` counters add up
      (the fs tier: its pool thread's run of the job's one task; tierd: its load, done in
      ``submit_load``, or its store on its store thread);
    - ``sched`` is the time spent inside any of the tier's methods, which blocks vLLM's
      scheduler thread (lookups, submits, polls, ``on_schedule_end``);
    - a request's lookup wait runs from its first lookup in the tier to its last answer
      that was not RETRY (the tier's lookups are asynchronous: RETRY until resolved).
    """

    WRAPPED = ("lookup", "submit_load", "submit_store", "get_finished_jobs", "on_schedule_end")

    def __init__(self, tiers: list[Any]) -> None:
        self.tiers = tiers
        self._pending: dict[int, tuple[float, bool, int]] = {}  # job -> (submit, load, keys)
        self.clear()
        for tier in tiers:
            for name in self.WRAPPED:
                setattr(tier, name, self._wrap(name, getattr(tier, name)))

    def clear(self) -> None:
        self._jobs: list[tuple[bool, int, float, float, float | None, bool]] = []
        self._sched_s = 0.0
        self._lookups: dict[str, list[float]] = {}  # request -> [first, last resolved]

    def _wrap(self, name: str, method: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                result = method(*args, **kwargs)
                if name == "get_finished_jobs":
                    result = list(result)
                    self._finished(result, time.perf_counter())
                elif name == "lookup":
                    self._looked_up(args[1].req_id, start, result)
                return result
            finally:
                self._sched_s += time.perf_counter() - start
                if name in ("submit_load", "submit_store"):
                    job = args[0]
                    self._pending[job.job_id] = (start, name == "submit_load", len(job.keys))

        return call

    def _looked_up(self, request: str, start: float, result: Any) -> None:
        span = self._lookups.setdefault(request, [start, start])
        if getattr(result, "name", "") != "RETRY":
            span[1] = time.perf_counter()

    def _finished(self, results: list[Any], now: float) -> None:
        for done in results:
            pending = self._pending.pop(done.job_id, None)
            if pending is None:
                continue
            submitted, is_load, keys = pending
            self._jobs.append(
                (is_load, keys, submitted, now, done.transfer_time, bool(done.success))
            )

    def figures(self) -> dict[str, Any]:
        """What the tiers' calls and jobs took since :meth:`clear` (seconds)."""
        out: dict[str, Any] = {"sched_s": self._sched_s}
        for kind, is_load in (("load", True), ("store", False)):
            jobs = [j for j in self._jobs if j[0] == is_load]
            out[f"{kind}s"] = len(jobs)
            out[f"{kind}_keys"] = sum(j[1] for j in jobs)
            out[f"{kind}_failed"] = sum(1 for j in jobs if not j[5])
            out[f"{kind}_wall_s"] = sum(j[3] - j[2] for j in jobs)
            out[f"{kind}_span_s"] = (
                max(j[3] for j in jobs) - min(j[2] for j in jobs) if jobs else 0.0
            )
            out[f"{kind}_tier_s"] = sum(j[4] or 0.0 for j in jobs)
        out["lookup_wait_s"] = sum(last - first for first, last in self._lookups.values())
        out["lookup_requests"] = len(self._lookups)
        return out


def tier_clock(llm: Any) -> TierClock | None:
    """A clock on the secondary tiers of ``llm``'s tiering manager (vLLM's private
    fields, read for these figures only); None for an engine with none."""
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    connector = getattr(scheduler, "connector", None)
    manager = getattr(getattr(connector, "connector_scheduler", None), "manager", None)
    tiers = list(getattr(manager, "secondary_tiers", None) or [])
    return TierClock(tiers) if tiers else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    kinds = ("plain", "fs", "tierd", "tierd-ev", "tierd-desc", "pool", "own")
    parser.add_argument("--kind", choices=kinds, required=True)
    parser.add_argument("--namespace", help="a prefix of tierd's namespace (tierd, pool)")
    parser.add_argument("--gpu-blocks", type=int, default=0, help="vLLM's own KV cache blocks")
    parser.add_argument("--events", help="vLLM's KV events endpoint (the -ev/-desc kinds)")
    parser.add_argument("--socket")
    parser.add_argument("--fs-root")
    parser.add_argument("--block-tokens", type=int, default=32)
    parser.add_argument("--cpu-bytes", type=int, default=256 << 20)
    parser.add_argument("--max-model-len", type=int, default=2176)
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")  # vLLM logs to stdout otherwise
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import run_engine
    from vllm import SamplingParams, TokensPrompt

    options = argparse.Namespace(
        model=args.model,
        socket=args.socket if args.kind.startswith("tierd") or args.kind == "pool" else None,
        pool=args.kind == "pool",
        gpu_blocks=args.gpu_blocks,
        fs_root=args.fs_root if args.kind == "fs" else None,
        plain=args.kind == "plain",
        # The two describe-mode kinds share one daemon and one model: each its own
        # namespace, or the second would be served the first one's stores.
        namespace=args.namespace
        or (
            f"bench-{os.path.basename(args.model)}-{args.kind}"
            if args.kind in ("tierd-ev", "tierd-desc")
            else None
        ),
        cpu_bytes=args.cpu_bytes,
        max_model_len=args.max_model_len,
        block_tokens=args.block_tokens,
        kv_events_endpoint=args.events if args.kind in ("tierd-ev", "tierd-desc") else None,
        describe_blocks={"tierd-ev": False, "tierd-desc": True}.get(args.kind),
    )
    llm = run_engine.engine(options)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    clock = tier_clock(llm)
    out = sys.stdout
    out.write(json.dumps({"ready": True}) + "\n")
    out.flush()
    for line in sys.stdin:
        command: dict[str, Any] = json.loads(line)
        op = command["op"]
        if op == "quit":
            break
        if clock is not None:
            clock.clear()
        start = time.perf_counter()
        if op == "gen":
            prompts = [TokensPrompt(prompt_token_ids=ids) for ids in command["prompts"]]
            results = llm.generate(prompts, params, use_tqdm=False)
            answer: dict[str, Any] = {"cached": [r.num_cached_tokens for r in results]}
            if clock is not None:
                answer["tier"] = clock.figures()
        elif op == "settle":
            for _ in range(3):
                llm.generate([TokensPrompt(prompt_token_ids=[5, 6, 7, 8])], params, use_tqdm=False)
                time.sleep(0.2)
            answer = {}
        elif op == "reset":
            answer = {"ok": bool(llm.reset_prefix_cache(reset_connector=True))}
        elif op == "resetgpu":  # vLLM's prefix cache only: its CPU tier (or tierd's) kept
            answer = {"ok": bool(llm.reset_prefix_cache(reset_connector=False))}
        elif op == "held":  # rows vLLM's own CPU tier holds a block in (0: it has none)
            answer = {"rows": own_cpu_rows(llm)}
        else:
            answer = {"error": f"unknown op {op!r}"}
        answer["seconds"] = time.perf_counter() - start
        out.write(json.dumps(answer) + "\n")
        out.flush()
    return 0


def own_cpu_rows(llm: Any) -> int:
    """Rows of vLLM's own CPU tier that hold a block (its manager's books: vLLM's private
    fields, read for this figure only); 0 for an engine with no CPU tier of its own."""
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    connector = getattr(scheduler, "connector", None)
    manager = getattr(getattr(connector, "connector_scheduler", None), "manager", None)
    primary = getattr(manager, "primary_tier", None)
    if primary is None:
        return 0
    return int(primary._num_allocated_chunks - len(primary._free_list))


if __name__ == "__main__":
    sys.exit(main())
