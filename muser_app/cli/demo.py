"""`muser demo`: the README's first command.

Builds (or reuses) the pair (`--pair`, default smollm2: the real SmolLM2-135M-Instruct),
writes a throwaway cluster (keys, config) in a temporary directory, qualifies its lane against
plain decode (`muser qualify`: the verifier refuses an unqualified lane), starts the verifier
and the proposer daemons on loopback, and streams the prompts with the text appearing as
rounds commit: on the real pair a chat request through the OpenAI-compatible HTTP API (the
model's own chat template) and a code continuation, in turn; on the toy pair stdlib code.
Then it decodes the same prompts with the target alone, prints a table, and shuts everything
down — also on Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import replace
from pathlib import Path


def _int_in(low: int, high: int | None = None):
    """An argparse type: an integer in [low, high]; anything else is refused (exit 2) before
    the demo builds, qualifies or starts anything."""
    expected = f"an integer >= {low}" if high is None else f"an integer from {low} to {high}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return value

    parse.__name__ = expected  # what argparse names in its own messages
    return parse


def register(sub, name: str, help_text: str) -> None:
    p = sub.add_parser(name, help=help_text, description=help_text)
    from muser_app.cli._common import add_pair_args

    add_pair_args(p)
    p.add_argument(
        "--prompts",
        type=_int_in(1),
        default=2,
        help="prompts to stream (default 2; on the real pair chat and code in turn)",
    )
    p.add_argument(
        "--max-tokens", type=_int_in(1), default=128, help="tokens per prompt (default 128)"
    )
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument(
        "--seed", type=int, default=0, help="seed of the sampled generations (default 0)"
    )
    p.add_argument(
        "--draft-len", type=_int_in(0, 64), default=4, help="drafts per round D (default 4)"
    )
    p.add_argument(
        "--keep",
        type=Path,
        default=None,
        help="write the cluster (keys, config, WALs, logs) here and keep it",
    )
    p.set_defaults(func=run)


def say(text: str) -> None:
    print(f"\n== {text}", file=sys.stderr, flush=True)


def check_sampling(args: argparse.Namespace) -> None:
    """Refuse the sampling flags before any work: prompt i is sampled with seed + i."""
    from muser.sampling import SamplingParams

    for seed in (args.seed, args.seed + args.prompts - 1):
        SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=seed)


def run(args: argparse.Namespace) -> int:
    check_sampling(args)
    if args.keep is not None:
        return _demo(args, args.keep)
    with tempfile.TemporaryDirectory(prefix="muser-demo-") as tmp:
        return _demo(args, Path(tmp))


def _demo(args: argparse.Namespace, workdir: Path) -> int:
    from muser_app.cli._common import pair_models

    say("the pair (built once, then cached)")
    models = pair_models(args)
    target_dir, draft_dir = models.target, models.draft
    say(f"pair {models.pair}: target {target_dir}, draft {models.draft_kind} ({draft_dir})")

    from transformers import AutoTokenizer

    from cluster_config import load_config
    from muser.affinity import pinned
    from muser.sampling import SamplingParams
    from muser_app.cli.cluster_client import stream_generate
    from muser_app.cli.config import init_cluster
    from muser_app.cli.qualify import qualify
    from muser_app.lanes.plain import run_plain
    from muser_app.pairs import pair_prompts
    from muser_app.procs import Daemon
    from verifier_gx.backends import load_target_backend

    tokenizer = AutoTokenizer.from_pretrained(str(target_dir))
    say(f"cluster: keys and cluster.toml in {workdir}")
    config = init_cluster(
        workdir,
        target=target_dir,
        draft=draft_dir,
        draft_backend=models.draft_backend,
        draft_len=args.draft_len,
        force=True,
    )
    say(f"qualify: the lane against plain decode, then a signed receipt in {workdir}")
    receipt = qualify(  # two prompts: the least that shows code and chat on the real pair
        load_config(config), pair_prompts(models.pair, 2, tokenizer), progress=True
    )
    e = receipt.evidence
    print(
        f"qualified: {e.prompts} prompts x {e.tokens_per_prompt} greedy tokens identical, "
        f"acceptance {e.acceptance:.3f}",
        file=sys.stderr,
    )
    daemons = [Daemon("verifier", config, workdir), Daemon("proposer", config, workdir)]
    rows = []
    try:
        for daemon in daemons:
            say(f"starting the {daemon.role} daemon (log: {daemon.log_path})")
            daemon.start()
        proposer = load_config(config).proposer
        target = load_target_backend("torch", target_dir)
        for i, (kind, text) in enumerate(demo_prompts(models.pair, args.prompts, tokenizer)):
            params = SamplingParams(
                temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed + i
            )
            with pinned(proposer.cpus, "proposer.cpus"):  # the client, on the proposer's CPUs
                if kind == "chat":
                    say(
                        f"prompt {i + 1}/{args.prompts}: a chat request through the HTTP API "
                        f"(POST http://{proposer.http}/v1/chat/completions)"
                    )
                    print(f"user: {text}\nassistant: ", end="")
                    params = replace(params, stop_tokens=(int(tokenizer.eos_token_id),))
                    prompt, result = chat_stream(proposer.http, text, params, tokenizer, write)
                else:
                    say(
                        f"prompt {i + 1}/{args.prompts}: the cluster streams each round as it "
                        "commits"
                    )
                    write(text)
                    prompt = list(tokenizer.encode(text, add_special_tokens=False))
                    result = stream_generate(
                        proposer.address, prompt, params, on_event=lambda e: write(e.text)
                    )
            target.reset()
            plain = run_plain(target, prompt, params)
            if kind == "chat":  # the API sends text, decoded without special tokens
                same = tokenizer.decode(plain.tokens, skip_special_tokens=True) == result["text"]
                result["tokens_count"] = result["completion_tokens"]
            else:
                same = plain.tokens == result["tokens"]
                result["tokens_count"] = len(result["tokens"])
            rows.append((result, plain, same))
            print()
    except KeyboardInterrupt:
        say("interrupted: stopping the daemons")
        return 130
    finally:
        for daemon in reversed(daemons):
            daemon.stop()
    _table(rows, args.temperature == 0)
    if args.temperature == 0 and not all(same for _, _, same in rows):
        print("ERROR: the cluster's greedy output differs from plain decode", file=sys.stderr)
        return 1
    return 0


def _table(rows, greedy: bool) -> None:
    from muser_app.cli._common import stats_table

    tokens = sum(r["tokens_count"] for r, _, _ in rows)
    wall = sum(r["stats"]["client_wall_s"] for r, _, _ in rows)
    plain_tokens = sum(len(p.tokens) for _, p, _ in rows)
    plain_wall = sum(p.stats.wall_s for _, p, _ in rows)
    drafted = sum(r["stats"]["drafted"] for r, _, _ in rows)
    accepted = sum(r["stats"]["accepted"] for r, _, _ in rows)
    rounds = sum(r["stats"]["rounds"] for r, _, _ in rows)
    split = {  # the gRPC client's statistics carry the split; the HTTP API's do not
        k: sum(r["stats"]["split_s"][k] for r, _, _ in rows if "split_s" in r["stats"])
        for k in ("draft", "transport", "verify", "wal", "sign")
    }
    cluster_rate, plain_rate = tokens / wall, plain_tokens / plain_wall
    say("statistics")
    print(
        stats_table(
            [
                ("cluster (2 daemons, loopback)", f"{cluster_rate:.1f} tok/s"),
                ("plain target decode", f"{plain_rate:.1f} tok/s"),
                ("cluster / plain", f"{cluster_rate / plain_rate:.2f}×"),
                (
                    "acceptance",
                    f"{accepted / drafted:.3f} ({accepted}/{drafted})" if drafted else "-",
                ),
                ("tokens per round", f"{tokens / rounds:.2f} (includes the next frontier)"),
                (
                    "round split (gRPC prompts)",
                    ", ".join(f"{k} {v:.2f}s" for k, v in split.items()),
                ),
                (
                    "exactness",
                    "greedy output identical to plain decode"
                    if greedy and all(s for _, _, s in rows)
                    else "sampled (same distribution)",
                ),
            ]
        )
    )


CODE_PROMPT = "def merge_sorted(left: list[int], right: list[int]) -> list[int]:\n"
"""The real pair's code continuation (a function every code model has seen written)."""


def write(piece: str) -> None:
    sys.stdout.write(piece)
    sys.stdout.flush()


def demo_prompts(pair: str, n: int, tokenizer) -> list[tuple[str, str]]:
    """(kind, text) for each prompt: on the real pair chat requests and code in turn, on the
    toy pair held-out stdlib code."""
    from muser_app.fixtures import natural_prompts
    from muser_app.fixtures.texts import CHAT_REQUESTS, heldout_prompts

    if pair == "toy":
        return [("code", text) for text in natural_prompts(n)]
    chats = list(CHAT_REQUESTS)
    code = [CODE_PROMPT, *heldout_prompts("code", n, tokenizer)]
    return [("chat", chats[i // 2]) if i % 2 == 0 else ("code", code[i // 2]) for i in range(n)]


def chat_stream(http: str, request: str, params, tokenizer, write) -> tuple[list[int], dict]:
    """One chat request through the proposer's OpenAI-compatible API, streamed: the prompt as
    the API renders it (the model's chat template) and the result in `stream_generate`'s
    shape (tokens re-encoded from the text the API sent, its statistics from `muser`)."""
    from proposer_mac.openai_request import chat_prompt

    messages = [{"role": "user", "content": request}]
    with urllib.request.urlopen(f"http://{http}/v1/models", timeout=60) as resp:
        model = json.load(resp)["data"][0]["id"]  # the name the API serves the target under
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": params.max_tokens,
        "temperature": params.temperature,
        "seed": params.seed,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    post = urllib.request.Request(
        f"http://{http}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    texts, stats, usage = [], {}, {}
    start = time.perf_counter()
    try:
        resp = urllib.request.urlopen(post, timeout=600)
    except urllib.error.HTTPError as exc:
        raise RuntimeError(
            f"the proposer's HTTP API refused the demo's chat request ({exc.code}): "
            f"{exc.read().decode(errors='replace')}"
        ) from exc
    with resp:
        for line in resp:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            event = json.loads(line[6:])
            for choice in event.get("choices", []):
                piece = choice.get("delta", {}).get("content") or ""
                texts.append(piece)
                write(piece)
            stats = event.get("muser", stats)
            usage = event.get("usage", usage)
    wall = time.perf_counter() - start
    prompt = list(tokenizer.encode(chat_prompt(tokenizer, messages), add_special_tokens=False))
    return prompt, {
        "text": "".join(texts),
        "completion_tokens": usage.get("completion_tokens", 0),
        "stats": {**stats, "client_wall_s": wall},
    }
