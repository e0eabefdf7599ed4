"""bench_peers' rows of one engine at one precision: served (its OpenAI /v1/completions, streamed,
at each concurrency, through serving_load) and offline (peers_offline.py in the engine's own
interpreter), each with the engine's greedy probe against transformers'. A row that could not
be measured comes back with a note saying why, never as a missing row.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import bench_common as bc
import peers_engines as pe
from serving_load import GatewayDoor, Record, run_point, summarize


class CompletionsDoor(GatewayDoor):
    """serving_load's gateway door, with a count of the streamed chunks for a server whose stream
    leaves the usage out (each chunk of a completion stream carries one token)."""

    @staticmethod
    def _event(event: bytes, record: Record) -> bool:
        if b'"choices"' in event and b'"choices":[]' not in event.replace(b" ", b""):
            record.seen = getattr(record, "seen", 0) + 1
        return GatewayDoor._event(event, record)

    async def send(self, request: bc.Request, record: Record) -> None:
        await super().send(request, record)
        if not record.output_tokens:
            record.output_tokens = getattr(record, "seen", 0)


def agreement(got: list | str, want: list | str, bf16: list | str | None = None) -> str:
    """'same', or how far `got` and `want` agree (tokens for id lists, characters for text); for
    a bf16 row (`bf16`: transformers' own tokens in bf16) its agreement with those where that
    is the longer: 'same as bf16', or 'N/M ... of bf16'."""
    if got == want:
        return "same"
    unit = "chars" if isinstance(want, str) else "tokens"
    agreed = _common_prefix(got, want)
    if bf16 is not None and _common_prefix(got, bf16) > agreed:
        if got == bf16:
            return "same as bf16"
        return f"{_common_prefix(got, bf16)}/{len(bf16)} {unit} of bf16"
    return f"{agreed}/{len(want)} {unit}"


def _common_prefix(a: list | str, b: list | str) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def probe_text(port: int, prompt: list[int], tokens: int) -> str:
    """The server's greedy completion of `tokens` tokens after `prompt`, not streamed."""
    model_id = pe.http_json(port, "/v1/models")["data"][0]["id"]
    body = {"model": model_id, "prompt": prompt, "max_tokens": tokens, "temperature": 0.0}
    body["ignore_eos"] = True
    return pe.http_json(port, "/v1/completions", body)["choices"][0]["text"]


def served_workload(args, concurrency: int, vocab: int) -> list[bc.Request]:
    """The point's prompts: the same for every engine, others at another concurrency."""
    seed = args.seed + 1 + args.concurrency.index(concurrency)
    return bc.workload_from_flags(args, args.num_requests, vocab, seed)


def offline_workload(args, prompts: int, vocab: int) -> list[bc.Request]:
    return bc.workload_from_flags(args, prompts, vocab, args.seed + 100 + prompts)


def unmeasured(mode: str, loads: list[int], note: str) -> list[dict]:
    """Rows that say why they have no figures."""
    key = "concurrency" if mode == "serve" else "prompts"
    return [
        {"mode": mode, "load": load_name(mode, n), key: n, "note": note.splitlines()[0]}
        for n in loads
    ]


def load_name(mode: str, n: int) -> str:
    return f"c={n}" if mode == "serve" else f"{n} prompts"


async def serve_points(port: int, concurrencies: list[int], args, vocab: int) -> list[dict]:
    door = CompletionsDoor("127.0.0.1", port)
    await door.open()
    warm = [bc.Request([7] * 16, 4), bc.Request([8] * 16, 4)]  # shares no prefix below
    await run_point(door, warm, None, None, args.seed)
    rows = []
    for c in concurrencies:
        workload = served_workload(args, c, vocab)
        records = await run_point(door, workload, None, c, args.seed)
        row = {"mode": "serve", "load": load_name("serve", c), "concurrency": c}
        row.update(summarize(records))
        row["short"] = sum(
            1
            for r, q in zip(records, workload)
            if r.error is None and r.output_tokens < q.output_len
        )
        rows.append(row)
        failed = f", {row['failed']} failed: {row.get('first_error')}" if row["failed"] else ""
        print(
            f"    c={c}: {row['output_throughput']:.1f} tok/s, TTFT p50 {row['ttft_p50_ms']:.0f} "
            f"ms, ITL p50 {row['itl_p50_ms']:.1f} ms{failed}",
            flush=True,
        )
    return rows


def serve_rows(
    engine: str, precision: str, model_dir: Path, reference, args, vocab: int, tmp: Path
) -> list[dict]:
    """One engine at one precision at every concurrency: one start (llama.cpp: one a point, its
    slots are the concurrency)."""
    groups = [[c] for c in args.concurrency] if engine == "llama.cpp" else [args.concurrency]
    bf16_text = reference.bf16_text if precision == "bf16" else None
    label = bc.model_label(args.model)
    rows, greedy = [], None
    for group in groups:
        print(f"  {engine} {precision}: serving ...", flush=True)
        try:
            server = pe.start_server(engine, precision, model_dir, label, max(group), args, tmp)
        except Exception as exc:  # noqa: BLE001 - the row says why
            print(f"    did not start: {exc}", flush=True)
            rows += unmeasured("serve", group, f"did not start: {exc}")
            continue
        try:
            print(f"    ready in {server.startup_s:.1f} s", flush=True)
            if greedy is None:
                text = probe_text(server.port, reference.prompt, len(reference.ids))
                greedy = agreement(text, reference.text, bf16_text)
            for row in asyncio.run(serve_points(server.port, group, args, vocab)):
                rows.append({**row, "startup_s": server.startup_s, "greedy": greedy})
        except Exception as exc:  # noqa: BLE001
            print(f"    failed: {exc}\n{server.tail()}", flush=True)
            rows += unmeasured("serve", group, f"failed: {exc}")
        finally:
            server.stop()
    return rows


def offline_rows(
    engine: str, precision: str, model_dir: Path, reference, args, vocab: int, tmp: Path
) -> list[dict]:
    """One engine's offline LLM at one precision on each prompt count, one start for all."""
    loads = args.offline_prompts
    workloads = [offline_workload(args, n, vocab) for n in loads]
    job = {
        "probe": reference.prompt,
        "probe_tokens": len(reference.ids),
        "workloads": [
            {"prompts": [r.prompt_ids for r in w], "output_lens": [r.output_len for r in w]}
            for w in workloads
        ],
    }
    print(f"  {engine} {precision}: offline ...", flush=True)
    try:
        result = pe.run_offline(engine, precision, model_dir, job, args, tmp)
    except Exception as exc:  # noqa: BLE001 - the rows say why
        print(f"    {exc}", flush=True)
        return unmeasured("offline", loads, f"failed: {exc}")
    rows = []
    for n, run in zip(loads, result["runs"]):
        rows.append(
            {
                "mode": "offline",
                "load": load_name("offline", n),
                "prompts": n,
                "requests": n,
                "output_throughput": run["output_tokens"] / run["wall_s"],
                "duration_s": run["wall_s"],
                "short": run["short"],
                "startup_s": result["startup_s"],
                "greedy": agreement(
                    result["probe_ids"],
                    reference.ids,
                    reference.bf16_ids if precision == "bf16" else None,
                ),
            }
        )
        print(f"    {n} prompts: {rows[-1]['output_throughput']:.1f} tok/s", flush=True)
    return rows
