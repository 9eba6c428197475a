"""`hlo-inspect FILE.txt [--json]`: the kernel-by-kernel report of a saved optimized HLO text file.

    python -c "import jax; print(jax.jit(f).lower(x).compile().as_text())" > f.hlo.txt
    hlo-inspect f.hlo.txt
    hlo-inspect f.hlo.txt --json > f.report.json
    hlo-inspect DUMP_DIR        # a folder XLA_FLAGS=--xla_dump_to=DUMP_DIR wrote: its one optimized module

Pure Python: no JAX needed. Malformed text exits with status 2 and one message naming the line that could not
be read; so do a file that is not text and an HTML path that cannot be written (its folder is made when missing).
An unexpected error (a bug) prints one line and exits with status 1; JAXFUSE_TRACEBACK=1 shows its traceback.
"""

from __future__ import annotations

import os
import sys

from absl import flags

from hlo_inspect.parser import HloParseError
from hlo_inspect.report import from_text

USAGE = ("usage: hlo-inspect FILE.txt [--json] [--html OUT.html]  (FILE '-' reads standard input; a folder of "
         "XLA dumps, its optimized module)")


def _flags() -> flags.FlagValues:
    fv = flags.FlagValues()
    flags.DEFINE_bool("json", False, "Print the report as JSON (schema hlo_inspect.report/1).", flag_values=fv)
    flags.DEFINE_string("html", None, "Also write a self-contained HTML report to this path.", flag_values=fv)
    return fv


def main(argv: list[str]) -> int:
    """Parse `argv` (without the program name), print the report; returns the exit status."""
    fv = _flags()
    if any(a in ("-h", "--help", "-help", "--helpfull") for a in argv):
        print(__doc__.strip() + "\n\nflags:\n" + fv.get_help())
        return 0
    try:
        rest = fv(["hlo-inspect"] + list(argv))[1:]
    except flags.Error as e:
        print(f"hlo-inspect: {e}\n{USAGE}", file=sys.stderr)
        return 2
    if len(rest) != 1:
        print(f"hlo-inspect: expected one HLO text file, got {len(rest)}\n{USAGE}", file=sys.stderr)
        return 2
    path = rest[0]
    try:
        return _report(path, fv.json, fv.html)
    except Exception as e:  # noqa: BLE001 - anything else is a bug: one line, the traceback on request
        if os.environ.get("JAXFUSE_TRACEBACK"):
            raise
        print(f"hlo-inspect: {path}: internal error {type(e).__name__}: {e}\n(a bug in hlo_inspect; set "
              "JAXFUSE_TRACEBACK=1 for the traceback)", file=sys.stderr)
        return 1


def _report(path: str, as_json: bool, html_path: str | None) -> int:
    """Read, parse and print; returns the exit status (2 for input that cannot be read)."""
    if html_path:
        folder = os.path.dirname(os.path.abspath(html_path))
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError as e:
            print(f"hlo-inspect: cannot write the HTML report to {html_path}: {e.strerror} ({folder})",
                  file=sys.stderr)
            return 2
    if path != "-" and os.path.isdir(path):
        path = _dump_in(path)
        if path is None:
            return 2
    try:
        if path == "-":
            data = sys.stdin.buffer.read()
        else:
            with open(path, "rb") as f:
                data = f.read()
    except OSError as e:
        print(f"hlo-inspect: cannot read {path}: {e.strerror}", file=sys.stderr)
        return 2
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        print(f"hlo-inspect: {path}: not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}): expected the "
              "HLO text of a compiled program, `jax.jit(f).lower(*args).compile().as_text()`", file=sys.stderr)
        return 2
    try:
        report = from_text(text, title=path)
    except HloParseError as e:
        print(f"hlo-inspect: {path}: {e}", file=sys.stderr)
        return 2
    if html_path:
        try:
            report.to_html(html_path)
        except OSError as e:
            print(f"hlo-inspect: cannot write the HTML report to {html_path}: {e.strerror}", file=sys.stderr)
            return 2
    print(report.to_json() if as_json else report.table())
    return 0


def _dump_in(folder: str) -> str | None:
    """The one optimized module XLA dumped into ``folder``, or None after saying why there is not one."""
    from hlo_inspect.passes import optimized_dumps

    try:
        dumps = optimized_dumps(folder)
    except OSError as e:
        print(f"hlo-inspect: cannot read the folder {folder}: {e.strerror}", file=sys.stderr)
        return None
    if len(dumps) == 1:
        print(f"hlo-inspect: {folder} holds one optimized module: {os.path.basename(dumps[0])}", file=sys.stderr)
        return dumps[0]
    if not dumps:
        print(f"hlo-inspect: {folder} is a folder without an optimized module (module_*.*after_optimizations.txt, "
              f"as XLA_FLAGS=--xla_dump_to={folder} writes them): pass an HLO text file", file=sys.stderr)
        return None
    listed = "\n".join(f"  {d}  ({os.path.getsize(d):,} bytes)" for d in dumps[:20])
    more = f"\n  ... and {len(dumps) - 20} more" if len(dumps) > 20 else ""
    print(f"hlo-inspect: {folder} holds {len(dumps)} optimized modules; pass one of them:\n{listed}{more}",
          file=sys.stderr)
    return None


def run() -> None:
    """Console-script entry point."""
    import signal

    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `... | head` ends quietly
    sys.exit(main(sys.argv[1:]))


if __name__ == "__main__":
    run()
