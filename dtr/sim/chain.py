"""The linear-chain toy model (simrd section 5.1, Algorithm 3) as a v1 log.

n forward layers ``t_i = f(t_{i-1})`` and n+1 gradient steps
``g_{i} = b(t_i, g_{i+1})``, unit sizes and costs; each forward tensor is
released right after its gradient step consumed it (Algorithm 3's ``ts.pop()``),
each gradient as soon as the next one exists. Base compute is 2n + 1.
"""
from __future__ import annotations

import json
import math
import re

__all__ = ["chain_log", "chain_budget", "MAX_CHAIN"]

#: The longest chain the command line builds (its log is held in memory).
MAX_CHAIN = 1_000_000


def chain_log(n: int, size: int = 1, cost: float = 1) -> str:
    """The v1 log of an n-layer chain's forward and backward pass.

    Raises:
        ValueError: n < 1.
    """
    if n < 1:
        raise ValueError(f"the chain needs at least one layer (got n={n})")
    dump = json.dumps
    lines = [dump({"op": "meta", "version": 1, "cost_unit": "unit", "model": "chain", "n": n})]

    def call(name, inputs, out):
        lines.append(dump({"op": "call", "name": name, "inputs": inputs, "outputs": [out],
                           "sizes": [size], "aliases": [None], "cost": cost}))

    call("f", [], "t1")
    for i in range(2, n + 1):
        call("f", [f"t{i-1}"], f"t{i}")
    call("b", [f"t{n}"], f"g{n}")
    for j in range(1, n + 1):
        lines.append(dump({"op": "release", "id": f"t{n - j + 1}"}))
        k = n - j
        call("b", ([f"t{k}"] if k >= 1 else []) + [f"g{k + 1}"], f"g{k}")
        lines.append(dump({"op": "release", "id": f"g{k + 1}"}))
    return "\n".join(lines) + "\n"


def chain_budget(n: int, spec: str | int) -> int:
    """Budget in tensors: ``sqrt`` = ceil(2 sqrt n), ``log`` = ceil(log2 n), or a whole number.

    Raises:
        ValueError: an unknown spec, or a number past 2^63 - 1.
    """
    if isinstance(spec, int) or re.fullmatch(r"\s*[0-9]+\s*", str(spec)):
        budget = int(spec)
        if not 0 <= budget <= 2**63 - 1:
            raise ValueError(f"chain budget {spec} is out of range (0 to 2^63 - 1 unit tensors)")
        return budget
    if spec == "sqrt":
        return math.ceil(2 * math.sqrt(n))
    if spec == "log":
        return math.ceil(math.log2(n))
    raise ValueError(f"unknown chain budget {spec!r} (valid: sqrt, log, or a number of tensors)")
