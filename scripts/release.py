#!/usr/bin/env python
"""Make a release: what `make release` runs (docs/release.md).

    python scripts/release.py              check, stamp, build dist/, tag v<version>, print how to publish
    python scripts/release.py --dry-run    the checks only: say what would happen, change nothing

The repository URL and the tag live in minipaged/colab.py (REPO_URL, RELEASE); the version in
minipaged/__init__.py (pyproject.toml reads it). Steps, each stopping with a message on failure:

1. the tree is clean (git status shows nothing) and the tests passed on this very commit:
   `make test` writes build/tests-passed with the commit it tested;
2. the install cells (scripts/stamp_colab.py, then scripts/make_exercises.py) and the README's
   badges (scripts/update_readme.py) are stamped with the release; a change is committed;
3. the wheel and the sdist are built into dist/ (setuptools, no network);
4. the commit is tagged v<version> (annotated); a tag already on another commit stops it;
5. the commands that publish are printed; nothing is pushed or uploaded.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
STAMP = ROOT / "build" / "tests-passed"


def git(*args: str, check: bool = True) -> str:
    r = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
    if check and r.returncode != 0:
        raise SystemExit(f"release: git {' '.join(args)} failed: {r.stderr.strip()}")
    return r.stdout.strip()


def fail(msg: str) -> None:
    raise SystemExit(f"release: {msg}")


def run(*args: str) -> None:
    r = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True)
    if r.returncode != 0:
        fail(f"{' '.join(args)} failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="check only; change nothing")
    a = ap.parse_args(argv)
    from minipaged import __version__
    from minipaged.colab import RELEASE, REPO_URL

    dirty = git("status", "--porcelain")
    if dirty:
        fail("the tree is not clean; commit or stash first:\n" + dirty)
    head = git("rev-parse", "HEAD")
    tested = STAMP.read_text().split()[0] if STAMP.is_file() and STAMP.read_text().strip() else None
    if tested != head:
        fail(f"the tests have not passed on this commit ({head[:12]}): run `make test` first "
             f"({'build/tests-passed is missing' if tested is None else 'it last passed on ' + tested[:12]})")
    existing = git("rev-parse", "-q", "--verify", f"refs/tags/{RELEASE}^{{commit}}", check=False)
    print(f"release {RELEASE} of {REPO_URL}: tree clean, tests passed on {head[:12]}")
    if a.dry_run:
        print(f"dry run: would stamp, build dist/minipaged-{__version__}-py3-none-any.whl and .tar.gz, tag {RELEASE}")
        return 0

    run("scripts/stamp_colab.py")
    run("scripts/make_exercises.py")
    run("scripts/update_readme.py")
    changed = git("status", "--porcelain")
    if changed:
        # only the install cells, the exercises made from them and the README's blocks may change
        allowed = ("notebooks/", "solutions/", "exercises/", "README.md")
        stray = [ln for ln in changed.splitlines() if not ln[3:].startswith(allowed)]
        if stray:
            fail("stamping changed files it should not have:\n" + "\n".join(stray))
        git("add", "-A", "notebooks", "solutions", "exercises", "README.md")
        git("commit", "-q", "-m", f"Release {RELEASE}: install cells and badges point at {RELEASE}")
        print(f"stamped and committed: {len(changed.splitlines())} file(s)")
    head = git("rev-parse", "HEAD")
    if existing and existing != head:
        fail(f"tag {RELEASE} already exists on {existing[:12]}, not on {head[:12]}: bump __version__ in minipaged/__init__.py")

    dist = ROOT / "dist"
    dist.mkdir(exist_ok=True)
    for old in dist.glob(f"minipaged-{__version__}*"):
        old.unlink()
    run("-c", "from setuptools import build_meta as b; b.build_sdist('dist'); b.build_wheel('dist')")
    built = sorted(p.name for p in dist.glob(f"minipaged-{__version__}*"))
    if len(built) != 2:
        fail(f"expected a wheel and an sdist in dist/, found {built}")
    if not existing:
        git("tag", "-a", RELEASE, "-m", f"minipaged {__version__}")
    print(f"built: {', '.join('dist/' + b for b in built)}; tagged {RELEASE} at {head[:12]}")
    wheel = next(b for b in built if b.endswith(".whl"))
    print(f"""
To publish (nothing has been pushed or uploaded):
  git push origin HEAD {RELEASE}
  gh release create {RELEASE} dist/{wheel} dist/{next(b for b in built if b.endswith('.tar.gz'))} --title "minipaged {__version__}" --notes "See docs/release.md"
Then open a badge ({REPO_URL.removeprefix('https://')}, tag {RELEASE}) in Colab and run its first cell.""")
    return 0


if __name__ == "__main__":
    sys.exit(main())
