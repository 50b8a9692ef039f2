"""Chat prompts: the model's own Jinja chat template, or a plain fallback.

The template is ``chat_template.jinja`` in the model folder (what transformers 5 writes), else the
``chat_template`` of ``tokenizer_config.json`` (older folders).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplate:
    """Renders a list of {role, content} messages into the prompt text the model was trained on."""

    def __init__(self, model_dir: str | Path) -> None:
        path = Path(model_dir) / "tokenizer_config.json"
        config = json.loads(path.read_text()) if path.exists() else {}
        self.special = {k: _token_text(config.get(k)) for k in ("bos_token", "eos_token")}
        jinja = Path(model_dir) / "chat_template.jinja"
        source = jinja.read_text() if jinja.is_file() else config.get("chat_template")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        self.template = env.from_string(source) if isinstance(source, str) else None

    def render(self, messages: Sequence[dict[str, str]]) -> str:
        """The prompt for ``messages``, ending where the assistant's reply starts."""
        if self.template is None:
            lines = [f"{m['role']}: {m['content']}" for m in messages]
            return "\n".join([*lines, "assistant:"])
        try:
            return self.template.render(messages=list(messages), add_generation_prompt=True, **self.special)
        except TemplateError as e:
            raise ValueError(f"the model's chat template rejected the messages: {e}") from e


def _token_text(token: object) -> str:
    if isinstance(token, dict):
        return str(token.get("content", ""))
    return token if isinstance(token, str) else ""
