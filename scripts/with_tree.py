"""Time two versions of the kernels side by side: run a script against another commit's flashformer package.

A device machine's copy of the repository may carry a stale git history, so the other commit's package is exported
where git has it and travels as an untracked folder; on the device the script runs with that folder's package first
on the import path (the editable install's finder is taken off it):

    python3 scripts/with_tree.py export 4b711c0 .gpu/trees/4b711c0      # here: writes the folder
    python3 scripts/with_tree.py run .gpu/trees/4b711c0 scripts/bench_gluon_backward.py --head-dims 128   # device

The script itself comes from the working tree, so both versions are timed by the same code.
"""

from __future__ import annotations

import argparse
import os
import runpy
import shutil
import subprocess
import sys
import tarfile
import tempfile

PACKAGE_DIRS = {"flashformer": "flashformer", "kernels": os.path.join("flashformer", "kernels")}


def export(commit, dest, repo="."):
    """Write ``commit``'s flashformer package (kernels/ inside it, as pyproject.toml installs it) under ``dest``."""
    if os.path.exists(dest):
        raise SystemExit(f"export: {dest} exists; remove it or pick another folder")
    with tempfile.TemporaryDirectory() as scratch:
        archive = os.path.join(scratch, "tree.tar")
        subprocess.run(["git", "-C", repo, "archive", "--format=tar", "-o", archive, commit, *PACKAGE_DIRS],
                       check=True)
        with tarfile.open(archive) as tar:
            tar.extractall(os.path.join(scratch, "tree"), filter="data")
        staged = os.path.join(scratch, "staged")
        for source, target in PACKAGE_DIRS.items():
            shutil.copytree(os.path.join(scratch, "tree", source), os.path.join(staged, target))
        shutil.move(staged, dest)


def run(tree, script, script_args):
    """Run ``script`` as __main__ with ``tree``'s flashformer package imported instead of the installed one."""
    if not os.path.isfile(os.path.join(tree, "flashformer", "kernels", "__init__.py")):
        raise SystemExit(f"run: {tree} holds no flashformer package with its kernels (see `export`)")
    sys.meta_path[:] = [finder for finder in sys.meta_path if "editable" not in repr(finder).lower()]
    sys.path[:0] = [os.path.abspath(tree), os.path.dirname(os.path.abspath(script))]
    sys.argv = [script, *script_args]
    runpy.run_path(script, run_name="__main__")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    export_parser = commands.add_parser("export", help="write a commit's package into a folder")
    export_parser.add_argument("commit")
    export_parser.add_argument("dest")
    run_parser = commands.add_parser("run", help="run a script against an exported package")
    run_parser.add_argument("tree")
    run_parser.add_argument("script")
    run_parser.add_argument("script_args", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    if args.command == "export":
        export(args.commit, args.dest)
    else:
        run(args.tree, args.script, args.script_args)


if __name__ == "__main__":
    main()
