"""Issue 30: a Trainer checkpoint is also a Hugging Face model directory, the weights written once.

One process, tiny Llama from a config (no downloads), CPU. Each ``checkpoint-N`` must hold the
model as ``save_pretrained`` lays it out (the same tensor names, dtypes, shapes and tied-weight
handling, nothing more), with ``config.json`` and ``generation_config.json``; those files are
part of the commit (listed and checksummed in the manifest), the model's bytes are in them and
nowhere else, ``from_pretrained`` and resume read them, and damage in them is caught.
"""

from __future__ import annotations

import json
import os

import pytest

# First: skips this module without transformers or accelerate, sets the offline environment.
from tests.integrations.hf_testing import (
    fresh_accelerate_state,  # noqa: F401 - autouse fixture
    reset_accelerate_state,
    tiny,
    training_args,
)

# isort: split
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, LlamaForCausalLM, Trainer, TrainingArguments

import safeckpt
from safeckpt.integrations.hf import with_safeckpt
from tests.helpers.hf_layout import assert_same_shards, tensors

pytestmark = pytest.mark.timeout(300)


def _model(tied: bool = True, seed: int = 0) -> LlamaForCausalLM:
    cfg = tiny.config(0.0)
    cfg.tie_word_embeddings = tied
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg)


def _args(out: str, steps: int, **kw: object) -> TrainingArguments:
    return training_args(out, max_steps=steps, logging_steps=1, seed=0, **kw)


def _flip(path: str, at: int) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0xFF]))


def test_checkpoint_is_save_pretrained_layout_loads_and_resumes(tmp_path) -> None:
    out = str(tmp_path / "out")
    trainer = with_safeckpt(Trainer)(model=_model(), args=_args(out, 4), train_dataset=tiny.TokenData(16, 1))
    trainer.train()
    ckpt = os.path.join(out, "checkpoint-4")
    ref = str(tmp_path / "ref")
    trainer.model.save_pretrained(ref)  # what stock Trainer's checkpoint holds for the model

    # The files save_pretrained writes, with exactly its tensors (tied lm_head left out).
    assert {"model.safetensors", "config.json", "generation_config.json"} <= set(os.listdir(ckpt))
    assert tensors(os.path.join(ckpt, "model.safetensors")) == tensors(os.path.join(ref, "model.safetensors"))
    assert "lm_head.weight" not in tensors(os.path.join(ckpt, "model.safetensors"))
    with safe_open(os.path.join(ckpt, "model.safetensors"), "pt") as f:
        assert f.metadata()["format"] == "pt"
    with open(os.path.join(ckpt, "config.json")) as a, open(os.path.join(ref, "config.json")) as b:
        assert json.load(a) == json.load(b)

    # Part of the commit: listed and checksummed; the weights are written once (not in rank files).
    man = json.load(open(os.path.join(ckpt, "manifest.json")))
    assert len(man["files"]["model.safetensors"]["xxh3_128"]) == 32
    assert {"config.json", "generation_config.json"} <= set(man["extra"])
    rank_files = [n for n in man["files"] if n.startswith("rank-")]
    assert rank_files and not any(k.startswith("model/") for n in rank_files
                                  for k in tensors(os.path.join(ckpt, n)))
    assert safeckpt.verify(ckpt).ok

    # from_pretrained gives the trained model, tied as before.
    loaded = AutoModelForCausalLM.from_pretrained(ckpt)
    want = trainer.model.state_dict()
    got = loaded.state_dict()
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()

    # Resume reads the weights back from model.safetensors (verified) and continues.
    reset_accelerate_state()
    again = with_safeckpt(Trainer)(model=_model(seed=5), args=_args(out, 6), train_dataset=tiny.TokenData(16, 1))
    again.train(resume_from_checkpoint=True)
    assert again.state.global_step == 6

    # A flipped byte in the model's weights: verify names the file, resume from it refuses.
    _flip(os.path.join(ckpt, "model.safetensors"), os.path.getsize(os.path.join(ckpt, "model.safetensors")) - 5)
    report = safeckpt.verify(ckpt)
    assert not report.ok and any("model.safetensors" in p for p in report.problems), report.problems
    reset_accelerate_state()
    third = with_safeckpt(Trainer)(model=_model(), args=_args(out, 8), train_dataset=tiny.TokenData(16, 1))
    with pytest.raises(safeckpt.CorruptCheckpoint):
        third.train(resume_from_checkpoint=ckpt)


def test_untied_model_and_sharded_layout_match_save_pretrained(tmp_path) -> None:
    out = str(tmp_path / "out")
    cls = with_safeckpt(Trainer, max_shard_size="40KB")
    trainer = cls(model=_model(tied=False), args=_args(out, 2), train_dataset=tiny.TokenData(8, 1))
    trainer.train()
    ckpt = os.path.join(out, "checkpoint-2")
    ref = str(tmp_path / "ref")
    trainer.model.save_pretrained(ref, max_shard_size="40KB")
    shards = assert_same_shards(ckpt, ref)
    assert len(shards) > 2 and shards[0].startswith("model-00001-of-")  # the test means something
    assert "lm_head.weight" in json.load(open(os.path.join(ckpt, "model.safetensors.index.json")))["weight_map"]
    man = json.load(open(os.path.join(ckpt, "manifest.json")))
    assert set(shards) <= set(man["files"]) and "model.safetensors.index.json" in man["extra"]
    loaded = AutoModelForCausalLM.from_pretrained(ckpt)
    want = trainer.model.state_dict()
    assert all(torch.equal(loaded.state_dict()[k], want[k]) for k in want)
    assert safeckpt.verify(ckpt).ok


def test_opting_out_keeps_the_model_in_safeckpt_files(tmp_path) -> None:
    out = str(tmp_path / "out")
    trainer = with_safeckpt(Trainer, pretrained=False)(model=_model(), args=_args(out, 2),
                                                       train_dataset=tiny.TokenData(8, 1))
    trainer.train()
    ckpt = os.path.join(out, "checkpoint-2")
    assert not os.path.exists(os.path.join(ckpt, "model.safetensors"))
    assert any(k.startswith("model/") for k in tensors(os.path.join(ckpt, "rank-00000.safetensors")))


def test_load_best_model_at_end_reads_the_best_checkpoint_directory(tmp_path) -> None:
    scores = iter([1.0, 3.0, 2.0])
    out = str(tmp_path / "out")
    trainer = with_safeckpt(Trainer)(
        model=_model(), args=_args(out, 6, eval_strategy="steps", eval_steps=2, save_total_limit=2,
                                   metric_for_best_model="score", greater_is_better=True,
                                   load_best_model_at_end=True),
        train_dataset=tiny.TokenData(16, 1), eval_dataset=tiny.TokenData(2, 2),
        compute_metrics=lambda _p: {"score": next(scores)},
        preprocess_logits_for_metrics=lambda logits, labels: logits[..., :1])
    trainer.train()
    best = trainer.state.best_model_checkpoint
    assert best is not None and os.path.basename(best) == "checkpoint-4"
    loaded = AutoModelForCausalLM.from_pretrained(best)
    want = trainer.model.state_dict()  # the best model was loaded back at the end
    assert all(torch.equal(loaded.state_dict()[k], want[k]) for k in want)
    final = AutoModelForCausalLM.from_pretrained(os.path.join(out, "checkpoint-6"))
    assert not all(torch.equal(final.state_dict()[k], want[k]) for k in want)  # a different step


def test_peft_checkpoint_is_an_adapter_directory(tmp_path) -> None:
    peft = pytest.importorskip("peft")
    from peft import LoraConfig, PeftModel, get_peft_model

    def lora():  # noqa: ANN202
        return get_peft_model(_model(tied=False), LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                                             lora_dropout=0.0))

    out = str(tmp_path / "out")
    trainer = with_safeckpt(Trainer)(model=lora(), args=_args(out, 2, learning_rate=1e-2),
                                     train_dataset=tiny.TokenData(8, 1))
    trainer.train()
    ckpt = os.path.join(out, "checkpoint-2")
    ref = str(tmp_path / "ref")
    trainer.model.save_pretrained(ref)
    assert {"adapter_model.safetensors", "adapter_config.json"} <= set(os.listdir(ckpt))
    assert not os.path.exists(os.path.join(ckpt, "model.safetensors"))
    # PEFT's model card is the one file of stock's checkpoint-N left out (documented); save_pretrained writes it
    assert os.path.exists(os.path.join(ref, "README.md")) and not os.path.exists(os.path.join(ckpt, "README.md"))
    assert tensors(os.path.join(ckpt, "adapter_model.safetensors")) == \
        tensors(os.path.join(ref, "adapter_model.safetensors"))
    loaded = PeftModel.from_pretrained(_model(tied=False), ckpt)
    want = {k: v for k, v in trainer.model.state_dict().items() if "lora_" in k}
    got = loaded.state_dict()
    assert want and all(torch.equal(got[k], want[k]) for k in want)
    assert any(not torch.equal(v, torch.zeros_like(v)) for k, v in want.items() if "lora_B" in k)
    assert peft.__version__ and safeckpt.verify(ckpt).ok
    reset_accelerate_state()
    again = with_safeckpt(Trainer)(model=lora(), args=_args(out, 4, learning_rate=1e-2),
                                   train_dataset=tiny.TokenData(8, 1))
    again.train(resume_from_checkpoint=True)
    assert again.state.global_step == 4


def test_trl_sft_checkpoint_is_a_model_directory_with_its_tokenizer(tmp_path) -> None:
    pytest.importorskip("trl")
    from transformers import AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    out = str(tmp_path / "out")
    cfg = SFTConfig(output_dir=out, max_steps=2, save_steps=2, per_device_train_batch_size=2, report_to="none",
                    use_cpu=True, disable_tqdm=True, logging_steps=1, max_length=16)
    trainer = with_safeckpt(SFTTrainer)(model=tiny.model(dropout=0.0), args=cfg,
                                        train_dataset=tiny.text_dataset(8, 1), processing_class=tiny.tokenizer())
    trainer.train()
    ckpt = os.path.join(out, "checkpoint-2")
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= set(os.listdir(ckpt))
    loaded = AutoModelForCausalLM.from_pretrained(ckpt)
    want = trainer.model.state_dict()
    assert all(torch.equal(loaded.state_dict()[k], want[k]) for k in want)
    assert len(AutoTokenizer.from_pretrained(ckpt)) == len(tiny.tokenizer())
    assert safeckpt.verify(ckpt).ok


def test_async_saves_and_frozen_parameters_keep_the_layout(tmp_path) -> None:
    out = str(tmp_path / "out")
    model = _model(tied=False)
    model.model.embed_tokens.weight.requires_grad_(False)  # frozen: save_pretrained still writes it
    trainer = with_safeckpt(Trainer, async_save=True)(model=model, args=_args(out, 4),
                                                      train_dataset=tiny.TokenData(16, 1))
    trainer.train()
    ckpt = os.path.join(out, "checkpoint-4")
    assert "model.embed_tokens.weight" in tensors(os.path.join(ckpt, "model.safetensors"))
    loaded = AutoModelForCausalLM.from_pretrained(ckpt)
    want = trainer.model.state_dict()
    assert all(torch.equal(loaded.state_dict()[k], want[k]) for k in want)
    assert safeckpt.verify(ckpt).ok
    reset_accelerate_state()
    again_model = _model(tied=False, seed=3)
    again_model.model.embed_tokens.weight.requires_grad_(False)
    again = with_safeckpt(Trainer, async_save=True)(model=again_model, args=_args(out, 6),
                                                    train_dataset=tiny.TokenData(16, 1))
    again.train(resume_from_checkpoint=True)
    assert again.state.global_step == 6
    assert torch.equal(again.model.model.embed_tokens.weight, want["model.embed_tokens.weight"])


def test_missing_checkpoints_are_reported_in_trainers_own_words(tmp_path) -> None:
    out = str(tmp_path / "out")
    trainer = with_safeckpt(Trainer)(model=_model(), args=_args(out, 2), train_dataset=tiny.TokenData(8, 1))
    with pytest.raises(safeckpt.CheckpointNotFound, match=r"^No valid checkpoint found in output directory"):
        trainer.train(resume_from_checkpoint=True)
    reset_accelerate_state()
    trainer = with_safeckpt(Trainer)(model=_model(), args=_args(out, 2), train_dataset=tiny.TokenData(8, 1))
    with pytest.raises(safeckpt.CheckpointNotFound, match=r"^Can't find a valid checkpoint at .*checkpoint-5-bogus"):
        trainer.train(resume_from_checkpoint=os.path.join(out, "checkpoint-5-bogus"))


class _Regression(torch.nn.Module):  # not a PreTrainedModel: Trainer saves its state dict alone
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Parameter(torch.tensor(0.5))
        self.b = torch.nn.Parameter(torch.tensor(1.0))

    def forward(self, input_x: torch.Tensor, labels: torch.Tensor | None = None) -> tuple:
        y = input_x * self.a + self.b
        return torch.nn.functional.mse_loss(y, labels), y


class _Line(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_x": torch.tensor(float(i)), "labels": torch.tensor(2.0 * i + 3)}


def test_a_plain_module_gets_model_safetensors_as_trainer_writes_it(tmp_path) -> None:
    from safetensors.torch import load_file

    out = str(tmp_path / "out")
    trainer = with_safeckpt(Trainer)(model=_Regression(), args=_args(out, 4, per_device_train_batch_size=4),
                                     train_dataset=_Line())
    trainer.train()
    sd = load_file(os.path.join(out, "checkpoint-4", "model.safetensors"))
    assert set(sd) == {"a", "b"} and torch.equal(sd["a"], trainer.model.a.detach())
    assert not torch.equal(sd["a"], torch.tensor(0.5))  # it trained



def _rewrite_header(path: str, kind: str) -> None:
    """Same-length header damage of model.safetensors: a renamed tensor, or two same-shaped
    tensors' data_offsets swapped (every chunk checksum still right)."""
    import struct

    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    hdr = json.loads(raw[8:8 + n])
    a, b = "model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.gate_proj.weight"
    if kind == "rename":
        hdr["X" + a[1:]] = hdr.pop(a)
    else:
        hdr[a]["data_offsets"], hdr[b]["data_offsets"] = hdr[b]["data_offsets"], hdr[a]["data_offsets"]
    text = json.dumps(hdr, separators=(",", ":")).encode()
    with open(path, "wb") as f:
        f.write(raw[:8] + text + b" " * (n - len(text)) + raw[8 + n:])


@pytest.mark.parametrize("kind", ["rename", "swap"])
def test_resume_refuses_a_checkpoint_whose_model_header_was_changed(tmp_path, kind) -> None:
    from transformers import TrainerCallback

    class StartStep(TrainerCallback):
        at: list[int] = []

        def on_train_begin(self, args, state, control, **kw):  # type: ignore[no-untyped-def]
            self.at.append(state.global_step)

    out = str(tmp_path / "out")
    with_safeckpt(Trainer)(model=_model(tied=False), args=_args(out, 4), train_dataset=tiny.TokenData(16, 1)).train()
    ckpt = os.path.join(out, "checkpoint-4")
    _rewrite_header(os.path.join(ckpt, "model.safetensors"), kind)
    assert not safeckpt.verify(ckpt).ok

    # A path to it: refused, nothing trained.
    reset_accelerate_state()
    explicit = with_safeckpt(Trainer)(model=_model(tied=False), args=_args(str(tmp_path / "other"), 6),
                                      train_dataset=tiny.TokenData(16, 1))
    with pytest.raises(safeckpt.CorruptCheckpoint, match="model.safetensors"):
        explicit.train(resume_from_checkpoint=ckpt)

    # The newest that loads: checkpoint-2.
    reset_accelerate_state()
    spy = StartStep()
    again = with_safeckpt(Trainer)(model=_model(tied=False), args=_args(out, 6), train_dataset=tiny.TokenData(16, 1),
                                   callbacks=[spy])
    with pytest.warns(UserWarning, match="corrupt"):
        again.train(resume_from_checkpoint=True)
    assert spy.at[-1] == 2 and again.state.global_step == 6


def test_max_shard_size_runs_the_whole_of_trainers_save(tmp_path) -> None:
    # with_safeckpt(..., max_shard_size=...) runs Trainer._save as without it (a subclass's
    # override, the tokenizer given only through the data collator), save_pretrained sharding.
    from transformers import DataCollatorForLanguageModeling

    class ExtraTrainer(Trainer):
        def _save(self, output_dir=None, state_dict=None):  # type: ignore[no-untyped-def]
            super()._save(output_dir, state_dict)
            with open(os.path.join(output_dir or self.args.output_dir, "extra_info.json"), "w") as f:
                f.write('{"from": "_save"}')

    tok = tiny.tokenizer()
    files = {}
    for label, kw in (("plain", {}), ("sharded", {"max_shard_size": "40KB"})):
        reset_accelerate_state()
        out = str(tmp_path / label)
        trainer = with_safeckpt(ExtraTrainer, **kw)(
            model=_model(tied=False), args=_args(out, 2), train_dataset=tiny.TokenData(8, 1),
            data_collator=DataCollatorForLanguageModeling(tok, mlm=False))
        assert trainer.processing_class is None  # the tokenizer is the collator's only
        trainer.train()
        ckpt = os.path.join(out, "checkpoint-2")
        files[label] = set(os.listdir(ckpt))
        assert {"extra_info.json", "tokenizer.json", "tokenizer_config.json"} <= files[label], files[label]
        assert safeckpt.verify(ckpt).ok
    weights = {"model.safetensors", "model.safetensors.index.json"}
    shards = {n for n in files["sharded"] if n.startswith("model-0")}
    assert len(shards) > 2 and "model.safetensors.index.json" in files["sharded"]
    assert files["sharded"] - shards - weights == files["plain"] - weights
