"""``kvconductor generate`` as a user runs it: a subprocess printing JSON; sampling, help and errors in-process."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest_engine import make_tiny_model

from cli.main import main
from engine.llm_engine import LLMEngine, generate
from engine.sampling import SamplingParams
from engine.tokenizer import load_tokenizer

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("model"))


def kvconductor(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "cli.main", *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False)


def test_generate_prints_json_with_the_engines_tokens(model_dir: Path) -> None:
    args = ["--model", str(model_dir), "--prompt", "Hello, world", "--max-tokens", "12", "--json"]
    result = kvconductor("generate", *args)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    tokenizer = load_tokenizer(model_dir)
    assert out["prompt_token_ids"] == tokenizer.encode("Hello, world", add_special_tokens=False).ids
    expected = generate(LLMEngine(model_dir, num_blocks=8), out["prompt_token_ids"], SamplingParams(12, 0.0))
    assert out["token_ids"] == expected and out["finish_reason"] in ("stop", "length")
    assert out["text"] == tokenizer.decode(expected, skip_special_tokens=True)


def test_generate_sampling_is_reproducible_with_a_seed_and_prints_text(model_dir: Path, capsys) -> None:
    args = ["generate", "--model", str(model_dir), "--prompt", "Hi", "--max-tokens", "8", "--temperature", "0.9",
            "--top-p", "0.9", "--seed", "5"]  # fmt: skip
    assert main(args) == 0
    first = capsys.readouterr().out
    assert first.strip()
    assert main(args) == 0
    assert capsys.readouterr().out == first


def test_generate_help_and_errors(model_dir: Path, capsys) -> None:
    with pytest.raises(SystemExit) as done:
        main(["generate", "--help"])
    assert done.value.code == 0
    help_text = capsys.readouterr().out
    for flag in ("--model", "--prompt", "--max-tokens", "--temperature", "--top-p", "--seed", "--json"):
        assert flag in help_text
    assert main(["generate", "--model", str(model_dir / "nope"), "--prompt", "x"]) == 1
    assert "no tokenizer.json" in capsys.readouterr().err
    assert main(["generate", "--model", str(model_dir), "--prompt", "x", "--top-p", "0"]) == 1
    assert "top_p" in capsys.readouterr().err
