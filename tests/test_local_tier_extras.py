"""The node-local tier with ``extra_files`` and ``named`` files (issue 28; what the Hugging Face
Trainer's pretrained layout and a framework's own JSON need), on real processes: 3 simulated
nodes x 1 rank (GROUP_RANK per rank, each node its own local_dir), gloo on 127.0.0.1.

A durable step under root is exactly what a save without the tier writes (every file byte for
byte, the manifest but for its time); a local-only step restored after a node is lost (its rank
SIGKILLed, its local_dir wiped, root's copy unreadable) gives the same state, the same named
files and the same extra files back, each verified.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import warnings

import pytest
import torch
from torch import nn

from tests.helpers import dist_harness
from tests.test_local_tier import _root_away

NODES = 3
pytestmark = pytest.mark.timeout(240)

LAYOUT = {"weights.safetensors": {"w.lm": "model/lm_head.weight", "w.body": "model/body.weight"},
          "bias.safetensors": {"b": "model/body.bias"}}


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 16)
        self.body = nn.Linear(16, 16)
        self.lm_head = nn.Linear(16, 64, bias=False)
        self.lm_head.weight = self.embed.weight


def _state(step: int, rank: int) -> dict:
    import safeckpt

    m = Tied()
    with torch.no_grad():
        for i, p in enumerate(m.parameters()):
            p.copy_(torch.arange(p.numel(), dtype=torch.float32).reshape(p.shape) * (step + i))
    return {"model": m, "mine": safeckpt.PerRank(torch.full((5,), float(100 * rank + step))), "v": step}


def _same(a: dict, b: dict) -> bool:
    sa, sb = a["model"].state_dict(), b["model"].state_dict()
    return (all(torch.equal(sa[k], sb[k]) for k in sb) and torch.equal(a["mine"].value, b["mine"].value)
            and a["v"] == b["v"] and a["model"].lm_head.weight is a["model"].embed.weight)


def _extras(step: int) -> dict:
    return {"trainer_state.json": json.dumps({"global_step": step, "log": list(range(step))}).encode(),
            "config.json": b'{"model_type": "tied"}'}


def _job(rank: int, world: int, root: str, nodes_dir: str, plain: str, phase: str) -> dict:
    import safeckpt
    from safeckpt.engine.request import NamedLayout

    os.environ["GROUP_RANK"] = str(rank)
    local = os.path.join(nodes_dir, f"node{rank}")
    mgr = safeckpt.CheckpointManager(root, local_dir=local, durable_every=10, replicas=1, keep_last=None,
                                     check_finite=True, preemption_signals=(), timeout=30)
    out: dict = {"warnings": []}
    if phase == "save":
        for step in (10, 11):
            mgr.save(step, _state(step, rank), extra_files=_extras(step), named=NamedLayout(LAYOUT))
            mgr.wait()
        # the same step 10 saved without the tier, to compare root's copy with
        safeckpt.save(plain, _state(10, rank), step=10, extra_files=_extras(10), named=NamedLayout(LAYOUT),
                      frozen="fingerprint")
        import torch.distributed as dist

        dist.barrier()
        if rank == 2:  # node 2 dies for real after step 11 is complete on the tier
            os.kill(os.getpid(), signal.SIGKILL)
        return out  # the others die too, without close(): step 11 never reaches root
    st = _state(0, rank)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = mgr.restore(st)
    out["warnings"] = [str(w.message) for w in caught]
    out["restored"] = [got, _same(st, _state(11, rank))]
    out["files"] = {k: v.decode() for k, v in mgr.restored_files().items()}
    out["path"] = mgr.restored_path
    return out


def _files(d: str) -> dict:
    """A step's files (not the tier's own record of who holds what)."""
    return {n: open(os.path.join(d, n), "rb").read() for n in sorted(os.listdir(d)) if n != "tier.json"}


def test_extra_files_and_named_on_the_local_tier(tmp_path):
    import safeckpt
    from safeckpt.engine.local_tier import tier_tag, tier_url

    root, nodes, plain = tmp_path / "root", tmp_path / "nodes", tmp_path / "plain"
    outs = dist_harness.run(_job, NODES, str(root), str(nodes), str(plain), "save", timeout=150)
    for o in outs:
        if o.rank == 2:
            assert not o.ok and o.exitcode == -signal.SIGKILL, (o.rank, o.exitcode, o.message)
        else:
            assert o.ok, (o.rank, o.error_type, o.message)
    # Root's step 10 is what the save without the tier wrote: every file the same bytes, the
    # manifest the same but for its time.
    durable, ref = _files(str(root / "step-0000000010")), _files(str(plain))
    assert sorted(durable) == sorted(ref) and {"weights.safetensors", "bias.safetensors", "trainer_state.json",
                                                "config.json"} <= set(durable)
    for name in ref:
        if name != "manifest.json":
            assert durable[name] == ref[name], name
    m1, m2 = (json.loads(x["manifest.json"]) for x in (durable, ref))
    for m in (m1, m2):
        for k in ("created_at", "created_unix", "manifest_xxh3_128"):  # the time, and the text's checksum
            m.pop(k)
    assert m1 == m2
    assert safeckpt.verify(str(root / "step-0000000010")).ok
    assert sorted(n for n in os.listdir(root) if n.startswith("step-")) == ["step-0000000010"]  # 11: nodes only
    # Every node holds the extra files of step 11; the data and named files are spread.
    tag = tier_tag(str(root))
    step11 = [nodes / f"node{n}" / tag / "step-0000000011" for n in range(NODES)]
    man = json.loads((step11[0] / "manifest.json").read_text())
    writers = {n: man["files"][n]["writer"] for n in LAYOUT}
    for d in step11:
        assert (d / "trainer_state.json").read_bytes() == _extras(11)["trainer_state.json"]
        assert not [n for n in os.listdir(d.parent) if n.startswith(".")], os.listdir(d.parent)  # no staging left
    # The node of a named file's writer is lost with its local_dir; root's copy is unreadable;
    # one node's extra file is damaged: that file alone comes from another copy.
    lost = writers["weights.safetensors"]
    shutil.rmtree(nodes / f"node{lost}")
    _root_away(root, tmp_path / "root-away")  # its run identity kept
    damaged = next(d for n, d in enumerate(step11) if n != lost)
    data = bytearray((damaged / "trainer_state.json").read_bytes())
    data[3] ^= 0x20
    (damaged / "trainer_state.json").write_bytes(bytes(data))
    outs = dist_harness.run(_job, NODES, str(root), str(nodes), str(plain), "restore", timeout=150)
    for o in outs:
        assert o.ok, (o.rank, o.error_type, o.message)
        v = o.value
        assert v["restored"] == [11, True], v
        assert v["files"] == {k: b.decode() for k, b in _extras(11).items()}, v
        assert v["path"] == tier_url(tag, 11)
        notes = [w for w in v["warnings"] if "failed verification" in w]
        assert notes == [f"restore of step 11: the copy of trainer_state.json on node-{step11.index(damaged)} "
                         "failed verification; taking it from another copy"], v["warnings"]
    # the lost node holds again what a save placed there (its rank's file and the replica of the
    # node before it) and what its load read, every named and extra file of the step, each byte
    # for byte as the other nodes hold it
    again = _files(str(step11[lost]))
    others: dict = {}
    for n in range(NODES):
        if n != lost:
            others.update(_files(str(step11[n])))
    assert {f"rank-{lost:05d}.safetensors", f"rank-{(lost - 1) % NODES:05d}.safetensors"} <= set(again)
    assert set(LAYOUT) | set(_extras(11)) <= set(again)
    assert all(again[n] == others[n] for n in again if n in others) and set(again) <= set(others)
    assert os.listdir(root) == [".safeckpt-run.json"]  # nothing read from, nor written to, root


def test_write_files_stays_refused_with_the_local_tier(tmp_path):
    import safeckpt

    with safeckpt.CheckpointManager(tmp_path / "root", local_dir=tmp_path / "local", preemption_signals=()) as m:
        with pytest.raises(safeckpt.CheckpointError, match="write_files"):
            m.save(1, {"w": torch.zeros(3)}, write_files=lambda d: [])
