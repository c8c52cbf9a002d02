"""A model folder's chat template, rendered as transformers' `apply_chat_template` renders it (torch-free).

The template is the folder's `chat_template.jinja` (what transformers 5 saves) or the
`chat_template` of its `tokenizer_config.json` (a string, or named templates: `default` is used).
It is rendered in a sandboxed Jinja environment with transformers' settings (`trim_blocks`,
`lstrip_blocks`, `raise_exception`, `tojson`, `strftime_now`) and the tokenizer's special-token
strings (`bos_token`, `eos_token`, ...), with `add_generation_prompt` set: the text ends where the
assistant's answer begins. Its tokens are taken as they are (no BOS added): a template that wants
one writes it.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from pruneops.core.errors import ConfigError

TEMPLATE_FILE = "chat_template.jinja"
SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


class TemplateError(ValueError):
    """The template refused the messages (its `raise_exception`, or a render error): the request is at fault."""


def _special(value: object) -> str | None:
    if isinstance(value, dict):  # an AddedToken written out
        return value.get("content")
    return value if isinstance(value, str) else None


class ChatTemplate:
    """A chat template and the special-token strings it is rendered with."""

    def __init__(self, source: str, specials: dict[str, str]):
        from jinja2 import TemplateError as JinjaError
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(
            x, indent=indent, ensure_ascii=ensure_ascii
        )
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self.template = env.from_string(source)
        except JinjaError as exc:
            raise ConfigError(f"chat template: does not compile: {exc}") from None
        self.specials = specials

    def render(self, messages: list[dict[str, str]]) -> str:
        """The conversation as the model was trained to read it, up to the assistant's answer.

        Raises:
            TemplateError: The template refuses the conversation (e.g. roles out of order).
        """
        from jinja2 import TemplateError as JinjaError

        try:
            return self.template.render(messages=messages, add_generation_prompt=True, **self.specials)
        except TemplateError:
            raise
        except (JinjaError, TypeError, ValueError, KeyError, IndexError) as exc:
            raise TemplateError(f"the model's chat template cannot render these messages: {exc}") from None


def load_chat_template(folder: Path) -> ChatTemplate | None:
    """The folder's chat template, or None where it has none (chat completions are then refused).

    Raises:
        ConfigError: A template that is unreadable or does not compile.
    """
    folder = Path(folder)
    config_file = folder / "tokenizer_config.json"
    try:
        config = json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
        source = (folder / TEMPLATE_FILE).read_text(encoding="utf-8") if (folder / TEMPLATE_FILE).is_file() else None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"chat template: cannot read {folder}: {exc}") from None
    if source is None:
        source = config.get("chat_template")
        if isinstance(source, list):  # named templates
            source = next((t.get("template") for t in source if t.get("name") == "default"), None)
    if not isinstance(source, str) or not source:
        return None
    specials = {key: value for key in SPECIAL_KEYS if (value := _special(config.get(key))) is not None}
    return ChatTemplate(source, specials)
