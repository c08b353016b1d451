"""Benchmarks: the serving factorial (serving.py on baselines.py), the machine's ceilings
(hardware.py), simulated runs for pictures (simulate.py) and, on a GPU, the kernels (kernels.py)."""


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
