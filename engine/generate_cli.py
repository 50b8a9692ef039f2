"""``kvconductor generate``: run one prompt through the engine in this process, no cluster.

The prompt is tokenized as the Conductor does (no special tokens added), generated
with the engine's sampler, and printed as text, or as JSON with the token ids. The
flags are defined with the other subcommands in ``cli/main.py``: ``model``,
``prompt``, ``max_tokens``, ``temperature``, ``top_p``, ``seed``, ``dtype``, ``json``.
"""

import argparse
import json
import sys

from engine.llm_engine import LLMEngine, generate
from engine.sampling import SamplingParams
from engine.tokenizer import load_tokenizer


def main(args: argparse.Namespace) -> int:
    """Generate for ``args.prompt`` and print the result; returns the exit status."""
    tokenizer = load_tokenizer(args.model)
    prompt = tokenizer.encode(args.prompt, add_special_tokens=False).ids
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed)
    block_size = 16
    engine = LLMEngine(args.model, num_blocks=-(-(len(prompt) + params.max_tokens) // block_size), dtype=args.dtype)
    tokens = generate(engine, prompt, params)
    text = tokenizer.decode(tokens, skip_special_tokens=True)
    if args.json:
        finish_reason = "stop" if tokens[-1] in engine.config.eos_token_ids else "length"
        result = {"prompt_token_ids": prompt, "token_ids": tokens, "text": text, "finish_reason": finish_reason}
        json.dump(result, sys.stdout)
        sys.stdout.write("\n")
    else:
        print(text)
    return 0
