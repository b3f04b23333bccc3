"""Chat templates (node_agent.chat_template) render exactly as transformers' apply_chat_template,
on tiny tokenizers made here; the sandbox refuses what transformers' sandbox refuses."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from node_agent.chat_template import ChatTemplateError, load_chat_template
from tests.agent.helpers import write_tokenizer
from tests.http.conftest import CHAT_TEMPLATE, write_chat_template
from tests.support.models import quiet_transformers

# The shape of real models' templates: a namespace carried through a loop, loop controls, tojson,
# the system message handled apart, and a refusal for roles out of order.
CHATML = """{%- set ns = namespace(system='') -%}
{%- for message in messages -%}
  {%- if message['role'] == 'system' -%}{%- set ns.system = message['content'] -%}{%- continue -%}{%- endif -%}
  {%- if loop.index0 == 0 and ns.system -%}<|im_start|>system
{{ ns.system }}<|im_end|>
{% endif -%}
  {%- if message['role'] not in ['user', 'assistant'] -%}{{ raise_exception('roles must be user or assistant') }}{%- endif -%}
<|im_start|>{{ message['role'] }}
{{ message['content'] }}{% if message.get('name') %} {{ message['name'] | tojson }}{% endif %}<|im_end|>
{% endfor -%}
{%- if add_generation_prompt -%}<|im_start|>assistant
{% endif -%}"""

CONVERSATIONS = [
    [{"role": "user", "content": "w7 w8"}],
    [
        {"role": "system", "content": "w3 w3"},
        {"role": "user", "content": "w10"},
        {"role": "assistant", "content": "w11 w12"},
        {"role": "user", "content": "w13 ü"},
    ],
    [{"role": "user", "content": "w5", "name": 'ann "q"'}],
]


def hf_tokenizer(model: Path):
    quiet_transformers()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model))


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    write_tokenizer(tmp_path)
    return tmp_path


@pytest.mark.parametrize("template", [CHAT_TEMPLATE, CHATML], ids=["words", "chatml"])
@pytest.mark.parametrize("conversation", CONVERSATIONS, ids=["one", "system-turns", "name"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_renders_as_transformers(model_dir, template, conversation, add_generation_prompt):
    write_chat_template(model_dir, template)
    ours = load_chat_template(model_dir)
    assert ours is not None
    reference = hf_tokenizer(model_dir)
    expected = reference.apply_chat_template(conversation, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours.render(conversation, add_generation_prompt) == expected
    ids = reference.apply_chat_template(conversation, tokenize=True, add_generation_prompt=add_generation_prompt, return_dict=False)
    assert list(reference.backend_tokenizer.encode(expected, add_special_tokens=False).ids) == list(ids)


def test_chat_template_jinja_file_wins_over_tokenizer_config(model_dir):
    write_chat_template(model_dir, "from config")
    (model_dir / "chat_template.jinja").write_text("{{ bos_token }} from file {{ messages[0]['content'] }}")
    conversation = [{"role": "user", "content": "w4"}]
    expected = hf_tokenizer(model_dir).apply_chat_template(conversation, tokenize=False)
    template = load_chat_template(model_dir)
    assert template is not None and template.render(conversation, False) == expected == "w1 from file w4"


def test_a_directory_without_a_template_has_none(model_dir):
    assert load_chat_template(model_dir) is None
    (model_dir / "tokenizer_config.json").write_text(json.dumps({"eos_token": "w2"}))
    assert load_chat_template(model_dir) is None


def test_raise_exception_refuses_with_the_templates_message(model_dir):
    write_chat_template(model_dir, CHATML)
    template = load_chat_template(model_dir)
    assert template is not None
    with pytest.raises(ChatTemplateError, match="roles must be user or assistant"):
        template.render([{"role": "tool", "content": "x"}])


@pytest.mark.parametrize(
    "escape",
    [
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ messages.append(1) }}",  # immutable: templates cannot change their inputs
        "{% set ns = namespace() %}{% set ns._private = 1 %}",
        "{{ namespace(_x=1) }}",
    ],
)
def test_the_sandbox_refuses_what_transformers_refuses(model_dir, escape):
    write_chat_template(model_dir, escape)
    template = load_chat_template(model_dir)
    assert template is not None
    conversation = [{"role": "user", "content": "w4"}]
    with pytest.raises(Exception):  # noqa: B017  transformers raises jinja's own errors
        hf_tokenizer(model_dir).apply_chat_template(conversation, tokenize=False)
    with pytest.raises(ChatTemplateError):
        template.render(conversation)
