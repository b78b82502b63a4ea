"""Seeded random v1 logs (every instruction kind) for the core's and the simulator's tests, and the runtime's
variants of a log: in-place mutations and graph-GC instructions."""
from __future__ import annotations

import json
import random


def random_log(seed: int, steps: int = 200) -> str:
    """A valid random v1 log using every instruction kind."""
    rng = random.Random(seed)
    lines, live, n = [json.dumps({"op": "meta", "version": 1, "seed": seed})], [], 0

    def new():
        nonlocal n
        n += 1
        return f"t{n}"

    for _ in range(3):
        t = new()
        lines.append(json.dumps({"op": "constant", "id": t, "size": rng.randint(0, 40)}))
        live.append(t)
    for _ in range(steps):
        r = rng.random()
        if len(live) > 12 and r < 0.5:  # keep the live set small: drop one
            t = live.pop(rng.randrange(len(live)))
            lines.append(json.dumps({"op": "release", "id": t}))
        elif r < 0.45 or len(live) < 2:
            ins = rng.sample(live, k=min(len(live), rng.randint(0, 3)))
            outs = [new() for _ in range(rng.randint(1, 3))]
            aliases = [rng.choice(ins) if ins and rng.random() < 0.2 else None for _ in outs]
            lines.append(json.dumps({"op": "call", "name": "f", "inputs": ins, "outputs": outs,
                                     "sizes": [rng.randint(0, 60) for _ in outs], "aliases": aliases,
                                     "cost": rng.choice([0, 0.5, 1, 2, 3.25, 7])}))
            live += outs
        elif r < 0.55:
            ins = rng.sample(live, k=min(len(live), rng.randint(1, 3)))
            lines.append(json.dumps({"op": "mutate", "name": "g_", "inputs": ins, "mutated": [ins[0]],
                                     "cost": rng.choice([1, 2, 5])}))
        elif r < 0.65:
            t = new()
            lines.append(json.dumps({"op": "copy", "dst": t, "src": rng.choice(live)}))
            live.append(t)
        elif r < 0.72:
            lines.append(json.dumps({"op": "copyfrom", "dst": rng.choice(live), "src": rng.choice(live)}))
        else:
            t = live.pop(rng.randrange(len(live)))
            lines.append(json.dumps({"op": "release", "id": t}))
    for t in live[3:]:  # a few outputs wanted at the end
        lines.append(json.dumps({"op": "release", "id": t}))
    return "\n".join(lines) + "\n"


def with_inplace(text: str, seed: int) -> str:
    """``text`` with about half of its ``mutate`` instructions run in place (as the runtime's are)."""
    rng = random.Random(f"inplace/{seed}")
    out = []
    for line in text.splitlines():
        rec = json.loads(line)
        if rec["op"] == "mutate" and rng.random() < 0.5:
            line = json.dumps({**rec, "inplace": True})
        out.append(line)
    return "\n".join(out) + "\n"


def with_collects(text: str, seed: int, every: int = 15) -> str:
    """``text`` with the runtime's graph-GC instruction inserted at random points."""
    rng = random.Random(f"collect/{seed}")
    lines = text.splitlines()
    out = lines[:1]
    for line in lines[1:]:
        out.append(line)
        if rng.random() < 1 / every:
            out.append(json.dumps({"op": "collect"}))
    return "\n".join(out) + "\n"


def with_reads(text: str, seed: int, every: int = 12) -> str:
    """``text`` with the runtime's ``read`` instruction (``.tolist()``, ``repr`` of a tensor) of live handles at
    random points: the core brings an evicted tensor back there, without pinning it."""
    rng = random.Random(f"read/{seed}")
    lines = text.splitlines()
    out, live = lines[:1], []
    for line in lines[1:]:
        out.append(line)
        rec = json.loads(line)
        if rec["op"] in ("constant", "copy"):
            live.append(rec.get("id", rec.get("dst")))
        elif rec["op"] == "call":
            live += rec["outputs"]
        elif rec["op"] == "release":
            live.remove(rec["id"])
        if live and rng.random() < 1 / every:
            out.append(json.dumps({"op": "read", "id": rng.choice(live)}))
    return "\n".join(out) + "\n"
