"""Tiny, deterministic building blocks for the Hugging Face integration workers (no downloads).

A 2-layer Llama from a config (with attention dropout, so a resumed run is bit-exact only if
every rank's RNG is restored at the right moment), a token dataset that is a pure function of
a seed, and a word-level tokenizer built in memory for TRL.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

VOCAB, SEQ = 128, 16
OFFLINE_ENV = {
    "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
    "WANDB_DISABLED": "true", "WANDB_MODE": "disabled", "DISABLE_MLFLOW_INTEGRATION": "TRUE",
    "TOKENIZERS_PARALLELISM": "false", "HF_HUB_DISABLE_TELEMETRY": "1",
    "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1", "OMP_NUM_THREADS": "1",
}


def config(dropout: float = 0.1) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                       max_position_embeddings=64, attention_dropout=dropout,
                       pad_token_id=0, bos_token_id=1, eos_token_id=2)


def model(seed: int = 0, dropout: float = 0.1) -> Any:
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(config(dropout))


class TokenData(torch.utils.data.Dataset):
    """``n`` fixed random sequences (labels = inputs), a pure function of ``seed``."""

    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(3, VOCAB, (n, SEQ), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i].clone()}


def tokenizer() -> Any:
    """A word-level tokenizer over the words ``w3`` .. ``w127`` plus specials."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>",
                                   eos_token="</s>", unk_token="<pad>")


def text_dataset(n: int, seed: int) -> Any:
    """A ``datasets.Dataset`` of ``{"text": ...}`` rows built in memory."""
    from datasets import Dataset

    g = torch.Generator().manual_seed(seed)
    rows = [" ".join(f"w{int(t)}" for t in torch.randint(3, VOCAB, (SEQ - 2,), generator=g))
            for _ in range(n)]
    return Dataset.from_dict({"text": rows})


def write_json(path: str, obj: Any) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
    os.replace(tmp, path)
