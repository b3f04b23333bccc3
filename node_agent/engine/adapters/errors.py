"""What an adapter's refusals name: its two files, `AdapterLoadError`, and how a message quotes
an offending value.

Only `adapter_config.json` and `adapter_model.safetensors` are ever opened; every refusal is an
`AdapterLoadError` with one message naming the problem, and nothing is written to the engine
until the whole adapter is read.
"""

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


class AdapterLoadError(ValueError):
    """An adapter was refused; the message says why. The engine is unchanged."""


def shorten(text: str, limit: int = 300) -> str:
    """One line, at most `limit` characters (a message quotes the offending value)."""
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"
