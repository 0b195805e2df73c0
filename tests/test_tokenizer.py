"""Our tokenizer (radixserve.tokenizer) against transformers' on the same files.

Two sources: the default GGUF checkpoint (tokenizer in the GGUF metadata) and a Hugging
Face tokenizer directory (the default tokenizer written by ``save_pretrained``). Chat
templates are rendered by our own sandboxed jinja2 environment, so the rendered strings
and the ids of ``encode_chat`` are compared with transformers' ``apply_chat_template``.
"""

from __future__ import annotations

import pytest
from radixserve.tokenizer import TemplateError, load_tokenizer

TEXTS = [
    "Hello, world!",
    "",
    " ",
    "   leading and trailing spaces   ",
    "tabs\tand\nnewlines\n\n\nand\r\nCRLF",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "text with <|im_start|> in the middle and <|endoftext|> too",
    "<|im_end|><|im_end|>",
    "naïve café, Straße, Ærøskøbing",
    "日本語のテキストと中文文本",
    "emoji: 🤖🚀👩‍👩‍👧 and math ∑∫√∞",
    "Привет, как дела? مرحبا שלום",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "3.14159 1,000,000 0x1F 2024-01-31 -42",
    "a" * 300,
]

MESSAGE_LISTS = {
    "system_user": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name three primes."},
    ],
    "user_only": [{"role": "user", "content": "Hi there"}],
    "multi_turn": [
        {"role": "system", "content": "You answer in French."},
        {"role": "user", "content": "Hello!"},
        {"role": "assistant", "content": "Bonjour !"},
        {"role": "user", "content": "How are you?"},
    ],
    "multi_turn_no_system": [
        {"role": "user", "content": "Write a haiku."},
        {"role": "assistant", "content": "Leaves fall\nsilent pond\nfrog"},
        {"role": "user", "content": "Another, about 日本 🌸"},
    ],
}

OVERRIDE_TEMPLATE = (
    "{% for m in messages %}[{{ m['role'] | upper }}] {{ m['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}[ASSISTANT] {% endif %}"
)


@pytest.fixture(scope="module")
def hf_dir_tokenizers(hf_default_tokenizer, tmp_path_factory):
    """(ours, transformers') loaded from a Hugging Face tokenizer directory."""
    from transformers import AutoTokenizer

    path = str(tmp_path_factory.mktemp("hf_tokenizer"))
    hf_default_tokenizer.save_pretrained(path)
    return load_tokenizer(path), AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def gguf_tokenizers(default_model_file, hf_default_tokenizer):
    """(ours, transformers') from the default GGUF file, built the way the Engine builds ours."""
    directory, name = default_model_file
    return load_tokenizer(directory, name), hf_default_tokenizer


@pytest.fixture(params=["gguf", "hf_dir"])
def tokenizers(request):
    return request.getfixturevalue(f"{request.param}_tokenizers")


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_matches_transformers(tokenizers, add_special_tokens):
    ours, hf = tokenizers
    for text in TEXTS:
        assert ours.encode(text, add_special_tokens=add_special_tokens) == hf.encode(
            text, add_special_tokens=add_special_tokens), repr(text)


def test_special_tokens_in_text_become_single_ids(tokenizers):
    ours, hf = tokenizers
    start, end = hf.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    ids = ours.encode("<|im_start|>user\nhi<|im_end|>", add_special_tokens=False)
    assert ids[0] == start and ids[-1] == end


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_decode_matches_transformers(tokenizers, skip_special_tokens):
    ours, hf = tokenizers
    for text in TEXTS:
        ids = hf.encode(text)
        assert ours.decode(ids, skip_special_tokens=skip_special_tokens) == hf.decode(
            ids, skip_special_tokens=skip_special_tokens), repr(text)


def test_special_token_ids_match_transformers(tokenizers):
    ours, hf = tokenizers
    assert ours.eos_token_id == hf.eos_token_id
    assert ours.bos_token_id == hf.bos_token_id
    assert ours.vocab_size == len(hf)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("messages", list(MESSAGE_LISTS.values()), ids=list(MESSAGE_LISTS))
def test_chat_template_matches_transformers(tokenizers, messages, add_generation_prompt):
    ours, hf = tokenizers
    text = ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    assert text == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    ref_ids = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt)
    ref_ids = ref_ids["input_ids"] if hasattr(ref_ids, "keys") else ref_ids
    assert ours.encode_chat(messages, add_generation_prompt=add_generation_prompt) == list(ref_ids)


def test_chat_template_override_text(default_model_file, hf_default_tokenizer):
    directory, name = default_model_file
    ours = load_tokenizer(directory, name, chat_template=OVERRIDE_TEMPLATE)
    for messages in MESSAGE_LISTS.values():
        text = ours.apply_chat_template(messages)
        assert text.startswith("[")  # the override, not the model's ChatML template
        assert text == hf_default_tokenizer.apply_chat_template(
            messages, chat_template=OVERRIDE_TEMPLATE, tokenize=False, add_generation_prompt=True)
        assert ours.encode_chat(messages) == hf_default_tokenizer.encode(text, add_special_tokens=False)


def test_chat_template_override_file(hf_dir_tokenizers, hf_default_tokenizer, tmp_path):
    hf_dir = hf_dir_tokenizers[1]
    path = tmp_path / "template.jinja"
    path.write_text(OVERRIDE_TEMPLATE)
    ours = load_tokenizer(hf_dir.name_or_path, chat_template=str(path))
    messages = MESSAGE_LISTS["multi_turn"]
    assert ours.apply_chat_template(messages) == hf_default_tokenizer.apply_chat_template(
        messages, chat_template=OVERRIDE_TEMPLATE, tokenize=False, add_generation_prompt=True)


def test_directory_without_chat_template(tmp_path):
    """A tokenizer with no template fails with a message pointing at --chat-template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({"<unk>": 0, "</s>": 1, "hello": 2}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="<unk>").save_pretrained(tmp_path)
    ours = load_tokenizer(str(tmp_path))
    assert ours.encode("hello hello") == [2, 2]
    with pytest.raises(TemplateError, match="--chat-template"):
        ours.apply_chat_template([{"role": "user", "content": "hello"}])
    ours = load_tokenizer(str(tmp_path), chat_template=OVERRIDE_TEMPLATE)
    assert ours.apply_chat_template([{"role": "user", "content": "hello"}]) == "[USER] hello</s>\n[ASSISTANT] "
