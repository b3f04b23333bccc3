"""Chat templates: a model directory's Jinja template, rendered as `transformers` renders it.

The template comes from `chat_template.jinja` in the model directory, else from the
`chat_template` entry of `tokenizer_config.json` (a string, or a list of named templates of
which the one named "default" is used). Templates are untrusted code, so they run in Jinja's
`ImmutableSandboxedEnvironment` with what `transformers.apply_chat_template` gives them and
nothing more: `messages`, `add_generation_prompt`, the named special tokens (`bos_token`,
`eos_token`, ...), `raise_exception`, `strftime_now`, a JSON `tojson` filter, loop controls, and
`dict` / `namespace` without access to private attributes.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
# transformers' SPECIAL_TOKENS_ATTRIBUTES: the special tokens a template sees by name.
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class ChatTemplateError(ValueError):
    """The template could not be read or refused to render these messages (its message says why)."""


class ChatTemplate:
    """One compiled chat template and the special tokens it is rendered with."""

    def __init__(self, source: str, special_tokens: Mapping[str, str]) -> None:
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateError as error:
            raise ChatTemplateError(f"the model's chat template does not compile: {error}") from None
        self.special_tokens = dict(special_tokens)

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> str:
        """The prompt text of `messages`; keys whose value is None are dropped, as transformers does."""
        plain = [{key: value for key, value in message.items() if value is not None} for message in messages]
        try:
            return self._template.render(messages=plain, add_generation_prompt=add_generation_prompt, **self.special_tokens)
        except jinja2.TemplateError as error:
            raise ChatTemplateError(f"the model's chat template refused the messages: {error}") from None


def load_chat_template(model_dir: Path) -> ChatTemplate | None:
    """The model directory's chat template, or None when it has none."""
    model_dir = Path(model_dir)
    config = _tokenizer_config(model_dir)
    template_file = model_dir / TEMPLATE_FILE
    if template_file.is_file():
        source: object = template_file.read_text()
    else:
        source = config.get("chat_template")
        if isinstance(source, list):  # named templates: [{"name": ..., "template": ...}, ...]
            source = next((item.get("template") for item in source if isinstance(item, dict) and item.get("name") == "default"), None)
    if source is None:
        return None
    if not isinstance(source, str):
        raise ChatTemplateError(f"{model_dir / TOKENIZER_CONFIG_FILE}: chat_template must be a string")
    return ChatTemplate(source, _special_tokens(config))


def _tokenizer_config(model_dir: Path) -> dict[str, Any]:
    path = model_dir / TOKENIZER_CONFIG_FILE
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ChatTemplateError(f"{path} is not valid JSON: {error}") from None
    if not isinstance(config, dict):
        raise ChatTemplateError(f"{path} must hold a JSON object")
    return config


def _special_tokens(config: Mapping[str, Any]) -> dict[str, str]:
    """Named special tokens from tokenizer_config.json: a string, or an added token {"content": ...}."""
    tokens = {}
    for name in SPECIAL_TOKENS:
        value = config.get(name)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            tokens[name] = value
    return tokens


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: tuple[str, str] | None = None, sort_keys: bool = False
) -> str:
    # Jinja's own tojson escapes HTML characters; templates expect plain JSON.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format_: str) -> str:
    return datetime.now().strftime(format_)


class _Dict:
    """`dict` for templates: building dicts only, no attribute access to the type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """Jinja's `namespace` refusing underscore-prefixed attributes (no reach into internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # Jinja's signature trick: `namespace(self=...)` works
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)


def _check_name(name: object) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(f"chat templates cannot store underscore-prefixed attributes, got {name!r}")


def _environment() -> ImmutableSandboxedEnvironment:
    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    environment.globals["dict"] = _Dict()
    environment.globals["namespace"] = _Namespace
    return environment
