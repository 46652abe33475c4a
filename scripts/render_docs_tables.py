"""Write the tables the docs take from the code, so the docs cannot drift from it.

    python scripts/render_docs_tables.py           # rewrite every generated block in README.md and docs/
    python scripts/render_docs_tables.py --check   # exit 1, naming each stale block, and change nothing

A generated block is the text between ``<!-- BEGIN generated: KEY -->`` and ``<!-- END generated: KEY -->``;
KEY is one of :data:`TABLES`: ``names`` (the registry's specs), ``options`` (every option: the shared ones and each
family's own, ``hf_efficient.registry.all_options()``, crossed with the names that take each option) and ``distributed`` (what each
name and backend does under DDP, FSDP and DeepSpeed: the registry facts the distributed checks refuse by; FSDP2
"yes" only where the FSDP2 tests run the name) and
``plugin`` (the accelerate plugin's fields, from the dataclass).
tests/test_docs.py runs the check.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hf_efficient.registry import PREFIX, SPECS, all_options  # noqa: E402

BLOCK = re.compile(r"(<!-- BEGIN generated: (\w+) -->\n)(.*?)(<!-- END generated: \2 -->)", re.S)
_DEVICE = {"cuda": "CUDA", "default": "other devices"}


def _code(text) -> str:
    return f"`{text}`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _backends(spec) -> str:
    """Backends in preference order per device type, those used only when forced, and any fallback name."""
    if not spec.backends:
        return "—"
    if len(spec.prefer) == 1:
        parts = [" > ".join(map(_code, spec.prefer["default"]))]
    else:
        parts = [f"{_DEVICE.get(dev, dev)}: {' > '.join(map(_code, order))}" for dev, order in spec.prefer.items()]
    preferred = {b for order in spec.prefer.values() for b in order}
    forced = [b for b in spec.backends if b not in preferred]
    if forced:
        parts.append("only when forced: " + ", ".join(map(_code, forced)))
    if spec.fallback:
        device, other = spec.fallback
        parts.append(f"needs {_DEVICE.get(device, device)}; elsewhere runs `{PREFIX}{other}`")
    return "; ".join(parts)


def names_table() -> str:
    rows = ["| Trainer name (short name) | family | state bytes / param | backends, in preference order | notes |",
            "|---|---|---|---|---|"]
    for spec in SPECS.values():
        rows.append(f"| `{spec.trainer_name}` (`{spec.name}`) | {spec.family} | {_cell(spec.bytes_label)} | "
                    f"{_backends(spec)} | {_cell(spec.notes)} |")
    return "\n".join(rows)


def _takers(key: str) -> str:
    names = [s.name for s in SPECS.values() if key in s.options]
    if len(names) == len(SPECS):
        return "all"
    if len(names) == len(SPECS) - 1:
        (left,) = set(SPECS) - set(names)
        return f"all but `{left}`"
    return ", ".join(map(_code, names))


def _shown(value) -> str:
    return "none" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def _values(option) -> str:
    if option.choices:
        values = " / ".join(map(_code, option.choices))
    elif option.type is bool:
        values = "`true` / `false`"
    else:
        values = {int: "an integer", float: "a number", str: "text"}[option.type]
        values += f", {option.check_text}" if option.check_text else ""
    if option.optional and "none" not in option.choices:
        values += " or `none`"
    return values


def options_table() -> str:
    rows = ["| key | names | values | default | what it does |", "|---|---|---|---|---|"]
    for option in all_options().values():
        rows.append(f"| `{option.name}` | {_takers(option.name)} | {_values(option)} | `{_shown(option.default)}` | "
                    f"{_cell(option.help)} |")
    return "\n".join(rows)


def fsdp2_tested() -> set[tuple[str, str]]:
    """(name, backend) of what the FSDP2 tests run: the names tests/cases.py's ``shardable`` query gives them (they
    parametrize over it: tests/test_docs.py checks), each on its torch backend (what they resolve on CPU)."""
    sys.path.insert(0, str(ROOT / "tests"))
    import cases

    return {(name, "torch") for name in cases.plain(cases.names(cases.shardable, cases.packaged))}


def distributed_table() -> str:
    rows = ["| name (backend) | DDP | FSDP2 | FSDP1 | DeepSpeed ZeRO 1, 2, 3 |", "|---|---|---|---|---|"]
    tested = fsdp2_tested()
    fsdp1 = "refused: use FSDP2"  # FSDP1 hands the optimizer flattened parameters: no shapes, names or groups
    for spec in SPECS.values():
        if not spec.backends:  # auto: sized per rank under FSDP2; ZeRO steps flat partitions, so it is refused there
            rows.append(f"| `{spec.trainer_name}` | yes | yes: sized per rank, among the names marked yes | {fsdp1} | "
                        "refused: name the optimizer |")
            continue
        facts = spec.facts
        if facts.deepspeed:
            zero = f"refused: {facts.deepspeed}"
        elif facts.deepspeed_options:
            zero = "yes, with " + ", ".join(f"`{k}={v}`" for k, (v, _) in facts.deepspeed_options.items())
        else:
            zero = "yes"
        for name, backend in spec.backends.items():
            if backend.fsdp2:
                fsdp2 = f"refused: {backend.fsdp2}"
            elif (spec.name, name) not in tested:
                forced = " only when forced (never chosen automatically: see Reliability)," if backend.flaw else ""
                fsdp2 = f"not refused,{forced} but no FSDP2 test runs it"
            else:
                fsdp2 = ("yes: steps Shard(0) shards on a 1-D mesh, state as DTensors (shown by "
                         "tests/test_fsdp2_integrations.py, which trains every name marked yes here in the Trainer and "
                         "in an accelerate loop, and tests/test_fsdp2.py)")
            rows.append(f"| `{spec.trainer_name}` ({name}) | yes | {_cell(fsdp2)} | {fsdp1} | {_cell(zero)} |")
    return "\n".join(rows)


def plugin_table() -> str:
    from dataclasses import fields

    from hf_efficient.integrations.plugin import EfficientOptimPlugin

    rows = ["| field | variable | default | what it is |", "|---|---|---|---|"]
    for f in fields(EfficientOptimPlugin):
        if "default" not in f.metadata:  # config_file: the file itself, not a value in it
            continue
        help_text = f.metadata["help"].removesuffix(f" (default: {f.metadata['default']!r})")
        rows.append(f"| `{f.name}` | `HF_EFF_{f.name.upper()}` | `{_shown(f.metadata['default'])}` | "
                    f"{_cell(help_text)} |")
    return "\n".join(rows)


TABLES = {"names": names_table, "options": options_table, "distributed": distributed_table, "plugin": plugin_table}


def doc_files() -> list[Path]:
    """README.md and the guide's pages (results pages are written by their own scripts)."""
    return [ROOT / "README.md"] + sorted(p for p in (ROOT / "docs").rglob("*.md") if "results" not in p.parts)


def render(text: str, where: str = "text") -> str:
    """``text`` with every generated block rewritten; an unknown KEY raises, naming it and ``where``."""
    def block(m: re.Match) -> str:
        if m.group(2) not in TABLES:
            raise ValueError(f"{where}: unknown generated block {m.group(2)!r}; known: {', '.join(TABLES)}")
        return f"{m.group(1)}{TABLES[m.group(2)]()}\n{m.group(4)}"

    return BLOCK.sub(block, text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="report stale blocks, write nothing")
    args = parser.parse_args(argv)
    stale = []
    for path in doc_files():
        text = path.read_text(encoding="utf-8")
        new = render(text, str(path.relative_to(ROOT)))
        if new != text:
            stale.append(str(path.relative_to(ROOT)))
            if not args.check:
                path.write_text(new, encoding="utf-8")
    verb = "stale (run python scripts/render_docs_tables.py)" if args.check else "rewritten"
    for name in stale:
        print(f"{name}: {verb}")
    return 1 if stale and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
