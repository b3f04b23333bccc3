"""Adapter names in an agent's registry: the one rule the agents enforce and the operator's names obey.

A name is letters, digits, ``.``, ``_`` and ``-``, starting with a letter or digit, at most
`MAX_NAME_LENGTH` characters. The agent refuses any other name (`node_agent.validation`); the
operator names a LoraAdapter ``<namespace>.<name>`` inside it and bounds the LoraAdapter's own
name so that the longest namespace still fits (`lorafleet_operator.names`, and the LoraAdapter
CRD's CEL rule, which a test keeps equal to it: YAML cannot import this).
"""

from __future__ import annotations

import re

MAX_NAME_LENGTH = 253
# \Z, not $: "$" would also match before a trailing newline.
ADAPTER_NAME = re.compile(rf"^[A-Za-z0-9][A-Za-z0-9._-]{{0,{MAX_NAME_LENGTH - 1}}}\Z")


def is_adapter_name(name: str) -> bool:
    """Whether an agent's registry can hold an adapter under `name`."""
    return ADAPTER_NAME.match(name) is not None
