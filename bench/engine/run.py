"""Engine vs. transformers on one checkpoint, in one process, with the same torch thread count.

Prefill: prompt tokens/s of a single prompt (128..4096 tokens) producing its first token:
``generate`` with max_tokens=1 on the engine (prefix cache off, the whole prompt in one
step) against ``model.generate(max_new_tokens=1)``; the best of ``--repeats`` runs.

Decode: generated tokens/s after the prompts are in. The engine decodes a batch of B
requests together (continuous batching, one forward per step); transformers runs the
same prompts one after another (``generate``, KV cache on), its decode time being
``generate(T tokens) - generate(1 token)`` per prompt. Sequential throughput does not
depend on B, so transformers is measured once, on the first ``--hf-decode-prompts``
prompts, and is the baseline of every batch size.

    .venv/bin/python -m bench.engine.run                  # table on stdout, progress on stderr
    .venv/bin/python -m bench.engine.run --json out.json  # also write the figures as JSON
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from engine.checkpoint import make_model
from engine.llm_engine import LLMEngine, generate
from engine.sampling import SamplingParams


def _parse_ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.engine.run", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", help="model folder (default: the generated default model, max length 8192)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads for BOTH engines (default 1)")
    parser.add_argument("--prompt-lens", type=_parse_ints, default=[128, 256, 512, 1024, 2048, 4096], help="prefill")
    parser.add_argument("--batches", type=_parse_ints, default=[1, 8, 16, 32], help="decode batch sizes")
    parser.add_argument("--decode-prompt-len", type=int, default=128, help="prompt tokens of each decode request")
    parser.add_argument("--decode-tokens", type=int, default=64, help="tokens generated per decode request")
    parser.add_argument("--hf-decode-prompts", type=int, default=16, help="prompts transformers decodes one by one")
    parser.add_argument("--repeats", type=int, default=2, help="prefill runs per length; the best counts")
    parser.add_argument("--json", type=Path, help="also write the results to this JSON file")
    return parser.parse_args(argv)


def _progress(message: str) -> None:
    print(f"[bench.engine] {message}", file=sys.stderr, flush=True)


def _prompt(length: int, seed: int, vocab: int) -> list[int]:
    return torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def _timed(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


class HFRunner:
    """transformers ``generate`` with greedy decoding and no early stop."""

    def __init__(self, model_dir: Path) -> None:
        import transformers

        self.model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()  # type: ignore[no-untyped-call]
        self.model.generation_config.eos_token_id = None
        self.model.generation_config.pad_token_id = 0

    def generate(self, prompt: list[int], num_tokens: int) -> None:
        with torch.inference_mode():
            self.model.generate(torch.tensor([prompt]), max_new_tokens=num_tokens, min_new_tokens=num_tokens)


def bench_prefill(engine: LLMEngine, hf: HFRunner, args: argparse.Namespace) -> list[dict[str, float]]:
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    rows = []
    for length in args.prompt_lens:
        prompt = _prompt(length, length, engine.config.vocab_size)
        ours = min(_timed(lambda p=prompt: generate(engine, p, one)) for _ in range(args.repeats))
        theirs = min(_timed(lambda p=prompt: hf.generate(p, 1)) for _ in range(args.repeats))
        rows.append({"prompt_tokens": length, "engine_tok_s": length / ours, "hf_tok_s": length / theirs})
        _progress(f"prefill {length}: engine {length / ours:.0f} tok/s, transformers {length / theirs:.0f} tok/s")
    return rows


def engine_decode(engine: LLMEngine, prompts: list[list[int]], num_tokens: int) -> float:
    """Decode tokens/s of the batch once every prompt has its first token."""
    params = SamplingParams(max_tokens=num_tokens, temperature=0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"decode-{i}", prompt, params)
    started: set[str] = set()
    while len(started) < len(prompts):
        started.update(out.request_id for out in engine.step())
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return len(prompts) * (num_tokens - 1) / (time.perf_counter() - start)


def hf_decode(hf: HFRunner, prompts: list[list[int]], num_tokens: int) -> float:
    """Decode tokens/s of transformers running the prompts one after another."""
    seconds = 0.0
    for prompt in prompts:
        seconds += _timed(lambda p=prompt: hf.generate(p, num_tokens)) - _timed(lambda p=prompt: hf.generate(p, 1))
    return len(prompts) * (num_tokens - 1) / seconds


def bench_decode(engine: LLMEngine, hf: HFRunner, args: argparse.Namespace) -> list[dict[str, float]]:
    vocab = engine.config.vocab_size
    prompts = [_prompt(args.decode_prompt_len, 1000 + i, vocab) for i in range(max(args.batches))]
    hf.generate(prompts[0], 4)  # warm-up
    baseline = hf_decode(hf, prompts[: args.hf_decode_prompts], args.decode_tokens)
    _progress(f"decode: transformers, {args.hf_decode_prompts} prompts one after another: {baseline:.0f} tok/s")
    rows = []
    for batch in args.batches:
        ours = engine_decode(engine, prompts[:batch], args.decode_tokens)
        rows.append({"batch": batch, "engine_tok_s": ours, "hf_sequential_tok_s": baseline})
        _progress(f"decode batch {batch}: engine {ours:.0f} tok/s")
    return rows


def _table(prefill: list[dict[str, float]], decode: list[dict[str, float]], threads: int) -> str:
    lines = [f"torch threads: {threads} (both engines)", "", "prefill (one prompt, first token)"]
    lines.append(f"{'prompt tokens':>14} {'engine tok/s':>13} {'transformers tok/s':>19} {'ratio':>6}")
    for r in prefill:
        ratio = r["engine_tok_s"] / r["hf_tok_s"]
        lines.append(f"{r['prompt_tokens']:>14.0f} {r['engine_tok_s']:>13.0f} {r['hf_tok_s']:>19.0f} {ratio:>6.2f}")
    lines += ["", "decode (engine: batch together; transformers: the prompts one after another)"]
    lines.append(f"{'batch':>6} {'engine tok/s':>13} {'transformers tok/s':>19} {'ratio':>6}")
    for r in decode:
        ratio = r["engine_tok_s"] / r["hf_sequential_tok_s"]
        lines.append(f"{r['batch']:>6.0f} {r['engine_tok_s']:>13.0f} {r['hf_sequential_tok_s']:>19.0f} {ratio:>6.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(args.model) if args.model else make_model(Path(tmp) / "model", max_position_embeddings=8192)
        _progress(f"model {model_dir}, {args.threads} torch thread(s)")
        hf = HFRunner(model_dir)
        longest = max(args.prompt_lens)
        engine = LLMEngine(
            model_dir,
            kv_cache_bytes=1 << 30,
            max_num_batched_tokens=max(longest, 2048),
            enable_prefix_caching=False,
        )
        generate(engine, _prompt(64, 0, engine.config.vocab_size), SamplingParams(max_tokens=2, temperature=0))
        prefill = bench_prefill(engine, hf, args)
        decode = bench_decode(engine, hf, args)
    print(_table(prefill, decode, args.threads))
    if args.json:
        result = {"threads": args.threads, "model": args.model or "generated default", "prefill": prefill}
        args.json.write_text(json.dumps({**result, "decode": decode}, indent=2) + "\n")
        _progress(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
