"""A small byte-level BPE tokenizer with Qwen's chat format, built offline.

No hub downloads exist where rlix runs its tests, so the presets carry their own tokenizer:
trained in-process with the `tokenizers` library on a fixed built-in text (deterministic), then
wrapped as a transformers fast tokenizer so the same files load in transformers and in vLLM.
Byte-level means every string round-trips, whatever the vocabulary learned.
"""

from __future__ import annotations

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)

_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Qwen-style ChatML: each message is `<|im_start|>role\ncontent<|im_end|>\n`.
CHAT_TEMPLATE = (
    # with `tools`: a system turn listing them and how to call them (hermes-style, as Qwen2's);
    # an assistant's calls render as <tool_call> blocks, tool results as <tool_response> turns
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n<tools>\\n' }}"
    "{%- for tool in tools %}{{- tool | tojson }}{{- '\\n' }}{%- endfor %}"
    "{{- '</tools>\\nTo call a tool, write <tool_call>{\"name\": NAME, \"arguments\": {...}}</tool_call>'"
    " + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if tools and loop.first and message['role'] == 'system' %}"
    "{%- elif message['role'] == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message['content'] + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- elif message['role'] == 'assistant' and message.get('tool_calls') %}"
    "{{- '<|im_start|>assistant\\n' + message['content'] }}"
    "{%- for call in message['tool_calls'] %}"
    "{{- '<tool_call>{\"name\": ' + (call['function']['name'] | tojson) + ', \"arguments\": '"
    " + (call['function']['arguments'] | tojson) + '}</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Training text: varied enough that merges cover common English, digits and chat roles.
_CORPUS = """\
The scheduler moves GPUs between pipelines according to priority and measured demand.
Each pipeline trains a policy model and generates rollouts with an inference engine.
When a trainer needs its GPUs, the overlapping inference shards sleep and later wake up.
The weights of version 12 are pushed to the shards that were asleep; the others keep serving.
A request streams tokens back to the caller together with their log probabilities.
user: What is the capital of France? assistant: The capital of France is Paris.
user: Add 17 and 25. assistant: 17 + 25 = 42.
system: You are a helpful assistant. Answer briefly and correctly.
Once upon a time there was a small model that learned to count: one, two, three, four, five.
def add(a, b):\n    return a + b\n\nprint(add(2, 3))
The quick brown fox jumps over the lazy dog. 0123456789 +-*/=()[]{}<>,.;:!?'"
Reinforcement learning from verifiable rewards: sample a group, score it, compute advantages.
"""


def build_tokenizer(vocab_size: int = 384) -> PreTrainedTokenizerFast:
    """Train the byte-level BPE and wrap it with eos/pad and the chat template."""
    core = Tokenizer(models.BPE())
    # The Qwen2 split (digits one by one), then bytes: transformers' Qwen2Tokenizer installs this
    # very pre-tokenizer when it loads a qwen2 checkpoint, so trained and loaded tokenizers agree.
    core.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_SPLIT_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(_CORPUS.splitlines() * 4, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        unk_token=None,
        bos_token=None,
        additional_special_tokens=[IM_START],
        clean_up_tokenization_spaces=False,
        model_max_length=2048,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer
