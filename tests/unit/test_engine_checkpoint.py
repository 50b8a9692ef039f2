import json
from pathlib import Path

import jinja2
import pytest
import torch
from conftest_engine import make_tiny_model

from engine.checkpoint import load_checkpoint, make_model
from engine.tokenizer import build_byte_level_tokenizer, load_tokenizer


def test_tokenizer_round_trips_arbitrary_utf8() -> None:
    tokenizer = build_byte_level_tokenizer()
    assert tokenizer.get_vocab_size() == 261
    text = "héllo wörld 😀 日本語 \x00\t\n  trailing "
    ids = tokenizer.encode(text).ids
    assert ids[:2] == [104, 195] and len(ids) == len(text.encode())
    assert tokenizer.decode(ids) == text


def test_special_tokens_are_single_ids() -> None:
    tokenizer = build_byte_level_tokenizer()
    ids = tokenizer.encode("<|begin_of_text|>hi<|eot_id|>").ids
    assert ids == [256, 104, 105, 260]
    assert tokenizer.decode(ids) == "hi"


def test_make_model_layout_and_determinism(tmp_path: Path) -> None:
    a = make_tiny_model(tmp_path / "a")
    b = make_tiny_model(tmp_path / "b")
    c = make_tiny_model(tmp_path / "c", seed=1)
    names = {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"}
    assert {p.name for p in a.iterdir()} == names
    weights = (a / "model.safetensors").read_bytes()
    assert weights == (b / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()
    config = json.loads((a / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["vocab_size"] == 261
    assert (config["bos_token_id"], config["eos_token_id"]) == (256, 260)
    assert load_tokenizer(a).get_vocab_size() == 261


def test_chat_template_renders_llama3_format(tmp_path: Path) -> None:
    model_dir = make_tiny_model(tmp_path)
    tokenizer_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    template = jinja2.Environment().from_string(tokenizer_config["chat_template"])
    text = template.render(
        messages=[{"role": "user", "content": "Hi "}],
        add_generation_prompt=True,
        bos_token="<|begin_of_text|>",
    )
    assert text == (
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    assert tokenizer_config["eos_token"] == "<|eot_id|>"


def test_load_checkpoint_reads_sharded_weights(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    model_dir = make_tiny_model(tmp_path)
    state = load_file(str(model_dir / "model.safetensors"))
    keys = sorted(state)
    save_file({k: state[k] for k in keys[:5]}, str(model_dir / "model-00001-of-00002.safetensors"))
    save_file({k: state[k] for k in keys[5:]}, str(model_dir / "model-00002-of-00002.safetensors"))
    (model_dir / "model.safetensors").unlink()
    config, loaded = load_checkpoint(model_dir)
    assert config.num_layers == 2 and config.num_kv_heads == 2 and config.head_dim == 16
    assert config.eos_token_id == 260 and config.max_model_len == 512
    assert loaded.keys() == state.keys() and all(torch.equal(loaded[k], state[k]) for k in keys)


def test_load_checkpoint_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_checkpoint(tmp_path)
    model_dir = make_model(tmp_path / "m", hidden_size=32, num_hidden_layers=1, intermediate_size=64)
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="architectures"):
        load_checkpoint(model_dir)
    (model_dir / "config.json").write_text(json.dumps(config))
    (model_dir / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_checkpoint(model_dir)
    with pytest.raises(ValueError, match="unknown shape keys"):
        make_model(tmp_path / "x", hidden=3)
