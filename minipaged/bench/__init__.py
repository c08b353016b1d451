"""Benchmarks: the serving factorial (serving.py on baselines.py), the machine's ceilings
(hardware.py), simulated runs for pictures (simulate.py) and, on a GPU, the kernels (kernels.py)."""


def text_table(rows: list, *, rule: bool = False, min_width: int = 0) -> list[str]:
    """Rows of text cells as aligned lines, what every bench's table prints: the first column
    left-justified, the others right-justified, each column as wide as its widest cell (the
    right-justified ones at least ``min_width``), two spaces between; ``rule``: a line of dashes
    under the first row (the header)."""
    w = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    w = [x if i == 0 else max(x, min_width) for i, x in enumerate(w)]
    lines = ["  ".join(c.rjust(w[i]) if i else c.ljust(w[i]) for i, c in enumerate(r)) for r in rows]
    if rule:
        lines.insert(1, "  ".join("-" * x for x in w))
    return lines


def off_on_rows(off: dict, on: dict, figures: list) -> list[tuple[str, str, str]]:
    """A feature off vs on, as table rows: ``(label, off[key], on[key])`` for each
    ``(label, key, format spec)`` of ``figures``, both formatted by the spec."""
    return [(label, format(off[key], spec), format(on[key], spec)) for label, key, spec in figures]


def save_run(res: dict, args, path=None) -> None:
    """Record the command's arguments in ``res`` and, given ``path`` (default ``args.json``),
    write ``res`` there as JSON, saying so: what every ``minipaged bench ...`` command ends with."""
    import json
    from pathlib import Path

    res["arguments"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                        if not k.startswith("_") and not callable(v)}
    path = path if path is not None else getattr(args, "json", None)
    if path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(res, indent=1) + "\n", encoding="utf-8")
        print(f"wrote {path}")
