"""Data-file and directory mutants, and :func:`apply`, which performs any mutant's file operations.

Operations are plain tuples (picklable): ``("write", name, bytes)``, ``("truncate", name, n)``,
``("xor", name, offset, mask)``, ``("fifo", name)``, ``("symlink", name, target)``, ... (see
:func:`apply`).
"""

from __future__ import annotations

import os
import random
import shutil
import socket
import stat
import struct
from typing import TYPE_CHECKING, Any

from tests.helpers.fuzz_bases import MANIFEST, STEP_A, STEP_B

if TYPE_CHECKING:
    from tests.helpers.fuzz_mutants import BaseView


def _data_name(rng: random.Random, v: BaseView) -> str:
    return rng.choice(sorted(v.files))


def _header_len(data: bytes) -> int:
    return struct.unpack("<Q", data[:8])[0]


def g_data(rng: random.Random, v: BaseView, kind: str) -> tuple[str, tuple[Any, ...]] | None:
    name = _data_name(rng, v)
    data = v.files[name]
    hl = 8 + _header_len(data)
    if kind == "bitflip_header":
        at, bit = rng.randrange(hl), rng.randrange(8)
        return f"{name}: flip bit {bit} of byte {at} (header, {hl} bytes)", (("xor", name, at, 1 << bit),)
    if kind == "bitflip_data":
        if len(data) <= hl:
            return None
        at, bit = rng.randrange(hl, len(data)), rng.randrange(8)
        return f"{name}: flip bit {bit} of byte {at} (data)", (("xor", name, at, 1 << bit),)
    if kind == "truncate":
        n = rng.choice([0, 4, 8, rng.randrange(8, hl), hl, rng.randrange(hl, len(data)), len(data) - 1])
        return f"{name}: truncated to {n} of {len(data)} bytes", (("truncate", name, n),)
    if kind == "extend":
        if rng.random() < 0.2:
            return f"{name}: extended to 1 GiB with a sparse hole", (("truncate", name, 1 << 30),)
        extra = rng.choice([b"\x00", b"\x00" * 8, rng.randbytes(rng.randrange(1, 4096))])
        return f"{name}: {len(extra)} bytes appended", (("append", name, extra),)
    if kind == "header_len":
        old = hl - 8
        new = rng.choice([0, 1, old - 1, old + 1, old - 8, old + 8, len(data), 2**63, 2**64 - 1])
        return f"{name}: header length {old} -> {new}", (("patch", name, 0, struct.pack("<Q", new)),)
    if kind == "special":
        what = rng.choice(["empty", "dir", "fifo", "fifo", "socket", "zero-device", "null-device"])
        op = {"empty": ("write", name, b""), "dir": ("mkdir", name), "fifo": ("fifo", name),
              "socket": ("socket", name), "zero-device": ("chardev", name, 1, 5),
              "null-device": ("chardev", name, 1, 3)}[what]
        return f"{name} replaced by {what}", (op,)
    if kind == "link":
        what = rng.choice(["symlink-outside-same", "symlink-etc", "symlink-inside", "symlink-loop",
                           "symlink-dangling", "hardlink-outside-same", "hardlink-outside-other",
                           "symlink-older"])
        ops: dict[str, tuple[Any, ...]] = {
            "symlink-outside-same": (("copy", name, "@outside/same"), ("symlink", name, "@outside/same")),
            "symlink-etc": (("symlink", name, "/etc/hostname"),),
            "symlink-inside": (("copy", name, ".copy"), ("symlink", name, ".copy")),
            "symlink-loop": (("symlink", name, name),),
            "symlink-dangling": (("symlink", name, "@outside/nothing"),),
            "hardlink-outside-same": (("copy", name, "@outside/same"), ("hardlink", name, "@outside/same")),
            "hardlink-outside-other": (("write", "@outside/other", rng.randbytes(len(data))),
                                       ("hardlink", name, "@outside/other")),
            "symlink-older": (("symlink", name, f"../step-0000000001/{name}"),),
        }
        return f"{name} replaced by {what}", ops[what]
    if kind == "swap":
        if len(v.files) > 1:
            a, b = sorted(v.files)[:2]
            return f"swap {a} and {b}", (("rename", a, ".tmp"), ("rename", b, a), ("rename", ".tmp", b))
        older = v.older_files.get(name)
        if older is None:
            return None
        return f"{name} replaced by the older checkpoint's {name}", (("write", name, older),)
    if kind == "perm":
        if os.geteuid() == 0:
            return None  # root reads anything: meaningless
        return f"{name} made unreadable (chmod 000)", (("chmod", name, 0),)
    raise ValueError(kind)


DATA_KINDS = {"bitflip_header": 3, "bitflip_data": 3, "truncate": 2, "extend": 1, "header_len": 2,
              "special": 2, "link": 2, "swap": 1, "perm": 0.5}


def g_dir(rng: random.Random, v: BaseView, kind: str) -> tuple[str, tuple[Any, ...]] | None:
    if kind == "extra":
        name, op = rng.choice([
            ("junk file", ("write", "junk.bin", b"junk")),
            ("extra rank file", ("copy", sorted(v.files)[0], "rank-00009.safetensors")),
            ("extra fifo", ("fifo", "rank-00009.safetensors")),
            ("extra subdirectory", ("mkdir", "sub")),
            ("extra symlink to /etc", ("symlink", "extra", "/etc")),
            ("manifest backup", ("write", "manifest.json.bak", v.manifest_raw)),
            ("staging-like dotfile", ("write", ".safeckpt-staging-x", b"")),
        ])
        return f"extra entry in the checkpoint: {name}", (op,)
    if kind == "missing":
        what = rng.choice(sorted(v.files) + [MANIFEST, "*all data*"])
        if what == "*all data*":
            return "every data file removed", tuple(("remove", n) for n in v.files)
        return f"{what} removed", (("remove", what),)
    if kind == "manifest_special":
        what = rng.choice(["dir", "fifo", "fifo", "symlink-outside-same", "symlink-inside",
                           "hardlink-outside-same", "zero-device", "socket", "symlink-older",
                           "hardlink-older", "copy-older"])
        ops: dict[str, tuple[Any, ...]] = {
            "dir": (("mkdir", MANIFEST),),
            "fifo": (("fifo", MANIFEST),),
            "symlink-outside-same": (("copy", MANIFEST, "@outside/m.json"), ("symlink", MANIFEST, "@outside/m.json")),
            "symlink-inside": (("copy", MANIFEST, ".m.json"), ("symlink", MANIFEST, ".m.json")),
            "hardlink-outside-same": (("copy", MANIFEST, "@outside/m.json"), ("hardlink", MANIFEST, "@outside/m.json")),
            "zero-device": (("chardev", MANIFEST, 1, 5),),
            "socket": (("socket", MANIFEST),),
            "symlink-older": (("symlink", MANIFEST, f"../step-0000000001/{MANIFEST}"),),
            # A valid, signed manifest, but of other data files (same names, other bytes).
            "hardlink-older": (("hardlink", MANIFEST, f"@root/{STEP_A}/{MANIFEST}"),),
            "copy-older": (("copy", f"@root/{STEP_A}/{MANIFEST}", MANIFEST),),
        }
        return f"{MANIFEST} replaced by {what}", ops[what]
    if kind == "checkpoint_dir":
        what = rng.choice(["symlink-outside", "file", "empty-dir", "fifo"])
        ckpt = f"@root/{STEP_B}"
        ops = {
            "symlink-outside": (("rename", ckpt, "@outside/ck"), ("symlink", ckpt, "@outside/ck")),
            "file": (("rmtree", ckpt), ("write", ckpt, b"x")),
            "empty-dir": (("rmtree", ckpt), ("mkdir", ckpt)),
            "fifo": (("rmtree", ckpt), ("fifo", ckpt)),
        }
        return f"the checkpoint directory replaced by {what}", ops[what]
    if kind == "all_damaged":  # restore has nothing to fall back to: it must raise, not start fresh
        older = f"@root/{STEP_A}/"
        name = sorted(v.older_files)[0]
        a = rng.choice([("xor", older + name, len(v.older_files[name]) - 1, 1),
                        ("truncate", older + MANIFEST, 100), ("write", older + MANIFEST, b"{}"),
                        ("remove", older + name)])
        b = rng.choice([("xor", name, len(v.files[name]) - 1, 1), ("truncate", MANIFEST, 100),
                        ("remove", MANIFEST), ("remove", name)])
        return f"both checkpoints damaged: older {a[0]} {a[1].rsplit('/', 1)[1]}, newer {b[0]} {b[1]}", (a, b)
    raise ValueError(kind)


DIR_KINDS = {"extra": 2, "missing": 1.5, "manifest_special": 2, "checkpoint_dir": 1, "all_damaged": 1}


def apply(ops: tuple[tuple[Any, ...], ...], ws: str, ckpt: str) -> None:
    """Run ``ops`` on the checkpoint ``ckpt`` inside the workspace ``ws``.

    Names are relative to the checkpoint, or ``@root/...`` / ``@outside/...`` (a directory
    beside the root, outside every checkpoint); symlink targets of that form become absolute.
    """

    def at(name: str) -> str:
        if name.startswith("@root/"):
            return os.path.join(ws, "root", name[6:])
        if name.startswith("@outside/"):
            return os.path.join(ws, "outside", name[9:])
        return os.path.join(ckpt, name)

    for op, *args in ops:
        if op in ("write", "truncate", "append", "patch", "xor", "splice", "mkdir", "fifo", "socket",
                  "chardev", "symlink", "hardlink"):
            path = at(args[0])
            os.makedirs(os.path.dirname(path), exist_ok=True)
        if op in ("write", "mkdir", "fifo", "socket", "chardev", "symlink", "hardlink"):
            _clear(at(args[0]))
        if op == "write":
            with open(at(args[0]), "wb") as f:
                f.write(args[1])
        elif op == "truncate":
            os.truncate(at(args[0]), args[1])
        elif op == "append":
            with open(at(args[0]), "ab") as f:
                f.write(args[1])
        elif op == "patch":
            with open(at(args[0]), "r+b") as f:
                f.seek(args[1])
                f.write(args[2])
        elif op == "xor":
            with open(at(args[0]), "r+b") as f:
                f.seek(args[1])
                b = f.read(1)[0] ^ args[2]
                f.seek(args[1])
                f.write(bytes([b]))
        elif op == "splice":
            _splice(at(args[0]), *args[1:])
        elif op == "remove":
            _clear(at(args[0]))
        elif op == "rmtree":
            _clear(at(args[0]))
        elif op == "mkdir":
            os.makedirs(at(args[0]))
        elif op == "fifo":
            os.mkfifo(at(args[0]))
        elif op == "socket":
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.bind(at(args[0]))
        elif op == "chardev":
            os.mknod(at(args[0]), stat.S_IFCHR | 0o600, os.makedev(args[1], args[2]))
        elif op == "symlink":
            target = args[1]
            os.symlink(at(target) if target.startswith("@") else target, at(args[0]))
        elif op == "hardlink":
            os.link(at(args[1]), at(args[0]))
        elif op == "copy":
            os.makedirs(os.path.dirname(at(args[1])), exist_ok=True)
            shutil.copyfile(at(args[0]), at(args[1]))
        elif op == "rename":
            os.makedirs(os.path.dirname(at(args[1])), exist_ok=True)
            os.rename(at(args[0]), at(args[1]))
        elif op == "chmod":
            os.chmod(at(args[0]), args[1])
        else:
            raise ValueError(op)


def _clear(path: str) -> None:
    if os.path.islink(path) or (os.path.lexists(path) and not os.path.isdir(path)):
        os.unlink(path)
    elif os.path.isdir(path):
        shutil.rmtree(path)


def _splice(path: str, head: bytes, kind: str, n: int, tail: bytes) -> None:
    """head + n bytes of filler + tail, streamed in 1 MiB pieces."""
    piece = {"ws": b" " * (1 << 20), "string": b"a" * (1 << 20), "array": b"0," * (1 << 19),
             "records": None}[kind]
    with open(path, "wb") as f:
        f.write(head)
        if kind == "string":
            f.write(b'"')
        elif kind == "array":
            f.write(b"[")
        elif kind == "records":
            f.write(b"[")
        written = 0
        if kind == "records":
            rec = b'{"dtype":"F32","shape":[1],"chunks":[{"offsets":[0],"sizes":[1]}]},'
            block = rec * ((1 << 20) // len(rec))
            while written < n:
                f.write(block)
                written += len(block)
            f.write(b"{}]")
        else:
            assert piece is not None
            while written < n:
                f.write(piece)
                written += len(piece)
            f.write({"ws": b"", "string": b'"', "array": b"0]"}[kind])
        f.write(tail)
