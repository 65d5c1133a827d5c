"""What a sharded program moves between devices, read off its text: the collectives of a compiled (optimized) HLO
module, the outputs it writes in place of donated inputs, and what the main function of a lowered StableHLO module does
outside its shard_map (tests/test_parallel.py, scripts/shard_hlo.py)."""

from __future__ import annotations

import collections
import re

COLLECTIVES = ("all-reduce", "all-gather", "all-to-all", "collective-permute", "reduce-scatter")
# an instruction's result shape and op: `%name = f32[1,64]{1,0} all-reduce(` (an async pair's `-start` counted once)
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%\S+ = (\S+) ([a-z][\w-]*?)(?:-start)?\(", re.M)


def collectives(hlo: str) -> dict[str, list[str]]:
    """Each kind of collective in an optimized HLO module's text -> the result shapes of its instructions, in program
    order (`f32[1,5120]`); kinds absent are left out."""
    out: dict[str, list[str]] = collections.defaultdict(list)
    for shape, op in _INSTRUCTION.findall(hlo):
        if op in COLLECTIVES:
            out[op].append(shape.split("{")[0])
    return dict(out)


def aliased_outputs(hlo: str) -> int:
    """How many outputs of a compiled HLO module reuse a (donated) input's buffer: its `input_output_alias` entries."""
    header = hlo.split("\n", 1)[0]  # HloModule NAME, ..., input_output_alias={ {0}: (53, {}, may-alias), ... }, ...
    return len(re.findall(r"\{[\d,]*\}: \(\d+, \{[\d,]*\}, (?:may|must)-alias\)", header))


def _lines_of_main(mlir: str) -> list[str]:
    lines = mlir.splitlines()
    start = next(i for i, line in enumerate(lines) if "func.func public @main(" in line)
    end = next(i for i in range(start + 1, len(lines)) if lines[i] == "  }")
    return lines[start:end]


def outside_shard_map(mlir: str) -> collections.Counter:
    """The ops of a lowered StableHLO module's main function outside its one `sdy.manual_computation` (the shard_map):
    op name -> count. Constants aside, each is work or data movement the SPMD partitioner places (on the global
    arrays: a reshard, a gather of a sharded argument)."""
    main = _lines_of_main(mlir)
    begin = next(i for i, line in enumerate(main) if "sdy.manual_computation" in line)
    end = next(i for i in range(begin, len(main)) if re.match(r"\s*\} : \(", main[i]))
    ops = collections.Counter()
    for line in main[1:begin] + main[end + 1:]:
        op = re.search(r"= (\"?[\w.]+\"?)", line) if "=" in line else re.match(r"\s*([\w.]+)", line)
        if op:
            ops[op.group(1).strip('"')] += 1
    return ops


def resharded_arguments(mlir: str) -> list[str]:
    """The arguments of a lowered StableHLO module's main function that enter its shard_map with another sharding
    than they come in with (each one moved or copied between devices at every call), as `%argN: SHAPE: from -> to`;
    an argument without a sharding annotation (one JAX may place as it likes) is left out."""
    main = _lines_of_main(mlir)
    signature = main[0].split("@main(", 1)[1].split(") -> (")[0]
    shardings = {}
    for arg in re.split(r", (?=%arg\d+: )", signature):
        name = arg.split(":")[0]
        found = re.search(r"#sdy.sharding<@\w+, (\[.*?\])>", arg)
        shardings[name] = (re.search(r"tensor<([^>]*)>", arg).group(1), found.group(1) if found else None)
    call = next(line for line in main if "sdy.manual_computation" in line)
    operands = re.search(r"manual_computation\((.*?)\) in_shardings", call).group(1).split(", ")
    specs = re.findall(r"<@\w+, (\[[^>]*?\])>", re.search(r"in_shardings=\[(.*?)\] out_shardings", call).group(1))
    moved = []
    for operand, spec in zip(operands, specs):
        shape, came = shardings.get(operand, (None, None))
        if came is not None and came != spec:
            moved.append(f"{operand}: {shape}: {came} -> {spec}")
    return moved
