"""A Llama-style model as Llama-3 base ships one: its chat-control tokens (and reserved ones)
have rows that were never trained, zero or ~1e-23 in bfloat16; and the chat template of the
instruct model, which uses them, with data made by it. Real transformers parts, built here."""

from __future__ import annotations

from typing import Any

import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

ROWS = 64  # the tokenizer is filled up to it with reserved tokens, as Llama-3's 128256
BOS = "<|begin_of_text|>"  # trained in the base model
CHAT = ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]  # untrained in the base
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}"
            "<|end_header_id|> {{ m['content'] }}<|eot_id|>{% endfor %}")
SENTENCES = [
    "the guard reads the flags once per step",
    "padding columns get no probability under the mask",
    "a ghost token is an id the tokenizer cannot produce",
    "every rank takes the same decision at the same step",
]
SEQ = 32


def chat_tokenizer() -> PreTrainedTokenizerFast:
    """Word-level, trained on SENTENCES; BOS, the chat tokens, then reserved tokens up to ROWS
    ids, and the Llama-3-style chat template."""
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([*SENTENCES, "user assistant"],
                            trainers.WordLevelTrainer(special_tokens=["[UNK]", "[PAD]"]))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]",
                                   bos_token=BOS)
    reserved = [f"<|reserved_special_token_{i}|>" for i in range(ROWS - len(fast) - len(CHAT))]
    fast.add_special_tokens({"additional_special_tokens": [*CHAT, *reserved]})
    fast.chat_template = TEMPLATE
    assert len(fast) == ROWS
    return fast


def ids_of(tok: PreTrainedTokenizerFast, tokens: list[str]) -> list[int]:
    ids = tok.convert_tokens_to_ids(tokens)
    assert isinstance(ids, list)
    return ids


def reserved(tok: PreTrainedTokenizerFast) -> list[int]:
    return [i for i in range(ROWS) if tok.convert_ids_to_tokens(i).startswith("<|reserved")]


def llama(tok: PreTrainedTokenizerFast, untrained: list[int] | None = None, *,
          value: float = 0.0, dtype: torch.dtype = torch.float32, seed: int = 0,
          tie: bool = False) -> LlamaForCausalLM:
    """A 1-layer Llama over `tok`'s ids (normal init), untied as Llama-3 8B, whose rows of
    `untrained` hold `value` in the embedding and the head."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                      max_position_embeddings=64, tie_word_embeddings=tie,
                      bos_token_id=tok.bos_token_id, pad_token_id=tok.pad_token_id,
                      eos_token_id=ids_of(tok, ["<|eot_id|>"])[0])
    m = LlamaForCausalLM(cfg).to(dtype)
    with torch.no_grad():
        for w in (m.get_input_embeddings().weight, m.get_output_embeddings().weight):
            w[untrained or []] = value
    return m


def chats(tok: PreTrainedTokenizerFast, n: int = 16) -> list[dict[str, torch.Tensor]]:
    """Chat examples made by the template: (SEQ,) input ids, labels -100 at the padding."""
    out = []
    for i in range(n):
        turns = [{"role": "user", "content": SENTENCES[i % 4]},
                 {"role": "assistant", "content": SENTENCES[(i + 1) % 4]}]
        ids = list(tok.apply_chat_template(turns, tokenize=True)["input_ids"])[:SEQ]
        pad = SEQ - len(ids)
        out.append({"input_ids": torch.tensor(ids + [tok.pad_token_id] * pad),
                    "labels": torch.tensor(ids + [-100] * pad)})
    return out


def stacked(examples: list[dict[str, torch.Tensor]]) -> dict[str, Any]:
    """One batch of `examples`."""
    return {k: torch.stack([e[k] for e in examples]) for k in examples[0]}
