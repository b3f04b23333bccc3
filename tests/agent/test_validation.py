"""The one request check at the agent's boundary, on its own and through `lorafleet-agent forward`
(which drives the engine directly, so it must refuse what the agent refuses)."""

from __future__ import annotations

import json

import pytest

from node_agent.cli import main
from node_agent.errors import InvalidRequest
from node_agent.validation import check_adapter_name, check_forward, check_generate
from tests.agent.helpers import SHAPE, make_model

VOCAB = SHAPE.vocab_size


@pytest.mark.parametrize("name", ["", "../x", "a/b", "-lead", ".hidden", "x" * 254, "sp ace"])
def test_names_outside_the_rule_are_refused(name):
    with pytest.raises(InvalidRequest, match="invalid adapter name"):
        check_adapter_name(name)


@pytest.mark.parametrize("name", ["a", "A.b_c-9", "x" * 253])
def test_names_inside_the_rule_pass(name):
    check_adapter_name(name)


@pytest.mark.parametrize(
    "sequences, phrase",
    [
        ([], "at least one sequence"),
        ([[1], []], "sequence 1 has no tokens"),
        ([[VOCAB]], f"token id {VOCAB} outside the vocabulary [0, {VOCAB})"),
        ([[-1]], "token id -1 outside"),
        ([[1, "2"]], "token id '2' outside"),
        ([[1.5]], "token id 1.5 outside"),
        ([[True]], "token id True outside"),
    ],
)
def test_forward_batches_are_checked(sequences, phrase):
    with pytest.raises(InvalidRequest) as refused:
        check_forward(sequences, VOCAB)
    assert phrase in str(refused.value)


def test_request_sizes_are_bounded():
    check_forward([[1] * 10, [2] * 10], VOCAB, max_tokens=20)
    with pytest.raises(InvalidRequest, match="needs 21 tokens, over the limit of 20"):
        check_forward([[1] * 10, [2] * 11], VOCAB, max_tokens=20)
    with pytest.raises(InvalidRequest, match="needs 21 tokens"):
        check_generate([1] * 5, 16, limit=1024, vocab_size=VOCAB, max_tokens=20)
    with pytest.raises(InvalidRequest, match=r"max_new_tokens must be within \[1, 8\], got 9"):
        check_generate([1], 9, limit=8, vocab_size=VOCAB, max_tokens=100)


def test_the_forward_command_refuses_bad_input_with_one_line(tmp_path, capsys):
    model = make_model(tmp_path / "model", tokenizer=False)
    (tmp_path / "in.json").write_text(json.dumps([{"tokens": [1, VOCAB], "adapter": None}]))
    command = ["forward", "--model", str(model), "--input", str(tmp_path / "in.json"), "--output", str(tmp_path / "out.safetensors")]
    assert main([*command, "--adapter", f"../x={tmp_path}"]) == 1
    assert "error: invalid adapter name '../x'" in capsys.readouterr().err
    assert main(command) == 1
    err = capsys.readouterr().err.strip()
    assert err == f"lorafleet-agent: error: sequence 0 has token id {VOCAB} outside the vocabulary [0, {VOCAB})"
    assert not (tmp_path / "out.safetensors").exists()
